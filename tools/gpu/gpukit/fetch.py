"""Getting each wheel of a group into `.gpu_kit/files/<group>/`, hash-checked.

pip downloads for the GPU host, not for this machine: CPython 3.12 on manylinux x86_64,
binary wheels only, no dependencies (every wheel the host needs is named in a group file).
A wheel already there, or in a folder given with `--from` (a copy fetched earlier), is
reused when its hash matches the pin, so a second build downloads nothing.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from gpukit.groups import Entry, Group

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
PIP_TARGET = ("--python-version", "3.12", "--implementation", "cp")


class FetchError(RuntimeError):
    """A wheel could not be had, or its bytes are not the pinned ones."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download_command(entries: Iterable[Entry], dest: Path) -> list[str]:
    entries = list(entries)
    platforms = list(PLATFORMS)
    for e in entries:
        if e.platform and e.platform not in platforms:
            platforms.append(e.platform)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", *PIP_TARGET]
    for p in platforms:
        cmd += ["--platform", p]
    return cmd + ["-d", str(dest), *(e.requirement for e in entries)]


def find_wheel(entry: Entry, folder: Path) -> Path | None:
    if not folder.is_dir():
        return None
    hits = sorted(p for p in folder.iterdir() if entry.matches(p.name))
    return hits[0] if hits else None


def _accept(entry: Entry, path: Path) -> str:
    """The file's sha256 if it is the pinned wheel; raises FetchError naming both hashes."""
    got = sha256_of(path)
    if entry.sha256 and got != entry.sha256:
        raise FetchError(f"{path.name} ({entry.requirement}): sha256 {got}, but the group file "
                         f"pins {entry.sha256}. The index serves other bytes than when it was "
                         f"pinned: check which is right before changing the pin.")
    return got


def fetch_group(group: Group, dest: Path, reuse: Iterable[Path] = (),
                log: Callable[[str], None] = print) -> list[tuple[Entry, Path, str]]:
    """Every entry of `group` as (entry, file in `dest`, sha256), in the group's order."""
    dest.mkdir(parents=True, exist_ok=True)
    reuse = list(reuse)
    have: dict[Entry, tuple[Path, str]] = {}
    missing: list[Entry] = []
    for e in group.entries:
        found = find_wheel(e, dest)
        if found is None:
            for folder in reuse:
                src = find_wheel(e, folder)
                if src is not None:
                    _accept(e, src)
                    found = dest / src.name
                    shutil.copyfile(src, found)
                    log(f"  {e.requirement}: reused {src}")
                    break
        if found is None:
            missing.append(e)
        else:
            have[e] = (found, _accept(e, found))
    # one pip call per distinct extra platform (pip matches platform tags exactly; a tag
    # added for one wheel could pick another build of the others)
    by_platform: dict[str | None, list[Entry]] = {}
    for e in missing:
        by_platform.setdefault(e.platform, []).append(e)
    for platform, entries in by_platform.items():
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".dl-") as tmp:
            cmd = pip_download_command(entries, Path(tmp))
            log(f"  pip download {' '.join(e.requirement for e in entries)}"
                + (f" (+{platform})" if platform else ""))
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-6:])
                raise FetchError(f"pip download failed for {group.name}:\n{tail}\n"
                                 f"command: {' '.join(cmd)}")
            for e in entries:
                src = find_wheel(e, Path(tmp))
                if src is None:
                    raise FetchError(f"pip saved no wheel for {e.requirement} (cp312 "
                                     f"manylinux x86_64); add a platform= tag to its line")
                sha = _accept(e, src)
                target = dest / src.name
                shutil.move(src, target)
                have[e] = (target, sha)
    stale = {p.name for p in dest.iterdir() if p.is_file()} - {p.name for p, _ in have.values()}
    for name in sorted(stale):  # a wheel of a version no longer listed
        (dest / name).unlink()
        log(f"  removed {name} (not in the group file any more)")
    return [(e, *have[e]) for e in group.entries]
