"""A checkpoint's loss on files of text (mx_jax/perplexity.py, `sample --loss`): windows, scores and the CLI."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mx_jax import choices, perplexity, sample, sharding, train
from mx_jax.config import ConfigError
from tests.helpers import tiny_config


@pytest.mark.parametrize("length,first,t,stride", [(10, 1, 4, 4), (10, 1, 4, 1), (23, 1, 8, 3), (30, 12, 8, 8),
                                                   (5, 1, 8, 8), (9, 4, 8, 2)])
def test_windows_score_every_target_once_with_enough_context(length, first, t, stride):
    """Every target seq[first:] is scored by exactly one window; a window holds at most t inputs; a scored target
    sees at least t - stride + 1 tokens before it, or all of them from the start of the sequence."""
    seen = []
    for start, end, done in perplexity.windows(list(range(length)), first, t, stride):
        assert 0 <= start and end - 1 - start <= t and start < done < end
        for p in range(done, end):
            seen.append(p)
            assert p - start >= min(p, t - stride + 1)
    assert seen == list(range(first, length))


def _docs(tmp_path, texts):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(t if isinstance(t, dict) else {"text": t}) + "\n" for t in texts))
    return path


def _model(tmp_path):
    cfg = tiny_config(tmp_path, "data.seq_len=16", "mesh.data=1", "mesh.fsdp=1", "model.init_std=0.5")
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        state = train.init_state(setup)
    from mx_jax.llama import with_compute
    return cfg, mesh, setup, with_compute(state["params"], state["compute"]), state["buffers"]


def test_scores_are_the_forwards_log_likelihoods(tmp_path):
    """A document within a row scores as one forward over the end-of-text token and it; a longer one (43 tokens)
    as one forward per disjoint window (stride = seq_len = 16), each from the window's first token; a prompt's
    tokens are context only. Loss, perplexity and bits per byte follow from the sums (module docstring)."""
    encode = lambda s: list(s.encode())  # noqa: E731
    texts = ["short one", "x" * 5 + "a longer document of forty or so bytes",
             {"prompt": "Q: 2+2? A:", "completion": " 4"}]
    cfg, mesh, setup, params, buffers = _model(tmp_path)
    eos = 0
    ts = perplexity.load(_docs(tmp_path, texts), encode, 256, 16, eos_id=eos, batch=4)
    n_long = len(texts[1])
    assert list(ts.tokens) == [9, n_long, 2] and list(ts.bytes) == [9, n_long, 2]
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        scores = choices.score(choices.make_step(setup.graphdef, jnp.float32), params, buffers, ts, 4)
        model = nnx.merge(setup.graphdef, params, buffers)

        def logp(seq):  # log-probabilities of seq[1:] after seq[:-1], one forward
            z = jax.nn.log_softmax(model(jnp.asarray([seq[:-1]]))[0][0], axis=-1)
            return np.asarray([float(z[i, t]) for i, t in enumerate(seq[1:])])

        want = [logp([eos] + encode(texts[0])).sum()]
        seq = [eos] + encode(texts[1])
        want.append(sum(logp(seq[s:s + 17]).sum() for s in range(0, len(seq) - 1, 16)))
        prompt = [eos] + encode("Q: 2+2? A:")
        want.append(logp(prompt + encode(" 4"))[-2:].sum())
    docs = perplexity.per_document(ts, scores)
    for d, w, n, b in zip(docs, want, ts.tokens, ts.bytes):
        assert d["loss"] == pytest.approx(-w / n, rel=1e-5, abs=1e-5)
        assert d["bits_per_byte"] == pytest.approx(-w / math.log(2) / b, rel=1e-5, abs=1e-5)
    got = perplexity.summary(ts, scores)
    total, n = -sum(want), 11 + n_long
    assert got["loss"] == pytest.approx(total / n, rel=1e-5) and got["tokens"] == n
    assert got["perplexity"] == pytest.approx(math.exp(total / n), rel=1e-4)
    assert got["bits_per_byte"] == pytest.approx(total / math.log(2) / n, rel=1e-5)
    assert got["loss"] > 1  # weights that make the scores depend on the text

    overlapping = perplexity.load(_docs(tmp_path, texts[1:2]), encode, 256, 16, eos_id=eos, stride=4, batch=4)
    # 44 positions, windows of 16 starting every 4: 8 rows, each token scored once
    assert overlapping.rows == 8 and int((overlapping.targets >= 0).sum()) == n_long


def test_the_first_token_of_a_document_without_an_end_of_text_token_is_not_scored(tmp_path):
    ts = perplexity.load(_docs(tmp_path, ["abc", "d"]), lambda s: list(s.encode()), 256, 16, eos_id=None)
    assert list(ts.tokens) == [2] and ts.rows == 1  # "d" alone has nothing to be scored after


def test_a_text_file_is_scored_on_the_bytes_the_converter_trains_on(tmp_path):
    """A Latin-1 file, byte-tokenized: its own 6 bytes (as `data convert` writes them), not the UTF-8 of its
    decoding with U+FFFD in place of each invalid byte (3 bytes each)."""
    from mx_jax import data

    f = tmp_path / "latin1.txt"
    f.write_bytes("café!!".encode("latin-1"))
    ts = perplexity.load(f, lambda s: list(s.encode()), 256, 16, eos_id=0)
    assert list(ts.bytes) == [6] and list(ts.tokens) == [6]
    np.testing.assert_array_equal(ts.inputs[0, :6], [0, *f.read_bytes()[:5]])
    (tmp_path / "docs").mkdir()
    f.rename(tmp_path / "docs" / f.name)
    (tmp_path / "docs" / "other.txt").write_text("hello world")
    data.convert([str(tmp_path / "docs")], str(tmp_path / "tok"), tokenizer="byte")
    ids = np.concatenate([np.fromfile(b, np.uint16) for b in sorted((tmp_path / "tok").glob("*.bin"))])
    assert len(ids) == 6 + 11 + 2 and 0xE9 in ids  # the bytes themselves, each document then its end-of-text


def test_sample_loss_prints_each_file_and_writes_each_document(tmp_path, capsys):
    run = tmp_path / "run"
    train.train(tiny_config(run, "steps=2", "mesh.data=1", "mesh.fsdp=1", "log.eval_every_steps=-1"),
                devices=jax.devices()[:1])
    one = _docs(tmp_path, ["def f(x):\n    return x\n", "import os\n" * 10])
    other = tmp_path / "plain.txt"
    other.write_text("print('hello')\n")
    out = tmp_path / "losses.jsonl"
    assert sample.main([str(run), "--loss", f"{one},{other}", "--out", str(out), "--stride", "16"]) == 0
    printed = capsys.readouterr().out
    assert f"{one}: 2 documents, " in printed and f"{other}: 1 documents, 15 tokens: loss " in printed
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(d["index"], d["tokens"]) for d in docs] == [(0, 23), (1, 100), (0, 15)]
    assert all(d["loss"] > 0 for d in docs)
    if jax.device_count() >= 2:  # (8 CPU devices; a GPU machine may have one)
        assert sample.main([str(run), "--loss", str(one), "--stride", "16", "--devices", "2"]) == 0  # the same, split
        line = next(x for x in printed.splitlines() if x.startswith(f"{one}:"))
        assert capsys.readouterr().out.split(" (")[0] == line.split(" (")[0]
    for flags, message in ((["--loss", str(one), "--choices", str(one)], "--loss scores files of text"),
                           (["--stride", "4"], "--stride goes with --loss"),
                           (["--loss", str(one), "--stride", "999"], "--stride: must be between 1 and"),
                           (["--loss", str(tmp_path / "nope.jsonl")], "nope.jsonl is not a file")):
        assert sample.main([str(run), *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags
    chat = _docs(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="a chat record"):
        perplexity.load(chat, lambda s: list(s.encode()), 256, 16)


def test_the_trainer_measures_the_texts_at_each_eval_on_its_mesh_as_sample_does(tmp_path, capsys):
    """log.eval_texts: each file's loss and bits per byte at every evaluation, from rows on the training mesh (data
    2 x fsdp 4 CPU devices), equal to `sample --loss` on one device from the checkpoint; a file that cannot be read
    stops the run before anything is written, naming the config key."""
    one = _docs(tmp_path, ["def f(x):\n    return x\n", "import os\n" * 10])
    other = tmp_path / "plain.txt"
    other.write_text("print('hello')\n" * 3)
    run = tmp_path / "run"
    layout = ("mesh.data=2", "mesh.fsdp=4") if jax.device_count() >= 8 else ("mesh.data=-1", "mesh.fsdp=1")  # a GPU
    result = train.train(tiny_config(run, "steps=2", *layout, "log.eval_every_steps=2",
                                     f"log.eval_texts={one},{other}"))
    m = result.metrics
    out = capsys.readouterr().out
    assert "2 documents, 123 tokens (5 windows) from" in out and "1 documents, 45 tokens (2 windows)" in out
    assert f"| texts docs {m['text_loss/docs']:.4f} ({m['text_bpb/docs']:.3f} bpb), plain " in out
    assert sample.main([str(run), "--loss", f"{one},{other}"]) == 0
    printed = capsys.readouterr().out
    for name, path in (("docs", one), ("plain", other)):
        line = next(x for x in printed.splitlines() if x.startswith(f"{path}:"))
        assert float(line.split("loss ")[1].split()[0]) == pytest.approx(m[f"text_loss/{name}"], abs=2e-4)
        assert float(line.split("perplexity ")[1].split(", ")[1].split()[0]) == pytest.approx(
            m[f"text_bpb/{name}"], abs=2e-4)
    bad = _docs(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="config key 'log.eval_texts': .*a chat record"):
        train.train(tiny_config(tmp_path / "other", f"log.eval_texts={bad}"))
    assert not (tmp_path / "other").exists()
    # the trainer's errors name its config key, not the sampler's flags
    nobody = _docs(tmp_path, [{"body": "x"}])
    for value, message in ((tmp_path / "none.jsonl", r"^config key 'log.eval_texts': .*none.jsonl is not a file$"),
                           (nobody, r"^config key 'log.eval_texts': .*no 'text' field, nor .*\(has: body\)$")):
        with pytest.raises(ConfigError, match=message) as e:
            train.train(tiny_config(tmp_path / "other", f"log.eval_texts={value}"))
        assert "--" not in str(e.value), e.value


def test_chat_records_score_their_replies_as_the_converter_marks_them(tmp_path):
    """A chat record scores the assistant replies (chatml, bytes), each piece tokenized alone: the loss of one
    forward over the rendered conversation at the replies' positions; without a template it stops, naming it."""
    msgs = [{"role": "user", "content": "Say fig."}, {"role": "assistant", "content": "fig"},
            {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "fig fig"}]
    path = _docs(tmp_path, [{"messages": msgs}])
    cfg, mesh, setup, params, buffers = _model(tmp_path)
    encode = lambda s: list(s.encode())  # noqa: E731
    ts = perplexity.load(path, encode, 256, 16, eos_id=0, stride=8, batch=4, chat_template="chatml")
    from mx_jax import data
    segs = data.ChatTemplate("chatml", "byte", "test").segments(msgs, "test")
    replies = [t for t, trained in segs if trained]
    assert [t.split("<|im_end|>")[0] for t in replies] == ["fig", "fig fig"]
    assert ts.tokens[0] == ts.bytes[0] == sum(len(t.encode()) for t in replies)
    seq, scored = [0], [False]
    for t, trained in segs:
        seq += encode(t)
        scored += [trained] * len(encode(t))
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        got = choices.score(choices.make_step(setup.graphdef, jnp.float32), params, buffers, ts, 4)
        # the reference: each scored token after the 8 (= seq_len - stride) or more tokens before it that its
        # window holds; one forward per scored token over exactly that window
        model = nnx.merge(setup.graphdef, params, buffers)
        want = 0.0
        for s, e, f in perplexity.windows(seq, scored.index(True), 16, 8):
            z = jax.nn.log_softmax(model(jnp.asarray([seq[s:e - 1]]))[0][0], axis=-1)
            want += sum(float(z[p - s - 1, seq[p]]) for p in range(max(f, s + 1), e) if scored[p])
    assert float(np.sum(got[:ts.rows])) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ConfigError, match="a chat record needs a chat template"):
        perplexity.load(path, encode, 256, 16)
