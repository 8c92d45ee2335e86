"""Scaled fp8 GEMM for Hopper: out = (a · b_tᵀ) * a_scale[:, None] * b_scale[None, :].

    a    (M, K)  float8_e4m3fn | float8_e5m2, K-major (row-major)
    b_t  (N, K)  float8_e4m3fn | float8_e5m2, K-major: the right operand stored transposed
    a_scale (M,) or (), b_scale (N,) or ()  float32 dequantization multipliers
    out  (M, N)  out_dtype (bf16 by default), accumulated in float32

Rowwise scaling (one scale per row of `a`, one per row of `b_t`) is what TorchAO's "rowwise" recipe feeds
`torch._scaled_mm`; a scalar pair is the tensorwise recipe. Both scale vectors are constant along K, so they factor
out of the sum and are applied once per output element in the epilogue: acc[i, j] * a_scale[i] * b_scale[j].

Kernel (Mosaic-GPU, `plgpu.kernel`; after jax's hopper_matmul_mgpu.py, adapted to fp8):
- 8-bit wgmma needs both operands K-major (benchmarks/JAX_NOTES.md): A's smem tile is (tile_m, tile_k) and B's is
  (tile_n, tile_k), passed to wgmma as `b_smem.T` (a layout transform, no data movement). tile_k = 128 fp8 = 128 B
  rows -> 128 B swizzle.
- Warp specialization: one memory warpgroup issues the TMA loads of a `stages`-deep ring; two compute warpgroups
  split the CTA tile along M or N (`wg_split`) and each owns a (tile_m, tile_n) f32 accumulator.
- Two rings (`ring`): jax's `emit_pipeline_warp_specialized` ("pipeline"), or a hand-rolled one ("static",
  `_static_ring_kernel`) whose K loop is unrolled by `stages` so every slot index and wgmma descriptor is a
  constant, and whose loads are issued by one warp instead of the whole memory warpgroup. impl="auto" runs the
  static ring with 64x256 warpgroup tiles (CTA 128x256, 4 stages) wherever the K steps divide by 4.
- Persistent grid: min(#SMs, #tiles) CTAs walk the output tiles along a planar snake (`grid_minor`,
  `grid_tile_width`) so that neighbouring CTAs share A rows / B columns in L2. Optional 2-CTA clusters multicast
  the shared operand (`cluster`). Each CTA takes every grid-th tile, or, with `schedule="dynamic"` (impl="auto"
  per device of a multi-device mesh, where collectives run beside the GEMMs), its next tile from an atomic counter
  (pallas_kernels/tile_queue.py). On 4 x H200, four 8192 x 4096 x 14336 GEMMs beside a 235 MB reduce-scatter
  took 19% longer than alone with the static stride (clustered), 8% with the dynamic schedule, 6% for cuBLASLt;
  alone the dynamic schedule, which has no cluster, is 1% slower (RESULTS.md, session 41).
- Epilogue: each compute warpgroup TMA-loads its a_scale / b_scale slices into SMEM at the start of the tile (they
  arrive during the main loop; reading them straight from GMEM does not lower on the GPU), then multiplies the
  accumulator by both, casts to out_dtype, stages the tile in SMEM and TMA-stores it.
- Numerics: the whole K is accumulated in the wgmma accumulator, whose fp8 accumulation keeps ~14 mantissa
  bits on Hopper (DeepSeek-V3 report §3.3.2). That is TorchAO's use_fast_accum=True; promoting to a separate f32
  accumulator every few K steps (CUTLASS's default, DeepGEMM) would double the accumulator registers.
- Trade-offs: the two compute warpgroups work on the same tile, so their epilogues do not overlap tensor-core work;
  the memory warpgroup prefetches the next tile's first stages meanwhile. The static ring can carry a tile's last
  `overlap_chunks` epilogue chunks in registers into the next tile and store one per K step while that step's wgmma
  runs (impl="auto": 4 of 8, 32 registers; all 8 spilled and slowed every K step by a third). Mosaic GPU's profiler
  (benchmarks/profile_tiles.py, RESULTS.md session 31) puts a 128x256x128 K step at 1,024 cycles, the tensor cores'
  peak, and the time between two tiles at 3.4k cycles serial and 2.4k with 4 chunks carried; sustained at the
  700 W limit that gains 0.7-1.0% at K = 4096 and 8192 and nothing at 14336. Measured at 8192^3 (benchmarks/RESULTS.md,
  sixth pass) the scale multiply costs nothing and the TMA store 1-4%, and TFLOP/s does not rise with K (fewer
  epilogues per FLOP) from K = 4096 on. Two schedules that attack the per-tile cost were built and measured
  (commit 0deee3c, RESULTS.md eighth pass) and not kept: chaining the tiles' TMA rings (jax's PipelinePipeline,
  so the next tile's loads overlap this epilogue) changed nothing beyond run-to-run noise, and a ping-pong schedule
  (each warpgroup owns whole 128x128 tiles, one's epilogue under the other's wgmmas; with or without 2-CTA
  multicast) lost 0-9% at K >= 8192: one warpgroup alone does not keep the tensor cores as busy as two (a 64x256
  warpgroup tile alone ran at ~1,000 TFLOP/s). Nsight Compute later showed ping-pong with 5 stages needing 2-9%
  fewer cycles than the cooperative kernel, but at the power limit it spent more energy per FLOP (twice the TMA
  issue work, 128x128 tiles read 1.33x the operand bytes) and the clustered cooperative kernel outran it at every
  shape tried (RESULTS.md, ninth pass). At K = 2048 (16 steps per tile) the per-tile cost shows. At the
  H200's 700 W limit the kernel, like cuBLASLt, runs at ~1,400 MHz, so energy per FLOP sets its speed: impl="auto"
  runs 2-CTA clusters along M (the B tile multicast, a third less L2 -> SMEM traffic), which gain 0-3% there.
  The last round of tiles is partly empty at most shapes (8192^3: 15.5 rounds of 66 clusters), which costs 2-3% even
  at the power limit (M grown to whole rounds gains that; RESULTS.md, seventeenth pass). A hybrid Stream-K that
  shared the last rounds out by K (commit 6002d38) was correct but 4-7% slower: its partial exchange spilled
  registers, and units at different K offsets lose the L2 reuse of tiles that move through K in step.
  Nsight Compute at 8192^3 (RESULTS.md, ninth and fifteenth passes): jax's pipeline ring with 128x128 warpgroup
  tiles executes 125 M warp instructions, 2.4x cuBLASLt's 51 M: `step % 3` and slot addresses in every K step, and
  all four warps of the memory warpgroup running the load loop. The static ring with 64x256 warpgroup tiles
  executes 48 M, takes 1% fewer cycles (tensor pipe busy 95% of active cycles; cuBLASLt 96%) and, at the power
  limit, runs 0.6-3.4% faster at 14 of the 17 AUTO_TABLE shapes. Its 64x256 wgmmas read each B row from SMEM once
  per K step; two 64x128 wgmmas per 128x128 tile read it twice.
  Scalars are broadcast to vectors so one kernel serves both recipes.

The dispatcher's `impl="xla"` is the best path without a custom kernel: `lax.dot_general` of the two fp8 operands
contracting dim 1 of both with an f32 result (XLA emits cuBLASLt `__cublas$lt$matmul$f8`), scales applied by an XLA
fusion on the f32 result.
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
from pallas_kernels import device, tile_queue

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
Impl = Literal["auto", "pallas", "xla", "reference"]
_SMEM_BYTES = 227 * 1024  # Hopper opt-in shared memory per block
_BARRIER_BYTES = 1024  # mbarriers and their alignment (measured: ~600 B beyond the buffers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig:
    """One point of the tile sweep. The CTA tile is two warpgroup tiles side by side along `wg_split`."""

    tile_m: int = 128  # C rows per compute warpgroup; multiple of 64 (wgmma M)
    tile_n: int = 128  # C cols per compute warpgroup; multiple of 8, <= 256 (wgmma N)
    tile_k: int = 128  # K per pipeline stage; 128 fp8 = 128 B = the widest swizzle
    stages: int = 3  # TMA ring depth (max_concurrent_steps)
    wg_split: Literal["m", "n"] = "n"  # the 2 compute warpgroups split the CTA tile along this dim
    epi_tile_m: int | None = None  # epilogue store chunk rows; None = the whole warpgroup tile
    epi_tile_n: int | None = None  # epilogue store chunk cols; None = the whole warpgroup tile
    grid_minor: Literal["m", "n"] = "n"  # planar-snake minor dim of the persistent tile walk
    grid_tile_width: int = 8  # planar-snake band width, in CTA (cluster) tiles
    cluster: Literal["m", "n"] | None = None  # 2-CTA cluster along this dim; the shared operand is multicast
    delay_release: int = 1  # wgmma groups left in flight before a stage is released (0 = wait for each)
    ring: Literal["pipeline", "static"] = "pipeline"  # "static": hand-rolled ring, K loop unrolled by `stages`
    # static ring only: a tile's last `overlap_chunks` epilogue chunks stay in registers and are stored during the
    # next tile's first K steps (one per step); the rest are stored before that tile starts
    overlap_chunks: int = 0
    # static ring only: "dynamic" hands out the tiles after each CTA's first one through an atomic counter in GMEM
    # (`tile_queue.TileQueue`), so CTAs that start late (their SMs held by a collective's kernel) take fewer tiles
    schedule: Literal["static", "dynamic"] = "static"

    @property
    def cta_tile_m(self) -> int:
        return self.tile_m * (2 if self.wg_split == "m" else 1)

    @property
    def cta_tile_n(self) -> int:
        return self.tile_n * (2 if self.wg_split == "n" else 1)

    @property
    def cluster_tile_m(self) -> int:
        return self.cta_tile_m * (2 if self.cluster == "m" else 1)

    @property
    def cluster_tile_n(self) -> int:
        return self.cta_tile_n * (2 if self.cluster == "n" else 1)

    @property
    def epi_m(self) -> int:
        return self.epi_tile_m or self.tile_m

    @property
    def epi_n(self) -> int:
        return self.epi_tile_n or self.tile_n

    def out_slots(self) -> int:
        """Epilogue staging buffers per warpgroup: 1 when the whole tile is staged at once, else 2 (ping-pong)."""
        return 1 if self.epi_m * self.epi_n == self.tile_m * self.tile_n else 2

    def smem_bytes(self, out_dtype=jnp.bfloat16) -> int:
        """Shared memory the kernel allocates: operand ring + epilogue staging + scale vectors + a barrier reserve."""
        ring = self.stages * (self.cta_tile_m + self.cta_tile_n) * self.tile_k  # fp8: 1 byte per element
        out = 2 * self.out_slots() * self.epi_m * self.epi_n * jnp.dtype(out_dtype).itemsize
        scales = 2 * (self.tile_m + self.tile_n) * 4
        return ring + out + scales + _BARRIER_BYTES

    def name(self) -> str:
        s = f"wg{self.tile_m}x{self.tile_n}x{self.tile_k}/{self.wg_split} s{self.stages} d{self.delay_release}"
        if self.epi_tile_m or self.epi_tile_n:
            s += f" epi{self.epi_m}x{self.epi_n}"
        s += f" snake-{self.grid_minor}{self.grid_tile_width}"
        if self.cluster:
            s += f" cl2{self.cluster}"
        if self.ring == "static":
            s += " static"
        if self.overlap_chunks:
            s += f" overlap{self.overlap_chunks}"
        if self.schedule == "dynamic":
            s += " dyn"
        return s


DEFAULT_CONFIG = TileConfig()


# --------------------------------------------------------------------------------------------------------------
# Reference: the spec, pure jnp, f32 accumulation.
# --------------------------------------------------------------------------------------------------------------
def fp8_matmul_reference(
    a: jax.Array, b_t: jax.Array, a_scale: jax.Array, b_scale: jax.Array, *, out_dtype=jnp.bfloat16
) -> jax.Array:
    """(a · b_tᵀ) * a_scale[:, None] * b_scale[None, :] with every operand upcast to f32."""
    acc = jnp.dot(a.astype(jnp.float32), b_t.astype(jnp.float32).T, precision=lax.Precision.HIGHEST)
    return (acc * _col(a_scale) * _row(b_scale)).astype(out_dtype)


def _col(s: jax.Array) -> jax.Array:
    s = jnp.asarray(s, jnp.float32)
    return s if s.ndim == 0 else s[:, None]


def _row(s: jax.Array) -> jax.Array:
    s = jnp.asarray(s, jnp.float32)
    return s if s.ndim == 0 else s[None, :]


# --------------------------------------------------------------------------------------------------------------
# Mosaic-GPU kernels.
# --------------------------------------------------------------------------------------------------------------
def _smem_transforms(c: TileConfig, out_dtype):
    """SMEM layouts of the fp8 operand tiles (tile_k bytes per row) and of the epilogue's staging chunks."""
    swizzle = plgpu.find_swizzle(c.tile_k * 8)
    in_transforms = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    out_bits = jnp.dtype(out_dtype).itemsize * 8
    out_swizzle = plgpu.find_swizzle(c.epi_n * out_bits)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle * 8 // out_bits)), plgpu.SwizzleTransform(out_swizzle))
    return in_transforms, out_transforms


