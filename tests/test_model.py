"""The model's pieces against independent NumPy formulations, and the pinned sharding of every parameter."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mx_jax import sharding
from mx_jax.config import MeshConfig, ModelConfig, RopeScaling
from mx_jax.layers import Positions, apply_rope, causal_attention, rope_inv_freq
from mx_jax.llama import Llama, param_axes


def test_rope_llama31_scaling_matches_formula():
    k, theta = 128, 500000.0
    sc = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192)
    got = np.asarray(rope_inv_freq(k, theta, sc), np.float64)
    inv = 1.0 / theta ** (np.arange(0, k, 2) / k)
    expected = []
    for f in inv:  # Meta's reference loop (llama3 `apply_scaling`)
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            expected.append(f)
        elif wavelen > 8192 / 1.0:
            expected.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - smooth) * f / 8.0 + smooth * f)
    np.testing.assert_allclose(got, expected, rtol=2e-6)
    assert not np.allclose(got, inv)  # scaling changed the low frequencies


def test_rope_yarn_scaling_matches_formula():
    """YaRN (arXiv 2309.00071, transformers' `_compute_yarn_parameters`): per frequency the share r of
    interpolation ramps from 0 below the dimension turning beta_fast times over the original context to 1 above the
    one turning beta_slow times; Qwen2.5's 128k recipe (factor 4 over 32,768) on a 128-dim head."""
    from mx_jax.layers import rope_attention_factor

    k, theta, original = 128, 1e6, 32768
    sc = RopeScaling(kind="yarn", factor=4.0, original_max_len=original)
    got = np.asarray(rope_inv_freq(k, theta, sc), np.float64)
    inv = 1.0 / theta ** (np.arange(0, k, 2) / k)
    turns = original * inv / (2 * math.pi)  # rotations of each frequency over the original context
    dim = lambda r: k * math.log(original / (r * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = math.floor(dim(32.0)), math.ceil(dim(1.0))
    ramp = np.clip((np.arange(k // 2) - low) / (high - low), 0, 1)
    np.testing.assert_allclose(got, inv * (1 - ramp) + inv / 4.0 * ramp, rtol=2e-6)
    np.testing.assert_allclose(got[turns > 32], inv[turns > 32], rtol=2e-6)  # fast ones kept
    np.testing.assert_allclose(got[turns < 1], inv[turns < 1] / 4, rtol=2e-6)  # slow ones interpolated
    assert 0 < low < high < k // 2  # all three bands present
    assert rope_attention_factor(sc) == pytest.approx(0.1 * math.log(4.0) + 1)
    assert rope_attention_factor(RopeScaling(kind="yarn", factor=4.0, attention_factor=1.5)) == 1.5
    assert rope_attention_factor(RopeScaling(factor=8.0)) == 1.0  # llama3: none


def test_rope_rotates_pairs_and_keeps_norm():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    pos = np.arange(5)
    inv = np.asarray(rope_inv_freq(8, 10000.0, RopeScaling()))
    y = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(inv)))
    ang = pos[:, None] * inv[None, :]
    x1, x2 = x[..., :4], x[..., 4:]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    np.testing.assert_allclose(y, np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def _naive_gqa(q, k, v):
    b, t, h, d = q.shape
    g = k.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for head in range(h):
        kv = head // (h // g)
        s = q[:, :, head] @ k[:, :, kv].transpose(0, 2, 1) / math.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, head] = (p / p.sum(-1, keepdims=True)) @ v[:, :, kv]
    return out


def test_gqa_causal_attention_matches_naive():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 16, 4, 8))
    k, v = rng.standard_normal((2, 2, 16, 2, 8))
    got = causal_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), impl="xla")
    np.testing.assert_allclose(np.asarray(got), _naive_gqa(q, k, v), rtol=1e-4, atol=1e-5)


def test_every_parameter_has_its_pinned_partition_spec():
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    specs = jax.tree.map(sharding.spec, param_axes(model), is_leaf=lambda x: isinstance(x, tuple))
    fc = ("fsdp", "expert", "context")  # ZeRO-3 over fsdp and expert; context never duplicates weight memory
    assert specs == {
        "embed": P(None, fc),
        "head": P(fc, None),
        "final_norm": {"scale": P(None)},
        "blocks": {
            "attn_norm": {"scale": P(None, None)},
            "mlp_norm": {"scale": P(None, None)},
            "attn": {"wq": P(None, fc, None), "wk": P(None, fc, None), "wv": P(None, fc, None),
                     "wo": P(None, None, fc)},
            "mlp": {"w_gate": P(None, fc, None), "w_up": P(None, fc, None), "w_down": P(None, None, fc)},
        },
    }


