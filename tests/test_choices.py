"""mx_jax.choices: multiple-choice evaluation by log-likelihood, from a checkpoint and inside the trainer."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mx_jax import choices, sample, sharding, train
from mx_jax.config import ConfigError
from mx_jax.moe import hidden_split as moe_split
from tests.helpers import need_devices, tiny_config


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _byte(s):
    return list(s.encode())


RECORDS = [{"context": "def add(a, b):\n    return", "choices": [" a + b", " a - b\n", " None"], "answer": 0},
           {"query": "import numpy as", "choices": [" np", " numpy_module_alias"], "gold": 1},
           {"prompt": "for i in range(10):\n   ", "choices": [" print(i)", " pass", " break", " i += 1"], "label": 2}]


def test_rows_hold_the_context_then_the_choice_whose_tokens_alone_are_targets(tmp_path):
    cs = choices.load(_write(tmp_path / "c.jsonl", RECORDS), _byte, 256, 64, batch=4)
    assert (cs.records, cs.rows, cs.inputs.shape) == (3, 9, (12, 64))  # 9 rows padded to a multiple of 4
    assert list(cs.record) == [0, 0, 0, 1, 1, 2, 2, 2, 2, -1, -1, -1] and list(cs.answers) == [0, 1, 2]
    ctx, cont = _byte(RECORDS[0]["context"]), _byte(RECORDS[0]["choices"][1])
    seq = ctx + cont
    np.testing.assert_array_equal(cs.inputs[1, :len(seq) - 1], seq[:-1])
    want = np.full(64, -1)
    want[len(ctx) - 1:len(seq) - 1] = cont  # the targets after the context's last token are the choice's tokens
    np.testing.assert_array_equal(cs.targets[1], want)
    assert cs.chars[1] == len(RECORDS[0]["choices"][1]) and (cs.targets[9:] == -1).all()
    short = choices.load(tmp_path / "c.jsonl", _byte, 256, 20)  # rows of 20: long contexts keep their end
    row = short.targets[0] >= 0
    assert row.sum() == len(" a + b") and short.inputs.shape == (9, 20)
    # as much context as the record's longest choice (" a - b\n", 7 tokens) leaves room for, for every choice
    kept = ctx[-(21 - max(len(_byte(c)) for c in RECORDS[0]["choices"])):]
    seq = kept + _byte(" a + b")
    np.testing.assert_array_equal(short.inputs[0, :len(seq) - 1], seq[:-1])
    np.testing.assert_array_equal(short.inputs[1, :20], kept + _byte(" a - b\n")[:-1])


@pytest.mark.parametrize("record,message", [
    ({"choices": ["a", "b"], "answer": 0}, "no 'context' / 'query' / 'prompt' field"),
    ({"context": "x", "choices": ["a"], "answer": 0}, "two or more non-empty texts"),
    ({"context": "x", "choices": ["a", "b"], "answer": 2}, "the index of one of its 2 choices, got 2"),
    ({"context": "x", "choices": ["a", "b"], "answer": True}, "got True"),
    ({"context": "", "choices": ["a", "b"], "answer": 0}, "an empty context"),
    ({"context": "x", "choices": ["a" * 40, "b"], "answer": 0}, "a choice of 40 tokens leaves no room"),
    ({"context": "\u00e9", "choices": ["a", "b"], "answer": 0}, "token id 195 is outside the model's vocabulary"),
    ("[1, 2]", "a JSON list, not an object"),
])
def test_bad_records_are_named_with_their_line(tmp_path, record, message):
    path = _write(tmp_path / "c.jsonl", [RECORDS[0], record])
    with pytest.raises(ConfigError, match="c.jsonl:2: .*" + message.replace("(", r"\(").replace("[", r"\[")):
        choices.load(path, _byte, 128, 32)


def test_a_file_that_is_not_utf8_is_named_and_a_line_separator_inside_a_text_is_not_a_line(tmp_path):
    (tmp_path / "bin.jsonl").write_bytes(b"\xc2\x00\xff binary")
    with pytest.raises(ConfigError, match=r"bin.jsonl is not UTF-8 text \(byte 0"):
        choices.load(tmp_path / "bin.jsonl", _byte, 256, 64)
    record = {"context": "a\u2028b", "choices": ["c", "d"], "answer": 1}  # U+2028, which JSON writes unescaped
    (tmp_path / "sep.jsonl").write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    assert choices.load(tmp_path / "sep.jsonl", lambda t: _byte(t.encode("ascii", "replace").decode()), 256,
                        64).records == 1


def test_several_files_need_different_names(tmp_path):
    (tmp_path / "a").mkdir()
    one, two = _write(tmp_path / "c.jsonl", RECORDS), _write(tmp_path / "a" / "c.jsonl", RECORDS)
    with pytest.raises(ConfigError, match="must have different names"):
        choices.load_files(f"{one},{two}", _byte, 256, 64)
    assert [cs.records for cs in choices.load_files(f"{one}, ", _byte, 256, 64)] == [3]


def test_accuracy_per_choice_and_per_character(tmp_path):
    cs = choices.load(_write(tmp_path / "c.jsonl", RECORDS), _byte, 256, 64)
    # record 0: the answer has the largest sum, the longer second choice the largest score per character;
    # records 1 and 2 are right either way
    scores = np.array([-5.0, -5.5, -9.0, -10.0, -3.0, -1.0, -2.0, -0.5, -3.0])
    assert choices.accuracy(cs, scores) == {"choice_acc": 1.0, "choice_acc_norm": 2 / 3}


def test_scores_are_each_choices_log_likelihood_after_its_context(tmp_path):
    """A batch of right-padded rows scores each choice as a forward over that context and choice alone does."""
    run = tmp_path / "run"
    train.train(tiny_config(run, "steps=2", "mesh.data=1", "mesh.fsdp=1", "log.eval_every_steps=-1"),
                devices=jax.devices()[:1])
    cfg = sample.load_config(str(run / "config.yaml"), [])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    cs = choices.load(_write(tmp_path / "c.jsonl", RECORDS), _byte, 256, cfg.data.seq_len, batch=4)
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        params, buffers = sample.load_model_state(cfg, setup, run, None)
        got = choices.score(choices.make_step(setup.graphdef, jnp.float32), params, buffers, cs, 4)
        model = nnx.merge(setup.graphdef, params, buffers)
        for row in range(cs.rows):
            rec = RECORDS[cs.record[row]]
            ctx = _byte(rec.get("context") or rec.get("query") or rec.get("prompt"))
            cont = _byte(rec["choices"][row - int(np.flatnonzero(cs.record == cs.record[row])[0])])
            longest = max(len(_byte(c)) for c in rec["choices"])  # a long context keeps what its longest leaves
            seq = ctx[-(cfg.data.seq_len + 1 - longest):] + cont
            logp = jax.nn.log_softmax(model(jnp.asarray([seq[:-1]]))[0][0], axis=-1)
            want = sum(float(logp[len(seq) - 1 - len(cont) + i, t]) for i, t in enumerate(cont))
            np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-4)


def test_the_trainer_scores_choices_at_each_eval_on_its_mesh_as_sample_does_on_one_device(tmp_path, capsys):
    path, other = _write(tmp_path / "c.jsonl", RECORDS * 3), _write(tmp_path / "d.jsonl", RECORDS[1:])
    run = tmp_path / "run"
    layout = ("mesh.data=2", "mesh.fsdp=4") if jax.device_count() >= 8 else ("mesh.data=-1", "mesh.fsdp=1")  # a GPU
    result = train.train(tiny_config(run, "steps=2", *layout, "log.eval_every_steps=2",
                                     f"log.eval_choices={path},{other}"))
    m = result.metrics
    for k in ("choice_acc", "choice_acc_norm"):  # each file's, and their plain mean
        assert 0 <= m[f"{k}/c"] <= 1 and 0 <= m[f"{k}/d"] <= 1
        assert m[k] == pytest.approx((m[f"{k}/c"] + m[f"{k}/d"]) / 2)
    out = capsys.readouterr().out
    assert "9 multiple-choice records (27 rows of at most 32 tokens)" in out and "2 multiple-choice records" in out
    assert f"| choices {100 * m['choice_acc']:.1f}% (norm {100 * m['choice_acc_norm']:.1f}%; c " in out
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["choice_acc/d"] == m["choice_acc/d"]
    for flag, value, said in (("--choices", ",", "name no file"), ("--loss", " , ", "names no file"),
                              ("--choices", str(tmp_path), "is a directory")):
        assert sample.main([str(run), flag, value]) == 2, (flag, value)
        assert said in capsys.readouterr().err, (flag, value)
    out_file = tmp_path / "scores.jsonl"
    assert sample.main([str(run), "--choices", f"{path},{other}", "--batch", "8", "--out", str(out_file)]) == 0
    printed = capsys.readouterr().out
    written = [json.loads(line) for line in out_file.read_text().splitlines()]
    for name in ("c", "d"):
        assert (f"{name}.jsonl: {9 if name == 'c' else 2} records, accuracy {100 * m['choice_acc/' + name]:.2f}% "
                f"(per character: {100 * m['choice_acc_norm/' + name]:.2f}%)") in printed
        mine = [r for r in written if r["file"].endswith(f"{name}.jsonl")]
        assert len(mine) == (9 if name == "c" else 2)
        assert np.mean([r["right"] for r in mine]) == pytest.approx(m[f"choice_acc/{name}"])
        assert np.mean([r["right_norm"] for r in mine]) == pytest.approx(m[f"choice_acc_norm/{name}"])
    first = written[0]  # the first record of c.jsonl (RECORDS[0]: three choices, the answer 0)
    assert (first["line"], first["answer"], len(first["scores"]), first["chars"]) == (1, 0, 3, [6, 7, 5])
    assert first["choice"] == int(np.argmax(first["scores"])) and first["right"] == (first["choice"] == 0)
    assert [r["line"] for r in written[:9]] == list(range(1, 10))
    # the scores behind them: on the run's mesh (8 CPU devices) as on one device (float32 compute)
    cfg = sample.load_config(str(run / "config.yaml"), [])
    cs = train.load_choices(cfg)[0]
    mesh = sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        on_mesh = train.make_row_scores(train.build(cfg, mesh), cs)(result.state)
    cfg = sample.load_config(str(run / "config.yaml"), ["mesh.data=1", "mesh.fsdp=1"])
    one = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    with jax.set_mesh(one):
        setup = train.build(cfg, one)
        params, buffers = sample.load_model_state(cfg, setup, run, None)
        alone = choices.score(choices.make_step(setup.graphdef, jnp.float32), params, buffers, cs, 16)
    np.testing.assert_allclose(on_mesh[:cs.rows], alone[:cs.rows], rtol=1e-5, atol=1e-4)
    assert np.ptp(alone[:cs.rows]) > 1  # scores that tell the choices apart
    with pytest.raises(ConfigError, match="config key 'log.eval_choices': choices file .*nope.jsonl does not exist"):
        train.train(tiny_config(tmp_path / "other", f"log.eval_choices={tmp_path / 'nope.jsonl'}"))
    assert not (tmp_path / "other").exists()


def test_choice_scores_under_context_parallelism_equal_one_device(tmp_path):
    """Rows split over a context axis (zigzag chunks, their length a multiple of 2 x context) score as on one
    device; the same initial parameters on both meshes."""
    path = _write(tmp_path / "c.jsonl", RECORDS)
    scores = []
    for layout in (("mesh.data=1", "mesh.fsdp=4", "mesh.context=2"), ("mesh.data=1", "mesh.fsdp=1")):
        cfg = tiny_config(tmp_path, *layout, f"log.eval_choices={path}")
        mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:8 if "mesh.context=2" in layout else 1])
        with jax.set_mesh(mesh):
            setup = train.build(cfg, mesh)
            (cs,) = train.load_choices(cfg, mesh.shape["context"])
            scores.append(train.make_row_scores(setup, cs)(train.init_state(setup))[:cs.rows])
    np.testing.assert_allclose(scores[0], scores[1], rtol=1e-5, atol=1e-4)


def _varied_records(n: int, seed: int = 0) -> list[dict]:
    """Records with contexts of 20-300 letters and 2-5 choices of 1-20, so that batches differ in width."""
    rng = np.random.default_rng(seed)
    text = lambda lo, hi: "".join(chr(97 + c) for c in rng.integers(0, 26, int(rng.integers(lo, hi))))
    return [{"context": text(20, 300), "choices": [" " + text(1, 20) for _ in range(2 + i % 4)], "answer": 0}
            for i in range(n)]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cached_scorer_gives_the_row_forwards_scores(tmp_path, moe):
    """choices.CachedScorer (a batch's contexts once into a KV cache, then each choice against it) scores every choice
    as the rows' forward does: contexts of 20-300 tokens (left-padded to 128 or 256) in rows of at most 256, so that the
    longer ones keep only their end, as much as the record's longest choice leaves room for (the same for every choice
    of it, in both scorers), 2-5 choices, 7 records in batches of 3 (the last padded); also split over 2 devices
    (`sample.tensor_parallel`: heads, hidden width, a MoE model's routed experts along theirs under `moe.hidden_split`).
    Weights drawn with std 0.5, so that the scores depend on the context."""
    from mx_jax.llama import with_compute

    path = _write(tmp_path / "c.jsonl", _varied_records(7))
    extra = ["model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.score=sigmoid"] if moe else []
    cfg = tiny_config(tmp_path, "data.seq_len=256", "mesh.data=1", "mesh.fsdp=1", "model.init_std=0.5", *extra)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    cs = choices.load(path, _byte, 256, cfg.data.seq_len, batch=4)
    assert sum(len(r["context"]) + max(map(len, r["choices"])) > 257 for r in _varied_records(7)) >= 2  # truncated
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):  # no TF32 on a GPU
        setup = train.build(cfg, mesh)
        state = train.init_state(setup)
        params, buffers = with_compute(state["params"], state["compute"]), state["buffers"]
        rows = choices.score(choices.make_step(setup.graphdef, jnp.float32), params, buffers, cs, 4)[:cs.rows]
        cached = choices.CachedScorer(setup.graphdef, cfg.model).score(params, buffers, cs, 3)[:cs.rows]
    assert np.ptp(rows) > 5
    np.testing.assert_allclose(cached, rows, rtol=1e-5, atol=1e-4)
    need_devices(2)
    split = sample.tensor_parallel(setup, jax.devices()[:2])
    params, buffers = jax.device_put(params, split.params), jax.device_put(buffers, split.buffers)
    with jax.default_matmul_precision("highest"), moe_split(split.mesh):
        on_two = choices.CachedScorer(setup.graphdef, cfg.model, split.cache).score(params, buffers, cs, 3)[:cs.rows]
    np.testing.assert_allclose(on_two, rows, rtol=1e-5, atol=1e-4)


def test_rows_run_cut_to_each_batchs_longest(tmp_path):
    """choices.score takes the rows longest first and cuts each batch to its longest row rounded up to 128 tokens:
    a file of contexts of 20-300 tokens runs batches 384, 256 and 128 tokens wide, with the scores of its whole
    rows (384 tokens) in file order."""
    from mx_jax.llama import with_compute

    cs = choices.load(_write(tmp_path / "c.jsonl", _varied_records(12, seed=1)), _byte, 256, 512, batch=4)
    assert cs.inputs.shape[1] == 384
    cfg = tiny_config(tmp_path, "data.seq_len=512", "mesh.data=1", "mesh.fsdp=1", "model.init_std=0.5")
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        setup = train.build(cfg, mesh)
        state = train.init_state(setup)
        params, buffers = with_compute(state["params"], state["compute"]), state["buffers"]
        step = choices.make_step(setup.graphdef, jnp.float32)
        widths = []
        seen = lambda p, b, x, y: widths.append(x.shape[1]) or step(p, b, x, y)  # noqa: E731
        got = choices.score(seen, params, buffers, cs, 4)
        whole = np.concatenate([np.asarray(step(params, buffers, cs.inputs[i:i + 4], cs.targets[i:i + 4]))
                                for i in range(0, len(cs.inputs), 4)])
    assert sorted(set(widths)) == [128, 256, 384] and widths == sorted(widths, reverse=True)
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-4)
    assert np.ptp(got[:cs.rows]) > 5 and (cs.lengths[cs.rows:] == 0).all()
