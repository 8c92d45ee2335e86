"""Per-kernel cycle counts of fp8 GEMMs from Nsight Compute: ours at each config beside cuBLASLt, clock-independent.

    bash benchmarks/run_on_gpu.sh ncu_gemm        # the cube and the FFN's K = 4096 and K = 14336 shapes

or by hand (ncu needs the Firecracker GPU runtime, see the device notes; clock control off, as METHOD.md asks):

    ncu --clock-control none --csv -k regex:'mosaic|nvjet|gemm' --metrics $(python3 benchmarks/ncu_gemm.py metrics) \\
        python3 benchmarks/ncu_gemm.py run 8192x8192x8192 delay_release=0,cluster=m delay_release=0 > ncu.csv
    python3 benchmarks/ncu_gemm.py table ncu.csv

`run-grouped [--problem NAME] [CONFIG ...]` does the same for the MoE grouped GEMM (bf16 `gmm` of bench_grouped's
problem, mixtral by default, balanced and skewed routing) beside cuBLAS's batched GEMM of the balanced groups and its
dense GEMM of the same FLOPs (`NCU_PROBLEM=qwen3 bash benchmarks/run_on_gpu.sh ncu_grouped`, mixtral without it).
`metrics --memory` adds DRAM bytes and the L2 hit rate, for which ncu replays each kernel: run those with
XLA_PYTHON_CLIENT_ALLOCATOR=platform (MEMORY_METRICS says why), as that section does.

Why: under the H200's 700 W limit a 0.1-0.3 s timing inherits the clock of whatever ran before it (up to 8% between
runs of one kernel), so it cannot rank two configs a few percent apart. SM cycles per kernel do not depend on the
clock (memory latency in cycles does, a little), so they show how much work per clock a config gets done; the
sustained sweep of `gemm_clock.py --sustained-sweep` then shows what the power limit leaves of it.

`run` launches, per shape, XLA's fp8 dot without scales (cuBLASLt; XLA may first launch its autotuning candidates,
which ncu profiles too) and then each Pallas config twice; `table` takes the second launch of each config and the last
cuBLASLt launch before the first Pallas one, and prints per row: SM cycles (the slowest GPC), tensor-pipe busy share
of active and elapsed cycles, SM clock, TFLOP/s at a nominal 1.5 GHz (= cycles only, for comparison), L2 -> SM
crossbar busy share and warp instructions executed.
"""

from __future__ import annotations

import csv
import importlib
import sys

METRICS = (
    "gpc__cycles_elapsed.max",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "sm__cycles_elapsed.avg.per_second",
    "lts__lts2xbar_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "smsp__inst_executed.sum",
)
# `metrics --memory` adds these: DRAM bytes need a second pass, so ncu replays each kernel and saves and restores
# the device memory the process holds first. JAX's default allocator holds 75% of the GPU from the start, so run
# with XLA_PYTHON_CLIENT_ALLOCATOR=platform (a cudaMalloc per live buffer) or the replays take minutes per kernel.
MEMORY_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sector_hit_rate.pct")


def run(shapes: str, configs: list[str]) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.bench import fp8_operands, parse_config, xla_fp8_noscale

    fp8mm = importlib.import_module("pallas_kernels.fp8_matmul")  # the module: the package re-exports the function
    for shape in shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        (args,) = fp8_operands(jax.random.key(0), m, n, k, 1)
        xla = jax.jit(xla_fp8_noscale)
        jax.block_until_ready(xla(*args))
        print(f"ROW|{shape}|cuBLASLt", flush=True)
        for c in configs:
            cfg = parse_config(c)
            if (reason := fp8mm.pallas_cover(m, n, k, args[0].dtype, args[1].dtype, jnp.bfloat16, cfg)) is not None:
                print(f"SKIP|{shape}|{cfg.name()}|{reason}", flush=True)
                continue
            f = jax.jit(lambda *x, cfg=cfg: fp8mm.fp8_matmul(*x, impl="pallas", config=cfg))
            for _ in range(2):
                jax.block_until_ready(f(*args))
            print(f"ROW|{shape}|{cfg.name()}", flush=True)


