"""Paged KV layouts: gathers/scatters against a per-token reference written from vLLM's source.

Synthetic paged caches are built the way vLLM 0.32 allocates them (one backing buffer, a
physical stride order, per-layer logical [blocks, H, N, 2*hd] views). The reference reads and
writes one token at a time with the exact expressions vLLM's attention backends use:
- CPU (cpu_attn.py): kv.view(B, H, 2N, hd)[b, :, n] is K, [b, :, N + n] is V.
- FlashAttention / FlashInfer (flash_attn.py, flashinfer.py):
  kv.transpose(1, 2).split(hd, -1) -> K[b, n], V[b, n] of shape [H, hd].
CPU-layout tests run everywhere; the same CUDA-layout tests run on a GPU (@pytest.mark.gpu).
"""
from __future__ import annotations

import pytest
import torch

from kvedit.vllm.paged import PagedKV

# vLLM's KVCacheLayout stride orders over the logical [L, B, H, N, C] (kv_cache_layout.py).
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4),
          "BLNHC": (1, 0, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4)}
CASES = [  # (paged kind, stride order, kernel block N, scheduler block)
    ("cpu", "LBHNC", 128, 128),          # vLLM CPU backend (block 128)
    ("cpu", "LBHNC", 32, 128),           # CPU kernel blocks split a scheduler block
    ("cpu_amx", "LBHNC", 128, 128),      # vLLM CPU backend, bf16 on AMX hardware
    ("cpu_amx", "LBHNC", 32, 64),
    ("cuda", "LBNHC", 16, 16),           # FlashAttention default (NHD), block 16
    ("cuda", "LBHNC", 16, 16),           # FlashInfer HND
    ("cuda", "BLHNC", 16, 16),           # layers interleaved inside blocks
    ("cuda", "BLNHC", 16, 32),
    ("cuda", "LHBNC", 16, 16),
]
L, H, HD, CHUNK = 3, 2, 32, 64


def make_layers(order: str, nblocks: int, n: int, dtype, device) -> list[torch.Tensor]:
    """Per-layer logical [B, H, N, 2*hd] views of one buffer in physical `order`."""
    perm = ORDERS[order]
    logical = (L, nblocks, H, n, 2 * HD)
    buf = torch.zeros([logical[i] for i in perm], dtype=dtype, device=device)
    view = buf.permute(*[perm.index(i) for i in range(5)])
    return [view[layer] for layer in range(L)]