@dataclasses.dataclass(frozen=True)
class _Tile:
    """Where one output tile lies: the CTA's rows and columns, this warpgroup's part of them, its first row and
    column in the output."""

    cta_rows: pl.Slice
    cta_cols: pl.Slice
    wg_rows: pl.Slice | slice
    wg_cols: pl.Slice | slice
    row0: jax.Array
    col0: jax.Array


def _tile(c: TileConfig, lin, wg, m_iters: int, n_iters: int) -> _Tile:
    """The `lin`-th output tile of the planar snake, for compute warpgroup `wg`."""
    mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 0 if c.grid_minor == "m" else 1, c.grid_tile_width)
    cta = lax.axis_index("cluster")
    if c.cluster == "m":
        mi = mi * 2 + cta
    elif c.cluster == "n":
        ni = ni * 2 + cta
    cta_rows = pl.ds(mi * c.cta_tile_m, c.cta_tile_m)
    cta_cols = pl.ds(ni * c.cta_tile_n, c.cta_tile_n)
    if c.wg_split == "m":
        return _Tile(cta_rows, cta_cols, pl.ds(wg * c.tile_m, c.tile_m), slice(None),
                     mi * c.cta_tile_m + wg * c.tile_m, ni * c.cta_tile_n)
    return _Tile(cta_rows, cta_cols, slice(None), pl.ds(wg * c.tile_n, c.tile_n),
                 mi * c.cta_tile_m, ni * c.cta_tile_n + wg * c.tile_n)


