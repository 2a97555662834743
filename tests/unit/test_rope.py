"""RoPE re-rotation against transformers' own rotary embeddings (and vLLM's dynamic NTK).

Each test makes keys at positions p with the reference implementation, re-rotates them to
p' with `kvedit.edits.rerotate`, and compares with the reference keys made at p'.
Tolerances: float32 keys agree to 2e-4 · max|K| (the reference itself forms angles of up to
~4000 rad in float32, ~2.4e-4 rad of rounding); bf16 keys to 8e-3 · max|K| (two bf16
roundings of at most 2^-8 · max|K| each: the cached keys and the re-rotated ones).
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gpt_neox.modeling_gpt_neox import (  # noqa: E402
    apply_rotary_pos_emb as neox_apply)
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply  # noqa: E402
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import (  # noqa: E402
    Qwen3RotaryEmbedding, apply_rotary_pos_emb)

from kvedit.edits import inv_freq, rerotate  # noqa: E402
from kvedit.layout import ModelLayout, RopeParams  # noqa: E402
from kvedit.harness.tiny_model import CONFIG  # noqa: E402

L, H, HD = CONFIG["num_hidden_layers"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
TOL = {torch.float32: 2e-4, torch.bfloat16: 8e-3}


def positions(n_old=4000, keep=700, seed=0):
    """Kept original positions (sorted, as a dropping policy leaves them) and new ones."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randperm(n_old, generator=g)[:keep].sort().values
    return old, torch.arange(keep)


def raw_keys(T, seed=1):
    """Un-rotated keys [L, H, T, HD] (layers in the batch dim of the references)."""
    return torch.randn(L, H, T, HD, generator=torch.Generator().manual_seed(seed))


def as_kv(k):
    """[L, H, T, HD] keys -> the SDK's [2, L, T, H*HD] tensor (V random)."""
    k = k.transpose(1, 2).reshape(L, k.shape[2], H * HD)
    return torch.stack([k, torch.randn_like(k)]).contiguous()


def qwen3(rope_parameters, **extra):
    return Qwen3Config(**{**CONFIG, "rope_parameters": rope_parameters, **extra})


def rope_params(config) -> RopeParams:
    """What the connector registers, from a transformers config."""
    rp = dict(config.rope_parameters)
    kind, theta = rp.pop("rope_type"), rp.pop("rope_theta")
    rp.pop("partial_rotary_factor", None)
    return RopeParams(theta=theta, rotary_dim=HD, is_neox=True, rope_type=kind, scaling=rp,
                      max_position_embeddings=config.max_position_embeddings)


def qwen3_keys(config, k, pos):
    """K at `pos` through Qwen3's rotary module and apply_rotary_pos_emb."""
    cos, sin = Qwen3RotaryEmbedding(config)(k, pos[None].expand(L, -1))
    _, out = apply_rotary_pos_emb(k, k, cos, sin)
    return out


def check(kv_old, kv_ref, old, new, rope, dtype):
    layout = ModelLayout(num_layers=L, num_kv_heads=H, head_dim=HD, dtype=str(dtype)[6:],
                         chunk_size=256, rope=rope)
    kv = kv_old.to(dtype, copy=True)
    values = kv[1].clone()
    assert rerotate(kv, old, new, layout) is kv  # in place
    scale = kv_ref[0].abs().max()
    err = (kv[0].float() - kv_ref[0]).abs().max() / scale
    assert err < TOL[dtype], f"{dtype}: max error {err:.2e} of max|K|"
    assert torch.equal(kv[1], values), "values must not change"
    # A wrong rotation is far off: positions not moved would be off by O(1).
    assert (kv_old[0] - kv_ref[0]).abs().max() / scale > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_qwen3_default(dtype):
    config = qwen3(CONFIG["rope_parameters"])
    old, new = positions()
    k = raw_keys(len(old))
    check(as_kv(qwen3_keys(config, k, old)), as_kv(qwen3_keys(config, k, new)), old, new,
          rope_params(config), dtype)


