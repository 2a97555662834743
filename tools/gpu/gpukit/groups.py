"""The kit's contents: groups of wheels, each read from one data file in `tools/gpu/groups/`.

A group is what one job on the GPU host needs whole before it can start (the vLLM site, the
kvpress site, the model's 22 parts), so the groups are also the order of the stream: the
earlier a group's last byte arrives, the earlier its job overlaps the remaining transfers.
The files are data so that a wheel can be added or pinned without touching code.

A line: `name==version [sha256=HEX] [platform=TAG]` (`platform`: one more manylinux tag that
pip must accept for that wheel). `accept NAME  # why`: a requirement of a wheel in the group
that the kit ships on purpose without (the check reports it as accepted, not missing).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
GROUP_DIR = HERE / "groups"
# Stream order; `site`: where the host installs the group (None: the model's parts).
# base first (small: the model's conversion needs it), then the model's parts (its conversion
# then runs while the vLLM wheel arrives), vLLM, kvpress.
ORDER = ("base", "model", "vllm", "kvpress")
SITES = {"base": "base-site", "vllm": "vllm-site", "kvpress": "kvpress-site", "model": None}

_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)"
                   r"(?P<opts>(?:\s+\w+=\S+)*)\s*$")
_HEX = re.compile(r"^[0-9a-f]{64}$")


def normalize(name: str) -> str:
    """PEP 503 name (what pip compares) and the wheel filename's form of it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_prefix(name: str, version: str) -> str:
    """How a wheel file of name==version starts (`pydantic_core-2.50.5-`)."""
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


@dataclass(frozen=True)
class Entry:
    name: str
    version: str
    sha256: str | None = None
    platform: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    def matches(self, filename: str) -> bool:
        return filename.lower().startswith(wheel_prefix(self.name, self.version)) \
            and filename.endswith(".whl")


@dataclass(frozen=True)
class Group:
    name: str
    entries: tuple[Entry, ...]
    accepted: dict[str, str] = field(default_factory=dict)  # requirement name -> why

    @property
    def site(self) -> str | None:
        return SITES.get(self.name)


class GroupFileError(ValueError):
    """A line of a group file could not be read; the message names the file and line."""


def parse(text: str, name: str, source: str = "<text>") -> Group:
    entries: list[Entry] = []
    accepted: dict[str, str] = {}
    for no, raw in enumerate(text.splitlines(), 1):
        line, _, comment = raw.partition("#")
        line = line.strip()
        if not line:
            continue
        if line.startswith("accept "):
            for req in line.split()[1:]:
                accepted[normalize(req)] = comment.strip()
            continue
        m = _LINE.match(line)
        if not m:
            raise GroupFileError(f"{source}:{no}: expected `name==version [sha256=HEX] "
                                 f"[platform=TAG]` or `accept NAME`, got {raw.strip()!r}")
        opts = dict(o.split("=", 1) for o in m["opts"].split())
        unknown = set(opts) - {"sha256", "platform"}
        if unknown:
            raise GroupFileError(f"{source}:{no}: unknown option(s) {sorted(unknown)}; "
                                 f"expected sha256= or platform=")
        sha = opts.get("sha256")
        if sha is not None and not _HEX.match(sha):
            raise GroupFileError(f"{source}:{no}: sha256 must be 64 lowercase hex digits")
        entries.append(Entry(m["name"], m["version"], sha, opts.get("platform")))
    seen: set[str] = set()
    for e in entries:
        if normalize(e.name) in seen:
            raise GroupFileError(f"{source}: {e.name} is listed twice (two versions of one "
                                 f"package stop the whole install)")
        seen.add(normalize(e.name))
    return Group(name, tuple(entries), accepted)


def load(name: str, directory: Path = GROUP_DIR) -> Group:
    path = directory / f"{name}.txt"
    return parse(path.read_text(), name, str(path))


def load_all(directory: Path = GROUP_DIR) -> list[Group]:
    return [load(n, directory) for n in ORDER]
