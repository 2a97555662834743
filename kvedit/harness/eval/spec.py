"""What a task generator returns, and the rule that says whether an answer is right.

A generator (`tasks.TASKS`) is one function `(rng, depth, length) -> Spec`: the needles and
where they go, the question and its answer prime, the expected answers and the answers that
must not appear (a confusable distractor's value), and optionally the haystack it hides them
in (default: `filler.sentence`). `tasks.build` turns a Spec into token ids of exact length.
Kept apart from tasks.py so the generator modules (confusable, cwe, docqa) and tasks.py,
which registers them, import it without a circle.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Needle:
    text: str     # the sentence inserted into the haystack (with its leading space)
    depth: float  # where in the haystack, 0 = start, 1 = end


@dataclass(frozen=True)
class Ask:
    """A further question about the same context (the reuse suite: one edited cache, many
    questions): its question, answer prime, expected answers and forbidden ones."""
    question: str
    prime: str
    answers: tuple[str, ...]
    wrong: tuple[str, ...] = ()


@dataclass(frozen=True)
class Spec:
    """What a task generator decides; `tasks.build` turns it into token ids."""
    needles: tuple[Needle, ...]
    question: str
    prime: str
    answers: tuple[str, ...]   # all must appear in the model's answer
    max_tokens: int
    more: tuple[Ask, ...] = ()  # the reuse suite's questions (the main one is not among them)
    # None must appear: the values of confusable distractors (an answer that names the asked
    # value beside a distractor's has not told them apart).
    wrong: tuple[str, ...] = ()
    # The haystack's pieces, one per call (text with a leading space); None: filler sentences.
    # Called with build's rng, in order, until the context is full.
    haystack: Callable[[random.Random], str] | None = None
    # Called with the haystack pieces that made it whole into the context (the last one, cut
    # to fit, is left out): raises ValueError when they do not support the answers (e.g. the
    # common words of `cwe` not strictly the most common).
    check: Callable[[list[str]], None] | None = None


def has(output: str, answer: str) -> bool:
    """Whether `answer` is in `output`: a number as a whole number (12345 is not in 123456),
    words as whole words, case-insensitive."""
    if answer.isdigit():
        return answer in re.findall(r"\d+", output)
    return re.search(r"(?<!\w)" + re.escape(answer.lower()) + r"(?!\w)", output.lower()) is not None


def correct(output: str, answers, wrong=()) -> bool:
    """True when every expected answer is in the output and no forbidden one is."""
    return all(has(output, a) for a in answers) and not any(has(output, w) for w in wrong)


def number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def near_number(rng: random.Random, value: str) -> str:
    """`value` with one digit changed (the first digit never to 0): a distractor one digit
    away from the answer."""
    i = rng.randrange(len(value))
    digits = [d for d in "0123456789" if d != value[i] and (i or d != "0")]
    return value[:i] + rng.choice(digits) + value[i + 1:]


def distinct(rng: random.Random, n: int, make, avoid=()) -> list:
    """n distinct values of `make()`, none in `avoid`."""
    out: list = []
    while len(out) < n:
        x = make()
        if x not in out and x not in avoid:
            out.append(x)
    return out
