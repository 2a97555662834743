"""Edit functions for `BatchedStream.modify`: RoPE re-rotation and token-dropping policies.

Pure torch: nothing here starts a process or talks to a server (that is kvedit/harness/).
A policy keeps or drops a token for every layer and KV head at once (one vLLM cache slot
holds them all); each policy's docstring says how it folds per-(layer, head) scores into one
score per token. POLICIES maps the CLI/eval names to the classes.
"""
from kvedit.edits.base import DropPolicy, Units
from kvedit.edits.policies import (DropMiddle, KeyDiff, KeyNorm, LeverageScore, RandomDrop, SnapKV,
                                   StreamingLLM, UniformDrop)
from kvedit.edits.rope import inv_freq, rerotate, rotate_keys

POLICIES = {
    "drop_middle": DropMiddle, "uniform": UniformDrop, "streaming_llm": StreamingLLM,
    "key_norm": KeyNorm, "snapkv": SnapKV, "keydiff": KeyDiff, "leverage": LeverageScore,
    "random": RandomDrop,
}

__all__ = ["DropPolicy", "Units", "DropMiddle", "UniformDrop", "StreamingLLM", "KeyNorm",
           "SnapKV", "KeyDiff", "LeverageScore", "RandomDrop", "POLICIES", "rerotate",
           "rotate_keys", "inv_freq"]
