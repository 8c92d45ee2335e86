"""Per-device memory of a training run, from shapes alone (`jax.eval_shape`): nothing is allocated.

    parameters   sum over weights of  size x 4 bytes / (product of the mesh axes sharding it)
    copies       the GEMM weights again in the compute dtype (2 bytes; llama.compute_copies), sharded alike
    gradients    the same (float32, same sharding)
    optimizer    AdamW moments: 2 x the parameter bytes, sharded like their parameters
    activations  tokens per device x layers x bytes saved per token per layer (below) + the logits

Bytes kept per token and layer for the backward pass, bf16 (2 bytes) unless noted, with flash attention
(no T x T scores are stored), D model, H*K query width, G*K key/value width, F feed-forward width:
    remat=none          2 (6D + 4HK + 5GK + 3F) + 4H (softmax statistics, f32; 3F: the SwiGLU's gate, up and h)
    remat=save_matmuls  2 (2D + 2HK + 2GK + 3F)   (linear outputs and attention only)
                        + (2D + HK + F) with an fp8 or MX recipe (each linear's fp8 transposed input, 1 byte)
    remat=full          2D                        (the block input; one block is recomputed at a time, +1 layer)
The logits add tokens x V x 2 bytes twice (values and gradient, in the compute dtype: bf16 unless compute is
f32). The estimate ignores XLA's temporary buffers and fragmentation; compile on the real mesh (train.py --dry-run
on a machine that has the devices) for an exact figure.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh

from mx_jax import sharding
from mx_jax.config import TrainConfig
from mx_jax.llama import COMPUTE_CAST, Llama, param_axes, params_of

GPUS_GB = {"H100 80GB": 80.0, "H200 141GB": 141.0, "B200 192GB": 192.0}


def _mesh_shape(cfg: TrainConfig) -> dict[str, int]:
    shape = {k: getattr(cfg.mesh, k) for k in sharding.MESH_AXES}
    free = [k for k, v in shape.items() if v == -1]
    if free:
        fixed = math.prod(v for v in shape.values() if v != -1)
        shape[free[0]] = max(1, jax.device_count() // fixed)
    return shape


def estimate(cfg: TrainConfig) -> dict:
    shape = _mesh_shape(cfg)
    mesh = AbstractMesh(tuple(shape.values()), tuple(shape.keys()))
    abstract_model = nnx.eval_shape(lambda: Llama(cfg.model, cfg.quant, rngs=nnx.Rngs(0)))
    params = params_of(abstract_model)
    logical = param_axes(abstract_model)
    n_params = 0
    param_bytes_dev = copy_bytes_dev = 0.0
    cdt = jnp.dtype(cfg.model.compute_dtype)
    for ax, (path, v) in zip(jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple)),
                             jax.tree_util.tree_leaves_with_path(params)):
        spec = sharding.fit_spec(sharding.spec(ax), v.shape, mesh)
        shards = 1
        for entry in spec:
            for a in ((entry,) if isinstance(entry, str) else (entry or ())):
                shards *= shape[a]
        n_params += v.size
        param_bytes_dev += v.size * v.dtype.itemsize / shards
        if path[-1].key in COMPUTE_CAST and v.dtype != cdt:
            copy_bytes_dev += v.size * cdt.itemsize / shards

    m = cfg.model
    d, hk, gk, f = m.d_model, m.n_heads * m.d_head, m.n_kv_heads * m.d_head, m.d_ff
    per_token_layer = {
        "none": 2 * (6 * d + 4 * hk + 5 * gk + 3 * f) + 4 * m.n_heads,
        "save_matmuls": 2 * (2 * d + 2 * hk + 2 * gk + 3 * f),
        "full": 2 * d,
    }[m.remat]
    if m.remat == "save_matmuls" and cfg.quant.recipe in ("fp8_tensorwise", "fp8_rowwise", "mxfp8"):
        per_token_layer += 2 * d + hk + f
    batch_shards = math.prod(shape[a] for a in sharding.batch_axes())
    micro_batch = cfg.data.batch_size // cfg.data.grad_accum_steps
    tokens_dev = micro_batch * cfg.data.seq_len / (batch_shards * shape["context"])
    layers = m.n_layers + (1 if m.remat == "full" else 0)
    logit_bytes = 4 if m.compute_dtype == "float32" else 2
    act = tokens_dev * (layers * per_token_layer + 2 * logit_bytes * m.vocab_size)
    gb = 1e9
    report = {
        "n_params": n_params,
        "mesh": shape,
        "devices": math.prod(shape.values()),
        "params_gb": param_bytes_dev / gb,
        "copies_gb": copy_bytes_dev / gb,
        "grads_gb": param_bytes_dev / gb,
        "optimizer_gb": 2 * param_bytes_dev / gb,
        "activations_gb": act / gb,
    }
    parts = ("params_gb", "copies_gb", "grads_gb", "optimizer_gb", "activations_gb")
    report["total_gb"] = sum(report[k] for k in parts)
    report["fits"] = {name: report["total_gb"] <= cap * 0.92 for name, cap in GPUS_GB.items()}
    return report


def format_report(r: dict) -> str:
    lines = [
        f"parameters      {r['n_params']:,} ({r['n_params'] / 1e9:.3f} B)",
        f"mesh            {r['mesh']} = {r['devices']} devices",
        "per device (estimate from shapes; nothing allocated):",
        f"  parameters    {r['params_gb']:8.2f} GB (float32)",
        f"  bf16 copies   {r['copies_gb']:8.2f} GB (GEMM weights in the compute dtype)",
        f"  gradients     {r['grads_gb']:8.2f} GB",
        f"  optimizer     {r['optimizer_gb']:8.2f} GB (AdamW moments)",
        f"  activations   {r['activations_gb']:8.2f} GB",
        f"  total         {r['total_gb']:8.2f} GB",
    ]
    for name, ok in r["fits"].items():
        lines.append(f"  fits {name:<10} {'yes' if ok else 'no'} (92% of capacity usable)")
    return "\n".join(lines)
