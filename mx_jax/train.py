"""`python -m mx_jax.train --config configs/X.yaml [--dry-run] [key=value ...]`: train a Llama on a device mesh.

The loop, per step: fetch this host's slice of the global batch -> one jitted, donated `train_step` (gradient
accumulation is a scan inside it) -> read the previous step's metrics (one step behind, so the host never stalls
the device) -> log / evaluate / checkpoint on schedule. A NaN or Inf loss stops the run and names the step; no
checkpoint of a diverged state is written.

Train state: {"step": int32, "params": nested dict of float32 arrays, "compute": what the GEMMs read
(llama.compute_copies: the GEMM weights' compute-dtype copies, and under an fp8 recipe the dense linears' and, when
llama.plan_for_run says so, the routed experts' fp8 operands), "buffers": MoE router biases, "opt_state": optax
state}, sharded by `sharding.RULES` (the optimizer moments and the copies take their parameter's sharding). The step
differentiates `llama.with_compute(params, compute)`: the GEMM weights in the compute dtype (zero slots where the
layers read fp8 operands, llama.with_operands), whose gradients arrive in bf16 and are upcast for the clipping norm
and AdamW. Where the mesh splits the tokens, the dense linears' per-device partial gradients are summed across
devices in model.grad_reduce_dtype (float32 by default, quant._grad_w_dtype) and rounded after the sum; the routed
experts' are summed in bf16 (they leave the MoE layer's shard_map as bf16 per-device partials, and the GPU profiles
show bf16 reduce-scatters and all-reduces for them, benchmarks/RESULTS.md session 38). The update writes the new
masters and makes their new copies and operands. Checkpoints hold everything but "compute", which is made again
from the restored masters.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import pathlib
import re
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mx_jax import checkpoint, choices, compat, layers, metrics, perplexity, preemption, profiling, sharding
from mx_jax.config import ConfigError, ModelConfig, TrainConfig, load_config, mixture_entries, to_dict, to_yaml
from mx_jax.data import (MIXTURE_ROUND, Batches, Dataset, Mixture, Prefetch, Windows, documents_per_window,
                         mixture_quota, open_dataset, read_meta)
from mx_jax.llama import (LinearPlan, Llama, buffers_of, compute_axes, compute_copies, cross_entropy, flops_per_token,
                          head_vocab_axes, moe_loss, mtp_targets, param_axes, params_of, plan_for_run, update_buffers,
                          with_compute, with_operands)
from mx_jax.moe import RouterBias
from mx_jax.optim import global_norm, make_optimizer, schedule


def log(msg: str) -> None:
    if jax.process_index() == 0:
        try:
            from tqdm import tqdm
            tqdm.write(msg, file=sys.stdout)
        except ImportError:
            print(msg, flush=True)
        sys.stdout.flush()


class _LogLines(logging.Handler):
    """mx_jax's logged warnings (some come at trace time, e.g. dispatch.expert_recipe's) as log lines, above the
    progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        log(f"warn   | {record.getMessage()}")


# ---------------------------------------------------------------------------------------------------------------
# Model, state and shardings


@dataclasses.dataclass
class Setup:
    """Everything derived from the config and the mesh, before any array is allocated."""

    cfg: TrainConfig
    mesh: jax.sharding.Mesh
    graphdef: Any
    abstract: dict  # the train state as ShapeDtypeStructs (no shardings)
    param_shardings: Any
    optimizer: optax.GradientTransformation
    state_shardings: Any
    batch_shardings: dict[str, NamedSharding]
    plan: LinearPlan  # each linear's recipe (llama.plan_linears); its notes name the linears kept in bf16

    @property
    def notes(self) -> tuple[str, ...]:
        return self.plan.notes


def _opt_shardings(abstract_opt, param_shardings: dict, mesh) -> Any:
    """Each optimizer leaf takes the sharding of the parameter whose path it ends with (same shape), else replicated."""
    flat = {tuple(_key(k) for k in path): s for path, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}
    replicated = NamedSharding(mesh, P())

    def pick(path, leaf):
        keys = tuple(_key(k) for k in path)
        for i in range(len(keys)):
            s = flat.get(keys[i:])
            if s is not None and len(s.spec) <= leaf.ndim:
                return s
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_opt)


def _key(k) -> Any:
    return getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))


def _shardings_for(mesh, logical: dict, abstract: dict) -> dict:
    # `abstract` leads: its leaves meet the logical axes tuples (pytree nodes themselves) whole.
    return jax.tree.map(lambda v, ax: sharding.named(mesh, ax, v.shape), abstract, logical)


def _abstract(tree) -> dict:
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), tree)


def build(cfg: TrainConfig, mesh: jax.sharding.Mesh) -> Setup:
    abstract_model = nnx.eval_shape(lambda: Llama(cfg.model, cfg.quant, rngs=nnx.Rngs(cfg.seed)))
    graphdef, _, _ = nnx.split(abstract_model, nnx.Param, ...)
    abstract_params = _abstract(params_of(abstract_model))
    abstract_buffers = _abstract(buffers_of(abstract_model))
    plan = plan_for_run(abstract_model.plan, cfg.model, cfg.data.batch_size // cfg.data.grad_accum_steps,
                        cfg.data.seq_len, dict(mesh.shape))
    param_shardings = _shardings_for(mesh, param_axes(abstract_model, plan=plan), abstract_params)
    optimizer = make_optimizer(cfg.optim, cfg.steps)
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    abstract_compute = jax.eval_shape(lambda p: compute_copies(cfg.model, p, plan), abstract_params)
    compute_logical = compute_axes(abstract_compute, param_axes(abstract_model, plan=plan))
    state_shardings = {
        "step": NamedSharding(mesh, P()),
        "params": param_shardings,
        "compute": _shardings_for(mesh, compute_logical, abstract_compute),
        "buffers": _shardings_for(mesh, param_axes(abstract_model, RouterBias), abstract_buffers),
        "opt_state": _opt_shardings(abstract_opt, param_shardings, mesh),
    }
    bspec = P(None, sharding.batch_axes(), sharding.RULES["seq"])
    batch_shardings = {k: NamedSharding(mesh, bspec) for k in ("inputs", "targets")}
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": abstract_params,
                "compute": abstract_compute, "buffers": abstract_buffers, "opt_state": abstract_opt}
    return Setup(cfg, mesh, graphdef, abstract, param_shardings, optimizer, state_shardings, batch_shardings, plan)


