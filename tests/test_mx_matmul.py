"""MX block-scaled GEMM (pallas_kernels/mx_matmul.py): the Hopper kernel interpreted on CPU, the XLA and reference
paths against a float64 NumPy product of the dequantized operands, the cover and the dispatcher, the Blackwell path's
hand-off to `jax.nn.scaled_matmul`, lowering for the H200 from CPU, and `gpu` tests at real shapes."""

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from mx_jax import compat
from pallas_kernels import device
from mx_jax import mx_format as mxf
from pallas_kernels import interpret_compat

mm = importlib.import_module("pallas_kernels.mx_matmul")
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
# Small tiles so a 128-256 sized problem has several CTA tiles, several K steps and two blocks per stage.
SMALL = mm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2)
NORM_RTOL = 1e-3  # the criterion: ||out - ref|| / ||ref|| against float64
F32_ATOL = 2.0**-16  # f32 accumulation over K <= 256: |err| <= ~K * 2^-24 * (|a| |b|^T); scaled below
BF16_RTOL = 2.0**-8  # a bf16 output is the f32 result rounded once (<= 2^-9 relative)


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    interpret_compat.install()


def mx_operand(key, rows, k, dtype, mode, spread):
    """MX-quantized normal data whose 32-blocks are scaled by 2^U[-spread, spread], with one all-zero block."""
    kx, ke = jax.random.split(key)
    exps = jax.random.randint(ke, (rows, k // 32), -spread, spread + 1)
    x = jax.random.normal(kx, (rows, k), jnp.float32) * jnp.exp2(exps.astype(jnp.float32)).repeat(32, axis=1)
    x = x.at[1, 32:64].set(0.0)
    return mxf.mx_quantize(x, mode=mode, elem_dtype=dtype)


@functools.partial(jax.jit, static_argnames=("m", "n", "k", "a_dtype", "b_dtype", "spread"))
def operands(key, m, n, k, a_dtype=E4M3, b_dtype=E4M3, spread=30):
    ka, kb = jax.random.split(key)
    a, sa = mx_operand(ka, m, k, a_dtype, "floor", spread)
    b, sb = mx_operand(kb, n, k, b_dtype, "rceil", spread)
    return a, b, sa, sb


def float64_product(a, b, sa, sb):
    """(ref, |a| |b|^T) in float64 from the exactly dequantized operands."""
    a64 = mxf.mx_dequantize_reference(a, sa, out_dtype=np.float64)
    b64 = mxf.mx_dequantize_reference(b, sb, out_dtype=np.float64)
    return a64 @ b64.T, np.abs(a64) @ np.abs(b64).T


def assert_matches_float64(out, a, b, sa, sb):
    ref, mag = float64_product(a, b, sa, sb)
    # The 1e-3 is the kernel's arithmetic (f32 out); a bf16 output adds its own rounding (~2^-9 RMS).
    rtol = BF16_RTOL if out.dtype == jnp.bfloat16 else 0.0
    out = np.asarray(out, np.float64)
    assert out.shape == ref.shape and np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= max(NORM_RTOL, rtol)
    # elementwise: accumulation error is relative to the sum of |terms|, not to a possibly cancelled result
    np.testing.assert_array_less(np.abs(out - ref), F32_ATOL * mag + rtol * np.abs(ref) + 1e-30)


def test_operands_span_a_wide_exponent_range_and_hold_zero_blocks():
    a, b, sa, sb = operands(jax.random.key(0), 64, 64, 256)
    for s in (sa, sb):
        s = np.asarray(s).astype(int)
        assert s.max() - s.min() >= 50  # >= 50 binades between blocks of the same operand
        assert (s[1, 1] == 0) and (s != 0).sum() == s.size - 1  # the zero block gets the E8M0 minimum


INTERPRET_CASES = [
    # (m, n, k, a dtype, b dtype, config, out dtype)
    (128, 128, 128, E4M3, E4M3, dataclasses.replace(SMALL, scale_first=True), jnp.float32),
    (128, 256, 128, E5M2, E5M2, dataclasses.replace(SMALL, wg_split="n", tmp_slots=2), jnp.bfloat16),
    (128, 128, 64, E4M3, E5M2, dataclasses.replace(SMALL, tile_m=128, wg_split="n"), jnp.float32),
]


@pytest.mark.parametrize("m,n,k,a_dtype,b_dtype,config,out_dtype", INTERPRET_CASES)
def test_pallas_interpreted_matches_float64(m, n, k, a_dtype, b_dtype, config, out_dtype):
    a, b, sa, sb = operands(jax.random.key(m + n + k), m, n, k, a_dtype, b_dtype)
    call = lambda: mm.mx_matmul(
        a, b, sa, sb, out_dtype=out_dtype, impl="pallas", config=config, interpret=compat.InterpretGPUParams()
    )
    if a_dtype != b_dtype and not compat.MGPU_MIXED_FP8_WGMMA:
        with pytest.raises(NotImplementedError, match="mixed"):
            call()
        return
    out = call()
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_matches_float64(out, a, b, sa, sb)


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("a_dtype,b_dtype", [(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2)])
def test_xla_and_reference_match_float64(impl, a_dtype, b_dtype):
    # spread 12 keeps the dequantized values inside XLA:CPU's normal float range (it flushes subnormals)
    a, b, sa, sb = operands(jax.random.key(7), 96, 80, 160, a_dtype, b_dtype, spread=12)
    out = jax.jit(lambda *x: mm.mx_matmul(*x, out_dtype=jnp.float32, impl=impl))(a, b, sa, sb)
    assert out.dtype == jnp.float32
    if impl == "xla":  # f32 out and bf16 operands: exact dequantization, f32 accumulation
        assert_matches_float64(out, a, b, sa, sb)
    else:
        ref, mag = float64_product(a, b, sa, sb)
        np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - ref), 1e-6 * mag + 1e-30)


