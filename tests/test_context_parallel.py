"""Context parallelism (mx_jax/context_parallel.py): the zigzag layout, each shard's merged attention and its
backward against autodiff of plain causal attention, the shard_map path on 8 fake devices, and cuDNN on a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mx_jax import context_parallel as cp
from mx_jax import sharding
from mx_jax.config import MeshConfig
from mx_jax.layers import causal_attention, document_attention, document_segments


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_zigzag_gives_shard_c_chunks_c_and_mirror(n):
    t = 2 * n * 3  # chunks of 3 tokens
    z = np.asarray(cp.to_zigzag(jnp.arange(t)[None], n))[0]
    for c in range(n):
        mine = z[c * 6:(c + 1) * 6]
        np.testing.assert_array_equal(mine, np.r_[np.arange(3) + 3 * c, np.arange(3) + 3 * (2 * n - 1 - c)])
    np.testing.assert_array_equal(np.asarray(cp.from_zigzag(jnp.asarray(z)[None], n))[0], np.arange(t))
    x = jnp.arange(2 * t * 5).reshape(2, t, 5)  # other axes ride along
    np.testing.assert_array_equal(cp.from_zigzag(cp.to_zigzag(x, n), n), x)
    shards = jnp.stack(jnp.split(cp.to_zigzag(x, n), n, axis=1))  # what all_gather returns: (C, B, 2s, ...)
    np.testing.assert_array_equal(cp.global_order(shards), x)


def _inputs(b, t, h, g, d, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, h, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, t, g, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, t, g, d), jnp.float32)
    w = jax.random.normal(keys[3], (b, t, h, d), jnp.float32)  # the loss sum(o * w) gives a dense cotangent
    return [a.astype(dtype) for a in (q, k, v)] + [w]


def _reference(q, k, v, w):
    f32 = lambda a: a.astype(jnp.float32)
    loss = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) * w)
    o = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True)
    return o, jax.grad(loss, argnums=(0, 1, 2))(f32(q), f32(k), f32(v))


@functools.partial(jax.jit, static_argnums=(4, 5, 7))
def _simulate_shards(q, k, v, w, n, impl, segments=None, max_documents=0):
    """Every shard's forward and backward on one device, assembled in natural order: (o, (dq, dk, dv))."""
    zq, zk, zv, zw = (cp.to_zigzag(a, n) for a in (q, k, v, w))
    split = lambda a: jnp.split(a, n, axis=1)
    outs, dqs, dks, dvs = [], [], [], []
    dkg = dvg = 0.0
    for c, (qc, kc, vc, wc) in enumerate(zip(*(split(a) for a in (zq, zk, zv, zw)))):
        o, lse = cp.shard_fwd(c, n, impl, qc, kc, vc, k, v, segments, max_documents)
        dq, dk, dv, dkg_c, dvg_c = cp.shard_bwd(c, n, impl, qc, kc, vc, k, v, o, lse, wc.astype(o.dtype), segments,
                                                max_documents)
        outs.append(o), dqs.append(dq), dks.append(dk), dvs.append(dv)
        dkg, dvg = dkg + dkg_c.astype(jnp.float32), dvg + dvg_c.astype(jnp.float32)
    back = lambda parts: cp.from_zigzag(jnp.concatenate(parts, axis=1), n).astype(jnp.float32)
    return back(outs), (back(dqs), back(dks) + dkg, back(dvs) + dvg)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_each_shard_merges_prefix_and_diagonal_exactly(n):
    q, k, v, w = _inputs(2, 8 * n, 4, 2, 8, jnp.float32, seed=n)
    ref_o, ref_grads = _reference(q, k, v, w)
    o, grads = _simulate_shards(q, k, v, w, n, "xla")
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def _document_tokens(b, t, seed):
    """(b, t) tokens with documents of random lengths (EOS = 1), one row holding a single document."""
    rng = np.random.default_rng(seed)
    tokens = np.full((b, t), 7)
    for row in range(b - 1):
        tokens[row, np.sort(rng.choice(t - 1, size=t // 6, replace=False))] = 1
    return jnp.asarray(tokens)


def _document_reference(q, k, v, w, segments):
    f32 = lambda a: a.astype(jnp.float32)
    attend = lambda q, k, v: document_attention(q, k, v, segments, "xla", 10 ** 6)
    o = attend(f32(q), f32(k), f32(v))
    return o, jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * w), argnums=(0, 1, 2))(f32(q), f32(k), f32(v))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_each_shard_keeps_documents_apart(n):
    """model.attention_mask=documents: each shard's diagonal within the chunk's documents and the first document's
    prefix from its start, merged, against one device's masked attention; a cap of 4 documents merges the rest."""
    q, k, v, w = _inputs(3, 12 * n, 4, 2, 8, jnp.float32, seed=n)
    for cap in (10 ** 6, 4):
        segments = document_segments(_document_tokens(3, 12 * n, n), 1, cap)
        ref_o, ref_grads = _document_reference(q, k, v, w, segments)
        o, grads = _simulate_shards(q, k, v, w, n, "xla", segments, cap)
        np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)
        for name, got, want in zip("qkv", grads, ref_grads):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"d{name} cap {cap}")
    causal_o, _ = _reference(q, k, v, w)
    assert float(jnp.max(jnp.abs(causal_o - ref_o))) > 1e-2  # the documents change the result


