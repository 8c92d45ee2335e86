"""All-to-all over NVLink inside one node: each GPU writes its chunks straight into the peers' outputs.

Semantics (the same as `jax.lax.all_to_all(x, axis_name, 0, 0)`, non-tiled, split = concat = axis 0). Inside
shard_map over a mesh axis of size P, every device d holds x_d of shape (P, C, ...); chunk x_d[p] goes to device p
and lands at row block d of p's output:

    y_p[d] = x_d[p]        for all devices d, p        (y_d[d] = x_d[d] stays local)

The permutation is its own transpose, so the VJP of the exchange is the same exchange of the cotangent, and two
exchanges in a row are the identity.

Partly filled chunks (`rows` = (sent, received)): when only the first s_d[p] rows (axis 1) of x_d[p] hold data, as
in the MoE dispatch, whose receive buffers are sized for the worst routing,

    y_p[d][r] = x_d[p][r]  for r < s_d[p],   0 for r >= s_d[p]

Device p knows s_d[p] as its received[d]. The kernel copies only those rows and the output is masked with
`received` afterwards (an elementwise select, for XLA to fuse into the consumer); lax.all_to_all moves everything
and is masked the same way, so both impls give the same result. The transpose is the same exchange of the cotangent
with sent and received swapped.

Data movement (per device; the whole chunk x_d[p] is contiguous, N = C * prod(x.shape[2:]) elements):
- Chunk q's first M_q elements travel: M_q = N, or with `rows` the rows to send times the row's elements, rounded
  up to 16 bytes (at most N). The (P, N) view is cut into P * ceil(max_q M_q / T) work items (peer offset
  k = item % P, tile t = item // P) of T elements each. Item (k, t) copies x_d[q, off : off + T] into
  y_q[d, off : off + T] on device q = (d + k) % P, off = max(0, min(t * T, M_q - T)), when t * T < M_q, and does
  nothing otherwise: the last tile of a chunk overlaps its neighbour instead of being shorter, so every copy has the
  same static size; the overlap writes the same bytes twice with the same values (or, past M_q, rows nobody reads).
  An item that copies nothing still takes its turn in the ring: it waits for every store to have read its slot
  before the next load reuses it.
- G CTAs (a persistent grid, default one per SM) take items c, c + G, c + 2G, ...; k varies fastest, so at any
  moment a device sends to, and receives from, all peers about equally.
- Per CTA a ring of `depth` SMEM slots of T elements: bulk copy (TMA, `cp.async.bulk`, 1-D contiguous) local gmem
  -> slot, then slot -> the peer's output through `plgpu.remote_ref` (NVLink peer memory; k = 0 is the local
  self-copy through the same path). depth - 1 loads are in flight ahead of the store; a slot is reloaded once the
  store that read it has finished reading SMEM. No register traffic, no multicast (forbidden on the lent machines,
  and not needed: every byte has exactly one destination).
- Completion: each CTA waits until all its stores have landed (`wait_smem_to_gmem(0)`: written, not only read),
  then signals a semaphore on every peer (`red.release.sys`); CTA 0 of every device waits until its semaphore has
  counted (P - 1) * G signals (`ld.relaxed.sys` poll + `fence.acquire.sys`) before the kernel may end, so no device
  returns before every incoming write has landed. Local self-copies are covered by each CTA's own final wait.
- Bytes per device: reads P * N * s from local HBM (s = itemsize), sends (P - 1) * N * s over NVLink, writes N * s
  locally, receives (P - 1) * N * s; the overlapping last tiles add at most P * T * s. With `rows`, M_q replaces N
  for each chunk. Bus bandwidth in the nccl-tests convention: busbw = P * N * s * (P - 1) / P / t.

Synchronisation that XLA provides (read in jax 0.11.2 and the jax-cuda13-pjrt 0.11.2 plugin, not guessed):
- A kernel that uses `plgpu.remote_ref` / a remote `semaphore_signal` without NVSHMEM is marked
  `uses_xla_collective_metadata` (jax/experimental/mosaic/gpu/launch_context.py `to_remote`); with one process
  holding all GPUs, XLA's `mosaic_gpu_v2` handler exchanges every device's kernel parameter addresses (inputs,
  outputs, the global-semaphore scratch) in its Initialize stage (a host rendezvous), and the kernel computes a
  peer's address as peer base + (local address - local base) on the device (`LaunchContext.to_remote`). The 1-D
  bulk copies used here resolve the peer pointer on the device, so the peer index may be a runtime value (2-D TMA
  descriptors, by contrast, are built on the host and need a peer id the host can recompute from the device id).
- `pl.get_global(plgpu.SemaphoreType.REGULAR)` is a GMEM scratch operand that Pallas zero-fills with an XLA op
  before every call (jax/_src/pallas/mosaic_gpu/pallas_call_registration.py), aliased into the custom call.
- Before launching such a kernel the handler runs a multi-GPU barrier kernel on the kernel's stream: jax's
  jaxlib/mosaic/gpu/custom_call.cc calls `LaunchMultiGpuBarrier` (every device writes its slot in every peer's
  signal buffer, a dedicated allocation, then waits for all slots) before each collective-metadata launch; jax
  0.11.2 lowers the call with `skip_device_barrier = false`, and the jax-cuda13-pjrt 0.11.2 plugin reads that
  attribute and carries the barrier's "Starting multi-GPU barrier with key" log line. Once a device passes the
  barrier, every device of the mesh has finished all its earlier stream work: the peers' output buffers are
  allocated and no longer used by earlier ops, and their semaphores are zeroed. This is what makes the first
  remote write safe. A "ready" handshake inside the kernel would not add safety without that barrier: the only
  memory a peer could signal into is itself an XLA buffer (the semaphore scratch) that may still be zero-filled or
  in use on the peer. So the kernel keeps the default barrier and relies on it; on jax < 0.11 (the barrier is not
  checked there) impl="pallas" refuses (`compat.MGPU_COLLECTIVE_PRELAUNCH_BARRIER`).
- Repeated calls (a Python loop, a fori_loop, two calls in one jit): each call has its own zero-filled semaphore
  and its own barrier, and no device leaves call i before all its incoming writes of call i landed, so no write of
  call i + 1 can reach a peer still inside call i.

Constraints of the collective-metadata path (impl="pallas" raises NotImplementedError, impl="auto" falls back):
one process sees all devices; the exchanged axis spans every device of the mesh (the barrier and the pointer
exchange cover the whole mesh); the mesh's device ids must be row-major (Mosaic raises otherwise at lowering); an
sm_90 GPU; N * itemsize a multiple of 16 bytes (bulk-copy alignment); dtypes of 1, 2 or 4 bytes (bool travels as
uint8). jax 0.11.2's Mosaic-GPU interpreter cannot run this kernel on CPU: it supports neither `pl.get_global`
semaphores ("No ir_type_handler for aval type: AbstractRef") nor remote refs ("'PeerMemRef' object has no
attribute 'indices'"), so CPU tests check the work plan in NumPy and lower the kernel for CUDA without a GPU.

Trade-offs: the kernel occupies every SM it is given (NCCL uses a few channels and can overlap compute); for the
MoE exchange nothing else runs meanwhile, and `num_ctas` is a knob. Copies are byte moves, so any 1/2/4-byte dtype
is bit-exact. Sources: PTX ISA 8.x, `cp.async.bulk` / `cp.async.bulk.wait_group` / `red.release.sys`; the
signal-after-store pattern of jax's experimental/pallas/ops/gpu/collective_matmul_mgpu.py; nccl-tests
doc/PERFORMANCE.md for busbw.
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

Impl = Literal["auto", "pallas", "xla"]
SMEM_BYTES = 227 * 1024  # per-CTA shared memory on H100/H200
BULK_ALIGN = 16  # bytes: cp.async.bulk sizes and addresses


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class A2AConfig:
    """The kernel's tuning knobs; `python benchmarks/bench_dispatch.py --tune` sweeps them."""

    num_ctas: int | None = None  # persistent grid size G; None: one CTA per SM
    tile_bytes: int = 16 * 1024  # bytes per bulk copy (T * itemsize), a multiple of 16
    depth: int = 4  # SMEM ring slots per CTA (>= 2): depth - 1 loads in flight ahead of the store

    def __post_init__(self):
        if self.num_ctas is not None and self.num_ctas < 1:
            raise ValueError(f"A2AConfig: num_ctas must be >= 1 or None, got {self.num_ctas}")
        if self.tile_bytes < BULK_ALIGN or self.tile_bytes % BULK_ALIGN:
            raise ValueError(f"A2AConfig: tile_bytes must be a multiple of {BULK_ALIGN} bytes, got {self.tile_bytes}")
        if self.depth < 2:
            raise ValueError(f"A2AConfig: depth must be >= 2, got {self.depth}")
        if self.depth * self.tile_bytes > SMEM_BYTES - 1024:  # (1 KiB for barriers and alignment)
            raise ValueError(
                f"A2AConfig: depth * tile_bytes = {self.depth * self.tile_bytes} exceeds shared memory ({SMEM_BYTES})"
            )


