"""How long an async Orbax save blocks the training loop, by device-to-host path (prints a table).

    python3 benchmarks/bench_ckpt.py [--gb 7.2] [--arrays 40] [--rounds 3] [--paths standard,...] [--warm]

The state is `--arrays` float32 arrays of `--gb` GB in all, on the first device (a 0.6B-parameter model with AdamW
holds 7.2 GB). For each path, `--rounds` saves through a CheckpointManager with async saving; "blocked" is the time
spent inside `save()` (what mx_jax.checkpoint logs as "blocked the loop"), "total" includes the background write.
Paths:
  standard        StandardCheckpointHandler, as mx_jax uses it (Orbax's defaults: pinned-host transfer on GPU)
  pytree_pinned   PyTreeCheckpointHandler(enable_pinned_host_transfer=True)
  pytree_pageable PyTreeCheckpointHandler(enable_pinned_host_transfer=False)
and, for reference, the raw transfers: `jax.device_get` of the whole tree, and a device-side copy of it.
--warm first allocates, all at once, pinned host buffers the size of the state and frees them (timed; the allocator
keeps the memory): run it in a fresh process to see what the first save costs after it.
"""

from __future__ import annotations

import argparse
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


def make_state(gb: float, n: int) -> dict:
    per = int(gb * 1e9 / 4 / n)
    keys = jax.random.split(jax.random.key(0), n)
    state = {f"w{i:03d}": jax.random.normal(k, (per,), jnp.float32) for i, k in enumerate(keys)}
    jax.block_until_ready(state)
    return state


def warm_pinned(tree: dict) -> None:
    """Pinned host zeros shaped like `tree`'s shards, allocated together, then dropped."""

    def zeros(x):
        return jax.make_array_from_callback(
            x.shape, x.sharding.with_memory_kind("pinned_host"),
            lambda idx: np.zeros([len(range(*s.indices(n))) for s, n in zip(idx, x.shape)], x.dtype))

    buffers = [zeros(x) for x in jax.tree.leaves(tree)]
    jax.block_until_ready(buffers)
    del buffers


def handler(path: str):
    if path == "standard":
        return ocp.StandardCheckpointHandler(), ocp.args.StandardSave
    pinned = path == "pytree_pinned"
    return ocp.PyTreeCheckpointHandler(enable_pinned_host_transfer=pinned), ocp.args.PyTreeSave


def time_saves(path: str, state: dict, root: str, rounds: int) -> list[tuple[float, float]]:
    shutil.rmtree(root, ignore_errors=True)
    h, save_args = handler(path)
    mgr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True),
                                item_names=("state",), item_handlers={"state": h})
    out = []
    for r in range(rounds):
        t0 = time.perf_counter()
        mgr.save(r, args=ocp.args.Composite(state=save_args(state)))
        blocked = time.perf_counter() - t0
        mgr.wait_until_finished()
        out.append((blocked, time.perf_counter() - t0))
    mgr.close()
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=7.2)
    ap.add_argument("--arrays", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/bench_ckpt")
    ap.add_argument("--paths", default="standard,pytree_pinned,pytree_pageable")
    ap.add_argument("--warm", action="store_true")
    args = ap.parse_args()
    state = make_state(args.gb, args.arrays)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, orbax {ocp.__version__}: {args.arrays} float32 "
          f"arrays, {args.gb:.1f} GB", flush=True)
    if args.warm:
        t0 = time.perf_counter()
        warm_pinned(state)
        print(f"warm-up (pinned host buffers allocated and freed): {time.perf_counter() - t0:.2f} s", flush=True)
    rows = []
    for path in args.paths.split(","):
        res = time_saves(path, state, args.dir, args.rounds)
        rows.append((path, res))
        print(path, [f"{b:.2f}/{t:.2f}" for b, t in res], flush=True)
    ref = []
    for _ in range(2):
        fresh = jax.block_until_ready(jax.tree.map(lambda x: x + 1, state))  # a jax.Array caches its host copy
        t0 = time.perf_counter()
        host = jax.device_get(fresh)
        ref.append(time.perf_counter() - t0)
        del host
    t0 = time.perf_counter()
    copy = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    dev_copy = time.perf_counter() - t0
    t0 = time.perf_counter()
    copy = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    dev_copy = min(dev_copy, time.perf_counter() - t0)
    del copy
    print("\n| path | blocked s (rounds) | blocked GB/s (best) | total s (best) |\n|---|---|---|---|")
    for path, res in rows:
        b = [x[0] for x in res]
        print(f"| {path} | {' / '.join(f'{x:.2f}' for x in b)} | {args.gb / min(b):.1f} | {min(x[1] for x in res):.2f} |")
    print(f"| jax.device_get (reference) | {' / '.join(f'{x:.2f}' for x in ref)} | {args.gb / min(ref):.1f} | |")
    print(f"| device-side copy (reference) | {dev_copy:.3f} | {args.gb / dev_copy:.0f} | |")


if __name__ == "__main__":
    main()
