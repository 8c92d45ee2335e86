"""Llama 3 (dense) and its sparse-MoE variants, in Flax NNX. Reads top to bottom: recipes, block, model, loss.

    tokens (B,T) -> embed (V,D) -> L x [x + Attn(RMSNorm(x)); x + FFN(RMSNorm(x))] -> RMSNorm -> head (D,V)

The L blocks are one stacked set of parameters with a leading layer axis. `model.scan_layers=true` runs them with
`jax.lax.scan`: compile time stays flat in L (an 80-layer 70B compiles like a 1-layer one). `false` unrolls the same
stacked parameters into a Python loop: XLA then keeps each layer's saved activations in their own buffers instead of
writing them into the scan's stacked residuals (dynamic_update_slice copies, ~10 ms of a 260 ms 8B step,
benchmarks/RESULTS.md), at a compile time that grows with L. jax would also zero-fill those buffers before the first
layer (a broadcast zero: ~4.6 ms of the 8-layer 8B fp8 step); `compat.uninitialize_scan_outputs`, installed on
import, has XLA allocate them instead (+2.9% on that step on an H200, +1.8% on an H100), on a multi-device mesh
each device its own shards (+2.7% on the whole 8B in fp8 at fsdp=4 on 4 x H200). Under an fp8 recipe the
dense linears read fp8 operands made at the update (`compute_copies`, quant.prequantize), so neither the forward nor
the rematerialized backward concatenates or casts a weight (+1.5% on that step on an H100, 1.4 GiB less peak). The loop
takes its layers through `unstack`, whose gradient stacks the per-layer gradients; differentiating `stacked[i]` would
instead add L zero-padded copies, which the clipping norm and the optimizer re-evaluate element by element (1.1-1.8
ms per reduction on the 8B step). Rematerialization wraps each block: "full" recomputes everything in the backward pass,
"save_matmuls" keeps the outputs of every linear and of attention (tagged with checkpoint_name in layers.py; also
the routed experts' grouped GEMMs without expert parallelism, mx_jax/dispatch.py) and the residual stream between
attention and FFN, h = x + Attn(..) (named "residual", which the FFN's RMSNorm backward reads), and recomputes only
the cheap elementwise work. Keeping h rather than the output projection's result (from which the backward would
rebuild h) matters inside lax.scan: XLA:GPU fused that Pallas GEMM into its write to the stacked residuals and ran it
a second time for the add, one extra 8192 x 4096 x 4096 fp8 GEMM per layer and sequence (2.0 ms of the 8-layer 8B
fp8 step on an H100, 9 ms of the whole 8B at fsdp=4; session 42 in benchmarks/RESULTS.md). Under bf16 XLA folds the
add into the cuBLAS GEMM (h is its C operand), so h was again a GEMM output run twice; in scanned layers an
optimization barrier on attention's output keeps the add out of the GEMM (the 8-layer 8B bf16 step +1.0% on an H200,
session 43; fp8 kernel counts unchanged).

The output head is untied from the embedding, as in Llama 3. Training keeps the logits in the compute dtype
(bf16: 2 bytes per vocabulary entry per token instead of 4; the head GEMM accumulates in float32 either way) and
the loss, the mean token cross-entropy in nats, upcasts inside its reductions. Over the targets that count, c_t = 1
unless y_t = -1 (a prompt token of a fine-tuning example, data.IGNORED), with N = sum_t c_t over the whole step:

    loss = sum_t c_t [ logsumexp_v z_tv - z_t,y_t ] / N,      dloss/dz_tv = c_t (softmax(z_t)_v - [v = y_t]) / N

`cross_entropy` is a custom_vjp that writes exactly that gradient in the logits' dtype in one pass, where autodiff
of the plain expression would materialize float32 softmax and one-hot scatter buffers of the logits' size.

Multi-token prediction (model.mtp, DeepSeek-V3 section 2.2; `MTPLayer`): D modules after the model, sharing its
embedding E and head W. With h_0 = RMSNorm(x_L) (the head's input) and t_i the token at position i,

    h_k,i = RMSNorm_k( Block_k( [RMSNorm_e,k(E t_{i+k}); RMSNorm_h,k(h_{k-1},i)] W_eh,k ) ),   z_k,i = h_k,i W
    loss  = CE(z_0, t_{i+1}) + (lambda / D) sum_k CE(z_k, t_{i+k+1})

each CE over the targets that count, divided by the same N (the paper's 1/T; a position whose target k + 1 ahead is
past the sequence or masked counts for nothing). [e; h] is in the order of DeepSeek-V3's checkpoint (its eh_proj),
and h_k is the normed output, the input of the head and of the next depth, as in Megatron-LM's MTP layers. Block_k
is a MoE block in a MoE model; its statistics join the model's (balancing loss, router-bias update). The modules
run only in training (`__call__(mtp=True)`): held-out loss, sampling and scoring read z_0.

Where the batch is split over data devices, which hold the same shard of the head (fsdp, expert and context split its
D), its gradient is a sum of the devices' partials: a ring all-reduce of the (D, V) head, in f32 by default. When a
microbatch has fewer tokens than about two vocabularies (sharding.head_vocab_axes), the head runs vocab-parallel
instead, split on V over data and expert: the devices all-gather their rows, each computes its own vocabulary's
logits, and no weight gradient moves. On 2 x H200 (session 45, with the embedding's sparse gradient sum,
sharding.embed_lookup; the dense weights were then replicated over expert) the 4-layer DeepSeekMoE step at expert=2
went from 120,805 to 131,585 tokens/s, the 4-layer 8B fp8 step at data=2 from 118,616 to 125,584, and the 2-layer
Mixtral step at expert=2 from 117,775 to 118,428 (its all-reduce had been hidden behind compute).

The head's weight gradient is fenced with its input gradient (quant.linear's `fence`): nothing in the layers'
backward needs it, and XLA had run its GEMM after them, keeping the (tokens, V) logits gradient alive through the
whole backward. Fenced, the 8-layer 8B fp8 step on one H200 peaks at 46.8 GiB instead of 47.7, and the 4-layer
DeepSeekMoE step at expert=2 on 2 x H200 at 21.2 instead of 22.4, at the same speed (benchmarks/RESULTS.md,
session 60).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mx_jax import compat, dispatch, grouped_linear, quant, sharding
from mx_jax.config import ModelConfig, QuantConfig
from mx_jax.context_parallel import from_zigzag, to_zigzag
from mx_jax.layers import (Attention, KVCache, LatentAttention, LatentCache, Positions, RMSNorm, SwiGLU, _param,
                           context_shards, document_segments, linear, rope_inv_freq)
from mx_jax.moe import MoE, RouterBias, update_bias

compat.uninitialize_scan_outputs()  # the scanned layers' residual buffers are allocated, not zero-filled

ATTN_LINEARS = ("wq", "wk", "wv", "wo")
MLA_LINEARS = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")  # layers.LatentAttention's (wq, or wq_a and wq_b)
MLP_LINEARS = ("w_gate", "w_up", "w_down")


def attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each attention linear: grouped-query's, or multi-head latent attention's (model.mla)."""
    d, h, a = cfg.d_model, cfg.n_heads, cfg.mla
    if not a.kv_rank:
        hk, gk = h * cfg.d_head, cfg.n_kv_heads * cfg.d_head
        return {"wq": (d, hk), "wk": (d, gk), "wv": (d, gk), "wo": (hk, d)}
    q = {"wq_a": (d, a.q_rank), "wq_b": (a.q_rank, h * cfg.d_head)} if a.q_rank else {"wq": (d, h * cfg.d_head)}
    return {**q, "wkv_a": (d, a.kv_rank + a.rope_dim), "wkv_b": (a.kv_rank, h * (a.nope_dim + a.v_dim)),
            "wo": (h * a.v_dim, d)}


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """The recipe chosen for each linear, and why any linear stayed in bf16."""

    recipes: dict[str, str]
    notes: tuple[str, ...]
    expert_min_rows: int = 0  # quant.expert_min_rows, for the routed experts (dispatch.expert_recipe)
    impl: str = "auto"  # quant.impl: the GEMM and cast dispatchers' choice
    # the routed experts' fp8 operands are made at the update (`plan_for_run`: the run's rows per device suffice)
    prequantize_experts: bool = False
    vocab_parallel: bool = False  # the head is split on V and runs vocab-parallel (`plan_for_run`)


