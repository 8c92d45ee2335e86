"""MXFP8 linear recipe (mx_jax/mx_linear.py): values and grads against the high-precision product, each GEMM operand
blocked along its own contraction axis (checked by intercepting the GEMMs), shapes, dtypes and the support check."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mx_jax import mx_format as mxf
from mx_jax import mx_linear as mxl
from pallas_kernels import device

mxmm = importlib.import_module("pallas_kernels.mx_matmul")
# e4m3 keeps 3 mantissa bits: each element is within 2^-4 relative of its input, ~2^-5.5 RMS. A product of two such
# operands lands ~2-3% from the exact one normwise; a misplaced scale or layout is off by O(1).
MXFP8_RTOL = 2.0**-4
BF16_RTOL = 2.0**-7  # the bf16 output rounding on top, for the bf16-vs-bf16 comparison


def rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@functools.partial(jax.jit, static_argnames=("t", "k", "n", "w_dtype"))
def inputs(key, t, k, n, w_dtype=jnp.float32):
    """x (t, k) bf16 with per-row magnitudes over 2^±6, w (k, n), g (t, n) bf16: fresh normal data, never zeros."""
    kx, kw, kg, kr = jax.random.split(key, 4)
    rows = jnp.exp2(jax.random.randint(kr, (t, 1), -6, 7).astype(jnp.float32))
    x = (jax.random.normal(kx, (t, k)) * rows).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n)) / np.sqrt(k)).astype(w_dtype)
    g = jax.random.normal(kg, (t, n)).astype(jnp.bfloat16)
    return x, w, g


@functools.lru_cache(maxsize=None)
def value_and_grads(impl: str = "auto"):
    """jit of (x, w, g) -> (y, grad_x, grad_w) of mx_linear (x may have leading dims)."""

    def f(x, w, g):
        y, pull = jax.vjp(functools.partial(mxl.mx_linear, impl=impl), x, w)
        return (y, *pull(g))

    return jax.jit(f)


def exact_vjp(x, w, g):
    """y, grad_x, grad_w of y = x @ w in float64 NumPy (the high-precision reference)."""
    x64, w64, g64 = (np.asarray(v, np.float64) for v in (x, w, g))
    return x64 @ w64, g64 @ w64.T, x64.T @ g64


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_grads_within_mxfp8_tolerance(w_dtype):
    x, w, g = inputs(jax.random.key(0), 128, 256, 96, w_dtype)
    y, gx, gw = value_and_grads()(x, w, g)
    assert y.dtype == jnp.bfloat16 and gx.dtype == jnp.bfloat16 and gw.dtype == w_dtype
    assert y.shape == (128, 96) and gx.shape == x.shape and gw.shape == w.shape
    y64, gx64, gw64 = exact_vjp(x, w, g)
    errs = [rel(y, y64), rel(gx, gx64), rel(gw, gw64)]
    print("rel. errors y, grad_x, grad_w:", errs)
    assert max(errs) < MXFP8_RTOL, errs
    # ... and not accidentally the unquantized product: MX rounding is visible at this size
    assert min(errs) > 2.0**-9, errs


def test_each_gemm_operand_is_blocked_along_its_contraction_axis(monkeypatch):
    """Intercept the three MX GEMMs; each operand must be bit-identical to mx_quantize(rceil, e4m3) of the
    high-precision operand laid out K-major, i.e. blocked along that GEMM's contraction axis."""
    t, k, n = 64, 160, 96  # shapes no other test uses: no cached trace can bypass the interception
    x, w, g = inputs(jax.random.key(1), t, k, n)

    calls, out_dtypes = [], []
    real = mxmm.mx_matmul

    def spy(a, b_t, a_scales, b_scales, **kw):
        calls.append((a, b_t, a_scales, b_scales))
        out_dtypes.append(kw["out_dtype"])
        return real(a, b_t, a_scales, b_scales, **kw)

    def operands_seen(x, w, g):  # traced once, with the spy in place; returns what the three GEMMs received
        y, pull = jax.vjp(functools.partial(mxl.mx_linear, impl="xla"), x, w)
        pull(g)
        return list(calls)

    monkeypatch.setattr(mxmm, "mx_matmul", spy)
    seen = jax.jit(operands_seen)(x, w, g)
    assert len(seen) == 3
    q = jax.jit(lambda v: mxf.mx_quantize(v, mode="rceil", elem_dtype=jnp.float8_e4m3fn))
    expected = {
        "out (contracts K)": (q(x), q(w.T), jnp.bfloat16),  # x (T, K), wᵀ (N, K)
        "grad_x (contracts N)": (q(g), q(w), jnp.bfloat16),  # g (T, N), w (K, N)
        "grad_w (contracts T)": (q(x.T), q(g.T), jnp.float32),  # xᵀ (K, T), gᵀ (N, T)
    }
    u8 = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8))
    for (name, want), (a, b_t, a_s, b_s), got_dtype in zip(expected.items(), seen, out_dtypes):
        (ea, sa), (eb, sb), out_dtype = want
        assert a.dtype == b_t.dtype == jnp.float8_e4m3fn, name
        np.testing.assert_array_equal(u8(a), u8(ea), err_msg=name)
        np.testing.assert_array_equal(u8(b_t), u8(eb), err_msg=name)
        np.testing.assert_array_equal(a_s, sa, err_msg=name)
        np.testing.assert_array_equal(b_s, sb, err_msg=name)
        assert jnp.dtype(got_dtype) == jnp.dtype(out_dtype), name
    # The test can tell the modes apart: floor differs from rceil on some block of x.
    assert not np.array_equal(jax.jit(mxf.mx_quantize)(x)[1], q(x)[1])


