"""MoE dispatch + combine on the GPUs of one node: mx_jax's exchanges against lax.all_to_all, as a table.

    python benchmarks/bench_dispatch.py --sizes-mb 8 64 512        # all local GPUs on one `expert` axis
    python benchmarks/bench_dispatch.py --tune                      # the Pallas all-to-all's knobs at 64 MB
    torchrun --nproc_per_node=4 benchmarks/nccl_a2a_torch.py        # NCCL's all_to_all_single, the same sizes

Per GPU, `size` MB of bf16 rows (hidden 4096 -> 8 KiB a row) are sent to uniformly random devices (dispatch) and
returned (combine). Bus bandwidth follows nccl-tests' all-to-all convention: busbw = bytes per GPU x (P-1)/P / t
per direction, so dispatch+combine time t gives 2 x size x (P-1)/P / t.

Paths (each timed as --loop round trips inside one jit, divided by --loop; median of --reps):
  xla all_to_all       lax.all_to_all of equal chunks, no routing: the best non-custom JAX path, an upper bound
  pallas all_to_all    the same exchange with pallas_kernels.all_to_all (GPU only): each GPU writes its chunks
                       into the peers' outputs over NVLink; its last column says whether one exchange is bit-exact
                       against lax.all_to_all (and the round trip returns the input)
  dense exchange       mx_jax.dispatch.exchange "dense": rows packed per peer into a buffer bounded at
                       1.25 x rows/P (the capacity-factor path), moved by the NVLink kernel where it applies (only
                       the rows each peer is sent), else lax.all_to_all
  ragged exchange      mx_jax.dispatch.exchange "ragged": lax.ragged_all_to_all, exact sizes, worst-case buffer
Then the full dispatch_combine (flat vs hierarchical, P GPUs read as 2 nodes x P/2) for a top-k routing with an
identity expert, its cross-node/intra-node rows, and a check that every path returns x. Its exchanges: "land"
(flat only: each row written by the row kernel straight to its place in the expert device's sorted buffer, and
read back from there), "dense" (the NVLink kernel on the flat path's whole axis, sent rows only), "dense-xla" (the
same worst-case buffers, every row moved by lax.all_to_all: the best non-custom path) and "ragged".
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from mx_jax import dispatch
from pallas_kernels.all_to_all import A2AConfig, all_to_all


def timed(fn, *args, reps: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class IdentityExperts:
    """Stands in for ExpertFFN: returns each row unchanged (padding rows zero), so only the exchange is timed."""

    n_local: int
    scanned: bool = False
    align: int = 1

    def run(self, rows, local_expert, fan_out: int = 1, compact: int = 0):
        """ExpertFFN.run's contract: (outputs, overflow flag); one buffer here, so the flag is None."""
        return jnp.where((local_expert < self.n_local)[:, None], jnp.repeat(rows, fan_out, axis=0), 0), None

    params: tuple = ()
    operands: None = None

    def with_params(self, params, operands):
        return self

    def gate_up(self, xs, sizes, group_align):
        """ExpertFFN.gate_up's contract (the rows arrived sorted, with zeros past the data): the rows as "g"."""
        return xs, None

    def down(self, g, u, sizes, group_align):
        """ExpertFFN.down's contract: the experts' outputs, here the rows unchanged."""
        return g

    def split_for_keep(self, head, tail):
        """ExpertFFN.split_for_keep's contract: nothing to keep for the backward."""
        return None


def looped(f, loop: int):
    """`loop` round trips back to back inside one jit (a fori_loop): the host's per-call dispatch and sync, which
    CUDA-event timing (nccl_a2a_torch.py) does not see either, are paid once per `loop` round trips."""

    def g(x, *rest):
        return jax.lax.fori_loop(0, loop, lambda i, v: f(v, *rest), x)

    return g