def test_qk_norm_normalizes_each_heads_query_and_key_before_rope():
    """model.qk_norm (Qwen3): q and k of every head divided by their RMS over the head dimension and scaled by the
    layer's (K,) scales, then rotated; the scales are replicated parameters that get gradients."""
    from mx_jax.layers import Attention

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=48,
                      qk_norm=True, compute_dtype="float32", norm_eps=1e-6)
    attn = Attention(cfg, dict.fromkeys(("wq", "wk", "wv", "wo"), "bf16"), "auto", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    s_q, s_k = (1 + 0.5 * rng.standard_normal(16)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    attn.q_norm.scale[...], attn.k_norm.scale[...] = jnp.asarray(s_q), jnp.asarray(s_k)
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    inv_freq = rope_inv_freq(16, cfg.rope_theta, cfg.rope_scaling)
    q, k, v = attn._qkv(jnp.asarray(x), Positions(jnp.arange(8)), inv_freq)

    def by_hand(w, scale, heads):
        h = (x.astype(np.float64) @ np.asarray(w[...], np.float64)).reshape(2, 8, heads, 16)
        h = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6) * scale
        return np.asarray(apply_rope(jnp.asarray(h, jnp.float32), jnp.arange(8), inv_freq))

    np.testing.assert_allclose(np.asarray(q), by_hand(attn.wq, s_q, 4), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(k), by_hand(attn.wk, s_k, 2), rtol=1e-4, atol=1e-5)
    model = Llama(cfg, rngs=nnx.Rngs(1))
    specs = jax.tree.map(sharding.spec, param_axes(model), is_leaf=lambda x: isinstance(x, tuple))
    assert specs["blocks"]["attn"]["q_norm"] == {"scale": P(None, None)}
    tokens = jnp.asarray(rng.integers(0, 64, (2, 8)))
    grads = nnx.grad(lambda m: jnp.sum(m(tokens)[0] ** 2))(model)
    for name in ("q_norm", "k_norm"):
        g = np.asarray(getattr(grads.blocks.attn, name).scale[...])
        assert g.shape == (2, 16) and np.all(np.abs(g).sum(-1) > 0), name


@pytest.mark.parametrize("mesh_shape,want_e,want_f", [
    ({"fsdp": 2}, ("expert", "fsdp", "context"), None),  # whole matrices, split over the experts
    ({"data": 2, "fsdp": 2, "expert": 2}, ("expert", "fsdp", "context"), None),
    ({"fsdp": 4, "context": 2}, ("expert", "fsdp", "context"), None),
    ({"fsdp": 16}, "expert", ("fsdp", "context")),  # 8 experts do not divide over 16: the hidden dim keeps fsdp
])
def test_expert_weights_put_fsdp_on_the_expert_axis_where_it_divides(mesh_shape, want_e, want_f):
    """sharding.param_spec: a routed expert weight (E, D, F) and its per-row scales take fsdp and context on E when
    they all divide it (an all-gather along the major axis into the MoE layer); dense weights keep `spec`."""
    from jax.sharding import AbstractMesh, AxisType

    shape = {a: mesh_shape.get(a, 1) for a in sharding.MESH_AXES}
    mesh = AbstractMesh(tuple(shape.values()), tuple(shape.keys()), axis_types=(AxisType.Auto,) * 4)
    assert sharding.param_spec(("layers", "expert", None, "expert_mlp"), (2, 8, 64, 128), mesh) == P(
        None, want_e, None, want_f)
    assert sharding.param_spec(("layers", "expert", "expert_mlp", None), (2, 8, 128, 64), mesh) == P(
        None, want_e, want_f, None)
    assert sharding.param_spec(("layers", "expert", None), (2, 8, 64), mesh) == P(None, want_e, None)  # a scale
    dense = ("layers", "embed", "q_heads")
    assert sharding.param_spec(dense, (2, 64, 128), mesh) == sharding.fit_spec(sharding.spec(dense), (2, 64, 128), mesh)


def test_mesh_errors_name_the_problem():
    from mx_jax.config import ConfigError
    with pytest.raises(ConfigError, match="mesh"):
        sharding.make_mesh(MeshConfig(data=3, fsdp=1))
    with pytest.raises(ConfigError, match="mesh.fsdp"):
        sharding.make_mesh(MeshConfig(data=3, fsdp=-1))
    n = len(jax.devices())  # CPU: more devices than there are says how to get fake ones
    with pytest.raises(ConfigError, match=f"xla_force_host_platform_device_count={2 * n} gives {2 * n} devices"):
        sharding.make_mesh(MeshConfig(data=2 * n, fsdp=1))


def _naive_cross_entropy(logits, targets):
    z = logits.astype(jnp.float32)
    return jnp.mean(jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, targets[..., None], -1)[..., 0])


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_cross_entropy_custom_vjp_matches_autodiff(dtype, tol):
    from mx_jax.llama import cross_entropy
    rng = np.random.default_rng(3)
    z = rng.standard_normal((2, 7, 50)) * 3
    z[0, 0, 5] = 40.0  # an outlier logit: the softmax must stay finite
    logits = jnp.asarray(z, dtype)
    targets = jnp.asarray(rng.integers(0, 50, (2, 7)), jnp.int32)
    loss, grad = jax.value_and_grad(cross_entropy)(logits, targets)
    ref_loss, ref_grad = jax.value_and_grad(_naive_cross_entropy)(logits, targets)
    assert grad.dtype == dtype and loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(ref_grad, np.float32), rtol=tol, atol=tol / 50)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_rowwise"])
