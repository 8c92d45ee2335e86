"""benchmarks/profile_step.py's HLO parsing: which GEMMs a compiled step runs, their FLOPs, and the instruction
names the GPU trace attributes kernels to (a GEMM can be the root of a wrapping dynamic-slice fusion)."""

import importlib.util
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import pytest

_spec = importlib.util.spec_from_file_location(
    "profile_step", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "profile_step.py")
profile_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_step)

# Trimmed from an H200 step's optimized HLO: one GEMM with its operand shapes printed inline, one whose operands
# are a wrapping computation's parameters (printed without shapes), called by a fusion.
HLO = """
%dynamic-slice-fusion (p0: bf16[8,4096,4096], p1: bf16[8192,4096]) -> (bf16[8192,4096], s8[1024]) {
  %p1 = bf16[8192,4096]{1,0} parameter(1), metadata={scheduling_name="p1"}
  %p0 = bf16[8,4096,4096]{2,1,0} parameter(0), metadata={scheduling_name="p0"}
  %slice.56 = bf16[1,4096,4096]{2,1,0} slice(%p0), slice={[0:1], [0:4096], [0:4096]}
  %bitcast.3243 = bf16[4096,4096]{1,0} bitcast(%slice.56)
  ROOT %cublas-lt-matmul.7 = (bf16[8192,4096]{0,1}, s8[1024]{0}) custom-call(%p1, %bitcast.3243), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]},"selected_algorithm":"3"}}
}

ENTRY %main (a: bf16[8192,14336], b: bf16[14336,4096], w: bf16[8,4096,4096]) -> bf16[8192,4096] {
  %a = bf16[8192,14336]{1,0} parameter(0)
  %b = bf16[14336,4096]{1,0} parameter(1)
  %w = bf16[8,4096,4096]{2,1,0} parameter(2)
  %custom-call.1 = (bf16[8192,4096]{1,0}, s8[1024]{0}) custom-call(bf16[8192,14336]{1,0} %a, bf16[14336,4096]{1,0} %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %address_computation.2 = (bf16[8192,4096]{0,1}, s8[1024]{0}) fusion(%w, %a), kind=kCustom, calls=%dynamic-slice-fusion
  ROOT %add = bf16[8192,4096]{1,0} add(%custom-call.1, %address_computation.2)
}
"""


def test_gemm_flops_finds_inline_and_wrapped_gemms():
    flops = profile_step.gemm_flops(HLO)
    assert flops["custom-call.1"] == (2.0 * 8192 * 4096 * 14336, "8192x14336 . 14336x4096 -> 8192x4096",
                                      "custom-call.1")
    wrapped = (2.0 * 8192 * 4096 * 4096, "8192x4096 . 4096x4096 -> 8192x4096", "cublas-lt-matmul.7")
    assert flops["cublas-lt-matmul.7"] == wrapped
    assert flops["address_computation.2"] == wrapped  # the trace names the calling fusion
    assert set(flops) == {"custom-call.1", "cublas-lt-matmul.7", "address_computation.2"}


# Shaped after the scanned 8B fp8 step's optimized HLO (session 42): the forward loop body runs the output
# projection's Pallas GEMM twice, once fused into the write of its stacked residual; a nested loop counts for itself.
LOOP_HLO = """
%dynamic-slice-fusion.19 (p0: f8e4m3fn[8192,4096], p1: f8e4m3fn[4096,4096]) -> bf16[8192,4096] {
  %p0 = f8e4m3fn[8192,4096]{1,0} parameter(0)
  %p1 = f8e4m3fn[4096,4096]{1,0} parameter(1)
  ROOT %mpmd_map.2 = bf16[8192,4096]{1,0} custom-call(%p0, %p1), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train_step)/jvp()/while/body/checkpoint/jit(fp8_matmul_pallas)/fp8_matmul/mpmd_map"}
}

%inner_body (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  %q = (s32[], f32[4]) parameter(0)
  %cast = f8e4m3fn[4]{0} custom-call(%q), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train_step)/while/body/jit(quantize)/quantize_cast/pallas_call"}
  ROOT %t = (s32[], f32[4]) tuple(%q)
}

%region_1.90 (arg: (s32[], bf16[8192,4096])) -> (s32[], bf16[8192,4096]) {
  %arg = (s32[], bf16[8192,4096]) parameter(0)
  %mpmd_map.1 = bf16[8192,4096]{1,0} custom-call(%arg, %arg), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train_step)/jvp()/while/body/checkpoint/jit(fp8_matmul_pallas)/fp8_matmul/mpmd_map"}
  %dsf = bf16[8192,4096]{1,0} fusion(%arg, %arg), kind=kCustom, calls=%dynamic-slice-fusion.19
  %att = (bf16[8192,4096]{1,0}, f32[4]{0}) custom-call(%arg), custom_call_target="__cudnn$fmhaSoftmax"
  %gemm = (bf16[8192,4096]{1,0}, s8[1024]{0}) custom-call(%arg, %arg), custom_call_target="__cublas$lt$matmul"
  %inner = (s32[], f32[4]) while(%arg), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (s32[], bf16[8192,4096]) tuple(%arg)
}

ENTRY %main (a: (s32[], bf16[8192,4096])) -> (s32[], bf16[8192,4096]) {
  %a = (s32[], bf16[8192,4096]) parameter(0)
  ROOT %while.1 = (s32[], bf16[8192,4096]) while(%a), condition=%region_8.91, body=%region_1.90, metadata={op_name="jit(train_step)/jvp()/while" stack_frame_id=14}, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"8"}}
}
"""


