"""Llama 3 building blocks (Flax NNX): RMSNorm, RoPE, grouped-query and latent attention, SwiGLU.

Dimension letters, used in every comment and einsum of the model:
    B batch, T sequence, D model width, H query heads, G key/value heads, K head dim, F feed-forward width,
    E experts, V vocabulary, L layers.

Parameters are float32 masters. The train step hands the GEMM weights in already cast to the compute dtype (the
state's bf16 copies, llama.with_compute) or, under an fp8 recipe, as `quant.Prequantized` (a gradient slot and the
fp8 operands made at the last update); any other weight is cast at the point of use. Every weight is a 2-D
(in, out) matrix that goes through `quant.linear`, which applies the model's low-precision recipe (bf16, fp8
rowwise/tensorwise, MX) to that linear.

RMSNorm:   y = x / sqrt(mean(x^2) + eps) * scale                       (Zhang & Sennrich 2019), in float32.
           Its backward is written out (a custom_vjp, `rms_norm`): with r = (mean(x^2) + eps)^-1/2, x_hat = x r,
           dx = r (dy scale - x_hat mean(dy scale x_hat)) and dscale = sum over tokens of dy x_hat. Under autodiff
           XLA laid the backward's activation gradients out D-major (the tokens minor), so every per-token sum was
           a column reduction at ~0.9 TB/s; with this backward they stay token-major and the 8B step's norm
           kernels take 0.6 ms less (benchmarks/RESULTS.md).
RoPE:      (x1, x2) -> (x1 cos(p w) - x2 sin(p w), x2 cos(p w) + x1 sin(p w)), w_i = theta^(-2i/K), with x1 and x2
           the two halves of the head dimension (the Hugging Face layout, so HF weights load unpermuted).
           Llama 3.1 scaling divides w_i by `factor` for wavelengths longer than original_max_len/low_freq_factor,
           keeps those shorter than original_max_len/high_freq_factor, and interpolates smoothly in between.
Attention: softmax(q k^T / sqrt(K) + causal mask) v with G key/value heads shared by H/G query heads each.
           model.qk_norm (Qwen3): each head's q and k go through RMSNorm over K (the `rms_norm` above, scales s_q and
           s_k of shape (K,) per layer) before RoPE. model.attention_bias (Qwen2): q, k, v = x W + b.
           cuDNN flash attention on GPU (the kernels of jax.nn.dot_product_attention(implementation="cudnn"),
           through context_parallel.cudnn_causal_attention, whose residuals remat policies can keep), XLA elsewhere.
           With a `context` mesh axis the sequence is split in load-balanced zigzag chunks; each shard all-gathers
           K and V and merges a causal diagonal block with a wholly visible prefix (mx_jax/context_parallel.py).
           model.attention_mask=documents: token t of a row attends to key u only if u <= t and both lie in the same
           document, d(t) = the number of end-of-text tokens before t (the token ending a document belongs to it),
           capped at max_documents - 1 (`document_segments`; under context parallelism per chunk, where each
           packed call runs one, context_parallel.py). cuDNN runs each row's documents as separate causal
           sequences (its packed layout, `compat.cudnn_attention_fwd`), per device under shard_map; XLA
           masks the T x T scores. RoPE keeps the row's positions: a score depends on u - t only, so a document
           attends within itself as it would alone. Under a `context` axis, context_parallel.py ("Documents").
           Decoding (`Attention.decode`, mx_jax/sample.py) writes the new tokens' keys and values into a KV cache
           and attends over the cache with a (B, T, S) mask of the positions each token sees (XLA).
           model.mla: multi-head latent attention (DeepSeek-V2/V3), `LatentAttention` (its docstring has the math).
SwiGLU:    y = (silu(x W_gate) * (x W_up)) W_down                     (Shazeer 2020).
           h = silu(g) u is a custom_vjp (`swiglu`) that keeps only g and u: with s = sigmoid(g),
           dg = dh u s (1 + g (1 - s)) and du = dh g s, in float32. Under autodiff each layer kept five (T, F)
           residuals (g, u, silu(g), sigmoid(g) and its derivative term); unrolled, XLA fused them away, but inside
           lax.scan with model.remat=none every one was written into the stacked residuals (8-layer 8B step on an
           H200: 5.3 GiB more and 2.9% slower, benchmarks/RESULTS.md).

Fused projections: q, k and v (and gate and up) are one GEMM, x [W_q | W_k | W_v], whose output is split. The
parameters stay separate (checkpoints and Hugging Face names are unchanged) and are concatenated inside the step,
one extra pass over those weights (an XLA concatenate fusion, ~0.4 ms per 8B layer on an H200). One
(T, D) x (D, (H+2G)K) GEMM replaces three, two of them only G K = 1024 wide, and the backward reads x once instead
of three times; on the 8B benchmark the fusions left the step time unchanged and saved 2.8 GiB together with the
bf16 logits (benchmarks/RESULTS.md). Under a quantized recipe, per-output-column weight scales (rowwise,
MX) are unchanged by the fusion; tensorwise shares one weight scale, and the gradient's rows share one scale,
across the fused outputs. Linears whose recipes differ (a kernel that cannot take one of the shapes) run unfused,
and so does decoding, where a step's cost is reading the weights and the concatenation would read them twice more.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from mx_jax import context_parallel, quant, sharding
from mx_jax.context_parallel import packed_layout  # noqa: F401  (cuDNN's description of a row's documents)
from mx_jax.config import ModelConfig, RopeScaling


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, axes: tuple[str, ...], dtype) -> nnx.Param:
    value = (std * jax.random.truncated_normal(rngs.params(), -3.0, 3.0, shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


def weight_and_operands(w: nnx.Param | jax.Array) -> tuple[jax.Array, quant.Operands | None]:
    """(the array a linear differentiates, its prequantized operands or None): a Param holds an array, or in the
    train step a `quant.Prequantized` whose operands were made at the last update (llama.with_operands)."""
    v = w.get_value() if isinstance(w, nnx.Variable) else w
    return (v.slot, v.operands) if isinstance(v, quant.Prequantized) else (v, None)


def logical_axes(w: nnx.Param | jax.Array) -> tuple[str, ...] | None:
    """A weight's own logical axes (sharding.RULES), or None for a plain array."""
    axes = w.get_metadata().get("logical_axes") if isinstance(w, nnx.Variable) else None
    return tuple(axes) if axes else None


