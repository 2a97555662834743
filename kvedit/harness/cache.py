"""Where built models live, and building one into place safely.

Models go under $KVEDIT_CACHE_DIR or ~/.cache/kvedit. Several processes may ask for the same
model at once (pytest workers, a demo beside a test): each builds into its own temp dir next
to the target and renames it into place; the loser discards its copy. A half-built directory
is never at the target path, so "the target exists" means "the build finished".
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("KVEDIT_CACHE_DIR", Path.home() / ".cache" / "kvedit"))


def build_into(target: Path, build: Callable[[Path], object]) -> Path:
    """Run `build(tmp)` and rename tmp to `target` (which must not exist or be empty)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()  # an empty directory the user made for us
        os.rename(tmp, target)
    except OSError:
        if not target.exists():
            raise
        # someone else finished first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
