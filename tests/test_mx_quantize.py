"""MX cast kernels (pallas_kernels/mx_quantize.py): interpreted on CPU bit-exact against the NumPy reference, lowered
for the GPU from CPU, dispatchers; `gpu` tests at real shapes against the XLA path."""

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mx_jax import compat
from mx_jax import mx_format as mxf
from pallas_kernels import mx_quantize as mq

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
VARIANTS = ("dim0", "dim1", "dim01")
PALLAS = {"dim0": mq.mx_quantize_dim0_pallas, "dim1": mq.mx_quantize_dim1_pallas, "dim01": mq.mx_quantize_dim01_pallas}
SMALL = mq.CastConfig(tile_rows=64, tile_k=64)


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def assert_same_bits(got, want, what=""):
    assert len(got) == len(want), what
    for n, (g, w) in enumerate(zip(got, want)):
        g, w = _bits(g), _bits(w)
        assert g.shape == w.shape, (what, n, g.shape, w.shape)
        bad = np.argwhere(g != w)
        first = [(tuple(i), g[tuple(i)], w[tuple(i)]) for i in bad[:4]]
        assert bad.size == 0, f"{what} output {n}: {len(bad)} differ, first (index, got, want): {first}"


def reference(x, variant, mode="floor", elem_dtype=E4M3):
    r0 = mq.mx_quantize_dim0_reference(x, mode=mode, elem_dtype=elem_dtype)
    r1 = mq.mx_quantize_dim1_reference(x, mode=mode, elem_dtype=elem_dtype)
    return {"dim0": r0, "dim1": r1, "dim01": (*r0, *r1)}[variant]


