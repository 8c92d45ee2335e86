"""Training throughput of `python -m mx_jax.train` variants, one subprocess each, as a table.

    python benchmarks/bench_train.py --steps 20 \\
        --base "--config configs/llama3_8b.yaml model.n_layers=8 data.seq_len=8192 data.batch_size=1" \\
        --variant bf16: --variant fp8_rowwise:quant.recipe=fp8_rowwise \\
        --variant bf16_no_triton_gemm:@--xla_gpu_enable_triton_gemm=false

A variant is NAME:OVERRIDES, where OVERRIDES are space-separated key=value pairs for the trainer and items starting
with @ are added to XLA_FLAGS for that run; +NAME=VALUE sets an environment variable for it
(`+PYTHONPATH=/tmp/old_tree` runs the mx_jax found there: the trainer starts with `python -P`, so the working
directory does not shadow PYTHONPATH, and this checkout comes after it); %N runs it as N processes of one GPU each
(`launch/local.sh N --gpus-per-process 1`, this checkout's mx_jax; process 1..N-1's output goes to OUT/NAME_procs).
Every run uses the embedded corpus unless the base says otherwise, the configured run's learning-rate schedule (its
first steps, not a warmup squeezed into --steps), an empty compile cache (so the first step is a whole compile; a
variant's `compile_cache=DIR` shares one on purpose), no checkpoints, no evaluation, and reports the mean of the
logged intervals after the first (compile) step: tokens/s, TFLOP/s per device, MFU, peak memory, and the first
step's wall time (compile included).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_trainer(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run the trainer in its own process group, and kill that group if this script stops first (SIGTERM from a
    `timeout`, Ctrl-C): an orphaned trainer, or its data-loader process, would hold its GPUs' memory and make the
    next run fail out of memory."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate()
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def configured_schedule(base: list[str], keys: list[str]) -> list[str]:
    """The configured run's learning-rate schedule for the benchmark's few steps: `steps=N` alone makes them the
    whole run (optim.decay_steps 0 means the run's steps), with the warmup squeezed into them. A fresh MoE router
    trained so, at the peak learning rate by step 10, routes less evenly step by step than a real run's first steps
    (benchmarks/RESULTS.md, session 51), and expert parallelism waits on its busiest device. Nothing where the base
    or the variant sets optim.decay_steps, or where the trainer will reject the config anyway."""
    from mx_jax.config import ConfigError, load_config

    if any(i.startswith("optim.decay_steps=") for i in (*base, *keys)):
        return []
    config = base[base.index("--config") + 1] if "--config" in base[:-1] else None
    overrides = [i for i in (*base, *keys) if "=" in i and not i.startswith("-")]
    try:
        cfg = load_config(str(ROOT / config) if config else None, overrides)
    except (ConfigError, OSError):
        return []
    return [f"optim.decay_steps={cfg.optim.decay_steps or cfg.steps}"]


def run_variant(name: str, base: list[str], overrides: str, steps: int, log_every: int, out_dir: pathlib.Path):
    items = shlex.split(overrides)
    xla = [i[1:] for i in items if i.startswith("@")]
    env_vars = dict(i[1:].split("=", 1) for i in items if i.startswith("+"))
    procs = [int(i[1:]) for i in items if i.startswith("%")]
    keys = [i for i in items if not i.startswith(("@", "+", "%"))]
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix=f"bench_{name}_"))
    # The embedded corpus unless the base or the variant names a source (a config's own `data.source: bin` would
    # need shards on the benchmark machine).
    source = [] if any(i.startswith("data.source=") for i in (*base, *keys)) else ["data.source=embedded"]
    launcher = [sys.executable, "-P", "-m", "mx_jax.train"]
    if procs:
        launcher = ["bash", "launch/local.sh", str(procs[-1]), "--gpus-per-process", "1"]
        env_vars = {"MX_JAX_LOG_DIR": str(out_dir / f"{name}_procs"), "PYTHON": sys.executable, **env_vars}
    cmd = [*launcher, *base, *source, *configured_schedule([*base, *source], keys), f"run_dir={run_dir}",
           f"steps={steps}", "ckpt.every_steps=-1", "log.eval_every_steps=-1", f"log.every_steps={log_every}",
           "log.progress=false", "log.tensorboard=false", *keys]
    # An empty compile cache of its own (the trainer's compile_cache=auto reads the variable; older trees' jax does
    # too), so that the first step is a whole compile in every run; removed after the run.
    cache = run_dir / "jax_cache"
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), **env_vars,
           "XLA_FLAGS": " ".join([os.environ.get("XLA_FLAGS", ""), *xla]).strip()}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    t0 = time.time()
    p = run_trainer(cmd, env)
    wall = time.time() - t0
    shutil.rmtree(cache, ignore_errors=True)
    (out_dir / f"{name}.log").write_text(" ".join(cmd) + "\n\n" + p.stdout + "\n" + p.stderr)
    if p.returncode != 0:
        return {"name": name, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:160], "wall_s": wall}
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r.get("tokens_per_sec")]
    if not logged:
        return {"name": name, "error": f"no step was logged: --steps {steps} must reach --log-every {log_every}",
                "wall_s": wall}
    timed = logged[1:] or logged
    first = next((l for l in p.stdout.splitlines() if "first step (compile included)" in l), "")
    mean = lambda k: sum(r[k] for r in timed) / len(timed) if timed and timed[0].get(k) is not None else None
    return {"name": name, "tokens_per_sec": mean("tokens_per_sec"), "tflops_per_device": mean("tflops_per_device"),
            "mfu": mean("mfu"), "peak_mem_gib": max((r.get("peak_mem_gib") or 0) for r in records),
            "first_step_s": float(first.split("took")[1].split("s")[0]) if first else None,
            "loss": records[-1]["loss"], "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="trainer arguments shared by every variant")
    ap.add_argument("--variant", action="append", required=True, help="NAME:OVERRIDES (see module docstring)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"), help="where each variant's log is written")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # unwinds through run_trainer's cleanup
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = shlex.split(args.base)
    rows = []
    for v in args.variant:
        name, _, overrides = v.partition(":")
        row = run_variant(name, base, overrides, args.steps, args.log_every, out)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nbase: {args.base}\n")
    print(f"{'variant':<28}{'tok/s':>10}{'TFLOP/s/dev':>13}{'MFU':>7}{'peak GiB':>10}{'1st step s':>12}{'loss':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<28} FAILED: {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"{r['name']:<28}{r['tokens_per_sec']:>10,.0f}{r['tflops_per_device']:>13.1f}{mfu:>7}"
              f"{r['peak_mem_gib']:>10.1f}{r['first_step_s'] or 0:>12.1f}{r['loss']:>8.3f}")


if __name__ == "__main__":
    main()