@pytest.mark.parametrize("out_dtype,rtol", [(jnp.bfloat16, 2.0**-8), (jnp.float16, 2.0**-11)])
def test_xla_low_precision_outputs_round_once(out_dtype, rtol):
    a, b, sa, sb = operands(jax.random.key(8), 64, 32, 96, spread=4)
    out = jax.jit(functools.partial(mm.mx_matmul, out_dtype=out_dtype, impl="xla"))(a, b, sa, sb)
    assert out.dtype == out_dtype
    ref, mag = float64_product(a, b, sa, sb)
    # one rounding of the f32 result to the output format (f16 must not go through bf16)
    np.testing.assert_array_less(np.abs(np.asarray(out, np.float64) - ref), rtol * np.abs(ref) + 1e-6 * mag)


def test_nan_scale_poisons_exactly_its_row_and_column():
    a, b, sa, sb = operands(jax.random.key(3), 64, 48, 96, spread=8)
    sa = sa.at[5, 2].set(0xFF)
    sb = sb.at[7, 0].set(0xFF)
    for impl in ("xla", "reference"):
        out = np.asarray(jax.jit(functools.partial(mm.mx_matmul, out_dtype=jnp.float32, impl=impl))(a, b, sa, sb))
        nan = np.zeros(out.shape, bool)
        nan[5, :] = nan[:, 7] = True
        np.testing.assert_array_equal(np.isnan(out), nan)


def test_pallas_interpreted_nan_scales_and_a_wide_exponent_spread():
    """The CPU twin of test_gpu_dtypes_zero_blocks_and_nan at 128 x 256 x 128: e5m2 operands whose blocks span
    2^-40 .. 2^40, a NaN scale in each operand (row 5, column 7), the kernel against the f32 reference."""
    a, b, sa, sb = operands(jax.random.key(9), 128, 256, 128, E5M2, E5M2, spread=40)
    sa = sa.at[5, 2].set(0xFF)
    sb = sb.at[7, 0].set(0xFF)
    config = dataclasses.replace(SMALL, wg_split="n", tmp_slots=2)
    out = np.asarray(mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.float32, impl="pallas", config=config,
                                  interpret=compat.InterpretGPUParams()))
    ref = np.asarray(mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.float32, impl="reference"))
    nan = np.zeros(out.shape, bool)
    nan[5, :] = nan[:, 7] = True
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(np.isnan(ref), nan)
    keep = ~nan
    assert np.linalg.norm(out[keep] - ref[keep]) / np.linalg.norm(ref[keep]) < NORM_RTOL


