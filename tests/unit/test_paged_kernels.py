"""The one-launch Triton gathers and scatters across layers (kvedit.vllm.paged_kernels) move
the same bytes as PagedKV's per-layer indexing ops. CUDA is not here: the kernels run in
Triton's interpreter (TRITON_INTERPRET=1, on CPU tensors laid out as vLLM's CUDA caches),
in a fresh interpreter since Triton reads that variable when a kernel is defined."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from kvedit.vllm.paged import PagedKV

def layers(L, B, H, N, hd, dtype, nhd):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(L):  # separate allocations, as vLLM 0.26 makes them
        if nhd:  # physical [B, N, H, 2hd] seen as the logical [B, H, N, 2hd]
            t = torch.randn(B, N, H, 2 * hd, generator=g).to(dtype).permute(0, 2, 1, 3)
        else:
            t = torch.randn(B, H, N, 2 * hd, generator=g).to(dtype)
        out.append(t)
    return out

for dtype in (torch.bfloat16, torch.float32, torch.float16):
    for nhd in (False, True):
        L, B, H, N, hd = 3, 6, 2, 16, 8
        mine = layers(L, B, H, N, hd, dtype, nhd)
        theirs = [t.clone() for t in mine]
        p = PagedKV(mine, "cuda", hd, 32)
        ref = PagedKV(theirs, "cuda", hd, 32)
        assert p.table is not None and len(p.groups) == L
        ref.table = None                    # the per-layer ops
        ids, pos = [2, 0, 1], torch.tensor([0, 5, 31, 40, 63, 17, 32])
        got = torch.empty(2, L, pos.numel(), H * hd, dtype=dtype)
        want = torch.empty_like(got)
        p.gather(p.slots_at(ids, pos), got)
        ref.gather(ref.slots_at(ids, pos), want)
        assert torch.equal(got, want), ("gather", dtype, nhd)
        assert not torch.equal(got[0], got[1])  # K and V are told apart
        src = torch.randn(2, L, pos.numel(), H * hd).to(dtype)
        p.scatter(p.slots_at(ids, pos), src)
        ref.scatter(ref.slots_at(ids, pos), src)
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b), ("scatter", dtype, nhd)
        # a non-contiguous destination takes the per-layer ops and agrees too
        wide = torch.empty(2, L, pos.numel(), 2 * H * hd, dtype=dtype)[..., : H * hd]
        p.gather(p.slots_at(ids, pos), wide)
        assert torch.equal(wide, src)
print("ok")
"""


@pytest.mark.slow  # the Triton interpreter runs the kernels on the CPU: ~13 s
def test_one_launch_kernels_move_what_the_per_layer_ops_move():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
