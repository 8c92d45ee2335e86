"""The MoE dispatch's row kernels (pallas_kernels/row_exchange.py) on the GPUs of one node, as a table.

    python benchmarks/bench_row_exchange.py                          # DeepSeekMoE's shape: 8,192 tokens, top-6 of 64
    python benchmarks/bench_row_exchange.py --experts 8 --top-k 2 --hidden 4096    # Mixtral's

Per GPU, `--tokens` tokens of `--hidden` bf16 routed top-k over `--experts` experts at random, the plan of
mx_jax.dispatch.landing (worst-case sorted buffers, as the flat dispatch sizes them). Timed, each inside one jit
and as the median of --reps calls of --loop back-to-back runs:
  push             dispatch.land: every (token, expert) row written to its place in the expert device's buffer,
                   the rest of that buffer zeroed
  pull             dispatch.fetch: every row read back home
  dense exchange   dispatch.exchange "dense" of the same rows, one way: the send buffers packed by a gather and
                   moved by the NVLink all-to-all kernel, then sorted by expert as ExpertFFN sorts them (what
                   "land" replaces)
for each value of --stores (row_exchange.STORES_IN_FLIGHT: stores a CTA leaves in flight), after a check that push
and pull equal the XLA reference bit for bit there. GB/s counts the rows that move (to peers and local): n k x
hidden x 2 bytes per GPU / t.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from mx_jax import dispatch
from pallas_kernels import row_exchange


def timed(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paths(mesh, n_dev, tokens, hidden, n_experts, k, loop):
    e_l = n_experts // n_dev
    rows = dispatch._room(n_dev * dispatch.peer_bound(tokens, k, e_l), e_l, 1)

    def plan_of(idx):
        return dispatch.landing(idx, "expert", e_l, 1, rows, hidden * 2)

    def chained(step):
        """`loop` runs of step(v) -> array, each fed by the last: v's first element moves by the result's (an
        in-place update of the carried array), so XLA can neither hoist nor drop a run."""
        def run(v):
            def body(i, carry):
                v, acc = carry
                v = v.at[0, 0].add(acc)
                return v, step(v)[0, 0].astype(v.dtype) * 0
            return jax.lax.fori_loop(0, loop, body, (v, jnp.zeros((), v.dtype)))[1][None]
        return run

    def push(x, idx):
        plan = plan_of(idx)
        return chained(lambda v: dispatch.land(v, plan, "expert"))(x)

    def pull(x, idx):
        plan = plan_of(idx)
        return chained(lambda v: dispatch.fetch(v, plan, "expert"))(dispatch.land(x, plan, "expert"))

    def dense(x, idx):
        flat = idx.reshape(-1)

        def one(v):
            recv, valid, _ = dispatch.exchange({"x": v, "e": flat % e_l}, flat // e_l,
                                               dispatch.Group("expert", n_dev), "dense",
                                               bound=dispatch.peer_bound(tokens, k, e_l))
            return dispatch.take_rows(recv["x"], jnp.argsort(jnp.where(valid, recv["e"], e_l), stable=True),
                                      jnp.zeros((recv["x"].shape[0], 1), jnp.int32))

        return chained(one)(x)

    def exact(x, idx):  # the kernels against the XLA reference, bit for bit (impl "auto" = the kernel on a GPU)
        plan = plan_of(idx)
        buf = row_exchange.move(x, plan.out, rows, "push", "expert", impl="auto")
        ref = row_exchange.move(x, plan.out, rows, "push", "expert", impl="xla")
        back = row_exchange.move(buf, plan.back, tokens * k, "pull", "expert", impl="auto")
        back_ref = row_exchange.move(buf, plan.back, tokens * k, "pull", "expert", impl="xla")
        same = jnp.all(jax.lax.bitcast_convert_type(buf, jnp.int16) == jax.lax.bitcast_convert_type(ref, jnp.int16))
        same &= jnp.all(jax.lax.bitcast_convert_type(back, jnp.int16)
                        == jax.lax.bitcast_convert_type(back_ref, jnp.int16))
        return same[None]

    spec = P("expert")
    return {name: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False))
            for name, f in (("push", push), ("pull", pull), ("dense exchange", dense), ("exact", exact))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--loop", type=int, default=10)
    ap.add_argument("--stores", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    devices = jax.devices()
    n_dev = len(devices)
    mesh = jax.make_mesh((n_dev,), ("expert",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    spec = NamedSharding(mesh, P("expert"))
    x = jax.device_put(jnp.asarray(rng.standard_normal((n_dev * args.tokens, args.hidden)), jnp.bfloat16), spec)
    idx = np.stack([rng.choice(args.experts, args.top_k, replace=False) for _ in range(n_dev * args.tokens)])
    idx = jax.device_put(jnp.asarray(idx, jnp.int32), spec)
    moved = args.tokens * args.top_k * args.hidden * 2
    print(f"{n_dev} x {devices[0].device_kind}, jax {jax.__version__}; {args.tokens} tokens/GPU, top-{args.top_k} "
          f"of {args.experts}, hidden {args.hidden}: {moved / 1e6:.0f} MB of rows per GPU each way", flush=True)
    print(f"{'stores':>7}  {'path':<16}{'ms':>9}{'GB/s':>9}")
    for s in args.stores:
        row_exchange.STORES_IN_FLIGHT = s
        fns = paths(mesh, n_dev, args.tokens, args.hidden, args.experts, args.top_k, args.loop)
        same = bool(np.all(np.asarray(fns.pop("exact")(x, idx))))
        print(f"{s:>7}  push and pull bit-exact against the XLA reference: {same}", flush=True)
        for name, fn in fns.items():
            if name == "dense exchange" and s != args.stores[0]:
                continue
            try:
                t = timed(fn, x, idx, reps=args.reps) / args.loop
                print(f"{s if name != 'dense exchange' else '-':>7}  {name:<16}{1e3 * t:>9.3f}{moved / t / 1e9:>9.1f}",
                      flush=True)
            except Exception as e:  # one failing path must not stop the table
                print(f"{s:>7}  {name:<16}FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
