"""Long-generation tasks whose correctness is checkable: accuracy under a KV budget.

The eval's RULER tasks (tasks.py) edit a long *prompt* and ask one short answer; here the
output is long, so a decode-time budget edits the model's own generated text. Two tasks,
seeded, built from token-id pieces with the model's chat template (as tasks.py does):

- count: "Count from S to E, separated by commas." with the reply primed "S, S+1, S+2,";
  about 4.6 tokens per 3-digit number with SmolLM2, so 200 numbers are ~950 generated
  tokens. Score: the fraction of the expected numbers S+3..E produced in order before the
  first wrong one (`CountScore.fraction`); a sample is correct when all of them are. Greedy
  SmolLM2-135M counts without a slip in a transformers check (and goes on past E: nothing
  after E is scored). Needs the instruction and the last few numbers: a sink + recent
  window budget should keep it.
- recall: a note of filler sentences (filler.py) with one "The secret code is NNNNN."
  sentence at a depth, then the same counting instruction; after the long count the user
  asks for the code in a second turn (`Sample.question_ids`, appended to the stream). The
  fact lies past the first chunk, so a budget that keeps only sinks and recent tokens loses
  it: this shows what a budget costs, per policy.
- restate: the recall note and count in one turn: "First count ... Then write the secret
  code." The code must come back at the end of the model's own long reply (>= 2k generated
  tokens at 400 numbers), in one request, so an in-engine budget (one request per stream)
  is scored on it too. Correct when the code is restated (the count's completeness is
  reported beside it). Made for a real instruct model (Qwen2.5-Coder-1.5B); SmolLM2 rarely
  follows the two-part instruction.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvedit.harness.eval.filler import sentence
from kvedit.harness.eval.tokenizer import ChatTokenizer, load

TASKS = ("count", "recall", "restate")
TOKENS_PER_NUMBER = 5   # ", 123" is 4-5 tokens with SmolLM2's tokenizer (digits split)
PRIMED = 3              # numbers written in the prime: the model continues from S+3
DEPTHS = (0.3, 0.55, 0.8)  # with a 512-token note: all past the first 128-token chunk
_SLOT = "\x00SLOT{}\x00"


@dataclass(frozen=True)
class Turns:
    """Chat-template text around the messages of a two-turn dialogue."""
    before_user: str   # up to the first user message
    after_user: str    # after a user message, up to where the assistant's reply starts
    next_user: str     # after an assistant reply, up to the next user message


@dataclass(frozen=True)
class CountScore:
    produced: int   # expected numbers produced in order before the first wrong one
    expected: int

    @property
    def fraction(self) -> float:
        return self.produced / self.expected if self.expected else 0.0

    @property
    def complete(self) -> bool:
        return self.produced == self.expected


@dataclass(frozen=True)
class Sample:
    task: str                 # "count" or "recall"
    index: int
    prompt_ids: list[int]
    start: int                # count from start ...
    stop: int                 # ... to stop (inclusive)
    max_tokens: int           # generated tokens allowed for the count
    question_ids: list[int]   # recall: the second turn, appended after the count; else []
    code: str | None          # recall: what the answer must contain
    depth: float | None       # recall: where the code sentence lies in the note
    code_position: int | None  # recall: token index of the code sentence in the prompt
    answer_tokens: int = 12

    def score_count(self, text: str) -> CountScore:
        """How far the generated text follows S+3, S+4, ..., E (numbers only, any spacing)."""
        want = range(self.start + PRIMED, self.stop + 1)
        got = [int(x) for x in re.findall(r"\d+", text)]
        n = 0
        for a, b in zip(want, got):
            if a != b:
                break
            n += 1
        return CountScore(n, len(want))

    def recalled(self, answer: str) -> bool:
        """The code appears in the answer as a whole number."""
        return self.code in re.findall(r"\d+", answer)

    def correct(self, generated: str) -> bool:
        """count: the whole count; restate: the code in the reply (5 digits: no counted
        number has as many); recall is scored on its second turn's answer instead."""
        if self.task == "restate":
            return self.recalled(generated)
        return self.score_count(generated).complete


