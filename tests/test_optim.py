"""The optimizer's own pieces: the per-layer global norm and the clipping built on it, against optax."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mx_jax import optim
from mx_jax.config import OptimConfig


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"stacked": jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float32),
            "experts": jnp.asarray(rng.standard_normal((2, 4, 3, 5)), jnp.bfloat16),
            "matrix": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32),
            "scale": jnp.asarray(rng.standard_normal((9,)), jnp.float32), "scalar": jnp.float32(rng.normal())}


def test_global_norm_is_exact_on_every_leaf_rank():
    tree = _tree(0)
    want = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
    np.testing.assert_allclose(float(optim.global_norm(tree)), want, rtol=1e-6)  # bf16 leaves summed in f32


def test_clip_by_global_norm_matches_optax_below_and_above_the_threshold():
    tree = {k: v.astype(jnp.float32) for k, v in _tree(1).items()}
    norm = float(optax.tree.norm(tree))
    for max_norm in (norm / 3, norm * 2):
        ours, _ = optim.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        ref, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    clipped, _ = optim.clip_by_global_norm(norm / 3).update(tree, optax.EmptyState())
    np.testing.assert_allclose(float(optax.tree.norm(clipped)), norm / 3, rtol=1e-5)


def _tiny_params(*overrides: str) -> dict:
    from flax import nnx

    from mx_jax.config import load_config
    from mx_jax.llama import Llama, params_of
    from tests.helpers import TINY

    cfg = load_config(None, TINY + list(overrides))
    return jax.jit(lambda: params_of(Llama(cfg.model, rngs=nnx.Rngs(0))))()  # jitted: eager init is op by op


# Module docstring of optim.py: decay on "matrices that multiply activations (attention, MLP, expert and head
# weights)"; never on the embedding table or norm scales. The MoE router (x W_r, (D, E)) multiplies activations and
# is neither an embedding nor a norm, so it is decayed (README: "weight_decay (not on norms/embeddings)").
_DECAYED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "head", "router"}
_NOT_DECAYED = {"embed", "scale"}


@pytest.mark.parametrize("overrides", [
    [],  # dense: blocks (L, ...)
    ["model.moe.n_experts=4", "model.moe.n_shared=1", "model.moe.d_expert=32"],  # every layer MoE, shared experts
    # a dense first layer and groups of (dense, MoE): norm scales stacked twice, (groups, n-1, D)
    ["model.n_layers=3", "model.moe.n_experts=4", "model.moe.n_dense_first=1", "model.moe.every_n_layers=2"],
], ids=["dense", "moe", "moe_dense_first_grouped"])
def test_decay_mask_on_the_real_parameter_tree(overrides):
    params = _tiny_params(*overrides)
    mask = optim.decay_mask(params)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    mask_leaves = jax.tree.leaves(mask)
    assert len(mask_leaves) == len(leaves)
    seen = set()
    stacked_norm = False
    for (path, p), m in zip(leaves, mask_leaves, strict=True):
        name, where = path[-1].key, jax.tree_util.keystr(path)
        assert name in _DECAYED | _NOT_DECAYED, where  # a parameter this test does not know about
        assert bool(m) is (name in _DECAYED), (where, p.shape, m)
        seen.add(name)
        stacked_norm |= name == "scale" and p.ndim >= 2  # only the name keeps these out, not the rank
    assert stacked_norm
    want = {"embed", "scale", "head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    if overrides:
        want.add("router")
        expert = params["blocks"]["moe"] if "moe" in params["blocks"] else params["blocks"]["moe_block"]["moe"]
        assert expert["w_gate"].ndim == 4  # (layers or groups, E, D, F)
    assert seen == want

    # The optimizer applies it: with zero gradients AdamW's step is -lr * wd * p on decayed leaves only.
    cfg = OptimConfig(lr_peak=0.5, warmup_steps=0, weight_decay=0.1)
    opt = optim.make_optimizer(cfg, total_steps=10)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates = jax.jit(lambda g, p: opt.update(g, opt.init(p), p)[0])(zeros, params)
    for (path, p), u in zip(leaves, jax.tree.leaves(updates), strict=True):
        want_u = -0.5 * 0.1 * np.asarray(p) if path[-1].key in _DECAYED else np.zeros(p.shape)
        np.testing.assert_allclose(np.asarray(u), want_u, rtol=1e-6, atol=1e-12, err_msg=jax.tree_util.keystr(path))


def _lr_formula(s: int, peak: float, warmup: int, decay: int, r: float) -> float:
    """optim.py's module docstring, written out."""
    if s < warmup:
        return peak * (1 + (warmup - 1) * s / warmup) / warmup
    p = min(max((s - warmup) / (decay - warmup), 0.0), 1.0)
    return peak * (r + (1 - r) * (1 + math.cos(math.pi * p)) / 2)