# 4 x H200, 64 MB per GPU (benchmarks/RESULTS.md): one CTA per SM, 16 KiB copies, 4 slots was the best of the sweep.
DEFAULT_CONFIG = A2AConfig()


# --------------------------------------------------------------------------------------------------------------
# Reference (also the "xla" path)
# --------------------------------------------------------------------------------------------------------------
def all_to_all_reference(x: jax.Array, axis_name: str) -> jax.Array:
    """y[p] on device d = x[d] on device p: XLA's all-to-all (NCCL on GPUs)."""
    return lax.all_to_all(x, axis_name, 0, 0)


# --------------------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------------------
def _work_item(item, dev, sent, *, n_peers: int, tile: int):
    """Work item -> (destination device, element offset in the chunk, whether it copies). `sent(q)` is how many
    leading elements of chunk q travel (`_sent_elements`); item (k, t) copies only while t * T < sent(q).
    Nonnegative ints only (lax.div/rem truncate), written with lax ops so that the same code runs in the kernel and,
    on arrays, in the tests."""
    target = lax.rem(dev + lax.rem(item, n_peers), n_peers)
    t = lax.div(item, n_peers)
    m = sent(target)
    off = lax.max(lax.min(t * tile, m - tile), 0)
    return target, off, t * tile < m