def exchange_paths(mesh, n_dev: int, rows: int, hidden: int, reps: int, loop: int) -> dict[str, float]:
    spec = P("expert")
    rng = np.random.default_rng(0)
    x = jax.device_put(jnp.asarray(rng.standard_normal((n_dev * rows, hidden)), jnp.bfloat16),
                       NamedSharding(mesh, spec))
    dest = jax.device_put(jnp.asarray(rng.integers(0, n_dev, n_dev * rows), jnp.int32), NamedSharding(mesh, spec))
    group = dispatch.Group("expert", n_dev)
    out = {}

    def a2a(x):
        chunks = x.reshape(n_dev, rows // n_dev, hidden)
        there = jax.lax.all_to_all(chunks, "expert", 0, 0)
        return jax.lax.all_to_all(there, "expert", 0, 0).reshape(rows, hidden)

    def via(method, bound):
        def f(x, dest):
            recv, valid, back = dispatch.exchange({"x": x}, dest, group, method, bound=bound)
            return back(jnp.where(valid[:, None], recv["x"], 0))
        return f

    paths = {"xla all_to_all": a2a, "dense exchange": via("dense", int(1.25 * rows / n_dev) + 1)}
    if jax.default_backend() == "gpu":
        paths["ragged exchange"] = via("ragged", None)
        paths["pallas all_to_all"] = round_trip(n_dev, rows, hidden, "pallas")
    results = {}
    for name, f in paths.items():
        args = (x,) if name.endswith("all_to_all") else (x, dest)
        in_specs = (spec,) * len(args)
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False))
        g_loop = jax.jit(jax.shard_map(looped(f, loop), mesh=mesh, in_specs=in_specs, out_specs=spec,
                                       check_vma=False))
        try:
            out[name] = timed(g_loop, *args, reps=reps) / loop
            results[name] = g(*args)
        except Exception as e:  # report and go on: one failing lowering must not hide the other paths
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    if "ragged exchange" in results:  # both exchanges return every row to its sender: the input itself
        for name in ("dense exchange", "ragged exchange"):
            got = np.asarray(results[name].astype(jnp.float32))
            kept = np.abs(got).sum(1) > 0  # the dense path drops rows past its capacity bound
            np.testing.assert_array_equal(got[kept], np.asarray(x.astype(jnp.float32))[kept])
            out[f"{name} rows returned"] = float(kept.mean())
    if "pallas all_to_all" in results:
        exact = pallas_bit_exact(mesh, n_dev, rows, hidden, x, results["pallas all_to_all"])
        out["pallas all_to_all bit-exact"] = exact
    return out


def round_trip(n_dev: int, rows: int, hidden: int, impl: str, config: A2AConfig = A2AConfig()):
    """Like `a2a` in exchange_paths (there and back, one jit) through pallas_kernels.all_to_all."""

    def f(x):
        chunks = x.reshape(n_dev, rows // n_dev, hidden)
        there = all_to_all(chunks, "expert", impl=impl, config=config)
        return all_to_all(there, "expert", impl=impl, config=config).reshape(rows, hidden)

    return f


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)  # bf16 payload: compare bit patterns


def pallas_bit_exact(mesh, n_dev: int, rows: int, hidden: int, x, round_trip) -> bool:
    """One Pallas exchange equals lax.all_to_all bit for bit, and the timed round trip returned x."""
    spec = P("expert")

    def one_way(impl):
        f = lambda v: all_to_all(v.reshape(n_dev, rows // n_dev, hidden), "expert", impl=impl).reshape(rows, hidden)
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))(x)

    same = np.array_equal(_bits(one_way("pallas")), _bits(one_way("xla")))
    return bool(same and np.array_equal(_bits(round_trip), _bits(x)))