def test_loop_kernel_calls_counts_each_loop_bodys_kernels_per_iteration():
    loops = {op: (trips, dict(calls)) for op, trips, calls in profile_step.loop_kernel_calls(LOOP_HLO)}
    assert loops["jit(train_step)/jvp()/while"] == (
        8, {"Pallas fp8_matmul": 2, "cuDNN": 1, "cuBLAS GEMM": 1})  # the fused one counted through its fusion
    assert loops["inner_body"] == (3, {"Pallas quantize_cast": 1})  # a while without op_name goes by its body


def test_call_operands_resolve_layouts():
    symbols = profile_step.hlo_symbols(HLO)
    line = next(l for l in HLO.splitlines() if "ROOT %cublas-lt-matmul.7" in l)
    assert profile_step.call_operands(line, symbols) == [("bf16", [8192, 4096], [1, 0]),
                                                         ("bf16", [4096, 4096], [1, 0])]


def test_replay_times_a_gemm_standalone(capsys):
    small = HLO.replace("8192", "64").replace("14336", "96").replace("4096", "32")
    profile_step.replay_gemms(small, profile_step.gemm_flops(small),
                              {"address_computation.2": (0.5, 2), "custom-call.1": (1.0, 1)}, top=5)
    out = capsys.readouterr().out
    rows = {m.group(1): [int(m.group(2))] + [float(v) for v in m.group(3, 4, 5)] for m in re.finditer(
        r"^  (\S+)\s+(\d+) +([\d.]+) +([\d.]+) +([\d.]+)  ", out, re.M)}
    assert set(rows) == {"address_computation.2", "custom-call.1"}, out
    # calls and per-call time in the step as given (0.5 ms over 2 calls), a measured time alone, and their ratio
    calls, in_step, alone, ratio = rows["address_computation.2"][:4]
    assert (calls, in_step) == (2, 0.25) and alone > 0
    # the ratio is of the unrounded time: within what the printed 3 decimals of `alone` (and 2 of the ratio) allow
    assert in_step / (alone + 5e-4) - 0.006 <= ratio <= in_step / max(alone - 5e-4, 1e-9) + 0.006, (alone, ratio)
    assert "total per step" in out


def test_idle_report_sums_gaps_between_kernels(capsys):
    from types import SimpleNamespace as NS

    def ev(start, dur, name, graph):
        return NS(start_ns=start, duration_ns=dur, name=name, stats=[("cuda_graph_id", "1")] if graph else [])

    events = [ev(0, 100, "a", True), ev(100, 50, "b", True), ev(400, 100, "mosaic", False), ev(450, 20, "c", False)]
    data = NS(planes=[NS(name="/device:GPU:0", lines=[NS(name="Stream #1", events=events)])])
    profile_step.idle_report(data, n_steps=1)
    out = capsys.readouterr().out
    assert "4 kernels per step, 2 of them in CUDA graphs" in out
    assert "stream idle 0.00 ms" in out  # 250 ns idle, before "mosaic"
    assert "idle before mosaic" in out


def test_profile_ffn_lists_the_last_calls_kernels_in_order(capsys):
    from types import SimpleNamespace as NS

    spec = importlib.util.spec_from_file_location(
        "profile_ffn", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "profile_ffn.py")
    profile_ffn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_ffn)

    def ev(start, dur, name, regs):
        return NS(start_ns=start, duration_ns=dur, name=name, stats=[("kernel_details", f"regs:{regs}")])

    # Two calls of three kernels, listed out of order: only the second call's, sorted, relative to its start.
    events = [ev(5_000_000, 700_000, "gemm", 168), ev(0, 100_000, "amax", 72), ev(4_000_000, 100_000, "amax", 72),
              ev(100_000, 700_000, "gemm", 168), ev(800_000, 300_000, "fusion", 28), ev(6_000_000, 50_000, "add", 16)]
    data = NS(planes=[NS(name="/host:CPU", lines=[]),
                      NS(name="/device:GPU:0", lines=[NS(name="Stream #1", events=events)])])
    profile_ffn.kernel_sequence(data, n_steps=2)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "kernels of the last call, in launch order (3):"
    assert [ln.split()[:3] for ln in lines[1:]] == [["0.000", "0.100", "ms"], ["1.000", "0.700", "ms"],
                                                   ["2.000", "0.050", "ms"]]
    assert "amax" in lines[1] and "regs:168" in lines[2] and "add" in lines[3]