def linear(x: jax.Array, w: nnx.Param, recipe: str, impl: str, reduce_dtype: str = "float32",
           fence: bool = False) -> jax.Array:
    """x (..., in) @ w (in, out) through the quantization recipe; the output is tagged for remat policies.
    reduce_dtype: model.grad_reduce_dtype, fence (quant.linear)."""
    axes = logical_axes(w)
    w, ops = weight_and_operands(w)
    y = quant.linear(x, w, recipe=recipe, impl=impl, operands=ops, w_axes=axes, reduce_dtype=reduce_dtype,
                     fence=fence)
    return checkpoint_name(y, "matmul")


def saved_output(y, scanned: bool):
    """A GEMM output (array or pytree) named "matmul" for remat policies (model.remat=save_matmuls keeps it).

    scanned (the layer runs inside lax.scan): the output first passes an optimization barrier. Inside a scan the
    saved output is written into the stacked residuals by a dynamic-update-slice; XLA:GPU (jax 0.11.2) fused the
    GEMM into that update and, for the output's other users, kept a second copy of the same GEMM: every gate|up GEMM
    ran twice. The barrier leaves XLA one GEMM to feed both (8-layer 8B, model.remat=save_matmuls, one H100:
    29,553 -> 32,551 tokens/s; the MoE experts' grouped GEMMs need it too, mx_jax/dispatch.py; benchmarks/
    RESULTS.md). Measured with save_matmuls only; with remat=none a scan stacks the same output, with remat=full it
    stacks nothing and the barrier changes nothing. Unrolled layers do not need it (it cost them 0.8%).
    """
    if scanned:
        y = jax.lax.optimization_barrier(y)
    return checkpoint_name(y, "matmul")


def fused_linear(x: jax.Array, ws: tuple[nnx.Param, ...], recipes: tuple[str, ...], impl: str,
                 scanned: bool = False, reduce_dtype: str = "float32", fused: bool = True) -> tuple[jax.Array, ...]:
    """(x @ w for w in ws) as one GEMM over the concatenated weights when they share a recipe (module docstring);
    its output goes through `saved_output`. fused=False: one GEMM per weight."""
    if len(set(recipes)) > 1 or not fused:
        return tuple(linear(x, w, r, impl, reduce_dtype) for w, r in zip(ws, recipes))
    parts = [weight_and_operands(w) for w in ws]
    # With prequantized operands (the first weight's, made from the concatenation) the weights are zero slots: their
    # concatenation is never materialized, and its gradient is split back by slicing.
    w = jnp.concatenate([p[0] for p in parts], axis=1)
    y = quant.linear(x, w, recipe=recipes[0], impl=impl, operands=parts[0][1], w_axes=logical_axes(ws[0]),
                     reduce_dtype=reduce_dtype)
    y = saved_output(y, scanned)
    bounds = [p[0].shape[1] for p in parts]
    return tuple(jnp.split(y, [sum(bounds[:i]) for i in range(1, len(bounds))], axis=-1))


