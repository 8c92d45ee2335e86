"""--dry-run: parameter count and per-device memory from shapes, then an AOT compile on faked devices."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from mx_jax import memory_estimate
from mx_jax.config import load_config
from tests.helpers import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _dry_run(*args):
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "mx_jax.train", "--dry-run", *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_8b_parameter_count_shapes_only():
    report = memory_estimate.estimate(load_config(str(ROOT / "configs/llama3_8b.yaml"), ["mesh.fsdp=1"]))
    assert report["n_params"] == 8_030_261_248  # Llama 3.1 8B: 8.03 B
    assert abs(report["params_gb"] - 4 * 8.03) < 0.1  # float32 masters on one device
    assert abs(report["copies_gb"] - 2 * (8.03 - 0.525)) < 0.05  # bf16 GEMM weights: all but the embedding
    # Gradients as the step makes them: bf16 for the GEMM weights, float32 for the embedding (and the norms)
    assert abs(report["grads_gb"] - (2 * (8.03 - 0.525) + 4 * 0.525)) < 0.05
    assert abs(report["optimizer_gb"] - 2 * 4 * 8.03) < 0.1  # AdamW's two moments, float32
    accum = memory_estimate.estimate(load_config(str(ROOT / "configs/llama3_8b.yaml"),
                                                 ["mesh.fsdp=1", "data.grad_accum_steps=2",
                                                  "optim.moment_dtype=bfloat16"]))
    assert abs(accum["grads_gb"] - report["grads_gb"] - 4 * 8.03) < 0.1  # + the float32 sum of the micro-steps
    assert abs(accum["optimizer_gb"] - 2 * 2 * 8.03) < 0.1  # the moments in bf16


def test_70b_compiles_for_64_devices_it_does_not_have():
    out = _dry_run("--config", str(ROOT / "configs/llama3_70b.yaml"), "mesh.fsdp=64")
    assert "70,553,706,496" in out and "= 64 devices" in out
    assert "compiled train step for 64 fake CPU devices" in out
    args_gb = float(re.search(r"arguments\s+([\d.]+) GB", out).group(1))
    # parameters + two AdamW moments, f32, sharded 64 ways: 3 x 4 B x 70.55e9 / 64 = 13.23 GB, plus the bf16
    # copies of the GEMM weights (all but the 1.05e9 embedding entries and the norms): 2 B x 69.50e9 / 64 = 2.17 GB
    assert 15.3 < args_gb < 15.5
    assert re.search(r"fits H200 141GB\s+yes", out) and re.search(r"fits H100 80GB\s+no", out)


def test_70b_memory_shrinks_with_fsdp():
    one = memory_estimate.estimate(load_config(str(ROOT / "configs/llama3_70b.yaml"), ["mesh.fsdp=8"]))
    many = memory_estimate.estimate(load_config(str(ROOT / "configs/llama3_70b.yaml"), ["mesh.fsdp=64"]))
    assert abs(one["params_gb"] / many["params_gb"] - 8) < 0.05  # every large weight is fsdp-sharded
    assert many["devices"] == 64


def _per_token(args, stack="blocks"):
    """(bytes one layer keeps per device and token, the same under remat=none) from the estimate's own trace."""
    from flax import nnx
    from jax.sharding import AbstractMesh, AxisType

    from mx_jax.llama import Llama

    cfg = memory_estimate._gpu_config(load_config(str(ROOT / args[0]), list(args[1:])))
    shape = memory_estimate._mesh_shape(cfg)
    mesh = AbstractMesh(tuple(shape.values()), tuple(shape.keys()), axis_types=(AxisType.Auto,) * len(shape))
    model = nnx.eval_shape(lambda: Llama(cfg.model, cfg.quant, rngs=nnx.Rngs(0)))
    n, kept, everything, gradients = memory_estimate.layer_residuals(cfg, model, mesh)[stack]
    tokens = cfg.data.seq_len * cfg.data.batch_size / (shape["data"] * shape["fsdp"] * shape["expert"] * shape["context"])
    return kept / tokens, everything / tokens, gradients / tokens


SHAPE_8B = ("configs/llama3_8b.yaml", "model.n_layers=2", "data.seq_len=2048", "data.batch_size=2", "mesh.fsdp=1")


@pytest.mark.parametrize("context", [1, 2])
def test_a_dense_layer_keeps_what_the_docstring_formula_says(context):
    """The trace of the 8B block (cuDNN attention, as on a GPU) against memory_estimate's docstring: x, q|k|v, the
    attention output and its statistics once (cuDNN's and context parallelism's own tags, no second copy), the
    residual stream after attention and gate|up; an fp8 recipe adds each linear's 1-byte transposed input."""
    d, hk, gk, f, h = 4096, 4096, 1024, 14336, 32
    save = 2 * (2 * d + 2 * hk + 2 * gk + 2 * f) + 4 * h
    mesh = f"mesh.context={context}"
    kept, everything, gradients = _per_token((*SHAPE_8B, mesh, "model.remat=save_matmuls"))
    assert kept == save and everything > 1.5 * save
    assert gradients == 3 * 2 * f  # the SwiGLU's backward writes dh, dg and du beside g, u and h: F each per token
    kept, _, _ = _per_token((*SHAPE_8B, mesh, "model.remat=save_matmuls", "quant.recipe=fp8_rowwise"))
    assert save + (2 * d + hk + f) <= kept < save + (2 * d + hk + f) + 64  # + per-channel f32 scale vectors
    kept, none, _ = _per_token((*SHAPE_8B, mesh, "model.remat=full"))
    assert kept == 2 * d and none == everything