def plan_linears(cfg: ModelConfig, qcfg: QuantConfig) -> LinearPlan:
    """Pick each linear's recipe from quant.modules; linears the kernels cannot take stay bf16, with a note.

    Keys: the attention and MLP weight names, "shared.<name>" for MoE shared experts, "head", "experts" (the
    grouped GEMMs of the routed experts, which take the recipes in grouped_linear.RECIPES) and, with model.mtp, the
    MTP modules' "eh_proj" (an "mlp" kind for quant.modules).
    """
    d, f = cfg.d_model, cfg.d_ff
    fs = cfg.moe.n_shared * (cfg.moe.d_expert or cfg.d_ff)
    attn = attention_shapes(cfg)
    shapes = {**attn, "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
              "shared.w_gate": (d, fs), "shared.w_up": (d, fs), "shared.w_down": (fs, d),
              "head": (d, cfg.vocab_size), **({"eh_proj": (2 * d, d)} if cfg.mtp.depth else {})}
    kinds = {**{n: "attn" for n in attn}, "head": "head"}
    recipes, notes = {}, []
    for name, (k, n) in shapes.items():
        if name.startswith("shared.") and not fs:
            continue
        recipe = qcfg.recipe if kinds.get(name, "mlp") in qcfg.modules else "bf16"
        if recipe != "bf16":
            reason = quant.kernel_support(recipe, k, n)
            if reason:
                notes.append(f"{name} ({k}x{n}) stays bf16: {reason}")
                recipe = "bf16"
        recipes[name] = recipe
    recipes["experts"] = "bf16"
    if cfg.moe.n_experts and "experts" in qcfg.modules and qcfg.recipe != "bf16":
        grouped = grouped_linear.recipe_for(qcfg.recipe)
        if grouped is None:
            notes.append(f"routed experts stay bf16: no grouped-GEMM kernel for recipe {qcfg.recipe}")
        else:
            recipes["experts"] = grouped
    return LinearPlan(recipes, tuple(notes), qcfg.expert_min_rows, qcfg.impl)


