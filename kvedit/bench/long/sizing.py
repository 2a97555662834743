"""What a `kvedit bench long` run needs, worked out and checked before anything starts.

Why a module of its own: a run on a GPU takes minutes of a lent device, and the first try of
issue 42's command failed 160 s in, when the host arm's streams found their chunks evicted
from a server whose default 1 GB L1 held a quarter of what the arms store. So the run's
sizes come first, from the prompts alone: the working set (every stream's prompt and output
at once, in vLLM blocks), the pool (`--kv-blocks`, or `--pool` as a share of the working
set), the bytes the server must hold (the largest arm's chunks: the no-budget arm stores every
stream's prompt and output), the server's L1 sized from that unless given, and what the
machine can give. A run that cannot fit is refused in seconds with the size it needs;
`--dry-run` prints all of it and an estimate of the time.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from kvedit.bench.long.policies import budget_list
from kvedit.bench.long.prompts import Prompts
from kvedit.bench.serve.workloads import kv_bytes_per_token
from kvedit.harness.eval.memory import l1_budget
from kvedit.harness.eval.sizing import engine_dtype
from kvedit.harness.experiment import block_size
from kvedit.harness.tiny_model import CONFIG
from kvedit.layout import DTYPE_SIZES

GB = 1 << 30
L1_MIN_GB = 1.0      # the server's L1 is never sized below this
HEADROOM = 1.25      # chunks in flight while an arm's streams are released, edits' copies

# Rough speeds for the estimate, from earlier runs (guesses, stated as such in the output):
# (prefill tokens/s, decode tokens/s for the whole batch, engine start s)
SPEEDS = {"gpu": (20_000.0, 2_500.0, 90.0), "cpu-real": (70.0, 12.0, 70.0),
          "cpu-tiny": (5_000.0, 400.0, 30.0)}


@dataclass
class Plan:
    block_size: int
    kv_blocks: int
    working_set_blocks: int
    pool_share: float            # the pool over the working set
    kv_bytes_per_token: int
    l1_need_gb: float            # the largest arm's chunks, with headroom
    l1_size_gb: float            # what the server gets
    l1_available_gb: float | None
    arms: list[str]
    estimate_s: float
    estimate_basis: str

    def to_dict(self) -> dict:
        return asdict(self)


def plan(args, prompts: Prompts) -> Plan:
    """The run's sizes; SystemExit naming what does not fit and the size it needs."""
    bs = block_size()
    o = args.max_tokens
    need_blocks = [-(-(len(p) + o + 1) // bs) for p in prompts.ids]
    working = sum(need_blocks)
    if args.kv_blocks is not None:
        blocks = args.kv_blocks
    else:
        if not 0 < args.pool <= 10:
            raise SystemExit(f"--pool {args.pool}: expected a share of the working set in "
                             "(0, 10], e.g. 0.4")
        blocks = max(max(need_blocks), -(-int(args.pool * working * 1000) // 1000))
    if max(need_blocks) > blocks:
        raise SystemExit(f"a KV pool of {blocks} blocks of {bs} cannot hold one stream of "
                         f"{max(map(len, prompts.ids))}+{o}+1 tokens ({max(need_blocks)} "
                         "blocks); raise --kv-blocks or --pool")
    tb = _token_bytes(prompts, dtype(args, prompts))
    need_gb = HEADROOM * _largest_arm_tokens(args, prompts) * tb / GB
    avail = _l1_available()
    size = args.l1_size_gb if args.l1_size_gb is not None else \
        max(L1_MIN_GB, -(-need_gb * 4 // 1) / 4)   # quarter GB steps
    if args.l1_size_gb is not None and size < need_gb:
        raise SystemExit(f"--l1-size-gb {size}: the no-budget arm stores every stream's prompt "
                         f"and output ({need_gb:.2f} GB with headroom at {tb} KV bytes a "
                         f"token): pass --l1-size-gb {need_gb:.2f} or more, or leave it out "
                         "(sized from the working set)")
    if avail is not None and size > avail:
        raise SystemExit(f"the kvedit server needs an L1 of {size:.2f} GB for this run and this "
                         f"machine can give {avail:.2f} GB (80% of /dev/shm's free space, 60% "
                         "of available memory): fewer --streams, shorter --max-tokens, or a "
                         "larger machine")
    arms = arm_names(args)
    basis = "gpu" if bs != 128 else ("cpu-real" if prompts.model_dir else "cpu-tiny")
    est = estimate(basis, arms, prompts, o)
    return Plan(bs, blocks, working, blocks / working, tb, round(need_gb, 3), size,
                None if avail is None else round(avail, 2), arms, round(est),
                f"{basis} speeds from earlier runs (a guess): prefill, decode, engine start "
                f"= {SPEEDS[basis]}")


def dtype(args, prompts: Prompts) -> str:
    """--dtype, else bfloat16, or float32 for a real model on a CPU without bf16 arithmetic
    (the eval's rule: emulated bf16 prefills ~8x slower there)."""
    if args.dtype:
        return args.dtype
    if prompts.model_dir is None:
        return "bfloat16"
    return engine_dtype()


def arm_names(args) -> list[str]:
    """The arms the run will start, in order."""
    arms = ["vllm_full", "vllm_two_phase"] if args.vllm_full else []
    if args.vllm_full and not args.two_phase:
        arms.remove("vllm_two_phase")
    arms.append("none")
    if args.vllm_full and args.connector_arm:
        arms.append("connector_one_phase")
    if args.host_arm:
        arms.append("host")
    if args.in_engine:
        arms.append("in_engine")
        if args.matched_arm:
            arms.append("in_engine_matched")
        arms += [f"in_engine:{e.strip()}" for e in (args.engine_policies or "").split(",")
                 if e.strip()]
        arms += [f"in_engine@{b}" for b in budget_list(args) if b != args.budget]
    return arms


def estimate(basis: str, arms: list[str], prompts: Prompts, o: int) -> float:
    prefill, decode, start = SPEEDS[basis]
    per_arm = sum(map(len, prompts.ids)) / prefill + len(prompts.ids) * (o + 1) / decode
    engines = (2 if arms and arms[0] == "vllm_full" else 1) * start
    return engines + len(arms) * per_arm


def _largest_arm_tokens(args, prompts: Prompts) -> int:
    """KV tokens the server holds at once for the arm that stores most: `none` stores every
    chunk of every stream's prompt and output (each arm's chunks are released when it ends);
    the host arm holds about a budget a stream, twice during an edit."""
    c = args.chunk_size
    none = sum(-(-(len(p) + args.max_tokens + 1) // c) * c for p in prompts.ids)
    host = len(prompts.ids) * 2 * (args.budget + c) if args.host_arm else 0
    return max(none, host)


def _token_bytes(prompts: Prompts, dt: str) -> int:
    """KV bytes of one token: from the model's config.json (the tiny model's config, which
    needs no build)."""
    if prompts.model_dir:
        return kv_bytes_per_token(prompts.model_dir, dt)[0]
    c = CONFIG
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * \
        DTYPE_SIZES[dt]


def _l1_available() -> float | None:
    b = l1_budget()
    return None if b is None else b / GB
