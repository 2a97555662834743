"""Repair (kvedit.edits.repair) on synthetic tensors: the query-agnostic base's selection
mended by the question's ranking within the same budget.

References: the base policy's own `select` and SnapKV's own `token_scores` (each tested
against loops and transformers elsewhere), combined here by a Python loop: the base's best
k - r, then the r best of the rest by the question.
"""
from __future__ import annotations

import pytest
import torch

from kvedit.edits import KeyDiff, KeyNorm, Repair, SnapKV, StreamingLLM
from kvedit.edits.attention import Window
from kvedit.edits.spec import PolicySpec, from_spec, to_spec
from kvedit.layout import ModelLayout, RopeParams

L, HKV, GROUP, HD, C = 3, 2, 2, 8, 4
LAYOUT = ModelLayout(num_layers=L, num_kv_heads=HKV, head_dim=HD, dtype="float32",
                     chunk_size=C, rope=RopeParams(theta=10000.0))
T = 40


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def inputs(seed=1):
    kv = rand(2, L, T, HKV * HD, seed=seed)
    q = rand(L, 5, HKV * GROUP * HD, seed=seed + 1)
    return kv, {"queries": q, "query_start": T}


def loop_repair(base_keep: list[int], question: list[float], keep: int) -> list[int]:
    """The base's tokens, then the best of the rest by the question (ties to the earlier)."""
    rest = sorted((t for t in range(len(question)) if t not in set(base_keep)),
                  key=lambda t: (-question[t], t))
    return sorted(list(base_keep) + rest[:keep - len(base_keep)])


@pytest.mark.parametrize("restore", [0.25, 0.5, 6])
def test_repair_keeps_the_bases_best_and_the_questions_best_of_the_rest(restore):
    kv, q = inputs()
    pol = Repair(0.5, base="key_norm", restore=restore, scorer_args={"span": 1, "kernel": 1})
    keep = T // 2
    r = round(restore * keep) if restore <= 1 else restore
    base = KeyNorm(0.5, granularity="token").select(kv, keep - r, LAYOUT).tolist()
    window = Window(q["queries"], T)
    question = SnapKV(0.5, granularity="token", span=1, kernel=1).token_scores(
        kv, LAYOUT, window).tolist()
    got = pol.keep_indices(kv, LAYOUT, **q)
    assert got.tolist() == loop_repair(base, question, keep)
    assert len(got) == keep


def test_restore_one_is_the_scorer_alone_and_zero_the_base_alone():
    kv, q = inputs(3)
    scorer = SnapKV(0.75, granularity="token", sink=4)
    assert torch.equal(Repair(0.75, restore=1.0, sink=4).keep_indices(kv, LAYOUT, **q),
                       scorer.keep_indices(kv, LAYOUT, **q))
    assert torch.equal(Repair(0.75, restore=0.0).keep_indices(kv, LAYOUT, **q),
                       KeyDiff(0.75, granularity="token").select(kv, T // 4, LAYOUT))


def test_the_sink_and_the_last_tokens_are_kept_whatever_the_question():
    kv, q = inputs(5)
    idx = Repair(0.75, base="key_norm", restore=0.5, sink=3, protect_last=2).keep_indices(
        kv, LAYOUT, **q).tolist()
    assert {0, 1, 2, T - 2, T - 1} <= set(idx) and len(idx) == T // 4


def test_per_head_mends_each_heads_own_selection():
    kv, q = inputs(7)
    keep, r = T // 2, T // 4
    pol = Repair(0.5, base="keydiff", restore=0.5, per_head=True,
                 scorer_args={"span": 1, "kernel": 1})
    got = pol.keep_indices(kv, LAYOUT, **q)
    assert got.shape == (L, HKV, keep)
    base = KeyDiff(0.5, granularity="token", per_head=True).select(kv, keep - r, LAYOUT)
    question = SnapKV(0.5, granularity="token", per_head=True, span=1, kernel=1).token_scores(
        kv, LAYOUT, Window(q["queries"], T))
    for layer in range(L):
        for h in range(HKV):
            assert got[layer, h].tolist() == loop_repair(
                base[layer, h].tolist(), question[layer, h].tolist(), keep)


def test_select_keeps_exactly_what_an_engine_asks():
    kv, q = inputs(9)
    idx = Repair(0.5, base="streaming_llm", restore=0.5).select(kv, 13, LAYOUT, **q)
    assert len(idx) == 13 and (idx.diff() > 0).all()
    # StreamingLLM's best 7 (its 4 sinks and the newest 3) are among them
    assert set(StreamingLLM(0.5, granularity="token").select(kv, 7, LAYOUT).tolist()) <= \
        set(idx.tolist())


def test_the_edit_returns_the_kept_tokens_kv_re_rotated_like_any_policy():
    kv, q = inputs(11)
    tokens = list(range(100, 100 + T))
    pol = Repair(0.5, base="key_norm", restore=0.5)
    idx = pol.keep_indices(kv, LAYOUT, **q)
    out, kept = pol(kv, tokens, LAYOUT, **q)
    assert kept == [100 + i for i in idx.tolist()]
    torch.testing.assert_close(out[1], kv[1].index_select(1, idx))      # values unchanged
    ref, _ = KeyNorm(0.5, granularity="token")._edit(kv, tokens, idx, LAYOUT)
    torch.testing.assert_close(out, ref)                               # keys re-rotated alike


def test_it_crosses_a_wire_as_plain_data():
    pol = Repair(0.5, base="key_norm", base_args={"granularity": "token"}, restore=96,
                 scorer="tova", sink=8)
    spec = to_spec(pol)
    assert spec.name == "repair" and spec.args["base"] == "key_norm"
    assert from_spec(PolicySpec(spec.name, spec.args)) == pol


@pytest.mark.parametrize("kw, match", [
    ({"base": "nope"}, r"base is 'nope'; expected one of"),
    ({"base": "snapkv"}, r"base is the selection made without the question"),
    ({"scorer": "keydiff"}, r"scorer must rank tokens by the question's queries"),
    ({"scorer": "kvzip"}, r"scorer must rank"),
    ({"restore": 1.5}, r"restore is 1.5; expected a share"),
    ({"restore": -1}, r"restore is -1"),
    ({"granularity": "chunk"}, r"granularity must be 'token'"),
    ({"base_args": {"bogus": 1}}, r"base_args \{'bogus': 1\} for 'keydiff'"),
])
def test_bad_settings_are_refused_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        Repair(0.5, **kw)


def test_without_queries_it_says_how_to_get_them():
    kv, _ = inputs()
    with pytest.raises(ValueError, match="capture_queries=W"):
        Repair(0.5).keep_indices(kv, LAYOUT)
