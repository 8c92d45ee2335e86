"""Decoding's expert products (pallas_kernels/indexed_matmul.py) against XLA, per layer, in one run.

    python -m pallas_kernels.bench indexed [--quick] [--config tile_n=128,stages=6 ...]   # on the H200
    python -m pallas_kernels.bench indexed --cpu-smoke                                     # tiny, interpreted

Problems: the routed experts of a decoding step, B tokens x top-k assignments of DeepSeekMoE 16B (E=64 experts of
2048 x 1408, k=6), Mixtral 8x7B (8 of 4096 x 14336, k=2) and DeepSeek-V3 (256 of 7168 x 2048, k=8), the
experts each token chose drawn uniformly without repeats per token; then dense projections of B rows, where the
kernel runs with E=1: DeepSeekMoE 16B's attention (2048 x 2048) and Llama3-8B's (K x N: 4096 x 4096, 4096 x 1024,
the FFN's 4096 x 14336 and 14336 x 4096). `--shapes dense` runs the dense ones only.

Each path runs L layers in `lax.scan` over stacked random bf16 weights (as the decoder runs them): "gate,up" is
h = silu(x W_gate) * (x W_up) over the assignments, "down" is h W_down. Columns: microseconds per layer and the
weights' bytes read per second (R K N 2 bytes per matrix, R assignments):
- xla       the gathered weights in an einsum (the model's expression before this kernel; XLA makes it a
            multiply-reduce fusion). For the dense rows: `x @ W` as written ("xla"), and its rows padded to 8 so
            that XLA keeps it a dot and calls cuBLAS ("xla, 8 rows")
- pallas    indexed_swiglu / indexed_matmul (impl="pallas"), the default Config or each --config
Correctness: max |pallas - xla| / max |xla| over the first layer's output.

Timing: bench.time_fn (compiled once, warmed up, median of `samples` samples of `batch` back-to-back calls rotating
over 2 sets of expert ids).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mx_jax import compat
from pallas_kernels import indexed_matmul as im
from pallas_kernels.bench import log, parse_config, time_fn

# name, D, F, E, k, token counts, layers
PROBLEMS = (
    ("deepseek-moe-16b", 2048, 1408, 64, 6, (1, 4, 8), 8),
    ("mixtral-8x7b", 4096, 14336, 8, 2, (1, 4), 2),
    ("deepseek-v3", 7168, 2048, 256, 8, (1, 8), 1),
)
DENSE = (("attention 2048", 2048, 2048, (1, 4, 8), 8),  # name, K, N, token counts, layers
         ("8b wq", 4096, 4096, (1, 8), 4), ("8b wk", 4096, 1024, (1, 8), 8),
         ("8b gate", 4096, 14336, (1, 8), 2), ("8b down", 14336, 4096, (1, 8), 2))
SMOKE = (("smoke", 128, 128, 4, 2, (1, 3), 2),)
SMOKE_DENSE = (("smoke dense", 128, 128, (1,), 2),)


def _stack(key, shape, layers, sets):
    return [(jax.random.normal(jax.random.fold_in(key, i), (layers, *shape), jnp.float32) / np.sqrt(shape[-2])
             ).astype(jnp.bfloat16) for i in range(sets)]


def _expert_ids(key, b, e, k, layers):
    """(layers, b k) int32: per token k distinct experts, drawn uniformly."""
    keys = jax.random.split(key, layers * b)
    ids = jax.vmap(lambda kk: jax.random.choice(kk, e, (k,), replace=False))(keys)
    return ids.reshape(layers, b * k).astype(jnp.int32)


def _scan(op):
    """op(x, *weights_of_one_layer, idx) -> y, run over stacked layers (the same x each layer)."""
    def run(x, *stacked):
        return lax.scan(lambda c, layer: (c, op(x, *layer)), None, stacked)[1]
    return run


def _kernels(kernel, cfgs, interpret) -> dict:
    """{label: fn}: `kernel(..., config=c)` per config (None: the dispatcher's pick)."""
    return {f"pallas {c.name() if c else 'default'}": functools.partial(kernel, config=c, interpret=interpret)
            for c in cfgs}


class Table:
    """Times each path of a problem in turn and compares its output with the first path's."""

    def __init__(self, samples: int, batch: int):
        self.samples, self.batch, self.rows = samples, batch, []

    def run(self, problem: str, part: str, paths: dict, sets: list[tuple], nbytes: int, layers: int) -> None:
        ref = None
        for label, fn in paths.items():
            try:
                t = time_fn(_scan(fn), sets, samples=self.samples, batch=self.batch)
            except Exception as e:  # noqa: BLE001  (e.g. a config outside the kernel's cover: say so, go on)
                log(f"  {problem:28s} {part:8s} {label}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            out = np.asarray(t.out[0], np.float32)
            ref = out if ref is None else ref
            err = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
            us = t.ms * 1e3 / layers
            self.rows.append((problem, part, label, us, nbytes / (us * 1e-6) / 1e9, err))
            log(f"  {problem:28s} {part:8s} {label:44s} {us:9.1f} us {self.rows[-1][4]:7.0f} GB/s  err {err:.1e}")

    def summary(self) -> None:
        log(f"\nindexed summary - {jax.devices()[0].device_kind}, jax {jax.__version__} (us per layer; GB/s of the "
            "weights the step needs)")
        log(f"{'problem':28s} {'part':8s} {'path':44s} {'us':>9s} {'GB/s':>7s} {'rel.err':>8s}")
        for problem, part, label, us, gbs, err in self.rows:
            log(f"{problem:28s} {part:8s} {label:44s} {us:9.1f} {gbs:7.0f} {err:8.1e}")


def _pad8(x, w):
    """x @ w with x's rows padded to 8: XLA keeps the dot a cuBLAS GEMM."""
    return jnp.dot(jnp.pad(x, ((0, max(0, 8 - x.shape[0])), (0, 0))), w)[:x.shape[0]]


def _dense_kernel(x, w, *, config, interpret):
    return im.indexed_matmul(x, w[None], jnp.zeros((x.shape[0],), jnp.int32), impl="pallas", config=config,
                             interpret=interpret)


def bench_indexed(quick: bool, smoke: bool, configs: list[str], samples: int, batch: int,
                  dense_only: bool = False) -> None:
    problems, dense = (SMOKE, SMOKE_DENSE) if smoke else (PROBLEMS, DENSE)
    if dense_only:
        problems = ()
    if quick and not smoke:
        problems = problems[:1]
    cfgs = [parse_config(c, im.Config) for c in configs] or [None]
    interpret = None
    if smoke:
        cfgs, interpret = [im.Config(tile_n=64, tile_k=64, stages=2)], compat.InterpretGPUParams()
    swiglu = functools.partial(im.indexed_swiglu, impl="pallas")
    matmul = functools.partial(im.indexed_matmul, impl="pallas")
    table = Table(samples, batch)
    key = jax.random.key(5)
    for name, d, f, e, k, tokens, layers in problems:
        # one set of weights (larger than L2 at every problem), two sets of expert ids
        wg, wu, wd = (_stack(jax.random.fold_in(key, j), s, layers, 1)[0]
                      for j, s in enumerate(((e, d, f), (e, d, f), (e, f, d))))
        for b in tokens:
            r = b * k
            x = jax.random.normal(jax.random.fold_in(key, 10 + b), (r, d), jnp.float32).astype(jnp.bfloat16)
            h = jax.random.normal(jax.random.fold_in(key, 20 + b), (r, f), jnp.float32).astype(jnp.bfloat16)
            ids = [_expert_ids(jax.random.fold_in(key, 30 + i), b, e, k, layers) for i in range(2)]
            problem = f"{name} B={b} R={r}"
            up = {"xla": functools.partial(im.indexed_swiglu, impl="xla"), **_kernels(swiglu, cfgs, interpret)}
            table.run(problem, "gate,up", up, [(x, wg, wu, i) for i in ids], 2 * r * d * f * 2, layers)
            down = {"xla": functools.partial(im.indexed_matmul, impl="xla"), **_kernels(matmul, cfgs, interpret)}
            table.run(problem, "down", down, [(h, wd, i) for i in ids], r * d * f * 2, layers)
    for name, d, n, tokens, layers in dense:
        w = _stack(jax.random.fold_in(key, 99), (d, n), layers, 2)
        for b in tokens:
            x = jax.random.normal(jax.random.fold_in(key, 40 + b), (b, d), jnp.float32).astype(jnp.bfloat16)
            paths = {"xla": jnp.dot, "xla, 8 rows": _pad8, **_kernels(_dense_kernel, cfgs, interpret)}
            table.run(f"{name} B={b}", "dense", paths, [(x, w[i]) for i in range(2)], d * n * 2, layers)
    table.summary()
