"""MX cast (mx_jax.mx_format): the jnp path bit-exact against the float64 NumPy reference, and the reference's
own assumptions (ml_dtypes rounding, saturation) checked against hand-computed answers."""

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mx_jax import mx_format as mxf

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
# Per input dtype, the binades random blocks are drawn from (inside its finite, mostly normal range).
EXP_RANGE = {BF16: (-135, 120), F32: (-135, 120), F16: (-20, 13)}


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def assert_same_bits(got, want, what=""):
    g, w = _bits(got), _bits(want)
    assert g.shape == w.shape, (what, g.shape, w.shape)
    bad = np.argwhere(g != w)
    first = [(tuple(i), g[tuple(i)], w[tuple(i)]) for i in bad[:5]]
    assert bad.size == 0, f"{what}: {len(bad)} bytes differ, first (index, got, want): {first}"


@functools.cache
def _jit_quantize(mode, elem_dtype, block=32):
    return jax.jit(functools.partial(mxf.mx_quantize, mode=mode, elem_dtype=elem_dtype, block=block))


def check_against_reference(x, mode, elem_dtype, block=32):
    e, s = _jit_quantize(mode, jnp.dtype(elem_dtype), block)(jnp.asarray(x))
    er, sr = mxf.mx_quantize_reference(x, mode=mode, elem_dtype=elem_dtype, block=block)
    assert e.dtype == jnp.dtype(elem_dtype) and e.shape == x.shape
    assert s.dtype == jnp.uint8 and s.shape == x.shape[:-1] + (x.shape[-1] // block,)
    assert_same_bits(s, sr, f"scales {mode} {elem_dtype}")
    assert_same_bits(e, er, f"elements {mode} {elem_dtype}")
    return np.asarray(e), np.asarray(s)


def random_blocks(rng, shape, dtype, block=32):
    """Normal data with one random binade per block, across the dtype's range; every block distinct."""
    lo, hi = EXP_RANGE[jnp.dtype(dtype)]
    exps = rng.integers(lo, hi, size=shape[:-1] + (shape[-1] // block, 1))
    x = rng.standard_normal(shape[:-1] + (shape[-1] // block, block)) * np.exp2(exps.astype(np.float64))
    return x.reshape(shape).astype(dtype)


def special_blocks(rng, dtype):
    """(16, 64): one special case per 32-element block (rows 0..15, blocks 0/1), filled around with normals."""
    dtype = jnp.dtype(dtype)
    x = rng.standard_normal((16, 64))
    lo, hi = EXP_RANGE[dtype]
    blocks = x.reshape(16, 2, 32)
    blocks[0, 0] = 0.0  # all-zero block -> e = -127
    blocks[0, 1] = -0.0  # all -0
    blocks[1, 0, ::2] = -0.0  # -0 among normals
    blocks[1, 1, 3] = np.nan
    blocks[2, 0, 7] = np.inf
    blocks[2, 1, 0] = -np.inf
    blocks[3, 0] *= 2.0**lo  # deepest binade of the dtype: subnormal inputs (and f32/bf16: amax ~ 2^-135)
    blocks[3, 1, 5] *= 2.0**12  # one outlier: the rest of the block underflows towards the subnormals
    blocks[4, 0] = np.sign(blocks[4, 0]) * 1.9 * 2.0**4  # significand 1.9 everywhere: floor saturates
    blocks[4, 1, :] = np.linspace(-1.0, 1.0, 32) * (2.0 - 2.0**-7)  # amax just below 2: even rounds up
    blocks[5, 0] *= 2.0 ** (hi - 3)  # top of the range (f32/bf16: amax ~ 2^120)
    blocks[5, 1] = 1.5 * 2.0 ** (lo - 10)  # below the dtype's subnormals: rounds to zero in the input dtype
    x = blocks.reshape(16, 64)
    if dtype != F16:
        x[6, :32] = rng.standard_normal(32) * 2.0**-140  # f32/bf16 subnormal block near the clamp
        x[6, 32:] = rng.standard_normal(32) * 2.0**126  # amax ~ 2^127
        x[7, :32] = np.float32(np.finfo(np.float32).max) * np.linspace(-1, 1, 32)  # amax = max float32
        x[7, 32:] = rng.standard_normal(32) * 2.0**-149 * 100  # subnormal mantissas 1..~300
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@pytest.mark.parametrize("mode", mxf.MODES)
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", [BF16, F32, F16], ids=["bf16", "f32", "f16"])
def test_random_blocks_bit_exact(mode, elem_dtype, in_dtype):
    rng = np.random.default_rng(zlib.crc32(f"{mode}/{elem_dtype}/{in_dtype}".encode()))  # stable across processes
    check_against_reference(random_blocks(rng, (48, 256), in_dtype), mode, elem_dtype)


@pytest.mark.parametrize("mode", mxf.MODES)
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", [BF16, F32, F16], ids=["bf16", "f32", "f16"])
def test_special_blocks_bit_exact(mode, elem_dtype, in_dtype):
    rng = np.random.default_rng(7)
    x = special_blocks(rng, in_dtype)
    e, s = check_against_reference(x, mode, elem_dtype)
    fmt = mxf.elem_format(elem_dtype)
    # Independent of the reference: the spec's fixed points.
    assert s[0, 0] == s[0, 1] == 0  # zero blocks: e = -127
    assert (_bits(e[0, 32:]) == 0x80).all()  # -0 kept
    assert (_bits(e[1, :32:2]) == 0x80).all()
    for r, b in [(1, 1), (2, 0), (2, 1)]:
        assert s[r, b] == 0xFF and (_bits(e[r, 32 * b : 32 * b + 32]) == fmt.nan_byte).all()
    assert np.isfinite(e[~np.isin(s, [0xFF]).repeat(32, axis=1)].astype(np.float32)).all()  # saturating
    if mode == "floor":  # significand 1.9 > 1.75: every element of the block saturates to +-M
        np.testing.assert_array_equal(np.abs(e[4, :32].astype(np.float32)), fmt.max_normal)


@pytest.mark.parametrize("mode", mxf.MODES)
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_every_bf16_value(mode, elem_dtype):
    """All 65536 bf16 bit patterns, in blocks of 32 consecutive patterns (each binade, ties, subnormals, NaN)."""
    x = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(64, 1024)
    check_against_reference(x, mode, elem_dtype)


@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_round_half_to_even_ties(elem_dtype):
    """Blocks with amax = 2^emax (e = 0 in every mode) whose elements sit exactly halfway between fp8 values."""
    fmt = mxf.elem_format(elem_dtype)
    grid = 1 + np.arange(2**fmt.mbits + 1) / 2**fmt.mbits  # significands 1, 1+ulp, ..., 2
    sub_ulp = 2.0 ** (fmt.emin - fmt.mbits)
    sub_ties = (np.arange(4) + 0.5) * sub_ulp
    normal_ties = np.concatenate([(grid[:-1] + grid[1:]) / 2 * 2.0**k for k in range(-6, 7)])
    ties = np.concatenate([sub_ties, normal_ties])[:31]
    block = np.concatenate([[2.0**fmt.emax], ties])
    x = np.stack([block, -block]).astype(np.float32)
    for mode in mxf.MODES:
        e, s = check_against_reference(x, mode, elem_dtype)
        assert (s == 127).all()
        got = e.astype(np.float64)
        np.testing.assert_array_equal(got[1], -got[0])
        # Rounded to a neighbour (half an ulp away), and the one with an even last mantissa bit.
        ulp = np.exp2(np.maximum(np.floor(np.log2(ties)), fmt.emin) - fmt.mbits)
        np.testing.assert_array_equal(np.abs(got[0, 1:] - ties), ulp / 2)
        assert (_bits(e[0, 1:]) & 1 == 0).all()


def test_scale_exponent_by_hand():
    """Known answers of the three modes (e4m3: emax 8, M 448; e5m2: emax 15, M 57344)."""
    cases = [  # amax, elem, floor, rceil, even
        (448.0, E4M3, 0, 0, 0),
        (449.0, E4M3, 0, 1, 0),  # significand 1.754 rounds to 1.75 at 3 bits: even keeps e
        (480.0, E4M3, 0, 1, 0),  # 1.875 has 3 mantissa bits: nothing to round
        (496.0, E4M3, 0, 1, 1),  # 1.9375 rounds (half away) up to 2
        (256.0, E4M3, 0, 0, 0),
        (255.0, E4M3, -1, 0, 0),  # 1.992 * 2^7: rceil and even go up a binade
        (1.0, E4M3, -8, -8, -8),
        (57344.0, E5M2, 0, 0, 0),
        (57345.0, E5M2, 0, 1, 0),
        (2.0**-130, E4M3, -127, -127, -127),  # clamped
        (3.0e38, E4M3, 119, 120, 119),  # 1.763 * 2^127
        (3.3e38, E4M3, 119, 120, 120),  # 1.94 * 2^127 rounds up to 2^128: e = 120, no overflow
    ]
    for amax, elem, floor, rceil, even in cases:
        x = np.full((1, 32), amax / 2, np.float32)
        x[0, 0] = amax
        for mode, want in zip(mxf.MODES, (floor, rceil, even)):
            _, s = check_against_reference(x, mode, elem)
            assert int(s[0, 0]) - 127 == want, (amax, elem, mode, int(s[0, 0]) - 127, want)


def test_floor_saturates_rceil_does_not():
    x = np.full((1, 32), 1.0, np.float32)
    x[0, 0] = 1.875 * 2.0**5  # significand above 1.75, exact in e4m3
    e_floor, _ = check_against_reference(x, "floor", E4M3)
    e_rceil, s_rceil = check_against_reference(x, "rceil", E4M3)
    assert float(e_floor[0, 0]) == 448.0  # 1.875 * 2^8 = 480 clipped to M
    assert float(e_rceil[0, 0]) * 2.0 ** (int(s_rceil[0, 0]) - 127) == 1.875 * 2.0**5  # exact, no clipping


def test_reference_rounding_matches_ml_dtypes_single_rounding():
    """The reference's explicit RNE equals ml_dtypes' direct float64 -> fp8 cast inside +-M; beyond M ml_dtypes
    does not saturate (so the cast clips first); and for values exact in float32 (every x / 2^e here) going through
    float32 is no double rounding."""
    rng = np.random.default_rng(3)
    for elem in (E4M3, E5M2):
        fmt = mxf.elem_format(elem)
        q = rng.standard_normal(20000) * np.exp2(rng.uniform(fmt.emin - fmt.mbits - 3, fmt.emax + 1, 20000))
        q = np.clip(q, -fmt.max_normal, fmt.max_normal)
        mine = mxf._round_to_elem(q, fmt).astype(elem)
        assert_same_bits(mine, q.astype(elem), f"direct float64 cast {elem}")
        q32 = q.astype(np.float32).astype(np.float64)  # exact in f32 -> f32 path has nothing to round twice
        assert_same_bits(mxf._round_to_elem(q32, fmt).astype(elem), q32.astype(np.float32).astype(elem), str(elem))
    assert np.isnan(np.float64(500.0).astype(E4M3).astype(np.float32))  # ml_dtypes: overflow -> NaN, no saturation
    assert np.isinf(np.float64(70000.0).astype(E5M2).astype(np.float32))


@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_plain_multiply_is_exact_where_subnormals_are_kept(elem_dtype):
    """The GPU kernels skip the subnormal fix-up and the clip: on IEEE float32 (NumPy keeps subnormals, like the
    GPU) x * 2^-e followed by a saturating RNE convert equals the reference, for every bf16 value and edge block."""
    fmt = mxf.elem_format(elem_dtype)
    x = np.concatenate(
        [
            np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(-1, 64),
            special_blocks(np.random.default_rng(0), BF16),
        ]
    )
    x = x[~np.isnan(x.astype(np.float32).reshape(-1, 2, 32)).any(-1).any(-1)]  # finite-or-Inf rows; NaN: see below
    for mode in mxf.MODES:
        er, sr = mxf.mx_quantize_reference(x, mode=mode, elem_dtype=elem_dtype)
        e = sr.astype(np.int32) - 127
        scale = np.ldexp(np.float32(1), -e).astype(np.float32)  # normal for finite blocks
        with np.errstate(over="ignore", invalid="ignore"):
            q = x.astype(np.float32).reshape(-1, 2, 32) * scale[..., None]  # one IEEE float32 multiply
            sat = np.clip(q, -fmt.max_normal, fmt.max_normal).astype(elem_dtype)  # = cvt.rn.satfinite
        finite = sr != 0xFF
        assert_same_bits(sat[finite], er.reshape(-1, 2, 32)[finite], f"{mode} {elem_dtype}")


def test_batch_dims_and_block_size():
    rng = np.random.default_rng(11)
    check_against_reference(random_blocks(rng, (2, 3, 128), BF16), "floor", E4M3)
    x = random_blocks(rng, (8, 128), F32, block=64)
    check_against_reference(x, "rceil", E5M2, block=64)


@pytest.mark.parametrize("mode", mxf.MODES)
def test_dequantize(mode):
    rng = np.random.default_rng(5)
    # Binades within +-60 keep every dequantized value in float32's normal range (XLA:CPU flushes subnormals).
    exps = rng.integers(-60, 60, size=(32, 4, 1)).astype(np.float64)
    x = (rng.standard_normal((32, 4, 32)) * np.exp2(exps)).reshape(32, 128).astype(np.float32)
    for elem in (E4M3, E5M2):
        fmt = mxf.elem_format(elem)
        e, s = mxf.mx_quantize(jnp.asarray(x), mode=mode, elem_dtype=elem)
        d = jax.jit(mxf.mx_dequantize)(e, s)
        assert d.dtype == jnp.float32
        dr = mxf.mx_dequantize_reference(np.asarray(e), np.asarray(s))
        assert_same_bits(d, dr, "dequantize")
        amax = np.abs(x.reshape(32, 4, 32)).max(-1, keepdims=True)
        err = np.abs(np.asarray(d).reshape(32, 4, 32) - x.reshape(32, 4, 32))
        # rceil keeps |x / 2^e| <= M: the error is rounding only, <= half an ulp of the top binade.
        # floor (and even, below its round-up threshold) clips significands above 1.75: up to 1/8 of amax.
        tol = 2.0**-fmt.mbits / 1.75 if mode == "rceil" else 1 / 8 + 2.0**-fmt.mbits
        assert (err <= tol * amax).all(), (mode, elem, float((err / amax).max()))
    d16 = mxf.mx_dequantize(e, s, out_dtype=jnp.bfloat16)
    assert d16.dtype == jnp.bfloat16
    assert_same_bits(d16, mxf.mx_dequantize_reference(np.asarray(e), np.asarray(s), out_dtype=ml_dtypes.bfloat16))


def test_dequantize_nan_scale():
    x = np.ones((2, 64), np.float32)
    x[1, 40] = np.nan
    e, s = mxf.mx_quantize(jnp.asarray(x))
    d = np.asarray(mxf.mx_dequantize(e, s))
    assert np.isnan(d[1, 32:]).all() and np.isfinite(d[:, :32]).all() and np.isfinite(d[0]).all()


def test_errors():
    x = jnp.ones((4, 48), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"multiple of block=32.*\(4, 48\).*bfloat16"):
        mxf.mx_quantize(x)
    with pytest.raises(ValueError, match=r"\(4, 48\)"):
        mxf.mx_quantize_reference(np.ones((4, 48), np.float32))
    with pytest.raises(TypeError, match=r"x must be bfloat16, float16 or float32.*int32"):
        mxf.mx_quantize(jnp.ones((4, 64), jnp.int32))
    with pytest.raises(ValueError, match="mode must be one of"):
        mxf.mx_quantize(jnp.ones((4, 64)), mode="ceil")
    with pytest.raises(ValueError, match="elem_dtype must be"):
        mxf.mx_quantize(jnp.ones((4, 64)), elem_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of block"):
        mxf.mx_quantize(jnp.ones(()))
    e, s = mxf.mx_quantize(jnp.ones((4, 64)))
    with pytest.raises(ValueError, match=r"scales must have shape"):
        mxf.mx_dequantize(e, s[:2])
    with pytest.raises(TypeError, match="uint8"):
        mxf.mx_dequantize(e, s.astype(jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", mxf.MODES)
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", [BF16, F32], ids=["bf16", "f32"])
def test_gpu_xla_path_bit_exact(mode, elem_dtype, in_dtype):
    """The jnp cast compiled by XLA:GPU (its own fp8 convert, no flush-to-zero) against the reference."""
    rng = np.random.default_rng(1)
    x = random_blocks(rng, (1024, 2048), in_dtype)
    x[:16, :64] = special_blocks(rng, in_dtype)
    check_against_reference(x, mode, elem_dtype)
    every_bf16 = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(64, 1024)
    check_against_reference(every_bf16, mode, elem_dtype)
