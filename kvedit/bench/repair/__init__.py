"""`kvedit bench repair`: what repairing a compressed cache for a new question costs the
question's time to first token (kvedit.sdk.repair), against the same question asked of the
compressed cache without repair, in the same run.

One kvedit server and one vLLM (SmolLM2 by default; any packaged model or directory). Each
round: a fresh context of `--context` tokens (random ids) and a first question is prefilled
(its chunks are the original), compressed by KeyDiff at `--ratio` with its original kept
(`modify(..., originals=)`), then two new questions of `--question` tokens are asked of that
one compressed cache, one per arm, the arms' order alternating between rounds:

- no repair: a request of the compressed context + the question (the chunks loaded from the
  kvedit server, the question computed), `max_tokens=1`; its TTFT;
- repair: `BatchedStream.repair(first_token=True)` then a one-token decode. `first token`:
  from the repair's start to the capture pass's answer (computed on the whole original:
  what a user waits for with `first_token=True`); `repaired first token`: the repair's whole
  time plus the decode's TTFT (the first token decoded on the repaired cache: what
  `first_token=False` waits for, and the second token's time with True).

Each request is alone on the engine (TTFT, not throughput). The ratios are per round, the
JSON gives their medians; the repair's time is split into its capture pass, its
re-selection (retrieve, Repair's scores and gather, store) and the rest; the connector's
loads (vLLM's log) say how much of each arm's TTFT went to copying chunks into vLLM's
blocks (the capture pass loads the whole original, the plain question the compressed cache).
"""
from kvedit.bench.repair.cli import register

__all__ = ["register"]
