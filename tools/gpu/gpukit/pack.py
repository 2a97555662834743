"""The payload as one stream of bytes, cut into parts that each fit one device call.

Every file of every group, in stream order, is concatenated; the stream is cut every
`part_bytes` (only the last part is shorter), so no call carries bytes it has no use for and
the number of calls is the least the limit allows. The manifest says where each file lies
in the stream and every file's and part's sha256: the host reassembles a file as soon as the
parts that hold it have arrived, and checks both.

Layout on disk: `.gpu_kit/send/NN/` holds part `pNN` and a copy of `manifest.json`; call NN
carries that one folder.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from gpukit.tree import LIMIT

FORMAT = "kvedit-gpu-kit/1"
MANIFEST_RESERVE = 256 * 1024  # room for the manifest copy each call carries
ALIGN = 64 * 1024


@dataclass(frozen=True)
class FileRec:
    group: str
    name: str
    size: int
    sha256: str
    offset: int


@dataclass(frozen=True)
class PartRec:
    name: str
    offset: int
    size: int
    sha256: str


class PackError(ValueError):
    """The payload cannot be cut as asked (a part would not fit beside the tree)."""


def part_name(index: int) -> str:
    """Part `index` (0-based) as named on disk and in the plan: p01, p02, ..."""
    return f"p{index + 1:02d}"


def part_bytes_for(tree: int, margin: int, limit: int = LIMIT) -> int:
    """The largest part that fits one call beside a tree of `tree` bytes, keeping `margin`
    bytes for the tree to grow between the build and the calls."""
    size = (limit - tree - margin - MANIFEST_RESERVE) // ALIGN * ALIGN
    if size < 4 * 2**20:
        raise PackError(f"the travelling tree is {tree / 2**20:.1f} MiB: with a margin of "
                        f"{margin / 2**20:.1f} MiB a part would be under 4 MiB of the "
                        f"{limit / 2**20:.0f} MiB a call carries; shrink the tree")
    return size


def layout(files: list[tuple[str, Path, str]]) -> list[FileRec]:
    """(group, path, sha256) in stream order -> their records with stream offsets."""
    out, offset = [], 0
    for group, path, sha in files:
        size = path.stat().st_size
        out.append(FileRec(group, path.name, size, sha, offset))
        offset += size
    return out


def parts_of(rec: FileRec, part_bytes: int) -> range:
    """Indexes (0-based) of the parts that hold `rec`'s bytes."""
    if rec.size == 0:
        return range(rec.offset // part_bytes, rec.offset // part_bytes + 1)
    return range(rec.offset // part_bytes, (rec.offset + rec.size - 1) // part_bytes + 1)


def completes_at(recs: list[FileRec], part_bytes: int) -> dict[str, int]:
    """group -> index of the part whose arrival completes it (its last byte's part)."""
    out: dict[str, int] = {}
    for r in recs:
        out[r.group] = max(out.get(r.group, 0), parts_of(r, part_bytes)[-1])
    return out


def write_parts(files: list[tuple[str, Path, str]], part_bytes: int, send: Path,
                meta: dict | None = None) -> dict:
    """Cut the stream of `files` into `send/NN/pNN`, write the manifest beside each part and
    return it. `send` is replaced whole (built beside it, then renamed)."""
    recs = layout(files)
    total = sum(r.size for r in recs)
    count = max(1, -(-total // part_bytes))
    tmp = send.with_name(send.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    parts: list[PartRec] = []
    index, written, h, out = 0, 0, hashlib.sha256(), None

    def close() -> None:
        nonlocal out
        if out is not None:
            out.close()
            parts.append(PartRec(part_name(index), index * part_bytes, written, h.hexdigest()))
            out = None

    def open_part() -> None:
        nonlocal out, written, h
        folder = tmp / f"{index + 1:02d}"
        folder.mkdir()
        out, written, h = open(folder / part_name(index), "wb"), 0, hashlib.sha256()

    open_part()
    for _, path, _ in files:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                while block:
                    if written == part_bytes:
                        close()
                        index += 1
                        open_part()
                    take = block[:part_bytes - written]
                    out.write(take)
                    h.update(take)
                    written += len(take)
                    block = block[len(take):]
    close()
    assert len(parts) == count, (len(parts), count)
    kit = hashlib.sha256("".join(p.sha256 for p in parts).encode()).hexdigest()[:12]
    manifest = {"format": FORMAT, "kit": kit, "part_bytes": part_bytes, "total_bytes": total,
                **(meta or {}),
                "files": [asdict(r) for r in recs], "parts": [asdict(p) for p in parts]}
    text = json.dumps(manifest, indent=1) + "\n"
    if len(text.encode()) > MANIFEST_RESERVE:
        raise PackError(f"the manifest is {len(text)} bytes, over the "
                        f"{MANIFEST_RESERVE} reserved beside each part")
    for p in range(count):
        (tmp / f"{p + 1:02d}" / "manifest.json").write_text(text)
    shutil.rmtree(send, ignore_errors=True)
    tmp.rename(send)
    return manifest


def load_manifest(send: Path) -> dict:
    """The manifest of a built kit (any part folder holds the same copy)."""
    copies = sorted(send.glob("*/manifest.json"))
    if not copies:
        raise FileNotFoundError(f"no kit in {send}: run `python tools/gpu/kit.py build`")
    return json.loads(copies[0].read_text())


def file_recs(manifest: dict) -> list[FileRec]:
    return [FileRec(**r) for r in manifest["files"]]


def part_recs(manifest: dict) -> list[PartRec]:
    return [PartRec(**p) for p in manifest["parts"]]
