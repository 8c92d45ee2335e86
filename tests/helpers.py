"""Shared test fixtures: a tiny config and a way to run the trainer in-process."""

from __future__ import annotations

import os

from mx_jax import compat
from mx_jax.config import TrainConfig, load_config

TINY = [
    "model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=128", "model.compute_dtype=float32", "data.seq_len=32", "data.batch_size=16",
    "optim.warmup_steps=2", "optim.lr_peak=1e-3", "log.every_steps=1", "log.eval_every_steps=0",
    "log.progress=false", "log.tensorboard=false", "ckpt.every_steps=0", "data.eval_batches=1",
]
# Multi-head latent attention (model.mla) on TINY's 4 heads: a query latent, value heads wider than the query and
# key heads (16 + 8 = 24 < 32, so attention pads q and k), one rotated key of 8 shared by the heads.
MLA = ["model.mla.kv_rank=16", "model.mla.q_rank=12", "model.mla.nope_dim=16", "model.mla.rope_dim=8",
       "model.mla.v_dim=32", "model.n_kv_heads=4"]
# For in-process runs that check only the math or the layouts: no final evaluation (NO_EVAL) and no final
# checkpoint either (NO_IO); they cost ~12 s of a 2-core CI machine per run on 8 devices (the eval step's compile,
# Orbax's save).
NO_EVAL = "log.eval_every_steps=-1"
NO_IO = ("ckpt.every_steps=-1", NO_EVAL)


# XLA:CPU compile options for every test process (conftest.py adds them to this process's XLA_FLAGS; tests that start
# a process with their own XLA_FLAGS build them with `xla_flags`). The suite's time is mostly XLA:CPU compiling tiny
# programs: LLVM at -O0 and (jax 0.10.2) the older elemental fusion emitters compile the 8-device fp8 MoE train step
# in 7.5 s instead of 17 s (2 cores), and tiny programs run about as fast either way. GPU runs (MX_JAX_TEST_GPU=1)
# keep the defaults: these flags would also reach the GPU backend's LLVM. The flags per jax version:
# mx_jax/compat.py.
FAST_CPU_COMPILE = compat.XLA_CPU_FAST_COMPILE


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test subprocess: `devices` fake CPU devices (None: jax's default of one per process, or what
    MX_JAX_CPU_DEVICES asks), and FAST_CPU_COMPILE unless the suite runs on a GPU."""
    flags = [] if devices is None else [f"--xla_force_host_platform_device_count={devices}"]
    if os.environ.get("MX_JAX_TEST_GPU") != "1":
        flags.append(FAST_CPU_COMPILE)
    return " ".join(flags)


def tiny_config(run_dir, *overrides: str) -> TrainConfig:
    return load_config(None, TINY + [f"run_dir={run_dir}", *overrides])


def lowered_train_step(cfg: TrainConfig, n_devices: int):
    """The train step of `cfg` on its mesh over the first `n_devices` devices, lowered (not compiled) with abstract
    state and batch: `.as_text()` for the program before XLA, `.compile().as_text()` after the partitioner."""
    import jax
    import jax.numpy as jnp

    from mx_jax import sharding, train

    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:n_devices])
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        shape = (cfg.data.grad_accum_steps, cfg.data.batch_size // cfg.data.grad_accum_steps, cfg.data.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=v) for k, v in setup.batch_shardings.items()}
        return train.make_train_step(setup).lower(train.abstract_state(setup), batch)


def worst_line_rel(out, ref) -> float:
    """The largest relative error of any row or column of a 2-D result (rows and columns with a nonzero reference):
    a whole-matrix norm hides one wrong row of thousands, this does not."""
    import numpy as np

    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = []
    for axis in (1, 0):
        norms = np.linalg.norm(ref, axis=axis)
        live = norms > 0
        err.append((np.linalg.norm(out - ref, axis=axis)[live] / norms[live]).max())
    return float(max(err))


def need_devices(n: int) -> None:
    """Skip the calling test unless jax has `n` devices (the CPU suite forces 8; a GPU run has its GPUs)."""
    import jax
    import pytest

    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, jax has {jax.device_count()}")
