"""kvedit.vllm.hooks, the one owner of every runtime shadowing of a vLLM internal.

- Layers compose as a stack per (object, name) and each subscriber removes only its own,
  wherever it sits; the last removal gives the object its own method (or the instance
  attribute it had before) back; a name not in the table is refused.
- A forward that raises with query capture and the budgets' recent queries both armed (the
  two layers over one attention `impl.forward`) leaves no hook behind once the worker side
  ends the step, whichever order the two take their layers out in.
- The source: no module but hooks.py assigns a hooked method or touches an instance dict,
  every `hooks.shadow` call names an internal of the table, and every internal of the table
  is shadowed somewhere (the table is neither short nor stale).
"""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvedit.vllm import hooks
from kvedit.vllm.budget.recent import RecentQueries
from kvedit.vllm.capture.plan import QueryRun
from kvedit.vllm.capture.worker import QueryCapture
from kvedit.vllm.worker_side import WorkerSide

ROOT = Path(__file__).resolve().parents[2]


class Pool:
    def get_new_blocks(self, n):
        return ["vllm"] * n


def _tag(tag: str, log: list):
    def wrap(inner):
        def f(n):
            log.append(tag)
            return inner(n)
        return f
    return wrap


def test_layers_compose_and_each_removes_its_own():
    pool, log = Pool(), []
    a = hooks.shadow(pool, "get_new_blocks", "BlockPool.get_new_blocks", _tag("a", log))
    b = hooks.shadow(pool, "get_new_blocks", "BlockPool.get_new_blocks", _tag("b", log))
    c = hooks.shadow(pool, "get_new_blocks", "BlockPool.get_new_blocks", _tag("c", log))
    assert pool.get_new_blocks(1) == ["vllm"] and log == ["c", "b", "a"]  # later wraps earlier
    b.remove()
    log.clear()
    assert pool.get_new_blocks(2) == ["vllm"] * 2 and log == ["c", "a"]
    b.remove()   # again: nothing
    assert hooks.layers(pool, "get_new_blocks") == 2
    c.remove()
    a.remove()
    assert hooks.layers(pool, "get_new_blocks") == 0 and "get_new_blocks" not in vars(pool)
    assert pool.get_new_blocks.__func__ is Pool.get_new_blocks

    mine = Pool()
    own = mine.get_new_blocks = lambda n: ["own"] * n   # an instance attribute kvedit did not put
    h = hooks.shadow(mine, "get_new_blocks", "BlockPool.get_new_blocks", _tag("x", log))
    assert mine.get_new_blocks(1) == ["own"]
    h.remove()
    assert mine.get_new_blocks is own

    with pytest.raises(KeyError, match="not a hooked vLLM internal .*list it in"):
        hooks.shadow(pool, "get_new_blocks", "BlockPool.take", _tag("y", log))
    with pytest.raises(KeyError, match="not a hooked vLLM internal named 'free'"):
        hooks.shadow(pool, "free", "BlockPool.get_new_blocks", _tag("y", log))


class Impl:
    """A stand-in attention impl with vLLM's forward parameters; `fail` makes it raise."""
    fail = False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        if self.fail:
            raise RuntimeError("the forward failed")
        return output


NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_a_raising_forward_leaves_no_hook_behind():
    layers = [SimpleNamespace(impl=Impl(), num_heads=2, head_size=3) for _ in NAMES]
    capture = QueryCapture(layers, NAMES, tp_rank=0)
    recent = RecentQueries(layers)
    fc = SimpleNamespace(slot_mapping={n: torch.tensor([7, 8]) for n in NAMES},
                         cudagraph_runtime_mode=SimpleNamespace(name="PIECEWISE"))
    for first, second in ((capture, recent), (recent, capture)):   # either side ends first
        capture.arm([QueryRun("r", [b"k"], rows=1, row0=0, slots=[8])], fc)
        recent.add("r", 4)
        recent.prepare(["r"], np.array([2]), np.array([0]), "cpu")
        recent.arm()
        impls = [layer.impl for layer in layers]
        assert [hooks.layers(i, "forward") for i in impls] == [2, 2]
        impls[0].fail = True
        q = torch.zeros(2, 2, 3)
        with pytest.raises(RuntimeError, match="the forward failed"):
            impls[0].forward(layers[0], q, q, q, None, None)
        impls[0].fail = False
        worker = WorkerSide.__new__(WorkerSide)   # end_step reads these two only
        worker.capture, worker.budgets = capture, SimpleNamespace(recent=recent)
        if first is recent:
            recent.disarm()
        worker.end_step()
        for impl in impls:
            assert hooks.layers(impl, "forward") == 0 and "forward" not in vars(impl)
        assert capture.step is None and not recent.armed


def _sources():
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text())
            for p in sorted((ROOT / "kvedit").rglob("*.py"))}


def test_hooks_py_alone_shadows_and_its_table_is_complete():
    names = {k.rpartition(".")[2] for k in hooks.HOOKED}
    shadowed, broken = set(), []
    for path, tree in _sources().items():
        if path == "kvedit/vllm/hooks.py":
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and el.attr in names:
                        broken.append(f"{path}:{node.lineno} assigns .{el.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "__dict__" and \
                    path.startswith("kvedit/vllm/"):
                broken.append(f"{path}:{node.lineno} reaches into an instance dict")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "shadow":
                internal = node.args[2] if len(node.args) > 2 else None
                if not (isinstance(internal, ast.Constant) and internal.value in hooks.HOOKED):
                    broken.append(f"{path}:{node.lineno} shadows an internal not in HOOKED")
                else:
                    shadowed.add(internal.value)
    assert broken == []
    assert shadowed == set(hooks.HOOKED)


def test_the_one_frame_search():
    class Scheduler:
        def __init__(self, connector):
            self.connector = connector
            self.found = connector.bind()

    class Connector:
        def bind(self):
            return hooks.find_caller(lambda obj: getattr(obj, "connector", None) is self)

    c = Connector()
    assert Scheduler(c).found.connector is c
    assert c.bind() is None   # nobody above holds it
