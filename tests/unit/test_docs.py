"""The front door and the map: README.md stays a front door (at most 12,000 characters), every
relative link in README.md and docs/*.md leads to a file that exists, and docs/modules.md
lists every module under kvedit/ once, in the room (section) whose folder holds it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX = 12_000
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_a_front_door():
    size = len((ROOT / "README.md").read_text())
    assert size <= README_MAX, f"README.md is {size} characters; move detail to docs/"


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def _listed() -> dict[str, list[str]]:
    """module path (kvedit/...) -> the sections of docs/modules.md that list it."""
    out: dict[str, list[str]] = {}
    room = "kvedit/"
    for line in (ROOT / "docs" / "modules.md").read_text().splitlines():
        if line.startswith("## "):
            m = re.search(r"`(kvedit/[\w/]*?)/?`", line)
            room = (m.group(1).rstrip("/") + "/") if m else "kvedit/"
            continue
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for name in re.findall(r"`([\w/]+\.py)`", first):
            path = name if name.startswith("kvedit/") else room + name
            out.setdefault(path, []).append(room)
    return out


def test_modules_md_lists_every_module_once_in_its_room():
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvedit").rglob("*.py")
               if p.name != "__init__.py" or p.parent.name == "lmcache"}
    listed = _listed()
    assert sorted(modules - set(listed)) == [], "add these to docs/modules.md"
    assert sorted(set(listed) - modules) == [], "docs/modules.md lists modules that are gone"
    assert {m: r for m, r in listed.items() if len(r) > 1} == {}, "listed more than once"