def test_scale_factors_are_twice_the_e8m0_value_in_kernel_layout():
    s = jnp.arange(256, dtype=jnp.uint8).reshape(128, 2)  # every byte once; (R, K/32) = (128, 2)
    f = np.asarray(mm.scale_factors(s, 64))
    assert f.shape == (2, 2, 64) and f.dtype == np.float32  # (K/32, R/64, 64)
    flat = f.transpose(1, 2, 0).reshape(128, 2)  # back to (R, K/32)
    byte = np.asarray(s).astype(np.int64)
    want = np.where(byte == 255, np.nan, np.ldexp(1.0, byte - 126))
    want[byte == 254] = np.inf  # 2^128: no cast of a finite float32 produces byte 254
    np.testing.assert_array_equal(flat, want.astype(np.float32))
    assert np.all(np.isfinite(flat[byte <= 253])) and np.all(flat[byte <= 253] >= 2.0**-126)  # all normal


def test_uncovered_shape_raises_under_pallas_and_falls_back_under_auto(monkeypatch):
    a, b, sa, sb = operands(jax.random.key(5), 96, 128, 128, spread=8)  # M=96: not a multiple of the CTA tile
    with pytest.raises(NotImplementedError, match="multiples"):
        mm.mx_matmul(a, b, sa, sb, impl="pallas", interpret=compat.InterpretGPUParams())
    assert_matches_float64(mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.float32, impl="auto"), a, b, sa, sb)  # CPU
    # On Hopper, auto runs the kernel only where it covers the shape and the table does not say XLA.
    monkeypatch.setattr(device, "compute_capability", lambda: (9, 0))
    assert mm.auto_choice(96, 128, 128, E4M3, E4M3) == "xla"
    assert mm.auto_choice(8192, 8192, 8192, E4M3, E4M3) == mm.AUTO_DEFAULT
    monkeypatch.setitem(mm.AUTO_TABLE, (8192, 8192, 8192), None)
    assert mm.auto_choice(8192, 8192, 8192, E4M3, E4M3) == "xla"
    monkeypatch.setattr(device, "compute_capability", lambda: (8, 0))  # Ampere: no TMA/wgmma
    assert mm.auto_choice(4096, 4096, 4096, E4M3, E4M3) == "xla"
    monkeypatch.setattr(device, "compute_capability", lambda: (10, 0))
    assert mm.auto_choice(96, 128, 128, E4M3, E4M3) == "blackwell"


def test_cover_reasons():
    assert mm.pallas_cover(8192, 8192, 8192, E4M3, E4M3) is None
    assert mm.pallas_cover(8192, 8192, 8192, E4M3, E4M3, jnp.float32) is None
    assert "multiples" in mm.pallas_cover(8192, 8192 + 64, 8192, E4M3, E4M3)
    assert "registers" in mm.pallas_cover(8192, 8192, 8192, E4M3, E4M3, config=mm.TileConfig(tile_m=128))
    assert "shared memory" in mm.pallas_cover(8192, 8192, 8192, E4M3, E4M3, config=mm.TileConfig(stages=6))
    assert "float8" in mm.pallas_cover(8192, 8192, 8192, jnp.bfloat16, E4M3)
    assert "tmp_slots" in mm.pallas_cover(8192, 8192, 8192, E4M3, E4M3, config=mm.TileConfig(tile_k=96, tmp_slots=2))
    mixed = mm.pallas_cover(8192, 8192, 8192, E4M3, E5M2)
    assert (mixed is None) == compat.MGPU_MIXED_FP8_WGMMA


def test_bad_arguments_name_the_argument():
    a, b, sa, sb = operands(jax.random.key(9), 64, 64, 64, spread=4)
    with pytest.raises(ValueError, match="`a`.*float32"):
        mm.mx_matmul(a.astype(jnp.float32), b, sa, sb)
    with pytest.raises(ValueError, match="contraction"):
        mm.mx_matmul(a, b[:, :32], sa, sb)
    with pytest.raises(ValueError, match="multiple of 32"):
        mm.mx_matmul(a[:, :48], b[:, :48], sa, sb)
    with pytest.raises(ValueError, match="`b_scales`.*uint8"):
        mm.mx_matmul(a, b, sa, sb.astype(jnp.int32))
    with pytest.raises(ValueError, match="`a_scales`.*\\(64, 2\\)"):
        mm.mx_matmul(a, b, sa[:, :1], sb)
    with pytest.raises(ValueError, match="impl"):
        mm.mx_matmul(a, b, sa, sb, impl="cuda")


