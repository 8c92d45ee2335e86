"""Kernel benchmarks against the best non-custom path (XLA / cuBLASLt), in one run per section.

    python -m pallas_kernels.bench fp8 [--quick]      # on the H200
    python -m pallas_kernels.bench fp8 --cpu-smoke    # tiny shapes, kernels interpreted on CPU: checks the script

Sections are entries of SECTIONS (name -> function(args)); other kernels add theirs ("grouped", "mx").

Timing: each measurement compiles once (compile time reported), warms up, then takes `samples` samples; a sample
is the mean over a batch of calls dispatched back to back with rotating input sets (several distinct sets so L2
does not hold the operands between calls), ending in block_until_ready. The median sample is reported. Inputs are
random normal (never zeros). Correctness: relative Frobenius error ||out - ref|| / ||ref|| against an f32
computation on the same (already quantized) inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mx_jax import compat, quant
fp8mm = importlib.import_module("pallas_kernels.fp8_matmul")  # the module: the package re-exports the function
qz = importlib.import_module("pallas_kernels.quantize")

E4M3 = jnp.float8_e4m3fn


def log(*args) -> None:
    print(*args, flush=True)


# --------------------------------------------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Timing:
    ms: float
    compile_s: float
    out: object  # the output for the first input set (for correctness checks)
    hlo: str  # the compiled module's text


def time_fn(fn: Callable, arg_sets: list[tuple], *, samples: int = 10, batch: int = 10, warmup: int = 3) -> Timing:
    """Median over `samples` of the mean time of `batch` back-to-back calls, rotating over `arg_sets`."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*arg_sets[0]).compile()
    compile_s = time.perf_counter() - t0
    out = jax.block_until_ready(compiled(*arg_sets[0]))
    ms = median_ms(compiled, arg_sets, samples=samples, batch=batch, warmup=warmup)
    return Timing(ms, compile_s, out, compiled.as_text() or "")


def median_ms(compiled: Callable, arg_sets: list[tuple], *, samples: int = 10, batch: int = 10, warmup: int = 3
              ) -> float:
    """`time_fn`'s measurement of an already compiled function: `warmup` calls, then the median sample (ms)."""
    for i in range(warmup):
        jax.block_until_ready(compiled(*arg_sets[i % len(arg_sets)]))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        res = None
        for i in range(batch):
            res = compiled(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(res)
        times.append((time.perf_counter() - t0) / batch * 1e3)
    return statistics.median(times)


def rel_err(out, ref) -> float:
    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


# --------------------------------------------------------------------------------------------------------------
# fp8 section.
# --------------------------------------------------------------------------------------------------------------
def gemm_shapes(quick: bool, smoke: bool) -> list[tuple[str, tuple[int, int, int]]]:
    """(label, (M, N, K)): 8192³, then M = 8192 tokens x Llama3 (N, K), then the FFN's two weight-gradient GEMMs."""
    t = 8192
    shapes = [("cube", (8192, 8192, 8192))]
    shapes += [(f"8B {n}x{k}", (t, n, k)) for n, k in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))]
    shapes += [(f"70B {n}x{k}", (t, n, k)) for n, k in ((8192, 8192), (1024, 8192), (28672, 8192), (8192, 28672))]
    shapes += [("ffn wgrad up", (4096, 14336, t)), ("ffn wgrad down", (14336, 4096, t))]
    # The other GEMMs of the 8B training step (fused q|k|v and gate|up projections, llama.py): forward (T, N, K),
    # grad-input (T, K, N), grad-weight (K, N, T), where not listed above.
    for name, (n, k) in (("qkv", (6144, 4096)), ("gate|up", (28672, 4096))):
        shapes += [(f"8B {name} fwd", (t, n, k)), (f"8B {name} dgrad", (t, k, n)), (f"8B {name} wgrad", (k, n, t))]
    shapes += [("8B wo wgrad", (4096, 4096, t))]
    if quick:
        shapes = [shapes[i] for i in (0, 3, 4, 8)]
    if smoke:
        shapes = [(label, (256, 256, 256)) for label, _ in shapes[:3]]
    return shapes