_ncu_spec = importlib.util.spec_from_file_location(
    "ncu_gemm", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_gemm.py")
ncu_gemm = importlib.util.module_from_spec(_ncu_spec)
_ncu_spec.loader.exec_module(ncu_gemm)


def _ncu_csv(launches, memory=None):
    """ncu --csv output (one line per kernel launch and metric) after the program's own ROW/SKIP lines."""
    head = '"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    lines = [head]
    for i, (kernel, cycles) in enumerate(launches):
        values = dict.fromkeys(ncu_gemm.METRICS, "1") | (memory or {})
        values["gpc__cycles_elapsed.max"] = f"{cycles:,}"
        lines += [f'"{i}","7","{kernel}","{name}","","{value}"' for name, value in values.items()]
    return lines


def test_ncu_table_skips_autotuning_candidates_and_takes_second_launches(tmp_path, capsys):
    # Shape 1: XLA autotunes (two candidates), then runs its pick twice; two Pallas configs, two launches each.
    # Shape 2: no autotuning; one config is not covered.
    launches = [("nvjet_a", 900), ("nvjet_b", 800), ("nvjet_b", 810), ("nvjet_b", 820),
                ("anonymous_mosaic_gpu_kernel", 1000), ("anonymous_mosaic_gpu_kernel", 1001),
                ("anonymous_mosaic_gpu_kernel", 1100), ("anonymous_mosaic_gpu_kernel", 1101),
                ("nvjet_c", 500), ("nvjet_c", 501),
                ("anonymous_mosaic_gpu_kernel", 600), ("anonymous_mosaic_gpu_kernel", 601)]
    program = ["ROW|8x8x8|cuBLASLt", "ROW|8x8x8|cfg A", "ROW|8x8x8|cfg B",
               "ROW|4x4x4|cuBLASLt", "SKIP|4x4x4|cfg B|too small", "ROW|4x4x4|cfg A"]
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(program + _ncu_csv(launches)) + "\n")
    ncu_gemm.table(str(path))
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0].strip("| "), r[1], r[2]) for r in rows] == [
        ("8x8x8", "cuBLASLt `nvjet_b`", "820"), ("8x8x8", "cfg A", "1,001"), ("8x8x8", "cfg B", "1,101"),
        ("4x4x4", "cuBLASLt `nvjet_c`", "501"), ("4x4x4", "cfg B", "not covered: too small |||||||"),
        ("4x4x4", "cfg A", "601")]


def test_ncu_table_grouped_rows_with_memory_metrics(tmp_path, capsys):
    """run-grouped's order: cuBLAS batched, our balanced launches, cuBLAS dense, our skewed launches; with
    `metrics --memory` the table adds DRAM MB read and written and the L2 hit rate."""
    launches = [("nvjet_batched", 240), ("nvjet_batched", 241), ("gmm_mosaic_gpu_kernel", 260),
                ("gmm_mosaic_gpu_kernel", 261), ("nvjet_dense", 270), ("gmm_mosaic_gpu_kernel", 360),
                ("gmm_mosaic_gpu_kernel", 362)]
    program = ["ROW|8x8x8|cuBLAS batched", "ROW|8x8x8|gmm bf16 balanced default", "ROW|8x8x8|cuBLAS dense",
               "ROW|8x8x8|gmm bf16 skewed default"]
    lines = _ncu_csv(launches, memory={"dram__bytes_read.sum": "537,000,000", "dram__bytes_write.sum": "46,000,000",
                                       "lts__t_sector_hit_rate.pct": "42.5"})
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(program + lines) + "\n")
    ncu_gemm.table(str(path))
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("DRAM read MB | DRAM write MB | L2 hit % |")
    rows = [line.split(" | ") for line in out[2:]]
    assert [(r[1], r[2], r[-3], r[-2], r[-1]) for r in rows] == [
        ("cuBLAS batched `nvjet_batched`", "241", "537", "46", "42.5 |"),
        ("gmm bf16 balanced default", "261", "537", "46", "42.5 |"),
        ("cuBLAS dense `nvjet_dense`", "270", "537", "46", "42.5 |"),
        ("gmm bf16 skewed default", "362", "537", "46", "42.5 |")]


