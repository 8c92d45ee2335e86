"""Multiple-choice evaluation by log-likelihood: which continuation of a context does the model find likeliest?

    python -m mx_jax.sample runs/llama3_1b --choices hellaswag_val.jsonl      # once, from a checkpoint
    python -m mx_jax.train --config configs/llama3_1b.yaml log.eval_choices=hellaswag_val.jsonl,arc_easy.jsonl

The file holds JSON lines {"context": str, "choices": [str, ...], "answer": int} ("query" or "prompt" for
"context", "gold" or "label" for "answer"), the shape of lm-evaluation-harness's multiple-choice tasks (HellaSwag,
ARC, PIQA, MMLU written out as text). Choice j of a record scores the summed log-probability of its tokens after
the context,

    s_j = sum_{t in choice j} log p(x_t | context, x_<t)

and the record counts as right when the answer has the largest score (`choice_acc`), or the largest score per
character of the choice (`choice_acc_norm`, lm-evaluation-harness's acc_norm, which stops long choices from losing
by length alone). The context and each choice are tokenized on their own (a choice's leading space belongs to it,
as those tasks write them) and joined; a row is the context's tokens then the choice's, right-padded, its targets
the choice's tokens only (data.IGNORED elsewhere), so one forward over a batch of rows gives every score (causal
attention: the padding after a row's end never reaches its logits). A context too long for the row keeps its end,
as much of it as the record's longest choice leaves room for, the same for all its choices.
Rows are at most the file's longest rounded up to a multiple of 128 (128 C under context parallelism over C
devices, whose zigzag chunks split it in 2 C) and data.seq_len; a batch of rows runs cut to its own longest,
rounded likewise, the rows taken longest first.

`python -m mx_jax.sample RUN --choices FILE` gives the same scores with each context run once (`CachedScorer`):
a batch of records' contexts fill a KV cache, and each choice then runs against it.

Under the trainer the rows run on the training mesh (batch split like the eval batches, data.batch_size rows per
forward), from the parameters being trained, after the held-out loss at every `log.eval_every_steps`; the log shows
`choices <acc>% (norm <acc_norm>%)` and metrics.jsonl gets both. Several files (comma-separated) each get their own
pair, `choice_acc/<file stem>`, and choice_acc is their plain mean (every task weighs the same).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Callable

import numpy as np

from mx_jax.config import ConfigError

ROW_MULTIPLE = 128
_CONTEXT_KEYS = ("context", "query", "prompt")
_ANSWER_KEYS = ("answer", "gold", "label")


@dataclasses.dataclass(frozen=True)
class ChoiceSet:
    """A file's records as rows: inputs and targets (R, T) int32, each row's record and choice index (R,), each
    choice's length in characters (R,), and the records' answers (N,). Rows past `rows` pad R to a batch multiple."""

    path: str
    inputs: np.ndarray
    targets: np.ndarray
    record: np.ndarray
    chars: np.ndarray
    answers: np.ndarray
    rows: int
    multiple: int = ROW_MULTIPLE  # a batch's rows are cut to a multiple of this many tokens (`score`)
    # per record: the context's tokens (kept as the rows keep it: its end, where it is too long) and each choice's
    contexts: tuple[np.ndarray, ...] = ()
    continuations: tuple[tuple[np.ndarray, ...], ...] = ()
    lines: tuple[int, ...] = ()  # each record's line in the file (1-based)

    @property
    def records(self) -> int:
        return len(self.answers)

    @property
    def lengths(self) -> np.ndarray:
        return used_lengths(self.targets)


def used_lengths(targets: np.ndarray) -> np.ndarray:
    """(R,) each row's used tokens: up to its last target (>= 0), 0 for a row without one (padding)."""
    used = targets >= 0
    return np.where(used.any(axis=1), targets.shape[1] - np.argmax(used[:, ::-1], axis=1), 0)


def _field(obj: dict, keys: tuple[str, ...], where: str):
    for k in keys:
        if k in obj:
            return obj[k]
    raise ConfigError(f"{where}: no {' / '.join(repr(k) for k in keys)} field (has: {', '.join(obj)})")


