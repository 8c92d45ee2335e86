"""Ragged grouped GEMMs for MoE experts on Hopper: forward / grad-input (`gmm`) and grad-weight (`tgmm`).

Tokens arrive sorted by expert. `group_sizes` (E,) int32 splits the M token rows into E consecutive groups:
group e holds rows [start_e, end_e) with start_e = sum(group_sizes[:e]), clamped to M. Rows past
sum(group_sizes) are *padding* (the MoE dispatch buffer is sized for the worst case):

    gmm:   out[r]  = lhs[r] @ W[e(r)]                         (M, K) x (E, K, N) -> (M, N)
                     W[e] = rhs[e] (E, K, N), or rhs[e].T when `transpose_rhs` (rhs stored K-major (E, N, K))
                     padding rows of `out` are exactly zero.
    tgmm:  out[e]  = sum_{r in group e} lhs[r]^T rhs[r]      (M, K) x (M, N) -> (E, K, N)
                     padding rows of lhs/rhs do not contribute; an empty group gives zeros.

fp8 rowwise W8A8 (TorchAO's "rowwise" recipe, torchao/prototype/moe_training/fp8_grouped_mm.py): operands are
e4m3 with f32 dequantization multipliers that are constant along the contraction, so they factor out of the sum
and are applied once per output element in the epilogue, before the cast and store:

    gmm:   out[r, n] = (sum_k lhs[r, k] W[e(r)][k, n]) * lhs_scale[r] * rhs_scale[e(r), n]
                       lhs_scale (M,) per token row; rhs_scale (E, N) per expert output channel.
    tgmm:  out[e, k, n] = (sum_{r in e} lhs[r, k] rhs[r, n]) * lhs_scale[e, k] * rhs_scale[e, n]
                       per-group, per-column scales: TorchAO's "per group colwise" scaling of the weight gradient.

Roles in training (mx_jax/grouped_linear.py): forward y = gmm(x, w); grad-input dx = gmm(dy, w, transpose_rhs=True)
contracts over N, and w stored (E, K, N) is already that GEMM's K-major (experts, outputs, contraction) operand,
so bf16 needs no copy of w; grad-weight dw = tgmm(x, dy).

Kernels (Mosaic-GPU `plgpu.kernel`, persistent: one CTA per SM walks a list of output tiles):
- Warp specialization as in jax's hopper_matmul_mgpu.py: a memory warpgroup streams (A, B) tiles through a
  `stages`-deep TMA ring; two compute warpgroups split the CTA tile along M or N (`wg_split`) and each owns a
  (tile_m, tile_n) f32 wgmma accumulator. 8-bit wgmma needs both operands K-major (benchmarks/JAX_NOTES.md), so
  fp8 `gmm` requires `transpose_rhs` and fp8 `tgmm` runs on a K-major copy of the tokens (below).
- `gmm`: the work list is the (row tile, column tile) pairs of the output. Row tiles are anchored at each
  group's first row, rounded down to the 8-row grid that TMA loads into the tiled SMEM operand need: group e owns
  ceil((start_e % 8 + size_e) / cta_tile_m) tiles at rows 8 floor(start_e / 8) + i * cta_tile_m, so only its last
  tile is partial; rows of a neighbouring group that a tile also loads are computed but not stored. (Aligned
  blocks, as in jax's ragged_dot_mgpu.py, compute a block that straddles a boundary once per group: up to one
  extra tile per group where anchored tiles cost half of one on average. E=8 with one group at 40% of M=16384:
  135 row tiles aligned, 130 anchored, 128 full; 64 experts at 384 rows on average, Dirichlet-drawn sizes: 255 vs
  227, 192 full.) Padding rows form segment E, whose tiles skip the matmul and store zeros. The row-tile list
  (segment, first row / 8, row range [lo, hi) inside the tile) is built by XLA outside the kernel, at most
  M / cta_tile_m + (E + 1)(1 + 6 / cta_tile_m) entries, the used ones first; a tile that would run past M moves back
  to end at M. The persistent walk deals out only the used tiles x N blocks, round-robin over the CTAs, band after
  band; inside a band the row tile runs fastest, so the CTAs resident at one time share each weight block in L2.
  A band never spans two experts: each segment's n tiles form ceil(n / 16) bands of even width, and every list
  entry carries its band's first entry and width, so the kernel finds a work item's band with one table lookup
  (`_band_walk`). (Bands of <= 16 over the whole list, blind to experts, read a weight block from HBM once per
  band that an expert straddles: ~1.5x the weight bytes at the skewed Mixtral routing, where the expert-aligned
  bands ran 1.1-1.7% faster at the 700 W limit, bf16 and fp8 (RESULTS.md, session 33). Walking the whole list,
  unused entries included, gave some CTAs two tiles more than others: 57 vs a mean of 55.2 at the skewed Mixtral
  routing, 10 vs 8.5 at DeepSeek's.)
  TMA stores need static shapes, so a partial tile is written by a ladder of power-of-two row stores from an
  unswizzled SMEM staging tile (at most log2(tile_m) + 1 stores; one for a full tile). Optional 2-CTA clusters
  (`cluster="n"`) put one row tile's two neighbouring N blocks on a CTA pair that multicasts the shared A tile.
- `tgmm` (after jax's transposed_ragged_dot_mgpu.py): one work item per (group, K tile, N tile); its pipeline runs
  over the group's token blocks (a dynamic trip count). Two layouts:
    "masked"  - the operands are read in place, (M, K) and (M, N) row-major, passed to wgmma transposed (16-bit
                only). The first and last token block of a group may hold rows of the neighbouring group; the
                compute warpgroup zeroes them in SMEM in the operand half it owns (so tokens outside every group,
                i.e. padding rows, must hold finite values: they meet a zero, and NaN * 0 = NaN).
    "aligned" - the tokens go first into a K-major (K, M') copy where every group starts on a tile_k boundary
                and the gaps are zero; no masking. fp8 always uses it (8-bit wgmma is K-major only). Built by XLA
                as one gather + transpose (`aligned_token_layout`), that copy read the tokens column by column:
                5.0 ms for three 16384 x 14336 fp8 operands on an H200, a sixth of the fp8 Mixtral MoE layer's
                fwd+bwd. `tgmm_fp8_rowwise` (the fp8 recipe's grad-weight GEMM) instead takes the bf16 operands:
                per-(group, column) amax (`group_col_amax`), XLA gathers whole bf16 rows into the aligned order,
                and the Pallas transposed cast (pallas_kernels/quantize.py, one set of column multipliers per
                64-row tile, each inside one group's aligned region) writes the fp8 (K, M') copy: 3 + 5 bytes per
                element, all coalesced, and the fp8 operands and scales are the same bytes as before.
- Schedule: each CTA takes every grid-th work item (`schedule="static"`), or its first item by its index and every
  further one from an atomic counter in GMEM (`"dynamic"`, pallas_kernels/tile_queue.py; the two slots through which
  the memory warpgroup hands each item to the compute warpgroups are a (grid, 2) int32 scratch output, since the
  SMEM is full: Pallas aligns every SMEM allocation to 1 KiB and the fp8 `gmm` tile uses 226 of 227 KiB). With the
  default configs, both kernels take the dynamic schedule per device of a multi-device mesh (`_pick`), where NCCL's
  kernels hold some SMs as a grouped GEMM launches and a fixed stride made the CTAs that waited for them end the
  kernel late. On 4 x H200, two Mixtral-shaped `gmm` calls (16384 x 14336 x 4096, 8 groups) beside a 235 MB
  reduce-scatter ran 12.0% (bf16) and 18.3% (fp8) slower than alone with the static schedule, 3.8% and 5.8% with
  the dynamic one, which alone is 0.8-1.1% slower (`benchmarks/gemm_beside_collective.py --grouped`). In the
  2-layer Mixtral step at fsdp=4, per step and device: fp8 `gmm` 11.07 -> 9.52 ms and `tgmm` 8.37 -> 6.14 ms (each
  against the static schedule in the same call), bf16 both 35.6 -> 28.6 ms (RESULTS.md, session 43).
- Trade-offs: partial row tiles cost on average E/2 tiles of extra work over M/cta_tile_m (3% at E=8, M=16384,
  128-row tiles); the staging tile is unswizzled so that partial tiles can be stored at any row (its register
  stores took as long as into a swizzled tile on an H200); both compute warpgroups share one tile, so their
  epilogues do not overlap tensor-core work (the memory warpgroup does prefetch the next tile meanwhile). Measured
  with Mosaic GPU's profiler (`benchmarks/profile_tiles.py`, the `jax.named_scope` regions below): the tensor cores
  idle ~3.6k cycles between two tiles, 3.4 K steps of 128 x 256 x 64, half of it the epilogue, which waits for its
  first chunk's TMA store to leave the staging tile (RESULTS.md, session 31). A hand-rolled ring whose positions run
  on across tiles, carrying half of the epilogue into the next tile's first K step, cut that to 2.5k cycles but took
  1% more cycles per K step, and at the 700 W limit it ran at a 2.5% lower clock for the same power: 5% slower at
  Mixtral's shape, -3% to +3% at DeepSeekMoE's (commit ed7a8e6, reverted; RESULTS.md, session 32).
- Shared memory, `gmm`'s default CTA 128x256 tile: ring 4 x (128 + 256) rows x 128 B = 192 KiB, staging
  2 x 128 x 64 x 2 B = 32 KiB (64-column epilogue chunks), fp8 scales 2 KiB: 226 KiB of the 227 KiB; `tgmm`'s
  default the same. The 3-stage fallback (f32 outputs) has 144 KiB of ring beside 64 KiB of 128-column staging.
- `gmm` releases a stage one K step late (`delay_release=1`): step i issues its wgmma group, waits until at most
  that group is in flight (step i-1's is done) and releases step i-1's stage, so the tensor cores hold queued work
  while the warpgroup waits. emit_pipeline_warp_specialized never marks a tile's last step consumed in that mode,
  and in a persistent loop the memory warpgroup's next-tile prologue would refill that stage under the in-flight
  wgmma (jax 0.11.2's GPU interpret mode reports it; tests/test_grouped_matmul.py). So both compute warpgroups
  arrive on an `acc_done` barrier once their accumulator is read, and the memory warpgroup waits on it before the
  next tile. `tgmm` awaits every stage (delay_release 0; not measured otherwise).

The dispatchers' `impl="xla"` is `jax.lax.ragged_dot_general` (what MaxText uses), fp8 scales applied by an XLA
fusion on its f32 result.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mx_jax import compat
from pallas_kernels import device, tile_queue

qz = importlib.import_module("pallas_kernels.quantize")  # the module: the package re-exports its `quantize` function

Impl = Literal["auto", "pallas", "xla", "reference"]
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), *FP8_DTYPES)
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_SMEM_BYTES = 227 * 1024  # Hopper opt-in shared memory per block
SMALL_GROUP_ROWS = 64  # gmm with at most this many rows per group on average takes 64-row tiles first (`_pick`)
TGMM_FEW_ROWS = 1024  # 16-bit tgmm with fewer rows per group on average takes 64x256 warpgroup tiles first (`_pick`)
_STAGING_BYTES = 32 * 1024  # epilogue staging per compute warpgroup when epi_tile_n is not given


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig:
    """One point of the tile sweep. For `tgmm` the output is (K, N): tile_m tiles K, tile_k tiles the tokens."""

    tile_m: int = 128  # output rows per compute warpgroup; multiple of 64 (wgmma M)
    tile_n: int = 128  # output cols per compute warpgroup; multiple of 64, <= 256 (wgmma N)
    tile_k: int = 64  # contraction per pipeline stage: 64 bf16 / 128 fp8 = 128 B rows = the widest swizzle
    stages: int = 3  # TMA ring depth (max_concurrent_steps)
    wg_split: Literal["m", "n"] = "n"  # the 2 compute warpgroups split the CTA tile along this dim
    grid_minor: Literal["m", "n"] = "m"  # which output tile axis the persistent walk runs fastest
    grid_tile_width: int = 16  # band width of that walk, in CTA tiles (L2 reuse of the other operand)
    epi_tile_n: int | None = None  # epilogue store chunk cols; None = as wide as fits in 32 KiB per warpgroup
    cluster: Literal["n"] | None = None  # gmm only: 2-CTA clusters on neighbouring N blocks multicast the A tile
    delay_release: int = 0  # gmm only: wgmma groups left in flight before a stage is released (module doc)
    # "dynamic" hands out the work items after each CTA's first through an atomic counter in GMEM
    # (pallas_kernels/tile_queue.py), so CTAs that start late (SMs held by a collective's kernel) take fewer
    schedule: Literal["static", "dynamic"] = "static"
    tgmm_layout: Literal["masked", "aligned"] = "masked"  # 16-bit tgmm only; fp8 is always "aligned"

    @property
    def cta_tile_m(self) -> int:
        return self.tile_m * (2 if self.wg_split == "m" else 1)

    @property
    def cta_tile_n(self) -> int:
        return self.tile_n * (2 if self.wg_split == "n" else 1)

    def epi_n(self, out_dtype) -> int:
        if self.epi_tile_n is not None:
            return self.epi_tile_n
        fit = _STAGING_BYTES // (self.tile_m * jnp.dtype(out_dtype).itemsize)
        return min(self.tile_n, max(8, fit))

    def smem_bytes(self, in_dtype, out_dtype, scaled: bool) -> int:
        """Shared memory the kernel allocates (operand ring + epilogue staging + scale vectors), barriers excluded."""
        ring = self.stages * (self.cta_tile_m + self.cta_tile_n) * self.tile_k * jnp.dtype(in_dtype).itemsize
        staging = 2 * self.tile_m * self.epi_n(out_dtype) * jnp.dtype(out_dtype).itemsize
        scales = 2 * (self.tile_m + self.tile_n) * 4 if scaled else 0
        return ring + staging + scales + 1024  # + mbarriers and their alignment (~600 B measured)

    def name(self) -> str:
        s = f"wg{self.tile_m}x{self.tile_n}x{self.tile_k}/{self.wg_split} s{self.stages}"
        s += f" walk-{self.grid_minor}{self.grid_tile_width}"
        if self.epi_tile_n is not None:
            s += f" epi{self.epi_tile_n}"
        if self.cluster:
            s += f" cl2{self.cluster}"
        if self.delay_release:
            s += f" d{self.delay_release}"
        if self.schedule == "dynamic":
            s += " dyn"
        return s

    @property
    def cluster_size(self) -> int:
        return 2 if self.cluster else 1


def default_configs(dtype, op: Literal["gmm", "tgmm"] = "gmm") -> tuple[TileConfig, ...]:
    """Configs tried in order when none is given: 128 B of contraction per stage (tile_k 64 for 16-bit operands,
    128 for fp8); a 128x256 CTA tile, then 256x128, then 64-wide warpgroup tiles for small dims (and for `tgmm` the
    128x256 CTA tile of 64x256 warpgroup tiles, which `_pick` puts first where groups have few rows).

    Each tile is tried first with 4 stages beside 64-column epilogue chunks, then with 3 stages. `gmm`'s 4-stage
    form also leaves one wgmma group in flight (delay_release 1): it ran 1-2% faster sustained at Mixtral's shape,
    bf16 and fp8 (benchmarks/RESULTS.md, MoE eleventh pass); with 3 stages, delay_release 1 was 2% slower (one stage
    fewer in flight). `tgmm`'s 4 stages (each awaited) ran 1-8% faster than 3 at the in-step shapes of Mixtral's fp8
    and DeepSeekMoE's bf16 weight gradients (RESULTS.md, session 29). Outputs whose staging does not fit beside 4
    stages (f32 at the largest tiles) take the second; a K of fewer steps than stages shrinks the ring
    (emit_pipeline_warp_specialized does)."""
    tk = 128 // jnp.dtype(dtype).itemsize
    tiles = (
        TileConfig(tile_k=tk),
        TileConfig(tile_k=tk, wg_split="m"),
        TileConfig(tile_m=64, tile_n=64, tile_k=tk),
        TileConfig(tile_m=64, tile_n=64, tile_k=tk, wg_split="m"),
    ) + ((TileConfig(tile_m=64, tile_n=256, tile_k=tk, wg_split="m"),) if op == "tgmm" else ())
    deep = lambda c: dataclasses.replace(c, stages=4, epi_tile_n=64, delay_release=int(op == "gmm"))
    return tuple(x for c in tiles for x in (deep(c), c))


def _pick(cover, dtype, config: TileConfig | None, op: Literal["gmm", "tgmm"], small: bool = False
          ) -> tuple[TileConfig, str | None]:
    """(config, None) for the given config or the first default that `cover(config)` accepts, else (the first
    default, its reason). On a Hopper GPU per device of a multi-device mesh, where collectives run beside the
    kernels, the defaults take the dynamic schedule (the interpreter runs no inline PTX).

    `small` (`gmm` with at most SMALL_GROUP_ROWS rows per group on average, as when decoding): the 64x128 CTA tile
    first. A group of a few rows costs a whole row tile of tensor-core work, so the 256-row tiles made 60 groups of
    3 rows each (DeepSeekMoE's 64 experts, 32 decoded tokens) compute-bound: a routed layer (routing, sort, three
    GEMMs) took 420 us on an H200 against 259 with 64-row tiles, and 374 against 222 for one token (6 groups), where
    the narrower tiles also spread each GEMM's weight reads over more SMs (RESULTS.md, session 64).
    `small` for `tgmm` (16-bit, fewer than TGMM_FEW_ROWS rows per group on average): the same 128x256 CTA tile with
    64x256 warpgroup tiles first, one wgmma of N = 256 per K step instead of two of 128, which read each row of the
    token tile from shared memory once instead of twice. With 4-8 K steps per output tile it ran 3-9% faster on an
    H200 (Qwen3-30B-A3B's experts at 256 and 512 rows each, DeepSeekMoE's at 384), 0.4-1.3% slower at 1,024 and
    Mixtral's 4,096 (RESULTS.md, session 70)."""
    if config is not None:
        return config, cover(config)
    candidates = default_configs(dtype, op)
    if small:
        first = (lambda c: c.cta_tile_m != 64) if op == "gmm" else (lambda c: (c.tile_m, c.tile_n) != (64, 256))
        candidates = tuple(sorted(candidates, key=first))
    dynamic = compat.MGPU_TILE_QUEUE and device.on_hopper() and not compat.gpu_interpret_forced()
    if dynamic and device.per_device_of_many():
        candidates = tuple(dataclasses.replace(c, schedule="dynamic") for c in candidates)
    for c in candidates:
        if cover(c) is None:
            return c, None
    return candidates[0], cover(candidates[0])


