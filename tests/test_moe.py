"""MoE: routing math, and expert parallelism that changes nothing: same loss and gradients on every mesh."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mx_jax import compat, sharding
from mx_jax.config import MeshConfig, load_config
from mx_jax.llama import Llama, buffers_of, cross_entropy, moe_loss, params_of
from mx_jax.moe import capacity_keep, route, update_bias

MOE = ["model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
       "model.d_ff=64", "model.compute_dtype=float32", "model.moe.n_experts=8", "model.moe.top_k=2",
       "model.moe.d_expert=16", "model.moe.aux_loss_coef=1.0", "model.moe.z_loss_coef=0.1"]


def test_route_softmax_topk_normalized():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    s, idx, g = route(logits, jnp.zeros(4), 2, "softmax", True)
    np.testing.assert_array_equal(idx, [[0, 1], [2, 0]])
    np.testing.assert_allclose(jnp.sum(g, -1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(g[0, 0] / g[0, 1], np.exp(1.0), rtol=1e-5)
    # the bias changes the choice, never the weights' source (scores without bias)
    s2, idx2, g2 = route(logits, jnp.array([0.0, 0.0, 0.0, 10.0]), 2, "sigmoid", False)
    assert set(np.asarray(idx2[0])) == {3, 0}
    np.testing.assert_allclose(g2[0, 0], jax.nn.sigmoid(-1.0), rtol=1e-6)
    # routed_scale multiplies the weights after the normalization (DeepSeek-V3's sum to 2.5), not the choice
    _, idx3, g3 = route(logits, jnp.zeros(4), 2, "softmax", True, scale=2.5)
    np.testing.assert_array_equal(idx3, idx)
    np.testing.assert_allclose(g3, 2.5 * np.asarray(g), rtol=1e-6)


def _group_limited_reference(s, b, k, groups, top_groups, group_top=0):
    """Group-limited top-k, token by token (moe.py's docstring): the groups by the sum of their top group_top (0:
    max(1, k // M)) values of s + b, then the top-k of s + b inside the M best groups."""
    n, e = s.shape
    per, q = e // groups, group_top or max(1, k // top_groups)
    out = []
    for c in s + b:
        score = [np.sort(c[i * per:(i + 1) * per])[::-1][:q].sum() for i in range(groups)]
        kept = sorted(np.argsort(-np.asarray(score), kind="stable")[:top_groups])
        cand = [x for i in kept for x in range(i * per, (i + 1) * per)]
        out.append(sorted(cand, key=lambda x: -c[x])[:k])
    return np.asarray(out)


@pytest.mark.parametrize("score, k, groups, top_groups, group_top", [
    ("sigmoid", 8, 8, 4, 0),  # DeepSeek-V3's 8 of 256 experts on 4 of 8 nodes, scaled down to 32 experts
    ("softmax", 6, 8, 3, 1),  # DeepSeek-V2's 6 of 160 in 3 of 8 groups, a group scored by its best expert
    ("softmax", 4, 4, 1, 0), ("sigmoid", 6, 4, 3, 3), ("softmax", 2, 4, 4, 0)])
def test_route_group_limited_matches_a_per_token_reference(score, k, groups, top_groups, group_top):
    rng = np.random.default_rng(groups * 10 + top_groups)
    logits = jnp.asarray(rng.standard_normal((64, 32)) * 2, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(32) * 0.3 - 1.0, jnp.float32)  # s + b below 0 in many groups
    s, idx, g = route(logits, bias, k, score, True, groups, top_groups, group_top=group_top)
    want = _group_limited_reference(np.asarray(s), np.asarray(bias), k, groups, top_groups, group_top)
    np.testing.assert_array_equal(np.sort(np.asarray(idx), axis=1), np.sort(want, axis=1))
    assert max(len(set(r)) for r in np.asarray(idx) // (32 // groups)) <= top_groups
    np.testing.assert_allclose(g, np.take_along_axis(np.asarray(s), np.asarray(idx), 1) /
                               np.take_along_axis(np.asarray(s), np.asarray(idx), 1).sum(1, keepdims=True), rtol=1e-6)
    if top_groups == groups:  # every group kept: plain top-k
        np.testing.assert_array_equal(idx, route(logits, bias, k, score, True)[1])
    else:  # the limit changed some tokens' choice
        assert not np.array_equal(np.sort(np.asarray(idx), 1), np.sort(np.asarray(route(logits, bias, k, score,
                                                                                          True)[1]), 1))


def test_capacity_keeps_first_arrivals():
    idx = jnp.array([[0, 1], [0, 2], [0, 1]])
    keep = capacity_keep(idx, 3, capacity=2)
    np.testing.assert_array_equal(keep, [[True, True], [True, True], [False, True]])


def test_bias_update_moves_toward_balance():
    b = update_bias(jnp.zeros(4), jnp.array([10.0, 0.0, 5.0, 5.0]), 0.1)
    np.testing.assert_allclose(b, [-0.1, 0.1, 0.0, 0.0])


def _loss_and_grads(cfg, params, buffers, tokens, mesh, extra=()):
    cfg = load_config(None, MOE + list(extra)) if extra else cfg
    graphdef = nnx.split(nnx.eval_shape(lambda: Llama(cfg.model, cfg.quant, rngs=nnx.Rngs(0))), nnx.Param, ...)[0]

    def loss_fn(p, x, y):
        logits, stats = nnx.merge(graphdef, p, buffers)(x)
        return cross_entropy(logits, y) + moe_loss(cfg.model, stats), stats["load"]

    with jax.set_mesh(mesh):
        f = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
        (loss, load), grads = f(params, tokens[:, :-1], tokens[:, 1:])
    return float(loss), np.asarray(load), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def moe_setup():
    cfg = load_config(None, MOE)
    model = Llama(cfg.model, cfg.quant, rngs=nnx.Rngs(0))
    params = params_of(model)
    buffers = buffers_of(model)
    # Expert 5 never chosen (a huge negative selection bias): with expert=8 its device receives no rows.
    buffers["blocks"]["moe"]["bias"] = buffers["blocks"]["moe"]["bias"].at[:, 5].set(-1e9)
    tokens = jax.random.randint(jax.random.key(1), (16, 17), 0, 256)
    ref = _loss_and_grads(cfg, params, buffers, tokens, sharding.make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    return cfg, params, buffers, tokens, ref


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=1, fsdp=2, expert=2, context=2),
                                      MeshConfig(data=2, fsdp=1, expert=1, context=4)],
                         ids=["fsdp_expert_context", "context4"])
def test_sequence_wise_balance_loss_matches_single_device(moe_setup, mesh_cfg):
    """model.moe.aux_loss_scope=sequence (DeepSeek-V3's): each row's statistics are summed over the context devices
    that split it, so expert, fsdp and context layouts give one device's loss and gradients (aux coefficient 1)."""
    cfg, params, buffers, tokens, (batch_loss, _, _) = moe_setup
    extra = ("model.moe.aux_loss_scope=sequence",)
    one = sharding.make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    ref_loss, _, ref_grads = _loss_and_grads(cfg, params, buffers, tokens, one, extra)
    assert abs(ref_loss - batch_loss) > 1e-4  # the scope changes the loss
    loss, _, grads = _loss_and_grads(cfg, params, buffers, tokens, sharding.make_mesh(mesh_cfg), extra)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for (path, g), (_, r) in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves_with_path(
            ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mesh_cfg, extra", [
    (MeshConfig(fsdp=1, expert=8), ()),
    (MeshConfig(data=2, fsdp=1, expert=4), ()),
    (MeshConfig(data=1, fsdp=2, expert=2, context=2), ()),
    (MeshConfig(fsdp=1, expert=8), ("model.moe.dispatch=hierarchical", "model.moe.gpus_per_node=4")),
    (MeshConfig(fsdp=1, expert=8), ("model.moe.dispatch=hierarchical", "model.moe.gpus_per_node=2")),
    (MeshConfig(fsdp=1, expert=8), ("model.moe.exchange=land", "model.moe.all_to_all=xla")),
], ids=["expert8", "expert4_data2", "fsdp2_expert2_context2", "hier_2nodes_x4", "hier_4nodes_x2", "expert8_land"])
def test_expert_parallel_matches_single_device(moe_setup, mesh_cfg, extra):
    cfg, params, buffers, tokens, (ref_loss, ref_load, ref_grads) = moe_setup
    assert ref_load[:, 5].sum() == 0 and ref_load.sum() == 2 * 16 * 16 * 2  # layers x tokens x top-k
    loss, load, grads = _loss_and_grads(cfg, params, buffers, tokens, sharding.make_mesh(mesh_cfg), extra)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_array_equal(load, ref_load)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    for (path, g), (_, r) in zip(jax.tree_util.tree_leaves_with_path(grads), flat_ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert np.abs(ref_grads["blocks"]["moe"]["w_gate"][:, 5]).max() == 0  # the unused expert gets no gradient
    assert np.abs(ref_grads["blocks"]["moe"]["router"]).max() > 0  # the aux loss reaches the router


def test_group_limited_routing_bounds_the_nodes_a_token_reaches(moe_setup):
    """route_groups = the expert axis's nodes: under the hierarchical dispatch each token's rows cross to at most
    route_top_groups nodes (one row per node), with the same loss and gradients as on one device."""
    cfg, params, buffers, tokens, _ = moe_setup
    hier = ("model.moe.dispatch=hierarchical", "model.moe.gpus_per_node=2")  # 8 devices: 4 nodes of 2
    groups = ("model.moe.route_groups=4", "model.moe.route_top_groups=1")
    mesh = sharding.make_mesh(MeshConfig(fsdp=1, expert=8))

    def cross_node_rows(extra):
        c = load_config(None, MOE + list(extra))
        graph = nnx.split(nnx.eval_shape(lambda: Llama(c.model, c.quant, rngs=nnx.Rngs(0))), nnx.Param, ...)[0]
        with jax.set_mesh(mesh):
            _, stats = jax.jit(lambda p, x: nnx.merge(graph, p, buffers)(x))(params, tokens[:, :-1])
        return np.asarray(stats["rows_cross_node"])  # per layer

    n_tokens = tokens[:, :-1].size
    limited, free = cross_node_rows(hier + groups), cross_node_rows(hier)
    assert limited.shape == (2,) and (limited <= n_tokens).all() and (free > n_tokens).all(), (limited, free)
    one = _loss_and_grads(cfg, params, buffers, tokens, sharding.make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]),
                          groups)
    ep = _loss_and_grads(cfg, params, buffers, tokens, mesh, hier + groups)
    np.testing.assert_allclose(ep[0], one[0], rtol=1e-5)
    np.testing.assert_array_equal(ep[1], one[1])
    for g, r in zip(jax.tree.leaves(ep[2]), jax.tree.leaves(one[2]), strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("method, gpus_per_node", [("flat", 4), ("hierarchical", 4), ("hierarchical", 2)])
def test_dispatch_traffic_matches_fabric_accounting(method, gpus_per_node):
    """The rows the implementation sends across and within nodes equal mx_jax.fabric.traffic for that routing."""
    from jax.sharding import PartitionSpec as P

    from mx_jax import dispatch, fabric

    n_dev, n_experts, n_tok, k, d, f = 8, 16, 6, 4, 8, 4
    rng = np.random.default_rng(7)
    idx = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(n_dev * n_tok)]).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((n_dev * n_tok, d)), jnp.float32)
    g = jnp.full(idx.shape, 1.0 / k, jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in
         ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d))]
    mesh = sharding.make_mesh(MeshConfig(fsdp=1, expert=8))

    def body(x, idx, g, w1, w2, w3):
        ffn = dispatch.ExpertFFN(w1, w2, w3, "bf16", "xla")
        y, t = dispatch.dispatch_combine(x, idx, g, jnp.ones(idx.shape, bool), ffn, axis="expert", method=method,
                                         gpus_per_node=gpus_per_node)
        return y, {key: jax.lax.psum(v, "expert") for key, v in t.items()}

    tok, wspec = P("expert"), P("expert", None, None)
    with jax.set_mesh(mesh):
        y, t = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec),
                                     out_specs=(tok, P()), check_vma=False))(x, jnp.asarray(idx), g, *w)
    src = np.repeat(np.arange(n_dev), n_tok)
    acc = fabric.traffic(idx, src, n_experts, n_dev // gpus_per_node, gpus_per_node, token_bytes=1.0)
    key = "flat" if method == "flat" else "hierarchical"
    assert int(t["rows_cross_node"]) == acc[key]["dispatch"]["cross_node"]
    assert int(t["rows_intra_node"]) == acc[key]["dispatch"]["intra_node"]
    # and the outputs are the plain mixture
    ref = dispatch.dispatch_combine(x, jnp.asarray(idx), g, jnp.ones(idx.shape, bool),
                                    dispatch.ExpertFFN(*w, "bf16", "xla"), axis=None)[0]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["flat", "hierarchical"])
