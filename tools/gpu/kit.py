"""The GPU kit: everything a fresh GPU host with no package registry needs, in device calls.

    python tools/gpu/kit.py build [--from DIR ...] [--margin-mib M] [--pin]
    python tools/gpu/kit.py plan [--json]
    python tools/gpu/kit.py check

`build` fetches the wheels of `tools/gpu/groups/*.txt` for CPython 3.12 manylinux x86_64
(hash-checked against the pins; `--from DIR`: folders holding copies fetched earlier, used
before pip), checks each group's requirements against the image (`check`), and cuts the
payload into parts that each fit one device call beside the travelling checkout, under
`.gpu_kit/` (ignored). Run again, it downloads nothing and only re-cuts the parts (do so
when the checkout has grown). `plan` prints the device calls: command and carry of each,
their sizes and an estimate of their device time. docs/gpu.md ("The kit") says more.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gpukit import fetch, groups, pack, plan, requires, tree

ROOT = Path(__file__).resolve().parents[2]
KIT_DIR = ROOT / ".gpu_kit"
FILES = KIT_DIR / "files"
SEND = KIT_DIR / "send"
DEFAULT_MARGIN_MIB = 2.5


def _pin(group: groups.Group, fetched, path: Path) -> int:
    """Write the sha256 of every unpinned line of `group`'s file; returns how many."""
    shas = {e.requirement: sha for e, _, sha in fetched if e.sha256 is None}
    if not shas:
        return 0
    out = []
    for raw in path.read_text().splitlines():
        code = raw.split("#", 1)[0].split()
        if code and code[0] in shas:
            raw = raw.replace(code[0], f"{code[0]} sha256={shas[code[0]]}", 1)
        out.append(raw)
    path.write_text("\n".join(out) + "\n")
    return len(shas)


def _check(all_groups, fetched, verbose: bool = False) -> tuple[list[str], int]:
    """Report lines and the number of requirements missing or outside the image's version."""
    image = requires.load_image()
    lines, bad = [], 0
    for g in all_groups:
        base = next((b for b in all_groups if b.name == "base"), None)
        verdicts = requires.check_group(g, [p for _, p, _ in fetched[g.name]], image,
                                        under=base if g.site else None)
        lines += requires.report(g, verdicts, verbose)
        bad += requires.problems(verdicts)
    return lines, bad


def build(args) -> int:
    all_groups = groups.load_all()
    fetched = {}
    t0 = time.monotonic()
    for g in all_groups:
        print(f"{g.name}: {len(g.entries)} wheels")
        fetched[g.name] = fetch.fetch_group(g, FILES / g.name, [Path(d) for d in args.sources])
        unpinned = [e.requirement for e, _, _ in fetched[g.name] if e.sha256 is None]
        if args.pin:
            n = _pin(g, fetched[g.name], groups.GROUP_DIR / f"{g.name}.txt")
            if n:
                print(f"  pinned {n} sha256 in tools/gpu/groups/{g.name}.txt")
        elif unpinned:
            print(f"  not pinned (recorded in the manifest; --pin writes them): "
                  f"{' '.join(unpinned)}")
    lines, bad = _check(all_groups, fetched)
    print(f"requirements against the image: {bad} missing or of another version")
    print("\n".join(lines))
    tree_now = tree.tree_bytes(ROOT)
    margin = int(args.margin_mib * 2**20)
    part_bytes = pack.part_bytes_for(tree_now, margin)
    stream = [(g.name, p, sha) for g in all_groups for _, p, sha in fetched[g.name]]
    meta = {"tree_bytes": tree_now, "margin_bytes": margin,
            "sites": {g.name: g.site for g in all_groups}, "order": list(groups.ORDER)}
    manifest = pack.write_parts(stream, part_bytes, SEND, meta)
    mib = 2**20
    print(f"kit {manifest['kit']}: {len(stream)} files, {manifest['total_bytes'] / mib:.1f} MiB "
          f"in {len(manifest['parts'])} parts of {part_bytes / mib:.2f} MiB (tree "
          f"{tree_now / mib:.2f} MiB + margin {margin / mib:.1f} MiB) under "
          f"{SEND.relative_to(ROOT)}/ in {time.monotonic() - t0:.0f} s")
    print("next: python tools/gpu/kit.py plan")
    return 0


def show_plan(args) -> int:
    manifest = pack.load_manifest(SEND)
    tree_now = tree.tree_bytes(ROOT)
    try:
        calls = plan.plan(manifest, tree_now)
    except plan.PlanError as e:
        print(f"kit.py plan: {e}", file=sys.stderr)
        return 1
    if args.json:
        print("[\n" + ",\n".join(json.dumps(c.as_json()) for c in calls) + "\n]")
    else:
        print(plan.render(calls, manifest, tree_now))
    return 0


def check(args) -> int:
    all_groups = groups.load_all()
    fetched = {}
    for g in all_groups:
        rows = []
        for e in g.entries:
            found = fetch.find_wheel(e, FILES / g.name)
            if found is None:
                print(f"kit.py check: {e.requirement} is not in {FILES / g.name}: run build",
                      file=sys.stderr)
                return 1
            rows.append((e, found, e.sha256 or ""))
        fetched[g.name] = rows
    lines, bad = _check(all_groups, fetched, args.verbose)
    print("\n".join(lines))
    print(f"{bad} requirement(s) missing or of another version")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kit.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="fetch the wheels and cut the parts")
    b.add_argument("--from", dest="sources", action="append", default=[], metavar="DIR",
                   help="a folder of wheels fetched earlier (used when the hash matches)")
    b.add_argument("--margin-mib", type=float, default=DEFAULT_MARGIN_MIB,
                   help="room kept for the checkout to grow before the calls "
                        f"(default {DEFAULT_MARGIN_MIB})")
    b.add_argument("--pin", action="store_true",
                   help="write the sha256 of unpinned wheels into their group files")
    b.set_defaults(func=build)
    pl = sub.add_parser("plan", help="print the device calls")
    pl.add_argument("--json", action="store_true", help="only [{command, carry}, ...]")
    pl.set_defaults(func=show_plan)
    c = sub.add_parser("check", help="each group's requirements against the GPU image")
    c.add_argument("--verbose", action="store_true", help="list every verdict")
    c.set_defaults(func=check)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except (fetch.FetchError, groups.GroupFileError, pack.PackError) as e:
        print(f"kit.py {args.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
