"""Changing the mesh never changes the math: a 2-layer model's loss and gradient norm after 3 steps are the same on
every layout; nor does splitting the batch into microbatches (gradient accumulation).

The loss alone would not show a gradient off by a constant factor (an axis that sums where it should average): AdamW's
update m / sqrt(v) and the global-norm clipping are blind to it. The gradient's norm is not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mx_jax import train
from tests.helpers import MLA, NO_IO, tiny_config

LAYOUTS = {
    "data8": ["mesh.data=8", "mesh.fsdp=1"],
    "fsdp8": ["mesh.data=1", "mesh.fsdp=8"],
    "data2_fsdp2_context2": ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("one"), "steps=3", "mesh.fsdp=1", *NO_IO)
    return train.train(cfg, devices=jax.devices()[:1]).metrics


def assert_same_step(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """The last logged step's loss and gradient norm (before clipping) agree."""
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=rtol)
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=10 * rtol)
    assert want["grad_norm"] > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_matches_single_device(layout, reference, tmp_path):
    cfg = tiny_config(tmp_path, "steps=3", *LAYOUTS[layout], *NO_IO)
    result = train.train(cfg)
    assert jax.device_count() == 8
    # fp32 everywhere: only the reduction order differs between layouts.
    assert_same_step(result.metrics, reference)
    assert 3.0 < reference["loss"] < 6.0  # a real, still-high loss after 3 steps (ln 256 = 5.55 at init)


@pytest.mark.parametrize("extra", [["model.qk_norm=true"], ["model.attention_bias=true"], MLA],
                         ids=["qk_norm", "attention_bias", "mla"])
def test_attention_variants_train_alike_on_a_data_fsdp_and_context_mesh(tmp_path, extra):
    """model.qk_norm's per-head norms, model.attention_bias's q, k, v biases and model.mla's latent attention on 8
    devices (data x fsdp x context: the sequence split in zigzag chunks, the scales and biases replicated, the
    latent matrices split like the model width) give one device's loss and gradient norm after 3 steps (fp32)."""
    over = ("steps=3", *extra, *NO_IO)
    want = train.train(tiny_config(tmp_path / "one", *over, "mesh.fsdp=1"), devices=jax.devices()[:1]).metrics
    got = train.train(tiny_config(tmp_path / "mesh", *over, "mesh.data=2", "mesh.fsdp=2", "mesh.context=2")).metrics
    assert_same_step(got, want)


