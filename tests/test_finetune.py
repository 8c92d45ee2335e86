"""Fine-tuning data: prompt/completion and chat examples, their loss masks, and the loss that leaves prompts out."""

from __future__ import annotations

import json
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mx_jax import data
from mx_jax.config import ConfigError, DataConfig


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _tokens_and_masks(d, split):
    """Each split's tokens and loss-mask bits, the shards concatenated (read back as the trainer's loader does)."""
    arrays, files, _ = data.load_shards(str(d), split)
    masks = data.load_masks(str(d), files, arrays)
    bits = [np.unpackbits(m, bitorder="little")[:len(a)].astype(bool) for a, m in zip(arrays, masks)]
    return np.concatenate(arrays), np.concatenate(bits)


def _examples(ids, mask, eos):
    """(tokens, mask) per example, cut after each end-of-text token."""
    cuts = np.flatnonzero(ids == eos) + 1
    return list(zip(np.split(ids, cuts)[:-1], np.split(mask, cuts)[:-1]))


def _text(ids):
    return bytes(np.asarray(ids, np.uint8)).decode()


def _trained_pieces(toks, mask):
    """The texts of an example's runs of target tokens, in order."""
    starts = np.concatenate([[0], np.flatnonzero(np.diff(mask.astype(int))) + 1])
    return [_text(toks[a:b]) for a, b in zip(starts, [*starts[1:], len(toks)]) if mask[a]]


def _arithmetic(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt": f"What is {a} + {b}? ", "completion": f"{a + b}."} for a, b in rng.integers(0, 999, (n, 2))]


def test_prompt_completion_trains_only_the_completion_and_the_end_of_text(tmp_path):
    records = _arithmetic(200)
    meta = data.convert([str(_write_jsonl(tmp_path / "qa.jsonl", records))], str(tmp_path / "tok"),
                        shard_tokens=1500, val_fraction=0.1)
    assert meta["loss_mask"] and meta["examples"] == 200 and meta["documents"] == 200
    assert len(list((tmp_path / "tok").glob("train_*.mask"))) > 1  # one mask per shard, several shards
    seen = []
    for split in ("train", "val"):
        ids, mask = _tokens_and_masks(tmp_path / "tok", split)
        assert meta[f"{split}_target_tokens"] == mask.sum() and meta[f"{split}_tokens"] == len(ids)
        for toks, m in _examples(ids, mask, 0):
            prompt, completion = _text(toks[~m]), _text(toks[m][:-1])
            assert m[-1] and toks[-1] == 0  # the end-of-text token after a completion is trained
            assert np.all(np.diff(m.astype(int)) >= 0)  # prompt first, then completion: one switch
            seen.append({"prompt": prompt, "completion": completion})
    assert sorted(map(str, seen)) == sorted(map(str, records))


def test_batches_mark_prompt_targets_minus_one_in_any_slice_of_the_window(tmp_path):
    data.convert([str(_write_jsonl(tmp_path / "qa.jsonl", _arithmetic(300)))], str(tmp_path / "tok"))
    ds = data.open_dataset(DataConfig(source="bin", path=str(tmp_path / "tok"), seq_len=37))
    assert "loss masks (" in ds.description
    batches = data.Batches(ds.train, 4, seed=3)
    inputs, targets = batches.rows(0, 0, 4, 0, 37)
    for r in range(4):
        win = ds.train.get(batches._window(r))
        mask = ds.train.get_mask(batches._window(r))
        np.testing.assert_array_equal(inputs[r], win[:-1])
        np.testing.assert_array_equal(targets[r], np.where(mask[1:], win[1:].astype(np.int32), -1))
    assert 0 < (targets >= 0).mean() < 0.5
    # a context-parallel process reads a slice of the sequence: bits at odd offsets within the packed bytes
    for t0, t1 in ((5, 18), (13, 37), (1, 2)):
        _, part = batches.rows(0, 0, 4, t0, t1)
        np.testing.assert_array_equal(part, targets[:, t0:t1])


def test_chat_trains_the_assistant_replies_with_their_end_of_turn(tmp_path):
    convo = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of France?"},
             {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"},
             {"role": "assistant", "content": "Rome."}]
    records = [{"messages": convo}] * 3 + [{"messages": convo[:2]}]  # the last has no reply: nothing to train
    meta = data.convert([str(_write_jsonl(tmp_path / "chat.jsonl", records))], str(tmp_path / "tok"),
                        chat_template="chatml", val_fraction=0)
    assert meta["examples"] == 4 and meta["examples_without_reply"] == 1 and meta["chat_template"] == "chatml"
    parts = [_tokens_and_masks(tmp_path / "tok", split) for split in ("train", "val")]
    examples = [ex for ids, mask in parts for ex in _examples(ids, mask, 0)]
    assert len(examples) == 3
    for toks, m in examples:
        assert _text(toks[:-1]) == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nCapital of "
                                    "France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\n"
                                    "And of Italy?<|im_end|>\n<|im_start|>assistant\nRome.<|im_end|>\n")
        assert _trained_pieces(toks, m) == ["Paris.<|im_end|>\n", "Rome.<|im_end|>\n\0"]


