"""MX (MXFP8) block-scaled GEMM: out = Σ_kb (a_kb · b_kbᵀ) · 2^(sa[m,kb]-127) · 2^(sb[n,kb]-127), f32 accumulated.

    a         (M, K)       float8_e4m3fn | float8_e5m2, K-major (row-major)
    b_t       (N, K)       float8_e4m3fn | float8_e5m2, K-major: the right operand stored transposed
    a_scales  (M, K // 32) uint8 E8M0, row-major: byte s means 2^(s - 127), 0xFF means NaN
    b_scales  (N, K // 32) uint8 E8M0
    out       (M, N)       out_dtype (bf16 by default)

kb runs over the K // 32 blocks of 32 elements (OCP MX v1.0, sections 5.1/5.3: one shared E8M0 scale per block of
k = 32). This is exactly what the cast kernels write (`pallas_kernels/mx_quantize.py`, dim0/dim1, both K-major), and
`mx_jax/mx_format.mx_dequantize` is the elementwise meaning of (elements, scales).

Why a dedicated kernel on Hopper. Blackwell's tcgen05 MMA applies the block scales in hardware; Hopper's wgmma has no
scale operand, so the scales must be applied to partial sums. An fp8 wgmma instruction is m64nNk32: its K is exactly
one MX block. The kernel issues one wgmma per 32-wide block into a fresh f32 accumulator p and promotes it:
    acc[m, n] += (p[m, n] · fa[m]) · fb[n]        fa = 2^(sa - 126), fb = 2^(sb - 126) (the epilogue takes out 4)
(DeepGEMM promotes every 128 elements, and with one weight scale per 128x128 block its per-row x scalar product is
one FFMA per element; MX promotes every 32, and its per-column factor adds an FMUL). Multiplying by a power of two
is exact, so the promotion adds one rounding per block, the FFMA's, like f32 accumulation of the dequantized
operands. (Inside one wgmma Hopper's tensor cores keep only ~14 bits while summing fp8 products, DeepSeek-V3 section
3.3.2; promoting every 32 bounds that loss to 32-term sums, where the fp8 rowwise kernel accumulates all of K.)
`scale_first=True` promotes as p · (fa · fb) instead: the same two instructions, the product S = fa · fb exact even
where p · fa would leave float32's normal range (an A block with amax below ~2^-100), at the price of up to 64 more
live registers per thread.

Where the time goes, per output element per 32-wide block on one SM of an H100/H200 (the lowered Mosaic module has
exactly one vector FMUL and one FFMA-contractible mul/add pair per accumulator register per block):
    wgmma:      32 MACs at 4096 fp8 MAC/clk/SM                              = 1/128 clk  (tensor cores)
    promotion:  FMUL + FFMA                                                 = 2 instructions
                + ~0.5 re-zeroing p (wgmma always accumulates; Pallas does not expose wgmma's scale-d = 0)
                + ~0.3 loads of the row/column factors from SMEM            ≈ 2.8 instructions at 128 lanes/clk/SM
So the CUDA cores, not the tensor cores, bound the kernel: the promotion of a block takes ~2.8x its wgmma even with
perfect overlap, a ceiling of 1/2.8 ≈ 36% of the fp8 tensor peak (~700 TFLOP/s of the H200's 1979 at spec clock,
before the efficiency losses that leave the fp8 kernels here at ~68% of their peak). Expect the kernel near or
below XLA's bf16 GEMM, not 1.3x above it. The structure buys the overlap that is possible: two compute warpgroups
share the tensor cores, so one warpgroup's promotion runs while the other's wgmma does, and `tmp_slots=2` issues
blocks in pairs so block j+1's wgmma also overlaps block j's promotion inside a warpgroup. Exponent-bit integer
tricks do not help: an IADD building 2^(sa+sb-254) replaces the FMUL one for one (same issue slot; Hopper's INT32
pipe is half rate), and adding the exponent straight into p's bits breaks on p = 0. benchmarks/bench_mx.py measures
it.

Kernel (Mosaic-GPU `plgpu.kernel`, Warpgroup semantics; the structure of `fp8_matmul.py`):
- SMEM operand tiles use a 32 B swizzle with (8, 32) tiling, so each 32-wide MX block is one tile column and a
  block's wgmma operand is a tile-aligned slice (with a 128 B swizzle four blocks share a swizzle atom, and Pallas
  refuses the slice: "slice size (32) ... divisible by the tile size (128)"). 8-bit wgmma needs both operands
  K-major: B's tile is (tile_n, 32), passed as `.T`.
- Scales arrive by TMA with the operands, in the same pipeline stage, as f32 factors: a tiny XLA pre-pass turns each
  (R, K // 32) byte array into (K // 32, R // t, t) float32 2^(s - 126) (0xFF -> NaN), K-block-major so that one
  stage's slice is a dense TMA box (the byte rows of one stage, 4 bytes, are below TMA's 16 B minimum) and a
  warpgroup reads its (t,) vector with a static block index. The +1 in the exponent keeps every factor a normal
  float32 for bytes 0..253 (2^-127 would be subnormal and flushed on some backends). Byte 254 (2^127) overflows to
  Inf; no cast of a finite bf16/f32 input produces it.
- Warp specialization: one memory warpgroup runs the `stages`-deep TMA ring; two compute warpgroups split the CTA
  tile along M or N (`wg_split`). Each holds acc and `tmp_slots` wgmma accumulators in registers:
  (1 + tmp_slots) · tile_m · tile_n / 128 f32 registers per thread, which caps the warpgroup tile at 64x128 /
  128x64 (a 128x128 tile would need 256 registers; compute threads get 232).
- Persistent grid: min(#SMs, #tiles) CTAs walk the output tiles along a planar snake.
- Epilogue: acc / 4 -> out_dtype -> SMEM -> TMA store.

Trade-offs. The scale pre-pass costs one XLA fusion over the scales (1/32 of the operand bytes, written as f32:
~10 us at 8192x8192) but removes all byte -> float work and strided byte loads from the kernel. A contribution is
flushed only where float32 cannot hold it: p · fa below 2^-126 (default order) or fa · fb below 2^-126
(`scale_first`), i.e. for blocks whose values are below ~1e-30.

Paths of the dispatcher `mx_matmul(..., impl=)`:
- "reference": dequantize both operands to f32 (`mx_dequantize`), f32 matmul at HIGHEST precision. The spec.
- "xla": dequantize to bf16 (exact: e4m3/e5m2 times a power of two fits bf16's 8-bit significand) and an XLA bf16
  dot (cuBLAS, f32 accumulation). This is what public stacks do for MX on Hopper, which has no MX hardware:
  TorchAO's emulated MXFP8 dequantizes and runs a high-precision mm, XLA lowers `jax.nn.scaled_matmul` there to a
  dequantized bf16 cuBLASLt GEMM (benchmarks/JAX_NOTES.md), Transformer Engine's MXFP8 recipe requires SM100+ (its
  JAX MXFP8 example asserts it). The best non-custom path.
- "pallas": the Mosaic-GPU kernel above; NotImplementedError outside its cover, never falls back.
- "blackwell": `jax.nn.scaled_matmul` (cuDNN's fused MX GEMM: float8_e8m0fnu scales, block 32, operands
  (B, M, K) / (B, N, K) with B = 1 here). UNTESTED ON HARDWARE: no Blackwell GPU was available; a CPU test checks
  the layout and dtypes handed to it against its docstring (identical in jax 0.10.2 and 0.11.2).
- "auto": "blackwell" on compute capability >= 10.0; on Hopper (9.0) "pallas" where AUTO_TABLE / AUTO_DEFAULT say
  it wins and the kernel covers the shape; otherwise "xla".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mx_jax import compat
from pallas_kernels import device
from mx_jax import mx_format as mxf

BLOCK = 32  # MX block size along K; also the K of one fp8 wgmma instruction
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
Impl = Literal["auto", "pallas", "xla", "reference", "blackwell"]
IMPLS = ("auto", "pallas", "xla", "reference", "blackwell")
_SMEM_BYTES = 227 * 1024  # Hopper opt-in shared memory per block
_ACC_REGISTERS = 192  # f32 accumulator registers allowed per compute thread (of 232): room for factors, addresses
_FACTOR_BIAS = 126  # factors are 2^(s - 126) = 2 * 2^(s - 127): normal float32 for every byte 0..253
_EPILOGUE = 0.25  # undoes the two factors of 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig:
    """One point of the tile sweep. The CTA tile is two warpgroup tiles side by side along `wg_split`."""

    tile_m: int = 64  # C rows per compute warpgroup; multiple of 64 (wgmma M)
    tile_n: int = 128  # C cols per compute warpgroup; multiple of 8, <= 256 (wgmma N)
    tile_k: int = 128  # K per pipeline stage: tile_k // 32 MX blocks, one wgmma + promotion each
    stages: int = 4  # TMA ring depth (max_concurrent_steps)
    wg_split: Literal["m", "n"] = "m"  # the 2 compute warpgroups split the CTA tile along this dim
    tmp_slots: Literal[1, 2] = 1  # wgmma accumulators per warpgroup; 2: blocks in pairs, j+1's wgmma overlaps j's FMAs
    scale_first: bool = False  # promote as p·(fa·fb) (exact S, 64 more live registers) instead of (p·fa)·fb
    grid_minor: Literal["m", "n"] = "n"  # planar-snake minor dim of the persistent tile walk
    grid_tile_width: int = 8  # planar-snake band width, in CTA tiles

    @property
    def cta_tile_m(self) -> int:
        return self.tile_m * (2 if self.wg_split == "m" else 1)

    @property
    def cta_tile_n(self) -> int:
        return self.tile_n * (2 if self.wg_split == "n" else 1)

    @property
    def blocks_per_stage(self) -> int:
        return self.tile_k // BLOCK

    def acc_registers(self) -> int:
        """f32 registers per compute thread held by acc and the wgmma accumulators."""
        return (1 + self.tmp_slots) * self.tile_m * self.tile_n // 128

    def smem_bytes(self, out_dtype=jnp.bfloat16) -> int:
        """Shared memory the kernel allocates (operand + scale ring, epilogue staging), excluding barriers."""
        rows = self.cta_tile_m + self.cta_tile_n
        ring = self.stages * rows * (self.tile_k + self.blocks_per_stage * 4)  # fp8 elements + f32 factors
        out = 2 * self.tile_m * self.tile_n * jnp.dtype(out_dtype).itemsize
        return ring + out

    def name(self) -> str:
        return (
            f"wg{self.tile_m}x{self.tile_n}x{self.tile_k}/{self.wg_split} s{self.stages} tmp{self.tmp_slots}"
            f"{' S' if self.scale_first else ''} snake-{self.grid_minor}{self.grid_tile_width}"
        )


DEFAULT_CONFIG = TileConfig()


# --------------------------------------------------------------------------------------------------------------
# Reference: the spec, pure jnp, f32 accumulation.
# --------------------------------------------------------------------------------------------------------------
def mx_matmul_reference(
    a: jax.Array, b_t: jax.Array, a_scales: jax.Array, b_scales: jax.Array, *, out_dtype=jnp.bfloat16
) -> jax.Array:
    """Dequantize both operands to f32 (`mx_dequantize`) and multiply at HIGHEST precision."""
    a32 = mxf.mx_dequantize(a, a_scales, out_dtype=jnp.float32)  # (M, K)
    b32 = mxf.mx_dequantize(b_t, b_scales, out_dtype=jnp.float32)  # (N, K)
    acc = lax.dot_general(
        a32, b32, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    return acc.astype(out_dtype)


# --------------------------------------------------------------------------------------------------------------
# Mosaic-GPU kernel.
# --------------------------------------------------------------------------------------------------------------
def scale_factors(scales: jax.Array, group: int) -> jax.Array:
    """(R, K // 32) uint8 E8M0 -> (K // 32, R // group, group) float32 2^(s - 126); NaN for 0xFF.

    The kernel's scale operand: K-block-major (one pipeline stage reads a dense box) and split into the groups of
    `group` rows one compute warpgroup uses, so the warpgroup's vector is `smem[block, group_index]`.
    """
    s = scales.astype(jnp.int32)
    biased = jnp.minimum(s - _FACTOR_BIAS + 127, 255)  # float32 exponent field of 2^(s - 126)
    factor = lax.bitcast_convert_type(biased << 23, jnp.float32)
    factor = jnp.where(s == mxf.E8M0_NAN, jnp.nan, factor)
    r, kb = scales.shape
    return factor.T.reshape(kb, r // group, group)


def _kernel(a_gmem, b_gmem, fa_gmem, fb_gmem, out_gmem, *, config: TileConfig):
    """One persistent CTA: walks its output tiles; per tile a warp-specialized TMA/wgmma pipeline over K."""
    c = config
    m, k = a_gmem.shape
    n = b_gmem.shape[0]
    out_dtype = out_gmem.dtype
    nb = c.blocks_per_stage
    m_iters, n_iters, k_iters = m // c.cta_tile_m, n // c.cta_tile_n, k // c.tile_k
    a_groups, b_groups = c.cta_tile_m // c.tile_m, c.cta_tile_n // c.tile_n  # 2 on the split side, else 1

    # One 32 B swizzle atom per MX block: a block is a tile column, so its wgmma operand is a tile-aligned slice.
    in_transforms = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(BLOCK))
    out_bits = c.tile_n * jnp.dtype(out_dtype).itemsize * 8
    out_swizzle = plgpu.find_swizzle(out_bits)
    out_swizzle_elems = out_swizzle * 8 // (jnp.dtype(out_dtype).itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle_elems)), plgpu.SwizzleTransform(out_swizzle))

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(  # A tile (cta_tile_m, tile_k)
                    (c.cta_tile_m, c.tile_k), lambda kk: (0, kk), transforms=in_transforms, memory_space=plgpu.SMEM
                ),
                plgpu.BlockSpec(  # B tile (cta_tile_n, tile_k), K-major
                    (c.cta_tile_n, c.tile_k), lambda kk: (0, kk), transforms=in_transforms, memory_space=plgpu.SMEM
                ),
                plgpu.BlockSpec((nb, a_groups, c.tile_m), lambda kk: (kk, 0, 0), memory_space=plgpu.SMEM),
                plgpu.BlockSpec((nb, b_groups, c.tile_n), lambda kk: (kk, 0, 0), memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=c.stages,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # allocations do not depend on the bodies
    acc_type = lambda: plgpu.ACC((c.tile_m, c.tile_n), jnp.float32)  # allocated zeroed: a fresh wgmma accumulator

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem, fa_gmem, fb_gmem),
        out_smem=plgpu.SMEM((2, c.tile_m, c.tile_n), out_dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
        def _tile_loop(info):
            (lin,) = info.index
            mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 0 if c.grid_minor == "m" else 1, c.grid_tile_width)
            cta_rows = pl.ds(mi * c.cta_tile_m, c.cta_tile_m)
            cta_cols = pl.ds(ni * c.cta_tile_n, c.cta_tile_n)
            if c.wg_split == "m":
                wg_rows, wg_cols = pl.ds(wg * c.tile_m, c.tile_m), slice(None)
                a_group, b_group = wg, 0
            else:
                wg_rows, wg_cols = slice(None), pl.ds(wg * c.tile_n, c.tile_n)
                a_group, b_group = 0, wg

            def compute_context(eval_pipeline):
                acc = eval_pipeline(jnp.zeros((c.tile_m, c.tile_n), jnp.float32))  # (tile_m, tile_n) f32
                out = (acc * _EPILOGUE).astype(out_dtype)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store left out_smem
                out_smem[wg] = out
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[cta_rows, cta_cols].at[wg_rows, wg_cols])

            def mma_body(_, a_smem, b_smem, fa_smem, fb_smem, acc):
                a_wg = a_smem.at[wg_rows]  # (tile_m, tile_k)
                b_wg = b_smem.at[wg_cols]  # (tile_n, tile_k)

                def issue(j, tmp):  # p_j = a_j · b_jᵀ into a zeroed accumulator (async)
                    blk = pl.ds(j * BLOCK, BLOCK)
                    plgpu.wgmma(tmp, a_wg.at[:, blk], b_wg.at[:, blk].T)

                def factors(j):  # this block's (fa (tile_m,), fb (tile_n,)) from SMEM, broadcast to the tile
                    shape = (c.tile_m, c.tile_n)
                    fa = lax.broadcast_in_dim(fa_smem[j, a_group], shape, [0])
                    fb = lax.broadcast_in_dim(fb_smem[j, b_group], shape, [1])
                    return fa, fb

                def promote(acc, p, f):  # acc + p · fa · fb: one FMUL + one FFMA per element
                    fa, fb = f
                    if c.scale_first:
                        return acc + p * (fa * fb)
                    return acc + (p * fa) * fb

                if c.tmp_slots == 1:
                    for j in range(nb):

                        def one_block(tmp, j=j, acc=acc):
                            issue(j, tmp)
                            f = factors(j)  # SMEM loads overlap the wgmma
                            return promote(acc, tmp[...], f)  # the load of tmp waits for the wgmma

                        acc = pl.run_scoped(one_block, acc_type())
                else:  # blocks in pairs: block j+1's wgmma runs while block j is promoted
                    for j in range(0, nb, 2):

                        def two_blocks(tmp0, tmp1, j=j, acc=acc):
                            issue(j, tmp0)
                            issue(j + 1, tmp1)
                            acc = promote(acc, plgpu.wgmma_accumulator_load(tmp0, wait_n=1), factors(j))
                            return promote(acc, plgpu.wgmma_accumulator_load(tmp1, wait_n=0), factors(j + 1))

                        acc = pl.run_scoped(two_blocks, acc_type(), acc_type())
                return acc

            pipeline(mma_body, compute_context)(
                a_gmem.at[cta_rows, :],
                b_gmem.at[cta_cols, :],
                fa_gmem.at[:, pl.ds(mi * a_groups, a_groups), :],
                fb_gmem.at[:, pl.ds(ni * b_groups, b_groups), :],
                allocations=pipeline_allocs,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def pallas_cover(
    m: int, n: int, k: int, a_dtype, b_dtype, out_dtype=jnp.bfloat16, config: TileConfig = DEFAULT_CONFIG
) -> str | None:
    """None when `mx_matmul_pallas` takes this problem with this config, else the reason it does not."""
    a_dtype, b_dtype = jnp.dtype(a_dtype), jnp.dtype(b_dtype)
    c = config
    if a_dtype not in FP8_DTYPES or b_dtype not in FP8_DTYPES:
        return f"operands must be float8_e4m3fn/float8_e5m2, got {a_dtype} and {b_dtype}"
    if a_dtype != b_dtype and not compat.MGPU_MIXED_FP8_WGMMA:
        return f"mixed fp8 operands ({a_dtype} x {b_dtype}) need jax >= 0.11 wgmma"
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        return f"out_dtype must be bf16, f16 or f32, got {jnp.dtype(out_dtype)}"
    if c.tile_m % 64 or c.tile_n % 8 or c.tile_n > 256 or c.tile_k % BLOCK or c.tile_k <= 0:
        return f"invalid tile {c.tile_m}x{c.tile_n}x{c.tile_k}: tile_m % 64, tile_n % 8 (<= 256), tile_k % 32"
    if c.tmp_slots not in (1, 2) or c.blocks_per_stage % c.tmp_slots:
        return f"tmp_slots must be 1 or 2 and divide tile_k // 32, got {c.tmp_slots} with tile_k {c.tile_k}"
    if c.acc_registers() > _ACC_REGISTERS:
        return (
            f"tile {c.tile_m}x{c.tile_n} with {c.tmp_slots} wgmma accumulator(s) needs {c.acc_registers()} f32 "
            f"registers per thread (> {_ACC_REGISTERS})"
        )
    if m % c.cta_tile_m or n % c.cta_tile_n or k % c.tile_k:
        return f"(M, N, K) = ({m}, {n}, {k}) must be multiples of ({c.cta_tile_m}, {c.cta_tile_n}, {c.tile_k})"
    if c.smem_bytes(out_dtype) > _SMEM_BYTES:
        return f"config needs {c.smem_bytes(out_dtype)} B of shared memory (> {_SMEM_BYTES})"
    return None


@device.lowered_once(('out_dtype', 'config', 'interpret'))
def mx_matmul_pallas(
    a: jax.Array,
    b_t: jax.Array,
    a_scales: jax.Array,
    b_scales: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    config: TileConfig = DEFAULT_CONFIG,
    interpret=None,
) -> jax.Array:
    """The Mosaic-GPU kernel. Raises NotImplementedError for problems outside its cover (see `pallas_cover`).

    `interpret`: None on the GPU, or a `compat.InterpretGPUParams` to run the kernel on CPU.
    """
    _check_args(a, b_t, a_scales, b_scales)
    m, k = a.shape
    n = b_t.shape[0]
    if (reason := pallas_cover(m, n, k, a.dtype, b_t.dtype, out_dtype, config)) is not None:
        raise NotImplementedError(f"mx_matmul_pallas: {reason}")
    fa = scale_factors(a_scales, config.tile_m)  # (K/32, M/tile_m, tile_m) f32
    fb = scale_factors(b_scales, config.tile_n)  # (K/32, N/tile_n, tile_n) f32
    tiles = (m // config.cta_tile_m) * (n // config.cta_tile_n)
    f = plgpu.kernel(
        functools.partial(_kernel, config=config),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(max(1, min(device.num_sms(interpret), tiles)),),
        grid_names=("cluster_grid",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
        kernel_name="mx_matmul",
    )
    return f(a, b_t, fa, fb)


# --------------------------------------------------------------------------------------------------------------
# XLA and Blackwell paths, dispatcher.
# --------------------------------------------------------------------------------------------------------------
def mx_matmul_xla(
    a: jax.Array, b_t: jax.Array, a_scales: jax.Array, b_scales: jax.Array, *, out_dtype=jnp.bfloat16
) -> jax.Array:
    """Dequantize to bf16 (exact) and an XLA bf16 dot contracting dim 1 of both (cuBLAS, f32 accumulation)."""
    a16 = mxf.mx_dequantize(a, a_scales, out_dtype=jnp.bfloat16)
    b16 = mxf.mx_dequantize(b_t, b_scales, out_dtype=jnp.bfloat16)
    # bf16 out straight from the GEMM, as the plain bf16 baseline; other outputs from the f32 result (XLA would
    # otherwise round a bf16 x bf16 -> f16 dot through bf16).
    pref = out_dtype if jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16) else jnp.float32
    out = lax.dot_general(a16, b16, (((1,), (1,)), ((), ())), preferred_element_type=pref)
    return out.astype(out_dtype)


def mx_matmul_blackwell(
    a: jax.Array, b_t: jax.Array, a_scales: jax.Array, b_scales: jax.Array, *, out_dtype=jnp.bfloat16
) -> jax.Array:
    """cuDNN's fused MX GEMM via `jax.nn.scaled_matmul` (compute capability >= 10.0). Untested on hardware.

    Its contract (docstring, jax 0.10.2 = 0.11.2): lhs (B, M, K), rhs (B, N, K), lhs_scales (B, M, K // 32),
    rhs_scales (B, N, K // 32), the contraction over the last dim of both; cuDNN needs e4m3fn/e5m2 elements,
    float8_e8m0fnu scales and block 32. The uint8 E8M0 bytes are reinterpreted bit for bit (0xFF stays NaN).
    """
    e8m0 = lambda s: lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)[None]  # (1, R, K // 32)
    out = jax.nn.scaled_matmul(
        a[None], b_t[None], e8m0(a_scales), e8m0(b_scales), preferred_element_type=out_dtype
    )  # (1, M, N)
    return out[0]


# Per-shape choice for impl="auto" on Hopper, from `python -m pallas_kernels.bench mx` on an H200:
# (M, N, K) -> the TileConfig that beat the XLA path there, or None where XLA won. Shapes not listed use
# AUTO_DEFAULT when the kernel covers them.
AUTO_TABLE: dict[tuple[int, int, int], TileConfig | None] = {}
AUTO_DEFAULT: TileConfig | None = DEFAULT_CONFIG


def auto_choice(m: int, n: int, k: int, a_dtype, b_dtype, out_dtype=jnp.bfloat16) -> str | TileConfig:
    """What impl="auto" runs: "blackwell", "xla", or the TileConfig of the Hopper kernel."""
    cc = device.compute_capability()
    if cc is not None and cc >= (10, 0):
        return "blackwell"
    if not device.kernels_apply():
        return "xla"
    config = AUTO_TABLE.get((m, n, k), AUTO_DEFAULT)
    if config is None or pallas_cover(m, n, k, a_dtype, b_dtype, out_dtype, config) is not None:
        return "xla"
    return config


def _check_args(a, b_t, a_scales, b_scales):
    if a.ndim != 2 or jnp.dtype(a.dtype) not in FP8_DTYPES:
        raise ValueError(f"mx_matmul: `a` must be a 2-D fp8 (M, K) array, got shape {a.shape} dtype {a.dtype}")
    if b_t.ndim != 2 or jnp.dtype(b_t.dtype) not in FP8_DTYPES:
        raise ValueError(f"mx_matmul: `b_t` must be a 2-D fp8 (N, K) array, got shape {b_t.shape} dtype {b_t.dtype}")
    if a.shape[1] != b_t.shape[1]:
        raise ValueError(f"mx_matmul: contraction sizes differ: a {a.shape} vs b_t {b_t.shape} (both K-major)")
    if a.shape[1] % BLOCK:
        raise ValueError(f"mx_matmul: K must be a multiple of {BLOCK}, got a {a.shape} and b_t {b_t.shape}")
    for name, s, rows in (("a_scales", a_scales, a.shape[0]), ("b_scales", b_scales, b_t.shape[0])):
        want = (rows, a.shape[1] // BLOCK)
        if s.dtype != jnp.uint8 or s.shape != want:
            raise ValueError(
                f"mx_matmul: `{name}` must be uint8 E8M0 of shape {want}, got shape {s.shape} dtype {s.dtype}"
            )


def mx_matmul(
    a: jax.Array,
    b_t: jax.Array,
    a_scales: jax.Array,
    b_scales: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    impl: Impl = "auto",
    config: TileConfig | None = None,
    interpret=None,
) -> jax.Array:
    """MX GEMM a (M, K) · b_t (N, K)ᵀ with uint8 E8M0 block scales (M, K // 32) / (N, K // 32) -> (M, N) out_dtype.

    impl: "auto" (blackwell on cc >= 10.0, the Hopper kernel where it is chosen and covers the shape, else xla),
    "pallas" (never falls back), "xla" (dequantize to bf16 + XLA bf16 dot), "reference" (f32 jnp),
    "blackwell" (`jax.nn.scaled_matmul`, cuDNN). `config` overrides the tile config of "pallas";
    `interpret` runs "pallas" in the CPU interpreter.
    """
    if impl not in IMPLS:
        raise ValueError(f"mx_matmul: impl must be one of {IMPLS}, got {impl!r}")
    _check_args(a, b_t, a_scales, b_scales)
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        raise ValueError(f"mx_matmul: out_dtype must be bf16, f16 or f32, got {out_dtype}")
    args = (a, b_t, a_scales, b_scales)
    if impl == "auto":
        chosen = auto_choice(a.shape[0], b_t.shape[0], a.shape[1], a.dtype, b_t.dtype, out_dtype)
        impl, config = ("pallas", chosen) if isinstance(chosen, TileConfig) else (chosen, None)
    if impl == "reference":
        return mx_matmul_reference(*args, out_dtype=out_dtype)
    if impl == "xla":
        return mx_matmul_xla(*args, out_dtype=out_dtype)
    if impl == "blackwell":
        return mx_matmul_blackwell(*args, out_dtype=out_dtype)
    return mx_matmul_pallas(*args, out_dtype=out_dtype, config=config or DEFAULT_CONFIG, interpret=interpret)