def _items_of_cta(cta, *, n_items, n_ctas: int):
    """How many of the items cta, cta + G, cta + 2G, ... exist."""
    return lax.div(n_items - cta + n_ctas - 1, n_ctas)


def _sent_elements(rows, *, row: int, n: int, unit: int):
    """Elements of a chunk that travel when its first `rows` rows (of `row` elements) hold data: rounded up to the
    bulk-copy unit (16 bytes), at most the chunk's n."""
    return lax.min(lax.div(rows * row + unit - 1, unit) * unit, n)


def _kernel(x_ref, rows_ref, o_ref, ring, loaded, *, axis_name: str, n_peers: int, tile: int, n: int, row: int,
            unit: int, n_ctas: int, depth: int):
    """x_ref, o_ref: (P, N) in GMEM; rows_ref: (P,) int32 rows to send per chunk; ring: (depth, T) SMEM;
    loaded: depth TMA barriers."""
    arrived = pl.get_global(plgpu.SemaphoreType.REGULAR)  # zero-filled by XLA before every call
    dev = lax.axis_index(axis_name)
    cta = lax.axis_index("cta")

    # Every chunk's length, read from GMEM once (a load per work item sat on the path that issues the copies)
    lengths = [_sent_elements(rows_ref[q], row=row, n=n, unit=unit) for q in range(n_peers)]

    def sent(q):
        return functools.reduce(lambda m, p: lax.select(q == p, lengths[p], m), range(1, n_peers), lengths[0])

    n_items = n_peers * lax.div(functools.reduce(lax.max, lengths) + tile - 1, tile)
    mine = _items_of_cta(cta, n_items=n_items, n_ctas=n_ctas)
    locate = functools.partial(_work_item, dev=dev, sent=sent, n_peers=n_peers, tile=tile)

    def load(step):
        slot = lax.rem(step, depth)
        target, off, live = locate(cta + step * n_ctas)

        @pl.when(live)
        def _():
            plgpu.copy_gmem_to_smem(
                x_ref.at[target, pl.ds(off, tile)], ring.at[slot], loaded.at[slot],
                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,  # in bounds by construction; selects the 1-D bulk copy
            )

    for step in range(depth - 1):
        pl.when(step < mine)(functools.partial(load, step))

    def body(step, carry):
        slot = lax.rem(step, depth)
        target, off, live = locate(cta + step * n_ctas)

        @pl.when(live)
        def _():
            plgpu.barrier_wait(loaded.at[slot])
            peer_out = plgpu.remote_ref(o_ref, target, device_id_type=pl.DeviceIdType.LOGICAL)
            plgpu.copy_smem_to_gmem(ring.at[slot], peer_out.at[dev, pl.ds(off, tile)])
            # The store of step - 1 must have read its slot before the load of step + depth - 1 overwrites it.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)

        @pl.when(~live)  # (an item past its chunk's rows: no load, no store; the next load still needs the slot)
        def _():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.when(step + depth - 1 < mine)(functools.partial(load, step + depth - 1))
        return carry

    lax.fori_loop(0, mine, body, 0)
    plgpu.wait_smem_to_gmem(0)  # every store of this CTA has landed (written, not only read)
    for k in range(1, n_peers):  # release: the peers may now rely on everything this CTA sent them
        pl.semaphore_signal(arrived, 1, device_id=lax.rem(dev + k, n_peers), device_id_type=pl.DeviceIdType.LOGICAL)

    @pl.when(cta == 0)
    def _():  # the kernel (and so the output's consumers) may not finish before all incoming writes landed
        pl.semaphore_wait(arrived, (n_peers - 1) * n_ctas, decrement=False)