@pytest.mark.parametrize("n", [2, 4])
def test_max_documents_counts_each_chunk_under_context_parallelism(n):
    """The model passes the sequence's segments uncapped under a context axis; each shard caps its chunks' own at
    max_documents - 1. M as large as the fullest chunk's count is exact though the sequence holds many more; one
    smaller merges a chunk's last documents."""
    t = 12 * n
    q, k, v, w = _inputs(3, t, 4, 2, 8, jnp.float32, seed=n)
    tokens = _document_tokens(3, t, n)
    segments = document_segments(tokens, 1, 10 ** 6)
    chunks = np.asarray(segments).reshape(3, 2 * n, t // (2 * n))
    per_chunk = int((chunks[:, :, -1] - chunks[:, :, 0] + 1).max())
    assert per_chunk < int(segments.max()) + 1  # the chunks hold fewer than the sequence
    ref_o, ref_grads = _document_reference(q, k, v, w, segments)
    o, grads = _simulate_shards(q, k, v, w, n, "xla", segments, per_chunk)
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")
    merged, _ = _simulate_shards(q, k, v, w, n, "xla", segments, per_chunk - 1)
    assert float(jnp.max(jnp.abs(merged - ref_o))) > 1e-2


def test_context_mesh_documents_match_one_device():
    """context=4 x fsdp=2 on 8 fake devices, through layers.document_attention's shard_map."""
    n = 4
    q, k, v, w = _inputs(2, 32, 4, 2, 8, jnp.float32, seed=8)
    segments = document_segments(_document_tokens(2, 32, 3), 1, 16)
    ref_o, ref_grads = _document_reference(q, k, v, w, segments)
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, context=n))

    def loss(q, k, v):
        zz = lambda a: cp.to_zigzag(a, n)
        o = cp.from_zigzag(document_attention(zz(q), zz(k), zz(v), zz(segments), "xla", 16), n)
        return jnp.sum(o * w), o

    with jax.set_mesh(mesh):
        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def test_context_mesh_attention_and_gradients_match_one_device():
    """context=4 x fsdp=2 on 8 fake devices, through causal_attention's shard_map (collectives included)."""
    n = 4
    q, k, v, w = _inputs(2, 32, 4, 2, 8, jnp.float32, seed=7)
    ref_o, ref_grads = _reference(q, k, v, w)
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, context=n))

    def loss(q, k, v):
        o = causal_attention(cp.to_zigzag(q, n), cp.to_zigzag(k, n), cp.to_zigzag(v, n), impl="xla")
        return jnp.sum(cp.from_zigzag(o, n) * w), cp.from_zigzag(o, n)

    with jax.set_mesh(mesh):
        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_allclose(o, ref_o, rtol=1e-5, atol=1e-5)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def test_context_mesh_bf16_gradients_are_as_close_as_one_device_bf16():
    """In bf16 the shards' key gradients are summed in float32: the error against float32 stays that of plain bf16
    attention on one device, within 1.5x (context=8 sums eight partial dK and dV per key)."""
    n = 8
    q, k, v, w = _inputs(1, 256, 4, 2, 32, jnp.bfloat16, seed=9)
    _, ref_grads = _reference(q, k, v, w)
    plain = jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True)
                                             .astype(jnp.float32) * w), argnums=(0, 1, 2))(q, k, v)

    def loss(q, k, v):
        o = causal_attention(cp.to_zigzag(q, n), cp.to_zigzag(k, n), cp.to_zigzag(v, n), impl="xla")
        return jnp.sum(cp.from_zigzag(o, n).astype(jnp.float32) * w)

    with jax.set_mesh(sharding.make_mesh(MeshConfig(data=1, fsdp=1, context=n))):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    err = lambda g, r: float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
    for name, got, one, want in zip("qkv", grads, plain, ref_grads):
        assert err(got, want) <= 1.5 * err(one, want) + 1e-3, (name, err(got, want), err(one, want))


