"""RULER-style synthetic tasks, generated procedurally with the model's tokenizer, seeded.

A sample is one prompt as token ids: the chat template's opening, an instruction, a haystack
of filler sentences (`filler.py`) with needles inserted at sentence boundaries, then the
question, the template's assistant turn and an answer prime ("The pass key is"). The part up
to the end of the haystack is exactly `length` tokens: that is the region a KV edit may
change. The question and the prime come after it; the runner picks lengths that are whole
chunks, so they are the stream's un-chunked suffix and no policy can drop the question
(kvpress's question-agnostic setting: compress the context, then ask).

Tasks (a generator is one function; `TASKS` registers it):
- passkey: one 5-digit pass key at a given depth (RULER's niah_single, "noise" haystack).
- multikey: three "pass key of the <noun>" needles (each said twice); the question asks
  one key, the other two are distractors at random depths (niah_multikey).
- multivalue: a first and a second secret code of one city; both must be answered
  (niah_multivalue).
- vartrack: a chain of variable assignments (VAR A = 12345 ... VAR B = VAR A ...) among
  distractor chains; the question asks the value of the chain's last variable, so the
  answer is found by following the chain, not by matching the question (RULER's vt, asked
  backwards so a small model can answer in a few tokens).
- multikey_confusable, multivalue_confusable (`confusable.py`): the needle among distractors
  one word of key and often one digit of value away, more of them as the context grows; a
  distractor's value in the answer makes it wrong.
- cwe (`cwe.py`): a list of words, three of which recur often; name those three.
- docqa (`docqa.py`): short company profiles; one attribute of one company, with profiles
  of companies one word of name away as distractors.

A generator is `(rng, depth, length) -> Spec` (`spec.py`); `build` places its needles in
its haystack (filler sentences unless the Spec brings its own) at exact token length.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from kvedit.harness.eval.confusable import multikey_confusable, multivalue_confusable
from kvedit.harness.eval.cwe import cwe
from kvedit.harness.eval.docqa import docqa
from kvedit.harness.eval.filler import sentence
from kvedit.harness.eval.spec import Ask, Needle, Spec, correct, distinct, number
from kvedit.harness.eval.tokenizer import ChatTokenizer

INSTRUCTION = ("Below is a long text. Some important facts are hidden in it. Read it and "
               "answer the question at the end.")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
KEY_NOUN = ["falcon", "harbor", "lantern", "meadow", "tiger", "violin", "glacier", "cactus",
            "orchid", "anchor", "comet", "walnut", "pepper", "marble", "willow", "rocket"]
CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Rome", "Quito", "Dublin",
          "Nairobi", "Madrid", "Seoul", "Vienna", "Havana", "Lisbon", "Manila"]
VAR_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"


@dataclass(frozen=True)
class Question:
    """One question of a context as token ids: the un-editable tail after the context."""
    tail: tuple[int, ...]       # question, end of the user turn, assistant turn, prime
    answers: tuple[str, ...]
    wrong: tuple[str, ...] = ()  # none of these may appear (spec.correct)

    def correct(self, output: str) -> bool:
        return correct(output, self.answers, self.wrong)


@dataclass(frozen=True)
class Sample:
    task: str
    length: int                     # tokens before the question (the editable context)
    depth: float                    # depth of the needle the question asks for
    index: int
    prompt_ids: list[int]
    answers: tuple[str, ...]
    needle_positions: tuple[int, ...]  # first token of each needle, in `Spec.needles` order
    needle_ids: tuple[tuple[int, ...], ...]
    max_tokens: int
    # Tokens of the template's opening + the instruction (the prompt's first tokens): what a
    # user protects like a system prompt; the eval gives policies with a `sink` this many.
    header: int = 0
    seed: int = 0                   # the suite's seed (several seeds run in one eval)
    # The reuse suite's questions about this context: the main one first, then `Spec.more`.
    questions: tuple[Question, ...] = ()
    wrong: tuple[str, ...] = ()     # answers that must not appear (spec.correct)

    def correct(self, output: str) -> bool:
        """Every expected answer in the output (numbers as whole numbers, words as whole
        words) and no forbidden one."""
        return correct(output, self.answers, self.wrong)


def passkey(rng: random.Random, depth: float, length: int) -> Spec:
    key = number(rng, 5)
    return Spec((Needle(f" The pass key is {key}. Remember it. {key} is the pass key.", depth),),
                "What is the pass key?", "The pass key is", (key,), 8)


def multikey(rng: random.Random, depth: float, length: int) -> Spec:
    # Keys are single nouns ("the falcon"): with hyphenated two-word keys ("amber-falcon")
    # SmolLM2-135M answered a distractor's number about half the time even unedited.
    keys = distinct(rng, 3, lambda: rng.choice(KEY_NOUN))
    values = distinct(rng, 3, lambda: number(rng, 5))
    depths = [depth] + [rng.random() for _ in keys[1:]]
    needles = tuple(Needle(f" The pass key of the {k} is {v}. Remember it: the pass key of the "
                           f"{k} is {v}.", d) for k, v, d in zip(keys, values, depths))
    more = tuple(Ask(f"What is the pass key of the {k}?", f"The pass key of the {k} is", (v,))
                 for k, v in zip(keys[1:], values[1:]))
    return Spec(needles, f"What is the pass key of the {keys[0]}?",
                f"The pass key of the {keys[0]} is", (values[0],), 8, more)


def multivalue(rng: random.Random, depth: float, length: int) -> Spec:
    key = rng.choice(CITIES)
    values = distinct(rng, 2, lambda: number(rng, 5))
    other = rng.uniform(0.05, 0.95)
    needles = (Needle(f" The first secret code of {key} is {values[0]}.", depth),
               Needle(f" The second secret code of {key} is {values[1]}.", other))
    more = tuple(Ask(f"What is the {n} secret code of {key}?", f"The {n} secret code of {key} is",
                     (v,)) for n, v in zip(("first", "second"), values))
    return Spec(needles, f"What are the first and the second secret codes of {key}?",
                f"The first secret code of {key} is", tuple(values), 24, more)


def vartrack(rng: random.Random, depth: float, length: int) -> Spec:
    names = distinct(rng, 4, lambda: "".join(rng.choices(VAR_LETTERS, k=3)))
    values = distinct(rng, 2, lambda: number(rng, 5))
    a, b, x, y = names
    # The asked chain a -> b: its value at `depth`, the copy later; a distractor chain x -> y.
    later = min(0.98, depth + rng.uniform(0.05, 0.3))
    dx = rng.uniform(0.02, 0.9)
    needles = (Needle(f" VAR {a} = {values[0]}.", depth),
               Needle(f" VAR {b} = VAR {a}.", later),
               Needle(f" VAR {x} = {values[1]}.", dx),
               Needle(f" VAR {y} = VAR {x}.", min(0.98, dx + rng.uniform(0.02, 0.1))))
    more = (Ask(f"What is the value of VAR {y}?", f"The value of VAR {y} is", (values[1],)),)
    return Spec(needles, f"What is the value of VAR {b}?", f"The value of VAR {b} is",
                (values[0],), 8, more)


TASKS: dict[str, Callable[[random.Random, float, int], Spec]] = {
    "passkey": passkey, "multikey": multikey, "multivalue": multivalue, "vartrack": vartrack,
    "multikey_confusable": multikey_confusable, "multivalue_confusable": multivalue_confusable,
    "cwe": cwe, "docqa": docqa,
}


def _haystack(tok: ChatTokenizer, spec: Spec, rng: random.Random,
              room: int) -> tuple[list[str], list[list[int]], bool]:
    """The haystack's pieces as text and as token ids, `room` tokens in all, and whether the
    last piece was cut to fit. Pieces are drawn in batches and tokenized together (one call
    per batch: a 16k context is ~500 pieces); the pieces past the one that fills the room are
    dropped, and nothing after the haystack draws from `rng`, so a sample is the same as
    drawn one by one."""
    make = spec.haystack or (lambda r: " " + sentence(r))
    texts: list[str] = []
    hay: list[list[int]] = []
    total = 0
    while total < room:
        # as many pieces as the room left holds at the mean piece so far (+10%)
        per = total / len(hay) if hay else 8
        batch = [make(rng) for _ in range(max(8, min(256, int((room - total) / per * 1.1))))]
        for text, enc in zip(batch, tok.encode_batch(batch)):
            texts.append(text)
            hay.append(enc)
            total += len(enc)
            if total >= room:
                break
    hay[-1] = hay[-1][: len(hay[-1]) - (total - room)]  # cut the last piece to fit exactly
    return texts, hay, total > room


def build(tok: ChatTokenizer, task: str, length: int, depth: float, index: int,
          seed: int) -> Sample:
    """One sample of `task`: exactly `length` context tokens, the asked needle at `depth`."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(TASKS)}")
    rng = random.Random(f"{seed}/{task}/{length}/{depth}/{index}")
    spec = TASKS[task](rng, depth, length)
    header = tok.header(INSTRUCTION)
    needles = [tok.encode(n.text) for n in spec.needles]
    room = length - len(header) - sum(map(len, needles))
    if room < 64:
        raise ValueError(f"length {length} leaves {room} haystack tokens for task {task!r} "
                         f"(header {len(header)}, needles {sum(map(len, needles))}); "
                         "ask for a longer context")
    texts, hay, cut = _haystack(tok, spec, rng, room)
    if spec.check is not None:
        spec.check(texts[:-1] if cut else texts)
    bounds = [0]  # haystack token offset at each sentence boundary
    for s in hay:
        bounds.append(bounds[-1] + len(s))
    # Each needle goes to the sentence boundary nearest its depth (of the haystack).
    at = [min(range(len(hay) + 1), key=lambda i: abs(bounds[i] - n.depth * room))
          for n in spec.needles]
    order = sorted(range(len(needles)), key=lambda j: (at[j], j))
    ids = list(header)
    pos = [0] * len(needles)
    k = 0
    for i in range(len(hay) + 1):
        while k < len(order) and at[order[k]] == i:
            pos[order[k]] = len(ids)
            ids += needles[order[k]]
            k += 1
        if i < len(hay):
            ids += hay[i]
    assert len(ids) == length, (len(ids), length)
    tail = tok.footer(spec.question, spec.prime)
    questions = (Question(tuple(tail), spec.answers, spec.wrong),) + tuple(
        Question(tuple(tok.footer(a.question, a.prime)), a.answers, a.wrong) for a in spec.more)
    return Sample(task, length, depth, index, ids + tail, spec.answers, tuple(pos),
                  tuple(tuple(n) for n in needles), spec.max_tokens, header=len(header),
                  seed=seed, questions=questions, wrong=spec.wrong)


def suite(tok: ChatTokenizer, tasks, lengths, samples: int, seed: int = 0,
          depths=DEPTHS) -> list[Sample]:
    """`samples` per task and length, depths cycling through `depths`."""
    return [build(tok, t, n, depths[i % len(depths)], i, seed)
            for t in tasks for n in lengths for i in range(samples)]


def reuse_suite(tok: ChatTokenizer, tasks, lengths, samples: int, seed: int = 0) -> list[Sample]:
    """The contexts of `suite` whose task asks more than one question (multikey, multivalue,
    vartrack: every needle's own question; passkey has one needle and is left out)."""
    return [s for s in suite(tok, tasks, lengths, samples, seed) if len(s.questions) > 1]