def test_head_runs_vocab_parallel_where_few_tokens_share_it(tmp_path):
    """data=8 with 256 tokens per step (fewer than the 2 V = 512 where sharding.head_vocab_axes stops paying): the
    head is split on V over data, the devices all-gather their rows instead of all-reducing the head's gradient, and
    the loss after 3 steps is one device's (fp32: only the reduction order differs)."""
    import re

    from tests.helpers import lowered_train_step

    over = ("steps=3", "data.batch_size=8", *NO_IO)
    want = train.train(tiny_config(tmp_path / "one", *over, "mesh.fsdp=1"), devices=jax.devices()[:1])
    cfg = tiny_config(tmp_path / "mesh", *over, "mesh.data=8", "mesh.fsdp=1")
    got = train.train(cfg)
    assert_same_step(got.metrics, want.metrics)
    head = got.state["params"]["head"]
    assert head.addressable_shards[0].data.shape == (64, 256 // 8)
    assert got.state["opt_state"][1][0].mu["head"].sharding == head.sharding
    text = lowered_train_step(cfg, 8).compile().as_text()
    assert re.search(r"f32\[8,32,64\]\S* all-gather", text)  # the rows
    assert not re.search(r"f32\[64,(256|32)\]\S* all-reduce", text)  # and never the head's gradient


@pytest.mark.parametrize("mesh_shape, tokens, want", [
    ({"expert": 4}, 16384, ("expert",)),  # expert parallelism: one microbatch is a fraction of V = 32,000 tokens
    ({"expert": 4}, 65536, ()),  # T >= 2 V: the replicated head's all-reduce moves fewer bytes
    ({"data": 2, "expert": 2}, 16384, ("data", "expert")),
    ({"fsdp": 2, "expert": 2}, 16384, ("expert",)),  # fsdp splits the head's D; the group is expert's
    ({"fsdp": 4}, 16384, ()),  # nothing splits the tokens but not D
    ({"data": 2, "fsdp": 2}, 16384, ()),  # a data group's rows are not one block of B (data is major)
    ({"data": 3}, 16384, ()),  # 3 does not divide V
])
def test_head_vocab_axes(mesh_shape, tokens, want):
    from mx_jax import sharding

    assert sharding.head_vocab_axes(tokens, 32000, 4096, 4, mesh_shape) == want


@pytest.mark.parametrize("V", [40, 5])  # the table gradient's partials: all-gathered rows (40), all-reduced (5)
@pytest.mark.parametrize("mesh_shape, B, D", [
    ({"data": 2, "fsdp": 2, "context": 2}, 4, 16),
    ({"data": 2, "fsdp": 2, "expert": 2}, 8, 16),
    ({"fsdp": 2, "context": 4}, 2, 24),
    ({"fsdp": 4, "data": 2}, 2, 16),  # B=2: the tokens cannot take fsdp, so D is all-gathered over it
    ({"fsdp": 8}, 8, 12),  # D=12: the table cannot take fsdp; the tokens' partial gradients are summed over it
    ({"expert": 4, "data": 2}, 8, 16),  # the table whole on every device; partials summed over data x expert
])
def test_embed_lookup_is_take_on_every_mesh(mesh_shape, B, D, V):
    """sharding.embed_lookup's per-device lookup and its collectives give jnp.take's rows and table gradient, and
    the gradient sums the devices' partials the way `sparse_table_grad` picks: where some devices hold other tokens
    of the same table columns, the compiled gradient all-reduces a (V, D_l) f32 table exactly when not sparse."""
    import re

    from mx_jax import sharding
    from mx_jax.config import MeshConfig

    S = 8
    kt, kx, kw = jax.random.split(jax.random.key(B * D + V), 3)
    table = jax.random.normal(kt, (V, D), jnp.float32)
    tokens = jax.random.randint(kx, (B, S), 0, V).at[0, :3].set(3)  # a repeated token sums its rows' gradients
    w = jax.random.normal(kw, (B, S, D), jnp.float32)
    loss = lambda lookup: lambda t, x: jnp.sum(lookup(t, x) * w)
    take = lambda t, x: jnp.take(t, x, axis=0)
    want, want_grad = take(table, tokens), jax.grad(loss(take))(table, tokens)
    mesh = sharding.make_mesh(MeshConfig(**{"fsdp": 1, **mesh_shape}), jax.devices()[:8])
    with jax.set_mesh(mesh):
        t = jax.device_put(table, sharding.named(mesh, ("vocab", "embed"), table.shape))
        x = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        lookup = lambda t, x: sharding.embed_lookup(t, x, jnp.float32)
        got = jax.jit(lookup)(t, x)
        grad_fn = jax.jit(jax.grad(loss(lookup)))
        got_grad = grad_fn(t, x)
        hlo = grad_fn.lower(t, x).compile().as_text()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-6, atol=1e-6)
    if D % 8 == 0 or "context" in mesh_shape:
        want_spec = sharding.fit_spec(sharding.spec(("batch", "seq", "act_embed")), got.shape, mesh)
        assert got.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, want_spec), got.ndim)
    table_spec = sharding.fit_spec(sharding.spec(("vocab", "embed")), table.shape, mesh)
    d_l = D // int(np.prod([mesh.shape[a] for a in sharding.entry_axes(table_spec[1])]))
    token_axes = sharding.entry_axes(sharding.fit_spec(sharding.spec(("batch", "seq")), tokens.shape, mesh)[0])
    summed = [a for a in token_axes if a not in sharding.entry_axes(table_spec[1]) and mesh.shape[a] > 1]
    dense = bool(summed) and not sharding.sparse_table_grad(B * S, V, d_l, 4)
    reduced = re.search(rf"f32\[{V},{d_l}\]\S* all-reduce(-start)?\(", hlo) is not None
    assert reduced == dense, (summed, dense)


