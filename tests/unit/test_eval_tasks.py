"""`kvedit eval`'s tasks at length, with the tiny model's tokenizer (no engine): every task's
context is exactly the length asked at 512 to 16k tokens with the question after it; the
confusable needles differ from the asked one by one word of key (and often one digit of
value) and the asked value is in the context once; cwe's three words are the most common of
its list by construction; docqa holds one profile of the asked company among profiles of
companies one word of name away; suites are deterministic by seed; and the correctness rule
(whole numbers, whole words, no distractor value) decides as stated. The same generators
against SmolLM2's tokenizer and chat template: tests/engine/test_tasks.py."""
from __future__ import annotations

import re
from collections import Counter

import pytest

from kvedit.harness.eval.confusable import distractors
from kvedit.harness.eval.cwe import VOCABULARY, cwe
from kvedit.harness.eval.spec import correct, has, near_number
from kvedit.harness.eval.tasks import TASKS, build, suite
from kvedit.harness.eval.tokenizer import load

NEW = ("multikey_confusable", "multivalue_confusable", "cwe", "docqa")


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load(tiny_model)


def context(tok, s) -> str:
    return tok.decode(s.prompt_ids[:s.length])


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("length", [1024, 4096, 16384])
def test_every_task_fills_exactly_the_length_and_asks_after_it(tok, task, length):
    s = build(tok, task, length, 0.3, 0, seed=1)
    assert s.length == length and len(s.prompt_ids) - length < 128  # the tail: one chunk
    assert "Question:" in tok.decode(s.prompt_ids[length:])
    assert "Question:" not in context(tok, s)
    for p, ids in zip(s.needle_positions, s.needle_ids):
        assert s.prompt_ids[p:p + len(ids)] == list(ids) and p + len(ids) <= length
    assert s.questions[0].answers == s.answers and s.questions[0].wrong == s.wrong
    assert not set(s.answers) & set(s.wrong)


@pytest.mark.parametrize("task", NEW)
def test_new_tasks_are_deterministic_by_seed_and_differ_between_samples(tok, task):
    a = suite(tok, [task], [1024], 4, seed=7)
    b = suite(tok, [task], [1024], 4, seed=7)
    c = suite(tok, [task], [1024], 4, seed=8)
    assert [s.prompt_ids for s in a] == [s.prompt_ids for s in b]
    assert [s.questions for s in a] == [s.questions for s in b]
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in c]
    assert len({tuple(s.prompt_ids) for s in a}) == 4


def _key(tok, needle_ids) -> tuple[str, str]:
    text = tok.decode(needle_ids)
    m = re.search(r"The (.+) is (\d+)\.", text)
    return m.group(1), m.group(2)


@pytest.mark.parametrize("task", ["multikey_confusable", "multivalue_confusable"])
@pytest.mark.parametrize("length", [2048, 16384])
def test_confusable_distractors_differ_by_one_word_and_the_answer_is_there_once(tok, task,
                                                                              length):
    for s in suite(tok, [task], [length], 5, seed=3):
        keys = [_key(tok, ids) for ids in s.needle_ids]
        asked = keys[:2] if task == "multivalue_confusable" else keys[:1]
        others = keys[len(asked):]
        assert len(others) == distractors(length)
        assert [v for _, v in asked] == list(s.answers)
        assert [v for _, v in others] == list(s.wrong)
        assert len({v for _, v in keys}) == len(keys)  # every value distinct
        for k, _ in others:  # one word of the key away from an asked key
            assert any(sum(x != y for x, y in zip(k.split(), a.split())) == 1
                       and len(k.split()) == len(a.split()) for a, _ in asked)
        near = [v for _, v in others if any(sum(x != y for x, y in zip(v, a)) == 1
                                            for a in s.answers)]
        assert len(near) >= len(others) // 2  # about half one digit from an answer
        numbers = Counter(re.findall(r"\d+", context(tok, s)))
        assert all(numbers[a] == 1 for a in s.answers)  # no filler number, no repeat
        assert all(numbers[w] == 1 for w in s.wrong)
    assert distractors(512) == 4 < distractors(4096) < distractors(16384) == 11


