"""Common-word extraction (RULER's cwe): a long list of words, a few of which recur often.

The context is a comma-separated list of nouns (no filler, no needles): three words recur
often, every other word of a vocabulary of ~200 seldom. The question asks for the three most
common words; the answer is right when it names those three and no other word of the list
(`Spec.wrong`: the rest of the vocabulary). Unlike a needle, the answer is spread over the
whole context, so it measures what a compressed cache keeps of the text as a whole.

Counts are fixed by construction, not by chance: the list is dealt in blocks of 50 words,
each holding the three common words 4, 3 and 2 times and 41 distinct other words, shuffled.
Over B blocks the common words appear 4B, 3B and 2B times and no other word more than B
times, so the three are the most common at any length of a few blocks and the first is the
most common of all (the reuse suite's question); `Spec.check` verifies it on the list as cut
to the context.
"""
from __future__ import annotations

import random
from collections import Counter

from kvedit.harness.eval.spec import Ask, Spec

VOCABULARY = """apple river stone garden window candle mirror basket ladder pillow hammer
blanket button carpet castle cherry circle cloud copper cotton desert dragon engine feather
forest fountain glove helmet island jacket kettle kitten lemon lizard magnet mountain needle
ocean orange palace parrot pencil piano planet pocket puzzle rabbit ribbon saddle sailor
shadow shelter silver spider spoon statue summer tablet teapot thunder ticket tomato tunnel
turtle valley velvet wagon walnut whistle winter wizard acorn anchor arrow bamboo barrel
beacon beetle biscuit blossom bottle bracelet breeze bridge bucket cabbage cactus canyon
carrot cellar chimney clover cobweb compass coral crystal cushion dolphin donkey eagle
emerald falcon fern ferry flute fossil gravel guitar harbor hazel hedge honey iceberg
jasmine jungle kayak kernel lantern lettuce lobster marble meadow melon mitten monkey mosaic
muffin nectar nutmeg olive orchard oyster paddle panther pebble pepper pigeon pine pirate
plum pumpkin quartz quilt raven reef rocket saffron salmon scarf shovel shrimp sparrow spruce
squirrel stable sugar sunset swan tiger timber tulip umbrella vase violin volcano walrus
wheat willow wolf yacht anvil badger banjo beaver blender bonnet cabin camel canoe cedar
cobalt cricket daisy dune ember gazelle goblet granite hornet jelly lagoon lilac llama mango
mural nickel otter pearl poppy prism radish sapphire sequin sloth thistle trumpet
truffle""".split()
BLOCK = 50
COMMON = (4, 3, 2)  # per block: the most common word, the second, the third


class Deck:
    """The list's words one at a time (` word,`), dealt in shuffled blocks (module docstring)."""

    def __init__(self, common: list[str], rare: list[str]):
        self.common, self.rare = common, rare
        self.pending: list[str] = []

    def __call__(self, rng: random.Random) -> str:
        if not self.pending:
            block = [w for w, k in zip(self.common, COMMON) for _ in range(k)]
            block += rng.sample(self.rare, BLOCK - len(block))
            rng.shuffle(block)
            self.pending = block[::-1]
        return f" {self.pending.pop()},"


def counts(pieces: list[str]) -> Counter:
    return Counter(p.strip(" ,") for p in pieces)


def cwe(rng: random.Random, depth: float, length: int) -> Spec:
    words = rng.sample(VOCABULARY, len(VOCABULARY))
    common, rare = words[:3], words[3:]

    def check(pieces: list[str]) -> None:
        c = counts(pieces)
        top = [w for w, _ in c.most_common()]
        fourth = max((c[w] for w in rare), default=0)
        if set(top[:3]) != set(common) or min(c[w] for w in common) <= fourth \
                or c[common[0]] <= max(c[common[1]], c[common[2]]):
            raise ValueError(f"cwe: a list of {len(pieces)} words is too short for its three "
                             f"common words to stand out ({dict(c.most_common(5))}); ask for a "
                             "longer context")

    others = tuple(rare)
    more = (Ask("Which word appears most often in the list of words above?",
                "The most common word in the list is", (common[0],), tuple(words[1:])),)
    return Spec((), "Which three words appear most often in the list of words above?",
                "The three most common words in the list are", tuple(common), 16, more,
                wrong=others, haystack=Deck(common, rare), check=check)