def parse_config(text: str, cls=fp8mm.TileConfig):
    """'tile_m=64,tile_n=256,wg_split=m' -> `cls` (a TileConfig; ints where the value is an int, None for 'none')."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in fields:
            raise SystemExit(f"--config: unknown TileConfig field {name!r}; fields: {sorted(fields)}")
        kw[name] = None if value.lower() == "none" else int(value) if value.lstrip("-").isdigit() else value
    return cls(**kw)


def tile_sweep(args) -> list[fp8mm.TileConfig]:
    """The configs tried at the first shape (8192³); the best two are then tried at every other shape."""
    if args.config:
        return [parse_config(c) for c in args.config]
    quick, smoke = args.quick, args.cpu_smoke
    base = fp8mm.DEFAULT_CONFIG
    r = dataclasses.replace
    configs = [
        fp8mm.AUTO_DEFAULT,  # the landed choice: static 4-stage ring, 64x256 warpgroup tiles, 2-CTA clusters along M
        base,  # CTA 128x256: each warpgroup 128x128, 3 stages, whole-tile epilogue
        r(base, wg_split="m"),  # CTA 256x128
        r(base, tile_m=64, tile_n=256, wg_split="m"),  # CTA 128x256, each warpgroup 64x256
        r(base, cluster="m"),  # 2 CTAs along M share (multicast) the B tile: 1/3 less L2->SMEM traffic
        r(base, cluster="n"),
        r(base, stages=4, epi_tile_m=64, epi_tile_n=64),
        r(base, delay_release=0),
        r(base, grid_minor="m", grid_tile_width=16),
        r(base, tile_k=64, stages=6),
    ]
    if quick:
        configs = configs[:4]
    if smoke:
        configs = [fp8mm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2)]
    return configs


def xla_fp8_noscale(a, b_t, *scales):
    """XLA's fp8 dot of K-major operands without scales (cuBLASLt): the 'no scales' column of every GEMM table."""
    del scales
    return lax.dot_general(a, b_t, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


def fp8_operands(key, m, n, k, sets):
    """`sets` input sets of (a (M,K) e4m3, b_t (N,K) e4m3, a_scale (M,), b_scale (N,)) from normal bf16 data."""
    out = []
    for i in range(sets):
        ka, kb = jax.random.split(jax.random.fold_in(key, i))
        (a, sa) = qz.quantize_reference(jax.random.normal(ka, (m, k), jnp.bfloat16), axis=1, dtype=E4M3)
        (b, sb) = qz.quantize_reference(jax.random.normal(kb, (n, k), jnp.bfloat16), axis=1, dtype=E4M3)
        out.append((a, b, sa, sb))
    return out


@dataclasses.dataclass
class GemmRow:
    label: str
    shape: tuple[int, int, int]
    tflops: dict[str, float] = dataclasses.field(default_factory=dict)
    err: dict[str, float] = dataclasses.field(default_factory=dict)
    best_config: fp8mm.TileConfig | None = None
    cublas_f8: bool = False


def bench_gemms(args, sets: int) -> list[GemmRow]:
    key = jax.random.key(0)
    rows = []
    configs = tile_sweep(args)
    ranked: list[fp8mm.TileConfig] = []
    wanted = set(filter(None, args.shapes.split(",")))
    for label, (m, n, k) in gemm_shapes(args.quick, args.cpu_smoke):
        if wanted and label not in wanted:
            continue
        row = GemmRow(label, (m, n, k))
        flop = 2.0 * m * n * k
        log(f"\n== {label}: M={m} N={n} K={k}")
        ops = fp8_operands(key, m, n, k, sets)
        a, b, sa, sb = ops[0]
        ref = fp8mm.fp8_matmul_reference(a, b, sa, sb, out_dtype=jnp.float32)

        def record(name, fn, arg_sets, ref_out):
            try:
                t = time_fn(fn, arg_sets, samples=args.samples, batch=args.batch)
            except Exception as e:  # noqa: BLE001 - report and go on with the other paths
                log(f"  {name:28s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                return None
            row.tflops[name] = flop / t.ms / 1e9
            row.err[name] = rel_err(t.out, ref_out)
            log(f"  {name:28s} {t.ms:8.3f} ms {row.tflops[name]:8.1f} TFLOP/s  rel.err {row.err[name]:.2e}"
                f"  (compile {t.compile_s:.1f}s)")
            return t

        # XLA bf16 on the same (dequantized) values, K-major right operand.
        bf_sets = [(x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)) for x, y, _, _ in ops]
        ref_bf = jnp.dot(bf_sets[0][0].astype(jnp.float32), bf_sets[0][1].astype(jnp.float32).T)
        record("xla bf16", lambda x, y: lax.dot_general(x, y, (((1,), (1,)), ((), ()))), bf_sets, ref_bf)
        # XLA fp8 without scales (bf16 out straight from cuBLASLt) and with rowwise scales (impl="xla").
        ref_ns = fp8mm.fp8_matmul_reference(a, b, 1.0, 1.0, out_dtype=jnp.float32)
        record("xla fp8 (no scales)", xla_fp8_noscale, [(x, y) for x, y, _, _ in ops], ref_ns)
        xla = lambda x, y, s, t: fp8mm.fp8_matmul(x, y, s, t, impl="xla")
        t_xla = record("xla fp8 rowwise", xla, ops, ref)
        row.cublas_f8 = t_xla is not None and "$f8" in t_xla.hlo  # cuBLASLt's `__cublas$lt$matmul$f8`
        # Pallas: the whole sweep at the first shape, the best two elsewhere (every config with --every-config).
        candidates = configs if not ranked or args.every_config else ranked[:2]
        results = []
        for cfg in candidates:
            if (reason := fp8mm.pallas_cover(m, n, k, a.dtype, b.dtype, jnp.bfloat16, cfg)) is not None:
                log(f"  pallas [{cfg.name()}] skipped: {reason}")
                continue
            fn = lambda x, y, s, t, cfg=cfg: fp8mm.fp8_matmul(x, y, s, t, impl="pallas", config=cfg)
            t = record(f"pallas [{cfg.name()}]", fn, ops, ref)
            if t is not None:
                results.append((t.ms, cfg))
        if results:
            results.sort(key=lambda r: r[0])
            best_ms, row.best_config = results[0]
            row.tflops["pallas fp8 rowwise"] = flop / best_ms / 1e9
            row.err["pallas fp8 rowwise"] = row.err[f"pallas [{row.best_config.name()}]"]
            if not ranked:
                ranked = [c for _, c in results]
        rows.append(row)
    return rows


def bench_casts(args, sets: int) -> list[tuple[str, str, str | None, float, float, float]]:
    """GB/s of the cast variants, Pallas vs the XLA-fused jnp reference.

    Returns (shape, variant, AUTO_PALLAS key it decides or None, xla GB/s, pallas GB/s, max |pallas - xla|).
    """
    shapes = [(8192, 4096), (8192, 14336)] if not args.cpu_smoke else [(256, 384)]
    if args.cast_shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.cast_shapes.split(",")]
    out = []
    key = jax.random.key(1)
    big_tile = qz.CastConfig(cast_bm=128, cast_bn=128)
    # name -> (function of (x, impl), number of fp8 outputs, the AUTO_PALLAS entry it decides)
    variants = {
        "rows (along last axis)": (
            lambda x, impl: qz.quantize(x, axis=1, dtype=E4M3, pow2_scale=True, impl=impl), 1, "rows"),
        "cols_t (transposed)": (
            lambda x, impl: qz.quantize_t(x, dtype=E4M3, pow2_scale=True, impl=impl), 1, "cols_t"),
        "dual (both layouts)": (
            lambda x, impl: qz.quantize_dual(x, dtype=E4M3, pow2_scale=True, impl=impl), 2, "dual"),
        "dual tensorwise": (
            lambda x, impl: qz.quantize_dual(x, dtype=E4M3, scaling="tensorwise", impl=impl), 2, None),
        "dual, 128x128 cast tile": (
            lambda x, impl: qz.quantize_dual(x, dtype=E4M3, pow2_scale=True, impl=impl, config=big_tile), 2, None),
    }
    if args.cast_config:  # a sweep of the Pallas dual cast over the given tile configs instead of the variants
        variants = {}
        for spec in args.cast_config:
            cfg = qz.CastConfig(**{k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))})
            name = f"dual a{cfg.amax_bm}x{cfg.amax_bn} c{cfg.cast_bm}x{cfg.cast_bn}"
            variants[name] = (lambda x, impl, cfg=cfg: qz.quantize_dual(x, dtype=E4M3, pow2_scale=True, impl=impl,
                                                                         config=cfg), 2, None)
    for r, c in shapes:
        xs = [(jax.random.normal(jax.random.fold_in(key, i), (r, c), jnp.bfloat16),) for i in range(sets)]
        log(f"\n== cast x ({r}, {c}) bf16 -> e4m3")
        for name, (fn, n_out, auto_key) in variants.items():
            nbytes = r * c * (2 + n_out)  # one read of x, each fp8 output written once (the minimal traffic)
            res = {}
            for impl in ("xla", "pallas"):
                try:
                    t = time_fn(lambda x, impl=impl: fn(x, impl), xs, samples=args.samples, batch=args.batch)
                    res[impl] = t
                    log(f"  {name:24s} {impl:6s} {t.ms * 1e3:8.1f} us {nbytes / t.ms / 1e6:8.1f} GB/s"
                        f"  (compile {t.compile_s:.1f}s)")
                except Exception as e:  # noqa: BLE001
                    log(f"  {name:24s} {impl:6s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            if len(res) == 2:
                diff = max(
                    float(jnp.max(jnp.abs(jnp.asarray(p, jnp.float32) - jnp.asarray(q, jnp.float32))))
                    for p, q in zip(jax.tree.leaves(res["xla"].out), jax.tree.leaves(res["pallas"].out))
                )
                gbs = (nbytes / res["xla"].ms / 1e6, nbytes / res["pallas"].ms / 1e6)
                out.append((f"{r}x{c}", name, auto_key, *gbs, diff))
    return out


def _ffn(x, w_gate, w_up, w_down, recipe, impl):
    """SwiGLU block: (silu(x W_gate) * (x W_up)) W_down; x (T, D), W_gate/W_up (D, F), W_down (F, D)."""
    g = quant.linear(x, w_gate, recipe=recipe, impl=impl)
    u = quant.linear(x, w_up, recipe=recipe, impl=impl)
    h = jax.nn.silu(g) * u
    return quant.linear(h, w_down, recipe=recipe, impl=impl)


FFN_SHAPE = (8192, 4096, 14336)  # T, D, F: Llama3-8B's FFN on 8192 tokens
FFN_SMALL = (256, 256, 512)


def ffn_inputs(key, sets: int, *, small: bool = False, wdtype=jnp.bfloat16) -> list[tuple]:
    """`sets` input sets (x (T, D) bf16, W_gate, W_up (D, F), W_down (F, D) in wdtype, dy (T, D) bf16)."""
    t_, d, f = FFN_SMALL if small else FFN_SHAPE

    def make(i):
        k = jax.random.split(jax.random.fold_in(key, i), 5)
        x = jax.random.normal(k[0], (t_, d), jnp.bfloat16)
        ws = [(jax.random.normal(kk, s, jnp.float32) / np.sqrt(s[0])).astype(wdtype)
              for kk, s in zip(k[1:4], ((d, f), (d, f), (f, d)))]
        dy = jax.random.normal(k[4], (t_, d), jnp.bfloat16)
        return (x, *ws, dy)

    return [make(i) for i in range(sets)]


def ffn_step(recipe: str, impl: str) -> Callable:
    """(x, W_gate, W_up, W_down, dy) -> (y, (dx, dW_gate, dW_up, dW_down)): the block's forward and backward."""
    def run(x, wg, wu, wd, dy):
        y, pull = jax.vjp(lambda *p: _ffn(*p, recipe, impl), x, wg, wu, wd)
        return y, pull(dy)
    return run


def bench_ffn(args, sets: int) -> list[tuple[str, float, float, float]]:
    """FFN fwd+bwd ms per recipe, every cast included; (name, ms, rel.err y, rel.err dx)."""
    t_, d, f = FFN_SMALL if args.cpu_smoke else FFN_SHAPE
    key = jax.random.key(2)
    variants = [
        ("bf16", "bf16", "auto", jnp.bfloat16),
        ("fp8_tensorwise", "fp8_tensorwise", "auto", jnp.bfloat16),
        ("fp8_rowwise", "fp8_rowwise", "auto", jnp.bfloat16),
        ("fp8_rowwise_gw_hp", "fp8_rowwise_gw_hp", "auto", jnp.bfloat16),
        ("fp8_rowwise xla-only", "fp8_rowwise", "xla", jnp.bfloat16),
        ("fp8_rowwise f32 master w", "fp8_rowwise", "auto", jnp.float32),
    ]
    if args.quick:
        variants = variants[:3]
    log(f"\n== FFN fwd+bwd: T={t_} D={d} F={f} (SwiGLU, 3 linears through quant.linear, every cast included)")
    inputs = {wd: ffn_inputs(key, sets, small=args.cpu_smoke, wdtype=wd) for wd in {v[3] for v in variants}}
    ref_args = [a.astype(jnp.float32) for a in inputs[jnp.bfloat16][0]]
    y_ref, grads_ref = ffn_step("bf16", "reference")(*ref_args)  # f32 operands: bf16 recipe then computes in f32
    out = []
    for name, recipe, impl, wd in variants:
        try:
            t = time_fn(ffn_step(recipe, impl), inputs[wd], samples=args.samples, batch=max(1, args.batch // 2))
        except Exception as e:  # noqa: BLE001
            log(f"  {name:26s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        y, grads = t.out
        ey, edx = rel_err(y, y_ref), rel_err(grads[0], grads_ref[0])
        log(f"  {name:26s} {t.ms:8.3f} ms  rel.err y {ey:.2e} dx {edx:.2e}  (compile {t.compile_s:.1f}s)")
        out.append((name, t.ms, ey, edx))
    return out


def section_fp8(args) -> None:
    sets = 3 if not args.cpu_smoke else 2
    t_start = time.perf_counter()
    rows = bench_gemms(args, sets)
    # Let impl="auto" use what this run measured (for the FFN below), and print it for AUTO_TABLE.
    table = {}
    for row in rows:
        pallas, xla = row.tflops.get("pallas fp8 rowwise", 0.0), row.tflops.get("xla fp8 rowwise", 0.0)
        table[row.shape] = row.best_config if pallas >= xla and row.best_config else None
    fp8mm.AUTO_TABLE.update(table)
    casts = bench_casts(args, sets)
    for auto_key in {c[2] for c in casts} - {None}:  # Pallas for a variant when it won at every shape
        qz.AUTO_PALLAS[auto_key] = all(c[4] > c[3] for c in casts if c[2] == auto_key)
    ffn = bench_ffn(args, sets)

    log("\n" + "=" * 118)
    log(f"fp8 summary — {jax.devices()[0].device_kind}, jax {jax.__version__}  (TFLOP/s; rel.err vs f32 on the same"
        f" inputs; section took {time.perf_counter() - t_start:.0f}s)")
    cols = ["xla bf16", "xla fp8 (no scales)", "xla fp8 rowwise", "pallas fp8 rowwise"]
    log(f"{'shape':16s} {'M':>6s} {'N':>6s} {'K':>6s} | {'bf16':>7s} {'fp8':>7s} {'fp8+sc':>7s} {'pallas':>7s}"
        f" {'pal/xla':>7s} | {'err bf16':>8s} {'err xla':>8s} {'err pal':>8s} | $f8 | best pallas config")
    for row in rows:
        m, n, k = row.shape
        v = [row.tflops.get(c, float("nan")) for c in cols]
        ratio = v[3] / v[2] if v[2] == v[2] and v[2] > 0 else float("nan")
        e = [row.err.get(c, float("nan")) for c in ("xla bf16", "xla fp8 rowwise", "pallas fp8 rowwise")]
        cfg = row.best_config.name() if row.best_config else "-"
        log(f"{row.label:16s} {m:6d} {n:6d} {k:6d} | {v[0]:7.0f} {v[1]:7.0f} {v[2]:7.0f} {v[3]:7.0f} {ratio:7.3f} |"
            f" {e[0]:8.1e} {e[1]:8.1e} {e[2]:8.1e} | {'yes' if row.cublas_f8 else 'no ':3s} | {cfg}")
    log("\ncasts (GB/s of minimal traffic: one bf16 read + each fp8 output written once)")
    for shape, variant, _, xla_gbs, pallas_gbs, diff in casts:
        log(f"  {shape:12s} {variant:24s} xla {xla_gbs:7.0f}  pallas {pallas_gbs:7.0f}  max|diff| {diff:.1e}")
    log("\nFFN fwd+bwd (ms)")
    for name, ms, ey, edx in ffn:
        log(f"  {name:26s} {ms:8.3f} ms   rel.err y {ey:.1e} dx {edx:.1e}")
    log("\nAUTO_TABLE for pallas_kernels/fp8_matmul.py (None = XLA won):")
    for shape, cfg in table.items():
        log(f"    {shape}: {repr(cfg) if cfg else None},")
    log(f"AUTO_PALLAS for pallas_kernels/quantize.py: {qz.AUTO_PALLAS}")


def section_mx(args) -> None:
    from pallas_kernels.bench_mx import bench_mx

    bench_mx(args.quick, smoke=args.cpu_smoke, samples=args.samples, batch=args.batch)


def section_mxcast(args) -> None:
    from pallas_kernels.mx_quantize import bench_mx_cast

    bench_mx_cast(args.quick)


def section_indexed(args) -> None:
    from pallas_kernels.bench_indexed import bench_indexed

    bench_indexed(args.quick, args.cpu_smoke, args.config, args.samples, args.batch, dense_only=args.shapes == "dense")


def section_grouped(args) -> None:
    from pallas_kernels.bench_grouped import bench_grouped

    bench_grouped(args.quick, args.cpu_smoke)


SECTIONS: dict[str, Callable] = {"fp8": section_fp8, "mx": section_mx, "mxcast": section_mxcast,
                                 "grouped": section_grouped, "indexed": section_indexed}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("section", choices=sorted(SECTIONS))
    p.add_argument("--quick", action="store_true", help="fewer shapes and tile configs")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Pallas kernels interpreted on CPU")
    p.add_argument("--config", action="append", default=[],
                   help="a TileConfig to try instead of the built-in sweep, e.g. tile_m=64,tile_n=256,wg_split=m "
                        "(repeatable)")
    p.add_argument("--every-config", action="store_true",
                   help="fp8: time every config at every shape (default: the best two of the first shape after it)")
    p.add_argument("--cast-config", action="append", default=[],
                   help="fp8: sweep the Pallas dual cast over these CastConfigs instead of the cast variants, e.g. "
                        "amax_bm=64,amax_bn=256,cast_bm=64,cast_bn=128 (repeatable)")
    p.add_argument("--cast-shapes", default="", help="fp8: comma-separated RxC cast shapes, e.g. 8192x6144,4096x28672")
    p.add_argument("--shapes", default="", help="fp8: comma-separated shape labels to run (default: all), e.g. cube; "
                                                "indexed: 'dense' runs its dense products only")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--batch", type=int, default=10)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.samples, args.batch = 2, 2
        from pallas_kernels import interpret_compat

        interpret_compat.install()
    log(f"device: {jax.devices()[0].device_kind} ({jax.devices()[0].platform}) x{jax.device_count()}  "
        f"jax {jax.__version__}  python {sys.version.split()[0]}")
    log(f"command: python -m pallas_kernels.bench {' '.join(argv if argv is not None else sys.argv[1:])}")
    ctx = compat.force_gpu_interpret_mode(compat.InterpretGPUParams()) if args.cpu_smoke else contextlib.nullcontext()
    with ctx:
        SECTIONS[args.section](args)


if __name__ == "__main__":
    main()
