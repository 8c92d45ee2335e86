"""fp8 training recipes (mx_jax/quant.py): the custom_vjp against the f32 product within fp8 tolerances, the grads'
dtypes, each recipe's table (dtype, scaling axis, pow2) rebuilt independently and matched bit for bit, the
Pallas path interpreted, kernel_support, and a `gpu` test of every recipe on the kernels."""

import importlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import PartitionSpec as P

from mx_jax import compat, quant
from pallas_kernels import device, interpret_compat
from tests.helpers import worst_line_rel

qz = importlib.import_module("pallas_kernels.quantize")
fm = importlib.import_module("pallas_kernels.fp8_matmul")
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
# Relative Frobenius error of a GEMM whose operands are rounded to fp8 (3 or 2 mantissa bits), per GEMM.
TOL = {"bf16": 1e-2, E4M3: 0.06, E5M2: 0.11}


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    interpret_compat.install()


def problem(key, t=128, k=256, n=128, w_dtype=jnp.float32):
    kx, kw, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (2, t // 2, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n)) / np.sqrt(k)).astype(w_dtype)
    g = jax.random.normal(kg, (2, t // 2, n), jnp.bfloat16)
    return x, w, g


def vjp(recipe, impl, x, w, g):
    y, pull = jax.vjp(lambda x, w: quant.linear(x, w, recipe=recipe, impl=impl), x, w)
    return (y, *pull(g))


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# (recipe, tolerance of y, grad_x, grad_w) from the dtypes in the table.
ERRORS = [
    ("bf16", TOL["bf16"], TOL["bf16"], 1e-6),
    ("fp8_tensorwise", TOL[E4M3], TOL[E5M2], TOL[E5M2]),
    ("fp8_rowwise", TOL[E4M3], TOL[E4M3], TOL[E4M3]),
    ("fp8_rowwise_gw_hp", TOL[E4M3], TOL[E4M3], 1e-6),
]


@pytest.mark.parametrize("recipe,tol_y,tol_gx,tol_gw", ERRORS)
def test_grads_close_to_f32(recipe, tol_y, tol_gx, tol_gw):
    x, w, g = problem(jax.random.key(0))
    f32 = lambda x, w: jnp.einsum("btk,kn->btn", x.astype(jnp.float32), w.astype(jnp.float32))
    y_ref, pull = jax.vjp(f32, x, w)
    gx_ref, gw_ref = pull(g.astype(jnp.float32))
    y, gx, gw = jax.jit(lambda x, w, g: vjp(recipe, "xla", x, w, g))(x, w, g)
    assert (y.dtype, gx.dtype, gw.dtype) == (x.dtype, x.dtype, w.dtype)
    assert y.shape == (2, 64, 128) and gx.shape == x.shape and gw.shape == w.shape
    assert rel(y, y_ref) < tol_y and rel(gx, gx_ref) < tol_gx and rel(gw, gw_ref) < tol_gw


def test_grad_dtypes_follow_the_primals():
    x, w, g = problem(jax.random.key(1), w_dtype=jnp.bfloat16)
    for recipe in quant.RECIPES:
        y, gx, gw = vjp(recipe, "xla", x, w, g)
        assert (y.dtype, gx.dtype, gw.dtype) == (jnp.bfloat16,) * 3, recipe


def expected(recipe, x, w, g):
    """The recipe table rebuilt from the module docstring, without quant.RECIPE_TABLE: (y, grad_x, grad_w)."""
    q, mm = qz.quantize_reference, fm.fp8_matmul_reference
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    # High precision: bf16 operands, the GEMM writes `out` itself (f32 accumulation inside). Not an f32 product
    # rounded afterwards: XLA:CPU's bf16-output dot may round differently (1 element in 32768 on some CPUs).
    hp = lambda a, b, dims, out: jax.lax.dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (dims, ((), ())), preferred_element_type=out)

    def fp8(a, a_axis, a_dtype, a_scaling, b, b_axis, b_dtype, b_scaling, out, pow2):
        # Each operand scaled along its contraction axis and laid out K-major (contraction axis last).
        qa, sa = q(a, axis=a_axis, dtype=a_dtype, scaling=a_scaling, pow2_scale=pow2)
        qb, sb = q(b, axis=b_axis, dtype=b_dtype, scaling=b_scaling, pow2_scale=pow2)
        qa, qb = (qa if a_axis == 1 else qa.T), (qb if b_axis == 1 else qb.T)
        return mm(qa, qb, sa, sb, out_dtype=out)

    if recipe == "bf16":  # over x's own (B, S) dims: bf16 does not flatten the tokens (quant._make_linear2d)
        y, gx = hp(x, w, ((2,), (0,)), x.dtype), hp(g, w, ((2,), (1,)), x.dtype)
        return y, gx, hp(x, g, ((0, 1), (0, 1)), w.dtype)
    elif recipe == "fp8_tensorwise":
        y = fp8(x2, 1, E4M3, "tensorwise", w, 0, E4M3, "tensorwise", x.dtype, False)
        gx = fp8(g2, 1, E5M2, "tensorwise", w, 1, E4M3, "tensorwise", x.dtype, False)
        gw = fp8(x2, 0, E4M3, "tensorwise", g2, 0, E5M2, "tensorwise", jnp.float32, False).astype(w.dtype)
    elif recipe == "fp8_rowwise":
        y = fp8(x2, 1, E4M3, "rowwise", w, 0, E4M3, "rowwise", x.dtype, True)
        gx = fp8(g2, 1, E4M3, "rowwise", w, 1, E4M3, "rowwise", x.dtype, True)
        gw = fp8(x2, 0, E4M3, "rowwise", g2, 0, E4M3, "rowwise", jnp.float32, True).astype(w.dtype)
    else:  # fp8_rowwise_gw_hp
        y = fp8(x2, 1, E4M3, "rowwise", w, 0, E4M3, "rowwise", x.dtype, False)
        gx = fp8(g2, 1, E4M3, "rowwise", w, 1, E4M3, "tensorwise", x.dtype, False)
        gw = hp(x2, g2, ((0,), (0,)), w.dtype)
    return y.reshape(g.shape), gx.reshape(x.shape), gw


FP8_RECIPES = tuple(r for r in quant.RECIPES if r != "mxfp8")  # mxfp8: tests/test_mx_linear.py


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_recipe_table_bit_exact(recipe):
    x, w, g = problem(jax.random.key(2))
    got = vjp(recipe, "reference", x, w, g)
    want = expected(recipe, x, w, g)
    for name, a, b in zip(("y", "grad_x", "grad_w"), got, want):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), (recipe, name)


def test_gw_hp_grad_w_is_the_bf16_grad_w_and_rowwise_is_not():
    x, w, g = problem(jax.random.key(3))
    x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])  # rows, as the fp8 recipes contract them
    gw_bf16 = vjp("bf16", "xla", x, w, g)[2]
    assert np.array_equal(np.asarray(vjp("fp8_rowwise_gw_hp", "xla", x, w, g)[2]), np.asarray(gw_bf16))
    assert rel(vjp("fp8_rowwise", "xla", x, w, g)[2], gw_bf16) > 1e-3  # fp8 operands: visibly different


