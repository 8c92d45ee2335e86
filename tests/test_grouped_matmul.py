"""Grouped GEMMs (pallas_kernels/grouped_matmul.py): every implementation against the jnp reference.

CPU: the Mosaic-GPU kernels run in GPU interpret mode at E=4, M=256, K=N=128 with small tiles, each jitted variant
compiled once and run on the ragged cases that matter: an empty group, groups that are not a multiple of the tile
(partial tiles that also load the next group's rows), padding rows past sum(group_sizes), one group holding every
row.
GPU (`gpu` marker, MX_JAX_TEST_GPU=1 on an H100/H200): the default tiles at MoE shapes, Pallas against XLA.
"""

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mx_jax import compat
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import interpret_compat

interpret_compat.install()  # jax 0.10.2's interpreter cannot read a transposed wgmma operand otherwise

E, M, K, N = 4, 256, 128, 128
F8 = jnp.float8_e4m3fn
# bf16 output of an f32 accumulation: the kernel and the reference may round to neighbouring bf16 values (2^-8).
BF16_TOL = dict(rtol=1e-2, atol=1e-2)
# f32 output: only the summation order differs.
F32_TOL = dict(rtol=1e-5, atol=1e-4)
INTERPRET = compat.InterpretGPUParams()

RAGGED = (69, 0, 123, 37)  # empty group, partial tiles, 27 padding rows (the last tile moves back to end at M)
ONE_GROUP = (0, 0, M, 0)  # every row in one group, empties before and after
SMALL = gm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2)  # CTA 64x128 (split n), 2 K steps
SMALL_M = gm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, wg_split="m")  # CTA 128x64
SMALL_F8 = gm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2)  # fp8: 64 B rows, still 2 K steps


def _sizes(sizes) -> jax.Array:
    return jnp.asarray(sizes, jnp.int32)


def _inputs(seed: int, *shapes, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _seed(*parts) -> int:
    """A fixed seed per test case, from its name and parameters (crc32: the same in every process, unlike hash())."""
    return zlib.crc32(repr(parts).encode())


def _scales(seed: int, *shapes):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [jax.random.uniform(k, s, jnp.float32, 0.25, 2.0) for k, s in zip(keys, shapes)]


def _close(out, ref, tol):
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)


