"""Attention within documents (model.attention_mask=documents): cuDNN's packed layout against the public API's mask.

    python benchmarks/bench_documents.py [--seq 8192] [--docs 1,4,16,32] [--max-documents 8,16,32]

One GPU, the Llama3-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16, batch 1), a row of T tokens
cut into n documents of random lengths (the same cut for every path), forward + backward (the gradients of q, k and
v) of:
- "causal, whole row": cuDNN causal attention over the row, documents ignored (jax.nn.dot_product_attention);
  what model.attention_mask=causal costs;
- "mask, cuDNN": the same call with the (T, T) document mask (`mask=`, which jax turns into an additive bias that
  cuDNN reads for every head): the best path without our code;
- "ours, M = ...": layers.document_attention, each document a separate causal sequence of cuDNN's packed layout
  (compat.cudnn_attention_fwd with documents), at model.max_documents = M (skipped where M < the documents).
  The last column is XLA's temporary memory of that fwd+bwd: cuDNN's packed backward takes a workspace of
  B M N T (8 H + 4) bytes (M times the causal one).
"useful TFLOP/s" counts only the work inside the documents, sum over documents of their causal attention, so a
path that skips the blocks between documents scores higher. The last column is the largest difference from the
masked path's output and gradients, relative to their largest entry.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from mx_jax.layers import document_attention, document_segments
from pallas_kernels.bench import median_ms

H, G, K = 32, 8, 128
EOS = 0


def useful_tflop(lengths) -> float:
    """fwd + bwd FLOPs of causal attention within each document (as bench_context.causal_tflops), in TFLOP."""
    return sum(3.5 * 4 * n * n * H * K / 2 for n in lengths) / 1e12


def doc_tokens(t: int, n: int, rng) -> tuple[np.ndarray, list[int]]:
    """A (1, t) row of n documents of random lengths (each at least t / (4 n)), EOS ending all but the last."""
    cuts = np.sort(rng.choice(np.arange(1, t), size=n - 1, replace=False)) if n > 1 else np.zeros(0, int)
    while n > 1 and np.min(np.diff(np.concatenate([[0], cuts, [t]]))) < t // (4 * n):
        cuts = np.sort(rng.choice(np.arange(1, t), size=n - 1, replace=False))
    tokens = np.full((1, t), 7)
    tokens[0, cuts - 1] = EOS
    return tokens, list(np.diff(np.concatenate([[0], cuts, [t]])))


def attention_inputs(t: int) -> tuple[jax.Array, ...]:
    """q, k, v and the output's cotangent weights w for one row of t tokens at the 8B attention shape (bf16)."""
    keys = jax.random.split(jax.random.key(0), 4)
    return tuple(jax.random.normal(key, (1, t, n, K), jnp.bfloat16) for key, n in zip(keys, (H, G, G, H)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--docs", default="1,4,16,32")
    ap.add_argument("--max-documents", default="8,16,32")
    args = ap.parse_args()
    t = args.seq
    q, k, v, w = attention_inputs(t)
    rng = np.random.default_rng(0)

    def loss(attend):
        return lambda q, k, v, w, seg: jnp.sum(attend(q, k, v, seg).astype(jnp.float32) * w)

    causal = loss(lambda q, k, v, seg: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                     implementation="cudnn"))

    def masked_attention(q, k, v, seg):
        mask = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((t, t), bool))
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="cudnn")

    masked = loss(masked_attention)
    rows = []
    for n in (int(s) for s in args.docs.split(",")):
        tokens, lengths = doc_tokens(t, n, rng)
        seg = document_segments(jnp.asarray(tokens), EOS, n)
        paths = [("causal, whole row", causal), ("mask, cuDNN", masked)]
        for m in (int(s) for s in args.max_documents.split(",")):
            if m >= n:
                paths.append((f"ours, M = {m}", loss(lambda q, k, v, seg, m=m: document_attention(
                    q, k, v, seg, "cudnn", m))))
        arg = [(q, k, v, w, seg)]
        results, times, temps = {}, {}, {}
        for name, f in paths:
            g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).lower(*arg[0]).compile()
            temps[name] = g.memory_analysis().temp_size_in_bytes / 1e9
            results[name] = jax.block_until_ready(g(*arg[0]))
            times[name] = median_ms(g, arg, samples=5, batch=5)
        ref = [x.astype(jnp.float32) for x in jax.tree.leaves(results["mask, cuDNN"])]
        for name in times:
            got = [x.astype(jnp.float32) for x in jax.tree.leaves(results[name])]
            err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, ref))
            rows.append((n, name, times[name], useful_tflop(lengths) / times[name] * 1e3, err, temps[name]))
            print(f"T={t} documents={n} {name}: {times[name]:.3f} ms", flush=True)
    print(f"\n| documents in {t} tokens | path | fwd+bwd ms | useful TFLOP/s | max diff vs mask | XLA temp GB |")
    print("|---|---|---|---|---|---|")
    for n, name, ms, tf, err, temp in rows:
        print(f"| {n} | {name} | {ms:.3f} | {tf:.0f} | {err:.1e} | {temp:.2f} |")


if __name__ == "__main__":
    main()
