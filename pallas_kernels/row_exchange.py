"""Rows to per-row addresses on the peers over NVLink: push (write into the peers) and pull (read from the peers).

Semantics. Inside shard_map over a mesh axis of P devices, device d holds an array a_d (S, ...) and a list of T
items: item i names a row src[i], a peer peer[i] and a row dst[i]; the items [0, n_live) copy, the others do not.
Device d also names rows zero_d[j], j < n_zero, of its own output (R rows):

    push:  y_p[dst_d[i]] = a_d[src_d[i]]            for every device d and live item i of d with peer_d[i] = p
    pull:  y_d[dst_d[i]] = a_{peer_d[i]}[src_d[i]]  for every live item i of d
    both:  y_d[zero_d[j] + c] = 0                    for j < n_zero; c < chunk where j < n_chunks, else c = 0

Every other row of y is left unwritten: the caller names each row of every output exactly once, as a destination
or a zero row (no two items may write one row). Push and pull with the same items are each other's transpose (with
src and dst swapped): the MoE dispatch pushes each (token, expert) row straight to its place in the expert device's
buffer sorted by expert, and the combine pulls each output row home to its (token, choice) slot (mx_jax/dispatch.py,
"land").

The first n_chunks zero entries each start a run of `chunk` rows (`zero_work` cuts a mask's runs into such stores
of CHUNK_BYTES), and the rest are single rows.

Kernel (per device, a persistent grid of G CTAs, one per SM): the items and the zero entries form one list of
n_live + n_zero work items; CTA c takes c, c + G, c + 2G, ... An item moves one row (a row is at most a few tens of
KiB: the hidden state of one token). Per CTA a ring of `depth` SMEM slots of one row each: bulk copy (TMA,
`cp.async.bulk`, 1-D contiguous: the arrays are passed flat) gmem -> slot, then slot -> gmem; for push the store
goes to the peer's output through `plgpu.remote_ref` (NVLink), for pull the load comes from the peer's input the
same way (the peer index is a runtime value: the 1-D bulk copies resolve the peer pointer on the device). Loads run
depth - S items ahead of the store and S stores stay in flight (S = STORES_IN_FLIGHT); a slot is reloaded once the
store that read it has finished reading SMEM. A zero entry is a store from an SMEM buffer of `chunk` zero rows,
loaded once per CTA. An item's src, peer and dst are scalar loads from GMEM, issued one iteration before they are
needed (clamped in bounds, no branch) and carried by the loop.

Measured (2 x H200, the 4-layer DeepSeekMoE step at expert=2, 9 pushes and 9 pulls of up to 49,152 rows of 4 KiB
per step; benchmarks/RESULTS.md, session 48): with one zeroing store per row and each item's indices loaded where
they were used, push took 4.91 and pull 3.41 ms a step; zeroing in runs of 32 KiB and loading the indices an
iteration ahead, 3.72 and 3.28 ms. The receive buffer there is twice the rows that arrive, so half of push's work
items had been zero rows.

Completion, as in pallas_kernels/all_to_all.py (its docstring has the collective-metadata path, the pre-launch
multi-GPU barrier and why they make the first remote access safe): each CTA waits until its stores have landed,
then signals a semaphore on every peer; CTA 0 of every device waits for (P - 1) G signals before the kernel ends.
For push this means no device returns before every row written into it has landed; for pull, no device returns
(and lets XLA reuse the input its peers read) before every peer has finished reading it. The barrier before the
launch means every peer's input is complete when the first remote load is issued.

Bytes per device: reads n_live rows, writes as many (push: to the peers, pull: locally) and the zero rows; nothing
for rows that hold no data, so a buffer sized for the worst routing costs only its zeroing (a memset's bytes).

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
# S: stores a CTA leaves in flight; loads run depth - S items ahead. S = 1, 2, 4, 8 timed the same on 2 x H200 at
# DeepSeekMoE's and Mixtral's shapes (push 0.46-0.48 and 0.36 ms, pull 0.70-0.71 and 0.49-0.52 ms; RESULTS.md).
STORES_IN_FLIGHT = 1
MAX_ROW_BYTES = RING_BYTES // 2  # a ring needs at least two slots


@dataclasses.dataclass(frozen=True)
class Items:
    """One device's work list (all int32): items [0, n_live) copy row src[i] <-> (peer[i], dst[i]); zero[j] for
    j < n_chunks start runs of `chunk` rows of this device's output to set to zero, and zero[j] for
    n_chunks <= j < n_zero single rows (`zero_work` builds them from a mask). src, peer, dst: (T,); zero: (Z,);
    n_live, n_chunks, n_zero: scalars; chunk: a static int."""

    src: jax.Array
    peer: jax.Array
    dst: jax.Array
    n_live: jax.Array
    zero: jax.Array
    n_zero: jax.Array
    n_chunks: jax.Array | int = 0
    chunk: int = 1


jax.tree_util.register_dataclass(Items, data_fields=["src", "peer", "dst", "n_live", "zero", "n_zero", "n_chunks"],
                                 meta_fields=["chunk"])

CHUNK_BYTES = 32 * 1024  # a zeroing store: several rows at once where they are contiguous


def zero_chunk(row_bytes: int) -> int:
    """Rows per zeroing store for rows of `row_bytes`."""
    return max(1, CHUNK_BYTES // row_bytes)


def zero_work(zero: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(zero list, n_chunks, n_zero) for `Items` that set the rows where `zero` (W,) bool holds: each run of such
    rows is cut into stores of `chunk` rows from its first row on, and its last (length mod chunk) rows are single
    stores. A receive buffer's padding is a few long runs (each expert's padding, and the tail past the data), so
    zeroing it costs about W / chunk stores instead of one per row."""
    w = zero.shape[0]
    r = jnp.arange(w, dtype=jnp.int32)
    first = zero & ~jnp.pad(zero[:-1], (1, 0))  # (a pad, not a concatenation: no empty piece when w == 1)
    last = zero & ~jnp.pad(zero[1:], (0, 1))
    start = lax.cummax(jnp.where(first, r, 0))  # (meaningful on the rows where zero holds)
    end = lax.cummin(jnp.where(last, r + 1, w), reverse=True)
    off, length = r - start, end - start
    whole = length - length % chunk
    is_chunk = zero & (off % chunk == 0) & (off < whole)
    single = zero & (off >= whole)
    order = jnp.argsort(jnp.where(is_chunk, 0, jnp.where(single, 1, 2)), stable=True).astype(jnp.int32)
    n_chunks = jnp.sum(is_chunk, dtype=jnp.int32)
    return order, n_chunks, n_chunks + jnp.sum(single, dtype=jnp.int32)


