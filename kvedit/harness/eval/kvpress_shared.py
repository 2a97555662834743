"""Runs inside kvpress's environment (imported by kvpress_worker.py, never by kvedit): every
press of a sample from one prefill, and their answers decoded in batches.

kvpress's pipeline prefills the context once per press: its presses compress in a forward
hook, after each layer's attention has run on the full keys, so a layer's compression never
changes what the layers after it compute. One prefill can therefore serve every press: the
attention inputs of each layer (its hidden states, the cache's keys and values, the RoPE
embeddings) are kept, and each press's `compress` is called on them layer by layer, exactly
as its hook would have been. What it returns is what its own prefill would have left:
pruned keys and values (a ScorerPress: the same count in every head and layer) or masked
key indices (AdaKVPress). KVzipPress needs its reconstruction passes: it wraps the shared
prefill and scores the cache afterwards; its scores are ranked once per ratio, globally,
as its `compress_post` ranks them. A question-aware arm (the question text compressed with
the context) has a prefill of its own, shared the same way by every such arm.

The answers: arms whose caches have one length (the pruned ones of one ratio, or the full
cache with masked keys, the uncompressed baseline among them) decode together, one row
each, greedily from the position kvpress starts at (the context length), each row cut at
its first end-of-sequence token as kvpress stops there. Checked against kvpress's pipeline,
press by press (tests/engine/test_kvpress_reference.py).
"""
from __future__ import annotations

import math

import torch
from transformers import DynamicCache

import kvpress
from kvpress import AdaKVPress, KVzipPress
from kvpress.presses.scorer_press import ScorerPress

# Rows decoded at once: a 4k float32 cache of Qwen2.5-1.5B is ~0.25 GB a row, and a decode
# step's cache concatenation holds two copies; a CPU host also holds the float32 model.
MAX_BATCH = 8
MAX_BATCH_CPU = 4


def shareable(press) -> bool:
    """Whether `press` runs from a shared prefill (else: kvpress's pipeline, alone)."""
    return press is None or isinstance(press, (ScorerPress, KVzipPress)) or (
        isinstance(press, AdaKVPress) and isinstance(press.press, ScorerPress))


class _ScoresKept(KVzipPress):
    """KVzipPress that keeps its scores (sinks included) instead of masking one ratio."""

    def compress_post(self, model):
        self.score_val[..., : self.n_sink] = self.score_val.amax() + 1.0
        self.kept_scores = self.score_val[:, 0].float().clone()      # [L, H, T]


