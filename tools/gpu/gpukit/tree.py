"""What travels with every device call besides the carried part: the working tree.

The device tool sends the tracked files and the untracked files git does not ignore (plus
the carried paths), 64 MiB in all per call. A part is sized against that sum, so the tree's
size is measured the same way here: `git ls-files` (cached, and others without the ignored).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

LIMIT = 64 * 2**20  # bytes one call may carry: tree + carried paths


def travelling_files(root: Path) -> list[Path]:
    out: list[Path] = []
    for extra in ([], ["--others", "--exclude-standard"]):
        r = subprocess.run(["git", "ls-files", "-z", *extra], cwd=root, capture_output=True,
                           check=True)
        out += [root / p for p in r.stdout.decode("utf-8", "surrogateescape").split("\0") if p]
    return out


def tree_bytes(root: Path) -> int:
    """Bytes of the working tree a device call sends (a deleted tracked file counts 0)."""
    total = 0
    seen: set[Path] = set()
    for path in travelling_files(root):
        if path in seen:
            continue
        seen.add(path)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not os.path.isdir(path):   # a submodule lists as its folder: its files don't travel
            total += st.st_size
    return total
