"""Training data: the embedded corpus, token shards, and a deterministic, resumable, per-host batch iterator.

Embedded corpus (no download, real text): the `.py` files of the running Python's standard library, excluding
test packages and site-packages, in sorted path order, each followed by a NUL byte (which never occurs in Python
source) as document separator. A file goes to the held-out split when sha1(relative path) mod 20 == 0 (5%).
Tokens are raw bytes (vocabulary 256), so the loss reads directly as nats per byte; ln 256 = 5.55 at init.

Token shards: a directory of flat little-endian `train_*.bin` / `val_*.bin` token arrays (nanoGPT / Megatron
style, no header) plus `meta.json` with `{"dtype": "uint16"|"uint32", "vocab_size": V, "tokenizer": ...}` and,
optionally, `train_tokens`, `val_tokens`, `max_token_id`: when present they are checked against the shards, and
every window read is checked against vocab_size, so stale or mistyped shards are an error naming the file. Write
them with
    python -m mx_jax.data convert --out DIR [--tokenizer byte|path/to/tokenizer.json] FILE_OR_DIR ...
from text files (one document each), JSON lines (`.jsonl`, a document per line in `--text-key`, default "text") or
Parquet (that column), any of them compressed (`.gz`, `.bz2`, `.xz`, `.zst`); each document ends with the
tokenizer's end-of-text token (see "Converter" below). A HF `tokenizer.json` needs the `tokenizers` package, Parquet
`pyarrow`, `.zst` `zstandard` (`pip install mx_jax[data]`). Shards are memory-mapped: a host touches only the windows
its devices need.

Fine-tuning examples: a JSON-lines record (or Parquet row) with "prompt" and "completion", or with chat
"messages" ([{"role", "content"}], TRL's and OpenAI's formats; tool calls, tool results and a "tools" list are passed
to the template as they are), is an example whose loss counts only the completion or the assistant's messages (its
replies and its tool calls). A conversation is rendered by a Jinja chat template (the tokenizer's own, found beside
its tokenizer.json, or `--chat-template`); reply k is the text from the end of render(messages[:k],
add_generation_prompt=True) to the end of render(messages[:k+1]), its end-of-turn marker included. Each segment
(prompt, reply, ...) is tokenized on its own, as it will be at inference. The converter then writes beside each
shard `<shard>.mask`: bit i (np.packbits, little-endian bit order) says whether token i is a target the loss counts,
and meta.json gets "loss_mask": true with the target counts. A batch's target whose bit is 0 is -1 (IGNORED), which
llama.cross_entropy leaves out: the loss is the sum over counted targets divided by their number in the whole step
(every microbatch), so every counted target weighs the same however they fall in microbatches. Plain documents mixed
in are trained whole. Each example ends with the end-of-text token (trained after a reply). By default examples
follow each other like documents, and a window may begin inside one, whose reply is then trained without the start
of its prompt. `--pack T` places whole examples into rows of T tokens instead (first fit over 64 open rows; the rest
of a row is padding, never a target, after every example so nothing attends to it), each shard k rows and one pad
token, so that with data.seq_len = T (checked at start) each window is one row: no example is cut. One longer than T
is cut to T tokens, or dropped if its prompt fills them. With model.attention_mask=documents no example sees another.

Sampling: a split is cut into n = floor((len - 1) / T) windows of T+1 tokens. Global sequence i (counting from
the start of training) is window perm_e[i mod n] of epoch e = i // n, with perm_e a permutation seeded by
(seed, e). The iterator's whole state is the number of sequences consumed, which the checkpoint stores, so a
resumed run sees exactly the batches an uninterrupted run would. Each process materializes only the rows (and
sequence slice) of the global batch that its addressable devices hold (jax.make_array_from_callback). The trainer
takes its batches through `Prefetch`, which builds them `data.prefetch` ahead in a background thread.

Mixtures (`data.mixture`: "WEIGHT:DIR" entries, weights normalized to w_s): global sequence i comes from source
s(i) in fixed proportions, still a pure function of i. The sequences are dealt in rounds of R = 2^16 slots; source s
owns q_s of each round's slots (R w_s rounded by largest remainder, so sum q_s = R and |q_s - R w_s| < 1), spread
evenly: its j-th slot sits at sort rank of (j + 1/2) / q_s among all sources' slots, so any B consecutive sequences
hold B w_s +- 2 of source s: every batch mixes in proportion. Slot k = i mod R of round r = i // R is the c-th
sequence source s draws, c = r q_s + (rank of the slot among s's slots), and that is window perm_{s,e}[c mod n_s]
of epoch e = c // n_s of that source, perm seeded by (seed, s, e): each source walks its own epochs (a small source
with a large weight repeats sooner, the usual upsampling). Held-out loss is reported per source and as the
weighted mean. All sources must share meta.json's vocab_size and tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import lzma
import pathlib
import queue
import sys
import sysconfig
import threading
import time
import zlib
from typing import TYPE_CHECKING, Sequence

import numpy as np

from mx_jax.config import ConfigError, DataConfig, mixture_entries, read_json_object

if TYPE_CHECKING:  # jax is imported where batches are made: the converter (and its workers) start without it
    import jax
    from jax.sharding import NamedSharding

SEPARATOR = 0  # NUL byte between documents of the embedded corpus
IGNORED = -1  # the target of a position the loss leaves out (llama.cross_entropy)
_EXCLUDED_PARTS = {"test", "tests", "site-packages", "dist-packages", "idle_test"}


# ---------------------------------------------------------------------------------------------------------------
# Sources


def stdlib_files() -> list[tuple[str, pathlib.Path]]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if _EXCLUDED_PARTS.intersection(rel.parts):
            continue
        out.append((rel.as_posix(), f))
    if not out:
        raise RuntimeError(f"no Python standard library sources found under {root}")
    return out


def is_heldout(rel_path: str) -> bool:
    return int(hashlib.sha1(rel_path.encode()).hexdigest(), 16) % 20 == 0


@functools.lru_cache(maxsize=1)
def embedded_corpus() -> dict[str, np.ndarray]:
    """{"train": uint8 tokens, "val": uint8 tokens} from the standard library sources (read once per process)."""
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for rel, f in stdlib_files():
        parts["val" if is_heldout(rel) else "train"].append(f.read_bytes() + bytes([SEPARATOR]))
    return {k: np.frombuffer(b"".join(v), dtype=np.uint8) for k, v in parts.items()}


PATH_KEY = "config key 'data.path': "  # how the shard readers' errors begin


def read_meta(d: pathlib.Path) -> dict:
    """`<d>/meta.json`, checked: dtype uint16/uint32 and a positive integer vocab_size."""
    meta_file = d / "meta.json"
    if not meta_file.is_file():
        raise ConfigError(f"{PATH_KEY}{meta_file} not found (write shards with "
                          f"`python -m mx_jax.data convert`)")
    meta = read_json_object(meta_file)
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise ConfigError(f"{meta_file}: 'dtype' must be \"uint16\" or \"uint32\", got {meta.get('dtype')!r}")
    vocab = meta.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ConfigError(f"{meta_file}: 'vocab_size' must be a positive integer, got {vocab!r}")
    if np.iinfo(meta["dtype"]).max < vocab - 1:
        raise ConfigError(f"{meta_file}: vocab_size {vocab} does not fit dtype {meta['dtype']}")
    eos = meta.get("eos_id")
    if eos is not None and (not isinstance(eos, int) or isinstance(eos, bool) or not 0 <= eos < vocab):
        raise ConfigError(f"{meta_file}: 'eos_id' must be a token id below vocab_size {vocab} or null, got {eos!r}")
    return meta


def load_shards(path: str, split: str) -> tuple[list[np.ndarray], list[pathlib.Path], int]:
    """Memory-map `<path>/<split>_*.bin`; returns (arrays, files, vocab_size).

    Checks what is cheap: each shard is non-empty and a whole number of tokens, and, where meta.json records it
    (`python -m mx_jax.data convert` does), that the shards hold exactly `<split>_tokens` tokens and no id above
    `max_token_id` -- which catches stale shards left from another conversion and a dtype that does not match the
    files. Token ids are also checked against vocab_size as windows are read (Windows.get).
    """
    d = pathlib.Path(path)
    meta = read_meta(d)
    dtype = np.dtype(meta["dtype"])
    vocab = meta["vocab_size"]
    files = sorted(d.glob(f"{split}_*.bin"))
    if not files:
        raise ConfigError(f"{PATH_KEY}no {split}_*.bin shards in {d}")
    arrays = []
    for f in files:
        size = f.stat().st_size
        if size == 0:
            raise ConfigError(f"token shard {f} is empty")
        if size % dtype.itemsize:
            raise ConfigError(f"token shard {f} has {size} bytes, not a multiple of {dtype} size "
                              f"({dtype.itemsize}, from {d / 'meta.json'})")
        arrays.append(np.memmap(f, dtype=dtype, mode="r"))
    n = sum(len(a) for a in arrays)
    want = meta.get(f"{split}_tokens")
    if want is not None and n != want:
        raise ConfigError(
            f"{d}: the {len(files)} {split}_*.bin shard(s) hold {n} {dtype} tokens but meta.json says "
            f"{split}_tokens={want}: stale shards from another conversion, or a dtype that does not match the files "
            f"({', '.join(f.name for f in files[:4])}{', ...' if len(files) > 4 else ''})")
    if meta.get("max_token_id", -1) >= vocab:
        raise ConfigError(f"{d / 'meta.json'}: max_token_id {meta['max_token_id']} is not below vocab_size {vocab}")
    return arrays, files, vocab


def check_packed(path: str, seq_len: int) -> None:
    """Shards packed into rows of T tokens (convert --pack T) are read with data.seq_len = T, one row per window."""
    packed = read_meta(pathlib.Path(path)).get("packed")
    if packed and packed != seq_len:
        raise ConfigError(f"config key 'data.seq_len': {seq_len}, but the examples in {path} were packed into rows of "
                          f"{packed} tokens (convert --pack {packed}); set data.seq_len={packed}, or convert again "
                          f"with --pack {seq_len}")


def load_masks(path: str, files: Sequence[pathlib.Path], arrays: Sequence[np.ndarray]) -> list[np.ndarray] | None:
    """The loss masks of shards `files` (meta.json "loss_mask": true): each `<shard>.mask` beside its `.bin`, one
    bit per token, little-endian bit order (np.packbits(..., bitorder="little")); None for shards without."""
    meta = read_meta(pathlib.Path(path))
    if not meta.get("loss_mask"):
        return None
    masks = []
    for f, a in zip(files, arrays):
        m = f.with_suffix(".mask")
        want = (len(a) + 7) // 8
        if not m.is_file():
            raise ConfigError(f"{pathlib.Path(path) / 'meta.json'} says the shards have loss masks, but {m} is "
                              f"missing")
        if m.stat().st_size != want:
            raise ConfigError(f"loss mask {m} has {m.stat().st_size} bytes; its shard's {len(a)} tokens need {want} "
                              f"(one bit each): a stale or truncated file")
        masks.append(np.memmap(m, dtype=np.uint8, mode="r"))
    return masks


# ---------------------------------------------------------------------------------------------------------------
# Windows and batches


class Windows:
    """Non-overlapping windows of T+1 tokens over a list of token arrays; window w -> (array, offset)."""

    def __init__(self, arrays: Sequence[np.ndarray], seq_len: int, name: str, vocab_size: int | None = None,
                 files: Sequence[pathlib.Path] | None = None, masks: Sequence[np.ndarray] | None = None):
        self.arrays, self.seq_len = list(arrays), seq_len
        self.vocab_size, self.files = vocab_size, files
        self.masks = None if masks is None else list(masks)  # packed loss-mask bits per array (load_masks)
        counts = np.array([max(0, (len(a) - 1) // seq_len) for a in self.arrays], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.n = int(self.starts[-1])
        self._perm_key, self._perm = None, None
        if self.n == 0:
            total = sum(len(a) for a in self.arrays)
            raise ConfigError(f"config key 'data.seq_len': the {name} split has {total} tokens, too few for one "
                              f"window of {seq_len + 1}")

    def pick(self, i: int, seed: Sequence[int], shuffle: bool = True) -> int:
        """The window of sequence i: window perm_e[i mod n] of epoch e = i // n, perm_e seeded by (*seed, e)."""
        epoch, j = divmod(i, self.n)
        if not shuffle:
            return j
        key = (*seed, epoch)
        if key != self._perm_key:
            self._perm = np.random.default_rng(list(key)).permutation(self.n)
            self._perm_key = key
        return int(self._perm[j])

    def _locate(self, w: int) -> tuple[int, int]:
        """(array, offset of the window's first token in it)."""
        a = int(np.searchsorted(self.starts, w, side="right") - 1)
        return a, int(w - self.starts[a]) * self.seq_len

    def get_mask(self, w: int, t0: int = 0, t1: int | None = None) -> np.ndarray | None:
        """Whether tokens [t0, t1) of window w count as targets in the loss (bool), or None without loss masks."""
        if self.masks is None:
            return None
        a, off = self._locate(w)
        t1 = self.seq_len + 1 if t1 is None else t1
        lo, hi = off + t0, off + t1
        bits = np.unpackbits(np.asarray(self.masks[a][lo // 8: (hi + 7) // 8]), bitorder="little")
        return bits[lo % 8: lo % 8 + hi - lo].astype(bool)

    def get(self, w: int, t0: int = 0, t1: int | None = None) -> np.ndarray:
        """Tokens [t0, t1) of window w's T+1 tokens."""
        a, off = self._locate(w)
        t1 = self.seq_len + 1 if t1 is None else t1
        win = np.asarray(self.arrays[a][off + t0: off + t1])
        if self.vocab_size is not None and win.size and win.max() >= self.vocab_size:
            bad = int(np.argmax(win >= self.vocab_size))
            where = self.files[a] if self.files else f"array {a}"
            raise ConfigError(f"token shard {where}: token id {int(win[bad])} at token {off + t0 + bad} is not below "
                              f"the vocabulary size {self.vocab_size} (meta.json vocab_size)")
        return win


MIXTURE_ROUND = 1 << 16


def mixture_quota(weights: Sequence[float]) -> list[int]:
    """Each source's slots in a round of MIXTURE_ROUND: R w_s rounded by largest remainder (they sum to R). These,
    not the weights as written, decide the order of a mixture's sequences (what a resume must keep)."""
    ideal = np.asarray(weights, np.float64) / np.sum(weights) * MIXTURE_ROUND
    quota = np.floor(ideal).astype(np.int64)
    quota[np.argsort(quota - ideal, kind="stable")[:MIXTURE_ROUND - int(quota.sum())]] += 1
    return [int(q) for q in quota]


class Mixture:
    """Windows of several sources dealt in fixed proportions (module docstring); `pick` and `get` as Windows'."""

    def __init__(self, sources: Sequence[Windows], weights: Sequence[float], names: Sequence[str]):
        self.sources, self.weights, self.names = list(sources), list(weights), list(names)
        self.seq_len = self.sources[0].seq_len
        self.n = sum(w.n for w in self.sources)
        quota = np.asarray(mixture_quota(weights))
        if (quota == 0).any():
            small = [n for n, q in zip(names, quota) if q == 0]
            raise ConfigError(f"config key 'data.mixture': the weight of {small} is below 1/{MIXTURE_ROUND} of the "
                              f"total")
        self.quota = quota
        src = np.concatenate([np.full(q, s) for s, q in enumerate(quota)])
        idx = np.concatenate([np.arange(q) for q in quota])
        order = np.argsort((idx + 0.5) / quota[src], kind="stable")
        self.slot_source, self.slot_index = src[order], idx[order]

    def pick(self, i: int, seed: Sequence[int], shuffle: bool = True) -> tuple[int, int]:
        r, k = divmod(i, MIXTURE_ROUND)
        s = int(self.slot_source[k])
        c = r * int(self.quota[s]) + int(self.slot_index[k])
        return s, self.sources[s].pick(c, (*seed, s), shuffle)

    def get(self, w: tuple[int, int], t0: int = 0, t1: int | None = None) -> np.ndarray:
        return self.sources[w[0]].get(w[1], t0, t1)

    def get_mask(self, w: tuple[int, int], t0: int = 0, t1: int | None = None) -> np.ndarray | None:
        return self.sources[w[0]].get_mask(w[1], t0, t1)


class Batches:
    """Deterministic, resumable batches of the global batch; `position` (sequences consumed) is the whole state."""

    def __init__(self, windows: Windows | Mixture, global_batch: int, seed: int, shuffle: bool = True,
                 position: int = 0):
        self.windows, self.global_batch, self.seed, self.shuffle = windows, global_batch, seed, shuffle
        self.position = position

    def _window(self, i: int):
        return self.windows.pick(i, (self.seed,), self.shuffle)

    def rows(self, first_seq: int, r0: int, r1: int, t0: int, t1: int) -> tuple[np.ndarray, np.ndarray]:
        """inputs, targets (r1-r0, t1-t0) int32 for rows [r0,r1) of the batch starting at global sequence first_seq;
        a target the loss mask leaves out (a prompt token of a fine-tuning example) is -1 (llama.cross_entropy)."""
        inputs = np.empty((r1 - r0, t1 - t0), np.int32)
        targets = np.empty_like(inputs)
        for r in range(r0, r1):
            w = self._window(first_seq + r)
            win = self.windows.get(w, t0, t1 + 1)
            inputs[r - r0] = win[:-1]
            targets[r - r0] = win[1:]
            mask = self.windows.get_mask(w, t0 + 1, t1 + 1)
            if mask is not None:
                targets[r - r0, ~mask] = IGNORED
        return inputs, targets

    def next_global(self, shardings: dict[str, NamedSharding], accum: int) -> dict[str, jax.Array]:
        """The next global batch as {"inputs","targets"}: (accum, batch/accum, T) arrays, built per addressable shard."""
        import jax

        first = self.position
        b = self.global_batch // accum
        t = self.windows.seq_len
        shape = (accum, b, t)
        cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

        def fetch(index) -> tuple[np.ndarray, np.ndarray]:
            ia, ib, it = (s.indices(n) for s, n in zip(index, shape))
            key = (ia[:2], ib[:2], it[:2])
            if key not in cache:
                xs, ys = [], []
                for a in range(*ia):
                    x, y = self.rows(first + a * b, ib[0], ib[1], it[0], it[1])
                    xs.append(x)
                    ys.append(y)
                cache[key] = (np.stack(xs), np.stack(ys))
            return cache[key]

        out = {
            "inputs": jax.make_array_from_callback(shape, shardings["inputs"], lambda idx: fetch(idx)[0]),
            "targets": jax.make_array_from_callback(shape, shardings["targets"], lambda idx: fetch(idx)[1]),
        }
        self.position += self.global_batch
        return out


class Prefetch:
    """The training loop's global batches (`Batches.next_global`), built `depth` ahead in a background thread.

    Why a thread: a step whose program holds a `lax.cond` (the MoE compact expert buffer's per-layer check) returns
    from its dispatch only when the devices have nearly run it, as XLA reads each predicate on the host. A batch built
    after that return is still being copied to the devices when the next step is dispatched, and that step ran
    170-250 ms slower: the trainer ran the whole DeepSeekMoE 16B on 4 x H200 at 39,808 tokens/s with its batches
    built in the loop and at 58,184 with them built here, as fast as steps on one reused batch (benchmarks/RESULTS.md,
    session 57). The thread builds while the loop waits in the dispatch, which releases the GIL.

    `position` counts the sequences the loop has taken (what a checkpoint records), never what the thread has built
    ahead. depth 0 builds each batch in the caller's thread. An error while building (a corrupt shard) is raised by
    `next`, in the loop, as without prefetching. `limit` batches are built in all: the steps left in the run.
    """

    def __init__(self, batches: Batches, shardings: dict[str, NamedSharding], accum: int, depth: int, limit: int):
        self.position = batches.position
        self._build = lambda: (batches.next_global(shardings, accum), batches.position)
        self._left = limit
        self._thread = None
        if depth > 0 and limit > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(limit,), name="mx_jax-prefetch", daemon=True)
            self._thread.start()

    def _run(self, n: int) -> None:
        try:
            for _ in range(n):
                if not self._put(self._build()):
                    return
        except BaseException as e:  # noqa: BLE001 -- handed to the loop, which raises it
            self._put(e)

    def _put(self, item) -> bool:
        """Queue `item`, waiting for room; False once close() was called."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def next(self) -> tuple[dict[str, jax.Array], float]:
        """The next batch, and the seconds the caller waited for it (building included when depth is 0)."""
        if self._left <= 0:
            raise IndexError("Prefetch: all `limit` batches were taken")
        t0 = time.perf_counter()
        if self._thread is None:
            batch, self.position = self._build()
        else:
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._left = 0
                raise item
            batch, self.position = item
        self._left -= 1
        return batch, time.perf_counter() - t0

    def close(self) -> None:
        """Stop the thread (after the batch it may be building) and drop what it built ahead."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


@dataclasses.dataclass
class Dataset:
    train: Windows | Mixture
    val: Windows | Mixture  # a mixture's held-out loss is evaluated per source (val.sources)
    vocab_size: int
    description: str
    # The token that ends each document (meta.json's eos_id; NUL for bytes), None where the shards do not say, or
    # the sources of a mixture disagree (model.attention_mask=documents needs it).
    eos_id: int | None = None

    @property
    def train_windows(self) -> int | list[int]:
        """What a resume checks the data against: the number of training windows (per source for a mixture)."""
        return [w.n for w in self.train.sources] if isinstance(self.train, Mixture) else self.train.n


def open_dataset(cfg: DataConfig) -> Dataset:
    if cfg.source == "embedded":
        splits = embedded_corpus()
        desc = (f"embedded corpus: Python {sys.version_info.major}.{sys.version_info.minor} standard library, "
                f"{len(splits['train']) / 1e6:.1f} M train / {len(splits['val']) / 1e6:.2f} M held-out bytes")
        return Dataset(Windows([splits["train"]], cfg.seq_len, "train"),
                       Windows([splits["val"]], cfg.seq_len, "held-out"), 256, desc, SEPARATOR)
    if cfg.mixture:
        return _open_mixture(cfg)
    check_packed(cfg.path, cfg.seq_len)
    train, train_files, vocab = load_shards(cfg.path, "train")
    val, val_files, _ = load_shards(cfg.path, "val")
    meta = read_meta(pathlib.Path(cfg.path))
    n_train = sum(len(a) for a in train)
    desc = f"token shards {cfg.path}: {n_train / 1e6:.1f} M train tokens, vocab {vocab}" + _mask_note(meta)
    return Dataset(Windows(train, cfg.seq_len, "train", vocab, train_files, load_masks(cfg.path, train_files, train)),
                   Windows(val, cfg.seq_len, "held-out", vocab, val_files, load_masks(cfg.path, val_files, val)),
                   vocab, desc, eos_of(meta))


def _mask_note(meta: dict) -> str:
    """What the description adds for shards with loss masks: the share of training tokens the loss counts."""
    if not meta.get("loss_mask"):
        return ""
    share = meta.get("train_target_tokens", 0) / max(meta.get("train_tokens", 0), 1)
    return f", loss masks ({share:.0%} of train tokens are targets)"


def documents_per_window(windows: Windows | Mixture, eos_id: int, n: int = 1024, seed: int = 0,
                         chunks: int = 1) -> np.ndarray:
    """Documents in the inputs (the first T tokens) of n windows drawn as the training batches are: 1 + the
    end-of-text tokens among the first T - 1 (model.attention_mask=documents, train.with_data_documents); with
    `chunks`, the same for each of the inputs' `chunks` equal parts (context parallelism's), n * chunks counts."""
    total = windows.n if isinstance(windows, Windows) else sum(w.n for w in windows.sources)
    picks = [windows.pick(i, (seed,)) for i in range(min(n, total))]
    t = windows.seq_len
    ends = np.stack([windows.get(w)[:t] == eos_id for w in picks]).reshape(len(picks), chunks, t // chunks)
    return 1 + np.count_nonzero(ends[:, :, :-1], axis=2).reshape(-1)


def eos_of(meta: dict) -> int | None:
    """The end-of-text id a shard directory's documents end with: meta.json's eos_id (None: written with --eos none);
    shards converted before it was recorded ended byte-tokenized documents with NUL and HF ones with nothing."""
    if "eos_id" in meta:
        return meta["eos_id"]
    return SEPARATOR if meta.get("tokenizer") == "byte" else None


def mixture_names(paths: Sequence[str]) -> list[str]:
    """Short names of the sources for metrics: the directory names, with parents added until they differ."""
    parts = [pathlib.Path(p).absolute().parts[1:] for p in paths]  # without the root
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(i) for i in range(len(paths))]


def _open_mixture(cfg: DataConfig) -> Dataset:
    entries = mixture_entries(cfg.mixture)
    names = mixture_names([p for _, p in entries])
    train, val, metas = [], [], []
    for (_, path), name in zip(entries, names):
        try:
            check_packed(path, cfg.seq_len)
            arrays, files, vocab = load_shards(path, "train")
            train.append(Windows(arrays, cfg.seq_len, f"train split of {path}", vocab, files,
                                 load_masks(path, files, arrays)))
            arrays, files, _ = load_shards(path, "val")
            val.append(Windows(arrays, cfg.seq_len, f"held-out split of {path}", vocab, files,
                               load_masks(path, files, arrays)))
            meta = read_meta(pathlib.Path(path))
        except ConfigError as e:  # the shard readers name data.path, which a mixture does not set
            raise ConfigError(f"config key 'data.mixture', source {path}: "
                              f"{str(e).removeprefix(PATH_KEY)}") from None
        metas.append((path, vocab, meta.get("tokenizer"), eos_of(meta)))
    if len({(v, t) for _, v, t, _ in metas}) > 1:
        raise ConfigError("config key 'data.mixture': the sources were tokenized differently (vocab_size, tokenizer in "
                          "meta.json): " + "; ".join(f"{p}: {v}, {t}" for p, v, t, _ in metas))
    weights = [w for w, _ in entries]
    desc = "token-shard mixture: " + ", ".join(
        f"{name} {w:.1%} ({sum(len(a) for a in t.arrays) / 1e6:.1f} M tokens{', loss masks' if t.masks else ''})"
        for name, w, t in zip(names, weights, train))
    eos = {e for *_, e in metas}
    return Dataset(Mixture(train, weights, names), Mixture(val, weights, names), metas[0][1], desc,
                   eos.pop() if len(eos) == 1 else None)


# ---------------------------------------------------------------------------------------------------------------
# Converter: documents -> token shards
#
# A file is read by its name: `.jsonl` / `.ndjson` / `.json` hold one JSON object per line, the document in its
# `text_key` field; `.parquet` holds a table with a `text_key` column (needs pyarrow); any other file is one document,
# its raw bytes. A trailing `.gz`, `.bz2`, `.xz` (standard library) or `.zst` / `.zstd` (needs zstandard) is
# decompressed first. Each document's tokens are followed by the end-of-text id (NUL for bytes), so documents never
# run into each other unmarked. A document goes to the held-out split when sha1 of its key (the file's path from the
# input argument's name, plus "#<record index>" for a record of a JSON-lines or Parquet file) mod round(1 /
# val_fraction) is 0: the split does not depend on where the inputs are mounted or how they are listed.
#
# Parts (`convert --part K/N`, then `merge`): N machines list the same inputs, split them into N groups of about equal
# bytes (_split_files, the same on each), and each converts its group into `<split>_n<K>_...` shards and
# `meta.part<K>.json` (its counts, statistics and shard names) in a shared directory. `merge` checks that the N parts
# came from the same listing (_listing: the files' keys and sizes) and settings (the tokenizer by its vocabulary and
# end-of-text id, since its path may differ by machine), gives the plain-document shards their masks where another
# part has examples, and writes meta.json as one conversion would.

COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd")
JSON_LINES = (".jsonl", ".ndjson", ".json")
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")  # Llama 3, GPT-2/Qwen, Llama 2/Mistral, Gemma


def declared_eos(tokenizer: pathlib.Path) -> str | None:
    """The eos_token of the tokenizer_config.json beside a tokenizer.json (DeepSeek's "<｜end▁of▁sentence｜>", say):
    `--eos auto`'s choice where none of EOS_CANDIDATES is a token. Checked after them, because a chat model's
    declares its end of turn ("<|eot_id|>", "<|im_end|>"), not the end of a document."""
    config = tokenizer.parent / "tokenizer_config.json"
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None
ENCODE_BATCH_BYTES = 8 << 20  # documents tokenized together (tokenizers' encode_batch runs them on all cores)


class _Encoder:
    """Bytes (ids 0-255, NUL after each document) or a HF tokenizer.json (its end-of-text token after each)."""

    def __init__(self, spec: str, eos: str = "auto"):
        if spec == "byte":
            self.vocab, self.name, self.eos_id, self._tok = 256, "byte", SEPARATOR, None
            if eos not in ("auto", "none"):
                raise SystemExit(f"--eos {eos}: the byte tokenizer separates documents with NUL (id 0); "
                                 f"use --eos auto or --eos none")
            if eos == "none":
                self.eos_id = None
            return
        path = pathlib.Path(spec)
        if not path.is_file():
            raise SystemExit(f"--tokenizer: {spec} is neither 'byte' nor an existing tokenizer.json")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise SystemExit("--tokenizer: a tokenizer.json needs the `tokenizers` package (pip install tokenizers)")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a JSON file of another kind
            raise SystemExit(f"--tokenizer: {spec} is not a tokenizers tokenizer.json ({e})") from None
        self.vocab, self.name = self._tok.get_vocab_size(), str(path.resolve())
        if eos == "none":
            self.eos_id = None
        elif eos == "auto":
            found = [t for t in (*EOS_CANDIDATES, declared_eos(path)) if t and self._tok.token_to_id(t) is not None]
            if not found:
                raise SystemExit(f"--eos auto: {spec} has none of the end-of-text tokens {', '.join(EOS_CANDIDATES)}, "
                                 f"and no tokenizer_config.json beside it names one of its tokens as eos_token; name "
                                 f"its token with --eos TOKEN, or pass --eos none to join documents unmarked")
            self.eos_id = self._tok.token_to_id(found[0])
        else:
            self.eos_id = self._tok.token_to_id(eos)
            if self.eos_id is None:
                raise SystemExit(f"--eos {eos}: not a token of {spec}")

    def _ids(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        if self._tok is None:
            return [np.frombuffer(d if isinstance(d, bytes) else d.encode("utf-8"), np.uint8) for d in texts]
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in texts]
        return [np.asarray(e.ids, np.uint32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode(self, examples: Sequence[Sequence[tuple[str | bytes, bool]]]
               ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """(ids, loss mask or None where every token is a target) of each example, given as (text, trained)
        segments: each segment is tokenized on its own (a prompt as the model will see it when asked to continue it),
        then the end-of-text id, trained when the example's last segment is (a reply learns to end)."""
        ids = iter(self._ids([t for ex in examples for t, _ in ex]))
        out = []
        for ex in examples:
            parts = [next(ids) for _ in ex]
            if self.eos_id is not None:
                parts.append(np.asarray([self.eos_id], parts[0].dtype if parts else np.uint32))
            toks = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if all(trained for _, trained in ex):
                out.append((toks, None))
                continue
            mask = [np.full(len(a), trained) for a, (_, trained) in zip(parts, ex)]
            if self.eos_id is not None:
                mask.append(np.asarray([ex[-1][1]]))
            out.append((toks, np.concatenate(mask)))
        return out


CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ChatTemplate:
    """A Jinja chat template (HF's convention: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`) and the
    replies' places in what it renders.

    spec: "chatml" (built in), a template file, or a tokenizer_config.json holding "chat_template"; None looks beside
    the tokenizer.json for chat_template.jinja, then tokenizer_config.json. Rendered in jinja2's sandbox, as
    transformers does, since a template comes with a downloaded model.
    """

    def __init__(self, spec: str | None, tokenizer: str, where: str):
        try:
            import jinja2
            import jinja2.ext
            import jinja2.sandbox
        except ImportError:
            raise SystemExit(f"{where}: chat messages need the `jinja2` package for the chat template (pip install "
                             f"jinja2, or mx_jax[data])")
        self.variables: dict[str, str] = {}
        source, self.name = self._find(spec, tokenizer, where)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                          extensions=[jinja2.ext.loopcontrols])

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: time.strftime(fmt))
        try:
            self._template, self.source = env.from_string(source), source
        except jinja2.TemplateError as e:
            raise SystemExit(f"--chat-template {self.name}: not a Jinja template ({e})")
        self._error = jinja2.TemplateError

    def _find(self, spec: str | None, tokenizer: str, where: str) -> tuple[str, str]:
        if spec == "chatml":
            return CHATML, "chatml"
        beside = pathlib.Path(tokenizer).parent if tokenizer != "byte" else None
        config = None
        if spec is None:
            if beside is not None and (beside / "chat_template.jinja").is_file():
                spec = str(beside / "chat_template.jinja")
            elif beside is not None and (beside / "tokenizer_config.json").is_file():
                config = beside / "tokenizer_config.json"
            else:
                raise SystemExit(f"{where}: chat messages, but no chat template: "
                                 + (f"no chat_template.jinja or tokenizer_config.json beside {tokenizer}"
                                    if beside is not None else "the byte tokenizer has none")
                                 + "; pass --chat-template FILE (a template or a tokenizer_config.json) or "
                                   "--chat-template chatml")
        if config is None:
            path = pathlib.Path(spec)
            if not path.is_file():
                raise SystemExit(f"--chat-template {spec}: neither 'chatml' nor an existing file")
            if path.suffix != ".json":
                return path.read_text(encoding="utf-8"), str(path)
            config = path
        if (config.parent / "tokenizer_config.json").is_file():
            cfg = read_json_object(config.parent / "tokenizer_config.json")
            for k in ("bos_token", "eos_token"):
                v = cfg.get(k)
                v = v.get("content") if isinstance(v, dict) else v
                if isinstance(v, str):
                    self.variables[k] = v
        cfg = read_json_object(config)
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):  # named templates: [{"name": ..., "template": ...}]
            tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(tpl, str):
            raise SystemExit(f"{where}: chat messages, but {config} has no \"chat_template\" string; pass "
                             f"--chat-template FILE or --chat-template chatml")
        return tpl, str(config)

    def render(self, messages: list, add_generation_prompt: bool, where: str, tools: list | None = None) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **self.variables)
        except self._error as e:
            raise SystemExit(f"{where}: the chat template ({self.name}) refused the conversation: {e}")

    def segments(self, messages: list, where: str, tools: list | None = None) -> list[tuple[str, bool]]:
        """The rendered conversation as (text, trained) segments: each assistant message's text (a reply or its tool
        calls), from the end of the generation prompt before it (render(messages[:k], add_generation_prompt=True))
        to the end of render(messages[:k+1]) -- its end-of-turn marker included -- is trained; everything else
        (system, user and tool messages, the tools' schemas) is context."""
        full = self.render(messages, False, where, tools)
        out, pos = [], 0
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            pre = self.render(messages[:k], True, where, tools)
            upto = self.render(messages[:k + 1], False, where, tools)
            if not (upto.startswith(pre) and full.startswith(upto) and len(pre) >= pos):
                raise SystemExit(f"{where}: the chat template ({self.name}) does not render this conversation prefix "
                                 f"by prefix (what comes before assistant message {k} changes once later messages "
                                 f"follow), so the replies cannot be told from the prompts")
            out += [(full[pos:len(pre)], False), (full[len(pre):len(upto)], True)]
            pos = len(upto)
        out.append((full[pos:], False))
        return [(t, trained) for t, trained in out if t]


def _input_files(inputs: Sequence[str], pattern: str) -> list[tuple[str, pathlib.Path]]:
    """(key, path) of every input file; a directory contributes its non-hidden files matching `pattern`. Under the
    default pattern, a directory that holds JSON-lines or Parquet files contributes only those (a downloaded
    dataset's README.md or LICENSE is not a document), and the skipped files are named on stderr."""
    files = []
    for item in inputs:
        p = pathlib.Path(item)
        if p.is_dir():
            found = []
            for f in sorted(p.rglob(pattern)):
                rel = f.relative_to(p)
                if f.is_file() and not any(part.startswith(".") for part in rel.parts):
                    found.append(((pathlib.Path(p.resolve().name) / rel).as_posix(), f))
            records = [(k, f) for k, f in found if _file_kind(f)[0] != "text"]
            if pattern == "*" and records and len(records) < len(found):
                other = [f.name for _, f in found if _file_kind(f)[0] == "text"]
                print(f"convert: {p} holds JSON-lines or Parquet files; its {len(other)} other file(s) are not read "
                      f"({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}; --pattern chooses files)",
                      file=sys.stderr)
                found = records
            files.extend(found)
        elif p.is_file():
            files.append((p.name, p))
        else:
            raise SystemExit(f"input {item} does not exist")
    if not files:
        raise SystemExit(f"no input files in {' '.join(inputs)}" + (f" matching --pattern {pattern}"
                                                                      if pattern != "*" else ""))
    return files


def _file_kind(path: pathlib.Path) -> tuple[str, str]:
    """("jsonl" | "parquet" | "text", compression suffix or "")."""
    name = path.name.lower()
    comp = next((c for c in COMPRESSED if name.endswith(c)), "")
    stem = name[: len(name) - len(comp)]
    if stem.endswith(".parquet"):
        if comp:
            raise SystemExit(f"{path}: a compressed Parquet file; Parquet compresses inside, pass the .parquet itself")
        return "parquet", ""
    return ("jsonl" if stem.endswith(JSON_LINES) else "text"), comp


def _open_stream(path: pathlib.Path, comp: str):
    """(decompressed binary stream, the raw file whose tell() is the progress)."""
    raw = open(path, "rb")
    if comp == ".gz":
        import gzip
        return gzip.GzipFile(fileobj=raw), raw
    if comp == ".bz2":
        import bz2
        return bz2.BZ2File(raw), raw
    if comp == ".xz":
        import lzma
        return lzma.LZMAFile(raw), raw
    if comp in (".zst", ".zstd"):
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise SystemExit(f"{path}: reading .zst files needs the `zstandard` package (pip install zstandard)")
        import io
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)), raw
    return raw, raw