class Prefill:
    """One prefill of `ids`: per layer the attention's inputs, for every press's compress."""

    def __init__(self, model, ids: list[int], kvzip_sink: int | None = None):
        self.model, self.length = model, len(ids)
        self.cache, self.inputs = DynamicCache(), {}
        layers = model.model.layers
        for layer in layers:   # as a press's own hook context sets it: ExpectedAttentionPress
            layer.self_attn.rotary_emb = model.model.rotary_emb   # reads the RoPE from there
        zipper = _ScoresKept(compression_ratio=0.5, n_sink=kvzip_sink) \
            if kvzip_sink is not None else None

        def keep(module, args, kwargs, output):
            self.inputs[module.layer_idx] = (
                kwargs["hidden_states"], {"position_embeddings": kwargs["position_embeddings"],
                                          "cache_position": kwargs.get("cache_position")})
            return output

        hooks = [layer.self_attn.register_forward_hook(keep, with_kwargs=True)
                 for layer in layers]
        try:
            with zipper(model) if zipper is not None else _nothing(), torch.no_grad():
                try:
                    model.model(input_ids=torch.tensor([ids], device=model.device),
                                past_key_values=self.cache)
                finally:
                    for h in hooks:   # before KVzip's passes, which run on exit
                        h.remove()
        finally:
            for layer in layers:
                layer.self_attn.masked_key_indices = None
        self.kvzip_scores = getattr(zipper, "kept_scores", None)

    def full(self):
        return [(self.cache.layers[i].keys, self.cache.layers[i].values)
                for i in range(len(self.cache.layers))]

    def arm(self, press):
        """(per-layer (keys, values), per-layer masked indices or None) of `press`."""
        kv = self.full()
        if press is None:
            return kv, None
        if isinstance(press, KVzipPress):
            return kv, _global_mask(self.kvzip_scores, press.compression_ratio)
        press.post_init_from_model(self.model)
        out, masks = [], []
        with torch.no_grad():
            for i, layer in enumerate(self.model.model.layers):
                module = layer.self_attn
                h, kw = self.inputs[i]
                module.masked_key_indices = None
                keys, values = press.compress(module, h, kv[i][0], kv[i][1], None, kw)
                out.append((keys, values))
                masks.append(getattr(module, "masked_key_indices", None))
                module.masked_key_indices = None
        return out, (masks if any(m is not None for m in masks) else None)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _global_mask(scores: torch.Tensor, ratio: float):
    """KVzipPress's compress_post: the lowest int(n * ratio) of every (layer, head, token),
    as per-layer (batch, head, seq) indices."""
    L, H, T = scores.shape
    pruned = torch.topk(-scores.reshape(-1), int(scores.numel() * ratio)).indices
    masks = []
    for layer in range(L):
        mine = pruned[(pruned // (H * T)) == layer] % (H * T)
        masks.append((torch.zeros(len(mine), dtype=torch.long, device=mine.device), mine // T,
                      mine % T))
    return masks


def answer(model, tokenizer, rows: list, question: list[int], start: int,
           max_tokens: int) -> list[str]:
    """Greedy answers of `rows` [(per-layer (keys, values), masks or None)], each cache of
    one length, to `question` at positions start.., in batches of MAX_BATCH."""
    texts: list[str] = []
    size = MAX_BATCH if model.device.type == "cuda" else MAX_BATCH_CPU
    for b0 in range(0, len(rows), size):
        texts += _batch(model, tokenizer, rows[b0:b0 + size], question, start, max_tokens)
    return texts


def _batch(model, tokenizer, rows, question, start, max_tokens) -> list[str]:
    layers = model.model.layers
    cache = DynamicCache()
    for i in range(len(layers)):
        cache.update(torch.cat([r[0][i][0] for r in rows]),
                     torch.cat([r[0][i][1] for r in rows]), i)
    for i, layer in enumerate(layers):
        parts = [(b, r[1][i]) for b, r in enumerate(rows) if r[1] is not None and r[1][i]
                 is not None]
        layer.self_attn.masked_key_indices = None if not parts else (
            torch.cat([torch.full_like(m[0], b) for b, m in parts]),
            torch.cat([m[1] for _, m in parts]), torch.cat([m[2] for _, m in parts]))
    B = len(rows)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    try:
        with torch.no_grad():
            dev = model.device   # the ids where the model is (CUDA on a GPU host)
            pos = torch.arange(start, start + len(question), device=dev)[None].expand(B, -1)
            logits = model(input_ids=torch.tensor([question] * B, device=dev),
                           past_key_values=cache,
                           position_ids=pos, logits_to_keep=1).logits[:, -1]
            nxt = logits.argmax(-1)
            for i in range(max_tokens):
                out.append(nxt)
                if i == max_tokens - 1:
                    break
                p = torch.full((B, 1), start + len(question) + i, device=dev)
                nxt = model(input_ids=nxt[:, None], past_key_values=cache,
                            position_ids=p).logits[:, -1].argmax(-1)
    finally:
        for layer in layers:
            layer.self_attn.masked_key_indices = None
    texts = []
    for row in torch.stack(out, 1).tolist():
        cut = next((j for j, t in enumerate(row) if t in eos), len(row))
        texts.append(str(tokenizer.decode(row[:cut], skip_special_tokens=True)))
    return texts


def press_of(spec: dict, ratio: float, question: int):
    """The press of an arm spec at `ratio`; a `window_size` of "question" becomes the
    question text's length (the observation window is the question alone)."""
    if spec["press"] is None:
        return None
    press = getattr(kvpress, spec["press"])
    kwargs = dict(spec.get("kwargs") or {})
    if kwargs.get("window_size") == "question":
        kwargs["window_size"] = max(1, question)
    inner = kwargs.pop("inner", None)
    if inner is not None:  # a wrapper press (AdaKVPress(SnapKVPress(...)))
        return press(getattr(kvpress, inner)(compression_ratio=ratio, **kwargs))
    return press(compression_ratio=ratio, **kwargs)


def arm_ratio(spec: dict, context: int, split: int) -> float:
    """The press's ratio: a question-aware arm compresses context + question text at the
    ratio that drops as many tokens as the arm's ratio drops of the context alone."""
    if not spec.get("question_in_context"):
        return spec["ratio"]
    drop = math.floor(spec["ratio"] * context)
    return (drop - 0.5) / (context + split)   # kvpress keeps int(n * (1 - ratio))