def _llama3_like(tmp_path):
    """A small BPE with Llama 3's special tokens, and a tokenizer_config.json holding Llama 3's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is the capital of France? Paris is the capital.", "user assistant system"] * 30
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=["[UNK]", *specials],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path / "model"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    template = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
                "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
                "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}, "chat_template": template}))
    return tok, d


def test_a_hf_tokenizer_uses_the_chat_template_beside_it(tmp_path):
    pytest.importorskip("tokenizers")
    tok, d = _llama3_like(tmp_path)
    convo = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "Paris is the capital."}]
    meta = data.convert([str(_write_jsonl(tmp_path / "chat.jsonl", [{"messages": convo}] * 4))],
                        str(tmp_path / "tok"), tokenizer=str(d / "tokenizer.json"), val_fraction=0)
    assert meta["chat_template"].endswith("tokenizer_config.json") and meta["eos_id"] == tok.token_to_id(
        "<|end_of_text|>")
    ids, mask = _tokens_and_masks(tmp_path / "tok", "train")
    examples = _examples(ids, mask, meta["eos_id"])
    assert len(examples) >= 3
    toks, m = examples[0]
    assert toks[0] == tok.token_to_id("<|begin_of_text|>")  # the template's bos_token, from tokenizer_config.json
    # the prompt up to the generation prompt, tokenized on its own; then the reply, its <|eot_id|>, the end of text
    prompt = tok.encode("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of "
                        "France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
                        add_special_tokens=False).ids
    reply = tok.encode("Paris is the capital.<|eot_id|>", add_special_tokens=False).ids
    np.testing.assert_array_equal(toks, [*prompt, *reply, meta["eos_id"]])
    np.testing.assert_array_equal(m, [False] * len(prompt) + [True] * (len(reply) + 1))


def test_sample_tokenizer_keeps_the_end_of_turn_token_and_names_a_wrong_file(tmp_path):
    """An exact answer's reference ends with the chat's end-of-turn token: the sampler's decode keeps special tokens
    as its encode reads them, so a reply drawn token for token equals it. A JSON file that is no tokenizer.json (a
    model's config.json) is an error naming it, in `sample` and in `data convert`."""
    pytest.importorskip("tokenizers")
    from mx_jax import sample

    _, d = _llama3_like(tmp_path)
    tok = sample.Tokenizer(str(d / "tokenizer.json"))
    reply = "Paris is the capital.<|eot_id|>"
    assert tok.decode(tok.encode(reply)) == reply
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="config.json: not a tokenizers tokenizer.json"):
        sample.Tokenizer(str(config))
    with pytest.raises(SystemExit, match="config.json is not a tokenizers tokenizer.json"):
        data.convert([str(_write_jsonl(tmp_path / "docs.jsonl", [{"text": "hi"}]))], str(tmp_path / "out"),
                     tokenizer=str(config))
    assert not (tmp_path / "out").exists()


def test_fine_tuning_records_errors_name_the_record_and_leave_nothing(tmp_path):
    out = tmp_path / "new" / "tok"

    def fails(match, records, **kw):
        with pytest.raises(SystemExit, match=match):
            data.convert([str(_write_jsonl(tmp_path / "in.jsonl", records))], str(out), **kw)
        assert not (tmp_path / "new").exists()

    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    fails(r"in.jsonl:2: chat messages, but no chat template: the byte tokenizer has none; pass --chat-template",
          [{"text": "a plain document first"}, chat])
    fails(r"in.jsonl:1: 'messages' must be a list of", [{"messages": [{"role": "user"}]}], chat_template="chatml")
    fails(r"in.jsonl:1: field 'completion' holds int", [{"prompt": "2+2=", "completion": 4}])
    # a template that numbers the turns from the end renders a prefix differently from the whole conversation
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ messages | length - loop.index }}:{{ m['content'] }}"
                                        "\n{% endfor %}")
    fails(r"in.jsonl:1: the chat template \(.*bad.jinja\) does not render this conversation prefix by prefix",
          [chat], chat_template=str(tmp_path / "bad.jinja"))
    (tmp_path / "raises.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    fails(r"in.jsonl:1: the chat template .* refused the conversation: roles must alternate", [chat],
          chat_template=str(tmp_path / "raises.jinja"))
    fails(r"--chat-template nowhere.jinja: neither 'chatml' nor an existing file", [chat],
          chat_template="nowhere.jinja")
    fails(r"no documents in 1 input file\(s\): every one was empty or an example without a reply \(2\)",
          [{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "only a prompt", "completion": ""}],
          chat_template="chatml")


