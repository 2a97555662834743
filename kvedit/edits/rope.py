"""RoPE re-rotation: move cached keys from their original positions to new ones.

vLLM gives a request's tokens positions 0..n-1 by count, so after tokens are dropped the kept
keys must carry the rotation of their *new* (contiguous) positions, or decode attends with
wrong relative distances. A rotary embedding rotates each pair of key dimensions by
`position * inv_freq[i]`; rotations of one pair compose, so `K(p') = R(p' - p) · K(p)` and we
never need the un-rotated keys. Scalings that only change `inv_freq` (linear, llama3, yarn,
dynamic NTK as vLLM implements it) keep this property; yarn's attention factor multiplies
cos and sin alike, so it is already inside K(p) and carries over unchanged.

Angles are formed in float64 from the same float32 `inv_freq` the engine used, so the
re-rotation adds no error beyond the final cast to the cache dtype.
"""
from __future__ import annotations

import math

import torch

from kvedit.layout import ModelLayout, RopeParams

# Temporary float32 memory per block of tokens (keys of all layers at once).
_BLOCK_BYTES = 256 << 20

SUPPORTED = ("default", "linear", "llama3", "yarn", "dynamic")


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # Same expression (and float32 rounding) as transformers' and vLLM's default RoPE.
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _scale(rope: RopeParams, key: str, default=None):
    value = rope.scaling.get(key, default)
    if value is None:
        raise ValueError(f"rope_type {rope.rope_type!r} needs scaling[{key!r}], "
                         f"got {dict(rope.scaling)}")
    return value


