"""KVzip in kvedit against kvpress's KVzipPress, factor by factor, in transformers (float32).

One prefill per sample. Scores:
  kvedit   kvedit's KVzip score (kvedit.edits.attention.window_attention, rows=max, heads=max)
           on kvedit's one reconstruction pass (repeat prompt + the whole context after the
           template opening), softmax over the context keys only (renormalised)
  fullden  the same pass, softmax over context + the pass's own keys (causal), as kvpress
  kvpress  KVzipPress's own scores (its 2048-token chunked passes), taken before it masks
Selections (each keeps L*H*T' (layer, head, token) entries, T' = T - floor(r*T)):
  global   one ranking over every layer, head and token (KVzipPress)
  layer    AdaKV inside each layer's total (H*T' per layer, split over its heads)
  head     T' per (layer, head)
  tmean    one decision per token, score = mean over (layer, head)
  tmax     one decision per token, score = max over (layer, head)
Positions: masked keys keep their positions (kvpress's attention patch: equal to kvedit's
"logical"); `*_compact` drop the tokens and re-rotate to 0..T'-1 (kvedit per token default).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.llama.modeling_llama import rotate_half

import kvpress  # noqa: F401  (patches attention for masked keys)
from kvpress import KVzipPress
from kvpress.pipeline import KVPressTextGenerationPipeline
from kvpress.utils import get_prerope_query_states

from kvedit.edits.attention import Window, window_attention
from kvedit.edits.rope import rerotate
from kvedit.harness.eval.tasks import build
from kvedit.harness.eval.tokenizer import load
from kvedit.layout import ModelLayout, RopeParams
from kvedit.sdk.kvzip import REPEAT_PROMPT


class SavedKVzip(KVzipPress):
    def compress_post(self, model):
        self.score_val[..., :self.n_sink] = self.score_val.amax() + 1.0
        self.saved = self.score_val[:, 0].clone().float()


def kv_of(cache, L):
    ks = [cache.layers[l].keys[0] for l in range(L)]   # [H, T, d]
    vs = [cache.layers[l].values[0] for l in range(L)]
    H, T, d = ks[0].shape
    k = torch.stack([x.transpose(0, 1).reshape(T, H * d) for x in ks])
    v = torch.stack([x.transpose(0, 1).reshape(T, H * d) for x in vs])
    return torch.stack([k, v])


def capture_pass(model, cache, ids, T):
    """Post-RoPE queries [L, W, Hq*d] and own keys [L, H, W, d] of a pass appended to the
    cache; the cache is cut back to T tokens after."""
    layers = model.model.layers
    qs = [None] * len(layers)

    def hook(i):
        def pre(module, args, kwargs):
            h = kwargs["hidden_states"]
            q = get_prerope_query_states(module, h)           # [1, Hq, W, d]
            cos, sin = kwargs["position_embeddings"]
            q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
            qs[i] = q[0].transpose(0, 1).reshape(q.shape[2], -1).detach()
        return pre

    hs = [l.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
          for i, l in enumerate(layers)]
    try:
        with torch.no_grad():
            model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
    finally:
        for h in hs:
            h.remove()
    own = []
    for l in range(len(layers)):
        lay = cache.layers[l]
        own.append(lay.keys[0, :, T:].clone())
        lay.keys, lay.values = lay.keys[:, :, :T], lay.values[:, :, :T]
    return torch.stack(qs), torch.stack(own)


def fullden_scores(kv, queries, own, head_dim, rows=512):
    """max over rows and the GQA group of softmax(q . [context keys, own keys causal])."""
    L, T, HD = kv.shape[1:]
    H = HD // head_dim
    W = queries.shape[1]
    g = queries.shape[2] // head_dim // H
    out = torch.zeros(L, H, T)
    scale = 1 / math.sqrt(head_dim)
    for l in range(L):
        k = kv[0, l].view(T, H, head_dim).transpose(0, 1)               # [H, T, d]
        keys = torch.cat([k, own[l]], dim=1)                            # [H, T+W, d]
        best = torch.zeros(H, T)
        for r0 in range(0, W, rows):
            r1 = min(W, r0 + rows)
            q = queries[l, r0:r1].view(r1 - r0, H, g, head_dim).permute(1, 2, 0, 3)
            logit = (q @ keys[:, None].transpose(-1, -2)) * scale        # [H, g, r, T+W]
            i = torch.arange(r0, r1)[:, None]
            j = torch.arange(W)[None, :]
            logit[..., T:] = logit[..., T:].masked_fill(j > i, float("-inf"))
            p = logit.softmax(-1)[..., :T]
            best = torch.maximum(best, p.amax(dim=(1, 2)))
        out[l] = best
    return out


def select(scores, how, keep):
    """bool keep mask [L, H, T] from per-(layer, head) scores."""
    L, H, T = scores.shape
    m = torch.zeros(L, H, T, dtype=torch.bool)
    if how == "global":
        idx = scores.reshape(-1).topk(L * H * keep).indices
        m.view(-1)[idx] = True
    elif how == "layer":
        idx = scores.reshape(L, -1).topk(H * keep, dim=1).indices
        m.view(L, -1).scatter_(1, idx, True)
    elif how == "head":
        idx = scores.topk(keep, dim=-1).indices
        m.scatter_(-1, idx, True)
    elif how in ("tmean", "tmax"):
        s = scores.clone()
        fin = torch.isfinite(s)
        s[~fin] = 0
        tok = s.mean(dim=(0, 1)) if how == "tmean" else s.amax(dim=(0, 1))
        tok[(~fin).any(0).any(0)] = float("inf")
        m[:, :, tok.topk(keep).indices] = True
    else:
        raise ValueError(how)
    return m


def batch_cache(kvs):
    """A DynamicCache of batch len(kvs) from [2, L, T, H*d] tensors of one length."""
    cache = DynamicCache()
    L, T, HD = kvs[0].shape[1:]
    H = LAYOUT.num_kv_heads
    for l in range(L):
        k = torch.stack([kv[0, l].view(T, H, -1).transpose(0, 1) for kv in kvs]).contiguous()
        v = torch.stack([kv[1, l].view(T, H, -1).transpose(0, 1) for kv in kvs]).contiguous()
        cache.update(k, v, l)
    return cache


def greedy(model, cache, q_ids, start, max_tokens, eos):
    """Greedy answers of a batch (rows share the question), positions from `start`."""
    B = cache.layers[0].keys.shape[0]
    ids = torch.tensor([q_ids] * B)
    pos = torch.arange(start, start + len(q_ids))[None].expand(B, -1)
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, position_ids=pos,
                       logits_to_keep=1).logits[:, -1]
        nxt = logits.argmax(-1)
        p = start + len(q_ids)
        for i in range(max_tokens):
            out.append(nxt)
            if i == max_tokens - 1:
                break
            logits = model(input_ids=nxt[:, None], past_key_values=cache,
                           position_ids=torch.full((B, 1), p + i)).logits[:, -1]
            nxt = logits.argmax(-1)
    toks = torch.stack(out, 1).tolist()
    res = []
    for row in toks:
        cut = [t for t in row]
        for j, t in enumerate(row):
            if t in eos:
                cut = row[:j]
                break
        res.append(cut)
    return res


def answer_masked(model, kv, masks, q_ids, T, max_tokens, eos):
    """One batch: row b attends to kv with the entries not in masks[b] masked (kvpress's
    patch: positions kept)."""
    L = kv.shape[1]
    cache = batch_cache([kv] * len(masks))
    for l in range(L):
        parts = [(b, (~m[l]).nonzero()) for b, m in enumerate(masks)]
        model.model.layers[l].self_attn.masked_key_indices = (
            torch.cat([torch.full((len(d),), b, dtype=torch.long) for b, d in parts]),
            torch.cat([d[:, 0] for _, d in parts]), torch.cat([d[:, 1] for _, d in parts]))
    try:
        return greedy(model, cache, q_ids, T, max_tokens, eos)
    finally:
        for l in range(L):
            model.model.layers[l].self_attn.masked_key_indices = None


def answer_compact(model, kv, token_masks, q_ids, max_tokens, eos):
    """Drop the tokens (one decision per token), re-rotate kept keys to 0..T'-1, answer."""
    outs = []
    for m in token_masks:
        idx = m.nonzero().flatten()
        out = kv.index_select(2, idx).clone()
        rerotate(out, idx, torch.arange(len(idx)), LAYOUT)
        outs.append(out)
    return greedy(model, batch_cache(outs), q_ids, outs[0].shape[2], max_tokens, eos)


