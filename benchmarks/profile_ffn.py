"""Where the FFN block's fwd+bwd time goes, per kernel: the block `python -m pallas_kernels.bench fp8` times.

    PYTHONPATH=. python benchmarks/profile_ffn.py --recipe fp8_rowwise --recipe bf16
    PYTHONPATH=. python benchmarks/profile_ffn.py --moe mixtral --recipe fp8_rowwise   # the whole MoE layer instead

Runs the SwiGLU block of `pallas_kernels.bench` (T=8192, D=4096, F=14336, bf16 weights, every cast included)
forward and backward under jit, traces `--steps` calls with jax.profiler and prints, per recipe: the untraced wall
time per call, the device time per op and category (`profile_step.summarize`), then the last call's kernels in
launch order with their durations and register counts. Each Mosaic-GPU kernel is named for what it does
(`fp8_matmul_mosaic_gpu_kernel`, `quantize_amax_...`, `quantize_cast_...`, `gmm_...`, `tgmm_...`), so the per-op
table separates the fp8 GEMMs from the amax and cast passes; the launch-order list separates the calls of one kernel
(GEMMs run ~0.7 ms with 168 registers, the amax and cast passes tens of microseconds with 72 and 96).
`--moe mixtral|deepseek` profiles the whole MoE layer of `pallas_kernels.bench_grouped` (router, sort, grouped
GEMMs, combine, shared experts; `--impl` goes to the layer) instead of the dense block.

The wall time covers only `--steps` calls right after a short warm-up, while the clock is still high; the bench's
median sample comes later in a longer burst, under the 700 W power cap, and reads a few percent slower.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import jax
from jax.profiler import ProfileData

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import summarize  # noqa: E402

from pallas_kernels.bench import ffn_inputs, ffn_step  # noqa: E402
from pallas_kernels.bench_grouped import LAYER_CONFIGS, moe_layer_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", action="append", default=[], help="repeatable; default fp8_rowwise")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--trace-dir", default="/tmp/mx_jax_ffn_trace")
    ap.add_argument("--small", action="store_true", help="T=256, D=256, F=512 (a CPU check of the script)")
    ap.add_argument("--moe", choices=sorted(LAYER_CONFIGS), help="profile that problem's whole MoE layer instead")
    ap.add_argument("--expert-min-rows", type=int, default=None,
                    help="with --moe: quant.expert_min_rows (0 = the routed experts in fp8 at any size)")
    args = ap.parse_args()
    for recipe in args.recipe or ["fp8_rowwise"]:
        if args.moe:
            step, layer_args, _ = moe_layer_step(args.moe, recipe, args.impl, smoke=args.small,
                                                   expert_min_rows=args.expert_min_rows)
            inputs = [layer_args] * 2
        else:
            step, inputs = ffn_step(recipe, args.impl), ffn_inputs(jax.random.key(2), 2, small=args.small)
        fn = jax.jit(step)
        for i in range(3):
            jax.block_until_ready(fn(*inputs[i % 2]))
        t0 = time.perf_counter()
        for i in range(args.steps):
            out = fn(*inputs[i % 2])
        jax.block_until_ready(out)
        wall = (time.perf_counter() - t0) / args.steps
        trace_dir = f"{args.trace_dir}/{recipe}"
        jax.profiler.start_trace(trace_dir)
        for i in range(args.steps):
            out = fn(*inputs[i % 2])
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        what = f"MoE layer of {LAYER_CONFIGS[args.moe]}" if args.moe else "FFN block"
        print(f"\n===== {what}, {recipe} (impl={args.impl}): {1000 * wall:.3f} ms per fwd+bwd call (untraced wall)")
        summarize(trace_dir, args.steps, args.top)
        paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        kernel_sequence(ProfileData.from_file(sorted(paths)[-1]), args.steps)


def kernel_sequence(data, n_steps: int) -> None:
    """The last traced call's kernels in launch order, with their start (ms from the call's first kernel), duration
    and launch stats: Mosaic-GPU kernels all share one name, so the order and register count tell the GEMMs from the
    casts. `data` is a jax.profiler.ProfileData."""
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        events = sorted(((ev.start_ns, ev.duration_ns, ev.name, dict(ev.stats) if hasattr(ev, "stats") else {})
                         for line in plane.lines if "Stream" in line.name for ev in line.events), key=lambda e: e[0])
        per_step = len(events) // n_steps
        if not per_step:
            continue
        print(f"\nkernels of the last call, in launch order ({per_step}):")
        t_first = events[-per_step][0]
        for start, dur, name, stats in events[-per_step:]:
            keep = {k: str(v)[:40] for k, v in stats.items() if k in ("kernel_details", "hlo_op")}
            print(f"  {(start - t_first) / 1e6:7.3f} {dur / 1e6:7.3f} ms  {name[:50]:<50} {keep}")


if __name__ == "__main__":
    main()