def test_plain_documents_beside_examples_are_trained_whole_and_alone_need_no_masks(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _write_jsonl(src / "docs.jsonl", [{"text": f"document number {i}\n"} for i in range(40)])
    plain = data.convert([str(src)], str(tmp_path / "plain"))
    assert "loss_mask" not in plain and not list((tmp_path / "plain").glob("*.mask"))
    _write_jsonl(src / "qa.jsonl", _arithmetic(40))
    # small shards: those of the documents (read first) are written before the first example comes; they get their
    # masks (all ones) at the end
    mixed = data.convert([str(src)], str(tmp_path / "mixed"), val_fraction=0, shard_tokens=300)
    assert len(list((tmp_path / "mixed").glob("train_*.mask"))) == len(list((tmp_path / "mixed").glob("train_*.bin")))
    ids, mask = _tokens_and_masks(tmp_path / "mixed", "train")
    for toks, m in _examples(ids, mask, 0):
        assert m.all() == _text(toks).startswith("document number")
    assert mixed["examples"] == 40 and mixed["documents"] == 80


def test_loss_masks_that_do_not_match_their_shards_are_an_error(tmp_path):
    data.convert([str(_write_jsonl(tmp_path / "qa.jsonl", _arithmetic(100)))], str(tmp_path / "tok"))
    cfg = DataConfig(source="bin", path=str(tmp_path / "tok"), seq_len=16)
    mask = tmp_path / "tok" / "train_00000.mask"
    mask.write_bytes(mask.read_bytes()[:-1])
    with pytest.raises(ConfigError, match=r"loss mask .*train_00000.mask has \d+ bytes; its shard's \d+ tokens need"):
        data.open_dataset(cfg)
    mask.unlink()
    with pytest.raises(ConfigError, match=r"meta.json says the shards have loss masks, but .*train_00000.mask is "
                                          r"missing"):
        data.open_dataset(cfg)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("vocab_parallel", [False, True])
def test_cross_entropy_leaves_minus_one_targets_out(dtype, tol, vocab_parallel):
    from mx_jax.llama import cross_entropy

    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((3, 9, 40)) * 3, dtype)
    targets = rng.integers(0, 40, (3, 9))
    keep = rng.random((3, 9)) < 0.4
    keep[1] = False  # a whole row of prompt
    masked = jnp.asarray(np.where(keep, targets, -1), jnp.int32)

    def naive(z):
        z = z.astype(jnp.float32)
        nll = jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, jnp.asarray(targets)[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(keep, nll, 0.0)) / keep.sum()

    loss, grad = jax.value_and_grad(lambda z: cross_entropy(z, masked, vocab_parallel, keep.sum()))(logits)
    ref_loss, ref_grad = jax.value_and_grad(naive)(logits)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    grad = np.asarray(grad, np.float32)
    np.testing.assert_allclose(grad, np.asarray(ref_grad, np.float32), rtol=tol, atol=tol / 50)
    assert np.all(grad[~keep] == 0) and np.abs(grad[keep]).max() > 0
    # every target counted and no count given: the plain mean, as before loss masks
    full = cross_entropy(logits, jnp.asarray(targets, jnp.int32), vocab_parallel)
    z = np.asarray(logits, np.float64)
    nll = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1) - np.take_along_axis(
        z, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(full), nll.mean(), rtol=1e-5)