def test_seq_len_must_split_into_two_chunks_per_context_shard(tmp_path):
    from mx_jax.config import ConfigError, load_config
    from mx_jax.train import check_against_mesh

    cfg = load_config("configs/llama3_debug.yaml", [f"run_dir={tmp_path}", "data.seq_len=12", "mesh.context=4",
                                                    "mesh.fsdp=2"])
    with pytest.raises(ConfigError, match=r"data.seq_len.*2 x mesh.context \(8\)"):
        check_against_mesh(cfg, sharding.make_mesh(cfg.mesh))


@pytest.mark.parametrize("recipe", ["bf16", "fp8_rowwise"])
def test_context_train_step_moves_no_activations_but_attention_and_zigzag(tmp_path, recipe):
    """The train step on a context=2 mesh with 16 sequences: no all-gather, all-reduce or reduce-scatter carries a
    whole sequence of activations. The K/V gathers (chunks) and the zigzag permutes are the only activation traffic.
    Flattening (B, S) into rows (the bf16 linears, RMSNorm's scale gradient) made XLA gather activations over the
    sequence and split the GEMMs over K (benchmarks/RESULTS.md, session 36)."""
    import re

    from tests.helpers import NO_IO, lowered_train_step, tiny_config

    # seq_len 48: no weight dimension or shard of one (64, 32, 128, 256, 16) has the sequence's length
    cfg = tiny_config(tmp_path, "mesh.fsdp=1", "mesh.context=2", "model.compute_dtype=bfloat16", "data.seq_len=48",
                      f"quant.recipe={recipe}", *NO_IO)
    text = lowered_train_step(cfg, 2).compile().as_text()
    moved = re.findall(r"= \(?([a-z]+\d*)\[([\d,]*)\][^ ]* (all-gather|all-reduce|reduce-scatter|all-to-all)\(", text)
    assert any(kind == "all-gather" for _, _, kind in moved)  # the weights and K/V are gathered
    whole_seq = [m for m in moved if m[0] != "s32" and str(cfg.data.seq_len) in m[1].split(",")]
    assert not whole_seq, whole_seq


_MOE4 = ("model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.d_expert=32")


@pytest.mark.parametrize("mesh_args", [("mesh.fsdp=2", "mesh.context=2"), ("mesh.fsdp=2", "mesh.expert=2", *_MOE4),
                                       ("mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", *_MOE4)])
