"""`python -m mx_jax.train` as a user runs it: outputs on disk, progress, NaN stop."""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from tests.helpers import TINY, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(args, devices=2, timeout=300):
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices),
           "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "mx_jax.train", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def test_train_writes_run_directory(tmp_path):
    args = [a for a in TINY if not a.startswith(("log.tensorboard", "log.progress"))]
    p = _run([*args, f"run_dir={tmp_path}", "steps=4", "log.every_steps=2", "log.eval_every_steps=4",
              "ckpt.every_steps=2"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "config.yaml").is_file()
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for key in ("step", "loss", "tokens_per_sec", "tflops_per_device", "mfu", "grad_norm", "lr"):
        assert key in records[-1], key
    assert "eval_loss" in records[-1] and "eval_loss" not in records[0]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    out = p.stdout
    assert "first step (compile included)" in out and "committed: blocked" in out
    assert "step/s" in p.stderr + out or "it/s" in p.stderr + out or "s/step" in p.stderr + out  # tqdm bar


def test_nan_loss_stops_and_names_the_step(tmp_path):
    p = _run([*TINY, f"run_dir={tmp_path}", "steps=30", "optim.lr_peak=1e6", "optim.warmup_steps=0",
              "optim.grad_clip_norm=0", "ckpt.every_steps=0"])
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    stop = r"error: (loss|grad norm) is (nan|-?inf) at step \d+: stopping \(no checkpoint written"
    assert re.search(stop, p.stderr), p.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists() or not any(
        n.isdigit() for n in os.listdir(tmp_path / "checkpoints"))


def test_metrics_jsonl_stays_json_and_drops_replayed_steps(tmp_path):
    from mx_jax import metrics

    w = metrics.MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        w.write(step, {"loss": float("nan") if step == 3 else 1.0 / step, "mfu": None})
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 0.')  # torn by a kill
    strict = lambda x: (_ for _ in ()).throw(ValueError(x))  # noqa: E731 -- NaN / Infinity are not JSON
    records = [json.loads(l, parse_constant=strict) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()[:3]]
    assert records[2] == {"step": 3, "loss": None, "mfu": None}
    w = metrics.MetricsWriter(tmp_path, tensorboard=False, resumed_at=2)  # the run resumes from step 2's checkpoint
    w.write(3, {"loss": 0.3})
    w.close()
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


class _FakeWandb:
    """Stands in for the wandb module: records init's arguments and every log call."""

    def __init__(self, fail: Exception | None = None):
        self.inits, self.logs, self.finished, self.fail = [], [], 0, fail

    def init(self, **kw):
        if self.fail:
            raise self.fail
        self.inits.append(kw)
        fake = self

        class Run:
            id = kw["id"] or "abc123"  # W&B makes an id where none is given

            def log(self, values, step):
                fake.logs.append((step, values))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_gets_the_scalars_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    from mx_jax import metrics
    from mx_jax.config import ConfigError

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    w = metrics.MetricsWriter(tmp_path, tensorboard=False, wandb="proj", config={"steps": 3})
    w.write(1, {"loss": 2.5, "mfu": None, "grad_norm": float("inf"), "expert_load": [0.75, 0.25]})
    w.close()
    assert fake.inits == [{"project": "proj", "name": tmp_path.name, "id": None, "resume": "allow",
                           "dir": str(tmp_path), "config": {"steps": 3}}]
    assert fake.logs == [(1, {"loss": 2.5, "expert_load/0": 0.75, "expert_load/1": 0.25})] and fake.finished == 1
    assert (tmp_path / "wandb_id").read_text() == "abc123\n"
    metrics.MetricsWriter(tmp_path, tensorboard=False, resumed_at=1, wandb="proj").close()  # a resumed run
    assert fake.inits[-1]["id"] == "abc123"
    monkeypatch.setitem(sys.modules, "wandb", _FakeWandb(fail=RuntimeError("api_key not configured")))
    with pytest.raises(ConfigError, match=r"log.wandb': W&B did not start the run \(RuntimeError: api_key not "
                                          r"configured\); log in with `wandb login`.*WANDB_MODE=offline"):
        metrics.MetricsWriter(tmp_path / "new", tensorboard=False, wandb="proj")


def test_wandb_offline_run_and_a_missing_package(tmp_path, monkeypatch, capsys):
    import jax

    from mx_jax import train
    from tests.helpers import NO_EVAL, tiny_config

    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train.train(tiny_config(tmp_path / "run", "steps=2", "mesh.data=1", "mesh.fsdp=1", NO_EVAL, "ckpt.every_steps=-1",
                            "log.wandb=mx-jax-test"), devices=jax.devices()[:1])
    run_id = (tmp_path / "run" / "wandb_id").read_text().strip()
    assert list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: an error before anything is written
    assert train.main([*TINY, f"run_dir={tmp_path / 'none'}", "log.wandb=proj"]) == 2
    assert "needs the `wandb` package" in capsys.readouterr().err and not (tmp_path / "none").exists()


def test_batch_wait_is_measured_and_a_slow_loader_warned(tmp_path, monkeypatch, capsys):
    import time

    from mx_jax import data, train
    from tests.helpers import NO_IO, tiny_config

    fast = train.train(tiny_config(tmp_path / "fast", "steps=4", "log.every_steps=2", *NO_IO))
    assert 0 <= fast.metrics["data_ms"] < 1000 * fast.metrics["step_time_s"]
    # The tiny CPU step is ~20 ms, so on a loaded machine the wait for a batch can cross the tenth: the warning must
    # then appear exactly when a logged step crossed it.
    logged = [json.loads(l) for l in (tmp_path / "fast" / "metrics.jsonl").read_text().splitlines()]
    crossed = any(r["data_ms"] >= 100 * r["step_time_s"] for r in logged if "data_ms" in r)
    assert ("the loop waited" in capsys.readouterr().out) == crossed
    # Batches built in the loop instead of by the prefetch thread: the same batches, so the same losses.
    inline = train.train(tiny_config(tmp_path / "inline", "steps=4", "log.every_steps=2", "data.prefetch=0", *NO_IO))
    assert inline.metrics["loss"] == fast.metrics["loss"]
    slow_next = data.Batches.next_global

    def slow(self, *args, **kwargs):
        time.sleep(0.6)
        return slow_next(self, *args, **kwargs)

    monkeypatch.setattr(data.Batches, "next_global", slow)
    slow_run = train.train(tiny_config(tmp_path / "slow", "steps=10", "log.every_steps=2", *NO_IO))
    # The thread builds a few batches ahead while the first step compiles; once they are used up, each step waits
    # for the next batch's 600 ms less the step's own time (~20 ms, ~100 ms on a loaded 2-core machine).
    assert slow_run.metrics["data_ms"] >= 300
    out = capsys.readouterr().out
    assert out.count("the loop waited") == 1 and "on process 0 (data.prefetch=2): batches are built slower" in out
    records = [json.loads(l) for l in (tmp_path / "slow" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["data_ms"] >= 300 for r in records if r["step"] >= 8)
    # Each window holds the waits it counts: no step takes less than the wait for its batch (the last window too,
    # which ends at the run's last step with no log edge after it).
    assert all(1000 * r["step_time_s"] >= r["data_ms"] for r in records if "data_ms" in r)


def test_deterministic_adds_xlas_flag_once_and_refuses_a_contradiction(monkeypatch):
    from mx_jax import train
    from mx_jax.config import ConfigError

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/dump")
    monkeypatch.delenv(train.ALLOCATOR_VAR, raising=False)  # restored after: the call sets the default
    train.apply_default_xla_flags(deterministic=False)
    assert "deterministic" not in os.environ["XLA_FLAGS"]
    for _ in range(2):
        train.apply_default_xla_flags(deterministic=True)
    flags = os.environ["XLA_FLAGS"].split()
    assert flags.count("--xla_gpu_deterministic_ops=true") == 1 and "--xla_dump_to=/tmp/dump" in flags
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    with pytest.raises(ConfigError, match="'deterministic'.*--xla_gpu_deterministic_ops=false"):
        train.apply_default_xla_flags(deterministic=True)


def test_the_trainer_uses_cudas_stream_ordered_allocator_unless_told(monkeypatch):
    """XLA's BFC allocator failed the whole DeepSeekMoE 16B on fragmentation; the trainer picks cuda_async unless the
    environment chose an allocator."""
    from mx_jax import train

    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delenv(train.ALLOCATOR_VAR, raising=False)
    train.apply_default_xla_flags()
    assert os.environ[train.ALLOCATOR_VAR] == "cuda_async"
    monkeypatch.setenv(train.ALLOCATOR_VAR, "bfc")
    train.apply_default_xla_flags()
    assert os.environ[train.ALLOCATOR_VAR] == "bfc"


def test_out_of_device_memory_stops_with_what_to_do(monkeypatch, capsys):
    """An XLA out-of-memory error from the run ends with exit code 5 and a message naming the failed allocation, the
    allocator that avoids fragmentation (where the user chose XLA's BFC instead) and the config keys that need less
    memory; any other XLA runtime error is raised as it was."""
    import jax

    from mx_jax import train

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored after: main() sets the defaults
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    errors = []

    def train_fails(cfg):
        raise errors[-1]

    monkeypatch.setattr(train, "train", train_fails)
    oom = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 30.51GiB with allocator GPU_0_bfc on device "
           "0. [executable_name='jit_train_step']")
    args = ["--config", str(ROOT / "configs" / "llama3_debug.yaml")]
    for allocator, hint in [("bfc", True), ("", False), ("cuda_async", False)]:
        monkeypatch.setenv(train.ALLOCATOR_VAR, allocator)
        errors.append(jax.errors.JaxRuntimeError(oom))
        assert train.main(args) == 5
        err = capsys.readouterr().err
        assert "out of device memory allocating 30.51GiB" in err and "data.grad_accum_steps" in err
        assert f"({oom[:60]}" in err
        assert ("XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async avoids" in err) == hint
        assert os.environ[train.ALLOCATOR_VAR] == (allocator or "cuda_async")  # main() set the default
    # Out of memory while XLA autotunes (seen on an H200): the allocation is on a later line, and that is quoted.
    autotune = ("RESOURCE_EXHAUSTED: Failed to get configs for: 8 out of 109 instructions. See logs for all failures. "
                "Example failure: \nFailures (7):\nEXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory while trying "
                "to allocate 256.02GiB with allocator gpu_async_0 on device 0.\n=== Source Location Trace: === ")
    errors.append(jax.errors.JaxRuntimeError(autotune))
    assert train.main(args) == 5
    err = capsys.readouterr().err
    assert "allocating 256.02GiB (EXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory while trying to allocate" in err
    errors.append(jax.errors.JaxRuntimeError("INTERNAL: an unrelated failure"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="unrelated"):
        train.main(args)


def test_compile_cache_dir_follows_the_config_then_the_environment(monkeypatch, tmp_path):
    from mx_jax import train
    from mx_jax.config import ConfigError

    monkeypatch.setenv(train.COMPILE_CACHE_VAR, "/scratch/jax")
    assert train.compile_cache_dir("auto") == "/scratch/jax"
    monkeypatch.delenv(train.COMPILE_CACHE_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert train.compile_cache_dir("auto") == "/xdg/mx_jax/jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/u")
    assert train.compile_cache_dir("auto") == "/home/u/.cache/mx_jax/jax"
    assert train.compile_cache_dir("~/c") == "/home/u/c"
    assert train.compile_cache_dir("") is None
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="config key 'compile_cache'.*a_file/jax"):
        train.use_compile_cache(str(tmp_path / "a_file" / "jax"))  # fails before it changes jax's setting


def test_the_cache_keeps_each_version_of_the_code_apart(tmp_path):
    """Programs go to a subdirectory named by a digest of the Python sources of mx_jax and pallas_kernels: an edit to
    either changes it, other files do not (jax's key leaves out what custom_partitioning callbacks do)."""
    import jax

    from mx_jax import train

    for package, name in (("mx_jax", "a.py"), ("pallas_kernels", "b.py")):
        (tmp_path / package / "sub").mkdir(parents=True)
        (tmp_path / package / "sub" / name).write_text("x = 1\n")
    first = train.source_digest(tmp_path)
    (tmp_path / "mx_jax" / "notes.md").write_text("not code")
    (tmp_path / "README.py").write_text("outside the packages")
    assert train.source_digest(tmp_path) == first
    (tmp_path / "pallas_kernels" / "sub" / "b.py").write_text("x = 2\n")
    assert train.source_digest(tmp_path) != first
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_remove_custom_partitioning_ptr_from_cache_key
    try:
        assert train.use_compile_cache(str(tmp_path / "c")) == f"{tmp_path / 'c'}/code-{train.code_digest()}"
        assert jax.config.jax_remove_custom_partitioning_ptr_from_cache_key
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", before[1])


def test_second_run_takes_its_step_from_the_compile_cache(tmp_path):
    """The second run of the same command loads the compiled train step from `compile_cache` (and says so), and
    trains the same losses; `compile_cache=` turns the cache off even where JAX_COMPILATION_CACHE_DIR names one.
    On two devices: the scanned step's buffers are custom_partitioning ops, whose callback addresses differ between
    processes and kept every multi-device step out of the cache until session 53 (compat._sharded_empty)."""
    from mx_jax import train

    cache = tmp_path / "cache"
    losses = []
    for i in range(2):
        p = _run([*TINY, f"run_dir={tmp_path / str(i)}", "steps=2", "ckpt.every_steps=-1", "log.eval_every_steps=-1",
                  f"compile_cache={cache}"])
        assert p.returncode == 0, p.stderr[-3000:]
        assert f"compiled programs are kept in {cache}" in p.stdout
        first = next(l for l in p.stdout.splitlines() if "first step (compile included)" in l)
        assert ("from the compile cache" in first) == (i == 1), first
        lines = (tmp_path / str(i) / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(l)["loss"] for l in lines])
    code = cache / f"code-{train.code_digest()}"  # this code's programs, apart from other versions'
    assert [f.name for f in cache.iterdir()] == [code.name]
    assert any(f.name.startswith("jit_train_step") for f in code.iterdir()), sorted(code.iterdir())
    assert losses[0] == losses[1] and len(losses[0]) == 2
    env_cache = tmp_path / "env_cache"
    env_cache.mkdir()
    p = subprocess.run([sys.executable, "-m", "mx_jax.train", *TINY, f"run_dir={tmp_path / 'off'}", "steps=1",
                        "ckpt.every_steps=-1", "log.eval_every_steps=-1", "compile_cache="], capture_output=True,
                       text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "XLA_FLAGS": xla_flags(1), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                            "JAX_COMPILATION_CACHE_DIR": str(env_cache)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "compiled programs are kept" not in p.stdout and not list(env_cache.iterdir())


def test_loading_a_config_starts_no_backend():
    """`python -m mx_jax.train` sets XLA_FLAGS after reading the config (`deterministic`), which only works while no
    backend has started: XLA reads the flags once, when the first backend starts."""
    code = ("from mx_jax import train; from jax._src import xla_bridge; "
            "cfg = train.load_config('configs/moe_debug.yaml', ['deterministic=true', 'quant.recipe=fp8_rowwise']); "
            "print(cfg.deterministic, xla_bridge.backends_are_initialized())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["True", "False"], p.stdout


# The small bf16 MoE model of the GPU repeat tests: 6 steps once differed from step 5 between two identical runs.
_GPU_MOE = ["--config", "configs/moe_debug.yaml", "model.compute_dtype=bfloat16", "data.seq_len=2048",
            "data.batch_size=4", "model.d_model=512", "model.d_ff=1536", "model.moe.d_expert=512"]


def _gpu_runs(tmp_path, args: list[str], extra: tuple[list[str], ...] = ([], [])) -> list[tuple[list, str]]:
    """`python -m mx_jax.train ARGS` on the GPU once per entry of `extra` (default twice), each run with those
    arguments appended (run_dir tmp_path/0, /1, ..., every step logged, no evaluation, no checkpoint): per run its
    (step, loss, grad_norm) records and its stdout."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "PYTHONPATH": str(ROOT)}
    env.pop("JAX_PLATFORMS", None)
    runs = []
    for i, more in enumerate(extra):
        cmd = [sys.executable, "-m", "mx_jax.train", *args, *more, f"run_dir={tmp_path / str(i)}", "log.every_steps=1",
               "log.eval_every_steps=-1", "ckpt.every_steps=-1", "log.progress=false", "log.tensorboard=false"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "Error reading persistent compilation cache" not in p.stderr, p.stderr[-3000:]
        lines = (tmp_path / str(i) / "metrics.jsonl").read_text().splitlines()
        runs.append(([(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines)], p.stdout))
    return runs


def _first_step_line(stdout: str) -> str:
    return next(l for l in stdout.splitlines() if "first step (compile included)" in l)


@pytest.mark.gpu
def test_gpu_runs_with_deterministic_repeat_bit_for_bit(tmp_path):
    """Two identical 6-step runs of a small bf16 MoE model with `deterministic=true`: the same loss and gradient norm
    at every step. Without it, two runs of this very command differed from step 5 on an H200 (losses 4.29423 /
    4.30240, benchmarks/RESULTS.md session 33), as did the dense debug Llama at sequence 2048."""
    runs = _gpu_runs(tmp_path, [*_GPU_MOE, "steps=6", "deterministic=true"])
    for _, out in runs:
        assert "deterministic: XLA_FLAGS has --xla_gpu_deterministic_ops=true" in out
    assert len(runs[0][0]) == 6 and runs[0][0] == runs[1][0], runs


@pytest.mark.gpu
def test_gpu_out_of_memory_exits_5_under_the_default_allocator(tmp_path):
    """A step far past the GPU's memory (the debug Llama with 2M tokens a batch: f32 attention scores alone are
    hundreds of GB) stops with exit code 5 and the trainer's message, under the cuda_async allocator the trainer
    picks itself, and writes no checkpoint."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "PYTHONPATH": str(ROOT)}
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
    args = ["--config", "configs/llama3_debug.yaml", f"run_dir={tmp_path}", "steps=2", "data.seq_len=4096",
            "data.batch_size=512", "ckpt.every_steps=1", "log.eval_every_steps=-1", "log.progress=false",
            "log.tensorboard=false"]
    p = subprocess.run([sys.executable, "-m", "mx_jax.train", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 5, p.stderr[-3000:]
    assert "error: out of device memory" in p.stderr and "data.grad_accum_steps" in p.stderr, p.stderr[-3000:]
    assert "XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async avoids" not in p.stderr  # already in use
    assert not list((tmp_path / "checkpoints").glob("*")), sorted(str(f) for f in tmp_path.rglob("*"))


@pytest.mark.gpu
def test_gpu_second_run_loads_the_pallas_step_from_the_compile_cache(tmp_path):
    """The fp8 step with its Mosaic GPU kernels comes back from the persistent compilation cache in a second process
    and trains the same losses and gradient norms, bit for bit under `deterministic=true`."""
    runs = _gpu_runs(tmp_path, [
        "--config", "configs/llama3_debug.yaml", "steps=4", "deterministic=true", "model.compute_dtype=bfloat16",
        "data.seq_len=2048", "data.batch_size=4", "model.d_model=512", "model.d_ff=1536", "quant.recipe=fp8_rowwise",
        "quant.impl=pallas", f"compile_cache={tmp_path / 'c'}"])
    assert ["from the compile cache" in _first_step_line(out) for _, out in runs] == [False, True]
    assert len(runs[0][0]) == 4 and runs[0][0] == runs[1][0], runs


@pytest.mark.gpu
def test_gpu_expert_parallel_step_from_the_compile_cache(tmp_path):
    """The MoE step with the expert axis over every GPU, whose exchange runs Mosaic GPU kernels that write to the
    peer GPUs over NVLink, comes back from the compile cache in a second process and trains the same losses and
    gradient norms, bit for bit under `deterministic=true`, as a third process without the cache does. It failed on
    2 x H200 in session 53, when no multi-device step was ever found in the cache (the custom_partitioning callbacks'
    addresses were in the key; train.COMPILE_CACHE_VAR), and passed there after the fix (session 54)."""
    import jax

    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs >= 2 GPUs")
    # The expert axis spans every GPU (2, 4 or 8: the kernels run only then), one sequence or more per GPU. Runs:
    # cold (writes the cache), warm (reads it), and without the cache, which tells a cache fault from a step that
    # does not repeat between processes at all.
    cache = f"compile_cache={tmp_path / 'c'}"
    (cold, cold_out), (warm, warm_out), (off, _) = _gpu_runs(
        tmp_path, [*_GPU_MOE, "steps=4", "deterministic=true", "mesh.fsdp=1", "mesh.expert=-1", "data.batch_size=8"],
        extra=([cache], [cache], ["compile_cache="]))
    assert len(cold) == 4 and cold == off, f"the step does not repeat between processes, cache or not: {cold} {off}"
    assert ["from the compile cache" in _first_step_line(out) for out in (cold_out, warm_out)] == [False, True]
    assert warm == cold, f"the step from the cache trains other losses: {warm} against {cold}"


def test_tokens_per_second_counts_every_second_between_two_reads(tmp_path, monkeypatch):
    """The rate's window runs from one step's read to a later one's: a pause in the loop after a log line (here a
    slow memory query; in a run of several processes, the all-gather of data times, which waits for the step in
    flight) is counted, while evaluation and the pause before it are not (the window opens anew at the next read).
    The loop used to open the window after such a pause, leaving out a whole step of device time per log line across
    processes: session 54's two-process runs looked 1.2-1.34x faster than they were."""
    import jax

    from mx_jax import train
    from tests.helpers import tiny_config

    pause = 0.4

    def slow_memory():
        time.sleep(pause)
        return {}

    real_evaluate = train.evaluate

    def slow_evaluate(*args):
        time.sleep(pause)
        return real_evaluate(*args)

    monkeypatch.setattr(train.metrics, "memory_in_use", slow_memory)
    monkeypatch.setattr(train, "evaluate", slow_evaluate)
    train.train(tiny_config(tmp_path, "steps=6", "log.every_steps=2", "log.eval_every_steps=4", "ckpt.every_steps=-1"),
                devices=jax.devices()[:1])
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == [2, 4, 6] and "eval_loss" in records[4]
    # steps 3 and 4 span the pause after step 2's line: at least half of it per step
    assert records[4]["step_time_s"] >= pause / 2, records[4]
    # step 6 alone: the pause and the evaluation after step 4's line are outside its window
    assert records[6]["step_time_s"] < pause / 4, records[6]


def test_the_log_notes_an_expert_axis_split_into_processes_on_one_host():
    """Processes sharing a host at mesh.expert >= 2 on GPUs miss the NVLink exchange kernels: the log says so. Not on
    CPU devices, not across hosts (no layout runs them there), not for dense models, and not under all_to_all=xla."""
    from mx_jax import train
    from tests.helpers import tiny_config

    moe = tiny_config("/tmp/unused", "model.moe.n_experts=4", "model.moe.top_k=2")
    host, other = (1, 2), (3, 4)
    note = train.moe_layout_note(moe, {"expert": 2, "fsdp": 1}, [host, host], "gpu")
    assert note and "expert=2 spans 2 processes on one host" in note and "NVLink" in note
    assert train.moe_layout_note(moe, {"expert": 2}, [host, host], "cpu") is None
    assert train.moe_layout_note(moe, {"expert": 2}, [host, other], "gpu") is None
    assert train.moe_layout_note(moe, {"expert": 2}, None, "gpu") is None  # one process
    assert train.moe_layout_note(moe, {"expert": 1, "data": 2}, [host, host], "gpu") is None
    dense = tiny_config("/tmp/unused")
    assert train.moe_layout_note(dense, {"expert": 2}, [host, host], "gpu") is None
    xla = tiny_config("/tmp/unused", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.all_to_all=xla")
    assert train.moe_layout_note(xla, {"expert": 2}, [host, host], "gpu") is None
