"""KVEditConnector: vLLM's KV connector for the kvedit server.

Load it with
  --kv-transfer-config '{"kv_connector": "KVEditConnector",
                         "kv_connector_module_path": "kvedit.vllm.connector",
                         "kv_role": "kv_both",
                         "kv_connector_extra_config": {"kvedit_url": "tcp://127.0.0.1:6555"}}'
(`kvedit vllm serve` writes this for you). vLLM creates one instance per role; this class
only routes each hook to the scheduler side or the worker side. The vLLM releases it
supports, and every vLLM internal kvedit shadows beyond these hooks: hooks.py.
"""
from __future__ import annotations

from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

try:  # newer vLLMs (0.32) label prefix-cache hits by where they came from
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM 0.26 has no such label: nothing to declare
    CacheHitSource = None

from kvedit.vllm.hooks import check_in_engine_version, check_vllm_version, find_caller
from kvedit.vllm.metadata import KVEditMetadata
from kvedit.vllm.settings import ConnectorSettings


class KVEditConnector(KVConnectorBase_V1, SupportsHMA):
    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.HOST  # hits come from the server's host memory

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config, role, kv_cache_config)
        settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        if settings.budgets.in_engine:
            check_in_engine_version(vllm.__version__)
        block_size = vllm_config.cache_config.block_size
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("kvedit connector: models with several KV cache groups (hybrid "
                             "or sliding-window attention) are not supported; expected one")
        self.scheduler = self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            # kvedit is a cache: a chunk that cannot be loaded is a miss, so vLLM must
            # recompute it rather than fail the request (vLLM's default policy is "fail").
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            from kvedit.vllm.scheduler_side import SchedulerSide
            self.scheduler = SchedulerSide(vllm_config, settings, block_size)
        else:
            from kvedit.vllm.worker_side import WorkerSide
            self.worker = WorkerSide(vllm_config, settings, block_size)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """vLLM >= 0.33 asks: no. The worker side holds views of the paged KV tensors (and,
        on a GPU, their host mappings); sleep mode remaps that memory under them."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best effort: a dropped store is just a later miss

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:  # called inside the step's forward context
            self.worker.begin_step(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker is not None:
            self.worker.end_step()

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # vLLM calls this with the step's metadata before it applies the scheduler's output:
        # where in-engine budgets move KV and rewrite block lists.
        if self.worker is not None and getattr(kv_connector_metadata, "budgets", None):
            self.worker.run_budgets(kv_connector_metadata.budgets)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if meta.loads:
            self.worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # all layers are stored at once in wait_for_save (one gather per chunk)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if meta.queries:
            self.worker.store_queries()
        if meta.stores:
            self.worker.store(meta.stores)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVEditMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        # vLLM's Scheduler binds its block pool from its constructor (0.32 through
        # bind_kv_cache_manager, 0.26 directly): store mode "evict" watches the pool, and
        # in-engine budgets hook the Scheduler and its KVCacheManager, found as the caller.
        if self.scheduler is None:
            return
        self.scheduler.bind_pool(gpu_block_pool)
        sched = find_caller(lambda obj: getattr(obj, "connector", None) is self)
        manager = getattr(sched, "kv_cache_manager", None)
        if self.scheduler.settings.budgets.in_engine and getattr(manager, "block_pool", None) \
                is not gpu_block_pool:
            raise RuntimeError("kvedit in-engine budgets: could not find vLLM's scheduler "
                               "and its KVCacheManager above bind_gpu_block_pool")
        self.scheduler.bind(manager, sched)

    def take_events(self):
        # vLLM publishes these after each step, after its own, under the engine's identity
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def update_connector_output(self, connector_output) -> None:
        if connector_output.invalid_block_ids:
            self.scheduler.invalid_blocks(connector_output.invalid_block_ids)
        self.scheduler.step_done()  # (in step order) the loads of that step have run

    def on_new_request(self, request) -> None:
        self.scheduler.on_new_request(request)

    def request_finished(self, request, block_ids):
        self.scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids)

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.close()
