"""Multi-token prediction (model.mtp; DeepSeek-V3's MTP, llama.MTPLayer): each depth's hidden states against the
definition written out in NumPy, the loss against per-depth cross-entropies computed here, the MTP MoE layer's
router bias, the same step on a mesh, fp8 operands, and the FLOP count against the parameters it touches."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mx_jax import quant, sharding, train
from mx_jax.config import ModelConfig, MoEConfig, MTPConfig
from mx_jax.layers import Positions, rope_inv_freq
from mx_jax.llama import Block, Llama, flops_per_token, mtp_targets, params_of
from tests.helpers import NO_IO, tiny_config

MOE = ("model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.d_expert=32", "model.moe.n_shared=1",
       "model.moe.bias_update_rate=0.01")


def _rms(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def test_each_depth_is_the_definition():
    """h_0 = RMSNorm(x_L), the main model's last hidden states; depth k: h_k = RMSNorm_k(Block_k(u)) with
    u = [RMSNorm_e(E[t_{i+k}]); RMSNorm_h(h_{k-1})] W_eh (token 0 where i + k is past the end). With the head
    [I | 0] (V >= D) the first D logits of each output are the h the head read, so the model's own outputs give
    every h; norms with random scales so that a swapped or missing norm shows."""
    D, V, T = 32, 64, 12
    cfg = ModelConfig(vocab_size=V, d_model=D, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, compute_dtype="float32",
                      mtp=MTPConfig(depth=2))
    model = Llama(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    params = jax.tree.map(np.asarray, params_of(model))
    params["head"] = np.eye(D, V, dtype=np.float32)
    for name in ("enorm", "hnorm", "norm"):
        params["mtp"][name]["scale"] = rng.uniform(0.5, 2.0, (2, D)).astype(np.float32)
    params["final_norm"]["scale"] = rng.uniform(0.5, 2.0, D).astype(np.float32)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    tokens = jnp.asarray(rng.integers(0, V, (2, T)), jnp.int32)
    with jax.default_matmul_precision("highest"):  # float32 GEMMs on a GPU too
        logits, _, ahead = model(tokens, mtp=True)
        np.testing.assert_array_equal(model(tokens)[0], logits)  # the main logits do not depend on mtp
    assert len(ahead) == 2 and all(z.shape == (2, T, V) for z in ahead)
    h = np.asarray(logits[..., :D])
    assert np.all(np.asarray(logits[..., D:]) == 0)
    block = Block(cfg, model.plan, "auto", rngs=nnx.Rngs(1))
    pos, inv_freq = Positions(jnp.arange(T)), rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
    embed = params["embed"]
    for k in (1, 2):
        layer = jax.tree.map(lambda a, k=k: a[k - 1], params["mtp"])
        ahead_ids = np.concatenate([np.asarray(tokens)[:, k:], np.zeros((2, k), np.int32)], axis=1)
        u = np.concatenate([_rms(embed[ahead_ids], layer["enorm"]["scale"], cfg.norm_eps),
                            _rms(h, layer["hnorm"]["scale"], cfg.norm_eps)], axis=-1) @ layer["eh_proj"]
        block_state = nnx.state(block, nnx.Param)
        nnx.replace_by_pure_dict(block_state, layer["block"])
        nnx.update(block, block_state)
        with jax.default_matmul_precision("highest"):
            y, _ = block(jnp.asarray(u), pos, inv_freq)
        want = _rms(np.asarray(y), layer["norm"]["scale"], cfg.norm_eps)
        got = np.asarray(ahead[k - 1][..., :D])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        h = got
    with pytest.raises(ValueError, match=r"model\.mtp\.depth > 0"):
        Llama(dataclasses.replace(cfg, mtp=MTPConfig()), rngs=nnx.Rngs(0))(tokens, mtp=True)


def test_mtp_targets_look_k_ahead():
    targets = jnp.asarray([[1, 2, -1, 4, 5]])
    np.testing.assert_array_equal(mtp_targets(targets, 1), [[2, -1, 4, 5, -1]])
    np.testing.assert_array_equal(mtp_targets(targets, 3), [[4, 5, -1, -1, -1]])


def _setup(tmp_path, *extra: str):
    cfg = tiny_config(tmp_path, "mesh.fsdp=1", *extra, *NO_IO)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    return cfg, mesh


def test_the_loss_adds_loss_scale_times_the_mean_of_each_depths_cross_entropy(tmp_path):
    """loss = CE + lambda / D sum_k CE_k, CE_k over the targets k ahead that count (loss masks carry over), each sum
    divided by the step's count of main targets; the held-out loss (mtp=False) is CE alone. The model's MoE
    statistics hold its MTP layers after the main ones, and the step's router-bias update moves each one's bias by
    the sign of its own load error."""
    cfg, mesh = _setup(tmp_path, "model.mtp.depth=2", "model.mtp.loss_scale=0.5", *MOE)
    rng = np.random.default_rng(0)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    inputs = rng.integers(0, 256, (b, t)).astype(np.int32)
    targets = np.where(rng.random((b, t)) < 0.8, rng.integers(0, 256, (b, t)), -1).astype(np.int32)
    count = float(np.sum(targets >= 0))
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        state = train.init_state(setup)
        params, buffers = state["params"], state["buffers"]
        loss, (ce, stats, mtp_ce) = jax.jit(train.make_loss_fn(setup))(params, buffers, inputs, targets, count)
        logits, stats2, ahead = jax.jit(
            lambda p, bu, x: nnx.merge(setup.graphdef, p, bu)(x, logits_dtype=jnp.float32, mtp=True))(
            params, buffers, inputs)
        held_out = jax.jit(train.make_loss_fn(setup, mtp=False))(params, buffers, inputs, targets, count)

    def ce_of(z, y):
        z = np.asarray(z, np.float64)
        logz = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
        picked = np.take_along_axis(z, np.maximum(y, 0)[..., None], -1)[..., 0]
        return np.sum(np.where(y >= 0, logz - picked, 0.0)) / count

    per_depth = []
    for k, z in enumerate(ahead, 1):
        y = np.full_like(targets, -1)
        y[:, :t - k] = targets[:, k:]
        per_depth.append(ce_of(z, y))
    np.testing.assert_allclose(ce, ce_of(logits, targets), rtol=1e-5)
    np.testing.assert_allclose(mtp_ce, per_depth, rtol=1e-5)
    moe = cfg.model.moe.aux_loss_coef * np.sum(stats["aux_loss"])
    np.testing.assert_allclose(loss, ce + 0.5 * np.mean(per_depth) + moe, rtol=1e-5)
    assert 4.0 < min(per_depth) and abs(per_depth[0] - per_depth[1]) > 1e-6  # real, distinct cross-entropies
    # without the MTP module its MoE layer's balancing term goes too
    np.testing.assert_allclose(held_out[0], ce + cfg.model.moe.aux_loss_coef * np.sum(stats["aux_loss"][:2]),
                               rtol=1e-5)
    assert held_out[1][2].shape == (0,)  # no MTP term
    assert stats["load"].shape == (4, 4)  # 2 main MoE layers, then the 2 MTP modules'
    np.testing.assert_array_equal(stats["load"], stats2["load"])

    with jax.set_mesh(mesh):
        step = train.make_train_step(setup)
        batch = {"inputs": inputs[None], "targets": targets[None]}
        new, out = step(jax.tree.map(jnp.copy, state), jax.device_put(batch, setup.batch_shardings))
    load = np.asarray(stats["load"])
    want = 0.01 * np.sign(load.mean(-1, keepdims=True) - load)
    assert np.any(want[2:] != 0)
    np.testing.assert_allclose(new["buffers"]["blocks"]["moe"]["bias"], want[:2], rtol=1e-6)
    np.testing.assert_allclose(new["buffers"]["mtp"]["block"]["moe"]["bias"], want[2:], rtol=1e-6)
    np.testing.assert_allclose(out["mtp_loss"], np.mean(per_depth), rtol=1e-5)  # the log's, and each module's
    np.testing.assert_allclose([out["mtp_loss/1"], out["mtp_loss/2"]], per_depth, rtol=1e-5)
    grads_moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                               new["params"]["mtp"], state["params"]["mtp"])
    assert min(jax.tree.leaves(grads_moved)) > 0  # every MTP parameter is trained


def test_an_mtp_moe_model_trains_alike_on_an_expert_fsdp_and_context_mesh(tmp_path):
    """The MTP module's shifted tokens (a global shift of the sequence, split over context in zigzag chunks), its
    MoE layer (experts split over expert) and its router bias give one device's loss, MTP loss, gradient norm and
    biases after 3 steps (fp32)."""
    over = ("steps=3", "model.mtp.depth=1", *MOE, *NO_IO)
    one = train.train(tiny_config(tmp_path / "one", *over, "mesh.fsdp=1"), devices=jax.devices()[:1])
    many = train.train(tiny_config(tmp_path / "mesh", *over, "mesh.expert=2", "mesh.fsdp=2", "mesh.context=2"))
    for k in ("loss", "mtp_loss"):
        np.testing.assert_allclose(many.metrics[k], one.metrics[k], rtol=1e-5)
    np.testing.assert_allclose(many.metrics["grad_norm"], one.metrics["grad_norm"], rtol=1e-4)
    bias = [np.asarray(r.state["buffers"]["mtp"]["block"]["moe"]["bias"]) for r in (one, many)]
    assert np.abs(bias[0]).max() > 0
    np.testing.assert_allclose(bias[1], bias[0], atol=1e-6)


def test_fp8_recipes_prequantize_the_mtp_projection(tmp_path):
    """Under fp8_rowwise W_eh (2D, D) is an "mlp" linear: its fp8 operands are made at the update with the block's,
    and the step trains (CPU: the reference GEMMs)."""
    cfg = tiny_config(tmp_path, "steps=2", "mesh.fsdp=1", "model.mtp.depth=1", "quant.recipe=fp8_rowwise",
                      "quant.impl=reference", "model.compute_dtype=bfloat16", *NO_IO)
    result = train.train(cfg, devices=jax.devices()[:1])
    compute = result.state["compute"]["mtp"]
    assert isinstance(compute["eh_proj"], quant.Operands)
    assert compute["eh_proj"].out[0].shape == (1, 64, 128) and compute["eh_proj"].out[0].dtype == jnp.float8_e4m3fn
    assert isinstance(compute["block"]["mlp"]["w_gate|w_up"], quant.Operands)
    assert np.isfinite(result.metrics["loss"]) and np.isfinite(result.metrics["mtp_loss"])


def test_flops_per_token_count_each_depths_matrices_and_head():
    """Each MTP depth adds 6 x (its matrices: W_eh, the block's, the head) + its causal attention, 3 T H (K + K)."""
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    with_mtp = dataclasses.replace(cfg, mtp=MTPConfig(depth=2))
    mtp = params_of(nnx.eval_shape(lambda: Llama(with_mtp, rngs=nnx.Rngs(0))))["mtp"]
    matrices = sum(a.size for a in jax.tree.leaves(mtp) if a.ndim == 3) // 2  # per depth, norms left out
    per_depth = 6 * (matrices + 32 * 96) + 3 * 128 * 4 * (8 + 8)
    assert flops_per_token(with_mtp, 128) - flops_per_token(cfg, 128) == pytest.approx(2 * per_depth)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_decoding_path_of_the_mtp_module_is_the_training_forwards(moe):
    """decode_hidden then decode_mtp over a whole sequence (teacher-forced: the token after each position) give the
    training forward's MTP logits, the keys and values going through the MTP module's own cache."""
    from mx_jax.llama import init_cache

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, compute_dtype="float32",
                      mtp=MTPConfig(depth=1), **({"moe": MoEConfig(n_experts=4, top_k=2, d_expert=16)} if moe else {}))
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
    with jax.default_matmul_precision("highest"):
        logits, _, (want,) = model(tokens, mtp=True)
        cache = init_cache(cfg, 2, 16, jnp.float32, mtp=True)
        first = jnp.zeros(2, jnp.int32)
        h, cache = model.decode_hidden(tokens, cache, jnp.int32(0), first)
        ahead = jnp.concatenate([tokens[:, 1:], jnp.zeros((2, 1), jnp.int32)], axis=1)  # as the forward pads
        g, cache = model.decode_mtp(ahead, h, cache, jnp.int32(0), first)
        np.testing.assert_allclose(model.head_logits(h), logits, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(model.head_logits(g), want, rtol=1e-4, atol=1e-5)
    assert np.abs(np.asarray(cache["mtp"].k[0, :, :12])).max() > 0 and not np.any(cache["mtp"].k[0, :, 12:])


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_speculative_decoding_draws_the_models_greedy_tokens(tmp_path, moe):
    """A speculative Decoder keeps a draft only where the model would have drawn it: its tokens are the plain
    Decoder's greedy ones, for a batch of prompts of different lengths whose rows keep different numbers of drafts
    and so advance apart. The head is zero but for tokens 1-3, so that the model's and the MTP module's argmax agree
    often and not always: drafts are kept and rejected within one run, through the caches of both."""
    from mx_jax import sample

    cfg, mesh = _setup(tmp_path, "model.mtp.depth=1", *(MOE if moe else ()))
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        state = train.init_state(setup)
        head = np.zeros(state["params"]["head"].shape, np.float32)
        head[:, 1:4] = np.random.default_rng(0).standard_normal((head.shape[0], 3))
        params = {**state["params"], "head": jnp.asarray(head)}
        plain = sample.Decoder(setup, params, state["buffers"], temperature=0.0)
        speculative = sample.Decoder(setup, params, state["buffers"], temperature=0.0, speculative=True)
        prompts = [np.random.default_rng(seed).integers(0, 256, n).tolist() for seed, n in ((0, 12), (1, 5), (2, 9))]
        stats: dict = {}
        got = speculative.run(prompts, 40, stats=stats)
        np.testing.assert_array_equal(got, plain.run(prompts, 40))
        for prompt, row in zip(prompts, got):  # and each row as it decodes alone
            np.testing.assert_array_equal(speculative.run([prompt], 40), row[None])
    assert 0 < stats["accepted"] < stats["proposals"]  # drafts kept and rejected
    assert stats["tokens"] == stats["proposals"] + stats["accepted"] >= 3 * 39


def test_cli_speculative_decoding(tmp_path, capsys):
    """`sample --speculative` prints the sample and how many drafts were kept; what it cannot do is named."""
    from mx_jax import sample
    from tests.helpers import NO_EVAL

    run = tmp_path / "run"
    train.train(tiny_config(run, "steps=2", "mesh.fsdp=1", "model.mtp.depth=1", NO_EVAL), devices=jax.devices()[:1])
    assert sample.main([str(run), "--speculative", "--temperature", "0", "--tokens", "12", "--prompt", "x = "]) == 0
    out = capsys.readouterr()
    assert out.out.count("----- sample") == 1 and "1 x 12 tokens" in out.err and "drafts kept:" in out.err
    assert sample.main([str(run), "--speculative", "--tokens", "12", "--top-k", "5", "--num", "3"]) == 0  # sampled
    out = capsys.readouterr()
    assert out.out.count("----- sample") == 3 and "drafts kept:" in out.err
    for flags, message in ((["--speculative", "--choices", str(run / "config.yaml")], "it does not go with --choices"),
                           (["--speculative", "--temperature", "0", "model.mtp.depth=0"],
                            "this run's model has none (model.mtp.depth=0)")):
        assert sample.main([str(run), *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags


def test_speculative_choice_keeps_the_models_distribution():
    """The kept token is distributed as p whatever the draft distribution q: 200,000 rows, each a draft drawn from
    its q, against p (a chi-square bound far in the tail), for q far from p, q = p and one-hot (greedy) p and q."""
    from mx_jax.sample import speculative_choice

    rng = np.random.default_rng(0)
    n, v = 200_000, 6
    p = rng.dirichlet(np.ones(v))
    for q in (rng.dirichlet(np.ones(v) * 0.3), p, np.eye(v)[2]):
        d = rng.choice(v, size=n, p=q)
        tok, kept = speculative_choice(jax.random.key(1), jnp.tile(jnp.asarray(p, jnp.float32), (n, 1)),
                                       jnp.tile(jnp.asarray(q, jnp.float32), (n, 1)), jnp.asarray(d, jnp.int32))
        counts = np.bincount(np.asarray(tok), minlength=v)
        chi2 = np.sum((counts - n * p) ** 2 / (n * p))
        assert chi2 < 40, (q, counts / n, p)  # 5 degrees of freedom: P(chi2 > 40) < 1e-6
        np.testing.assert_allclose(np.mean(np.asarray(kept)), np.sum(np.minimum(p, q)), atol=0.005)
    hot = np.eye(v, dtype=np.float32)
    tok, kept = speculative_choice(jax.random.key(2), jnp.asarray(hot[[1, 4]]), jnp.asarray(hot[[1, 2]]),
                                   jnp.asarray([1, 2], jnp.int32))
    assert tok.tolist() == [1, 4] and kept.tolist() == [True, False]  # greedy: the draft where it is the argmax


def test_speculative_sampling_repeats_with_its_seed(tmp_path):
    """At a temperature the drafts are verified by `speculative_choice`: the same seed draws the same tokens, another
    seed others, all below the tokenizer's vocabulary limit."""
    from mx_jax import sample

    cfg, mesh = _setup(tmp_path, "model.mtp.depth=1")
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        state = train.init_state(setup)
        decoder = sample.Decoder(setup, state["params"], state["buffers"], temperature=1.0, top_k=20, vocab_limit=100,
                                 speculative=True)
        prompts = [[5, 6, 7], [8]]
        one, two = (decoder.run(prompts, 30, seed=s) for s in (0, 1))
        np.testing.assert_array_equal(decoder.run(prompts, 30, seed=0), one)
    assert one.shape == two.shape == (2, 30) and not np.array_equal(one, two)
    assert one.max() < 100 and two.max() < 100


def test_speculative_decoding_split_over_devices_draws_what_one_does(tmp_path):
    """--devices 2 --speculative: the MTP module's weights and cache split like the model's, the same greedy tokens
    as one device (a MoE model: its experts in shard_map, the MTP module's too)."""
    from mx_jax import sample
    from tests.helpers import need_devices

    need_devices(2)
    cfg, mesh = _setup(tmp_path, "model.mtp.depth=1", *MOE)
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        state = train.init_state(setup)
        head = np.zeros(state["params"]["head"].shape, np.float32)
        head[:, 1:4] = np.random.default_rng(0).standard_normal((head.shape[0], 3))
        params = jax.tree.map(np.asarray, {**state["params"], "head": jnp.asarray(head)})
        buffers = jax.tree.map(np.asarray, state["buffers"])
        prompts = [[5, 6, 7, 8], [9, 10]]
        want = sample.Decoder(setup, params, buffers, temperature=0.0, speculative=True).run(prompts, 24)
    split = sample.tensor_parallel(setup, jax.devices()[:2])
    with sample.moe.hidden_split(split.mesh):
        placed = jax.tree.map(jax.device_put, params, split.params)
        decoder = sample.Decoder(setup, placed, jax.tree.map(jax.device_put, buffers, split.buffers), temperature=0.0,
                                 cache_sharding=split.cache, speculative=True)
        np.testing.assert_array_equal(decoder.run(prompts, 24), want)
        assert decoder._cache(2, 128, True)["mtp"].k.sharding.spec[-2] == "tensor"