def test_dispatch_moves_rows_by_gathers_only(method):
    """The forward and backward of the expert-parallel dispatch scatter no rows: the exchanges fill their send
    buffers and bring the outputs home by gathers whose transposes are gathers (dispatch.exchange), and the experts
    sort likewise. What is left are the 1-D int32 index maps (each row's slot, each slot's row)."""
    import re

    from jax.sharding import PartitionSpec as P

    from mx_jax import dispatch

    n_dev, n_experts, n_tok, k, d, f = 8, 16, 6, 4, 8, 4
    rng = np.random.default_rng(7)
    idx = jnp.asarray(np.stack([rng.choice(n_experts, k, replace=False) for _ in range(n_dev * n_tok)]), jnp.int32)
    x = jnp.asarray(rng.standard_normal((n_dev * n_tok, d)), jnp.float32)
    g = jnp.full(idx.shape, 1.0 / k, jnp.float32)
    w = [jnp.zeros(s, jnp.float32) for s in ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d))]
    mesh = sharding.make_mesh(MeshConfig(fsdp=1, expert=8))

    def body(x, idx, g, w1, w2, w3):
        y, _ = dispatch.dispatch_combine(x, idx, g, jnp.ones(idx.shape, bool), dispatch.ExpertFFN(w1, w2, w3, "bf16",
                                         "xla"), axis="expert", method=method, gpus_per_node=4)
        return jnp.sum(y ** 2, keepdims=True)[None]

    tok, wspec = P("expert"), P("expert", None, None)
    f_ = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec), out_specs=tok,
                       check_vma=False)
    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(lambda x, g, *w: jnp.sum(f_(x, idx, g, *w)), argnums=(0, 1, 2, 3, 4))).lower(
            x, g, *w).as_text(dialect="hlo")
    scatters = re.findall(r"= (\w+)\[([\d,]*)\]\S* scatter\(", hlo)
    assert scatters  # the index maps: the pattern finds scatters in this text
    assert all(dtype == "s32" and "," not in dims for dtype, dims in scatters), scatters


