"""Scaled fp8 GEMM (pallas_kernels/fp8_matmul.py): the Pallas kernel interpreted on CPU and the XLA path against the
f32 reference, the cover and the dispatcher, lowering for the H200 from CPU, and `gpu` tests at real shapes."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh
from jax.sharding import PartitionSpec as P

from mx_jax import compat
from pallas_kernels import device
from pallas_kernels import interpret_compat
from tests.helpers import worst_line_rel

fm = importlib.import_module("pallas_kernels.fp8_matmul")
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
SMALL = fm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2)  # CTA 64x128: several tiles per CTA at 256³
BF16_RTOL = 2.0**-8  # a bf16 output is the f32 result rounded once (<= 2^-9 relative) plus f32 summation order


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    interpret_compat.install()


def operands(key, m, n, k, a_dtype=E4M3, b_dtype=E4M3, scalar=False):
    """Normal data times 4 with outliers near the fp8 max, a zero row in a, and positive scales."""
    ka, kb, ks, kt = jax.random.split(key, 4)
    a = jax.random.normal(ka, (m, k)) * 4
    a = a.at[0].set(0.0).at[3, 5].set(0.9 * float(jnp.finfo(a_dtype).max))
    b = (jax.random.normal(kb, (n, k)) * 4).at[1, 7].set(-0.9 * float(jnp.finfo(b_dtype).max))
    if scalar:
        sa, sb = jnp.float32(0.37), jnp.float32(1.9)
    else:
        sa = jax.random.uniform(ks, (m,), minval=0.25, maxval=2.0)
        sb = jax.random.uniform(kt, (n,), minval=0.25, maxval=2.0) * 1e-2
    return a.astype(a_dtype), b.astype(b_dtype), sa, sb


def assert_close_to_reference(out, a, b, sa, sb):
    ref = np.asarray(fm.fp8_matmul_reference(a, b, sa, sb, out_dtype=jnp.float32))
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    # atol covers entries that cancel to ~0, measured against the typical magnitude.
    np.testing.assert_allclose(out, ref, rtol=BF16_RTOL, atol=BF16_RTOL * np.abs(ref).mean())


INTERPRET_CASES = [
    # (m, n, k, a dtype, b dtype, scalar scales, config, out dtype)
    (256, 256, 256, E4M3, E4M3, False, SMALL, jnp.bfloat16),
    (256, 128, 192, E5M2, E5M2, True, dataclasses.replace(SMALL, wg_split="m", delay_release=0), jnp.bfloat16),
    (128, 256, 256, E5M2, E4M3, False, SMALL, jnp.bfloat16),  # mixed operands: the tensorwise recipe's backward
    (128, 256, 256, E4M3, E4M3, False, fm.fit_config(fm.DEFAULT_CONFIG, jnp.float32), jnp.float32),
    (256, 128, 128, E4M3, E4M3, False, dataclasses.replace(SMALL, cluster="m", epi_tile_n=32), jnp.bfloat16),
    # The static ring: two and three stages, each release schedule, both splits, clusters along M and N.
    (256, 256, 256, E4M3, E4M3, False, dataclasses.replace(SMALL, ring="static"), jnp.bfloat16),
    (256, 128, 256, E5M2, E5M2, True, dataclasses.replace(SMALL, ring="static", wg_split="m", delay_release=0),
     jnp.bfloat16),
    (128, 256, 384, E4M3, E4M3, False, dataclasses.replace(SMALL, ring="static", stages=3, delay_release=0),
     jnp.float32),
    (256, 128, 128, E4M3, E4M3, False, dataclasses.replace(SMALL, ring="static", cluster="m", epi_tile_n=32),
     jnp.bfloat16),
    (256, 256, 256, E4M3, E4M3, False, dataclasses.replace(SMALL, ring="static", cluster="n", delay_release=0),
     jnp.bfloat16),
    # The overlapped epilogue: a tile's last chunks stored during the next tile's K steps (4 carried over 2 steps:
    # two stored after the loop; 1 of 2 over 6 steps), the CTA's last tile after the tile loop.
    (256, 512, 256, E4M3, E4M3, False,
     dataclasses.replace(SMALL, ring="static", tile_n=128, epi_tile_n=32, overlap_chunks=4), jnp.bfloat16),
    (256, 256, 768, E5M2, E5M2, True,
     dataclasses.replace(SMALL, ring="static", wg_split="m", epi_tile_n=32, delay_release=0, overlap_chunks=1),
     jnp.bfloat16),
    (128, 256, 384, E4M3, E4M3, False,  # f32 output (the weight gradients'), 3 steps for 2 carried chunks
     dataclasses.replace(SMALL, ring="static", stages=3, epi_tile_n=32, overlap_chunks=2), jnp.float32),
]


@pytest.mark.parametrize("m,n,k,a_dtype,b_dtype,scalar,config,out_dtype", INTERPRET_CASES)
def test_pallas_interpreted_matches_reference(m, n, k, a_dtype, b_dtype, scalar, config, out_dtype):
    if config.cluster and compat.JAX_VERSION < (0, 11, 0):
        pytest.skip("jax 0.10.2's GPU interpreter has no cluster barriers (run under 0.11 and by the lowering test)")
    a, b, sa, sb = operands(jax.random.key(m + n + k), m, n, k, a_dtype, b_dtype, scalar)
    call = lambda: fm.fp8_matmul(
        a, b, sa, sb, out_dtype=out_dtype, impl="pallas", config=config, interpret=compat.InterpretGPUParams()
    )
    if a_dtype != b_dtype and not compat.MGPU_MIXED_FP8_WGMMA:
        with pytest.raises(NotImplementedError, match="mixed"):
            call()
        return
    out = call()
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_close_to_reference(out, a, b, sa, sb)


@pytest.mark.parametrize("a_dtype,b_dtype,scalar", [(E4M3, E4M3, False), (E5M2, E4M3, True), (E4M3, E5M2, False)])
def test_xla_matches_reference(a_dtype, b_dtype, scalar):
    a, b, sa, sb = operands(jax.random.key(7), 96, 80, 112, a_dtype, b_dtype, scalar)
    out = jax.jit(lambda *args: fm.fp8_matmul(*args, impl="xla"))(a, b, sa, sb)
    assert out.dtype == jnp.bfloat16
    assert_close_to_reference(out, a, b, sa, sb)


def test_reference_is_the_scaled_product():
    # Independent of the module: upcast, multiply, scale, in NumPy float64.
    a, b, sa, sb = operands(jax.random.key(3), 64, 48, 32)
    want = (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T) * np.asarray(sa)[:, None] * np.asarray(sb)
    got = np.asarray(fm.fp8_matmul(a, b, sa, sb, out_dtype=jnp.float32, impl="reference"), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).mean())


def test_uncovered_shape_raises_under_pallas_and_falls_back_under_auto(monkeypatch):
    a, b, sa, sb = operands(jax.random.key(5), 100, 256, 256)  # M=100 is not a multiple of the CTA tile
    with pytest.raises(NotImplementedError, match="multiples"):
        fm.fp8_matmul(a, b, sa, sb, impl="pallas", interpret=compat.InterpretGPUParams())
    assert_close_to_reference(fm.fp8_matmul(a, b, sa, sb, impl="auto"), a, b, sa, sb)  # CPU: XLA
    # On a Hopper GPU, auto picks the kernel only for covered shapes and only where the table does not say XLA.
    monkeypatch.setattr(device, "on_hopper", lambda: True)
    assert fm.auto_choice(100, 256, 256, E4M3, E4M3) is None
    assert fm.auto_choice(8192, 8192, 8192, E4M3, E4M3) == fm.AUTO_TABLE[(8192, 8192, 8192)]  # a measured winner
    assert fm.auto_choice(8192, 3072, 2048, E4M3, E4M3) == fm.AUTO_DEFAULT  # not in the table
    monkeypatch.setitem(fm.AUTO_TABLE, (8192, 3072, 2048), None)
    assert fm.auto_choice(8192, 3072, 2048, E4M3, E4M3) is None  # where XLA won, auto takes XLA
    f32 = fm.auto_choice(8192, 8192, 8192, E4M3, E4M3, jnp.float32)  # f32 staging is chunked to fit SMEM
    assert f32.ring == "static" and f32.epi_n < 32 and f32.smem_bytes(jnp.float32) <= fm._SMEM_BYTES
    # 65 K steps do not divide into the static ring's 4 stages: auto runs jax's pipeline kernel instead of XLA.
    assert fm.AUTO_DEFAULT.ring == "static" and fm.auto_choice(8192, 8192, 8320, E4M3, E4M3).ring == "pipeline"
    # M = 8320 is one CTA tile but not a cluster pair's multiple: auto drops the cluster instead of taking XLA.
    assert fm.AUTO_DEFAULT.cluster == "m" and "multiples" in fm.pallas_cover(
        8320, 8192, 8192, E4M3, E4M3, config=fm.AUTO_DEFAULT)
    assert fm.auto_choice(8320, 8192, 8192, E4M3, E4M3) == dataclasses.replace(fm.AUTO_DEFAULT, cluster=None)
    # Under a multi-device mesh (outside shard_map) the partitioner could not split the kernel: XLA.
    mesh = jax.make_mesh((len(jax.devices()),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        assert len(jax.devices()) == 1 or fm.auto_choice(8192, 8192, 8192, E4M3, E4M3) is None
    monkeypatch.setitem(fm.AUTO_TABLE, (8192, 8192, 8192), None)
    assert fm.auto_choice(8192, 8192, 8192, E4M3, E4M3) is None


def test_auto_runs_the_dynamic_schedule_per_device_of_a_mesh(monkeypatch):
    """Inside shard_map over several devices (the fp8 linears' per-device path) collectives run beside the GEMMs,
    and impl="auto" takes the dynamic tile schedule without a cluster (jax >= 0.11); alone, the static one."""
    monkeypatch.setattr(device, "on_hopper", lambda: True)
    seen = []

    def per_device(x):
        seen.append(fm.auto_choice(8192, 8192, 8192, E4M3, E4M3))
        return x

    mesh = jax.make_mesh((len(jax.devices()),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(jnp.zeros(len(jax.devices())))
    alone = fm.auto_choice(8192, 8192, 8192, E4M3, E4M3)
    assert alone == fm.AUTO_TABLE[(8192, 8192, 8192)] and alone.schedule == "static"
    if compat.MGPU_TILE_QUEUE and len(jax.devices()) > 1:
        assert seen == [dataclasses.replace(alone, cluster=None, schedule="dynamic")]
    else:
        assert seen == [alone]
    assert "dynamic schedule" in fm.pallas_cover(8192, 8192, 8192, E4M3, E4M3,
                                                  config=dataclasses.replace(alone, schedule="dynamic"))


def test_cover_reasons():
    assert fm.pallas_cover(8192, 8192, 8192, E4M3, E4M3) is None
    assert "multiples" in fm.pallas_cover(8192, 8192 + 128, 8192, E4M3, E4M3)
    assert "shared memory" in fm.pallas_cover(8192, 8192, 8192, E4M3, E4M3, jnp.float32)  # unchunked f32 staging
    assert "float8" in fm.pallas_cover(8192, 8192, 8192, jnp.bfloat16, E4M3)
    assert "delay_release" in fm.pallas_cover(8192, 8192, 8192, E4M3, E4M3, config=fm.TileConfig(stages=1))
    static3 = fm.TileConfig(ring="static", delay_release=0)
    assert "multiple of the stages" in fm.pallas_cover(8192, 8192, 8192, E4M3, E4M3, config=static3)  # 64 K steps
    assert fm.pallas_cover(8192, 8192, 6144, E4M3, E4M3, config=static3) is None  # 48


def test_bad_arguments_name_the_argument():
    a, b, sa, sb = operands(jax.random.key(9), 64, 64, 64)
    with pytest.raises(ValueError, match="`a`.*float32"):
        fm.fp8_matmul(a.astype(jnp.float32), b, sa, sb)
    with pytest.raises(ValueError, match="contraction"):
        fm.fp8_matmul(a, b[:, :32], sa, sb)
    with pytest.raises(ValueError, match="b_scale"):
        fm.fp8_matmul(a, b, sa, sb[:10])
    with pytest.raises(ValueError, match="impl"):
        fm.fp8_matmul(a, b, sa, sb, impl="cuda")


H200 = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132))
SWEEP = [
    fm.DEFAULT_CONFIG,
    fm.TileConfig(wg_split="m"),
    fm.TileConfig(tile_m=64, tile_n=256, wg_split="m"),
    fm.TileConfig(cluster="m"),
    fm.TileConfig(cluster="m", delay_release=0),  # AUTO_DEFAULT before the static ring
    fm.TileConfig(cluster="n", delay_release=0),
    fm.TileConfig(stages=4, epi_tile_m=64, epi_tile_n=64),
    fm.TileConfig(tile_k=64, stages=6),
    fm.TileConfig(stages=4, epi_tile_m=64, epi_tile_n=64, delay_release=0, cluster="m", ring="static"),
    fm.TileConfig(stages=4, epi_tile_m=64, epi_tile_n=64, cluster="m", ring="static"),
    fm.AUTO_DEFAULT,  # the static ring, 64x256 warpgroup tiles, cluster along M
    dataclasses.replace(fm.AUTO_DEFAULT, overlap_chunks=4),
]
DYNAMIC = [dataclasses.replace(fm.AUTO_DEFAULT, cluster=None, schedule="dynamic", overlap_chunks=o) for o in (0, 4)]


@pytest.mark.parametrize("config", SWEEP + DYNAMIC, ids=lambda c: c.name())
def test_lowers_for_h200(config):
    """Mosaic-GPU lowering (layout inference, SMEM budget) runs in Python: check it on CPU for the bench's configs,
    with the GPU image's jax (0.11) and with 0.10.2 (the static ring's producer then runs on the whole warpgroup,
    compat.MGPU_WARP_MAP; mixed e4m3 x e5m2 operands need 0.11)."""
    if config.schedule == "dynamic" and not compat.MGPU_TILE_QUEUE:
        pytest.skip("the dynamic schedule needs jax >= 0.11 (pallas_cover says so)")
    m = n = k = 8192
    b_dtype = E5M2 if compat.MGPU_MIXED_FP8_WGMMA else E4M3
    shapes = (
        jax.ShapeDtypeStruct((m, k), E4M3),
        jax.ShapeDtypeStruct((n, k), b_dtype),
        jax.ShapeDtypeStruct((m,), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    lowered = []
    for out_dtype in (jnp.bfloat16, jnp.float32):
        cfg = fm.fit_config(config, out_dtype)
        if out_dtype == jnp.float32 and fm.pallas_cover(m, n, k, E4M3, b_dtype, out_dtype, cfg) is not None:
            continue  # e.g. 4 stages leave no room for f32 staging; auto never picks it for f32
        with jax.sharding.use_abstract_mesh(H200):
            text = jax.jit(lambda *x: fm.fp8_matmul_pallas(*x, out_dtype=out_dtype, config=cfg)).trace(
                *shapes).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        lowered.append(out_dtype)
    assert jnp.bfloat16 in lowered  # bf16 outputs always fit; f32 where the config leaves room


# --------------------------------------------------------------------------------------------------------------
# GPU: MX_JAX_TEST_GPU=1 python -m pytest -m gpu tests/test_fp8_matmul.py
# --------------------------------------------------------------------------------------------------------------
GPU_SHAPES = [(8192, 8192, 8192), (8192, 1024, 4096), (8192, 4096, 14336), (4096, 14336, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", GPU_SHAPES)
@pytest.mark.parametrize("config", SWEEP[:3] + SWEEP[-3:], ids=lambda c: c.name())  # SWEEP[-1]: AUTO_DEFAULT
def test_gpu_pallas_matches_reference_and_xla(m, n, k, config):
    a, b, sa, sb = operands(jax.random.key(1), m, n, k)
    ref = fm.fp8_matmul_reference(a, b, sa, sb, out_dtype=jnp.float32)
    out = fm.fp8_matmul(a, b, sa, sb, impl="pallas", config=config)
    xla = fm.fp8_matmul(a, b, sa, sb, impl="xla")
    # The kernel keeps the whole K in the wgmma accumulator, whose fp8 accumulation keeps ~14 mantissa bits on
    # Hopper (TorchAO's use_fast_accum=True numerics; DeepSeek-V3 §3.3.2), so the bound is looser than bf16
    # rounding. A layout or scale bug gives errors of order 1 in the rows or columns it touches.
    errs = (worst_line_rel(out, ref), worst_line_rel(xla, ref))
    assert max(errs) < 2e-2, errs


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (8192, 4096, 14336)])
def test_gpu_static_ring_without_the_producer_warp(monkeypatch, m, n, k):
    """Under jax 0.10.2 the static ring's loads are issued by the whole memory warpgroup (compat.MGPU_WARP_MAP):
    that form of the kernel, built here on the GPU image's jax, against the reference. The launcher is traced
    directly (`__wrapped__`), so jit's cache of the producer-warp form does not answer."""
    monkeypatch.setattr(compat, "MGPU_WARP_MAP", False)
    a, b, sa, sb = operands(jax.random.key(5), m, n, k)
    ref = fm.fp8_matmul_reference(a, b, sa, sb, out_dtype=jnp.float32)
    out = jax.jit(lambda *x: fm.fp8_matmul_pallas.__wrapped__(*x, config=fm.AUTO_DEFAULT))(a, b, sa, sb)
    assert worst_line_rel(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (8192, 1024, 4096), (4096, 14336, 8192), (256, 512, 512)])