def test_grouped_bench_sweeps_only_configs_that_tile_n():
    """DeepSeek's d_expert 1408 is 11 x 128: no 256-wide CTA tile may be timed there, and some config must be."""
    import jax.numpy as jnp

    from pallas_kernels import bench_grouped

    for n in (bench_grouped.FULL.n, bench_grouped.DEEPSEEK.n):
        for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
            for quick in (True, False):
                configs = bench_grouped.sweep(dtype, quick, False, n)
                assert configs, (n, quick)
                assert all(n % (c.cta_tile_n * c.cluster_size) == 0 for c in configs), [c.name() for c in configs]
    quick = bench_grouped.sweep(jnp.bfloat16, True, False, bench_grouped.FULL.n)
    assert len(quick) == 4  # quick stays quick
    assert quick[0] == bench_grouped.gm.default_configs(jnp.bfloat16)[0], "the dispatcher's default is timed first"


@pytest.mark.parametrize("problem", ["mixtral", "deepseek"])
def test_moe_layer_bench_times_the_configs_layer(problem):
    """The whole-layer bench builds the MoE layer of the problem's config (shared experts for DeepSeek) under the
    fp8 recipe, differentiates params and x, and counts every routed and shared expert GEMM."""
    import jax
    import numpy as np

    from pallas_kernels import bench_grouped

    fn, args, info = bench_grouped.moe_layer_step(problem, "fp8_rowwise", "xla", smoke=True, expert_min_rows=0)
    (loss, load), (dparams, dx) = jax.jit(fn)(*args)
    p, shared = bench_grouped.SMOKE, 2 if problem == "deepseek" else 0
    assert info["tokens"] == p.m // 2 and info["experts_recipe"] == "fp8_rowwise"
    # the config's default quant.expert_min_rows leaves the smoke problem's 64 rows per expert in bf16
    assert bench_grouped.moe_layer_step(problem, "fp8_rowwise", "xla", smoke=True)[2]["experts_recipe"] == "bf16"
    assert float(np.asarray(load).sum()) == p.m  # tokens x top-2
    assert info["flops"] == 18.0 * info["tokens"] * p.k * p.n * (2 + shared)
    assert ("shared" in dparams) == bool(shared)
    assert np.isfinite(float(loss)) and dx.shape == args[1].shape
    assert float(np.abs(np.asarray(dx, np.float32)).max()) > 0


def _load_bench_train():
    spec = importlib.util.spec_from_file_location(
        "bench_train", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py")
    bench_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_train)
    return bench_train


def _trainer_commands(monkeypatch, tmp_path, runs: list[tuple[list[str], str]], envs: list | None = None
                      ) -> list[list[str]]:
    """The trainer command lines bench_train builds for each (base, variant overrides), none of them run; each
    run's environment is appended to `envs` when given."""
    import subprocess

    bench_train = _load_bench_train()
    cmds = []

    def fake_run(cmd, env):
        cmds.append(cmd)
        if envs is not None:
            envs.append(env)
        return subprocess.CompletedProcess(cmd, 1, "", "stopped")

    monkeypatch.setattr(bench_train, "run_trainer", fake_run)
    for i, (base, overrides) in enumerate(runs):
        bench_train.run_variant(f"v{i}", base, overrides, steps=2, log_every=1, out_dir=tmp_path)
    return cmds


def test_bench_train_reports_a_run_that_logged_no_step(tmp_path, monkeypatch):
    """--steps below --log-every leaves metrics.jsonl empty: a row naming both flags, not a traceback."""
    import subprocess

    bench_train = _load_bench_train()

    def fake_run(cmd, **_):
        run_dir = pathlib.Path(next(a for a in cmd if a.startswith("run_dir=")).split("=", 1)[1])
        (run_dir / "metrics.jsonl").write_text("")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench_train, "run_trainer", lambda cmd, env: fake_run(cmd))
    row = bench_train.run_variant("v", [], "", steps=2, log_every=5, out_dir=tmp_path)
    assert "--steps 2" in row["error"] and "--log-every 5" in row["error"]


def test_bench_train_runs_the_embedded_corpus_unless_told_a_source(tmp_path, monkeypatch):
    """A config whose data.source is `bin` would need shards on the benchmark machine: bench_train adds
    data.source=embedded after the base, except where the base or the variant names a source."""
    base = ["--config", "configs/deepseek_moe_16b.yaml"]
    cmds = _trainer_commands(monkeypatch, tmp_path, [(base, ""), ([*base, "data.source=bin"], ""),
                                                     (base, "data.source=bin")])
    sources = [[a for a in cmd if a.startswith("data.source=")] for cmd in cmds]
    assert sources == [["data.source=embedded"], ["data.source=bin"], ["data.source=bin"]]
    assert cmds[0].index("data.source=embedded") > cmds[0].index("configs/deepseek_moe_16b.yaml")


