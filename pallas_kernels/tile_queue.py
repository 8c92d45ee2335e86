"""A dynamic tile schedule for persistent Mosaic-GPU kernels: tiles handed out by an atomic counter in GMEM.

A persistent GEMM whose CTAs take a fixed stride of tiles finishes when its last CTA does. When a collective's
kernel holds some SMs as the GEMM launches (NCCL's ring kernels take one SM per channel, 24 on 4 x H200), the CTAs
that wait for those SMs start late and still do their full share, so the GEMM ends about that kernel's duration
late (benchmarks/RESULTS.md, session 41). With the queue, CTA g takes tile g first and every further tile from a
counter that XLA zeroes before each call (`pl.get_global`):

    tile = grid + atomicAdd(counter, 1),      grid = the number of CTAs (tiles 0 .. grid - 1 are the first ones),

so a CTA that starts late takes fewer tiles. A tile index past the last tile ends the CTA's loop. The memory
warpgroup (the producer) fetches a CTA's tile i + 1 before it loads tile i, stores it in slot i % 2 and arrives on
the slot's `full` barrier; each of the two compute warpgroups waits on `full`, reads the slot and arrives on
`free`, which the producer awaits before it reuses the slot two tiles later. The mbarrier's arrive (release) and
wait (acquire) order the slot's write before its reads. The slots are two int32 in SMEM (`scratch()`), or in GMEM
where a kernel has no SMEM to spare: Pallas aligns every SMEM allocation to 1 KiB, and the grouped GEMM's fp8
tile uses 226 of its 227 KiB (a `(grid, 2)` int32 scratch output, one row per CTA). The whole memory warpgroup runs
the producer: Mosaic GPU lowers neither the while loop nor the scalar SMEM read in a single warp's code. There is
no cluster: its two CTAs would have to agree on each tile. The atomic is inline PTX (`mgpu.utils.inline_ptx`, jax
>= 0.11; compat.MGPU_TILE_QUEUE).

Used by pallas_kernels/fp8_matmul.py (`TileConfig.schedule`, SMEM slots) and the grouped GEMMs' `gmm` and `tgmm`
(pallas_kernels/grouped_matmul.py, GMEM slots)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def scratch(smem_slots: bool = True) -> dict:
    """The queue's barriers and (`smem_slots`) its SMEM slots, as `pl.run_scoped` keyword arguments (pass them on
    to `TileQueue`)."""
    return dict(
        **(dict(queue_slots=plgpu.SMEM((2,), jnp.int32)) if smem_slots else {}),
        queue_full=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        queue_free=plgpu.Barrier(num_arrivals=2, num_barriers=2),
    )


class TileQueue:
    """The tile queue of one CTA whose persistent grid is the named axis `grid_axis`; `queue_slots`: two int32,
    in SMEM or GMEM (the CTA's own)."""

    def __init__(self, grid_axis: str, queue_slots, queue_full, queue_free):
        self.grid_axis = grid_axis
        self.slots, self.full, self.free = queue_slots, queue_full, queue_free
        self.counter = pl.get_global(plgpu.SemaphoreType.REGULAR((1,)))

    def first(self):
        """The CTA's first tile: its index in the grid (no queue)."""
        return lax.axis_index(self.grid_axis)

    def publish(self, i) -> None:
        """Producer: fetch the CTA's `i`-th tile (i >= 1) from the counter into slot (i - 1) % 2 once the compute
        warpgroups have read the slot's previous tile."""
        slot = lax.rem(i - 1, 2)

        @pl.when(i >= 3)
        def _():
            plgpu.barrier_wait(self.free.at[slot])

        _fetch_tile(self.counter, self.slots.at[pl.ds(slot, 1)], lax.axis_size(self.grid_axis))
        plgpu.barrier_arrive(self.full.at[slot])

    def put_next(self, i):
        """Producer: `publish(i)`, then the tile (its own warpgroup's write, which it may read at once)."""
        self.publish(i)
        return self.take(i, consumer=False)

    def take(self, i, consumer=True):
        """The CTA's `i`-th tile (i >= 1). A compute warpgroup (`consumer`, may be traced) waits until the producer
        has published it and frees the slot after reading; the producer reads its own write."""
        slot = lax.rem(i - 1, 2)
        pl.when(consumer)(lambda: plgpu.barrier_wait(self.full.at[slot]))
        lin = self.slots[slot]
        pl.when(consumer)(lambda: plgpu.barrier_arrive(self.free.at[slot]))
        return lin


def _fetch_tile(counter, dst, grid):
    """One thread of the warpgroup adds 1 to the GMEM counter and stores grid + its old value to the 1-element
    slot ref; the warpgroup then synchronizes, so all its threads read it."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref
    from jax.experimental.mosaic import gpu as mgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def fetch(_ctx, counter, dst):
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        with mgpu.utils.when(mgpu.utils.single_thread_predicate(mgpu.utils.ThreadSubset.WARPGROUP)):
            old = mgpu.utils.inline_ptx("atom.relaxed.gpu.global.add.u32 $0, [$1], 1;", mgpu.utils.memref_ptr(counter),
                                        result_types=i32, has_side_effects=True)
            memref.store(arith.addi(old, arith.constant(i32, grid)), dst, [arith.constant(index, 0)])
        mgpu.utils.warpgroup_barrier()

    fetch(counter, dst)