@jax.custom_vjp
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """y = x / sqrt(mean(x^2) + eps) * scale over the last axis, computed in float32, returned in x's dtype."""
    return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # (..., 1)
    return (x32 * r * scale.astype(jnp.float32)).astype(x.dtype), (x, scale, r)


def _rms_norm_bwd(res, dy):
    # With x_hat = x r:  dx = r (dy w - x_hat mean(dy w x_hat)),  dscale = sum over tokens of dy x_hat.
    x, scale, r = res
    x_hat = x.astype(jnp.float32) * r
    dy32 = dy.astype(jnp.float32)
    dyw = dy32 * scale.astype(jnp.float32)
    dx = r * (dyw - x_hat * jnp.mean(dyw * x_hat, axis=-1, keepdims=True))
    # Summed over x's own leading dims: flattening (B, S) first, with S split over context and B > 1, made XLA
    # all-gather dy x_hat over the sequence (f32, the size of the activations) for every norm.
    dscale = jnp.sum(dy32 * x_hat, axis=tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), dscale.astype(scale.dtype), None


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """h = silu(gate) * up, elementwise; the backward recomputes sigmoid(gate) from the saved gate and up."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, dh):
    # With s = sigmoid(g):  dh/dg = u s (1 + g (1 - s)),  dh/du = g s.
    gate, up = res
    g, u, d = gate.astype(jnp.float32), up.astype(jnp.float32), dh.astype(jnp.float32)
    s = jax.nn.sigmoid(g)
    return (d * u * s * (1.0 + g * (1.0 - s))).astype(gate.dtype), (d * g * s).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float, param_dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((d,), param_dtype), logical_axes=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> jax.Array:
    """(K/2,) inverse frequencies w_i = theta^(-2i/K), scaled when scaling.factor s > 1:
    - llama3 (Meta's `apply_scaling`): wavelengths 2 pi / w_i beyond original_max_len / low_freq_factor divided by
      s, those below original_max_len / high_freq_factor kept, a smooth mix between;
    - yarn (YaRN, arXiv 2309.00071, as transformers computes it): frequency i kept (extrapolated) below the dimension
      d(beta_fast) and divided by s (interpolated) above d(beta_slow), mixed linearly between, where
      d(r) = K ln(L / (2 pi r)) / (2 ln theta) is the dimension that turns r times over the original context L
      (floor and ceil, clipped to [0, K - 1]); q and k are then scaled by `rope_attention_factor`."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling.factor <= 1.0:
        return inv
    if scaling.kind == "yarn":
        def dim_of(rotations: float) -> float:
            return head_dim * math.log(scaling.original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(dim_of(scaling.beta_fast)), 0)
        high = min(math.ceil(dim_of(scaling.beta_slow)), head_dim - 1)
        high = high + 0.001 if high == low else high
        ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        return inv / scaling.factor * ramp + inv * (1 - ramp)
    wavelen = 2 * math.pi / inv
    low_wavelen = scaling.original_max_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_len / scaling.high_freq_factor
    scaled = jnp.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_attention_factor(scaling: RopeScaling) -> float:
    """YaRN's scale of q and k after RoPE (of cos and sin, in transformers): attention_factor, else 0.1 ln(s) + 1;
    1 for llama3 or no scaling. mx_jax multiplies q by its square, the same logits."""
    if scaling.kind != "yarn" or scaling.factor <= 1.0:
        return 1.0
    return scaling.attention_factor or 0.1 * math.log(scaling.factor) + 1.0


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x (B,T,N,K), positions (T,) or, each row its own, (B,T) -> x rotated, half-split layout."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (T, K/2) or (B, T, K/2)
    angles = angles if angles.ndim == 3 else angles[None]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention_impl(requested: str, dtype, head_dim: int, platform: str | None = None) -> str:
    """cuDNN flash attention on GPU for bf16/fp16 with a head dim it takes (<= 256, multiple of 8), else XLA.
    `platform`: the backend to decide for (default: jax's default backend)."""
    if requested != "auto":
        return requested
    ok = ((platform or jax.default_backend()) == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
          and head_dim <= 256 and head_dim % 8 == 0)
    return "cudnn" if ok else "xla"


class Positions(NamedTuple):
    """Where each token sits: RoPE positions (T,) and, under model.attention_mask=documents, the document of each
    token within its row (B, T) int32 (`document_segments`; None: the row is one causal sequence). Decoding with a
    KV cache (`Attention.decode`), `visible` (B, T, S) bool says which of the cache's S positions each token sees,
    and the positions may be each row's own, (B, T) (speculative decoding, whose rows advance apart)."""

    rope: jax.Array
    segments: jax.Array | None = None
    visible: jax.Array | None = None


class KVCache(NamedTuple):
    """Keys and values (..., B, S, G, K) at the S positions a decode can reach (mx_jax/sample.py), with leading
    layer axes like the model's stacks (llama.init_cache)."""

    k: jax.Array
    v: jax.Array


class LatentCache(NamedTuple):
    """Latent attention's decode cache (LatentAttention.decode), laid out as KVCache with one head: the normalized
    key-value latent (..., B, S, 1, kv_rank) and the rotated key (..., B, S, 1, rope_dim), what every head's key
    and value are made from."""

    c: jax.Array
    k_rope: jax.Array


def cache_write_read(cache, new: tuple[jax.Array, ...], at: jax.Array, layer: tuple[jax.Array, ...], dtype):
    """Write `new` (B,T,...) into the stacked cache's arrays at `layer` (its leading indices) and position `at` (a
    scalar, or each row's (B,)), in place; return (the cache, this layer's whole arrays (B,S,...) in `dtype`)."""
    n = len(layer)
    if jnp.ndim(at):  # row b's T tokens at at[b] ..
        b, t = new[0].shape[:2]
        rows, cols = jnp.arange(b)[:, None], at[:, None] + jnp.arange(t)
        cache = type(cache)(*(c.at[(*layer, rows, cols)].set(x.astype(c.dtype)) for c, x in zip(cache, new)))
    else:
        cache = type(cache)(*(jax.lax.dynamic_update_slice(c, x.astype(c.dtype).reshape((1,) * n + x.shape),
                                                           (*layer, 0, at) + (0,) * (x.ndim - 2))
                              for c, x in zip(cache, new)))
    return cache, tuple(jax.lax.dynamic_slice(c, (*layer,) + (0,) * (c.ndim - n), (1,) * n + c.shape[n:])
                        .reshape(c.shape[n:]).astype(dtype) for c in cache)


def document_segments(tokens: jax.Array, eos_id: int, max_documents: int) -> jax.Array:
    """tokens (B,T) -> (B,T) int32: the number of `eos_id` tokens before each position (a document's end-of-text
    token belongs to it), capped at max_documents - 1: the later documents of a row share the last segment."""
    ends = (tokens == eos_id).astype(jnp.int32)
    return jnp.minimum(jnp.cumsum(ends, axis=1) - ends, max_documents - 1)


def document_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, impl: str,
                       max_documents: int) -> jax.Array:
    """Causal attention within each document of a row (q (B,T,H,K), k and v (B,T,G,K), segments (B,T)); under a
    `context` mesh axis in zigzag order, as `causal_attention`."""
    if context_shards() > 1:
        return causal_attention(q, k, v, impl, segments, max_documents)
    if impl != "cudnn":
        t = q.shape[1]
        mask = (segments[:, :, None] == segments[:, None, :]) & jnp.tril(jnp.ones((t, t), bool))
        o = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation=impl)
        return checkpoint_name(o, "attention")

    def local(q, k, v, segments):
        return context_parallel.cudnn_document_attention(q, k, v, *packed_layout(segments, max_documents))

    mesh = jax.sharding.get_abstract_mesh()
    batch = tuple(a for a in sharding.batch_axes() if not mesh.empty and mesh.shape.get(a, 1) > 1)
    if not batch:
        return local(q, k, v, segments)
    spec = P(batch, None, None, None)  # each device describes and attends its own rows
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(batch, None)), out_specs=spec,
                         check_vma=False)(q, k, v, segments)


