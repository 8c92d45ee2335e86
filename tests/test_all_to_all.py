"""pallas_kernels.all_to_all: the NVLink exchange against lax.all_to_all.

CPU (8 fake devices): impl "auto" and "xla" equal lax.all_to_all over an axis of 8 and an axis of 4, the custom_vjp
gradient equals lax's, impl "pallas" raises NotImplementedError naming why; with rows=(sent, received) the result
is zero past the sent rows and the gradient is the masked exchange back; the kernel's work plan (which CTA copies
which bytes to which device) replayed in NumPy reproduces lax's result, on every sent row when only some travel, and
copies no tile twice; and the kernel lowers for CUDA without a
GPU (Mosaic's Python passes, collective metadata, the pre-launch barrier kept). jax 0.11.2's Mosaic-GPU interpreter
cannot execute the kernel (it supports neither `pl.get_global` semaphores nor remote refs), so no CPU test runs it.

GPU (MX_JAX_TEST_GPU=1, one process seeing >= 2 Hopper GPUs): the kernel bit-exact against lax.all_to_all for bf16,
f32, int32, int8 and bool payloads and several tilings, repeated calls (Python loop, fori_loop, twice in one jit),
and the gradient; with rows, bit-exact against lax.all_to_all masked to the sent rows (empty, partial and full
chunks, rows of 6 bytes) on three calls in a row, and its gradient against the "xla" impl's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from mx_jax import compat
from pallas_kernels import all_to_all as a2a


# The CPU tests need the 8 fake CPU devices of conftest (GPU runs select `-m gpu`).
on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU test: 8 fake devices, no kernel runs")


def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))],
                         axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


def _sharded(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _on_axis(fn, mesh, spec, *args):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec))(*args)


# Meshes: an axis spanning all 8 devices, and an axis of 4 inside a (2, 4) mesh (the kernel's "not all devices").
MESHES = [((8,), ("expert",), P("expert")), ((2, 4), ("data", "expert"), P(("data", "expert")))]


@on_cpu
@pytest.mark.parametrize("shape,names,spec", MESHES)
@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_matches_lax(shape, names, spec, impl):
    mesh = _mesh(shape, names)
    p = shape[-1]
    rng = np.random.default_rng(0)
    host = rng.standard_normal((8 * p, 6, 16)).astype(np.float32)
    x = _sharded(mesh, jnp.asarray(host, jnp.bfloat16), spec)
    got = _on_axis(functools.partial(a2a.all_to_all, axis_name="expert", impl=impl), mesh, spec, x)
    # Independently of lax: in each group of p devices along `expert`, device d's chunk q lands on device q at d.
    groups = 8 // p
    want = host.reshape(groups, p, p, -1, 6, 16).swapaxes(1, 2).reshape(host.shape)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32))  # a permutation: exact
    assert not np.array_equal(want, host)


@on_cpu
@pytest.mark.parametrize("shape,names,spec", MESHES)
def test_grad_matches_lax(shape, names, spec):
    mesh = _mesh(shape, names)
    p = shape[-1]
    rng = np.random.default_rng(1)
    x = _sharded(mesh, jnp.asarray(rng.standard_normal((8 * p, 5, 8)), jnp.float32), spec)
    w = _sharded(mesh, jnp.asarray(rng.standard_normal((8 * p, 5, 8)), jnp.float32), spec)

    def loss(exchange, x, w):
        inner = jax.shard_map(lambda v, u: jnp.sum(u * jnp.tanh(exchange(v)), keepdims=True)[None],
                              mesh=mesh, in_specs=(spec, spec), out_specs=spec)
        return jnp.sum(inner(x, w))

    got = jax.jit(jax.grad(functools.partial(loss, lambda v: a2a.all_to_all(v, "expert"))))(x, w)
    want = jax.jit(jax.grad(functools.partial(loss, lambda v: lax.all_to_all(v, "expert", 0, 0))))(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)  # f32: same math


def _row_table(p: int, a: int, seed: int) -> np.ndarray:
    """sent[d, q]: rows device d sends to q in each group of p devices, from none to all a."""
    table = np.random.default_rng(seed).integers(0, a + 1, (p, p))
    table[0, 1], table[1, 0] = 0, a
    return table


def _rows_on_axis(table: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per device of the axis (sharded as x is), its `sent` row and its `received` column of the table."""
    return np.tile(table, (groups, 1)).reshape(-1), np.tile(table.T, (groups, 1)).reshape(-1)


