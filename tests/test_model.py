"""The model's pieces against independent NumPy formulations, and the pinned sharding of every parameter."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mx_jax import sharding
from mx_jax.config import MeshConfig, ModelConfig, RopeScaling
from mx_jax.layers import apply_rope, causal_attention, rope_inv_freq
from mx_jax.llama import Llama, param_axes


def test_rope_llama31_scaling_matches_formula():
    k, theta = 128, 500000.0
    sc = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192)
    got = np.asarray(rope_inv_freq(k, theta, sc), np.float64)
    inv = 1.0 / theta ** (np.arange(0, k, 2) / k)
    expected = []
    for f in inv:  # Meta's reference loop (llama3 `apply_scaling`)
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            expected.append(f)
        elif wavelen > 8192 / 1.0:
            expected.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * f / 8.0 + smooth * f)
    np.testing.assert_allclose(got, expected, rtol=2e-6)
    assert not np.allclose(got, inv)  # scaling changed the low frequencies


def test_rope_rotates_pairs_and_keeps_norm():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    pos = np.arange(5)
    inv = np.asarray(rope_inv_freq(8, 10000.0, RopeScaling()))
    y = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(inv)))
    ang = pos[:, None] * inv[None, :]
    x1, x2 = x[..., :4], x[..., 4:]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    np.testing.assert_allclose(y, np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def _naive_gqa(q, k, v):
    b, t, h, d = q.shape
    g = k.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for head in range(h):
        kv = head // (h // g)
        s = q[:, :, head] @ k[:, :, kv].transpose(0, 2, 1) / math.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, head] = (p / p.sum(-1, keepdims=True)) @ v[:, :, kv]
    return out


def test_gqa_causal_attention_matches_naive():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 16, 4, 8))
    k, v = rng.standard_normal((2, 2, 16, 2, 8))
    got = causal_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), impl="xla")
    np.testing.assert_allclose(np.asarray(got), _naive_gqa(q, k, v), rtol=1e-4, atol=1e-5)


def test_context_parallel_attention_is_exact():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 32, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(a, jnp.float32) for a in rng.standard_normal((2, 2, 32, 2, 8)))
    reference = causal_attention(q, k, v, impl="xla")
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, context=4))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda q, k, v: causal_attention(q, k, v, impl="xla"))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), rtol=1e-5, atol=1e-6)


def test_every_parameter_has_its_pinned_partition_spec():
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    specs = jax.tree.map(sharding.spec, param_axes(model), is_leaf=lambda x: isinstance(x, tuple))
    fc = ("fsdp", "context")
    assert specs == {
        "embed": P(None, fc),
        "head": P(fc, None),
        "final_norm": {"scale": P(None)},
        "blocks": {
            "attn_norm": {"scale": P(None, None)},
            "mlp_norm": {"scale": P(None, None)},
            "attn": {"wq": P(None, fc, None), "wk": P(None, fc, None), "wv": P(None, fc, None),
                     "wo": P(None, None, fc)},
            "mlp": {"w_gate": P(None, fc, None), "w_up": P(None, fc, None), "w_down": P(None, None, fc)},
        },
    }


def test_mesh_errors_name_the_problem():
    from mx_jax.config import ConfigError
    with pytest.raises(ConfigError, match="mesh"):
        sharding.make_mesh(MeshConfig(data=3, fsdp=1))
    with pytest.raises(ConfigError, match="mesh.fsdp"):
        sharding.make_mesh(MeshConfig(data=3, fsdp=-1))