@pytest.mark.parametrize("d", [6, 160])  # hidden rows packed with the metadata, or (wide) moved on their own
def test_payloads_move_together_as_separately(d):
    """moved_together (the small arrays packed as 32-bit words into one exchange) equals one lax.all_to_all per
    array, bit for bit, for mixed dtypes; its gradient in the float arrays equals the separate exchanges'."""
    from jax.sharding import PartitionSpec as P
    from mx_jax.dispatch import moved_together
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    rng = np.random.default_rng(11)
    bufs = {"x": jnp.asarray(rng.standard_normal((16, 5, d)), jnp.bfloat16),  # (P * 4, A, D) global
            "g": jnp.asarray(rng.standard_normal((16, 5, 3)), jnp.float32),
            "e": jnp.asarray(rng.integers(-1, 9, (16, 5, 3)), jnp.int32),
            "v": jnp.asarray(rng.integers(0, 2, (16, 5)), jnp.bool_)}
    a2a = lambda t: jax.lax.all_to_all(t, "expert", 0, 0)

    def run(together):
        def f(b):
            return moved_together(b, a2a)[0] if together else {k: a2a(v) for k, v in b.items()}
        spec = {k: P("expert") for k in bufs}
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,), out_specs=spec))

    with jax.set_mesh(mesh):
        got, want = run(True)(bufs), run(False)(bufs)
        for k in bufs:
            assert got[k].dtype == bufs[k].dtype and got[k].shape == bufs[k].shape
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))

        def loss(together, x, g):
            out = run(together)({**bufs, "x": x, "g": g})
            w = jnp.arange(out["x"].size, dtype=jnp.float32).reshape(out["x"].shape)
            return jnp.sum(out["x"].astype(jnp.float32) * w) + jnp.sum(out["g"] * out["g"])

        gt = jax.grad(lambda x, g: loss(True, x, g), argnums=(0, 1))(bufs["x"], bufs["g"])
        gw = jax.grad(lambda x, g: loss(False, x, g), argnums=(0, 1))(bufs["x"], bufs["g"])
    for a, b in zip(gt, gw):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _rel(a, b) -> float:
    """||a - b|| / ||b|| (Frobenius), in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# The fp8_rowwise MoE layer (three e4m3 grouped GEMMs chained through SwiGLU) against the same layer in bf16, relative
# Frobenius error of its output and of its expert-weight gradients: measured 0.064-0.072 (CPU, XLA; 4 weight and
# input draws). Experts that silently ran bf16 give exactly 0 (the same code), garbage ~1.
FP8_MOE_REL = (2e-2, 0.1)


@pytest.mark.parametrize("recipe, experts", [("fp8_rowwise", "fp8_rowwise"), ("fp8_tensorwise", "bf16"),
                                             ("mxfp8", "bf16")])
def test_quantized_recipe_reaches_the_routed_experts(recipe, experts):
    """quant.recipe picks the routed experts' grouped recipe where one exists (else bf16 with a note), and the MoE
    layer the model builds runs it: under fp8_rowwise its output and expert-weight gradients differ from the bf16
    recipe's by fp8's error (neither 0, experts silently in bf16, nor ~1, garbage); where the experts stay bf16 they
    equal the bf16 recipe's bit for bit. (The routed-expert output is ~1e-4 of the residual stream at init, so the
    model's loss could not tell.)"""
    from mx_jax.llama import plan_linears

    fp8 = ["quant.expert_min_rows=0"]  # 16 rows per expert here; the default would run them in bf16
    cfg = load_config(None, MOE + [f"quant.recipe={recipe}", "model.compute_dtype=bfloat16"] + fp8)
    plan = plan_linears(cfg.model, cfg.quant)
    assert plan.recipes["experts"] == experts
    assert any("routed experts stay bf16" in n for n in plan.notes) == (experts == "bf16")
    x = jax.random.normal(jax.random.key(3), (4, 16, cfg.model.d_model), jnp.float32).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(4), x.shape, jnp.float32)
    got = {}
    for r in (recipe, "bf16"):
        c = load_config(None, MOE + [f"quant.recipe={r}", "model.compute_dtype=bfloat16"] + fp8)
        model = Llama(c.model, c.quant, rngs=nnx.Rngs(0))
        moe = model.blocks.moe  # the MoE layers of the model's stacked blocks, parameters (n_layers, ...)
        assert (moe.recipe, moe.min_rows) == (experts if r == recipe else "bf16", 0)
        graphdef, state = nnx.split(moe)
        layer0 = jax.tree.map(lambda a: a[0], state)

        def loss(state, x):
            y, stats = nnx.merge(graphdef, state)(x)
            return jnp.sum(y.astype(jnp.float32) * cot), (y, stats["load"])

        (_, (y, load)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(layer0, x)
        assert np.asarray(load).sum() == 4 * 16 * 2  # tokens x top-k
        got[r] = {"y": y, **{k: grads[k][...] for k in ("w_gate", "w_up", "w_down")}}
    for name, want in got["bf16"].items():
        a, b = np.asarray(got[recipe][name], np.float32), np.asarray(want, np.float32)
        assert np.isfinite(a).all() and np.abs(b).max() > 0, name
        if experts == "bf16":
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            lo, hi = FP8_MOE_REL
            assert lo < _rel(a, b) < hi, (name, _rel(a, b))


@pytest.mark.parametrize("fan_out,align", [(1, 1), (3, 1), (3, 8)])
def test_expert_ffn_gathers_equal_a_per_row_loop(fan_out, align):
    """ExpertFFN (sort by gathers, take_rows' gather transposes) against each row through its own expert, values
    and gradients, with dropped assignments (id E_l) and an expert that gets no row; align > 1 pads every expert's
    rows with zero rows to a multiple of it (the fp8 recipe's layout)."""
    from mx_jax import dispatch

    rng = np.random.default_rng([fan_out, align])  # fixed, one stream per case
    e, s, d, f = 4, 37, 8, 16
    ids = rng.integers(0, e + 1, s * fan_out)
    ids[ids == 2] = 3  # expert 2 gets nothing
    ids = jnp.asarray(ids, jnp.int32)
    rows = jnp.asarray(rng.standard_normal((s, d)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(sh) * 0.3, jnp.float32) for sh in ((e, d, f), (e, d, f), (e, f, d))]
    cot = jnp.asarray(rng.standard_normal((s * fan_out, d)), jnp.float32)

    def ours(rows, wg, wu, wd):
        ffn = dispatch.ExpertFFN(wg, wu, wd, "bf16", "reference", group_align=align)
        return jnp.sum(ffn(rows, ids, fan_out=fan_out) * cot)

    def loop(rows, wg, wu, wd):
        x = jnp.repeat(rows, fan_out, axis=0)
        eid = jnp.minimum(ids, e - 1)
        h = jax.nn.silu(jnp.einsum("rd,rdf->rf", x, wg[eid])) * jnp.einsum("rd,rdf->rf", x, wu[eid])
        y = jnp.einsum("rf,rfd->rd", h, wd[eid])
        return jnp.sum(jnp.where((ids < e)[:, None], y, 0.0) * cot)

    got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2, 3)))(rows, *ws)
    want = jax.value_and_grad(loop, argnums=(0, 1, 2, 3))(rows, *ws)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    assert np.abs(np.asarray(got[1][1][2])).max() == 0  # the expert without rows


def test_expert_ffn_makes_no_empty_arrays():
    """With rows that need no tail (a multiple of ROW_MULTIPLE), ExpertFFN's forward and backward hold no zero-size
    array: jax 0.11.2's Shardy partitioner segfaulted compiling the scanned MoE train step on a data or fsdp mesh when
    the sort keys were concatenated with an empty tail (benchmarks/RESULTS.md, session 34)."""
    import re

    from mx_jax import dispatch

    e, d, f, fan_out = 4, 8, 16, 2
    s = dispatch.ROW_MULTIPLE // fan_out
    ids = jnp.asarray(np.arange(s * fan_out) % (e + 1), jnp.int32)
    rows = jnp.ones((s, d), jnp.float32)
    ws = [jnp.ones(sh, jnp.float32) for sh in ((e, d, f), (e, d, f), (e, f, d))]

    def loss(rows, wg, wu, wd):
        return jnp.sum(dispatch.ExpertFFN(wg, wu, wd, "bf16", "reference")(rows, ids, fan_out=fan_out))

    text = str(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(rows, *ws))
    assert "concatenate" in text or "sort" in text  # the sort is traced here
    assert not re.findall(r"\b[a-z]+\d*\[(?:\d+,)*0(?:,\d+)*\]", text)


def test_moe_train_step_has_no_empty_arrays(tmp_path):
    """The whole scanned bf16 MoE train step on a data-parallel mesh (the expert layer's shard_map, its backward,
    the update) lowers without a zero-size tensor: the input on which jax 0.11.2's Shardy partitioner segfaulted.
    (Under fp8 on CPU, the XLA fallback of the grouped column scales has lax.associative_scan's empty slices, which
    did not crash it; on a GPU the cast kernels replace that fallback.)"""
    recipe = "bf16"
    import dataclasses
    import re

    from tests.helpers import NO_IO, lowered_train_step, tiny_config

    cfg = tiny_config(tmp_path, "model.moe.n_experts=8", "model.moe.top_k=2", "model.moe.d_expert=16",
                      "mesh.data=2", "mesh.fsdp=1", f"quant.recipe={recipe}", "quant.expert_min_rows=0", *NO_IO)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=True))
    text = lowered_train_step(cfg, 2).as_text()
    assert "manual_computation" in text or "shard_map" in text  # the expert layer's per-device body is there
    assert not re.findall(r"tensor<(?:\d+x)*0(?:x\d+)*x?[a-z]", text)


@pytest.mark.parametrize("dims,rows_each,fp8", [
    ((4096, 14336), 1024, True), ((4096, 14336), 2048, True),  # Mixtral: 1.09x and 1.16x on an H200
    ((4096, 14336), 800, False),
    ((2048, 1408), 768, False), ((2048, 1408), 1536, False),  # DeepSeekMoE: 0.92x, 0.97x on an H100
    ((2048, 1408), 3072, True),  # 1.01x on an H100, 1.03x on an H200
])
def test_expert_recipe_at_the_measured_crossovers(dims, rows_each, fp8):
    """The default quant.expert_min_rows with the experts' dims picks the side that measured faster (module doc of
    mx_jax.dispatch); 0 always picks fp8, and bf16 stays bf16."""
    from mx_jax import dispatch
    from mx_jax.config import QuantConfig

    min_rows = QuantConfig().expert_min_rows
    got = dispatch.expert_recipe("fp8_rowwise", rows_each * 64, 64, min_rows, dims)
    assert got == ("fp8_rowwise" if fp8 else "bf16")
    assert dispatch.expert_recipe("fp8_rowwise", rows_each * 64, 64, 0, dims) == "fp8_rowwise"
    assert dispatch.expert_recipe("bf16", rows_each * 64, 64, min_rows, dims) == "bf16"


def test_fp8_experts_run_bf16_below_expert_min_rows(caplog):
    """Where a device's experts get too few rows for their dims (quant.expert_min_rows), fp8_rowwise runs them in
    bf16 (the bf16 recipe's values exactly) and warns, naming the key; with 0 they run fp8 (fp8's error from bf16)."""
    import logging

    from mx_jax import dispatch
    from mx_jax.moe import MoE

    cfg = load_config(None, MOE + ["model.compute_dtype=bfloat16"]).model
    x = jax.random.normal(jax.random.key(2), (2, 16, cfg.d_model), jnp.float32).astype(jnp.bfloat16)
    # 32 tokens x top-2 = 64 rows for 8 experts: 8 rows each, at dims far too small for fp8 to pay

    def run(recipe, min_rows):
        layer = MoE(cfg, recipe, "xla", {}, min_rows=min_rows, rngs=nnx.Rngs(0))
        return np.asarray(jax.jit(lambda x: layer(x)[0])(x), np.float32)

    bf16 = run("bf16", 0)
    logger = logging.getLogger("mx_jax")  # train() stops its propagation to the root, where caplog listens
    dispatch._warn_bf16.cache_clear()  # warned once per case and process
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="mx_jax"):
            below = run("fp8_rowwise", 1)
    finally:
        logger.removeHandler(caplog.handler)
    np.testing.assert_array_equal(below, bf16)
    assert "run bf16 instead of fp8_rowwise" in caplog.text and "quant.expert_min_rows=1" in caplog.text
    at = run("fp8_rowwise", 0)
    lo, hi = FP8_MOE_REL  # fp8, not bf16 (0) and not garbage (~1); measured 0.071 here
    assert lo < _rel(at, bf16) < hi, _rel(at, bf16)