def test_a_routed_expert_layer_keeps_its_rows_only_without_expert_parallelism():
    """Mixtral's block: without expert parallelism save_matmuls keeps the three grouped-GEMM outputs of its k rows
    per token; with it, only the experts' outputs once back home (k rows of D per token; with ep_buffer_factor=0
    none; with ep_save_gate_up also the gate and up outputs of the compact buffer's rows): the backward recomputes
    the experts, and the worst-case receive buffers (every peer sends every row) appear as the layer's
    intermediates instead."""
    d, hk, gk, f, h, k = 4096, 4096, 1024, 14336, 32, 2
    attention = 2 * (2 * d + 2 * hk + 2 * gk) + 4 * h
    mixtral = ("configs/mixtral_8x7b.yaml", "model.n_layers=1", "data.seq_len=2048", "data.batch_size=8")
    kept, everything, gradients = _per_token((*mixtral, "mesh.fsdp=8"))
    assert kept == attention + 2 * k * (2 * f + d)
    assert gradients == 3 * 2 * k * f  # the SwiGLU's dh, dg and du over the k rows of each token
    kept_ep, everything_ep, gradients_ep = _per_token((*mixtral, "mesh.fsdp=1", "mesh.expert=8"))
    assert kept_ep == attention + 2 * k * d
    assert gradients_ep == 3 * 2 * 8 * f  # over the worst-case buffer (below), which XLA plans for
    assert _per_token((*mixtral, "mesh.fsdp=1", "mesh.expert=8", "model.moe.ep_buffer_factor=0"))[0] == attention
    # ep_save_gate_up: also the gate and up outputs of the compact buffer's C rows (2 x 2,048 tokens x k = 8,192,
    # bf16, one expert per device: no padding), on top of what the layer keeps and twice on top of its
    # intermediates (the running layer's own slice is copied out of the stack)
    kept_save, everything_save, _ = _per_token((*mixtral, "mesh.fsdp=1", "mesh.expert=8",
                                                "model.moe.ep_save_gate_up=true"))
    assert kept_save - kept_ep == 2 * 2 * f * (2 * 2048 * k) / 2048
    assert everything_save - everything_ep == 2 * (kept_save - kept_ep)
    # P = 8 peers' worst case, min(k, 1 expert) = 1 row per token from each: 8 rows per token of gate, up and h
    assert everything_ep > 8 * 2 * 3 * f
    assert everything < 2 * k * 2 * (3 * f + d) + 4 * attention


def test_moe_models_estimate_every_stack():
    """DeepSeekMoE: a dense first layer and 27 MoE layers, each stack traced; remat=full adds one layer's
    intermediates once, not per layer."""
    report = memory_estimate.estimate(load_config(str(ROOT / "configs/deepseek_moe_16b.yaml"),
                                                  ["mesh.fsdp=8", "data.batch_size=8"]))
    assert set(report["layer_gb"]) == {"dense_blocks", "blocks"}
    assert report["layer_gb"]["dense_blocks"][0] == 1 and report["layer_gb"]["blocks"][0] == 27
    full = memory_estimate.estimate(load_config(str(ROOT / "configs/deepseek_moe_16b.yaml"),
                                                ["mesh.fsdp=8", "data.batch_size=8", "model.remat=full"]))
    per_layer = full["layer_gb"]["blocks"][1]
    assert per_layer == 2 * 2048 * 4096 / 1e9  # the block input, bf16, 4096 tokens per device
    assert 0 < full["transient_gb"] < report["activations_gb"] / 4


def test_mtp_modules_add_a_layer_each_and_their_logits():
    """model.mtp: each module is one more layer of the MoE kind (traced with its 2D-wide input) and one more set of
    logits (values and gradient, bf16)."""
    over = ["mesh.fsdp=8", "data.batch_size=8"]
    base = memory_estimate.estimate(load_config(str(ROOT / "configs/deepseek_moe_16b.yaml"), over))
    mtp = memory_estimate.estimate(load_config(str(ROOT / "configs/deepseek_moe_16b.yaml"),
                                               [*over, "model.mtp.depth=2"]))
    n, kept = mtp["layer_gb"]["mtp"]
    assert n == 2 and kept > base["layer_gb"]["blocks"][1]  # a MoE layer's residuals and its 2D-wide input
    logits = mtp["tokens_per_device"] * 2 * 2 * 102400 * 2 / 1e9
    # the running layer's transient: the largest over the stacks, the MTP module's with its wider input
    assert mtp["transient_gb"] >= base["transient_gb"]
    assert mtp["activations_gb"] == pytest.approx(
        base["activations_gb"] + 2 * kept + logits + mtp["transient_gb"] - base["transient_gb"], rel=1e-6)


