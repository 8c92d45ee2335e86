"""MX GEMM benchmark on Hopper: the Pallas MX kernel against XLA bf16, the XLA MX path and the fp8 rowwise kernel.

    python -m pallas_kernels.bench_mx [--quick]      # on the H200 (also: bench_mx(quick) from pallas_kernels.bench)
    python -m pallas_kernels.bench_mx --cpu-smoke    # tiny shapes, Pallas kernels interpreted on CPU: checks the script

Shapes: 8192³, then M = 8192 tokens x the Llama3 (N, K) of the fp8 benchmark (8B: 4096x4096, 1024x4096,
14336x4096, 4096x14336; 70B: 8192x8192, 1024x8192, 28672x8192, 8192x28672). Operands: normal bf16 data cast to
MXFP8 (e4m3, rceil: the training recipe's cast) by `mx_format.mx_quantize`.

Columns (TFLOP/s = 2MNK / time):
- xla bf16     lax.dot_general of the dequantized bf16 operands, K-major right operand, bf16 out: the bar to beat
- xla mx       mx_matmul(impl="xla"): dequantize to bf16 + the same XLA bf16 GEMM (what public stacks do on Hopper)
- pallas mx    mx_matmul(impl="pallas"): the tile sweep at 8192³, its best two configs at every other shape
- pallas fp8   fp8 rowwise Pallas kernel (pallas_kernels.fp8_matmul) on rowwise e4m3 operands of the same data,
               when that module imports: what MX costs relative to per-row scaling
Correctness: ||out - ref|| / ||ref|| with ref = mx_matmul_reference (f32 HIGHEST) on the same MX operands; bf16 output
rounding alone gives ~1e-3.

Timing: each path is compiled once (compile time printed), warmed up, then `samples` samples are taken; a sample is
the mean of `batch` back-to-back calls rotating over distinct input sets (so L2 does not hold the operands), ended by
block_until_ready; the median sample is reported. Budget: ~3-4 min of GPU time (--quick: ~1 min), mostly compiles.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from mx_jax import compat
from mx_jax import mx_format as mxf
from pallas_kernels.bench import rel_err, time_fn

mm = importlib.import_module("pallas_kernels.mx_matmul")  # the module; the package re-exports dispatchers
E4M3 = jnp.float8_e4m3fn
SMOKE_CONFIG = mm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2)


def _fp8_module():
    """pallas_kernels.fp8_matmul when it exists and imports, else None (the fp8 column is then left out)."""
    try:
        return importlib.import_module("pallas_kernels.fp8_matmul")
    except Exception as err:  # noqa: BLE001 - another helper's module: any import failure only drops a column
        print(f"(fp8 rowwise column skipped: pallas_kernels.fp8_matmul does not import: {err!r})", flush=True)
        return None


def shapes(quick: bool, smoke: bool) -> list[tuple[str, tuple[int, int, int]]]:
    """(label, (M, N, K)): 8192³ and M = 8192 tokens x Llama3-8B/70B (N, K)."""
    t = 8192
    out = [("cube", (8192, 8192, 8192))]
    out += [(f"8B {n}x{k}", (t, n, k)) for n, k in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))]
    out += [(f"70B {n}x{k}", (t, n, k)) for n, k in ((8192, 8192), (1024, 8192), (28672, 8192), (8192, 28672))]
    if quick:
        out = [out[i] for i in (0, 3, 6, 7)]
    if smoke:
        out = [(label, (256, 256, 256)) for label, _ in out[:2]]
    return out


def tile_sweep(quick: bool, smoke: bool) -> list[mm.TileConfig]:
    """Configs tried at the first shape; the best two are tried at every other shape."""
    r = dataclasses.replace
    base = mm.DEFAULT_CONFIG
    configs = [
        base,  # CTA 128x128: warpgroups 64x128 stacked along M, 4 stages, one wgmma accumulator
        r(base, tile_m=128, tile_n=64, wg_split="n"),  # 4 rows x 16 cols per thread: fewer factor loads
        r(base, tmp_slots=2),  # blocks in pairs: block j+1's wgmma overlaps block j's promotion
        r(base, scale_first=True),  # p · (fa · fb): S may be hoisted above the wgmma wait
        r(base, tile_m=128, tile_n=64, wg_split="n", tmp_slots=2),
        r(base, wg_split="n"),  # CTA 64x256
        r(base, stages=5),
    ]
    if quick:
        configs = configs[:4]
    if smoke:
        configs = [SMOKE_CONFIG, r(SMOKE_CONFIG, tmp_slots=2)]
    return configs


@jax.jit
def _mx_cast(x):
    return mxf.mx_quantize(x, mode="rceil", elem_dtype=E4M3)


@jax.jit
def _rowwise_cast(x):
    """x (R, C) bf16 -> (e4m3 (R, C), f32 dequantization scale (R,)): the fp8 rowwise recipe's cast (amax / 448)."""
    amax = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1), 1e-12)
    scale = amax / 448.0
    return jnp.clip(x.astype(jnp.float32) / scale[:, None], -448.0, 448.0).astype(E4M3), scale