def _load_scales(c: TileConfig, t: _Tile, wg, a_scale_gmem, b_scale_gmem, a_scale_smem, b_scale_smem, scale_barrier):
    """Start the TMA loads of this warpgroup's scale slices; they land while the K loop runs."""
    plgpu.copy_gmem_to_smem(a_scale_gmem.at[pl.ds(t.row0, c.tile_m)], a_scale_smem.at[wg], scale_barrier.at[wg])
    plgpu.copy_gmem_to_smem(b_scale_gmem.at[pl.ds(t.col0, c.tile_n)], b_scale_smem.at[wg], scale_barrier.at[wg])


def _scaled_out(wg, acc, out_dtype, a_scale_smem, b_scale_smem, scale_barrier):
    """acc (tile_m, tile_n) f32 times both scale slices, cast to out_dtype."""
    plgpu.barrier_wait(scale_barrier.at[wg])
    acc = acc * lax.broadcast_in_dim(a_scale_smem[wg], acc.shape, [0])  # (tile_m,)
    acc = acc * lax.broadcast_in_dim(b_scale_smem[wg], acc.shape, [1])  # (tile_n,)
    return acc.astype(out_dtype)


def _store_chunk(c: TileConfig, wg, vals, idx: int, row0, col0, out_gmem, out_smem):
    """Stage epilogue chunk `idx` (row-major over the warpgroup tile), `vals` (epi_m, epi_n), in SMEM and TMA-store it
    to the warpgroup tile at (row0, col0). It first waits until the chunk that last used its slot has left SMEM:
    chunk 0 for every earlier store (the previous tile's last chunk may have used either slot), later chunks for
    all but the latest one (with two slots, the other slot's). Chunks are stored in index order."""
    ei, ej = divmod(idx, c.tile_n // c.epi_n)
    slots = c.out_slots()
    plgpu.wait_smem_to_gmem(0 if idx == 0 else slots - 1, wait_read_only=True)
    out_smem[wg, idx % slots] = vals
    plgpu.commit_smem()
    # row0 and col0 start a warpgroup tile; carried through a loop, Mosaic no longer sees that (its TMA lowering
    # needs the alignment).
    row0, col0 = pl.multiple_of(row0, c.tile_m), pl.multiple_of(col0, c.tile_n)
    dst = out_gmem.at[pl.ds(row0 + ei * c.epi_m, c.epi_m), pl.ds(col0 + ej * c.epi_n, c.epi_n)]
    plgpu.copy_smem_to_gmem(out_smem.at[wg, idx % slots], dst)


def _num_chunks(c: TileConfig) -> int:
    return (c.tile_m // c.epi_m) * (c.tile_n // c.epi_n)


def _chunk(c: TileConfig, out, idx: int):
    ei, ej = divmod(idx, c.tile_n // c.epi_n)
    return out[ei * c.epi_m : (ei + 1) * c.epi_m, ej * c.epi_n : (ej + 1) * c.epi_n]


def _store_tile(c: TileConfig, t: _Tile, wg, acc, out_gmem, out_smem, a_scale_smem, b_scale_smem, scale_barrier):
    """Epilogue: acc (tile_m, tile_n) f32 times both scale slices, cast, staged in SMEM chunks and TMA-stored."""
    out = _scaled_out(wg, acc, out_gmem.dtype, a_scale_smem, b_scale_smem, scale_barrier)
    for idx in range(_num_chunks(c)):
        _store_chunk(c, wg, _chunk(c, out, idx), idx, t.row0, t.col0, out_gmem, out_smem)


def _kernel(a_gmem, b_gmem, a_scale_gmem, b_scale_gmem, out_gmem, *, config: TileConfig):
    """One persistent CTA: walks its output tiles; per tile a warp-specialized TMA/wgmma pipeline over K."""
    c = config
    m, k = a_gmem.shape
    n = b_gmem.shape[0]
    out_dtype = out_gmem.dtype
    m_iters, n_iters, k_iters = m // c.cluster_tile_m, n // c.cluster_tile_n, k // c.tile_k
    in_transforms, out_transforms = _smem_transforms(c, out_dtype)

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(  # A tile (cta_tile_m, tile_k); shared by the CTAs of an n-cluster
                    (c.cta_tile_m, c.tile_k),
                    lambda kk: (0, kk),
                    transforms=in_transforms,
                    memory_space=plgpu.SMEM,
                    delay_release=c.delay_release,
                    collective_axes=("cluster",) if c.cluster == "n" else (),
                ),
                plgpu.BlockSpec(  # B tile (cta_tile_n, tile_k), K-major
                    (c.cta_tile_n, c.tile_k),
                    lambda kk: (0, kk),
                    transforms=in_transforms,
                    memory_space=plgpu.SMEM,
                    delay_release=c.delay_release,
                    collective_axes=("cluster",) if c.cluster == "m" else (),
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=c.stages,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
        out_smem=plgpu.SMEM((2, c.out_slots(), c.epi_m, c.epi_n), out_dtype, transforms=out_transforms),
        a_scale_smem=plgpu.SMEM((2, c.tile_m), jnp.float32),
        b_scale_smem=plgpu.SMEM((2, c.tile_n), jnp.float32),
        scale_barrier=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        # Arrived on by both compute warpgroups of every CTA of the cluster (a multicast load writes the peer's
        # stage too); the pipeline's own consumed barriers are built the same way.
        acc_done_barrier=(
            plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=2)
            if c.cluster
            else plgpu.Barrier(num_arrivals=2)
        ),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem, a_scale_smem, b_scale_smem, scale_barrier, acc_done_barrier):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
        def _tile_loop(info):
            t = _tile(c, info.index[0], wg, m_iters, n_iters)

            def compute_context(eval_pipeline):
                _load_scales(c, t, wg, a_scale_gmem, b_scale_gmem, a_scale_smem, b_scale_smem, scale_barrier)

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
                def _acc_scope(acc_ref):
                    eval_pipeline(acc_ref)
                    acc = acc_ref[...]  # (tile_m, tile_n) f32; waits for the last wgmma
                    if c.delay_release:
                        plgpu.barrier_arrive(acc_done_barrier)
                    _store_tile(c, t, wg, acc, out_gmem, out_smem, a_scale_smem, b_scale_smem, scale_barrier)

            def mma_body(_, a_smem, b_smem, acc_ref):
                plgpu.wgmma(acc_ref, a_smem.at[t.wg_rows], b_smem.at[t.wg_cols].T)
                plgpu.wgmma_wait(c.delay_release)
                return acc_ref

            pipeline(mma_body, compute_context)(
                a_gmem.at[t.cta_rows, :], b_gmem.at[t.cta_cols, :], allocations=pipeline_allocs
            )
            if c.delay_release:
                # With delay_release the pipeline never marks the last K step's stage consumed, so the memory
                # warpgroup's next prologue could overwrite it under the last in-flight wgmma: it first waits for
                # the compute warpgroups (of the whole cluster) to have drained their accumulators (they arrive
                # in the epilogue).
                @pl.when(wg == 2)
                def _():
                    plgpu.barrier_wait(acc_done_barrier)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _static_ring_kernel(
    a_gmem, b_gmem, a_scale_gmem, b_scale_gmem, out_gmem, *, config: TileConfig, producer_warp: bool = True
):
    """The cooperative kernel of `_kernel` with a hand-rolled TMA ring: K loop unrolled by `stages`, one producer warp.

    Every tile's K steps are a multiple of `stages`, so step s of an unrolled group always uses ring slot s: slot
    indices, SMEM addresses and wgmma descriptors are compile-time constants, where jax's pipeline computes
    `step % stages` (64-bit multiply-high sequences at 3 stages) and the slot's addresses at run time in every K step.
    One warp of the memory warpgroup issues the loads (`plgpu.warp_map`); in the pipeline all four run the loop and
    spin on its barriers. It waits for a slot's release from the kernel's second round on and drains the last round
    before the CTA exits (with a cluster the peer CTA arrives on this CTA's barriers remotely). Nsight Compute at
    8192^3 (RESULTS.md, fifteenth pass): 125 M warp instructions (the pipeline, 3 stages) -> 91 M (this kernel, the
    same 128x128 warpgroup tiles) -> 48 M with 64x256 warpgroup tiles, whose wgmmas read each B row from SMEM once
    instead of twice (cuBLASLt: 51 M).
    """
    c = config
    m, k = a_gmem.shape
    n = b_gmem.shape[0]
    out_dtype = out_gmem.dtype
    m_iters, n_iters, k_iters = m // c.cluster_tile_m, n // c.cluster_tile_n, k // c.tile_k
    stages = c.stages
    rounds = k_iters // stages
    in_transforms, out_transforms = _smem_transforms(c, out_dtype)

    @functools.partial(
        pl.run_scoped,
        a_smem=plgpu.SMEM((stages, c.cta_tile_m, c.tile_k), a_gmem.dtype, transforms=in_transforms),
        b_smem=plgpu.SMEM((stages, c.cta_tile_n, c.tile_k), b_gmem.dtype, transforms=in_transforms),
        out_smem=plgpu.SMEM((2, c.out_slots(), c.epi_m, c.epi_n), out_dtype, transforms=out_transforms),
        a_scale_smem=plgpu.SMEM((2, c.tile_m), jnp.float32),
        b_scale_smem=plgpu.SMEM((2, c.tile_n), jnp.float32),
        produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # the A and B loads of a slot
        # Released by both compute warpgroups of every CTA of the cluster (a multicast load writes the peer's slot).
        consumed=(
            plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=2, num_barriers=stages)
            if c.cluster
            else plgpu.Barrier(num_arrivals=2, num_barriers=stages)
        ),
        scale_barrier=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        **(tile_queue.scratch() if c.schedule == "dynamic" else {}),  # the dynamic schedule's tile queue
        collective_axes="wg",
    )
    def _scope(a_smem, b_smem, out_smem, a_scale_smem, b_scale_smem, produced, consumed, scale_barrier, **queue_refs):
        wg = lax.axis_index("wg")
        total = m_iters * n_iters
        queue = tile_queue.TileQueue("cluster_grid", **queue_refs) if queue_refs else None

        def walk(body, init=None):
            """body(lin, local_index, carry) -> carry over this CTA's tiles, in order: the persistent grid's static
            stride, or the tiles the producer publishes in the queue (compute warpgroups only)."""
            if queue is None:
                if init is None:
                    plgpu.nd_loop((total,), collective_axes="cluster_grid")(
                        lambda info: body(info.index[0], info.local_index, None))
                    return None
                return plgpu.nd_loop((total,), collective_axes="cluster_grid", init_carry=init)(
                    lambda info, carry: body(info.index[0], info.local_index, carry))

            def step(st):
                i, lin, carry = st
                carry = body(lin, i, carry)
                return i + 1, queue.take(i + 1), carry

            return lax.while_loop(lambda st: st[1] < total, step, (jnp.int32(0), queue.first(), init))[2]

        def producer():
            def load_tile(lin, local_index):
                t = _tile(c, lin, 0, m_iters, n_iters)  # the CTA's rows and columns

                @pl.loop(0, rounds)
                def _round(r):
                    refill = jnp.logical_or(r > 0, local_index > 0)
                    for s in range(stages):
                        @pl.when(refill)
                        def _():
                            plgpu.barrier_wait(consumed.at[s])

                        ks = pl.ds((r * stages + s) * c.tile_k, c.tile_k)
                        plgpu.copy_gmem_to_smem(
                            a_gmem.at[t.cta_rows, ks], a_smem.at[s], produced.at[s],
                            collective_axes="cluster" if c.cluster == "n" else None,
                        )
                        plgpu.copy_gmem_to_smem(
                            b_gmem.at[t.cta_cols, ks], b_smem.at[s], produced.at[s],
                            collective_axes="cluster" if c.cluster == "m" else None,
                        )

            if queue is None:
                plgpu.nd_loop((total,), collective_axes="cluster_grid")(
                    lambda info: load_tile(info.index[0], info.local_index))
            else:
                # Publish the next tile before loading this one, so that it waits in the queue by the time the
                # compute warpgroups finish this one.
                def step(st):
                    i, lin = st
                    nxt = queue.put_next(i + 1)
                    load_tile(lin, i)
                    return i + 1, nxt

                lax.while_loop(lambda st: st[1] < total, step, (jnp.int32(0), queue.first()))

            for s in range(stages):  # the last round's releases (remote ones too) land before this CTA exits
                plgpu.barrier_wait(consumed.at[s])

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            # jax 0.10.2 (compat.MGPU_WARP_MAP); the dynamic schedule's loop and scalar reads do not lower in a
            # single warp's code either.
            if not producer_warp or queue is not None:
                producer()
                return

            # One warp issues the loads; the warpgroup's other three wait at a hardware barrier meanwhile instead of
            # running (and spinning in) the same loop.
            @plgpu.warp_map
            def _per_warp(warp):
                pl.when(warp == 0)(producer)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            chunks = _num_chunks(c)
            first = chunks - c.overlap_chunks  # the first chunk stored during the next tile (one row of chunks)

            def k_loop(acc_ref, t, prev):
                """The tile's K steps. `prev`: the previous tile's carried columns (tile_m, overlap_chunks * epi_n),
                its first row and column, and whether there is one; K step j stores its chunk first + j while the
                step's wgmma runs (chunks past the last step right after the loop)."""

                def store_prev(j):
                    vals, row0, col0, live = prev
                    part = vals[:, j * c.epi_n : (j + 1) * c.epi_n]
                    pl.when(live)(lambda: _store_chunk(c, wg, part, first + j, row0, col0, out_gmem, out_smem))

                @pl.loop(0, rounds)
                def _round(r):
                    for s in range(stages):
                        plgpu.barrier_wait(produced.at[s])
                        plgpu.wgmma(acc_ref, a_smem.at[s].at[t.wg_rows], b_smem.at[s].at[t.wg_cols].T)
                        for r0 in range(-(-c.overlap_chunks // stages)):  # carried chunk r * stages + s
                            if r0 * stages + s < c.overlap_chunks:
                                pl.when(r == r0)(functools.partial(store_prev, r0 * stages + s))
                        plgpu.wgmma_wait(c.delay_release)
                        if not c.delay_release:
                            plgpu.barrier_arrive(consumed.at[s])
                        elif s:
                            plgpu.barrier_arrive(consumed.at[s - 1])
                        else:
                            @pl.when(r > 0)
                            def _():
                                plgpu.barrier_arrive(consumed.at[stages - 1])

                for j in range(rounds * stages, c.overlap_chunks):  # carried chunks the K loop had no step for
                    store_prev(j)

            def drain(acc_ref):
                acc = acc_ref[...]  # waits for the last wgmma
                if c.delay_release:
                    plgpu.barrier_arrive(consumed.at[stages - 1])
                return acc

            if not c.overlap_chunks:
                def tile_body(lin, _local_index, _carry):
                    with jax.named_scope("decode"):  # spans of device.profiler_params' traces
                        t = _tile(c, lin, wg, m_iters, n_iters)
                        _load_scales(c, t, wg, a_scale_gmem, b_scale_gmem, a_scale_smem, b_scale_smem, scale_barrier)

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
                    def _acc_scope(acc_ref):
                        with jax.named_scope("k_loop"):
                            k_loop(acc_ref, t, None)
                        with jax.named_scope("drain"):
                            acc = drain(acc_ref)
                        with jax.named_scope("epilogue"):
                            _store_tile(c, t, wg, acc, out_gmem, out_smem, a_scale_smem, b_scale_smem, scale_barrier)

                walk(tile_body)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                return

            # Overlapped epilogue: the tile's last chunks stay in registers (the loop carry) and are stored during
            # the next tile's first K steps; the CTA's last tile stores them after the loop.
            carried = (c.tile_m, c.overlap_chunks * c.epi_n)
            zero = pl.run_scoped(lambda r: r[...].astype(out_dtype), plgpu.ACC(carried, jnp.float32))
            init = (zero, jnp.int32(0), jnp.int32(0), jnp.bool_(False))

            def tile_body(lin, _local_index, carry):
                with jax.named_scope("decode"):
                    t = _tile(c, lin, wg, m_iters, n_iters)
                    _load_scales(c, t, wg, a_scale_gmem, b_scale_gmem, a_scale_smem, b_scale_smem, scale_barrier)

                def body(acc_ref):
                    with jax.named_scope("k_loop"):
                        k_loop(acc_ref, t, carry)
                    with jax.named_scope("drain"):
                        out = _scaled_out(wg, drain(acc_ref), out_dtype, a_scale_smem, b_scale_smem, scale_barrier)
                    with jax.named_scope("epilogue"):
                        for idx in range(first):
                            _store_chunk(c, wg, _chunk(c, out, idx), idx, t.row0, t.col0, out_gmem, out_smem)
                    # (traced: a literal True does not lower)
                    return out[:, first * c.epi_n :], t.row0, t.col0, lin >= 0

                return pl.run_scoped(body, plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))

            vals, row0, col0, live = walk(tile_body, init)

            @pl.when(live)
            def _last():
                for j in range(c.overlap_chunks):
                    _store_chunk(c, wg, vals[:, j * c.epi_n : (j + 1) * c.epi_n], first + j, row0, col0, out_gmem,
                                 out_smem)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def pallas_cover(
    m: int, n: int, k: int, a_dtype, b_dtype, out_dtype=jnp.bfloat16, config: TileConfig = DEFAULT_CONFIG
) -> str | None:
    """None when `fp8_matmul_pallas` takes this problem with this config, else the reason it does not."""
    a_dtype, b_dtype = jnp.dtype(a_dtype), jnp.dtype(b_dtype)
    c = config
    if a_dtype not in FP8_DTYPES or b_dtype not in FP8_DTYPES:
        return f"operands must be float8_e4m3fn/float8_e5m2, got {a_dtype} and {b_dtype}"
    if a_dtype != b_dtype and not compat.MGPU_MIXED_FP8_WGMMA:
        return f"mixed fp8 operands ({a_dtype} x {b_dtype}) need jax >= 0.11 wgmma"
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return f"out_dtype must be bf16, f16 or f32, got {jnp.dtype(out_dtype)}"
    if c.tile_m % 64 or c.tile_n % 8 or c.tile_n > 256 or c.tile_k % 32:
        return f"invalid tile {c.tile_m}x{c.tile_n}x{c.tile_k}: tile_m % 64, tile_n % 8 (<= 256), tile_k % 32"
    if c.tile_m % c.epi_m or c.tile_n % c.epi_n:
        return f"epilogue chunk {c.epi_m}x{c.epi_n} must divide the warpgroup tile {c.tile_m}x{c.tile_n}"
    if m % c.cluster_tile_m or n % c.cluster_tile_n or k % c.tile_k:
        return (
            f"(M, N, K) = ({m}, {n}, {k}) must be multiples of ({c.cluster_tile_m}, {c.cluster_tile_n}, {c.tile_k})"
        )
    if c.stages <= c.delay_release:
        return f"stages ({c.stages}) must exceed delay_release ({c.delay_release})"
    if c.overlap_chunks and (c.ring != "static" or c.epi_m != c.tile_m or c.overlap_chunks > _num_chunks(c)):
        return (f"overlap_chunks={c.overlap_chunks} needs the static ring and one row of at least that many "
                f"epilogue chunks (epi_tile_m = tile_m)")
    if c.schedule == "dynamic" and (c.ring != "static" or c.cluster or not compat.MGPU_TILE_QUEUE):
        return "the dynamic schedule needs the static ring, no cluster and jax >= 0.11 (compat.MGPU_TILE_QUEUE)"
    if c.ring == "static" and (k // c.tile_k) % c.stages:
        return f"the static ring needs K / tile_k ({k // c.tile_k}) to be a multiple of the stages ({c.stages})"
    if c.smem_bytes(out_dtype) > _SMEM_BYTES:
        return f"config needs {c.smem_bytes(out_dtype)} B of shared memory (> {_SMEM_BYTES})"
    return None


def fit_config(config: TileConfig, out_dtype) -> TileConfig:
    """`config`, made to fit SMEM for this output dtype: the epilogue staged in 64x64 chunks when a whole-tile
    staging buffer would overflow (an f32 output: 2 x 128x128x4 B next to a 144 KiB operand ring); then, for the
    static ring (whose stages must divide the K steps), the chunk's columns halved down to 16; then fewer pipeline
    stages while it still does (a 4-stage config measured with bf16 output, run for an f32 weight grad)."""
    fits = lambda c: c.smem_bytes(out_dtype) <= _SMEM_BYTES
    if not fits(config) and config.epi_tile_m is None and config.epi_tile_n is None:
        config = dataclasses.replace(config, epi_tile_m=min(64, config.tile_m), epi_tile_n=min(64, config.tile_n))
    while not fits(config) and config.ring == "static" and config.epi_n > 16:  # rows stay 64 (the wgmma layout's)
        config = dataclasses.replace(config, epi_tile_n=config.epi_n // 2)
    while not fits(config) and config.stages > max(2, config.delay_release + 1):
        config = dataclasses.replace(config, stages=config.stages - 1)
    return config


@device.lowered_once(('out_dtype', 'config', 'interpret'))
def fp8_matmul_pallas(
    a: jax.Array,
    b_t: jax.Array,
    a_scale: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    config: TileConfig = DEFAULT_CONFIG,
    interpret=None,
) -> jax.Array:
    """The Mosaic-GPU kernel. Raises NotImplementedError for problems outside its cover (see `pallas_cover`).

    `interpret`: None on the GPU, or a `compat.InterpretGPUParams` to run the kernel on CPU.
    """
    m, k = a.shape
    n = b_t.shape[0]
    if (reason := pallas_cover(m, n, k, a.dtype, b_t.dtype, out_dtype, config)) is not None:
        raise NotImplementedError(f"fp8_matmul_pallas: {reason}")
    a_scale = jnp.broadcast_to(jnp.asarray(a_scale, jnp.float32), (m,))
    b_scale = jnp.broadcast_to(jnp.asarray(b_scale, jnp.float32), (n,))
    if interpret is not None and config.schedule == "dynamic":  # the interpreter has no GMEM atomics: same tiles
        config = dataclasses.replace(config, schedule="static")
    cluster_size = 2 if config.cluster else 1
    tiles = (m // config.cluster_tile_m) * (n // config.cluster_tile_n)
    grid = max(1, min(device.num_sms(interpret) // cluster_size, tiles))
    if config.ring == "static":
        body = functools.partial(_static_ring_kernel, config=config, producer_warp=compat.MGPU_WARP_MAP)
    else:
        body = functools.partial(_kernel, config=config)
    f = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(grid,),
        grid_names=("cluster_grid",),
        cluster=(cluster_size,),
        cluster_names=("cluster",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **device.profiler_params()
        ),
        interpret=interpret,
        kernel_name="fp8_matmul",
    )
    return f(a, b_t, a_scale, b_scale)


# --------------------------------------------------------------------------------------------------------------
# XLA path and dispatcher.
# --------------------------------------------------------------------------------------------------------------
def fp8_matmul_xla(
    a: jax.Array, b_t: jax.Array, a_scale: jax.Array, b_scale: jax.Array, *, out_dtype=jnp.bfloat16
) -> jax.Array:
    """cuBLASLt fp8 through XLA: both operands K-major (contract dim 1 of both), f32 result, scales in a fusion."""
    acc = lax.dot_general(a, b_t, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (acc * _col(a_scale) * _row(b_scale)).astype(out_dtype)


# Per-shape choice for impl="auto" on Hopper: (M, N, K) -> the TileConfig to run, or None where XLA wins. Shapes not
# listed use AUTO_DEFAULT when the kernel covers them. Chosen by sustained throughput at the H200's 700 W power
# limit, the state a training run's GEMMs run in (`benchmarks/gemm_clock.py --sustained-sweep`, each kernel run 1 s,
# all of them twice in the same order; benchmarks/RESULTS.md, fifteenth pass, jax 0.11.2, 2026-11-22). The comments
# give those TFLOP/s: the chosen config vs the jax-pipeline kernel chosen before (ninth pass) and XLA's fp8 path with
# the same rowwise scales. The static ring with 64x256 warpgroup tiles (`_W64`) won 0.6-3.4% at 14 of the 17 shapes;
# per clock it is within 1% of the pipeline kernel (Nsight Compute), so what it saves is energy per FLOP: 2.6x fewer
# warp instructions, each B row read from SMEM once per K step, one load warp.
# The 2-CTA cluster along M multicasts the B tile into both CTAs (a third less L2 -> SMEM traffic). Since session 31
# `_W64` also stores half of each tile's epilogue under the next tile's first K steps (`overlap_chunks`): +1.0% /
# +0.7% / -0.3% sustained at (8192, 14336, 4096) / 8192^3 / (8192, 4096, 14336), the table's figures unchanged.
_D0M = TileConfig(delay_release=0, cluster="m")  # wg128x128x128/n, 3 stages, jax's pipeline, 2-CTA M
_D0 = TileConfig(delay_release=0)  # the same without the cluster
_W64 = TileConfig(tile_m=64, tile_n=256, wg_split="m", stages=4, epi_tile_m=64, epi_tile_n=32, delay_release=0,
                  cluster="m", ring="static", overlap_chunks=4)  # CTA 128x256 as two 64x256 warpgroup tiles
_W64N = dataclasses.replace(_W64, cluster=None)
AUTO_TABLE: dict[tuple[int, int, int], TileConfig | None] = {
    (8192, 8192, 8192): _W64,  # 1287 (pipeline 1276, XLA 1190)
    (8192, 4096, 4096): _W64,  # 1275 (1233, 1034) (8B wo fwd and dgrad)
    (8192, 1024, 4096): _W64,  # 1231 (1200, 936)
    (8192, 14336, 4096): _W64,  # 1262 (1245, 1087) (8B FFN gate, up; dh)
    (8192, 4096, 14336): _W64,  # 1313 (1301, 1210) (8B FFN down fwd; dx)
    (8192, 1024, 8192): _D0,  # 1292 (_W64: 1284, XLA 1169)
    (8192, 28672, 8192): _W64,  # 1305 (1294, 1204)
    (8192, 8192, 28672): _W64,  # 1333 (1324, 1300)
    (4096, 14336, 8192): _W64,  # 1284 (1279, 1185) (8B FFN gate, up wgrad)
    (14336, 4096, 8192): _W64,  # 1292 (1276, 1176) (8B FFN down wgrad)
    (8192, 6144, 4096): _W64,  # 1254 (1240, 1071) (8B q|k|v fwd)
    (8192, 4096, 6144): _W64,  # 1290 (1260, 1111) (q|k|v dgrad)
    (4096, 6144, 8192): _W64,  # 1282 (1285, 1163; all configs within their spread) (q|k|v wgrad)
    (8192, 28672, 4096): _W64,  # 1276 (1260, 1090) (8B gate|up fwd)
    (8192, 4096, 28672): _W64,  # 1334 (1327, 1285) (gate|up dgrad)
    (4096, 28672, 8192): _W64,  # 1288 (1273, 1197) (gate|up wgrad)
    (4096, 4096, 8192): _W64N,  # 1297 (1272, 1130) (wo wgrad)
}
AUTO_DEFAULT: TileConfig | None = _W64


def auto_choice(m: int, n: int, k: int, a_dtype, b_dtype, out_dtype=jnp.bfloat16) -> TileConfig | None:
    """The Pallas config impl="auto" runs for this problem, or None when it runs XLA."""
    if not device.kernels_apply():
        return None
    config = AUTO_TABLE.get((m, n, k), AUTO_DEFAULT)
    if config is None:
        return None
    if config.ring == "static" and compat.MGPU_TILE_QUEUE and device.per_device_of_many():
        # Per device of a mesh, collectives run beside the GEMMs: the dynamic schedule (tile_queue; no cluster).
        config = dataclasses.replace(config, cluster=None, schedule="dynamic")
    # A clustered config needs M (or N) to be a multiple of two CTA tiles, one CTA tile is enough without it; the
    # static ring needs the K steps to be a multiple of its stages, jax's pipeline does not.
    for candidate in dict.fromkeys((config, dataclasses.replace(config, cluster=None), _D0M, _D0)):
        candidate = fit_config(candidate, out_dtype)
        if pallas_cover(m, n, k, a_dtype, b_dtype, out_dtype, candidate) is None:
            return candidate
    return None


def _check_args(a, b_t, a_scale, b_scale):
    if a.ndim != 2 or jnp.dtype(a.dtype) not in FP8_DTYPES:
        raise ValueError(f"fp8_matmul: `a` must be a 2-D fp8 (M, K) array, got shape {a.shape} dtype {a.dtype}")
    if b_t.ndim != 2 or jnp.dtype(b_t.dtype) not in FP8_DTYPES:
        raise ValueError(f"fp8_matmul: `b_t` must be a 2-D fp8 (N, K) array, got shape {b_t.shape} dtype {b_t.dtype}")
    if a.shape[1] != b_t.shape[1]:
        raise ValueError(f"fp8_matmul: contraction sizes differ: a {a.shape} vs b_t {b_t.shape} (both K-major)")
    for name, s, size in (("a_scale", a_scale, a.shape[0]), ("b_scale", b_scale, b_t.shape[0])):
        s = jnp.asarray(s)
        if s.shape not in ((), (size,)):
            raise ValueError(f"fp8_matmul: `{name}` must have shape () or ({size},), got {s.shape} dtype {s.dtype}")


def fp8_matmul(
    a: jax.Array,
    b_t: jax.Array,
    a_scale: jax.Array,
    b_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    impl: Impl = "auto",
    config: TileConfig | None = None,
    interpret=None,
) -> jax.Array:
    """(a · b_tᵀ) * a_scale[:, None] * b_scale[None, :] in out_dtype; a (M, K), b_t (N, K) fp8, both K-major.

    impl: "pallas" (the Mosaic-GPU kernel; NotImplementedError outside its cover, never falls back), "xla"
    (cuBLASLt fp8 via XLA), "reference" (f32 jnp), "auto" (pallas on Hopper where AUTO_TABLE / AUTO_DEFAULT
    says it wins and the kernel covers the shape, else xla; xla on CPU). `config` overrides the tile config of
    "pallas" (default: DEFAULT_CONFIG through `fit_config`); `interpret` runs "pallas" in the CPU interpreter
    (so does `compat.force_gpu_interpret_mode`).
    """
    _check_args(a, b_t, a_scale, b_scale)
    if impl == "reference":
        return fp8_matmul_reference(a, b_t, a_scale, b_scale, out_dtype=out_dtype)
    if impl == "xla":
        return fp8_matmul_xla(a, b_t, a_scale, b_scale, out_dtype=out_dtype)
    if impl == "pallas":
        config = config or fit_config(DEFAULT_CONFIG, out_dtype)
        return fp8_matmul_pallas(a, b_t, a_scale, b_scale, out_dtype=out_dtype, config=config, interpret=interpret)
    if impl == "auto":
        m, k = a.shape
        chosen = auto_choice(m, b_t.shape[0], k, a.dtype, b_t.dtype, out_dtype)
        if chosen is None:
            return fp8_matmul_xla(a, b_t, a_scale, b_scale, out_dtype=out_dtype)
        return fp8_matmul_pallas(a, b_t, a_scale, b_scale, out_dtype=out_dtype, config=chosen)
    raise ValueError(f"fp8_matmul: impl must be 'auto', 'pallas', 'xla' or 'reference', got {impl!r}")