def load(path: str | pathlib.Path, encode: Callable[[str], list[int]], vocab_size: int, max_len: int,
         batch: int = 1, pad_id: int = 0, multiple: int = ROW_MULTIPLE) -> ChoiceSet:
    """The rows of a choices file (module docstring), at most max_len tokens each and a `multiple` of tokens long
    (unless max_len is less), R a multiple of `batch`."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"choices file {path} {'is a directory' if path.is_dir() else 'does not exist'}")
    contexts, conts, answers, lines = [], [], [], []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"choices file {path} is not UTF-8 text (byte {e.start}: {e.reason}); a choices file holds "
                          f"JSON lines") from None
    for i, line in enumerate(text.split("\n")):  # (not splitlines: JSON text may hold U+2028)
        where = f"{path}:{i + 1}"
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{where}: not a JSON object ({e})")
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: a JSON {type(obj).__name__}, not an object")
        context, choices, answer = _field(obj, _CONTEXT_KEYS, where), obj.get("choices"), _field(obj, _ANSWER_KEYS,
                                                                                                  where)
        if not isinstance(context, str):
            raise ConfigError(f"{where}: the context must be text, got {type(context).__name__}")
        if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
            raise ConfigError(f"{where}: 'choices' must be a list of two or more non-empty texts")
        if not (isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices)):
            raise ConfigError(f"{where}: the answer must be the index of one of its {len(choices)} choices, got "
                              f"{answer!r}")
        ctx = encode(context)
        ids = [encode(c) for c in choices]
        if not ctx:
            raise ConfigError(f"{where}: an empty context (a choice's first token needs one before it)")
        bad = max((max(t) for t in [ctx, *ids] if t), default=0)
        if bad >= vocab_size:
            raise ConfigError(f"{where}: token id {bad} is outside the model's vocabulary "
                              f"(model.vocab_size={vocab_size}); is the tokenizer the run's?")
        longest = max(map(len, ids))
        if longest >= max_len:
            raise ConfigError(f"{where}: a choice of {longest} tokens leaves no room for its context in rows of "
                              f"{max_len} (data.seq_len)")
        contexts.append(ctx)
        conts.append((ids, [len(c) for c in choices]))
        answers.append(answer)
        lines.append(i + 1)
    if not answers:
        raise ConfigError(f"choices file {path} holds no records")
    # rows hold context + choice minus the last token (inputs) and the same shifted by one (targets)
    need = max(len(c) + len(t) - 1 for c, (ids, _) in zip(contexts, conts) for t in ids)
    t_len = min(max_len, math.ceil(need / multiple) * multiple)
    n_rows = sum(len(ids) for ids, _ in conts)
    r = math.ceil(n_rows / batch) * batch
    inputs = np.full((r, t_len), pad_id, np.int32)
    targets = np.full((r, t_len), -1, np.int32)
    record, chars = np.full(r, -1, np.int32), np.ones(r, np.int32)
    # A context too long for the row keeps its end: what the row of the record's longest choice has room for, the
    # same for each of its choices (and for the cached scorer's shared context).
    kept = tuple(np.asarray(ctx[-(t_len + 1 - max(map(len, ids))):], np.int32)
                 for ctx, (ids, _) in zip(contexts, conts))
    row = 0
    for n, (ctx, (ids, lens)) in enumerate(zip(kept, conts)):
        for cont, length in zip(ids, lens):
            seq = [*ctx, *cont]
            inputs[row, :len(seq) - 1] = seq[:-1]
            targets[row, len(seq) - 1 - len(cont):len(seq) - 1] = cont
            record[row], chars[row] = n, length
            row += 1
    continuations = tuple(tuple(np.asarray(t, np.int32) for t in ids) for ids, _ in conts)
    return ChoiceSet(str(path), inputs, targets, record, chars, np.asarray(answers, np.int32), n_rows, multiple, kept,
                     continuations, tuple(lines))


def row_logprobs(logits, targets):
    """(B,) the summed log-probability of each row's counted targets (>= 0); logits (B, T, V) in any float dtype,
    reduced in float32 without a float32 copy of them (a select and two reductions, which split over a sharded V)."""
    import jax
    import jax.numpy as jnp

    z = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.sum(jnp.where(jnp.arange(z.shape[-1]) == jnp.maximum(targets, 0)[..., None], z, 0.0), axis=-1)
    return jnp.sum(jnp.where(targets >= 0, picked - lse, 0.0), axis=-1)


def make_step(graphdef, compute_dtype, shardings: tuple | None = None):
    """step(params, buffers, inputs (B, T), targets (B, T)) -> (B,) row scores, jitted; `shardings`: (params',
    buffers', the rows', the output's) NamedShardings on a mesh (the trainer's), else wherever the inputs are."""
    import jax
    from flax import nnx

    def step(params, buffers, inputs, targets):
        logits, _ = nnx.merge(graphdef, params, buffers)(inputs, logits_dtype=compute_dtype)
        return row_logprobs(logits, targets)

    if shardings is None:
        return jax.jit(step)
    p, b, rows, out = shardings
    return jax.jit(step, in_shardings=(p, b, rows, rows), out_shardings=out)


def score(step, params, buffers, cs: ChoiceSet, batch: int, sharding=None) -> np.ndarray:
    """(R,) every row's score, `batch` rows per call of `step` (placed with `sharding` from the host rows, which
    every process holds whole). cs: a ChoiceSet, or any rows with its inputs, targets, lengths and multiple
    (perplexity.TextSet). The rows go longest first, and each call's are cut to its longest rounded up to
    cs.multiple tokens: a file whose lengths vary runs short rows short (one compile of `step` per width; causal
    attention, so the cut padding changed nothing before it)."""
    import jax

    used = cs.lengths
    order = np.argsort(-used, kind="stable")
    out, pending = np.zeros(len(cs.inputs), np.float32), []
    for i in range(0, len(order), batch):
        rows = order[i:i + batch]
        width = min(cs.inputs.shape[1], max(1, math.ceil(used[rows].max() / cs.multiple)) * cs.multiple)
        x, y = cs.inputs[rows, :width], cs.targets[rows, :width]
        if sharding is not None:
            x, y = (jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx]) for a in (x, y))
        pending.append((rows, step(params, buffers, x, y)))  # read back after all are dispatched
    for rows, got in pending:
        out[rows] = np.asarray(got)
    return out


class CachedScorer:
    """Row scores (`score`'s) with each context run once: a batch of records' contexts, left-padded, fill a KV cache
    (`Llama.decode`), and then choice j of every record of the batch runs against that cache, j = 0, 1, ... (a
    record with fewer choices repeats its first). Choice j's first token is scored from the context's last logits,
    its next ones from its own positions'. A record costs its context once and its choices' tokens, where a row per
    choice costs the context once per choice and pads every row to the file's longest. On one H200 (RESULTS.md,
    session 64; 4 choices, 32 records per batch against 32 rows per forward): the Llama3-8B shape 382 choices/s
    against 159 with contexts of 200 tokens and choices of 30, 203 against 65 with contexts of 600 and choices of
    2; the 1B config 1,786 against 886. For one device or the tensor-parallel split of `sample.tensor_parallel`;
    the trainer's mesh scores rows (`make_step`)."""

    CONTEXT_MULTIPLE = 128  # a batch's contexts are left-padded to a multiple of this (one compile per width)
    CHOICE_MULTIPLE = 16  # and its choices right-padded to a multiple of this

    def __init__(self, graphdef, cfg, cache_sharding=None):
        """cfg: the model's ModelConfig; cache_sharding: the KV cache's (None: where jax puts it)."""
        import functools

        import jax
        import jax.numpy as jnp
        from flax import nnx

        from mx_jax.llama import init_cache

        def prefill(params, buffers, tokens, cache, first):
            last, cache = nnx.merge(graphdef, params, buffers).decode(tokens, cache, jnp.int32(0), first)
            return jax.nn.log_softmax(last, axis=-1), cache

        def choice(params, buffers, cache, head, tokens, targets, index, first):
            logits, _ = nnx.merge(graphdef, params, buffers).decode(tokens, cache, index, first, every_position=True)
            # token 0 after the context's last position (`head`, log-probabilities), token t after position t - 1
            lead = jnp.where(targets[:, 0] >= 0, jnp.take_along_axis(head, tokens[:, :1], axis=1)[:, 0], 0.0)
            return lead + row_logprobs(logits[:, :-1], targets[:, 1:])

        self._prefill = jax.jit(prefill, donate_argnums=3)
        self._choice = jax.jit(choice)  # the cache is not donated: every choice of the batch reads it
        self._cache = jax.jit(functools.partial(init_cache, cfg, dtype=jnp.dtype(cfg.compute_dtype)),
                              static_argnums=(0, 1), out_shardings=cache_sharding)

    def score(self, params, buffers, cs: ChoiceSet, batch: int) -> np.ndarray:
        """(R,) every row's score, as `score` gives them, `batch` records at a time (longest contexts first)."""
        import jax.numpy as jnp

        n = cs.records
        starts = np.r_[0, np.cumsum([len(c) for c in cs.continuations])]
        out, pending = np.zeros(len(cs.inputs), np.float32), []
        order = sorted(range(n), key=lambda i: -len(cs.contexts[i]))
        for at in range(0, n, batch):
            recs = order[at:at + batch]
            recs = recs + [recs[0]] * (batch - len(recs))  # the last batch padded with a repeated record
            ctx = [cs.contexts[i] for i in recs]
            width = -(-max(map(len, ctx)) // self.CONTEXT_MULTIPLE) * self.CONTEXT_MULTIPLE
            tc = max(len(t) for i in recs for t in cs.continuations[i])
            tc = -(-tc // self.CHOICE_MULTIPLE) * self.CHOICE_MULTIPLE
            tokens = np.zeros((batch, width), np.int32)
            for b, c in enumerate(ctx):
                tokens[b, width - len(c):] = c
            first = jnp.asarray([width - len(c) for c in ctx], jnp.int32)
            head, cache = self._prefill(params, buffers, jnp.asarray(tokens), self._cache(batch, width + tc), first)
            for j in range(max(len(cs.continuations[i]) for i in recs)):
                conts = [cs.continuations[i][j if j < len(cs.continuations[i]) else 0] for i in recs]
                targets = np.full((batch, tc), -1, np.int32)
                for b, t in enumerate(conts):
                    targets[b, :len(t)] = t
                got = self._choice(params, buffers, cache, head, jnp.asarray(np.maximum(targets, 0)),
                                   jnp.asarray(targets), np.int32(width), first)
                rows = [(b, starts[i] + j) for b, i in enumerate(recs[:min(batch, n - at)])
                        if j < len(cs.continuations[i])]
                pending.append((rows, got))  # read back after all are dispatched
        for rows, got in pending:
            got = np.asarray(got)
            for b, row in rows:
                out[row] = got[b]
        return out


def load_files(paths: str, encode: Callable[[str], list[int]], vocab_size: int, max_len: int,
               batch: int = 1, multiple: int = ROW_MULTIPLE) -> list[ChoiceSet]:
    """`load` of each file of a comma-separated list; their names (file stems, the metrics' suffixes) must differ."""
    files = [f for f in (p.strip() for p in paths.split(",")) if f]
    if not files:
        raise ConfigError(f"the choices files {paths!r} name no file")
    stems = [pathlib.Path(f).stem for f in files]
    if len(set(stems)) < len(stems):
        raise ConfigError(f"the files {', '.join(files)} must have different names (their metrics are named so)")
    return [load(f, encode, vocab_size, max_len, batch, multiple=multiple) for f in files]


def summary(sets: list[ChoiceSet], scores: list[np.ndarray]) -> dict[str, float]:
    """The metrics of one or several files: `accuracy` of one; of several, each file's under "/<its stem>" and their
    plain mean (every task weighs the same) as choice_acc and choice_acc_norm."""
    per = [accuracy(cs, s) for cs, s in zip(sets, scores)]
    if len(per) == 1:
        return per[0]
    out = {f"{k}/{pathlib.Path(cs.path).stem}": v for cs, acc in zip(sets, per) for k, v in acc.items()}
    return {k: float(np.mean([acc[k] for acc in per])) for k in per[0]} | out


def accuracy(cs: ChoiceSet, scores: np.ndarray) -> dict[str, float]:
    """{"choice_acc", "choice_acc_norm"} from each row's score (R,) (module docstring)."""
    recs = per_record(cs, scores)
    return {"choice_acc": sum(r["right"] for r in recs) / cs.records,
            "choice_acc_norm": sum(r["right_norm"] for r in recs) / cs.records}


def per_record(cs: ChoiceSet, scores: np.ndarray) -> list[dict]:
    """Each record's outcome from the rows' scores (R,): {"file", "line", "answer", "scores" (each choice's summed
    log-probability), "chars" (each choice's length in characters), "choice" and "choice_norm" (the choice of the
    largest score, and of the largest score per character), "right", "right_norm"}: what `sample --choices --out`
    writes, and what `accuracy` counts."""
    scores = np.asarray(scores, np.float64)[:cs.rows]
    record, chars = cs.record[:cs.rows], cs.chars[:cs.rows]
    starts = np.flatnonzero(np.r_[True, record[1:] != record[:-1]])
    out = []
    for n, (a, b) in enumerate(zip(starts, np.r_[starts[1:], cs.rows])):
        pick, pick_norm = int(np.argmax(scores[a:b])), int(np.argmax(scores[a:b] / chars[a:b]))
        answer = int(cs.answers[n])
        out.append({"file": cs.path, "line": cs.lines[n] if cs.lines else None, "answer": answer,
                    "scores": [round(float(v), 4) for v in scores[a:b]], "chars": [int(c) for c in chars[a:b]],
                    "choice": pick, "choice_norm": pick_norm, "right": pick == answer,
                    "right_norm": pick_norm == answer})
    return out