# ------------------------------------------------------------------------------------------------------------
# Group bookkeeping (pure jnp, fast)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [64, 128])
def test_row_tiles_cover_every_row_once(block):
    """Each row is stored by exactly one tile of its own segment; a segment of s rows starting at row r gets
    ceil((r % 8 + s) / block) tiles (anchored on the 8-row grid that TMA loads need), all inside [0, M). The used
    entries come first (the kernel walks only that prefix). Each tile's band holds it, lies inside its segment and
    is one of ceil(n / 16) bands of even width over the segment's n tiles."""
    rng = np.random.default_rng(_seed("row_tiles", block))
    e, m = 6, 512
    for total in (*rng.integers(0, m + 1, size=5), m):
        sizes = rng.multinomial(int(total), rng.dirichlet(np.full(e, 0.3)))
        meta = np.asarray(gm._gmm_row_tiles(_sizes(sizes), m, block))
        used = meta[0] >= 0
        assert used[: used.sum()].all(), "unused entries must come last"
        owner = np.full(m, -2)
        tiles = np.zeros(e + 1, int)
        for t, (seg, row8, lo, hi, band_start, band_width) in enumerate(meta.T):
            if seg < 0:
                continue
            assert band_start <= t < band_start + band_width, (t, band_start, band_width)
            assert (meta[0, band_start : band_start + band_width] == seg).all(), "a band spans two segments"
            row = row8 * 8
            assert 0 <= row <= m - block and 0 <= lo <= hi <= block, (row, lo, hi)
            rows = slice(row + lo, row + hi)
            assert (owner[rows] == -2).all(), "a row is stored twice"
            owner[rows] = seg
            tiles[seg] += 1
        np.testing.assert_array_equal(owner, np.asarray(gm.row_groups(_sizes(sizes), m)))
        segment_rows = np.append(sizes, m - sizes.sum())
        starts = np.cumsum(segment_rows) - segment_rows
        np.testing.assert_array_equal(tiles, np.where(segment_rows > 0, -(-(starts % 8 + segment_rows) // block), 0))
        for seg in np.flatnonzero(tiles):
            bands = {(int(b), int(w)) for b, w in meta[4:, meta[0] == seg].T}  # (first entry, width)
            assert len(bands) == -(-tiles[seg] // 16) and sum(w for _, w in bands) == tiles[seg], bands
            assert max(w for _, w in bands) - min(w for _, w in bands) < len(bands), bands


def test_band_walk_visits_each_tile_once_band_after_band():
    """`_band_walk` over the row-tile list of a skewed routing (one expert with 40% of the rows): every (row tile,
    col) pair once, bands one after another, the row tile fastest inside a band."""
    sizes = np.array([6554, 1404, 1404, 1404, 1404, 1404, 1404, 1406])
    meta = np.asarray(gm._gmm_row_tiles(_sizes(sizes), 16384, 128))
    count, cols = int((meta[0] >= 0).sum()), 56
    seen = [tuple(int(v) for v in gm._band_walk(jnp.int32(i), cols, lambda q: (meta[4, q], meta[5, q])))
            for i in range(count * cols)]
    assert sorted(seen) == [(r, c) for r in range(count) for c in range(cols)]
    band_of = [int(meta[4, r]) for r, _ in seen]
    assert band_of == sorted(band_of), "bands are walked one after another"
    r0, r1 = seen[0][0], seen[1][0]
    assert (r1, seen[1][1]) == (r0 + 1, seen[0][1]), "the row tile runs fastest"
    assert sorted({int(w) for w in meta[5, :count]}) == [11, 12, 13]  # 52 tiles as 4 x 13, 11-12 for the others


def test_walk_visits_each_tile_once_in_even_bands():
    """Every (row, col) tile once, band after band along the minor axis; the bands differ in width by less than
    their count (130 row tiles in bands of <= 16: eight of 15 and one of 10, not eight of 16 and one of 2)."""
    for rows, cols, minor, width in ((130, 56, "m", 16), (128, 56, "m", 16), (7, 11, "m", 16), (102, 11, "n", 4)):
        seen = [tuple(int(v) for v in gm._walk(jnp.int32(i), rows, cols, minor, width)) for i in range(rows * cols)]
        assert sorted(seen) == [(r, c) for r in range(rows) for c in range(cols)]
        size = rows if minor == "m" else cols
        bands = -(-size // width)
        w = -(-size // bands)
        band_of = [(r if minor == "m" else c) // w for r, c in seen]
        assert band_of == sorted(band_of), "bands are walked one after another"
        widths = [len({(r if minor == "m" else c) for (r, c), b in zip(seen, band_of) if b == k}) for k in range(bands)]
        assert max(widths) <= width and min(widths) > w - bands, widths


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_group_col_amax_matches_segment_max(dtype):
    """Groups spanning many blocks, several tiny groups inside one block, empty groups, padding rows, and an M that
    is not a multiple of the block (the segment_max fallback)."""
    rng = np.random.default_rng(_seed("group_col_amax", jnp.dtype(dtype).name))
    cases = [(384, (0, 300, 0, 84, 0)), (384, (3, 1, 2, 5, 0, 1, 250, 7, 1, 2)), (256, (0, 0, 0)),
             (384, (128, 128, 128)), (200, (17, 0, 150))]
    e = 6
    cases += [(512, tuple(rng.multinomial(512 - 40, rng.dirichlet(np.full(e, 0.5))))) for _ in range(3)]
    for m, sizes in cases:
        t = jnp.asarray(rng.standard_normal((m, 7)) * rng.exponential(1.0, (m, 1)), dtype)
        gid = gm.row_groups(_sizes(sizes), m)
        want = jnp.maximum(jax.ops.segment_max(jnp.abs(t).astype(jnp.float32), gid,
                                               num_segments=len(sizes) + 1)[: len(sizes)], 0.0)
        got = jax.jit(gm.group_col_amax)(t, _sizes(sizes))
        np.testing.assert_array_equal(got, want, err_msg=str((m, sizes)))


def test_aligned_token_layout_round_trip():
    rng = np.random.default_rng(_seed("aligned_token_layout"))
    sizes = _sizes([5, 0, 70, 1, 30])
    x = jnp.asarray(rng.standard_normal((128, 3)), jnp.float32)
    x_t, starts = gm.aligned_token_layout(x, sizes, 16)
    assert x_t.shape[0] == 3 and x_t.shape[1] % 16 == 0
    gid = np.asarray(gm.row_groups(sizes, 128))
    offset = 0
    for g, size in enumerate(np.asarray(sizes)):
        assert int(starts[g]) % 16 == 0
        np.testing.assert_array_equal(x_t[:, starts[g] : starts[g] + size].T, x[offset : offset + size])
        offset += size
    assert float(jnp.abs(x_t).sum()) == pytest.approx(float(jnp.abs(x[gid < 5]).sum()), rel=1e-6)


def test_group_bookkeeping_has_no_loop():
    """jnp.searchsorted's default is a while loop, which XLA:GPU steps through with a host round trip per
    iteration (233 us idle beside a 169 us gmm kernel at E = 128): the kernels' bookkeeping must not contain one,
    and `gm.searchsorted` must still agree with numpy's."""
    sizes = _sizes(np.full(128, 256))
    programs = {
        "row_groups": lambda s: gm.row_groups(s, 32768),
        "_gmm_row_tiles": lambda s: gm._gmm_row_tiles(s, 32768, 128),
        "_row_pieces": lambda s: gm._row_pieces(s, 32768, 128),
        "_tgmm_group_meta": lambda s: gm._tgmm_group_meta(s, 32768, 128, None),
        "aligned_token_layout": lambda s: gm.aligned_token_layout(jnp.zeros((32768, 8)), s, 64),
        "group_col_amax": lambda s: gm.group_col_amax(jnp.ones((32768, 8)), s),
    }
    for name, f in programs.items():
        assert "while" not in jax.jit(f).lower(sizes).as_text(), name
    rng = np.random.default_rng(_seed("searchsorted"))
    a = np.sort(rng.integers(0, 1000, 129)).astype(np.int32)
    v = np.arange(-2, 1003, dtype=np.int32)
    for side in ("left", "right"):
        np.testing.assert_array_equal(gm.searchsorted(jnp.asarray(a), jnp.asarray(v), side),
                                      np.searchsorted(a, v, side))


# ------------------------------------------------------------------------------------------------------------
# XLA path against the reference (no kernel)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_gmm_xla(transpose_rhs, fp8):
    rng = np.random.default_rng(_seed("gmm_xla", transpose_rhs, fp8))
    sizes = _sizes(rng.multinomial(M - 13, np.full(E, 1 / E)))  # random groups + 13 padding rows
    x, w = _inputs(1, (M, K), (E, N, K) if transpose_rhs else (E, K, N), dtype=F8 if fp8 else jnp.bfloat16)
    scales = dict(zip(("lhs_scale", "rhs_scale"), _scales(2, (M,), (E, N)))) if fp8 else {}
    kw = dict(transpose_rhs=transpose_rhs, **scales)
    _close(gm.gmm(x, w, sizes, impl="xla", **kw), gm.gmm(x, w, sizes, impl="reference", **kw), BF16_TOL)


@pytest.mark.parametrize("fp8", [False, True])
def test_tgmm_xla(fp8):
    x, dy = _inputs(3, (M, K), (M, N), dtype=F8 if fp8 else jnp.bfloat16)
    scales = dict(zip(("lhs_scale", "rhs_scale"), _scales(4, (E, K), (E, N)))) if fp8 else {}
    for sizes in (RAGGED, ONE_GROUP):
        out = gm.tgmm(x, dy, _sizes(sizes), impl="xla", **scales)
        _close(out, gm.tgmm(x, dy, _sizes(sizes), impl="reference", **scales), F32_TOL)


def test_auto_on_cpu_is_xla():
    x, w = _inputs(5, (M, K), (E, K, N))
    np.testing.assert_array_equal(gm.gmm(x, w, _sizes(RAGGED)), gm.gmm(x, w, _sizes(RAGGED), impl="xla"))


# ------------------------------------------------------------------------------------------------------------
# The Pallas kernels in GPU interpret mode
# ------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _gmm_fn(config, transpose_rhs):
    return jax.jit(
        functools.partial(gm.gmm_pallas, transpose_rhs=transpose_rhs, config=config, interpret=INTERPRET)
    )


@functools.lru_cache(maxsize=None)
def _tgmm_fn(config, out_dtype):
    return jax.jit(functools.partial(gm.tgmm_pallas, config=config, out_dtype=out_dtype, interpret=INTERPRET))


def test_gmm_pallas_bf16_ragged_cases():
    x, w = _inputs(10, (M, K), (E, K, N))
    f = _gmm_fn(SMALL, False)
    for sizes in (RAGGED, ONE_GROUP):
        out = f(x, w, _sizes(sizes))
        _close(out, gm.gmm_reference(x, w, _sizes(sizes)), BF16_TOL)
        assert not np.asarray(out[sum(sizes) :], np.float32).any(), "padding rows must be exactly zero"


def test_gmm_pallas_transposed_rhs_split_m():
    """The grad-input orientation (rhs stored (E, N, K)); warpgroups split the CTA rows, and a warpgroup that holds
    none of the tile's segment rows stores nothing: the second one in group 0's only tile of (40, 0, 150, 66), the
    first one in RAGGED's last tile (moved back to end at M, its first 64 rows already stored)."""
    x, w_t = _inputs(11, (M, K), (E, N, K))
    for sizes in (RAGGED, (40, 0, 150, 66)):
        out = _gmm_fn(SMALL_M, True)(x, w_t, _sizes(sizes))
        _close(out, gm.gmm_reference(x, w_t, _sizes(sizes), transpose_rhs=True), BF16_TOL)


@pytest.mark.skipif(not compat.MGPU_INTERPRET_CLUSTERS, reason="this jax's GPU interpreter has no clusters")
def test_gmm_pallas_cluster_multicast():
    """2-CTA clusters on neighbouring N blocks share (multicast) the A tile."""
    x, w = _inputs(26, (M, K), (E, K, 2 * N))
    config = gm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, cluster="n")
    out = _gmm_fn(config, False)(x, w, _sizes(RAGGED))
    _close(out, gm.gmm_reference(x, w, _sizes(RAGGED)), BF16_TOL)


@pytest.mark.parametrize("cluster", [None, "n"])
def test_gmm_pallas_delay_release(cluster):
    """One wgmma group left in flight per step: each tile's last stage is released only after its accumulator is
    drained, before the memory warpgroup refills the ring for the CTA's next tile (4 K steps over a 3-stage ring)."""
    if cluster and not compat.MGPU_INTERPRET_CLUSTERS:
        pytest.skip("this jax's GPU interpreter has no clusters")
    x, w = _inputs(27, (M, 2 * K), (E, 2 * K, 2 * N))
    config = gm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, delay_release=1, cluster=cluster)
    f = _gmm_fn(config, False)
    for sizes in (RAGGED, ONE_GROUP):
        out = f(x, w, _sizes(sizes))
        _close(out, gm.gmm_reference(x, w, _sizes(sizes)), BF16_TOL)
        assert not np.asarray(out[sum(sizes) :], np.float32).any(), "padding rows must be exactly zero"


def test_gmm_pallas_fp8_rowwise():
    x, w_t = _inputs(12, (M, K), (E, N, K), dtype=F8)
    xs, ws = _scales(13, (M,), (E, N))
    out = jax.jit(
        lambda *a: gm.gmm_pallas(*a[:3], transpose_rhs=True, lhs_scale=a[3], rhs_scale=a[4], config=SMALL_F8,
                                 interpret=INTERPRET)
    )(x, w_t, _sizes(RAGGED), xs, ws)
    ref = gm.gmm_reference(x, w_t, _sizes(RAGGED), transpose_rhs=True, lhs_scale=xs, rhs_scale=ws)
    _close(out, ref, BF16_TOL)


@pytest.mark.parametrize(
    "config, cases",
    [
        (SMALL, (RAGGED, ONE_GROUP)),  # each warpgroup masks the dy columns it owns
        # each warpgroup masks the x columns it owns; 4 stages (tgmm's default depth) over groups of 1-2 blocks
        (dataclasses.replace(SMALL_M, stages=4), (RAGGED,)),
    ],
    ids=["split_n", "split_m"],
)
def test_tgmm_pallas_bf16_masked(config, cases):
    x, dy = _inputs(14, (M, K), (M, N))
    f = _tgmm_fn(config, jnp.float32)
    for sizes in cases:
        _close(f(x, dy, _sizes(sizes)), gm.tgmm_reference(x, dy, _sizes(sizes)), F32_TOL)


def test_tgmm_pallas_bf16_aligned():
    x, dy = _inputs(15, (M, K), (M, N))
    config = gm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, wg_split="m", tgmm_layout="aligned")
    out = _tgmm_fn(config, jnp.bfloat16)(x, dy, _sizes(RAGGED))
    _close(out, gm.tgmm_reference(x, dy, _sizes(RAGGED), out_dtype=jnp.bfloat16), BF16_TOL)


def test_tgmm_pallas_fp8_rowwise():
    x, dy = _inputs(16, (M, K), (M, N), dtype=F8)
    xs, dys = _scales(17, (E, K), (E, N))
    out = jax.jit(
        lambda *a: gm.tgmm_pallas(*a[:3], lhs_scale=a[3], rhs_scale=a[4], config=SMALL_F8, interpret=INTERPRET)
    )(x, dy, _sizes(RAGGED), xs, dys)
    _close(out, gm.tgmm_reference(x, dy, _sizes(RAGGED), lhs_scale=xs, rhs_scale=dys), F32_TOL)


def test_group_cast_t_equals_quantize_then_layout():
    """The Pallas cast into the aligned K-major token layout writes exactly the bytes of quantize_group_cols
    followed by aligned_token_layout (per-64-row-tile multipliers, zero gaps, a group of one row, an empty one)."""
    for sizes in (RAGGED, (1, 0, 200, 40)):
        (t,) = _inputs(20, (M, K))
        q, _ = gm.qz.amax_to_scales(gm.group_col_amax(t, _sizes(sizes)), F8, True)
        got, a_starts = jax.jit(lambda t, g: gm._group_cast_t(t, g, q, 64, INTERPRET))(t, _sizes(sizes))
        want, want_starts = gm.aligned_token_layout(gm.quantize_group_cols(t, _sizes(sizes))[0], _sizes(sizes), 64)
        np.testing.assert_array_equal(a_starts, want_starts)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_group_cast_t_in_place_equals_gathered():
    """Groups sized in multiples of 64 rows (an empty one, a 64-row one): the cast that reads each group's row tiles
    in place writes the bytes of the gathered version, zero gaps included."""
    (t,) = _inputs(22, (M, K))
    for sizes in ((64, 0, 128, 64), (0, 192, 64, 0)):
        q, _ = gm.qz.amax_to_scales(gm.group_col_amax(t, _sizes(sizes)), F8, True)
        got, a_starts = jax.jit(lambda t, g: gm._group_cast_t_in_place(t, g, q, 128, INTERPRET))(t, _sizes(sizes))
        want, want_starts = jax.jit(lambda t, g: gm._group_cast_t(t, g, q, 128, INTERPRET))(t, _sizes(sizes))
        np.testing.assert_array_equal(a_starts, want_starts)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_tgmm_fp8_rowwise_pallas_matches_reference():
    x, dy = _inputs(21, (M, K), (M, N))
    f = jax.jit(functools.partial(gm.tgmm_fp8_rowwise_pallas, config=SMALL_F8, interpret=INTERPRET))
    out = f(x, dy, _sizes(RAGGED))
    _close(out, gm.tgmm_fp8_rowwise(x, dy, _sizes(RAGGED), impl="reference"), F32_TOL)
    assert not np.asarray(out[1]).any(), "the empty group's gradient is zero"
    aligned = _sizes((64, 0, 128, 64))  # with group_align=64 the operands are cast in place
    g = jax.jit(functools.partial(gm.tgmm_fp8_rowwise_pallas, config=SMALL_F8, interpret=INTERPRET, group_align=64))
    one = g(x, dy, aligned)
    _close(one, gm.tgmm_fp8_rowwise(x, dy, aligned, impl="reference"), F32_TOL)
    # two right operands sharing x (the experts' gate and up): x cast once, each result as from its own call
    dy2 = dy[:, ::-1] * 3.0
    both = g(x, (dy, dy2), aligned)
    np.testing.assert_array_equal(np.asarray(both[0]), np.asarray(one))
    np.testing.assert_array_equal(np.asarray(both[1]), np.asarray(g(x, dy2, aligned)))


# ------------------------------------------------------------------------------------------------------------
# Lowering for the GPU, on CPU: Mosaic-GPU layout inference and the shared-memory budget at the shape
# ------------------------------------------------------------------------------------------------------------
_H200 = jax.sharding.AbstractMesh(
    (), (), abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
)
_S = jax.ShapeDtypeStruct
_LOWERING_CASES = {
    "gmm_bf16": (lambda x, w, g: gm.gmm_pallas(x, w, g), ((16384, 4096), (8, 4096, 14336))),
    "gmm_bf16_grad_input": (
        lambda x, w, g: gm.gmm_pallas(x, w, g, transpose_rhs=True), ((16384, 14336), (8, 4096, 14336))
    ),
    "gmm_fp8_cluster": (
        lambda x, w, g: gm.gmm_pallas(
            x, w, g, transpose_rhs=True, lhs_scale=jnp.ones(x.shape[:1]), rhs_scale=jnp.ones(w.shape[:2]),
            config=gm.TileConfig(tile_k=128, cluster="n"),
        ),
        ((16384, 4096), (8, 14336, 4096)),
    ),
    # N = 1408 (DeepSeek's d_expert): 256 does not divide it, the dispatcher takes the 256x128 CTA tile
    "gmm_bf16_n1408": (lambda x, w, g: gm.gmm_pallas(x, w, g), ((24576, 2048), (8, 2048, 1408))),
    "gmm_fp8_n1408": (
        lambda x, w, g: gm.gmm_pallas(
            x, w, g, transpose_rhs=True, lhs_scale=jnp.ones(x.shape[:1]), rhs_scale=jnp.ones(w.shape[:2])
        ),
        ((24576, 2048), (8, 1408, 2048)),
    ),
    # the dynamic schedule (tiles from a GMEM counter, pallas_kernels/tile_queue.py), bf16 and fp8 with scales
    "gmm_bf16_dynamic": (
        lambda x, w, g: gm.gmm_pallas(x, w, g, config=dataclasses.replace(gm.default_configs(x.dtype)[0],
                                                                           schedule="dynamic")),
        ((16384, 4096), (8, 4096, 14336)),
    ),
    "gmm_fp8_dynamic": (
        lambda x, w, g: gm.gmm_pallas(
            x, w, g, transpose_rhs=True, lhs_scale=jnp.ones(x.shape[:1]), rhs_scale=jnp.ones(w.shape[:2]),
            config=dataclasses.replace(gm.default_configs(x.dtype)[0], schedule="dynamic"),
        ),
        ((16384, 4096), (8, 14336, 4096)),
    ),
    "tgmm_bf16_masked_dynamic": (
        lambda x, d, g: gm.tgmm_pallas(x, d, g, config=dataclasses.replace(gm.default_configs(x.dtype, "tgmm")[1],
                                                                            schedule="dynamic")),  # f32: 3 stages
        ((16384, 4096), (16384, 14336)),
    ),
    "tgmm_fp8_dynamic": (
        lambda x, d, g: gm.tgmm_pallas(x, d, g, lhs_scale=jnp.ones((8, 4096)), rhs_scale=jnp.ones((8, 14336)),
                                       config=dataclasses.replace(gm.default_configs(x.dtype, "tgmm")[1],
                                                                  schedule="dynamic")),
        ((16384, 4096), (16384, 14336)),
    ),
    "gmm_bf16_3_stages": (  # the fallback of the default 4-stage tile (which the cases above take)
        lambda x, w, g: gm.gmm_pallas(x, w, g, config=gm.TileConfig()),
        ((16384, 4096), (8, 4096, 14336)),
    ),
    "tgmm_bf16_masked": (lambda x, d, g: gm.tgmm_pallas(x, d, g), ((16384, 4096), (16384, 14336))),
    "tgmm_fp8": (
        lambda x, d, g: gm.tgmm_pallas(x, d, g, lhs_scale=jnp.ones((8, 4096)), rhs_scale=jnp.ones((8, 14336))),
        ((16384, 4096), (16384, 14336)),
    ),
    # bf16 operands cast into the aligned K-major layout by the transposed-cast kernel, then the fp8 tgmm
    "tgmm_fp8_rowwise_bf16_in": (lambda x, d, g: gm.tgmm_fp8_rowwise_pallas(x, d, g), ((16384, 4096), (16384, 14336))),
    "tgmm_fp8_rowwise_bf16_in_place": (lambda x, d, g: gm.tgmm_fp8_rowwise_pallas(x, d, g, group_align=64),
                                  ((16384, 4096), (16384, 14336))),
}


@pytest.mark.parametrize("case", sorted(_LOWERING_CASES))
def test_kernels_lower_for_hopper(case):
    """Lowering runs Mosaic-GPU's layout inference and checks shared memory against 227 KiB; no GPU needed."""
    fn, (lhs_shape, rhs_shape) = _LOWERING_CASES[case]
    dtype = F8 if "fp8" in case and "bf16_in" not in case else jnp.bfloat16
    args = (_S(lhs_shape, dtype), _S(rhs_shape, dtype), _S((8,), jnp.int32))
    with jax.sharding.use_abstract_mesh(_H200):
        if "bf16_in" in case and not compat.MGPU_TRANSPOSED_CAST:  # jax 0.10.2: auto takes the row-major path
            with pytest.raises(NotImplementedError, match="transposed cast lowers for the GPU with jax >= 0.11"):
                jax.jit(fn).trace(*args)
            return
        if "dynamic" in case and not compat.MGPU_TILE_QUEUE:  # jax 0.10.2: no inline PTX for the queue's atomic
            with pytest.raises(NotImplementedError, match="MGPU_TILE_QUEUE"):
                jax.jit(fn).trace(*args)
            return
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ------------------------------------------------------------------------------------------------------------
# Cover and argument errors (no kernel runs)
# ------------------------------------------------------------------------------------------------------------
def test_grouped_gemms_take_the_dynamic_schedule_per_device_of_a_mesh(monkeypatch):
    """Inside shard_map over several devices (the MoE layer's expert GEMMs under fsdp or expert parallelism) the
    collectives run beside the grouped GEMMs, and `gmm` and `tgmm` take their default tiles with the dynamic
    schedule (jax >= 0.11, a Hopper GPU, not interpreted); alone, the static one. A cluster refuses it."""
    from jax.sharding import PartitionSpec as P
    from pallas_kernels import device

    monkeypatch.setattr(device, "on_hopper", lambda: True)
    x, w = _S((16384, 4096), jnp.bfloat16), _S((8, 4096, 14336), jnp.bfloat16)
    gmm_cover = gm._gmm_cover_fn(x, w, False, jnp.bfloat16, False)
    tgmm_cover = gm._tgmm_cover_fn(x, _S((16384, 14336), jnp.bfloat16), jnp.float32, False)
    seen = []

    def per_device(v):
        seen.append((gm._pick(gmm_cover, x.dtype, None, "gmm"), gm._pick(tgmm_cover, x.dtype, None, "tgmm")))
        return v

    mesh = jax.make_mesh((len(jax.devices()),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(jnp.zeros(len(jax.devices())))
    (gmm_mesh, gmm_reason), (tgmm_mesh, tgmm_reason) = seen[0]
    alone, reason = gm._pick(gmm_cover, x.dtype, None, "gmm")
    t_alone, t_reason = gm._pick(tgmm_cover, x.dtype, None, "tgmm")
    assert reason is gmm_reason is t_reason is tgmm_reason is None
    assert alone.schedule == t_alone.schedule == "static"
    if compat.MGPU_TILE_QUEUE and len(jax.devices()) > 1:
        assert gmm_mesh == dataclasses.replace(alone, schedule="dynamic")
        assert tgmm_mesh == dataclasses.replace(t_alone, schedule="dynamic")
    else:
        assert (gmm_mesh, tgmm_mesh) == (alone, t_alone)
    assert "dynamic schedule" in gmm_cover(dataclasses.replace(alone, schedule="dynamic", cluster="n"))


@pytest.mark.parametrize("rows,experts,tile_m", [(256, 64, 64), (4096, 64, 64), (8192, 64, 256), (49152, 8, 256)],
                         ids=["decode_1", "decode_64", "prefill", "8_experts"])
def test_gmm_takes_64_row_tiles_for_groups_of_few_rows(rows, experts, tile_m):
    """A gmm with at most 64 rows per group on average (a decoding step's routed tokens) takes the first 64-row
    default that covers it; training-sized groups keep the 256-row tiles (DeepSeekMoE's expert dims: N = 1408 is
    no multiple of 256, so the wide default falls to the 256 x 128 tile)."""
    x, w = _S((rows, 2048), jnp.bfloat16), _S((experts, 2048, 1408), jnp.bfloat16)
    config, reason = gm._pick(gm._gmm_cover_fn(x, w, False, jnp.bfloat16, False), x.dtype, None, "gmm",
                              gm._small_groups(x, w))
    assert reason is None and config.cta_tile_m == tile_m
    if tile_m == 64:
        assert (config.tile_m, config.cta_tile_n, config.stages) == (64, 128, 4)


@pytest.mark.parametrize("rows,experts,k,n,wide", [
    (32768, 128, 2048, 768, True), (32768, 128, 768, 2048, True), (24576, 64, 1408, 2048, True),  # 256 / 384 rows
    (131072, 128, 2048, 768, False), (32768, 8, 4096, 14336, False),  # 1,024 rows each; Mixtral's 4,096
    (24576, 64, 2048, 1408, False)])  # N = 1408: no 256-wide tile covers it
def test_tgmm_takes_64x256_warpgroup_tiles_for_groups_of_few_rows(rows, experts, k, n, wide):
    """16-bit tgmm with fewer than 1,024 rows per group on average: the 128x256 CTA tile of 64x256 warpgroup tiles
    (3-9% faster at Qwen3-30B-A3B's and DeepSeekMoE's experts on an H200); otherwise, or for fp8, the default."""
    x, dy, sizes = _S((rows, k), jnp.bfloat16), _S((rows, n), jnp.bfloat16), _S((experts,), jnp.int32)
    config, reason = gm._pick(gm._tgmm_cover_fn(x, dy, jnp.bfloat16, False), x.dtype, None, "tgmm",
                              gm._tgmm_few_rows(x, sizes))
    assert reason is None and ((config.tile_m, config.tile_n, config.wg_split) == (64, 256, "m")) == wide, config
    assert config.stages == 4 and config.epi_tile_n == 64
    assert not gm._tgmm_few_rows(_S((rows, k), F8), sizes)  # fp8 (aligned layout): not measured, unchanged


def test_tgmm_pallas_bf16_64x256_warpgroup_tiles():
    """The 64x256 warpgroup tile (wg_split m, N = 256 per wgmma) against the reference, ragged groups with an empty
    one, in interpret mode (K = 128, N = 256: one CTA tile per group)."""
    x, dy = _inputs(25, (M, K), (M, 2 * N))
    config = gm.TileConfig(tile_m=64, tile_n=256, tile_k=64, stages=2, wg_split="m")
    _close(_tgmm_fn(config, jnp.float32)(x, dy, _sizes(RAGGED)), gm.tgmm_reference(x, dy, _sizes(RAGGED)), F32_TOL)


def test_pallas_refuses_uncovered_shapes():
    x, w = _inputs(18, (M - 8, K), (E, K, N))
    with pytest.raises(NotImplementedError, match="multiples of"):
        gm.gmm_pallas(x, w, _sizes(RAGGED), config=SMALL)
    x8, w8 = _inputs(18, (M, K), (E, K, N), dtype=F8)
    with pytest.raises(NotImplementedError, match="K-major"):
        gm.gmm(x8, w8, _sizes(RAGGED), impl="pallas")
    with pytest.raises(NotImplementedError, match="shared memory"):
        gm.gmm_pallas(*_inputs(18, (M, K), (E, K, N)), _sizes(RAGGED), config=gm.TileConfig(stages=5))
    with pytest.raises(NotImplementedError, match="128 B"):  # 32 bf16 columns: 64 B staging rows
        gm.gmm_pallas(x, w, _sizes(RAGGED), config=dataclasses.replace(SMALL, epi_tile_n=32))
    with pytest.raises(NotImplementedError, match="delay_release=2 must be >= 0 and below stages=2"):
        gm.gmm_pallas(x, w, _sizes(RAGGED), config=dataclasses.replace(SMALL, delay_release=2))
    with pytest.raises(NotImplementedError, match="delay_release is implemented for gmm only"):
        gm.tgmm_pallas(x, x, _sizes(RAGGED), config=dataclasses.replace(SMALL, delay_release=1))


def test_bad_arguments_name_the_argument():
    x, w = _inputs(19, (M, K), (E, K, N))
    with pytest.raises(ValueError, match="group_sizes"):
        gm.gmm(x, w, _sizes(RAGGED[:3]))
    with pytest.raises(ValueError, match="contract"):
        gm.gmm(x, jnp.zeros((E, K, N + 64), jnp.bfloat16), _sizes(RAGGED), transpose_rhs=True)
    with pytest.raises(ValueError, match="rhs_scale"):
        gm.gmm(x, w, _sizes(RAGGED), lhs_scale=jnp.ones((M,)), rhs_scale=jnp.ones((E, K + 1)))
    with pytest.raises(ValueError, match="impl"):
        gm.tgmm(x, x, _sizes(RAGGED), impl="cuda")


# ------------------------------------------------------------------------------------------------------------
# GPU: default tiles at the MoE shape (Mixtral-sized experts), Pallas against XLA / the reference
# ------------------------------------------------------------------------------------------------------------
GPU_E, GPU_M, GPU_D, GPU_F = 8, 16384, 4096, 14336
GPU_SIZES = (6554, 0, 1401, 1400, 1399, 1400, 1400, 2700)  # 40% on one expert, an empty one, 150 padding rows
# Worst row of ||out - ref|| / ||ref||: a wrong or missing row scores ~1; bf16 output rounding ~2e-3; fp8 wgmma
# accumulates in reduced precision (DeepSeek-V3 report: ~14 bits on Hopper) over up to 6554 products.
GPU_ROW_TOL = 1e-2


def _worst_row_err(out, ref) -> float:
    out = np.asarray(out, np.float32).reshape(-1, out.shape[-1])
    ref = np.asarray(ref, np.float32).reshape(-1, ref.shape[-1])
    norms = np.linalg.norm(ref, axis=1)
    live = norms > 0
    return float((np.linalg.norm(out - ref, axis=1)[live] / norms[live]).max())


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, gm.TileConfig()], ids=["default", "3_stages"])
@pytest.mark.parametrize("direction", ["forward", "grad_input"])
def test_gpu_gmm_bf16(direction, config):
    k, n = (GPU_D, GPU_F) if direction == "forward" else (GPU_F, GPU_D)
    transpose_rhs = direction == "grad_input"  # dx = dy @ w^T reads w (E, D, F) as the K-major (E, N, K) operand
    x, w = _inputs(20, (GPU_M, k), (GPU_E, n, k) if transpose_rhs else (GPU_E, k, n))
    sizes = _sizes(GPU_SIZES)
    out = jax.jit(functools.partial(gm.gmm, transpose_rhs=transpose_rhs, impl="pallas", config=config))(x, w, sizes)
    ref = jax.jit(functools.partial(gm.gmm, transpose_rhs=transpose_rhs, impl="xla"))(x, w, sizes)
    assert _worst_row_err(out[: sum(GPU_SIZES)], ref[: sum(GPU_SIZES)]) < GPU_ROW_TOL
    assert not np.asarray(out[sum(GPU_SIZES) :], np.float32).any(), "padding rows must be exactly zero"


@pytest.mark.gpu
def test_gpu_gmm_fp8():
    x, w_t = _inputs(21, (GPU_M, GPU_D), (GPU_E, GPU_F, GPU_D), dtype=F8)
    xs, ws = _scales(22, (GPU_M,), (GPU_E, GPU_F))
    f = lambda impl: jax.jit(
        functools.partial(gm.gmm, transpose_rhs=True, lhs_scale=xs, rhs_scale=ws, impl=impl)
    )(x, w_t, _sizes(GPU_SIZES))
    out, ref = f("pallas"), f("reference")
    assert _worst_row_err(out[: sum(GPU_SIZES)], ref[: sum(GPU_SIZES)]) < GPU_ROW_TOL
    assert not np.asarray(out[sum(GPU_SIZES) :], np.float32).any()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["masked", "aligned"])
def test_gpu_tgmm_bf16(layout):
    x, dy = _inputs(23, (GPU_M, GPU_D), (GPU_M, GPU_F))
    config = gm.TileConfig(tgmm_layout=layout)
    out = jax.jit(functools.partial(gm.tgmm, impl="pallas", config=config))(x, dy, _sizes(GPU_SIZES))
    ref = jax.jit(functools.partial(gm.tgmm, impl="xla"))(x, dy, _sizes(GPU_SIZES))
    assert _worst_row_err(out, ref) < GPU_ROW_TOL
    assert not np.asarray(out[1]).any(), "an empty group's gradient is zero"


@pytest.mark.gpu
def test_gpu_tgmm_fp8():
    x, dy = _inputs(24, (GPU_M, GPU_D), (GPU_M, GPU_F), dtype=F8)
    xs, dys = _scales(25, (GPU_E, GPU_D), (GPU_E, GPU_F))
    f = lambda impl: jax.jit(functools.partial(gm.tgmm, lhs_scale=xs, rhs_scale=dys, impl=impl))(
        x, dy, _sizes(GPU_SIZES)
    )
    out, ref = f("pallas"), f("reference")
    assert _worst_row_err(out, ref) < GPU_ROW_TOL
    assert not np.asarray(out[1]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("sizes", [GPU_SIZES, (2048,) * 8, (0,) * 7 + (100,)], ids=["skewed", "balanced", "small"])
def test_gpu_gmm_dynamic_schedule_equals_the_static_one(dtype, sizes):
    """The dynamic schedule (work items from a GMEM counter, pallas_kernels/tile_queue.py) computes every tile as
    the static stride does, on three calls in a row (XLA zeroes the counter before each), and with fewer work items
    than CTAs (small: 256 rows, 100 of them in the last group, 2 row tiles x 56 column blocks)."""
    fp8 = dtype == "fp8"
    m = GPU_M if sum(sizes) > 256 else 256
    x, w_t = _inputs(26, (m, GPU_D), (GPU_E, GPU_F, GPU_D), dtype=F8 if fp8 else jnp.bfloat16)
    xs, ws = _scales(27, (m,), (GPU_E, GPU_F)) if fp8 else (None, None)
    static = gm.default_configs(x.dtype)[0]
    dynamic = dataclasses.replace(static, schedule="dynamic")
    assert gm.gmm_pallas_cover(x.shape, w_t.shape, x.dtype, w_t.dtype, transpose_rhs=True, out_dtype=jnp.bfloat16,
                               scaled=fp8, config=dynamic) is None
    f = lambda c: jax.jit(functools.partial(gm.gmm, transpose_rhs=True, lhs_scale=xs, rhs_scale=ws, impl="pallas",
                                            config=c))
    want = np.asarray(f(static)(x, w_t, _sizes(sizes)), np.float32)
    run = f(dynamic)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(run(x, w_t, _sizes(sizes)), np.float32), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gpu_tgmm_dynamic_schedule_equals_the_static_one(dtype):
    """`tgmm` under the dynamic schedule: bit-identical to the static stride, on three calls in a row, with the
    skewed sizes (an empty group: its work items store zeros)."""
    fp8 = dtype == "fp8"
    x, dy = _inputs(28, (GPU_M, GPU_D), (GPU_M, GPU_F), dtype=F8 if fp8 else jnp.bfloat16)
    xs, dys = _scales(29, (GPU_E, GPU_D), (GPU_E, GPU_F)) if fp8 else (None, None)
    static, reason = gm._pick(gm._tgmm_cover_fn(x, dy, jnp.float32, fp8), x.dtype, None, "tgmm")
    assert reason is None and static.schedule == "static"
    dynamic = dataclasses.replace(static, schedule="dynamic")
    f = lambda c: jax.jit(functools.partial(gm.tgmm, lhs_scale=xs, rhs_scale=dys, impl="pallas", config=c))
    want = np.asarray(f(static)(x, dy, _sizes(GPU_SIZES)), np.float32)
    run = f(dynamic)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(run(x, dy, _sizes(GPU_SIZES)), np.float32), want)
