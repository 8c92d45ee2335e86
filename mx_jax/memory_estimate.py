"""Per-device memory of a training run, from shapes alone (`jax.eval_shape`, `jax.make_jaxpr`): nothing is allocated.

    parameters   sum over weights of  size x 4 bytes / (product of the mesh axes sharding it)
    copies       what the GEMMs read (llama.compute_copies), sharded like the weights: each GEMM weight in the
                 compute dtype (2 bytes), or under an fp8 recipe its two fp8 operands (2 bytes and the scales)
    gradients    the same sharding, in the dtype the train step differentiates in: the compute dtype for the GEMM
                 weights (llama.with_compute), the parameter dtype for the rest; plus a float32 sum of them
                 under gradient accumulation
    optimizer    AdamW moments: 2 x the parameters x the bytes of optim.moment_dtype, sharded like their parameters
    activations  sum over the layer stacks of  layers x the bytes one layer keeps for the backward
                 + the rest of one layer's intermediates (below)  + the logits

The bytes a layer keeps are not a formula kept beside the model: they are the residuals jax itself saves for one block's
backward (jax's `saved_residuals`, `compat.saved_residuals`, of the block under the run's remat policy), traced on the
run's mesh at its micro-batch, with the GEMM weights in the compute dtype as the train step feeds them. The weights
themselves are not counted again; the block's input is (the layer loop stacks it). A residual made outside any
`shard_map` has the global activation's shape and is divided over the batch and context shards; one made inside
(the MoE layer, context-parallel attention) comes out of jax stacked over every device and is divided by their
number. Attention is traced as the GPU runs it, cuDNN flash attention (output and softmax statistics kept, no
T x T scores), without needing cuDNN here (`compat.cudnn_shapes_only`).

For a dense block this comes to, per token and layer (2 bytes per bf16 element; D model, H*K query width, G*K
key/value width, F feed-forward width; tests/test_dry_run.py checks the trace against these):
    remat=save_matmuls  2 (2D + 2HK + 2GK + 2F) + 4H   x, q|k|v, attention's output and f32 statistics, the residual
                                                      stream after attention, gate|up (the configs' default)
                        + (2D + HK + F)               with an fp8 or MX recipe: each linear's 1-byte transposed input
    remat=full          2D                            the block input
    remat=none          every intermediate the backward reads (about twice save_matmuls for the 8B block), and
                        each layer's concatenated q|k|v and gate|up weights (weight-shaped residuals count whole)
A routed-expert layer under save_matmuls keeps, without expert parallelism, its three grouped GEMMs' outputs for
every (token, expert) row, 2k (2F + D) bytes per token plus row padding; with expert parallelism only the experts'
outputs once back home, 2kD bytes per token (with model.moe.ep_buffer_factor > 0, the default; with 0 nothing): the
backward recomputes the experts, and the combine's exchange with them under 0 (mx_jax/dispatch.py, "Two expert
buffers"); with model.moe.ep_save_gate_up also the compact buffer's gate and up outputs, 2 x 2F bytes per row of it.
On top of what every layer keeps, the layer whose backward is running holds the rest of its intermediates (under
remat, recomputed): the largest of (remat=none minus kept) over the stacks, counted once. With expert parallelism
that includes the dispatch's receive buffers and the expert GEMMs run over them, sized for the worst routing
(dispatch.peer_bound: P peers x min(k, experts per device) rows per token, dropless), which dominate at large P.
The backward also holds gradients, which no residual list shows. The largest are the SwiGLU's: h = silu(g) u over
R rows of width F is differentiated in one fused pass that reads g, u and dh and writes dg, du and the h the down
GEMM's weight gradient reads, six (R, F) buffers at once, of which remat=none lists three. So the transient adds
3 R F x 2 bytes for the widest SwiGLU of the stack (R: the tokens of a device for a dense FFN; the expert buffer's
rows for routed experts, the worst-case W = P peer_bound rows under expert parallelism, whose branch XLA plans
for even where the compact buffer runs). With model.moe.ep_save_gate_up the running layer's saved gate and up
outputs count twice: the backward's loop copies its layer's slice out of the stack into a buffer of its own.
XLA's buffer assignment for the 2-layer Mixtral step at expert=2 on 2 x H200 puts its peak in that fused pass of
the whole-buffer branch, with the running layer's slice copies beside it. Against measured peaks and XLA's compiled
figures of 8B, Mixtral and DeepSeekMoE steps on 1 to 4 H200s the total reads -6% to +7%, but +14-15% for two short
steps measured after the head's weight gradient was fenced (mx_jax/llama.py), the 8-layer 8B (+11% before the
fence) and the 4-layer DeepSeekMoE at expert=2 (`benchmarks/estimate_check.py`; benchmarks/RESULTS.md, session 60).
The logits add tokens x V x 2 bytes twice (values and gradient, in the compute dtype: bf16 unless compute is
f32), and as much again for each multi-token prediction module (model.mtp), whose layers count as one more stack.
XLA's own workspace and fragmentation are not counted, and XLA may fuse away a residual jax lists (remat=none
unrolled, mostly); `train.py --dry-run` also compiles the step for the mesh and prints XLA's figure beside this one.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

from mx_jax import compat, dispatch, sharding
from mx_jax.config import TrainConfig
from mx_jax.layers import Positions, attention_impl
from mx_jax.llama import (COMPUTE_CAST, Llama, compute_axes, compute_copies, layer_body, param_axes, params_of,
                          plan_for_run, rope_inv_freq, with_compute, with_operands)

# model.max_documents=0 is set from the data when training starts (and by --dry-run where the data opens); an
# estimate made without it assumes this.
DOCUMENTS_ASSUMED = 16
GPUS_GB = {"H100 80GB": 80.0, "H200 141GB": 141.0, "B200 192GB": 192.0}
# The share of each GPU's memory that JAX's allocator may take in a training run. JAX's own default is 0.75 (jax
# 0.11.2 on an H200: a 104.9 GiB limit of 139.8 GiB), which left the full 8B model with float32 AdamW moments out of
# memory on one H200 at an estimated 136 GB. `python -m mx_jax.train` sets XLA_PYTHON_CLIENT_MEM_FRACTION to this
# unless the environment chose a share (train.apply_default_xla_flags); the rest of the GPU stays for the CUDA
# context and the cuBLAS, cuDNN and NCCL workspaces. The fit check uses the share in force.
GPU_MEM_FRACTION = 0.9
MEM_FRACTION_VARS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")


def mem_fraction() -> float:
    """The GPU memory share a run started from this environment gets (see GPU_MEM_FRACTION)."""
    for var in MEM_FRACTION_VARS:
        if os.environ.get(var):
            return float(os.environ[var])
    return GPU_MEM_FRACTION


def _mesh_shape(cfg: TrainConfig) -> dict[str, int]:
    shape = {k: getattr(cfg.mesh, k) for k in sharding.MESH_AXES}
    free = [k for k, v in shape.items() if v == -1]
    if free:
        fixed = math.prod(v for v in shape.values() if v != -1)
        shape[free[0]] = max(1, jax.device_count() // fixed)
    return shape


def _gpu_config(cfg: TrainConfig) -> TrainConfig:
    """The config as a GPU run with one process per node runs it (launch/slurm.sbatch's default): attention "auto"
    resolved for the GPU (cuDNN where it takes the shapes), and the MoE exchange "auto" as `dispatch.pick_exchange`
    resolves it where the NVLink kernels run: "land" on a flat dispatch over 2 to LAND_MAX_PEERS expert devices. The
    trace then takes the land exchange's XLA reference (impl "xla"), whose outputs have the kernel's shapes; a CPU
    trace of "auto" would take the dense exchange, whose worst-case chunks keep more."""
    m = cfg.model
    attention = attention_impl(m.attention, m.compute_dtype, m.attention_dim, platform="gpu")
    moe = m.moe
    if (moe.n_experts and moe.exchange == "auto" and moe.dispatch == "flat"
            and 1 < _mesh_shape(cfg)["expert"] <= dispatch.LAND_MAX_PEERS):
        moe = dataclasses.replace(moe, exchange="land", all_to_all="xla")
    return dataclasses.replace(cfg, model=dataclasses.replace(m, attention=attention, moe=moe))


def layer_residuals(cfg: TrainConfig, abstract_model: Llama,
                    mesh: AbstractMesh) -> dict[str, tuple[int, float, float, float]]:
    """{stack: (layers, bytes one layer keeps per device under cfg.model.remat, what its backward holds at most: the
    same under remat=none plus the SwiGLU's gradients, those gradients alone)}.

    Each stack's layer is traced as `llama._scan` runs it (`llama.layer_body`), at the global micro-batch."""
    m = cfg.model
    shape = dict(mesh.shape)
    n_dev = math.prod(shape.values())
    act_shards = math.prod(shape[a] for a in sharding.batch_axes()) * shape["context"]
    cdt = jnp.dtype(m.compute_dtype)
    x = jax.ShapeDtypeStruct((cfg.data.batch_size // cfg.data.grad_accum_steps, cfg.data.seq_len, m.d_model), cdt)
    plan = plan_for_run(abstract_model.plan, m, x.shape[0], cfg.data.seq_len, shape)
    copies = jax.eval_shape(lambda p: compute_copies(m, p, plan), params_of(abstract_model))
    inv_freq = rope_inv_freq(m.rope_dim, m.rope_theta, m.rope_scaling)
    micro_batch, seq = x.shape[:2]
    positions = Positions(jnp.arange(seq), jnp.zeros((micro_batch, seq), jnp.int32)
                          if m.attention_mask == "documents" else None)

    def one(aval, origin) -> tuple[float, bool]:
        """(bytes of one residual per device, whether it is an activation); (0, False) where it is not counted."""
        if origin.startswith(("from a constant", "from a literal")) or "layer_state" in origin:
            return 0.0, False  # positions are shared by every layer; the weights are counted above
        nbytes = aval.size * aval.dtype.itemsize
        if "shard_map" in origin:
            return nbytes / n_dev, True
        if "quant.py" in origin and aval.shape[:1] == (act_shards,):
            return nbytes / act_shards, True  # a linear's per-device residuals, stacked over the token shards
        if micro_batch * seq in aval.shape or (aval.shape[:1] == (micro_batch,) and seq in aval.shape[1:]):
            return nbytes / act_shards, True  # an activation, (B, T, ...), (B, H, T) or (tokens, ...) transposed
        return nbytes, False  # weight-shaped (remat=none keeps each layer's concatenated and fp8 weights): whole

    def per_device(residuals) -> float:
        return sum(one(aval, origin)[0] for aval, origin in residuals)

    # The widest SwiGLU's backward (see the module docstring): three more (rows, F) buffers in the compute dtype
    # than the intermediates remat=none lists, with rows those of its largest (rows, F) or (rows, 2F) activation.
    def swiglu_gradients(residuals, widths) -> float:
        slab = 0.0
        for aval, origin in residuals:
            nbytes, activation = one(aval, origin)
            for f in widths:
                if activation and aval.shape[-1] in (f, 2 * f):
                    slab = max(slab, nbytes / aval.dtype.itemsize * f / aval.shape[-1] * cdt.itemsize)
        return 3 * slab

    # The layer's transient figure (remat=none) counts the routed experts run over the whole receive buffer, as a
    # device whose rows overflow the compact one runs them. With the compact buffer on they run inside a custom VJP
    # whose backward recomputes them, out of saved_residuals' sight, so that pass traces the model without it.
    # With model.moe.ep_save_gate_up that custom VJP also saves the compact buffer's gate and up outputs: counted
    # in what each layer keeps, and twice on top of the whole buffer's intermediates (the layer whose backward runs
    # holds its own slice of them beside the stack, also in the branch that runs the whole buffer), so the transient
    # figure is taken against the layer that does not save them.
    whole = plain = abstract_model
    if m.moe.n_experts and m.moe.ep_buffer_factor:
        no_compact = dataclasses.replace(m, moe=dataclasses.replace(m.moe, ep_buffer_factor=0.0))
        whole = nnx.eval_shape(lambda: Llama(no_compact, cfg.quant, rngs=nnx.Rngs(0)))
        if m.moe.ep_save_gate_up:
            no_save = dataclasses.replace(m, moe=dataclasses.replace(m.moe, ep_save_gate_up=False))
            plain = nnx.eval_shape(lambda: Llama(no_save, cfg.quant, rngs=nnx.Rngs(0)))
    out = {}
    for name in ("dense_blocks", "blocks", "mtp"):
        if not hasattr(abstract_model, name):
            continue
        # an MTP module (llama.MTPLayer) takes [embedded tokens ahead; hidden state], 2D wide, and keeps it
        x_in = x if name != "mtp" else jax.ShapeDtypeStruct((*x.shape[:2], 2 * m.d_model), cdt)
        graphdef, state = nnx.split(getattr(abstract_model, name))
        whole_graphdef = nnx.split(getattr(whole, name))[0]
        # One layer's weights as the train step feeds them: compute-dtype copies, or slots with fp8 operands.
        fed = jax.eval_shape(lambda p, c: with_operands(with_compute(p, c, cdt), c), nnx.to_pure_dict(state),
                             copies.get(name, {}))
        layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), fed)
        n_layers = jax.tree.leaves(state)[0].shape[0]
        traces = [(graphdef, m.remat), (whole_graphdef, "none")]
        if plain is not abstract_model:
            traces.append((nnx.split(getattr(plain, name))[0], m.remat))
        f_expert = m.moe.d_expert or m.d_ff
        moe_stack = name == "mtp" or name == "blocks"
        widths = {f_expert, m.moe.n_shared * f_expert} - {0} if moe_stack and m.moe.n_experts else {m.d_ff}
        kept, gradients = [], 0.0
        for g, remat in traces:
            if len(kept) == 1 and whole is abstract_model and remat == m.remat:
                kept.append(kept[0])  # remat=none and no compact buffer: the same trace
                continue
            body = layer_body(g, positions, inv_freq, remat)
            with jax.sharding.use_abstract_mesh(mesh), compat.cudnn_shapes_only():
                residuals = compat.saved_residuals(body, x_in, layer)
            kept.append(per_device(residuals))
            if len(kept) <= 2:
                gradients = max(gradients, swiglu_gradients(residuals, widths))  # remat=none: the widest
        everything = kept[1] + gradients
        if len(kept) == 3:
            # The saved gate and up outputs: every layer's in the stack, and the running layer's own once more,
            # copied out of the stack by the backward's loop for the branch that reads them (above).
            everything += 2 * (kept[0] - kept[2])
        out[name] = (n_layers, kept[0], everything, gradients)
    return out


def estimate(cfg: TrainConfig) -> dict:
    cfg = _gpu_config(cfg)
    shape = _mesh_shape(cfg)
    mesh = AbstractMesh(tuple(shape.values()), tuple(shape.keys()), axis_types=(AxisType.Auto,) * len(shape))
    abstract_model = nnx.eval_shape(lambda: Llama(cfg.model, cfg.quant, rngs=nnx.Rngs(0)))
    params = params_of(abstract_model)
    plan = plan_for_run(abstract_model.plan, cfg.model, cfg.data.batch_size // cfg.data.grad_accum_steps,
                        cfg.data.seq_len, shape)
    logical = param_axes(abstract_model, plan=plan)
    n_params = 0
    param_bytes_dev = grad_bytes_dev = moment_bytes_dev = 0.0
    moment_size = jnp.dtype(cfg.optim.moment_dtype).itemsize
    m, cdt = cfg.model, jnp.dtype(cfg.model.compute_dtype)

    def shards(ax, v) -> int:
        out = 1
        for entry in sharding.param_spec(ax, v.shape, mesh):
            for a in sharding.entry_axes(entry):
                out *= shape[a]
        return out

    for ax, (path, v) in zip(jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple)),
                             jax.tree_util.tree_leaves_with_path(params)):
        n_params += v.size
        param_bytes_dev += v.size * v.dtype.itemsize / shards(ax, v)
        moment_bytes_dev += 2 * v.size * moment_size / shards(ax, v)
        gemm = path[-1].key in COMPUTE_CAST and v.dtype != cdt  # differentiated in the compute dtype
        grad_bytes_dev += v.size * (cdt if gemm else v.dtype).itemsize / shards(ax, v)
    # What the GEMMs read: compute-dtype copies and fp8 operands (llama.compute_copies), sharded like their weights.
    copies = jax.eval_shape(lambda p: compute_copies(m, p, plan), params)
    copy_bytes_dev = sum(jax.tree.leaves(jax.tree.map(lambda v, ax: v.size * v.dtype.itemsize / shards(ax, v), copies,
                                                      compute_axes(copies, logical))))

    batch_shards = math.prod(shape[a] for a in sharding.batch_axes())
    micro_batch = cfg.data.batch_size // cfg.data.grad_accum_steps
    tokens_dev = micro_batch * cfg.data.seq_len / (batch_shards * shape["context"])
    stacks = layer_residuals(cfg, abstract_model, mesh)
    logit_bytes = 4 if m.compute_dtype == "float32" else 2
    kept_all = sum(n * kept for n, kept, *_ in stacks.values())
    # The layer whose backward is running holds all of its intermediates at once (recomputed under remat).
    transient = max(everything - kept for _, kept, everything, _ in stacks.values())
    # cuDNN's packed attention (model.attention_mask=documents) takes a backward workspace of B M N T (8 K + 4)
    # bytes for a device's B rows (XLA's compiled figure, benchmarks/bench_documents.py), M as the trainer sets it.
    workspace = 0.0
    if (m.attention_mask == "documents"
            and attention_impl(m.attention, m.compute_dtype, m.attention_dim, "gpu") == "cudnn"):
        rows = micro_batch / (batch_shards * shape["context"])
        workspace = (rows * (m.max_documents or DOCUMENTS_ASSUMED) * m.n_heads * cfg.data.seq_len
                     * (8 * m.attention_dim + 4))
    transient += workspace
    # the model's logits and each MTP module's (model.mtp), values and gradients
    act = kept_all + transient + tokens_dev * 2 * logit_bytes * m.vocab_size * (1 + m.mtp.depth)
    gb = 1e9
    report = {
        "n_params": n_params,
        "mesh": shape,
        "devices": math.prod(shape.values()),
        "params_gb": param_bytes_dev / gb,
        "copies_gb": copy_bytes_dev / gb,
        # With gradient accumulation the sum is float32 (train.make_train_step), beside each micro-step's gradients.
        "grads_gb": (grad_bytes_dev + (param_bytes_dev if cfg.data.grad_accum_steps > 1 else 0)) / gb,
        "optimizer_gb": moment_bytes_dev / gb,
        "activations_gb": act / gb,
        "tokens_per_device": tokens_dev,
        "layer_gb": {name: (n, kept / gb) for name, (n, kept, *_) in stacks.items()},
        "transient_gb": transient / gb,
        "attention_workspace_gb": workspace / gb,
        "max_documents": m.max_documents or DOCUMENTS_ASSUMED,
    }
    parts = ("params_gb", "copies_gb", "grads_gb", "optimizer_gb", "activations_gb")
    report["total_gb"] = sum(report[k] for k in parts)
    report["mem_fraction"] = mem_fraction()
    report["fits"] = {name: report["total_gb"] <= cap * report["mem_fraction"] for name, cap in GPUS_GB.items()}
    return report


def format_report(r: dict) -> str:
    lines = [
        f"parameters      {r['n_params']:,} ({r['n_params'] / 1e9:.3f} B)",
        f"mesh            {r['mesh']} = {r['devices']} devices",
        "per device (estimate from shapes; nothing allocated):",
        f"  parameters    {r['params_gb']:8.2f} GB (float32)",
        f"  GEMM copies   {r['copies_gb']:8.2f} GB (GEMM weights in the compute dtype, or their fp8 operands)",
        f"  gradients     {r['grads_gb']:8.2f} GB (GEMM weights' in the compute dtype)",
        f"  optimizer     {r['optimizer_gb']:8.2f} GB (AdamW moments)",
        f"  activations   {r['activations_gb']:8.2f} GB ({r['tokens_per_device']:,.0f} tokens of each micro-batch)",
        *(f"    {name:<12}  {n} x {kept:.3f} GB kept per layer for the backward" for name, (n, kept) in
          r["layer_gb"].items()),
        f"    transient     {r['transient_gb']:8.2f} GB (one layer's backward: the rest of its intermediates, "
        "its SwiGLU's gradients" + (f", {r['attention_workspace_gb']:.2f} GB of cuDNN workspace for "
                                    f"{r['max_documents']} documents per sequence" if r["attention_workspace_gb"]
                                    else "") + ")",
        f"  total         {r['total_gb']:8.2f} GB",
    ]
    for name, ok in r["fits"].items():
        lines.append(f"  fits {name:<10} {'yes' if ok else 'no'} ({r['mem_fraction']:.0%} of capacity usable: "
                     f"XLA_PYTHON_CLIENT_MEM_FRACTION)")
    return "\n".join(lines)