# --------------------------------------------------------------------------------------------------------------
# Reference (also the "xla" path)
# --------------------------------------------------------------------------------------------------------------
def _zeroed(y: jax.Array, items: Items) -> jax.Array:
    """y with its zero rows set to zero (the entries past n_zero are ignored)."""
    j = jnp.arange(items.zero.shape[0])
    width = jnp.where(j < items.n_chunks, items.chunk, 1)
    rows = items.zero[:, None] + jnp.arange(items.chunk)[None, :]
    rows = jnp.where((j[:, None] < items.n_zero) & (jnp.arange(items.chunk)[None, :] < width[:, None]), rows,
                     y.shape[0])
    return y.at[rows.reshape(-1)].set(jnp.zeros((), y.dtype), mode="drop")


def move_reference(a: jax.Array, items: Items, out_rows: int, mode: Mode, axis_name: str) -> jax.Array:
    """The semantics with lax.all_to_all; rows that no item or zero row names are zero."""
    p = lax.axis_size(axis_name)
    live = jnp.arange(items.src.shape[0]) < items.n_live
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
            *, axis_name: str, n_peers: int, n_ctas: int, depth: int, ahead: int, pull: bool, row: int, chunk: int):
    """a_ref (S D,), o_ref (R D,) in GMEM, flat: row r is [r D, (r + 1) D); src/peer/dst (T,), zero (Z,), counts
    (3,) = (n_live, n_chunks, n_zero), int32; zeros_ref (chunk D,) zeros; ring (depth, D) and blank (chunk D,)
    SMEM; loaded: depth TMA barriers; ready: one."""
    arrived = pl.get_global(plgpu.SemaphoreType.REGULAR)  # zero-filled by XLA before every call
    dev = lax.axis_index(axis_name)
    cta = lax.axis_index("cta")
    n_live, n_chunks, n_zero = counts_ref[0], counts_ref[1], counts_ref[2]
    mine = a2a._items_of_cta(cta, n_items=n_live + n_zero, n_ctas=n_ctas)
    last_item, last_zero = src_ref.shape[0] - 1, zero_ref.shape[0] - 1

    plgpu.copy_gmem_to_smem(zeros_ref, blank, ready, oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
    plgpu.barrier_wait(ready)

    def meta(step):
        """Work item cta + step G's (src, peer, dst, zero row): loads clamped in bounds, so that they can be issued
        an iteration before they are needed, with no branch (a scalar load from GMEM takes an L2 round trip)."""
        item = cta + step * n_ctas
        i = lax.min(item, last_item)
        j = lax.max(lax.min(item - n_live, last_zero), 0)
        return src_ref[i], peer_ref[i], dst_ref[i], zero_ref[j]

    def load(step, src, peer):
        @pl.when(cta + step * n_ctas < n_live)
        def _():
            ref = plgpu.remote_ref(a_ref, peer, device_id_type=pl.DeviceIdType.LOGICAL) if pull else a_ref
            slot = lax.rem(step, depth)
            plgpu.copy_gmem_to_smem(ref.at[pl.ds(src * row, row)], ring.at[slot], loaded.at[slot],
                                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

    for step in range(ahead):
        src, peer, _, _ = meta(step)
        pl.when(step < mine)(functools.partial(load, step, src, peer))

    def body(step, carry):
        (peer, dst, zrow), (load_src, load_peer) = carry  # item step's store; item step + ahead's load
        _, next_peer, next_dst, next_zrow = meta(step + 1)
        ahead_src, ahead_peer, _, _ = meta(step + ahead + 1)
        z = cta + step * n_ctas - n_live  # >= 0: a zeroing item

        @pl.when(z < 0)
        def _():
            slot = lax.rem(step, depth)
            plgpu.barrier_wait(loaded.at[slot])
            out = o_ref if pull else plgpu.remote_ref(o_ref, peer, device_id_type=pl.DeviceIdType.LOGICAL)
            plgpu.copy_smem_to_gmem(ring.at[slot], out.at[pl.ds(dst * row, row)])

        @pl.when((z >= 0) & (z < n_chunks))
        def _():
            plgpu.copy_smem_to_gmem(blank, o_ref.at[pl.ds(zrow * row, chunk * row)])

        @pl.when(z >= n_chunks)
        def _():
            plgpu.copy_smem_to_gmem(blank.at[pl.ds(0, row)], o_ref.at[pl.ds(zrow * row, row)])

        # The load of step + ahead reuses the slot of step + ahead - depth = step - S: that store must have read it.
        plgpu.wait_smem_to_gmem(depth - ahead, wait_read_only=True)
        pl.when(step + ahead < mine)(functools.partial(load, step + ahead, load_src, load_peer))
        return (next_peer, next_dst, next_zrow), (ahead_src, ahead_peer)

    _, first_peer, first_dst, first_zrow = meta(0)
    ahead_src, ahead_peer, _, _ = meta(ahead)
    lax.fori_loop(0, mine, body, ((first_peer, first_dst, first_zrow), (ahead_src, ahead_peer)))
    plgpu.wait_smem_to_gmem(0)  # every store of this CTA has landed (written, not only read)
    for k in range(1, n_peers):  # release: the peers may rely on everything this CTA wrote or read
        pl.semaphore_signal(arrived, 1, device_id=lax.rem(dev + k, n_peers), device_id_type=pl.DeviceIdType.LOGICAL)

    @pl.when(cta == 0)
    def _():  # no device may finish before every peer has finished writing into it or reading from it
        pl.semaphore_wait(arrived, (n_peers - 1) * n_ctas, decrement=False)


def _row_cover(a: jax.Array, out_rows: int = 0) -> str | None:
    dtype = jnp.dtype(a.dtype)
    if dtype.itemsize not in (1, 2, 4) or jnp.issubdtype(dtype, jnp.complexfloating) or dtype == jnp.bool_:
        return f"dtype {dtype} (the kernel moves rows of 1-, 2- and 4-byte elements)"
    if a.ndim < 1 or a.shape[0] == 0:
        return f"an array of shape {a.shape}: needs a nonempty row axis"
    row_bytes = math.prod(a.shape[1:]) * dtype.itemsize
    if row_bytes % a2a.BULK_ALIGN or row_bytes > MAX_ROW_BYTES:
        return f"rows of {row_bytes} bytes (needs a multiple of {a2a.BULK_ALIGN}, at most {MAX_ROW_BYTES})"
    if max(a.size, out_rows * math.prod(a.shape[1:])) >= 2**31:
        return f"{max(a.shape[0], out_rows)} rows of {math.prod(a.shape[1:])} elements: offsets past int32"
    return None


def pallas_cover(a: jax.Array, axis_name: str, out_rows: int = 0) -> str | None:
    """Why impl="pallas" cannot run here, or None when it can."""
    if not compat.MGPU_REMOTE_LOAD:
        return f"jax {jax.__version__}: Mosaic GPU loads from a peer's memory from jax 0.11.1 on"
    return a2a.topology_cover(axis_name) or _row_cover(a, out_rows)


def move_pallas(a: jax.Array, items: Items, out_rows: int, mode: Mode, axis_name: str,
                num_ctas: int | None = None) -> jax.Array:
    """The kernel (no device checks: it can be lowered for CUDA on a machine without a GPU)."""
    if (why := _row_cover(a, out_rows)) is not None:
        raise NotImplementedError(f"row_exchange (pallas): {why}")
    d = math.prod(a.shape[1:])
    depth = max(2, min(16, RING_BYTES // (d * a.dtype.itemsize)))
    ahead = max(1, depth - STORES_IN_FLIGHT)
    n_ctas = num_ctas or device.num_sms(None)

    def i32(v):  # (an empty GMEM ref cannot lower: one unused entry instead)
        v = jnp.asarray(v, jnp.int32)
        return v if v.size else jnp.zeros((1,), jnp.int32)

    counts = jnp.stack([i32(items.n_live).reshape(()), i32(items.n_chunks).reshape(()), i32(items.n_zero).reshape(())])
    out = plgpu.kernel(
        functools.partial(_kernel, axis_name=axis_name, n_peers=lax.axis_size(axis_name), n_ctas=n_ctas, depth=depth,
                          ahead=ahead, pull=mode == "pull", row=d, chunk=items.chunk),
        out_type=jax.ShapeDtypeStruct((out_rows * d,), a.dtype),
        scratch_types=[plgpu.SMEM((depth, d), a.dtype), plgpu.SMEM((items.chunk * d,), a.dtype),
                       plgpu.Barrier(num_barriers=depth), plgpu.Barrier(num_barriers=1)],
        grid=(n_ctas,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name=f"rows_{mode}",
    )(a.reshape(-1), i32(items.src), i32(items.peer), i32(items.dst), i32(items.zero), counts,
      jnp.zeros((items.chunk * d,), a.dtype))
    missing = compat.varying_axes(a) - compat.varying_axes(out)
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
    if jnp.ndim(items.n_live) or jnp.ndim(items.n_zero) or jnp.ndim(items.n_chunks) or jnp.ndim(items.zero) != 1:
        raise ValueError(f"row_exchange: items.n_live, n_chunks and n_zero must be scalars and zero 1-D, got shapes "
                         f"{jnp.shape(items.n_live)}, {jnp.shape(items.n_chunks)}, {jnp.shape(items.n_zero)} and "
                         f"{jnp.shape(items.zero)}")
    if not isinstance(items.chunk, int) or items.chunk < 1:
        raise ValueError(f"row_exchange: items.chunk must be a positive int, got {items.chunk!r}")
    if impl == "xla" or (why := pallas_cover(a, axis_name, out_rows)) is not None:
        if impl == "pallas":
            raise NotImplementedError(f"row_exchange (pallas): {why}")
        return move_reference(a, items, out_rows, mode, axis_name)
    return move_pallas(a, items, out_rows, mode, axis_name)
