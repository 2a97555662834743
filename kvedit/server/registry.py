"""The registered model layouts (a mixin of Service, kept out of service.py).

Why a room of its own: every request names a (model, tp_rank) whose layout must be
registered, and every request's keys go through the same checks before the index sees
them (`_layout`: the key count, each key's size, the model, with an `unknown_model` error of
bounded size); Register checks a layout against the server's limits before it is kept;
ListModels and /status read them. A handler's refusal is `Fail` (an error code and a
message naming what was wrong), shared with the service's other handlers.
"""
from __future__ import annotations

import logging

from kvedit import protocol as P
from kvedit.layout import ModelLayout
from kvedit.server import layout_limits

log = logging.getLogger("kvedit.server")
MAX_LISTED_MODELS = 20    # an unknown_model error names at most this many
MAX_QUOTED_NAME = 80      # characters of a client-given name quoted back in an error


class Fail(Exception):
    """Raised by a handler: becomes an Error(code, message) reply."""

    def __init__(self, code: P.ErrorCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def quoted(name: str) -> str:
    return repr(name if len(name) <= MAX_QUOTED_NAME else name[:MAX_QUOTED_NAME] + "...")


class Registry:
    """Mixed into Service: uses its cfg, arena, layouts (and `_check_not_dropping`)."""

    def _layout(self, model: str, tp: int, keys: list[bytes] = ()) -> ModelLayout:
        if len(keys) > self.cfg.max_keys_per_request:
            raise Fail("too_many_keys", f"{len(keys)} keys in one request, at most "
                                        f"{self.cfg.max_keys_per_request} "
                                        f"(--max-keys-per-request): split the request")
        for i, k in enumerate(keys):
            if not 0 < len(k) <= P.MAX_KEY_BYTES:
                raise Fail("bad_key", f"key {i} is {len(k)} bytes, expected 1..{P.MAX_KEY_BYTES}"
                                      f" (kvedit.keys makes 16-byte keys)")
        lay = self.layouts.get((model, tp))
        if lay is None:
            # bounded: at most MAX_LISTED_MODELS names (each cut short), then a count
            known = sorted(f"{m}[tp_rank {r}]" for m, r in self.layouts)
            listed = "none"
            if known:
                listed = "[" + ", ".join(quoted(k) for k in known[:MAX_LISTED_MODELS]) + "]"
            if len(known) > MAX_LISTED_MODELS:
                listed += f" and {len(known) - MAX_LISTED_MODELS} more"
            raise Fail("unknown_model", f"model {quoted(model)} (tp_rank {tp}) is not registered;"
                                        f" registered: {listed}")
        return lay

    def _register(self, model: str, layout: ModelLayout):
        if not model:
            raise Fail("bad_layout", "model name must be a non-empty string")
        if len(model.encode()) > self.cfg.max_model_name:
            raise Fail("name_too_long", f"model name is {len(model.encode())} bytes, at most "
                                        f"{self.cfg.max_model_name} (--max-model-name)")
        try:
            layout.validate()
            layout_limits.check(layout)
        except ValueError as e:
            raise Fail("bad_layout", str(e)) from None
        if layout.chunk_size != self.cfg.chunk_size:
            raise Fail("bad_layout", f"layout.chunk_size {layout.chunk_size} does not match the "
                                     f"server's --chunk-size {self.cfg.chunk_size}")
        if layout.chunk_bytes > self.arena.pool_bytes:
            raise Fail("too_large", f"one chunk of this layout is {layout.chunk_bytes} bytes, "
                                    f"larger than the whole pool ({self.arena.pool_bytes} bytes)")
        old = self.layouts.get((model, layout.tp_rank))
        if old is not None and old != layout:
            raise Fail("layout_conflict", f"model {quoted(model)} tp_rank {layout.tp_rank} is "
                                          f"already registered with {old}, not {layout}")
        if old is None:
            self._check_not_dropping(model, layout.tp_rank)
            if len(self.layouts) >= self.cfg.max_models:
                raise Fail("too_many_models", f"{len(self.layouts)} model layouts are registered"
                                              f", at most {self.cfg.max_models} (--max-models);"
                                              f" unregister one first")
            self.layouts[(model, layout.tp_rank)] = layout
            log.info("registered model %s tp_rank %d: chunk %s %s (%d bytes)", quoted(model),
                     layout.tp_rank, layout.chunk_shape, layout.dtype, layout.chunk_bytes)
        return P.Ok()

    def models(self) -> dict[str, list[ModelLayout]]:
        """The registered layouts by model name (at most --max-models): ListModels, /status."""
        with self.lock:
            return self._models()

    def _models(self) -> dict[str, list[ModelLayout]]:
        models: dict[str, list[ModelLayout]] = {}
        for (m, _), lay in sorted(self.layouts.items()):
            models.setdefault(m, []).append(lay)
        return models
