"""Does each group, laid over the GPU image, hold what its wheels require?

Nothing can be installed on the host from a registry, so every requirement of a wheel in a
group (its `Requires-Dist`, markers evaluated for CPython 3.12 on Linux x86_64, no extras)
must be met by a wheel of the same group or by a package of the image (`image.txt`: what
the image was seen to hold, with its version where one was read). The verdicts: met, met
by the image at an unknown version, the image's version outside the range, accepted
(named in the group file with why), or missing.
"""
from __future__ import annotations

import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from gpukit.groups import HERE, Group, normalize

IMAGE_FILE = HERE / "image.txt"
HOST_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "platform_machine": "x86_64", "extra": ""}


@dataclass(frozen=True)
class Verdict:
    wheel: str
    requirement: str
    status: str   # met | image-unknown-version | image-version | accepted | missing
    detail: str = ""


def load_image(path: Path = IMAGE_FILE) -> dict[str, str | None]:
    """name -> version (None where only the name was read)."""
    out: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].split()
        if line:
            out[normalize(line[0])] = line[1] if len(line) > 1 else None
    return out


def wheel_requires(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = Parser().parsestr(z.read(meta).decode("utf-8", "replace"))
    out = []
    for line in msg.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate(HOST_ENV):
            out.append(req)
    return out


def _version_ok(req: Requirement, version: str) -> bool:
    try:
        return req.specifier.contains(Version(version.split("+")[0]), prereleases=True)
    except InvalidVersion:
        return False


def check_group(group: Group, wheels: list[Path],
                image: dict[str, str | None], under: Group | None = None) -> list[Verdict]:
    """`under`: a group whose site lies under this one's on PYTHONPATH (the base site), so
    its wheels count as this group's own."""
    own = {normalize(e.name): e.version for e in group.entries}
    if under is not None and under is not group:
        own = {**{normalize(e.name): e.version for e in under.entries}, **own}
    out = []
    for path in wheels:
        for req in wheel_requires(path):
            name = normalize(req.name)
            text = str(req)
            if name in own and _version_ok(req, own[name]):
                out.append(Verdict(path.name, text, "met"))
            elif name in group.accepted:
                out.append(Verdict(path.name, text, "accepted", group.accepted[name]))
            elif name in own:
                out.append(Verdict(path.name, text, "missing", f"the group has {own[name]}"))
            elif name in image:
                version = image[name]
                if version is None:
                    out.append(Verdict(path.name, text, "image-unknown-version"))
                elif _version_ok(req, version):
                    out.append(Verdict(path.name, text, "met", f"image {version}"))
                else:
                    out.append(Verdict(path.name, text, "image-version", f"image has {version}"))
            else:
                out.append(Verdict(path.name, text, "missing"))
    return out


def report(group: Group, verdicts: list[Verdict], verbose: bool = False) -> list[str]:
    """Lines for what needs a look: every requirement missing or outside the image's version,
    then counts of the accepted and of those the image meets at a version never read (each
    listed with `verbose`)."""
    lines = [f"  {group.name}: {v.status:14s} {v.requirement} <- {v.wheel}"
             + (f"  ({v.detail})" if v.detail else "")
             for v in verdicts if v.status in ("missing", "image-version")]
    for status, what in (("accepted", "accepted as they are (the group file says why)"),
                         ("image-unknown-version", "met by the image at a version not read")):
        these = [v for v in verdicts if v.status == status]
        if these and verbose:
            lines += [f"  {group.name}: {status} {v.requirement} <- {v.wheel}" for v in these]
        elif these:
            names = sorted({normalize(Requirement(v.requirement).name) for v in these})
            lines.append(f"  {group.name}: {len(names)} {what}: {' '.join(names)}")
    return lines


def problems(verdicts: list[Verdict]) -> int:
    return sum(v.status in ("missing", "image-version") for v in verdicts)
