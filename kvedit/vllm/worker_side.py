"""Worker-side connector logic: copy chunks between the server and vLLM's paged KV blocks.

Runs in each vLLM worker. At start-up it registers this rank's layout (with RoPE params)
with the server. Loads run before the forward (vLLM calls start_load_kv first when a step
has synchronous loads); stores run in wait_for_save after the forward and read the blocks
before it returns, so vLLM cannot hand them to another request first. On the CPU stores
copy from the paged blocks straight into the server's shared-memory slots; on a GPU they
gather into device staging and a background thread copies and commits (PagedCopier; the
scheduler side makes a new request wait for keys still in flight: transfer/inflight.py).
"""
from __future__ import annotations

import logging

import torch

from kvedit.client import KVError
from kvedit.layout import ModelLayout
from kvedit.vllm.budget.plan import BudgetStep
from kvedit.vllm.budget.worker import BudgetWorker, find_runner
from kvedit.vllm.capture.support import capture_unavailable
from kvedit.vllm.capture.worker import STATS, QueryCapture, current_forward_context
from kvedit.vllm.link import UNAVAILABLE, ServerLink
from kvedit.vllm.metadata import KVEditMetadata
from kvedit.vllm.paged import PagedKV
from kvedit.vllm.settings import ConnectorSettings, check_chunk_size, model_layout
from kvedit.vllm.transfer.copier import PagedCopier

logger = logging.getLogger("vllm.kvedit")


