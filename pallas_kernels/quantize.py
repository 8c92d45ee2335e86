"""Dynamic fp8 quantization: amax -> scale -> saturating cast, rowwise or tensorwise, optionally transposed.

For a high-precision x and an fp8 dtype with largest finite value F (e4m3fn 448, e5m2 57344), along `axis`:

    amax  = max |x|                                   (over `axis` for "rowwise", over everything for "tensorwise")
    q     = F / max(amax, 1e-12)                      quantization multiplier (TorchAO's `scale`, amax_to_scale)
    q     = 2 ** floor(log2 q)                        if pow2_scale (TorchAO round_scales_to_power_of_2)
    x_fp8 = cast(clip(x * q, -F, F))                  saturating: e4m3fn has no inf, an unclipped cast gives NaN
    scale = 1 / q                                     the DEQUANTIZATION multiplier returned: x ≈ x_fp8 * scale

Rounding q down to a power of two is rounding the returned scale UP, so |x / scale| <= F always holds, and the
multiply by q is exact (no extra rounding before the cast). A zero row gets amax = 1e-12, a finite q and x_fp8 = 0.
Source: TorchAO torchao/float8/float8_utils.py (amax_to_scale, EPS = 1e-12, to_fp8_saturated,
_round_scale_down_to_power_of_2); the scale is used as the reciprocal passed to torch._scaled_mm.

Layouts. An fp8 GEMM operand must be K-major (the contraction axis last). `quantize` keeps x's layout;
`quantize_t` scales a 2-D x along axis 0 and writes the transposed (C, R) copy the backward GEMMs need;
`quantize_dual` produces both (rowwise along axis 1 as (R, C), rowwise along axis 0 as (C, R)) from the same reads
of x, which is what the rowwise recipe needs for every tensor (x, w and the output gradient). It also takes a batch
of matrices (B, R, C), each entry scaled on its own: the MoE experts' weights (E, K, N), whose forward GEMM wants
(E, N, K) scaled per (e, n) and whose grad-input GEMM wants (E, K, N) scaled per (e, k). And it takes a fused
weight as its parts (w_q, w_k, w_v), reading each tile from the part that holds it, so that the concatenation is
never written.

Implementations. The jnp reference is also the "xla" path: XLA fuses it (an amax reduction fusion, then a cast
fusion with the transpose folded in). The Pallas kernels (Mosaic-GPU, one CTA per tile) take a 2-D x (or a batch
of them) whose dims are multiples of the tiles: pass 1 reads each (64, 128) tile once and max-reduces it into per-row and per-column amax
partials (a tiny XLA max finishes them; the column maxima are taken as row maxima of the transposed SMEM view, see
`_amax_kernel`); pass 2 reads each tile again and writes the fp8 tile and/or its transpose,
the transposed tile read through a transposed SMEM view (which Mosaic-GPU lowers for 16-bit x only). Bytes per
element of x, bf16 in: dual cast XLA 2+2 (two amax reductions) + 2+1 + 2+1 (two casts) = 10, Pallas 2 + 2+1+1 = 6;
transposed cast 5 vs 5 (the win, if any, is the transpose's access pattern); a cast along the last axis 5 vs 5,
or 3 for XLA if it fuses the row reduction into the cast. One pass is not possible for a scale along axis 0 (or
a tensorwise one): a column's amax needs all R rows before any of its elements can be cast, and a (R, 128) bf16
column band (2 MiB at R = 8192) does not fit in SMEM; a one-pass kernel along the last axis (a band of whole rows
in SMEM) is the follow-up if XLA's row cast proves slow. The trade-off is two kernel launches and an f32 partial
buffer. AUTO_PALLAS records which variants "auto" sends to the kernels; `python -m pallas_kernels.bench fp8`
measures them against XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mx_jax import compat
from pallas_kernels import device

AMAX_EPS = 1e-12  # TorchAO's EPS: keeps q finite for an all-zero row
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
Scaling = Literal["rowwise", "tensorwise"]
Impl = Literal["auto", "pallas", "xla", "reference"]


def fp8_max(dtype) -> float:
    """Largest finite value of an fp8 dtype: 448 (e4m3fn), 57344 (e5m2)."""
    return float(jnp.finfo(dtype).max)


def amax_to_scales(amax: jax.Array, dtype, pow2_scale: bool) -> tuple[jax.Array, jax.Array]:
    """(q, scale): the f32 quantization multiplier and the dequantization multiplier 1/q."""
    amax = jnp.maximum(amax.astype(jnp.float32), AMAX_EPS)
    q = jnp.float32(fp8_max(dtype)) / amax
    if pow2_scale:
        # frexp: q = m * 2**e with m in [0.5, 1) -> floor(log2 q) = e - 1, exact (log2/exp2 need not be).
        _, e = jnp.frexp(q)
        q = jnp.ldexp(jnp.ones_like(q), e - 1)
    return q, 1.0 / q


def rounded(x: jax.Array, dtype) -> jax.Array:
    """x rounded to a narrower float dtype (x.astype(dtype)), spelled so that XLA keeps the rounding: on GPU its
    excess-precision rewrite removes a convert round trip (f32 -> bf16 -> f32) and would quantize the f32 values
    instead (about 4% of e4m3 values one step apart, from double rounding at bf16 ties). reduce_precision stays."""
    if jnp.finfo(x.dtype).bits > jnp.finfo(dtype).bits:
        fi = jnp.finfo(dtype)
        x = lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    return x.astype(dtype)


def _cast(x: jax.Array, q: jax.Array, dtype) -> jax.Array:
    f = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * q, -f, f).astype(dtype)


def _check(x, axis, dtype, scaling, name):
    if jnp.dtype(dtype) not in FP8_DTYPES:
        raise ValueError(f"{name}: `dtype` must be float8_e4m3fn or float8_e5m2, got {dtype}")
    if scaling not in ("rowwise", "tensorwise"):
        raise ValueError(f"{name}: `scaling` must be 'rowwise' or 'tensorwise', got {scaling!r}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype) in FP8_DTYPES:
        raise ValueError(f"{name}: `x` must be a bf16/f16/f32 array, got shape {x.shape} dtype {x.dtype}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{name}: `axis` {axis} out of range for x of shape {x.shape}")


# --------------------------------------------------------------------------------------------------------------
# References (pure jnp; also the "xla" path, which XLA fuses).
# --------------------------------------------------------------------------------------------------------------
def quantize_reference(
    x: jax.Array, *, axis: int, dtype, scaling: Scaling = "rowwise", pow2_scale: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(x_fp8 shaped like x, scale): scale has x.shape without `axis` (rowwise) or shape () (tensorwise)."""
    amax = jnp.max(jnp.abs(x), axis=axis if scaling == "rowwise" else None)
    q, scale = amax_to_scales(amax, dtype, pow2_scale)
    qb = jnp.expand_dims(q, axis) if scaling == "rowwise" else q
    return _cast(x, qb, dtype), scale


