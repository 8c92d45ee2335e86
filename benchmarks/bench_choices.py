"""Multiple-choice scoring (mx_jax.choices) on one GPU: rows per second in batches, against one forward per choice.

    python benchmarks/bench_choices.py --config configs/llama3_8b.yaml [--records 256] [--context 200]
        [--choice 30] [--batch 8,32] [key=value ...]

The model is the config's with random weights (bench_decode.random_state). The records are synthetic: a context of
`--context` random tokens and 4 choices of `--choice` random tokens each, so a row is context + choice, right-padded
to a multiple of 128. Rows (choices) per second of `choices.score` at each batch size (compiled beforehand); of
`choices.CachedScorer` with as many records per batch (each context once into a KV cache, then every choice against
it; its last column: the largest difference from `choices.score`'s scores); and of the plain way without batching:
each context + choice alone through the model, one jitted forward per distinct length (all lengths are equal here,
so one compile), its log-probabilities summed on the host (its last column: the largest difference from
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
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    train.apply_default_xla_flags()
    cfg = load_config(args.config, ["quant.recipe=bf16", "mesh.data=1", "mesh.fsdp=1", "mesh.expert=1",
                                    "mesh.context=1", *args.overrides])
    rng = np.random.default_rng(0)
    vocab = cfg.model.vocab_size
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for _ in range(args.records):
            words = lambda n: " ".join(map(str, rng.integers(1, vocab, n)))  # noqa: E731 (ids written as text)
            f.write(json.dumps({"context": words(args.context), "choices": [words(args.choice) for _ in range(4)],
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
            rows.append(("choices.score", b, cs.inputs.shape[1], cs.rows / (time.perf_counter() - t0), ""))
        cached = choices.CachedScorer(setup.graphdef, cfg.model)
        for b in map(int, args.batch.split(",")):
            cached.score(params, buffers, cs, b)  # compiles
            t0 = time.perf_counter()
            by_cache = cached.score(params, buffers, cs, b)
            diff = float(np.max(np.abs(by_cache[:cs.rows] - got[:cs.rows])))
            rows.append(("CachedScorer", f"{b} records", f"{args.context} + {args.choice}",
                         cs.rows / (time.perf_counter() - t0), f"{diff:.3f}"))
        model = lambda p, bu, t: nnx.merge(setup.graphdef, p, bu)(t, logits_dtype=jnp.float32)[0]  # noqa: E731
        forward = jax.jit(lambda p, bu, t: jax.nn.log_softmax(model(p, bu, t), axis=-1))
        want, t0 = [], None
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
    err = float(np.max(np.abs(np.asarray(want) - got[:len(want)])))
    print(f"\n{args.config} {' '.join(args.overrides)}: {args.records} records x 4 choices, context {args.context} "
          f"and choice {args.choice} tokens, random weights")
    print("| path | batch | row length | choices/s | max score difference |\n|---|---|---|---|---|")
    for path, b, t, r, d in rows:
        print(f"| {path} | {b} | {t} | {r:,.1f} | {d} |")
    print(f"| one forward per choice | 1 | {args.context + args.choice - 1} | {alone:,.1f} | {err:.3f} |")


if __name__ == "__main__":
    main()
