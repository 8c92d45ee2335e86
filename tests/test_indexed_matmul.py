"""Decoding's per-row expert products (pallas_kernels/indexed_matmul.py): the kernel against the XLA expression.

CPU: the Mosaic-GPU kernel in GPU interpret mode at small shapes with 2-stage rings: row counts that fill one A tile
partly (1, 5 rows) or span several (13 rows: tiles anchored at rows 0 and 8), repeated and out-of-range expert ids.
GPU (`gpu` marker): the default Config at DeepSeekMoE 16B's expert shapes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mx_jax import compat
from pallas_kernels import indexed_matmul as im

INTERPRET = compat.InterpretGPUParams()
SMALL = im.Config(tile_n=64, tile_k=64, stages=2)
E, K, N = 5, 128, 192  # 2 K steps, 3 column blocks


def _inputs(seed, r, k=K, n=N, e=E, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (r, k), jnp.float32).astype(dtype)
    w = [(jax.random.normal(kk, (e, k, n), jnp.float32) / np.sqrt(k)).astype(dtype) for kk in ks[1:3]]
    idx = jax.random.randint(ks[3], (r,), 0, e, jnp.int32)
    return x, w[0], w[1], idx


def _f32(a):
    return np.asarray(a, np.float32)


def _by_hand(x, w, idx):
    """Row by row in float64 from the rounded inputs."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return np.stack([x[r] @ w[min(int(i), w.shape[0] - 1)] for r, i in enumerate(np.asarray(idx))])


@pytest.mark.parametrize("rows", [1, 5, 13])
def test_indexed_matmul_interpret(rows):
    x, w, _, idx = _inputs(rows, rows)
    idx = idx.at[-1].set(idx[0])  # an expert chosen twice
    out = im.indexed_matmul(x, w, idx, impl="pallas", config=SMALL, interpret=INTERPRET)
    ref = im.indexed_matmul(x, w, idx, impl="xla")
    assert out.shape == (rows, N) and out.dtype == x.dtype
    np.testing.assert_array_equal(_f32(out), _f32(ref))  # float32 sums of the same products, rounded once
    np.testing.assert_allclose(_f32(out), _by_hand(x, w, idx), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 13])
def test_indexed_swiglu_interpret(rows):
    x, wg, wu, idx = _inputs(100 + rows, rows)
    out = im.indexed_swiglu(x, wg, wu, idx, impl="pallas", config=SMALL, interpret=INTERPRET)
    ref = im.indexed_swiglu(x, wg, wu, idx, impl="xla")
    g, u = (_by_hand(x, w, idx) for w in (wg, wu))
    np.testing.assert_allclose(_f32(out), _f32(ref), rtol=2e-2, atol=2e-2)  # exp's rounding may move one bf16 step
    np.testing.assert_allclose(_f32(out), g / (1 + np.exp(-g)) * u, rtol=3e-2, atol=3e-2)
    assert np.abs(_f32(out)).max() > 0.1  # not a zero output


def test_out_of_range_ids_as_jnp_indexing():
    x, w, _, _ = _inputs(7, 3)
    idx = jnp.asarray([-3, 2, E + 4], jnp.int32)
    out = im.indexed_matmul(x, w, idx, impl="pallas", config=SMALL, interpret=INTERPRET)
    np.testing.assert_array_equal(_f32(out), _f32(im.indexed_matmul(x, w, idx, impl="xla")))
    np.testing.assert_allclose(_f32(out), _by_hand(x, w, [E - 3, 2, E + 4]), rtol=1e-2, atol=1e-2)


def test_cover_and_errors():
    x, w, wu, idx = _inputs(8, 4)
    with pytest.raises(NotImplementedError, match="16-bit"):
        im.indexed_matmul(x.astype(jnp.float32), w.astype(jnp.float32), idx, impl="pallas")
    with pytest.raises(NotImplementedError, match="tile_n"):
        im.indexed_matmul(x, w[..., :100], idx, impl="pallas")
    # impl="auto" falls back to XLA off Hopper and outside the cover
    np.testing.assert_array_equal(_f32(im.indexed_matmul(x, w[..., :100], idx)),
                                  _f32(im.indexed_matmul(x, w[..., :100], idx, impl="xla")))
    with pytest.raises(ValueError, match="contract"):
        im.indexed_matmul(x[:, :64], w, idx)
    with pytest.raises(ValueError, match="idx"):
        im.indexed_matmul(x, w, idx[:2])
    with pytest.raises(ValueError, match="differ in shape"):
        im.indexed_swiglu(x, w, wu[:2], idx)
    with pytest.raises(ValueError, match="impl"):
        im.indexed_matmul(x, w, idx, impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 6, 48])
def test_gpu_deepseek_shapes(rows):
    """The default configs at DeepSeekMoE 16B's experts: gate and up (2048 x 1408), down (1408 x 2048)."""
    x, wg, wu, idx = _inputs(200 + rows, rows, k=2048, n=1408, e=64)
    h = jax.nn.silu(x[:, :1408].astype(jnp.float32)).astype(jnp.bfloat16)
    wd = wg.reshape(64, 1408, 2048)
    cases = ((im.indexed_swiglu, (x, wg, wu, idx)), (im.indexed_matmul, (x, wg, idx)), (im.indexed_matmul, (h, wd, idx)))
    for f, args in cases:  # operands as arguments: jit would embed closed-over arrays as constants
        out, ref = (jax.jit(functools.partial(f, impl=i))(*args) for i in ("pallas", "xla"))
        scale = np.abs(_f32(ref)).max()
        assert scale > 0.1
        assert np.abs(_f32(out) - _f32(ref)).max() <= 2e-2 * scale