def quantize_t_reference(
    x: jax.Array, *, dtype, scaling: Scaling = "rowwise", pow2_scale: bool = False
) -> tuple[jax.Array, jax.Array]:
    """x (R, C) scaled along axis 0, written transposed: (x_fp8ᵀ (C, R), scale (C,) or ())."""
    x_fp8, scale = quantize_reference(x, axis=0, dtype=dtype, scaling=scaling, pow2_scale=pow2_scale)
    return x_fp8.T, scale


def quantize_dual_reference(
    x: jax.Array, *, dtype, scaling: Scaling = "rowwise", pow2_scale: bool = False
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """x (R, C) -> ((x_fp8 (R, C) along axis 1, scale (R,)), (x_fp8ᵀ (C, R) along axis 0, scale (C,))).

    A batch x (B, R, C), rowwise only: the same for each entry, ((B, R, C), (B, R)), ((B, C, R), (B, C)).
    Tensorwise: one amax; the second pair is the transpose of the first with the same scalar scale.
    """
    if scaling == "tensorwise":
        x_fp8, scale = quantize_reference(x, axis=0, dtype=dtype, scaling="tensorwise", pow2_scale=pow2_scale)
        return (x_fp8, scale), (x_fp8.T, scale)
    rows = quantize_reference(x, axis=-1, dtype=dtype, pow2_scale=pow2_scale)
    cols_fp8, cols_scale = quantize_reference(x, axis=-2, dtype=dtype, pow2_scale=pow2_scale)
    return rows, (jnp.swapaxes(cols_fp8, -1, -2), cols_scale)


# --------------------------------------------------------------------------------------------------------------
# Mosaic-GPU kernels: pass 1 (amax partials) and pass 2 (scaled casts, plain and transposed).
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class CastConfig:
    """Tiles of the two passes. One CTA per tile; many CTAs per SM hide the TMA latency."""

    amax_bm: int = 64  # pass-1 tile rows (a WGMMA-layout register tile: multiple of 64)
    amax_bn: int = 128  # pass-1 tile cols
    cast_bm: int = 64  # pass-2 tile rows (the transposed output's columns); multiple of 64
    cast_bn: int = 128  # pass-2 tile cols (the transposed output's rows); multiple of 64


DEFAULT_CAST_CONFIG = CastConfig()
_HP_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _smem_transforms(cols: int, dtype) -> tuple:
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(cols * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _compiler_params():
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _staged(x_smem, stage_smem: list):
    """The tile to read: x_smem itself, or (an f32 tile with a 16-bit `round_to`) its rounded copy, written to the
    16-bit staging tile and made visible to the whole warpgroup (commit_smem ends in a warpgroup barrier)."""
    if not stage_smem:
        return x_smem
    (stage,) = stage_smem
    stage[...] = x_smem[...].astype(stage.dtype)
    plgpu.commit_smem()
    return stage


def _stage_scratch(x_dtype, round_to, shape) -> list:
    if round_to is None or jnp.dtype(round_to) == jnp.dtype(x_dtype):
        return []
    return [plgpu.SMEM(shape, round_to, transforms=_smem_transforms(shape[1], round_to))]


def _copy_tile(x_gmems, col_tiles: tuple[int, ...], b, rows, j, bn: int, dst, barrier) -> None:
    """Start the TMA copy of column tile j of concatenate(x_gmems, axis=-1)[b, rows] into dst: from the part that
    holds it (part p holds col_tiles[p] tiles of bn columns), so the concatenation is never written."""
    if len(x_gmems) == 1:
        plgpu.copy_gmem_to_smem(x_gmems[0].at[b, rows, pl.ds(j * bn, bn)], dst, barrier)
        return
    start = 0
    for x_gmem, n in zip(x_gmems, col_tiles):
        @pl.when((j >= start) & (j < start + n))
        def _(x_gmem=x_gmem, start=start):
            plgpu.copy_gmem_to_smem(x_gmem.at[b, rows, pl.ds((j - start) * bn, bn)], dst, barrier)

        start += n


def _amax_kernel(*refs, n_x: int, col_tiles: tuple[int, ...], want_rows: bool, want_cols: bool, bm: int, bn: int):
    """One (bm, bn) tile of |x[b]|: its row maxima -> rows_part[b, j, i*bm:(i+1)*bm], column maxima ->
    cols_part[b, i, j*bn:(j+1)*bn]. x is the concatenation of the first n_x refs along their last axis.

    The column maxima are the row maxima of the tile read through its transposed SMEM view (16-bit x, which every
    transposed cast needs anyway): a row of the register tile lives in one warp's quad, so its max is a few
    shuffles, where a column max crosses the four warps of the warpgroup. Reducing along axis 0 directly ran this
    pass at ~1.6 TB/s, under half the cast pass's ~3.7 (RESULTS.md, seventh pass).
    """
    x_gmems, refs = refs[:n_x], refs[n_x:]
    outs = list(refs[: want_rows + want_cols])
    x_smem, rows_smem, cols_smem, barrier, *stage_smem = refs[want_rows + want_cols :]
    i, j, b = lax.axis_index("i"), lax.axis_index("j"), lax.axis_index("b")
    _copy_tile(x_gmems, col_tiles, b, pl.ds(i * bm, bm), j, bn, x_smem, barrier)
    plgpu.barrier_wait(barrier)
    x_smem = _staged(x_smem, stage_smem)
    if want_rows:
        rows_smem[...] = jnp.max(jnp.abs(x_smem[...].astype(jnp.float32)), axis=1)  # (bm,)
    if want_cols:
        cols_smem[...] = jnp.max(jnp.abs(x_smem.T[...].astype(jnp.float32)), axis=1)  # (bn,)
    plgpu.commit_smem()
    if want_rows:
        plgpu.copy_smem_to_gmem(rows_smem, outs.pop(0).at[b, j, pl.ds(i * bm, bm)])
    if want_cols:
        plgpu.copy_smem_to_gmem(cols_smem, outs.pop(0).at[b, i, pl.ds(j * bn, bn)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _parts(x) -> tuple[tuple[jax.Array, ...], tuple[int, ...]]:
    """x: one array, or a tuple of the parts of one along its last axis -> (the parts, the whole's shape)."""
    xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    return xs, (*xs[0].shape[:-1], sum(p.shape[-1] for p in xs))


def _amax_pallas(x, *, want_rows: bool, want_cols: bool, config: CastConfig, interpret, round_to=None):
    """x (B, R, C) -> row amax (B, R) and/or column amax (B, C), f32: per-tile partials in Pallas, a tiny max in
    XLA. Each batch entry is its own matrix (an expert's weight): a column's amax never crosses entries. With
    `round_to` (16-bit, x f32), the maxima of x rounded to it. x may be a tuple of parts (`_parts`), each a
    multiple of amax_bn wide: the maxima of their concatenation."""
    xs, (nb, r, c) = _parts(x)
    x = xs[0]
    bm, bn = config.amax_bm, config.amax_bn
    out_type = []
    if want_rows:
        out_type.append(jax.ShapeDtypeStruct((nb, c // bn, r), jnp.float32))
    if want_cols:
        out_type.append(jax.ShapeDtypeStruct((nb, r // bm, c), jnp.float32))
    partials = plgpu.kernel(
        functools.partial(_amax_kernel, n_x=len(xs), col_tiles=tuple(p.shape[-1] // bn for p in xs),
                          want_rows=want_rows, want_cols=want_cols, bm=bm, bn=bn),
        out_type=tuple(out_type),
        scratch_types=[
            plgpu.SMEM((bm, bn), x.dtype, transforms=_smem_transforms(bn, x.dtype)),
            plgpu.SMEM((bm,), jnp.float32),
            plgpu.SMEM((bn,), jnp.float32),
            plgpu.Barrier(),
            *_stage_scratch(x.dtype, round_to, (bm, bn)),
        ],
        grid=(r // bm, c // bn, nb),
        grid_names=("i", "j", "b"),
        compiler_params=_compiler_params(),
        interpret=interpret,
        kernel_name="quantize_amax",
    )(*xs)
    return tuple(jnp.max(p, axis=1) for p in partials)


def _cast_kernel(*refs, n_x: int, col_tiles: tuple[int, ...], want_rows: bool, want_cols: bool, bm: int, bn: int,
                 dtype, tiled_src: bool):
    """One (bm, bn) tile of x[b]: rows output x*q_row cast (bm, bn) at [b, i, j]; cols output (x*q_col)ᵀ (bn, bm)
    at [b, j, i]. x is the concatenation of the first n_x refs along their last axis. With `tiled_src` the tile's
    rows are x[b, src[i]*bm : (src[i]+1)*bm] instead of row tile i."""
    x_gmems, refs = refs[:n_x], refs[n_x:]
    n_in, n_out = want_rows + want_cols + tiled_src, want_rows + want_cols
    q_refs, out_refs = list(refs[:n_in]), list(refs[n_in : n_in + n_out])
    x_smem, q_row_smem, q_col_smem, o_smem, ot_smem, barrier, *stage_smem = refs[n_in + n_out :]
    i, j, b = lax.axis_index("i"), lax.axis_index("j"), lax.axis_index("b")
    f = fp8_max(dtype)
    row0 = q_refs.pop()[i] * bm if tiled_src else i * bm  # a multiple of bm that Mosaic's TMA lowering can see
    _copy_tile(x_gmems, col_tiles, b, pl.ds(row0, bm), j, bn, x_smem, barrier)
    if want_rows:
        plgpu.copy_gmem_to_smem(q_refs.pop(0).at[b, pl.ds(i * bm, bm)], q_row_smem, barrier)
    if want_cols:
        q_col = q_refs.pop(0)  # (B, C), or (B, R // bm, C): one set of column multipliers per row tile
        q_col = q_col.at[b, pl.ds(j * bn, bn)] if len(q_col.shape) == 2 else q_col.at[b, i, pl.ds(j * bn, bn)]
        plgpu.copy_gmem_to_smem(q_col, q_col_smem, barrier)
    plgpu.barrier_wait(barrier)
    x_smem = _staged(x_smem, stage_smem)
    if want_rows:
        x = x_smem[...].astype(jnp.float32)  # (bm, bn)
        y = x * lax.broadcast_in_dim(q_row_smem[...], x.shape, [0])
        o_smem[...] = jnp.clip(y, -f, f).astype(dtype)
    if want_cols:
        xt = x_smem.T[...].astype(jnp.float32)  # (bn, bm): the tile transposed, read through a transposed view
        yt = xt * lax.broadcast_in_dim(q_col_smem[...], xt.shape, [0])
        ot_smem[...] = jnp.clip(yt, -f, f).astype(dtype)
    plgpu.commit_smem()
    if want_rows:
        plgpu.copy_smem_to_gmem(o_smem, out_refs.pop(0).at[b, pl.ds(i * bm, bm), pl.ds(j * bn, bn)])
    if want_cols:
        plgpu.copy_smem_to_gmem(ot_smem, out_refs.pop(0).at[b, pl.ds(j * bn, bn), pl.ds(i * bm, bm)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _cast_pallas(x, q_row, q_col, *, dtype, config: CastConfig, interpret, round_to=None, src_tiles=None):
    """x (R, C) or (B, R, C); q_row (R,) | (B, R) | None; q_col (C,) | (B, C), or per row tile (R // cast_bm, C) |
    (B, R // cast_bm, C), | None -> [x*q_row as (R, C) fp8], [(x*q_col)ᵀ as (C, R) fp8] (each with the leading B
    of a 3-D x): a per-row-tile q_col gives each tile of cast_bm rows its own column multipliers. With `round_to`
    (16-bit, x f32) x is rounded to it in SMEM first. `src_tiles` (T,) int32 (cols output of a 2-D x only): output
    row tile i is read from x's row tile src_tiles[i], so the (C, T cast_bm) output can reorder and repeat x's row
    tiles (q_col then has one row per output tile). x may be a tuple of parts (`_parts`, each 2-D or each 3-D
    and a multiple of cast_bn wide): the casts of their concatenation along the last axis."""
    xs, shape = _parts(x)
    batched = len(shape) == 3
    if not batched:
        xs = tuple(p[None] for p in xs)
        q_row, q_col = (None if q is None else q[None] for q in (q_row, q_col))
    nb, r, c = shape if batched else (1, *shape)
    x = xs[0]
    bm, bn = config.cast_bm, config.cast_bn
    want_rows, want_cols = q_row is not None, q_col is not None
    tiled_src = src_tiles is not None
    if tiled_src:
        assert not want_rows and nb == 1, "src_tiles reorders the transposed output of one matrix only"
        r, src_tiles = src_tiles.shape[0] * bm, src_tiles.astype(jnp.int32)
    out_type = []
    if want_rows:
        out_type.append(jax.ShapeDtypeStruct((nb, r, c), dtype))
    if want_cols:
        out_type.append(jax.ShapeDtypeStruct((nb, c, r), dtype))
    outs = plgpu.kernel(
        functools.partial(
            _cast_kernel, n_x=len(xs), col_tiles=tuple(p.shape[-1] // bn for p in xs), want_rows=want_rows,
            want_cols=want_cols, bm=bm, bn=bn, dtype=jnp.dtype(dtype), tiled_src=tiled_src,
        ),
        out_type=tuple(out_type),
        scratch_types=[
            plgpu.SMEM((bm, bn), x.dtype, transforms=_smem_transforms(bn, x.dtype)),
            plgpu.SMEM((bm,), jnp.float32),
            plgpu.SMEM((bn,), jnp.float32),
            plgpu.SMEM((bm, bn), dtype, transforms=_smem_transforms(bn, dtype)),
            plgpu.SMEM((bn, bm), dtype, transforms=_smem_transforms(bm, dtype)),
            plgpu.Barrier(num_arrivals=1 + want_rows + want_cols),
            *_stage_scratch(x.dtype, round_to, (bm, bn)),
        ],
        grid=(r // bm, c // bn, nb),
        grid_names=("i", "j", "b"),
        compiler_params=_compiler_params(),
        interpret=interpret,
        kernel_name="quantize_cast",
    )(*xs, *[q for q in (q_row, q_col, src_tiles) if q is not None])
    return tuple(outs) if batched else tuple(o[0] for o in outs)


def pallas_cover(
    shape: tuple[int, ...], x_dtype, *, transposed: bool, config: CastConfig = DEFAULT_CAST_CONFIG, round_to=None,
    interpret=None, parts: tuple[int, ...] = (),
) -> str | None:
    """None when the Pallas cast kernels take an x (R, C) or a batch of them (B, R, C) of this shape and dtype,
    else the reason.

    `transposed`: a (C, R) output is wanted; it is read through a transposed SMEM view, which Mosaic-GPU lowers
    for 16-bit tiles only (an f32 tile fails layout inference on jax 0.11.2), so an f32 x needs a 16-bit
    `round_to`: the kernels then round each tile into a 16-bit SMEM copy and read that. jax 0.10.2 lowers no
    transposed view for the GPU (`compat.MGPU_TRANSPOSED_CAST`); its interpreter runs them (`interpret`, or
    `compat.force_gpu_interpret_mode`).
    `parts`: the widths of the arrays whose concatenation along the last axis is x (`quantize_dual`), if several.
    """
    if len(shape) not in (2, 3):
        return f"x must be 2-D or 3-D, got shape {shape}"
    if jnp.dtype(x_dtype) not in _HP_DTYPES:
        return f"x must be bf16, f16 or f32, got {jnp.dtype(x_dtype)}"
    if round_to is not None and jnp.dtype(round_to) not in _HP_DTYPES[:2]:
        return f"round_to must be bf16 or f16, got {jnp.dtype(round_to)}"
    if transposed and jnp.dtype(x_dtype).itemsize != 2 and round_to is None:
        return f"a transposed output needs a 16-bit x (or a 16-bit round_to), got {jnp.dtype(x_dtype)}"
    tile_r, tile_c = math.lcm(config.amax_bm, config.cast_bm), math.lcm(config.amax_bn, config.cast_bn)
    if shape[-2] % tile_r or shape[-1] % tile_c:
        return f"x shape {shape} must be a multiple of ({tile_r}, {tile_c}) in its last two dims"
    if any(w % tile_c for w in parts):
        return f"each concatenated part must be a multiple of {tile_c} wide, got widths {parts}"
    lowered = interpret is None and not compat.gpu_interpret_forced()
    if transposed and lowered and not compat.MGPU_TRANSPOSED_CAST:
        return f"the transposed cast lowers for the GPU with jax >= 0.11 only (this is jax {jax.__version__})"
    return None


@device.lowered_once(('rows', 'cols', 'dtype', 'scaling', 'pow2_scale', 'config', 'interpret', 'round_to'))
def _pallas_quantize(x, *, rows: bool, cols: bool, dtype, scaling, pow2_scale, config, interpret, round_to=None):
    """Both passes. Returns [(x_fp8 (R, C), scale)] for rows and/or [(x_fp8ᵀ (C, R), scale)] for cols; for a
    batch x (B, R, C) (rowwise only) each entry is its own matrix: (B, R, C) with (B, R), (B, C, R) with (B, C).
    With `round_to`, of x rounded to that 16-bit dtype (in SMEM, no rounded copy of x in HBM). x may be a tuple of
    arrays: the parts of x along its last axis, never concatenated in HBM (`quantize_dual`)."""
    xs, shape = _parts(x)
    widths = tuple(p.shape[-1] for p in xs)
    reason = pallas_cover(shape, xs[0].dtype, transposed=cols, config=config, round_to=round_to,
                          interpret=interpret, parts=widths if len(xs) > 1 else ())
    if reason is not None:
        raise NotImplementedError(f"quantize (pallas): {reason}")
    rt = dict(round_to=round_to)
    batched = len(shape) == 3
    x = xs if batched else tuple(p[None] for p in xs)
    r, c = shape[-2:]
    if scaling == "tensorwise":
        assert not batched, "tensorwise scaling of a batch has no per-entry meaning; flatten it"
        (row_amax,) = _amax_pallas(x, want_rows=True, want_cols=False, config=config, interpret=interpret, **rt)
        q, scale = amax_to_scales(jnp.max(row_amax), dtype, pow2_scale)
        q_row = jnp.broadcast_to(q, (1, r)) if rows else None
        q_col = jnp.broadcast_to(q, (1, c)) if cols else None
        outs = _cast_pallas(x, q_row, q_col, dtype=dtype, config=config, interpret=interpret, **rt)
        return [(o[0], scale) for o in outs]
    amaxes = list(_amax_pallas(x, want_rows=rows, want_cols=cols, config=config, interpret=interpret, **rt))
    q_row = s_row = q_col = s_col = None
    if rows:
        q_row, s_row = amax_to_scales(amaxes.pop(0), dtype, pow2_scale)
    if cols:
        q_col, s_col = amax_to_scales(amaxes.pop(0), dtype, pow2_scale)
    outs = list(_cast_pallas(x, q_row, q_col, dtype=dtype, config=config, interpret=interpret, **rt))
    result = []
    if rows:
        result.append((outs.pop(0), s_row))
    if cols:
        result.append((outs.pop(0), s_col))
    return result if batched else [(o[0], s[0]) for o, s in result]


# --------------------------------------------------------------------------------------------------------------
# Dispatchers.
# --------------------------------------------------------------------------------------------------------------
# impl="auto" on Hopper: which variants run the Pallas kernels (when covered). From the bench's cast section
# (`python -m pallas_kernels.bench fp8`): "rows" = quantize along the last axis, "cols_t" = quantize_t,
# "dual" = quantize_dual. XLA can fuse the single-axis rowwise cast into one pass; the transposed and dual casts
# are where one read of x saves the most.
# H200, 2026-11-21, bf16 (8192, 4096) / (8192, 14336): rows 1544 / 1941 GB/s vs XLA 1335 / 1676; cols_t 1351 / 1345
# vs XLA 1390 / 1667; dual 1229 / 1712 vs XLA 980 / 1224 (benchmarks/RESULTS.md). Seventh pass, with the amax pass's
# column maxima taken through the transposed view: dual at (8192, 14336) 2,226-2,281 GB/s vs XLA 1,211-1,271.
AUTO_PALLAS = {"rows": True, "cols_t": False, "dual": True}


def _use_pallas(variant: str, impl: Impl, shape, x_dtype, config: CastConfig, round_to=None, parts=()) -> bool:
    if impl == "pallas":
        return True
    if impl != "auto" or not AUTO_PALLAS[variant]:
        return False
    if not device.kernels_apply():
        return False
    return pallas_cover(shape, x_dtype, transposed=variant != "rows", config=config, round_to=round_to,
                        parts=parts) is None


def quantize(
    x: jax.Array,
    *,
    axis: int,
    dtype,
    scaling: Scaling = "rowwise",
    pow2_scale: bool = False,
    impl: Impl = "auto",
    config: CastConfig = DEFAULT_CAST_CONFIG,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:
    """(x_fp8 shaped like x, scale): rowwise scale has x.shape without `axis`; tensorwise scale is ().

    impl "pallas" covers the last axis of an x whose flattened (rows, K) view `pallas_cover` accepts
    (NotImplementedError otherwise); "auto" uses it on Hopper where AUTO_PALLAS["rows"] says so, else XLA.
    """
    _check(x, axis, dtype, scaling, "quantize")
    axis = axis % x.ndim
    if impl not in ("auto", "pallas", "xla", "reference"):
        raise ValueError(f"quantize: impl must be 'auto', 'pallas', 'xla' or 'reference', got {impl!r}")
    flat = (math.prod(x.shape[:-1]), x.shape[-1])
    last = axis == x.ndim - 1 or scaling == "tensorwise"
    if impl == "pallas" and not last:
        raise NotImplementedError("quantize (pallas): rowwise scaling only along the last axis (use quantize_t)")
    if last and _use_pallas("rows", impl, flat, x.dtype, config):
        [(x_fp8, scale)] = _pallas_quantize(
            x.reshape(flat), rows=True, cols=False, dtype=dtype, scaling=scaling, pow2_scale=pow2_scale,
            config=config, interpret=interpret,
        )
        return x_fp8.reshape(x.shape), scale.reshape(x.shape[:-1]) if scaling == "rowwise" else scale
    return quantize_reference(x, axis=axis, dtype=dtype, scaling=scaling, pow2_scale=pow2_scale)


def quantize_t(
    x: jax.Array,
    *,
    dtype,
    scaling: Scaling = "rowwise",
    pow2_scale: bool = False,
    impl: Impl = "auto",
    config: CastConfig = DEFAULT_CAST_CONFIG,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:
    """x (R, C) scaled along axis 0 and written transposed: (x_fp8ᵀ (C, R), scale (C,) or ())."""
    if x.ndim != 2:
        raise ValueError(f"quantize_t: `x` must be 2-D, got shape {x.shape} dtype {x.dtype}")
    _check(x, 0, dtype, scaling, "quantize_t")
    if _use_pallas("cols_t", impl, x.shape, x.dtype, config):
        [(xt, scale)] = _pallas_quantize(
            x, rows=False, cols=True, dtype=dtype, scaling=scaling, pow2_scale=pow2_scale, config=config,
            interpret=interpret,
        )
        return xt, scale
    return quantize_t_reference(x, dtype=dtype, scaling=scaling, pow2_scale=pow2_scale)


def quantize_dual(
    x: jax.Array | tuple[jax.Array, ...],
    *,
    dtype,
    scaling: Scaling = "rowwise",
    pow2_scale: bool = False,
    impl: Impl = "auto",
    config: CastConfig = DEFAULT_CAST_CONFIG,
    interpret=None,
    round_to=None,
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """x (R, C) -> ((x_fp8 (R, C) along axis 1, scale), (x_fp8ᵀ (C, R) along axis 0, scale)) from one read of x.

    x may be a batch of matrices (B, R, C) (the experts' weights), rowwise only: each entry is quantized on its
    own, ((B, R, C), (B, R)), ((B, C, R), (B, C)). `round_to` (bf16 or f16): quantize `rounded(x, round_to)`,
    the compute copy of an f32 master weight, bit for bit; the kernels round each f32 tile in SMEM, so the copy
    is never written to HBM (per element 4 + 4+1+1 bytes instead of 4+2 for the copy, then 2 + 2+1+1).

    x may be a tuple of arrays sharing every axis but the last (a fused weight's parts, e.g. w_gate and w_up):
    the result is that of their concatenation along the last axis, which the kernels never write (each tile is
    read from the part that holds it; the parts must then be multiples of the 128-column tiles), where
    `jnp.concatenate` would write and read again 2 + 2 bytes per element, or 4 + 2 + 2 from f32 masters."""
    parts = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    if not parts or len({(p.shape[:-1], jnp.dtype(p.dtype)) for p in parts}) != 1:
        raise ValueError(f"quantize_dual: the parts of x must share every axis but the last and their dtype, got "
                         f"{[(p.shape, str(p.dtype)) for p in parts]}")
    shape = (*parts[0].shape[:-1], sum(p.shape[-1] for p in parts))
    if len(shape) not in (2, 3) or (len(shape) == 3 and scaling != "rowwise"):
        raise ValueError(
            f"quantize_dual: `x` must be 2-D, or 3-D with rowwise scaling, got shape {shape} dtype {parts[0].dtype} "
            f"with scaling={scaling!r}"
        )
    _check(parts[0], 0, dtype, scaling, "quantize_dual")
    if round_to is not None and jnp.dtype(parts[0].dtype).itemsize <= jnp.dtype(round_to).itemsize:
        parts, round_to = tuple(p.astype(round_to) for p in parts), None  # nothing to round away
    widths = tuple(p.shape[-1] for p in parts) if len(parts) > 1 else ()
    if _use_pallas("dual", impl, shape, parts[0].dtype, config, round_to, parts=widths):
        rows, cols = _pallas_quantize(
            parts if widths else parts[0], rows=True, cols=True, dtype=dtype, scaling=scaling,
            pow2_scale=pow2_scale, config=config, interpret=interpret,
            round_to=None if round_to is None else jnp.dtype(round_to),
        )
        return rows, cols
    x = jnp.concatenate(parts, axis=-1) if widths else parts[0]
    if round_to is not None:
        x = rounded(x, round_to)
    return quantize_dual_reference(x, dtype=dtype, scaling=scaling, pow2_scale=pow2_scale)