@pytest.mark.parametrize("overlap_chunks", [0, 4])
def test_gpu_dynamic_schedule_equals_the_static_one(m, n, k, overlap_chunks):
    """The dynamic schedule (tiles handed out by a GMEM counter, pallas_kernels/tile_queue.py) computes every tile as
    the static one does: bit-identical outputs, and again on a second call (XLA zeroes the counter before each)."""
    a, b, sa, sb = operands(jax.random.key(6), m, n, k)
    static = fm.fit_config(dataclasses.replace(fm.AUTO_DEFAULT, cluster=None, overlap_chunks=overlap_chunks),
                           jnp.bfloat16)
    dynamic = dataclasses.replace(static, schedule="dynamic")
    assert fm.pallas_cover(m, n, k, a.dtype, b.dtype, jnp.bfloat16, dynamic) is None
    want = fm.fp8_matmul_pallas(a, b, sa, sb, config=static)
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(fm.fp8_matmul_pallas(a, b, sa, sb, config=dynamic), np.float32),
                                      np.asarray(want, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("a_dtype,b_dtype,scalar,out_dtype", [
    (E5M2, E4M3, True, jnp.bfloat16), (E4M3, E5M2, False, jnp.float32), (E4M3, E4M3, True, jnp.float32)])
def test_gpu_dtypes_and_scales(a_dtype, b_dtype, scalar, out_dtype):
    a, b, sa, sb = operands(jax.random.key(2), 4096, 4096, 4096, a_dtype, b_dtype, scalar)
    ref = fm.fp8_matmul_reference(a, b, sa, sb, out_dtype=jnp.float32)
    for impl in ("pallas", "auto"):  # DEFAULT_CONFIG (jax's pipeline); AUTO_DEFAULT (the static ring), fit to out_dtype
        out = fm.fp8_matmul(a, b, sa, sb, out_dtype=out_dtype, impl=impl)
        assert out.dtype == out_dtype
        assert worst_line_rel(out, ref) < 2e-2, impl


@pytest.mark.gpu
def test_gpu_auto_uses_the_kernel_on_hopper():
    a, b, sa, sb = operands(jax.random.key(4), 8192, 8192, 8192)
    if not device.on_hopper():
        pytest.skip("not a Hopper GPU")
    assert fm.auto_choice(8192, 8192, 8192, a.dtype, b.dtype) is not None
    hlo = jax.jit(lambda *x: fm.fp8_matmul(*x, impl="auto")).lower(a, b, sa, sb).as_text()
    assert "mosaic_gpu" in hlo
