"""model.attention_mask=documents: a token attends only within its own document (Llama 3's packed training)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mx_jax import data
from mx_jax.config import ConfigError, ModelConfig
from mx_jax.layers import document_attention, document_segments, packed_layout
from mx_jax.llama import Llama
from tests.helpers import tiny_config

EOS = 1


def test_segments_count_the_end_of_text_tokens_before_each_position_and_cap_them():
    tokens = jnp.asarray([[5, 6, EOS, 7, EOS, EOS, 8, 9],
                          [EOS, 3, 3, 3, 3, 3, 3, EOS]])
    assert document_segments(tokens, EOS, 8).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3],
                                                          [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_segments(tokens, EOS, 2).tolist() == [[0, 0, 0, 1, 1, 1, 1, 1],
                                                          [0, 1, 1, 1, 1, 1, 1, 1]]
    lengths, starts = packed_layout(document_segments(tokens, EOS, 8), 3)  # M = 3 < 4 documents: cut at 3
    lengths8, starts8 = packed_layout(document_segments(tokens, EOS, 8), 8)
    assert lengths8.tolist() == [[3, 2, 1, 2, -1, -1, -1, -1], [1, 7, -1, -1, -1, -1, -1, -1]]
    assert starts8.tolist() == [[0, 3, 5, 6, -1, -1, -1, -1, -1], [0, 1, -1, -1, -1, -1, -1, -1, -1]]
    assert lengths.tolist() == [[3, 2, 1], [1, 7, -1]] and starts.shape == (2, 4)


def _naive(q, k, v, segments):
    """float64 causal attention per document, grouped-query heads."""
    b, t, h, d = q.shape
    g = k.shape[2]
    out = np.zeros((b, t, h, d))
    for i in range(b):
        for n in range(h):
            s = q[i, :, n] @ k[i, :, n // (h // g)].T / np.sqrt(d)
            ok = np.tril(np.ones((t, t), bool)) & (segments[i][:, None] == segments[i][None, :])
            s = np.where(ok, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[i, :, n] = (p / p.sum(-1, keepdims=True)) @ v[i, :, n // (h // g)]
    return out


def test_xla_document_attention_matches_per_document_softmax():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 12, 4, 8))
    k, v = rng.standard_normal((2, 2, 12, 2, 8))
    tokens = np.full((2, 12), 7)
    tokens[0, [2, 3, 8]] = EOS  # documents of 3, 1, 5 and 3 tokens; row 1 is one document
    segments = document_segments(jnp.asarray(tokens), EOS, 8)
    got = document_attention(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), segments, "xla", 8)
    np.testing.assert_allclose(np.asarray(got), _naive(q, k, v, np.asarray(segments)), rtol=1e-4, atol=1e-5)


def test_cudnn_path_runs_per_device_on_a_batch_split_mesh():
    """Traced (cuDNN cannot run here): under fsdp=4 x data=2 each device's rows go to cuDNN as its own batch of 1."""
    from mx_jax import compat, sharding
    from mx_jax.config import MeshConfig

    q = jax.ShapeDtypeStruct((8, 256, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((8, 256, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((8, 256), jnp.int32)
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=4), jax.devices()[:8])
    with jax.set_mesh(mesh), compat.cudnn_shapes_only():
        jaxpr = jax.make_jaxpr(lambda q, k, v, s: document_attention(q, k, v, s, "cudnn", 8))(q, kv, kv, seg)
    assert jaxpr.out_avals[0].shape == (8, 256, 8, 64)
    inner = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    assert len(inner) == 1
    fwd = [e for e in inner[0].params["jaxpr"].eqns if "custom_vjp" in e.primitive.name]
    assert fwd and fwd[0].invars[0].aval.shape == (1, 256, 8, 64)  # one row per device


def _model(mask: str, max_documents: int = 32):
    cfg = ModelConfig(compute_dtype="float32", vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      d_ff=64, attention="xla", attention_mask=mask, eos_id=EOS, max_documents=max_documents)
    return Llama(cfg, rngs=nnx.Rngs(0))


def test_a_document_is_predicted_as_it_would_be_alone():
    """RoPE scores depend on relative positions only, so with the mask a document packed after others gets the
    logits it gets at the start of a sequence; without it, its tokens see the documents before it."""
    rng = np.random.default_rng(3)
    a, b, c = (list(rng.integers(2, 32, size=n)) for n in (5, 6, 5))
    packed = jnp.asarray([a + [EOS] + b + [EOS] + c])  # 18 tokens
    alone_b = jnp.asarray([b + [EOS] + c + [EOS] + a])
    alone_c = jnp.asarray([c + [EOS] + a + [EOS] + b])
    model = _model("documents")
    logits = model(packed)[0][0]
    np.testing.assert_allclose(logits[6:13], model(alone_b)[0][0, :7], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[13:], model(alone_c)[0][0, :5], rtol=1e-4, atol=1e-4)
    causal = _model("causal")
    assert float(jnp.max(jnp.abs(causal(packed)[0][0, 6:13] - causal(alone_b)[0][0, :7]))) > 1e-2

    capped = _model("documents", max_documents=2)(packed)[0][0]  # c shares b's segment
    np.testing.assert_allclose(capped[6:13], logits[6:13], rtol=1e-4, atol=1e-4)
    assert float(jnp.max(jnp.abs(capped[13:] - logits[13:]))) > 1e-2


def test_max_documents_comes_from_the_datas_documents_per_sequence():
    from mx_jax import train
    from mx_jax.config import load_config

    tokens = np.full(16 * 1000 + 1, 7, np.uint16)
    tokens[::3] = EOS  # a 16-token input holds 5 end-of-text tokens among its first 15: 6 documents
    windows = data.Windows([tokens], 16, "train")
    assert set(data.documents_per_window(windows, EOS).tolist()) == {6}
    dataset = data.Dataset(windows, windows, 256, "synthetic", EOS)
    cfg, note = train.with_data_documents(load_config(None, ["model.attention_mask=documents"]), dataset)
    assert (cfg.model.eos_id, cfg.model.max_documents) == (EOS, 8)  # the 99th percentile, 6, rounded up to 8
    assert "6.0 per sequence" in note and "99% have <= 6" in note and " 0.0% of them have more" in note
    cfg, note = train.with_data_documents(load_config(None, ["model.attention_mask=documents",
                                                              "model.max_documents=4"]), dataset)
    assert cfg.model.max_documents == 4 and "model.max_documents=4, 100.0% of them have more" in note
    assert train.with_data_documents(load_config(None, []), dataset)[1] == ""
    # context=2: M counts each of the 4 chunks of 4 tokens, whose first 3 hold one end-of-text token: 2 documents
    assert set(data.documents_per_window(windows, EOS, chunks=4).tolist()) == {2}
    cfg, note = train.with_data_documents(load_config(None, ["model.attention_mask=documents"]), dataset, context=2)
    assert cfg.model.max_documents == 8 and "2.0 per chunk of 4 tokens (mesh.context=2)" in note


def test_document_metrics_count_overflow_per_chunk_under_context_parallelism():
    from mx_jax import train
    from mx_jax.config import load_config

    m = load_config(None, ["model.attention_mask=documents", "model.eos_id=1", "model.max_documents=2"]).model
    inputs = jnp.asarray([[1, 1, 7, 7, 7, 7, 7, 7], [7, 7, 7, 7, 7, 7, 7, 7]])  # 3 and 1 documents
    whole = train._document_metrics(m, inputs)
    assert float(whole["documents_per_seq"]) == 2.0 and float(whole["doc_overflow_frac"]) == 0.5
    halves = train._document_metrics(m, inputs, chunks=2)  # row 0: 3 documents in its first half, 1 in its second
    assert float(halves["documents_per_seq"]) == 2.0 and float(halves["doc_overflow_frac"]) == 0.25
    assert train.document_chunks(1) == 1 and train.document_chunks(4) == 8


def test_the_estimate_counts_cudnns_packed_workspace():
    from mx_jax import memory_estimate
    from mx_jax.config import load_config

    base = ["model.n_layers=2", "data.seq_len=1024", "data.batch_size=2", "mesh.fsdp=1", "model.eos_id=0",
            "model.compute_dtype=bfloat16"]
    plain = memory_estimate.estimate(load_config("configs/llama3_debug.yaml", base))
    docs = memory_estimate.estimate(load_config("configs/llama3_debug.yaml", base + [
        "model.attention_mask=documents", "model.max_documents=4"]))
    m = load_config("configs/llama3_debug.yaml", base).model
    want = 2 * 4 * m.n_heads * 1024 * (8 * m.d_head + 4) / 1e9  # B M N T (8 K + 4) bytes
    assert docs["attention_workspace_gb"] == pytest.approx(want) and plain["attention_workspace_gb"] == 0
    assert docs["transient_gb"] - plain["transient_gb"] == pytest.approx(want, rel=0.05)


def test_a_context_parallel_run_trains_as_one_device_with_documents(tmp_path):
    """The train step at mesh.context=2 against mesh.context=1 (float32, two steps): the same losses and gradient
    norms."""
    from mx_jax import train

    runs = [train.train(tiny_config(tmp_path / f"c{n}", "model.attention_mask=documents", "steps=2",
                                    f"mesh.context={n}", "mesh.fsdp=1", "data.batch_size=4", "ckpt.every_steps=-1"),
                        jax.devices()[:n]) for n in (1, 2)]
    for key in ("loss", "grad_norm"):  # the norm shows a gradient off by a constant factor, which the loss does not
        got = [[json.loads(line)[key] for line in (tmp_path / f"c{n}" / "metrics.jsonl").read_text().splitlines()
                if "loss" in json.loads(line)] for n in (1, 2)]
        assert len(got[0]) == 2 and np.allclose(got[0], got[1], rtol=1e-5 if key == "loss" else 1e-4), (key, got)
    assert all(np.isfinite(r.metrics["loss"]) for r in runs)


def test_training_takes_the_datas_end_of_text_token_and_reports_documents(tmp_path, capsys):
    from mx_jax import train

    cfg = tiny_config(tmp_path / "run", "model.attention_mask=documents", "steps=2")
    result = train.train(cfg)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "eos_id: 0" in saved and "max_documents: 8" in saved  # NUL ends each file; 32-token windows hold 1-2
    assert "attn   | documents end with token 0 (the data's)" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "documents_per_seq" in r]
    assert logged and all(r["documents_per_seq"] >= 1 and 0 <= r["doc_overflow_frac"] <= 1 for r in logged)
    assert np.isfinite(result.metrics["loss"])


def test_documents_need_an_end_of_text_token(tmp_path):
    from mx_jax import train

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 40}) + "\n" for i in range(40)))
    data.convert([str(src)], str(tmp_path / "tok"), eos="none")
    cfg = tiny_config(tmp_path / "run", "model.attention_mask=documents", "data.source=bin",
                      f"data.path={tmp_path / 'tok'}", "data.seq_len=32")
    with pytest.raises(ConfigError, match="model.eos_id.*does not name one.*--eos"):
        train.train(cfg)
    assert not (tmp_path / "run").exists()
    ok = tiny_config(tmp_path / "run", "model.attention_mask=documents", "model.eos_id=10", "data.source=bin",
                     f"data.path={tmp_path / 'tok'}", "data.seq_len=32", "steps=1")
    train.train(ok)  # named in the config instead