def _small_groups(lhs: jax.Array, rhs: jax.Array) -> bool:
    """`_pick`'s `small` for gmm(lhs (M, K), rhs (E, ...))."""
    return lhs.shape[0] <= SMALL_GROUP_ROWS * rhs.shape[0]


def _tgmm_few_rows(lhs: jax.Array, group_sizes: jax.Array) -> bool:
    """`_pick`'s `small` for tgmm(lhs (M, K), ..., group_sizes (E,))."""
    return jnp.dtype(lhs.dtype).itemsize == 2 and lhs.shape[0] < TGMM_FEW_ROWS * group_sizes.shape[0]


# --------------------------------------------------------------------------------------------------------------
# Group bookkeeping shared by every implementation.
# --------------------------------------------------------------------------------------------------------------
def searchsorted(a: jax.Array, v: jax.Array, side: str = "left") -> jax.Array:
    """jnp.searchsorted without a loop in the program. Its default method is a `lax.while_loop` of log2(len(a))
    iterations, which XLA:GPU runs one at a time, copying each iteration's condition to the host: at Qwen3-30B-A3B's
    experts (E = 128) the bookkeeping of one `gmm` call took 8 such iterations, 16 device-to-device copies and 233
    us of idle device time beside the kernel's 169 us. Unrolled, the same search is a few fusions."""
    return jnp.searchsorted(a, v, side=side, method="scan_unrolled")


