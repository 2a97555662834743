"""The room rules: which rooms of kvedit may import which, read from the source with `ast`
(the import graph of tests/unit/test_imports.py: every kvedit import that can run, top level
and inside functions).

- `sdk/` and `vllm/` never import each other: they are two ends of one wire and meet only in
  the shared top-level contracts (`request_params`, `budget`, `query_contract`, `keys`,
  `layout`, ...), so either side can change its insides alone.
- `server/` imports no `client/`, `sdk/` or `vllm/`: the store knows none of its users (what
  both ends of its wire share is top level: `protocol`, `wire`, `auth`).
- `edits/` imports nothing of kvedit but `layout`: edit functions are pure torch over a
  layout, usable without a server, an engine or the SDK; and `sdk/` imports nothing of
  `edits/`: the SDK names no policy family (a policy serializes itself, kvedit.edits.spec,
  and a budget's edit is fitted through the `Fits` protocol of sdk/contracts.py).
- No library room imports tooling (`harness/`, `bench/`, `launch/`, the `kvedit` command):
  a library never depends on what only tests, benchmarks and the CLI use.
A test plants one breach of each rule and checks that it is caught; the last one holds vllm/
to its shape: a core of at most 12 modules, the concerns in sub-rooms that never call the
core's two sides.
"""
from __future__ import annotations

from functools import cache

from tests.unit.test_imports import MODULES, _all_imports

FOLDERS = ("sdk", "vllm", "server", "client", "edits", "compat", "harness", "bench", "launch")
TOOLING = {"harness", "bench", "launch", "cli"}
LIBRARY = {"sdk", "vllm", "server", "client", "edits", "compat", "top"}


def room(module: str) -> str:
    """`sdk`, `vllm`, ... for a module in a folder of kvedit; `cli` for the kvedit command;
    `layout` for kvedit.layout (edits' one allowed import); `top` for the other top-level
    modules and the package itself."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FOLDERS:
        return parts[1]
    if module == "kvedit.cli":
        return "cli"
    if module == "kvedit.layout":
        return "layout"
    return "top"


# (room, rooms it must not import, why)
RULES = [
    ("sdk", {"vllm"}, "sdk and vllm meet only in shared top-level contracts"),
    ("sdk", {"edits"}, "the SDK names no policy family"),
    ("vllm", {"sdk"}, "sdk and vllm meet only in shared top-level contracts"),
    ("server", {"client", "sdk", "vllm"}, "the server knows none of its users"),
    ("edits", {r for r in (*FOLDERS, "cli", "top") if r != "edits"},
     "edits are pure torch over a layout"),
    *((lib, TOOLING, "a library never imports tooling") for lib in sorted(LIBRARY | {"layout"})),
]


def breaches(graph: dict[str, set[str]]) -> list[str]:
    """`importer -> imported (why)` for every import that breaks a rule."""
    out = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            for importer, forbidden, why in RULES:
                if room(module) == importer and room(target) in forbidden:
                    out.append(f"{module} -> {target} ({why})")
    return out


@cache
def _graph() -> dict[str, frozenset[str]]:
    return {m: frozenset(t for _, t in edges) for m, edges in _all_imports().items()}


def test_the_rooms_keep_their_rules():
    assert breaches(_graph()) == []


def test_each_rule_catches_a_planted_breach():
    graph = _graph()
    planted = {
        "kvedit.sdk.stream": "kvedit.vllm.settings",
        "kvedit.sdk.driver": "kvedit.edits.base",
        "kvedit.vllm.scheduler_side": "kvedit.sdk.stream",
        "kvedit.server.service": "kvedit.client.kv_client",
        "kvedit.edits.base": "kvedit.engine_budget",
        "kvedit.client.kv_client": "kvedit.harness.vocab",
        "kvedit.engine_budget": "kvedit.launch.server",
    }
    for importer, target in planted.items():
        assert importer in graph and target in graph, "the planted modules must exist"
        broken = {**graph, importer: graph[importer] | {target}}
        found = breaches(broken)
        assert len(found) == 1 and found[0].startswith(f"{importer} -> {target} ("), found
    # what the rules allow stays allowed
    assert room("kvedit.layout") == "layout" and room("kvedit.request_params") == "top"
    assert breaches({"kvedit.edits.base": {"kvedit.layout"},
                     "kvedit.sdk.stream": {"kvedit.request_params", "kvedit.client.kv_client"},
                     "kvedit.bench.long": {"kvedit.sdk.batch", "kvedit.vllm.connector"}}) == []


def test_the_vllm_core_stays_a_core():
    """vllm/ holds the connector core (at most 12 modules directly); each concern is a
    sub-room of its own (transfer/, capture/, budget/), which the core calls and which never
    call the core's two sides."""
    core = [m for m in _graph() if m.startswith("kvedit.vllm.") and m.count(".") == 2
            and MODULES[m].name != "__init__.py"]
    assert len(core) + 1 <= 12, sorted(core)   # + the package's __init__
    subs = {m.split(".")[2] for m in _graph()
            if m.count(".") == 3 and m.startswith("kvedit.vllm.")}
    assert subs == {"transfer", "capture", "budget"}
    sides = {"kvedit.vllm.connector", "kvedit.vllm.scheduler_side", "kvedit.vllm.worker_side"}
    assert [(m, t) for m, ts in _graph().items() for t in ts
            if m.count(".") == 3 and m.startswith("kvedit.vllm.") and t in sides] == []


