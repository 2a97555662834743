"""Accuracy with a 95% Wilson score interval, grouped by any field of the results."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

Z95 = 1.959963984540054  # two-sided 95% normal quantile


@dataclass(frozen=True)
class Accuracy:
    correct: int
    total: int

    @property
    def value(self) -> float | None:
        return self.correct / self.total if self.total else None

    @property
    def ci(self) -> tuple[float, float] | None:
        return wilson(self.correct, self.total)

    def to_dict(self) -> dict:
        return {"accuracy": self.value, "ci": list(self.ci) if self.ci else None,
                "correct": self.correct, "n": self.total}


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of k successes in n trials (None for n = 0). Unlike the normal
    approximation it stays inside [0, 1] and is not empty at k = 0 or k = n."""
    if n == 0:
        return None
    if not 0 <= k <= n:
        raise ValueError(f"wilson: need 0 <= k <= n, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def accuracy(oks) -> Accuracy:
    oks = list(oks)
    return Accuracy(sum(bool(x) for x in oks), len(oks))


def by(records, key) -> dict:
    """{key(record): Accuracy} over records with an `ok` field, keys in sorted order."""
    groups: dict = defaultdict(list)
    for r in records:
        groups[key(r)].append(r["ok"])
    return {k: accuracy(groups[k]) for k in sorted(groups)}