def _group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """starts, ends (E,) int32 of each group's rows, clamped to [0, M]."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def row_groups(group_sizes: jax.Array, m: int) -> jax.Array:
    """(M,) int32: the group of each token row; E for padding rows."""
    _, ends = _group_bounds(group_sizes, m)
    return searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def _segments(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """starts, ends (E + 1,) int32: the E groups, then segment E = the padding rows [sum(group_sizes), M)."""
    starts, ends = _group_bounds(group_sizes, m)
    return jnp.concatenate([starts, ends[-1:]]), jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])


def _list_entries(counts: jax.Array, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A list of `length` entries where segment s owns counts[s] consecutive ones, the rest unused: per entry its
    segment (-1 if unused), that segment clamped to a valid index, and the entry's index within its segment."""
    last = counts.shape[0] - 1
    cum = jnp.cumsum(counts)
    t = jnp.arange(length, dtype=jnp.int32)
    seg = searchsorted(cum, t, side="right").astype(jnp.int32)  # last + 1 past the final entry
    s = jnp.minimum(seg, last)
    return jnp.where(seg <= last, seg, -1), s, t - (cum[s] - counts[s])


def _row_pieces(group_sizes: jax.Array, m: int, block: int) -> jax.Array:
    """(4, M // block + E) int32: the (segment, block) pieces of M rows cut into aligned blocks of `block` rows:
    segment (E = padding, -1 = unused entry), block index, and the segment's row range [lo, hi) inside the block."""
    starts, ends = _segments(group_sizes, m)
    first = starts // block
    nblk = jnp.where(ends > starts, (ends - 1) // block - first + 1, 0)
    seg, s, i = _list_entries(nblk, m // block + group_sizes.shape[0])
    blk = first[s] + i
    lo = jnp.clip(starts[s] - blk * block, 0, block)
    hi = jnp.clip(ends[s] - blk * block, 0, block)
    return jnp.stack([seg, blk, lo, hi]).astype(jnp.int32)


_ROW_ALIGN = 8  # a TMA load into a tiled SMEM operand starts on a multiple of its 8-row tiling


def _gmm_num_row_tiles(m: int, e: int, block_m: int) -> int:
    """Length of `_gmm_row_tiles`' list: segment s (E groups + padding) takes ceil((a_s + size_s) / block_m) tiles
    with a_s = start_s % 8 <= 7 and sum(size_s) = M: at most M / block_m + (E + 1) (block_m + 6) / block_m."""
    return m // block_m + e + 1 + (6 * (e + 1)) // block_m


def _gmm_row_tiles(group_sizes: jax.Array, m: int, block_m: int, band: int = 16) -> jax.Array:
    """(6, `_gmm_num_row_tiles`) int32 row-tile list of `_gmm_kernel`: segment (E = padding, -1 = unused entry),
    the tile's first row / 8, the segment's row range [lo, hi) inside the tile (see the module doc), and the first
    entry and width of the tile's band.

    Segment s's tiles are anchored at its first row rounded down to a multiple of 8, so each segment's last tile is
    its only partial one; a tile that would run past M is moved back to end at M (M is a multiple of block_m).
    Bands never span two segments: segment s's n_s tiles form ceil(n_s / band) bands of even width (`_band_walk`)."""
    starts, ends = _segments(group_sizes, m)
    anchors = starts // _ROW_ALIGN * _ROW_ALIGN
    ntiles = jnp.where(ends > starts, -(-(ends - anchors) // block_m), 0)
    seg, s, i = _list_entries(ntiles, _gmm_num_row_tiles(m, group_sizes.shape[0], block_m))
    first = anchors[s] + i * block_m
    row = jnp.clip(first, 0, m - block_m)
    lo = jnp.clip(jnp.maximum(starts[s], first) - row, 0, block_m)  # a moved-back tile skips the rows already stored
    hi = jnp.clip(ends[s] - row, 0, block_m)
    n = jnp.maximum(ntiles[s], 1)
    width = -(-n // -(-n // band))  # n tiles in ceil(n / band) bands of even width
    j = i // width
    band_start = jnp.where(seg >= 0, jnp.arange(seg.shape[0], dtype=jnp.int32) - i + j * width, 0)
    band_width = jnp.where(seg >= 0, jnp.minimum(width, n - j * width), 1)
    return jnp.stack([seg, row // _ROW_ALIGN, lo, hi, band_start, band_width]).astype(jnp.int32)


def _band_walk(lin, cols, band_of):
    """Linear work index -> (row tile, col tile) when the row tiles are cut into bands of any widths: band b covers
    row tiles [start_b, start_b + width_b) x every column, i.e. work items [start_b cols, (start_b + width_b) cols),
    so the band of item `lin` is the one holding row tile lin // cols, and `band_of(row tile)` -> (start, width) is
    a table lookup. Inside a band the row tile runs fastest, as in `_walk`."""
    start, width = band_of(lax.div(lin, cols))
    within = lin - start * cols
    return start + lax.rem(within, width), lax.div(within, width)


def _aligned_len(m: int, e: int, align: int) -> int:
    """M' of the aligned token layout: room for M rows whose E groups each start on a multiple of `align`."""
    return -(-(m + e * (align - 1)) // align) * align


def _aligned_source(group_sizes: jax.Array, m: int, align: int, j: jax.Array):
    """Where rows j of the aligned token layout come from: (aligned group starts (E,) int32; for each j its group,
    its source row of the (M, C) tokens (0 where none) and whether it holds one)."""
    starts, ends = _group_bounds(group_sizes, m)
    sizes = ends - starts
    a_starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(-(-sizes // align) * align)[:-1]])
    a_starts = a_starts.astype(jnp.int32)
    g = searchsorted(a_starts, j, side="right").astype(jnp.int32) - 1  # last group starting at or before j
    off = j - a_starts[g]
    valid = off < sizes[g]
    return a_starts, g, jnp.where(valid, starts[g] + off, 0), valid


def _aligned_rows(x: jax.Array, group_sizes: jax.Array, align: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token rows with every group starting on a multiple of `align`: (rows (M', C), zero outside the groups;
    aligned group starts (E,) int32; the group whose aligned region holds each row (M',)), M' = roundup(M + E *
    (align - 1), align). Padding rows of x are dropped. Row-major, so the gather reads whole rows."""
    m = x.shape[0]
    j = jnp.arange(_aligned_len(m, group_sizes.shape[0], align), dtype=jnp.int32)
    a_starts, g, src, valid = _aligned_source(group_sizes, m, align, j)
    rows = jnp.where(valid[:, None], x[src], jnp.zeros((), x.dtype))
    return rows, a_starts, g


def aligned_token_layout(x: jax.Array, group_sizes: jax.Array, align: int) -> tuple[jax.Array, jax.Array]:
    """K-major copy of the token rows with every group starting on a multiple of `align`.

    x (M, C) -> x_t (C, M') with M' = roundup(M + E * (align - 1), align), zero outside the groups; and the aligned
    group starts (E,) int32. Padding rows of x are dropped. (XLA fuses the gather and the transpose into one loop
    that reads x by columns: 0.3 TB/s on an H200. `tgmm_fp8_rowwise` casts into this layout with a Pallas kernel.)"""
    rows, a_starts, _ = _aligned_rows(x, group_sizes, align)
    return rows.T, a_starts


def quantize_group_cols(t: jax.Array, group_sizes: jax.Array, dtype=jnp.float8_e4m3fn) -> tuple[jax.Array, jax.Array]:
    """t (M, C) -> (fp8 (M, C), scale (E, C)): one power-of-two scale per (group, column), the amax over the
    group's rows. Padding rows are cast with multiplier 1 (the grouped GEMMs never read them into a sum)."""
    m = t.shape[0]
    gid = row_groups(group_sizes, m)  # (M,), E for padding rows
    q, scale = qz.amax_to_scales(group_col_amax(t, group_sizes), dtype, True)
    q_rows = jnp.concatenate([q, jnp.ones((1, t.shape[1]), jnp.float32)])[gid]  # (M, C)
    f = qz.fp8_max(dtype)
    return jnp.clip(t.astype(jnp.float32) * q_rows, -f, f).astype(dtype), scale


def _tgmm_group_meta(group_sizes: jax.Array, m: int, block: int, aligned_starts: jax.Array | None) -> jax.Array:
    """(4, E) int32: first token block, block count, start, end of each group in the kernel's token layout."""
    starts, ends = _group_bounds(group_sizes, m)
    if aligned_starts is not None:
        ends = aligned_starts + (ends - starts)
        starts = aligned_starts
    first = starts // block
    nblk = jnp.where(ends > starts, -(-ends // block) - first, 0)
    return jnp.stack([first, nblk, starts, ends]).astype(jnp.int32)


def group_col_amax(t: jax.Array, group_sizes: jax.Array, *, block: int = 128) -> jax.Array:
    """(E, C) f32: max |t| over each group's rows of t (M, C), 0 for an empty group, in one pass over t.

    Rows are sorted by group, so aligned blocks of `block` rows cut them into at most M / block + E (segment, block)
    pieces (`_row_pieces`), of which at most two per segment (its first and last block) are partial:
        1. block maxima (M / block, C): one reduction over t;
        2. the partial pieces' maxima, over their own rows of the <= 2 (E + 1) blocks they cut (a gather of those
           blocks only);
        3. per segment, the max over its pieces, a segmented max-scan over the M / block + E piece rows.
    The previous form gathered every piece's block of t into a (M / block + E) x block x C f32 array; swapping it
    for this one did not change the Mixtral MoE layer's time measurably on an H200 (RESULTS.md, twelfth pass), but
    it never writes that array (1 GB at Mixtral's dgate). A segment_max over rows or pieces is a scatter with heavy
    atomic contention on the GPU. The result is exact (a max), whatever the order."""
    m, c = t.shape
    e = group_sizes.shape[0]
    if m % block:
        gid = row_groups(group_sizes, m)
        mag = jnp.abs(t).astype(jnp.float32)
        return jnp.maximum(jax.ops.segment_max(mag, gid, num_segments=e + 1)[:e], 0.0)
    nb = m // block
    blocks = t.reshape(nb, block, c)
    block_max = jnp.max(jnp.abs(blocks), axis=1).astype(jnp.float32)  # (nb, C)
    seg, blk, lo, hi = _row_pieces(group_sizes, m, block)  # (T,) each, T = nb + E, sorted by segment
    blk = jnp.clip(blk, 0, nb - 1)
    used = seg >= 0
    partial = used & ((lo > 0) | (hi < block))
    n_part = 2 * (e + 1)  # a segment's first and last block are its only partial ones
    (which,) = jnp.nonzero(partial, size=n_part, fill_value=0)
    r = jnp.arange(block, dtype=jnp.int32)[None, :, None]
    live = (r >= lo[which][:, None, None]) & (r < hi[which][:, None, None])
    part_max = jnp.max(jnp.where(live, jnp.abs(blocks[blk[which]]), 0), axis=1).astype(jnp.float32)  # (n_part, C)
    rank = jnp.clip(jnp.cumsum(partial) - 1, 0, n_part - 1)
    piece_max = jnp.where(partial[:, None], part_max[rank], block_max[blk])
    piece_max = jnp.where(used[:, None], piece_max, 0.0)  # (T, C)
    # Segmented max-scan along the (sorted) pieces; a segment's max sits at its last piece.
    seg = jnp.where(used, seg, e + 1)
    first = jnp.concatenate([jnp.ones((1,), bool), seg[1:] != seg[:-1]])

    def combine(a, b):
        (va, fa), (vb, fb) = a, b
        return jnp.where(fb[..., None], vb, jnp.maximum(va, vb)), fa | fb

    scanned, _ = lax.associative_scan(combine, (piece_max, first))
    counts = jnp.sum(seg[None, :] == jnp.arange(e, dtype=jnp.int32)[:, None], axis=1)  # pieces per group
    last = searchsorted(seg, jnp.arange(e, dtype=jnp.int32), side="right") - 1  # its last piece
    return jnp.where((counts > 0)[:, None], scanned[jnp.clip(last, 0, seg.shape[0] - 1)], 0.0)


def _check_group_sizes(group_sizes: jax.Array, e: int) -> None:
    if group_sizes.shape != (e,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be ({e},) integer, got {group_sizes.shape} {group_sizes.dtype}")


# --------------------------------------------------------------------------------------------------------------
# References: the spec, pure jnp, f32 accumulation.
# --------------------------------------------------------------------------------------------------------------
def gmm_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """out[r] = (lhs[r] * lhs_scale[r]) @ (W[e(r)] * rhs_scale[e(r)]), zero on padding rows: a masked GEMM per group."""
    m = lhs.shape[0]
    w = rhs.astype(jnp.float32)
    if transpose_rhs:
        w = jnp.swapaxes(w, 1, 2)  # (E, K, N)
    x = lhs.astype(jnp.float32)
    if lhs_scale is not None:
        x = x * lhs_scale.astype(jnp.float32)[:, None]
    if rhs_scale is not None:
        w = w * rhs_scale.astype(jnp.float32)[:, None, :]
    gid = row_groups(group_sizes, m)
    out = jnp.zeros((m, w.shape[2]), jnp.float32)
    for e in range(w.shape[0]):
        y = jnp.dot(x, w[e], precision=lax.Precision.HIGHEST)
        out = out + jnp.where((gid == e)[:, None], y, 0.0)
    return out.astype(out_dtype)


def tgmm_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    out_dtype=jnp.float32,
) -> jax.Array:
    """out[e] = (lhs[rows of e]^T @ rhs[rows of e]) * lhs_scale[e][:, None] * rhs_scale[e][None, :]."""
    m = lhs.shape[0]
    e_count = group_sizes.shape[0]
    gid = row_groups(group_sizes, m)
    x = lhs.astype(jnp.float32)
    dy = rhs.astype(jnp.float32)
    outs = []
    for e in range(e_count):
        xe = jnp.where((gid == e)[:, None], x, 0.0)
        outs.append(jnp.dot(xe.T, dy, precision=lax.Precision.HIGHEST))
    out = jnp.stack(outs)  # (E, K, N)
    if lhs_scale is not None:
        out = out * lhs_scale.astype(jnp.float32)[:, :, None]
    if rhs_scale is not None:
        out = out * rhs_scale.astype(jnp.float32)[:, None, :]
    return out.astype(out_dtype)


# --------------------------------------------------------------------------------------------------------------
# Mosaic-GPU kernels.
# --------------------------------------------------------------------------------------------------------------
def operand_transforms(dtype, minor: int):
    """Tiling + swizzle for an SMEM operand tile whose minor dim holds `minor` elements of `dtype`."""
    swizzle = plgpu.find_swizzle(min(minor * jnp.dtype(dtype).itemsize, 128) * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _walk(lin, rows, cols, minor: str, width: int):
    """Linear work index -> (row tile, col tile) of a rows x cols grid (`rows` may be a traced count). The minor
    axis is cut into ceil(size / width) bands of equal width (the last one narrower by less than the band count);
    inside a band the minor index runs fastest, so the CTAs resident at one time share the major operand's tiles in
    L2. (Bands of exactly `width` could leave a last band of 1-2 tiles, whose resident CTAs would each read a
    different major tile from HBM.)"""
    minor_size, major_size = (rows, cols) if minor == "m" else (cols, rows)
    minor_size = jnp.maximum(jnp.asarray(minor_size, jnp.int32), 1)
    major_size = jnp.asarray(major_size, jnp.int32)
    bands = lax.div(minor_size + (width - 1), jnp.int32(width))
    width = lax.div(minor_size + bands - 1, bands)
    band_size = width * major_size
    band = lax.div(lin, band_size)
    within = lax.rem(lin, band_size)
    band_width = jnp.minimum(width, minor_size - band * width)
    minor_idx = band * width + lax.rem(within, band_width)
    major_idx = lax.div(within, band_width)
    return (minor_idx, major_idx) if minor == "m" else (major_idx, minor_idx)


def _store_rows(acc, staging, dst, lo, count, *, full: bool) -> None:
    """Store rows [lo, lo + count) of the (tile_m, tile_n) f32 tile `acc` into the gmem window `dst` (same shape).

    `staging` (tile_m, epi_n) unswizzled SMEM. TMA boxes are static, so a dynamic row range is written by a ladder
    of power-of-two row stores (the bits of `count`); `full` (static) means all rows, one store per chunk."""
    tile_m, tile_n = acc.shape
    epi_n = staging.shape[1]
    top = 1 << (tile_m.bit_length() - 1)
    for j in range(tile_n // epi_n):
        cols = slice(j * epi_n, (j + 1) * epi_n)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk / tile has left the staging tile
        staging[...] = acc[:, cols].astype(staging.dtype)
        plgpu.commit_smem()
        dst_cols = dst.at[:, pl.ds(j * epi_n, epi_n)]
        if full:
            plgpu.copy_smem_to_gmem(staging, dst_cols)
            continue
        start = lo
        p = top
        while p >= 1:

            @pl.when((count & p) != 0)
            def _store(start=start, p=p):
                plgpu.copy_smem_to_gmem(staging.at[pl.ds(start, p)], dst_cols.at[pl.ds(start, p)])

            start = start + (count & p)
            p //= 2


def _store_zeros(c: TileConfig, staging, dst, lo, count, *, full: bool) -> None:
    """`_store_rows` of a zero tile. A fresh wgmma accumulator is zero and already in the WGMMA layout."""

    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
    def _zero_scope(acc_ref):
        _store_rows(acc_ref[...], staging, dst, lo, count, full=full)


def _scale_scratch(c: TileConfig, scaled: bool):
    if not scaled:
        return None
    return dict(
        row=plgpu.SMEM((2, c.tile_m), jnp.float32),
        col=plgpu.SMEM((2, c.tile_n), jnp.float32),
        barrier=plgpu.Barrier(num_arrivals=2, num_barriers=2),
    )


def _fetch_scales(scales, wg, row_src, col_src) -> None:
    """Issue the TMA loads of this warpgroup's scale slices; they land while the K loop runs."""
    plgpu.copy_gmem_to_smem(row_src, scales["row"].at[wg], scales["barrier"].at[wg])
    plgpu.copy_gmem_to_smem(col_src, scales["col"].at[wg], scales["barrier"].at[wg])


def _apply_scales(acc, scales, wg):
    plgpu.barrier_wait(scales["barrier"].at[wg])
    row = scales["row"][wg]  # (tile_m,)
    col = scales["col"][wg]  # (tile_n,)
    acc = acc * lax.broadcast_in_dim(row, acc.shape, [0])
    return acc * lax.broadcast_in_dim(col, acc.shape, [1])


def _queue_slots(refs: tuple, dynamic: bool) -> tuple[tuple, object]:
    """(the kernel's other refs, the dynamic schedule's GMEM slots or None): the slots are the last output, a
    (grid, 2) int32 scratch (`_launch(queue_slots=True)`, tile_queue module doc)."""
    return (refs[:-1], refs[-1]) if dynamic else (refs, None)


def _for_each_item(tile, loop_size: int, live, wg, slots_gmem, queue_refs) -> None:
    """Run `tile(lin)` on every work item of this CTA. Static schedule (no `queue_refs`): every grid-th index of
    range(loop_size), the persistent loop's stride (`tile` skips indices >= live itself). Dynamic schedule: the live
    items [0, live) that the tile queue hands this CTA (pallas_kernels/tile_queue.py, slots in GMEM). Every
    warpgroup walks the same items: the memory warpgroup publishes the next one before it loads this one, the
    compute warpgroups take it after computing this one."""
    if not queue_refs:
        plgpu.nd_loop((loop_size,), collective_axes="sm")(lambda info: tile(info.index[0]))
        return
    queue = tile_queue.TileQueue("sm", slots_gmem.at[lax.axis_index("sm")], **queue_refs)

    def step(st):
        i, lin = st
        pl.when(wg == 2)(lambda: queue.publish(i + 1))
        tile(lin)
        return i + 1, queue.take(i + 1, consumer=wg < 2)

    lax.while_loop(lambda st: st[1] < live, step, (jnp.int32(0), queue.first()))


def _gmm_kernel(
    meta_gmem, count_gmem, lhs_gmem, rhs_gmem, *refs, config: TileConfig, transpose_rhs: bool, scaled: bool
):
    """meta (6, T): per row tile its segment (E = padding, -1 = unused), first row / 8, row range [lo, hi), and its
    band's first entry and width (`_gmm_row_tiles`); count (1,): the used entries, which come first. The walk covers
    count x N-blocks work items, so the round-robin split of the persistent loop deals out only real tiles; the
    remaining loop indices do nothing (the dynamic schedule hands out only the real ones). `grid_minor="n"` configs
    walk N-bands with `_walk` instead. With the dynamic schedule the last ref is the queue's (grid, 2) GMEM slots."""
    c = config
    dynamic = c.schedule == "dynamic"
    refs, slots_gmem = _queue_slots(refs, dynamic)
    if scaled:
        lhs_scale_gmem, rhs_scale_gmem, out_gmem = refs
    else:
        (out_gmem,) = refs
    k = lhs_gmem.shape[1]
    num_groups = rhs_gmem.shape[0]
    num_row_tiles = meta_gmem.shape[1]
    n_iters, k_iters = out_gmem.shape[1] // c.cta_tile_n, k // c.tile_k
    cl = c.cluster_size  # a cluster takes one row tile and `cl` neighbouring N blocks: same group, one A tile
    out_dtype = out_gmem.dtype
    split_m = c.wg_split == "m"
    dtype = lhs_gmem.dtype
    a_transforms = operand_transforms(dtype, c.tile_k)
    b_transforms = operand_transforms(dtype, c.tile_k if transpose_rhs else c.cta_tile_n)

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(  # A: (cta_tile_m, tile_k) token rows
                    (c.cta_tile_m, c.tile_k),
                    lambda kk: (0, kk),
                    transforms=a_transforms,
                    delay_release=c.delay_release,
                    collective_axes=("cluster",) if cl > 1 else (),
                ),
                plgpu.BlockSpec(  # B: (cta_tile_n, tile_k) K-major, or (tile_k, cta_tile_n)
                    (c.cta_tile_n, c.tile_k) if transpose_rhs else (c.tile_k, c.cta_tile_n),
                    (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0)),
                    transforms=b_transforms,
                    delay_release=c.delay_release,
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=c.stages,
            compute_context=compute_context,
        )

    def rhs_window(g, ni):  # expert g's (K, cta_tile_n) column block, in its stored orientation
        cols = pl.ds(ni * c.cta_tile_n, c.cta_tile_n)
        return rhs_gmem.at[g].at[cols, :] if transpose_rhs else rhs_gmem.at[g].at[:, cols]

    ignore = lambda *_, **__: None  # allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline(ignore, ignore).get_allocations(lhs_gmem, rhs_window(0, 0)),
        staging=plgpu.SMEM((2, c.tile_m, c.epi_n(out_dtype)), out_dtype),
        scales=_scale_scratch(c, scaled),
        # Both compute warpgroups of every CTA of the cluster arrive once their accumulator is drained (a multicast
        # load writes the peer's stage too). Used with delay_release only.
        acc_done=(
            plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=2)
            if cl > 1
            else plgpu.Barrier(num_arrivals=2)
        ),
        **(tile_queue.scratch(smem_slots=False) if dynamic else {}),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, staging, scales, acc_done, **queue_refs):
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cluster")

        count = count_gmem[0]
        live_items = count * (n_iters // cl)

        def tile(lin):
            with jax.named_scope("decode"):  # spans of device.profiler_params' traces
                live = lin < live_items
                lin_c = jnp.minimum(lin, live_items - 1)
                if c.grid_minor == "m":  # bands of row tiles inside one segment each
                    t, nj = _band_walk(lin_c, n_iters // cl, lambda q: (meta_gmem[4, q], meta_gmem[5, q]))
                else:
                    t, nj = _walk(lin_c, count, n_iters // cl, c.grid_minor, c.grid_tile_width)
                ni = nj * cl + cta
                seg, row8, lo, hi = (meta_gmem[i, t] for i in range(4))
                seg = jnp.where(live, seg, -1)
                first_row = row8 * _ROW_ALIGN  # a multiple of 8 that Mosaic can see, as its TMA lowering requires
                wg_row, wg_col = (wg * c.tile_m, 0) if split_m else (0, wg * c.tile_n)
                row0 = first_row + wg_row
                col0 = ni * c.cta_tile_n + wg_col
                # This warpgroup's share of the segment's rows [lo, hi) of the CTA tile, relative to its own tile.
                w_lo = jnp.clip(lo - wg_row, 0, c.tile_m)
                w_count = jnp.clip(hi - wg_row, 0, c.tile_m) - w_lo
                dst = out_gmem.at[pl.ds(row0, c.tile_m), pl.ds(col0, c.tile_n)]

            def compute_context(eval_pipeline):
                if scaled:
                    row_scales = lhs_scale_gmem.at[pl.ds(row0, c.tile_m)]
                    _fetch_scales(scales, wg, row_scales, rhs_scale_gmem.at[seg, pl.ds(col0, c.tile_n)])

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
                def _acc_scope(acc_ref):
                    with jax.named_scope("k_loop"):
                        eval_pipeline(acc_ref)
                    with jax.named_scope("drain"):
                        acc = acc_ref[...]  # waits for the last wgmma
                        if c.delay_release:
                            plgpu.barrier_arrive(acc_done)
                        if scaled:
                            acc = _apply_scales(acc, scales, wg)
                    with jax.named_scope("epilogue"):
                        _store_rows(acc, staging.at[wg], dst, w_lo, w_count, full=False)

            def mma_body(_, a_smem, b_smem, acc_ref):
                a = a_smem.at[pl.ds(wg * c.tile_m, c.tile_m)] if split_m else a_smem
                if transpose_rhs:
                    b = (b_smem if split_m else b_smem.at[pl.ds(wg * c.tile_n, c.tile_n)]).T
                else:
                    b = b_smem if split_m else b_smem.at[:, pl.ds(wg * c.tile_n, c.tile_n)]
                plgpu.wgmma(acc_ref, a, b)
                plgpu.wgmma_wait(c.delay_release)  # the stage `delay_release` steps back is released on return
                return acc_ref

            @pl.when((seg >= 0) & (seg < num_groups))
            def _matmul():
                pipeline(mma_body, compute_context)(
                    lhs_gmem.at[pl.ds(first_row, c.cta_tile_m), :],
                    rhs_window(seg, ni),
                    allocations=pipeline_allocs,
                )
                if c.delay_release:
                    # The pipeline never marks the last `delay_release` stages consumed: the memory warpgroup
                    # must not refill them for the next tile until the accumulators are drained.
                    @pl.when(wg == 2)
                    def _():
                        plgpu.barrier_wait(acc_done)

            @pl.when((seg == num_groups) & (wg < 2))
            def _padding():
                _store_zeros(c, staging.at[wg], dst, w_lo, w_count, full=False)

        _for_each_item(tile, num_row_tiles * (n_iters // cl), live_items, wg, slots_gmem, queue_refs)

    plgpu.wait_smem_to_gmem(0)


def _tgmm_kernel(meta_gmem, lhs_gmem, rhs_gmem, *refs, config: TileConfig, aligned: bool, scaled: bool):
    """meta (4, E): per group its first token block, block count, and token range [start, end) in this layout.

    aligned=False: lhs (M, K), rhs (M, N) row-major, boundary blocks masked in SMEM.
    aligned=True:  lhs (K, M'), rhs (N, M') K-major, every group starts on a block boundary, gaps are zero.
    With the dynamic schedule the last ref is the tile queue's (grid, 2) GMEM slots."""
    c = config
    dynamic = c.schedule == "dynamic"
    refs, slots_gmem = _queue_slots(refs, dynamic)
    if scaled:
        lhs_scale_gmem, rhs_scale_gmem, out_gmem = refs
    else:
        (out_gmem,) = refs
    num_groups, k, n = out_gmem.shape
    m_iters, n_iters = k // c.cta_tile_m, n // c.cta_tile_n
    tiles_per_group = m_iters * n_iters
    out_dtype = out_gmem.dtype
    split_m = c.wg_split == "m"
    dtype = lhs_gmem.dtype
    if aligned:
        a_block, b_block = (c.cta_tile_m, c.tile_k), (c.cta_tile_n, c.tile_k)
        a_transforms = b_transforms = operand_transforms(dtype, c.tile_k)
    else:
        a_block, b_block = (c.tile_k, c.cta_tile_m), (c.tile_k, c.cta_tile_n)
        a_transforms, b_transforms = operand_transforms(dtype, c.cta_tile_m), operand_transforms(dtype, c.cta_tile_n)

    def pipeline(body, compute_context, num_blocks, first_block):
        index = (lambda r: (0, first_block + r)) if aligned else (lambda r: (first_block + r, 0))
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(num_blocks,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(a_block, index, transforms=a_transforms),
                plgpu.BlockSpec(b_block, index, transforms=b_transforms),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=c.stages,
            compute_context=compute_context,
        )

    def windows(mi, ni):  # this CTA's K block of lhs and N block of rhs, all tokens
        rows_k, cols_n = pl.ds(mi * c.cta_tile_m, c.cta_tile_m), pl.ds(ni * c.cta_tile_n, c.cta_tile_n)
        if aligned:
            return lhs_gmem.at[rows_k, :], rhs_gmem.at[cols_n, :]
        return lhs_gmem.at[:, rows_k], rhs_gmem.at[:, cols_n]

    ignore = lambda *_, **__: None
    # A static grid of `stages` steps allocates the same ring as the dynamic one used below.
    allocs = pipeline(ignore, ignore, c.stages, 0).get_allocations(*windows(0, 0))

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=allocs,
        staging=plgpu.SMEM((2, c.tile_m, c.epi_n(out_dtype)), out_dtype),
        scales=_scale_scratch(c, scaled),
        **(tile_queue.scratch(smem_slots=False) if dynamic else {}),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, staging, scales, **queue_refs):
        wg = lax.axis_index("wg")

        def tile(lin):
            g = lax.div(lin, jnp.int32(tiles_per_group))
            mi, ni = _walk(lax.rem(lin, jnp.int32(tiles_per_group)), m_iters, n_iters, c.grid_minor, c.grid_tile_width)
            first, num_blocks, start, end = (meta_gmem[i, g] for i in range(4))
            wg_row, wg_col = (wg * c.tile_m, 0) if split_m else (0, wg * c.tile_n)
            row0 = mi * c.cta_tile_m + wg_row
            col0 = ni * c.cta_tile_n + wg_col
            dst = out_gmem.at[g].at[pl.ds(row0, c.tile_m), pl.ds(col0, c.tile_n)]

            def compute_context(eval_pipeline):
                if scaled:
                    row_scales = lhs_scale_gmem.at[g, pl.ds(row0, c.tile_m)]
                    _fetch_scales(scales, wg, row_scales, rhs_scale_gmem.at[g, pl.ds(col0, c.tile_n)])

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((c.tile_m, c.tile_n), jnp.float32))
                def _acc_scope(acc_ref):
                    eval_pipeline(acc_ref)
                    acc = acc_ref[...]
                    if scaled:
                        acc = _apply_scales(acc, scales, wg)
                    _store_rows(acc, staging.at[wg], dst, 0, c.tile_m, full=True)

            def mask_tokens(ref, r):
                """Zero the token rows of this (tile_k, cols) SMEM block that lie outside [start, end)."""

                @pl.when((r == 0) | (r == num_blocks - 1))
                def _mask():
                    vals = ref[...]
                    rows = lax.broadcasted_iota(jnp.int32, vals.shape, 0) + (first + r) * c.tile_k
                    keep = (rows >= start) & (rows < end)
                    ref[...] = jnp.where(keep, vals, jnp.zeros_like(vals))
                    plgpu.commit_smem()

            def mma_body(idx, a_smem, b_smem, acc_ref):
                (r,) = idx
                if aligned:  # a (cta_m, tile_k), b (cta_n, tile_k): both K-major
                    a = a_smem.at[pl.ds(wg * c.tile_m, c.tile_m)] if split_m else a_smem
                    b = (b_smem if split_m else b_smem.at[pl.ds(wg * c.tile_n, c.tile_n)]).T
                else:  # a (tile_k, cta_m), b (tile_k, cta_n): token rows; mask the half this warpgroup owns
                    a = a_smem.at[:, pl.ds(wg * c.tile_m, c.tile_m)] if split_m else a_smem
                    b = b_smem if split_m else b_smem.at[:, pl.ds(wg * c.tile_n, c.tile_n)]
                    mask_tokens(a if split_m else b, r)
                    a = a.T
                plgpu.wgmma(acc_ref, a, b)
                plgpu.wgmma_wait(0)  # the stage is released on return (module doc)
                return acc_ref

            @pl.when(num_blocks > 0)
            def _matmul():
                pipeline(mma_body, compute_context, num_blocks, first)(*windows(mi, ni), allocations=pipeline_allocs)

            @pl.when((num_blocks == 0) & (wg < 2))
            def _empty_group():
                _store_zeros(c, staging.at[wg], dst, 0, c.tile_m, full=True)

        total = num_groups * tiles_per_group
        _for_each_item(tile, total, total, wg, slots_gmem, queue_refs)

    plgpu.wait_smem_to_gmem(0)


def _check_config(c: TileConfig, in_dtype, out_dtype, scaled: bool) -> str | None:
    if c.tile_m % 64 or c.tile_n % 64 or c.tile_n > 256 or c.cta_tile_m > 256 or c.cta_tile_n > 256:
        return f"invalid tile {c.tile_m}x{c.tile_n}: multiples of 64, tile_n <= 256, CTA tile <= 256 per dim"
    if (c.tile_k * jnp.dtype(in_dtype).itemsize) % 32:
        return f"tile_k={c.tile_k} of {jnp.dtype(in_dtype)} is not a multiple of 32 bytes"
    epi_n = c.epi_n(out_dtype)
    if c.tile_n % epi_n or (epi_n * jnp.dtype(out_dtype).itemsize) % 128:
        # A partial tile is stored from any row of the staging tile; TMA needs 128 B-aligned shared-memory sources.
        return (
            f"epilogue chunk {epi_n} must divide tile_n={c.tile_n} and span a multiple of 128 B of "
            f"{jnp.dtype(out_dtype)} (TMA alignment of partial-tile row stores)"
        )
    if c.stages < 2:
        return f"stages={c.stages}: the TMA ring needs at least 2 stages"
    if not 0 <= c.delay_release < c.stages:
        return f"delay_release={c.delay_release} must be >= 0 and below stages={c.stages}"
    if (need := c.smem_bytes(in_dtype, out_dtype, scaled)) > _SMEM_BYTES:
        return f"config {c.name()} needs {need} B of shared memory (> {_SMEM_BYTES})"
    return None


def gmm_pallas_cover(
    lhs_shape, rhs_shape, lhs_dtype, rhs_dtype, *, transpose_rhs: bool, out_dtype, scaled: bool, config: TileConfig
) -> str | None:
    """None when `gmm_pallas` takes this problem with this config, else the reason it does not."""
    lhs_dtype, rhs_dtype, out_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype), jnp.dtype(out_dtype)
    (m, k), (_, _, n) = lhs_shape, rhs_shape
    if transpose_rhs:
        n = rhs_shape[1]
    if lhs_dtype != rhs_dtype or lhs_dtype not in _KERNEL_DTYPES:
        return f"operands must share one of {[str(d) for d in _KERNEL_DTYPES]}, got {lhs_dtype} and {rhs_dtype}"
    if lhs_dtype in FP8_DTYPES and not transpose_rhs:
        return "8-bit wgmma needs a K-major right operand: pass rhs as (E, N, K) with transpose_rhs=True"
    if out_dtype not in _OUT_DTYPES:
        return f"out_dtype must be bf16, f16 or f32, got {out_dtype}"
    if (reason := _check_config(config, lhs_dtype, out_dtype, scaled)) is not None:
        return reason
    if config.schedule == "dynamic" and (config.cluster or not compat.MGPU_TILE_QUEUE):
        return "the dynamic schedule takes no cluster and needs jax >= 0.11 (compat.MGPU_TILE_QUEUE)"
    cluster_n = config.cta_tile_n * config.cluster_size
    if m % config.cta_tile_m or n % cluster_n or k % config.tile_k:
        return (
            f"(M, N, K) = ({m}, {n}, {k}) must be multiples of ({config.cta_tile_m}, {cluster_n}, "
            f"{config.tile_k}); pad the token rows (padding rows are free) to a multiple of {config.cta_tile_m}"
        )
    return None


def tgmm_pallas_cover(
    lhs_shape, rhs_shape, lhs_dtype, rhs_dtype, *, out_dtype, scaled: bool, config: TileConfig
) -> str | None:
    """None when `tgmm_pallas` takes this problem with this config, else the reason it does not."""
    lhs_dtype, rhs_dtype, out_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype), jnp.dtype(out_dtype)
    (m, k), (_, n) = lhs_shape, rhs_shape
    if lhs_dtype != rhs_dtype or lhs_dtype not in _KERNEL_DTYPES:
        return f"operands must share one of {[str(d) for d in _KERNEL_DTYPES]}, got {lhs_dtype} and {rhs_dtype}"
    if out_dtype not in _OUT_DTYPES:
        return f"out_dtype must be bf16, f16 or f32, got {out_dtype}"
    if (reason := _check_config(config, lhs_dtype, out_dtype, scaled)) is not None:
        return reason
    if config.cluster:
        return "clusters are implemented for gmm only"
    if config.schedule == "dynamic" and not compat.MGPU_TILE_QUEUE:
        return "the dynamic schedule needs jax >= 0.11 (compat.MGPU_TILE_QUEUE)"
    if config.delay_release:
        return "delay_release is implemented for gmm only (tgmm awaits every stage; see the module doc)"
    if k % config.cta_tile_m or n % config.cta_tile_n:
        return f"(K, N) = ({k}, {n}) must be multiples of ({config.cta_tile_m}, {config.cta_tile_n})"
    if _tgmm_aligned(lhs_dtype, config):
        return None
    if m % config.tile_k:
        return f"M={m} must be a multiple of tile_k={config.tile_k} (or use tgmm_layout='aligned')"
    return None


def _gmm_cover_fn(lhs, rhs, transpose_rhs: bool, out_dtype, scaled: bool):
    return lambda c: gmm_pallas_cover(
        lhs.shape, rhs.shape, lhs.dtype, rhs.dtype, transpose_rhs=transpose_rhs, out_dtype=out_dtype, scaled=scaled,
        config=c,
    )


def _tgmm_cover_fn(lhs, rhs, out_dtype, scaled: bool):
    return lambda c: tgmm_pallas_cover(
        lhs.shape, rhs.shape, lhs.dtype, rhs.dtype, out_dtype=out_dtype, scaled=scaled, config=c
    )


def _tgmm_aligned(dtype, config: TileConfig) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES or config.tgmm_layout == "aligned"


def _launch(body, out_type, work_items: int, args, interpret, cluster_size: int = 1, name: str = "gmm",
            queue_slots: bool = False):
    """Run the persistent kernel `body` on min(#SMs / cluster, work_items) CTAs. `queue_slots`: the kernel also
    writes a (grid, 2) int32 scratch output, the dynamic schedule's GMEM slots (dropped here)."""
    grid = max(1, min(device.num_sms(interpret) // cluster_size, work_items))
    if queue_slots:
        out_type = (out_type, jax.ShapeDtypeStruct((grid, 2), jnp.int32))
    f = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(grid,),
        grid_names=("sm",),
        cluster=(cluster_size,),
        cluster_names=("cluster",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, **device.profiler_params()
        ),
        interpret=interpret,
        kernel_name=name,  # how the kernel is named in profiles
    )
    out = f(*args)
    if queue_slots:
        out = out[0]
    # A Mosaic-GPU kernel's output carries no varying axes; inside shard_map (check_vma) it varies like its inputs.
    missing = set().union(*map(compat.varying_axes, args)) - compat.varying_axes(out)
    return jax.lax.pcast(out, tuple(sorted(missing)), to="varying") if missing else out


def _scale_args(lhs_scale, rhs_scale) -> tuple[jax.Array, ...]:
    if lhs_scale is None and rhs_scale is None:
        return ()
    return (jnp.asarray(lhs_scale, jnp.float32), jnp.asarray(rhs_scale, jnp.float32))


@device.lowered_once(('transpose_rhs', 'out_dtype', 'config', 'interpret'))
def gmm_pallas(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    out_dtype=jnp.bfloat16,
    config: TileConfig | None = None,
    interpret=None,
) -> jax.Array:
    """The Mosaic-GPU `gmm` kernel. Raises NotImplementedError outside its cover (see `gmm_pallas_cover`).

    config None: the first of `default_configs` that covers the problem.
    `interpret`: None on the GPU, or a `compat.InterpretGPUParams` to run the kernel on CPU."""
    scales = _scale_args(lhs_scale, rhs_scale)
    config, reason = _pick(_gmm_cover_fn(lhs, rhs, transpose_rhs, out_dtype, bool(scales)), lhs.dtype, config, "gmm",
                           _small_groups(lhs, rhs))
    if reason is not None:
        raise NotImplementedError(f"gmm_pallas: {reason}")
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    meta = _gmm_row_tiles(group_sizes, m, config.cta_tile_m, config.grid_tile_width)
    count = jnp.sum(meta[0] >= 0, dtype=jnp.int32, keepdims=True)  # used entries come first
    body = functools.partial(_gmm_kernel, config=config, transpose_rhs=transpose_rhs, scaled=bool(scales))
    work = meta.shape[1] * (n // (config.cta_tile_n * config.cluster_size))
    out_type = jax.ShapeDtypeStruct((m, n), out_dtype)
    return _launch(body, out_type, work, (meta, count, lhs, rhs, *scales), interpret, config.cluster_size,
                   queue_slots=config.schedule == "dynamic")


@device.lowered_once(('out_dtype', 'config', 'interpret'))
def tgmm_pallas(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    out_dtype=jnp.float32,
    config: TileConfig | None = None,
    interpret=None,
) -> jax.Array:
    """The Mosaic-GPU `tgmm` kernel. Raises NotImplementedError outside its cover (see `tgmm_pallas_cover`)."""
    scales = _scale_args(lhs_scale, rhs_scale)
    config, reason = _pick(_tgmm_cover_fn(lhs, rhs, out_dtype, bool(scales)), lhs.dtype, config, "tgmm",
                           _tgmm_few_rows(lhs, group_sizes))
    if reason is not None:
        raise NotImplementedError(f"tgmm_pallas: {reason}")
    m = lhs.shape[0]
    a_starts = None
    if _tgmm_aligned(lhs.dtype, config):
        lhs, a_starts = aligned_token_layout(lhs, group_sizes, config.tile_k)
        rhs, _ = aligned_token_layout(rhs, group_sizes, config.tile_k)
    return _tgmm_launch(lhs, rhs, group_sizes, m, a_starts, scales, out_dtype, config, interpret)


def _tgmm_launch(lhs, rhs, group_sizes, m: int, a_starts, scales, out_dtype, config: TileConfig, interpret):
    """The kernel on operands as it reads them: (M, K), (M, N) row-major, or with a_starts given, the aligned
    K-major layout (K, M'), (N, M') of `aligned_token_layout`."""
    aligned = a_starts is not None
    k, n, e = lhs.shape[0 if aligned else 1], rhs.shape[0 if aligned else 1], group_sizes.shape[0]
    meta = _tgmm_group_meta(group_sizes, m, config.tile_k, a_starts)
    body = functools.partial(_tgmm_kernel, config=config, aligned=aligned, scaled=bool(scales))
    work = e * (k // config.cta_tile_m) * (n // config.cta_tile_n)
    out_type = jax.ShapeDtypeStruct((e, k, n), out_dtype)
    return _launch(body, out_type, work, (meta, lhs, rhs, *scales), interpret, name="tgmm",
                   queue_slots=config.schedule == "dynamic")


def _group_cast_t(t, group_sizes, q, align: int, interpret) -> tuple[jax.Array, jax.Array]:
    """t (M, C) high precision, q (E, C) quantization multipliers -> (fp8 (C, M') in the aligned K-major layout,
    aligned starts): bf16 rows gathered by XLA into the aligned row order, then the Pallas transposed cast, whose
    every 64-row tile lies in one group's aligned region and takes that group's multipliers."""
    rows, a_starts, g = _aligned_rows(t, group_sizes, align)
    bm = qz.DEFAULT_CAST_CONFIG.cast_bm
    q_tiles = jnp.concatenate([q, jnp.ones((1, q.shape[1]), jnp.float32)])[g[::bm]]  # (M' / bm, C)
    (out,) = qz._cast_pallas(rows, None, q_tiles, dtype=E4M3, config=qz.DEFAULT_CAST_CONFIG, interpret=interpret)
    return out, a_starts


def _group_cast_t_in_place(t, group_sizes, q, align: int, interpret) -> tuple[jax.Array, jax.Array]:
    """`_group_cast_t` for groups whose sizes are multiples of the cast's 64-row tiles: no gathered copy of t. Each
    64-row tile of the aligned layout is a whole 64-row tile of t (`_cast_pallas`'s src_tiles) or, in the gaps,
    any tile times zero multipliers."""
    m = t.shape[0]
    bm = qz.DEFAULT_CAST_CONFIG.cast_bm
    tile0 = jnp.arange(_aligned_len(m, group_sizes.shape[0], align) // bm, dtype=jnp.int32) * bm
    a_starts, g, src, valid = _aligned_source(group_sizes, m, align, tile0)  # valid: the whole tile (sizes % bm == 0)
    src_tiles = src // bm
    q_tiles = jnp.where(valid[:, None], q[g], 0.0)
    (out,) = qz._cast_pallas(t, None, q_tiles, dtype=E4M3, config=qz.DEFAULT_CAST_CONFIG, interpret=interpret,
                             src_tiles=src_tiles)
    return out, a_starts


@device.lowered_once(('out_dtype', 'config', 'interpret', 'group_align'))
def tgmm_fp8_rowwise_pallas(lhs, rhs, group_sizes, *, out_dtype=jnp.float32, config: TileConfig | None = None,
                            interpret=None, group_align: int = 1):
    """`tgmm_fp8_rowwise` on the kernels; NotImplementedError outside their cover."""
    rhs_all = rhs if isinstance(rhs, tuple) else (rhs,)
    (m, k), bm = lhs.shape, qz.DEFAULT_CAST_CONFIG.cast_bm
    for r in rhs_all:
        f8 = (jax.ShapeDtypeStruct((m, k), E4M3), jax.ShapeDtypeStruct(r.shape, E4M3))
        config_r, reason = _pick(_tgmm_cover_fn(*f8, out_dtype, True), E4M3, config, "tgmm")
        if reason is None and config_r.tile_k % bm:
            reason = f"tile_k={config_r.tile_k} must be a multiple of the transposed cast's {bm}-row tiles"
        if reason is None:
            mp = _aligned_len(m, group_sizes.shape[0], config_r.tile_k)
            for cols in (k, r.shape[1]):
                if (why := qz.pallas_cover((mp, cols), lhs.dtype, transposed=True, interpret=interpret)) is not None:
                    reason = f"the transposed cast: {why}"
        if reason is not None:
            raise NotImplementedError(f"tgmm_fp8_rowwise_pallas: {reason}")
        config = config_r  # the first right operand's pick serves all: one token layout of lhs for every GEMM
    ql, sl = qz.amax_to_scales(group_col_amax(lhs, group_sizes), E4M3, True)
    cast_t = _group_cast_t_in_place if group_align % bm == 0 and m % bm == 0 else _group_cast_t
    lhs_t, a_starts = cast_t(lhs, group_sizes, ql, config.tile_k, interpret)
    outs = []
    for r in rhs_all:
        qr, sr = qz.amax_to_scales(group_col_amax(r, group_sizes), E4M3, True)
        rhs_t, _ = cast_t(r, group_sizes, qr, config.tile_k, interpret)
        outs.append(_tgmm_launch(lhs_t, rhs_t, group_sizes, m, a_starts, (sl, sr), out_dtype, config, interpret))
    return tuple(outs) if isinstance(rhs, tuple) else outs[0]


def tgmm_fp8_rowwise(lhs: jax.Array, rhs, group_sizes: jax.Array, *, out_dtype=jnp.float32,
                     impl: Impl = "auto", config: TileConfig | None = None, group_align: int = 1):
    """The fp8 rowwise recipe's grad-weight GEMM: lhs (M, K), rhs (M, N) high precision, each cast to e4m3 with one
    power-of-two scale per (group, column) (`quantize_group_cols`), then `tgmm` with the scales -> (E, K, N).
    rhs may be a tuple of (M, N_i) arrays (the gradients of the experts' gate and up, which share lhs): then a tuple
    of (E, K, N_i), with lhs cast once for all of them.

    impl "pallas" (and "auto" where the kernels apply) casts straight into the kernel's aligned K-major token layout
    (`_group_cast_t`); the others quantize row-major and call `tgmm` with that impl. Same fp8 operands and scales
    either way, so the same result up to the GEMMs' summation order. `group_align`: the caller's promise that every
    group size is a multiple of it (padding rows inside a group must then be zero); a multiple of 64 lets the
    cast read each group's rows in place instead of gathering them first (`_group_cast_t_in_place`)."""
    kw = dict(out_dtype=out_dtype, config=config, group_align=group_align)
    if impl == "pallas":
        return tgmm_fp8_rowwise_pallas(lhs, rhs, group_sizes, **kw)
    if impl == "auto" and device.kernels_apply():
        try:
            return tgmm_fp8_rowwise_pallas(lhs, rhs, group_sizes, **kw)
        except NotImplementedError:
            pass  # tgmm below picks its own path for the row-major operands
    xq, xs = quantize_group_cols(lhs, group_sizes)
    outs = []
    for r in rhs if isinstance(rhs, tuple) else (rhs,):
        dq, ds = quantize_group_cols(r, group_sizes)
        outs.append(tgmm(xq, dq, group_sizes, lhs_scale=xs, rhs_scale=ds, out_dtype=out_dtype, impl=impl,
                         config=config))
    return tuple(outs) if isinstance(rhs, tuple) else outs[0]


# --------------------------------------------------------------------------------------------------------------
# XLA path and dispatchers.
# --------------------------------------------------------------------------------------------------------------
def _gmm_xla(lhs, rhs, group_sizes, *, transpose_rhs, lhs_scale, rhs_scale, out_dtype):
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2 if transpose_rhs else 1,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    out = lax.ragged_dot_general(lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32)
    if lhs_scale is not None:
        out = out * lhs_scale.astype(jnp.float32)[:, None]
    if rhs_scale is not None:
        gid = jnp.minimum(row_groups(group_sizes, lhs.shape[0]), rhs.shape[0] - 1)  # padding rows are zero anyway
        out = out * rhs_scale.astype(jnp.float32)[gid]
    return out.astype(out_dtype)


def _tgmm_xla(lhs, rhs, group_sizes, *, lhs_scale, rhs_scale, out_dtype):
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out = lax.ragged_dot_general(lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32)  # (E, K, N)
    if lhs_scale is not None:
        out = out * lhs_scale.astype(jnp.float32)[:, :, None]
    if rhs_scale is not None:
        out = out * rhs_scale.astype(jnp.float32)[:, None, :]
    return out.astype(out_dtype)


def _check_scales(lhs_scale, rhs_scale, lhs_scale_shape, rhs_scale_shape) -> None:
    if (lhs_scale is None) != (rhs_scale is None):
        raise ValueError("pass both lhs_scale and rhs_scale, or neither")
    if lhs_scale is not None:
        if lhs_scale.shape != lhs_scale_shape:
            raise ValueError(f"lhs_scale must be {lhs_scale_shape}, got {lhs_scale.shape} {lhs_scale.dtype}")
        if rhs_scale.shape != rhs_scale_shape:
            raise ValueError(f"rhs_scale must be {rhs_scale_shape}, got {rhs_scale.shape} {rhs_scale.dtype}")


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    out_dtype=jnp.bfloat16,
    impl: Impl = "auto",
    config: TileConfig | None = None,
) -> jax.Array:
    """Grouped GEMM: lhs (M, K) x rhs (E, K, N) [or (E, N, K) with transpose_rhs] -> (M, N); see the module doc.

    impl: "pallas" (the Mosaic-GPU kernel; NotImplementedError outside its cover), "xla" (lax.ragged_dot_general),
    "reference", or "auto" = pallas on a Hopper GPU when covered, else xla."""
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(
            f"gmm wants lhs (M, K) and rhs (E, K, N); got lhs {lhs.shape} {lhs.dtype}, rhs {rhs.shape} {rhs.dtype}"
        )
    e = rhs.shape[0]
    k, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
    if lhs.shape[1] != k:
        layout = "(E, N, K)" if transpose_rhs else "(E, K, N)"
        raise ValueError(
            f"gmm: lhs {lhs.shape} {lhs.dtype} does not contract with rhs {layout} = {rhs.shape} {rhs.dtype}"
        )
    _check_group_sizes(group_sizes, e)
    _check_scales(lhs_scale, rhs_scale, (lhs.shape[0],), (e, n))
    kw = dict(transpose_rhs=transpose_rhs, lhs_scale=lhs_scale, rhs_scale=rhs_scale, out_dtype=out_dtype)
    if impl == "auto":
        cover = _gmm_cover_fn(lhs, rhs, transpose_rhs, out_dtype, lhs_scale is not None)
        _, reason = _pick(cover, lhs.dtype, config, "gmm", _small_groups(lhs, rhs))
        impl = "pallas" if reason is None and device.kernels_apply() else "xla"
    if impl == "pallas":
        return gmm_pallas(lhs, rhs, group_sizes, config=config, **kw)
    if impl == "xla":
        return _gmm_xla(lhs, rhs, group_sizes, **kw)
    if impl == "reference":
        return gmm_reference(lhs, rhs, group_sizes, **kw)
    raise ValueError(f"impl must be one of auto, pallas, xla, reference; got {impl!r}")


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_scale: jax.Array | None = None,
    rhs_scale: jax.Array | None = None,
    out_dtype=jnp.float32,
    impl: Impl = "auto",
    config: TileConfig | None = None,
) -> jax.Array:
    """Grouped weight-gradient GEMM: lhs (M, K), rhs (M, N) -> (E, K, N), contracting each group's rows.

    Scales (fp8): lhs_scale (E, K), rhs_scale (E, N). impl as in `gmm`."""
    if lhs.ndim != 2 or rhs.ndim != 2 or lhs.shape[0] != rhs.shape[0]:
        raise ValueError(
            f"tgmm wants lhs (M, K) and rhs (M, N); got lhs {lhs.shape} {lhs.dtype}, rhs {rhs.shape} {rhs.dtype}"
        )
    e = group_sizes.shape[0] if group_sizes.ndim == 1 else -1
    _check_group_sizes(group_sizes, e)
    _check_scales(lhs_scale, rhs_scale, (e, lhs.shape[1]), (e, rhs.shape[1]))
    kw = dict(lhs_scale=lhs_scale, rhs_scale=rhs_scale, out_dtype=out_dtype)
    if impl == "auto":
        _, reason = _pick(_tgmm_cover_fn(lhs, rhs, out_dtype, lhs_scale is not None), lhs.dtype, config, "tgmm",
                          _tgmm_few_rows(lhs, group_sizes))
        impl = "pallas" if reason is None and device.kernels_apply() else "xla"
    if impl == "pallas":
        return tgmm_pallas(lhs, rhs, group_sizes, config=config, **kw)
    if impl == "xla":
        return _tgmm_xla(lhs, rhs, group_sizes, **kw)
    if impl == "reference":
        return tgmm_reference(lhs, rhs, group_sizes, **kw)
    raise ValueError(f"impl must be one of auto, pallas, xla, reference; got {impl!r}")