def needle_kept(mask, s):
    """Share of (layer, head) entries kept over the asked needle's tokens."""
    p, n = s.needle_positions[0], len(s.needle_ids[0])
    return float(mask[:, :, p:p + n].float().mean())


LAYOUT = None


def watchdog(limit_gb: float = 15.0):
    """Exit before the OOM killer picks a neighbour: this box is shared."""
    import os
    import threading

    def run():
        while True:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            if rss > limit_gb * 2**30:
                print(f"watchdog: RSS {rss / 2**30:.1f} GB > {limit_gb} GB, exiting",
                      file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.5)
    threading.Thread(target=run, daemon=True).start()


def mark(what):
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"  [{what}] peak RSS {peak:.1f} GB", file=sys.stderr, flush=True)


def scores_for(model, tok, s, want, cache_dir):
    """(kv [2, L, T, D], {score name: [L, H, T]}) for sample s, from disk when there."""
    from pathlib import Path
    path = Path(cache_dir) / f"{s.task}-{s.length}-{s.depth}-{s.index}-{s.seed}.pt"
    have = torch.load(path) if path.exists() else {"scores": {}}
    missing = [w for w in want if w not in have["scores"]]
    if not missing and "kv" in have:
        return have["kv"], have["scores"]
    L = model.config.num_hidden_layers
    ctx, T = s.prompt_ids[:s.length], s.length
    t0 = time.time()
    cache = DynamicCache()
    if "kvpress" in missing:
        press = SavedKVzip(compression_ratio=0.5, n_sink=s.header)
        with press(model), torch.no_grad():
            model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
        for l in range(L):
            model.model.layers[l].self_attn.masked_key_indices = None
        have["scores"]["kvpress"] = press.saved
        mark("prefill + kvpress pass")
    else:
        with torch.no_grad():
            model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
    kv = kv_of(cache, L)
    have["kv"] = kv
    if "kvedit" in missing or "fullden" in missing:
        repeat = tok.encode(REPEAT_PROMPT + tok.after_user)
        start = len(tok.encode(tok.before_user))
        queries, own = capture_pass(model, cache, repeat + ctx[start:], T)
        mark("kvedit pass")
        d = LAYOUT.head_dim
        sc = window_attention(kv, Window(queries, T), d, heads="max", rows="max",
                              per_head=True)
        sc[..., :s.header] = float("inf")
        have["scores"]["kvedit"] = sc
        sc = fullden_scores(kv, queries, own, d)
        sc[..., :s.header] = float("inf")
        have["scores"]["fullden"] = sc
        torch.save(queries.half(), path.with_suffix(".q.pt"))  # Expected Attention, later
        mark("scores")
    torch.save(have, path)
    print(f"  scores of {path.name} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return kv, have["scores"]


def main(argv=None):
    global LAYOUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--picks", required=True, help="task:depth:index:seed,...")
    ap.add_argument("--ratios", default="0.75")
    ap.add_argument("--scores", default="kvedit,fullden")
    ap.add_argument("--selections", default="global,layer,head,tmean,tmax,tmean_compact")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default="/tmp/i43a/analysis/cache")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    watchdog()
    from pathlib import Path
    Path(a.cache).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    tok = load(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    import gc
    gc.collect()
    mark("model loaded")
    cfg = model.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    LAYOUT = ModelLayout(num_layers=L, num_kv_heads=H, head_dim=d, dtype="float32",
                         chunk_size=128, num_q_heads=cfg.num_attention_heads,
                         rope=RopeParams(theta=cfg.rope_parameters["rope_theta"]))
    eos = {cfg.eos_token_id} if isinstance(cfg.eos_token_id, int) else set(cfg.eos_token_id)
    ratios = [float(r) for r in a.ratios.split(",")]
    want = a.scores.split(",")
    out = open(a.out, "a")
    for pick in a.picks.split(","):
        task, depth, index, seed = pick.split(":")
        s = build(tok, task, a.length, float(depth), int(index), int(seed))
        q_ids, T = list(s.prompt_ids[s.length:]), s.length
        t0 = time.time()
        kv, scores = scores_for(model, tok, s, want, a.cache)
        rec = {"task": task, "depth": float(depth), "index": int(index), "seed": int(seed),
               "length": T, "answer": list(s.answers)}
        arms = [("full", None, 0.0, torch.ones(L, H, T, dtype=torch.bool))]
        compact = []
        for r in ratios:
            keep = T - math.floor(r * T)
            for name in want:
                for how in a.selections.split(","):
                    m = select(scores[name], how.replace("_compact", ""), keep)
                    (compact if how.endswith("_compact") else arms).append((how, name, r, m))
        texts = []
        for b0 in range(0, len(arms), 6):   # 6 rows at once: the box's memory
            texts += answer_masked(model, kv, [m for *_, m in arms[b0:b0 + 6]], q_ids, T,
                                   s.max_tokens, eos)
        for r in ratios:   # one batch per ratio: the compacted caches' lengths differ
            group = [m for _, _, cr, m in compact if cr == r]
            if group:
                texts += answer_compact(model, kv, [m[0, 0] for m in group], q_ids,
                                        s.max_tokens, eos)
        for (how, name, r, m), ids in zip(arms + compact, texts):
            text = tok.decode(ids)
            out.write(json.dumps({**rec, "score": name, "selection": how, "ratio": r,
                                  "needle_kept": needle_kept(m, s),
                                  "slots": float(m.sum(-1).max()) / T, "output": text,
                                  "ok": s.correct(text)}) + "\n")
        out.flush()
        ok = sum(s.correct(tok.decode(t)) for t in texts)
        print(f"{pick}: {ok}/{len(texts)} right, {time.time() - t0:.0f} s", file=sys.stderr,
              flush=True)


if __name__ == "__main__":
    main()
