"""MX (MXFP8) cast kernels: one pass over a bf16 matrix -> fp8 elements + E8M0 scales, rowwise or transposed.

The math is `mx_jax.mx_format` (OCP MX v1.0, blocks of 32 along the contracted axis K, modes floor/rceil/even);
these kernels apply it to the two layouts an MX GEMM consumes:

    dim0   x (M, K) -> elements (M, K) fp8, scales (M, K // 32) uint8   blocks along x's rows (axis 1)
    dim1   x (K, N) -> elements (N, K) fp8, scales (N, K // 32) uint8   blocks down x's columns (axis 0), written
                                                                          as the transposed, K-major copy
    dim01  x (R, C) -> dim0(x) and dim1(x) from one read of x             (dim1's K is R, its N is C)

Scale layout (what `mx_matmul` reads): plain row-major (rows, K // 32) uint8, the scale of elements[r, 32*j : 32*j+32]
at scales[r, j]; byte = e + 127, 0xFF for a block holding NaN/Inf. Both outputs are K-major, the operand layout 8-bit
wgmma requires (A (M, K), B stored (N, K)), so out = a @ b contracts dim0(a) with dim1(b). For y = x @ w in training:
forward dim0(x) . dim1(w); dgrad dx = dy @ w^T: dim0(dy) . dim0(w); wgrad dw = x^T @ dy: dim1(x) . dim1(dy).
So w and dy each need both casts (dim01 reads them once); x needs dim0 now and dim1 for the backward.

Kernel (Mosaic-GPU `plgpu.kernel`, Lane semantics, one warpgroup, one output tile of (tile_rows, tile_k) per CTA):
- TMA loads the bf16 input tile into 128 B-swizzled SMEM; the kernel walks it 32 K-columns at a time as a
  (tile_rows, 32) register array in the WGMMA layout (four lanes of a quad hold one row's 8-column groups):
    dim0: a (tile_rows, 64) SMEM slice per step, split into two 32-column halves in registers;
    dim1: 32 rows of the (tile_k, tile_rows) input tile read through the transposed view (`ref.T`, an ldmatrix
          transpose into WGMMA_TRANSPOSED, then one shuffle + permute into WGMMA): the transpose costs no SMEM pass.
- Per block (`mx_format` helpers, so kernel and XLA path are bit-identical): amax by packed max.NaN.bf16x2 over the
  thread's registers and two shuffles across the quad; the exponent per row; per element one bf16 -> f32 widen,
  one multiply by 2^-e and `cvt.rn.satfinite` to fp8 (~6 ops/element, inside the memory-bound budget). The GPU
  keeps subnormals and satfinite saturates, so the kernel omits the subnormal fix-up and the clip that XLA:CPU
  needs; interpreted on CPU it includes both (the `gpu` tests check the omission on hardware).
- Elements go to 32 B-swizzled SMEM (32 fp8 = one swizzle row per block) and leave by one TMA store per tile.
  Scales go straight from registers to global memory (one byte per row per block): a TMA box needs >= 16 B rows,
  i.e. tile_k >= 512, which would leave no room for several CTAs per SM.
- No intra-CTA pipelining: a tile is load -> cast -> store, and latency is hidden by 3-4 resident CTAs per SM
  (32 KiB in + 16 KiB out per CTA at the default 128 x 128 tile). The cast is memory bound (2 B read and
  ~1.03 B written per element; dim01 2 + 2.06), so bytes in flight per SM, not arithmetic, set the speed.

Trade-off: Mosaic-GPU expresses the per-32 block reduction only as "slice 32 columns, reduce along axis 1", so
the kernel is an unrolled loop over blocks rather than one reshape-and-reduce; it keeps every step in a layout
Mosaic-GPU lowers natively (WGMMA / WGMMA_TRANSPOSED / WGMMA_ROW). The Triton backend could express the tile as
(rows, K/32, 32) directly but is deprecated from jax 0.11.

The dispatchers' `impl="xla"` path is `mx_format.mx_quantize` (plus a transpose for dim1), which XLA fuses;
`impl="reference"` is the float64 NumPy spec through `jax.pure_callback`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mx_jax import compat
from pallas_kernels import device
from mx_jax import mx_format as mxf

Impl = Literal["auto", "pallas", "xla", "reference"]
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_BLOCK = 32
_SMEM_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class CastConfig:
    """The output tile one CTA writes: (tile_rows, tile_k) elements and (tile_rows, tile_k // 32) scales."""

    tile_rows: int = 128  # output rows per CTA; multiple of 64 (the WGMMA layout's warpgroup tile)
    tile_k: int = 128  # K extent per CTA; multiple of 64 (128 B-swizzled bf16 SMEM rows)

    def smem_bytes(self, variant: str) -> int:
        n_out = 2 if variant == "dim01" else 1
        return self.tile_rows * self.tile_k * (2 + n_out)

    @property
    def name(self) -> str:
        return f"{self.tile_rows}x{self.tile_k}"


DEFAULT_CONFIG = CastConfig()


# ---------------------------------------------------------------------------------------------------------------
# Reference: the float64 NumPy spec applied to each layout.
# ---------------------------------------------------------------------------------------------------------------


def mx_quantize_dim0_reference(x, *, mode: mxf.Mode = "floor", elem_dtype=jnp.float8_e4m3fn):
    """x (M, K) -> NumPy (elements (M, K), scales (M, K // 32)): `mx_format.mx_quantize_reference` along K."""
    return mxf.mx_quantize_reference(np.asarray(x), mode=mode, elem_dtype=elem_dtype)


def mx_quantize_dim1_reference(x, *, mode: mxf.Mode = "floor", elem_dtype=jnp.float8_e4m3fn):
    """x (K, N) -> NumPy (elements (N, K), scales (N, K // 32)): the reference on the transposed copy."""
    return mxf.mx_quantize_reference(np.ascontiguousarray(np.asarray(x).T), mode=mode, elem_dtype=elem_dtype)


# ---------------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------------


def _cast_block(xs: jax.Array, *, mode: mxf.Mode, fmt: mxf.ElemFormat, elem_dtype, interpret):
    """xs (R, 32) bf16/f16 in the WGMMA layout -> (elements (R, 32) elem_dtype, scale bytes (R,) uint8)."""
    rows = xs.shape[0]
    bcast = lambda v: lax.broadcast_in_dim(v, (rows, _BLOCK), (0,))  # (R,) WGMMA_ROW -> (R, 32) WGMMA
    # amax: packed max.NaN.bf16x2 over the thread's registers, then two shuffles across the quad.
    e, bad = mxf.block_exponent(mxf.block_amax(xs, axis=1), mode=mode, fmt=fmt)  # (R,)
    # On the GPU subnormals are kept and cvt.rn.satfinite saturates, so neither fix-up is needed; the interpreter
    # runs on XLA:CPU, which flushes subnormals and whose convert does not saturate.
    exact_on_xla_cpu = interpret is not None
    elements = mxf.scale_elements(
        xs, e, bcast, fmt=fmt, elem_dtype=elem_dtype, subnormal_fixup=exact_on_xla_cpu, clip=exact_on_xla_cpu
    )
    keep, fill = mxf.nan_masks(bad, fmt=fmt)
    return mxf.nan_fill(elements, bcast(keep), bcast(fill)), mxf.scale_bytes(e, bad)


def _load_rows(ref) -> jax.Array:
    """ref (R, C) SMEM -> (R, C) value in the WGMMA layout."""
    return plgpu.layout_cast(ref[...], plgpu.Layout.WGMMA)


def _load_transposed(ref, interpret) -> jax.Array:
    """ref (C, R) SMEM -> its transpose (R, C) in the WGMMA layout, read through the transposed view."""
    if interpret is not None and not compat.MGPU_INTERPRET_REF_TRANSPOSE:
        return ref[...].T  # jax 0.10.2's interpreter cannot read `ref.T`; layouts mean nothing there
    xt = plgpu.layout_cast(ref.T[...], plgpu.Layout.WGMMA_TRANSPOSED)
    return plgpu.layout_cast(xt, plgpu.Layout.WGMMA)


def _cast_rows_of_tile(x_smem, e_smem, s_gmem, s_rows, s_col0, *, cast):
    """Blocks along the SMEM tile's columns: x_smem (R, C) -> e_smem (R, C), scales to s_gmem[s_rows, s_col0 + j]."""
    for c2 in range(x_smem.shape[1] // 64):
        x64 = _load_rows(x_smem.at[:, pl.ds(c2 * 64, 64)])  # (R, 64)
        for half in range(2):
            j = 2 * c2 + half
            elements, scales = cast(x64[:, half * _BLOCK : (half + 1) * _BLOCK])
            e_smem.at[:, pl.ds(j * _BLOCK, _BLOCK)][...] = elements
            s_gmem.at[s_rows, s_col0 + j][...] = scales


def _cast_cols_of_tile(x_smem, e_smem, s_gmem, s_rows, s_col0, *, cast, interpret):
    """Blocks down the SMEM tile's rows: x_smem (C, R) -> e_smem (R, C) (transposed), scales as above."""
    for j in range(x_smem.shape[0] // _BLOCK):
        xs = _load_transposed(x_smem.at[pl.ds(j * _BLOCK, _BLOCK), :], interpret)  # (R, 32)
        elements, scales = cast(xs)
        e_smem.at[:, pl.ds(j * _BLOCK, _BLOCK)][...] = elements
        s_gmem.at[s_rows, s_col0 + j][...] = scales


def _kernel(x_gmem, *refs, variant, config, cast, interpret):
    """One CTA: TMA-load one input tile, cast it (dim0, dim1 or both), TMA-store the element tile(s)."""
    r, k = config.tile_rows, config.tile_k
    i = lax.axis_index("i")
    j = lax.axis_index("j")
    if variant == "dim0":  # x (M, K) tile (r, k) at (i, j)
        e_gmem, s_gmem, x_smem, e_smem, bar = refs
        rows, cols = pl.ds(i * r, r), pl.ds(j * k, k)
        plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem, bar)
        plgpu.barrier_wait(bar)
        _cast_rows_of_tile(x_smem, e_smem, s_gmem, rows, j * (k // _BLOCK), cast=cast)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(e_smem, e_gmem.at[rows, cols])
    elif variant == "dim1":  # x (K, N) tile (k, r) at (j, i); output (N, K) tile (r, k) at (i, j)
        e_gmem, s_gmem, x_smem, e_smem, bar = refs
        rows, cols = pl.ds(i * r, r), pl.ds(j * k, k)
        plgpu.copy_gmem_to_smem(x_gmem.at[cols, rows], x_smem, bar)
        plgpu.barrier_wait(bar)
        _cast_cols_of_tile(x_smem, e_smem, s_gmem, rows, j * (k // _BLOCK), cast=cast, interpret=interpret)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(e_smem, e_gmem.at[rows, cols])
    else:  # dim01: x (R, C) tile (r, k) at (i, j); dim0 tile (r, k) at (i, j); dim1 (C, R) tile (k, r) at (j, i)
        e0_gmem, s0_gmem, e1_gmem, s1_gmem, x_smem, e0_smem, e1_smem, bar = refs
        rows, cols = pl.ds(i * r, r), pl.ds(j * k, k)
        plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem, bar)
        plgpu.barrier_wait(bar)
        _cast_rows_of_tile(x_smem, e0_smem, s0_gmem, rows, j * (k // _BLOCK), cast=cast)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(e0_smem, e0_gmem.at[rows, cols])
        _cast_cols_of_tile(x_smem, e1_smem, s1_gmem, cols, i * (r // _BLOCK), cast=cast, interpret=interpret)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(e1_smem, e1_gmem.at[cols, rows])
    plgpu.wait_smem_to_gmem(0)


def pallas_cover(shape: tuple[int, ...], dtype, *, variant: str = "dim0", config: CastConfig = DEFAULT_CONFIG):
    """None when the kernel of `variant` takes x of this shape/dtype with this config, else the reason it does not."""
    if jnp.dtype(dtype) not in KERNEL_DTYPES:
        return f"x must be bfloat16 or float16, got {jnp.dtype(dtype)}"
    if len(shape) != 2:
        return f"x must be 2-D, got shape {tuple(shape)}"
    r, k = config.tile_rows, config.tile_k
    if r % 64 or k % 64 or r <= 0 or k <= 0:
        return f"tile {config.name} must be multiples of 64 in both dims"
    # the input tile as it sits in x: dim0 / dim01 (r, k), dim1 (k, r)
    tile = (k, r) if variant == "dim1" else (r, k)
    if shape[0] % tile[0] or shape[1] % tile[1]:
        return f"x of shape {tuple(shape)} must be a multiple of the input tile {tile} ({variant})"
    if variant == "dim01" and r % _BLOCK:
        return f"tile_rows must be a multiple of {_BLOCK} for dim01"
    if config.smem_bytes(variant) > _SMEM_BYTES:
        return f"tile {config.name} needs {config.smem_bytes(variant)} B of shared memory (> {_SMEM_BYTES})"
    return None


@device.lowered_once(('variant', 'mode', 'elem_dtype', 'config', 'interpret'))
def _mx_cast_pallas(x, *, variant, mode, elem_dtype, config, interpret):
    mxf.check_mode(mode)
    fmt = mxf.elem_format(elem_dtype)
    elem_dtype = jnp.dtype(elem_dtype)
    if (reason := pallas_cover(x.shape, x.dtype, variant=variant, config=config)) is not None:
        raise NotImplementedError(f"mx_quantize_{variant}_pallas: {reason}")
    if interpret is not None:
        compat.enable_mgpu_interpret_layout_cast()
    r, k = config.tile_rows, config.tile_k
    a, b = x.shape
    x_swizzle = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 64 bf16 = 128 B rows
    e_swizzle = (plgpu.TilingTransform((8, _BLOCK)), plgpu.SwizzleTransform(32))  # one 32 B block per row
    x_tile = plgpu.SMEM((k, r) if variant == "dim1" else (r, k), x.dtype, transforms=x_swizzle)
    e_tile = plgpu.SMEM((r, k), elem_dtype, transforms=e_swizzle)
    e_tile_t = plgpu.SMEM((k, r), elem_dtype, transforms=e_swizzle)
    sds = jax.ShapeDtypeStruct
    if variant == "dim0":  # x (M, K)
        out = (sds((a, b), elem_dtype), sds((a, b // _BLOCK), jnp.uint8))
        scratch, grid = [x_tile, e_tile], (a // r, b // k)
    elif variant == "dim1":  # x (K, N)
        out = (sds((b, a), elem_dtype), sds((b, a // _BLOCK), jnp.uint8))
        scratch, grid = [x_tile, e_tile], (b // r, a // k)
    else:  # x (R, C)
        out = (
            sds((a, b), elem_dtype),
            sds((a, b // _BLOCK), jnp.uint8),
            sds((b, a), elem_dtype),
            sds((b, a // _BLOCK), jnp.uint8),
        )
        scratch, grid = [x_tile, e_tile, e_tile_t], (a // r, b // k)
    cast = functools.partial(_cast_block, mode=mode, fmt=fmt, elem_dtype=elem_dtype, interpret=interpret)
    f = plgpu.kernel(
        functools.partial(_kernel, variant=variant, config=config, cast=cast, interpret=interpret),
        out_type=out,
        scratch_types=[*scratch, plgpu.Barrier(num_arrivals=1)],
        grid=grid,
        grid_names=("i", "j"),
        # Each SMEM buffer is written once per CTA and read back only by TMA after commit_smem (a fence plus a
        # warpgroup barrier), so the barriers Pallas would put around every SMEM store are not needed.
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane, unsafe_no_auto_barriers=True
        ),
        interpret=interpret,
        kernel_name=f"mx_quantize_{variant}",
    )
    return f(x)


def mx_quantize_dim0_pallas(
    x: jax.Array,
    *,
    mode: mxf.Mode = "floor",
    elem_dtype=jnp.float8_e4m3fn,
    config: CastConfig = DEFAULT_CONFIG,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:
    """x (M, K) bf16/f16 -> (elements (M, K), scales (M, K // 32) uint8). NotImplementedError outside `pallas_cover`.

    `interpret`: None on the GPU, or a `compat.InterpretGPUParams` to run the kernel on CPU.
    """
    return _mx_cast_pallas(x, variant="dim0", mode=mode, elem_dtype=elem_dtype, config=config, interpret=interpret)


def mx_quantize_dim1_pallas(
    x: jax.Array,
    *,
    mode: mxf.Mode = "floor",
    elem_dtype=jnp.float8_e4m3fn,
    config: CastConfig = DEFAULT_CONFIG,
    interpret=None,
) -> tuple[jax.Array, jax.Array]:
    """x (K, N) bf16/f16 -> (elements (N, K), scales (N, K // 32) uint8): blocks down x's columns, output transposed."""
    return _mx_cast_pallas(x, variant="dim1", mode=mode, elem_dtype=elem_dtype, config=config, interpret=interpret)


def mx_quantize_dim01_pallas(
    x: jax.Array,
    *,
    mode: mxf.Mode = "floor",
    elem_dtype=jnp.float8_e4m3fn,
    config: CastConfig = DEFAULT_CONFIG,
    interpret=None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x (R, C) -> dim0(x) + dim1(x) = (e0 (R, C), s0 (R, C // 32), e1 (C, R), s1 (C, R // 32)) from one read of x."""
    return _mx_cast_pallas(x, variant="dim01", mode=mode, elem_dtype=elem_dtype, config=config, interpret=interpret)


# ---------------------------------------------------------------------------------------------------------------
# Dispatchers
# ---------------------------------------------------------------------------------------------------------------


def _reference_callback(x, *, variant, mode, elem_dtype):
    """The NumPy reference behind `jax.pure_callback`, so impl="reference" also runs under jit."""
    elem_dtype = jnp.dtype(elem_dtype)
    a, b = x.shape
    s0 = (jax.ShapeDtypeStruct((a, b), elem_dtype), jax.ShapeDtypeStruct((a, b // _BLOCK), jnp.uint8))
    s1 = (jax.ShapeDtypeStruct((b, a), elem_dtype), jax.ShapeDtypeStruct((b, a // _BLOCK), jnp.uint8))
    ref0 = functools.partial(mx_quantize_dim0_reference, mode=mode, elem_dtype=elem_dtype)
    ref1 = functools.partial(mx_quantize_dim1_reference, mode=mode, elem_dtype=elem_dtype)
    if variant == "dim0":
        return jax.pure_callback(ref0, s0, x)
    if variant == "dim1":
        return jax.pure_callback(ref1, s1, x)
    return jax.pure_callback(lambda v: (*ref0(v), *ref1(v)), (*s0, *s1), x)


def _xla(x, *, variant, mode, elem_dtype):
    q = functools.partial(mxf.mx_quantize, mode=mode, elem_dtype=elem_dtype)
    if variant == "dim0":
        return q(x)
    if variant == "dim1":
        return q(x.T)
    return (*q(x), *q(x.T))


def _dispatch(x, *, variant, mode, elem_dtype, impl, config):
    fn = f"mx_quantize_{variant}"
    if impl not in ("auto", "pallas", "xla", "reference"):
        raise ValueError(f"{fn}: impl must be auto|pallas|xla|reference, got {impl!r}")
    if x.ndim != 2:
        raise ValueError(f"{fn}: x must be 2-D; got x of shape {tuple(x.shape)} and dtype {x.dtype}")
    mxf.check_mode(mode)
    mxf.elem_format(elem_dtype)
    mxf.check_input("x", x, 1, fn=fn)  # dtype
    # The blocked axis: K = x.shape[1] for dim0, x.shape[0] for dim1; both for dim01.
    for ax in {"dim0": (1,), "dim1": (0,), "dim01": (0, 1)}[variant]:
        if x.shape[ax] % _BLOCK:
            raise ValueError(
                f"{fn}: axis {ax} of x is blocked and must be a multiple of {_BLOCK}; got x of shape "
                f"{tuple(x.shape)} and dtype {x.dtype}"
            )
    if impl == "reference":
        return _reference_callback(x, variant=variant, mode=mode, elem_dtype=elem_dtype)
    if impl == "xla":
        return _xla(x, variant=variant, mode=mode, elem_dtype=elem_dtype)
    if impl == "pallas":
        if not device.kernels_apply():
            raise NotImplementedError(
                f"{fn}(impl='pallas') needs a Hopper-or-newer GPU; on CPU call mx_quantize_{variant}_pallas("
                "..., interpret=compat.InterpretGPUParams())"
            )
        return _mx_cast_pallas(x, variant=variant, mode=mode, elem_dtype=elem_dtype, config=config, interpret=None)
    if device.kernels_apply() and pallas_cover(x.shape, x.dtype, variant=variant, config=config) is None:
        return _mx_cast_pallas(x, variant=variant, mode=mode, elem_dtype=elem_dtype, config=config, interpret=None)
    return _xla(x, variant=variant, mode=mode, elem_dtype=elem_dtype)


def mx_quantize_dim0(
    x: jax.Array,
    *,
    mode: mxf.Mode = "floor",
    elem_dtype=jnp.float8_e4m3fn,
    impl: Impl = "auto",
    config: CastConfig = DEFAULT_CONFIG,
) -> tuple[jax.Array, jax.Array]:
    """MX cast of x (M, K) along K: (elements (M, K), scales (M, K // 32) uint8, row-major).

    impl: "auto" (the kernel on Hopper+ for shapes it covers, else XLA), "pallas" (never falls back), "xla",
    "reference" (NumPy float64 spec via pure_callback).
    """
    return _dispatch(x, variant="dim0", mode=mode, elem_dtype=elem_dtype, impl=impl, config=config)


def mx_quantize_dim1(
    x: jax.Array,
    *,
    mode: mxf.Mode = "floor",
    elem_dtype=jnp.float8_e4m3fn,
    impl: Impl = "auto",
    config: CastConfig = DEFAULT_CONFIG,
) -> tuple[jax.Array, jax.Array]:
    """MX cast of x (K, N) along K, written transposed: (elements (N, K), scales (N, K // 32) uint8)."""
    return _dispatch(x, variant="dim1", mode=mode, elem_dtype=elem_dtype, impl=impl, config=config)


def mx_quantize_dim01(
    x: jax.Array,
    *,
    mode: mxf.Mode = "floor",
    elem_dtype=jnp.float8_e4m3fn,
    impl: Impl = "auto",
    config: CastConfig = DEFAULT_CONFIG,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """dim0 and dim1 of x (R, C) together: (e0 (R, C), s0 (R, C // 32), e1 (C, R), s1 (C, R // 32))."""
    return _dispatch(x, variant="dim01", mode=mode, elem_dtype=elem_dtype, impl=impl, config=config)


# ---------------------------------------------------------------------------------------------------------------
# GPU benchmark: python -m pallas_kernels.mx_quantize [--quick]
# ---------------------------------------------------------------------------------------------------------------

BENCH_SHAPES = ((8192, 8192), (8192, 14336))
BENCH_CONFIGS = (
    CastConfig(tile_rows=128, tile_k=128),
    CastConfig(tile_rows=64, tile_k=128),
    CastConfig(tile_rows=128, tile_k=256),
    CastConfig(tile_rows=64, tile_k=256),
    CastConfig(tile_rows=256, tile_k=64),
    CastConfig(tile_rows=128, tile_k=64),
)


def _seconds_per_call(f, x, iters: int) -> float:
    jax.block_until_ready(f(x))  # compile + warm up
    jax.block_until_ready(f(x))
    t0 = time.perf_counter()
    for _ in range(iters):  # dispatch is async: back-to-back calls keep the GPU busy
        out = f(x)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def _same_bits(got, want) -> bool:
    u8 = lambda a: lax.bitcast_convert_type(a, jnp.uint8) if a.dtype != jnp.uint8 else a
    return all(bool(jnp.array_equal(u8(g), u8(w))) for g, w in zip(got, want, strict=True))


def bench_mx_cast(quick: bool = False) -> list[dict]:
    """GB/s of the Pallas kernels vs the XLA path (dim0, dim1, dim01) on bf16 inputs, with a bit-exact check.

    Bytes counted: the bf16 read plus fp8 elements and uint8 scales written (dim01: one read, two writes).
    `quick`: the default tile only and fewer iterations. Returns the rows it prints.
    """
    iters = 20 if quick else 100
    configs = (DEFAULT_CONFIG,) if quick else BENCH_CONFIGS
    dev = jax.devices()[0]
    print(f"# mx cast bench on {dev.device_kind}, jax {jax.__version__}, mode=floor, e4m3, {iters} iters")
    print(f"{'variant':7s} {'shape':>12s} {'impl':>16s} {'us':>9s} {'GB/s':>8s}  bit-exact")
    rows = []
    for a, b in BENCH_SHAPES:
        x = jax.random.normal(jax.random.key(0), (a, b), jnp.float32).astype(jnp.bfloat16)
        for variant in ("dim0", "dim1", "dim01"):
            n_out = 2 if variant == "dim01" else 1
            nbytes = a * b * 2 + n_out * (a * b + a * b // _BLOCK)
            xla_f = jax.jit(functools.partial(_xla, variant=variant, mode="floor", elem_dtype=jnp.float8_e4m3fn))
            want = xla_f(x)
            cands = [("xla", xla_f)] + [
                (
                    f"pallas {c.name}",
                    jax.jit(
                        functools.partial(
                            _mx_cast_pallas,
                            variant=variant,
                            mode="floor",
                            elem_dtype=jnp.float8_e4m3fn,
                            config=c,
                            interpret=None,
                        )
                    ),
                )
                for c in configs
                if pallas_cover((a, b), x.dtype, variant=variant, config=c) is None
            ]
            for name, f in cands:
                try:
                    s = _seconds_per_call(f, x, iters)
                    exact = _same_bits(f(x), want)
                except Exception as err:  # a config that fails to compile must not hide the others
                    print(f"{variant:7s} {a:>5d}x{b:<6d} {name:>16s}  FAILED: {type(err).__name__}: {err}"[:300])
                    continue
                row = dict(variant=variant, shape=(a, b), impl=name, us=s * 1e6, gbps=nbytes / s / 1e9, exact=exact)
                rows.append(row)
                print(f"{variant:7s} {a:>5d}x{b:<6d} {name:>16s} {s * 1e6:9.1f} {row['gbps']:8.0f}  {exact}")
    return rows


if __name__ == "__main__":
    import sys

    bench_mx_cast(quick="--quick" in sys.argv)
