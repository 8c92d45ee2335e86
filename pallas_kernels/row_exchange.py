"""Rows to per-row addresses on the peers over NVLink: push (write into the peers) and pull (read from the peers).

Semantics. Inside shard_map over a mesh axis of P devices, device d holds an array a_d (S, ...) and a list of T
items: item i names a row src[i], a peer peer[i] and a row dst[i]; the items [0, n_live) copy, the others do not.
Device d also names rows zero_d[j], j < n_zero, of its own output (R rows):

    push:  y_p[dst_d[i]] = a_d[src_d[i]]            for every device d and live item i of d with peer_d[i] = p
    pull:  y_d[dst_d[i]] = a_{peer_d[i]}[src_d[i]]  for every live item i of d
    both:  y_d[zero_d[j]] = 0                        for j < n_zero

Every other row of y is left unwritten: the caller names each row of every output exactly once, as a destination
or a zero row (no two items may write one row). Push and pull with the same items are each other's transpose (with
src and dst swapped): the MoE dispatch pushes each (token, expert) row straight to its place in the expert device's
buffer sorted by expert, and the combine pulls each output row home to its (token, choice) slot (mx_jax/dispatch.py,
"land").

Kernel (per device, a persistent grid of G CTAs, one per SM): the items and the zero rows form one list of
n_live + n_zero work items; CTA c takes c, c + G, c + 2G, ... Each work item is one row (a row is at most a few tens
of KiB: the hidden state of one token). Per CTA a ring of `depth` SMEM slots of one row each: bulk copy (TMA,
`cp.async.bulk`, 1-D contiguous) gmem -> slot, then slot -> gmem; for push the store goes to the peer's output
through `plgpu.remote_ref` (NVLink), for pull the load comes from the peer's input the same way (the peer index is a
runtime value: the 1-D bulk copies resolve the peer pointer on the device). depth - 1 loads are in flight ahead of
the store; a slot is reloaded once the store that read it has finished reading SMEM. A zero row is a store from a
slot of zeros loaded once per CTA. An item's src, peer and dst are scalar loads from GMEM.

Completion, as in pallas_kernels/all_to_all.py (its docstring has the collective-metadata path, the pre-launch
multi-GPU barrier and why they make the first remote access safe): each CTA waits until its stores have landed,
then signals a semaphore on every peer; CTA 0 of every device waits for (P - 1) G signals before the kernel ends.
For push this means no device returns before every row written into it has landed; for pull, no device returns
(and lets XLA reuse the input its peers read) before every peer has finished reading it. The barrier before the
launch means every peer's input is complete when the first remote load is issued.

Bytes per device: reads (live items + 0) rows, writes the same number of rows (push: to the peers, pull: locally)
and n_zero rows of zeros; nothing for rows that hold no data, so a buffer sized for the worst routing costs only
its zeroing. Bus bandwidth in nccl-tests' convention: rows moved to other devices x row bytes / t.

Constraints (impl="pallas" raises NotImplementedError naming the reason, impl="auto" falls back to the XLA
reference): those of the all-to-all kernel (an sm_90 GPU; one process holding every device; the axis spans all of
them; jax >= 0.11), plus jax >= 0.11.1 for loads from a peer (`compat.MGPU_REMOTE_LOAD`), a row of a multiple of 16
bytes and at most `MAX_ROW_BYTES`, and a 1-, 2- or 4-byte dtype. The Mosaic-GPU interpreter runs neither remote
refs nor global semaphores, so CPU tests check the XLA reference against the semantics above and lower the kernel
for CUDA; the GPU tests compare the kernel with the reference bit for bit.

XLA reference ("xla", also the fallback): two all-to-alls of a (P, T, ...) buffer per call (push: the rows and
their destinations; pull: the requests and the rows served), P times the bytes of the kernel and a scatter; it is
for tests and for the places the kernel cannot run, not for speed.
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
from pallas_kernels import all_to_all as a2a
from pallas_kernels import device

Impl = Literal["auto", "pallas", "xla"]
Mode = Literal["push", "pull"]
RING_BYTES = 96 * 1024  # SMEM for one CTA's ring of row slots
MAX_ROW_BYTES = RING_BYTES // 2  # a ring needs at least two slots


@dataclasses.dataclass(frozen=True)
class Items:
    """One device's work list (all int32): items [0, n_live) copy row src[i] <-> (peer[i], dst[i]); zero[j] for
    j < n_zero are rows of this device's output to set to zero. src, peer, dst: (T,); zero: (Z,); n_live, n_zero:
    scalars."""

    src: jax.Array
    peer: jax.Array
    dst: jax.Array
    n_live: jax.Array
    zero: jax.Array
    n_zero: jax.Array


jax.tree_util.register_dataclass(Items, data_fields=["src", "peer", "dst", "n_live", "zero", "n_zero"],
                                 meta_fields=[])


# --------------------------------------------------------------------------------------------------------------
# Reference (also the "xla" path)
# --------------------------------------------------------------------------------------------------------------
def _live(items: Items) -> jax.Array:
    return jnp.arange(items.src.shape[0]) < items.n_live


def _zeroed(y: jax.Array, items: Items) -> jax.Array:
    """y with its zero rows set to zero (the rows past n_zero are ignored)."""
    rows = jnp.where(jnp.arange(items.zero.shape[0]) < items.n_zero, items.zero, y.shape[0])
    return y.at[rows].set(jnp.zeros((), y.dtype), mode="drop")


def move_reference(a: jax.Array, items: Items, out_rows: int, mode: Mode, axis_name: str) -> jax.Array:
    """The semantics with lax.all_to_all; rows that no item or zero row names are zero."""
    p = lax.axis_size(axis_name)
    live = _live(items)
    to = live[None, :] & (items.peer[None, :] == jnp.arange(p)[:, None])  # (P, T): item i concerns peer q
    tail = a.shape[1:]
    pad = (1,) * len(tail)
    if mode == "push":
        rows = jnp.take(a, jnp.where(live, items.src, 0), axis=0)
        send = jnp.where(to.reshape(to.shape + pad), rows[None], jnp.zeros((), a.dtype))
        recv = lax.all_to_all(send, axis_name, 0, 0)  # (P, T, ...): what each device pushed to me
        where = lax.all_to_all(jnp.where(to, items.dst, out_rows), axis_name, 0, 0)
        y = jnp.zeros((out_rows,) + tail, a.dtype).at[where.reshape(-1)].set(recv.reshape((-1,) + tail), mode="drop")
    else:
        asked = lax.all_to_all(jnp.where(to, items.src, -1), axis_name, 0, 0)  # (P, T): rows each device asks of me
        served = jnp.take(a, jnp.clip(asked, 0, a.shape[0] - 1), axis=0)
        served = jnp.where((asked >= 0).reshape(asked.shape + pad), served, jnp.zeros((), a.dtype))
        back = lax.all_to_all(served, axis_name, 0, 0)  # (P, T, ...): [q, i] is peer q's answer to my item i
        got = back[jnp.clip(items.peer, 0, p - 1), jnp.arange(items.src.shape[0])]
        y = jnp.zeros((out_rows,) + tail, a.dtype).at[jnp.where(live, items.dst, out_rows)].set(got, mode="drop")
    return _zeroed(y, items)


# --------------------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------------------
def _kernel(a_ref, src_ref, peer_ref, dst_ref, zero_ref, counts_ref, zeros_ref, o_ref, ring, blank, loaded, ready,
            *, axis_name: str, n_peers: int, n_ctas: int, depth: int, pull: bool):
    """a_ref (S, D), o_ref (R, D) in GMEM; src/peer/dst (T,), zero (Z,), counts (2,) = (n_live, n_zero), int32;
    zeros_ref (D,) zeros; ring (depth, D) and blank (D,) SMEM; loaded: depth TMA barriers; ready: one."""
    arrived = pl.get_global(plgpu.SemaphoreType.REGULAR)  # zero-filled by XLA before every call
    dev = lax.axis_index(axis_name)
    cta = lax.axis_index("cta")
    n_live, n_zero = counts_ref[0], counts_ref[1]
    mine = a2a._items_of_cta(cta, n_items=n_live + n_zero, n_ctas=n_ctas)

    plgpu.copy_gmem_to_smem(zeros_ref, blank, ready, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
    plgpu.barrier_wait(ready)

    def load(step):
        item = cta + step * n_ctas

        @pl.when(item < n_live)
        def _():
            src = src_ref[item]
            ref = plgpu.remote_ref(a_ref, peer_ref[item], device_id_type=pl.DeviceIdType.LOGICAL) if pull else a_ref
            slot = lax.rem(step, depth)
            plgpu.copy_gmem_to_smem(ref.at[src], ring.at[slot], loaded.at[slot],
                                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

    for step in range(depth - 1):
        pl.when(step < mine)(functools.partial(load, step))

    def body(step, carry):
        item = cta + step * n_ctas

        @pl.when(item < n_live)
        def _():
            slot = lax.rem(step, depth)
            plgpu.barrier_wait(loaded.at[slot])
            dst = dst_ref[item]
            out = o_ref if pull else plgpu.remote_ref(o_ref, peer_ref[item], device_id_type=pl.DeviceIdType.LOGICAL)
            plgpu.copy_smem_to_gmem(ring.at[slot], out.at[dst])

        @pl.when(item >= n_live)
        def _():
            plgpu.copy_smem_to_gmem(blank, o_ref.at[zero_ref[item - n_live]])

        # The store of step - 1 must have read its slot before the load of step + depth - 1 overwrites it.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        pl.when(step + depth - 1 < mine)(functools.partial(load, step + depth - 1))
        return carry

    lax.fori_loop(0, mine, body, 0)
    plgpu.wait_smem_to_gmem(0)  # every store of this CTA has landed (written, not only read)
    for k in range(1, n_peers):  # release: the peers may rely on everything this CTA wrote or read
        pl.semaphore_signal(arrived, 1, device_id=lax.rem(dev + k, n_peers), device_id_type=pl.DeviceIdType.LOGICAL)

    @pl.when(cta == 0)
    def _():  # no device may finish before every peer has finished writing into it or reading from it
        pl.semaphore_wait(arrived, (n_peers - 1) * n_ctas, decrement=False)


def _row_cover(a: jax.Array) -> str | None:
    dtype = jnp.dtype(a.dtype)
    if dtype.itemsize not in (1, 2, 4) or jnp.issubdtype(dtype, jnp.complexfloating) or dtype == jnp.bool_:
        return f"dtype {dtype} (the kernel moves rows of 1-, 2- and 4-byte elements)"
    if a.ndim < 1 or a.shape[0] == 0:
        return f"an array of shape {a.shape}: needs a nonempty row axis"
    row_bytes = math.prod(a.shape[1:]) * dtype.itemsize
    if row_bytes % a2a.BULK_ALIGN or row_bytes > MAX_ROW_BYTES:
        return f"rows of {row_bytes} bytes (needs a multiple of {a2a.BULK_ALIGN}, at most {MAX_ROW_BYTES})"
    return None


def pallas_cover(a: jax.Array, axis_name: str) -> str | None:
    """Why impl="pallas" cannot run here, or None when it can."""
    if not compat.MGPU_REMOTE_LOAD:
        return f"jax {jax.__version__}: Mosaic GPU loads from a peer's memory from jax 0.11.1 on"
    return a2a.pallas_cover(jnp.zeros((lax.axis_size(axis_name), 16), jnp.uint8), axis_name) or _row_cover(a)


def move_pallas(a: jax.Array, items: Items, out_rows: int, mode: Mode, axis_name: str,
                num_ctas: int | None = None) -> jax.Array:
    """The kernel (no device checks: it can be lowered for CUDA on a machine without a GPU)."""
    if (why := _row_cover(a)) is not None:
        raise NotImplementedError(f"row_exchange (pallas): {why}")
    flat = a.reshape(a.shape[0], -1)
    d = flat.shape[1]
    row_bytes = d * flat.dtype.itemsize
    depth = max(2, min(16, RING_BYTES // row_bytes))
    n_ctas = num_ctas or device.num_sms(None)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    counts = jnp.stack([i32(items.n_live), i32(items.n_zero)])
    zero = i32(items.zero) if items.zero.shape[0] else jnp.zeros((1,), jnp.int32)  # (an empty GMEM ref cannot lower)
    out = plgpu.kernel(
        functools.partial(_kernel, axis_name=axis_name, n_peers=lax.axis_size(axis_name), n_ctas=n_ctas, depth=depth,
                          pull=mode == "pull"),
        out_type=jax.ShapeDtypeStruct((out_rows, d), flat.dtype),
        scratch_types=[plgpu.SMEM((depth, d), flat.dtype), plgpu.SMEM((d,), flat.dtype),
                       plgpu.Barrier(num_barriers=depth), plgpu.Barrier(num_barriers=1)],
        grid=(n_ctas,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name=f"rows_{mode}",
    )(flat, i32(items.src), i32(items.peer), i32(items.dst), zero, counts, jnp.zeros((d,), flat.dtype))
    missing = a2a._varying_axes(a) - a2a._varying_axes(out)
    out = lax.pcast(out, tuple(sorted(missing)), to="varying") if missing else out
    return out.reshape((out_rows,) + a.shape[1:])


def move(a: jax.Array, items: Items, out_rows: int, mode: Mode, axis_name: str, impl: Impl = "auto") -> jax.Array:
    """Push or pull rows by `items` inside shard_map (module doc); not differentiable by itself (the MoE dispatch
    pairs push and pull as each other's transpose). impl "pallas": the NVLink kernel (NotImplementedError naming
    why where it cannot run); "xla": `move_reference`; "auto": the kernel where it applies."""
    if mode not in ("push", "pull"):
        raise ValueError(f"row_exchange: mode must be 'push' or 'pull', got {mode!r}")
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"row_exchange: impl must be 'auto', 'pallas' or 'xla', got {impl!r}")
    shapes = {k: jnp.shape(getattr(items, k)) for k in ("src", "peer", "dst")}
    if len(set(shapes.values())) != 1 or len(shapes["src"]) != 1:
        raise ValueError(f"row_exchange: items.src, peer and dst must be 1-D of one length, got {shapes}")
    if jnp.ndim(items.n_live) or jnp.ndim(items.n_zero) or jnp.ndim(items.zero) != 1:
        raise ValueError(f"row_exchange: items.n_live and n_zero must be scalars and zero 1-D, got shapes "
                         f"{jnp.shape(items.n_live)}, {jnp.shape(items.n_zero)} and {jnp.shape(items.zero)}")
    if impl == "xla" or (why := pallas_cover(a, axis_name)) is not None:
        if impl == "pallas":
            raise NotImplementedError(f"row_exchange (pallas): {why}")
        return move_reference(a, items, out_rows, mode, axis_name)
    return move_pallas(a, items, out_rows, mode, axis_name)