class Block(nnx.Module):
    """x + Attn(RMSNorm(x)), then x + FFN(RMSNorm(x)); FFN is SwiGLU or, with moe=True, a MoE layer. x (B,T,D)."""

    def __init__(self, cfg: ModelConfig, plan: LinearPlan, impl: str, moe: bool = False, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        r = plan.recipes
        self.scanned = cfg.scan_layers
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        attention = LatentAttention if cfg.mla.kv_rank else Attention
        self.attn = attention(cfg, {n: r[n] for n in attention_shapes(cfg)}, impl, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        if moe:
            shared = {n: r[f"shared.{n}"] for n in MLP_LINEARS} if cfg.moe.n_shared else {}
            self.moe = MoE(cfg, r["experts"], impl, shared, min_rows=plan.expert_min_rows, rngs=rngs)
        else:
            self.mlp = SwiGLU(cfg, cfg.d_ff, {n: r[n] for n in MLP_LINEARS}, impl, rngs=rngs)

    def __call__(self, x: jax.Array, pos: Positions, inv_freq: jax.Array) -> tuple[jax.Array, dict]:
        a = self.attn(self.attn_norm(x), pos, inv_freq)
        if self.scanned:  # keeps XLA from folding the add into a cuBLAS GEMM, whose saved output it would run twice
            a = jax.lax.optimization_barrier(a)
        x = checkpoint_name(x + a, "residual")  # module docstring
        stats = {}
        if hasattr(self, "moe"):
            y, stats = self.moe(self.mlp_norm(x))
        else:
            y = self.mlp(self.mlp_norm(x))
        x = sharding.constrain(x + y, ("batch", "seq", "act_embed"))
        return x, stats

    def decode(self, x: jax.Array, pos: Positions, inv_freq: jax.Array, cache: KVCache,
               layer: tuple[jax.Array, ...]) -> tuple[jax.Array, KVCache]:
        """The block over T new tokens, its keys and values at `layer` of the stacked cache (Llama.decode)."""
        a, cache = self.attn.decode(self.attn_norm(x), pos, inv_freq, cache, layer)
        x = x + a
        # one GEMM per weight (Attention.decode says why)
        y = self.moe.decode(self.mlp_norm(x)) if hasattr(self, "moe") else self.mlp(self.mlp_norm(x), False)
        return x + y, cache


class MoEGroup(nnx.Module):
    """every_n_layers > 1: (n - 1) dense blocks, then one MoE block; the model scans over these groups."""

    def __init__(self, cfg: ModelConfig, plan: LinearPlan, impl: str, *, rngs: nnx.Rngs):
        n = cfg.moe.every_n_layers
        self.dense = _stack(n - 1, lambda r: Block(cfg, plan, impl, rngs=r), rngs)
        self.scan = cfg.scan_layers
        self.moe_block = Block(cfg, plan, impl, moe=True, rngs=rngs)

    def __call__(self, x, pos, inv_freq):
        x, _ = _scan(self.dense, x, pos, inv_freq, "none", self.scan)
        return self.moe_block(x, pos, inv_freq)

    def decode(self, x, pos, inv_freq, cache: dict, layer: tuple[jax.Array, ...]):
        x, dense = _decode_stack(self.dense, x, pos, inv_freq, cache["dense"], layer)
        x, moe = self.moe_block.decode(x, pos, inv_freq, cache["moe_block"], layer)
        return x, {"dense": dense, "moe_block": moe}


class MTPLayer(nnx.Module):
    """Depth k of multi-token prediction (model.mtp; module docstring): x (B,T,2D) = [e; h], the embedded tokens k
    ahead and the (k-1)-th depth's hidden state, -> (RMSNorm(Block([RMSNorm(e); RMSNorm(h)] W_eh)), the block's MoE
    statistics). The block is a MoE block in a MoE model (DeepSeek-V3's MTP layer is), else a dense one. One input
    array lets `layer_body` run it (and memory_estimate trace it) like any layer."""

    def __init__(self, cfg: ModelConfig, plan: LinearPlan, impl: str, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        self.enorm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.hnorm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.eh_proj = _param(rngs, (2 * cfg.d_model, cfg.d_model), cfg.init_std, ("embed", "mlp"), pd)
        self.block = Block(cfg, plan, impl, moe=cfg.moe.n_experts > 0, rngs=rngs)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.recipe, self.impl, self.reduce_dtype = plan.recipes["eh_proj"], impl, cfg.grad_reduce_dtype

    def __call__(self, x: jax.Array, pos: Positions, inv_freq: jax.Array) -> tuple[jax.Array, dict]:
        u, stats = self.block(sharding.constrain(self._joined(x), ("batch", "seq", "act_embed")), pos, inv_freq)
        return self.norm(u), stats

    def _joined(self, x: jax.Array) -> jax.Array:
        e, h = jnp.split(x, 2, axis=-1)
        u = jnp.concatenate([self.enorm(e), self.hnorm(h)], axis=-1)
        return linear(u, self.eh_proj, self.recipe, self.impl, self.reduce_dtype)

    def decode(self, x: jax.Array, pos: Positions, inv_freq: jax.Array, cache: KVCache,
               layer: tuple[jax.Array, ...]) -> tuple[jax.Array, KVCache]:
        """The module over T new positions, its block's keys and values at `layer` of its cache (Llama.decode_mtp)."""
        u, cache = self.block.decode(self._joined(x), pos, inv_freq, cache, layer)
        return self.norm(u), cache


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_matmuls": jax.checkpoint_policies.save_only_these_names("matmul", "attention", "residual"),
}


def _stack(n: int, make, rngs: nnx.Rngs) -> nnx.Module:
    """n copies of a module with parameters stacked on a leading axis (independent initializations)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=n)
    def make_stack(r: nnx.Rngs):
        return make(r)

    return make_stack(rngs)


def unstack(tree, n: int) -> list:
    """The n layers of a stacked pytree, as n pytrees of slices; the gradient of the stack is their gradients
    stacked (one concatenation). Autodiff of `a[i]` instead pads each layer's gradient to the stacked shape and
    adds the n pads, which every consumer of the gradient (clipping norm, optimizer) then re-evaluates per element.
    """
    leaves, treedef = jax.tree.flatten(tree)
    # fp8 leaves are prequantized operands (quant.Prequantized), never differentiated
    differentiable = [jnp.issubdtype(a.dtype, jnp.inexact) and jnp.dtype(a.dtype).itemsize > 1 for a in leaves]

    @jax.custom_vjp
    def split(*leaves):
        return tuple(tuple(a[i] for a in leaves) for i in range(n))

    def split_fwd(*leaves):
        return split(*leaves), None

    def split_bwd(_, cts):
        return tuple(jnp.stack([cts[i][j] for i in range(n)]) if d else None for j, d in enumerate(differentiable))

    split.defvjp(split_fwd, split_bwd)
    return [jax.tree.unflatten(treedef, layer) for layer in split(*leaves)]


def layer_body(graphdef, pos, inv_freq, remat: str):
    """body(x, layer_state) -> (x, stats): one layer of a stack under the remat policy, as `_scan` runs it (and
    memory_estimate traces it; its argument name `layer_state` is how the estimate tells weights from activations)."""

    def body(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, pos, inv_freq)

    if remat != "none":
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[remat], prevent_cse=False)
    return body


def _scan(stack: nnx.Module, x, pos, inv_freq, remat: str, scan: bool = True):
    """Run a stacked module layer by layer, by lax.scan or unrolled; returns (x, per-layer stats stacked)."""
    graphdef, state = nnx.split(stack)
    body = layer_body(graphdef, pos, inv_freq, remat)
    if scan:
        return jax.lax.scan(body, x, state)
    n = jax.tree.leaves(state)[0].shape[0]
    stats = []
    for layer in unstack(state, n):
        x, s = body(x, layer)
        stats.append(s)
    return x, jax.tree.map(lambda *per_layer: jnp.stack(per_layer), *stats)


def _decode_stack(stack: nnx.Module, x, pos, inv_freq, cache, outer: tuple[jax.Array, ...] = ()):
    """A stacked module's layers over T new tokens -> (x, cache). The cache is the scan's carry, each layer writing
    its keys and values in place at (*outer, its index): as scanned inputs and outputs, every step would copy the
    whole cache into a new stacked output."""
    graphdef, state = nnx.split(stack)

    def body(carry, layer):
        x, cache = carry
        i, layer_state = layer
        return nnx.merge(graphdef, layer_state).decode(x, pos, inv_freq, cache, (*outer, i)), None

    n = jax.tree.leaves(state)[0].shape[0]
    return jax.lax.scan(body, (x, cache), (jnp.arange(n), state))[0]


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.bfloat16, mtp: bool = False) -> dict:
    """A zero KV cache of `length` positions for `batch` rows, shaped like the model's stacks (Llama.decode); mtp:
    also the first multi-token prediction module's, "mtp" (Llama.decode_mtp)."""

    def kv(*layers: int) -> KVCache | LatentCache:
        if cfg.mla.kv_rank:  # the latents, one "head" (layers.LatentAttention.decode)
            shape = (*layers, batch, length, 1)
            return LatentCache(jnp.zeros((*shape, cfg.mla.kv_rank), dtype),
                               jnp.zeros((*shape, cfg.mla.rope_dim), dtype))
        shape = (*layers, batch, length, cfg.n_kv_heads)
        return KVCache(jnp.zeros((*shape, cfg.d_head), dtype), jnp.zeros((*shape, cfg.d_head), dtype))

    n_first, n_groups, per_group = layer_kinds(cfg)
    cache = {"dense_blocks": kv(n_first)} if n_first else {}
    cache["blocks"] = kv(n_groups) if per_group == 1 else {"dense": kv(n_groups, per_group - 1),
                                                           "moe_block": kv(n_groups)}
    if mtp:
        cache["mtp"] = kv(1)
    return cache


def layer_kinds(cfg: ModelConfig) -> tuple[int, int, int]:
    """(dense layers first, groups in the main stack, layers per group)."""
    m = cfg.moe
    if not m.n_experts:
        return 0, cfg.n_layers, 1
    return m.n_dense_first, (cfg.n_layers - m.n_dense_first) // m.every_n_layers, m.every_n_layers


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, qcfg: QuantConfig = QuantConfig(), *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.plan = plan_linears(cfg, qcfg)
        pd = jnp.dtype(cfg.param_dtype)
        impl = qcfg.impl
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, ("vocab", "embed"), pd)
        n_first, n_groups, per_group = layer_kinds(cfg)
        moe = cfg.moe.n_experts > 0
        if n_first:
            self.dense_blocks = _stack(n_first, lambda r: Block(cfg, self.plan, impl, rngs=r), rngs)
        if per_group > 1:
            self.blocks = _stack(n_groups, lambda r: MoEGroup(cfg, self.plan, impl, rngs=r), rngs)
        else:
            self.blocks = _stack(n_groups, lambda r: Block(cfg, self.plan, impl, moe=moe, rngs=r), rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, ("embed", "vocab"), pd)
        if cfg.mtp.depth:
            self.mtp = _stack(cfg.mtp.depth, lambda r: MTPLayer(cfg, self.plan, impl, rngs=r), rngs)
        self.head_recipe, self.quant_impl = self.plan.recipes["head"], impl

    def __call__(self, tokens: jax.Array, logits_dtype=jnp.float32, *, mtp: bool = False) -> tuple:
        """tokens (B,T) int32 -> (logits (B,T,V) in logits_dtype, MoE statistics per MoE layer; {} for dense).

        Training asks for the compute dtype (module docstring); float32 is the default for inspection. mtp=True
        (a model with model.mtp.depth D > 0) adds a third element, the D multi-token prediction modules' logits, a
        tuple of (B,T,V): the k-th's position t predicts token t + k + 1 (`mtp_targets`; its last k positions,
        whose token k ahead is not in `tokens`, read token 0 and have no target); the MoE statistics then also
        hold the MTP modules' MoE layers, after the model's.
        """
        cfg = self.cfg
        cdt = jnp.dtype(cfg.compute_dtype)
        ids = tokens
        positions = jnp.arange(tokens.shape[1])
        segments = None
        n_ctx = context_shards()
        if cfg.attention_mask == "documents":
            if cfg.eos_id < 0 or cfg.max_documents < 1:
                raise ValueError("model.attention_mask=documents needs model.eos_id and model.max_documents (train.py "
                                 "sets them from the data)")
            # under context parallelism max_documents caps each chunk's documents (context_parallel._local_segments)
            segments = document_segments(tokens, cfg.eos_id, cfg.max_documents if n_ctx == 1 else tokens.shape[1])
        if n_ctx > 1:  # load-balanced causal attention over the context axis (mx_jax/context_parallel.py)
            tokens, positions = to_zigzag(tokens, n_ctx), to_zigzag(positions, n_ctx, axis=0)
            segments = None if segments is None else to_zigzag(segments, n_ctx)
        x = sharding.embed_lookup(self.embed[...], tokens, cdt)  # (B,T,D); gather first, cast B*T rows only
        inv_freq = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        pos = Positions(positions, segments)
        if hasattr(self, "dense_blocks"):
            x, _ = _scan(self.dense_blocks, x, pos, inv_freq, cfg.remat, cfg.scan_layers)
        x, stats = _scan(self.blocks, x, pos, inv_freq, cfg.remat, cfg.scan_layers)  # leaves (n_groups, ...)
        h = self.final_norm(x)  # per token: the same before or after undoing the zigzag
        logits = self._logits(h, n_ctx).astype(logits_dtype)
        if not mtp:
            return logits, stats
        if not cfg.mtp.depth:
            raise ValueError("Llama(mtp=True) needs a model with model.mtp.depth > 0")
        graphdef, state = nnx.split(self.mtp)
        body = layer_body(graphdef, pos, inv_freq, cfg.remat)
        mtp_logits, mtp_stats = [], []
        for k, layer in enumerate(unstack(state, cfg.mtp.depth), 1):
            ahead = jnp.concatenate([ids[:, k:], jnp.zeros_like(ids[:, :k])], axis=1)  # token t + k at t
            if n_ctx > 1:
                ahead = to_zigzag(ahead, n_ctx)
            e = sharding.embed_lookup(self.embed[...], ahead, cdt)
            h, s = body(jnp.concatenate([e, h], axis=-1), layer)
            mtp_logits.append(self._logits(h, n_ctx).astype(logits_dtype))
            mtp_stats.append(s)
        if stats:  # per MoE layer: the model's, then the MTP modules'
            stats = jax.tree.map(lambda a, *b: jnp.concatenate([a, jnp.stack(b)]), stats, *mtp_stats)
        return logits, stats, tuple(mtp_logits)

    def _logits(self, h: jax.Array, n_ctx: int) -> jax.Array:
        """The head over the normed hidden states h (B,T,D) (in zigzag order under context parallelism: undone)."""
        cfg = self.cfg
        if n_ctx > 1:
            h = sharding.constrain(from_zigzag(h, n_ctx), ("batch", "seq", "act_embed"))
        vocab_parallel = bool(head_vocab_axes(cfg, self.head_recipe, h.shape[0] * h.shape[1]))
        if vocab_parallel:  # the group's rows on every device of it; each computes its own vocabulary's logits
            h = sharding.constrain(h, ("head_batch", "seq", "act_embed"))
        logits = linear(h, self.head, self.head_recipe, self.quant_impl, cfg.grad_reduce_dtype, fence=True)
        if vocab_parallel:
            logits = sharding.constrain(logits, ("head_batch", "seq", "head_vocab"))
        return logits

    def decode(self, tokens: jax.Array, cache: dict, index: jax.Array, first: jax.Array, *,
               every_position: bool = False) -> tuple[jax.Array, dict]:
        """tokens (B,T) at cache positions index .. index+T-1 -> (float32 logits (B,V) after the last of them, the
        cache with their keys and values). Row b's text starts at position first[b] (B,): the rows are left-padded
        to a common length, and a token sees the positions from its row's first to its own (it and the padding see
        themselves only). RoPE scores depend on position differences only, so a left-padded row decodes as it would
        alone. every_position: the logits after each of the T tokens, (B,T,V) in the compute dtype (mx_jax.choices
        scores continuations so). One device or tensor-parallel, no context parallelism; mx_jax/sample.py runs it."""
        x, new = self._decode_trunk(tokens, cache, index, first)
        x = self.final_norm(x if every_position else x[:, -1:])
        logits = self.head_logits(x)
        return (logits if every_position else logits[:, 0].astype(jnp.float32)), {**cache, **new}

    def _positions(self, t: int, cache: dict, index: jax.Array, first: jax.Array) -> tuple[Positions, jax.Array]:
        """The Positions of T new tokens at cache positions index .. index+T-1 (`decode`; index a scalar, or each
        row's (B,)), and RoPE's inverse frequencies."""
        cfg = self.cfg
        length = jax.tree.leaves(cache)[0].shape[-3]
        here = jnp.asarray(index)[..., None] + jnp.arange(t)  # (T,), or (B, T)
        at = jnp.broadcast_to(here, (first.shape[0], t))[..., None]  # (B, T, 1)
        keys = jnp.arange(length)
        visible = ((keys >= first[:, None, None]) & (keys <= at)) | (keys == at)
        return Positions(here, visible=visible), rope_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)

    def _decode_trunk(self, tokens: jax.Array, cache: dict, index: jax.Array, first: jax.Array
                      ) -> tuple[jax.Array, dict]:
        """The layers over T new tokens -> (the last layer's output (B,T,D), the stacks' caches)."""
        pos, inv_freq = self._positions(tokens.shape[1], cache, index, first)
        x = sharding.embed_lookup(self.embed[...], tokens, jnp.dtype(self.cfg.compute_dtype))
        new = {}
        if hasattr(self, "dense_blocks"):
            x, new["dense_blocks"] = _decode_stack(self.dense_blocks, x, pos, inv_freq, cache["dense_blocks"])
        x, new["blocks"] = _decode_stack(self.blocks, x, pos, inv_freq, cache["blocks"])
        return x, new

    def head_logits(self, h: jax.Array) -> jax.Array:
        """The head over final-normed hidden states h (B,T,D) -> logits (B,T,V) in the compute dtype."""
        return linear(h, self.head, self.head_recipe, self.quant_impl, self.cfg.grad_reduce_dtype)

    def decode_hidden(self, tokens: jax.Array, cache: dict, index: jax.Array, first: jax.Array
                      ) -> tuple[jax.Array, dict]:
        """`decode`'s layers, returning the final-normed hidden states of all T tokens (B,T,D), the head's input and
        the first MTP module's h_0 (speculative decoding, mx_jax/sample.py), with the cache."""
        x, new = self._decode_trunk(tokens, cache, index, first)
        return self.final_norm(x), {**cache, **new}

    def decode_mtp(self, ahead: jax.Array, h: jax.Array, cache: dict, index: jax.Array, first: jax.Array
                   ) -> tuple[jax.Array, dict]:
        """The first multi-token prediction module over T positions index .. index+T-1: ahead (B,T) the token after
        each position, h (B,T,D) the model's final-normed hidden states there (`decode_hidden`) -> (its normed
        output h_1 (B,T,D), whose head logits predict the token two ahead, the cache with its keys and values at
        cache["mtp"], init_cache(mtp=True))."""
        if not self.cfg.mtp.depth:
            raise ValueError("Llama.decode_mtp needs a model with model.mtp.depth > 0")
        pos, inv_freq = self._positions(ahead.shape[1], cache, index, first)
        graphdef, state = nnx.split(self.mtp)
        module = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
        e = sharding.embed_lookup(self.embed[...], ahead, h.dtype)
        h, mtp_cache = module.decode(jnp.concatenate([e, h], axis=-1), pos, inv_freq, cache["mtp"],
                                     (jnp.int32(0),))
        return h, {**cache, "mtp": mtp_cache}


