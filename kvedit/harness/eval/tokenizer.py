"""The model's tokenizer and chat template, reduced to what the task generators need.

Prompts are built from token-id pieces (header, sentences, needles, question), not from one
string tokenized at the end, so a needle's token position and the context length are exact.
Every piece after the header starts with a space, which byte-level BPE tokenizers (GPT-2,
SmolLM2, Qwen) encode the same way wherever the piece lands.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_SLOT = "\x00CONTENT\x00"


@dataclass(frozen=True)
class ChatTokenizer:
    """encode/decode plus the chat template split around the user message."""
    tok: object            # a `tokenizers.Tokenizer`
    before_user: str       # template text before the user message ("" without a template)
    after_user: str        # template text after it, up to where the assistant's reply starts
    name: str

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def header(self, instruction: str) -> list[int]:
        """The template's opening and the task instruction: the start of every prompt."""
        return self.encode(self.before_user + instruction + "\n\n")

    def footer(self, question: str, prime: str) -> list[int]:
        """The question, the end of the user turn, the assistant's turn, the answer prime."""
        return self.encode("\n\nQuestion: " + question + self.after_user + prime)


@lru_cache(maxsize=4)
def load(model_dir: str | Path) -> ChatTokenizer:
    """The tokenizer of a model directory (tokenizer.json, chat template if it has one)."""
    from tokenizers import Tokenizer

    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the eval needs a model directory with a "
                                "tokenizer.json (e.g. `kvedit model smollm2`)")
    before, after = _template_split(model_dir)
    return ChatTokenizer(Tokenizer.from_file(str(path)), before, after, model_dir.name)


def _template_split(model_dir: Path) -> tuple[str, str]:
    """Render the chat template around a placeholder; plain Q/A without a template."""
    template = model_dir / "chat_template.jinja"
    if not template.exists():
        return "", "\nAnswer:"
    import json

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    specials = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(template.read_text()).render(
        messages=[{"role": "user", "content": _SLOT}], add_generation_prompt=True, **specials)
    before, sep, after = text.partition(_SLOT)
    if not sep:
        raise ValueError(f"{template}: the chat template does not render the user message")
    return before, after