def test_fused_projection_equals_separate_linears(recipe):
    from mx_jax.layers import fused_linear, linear
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.float32 if recipe == "bf16" else jnp.bfloat16)
    ws = tuple(nnx.Param(jnp.asarray(rng.standard_normal((32, n)) / 6, jnp.float32)) for n in (64, 16, 16))
    impl = "reference"

    def fused(x, *w):
        return fused_linear(x, tuple(nnx.Param(a) for a in w), (recipe,) * 3, impl)

    def separate(x, *w):
        return tuple(linear(x, nnx.Param(a), recipe, impl) for a in w)

    got, want = fused(x, *(w[...] for w in ws)), separate(x, *(w[...] for w in ws))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        # Forward: rowwise scales are per row of x and per column of w, both unchanged by the concatenation, so
        # only the GEMM's summation order (blocking by N) may differ.
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-5, atol=1e-5)
    cot = tuple(jnp.asarray(rng.standard_normal(w.shape), w.dtype) for w in want)
    g_fused = jax.vjp(fused, x, *(w[...] for w in ws))[1](cot)
    g_sep = jax.vjp(separate, x, *(w[...] for w in ws))[1](cot)
    tol = 1e-5 if recipe == "bf16" else 0.1  # fp8 grad-input rows share one scale across the fused outputs
    for a, b in zip(g_fused, g_sep):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


def _assert_scan_equals_loop(remat: str):
    """A 3-layer float32 model's loss and gradients, scanned and unrolled, agree on the default device; returns the
    scanned model's jitted value_and_grad and its parameters."""
    import dataclasses
    from mx_jax.llama import cross_entropy
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64,
                      compute_dtype="float32", remat=remat)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 16)), jnp.int32)

    def loss_and_grads(c):
        model = Llama(c, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            logits, _ = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
            return cross_entropy(logits, tokens[:, 1:])

        fn = jax.jit(jax.value_and_grad(loss))
        return fn, params, fn(params)

    fn, params, (l_scan, g_scan) = loss_and_grads(cfg)
    _, _, (l_loop, g_loop) = loss_and_grads(dataclasses.replace(cfg, scan_layers=False))
    np.testing.assert_allclose(float(l_loop), float(l_scan), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_loop), jax.tree.leaves(g_scan)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    return fn, params


@pytest.mark.parametrize("remat", ["none", "save_matmuls"])
def test_unrolled_layers_equal_scanned_layers(remat):
    fn, params = _assert_scan_equals_loop(remat)
    # The scan's stacked residuals are allocated, not zero-filled (compat.uninitialize_scan_outputs). On one device
    # the forward loop's outputs are AllocateBuffer custom calls in the CUDA lowering. On a multi-device mesh a bare
    # AllocateBuffer would stay whole on every device (the partitioner cannot split it: the full 8B on 4 x H200 held
    # 98 GiB of temporaries instead of 31), so there each is a custom_partitioning op, expanded by the partitioner.
    def cuda_hlo(n_devices):
        with jax.set_mesh(sharding.make_mesh(MeshConfig(fsdp=n_devices), jax.devices()[:n_devices])):
            return fn.trace(params).lower(lowering_platforms=("cuda",)).as_text()

    assert cuda_hlo(1).count("AllocateBuffer") >= 2, "the scanned layers' residuals are zero-filled again"
    four = cuda_hlo(4)
    assert four.count("AllocateBuffer") == 0, "an unshardable AllocateBuffer on a 4-device mesh"
    assert four.count("CustomSPMDPartitioning") >= 2, "the residuals on a 4-device mesh are zero-filled again"


@pytest.mark.parametrize("n_shared", [None, 0, 1])  # dense; Mixtral-style MoE; DeepSeek-style with a shared expert
def test_save_matmuls_keeps_the_residual_stream_not_the_output_projection(n_shared):
    """Under model.remat=save_matmuls a block keeps h = x + Attn(..) (named "residual") for the FFN norm's backward,
    and no output of a plain `linear` (the output projection, down): inside lax.scan XLA:GPU fused the saved output
    projection into its stacked-residual write and ran that GEMM twice (llama.py docstring)."""
    from mx_jax import compat
    from mx_jax.config import MoEConfig
    from mx_jax.llama import layer_body
    moe_cfg = {} if n_shared is None else dict(n_experts=4, top_k=2, d_expert=32, n_shared=n_shared)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      compute_dtype="bfloat16", remat="save_matmuls", moe=MoEConfig(**moe_cfg))
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model.blocks)
    layer = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(state))
    x = jnp.ones((2, 16, 32), jnp.bfloat16)
    positions, inv_freq = Positions(jnp.arange(16)), rope_inv_freq(cfg.d_head, cfg.rope_theta, cfg.rope_scaling)
    named = [o for _, o in compat.saved_residuals(layer_body(graphdef, positions, inv_freq, "save_matmuls"), x, layer)
             if o.startswith("named")]
    assert sum("named 'residual'" in o and "Block.__call__" in o for o in named) == 1, named
    assert not [o for o in named if "(linear)" in o], named
    # q|k|v and gate|up; in a MoE block the routed experts' three grouped GEMMs (mx_jax/dispatch.py) and each shared
    # expert's gate|up instead of gate|up
    assert sum("(saved_output)" in o for o in named) == (2 if n_shared is None else 4 + n_shared), named