SCALINGS = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0},
    # Below max_position_embeddings transformers' dynamic NTK is position-independent.
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_scaled_inv_freq_matches_transformers(kind):
    config = qwen3(dict(SCALINGS[kind]), max_position_embeddings=4096)
    if kind == "dynamic":
        ref = Qwen3RotaryEmbedding(config).inv_freq
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[kind](config)
    torch.testing.assert_close(inv_freq(rope_params(config), HD), ref.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_rerotation(kind, dtype):
    # yarn's attention factor scales cos and sin: it must survive the re-rotation unchanged.
    config = qwen3(dict(SCALINGS[kind]), max_position_embeddings=4096)
    old, new = positions(n_old=4000)
    k = raw_keys(len(old))
    check(as_kv(qwen3_keys(config, k, old)), as_kv(qwen3_keys(config, k, new)), old, new,
          rope_params(config), dtype)


def gptj_keys(k, pos, rotary):
    """GPT-J: interleaved pairs on the first `rotary` dims, theta 10000."""
    table = create_sinusoidal_positions(4096, rotary)[pos]  # [T, rotary] = sin | cos
    sin, cos = table[None, :, : rotary // 2], table[None, :, rotary // 2:]
    kt = k.transpose(1, 2)  # GPT-J's layout is [B, T, H, d]
    rot = gptj_apply(kt[..., :rotary], sin.expand(L, -1, -1), cos.expand(L, -1, -1))
    return torch.cat([rot, kt[..., rotary:]], dim=-1).transpose(1, 2)


@pytest.mark.parametrize("rotary", [HD, HD // 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptj_interleaved(rotary, dtype):
    old, new = positions(n_old=4000, keep=300)
    k = raw_keys(len(old))
    rope = RopeParams(theta=10000.0, rotary_dim=rotary, is_neox=False)
    check(as_kv(gptj_keys(k, old, rotary)), as_kv(gptj_keys(k, new, rotary)), old, new, rope, dtype)


def neox_keys(k, pos, rotary, theta=10000.0):
    """GPT-NeoX's apply_rotary_pos_emb rotates only cos.shape[-1] dims (partial rotary)."""
    f = 1.0 / (theta ** (torch.arange(0, rotary, 2, dtype=torch.int64).float() / rotary))
    emb = torch.cat([pos[:, None].float() * f] * 2, dim=-1)[None].expand(L, -1, -1)
    _, out = neox_apply(k, k, emb.cos(), emb.sin())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_neox(dtype):
    rotary = HD // 4
    old, new = positions(n_old=4000, keep=300)
    k = raw_keys(len(old))
    kv_old, kv_ref = as_kv(neox_keys(k, old, rotary)), as_kv(neox_keys(k, new, rotary))
    check(kv_old, kv_ref, old, new, RopeParams(theta=10000.0, rotary_dim=rotary), dtype)
    # The pass-through dims are bit-identical.
    kv = kv_old.clone()
    rerotate(kv, old, new, rope=RopeParams(theta=10000.0, rotary_dim=rotary), head_dim=HD)
    heads = kv[0].view(L, -1, H, HD), kv_old[0].view(L, -1, H, HD)
    assert torch.equal(heads[0][..., rotary:], heads[1][..., rotary:])


def test_dynamic_ntk_matches_vllm():
    # vLLM fixes the dynamic-NTK base once from its config (max_trained_positions), so the
    # keys in its cache compose; check our frequencies against its cos/sin cache.
    mod = pytest.importorskip(
        "vllm.model_executor.layers.rotary_embedding.dynamic_ntk_scaling_rope")
    from types import SimpleNamespace

    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    fake = SimpleNamespace(base=10000.0, rotary_dim=HD, max_position_embeddings=8192,
                           max_trained_positions=2048, scaling_factor=2.0)
    fake._compute_inv_freq = lambda base: RotaryEmbedding._compute_inv_freq(fake, base)
    cache = mod.DynamicNTKScalingRotaryEmbedding._compute_cos_sin_cache(fake)  # [pos, cos|sin]
    rope = RopeParams(theta=10000.0, rotary_dim=HD, rope_type="dynamic",
                      max_position_embeddings=8192,
                      scaling={"factor": 2.0, "max_trained_positions": 2048})
    f = inv_freq(rope, HD)
    torch.testing.assert_close(cache[1, : HD // 2], torch.cos(f), rtol=0, atol=1e-6)
    torch.testing.assert_close(cache[1, HD // 2:], torch.sin(f), rtol=0, atol=1e-6)


def test_composes_and_round_trips():
    # R(a) then R(b) == R(a + b), and moving back restores the keys.
    kv = torch.randn(2, L, 50, H * HD)
    layout = ModelLayout(num_layers=L, num_kv_heads=H, head_dim=HD, dtype="float32", chunk_size=16,
                         rope=RopeParams(theta=1e6))
    p0 = torch.arange(100, 150)
    a = rerotate(rerotate(kv.clone(), p0, p0 - 30, layout), p0 - 30, p0 - 70, layout)
    b = rerotate(kv.clone(), p0, p0 - 70, layout)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(rerotate(b, p0 - 70, p0, layout), kv, rtol=0, atol=1e-5)


def test_unchanged_positions_are_untouched():
    kv = torch.randn(2, L, 40, H * HD, dtype=torch.bfloat16)
    before = kv.clone()
    old = torch.cat([torch.arange(10), torch.arange(30, 60)])
    layout = ModelLayout(num_layers=L, num_kv_heads=H, head_dim=HD, dtype="bfloat16", chunk_size=16,
                         rope=RopeParams())
    rerotate(kv, old, torch.arange(40), layout)
    assert torch.equal(kv[:, :, :10], before[:, :, :10])
    assert not torch.equal(kv[0, :, 10:], before[0, :, 10:])


def test_errors():
    kv = torch.zeros(2, L, 8, H * HD)
    no_rope = ModelLayout(num_layers=L, num_kv_heads=H, head_dim=HD, dtype="float32", chunk_size=4)
    with pytest.raises(ValueError, match="RoPE parameters"):
        rerotate(kv, torch.arange(8), torch.arange(8), no_rope)
    with pytest.raises(ValueError, match="longrope.*supported"):
        rerotate(kv, torch.arange(8) + 1, torch.arange(8), rope=RopeParams(rope_type="longrope"),
                 head_dim=HD)
    with pytest.raises(ValueError, match="shape"):
        rerotate(kv, torch.arange(7), torch.arange(7), rope=RopeParams(), head_dim=HD)
    with pytest.raises(ValueError, match="rotary_dim"):
        inv_freq(RopeParams(rotary_dim=HD + 2), HD)
    with pytest.raises(ValueError, match="low_freq_factor"):
        inv_freq(RopeParams(rope_type="llama3", scaling={"factor": 8.0}), HD)
