"""Llama 3 (dense) and its sparse-MoE variants, in Flax NNX. Reads top to bottom: recipes, block, model, loss.

    tokens (B,T) -> embed (V,D) -> L x [x + Attn(RMSNorm(x)); x + FFN(RMSNorm(x))] -> RMSNorm -> head (D,V)

The L blocks are one stacked set of parameters with a leading layer axis, run by `jax.lax.scan`: compile time
stays flat in L (an 80-layer 70B compiles like a 1-layer one) and the step runs as fast as an unrolled loop on one
device (see benchmarks/RESULTS.md). Rematerialization wraps the scanned block: "full" recomputes everything in the
backward pass, "save_matmuls" keeps the outputs of every linear and of attention (tagged with checkpoint_name in
layers.py) and recomputes only the cheap elementwise work.

The output head is untied from the embedding, as in Llama 3. Logits are computed with float32 accumulation and
the loss is the mean token cross-entropy in nats.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mx_jax import quant, sharding
from mx_jax.config import ModelConfig, QuantConfig
from mx_jax.layers import Attention, RMSNorm, SwiGLU, _param, linear, rope_inv_freq

ATTN_LINEARS = ("wq", "wk", "wv", "wo")
MLP_LINEARS = ("w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """The recipe chosen for each linear, and why any linear stayed in bf16."""

    recipes: dict[str, str]
    notes: tuple[str, ...]


def plan_linears(cfg: ModelConfig, qcfg: QuantConfig) -> LinearPlan:
    """Pick each linear's recipe from quant.modules; linears the kernels cannot take stay bf16, with a note."""
    d, f, hk, gk = cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    shapes = {"wq": (d, hk), "wk": (d, gk), "wv": (d, gk), "wo": (hk, d),
              "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d), "head": (d, cfg.vocab_size)}
    kinds = {**{n: "attn" for n in ATTN_LINEARS}, **{n: "mlp" for n in MLP_LINEARS}, "head": "head"}
    recipes, notes = {}, []
    for name, (k, n) in shapes.items():
        recipe = qcfg.recipe if kinds[name] in qcfg.modules else "bf16"
        if recipe != "bf16":
            reason = quant.kernel_support(recipe, k, n)
            if reason:
                notes.append(f"{name} ({k}x{n}) stays bf16: {reason}")
                recipe = "bf16"
        recipes[name] = recipe
    return LinearPlan(recipes, tuple(notes))


class Block(nnx.Module):
    """x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)). x (B,T,D)."""

    def __init__(self, cfg: ModelConfig, plan: LinearPlan, impl: str, *, rngs: nnx.Rngs):
        pd = jnp.dtype(cfg.param_dtype)
        r = plan.recipes
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.attn = Attention(cfg, {n: r[n] for n in ATTN_LINEARS}, impl, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.mlp = SwiGLU(cfg, cfg.d_ff, {n: r[n] for n in MLP_LINEARS}, impl, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, inv_freq)
        x = x + self.mlp(self.mlp_norm(x))
        return sharding.constrain(x, ("batch", "seq", "act_embed"))


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_matmuls": jax.checkpoint_policies.save_only_these_names("matmul", "attention"),
}


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, qcfg: QuantConfig = QuantConfig(), *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.plan = plan_linears(cfg, qcfg)
        pd = jnp.dtype(cfg.param_dtype)
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, ("vocab", "embed"), pd)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.n_layers)
        def make_blocks(r: nnx.Rngs) -> Block:
            return Block(cfg, self.plan, qcfg.impl, rngs=r)

        self.blocks = make_blocks(rngs)  # every parameter has a leading (L,) axis
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
        self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, ("embed", "vocab"), pd)
        self.head_recipe, self.quant_impl = self.plan.recipes["head"], qcfg.impl

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens (B,T) int32 -> logits (B,T,V) float32."""
        cfg = self.cfg
        cdt = jnp.dtype(cfg.compute_dtype)
        x = jnp.take(self.embed[...].astype(cdt), tokens, axis=0)  # (B,T,D)
        x = sharding.constrain(x, ("batch", "seq", "act_embed"))
        positions = jnp.arange(tokens.shape[1])
        inv_freq = rope_inv_freq(cfg.d_head, cfg.rope_theta, cfg.rope_scaling)

        graphdef, stacked = nnx.split(self.blocks)

        def body(x, layer_params):
            return nnx.merge(graphdef, layer_params)(x, positions, inv_freq), None

        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
        x, _ = jax.lax.scan(body, x, stacked)
        x = self.final_norm(x)
        logits = linear(x, self.head, self.head_recipe, self.quant_impl)
        return logits.astype(jnp.float32)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats. logits (B,T,V) f32, targets (B,T) int."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def params_of(model: nnx.Module) -> dict:
    """The model's parameters as a nested dict of arrays (the train state's and the checkpoint's form)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def param_axes(model: nnx.Module) -> dict:
    """Nested dict of logical axis names per parameter; stacked layer parameters get a leading 'layers' axis."""

    def axes(v: nnx.Variable) -> tuple[str, ...]:
        names = tuple(v.get_metadata().get("logical_axes", ()))
        if len(names) == v.ndim - 1:
            names = ("layers",) + names
        if len(names) != v.ndim:
            raise ValueError(f"parameter of shape {v.shape} has logical axes {names}")
        return names

    state = jax.tree.map(axes, nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(state)


def param_count(cfg: ModelConfig) -> int:
    """Exact parameter count from shapes alone (no allocation)."""
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters) + causal attention, 6 L T D' (fwd + bwd).

    6N counts the forward (2N) and backward (4N) multiply-adds of every weight matrix except the embedding lookup;
    attention scores and values add 4 T K H per layer forward, halved by the causal mask, times 3 for fwd+bwd.
    This is the PaLM/Chinchilla convention with the causal half, as TorchTitan reports it.
    """
    d, f, hk, gk = cfg.d_model, cfg.d_ff, cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    per_layer = d * hk * 2 + d * gk * 2 + 3 * d * f
    matmul_params = cfg.n_layers * per_layer + d * cfg.vocab_size
    attn = 6 * cfg.n_layers * seq_len * hk  # 3 (fwd+bwd) x 4 T HK / 2 (causal)
    return 6.0 * matmul_params + attn
