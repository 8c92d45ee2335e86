"""Context-parallel attention: one shard's work against 1/C of plain causal attention, and the old masked path.

    python benchmarks/bench_context.py [--seqs 16384,32768,65536,131072] [--shards 2,4,8] [--doc-len 2048]

On one GPU, for the Llama3-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16, batch 1) and a
sequence of T tokens over C context shards, times forward + backward (the gradients of q, k and v) of:
- "1/C of causal": cuDNN causal attention over the whole sequence (jax.nn.dot_product_attention), divided by C:
  the per-shard time of a perfect split;
- "zigzag, slowest shard" (mx_jax/context_parallel.py): each shard's merged prefix + diagonal cuDNN calls and their
  backward, given the gathered K and V (the all-gather and reduce-scatter are not in this figure); max over c;
- "masked (before)": what the context path did before: a contiguous T/C query chunk against all T keys with a
  (T/C, T) boolean mask, through jax.nn.dot_product_attention with the same implementation. Skipped where the
  mask's bias would pass 4 GB.
- "documents, slowest shard" (with --doc-len L): the same shards under model.attention_mask=documents, the sequence
  cut into documents of L tokens (model.max_documents = T / (2 C L) + 2, per chunk as the trainer counts it under
  context parallelism: enough for every chunk of T / 2C tokens; until session 62 it was per sequence, 2 T / (C L) + 2).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from mx_jax import context_parallel as cp
from pallas_kernels.bench import median_ms

H, G, K = 32, 8, 128


def _plain(q, k, v, w):
    return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
                   .astype(jnp.float32) * w)


def _masked(q, k, v, w, c):
    t_local = q.shape[1]
    q_pos = c * t_local + jnp.arange(t_local)
    mask = jnp.arange(k.shape[1])[None, :] <= q_pos[:, None]
    o = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation="cudnn")
    return jnp.sum(o.astype(jnp.float32) * w)


def _shard(q, k, v, kg, vg, w, segments, c, n, m):
    o, lse = cp.shard_fwd(c, n, "cudnn", q, k, v, kg, vg, segments, m)
    return cp.shard_bwd(c, n, "cudnn", q, k, v, kg, vg, o, lse, w.astype(o.dtype), segments, m)


def causal_tflops(t: int) -> float:
    """fwd + bwd FLOPs of causal attention over t tokens (2 GEMMs forward, 5 backward with the recompute; half the
    blocks), in TFLOP."""
    return 3.5 * 4 * t * t * H * K / 2 / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="16384,32768,65536,131072")
    ap.add_argument("--shards", default="2,4,8")
    ap.add_argument("--doc-len", type=int, default=0, help="also time documents of this many tokens (0: no)")
    args = ap.parse_args()
    rows = []
    for t in (int(s) for s in args.seqs.split(",")):
        keys = jax.random.split(jax.random.key(t), 4)
        q = jax.random.normal(keys[0], (1, t, H, K), jnp.bfloat16)
        k = jax.random.normal(keys[1], (1, t, G, K), jnp.bfloat16)
        v = jax.random.normal(keys[2], (1, t, G, K), jnp.bfloat16)
        w = jax.random.normal(keys[3], (1, t, H, K), jnp.bfloat16)
        full = median_ms(jax.jit(jax.grad(_plain, argnums=(0, 1, 2))), [(q, k, v, w)], samples=5, batch=3)
        print(f"T={t}: causal fwd+bwd {full:.2f} ms ({causal_tflops(t) / full * 1e3:.0f} TFLOP/s)", flush=True)
        for n in (int(s) for s in args.shards.split(",")):
            if t % (2 * n):
                continue
            zq, zk, zv, zw = (cp.to_zigzag(a, n) for a in (q, k, v, w))
            per = t // n
            shard_ms, doc_ms = [], []
            segments = jnp.arange(t)[None] // max(args.doc_len, 1)
            m = t // (2 * n * max(args.doc_len, 1)) + 2
            for c in range(n):
                sl = slice(c * per, (c + 1) * per)
                f = jax.jit(functools.partial(_shard, segments=None, c=c, n=n, m=0))
                shard_ms.append(median_ms(f, [(zq[:, sl], zk[:, sl], zv[:, sl], k, v, zw[:, sl])], samples=5, batch=3))
                if args.doc_len:
                    f = jax.jit(functools.partial(_shard, c=c, n=n, m=m))
                    doc_ms.append(median_ms(f, [(zq[:, sl], zk[:, sl], zv[:, sl], k, v, zw[:, sl], segments)],
                                            samples=5, batch=3))
            masked = None
            if per * t * 2 <= 4 << 30:
                f = jax.jit(jax.grad(functools.partial(_masked, c=n - 1), argnums=(0, 1, 2)))
                masked = median_ms(f, [(q[:, -per:], k, v, w[:, -per:])], samples=5, batch=3)
            rows.append((t, n, full / n, max(shard_ms), sum(shard_ms) / n, min(shard_ms), masked,
                         max(doc_ms) if doc_ms else None))
            print(f"  C={n}: shards {' '.join(f'{m:.2f}' for m in shard_ms)} ms; masked {masked}", flush=True)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; ms per shard, forward + backward")
    docs = f", documents of {args.doc_len} tokens" if args.doc_len else ""
    print(f"| T | C | 1/C of causal | zigzag, slowest shard | mean / fastest shard | slowest / ideal | masked (before) | "
          f"documents, slowest shard{docs} |")
    print("|---|---|---|---|---|---|---|---|")
    for t, n, ideal, worst, mean, best, masked, doc in rows:
        m = f"{masked:.2f}" if masked is not None else "-"
        d = f"{doc:.2f}" if doc is not None else "-"
        print(f"| {t} | {n} | {ideal:.2f} | {worst:.2f} | {mean:.2f} / {best:.2f} | {worst / ideal:.2f} | {m} | {d} |")


if __name__ == "__main__":
    main()
