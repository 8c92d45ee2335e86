"""pallas_kernels.row_exchange: rows pushed to and pulled from per-row addresses on the peers.

CPU (8 fake devices): `zero_work` names each masked row once, in runs and single rows; the XLA reference against
the semantics written out in NumPy (push and pull, random items with some not live, runs of zero rows and single
ones, an axis of 8 and an axis of 4 inside a (2, 4) mesh); impl "pallas" raises
NotImplementedError naming why; bad arguments are named; both kernels lower for CUDA without a GPU (collective
metadata, the pre-launch barrier kept; pull needs jax >= 0.11.1). The Mosaic-GPU interpreter runs neither remote refs
nor global semaphores, so no CPU test runs the kernel.

GPU (MX_JAX_TEST_GPU=1, one process seeing >= 2 Hopper GPUs): the kernel bit for bit against the reference, push and
pull, bf16 / f32 / int8 rows of several widths (zeroing runs of 4 to 682 rows), three calls in a row.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mx_jax import compat
from pallas_kernels import row_exchange as rx

on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU test: 8 fake devices, no kernel runs")


def _plan(rng, n_dev, s, t, out_rows, mode, chunk, live_frac=0.8):
    """Random work lists per device that name every output row once: for push, device q's output rows are dealt
    to (sender, item) pairs at random; for pull, each device's items read random peer rows into distinct local
    rows. The rows left over are zero rows (`zero_work`: runs of `chunk`, then single rows)."""
    src = np.zeros((n_dev, t), np.int32)
    peer = np.zeros((n_dev, t), np.int32)
    dst = np.zeros((n_dev, t), np.int32)
    n_live = (rng.random(n_dev) * live_frac * t).astype(np.int32) + 1
    written = np.zeros((n_dev, out_rows), bool)
    for d in range(n_dev):
        for i in range(n_live[d]):
            q = rng.integers(n_dev) if mode == "push" else d
            while written[q].all():
                q = (q + 1) % n_dev
            if mode == "pull":  # a contiguous block sometimes, so that the zero rows form runs
                free = np.flatnonzero(~written[q])
                row = free[0] if rng.random() < 0.5 else rng.choice(free)
            else:
                row = rng.choice(np.flatnonzero(~written[q]))
            written[q, row] = True
            src[d, i], peer[d, i], dst[d, i] = rng.integers(s), (q if mode == "push" else rng.integers(n_dev)), row
    work = [rx.zero_work(jnp.asarray(~written[q]), chunk) for q in range(n_dev)]
    zero = np.stack([np.asarray(w[0]) for w in work])
    n_chunks = np.array([int(w[1]) for w in work], np.int32)
    n_zero = np.array([int(w[2]) for w in work], np.int32)
    # items past n_live hold junk that must be ignored
    src[:, :] = np.where(np.arange(t) < n_live[:, None], src, 10**6)
    return src, peer, dst, n_live, zero, n_zero, n_chunks


def _expected(a, plan, out_rows, mode, chunk):
    src, peer, dst, n_live, zero, n_zero, n_chunks = plan
    n_dev = a.shape[0]
    y = np.full((n_dev, out_rows) + a.shape[2:], np.nan if a.dtype.kind == "f" else -1, a.dtype)
    for d in range(n_dev):
        for i in range(n_live[d]):
            if mode == "push":
                y[peer[d, i], dst[d, i]] = a[d, src[d, i]]
            else:
                y[d, dst[d, i]] = a[peer[d, i], src[d, i]]
        for j in range(n_zero[d]):
            y[d, zero[d, j]: zero[d, j] + (chunk if j < n_chunks[d] else 1)] = 0
    return y


def _run(mesh, fn, a, plan, chunk):
    spec = P(mesh.axis_names)
    args = [jax.device_put(jnp.asarray(v.reshape((-1,) + v.shape[2:])), NamedSharding(mesh, spec)) for v in
            (a, *plan[:3])] + [jax.device_put(jnp.asarray(v), NamedSharding(mesh, spec)) for v in plan[3:]]

    def body(a, src, peer, dst, n_live, zero, n_zero, n_chunks):
        return fn(a, rx.Items(src, peer, dst, n_live[0], zero.reshape(-1), n_zero[0], n_chunks[0], chunk))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 8, out_specs=spec, check_vma=False))
    return np.asarray(f(*args))


@on_cpu
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_zero_work_names_each_masked_row_once(chunk):
    rng = np.random.default_rng(0)
    masks = [rng.random(50) < 0.5, np.repeat(rng.random(10) < 0.5, rng.integers(1, 20, 10)), np.ones(37, bool),
             np.zeros(9, bool)]
    for mask in masks:
        zero, n_chunks, n_zero = (np.asarray(v) for v in rx.zero_work(jnp.asarray(mask), chunk))
        covered = np.zeros(mask.shape, int)
        for j in range(n_zero):
            covered[zero[j]: zero[j] + (chunk if j < n_chunks else 1)] += 1
        np.testing.assert_array_equal(covered, mask.astype(int))
        runs = np.diff(np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]]))))[::2]
        assert n_chunks == sum(r // chunk for r in runs) and n_zero - n_chunks == sum(r % chunk for r in runs)


def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))],
                         axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


@on_cpu
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("shape,names", [((8,), ("expert",)), ((2, 4), ("data", "expert"))])
def test_reference_does_what_the_docstring_says(mode, shape, names):
    mesh = _mesh(shape, names)
    n_dev, s, t, out_rows = shape[-1], 9, 12, 20
    rng = np.random.default_rng(1)
    groups = int(np.prod(shape)) // n_dev
    a = rng.standard_normal((groups * n_dev, s, 3, 2)).astype(np.float32)
    chunk = 3
    plans = [_plan(rng, n_dev, s, t, out_rows, mode, chunk) for _ in range(groups)]
    plan = tuple(np.concatenate([p[j] for p in plans]) for j in range(7))
    assert plan[-1].sum() > 0 and (plan[-2] > plan[-1]).any()  # runs of zero rows and single ones
    fn = functools.partial(lambda a, items: rx.move(a, items, out_rows, mode, "expert", impl="auto"))
    with jax.set_mesh(mesh):
        y = _run(mesh, fn, a, plan, chunk)
    y = y.reshape((groups * n_dev, out_rows) + a.shape[2:])
    for g in range(groups):
        part = slice(g * n_dev, (g + 1) * n_dev)
        want = _expected(a[part], tuple(p[part] for p in plan), out_rows, mode, chunk)
        np.testing.assert_array_equal(y[part], want)  # every row named once: no NaN left from `want`'s fill
    assert np.abs(y).sum() > 0


@on_cpu
def test_pallas_raises_on_cpu_and_bad_arguments_are_named():
    mesh = _mesh((8,), ("expert",))
    items = rx.Items(*(jnp.zeros((4,), jnp.int32),) * 3, jnp.int32(0), jnp.zeros((2,), jnp.int32), jnp.int32(0))

    def call(**kw):
        args = dict(a=jnp.zeros((3, 8), jnp.bfloat16), items=items, out_rows=2, mode="push", axis_name="expert")
        args.update(kw)
        with jax.set_mesh(mesh):
            jax.jit(jax.shard_map(lambda: rx.move(**args), mesh=mesh, in_specs=(), out_specs=P(),
                                  check_vma=False))()

    with pytest.raises(NotImplementedError, match="row_exchange \\(pallas\\)"):
        call(impl="pallas")
    with pytest.raises(ValueError, match="mode must be"):
        call(mode="scatter")
    with pytest.raises(ValueError, match="impl must be"):
        call(impl="nccl")
    with pytest.raises(ValueError, match="scalars"):
        call(items=rx.Items(*(jnp.zeros((4,), jnp.int32),) * 3, jnp.zeros((1,), jnp.int32),
                            jnp.zeros((2,), jnp.int32), jnp.int32(0)))
    with pytest.raises(ValueError, match="1-D of one length"):
        call(items=rx.Items(jnp.zeros((4,), jnp.int32), jnp.zeros((3,), jnp.int32), jnp.zeros((4,), jnp.int32),
                            jnp.int32(0), jnp.zeros((2,), jnp.int32), jnp.int32(0)))
    assert "rows of 6 bytes" in rx._row_cover(jnp.zeros((4, 3), jnp.bfloat16))
    assert "dtype" in rx._row_cover(jnp.zeros((4, 8), jnp.complex64))
    assert rx._row_cover(jnp.zeros((4, 2048), jnp.bfloat16)) is None


@on_cpu
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_lowers_for_cuda(mode):
    if mode == "pull" and not compat.MGPU_REMOTE_LOAD:
        pytest.skip(f"jax {jax.__version__}: Mosaic GPU loads from a peer from 0.11.1 on")
    mesh = _mesh((8,), ("expert",))
    spec = P("expert")

    def fn(a, src, peer, dst, zero):  # two kernels in one jit, one inside a loop
        items = rx.Items(src, peer, dst, jnp.int32(5), zero, jnp.int32(3))
        y = rx.move_pallas(a, items, 24, mode, "expert", num_ctas=4)
        return jax.lax.fori_loop(0, 2, lambda _, v: rx.move_pallas(v, items, 24, mode, "expert", num_ctas=4), y)

    sds = [jax.ShapeDtypeStruct((8 * 24, 256), jnp.bfloat16, sharding=NamedSharding(mesh, spec))] + [
        jax.ShapeDtypeStruct((8 * 10,), jnp.int32, sharding=NamedSharding(mesh, spec))] * 4
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))
    text = f.trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu_v2" in line]
    assert len(calls) == 2
    for call in calls:
        assert "uses_xla_collective_metadata = true" in call
        assert "skip_device_barrier = true" not in call


# ---------------------------------------------------------------------------------------------------------------
# GPU: MX_JAX_TEST_GPU=1 python -m pytest tests/test_row_exchange.py -m gpu (one process, all GPUs of the node)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("row,dtype", [((2048,), jnp.bfloat16), ((4096,), jnp.bfloat16), ((8, 40), jnp.float32),
                                       ((48,), jnp.int8)])
def test_gpu_bit_exact(mode, row, dtype):
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs >= 2 GPUs in this process")
    mesh = jax.make_mesh((len(gpus),), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))
    n_dev, s, t, out_rows = len(gpus), 700, 1500, 3000
    rng = np.random.default_rng(2)
    if jnp.issubdtype(dtype, jnp.integer):
        a = rng.integers(-128, 127, (n_dev, s) + row).astype(np.int8)
    else:
        a = np.asarray(jnp.asarray(rng.standard_normal((n_dev, s) + row), dtype))
    chunk = rx.zero_chunk(a[0, 0].nbytes)
    plan = _plan(rng, n_dev, s, t, out_rows, mode, chunk)
    with jax.set_mesh(mesh):
        for impl in ("xla", "pallas", "pallas", "pallas"):  # the kernel three times in a row
            got = _run(mesh, lambda a, items: rx.move(a, items, out_rows, mode, "expert", impl=impl), a, plan,
                       chunk)
            if impl == "xla":
                want = got
            else:
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert np.abs(want.astype(np.float32)).sum() > 0
