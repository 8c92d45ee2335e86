"""fp8 quantization (pallas_kernels/quantize.py): the reference's TorchAO semantics (scales, saturation, zero rows,
power-of-two scales), the Pallas cast kernels interpreted on CPU bit-exact against it, the cover, lowering for the
H200 from CPU, and `gpu` tests at real shapes against the XLA path."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from mx_jax import compat
from pallas_kernels import interpret_compat

qz = importlib.import_module("pallas_kernels.quantize")
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
FMAX = {E4M3: 448.0, E5M2: 57344.0}
HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3}  # round-to-nearest relative error for normal fp8 values


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    interpret_compat.install()


def sample(key, shape, dtype=jnp.bfloat16):
    """Normal data with column-dependent magnitudes, a zero row, a zero column and a large outlier; a 3-D batch's
    entries also differ in magnitude (16x apart), so an amax taken across entries changes the scales."""
    x = jax.random.normal(key, shape) * jnp.logspace(-3, 3, shape[-1])
    if len(shape) == 3:
        x = x * (16.0 ** jnp.arange(shape[0]))[:, None, None]
    x = x.at[1].set(0.0).at[:, 2].set(0.0).at[4, 5].set(3e4)
    return x.astype(dtype)


def same(a, b) -> bool:
    return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)) if a.dtype.itemsize == 1 else \
        np.array_equal(np.asarray(a), np.asarray(b))


def all_same(a, b) -> bool:
    """Every leaf of a equal to b's, bit for bit, with the same shapes and dtypes."""
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_reference_semantics(dtype, pow2):
    x = sample(jax.random.key(0), (64, 96))
    xf = np.asarray(x, np.float32)
    q, s = qz.quantize_reference(x, axis=1, dtype=dtype, pow2_scale=pow2)
    q32, s = np.asarray(q, np.float32), np.asarray(s)
    assert q.dtype == dtype and s.shape == (64,) and s.dtype == np.float32
    assert np.isfinite(q32).all() and np.isfinite(s).all() and (s > 0).all()
    assert (np.abs(q32) <= FMAX[dtype]).all()  # saturating: never NaN/inf, never past the max
    assert (q32[1] == 0).all()  # the zero row quantizes to zeros with a finite scale
    amax = np.abs(xf).max(axis=1)
    if pow2:
        assert (np.frexp(s)[0] == 0.5).all()  # exact powers of two
        assert (s >= amax / FMAX[dtype]).all()  # rounded up: x / s never overflows
    else:
        # TorchAO: scale = 1 / (F / amax); each row's amax lands on +-F.
        nz = amax > 0
        np.testing.assert_allclose(s[nz], amax[nz] / FMAX[dtype], rtol=2e-7)
        np.testing.assert_array_equal(np.abs(q32[nz]).max(axis=1), FMAX[dtype])
    # Dequantization error: half an fp8 ulp for values in the normal range of their row.
    deq = q32 * s[:, None]
    normal = np.abs(xf / s[:, None]) >= float(jnp.finfo(dtype).smallest_normal)
    rel = np.abs(deq - xf)[normal] / np.abs(xf)[normal]
    assert rel.max() <= HALF_ULP[dtype] * (1 + 1e-6)


def test_outliers_saturate_instead_of_nan():
    # A tensorwise scale from one tensor applied to a larger one: the cast must clip, as to_fp8_saturated does.
    x = jnp.array([[1.0, -2.0, 1e6, -1e6]], jnp.float32)
    q = qz._cast(x, jnp.float32(1.0), E4M3)
    np.testing.assert_array_equal(np.asarray(q, np.float32), [[1.0, -2.0, 448.0, -448.0]])
    q5 = qz._cast(x, jnp.float32(1.0), E5M2)
    np.testing.assert_array_equal(np.asarray(q5, np.float32), [[1.0, -2.0, 57344.0, -57344.0]])


def test_tensorwise_and_axes():
    x = sample(jax.random.key(1), (32, 48), jnp.float32)
    q, s = qz.quantize_reference(x, axis=0, dtype=E4M3, scaling="tensorwise")
    assert s.shape == () and float(s) == pytest.approx(float(jnp.abs(x).max()) / 448.0, rel=1e-6)
    q0, s0 = qz.quantize_reference(x, axis=0, dtype=E4M3)
    assert s0.shape == (48,)
    qt, st = qz.quantize_t_reference(x, dtype=E4M3)
    assert same(qt, q0.T) and same(st, s0)
    (a, sa), (b, sb) = qz.quantize_dual_reference(x, dtype=E4M3, scaling="tensorwise")
    assert same(a, q) and same(b, q.T) and same(sa, sb)


PALLAS_CASES = [
    # (function, shape, x dtype, fp8 dtype, scaling, pow2)
    ("dual", (256, 384), jnp.bfloat16, E4M3, "rowwise", True),
    ("dual", (128, 256), jnp.bfloat16, E5M2, "tensorwise", False),
    ("t", (384, 128), jnp.bfloat16, E4M3, "rowwise", False),
    ("rows", (2, 128, 256), jnp.float32, E5M2, "rowwise", True),
    ("dual", (3, 128, 256), jnp.bfloat16, E4M3, "rowwise", True),  # a batch: the experts' weights (E, K, N)
    ("dual_bf16", (3, 128, 256), jnp.float32, E4M3, "rowwise", True),  # f32 master weights, rounded in SMEM
    ("dual_bf16", (128, 384), jnp.float32, E5M2, "rowwise", False),
]


