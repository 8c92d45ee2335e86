"""Where a step's device time goes: a jax.profiler trace of a few steps, summed per XLA op and per category.

The trainer traces steps `log.profile_from` .. `log.profile_from + log.profile_steps - 1` into
run_dir/profile/process_<i> (open it with TensorBoard's profile plugin, XProf or Perfetto) and logs the summary
`summarize` prints; `benchmarks/profile_step.py` adds the per-GEMM TFLOP/s table and a replay of each GEMM.

Device time per op is read from the trace's device planes: the "XLA Ops" line where the trace has one (GPU),
else the kernels of every stream. A CPU trace has no device plane, so there is nothing to sum on CPU. `overlap`
reads the same events' start times: how long any op ran, and how long a collective ran with no other op beside it
(communication that nothing hid; a busy time well below the step's wall time means the line missed kernels).
"""

from __future__ import annotations

import collections
import glob
import pathlib

# First match wins. Pallas kernels (fp8/MX GEMMs, grouped GEMMs, casts, the NVLink all-to-all) trace as
# "<kernel_name>_mosaic_gpu_kernel" (fp8_matmul, gmm, tgmm, quantize_amax, quantize_cast, mx_matmul,
# mx_quantize_<variant>, all_to_all), so they get their own category and, per op, their own rows; cuBLAS's Hopper
# GEMMs are the "nvjet_*" kernels.
CATEGORIES = (
    ("attention", ("cudnn", "fmha", "flash", "attention")),
    ("pallas kernels", ("mosaic",)),
    ("gemm", ("gemm", "cublas", "nvjet", "cutlass", "xmma", "matmul", "dot", "wgmma", "custom-call")),
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


def latest_trace(trace_dir: str | pathlib.Path):
    """The newest trace under trace_dir as jax.profiler.ProfileData, or None if there is none."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    return ProfileData.from_file(paths[-1]) if paths else None


def device_time(data) -> tuple[collections.Counter, collections.Counter, int]:
    """(ms per op name, calls per op name, number of device planes), summed over the trace's device planes."""
    per_op: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    planes = device_events(data)
    for events in planes:
        for ev in events:
            per_op[ev.name] += ev.duration_ns / 1e6
            counts[ev.name] += 1
    return per_op, counts, len(planes)


def device_events(data) -> list[list]:
    """Each device plane's events: those of its "XLA Ops" line where it has one, else of every stream."""
    out = []
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            lines = {line.name: line for line in plane.lines}
            chosen = [lines["XLA Ops"]] if "XLA Ops" in lines else [l for n, l in lines.items() if "Stream" in n]
            out.append([ev for line in chosen for ev in line.events])
    return out


def _op_name(ev) -> str:
    """The XLA instruction an event ran for (a kernel's `hlo_op` stat), else the event's own name."""
    stats = dict(ev.stats) if getattr(ev, "stats", None) else {}
    return str(stats.get("hlo_op") or ev.name)


def overlap(data) -> tuple[float, float, int, collections.Counter]:
    """(ms during which any op ran, ms during which a collective ran and no other op did, number of device planes,
    that unhidden ms per collective instruction), summed over the device planes: the second is the communication
    that nothing hid, and the last says which collectives it was (time when several ran together is split evenly
    between them). Ops are the same events `device_time` sums; overlapping ops count once."""
    busy = alone = 0.0
    by_op: collections.Counter = collections.Counter()
    planes = device_events(data)
    for events in planes:
        edges = []  # (time, +1 start / -1 end, collective instruction or None)
        for ev in events:
            coll = _op_name(ev) if category(ev.name) == "collective" else None
            edges += [(ev.start_ns, 1, coll), (ev.start_ns + ev.duration_ns, -1, coll)]
        edges.sort(key=lambda e: (e[0], e[1]))  # at equal times, ends first
        colls: collections.Counter = collections.Counter()  # the collectives running
        others = 0
        last = None
        for t, step, coll in edges:
            if last is not None and t > last:
                ms, n_coll = (t - last) / 1e6, sum(colls.values())
                if n_coll or others:
                    busy += ms
                if n_coll and not others:
                    alone += ms
                    for name, k in colls.items():
                        by_op[name] += ms * k / n_coll
            if coll is None:
                others += step
            else:
                colls[coll] += step
                if not colls[coll]:
                    del colls[coll]
            last = t
    return busy, alone, len(planes), by_op


def idle_gaps(events) -> tuple[float, float, collections.Counter]:
    """One device's (span, idle, idle by op) in ms: from its first event's start to its last one's end; the time in
    that span with no event running; and that idle time by the event that ended each gap (its name up to "(")."""
    events = sorted(events, key=lambda ev: ev.start_ns)
    if not events:
        return 0.0, 0.0, collections.Counter()
    before: collections.Counter = collections.Counter()
    idle, end = 0, events[0].start_ns + events[0].duration_ns
    for ev in events[1:]:
        if ev.start_ns > end:
            idle += ev.start_ns - end
            before[ev.name.split("(")[0][:60]] += (ev.start_ns - end) / 1e6
        end = max(end, ev.start_ns + ev.duration_ns)
    return (end - events[0].start_ns) / 1e6, idle / 1e6, before


def summarize(data, n_steps: int, top: int) -> list[str]:
    """Lines: device time per step and device, by category, the busy and unhidden-communication times (`overlap`),
    the idle time between ops and the ops it came before (`idle_gaps`), then the `top` longest ops."""
    per_op, counts, n_dev = device_time(data)
    if not n_dev:
        return ["no device plane in the trace (a CPU run): no per-op device time to sum"]
    n = n_steps * n_dev  # per step and per device
    total = sum(per_op.values())
    by_cat: collections.Counter = collections.Counter()
    for name, ms in per_op.items():
        by_cat[category(name)] += ms
    out = [f"device time per step and device: {total / n:.1f} ms (sum over ops, {n_steps} steps traced on {n_dev} "
           f"device(s))"]
    out += [f"  {cat:<16}{ms / n:9.2f} ms  {100 * ms / total:5.1f}%" for cat, ms in by_cat.most_common()]
    busy, alone, _, by_op = overlap(data)
    out.append(f"  busy {busy / n:.1f} ms per step and device (any op running; overlaps counted once), of which "
               f"{alone / n:.1f} ms collectives with no other op running (communication nothing hid)")
    if by_op:
        top_ops = by_op.most_common(6)
        out.append("  unhidden by collective: " + ", ".join(f"{name} {ms / n:.1f}" for name, ms in top_ops))
    span = idle = 0.0
    before: collections.Counter = collections.Counter()
    for events in device_events(data):
        s, i, b = idle_gaps(events)
        span, idle = span + s, idle + i
        before.update(b)
    out.append(f"  idle {idle / n:.1f} ms per step and device with no op running, of a {span / n:.1f} ms span from "
               f"the first op to the last (the device waiting on the host or on another device)")
    if before:
        out.append("  idle before: " + ", ".join(f"{name} {ms / n:.1f}" for name, ms in before.most_common(6)))
    if top:
        out.append(f"top {top} ops (ms per step, calls per step):")
        out += [f"  {ms / n:8.2f}  {counts[name] // n:4d}x  {category(name):<14} {name[:110]}"
                for name, ms in per_op.most_common(top)]
    return out
