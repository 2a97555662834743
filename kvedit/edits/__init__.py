"""Edit functions for `BatchedStream.modify`: RoPE re-rotation and token-dropping policies."""
from kvedit.edits.base import DropPolicy, Units
from kvedit.edits.policies import DropMiddle, KeyNorm, SnapKV, StreamingLLM, UniformDrop
from kvedit.edits.rope import inv_freq, rerotate, rotate_keys

POLICIES = {
    "drop_middle": DropMiddle, "uniform": UniformDrop, "streaming_llm": StreamingLLM,
    "key_norm": KeyNorm, "snapkv": SnapKV,
}

__all__ = ["DropPolicy", "Units", "DropMiddle", "UniformDrop", "StreamingLLM", "KeyNorm",
           "SnapKV", "POLICIES", "rerotate", "rotate_keys", "inv_freq"]