def test_params_are_sharded_as_configured(tmp_path, capsys):
    cfg = tiny_config(tmp_path, "steps=1", "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", "model.moe.n_experts=4",
                      "model.moe.top_k=2", "model.moe.d_expert=16", "model.grad_reduce_dtype=bfloat16", *NO_IO)
    state = train.train(cfg).state
    assert "mesh   | weight gradients summed across devices in bfloat16 (model.grad_reduce_dtype)" in (
        capsys.readouterr().out)
    # (L, D, H*K) with D over fsdp and expert (ZeRO-3 over both; context has size 1), replicated over data
    wq = state["params"]["blocks"]["attn"]["wq"]
    assert wq.sharding.spec[1] == ("fsdp", "expert", "context")
    assert wq.addressable_shards[0].data.shape == (2, 64 // 4, 4 * 16)
    mu = state["opt_state"][1][0].mu["blocks"]["attn"]["wq"]
    assert mu.sharding == wq.sharding


def test_fp8_operands_are_sharded_like_their_weights(tmp_path):
    """Under fp8_rowwise the state keeps each GEMM's fp8 operands (llama.compute_copies), made from the masters the
    same step wrote, with its weight's sharding (transposed for the forward operand): the dense linears' over fsdp,
    the routed experts' (whose rows suffice here: quant.expert_min_rows=0) over the expert axis, entering each
    device's shard_map body. The loss matches one device's: the operands are made from the sharded masters (amax
    over the fsdp shards) as one device makes them. (Restored runs make them with the same function: test_resume.)"""
    from mx_jax import quant
    over = ("steps=2", "quant.recipe=fp8_rowwise", "quant.expert_min_rows=0", "model.moe.n_experts=8",
            "model.moe.top_k=2", "model.moe.d_expert=16", *NO_IO)
    result = train.train(tiny_config(tmp_path / "mesh", *over, "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"))
    state = result.state
    wq = state["params"]["blocks"]["attn"]["wq"]  # (L, D, H*K), D over fsdp and expert
    ops = state["compute"]["blocks"]["attn"]["wq|wk|wv"]
    assert isinstance(ops, quant.Operands) and "wq" not in state["compute"]["blocks"]["attn"]
    (out, _), (gx, gx_scale) = ops.out, ops.grad_x
    assert out.shape == (2, 4 * 16 + 2 * 2 * 16, 64) and gx.shape == (2, 64, 128) and out.dtype == jnp.float8_e4m3fn
    d_axes = wq.sharding.spec[1]
    assert d_axes and out.sharding.spec[2] == d_axes and gx.sharding.spec[1] == d_axes
    assert gx_scale.sharding.spec[1] == d_axes and out.addressable_shards[0].data.shape == (2, 128, 64 // 4)
    # made from the masters the same step wrote (not the previous ones), as prequantize makes them
    attn = state["params"]["blocks"]["attn"]
    want = jax.jit(lambda *w: quant.prequantize(w, recipe="fp8_rowwise", compute_dtype=jnp.float32))(
        attn["wq"], attn["wk"], attn["wv"])
    for a, b in zip(jax.tree.leaves(ops), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    experts = state["compute"]["blocks"]["moe"]["w_gate"]  # (L, E, D, F) weights
    assert isinstance(experts, quant.Operands) and experts.out[0].shape == (2, 8, 16, 64)
    # the experts' axis carries fsdp too (8 experts over expert=2 x fsdp=2: sharding.param_spec), the matrices whole
    e_axes = ("expert", "fsdp", "context")
    assert experts.out[0].sharding.spec[1] == e_axes and experts.grad_x[1].sharding.spec[1] == e_axes
    assert experts.out[0].addressable_shards[0].data.shape == (2, 2, 16, 64)
    one = train.train(tiny_config(tmp_path / "one", *over, "mesh.fsdp=1"), devices=jax.devices()[:1])
    assert_same_step(result.metrics, one.metrics, rtol=1e-4)


def _step_with_accum(tmp_path, tokens: np.ndarray, extra: tuple[str, ...], keep: np.ndarray | None = None) -> dict:
    """One train step from the same initial state on the global batch `tokens` (B, T+1), for
    data.grad_accum_steps 1 and 2 (microbatches of consecutive rows, Batches.next_global's layout); `keep` (B, T):
    which targets the loss counts (the others are -1, as loss-masked data gives them).
    Returns {accum: (new state, step metrics)} and, under "init" and "load", the initial params and, for a MoE
    model, the whole batch's expert assignment counts per layer from one plain forward pass."""
    from flax import nnx

    from mx_jax import sharding

    b, t = tokens.shape[0], tokens.shape[1] - 1
    results, state = {}, None
    for accum in (1, 2):
        cfg = tiny_config(tmp_path / f"accum{accum}", "steps=4", "mesh.fsdp=1", f"data.grad_accum_steps={accum}",
                          *extra)
        mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])  # one device: the layouts are covered above
        with jax.set_mesh(mesh):
            setup = train.build(cfg, mesh)
            if state is None:  # the state does not depend on the accumulation: initialize once (compile time)
                state = train.init_state(setup)
                results["init"] = jax.tree.map(np.asarray, state["params"])
                buffers = jax.tree.map(np.asarray, state["buffers"])
                results["load"] = None
                if cfg.model.moe.n_experts:
                    model = nnx.merge(setup.graphdef, results["init"], buffers)
                    results["load"] = np.asarray(jax.jit(lambda x: model(x)[1]["load"])(jnp.asarray(tokens[:, :-1])))
            targets = tokens[:, 1:] if keep is None else np.where(keep, tokens[:, 1:], -1)
            batch = {k: jax.device_put(v.reshape(accum, b // accum, t), setup.batch_shardings[k])
                     for k, v in (("inputs", tokens[:, :-1]), ("targets", targets))}
            fresh = jax.tree.map(jnp.copy, state)  # the step donates its input state
            new, out = train.make_train_step(setup)(fresh, batch)
        results[accum] = (jax.tree.map(np.asarray, new), {k: np.asarray(v) for k, v in out.items()})
    return results


def test_grad_accumulation_with_loss_masks_weighs_every_counted_target_alike(tmp_path):
    # The first microbatch keeps 10% of its targets, the second 90%: a mean per microbatch, then over microbatches,
    # would weigh a target of the first 9 times as much as one of the second. The step divides by the whole step's
    # count, so accumulation changes nothing (the optimizer settings as in the test below).
    extra = ("optim.eps=1.0", "optim.grad_clip_norm=0", "optim.weight_decay=0", "optim.lr_peak=1.0",
             "optim.warmup_steps=0")
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, (16, 33)).astype(np.int32)
    keep = rng.random((16, 32)) < np.where(np.arange(16) < 8, 0.1, 0.9)[:, None]
    r = _step_with_accum(tmp_path, tokens, extra, keep)
    (new1, out1), (new2, out2) = r[1], r[2]
    np.testing.assert_allclose(out1["target_frac"], keep.mean(), rtol=1e-6)
    np.testing.assert_allclose(out2["loss"], out1["loss"], rtol=1e-6)
    np.testing.assert_allclose(out2["grad_norm"], out1["grad_norm"], rtol=1e-5)
    for p1, p2, p0 in zip(jax.tree.leaves(new1["params"]), jax.tree.leaves(new2["params"]), jax.tree.leaves(r["init"])):
        np.testing.assert_allclose(p2 - p0, p1 - p0, rtol=1e-4, atol=1e-4 * np.abs(p1 - p0).max())
    # the masks matter: every target counted gives another update
    full = _step_with_accum(tmp_path / "full", tokens, extra)[1]
    assert full[1]["target_frac"] == 1 and abs(full[1]["grad_norm"] - out1["grad_norm"]) > 1e-3 * out1["grad_norm"]


@pytest.mark.parametrize("extra", [
    (),
    # MoE: aux_loss_coef=0 because the Switch aux loss (E sum_e f_e P_e) is a product of batch means, so its mean
    # over microbatches is not the whole batch's; the z-loss is a mean over tokens and accumulates exactly.
    ("model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.d_expert=32", "model.moe.aux_loss_coef=0",
     "model.moe.z_loss_coef=0.01", "model.moe.bias_update_rate=0.01"),
], ids=["dense", "moe"])
def test_grad_accumulation_equals_the_whole_batch(tmp_path, extra):
    # AdamW's first step is ~ lr * sign(g) and clipping rescales g: neither would show a gradient that is off by a
    # constant factor (summed instead of averaged). With eps=1 and no clipping the update is lr * g / (|g| + 1),
    # about lr * g, so the parameter change follows the accumulated gradient itself (lr 1: the change stays far
    # above the float32 rounding of the weights it is added to).
    extra = (*extra, "optim.eps=1.0", "optim.grad_clip_norm=0", "optim.weight_decay=0", "optim.lr_peak=1.0",
             "optim.warmup_steps=0")
    tokens = np.random.default_rng(0).integers(0, 256, (16, 33)).astype(np.int32)
    r = _step_with_accum(tmp_path, tokens, extra)
    (new1, out1), (new2, out2), init, load1 = r[1], r[2], r["init"], r["load"]
    np.testing.assert_allclose(out2["loss"], out1["loss"], rtol=1e-6)
    assert 5.0 < out1["loss"] < 6.0  # ~ ln 256 at init: a real cross-entropy, not a sum over microbatches
    np.testing.assert_allclose(out2["grad_norm"], out1["grad_norm"], rtol=1e-5)
    assert out1["grad_norm"] > 0
    flat1 = jax.tree_util.tree_leaves_with_path(new1["params"])
    for (path, p1), p2, p0 in zip(flat1, jax.tree.leaves(new2["params"]), jax.tree.leaves(init), strict=True):
        where = jax.tree_util.keystr(path)
        d1, d2 = p1 - p0, p2 - p0  # the updates, compared on their own scale, not the weights'
        assert np.abs(d1).max() > 0, where
        np.testing.assert_allclose(d2, d1, rtol=1e-4, atol=1e-4 * np.abs(d1).max(), err_msg=where)
        np.testing.assert_allclose(p2, p1, rtol=1e-5, atol=1e-8, err_msg=where)
    if load1 is None:
        return
    # Expert loads: summed over the microbatches, they are the whole batch's counts. The step exposes them as the
    # per-layer share (averaged over layers) and through the router-bias update; both must equal the whole batch's.
    n_layers, top_k, n_tokens = 2, 2, 16 * 32
    assert load1.shape == (n_layers, 4) and np.all(load1.sum(-1) == n_tokens * top_k)
    want_share = np.mean(load1 / (n_tokens * top_k), axis=0)
    np.testing.assert_allclose(out1["expert_load"], want_share, rtol=1e-6)
    np.testing.assert_allclose(out2["expert_load"], want_share, rtol=1e-6)
    np.testing.assert_allclose(out2["moe_z_loss"], out1["moe_z_loss"], rtol=1e-5)
    want_bias = 0.01 * np.sign(load1.mean(-1, keepdims=True) - load1)  # DeepSeek-V3 update from zero bias
    assert np.any(want_bias != 0)
    np.testing.assert_allclose(new1["buffers"]["blocks"]["moe"]["bias"], want_bias, rtol=1e-6)
    np.testing.assert_allclose(new2["buffers"]["blocks"]["moe"]["bias"], want_bias, rtol=1e-6)


@pytest.mark.gpu
def test_gpu_scanned_layers_on_a_mesh_equal_unrolled(tmp_path):
    """On a mesh of every local GPU the scanned layers' residual buffers are per-device allocations, left
    uninitialized (compat._sharded_empty): every slice must be written before the backward reads it. The loss of 3
    steps equals the unrolled layers', which keep no stacked buffers, at full float32 GEMM precision."""
    n = jax.device_count()
    if n < 2:
        pytest.skip("needs two GPUs or more")
    losses = {}
    with jax.default_matmul_precision("highest"):
        for scan in ("true", "false"):
            cfg = tiny_config(tmp_path / scan, "steps=3", f"mesh.fsdp={n}", "model.remat=save_matmuls",
                              f"model.scan_layers={scan}", *NO_IO)
            losses[scan] = train.train(cfg).metrics["loss"]
    np.testing.assert_allclose(losses["true"], losses["false"], rtol=1e-5)
