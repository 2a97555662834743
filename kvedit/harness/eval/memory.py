"""How much of the kvedit server's L1 a group of the eval's samples needs, and groups cut to
fit what the machine can give.

Why a module of its own: the eval starts the server with an L1 sized for its largest group,
and splits groups that would not fit; both read the same estimate, which depends on what the
policies need besides the KV (captured queries, KVzip's pass and its chunks, the context
pass) and on how many cells edit at once. Were the estimate short, the server's LRU would
evict a pass's queries under its own chunks before the cells could read them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from kvedit.layout import DTYPE_SIZES


def group_need(model_dir: Path, dtype: str, group: list, *, reconstruction: bool = False,
               context_rows: int = 0, cells_at_once: int = 1) -> float:
    """Bytes of L1 `group` needs: its original chunks (held while the group runs) and
    captured queries (the question's; KVzip's pass: ~the context's rows; the context pass:
    `context_rows` a sample), the edited chunks of the cells that run at once, with KVzip
    the pass's own chunks (the repeat and the second copy of the context, stored before
    they are deleted), and half as much again to spare."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg.get("num_key_value_heads")
    qheads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // qheads
    width = DTYPE_SIZES[dtype]
    kv_token = 2 * layers * (heads or qheads) * head_dim * width      # K and V
    q_row = layers * qheads * head_dim * width
    context = sum(s.length for s in group)
    rows = sum(len(s.prompt_ids) - s.length for s in group) + context_rows * len(group)
    copies = 1 + cells_at_once
    if reconstruction:
        rows, copies = rows + context, copies + 1
    return 1.5 * (copies * context * kv_token + rows * q_row)


def fit(groups: list[list], budget: float | None, need, log=print) -> list[list]:
    """Groups whose `need(group)` is past `budget` (bytes the machine can give the server)
    split in halves until they fit (or hold one sample)."""
    def cut(gs: list[list]) -> list[list]:
        out: list[list] = []
        for g in gs:
            if budget is not None and len(g) > 1 and need(g) > budget:
                half = (len(g) + 1) // 2
                out += cut([g[:half], g[half:]])
            else:
                out.append(g)
        return out

    out = cut(groups)
    if len(out) > len(groups):
        log(f"groups split to fit the kvedit server's memory ({budget / 1e9:.0f} GB to "
            f"give): {len(groups)} -> {len(out)}")
    return out


def l1_budget() -> float | None:
    """Bytes this machine can give the kvedit server's L1 (a shared-memory segment): 80% of
    what /dev/shm has free and 60% of the memory available, whichever is less (None where
    neither can be read)."""
    from kvedit.launch.vllm import mem_available_bytes

    caps = []
    try:
        st = os.statvfs("/dev/shm")
        caps.append(0.8 * st.f_bavail * st.f_frsize)
    except OSError:
        pass
    avail = mem_available_bytes()
    if avail is not None:
        caps.append(0.6 * avail)
    return min(caps) if caps else None