def test_cwe_names_the_three_most_common_words_of_its_list(tok):
    for length in (512, 4096, 16384):
        for s in suite(tok, ["cwe"], [length], 3, seed=5):
            words = Counter(w.strip() for w in context(tok, s).split(",")[1:-1])
            top, first = s.answers, s.questions[1].answers[0]
            fourth = max(n for w, n in words.items() if w not in top)
            assert min(words[w] for w in top) > fourth
            assert first == top[0] and words[first] > max(words[w] for w in top[1:])
            assert set(s.wrong) == set(VOCABULARY) - set(top)
            assert correct(f" {top[2]}, {top[0]} and {top[1].upper()}.", s.answers, s.wrong)
            rare = s.wrong[0]
            assert not correct(f" {top[0]}, {top[1]}, {top[2]} and {rare}.", s.answers, s.wrong)
            assert not correct(f" {top[0]} and {top[1]}.", s.answers, s.wrong)


def test_cwe_refuses_a_list_too_short_for_its_words_to_stand_out():
    import random

    spec = cwe(random.Random(0), 0.5, 512)
    deck = [spec.haystack(random.Random(1)) for _ in range(60)]
    with pytest.raises(ValueError, match="too short"):
        spec.check(deck[:20])
    spec.check([spec.haystack(random.Random(1)) for _ in range(500)])


def test_docqa_asks_one_company_among_companies_one_word_of_name_away(tok):
    for s in suite(tok, ["docqa"], [4096], 10, seed=2):
        text = context(tok, s)
        names = re.findall(r"Company profile: ([A-Za-z]+ [A-Za-z]+)\.", text)
        assert len(names) == len(set(names))  # no company twice
        asked = re.search(r"Company profile: ([A-Za-z]+ [A-Za-z]+)\.",
                          tok.decode(s.needle_ids[0])).group(1)
        assert names.count(asked) == 1 and has(tok.decode(s.needle_ids[0]), s.answers[0])
        similar = [re.search(r"profile: ([A-Za-z]+ [A-Za-z]+)\.", tok.decode(ids)).group(1)
                   for ids in s.needle_ids[1:]]
        assert len(similar) == 3 and all(
            sum(x != y for x, y in zip(n.split(), asked.split())) == 1 for n in similar)
        assert len(s.wrong) == 3 and s.answers[0] not in s.wrong
        for ids, w in zip(s.needle_ids[1:], s.wrong):  # each distractor holds one wrong value
            assert has(tok.decode(ids), w)
        assert asked in tok.decode(s.prompt_ids[s.length:])  # the question names it
        assert len(s.questions) == 4  # + two attributes of it and one of a distractor
        assert correct(f" {s.answers[0]}.", s.answers, s.wrong)
        assert not correct(f" {s.answers[0]} or {s.wrong[0]}.", s.answers, s.wrong)


def test_the_rule_matches_whole_numbers_and_whole_words_and_refuses_distractors():
    assert has("The key is 12345.", "12345") and not has("The key is 123456.", "12345")
    assert not has("The key is 112345.", "12345")
    assert has("Founded in LIMA, Peru", "Lima") and not has("Limassol", "Lima")
    assert has("It is Maria Ostrova.", "Maria Ostrova")
    assert not has("Maria Ostrovan", "Maria Ostrova")
    assert correct("12345 and 67890", ("12345", "67890"))
    assert not correct("12345", ("12345", "67890"))
    assert not correct("12345, or maybe 12346", ("12345",), ("12346",))
    assert correct("12345", ("12345",), ("12346",))


def test_near_numbers_are_one_digit_away_and_keep_their_length():
    import random

    rng = random.Random(0)
    for _ in range(500):
        v = str(rng.randrange(10000, 100000))
        n = near_number(rng, v)
        assert len(n) == len(v) and n[0] != "0" and sum(a != b for a, b in zip(n, v)) == 1


def test_a_sample_offset_run_asks_the_prompts_the_whole_run_would_after_k(tiny_model, tmp_path):
    """`--sample-offset K` finishes a cut run: its samples are exactly the whole run's samples
    with index >= K, prompt for prompt, so the two runs pool without repeats or gaps."""
    import time

    from kvedit.harness.eval.run import EvalConfig, EvalRun

    cfg = EvalConfig(model=str(tiny_model), tasks=["passkey", "multikey"], lengths=[512],
                     samples=4, seeds=[0, 1], policies=["keydiff"], ratios=[0.5])
    tok = load(tiny_model)
    whole = EvalRun(cfg, tiny_model, tok, print, time.perf_counter(), tmp_path).samples
    cfg.sample_offset = 3
    rest = EvalRun(cfg, tiny_model, tok, print, time.perf_counter(), tmp_path).samples
    assert len(whole) == 16 and len(rest) == 4
    assert [(s.task, s.index, s.prompt_ids) for s in rest] == \
        [(s.task, s.index, s.prompt_ids) for s in whole if s.index >= 3]