def test_embedding_rows_are_never_replicated(tmp_path, capfd, mesh_args):
    """On fsdp x context, fsdp x expert and data x fsdp x expert meshes the embedding lookup's collectives move
    only each device's own rows (sharding.embed_lookup). Left to the partitioner, XLA replicated the whole (B, S, D)
    array on every device, in the forward, the backward or both, and said so on stderr."""
    import re

    from tests.helpers import NO_IO, lowered_train_step, tiny_config

    n = 8 if "mesh.data=2" in mesh_args else 4
    cfg = tiny_config(tmp_path, *mesh_args, "model.compute_dtype=bfloat16", f"data.batch_size={n}", *NO_IO)
    text = lowered_train_step(cfg, n).compile().as_text()
    whole = f"{cfg.data.batch_size},{cfg.data.seq_len},{cfg.model.d_model}"
    kinds = "all-gather|all-reduce|all-to-all|collective-permute"
    moved = re.findall(rf"= \(?[a-z]+\d*\[([\d,]*)\][^ ]* (?:{kinds})\(", text)
    assert moved and whole not in moved, moved
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_cudnn_shards_match_the_jnp_formulas(n):
    """cuDNN's forward statistics and its backward fed the merged (O, L) agree with the jnp formulas; the whole
    sequence's output and gradients with plain cuDNN causal attention."""
    q, k, v, w = _inputs(1, 512 * n, 8, 2, 128, jnp.bfloat16, seed=n)
    o_x, lse_x = cp.block_fwd(q[:, :256], k[:, :256], v[:, :256], causal=True, impl="xla")
    o_c, lse_c = cp.block_fwd(q[:, :256], k[:, :256], v[:, :256], causal=True, impl="cudnn")
    np.testing.assert_allclose(lse_c, lse_x, atol=2e-2)  # natural-log log-sum-exp, (B, H, t)
    got_o, got = _simulate_shards(q, k, v, w, n, "cudnn")
    want_o, want = _simulate_shards(q, k, v, w, n, "xla")
    cudnn_loss = lambda q, k, v: jnp.sum(
        jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32) * w)
    plain = jax.jit(jax.grad(cudnn_loss, argnums=(0, 1, 2)))(q, k, v)
    scale = lambda a: float(jnp.max(jnp.abs(a)))
    assert scale(got_o - want_o) < 2e-2 * scale(want_o)
    for name, g, wnt, p in zip("qkv", got, want, plain):
        err, plain_err = scale(g - wnt), scale(p.astype(jnp.float32) - wnt)
        assert err < 2e-2 * scale(wnt), f"d{name}: {err} vs {scale(wnt)}"
        assert err < 2 * plain_err + 1e-3, f"d{name}: merged {err}, cuDNN's own causal call {plain_err}"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_cudnn_document_shards_match_the_jnp_formulas(n):
    """The documents' shards through cuDNN (the packed diagonal with its statistics read per row, the windowed
    prefix) against the jnp formulas, and the per-row statistics against jnp's log-sum-exp."""
    q, k, v, w = _inputs(2, 512 * n, 8, 2, 128, jnp.bfloat16, seed=n)
    tokens = np.full((2, 512 * n), 7)
    tokens[0, np.arange(300, 512 * n, 397)] = 1  # documents crossing the chunks
    segments = document_segments(jnp.asarray(tokens), 1, 16)
    local = segments[:, :256] - segments[:, :1]
    o_x, lse_x = cp.block_fwd(q[:, :256], k[:, :256], v[:, :256], causal=True, impl="xla", segments=local)
    o_c, lse_c = cp.block_fwd(q[:, :256], k[:, :256], v[:, :256], causal=True, impl="cudnn", segments=local,
                              max_documents=16)
    np.testing.assert_allclose(lse_c, lse_x, atol=2e-2)
    got_o, got = _simulate_shards(q, k, v, w, n, "cudnn", segments, 16)
    want_o, want = _simulate_shards(q, k, v, w, n, "xla", segments, 16)
    scale = lambda a: float(jnp.max(jnp.abs(a)))
    assert scale(got_o - want_o) < 2e-2 * scale(want_o)
    for name, g, wnt in zip("qkv", got, want):
        assert scale(g - wnt) < 2e-2 * scale(wnt), f"d{name}: {scale(g - wnt)} vs {scale(wnt)}"


def _dot_count(jaxpr) -> int:
    from jax._src import core
    return sum((e.primitive.name == "dot_general") + sum(_dot_count(j) for j in core.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


def test_save_matmuls_keeps_attention_residuals_under_scan():
    """With the "attention" name saved (model.remat=save_matmuls), the backward of a scanned, rematerialized layer
    runs no forward GEMM of the attention again: as many dot_generals as when everything is saved."""
    n = 2
    q, _, _, w = _inputs(2, 16, 4, 2, 8, jnp.float32, seed=3)
    zq, zw = cp.to_zigzag(q, n), cp.to_zigzag(w, n)

    def layer(x, _):
        return causal_attention(x, x[:, :, :2], x[:, :, 2:], impl="xla"), None

    def dots(policy) -> int:
        loss = lambda x: jnp.sum(jax.lax.scan(jax.checkpoint(layer, policy=policy), x, None, length=2)[0] * zw)
        with jax.set_mesh(sharding.make_mesh(MeshConfig(data=1, fsdp=2, context=n), jax.devices()[:4])):
            return _dot_count(jax.make_jaxpr(jax.grad(loss))(zq).jaxpr)

    saved = dots(jax.checkpoint_policies.save_only_these_names("attention"))
    assert saved == dots(jax.checkpoint_policies.everything_saveable)
    assert dots(jax.checkpoint_policies.nothing_saveable) > saved  # the count does see a recomputed forward


@pytest.mark.gpu
def test_cudnn_causal_attention_matches_jax_nn():
    """The one-device path (cuDNN through our custom_vjp, residuals tagged) gives jax.nn's cuDNN results."""
    q, k, v, w = _inputs(2, 1024, 8, 2, 128, jnp.bfloat16, seed=11)

    def loss(attention):
        return lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * w)

    ours = jax.jit(jax.value_and_grad(loss(cp.cudnn_causal_attention), argnums=(0, 1, 2)))(q, k, v)
    jax_nn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    theirs = jax.jit(jax.value_and_grad(loss(jax_nn), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-2 * float(jnp.max(jnp.abs(want)))