def moe_loss(cfg: ModelConfig, stats: dict) -> jax.Array:
    """The balancing terms added to the cross-entropy: sum over MoE layers of aux and z-loss with their coefficients."""
    if not stats:
        return jnp.zeros((), jnp.float32)
    m = cfg.moe
    return m.aux_loss_coef * jnp.sum(stats["aux_loss"]) + m.z_loss_coef * jnp.sum(stats["z_loss"])


def buffers_of(model: nnx.Module) -> dict:
    """Non-trainable state (the MoE router biases), as a nested dict; {} for a dense model."""
    return nnx.to_pure_dict(nnx.state(model, RouterBias))


def update_buffers(cfg: ModelConfig, buffers: dict, stats: dict) -> dict:
    """Auxiliary-loss-free balancing: nudge each MoE layer's router bias by the sign of its load error."""
    rate = cfg.moe.bias_update_rate
    if not buffers or rate == 0:
        return buffers
    blocks, load = buffers["blocks"], stats["load"]  # load (MoE layers, E): the model's, then the MTP modules'
    grouped = "moe_block" in blocks  # grouped layers
    bias = (blocks["moe_block"] if grouped else blocks)["moe"]["bias"]
    n = bias.shape[0]
    new = {"moe": {"bias": update_bias(bias, load[:n], rate)}}
    out = {**buffers, "blocks": {**blocks, "moe_block": new} if grouped else {**blocks, **new}}
    if "mtp" in buffers:
        out["mtp"] = {"block": {"moe": {"bias": update_bias(buffers["mtp"]["block"]["moe"]["bias"], load[n:], rate)}}}
    return out