def context_shards() -> int:
    """Size of the current mesh's `context` axis (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.shape.get("context", 1)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, impl: str, segments: jax.Array | None = None,
                     max_documents: int = 0) -> jax.Array:
    """q (B,T,H,K), k and v (B,T,G,K) -> (B,T,H,K). Under a `context` mesh axis the sequence must be in
    `context_parallel.to_zigzag` order (Llama.__call__ puts it there); exact either way.

    The output is named "attention" (kept by model.remat=save_matmuls) exactly once: the cuDNN and context-parallel
    paths name it inside their custom_vjp, with the softmax statistics. A second name outside made jax list a
    second residual of the same values: a second stacked output of a scanned stack's forward loop (whether XLA's
    GPU buffer assignment merged the two is not yet measured), and memory_estimate, which reads jax's list, counted
    both."""
    if context_shards() == 1:
        if impl == "cudnn":
            return context_parallel.cudnn_causal_attention(q, k, v)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        return checkpoint_name(o, "attention")
    mesh = jax.sharding.get_abstract_mesh()
    batch = tuple(a for a in sharding.batch_axes() if mesh.shape.get(a, 1) > 1) or None
    spec = P(batch, "context", None, None)
    local = functools.partial(context_parallel.context_attention, impl=impl, axis="context",
                              max_documents=max_documents)
    if segments is None:
        return jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                             check_vma=False)(q, k, v)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (P(batch, "context"),), out_specs=spec,
                         check_vma=False)(q, k, v, segments)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, recipes: dict[str, str], impl: str, *, rngs: nnx.Rngs):
        d, h, g, k = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        pd = jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.wq = _param(rngs, (d, h * k), cfg.init_std, ("embed", "q_heads"), pd)
        self.wk = _param(rngs, (d, g * k), cfg.init_std, ("embed", "kv_heads"), pd)
        self.wv = _param(rngs, (d, g * k), cfg.init_std, ("embed", "kv_heads"), pd)
        self.wo = _param(rngs, (h * k, d), out_std, ("q_heads", "embed"), pd)
        self.n_heads, self.n_kv_heads, self.head_dim = h, g, k
        self.recipes, self.impl, self.scanned, self.reduce = recipes, impl, cfg.scan_layers, cfg.grad_reduce_dtype
        self.attention = attention_impl(cfg.attention, cfg.compute_dtype, k)
        self.max_documents = cfg.max_documents
        self.q_scale = rope_attention_factor(cfg.rope_scaling) ** 2  # YaRN's, on q alone: the same q k^T
        if cfg.qk_norm:  # per-head RMSNorm of q and k before RoPE (config.ModelConfig.qk_norm)
            self.q_norm, self.k_norm = RMSNorm(k, cfg.norm_eps, pd), RMSNorm(k, cfg.norm_eps, pd)
        if cfg.attention_bias:  # added to the projections' outputs (config.ModelConfig.attention_bias); start at 0
            self.bq = nnx.Param(jnp.zeros((h * k,), pd), logical_axes=("q_heads",))
            self.bk = nnx.Param(jnp.zeros((g * k,), pd), logical_axes=("kv_heads",))
            self.bv = nnx.Param(jnp.zeros((g * k,), pd), logical_axes=("kv_heads",))

    def _qkv(self, x: jax.Array, pos: Positions, inv_freq: jax.Array,
             fused: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x (B,T,D) -> q (B,T,H,K) and k, v (B,T,G,K), q and k rotated to their positions; `fused`: one GEMM
        over the concatenated weights (module docstring), else one per weight (`decode`: no concatenation)."""
        b, t, _ = x.shape
        r = self.recipes
        q, k, v = fused_linear(x, (self.wq, self.wk, self.wv), (r["wq"], r["wk"], r["wv"]), self.impl, self.scanned,
                               self.reduce, fused)
        if hasattr(self, "bq"):  # in the activations' dtype, as the GEMM's output
            q, k, v = (y + b[...].astype(y.dtype) for y, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, pos.rope, inv_freq)
        if self.q_scale != 1.0:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        return q, apply_rope(k, pos.rope, inv_freq), v

    def _out(self, o: jax.Array) -> jax.Array:
        b, t = o.shape[:2]
        return linear(o.reshape(b, t, self.n_heads * self.head_dim), self.wo, self.recipes["wo"], self.impl,
                      self.reduce)

    def __call__(self, x: jax.Array, pos: Positions, inv_freq: jax.Array) -> jax.Array:
        q, k, v = self._qkv(x, pos, inv_freq)
        return self._out(attend_heads(q, k, v, pos.segments, self.attention, self.max_documents))

    def decode(self, x: jax.Array, pos: Positions, inv_freq: jax.Array, cache: KVCache,
               layer: tuple[jax.Array, ...]) -> tuple[jax.Array, KVCache]:
        """T new tokens at the consecutive cache positions pos.rope: their keys and values are written into the
        stacked cache at `layer` (its leading indices), in place, then each token attends to the cached positions
        pos.visible lets it see. XLA's attention: the queries are few, the cost is reading the cache. The
        projections run one GEMM per weight: a step reads each weight once, where concatenating them would write
        and read them again (a token of the 8B on an H200: 9.6 ms fused, 5.9 unfused; benchmarks/RESULTS.md,
        session 63)."""
        q, k, v = self._qkv(x, pos, inv_freq, fused=False)
        cache, (k, v) = cache_write_read(cache, (k, v), pos.rope[..., 0], layer, q.dtype)
        o = attend_padded(functools.partial(jax.nn.dot_product_attention, mask=pos.visible[:, None],
                                            implementation="xla"), q, k, v)
        return self._out(o), cache