def test_rowwise_scales_are_powers_of_two_and_gw_hp_scales_are_not():
    x, w, _ = problem(jax.random.key(4))
    x2 = x.reshape(-1, x.shape[-1])
    r = quant.RECIPE_TABLE
    _, s_row = qz.quantize(x2, axis=1, dtype=E4M3, pow2_scale=r["fp8_rowwise"].pow2_scale)
    assert (np.frexp(np.asarray(s_row))[0] == 0.5).all()
    _, s_hp = qz.quantize(x2, axis=1, dtype=E4M3, pow2_scale=r["fp8_rowwise_gw_hp"].pow2_scale)
    assert not (np.frexp(np.asarray(s_hp))[0] == 0.5).all()


@pytest.mark.parametrize("recipe", ["fp8_rowwise"])
def test_pallas_interpreted_matches_reference(recipe):
    # bf16 weights: the transposed cast kernel takes 16-bit inputs (f32 masters fall back to XLA under "auto").
    x, w, g = problem(jax.random.key(5), t=256, k=256, n=256, w_dtype=jnp.bfloat16)
    want = vjp(recipe, "reference", x, w, g)
    with compat.force_gpu_interpret_mode(compat.InterpretGPUParams()):
        got = vjp(recipe, "pallas", x, w, g)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2**-7, atol=1e-2)