# --------------------------------------------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------------------------------------------
def _as_payload(x: jax.Array) -> jax.Array:
    """The array the kernel moves: bool travels as uint8 (Mosaic has no 1-bit memrefs)."""
    return x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x


def pallas_cover(x: jax.Array, axis_name: str) -> str | None:
    """Why impl="pallas" cannot run here, or None when it can (device, topology, dtype and shape)."""
    return topology_cover(axis_name) or _shape_cover(x)


def topology_cover(axis_name: str) -> str | None:
    """Why an NVLink collective kernel over `axis_name` (XLA's collective-metadata path) cannot run here, or None:
    the device, the jax version, one process holding every GPU, and a shard_map axis spanning all of them."""
    if device.compute_capability() is None:
        return f"not an NVIDIA GPU (backend {jax.default_backend()!r})"
    if not device.on_hopper():
        return f"needs an sm_90 GPU, got compute capability {device.compute_capability()}"
    if not compat.MGPU_COLLECTIVE_PRELAUNCH_BARRIER:
        return f"jax {jax.__version__}: the pre-launch multi-GPU barrier the kernel relies on is checked from 0.11 only"
    if not device.one_process_sees_all_devices():
        return f"{jax.process_count()} processes: XLA's collective metadata path needs one process holding all GPUs"
    mesh = jax.sharding.get_abstract_mesh()
    if dict(zip(mesh.axis_names, mesh.axis_types)).get(axis_name) != jax.sharding.AxisType.Manual:
        return f"axis {axis_name!r} is not a shard_map axis of the current mesh (the kernel is an SPMD collective)"
    if (size := lax.axis_size(axis_name)) < 2:
        return f"axis {axis_name!r} has one device: nothing to exchange (and no peers for collective metadata)"
    if size != jax.device_count():
        return f"axis {axis_name!r} has {size} devices, the kernel needs an axis spanning all {jax.device_count()}"
    return None


def _bits(dtype: jnp.dtype) -> int:
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    return 8 * dtype.itemsize


def _shape_cover(x: jax.Array) -> str | None:
    dtype = jnp.dtype(x.dtype)
    whole_bytes = _bits(dtype) == 8 * dtype.itemsize  # (int4 / fp4 pack two per byte)
    if dtype != jnp.bool_ and (
        dtype.itemsize not in (1, 2, 4) or not whole_bytes or jnp.issubdtype(dtype, jnp.complexfloating)
    ):
        return f"dtype {dtype} (the kernel moves 1-, 2- and 4-byte elements and bool)"
    if x.ndim < 2 or x.size == 0:
        return f"x of shape {x.shape}: each chunk needs a nonempty row axis"
    chunk_bytes = math.prod(x.shape[1:]) * dtype.itemsize  # (bool: 1 byte, as its uint8 payload)
    if chunk_bytes % BULK_ALIGN:
        return f"a chunk of x {x.shape} {dtype} is {chunk_bytes} bytes, not a multiple of {BULK_ALIGN}"
    return None