# A hand-made routing: 8 tokens, 4 experts, top-2. The router is [I_4; 0], so each token's logits are its first 4
# features, chosen with distinct values so that the top-2 choices below are unambiguous.
_STATS_LOGITS = np.array([
    [3.0, 1.0, 0.0, -1.0],   # experts {0, 1}
    [2.5, -0.5, 0.0, 1.5],   # {0, 3}
    [0.2, 2.0, 1.0, -1.0],   # {1, 2}
    [4.0, 0.0, -2.0, 0.5],   # {0, 3}
    [-1.0, 0.5, 2.2, 1.1],   # {2, 3}
    [1.8, 0.3, 0.9, -0.7],   # {0, 2}
    [2.1, -0.3, 0.0, 1.4],   # {0, 3}
    [0.6, -1.5, 0.0, 2.4],   # {3, 0}
])
_STATS_CHOICES = [(0, 1), (0, 3), (1, 2), (0, 3), (2, 3), (0, 2), (0, 3), (3, 0)]  # chosen 6, 2, 3, 5 times


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_balancing_statistics_on_a_known_routing(capacity_factor):
    """The layer's stats and output on a routing known by construction, against the formulas of moe.py's docstring
    evaluated in NumPy: load (the router's choices per expert, before any capacity drop, as Switch and GShard count
    them: an over-full expert must not look balanced), aux = E sum_e f_e P_e with f_e = load_e / (N k) and
    P_e = mean_n softmax(logits_n)_e, z = mean_n logsumexp(logits_n)^2, dropped = dropped share of the N k
    assignments, y_n = sum of g_nj Expert_j(x_n) over its kept choices (g: top-2 softmax scores over their sum,
    not renormalized after a drop).

    Dropless, the loads are 6, 2, 3, 5. With capacity_factor 1 each expert keeps ceil(1 * 8 * 2 / 4) = 4
    assignments, the first in token order: expert 0 drops tokens 6 and 7, expert 3 token 7, so token 7 gets no
    expert output at all and token 6 only its expert 3's."""
    from mx_jax.moe import MoE

    e, k, n, d, f = 4, 2, 8, 32, 16
    cfg = load_config(None, MOE + ["model.moe.n_experts=4", f"model.moe.capacity_factor={capacity_factor}"]).model
    assert (cfg.moe.top_k, cfg.moe.score, cfg.moe.normalize_top_k, cfg.d_model, cfg.moe.d_expert) == \
        (k, "softmax", True, d, f)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x[:, :e] = _STATS_LOGITS
    w_router = np.zeros((d, e), np.float32)
    w_router[:e, :e] = np.eye(e)
    w_gate, w_up = (rng.standard_normal((e, d, f)).astype(np.float32) * 0.3 for _ in range(2))
    w_down = rng.standard_normal((e, f, d)).astype(np.float32) * 0.3

    layer = MoE(cfg, "bf16", "xla", {}, rngs=nnx.Rngs(0))  # compute dtype float32: the bf16 recipe's GEMMs are f32
    for name, v in (("router", w_router), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        getattr(layer, name).value = jnp.asarray(v)
    y, stats = jax.jit(lambda x: layer(x))(jnp.asarray(x).reshape(2, 4, d))
    y, stats = np.asarray(y).reshape(n, d), {key: np.asarray(v) for key, v in stats.items()}

    # NumPy, in float64
    z = _STATS_LOGITS
    lse = np.log(np.exp(z).sum(-1))
    s = np.exp(z - lse[:, None])  # softmax scores (N, E)
    choices = np.array(_STATS_CHOICES)
    np.testing.assert_array_equal(np.sort(choices, 1), np.sort(np.argsort(-s, 1)[:, :k], 1))  # the example is right
    keep = np.ones((n, k), bool)
    if capacity_factor:
        keep[6, 0] = keep[7, 0] = keep[7, 1] = False  # expert 0's 5th and 6th assignments, expert 3's 5th
    load = np.zeros(e)
    np.add.at(load, choices.reshape(-1), 1.0)  # with or without drops
    np.testing.assert_array_equal(load, [6, 2, 3, 5])
    aux = e * np.sum(load / (n * k) * s.mean(0))
    g = np.take_along_axis(s, choices, 1)
    g = g / g.sum(1, keepdims=True)

    def expert(j, v):
        h = v @ w_gate[j]
        return ((h / (1 + np.exp(-h))) * (v @ w_up[j])) @ w_down[j]

    x64 = x.astype(np.float64)
    want_y = np.zeros((n, d))
    for t in range(n):
        for j in range(k):
            if keep[t, j]:
                want_y[t] += g[t, j] * expert(choices[t, j], x64[t])

    np.testing.assert_array_equal(stats["load"], load)
    np.testing.assert_allclose(stats["dropped"], (~keep).sum() / (n * k), rtol=1e-6)  # 3 / 16 with capacity
    np.testing.assert_allclose(stats["aux_loss"], aux, rtol=1e-5)
    np.testing.assert_allclose(stats["z_loss"], np.mean(lse ** 2), rtol=1e-5)
    np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-4 * np.abs(want_y).max())
    if capacity_factor:
        assert not y[7].any(), "a token whose every assignment was dropped gets no expert output"
    # aux_loss_scope=sequence: per row of 4 tokens, E sum_e (its share of the row's choices) x (mean normalized score)
    seq_cfg = load_config(None, MOE + ["model.moe.n_experts=4", f"model.moe.capacity_factor={capacity_factor}",
                                       "model.moe.aux_loss_scope=sequence"]).model
    seq_layer = MoE(seq_cfg, "bf16", "xla", {}, rngs=nnx.Rngs(0))
    for name, v in (("router", w_router), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        getattr(seq_layer, name).value = jnp.asarray(v)
    seq_aux = float(jax.jit(lambda x: seq_layer(x)[1]["aux_loss"])(jnp.asarray(x).reshape(2, 4, d)))
    rows = []
    for r in (slice(0, 4), slice(4, 8)):
        chosen = np.zeros(e)
        np.add.at(chosen, choices[r].reshape(-1), 1.0)
        rows.append(e * np.sum(chosen / (4 * k) * s[r].mean(0)))  # softmax scores already sum to 1
    np.testing.assert_allclose(seq_aux, np.mean(rows), rtol=1e-5)
    assert abs(np.mean(rows) - aux) > 1e-3  # the two scopes differ on this routing


def test_save_matmuls_keeps_the_expert_gemm_outputs_under_scan():
    """model.remat=save_matmuls, scanned layers, no expert parallelism: the backward runs no forward grouped GEMM
    again (as many as with remat=none), while remat=full does recompute them, so the count can see it."""
    from jax._src import core

    def count(j) -> int:
        return sum((e.primitive.name == "ragged_dot_general") + sum(count(s) for s in core.jaxprs_in_params(e.params))
                   for e in j.eqns)

    def backward_grouped_gemms(remat: str) -> int:
        cfg = load_config(None, MOE + [f"model.remat={remat}", "model.scan_layers=true"])
        graphdef, state = nnx.split(Llama(cfg.model, cfg.quant, rngs=nnx.Rngs(0)))

        def loss(state):
            logits, _ = nnx.merge(graphdef, state)(jnp.zeros((2, 16), jnp.int32))
            return jnp.sum(logits.astype(jnp.float32))

        scans = [e for e in jax.make_jaxpr(jax.grad(loss))(state).jaxpr.eqns if e.primitive.name == "scan"]
        return count(scans[-1].params["jaxpr"].jaxpr)  # the last scan runs the backward

    saved = backward_grouped_gemms("save_matmuls")
    assert saved == backward_grouped_gemms("none")
    assert backward_grouped_gemms("full") > saved


@pytest.mark.parametrize("exchange", ["dense", "land"])
def test_ep_save_gate_up_keeps_them_for_the_backward(exchange):
    """model.moe.ep_save_gate_up at expert=8 (compact buffers of 256 rows against whole ones of 512; land on its XLA
    reference), scanned layers under save_matmuls: the same loss and gradients as computing the gate and up outputs
    again in the backward, and the compiled step has two GEMMs fewer (the backward's gate and up; XLA:CPU lowers each
    grouped GEMM to one dot), so they are neither recomputed nor the forward run again for them."""
    import re

    base = MOE + ["model.remat=save_matmuls", "model.scan_layers=true", f"model.moe.exchange={exchange}",
                  "model.moe.all_to_all=xla"]
    cfg = load_config(None, base)
    model = Llama(cfg.model, cfg.quant, rngs=nnx.Rngs(0))
    params, buffers = params_of(model), buffers_of(model)
    tokens = jax.random.randint(jax.random.key(2), (16, 33), 0, 256)  # 64 tokens per device
    mesh = sharding.make_mesh(MeshConfig(fsdp=1, expert=8))

    def step(save: bool):
        extra = base + [f"model.moe.ep_save_gate_up={str(save).lower()}"]
        c = load_config(None, extra)
        graphdef = nnx.split(nnx.eval_shape(lambda: Llama(c.model, c.quant, rngs=nnx.Rngs(0))), nnx.Param, ...)[0]

        def loss_fn(p, x, y):
            logits, stats = nnx.merge(graphdef, p, buffers)(x)
            return cross_entropy(logits, y) + moe_loss(c.model, stats)

        with jax.set_mesh(mesh):
            hlo = jax.jit(jax.grad(loss_fn)).lower(params, tokens[:, :-1], tokens[:, 1:]).compile().as_text()
        return len(re.findall(r"= \S+ dot\(", hlo)), _loss_and_grads(cfg, params, buffers, tokens, mesh, extra)

    (dots_again, (loss_again, _, grads_again)), (dots_saved, (loss_saved, _, grads_saved)) = step(False), step(True)
    assert dots_saved == dots_again - 2
    np.testing.assert_allclose(loss_saved, loss_again, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_saved), jax.tree.leaves(grads_again), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert np.abs(grads_saved["blocks"]["moe"]["w_gate"]).max() > 0


@pytest.mark.parametrize("method, gpus_per_node", [("flat", 8), ("hierarchical", 4), ("hierarchical", 2)])
@pytest.mark.parametrize("capacity", [0, 3])
def test_receive_buffers_hold_the_exact_bound_and_drop_nothing(method, gpus_per_node, capacity, monkeypatch):
    """8 devices, 8 experts (one each), top-2. Receive buffers hold peer_bound rows per sender: min(k, 1) = 1 per
    token instead of k, or the capacity. The routing reaches the bound: every token of every device chooses experts
    0 and 1 (some also others), so devices 0 and 1 get a full chunk from each peer; the mixture must still equal the
    single-device one with the same keep mask."""
    from jax.sharding import PartitionSpec as P

    from mx_jax import dispatch
    from mx_jax.moe import capacity_keep

    n_dev, n_experts, n_tok, k, d, f = 8, 8, 6, 2, 8, 4
    rng = np.random.default_rng(3)
    idx = np.zeros((n_dev * n_tok, k), np.int32)
    idx[:, 0] = 0
    idx[:, 1] = 1
    idx[::3, 1] = rng.integers(2, n_experts, size=idx[::3].shape[0])  # a third of the tokens pick another second
    keep = np.ones(idx.shape, bool)
    if capacity:
        keep = np.concatenate([np.asarray(capacity_keep(jnp.asarray(idx[i * n_tok:(i + 1) * n_tok]), n_experts,
                                                        capacity)) for i in range(n_dev)])
    x = jnp.asarray(rng.standard_normal((n_dev * n_tok, d)), jnp.float32)
    g = jnp.asarray(rng.uniform(0.2, 0.8, idx.shape), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in
         ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d))]
    seen = []
    call = dispatch.ExpertFFN.run
    monkeypatch.setattr(dispatch.ExpertFFN, "run", lambda self, rows, *a, **kw: seen.append(rows.shape[0])
                        or call(self, rows, *a, **kw))
    mesh = sharding.make_mesh(MeshConfig(fsdp=1, expert=8))

    def body(x, idx, g, keep, w1, w2, w3):
        ffn = dispatch.ExpertFFN(w1, w2, w3, "bf16", "xla")
        return dispatch.dispatch_combine(x, idx, g, keep, ffn, axis="expert", method=method,
                                         gpus_per_node=gpus_per_node, capacity=capacity)[0]

    tok, wspec = P("expert"), P("expert", None, None)
    with jax.set_mesh(mesh):
        y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, tok, wspec, wspec, wspec),
                                  out_specs=tok, check_vma=False))(x, jnp.asarray(idx), g, jnp.asarray(keep), *w)
    per_sender = min(n_tok, capacity) if capacity else n_tok  # min(k, 1 expert) = 1 row per token
    if method == "flat":
        assert seen == [n_dev * per_sender]  # the worst case that counts every row: 8 x 12
    else:
        nodes = n_dev // gpus_per_node
        assert seen == [gpus_per_node * nodes * per_sender]
    ref = dispatch.dispatch_combine(x, jnp.asarray(idx), g, jnp.asarray(keep), dispatch.ExpertFFN(*w, "bf16", "xla"),
                                    axis=None)[0]
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-6)
    if capacity:
        assert not keep.all()  # the capacity dropped rows: the bound is the capacity's, not the routing's