def test_a_cuda_plugin_that_cannot_start_compiles_on_named_cpu_devices():
    """Where the CUDA plugin is installed but cannot start (no driver), jax falls back to its CPU backend: the dry run
    must still compile for the mesh's device count and say that it compiled for CPU devices, not a GPU topology."""
    code = ("import sys; from mx_jax import compat, train; compat.cuda_plugin_available = lambda: True; "
            "train.local_gpus = lambda: 2; sys.exit(train.main(sys.argv[1:]))")
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": ""}
    p = subprocess.run([sys.executable, "-c", code, "--dry-run", "--config", str(ROOT / "configs/moe_debug.yaml"),
                        "mesh.expert=2", "model.moe.exchange=ragged", "model.moe.all_to_all=pallas"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "compiled train step for 2 fake CPU devices (the CUDA plugin is installed but did not start)" in p.stdout
    assert "XLA:CPU attention keeps T x T scores" in p.stdout
    # a GPU plan's GPU-only paths compile as their CPU stand-ins (XLA:CPU has no ragged-all-to-all), said so
    assert "model.moe.exchange=ragged as dense, model.moe.all_to_all=pallas as xla (GPU-only paths)" in p.stdout


def test_a_mesh_the_config_does_not_divide_over_is_refused_before_the_estimate():
    """The dry run checks the batch, sequence and experts against its mesh before the estimate traces the model on
    it (16 expert devices for Mixtral's 8 experts crashed inside the trace with shard_map's error)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    for args, key in ((["--config", str(ROOT / "configs/mixtral_8x7b.yaml"), "mesh.fsdp=1", "mesh.expert=16"],
                       "'mesh.expert': 16 devices must divide model.moe.n_experts (8)"),
                      (["--config", str(ROOT / "configs/moe_debug.yaml"), "mesh.expert=8", "data.batch_size=12"],
                       "'data.batch_size': 12 must be a multiple")):
        p = subprocess.run([sys.executable, "-m", "mx_jax.train", "--dry-run", *args], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=300)
        assert p.returncode == 2 and key in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_the_trainer_takes_90_percent_of_gpu_memory_unless_told(monkeypatch):
    """JAX's allocator would take 75% of a GPU; `python -m mx_jax.train` sets 90% unless the environment chose a
    share (either name), and the dry run's fit check uses the share in force."""
    from mx_jax import train

    for var in memory_estimate.MEM_FRACTION_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delenv(train.ALLOCATOR_VAR, raising=False)  # restored after: the call sets the default
    train.apply_default_xla_flags()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9" and memory_estimate.mem_fraction() == 0.9
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.8")
    train.apply_default_xla_flags()
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ and memory_estimate.mem_fraction() == 0.8
    # 8B on one H200 with bf16 moments and full remat: ~104 GB, which fits 0.8 x 141 but not 0.7 x 141
    cfg = load_config(str(ROOT / "configs/llama3_8b.yaml"), ["mesh.fsdp=1", "data.batch_size=1", "model.remat=full",
                                                            "optim.moment_dtype=bfloat16"])
    assert memory_estimate.estimate(cfg)["fits"]["H200 141GB"]
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.7")
    report = memory_estimate.estimate(cfg)
    assert not report["fits"]["H200 141GB"] and "70% of capacity usable" in memory_estimate.format_report(report)


def test_the_dry_run_compiles_for_a_gpu_only_where_the_mesh_has_its_gpus(monkeypatch):
    """XLA's mock GPU topology cannot stand in for GPUs the machine lacks (RESULTS.md, session 33), so a mesh larger
    than the visible GPUs compiles on fake CPU devices, and says why."""
    from mx_jax import train

    assert train.dry_run_target(8, plugin=True, gpus=8) == ("8 of this machine's 8 GPU(s)", False)
    assert train.dry_run_target(2, plugin=True, gpus=8) == ("2 of this machine's 8 GPU(s)", False)
    target, cpu = train.dry_run_target(2, plugin=True, gpus=1)
    assert cpu and target.startswith("2 fake CPU devices (this machine has 1 GPU(s)")
    assert train.dry_run_target(4, plugin=False, gpus=0) == ("4 fake CPU devices", True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert train.local_gpus() == 0


@pytest.mark.parametrize("overrides, exchange", [
    (("mesh.fsdp=1", "mesh.expert=4"), "land"),  # as a GPU run with one process per node picks it
    (("mesh.fsdp=1", "mesh.expert=8"), "auto"),  # beyond dispatch.LAND_MAX_PEERS
    (("mesh.fsdp=1", "mesh.expert=4", "model.moe.exchange=dense"), "dense"),  # chosen by the user
    (("mesh.fsdp=4",), "auto"),  # no expert parallelism
])
def test_the_estimate_traces_the_exchange_a_gpu_run_picks(overrides, exchange):
    cfg = load_config(str(ROOT / "configs/mixtral_8x7b.yaml"), ["data.batch_size=8", *overrides])
    assert memory_estimate._gpu_config(cfg).model.moe.exchange == exchange