def head_vocab_axes(cfg: ModelConfig, head_recipe: str, n_tokens: int, mesh_shape: dict[str, int] | None = None
                    ) -> tuple[str, ...]:
    """The mesh axes over which the model's head runs vocab-parallel for a microbatch of `n_tokens` tokens (a bf16
    head only; an fp8 head reads whole operands), as sharding.head_vocab_axes decides; () otherwise. The train
    state splits the head's V over them (`plan_for_run`, `param_axes`) and the forward decides the same way."""
    if head_recipe != "bf16":
        return ()
    return sharding.head_vocab_axes(n_tokens, cfg.vocab_size, cfg.d_model, jnp.dtype(cfg.grad_reduce_dtype).itemsize,
                                    mesh_shape)


def mtp_targets(targets: jax.Array, k: int) -> jax.Array:
    """targets (B,T) -> the k-th multi-token prediction module's: at position t the target of t + k (the token
    t + k + 1), -1 at the last k positions (Llama.__call__ with mtp=True)."""
    return jnp.concatenate([targets[:, k:], jnp.full_like(targets[:, :k], -1)], axis=1)


def cross_entropy(logits: jax.Array, targets: jax.Array, vocab_parallel: bool = False,
                  count: jax.Array | None = None) -> jax.Array:
    """Next-token cross-entropy in nats, float32: summed over the targets that count (id >= 0; -1 leaves a position
    out) and divided by `count`, by default targets.size (the mean, when every target counts). The train step passes
    the counted targets of the whole step, so microbatches add up to the step's mean. logits (B,T,V) any float
    dtype, targets (B,T) int.

    vocab_parallel: the logits are split on V (the head ran vocab-parallel, `head_vocab_axes`): each token's logit
    of its target is then picked by a masked sum, which the partitioner reduces across the split like logsumexp,
    where a gather would have it gather the logits."""
    count = jnp.asarray(targets.size if count is None else count, jnp.float32)
    return _cross_entropy(vocab_parallel, logits, targets, count)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cross_entropy(vocab_parallel, logits, targets, count):
    return _cross_entropy_fwd(vocab_parallel, logits, targets, count)[0]


