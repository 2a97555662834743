"""The low findings of an outside red-team run, against real server processes: a message
nested deep, the listen backlogs, the help of the watch options.

Reproductions: a Hello with an unknown field nested 100,000 arrays deep made the decoder
raise RecursionError, answered `internal` with a traceback in the log per message (a peer
could fill the disk); the HTTP listener took the backlog uvicorn gave it (2,048) and the
data link Python's default (128), so a user churning connections could fill the accept
queue and delay everyone's connect by SYN retransmits; three watch options' help said
"seconds" for MiB and a rate. Here a nested message is `malformed` with no traceback (and
internal errors log a traceback at most every 10 s), both listeners take the kernel's cap
(net.core.somaxconn), and each option names its unit.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvedit import protocol as P
from kvedit.client import KVClient
from kvedit.launch.server import start_server
from tests.fixtures_server import close_dealer, dealer

DEEP = b"\x91" * 100_000 + b"\xc0"   # [[[[...[nil]...]]]]


def test_a_deeply_nested_message_is_malformed_without_a_traceback():
    with start_server(0.01) as s:
        d = dealer(s.url)
        try:
            hello = b"\x83\xa1t\xa5hello\xa8protocol" + bytes([P.PROTOCOL]) + b"\xa1x" + DEEP
            codes = []
            for i in range(20):
                d.send_multipart([i.to_bytes(2, "big"), hello])
                codes.append(P.reply_decoder.decode(d.recv_multipart()[1]))
            assert all(r.code == "malformed" for r in codes), codes[0]   # was internal
            with KVClient(s.url) as c:   # and the server goes on
                assert c.server_info().protocol == P.PROTOCOL
        finally:
            close_dealer(d)
        log = s.log()
    assert "Traceback" not in log and "RecursionError" not in log.split("malformed")[0]


def _somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn") as f:
        return int(f.read())


def test_the_listeners_take_the_kernels_backlog():
    with start_server(0.01) as s, KVClient(s.url) as c:
        ports = {s.http_port, c.server_info().data_port}
        out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        pytest.skip("no ss here")
    backlogs = {int(line.split()[2]) for line in out.stdout.splitlines()
                if any(line.split()[3].endswith(f":{p}") for p in ports)}
    assert backlogs == {_somaxconn()}, backlogs   # was {2048, 128}


def test_the_watch_options_name_their_units():
    out = subprocess.run([sys.executable, "-m", "kvedit.server.cli", "--help"],
                         capture_output=True, text=True, timeout=60).stdout
    flat = " ".join(out.split())
    for flag, unit in (("--watch-queue-mb WATCH_QUEUE_MB", "MiB"),
                       ("--watch-queue-total-mb WATCH_QUEUE_TOTAL_MB", "MiB"),
                       ("--watch-subscribes-per-min WATCH_SUBSCRIBES_PER_MIN", "a rate"),
                       ("--watch-slice-ms WATCH_SLICE_MS", "milliseconds")):
        help_text = flat.split(flag, 2)[2].split(" --", 1)[0].strip()   # past the usage
        assert help_text.startswith(unit), (flag, help_text[:60])