def _llama3(rope: RopeParams, inv_freq: torch.Tensor) -> torch.Tensor:
    factor = float(_scale(rope, "factor"))
    low = float(_scale(rope, "low_freq_factor"))
    high = float(_scale(rope, "high_freq_factor"))
    old_len = float(_scale(rope, "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeParams, dim: int) -> torch.Tensor:
    factor = float(_scale(rope, "factor"))
    base = rope.theta
    orig = rope.scaling.get("original_max_position_embeddings") or rope.max_position_embeddings
    if not orig:
        raise ValueError("yarn needs scaling['original_max_position_embeddings'] or "
                         "max_position_embeddings")
    beta_fast = float(rope.scaling.get("beta_fast") or 32)
    beta_slow = float(rope.scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rotary_dim(rope: RopeParams, head_dim: int) -> int:
    """Rotated dims per head (`rope.rotary_dim`, 0 meaning all of `head_dim`)."""
    dim = rope.rotary_dim or head_dim
    if dim > head_dim or dim % 2:
        raise ValueError(f"rope.rotary_dim must be even and <= head_dim {head_dim}, got {dim}")
    return dim


def inv_freq(rope: RopeParams, head_dim: int) -> torch.Tensor:
    """float32 [rotary_dim/2] angular frequencies, as the engine computed them."""
    dim = rotary_dim(rope, head_dim)
    kind = rope.rope_type
    if kind == "default":
        return _base_inv_freq(rope.theta, dim)
    if kind == "linear":
        return _base_inv_freq(rope.theta, dim) / float(_scale(rope, "factor"))
    if kind == "llama3":
        return _llama3(rope, _base_inv_freq(rope.theta, dim))
    if kind == "yarn":
        return _yarn(rope, dim)
    if kind == "dynamic":
        return _dynamic_ntk(rope, dim)
    raise ValueError(
        f"cannot re-rotate keys for rope_type {kind!r}: supported are {SUPPORTED}. "
        "Types whose frequencies depend on the sequence length (e.g. longrope's short/long "
        "factors, dynamic NTK in transformers) do not compose as R(p'-p)·K(p).")


def _dynamic_ntk(rope: RopeParams, dim: int) -> torch.Tensor:
    # vLLM builds dynamic NTK once, with a base fixed by its config, so its frequencies do not
    # depend on the position and re-rotation is exact; we follow the engine that made the KV.
    # (transformers instead re-derives the base from the current sequence length once it
    # exceeds max_position_embeddings; keys made that way do not compose as R(p'-p)·K(p).)
    if "alpha" in rope.scaling:  # Hunyuan's NTK-alpha
        base = rope.theta * float(rope.scaling["alpha"]) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim)
    factor = float(_scale(rope, "factor"))
    max_pos = rope.max_position_embeddings
    trained = rope.scaling.get("max_trained_positions") or max_pos
    if not max_pos:
        raise ValueError("dynamic NTK needs max_position_embeddings to fix its base")
    base = rope.theta * ((factor * max_pos / trained) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim)


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, rope: RopeParams,
                head_dim: int) -> torch.Tensor:
    """Rotate `keys` [..., T, H*head_dim] in place by `delta` positions; returns `keys`.

    `delta` is [T] (the same shift for every head; leading dims such as layers broadcast, so
    one call covers every layer and head) or [..., T, H] (a shift per head, leading dims as
    in `keys`: per-head selections move each head's tokens differently). Work is done in
    float32 blocks of tokens, on the keys' device, and cast back into the original tensor.
    """
    T, D = keys.shape[-2], keys.shape[-1]
    if D % head_dim:
        raise ValueError(f"key width {D} is not a multiple of head_dim {head_dim}")
    heads = D // head_dim
    per_head = delta.dim() > 1
    if per_head and delta.shape != (*keys.shape[:-1], heads):
        raise ValueError(f"a per-head delta must have shape {(*keys.shape[:-1], heads)} "
                         f"(keys' leading dims, T, heads), got {tuple(delta.shape)}")
    if not per_head and delta.shape != (T,):
        raise ValueError(f"delta must have shape ({T},), got {tuple(delta.shape)}")
    dim = rotary_dim(rope, head_dim)
    freqs = inv_freq(rope, head_dim).double().to(keys.device, non_blocking=True)
    k = keys.view(*keys.shape[:-1], heads, head_dim)
    if rope.is_neox:  # rotate-half: pairs (i, i + dim/2)
        x1, x2 = k[..., : dim // 2], k[..., dim // 2: dim]
    else:  # GPT-J: interleaved pairs (2i, 2i+1)
        x1, x2 = k[..., 0:dim:2], k[..., 1:dim:2]
    lead = max(1, keys[..., 0, 0].numel())
    block = max(1, _BLOCK_BYTES // (lead * heads * dim * 4 * 2))
    delta = delta.to(device=keys.device, dtype=torch.float64, non_blocking=True)
    for s in range(0, T, block):
        if per_head:
            angle = delta[..., s: s + block, :, None] * freqs   # [..., t, H, dim/2]
            cos, sin = angle.cos().float(), angle.sin().float()
        else:
            angle = delta[s: s + block, None] * freqs  # [t, dim/2]
            cos = angle.cos().float()[:, None, :]     # broadcast over heads (and leading dims)
            sin = angle.sin().float()[:, None, :]
        a, b = x1[..., s: s + block, :, :], x2[..., s: s + block, :, :]
        # copy=True: for float32 keys .float() would alias `a`, which is overwritten first.
        af, bf = a.to(torch.float32, copy=True), b.to(torch.float32, copy=True)
        new_a = (af * cos).addcmul_(bf, sin, value=-1)  # a·cos − b·sin
        a.copy_(new_a)
        b.copy_(bf.mul_(cos).addcmul_(af, sin))         # b·cos + a·sin
    return keys


def rerotate(kv: torch.Tensor, old_positions, new_positions, layout: ModelLayout | None = None,
             *, rope: RopeParams | None = None, head_dim: int | None = None) -> torch.Tensor:
    """Re-rotate the keys of `kv` [2, L, T, D] (K then V) in place from old to new positions.

    RoPE parameters come from `layout.rope` (what the connector registered) or `rope` +
    `head_dim`. Tokens whose position does not change are left untouched.
    """
    if rope is None:
        if layout is None or layout.rope is None:
            raise ValueError(
                "re-rotation needs RoPE parameters: pass a layout whose .rope is set (the "
                "connector registers it) or rope=RopeParams(...), or skip with rerotate=False")
        rope = layout.rope
    if head_dim is None:
        if layout is None:
            raise ValueError("re-rotation needs head_dim (or a layout) to split D into heads")
        head_dim = layout.head_dim
    if kv.dim() != 4 or kv.shape[0] != 2:
        raise ValueError(f"kv must be [2, L, T, D], got {tuple(kv.shape)}")
    old = torch.as_tensor(old_positions, dtype=torch.int64)
    new = torch.as_tensor(new_positions, dtype=torch.int64)
    if old.shape != (kv.shape[2],) or new.shape != old.shape:
        raise ValueError(f"positions must both have shape ({kv.shape[2]},), got "
                         f"{tuple(old.shape)} and {tuple(new.shape)}")
    delta = new - old
    moved = delta.nonzero()
    if moved.numel() == 0:
        return kv
    lo, hi = int(moved[0]), int(moved[-1]) + 1  # identity rotations outside [lo, hi) are skipped
    rotate_keys(kv[0, :, lo:hi], delta[lo:hi], rope, head_dim)
    return kv


def mean_rotation(rope: RopeParams, head_dim: int, start: int, count: int) -> torch.Tensor:
    """float32 [head_dim, head_dim]: the mean of the rotations of positions start ..
    start+count-1, acting on a column vector (`R @ x` rotates x as RoPE rotates a query or
    key at such a position, on average). Dims past rotary_dim stay as they are. Expected
    Attention (kvedit.edits.expected_attention) averages a query's rotation over the
    positions still to come this way, as kvpress does."""
    dim = rotary_dim(rope, head_dim)
    freqs = inv_freq(rope, head_dim).double()
    angle = torch.arange(start, start + count, dtype=torch.float64)[:, None] * freqs
    cos, sin = angle.cos().mean(0), angle.sin().mean(0)        # [dim/2]
    R = torch.eye(head_dim, dtype=torch.float64)
    half = torch.arange(dim // 2)
    a, b = (half, half + dim // 2) if rope.is_neox else (2 * half, 2 * half + 1)
    R[a, a], R[b, b] = cos, cos
    R[a, b], R[b, a] = -sin, sin   # a' = a cos - b sin, b' = b cos + a sin (rotate_keys)
    return R.float()