def run_grouped(configs: list[str], problem: str = "mixtral") -> None:
    """The MoE grouped GEMM (bf16 `gmm` of bench_grouped's `problem`, balanced then skewed routing) beside cuBLAS:
    under balanced routing its batched GEMM of the same groups (x as (E, M/E, K) @ w), under skewed routing the dense
    GEMM of the same FLOPs (x (M, K) @ w[0], whose weights stay in L2); configs as in gemm_clock.py --grouped
    ('default': the built-in)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import grouped_matmul as gm
    from pallas_kernels.bench_grouped import PROBLEMS, routings

    gemm_clock = importlib.import_module("gemm_clock")  # benchmarks/ is this script's directory
    p = PROBLEMS[problem]
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (p.m, p.k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (p.e, p.k, p.n), jnp.float32) / p.k**0.5).astype(jnp.bfloat16)
    shape = f"{p.m}x{p.n}x{p.k}"
    dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    batched = jax.jit(lambda a, b: jnp.einsum("gmk,gkn->gmn", a.reshape(p.e, p.m // p.e, p.k), b))
    for routing, sizes in routings(p).items():
        # The table pairs a cuBLAS row with the last cuBLAS launch before the next Pallas one, so each cuBLAS row
        # has Pallas launches between it and the one before.
        if routing == "balanced" and p.m % p.e == 0:
            baseline, name, args = batched, "cuBLAS batched", (x, w)
        else:
            baseline, name, args = dense, "cuBLAS dense", (x, w[0])
        for _ in range(3):
            jax.block_until_ready(baseline(*args))
        print(f"ROW|{shape}|{name}", flush=True)
        for c in configs:
            cfg = gemm_clock._grouped_config(c, fp8=False)
            f = jax.jit(lambda x, w, s, cfg=cfg: gm.gmm(x, w, s, impl="pallas", config=cfg))
            for _ in range(2):
                jax.block_until_ready(f(x, w, sizes))
            print(f"ROW|{shape}|gmm bf16 {routing} {c}", flush=True)


def table(path: str) -> None:
    lines = open(path).read().splitlines()
    rows = list(csv.reader(line for line in lines if line.startswith('"')))
    order = [line.split("|") for line in lines if line.startswith(("ROW|", "SKIP|"))]
    ix = {h: i for i, h in enumerate(rows[0])}
    names, vals = {}, {}
    for r in rows[1:]:
        i = int(r[ix["ID"]])
        names[i] = r[ix["Kernel Name"]]
        vals.setdefault(i, {})[r[ix["Metric Name"]]] = float(r[ix["Metric Value"]].replace(",", ""))
    ours = [i for i in sorted(names) if "mosaic" in names[i]]
    theirs = [i for i in sorted(names) if "mosaic" not in names[i]]
    memory = all(mm in v for v in vals.values() for mm in MEMORY_METRICS)
    print("| M x N x K | kernel | SM cycles | tensor busy, % of active | % of elapsed | SM GHz | TFLOP/s at 1.5 GHz"
          " | L2->SM xbar % | M warp instr. |" + (" DRAM read MB | DRAM write MB | L2 hit % |" if memory else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if memory else ""))
    used = 0
    for kind, shape, name, *rest in order:
        if kind == "SKIP":
            print(f"| {shape} | {name} | not covered: {rest[0]} |||||||")
            continue
        if name.startswith("cuBLAS"):
            nxt = ours[used] if used < len(ours) else float("inf")
            prev = ours[used - 1] if used else -1
            cand = [i for i in theirs if prev < i < nxt]
            if not cand:
                continue
            i = cand[-1]
            name = f"{name} `{names[i].split('(')[0][:48]}`"
        else:
            i = ours[used + 1]
            used += 2
        v = vals[i]
        m, n, k = (int(x) for x in shape.split("x"))
        cyc = v["gpc__cycles_elapsed.max"]
        print(f"| {shape} | {name} | {cyc:,.0f} | {v[METRICS[1]]:.1f} | {v[METRICS[2]]:.1f} "
              f"| {v[METRICS[3]] / 1e9:.2f} | {2 * m * n * k / (cyc / 1.5e9) / 1e12:,.0f} | {v[METRICS[4]]:.1f} "
              f"| {v[METRICS[5]] / 1e6:.1f} |"
              + (f" {v[MEMORY_METRICS[0]] / 1e6:,.0f} | {v[MEMORY_METRICS[1]] / 1e6:,.0f} | {v[MEMORY_METRICS[2]]:.1f} |"
                 if memory else ""))


def main(argv: list[str]) -> None:
    if argv[:1] == ["metrics"]:
        print(",".join(METRICS + (MEMORY_METRICS if argv[1:] == ["--memory"] else ())))
    elif argv[:1] == ["run"] and len(argv) >= 2:
        run(argv[1], argv[2:])
    elif argv[:1] == ["run-grouped"]:
        problem = "mixtral"
        if argv[1:2] == ["--problem"] and len(argv) >= 3:
            problem, argv = argv[2], argv[2:]
        run_grouped(argv[1:] or ["default"], problem)
    elif argv[:1] == ["table"] and len(argv) == 2:
        table(argv[1])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
