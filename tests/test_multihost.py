"""Several processes on one machine (jax.distributed over loopback), HSDP, and checkpoints across meshes."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from mx_jax import sharding, train
from mx_jax.config import MeshConfig
from tests.helpers import NO_IO, TINY, tiny_config, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _losses(run_dir, key="loss"):
    return [json.loads(l)[key] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_steps(got_dir, want_dir, steps=None):
    """Per logged step, the same loss and gradient norm: the loss alone would not show a gradient off by a constant
    factor (AdamW's update and the clipping are blind to it), e.g. a process-crossing axis summed, not averaged."""
    for key, rtol in (("loss", 1e-5), ("grad_norm", 1e-4)):
        want = _losses(want_dir, key)[:steps]
        assert want and all(v > 0 for v in want)
        np.testing.assert_allclose(_losses(got_dir, key), want, rtol=rtol, err_msg=key)


def _local(n_proc, devices_each, args, log_dir, timeout=300):
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "PYTHONPATH": str(ROOT), "MX_JAX_LOG_DIR": str(log_dir)}
    return subprocess.run(["bash", "launch/local.sh", str(n_proc), "--cpu-devices", str(devices_each), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_processes_match_one_and_share_checkpoints(tmp_path):
    # decay_steps pinned: the schedule must not depend on each leg's `steps`, so that the legs add up to one run
    common = [*TINY, "optim.decay_steps=5", "mesh.data=2", "mesh.fsdp=4", "steps=3"]
    two = tmp_path / "two"
    p = _local(2, 4, [*common, f"run_dir={two}"], tmp_path / "logs")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "data=2 (across processes, within a host), fsdp=4 (within a process)" in p.stdout  # HSDP layout
    # the same run in one process with 8 devices, uninterrupted to step 5
    straight = train.train(tiny_config(tmp_path / "one", "optim.decay_steps=5", "mesh.data=2", "mesh.fsdp=4",
                                       "steps=5", *NO_IO))
    _assert_same_steps(two, tmp_path / "one", steps=3)
    assert sorted(os.listdir(two / "checkpoints")) == ["3"]
    last = json.loads((two / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["data_ms_max"] >= last["data_ms"] >= 0  # the slowest process's batch building, gathered
    # The checkpoint both processes wrote resumes in two processes ...
    p = _local(2, 4, [*common[:-1], "steps=4", f"run_dir={two}"], tmp_path / "logs2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "resume | from step 3" in p.stdout
    # ... and that one in one process with 8 devices, on another mesh; the run continues as an uninterrupted one.
    resumed = train.train(tiny_config(two, "optim.decay_steps=5", "mesh.data=1", "mesh.fsdp=8", "steps=5", *NO_IO))
    assert int(resumed.state["step"]) == 5
    assert [json.loads(l)["step"] for l in (two / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    _assert_same_steps(two, tmp_path / "one")
    assert resumed.metrics["loss"] == pytest.approx(straight.metrics["loss"], rel=1e-5)


def test_two_processes_sum_the_embedding_and_head_gradients_across_them(tmp_path):
    """data=8 over two processes with 256 tokens per step: the head runs vocab-parallel across the processes and the
    embedding's sparse partials are all-gathered across them (sharding.head_vocab_axes, embed_lookup); the losses and
    gradient norms are one device's."""
    common = [*TINY, "mesh.data=8", "mesh.fsdp=1", "data.batch_size=8", "steps=3", *NO_IO]
    p = _local(2, 4, [*common, f"run_dir={tmp_path / 'two'}"], tmp_path / "logs")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "output head vocab-parallel over data: split on its 256 vocabulary entries, for 256 tokens" in p.stdout
    one = train.train(tiny_config(tmp_path / "one", *common, "mesh.data=1"), devices=jax.devices()[:1])
    assert len(_losses(tmp_path / "two")) == 3
    _assert_same_steps(tmp_path / "two", tmp_path / "one")


def test_two_processes_run_the_expert_axis_across_them(tmp_path):
    """mesh.expert=2 over two processes of one device each: the tokens' exchanges cross the processes (XLA's
    collectives; the NVLink kernels need one process holding every device), and the losses are those of one process
    holding both devices."""
    from mx_jax.config import load_config

    common = ["model.vocab_size=256", "data.seq_len=64", "data.batch_size=8", "mesh.fsdp=1", "mesh.expert=2",
              "steps=3", "log.every_steps=1", "log.progress=false", "log.tensorboard=false", *NO_IO]
    moe = ["--config", "configs/moe_debug.yaml"]
    p = _local(2, 1, [*moe, *common, f"run_dir={tmp_path / 'two'}"], tmp_path / "logs")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "expert=2 (across processes, within a host)" in p.stdout
    train.train(load_config(str(ROOT / "configs" / "moe_debug.yaml"), [*common, f"run_dir={tmp_path / 'one'}"]),
                devices=jax.devices()[:2])
    assert len(_losses(tmp_path / "two")) == 3
    _assert_same_steps(tmp_path / "two", tmp_path / "one")


def test_hsdp_mesh_keeps_fsdp_inside_a_host():
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=4))
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(2, 4)
    assert set(ids[0]) == {d.id for d in jax.devices()[:4]}  # one fsdp group = one host's devices


def test_checkpoint_restores_on_another_mesh(tmp_path):
    first = train.train(tiny_config(tmp_path, "mesh.data=1", "mesh.fsdp=8", "steps=2"))
    params = jax.tree.map(np.asarray, first.state["params"])
    for overrides, devices in ((["mesh.data=2", "mesh.fsdp=4"], None), (["mesh.fsdp=1"], jax.devices()[:1])):
        restored = train.train(tiny_config(tmp_path, *overrides, "steps=2"), devices=devices)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored.state["params"]), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
        wq = restored.state["params"]["blocks"]["attn"]["wq"]
        assert len(wq.sharding.device_set) == (8 if devices is None else 1)


def test_local_launcher_returns_the_processes_exit_code(tmp_path):
    p = _local(2, 4, [*TINY, "model.d_model=-1", f"run_dir={tmp_path}"], tmp_path / "logs", timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]  # the config error's code, not a generic failure
    assert "config key 'model.d_model'" in p.stderr


def test_local_launcher_stops_all_when_any_process_fails(tmp_path):
    """Process 1 fails while process 0 still waits (for the coordinator, or a collective): the launcher stops process
    0 at once and exits with process 1's code (it waited in process order: 5 minutes, until jax's initialization
    timeout aborted process 0, then exit 134)."""
    import time

    fake = tmp_path / "python.sh"
    fake.write_text('#!/usr/bin/env bash\nif [[ $MX_JAX_PROCESS_ID == 1 ]]; then exit 7; fi\nexec sleep 120\n')
    fake.chmod(0o755)
    t0 = time.perf_counter()
    p = subprocess.run(["bash", "launch/local.sh", "2", "--cpu-devices", "1", "--config", "x.yaml"], cwd=ROOT,
                       capture_output=True, text=True, timeout=100,
                       env={**os.environ, "PYTHON": str(fake), "MX_JAX_LOG_DIR": str(tmp_path / "logs")})
    assert p.returncode == 7 and time.perf_counter() - t0 < 30, (p.returncode, p.stderr[-1000:])
    assert "a process failed" in p.stderr


def test_distributed_start_ignores_slurms_variables(tmp_path):
    """Inside an `srun` task jax's cluster detection would take SLURM_LOCALID as the one GPU this process may use
    (jax_cuda_visible_devices), where the launcher means all it sees; the MX_JAX_* variables are checked by name."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "SLURM_JOB_ID": "1", "SLURM_NTASKS": "1",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "3", "SLURM_STEP_NODELIST": "localhost", "SLURM_NODEID": "0",
           "MX_JAX_COORDINATOR": "127.0.0.1:" + str(_free_port()), "MX_JAX_NUM_PROCESSES": "1",
           "MX_JAX_PROCESS_ID": "0"}
    code = ("from mx_jax import train; train.init_distributed(); import jax; "
            "print('visible', jax.config.read('jax_cuda_visible_devices'), jax.process_count()); "
            "jax.distributed.shutdown()")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "visible all 1" in p.stdout, p.stdout + p.stderr[-2000:]
    for change, message in (({"MX_JAX_NUM_PROCESSES": ""}, "MX_JAX_NUM_PROCESSES=''"),
                            ({"MX_JAX_PROCESS_ID": "2"}, "MX_JAX_PROCESS_ID='2': must be this process's index")):
        p = subprocess.run([sys.executable, "-m", "mx_jax.train", *TINY, f"run_dir={tmp_path / 'run'}"], cwd=ROOT,
                           env={**env, **change}, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_launcher_refuses_bad_counts(tmp_path):
    """A process count or --cpu-devices that is not a positive number stops the launcher before any process starts
    (0 processes ran nothing and exited 0; --cpu-devices 0 crashed jax, 'abc' raised a traceback)."""
    for args, message in ((["0", "--config", "x.yaml"], "usage:"),
                          (["1", "--cpu-devices"], "--cpu-devices takes a positive number"),
                          (["1", "--cpu-devices", "abc", "--config", "x.yaml"], "got 'abc'"),
                          (["1", "--cpu-devices", "0", "--config", "x.yaml"], "got '0'")):
        p = subprocess.run(["bash", "launch/local.sh", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "MX_JAX_LOG_DIR": str(tmp_path / "logs")})
        assert p.returncode == 2 and message in p.stderr, (args, p.returncode, p.stderr)
    env = {**os.environ, "MX_JAX_COORDINATOR": "127.0.0.1:1", "MX_JAX_NUM_PROCESSES": "1", "MX_JAX_PROCESS_ID": "0",
           "MX_JAX_CPU_DEVICES": "two"}  # as a hand-written launcher might set it
    p = subprocess.run([sys.executable, "-m", "mx_jax.train", *TINY, f"run_dir={tmp_path / 'run'}"], cwd=ROOT,
                       env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "MX_JAX_CPU_DEVICES='two': must be a positive number" in p.stderr, p.stderr[-2000:]


def test_local_launcher_gives_each_process_its_gpus(tmp_path):
    """--gpus-per-process G hands process i the i-th G entries of CUDA_VISIBLE_DEVICES; asking for more GPUs than
    there are is an error naming the count. A stand-in `python` on PATH reports what each process was given."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text('#!/bin/sh\necho "process $MX_JAX_PROCESS_ID of $MX_JAX_NUM_PROCESSES: '
                                 'GPUs $CUDA_VISIBLE_DEVICES"\n')
    (fake / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "3,5,7,9",
           "MX_JAX_LOG_DIR": str(tmp_path / "logs")}
    p = subprocess.run(["bash", "launch/local.sh", "2", "--gpus-per-process", "2", "--config", "x.yaml"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "process 0 of 2: GPUs 3,5"
    assert (tmp_path / "logs" / "proc1.log").read_text().strip() == "process 1 of 2: GPUs 7,9"
    p = subprocess.run(["bash", "launch/local.sh", "3", "--gpus-per-process", "2", "--config", "x.yaml"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "needs 3 x 2 GPUs; this machine shows 4" in p.stderr, p.stderr


_GPU_SMALL = ["model.compute_dtype=bfloat16", "data.seq_len=2048", "data.batch_size=4", "model.d_model=512",
              "model.d_ff=1536"]


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama_fp8_fsdp", "moe_expert"])
def test_gpu_two_processes_of_one_gpu_train_as_one_process_of_two(tmp_path, model):
    """Two processes of one GPU each, joined by jax.distributed over loopback (launch/local.sh --gpus-per-process 1:
    NCCL between processes, as between hosts), train the losses of one process holding both GPUs, commit a
    checkpoint both write, and continue from it in two processes as the one process's run went on. Models: the fp8
    debug Llama on its Pallas kernels at fsdp=2, and the MoE at expert=2, whose exchanges then take XLA's
    collectives (the NVLink kernels need one process holding every GPU); so the one process takes them too
    (`model.moe.all_to_all=xla`). Its own NVLink exchange gave a step-1 loss 4e-6 apart (session 54), and this
    small, fast-moving MoE carries such a difference to 2.5% by step 5."""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs >= 2 GPUs")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(str(i) for i in range(len(gpus)))
    args = {"llama_fp8_fsdp": ["--config", "configs/llama3_debug.yaml", *_GPU_SMALL, "mesh.data=1", "mesh.fsdp=2",
                               "quant.recipe=fp8_rowwise"],
            "moe_expert": ["--config", "configs/moe_debug.yaml", *_GPU_SMALL, "model.moe.d_expert=512",
                           "mesh.fsdp=1", "mesh.expert=2"]}[model]
    args += ["deterministic=true", "optim.decay_steps=6", "ckpt.every_steps=2", "log.every_steps=1",
             "log.eval_every_steps=-1", "log.progress=false", "log.tensorboard=false"]
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "PYTHONPATH": str(ROOT), "MX_JAX_LOG_DIR": str(tmp_path / "logs"),
           "CUDA_VISIBLE_DEVICES": ",".join(visible.split(",")[:2])}
    env.pop("JAX_PLATFORMS", None)

    def launch(*cmd):
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        return p.stdout

    local = ["bash", "launch/local.sh", "2", "--gpus-per-process", "1", *args, f"run_dir={tmp_path / 'two'}"]
    out = launch(*local, "steps=4")
    assert "2 x NVIDIA" in out and "(2 process(es))" in out, out[-2000:]
    assert "(across processes, within a host)" in out, out[-2000:]
    assert ("expert=2 spans 2 processes on one host" in out) == (model == "moe_expert"), out[-2000:]  # the note
    same_exchange = ["model.moe.all_to_all=xla"] if model == "moe_expert" else []
    launch(sys.executable, "-m", "mx_jax.train", *args, *same_exchange, "steps=6", f"run_dir={tmp_path / 'one'}")
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["2", "4"]
    out = launch(*local, "steps=6")
    assert "resume | from step 4" in out, out[-2000:]
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(two) == len(one) == 6
    assert two == one, f"two processes {two}, one process {one}"  # bit for bit (session 54, 2 x H200: both models)


def test_mesh_description_tells_hosts_from_processes():
    """With each process's host known, an axis that crosses processes says whether it crosses hosts too: one process
    per GPU on two 4-GPU hosts keeps fsdp=4 inside a host and puts data=2 across them."""
    from types import SimpleNamespace as NS

    devs = np.array([NS(process_index=p) for p in range(8)], dtype=object).reshape(2, 4)
    mesh = NS(devices=devs, axis_names=("data", "fsdp"), shape={"data": 2, "fsdp": 4})
    hosts = ["a"] * 4 + ["b"] * 4
    assert sharding.describe(mesh, hosts) == "data=2 (across hosts), fsdp=4 (across processes, within a host)"
    words = [(1, 2)] * 4 + [(1, 3)] * 4  # process_hosts' form: digest words per process
    assert sharding.describe(mesh, words) == "data=2 (across hosts), fsdp=4 (across processes, within a host)"
    assert sharding.describe(mesh) == "data=2 (across processes), fsdp=4 (across processes)"
    assert sharding.process_hosts() is None  # one process