@lru_cache(maxsize=4)
def turns(model_dir: str | Path) -> Turns:
    """Render the model's chat template around placeholders (user, assistant, user)."""
    template = Path(model_dir) / "chat_template.jinja"
    if not template.exists():
        return Turns("", "\nAnswer:", "\n\n")
    import json

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    cfg_path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    specials = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    msgs = [{"role": r, "content": _SLOT.format(i)}
            for i, r in enumerate(("user", "assistant", "user"))]
    text = env.from_string(template.read_text()).render(messages=msgs,
                                                        add_generation_prompt=True, **specials)
    parts = re.split("\x00SLOT\\d\x00", text)
    if len(parts) != 4:
        raise ValueError(f"{template}: the chat template does not render a user, assistant, "
                         f"user dialogue with each message once")
    return Turns(parts[0], parts[3], parts[2])


def _count_instruction(start: int, stop: int) -> str:
    return f"Count from {start} to {stop}, separated by commas. Write every number."


def _prime(start: int) -> str:
    return ", ".join(str(start + i) for i in range(PRIMED)) + ","


def _numbers(rng: random.Random, how_many: int) -> tuple[int, int]:
    start = rng.randrange(100, 600)   # three-digit numbers throughout
    return start, start + how_many - 1


def count_sample(tok: ChatTokenizer, t: Turns, rng: random.Random, index: int,
                 how_many: int) -> Sample:
    start, stop = _numbers(rng, how_many)
    ids = tok.encode(t.before_user + _count_instruction(start, stop) + t.after_user
                     + _prime(start))
    return Sample("count", index, ids, start, stop, TOKENS_PER_NUMBER * how_many + 16, [],
                  None, None, None)


def recall_sample(tok: ChatTokenizer, t: Turns, rng: random.Random, index: int,
                  how_many: int, note_tokens: int) -> Sample:
    """A note of about note_tokens filler tokens with the code sentence at a depth."""
    start, stop = _numbers(rng, how_many)
    code = str(rng.randrange(10_000, 100_000))
    depth = DEPTHS[index % len(DEPTHS)]
    ids = tok.encode(t.before_user + "Read this note carefully and remember the secret code "
                                     "in it.\n\nNote:")
    sentences: list[list[int]] = []
    while sum(map(len, sentences)) < note_tokens:
        sentences.append(tok.encode(" " + sentence(rng)))
    at = round(depth * len(sentences))
    for s in sentences[:at]:
        ids += s
    position = len(ids)
    ids += tok.encode(f" The secret code is {code}.")
    for s in sentences[at:]:
        ids += s
    ids += tok.encode("\n\nFirst, c" + _count_instruction(start, stop)[1:] + t.after_user
                      + _prime(start))
    question = tok.encode(t.next_user + "What is the secret code in the note?" + t.after_user
                          + "The secret code is")
    return Sample("recall", index, ids, start, stop, TOKENS_PER_NUMBER * how_many + 16,
                  question, code, depth, position)


def restate_sample(tok: ChatTokenizer, t: Turns, rng: random.Random, index: int,
                   how_many: int, note_tokens: int) -> Sample:
    """recall's note and count, with the code asked for at the end of the same reply."""
    r = recall_sample(tok, t, rng, index, how_many, note_tokens)
    head = r.prompt_ids[:len(r.prompt_ids) - len(tok.encode(
        "\n\nFirst, c" + _count_instruction(r.start, r.stop)[1:] + t.after_user
        + _prime(r.start)))]
    ids = head + tok.encode(
        "\n\nFirst, c" + _count_instruction(r.start, r.stop)[1:] + " Then, on a new line, "
        "write \"The secret code is\" followed by the secret code from the note."
        + t.after_user + _prime(r.start))
    return Sample("restate", index, ids, r.start, r.stop, r.max_tokens + r.answer_tokens, [],
                  r.code, r.depth, r.code_position)


def samples(model_dir: str | Path, task: str, n: int, *, how_many: int = 200,
            note_tokens: int = 512, seed: int = 0) -> list[Sample]:
    """n seeded samples of `task` (count or recall) for the model's tokenizer/template."""
    if task not in TASKS:
        raise ValueError(f"unknown long-generation task {task!r}; expected one of {TASKS}")
    if how_many <= PRIMED:
        raise ValueError(f"how_many must be more than the {PRIMED} primed numbers, got "
                         f"{how_many}")
    tok, t = load(model_dir), turns(model_dir)
    rng = random.Random(f"longgen-{task}-{seed}")
    if task == "count":
        return [count_sample(tok, t, rng, i, how_many) for i in range(n)]
    make = recall_sample if task == "recall" else restate_sample
    return [make(tok, t, rng, i, how_many, note_tokens) for i in range(n)]
