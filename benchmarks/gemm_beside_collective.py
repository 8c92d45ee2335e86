"""How much a collective running beside the fp8 GEMM (or, `--grouped`, the MoE grouped GEMM) slows it: our
kernels' static and dynamic tile schedules against cuBLASLt (impl="xla"; the grouped GEMM has no such reference),
traced on every local GPU.

Per device, in one jitted shard_map over all local devices:
    gemm: `--gemms` GEMMs (M, N, K) summed, each with its own B: fp8 with rowwise scales, or with `--grouped`
          `gmm` over E = 8 balanced groups of M / 8 rows, B (E, N, K) K-major (`--dtype` bf16 or fp8);
    rs:   a bf16 reduce-scatter of an (R, C) array (the sum of `--gemms` distinct inputs: XLA reassociates a sum
          of reduce-scatters into the reduce-scatter of the sum anyway);
    both: the two, independent, so XLA's scheduler runs the reduce-scatter beside the GEMMs.
Each program is compiled, run 3 times, then traced over 3 calls. The table gives per call and device the GEMM
kernels' time alone and beside the collective, the collective kernel's time alone and beside the GEMMs, and the
busy time of `both` (any kernel running). The defaults are the gate/up projection of the Llama3-8B FFN at
8192 tokens per device and its weight gradient's reduce-scatter at fsdp=4 (RESULTS.md, session 41).

    python3 benchmarks/gemm_beside_collective.py [--shape 8192x4096x14336] [--rs 4096x28672] [--gemms 4]
    python3 benchmarks/gemm_beside_collective.py --grouped --dtype bf16 --shape 16384x14336x4096

On CPU (`--small`, XLA's GEMM only) it only checks that the programs build and run: there is no device trace.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mx_jax.profiling import category, device_time, latest_trace, overlap

fp8mm = importlib.import_module("pallas_kernels.fp8_matmul")
gm = importlib.import_module("pallas_kernels.grouped_matmul")
GROUPS = 8


def variants(small: bool, grouped: bool = False, dtype=jnp.float8_e4m3fn) -> dict[str, object]:
    """Name -> TileConfig of our kernel (None: cuBLASLt through XLA, or for the grouped GEMM `ragged_dot`)."""
    if small:
        return {"cuBLASLt (xla)": None} if not grouped else {"ragged_dot (xla)": None}
    if grouped:
        static = gm.default_configs(dtype)[0]
        return {"ours, static (gmm alone)": static,
                "ours, dynamic (gmm per device)": dataclasses.replace(static, schedule="dynamic")}
    auto = fp8mm.fit_config(fp8mm.AUTO_DEFAULT, jnp.bfloat16)
    return {
        "ours, static (auto alone)": auto,
        "ours, static, no cluster": dataclasses.replace(auto, cluster=None),
        "ours, dynamic (auto per device)": dataclasses.replace(auto, cluster=None, schedule="dynamic"),
        "cuBLASLt (xla)": None,
    }


def program(kind: str, config, mesh, m: int, n: int, rs_rows: int, rs_cols: int, gemms: int, grouped: bool = False):
    def gemm(a, b, sa, sb, i):
        if grouped:  # b (gemms * E, N, K); the scales (M,) and (E * N,) apply to fp8 only
            sizes = jnp.full((GROUPS,), m // GROUPS, jnp.int32)
            scales = dict(lhs_scale=sa, rhs_scale=sb.reshape(GROUPS, n)) if a.dtype == jnp.float8_e4m3fn else {}
            impl = "xla" if config is None else "pallas"
            return gm.gmm(a, b[i * GROUPS:(i + 1) * GROUPS], sizes, transpose_rhs=True, impl=impl, config=config,
                          **scales)
        if config is None:
            return fp8mm.fp8_matmul(a, b[i * n:(i + 1) * n], sa, sb, impl="xla")
        return fp8mm.fp8_matmul(a, b[i * n:(i + 1) * n], sa, sb, impl="pallas", config=config)

    def local(a, b, sa, sb, c):
        outs = []
        if kind in ("gemm", "both"):
            acc = jnp.zeros((m, n), jnp.bfloat16)
            for i in range(gemms):
                acc = acc + gemm(a, b, sa, sb, i)
            outs.append(acc[None])
        if kind in ("rs", "both"):
            summed = sum(c[i * rs_rows:(i + 1) * rs_rows] for i in range(gemms))
            outs.append(jax.lax.psum_scatter(summed, "d", scatter_dimension=0, tiled=True)[None])
        return tuple(outs)

    n_out = 2 if kind == "both" else 1
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"),) * 5, out_specs=(P("d"),) * n_out,
                                 check_vma=False))


def traced(compiled, args, calls: int = 3) -> tuple[collections.Counter, float]:
    """(ms per call and device by kernel category, busy ms per call and device)."""
    for _ in range(calls):
        jax.block_until_ready(compiled(*args))
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for _ in range(calls):
            out = compiled(*args)
        jax.block_until_ready(out)
    data = latest_trace(trace_dir)
    per_op, _, n = device_time(data)
    cats = collections.Counter()
    for name, ms in per_op.items():
        cats[category(name)] += ms / (calls * max(n, 1))
    busy, _, n2, _ = overlap(data)
    return cats, busy / (calls * max(n2, 1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8192x4096x14336", help="M x N x K of each GEMM, per device")
    p.add_argument("--rs", default="4096x28672", help="rows x cols of the reduce-scatter's input, per device")
    p.add_argument("--gemms", type=int, default=4)
    p.add_argument("--small", action="store_true", help="CPU smoke run: small shapes, XLA's GEMM only")
    p.add_argument("--grouped", action="store_true", help="the MoE grouped GEMM (gmm, 8 balanced groups)")
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="fp8", help="--grouped operands")
    args = p.parse_args(argv)
    m, n, k = (256, 128, 256) if args.small else map(int, args.shape.split("x"))
    dtype = jnp.float8_e4m3fn if args.dtype == "fp8" or not args.grouped else jnp.bfloat16
    rs_rows, rs_cols = (64, 128) if args.small else map(int, args.rs.split("x"))
    mesh = jax.make_mesh((jax.local_device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    n_dev = mesh.size
    if rs_rows % n_dev:
        raise SystemExit(f"--rs: {rs_rows} rows do not split over {n_dev} devices")
    keys = jax.random.split(jax.random.key(0), 3)
    groups = GROUPS if args.grouped else 1
    a = (jax.random.normal(keys[0], (n_dev * m, k)) * 2).astype(dtype)
    b = (jax.random.normal(keys[1], (n_dev * args.gemms * groups * n, k)) * 2).astype(dtype)
    if args.grouped:
        b = b.reshape(n_dev * args.gemms * groups, n, k)
    sa, sb = jnp.ones((n_dev * m,), jnp.float32), jnp.ones((n_dev * groups * n,), jnp.float32)
    c = jax.random.normal(keys[2], (n_dev * args.gemms * rs_rows, rs_cols), jnp.bfloat16)
    put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, P("d")))
    inputs = tuple(map(put, (a, b, sa, sb, c)))
    what = f"grouped {jnp.dtype(dtype).name} GEMMs ({GROUPS} groups)" if args.grouped else "fp8 GEMMs"
    print(f"{n_dev} x {jax.devices()[0].device_kind}: {args.gemms} {what} {m}x{n}x{k} beside a reduce-scatter of "
          f"{rs_rows}x{rs_cols} bf16 per device; ms per call and device (traced)")
    print("| variant | GEMMs alone | GEMMs beside | slowdown | reduce-scatter alone | beside | busy, both |")
    print("|---|---|---|---|---|---|---|")
    for label, config in variants(args.small, args.grouped, dtype).items():
        jax.clear_caches()  # the kernel launcher's jit cache keys on the config, but start each variant cold alike
        res = {}
        for kind in ("gemm", "rs", "both"):
            compiled = program(kind, config, mesh, m, n, rs_rows, rs_cols, args.gemms, args.grouped)
            compiled = compiled.lower(*inputs).compile()
            res[kind] = traced(compiled, inputs)
        gemm_cat = "gemm" if config is None and not args.grouped else "pallas kernels"
        alone, beside = res["gemm"][0][gemm_cat], res["both"][0][gemm_cat]
        slow = f"{(beside / alone - 1) * 100:+.1f}%" if alone else "-"
        print(f"| {label} | {alone:.3f} | {beside:.3f} | {slow} | {res['rs'][0]['collective']:.3f} | "
              f"{res['both'][0]['collective']:.3f} | {res['both'][1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
