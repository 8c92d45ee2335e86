"""Where one train step's time goes: jax.profiler trace of a few steps, summed per XLA op and per category.

    python benchmarks/profile_step.py --steps 3 --config configs/llama3_8b.yaml model.n_layers=8 \\
        data.source=embedded data.seq_len=8192 data.batch_size=1

Prints the step time (steps of one batch dispatched back to back, then the same steps run the way the trainer's loop
runs them, `trainer_loop_time`: what the host loop costs), the device time per category (GEMMs, attention, fusions,
copies, collectives, other) and the top ops, from the device plane of the trace (XLA op names on GPU). Then, per
cuBLAS GEMM of the compiled step (matched through the kernels' `hlo_op` trace stat), its shapes, time and TFLOP/s:
what to compare with the same GEMM run standalone (`python -m pallas_kernels.bench fp8`, "xla bf16" column). It also
counts the kernel calls (Pallas kernels by name, cuBLAS GEMMs, cuDNN) in one iteration of each of the compiled
step's loops: a scanned layer's forward body should hold one GEMM per linear. The raw trace stays under --trace-dir
for TensorBoard's profile plugin.

--replay (which turns XLA's CUDA-graph command buffers off, so that each kernel in the trace names its HLO
instruction) times every cuBLAS GEMM of the step again on its own: the same operand shapes, physical layouts,
contracting and batch dimensions and output dtype, compiled by XLA as a one-GEMM program. Side by side with the
in-step time it separates "XLA picked a slow algorithm / layout at this call site" from "the same GEMM is slower
inside the step" (clocks, power, L2). --dump DIR writes the optimized HLO, every op's time as CSV (ops.csv) and
the first device's timeline of traced ops with their trace stats (events.csv).
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import time

import jax

from mx_jax import sharding, train
from mx_jax.profiling import category, device_events, device_time, idle_gaps, latest_trace, summarize as summary_lines
from mx_jax.config import load_config
from mx_jax.data import Batches, Prefetch, open_dataset

_SHAPE = r"([a-z0-9]+)\[([0-9,]*)\]"


def hlo_symbols(hlo_text: str) -> dict[str, tuple[str, list[int], list[int]]]:
    """{instruction name: (dtype, dims, minor-to-major layout)} of every array-valued HLO instruction (a tuple's
    first element for tuple-valued ones). Names are unique within a module."""
    table = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = \(?([a-z0-9]+)\[([0-9,]*)\](?:\{([0-9,]*))?", hlo_text, re.M):
        table[m.group(1)] = (m.group(2), [int(d) for d in m.group(3).split(",") if d],
                             [int(d) for d in (m.group(4) or "").split(",") if d])
    return table


def call_operands(line: str, symbols: dict) -> list[tuple[str, list[int], list[int]]]:
    """(dtype, dims, layout) of each operand of an HLO instruction line; operands printed without their shape
    (as inside wrapped computations) are looked up in `symbols`."""
    args = re.search(r"(?:custom-call|dot)\((.*?)\)(?:,|$)", line).group(1)
    out = []
    for item in args.split(", "):
        m = re.match(r"\s*([a-z0-9]+)\[([0-9,]*)\](?:\{([0-9,]*)\})? %([\w.\-]+)", item)
        if m:
            out.append((m.group(1), [int(d) for d in m.group(2).split(",") if d],
                        [int(d) for d in (m.group(3) or "").split(",") if d]))
        elif (name := re.match(r"\s*%([\w.\-]+)", item)) and name.group(1) in symbols:
            out.append(symbols[name.group(1)])
    return out


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines} of an HLO module's text."""
    comps, lines = {}, None
    for line in hlo_text.splitlines():
        if (h := re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)):
            lines = comps.setdefault(h.group(1), [])
        elif lines is not None and line.startswith("}"):
            lines = None
        elif lines is not None:
            lines.append(line)
    return comps


