"""Data: the embedded corpus, token shards and the converter, deterministic and resumable batches."""

import hashlib
import json

import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mx_jax import data, sharding
from mx_jax.config import ConfigError, DataConfig, MeshConfig


def test_embedded_corpus_is_real_python_split_by_file():
    corpus = data.embedded_corpus()
    assert len(corpus["train"]) > 2_000_000 and len(corpus["val"]) > 50_000
    text = bytes(corpus["train"][:200_000]).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    files = data.stdlib_files()
    held = [rel for rel, _ in files if data.is_heldout(rel)]
    assert 0.02 < len(held) / len(files) < 0.09
    assert not any("test" in rel.split("/") for rel, _ in files)


def _shardings(mesh):
    s = NamedSharding(mesh, P(None, sharding.batch_axes(), "context"))
    return {"inputs": s, "targets": s}


def test_batches_deterministic_resumable_and_shifted():
    ds = data.open_dataset(DataConfig(seq_len=16, batch_size=8))
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, context=2))
    a = data.Batches(ds.train, 8, seed=3)
    first = [a.next_global(_shardings(mesh), 1) for _ in range(3)]
    b = data.Batches(ds.train, 8, seed=3, position=16)  # resumed after two batches
    third = b.next_global(_shardings(mesh), 1)
    np.testing.assert_array_equal(np.asarray(first[2]["inputs"]), np.asarray(third["inputs"]))
    x, y = np.asarray(first[0]["inputs"]), np.asarray(first[0]["targets"])
    assert x.shape == (1, 8, 16)
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])  # targets are inputs shifted by one
    assert not np.array_equal(np.asarray(first[0]["inputs"]), np.asarray(first[1]["inputs"]))
    c = data.Batches(ds.train, 8, seed=4)
    assert not np.array_equal(np.asarray(c.next_global(_shardings(mesh), 1)["inputs"]), x)


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetch_hands_out_the_same_batches_and_counts_only_what_the_loop_took(depth):
    ds = data.open_dataset(DataConfig(seq_len=16, batch_size=8))
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, context=2))
    plain = data.Batches(ds.train, 8, seed=3)
    expected = [np.asarray(plain.next_global(_shardings(mesh), 2)["inputs"]) for _ in range(3)]
    ahead = data.Batches(ds.train, 8, seed=3)
    feed = data.Prefetch(ahead, _shardings(mesh), 2, depth, limit=3)
    try:
        batch, waited = feed.next()
        np.testing.assert_array_equal(np.asarray(batch["inputs"]), expected[0])
        assert waited >= 0 and batch["inputs"].sharding == _shardings(mesh)["inputs"]
        assert feed.position == 8  # what a checkpoint records: the loop took one batch, whatever was built ahead
        for want in expected[1:]:
            np.testing.assert_array_equal(np.asarray(feed.next()[0]["inputs"]), want)
        assert feed.position == 24 == ahead.position
        with pytest.raises(IndexError, match="all `limit` batches"):
            feed.next()  # the run's steps are all fed: nothing more was built
    finally:
        feed.close()


@pytest.mark.parametrize("depth", [0, 2])
def test_evaluation_reads_the_first_held_out_batches_in_order(depth):
    from types import SimpleNamespace as NS

    from mx_jax import train

    ds = data.open_dataset(DataConfig(seq_len=16, batch_size=8))
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, context=2))
    setup = NS(cfg=NS(data=NS(batch_size=8, eval_batches=3, prefetch=depth), seed=0), batch_shardings=_shardings(mesh))
    seen = []

    def eval_step(params, buffers, batch):  # a stand-in "loss": the batch's mean token id, over its targets
        seen.append(np.asarray(batch["inputs"]))
        return float(seen[-1].mean()), int((np.asarray(batch["targets"]) >= 0).sum())

    got = train.evaluate(eval_step, {"params": None, "buffers": None}, ds, setup)["eval_loss"]
    plain = data.Batches(ds.val, 8, seed=0, shuffle=False)
    want = [np.asarray(plain.next_global(_shardings(mesh), 1)["inputs"]) for _ in range(3)]
    assert len(seen) == 3 and all(np.array_equal(a, b) for a, b in zip(seen, want))
    assert got == pytest.approx(np.mean([w.mean() for w in want]))