def test_leading_dims_and_ragged_token_count():
    """x (B, S, K) with B*S = 90 tokens (not a multiple of 32): padded for the grad_w blocks, sliced back."""
    x, w, g = inputs(jax.random.key(2), 90, 128, 64)
    x3, g3 = x.reshape(3, 30, 128), g.reshape(3, 30, 64)
    y, gx, gw = value_and_grads()(x3, w, g3)
    assert y.shape == (3, 30, 64) and gx.shape == (3, 30, 128) and gw.shape == (128, 64)
    # Zero-padding the tokens by hand gives the same numbers: padding is exact.
    xp = jnp.pad(x, ((0, 6), (0, 0)))
    gp = jnp.pad(g, ((0, 6), (0, 0)))
    yp, gxp, gwp = value_and_grads()(xp, w, gp)
    np.testing.assert_array_equal(np.asarray(y).reshape(90, 64), np.asarray(yp)[:90])
    np.testing.assert_array_equal(np.asarray(gx).reshape(90, 128), np.asarray(gxp)[:90])
    np.testing.assert_array_equal(gw, gwp)
    y64, gx64, gw64 = exact_vjp(x, w, g)
    assert max(rel(y.reshape(90, 64), y64), rel(gx.reshape(90, 128), gx64), rel(gw, gw64)) < MXFP8_RTOL


def test_xla_and_reference_impls_agree():
    x, w, g = inputs(jax.random.key(3), 64, 64, 64)
    outs = {impl: value_and_grads(impl)(x, w, g) for impl in ("xla", "reference")}
    for got, want in zip(outs["xla"], outs["reference"]):
        # same MX operands (the XLA and NumPy casts are bit-identical); bf16 vs f32 GEMM accumulation + output
        assert rel(got, want) < BF16_RTOL


def test_support_and_bad_arguments():
    assert mxl.mx_kernel_support(4096, 14336) is None
    assert mxl.mx_kernel_support(8192, 1024) is None
    assert "multiples of 32" in mxl.mx_kernel_support(4096, 4100)
    assert "K=48" in mxl.mx_kernel_support(48, 64)
    x, w, _ = inputs(jax.random.key(4), 32, 64, 64)
    with pytest.raises(ValueError, match="multiples of 32"):
        mxl.mx_linear(x[:, :48], w[:48])
    with pytest.raises(ValueError, match=r"x \(\.\.\., K\)"):
        mxl.mx_linear(x, w.T[:32])
    with pytest.raises(ValueError, match="impl"):
        mxl.mx_linear(x, w, impl="blackwell")
    with pytest.raises(ValueError, match="`x`.*int32"):
        mxl.mx_linear(x.astype(jnp.int32), w)


# --------------------------------------------------------------------------------------------------------------
# GPU: MX_JAX_TEST_GPU=1 python -m pytest -m gpu tests/test_mx_linear.py
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("t,k,n", [(8192, 4096, 14336), (8192, 14336, 4096)])
def test_gpu_auto_matches_xla_path(t, k, n):
    x, w, g = inputs(jax.random.key(5), t, k, n)
    res = {impl: value_and_grads(impl)(x, w, g) for impl in ("auto", "xla")}
    for got, want in zip(res["auto"], res["xla"]):
        assert rel(got, want) < BF16_RTOL  # same MX operands; kernel vs cuBLAS accumulation order, bf16 outputs
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    assert rel(res["auto"][0], ref) < MXFP8_RTOL
    if device.on_hopper():  # "auto" ran the Mosaic-GPU kernels, not the XLA path it is compared with
        assert "mosaic_gpu" in value_and_grads("auto").lower(x, w, g).as_text()
        assert "mosaic_gpu" not in value_and_grads("xla").lower(x, w, g).as_text()
