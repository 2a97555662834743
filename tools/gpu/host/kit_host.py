"""Host side of the GPU kit: receive a part, rebuild the files it completes, say what is ready.

Runs on the GPU host with its own python3 (standard library only), called by recv.sh,
start.sh and ready.sh. The kit's state lives in one folder outside the checkout (`--kit`,
default $HOME/kit): `manifest.json`, `parts/pNN` (moved out of the checkout as they arrive,
so a later call does not carry them again), `files/<group>/<wheel>` (each written under a
temporary name and renamed only once its sha256 matches the manifest).

    kit_host.py [--kit DIR] receive NN --repo REPO   move part NN in, rebuild completed files
    kit_host.py [--kit DIR] complete-groups           groups whose files are all here
    kit_host.py [--kit DIR] need GROUP                 exit 1, naming what is missing
    kit_host.py [--kit DIR] files GROUP                the group's files, one path a line
    kit_host.py [--kit DIR] all-parts                  exit 1, naming the parts not here
    kit_host.py [--kit DIR] verify                     re-hash every file
    kit_host.py [--kit DIR] status                     parts here and missing
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

FORMAT = "kvedit-gpu-kit/1"
SEND = Path(".gpu_kit") / "send"
BLOCK = 1 << 20


class KitError(Exception):
    """Something the person running the calls must fix; the message says what."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