@on_cpu
@pytest.mark.parametrize("shape,names,spec", MESHES)
@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_rows_zero_what_was_not_sent(shape, names, spec, impl):
    """With rows=(sent, received): chunk d on device q holds device d's first sent[d, q] rows, then zeros, whatever
    the rows past them held on the sender."""
    mesh = _mesh(shape, names)
    p, a = shape[-1], 6
    groups = 8 // p
    host = np.random.default_rng(3).standard_normal((8 * p, a, 16)).astype(np.float32)
    table = _row_table(p, a, seed=4)
    sent, received = (_sharded(mesh, jnp.asarray(v, jnp.int32), spec) for v in _rows_on_axis(table, groups))
    x = _sharded(mesh, jnp.asarray(host), spec)
    exchange = functools.partial(a2a.all_to_all, axis_name="expert", impl=impl)
    got = _on_axis(lambda v, s, r: exchange(v, rows=(s, r)), mesh, spec, x, sent, received)
    want = host.reshape(groups, p, p, a, 16).swapaxes(1, 2).copy()  # [group, q, d]: device d's chunk for q
    for q in range(p):
        for d in range(p):
            want[:, q, d, table[d, q]:] = 0
    np.testing.assert_array_equal(np.asarray(got), want.reshape(host.shape))
    assert np.any(table < a) and np.any(host[:, 3:] != 0)