@pytest.mark.parametrize("scan", [True, False])
def test_scanned_block_puts_a_barrier_between_attention_and_the_residual_add(scan):
    """In scanned layers attention's output passes an optimization barrier before h = x + Attn(..): under bf16
    XLA:GPU otherwise folds the add into the output projection's cuBLAS GEMM, and that GEMM, whose output is then
    the saved residual h, ran twice per layer in the scan (llama.py docstring). Unrolled layers need no barrier."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      compute_dtype="bfloat16", scan_layers=scan)
    graphdef, state = nnx.split(Llama(cfg, rngs=nnx.Rngs(0)).blocks)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))  # layer 0
    positions, inv_freq = Positions(jnp.arange(16)), rope_inv_freq(cfg.d_head, cfg.rope_theta, cfg.rope_scaling)
    jaxpr = jax.make_jaxpr(lambda x: block(x, positions, inv_freq))(jnp.ones((2, 16, 32), jnp.bfloat16))
    eqns, x = jaxpr.jaxpr.eqns, jaxpr.jaxpr.invars[0]
    barrier_outs = {v for e in eqns if e.primitive.name == "optimization_barrier" for v in e.outvars}
    residual_adds = [e for e in eqns if e.primitive.name == "add" and x in e.invars]
    assert len(residual_adds) == 1, jaxpr
    assert any(v in barrier_outs for v in residual_adds[0].invars) == scan, jaxpr


@pytest.mark.parametrize("mesh", [("mesh.fsdp=4",), ("mesh.data=2", "mesh.context=2")])
def test_scan_residual_buffers_on_a_mesh_split_like_jax_zero_fill(tmp_path, mesh):
    """The partitioner gives the allocated residual buffers (compat._sharded_empty) the shards it gave jax's zero fill:
    the compiled train step has the same per-device buffers and the same collectives either way. On XLA:CPU an
    allocation lowers to zeros, so the buffers show as broadcasts; on the GPU they are per-device AllocateBuffers."""
    import re
    from collections import Counter
    from jax._src.lax.control_flow import loops
    from mx_jax import compat
    from tests.helpers import NO_IO, lowered_train_step, tiny_config

    cfg = tiny_config(str(tmp_path), *NO_IO, *mesh, "model.compute_dtype=bfloat16", "model.remat=save_matmuls")
    assert cfg.model.scan_layers

    def compiled(empty_array):
        saved, loops._empty_array = loops._empty_array, empty_array
        try:
            return lowered_train_step(cfg, 4).compile().as_text()
        finally:
            loops._empty_array = saved

    ops = "broadcast|all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"

    def buffers_and_collectives(text):
        found = Counter(m.groups() for m in re.finditer(rf"= (\S+) ({ops})(?:-start)?\(", text))
        return found, text.count('/custom_partitioning"')

    ours, n_ours = buffers_and_collectives(compiled(compat._scan_output_buffer))
    jaxs, n_jaxs = buffers_and_collectives(compiled(compat._JAX_EMPTY_ARRAY))
    assert n_ours >= 4 and n_jaxs == 0, (n_ours, n_jaxs)
    assert ours == jaxs


@pytest.mark.gpu
@pytest.mark.parametrize("remat", ["none", "save_matmuls"])
def test_scanned_layers_on_gpu_equal_unrolled_with_uninitialized_residuals(remat):
    """What the CPU test cannot show: on the GPU the residual buffers really start uninitialized, and every slice
    is written before the backward loop reads it. At full float32 GEMM precision: with the GPU's default TF32 the
    two layouts' XLA fusions differ by up to 4e-4 relative, with or without the shim (H100, 2026-11-26)."""
    assert jax.devices()[0].platform == "gpu"
    with jax.default_matmul_precision("highest"):
        _assert_scan_equals_loop(remat)


