"""The connector's settings (from kv_connector_extra_config) and the model layout it registers.

Both connector roles build the same ModelLayout from vLLM's config, so the scheduler side
computes exactly the keys the worker side stores under.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, get_args

from kvedit.auth import SecretSource
from kvedit.layout import ModelLayout, RopeParams
from kvedit.vllm.transfer.admission import STORE_MODES, StoreMode

# Model types whose rotary embedding pairs adjacent dims (GPT-J style) instead of halves.
GPTJ_STYLE_MODELS = {"gptj", "glm", "glm4", "chatglm", "cohere", "cohere2", "commandr",
                     "ernie4_5_moe", "ernie4_5_vl_moe", "llama4", "mllama4"}


QueryCaptureMode = Literal["auto", "on", "off"]
CachedKeptBlocks = Literal["uncache", "copy"]


@dataclass(slots=True)
class TransferSettings:
    """Store and load (transfer/)."""
    store_generated: bool = True       # also store chunks of generated tokens (multi-turn)
    pin_shm: bool = True               # GPU: page-lock the server's shared memory for DMA
    # Stores commit from a background thread while the next step computes (None: on where
    # vLLM runs on CUDA, off elsewhere; True also on the CPU, through device-style staging).
    # A new request whose prefix is still being stored then waits for it, at most
    # store_wait_s seconds (vLLM asks again each step; transfer/inflight.py), rather than
    # recompute.
    async_store: bool | None = None
    store_wait_s: float = 5.0
    gpu_staging_bytes: int = 0  # the device staging ring (0: 3/4 of min(2 GiB, GPU mem / 32))
    # GPU: how the copies are ordered against the forward. False (default) orders them by
    # vLLM's forward stream and events, so vLLM's thread never waits for the forward; True
    # waits for the whole device before a store's gather and after a load (the older way,
    # far slower for vLLM's thread: docs/gpu.md).
    device_wait: bool = False
    # vLLM holds back the blocks a preempted or finished request frees until the step in
    # flight has run, when a connector that loads KV runs under async scheduling (its loads
    # might not be ordered against that step's writes). kvedit's loads scatter on the
    # forward's stream, ordered after it, so by default the connector turns that deferral
    # off: with it, a request short of one block makes vLLM preempt running requests one
    # after another in one step (their blocks stay unusable until it ends): 1,036
    # preemptions against plain vLLM's 39 on an H100 under KV pressure (docs/connector.md).
    defer_frees: bool = False
    # Which computed chunks are stored, and when (transfer/admission.py; docs/connector.md):
    # "eager" every chunk as it is computed, "evict" only when vLLM is about to evict its
    # blocks, "reuse" on the second sight of its prefix. A request whose kv_transfer_params
    # ask for eager stores (kvedit.request_params) has its chunks stored as computed whatever
    # the mode (the SDK's requests ask: its edits read them next).
    store: StoreMode = "evict"
    # A lookup's hits stay leased until loaded (transfer/pins.py): at most pin_max_chunks
    # chunks at once (0: no pins), each pin at most pin_ttl_s (and a quarter of the lease TTL).
    pin_max_chunks: int = 4096
    pin_ttl_s: float = 30.0
    # Answer a lookup whose first chunk the server lacks from a copy of its keys that the
    # server keeps current (kvedit.client.key_watch), without a round trip in vLLM's
    # scheduler loop; off where the server has a second tier (a miss may be found there).
    key_watch: bool = True

    def background_commit(self, on_cuda: bool) -> bool:
        """Whether stores commit from a background thread: async_store, else on CUDA only.
        Both connector roles decide the same way (the scheduler side waits for in-flight
        stores only when the workers commit in the background)."""
        return on_cuda if self.async_store is None else bool(self.async_store)


@dataclass(slots=True)
class CaptureSettings:
    """Query capture (capture/, docs/queries.md): "auto" hooks attention where the vLLM is
    supported and otherwise warns each asking request; "on" refuses to start on an
    unsupported vLLM; "off" never hooks. max_capture_bytes bounds the windows in flight per
    rank."""
    query_capture: QueryCaptureMode = "auto"
    max_capture_bytes: int = 1 << 30


@dataclass(slots=True)
class BudgetSettings:
    """In-engine budgets (budget/, docs/in-engine.md)."""
    # Hook vLLM's scheduler and model runner so a request may ask, in kv_transfer_params, to
    # have its KV compacted in place; off, such a request is refused. stash_bytes bounds the
    # host memory per worker that holds preempted compacted requests (past it a preempted
    # one is recomputed in full).
    in_engine: bool = False
    stash_bytes: int = 1 << 30
    # When budgeted requests do not all fit, time slicing by equal service: the running one
    # that has generated the most yields its blocks to a stashed one once it has run
    # turn_tokens since it last started and is turn_tokens ahead of it. Smaller: the
    # streams end closer together (a stream left behind ends the run decoding alone);
    # larger: fewer stash copies.
    turn_tokens: int = 128
    # A compaction's kept block that sits in vLLM's prefix cache and that only the compacted
    # request holds: "uncache" takes it out of the prefix cache and writes it in place (a later
    # request with the same prefix misses those blocks); "copy" writes a fresh block instead
    # and leaves the cached one for later hits (one more block per kept block while the old
    # one waits in the pool). A block another running request holds is always copied.
    cached_kept_blocks: CachedKeptBlocks = "uncache"


GROUPS = {"transfer": TransferSettings, "capture": CaptureSettings, "budgets": BudgetSettings}


@dataclass(slots=True)
class ConnectorSettings:
    """kv_connector_extra_config: one flat object of keys (`from_extra`), held here as the
    connection's own keys and one group per sub-room (`transfer`, `capture`, `budgets`)."""
    kvedit_url: str = "tcp://127.0.0.1:6555"  # the server's ZMQ address
    kvedit_http_url: str = ""          # the server's HTTP address, named in the logs
    chunk_size: int = 0                # tokens per chunk; 0: the server's
    timeout: float = 2.0               # seconds before a call counts as "server unavailable"
    retry_interval: float = 1.0        # seconds between reconnect attempts while unavailable
    rope_is_neox: bool | None = None   # override the GPT-J/NeoX guess from the model type
    stats_interval_s: float = 30.0     # store/load/scheduler stats lines in vLLM's log (0: each)
    kvedit_secret_file: str = ""       # the server's shared secret; "": $KVEDIT_SECRET(_FILE),
                                       # else a loopback server's own (kvedit.rundir)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    budgets: BudgetSettings = field(default_factory=BudgetSettings)

    def secret(self) -> SecretSource:
        """Where the shared secret comes from: kvedit_secret_file, else the environment, else
        the file the server at kvedit_url made in this user's runtime directory
        (kvedit.auth); read at each (re)connect, so a restarted server is found again."""
        return SecretSource(secret_file=self.kvedit_secret_file or None, url=self.kvedit_url)

    @classmethod
    def keys(cls) -> dict[str, str | None]:
        """Every kv_connector_extra_config key -> its group (None: the connection's own)."""
        own = {f.name: None for f in fields(cls) if f.name not in GROUPS}
        return {**own, **{f.name: g for g, group in GROUPS.items() for f in fields(group)}}

    @classmethod
    def from_extra(cls, extra: dict | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        keys = cls.keys()
        unknown = sorted(set(extra) - set(keys))
        if unknown:
            raise ValueError(f"kvedit connector: unknown kv_connector_extra_config keys "
                             f"{unknown}; expected some of {sorted(keys)}")
        _check(extra)
        grouped: dict[str, dict] = {g: {} for g in GROUPS}
        own = {}
        for k, v in extra.items():
            (own if keys[k] is None else grouped[keys[k]])[k] = v
        return cls(**own, **{g: GROUPS[g](**kw) for g, kw in grouped.items()})


_DEFAULTS = {f.name: f.default for c in (ConnectorSettings, *GROUPS.values()) for f in fields(c)
             if f.name not in GROUPS}


def _check(extra: dict) -> None:
    """ValueError naming the key, its value and what was expected, for the keys whose type
    or range a wrong value would not reveal until much later."""
    def default(name):
        return _DEFAULTS[name]

    mode = extra.get("query_capture", "auto")
    if mode not in get_args(QueryCaptureMode):
        raise ValueError(f"kvedit connector: query_capture {mode!r}; expected one of "
                         f"{list(get_args(QueryCaptureMode))}")
    store = extra.get("store", default("store"))
    if store not in STORE_MODES:
        raise ValueError(f"kvedit connector: store {store!r}; expected one of "
                         f"{list(STORE_MODES)}")
    pins = extra.get("pin_max_chunks", default("pin_max_chunks"))
    ttl = extra.get("pin_ttl_s", default("pin_ttl_s"))
    if isinstance(pins, bool) or not isinstance(pins, int) or pins < 0:
        raise ValueError(f"kvedit connector: pin_max_chunks {pins!r}; expected a chunk "
                         "count >= 0 (0: no pins)")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
        raise ValueError(f"kvedit connector: pin_ttl_s {ttl!r}; expected seconds > 0")
    kept = extra.get("cached_kept_blocks", default("cached_kept_blocks"))
    if kept not in get_args(CachedKeptBlocks):
        raise ValueError(f"kvedit connector: cached_kept_blocks {kept!r}; expected one of "
                         f"{list(get_args(CachedKeptBlocks))}")
    for name in ("in_engine", "device_wait", "key_watch", "defer_frees"):
        if not isinstance(extra.get(name, default(name)), bool):
            raise ValueError(f"kvedit connector: {name} {extra[name]!r}; expected true or "
                             "false")
    wait = extra.get("store_wait_s", 5.0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 300:
        raise ValueError(f"kvedit connector: store_wait_s {wait!r}; expected seconds "
                         "between 0 and 300 (0: never wait for an in-flight store)")


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    """Both connector sides' one rule: a chunk is whole vLLM blocks (its slots are the blocks'
    own, so a chunk never splits a block between two keys)."""
    if chunk_size % block_size:
        raise ValueError(f"kvedit connector: chunk_size {chunk_size} must be a multiple of "
                         f"vLLM's block size {block_size}")


def rope_params(hf_config, head_dim: int, is_neox: bool | None = None) -> RopeParams | None:
    """RoPE parameters from a HF config (transformers 5 `rope_parameters` or older
    `rope_theta` + `rope_scaling`). None when the model has no rotary embedding."""
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    params = dict(getattr(text, "rope_parameters", None) or {})
    if not params:
        if getattr(text, "rope_theta", None) is None:
            return None
        params = dict(getattr(text, "rope_scaling", None) or {})
        params["rope_theta"] = text.rope_theta
    theta = float(params.pop("rope_theta"))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    partial = params.pop("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
    if is_neox is None:
        is_neox = getattr(text, "model_type", "") not in GPTJ_STYLE_MODELS
    scaling = {k: v for k, v in params.items()
               if v is None or isinstance(v, (bool, int, float, str))}
    return RopeParams(theta=theta, rotary_dim=int(head_dim * float(partial)), is_neox=is_neox,
                      rope_type=rope_type, scaling=scaling,
                      max_position_embeddings=int(getattr(text, "max_position_embeddings", 0)
                                                  or 0))


def model_layout(vllm_config, chunk_size: int, tp_rank: int,
                 is_neox: bool | None = None) -> ModelLayout:
    """This rank's KV layout as the kvedit server stores it."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise ValueError(f"kvedit connector: kv_cache_dtype {cache_dtype!r} is not supported; "
                         "expected 'auto' (KV in the model dtype)")
    head_dim = mc.get_head_size()
    layout = ModelLayout(
        num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=head_dim, dtype=str(mc.dtype).removeprefix("torch."),
        chunk_size=chunk_size, tp_rank=tp_rank, tp_size=pc.tensor_parallel_size,
        rope=rope_params(mc.hf_config, head_dim, is_neox),
        num_q_heads=mc.get_num_attention_heads(pc))   # the captured queries' width
    layout.validate()
    return layout
