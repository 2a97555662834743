"""The device calls that bring a built kit onto a fresh GPU host, and what they cost.

One call per part, back to back (a machine idle for ~30 s is given back and the next call
gets a bare one). Call NN carries `.gpu_kit/send/NN` and runs `host/recv.sh NN`, which
checks the part, moves it out of the checkout to `$HOME/kit` and starts the job of every
group the part completes (the base site, the model's conversion, the vLLM site, the kvpress
site) in the background, so the installs overlap the transfers still to come. The last call also runs
`host/ready.sh`: it waits for the jobs, checks, and writes `$HOME/env.sh`.

Time per call is estimated from the transfer calls of earlier GPU sessions (docs/gpu.md:
6-17 s each when warm, ~30 s for the call that started the machine, up to ~40 s seen).
"""
from __future__ import annotations

from dataclasses import dataclass

from gpukit.pack import ALIGN, MANIFEST_RESERVE, completes_at, file_recs, part_recs
from gpukit.tree import LIMIT

COMMAND_MAX = 2000
SEND = ".gpu_kit/send"
HOST = "tools/gpu/host"
SAFETY = 512 * 1024        # never plan a call within this of the limit
WARN_BELOW = 2 * 2**20     # say so when the room left is under this
SECONDS_PER_CALL = (8, 12, 40)   # low, typical, high: a warm transfer call
TRANSFER_TIMEOUT_S = 120         # a transfer call takes seconds; never let one hang longer
LAST_TIMEOUT_S = 600             # the last also waits for the jobs (ready.sh: <= 540 s)
START_SECONDS = (30, 60, 180)    # the first call also starts the machine
JOB_NOTES = {
    "vllm": "vLLM site install starts (background)",
    "kvpress": "kvpress site install starts (background)",
    "base": "base site install starts (background: msgspec, pyzmq, gguf)",
    "model": "model conversion starts (background, beside the remaining transfers)",
}


@dataclass(frozen=True)
class Call:
    number: int
    command: str
    carry: tuple[str, ...]
    part: str
    part_bytes: int
    tree_bytes: int
    starts: tuple[str, ...]   # groups whose job this call starts
    timeout_s: int = TRANSFER_TIMEOUT_S

    @property
    def carried_bytes(self) -> int:
        return self.tree_bytes + self.part_bytes + MANIFEST_RESERVE

    def as_json(self) -> dict:
        return {"command": self.command, "carry": list(self.carry), "timeout_s": self.timeout_s}


class PlanError(ValueError):
    """A planned call would not fit (the tree grew since the build): rebuild."""


def plan(manifest: dict, tree_bytes: int, limit: int = LIMIT) -> list[Call]:
    parts = part_recs(manifest)
    done = completes_at(file_recs(manifest), manifest["part_bytes"])
    calls = []
    for i, p in enumerate(parts):
        nn = f"{i + 1:02d}"
        last = i == len(parts) - 1
        command = f"bash {HOST}/recv.sh {nn}" + (f" && bash {HOST}/ready.sh" if last else "")
        starts = tuple(g for g, at in done.items() if at == i)
        call = Call(i + 1, command, (f"{SEND}/{nn}",), p.name, p.size, tree_bytes, starts,
                    LAST_TIMEOUT_S if last else TRANSFER_TIMEOUT_S)
        if len(command) > COMMAND_MAX:
            raise PlanError(f"call {nn}: command of {len(command)} characters "
                            f"(the limit is {COMMAND_MAX})")
        if call.carried_bytes > limit - SAFETY:
            raise PlanError(
                f"call {nn}: part {p.name} ({p.size / 2**20:.1f} MiB) + the travelling tree "
                f"({tree_bytes / 2**20:.2f} MiB) + the manifest = "
                f"{call.carried_bytes / 2**20:.2f} MiB, over {limit / 2**20:.0f} MiB less "
                f"{SAFETY // 1024} KiB. The tree grew since the kit was built: run "
                f"`python tools/gpu/kit.py build` again (it re-cuts the parts; nothing is "
                f"downloaded again)")
        calls.append(call)
    return calls


def headroom(calls: list[Call], limit: int = LIMIT) -> int:
    """The least room any call leaves under the limit, in bytes."""
    return min(limit - c.carried_bytes for c in calls)


def estimate(calls: list[Call]) -> tuple[int, int, int]:
    """Device seconds for the transfer calls (low, typical, high), the machine's start
    included; not the wait for the jobs at the end."""
    n = len(calls)
    return tuple(s + n * c for s, c in zip(START_SECONDS, SECONDS_PER_CALL))


def margin_for_one_call_fewer(manifest: dict, tree_bytes: int,
                              limit: int = LIMIT) -> float | None:
    """The largest `build --margin-mib` that would cut the payload into one part fewer beside
    today's tree (None when that would leave under SAFETY of room)."""
    n = len(manifest["parts"]) - 1
    if n < 1:
        return None
    need = -(-manifest["total_bytes"] // n)
    need = -(-need // ALIGN) * ALIGN
    margin = limit - tree_bytes - MANIFEST_RESERVE - need
    return margin / 2**20 if margin >= SAFETY else None


def render(calls: list[Call], manifest: dict, tree_bytes: int) -> str:
    mib = 2**20
    lines = [f"kit {manifest['kit']}: {manifest['total_bytes'] / mib:.1f} MiB in "
             f"{len(calls)} parts of {manifest['part_bytes'] / mib:.2f} MiB; travelling tree "
             f"now {tree_bytes / mib:.2f} MiB (at build {manifest.get('tree_bytes', 0) / mib:.2f})",
             f"least room left under {LIMIT // mib} MiB in any call: "
             f"{headroom(calls) / mib:.2f} MiB", ""]
    if headroom(calls) < WARN_BELOW:
        lines.insert(2, f"WARNING: under {WARN_BELOW // mib} MiB of room: if the tree grows "
                        f"before the calls, rebuild the kit")
    for c in calls:
        notes = "; ".join(JOB_NOTES.get(g, f"{g} complete") for g in c.starts)
        if c.number == len(calls):
            notes = (notes + "; " if notes else "") + \
                "ready.sh waits for the jobs and writes $HOME/env.sh"
        lines.append(f"call {c.number:2d}/{len(calls)}  carry {list(c.carry)}  timeout_s "
                     f"{c.timeout_s}  part {c.part} {c.part_bytes / mib:5.2f} MiB + tree + "
                     f"manifest = {c.carried_bytes / mib:5.2f} MiB")
        lines.append(f"    command: {c.command}")
        if notes:
            lines.append(f"    -> {notes}")
    fewer = margin_for_one_call_fewer(manifest, tree_bytes)
    if fewer is not None:
        lines += ["", f"one call fewer: `python tools/gpu/kit.py build --margin-mib "
                      f"{int(fewer * 100) / 100:.2f}` (then only that much room is left for the "
                      f"checkout to grow until the last call)"]
    low, typ, high = estimate(calls)
    lines += ["", f"estimate: {len(calls)} calls back to back, ~{typ} device seconds "
                  f"({low}-{high}) including the machine's start; then ready.sh waits for "
                  f"the jobs still running (the vLLM install, started by the last call)",
              "every call is the same shape: run them with no pause (idle ~30 s loses the "
              "machine); a call that fails can be run again as is; on a new machine start "
              "again at call 1"]
    return "\n".join(lines)