def test_bench_train_keeps_the_configured_learning_rate_schedule(tmp_path, monkeypatch):
    """`steps=N` would make the benchmark's steps the whole run and squeeze the warmup into them: bench_train passes
    the configured run's decay_steps (its `steps` where decay_steps is 0), unless the base or the variant sets it."""
    moe = ["--config", "configs/deepseek_moe_16b.yaml"]
    debug = ["--config", "configs/llama3_debug.yaml", "steps=300"]
    cmds = _trainer_commands(monkeypatch, tmp_path, [(moe, ""), (debug, ""), (moe, "optim.decay_steps=40"),
                                                     (moe, "model.no_such_key=1")])
    decay = [[a for a in cmd if a.startswith("optim.decay_steps=")] for cmd in cmds]
    assert decay == [["optim.decay_steps=100000"], ["optim.decay_steps=300"], ["optim.decay_steps=40"], []]
    assert cmds[0].index("optim.decay_steps=100000") < cmds[0].index("steps=2")


def test_bench_train_compiles_each_run_afresh(tmp_path, monkeypatch):
    """Every run gets an empty compile cache of its own, so its first-step time is a whole compile (older trees read
    the variable too); a variant's +JAX_COMPILATION_CACHE_DIR or compile_cache= is the user's choice."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "users_cache"))
    envs = []
    base = ["--config", "configs/llama3_debug.yaml"]
    cmds = _trainer_commands(monkeypatch, tmp_path, [(base, ""), (base, ""), (base, "+JAX_COMPILATION_CACHE_DIR=/c"),
                                                     (base, "compile_cache=/d")], envs)
    dirs = [e["JAX_COMPILATION_CACHE_DIR"] for e in envs]
    runs = [next(a for a in c if a.startswith("run_dir=")).split("=", 1)[1] for c in cmds]
    assert dirs[0] != dirs[1] and all(d.startswith(r) for d, r in zip(dirs[:2], runs)), (dirs, runs)
    assert not any(pathlib.Path(d).exists() for d in dirs[:2])  # removed after the run
    assert dirs[2] == "/c" and "compile_cache=/d" in cmds[3]


def test_bench_train_stopped_by_sigterm_kills_its_trainer(tmp_path):
    """`timeout` around bench_train sends it SIGTERM: the trainer it started, and that trainer's own child (the data
    loader in a real run), must not outlive it. A fake mx_jax.train on +PYTHONPATH writes both pids and sleeps."""
    import os
    import signal
    import subprocess
    import sys
    import time

    fake = tmp_path / "tree" / "mx_jax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "train.py").write_text(
        "import os, pathlib, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"pathlib.Path({str(tmp_path / 'pids')!r}).write_text(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(60)\n")
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
    bench = subprocess.Popen([sys.executable, str(script), "--out", str(tmp_path / "out"), "--base", "",
                              "--variant", f"v:+PYTHONPATH={tmp_path / 'tree'}"])
    deadline = time.time() + 30
    while not (tmp_path / "pids").exists() or len((tmp_path / "pids").read_text().split()) < 2:
        assert time.time() < deadline and bench.poll() is None, "the fake trainer never started"
        time.sleep(0.1)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    bench.send_signal(signal.SIGTERM)
    code = bench.wait(timeout=20)

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.time() + 10
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), pids
    assert code == 128 + signal.SIGTERM  # its handler's exit, after the cleanup


def test_profiling_summary_sums_device_time_per_category():
    from types import SimpleNamespace as NS

    from mx_jax import profiling

    def ev(dur_ms, name):
        return NS(start_ns=0, duration_ns=int(dur_ms * 1e6), name=name, stats=[])

    # Two steps on two devices; the "XLA Ops" line is preferred over the stream's kernels where a plane has it.
    gpu0 = NS(name="/device:GPU:0", lines=[
        NS(name="XLA Ops", events=[ev(4, "fp8_matmul_mosaic_gpu_kernel"), ev(2, "nvjet_sm90_tst_128x256"),
                                   ev(1, "loop_add_fusion"), ev(1, "all-reduce.3")]),
        NS(name="Stream #7", events=[ev(100, "ignored")])])
    gpu1 = NS(name="/device:GPU:1", lines=[
        NS(name="Stream #7", events=[ev(6, "cudnn_sdpa_flash_fprop"), ev(2, "unknown_kernel")])])
    lines = profiling.summarize(NS(planes=[NS(name="/host:CPU", lines=[]), gpu0, gpu1]), n_steps=2, top=2)
    assert lines[0].startswith("device time per step and device: 4.0 ms (sum over ops, 2 steps traced on 2 device")
    per_cat = {ln.split()[0]: float(ln.split()[-3]) for ln in lines[1:] if ln.endswith("%")}
    assert per_cat == {"pallas": 1.0, "gemm": 0.5, "fusion": 0.25, "collective": 0.25, "attention": 1.5,
                       "other": 0.5}
    assert lines[-3] == "top 2 ops (ms per step, calls per step):" and "cudnn_sdpa_flash_fprop" in lines[-2]
    assert profiling.summarize(NS(planes=[NS(name="/host:CPU", lines=[])]), 1, 1)[0].startswith("no device plane")


def test_profiling_overlap_counts_communication_nothing_hid():
    from types import SimpleNamespace as NS

    from mx_jax import profiling

    def ev(start_ms, stop_ms, name, hlo_op=None):
        return NS(start_ns=int(start_ms * 1e6), duration_ns=int((stop_ms - start_ms) * 1e6), name=name,
                  stats=[("hlo_op", hlo_op)] if hlo_op else [])

    # GPU 0: a GEMM [0, 4) under an all-reduce [2, 6) (2 ms of it alone), a fusion [7, 8), an all-gather [9, 10)
    # alone. GPU 1: a NCCL kernel wholly under a fusion on another stream, then two NCCL kernels on two streams,
    # [3, 5) and [4, 6), with nothing else running (named by their XLA instructions).
    gpu0 = NS(name="/device:GPU:0", lines=[NS(name="XLA Ops", events=[
        ev(0, 4, "nvjet_sm90_tst"), ev(2, 6, "all-reduce.1"), ev(7, 8, "loop_add_fusion"), ev(9, 10, "all-gather.2")])])
    gpu1 = NS(name="/device:GPU:1", lines=[
        NS(name="Stream #7", events=[ev(0, 2, "input_reduce_fusion"), ev(3, 5, "ncclDevKernel_AllGather", "ag.7")]),
        NS(name="Stream #9", events=[ev(0.5, 1.5, "ncclDevKernel_AllGather"),
                                     ev(4, 6, "ncclDevKernel_ReduceScatter", "rs.8")])])
    data = NS(planes=[NS(name="/host:CPU", lines=[]), gpu0, gpu1])
    busy, alone, n_dev, by_op = profiling.overlap(data)
    assert n_dev == 2 and abs(busy - 13.0) < 1e-6 and abs(alone - 6.0) < 1e-6, (busy, alone)
    want = {"all-reduce.1": 2.0, "all-gather.2": 1.0, "ag.7": 1.5, "rs.8": 1.5}  # [4, 5) split between ag.7, rs.8
    assert set(by_op) == set(want) and all(abs(by_op[k] - v) < 1e-6 for k, v in want.items()), by_op
    lines = profiling.summarize(data, n_steps=1, top=0)
    line = [ln for ln in lines if ln.lstrip().startswith("busy")]
    assert line and line[0].split()[1] == "6.5" and "of which 3.0 ms collectives" in line[0]
    assert "  unhidden by collective: all-reduce.1 1.0, ag.7 0.8, rs.8 0.8, all-gather.2 0.5" in lines
    # Idle: GPU 0 [6, 7) and [8, 9) of its 10 ms span, GPU 1 [2, 3) of 6 ms; per device, by the op each gap ended at.
    assert lines[-2].startswith("  idle 1.5 ms per step and device with no op running, of a 8.0 ms span"), lines
    assert lines[-1] == "  idle before: loop_add_fusion 0.5, all-gather.2 0.5, ncclDevKernel_AllGather 0.5"


def test_profile_step_dumps_device_0s_timeline_with_its_stats(tmp_path):
    """events.csv: the first device plane's chosen events in start order, from its first op, with their stats."""
    import csv
    from types import SimpleNamespace as NS

    def ev(start_us, dur_us, name, **stats):
        return NS(start_ns=int(start_us * 1e3), duration_ns=int(dur_us * 1e3), name=name, stats=list(stats.items()))

    gpu0 = NS(name="/device:GPU:0", lines=[NS(name="Stream #7", events=[
        ev(1005, 2, "ncclDevKernel_ReduceScatter", hlo_op="reduce_scatter.39.1"), ev(1000, 4, "fp8_matmul_mosaic")])])
    gpu1 = NS(name="/device:GPU:1", lines=[NS(name="Stream #7", events=[ev(0, 1, "other_device")])])
    data = NS(planes=[NS(name="/host:CPU", lines=[]), gpu0, gpu1])
    assert profile_step.dump_events(data, tmp_path / "events.csv") == 2
    rows = list(csv.DictReader(open(tmp_path / "events.csv")))
    assert [(r["start_us"], r["duration_us"], r["name"], r["category"], r["stats"]) for r in rows] == [
        ("0.0", "4.0", "fp8_matmul_mosaic", "pallas kernels", ""),
        ("5.0", "2.0", "ncclDevKernel_ReduceScatter", "collective", "hlo_op=reduce_scatter.39.1")]


