"""A checkpoint's loss on files of text: nats per token, perplexity and bits per byte.

    python -m mx_jax.sample runs/llama3_1b --loss wiki_test.jsonl,code_test.jsonl [--stride 1024] [--out docs.jsonl]

A file is read as `data convert` reads one (mx_jax/data.py): JSON lines or Parquet with the text under "text"
(`--text-key`), or a plain text file as one document. Each document is tokenized on its own and, where the run's
data has an end-of-text token, follows it, as documents follow one another in training, so that its first token is
scored too. Over the N scored tokens x_t of a file,

    loss = -(1/N) sum_t log p(x_t | x_<t)               (nats per token)
    perplexity = exp(loss)
    bits per byte = -sum_t log2 p(x_t | x_<t) / B       (B: the documents' UTF-8 bytes; comparable across tokenizers)

A document longer than a row (data.seq_len = T tokens of context) runs in windows of T tokens, the next starting
`stride` tokens after the last (default T: disjoint windows); a window scores only the tokens that no window before
it scored, so each scored token sees at least T - stride tokens before it (the first window's, all before them).
A smaller stride costs T / stride forwards per T tokens and scores each token with more context (lm-evaluation-
harness's rolling log-likelihood has the disjoint windows). Fine-tuning records score what a fine-tuning on them
trains: a "prompt" and "completion" the completion's tokens after the prompt, chat "messages" the assistant replies
(rendered with the data's chat template, each piece tokenized on its own, as `data convert` does); B counts those
pieces' bytes. (No end-of-text token after a document or reply is scored.) The windows are rows of
`choices.score`: batches of rows, longest first, each cut to its longest row.

Under the trainer, `log.eval_texts=A.jsonl,B.txt` scores the files (disjoint windows) on the training mesh at every
evaluation, after the held-out loss: metrics text_loss/<file stem> and text_bpb/<file stem>.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Callable

import numpy as np

from mx_jax.choices import ROW_MULTIPLE, used_lengths
from mx_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class TextSet:
    """A file's documents as rows: inputs and targets (R, T) int32 (targets -1 where nothing is scored), each row's
    document (R,) (-1 for the rows that pad R to a batch multiple), and per document its scored tokens and bytes."""

    path: str
    inputs: np.ndarray
    targets: np.ndarray
    doc: np.ndarray
    tokens: np.ndarray
    bytes: np.ndarray
    rows: int
    multiple: int = ROW_MULTIPLE

    @property
    def lengths(self) -> np.ndarray:
        return used_lengths(self.targets)


def windows(seq: list[int], first: int, t: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, scored from) of the windows that score the targets seq[first:], end exclusive: a window is the
    inputs seq[start:end - 1] (at most t tokens) with the targets seq[start + 1:end], and it scores those at
    positions >= `scored from`, the ones no earlier window scored. The first window starts where the first target
    has the most context it can, each next one `stride` after it (1 <= stride <= t)."""
    out, done, start = [], first, max(0, first - t)
    while done < len(seq):
        end = min(start + t + 1, len(seq))
        out.append((start, end, done))
        done, start = end, start + stride
    return out