def test_jit_grad_and_leading_dims():
    x, w, g = problem(jax.random.key(6))
    loss = lambda x, w: jnp.sum(quant.linear(x, w, recipe="fp8_rowwise").astype(jnp.float32) * g)
    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    _, gx2, gw2 = vjp("fp8_rowwise", "auto", x, w, g)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(gx2))
    np.testing.assert_allclose(np.asarray(gw), np.asarray(gw2), rtol=1e-6)
    # a single token vector (no leading dims) is its row of the batched product: rowwise scales are per row
    y1 = quant.linear(x[0, 0], w, recipe="fp8_rowwise")
    assert y1.shape == (w.shape[1],)
    y = quant.linear(x, w, recipe="fp8_rowwise")
    np.testing.assert_allclose(np.asarray(y1, np.float32), np.asarray(y[0, 0], np.float32), rtol=1e-2, atol=1e-2)
    exact = np.asarray(x[0, 0], np.float32) @ np.asarray(w, np.float32)
    assert np.abs(np.asarray(y1, np.float32) - exact).max() < 0.1 * np.abs(exact).max()  # and near the true product


def test_bf16_linear_pads_few_rows_into_a_gemm():
    """A decoding step's bf16 product of fewer than 8 rows runs as an 8-row dot (quant._few_rows) whose padding
    rows come from its own weight, so two products of one x do not share a padded operand; values and gradients are
    those of the unpadded product."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 3, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 96)) / 8, jnp.bfloat16)
    f = lambda x, w: quant.linear(x, w, recipe="bf16")
    jaxpr = jax.make_jaxpr(f)(x, w)
    assert "pad[" in str(jaxpr) and "bf16[8,96]" in str(jaxpr)
    two = str(jax.make_jaxpr(lambda x, a, b: (f(x, a), f(x, b)))(x, w, w + 1))
    assert len(re.findall(r"bf16\[8,64\] = p?jit\[name=_pad", two)) == 2  # one padded x per product
    assert "pad[" not in str(jax.make_jaxpr(f)(jnp.zeros((2, 4, 64), jnp.bfloat16), w))  # 8 rows: as written
    with jax.default_matmul_precision("highest"):
        y, pull = jax.vjp(f, x, w)
        want = jnp.einsum("btk,kn->btn", x, w, preferred_element_type=jnp.float32)
        dx, dw = pull(jnp.ones_like(y))
        dx_want, dw_want = jax.grad(lambda x, w: jnp.sum(jnp.einsum(
            "btk,kn->btn", x.astype(jnp.float32), w.astype(jnp.float32))), argnums=(0, 1))(x, w)
    assert y.shape == (1, 3, 96) and y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_want), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(dw_want), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("recipe", quant.RECIPES)
def test_linear_inside_shard_map_makes_no_empty_arrays(recipe):
    """A linear called inside shard_map (as in the MoE layer's body) traces, with its backward, no zero-size array:
    jax 0.11.2's Shardy partitioner segfaulted on one there (tests/test_moe.py). The grads keep the primal dtypes,
    which the custom_vjp holds as static values rather than as empty residuals."""
    import re

    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    x, w, _ = problem(jax.random.key(12), t=128, k=64, n=96, w_dtype=jnp.bfloat16)

    def loss(x, w):
        body = lambda x, w: jnp.sum(quant.linear(x, w, recipe=recipe, impl="reference").astype(jnp.float32))[None]
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False)(
            x, w).sum()

    f = jax.value_and_grad(loss, argnums=(0, 1))
    assert not re.findall(r"\b[a-z]+\d*\[(?:\d+,)*0(?:,\d+)*\]", str(jax.make_jaxpr(f)(x, w)))
    _, (gx, gw) = jax.jit(f)(x, w)
    assert (gx.dtype, gw.dtype) == (x.dtype, w.dtype) and bool(jnp.isfinite(gw.astype(jnp.float32)).all())


def test_save_matmuls_keeps_the_fp8_activation_residuals_under_scan():
    """Under a scanned, rematerialized layer with the "matmul" name saved (model.remat=save_matmuls), the fp8
    transposed copy of each linear's input is a stacked residual, and the backward casts no (T, F) activation again
    (before x's residual was named, it recomputed the SwiGLU output h and its cast)."""
    from jax._src import core
    from mx_jax.layers import linear, swiglu
    t, d, f, n_layers = 32, 64, 128, 2
    x = jnp.asarray(np.random.default_rng(0).standard_normal((t, d)), jnp.bfloat16)
    ws = (jnp.full((n_layers, d, 2 * f), 0.05, jnp.bfloat16), jnp.full((n_layers, f, d), 0.05, jnp.bfloat16))

    def layer(x, w):
        gu = linear(x, w[0], "fp8_rowwise", "xla")
        return linear(swiglu(gu[:, :f], gu[:, f:]), w[1], "fp8_rowwise", "xla"), None

    policy = jax.checkpoint_policies.save_only_these_names("matmul")
    loss = lambda x, ws: jnp.sum(jax.lax.scan(jax.checkpoint(layer, policy=policy), x, ws)[0].astype(jnp.float32))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, ws).jaxpr
    fwd, bwd = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    fp8_saved = {v.aval.shape for v in fwd.outvars if v.aval.dtype == jnp.float8_e4m3fn}
    assert {(n_layers, d, t), (n_layers, f, t)} <= fp8_saved

    def reduced_shapes(j):
        out = [tuple(e.invars[0].aval.shape) for e in j.eqns if e.primitive.name == "reduce_max"]
        return out + [s for e in j.eqns for sub in core.jaxprs_in_params(e.params) for s in reduced_shapes(sub)]

    assert (t, f) not in reduced_shapes(bwd.params["jaxpr"].jaxpr)
    assert (t, f) in reduced_shapes(fwd.params["jaxpr"].jaxpr)  # the forward does cast h: the check can see it


def test_kernel_support_and_errors():
    assert quant.kernel_support("bf16", 7, 3) is None
    assert quant.kernel_support("fp8_rowwise", 4096, 14336) is None
    assert "16" in quant.kernel_support("fp8_rowwise", 4096, 100)
    with pytest.raises(ValueError, match="unknown recipe"):
        quant.kernel_support("fp4", 64, 64)
    x, w, _ = problem(jax.random.key(7))
    with pytest.raises(ValueError, match="unknown recipe"):
        quant.linear(x, w, recipe="fp8")
    with pytest.raises(ValueError, match="x \\(2, 64, 256\\)"):
        quant.linear(x, w.T, recipe="bf16")
    with pytest.raises(ValueError, match="impl"):
        quant.linear(x, w, recipe="bf16", impl="triton")


MESHES = {"data2_expert4": (2, 1, 4, 1), "data8": (8, 1, 1, 1), "fsdp2_expert4": (1, 2, 4, 1)}


@pytest.mark.parametrize("layout", list(MESHES))
def test_prequantize_under_a_mesh(layout):
    """Under a multi-device mesh whose devices hold whole matrices (no fsdp, expert or context split of the dense
    weights' D; for the experts also fsdp on their expert axis), each device casts its own weights in shard_map
    (where impl="auto" may take the Pallas casts); otherwise the partitioner splits XLA's casts. Either way the
    operands equal one device's bit for bit, and the experts' stay split over "expert"."""
    mesh = jax.make_mesh(MESHES[layout], ("data", "fsdp", "expert", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    experts = jax.random.normal(jax.random.key(0), (2, 8, 64, 128), jnp.float32)  # (L, E, K, N)
    dense = tuple(jax.random.normal(jax.random.key(i), (2, 64, 32 * i), jnp.float32) for i in (1, 2))
    cases = [(experts, "fp8_rowwise", True), (dense, "fp8_rowwise", False), (dense, "fp8_tensorwise", False)]
    for ws, recipe, batched in cases:
        def f(*w, recipe=recipe, batched=batched):
            return quant.prequantize(w, recipe=recipe, batched=batched)
        ws = ws if isinstance(ws, tuple) else (ws,)
        want = jax.jit(f)(*ws)
        with jax.set_mesh(mesh):
            spec = jax.sharding.PartitionSpec(None, "expert") if batched else jax.sharding.PartitionSpec()
            placed = [jax.device_put(w, jax.sharding.NamedSharding(mesh, spec)) for w in ws]
            # fsdp and expert split the dense weights' matrices; the experts' are whole (fsdp on their expert axis)
            assert ("shard_map" in str(jax.make_jaxpr(f)(*placed))) == (batched or layout == "data8")
            got = jax.jit(f)(*placed)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
        if batched and mesh.shape["expert"] > 1:
            want_spec = ("expert", "fsdp") if mesh.shape["fsdp"] > 1 else "expert"
            assert all(a.sharding.spec[:2] == (None, want_spec) for a in jax.tree.leaves(got))


@pytest.mark.parametrize("mesh_shape", [(2, 1, 4, 1), (1, 2, 4, 1)])
def test_prequantize_under_an_expert_mesh_lowers_to_the_cast_kernels(monkeypatch, mesh_shape):
    """On Hopper, the experts' operands under a data x expert or fsdp x expert mesh come from the Pallas casts,
    run per device."""
    monkeypatch.setattr(device, "on_hopper", lambda: True)
    mesh = jax.sharding.AbstractMesh(
        mesh_shape, ("data", "fsdp", "expert", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 4,
        abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132))
    w = jax.ShapeDtypeStruct((2, 8, 4096, 1024), jnp.float32)
    f = jax.jit(lambda w: quant.prequantize(w, recipe="fp8_rowwise", batched=True))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(w).lower(lowering_platforms=("cuda",)).as_text()
    assert "manual_computation" in text
    # jax 0.10.2 cannot lower the transposed cast for the GPU (compat.MGPU_TRANSPOSED_CAST): auto takes XLA there
    assert ("mosaic_gpu" in text) == compat.MGPU_TRANSPOSED_CAST


LINEAR_MESHES = {"data2_fsdp2_expert2": (2, 2, 2, 1), "fsdp4_context2": (1, 4, 1, 2), "data8": (8, 1, 1, 1)}


@pytest.mark.parametrize("layout", list(LINEAR_MESHES))
@pytest.mark.parametrize("recipe", quant.PREQUANTIZED)
def test_linear_per_device_under_a_mesh(layout, recipe):
    """Under a multi-device mesh an fp8 linear runs per device over the token axes (shard_map; on Hopper that is
    where the Pallas GEMM and casts apply). Rows scaled along K or N are the same on every device count, so y and
    grad_x equal one device's bit for bit under the rowwise recipes; grad_w (its operands scaled along T, each
    device over its own tokens) and every tensorwise operand (one scale per device) come out as close to the f32
    product as one device's do. T not split evenly keeps the partitioner's path, with the same results."""
    mesh = jax.make_mesh(LINEAR_MESHES[layout], ("data", "fsdp", "expert", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    x, w, g = problem(jax.random.key(11), t=512, k=256, n=384)
    x, g = x.reshape(8, 64, 256), g.reshape(8, 64, 384)
    x = x.at[1, 3].multiply(50.0)  # an outlier row: tensorwise scales differ between the devices
    f32 = lambda x, w: jnp.einsum("btk,kn->btn", x.astype(jnp.float32), w.astype(jnp.float32))
    y_ref, pull = jax.vjp(f32, x, w)
    refs = (y_ref, *pull(g.astype(jnp.float32)))
    one = jax.jit(lambda x, w, g: vjp(recipe, "auto", x, w, g))(x, w, g)
    act = jax.sharding.PartitionSpec(("data", "fsdp", "expert"), "context")
    with jax.set_mesh(mesh):
        xs, gs = (jax.device_put(a, jax.sharding.NamedSharding(mesh, act)) for a in (x, g))
        ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
        f = jax.jit(lambda x, w, g: vjp(recipe, "auto", x, w, g))
        assert "shard_map" in str(jax.make_jaxpr(f)(xs, ws, gs))
        # x and dy reach the shard_maps as the model lays them out: no all-to-all re-lays them (context included)
        assert "all-to-all" not in f.lower(xs, ws, gs).compile().as_text()
        got = f(xs, ws, gs)
        odd = (x[:4, :63], g[:4, :63])  # 4 x 63 rows: not a multiple of the 8 devices' token split
        assert "shard_map" not in str(jax.make_jaxpr(f)(*odd[:1], ws, *odd[1:]))
        got_odd = f(odd[0], ws, odd[1])
    want_odd = jax.jit(lambda x, w, g: vjp(recipe, "auto", x, w, g))(odd[0], w, odd[1])
    for a, b in zip(got_odd, want_odd):  # (float32 sums in another order: grad_w's over 8 devices' tokens)
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
    for i, (a, b, ref) in enumerate(zip(got, one, refs)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if recipe != "fp8_tensorwise" and i < 2:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        else:
            assert rel(a, ref) < 1.1 * rel(b, ref) + 1e-6, (i, rel(a, ref), rel(b, ref))
            assert rel(a, b) < 2 * rel(b, ref) + 1e-5, (i, rel(a, b))


@pytest.mark.parametrize("layout", [(2, 2, 1, 1), (2, 2, 2, 1), (1, 4, 1, 2)])
@pytest.mark.parametrize("w_axes", [("embed", "mlp"), ("mlp", "embed")])
def test_linear_per_device_reduces_grad_w_where_the_weight_is_split(layout, w_axes):
    """Given w's logical axes, the per-device fp8 linear reduce-scatters its grad_w partials over the mesh axes that
    split w (fsdp, context), on w's split dim, and all-reduces the shards over the other token axes (data, expert),
    inside its shard_map: no collective carries the whole weight gradient. Summed outside (no axes given), XLA
    all-reduced whole weight gradients over data x fsdp (benchmarks/RESULTS.md, session 37). Same sum either way."""
    import re

    from mx_jax import sharding

    mesh = jax.make_mesh(layout, ("data", "fsdp", "expert", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 4,
                         devices=jax.devices()[:math.prod(layout)])
    x, w, g = problem(jax.random.key(12), t=512, k=256, n=384)
    x, g = x.reshape(8, 64, 256), g.reshape(8, 64, 384)
    grad_w = lambda axes: lambda x, w, g: jax.vjp(
        lambda x, w: quant.linear(x, w, recipe="fp8_rowwise", w_axes=axes), x, w)[1](g)[1]
    with jax.set_mesh(mesh):
        act = jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert"), "context"))
        w_sharding = jax.sharding.NamedSharding(mesh, sharding.param_spec(w_axes, w.shape, mesh))
        xs, gs, ws = jax.device_put(x, act), jax.device_put(g, act), jax.device_put(w, w_sharding)
        f = jax.jit(grad_w(w_axes), out_shardings=w_sharding)
        lowered = f.lower(xs, ws, gs)
        text = lowered.compile().as_text()
        got = f(xs, ws, gs)
        outside = jax.jit(grad_w(None), out_shardings=w_sharding)
        summed_outside = outside(xs, ws, gs)
    np.testing.assert_allclose(got, summed_outside, rtol=1e-5, atol=1e-5)
    # Reduced inside, the grad_w GEMM is fenced before the grad_x GEMM, so that its reduce-scatter runs beside it,
    # and the reduce-scatter before anything downstream of grad_x: two fences.
    assert lowered.as_text().count("stablehlo.optimization_barrier") == 2
    assert "optimization_barrier" not in outside.lower(xs, ws, gs).as_text()
    # The reduce-scatter takes dim 0 of a GEMM output whose rows are w's split dim: where w is split on dim 1, the
    # GEMM writes grad_wᵀ and only the shard is transposed back (no transpose of the whole partial before it).
    scattered = re.findall(r"reduce_scatter\"[\s\S]*?\) -> tensor<(\d+)x(\d+)xf32>", lowered.as_text())
    assert scattered and {int(c) for _, c in scattered} == {w.shape[1 - w_axes.index("embed")]}, scattered
    assert got.sharding.is_equivalent_to(w_sharding, 2)
    reduced = re.findall(r"= \(?f32\[([\d,]*)\][^ ]* (all-reduce|reduce-scatter)(?:-start)?\(", text)
    assert any(kind == "reduce-scatter" for _, kind in reduced), reduced
    assert not [d for d, _ in reduced if d in ("256,384", "1,256,384")], reduced


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_fp8_and_mx_linears_sum_grad_w_across_devices_in_reduce_dtype(reduce_dtype):
    """The fp8 linear's per-device path reduce-scatters its grad_w partials in `reduce_dtype`
    (model.grad_reduce_dtype), and the MX linear's weight-gradient GEMM writes that dtype for XLA's sum; the
    gradient comes back in w's dtype, as close to the f32 product as one device's."""
    import re

    from mx_jax import sharding

    mesh = jax.make_mesh((1, 4, 1, 1), ("data", "fsdp", "expert", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 4, devices=jax.devices()[:4])
    x, w, g = problem(jax.random.key(14), t=512, k=256, n=384, w_dtype=jnp.bfloat16)
    x, g = x.reshape(8, 64, 256), g.reshape(8, 64, 384)
    ref = jnp.einsum("btk,btn->kn", x.astype(jnp.float32), g.astype(jnp.float32))
    want = {"float32": "f32", "bfloat16": "bf16"}[reduce_dtype]
    for recipe in ("fp8_rowwise", "mxfp8"):
        grad_w = lambda x, w, g: jax.vjp(lambda x, w: quant.linear(
            x, w, recipe=recipe, w_axes=("embed", "mlp"), reduce_dtype=reduce_dtype), x, w)[1](g)[1]
        one = jax.jit(grad_w)(x, w, g)
        with jax.set_mesh(mesh):
            act = jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert"), "context"))
            w_sharding = jax.sharding.NamedSharding(mesh, sharding.param_spec(("embed", "mlp"), w.shape, mesh))
            xs, gs, ws = jax.device_put(x, act), jax.device_put(g, act), jax.device_put(w, w_sharding)
            f = jax.jit(grad_w, out_shardings=w_sharding)
            text = f.lower(xs, ws, gs).as_text()
            got = f(xs, ws, gs)
        if recipe == "fp8_rowwise":  # (256, 384) partials scattered over fsdp on w's split dim
            summed = re.findall(r"reduce_scatter\"[\s\S]*?\) -> tensor<64x384x(\w+)>", text)
        else:
            summed = re.findall(r"dot_general .*-> tensor<256x384x(\w+)>$", text, re.M)
        assert summed and set(summed) == {want}, (recipe, summed)
        assert got.dtype == jnp.bfloat16
        assert rel(got, ref) < 1.1 * rel(one, ref) + 1e-3, (recipe, rel(got, ref), rel(one, ref))


@pytest.mark.parametrize("layout", [(1, 1, 1, 2), (1, 2, 1, 2), (2, 1, 1, 4)])
def test_bf16_linear_under_context_moves_only_weights(layout):
    """A bf16 linear over x (B, S, K) with B > 1 and S split over context: the only collectives move the weight
    and its gradient. Flattening x to rows first made XLA gather x over the sequence, contract over the weight's K
    shard and all-reduce activations (benchmarks/RESULTS.md, session 36)."""
    import re

    mesh = jax.make_mesh(layout, ("data", "fsdp", "expert", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 4,
                         devices=jax.devices()[:math.prod(layout)])
    x, w, g = problem(jax.random.key(13), t=256, k=256, n=384)
    x, g = x.reshape(4, 64, 256), g.reshape(4, 64, 384)
    f = jax.jit(lambda x, w, g: vjp("bf16", "auto", x, w, g))
    want = f(x, w, g)
    with jax.set_mesh(mesh):
        act = jax.sharding.NamedSharding(mesh, P(("data", "fsdp", "expert"), "context"))
        xs, gs = jax.device_put(x, act), jax.device_put(g, act)
        ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, P(("fsdp", "context"))))
        text = f.lower(xs, ws, gs).compile().as_text()
        got = f(xs, ws, gs)
    moved = re.findall(r"= \w+\[([\d,]*)\][^ ]* (?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\(",
                       text)
    assert moved and all(d.split(",")[-1] == "384" and 256 % int(d.split(",")[0]) == 0 and d.count(",") == 1
                         for d in moved), moved
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


def test_linear_per_device_lowers_to_the_kernels(monkeypatch):
    """On Hopper under a data x fsdp mesh, the fp8 linear's GEMMs (forward, grad_x, grad_w) are Mosaic GPU kernels
    inside the manual computation, and grad_w's per-device partial sums are summed in f32."""
    monkeypatch.setattr(device, "on_hopper", lambda: True)
    mesh = jax.sharding.AbstractMesh(
        (2, 2, 1, 1), ("data", "fsdp", "expert", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 4,
        abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132))
    x = jax.ShapeDtypeStruct((4, 1024, 1024), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((4, 1024, 2048), jnp.bfloat16)
    f = jax.jit(lambda x, w, g: vjp("fp8_rowwise", "auto", x, w, g))
    with jax.sharding.use_abstract_mesh(mesh):
        text = f.trace(x, w, g).lower(lowering_platforms=("cuda",)).as_text()
    assert "manual_computation" in text
    assert text.count("mosaic_gpu") >= 3, text.count("mosaic_gpu")
    assert "tensor<4x1024x2048xf32>" in text  # the stacked partial grad_w, before its f32 sum


# --------------------------------------------------------------------------------------------------------------
# GPU: MX_JAX_TEST_GPU=1 python -m pytest -m gpu tests/test_quant_recipes.py
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_recipes_on_the_kernels(recipe, w_dtype):
    x, w, g = problem(jax.random.key(8), t=8192, k=4096, n=14336, w_dtype=w_dtype)
    got = jax.jit(lambda x, w, g: vjp(recipe, "auto", x, w, g))(x, w, g)
    want = jax.jit(lambda x, w, g: vjp(recipe, "reference", x, w, g))(x, w, g)
    # Same quantized operands on both sides: only the kernels' accumulation (fp8 wgmma: ~14-bit, see
    # test_fp8_matmul) and output rounding differ.
    tol = 1e-2 if recipe == "bf16" else 3e-2
    for a, b in zip(got, want):
        err = worst_line_rel(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))
        assert a.dtype == b.dtype and err < tol, (recipe, err)
    if recipe != "bf16" and w_dtype == jnp.bfloat16 and device.on_hopper():  # bf16 weights: every cast is a kernel
        hlo = jax.jit(lambda x, w, g: vjp(recipe, "auto", x, w, g)).lower(x, w, g).as_text()
        assert "mosaic_gpu" in hlo, recipe
        assert "mosaic_gpu" not in jax.jit(lambda x, w, g: vjp(recipe, "reference", x, w, g)).lower(x, w, g).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_tensorwise"])
def test_gpu_prequantize_on_the_kernels(recipe):
    """The train step's weight operands (quant.prequantize over stacked layers, a fused pair and a single f32
    master) come from the cast kernels on Hopper and equal the reference's bit for bit."""
    k, n = 4096, 2048
    ws = tuple(jax.random.normal(jax.random.key(i), (2, k, n), jnp.float32) / 64 for i in range(2))
    for group in (ws, ws[:1]):
        got = jax.jit(lambda *g: quant.prequantize(g, recipe=recipe, impl="auto"))(*group)
        want = jax.jit(lambda *g: quant.prequantize(g, recipe=recipe, impl="reference"))(*group)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
        if device.on_hopper():
            text = jax.jit(lambda *g: quant.prequantize(g, recipe=recipe)).lower(*group).as_text()
            assert "mosaic_gpu" in text and "concatenate" not in text  # the pair's tiles are read from each weight


@pytest.mark.gpu
@pytest.mark.parametrize("axis", ["data", "context", "fsdp"])
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_tensorwise"])
def test_gpu_linear_per_device_on_two_gpus(recipe, axis):
    """On a mesh of two GPUs split over data (the batch), context (the sequence) or fsdp (the batch, and the weight
    on K: grad_w reduce-scattered inside the shard_map), the per-device linear (Pallas GEMMs and casts in its
    shard_map) against one GPU: rowwise y and grad_x bit for bit (same rows, same kernels), grad_w and tensorwise
    within one device's distance from the f32 product."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    x, w, g = problem(jax.random.key(12), t=8192, k=4096, n=2048, w_dtype=jnp.bfloat16)
    f32 = lambda x, w: jnp.einsum("btk,kn->btn", x.astype(jnp.float32), w.astype(jnp.float32))
    y_ref, pull = jax.vjp(f32, x, w)
    refs = (y_ref, *pull(g.astype(jnp.float32)))
    w_axes = ("embed", "mlp") if axis == "fsdp" else None

    def f(x, w, g):
        y, pull = jax.vjp(lambda x, w: quant.linear(x, w, recipe=recipe, w_axes=w_axes), x, w)
        return (y, *pull(g))

    f = jax.jit(f)
    one = f(x, w, g)
    layout = {"data": (2, 1, 1, 1), "fsdp": (1, 2, 1, 1), "context": (1, 1, 1, 2)}[axis]
    mesh = jax.make_mesh(layout, ("data", "fsdp", "expert", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 4,
                         devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        act = jax.sharding.NamedSharding(mesh, P(None, "context") if axis == "context" else P(axis))
        xs, gs = jax.device_put(x, act), jax.device_put(g, act)
        ws = jax.device_put(w, jax.sharding.NamedSharding(mesh, P("fsdp") if axis == "fsdp" else P()))
        lowered = f.lower(xs, ws, gs)
        if device.on_hopper():
            assert "mosaic_gpu" in lowered.as_text()
        compiled = lowered.compile().as_text()
        assert "all-to-all" not in compiled  # x and dy are used as laid out
        assert ("reduce-scatter" in compiled) == (axis == "fsdp")
        got = f(xs, ws, gs)
    for i, (a, b, ref) in enumerate(zip(got, one, refs)):
        if recipe == "fp8_rowwise" and i < 2:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        else:
            assert rel(a, ref) < 1.1 * rel(b, ref) + 1e-6, (i, rel(a, ref), rel(b, ref))