def gemm_flops(hlo_text: str) -> dict[str, tuple[float, str, str]]:
    """{instruction name: (FLOPs, "MxK . KxN -> out" description, GEMM instruction)} for the cuBLAS GEMM custom
    calls (and plain dots) of an optimized HLO module, and for the instructions that call a computation whose root
    is one: 2 x (output elements) x (product of the lhs contracting dimensions)."""
    symbols = hlo_symbols(hlo_text)
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \(?" + _SHAPE + r".*?(custom-call|dot)\(", line)
        if not m or (m.group(4) == "custom-call" and "__cublas" not in line):
            continue
        name, out_dims = m.group(1), [int(d) for d in m.group(3).split(",") if d]
        operands = call_operands(line, symbols)
        contract = re.search(r"lhs_contracting_dim(?:ension)?s\W+([\d\W]*?)[\]}]", line)
        if len(operands) < 2 or not contract:
            continue
        lhs = operands[0][1]
        k = math.prod(lhs[int(i)] for i in re.findall(r"\d+", contract.group(1)))
        shapes = " . ".join("x".join(map(str, dims)) for _, dims, _ in operands[:2])
        out[name] = (2.0 * math.prod(out_dims) * k, f"{shapes} -> {'x'.join(map(str, out_dims))}", name)
    # A GEMM can be the root of a wrapping computation (a dynamic-slice fusion that folds the slice of stacked
    # layer weights into the GEMM's operand address); the trace names the calling instruction, so map it too.
    root_of = {}
    for comp, lines in _computations(hlo_text).items():
        for line in lines:
            if (r := re.match(r"\s*ROOT %([\w.\-]+) = ", line)) and r.group(1) in out:
                root_of[comp] = r.group(1)
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?calls=%([\w.\-]+)", hlo_text, re.M):
        if m.group(2) in root_of and m.group(1) not in out:
            out[m.group(1)] = out[root_of[m.group(2)]]
    return out


def _kernel_call(line: str) -> str | None:
    """What a custom-call instruction runs: a Pallas kernel by its name, "cuBLAS GEMM" or "cuDNN"; else None."""
    target = re.search(r'custom_call_target="([^"]+)"', line)
    if not target or "custom-call(" not in line:
        return None
    if target.group(1).startswith("mosaic_gpu") or target.group(1) == "__gpu$xla.gpu.triton":
        name = re.search(r'op_name="[^"]*/([\w]+)/(?:mpmd_map|pallas_call)[^"/]*"', line)
        return f"Pallas {name.group(1)}" if name else "Pallas kernel"
    if "cublas" in target.group(1):
        return "cuBLAS GEMM"
    if "cudnn" in target.group(1):
        return "cuDNN"
    return None


def loop_kernel_calls(hlo_text: str) -> list[tuple[str, int, collections.Counter]]:
    """(the loop's op_name, trip count, kernel calls per iteration by `_kernel_call`) for every while loop of a
    compiled HLO module with a known trip count: a scanned layer's forward and backward bodies. A kernel that runs
    more often than the layer needs shows here (session 42: XLA ran a saved GEMM twice inside the forward loop, so
    the forward body held five fp8 GEMMs where the layer has four). Calls inside fusions and other called
    computations count for the loop that calls them; a nested loop's body counts for the nested loop only."""
    comps = _computations(hlo_text)

    def count(name: str, seen: set) -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for line in comps.get(name, []):
            if (kind := _kernel_call(line)):
                out[kind] += 1
            if " while(" in line:
                continue
            for callee in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line):
                if callee not in seen:
                    out += count(callee, seen | {callee})
        return out

    loops = []
    for lines in comps.values():
        for line in lines:
            body = re.search(r" while\(.*body=%([\w.\-]+)", line)
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
            if body and trips:
                op = re.search(r'op_name="([^"]*)"', line)
                loops.append((op.group(1) if op else body.group(1), int(trips.group(1)), count(body.group(1), set())))
    return loops


def gemm_table(data, flops: dict, n_steps: int, top: int) -> dict[str, tuple[float, int]]:
    """Per-GEMM time and TFLOP/s from the kernels' hlo_op stats (GPU traces), for the GEMMs `gemm_flops` found;
    returns {op: (ms per step, executions per step)}."""
    per_op: collections.Counter = collections.Counter()
    per_kernel: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    launches: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
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
                    per_kernel[op][ev.name] += ev.duration_ns
                    launches[op][ev.name] += 1
    # A GEMM instruction may launch a helper kernel besides the GEMM (e.g. a workspace memset): count executions
    # by its longest-running kernel.
    kernel = {op: per_kernel[op].most_common(1)[0][0] for op in per_op}
    calls = {op: launches[op][kernel[op]] for op in per_op}
    if not per_op:
        print(f"\n(no kernel in the trace names one of the {len(flops)} GEMMs of the step: per-GEMM table skipped. "
              "Inside XLA's CUDA-graph command buffers kernels name the command buffer; --replay turns them off.)")
        return {}
    total_flop = sum(flops[op][0] * calls[op] for op in per_op)
    print(f"\n{len(per_op)} GEMM call sites of the step matched in the trace")
    total_ms = sum(per_op.values())
    print(f"\nGEMMs of the step: {total_ms / n_steps:.1f} ms per step and device at "
          f"{total_flop / (total_ms * 1e-3) / 1e12:.0f} TFLOP/s; the {top} longest:")
    print(f"  {'ms/step':>8} {'calls':>5} {'TFLOP/s':>8}  {'operands -> output':<40} kernel")
    for op, ms in per_op.most_common(top):
        f, desc, _ = flops[op]
        tflops = f * calls[op] / (ms * 1e-3) / 1e12
        print(f"  {ms / n_steps:8.2f} {calls[op] // n_steps:5d} {tflops:8.0f}  {desc:<40} {kernel[op][:60]}")
    return {op: (ms / n_steps, max(1, calls[op] // n_steps)) for op, ms in per_op.items()}


def replay_gemms(hlo_text: str, flops: dict, in_step: dict[str, tuple[float, int]], top: int) -> None:
    """Time each cuBLAS GEMM of the step standalone (same shapes, layouts, dimension numbers, output dtype)."""
    import json

    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    symbols = hlo_symbols(hlo_text)
    gemm_lines = {m.group(1): m.group(0) for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = .*$", hlo_text, re.M)
                  if '"__cublas$gemm"' in m.group(0) or '"__cublas$lt$matmul"' in m.group(0)}
    hlo_dtypes = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32, "f64": jnp.float64}
    rows = []
    for op, (ms_step, calls) in sorted(in_step.items(), key=lambda kv: -kv[1][0])[:top]:
        line = gemm_lines.get(flops[op][2])
        cfg = re.search(r'"dot_dimension_numbers":(\{.*?\})', line or "")
        if cfg is None:
            continue
        dn = json.loads(cfg.group(1))
        ints = lambda key: tuple(int(x) for x in dn.get(key, []))
        out_dt = re.search(r"= \(?([a-z0-9]+)\[", line).group(1)
        ops = call_operands(line, symbols)[:2]
        algo = re.search(r'"selected_algorithm":"?(-?\d+)', line)

        def physical(dt, dims, layout):
            # an array whose row-major storage is this operand's layout; the jitted fn transposes it back
            perm = list(reversed(layout))  # major-to-minor
            x = jax.random.normal(jax.random.key(len(rows)), [dims[p] for p in perm], jnp.float32)
            x = x.astype(hlo_dtypes[dt])
            return x, tuple(int(i) for i in np.argsort(perm))

        (a, pa), (b, pb) = (physical(*o) for o in ops)
        dims = ((ints("lhs_contracting_dimensions"), ints("rhs_contracting_dimensions")),
                (ints("lhs_batch_dimensions"), ints("rhs_batch_dimensions")))
        f = jax.jit(lambda a, b: lax.dot_general(jnp.transpose(a, pa), jnp.transpose(b, pb), dims,
                                                 preferred_element_type=hlo_dtypes[out_dt]))
        compiled = f.lower(a, b).compile()
        rep_algo = re.search(r'"selected_algorithm":"?(-?\d+)', compiled.as_text())
        for _ in range(3):
            out = compiled(a, b)
        out.block_until_ready()
        n = max(3, int(0.2 / max(ms_step / calls * 1e-3, 1e-5)))
        t0 = time.perf_counter()
        for _ in range(n):
            out = compiled(a, b)
        out.block_until_ready()
        rows.append((op, ms_step / calls, (time.perf_counter() - t0) / n * 1e3, calls,
                     algo.group(1) if algo else "-", rep_algo.group(1) if rep_algo else "-"))
    if not rows:
        print("\n(replay: no cuBLAS GEMM with dot_dimension_numbers found)")
        return
    print("\nreplay: each GEMM of the step alone (same shapes/layouts/dims/out dtype), ms per call:")
    print(f"  {'op':<28} {'calls':>5} {'in step':>8} {'alone':>8} {'ratio':>6}  algorithm step/alone")
    tot_in = tot_alone = 0.0
    for op, ms_in, ms_alone, calls, a1, a2 in rows:
        tot_in += ms_in * calls
        tot_alone += ms_alone * calls
        print(f"  {op[:28]:<28} {calls:5d} {ms_in:8.3f} {ms_alone:8.3f} {ms_in / ms_alone:6.2f}  {a1} / {a2}")
    print(f"  {'total per step':<28} {'':>5} {tot_in:8.2f} {tot_alone:8.2f} {tot_in / tot_alone:6.2f}")


def idle_report(data, n_steps: int) -> None:
    """How long each device's kernel stream sat idle between kernels during the traced steps, how many kernels ran
    inside CUDA graphs (XLA command buffers), and the kernels that most often followed the longest gaps."""
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        events = [ev for line in plane.lines if "Stream" in line.name for ev in line.events]
        if not events:
            continue
        span, idle, gaps = idle_gaps(events)
        in_graph = sum("cuda_graph_id" in dict(ev.stats) for ev in events if getattr(ev, "stats", None))
        print(f"\n{plane.name}: {len(events) // n_steps} kernels per step, {in_graph // n_steps} of them in CUDA "
              f"graphs; stream idle {idle / n_steps:.2f} ms per step between kernels "
              f"(span {span / n_steps:.1f} ms)")
        for name, ms in gaps.most_common(5):
            print(f"    {ms / n_steps:7.2f} ms idle before {name}")


def dump_events(data, path: str) -> int:
    """Write the first device plane's traced ops, in start order, as CSV: start (us from the first op), duration
    (us), name, category and the event's stats (`hlo_op` and the rest, `key=value` joined by "; "): the timeline
    to read offline, e.g. where in the step a collective nothing hid ran. Returns the number of rows."""
    import csv

    planes = device_events(data)
    events = sorted(planes[0], key=lambda ev: ev.start_ns) if planes else []
    t0 = events[0].start_ns if events else 0
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["start_us", "duration_us", "name", "category", "stats"])
        for ev in events:
            stats = "; ".join(f"{k}={v}" for k, v in (ev.stats or []))
            w.writerow([f"{(ev.start_ns - t0) / 1e3:.1f}", f"{ev.duration_ns / 1e3:.1f}", ev.name, category(ev.name),
                        stats])
    return len(events)


def summarize(trace_dir: str, n_steps: int, top: int, hlo_text: str = "", dump: str = "",
              replay: bool = False) -> None:
    data = latest_trace(trace_dir)
    per_op, counts, n_dev = device_time(data)
    print("\n" + "\n".join(summary_lines(data, n_steps, top)))
    if not n_dev:
        return
    n_steps *= n_dev  # report per step and per device
    idle_report(data, n_steps)
    if dump:
        import csv

        os.makedirs(dump, exist_ok=True)
        with open(f"{dump}/ops.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["op", "category", "ms_per_step", "calls_per_step"])
            for name, ms in per_op.most_common():
                w.writerow([name, category(name), f"{ms / n_steps:.4f}", counts[name] // n_steps])
        with open(f"{dump}/step.hlo.txt", "w") as fh:
            fh.write(hlo_text)
        dump_events(data, f"{dump}/events.csv")
    if hlo_text:
        loops = [loop for loop in loop_kernel_calls(hlo_text) if loop[2]]
        if loops:
            print("\nkernel calls per iteration of the step's loops (compiled HLO; a scanned layer's forward and "
                  "backward):")
            for op, trips, calls in loops:
                print(f"  {op} x{trips}: " + ", ".join(f"{n} {k}" for k, n in sorted(calls.items())))
        flops = gemm_flops(hlo_text)
        in_step = gemm_table(data, flops, n_steps, top)
        if replay and in_step:
            replay_gemms(hlo_text, flops, in_step, top)


def trainer_loop_time(step, state, batches: Batches, setup, cfg, n: int, *, prefetch: int | None = None,
                      read: bool = True, wait: bool = True):
    """(state, seconds per step) of n steps run as train._loop runs them, less its logging and saves: (wait) after a
    log.every_steps step the loop waits for it; then the next batch from data.Prefetch (`prefetch` built ahead;
    default cfg.data.prefetch), the step dispatched, and (read) the previous step's metrics read
    (train.read_metrics, which waits for that step). Against the one-batch loop, the difference is what the
    trainer's host loop costs the device."""
    pending, every = None, cfg.log.every_steps
    depth = cfg.data.prefetch if prefetch is None else prefetch
    feed = Prefetch(batches, setup.batch_shardings, cfg.data.grad_accum_steps, depth, n)
    try:
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            if wait and pending is not None and (i - 1) % every == 0:
                jax.block_until_ready(pending)
            batch, _ = feed.next()
            state, m = step(state, batch)
            if read and pending is not None:
                train.read_metrics(pending)
            pending = m
        train.read_metrics(pending)
        return state, (time.perf_counter() - t0) / n
    finally:
        feed.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--trace-dir", default="/tmp/mx_jax_trace")
    ap.add_argument("--dump", default="",
                    help="write step.hlo.txt, ops.csv (every op's time) and events.csv (device 0's timeline) here")
    ap.add_argument("--replay", action="store_true", help="time each cuBLAS GEMM of the step standalone too")
    ap.add_argument("--no-trace", action="store_true", help="stop after the step times: no trace, no summary")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.replay:
        # Inside a CUDA-graph command buffer every kernel's hlo_op is the command buffer: turn them off so each
        # GEMM kernel carries its own instruction name (the step may run slightly slower).
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_enable_command_buffer=".strip()
    train.apply_default_xla_flags()
    cfg = load_config(args.config, [*args.overrides, "run_dir=/tmp/mx_jax_profile"])
    mesh = sharding.make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        state = train.init_state(setup)
        batches = Batches(open_dataset(cfg.data).train, cfg.data.batch_size, cfg.seed)
        batch = batches.next_global(setup.batch_shardings, cfg.data.grad_accum_steps)
        # Compiled once, ahead of time: every step below runs this executable, so the HLO summarized and dumped is
        # the traced program's own, and no second compile is paid for it.
        t0 = time.perf_counter()
        step = train.make_train_step(setup).lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        # Progress as it happens: a run cut off by a timeout still shows how far it got.
        print(f"compile: {compile_s:.1f} s", flush=True)
        hlo = step.as_text()
        first = []
        for _ in range(3):  # warm up
            state, m = step(state, batch)
            first.append(m["loss"])
        jax.block_until_ready(m["loss"])
        print("loss of the first 3 steps (one batch, repeated): " + " ".join(f"{float(v):.6f}" for v in first),
              flush=True)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        wall = (time.perf_counter() - t0) / args.steps
        tokens = cfg.data.batch_size * cfg.data.seq_len
        print(f"wall time per step (untraced): {1000 * wall:.1f} ms = {tokens / wall:,.0f} tokens/s", flush=True)
        print("  the trainer's loop, one part added per line (in parentheses: against the one-batch loop):")
        for what, kw in (("a fresh batch each step, built in the loop (data.prefetch=0)",
                          dict(prefetch=0, read=False, wait=False)),
                         (f"built ahead instead (data.prefetch={cfg.data.prefetch})", dict(read=False, wait=False)),
                         ("the previous step's metrics read once the next is dispatched", dict(wait=False)),
                         (f"a wait for the step at each log line (log.every_steps={cfg.log.every_steps})", {})):
            state, looped = trainer_loop_time(step, state, batches, setup, cfg, args.steps, **kw)
            print(f"    {1000 * looped:7.1f} ms ({1000 * (looped - wall):+6.1f}) = {tokens / looped:,.0f} tokens/s: "
                  f"{what}", flush=True)
        if args.no_trace:
            return
        jax.profiler.start_trace(args.trace_dir)
        for _ in range(args.steps):
            state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        jax.profiler.stop_trace()
    if moe := {k: float(v) for k, v in m.items() if k.startswith("moe_")}:  # the last step's routing statistics
        print("moe, last step: " + ", ".join(f"{k.removeprefix('moe_')} {v:.4g}" for k, v in sorted(moe.items())))
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices()]
    if any(peaks):  # the allocator's high-water mark since start (not reported on CPU)
        print(f"peak device memory: {max(peaks) / 2**30:.2f} GiB (largest of {len(peaks)} local devices)")
    del state, batch  # free the step's memory for the replay
    summarize(args.trace_dir, args.steps, args.top, hlo, args.dump, args.replay)


if __name__ == "__main__":
    main()