def abstract_state(setup: Setup) -> dict:
    """The train state as ShapeDtypeStructs carrying their shardings (restore target, dry-run input)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), setup.abstract,
                        setup.state_shardings)


def saved_part(state: dict) -> dict:
    """What a checkpoint holds: the state without the compute copies (derived from the masters)."""
    return {k: v for k, v in state.items() if k != "compute"}


def with_fresh_compute(setup: Setup, state: dict) -> dict:
    """`state` with its compute copies cast from its masters (after a restore or an HF import)."""
    cast = jax.jit(lambda p: compute_copies(setup.cfg.model, p, setup.plan),
                   out_shardings=setup.state_shardings["compute"])
    return {**state, "compute": cast(state["params"])}


def init_state(setup: Setup) -> dict:
    cfg = setup.cfg

    def init():
        model = Llama(cfg.model, cfg.quant, rngs=nnx.Rngs(cfg.seed))
        params = params_of(model)
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "compute": compute_copies(cfg.model, params, setup.plan),
                "buffers": buffers_of(model), "opt_state": setup.optimizer.init(params)}

    return jax.jit(init, out_shardings=setup.state_shardings)()


# ---------------------------------------------------------------------------------------------------------------
# Steps


def make_loss_fn(setup: Setup, mtp: bool = True):
    """loss_fn(params, buffers, inputs, targets, count, micro=1) -> (cross-entropy + MTP term + MoE balancing terms
    / micro, (cross-entropy, stats, MTP cross-entropy)): each cross-entropy is summed over the counted targets (not
    -1) and divided by `count` (llama.cross_entropy); with `micro` microbatches the step adds their losses.

    With model.mtp.depth D > 0 (and `mtp`; the held-out loss leaves it out) the MTP term is DeepSeek-V3's
    loss_scale / D x sum_k CE_k, CE_k the k-th module's cross-entropy against the targets k ahead
    (llama.mtp_targets) over the same `count`, the paper's 1/T; the third element is CE_k for k = 1 .. D, (D,)
    (empty without MTP)."""
    graphdef, model_cfg = setup.graphdef, setup.cfg.model
    depth = model_cfg.mtp.depth if mtp else 0

    def loss_fn(params, buffers, inputs, targets, count, micro=1):
        model = nnx.merge(graphdef, params, buffers)
        vocab_parallel = bool(head_vocab_axes(model_cfg, setup.plan.recipes["head"], targets.size))
        if depth:
            logits, stats, ahead = model(inputs, logits_dtype=model_cfg.compute_dtype, mtp=True)
            mtp_ce = jnp.stack([cross_entropy(z, mtp_targets(targets, k), vocab_parallel, count)
                                for k, z in enumerate(ahead, 1)])
        else:
            logits, stats = model(inputs, logits_dtype=model_cfg.compute_dtype)
            mtp_ce = jnp.zeros((0,), jnp.float32)
        ce = cross_entropy(logits, targets, vocab_parallel, count)
        loss = ce + model_cfg.mtp.loss_scale * jnp.sum(mtp_ce) / max(depth, 1) + moe_loss(model_cfg, stats) / micro
        return loss, (ce, stats, mtp_ce)

    return loss_fn


def _moe_metrics(stats: dict, expert_devices: int = 1, top_k: int = 1) -> dict:
    """Scalars for the log from per-layer MoE statistics (load: (layers, E) assignment counts). With expert
    parallelism over `expert_devices` (P), device p holds experts [p E/P, (p+1) E/P) and computes their rows. A
    layer's exchange and expert GEMMs last as long as its busiest device's, so the experts take about
    moe_ep_max_over_mean = mean over layers l of max_p(load_lp) / mean_p(load_lp) times as long as under balanced
    routing (from the router's choices before capacity drops, summed over the data axes). The dispatch's rows sent
    to another node and to another GPU of the same node (model.moe.gpus_per_node) per token, averaged over layers:
    moe_cross_node_rows_per_token, moe_intra_node_rows_per_token (the tokens are the load's sum over top_k)."""
    if not stats:
        return {}
    load = stats["load"]
    share = load / jnp.sum(load, axis=-1, keepdims=True)  # (layers, E), rows sum to 1
    ep = {}
    if expert_devices > 1:
        per_device = jnp.sum(share.reshape(share.shape[0], expert_devices, -1), axis=-1)  # (layers, P)
        ep = {"moe_ep_max_over_mean": jnp.mean(jnp.max(per_device, axis=-1) * expert_devices)}
        if "rows_cross_node" in stats:
            tokens = jnp.sum(load, axis=-1) / top_k  # (layers,)
            ep["moe_cross_node_rows_per_token"] = jnp.mean(stats["rows_cross_node"] / tokens)
            ep["moe_intra_node_rows_per_token"] = jnp.mean(stats["rows_intra_node"] / tokens)
    return {
        **ep,
        "moe_aux_loss": jnp.mean(stats["aux_loss"]),
        "moe_z_loss": jnp.mean(stats["z_loss"]),
        "moe_dropped_frac": jnp.mean(stats["dropped"]),
        "moe_max_over_mean_load": jnp.mean(jnp.max(share, axis=-1) * share.shape[-1]),
        # the share of MoE layers (and devices) whose rows overflowed expert parallelism's compact expert buffer
        # and ran the worst-case one (model.moe.ep_buffer_factor)
        "moe_ep_overflow_frac": jnp.mean(stats["ep_overflow"]),
        "expert_load": jnp.mean(share, axis=0),  # (E,): share of assignments per expert, averaged over layers
    }


def _document_metrics(m: ModelConfig, inputs: jax.Array, chunks: int = 1) -> dict:
    """model.attention_mask=documents: documents per sequence (counted by their starts), and the share of sequences
    (of the sequences' `chunks` equal parts under context parallelism) with more than model.max_documents, whose
    last documents attend to each other (layers.document_segments, context_parallel._local_segments)."""
    if m.attention_mask != "documents":
        return {}
    docs = 1 + jnp.sum(inputs[..., :-1] == m.eos_id, axis=-1)
    parts = inputs.reshape(*inputs.shape[:-1], chunks, inputs.shape[-1] // chunks)
    per_part = 1 + jnp.sum(parts[..., :-1] == m.eos_id, axis=-1)
    return {"documents_per_seq": jnp.mean(docs.astype(jnp.float32)),
            "doc_overflow_frac": jnp.mean((per_part > m.max_documents).astype(jnp.float32))}


def document_chunks(context: int) -> int:
    """The parts of a sequence whose documents model.max_documents counts: the whole sequence, or under context
    parallelism each of its 2 x mesh.context chunks (context_parallel.py), which one packed call runs."""
    return 2 * context if context > 1 else 1


def make_train_step(setup: Setup):
    cfg = setup.cfg
    loss_fn = make_loss_fn(setup)
    lr_at = schedule(cfg.optim, cfg.steps)
    accum = cfg.data.grad_accum_steps

    def train_step(state, batch):
        params, buffers = state["params"], state["buffers"]
        # The GEMM weights as the last update made them: cast copies, or zero slots whose fp8 operands the layers
        # read (llama.with_operands); the operands are not differentiated.
        compute = with_compute(params, state["compute"], cfg.model.compute_dtype)

        def loss_of(compute, buffers, inputs, targets, count):
            return loss_fn(with_operands(compute, state["compute"]), buffers, inputs, targets, count, accum)

        grad_fn = jax.value_and_grad(loss_of, has_aux=True)
        # The targets the loss counts in the whole step (all but the -1 of loss-masked data): each microbatch's
        # cross-entropy is its sum over them divided by this, so the microbatches add up to the step's mean.
        targets_counted = jnp.sum(batch["targets"] >= 0)
        count = jnp.maximum(targets_counted, 1).astype(jnp.float32)

        def one(inputs, targets):
            # Differentiated in the compute dtype (llama.with_compute); summed and clipped in float32.
            (_, (ce, stats, mtp_ce)), grads = grad_fn(compute, buffers, inputs, targets, count)
            return ce, stats, mtp_ce, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

        if accum == 1:
            ce, stats, mtp_ce, grads = one(batch["inputs"][0], batch["targets"][0])
        else:
            def micro(carry, mb):
                return jax.tree.map(jnp.add, carry, one(*mb)), None

            zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(one, batch["inputs"][0], batch["targets"][0]))
            (ce, stats, mtp_ce, grads), _ = jax.lax.scan(micro, zeros, (batch["inputs"], batch["targets"]))
            # The cross-entropy and gradients are sums already (see count; the balancing terms enter each
            # microbatch's loss divided by accum). The stats become means over microbatches, but the counts (expert
            # loads, dispatched rows) stay summed. The MoE balancing losses are built from per-microbatch averages,
            # so with accumulation they (and capacity, when model.moe.capacity_factor > 0) are per microbatch: close
            # to, not equal to, the whole-batch value.
            counts = ("load", "rows_cross_node", "rows_intra_node")
            stats = {k: (v if k in counts else v / accum) for k, v in stats.items()}
        updates, opt_state = setup.optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_state = {"step": state["step"] + 1, "params": new_params,
                     "compute": compute_copies(cfg.model, new_params, setup.plan),
                     "buffers": update_buffers(cfg.model, buffers, stats), "opt_state": opt_state}
        # MTP: the mean over the modules, and with several each module's
        mtp = {"mtp_loss": jnp.mean(mtp_ce), **({f"mtp_loss/{k}": v for k, v in enumerate(mtp_ce, 1)}
                                                if cfg.model.mtp.depth > 1 else {})} if cfg.model.mtp.depth else {}
        out = {"loss": ce, **mtp,
               "grad_norm": global_norm(grads), "lr": lr_at(state["step"]),
               **_moe_metrics(stats, setup.mesh.shape["expert"], cfg.model.moe.top_k),
               **_document_metrics(cfg.model, batch["inputs"], document_chunks(setup.mesh.shape["context"])),
               "target_frac": targets_counted / batch["targets"].size}
        return new_state, out

    return jax.jit(train_step, in_shardings=(setup.state_shardings, setup.batch_shardings),
                   out_shardings=(setup.state_shardings, None), donate_argnums=(0,))


def make_eval_step(setup: Setup):
    loss_fn = make_loss_fn(setup, mtp=False)

    def eval_step(params, buffers, batch):
        """(mean cross-entropy over the batch's counted targets, their number)."""
        targets = batch["targets"][0]
        n = jnp.sum(targets >= 0)
        return loss_fn(params, buffers, batch["inputs"][0], targets, jnp.maximum(n, 1))[1][0], n

    return jax.jit(eval_step, in_shardings=(setup.param_shardings, setup.state_shardings["buffers"],
                                            setup.batch_shardings))


def evaluate(eval_step, state, dataset: Dataset, setup: Setup) -> dict[str, float]:
    """{"eval_loss": mean held-out cross-entropy over the counted targets of the first data.eval_batches batches of
    the held-out split (fixed order)}; for a mixture, that per source ("eval_loss/<source>") and their mean weighted
    as the mixture."""
    cfg = setup.cfg

    def mean_loss(windows: Windows) -> float:
        n = min(cfg.data.eval_batches, max(1, windows.n // cfg.data.batch_size))
        # Built ahead as the training batches are (data.Prefetch says why).
        feed = Prefetch(Batches(windows, cfg.data.batch_size, cfg.seed, shuffle=False), setup.batch_shardings, 1,
                        cfg.data.prefetch, n)
        try:
            losses = [eval_step(state["params"], state["buffers"], feed.next()[0]) for _ in range(n)]
        finally:
            feed.close()
        loss, count = (np.asarray([float(x[i]) for x in losses]) for i in (0, 1))
        return float(np.dot(loss, count) / count.sum()) if count.sum() else float("nan")  # nan: all masked out

    if not isinstance(dataset.val, Mixture):
        return {"eval_loss": mean_loss(dataset.val)}
    per = {f"eval_loss/{name}": mean_loss(w) for name, w in zip(dataset.val.names, dataset.val.sources)}
    return {"eval_loss": float(np.dot(dataset.val.weights, list(per.values()))), **per}


def load_choices(cfg: TrainConfig, context: int = 1) -> list[choices.ChoiceSet]:
    """The files of log.eval_choices (comma-separated), read and tokenized with the data's tokenizer
    (mx_jax/choices.py), in rows that `context` devices of context parallelism split; [] when unset."""
    if not cfg.log.eval_choices:
        return []
    from mx_jax.sample import Tokenizer, tokenizer_of  # sample imports this module

    try:
        return choices.load_files(cfg.log.eval_choices, Tokenizer(tokenizer_of(cfg)).encode, cfg.model.vocab_size,
                                  cfg.data.seq_len, cfg.data.batch_size, multiple=choices.ROW_MULTIPLE * context)
    except ConfigError as e:
        raise ConfigError(f"config key 'log.eval_choices': {e}")


def load_texts(cfg: TrainConfig, context: int = 1) -> list[perplexity.TextSet]:
    """The files of log.eval_texts (comma-separated), read and tokenized with the data's tokenizer, each document
    after its end-of-text token (mx_jax/perplexity.py), in rows that `context` devices split; [] when unset."""
    if not cfg.log.eval_texts:
        return []
    from mx_jax.sample import Tokenizer, chat_template_of, eos_of_run, tokenizer_of  # sample imports this module

    try:
        spec = tokenizer_of(cfg)
        return perplexity.load_files(cfg.log.eval_texts, Tokenizer(spec).encode, cfg.model.vocab_size,
                                     cfg.data.seq_len, eos_id=eos_of_run(cfg), batch=cfg.data.batch_size,
                                     chat_template=chat_template_of(cfg), tokenizer=spec,
                                     multiple=choices.ROW_MULTIPLE * context, flag="config key 'log.eval_texts'")
    except (ConfigError, SystemExit) as e:  # (the record reader's errors are SystemExit, naming file and line)
        said = re.sub(r"; name the text \w+ with --text-key", "", str(e))  # the converter's flag: not a config key
        raise ConfigError(said if said.startswith("config key") else f"config key 'log.eval_texts': {said}") from None


def make_row_scores(setup: Setup, cs: choices.ChoiceSet | perplexity.TextSet):
    """row_scores(state) -> (R,) each row's summed log-probability of its targets (choices.accuracy turns a choice
    set's into choice_acc, perplexity.metrics a text set's into text_loss), data.batch_size rows at a time on the
    training mesh, split like the eval batches."""
    rows = NamedSharding(setup.mesh, P(*setup.batch_shardings["inputs"].spec[1:]))
    step = choices.make_step(setup.graphdef, setup.cfg.model.compute_dtype,
                             (setup.param_shardings, setup.state_shardings["buffers"], rows,
                              NamedSharding(setup.mesh, P())))

    def row_scores(state: dict) -> np.ndarray:
        return choices.score(step, state["params"], state["buffers"], cs, setup.cfg.data.batch_size, rows)

    return row_scores


# ---------------------------------------------------------------------------------------------------------------
# Entry points


def check_against_mesh(cfg: TrainConfig, mesh) -> None:
    """Config rules that need the resolved mesh: `check_mesh_shape` on its axes, `check_platform` on its devices."""
    check_mesh_shape(cfg, dict(mesh.shape))
    check_platform(cfg, mesh.devices.flat[0].platform, mesh.shape["expert"])


def check_mesh_shape(cfg: TrainConfig, shape: dict[str, int]) -> None:
    """The batch, the sequence and the experts divide over the mesh axes `shape` ({axis: size})."""
    batch_div = sharding.batch_size_divisor(shape)
    div = batch_div * cfg.data.grad_accum_steps
    if cfg.data.batch_size % div:
        raise ConfigError(
            f"config key 'data.batch_size': {cfg.data.batch_size} must be a multiple of the batch mesh axes "
            f"({batch_div}) x data.grad_accum_steps ({cfg.data.grad_accum_steps})")
    n_ctx = shape["context"]
    if n_ctx > 1 and cfg.data.seq_len % (2 * n_ctx):
        raise ConfigError(f"config key 'data.seq_len': {cfg.data.seq_len} must be a multiple of 2 x mesh.context "
                          f"({2 * n_ctx}): each context shard holds two chunks of the sequence "
                          f"(mx_jax/context_parallel.py)")
    moe, n_ep = cfg.model.moe, shape["expert"]
    if moe.n_experts and moe.n_experts % n_ep:
        raise ConfigError(f"config key 'mesh.expert': {n_ep} devices must divide model.moe.n_experts "
                          f"({moe.n_experts}) so that each holds the same number of experts")
    if moe.n_experts and n_ep % min(moe.gpus_per_node, n_ep):
        raise ConfigError(f"config key 'model.moe.gpus_per_node': mesh.expert ({n_ep}) must be a multiple of it "
                          f"(the expert axis is read as nodes x GPUs per node), got {moe.gpus_per_node}")


def check_platform(cfg: TrainConfig, platform: str, expert_devices: int) -> None:
    """Paths asked for by name that run only on NVIDIA GPUs, on another `platform` ('auto' picks them where they run)."""
    m = cfg.model
    if m.attention == "cudnn" and layers.attention_impl("auto", m.compute_dtype, m.attention_dim, platform) != "cudnn":
        raise ConfigError(f"config key 'model.attention': cudnn needs an NVIDIA GPU, model.compute_dtype=bfloat16 and "
                          f"a head dim of at most 256 that is a multiple of 8; here {platform}, {m.compute_dtype}, "
                          f"{m.attention_dim} ('auto' takes cuDNN where it applies, else XLA)")
    if m.moe.n_experts and expert_devices > 1 and platform != "gpu":
        if m.moe.exchange == "ragged":
            raise ConfigError(f"config key 'model.moe.exchange': ragged (lax.ragged_all_to_all) runs on NVIDIA GPUs "
                              f"only, not {platform} (dense moves the same rows in padded chunks)")
        if m.moe.all_to_all == "pallas":
            raise ConfigError(f"config key 'model.moe.all_to_all': pallas (the NVLink Mosaic-GPU kernels) runs on "
                              f"NVIDIA GPUs only, not {platform} ('auto' takes them where they apply)")


def cpu_stand_ins(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """A GPU config as a dry run compiles it on fake CPU devices: the GPU-only paths asked for by name (`check_platform`)
    replaced by what runs there, with a note for each."""
    m, moe, notes = cfg.model, cfg.model.moe, []
    if m.attention == "cudnn":
        m, notes = dataclasses.replace(m, attention="xla"), notes + ["model.attention=cudnn as xla"]
    if moe.exchange == "ragged":
        moe, notes = dataclasses.replace(moe, exchange="dense"), notes + ["model.moe.exchange=ragged as dense"]
    if moe.all_to_all == "pallas":
        moe, notes = dataclasses.replace(moe, all_to_all="xla"), notes + ["model.moe.all_to_all=pallas as xla"]
    return dataclasses.replace(cfg, model=dataclasses.replace(m, moe=moe)), notes


def with_data_documents(cfg: TrainConfig, dataset: Dataset, context: int = 1) -> tuple[TrainConfig, str]:
    """model.attention_mask=documents: model.eos_id (-1: the data's end-of-text token) and model.max_documents (0:
    the 99th percentile of documents per sequence, or per chunk under context parallelism over `context` devices,
    over 1,024 training windows, rounded up to a multiple of 8: cuDNN's cost grows with it, config.py), resolved
    from the data; and a line for the log ("" for causal attention)."""
    m = cfg.model
    if m.attention_mask != "documents":
        return cfg, ""
    eos = m.eos_id
    if eos < 0:
        if dataset.eos_id is None:
            where = ", ".join(cfg.data.mixture) if cfg.data.mixture else f"{cfg.data.path}/meta.json"
            raise ConfigError(f"config key 'model.eos_id': model.attention_mask=documents needs the token that ends "
                              f"each document, and the data does not name one ({where}: converted with --eos none, "
                              f"before eos_id was recorded, or a mixture whose sources differ); set model.eos_id, or "
                              f"convert the text again with `python -m mx_jax.data convert --eos ...`")
        eos = dataset.eos_id
    chunks = document_chunks(context)
    counts = documents_per_window(dataset.train, eos, seed=cfg.seed, chunks=chunks)
    p99 = int(np.ceil(np.percentile(counts, 99)))
    docs = m.max_documents or -(-p99 // 8) * 8
    unit = "sequence" if chunks == 1 else f"chunk of {dataset.train.seq_len // chunks} tokens (mesh.context={context})"
    note = (f"documents end with token {eos}{' (the data' + chr(39) + 's)' if m.eos_id < 0 else ''}: "
            f"{counts.mean():.1f} per {unit} "
            f"over {len(counts) // chunks} training windows, 99% have <= {p99}, max {counts.max()}; kept apart up to "
            f"model.max_documents={docs}{' (from the data)' if not m.max_documents else ''}, "
            f"{np.mean(counts > docs):.1%} of them have more")
    return dataclasses.replace(cfg, model=dataclasses.replace(m, eos_id=eos, max_documents=docs)), note


def _vocabulary(tokenizer_json: pathlib.Path) -> tuple | None:
    """A tokenizer.json's token -> id table and added tokens (what decides the ids), or None if it cannot be read."""
    try:
        tj = json.loads(tokenizer_json.read_text())
        added = sorted((t["id"], t["content"]) for t in tj.get("added_tokens", []))
        return tj["model"].get("vocab"), added
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def tokenizer_mismatch(cfg: TrainConfig) -> str | None:
    """A warning when init_from is an HF directory whose tokenizer.json assigns other ids than the one the data was
    converted with (meta.json's tokenizer): a fine-tune would then read every token as another. None if they agree or
    either is not there to compare."""
    if not cfg.init_from or cfg.data.source != "bin":
        return None
    theirs = pathlib.Path(cfg.init_from) / "tokenizer.json"
    first = mixture_entries(cfg.data.mixture)[0][1] if cfg.data.mixture else cfg.data.path
    try:
        ours = read_meta(pathlib.Path(first)).get("tokenizer")
    except ConfigError:
        return None
    if not theirs.is_file() or not ours or ours == "byte" or not pathlib.Path(ours).is_file():
        return None
    a, b = _vocabulary(pathlib.Path(ours)), _vocabulary(theirs)
    if a is None or b is None or a == b:
        return None
    return (f"the data ({first}) was tokenized with {ours}, whose ids differ from those of {theirs}, the tokenizer "
            f"of the model in init_from: convert the data again with --tokenizer {theirs}")


def _write_atomic(path: pathlib.Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)  # after a failed replace (path is a directory, ...): no stray file


def _fmt_log(step: int, m: dict) -> str:
    parts = [f"step {step:>6}", f"loss {m['loss']:.4f}"]
    if "mtp_loss" in m:
        parts.append(f"mtp {m['mtp_loss']:.4f}")
    if "eval_loss" in m:
        per = [f"{k.split('/', 1)[1]} {v:.4f}" for k, v in m.items() if k.startswith("eval_loss/")]
        parts.append(f"eval {m['eval_loss']:.4f}" + (f" ({', '.join(per)})" if per else ""))
    if "choice_acc" in m:
        names = [k.split("/", 1)[1] for k in m if k.startswith("choice_acc/")]  # several files: each one's
        per = [f"{n} {100 * m['choice_acc/' + n]:.1f}/{100 * m['choice_acc_norm/' + n]:.1f}" for n in names]
        parts.append(f"choices {100 * m['choice_acc']:.1f}% (norm {100 * m['choice_acc_norm']:.1f}%"
                     + (f"; {', '.join(per)})" if per else ")"))
    texts = [k.split("/", 1)[1] for k in m if k.startswith("text_loss/")]
    if texts:
        parts.append("texts " + ", ".join(f"{n} {m['text_loss/' + n]:.4f} ({m['text_bpb/' + n]:.3f} bpb)"
                                          for n in texts))
    parts += [f"gnorm {m['grad_norm']:.3f}", f"lr {m['lr']:.2e}"]
    if m.get("target_frac", 1) < 1:  # loss-masked data: the share of the step's tokens the loss counted
        parts.append(f"targets {100 * m['target_frac']:.0f}%")
    if "moe_max_over_mean_load" in m:  # the busiest expert's load over the mean, averaged over the MoE layers
        parts.append(f"moe load max/mean {m['moe_max_over_mean_load']:.2f}")
        if m.get("moe_dropped_frac"):
            parts.append(f"dropped {100 * m['moe_dropped_frac']:.1f}%")
        if "moe_ep_max_over_mean" in m:  # the busiest expert device's rows over the mean (expert parallelism)
            parts.append(f"ep device max/mean {m['moe_ep_max_over_mean']:.2f}")
        if m.get("moe_cross_node_rows_per_token"):  # the dispatch's rows to other nodes (model.moe.gpus_per_node)
            parts.append(f"cross-node rows/token {m['moe_cross_node_rows_per_token']:.2f}")
        if m.get("moe_ep_overflow_frac"):  # devices x layers that ran the worst-case expert buffer (slower)
            parts.append(f"ep overflow {100 * m['moe_ep_overflow_frac']:.0f}%")
    if "tokens_per_sec" in m:
        parts += [f"{m['tokens_per_sec']:,.0f} tok/s", f"{m['tflops_per_device']:.1f} TFLOP/s/dev"]
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "peak_mem_gib" in m:
        parts.append(f"mem {m.get('mem_gib', 0):.1f}/{m['peak_mem_gib']:.1f} GiB")
    return " | ".join(parts)


@dataclasses.dataclass
class TrainResult:
    state: dict  # the final train state (sharded device arrays)
    metrics: dict  # the last logged metrics
    preempted: bool = False  # stopped by SIGTERM before `steps` (that step is committed unless ckpt.every_steps=-1)


# Keys of the data item each checkpoint stores with the iterator position: what decides the batch order. A resumed
# run must match them, or it would silently see other data than an uninterrupted run. data.path may move (a new
# mount) as long as the data holds the same number of training windows (`train_windows`).
_DATA_KEYS = ("seed", "data.seq_len", "data.source", "data.mixture_quota")
# ModelConfig keys that may change across a resume: how the same function is computed, not which function.
_MODEL_KEYS_FREE_ON_RESUME = frozenset({
    "remat", "scan_layers", "attention", "compute_dtype", "param_dtype", "grad_reduce_dtype", "max_documents",
    "moe.impl",
    "moe.all_to_all", "moe.dispatch", "moe.gpus_per_node", "moe.capacity_factor", "moe.aux_loss_coef",
    "moe.z_loss_coef", "moe.bias_update_rate", "moe.ep_buffer_factor", "moe.exchange", "moe.ep_save_gate_up",
    "mtp.loss_scale"})  # DeepSeek-V3 lowered its MTP weight from 0.3 to 0.1 for its last 4.8 T tokens


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _data_path(cfg: TrainConfig) -> str | list[str]:
    """The data's directory, absolute (a list, one per source, for a mixture; "" for the embedded corpus)."""
    if cfg.data.mixture:
        return [str(pathlib.Path(p).absolute()) for _, p in mixture_entries(cfg.data.mixture)]
    return str(pathlib.Path(cfg.data.path).absolute()) if cfg.data.source == "bin" else ""


def checkpoint_record(cfg: TrainConfig, position: int, train_windows: int | list[int]) -> dict:
    """The JSON `data` item saved with each step: the iterator position and what a resume must agree with (a
    mixture adds its sources' slots per round, data.mixture_quota, and its directories' names; train_windows is then
    per source)."""
    record = {"position": position, "seed": cfg.seed, "data.seq_len": cfg.data.seq_len,
              "data.source": cfg.data.source, "data.path": _data_path(cfg), "train_windows": train_windows,
              "model": to_dict(cfg.model)}
    if cfg.data.mixture:
        entries = mixture_entries(cfg.data.mixture)
        record["data.mixture_quota"] = mixture_quota([w for w, _ in entries])
        record["data.mixture_names"] = [pathlib.Path(p).name for _, p in entries]
    return record


def _opt_state_shifted(shapes: dict[str, tuple], by: int) -> dict[str, tuple]:
    """{array name: shape} with each "opt_state.<i>." name's chain index moved by `by`."""
    return {re.sub(r"^opt_state\.(\d+)\.", lambda m: f"opt_state.{int(m.group(1)) + by}.", k): v
            for k, v in shapes.items()}


def clip_toggled(saved_shapes: dict[str, tuple], wanted_shapes: dict[str, tuple]) -> int:
    """For a checkpoint whose arrays differ from this run's: +1 where it was trained without gradient clipping and
    this run clips, -1 the reverse, else 0.

    optim.make_optimizer chains the clipping (whose state holds no arrays) before AdamW only where
    optim.grad_clip_norm > 0, so turning it on or off moves AdamW's state one place along opt_state: the same arrays
    under other names (`_restore` restores them under the checkpoint's names and moves them)."""
    return next((by for by in (1, -1)
                 if not checkpoint.shape_mismatches(_opt_state_shifted(saved_shapes, by), wanted_shapes)), 0)


def check_resumable(cfg: TrainConfig, saved: dict, train_windows: int | list[int], saved_shapes: dict,
                    wanted_shapes: dict, where: str) -> int:
    """ConfigError naming the keys when this config cannot continue the checkpoint `saved` (its data item); else
    `clip_toggled` of its arrays (0 where they are this run's)."""
    mine = checkpoint_record(cfg, 0, train_windows)

    def source(record: dict) -> str:
        if "data.mixture_quota" in record:
            pairs = zip(record["data.mixture_quota"], record["data.path"])
            return "the mixture " + ", ".join(f"{q / MIXTURE_ROUND:.4g}:{p}" for q, p in pairs)
        return record.get("data.path") or "the embedded corpus"

    for key in (*_DATA_KEYS, "data.mixture_names", "train_windows"):
        # the mixture keys are absent from single-source records, old or new: compare them always; the others only
        # where the checkpoint recorded them (older checkpoints recorded fewer). A source's directory may move to
        # another mount, but not trade places with another.
        mixture_key = key.startswith("data.mixture")
        if saved.get(key) == mine.get(key) or (key not in saved and not mixture_key):
            continue
        if mixture_key:
            what = f"config key 'data.mixture': the checkpoint at {where} was trained on {source(saved)}, this run has"
            what += f" {source(mine)}"
        elif key == "train_windows":
            what = (f"config key 'data.path': the checkpoint at {where} was trained on data of {saved[key]} windows "
                    f"of data.seq_len tokens ({source(saved)}), this run's ({source(mine)}) has {mine[key]}")
        else:
            what = f"config key '{key}': the checkpoint at {where} was trained with {key}={saved[key]!r}, this run has"
            what += f" {mine[key]!r}"
        raise ConfigError(f"{what}; resuming would change the data order. Keep {', '.join(_DATA_KEYS[:3])} and the "
                          f"data, or start a new run_dir (init_from={where} starts one from these weights)")
    if saved.get("data.path", mine["data.path"]) != mine["data.path"]:
        log(f"resume | data.path moved from {saved['data.path']} to {mine['data.path']} (same number of windows)")
    if "model" in saved:
        theirs, ours = _flat(saved["model"]), _flat(mine["model"])
        diff = [k for k in ours if k not in _MODEL_KEYS_FREE_ON_RESUME and k in theirs and theirs[k] != ours[k]]
        if diff:
            raise ConfigError(
                "the checkpoint at {} is a different model: {}".format(
                    where, "; ".join(f"config key 'model.{k}' is {theirs[k]!r} there, {ours[k]!r} here" for k in diff)))
    bad = checkpoint.shape_mismatches(saved_shapes, wanted_shapes)
    toggled = clip_toggled(saved_shapes, wanted_shapes) if bad else 0
    if bad and not toggled:
        raise ConfigError(f"the checkpoint at {where} does not fit this model's state ({len(bad)} array(s) differ: "
                          f"{'; '.join(bad[:4])}{'; ...' if len(bad) > 4 else ''}); compare the model and optim "
                          f"sections with the run_dir's config.yaml")
    return toggled


def prepare_run_dir(cfg: TrainConfig) -> pathlib.Path:
    """Create run_dir and check it is a writable directory, before anything is computed or written. Every process
    checks (run_dir is on storage all hosts see), so a bad run_dir stops all of them, not only process 0."""
    run_dir = pathlib.Path(cfg.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"config key 'run_dir': {run_dir} exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{jax.process_index()}-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"config key 'run_dir': cannot write in {run_dir} ({e.strerror or e})") from None
    return run_dir


def _init_params(cfg: TrainConfig, setup: Setup) -> tuple[dict, dict]:
    """(params, buffers) from the config key init_from, placed as the train state's: a MoE model's router biases come
    with the parameters (DeepSeek-V3's trained ones; zeros where the source holds none)."""
    from mx_jax import hf  # needs safetensors, only for this path

    try:
        return hf.init_from(cfg.init_from, cfg.model, setup.param_shardings, setup.state_shardings["buffers"])
    except ConfigError:
        raise
    except (hf.HFFormatError, OSError, ValueError) as e:
        raise ConfigError(f"config key 'init_from': {e}") from None


def _keep_model_files(source: str, run_dir: pathlib.Path) -> None:
    """The HF config.json and sidecars of the model a run starts from, kept in run_dir for `hf export`
    (hf.keep_model_files); a failure to copy them is logged, not fatal: the weights are what the run needs."""
    from mx_jax import hf

    try:
        kept = hf.keep_model_files(source, run_dir)
    except (OSError, hf.HFFormatError) as e:
        log(f"init   | WARNING: the HF files of {source} were not kept for `hf export` ({e})")
        return
    if kept:
        log(f"init   | kept {', '.join(kept)} of {source} in {run_dir} as hf_* for `hf export`")


def _restore(cfg: TrainConfig, setup: Setup, ckpt: checkpoint.Checkpointer, start: int,
             train_windows: int | list[int]) -> tuple[dict, int]:
    """The state and data position of committed step `start`, after checking this config can continue it."""
    where = ckpt.dir / str(start)
    saved = ckpt.data_state(start)
    target = saved_part(abstract_state(setup))
    saved_shapes, wanted_shapes = ckpt.saved_shapes(start), checkpoint.array_shapes(target)
    toggled = check_resumable(cfg, saved, train_windows, saved_shapes, wanted_shapes, str(where))
    if toggled:  # the optimizer chain as the checkpoint has it: (clip, AdamW) or (AdamW,); the clip holds no arrays
        opt = target["opt_state"]
        target = {**target, "opt_state": opt[1:] if toggled > 0 else (optax.EmptyState(), *opt)}
        log(f"resume | gradient clipping turned {'on' if toggled > 0 else 'off'} (optim.grad_clip_norm="
            f"{cfg.optim.grad_clip_norm}): AdamW's moments continue")
    state = ckpt.restore(start, target)
    if toggled:
        opt = state["opt_state"]
        state = {**state, "opt_state": (optax.EmptyState(), *opt) if toggled > 0 else opt[1:]}
    if int(state["step"]) != start:
        raise checkpoint.CheckpointError(f"{where} holds the state of step {int(state['step'])}, not {start}: it was "
                                         f"copied or renamed; move it out of {ckpt.dir}")
    return with_fresh_compute(setup, state), int(saved["position"])


def train(cfg: TrainConfig, devices: list[jax.Device] | None = None) -> TrainResult:
    """Run (or resume) training on `devices` (default: all).

    run_dir/config.yaml is written once the first step has compiled and been dispatched (after the state is
    initialized or restored and the metrics writers, W&B included, have started), so a run that fails to start leaves
    the previous config (and every checkpoint) as it was, and a run with nothing left to train does not touch it.
    """
    logger = logging.getLogger("mx_jax")
    if not any(isinstance(h, _LogLines) for h in logger.handlers):
        logger.addHandler(_LogLines())
        logger.propagate = False
    mesh = sharding.make_mesh(cfg.mesh, devices)
    check_against_mesh(cfg, mesh)
    if cfg.log.wandb and jax.process_index() == 0:
        metrics.require_wandb()  # before anything is written
    dataset = open_dataset(cfg.data)
    if dataset.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"config key 'model.vocab_size': {cfg.model.vocab_size} is smaller than the data's "
                          f"vocabulary ({dataset.vocab_size})")
    choice_sets = load_choices(cfg, mesh.shape["context"])  # before anything is written
    text_sets = load_texts(cfg, mesh.shape["context"])
    cfg, documents_note = with_data_documents(cfg, dataset, mesh.shape["context"])
    saved = pathlib.Path(cfg.run_dir) / "checkpoints"
    if (cfg.init_from and not pathlib.Path(cfg.init_from).exists()
            and not (saved.is_dir() and any(d.name.isdigit() for d in saved.iterdir()))):  # (a resume never reads it)
        raise ConfigError(f"config key 'init_from': {cfg.init_from} does not exist (an HF Llama directory or an mx_jax "
                          f"run/step directory)")
    if cfg.ckpt.resume not in ("latest", "never") and not (saved / str(int(cfg.ckpt.resume))).is_dir():
        have = sorted(int(d.name) for d in saved.iterdir() if d.name.isdigit()) if saved.is_dir() else []
        raise ConfigError(f"config key 'ckpt.resume': no checkpoint for step {int(cfg.ckpt.resume)} in {saved} (have "
                          f"{have or 'none'})")  # before prepare_run_dir makes the run directory
    run_dir = prepare_run_dir(cfg)
    ckpt = None
    # From here until the last save is committed, a SIGTERM waits for the step in flight and its checkpoint.
    with preemption.PreemptionWatch() as watch:
        try:
            with jax.set_mesh(mesh):
                setup = build(cfg, mesh)
                ckpt = checkpoint.Checkpointer(run_dir, cfg.ckpt)
                start = ckpt.resume_step()  # may raise before anything is written
                if start is not None and start > cfg.steps:
                    raise ConfigError(f"config key 'steps': {cfg.steps}, but {run_dir} already has a checkpoint at "
                                      f"step {start}; raise steps to continue the run, or use a new run_dir")
                log(f"mx_jax | {jax.device_count()} x {jax.devices()[0].device_kind} ({jax.process_count()} "
                    f"process(es)) | mesh {dict(mesh.shape)} | jax {jax.__version__}")
                hosts = sharding.process_hosts()
                log(f"mesh   | {sharding.describe(mesh, hosts)}")
                if note := moe_layout_note(cfg, dict(mesh.shape), hosts, jax.default_backend()):
                    log(f"note   | {note}")
                if cache := jax.config.jax_compilation_cache_dir:
                    log(f"cache  | compiled programs are kept in {cache} for later runs (config key compile_cache)")
                if mesh.size > 1:
                    experts = "; the routed experts' in bfloat16" if cfg.model.moe.n_experts else ""
                    log(f"mesh   | weight gradients summed across devices in {cfg.model.grad_reduce_dtype} "
                        f"(model.grad_reduce_dtype){experts}")
                    tokens = cfg.data.batch_size // cfg.data.grad_accum_steps * cfg.data.seq_len
                    if axes := head_vocab_axes(cfg.model, setup.plan.recipes["head"], tokens, dict(mesh.shape)):
                        log(f"mesh   | output head vocab-parallel over {' x '.join(axes)}: split on its "
                            f"{cfg.model.vocab_size} vocabulary entries, for {tokens} tokens per microbatch")
                if cfg.deterministic:
                    log(f"mx_jax | deterministic: XLA_FLAGS has {DETERMINISTIC_XLA_FLAG}=true (slower; see README)")
                log(f"data   | {dataset.description}")
                if documents_note:
                    log(f"attn   | {documents_note}")
                if isinstance(dataset.train, Mixture):
                    seqs = cfg.steps * cfg.data.batch_size
                    log(f"data   | in {cfg.steps} steps: " + ", ".join(
                        f"{name} {seqs * w / src.n:.2f} epochs" for name, w, src in
                        zip(dataset.train.names, dataset.train.weights, dataset.train.sources)))
                if cfg.data.source == "embedded" and cfg.data.path:
                    log(f"data   | note: data.path={cfg.data.path} is not read (data.source=embedded; set "
                        f"data.source=bin)")
                n_params = sum(x.size for x in jax.tree.leaves(setup.abstract["params"]))
                n_mtp = sum(x.size for x in jax.tree.leaves(setup.abstract["params"].get("mtp", {})))
                mtp = f" ({n_mtp / 1e6:,.1f} M of them in {cfg.model.mtp.depth} MTP module(s))" if n_mtp else ""
                log(f"model  | {n_params / 1e6:,.1f} M parameters{mtp} | quant recipe {cfg.quant.recipe} | remat "
                    f"{cfg.model.remat}")
                for note in setup.notes:
                    log(f"quant  | {note}")

                train_batches = Batches(dataset.train, cfg.data.batch_size, cfg.seed)
                if start is None:
                    state = init_state(setup)
                    step = 0
                    if cfg.init_from:
                        state["params"], state["buffers"] = _init_params(cfg, setup)
                        state = with_fresh_compute(setup, state)
                        log(f"init   | parameters from {cfg.init_from}")
                        if jax.process_index() == 0:
                            _keep_model_files(cfg.init_from, run_dir)
                        if warning := tokenizer_mismatch(cfg):
                            log(f"init   | WARNING: {warning}")
                else:
                    state, train_batches.position = _restore(cfg, setup, ckpt, start, dataset.train_windows)
                    step = start
                    log(f"resume | from step {step} ({ckpt.dir / str(start)}), data position {train_batches.position}")
                if step == cfg.steps:
                    log(f"done   | step {step} is already committed in {ckpt.dir}: nothing to train")
                    return TrainResult(state, {})
                if watch.note:
                    log(f"note   | SIGTERM stops the run without a final checkpoint: {watch.note}")
                for cs in choice_sets:
                    log(f"eval   | {cs.records} multiple-choice records ({cs.rows} rows of at most "
                        f"{cs.inputs.shape[1]} tokens) from {cs.path} at every evaluation")
                for ts in text_sets:
                    log(f"eval   | {len(ts.tokens)} documents, {int(ts.tokens.sum()):,} tokens ({ts.rows} windows) "
                        f"from {ts.path} at every evaluation")
                state, last, stopped_at = _loop(cfg, setup, state, step, dataset, train_batches, ckpt, run_dir,
                                                resumed_at=start, watch=watch, choice_sets=choice_sets,
                                                text_sets=text_sets)
        finally:
            if ckpt is not None:
                ckpt.close()  # waits for saves in flight: a committed step is never lost on the way out
                for s, blocked, background in ckpt.finished_saves():
                    log(f"ckpt   | step {s} committed: blocked {1000 * blocked:.0f} ms, background "
                        f"{1000 * background:.0f} ms")
    if stopped_at is not None:
        where = (f"step {stopped_at} is committed in {ckpt.dir}: run the same command again to resume"
                 if ckpt.latest_step() == stopped_at else f"no checkpoint of step {stopped_at} (ckpt.every_steps="
                 f"{cfg.ckpt.every_steps}); the last committed step is {ckpt.latest_step()}")
        log(f"stop   | SIGTERM: stopped after step {stopped_at} of {cfg.steps}; {where}")
    return TrainResult(state, last, preempted=stopped_at is not None)


class _Trace:
    """jax.profiler trace of steps log.profile_from .. + log.profile_steps - 1 into run_dir/profile/process_<i>,
    and the per-category summary of process 0's trace in the log (mx_jax/profiling.py)."""

    def __init__(self, cfg: TrainConfig, run_dir: pathlib.Path, step: int):
        self.cfg = cfg
        self.first, self.n = cfg.log.profile_from, cfg.log.profile_steps
        self.dir = run_dir / "profile" / f"process_{jax.process_index()}"
        self.active = False
        if self.n and step >= self.first:
            log(f"note   | log.profile_from={self.first}: the run starts after step {step}, nothing is traced")

    def maybe_start(self, step: int, state) -> None:
        if self.n and step == self.first:
            jax.block_until_ready(state)  # the trace holds these steps alone
            jax.profiler.start_trace(str(self.dir))
            self.active = True

    def maybe_stop(self, step: int, outputs, last: bool) -> None:
        if not self.active or (step < self.first + self.n - 1 and not last):
            return
        jax.block_until_ready(outputs)
        self.close()
        log(f"trace  | steps {self.first}-{step} traced into {self.dir} (TensorBoard's profile plugin, XProf or "
            f"Perfetto)")
        if jax.process_index() != 0:  # only process 0 logs
            return
        c = self.cfg
        extra = [what for what, every in (("an evaluation", c.log.eval_every_steps), ("a checkpoint save",
                                                                                     c.ckpt.every_steps))
                 if any(_due(s, every, c.steps) for s in range(self.first, step + 1))]
        if extra:
            log(f"trace  | note: {' and '.join(extra)} ran inside these steps and count in their device time")
        data = profiling.latest_trace(self.dir)
        lines = profiling.summarize(data, step - self.first + 1, top=8) if data else [f"no trace file in {self.dir}"]
        for line in lines:
            log(f"trace  | {line}")

    def close(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()


def _due(step: int, every: int, last: int) -> bool:
    """every > 0: each `every` steps and at the end; 0: only at the end; -1: never."""
    if every < 0:
        return False
    return step == last or (every > 0 and step % every == 0)


def read_metrics(dev_metrics: dict) -> dict:
    """One step's metrics on the host (waits for the step): floats, and lists of floats for per-expert arrays."""
    return {k: (float(v) if np.ndim(v) == 0 else [round(float(x), 5) for x in np.asarray(v)])
            for k, v in dev_metrics.items()}


def _loop(cfg, setup, state, step, dataset, train_batches, ckpt, run_dir, resumed_at,
          watch: preemption.PreemptionWatch, choice_sets: Sequence[choices.ChoiceSet] = (),
          text_sets: Sequence[perplexity.TextSet] = ()) -> tuple[dict, dict, int | None]:
    """Train from `step` to cfg.steps; returns the state, the last logged metrics, and the step a SIGTERM stopped
    the run after (None if it ran to the end)."""
    train_step = make_train_step(setup)
    eval_step = make_eval_step(setup)
    choice_scores = [make_row_scores(setup, cs) for cs in choice_sets]
    text_scores = [make_row_scores(setup, ts) for ts in text_sets]
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    peak, peak_src = metrics.device_peak_tflops(cfg.log.peak_tflops)
    log(f"mfu    | {peak_src}")
    rate = metrics.Throughput(tokens_per_step, flops_per_token(cfg.model, cfg.data.seq_len), jax.device_count(), peak)
    # A fresh start drops the step records that an earlier start in this run_dir wrote before its first checkpoint
    writer = metrics.MetricsWriter(run_dir, cfg.log.tensorboard, resumed_at=0 if resumed_at is None else resumed_at,
                                   wandb=cfg.log.wandb, config=to_dict(cfg))
    bar = None
    if cfg.log.progress and jax.process_index() == 0:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stdout,
                   mininterval=1.0)
    last: dict = {}
    pending = None  # (step number, device metrics, seconds waited for its batch) of the step dispatched last
    t_start = time.perf_counter()
    hits_before = (_CACHE_HITS.hits, _CACHE_HITS.saved_s)
    compiled_at = None
    stopped_at = None
    restart_window = False  # set by evaluation and saves: the rate's next window opens when the next step is done
    data_warned = False
    config_written = False

    def check_data_time(m: dict) -> None:
        """data_ms_max: the slowest process's wait for its batches (every process calls this at the same steps); a
        one-time warning when it takes a tenth of the step or more."""
        nonlocal data_warned
        per_process = [m["data_ms"]]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            per_process = [float(x) for x in multihost_utils.process_allgather(np.float32(m["data_ms"]))]
            m["data_ms"], m["data_ms_max"] = per_process[jax.process_index()], max(per_process)  # both as gathered
        worst = int(np.argmax(per_process))
        if not data_warned and per_process[worst] >= 100 * m["step_time_s"]:  # ms vs s: a tenth of the step
            data_warned = True
            log(f"warn   | the loop waited {per_process[worst]:.1f} ms for the batch of each "
                f"{1000 * m['step_time_s']:.1f} ms step on process {worst} (data.prefetch={cfg.data.prefetch}): "
                f"batches are built slower than the steps run (slow storage under data.path?)")

    trace = _Trace(cfg, run_dir, step)
    feed = Prefetch(train_batches, setup.batch_shardings, cfg.data.grad_accum_steps, cfg.data.prefetch,
                    cfg.steps - step)

    def finish(step_no: int, dev_metrics, data_s: float, with_eval: bool = False, done_at: float | None = None) -> None:
        """Read one step's metrics (blocks until it is done); log, and evaluate the *current* params if asked.
        done_at: when the step was seen done, if that was before now (the loop waits for a window's edge before it
        dispatches the next step); else the read's return is that time."""
        nonlocal last, compiled_at, restart_window
        m = read_metrics(dev_metrics)
        # A finite loss and gradient at step n, from finite parameters, with a finite learning rate (validated),
        # give finite parameters after it: checking these two scalars keeps non-finite weights out of checkpoints.
        for k in ("loss", "grad_norm"):
            if not math.isfinite(m[k]):
                raise FloatingPointError(f"{k.replace('_', ' ')} is {m[k]} at step {step_no}: stopping (no "
                                         f"checkpoint written for this step; the last committed one is "
                                         f"{ckpt.latest_step()})")
        if compiled_at is None:
            compiled_at = time.perf_counter() - t_start
            hits, saved = _CACHE_HITS.hits - hits_before[0], _CACHE_HITS.saved_s - hits_before[1]
            cached = f" ({hits} program(s) from the compile cache: {saved:.1f} s of compiling saved)" if hits else ""
            log(f"step   | first step (compile included) took {compiled_at:.1f} s{cached}")
            rate.start(done_at)
        elif restart_window:  # evaluation or a save ran since the last step: the window opens at this one's end
            rate.start(done_at)
            restart_window = False
        else:
            rate.step(data_s)
        if bar is not None:
            bar.update(1)
        if step_no % cfg.log.every_steps == 0 or with_eval:
            m.update(rate.report(done_at))
            if "data_ms" in m:
                check_data_time(m)
            m.update(metrics.memory_in_use())
            if with_eval:
                m.update(evaluate(eval_step, state, dataset, setup))
                if choice_sets:
                    m.update(choices.summary(choice_sets, [scores(state) for scores in choice_scores]))
                if text_sets:
                    m.update(perplexity.metrics(text_sets, [scores(state) for scores in text_scores]))
            writer.write(step_no, m)
            log(_fmt_log(step_no, m))
            if bar is not None:
                bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m.get('tokens_per_sec', 0):,.0f}", refresh=False)
            last = {"step": step_no, **m}
        restart_window = restart_window or with_eval

    try:
        while step < cfg.steps:
            trace.maybe_start(step + 1, state)
            done_at = None
            if pending is not None and (restart_window or compiled_at is None
                                        or pending[0] % cfg.log.every_steps == 0):
                # An edge of the rate's window: wait for the step before the next one is dispatched, so that the edge
                # is its completion and none of the next step's device time can fall before the edge; and before the
                # wait for the next batch, which belongs to the next window, as its `data_s` does.
                jax.block_until_ready(pending[1])
                done_at = time.perf_counter()
            batch, data_s = feed.next()
            state, dev_metrics = train_step(state, batch)
            if not config_written:  # the first step compiled: this config runs (`train`'s docstring)
                config_written = True
                if jax.process_index() == 0:
                    _write_atomic(run_dir / "config.yaml", to_yaml(cfg))
            step += 1
            if pending is not None:
                finish(*pending, done_at=done_at)  # the previous step: the device is already busy with this one
            pending = (step, dev_metrics, data_s)
            # Every process asks at every step (the multi-process agreement needs it), before any save of the step.
            preempted = watch.reached(step) and step < cfg.steps
            eval_now = _due(step, cfg.log.eval_every_steps, cfg.steps)
            save_now = _due(step, cfg.ckpt.every_steps, cfg.steps) or (preempted and cfg.ckpt.every_steps >= 0)
            if eval_now or save_now:
                finish(*pending, with_eval=eval_now)  # `state` is this step's: never save an unchecked loss
                pending = None
            if save_now:
                blocked = ckpt.save(step, saved_part(state),
                                    checkpoint_record(cfg, feed.position, dataset.train_windows))
                waited = (f" ({1000 * ckpt.waited_s:.0f} ms of it waiting for the previous save to be written: saves "
                          f"are due faster than they are written)" if ckpt.waited_s > 0.05 else "")
                log(f"ckpt   | step {step}: save started, blocked the loop {1000 * blocked:.0f} ms{waited}")
                restart_window = True
            for s, blocked, background in ckpt.finished_saves():
                log(f"ckpt   | step {s} committed: blocked {1000 * blocked:.0f} ms, background "
                    f"{1000 * background:.0f} ms")
            trace.maybe_stop(step, (state, dev_metrics), last=preempted or step == cfg.steps)
            if preempted:
                stopped_at = step
                break
        if pending is not None:
            finish(*pending)
    finally:
        feed.close()
        trace.close()
        if bar is not None:
            bar.close()
        writer.close()
    return state, last, stopped_at


def moe_layout_note(cfg: TrainConfig, mesh_shape: dict[str, int], hosts: list | None, backend: str) -> str | None:
    """The note for an expert-parallel GPU run split into processes on one host, or None. Its exchanges then run
    XLA's collectives: the NVLink kernels (pallas_kernels/all_to_all.py, row_exchange.py) need one process holding
    every GPU of the run. One process trained the reduced-layer DeepSeekMoE and Mixtral steps 1.06-1.12x the tokens/s
    of one process per GPU at expert=2 (2 x H200) and 1.16-1.44x at expert=4 (4 x H200), the whole 28-layer
    DeepSeekMoE 16B at expert=4 1.43x (benchmarks/RESULTS.md, sessions 55-57). Across hosts the kernels cannot run in
    any layout, so no note."""
    expert = mesh_shape.get("expert", 1)
    if (backend != "gpu" or not cfg.model.moe.n_experts or expert < 2 or cfg.model.moe.all_to_all == "xla"
            or hosts is None or len(set(hosts)) > 1):
        return None
    return (f"expert={expert} spans {len(hosts)} processes on one host, so the MoE exchanges run XLA's collectives "
            f"(the NVLink kernels need one process holding every GPU); one process of these GPUs trained "
            f"1.06-1.44x the tokens/s of one process per GPU on DeepSeekMoE and Mixtral steps at expert=2 and 4 "
            f"(README, Process layout)")


def dry_run_devices(cfg: TrainConfig) -> int:
    """Devices the dry run compiles for: the mesh product, a -1 axis counted as 1 (set it to plan for more)."""
    return math.prod(max(1, getattr(cfg.mesh, k)) for k in sharding.MESH_AXES)


def local_gpus() -> int:
    """NVIDIA GPUs this process may use, counted without starting a backend: the driver's entries under /proc,
    limited by CUDA_VISIBLE_DEVICES (whose list ends at its first invalid entry, e.g. -1)."""
    gpus = len(list(pathlib.Path("/proc/driver/nvidia/gpus").glob("*")))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [v.strip() for v in visible.split(",")]
        valid = next((i for i, v in enumerate(entries) if not v or v.startswith("-")), len(entries))
        gpus = min(gpus, valid)
    return gpus


def dry_run_target(n_devices: int, plugin: bool, gpus: int) -> tuple[str, bool]:
    """(description of the compile target, whether it is fake CPU devices) for a mesh of n_devices.

    A GPU compile (cuDNN attention, real GPU memory analysis) needs the mesh's devices on this machine. XLA's mock
    GPU topology cannot stand in for missing ones: it needs as many devices per mocked host as the machine has
    (a dry run for 2 devices on a 1-GPU H200 failed to start the backend with 2 per host), and mocking 2 hosts of 1
    GPU did not finish compiling the 2-layer Mixtral step in 150 s (benchmarks/RESULTS.md, session 33)."""
    if not plugin:
        return f"{n_devices} fake CPU devices", True
    if gpus >= n_devices:
        return f"{n_devices} of this machine's {gpus} GPU(s)", False
    return (f"{n_devices} fake CPU devices (this machine has {gpus} GPU(s); a GPU compile needs the mesh's "
            f"{n_devices} here)"), True


def prepare_dry_run_backend(n_devices: int) -> str:
    """Before any backend starts: choose the compile target (`dry_run_target`) and fake the CPU device count.

    The CPU device count is set either way: where the plugin is installed but cannot start (no driver), jax falls
    back to the CPU backend, and `dry_run` names that target instead. XLA:CPU's attention keeps the T x T scores,
    so its temporary memory overstates what flash attention needs on a GPU."""
    jax.config.update("jax_num_cpu_devices", n_devices)
    plugin = compat.cuda_plugin_available() and os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu")
    target, cpu = dry_run_target(n_devices, plugin, local_gpus() if plugin else 0)
    if cpu:
        jax.config.update("jax_platforms", "cpu")
    return target


def dry_run_documents(cfg: TrainConfig) -> TrainConfig:
    """model.attention_mask=documents in a dry run: eos_id and max_documents from the data where it opens (as a run
    would set them), else the estimate's assumption (memory_estimate.DOCUMENTS_ASSUMED documents; any eos_id)."""
    from mx_jax import memory_estimate

    m = cfg.model
    if m.attention_mask != "documents" or (m.eos_id >= 0 and m.max_documents):
        return cfg
    try:
        cfg, note = with_data_documents(cfg, open_dataset(cfg.data), max(cfg.mesh.context, 1))
        print(f"attn   | {note}")
        return cfg
    except ConfigError as e:
        docs = m.max_documents or memory_estimate.DOCUMENTS_ASSUMED
        print(f"attn   | documents: the data did not open here ({e}); planned for model.max_documents={docs}")
        return dataclasses.replace(cfg, model=dataclasses.replace(m, eos_id=max(m.eos_id, 0), max_documents=docs))


def dry_run(cfg: TrainConfig, target: str) -> dict:
    """Parameter count and per-device memory, from shapes and from an AOT compile on the target mesh; allocates
    no model memory."""
    from mx_jax import memory_estimate

    cfg = dry_run_documents(cfg)
    for k in sharding.MESH_AXES:
        if getattr(cfg.mesh, k) == -1:
            print(f"mesh   | mesh.{k}=-1 counts as 1 in a dry run (it has no devices to fill): set it, e.g. "
                  f"mesh.{k}=8, to plan for that many devices", flush=True)
    check_mesh_shape(cfg, {k: max(1, getattr(cfg.mesh, k)) for k in sharding.MESH_AXES})  # before the trace on it
    report = memory_estimate.estimate(cfg)
    print(memory_estimate.format_report(report), flush=True)
    n = report["devices"]
    devices = jax.devices()[:n]
    if "fake CPU" not in target and devices[0].platform != "gpu":
        target = f"{len(jax.devices())} fake CPU devices (the CUDA plugin is installed but did not start)"
    if len(devices) < n:
        print(f"compile: skipped ({len(jax.devices())} devices available, the mesh needs {n})")
        return report
    mesh = sharding.make_mesh(dataclasses.replace(cfg.mesh, **{k: max(1, getattr(cfg.mesh, k))
                                                                for k in sharding.MESH_AXES}), devices)
    if devices[0].platform != "gpu":
        cfg, notes = cpu_stand_ins(cfg)
        if notes:
            print(f"compile: on CPU devices with {', '.join(notes)} (GPU-only paths)", flush=True)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        check_against_mesh(cfg, mesh)
        setup = build(cfg, mesh)
        shape = (cfg.data.grad_accum_steps, cfg.data.batch_size // cfg.data.grad_accum_steps, cfg.data.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s) for k, s in setup.batch_shardings.items()}
        compiled = make_train_step(setup).lower(abstract_state(setup), batch).compile()
    mem = compiled.memory_analysis()
    gb = 1e9
    args_gb = mem.argument_size_in_bytes / gb
    temp_gb = mem.temp_size_in_bytes / gb
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes) / gb
    report["compiled"] = {"target": target, "seconds": time.perf_counter() - t0, "arguments_gb": args_gb,
                          "temp_gb": temp_gb, "total_gb": total}
    print(f"compiled train step for {target} in {report['compiled']['seconds']:.1f} s; per device (XLA):\n"
          f"  arguments     {args_gb:8.2f} GB (parameters + optimizer state + batch, donated)\n"
          f"  temporaries   {temp_gb:8.2f} GB (activations, gradients, workspace)\n"
          f"  total         {total:8.2f} GB")
    if "CPU" in target:
        print("  (XLA:CPU attention keeps T x T scores; on GPU cuDNN flash attention does not: for the GPU fit use "
              "the shape estimate above, or run the dry run on a GPU machine for a GPU compile)")
    return report


def init_distributed() -> None:
    """Join a multi-process run when the launcher set MX_JAX_COORDINATOR (launch/local.sh, launch/slurm.sbatch).

    MX_JAX_COORDINATOR=host:port, MX_JAX_NUM_PROCESSES, MX_JAX_PROCESS_ID; on CPU, MX_JAX_CPU_DEVICES sets the
    devices per process. Must run before anything touches a jax backend.

    jax's cluster auto-detection is off: inside an `srun` task it would read SLURM's variables and give each process
    the one GPU numbered SLURM_LOCALID (jax_cuda_visible_devices), where the launcher means every GPU the process
    can see (one process per node holding its 8, or one per GPU whose CUDA_VISIBLE_DEVICES names that GPU as 0).
    """
    coordinator = os.environ.get("MX_JAX_COORDINATOR")
    if not coordinator:
        return
    if cpu := os.environ.get("MX_JAX_CPU_DEVICES"):
        if not cpu.isdigit() or int(cpu) < 1:
            raise ConfigError(f"MX_JAX_CPU_DEVICES={cpu!r}: must be a positive number of CPU devices")
        jax.config.update("jax_num_cpu_devices", int(cpu))
    n, i = os.environ.get("MX_JAX_NUM_PROCESSES", ""), os.environ.get("MX_JAX_PROCESS_ID", "")
    if not n.isdigit() or int(n) < 1:
        raise ConfigError(f"MX_JAX_NUM_PROCESSES={n!r}: MX_JAX_COORDINATOR={coordinator} needs the number of processes")
    if not i.isdigit() or int(i) >= int(n):
        raise ConfigError(f"MX_JAX_PROCESS_ID={i!r}: must be this process's index, 0 to MX_JAX_NUM_PROCESSES - 1 = "
                          f"{int(n) - 1}")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=int(n), process_id=int(i),
                               cluster_detection_method="deactivate")


# XLA flags mx_jax sets unless the user already chose them (before any backend starts). Measured on an H200
# (benchmarks/RESULTS.md): cuBLAS instead of XLA's Triton GEMMs for the 8B-shaped step is 3% faster and compiles
# in 2.4 s instead of 10 s (Triton GEMM autotuning).
DEFAULT_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)
# `deterministic=true`: without it two identical GPU runs drift apart from the first steps (the 2-layer Mixtral step
# on an H200: step-10 losses 4.8466 and 5.0032); with it they matched at every logged step, at 0.87x the tokens/s
# (benchmarks/RESULTS.md, session 33). The Pallas kernels need nothing: their one atomic (tile_queue) hands out tile
# indices, and each output tile is computed whole by one CTA in a fixed order.
DETERMINISTIC_XLA_FLAG = "--xla_gpu_deterministic_ops"
# The GPU allocator, unless the environment chose one. XLA's default (BFC) gives each executable its temporaries as
# one block: with half the pool in use a step can fail for want of a contiguous block although the free memory adds
# up to twice what it needs. That stopped the whole DeepSeekMoE 16B at mesh.expert=4 on 4 x H200 at step 2 (its
# 30.5 GiB block, with 59 GiB free in two pieces). CUDA's stream-ordered allocator (cudaMallocAsync) trained the
# same run at a 95.4 GiB peak. It ran the 8B-shaped fp8 step (one H200) and the 4-layer DeepSeekMoE step at
# expert=2 (two) as fast as BFC (within 1%), with a first step 3-5 s longer (benchmarks/RESULTS.md, sessions 50-51).
ALLOCATOR_VAR = "XLA_PYTHON_CLIENT_ALLOCATOR"
DEFAULT_ALLOCATOR = "cuda_async"


# The persistent compilation cache (config key `compile_cache`): jax keys each compiled program on its HLO, the
# compile options and XLA flags, the devices and jax's version, so a run only ever reuses a program compiled for the
# same step, and a stale entry is never read. Only process 0 writes entries (jax); on a cluster every process finds
# them when the directory is on a filesystem all nodes see.
# One part of a program is not in its HLO: a custom_partitioning op (the scan buffers of multi-device steps,
# compat._sharded_empty; jax's cuDNN attention under a mesh) is lowered as a call to a Python callback, named by the
# callback's object address. That address differs in every process, so jax is told to leave it out of the key
# (`jax_remove_custom_partitioning_ptr_from_cache_key`); otherwise no multi-device step would ever be found again
# (session 53). What the callback does then has to be pinned another way. Its code: the programs are kept in a
# subdirectory named by a digest of mx_jax's and pallas_kernels' sources (`code_digest`), so a changed mx_jax never
# loads a program another version compiled. Its static arguments: they must follow from the program's shapes, as
# they do today (cuDNN attention's scale is head_dim^-0.5, its mask causal or padding by the block's place); a
# config value that reached such a callback and nothing else would let two different steps share a key.
COMPILE_CACHE_VAR = "JAX_COMPILATION_CACHE_DIR"


def source_digest(root: pathlib.Path) -> str:
    """12 hex digits of sha256 over the Python sources of root/mx_jax and root/pallas_kernels (path and bytes)."""
    h = hashlib.sha256()
    for package in ("mx_jax", "pallas_kernels"):
        for f in sorted((root / package).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


@functools.cache
def code_digest() -> str:
    """`source_digest` of the code running now."""
    return source_digest(pathlib.Path(__file__).resolve().parent.parent)


def compile_cache_dir(setting: str) -> str | None:
    """The directory config key `compile_cache` names: "auto" = $JAX_COMPILATION_CACHE_DIR, else
    $XDG_CACHE_HOME/mx_jax/jax (~/.cache/mx_jax/jax); "" = None (off); any other value is the path."""
    if setting == "auto":
        if os.environ.get(COMPILE_CACHE_VAR):
            return os.environ[COMPILE_CACHE_VAR]
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "mx_jax", "jax")
    return os.path.expanduser(setting) if setting else None


def use_compile_cache(setting: str) -> str | None:
    """Point jax's persistent compilation cache at the subdirectory code-`code_digest()` of
    `compile_cache_dir(setting)` (None turns it off, also where the environment had set it), before anything
    compiles, and return it. A local directory that cannot be created or written is a ConfigError naming the key."""
    path = compile_cache_dir(setting)
    if path is not None:
        path = f"{path.rstrip('/')}/code-{code_digest()}"
    if path is not None and "://" not in path:
        try:
            os.makedirs(path, exist_ok=True)
            if not os.access(path, os.W_OK):
                raise PermissionError(f"{path} is not writable")
        except OSError as e:
            raise ConfigError(f"config key 'compile_cache': cannot use {path!r} for compiled programs ({e}); name "
                              f"another directory, or compile_cache= to turn the cache off") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", path is not None)  # see COMPILE_CACHE_VAR
    return path


class _CacheHits:
    """Programs this process took from the persistent compilation cache, and the compile seconds that saved (jax's
    monitoring event, recorded at each hit)."""

    EVENT = "/jax/compilation_cache/compile_time_saved_sec"

    def __init__(self):
        self.hits, self.saved_s = 0, 0.0

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == self.EVENT:
            self.hits += 1
            self.saved_s += duration


_CACHE_HITS = _CacheHits()
jax.monitoring.register_event_duration_secs_listener(_CACHE_HITS)


def apply_default_xla_flags(deterministic: bool = False) -> None:
    """DEFAULT_XLA_FLAGS, the GPU memory share (memory_estimate.GPU_MEM_FRACTION instead of JAX's 0.75) and
    DEFAULT_ALLOCATOR, each unless the environment already chose it; with `deterministic`, XLA's deterministic ops
    (an XLA_FLAGS that turns them off is a ConfigError). Before any backend starts."""
    from mx_jax import memory_estimate

    flags = os.environ.get("XLA_FLAGS", "")
    for flag in DEFAULT_XLA_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    if deterministic:
        set_to = [f.partition("=")[2] or "true" for f in flags.split() if f.split("=")[0] == DETERMINISTIC_XLA_FLAG]
        if any(v.lower() not in ("true", "1") for v in set_to):
            raise ConfigError(f"config key 'deterministic': true, but XLA_FLAGS sets {DETERMINISTIC_XLA_FLAG}="
                              f"{set_to[-1]}; drop it from XLA_FLAGS or set deterministic=false")
        if not set_to:
            flags = f"{flags} {DETERMINISTIC_XLA_FLAG}=true".strip()
    os.environ["XLA_FLAGS"] = flags
    if not any(os.environ.get(v) for v in memory_estimate.MEM_FRACTION_VARS):
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(memory_estimate.GPU_MEM_FRACTION)
    if not os.environ.get(ALLOCATOR_VAR):
        os.environ[ALLOCATOR_VAR] = DEFAULT_ALLOCATOR


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: --config, --dry-run and key=value overrides, the flags anywhere among the overrides."""
    ap = argparse.ArgumentParser(prog="python -m mx_jax.train", description="Train a Llama with mx_jax.")
    ap.add_argument("--config", help="YAML config (defaults < YAML < key=value overrides)")
    ap.add_argument("--dry-run", action="store_true",
                    help="parameter count and per-device memory: a shape estimate, then an AOT compile of the train "
                         "step for the configured mesh (on this machine's GPUs where it has enough, else on fake CPU "
                         "devices; a -1 mesh axis counts as 1); allocates no model memory")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. optim.lr_peak=1e-3")
    return ap.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)  # starts no backend, so the XLA flags below still apply
        apply_default_xla_flags(cfg.deterministic)
        use_compile_cache(cfg.compile_cache)
        if args.dry_run:
            dry_run(cfg, prepare_dry_run_backend(dry_run_devices(cfg)))
            return 0
        init_distributed()
        if train(cfg).preempted:
            return preemption.EXIT_CODE
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except checkpoint.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    except NotImplementedError as e:  # a kernel refusing its problem: only where quant.impl forces the kernels
        if cfg.quant.impl == "auto":
            raise
        print(f"error: config key 'quant.impl': {cfg.quant.impl} forces that path, which does not take this "
              f"problem ({e}); quant.impl=auto sends the problems the kernels do not take to XLA", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as e:
        if (why := out_of_memory_help(str(e))) is None:
            raise
        print(f"error: {why}", file=sys.stderr)
        return 5
    return 0


def out_of_memory(message: str) -> str | None:
    """"out of device memory allocating SIZE (XLA's line)." for a device out-of-memory error from XLA (its
    message), or None for any other error."""
    if "RESOURCE_EXHAUSTED" not in message or "memory" not in message.lower():
        return None
    size = re.search(r"allocate ([\d.]+ ?[KMGT]i?B)", message)
    # Quote XLA's line that names the allocation: out of memory while autotuning, the message's first line is only
    # "Failed to get configs for: 8 out of 109 instructions", with the allocations listed below it.
    xla_lines = message.strip().splitlines()
    first = next((l for l in xla_lines if "Out of memory while trying to allocate" in l), xla_lines[0]).strip()[:300]
    return f"out of device memory{f' allocating {size.group(1)}' if size else ''} ({first})."


def out_of_memory_help(message: str) -> str | None:
    """What to do about a device out-of-memory error from XLA (its message) in training, or None for any other
    error."""
    if (what := out_of_memory(message)) is None:
        return None
    lines = [what]
    if (os.environ.get(ALLOCATOR_VAR) or "default").lower() in ("default", "bfc"):
        lines.append(f"If `--dry-run` says this run fits, the free memory may be fragmented (XLA needs each step's "
                     f"temporaries in one block): {ALLOCATOR_VAR}={DEFAULT_ALLOCATOR} avoids that.")
    lines.append("Less memory per device: a smaller data.batch_size with data.grad_accum_steps, model.remat=full, "
                 "or more devices on mesh.fsdp. Checkpoints already committed are kept.")
    return " ".join(lines)


if __name__ == "__main__":
    sys.exit(main())