class Kit:
    def __init__(self, root: Path):
        self.root = root
        self.manifest_path = root / "manifest.json"
        self._manifest: dict | None = None

    @property
    def manifest(self) -> dict:
        if self._manifest is None:
            if not self.manifest_path.exists():
                raise KitError(f"no kit in {self.root} yet: run the first call (recv.sh 01) "
                               f"with its carried folder")
            self._manifest = json.loads(self.manifest_path.read_text())
        return self._manifest

    def adopt(self, carried: Path) -> None:
        """Take the carried manifest as the kit's, or check it is the same kit."""
        new = json.loads(carried.read_text())
        if new.get("format") != FORMAT:
            raise KitError(f"{carried}: format {new.get('format')!r}, expected {FORMAT!r}")
        if self.manifest_path.exists():
            old = self.manifest
            if old["kit"] != new["kit"]:
                raise KitError(
                    f"{self.root} holds parts of kit {old['kit']}, this call carries kit "
                    f"{new['kit']} (the kit was rebuilt between calls): run every call of "
                    f"the new plan from call 1 after `rm -rf {self.root}`, or set KIT to "
                    f"another folder")
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.manifest_path.with_suffix(".tmp")
        shutil.copyfile(carried, tmp)
        os.replace(tmp, self.manifest_path)
        self._manifest = new

    # parts -----------------------------------------------------------------------------
    def part(self, number: int) -> dict:
        parts = self.manifest["parts"]
        if not 1 <= number <= len(parts):
            raise KitError(f"part {number} does not exist: the kit has parts 1-{len(parts)}")
        return parts[number - 1]

    def part_path(self, rec: dict) -> Path:
        return self.root / "parts" / rec["name"]

    def part_here(self, rec: dict) -> bool:
        p = self.part_path(rec)
        return p.is_file() and p.stat().st_size == rec["size"]

    def receive(self, number: int, repo: Path) -> str:
        folder = repo / SEND / f"{number:02d}"
        carried_manifest = folder / "manifest.json"
        if carried_manifest.exists():
            self.adopt(carried_manifest)
        rec = self.part(number)
        src, dest = folder / rec["name"], self.part_path(rec)
        if src.exists():
            size, sha = src.stat().st_size, sha256_of(src)
            if size != rec["size"] or sha != rec["sha256"]:
                raise KitError(
                    f"part {rec['name']} is corrupt: {size} bytes, sha256 {sha}; the manifest "
                    f"says {rec['size']} bytes, sha256 {rec['sha256']}. Send it again (the "
                    f"same call), or rebuild the kit if it is corrupt where it was built")
            if self.part_here(rec) and sha256_of(dest) == rec["sha256"]:
                src.unlink()
                how = "already here"
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.tmp")
                shutil.move(str(src), str(tmp))
                os.replace(tmp, dest)
                how = "received"
            shutil.rmtree(folder, ignore_errors=True)
        elif self.part_here(rec):
            how = "already here"
        else:
            raise KitError(f"part {rec['name']} is not here: neither {src} (the call must "
                           f"carry {SEND / f'{number:02d}'}) nor {dest}")
        self.rebuild_files()
        return how

    def missing_parts(self) -> list[str]:
        return [p["name"] for p in self.manifest["parts"] if not self.part_here(p)]

    # files -----------------------------------------------------------------------------
    def file_path(self, rec: dict) -> Path:
        return self.root / "files" / rec["group"] / rec["name"]

    def parts_of(self, rec: dict) -> list[dict]:
        size = self.manifest["part_bytes"]
        first = rec["offset"] // size
        last = (rec["offset"] + max(rec["size"], 1) - 1) // size
        return self.manifest["parts"][first:last + 1]

    def rebuild_files(self) -> list[str]:
        """Write every file whose parts are all here and that is not written yet."""
        made = []
        for rec in self.manifest["files"]:
            out = self.file_path(rec)
            if out.exists() or not all(self.part_here(p) for p in self.parts_of(rec)):
                continue
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp")
            h = hashlib.sha256()
            with open(tmp, "wb") as w:
                for p in self.parts_of(rec):
                    start = max(rec["offset"], p["offset"])
                    end = min(rec["offset"] + rec["size"], p["offset"] + p["size"])
                    with open(self.part_path(p), "rb") as f:
                        f.seek(start - p["offset"])
                        left = end - start
                        while left:
                            block = f.read(min(BLOCK, left))
                            if not block:
                                raise KitError(f"part {p['name']} ended early")
                            w.write(block)
                            h.update(block)
                            left -= len(block)
            if h.hexdigest() != rec["sha256"]:
                tmp.unlink()
                raise KitError(f"{rec['name']} rebuilt from parts "
                               f"{', '.join(p['name'] for p in self.parts_of(rec))} has sha256 "
                               f"{h.hexdigest()}, the manifest says {rec['sha256']}")
            os.replace(tmp, out)
            made.append(rec["name"])
        return made

    def group_files(self, group: str) -> list[dict]:
        recs = [r for r in self.manifest["files"] if r["group"] == group]
        if not recs:
            groups = sorted({r["group"] for r in self.manifest["files"]})
            raise KitError(f"the kit has no group {group!r}; it has {', '.join(groups)}")
        return recs

    def groups(self) -> list[str]:
        order = self.manifest.get("order") or []
        present = []
        for r in self.manifest["files"]:
            if r["group"] not in present:
                present.append(r["group"])
        return [g for g in order if g in present] + [g for g in present if g not in order]

    def complete(self, group: str) -> bool:
        return all(self.file_path(r).exists() for r in self.group_files(group))

    def need(self, group: str) -> None:
        absent = [r for r in self.group_files(group) if not self.file_path(r).exists()]
        if absent:
            parts = sorted({p["name"] for r in absent for p in self.parts_of(r)
                            if not self.part_here(p)})
            raise KitError(f"{group}: {len(absent)} file(s) not rebuilt yet "
                           f"({', '.join(r['name'] for r in absent[:3])}"
                           f"{', ...' if len(absent) > 3 else ''}); parts not here: "
                           f"{', '.join(parts) or 'none (run recv.sh again)'}")

    def verify(self) -> list[str]:
        bad = []
        for rec in self.manifest["files"]:
            path = self.file_path(rec)
            if not path.exists():
                bad.append(f"{rec['group']}/{rec['name']}: missing")
            elif sha256_of(path) != rec["sha256"]:
                bad.append(f"{rec['group']}/{rec['name']}: sha256 differs from the manifest")
        return bad

    def status(self) -> str:
        parts = self.manifest["parts"]
        missing = self.missing_parts()
        done = [g for g in self.groups() if self.complete(g)]
        waiting = [g for g in self.groups() if g not in done]
        return (f"kit {self.manifest['kit']}: {len(parts) - len(missing)} of {len(parts)} parts "
                f"here{'; missing ' + ' '.join(missing) if missing else ''}; groups complete: "
                f"{' '.join(done) or 'none'}"
                + (f"; waiting: {' '.join(waiting)}" if waiting else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kit_host.py")
    p.add_argument("--kit", default=os.environ.get("KIT") or str(Path.home() / "kit"))
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("receive")
    r.add_argument("number", type=int)
    r.add_argument("--repo", required=True)
    for name in ("need", "files"):
        sub.add_parser(name).add_argument("group")
    for name in ("complete-groups", "all-parts", "verify", "status", "id"):
        sub.add_parser(name)
    args = p.parse_args(argv)
    kit = Kit(Path(args.kit))
    try:
        if args.cmd == "receive":
            how = kit.receive(args.number, Path(args.repo))
            print(f"[kit] part {args.number:02d} {how}; {kit.status()}")
        elif args.cmd == "complete-groups":
            print("\n".join(g for g in kit.groups() if kit.complete(g)))
        elif args.cmd == "need":
            kit.need(args.group)
        elif args.cmd == "files":
            kit.need(args.group)
            print("\n".join(str(kit.file_path(r)) for r in kit.group_files(args.group)))
        elif args.cmd == "all-parts":
            missing = kit.missing_parts()
            if missing:
                raise KitError(f"parts not here: {' '.join(missing)}: run their calls "
                               f"(recv.sh NN), then ready.sh again")
        elif args.cmd == "verify":
            bad = kit.verify()
            if bad:
                raise KitError("files that do not match the manifest:\n  " + "\n  ".join(bad))
            print(f"[kit] {len(kit.manifest['files'])} files match the manifest's sha256")
        elif args.cmd == "status":
            print(f"[kit] {kit.status()}")
        elif args.cmd == "id":
            print(kit.manifest["kit"])
    except KitError as e:
        print(f"[kit] ERROR: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