def make_input(rng, shape, dtype=jnp.bfloat16):
    """Normals with a random binade per 32 x 32 patch (so blocks along either axis vary), plus special values."""
    a, b = shape
    lim = 40 if dtype == jnp.bfloat16 else 6  # float16 tops out at 2^16
    exps = rng.integers(-lim, lim, size=(a // 32, 1, b // 32, 1)).astype(np.float64)
    x = (rng.standard_normal((a // 32, 32, b // 32, 32)) * np.exp2(exps)).reshape(a, b)
    x[0, :32] = 0.0  # an all-zero row block (and zeros in column blocks)
    x[1, 3] = -0.0
    x[2, 40] = np.nan
    x[33, 5] = np.inf
    x[34, 6] = -np.inf
    x[35, 37] *= 2.0**10  # outlier
    x[36:40, 64 % b : 64 % b + 32] *= 2.0**-100 if dtype == jnp.bfloat16 else 2.0**-10  # tiny blocks
    if a >= 96 and b >= 96:  # a 32 x 32 patch of subnormal inputs: e = -127 along both axes, nonzero elements
        tiny = np.finfo(dtype).smallest_subnormal if dtype == jnp.float16 else 2.0**-133
        x[64:96, 64:96] = rng.integers(-127, 128, (32, 32)) * float(tiny)
    return x.astype(dtype)


@functools.cache
def _interpreted(variant, mode, elem_dtype, config):
    return jax.jit(
        functools.partial(
            PALLAS[variant], mode=mode, elem_dtype=elem_dtype, config=config, interpret=compat.InterpretGPUParams()
        )
    )


# Input shapes per variant: two CTAs along each grid axis at the small tile.
SHAPES = {"dim0": (128, 128), "dim1": (128, 128), "dim01": (128, 128)}


@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", mxf.MODES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_interpret_bit_exact(variant, mode, elem_dtype):
    rng = np.random.default_rng(zlib.crc32(f"{variant}/{mode}/{elem_dtype}".encode()))  # stable across processes
    x = make_input(rng, SHAPES[variant])
    got = _interpreted(variant, mode, elem_dtype, SMALL)(jnp.asarray(x))
    assert_same_bits(got, reference(x, variant, mode, elem_dtype), f"{variant} {mode} {elem_dtype}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_interpret_no_races(variant):
    """The interpreter's race detector: every SMEM write precedes the TMA store that reads it (the kernel runs
    without Pallas' automatic barriers). Moving dim0's TMA store before the cast makes this fail."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # the detector's state is not public API

    x = jnp.asarray(make_input(np.random.default_rng(4), (128, 128)))
    out = PALLAS[variant](x, config=SMALL, interpret=compat.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(out)
    assert gpu_callbacks._races is not None and not gpu_callbacks._races.races_found


@pytest.mark.parametrize(
    "variant,shape,config",
    [
        ("dim0", (64, 256), mq.DEFAULT_CONFIG),  # rows < tile_rows -> not covered; see below
        ("dim0", (128, 256), mq.DEFAULT_CONFIG),
        ("dim1", (256, 128), mq.CastConfig(tile_rows=64, tile_k=128)),
        ("dim01", (128, 192), mq.CastConfig(tile_rows=128, tile_k=64)),
    ],
)
def test_interpret_other_tiles_and_f16(variant, shape, config):
    rng = np.random.default_rng(1)
    for dtype in (jnp.bfloat16, jnp.float16):
        x = make_input(rng, shape, dtype)
        if mq.pallas_cover(shape, dtype, variant=variant, config=config) is not None:
            with pytest.raises(NotImplementedError, match=r"multiple of the input tile"):
                PALLAS[variant](jnp.asarray(x), config=config, interpret=compat.InterpretGPUParams())
            continue
        got = _interpreted(variant, "rceil", E4M3, config)(jnp.asarray(x))
        assert_same_bits(got, reference(x, variant, "rceil"), f"{variant} {config.name} {dtype}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "config", [mq.DEFAULT_CONFIG, SMALL, mq.CastConfig(tile_rows=64, tile_k=256)], ids=lambda c: c.name
)
def test_lowers_for_gpu(variant, config):
    """Mosaic-GPU lowering (layouts, swizzles, transposed loads) runs in Python: check it from CPU."""
    shape = (512, 512)
    for mode, elem, dtype in [("floor", E4M3, jnp.bfloat16), ("even", E5M2, jnp.float16)]:
        f = functools.partial(PALLAS[variant], mode=mode, elem_dtype=elem, config=config)
        text = jax.jit(f).trace(jax.ShapeDtypeStruct(shape, dtype)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, (mode, dtype)  # the kernel, not a fallback


def test_pallas_cover():
    c = mq.DEFAULT_CONFIG
    assert mq.pallas_cover((256, 256), jnp.bfloat16, variant="dim0", config=c) is None
    assert "bfloat16 or float16" in mq.pallas_cover((256, 256), jnp.float32, variant="dim0", config=c)
    assert "multiple of the input tile" in mq.pallas_cover((256, 96), jnp.bfloat16, variant="dim0", config=c)
    assert "multiples of 64" in mq.pallas_cover((256, 256), jnp.bfloat16, config=mq.CastConfig(tile_rows=32))
    assert "shared memory" in mq.pallas_cover((4096, 4096), jnp.bfloat16, config=mq.CastConfig(tile_k=1024))
    with pytest.raises(NotImplementedError, match="mx_quantize_dim1_pallas: x must be bfloat16 or float16"):
        mq.mx_quantize_dim1_pallas(jnp.ones((128, 128), jnp.float32), interpret=compat.InterpretGPUParams())


@pytest.mark.parametrize("variant", VARIANTS)
def test_dispatch_xla_and_reference_under_jit(variant):
    rng = np.random.default_rng(2)
    x = make_input(rng, (96, 64))
    want = reference(x, variant, "even", E5M2)
    for impl in ("xla", "reference", "auto"):  # auto on CPU = xla
        f = jax.jit(functools.partial(getattr(mq, f"mx_quantize_{variant}"), mode="even", elem_dtype=E5M2, impl=impl))
        assert_same_bits(tuple(f(jnp.asarray(x))), want, f"{variant} {impl}")


def test_dispatch_errors():
    x = jnp.ones((64, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="needs a Hopper-or-newer GPU"):
        mq.mx_quantize_dim0(x, impl="pallas")
    with pytest.raises(ValueError, match="impl must be"):
        mq.mx_quantize_dim0(x, impl="triton")
    with pytest.raises(ValueError, match=r"axis 0 of x is blocked and must be a multiple of 32.*\(48, 64\)"):
        mq.mx_quantize_dim1(jnp.ones((48, 64), jnp.bfloat16))  # dim1 blocks run along axis 0
    with pytest.raises(ValueError, match=r"must be 2-D.*\(2, 64, 64\)"):
        mq.mx_quantize_dim0(jnp.ones((2, 64, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="mode must be"):
        mq.mx_quantize_dim01(x, mode="up")
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        mq.mx_quantize_dim0(jnp.ones((64, 64), jnp.int8))


# ----------------------------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", [(8192, 8192), (8192, 14336), (14336, 8192)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gpu_real_shapes_match_xla(variant, shape):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32) * jnp.exp2(
        jax.random.randint(jax.random.key(1), (shape[0] // 32, 1, shape[1] // 32, 1), -30, 30).astype(jnp.float32)
    ).repeat(32, 1).repeat(32, 3).reshape(shape)
    x = x.astype(jnp.bfloat16)
    for mode, elem in [("floor", E4M3), ("rceil", E4M3), ("even", E5M2)]:
        kw = dict(mode=mode, elem_dtype=elem)
        got = jax.jit(functools.partial(getattr(mq, f"mx_quantize_{variant}"), impl="pallas", **kw))(x)
        want = jax.jit(functools.partial(getattr(mq, f"mx_quantize_{variant}"), impl="xla", **kw))(x)
        for g, w in zip(got, want, strict=True):
            u8 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != jnp.uint8 else a
            assert bool(jnp.array_equal(u8(g), u8(w))), (variant, shape, mode, elem)


@pytest.mark.gpu
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", mxf.MODES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_bit_exact_vs_reference(variant, mode, elem_dtype):
    rng = np.random.default_rng(3)
    x = make_input(rng, (1024, 2048))
    x[-64:, -1024:] = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(64, 1024)  # every bf16
    for config in (mq.DEFAULT_CONFIG, SMALL):
        f = getattr(mq, f"mx_quantize_{variant}")
        got = f(jnp.asarray(x), mode=mode, elem_dtype=elem_dtype, impl="pallas", config=config)
        assert_same_bits(got, reference(x, variant, mode, elem_dtype), f"{variant} {mode} {elem_dtype} {config.name}")
