"""Long-generation tasks (kvedit.harness.eval.longgen) against the real SmolLM2 tokenizer and
chat template: the prompts say what the scoring expects, the facts sit where a budget can
lose them, and the scores follow the text. No engine (the smollm2_model session fixture
converts the model, ~1 min, shared with test_tasks.py)."""
from __future__ import annotations

import pytest

from kvedit.harness.eval import longgen
from kvedit.harness.eval.tokenizer import load

CHUNK = 128


@pytest.fixture(scope="module")
def tok(smollm2_model):
    return load(smollm2_model)


def _count_text(start: int, stop: int) -> str:
    return " " + ", ".join(str(i) for i in range(start, stop + 1))


def test_count_prompt_asks_what_the_score_expects(smollm2_model, tok):
    for s in longgen.samples(smollm2_model, "count", 4, how_many=50):
        text = tok.decode(s.prompt_ids)
        assert f"Count from {s.start} to {s.stop}, separated by commas" in text
        assert text.endswith(f"{s.start}, {s.start + 1}, {s.start + 2},")  # the prime
        assert text.index("user") < text.index("Count") < text.rindex("assistant")
        assert s.stop - s.start + 1 == 50 and s.question_ids == [] and s.code is None
        # the whole expected continuation fits in max_tokens with this tokenizer
        assert len(tok.encode(_count_text(s.start + 3, s.stop))) <= s.max_tokens


def test_count_score_is_the_prefix_before_the_first_slip(smollm2_model):
    s = longgen.samples(smollm2_model, "count", 1, how_many=20)[0]
    a, z = s.start + 3, s.stop
    assert s.score_count(_count_text(a, z)) == longgen.CountScore(17, 17)
    assert s.score_count(_count_text(a, z) + ", 999, 1000").complete  # past E: not scored
    skipped = _count_text(a, a + 4) + _count_text(a + 6, z)            # a+5 missing
    assert s.score_count(skipped) == longgen.CountScore(5, 17)
    assert s.score_count(_count_text(a, a + 8)).fraction == pytest.approx(9 / 17)
    assert s.score_count("I cannot count.").produced == 0


def test_recall_code_sits_past_the_first_chunk_at_its_depth(smollm2_model, tok):
    samples = longgen.samples(smollm2_model, "recall", 6)
    assert {s.depth for s in samples} == set(longgen.DEPTHS)
    for s in samples:
        i = s.code_position
        assert tok.decode(s.prompt_ids[i:i + 12]).startswith(f" The secret code is {s.code}.")
        assert i >= CHUNK  # only sinks + recent tokens kept: this fact is dropped
        assert str(s.code) not in tok.decode(s.prompt_ids[:i] + s.prompt_ids[i + 12:])
        assert tok.decode(s.prompt_ids).endswith(f"{s.start}, {s.start + 1}, {s.start + 2},")
        q = tok.decode(s.question_ids)
        assert "What is the secret code" in q and q.endswith("The secret code is")
    assert all(a.code_position < b.code_position for a in samples for b in samples
               if a.depth < b.depth)  # deeper = later in the note


def test_recall_needs_the_code_as_a_whole_number(smollm2_model):
    s = longgen.samples(smollm2_model, "recall", 1)[0]
    assert s.recalled(f" {s.code}.")
    assert not s.recalled(f" {s.code}7") and not s.recalled(" " + s.code[:-1])


def test_chat_turns_render_the_template_in_order(smollm2_model):
    t = longgen.turns(smollm2_model)
    assert t.before_user.endswith("<|im_start|>user\n")
    assert t.after_user == "<|im_end|>\n<|im_start|>assistant\n"
    assert t.next_user == "<|im_end|>\n<|im_start|>user\n"


def test_seeds_reproduce_and_differ(smollm2_model):
    one = longgen.samples(smollm2_model, "recall", 3, seed=1)
    assert one == longgen.samples(smollm2_model, "recall", 3, seed=1)
    assert [s.code for s in one] != [s.code for s in longgen.samples(smollm2_model, "recall",
                                                                      3, seed=2)]


def test_bad_arguments_are_refused_with_the_reason(smollm2_model):
    with pytest.raises(ValueError, match="unknown long-generation task 'sum'.*count"):
        longgen.samples(smollm2_model, "sum", 1)
    with pytest.raises(ValueError, match="more than the 3 primed numbers"):
        longgen.samples(smollm2_model, "count", 1, how_many=3)


def test_restate_asks_for_the_code_at_the_end_of_one_reply(smollm2_model, tok):
    """restate: the note's code and the count in one turn, the code asked for after the
    count; scored on the reply alone (no second turn), so one request per stream carries it."""
    for s in longgen.samples(smollm2_model, "restate", 3, how_many=400, note_tokens=1500):
        text = tok.decode(s.prompt_ids)
        assert f"The secret code is {s.code}." in text and s.question_ids == []
        assert text.index(s.code) < text.index("First, count") < text.index(
            "followed by the secret code")
        assert tok.decode(s.prompt_ids[s.code_position:]).startswith(" The secret code is")
        assert s.code_position > CHUNK and 1500 <= len(s.prompt_ids) <= 1800
        reply = _count_text(s.start + 3, s.stop) + f"\nThe secret code is {s.code}."
        assert len(tok.encode(reply)) <= s.max_tokens  # the whole reply fits
        assert s.correct(reply) and not s.correct(_count_text(s.start + 3, s.stop))
        assert s.score_count(reply).complete
