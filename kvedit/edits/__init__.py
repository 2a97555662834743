"""Edit functions for `BatchedStream.modify`: RoPE re-rotation and token-dropping policies.

Pure torch: nothing here starts a process or talks to a server (that is kvedit/harness/).
A policy keeps or drops a token for every layer and KV head at once (one vLLM cache slot
holds them all); each policy's docstring says how it folds per-(layer, head) scores into one
score per token. POLICIES maps the CLI/eval names to the classes, and a policy's plain-data
form goes through it (`spec.py`); a class with `needs_queries = True` scores from the
request's captured queries (`query_policies.py`).
"""
from kvedit.edits.anchored import PromptAnchored, PromptRanks
from kvedit.edits.attention import Window, window_attention
from kvedit.edits.base import DropPolicy, Units
from kvedit.edits.policies import (DropMiddle, KeyDiff, KeyNorm, LeverageScore, RandomDrop,
                                   SnapKVProxy, StreamingLLM, UniformDrop)
from kvedit.edits.kvzip import KVzip
from kvedit.edits.query_policies import TOVA, SnapKV
from kvedit.edits.rope import inv_freq, rerotate, rotate_keys
from kvedit.edits.spec import POLICIES, PolicySpec, from_spec, to_spec

__all__ = ["DropPolicy", "Units", "Window", "DropMiddle", "UniformDrop", "StreamingLLM",
           "KeyNorm", "SnapKVProxy", "SnapKV", "TOVA", "KVzip", "PromptAnchored", "PromptRanks", "KeyDiff", "LeverageScore", "RandomDrop",
           "POLICIES", "PolicySpec", "from_spec", "to_spec", "rerotate", "rotate_keys",
           "inv_freq", "window_attention"]