class _CountingBatches:
    """A stand-in for data.Batches: counts its builds, and fails at build `fail_at` (1-based) if given."""

    def __init__(self, fail_at=None):
        self.position, self.built, self.fail_at = 0, 0, fail_at

    def next_global(self, shardings, accum):
        self.built += 1
        if self.built == self.fail_at:
            raise ConfigError(f"data.path: shard train_00003.bin is corrupt (build {self.built})")
        self.position += 8
        return {"inputs": self.built}


def test_prefetch_raises_a_build_error_in_the_loop_after_the_good_batches():
    feed = data.Prefetch(_CountingBatches(fail_at=3), {}, 1, 2, limit=10)
    try:
        assert [feed.next()[0]["inputs"] for _ in range(2)] == [1, 2]
        with pytest.raises(ConfigError, match="train_00003.bin is corrupt"):
            feed.next()
        assert feed.position == 16  # the failed batch was never taken
    finally:
        feed.close()


def test_prefetch_close_stops_the_thread_with_its_queue_full():
    import time

    batches = _CountingBatches()
    feed = data.Prefetch(batches, {}, 1, 2, limit=1000)
    assert feed.next()[0]["inputs"] == 1
    deadline = time.perf_counter() + 5.0  # the thread fills its queue of 2 and waits for room (a loaded CI is slow)
    while batches.built < 4 and time.perf_counter() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert batches.built == 4  # the one taken, the queue's 2, and one waiting to be queued: never more
    thread = feed._thread
    t0 = time.perf_counter()
    feed.close()
    assert not thread.is_alive() and time.perf_counter() - t0 < 1.0
    time.sleep(0.1)
    assert batches.built == 4


def test_each_shard_reads_only_its_rows(monkeypatch):
    ds = data.open_dataset(DataConfig(seq_len=16, batch_size=8))
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=4, context=2))
    batches = data.Batches(ds.train, 8, seed=0)
    calls = []
    original = batches.rows

    def spy(first, r0, r1, t0, t1):
        calls.append((r0, r1, t0, t1))
        return original(first, r0, r1, t0, t1)

    monkeypatch.setattr(batches, "rows", spy)
    out = batches.next_global(_shardings(mesh), 2)  # 2 microbatches of 4 rows
    assert out["inputs"].shape == (2, 4, 16)
    # fsdp=4 splits 4 rows into 1-row shards; context=2 splits 16 tokens into 8: no call reads a whole batch, and
    # each of the 2 microbatches x 4 row shards x 2 sequence halves is read once (the inputs and targets share it)
    assert all(r1 - r0 == 1 and t1 - t0 == 8 for r0, r1, t0, t1 in calls)
    assert sorted(set(calls)) == [(r, r + 1, t, t + 8) for r in range(4) for t in (0, 8)] and len(calls) == 16


def test_convert_and_read_token_shards(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(30):
        (src / f"doc{i}.txt").write_bytes(bytes(rng.integers(32, 127, size=500, dtype=np.uint8)))
    meta = data.convert([str(src)], str(tmp_path / "tok"), tokenizer="byte", shard_tokens=4000)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    assert meta["train_tokens"] + meta["val_tokens"] == 30 * 501
    assert len(list((tmp_path / "tok").glob("train_*.bin"))) >= 3  # split into several shards
    ds = data.open_dataset(DataConfig(source="bin", path=str(tmp_path / "tok"), seq_len=32, batch_size=4))
    window = ds.train.get(0)
    assert window.dtype == np.uint16 and len(window) == 33


def test_shard_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="meta.json"):
        data.open_dataset(DataConfig(source="bin", path=str(tmp_path), seq_len=8))
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 10}))
    (tmp_path / "train_00000.bin").write_bytes(b"\x01\x00\x02")
    (tmp_path / "val_00000.bin").write_bytes(b"\x01\x00")
    with pytest.raises(ConfigError, match="not a multiple"):
        data.open_dataset(DataConfig(source="bin", path=str(tmp_path), seq_len=8))