def ref_token(layer: torch.Tensor, kind: str, b: int, n: int) -> tuple[torch.Tensor, ...]:
    """(K, V) views [H, hd] of one token, as the attention backend sees them."""
    if kind == "cuda":
        k, v = layer.transpose(1, 2).split(HD, dim=-1)
        return k[b, n], v[b, n]
    bs = layer.shape[2]
    tiles = layer[b].reshape(layer.shape[1], -1)  # [H, 2*N*hd]: one tile per head
    d = torch.arange(HD)
    if kind == "cpu":  # K tile [hd, N] (transposed), then V tile [N, hd]
        k_off, v_off = d * bs + n, bs * HD + n * HD + d
    else:  # cpu_amx: 16-token groups of dim pairs, then 16-dim groups of token pairs
        k_off = (n // 16) * 16 * HD + (d // 2) * 32 + (n % 16) * 2 + d % 2
        v_off = bs * HD + (d // 16) * 16 * bs + (n // 2) * 32 + (d % 16) * 2 + n % 2
    return _Sel(tiles, k_off.to(tiles.device)), _Sel(tiles, v_off.to(tiles.device))


class _Sel:
    """Elements tiles[:, off] as a read/write [H, hd] handle (offsets need not be a view)."""

    def __init__(self, tiles, off):
        self.tiles, self.off = tiles, off

    def copy_(self, x):
        self.tiles[:, self.off] = x.to(self.tiles.device)

    def reshape(self, *shape):
        return self.tiles[:, self.off].reshape(*shape)


def slot_of(block_ids, pos: int, sched_block: int, n: int) -> tuple[int, int]:
    kb = block_ids[pos // sched_block] * (sched_block // n) + (pos % sched_block) // n
    return kb, pos % n


def setup(kind, order, n, sched, device, dtype=torch.float32, tokens=2 * CHUNK + 40):
    gen = torch.Generator().manual_seed(0)
    nsched = 12
    layers = make_layers(order, nsched * (sched // n), n, dtype, device)
    block_ids = torch.randperm(nsched, generator=gen)[: -(-tokens // sched)].tolist()
    kv = torch.randn(2, L, tokens, H * HD, generator=gen).to(dtype)
    return layers, block_ids, kv


def write_ref(layers, kind, block_ids, sched, n, kv, start, end):
    for pos in range(start, end):
        b, off = slot_of(block_ids, pos, sched, n)
        for layer in range(L):
            k, v = ref_token(layers[layer], kind, b, off)
            k.copy_(kv[0, layer, pos].view(H, HD))
            v.copy_(kv[1, layer, pos].view(H, HD))


def read_ref(layers, kind, block_ids, sched, n, start, end) -> torch.Tensor:
    out = torch.empty(2, L, end - start, H * HD, dtype=layers[0].dtype)
    for pos in range(start, end):
        b, off = slot_of(block_ids, pos, sched, n)
        for layer in range(L):
            k, v = ref_token(layers[layer], kind, b, off)
            out[0, layer, pos - start] = k.reshape(-1).cpu()
            out[1, layer, pos - start] = v.reshape(-1).cpu()
    return out


def check_gather(device, kind, order, n, sched):
    layers, block_ids, kv = setup(kind, order, n, sched, device)
    write_ref(layers, kind, block_ids, sched, n, kv, 0, kv.shape[2])
    paged = PagedKV(layers, kind, HD, sched)
    assert len(paged.groups) == 1  # one backing buffer -> one op per K/V per chunk
    for c in range(2):
        out = torch.empty(2, L, CHUNK, H * HD, device=device)
        paged.gather(paged.slots(block_ids, c * CHUNK, (c + 1) * CHUNK), out)
        torch.testing.assert_close(out.cpu(), kv[:, :, c * CHUNK:(c + 1) * CHUNK], rtol=0,
                                   atol=0)


def check_scatter(device, kind, order, n, sched):
    layers, block_ids, kv = setup(kind, order, n, sched, device)
    paged = PagedKV(layers, kind, HD, sched)
    start, end = 37, 2 * CHUNK  # a load may start mid-chunk (after a local prefix hit)
    paged.scatter(paged.slots(block_ids, start, end), kv[:, :, start:end].to(device))
    torch.testing.assert_close(read_ref(layers, kind, block_ids, sched, n, start, end),
                               kv[:, :, start:end], rtol=0, atol=0)
    # Nothing outside the target slots was touched.
    total = sum(t.abs().sum().item() for t in layers)
    assert total == pytest.approx(kv[:, :, start:end].abs().sum().item(), rel=1e-5)


@pytest.mark.parametrize("kind,order,n,sched", CASES)
def test_gather_matches_backend_layout(kind, order, n, sched):
    check_gather("cpu", kind, order, n, sched)


@pytest.mark.parametrize("kind,order,n,sched", CASES)
def test_scatter_writes_only_target_slots(kind, order, n, sched):
    check_scatter("cpu", kind, order, n, sched)


def test_separate_layer_storages():
    """Layers in separate allocations (older vLLM): one gather per storage, same result."""
    layers = [t.clone() for t in make_layers("LBNHC", 8, 16, torch.float32, "cpu")]
    block_ids = [5, 2, 7, 0]
    kv = torch.randn(2, L, 64, H * HD)
    write_ref(layers, "cuda", block_ids, 16, 16, kv, 0, 64)
    paged = PagedKV(layers, "cuda", HD, 16)
    assert len(paged.groups) == L
    out = torch.empty(2, L, 64, H * HD)
    paged.gather(paged.slots(block_ids, 0, 64), out)
    assert torch.equal(out, kv)


def test_bad_layout_is_a_clear_error():
    layers = make_layers("LBHNC", 4, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="2\\*head_dim"):
        PagedKV(layers, "cuda", HD * 2, 16)
    with pytest.raises(ValueError, match="unknown paged layout"):
        PagedKV(layers, "rocm", HD, 16)
    with pytest.raises(ValueError, match="multiple of the kernel block"):
        PagedKV(layers, "cuda", HD, 24)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    return "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("kind,order,n,sched", [c for c in CASES if c[0] == "cuda"])
def test_cuda_gather(kind, order, n, sched):
    check_gather(_cuda(), kind, order, n, sched)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,order,n,sched", [c for c in CASES if c[0] == "cuda"])
def test_cuda_scatter(kind, order, n, sched):
    check_scatter(_cuda(), kind, order, n, sched)


@pytest.mark.gpu
def test_cuda_bf16_roundtrip():
    device = _cuda()
    layers, block_ids, kv = setup("cuda", "LBNHC", 16, 16, device, dtype=torch.bfloat16)
    paged = PagedKV(layers, "cuda", HD, 16)
    slots = paged.slots(block_ids, 0, CHUNK)
    paged.scatter(slots, kv[:, :, :CHUNK].to(device))
    out = torch.empty(2, L, CHUNK, H * HD, dtype=torch.bfloat16, device=device)
    paged.gather(slots, out)
    assert torch.equal(out.cpu(), kv[:, :, :CHUNK])


@pytest.mark.parametrize("isa,dtype,n", [("vec", torch.float32, 128), ("vec", torch.bfloat16, 32),
                                         ("vec16", torch.float32, 16),
                                         ("amx", torch.bfloat16, 128)])
def test_cpu_layouts_match_vllm_kernel(isa, dtype, n):
    """vLLM's own CPU cache-write kernel puts each token where PagedKV reads it."""
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip("this vLLM build has no CPU attention ops (a CUDA build)")
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU")
    hd, nblocks, tokens = 64, 6, 2 * n + 5
    cache = torch.zeros(nblocks, H, n, 2 * hd, dtype=dtype)
    k_cache, v_cache = cache.view(nblocks, H, 2 * n, hd).chunk(2, dim=2)
    block_ids = [4, 1, 5]
    slot = torch.tensor([block_ids[p // n] * n + p % n for p in range(tokens)])
    key, value = torch.randn(2, tokens, H, hd).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slot, isa)
    paged = PagedKV([cache], "cpu_amx" if isa == "amx" else "cpu", hd, n)
    out = torch.empty(2, 1, tokens, H * hd, dtype=dtype)
    paged.gather(paged.slots(block_ids, 0, tokens), out)
    assert torch.equal(out[0, 0], key.flatten(1)) and torch.equal(out[1, 0], value.flatten(1))


# Whole-block copies (CPU AMX layout): the same bytes as the per-token ops they replace.
BLOCKWISE = [  # (kind, kernel block N, scheduler block)
    ("cpu_amx", 128, 128), ("cpu_amx", 32, 64), ("cpu_amx", 16, 16), ("cpu", 128, 128),
    ("cpu", 32, 128)]


def _positions(case: str, total: int, sched: int, gen) -> torch.Tensor:
    if case == "whole":          # every slot of whole blocks
        return torch.arange(total)
    if case == "partial":        # the last block partly filled
        return torch.arange(total - sched // 2 - 3)
    if case == "offset":         # from a start offset (a compaction's unmoved slots)
        return torch.arange(sched // 2 + 5, total)
    if case == "kept":           # gather_kept: sinks and a recent window
        return torch.cat([torch.arange(4), torch.arange(total - 2 * sched - 7, total)])
    if case == "sorted":         # arbitrary kept slots in order
        return torch.randperm(total, generator=gen)[:3 * total // 4].sort().values
    return torch.randperm(total, generator=gen)[:3 * total // 4]  # any order


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _blockwise_case(kind, n, sched, dtype, shared):
    gen = torch.Generator().manual_seed(1)
    nblocks = 10 * (sched // n)
    if shared:   # one buffer, layers at a uniform stride
        layers = list(torch.randn(L, nblocks, H, n, 2 * HD, generator=gen).to(dtype))
    else:        # one tensor per layer (vLLM's CPU backend)
        layers = [torch.randn(nblocks, H, n, 2 * HD, generator=gen).to(dtype) for _ in range(L)]
    paged = PagedKV(layers, kind, HD, sched)
    block_ids = torch.randperm(10, generator=gen)[:5].tolist()
    return layers, paged, block_ids, gen


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind,n,sched", BLOCKWISE)
@pytest.mark.parametrize("case", ["whole", "partial", "offset", "kept", "sorted", "shuffled"])
def test_blockwise_copies_match_per_token_ops(case, kind, n, sched, dtype, shared):
    layers, paged, block_ids, gen = _blockwise_case(kind, n, sched, dtype, shared)
    pos = _positions(case, 5 * sched, sched, gen)
    slots = paged.slots_at(block_ids, pos)
    want = torch.empty(2, L, pos.numel(), H * HD, dtype=dtype)
    paged._gather_slots(slots, want)
    got = torch.full_like(want, 7)
    paged.gather(slots, got)
    assert torch.equal(_bits(got), _bits(want))
    if kind == "cpu_amx":
        assert paged._blockwise_gather(slots, got)  # the whole-block path ran

    src = torch.randn(2, L, pos.numel(), H * HD, generator=gen).to(dtype)
    before = [t.clone() for t in layers]
    paged._scatter_slots(slots, src)
    want_layers = [t.clone() for t in layers]
    for t, b in zip(layers, before):
        t.copy_(b)
    paged.scatter(slots, src)
    for t, w in zip(layers, want_layers):
        assert torch.equal(_bits(t), _bits(w))
    if kind == "cpu_amx" and case in ("whole", "partial", "offset"):
        assert paged._blockwise_scatter(slots, src) is not None  # whole blocks written


def test_blockwise_scatter_leaves_a_block_written_twice_to_the_per_token_ops():
    layers, paged, block_ids, gen = _blockwise_case("cpu_amx", 32, 32, torch.bfloat16, False)
    pos = torch.cat([torch.arange(64), torch.arange(40, 48)])  # block 1 whole, then again
    slots = paged.slots_at(block_ids, pos)
    src = torch.randn(2, L, pos.numel(), H * HD, generator=gen).to(torch.bfloat16)
    assert paged._blockwise_scatter(slots, src) is None