def test_rms_norm_backward_matches_float64_math():
    """The written-out RMSNorm backward (layers.rms_norm) against the float64 formula, f32 and bf16 inputs."""
    from mx_jax.layers import rms_norm
    rng = np.random.default_rng(7)
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        x = jnp.asarray(3 * rng.standard_normal((2, 16, 256)), dtype)
        c = jnp.asarray(rng.standard_normal((2, 16, 256)), dtype)
        scale = jnp.asarray(rng.standard_normal(256), jnp.float32)
        dx, dscale = jax.grad(lambda x, s: jnp.sum((rms_norm(x, s, 1e-5) * c).astype(jnp.float32)), (0, 1))(x, scale)
        x64, c64, s64 = (np.asarray(a, np.float64) for a in (x, c, scale))
        r = 1 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + 1e-5)
        x_hat, dyw = x64 * r, c64 * s64
        want_dx = r * (dyw - x_hat * np.mean(dyw * x_hat, axis=-1, keepdims=True))
        want_ds = np.sum((c64 * x_hat).reshape(-1, 256), axis=0)
        assert dx.dtype == dtype and dscale.dtype == jnp.float32
        assert np.linalg.norm(np.asarray(dx, np.float64) - want_dx) / np.linalg.norm(want_dx) < tol
        assert np.linalg.norm(np.asarray(dscale, np.float64) - want_ds) / np.linalg.norm(want_ds) < 1e-6


def test_swiglu_backward_matches_float64_math_and_keeps_two_residuals():
    """layers.swiglu: h = silu(g) u; its written-out backward against the float64 derivative, and under a scan with
    everything saved it stacks only g and u (autodiff stacked five (T, F) arrays: g, u, silu(g), sigmoid(g), ...)."""
    from mx_jax.layers import swiglu
    rng = np.random.default_rng(3)
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        g = jnp.asarray(4 * rng.standard_normal((8, 96)), dtype)
        u = jnp.asarray(rng.standard_normal((8, 96)), dtype)
        c = jnp.asarray(rng.standard_normal((8, 96)), dtype)
        h, (dg, du) = jax.value_and_grad(lambda g, u: jnp.sum((swiglu(g, u) * c).astype(jnp.float32)), (0, 1))(g, u)
        g64, u64, c64 = (np.asarray(a, np.float64) for a in (g, u, c))
        s = 1 / (1 + np.exp(-g64))
        want = {"dg": c64 * u64 * s * (1 + g64 * (1 - s)), "du": c64 * g64 * s}
        for name, got in (("dg", dg), ("du", du)):
            assert got.dtype == dtype
            err = np.linalg.norm(np.asarray(got, np.float64) - want[name]) / np.linalg.norm(want[name])
            assert err < tol, (dtype, name, err)
        assert abs(float(h) - float(np.sum(g64 * s * u64 * c64))) < 1e-2 * float(np.sum(np.abs(g64 * s * u64 * c64)))

    def stacked_residuals(f):
        def body(x, w):  # x (8, 32), w (32, 192): gate and up of width 96, then back to 32 columns
            gu = x @ w
            return f(gu[:, :96], gu[:, 96:])[:, :32], None
        loss = lambda x, ws: jnp.sum(jax.lax.scan(body, x, ws)[0])
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=1))(jnp.ones((8, 32)), jnp.ones((3, 32, 192)))
        scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        return sum(v.aval.shape == (3, 8, 96) for v in scans[0].outvars)

    assert stacked_residuals(swiglu) == 2
    assert stacked_residuals(lambda g, u: jax.nn.silu(g) * u) > 2  # the count does see autodiff's residuals