def test_fine_tuning_run_evaluates_the_replies_and_samples_a_chat(tmp_path, capsys):
    """Train the tiny model on chat examples; its held-out loss is the mean over the replies' tokens alone (checked
    against a forward pass and the mask bits read from the files), and `sample --chat` renders the prompt with the
    data's template."""
    from flax import nnx

    from mx_jax import sample, sharding, train
    from tests.helpers import tiny_config

    rng = np.random.default_rng(0)
    records = [{"messages": [{"role": "user", "content": f"Say {w} twice."},
                             {"role": "assistant", "content": f"{w} {w}"}]}
               for w in rng.choice(["apple", "pear", "fig", "plum", "lime", "kiwi"], 400)]
    data.convert([str(_write_jsonl(tmp_path / "chat.jsonl", records))], str(tmp_path / "tok"), chat_template="chatml",
                 pack=128)  # one chat per row (~75 bytes), then padding
    run = tmp_path / "run"
    result = train.train(tiny_config(run, "steps=3", "mesh.data=1", "mesh.fsdp=1", "data.source=bin",
                                     f"data.path={tmp_path / 'tok'}", "data.seq_len=128", "log.eval_every_steps=3",
                                     "model.attention_mask=documents"), devices=jax.devices()[:1])
    m = result.metrics
    assert 0.05 < m["target_frac"] < 0.5 and np.isfinite(m["eval_loss"]) and m["documents_per_seq"] == 2

    cfg = sample.load_config(str(run / "config.yaml"), [])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        params, buffers = sample.load_model_state(cfg, setup, run, None)
        ds = data.open_dataset(cfg.data)
        nll, counted = [], []
        for w in range(min(cfg.data.eval_batches * cfg.data.batch_size, ds.val.n)):  # the held-out windows in order
            win, bits = ds.val.get(w).astype(np.int32), ds.val.get_mask(w)
            logits, _ = nnx.merge(setup.graphdef, params, buffers)(jnp.asarray(win[None, :-1]),
                                                                   logits_dtype=jnp.float32)
            z = np.asarray(logits[0], np.float64)
            lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
            nll.append((lse - z[np.arange(len(win) - 1), win[1:]])[bits[1:]])
            counted.append(bits[1:].sum())
    want = np.concatenate(nll).mean()
    assert sum(counted) < 0.5 * len(counted) * cfg.data.seq_len  # the prompts were left out
    np.testing.assert_allclose(m["eval_loss"], want, rtol=2e-5)

    assert sample.main([str(run), "--chat", "--system", "Be brief.", "--prompt", "Say fig twice.", "--tokens", "4",
                        "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay fig twice.<|im_end|>\n"
            "<|im_start|>assistant\n") in out
    assert sample.main([str(run), "--system", "Be brief."]) == 2
    assert "--system and --chat-template go with --chat or --prompts" in capsys.readouterr().err
    assert sample.main([str(run), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "--out goes with --prompts, --choices or --loss" in capsys.readouterr().err and not (tmp_path / "o.jsonl").exists()

    # --prompts: chat records are rendered by the data's template up to the generation prompt, a last assistant
    # message is the reference (as trained: its end-of-turn marker included); prompt records are raw text
    held = _write_jsonl(tmp_path / "held.jsonl", [
        {"messages": [{"role": "user", "content": "Say fig twice."}, {"role": "assistant", "content": "fig fig"}]},
        {"prompt": "Say ", "completion": "kiwi"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say fig twice."}]}])
    answers = tmp_path / "answers.jsonl"
    assert sample.main([str(run), "--prompts", str(held), "--out", str(answers), "--tokens", "4", "--temperature",
                        "0", "--batch", "2"]) == 0
    recs = [json.loads(line) for line in answers.read_text().splitlines()]
    assert recs[0]["prompt"] == "<|im_start|>user\nSay fig twice.<|im_end|>\n<|im_start|>assistant\n"
    assert recs[0]["reference"] == "fig fig<|im_end|>\n" and "exact" in recs[0]
    assert recs[1]["prompt"] == "Say " and recs[1]["reference"] == "kiwi"
    assert "reference" not in recs[2] and recs[2]["prompt"] + recs[2]["output"] in out  # the --chat run's reply
    assert "3 samples" in capsys.readouterr().err
    for flags, message in ((["--prompt", "x"], "--prompt does not go with --prompts"),
                           (["--chat-template", str(tmp_path / "nope.jinja")], "nope.jinja"),
                           (["--batch", "0"], "--batch: must be >= 1")):
        assert sample.main([str(run), "--prompts", str(held), *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, {"question": "c"}])
    assert sample.main([str(run), "--prompts", str(bad)]) == 2
    assert "bad.jsonl:2: no 'text' field" in capsys.readouterr().err


def test_parquet_examples_read_like_json_lines(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    qa = _arithmetic(30)
    chats = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(30)]
    for name, records in (("qa", qa), ("chat", [{"messages": c} for c in chats])):
        pq.write_table(pa.Table.from_pylist(records), tmp_path / f"{name}.parquet")
        _write_jsonl(tmp_path / f"{name}.jsonl", records)
        kw = {"chat_template": "chatml"} if name == "chat" else {}
        a = data.convert([str(tmp_path / f"{name}.parquet")], str(tmp_path / f"{name}_pq"), **kw)
        b = data.convert([str(tmp_path / f"{name}.jsonl")], str(tmp_path / f"{name}_js"), **kw)
        assert a["loss_mask"] and a["train_target_tokens"] + a["val_target_tokens"] == \
            b["train_target_tokens"] + b["val_target_tokens"]
        got = {}
        for d in (f"{name}_pq", f"{name}_js"):  # the files' names differ, and so do their splits: compare both
            got[d] = sorted(str((_text(t), m.tolist())) for split in ("train", "val")
                            for t, m in _examples(*_tokens_and_masks(tmp_path / d, split), 0))
        assert len(got[f"{name}_pq"]) == 30 and got[f"{name}_pq"] == got[f"{name}_js"]


def test_packed_examples_fill_rows_whole_and_the_run_must_read_them_as_rows(tmp_path, capsys):
    records = _arithmetic(300) + [{"prompt": "Spell it out: ", "completion": " y" * 40},  # longer than a row
                                  {"prompt": "Too long: " + "x" * 90, "completion": "z"}]  # its prompt fills one
    meta = data.convert([str(_write_jsonl(tmp_path / "qa.jsonl", records))], str(tmp_path / "tok"), pack=64,
                        shard_tokens=1000, val_fraction=0.1)
    assert meta["packed"] == 64 and meta["pad_id"] == 1 and meta["documents"] == 301
    assert meta["cut_examples"] == 2 and meta["cut_to_no_target"] == 1
    assert "warning: 2 record(s) longer than --pack 64 tokens were cut to it, 1 of them dropped" in \
        capsys.readouterr().err
    arrays, files, _ = data.load_shards(str(tmp_path / "tok"), "train")
    assert len(arrays) > 1 and all(len(a) % 64 == 1 and len(a) <= 1000 + 1 for a in arrays)  # rows and one pad
    ds = data.open_dataset(DataConfig(source="bin", path=str(tmp_path / "tok"), seq_len=64))
    seen, pads = [], 0
    for windows in (ds.train, ds.val):
        for w in range(windows.n):
            toks, mask = windows.get(w), windows.get_mask(w)
            assert not mask[0] and not mask[-1]  # a row starts with a prompt; the token after it is not a target
            cuts = np.flatnonzero(toks[:64] == 0) + 1
            *whole, rest = np.split(np.arange(64), cuts)
            if _text(toks[rest]).startswith("Spell it out"):  # the long example: cut to a row, its end dropped
                assert len(rest) == 64 and mask[rest].sum() == 64 - len("Spell it out: ")
                continue
            assert np.all(toks[rest] == 1) and not mask[rest].any()  # after the last example: padding alone
            pads += len(rest)
            for idx in whole:
                prompt, completion = _text(toks[idx][~mask[idx]]), _text(toks[idx][mask[idx]][:-1])
                seen.append(str({"prompt": prompt, "completion": completion}))
    assert sorted(seen) == sorted(map(str, records[:-2]))  # every example once, none split across rows
    assert meta["pad_tokens"] == pads + len(arrays) + len(data.load_shards(str(tmp_path / "tok"), "val")[0])
    with pytest.raises(ConfigError, match=r"data.seq_len': 128, but the examples in .* were packed into rows of 64 "
                                          r"tokens \(convert --pack 64\); set data.seq_len=64"):
        data.open_dataset(DataConfig(source="bin", path=str(tmp_path / "tok"), seq_len=128))


def test_loss_masked_training_on_a_vocab_parallel_mesh_matches_one_device(tmp_path):
    """data=8 with 256 tokens per step runs the head vocab-parallel (test_train_mesh.py): the -1 targets are picked by
    the masked sum over the split vocabulary; 3 steps give one device's losses and held-out loss (float32)."""
    from mx_jax import train
    from tests.helpers import NO_IO, tiny_config

    data.convert([str(_write_jsonl(tmp_path / "qa.jsonl", _arithmetic(600)))], str(tmp_path / "tok"))
    over = ("steps=3", "data.batch_size=8", "data.source=bin", f"data.path={tmp_path / 'tok'}", "mesh.fsdp=1",
            NO_IO[0], "log.eval_every_steps=3")
    one = train.train(tiny_config(tmp_path / "one", *over), devices=jax.devices()[:1])
    mesh = train.train(tiny_config(tmp_path / "mesh", *over, "mesh.data=8"))
    assert mesh.state["params"]["head"].addressable_shards[0].data.shape == (64, 256 // 8)
    assert 0 < one.metrics["target_frac"] < 0.5
    for key in ("loss", "eval_loss", "target_frac", "grad_norm"):
        np.testing.assert_allclose(mesh.metrics[key], one.metrics[key], rtol=1e-5, err_msg=key)


def test_export_puts_the_datas_tokenizer_and_chat_template_beside_the_weights(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    from mx_jax import hf, train
    from tests.helpers import NO_EVAL, tiny_config

    tok, d = _llama3_like(tmp_path)
    convo = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "Paris is the capital."}]
    chats = str(_write_jsonl(tmp_path / "chat.jsonl", [{"messages": convo}] * 60))
    for name, template in (("own", None), ("chatml", "chatml")):
        data.convert([chats], str(tmp_path / f"tok_{name}"), tokenizer=str(d / "tokenizer.json"),
                     chat_template=template)
        run = tmp_path / f"run_{name}"
        train.train(tiny_config(run, "steps=1", "mesh.data=1", "mesh.fsdp=1", "model.vocab_size=384", NO_EVAL,
                                "data.source=bin", f"data.path={tmp_path / f'tok_{name}'}", "data.seq_len=16"),
                    devices=jax.devices()[:1])
        out = tmp_path / f"hf_{name}"
        assert hf.main(["export", str(run), str(out)]) == 0
        assert "tokenizer: tokenizer.json, tokenizer_config.json" in capsys.readouterr().out
        assert (out / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
        exported = json.loads((out / "tokenizer_config.json").read_text())
        assert exported["bos_token"] == "<|begin_of_text|>"
        want = json.loads((d / "tokenizer_config.json").read_text())["chat_template"] if template is None \
            else data.CHATML
        assert exported["chat_template"] == want
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "hf_own").stat().st_mode) == 0o777 & ~umask  # not mkdtemp's 0700
    # A byte-level run exported over it: the old export's tokenizer goes with its weights
    train.train(tiny_config(tmp_path / "run_bytes", "steps=1", "mesh.data=1", "mesh.fsdp=1", NO_EVAL),
                devices=jax.devices()[:1])
    assert hf.main(["export", str(tmp_path / "run_bytes"), str(tmp_path / "hf_own"), "--overwrite"]) == 0
    assert "tokenizer: bytes" in capsys.readouterr().out
    assert not any((tmp_path / "hf_own" / n).exists() for n in hf.TOKENIZER_FILES)


def test_a_model_from_init_from_with_another_tokenizer_is_warned_about(tmp_path):
    pytest.importorskip("tokenizers")
    import shutil

    from mx_jax import train
    from tests.helpers import tiny_config

    tok, d = _llama3_like(tmp_path)
    data.convert([str(_write_jsonl(tmp_path / "qa.jsonl", _arithmetic(50)))], str(tmp_path / "tok"),
                 tokenizer=str(d / "tokenizer.json"))
    same, other = tmp_path / "same_model", tmp_path / "other_model"
    same.mkdir()
    shutil.copyfile(d / "tokenizer.json", same / "tokenizer.json")  # a copy: the same ids
    other.mkdir()
    tok.add_special_tokens(["<|extra|>"])  # one more token: every id past it moves, or a new one appears
    tok.save(str(other / "tokenizer.json"))
    cfg = lambda model: tiny_config(tmp_path / "run", "data.source=bin", f"data.path={tmp_path / 'tok'}",  # noqa
                                    f"init_from={model}")
    assert train.tokenizer_mismatch(cfg(same)) is None
    warning = train.tokenizer_mismatch(cfg(other))
    assert "was tokenized with" in warning and str(other / "tokenizer.json") in warning
    assert "convert the data again with --tokenizer" in warning
    assert train.tokenizer_mismatch(cfg(tmp_path / "no_tokenizer_here")) is None


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | map(attribute='name') | join(',') }}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c['name'] }}({{ c['arguments'] | tojson }}){% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_tool_calls_are_trained_and_tool_results_are_context(tmp_path):
    """An agentic conversation (OpenAI's format): the assistant's tool call and its final answer are targets; the
    tools' schemas, the user's question and the tool's result are context. JSON lines and Parquet alike (Parquet
    gives the messages' absent struct fields as nulls)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    (tmp_path / "tools.jinja").write_text(TOOL_TEMPLATE)
    record = {"tools": [{"name": "weather", "parameters": {"city": "string"}}],
              "messages": [{"role": "user", "content": "Weather in Oslo?"},
                           {"role": "assistant", "tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}]},
                           {"role": "tool", "content": "-3 C, snow"},
                           {"role": "assistant", "content": "Snowy, -3 C."}]}
    _write_jsonl(tmp_path / "agent.jsonl", [record] * 3)
    pq.write_table(pa.Table.from_pylist([record] * 3), tmp_path / "agent.parquet")
    for name in ("agent.jsonl", "agent.parquet"):
        out = tmp_path / f"tok_{name}"
        data.convert([str(tmp_path / name)], str(out), chat_template=str(tmp_path / "tools.jinja"), val_fraction=0)
        examples = [ex for split in ("train", "val") for ex in _examples(*_tokens_and_masks(out, split), 0)]
        assert len(examples) == 3
        toks, m = examples[0]
        assert _text(toks[:-1]) == ('<tools>weather</tools>\n<user>Weather in Oslo?</user>\n<assistant>call weather('
                                    '{"city": "Oslo"})</assistant>\n<tool>-3 C, snow</tool>\n<assistant>Snowy, -3 C.'
                                    '</assistant>\n')
        assert _trained_pieces(toks, m) == ['call weather({"city": "Oslo"})</assistant>\n',
                                            "Snowy, -3 C.</assistant>\n\0"], name
    bad = {"messages": [{"role": "assistant"}]}  # neither content nor tool calls
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: 'messages' must be a list of .*\(content may be absent"):
        data.convert([str(_write_jsonl(tmp_path / "bad.jsonl", [bad]))], str(tmp_path / "bad"), chat_template="chatml")


def _qa_and_docs(src, n_docs: int):
    """src/qa0-2.jsonl (120 arithmetic examples each) and src/docs.jsonl (n_docs plain documents)."""
    src.mkdir()
    for i in range(3):
        _write_jsonl(src / f"qa{i}.jsonl", _arithmetic(120, seed=i))
    _write_jsonl(src / "docs.jsonl", [{"text": f"plain document {i}\n" * (i % 7 + 1)} for i in range(n_docs)])
    return src


def _assert_same_records(a, b):
    """The two conversions hold the same examples and documents (in any order), held out alike."""
    for split in ("train", "val"):
        got = [sorted(str((_text(t), m.tolist())) for t, m in _examples(*_tokens_and_masks(d, split), 0))
               for d in (a, b)]
        assert got[0] == got[1], split


def test_parallel_conversion_holds_the_same_records_and_cleans_up_after_an_error(tmp_path, capsys):
    src = _qa_and_docs(tmp_path / "src", 90)
    one = data.convert([str(src)], str(tmp_path / "one"), shard_tokens=2000, val_fraction=0.1)
    two = data.convert([str(src)], str(tmp_path / "two"), shard_tokens=2000, val_fraction=0.1, workers=2,
                       progress=True)
    assert "part 2/2 done" in capsys.readouterr().err and two["workers"] == 2
    for key in ("train_tokens", "val_tokens", "train_target_tokens", "val_target_tokens", "documents", "examples",
                "files", "max_token_id"):
        assert one[key] == two[key], key
    assert list((tmp_path / "two").glob("train_p001_*.bin")) and list((tmp_path / "two").glob("train_p000_*.mask"))
    _assert_same_records(tmp_path / "one", tmp_path / "two")  # the held-out records are chosen per record
    packed = data.convert([str(src)], str(tmp_path / "packed"), pack=64, shard_tokens=1000, workers=2)
    arrays, _, _ = data.load_shards(str(tmp_path / "packed"), "train")
    assert all(len(a) % 64 == 1 for a in arrays) and packed["pad_tokens"] > 0
    (src / "qa1.jsonl").write_text((src / "qa1.jsonl").read_text() + '{"prompt": "no completion"}\n')
    with pytest.raises(SystemExit, match=r"qa1.jsonl:121: no 'text' field, nor 'prompt' and 'completion'"):
        data.convert([str(src)], str(tmp_path / "new" / "bad"), shard_tokens=500, workers=2)
    assert not (tmp_path / "new").exists()  # the other worker's shards too
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "train_notes.txt").write_text("the user's")  # not a shard: never removed
    with pytest.raises(SystemExit, match=r"qa1.jsonl:121"):
        data.convert([str(src)], str(tmp_path / "kept"), shard_tokens=500, workers=2)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["train_notes.txt"]


def test_parts_converted_on_several_machines_merge_into_the_whole_conversion(tmp_path, capsys):
    """convert --part K/N (one per machine, into one shared directory) and merge: the same records, held out alike,
    as one conversion; masks for the plain-document shards of a part without examples; merge refuses missing or
    mismatched parts and changes nothing then; a failing part removes only its own shards."""
    src = _qa_and_docs(tmp_path / "src", 300)
    one = data.convert([str(src)], str(tmp_path / "one"), shard_tokens=2000, val_fraction=0.1)
    out = tmp_path / "shared"
    with pytest.raises(SystemExit, match="no meta.part"):
        data.merge(str(out))
    for k in (2, 0):
        part = data.convert([str(src)], str(out), shard_tokens=2000, val_fraction=0.1, part=f"{k}/3",
                            workers=2 if k == 0 else 1)
        assert part["part"] == k and (out / f"meta.part{k:03d}.json").exists()
    with pytest.raises(SystemExit, match="part\\(s\\) 1/3 of 3 not converted yet"):
        data.merge(str(out))
    with pytest.raises(SystemExit, match="already holds token shards \\(meta.part002.json"):
        data.convert([str(src)], str(out), shard_tokens=2000, val_fraction=0.1, part="2/3")
    data.main(["convert", str(src), "--out", str(out), "--shard-tokens", "2000", "--val-fraction", "0.1", "--part",
               "1/3", "--quiet"])
    assert json.loads(capsys.readouterr().out)["part"] == 1
    assert not list(out.glob("train_n000_*.mask"))  # part 0 holds the plain documents alone
    good = (out / "meta.part001.json").read_bytes()
    for damaged, message in ((good[:100], "is not valid JSON"), (b"[]", "must hold a JSON object"),
                             (b"{}", "part is missing"), (good.replace(b'"vocab"', b'"vocabulary"'),
                                                          "converted\\[0\\].vocab is missing")):
        (out / "meta.part001.json").write_bytes(damaged)
        with pytest.raises(SystemExit, match=f"meta.part001.json.*{message}"):
            data.merge(str(out))
    (out / "meta.part001.json").write_bytes(good)
    data.main(["merge", str(out)])
    merged = json.loads(capsys.readouterr().out)
    assert merged["parts"] == 3 and not list(out.glob("meta.part*")) and (out / "meta.json").exists()
    for key in ("train_tokens", "val_tokens", "train_target_tokens", "val_target_tokens", "documents", "examples",
                "files", "max_token_id"):
        assert one[key] == merged[key], key
    assert all(p.with_suffix(".mask").exists() for p in out.glob("*_n*.bin"))  # merge wrote part 0's masks
    _assert_same_records(tmp_path / "one", out)
    with pytest.raises(SystemExit, match="already merged"):
        data.merge(str(out))
    # parts of other settings do not merge, and merge then writes nothing
    other = tmp_path / "other"
    data.convert([str(src)], str(other), shard_tokens=2000, val_fraction=0.1, part="0/2")
    data.convert([str(src)], str(other), shard_tokens=3000, val_fraction=0.1, part="1/2")
    before = sorted(p.name for p in other.iterdir())
    with pytest.raises(SystemExit, match="meta.part001.json has another settings"):
        data.merge(str(other))
    assert sorted(p.name for p in other.iterdir()) == before
    with pytest.raises(SystemExit, match="4 input file\\(s\\) cannot be split into 5 parts"):
        data.convert([str(src)], str(tmp_path / "five"), part="0/5")
    with pytest.raises(SystemExit, match="expected K/N"):
        data.convert([str(src)], str(tmp_path / "five"), part="3")
    # a part that fails removes its own shards, never another part's
    (src / "qa1.jsonl").write_text((src / "qa1.jsonl").read_text() + '{"prompt": "no completion"}\n')
    bad = tmp_path / "bad"
    groups = [sorted(k for k, _ in g) for g in data._split_files(data._input_files([str(src)], "*"), 2)]
    failing = next(i for i, g in enumerate(groups) if "src/qa1.jsonl" in g)
    data.convert([str(src)], str(bad), shard_tokens=500, val_fraction=0.1, part=f"{1 - failing}/2")
    kept = sorted(p.name for p in bad.iterdir())
    with pytest.raises(SystemExit, match="qa1.jsonl:121"):
        data.convert([str(src)], str(bad), shard_tokens=500, val_fraction=0.1, part=f"{failing}/2")
    assert sorted(p.name for p in bad.iterdir()) == kept
