"""Data: the embedded corpus, token shards and the converter, deterministic and resumable batches."""

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


def test_hf_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = ["def foo(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n"] * 50
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(corpus[:40]):
        (src / f"f{i}.py").write_text(text)
    meta = data.convert([str(src)], str(tmp_path / "tok"), tokenizer=str(tmp_path / "tokenizer.json"))
    assert meta["vocab_size"] == tok.get_vocab_size()
    ids = np.fromfile(next((tmp_path / "tok").glob("train_*.bin")), dtype=np.uint16)
    assert ids.max() < meta["vocab_size"] and len(ids) < sum(len(t) for t in corpus[:40])  # BPE compresses