_tiles_spec = importlib.util.spec_from_file_location(
    "profile_tiles", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "profile_tiles.py")
profile_tiles = importlib.util.module_from_spec(_tiles_spec)
_tiles_spec.loader.exec_module(profile_tiles)


def test_profile_tiles_summary_takes_medians_and_gaps_per_track():
    """Two warpgroup tracks of one CTA, two tiles each (the layout of Mosaic GPU's profiler trace): medians over the
    tiles of both tracks; `gap` runs from a region's end to the next k_loop's begin on the same track only."""

    def track(tid, t0, loop):
        spans = [("decode", 0.0, 0.5), ("k_loop", 0.75, 0.75 + loop), ("drain", loop + 0.75, loop + 1.0),
                 ("epilogue", loop + 1.0, loop + 2.5), ("decode", loop + 2.5, loop + 3.0),
                 ("k_loop", loop + 3.5, 2 * loop + 3.5)]
        return [{"name": n, "ph": ph, "ts": t0 + t, "pid": 1, "tid": tid}
                for n, b, e in spans for ph, t in (("B", b), ("E", e))]

    trace = {"traceEvents": track(1, 100.0, 8.0) + track(2, 0.0, 10.0)}
    summary = profile_tiles.summarize(trace)
    assert summary["k_loop"] == (9.0, 4)
    assert summary["epilogue"] == (1.5, 2) and summary["drain"] == (0.25, 2)
    assert summary["gap"] == (0.375, 4)  # 0.25 before each first k_loop, 0.5 before each second one


