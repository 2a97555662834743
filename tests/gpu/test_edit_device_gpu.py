"""On a GPU: a policy with `edit_device="cuda"` (what `kvedit eval` sets on a GPU host, so a
16k-token edit is scored, gathered and re-rotated there instead of on the host's cores) keeps
the same tokens as the same policy on the CPU, and returns its edited KV and token ids on the
CPU, equal to the CPU edit's up to float rounding of the re-rotation. Every registered policy,
per token and per head, with captured queries where it needs them. Skips without CUDA;
the CPU path of the same policies: tests/unit/test_edits.py and test_per_head*.py."""
import pytest
import torch

from kvedit.edits import POLICIES
from kvedit.layout import ModelLayout, RopeParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

L, H, D, HQ, T, W = 6, 2, 64, 6, 1000, 20


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_edit_on_cuda_keeps_what_the_cpu_edit_keeps(name, per_head):
    torch.manual_seed(0)
    kv = torch.randn(2, L, T, H * D).to(torch.bfloat16)
    queries = torch.randn(L, W, HQ * D).to(torch.bfloat16)
    layout = ModelLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16",
                         chunk_size=128, rope=RopeParams(theta=1e6), num_q_heads=HQ)
    cls = POLICIES[name]
    kw = dict(ratio=0.5, granularity="token", per_head=per_head)
    # A question's rows follow the context; Expected Attention scores with the context's own
    # last rows (queries_from "context") and refuses rows outside it.
    start = T - W if getattr(cls, "queries_from", None) == "context" else T
    extra = dict(queries=queries, query_start=start) if cls.needs_queries else {}
    tokens = list(range(T))
    want_idx = cls(**kw).keep_indices(kv, layout, **extra)
    got_idx = cls(**kw, edit_device="cuda").keep_indices(kv, layout, **extra)
    assert got_idx.device.type == "cpu"
    # Scores computed in another order on the GPU may tie-break a near-equal pair otherwise.
    assert (got_idx == want_idx).float().mean() > 0.99
    want_kv, want_tok = cls(**kw)(kv, tokens, layout, **extra)
    got_kv, got_tok = cls(**kw, edit_device="cuda")(kv, tokens, layout, **extra)
    assert got_kv.device.type == "cpu" and got_kv.shape == want_kv.shape
    if isinstance(want_tok, torch.Tensor):
        assert got_tok.device.type == "cpu"
    if torch.equal(torch.as_tensor(got_tok), torch.as_tensor(want_tok)):
        torch.testing.assert_close(got_kv.float(), want_kv.float(), atol=2e-2, rtol=2e-2)
