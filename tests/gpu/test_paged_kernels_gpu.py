"""On a GPU: the one-launch Triton gathers and scatters (kvedit.vllm.paged_kernels) serve
per-layer CUDA caches and move what the per-layer ops move, and cost less host time (printed, not asserted; the
reason they exist: an in-engine compaction issued one op per K/V and layer). Skips without
CUDA and Triton; tests/unit/test_paged_kernels.py checks the same on the CPU in Triton's
interpreter."""
import time

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _layers(L, B, H, N, hd, dtype, nhd):
    out = []
    for _ in range(L):  # one allocation per layer, as vLLM 0.26 makes them
        shape = (B, N, H, 2 * hd) if nhd else (B, H, N, 2 * hd)
        t = torch.randn(shape, device="cuda").to(dtype)
        out.append(t.permute(0, 2, 1, 3) if nhd else t)
    return out


@pytest.mark.parametrize("nhd", [False, True])
def test_kernels_match_the_per_layer_ops_on_cuda(nhd):
    from kvedit.vllm.paged import PagedKV

    L, B, H, N, hd = 36, 64, 8, 16, 128
    mine = _layers(L, B, H, N, hd, torch.bfloat16, nhd)
    theirs = [t.clone() for t in mine]
    p, ref = PagedKV(mine, "cuda", hd, 16), PagedKV(theirs, "cuda", hd, 16)
    assert p.table is not None
    ref.table = None
    ids = torch.randperm(B)[:48].tolist()
    pos = torch.randperm(48 * 16)[:700].sort().values
    got = torch.empty(2, L, 700, H * hd, dtype=torch.bfloat16, device="cuda")
    want = torch.empty_like(got)
    p.gather(p.slots_at(ids, pos), got)
    ref.gather(ref.slots_at(ids, pos), want)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    src = torch.randn_like(got, dtype=torch.float32).to(torch.bfloat16)
    p.scatter(p.slots_at(ids, pos), src)
    ref.scatter(ref.slots_at(ids, pos), src)
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(mine, theirs))

    def host_time(paged):
        slots = paged.slots_at(ids, pos)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            paged.gather(slots, got)
            paged.scatter(slots, got)
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        return host / 20

    kernel, ops = host_time(p), host_time(ref)
    print(f"host time per gather+scatter, 36 layers x 700 tokens: kernels {kernel * 1e3:.2f} "
          f"ms, per-layer ops {ops * 1e3:.2f} ms")