def _record_fields(names: Sequence[str], text_key: str) -> tuple[str, ...] | None:
    """Which fields make a record: ("messages"[, "tools"]) for a chat, ("prompt", "completion"), or (text_key,)."""
    if "messages" in names:
        return ("messages", "tools") if "tools" in names else ("messages",)
    if "prompt" in names and "completion" in names:
        return ("prompt", "completion")
    return (text_key,) if text_key in names else None


def _record(values: Sequence, fields: tuple[str, ...], where: str):
    """A record's document (str) or fine-tuning example: (prompt, completion), or a chat {"messages", "tools"}.

    A chat message is passed to the template whole (tool calls, names, ids), less the keys that are null (a Parquet
    struct's absent fields); its content must be text, except in an assistant message that makes tool calls."""
    for k, v in zip(fields, values):
        if k not in ("messages", "tools") and v is not None and not isinstance(v, str):
            raise SystemExit(f"{where}: field {k!r} holds {type(v).__name__}, not text")
    if fields[0] == "messages":
        msgs = values[0]
        if isinstance(msgs, list) and all(isinstance(m, dict) for m in msgs):
            msgs = [{k: v for k, v in m.items() if v is not None} for m in msgs]
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and (isinstance(m.get("content"), str) or ("content" not in m and m.get("tool_calls")))
                for m in msgs):
            raise SystemExit(f"{where}: 'messages' must be a list of {{\"role\": text, \"content\": text}} objects "
                             f"(content may be absent or null where an assistant message has tool_calls)")
        tools = values[1] if len(values) > 1 else None
        if tools is not None and not isinstance(tools, list):
            raise SystemExit(f"{where}: 'tools' must be a list (of function schemas), got {type(tools).__name__}")
        return {"messages": msgs, "tools": tools}
    if len(fields) == 2:
        return values[0] or "", values[1] or ""
    return values[0] or ""


