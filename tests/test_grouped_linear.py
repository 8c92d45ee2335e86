"""grouped_linear (mx_jax/grouped_linear.py): values and gradients against jax.grad of a reference formulation.

The reference is the f32 math of the layer, y[r] = x[r] @ w[e(r)] as one masked GEMM per expert, differentiated by
jax. bf16 operands round x and w to 8 bits of mantissa; fp8 e4m3 to 4, so the fp8 recipe is held to a relative-norm
tolerance against that f32 math and to a tight one against the same quantized operands run through the reference
GEMMs (impl="reference"). The Pallas kernels run in GPU interpret mode on CPU; real shapes run under the `gpu` marker.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mx_jax import compat
from mx_jax.grouped_linear import grouped_linear, quantize_group_cols
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import interpret_compat

interpret_compat.install()

E, M, K, N = 4, 256, 128, 128
SIZES = (69, 0, 123, 37)  # empty expert, ragged groups, 27 padding rows
# Relative L2 error of y, dx, dw against the f32 math: bf16 rounding of x and w (2^-9 relative each) gives ~3e-3;
# e4m3 (2^-4 relative) gives ~4e-2 on these random inputs.
REL_TOL = {"bf16": 1e-2, "fp8_rowwise": 8e-2}
# ...and at least this much for fp8_rowwise, output by output, so that none of its three GEMMs (forward, grad-input,
# grad-weight) can silently run in bf16. Measured (CPU, seeds 0-4, both group layouts): fp8 0.0374-0.0381 for each
# of y, dx, dw; the same GEMM in bf16 0.0016-0.0029; e4m3 on one operand only 0.027.
FP8_MIN_REL = 3e-2
# Same operands, same scales, different GEMM: f32 accumulation order and one bf16 rounding of y / dx.
SAME_OPERANDS_TOL = dict(rtol=1e-2, atol=1e-2)


def _inputs(seed: int, x_dtype=jnp.bfloat16, m=M, k=K, n=N, e=E):
    kx, kw, kc = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(x_dtype)
    w = jax.random.normal(kw, (e, k, n), jnp.float32) / np.sqrt(k)  # f32 master weights
    cot = jax.random.normal(kc, (m, n), jnp.float32)  # a fresh cotangent for the VJP
    return x, w, cot


def _reference_loss(x, w, sizes, cot):
    y = gm.gmm_reference(x.astype(jnp.float32), w, sizes, out_dtype=jnp.float32)
    return jnp.sum(y * cot)


def _value_and_grads(recipe, impl, x, w, sizes, cot, group_align=1):
    def loss(x, w):
        y = grouped_linear(x, w, sizes, recipe=recipe, impl=impl, group_align=group_align)
        return jnp.sum(y.astype(jnp.float32) * cot), y

    (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    return y, dx, dw


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _check_against_f32_math(recipe, got, x, w, sizes, cot):
    """got = (y, dx, dw) of `recipe`: each within REL_TOL of the f32 math, and for fp8 no closer than FP8_MIN_REL."""
    y_ref = gm.gmm_reference(x.astype(jnp.float32), w, sizes, out_dtype=jnp.float32)
    dx_ref, dw_ref = jax.grad(_reference_loss, argnums=(0, 1))(x.astype(jnp.float32), w, sizes, cot)
    for name, out, want in zip(("y", "dx", "dw"), got, (y_ref, dx_ref, dw_ref)):
        err = _rel(out, want)
        assert err < REL_TOL[recipe], (name, err)
        if recipe == "fp8_rowwise":
            assert err > FP8_MIN_REL, (f"{name} is closer to the f32 math than e4m3 operands allow: not fp8?", err)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_rowwise"])
def test_values_and_grads_match_f32_math(recipe):
    x, w, cot = _inputs(0)
    sizes = jnp.asarray(SIZES, jnp.int32)
    y, dx, dw = _value_and_grads(recipe, "xla", x, w, sizes, cot)
    assert (y.dtype, dx.dtype, dw.dtype) == (x.dtype, x.dtype, w.dtype)
    _check_against_f32_math(recipe, (y, dx, dw), x, w, sizes, cot)
    pad = sum(SIZES)
    assert not np.asarray(y[pad:], np.float32).any() and not np.asarray(dx[pad:], np.float32).any()
    assert not np.asarray(dw[1]).any(), "an expert without tokens gets a zero gradient"


def test_fp8_recipe_xla_matches_reference_gemms():
    """Same quantized operands through lax.ragged_dot and through the jnp reference GEMMs (both fp8: each output as
    far from the f32 math as e4m3 operands put it)."""
    x, w, cot = _inputs(1)
    sizes = jnp.asarray(SIZES, jnp.int32)
    got_all = _value_and_grads("fp8_rowwise", "xla", x, w, sizes, cot)
    want_all = _value_and_grads("fp8_rowwise", "reference", x, w, sizes, cot)
    for got, want in zip(got_all, want_all):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **SAME_OPERANDS_TOL)
    _check_against_f32_math("fp8_rowwise", got_all, x, w, sizes, cot)
    _check_against_f32_math("fp8_rowwise", want_all, x, w, sizes, cot)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_fp8_quantizes_the_weights_compute_copy(impl):
    """fp8_rowwise quantizes w.astype(x.dtype): f32 master weights give the same y, bit for bit, as their bf16 copy
    (on GPU XLA would otherwise drop the f32 -> bf16 -> f32 round trip and quantize the f32 values)."""
    x, w, _ = _inputs(7)
    sizes = jnp.asarray(SIZES, jnp.int32)
    f = jax.jit(lambda x, w: grouped_linear(x, w, sizes, recipe="fp8_rowwise", impl=impl))
    np.testing.assert_array_equal(np.asarray(f(x, w), np.float32), np.asarray(f(x, w.astype(x.dtype)), np.float32))


def test_group_column_scales():
    x, _, _ = _inputs(2)
    sizes = jnp.asarray(SIZES, jnp.int32)
    q, scale = quantize_group_cols(x, sizes)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (E, K)
    log2 = np.log2(np.asarray(scale))
    np.testing.assert_array_equal(log2, np.round(log2))  # powers of two
    gid = np.asarray(gm.row_groups(sizes, M))
    real = gid < E
    row_scale = np.asarray(scale)[gid[real]]  # (rows, K)
    x_real = np.asarray(x, np.float32)[real]
    err = np.abs(np.asarray(q, np.float32)[real] * row_scale - x_real)
    # Round to nearest e4m3 (3 mantissa bits): half an ulp is 2^-4 relative; subnormals step by 2^-9 * scale.
    assert (err <= 2**-4 * np.abs(x_real) + 2**-10 * row_scale).all()
    amax = np.stack([np.abs(x_real[gid[real] == g]).max(0) if (gid == g).any() else np.zeros(K) for g in range(E)])
    used = amax > 0
    assert (amax[used] / np.asarray(scale)[used] <= 448).all() and (amax[used] / np.asarray(scale)[used] > 224).all()


@pytest.mark.parametrize("recipe,align", [("bf16", 1), ("fp8_rowwise", 1), ("fp8_rowwise", 64)])
def test_pallas_kernels_in_interpret_mode(recipe, align):
    """All three grouped GEMMs on the Pallas kernels (GPU interpret mode) against the same recipe on the reference;
    with group_align=64 (group sizes multiples of 64) the fp8 grad-weight operands are cast in place."""
    x, w, cot = _inputs(3)
    sizes = jnp.asarray(SIZES if align == 1 else (64, 0, 128, 64), jnp.int32)
    with compat.force_gpu_interpret_mode(compat.InterpretGPUParams()):
        got = _value_and_grads(recipe, "pallas", x, w, sizes, cot, group_align=align)
    want = _value_and_grads(recipe, "reference", x, w, sizes, cot)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), **SAME_OPERANDS_TOL)
    _check_against_f32_math(recipe, got, x, w, sizes, cot)  # fp8: the kernels' GEMMs really ran on e4m3 operands


def test_shard_map_with_experts_sharded():
    """Each device holds its own tokens (sorted by its local experts) and E/4 experts: the op runs on local arrays."""
    devices = np.array(jax.devices()[:4])
    mesh = jax.sharding.Mesh(devices, ("expert",))
    e_local, m_local = 2, 64
    x, w, cot = _inputs(4, m=4 * m_local, e=4 * e_local)
    rng = np.random.default_rng(4)
    sizes = jnp.asarray(
        np.concatenate([rng.multinomial(m_local - 5, np.full(e_local, 1 / e_local)) for _ in range(4)]), jnp.int32
    )  # per device: its experts' groups + 5 padding rows

    def local_loss(x, w, sizes, cot):
        y = grouped_linear(x, w, sizes, recipe="bf16", impl="xla")
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * cot), "expert")

    sharded = jax.shard_map(
        local_loss, mesh=mesh, in_specs=(P("expert"), P("expert"), P("expert"), P("expert")), out_specs=P()
    )
    dx, dw = jax.jit(jax.grad(sharded, argnums=(0, 1)))(x, w, sizes, cot)

    def per_device_reference(x, w, sizes, cot):
        total = 0.0
        for d in range(4):
            rows, experts = slice(d * m_local, (d + 1) * m_local), slice(d * e_local, (d + 1) * e_local)
            total = total + _reference_loss(x[rows], w[experts], sizes[experts], cot[rows])
        return total

    dx_ref, dw_ref = jax.grad(per_device_reference, argnums=(0, 1))(x.astype(jnp.float32), w, sizes, cot)
    assert _rel(dx, dx_ref) < REL_TOL["bf16"] and _rel(dw, dw_ref) < REL_TOL["bf16"]


@pytest.mark.parametrize("recipe", ["bf16", "fp8_rowwise"])
def test_pallas_path_types_check_in_shard_map(recipe):
    """Inside shard_map (check_vma) the kernels' outputs must vary over the mesh axis like their inputs, or the
    custom_vjp rejects the cotangents and psum would treat per-device values as replicated. Traced, not run."""
    if recipe != "bf16" and not compat.MGPU_TRANSPOSED_CAST:
        pytest.skip("jax 0.10.2: impl='pallas' refuses the fp8 recipe's transposed cast for the GPU (auto uses XLA)")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("expert",))
    x, w, _ = _inputs(7, m=2 * M, e=2 * E)
    sizes = jnp.asarray(SIZES * 2, jnp.int32)

    def local_loss(x, w, sizes):
        y = grouped_linear(x, w, sizes, recipe=recipe, impl="pallas")
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32)), "expert")

    sharded = jax.shard_map(local_loss, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P())
    jax.jit(jax.grad(sharded, argnums=(0, 1))).trace(x, w, sizes)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_rowwise"])
def test_weights_sharing_x_give_what_one_call_each_gives(recipe):
    """grouped_linear(x, (w_gate, w_up)) (x cast once for both under fp8): the outputs and the gradients of x and of
    both weights equal those of one call per weight, bit for bit."""
    x, w, cot = _inputs(8)
    w2 = jax.random.normal(jax.random.key(9), (E, K, 2 * N), jnp.float32) / np.sqrt(K)
    cot2 = jax.random.normal(jax.random.key(10), (M, 2 * N), jnp.float32)
    sizes = jnp.asarray(SIZES, jnp.int32)

    def loss(x, w, w2, together):
        kw = dict(recipe=recipe, impl="xla")
        y, y2 = (grouped_linear(x, (w, w2), sizes, **kw) if together else
                 (grouped_linear(x, w, sizes, **kw), grouped_linear(x, w2, sizes, **kw)))
        return jnp.sum(y.astype(jnp.float32) * cot) + jnp.sum(y2.astype(jnp.float32) * cot2), (y, y2)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    got, want = f(x, w, w2, True), f(x, w, w2, False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_bad_arguments():
    x, w, _ = _inputs(5)
    sizes = jnp.asarray(SIZES, jnp.int32)
    with pytest.raises(ValueError, match="recipe"):
        grouped_linear(x, w, sizes, recipe="fp8_tensorwise")
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_linear(x, w, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"x \(M, K\)"):
        grouped_linear(x[:, :64], w, sizes)
    with pytest.raises(ValueError, match="group_align"):
        grouped_linear(x, w, sizes, group_align=0)
    with pytest.raises(ValueError, match="operands for each"):
        grouped_linear(x, (w, w), sizes, recipe="fp8_rowwise", operands=(None,))
    with pytest.raises(ValueError, match=r"w \(E, K, N\)"):
        grouped_linear(x, (w, w[:2]), sizes)


# ------------------------------------------------------------------------------------------------------------
# GPU: the expert FFN shapes scaled down, Pallas against XLA
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["bf16", "fp8_rowwise"])
def test_gpu_grads_pallas_vs_xla(recipe):
    e, m, k, n = 8, 4096, 1024, 2048
    x, w, cot = _inputs(6, m=m, k=k, n=n, e=e)
    sizes = jnp.asarray((900, 0, 1500, 37, 700, 129, 500, 200), jnp.int32)
    got = _value_and_grads(recipe, "pallas", x, w, sizes, cot)
    want = _value_and_grads(recipe, "xla", x, w, sizes, cot)
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert _rel(g, r) < 1e-2, name  # same operands; bf16 rounding of outputs only