class WorkerSide:
    def __init__(self, vllm_config, settings: ConnectorSettings, block_size: int):
        self.vllm_config, self.settings, self.block_size = vllm_config, settings, block_size
        name = vllm_config.model_config.served_model_name
        self.model = name[0] if isinstance(name, (list, tuple)) else name
        self.tp_rank = vllm_config.parallel_config.rank % \
            vllm_config.parallel_config.tensor_parallel_size
        self.layout: ModelLayout | None = None
        self.paged: PagedKV | None = None
        self.load_errors: set[int] = set()
        self.failed_from: dict[str, int] = {}  # req -> first token a load failed on, this step
        self.link: ServerLink | None = None
        self.copier: PagedCopier | None = None  # built once the layout is known
        self.capture: QueryCapture | None = None  # None: query capture off in this process
        self.budgets: BudgetWorker | None = None   # None: in-engine budgets off

    # ---- start-up -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        self.paged = PagedKV([kv_caches[n] for n in names], self._paged_kind(names[0], kv_caches),
                             self.vllm_config.model_config.get_head_size(), self.block_size)
        self._install_capture(names)
        if self.settings.budgets.in_engine:
            # the policies' layout (head_dim, RoPE; chunk units as the host path's edits)
            layout = model_layout(self.vllm_config, self.settings.chunk_size or 256,
                                  self.tp_rank, self.settings.rope_is_neox)
            ctx = self.vllm_config.compilation_config.static_forward_context
            self.budgets = BudgetWorker(find_runner(), self.paged, layout,
                                        [ctx[n] for n in names], self.settings.stats_interval_s)
        self.link = ServerLink(self.settings.kvedit_url, self.settings.timeout,
                               self.settings.retry_interval, self._on_connect, "worker",
                               secret=self.settings.secret())

    def _install_capture(self, names: list[str]) -> None:
        import vllm

        mode = self.settings.capture.query_capture
        why = capture_unavailable(mode, vllm.__version__,
                                  self.vllm_config)
        if why is not None:
            if mode != "off":
                logger.warning("kvedit: %s; requests that ask for query capture get none",
                               why)
            return
        ctx = self.vllm_config.compilation_config.static_forward_context
        try:
            self.capture = QueryCapture([ctx[n] for n in names], names, self.tp_rank)
        except RuntimeError as e:  # attention layers the hook does not know
            if mode == "on":
                raise
            logger.warning("%s; requests that ask for query capture get none", e)

    def _paged_kind(self, name: str, kv_caches) -> str:
        """Which paged layout the attention backend writes (paged.py lists them)."""
        layer = self.vllm_config.compilation_config.static_forward_context.get(name)
        if kv_caches[name].device.type != "cpu":
            return "cuda"
        # The CPU backend's tile layout depends on the ISA its builder picked for the layer.
        isa = getattr(layer, "isa", None)
        if isa in ("vec", "vec16"):
            return "cpu"
        if isa == "amx":
            return "cpu_amx"
        raise ValueError(f"kvedit connector: CPU attention ISA {isa!r} uses a KV tile layout "
                         "kvedit does not know; supported: vec, vec16, amx")

    def _on_connect(self, client) -> None:
        """(Re-)register this rank's layout: a restarted server starts empty."""
        if self.layout is None:
            chunk = self.settings.chunk_size or client.server_info().chunk_size
            check_chunk_size(chunk, self.block_size)
            # with TP the SDK gathers the ranks' heads: it needs the model's total count
            layout = model_layout(self.vllm_config, chunk, self.tp_rank,
                                  self.settings.rope_is_neox)
            if layout.tp_size > 1:
                layout = layout.with_total_kv_heads(
                    self.vllm_config.model_config.get_total_num_kv_heads())
            if layout.num_layers != self.paged.num_layers or layout.hidden != self.paged.hidden:
                raise ValueError(f"kvedit connector: model config says {layout.num_layers} "
                                 f"layers x {layout.hidden}, KV cache has "
                                 f"{self.paged.num_layers} x {self.paged.hidden}")
            self.layout = layout
            s = self.settings.transfer
            self.copier = PagedCopier(self.paged, layout, self.model, self.tp_rank, s.pin_shm,
                                      async_store=s.background_commit(
                                          self.paged.device.type == "cuda"),
                                      staging_bytes=s.gpu_staging_bytes or None,
                                      device_wait=s.device_wait,
                                      on_error=self._background_store_failed,
                                      stats_every=self.settings.stats_interval_s)
        client.register(self.model, self.layout)
        self.copier.prepare(client)
        http = self.settings.kvedit_http_url
        logger.info("kvedit: registered %s (rank %d) with %s%s: %s", self.model, self.tp_rank,
                    self.settings.kvedit_url, f" (status: {http}/status)" if http else "",
                    self.layout)

    def _background_store_failed(self, err: BaseException) -> None:
        """A background commit failed: mark the outage now (one warning), not at the next
        store, which may come much later (or after the server is back)."""
        if self.link is not None:
            self.link.failed(err)

    # ---- per step -----------------------------------------------------------------------
    def load(self, meta: KVEditMetadata) -> None:
        for run in meta.loads:
            client = self.link.client if self.link else None
            loaded = run.start
            if client is not None:
                try:
                    loaded = self.copier.load_run(client, run)
                except Exception as e:
                    self.link.failed(e)
            if loaded < run.end:  # vLLM must recompute these tokens, not attend to garbage
                bs = self.block_size
                self.load_errors.update(run.block_ids[loaded // bs: -(-run.end // bs)])
                self.failed_from[run.req_id] = loaded // bs * bs
                logger.info("kvedit: %s loaded tokens [%d, %d) of [%d, %d); rest recomputed",
                            run.req_id, run.start, loaded, run.start, run.end)

    def store(self, runs: list, before_forward: bool = False) -> None:
        """Store chunks of `runs`: after the forward, this step's completed chunks of every
        request; before it (`before_forward`), chunks whose blocks this step reuses (store
        mode "evict"). One prepare/commit pair with the server per call, one gather per chunk
        the server is missing."""
        failed = {}
        if not before_forward:   # this step's failed loads: blocks past them hold garbage
            failed, self.failed_from = self.failed_from, {}
        client = self.link.client if self.link else None
        if client is None or not runs:
            return
        c = self.layout.chunk_size
        todo: dict[bytes, tuple[list[int], int]] = {}  # key -> (block ids, chunk index)
        for run in runs:
            keys = run.keys[self.tp_rank]
            if run.req_id in failed:  # blocks past a failed load hold garbage: never store them
                keys = keys[:max(0, failed[run.req_id] // c - run.first)]
            for i, key in enumerate(keys):
                todo.setdefault(key, (run.block_ids, run.first + i))
        if not todo:
            return
        try:
            self.copier.store_chunks(client, todo)
        except Exception as e:
            self.link.failed(e)

    def run_budgets(self, step: BudgetStep) -> None:
        """Before vLLM applies the step: the in-engine budgets' stashes, compactions and
        restores (called from the connector's handle_preemptions)."""
        if self.budgets is None:
            raise RuntimeError("kvedit: the scheduler sent in-engine budget work to a worker "
                               "without in-engine budgets (the two sides' settings differ)")
        self.budgets.run(step)

    def begin_step(self, meta: KVEditMetadata) -> None:
        """Before the forward (vLLM binds the step's metadata): store the chunks whose blocks
        this step reuses (their bytes are still theirs until the forward), then write the
        in-engine budgets' compacted KV (which may go into such blocks), arm query
        capture."""
        if meta.pre_stores:
            self.store(meta.pre_stores, before_forward=True)
        if self.budgets is not None:
            self.budgets.write()
        STATS.steps += 1
        if self.copier is not None:   # the last stores' and loads' counts, where due
            self.copier.log_stats()
        if self.capture is not None and (meta.queries or meta.query_drops):
            self.capture.drop(meta.query_drops)
            if meta.queries:
                self.capture.arm(meta.queries, current_forward_context())
        if self.budgets is not None:
            self.budgets.recent.arm()  # a layer over query capture's, if armed (hooks.py)

    def end_step(self) -> None:
        """vLLM cleared the step's metadata: never leave a hook in place past it (a forward
        that raised skips wait_for_save); each feature takes out its own layers (hooks.py)."""
        if self.capture is not None:
            self.capture.abandon()
        if self.budgets is not None:
            self.budgets.recent.disarm()

    def store_queries(self) -> None:
        """After the forward: send the query windows completed this step."""
        if self.capture is None:
            return
        ready = self.capture.finish()
        client = self.link.client if self.link else None
        for r in ready:
            if client is None:
                STATS.dropped += 1
                continue
            try:
                client.store_queries(self.model, r.key, r.data, tp_rank=self.tp_rank)
            except Exception as e:  # a refused or failed store: the SDK reports it missing
                STATS.dropped += 1
                if isinstance(e, KVError) and not isinstance(e, UNAVAILABLE):
                    # refused (e.g. too_large): the client only finds none, so name the
                    # request here, one line per refusal
                    logger.warning("kvedit query capture: the server refused the queries of "
                                   "%s (%d bytes, rank %d), the client gets none: %s",
                                   r.req_id, r.data.nbytes, self.tp_rank, e)
                else:
                    self.link.failed(e)
                continue
            STATS.stored += 1
            STATS.stored_bytes += r.data.nbytes

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()   # joins the store thread, unpins the copier's mapping
        if self.link is not None:
            self.link.close()