# --------------------------------------------------------------------------------------------------------------
# Blackwell: the hand-off to jax.nn.scaled_matmul (cuDNN), checked against its docstring without the hardware.
# --------------------------------------------------------------------------------------------------------------
def test_blackwell_path_hands_scaled_matmul_its_documented_layout(monkeypatch):
    a, b, sa, sb = operands(jax.random.key(11), 64, 96, 128, E4M3, E5M2, spread=8)
    sa = sa.at[0, 0].set(0xFF)  # NaN scale: must reach cuDNN as the e8m0 NaN, bit for bit
    seen = {}

    def fake_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
        seen.update(lhs=lhs, rhs=rhs, lhs_scales=lhs_scales, rhs_scales=rhs_scales, out=preferred_element_type)
        # the docstring's semantics: a * repeat(a_scales, K // K_a) contracted with b on the last dim
        deq = lambda x, s: x.astype(jnp.float32) * jnp.repeat(s.astype(jnp.float32), x.shape[-1] // s.shape[-1], -1)
        out = jnp.einsum("bmk,bnk->bmn", deq(lhs, lhs_scales), deq(rhs, rhs_scales))
        return out.astype(preferred_element_type)

    monkeypatch.setattr(jax.nn, "scaled_matmul", fake_scaled_matmul)
    monkeypatch.setattr(device, "compute_capability", lambda: (10, 0))
    out = mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.bfloat16, impl="auto")  # auto picks blackwell on cc 10.0
    # (B, M, K) and (B, N, K) fp8 operands; (B, M, K/32) and (B, N, K/32) float8_e8m0fnu scales; block 32
    assert seen["lhs"].shape == (1, 64, 128) and seen["lhs"].dtype == E4M3
    assert seen["rhs"].shape == (1, 96, 128) and seen["rhs"].dtype == E5M2
    assert seen["lhs_scales"].shape == (1, 64, 4) and seen["rhs_scales"].shape == (1, 96, 4)
    for got, want in ((seen["lhs_scales"], sa), (seen["rhs_scales"], sb)):
        assert got.dtype == jnp.float8_e8m0fnu
        np.testing.assert_array_equal(jax.lax.bitcast_convert_type(got, jnp.uint8)[0], want)
    np.testing.assert_array_equal(seen["lhs"][0], a)
    assert jnp.dtype(seen["out"]) == jnp.bfloat16 and out.shape == (64, 96) and out.dtype == jnp.bfloat16
    want = mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.float32, impl="reference")
    np.testing.assert_array_equal(np.isnan(np.asarray(out, np.float32)), np.isnan(np.asarray(want)))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=BF16_RTOL, atol=1e-6)


def test_blackwell_path_lowers_to_cudnn_block_scaled_dot():
    """The real jax.nn.scaled_matmul accepts our arguments (its shape checks run) and lowers for CUDA to the
    block-scaled dot custom call with e8m0 scales: everything short of running it on a B200."""
    shapes = (
        jax.ShapeDtypeStruct((256, 512), E4M3),
        jax.ShapeDtypeStruct((128, 512), E4M3),
        jax.ShapeDtypeStruct((256, 16), jnp.uint8),
        jax.ShapeDtypeStruct((128, 16), jnp.uint8),
    )
    f = jax.jit(lambda *x: mm.mx_matmul(*x, out_dtype=jnp.bfloat16, impl="blackwell"))
    assert jax.eval_shape(f, *shapes) == jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    hlo = f.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "block_scaled_dot" in hlo
    for t in ("1x256x512xf8E4M3FN", "1x128x512xf8E4M3FN", "1x256x16xf8E8M0FNU", "1x128x16xf8E8M0FNU"):
        assert t in hlo, t


# --------------------------------------------------------------------------------------------------------------
# Lowering for the H200 from CPU (layout inference and the Python Mosaic-GPU passes run at lowering time).
# --------------------------------------------------------------------------------------------------------------
H200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132))
SWEEP = [
    mm.DEFAULT_CONFIG,
    mm.TileConfig(tmp_slots=2),
    mm.TileConfig(scale_first=True),
    mm.TileConfig(tile_m=128, tile_n=64, wg_split="n"),
    mm.TileConfig(tile_m=128, tile_n=64, wg_split="n", tmp_slots=2),
    mm.TileConfig(wg_split="n"),
    mm.TileConfig(stages=5),
    mm.TileConfig(tile_k=64, stages=8),
]
LOWERING_CASES = [(c, jnp.bfloat16) for c in SWEEP] + [(mm.DEFAULT_CONFIG, jnp.float32), (SWEEP[3], jnp.float16)]