def _no_fields(where: str, names: Sequence[str], text_key: str, noun: str = "field") -> SystemExit:
    return SystemExit(f"{where}: no {text_key!r} {noun}, nor 'prompt' and 'completion', nor 'messages' (has: "
                      f"{', '.join(map(str, names))}); name the text {noun} with --text-key")


def read_records(path: pathlib.Path, text_key: str):
    """Yields (record index or None for a whole-file document, document or example (`_record`), bytes of the file
    read so far). A file that cannot be read or decompressed (truncated, or not what its name says) stops the
    conversion with its name."""
    try:
        yield from _read_records(path, text_key)
    except Exception as e:  # noqa: BLE001 -- the decompressors' and pyarrow's own error types among them
        if not (isinstance(e, (OSError, EOFError, lzma.LZMAError, zlib.error))
                or type(e).__module__.split(".")[0] in ("zstandard", "zstd", "pyarrow")):
            raise
        comp = _file_kind(path)[1]
        raise SystemExit(f"{path}: cannot be read{f' as {comp[1:]}' if comp else ''} ({type(e).__name__}: "
                         f"{str(e)[:200]}); is the file whole, and of the kind its name says?") from None


def _read_records(path: pathlib.Path, text_key: str):
    kind, comp = _file_kind(path)
    if kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(f"{path}: reading Parquet files needs the `pyarrow` package (pip install pyarrow)")
        pf = pq.ParquetFile(path)
        fields = _record_fields(pf.schema_arrow.names, text_key)
        if fields is None:
            raise _no_fields(str(path), pf.schema_arrow.names, text_key, "column")
        size, groups, i = path.stat().st_size, max(pf.num_row_groups, 1), 0
        for g in range(pf.num_row_groups):
            table = pf.read_row_group(g, columns=list(fields))
            for values in zip(*(table.column(k).to_pylist() for k in fields)):
                yield i, _record(values, fields, f"{path}: row {i}"), size * (g + 1) // groups
                i += 1
        return
    stream, raw = _open_stream(path, comp)
    try:
        if kind == "text":
            yield None, stream.read(), raw.tell()
            return
        for i, line in enumerate(stream):
            if not line.strip():
                raise SystemExit(f"{path}:{i + 1}: an empty line in a JSON-lines file")
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"{path}:{i + 1}: not a JSON object ({e}); a JSON-lines file holds one object per "
                                 f"line")
            if not isinstance(obj, dict):
                raise SystemExit(f"{path}:{i + 1}: a JSON {type(obj).__name__}, not an object")
            fields = _record_fields(list(obj), text_key)
            if fields is None:
                raise _no_fields(f"{path}:{i + 1}", list(obj), text_key)
            yield i, _record([obj[k] for k in fields], fields, f"{path}:{i + 1}"), raw.tell()
    finally:
        stream.close()
        raw.close()


