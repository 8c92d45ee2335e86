"""GEMM throughput against the SM clock and board power: ours beside XLA's, burst and sustained.

    python benchmarks/gemm_clock.py                  # fp8 8192^3 and the MoE grouped bf16 shape, 0.3 s and 3 s
    python benchmarks/gemm_clock.py --k-sweep        # + fp8 M = N = 8192 over K = 2048 ... 32768
    python benchmarks/gemm_clock.py --idle-bursts    # only fp8 8192^3 bursts after 0 / 2 / 5 s idle, 3 rounds
    python benchmarks/gemm_clock.py --whole-rounds   # only fp8 at M and at M' = 8448 (whole rounds of tiles)
    python benchmarks/gemm_clock.py --sustained-sweep --config delay_release=0,cluster=m --config delay_release=0
    python benchmarks/gemm_clock.py --sustained-sweep --grouped --config default --config cluster=n
    python benchmarks/gemm_clock.py --sustained-sweep --grouped --dtypes bf16,fp8 --config default \
        --config delay_release=1
    python benchmarks/gemm_clock.py --sustained-sweep --grouped --problem deepseek --config default \
        --config tile_m=64,tile_n=128,wg_split=m,stages=4

Why: an H200 running a large GEMM reaches its 700 W board limit and lowers the SM clock (nvidia-smi throttle reason
0x4, software power cap), so TFLOP/s depends on how long the GEMM has run and on the host. Each row runs one GEMM
back to back for `seconds` while a thread samples `nvidia-smi` every ~50 ms, and reports TFLOP/s, the median SM
clock and power of the last two thirds of the samples, and TFLOP/s per GHz of SM clock:

    efficiency per clock = (TFLOP/s / f_SM) / (SMs x FLOP per SM per clock),
    FLOP per SM per clock = 4096 (dense bf16) or 8192 (dense fp8) on Hopper.

Two kernels compared at one clock differ in work per clock; at the same power they also differ in energy per FLOP,
which is what decides throughput once the board is at its limit.

The clock and power of a 0.3 s row are not its own: nvidia-smi's readings trail the load by about a second, so
only the sustained rows' clock columns describe the kernel. Even those are samples of a clock the power cap moves
many times a second: they put the bf16 grouped GEMM 9% behind cuBLAS per clock where Nsight Compute's cycle counts
show it level (benchmarks/RESULTS.md, MoE fourteenth pass). Compare work per clock with benchmarks/ncu_gemm.py.

--k-sweep times fp8 GEMMs of fixed M = N = 8192 and growing K in the burst protocol of `pallas_kernels.bench`: a
kernel that lost time per output tile (epilogue, pipeline refill) would gain TFLOP/s as K grows.

--sustained-sweep chooses between kernel configs the way a training run sees them: at every shape of
`fp8_matmul.AUTO_TABLE` (or --shapes) it runs XLA's rowwise-scaled fp8 path, cuBLASLt without scales and each
--config back to back for `--sweep-seconds`, and repeats the whole set `--rounds` times in the same order, so that
every kernel is timed at the power limit and none inherits a cooler board than the others. The two rounds of one
kernel agree within 0.5% at 2.5 s per run and within 2% at 1 s on an H200, where single 0.1-0.3 s bursts of
`pallas_kernels.bench` move by up to 8% with the order they run in (benchmarks/RESULTS.md, eighth and ninth passes).
With --grouped it does the same for the MoE grouped GEMM (bf16 `gmm`, the issue's E = 8 problem or `--problem
deepseek`, balanced and skewed routing; `--config` then takes `grouped_matmul.TileConfig` fields, `default` for the
built-in config; `--dtypes bf16,fp8` adds the fp8 rowwise forward) beside the dense GEMM of the same FLOPs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import statistics
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp

from pallas_kernels import grouped_matmul as gm
from pallas_kernels.bench import fp8_operands, median_ms, parse_config, time_fn, xla_fp8_noscale
from pallas_kernels.bench_grouped import FULL, PROBLEMS, routings

fp8mm = importlib.import_module("pallas_kernels.fp8_matmul")  # the module: the package re-exports the function
F8 = jnp.float8_e4m3fn


def _smi() -> tuple[float, float] | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                              "--id=0"], capture_output=True, text=True, timeout=5).stdout
        clock, power = (float(v) for v in out.strip().split(","))
        return clock, power
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _sampler(stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        s = _smi()
        if s:
            out.append(s)
        time.sleep(0.05)


def run(label: str, fn, args, flops: float, seconds: float, sms: int, flop_per_clock: int) -> None:
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:  # calibrate the repeat count
        jax.block_until_ready(f(*args))
        n += 1
    reps = max(3, int(seconds / ((time.perf_counter() - t0) / n)))
    time.sleep(1.0)  # let the clock recover between rows
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=_sampler, args=(stop, samples))
    sampler.start()
    t0 = time.perf_counter()
    for _ in range(reps):
        y = f(*args)
    jax.block_until_ready(y)
    dt = (time.perf_counter() - t0) / reps
    stop.set()
    sampler.join()
    tflops = flops / dt / 1e12
    steady = samples[len(samples) // 3:]
    if steady:
        mhz = statistics.median(s[0] for s in steady)
        watts = statistics.median(s[1] for s in steady)
        per_ghz = tflops / (mhz / 1e3)
        eff = per_ghz * 1e12 / (sms * flop_per_clock * 1e9)
        clock = f"{mhz:.0f} | {watts:.0f} | {per_ghz:.0f} | {eff:.0%}"
    else:
        clock = "n/a | n/a | n/a | n/a"
    print(f"| {seconds:g} s | {label} | {dt * 1e3:.3f} | {tflops:.0f} | {clock} |", flush=True)


def table(seconds_list, sms: int) -> None:
    print("| run | GEMM | ms | TFLOP/s | SM MHz | W | TFLOP/s per GHz | of peak per clock |")
    print("|---|---|---|---|---|---|---|---|")
    c = 8192
    (fp8_args,) = fp8_operands(jax.random.key(0), c, c, c, 1)
    fp8_flops = 2.0 * c**3
    p = FULL
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (p.m, p.k), jnp.bfloat16)
    w = (jax.random.normal(kw, (p.e, p.k, p.n), jnp.float32) / p.k**0.5).astype(jnp.bfloat16)
    w_dense = w[0]
    g_flops = 2.0 * p.m * p.k * p.n
    for seconds in seconds_list:
        run("fp8 8192^3, XLA cuBLASLt, no scales", xla_fp8_noscale, fp8_args, fp8_flops, seconds, sms, 8192)
        run("fp8 8192^3, XLA cuBLASLt, rowwise scales", fp8mm.fp8_matmul_xla, fp8_args, fp8_flops, seconds, sms, 8192)
        run("fp8 8192^3, Pallas rowwise (impl=auto)", fp8mm.fp8_matmul, fp8_args, fp8_flops, seconds, sms, 8192)
        run(f"bf16 {p.m}x{p.n}x{p.k} dense, XLA cuBLAS", lambda a, b: a @ b, (x, w_dense), g_flops, seconds, sms, 4096)
        for name, sizes in routings(p).items():
            run(f"bf16 grouped E={p.e} {name}, Pallas gmm", lambda a, b, s: gm.gmm(a, b, s, impl="pallas"),
                (x, w, sizes), g_flops, seconds, sms, 4096)


def k_sweep() -> None:
    print("\n| M x N x K | XLA fp8 no scales TFLOP/s | Pallas fp8 rowwise (impl=auto) TFLOP/s |\n|---|---|---|")
    for i, k in enumerate((2048, 4096, 8192, 16384, 32768)):
        args = fp8_operands(jax.random.key(k), 8192, 8192, k, 2)
        flops = 2.0 * 8192 * 8192 * k
        ms = {}
        # Short bursts depend on what ran just before (the clock falls as the board heats up to its power limit):
        # each timing starts after a pause, and the two kernels alternate which goes first.
        for name in (("xla", "ours") if i % 2 else ("ours", "xla")):
            time.sleep(1.0)
            ms[name] = time_fn(xla_fp8_noscale if name == "xla" else fp8mm.fp8_matmul, args).ms
        xla, ours = ms["xla"], ms["ours"]
        print(f"| 8192 x 8192 x {k} | {flops / xla / 1e9:.0f} | {flops / ours / 1e9:.0f} |", flush=True)


def idle_bursts(idles=(0.0, 2.0, 5.0), rounds: int = 3) -> None:
    """fp8 8192^3 in `pallas_kernels.bench`'s burst protocol (3 warm-up calls, median of 10 samples of 10 calls),
    each burst started after `idle` seconds of an idle GPU, for XLA without scales, XLA rowwise and ours
    (impl="auto"); each round rotates which path goes first. Asks whether a burst figure is reproducible once every
    path starts from the same power state."""
    c = 8192
    sets = fp8_operands(jax.random.key(0), c, c, c, 3)
    fns = {"XLA no scales": jax.jit(xla_fp8_noscale), "XLA rowwise": jax.jit(fp8mm.fp8_matmul_xla),
           "Pallas (impl=auto)": jax.jit(fp8mm.fp8_matmul)}
    for f in fns.values():
        jax.block_until_ready(f(*sets[0]))  # compiled before any timing
    names = list(fns)
    print(f"\nfp8 8192^3 bursts after an idle pause, TFLOP/s of each round ({rounds} rounds, order rotated)")
    print("| idle before each burst | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for idle in idles:
        tf = {n: [] for n in names}
        for r in range(rounds):
            for n in names[r % len(names):] + names[: r % len(names)]:
                time.sleep(idle)
                tf[n].append(2.0 * c**3 / median_ms(fns[n], sets) / 1e9)  # no compile after the pause
        print(f"| {idle:g} s | " + " | ".join(" / ".join(f"{v:,.0f}" for v in tf[n]) for n in names) + " |",
              flush=True)


WHOLE_ROUNDS_SHAPES = [(8192, 8192, 8192), (8192, 14336, 4096), (8192, 4096, 14336)]  # M' = 8448 for all three


def whole_rounds_m(m: int, n: int, k: int, sms: int) -> tuple[int, float]:
    """(M', rounds at M): the smallest M' >= M at which impl="auto"'s config makes a whole number of rounds of
    output tiles over its persistent grid (one CTA or 2-CTA cluster per unit)."""
    cfg = fp8mm.auto_choice(m, n, k, F8, F8)
    if cfg is None:
        raise SystemExit(f"--whole-rounds: impl='auto' runs XLA at {m}x{n}x{k}: no kernel grid to fill")
    units = sms // (2 if cfg.cluster else 1)
    n_iters, step = n // cfg.cluster_tile_n, cfg.cluster_tile_m
    for rows in range(-(-m // step), 4 * m // step + 1):
        if rows * n_iters % units == 0 and fp8mm.auto_choice(rows * step, n, k, F8, F8) == cfg:
            return rows * step, (m // step) * n_iters / units
    raise SystemExit(f"--whole-rounds: no M' <= 4M gives whole rounds at {m}x{n}x{k} with the same config")


def whole_rounds(shapes, sms: int, seconds: float, rounds: int) -> None:
    """Does the last, partly empty round of output tiles cost time? Each shape beside the same problem with M grown to
    the next whole number of rounds (e.g. 8192 -> 8448 rows: 1,056 tiles of 256x256 over 66 clusters instead of
    1,024), ours (impl="auto") and cuBLASLt without scales: bursts after 2 s idle (`rounds` + 1, order rotated) and
    `seconds`-long sustained runs (`rounds`), TFLOP/s. The wave-quantization loss is the TFLOP/s gained at M'."""
    print(f"\nWhole rounds of tiles: TFLOP/s at M and at M' (sustained {seconds:g} s x {rounds}; bursts after 2 s idle)")
    print("| M x N x K | rounds at M | M' | path | sustained M | sustained M' | gain | burst mean M | burst mean M' |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m, n, k in shapes:
        m2, r = whole_rounds_m(m, n, k, sms)
        fns = {}
        for rows in (m, m2):
            (args,) = fp8_operands(jax.random.key(0), rows, n, k, 1)
            for path, f in (("ours", fp8mm.fp8_matmul), ("cuBLASLt no scales", xla_fp8_noscale)):
                fns[(path, rows)] = (jax.jit(f).lower(*args).compile(), args, 2.0 * rows * n * k)
        bursts = {key: [] for key in fns}
        for i in range(rounds + 1):
            keys = list(fns)[i % len(fns):] + list(fns)[: i % len(fns)]
            for key in keys:
                time.sleep(2.0)
                c, args, fl = fns[key]
                bursts[key].append(fl / median_ms(c, [args]) / 1e9)
        per_s = _alternate({key: (c, args) for key, (c, args, _) in fns.items()}, 1e12, seconds, rounds)  # calls/s
        for path in ("ours", "cuBLASLt no scales"):
            a = statistics.mean(per_s[(path, m)]) * fns[(path, m)][2] / 1e12
            b = statistics.mean(per_s[(path, m2)]) * fns[(path, m2)][2] / 1e12
            print(f"| {m} x {n} x {k} | {r:.2f} | {m2} | {path} | {a:,.0f} | {b:,.0f} | {b / a - 1:+.1%} | "
                  f"{statistics.mean(bursts[(path, m)]):,.0f} | {statistics.mean(bursts[(path, m2)]):,.0f} |",
                  flush=True)


def _sustained(f, args, flops: float, seconds: float) -> float:
    """TFLOP/s of `f(*args)` run back to back for `seconds`, after a 0.5 s pause."""
    time.sleep(0.5)
    reps = max(5, int(seconds / _calibrate(f, args)))
    t0 = time.perf_counter()
    for _ in range(reps):
        y = f(*args)
    jax.block_until_ready(y)
    return flops * reps / (time.perf_counter() - t0) / 1e12


def _calibrate(f, args) -> float:
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(5):
        y = f(*args)
    jax.block_until_ready(y)
    return (time.perf_counter() - t0) / 5


def sustained_sweep(shapes, configs: list[str], seconds: float, rounds: int) -> None:
    """Per shape: XLA rowwise, XLA without scales and every config, `rounds` times in the same order."""
    print(f"\nSustained fp8 GEMM TFLOP/s, {seconds:g} s per run, {rounds} rounds (each cell: the rounds' mean, then "
          "their spread)")
    print("| M x N x K | XLA rowwise | XLA no scales | " + " | ".join(configs)
          + " | best config | best / XLA rowwise |")
    print("|---|---|---|" + "---|" * len(configs) + "---|---|")
    for m, n, k in shapes:
        (fp8_args,) = fp8_operands(jax.random.key(0), m, n, k, 1)
        fns = {"XLA rowwise": (jax.jit(fp8mm.fp8_matmul_xla), fp8_args),
               "XLA no scales": (jax.jit(xla_fp8_noscale), fp8_args)}
        for c in configs:
            cfg = parse_config(c)
            if fp8mm.pallas_cover(m, n, k, fp8_args[0].dtype, fp8_args[1].dtype, jnp.bfloat16, cfg) is None:
                fns[c] = (jax.jit(functools.partial(fp8mm.fp8_matmul, impl="pallas", config=cfg)), fp8_args)
        runs = _alternate(fns, 2.0 * m * n * k, seconds, rounds)
        mean = {name: statistics.mean(r) for name, r in runs.items()}
        best = max((c for c in configs if c in mean), key=mean.get, default=None)
        ratio = f"{mean[best] / mean['XLA rowwise']:.2f}" if best else "-"
        print(f"| {m} x {n} x {k} | {_cell(runs, 'XLA rowwise')} | {_cell(runs, 'XLA no scales')} | "
              + " | ".join(_cell(runs, c) for c in configs) + f" | {best} | {ratio} |", flush=True)


def _alternate(fns: dict, flops: float, seconds: float, rounds: int) -> dict[str, list[float]]:
    """{name: (f, args)} -> {name: TFLOP/s of each round}; every round runs all of them in the same order."""
    runs = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (f, args) in fns.items():
            runs[name].append(_sustained(f, args, flops, seconds))
    return runs


def _cell(runs: dict[str, list[float]], name: str) -> str:
    """'mean ±half the spread' of one kernel's rounds."""
    if name not in runs:
        return "not covered"
    r = runs[name]
    return f"{statistics.mean(r):.0f} ±{(max(r) - min(r)) / 2:.0f}"


def _grouped_config(text: str, fp8: bool) -> gm.TileConfig | None:
    """None for 'default'; fp8 configs take 128-wide K steps (128 B rows) unless tile_k is given."""
    if text == "default":
        return None
    cfg = parse_config(text, gm.TileConfig)
    if fp8 and "tile_k=" not in text:
        cfg = dataclasses.replace(cfg, tile_k=128)
    return cfg


def grouped_sustained_sweep(
    configs: list[str], seconds: float, rounds: int, problem: str = "mixtral", dtypes: tuple[str, ...] = ("bf16",)
) -> None:
    """gmm at each config, balanced and skewed, beside the dense GEMM of the same FLOPs (cuBLAS bf16, cuBLASLt fp8
    without scales); `rounds` times in the same order. fp8 is the rowwise W8A8 forward (weights stored K-major)."""
    p = PROBLEMS[problem]
    kx, kw, ks = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (p.m, p.k), jnp.bfloat16)
    w = (jax.random.normal(kw, (p.e, p.k, p.n), jnp.float32) / p.k**0.5).astype(jnp.bfloat16)
    flops = 2.0 * p.m * p.k * p.n
    for dtype in dtypes:
        fp8 = dtype == "fp8"
        if fp8:
            w_op = jnp.swapaxes(w, 1, 2).astype(F8)  # (E, N, K)
            x_op = x.astype(F8)
            scales = dict(lhs_scale=jax.random.uniform(ks, (p.m,), jnp.float32, 0.5, 2.0),
                          rhs_scale=jnp.ones((p.e, p.n), jnp.float32))
            dense = ("cuBLASLt fp8 dense", jax.jit(xla_fp8_noscale), (x_op, w_op[0]))
        else:
            w_op, x_op, scales = w, x, {}
            dense = ("cuBLAS dense", jax.jit(lambda a, b: a @ b), (x, w[0]))
        print(f"\nSustained {dtype} grouped GEMM TFLOP/s (E={p.e}, M={p.m}, K={p.k}, N={p.n}), {seconds:g} s per "
              f"run, {rounds} rounds (each cell: the rounds' mean, then their spread)")
        print(f"| routing | {dense[0]} | " + " | ".join(configs) + " |")
        print("|---|---|" + "---|" * len(configs))
        for name, sizes in routings(p).items():
            fns = {dense[0]: dense[1:]}
            for c in configs:
                cfg = _grouped_config(c, fp8)
                if cfg is not None and (reason := gm.gmm_pallas_cover(
                        x_op.shape, w_op.shape, x_op.dtype, w_op.dtype, transpose_rhs=fp8, out_dtype=jnp.bfloat16,
                        scaled=fp8, config=cfg)) is not None:
                    sys.exit(f"--config {c}: {reason}")
                f = functools.partial(gm.gmm, transpose_rhs=fp8, impl="pallas", config=cfg, **scales)
                fns[c] = (jax.jit(f), (x_op, w_op, sizes))
            runs = _alternate(fns, flops, seconds, rounds)
            print(f"| {name} | {_cell(runs, dense[0])} | " + " | ".join(_cell(runs, c) for c in configs) + " |",
                  flush=True)


def _shapes(text: str, default: list) -> list[tuple[int, int, int]]:
    """--shapes: 'auto' (the mode's default list) or MxNxK,MxNxK,..."""
    return default if text == "auto" else [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", default="0.3,3", help="comma-separated run lengths per row")
    ap.add_argument("--k-sweep", action="store_true", help="also time fp8 8192 x 8192 x K for K = 2048 ... 32768")
    ap.add_argument("--sustained-sweep", action="store_true",
                    help="only the sustained config sweep (--config, --shapes, --sweep-seconds, --rounds)")
    ap.add_argument("--config", action="append", default=[],
                    help="TileConfig fields, e.g. 'stages=4,epi_tile_m=64,epi_tile_n=64,cluster=m' (repeatable)")
    ap.add_argument("--shapes", default="auto",
                    help="'auto' (AUTO_TABLE's shapes; WHOLE_ROUNDS_SHAPES with --whole-rounds) or MxNxK,MxNxK,...")
    ap.add_argument("--grouped", action="store_true", help="--sustained-sweep over grouped GEMM configs instead")
    ap.add_argument("--problem", choices=sorted(PROBLEMS), default="mixtral",
                    help="with --grouped: bench_grouped's problem (mixtral: the issue's E=8; deepseek: E=64)")
    ap.add_argument("--dtypes", default="bf16", help="with --grouped: comma-separated, from bf16,fp8")
    ap.add_argument("--idle-bursts", action="store_true",
                    help="only fp8 8192^3 bursts after 0, 2 and 5 s idle, ours beside XLA's (see idle_bursts)")
    ap.add_argument("--whole-rounds", action="store_true",
                    help="only ours and cuBLASLt at each --shapes shape and at M grown to whole rounds of tiles")
    ap.add_argument("--sweep-seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("gemm_clock.py times GPU kernels: run it on an NVIDIA Hopper GPU")
    dev = jax.devices()[0]
    print(f"{dev.device_kind}, jax {jax.__version__}, {dev.core_count} SMs")
    if args.idle_bursts:
        idle_bursts()
        return
    if args.whole_rounds:
        whole_rounds(_shapes(args.shapes, WHOLE_ROUNDS_SHAPES), dev.core_count, args.sweep_seconds, args.rounds)
        return
    if args.grouped and not args.sustained_sweep:
        sys.exit("--grouped selects what --sustained-sweep times: pass both")
    if args.sustained_sweep and args.grouped:
        dtypes = tuple(args.dtypes.split(","))
        if unknown := set(dtypes) - {"bf16", "fp8"}:
            sys.exit(f"--dtypes: unknown {sorted(unknown)}; choose from bf16, fp8")
        grouped_sustained_sweep(args.config or ["default"], args.sweep_seconds, args.rounds, args.problem, dtypes)
        return
    if args.sustained_sweep:
        if not args.config:
            sys.exit("--sustained-sweep needs at least one --config")
        sustained_sweep(_shapes(args.shapes, list(fp8mm.AUTO_TABLE)), args.config, args.sweep_seconds, args.rounds)
        return
    table([float(s) for s in args.seconds.split(",")], dev.core_count)
    if args.k_sweep:
        k_sweep()


if __name__ == "__main__":
    main()
