"""Multiple-choice scoring (mx_jax.choices) on one GPU: rows per second in batches, against one forward per choice.

    python benchmarks/bench_choices.py --config configs/llama3_8b.yaml [--records 256] [--context 200]
        [--context-min 0] [--choice 30] [--batch 8,32] [key=value ...]

The model is the config's with random weights (bench_decode.random_state). The records are synthetic: a context of
`--context` random tokens (or of a length drawn from `--context-min` to `--context`) and 4 choices of `--choice`
random tokens each, so a row is context + choice. Rows (choices) per second of `choices.score` at each batch size
(compiled beforehand; each batch cut to its longest row, rounded up to 128); of `choices.CachedScorer` with as many
records per batch (each context once into a KV cache, then every choice against it; its last column: the largest
difference from `choices.score`'s scores); with varied contexts, of `choices.make_step` over every batch at the
file's width, as `choices.score` ran before session 64; and with equal contexts, of the plain way without
batching: each context + choice alone through the model, one jitted forward (all lengths are equal, so one
compile), its log-probabilities summed on the host (its last column: the largest difference from
`choices.score`'s).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mx_jax import choices, sharding, train
from mx_jax.config import load_config

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_decode import random_state  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/llama3_8b.yaml")
    ap.add_argument("--records", type=int, default=256)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--choice", type=int, default=30)
    ap.add_argument("--context-min", type=int, default=0,
                    help="draw each record's context length from [this, --context] (0: all --context)")
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    train.apply_default_xla_flags()
    spread = f"{args.context_min}-{args.context}" if args.context_min else str(args.context)
    cfg = load_config(args.config, ["quant.recipe=bf16", "mesh.data=1", "mesh.fsdp=1", "mesh.expert=1",
                                    "mesh.context=1", *args.overrides])
    rng = np.random.default_rng(0)
    vocab = cfg.model.vocab_size
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for _ in range(args.records):
            words = lambda n: " ".join(map(str, rng.integers(1, vocab, n)))  # noqa: E731 (ids written as text)
            n_ctx = int(rng.integers(args.context_min, args.context + 1)) if args.context_min else args.context
            f.write(json.dumps({"context": words(n_ctx), "choices": [words(args.choice) for _ in range(4)],
                                "answer": 0}) + "\n")
    encode = lambda text: [int(t) for t in text.split()]  # noqa: E731
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        params, buffers = random_state(setup)
        step = choices.make_step(setup.graphdef, cfg.model.compute_dtype)
        rows = []
        for b in map(int, args.batch.split(",")):
            cs = choices.load(f.name, encode, vocab, cfg.data.seq_len, b)
            choices.score(step, params, buffers, cs, b)  # compiles
            t0 = time.perf_counter()
            got = choices.score(step, params, buffers, cs, b)
            rows.append(("choices.score", b, f"<= {cs.inputs.shape[1]}", cs.rows / (time.perf_counter() - t0), ""))
            if args.context_min:  # every batch at the file's width, as choices.score ran before session 64
                for i in range(0, len(cs.inputs), b):
                    step(params, buffers, cs.inputs[i:i + b], cs.targets[i:i + b])  # compiles
                t0 = time.perf_counter()
                whole = [step(params, buffers, cs.inputs[i:i + b], cs.targets[i:i + b])
                         for i in range(0, len(cs.inputs), b)]
                whole = np.concatenate([np.asarray(w) for w in whole])
                diff = float(np.max(np.abs(whole[:cs.rows] - got[:cs.rows])))
                rows.append(("rows at the file's width", b, cs.inputs.shape[1], cs.rows / (time.perf_counter() - t0),
                             f"{diff:.3f}"))
        cached = choices.CachedScorer(setup.graphdef, cfg.model)
        for b in map(int, args.batch.split(",")):
            cached.score(params, buffers, cs, b)  # compiles
            t0 = time.perf_counter()
            by_cache = cached.score(params, buffers, cs, b)
            diff = float(np.max(np.abs(by_cache[:cs.rows] - got[:cs.rows])))
            rows.append(("CachedScorer", f"{b} records", f"{spread} + {args.choice}",
                         cs.rows / (time.perf_counter() - t0), f"{diff:.3f}"))
        want, alone = [], None
        if not args.context_min:  # (varied lengths would compile the plain forward once per length)
            model = lambda p, bu, t: nnx.merge(setup.graphdef, p, bu)(t, logits_dtype=jnp.float32)[0]  # noqa: E731
            forward = jax.jit(lambda p, bu, t: jax.nn.log_softmax(model(p, bu, t), axis=-1))
            t0 = None
            for i, line in enumerate(open(f.name)):
                rec = json.loads(line)
                ctx = encode(rec["context"])
                for c in rec["choices"]:
                    seq = ctx + encode(c)
                    logp = forward(params, buffers, jnp.asarray([seq[:-1]]))[0]
                    n = len(encode(c))
                    want.append(float(jnp.sum(logp[len(seq) - 1 - n:, :][jnp.arange(n), jnp.asarray(seq[-n:])])))
                if i == 0:
                    t0 = time.perf_counter()  # after the compile
            alone = (len(want) - 4) / (time.perf_counter() - t0)
    print(f"\n{args.config} {' '.join(args.overrides)}: {args.records} records x 4 choices, context {spread} "
          f"and choice {args.choice} tokens, random weights")
    print("| path | batch | row length | choices/s | max score difference |\n|---|---|---|---|---|")
    for path, b, t, r, d in rows:
        print(f"| {path} | {b} | {t} | {r:,.1f} | {d} |")
    if alone is not None:
        err = float(np.max(np.abs(np.asarray(want) - got[:len(want)])))
        print(f"| one forward per choice | 1 | {spread} + {args.choice} | {alone:,.1f} | {err:.3f} |")


if __name__ == "__main__":
    main()