@pytest.mark.parametrize("fn,shape,x_dtype,dtype,scaling,pow2", PALLAS_CASES)
def test_pallas_interpreted_is_bit_exact(fn, shape, x_dtype, dtype, scaling, pow2):
    x = sample(jax.random.key(sum(shape)), shape, x_dtype)
    kw = dict(dtype=dtype, scaling=scaling, pow2_scale=pow2)
    ip = compat.InterpretGPUParams()
    if fn == "dual":
        got = qz.quantize_dual(x, impl="pallas", interpret=ip, **kw)
        want = qz.quantize_dual_reference(x, **kw)
    elif fn == "dual_bf16":  # the same function as quantizing x's bf16 copy
        got = qz.quantize_dual(x, impl="pallas", interpret=ip, round_to=jnp.bfloat16, **kw)
        want = qz.quantize_dual_reference(x.astype(jnp.bfloat16), **kw)
        assert same(got[1][0], qz.quantize_dual(x, impl="xla", round_to=jnp.bfloat16, **kw)[1][0])
    elif fn == "t":
        got = qz.quantize_t(x, impl="pallas", interpret=ip, **kw)
        want = qz.quantize_t_reference(x, **kw)
    else:
        got = qz.quantize(x, axis=-1, impl="pallas", interpret=ip, **kw)
        want = qz.quantize_reference(x, axis=-1, **kw)
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and same(g, w)


@pytest.mark.parametrize("widths,lead,x_dtype,scaling,round_to", [
    ((128, 256, 128), (128,), jnp.float32, "rowwise", jnp.bfloat16),  # q|k|v from f32 masters
    ((128, 256), (3, 64), jnp.bfloat16, "rowwise", None),  # the experts' gate|up, a batch of 3
    ((256, 128), (128,), jnp.bfloat16, "tensorwise", None),
])
def test_pallas_dual_of_parts_is_the_dual_of_their_concatenation(widths, lead, x_dtype, scaling, round_to):
    keys = jax.random.split(jax.random.key(sum(widths) + len(lead)), len(widths))
    parts = tuple(sample(k, (*lead, w), x_dtype) * (i + 1) for i, (k, w) in enumerate(zip(keys, widths)))
    kw = dict(dtype=E4M3, scaling=scaling, pow2_scale=True, round_to=round_to)
    got = qz.quantize_dual(parts, impl="pallas", interpret=compat.InterpretGPUParams(), **kw)
    want = qz.quantize_dual(jnp.concatenate(parts, axis=-1), impl="xla", **kw)
    assert all_same(got, want) and all_same(qz.quantize_dual(parts, impl="xla", **kw), want)


def test_dual_of_parts_rejects_bad_parts():
    a, b = sample(jax.random.key(0), (128, 192)), sample(jax.random.key(1), (128, 64))
    with pytest.raises(NotImplementedError, match="part must be a multiple of 128"):
        qz.quantize_dual((a, b), dtype=E4M3, impl="pallas")  # 256 columns in all, but a tile would straddle them
    assert all_same(qz.quantize_dual((a, b), dtype=E4M3, impl="auto"),
                    qz.quantize_dual(jnp.concatenate([a, b], axis=1), dtype=E4M3, impl="xla"))
    with pytest.raises(ValueError, match="share every axis but the last"):
        qz.quantize_dual((a, sample(jax.random.key(2), (64, 128))), dtype=E4M3)
    with pytest.raises(ValueError, match="share every axis but the last and their dtype"):
        qz.quantize_dual((a, b.astype(jnp.float32)), dtype=E4M3)


def test_cover_and_fallback():
    x32 = sample(jax.random.key(2), (128, 256), jnp.float32)
    with pytest.raises(NotImplementedError, match="16-bit"):
        qz.quantize_t(x32, dtype=E4M3, impl="pallas")  # transposed SMEM reads lower for 16-bit tiles only
    with pytest.raises(NotImplementedError, match="16-bit"):
        qz.quantize_dual(x32, dtype=E4M3, impl="pallas")  # f32 dual needs round_to (a 16-bit copy in SMEM)
    with pytest.raises(NotImplementedError, match="must be a multiple of"):
        qz.quantize_dual(sample(jax.random.key(3), (96, 256)), dtype=E4M3, impl="pallas")
    with pytest.raises(NotImplementedError, match="last axis"):
        qz.quantize(x32, axis=0, dtype=E4M3, impl="pallas")
    # auto falls back (on CPU, to the XLA-fused jnp path): checked against NumPy, not against the reference it runs.
    q, s = qz.quantize_t(x32, dtype=E4M3)
    xf, q32, s = np.asarray(x32), np.asarray(q, np.float32), np.asarray(s)
    assert q.dtype == E4M3 and q.shape == (256, 128) and s.shape == (256,)
    amax = np.abs(xf).max(axis=0)  # per column of x
    nz = amax > 0
    assert not nz.all() and (s > 0).all() and (q32[~nz] == 0).all()  # sample() has a zero column: zeros, finite scale
    np.testing.assert_allclose(s[nz], amax[nz] / FMAX[E4M3], rtol=2e-7)
    np.testing.assert_array_equal(np.abs(q32[nz]).max(axis=1), FMAX[E4M3])
    np.testing.assert_allclose(q32 * s[:, None], xf.T, rtol=HALF_ULP[E4M3] * (1 + 1e-6), atol=1e-2 * s.max())


