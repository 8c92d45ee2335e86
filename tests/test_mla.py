"""Multi-head latent attention (model.mla, layers.LatentAttention) against the paper's formula written out in float64
numpy, and cuDNN's own value head dim against the zero-padded XLA attention on the GPU. Its Hugging Face layout
(DeepSeek-V2's checkpoints) is checked against transformers' logits in test_hf.py; decoding in test_sample.py, the
mesh in test_train_mesh.py, fp8 operands in test_model.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mx_jax import layers
from mx_jax.config import load_config
from mx_jax.layers import LatentAttention, Positions, attend_padded, rope_inv_freq


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, inv_freq):
    """x (B,T,N,R): dims i and R/2 + i rotated by position x inv_freq[i]."""
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _reference(p: dict, x: np.ndarray, cfg, inv_freq: np.ndarray) -> np.ndarray:
    """The class docstring's formula, float64, causal."""
    a, h = cfg.mla, cfg.n_heads
    b, t, _ = x.shape
    eps = LatentAttention.LATENT_NORM_EPS
    if a.q_rank:
        q = _rms(x @ p["wq_a"], p["q_a_norm"]["scale"], eps) @ p["wq_b"]
    else:
        q = x @ p["wq"]
    q = q.reshape(b, t, h, a.nope_dim + a.rope_dim)
    kv = x @ p["wkv_a"]
    c, k_rope = kv[..., :a.kv_rank], kv[..., a.kv_rank:]
    kvb = (_rms(c, p["kv_norm"]["scale"], eps) @ p["wkv_b"]).reshape(b, t, h, a.nope_dim + a.v_dim)
    k_nope, v = kvb[..., :a.nope_dim], kvb[..., a.nope_dim:]
    pos = np.arange(t, dtype=np.float64)
    rs = cfg.rope_scaling
    factor = layers.rope_attention_factor(rs)
    m = 0.1 * rs.mscale_all_dim * np.log(rs.factor) + 1 if rs.kind == "yarn" and rs.factor > 1 else 1.0
    q = np.concatenate([q[..., :a.nope_dim], factor ** 2 * _rope(q[..., a.nope_dim:], pos, inv_freq)], axis=-1)
    k_rope = np.broadcast_to(_rope(k_rope[:, :, None, :], pos, inv_freq), (b, t, h, a.rope_dim))
    k = np.concatenate([k_nope, k_rope], axis=-1)
    s = np.einsum("bthk,bshk->bhts", q, k) * m * m / np.sqrt(a.nope_dim + a.rope_dim)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshv->bthv", w, v).reshape(b, t, h * a.v_dim)
    return o @ p["wo"]


@pytest.mark.parametrize("over", [
    ["model.mla.v_dim=8"],  # values narrower than q and k (DeepSeek's 128 < 192): v padded
    ["model.mla.v_dim=40", "model.mla.q_rank=20"],  # wider, and a query latent: q and k padded, q rescaled
    ["model.mla.v_dim=24", "model.rope_scaling.kind=yarn", "model.rope_scaling.factor=8",
     "model.rope_scaling.original_max_len=4", "model.rope_scaling.mscale_all_dim=0.7",
     "model.rope_scaling.attention_factor=1.4"],  # equal dims; YaRN's two factors
], ids=["v_narrower", "v_wider_q_latent", "yarn"])
def test_latent_attention_is_the_formula(over):
    cfg = load_config(None, ["model.d_model=48", "model.n_heads=3", "model.n_kv_heads=3", "model.mla.kv_rank=16",
                             "model.mla.nope_dim=16", "model.mla.rope_dim=8", "model.compute_dtype=float32",
                             *over]).model
    attn = LatentAttention(cfg, {n: "bf16" for n in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")}, "xla",
                           rngs=nnx.Rngs(3))
    params = nnx.to_pure_dict(nnx.state(attn, nnx.Param))
    rng = np.random.default_rng(0)  # norm scales 1 + 0.5 N(0, 1), not ones; matrices 0.3 N(0, 1)
    params = jax.tree.map(lambda w: rng.standard_normal(w.shape) * (0.3 if w.ndim == 2 else 0.5) + (w.ndim == 1),
                          params)
    nnx.update(attn, jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), params))
    x = rng.standard_normal((2, 11, 48))
    inv_freq = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    with jax.default_matmul_precision("highest"):
        got = attn(jnp.asarray(x, jnp.float32), Positions(jnp.arange(11)), inv_freq)
    want = _reference(params, x, cfg, np.asarray(inv_freq, np.float64))
    assert float(np.max(np.abs(want))) > 1.0  # scores far from uniform: a wrong scale or rotation shows
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * float(np.max(np.abs(want))))


