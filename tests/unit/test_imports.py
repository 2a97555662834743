"""kvedit's import structure, read from the source with `ast` (nothing is imported).

The rule: a library module imports the kvedit modules it needs at its top. An import of a
kvedit module inside a function is how a circle gets hidden (module A imports B at the top,
B imports A inside a function: it works until someone moves a line), so the library rooms
(`sdk/`, `client/`, `server/`, `vllm/`, `edits/`, the shared top-level modules) have none,
except the few in ALLOWED, each with its reason. Command modules may defer them: `cli.py`
files, `bench/` and `harness/` are loaded when the `kvedit` command registers its
subcommands, and they load torch, vLLM or a server's modules only when a subcommand runs
(optional heavy imports such as torch/vllm/transformers anywhere are not kvedit modules and
are not this test's business). Whatever the room, the graph of every kvedit import (top
level and inside functions; `if TYPE_CHECKING:` blocks excluded, they never run) has no
circle, except the ones in KNOWN_CIRCLES.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvedit"

# Rooms whose modules may import kvedit modules inside functions (they run as commands).
COMMAND_ROOMS = ("kvedit/bench/", "kvedit/harness/")

# (module, function, imported module) -> why it is imported inside that function.
ALLOWED = {
    ("kvedit.vllm.connector", "__init__", "kvedit.vllm.scheduler_side"):
        "vLLM instantiates the connector once per role; each process loads only its side",
    ("kvedit.vllm.connector", "__init__", "kvedit.vllm.worker_side"):
        "vLLM instantiates the connector once per role; each process loads only its side",
    ("kvedit.server.main", "serve", "kvedit.server.http"):
        "the server process loads its HTTP stack (starlette, uvicorn) only when it serves",
    ("kvedit.server.main", "serve", "kvedit.server.service"):
        "the server process loads the ZMQ service only when it serves",
}

# Circles that exist today in rooms owned elsewhere; each entry is a set of modules.
KNOWN_CIRCLES = [
    # `kvedit eval`: run.py takes resolve_model from cli.py, cli.py calls run.py; it goes
    # when the experiment vocabulary (model by name) gets its own module.
    {"kvedit.harness.eval.cli", "kvedit.harness.eval.run"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The module (or package) `name` lives in: the longest prefix that is one."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, module: str) -> list[str]:
    """The kvedit modules an import node imports (`from kvedit.x import y` imports x.y when
    that is a module, else x)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:   # relative: from the importing module's package
            pkg = module.split(".")
            if not MODULES[module].name == "__init__.py":
                pkg = pkg[:-1]
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" for a in node.names] or [base]
    else:
        return []
    found = {_resolve(n) for n in names if n == "kvedit" or n.startswith("kvedit.")}
    return sorted(t for t in found if t and t != module)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(source: str, module: str) -> list[tuple[str | None, str]]:
    """(enclosing function or None at module level, imported kvedit module) for every import
    in `source` that can run (TYPE_CHECKING blocks skipped)."""
    found: list[tuple[str | None, str]] = []

    def visit(node: ast.AST, func: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other, func)
                continue
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else func
            found.extend((inner, t) for t in _targets(child, module))
            visit(child, inner)

    visit(ast.parse(source), None)
    return found


def _all_imports() -> dict[str, list[tuple[str | None, str]]]:
    return {m: imports(p.read_text(), m) for m, p in MODULES.items()}


def _is_command(module: str) -> bool:
    path = MODULES[module].relative_to(ROOT).as_posix()
    return path.startswith(COMMAND_ROOMS) or path.endswith("/cli.py") or path == "kvedit/cli.py"


def test_library_modules_import_kvedit_modules_at_the_top():
    found = _all_imports()
    inside = {(m, f, t) for m, edges in found.items() for f, t in edges
              if f is not None and not _is_command(m)}
    assert sorted(inside - set(ALLOWED)) == [], "kvedit imports inside functions (move them " \
        "to the module's top; a circle means a module both need is missing)"
    assert sorted(set(ALLOWED) - inside) == [], "ALLOWED lists imports that are gone"


def test_no_import_circles():
    graph = {m: {t for _, t in edges} for m, edges in _all_imports().items()}
    circles = [set(c) for c in strongly_connected(graph) if len(c) > 1]
    assert [sorted(c) for c in circles if c not in KNOWN_CIRCLES] == []
    assert [sorted(c) for c in KNOWN_CIRCLES if c not in circles] == [], \
        "KNOWN_CIRCLES lists a circle that is gone: remove it"


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(comp)
    return out


def test_the_checks_see_a_hidden_circle_and_skip_type_checking_imports():
    """The detectors on a planted example: an import inside a function is found (with its
    function), a TYPE_CHECKING-only import is not, and a two-module circle is a component."""
    src = ("from typing import TYPE_CHECKING\n"
           "from kvedit.sdk import stream\n"
           "if TYPE_CHECKING:\n    from kvedit.sdk.batch import BatchedStream\n"
           "def f():\n    from kvedit.sdk.modify import modify_stream\n"
           "    import torch\n")
    assert imports(src, "kvedit.sdk.driver") == [(None, "kvedit.sdk.stream"),
                                                 ("f", "kvedit.sdk.modify")]
    comps = strongly_connected({"a": {"b"}, "b": {"a", "c"}, "c": set()})
    assert sorted(sorted(c) for c in comps) == [["a", "b"], ["c"]]