@pytest.mark.parametrize("method", ["flat", "hierarchical"])
@pytest.mark.parametrize("routing", ["balanced", "device_0_flooded"])
def test_compact_expert_buffer_unless_a_device_receives_more(method, routing, monkeypatch):
    """8 devices, 2 experts each, top-2, 32 tokens per device: a device receives 64 rows on average and its whole
    sorted buffer has 512 rows (8 peers x 64, the worst case); buffer_factor 2 gives a compact one of 256 (128
    rounded up to the kernels' tile). Balanced routing (exactly 8 rows from every device to every device) runs the
    compact buffer everywhere; when devices 1-7 send all their rows to device 0, device 0 runs the whole buffer and
    the others the compact one. Outputs and the gradients of x, the gates and every expert weight equal the
    single-device mixture either way, and the overflow flag says which buffer each device ran."""
    from jax.sharding import PartitionSpec as P

    from mx_jax import dispatch

    n_dev, e_l, n_tok, k, d, f = 8, 2, 32, 2, 8, 4
    n_experts = n_dev * e_l
    t = np.arange(n_tok)
    idx = np.concatenate([np.stack([2 * ((dev + t) % n_dev), 2 * ((dev + t + 1) % n_dev) + 1], axis=1)
                          for dev in range(n_dev)]).astype(np.int32)
    if routing != "balanced":
        idx[n_tok:] = [0, 1]
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((n_dev * n_tok, d)), jnp.float32)
    g = jnp.asarray(rng.uniform(0.2, 0.8, idx.shape), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in
         ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d))]
    seen = set()
    sorted_ = dispatch.ExpertFFN._sorted
    monkeypatch.setattr(dispatch.ExpertFFN, "_sorted", lambda self, n_rows, *a: seen.add(n_rows)
                        or sorted_(self, n_rows, *a))
    mesh = sharding.make_mesh(MeshConfig(fsdp=1, expert=n_dev))
    assert dispatch.compact_rows(n_tok, k, 2.0) == 128

    def body(x, g, w1, w2, w3):
        ffn = dispatch.ExpertFFN(w1, w2, w3, "bf16", "xla")
        y, traffic = dispatch.dispatch_combine(x, jnp.asarray(idx).reshape(n_dev, n_tok, k)[jax.lax.axis_index(
            "expert")], g, jnp.ones((n_tok, k), bool), ffn, axis="expert", method=method, gpus_per_node=4,
            buffer_factor=2.0)
        return y, traffic["overflow"][None]

    tok, wspec = P("expert"), P("expert", None, None)
    ep = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, wspec, wspec, wspec), out_specs=(tok, tok),
                       check_vma=False)

    def loss(fn, x, g, *w):
        y, overflow = fn(x, g, *w)
        return jnp.sum(jnp.sin(y)), (y, overflow)

    def one(x, g, *w):
        y = dispatch.dispatch_combine(x, jnp.asarray(idx), g, jnp.ones(idx.shape, bool),
                                      dispatch.ExpertFFN(*w, "bf16", "xla"), axis=None)[0]
        return y, jnp.zeros((1,))

    grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5), has_aux=True)
    with jax.set_mesh(mesh):
        (_, (y, overflow)), grads = jax.jit(functools.partial(grad, ep))(x, g, *w)
    whole = 512 if method == "flat" else 2 * 4 * 64  # hierarchical: 4 local peers x 2 nodes x 64 rows per source
    assert seen == {256, whole}  # both buffers are traced; each device runs one
    np.testing.assert_array_equal(overflow, [float(routing != "balanced")] + [0.0] * (n_dev - 1))
    (_, (y_ref, _)), grads_ref = jax.jit(functools.partial(grad, one))(x, g, *w)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("routing, capacity, align, buffer_factor", [
    ("random", 0, 1, 0.0), ("random", 3, 8, 2.0), ("random", 0, 8, 2.0), ("device_0_flooded", 0, 8, 2.0),
    ("even_experts", 0, 8, 0.0)])