@pytest.mark.gpu
def test_cudnn_packed_document_attention_matches_the_masked_scores():
    """cuDNN's packed layout (our offsets, grouped-query heads, a row past max_documents) against XLA's masked
    attention: outputs and the three gradients, bf16."""
    rng = np.random.default_rng(5)
    b, t, h, g, d = 2, 1024, 8, 2, 128
    q, k, v, w = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                  for s in ((b, t, h, d), (b, t, g, d), (b, t, g, d), (b, t, h, d)))
    tokens = np.full((b, t), 7)
    tokens[0, [99, 100, 517, 900]] = EOS  # documents of 100, 1, 417, 383 and 123 tokens
    tokens[1, np.arange(40, t, 41)] = EOS  # 25 documents: past max_documents = 16
    segments = document_segments(jnp.asarray(tokens), EOS, 16)

    def loss(impl):
        return lambda q, k, v: jnp.sum(document_attention(q, k, v, segments, impl, 16).astype(jnp.float32) * w)

    ours = jax.jit(jax.value_and_grad(loss("cudnn"), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        assert float(jnp.max(jnp.abs(got - want))) <= 2e-2 * float(jnp.max(jnp.abs(want)))


def test_a_dry_run_plans_documents_from_the_data_or_says_what_it_assumed():
    from tests.test_dry_run import ROOT, _dry_run

    debug = str(ROOT / "configs/llama3_debug.yaml")
    out = _dry_run("--config", debug, "model.attention_mask=documents")
    assert "attn   | documents end with token 0 (the data's)" in out and "compiled train step" in out
    assert "mesh.fsdp=-1 counts as 1 in a dry run" in out  # the debug config leaves fsdp at its default, -1
    out = _dry_run("--config", debug, "model.attention_mask=documents", "data.source=bin", "data.path=/nonexistent")
    assert "the data did not open here" in out and "planned for model.max_documents=16" in out
    assert "compiled train step" in out