def test_compute_copies_cast_the_gemm_weights_only():
    from mx_jax.config import MoEConfig
    from mx_jax.llama import compute_copies, params_of, with_compute
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      moe=MoEConfig(n_experts=4, top_k=2, n_shared=1, d_expert=16))
    params = params_of(Llama(cfg, rngs=nnx.Rngs(0)))
    cast = with_compute(params, compute_copies(cfg, params))
    seen = set()
    for (path, p), c in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(cast)):
        name = path[-1].key
        gemm = name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "head")
        assert c.dtype == (jnp.bfloat16 if gemm else jnp.float32), (jax.tree_util.keystr(path), c.dtype)
        np.testing.assert_array_equal(np.asarray(c, np.float32), np.asarray(p.astype(c.dtype), np.float32))
        seen.add((name, gemm))
    assert {("embed", False), ("router", False), ("scale", False), ("head", True), ("w_up", True)} <= seen
    f32_cfg = ModelConfig(compute_dtype="float32", vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                          d_ff=64)
    assert compute_copies(f32_cfg, params) == {}  # nothing to keep when the compute dtype is the masters' own
    copies = compute_copies(cfg, params)  # only the GEMM weights, in the nesting of params
    assert {p[-1].key for p, _ in jax.tree_util.tree_leaves_with_path(copies)} == {
        "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "head"}


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_weight_grad_dtype_follows_the_weight_and_is_summed_over_devices_in_reduce_dtype(reduce_dtype):
    """A bf16 weight gets a bf16 gradient; with the tokens split over 8 devices the partial weight gradients are
    summed across devices in `reduce_dtype` (model.grad_reduce_dtype): the weight-gradient GEMM writes that dtype,
    and f32 sums are rounded after the sum."""
    from mx_jax import quant
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((32, 24)) / 6, jnp.bfloat16)

    def grad_w(x, w):
        loss = lambda w: jnp.sum(quant.linear(x, w, recipe="bf16", reduce_dtype=reduce_dtype).astype(jnp.float32) ** 2)
        return jax.grad(loss)(w)

    assert grad_w(x, w).dtype == jnp.bfloat16
    mesh = sharding.make_mesh(MeshConfig(data=8))
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data", None)))
    with jax.set_mesh(mesh):
        fn = jax.jit(grad_w, out_shardings=jax.sharding.NamedSharding(mesh, P()))
        split = fn.lower(xs, w).as_text()
        g8 = fn(xs, w)
    alone = jax.jit(grad_w).lower(x, w).as_text()
    # The weight-gradient GEMM (32, 24): reduce_dtype out when its partial sums cross devices, bf16 on one device.
    wgrad = lambda text: [ln for ln in text.splitlines() if "dot_general" in ln and "-> tensor<32x24x" in ln]
    want = {"float32": "f32", "bfloat16": "bf16"}[reduce_dtype]
    assert wgrad(split) and all(f"tensor<32x24x{want}>" in ln.split("->")[-1] for ln in wgrad(split)), wgrad(split)
    assert wgrad(alone) and all("tensor<32x24xbf16>" in ln.split("->")[-1] for ln in wgrad(alone)), wgrad(alone)
    assert g8.dtype == jnp.bfloat16
    ref = (2 * x.astype(jnp.float32).T @ (x.astype(jnp.float32) @ w.astype(jnp.float32)))
    err = np.linalg.norm(np.asarray(g8, np.float32) - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
    assert err < 1e-2, err  # bf16 operands and a bf16 result: ~3 bf16 roundings (4 with the bf16 sum)


def test_grad_reduce_dtype_reaches_every_dense_linear_of_the_train_step(tmp_path):
    """model.grad_reduce_dtype=bfloat16 makes every weight-gradient GEMM of the dense model's step (attention, FFN,
    head) write bf16 partials on a mesh that splits the tokens; under the float32 default each of them writes f32."""
    import re

    from tests.helpers import NO_IO, lowered_train_step, tiny_config

    def wgrad_dtypes(reduce_dtype):
        cfg = tiny_config(tmp_path, *NO_IO, "mesh.fsdp=4", "quant.recipe=bf16", "model.compute_dtype=bfloat16",
                          f"model.grad_reduce_dtype={reduce_dtype}")
        m, d = cfg.model, cfg.model.d_model
        qkv, o = (m.n_heads + 2 * m.n_kv_heads) * m.d_head, m.n_heads * m.d_head  # q|k|v and gate|up are fused
        shapes = {f"{d}x{qkv}", f"{o}x{d}", f"{d}x{2 * m.d_ff}", f"{m.d_ff}x{d}", f"{d}x{m.vocab_size}"}
        text = lowered_train_step(cfg, 4).as_text()
        found = {}
        for ln in text.splitlines():
            if "dot_general" in ln and (hit := re.search(r"-> tensor<(\d+x\d+)x(\w+)>$", ln.strip())):
                if hit[1] in shapes:
                    found.setdefault(hit[1], set()).add(hit[2])
        return shapes, found

    shapes, f32 = wgrad_dtypes("float32")
    assert set(f32) == shapes and all("f32" in d for d in f32.values()), f32
    _, bf16 = wgrad_dtypes("bfloat16")
    assert set(bf16) == shapes and all(d == {"bf16"} for d in bf16.values()), bf16


def test_the_output_heads_weight_gradient_is_fenced_with_its_input_gradient(tmp_path):
    """The head's backward passes (grad_x, grad_w) through one optimization barrier, so grad_w's GEMM runs before the
    layers' backward and the V-wide logits gradient it reads is freed there (XLA had run it after them)."""
    import re

    from tests.helpers import NO_IO, lowered_train_step, tiny_config

    cfg = tiny_config(tmp_path, *NO_IO, "mesh.fsdp=1", "quant.recipe=bf16")
    d, v = cfg.model.d_model, cfg.model.vocab_size
    fences = [ln for ln in lowered_train_step(cfg, 1).as_text().splitlines() if "optimization_barrier" in ln]
    assert any(f"tensor<{d}x{v}x" in ln and re.search(rf"tensor<\d+x\d+x{d}x", ln) for ln in fences), fences


def test_flops_per_token_llama3_8b_and_mfu(monkeypatch):
    import pathlib
    import types

    from mx_jax import metrics
    from mx_jax.config import load_config
    from mx_jax.llama import flops_per_token

    root = pathlib.Path(__file__).resolve().parents[1]
    cfg = load_config(str(root / "configs/llama3_8b.yaml")).model
    d, n_layers, h, g, k, f, v, t = 4096, 32, 32, 8, 128, 14336, 128256, 8192  # Llama 3.1 8B, by hand
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_ff, cfg.vocab_size) == (
        d, n_layers, h, g, k, f, v)
    per_layer = d * h * k + 2 * d * g * k + h * k * d + 3 * d * f  # q, k, v, o; gate, up, down
    matmul = n_layers * per_layer + d * v  # + the head; the embedding is a lookup, not a matmul
    assert matmul == 7_504_658_432
    # the same number from the other side: all 8,030,261,248 parameters less the embedding and the norm scales
    assert matmul == 8_030_261_248 - v * d - (2 * n_layers + 1) * d
    # causal attention per layer and token: q.k and p.v are 2 T H K FLOPs each forward, halved by the mask, x3
    attention = n_layers * 3 * (2 * t * h * k + 2 * t * h * k) // 2
    want = 6 * matmul + attention
    assert want == 51_470_401_536
    assert flops_per_token(cfg, t) == want

    # Throughput over a fake clock: 3 steps of 64 x 8192 tokens in 30 s on 8 devices.
    clock = {"now": 100.0}
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    tokens, peak = 64 * t, 989.4
    rate = metrics.Throughput(tokens, want, n_devices=8, peak_tflops=peak)
    for _ in range(3):
        rate.step()
    clock["now"] += 30.0
    r = rate.report()
    tps = 3 * 64 * 8192 / 30.0
    tflops = want * tps / 8 / 1e12  # 51.47e9 FLOPs x 52,428.8 tok/s / 8 devices = 337.3 TFLOP/s per device
    np.testing.assert_allclose(r["tokens_per_sec"], tps, rtol=1e-12)
    np.testing.assert_allclose(r["step_time_s"], 10.0, rtol=1e-12)
    np.testing.assert_allclose(r["tflops_per_device"], tflops, rtol=1e-12)
    np.testing.assert_allclose(r["mfu"], r["tflops_per_device"] / peak, rtol=1e-12)
    np.testing.assert_allclose(r["mfu"], 0.340930, atol=1e-6)  # 337.3 / 989.4 (H100 SXM dense bf16)
    assert rate.report() == {}  # report() opens the next window: no steps since
    assert metrics.Throughput(tokens, want, 8, None).report() == {}  # no steps yet
    unknown = metrics.Throughput(tokens, want, 8, None)
    unknown.step()
    clock["now"] += 1.0
    assert unknown.report()["mfu"] is None  # no known peak (the CPU): no MFU