def _cross_entropy_fwd(vocab_parallel, logits, targets, count):
    z = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(z, axis=-1)  # (B,T)
    if vocab_parallel:
        targets = sharding.constrain(targets, ("head_batch", "seq"))
        picked = jnp.sum(jnp.where(jnp.arange(z.shape[-1]) == targets[..., None], z, 0.0), axis=-1)
    else:
        picked = jnp.take_along_axis(z, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(targets >= 0, logz - picked, 0.0)) / count, (logits, targets, logz, count)


def _cross_entropy_bwd(vocab_parallel, res, g):
    logits, targets, logz, count = res
    p = jnp.exp(logits.astype(jnp.float32) - logz[..., None])  # softmax, recomputed from the saved logits
    onehot = jnp.arange(logits.shape[-1]) == targets[..., None]  # all False where the target is -1
    scale = jnp.where(targets >= 0, g / count, 0.0)[..., None]
    return ((p - onehot) * scale).astype(logits.dtype), None, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


# the matrices every GEMM reads
COMPUTE_CAST = frozenset((*ATTN_LINEARS, *MLA_LINEARS, *MLP_LINEARS, "head", "eh_proj"))


# The linears whose fp8 operands the train step makes at the update, by the parameter dict that holds them
# (Block.attn, Block.mlp, MoE.shared, the MTPLayer stack) and grouped as layers.fused_linear fuses them.
LINEAR_GROUPS = {"attn": (("wq", "wk", "wv"), ("wo",)), "mlp": (("w_gate", "w_up"), ("w_down",)),
                 "shared": (("w_gate", "w_up"), ("w_down",)), "mtp": (("eh_proj",),)}