# vLLM fields kvedit writes and vLLM private methods it calls: only kvedit/vllm/hooks.py, which
# lists each (WRITTEN, CALLED) and holds the one function that touches it.
WRITTEN_FIELDS = {"skip_reading_prefix_cache", "defer_block_free", "deferred_frees",
                  "kv_event_queue"}
PRIVATE_CALLS = {"_preempt_request", "_maybe_evict_cached_block"}


def vllm_internals_touched(tree) -> list[str]:
    """`field =` writes of WRITTEN_FIELDS, `x.deferred_frees.append(...)`, and any use of
    PRIVATE_CALLS, as 'line: what'."""
    import ast

    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in WRITTEN_FIELDS:
                out.append(f"{node.lineno}: writes .{t.attr}")
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_CALLS:
            out.append(f"{node.lineno}: uses .{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Attribute) and \
                node.func.value.attr in WRITTEN_FIELDS:
            out.append(f"{node.lineno}: changes .{node.func.value.attr}")
    return out


def test_vllm_internals_are_written_and_called_in_hooks_only():
    import ast

    from tests.unit.test_imports import MODULES

    found = {m: hits for m, path in MODULES.items()
             if m != "kvedit.vllm.hooks"
             and (hits := vllm_internals_touched(ast.parse(path.read_text())))}
    assert found == {}, "go through kvedit.vllm.hooks (and list the internal there)"
    planted = ast.parse("r.skip_reading_prefix_cache = True\ns._preempt_request(r, 0)\n"
                        "s.deferred_frees.append((0, []))\nx = r.skip_reading_prefix_cache\n")
    assert sorted(h.split(":", 1)[1].strip() for h in vllm_internals_touched(planted)) == [
        "changes .deferred_frees", "uses ._preempt_request",
        "writes .skip_reading_prefix_cache"]


# ---- no private crosses a file ------------------------------------------------------------
# `from kvedit.x import _y` in another kvedit module: a leading underscore says "only this
# file uses it", so a second user means the name wants to be public or the two files want to
# be one. None is allowed (the test also fails on a stale entry, should one be added).
PRIVATE_IMPORTS_ALLOWED: set[tuple[str, str, str]] = set()


def private_imports(tree, module: str) -> set[tuple[str, str, str]]:
    """(module, kvedit module imported from, private name) for every `from kvedit... import
    _name` in `tree` (relative imports resolved from `module`; dunders are not private)."""
    import ast

    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            pkg = module.split(".")
            if MODULES[module].name != "__init__.py":
                pkg = pkg[:-1]
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        if base != "kvedit" and not base.startswith("kvedit."):
            continue
        out |= {(module, base, a.name) for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")}
    return out


def test_no_private_name_is_imported_across_files():
    import ast

    found = set().union(*(private_imports(ast.parse(p.read_text()), m)
                          for m, p in MODULES.items()))
    assert sorted(found - PRIVATE_IMPORTS_ALLOWED) == [], \
        "make the name public (it has a second user) or move the code to one file"
    assert sorted(PRIVATE_IMPORTS_ALLOWED - found) == [], \
        "PRIVATE_IMPORTS_ALLOWED lists imports that are gone: remove them"
    planted = ast.parse("from kvedit.bench.connector.calls import _complete, complete_one\n"
                        "from .procs import _client\nfrom kvedit import __version__\n"
                        "def f():\n    from kvedit.sdk.stream import _x\n")
    assert private_imports(planted, "kvedit.bench.soak.run") == {
        ("kvedit.bench.soak.run", "kvedit.bench.connector.calls", "_complete"),
        ("kvedit.bench.soak.run", "kvedit.bench.soak.procs", "_client"),
        ("kvedit.bench.soak.run", "kvedit.sdk.stream", "_x")}


# bench/ may import kvedit modules inside functions (tests/unit/test_imports.py: command
# rooms load torch, vLLM and servers only when a subcommand runs), but only where that is what
# keeps `kvedit bench` light. A family of several modules is a sub-room (connector/, l2/,
# long/, repair/, serve/, soak/) whose light cli.py registers its options and makes the one
# late import of the module that runs it; its other modules import at their top. A
# one-module bench at bench/'s top level is imported when `kvedit bench` registers it, so
# what loads torch (the client, the SDK, kvedit.edits) stays inside its functions. 19 since
# issue 47 (from 150): 9 sub-room cli.py late imports (connector/'s 4: one per mode of
# `connector` so that only --kv-events imports vllm, and route), modify 5, transfer 2,
# dropping 1 (torch), soak/attacks.py 2 (its attacker processes skip redis-py and the HTTP
# proof unless their role needs them). The ceiling is the count: a new import inside a bench
# function fails this test; lower it when a change brings it down.
BENCH_FUNCTION_IMPORTS_CEILING = 19


def bench_function_imports() -> list[tuple[str, str, str]]:
    """(module, function, kvedit module) for every kvedit import inside a function in bench/."""
    return sorted((m, f, t) for m, edges in _all_imports().items()
                  if m.startswith("kvedit.bench.") for f, t in edges if f is not None)


def test_function_level_kvedit_imports_in_bench_stay_under_the_ceiling():
    inside = bench_function_imports()
    assert len(inside) <= BENCH_FUNCTION_IMPORTS_CEILING, \
        f"{len(inside)} kvedit imports inside bench/ functions; move them to the top of a " \
        f"heavy module that a light cli.py loads when the command runs: {inside}"


# bench/'s top level: its cli.py, the shared http.py and the one-module benches; a family of
# several modules is a sub-room (a folder with a light cli.py). 8 modules since issue 47
# (16 before l2/ and connector/ became sub-rooms).
BENCH_TOP_LEVEL_CEILING = 12


def test_bench_top_level_stays_small():
    top = sorted(m for m, p in MODULES.items() if m.startswith("kvedit.bench.")
                 and m.count(".") == 2 and p.name != "__init__.py")
    assert len(top) + 1 <= BENCH_TOP_LEVEL_CEILING, \
        f"bench/ holds {len(top) + 1} modules (with its __init__.py): {top}; put a family " \
        f"of several modules in a sub-room of its own (a folder with a light cli.py)"


# ---- docs say what is true now ------------------------------------------------------------
# A heading with a date (`## 2026-12-06 ...`) or a numbered session or run (`### Session 14`,
# `## Run 3`) starts a lab record: dated records belong in results/ (a log per area, newest
# first), docs/ says what is true now and how to reproduce it. Headings of that kind today, in
# docs other changes are moving (issue 47, item 3); the test fails on a stale entry, so the
# list only shrinks.
DATED_HEADINGS_ALLOWED: set[tuple[str, str]] = set()


def dated_headings(text: str) -> list[str]:
    """Markdown headings (outside fenced code) that carry a date or a numbered session or
    run. "Sessions" alone is a concept (the protocol's), not a record."""
    import re

    dated = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\bsession\s+#?\d+|\brun\s+#?\d+\b", re.I)
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line) and dated.search(line):
            out.append(line.strip())
    return out


def test_docs_have_no_dated_headings():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    found = {(p.name, h) for p in sorted(docs.glob("*.md")) for h in dated_headings(p.read_text())}
    assert sorted(found - DATED_HEADINGS_ALLOWED) == [], \
        "a dated record: move it to results/ (its area's log) and keep what is true now in docs/"
    assert sorted(DATED_HEADINGS_ALLOWED - found) == [], \
        "DATED_HEADINGS_ALLOWED lists headings that are gone: remove them"
    planted = ("# kvedit\n## Sessions and holders\n### Session 14: the key watch\n"
               "## 2026-12-06 quiet box\n## Run 3\n```\n# G1 run 2 (2026-12-01)\n```\n"
               "## vLLM versions: 0.26 to 0.33\n")
    assert dated_headings(planted) == ["### Session 14: the key watch",
                                       "## 2026-12-06 quiet box", "## Run 3"]


def bench_room_breaches(path, source: str) -> list[str]:
    """Where a module of a bench sub-room breaks its shape: over 500 lines, a function over
    80, a private name of another kvedit module imported or reached through its module."""
    import ast

    tree = ast.parse(source)
    out = [f"{path}: {len(source.splitlines())} lines"] if len(source.splitlines()) > 500 else []
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.end_lineno - node.lineno >= 80:
            out.append(f"{path}:{node.lineno}: {node.name} is {node.end_lineno - node.lineno + 1}"
                       f" lines")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvedit"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    out.append(f"{path}:{node.lineno}: imports {node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in modules and node.attr.startswith("_") and \
                not node.attr.startswith("__"):
            out.append(f"{path}:{node.lineno}: uses {node.value.id}.{node.attr}")
    return out


def test_the_bench_sub_rooms_keep_their_shape():
    """Each family of `kvedit bench` with a folder of its own (soak/, long/): short files and
    functions, and what one module shares with another is public."""
    found = [hit for m, path in MODULES.items() if m.startswith("kvedit.bench.")
             and m.count(".") == 3 for hit in bench_room_breaches(path, path.read_text())]
    assert found == []
    planted = "from kvedit.bench.soak.common import _x\nfrom kvedit.bench.soak import watch\n" \
              "watch._Prober\n" + "def f():\n" + "    pass\n" * 80
    assert sorted(h.split(": ", 1)[1] for h in bench_room_breaches("p", planted)) == [
        "f is 81 lines", "imports kvedit.bench.soak.common._x", "uses watch._Prober"]