def _weight_casts(jaxpr, weight_shapes) -> int:
    """fp8 casts in `jaxpr` (nested jaxprs included) whose operand has the shape of a weight or its transpose."""
    from jax._src import core
    n = 0
    for e in jaxpr.eqns:
        if (e.primitive.name == "convert_element_type" and jnp.dtype(e.params["new_dtype"]).itemsize == 1
                and tuple(e.invars[0].aval.shape) in weight_shapes):
            n += 1
        n += sum(_weight_casts(sub, weight_shapes) for sub in core.jaxprs_in_params(e.params))
    return n


# fp8_rowwise runs scanned with save_matmuls on the MoE model, which has a dense first layer, attention, shared and
# routed experts.
@pytest.mark.parametrize("recipe,layout", [
    pytest.param("fp8_tensorwise", "model.scan_layers=false model.remat=none", id="tensorwise-unrolled"),
    pytest.param("fp8_rowwise_gw_hp", "model.scan_layers=true model.remat=none", id="gw_hp-scanned"),
    pytest.param("fp8_rowwise", "model.scan_layers=true model.remat=save_matmuls model.moe.n_experts=4 "
                 "model.moe.top_k=2 model.moe.n_shared=1 model.moe.d_expert=32 model.moe.n_dense_first=1",
                 id="rowwise-moe"),
    pytest.param("fp8_rowwise", "model.scan_layers=true model.remat=save_matmuls model.mla.kv_rank=32 "
                 "model.mla.q_rank=32 model.mla.nope_dim=16 model.mla.rope_dim=32 model.mla.v_dim=32 "
                 "model.n_kv_heads=4", id="rowwise-mla"),
])
def test_prequantized_operands_give_the_same_loss_and_grads(recipe, layout):
    """The train step's fp8 operands, made from the masters at the update (llama.compute_copies with the plan),
    give the loss and weight gradients of quantizing the bf16 copies inside every linear, bit for bit, and the
    differentiated function then casts no weight at all (the forward's and the rematerialized backward's casts
    are gone)."""
    from mx_jax.config import QuantConfig, load_config
    from mx_jax import llama, quant
    from mx_jax.llama import buffers_of, compute_copies, cross_entropy, params_of, with_compute, with_operands
    cfg = load_config(None, ["model.vocab_size=64", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                             "model.n_kv_heads=2", "model.d_ff=128", "model.compute_dtype=bfloat16",
                             *layout.split()]).model
    model = Llama(cfg, QuantConfig(recipe=recipe, impl="xla", expert_min_rows=0), rngs=nnx.Rngs(0))
    graphdef, _, _ = nnx.split(model, nnx.Param, ...)
    params, buffers = params_of(model), buffers_of(model)
    tokens = jax.random.randint(jax.random.key(1), (2, 25), 0, 64)  # 48 tokens: no activation has a weight's shape

    def loss(p):
        logits = nnx.merge(graphdef, p, buffers)(tokens[:, :-1], logits_dtype=jnp.bfloat16)[0]
        return cross_entropy(logits, tokens[:, 1:])

    plain = jax.jit(jax.value_and_grad(loss))(with_compute(params, compute_copies(cfg, params)))
    moe = cfg.moe.n_experts > 0
    plan = llama.plan_for_run(model.plan, cfg, 2, 24, {})  # one device; expert_min_rows=0: the experts run fp8
    assert plan.prequantize_experts == moe
    copies = compute_copies(cfg, params, plan)
    layers = 1 if moe else 2  # the MoE model: one dense layer first ("dense_blocks"), then one MoE layer
    attn = copies["blocks"]["attn"]
    if cfg.mla.kv_rank:  # latent attention: x W_qa | x W_kva one GEMM (64 -> 32 + 64), W_qb, W_kvb and W_o alone
        assert set(attn) == {"wq_a|wkv_a", "wq_b", "wkv_b", "wo"}
        assert all(isinstance(v, quant.Operands) for v in attn.values())
        assert attn["wq_a|wkv_a"].out[0].shape == (layers, 96, 64) and attn["wkv_b"].out[0].shape == (layers, 192, 32)
    else:
        attn_ops = attn["wq|wk|wv"]
        assert isinstance(attn_ops, quant.Operands) and "wq" not in attn
        assert attn_ops.out[0].shape == (layers, 64 + 2 * 32, 64) and attn_ops.out[0].dtype == jnp.float8_e4m3fn
        assert attn_ops.grad_x[0].shape == (layers, 64, 128)
    if moe:  # the shared experts, the dense first layer and the routed experts (one per weight) are prequantized
        assert isinstance(copies["blocks"]["moe"]["shared"]["w_gate|w_up"], quant.Operands)
        assert isinstance(copies["dense_blocks"]["mlp"]["w_down"], quant.Operands)
        experts = copies["blocks"]["moe"]["w_gate"]  # (L, E, D, F) weights: out (L, E, F, D), grad_x (L, E, D, F)
        assert experts.out[0].shape == (1, 4, 32, 64) and experts.grad_x[1].shape == (1, 4, 64)
    else:
        assert isinstance(copies["blocks"]["mlp"]["w_gate|w_up"], quant.Operands)
    assert copies["head"].dtype == jnp.bfloat16  # the head stays bf16: a cast copy

    def loss_pre(c):
        return loss(with_operands(c, copies))

    slots = with_compute(params, copies, jnp.bfloat16)
    pre = jax.jit(jax.value_and_grad(loss_pre))(slots)
    assert float(pre[0]) == float(plain[0])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(pre[1]), jax.tree.leaves(plain[1])):
        assert a.dtype == b.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=jax.tree_util.keystr(path))
    # What the step no longer does: every weight-shaped fp8 cast (forward and rematerialized backward) is gone.
    shapes = {s for w in jax.tree.leaves(params) if w.ndim >= 2 for s in (w.shape[-2:], w.shape[-2:][::-1])}
    shapes |= {(64, 128), (128, 64), (64, 256), (256, 64), (64, 96), (96, 64)}  # fused q|k|v, gate|up, q_a|kv_a
    shapes |= {(4, *s) for s in shapes}  # the routed experts' (E, K, N) batches
    assert _weight_casts(jax.make_jaxpr(jax.grad(loss))(with_compute(params, compute_copies(cfg, params))).jaxpr,
                         shapes) > 0
    assert _weight_casts(jax.make_jaxpr(jax.grad(loss_pre))(slots).jaxpr, shapes) == 0


def test_prequantize_errors_name_the_problem():
    from mx_jax import quant
    w = jnp.ones((64, 32), jnp.float32)
    with pytest.raises(ValueError, match="recipe 'mxfp8' has no fp8 weight operands"):
        quant.prequantize(w, recipe="mxfp8")
    with pytest.raises(ValueError, match=r"share every axis but the last.*\(64, 32\), \(32, 32\)"):
        quant.prequantize((w, jnp.ones((32, 32))), recipe="fp8_rowwise")
    ops = quant.prequantize(w, recipe="fp8_rowwise", impl="xla")
    x = jnp.ones((4, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"operands must be quant.prequantize's for a \(32, 64\) weight"):
        quant.linear(x, jnp.zeros((32, 64), jnp.bfloat16), recipe="fp8_rowwise", operands=ops)
    with pytest.raises(ValueError, match="recipe 'bf16'"):
        quant.linear(jnp.ones((4, 64), jnp.bfloat16), w, recipe="bf16", operands=ops)