@on_cpu
def test_rows_grad_is_the_masked_exchange_back():
    mesh = _mesh((8,), ("expert",))
    spec = P("expert")
    rng = np.random.default_rng(5)
    x = _sharded(mesh, jnp.asarray(rng.standard_normal((64, 5, 8)), jnp.float32), spec)
    w = _sharded(mesh, jnp.asarray(rng.standard_normal((64, 5, 8)), jnp.float32), spec)
    table = _row_table(8, 5, seed=6)
    sent, received = (_sharded(mesh, jnp.asarray(v, jnp.int32), spec) for v in _rows_on_axis(table, 1))

    def loss(exchange, x, w):
        inner = jax.shard_map(lambda v, u, s, r: jnp.sum(u * jnp.tanh(exchange(v, s, r)), keepdims=True)[None],
                              mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
        return jnp.sum(inner(x, w, sent, received))

    def ours(v, s, r):
        return a2a.all_to_all(v, "expert", rows=(s, r))

    def masked_input(v, s, r):  # the same function written the other way: zero what is not sent, move everything
        keep = jnp.arange(v.shape[1])[None, :, None] < s[:, None, None]
        return lax.all_to_all(jnp.where(keep, v, 0), "expert", 0, 0)

    got = jax.jit(jax.grad(functools.partial(loss, ours)))(x, w)
    want = jax.jit(jax.grad(functools.partial(loss, masked_input)))(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(got)[1] == 0) and np.all(np.asarray(got)[8] != 0)  # 0 sent 1 nothing, 1 sent 0 all


@on_cpu
def test_pallas_raises_on_cpu():
    mesh = _mesh((8,), ("expert",))
    x = _sharded(mesh, jnp.ones((64, 4, 8), jnp.bfloat16), P("expert"))
    with pytest.raises(NotImplementedError, match=r"all_to_all \(pallas\): not an NVIDIA GPU"):
        _on_axis(functools.partial(a2a.all_to_all, axis_name="expert", impl="pallas"), mesh, P("expert"), x)


@on_cpu
def test_bad_arguments():
    mesh = _mesh((8,), ("expert",))
    x = _sharded(mesh, jnp.ones((48, 4), jnp.float32), P("expert"))  # 6 rows per device, not 8
    with pytest.raises(ValueError, match=r"shape \(P, \.\.\.\) with P = 8.*got shape \(6, 4\) dtype float32"):
        _on_axis(functools.partial(a2a.all_to_all, axis_name="expert"), mesh, P("expert"), x)
    with pytest.raises(ValueError, match="impl must be"):
        _on_axis(functools.partial(a2a.all_to_all, axis_name="expert", impl="nccl"), mesh, P("expert"), x)
    rows = jnp.zeros((8,), jnp.int32)
    with pytest.raises(ValueError, match=r"`rows` must be \(sent, received\), two arrays of shape \(8,\)"):
        x2 = _sharded(mesh, jnp.ones((64, 4), jnp.float32), P("expert"))
        _on_axis(lambda v: a2a.all_to_all(v, "expert", rows=(rows, rows[:4])), mesh, P("expert"), x2)
    with pytest.raises(ValueError, match="depth"):
        a2a.A2AConfig(depth=1)
    with pytest.raises(ValueError, match="exceeds shared memory"):
        a2a.A2AConfig(depth=8, tile_bytes=64 * 1024)


@pytest.mark.parametrize(
    "shape,dtype,why",
    [((4, 3, 4), jnp.bfloat16, "not a multiple of 16"), ((4, 64), jnp.complex64, "dtype complex64"),
     ((4, 64), jnp.int4, "dtype int4"), ((4,), jnp.float32, "nonempty row axis"), ((4, 64), jnp.bool_, None),
     ((4, 2, 8), jnp.int8, None), ((4, 8), jnp.float8_e4m3fn, "not a multiple of 16")],
)
def test_shape_cover(shape, dtype, why):
    got = a2a._shape_cover(jax.ShapeDtypeStruct(shape, dtype))
    assert got is None if why is None else why in got


# ---------------------------------------------------------------------------------------------------------------
# The work plan in NumPy: every CTA of every device replays its items (destination, offset) as the kernel does.
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n_peers,a,row,itemsize,config",
    [(4, 1000, 8, 2, a2a.A2AConfig(num_ctas=3, tile_bytes=4096, depth=2)),  # last tile overlaps, G not a multiple of P
     (8, 12, 8, 4, a2a.A2AConfig(num_ctas=5, tile_bytes=256, depth=3)),
     (2, 6, 8, 1, a2a.A2AConfig(num_ctas=64, tile_bytes=1024)),  # more CTAs than items: capped
     (4, 64, 1024, 2, a2a.A2AConfig(num_ctas=8, tile_bytes=64 * 1024, depth=3)),  # one tile per chunk
     (4, 48, 3, 2, a2a.A2AConfig(num_ctas=3, tile_bytes=32, depth=2))],  # rows of 6 bytes: sent rounded to 16
)
@pytest.mark.parametrize("partial", [False, True])
def test_work_plan_reproduces_all_to_all(n_peers, a, row, itemsize, config, partial):
    n = a * row
    tile, n_ctas = a2a._grid(n_peers, n, itemsize, config)
    assert tile * itemsize % a2a.BULK_ALIGN == 0 and tile <= n
    rng = np.random.default_rng(2)
    x = rng.integers(0, 2**15, (n_peers, n_peers, n))  # x[d]: device d's (P, N) input
    # sent[d, q]: rows device d sends to q; with `partial` some chunks are empty, some full, most in between
    sent = rng.integers(0, a + 1, (n_peers, n_peers)) if partial else np.full((n_peers, n_peers), a)
    if partial:
        sent[0, 1], sent[1, 0] = 0, a
    y = np.full_like(x, -1)  # y[q]: device q's output
    for dev in range(n_peers):
        elems = a2a._sent_elements(jnp.asarray(sent[dev], jnp.int32), row=row, n=n, unit=a2a.BULK_ALIGN // itemsize)
        assert np.all(np.asarray(elems) * itemsize % a2a.BULK_ALIGN == 0)
        n_items = n_peers * -(-int(np.max(elems)) // tile)
        seen, copies = [], 0
        for cta in range(n_ctas):
            mine = int(a2a._items_of_cta(jnp.int32(cta), n_items=n_items, n_ctas=n_ctas))
            items = cta + n_ctas * jnp.arange(mine, dtype=jnp.int32)
            targets, offs, live = a2a._work_item(items, jnp.int32(dev), lambda q: elems[q], n_peers=n_peers,
                                                 tile=tile)
            for q, off, copies_it in zip(np.asarray(targets), np.asarray(offs), np.asarray(live)):
                if copies_it:
                    assert 0 <= off <= n - tile and off * itemsize % a2a.BULK_ALIGN == 0
                    y[q, dev, off : off + tile] = x[dev, q, off : off + tile]  # ring slot -> peer q's row block dev
                    copies += 1
            seen += np.asarray(items).tolist()
        assert sorted(seen) == list(range(n_items))  # each item exactly once per device
        assert copies == sum(-(-int(m) // tile) for m in np.asarray(elems))  # no chunk's tile copied twice
    for q in range(n_peers):
        for d in range(n_peers):  # y_q[d] = x_d[q] on the rows that were sent
            np.testing.assert_array_equal(y[q, d, : sent[d, q] * row], x[d, q, : sent[d, q] * row])
    if not partial:
        np.testing.assert_array_equal(y, x.transpose(1, 0, 2))  # every element written


# ---------------------------------------------------------------------------------------------------------------
# The kernel lowered for CUDA on this CPU-only machine: Pallas -> Mosaic GPU -> LLVM-dialect passes in Python.
# ---------------------------------------------------------------------------------------------------------------
def _lower_for_cuda(fn, x_shape, dtype):
    mesh = _mesh((8,), ("expert",))
    x = jax.ShapeDtypeStruct(x_shape, dtype, sharding=NamedSharding(mesh, P("expert")))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()


@on_cpu
@pytest.mark.parametrize(
    "x_shape,dtype,config",
    [((64, 100, 512), jnp.bfloat16, a2a.A2AConfig(num_ctas=6, tile_bytes=16 * 1024, depth=3)),
     ((64, 7, 64), jnp.bool_, a2a.A2AConfig(num_ctas=2, tile_bytes=128, depth=2))],
)
def test_lowers_for_cuda(x_shape, dtype, config):
    def twice(x):  # two kernels in one jit, and one inside a loop; one sends only some rows
        y = a2a.all_to_all_pallas(x, "expert", rows=jnp.arange(8, dtype=jnp.int32), config=config)
        y = lax.fori_loop(0, 3, lambda _, v: a2a.all_to_all_pallas(v, "expert", config=config), y)
        return a2a.all_to_all_pallas(y, "expert", config=config)

    text = _lower_for_cuda(twice, x_shape, dtype)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu_v2" in line]
    assert len(calls) == 3
    for call in calls:
        assert "uses_xla_collective_metadata = true" in call  # peers' addresses come from XLA
        assert 'xla_replica_ids = "0,1,2,3,4,5,6,7"' in call
        assert "skip_device_barrier = true" not in call  # the pre-launch barrier the kernel relies on
        if compat.MGPU_COLLECTIVE_PRELAUNCH_BARRIER:
            assert "skip_device_barrier = false" in call


@on_cpu
@pytest.mark.parametrize("with_rows", [False, True])
def test_grad_lowers_for_cuda(monkeypatch, with_rows):
    """The dispatcher's custom_vjp with the kernel on both sides: forward and backward are one kernel each."""
    monkeypatch.setattr(a2a, "pallas_cover", lambda x, axis_name: None)  # as on a Hopper node
    config = a2a.A2AConfig(num_ctas=4, tile_bytes=2048, depth=2)
    mesh = _mesh((8,), ("expert",))
    spec = P("expert")
    x = jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    rows = (jnp.arange(8, dtype=jnp.int32), jnp.full((8,), 3, jnp.int32)) if with_rows else None

    def loss(x):
        inner = jax.shard_map(
            lambda v: jnp.sum(jnp.square(a2a.all_to_all(v, "expert", impl="pallas", config=config, rows=rows)
                                         .astype(jnp.float32)), keepdims=True)[None],
            mesh=mesh, in_specs=spec, out_specs=spec)
        return jnp.sum(inner(x))

    text = jax.jit(jax.grad(loss)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 2


# ---------------------------------------------------------------------------------------------------------------
# GPU: MX_JAX_TEST_GPU=1 python -m pytest tests/test_all_to_all.py -m gpu (one process, all GPUs of the node)
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def gpu_mesh():
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs >= 2 GPUs in this process")
    return jax.make_mesh((len(gpus),), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))


def _random(mesh, shape, dtype, seed):
    rng = np.random.default_rng(seed)
    p = mesh.shape["expert"]
    shape = (p * p, *shape)  # (P, C, ...) per device
    if dtype == jnp.bool_:
        x = rng.random(shape) < 0.5
    elif jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        x = rng.integers(info.min, info.max, shape, endpoint=True)
    else:
        x = rng.standard_normal(shape)
    return _sharded(mesh, jnp.asarray(x, dtype), P("expert"))


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype == np.bool_ else a.view(f"u{a.dtype.itemsize}")


def _pallas(mesh, x, config=a2a.DEFAULT_CONFIG):
    fn = functools.partial(a2a.all_to_all, axis_name="expert", impl="pallas", config=config)
    return _on_axis(fn, mesh, P("expert"), x)


def _lax(mesh, x):
    return _on_axis(lambda v: lax.all_to_all(v, "expert", 0, 0), mesh, P("expert"), x)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,dtype",
    [((384, 4096), jnp.bfloat16), ((1000, 4096), jnp.bfloat16), ((2048, 4096), jnp.bfloat16),
     ((300, 1024), jnp.float32), ((257, 64), jnp.int32), ((96, 4096), jnp.int8), ((128, 256), jnp.bool_)],
)
def test_gpu_bit_exact(gpu_mesh, rows, dtype):
    x = _random(gpu_mesh, rows, dtype, seed=3)
    np.testing.assert_array_equal(_bits(_pallas(gpu_mesh, x)), _bits(_lax(gpu_mesh, x)))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [a2a.A2AConfig(num_ctas=3, tile_bytes=4096, depth=2), a2a.A2AConfig(num_ctas=16, tile_bytes=8192, depth=6),
     a2a.A2AConfig(tile_bytes=64 * 1024, depth=3)],
)
def test_gpu_configs(gpu_mesh, config):
    x = _random(gpu_mesh, (1000, 4096), jnp.bfloat16, seed=4)
    np.testing.assert_array_equal(_bits(_pallas(gpu_mesh, x, config)), _bits(_lax(gpu_mesh, x)))


@pytest.mark.gpu
def test_gpu_repeated(gpu_mesh):
    x = _random(gpu_mesh, (512, 4096), jnp.bfloat16, seed=5)
    want = _bits(_lax(gpu_mesh, x))
    exchange = functools.partial(a2a.all_to_all, axis_name="expert", impl="pallas")
    there_and_back = jax.jit(jax.shard_map(lambda v: exchange(exchange(v)), mesh=gpu_mesh, in_specs=P("expert"),
                                           out_specs=P("expert")))
    np.testing.assert_array_equal(_bits(there_and_back(x)), _bits(x))  # twice in one jit: the identity
    looped = jax.jit(jax.shard_map(lambda v: lax.fori_loop(0, 5, lambda _, u: exchange(u), v), mesh=gpu_mesh,
                                   in_specs=P("expert"), out_specs=P("expert")))
    np.testing.assert_array_equal(_bits(looped(x)), want)  # an odd number of exchanges: one exchange
    once = jax.jit(jax.shard_map(exchange, mesh=gpu_mesh, in_specs=P("expert"), out_specs=P("expert")))
    outs = [once(x) for _ in range(20)]  # back-to-back launches, nothing synchronised in between
    for out in outs:
        np.testing.assert_array_equal(_bits(out), want)


@pytest.mark.gpu
def test_gpu_grad(gpu_mesh):
    x = _random(gpu_mesh, (256, 4096), jnp.float32, seed=6)
    w = _random(gpu_mesh, (256, 4096), jnp.float32, seed=7)

    def loss(impl, x, w):
        exchange = functools.partial(a2a.all_to_all, axis_name="expert", impl=impl)
        inner = jax.shard_map(lambda v, u: jnp.sum(u * exchange(v), keepdims=True)[None], mesh=gpu_mesh,
                              in_specs=(P("expert"), P("expert")), out_specs=P("expert"))
        return jnp.sum(inner(x, w))

    got = jax.jit(jax.grad(functools.partial(loss, "pallas")))(x, w)
    want = jax.jit(jax.grad(functools.partial(loss, "xla")))(x, w)
    np.testing.assert_array_equal(_bits(got), _bits(want))  # d/dx = exchange(w): a permutation, exact


def _rows_of(mesh, a: int, seed: int):
    p = mesh.shape["expert"]
    table = _row_table(p, a, seed)
    return tuple(_sharded(mesh, jnp.asarray(v, jnp.int32), P("expert")) for v in _rows_on_axis(table, 1))


def _masked_lax(v, s, r):
    keep = jnp.arange(v.shape[1])[None, :] < r[:, None]
    keep = keep.reshape(keep.shape + (1,) * (v.ndim - 2))
    return jnp.where(keep, lax.all_to_all(v, "expert", 0, 0), jnp.zeros((), v.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,dtype,config",
    [((1000, 4096), jnp.bfloat16, a2a.DEFAULT_CONFIG), ((257, 64), jnp.int32, a2a.DEFAULT_CONFIG),
     ((304, 3), jnp.bfloat16, a2a.A2AConfig(num_ctas=5, tile_bytes=256, depth=3)),  # rows of 6 bytes
     ((96, 4096), jnp.int8, a2a.A2AConfig(num_ctas=16, tile_bytes=8192, depth=6))],
)
def test_gpu_rows_bit_exact(gpu_mesh, rows, dtype, config):
    """Only the sent rows travel; the result equals lax.all_to_all masked to them, on repeated calls too (rows past
    a count on the receiver are zeroed, not left from an earlier call)."""
    x = _random(gpu_mesh, rows, dtype, seed=8)
    sent, received = _rows_of(gpu_mesh, rows[0], seed=9)
    ours = jax.jit(jax.shard_map(
        lambda v, s, r: a2a.all_to_all(v, "expert", rows=(s, r), impl="pallas", config=config),
        mesh=gpu_mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert")))
    want = _bits(_on_axis(_masked_lax, gpu_mesh, P("expert"), x, sent, received))
    for _ in range(3):
        np.testing.assert_array_equal(_bits(ours(x, sent, received)), want)


@pytest.mark.gpu
def test_gpu_rows_grad(gpu_mesh):
    x = _random(gpu_mesh, (256, 4096), jnp.float32, seed=10)
    w = _random(gpu_mesh, (256, 4096), jnp.float32, seed=11)
    sent, received = _rows_of(gpu_mesh, 256, seed=12)

    def loss(impl, x, w):
        exchange = functools.partial(a2a.all_to_all, axis_name="expert", impl=impl)
        inner = jax.shard_map(lambda v, u, s, r: jnp.sum(u * exchange(v, rows=(s, r)), keepdims=True)[None],
                              mesh=gpu_mesh, in_specs=(P("expert"),) * 4, out_specs=P("expert"))
        return jnp.sum(inner(x, w, sent, received))

    got = jax.jit(jax.grad(functools.partial(loss, "pallas")))(x, w)
    want = jax.jit(jax.grad(functools.partial(loss, "xla")))(x, w)
    np.testing.assert_array_equal(_bits(got), _bits(want))