@pytest.mark.parametrize("config,out_dtype", LOWERING_CASES, ids=lambda v: v.name() if hasattr(v, "name") else str(v))
def test_lowers_for_h200(config, out_dtype):
    """With the GPU image's jax (0.11) and with 0.10.2, where mixed e4m3 x e5m2 operands are not covered."""
    m = n = k = 8192
    b_dtype = E5M2 if compat.MGPU_MIXED_FP8_WGMMA else E4M3
    shapes = (
        jax.ShapeDtypeStruct((m, k), E4M3),
        jax.ShapeDtypeStruct((n, k), b_dtype),
        jax.ShapeDtypeStruct((m, k // 32), jnp.uint8),
        jax.ShapeDtypeStruct((n, k // 32), jnp.uint8),
    )
    assert mm.pallas_cover(m, n, k, E4M3, b_dtype, out_dtype, config) is None
    with jax.sharding.use_abstract_mesh(H200):
        hlo = (
            jax.jit(lambda *x: mm.mx_matmul_pallas(*x, out_dtype=out_dtype, config=config))
            .trace(*shapes)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert "mosaic_gpu" in hlo


# --------------------------------------------------------------------------------------------------------------
# GPU: MX_JAX_TEST_GPU=1 python -m pytest -m gpu tests/test_mx_matmul.py
# --------------------------------------------------------------------------------------------------------------
GPU_SHAPES = [(8192, 8192, 8192), (8192, 1024, 4096), (8192, 4096, 14336), (8192, 28672, 8192)]


def _rel(x, ref):
    # float64: at spread 40 the entries reach ~1e25, and a float32 norm squares them past 3.4e38 (inf / inf = nan)
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
@pytest.mark.parametrize("config", [SWEEP[0], SWEEP[1], SWEEP[3]], ids=lambda c: c.name())
def test_gpu_pallas_matches_reference_and_xla(m, n, k, config):
    a, b, sa, sb = operands(jax.random.key(1), m, n, k, spread=20)
    ref = mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.float32, impl="reference")
    out = mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.float32, impl="pallas", config=config)
    xla = mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.float32, impl="xla")
    # Hopper's fp8 wgmma keeps only ~14 bits while summing inside the tensor core (DeepSeek-V3, 3.3.2); promoting
    # every 32-wide block bounds that loss to 32-term sums, so expect ~1e-5..1e-4, well inside the 1e-3.
    print(f"rel.err f32 out: pallas {_rel(out, ref):.2e}  xla {_rel(xla, ref):.2e}")
    assert _rel(out, ref) < NORM_RTOL, _rel(out, ref)
    assert _rel(xla, ref) < 1e-5, _rel(xla, ref)  # bf16 operands are exact, cuBLAS accumulates in f32
    out16 = mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.bfloat16, impl="pallas", config=config)
    assert _rel(out16, ref) < 3e-3, _rel(out16, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("a_dtype,b_dtype", [(E5M2, E5M2), (E4M3, E5M2)])
def test_gpu_dtypes_zero_blocks_and_nan(a_dtype, b_dtype):
    a, b, sa, sb = operands(jax.random.key(2), 4096, 4096, 4096, a_dtype, b_dtype, spread=40)
    sa = sa.at[5, 7].set(0xFF)
    ref = mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.float32, impl="reference")
    out = mm.mx_matmul(a, b, sa, sb, out_dtype=jnp.float32, impl="pallas")
    np.testing.assert_array_equal(np.isnan(np.asarray(out)), np.isnan(np.asarray(ref)))  # row 5 only
    keep = np.arange(4096) != 5
    assert _rel(np.asarray(out)[keep], np.asarray(ref)[keep]) < NORM_RTOL


@pytest.mark.gpu
def test_gpu_auto_uses_the_kernel_on_hopper():
    if device.compute_capability() != (9, 0):
        pytest.skip("not a Hopper GPU")
    a, b, sa, sb = operands(jax.random.key(4), 8192, 8192, 8192, spread=8)
    assert isinstance(mm.auto_choice(8192, 8192, 8192, a.dtype, b.dtype), mm.TileConfig)
    hlo = jax.jit(lambda *x: mm.mx_matmul(*x, impl="auto")).lower(a, b, sa, sb).as_text()
    assert "mosaic_gpu" in hlo