@dataclasses.dataclass
class Row:
    label: str
    shape: tuple[int, int, int]
    tflops: dict[str, float] = dataclasses.field(default_factory=dict)
    err: dict[str, float] = dataclasses.field(default_factory=dict)
    best_config: mm.TileConfig | None = None


def bench_mx(quick: bool = False, *, smoke: bool = False, samples: int = 10, batch: int = 10) -> list[Row]:
    """Run the MX GEMM benchmark and print its table last; returns the rows. `smoke`: tiny shapes, interpreted."""
    t_start = time.perf_counter()
    interpret = compat.InterpretGPUParams() if smoke else None
    if smoke:
        from pallas_kernels import interpret_compat

        interpret_compat.install()
        samples, batch = 2, 2
    fp8mm = _fp8_module()
    dev = jax.devices()[0]
    print(f"# MX GEMM bench on {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
          f"{samples} samples x {batch} calls", flush=True)
    configs = tile_sweep(quick, smoke)
    ranked: list[mm.TileConfig] = []
    rows = []
    sets = 2
    key = jax.random.key(0)
    for label, (m, n, k) in shapes(quick, smoke):
        row = Row(label, (m, n, k))
        flop = 2.0 * m * n * k
        print(f"\n== {label}: M={m} N={n} K={k}", flush=True)
        src = [
            tuple(jax.random.normal(kk, s, jnp.bfloat16) for kk, s in zip(jax.random.split(jax.random.fold_in(key, i)),
                                                                           ((m, k), (n, k))))
            for i in range(sets)
        ]
        mx_sets = [(*_mx_cast(x), *_mx_cast(y)) for x, y in src]  # (a, sa, b, sb)
        mx_sets = [(a, b, sa, sb) for a, sa, b, sb in mx_sets]
        ref = jax.jit(lambda *v: mm.mx_matmul_reference(*v, out_dtype=jnp.float32))(*mx_sets[0])

        def record(name, fn, arg_sets, ref_out=ref):
            try:
                t = time_fn(fn, arg_sets, samples=samples, batch=batch)
            except Exception as err:  # noqa: BLE001 - report and go on with the other paths
                print(f"  {name:34s} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
                return None
            row.tflops[name] = flop / t.ms / 1e9
            row.err[name] = rel_err(t.out, ref_out)
            print(f"  {name:34s} {t.ms:8.3f} ms {row.tflops[name]:8.1f} TFLOP/s  rel.err {row.err[name]:.2e}"
                  f"  (compile {t.compile_s:.1f}s)", flush=True)
            return t

        deq = jax.jit(lambda a, b, sa, sb: (mxf.mx_dequantize(a, sa, out_dtype=jnp.bfloat16),
                                            mxf.mx_dequantize(b, sb, out_dtype=jnp.bfloat16)))
        bf_sets = [deq(*s) for s in mx_sets]
        record("xla bf16", lambda x, y: lax.dot_general(x, y, (((1,), (1,)), ((), ()))), bf_sets)
        del bf_sets
        record("xla mx", lambda *v: mm.mx_matmul(*v, impl="xla"), mx_sets)
        candidates = configs if not ranked else ranked[:2]
        results = []
        for cfg in candidates:
            if (reason := mm.pallas_cover(m, n, k, E4M3, E4M3, jnp.bfloat16, cfg)) is not None:
                print(f"  pallas mx [{cfg.name()}] skipped: {reason}", flush=True)
                continue
            fn = lambda *v, cfg=cfg: mm.mx_matmul(*v, impl="pallas", config=cfg, interpret=interpret)
            if (t := record(f"pallas mx [{cfg.name()}]", fn, mx_sets)) is not None:
                results.append((t.ms, cfg))
        if results:
            results.sort(key=lambda r: r[0])
            best_ms, row.best_config = results[0]
            row.tflops["pallas mx"] = flop / best_ms / 1e9
            row.err["pallas mx"] = row.err[f"pallas mx [{row.best_config.name()}]"]
            ranked = ranked or [c for _, c in results]
        if fp8mm is not None:
            fp8_sets = [(*_rowwise_cast(x), *_rowwise_cast(y)) for x, y in src]
            fp8_sets = [(a, b, sa, sb) for a, sa, b, sb in fp8_sets]
            a, b, sa, sb = fp8_sets[0]
            fp8_ref = jnp.dot(a.astype(jnp.float32) * sa[:, None], (b.astype(jnp.float32) * sb[:, None]).T,
                              precision=lax.Precision.HIGHEST)  # not TF32
            kw = dict(config=fp8mm.TileConfig(tile_m=64, tile_n=64, tile_k=64, stages=2)) if smoke else {}
            fn = lambda *v: fp8mm.fp8_matmul(*v, impl="pallas", interpret=interpret, **kw)
            record("pallas fp8 rowwise", fn, fp8_sets, fp8_ref)
            del fp8_sets
        rows.append(row)
        del mx_sets, src

    print("\nAUTO_TABLE for pallas_kernels/mx_matmul.py (None = the XLA MX path won):")
    for row in rows:
        won = row.tflops.get("pallas mx", 0.0) >= row.tflops.get("xla mx", float("inf"))
        print(f"    {row.shape}: {repr(row.best_config) if won and row.best_config else None},")
    print("\n" + "=" * 124)
    print(f"MX GEMM summary — {dev.device_kind}, jax {jax.__version__}  (TFLOP/s; rel.err vs f32 reference on the "
          f"same MX operands; took {time.perf_counter() - t_start:.0f}s)")
    print(f"{'shape':16s} {'M':>6s} {'N':>6s} {'K':>6s} | {'bf16':>6s} {'xla mx':>6s} {'pal mx':>6s} {'pal fp8':>7s} |"
          f" {'mx/bf16':>7s} {'mx/fp8':>6s} | {'err xmx':>7s} {'err pmx':>7s} | best pallas mx config")
    nan = float("nan")
    ratio = lambda x, y: x / y if y > 0 else nan
    for row in rows:
        m, n, k = row.shape
        v = [row.tflops.get(c, nan) for c in ("xla bf16", "xla mx", "pallas mx", "pallas fp8 rowwise")]
        e = [row.err.get(c, nan) for c in ("xla mx", "pallas mx")]
        cfg = row.best_config.name() if row.best_config else "-"
        print(f"{row.label:16s} {m:6d} {n:6d} {k:6d} | {v[0]:6.0f} {v[1]:6.0f} {v[2]:6.0f} {v[3]:7.0f} |"
              f" {ratio(v[2], v[0]):7.3f} {ratio(v[2], v[3]):6.3f} | {e[0]:7.1e} {e[1]:7.1e} | {cfg}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 shapes, 4 tile configs")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Pallas kernels interpreted on CPU")
    args = p.parse_args(argv)
    print(f"command: python -m pallas_kernels.bench_mx {' '.join(argv if argv is not None else sys.argv[1:])}  "
          f"(python {sys.version.split()[0]})", flush=True)
    ctx = compat.force_gpu_interpret_mode(compat.InterpretGPUParams()) if args.cpu_smoke else contextlib.nullcontext()
    with ctx:
        bench_mx(args.quick, smoke=args.cpu_smoke)


if __name__ == "__main__":
    main()