def tune(mesh, n_dev: int, hidden: int, reps: int, loop: int, mb: int = 64) -> None:
    """Sweep A2AConfig (CTAs, bytes per bulk copy, ring depth) at `mb` MB per GPU; one line per config."""
    rows = (mb * 2**20 // (hidden * 2)) // n_dev * n_dev
    spec = P("expert")
    x = jax.device_put(jnp.asarray(np.random.default_rng(2).standard_normal((n_dev * rows, hidden)), jnp.bfloat16),
                       NamedSharding(mesh, spec))
    size = rows * hidden * 2
    jitted = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    t_xla = timed(jitted(looped(round_trip(n_dev, rows, hidden, "xla"), loop)), x, reps=reps) / loop
    busbw = lambda t: 2 * size * (n_dev - 1) / n_dev / t / 1e9
    print(f"tune at {mb} MB/GPU, {n_dev} GPUs; xla all_to_all {1e3 * t_xla:.3f} ms, busbw {busbw(t_xla):.1f} GB/s")
    print(f"{'num_ctas':>9}{'tile KiB':>9}{'depth':>6}{'ms':>9}{'busbw GB/s':>12}  round trip")
    best = None
    for num_ctas in (66, None):
        for tile_kib in (8, 16, 32):
            for depth in (3, 4, 6, 8):
                try:
                    config = A2AConfig(num_ctas=num_ctas, tile_bytes=tile_kib * 1024, depth=depth)
                except ValueError:  # does not fit in shared memory
                    continue
                label = f"{num_ctas or 'SMs':>9}{tile_kib:>9}{depth:>6}"
                trip = round_trip(n_dev, rows, hidden, "pallas", config)
                g = jitted(trip)
                try:
                    t = timed(jitted(looped(trip, loop)), x, reps=reps) / loop
                    ok = np.array_equal(_bits(g(x)), _bits(x))
                except Exception as e:  # one config failing to compile must not stop the sweep
                    print(f"{label}  FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                print(f"{label}{1e3 * t:>9.3f}{busbw(t):>12.1f}  {'exact' if ok else 'MISMATCH'}", flush=True)
                if ok and (best is None or t < best[0]):
                    best = (t, config)
    if best is not None:
        print(f"best: {best[1]} {1e3 * best[0]:.3f} ms, busbw {busbw(best[0]):.1f} GB/s "
              f"({t_xla / best[0]:.2f}x xla all_to_all)")


def dispatch_paths(mesh, n_dev: int, tokens: int, hidden: int, n_experts: int, top_k: int, reps: int):
    spec = P("expert")
    rng = np.random.default_rng(1)
    x = jax.device_put(jnp.asarray(rng.standard_normal((n_dev * tokens, hidden)), jnp.bfloat16),
                       NamedSharding(mesh, spec))
    idx = np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_dev * tokens)]).astype(np.int32)
    idx = jax.device_put(jnp.asarray(idx), NamedSharding(mesh, spec))
    g = jnp.full((n_dev * tokens, top_k), 1.0 / top_k, jnp.float32)
    g = jax.device_put(g, NamedSharding(mesh, spec))
    experts = IdentityExperts(n_experts // n_dev)
    out = {}
    # (exchange, all_to_all impl): "dense" on the whole axis runs the NVLink kernel where it applies, which moves
    # only the rows each peer sent; "dense-xla" moves the same padded buffers, all of them, with lax.all_to_all.
    exchanges = [("land", "auto"), ("dense", "auto"), ("dense-xla", "xla"), ("ragged", "auto")] \
        if jax.default_backend() == "gpu" else [("land", "xla"), ("dense", "auto")]
    for method in ("flat", "hierarchical"):
        for how, impl in exchanges:
            if how == "land" and method != "flat":
                continue
            def f(x, idx, g):
                y, t = dispatch.dispatch_combine(x, idx, g, jnp.ones(idx.shape, bool), experts, axis="expert",
                                                 method=method, gpus_per_node=max(1, n_dev // 2),
                                                 exchange_method=how.split("-")[0], a2a_impl=impl)
                return y, {k: jax.lax.psum(v, "expert") for k, v in t.items()}

            fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, P()), check_vma=False))
            try:
                y, traffic = fn(x, idx, g)
                # identity experts with weights summing to 1: the combine returns x
                np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(x, np.float32), rtol=2e-2,
                                           atol=2e-2)
                out[(method, how)] = (timed(fn, x, idx, g, reps=reps), int(traffic["rows_cross_node"]),
                                      int(traffic["rows_intra_node"]))
            except Exception as e:
                print(f"dispatch_combine {method}/{how}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--loop", type=int, default=10, help="round trips per timed call, inside one jit (see `looped`)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per GPU for the dispatch_combine comparison")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tune", action="store_true", help="only sweep the Pallas all-to-all's knobs at 64 MB per GPU")
    args = ap.parse_args()
    devices = jax.devices()
    n_dev = len(devices)
    mesh = jax.make_mesh((n_dev,), ("expert",), axis_types=(AxisType.Auto,))
    print(f"{n_dev} x {devices[0].device_kind}, jax {jax.__version__}", flush=True)
    if args.tune:
        if jax.default_backend() != "gpu":
            raise SystemExit("--tune times the Pallas NVLink kernel: run it on a multi-GPU node")
        tune(mesh, n_dev, args.hidden, args.reps, args.loop)
        return
    rows_bytes = args.hidden * 2
    table = []
    for mb in args.sizes_mb:
        rows = (mb * 2**20 // rows_bytes) // n_dev * n_dev
        t = exchange_paths(mesh, n_dev, rows, args.hidden, args.reps, args.loop)
        size = rows * rows_bytes
        for name in ("xla all_to_all", "pallas all_to_all", "dense exchange", "ragged exchange"):
            if name in t:
                busbw = 2 * size * (n_dev - 1) / n_dev / t[name] / 1e9
                if f"{name} bit-exact" in t:
                    note = "bit-exact" if t[f"{name} bit-exact"] else "MISMATCH"
                elif f"{name} rows returned" in t:
                    note = f"{100 * t[f'{name} rows returned']:.1f}% rows returned"
                else:
                    note = ""
                table.append((mb, name, 1e3 * t[name], busbw, note))
                print(table[-1], flush=True)
    d = dispatch_paths(mesh, n_dev, args.tokens, args.hidden, args.experts, args.top_k, args.reps)
    print(f"\ndispatch+combine bus bandwidth per GPU, {n_dev} GPUs, bf16 rows of {args.hidden}")
    print(f"{'MB/GPU':>7}  {'path':<18}{'ms':>9}{'busbw GB/s':>12}  check")
    for mb, name, ms, bw, note in table:
        print(f"{mb:>7}  {name:<18}{ms:>9.3f}{bw:>12.1f}  {note}")
    print(f"\ndispatch_combine, {args.tokens} tokens/GPU, top-{args.top_k} of {args.experts} experts, "
          f"{n_dev} GPUs as 2 nodes x {max(1, n_dev // 2)}, identity experts")
    print(f"{'method':<14}{'exchange':<11}{'ms':>9}{'cross-node rows':>17}{'intra-node rows':>17}")
    for (method, how), (sec, cross, intra) in d.items():
        print(f"{method:<14}{how:<11}{1e3 * sec:>9.3f}{cross:>17,}{intra:>17,}")


if __name__ == "__main__":
    main()