def _grid(n_peers: int, n: int, itemsize: int, config: A2AConfig) -> tuple[int, int]:
    """(T elements per bulk copy, G CTAs) for P chunks of N elements (N * itemsize a multiple of 16 bytes)."""
    unit = BULK_ALIGN // itemsize
    tile = min(config.tile_bytes // itemsize, n) // unit * unit
    n_items = n_peers * pl.cdiv(n, tile)
    return tile, min(config.num_ctas or device.num_sms(None), n_items)


def all_to_all_pallas(x: jax.Array, axis_name: str, *, rows: jax.Array | None = None,
                      config: A2AConfig = DEFAULT_CONFIG) -> jax.Array:
    """The kernel on x (P, A, ...) inside shard_map; no device checks (the dispatcher's job), so it can also be
    lowered for CUDA on a machine without a GPU. `rows` (P,) int32: only the first rows[q] rows of chunk x[q] are
    sent (None: all A); the output's rows past what each peer sent are left as they are (unwritten)."""
    if (why := _shape_cover(x)) is not None:
        raise NotImplementedError(f"all_to_all (pallas): {why}")
    n_peers = x.shape[0]
    flat = _as_payload(x).reshape(n_peers, -1)  # (P, N): each chunk is contiguous
    n = flat.shape[1]
    row = math.prod(x.shape[2:])
    rows = jnp.full((n_peers,), x.shape[1], jnp.int32) if rows is None else jnp.clip(rows, 0, x.shape[1])
    tile, n_ctas = _grid(n_peers, n, flat.dtype.itemsize, config)
    out = plgpu.kernel(
        functools.partial(
            _kernel, axis_name=axis_name, n_peers=n_peers, tile=tile, n=n, row=row,
            unit=BULK_ALIGN // flat.dtype.itemsize, n_ctas=n_ctas, depth=config.depth,
        ),
        out_type=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        scratch_types=[plgpu.SMEM((config.depth, tile), flat.dtype), plgpu.Barrier(num_barriers=config.depth)],
        grid=(n_ctas,),
        grid_names=("cta",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        kernel_name="all_to_all",
    )(flat, rows.astype(jnp.int32))
    # A Mosaic-GPU kernel's output carries no varying axes; inside shard_map (check_vma) it varies like x.
    missing = compat.varying_axes(x) - compat.varying_axes(out)
    out = lax.pcast(out, tuple(sorted(missing)), to="varying") if missing else out
    out = out.reshape(x.shape)
    return out.astype(jnp.bool_) if x.dtype == jnp.bool_ else out


# --------------------------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------------------------
def _zero_past(y: jax.Array, rows: jax.Array) -> jax.Array:
    """y (P, A, ...) with the rows of chunk d from rows[d] on set to zero."""
    keep = jnp.arange(y.shape[1])[None, :] < rows[:, None]
    return jnp.where(keep.reshape(keep.shape + (1,) * (y.ndim - 2)), y, jnp.zeros((), y.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _exchange(x: jax.Array, rows, axis_name: str, impl: Impl, config: A2AConfig) -> jax.Array:
    sent, received = rows if rows is not None else (None, None)
    if impl == "xla" or (why := pallas_cover(x, axis_name)) is not None:
        if impl == "pallas":
            raise NotImplementedError(f"all_to_all (pallas): {why}")
        y = all_to_all_reference(x, axis_name)
    else:
        y = all_to_all_pallas(x, axis_name, rows=sent, config=config)
    return y if rows is None else _zero_past(y, received)


def _exchange_fwd(x, rows, axis_name, impl, config):
    return _exchange(x, rows, axis_name, impl, config), rows


def _exchange_bwd(axis_name, impl, config, rows, ct):
    back = None if rows is None else rows[::-1]  # the cotangent travels back: each peer returns what it received
    return _exchange(ct, back, axis_name, impl, config), None  # the permutation (masked) is its own transpose


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def all_to_all(x: jax.Array, axis_name: str, *, rows: tuple[jax.Array, jax.Array] | None = None,
               impl: Impl = "auto", config: A2AConfig = DEFAULT_CONFIG) -> jax.Array:
    """`lax.all_to_all(x, axis_name, 0, 0)` inside shard_map: x (P, A, ...) per device, P = the axis size.

    rows = (sent, received), both (P,) int: only the first sent[q] rows (along axis 1) of chunk x[q] hold data,
    and received[d] must be what device d's `sent` holds for this device (the rows it sends here). The result's
    chunk d then holds device d's rows up to received[d] and zeros after them, on every impl, and the kernel copies
    only those rows (rounded up to 16 bytes): a receive buffer sized for the worst case costs no bandwidth for its
    padding. None: every row.

    impl "pallas": the NVLink kernel (NotImplementedError naming the reason where it cannot run); "xla":
    lax.all_to_all; "auto": the kernel where it applies, else lax.all_to_all. Differentiable in x (custom_vjp: the
    backward is the same exchange of the cotangent, with sent and received swapped).
    """
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"all_to_all: impl must be 'auto', 'pallas' or 'xla', got {impl!r}")
    size = lax.axis_size(axis_name)
    if x.ndim < 1 or x.shape[0] != size:
        raise ValueError(
            f"all_to_all: `x` must have shape (P, ...) with P = {size}, the size of axis {axis_name!r}; "
            f"got shape {x.shape} dtype {x.dtype}"
        )
    if rows is not None:
        if x.ndim < 2 or len(rows) != 2 or any(jnp.shape(r) != (size,) for r in rows):
            raise ValueError(
                f"all_to_all: `rows` must be (sent, received), two arrays of shape ({size},), for x of shape "
                f"(P, A, ...); got x {x.shape} and rows of shapes {[jnp.shape(r) for r in rows]}"
            )
        rows = tuple(jnp.asarray(r, jnp.int32) for r in rows)
    return _exchange(x, rows, axis_name, impl, config)