# LatentAttention's (with or without a query latent, wq_a): x W_q (or x W_qa) and x W_kva are one GEMM
MLA_GROUPS = {False: (("wq", "wkv_a"), ("wkv_b",), ("wo",)), True: (("wq_a", "wkv_a"), ("wq_b",), ("wkv_b",), ("wo",))}


def plan_for_run(plan: LinearPlan, cfg: ModelConfig, micro_batch: int, seq_len: int,
                 mesh_shape: dict[str, int]) -> LinearPlan:
    """`plan` for a train step of `micro_batch` x `seq_len` tokens on a mesh of `mesh_shape`: with fp8 routed
    experts, their operands are made at the update when each device's experts get the rows that fp8 needs
    (dispatch.expert_recipe over the rows one device's MoE layer sees, as moe.MoE counts them); otherwise the
    experts keep bf16 copies and each trace decides. Likewise whether the head runs vocab-parallel
    (`head_vocab_axes`), which splits it on V in the train state (`param_axes`)."""
    vocab = bool(head_vocab_axes(cfg, plan.recipes["head"], micro_batch * seq_len, mesh_shape))
    plan = dataclasses.replace(plan, vocab_parallel=vocab)
    if not cfg.moe.n_experts or plan.recipes["experts"] == "bf16":
        return plan
    batch = math.prod(mesh_shape.get(a, 1) for a in sharding.batch_axes())
    rows = micro_batch // batch * (seq_len // mesh_shape.get("context", 1)) * cfg.moe.top_k
    n_local = cfg.moe.n_experts // mesh_shape.get("expert", 1)
    dims = (cfg.d_model, cfg.moe.d_expert or cfg.d_ff)
    fp8 = dispatch.expert_recipe(plan.recipes["experts"], rows, n_local, plan.expert_min_rows, dims) != "bf16"
    return dataclasses.replace(plan, prequantize_experts=fp8)


def _operand_groups(plan: LinearPlan | None, where: str) -> list[tuple[tuple[str, ...], str]]:
    """(weights, recipe) of the prequantized GEMMs in the parameter dict `where`: a fused group whose weights share
    an fp8 recipe in quant.PREQUANTIZED; with mixed recipes each weight on its own, as fused_linear runs them; the
    routed experts' three weights ("moe") each on its own when `plan.prequantize_experts`."""
    if plan is not None and where == "moe" and plan.prequantize_experts:
        return [((name,), plan.recipes["experts"]) for name in MLP_LINEARS]
    if plan is None or where not in LINEAR_GROUPS:
        return []
    prefix = "shared." if where == "shared" else ""
    groups = MLA_GROUPS["wq_a" in plan.recipes] if where == "attn" and "wkv_a" in plan.recipes else LINEAR_GROUPS[where]
    out = []
    for group in groups:
        recipes = [plan.recipes.get(prefix + name) for name in group]
        for names in [group] if len(set(recipes)) == 1 else [(name,) for name in group]:
            recipe = plan.recipes.get(prefix + names[0])
            if recipe in quant.PREQUANTIZED:
                out.append((names, recipe))
    return out


def compute_copies(cfg: ModelConfig, params: dict, plan: LinearPlan | None = None) -> dict:
    """What the GEMMs read in the train step, made from the masters by the step that updates them, as a nested dict:
    - for the linears `plan` gives an fp8 recipe (LINEAR_GROUPS): their fp8 operands (`quant.prequantize`), one
      `quant.Operands` per GEMM under the key "wq|wk|wv" (the weights of a fused GEMM joined by "|"); likewise the
      routed experts' w_gate, w_up and w_down (each a batch of E matrices) when `plan.prequantize_experts`;
    - every other linear weight (COMPUTE_CAST: dense, shared and routed experts, head) cast to the compute dtype.
    Without a plan only the casts ({} when the compute dtype is the parameters' own).

    The train state keeps these beside the float32 masters (train.py "compute"), the way Megatron-LM keeps bf16
    model weights beside its optimizer's f32 main weights. XLA fuses the casts into AdamW's update kernels: 2 bytes
    written per weight instead of a separate pass that reads 4 and writes 2 at the start of the next step. The fp8
    operands (2 bytes per weight too: the forward's and the grad-input GEMM's layouts) replace what each scanned
    layer did twice per step, in its forward and again in its rematerialized backward: concatenate the fused
    weights and cast them (benchmarks/RESULTS.md, session 26). The checkpoint stores only the masters; these are
    made again on restore (the same rounding of the same values).
    """
    cdt = jnp.dtype(cfg.compute_dtype)
    impl = plan.impl if plan is not None else "auto"

    def pick(tree: dict, where: str) -> dict:
        out = {}
        done = set()
        for names, recipe in _operand_groups(plan, where):
            out["|".join(names)] = quant.prequantize(tuple(tree[n] for n in names), recipe=recipe, impl=impl,
                                                     compute_dtype=cdt, batched=where == "moe")
            done.update(names)
        for k, v in tree.items():
            if isinstance(v, dict):
                sub = pick(v, k)
                if sub:
                    out[k] = sub
            elif k not in done and k in COMPUTE_CAST and jnp.issubdtype(v.dtype, jnp.floating) and v.dtype != cdt:
                out[k] = v.astype(cdt)
        return out

    return pick(params, "")