def test_landed_dispatch_equals_the_dense_one(routing, capacity, align, buffer_factor, monkeypatch):
    """The "land" exchange (each row pushed straight to its place in the expert device's sorted buffer, outputs
    pulled back; here its XLA reference) gives the dense exchange's outputs and the gradients of x, the gates and
    every expert weight, on 8 devices with 2 experts each: with rows dropped by a capacity (items that do not move,
    and zero rows where they come home), groups padded to a multiple of 8 (zero rows inside the buffer), in compact
    buffers, with device 0 flooded past its compact buffer (then every device runs the whole one), and with every
    odd expert empty."""
    from jax.sharding import PartitionSpec as P

    from mx_jax import dispatch
    from mx_jax.moe import capacity_keep

    n_dev, e_l, n_tok, k, d, f = 8, 2, 32, 2, 8, 4
    n_experts = n_dev * e_l
    rng = np.random.default_rng(6)
    idx = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(n_dev * n_tok)]).astype(np.int32)
    if routing == "device_0_flooded":
        idx[n_tok:] = [0, 1]
    if routing == "even_experts":
        idx = 2 * np.stack([rng.choice(n_experts // 2, k, replace=False) for _ in range(n_dev * n_tok)])
    keep = np.ones(idx.shape, bool)
    if capacity:
        keep = np.concatenate([np.asarray(capacity_keep(jnp.asarray(idx[i * n_tok:(i + 1) * n_tok]), n_experts,
                                                        capacity)) for i in range(n_dev)])
        assert not keep.all()
    x = jnp.asarray(rng.standard_normal((n_dev * n_tok, d)), jnp.float32)
    g = jnp.asarray(rng.uniform(0.2, 0.8, idx.shape), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32) for s in
         ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d))]
    landed, buffers = [], set()
    plan, land = dispatch.landing, dispatch.land
    monkeypatch.setattr(dispatch, "landing", lambda *a: landed.append(1) or plan(*a))
    monkeypatch.setattr(dispatch, "land", lambda x, p, *a: buffers.add(p.rows) or land(x, p, *a))
    mesh = sharding.make_mesh(MeshConfig(fsdp=1, expert=n_dev))

    def run(exchange):
        def body(x, idx, g, keep, w1, w2, w3):
            ffn = dispatch.ExpertFFN(w1, w2, w3, "bf16", "xla", group_align=align)
            y, traffic = dispatch.dispatch_combine(x, idx, g, keep, ffn, axis="expert", exchange_method=exchange,
                                                   a2a_impl="xla", capacity=capacity, buffer_factor=buffer_factor)
            return jnp.sum(jnp.sin(y), keepdims=True)[None], y, traffic["overflow"][None]

        tok, wspec = P("expert"), P("expert", None, None)
        f_ = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, tok, wspec, wspec, wspec),
                           out_specs=(tok, tok, tok), check_vma=False)

        def loss(x, g, *w):
            s, y, overflow = f_(x, jnp.asarray(idx), g, jnp.asarray(keep), *w)
            return jnp.sum(s), (y, overflow)

        with jax.set_mesh(mesh):
            (_, (y, overflow)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
                x, g, *w)
        return np.asarray(y), np.asarray(overflow), [np.asarray(v) for v in grads]

    y_dense, over_dense, grads_dense = run("dense")
    assert not landed
    y_land, over_land, grads_land = run("land")
    assert landed
    whole = dispatch._room(n_dev * dispatch.peer_bound(n_tok, k, e_l, capacity), e_l, align)
    # with a compact buffer smaller than the whole one both sizes are traced (the pushes land in one or the other);
    # a capacity of 3 rows per expert already makes the whole buffer small
    compact = dispatch._room(dispatch.compact_rows(n_tok, k, buffer_factor), e_l, align)
    assert buffers == ({compact, whole} if buffer_factor and not capacity else {whole}) and compact <= whole
    # land decides for every device at once (its pushes and pulls must match): all run whole buffers if one must
    np.testing.assert_array_equal(over_land, np.full_like(over_dense, over_dense.max()))
    assert over_land.any() == (routing == "device_0_flooded")
    np.testing.assert_allclose(y_land, y_dense, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads_land, grads_dense, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert np.abs(grads_land[0]).sum() > 0 and np.abs(grads_land[-1]).sum() > 0


def test_auto_lands_rows_only_where_the_row_kernel_was_verified(monkeypatch):
    """exchange "auto" takes "land" where the row kernel can run and the expert axis has at most LAND_MAX_PEERS
    devices, the dense exchange on larger axes and wherever the kernel cannot run; an explicit choice is kept (land
    where the kernel cannot run, with a warning naming why, unless the XLA path was asked for), and land is
    refused for a hierarchical stage."""
    from mx_jax import dispatch
    from pallas_kernels import row_exchange

    x = jnp.zeros((8, 16), jnp.bfloat16)
    assert dispatch.pick_exchange("auto", 2, x, "expert") == "dense"  # CPU: the kernel cannot run here
    warned = []
    monkeypatch.setattr(dispatch, "_warn_land_reference", warned.append)
    assert dispatch.pick_exchange("land", 2, x, "expert") == "land" and "GPU" in warned[0]  # forced: says why
    assert dispatch.pick_exchange("land", 2, x, "expert", impl="xla") == "land" and len(warned) == 1
    monkeypatch.setattr(row_exchange, "pallas_cover", lambda *a: None)  # as on one GPU process
    assert dispatch.pick_exchange("auto", dispatch.LAND_MAX_PEERS, x, "expert") == "land"
    assert dispatch.pick_exchange("auto", dispatch.LAND_MAX_PEERS + 1, x, "expert") == "dense"
    assert dispatch.pick_exchange("auto", 2, x, "expert", impl="xla") == "dense"
    assert dispatch.pick_exchange("land", 8, x, "expert") == "land"
    with pytest.raises(ValueError, match="flat dispatch"):
        dispatch.pick_exchange("land", 2)


def test_the_log_line_shows_the_routing():
    """The console line of an MoE run shows the max/mean expert load, and the dropped share and the share of devices
    and layers that overflowed the compact expert buffer only when they are not zero; a dense run shows none."""
    from mx_jax.train import _fmt_log

    base = {"loss": 2.5, "grad_norm": 0.5, "lr": 1e-3}
    moe = {"moe_max_over_mean_load": 1.4204, "moe_dropped_frac": 0.0, "moe_ep_overflow_frac": 0.0}
    assert "moe load max/mean 1.42" in _fmt_log(3, base | moe)
    assert "dropped" not in _fmt_log(3, base | moe) and "overflow" not in _fmt_log(3, base | moe)
    line = _fmt_log(3, base | moe | {"moe_dropped_frac": 0.0312, "moe_ep_overflow_frac": 0.25})
    assert "dropped 3.1%" in line and "ep overflow 25%" in line
    assert "moe" not in _fmt_log(3, base)


def test_expert_parallel_imbalance_is_the_busiest_devices_share():
    """moe_ep_max_over_mean: per layer, the rows of the busiest expert device's block of experts over the mean,
    averaged over layers; absent without expert parallelism."""
    from mx_jax.train import _fmt_log, _moe_metrics

    load = jnp.array([[4.0, 0, 2, 2, 1, 1, 3, 3],  # P = 2: blocks 8 and 8; P = 4: 4, 4, 2, 6
                      [10.0, 6, 0, 0, 0, 0, 0, 0]])  # P = 2: 16 and 0; P = 4: 16, 0, 0, 0
    stats = {"load": load, **{k: jnp.zeros(2) for k in ("aux_loss", "z_loss", "dropped", "ep_overflow")}}
    assert "moe_ep_max_over_mean" not in _moe_metrics(stats)
    assert float(_moe_metrics(stats, 2)["moe_ep_max_over_mean"]) == pytest.approx((1.0 + 2.0) / 2)
    m = _moe_metrics(stats, 4)
    assert float(m["moe_ep_max_over_mean"]) == pytest.approx((6 / 4 + 4.0) / 2)
    line = _fmt_log(3, {"loss": 2.5, "grad_norm": 0.5, "lr": 1e-3, **{k: float(v) for k, v in m.items()
                                                                       if k != "expert_load"}})
    assert "ep device max/mean 2.75" in line and "cross-node" not in line
    # 8 tokens of top-2 in each layer (load sums to 16); 2 and 6 rows sent to other nodes, 4 and 0 inside the node
    rows = {"rows_cross_node": jnp.array([2.0, 6.0]), "rows_intra_node": jnp.array([4.0, 0.0])}
    m = _moe_metrics({**stats, **rows}, 4, top_k=2)
    assert float(m["moe_cross_node_rows_per_token"]) == pytest.approx((2 / 8 + 6 / 8) / 2)
    assert float(m["moe_intra_node_rows_per_token"]) == pytest.approx((4 / 8 + 0) / 2)
    assert "moe_cross_node_rows_per_token" not in _moe_metrics({**stats, **rows}, 1, top_k=2)
    line = _fmt_log(3, {"loss": 2.5, "grad_norm": 0.5, "lr": 1e-3, **{k: float(v) for k, v in m.items()
                                                                       if k != "expert_load"}})
    assert "cross-node rows/token 0.50" in line


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["dense", "land"])
@pytest.mark.parametrize("routing, buffer_factor", [("skewed", 0.0), ("flooded", 1.25), ("random", 1.25)])
def test_gpu_flat_dispatch_on_the_nvlink_kernel_equals_lax_and_one_device(routing, buffer_factor, exchange):
    """One process, every local GPU on the expert axis: the flat dispatch through the NVLink kernels, the dense one
    (moves only the rows each peer is sent) or the row kernel ("land": each row straight to its sorted place, with
    groups padded to 8 rows), gives bit for bit the outputs and gradients of the dense exchange over lax.all_to_all
    moving the whole worst-case buffers, and matches the single-device mixture. Skewed: device 0's tokens all choose
    device 0's experts, so it sends its peers nothing; device 1's choose only other devices' experts. With
    buffer_factor 1.25 a device's compact expert buffer holds 768 rows (1.25 x 256 tokens x top-2, plus the
    padding's room, in 256-row tiles) beside the whole one's P x 512: flooded (every token chooses device 0's
    experts) sends device 0 P x 512 rows, which overflow it, and nothing to the others (land then runs the whole
    buffers on every device); random routing fits everywhere."""
    from jax.sharding import PartitionSpec as P

    from mx_jax import dispatch

    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs >= 2 GPUs in this process")
    n_dev, e_l, n_tok, k, d, f = len(gpus), 2, 256, 2, 512, 256
    n_experts = n_dev * e_l
    rng = np.random.default_rng(4)
    idx = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(n_dev * n_tok)]).astype(np.int32)
    if routing == "flooded":
        idx[:] = [0, 1]
    if routing == "skewed":
        idx[:n_tok] = [0, 1]  # device 0: its own two experts
        others = [e for e in range(n_experts) if e // e_l != 1]
        idx[n_tok:2 * n_tok] = [rng.choice(others, k, replace=False) for _ in range(n_tok)]  # device 1: never its own
    x = jnp.asarray(rng.standard_normal((n_dev * n_tok, d)), jnp.bfloat16)
    g = jnp.asarray(rng.uniform(0.2, 0.8, idx.shape), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.05, jnp.bfloat16) for s in
         ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d))]
    mesh = jax.make_mesh((n_dev,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))

    def run(a2a_impl, how):
        def body(x, idx, g, w1, w2, w3):
            ffn = dispatch.ExpertFFN(w1, w2, w3, "bf16", "pallas", group_align=8)
            y, traffic = dispatch.dispatch_combine(x, idx, g, jnp.ones(idx.shape, bool), ffn, axis="expert",
                                                   method="flat", exchange_method=how, a2a_impl=a2a_impl,
                                                   buffer_factor=buffer_factor)
            return jnp.sum(y.astype(jnp.float32) ** 2, keepdims=True)[None], y, traffic["overflow"][None]

        tok, wspec = P("expert"), P("expert", None, None)
        f_ = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec),
                           out_specs=(tok, tok, tok), check_vma=False)

        def loss(x, g, *w):
            s, y, overflow = f_(x, jnp.asarray(idx), g, *w)
            return jnp.sum(s), (y, overflow)

        (_, (y, overflow)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(x, g, *w)
        received = np.bincount(idx.reshape(-1) // e_l, minlength=n_dev)
        compact = dispatch.compact_rows(n_tok, k, buffer_factor)
        over = (0 < compact) & (received >= compact)
        if how == "land":
            over = np.full_like(over, over.any())
        np.testing.assert_array_equal(overflow, over.astype(np.float32))
        assert overflow.any() == (routing == "flooded")  # the routings do what the docstring says
        return np.asarray(y.astype(jnp.float32)), [np.asarray(v.astype(jnp.float32)) for v in grads]

    y_kernel, grads_kernel = run("pallas", exchange)
    y_lax, grads_lax = run("xla", "dense")
    np.testing.assert_array_equal(y_kernel, y_lax)
    for a, b in zip(grads_kernel, grads_lax):
        np.testing.assert_array_equal(a, b)
    ref = dispatch.dispatch_combine(x, jnp.asarray(idx), g, jnp.ones(idx.shape, bool),
                                    dispatch.ExpertFFN(*w, "bf16", "xla"), axis=None)[0]
    np.testing.assert_allclose(y_kernel, np.asarray(ref.astype(jnp.float32)), rtol=2e-2, atol=2e-2)
    assert np.all(np.isfinite(y_kernel)) and np.abs(grads_kernel[0]).sum() > 0


def _gpu_dispatch_grads(mesh, idx, x, g, w, ffn_impl, keep_gate_up=False, **dispatch_kwargs) -> list[np.ndarray]:
    """[y, dy/dx, dy/dg, dy/dw_gate, dy/dw_up, dy/dw_down] (float32) of sum(y^2) for dispatch_combine over the
    mesh's `expert` axis (tokens and experts split over it), with `dispatch_kwargs` passed through."""
    from jax.sharding import PartitionSpec as P

    from mx_jax import dispatch

    def body(x, idx, g, w1, w2, w3):
        ffn = dispatch.ExpertFFN(w1, w2, w3, "bf16", ffn_impl, keep_gate_up=keep_gate_up)
        y, _ = dispatch.dispatch_combine(x, idx, g, jnp.ones(idx.shape, bool), ffn, axis="expert", **dispatch_kwargs)
        return jnp.sum(y.astype(jnp.float32) ** 2, keepdims=True)[None], y

    tok, wspec = P("expert"), P("expert", None, None)
    f_ = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec), out_specs=(tok, tok),
                       check_vma=False)

    def loss(x, g, *w):
        s, y = f_(x, jnp.asarray(idx), g, *w)
        return jnp.sum(s), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(x, g, *w)
    return [np.asarray(v.astype(jnp.float32)) for v in (y, *grads)]


