"""Needles with confusable distractors: keys one word apart, values one digit apart.

RULER's multi-key and multi-value needles at length (niah_multikey_2/3, niah_multivalue)
hide the asked needle among many of its own kind. Here every distractor differs from the
asked needle by one word of its key ("the amber falcon" / "the amber harbor" / "the silver
falcon"; "the first secret code of Oslo" / "the third secret code of Oslo") and about half of
them by one digit of their value, so a model (or a compressed cache) that keeps only roughly
where the answer was, or only part of its sentence, answers a distractor. A distractor's value
in the answer makes it wrong (`Spec.wrong`), even beside the right one. The number of
distractors grows with the context: `distractors(length)`.

- multikey_confusable: "The pass key of the <adjective> <noun> is N." said once; asked one key.
- multivalue_confusable: the first and the second secret code of a city, among other
  ordinals of the same city and the same ordinals of other cities; both asked.
"""
from __future__ import annotations

import random

from kvedit.harness.eval.spec import Ask, Needle, Spec, distinct, near_number, number

ADJECTIVES = ["amber", "silver", "crimson", "golden", "quiet", "northern", "hidden", "frozen",
              "bright", "ancient", "rapid", "gentle", "hollow", "scarlet", "distant", "wooden"]
NOUNS = ["falcon", "harbor", "lantern", "meadow", "tiger", "violin", "glacier", "cactus",
         "orchid", "anchor", "comet", "walnut", "pepper", "marble", "willow", "rocket"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth"]
CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Rome", "Quito", "Dublin",
          "Nairobi", "Madrid", "Seoul", "Vienna", "Havana", "Lisbon", "Manila"]


def distractors(length: int) -> int:
    """Distractor needles for a context of `length` tokens: 4 up to 2k, one more per 2k
    tokens after, at most 11 (RULER's multikey tasks hide the needle among a few to many)."""
    return min(11, 3 + max(1, length // 2048))


def _values(rng: random.Random, answer: str, n: int) -> list[str]:
    """n distractor values, distinct and not the answer: every other one a digit away from it."""
    out: list[str] = []
    while len(out) < n:
        v = near_number(rng, answer) if len(out) % 2 == 0 else number(rng, len(answer))
        if v != answer and v not in out:
            out.append(v)
    return out


def multikey_confusable(rng: random.Random, depth: float, length: int) -> Spec:
    n = distractors(length)
    adj, noun = rng.choice(ADJECTIVES), rng.choice(NOUNS)
    # Each distractor key shares one word with the asked key and differs in the other.
    other_adj = distinct(rng, (n + 1) // 2, lambda: rng.choice(ADJECTIVES), avoid=(adj,))
    other_noun = distinct(rng, n // 2, lambda: rng.choice(NOUNS), avoid=(noun,))
    keys = [f"{adj} {noun}"] + [f"{a} {noun}" for a in other_adj] + \
        [f"{adj} {x}" for x in other_noun]
    value = number(rng, 5)
    values = [value] + _values(rng, value, n)
    depths = [depth] + [rng.uniform(0.02, 0.98) for _ in range(n)]
    needles = tuple(Needle(f" The pass key of the {k} is {v}.", d)
                    for k, v, d in zip(keys, values, depths))
    more = tuple(Ask(f"What is the pass key of the {k}?", f"The pass key of the {k} is", (v,),
                     tuple(x for x in values if x != v))
                 for k, v in zip(keys[1:3], values[1:3]))
    return Spec(needles, f"What is the pass key of the {keys[0]}?",
                f"The pass key of the {keys[0]} is", (value,), 10, more,
                wrong=tuple(values[1:]))


def multivalue_confusable(rng: random.Random, depth: float, length: int) -> Spec:
    n = distractors(length)
    city = rng.choice(CITIES)
    codes = distinct(rng, 2, lambda: number(rng, 5))
    # Distractors: other ordinals of the same city, and the first/second of other cities.
    same = ORDINALS[2:2 + min(len(ORDINALS) - 2, (n + 1) // 2)]
    others = distinct(rng, n - len(same), lambda: rng.choice(CITIES), avoid=(city,)) \
        if n > len(same) else []
    keys = [("first", city), ("second", city)] + [(o, city) for o in same] + \
        [(ORDINALS[i % 2], c) for i, c in enumerate(others)]
    values = list(codes)
    while len(values) < len(keys):  # every other one a digit away from the first code
        v = near_number(rng, codes[0]) if len(values) % 2 == 0 else number(rng, 5)
        if v not in values:
            values.append(v)
    depths = [depth, rng.uniform(0.05, 0.95)] + [rng.uniform(0.02, 0.98) for _ in keys[2:]]
    needles = tuple(Needle(f" The {o} secret code of {c} is {v}.", d)
                    for (o, c), v, d in zip(keys, values, depths))
    wrong = tuple(values[2:])
    more = tuple(Ask(f"What is the {o} secret code of {city}?",
                     f"The {o} secret code of {city} is", (v,), wrong)
                 for o, v in zip(("first", "second"), codes))
    return Spec(needles, f"What are the first and the second secret codes of {city}?",
                f"The first secret code of {city} is", tuple(codes), 28, more, wrong=wrong)
