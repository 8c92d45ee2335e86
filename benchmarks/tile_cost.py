"""The grouped GEMM's cost per output tile, apart from its cost per K step, against cuBLAS's batched GEMM.

    python benchmarks/tile_cost.py                                  # E=64 x 1536 rows (DeepSeekMoE, batch 4), N=2048
    python benchmarks/tile_cost.py --config default --config stages=3
    python benchmarks/tile_cost.py --groups 8 --rows 2048 --n 14336 --k 1024,2048,4096

gmm (bf16, balanced routing: every group holds `rows` rows) runs at several contraction sizes K with everything else
fixed. Its time is modelled as

    ms = W * (c + (K / 64) * t),        W = (M * N / (128 * 256)) / 132

W: output area per SM in units of a 128 x 256 tile; c: the cost per such tile that does not grow with K (pipeline
fill and drain, epilogue, work-item decode); t: the cost per 64-deep K step. The least-squares fit of c and t over
the K values is printed per config, beside the same fit for XLA's batched dot_general over (E, rows, K) x (E, K, N),
cuBLAS's batched GEMM (the best path without custom kernels when the routing is balanced). A kernel whose t matches
cuBLAS's but whose c does not loses c / (c + (K/64) t) of its throughput to tile boundaries: the share that grows as K
shrinks (DeepSeekMoE's experts contract over K = 2048 and 1408). Timing: `pallas_kernels.bench.time_fn` (compile,
3 warm-up calls, median of 10 samples of 10 calls); one run is one burst under the power cap, so compare configs
within a run.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import grouped_matmul as gm
from pallas_kernels.bench import parse_config, time_fn


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1536, help="rows per group (balanced routing)")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", default="512,1024,2048,4096", help="comma-separated contraction sizes")
    ap.add_argument("--config", action="append", default=None,
                    help="grouped_matmul.TileConfig fields (a=1,b=x) or 'default'; repeatable")
    args = ap.parse_args(argv)
    e, rows, n = args.groups, args.rows, args.n
    m = e * rows
    ks = [int(k) for k in args.k.split(",")]
    names = args.config or ["default"]
    configs = {c: None if c == "default" else parse_config(c, gm.TileConfig) for c in names}
    sizes = jnp.full((e,), rows, jnp.int32)
    ms: dict[str, list[float]] = {c: [] for c in [*configs, "batched cuBLAS"]}
    print(f"gmm bf16, E={e} x {rows} rows, N={n}, K in {ks} ({jax.devices()[0].device_kind}, jax {jax.__version__})")
    for k in ks:
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(2), (e, k, n), jnp.bfloat16) * 0.02
        ref = None
        for name, cfg in configs.items():
            t = time_fn(lambda a, b, cfg=cfg: gm.gmm(a, b, sizes, impl="pallas", config=cfg), [(x, w)])
            out = np.asarray(t.out[:: max(1, m // 2048)].astype(jnp.float32))
            ms[name].append(t.ms)
            if ref is None:
                batched = time_fn(lambda a, b: jnp.einsum("emk,ekn->emn", a.reshape(e, rows, k), b), [(x, w)])
                ms["batched cuBLAS"].append(batched.ms)
                ref = np.asarray(batched.out.reshape(m, n)[:: max(1, m // 2048)].astype(jnp.float32))
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            if err > 1e-2:
                raise SystemExit(f"config {name} at K={k}: relative error {err:.1e} against cuBLAS")
        print(f"  K={k}: " + ", ".join(f"{name} {v[-1]:.3f} ms" for name, v in ms.items()), flush=True)
    waves = m * n / (128 * 256) / 132
    design = np.stack([np.full(len(ks), waves), waves * np.asarray(ks) / 64], 1)
    print("\nTFLOP/s by K; c (us per 128x256 tile) and t (us per 64-deep K step) fitted over K")
    print(f"{'path':28s}" + "".join(f"{k:>8d}" for k in ks) + f"{'c us':>8s}{'t us':>8s}")
    for name, times in ms.items():
        (c, t), *_ = np.linalg.lstsq(design, np.asarray(times) * 1e3, rcond=None)
        tflops = [2 * m * k * n / (t_ms * 1e-3) / 1e12 for k, t_ms in zip(ks, times)]
        print(f"{name:28s}" + "".join(f"{v:8.0f}" for v in tflops) + f"{c:8.2f}{t:8.3f}")


if __name__ == "__main__":
    main()