def test_bad_arguments_name_the_argument():
    x = sample(jax.random.key(4), (16, 32))
    with pytest.raises(ValueError, match="`dtype`"):
        qz.quantize(x, axis=1, dtype=jnp.int8)
    with pytest.raises(ValueError, match="`scaling`"):
        qz.quantize(x, axis=1, dtype=E4M3, scaling="blockwise")
    with pytest.raises(ValueError, match="`axis`"):
        qz.quantize(x, axis=2, dtype=E4M3)
    with pytest.raises(ValueError, match="`x`.*2-D"):
        qz.quantize_dual(x[None, None], dtype=E4M3)
    with pytest.raises(ValueError, match="3-D with rowwise"):
        qz.quantize_dual(x[None], dtype=E4M3, scaling="tensorwise")


H200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132))


@pytest.mark.parametrize("fn", ["dual", "t", "rows", "dual_batch", "dual_f32"])
def test_lowers_for_h200(fn):
    """The GPU image's jax (0.11) lowers every cast; 0.10.2 the row cast only, and the others say so."""
    shape = (8, 4096, 14336) if fn in ("dual_batch", "dual_f32") else (8192, 14336)
    x = jax.ShapeDtypeStruct(shape, jnp.float32 if fn == "dual_f32" else jnp.bfloat16)
    f = {
        "dual_f32": lambda x: qz.quantize_dual(x, dtype=E4M3, pow2_scale=True, impl="pallas", round_to=jnp.bfloat16),
        "dual": lambda x: qz.quantize_dual(x, dtype=E4M3, pow2_scale=True, impl="pallas"),
        "dual_batch": lambda x: qz.quantize_dual(x, dtype=E4M3, pow2_scale=True, impl="pallas"),
        "t": lambda x: qz.quantize_t(x, dtype=E5M2, scaling="tensorwise", impl="pallas"),
        "rows": lambda x: qz.quantize(x.astype(jnp.float32), axis=1, dtype=E4M3, impl="pallas"),
    }[fn]
    with jax.sharding.use_abstract_mesh(H200):
        if fn != "rows" and not compat.MGPU_TRANSPOSED_CAST:
            with pytest.raises(NotImplementedError, match="transposed cast lowers for the GPU with jax >= 0.11"):
                jax.jit(f).trace(x)
            return
        assert "mosaic_gpu" in jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()  # not a fallback


# --------------------------------------------------------------------------------------------------------------
# GPU: MX_JAX_TEST_GPU=1 python -m pytest -m gpu tests/test_quantize.py
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 4096), (8192, 14336)])
@pytest.mark.parametrize("scaling,dtype,pow2", [("rowwise", E4M3, True), ("tensorwise", E5M2, False)])
def test_gpu_pallas_matches_xla_bit_exact(shape, scaling, dtype, pow2):
    x = sample(jax.random.key(5), shape)
    kw = dict(dtype=dtype, scaling=scaling, pow2_scale=pow2)
    for got, want in [
        (qz.quantize_dual(x, impl="pallas", **kw), qz.quantize_dual(x, impl="xla", **kw)),
        (qz.quantize_t(x, impl="pallas", **kw), qz.quantize_t(x, impl="xla", **kw)),
        (qz.quantize(x, axis=1, impl="pallas", **kw), qz.quantize(x, axis=1, impl="xla", **kw)),
    ]:
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.shape == w.shape
            if g.dtype.itemsize == 1 or pow2:
                assert same(g, w)  # fp8 payloads, and power-of-two scales, bit for bit
            else:
                # A free f32 scale 1 / (F / amax) may differ in its last bit: XLA simplifies the division chain
                # differently in the two programs (seen: 0.52232146 vs 0.5223214). The payloads above use q itself.
                assert np.max(np.abs(np.asarray(g).view(np.int32) - np.asarray(w).view(np.int32))) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8, 4096, 14336), (64, 1408, 2048)])  # Mixtral's and DeepSeekMoE's experts
def test_gpu_batched_dual_matches_xla_bit_exact(shape):
    x = sample(jax.random.key(6), shape, jnp.float32)  # f32 master weights, quantized from their bf16 copy
    kw = dict(dtype=E4M3, pow2_scale=True)
    for x_in, rt in ((x.astype(jnp.bfloat16), None), (x, jnp.bfloat16)):
        got = qz.quantize_dual(x_in, impl="pallas", round_to=rt, **kw)
        want = qz.quantize_dual(x_in, impl="xla", round_to=rt, **kw)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.shape == w.shape and same(g, w)
