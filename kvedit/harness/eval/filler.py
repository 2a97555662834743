"""Real-text-like haystack: seeded sentences from a small grammar, never one repeated line.

RULER hides needles in essays; we cannot ship essays, and one sentence repeated a thousand
times ("The grass is green...") is a haystack a model learns to skip in a way it never can in
real text. These sentences vary subject, verb, object, place and time, read like a dull report,
and contain no digits, so a number in the answer can only come from a needle.
"""
from __future__ import annotations

import random

SUBJECTS = [
    "The committee", "A local farmer", "The old librarian", "Our neighbour", "The museum guide",
    "A young engineer", "The ship's captain", "The village baker", "A retired teacher",
    "The city council", "The night nurse", "A travelling musician", "The school principal",
    "The head gardener", "A quiet student", "The mayor", "The carpenter", "A visiting scholar",
    "The postman", "The orchestra", "The railway clerk", "A painter from the coast",
    "The football coach", "The hotel manager", "An elderly fisherman", "The bookseller",
]
VERBS = [
    "discussed", "repaired", "painted", "described", "carried", "ordered", "studied",
    "photographed", "cleaned", "measured", "borrowed", "delivered", "admired", "planned",
    "questioned", "sketched", "rebuilt", "counted", "sorted", "examined", "praised", "moved",
]
OBJECTS = [
    "the wooden bridge", "a basket of apples", "the harbour wall", "an old map",
    "the new library roof", "a crate of oranges", "the garden fence", "a set of letters",
    "the bell tower", "a pile of firewood", "the winter schedule", "a broken lantern",
    "the train timetable", "a box of seeds", "the market stalls", "a faded painting",
    "the river path", "a stack of newspapers", "the village well", "a blue bicycle",
    "the kitchen table", "a pair of boots", "the chapel windows", "a bundle of wool",
]
PLACES = [
    "near the station", "by the river", "in the town square", "behind the church",
    "at the market", "on the hill", "beside the old mill", "in the north field",
    "at the harbour", "along the canal", "in the school yard", "under the bridge",
    "by the lake", "at the crossroads", "in the valley", "outside the bakery",
]
TIMES = [
    "on Monday morning", "late in the evening", "before the storm", "after lunch",
    "during the festival", "at dawn", "in early spring", "on a rainy afternoon",
    "last autumn", "before the winter", "on the longest day", "after the harvest",
    "at midnight", "during the holidays", "in the dry season", "on a quiet Sunday",
]
CLAUSES = [
    "while the others watched", "and nobody complained", "as the weather turned",
    "because it was needed", "although it took hours", "and then went home",
    "while the dogs barked", "as everyone expected", "before anyone noticed",
    "and wrote it down carefully", "with great patience", "without saying a word",
]


def sentence(rng: random.Random) -> str:
    """One filler sentence, e.g. 'The postman repaired the bell tower near the station at dawn.'"""
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.8:
        parts.append(rng.choice(PLACES))
    if rng.random() < 0.7:
        parts.append(rng.choice(TIMES))
    if rng.random() < 0.35:
        parts.append(rng.choice(CLAUSES))
    return " ".join(parts) + "."