def test_attend_padded_keeps_the_softmax_scale():
    """Zero-padding q, k and v to a common head dim (and rescaling q where it grows) gives the unpadded attention."""
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32) for _ in range(2))

    def plain(q, k, v):  # softmax(q k^T / sqrt(8)) v, any value dim
        s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(8) + jnp.where(jnp.tril(jnp.ones((6, 6), bool)), 0, -1e30)
        return jnp.einsum("bhts,bshv->bthv", jax.nn.softmax(s, -1), v)

    attend = jax.tree_util.Partial(jax.nn.dot_product_attention, is_causal=True)
    for width in (3, 8, 20):
        v = jnp.asarray(rng.standard_normal((1, 6, 2, width)), jnp.float32)
        got = attend_padded(attend, q, k, v)
        assert got.shape == (1, 6, 2, width)
        np.testing.assert_allclose(np.asarray(got), np.asarray(plain(q, k, v)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dims", [(24, 16), (20, 32), (24, 12)], ids=["both_multiples", "k_20", "v_12"])
def test_cudnn_gets_head_dims_it_takes(monkeypatch, dims):
    """`attention_impl` picks cuDNN by the larger head dim (model.attention_dim); `attend_heads` hands its causal
    kernels q, k and v at their own dims only where both are multiples of 8 (cuDNN refuses any other), else all three
    zero-padded to the larger: the kernel (faked here by softmax(q k^T / sqrt(its K)) v) sees dims it takes, and the
    output is XLA's."""
    from mx_jax import context_parallel
    from mx_jax.layers import attend_heads

    seen = []

    def cudnn(q, k, v):
        seen.append((q.shape[-1], v.shape[-1]))
        s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
        return jnp.einsum("bhts,bshv->bthv", jax.nn.softmax(s, -1), v)

    monkeypatch.setattr(context_parallel, "cudnn_causal_attention", cudnn)
    rng = np.random.default_rng(2)
    q, k = (jnp.asarray(rng.standard_normal((1, 6, 2, dims[0])), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 6, 2, dims[1])), jnp.float32)
    got = attend_heads(q, k, v, None, "cudnn", 1)
    assert seen and all(d % 8 == 0 for d in seen[0]), seen
    np.testing.assert_allclose(np.asarray(got), np.asarray(attend_heads(q, k, v, None, "xla", 1)), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_gpu_cudnn_attention_of_a_narrower_value_head(documents):
    """On the GPU `attend_heads` hands cuDNN's causal kernels values of their own head dim (192-dim q and k, 128-dim
    v, as DeepSeek-V2), and pads them for its packed (documents) layout: output and gradients against XLA's
    attention of the zero-padded values, bf16."""
    from mx_jax.layers import attend_heads, document_segments

    rng = np.random.default_rng(5)
    b, t, h = 2, 1024, 4
    q, k = (jnp.asarray(rng.standard_normal((b, t, h, 192)), jnp.bfloat16) for _ in range(2))
    v, w = (jnp.asarray(rng.standard_normal((b, t, h, 128)), jnp.bfloat16) for _ in range(2))
    tokens = np.full((b, t), 7)
    tokens[0, [99, 517]] = 0
    segments = document_segments(jnp.asarray(tokens), 0, 8) if documents else None

    def loss(impl):
        def f(q, k, v):
            o = attend_heads(q, k, v, segments, impl, 8)
            assert o.shape == (b, t, h, 128)
            return jnp.sum(o.astype(jnp.float32) * w)
        return f

    ours = jax.jit(jax.value_and_grad(loss("cudnn"), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        assert float(jnp.max(jnp.abs(got - want))) <= 2e-2 * float(jnp.max(jnp.abs(want)))
