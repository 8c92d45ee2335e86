"""OCP Microscaling (MX) block format: MXFP8 casts to and from blocks of 32 with one E8M0 scale.

Source: OCP Microscaling Formats (MX) Specification v1.0, sections 5.1 (MX block: k elements sharing one scale),
5.3 (E8M0 scale: unbiased exponent in [-127, 127] stored with bias 127, 0xFF = NaN) and 6.3 (conversion: scale from
the block's absolute maximum, elements cast with round-to-nearest-even and saturation).

For the last axis split into blocks of `block` (= k = 32) elements x_1..x_k and an element format with largest normal
exponent emax, largest normal M and m mantissa bits (float8_e4m3fn: 8, 448, 3; float8_e5m2: 15, 57344, 2), with
amax = max_i |x_i|, the shared unbiased exponent e is, by `mode`:

  floor  (the spec, 6.3):   e = floor(log2(amax)) - emax
  rceil  (NVIDIA's):        e = ceil(log2(amax / M))          = the smallest e with amax <= M * 2^e
  even   (TorchAO's EVEN):  amax rounded to m mantissa bits, half away from zero, on its float32 bit pattern
                            (add 1 << (22 - m), clear the 23 mantissa bits), then as floor

then e is clamped to [-127, 127] and stored as the byte e + 127; amax = 0 (and any float32-subnormal amax, whose
exponent lies below -126 - emax) gives e = -127. Each element is x_i / 2^e rounded to nearest-even in the element
format and saturated to +-M: never Inf or NaN for finite input, and -0 stays -0. A block holding a NaN or +-Inf gets
the scale byte 0xFF (E8M0 NaN) and every element the element format's canonical NaN (0x7F for e4m3fn, 0x7E for
e5m2). Dequantization is elements * 2^(scale - 127).

Why floor can saturate and rceil cannot: floor keeps amax's leading power of two, so amax / 2^e lies in
[2^emax, 2^(emax+1)), and the part above M (1.75 * 2^emax for both formats) is clipped to M: a block whose amax
has significand above 1.75 loses up to 12.5% of its largest elements. rceil picks the smallest e with
amax / 2^e <= M, so nothing overflows, at the price of one binade for blocks with significand in (1.75, 2): their
small elements fall one binade deeper towards the subnormals. even moves e up only when amax's significand rounds
to 2 (>= 1.9375 for e4m3, >= 1.875 for e5m2); between 1.75 and that threshold it saturates like floor (clipping
at most 9.7% / 6.7% of amax).

Trade-off chosen (per element, the cast must stay memory bound: an H200 moves ~3 B/element at 4.8 TB/s, leaving
~10 integer/float ops per element): amax is a NaN-propagating max of |x| in x's own dtype; the exponent comes from
amax's float32 exponent field with integer ops, once per block; each element is then one float32 multiply by the
normal power of two 2^-e, exact whenever the product is a normal float32 (a product below 2^-126 rounds to +-0 in
fp8 anyway), and one float32 -> fp8 convert, the only rounding. Two backend effects are handled explicitly:
- XLA:CPU flushes subnormal float32 *inputs* (seen: 1.5 * 2^-137 * 2^127 evaluates to 0 there, not 1.5 * 2^-10).
  They matter only in blocks with e <= -110, so on backends that flush, those elements are redone from the integer
  significand (sig * 2^(-149 - e), exact); XLA:GPU and Mosaic-GPU keep subnormals and skip that fix-up.
- XLA's float32 -> fp8 convert turns out-of-range values into NaN, so the XLA path clips to +-M first; Mosaic-GPU's
  cvt.rn.satfinite saturates by itself. Clipping before or saturating after RNE give the same byte.
NaN elements are written as bytes (an fp8 NaN constant may be re-canonicalised by XLA). The same helpers are the
math of the Pallas cast kernels (`pallas_kernels/mx_quantize.py`), so the XLA and kernel paths agree bit for bit.
`mx_quantize_reference` is an independent float64 NumPy spec of the definitions above, used by the tests.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

MODES = ("floor", "rceil", "even")
Mode = Literal["floor", "rceil", "even"]

E8M0_BIAS = 127
E8M0_NAN = 0xFF


@dataclasses.dataclass(frozen=True, kw_only=True)
class ElemFormat:
    """An MX element format: its exponent/mantissa geometry and the canonical NaN byte."""

    name: str
    emax: int  # exponent of the largest normal
    emin: int  # exponent of the smallest normal
    max_normal: float
    mbits: int
    nan_byte: int


ELEM_FORMATS = {
    jnp.dtype(jnp.float8_e4m3fn): ElemFormat(
        name="float8_e4m3fn", emax=8, emin=-6, max_normal=448.0, mbits=3, nan_byte=0x7F
    ),
    jnp.dtype(jnp.float8_e5m2): ElemFormat(
        name="float8_e5m2", emax=15, emin=-14, max_normal=57344.0, mbits=2, nan_byte=0x7E
    ),
}
INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def elem_format(elem_dtype) -> ElemFormat:
    """The ElemFormat of `elem_dtype`; ValueError for anything but float8_e4m3fn / float8_e5m2."""
    try:
        return ELEM_FORMATS[jnp.dtype(elem_dtype)]
    except (KeyError, TypeError):
        raise ValueError(
            f"elem_dtype must be float8_e4m3fn or float8_e5m2, got {elem_dtype!r}"
        ) from None


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def check_input(name: str, x, block: int, *, fn: str) -> None:
    """Shape/dtype checks shared by the casts: a float input whose last axis splits into blocks."""
    if jnp.dtype(x.dtype) not in INPUT_DTYPES:
        raise TypeError(
            f"{fn}: {name} must be bfloat16, float16 or float32; got {name} of shape {tuple(x.shape)} "
            f"and dtype {x.dtype}"
        )
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"{fn}: block must be a positive int, got {block!r}")
    if x.ndim < 1 or x.shape[-1] % block:
        raise ValueError(
            f"{fn}: the last axis of {name} must be a multiple of block={block}; got {name} of shape "
            f"{tuple(x.shape)} and dtype {x.dtype}"
        )


# ---------------------------------------------------------------------------------------------------------------
# The cast math, in three steps that the jnp path and the Pallas kernels share:
#   amax (per block, in x's dtype) -> block_exponent (per block) -> scale_elements (per element) -> nan_fill.
# ---------------------------------------------------------------------------------------------------------------


def block_amax(x: jax.Array, axis: int = -1) -> jax.Array:
    """max |x| along `axis` in x's dtype; NaN-propagating, so a block holding NaN or Inf gets NaN or Inf.

    A backend that flushes subnormals may return 0 for a block of subnormals: same exponent (-127) either way.
    """
    return jnp.max(jnp.abs(x), axis=axis)


def scale_exponent(amax_bits: jax.Array, *, mode: Mode, fmt: ElemFormat) -> jax.Array:
    """Clamped unbiased block exponent e (int32) from the int32 bits of a finite amax >= 0."""
    if mode == "even":
        # Half away from zero at m mantissa bits; a carry into the exponent field is the round-up to 2^(E+1).
        amax_bits = amax_bits + (1 << (22 - fmt.mbits))
    biased = lax.shift_right_logical(amax_bits, 23)  # exponent field; 0 for 0 and subnormals
    e = biased - (127 + fmt.emax)
    if mode == "rceil":
        # M = 1.75 * 2^emax, so amax <= M * 2^(E - emax) iff amax's significand <= 1.75 (fraction <= 0x600000).
        e = e + ((amax_bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
    # Subnormal or zero amax: biased = 0 puts e below -127 - emax, and the clamp gives the spec's -127.
    return jnp.clip(e, -E8M0_BIAS, E8M0_BIAS)


def block_exponent(amax: jax.Array, *, mode: Mode, fmt: ElemFormat) -> tuple[jax.Array, jax.Array]:
    """(e int32, bad bool) per block from amax (any float dtype; widened exactly to float32)."""
    amax_bits = lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
    return scale_exponent(amax_bits, mode=mode, fmt=fmt), amax_bits >= 0x7F800000


def pow2(k: jax.Array) -> jax.Array:
    """2.0^k in float32 for int32 k in [-126, 127], from the exponent field (no float op)."""
    return lax.bitcast_convert_type((k + 127) << 23, jnp.float32)


def scale_elements(
    x: jax.Array,
    e: jax.Array,
    bcast: Callable[[jax.Array], jax.Array],
    *,
    fmt: ElemFormat,
    elem_dtype,
    subnormal_fixup: bool = True,
    clip: bool = True,
) -> jax.Array:
    """Elements x / 2^e in `elem_dtype` (RNE, saturated to +-M) for a finite block; e (int32) is per block and
    `bcast` broadcasts a per-block array to x's shape (per-block work stays per block).

    x * 2^-e is one float32 multiply by a normal power of two (-e in [-120, 127] for a finite block), exact
    whenever the product is a normal float32; a product below 2^-126 is far below the element format's smallest
    subnormal and rounds to +-0 however the backend treats it. What a flushing backend gets wrong is a subnormal
    *input* (XLA:CPU reads it as 0), which matters only in blocks with e <= -110; `subnormal_fixup` redoes those
    elements from the integer significand: x / 2^e = sig * 2^(-149 - e) with sig < 2^23 exact in float32.
    `clip=False` relies on the convert saturating (Mosaic-GPU's cvt.rn.satfinite); XLA's convert does not.
    """
    xf = x.astype(jnp.float32)
    q = xf * bcast(pow2(-e))
    if subnormal_fixup:
        bits = lax.bitcast_convert_type(xf, jnp.int32)
        mag = bits & 0x7FFFFFFF
        # Below -126 the exact value is < 2^-103, +-0 in either format just as sig * 2^-126 is.
        q_sub = mag.astype(jnp.float32) * bcast(pow2(jnp.maximum(-149 - e, -126)))
        q = jnp.where(mag < 0x800000, jnp.where(bits < 0, -q_sub, q_sub), q)  # sign after the product: -0 kept
    if clip:
        q = jnp.clip(q, -fmt.max_normal, fmt.max_normal)
    return q.astype(elem_dtype)


def nan_masks(bad: jax.Array, *, fmt: ElemFormat) -> tuple[jax.Array, jax.Array]:
    """Per-block uint8 (keep, fill) masks: elements & keep | fill is the element, or the NaN byte in a bad block."""
    # Built in int32 and narrowed: Mosaic-GPU allows only bitwise ops on 8-bit values.
    return jnp.where(bad, 0, 0xFF).astype(jnp.uint8), jnp.where(bad, fmt.nan_byte, 0).astype(jnp.uint8)


def nan_fill(elements: jax.Array, keep: jax.Array, fill: jax.Array) -> jax.Array:
    """Bitwise on the bytes: an fp8 NaN constant may be re-canonicalised by XLA (e5m2 0x7E came back as 0x7F)."""
    elem_bytes = (lax.bitcast_convert_type(elements, jnp.uint8) & keep) | fill
    return lax.bitcast_convert_type(elem_bytes, elements.dtype)


def scale_bytes(e: jax.Array, bad: jax.Array) -> jax.Array:
    """E8M0 scale bytes: e + 127, or 0xFF for a block holding NaN/Inf."""
    return jnp.where(bad, E8M0_NAN, e + E8M0_BIAS).astype(jnp.uint8)


def _backend_flushes_subnormals() -> bool:
    """XLA:CPU flushes float32 subnormals (seen: 1.5 * 2^-137 * 2^127 -> 0); XLA:GPU keeps them (xla_gpu_ftz off)."""
    return jax.default_backend() != "gpu"


def mx_quantize(
    x: jax.Array,
    *,
    block: int = 32,
    mode: Mode = "floor",
    elem_dtype=jnp.float8_e4m3fn,
) -> tuple[jax.Array, jax.Array]:
    """MX cast over the last axis: (elements of x's shape in elem_dtype, uint8 E8M0 scales (..., K // block)).

    `elements * 2**(scales - 127)` approximates x blockwise; see the module docstring for the exact definition.
    Works under jit and on any backend; bit-identical to `mx_quantize_reference`.
    """
    check_input("x", x, block, fn="mx_quantize")
    check_mode(mode)
    fmt = elem_format(elem_dtype)
    blocked = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)  # (..., K/32, 32)
    e, bad = block_exponent(block_amax(blocked), mode=mode, fmt=fmt)  # (..., K/32)
    elements = scale_elements(
        blocked,
        e,
        lambda v: v[..., None],
        fmt=fmt,
        elem_dtype=jnp.dtype(elem_dtype),
        subnormal_fixup=_backend_flushes_subnormals(),
    )
    keep, fill = nan_masks(bad, fmt=fmt)
    elements = nan_fill(elements, keep[..., None], fill[..., None]).reshape(x.shape)
    return elements, scale_bytes(e, bad)


def mx_dequantize(
    elements: jax.Array, scales: jax.Array, *, out_dtype=jnp.float32
) -> jax.Array:
    """elements * 2^(scales - 127) blockwise, computed in float32 and cast once to `out_dtype`.

    Scale 0xFF gives NaN. The product is exact in float32 except where it lands below float32's normal range on
    a backend that flushes subnormals (XLA:CPU), where it becomes +-0.
    """
    elem_format(elements.dtype)
    if scales.dtype != jnp.uint8:
        raise TypeError(f"mx_dequantize: scales must be uint8 E8M0; got shape {scales.shape} dtype {scales.dtype}")
    if (
        elements.ndim < 1
        or scales.shape[:-1] != elements.shape[:-1]
        or scales.shape[-1] == 0
        or elements.shape[-1] % scales.shape[-1]
    ):
        raise ValueError(
            "mx_dequantize: scales must have shape elements.shape[:-1] + (K // block,); got elements of shape "
            f"{elements.shape} and scales of shape {scales.shape}"
        )
    block = elements.shape[-1] // scales.shape[-1]
    e = scales.astype(jnp.int32) - E8M0_BIAS
    # 2^e for e in [-127, 127] as two normal float32 factors (2^-127 alone is subnormal).
    half = e >> 1
    f1 = lax.bitcast_convert_type((half + 127) << 23, jnp.float32)
    f2 = lax.bitcast_convert_type((e - half + 127) << 23, jnp.float32)
    vals = elements.astype(jnp.float32).reshape(*scales.shape, block)
    out = vals * f1[..., None] * f2[..., None]
    out = jnp.where((scales == E8M0_NAN)[..., None], jnp.nan, out)
    return out.reshape(elements.shape).astype(out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# NumPy reference: float64 math on exact values, written from the definitions, not from the bit tricks above.
# ---------------------------------------------------------------------------------------------------------------


def _floor_log2(v: np.ndarray) -> np.ndarray:
    """floor(log2(v)) for finite v > 0, exactly (frexp: v = f * 2^x, f in [0.5, 1))."""
    return np.frexp(v)[1].astype(np.int64) - 1


def _exact_float64(x: np.ndarray) -> np.ndarray:
    """float64 of a bf16/f16/f32 array from its float32 bits, with integer and normal-range float64 ops only.

    A plain astype goes float32 -> float64 through the FPU, which zeroes float32 subnormals when the calling thread
    has denormals-are-zero set: XLA:CPU sets it on the threads that run `jax.pure_callback`.
    """
    bits = x.astype(np.float32).view(np.uint32)  # bf16/f16 -> f32 widening in ml_dtypes / NumPy is bit-level
    biased = ((bits >> 23) & 0xFF).astype(np.int64)
    sig = (bits & 0x7FFFFF).astype(np.int64) + np.where(biased > 0, 1 << 23, 0)
    mag = np.ldexp(sig.astype(np.float64), np.maximum(biased, 1) - 150)
    mag = np.where(biased == 0xFF, np.where(sig == 1 << 23, np.inf, np.nan), mag)
    return np.where(bits >> 31 == 1, -mag, mag)


def _round_to_elem(q: np.ndarray, fmt: ElemFormat) -> np.ndarray:
    """Round float64 q to the nearest-even value of the element format, saturating to +-M (float64 result)."""
    q = np.clip(q, -fmt.max_normal, fmt.max_normal)
    with np.errstate(divide="ignore"):
        exp = np.where(q != 0, _floor_log2(np.where(q != 0, np.abs(q), 1.0)), fmt.emin)
    ulp = np.ldexp(1.0, np.maximum(exp, fmt.emin) - fmt.mbits)  # subnormal ulp below 2^emin
    # q / ulp is exact (power of two); np.round is half-to-even; the rounded value never exceeds M (representable).
    return np.round(q / ulp) * ulp


def mx_quantize_reference(
    x, *, block: int = 32, mode: Mode = "floor", elem_dtype=jnp.float8_e4m3fn
) -> tuple[np.ndarray, np.ndarray]:
    """The MX cast in float64 NumPy from the spec's definitions: (elements as ml_dtypes array, uint8 scales)."""
    x = np.asarray(x)
    check_input("x", x, block, fn="mx_quantize_reference")
    check_mode(mode)
    fmt = elem_format(elem_dtype)
    x64 = _exact_float64(x)
    blocks = x64.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    with np.errstate(invalid="ignore"):
        amax = np.max(np.abs(blocks), axis=-1)  # NaN propagates
    bad = ~np.isfinite(amax)
    pos = np.isfinite(amax) & (amax > 0)
    a = np.where(pos, amax, 1.0)
    if mode == "floor":
        e = _floor_log2(a) - fmt.emax
    elif mode == "rceil":
        # smallest integer e with amax <= M * 2^e; ldexp is exact, so the comparisons are exact.
        e = _floor_log2(a) - fmt.emax - 1
        for _ in range(3):
            e = np.where(a > np.ldexp(fmt.max_normal, e), e + 1, e)
        assert np.all(a <= np.ldexp(fmt.max_normal, e)) and np.all(a > np.ldexp(fmt.max_normal, e - 1))
    else:  # even
        sig = np.ldexp(a, -_floor_log2(a))  # in [1, 2)
        sig_r = np.floor(sig * 2.0**fmt.mbits + 0.5) / 2.0**fmt.mbits  # half away from zero (sig > 0)
        e = _floor_log2(np.ldexp(sig_r, _floor_log2(a))) - fmt.emax
    e = np.where(pos, e, -E8M0_BIAS)
    e = np.clip(e, -E8M0_BIAS, E8M0_BIAS)
    q = np.ldexp(blocks, -e[..., None])  # exact in float64: |x| in [2^-149, 2^128), e in [-127, 127]
    with np.errstate(invalid="ignore"):
        r = _round_to_elem(np.where(bad[..., None], 0.0, q), fmt)
    elements = r.astype(jnp.dtype(elem_dtype))  # exact: r is representable
    elements = np.where(bad[..., None], np.uint8(fmt.nan_byte).view(elements.dtype), elements)
    scales = np.where(bad, E8M0_NAN, e + E8M0_BIAS).astype(np.uint8)
    return elements.reshape(x.shape), scales


def mx_dequantize_reference(elements, scales, *, out_dtype=np.float32) -> np.ndarray:
    """float64 elements * 2^(scale - 127), NaN for scale 0xFF, cast once to out_dtype."""
    elements = np.asarray(elements)
    scales = np.asarray(scales)
    block = elements.shape[-1] // scales.shape[-1]
    vals = elements.astype(np.float64).reshape(*scales.shape, block)
    out = np.ldexp(vals, scales.astype(np.int64)[..., None] - E8M0_BIAS)
    out = np.where((scales == E8M0_NAN)[..., None], np.nan, out)
    return out.reshape(elements.shape).astype(out_dtype)