def _convert(tmp_path, n_docs=30):
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n_docs):
        (src / f"doc{i}.txt").write_bytes(bytes(rng.integers(32, 127, size=500, dtype=np.uint8)))
    return data.convert([str(src)], str(tmp_path / "tok"), tokenizer="byte", shard_tokens=4000)


def _open(path, seq_len=32):
    return data.open_dataset(DataConfig(source="bin", path=str(path), seq_len=seq_len, batch_size=4))


def test_convert_refuses_a_directory_with_shards(tmp_path):
    _convert(tmp_path)
    before = {f.name: f.read_bytes() for f in (tmp_path / "tok").iterdir()}
    with pytest.raises(SystemExit, match="already holds token shards"):
        _convert(tmp_path)  # would leave the old shards beside the new ones
    assert {f.name: f.read_bytes() for f in (tmp_path / "tok").iterdir()} == before


def test_stale_or_mistyped_shards_are_refused(tmp_path):
    meta = _convert(tmp_path)
    tok = tmp_path / "tok"
    assert meta["max_token_id"] == 126
    (tok / "train_00099.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())  # left from another run
    with pytest.raises(ConfigError, match=f"hold {meta['train_tokens'] + 100} uint16 tokens but meta.json says "
                                          f"train_tokens={meta['train_tokens']}"):
        _open(tok)
    (tok / "train_00099.bin").unlink()
    (tok / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))  # the files are uint16
    with pytest.raises(ConfigError, match="train_tokens|not a multiple of uint32"):
        _open(tok)
    for f in tok.glob("*.bin"):  # even sizes: only the recorded count tells the widths apart
        if f.stat().st_size % 4:
            f.write_bytes(f.read_bytes()[:-2])
    ok = {**meta, "train_tokens": sum(f.stat().st_size // 2 for f in tok.glob("train_*.bin"))}
    (tok / "meta.json").write_text(json.dumps({**ok, "dtype": "uint32"}))
    with pytest.raises(ConfigError, match="or a dtype that does not match the files"):
        _open(tok)


@pytest.mark.parametrize("meta_text, match", [
    ("{\"dtype\": \"uint16\",", "meta.json is not valid JSON"),
    ("[1, 2]", "meta.json must hold a JSON object"),
    (json.dumps({"dtype": "uint16"}), "'vocab_size' must be a positive integer, got None"),
    (json.dumps({"vocab_size": 256}), "'dtype' must be"),
    (json.dumps({"dtype": "uint16", "vocab_size": 100_000}), "does not fit dtype uint16"),
])
def test_bad_meta_json_names_the_file(tmp_path, meta_text, match):
    (tmp_path / "meta.json").write_text(meta_text)
    (tmp_path / "train_00000.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    with pytest.raises(ConfigError, match=match):
        _open(tmp_path, seq_len=8)


def test_empty_shard_and_out_of_vocabulary_ids_name_the_file(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 50}))
    (tmp_path / "val_00000.bin").write_bytes(np.arange(40, dtype=np.uint16).tobytes())
    (tmp_path / "train_00000.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="train_00000.bin is empty"):
        _open(tmp_path, seq_len=8)
    ids = np.arange(100, dtype=np.uint16) % 50
    ids[37] = 50  # one id outside the vocabulary: the embedding lookup would read garbage, the loss turn nan
    (tmp_path / "train_00000.bin").write_bytes(ids.tobytes())
    ds = _open(tmp_path, seq_len=8)
    ds.train.get(0)  # tokens 0..8 are fine
    with pytest.raises(ConfigError, match=r"train_00000.bin: token id 50 at token 37 is not below the vocabulary "
                                          r"size 50"):
        ds.train.get(4)  # tokens 32..40


def _bpe(tmp_path, specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ["def foo(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n"] * 50
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", *specials],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    for i, text in enumerate(corpus[:40]):
        (src / f"f{i}.py").write_text(text)
    return tok, corpus[:40], src


def test_hf_tokenizer_json_ends_each_document_with_its_end_of_text_token(tmp_path):
    pytest.importorskip("tokenizers")
    tok, docs, src = _bpe(tmp_path, ["</s>"])
    eos = tok.token_to_id("</s>")
    meta = data.convert([str(src)], str(tmp_path / "tok"), tokenizer=str(tmp_path / "tokenizer.json"))
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["eos_id"] == eos and meta["documents"] == 40
    ids = np.concatenate([np.fromfile(f, dtype=np.uint16) for f in sorted((tmp_path / "tok").glob("*.bin"))])
    assert ids.max() < meta["vocab_size"] and len(ids) < sum(len(t) for t in docs)  # BPE compresses
    assert (ids == eos).sum() == 40 and ids[-1] == eos
    pieces = np.split(ids, np.flatnonzero(ids == eos) + 1)[:-1]
    assert sorted(tok.decode(p[:-1].tolist()) for p in pieces) == sorted(docs)


def test_a_tokenizer_without_an_end_of_text_token_needs_eos_named(tmp_path):
    pytest.importorskip("tokenizers")
    _, docs, src = _bpe(tmp_path, ["<|sep|>"])
    tj = str(tmp_path / "tokenizer.json")
    with pytest.raises(SystemExit, match="none of the end-of-text tokens .*--eos TOKEN"):
        data.convert([str(src)], str(tmp_path / "a"), tokenizer=tj)
    assert not (tmp_path / "a").exists()
    with pytest.raises(SystemExit, match="--eos <eot>: not a token of"):
        data.convert([str(src)], str(tmp_path / "b"), tokenizer=tj, eos="<eot>")
    sep = data.convert([str(src)], str(tmp_path / "c"), tokenizer=tj, eos="<|sep|>")
    bare = data.convert([str(src)], str(tmp_path / "d"), tokenizer=tj, eos="none")
    assert bare["eos_id"] is None and sep["eos_id"] is not None
    assert sep["train_tokens"] + sep["val_tokens"] == bare["train_tokens"] + bare["val_tokens"] + len(docs)
    # the tokenizer_config.json beside it names its eos_token (DeepSeek's tokenizer has none of the usual names)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|sep|>"}}))
    declared = data.convert([str(src)], str(tmp_path / "e"), tokenizer=tj)
    assert declared["eos_id"] == sep["eos_id"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not-a-token|>"}))
    with pytest.raises(SystemExit, match="no tokenizer_config.json beside it names one of its tokens"):
        data.convert([str(src)], str(tmp_path / "f"), tokenizer=tj)


# ---------------------------------------------------------------------------------------------------------------
# The converter's input formats


def _docs(n, seed):
    rng = np.random.default_rng(seed)
    return [f"doc {seed}.{i}: " + "".join(rng.choice(list("abcdefgh \n\u00e9\u4e2d"), size=rng.integers(1, 200)))
            for i in range(n)]


def _json_lines(docs, key="text"):
    return "".join(json.dumps({"id": i, key: d}) + "\n" for i, d in enumerate(docs)).encode()


def _split_documents(out, split):
    """The documents of a byte-tokenized split, in order (the converter ends each with NUL)."""
    ids = np.concatenate([np.fromfile(f, dtype=np.uint16) for f in sorted(out.glob(f"{split}_*.bin"))])
    assert ids[-1] == data.SEPARATOR
    return [bytes(p[:-1].astype(np.uint8)).decode() for p in np.split(ids, np.flatnonzero(ids == 0) + 1)[:-1]]


def test_convert_reads_json_lines_parquet_and_compressed_inputs(tmp_path, capsys):
    import bz2
    import gzip
    import lzma

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    zstd = pytest.importorskip("zstandard")
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    files = {"a.jsonl": (_docs(40, 1), lambda b: b), "sub/b.jsonl.gz": (_docs(30, 2), gzip.compress),
             "c.ndjson.bz2": (_docs(20, 3), bz2.compress), "d.json.xz": (_docs(20, 4), lzma.compress),
             "e.jsonl.zst": (_docs(30, 5), zstd.ZstdCompressor().compress)}
    for name, (docs, pack) in files.items():
        (src / name).write_bytes(pack(_json_lines(docs)))
    files["f.parquet"] = (_docs(50, 6), None)
    pq.write_table(pa.table({"id": list(range(50)), "text": files["f.parquet"][0]}), src / "f.parquet",
                   row_group_size=16)
    (src / ".cache").mkdir()
    (src / ".cache" / "h.txt").write_text("hidden: not read")
    (src / "README.md").write_text("a dataset card: not a document")
    meta = data.convert([str(src)], str(tmp_path / "tok"), shard_tokens=3000, val_fraction=0.25)
    assert "its 1 other file(s) are not read (README.md" in capsys.readouterr().err
    assert meta["files"] == 6 and meta["documents"] == 190 and meta["eos_id"] == data.SEPARATOR

    val = [d for name, (docs, _) in files.items() for i, d in enumerate(docs)
           if int(hashlib.sha1(f"corpus/{name}#{i}".encode()).hexdigest(), 16) % 4 == 0]
    assert 20 < len(val) < 80  # records are split one by one, not file by file
    everything = [d for docs, _ in files.values() for d in docs]
    train, held = _split_documents(tmp_path / "tok", "train"), _split_documents(tmp_path / "tok", "val")
    assert sorted(held) == sorted(val)
    assert sorted(train + held) == sorted(everything)
    assert len(list((tmp_path / "tok").glob("train_*.bin"))) >= 3

    moved = tmp_path / "elsewhere" / "corpus"  # the same inputs under another mount: the same shards
    moved.parent.mkdir()
    src.rename(moved)
    data.convert([str(moved)], str(tmp_path / "tok2"), shard_tokens=3000, val_fraction=0.25)
    for f in (tmp_path / "tok").glob("*.bin"):
        assert f.read_bytes() == (tmp_path / "tok2" / f.name).read_bytes()
    (moved / "g.txt").write_text("a whole file is one document\n")  # chosen by --pattern, text files are read
    (moved / "h.txt").write_text("and this one another\n")
    meta = data.convert([str(moved)], str(tmp_path / "tok3"), pattern="*.txt")
    assert meta["files"] == 2 and meta["documents"] == 2 and meta["train_tokens"] > 0


def test_converter_errors_name_the_file_and_line_and_leave_nothing_behind(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(_json_lines(_docs(300, 1)))  # enough for shards before the error
    out = tmp_path / "new" / "tok"

    def fails(match, **kw):
        with pytest.raises(SystemExit, match=match):
            data.convert([str(src)], str(out), shard_tokens=2000, **kw)
        assert not (tmp_path / "new").exists()

    fails(r"a.jsonl:1: no 'body' field, nor 'prompt' and 'completion', nor 'messages' \(has: id, text\); name the "
          r"text field with --text-key", text_key="body")
    (src / "b.jsonl").write_bytes(_json_lines(_docs(3, 2)) + b'{"text": "cut off\n')
    fails(r"b.jsonl:4: not a JSON object")
    (src / "b.jsonl").write_bytes(_json_lines(_docs(3, 2)) + b'{"text": 7}\n')
    fails(r"b.jsonl:4: field 'text' holds int, not text")
    (src / "b.jsonl").write_bytes(b'{"text": "fine"}\n\n')
    fails(r"b.jsonl:2: an empty line")
    (src / "b.jsonl").unlink()
    pq.write_table(pa.table({"content": ["x"]}), src / "c.parquet")
    fails(r"c.parquet: no 'text' column, nor 'prompt' and 'completion', nor 'messages' \(has: content\); name the "
          r"text column with --text-key")
    (src / "c.parquet").unlink()
    (src / "d.parquet.gz").write_bytes(b"")
    fails(r"d.parquet.gz: a compressed Parquet file")
    (src / "d.parquet.gz").unlink()
    (src / "f.jsonl.gz").write_bytes(b'{"text": "not gzip"}\n')  # a file that is not what its name says
    fails(r"f.jsonl.gz: cannot be read as gz \(BadGzipFile: .*is the file whole")
    import gzip, lzma
    for name, packed in (("f.jsonl.gz", gzip.compress(_json_lines(_docs(50, 3)))),
                         ("f.jsonl.xz", lzma.compress(_json_lines(_docs(50, 3))))):
        (src / "f.jsonl.gz").unlink(missing_ok=True)
        (src / name).write_bytes(packed[:len(packed) // 2])  # cut off in the middle, as an interrupted download
        fails(rf"{name}: cannot be read as {name[-2:]} \(EOFError: Compressed file ended")
        (src / name).unlink()
    (src / "g.parquet").write_bytes(b"PAR1 not a parquet file")
    fails(r"g.parquet: cannot be read \(Arrow\w+: .*is the file whole")
    (src / "g.parquet").unlink()
    (src / "h.txt").write_text("one document only")
    with pytest.raises(SystemExit, match=r"the input's 18 tokens are one document: held out for evaluation, it would "
                                         r"leave nothing to train on"):
        data.convert([str(src / "h.txt")], str(out))
    assert not (tmp_path / "new").exists()
    (src / "h.txt").unlink()
    fails(r"no input files .* matching --pattern \*.txt", pattern="*.txt")
    (src / "e.jsonl").write_bytes(b'{"text": ""}\n{"text": null}\n')
    meta = data.convert([str(src / "e.jsonl"), str(src / "a.jsonl")], str(out), shard_tokens=2000)
    assert meta["documents"] == 300 and meta["empty_documents"] == 2  # empty records are counted, not written


# ---------------------------------------------------------------------------------------------------------------
# Mixtures of token-shard directories


def _source(tmp_path, name, byte, n_tokens=3000, vocab=None):
    """A shard directory whose every token is `byte` (so a window tells its source), byte-tokenized."""
    src = tmp_path / f"src_{name}"
    src.mkdir()
    for i in range(20):
        (src / f"d{i}.txt").write_bytes(bytes([byte]) * (n_tokens // 20))
    out = tmp_path / name
    data.convert([str(src)], str(out), tokenizer="byte", shard_tokens=100_000, val_fraction=0.3)
    if vocab is not None:
        meta = json.loads((out / "meta.json").read_text())
        (out / "meta.json").write_text(json.dumps({**meta, "vocab_size": vocab}))
    return out


def test_mixture_deals_sources_in_proportion_and_walks_each_ones_epochs():
    windows = [data.Windows([np.zeros(n * 8 + 1, np.uint16)], 8, f"s{n}") for n in (50, 7, 23)]
    mix = data.Mixture(windows, [0.5, 0.3, 0.2], ["a", "b", "c"])
    R = data.MIXTURE_ROUND
    assert mix.quota.sum() == R and abs(mix.quota - np.array([0.5, 0.3, 0.2]) * R).max() < 1
    picks = [mix.pick(i, (7,)) for i in range(20_000)]
    src = np.array([s for s, _ in picks])
    for start, length in ((0, 64), (1234, 100), (9000, 4096)):  # any run of consecutive sequences mixes in proportion
        counts = np.bincount(src[start:start + length], minlength=3)
        assert (np.abs(counts - length * np.array([0.5, 0.3, 0.2])) <= 1.5).all(), (start, counts)
    for s, w in enumerate(windows):  # each source: every window once per epoch of its own, reshuffled per epoch
        seq = [win for t, win in picks if t == s]
        epochs = [sorted(seq[e * w.n:(e + 1) * w.n]) for e in range(len(seq) // w.n)]
        assert all(e == list(range(w.n)) for e in epochs)
        assert seq[:w.n] != seq[w.n:2 * w.n]
    # a pure function of (seed, i): a fresh mixture agrees anywhere, e.g. past a round boundary
    again = data.Mixture(windows, [0.5, 0.3, 0.2], ["a", "b", "c"])
    assert [again.pick(i, (7,)) for i in range(data.MIXTURE_ROUND - 5, data.MIXTURE_ROUND + 5)] == \
        [mix.pick(i, (7,)) for i in range(data.MIXTURE_ROUND - 5, data.MIXTURE_ROUND + 5)]


def test_single_source_order_is_unchanged():
    """The order of a one-directory run (what its checkpoints' positions mean) is pinned: perm seeded (seed, epoch)."""
    w = data.Windows([np.zeros(30 * 4 + 1, np.uint16)], 4, "x")
    b = data.Batches(w, 4, seed=11)
    want = [*np.random.default_rng([11, 0]).permutation(30), *np.random.default_rng([11, 1]).permutation(30)]
    assert [b._window(i) for i in range(60)] == [int(x) for x in want]


def test_mixture_dataset_batches_and_errors(tmp_path):
    a, b = _source(tmp_path, "web", ord("a")), _source(tmp_path, "code", ord("b"))
    cfg = DataConfig(source="bin", mixture=(f"3:{a}", f"1:{b}"), seq_len=16, batch_size=8)
    ds = data.open_dataset(cfg)
    assert ds.train.names == ["web", "code"] and ds.train.weights == [0.75, 0.25]
    assert ds.train_windows == [w.n for w in ds.train.sources] and "web 75.0%" in ds.description
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=4))
    x = np.asarray(data.Batches(ds.train, 8, seed=0).next_global(_shardings(mesh), 1)["inputs"])[0]
    assert sorted(int(r[0]) for r in x) == [ord("a")] * 6 + [ord("b")] * 2  # 3:1 inside one batch
    c = _source(tmp_path, "big", ord("c"), vocab=1000)
    with pytest.raises(ConfigError, match="tokenized differently"):
        data.open_dataset(DataConfig(source="bin", mixture=(f"1:{a}", f"1:{c}"), seq_len=16))
    with pytest.raises(ConfigError, match=rf"^config key 'data.mixture', source {tmp_path}/gone: "
                                          rf"{tmp_path}/gone/meta.json not found"):  # not data.path, which is unset
        data.open_dataset(DataConfig(source="bin", mixture=(f"1:{a}", f"1:{tmp_path}/gone"), seq_len=16))
    assert data.mixture_names(["/x/data/web", "/y/data/web", "/z/code"]) == ["x/data/web", "y/data/web", "z/code"]


@pytest.mark.parametrize("over,match", [
    (["data.mixture=1:/a"], "two or more"),
    (["data.mixture=1:/a,x:/b"], "'x:/b' is not 'WEIGHT:DIR'"),
    (["data.mixture=1:/a,0:/b"], "positive weight"),
    (["data.mixture=1:/a,2:/a"], "listed twice"),
    (["data.mixture=1:/a,2:/b", "data.path=/c"], "use one of them"),
    (["data.source=embedded", "data.mixture=1:/a,2:/b"], "needs data.source=bin"),
])
def test_mixture_config_errors_name_the_key(over, match):
    from mx_jax.config import load_config

    with pytest.raises(ConfigError, match=match):
        load_config(None, ["data.source=bin", *over])


def test_training_on_a_mixture_reports_each_source_and_resumes_only_on_it(tmp_path, capsys):
    from mx_jax import train
    from tests.helpers import tiny_config

    a, b = _source(tmp_path, "web", ord("a")), _source(tmp_path, "code", ord("b"))
    run = tmp_path / "run"
    mix = f"data.mixture=3:{a},1:{b}"
    over = ["data.source=bin", mix, "data.seq_len=16", "data.batch_size=8", "log.eval_every_steps=2", "steps=2"]
    result = train.train(tiny_config(run, *over))
    out = capsys.readouterr().out
    assert "data   | in 2 steps: web " in out and "epochs, code " in out
    m = result.metrics
    assert m["eval_loss"] == pytest.approx(0.75 * m["eval_loss/web"] + 0.25 * m["eval_loss/code"], rel=1e-6)
    assert m["eval_loss/web"] != m["eval_loss/code"]
    assert "eval_loss/code" in json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    # Other weights would change the order of the data: refused, naming the key; the same mixture resumes.
    with pytest.raises(ConfigError, match="'data.mixture'.*trained on the mixture 0.75:.*this run has the mixture"):
        train.train(tiny_config(run, *over[:1], f"data.mixture=1:{a},1:{b}", *over[2:-1], "steps=3"))
    with pytest.raises(ConfigError, match="'data.mixture'"):
        train.train(tiny_config(run, "data.source=bin", f"data.path={a}", *over[2:-1], "steps=3"))
    # Same slots per round, same windows, but the sources trade places: refused too.
    with pytest.raises(ConfigError, match="'data.mixture'"):
        train.train(tiny_config(run, *over[:1], f"data.mixture=3:{b},1:{a}", *over[2:-1], "steps=3"))
    # The same proportions written otherwise resume.
    assert int(train.train(tiny_config(run, *over[:1], f"data.mixture=0.6:{a},0.2:{b}", *over[2:-1],
                                       "steps=3")).state["step"]) == 3


def test_a_held_out_share_that_leaves_nothing_to_train_on_is_refused(tmp_path):
    """One record in round(1 / val_fraction) is held out, so a fraction above 1/2 would hold out every one: refused
    by name, as is a conversion whose records all landed in the held-out split; nothing is left behind."""
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    with pytest.raises(SystemExit, match=r"--val-fraction must be in \[0, 0.5\].*got 0.7"):
        data.convert([str(src)], str(tmp_path / "out"), val_fraction=0.7)
    errors = []
    for i in range(8):  # one-document conversions at 1/2: the document's key decides its split
        one = tmp_path / f"one{i}"
        one.mkdir()
        (one / f"doc{i}.txt").write_text("hello")
        with pytest.raises(SystemExit) as e:
            data.convert([str(one)], str(tmp_path / f"out{i}"), val_fraction=0.5)
        errors.append(str(e.value))
        assert not (tmp_path / f"out{i}").exists() or not any((tmp_path / f"out{i}").iterdir())
    assert any("none is left to train on: lower --val-fraction" in m for m in errors), errors
    # the others kept their one document for training, and holding it out instead would leave none either
    assert all("none is left to train on" in m or "are one document: held out" in m for m in errors), errors


def test_documents_holding_the_end_of_text_token_are_counted_and_warned_about(tmp_path, capsys):
    """With bytes a NUL is the end-of-text token: a UTF-16 file becomes thousands of one-character documents for
    model.attention_mask=documents. The converter says so (meta.json documents_with_eos_inside, a warning)."""
    src = tmp_path / "docs"
    src.mkdir()
    (src / "utf16.txt").write_text("hello world " * 20, encoding="utf-16")
    for i in range(3):
        (src / f"plain{i}.txt").write_text("hello world " * 20)
    meta = data.convert([str(src)], str(tmp_path / "out"), tokenizer="byte", progress=False)
    assert meta["documents"] == 4 and meta["documents_with_eos_inside"] == 1
    assert "1 of 4 documents hold the end-of-text token (id 0, NUL)" in capsys.readouterr().err
    clean = data.convert([str(src / f"plain{i}.txt") for i in range(3)], str(tmp_path / "clean"), tokenizer="byte",
                         progress=False)
    assert "documents_with_eos_inside" not in clean