@pytest.mark.gpu
def test_gpu_landed_dispatch_is_bit_exact_at_deepseek_scale():
    """The row kernels at DeepSeekMoE's dims (8,192 tokens per GPU, top-6 of 32 experts per GPU, hidden 2,048,
    expert width 1,408) with Zipf-skewed routing (on 2 GPUs one expert gets 14,930 rows, the devices 53,436 and
    44,868): the "land" dispatch gives the dense exchange's outputs and gradients (lax.all_to_all) bit for bit, on
    two runs into the whole buffers and one into compact ones (1.25 x the rows a device receives on average), so
    no row lands late or unzeroed at the scale the train step runs at; and with the experts' gate and up outputs
    saved for the backward (model.moe.ep_save_gate_up) instead of computed again."""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs >= 2 GPUs in this process")
    n_dev, e_l, n_tok, k, d, f = len(gpus), 32, 8192, 6, 2048, 1408
    n_experts = n_dev * e_l
    rng = np.random.default_rng(0)
    pop = 1.0 / np.arange(1, n_experts + 1) ** 1.2
    pop = rng.permutation(pop / pop.sum())
    idx = np.stack([rng.choice(n_experts, k, replace=False, p=pop) for _ in range(n_dev * n_tok)]).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((n_dev * n_tok, d)), jnp.bfloat16)
    g = jnp.asarray(rng.uniform(0.05, 0.3, idx.shape), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.02, jnp.bfloat16) for s in
         ((n_experts, d, f), (n_experts, d, f), (n_experts, f, d))]
    mesh = jax.make_mesh((n_dev,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))

    def run(a2a_impl, how, buffer_factor=2.0, keep=False):
        return _gpu_dispatch_grads(mesh, idx, x, g, w, "pallas", keep, method="flat", exchange_method=how,
                                   a2a_impl=a2a_impl, buffer_factor=buffer_factor)

    want = run("xla", "dense")
    assert np.bincount(idx.reshape(-1)).max() > 10_000 and all(np.isfinite(v).all() for v in want)
    for factor, keep in ((2.0, False), (2.0, False), (1.25, False), (1.25, True)):
        for a, b in zip(run("pallas", "land", factor, keep), want, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["flat", "hierarchical"])