def attend_heads(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, impl: str,
                 max_documents: int) -> jax.Array:
    """q (B,T,H,K), k (B,T,G,K), v (B,T,G,K_v) -> (B,T,H,K_v): causal, or within documents where `segments` (B,T)
    are given and max_documents > 1. A value head dim K_v != K (latent attention) goes to cuDNN's causal kernels as
    it is (cuDNN >= 9.10 on Hopper: 2.96 ms fwd+bwd for DeepSeek-V2-Lite's 16 heads of 192 / 128 at 4 x 4096 tokens
    against 4.31 padded, one H200, benchmarks/RESULTS.md session 71) where both K and K_v are multiples of 8, and is
    zero-padded to the larger everywhere else (`attend_padded`): XLA's and the context-parallel paths take one head
    dim, cuDNN refuses a head dim that is not a multiple of 8 (`attention_impl` checks only the larger, the padded
    one; "hidden_dim should be multiple of 8" for K = 192, K_v = 100 on an H200), and cuDNN 9.19's packed-layout
    backward (documents) with K_v != K failed with a misaligned address on an H200."""
    if segments is None or max_documents == 1:  # one segment: the row is one causal sequence
        attend = functools.partial(causal_attention, impl=impl)
        if impl == "cudnn" and context_shards() == 1 and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0:
            return attend(q, k, v)
    else:
        attend = functools.partial(document_attention, segments=segments, impl=impl, max_documents=max_documents)
    return attend_padded(attend, q, k, v)


