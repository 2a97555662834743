"""kvedit.sdk.tp: gathering the ranks' KV into one tensor for an edit and scattering it back.

Pure tensor functions, so this runs on the CPU. The rank tensors are cut from a full KV the
way vLLM's QKVParallelLinear assigns heads (written out per case below, not derived from the
module under test). The two-GPU test (TP=2 decode after an edit == TP=1) needs the two-GPU
machine and the SDK hook (docs/gpu.md).
"""
from __future__ import annotations

import pytest
import torch

from kvedit.layout import ModelLayout
from kvedit.sdk.tp import TPHeads, gather_ranks, scatter_ranks, tp_heads

D = 4

# (tp_size, total KV heads) -> the global heads each rank holds, as vLLM assigns them
VLLM_SPLIT = {
    (1, 2): [[0, 1]],
    (2, 8): [[0, 1, 2, 3], [4, 5, 6, 7]],
    (4, 8): [[0, 1], [2, 3], [4, 5], [6, 7]],
    (4, 2): [[0], [0], [1], [1]],   # 4 ranks, 2 heads: each head on 2 ranks
    (8, 2): [[0]] * 4 + [[1]] * 4,
    (2, 1): [[0], [0]],
}


def full_kv(heads: int, layers: int = 3, tokens: int = 5, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, layers, tokens, heads * D, generator=g)


def cut(kv: torch.Tensor, heads: list[int]) -> torch.Tensor:
    return torch.cat([kv[..., h * D:(h + 1) * D] for h in heads], dim=-1)


@pytest.mark.parametrize("tp,total", sorted(VLLM_SPLIT))
def test_gather_then_scatter_follows_vllms_head_split(tp, total):
    heads = TPHeads(tp, total, D)
    assert [list(heads.heads_of(r)) for r in range(tp)] == VLLM_SPLIT[tp, total]
    kv = full_kv(total)
    ranks = [cut(kv, VLLM_SPLIT[tp, total][r]) for r in range(tp)]
    gathered = gather_ranks(ranks, heads)
    assert torch.equal(gathered, kv)
    # An edit that drops tokens and changes values: each rank gets its heads of the result.
    edited = gathered[:, :, [0, 2, 4]] * 2 + 1
    back = scatter_ranks(edited, heads)
    assert len(back) == tp
    for r in range(tp):
        assert torch.equal(back[r], cut(edited, VLLM_SPLIT[tp, total][r]))


def test_scatter_returns_views_and_gather_reads_first_replica():
    heads = TPHeads(4, 2, D)
    kv = full_kv(2)
    back = scatter_ranks(kv, heads)
    assert back[0].data_ptr() == back[1].data_ptr() == kv.data_ptr()  # no copies
    ranks = [cut(kv, [0]), cut(kv, [0]) + 100, cut(kv, [1]), cut(kv, [1]) + 100]
    assert torch.equal(gather_ranks(ranks, heads), kv)  # ranks 0 and 2 are read


def test_bad_inputs_say_what_was_expected():
    with pytest.raises(ValueError, match="one to divide the other"):
        TPHeads(3, 8, D)
    with pytest.raises(ValueError, match="tp_size must be positive"):
        TPHeads(0, 8, D)
    heads = TPHeads(2, 8, D)
    with pytest.raises(ValueError, match="rank 2 outside"):
        heads.heads_of(2)
    kv = full_kv(8)
    ranks = scatter_ranks(kv, heads)
    with pytest.raises(ValueError, match="1 rank tensors for tensor parallel 2"):
        gather_ranks(ranks[:1], heads)
    with pytest.raises(ValueError, match=r"expected \[2, L, T, 16\]"):
        gather_ranks([ranks[0], ranks[1][..., :8]], heads)
    with pytest.raises(ValueError, match="differs from rank 0's"):
        gather_ranks([ranks[0], ranks[1][:, :, :2]], heads)
    with pytest.raises(ValueError, match=r"the edited KV of shape .*expected \[2, L, T, 32\]"):
        scatter_ranks(kv[..., :16], heads)


def test_tp_heads_checks_the_rank_layouts():
    def lay(rank, size=2, heads=4):
        return ModelLayout(num_layers=3, num_kv_heads=heads, head_dim=D, dtype="bfloat16",
                           chunk_size=16, tp_rank=rank, tp_size=size)

    assert tp_heads([lay(0), lay(1)], 8) == TPHeads(2, 8, D)
    with pytest.raises(ValueError, match="expected ranks 0..1"):
        tp_heads([lay(1), lay(0)], 8)
    with pytest.raises(ValueError, match=r"differs from rank 0's in \['num_kv_heads'\]"):
        tp_heads([lay(0), lay(1, heads=2)], 8)
    with pytest.raises(ValueError, match="gives 2 per rank; the layouts say 4"):
        tp_heads([lay(0), lay(1)], 4)
