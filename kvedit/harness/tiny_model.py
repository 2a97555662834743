"""A tiny random-weight Qwen3 and a byte-level BPE tokenizer, built locally from a seed.

No model can be downloaded here, yet tests, the demo and the benchmarks need a real model
that vLLM serves. This one has the shape of a real Qwen3 (GQA, RoPE, q/k norms) at 5 M
parameters. Everything is a function of the seed: the same seed gives the same files.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from kvedit.harness.cache import build_into, cache_root

VERSION = "v1"  # bump when the recipe changes, so cached copies are rebuilt
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_act="silu",
    max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
    # Larger than the usual 0.02 so attention is far from uniform and KV edits show up.
    initializer_range=0.08,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Real models' shapes with this tokenizer and no weight files: vLLM's `--load-format dummy`
# initialises weights from config.json alone, so the GPU rows run at a real model's size
# (compute, KV bytes per token) without its weights. qwen3-8b: Qwen3-8B's layers, heads and
# widths with this tokenizer's vocabulary (the model behind the README's GPU rows: 7.0 B
# parameters, Qwen3-8B's 8.2 B less its larger embedding and head).
SHAPES = {
    "qwen3-8b": dict(
        vocab_size=VOCAB_SIZE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}),
}


def _corpus(rng: np.random.Generator, n_lines: int = 4000) -> list[str]:
    """Deterministic pseudo-text: Zipf-distributed 'words' over a small alphabet."""
    letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(1, 9))) for _ in range(3000)]
    ranks = np.minimum(rng.zipf(1.3, size=(n_lines, 12)), len(words)) - 1
    return [" ".join(words[r] for r in row) for row in ranks]


def _build_tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(np.random.default_rng(seed)), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(out)


def build_tiny_model(dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write config, bf16 safetensors weights and tokenizer into `dir`; return it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(out, seed)
    eos = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]["<|endoftext|>"]
    config = Qwen3Config(**CONFIG, bos_token_id=eos, eos_token_id=eos, dtype="bfloat16")
    config.architectures = ["Qwen3ForCausalLM"]
    with torch.random.fork_rng():  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


def build_shaped_config(dir: str | os.PathLike, shape: str, seed: int = 0) -> Path:
    """Write `shape`'s config.json (bf16, Qwen3ForCausalLM) and this tokenizer into `dir`,
    no weights (serve it with vLLM's `--load-format dummy`); return `dir`."""
    from transformers import Qwen3Config

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; expected one of "
                         f"{['tiny', *SHAPES]}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(out, seed)
    eos = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]["<|endoftext|>"]
    config = Qwen3Config(**SHAPES[shape], bos_token_id=eos, eos_token_id=eos, dtype="bfloat16")
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(out)
    return out


def default_tiny_model(seed: int = 0) -> Path:
    """The cached tiny model (~/.cache/kvedit, or $KVEDIT_CACHE_DIR), built on first use."""
    target = cache_root() / f"tiny-qwen3-{VERSION}-seed{seed}"
    if all((target / f).exists() for f in _FILES):
        return target
    return build_into(target, lambda tmp: build_tiny_model(tmp, seed))