def attend_padded(attend, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """attend(q, k, v) (an attention of one head dim for q, k and v) where v's head dim differs from q's and k's K:
    all three are zero-padded to the larger, q scaled by sqrt(padded / K) so that the softmax keeps 1/sqrt(K), and
    the output cut back to v's dim. A zero query or key dim adds nothing to q k^T, a zero value dim only zero
    outputs."""
    kq, kv = q.shape[-1], v.shape[-1]
    if kq == kv:
        return attend(q, k, v)
    width = max(kq, kv)

    def pad(x):
        return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - x.shape[-1]),))

    if width > kq:
        q = q * jnp.asarray(math.sqrt(width / kq), q.dtype)
    return attend(pad(q), pad(k), pad(v))[..., :kv]


class LatentAttention(Attention):
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434; V3). With c the key-value latent (model.mla
    kv_rank wide), n, r, v the per-head dims nope_dim, rope_dim, v_dim, and H heads:

        [c | k_r] = x W_kva                       c (T, kv_rank), k_r (T, r): one rotated key for all heads
        [k_n,h | v_h] = RMSNorm(c) W_kvb          per head h: k_n,h (T, n), v_h (T, v)
        [q_n,h | q_r,h] = x W_q                   or RMSNorm(x W_qa) W_qb with a query latent (model.mla.q_rank)
        q_h = [q_n,h | RoPE(q_r,h)],  k_h = [k_n,h | RoPE(k_r)]
        o = concat_h softmax(q_h k_h^T s + causal mask) v_h,  out = o W_o

    with s = m^2 / sqrt(n + r): m = 0.1 mscale_all_dim ln(factor) + 1 under YaRN (model.rope_scaling), else 1;
    YaRN's attention factor a multiplies the rotated parts of q and k (transformers scales cos and sin), here q_r
    by a^2. x W_q (or x W_qa) and x W_kva are one GEMM over the concatenated weights, as `fused_linear` fuses q, k,
    v. Attention itself runs as grouped-query attention with G = H (`attend_heads`: cuDNN's causal kernels take v's
    own dims; elsewhere v is zero-padded to n + r). Decoding caches the latent c and k_r, not the heads' keys and
    values (`decode`). The two latent norms take eps LATENT_NORM_EPS whatever model.norm_eps, as DeepSeek's code (and transformers') builds them.
    """

    LATENT_NORM_EPS = 1e-6

    def __init__(self, cfg: ModelConfig, recipes: dict[str, str], impl: str, *, rngs: nnx.Rngs):
        a = cfg.mla
        d, h, pd = cfg.d_model, cfg.n_heads, jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        kq = a.nope_dim + a.rope_dim
        if a.q_rank:
            self.wq_a = _param(rngs, (d, a.q_rank), cfg.init_std, ("embed", "latent"), pd)
            self.q_a_norm = RMSNorm(a.q_rank, self.LATENT_NORM_EPS, pd)
            self.wq_b = _param(rngs, (a.q_rank, h * kq), cfg.init_std, ("latent_in", "q_heads"), pd)
        else:
            self.wq = _param(rngs, (d, h * kq), cfg.init_std, ("embed", "q_heads"), pd)
        self.wkv_a = _param(rngs, (d, a.kv_rank + a.rope_dim), cfg.init_std, ("embed", "latent"), pd)
        self.kv_norm = RMSNorm(a.kv_rank, self.LATENT_NORM_EPS, pd)
        self.wkv_b = _param(rngs, (a.kv_rank, h * (a.nope_dim + a.v_dim)), cfg.init_std, ("latent_in", "q_heads"),
                            pd)
        self.wo = _param(rngs, (h * a.v_dim, d), out_std, ("q_heads", "embed"), pd)
        self.n_heads, self.n_kv_heads, self.head_dim, self.mla = h, h, kq, a
        self.recipes, self.impl, self.scanned, self.reduce = recipes, impl, cfg.scan_layers, cfg.grad_reduce_dtype
        self.attention = attention_impl(cfg.attention, cfg.compute_dtype, cfg.attention_dim)
        self.max_documents = cfg.max_documents
        rs = cfg.rope_scaling
        self.rope_scale = rope_attention_factor(rs) ** 2
        m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0 if rs.kind == "yarn" and rs.factor > 1 else 1.0
        self.q_scale = m * m

    def _latent(self, x: jax.Array, pos: Positions, inv_freq: jax.Array,
                fused: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x (B,T,D) -> (q (B,T,H,n+r) rotated and scaled, the normalized latent c (B,T,kv_rank), the rotated key
        k_r (B,T,1,r))."""
        b, t, _ = x.shape
        a, r, h = self.mla, self.recipes, self.n_heads
        first = "wq_a" if a.q_rank else "wq"
        q, kv = fused_linear(x, (getattr(self, first), self.wkv_a), (r[first], r["wkv_a"]), self.impl, self.scanned,
                             self.reduce, fused)
        if a.q_rank:
            q = linear(self.q_a_norm(q), self.wq_b, r["wq_b"], self.impl, self.reduce)
        c, k_rope = jnp.split(kv, [a.kv_rank], axis=-1)
        q_nope, q_rope = jnp.split(q.reshape(b, t, h, self.head_dim), [a.nope_dim], axis=-1)
        q_rope = apply_rope(q_rope, pos.rope, inv_freq)
        if self.rope_scale != 1.0:
            q_rope = q_rope * jnp.asarray(self.rope_scale, q_rope.dtype)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        if self.q_scale != 1.0:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        return q, self.kv_norm(c), apply_rope(k_rope[:, :, None, :], pos.rope, inv_freq)

    def _expand(self, c: jax.Array, k_rope: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The latent c (B,S,kv_rank) and rotated key (B,S,1,r) -> every head's k (B,S,H,n+r) and v (B,S,H,v)."""
        b, s, _ = c.shape
        a, h = self.mla, self.n_heads
        kv = linear(c, self.wkv_b, self.recipes["wkv_b"], self.impl, self.reduce)
        k_nope, v = jnp.split(kv.reshape(b, s, h, a.nope_dim + a.v_dim), [a.nope_dim], axis=-1)
        return jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (b, s, h, a.rope_dim))], axis=-1), v

    def _qkv(self, x: jax.Array, pos: Positions, inv_freq: jax.Array,
             fused: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x (B,T,D) -> q, k (B,T,H,n+r) and v (B,T,H,v) (class docstring)."""
        q, c, k_rope = self._latent(x, pos, inv_freq, fused)
        return (q, *self._expand(c, k_rope))

    def decode(self, x: jax.Array, pos: Positions, inv_freq: jax.Array, cache: LatentCache,
               layer: tuple[jax.Array, ...]) -> tuple[jax.Array, LatentCache]:
        """`Attention.decode` over a cache of the latents (`LatentCache`, kv_rank + r values per position and layer
        where the heads' keys and values would take H (n + r + v): 1,152 bytes against 10,240 per token and layer
        for DeepSeek-V2-Lite in bf16). One new token a row (T = 1) attends in the latent, the paper's absorbed
        form: with W_kvb's columns of head h split into W_k,h (kv_rank, n) and W_v,h (kv_rank, v),
            q_n,h k_n,h(s)^T = (q_n,h W_k,h^T) c(s)^T,      o_h = sum_s p_h(s) v_h(s) = (sum_s p_h(s) c(s)) W_v,h,
        so a step reads each cached position's c and k_r once for all heads and expands nothing. Several tokens
        (a prompt's prefill, mx_jax.choices' continuations) expand the cached latents into keys and values and
        attend as `Attention.decode`: there the absorbed scores' kv_rank + r dims per query would cost
        (2 kv_rank + r) / (n + r + v) times the expanded form's FLOPs (3.4x at DeepSeek's dims)."""
        q, c, k_rope = self._latent(x, pos, inv_freq, fused=False)
        cache, (c, k_rope) = cache_write_read(cache, (c[:, :, None, :], k_rope), pos.rope[..., 0], layer, q.dtype)
        c = c[:, :, 0, :]  # (B,S,kv_rank)
        if x.shape[1] > 1:
            k, v = self._expand(c, k_rope)
            o = attend_padded(functools.partial(jax.nn.dot_product_attention, mask=pos.visible[:, None],
                                                implementation="xla"), q, k, v)
            return self._out(o), cache
        a, h = self.mla, self.n_heads
        w = weight_and_operands(self.wkv_b)[0].astype(q.dtype).reshape(a.kv_rank, h, a.nope_dim + a.v_dim)
        q_nope, q_rope = jnp.split(q, [a.nope_dim], axis=-1)
        q_latent = jnp.einsum("bthn,chn->bthc", q_nope, w[..., :a.nope_dim])
        scores = (jnp.einsum("bthc,bsc->bhts", q_latent, c, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope[:, :, 0, :], preferred_element_type=jnp.float32))
        scores = jnp.where(pos.visible[:, None], scores / math.sqrt(self.head_dim), -jnp.inf)
        p = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        o = jnp.einsum("bthc,chv->bthv", jnp.einsum("bhts,bsc->bthc", p, c), w[..., a.nope_dim:])
        return self._out(o), cache

    def _out(self, o: jax.Array) -> jax.Array:
        b, t = o.shape[:2]
        return linear(o.reshape(b, t, self.n_heads * self.mla.v_dim), self.wo, self.recipes["wo"], self.impl,
                      self.reduce)


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, d_ff: int, recipes: dict[str, str], impl: str, *, rngs: nnx.Rngs):
        d, pd = cfg.d_model, jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.w_gate = _param(rngs, (d, d_ff), cfg.init_std, ("embed", "mlp"), pd)
        self.w_up = _param(rngs, (d, d_ff), cfg.init_std, ("embed", "mlp"), pd)
        self.w_down = _param(rngs, (d_ff, d), out_std, ("mlp", "embed"), pd)
        self.recipes, self.impl, self.scanned, self.reduce = recipes, impl, cfg.scan_layers, cfg.grad_reduce_dtype

    def __call__(self, x: jax.Array, fused: bool = True) -> jax.Array:
        """fused: gate and up as one GEMM over their concatenated weights (module docstring); False when decoding."""
        r = self.recipes
        gate, up = fused_linear(x, (self.w_gate, self.w_up), (r["w_gate"], r["w_up"]), self.impl, self.scanned,
                                self.reduce, fused)
        return linear(swiglu(gate, up), self.w_down, r["w_down"], self.impl, self.reduce)
