"""Where attention within documents spends its time: device time per kernel of one fwd+bwd, by case.

    PYTHONPATH=. python benchmarks/profile_documents.py [--seq 8192] [--cases causal,1:8,4:8,16:16,16:32]

One GPU, the Llama3-8B attention shape (bench_documents.py's), a row of T tokens cut into n documents of random
lengths. A case "n:M" runs layers.document_attention (cuDNN's packed layout) at model.max_documents = M; "causal"
runs plain cuDNN causal attention over the row. Each case is traced with jax.profiler over 5 calls, and the longest
kernels are listed per call.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_documents import EOS, attention_inputs, doc_tokens  # noqa: E402

from mx_jax import profiling  # noqa: E402
from mx_jax.layers import document_attention, document_segments  # noqa: E402

CALLS = 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cases", default="causal,1:8,4:8,16:16,16:32")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    t = args.seq
    q, k, v, w = attention_inputs(t)
    rng = np.random.default_rng(0)
    for case in args.cases.split(","):
        n, m = (1, 0) if case == "causal" else (int(x) for x in case.split(":"))
        tokens, lengths = doc_tokens(t, n, rng)
        seg = document_segments(jnp.asarray(tokens), EOS, n)
        if m == 0:
            attend = lambda q, k, v, s: jax.nn.dot_product_attention(q, k, v, is_causal=True,  # noqa: E731
                                                                     implementation="cudnn")
        else:
            attend = lambda q, k, v, s, m=m: document_attention(q, k, v, s, "cudnn", m)  # noqa: E731
        loss = lambda q, k, v, s, attend=attend: jnp.sum(attend(q, k, v, s).astype(jnp.float32) * w)  # noqa: E731
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        jax.block_until_ready(f(q, k, v, seg))
        trace_dir = tempfile.mkdtemp()
        with jax.profiler.trace(trace_dir):
            for _ in range(CALLS):
                out = f(q, k, v, seg)
            jax.block_until_ready(out)
        per_op, counts, _ = profiling.device_time(profiling.latest_trace(trace_dir))
        print(f"== {case}: {sum(per_op.values()) / CALLS:.3f} ms per call; document lengths "
              f"{', '.join(str(int(x)) for x in lengths[:8])}{', ...' if len(lengths) > 8 else ''}")
        for op, ms in per_op.most_common(args.top):
            print(f"   {ms / CALLS:8.3f} ms  x{counts[op] // CALLS}  {op[:110]}")


if __name__ == "__main__":
    main()