def with_compute(params: dict, copies: dict, compute_dtype=jnp.bfloat16) -> dict:
    """The parameters as the train step differentiates them: `params` with the leaves of `copies` in their place,
    and each prequantized weight (a member of an operands entry of `copies`) as a zero slot in `compute_dtype`.

    Only the GEMM weights come in the compute dtype; everything else stays as stored (the embedding table, whose
    rows are gathered and whose scatter-added gradient needs f32; norm scales; the router). The forward is
    unchanged (each GEMM cast its weight to the compute dtype anyway). The weight gradients come out in that dtype,
    rounded from the GEMM's f32 accumulator (where the tokens are split, each device's partial sum is summed across
    devices in model.grad_reduce_dtype first, quant._grad_w_dtype), as under TorchTitan's FSDP2 mixed precision
    (param_dtype=bf16), and the step upcasts them for the clipping norm and AdamW, which keep the float32 masters
    and moments. A bf16 gradient halves the bytes of its write, the norm's read and AdamW's read. A slot's values
    are never read (`with_operands` pairs it with its operands), so XLA never materializes the zeros.
    """
    slots = {n for k, v in copies.items() if isinstance(v, quant.Operands) for n in k.split("|")}
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out[k] = with_compute(v, copies[k], compute_dtype) if k in copies else v
        elif k in slots:
            out[k] = jnp.zeros(v.shape, compute_dtype)
        else:
            out[k] = copies.get(k, v)
    return out


def with_operands(params: dict, copies: dict) -> dict:
    """`params` (as `with_compute` makes them) with each prequantized weight wrapped as `quant.Prequantized`: its
    slot and, on the first weight of its group, the group's operands from `copies` (what the layers read)."""
    out = dict(params)
    for k, v in copies.items():
        if isinstance(v, dict):
            out[k] = with_operands(params[k], v)
        elif isinstance(v, quant.Operands):
            names = k.split("|")
            for i, n in enumerate(names):
                out[n] = quant.Prequantized(params[n], v if i == 0 else None)
    return out


def compute_axes(copies: dict, axes: dict) -> dict:
    """Logical axes of `copies`' leaves from the parameters' (`param_axes`): a cast copy keeps its weight's; an
    operand (w (..., K, N) -> out wᵀ (..., N, K), scale (..., N); grad_x w (..., K, N), scale (..., K); a
    tensorwise scale has only the layer axes) follows the first weight of its group."""
    out = {}
    for k, v in copies.items():
        if isinstance(v, dict):
            out[k] = compute_axes(v, axes[k])
        elif isinstance(v, quant.Operands):
            *lead, ak, an = axes[k.split("|")[0]]
            lead = tuple(lead)

            def scale(s, a):
                return (*lead, a) if s.ndim > len(lead) else lead

            out[k] = quant.Operands(out=((*lead, an, ak), scale(v.out[1], an)),
                                    grad_x=((*lead, ak, an), scale(v.grad_x[1], ak)))
        else:
            out[k] = axes[k]
    return out


def params_of(model: nnx.Module) -> dict:
    """The model's parameters as a nested dict of arrays (the train state's and the checkpoint's form)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def param_axes(model: nnx.Module, variables=nnx.Param, plan: LinearPlan | None = None) -> dict:
    """Nested dict of logical axis names per parameter; stacked layer parameters get leading 'layers' axes. With a
    run's `plan` (plan_for_run) that runs the head vocab-parallel, the head's V is "head_vocab"."""

    def axes(v: nnx.Variable) -> tuple[str, ...]:
        names = tuple(v.get_metadata().get("logical_axes", ()))
        if len(names) > v.ndim:
            raise ValueError(f"parameter of shape {v.shape} has logical axes {names}")
        return ("layers",) * (v.ndim - len(names)) + names  # one leading axis per level of layer stacking

    state = jax.tree.map(axes, nnx.state(model, variables), is_leaf=lambda x: isinstance(x, nnx.Variable))
    out = nnx.to_pure_dict(state)
    if plan is not None and plan.vocab_parallel and "head" in out:
        out["head"] = ("head_embed", "head_vocab")
    return out


def param_count(cfg: ModelConfig) -> int:
    """Exact parameter count from shapes alone (no allocation)."""
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters a token touches) + causal attention, 3 L T H (K + K_v).

    6N counts the forward (2N) and backward (4N) FLOPs (a multiply-add is 2) of every weight matrix except the
    embedding lookup; a MoE layer counts its router, its top-k routed experts and its shared experts (the active
    parameters); each multi-token prediction module (model.mtp) its block, W_eh and the head, and its attention as
    a layer's. Attention scores and values add 2 T H (K + K_v) per layer forward (K_v the value head dim: K, or
    model.mla.v_dim), halved by the causal mask, times 3 for fwd+bwd. PaLM's convention, which TorchTitan reports,
    counts the whole T x T scores (12 L T H K): this counts the causal half the kernels compute, so at long
    sequences its TFLOP/s and MFU read lower than TorchTitan's for the same tokens/s (compare tokens/s across stacks).
    """
    d, f = cfg.d_model, cfg.d_ff
    attn = sum(k * n for k, n in attention_shapes(cfg).values() if k * n)
    dense_ffn = 3 * d * f
    n_first, n_groups, per_group = layer_kinds(cfg)
    if cfg.moe.n_experts:
        m = cfg.moe
        fe = m.d_expert or f
        moe_ffn = d * m.n_experts + 3 * d * fe * (m.top_k + m.n_shared)
        n_moe = n_groups
        n_dense = cfg.n_layers - n_moe
    else:
        moe_ffn, n_moe, n_dense = 0, 0, cfg.n_layers
    matmul_params = cfg.n_layers * attn + n_dense * dense_ffn + n_moe * moe_ffn + d * cfg.vocab_size
    # each MTP module: W_eh, a block (MoE in a MoE model) and the head once more
    n_mtp = cfg.mtp.depth
    matmul_params += n_mtp * (2 * d * d + attn + (moe_ffn if cfg.moe.n_experts else dense_ffn) + d * cfg.vocab_size)
    return 6.0 * matmul_params + 3 * (cfg.n_layers + n_mtp) * seq_len * cfg.n_heads * (cfg.d_head + cfg.v_dim)