def test_mgpu_profiler_params_from_the_environment(monkeypatch):
    from pallas_kernels import device

    monkeypatch.delenv(device.PROFILE_ENV, raising=False)
    assert device.profiler_params() == {}
    monkeypatch.setenv(device.PROFILE_ENV, "/tmp/prof:48")
    assert device.profiler_params() == dict(profile_space=48, profile_dir="/tmp/prof")
    monkeypatch.setenv(device.PROFILE_ENV, "/tmp/prof")
    assert device.profiler_params()["profile_space"] == 64
    monkeypatch.setenv(device.PROFILE_ENV, "/tmp/prof:many")
    with pytest.raises(ValueError, match="MX_JAX_MGPU_PROFILE"):
        device.profiler_params()


def test_gemm_beside_collective_builds_its_three_programs(capsys):
    """benchmarks/gemm_beside_collective.py on CPU (XLA's GEMM only, no device trace): `both` holds the GEMMs and
    the reduce-scatter with no dependency between them, and the table prints a row per variant."""
    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gemm_beside_collective.py"
    spec = importlib.util.spec_from_file_location("gemm_beside_collective", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    shapes = [jax.ShapeDtypeStruct(s, d, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
              for s, d in [((4 * 256, 256), jnp.float8_e4m3fn), ((4 * 2 * 128, 256), jnp.float8_e4m3fn),
                           ((4 * 256,), jnp.float32), ((4 * 128,), jnp.float32), ((4 * 2 * 64, 128), jnp.bfloat16)]]
    hlo = {kind: bench.program(kind, None, mesh, 256, 128, 64, 128, 2).lower(*shapes).as_text()
           for kind in ("gemm", "rs", "both")}
    assert "reduce_scatter" in hlo["both"] and "dot_general" in hlo["both"]
    assert "reduce_scatter" not in hlo["gemm"] and "dot_general" not in hlo["rs"]
    bench.main(["--small"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("| variant |") and out[3].startswith("| cuBLASLt (xla) |"), out
    # --grouped: the MoE grouped GEMM (XLA's ragged_dot on CPU), bf16 and fp8 with scales
    for dtype in ("bf16", "fp8"):
        bench.main(["--small", "--grouped", "--dtype", dtype])
        out = capsys.readouterr().out.splitlines()
        assert f"grouped {'bfloat16' if dtype == 'bf16' else 'float8_e4m3fn'} GEMMs" in out[0], out
        assert out[3].startswith("| ragged_dot (xla) |"), out


def test_dispatch_bench_runs_both_methods_on_identity_experts(capsys, monkeypatch):
    """benchmarks/bench_dispatch.py's dispatch_combine table on 4 CPU devices (2 nodes x 2): both methods run
    (the bench catches a failing path and prints FAILED, so a stand-in that drifts from ExpertFFN's interface would
    only show there), return x through identity experts, and count the fabric's rows."""
    spec = importlib.util.spec_from_file_location(
        "bench_dispatch", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dispatch.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_dispatch", bench)  # (its dataclass looks itself up there)
    spec.loader.exec_module(bench)
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    out = bench.dispatch_paths(mesh, 4, tokens=16, hidden=32, n_experts=8, top_k=2, reps=1)
    assert "FAILED" not in capsys.readouterr().out
    assert set(out) == {("flat", "land"), ("flat", "dense"), ("hierarchical", "dense")}
    assert out[("flat", "land")][1:] == out[("flat", "dense")][1:]  # the same rows cross the fabric
    flat, hier = out[("flat", "dense")], out[("hierarchical", "dense")]
    assert hier[1] <= flat[1] and flat[1] > 0  # a token crosses to another node at most once per node


def test_bench_train_runs_a_variant_as_processes_of_one_gpu(tmp_path, monkeypatch):
    """`%N` in a variant starts it through launch/local.sh as N processes of one GPU each, with this Python and the
    other processes' logs under --out; the trainer arguments are the same as a one-process variant's."""
    envs = []
    base = ["--config", "configs/llama3_debug.yaml"]
    one, two = _trainer_commands(monkeypatch, tmp_path, [(base, "mesh.fsdp=2"), (base, "%2 mesh.fsdp=2")], envs)
    assert two[:6] == ["bash", "launch/local.sh", "2", "--gpus-per-process", "1", "--config"]
    assert one[:4] == [sys.executable, "-P", "-m", "mx_jax.train"]
    strip = lambda cmd: [a for a in cmd if not a.startswith("run_dir=")]
    assert strip(two)[5:] == strip(one)[4:] and "%2" not in two
    assert envs[1]["PYTHON"] == sys.executable and envs[1]["MX_JAX_LOG_DIR"].endswith("_procs")
    assert "MX_JAX_LOG_DIR" not in envs[0] or envs[0]["MX_JAX_LOG_DIR"] == os.environ.get("MX_JAX_LOG_DIR")


def test_trainer_loop_time_reads_each_step_after_the_next_is_dispatched():
    """profile_step's second timing runs steps as train._loop does: a fresh batch each step (from data.Prefetch,
    built in the loop or ahead by its thread), step i's metrics read only once step i+1 is dispatched, every one of
    them read (the last after the loop), and at a log line's step a wait for it before the next is dispatched."""
    from types import SimpleNamespace as NS

    events = []

    class Metric:
        def __init__(self, i):
            self.i = i

        def __float__(self):
            events.append(("read", self.i))
            return float(self.i)

        def block_until_ready(self):
            events.append(("wait", self.i))
            return self

    class Batches:
        position = 0

        def next_global(self, shardings, accum):
            events.append(("batch",))
            self.position += 1
            return f"batch {self.position}"

    def step(state, batch):
        assert batch == f"batch {state + 1}"  # each step gets the next batch, in order
        events.append(("dispatch", state + 1))
        return state + 1, {"loss": Metric(state + 1)}

    cfg = NS(log=NS(every_steps=100), data=NS(grad_accum_steps=1, prefetch=2))
    state, seconds = profile_step.trainer_loop_time(step, 0, Batches(), NS(batch_shardings=None), cfg, 3, prefetch=0)
    assert state == 3 and seconds > 0
    assert events == [("batch",), ("dispatch", 1), ("batch",), ("dispatch", 2), ("read", 1),
                      ("batch",), ("dispatch", 3), ("read", 2), ("read", 3)]
    events.clear()  # built ahead by the thread (cfg.data.prefetch): the same steps and reads, and 3 batches built
    profile_step.trainer_loop_time(step, 0, Batches(), NS(batch_shardings=None), cfg, 3)
    assert [e for e in events if e[0] != "batch"] == [("dispatch", 1), ("dispatch", 2), ("read", 1), ("dispatch", 3),
                                                       ("read", 2), ("read", 3)]
    assert events.count(("batch",)) == 3
    events.clear()  # a log line every 2 steps: the loop waits for step 2 (jax.block_until_ready) before step 3
    profile_step.trainer_loop_time(step, 0, Batches(), NS(batch_shardings=None), NS(log=NS(every_steps=2),
                                                                               data=cfg.data), 3)
    assert [e for e in events if e[0] != "batch"] == [("dispatch", 1), ("dispatch", 2), ("read", 1), ("wait", 2),
                                                       ("dispatch", 3), ("read", 2), ("read", 3)]
    events.clear()  # neither: only the last step's metrics are read, after the loop
    profile_step.trainer_loop_time(step, 0, Batches(), NS(batch_shardings=None), NS(log=NS(every_steps=2),
                                                                               data=cfg.data), 3, read=False,
                                   wait=False)
    assert [e for e in events if e[0] != "batch"] == [("dispatch", 1), ("dispatch", 2), ("dispatch", 3), ("read", 3)]