class _Progress:
    """A line on stderr every `every` seconds: files, documents, tokens and the input read so far."""

    def __init__(self, total_bytes: int, n_files: int, enabled: bool, every: float = 10.0):
        self.total, self.n_files, self.enabled, self.every = total_bytes, n_files, enabled, every
        self.t0 = self.last = time.monotonic()

    def update(self, read: int, files: int, docs: int, tokens: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.every and not force):
            return
        self.last = now
        rate = read / max(now - self.t0, 1e-9)
        eta = f", ETA {(self.total - read) / rate:.0f} s" if rate > 0 and read < self.total else ""
        print(f"convert: {files}/{self.n_files} files, {docs:,} documents, {tokens:,} tokens, "
              f"{read / 1e6:,.1f} of {self.total / 1e6:,.1f} MB read ({rate / 1e6:.1f} MB/s{eta})",
              file=sys.stderr, flush=True)


class _Packer:
    """First-fit packing of whole examples into rows of T tokens (convert --pack T): an example goes into the first
    of the open rows with room for it, else opens one; with OPEN rows open, the oldest is closed. A closed row is
    filled up with the pad id, never a target."""

    OPEN = 64

    def __init__(self, seq_len: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.rows: list[list] = []  # [ids pieces, mask pieces, tokens used]
        self.padding = 0  # pad tokens in the closed rows

    def add(self, ids: np.ndarray, mask: np.ndarray | None) -> list[tuple[np.ndarray, np.ndarray]]:
        mask = np.ones(len(ids), bool) if mask is None else mask
        row = next((r for r in self.rows if r[2] + len(ids) <= self.seq_len), None)
        done = []
        if row is None:
            if len(self.rows) == self.OPEN:
                done.append(self._close(self.rows.pop(0)))
            row = [[], [], 0]
            self.rows.append(row)
        row[0].append(ids)
        row[1].append(mask)
        row[2] += len(ids)
        if row[2] == self.seq_len:
            self.rows = [r for r in self.rows if r is not row]
            done.append(self._close(row))
        return done

    def _close(self, row: list) -> tuple[np.ndarray, np.ndarray]:
        pad = self.seq_len - row[2]
        self.padding += pad
        return (np.concatenate([*row[0], np.full(pad, self.pad_id, row[0][0].dtype)]),
                np.concatenate([*row[1], np.zeros(pad, bool)]))

    def close(self) -> list[tuple[np.ndarray, np.ndarray]]:
        done, self.rows = [self._close(r) for r in self.rows], []
        return done


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What every part of a conversion shares (picklable: a worker process gets it)."""
    tokenizer: str
    eos: str
    shard_tokens: int
    stride: int  # a record is held out when sha1(key) % stride == 0; 0: none
    text_key: str
    chat_template: str | None
    pack: int


SHARD_PATTERNS = ("train_*.bin*", "val_*.bin*", "train_*.mask*", "val_*.mask*")  # with their .tmp files


def _write_file(target: pathlib.Path, arr: np.ndarray, written: list[pathlib.Path]) -> None:
    """Write under a temporary name and rename: a file is either whole or absent."""
    tmp = target.with_name(target.name + ".tmp")
    written.extend([tmp, target])
    arr.tofile(tmp)
    tmp.replace(target)


def _convert_part(files: Sequence[tuple[str, pathlib.Path]], out_dir: pathlib.Path, st: _Settings, prefix: str = "",
                  progress: bool = False, hold_out_last: bool = True) -> dict:
    """Tokenize `files` into `<split>_<prefix><k>.bin` shards (and their masks) under out_dir; returns what the
    meta.json needs: token and target counts per split, statistics, and the shards written (path, tokens, whether a
    mask was written beside it). hold_out_last: with no record held out, move the last one to the held-out split
    (tiny inputs); a part of a parallel conversion leaves that to the whole."""
    enc = _Encoder(st.tokenizer, st.eos)
    dtype = np.uint16 if enc.vocab <= 65536 else np.uint32
    pack = st.pack
    buffers: dict[str, list[tuple[np.ndarray, np.ndarray | None]]] = {"train": [], "val": []}  # (ids, loss mask)
    pending = {"train": 0, "val": 0}  # tokens in buffers[split]
    counts = {"train": 0, "val": 0}
    targets = {"train": 0, "val": 0}  # tokens the loss counts
    shard_idx = {"train": 0, "val": 0}
    written: list[pathlib.Path] = []
    shards: list[tuple[pathlib.Path, int, bool]] = []  # (shard, tokens, whether a mask was written beside it)
    stats = {"max_id": -1, "documents": 0, "empty": 0, "read": 0, "examples": 0, "untrained": 0, "cut": 0,
             "eos_inside": 0,
             "cut_dropped": 0}
    pad_id = 1 if enc.eos_id == 0 else 0  # any id but the end of text: padding must not count as a document
    packers = {split: _Packer(pack, pad_id) for split in ("train", "val")} if pack else {}
    template: list[ChatTemplate] = []  # made at the first chat record

    def flush(split: str, force: bool = False) -> None:
        if pending[split] == 0 or (pending[split] < st.shard_tokens and not force):
            return
        if pack:  # one pad token after the rows: the last row's window reads one token past it
            buffers[split].append((np.asarray([pad_id], dtype), np.zeros(1, bool)))
            counts[split] += 1
            pending[split] += 1
        target = out_dir / f"{split}_{prefix}{shard_idx[split]:05d}.bin"
        _write_file(target, np.concatenate([ids for ids, _ in buffers[split]]).astype(dtype), written)
        masked = any(m is not None for _, m in buffers[split])
        if masked:  # the shards of plain documents only get theirs at the end, if examples came
            _write_file(target.with_suffix(".mask"), np.packbits(np.concatenate(
                [np.ones(len(ids), bool) if m is None else m for ids, m in buffers[split]]), bitorder="little"), written)
        shards.append((target, pending[split], masked))
        shard_idx[split] += 1
        buffers[split], pending[split] = [], 0

    def segments(item, f: pathlib.Path, index: int | None) -> list[tuple[str | bytes, bool]]:
        if isinstance(item, (str, bytes)):
            return [(item, True)] if item else []
        stats["examples"] += 1
        if isinstance(item, tuple):
            return [(t, trained) for t, trained in zip(item, (False, True)) if t]
        where = f"{f}:{index + 1}" if _file_kind(f)[0] == "jsonl" else f"{f}: row {index}"
        if not template:
            template.append(ChatTemplate(st.chat_template, st.tokenizer, where))
        return template[0].segments(item["messages"], where, item["tools"])

    def add(batch: list[tuple[str, list[tuple[str | bytes, bool]]]]) -> None:
        for (key, _), (ids, mask) in zip(batch, enc.encode([ex for _, ex in batch])):
            if enc.eos_id is not None and (ids[:-1] == enc.eos_id).any():  # ends the document early (NUL for bytes)
                stats["eos_inside"] += 1
            split = "val" if st.stride and int(hashlib.sha1(key.encode()).hexdigest(), 16) % st.stride == 0 \
                else "train"
            if pack and len(ids) > pack:
                ids, mask = ids[:pack], None if mask is None else mask[:pack]
                stats["cut"] += 1
                if mask is not None and not mask.any():  # its prompt fills the row: nothing left to train
                    stats["cut_dropped"] += 1
                    continue
            if len(ids):
                stats["max_id"] = max(stats["max_id"], int(ids.max()))
            stats["documents"] += 1
            for row in packers[split].add(ids, mask) if pack else [(ids, mask)]:
                append(split, *row)

    def append(split: str, ids: np.ndarray, mask: np.ndarray | None) -> None:
        buffers[split].append((ids.astype(dtype, copy=False), mask))
        counts[split] += len(ids)
        targets[split] += len(ids) if mask is None else int(np.count_nonzero(mask))
        pending[split] += len(ids)
        if not pack:
            flush(split)
        elif pending[split] + pack > st.shard_tokens:  # a packed shard holds whole rows: the next would not fit
            flush(split, force=True)

    prog = _Progress(sum(f.stat().st_size for _, f in files), len(files), progress)
    for n_done, (key, f) in enumerate(files):
        batch: list[tuple[str, list[tuple[str | bytes, bool]]]] = []
        batch_bytes = 0
        for index, item, read in read_records(f, st.text_key):
            ex = segments(item, f, index)
            if not any(trained for _, trained in ex):  # empty, or an example without a reply
                stats["untrained" if ex else "empty"] += 1
                continue
            batch.append((key if index is None else f"{key}#{index}", ex))
            batch_bytes += sum(len(t) for t, _ in ex)
            if batch_bytes >= ENCODE_BATCH_BYTES:
                add(batch)
                batch, batch_bytes = [], 0
                prog.update(stats["read"] + read, n_done, stats["documents"], sum(counts.values()))
        add(batch)
        stats["read"] += f.stat().st_size
        prog.update(stats["read"], n_done + 1, stats["documents"], sum(counts.values()))
    for split, packer in packers.items():
        for row in packer.close():
            append(split, *row)
    if hold_out_last and counts["val"] == 0 and stats["documents"]:  # tiny inputs: hold out the last document
        if not buffers["train"]:
            raise SystemExit(f"no document was held out, and the training shards are already written; raise "
                             f"--val-fraction or --shard-tokens ({st.shard_tokens})")
        if counts["train"] == len(buffers["train"][-1][0]):
            raise SystemExit(f"the input's {counts['train']} tokens are one {'packed row' if pack else 'document'}: "
                             f"held out for evaluation, it would leave nothing to train on; give more documents (a "
                             f"text file is one, a JSON-lines file one per line)")
        last = buffers["train"].pop()
        for split, sign in (("train", -1), ("val", 1)):
            counts[split] += sign * len(last[0])
            pending[split] += sign * len(last[0])
            targets[split] += sign * (len(last[0]) if last[1] is None else int(np.count_nonzero(last[1])))
        buffers["val"].append(last)
    flush("train", force=True)
    flush("val", force=True)
    prog.update(stats["read"], len(files), stats["documents"], sum(counts.values()), force=True)
    return {"counts": counts, "targets": targets, "stats": stats, "shards": [(str(a), n, m) for a, n, m in shards],
            "template": template[0].name if template else None, "pad_id": pad_id, "dtype": np.dtype(dtype).name,
            "vocab": enc.vocab, "tokenizer": enc.name, "eos_id": enc.eos_id,
            # padding of the packed rows, and the pad token after each shard's rows
            "padding": sum(k.padding for k in packers.values()) + (len(shards) if pack else 0)}


def _part_worker(args: tuple) -> dict:
    """One part of a parallel conversion, in a worker process."""
    files, out_dir, st, prefix = args
    return _convert_part(files, out_dir, st, prefix, hold_out_last=False)


def _split_files(files: Sequence[tuple[str, pathlib.Path]], n: int) -> list[list[tuple[str, pathlib.Path]]]:
    """n groups of about equal bytes: the largest files first, each into the lightest group (in input order within
    a group)."""
    groups: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(files)), key=lambda i: -files[i][1].stat().st_size):
        g = load.index(min(load))
        groups[g].append(i)
        load[g] += files[i][1].stat().st_size
    return [[files[i] for i in sorted(g)] for g in groups if g]


def _finish(parts: list[dict], out_dir: pathlib.Path, n_files: int, val_fraction: float, pack: int,
            written: list[pathlib.Path], extra: dict) -> dict:
    """meta.json from the parts of a conversion (_convert_part's results), written last; the plain-document shards
    of a conversion with examples get their all-ones masks here. `extra`: more meta fields (workers, parts)."""
    total = lambda key: sum(part["stats"][key] for part in parts)  # noqa: E731
    counts = {s: sum(part["counts"][s] for part in parts) for s in ("train", "val")}
    targets = {s: sum(part["targets"][s] for part in parts) for s in ("train", "val")}
    shards = [(pathlib.Path(a), n, m) for part in parts for a, n, m in part["shards"]]
    if total("documents") == 0:
        raise SystemExit(f"no documents in {n_files} input file(s): every one was empty"
                         + (f" or an example without a reply ({total('untrained')})" if total("untrained") else ""))
    if counts["val"] == 0:
        raise SystemExit(f"no record was held out: raise --val-fraction ({val_fraction})")
    if counts["train"] == 0:
        raise SystemExit(f"every record was held out, none is left to train on: lower --val-fraction ({val_fraction})")
    first = parts[0]
    meta = {"dtype": first["dtype"], "vocab_size": first["vocab"], "tokenizer": first["tokenizer"],
            "eos_id": first["eos_id"], "train_tokens": counts["train"], "val_tokens": counts["val"],
            "max_token_id": max(part["stats"]["max_id"] for part in parts), "files": n_files,
            "documents": total("documents"), "empty_documents": total("empty")}
    if eos_inside := sum(part["stats"].get("eos_inside", 0) for part in parts):
        # The end-of-text token inside a document ends it there for model.attention_mask=documents and the
        # documents-per-sequence statistics: with bytes, every NUL of a binary or UTF-16 file is one.
        meta["documents_with_eos_inside"] = eos_inside
        print(f"warning: {eos_inside} of {total('documents')} documents hold the end-of-text token "
              f"(id {first['eos_id']}{', NUL' if first['tokenizer'] == 'byte' else ''}) inside them, which splits them "
              f"there (binary or UTF-16 files?)", file=sys.stderr)
    if any(masked for *_, masked in shards):
        for shard, n, masked in shards:
            if not masked:
                _write_file(shard.with_suffix(".mask"), np.packbits(np.ones(n, bool), bitorder="little"), written)
        template = next((part["template"] for part in parts if part["template"]), None)
        meta.update(loss_mask=True, train_target_tokens=targets["train"], val_target_tokens=targets["val"],
                    examples=total("examples"), examples_without_reply=total("untrained"),
                    **({"chat_template": template} if template else {}))
    if pack:
        meta.update(packed=pack, pad_id=first["pad_id"], cut_examples=total("cut"),
                    cut_to_no_target=total("cut_dropped"), pad_tokens=sum(part["padding"] for part in parts))
    meta.update(extra)
    _write_json(out_dir / "meta.json", meta, written)  # written last: a directory with meta.json holds every shard
    return meta


def _write_json(target: pathlib.Path, obj: dict, written: list[pathlib.Path]) -> None:
    tmp = target.with_name(target.name + ".tmp")
    written.append(tmp)
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(target)


def _parse_part(part: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise SystemExit(f"--part {part!r}: expected K/N, this machine's part K of N (0 <= K < N)")
    if not 0 <= k < n:
        raise SystemExit(f"--part {part!r}: expected K/N with 0 <= K < N")
    return k, n


def _listing(files: Sequence[tuple[str, pathlib.Path]]) -> str:
    """A digest of the input files' keys and sizes: every part of a conversion must see the same listing."""
    return hashlib.sha1(json.dumps([(key, f.stat().st_size) for key, f in files]).encode()).hexdigest()[:16]


def convert(inputs: Sequence[str], out: str, tokenizer: str = "byte", shard_tokens: int = 100_000_000,
            val_fraction: float = 0.05, pattern: str = "*", text_key: str = "text", eos: str = "auto",
            progress: bool = False, chat_template: str | None = None, pack: int = 0, workers: int = 1,
            part: str | None = None) -> dict:
    """Tokenize documents (text, JSON-lines or Parquet files) into train/val shards under `out`.

    pack > 0: whole examples packed into rows of `pack` tokens (_Packer; one longer is cut to `pack` tokens), each
    shard a whole number of rows and one pad token, so that a run's windows (data.seq_len = pack) are the rows.
    workers > 1: the files are split into that many groups of about equal bytes, each converted by its own process
    into its own shards (`<split>_p<i>_<k>.bin`); which record lands where then depends on the number of workers.
    part "K/N": this machine converts the K-th of N groups of the files (the same split, by bytes, on every machine
    that lists the same inputs) into `<split>_n<K>_...` shards and `meta.part<K>.json` instead of meta.json, beside
    the other machines' parts in a shared `out`; `merge` then writes meta.json. A record is held out or not by its
    own key, so the held-out records do not depend on N or on the workers.

    Writes each shard under a temporary name and renames it whole, and meta.json last; if the conversion stops on an
    error, the shards it wrote are removed again, so `out` never holds a partial conversion. Where some records are
    fine-tuning examples, each shard gets its loss mask (`<shard>.mask`, load_masks) and meta.json "loss_mask".
    """
    if not 0 <= val_fraction <= 0.5:  # held out: 1 in round(1 / val_fraction) documents, so above 1/2 all of them
        raise SystemExit(f"--val-fraction must be in [0, 0.5] (one document in round(1 / fraction) is held out), "
                         f"got {val_fraction}")
    if shard_tokens < 1:
        raise SystemExit(f"--shard-tokens must be positive, got {shard_tokens}")
    if pack < 0:
        raise SystemExit(f"--pack must be positive (or 0: no packing), got {pack}")
    if workers < 1:
        raise SystemExit(f"--workers must be positive, got {workers}")
    k, n = _parse_part(part) if part is not None else (0, 1)
    _Encoder(tokenizer, eos)  # a bad --tokenizer or --eos stops here, before any file is read
    files = _input_files(inputs, pattern)
    if n > len(files):
        raise SystemExit(f"--part {part}: {len(files)} input file(s) cannot be split into {n} parts")
    mine = _split_files(files, n)[k] if part is not None else files
    out_dir = pathlib.Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise SystemExit(f"--out {out} exists and is not a directory")
    own = SHARD_PATTERNS if part is None else tuple(p.replace("_*", f"_n{k:03d}_*") for p in SHARD_PATTERNS)
    shard_files = lambda: [f for pattern in own for f in out_dir.glob(pattern)]  # noqa: E731
    done = out_dir / ("meta.json" if part is None else f"meta.part{k:03d}.json")
    old = sorted({p.name for p in [*shard_files(), done, out_dir / "meta.json"] if p.exists()}) \
        if out_dir.is_dir() else []
    if old:
        listed = ", ".join(old[:4]) + (", ..." if len(old) > 4 else "")
        raise SystemExit(f"--out {out} already holds token shards ({listed}); write into a new directory, or remove "
                         f"them first")
    made = [d for d in (out_dir, *out_dir.parents) if not d.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    st = _Settings(tokenizer, eos, shard_tokens, max(1, round(1 / val_fraction)) if val_fraction > 0 else 0,
                   text_key, chat_template, pack)
    groups = _split_files(mine, min(workers, len(mine)))
    prefix = "" if part is None else f"n{k:03d}_"
    written: list[pathlib.Path] = []
    try:
        if len(groups) == 1:
            parts = [_convert_part(mine, out_dir, st, prefix, progress=progress, hold_out_last=part is None)]
        else:
            import concurrent.futures
            import multiprocessing

            parts = []
            jobs = [(g, out_dir, st, f"{prefix}p{i:03d}_") for i, g in enumerate(groups)]
            # spawn, not fork: the parent may have started jax's threads
            with concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) \
                    as pool:
                for i, done_part in enumerate(pool.map(_part_worker, jobs)):
                    parts.append(done_part)
                    if progress:
                        print(f"convert: part {i + 1}/{len(jobs)} done ({len(groups[i])} files, "
                              f"{done_part['stats']['documents']:,} documents)", file=sys.stderr, flush=True)
        if part is None:
            meta = _finish(parts, out_dir, len(files), val_fraction, pack, written,
                           {"workers": len(groups)} if workers > 1 else {})
        else:  # what merge needs; the shards by name, the directory may be mounted elsewhere on another machine
            for q in parts:
                q["shards"] = [(pathlib.Path(a).name, tokens, masked) for a, tokens, masked in q["shards"]]
            meta = {"part": k, "parts": n, "listing": _listing(files), "files": len(mine), "total_files": len(files),
                    "settings": dataclasses.asdict(st), "val_fraction": val_fraction, "workers": len(groups),
                    "converted": parts}
            _write_json(done, meta, written)
    except BaseException:
        # every shard of this conversion (the directory held none before it), from whichever process wrote it
        for q in [*written, *shard_files()]:
            q.unlink(missing_ok=True)
        for d in made:  # the directories this call created, deepest first, where nothing else was put in them
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise
    cut = sum(q["stats"]["cut"] for q in parts)
    if cut:
        dropped = sum(q["stats"]["cut_dropped"] for q in parts)
        print(f"convert: warning: {cut} record(s) longer than --pack {pack} tokens were cut to it"
              + (f", {dropped} of them dropped (the prompt filled the row)" if dropped else ""), file=sys.stderr)
    return meta


# What `convert --part K/N` writes into meta.part<K>.json, and into each of its "converted" entries, for `merge`.
_PART_KEYS = {"part": int, "parts": int, "listing": str, "total_files": int, "settings": dict,
              "val_fraction": (int, float), "workers": int, "converted": list}
_CONVERTED_KEYS = {"counts": dict, "targets": dict, "stats": dict, "shards": list, "dtype": str, "vocab": int,
                   "eos_id": (int, type(None))}


def _read_part_meta(f: pathlib.Path) -> dict:
    """A meta.part<K>.json, its keys checked: a damaged or foreign file is an error naming it."""
    m = read_json_object(f, SystemExit)
    for where, obj, keys in (("", m, _PART_KEYS), *((f"converted[{i}].", c, _CONVERTED_KEYS)
                                                   for i, c in enumerate(m.get("converted") or [None]))):
        for key, kind in keys.items():
            if not isinstance(obj, dict) or not isinstance(obj.get(key), kind) or isinstance(obj.get(key), bool):
                raise SystemExit(f"{f}: {where}{key} is missing or not a {getattr(kind, '__name__', kind)}; not a "
                                 f"meta.part file that this version of `convert --part K/N` writes")
    return m


def merge(out: str) -> dict:
    """meta.json from the `meta.part<K>.json` files that `convert --part K/N` wrote into `out` (every K of N, from
    the same input listing and settings); the part files are removed once meta.json is written. Nothing is changed
    on an error."""
    out_dir = pathlib.Path(out)
    if (out_dir / "meta.json").exists():
        raise SystemExit(f"{out_dir / 'meta.json'} exists: the conversion is already merged")
    found = sorted(out_dir.glob("meta.part*.json")) if out_dir.is_dir() else []
    if not found:
        raise SystemExit(f"{out}: no meta.part*.json (written by `convert --part K/N --out {out}`)")
    metas = [_read_part_meta(f) for f in found]
    n = metas[0]["parts"]

    def agreed(m: dict) -> dict:  # the tokenizer and template by what they do: their paths may differ by machine
        enc = {k: m["converted"][0][k] for k in ("vocab", "eos_id", "dtype")}
        st = {k: v for k, v in m["settings"].items() if k not in ("tokenizer", "chat_template")}
        return {"parts": m["parts"], "listing": m["listing"], "settings": st, "val_fraction": m["val_fraction"],
                "tokenizer": enc}

    for f, m in zip(found, metas):
        for key, value in agreed(m).items():
            if value != agreed(metas[0])[key]:
                raise SystemExit(f"{f.name} has another {key} than {found[0].name} ({value} against "
                                 f"{agreed(metas[0])[key]}): the parts must convert the same input files with the "
                                 f"same options")
    missing = sorted(set(range(n)) - {m["part"] for m in metas})
    if missing:
        raise SystemExit(f"{out}: part(s) {', '.join(f'{k}/{n}' for k in missing)} of {n} not converted yet "
                         f"(no meta.part file)")
    parts = [{**q, "shards": [(str(out_dir / name), tokens, masked) for name, tokens, masked in q["shards"]]}
             for m in metas for q in m["converted"]]
    for q in parts:
        for name, _, masked in q["shards"]:
            if not pathlib.Path(name).exists() or (masked and not pathlib.Path(name).with_suffix(".mask").exists()):
                raise SystemExit(f"{name} is missing: a part's shard was moved or removed since it was converted")
    written: list[pathlib.Path] = []
    try:
        meta = _finish(parts, out_dir, metas[0]["total_files"], metas[0]["val_fraction"],
                       metas[0]["settings"]["pack"], written,
                       {"parts": n, **({"workers": sum(m["workers"] for m in metas)}
                                       if any(m["workers"] > 1 for m in metas) else {})})
    except BaseException:
        for q in written:  # the masks and meta.json this call wrote; the parts' shards stay
            q.unlink(missing_ok=True)
        raise
    for f in found:
        f.unlink()
    return meta


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mx_jax.data", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="tokenize documents into train/val token shards",
                       description="Tokenize text files (one document each), JSON-lines files (.jsonl, .ndjson, "
                                   ".json; one document per line, in --text-key) or Parquet files (the --text-key "
                                   "column) into train/val token shards; .gz, .bz2, .xz and .zst inputs are "
                                   "decompressed. Records with 'prompt' and 'completion', or chat 'messages', are "
                                   "fine-tuning examples: only the completion or the assistant's replies are "
                                   "trained (a loss mask beside each shard).")
    c.add_argument("inputs", nargs="+", help="files or directories (searched recursively; hidden files skipped)")
    c.add_argument("--out", required=True, help="a new directory (or one without shards)")
    c.add_argument("--tokenizer", default="byte", help="'byte' or a HF tokenizer.json")
    c.add_argument("--pattern", default="*", help="glob for files inside input directories, e.g. '*.parquet' (default: "
                   "all, or only the JSON-lines and Parquet files of a directory that has some)")
    c.add_argument("--text-key", default="text", help="the document's field (JSON lines) or column (Parquet)")
    c.add_argument("--eos", default="auto", help="the token after each document: 'auto' (the tokenizer's "
                   "end-of-text token; NUL for bytes), a token string, or 'none'")
    c.add_argument("--chat-template", default=None, help="for records with 'messages': 'chatml', a Jinja template "
                   "file, or a tokenizer_config.json (default: chat_template.jinja or tokenizer_config.json beside "
                   "--tokenizer)")
    c.add_argument("--pack", type=int, default=0, metavar="T", help="pack whole examples into rows of T tokens, "
                   "the run's data.seq_len, so none is cut across sequences (an example longer than T is cut to T)")
    c.add_argument("--workers", type=int, default=1, help="processes converting the files in parallel (groups of "
                   "about equal bytes, each into its own shards); the order of the records depends on it")
    c.add_argument("--part", metavar="K/N", help="convert part K of N (0-based) into a shared --out: one part per "
                   "machine, the same inputs and options on each; then `python -m mx_jax.data merge OUT`")
    c.add_argument("--shard-tokens", type=int, default=100_000_000)
    c.add_argument("--val-fraction", type=float, default=0.05, help="share of the records held out, in [0, 0.5]")
    c.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    m = sub.add_parser("merge", help="meta.json for the parts that `convert --part K/N` wrote into a directory")
    m.add_argument("out", help="the directory the parts were converted into")
    args = ap.parse_args(argv)
    if args.cmd == "merge":
        meta = merge(args.out)
    else:
        meta = convert(args.inputs, args.out, args.tokenizer, args.shard_tokens, args.val_fraction, args.pattern,
                       args.text_key, args.eos, progress=not args.quiet, chat_template=args.chat_template,
                       pack=args.pack, workers=args.workers, part=args.part)
        if args.part is not None:
            meta = {k: v for k, v in meta.items() if k != "converted"}
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