def test_gpu_ragged_exchange_equals_the_dense_one(method):
    """The ragged exchange (lax.ragged_all_to_all, chosen on GPU for groups of more than 8 peers; XLA:CPU cannot run
    it) gives the dense exchange's outputs and gradients, flat and hierarchical (2 GPUs per node, so the rail
    stage's groups are strided), with a device whose tokens all stay home."""
    gpus = jax.devices("gpu")
    n_dev = len(gpus) - len(gpus) % 2
    if n_dev < 2 or (method == "hierarchical" and n_dev < 4):
        pytest.skip(f"needs >= {2 if method == 'flat' else 4} GPUs in this process")
    e_l, n_tok, k, d, f = 2, 128, 2, 256, 128
    rng = np.random.default_rng(5)
    idx = np.stack([rng.choice(n_dev * e_l, k, replace=False) for _ in range(n_dev * n_tok)]).astype(np.int32)
    idx[:n_tok] = [0, 1]  # device 0's tokens choose its own experts
    x = jnp.asarray(rng.standard_normal((n_dev * n_tok, d)), jnp.float32)
    g = jnp.asarray(rng.uniform(0.2, 0.8, idx.shape), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32) for s in
         ((n_dev * e_l, d, f), (n_dev * e_l, d, f), (n_dev * e_l, f, d))]
    mesh = jax.make_mesh((n_dev,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpus[:n_dev])

    def run(exchange):
        y, *grads = _gpu_dispatch_grads(mesh, idx, x, g, w, "xla", method=method, gpus_per_node=2,
                                        exchange_method=exchange)
        return y, grads

    y_dense, grads_dense = run("dense")
    y_ragged, grads_ragged = run("ragged")
    np.testing.assert_allclose(y_ragged, y_dense, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_ragged, grads_dense, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert np.abs(y_dense).sum() > 0 and np.abs(grads_dense[0]).sum() > 0


def test_decode_by_index_kernel_interpreted_matches_xla():
    """With moe.impl=pallas, MoE.decode reads the experts through pallas_kernels.indexed_matmul's Mosaic-GPU kernels
    (here in GPU interpret mode on CPU) and gives the XLA expression's output. With the kernels, wide experts are
    read by index too while few are chosen twice (uniform routing's expectation)."""
    from mx_jax.moe import MoE

    cfg = load_config(None, MOE + ["model.d_model=64", "model.moe.d_expert=64", "model.moe.n_shared=1"]).model
    layers = {impl: MoE(cfg, "bf16", impl, {"w_gate": "bf16", "w_up": "bf16", "w_down": "bf16"}, rngs=nnx.Rngs(3))
              for impl in ("pallas", "xla")}
    for layer in layers.values():  # bf16 weights, as the decoder's compute copies; init_std 0.02 is too small here
        for w in (layer.w_gate, layer.w_up, layer.w_down, layer.router):
            w.value = (w.value * 20).astype(jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((1, 3, cfg.d_model)), jnp.bfloat16)
    assert layers["pallas"]._by_index_impl(3, x.dtype) == "pallas"
    assert layers["xla"]._by_index_impl(3, x.dtype) == "xla"
    assert layers["pallas"]._by_index_impl(5, x.dtype) is None  # 10 assignments > 8 experts
    wide = MoE(cfg, "bf16", "pallas", {}, rngs=nnx.Rngs(3))
    wide.expert_dims = (4096, 14336)  # Mixtral's experts (8, top-2): the kernel for 1 token and 2, not 4
    assert [wide._by_index_impl(t, x.dtype) for t in (1, 2, 4)] == ["pallas", "pallas", None]
    with compat.force_gpu_interpret_mode(compat.InterpretGPUParams()):
        got = layers["pallas"].decode(x)
    want = layers["xla"].decode(x)
    assert float(jnp.max(jnp.abs(want))) > 0.5
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2,
                               atol=2e-2 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("parts", [2, 4])
def test_hidden_split_gives_one_devices_output(parts):
    """Under moe.hidden_split each device holds every expert's slice of the hidden width and runs the layer on all
    tokens; the psum of the partial outputs gives one device's output: decoding by index (3 tokens, 6 of 8 experts'
    worth of assignments), the grouped GEMM (5 tokens) and `__call__` with its statistics. (The Mosaic-GPU
    interpreter cannot run the kernels inside a shard_map over CPU devices: it hung or aborted there.)"""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from tests.helpers import need_devices

    need_devices(parts)
    from mx_jax import moe

    cfg = load_config(None, MOE + ["model.d_model=64", "model.moe.d_expert=128", "model.moe.n_shared=1"]).model
    layer = moe.MoE(cfg, "bf16", "xla", {"w_gate": "bf16", "w_up": "bf16", "w_down": "bf16"}, rngs=nnx.Rngs(3))
    for w in (layer.w_gate, layer.w_up, layer.w_down, layer.router):
        w.value = (w.value * 20).astype(jnp.bfloat16)
    graphdef, state = nnx.split(layer)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:parts]), ("tensor",))
    specs = {"w_gate": P(None, None, "tensor"), "w_up": P(None, None, "tensor"), "w_down": P(None, "tensor", None)}

    def place(path, v):
        name = str(path[0].key) if len(path) == 2 else ""
        return jax.device_put(v, NamedSharding(mesh, specs.get(name, P())))

    split_state = jax.tree_util.tree_map_with_path(place, state)
    assert split_state["w_down"].value.addressable_shards[0].data.shape == (8, 128 // parts, 64)
    rng = np.random.default_rng(6)
    for tokens, method in [(3, "decode"), (5, "decode"), (5, "__call__")]:
        x = jnp.asarray(rng.standard_normal((1, tokens, cfg.d_model)), jnp.bfloat16)
        assert (layer._by_index_impl(tokens, x.dtype, parts) is None) == (tokens == 5)

        def run(state, x):
            out = getattr(nnx.merge(graphdef, state), method)(x)
            return out if method == "decode" else (out[0], out[1]["load"], out[1]["aux_loss"])

        want = jax.jit(run)(state, x)
        with moe.hidden_split(mesh):
            lowered = jax.jit(run).lower(split_state, x)
            got = lowered.compile()(split_state, x)
        assert "all_reduce" in lowered.as_text()  # the partial outputs' psum
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            b = np.asarray(b, np.float32)
            np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=2e-2, atol=2e-2 * np.abs(b).max())
        assert float(jnp.max(jnp.abs(jax.tree.leaves(want)[0]))) > 0.5


@pytest.mark.gpu
def test_gpu_hidden_split_runs_the_kernels_per_device():
    """On up to 2 GPUs (one where the host has one), MoE.decode under moe.hidden_split runs pallas_kernels'
    Mosaic-GPU kernels inside its shard_map, by index (2 tokens) and through the grouped GEMM (8 tokens), and gives
    the XLA path's output on one device."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mx_jax import moe

    cfg = load_config(None, MOE + ["model.d_model=256", "model.moe.d_expert=512", "model.moe.n_shared=1"]).model
    layers = {impl: moe.MoE(cfg, "bf16", impl, {"w_gate": "bf16", "w_up": "bf16", "w_down": "bf16"},
                            rngs=nnx.Rngs(3)) for impl in ("auto", "xla")}
    for layer in layers.values():
        for w in (layer.w_gate, layer.w_up, layer.w_down, layer.router):
            w.value = (w.value * 20).astype(jnp.bfloat16)
    (graphdef, state), (xla_def, xla_state) = (nnx.split(layers[i]) for i in ("auto", "xla"))
    devices = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.asarray(devices), ("tensor",))
    specs = {"w_gate": P(None, None, "tensor"), "w_up": P(None, None, "tensor"), "w_down": P(None, "tensor", None)}
    split_state = jax.tree_util.tree_map_with_path(
        lambda path, v: jax.device_put(v, NamedSharding(mesh, specs.get(str(path[0].key), P()))), state)
    rng = np.random.default_rng(7)
    for tokens in (2, 8):
        x = jnp.asarray(rng.standard_normal((1, tokens, cfg.d_model)), jnp.bfloat16)
        assert (layers["auto"]._by_index_impl(tokens, x.dtype, len(devices)) == "pallas") == (tokens == 2)
        want = jax.jit(lambda s, x: nnx.merge(xla_def, s).decode(x))(xla_state, x)
        with moe.hidden_split(mesh):
            lowered = jax.jit(lambda s, x: nnx.merge(graphdef, s).decode(x)).lower(split_state, x)
            got = lowered.compile()(split_state, x)
        assert "mosaic_gpu" in lowered.as_text()
        want = np.asarray(want, np.float32)
        assert np.abs(want).max() > 0.5
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("routing,capacity_factor,n_shared", [("random", 0.0, 1), ("crowded", 0.0, 0),
                                                             ("crowded", 1.0, 1)])
def test_decode_reads_experts_by_index_with_the_layers_values(routing, capacity_factor, n_shared):
    """MoE.decode with fine-grained experts and no more assignments than experts (3 tokens x top-2 of 8) gathers
    each assignment's expert weights instead of sorting rows (no sort in its program), and gives `__call__`'s
    output: shared experts added, and under a capacity the same drops ("crowded": every token picks experts 0 and
    1, and with capacity ceil(1.0 * 3 * 2 / 8) = 1 only the first token keeps them). More assignments, or experts
    as wide as Mixtral's, take the grouped GEMM."""
    from mx_jax.moe import MoE

    cfg = load_config(None, MOE + [f"model.moe.capacity_factor={capacity_factor}",
                                   f"model.moe.n_shared={n_shared}"]).model
    layer = MoE(cfg, "bf16", "xla", {"w_gate": "bf16", "w_up": "bf16", "w_down": "bf16"}, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 3, cfg.d_model)).astype(np.float32)
    layer.router.value = jnp.asarray(rng.standard_normal(layer.router.value.shape).astype(np.float32))
    if routing == "crowded":
        router = np.zeros(layer.router.value.shape, np.float32)
        router[0, :2] = 1.0
        layer.router.value = jnp.asarray(router)
        x[..., 0] = 4.0
    for w in (layer.w_gate, layer.w_up, layer.w_down):  # init_std 0.02 would leave the outputs near zero
        w.value = w.value * 20
    x = jnp.asarray(x)
    sorts = lambda x: re.search(r"\bsort\[", str(jax.make_jaxpr(layer.decode)(x)))  # the sort primitive
    assert not sorts(x)
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
        want, _ = jax.jit(lambda x: layer(x))(x)
        got = jax.jit(layer.decode)(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * float(jnp.max(abs(want))))
    if capacity_factor:  # tokens 1 and 2 lost both routed experts: what remains is the shared expert's output
        with jax.default_matmul_precision("highest"):
            shared = np.asarray(layer.shared(x))
        np.testing.assert_allclose(np.asarray(got)[0, 1:], shared[0, 1:], rtol=1e-5, atol=1e-6)
    wide = jnp.asarray(rng.standard_normal((1, 5, cfg.d_model)).astype(np.float32))  # 10 assignments > 8 experts
    assert sorts(wide)
    layer.expert_dims = (cfg.d_model, 1 << 22)  # as wide as Mixtral's: the grouped GEMM
    assert sorts(x)