@pytest.mark.parametrize("warmup, decay_steps, total", [
    (10, 100, 1000),  # explicit decay horizon, shorter than the run
    (10, 0, 100),  # decay_steps=0: the run's steps
    (0, 100, 100),  # no warmup: step 0 already at the peak, cosine from there
    (1, 40, 100),
])
def test_schedule_matches_the_docstring_formula(warmup, decay_steps, total):
    peak, r = 3e-3, 0.1
    cfg = OptimConfig(lr_peak=peak, lr_final_ratio=r, warmup_steps=warmup, decay_steps=decay_steps)
    decay = decay_steps or total
    lr = optim.schedule(cfg, total)
    steps = {0, max(warmup - 1, 0), warmup, warmup + 1, (warmup + decay) // 2, decay - 1, decay, decay + 7,
             2 * decay}
    for s in sorted(steps):
        want = _lr_formula(s, peak, warmup, decay, r)
        np.testing.assert_allclose(float(lr(s)), want, rtol=1e-6, err_msg=f"step {s}")
    # landmarks, by hand
    np.testing.assert_allclose(float(lr(0)), peak / warmup if warmup else peak, rtol=1e-6)
    np.testing.assert_allclose(float(lr(warmup)), peak, rtol=1e-6)
    if (decay - warmup) % 2 == 0:  # halfway through the cosine: cos(pi / 2) = 0
        np.testing.assert_allclose(float(lr((warmup + decay) // 2)), peak * (r + (1 - r) / 2), rtol=1e-6)
    np.testing.assert_allclose(float(lr(decay)), peak * r, rtol=1e-6)
    np.testing.assert_allclose(float(lr(decay + 1000)), peak * r, rtol=1e-6)


@pytest.mark.parametrize("warmup, decay_steps, total, frac", [(10, 0, 100, 0.2), (0, 200, 100, 0.5), (5, 0, 40, 1.0)])
def test_wsd_schedule_matches_the_docstring_formula(warmup, decay_steps, total, frac):
    peak, r = 2e-3, 0.05
    cfg = OptimConfig(lr_peak=peak, lr_final_ratio=r, warmup_steps=warmup, decay_steps=decay_steps,
                      schedule="wsd", cooldown_fraction=frac)
    decay = decay_steps or total
    c = max(warmup, decay - round(frac * decay))
    lr = optim.schedule(cfg, total)
    for s in range(0, decay + 5):
        if s < warmup:
            want = peak * (1 + (warmup - 1) * s / warmup) / warmup
        else:
            q = min(max((s - c) / (decay - c), 0.0), 1.0)
            want = peak * (r + (1 - r) * (1 - math.sqrt(q)))
        np.testing.assert_allclose(float(lr(s)), want, rtol=1e-6, err_msg=f"step {s}")
    assert float(lr(c)) == pytest.approx(peak) and float(lr(decay)) == pytest.approx(peak * r)
    if c > warmup:
        assert float(lr(c - 1)) == pytest.approx(peak)  # stable up to the cooldown


def test_wsd_before_its_cooldown_does_not_depend_on_the_run_length():
    cfg = OptimConfig(lr_peak=1e-3, warmup_steps=10, schedule="wsd", cooldown_fraction=0.2)
    short, long = optim.schedule(cfg, 1000), optim.schedule(cfg, 3000)
    for s in (0, 5, 10, 400, 799):  # the 1000-step run cools down from step 800
        assert float(short(s)) == float(long(s))
    assert float(short(900)) < float(long(900)) == pytest.approx(1e-3)
    cos_short, cos_long = (optim.schedule(OptimConfig(lr_peak=1e-3, warmup_steps=10), n) for n in (1000, 3000))
    assert float(cos_short(400)) != float(cos_long(400))  # a cosine schedule stretches with the run


def test_cooldown_fraction_is_checked():
    from mx_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="optim.cooldown_fraction"):
        load_config(None, ["optim.schedule=wsd", "optim.cooldown_fraction=0"])
    with pytest.raises(ConfigError, match="optim.schedule"):
        load_config(None, ["optim.schedule=linear"])


def _adamw_runs(moment_dtype: str, steps: int):
    """make_optimizer against optax.adamw (the float32 arithmetic the moments' dtype must not change) on the same
    gradients: ([(our update, our state)] per step, [optax's update per step])."""
    cfg = OptimConfig(lr_peak=1e-2, warmup_steps=2, moment_dtype=moment_dtype)
    ours = optim.make_optimizer(cfg, total_steps=10)
    ref = optax.chain(optim.clip_by_global_norm(cfg.grad_clip_norm),
                      optax.adamw(optim.schedule(cfg, 10), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, mask=optim.decay_mask))
    params = {k: v.astype(jnp.float32) for k, v in _tree(3).items()}
    s_ours, s_ref, got, want = ours.init(params), ref.init(params), [], []
    for i in range(steps):
        grads = {k: v.astype(jnp.float32) * 0.3 for k, v in _tree(10 + i).items()}
        u, s_ours = jax.jit(ours.update)(grads, s_ours, params)
        got.append((u, s_ours))
        u, s_ref = jax.jit(ref.update)(grads, s_ref, params)
        want.append(u)
    return got, want


def test_float32_moments_are_optax_adamw_exactly():
    got, want = _adamw_runs("float32", 3)
    for (u, _), w in zip(got, want, strict=True):
        for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(w), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_moments_are_stored_rounded_and_the_step_uses_them_unrounded():
    """optim.moment_dtype=bfloat16: both moments stay bf16 through jit; the first step, from zero moments, makes
    exactly optax's float32 update (it uses m' and v' before rounding) and stores them rounded to bf16; later steps
    read the rounded moments, so they differ from float32's by about bf16's precision, not more."""
    got, want = _adamw_runs("bfloat16", 4)
    (u1, state1), *_ = got
    adam = state1[1][0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert all(s[1][0].mu["matrix"].dtype == jnp.bfloat16 for _, s in got)  # still bf16 after updates
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    f32_first = _adamw_runs("float32", 1)[0][0][1][1][0]
    for mine, full in ((adam.mu, f32_first.mu), (adam.nu, f32_first.nu)):
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(full), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))
    (u4, _), w4 = got[-1], want[-1]
    for a, b in zip(jax.tree.leaves(u4), jax.tree.leaves(w4), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert not np.array_equal(a, b)  # the rounded moments are read
        np.testing.assert_allclose(a, b, rtol=0.05, atol=1e-2 * np.abs(b).max())


def test_bf16_moments_refuse_betas_they_cannot_track():
    from mx_jax.config import ConfigError, load_config

    assert load_config(None, ["optim.moment_dtype=bfloat16"]).optim.b2 == 0.95  # the default betas are fine
    with pytest.raises(ConfigError, match=r"'optim.b2'.*0.999.*moment_dtype=bfloat16"):
        load_config(None, ["optim.moment_dtype=bfloat16", "optim.b2=0.999"])
    with pytest.raises(ConfigError, match=r"'optim.b1'"):
        load_config(None, ["optim.moment_dtype=bfloat16", "optim.b1=0.998"])
    assert load_config(None, ["optim.b2=0.999"]).optim.moment_dtype == "float32"
    with pytest.raises(ConfigError, match="optim.moment_dtype"):
        load_config(None, ["optim.moment_dtype=float16"])