def load(path: str | pathlib.Path, encode: Callable[[str], list[int]], vocab_size: int, seq_len: int, *,
         eos_id: int | None = None, stride: int = 0, batch: int = 1, text_key: str = "text",
         chat_template: str | None = None, tokenizer: str = "byte", multiple: int = ROW_MULTIPLE,
         flag: str = "--loss") -> TextSet:
    """The rows of a text file (module docstring): rows of seq_len tokens, windows `stride` apart (0: seq_len), R a
    multiple of `batch`. chat_template (with the `tokenizer` spec): how chat records are rendered (the data's).
    flag: what errors about the file are said of ("--loss" for the sampler, the config key for the trainer)."""
    from mx_jax import data

    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag}: {path} is not a file")
    stride = stride or seq_len
    if not 1 <= stride <= seq_len:
        raise ConfigError(f"--stride: must be between 1 and data.seq_len={seq_len}, got {stride}")
    template = None
    pieces, tokens, nbytes = [], [], []
    for i, rec, _ in data.read_records(path, text_key):
        where = f"{path}:{i + 1}" if i is not None else str(path)
        if isinstance(rec, dict):  # a chat: its replies scored, as `data convert` marks them for training
            if template is None:
                if chat_template is None:
                    raise ConfigError(f"{where}: a chat record needs a chat template, and the run's data has none "
                                      f"(meta.json chat_template; `sample --loss` takes --chat-template)")
                template = data.ChatTemplate(chat_template, tokenizer, "chat_template")
            segs = template.segments(rec["messages"], where, rec["tools"])
        elif isinstance(rec, tuple):
            segs = [(rec[0], False), (rec[1], True)]
        elif isinstance(rec, bytes) and tokenizer == "byte":  # a whole file: its bytes, as `data convert` reads them
            segs = [(rec, True)]
        else:  # (a whole file for a tokenizer of text: its invalid UTF-8 replaced, as `data convert` does)
            segs = [(rec.decode("utf-8", errors="replace") if isinstance(rec, bytes) else rec, True)]
        # each piece tokenized on its own, as the converter does; the end-of-text token before the first
        seq, scored = ([eos_id], [False]) if eos_id is not None else ([], [])
        for text, trained in segs:
            ids = list(text) if isinstance(text, bytes) else encode(text)
            seq += ids
            scored += [trained] * len(ids)
        if seq and max(seq) >= vocab_size:
            raise ConfigError(f"{where}: token id {max(seq)} is outside the model's vocabulary "
                              f"(model.vocab_size={vocab_size}); is the tokenizer the run's?")
        scored[:1] = [False]  # the first token follows nothing (where no end-of-text token comes first)
        if not any(scored):
            continue  # nothing to score: an empty document, or a chat without a reply
        pieces.append((seq, np.asarray(scored)))
        tokens.append(sum(scored))
        nbytes.append(len(rec) if isinstance(rec, bytes) else sum(len(t.encode()) for t, trained in segs if trained))
    if not pieces:
        raise ConfigError(f"{flag}: {path} holds no text to score")
    # windows from the first scored token to the last (a chat's closing context scores nothing)
    rows = [(d, s, e, f) for d, (seq, scored) in enumerate(pieces)
            for s, e, f in windows(seq[:len(scored) - int(np.argmax(scored[::-1]))], int(np.argmax(scored)), seq_len,
                                   stride)]
    r = math.ceil(len(rows) / batch) * batch
    inputs = np.zeros((r, seq_len), np.int32)
    targets = np.full((r, seq_len), -1, np.int32)
    doc = np.full(r, -1, np.int32)
    for k, (d, s, e, f) in enumerate(rows):
        seq, scored = pieces[d]
        inputs[k, :e - 1 - s] = seq[s:e - 1]
        pos = np.arange(s + 1, e)  # the window's target positions
        # scored there, and not by an earlier window
        targets[k, :e - 1 - s] = np.where(scored[s + 1:e] & (pos >= f), seq[s + 1:e], -1)
        doc[k] = d
    return TextSet(str(path), inputs, targets, doc, np.asarray(tokens), np.asarray(nbytes), len(rows), multiple)


def per_document(ts: TextSet, scores: np.ndarray) -> list[dict]:
    """Each document's {"file", "index", "tokens", "bytes", "loss", "bits_per_byte"} from the rows' summed
    log-probabilities (R,) (`choices.score`)."""
    logp = np.zeros(len(ts.tokens))
    np.add.at(logp, ts.doc[:ts.rows], np.asarray(scores, np.float64)[:ts.rows])
    return [{"file": ts.path, "index": i, "tokens": int(n), "bytes": int(b), "loss": round(-lp / n, 6),
             "bits_per_byte": round(-lp / math.log(2) / b, 6) if b else None}
            for i, (lp, n, b) in enumerate(zip(logp, ts.tokens, ts.bytes))]


def summary(ts: TextSet, scores: np.ndarray) -> dict[str, float]:
    """{"documents", "tokens", "loss", "perplexity", "bits_per_byte"} of a file (module docstring)."""
    total = -float(np.sum(np.asarray(scores, np.float64)[:ts.rows]))
    n, b = int(ts.tokens.sum()), int(ts.bytes.sum())
    return {"documents": len(ts.tokens), "tokens": n, "loss": total / n, "perplexity": math.exp(total / n),
            "bits_per_byte": total / math.log(2) / b}


def load_files(paths: str, encode: Callable[[str], list[int]], vocab_size: int, seq_len: int, *,
               eos_id: int | None = None, stride: int = 0, batch: int = 1, text_key: str = "text",
               chat_template: str | None = None, tokenizer: str = "byte", multiple: int = ROW_MULTIPLE,
               flag: str = "--loss") -> list[TextSet]:
    """`load` of each file of a comma-separated list; their names (file stems, the metrics' suffixes) must differ."""
    files = [f for f in (p.strip() for p in paths.split(",")) if f]
    if not files:
        raise ConfigError(f"{flag}: {paths!r} names no file")
    stems = [pathlib.Path(f).stem for f in files]
    if len(set(stems)) < len(stems):
        raise ConfigError(f"the files {', '.join(files)} must have different names (their metrics are named so)")
    return [load(f, encode, vocab_size, seq_len, eos_id=eos_id, stride=stride, batch=batch, text_key=text_key,
                 chat_template=chat_template, tokenizer=tokenizer, multiple=multiple, flag=flag) for f in files]


def metrics(sets: list[TextSet], scores: list[np.ndarray]) -> dict[str, float]:
    """The trainer's metrics of log.eval_texts: text_loss/<file stem> (nats per token) and text_bpb/<file stem>."""
    out = {}
    for ts, sc in zip(sets, scores):
        got, stem = summary(ts, sc), pathlib.Path(ts.path).stem
        out[f"text_loss/{stem}"], out[f"text_bpb/{stem}"] = got["loss"], got["bits_per_byte"]
    return out
