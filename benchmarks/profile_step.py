"""Where one train step's time goes: jax.profiler trace of a few steps, summed per XLA op and per category.

    python benchmarks/profile_step.py --steps 3 --config configs/llama3_8b.yaml model.n_layers=8 \\
        data.source=embedded data.seq_len=8192 data.batch_size=1

Prints the step time, the device time per category (GEMMs, attention, fusions, copies, collectives, other) and
the top ops, from the device plane of the trace (XLA op names on GPU). Then, per cuBLAS GEMM of the compiled step
(matched through the kernels' `hlo_op` trace stat), its shapes, time and TFLOP/s: what to compare with the same
GEMM run standalone (`python -m pallas_kernels.bench fp8`, "xla bf16" column). The raw trace stays under
--trace-dir for TensorBoard's profile plugin.
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import re
import time

import jax

from mx_jax import sharding, train
from mx_jax.config import load_config
from mx_jax.data import Batches, open_dataset

CATEGORIES = (
    ("attention", ("cudnn", "fmha", "flash", "attention")),
    ("gemm", ("gemm", "cublas", "matmul", "dot", "wgmma", "mosaic", "custom-call")),
    ("collective", ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "nccl", "collective")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset", "dynamic-update-slice", "dynamic-slice")),
    ("scatter/gather", ("scatter", "gather")),
    ("fusion", ("fusion", "loop_", "input_", "reduce")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


_SHAPE = r"([a-z0-9]+)\[([0-9,]*)\]"


def gemm_flops(hlo_text: str) -> dict[str, tuple[float, str]]:
    """{instruction name: (FLOPs, "MxK . KxN -> out" description)} for the cuBLAS GEMM custom calls (and plain dots)
    of an optimized HLO module: 2 x (output elements) x (product of the lhs contracting dimensions)."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \(?" + _SHAPE + r".*?(custom-call|dot)\((.*?)\)", line)
        if not m or (m.group(4) == "custom-call" and "__cublas" not in line):
            continue
        name, out_dims = m.group(1), [int(d) for d in m.group(3).split(",") if d]
        operands = re.findall(_SHAPE, m.group(5))
        contract = re.search(r"lhs_contracting_dim(?:ension)?s\W+([\d\W]*?)[\]}]", line)
        if not operands or not contract:
            continue
        lhs = [int(d) for d in operands[0][1].split(",") if d]
        k = math.prod(lhs[int(i)] for i in re.findall(r"\d+", contract.group(1)))
        shapes = " . ".join("x".join(dims.split(",")) for _, dims in operands[:2])
        out[name] = (2.0 * math.prod(out_dims) * k, f"{shapes} -> {'x'.join(map(str, out_dims))}")
    return out


def gemm_table(data, hlo_text: str, n_steps: int, top: int) -> None:
    """Per-GEMM time and TFLOP/s from the kernels' hlo_op stats (GPU traces); silent when the trace has none."""
    flops = gemm_flops(hlo_text)
    per_op: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    kernel: dict[str, str] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if "Stream" not in line.name:
                continue
            for ev in line.events:
                op = dict(ev.stats).get("hlo_op") if hasattr(ev, "stats") else None
                if op in flops:
                    per_op[op] += ev.duration_ns / 1e6
                    calls[op] += 1
                    kernel[op] = ev.name
    if not per_op:
        print("\n(no hlo_op stats matched a GEMM of the compiled step: per-GEMM table skipped)")
        return
    total_flop = sum(flops[op][0] * calls[op] for op in per_op)
    total_ms = sum(per_op.values())
    print(f"\nGEMMs of the step: {total_ms / n_steps:.1f} ms per step and device at "
          f"{total_flop / (total_ms * 1e-3) / 1e12:.0f} TFLOP/s; the {top} longest:")
    print(f"  {'ms/step':>8} {'calls':>5} {'TFLOP/s':>8}  {'operands -> output':<40} kernel")
    for op, ms in per_op.most_common(top):
        f, desc = flops[op]
        tflops = f * calls[op] / (ms * 1e-3) / 1e12
        print(f"  {ms / n_steps:8.2f} {calls[op] // n_steps:5d} {tflops:8.0f}  {desc:<40} {kernel[op][:60]}")


def summarize(trace_dir: str, n_steps: int, top: int, hlo_text: str = "") -> None:
    from jax.profiler import ProfileData

    paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    data = ProfileData.from_file(sorted(paths)[-1])
    per_op: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    n_dev = 0
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        n_dev += 1
        lines = {line.name: line for line in plane.lines}
        # "XLA Ops" carries HLO op names; fall back to the raw kernel streams
        chosen = [lines["XLA Ops"]] if "XLA Ops" in lines else [l for n, l in lines.items() if "Stream" in n]
        for line in chosen:
            for ev in line.events:
                per_op[ev.name] += ev.duration_ns / 1e6
                counts[ev.name] += 1
    if not n_dev:
        print("no device plane in the trace (CPU run): nothing to summarize")
        return
    n_steps *= n_dev  # report per step and per device
    total = sum(per_op.values())
    by_cat: collections.Counter = collections.Counter()
    for name, ms in per_op.items():
        by_cat[category(name)] += ms
    print(f"\ndevice time per step and device: {total / n_steps:.1f} ms (sum over ops, {n_steps // n_dev} steps "
          f"traced on {n_dev} device(s))")
    for cat, ms in by_cat.most_common():
        print(f"  {cat:<16}{ms / n_steps:9.2f} ms  {100 * ms / total:5.1f}%")
    print(f"\ntop {top} ops (ms per step, calls per step):")
    for name, ms in per_op.most_common(top):
        print(f"  {ms / n_steps:8.2f}  {counts[name] // n_steps:4d}x  {category(name):<14} {name[:110]}")
    if hlo_text:
        gemm_table(data, hlo_text, n_steps, top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--trace-dir", default="/tmp/mx_jax_trace")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    train.apply_default_xla_flags()
    cfg = load_config(args.config, [*args.overrides, "run_dir=/tmp/mx_jax_profile"])
    mesh = sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        state = train.init_state(setup)
        step = train.make_train_step(setup)
        batches = Batches(open_dataset(cfg.data).train, cfg.data.batch_size, cfg.seed)
        batch = batches.next_global(setup.batch_shardings, cfg.data.grad_accum_steps)
        for _ in range(3):  # compile + warm up
            state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        wall = (time.perf_counter() - t0) / args.steps
        jax.profiler.start_trace(args.trace_dir)
        for _ in range(args.steps):
            state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        jax.profiler.stop_trace()
    tokens = cfg.data.batch_size * cfg.data.seq_len
    print(f"wall time per step (untraced): {1000 * wall:.1f} ms = {tokens / wall:,.0f} tokens/s")
    summarize(args.trace_dir, args.steps, args.top, step.lower(state, batch).compile().as_text())


if __name__ == "__main__":
    main()
