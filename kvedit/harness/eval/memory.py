"""How much of the kvedit server's L1 a group of the eval's samples needs, and groups cut to
fit what the machine can give.

Why a module of its own: the eval starts the server with an L1 sized for its largest group,
and splits groups that would not fit; both read the same estimate, which depends on what the
policies need besides the KV (captured queries, KVzip's pass and its chunks, the context
pass) and on how many cells edit at once. Were the estimate short, the server's LRU would
evict a pass's queries under its own chunks before the cells could read them. On a CPU host
vLLM's weights, KV pool and working memory share the machine's RAM with that L1, so what the
server may be given is what is left once vLLM's share is set aside (`engine_host_bytes`):
without it a 4k group of 12 Qwen2.5-1.5B prompts got vLLM's worker OOM-killed on a 24 GB box
(results/eval/cpu-qwen25-repair-4k-2026-12-07).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from kvedit.layout import DTYPE_SIZES


# vLLM's host memory on a CPU host beyond its weights and KV pool: prefill activations (steps
# of sizing.CPU_STEP_TOKENS), the allocator's and oneDNN's scratch, the query-capture buffers
# (max_capture_bytes, 1 GiB by default), and the API server and engine-core processes.
# Measured at the OOM kill of 2026-12-07 (Qwen2.5-1.5B, float32, 4k prompts): ~5.7 GiB in the
# worker beside weights and pool, 1.4 GiB in the other two. A larger model needs more; there
# `--group-size` cuts the L1 a group asks for.
ENGINE_WORKING_BYTES = 7 * 2**30

# How many copies of the group's context the repair cell adds (repair_cell.py): each sample's
# compressed cache (1 - ratio of its context) and the repaired copy of every question's stream
# (the same budget each) while they are decoded; at 0.5 with up to 3 questions a sample
# that is 2 copies.
REPAIR_COPIES = 2


def group_need(model_dir: Path, dtype: str, group: list, *, reconstruction: bool = False,
               context_rows: int = 0, cells_at_once: int = 1, repair: bool = False) -> float:
    """Bytes of L1 `group` needs: its original chunks (held while the group runs) and
    captured queries (the question's; KVzip's pass: ~the context's rows; the context pass:
    `context_rows` a sample), the edited chunks of the cells that run at once, with KVzip
    the pass's own chunks (the repeat and the second copy of the context, stored before
    they are deleted), with a repair cell its compressed and repaired copies
    (`REPAIR_COPIES`), and half as much again to spare."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg.get("num_key_value_heads")
    qheads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // qheads
    width = DTYPE_SIZES[dtype]
    kv_token = 2 * layers * (heads or qheads) * head_dim * width      # K and V
    q_row = layers * qheads * head_dim * width
    context = sum(s.length for s in group)
    rows = sum(len(s.prompt_ids) - s.length for s in group) + context_rows * len(group)
    copies = 1 + cells_at_once + (REPAIR_COPIES if repair else 0)
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


def engine_host_bytes(model_dir: Path, dtype: str, kv_tokens: int) -> float:
    """Bytes of host memory a vLLM of `model_dir` takes on a CPU host: its weights in `dtype`
    (the checkpoint's bytes scaled from the dtype it is stored in), a KV pool of `kv_tokens`,
    and `ENGINE_WORKING_BYTES`."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    stored = DTYPE_SIZES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), 2)
    files = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    weights = files * DTYPE_SIZES[dtype] / stored
    qheads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // qheads
    kv_token = 2 * text["num_hidden_layers"] * text.get("num_key_value_heads", qheads) * \
        head_dim * DTYPE_SIZES[dtype]
    return weights + kv_tokens * kv_token + ENGINE_WORKING_BYTES


def l1_budget(reserve: float = 0.0) -> float | None:
    """Bytes this machine can give the kvedit server's L1 (a shared-memory segment): 80% of
    what /dev/shm has free and 60% of the memory available less `reserve` (what an engine
    still to start will take of it: `engine_host_bytes` on a CPU host), whichever is less
    (None where neither can be read)."""
    from kvedit.launch.vllm import mem_available_bytes

    caps = []
    try:
        st = os.statvfs("/dev/shm")
        caps.append(0.8 * st.f_bavail * st.f_frsize)
    except OSError:
        pass
    avail = mem_available_bytes()
    if avail is not None:
        caps.append(0.6 * max(0.0, avail - reserve))
    return min(caps) if caps else None
