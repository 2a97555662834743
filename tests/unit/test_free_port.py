"""free_port never hands one process the same port twice: CI once started a server whose
HTTP port was the data port a test had picked a moment before (both free, neither bound)."""
from kvedit.launch.server import free_port


def test_ports_handed_out_are_distinct():
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
