"""Where a GEMM tile's time goes, from Mosaic GPU's on-device profiler (GPU only).

    python benchmarks/profile_tiles.py                        # gmm: E=5 x 1536 rows, N=2048, K=512,2048, default config
    python benchmarks/profile_tiles.py --k 1408 --config stages=3,delay_release=1
    python benchmarks/profile_tiles.py --kernel fp8 --m 8192 --n 14336 --k 4096,14336 --spans 150

The kernel (`gmm`: bf16, balanced routing; `fp8`: fp8_matmul rowwise, impl="pallas" with impl="auto"'s config)
runs with MX_JAX_MGPU_PROFILE set (pallas_kernels/device.profiler_params), and the last call's trace is read back.
The kernels mark four regions per tile in each warpgroup (`jax.named_scope` in grouped_matmul._gmm_kernel and
fp8_matmul._static_ring_kernel):

    decode     the work item's walk (integer divisions) and its row-tile entry's loads from GMEM
    k_loop     the TMA/wgmma pipeline over K (compute warpgroups; the memory warpgroup's loads are not marked)
    drain      reading the accumulator (waits for the last wgmma group), applying fp8 scales
    epilogue   registers -> SMEM staging -> TMA store, chunk by chunk

printed as medians over every tile of every CTA, in thousands of SM clock cycles (the profiler reads %clock), with
`gap`: from the end of a warpgroup's previous region to the start of its next k_loop. Between two tiles the tensor
cores idle for drain + epilogue + decode + gap + the k_loop's ramp; `k_loop` at two K gives the ramp and the cost
of one K step (the least-squares line through the K values).

The profiler's buffer takes shared memory (16 B per span and warpgroup), which gmm's default 4-stage config nearly
fills: hence a few tiles per CTA (E=5 x 1536 rows x N=2048 is 3.6 tiles per CTA at 132 SMs) and `--spans 60`. The fp8
GEMM's static ring leaves ~17 KiB: 27 tiles per CTA at 8192 x 14336 fit in 150 spans.
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib
import json
import os
import tempfile

import numpy as np

REGIONS = ("decode", "k_loop", "drain", "epilogue")


def spans_per_track(trace: dict) -> list[list[tuple[str, float, float]]]:
    """(name, begin, end) of every closed span, per (CTA, warpgroup) track, in time order."""
    tracks = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        tracks[(e["pid"], e["tid"])].append(e)
    out = []
    for events in tracks.values():
        events.sort(key=lambda e: e["ts"])
        begins, spans = {}, []
        for e in events:
            if e["ph"] == "B":
                begins[e["name"]] = e["ts"]
            elif e["name"] in begins:
                spans.append((e["name"], begins.pop(e["name"]), e["ts"]))
        out.append(sorted(spans, key=lambda s: s[1]))
    return out


def summarize(trace: dict) -> dict[str, tuple[float, int]]:
    """Region -> (median duration, count), plus `gap` (previous region's end -> next k_loop's begin)."""
    durations = collections.defaultdict(list)
    for spans in spans_per_track(trace):
        for name, b, e in spans:
            durations[name].append(e - b)
        for (_, _, prev_end), (name, b, _) in zip(spans, spans[1:]):
            if name == "k_loop":
                durations["gap"].append(b - prev_end)
    return {name: (float(np.median(v)), len(v)) for name, v in durations.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=("gmm", "fp8"), default="gmm")
    ap.add_argument("--groups", type=int, default=5, help="gmm: experts")
    ap.add_argument("--rows", type=int, default=1536, help="gmm: rows per group (balanced routing)")
    ap.add_argument("--m", type=int, default=8192, help="fp8: rows")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", default="512,2048", help="comma-separated contraction sizes")
    ap.add_argument("--config", default=None,
                    help="TileConfig fields of the kernel (a=1,b=x); default: the dispatcher's choice")
    ap.add_argument("--spans", type=int, default=60, help="spans recorded per warpgroup")
    args = ap.parse_args(argv)
    out_dir = tempfile.mkdtemp(prefix="mgpu_profile_")
    os.environ["MX_JAX_MGPU_PROFILE"] = f"{out_dir}:{args.spans}"  # read when the kernel is lowered, below

    import jax
    import jax.numpy as jnp

    from pallas_kernels import grouped_matmul as gm
    from pallas_kernels.bench import parse_config

    fm = importlib.import_module("pallas_kernels.fp8_matmul")  # the package re-exports its `fp8_matmul` function

    if jax.devices()[0].platform != "gpu":
        raise SystemExit("profile_tiles.py needs a GPU: the profiler is part of the Mosaic GPU lowering")
    ks = [int(k) for k in args.k.split(",")]
    n = args.n
    if args.kernel == "gmm":
        config = parse_config(args.config, gm.TileConfig) if args.config else None
        e, rows = args.groups, args.rows
        sizes = jnp.full((e,), rows, jnp.int32)
        problem = f"gmm bf16, E={e} x {rows} rows, N={n}"
        tile_k = config.tile_k if config else 64

        def kernel_at(k):  # (the jitted call, its operands) at contraction size k
            x = jax.random.normal(jax.random.key(1), (e * rows, k), jnp.bfloat16)
            w = jax.random.normal(jax.random.key(2), (e, k, n), jnp.bfloat16) * 0.02
            return jax.jit(lambda a, b: gm.gmm(a, b, sizes, impl="pallas", config=config)), (x, w)
    else:
        m = args.m
        problem = f"fp8_matmul rowwise, M={m}, N={n}"
        tile_k = (parse_config(args.config) if args.config else fm.AUTO_DEFAULT).tile_k

        def kernel_at(k):  # (the jitted call, its operands) at contraction size k
            e4m3 = jnp.float8_e4m3fn
            config = parse_config(args.config) if args.config else fm.auto_choice(m, n, k, e4m3, e4m3)
            if config is None:
                raise SystemExit(f"impl='auto' runs XLA at ({m}, {n}, {k}); pass --config")
            a = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(e4m3)
            b = jax.random.normal(jax.random.key(2), (n, k), jnp.float32).astype(e4m3)
            sa, sb = jnp.full((m,), 0.01, jnp.float32), jnp.full((n,), 0.01, jnp.float32)
            f = jax.jit(lambda a, b: fm.fp8_matmul(a, b, sa, sb, impl="pallas", config=config))
            return f, (a, b)

    print(f"{problem}, config {args.config or 'default'} ({jax.devices()[0].device_kind}, jax {jax.__version__}); "
          "kcycles, medians over tiles")
    table = {}
    for k in ks:
        f, xs = kernel_at(k)
        for _ in range(3):
            f(*xs).block_until_ready()
        jax.effects_barrier()  # the traces are written by a host callback
        newest = max(glob.glob(os.path.join(out_dir, "*trace.json")), key=os.path.getmtime)
        with open(newest) as fh:
            table[k] = summarize(json.load(fh))
    names = [r for r in (*REGIONS, "gap") if any(r in t for t in table.values())]
    print(f"{'region':10s}" + "".join(f"{'K=' + str(k):>12s}" for k in ks) + f"{'count':>8s}")
    for name in names:
        print(f"{name:10s}" + "".join(f"{table[k].get(name, (np.nan, 0))[0]:12.2f}" for k in ks)
              + f"{table[ks[-1]].get(name, (0, 0))[1]:8d}")
    if len(ks) > 1:
        steps = np.asarray(ks) / tile_k
        loop = np.asarray([table[k]["k_loop"][0] for k in ks])
        step, ramp = np.polyfit(steps, loop, 1)
        fixed = ramp + sum(table[ks[-1]].get(r, (0, 0))[0] for r in ("decode", "drain", "epilogue", "gap"))
        print(f"\nK step {step:.3f} kcycles; k_loop ramp {ramp:.2f}; between tiles {fixed:.2f} kcycles "
              f"= {fixed / step:.1f} K steps")


if __name__ == "__main__":
    main()
