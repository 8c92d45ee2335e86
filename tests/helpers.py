"""Shared test fixtures: a tiny config and a way to run the trainer in-process."""

from __future__ import annotations

from mx_jax.config import TrainConfig, load_config

TINY = [
    "model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=128", "model.compute_dtype=float32", "data.seq_len=32", "data.batch_size=16",
    "optim.warmup_steps=2", "optim.lr_peak=1e-3", "log.every_steps=1", "log.eval_every_steps=0",
    "log.progress=false", "log.tensorboard=false", "ckpt.every_steps=0", "data.eval_batches=1",
]


def tiny_config(run_dir, *overrides: str) -> TrainConfig:
    return load_config(None, TINY + [f"run_dir={run_dir}", *overrides])
