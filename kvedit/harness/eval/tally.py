"""What each policy x ratio cell has measured so far, summed over the groups of samples.

`kvedit eval` runs its samples in groups (schedule.py), so a cell's answers and timings
arrive in parts. A `Tally` adds them up and gives the row `report.summarize` reads: the
records, the kept and stored fractions over every token the cell edited, and the phase
timings summed (modify split into retrieve, fn and store, each summed over streams, which
overlap, so they can exceed the modify's wall time).
"""
from __future__ import annotations

from dataclasses import dataclass, field

SUMS = ("kept_tokens", "context_tokens", "tokens_before", "tokens_after", "modify_s",
        "retrieve_s", "fn_s", "store_s", "decode_s", "seconds")


@dataclass
class Tally:
    policy: str   # the result's label (run.label)
    ratio: float
    records: list[dict] = field(default_factory=list)
    sums: dict = field(default_factory=lambda: dict.fromkeys(SUMS, 0.0))
    groups: int = 0
    samples: int = 0

    def add(self, records: list[dict], info: dict, samples: int) -> None:
        self.records += records
        for k in SUMS:
            self.sums[k] += info.get(k) or 0.0
        for k, v in info.items():   # a cell kind's own counters (repair_cell.py) add up too
            if k not in SUMS and isinstance(v, (int, float)):
                self.sums[k] = self.sums.get(k, 0) + v
        self.groups += 1
        self.samples += samples

    def row(self) -> dict:
        s = self.sums
        return {"policy": self.policy, "ratio": self.ratio, "records": self.records,
                "kept_fraction": s["kept_tokens"] / s["context_tokens"]
                if s["context_tokens"] else None,
                "stored_fraction": s["tokens_after"] / s["tokens_before"]
                if s["tokens_before"] else None,
                "samples": self.samples, "groups": self.groups,
                **{k: s[k] for k in s if k not in SUMS or k.endswith("_s") or k == "seconds"},
                "seconds_per_sample": s["seconds"] / self.samples if self.samples else None}
