"""AdamW with linear warmup and a cosine or WSD decay, global-norm clipping, no weight decay on norms and embeddings.

    lr(s) = lr_peak * (1 + (warmup - 1) * s / warmup) / warmup      for s < warmup (step 0 already learns)
    cosine (optim.schedule=cosine, the default):
          = lr_peak * (r + (1 - r) * (1 + cos(pi * p)) / 2)         p = (s - warmup) / (decay - warmup), clipped
    warmup-stable-decay (optim.schedule=wsd):
          = lr_peak                                                 for warmup <= s < c
          = lr_peak * (r + (1 - r) * (1 - sqrt(q)))                 q = (s - c) / (decay - c), clipped
            with c = max(warmup, decay - round(cooldown_fraction * decay)) where the cooldown starts
    with r = lr_final_ratio and decay = optim.decay_steps or the run's steps. Updates: g <- g * min(1, m / ||g||_2)
    with m = grad_clip_norm; AdamW(b1, b2, eps, wd) (Loshchilov & Hutter).

WSD keeps the peak until a short cooldown at the end (the "1 - sqrt" shape, which Hagele et al. 2024, "Scaling Laws
and Compute-Optimal Training Beyond Fixed Training Durations", found to match or beat cosine). Its learning rate
before the cooldown does not depend on the run's length, so a run resumed with more `steps` from a checkpoint taken
before its cooldown continues exactly as if it had been planned that long; a cosine run's schedule stretches.

AdamW's moments (optim.moment_dtype). Per step, for gradient g, in float32 whatever the storage:
    m' = b1 m + (1 - b1) g,   v' = b2 v + (1 - b2) g^2,   u = (m' / (1 - b1^t)) / (sqrt(v' / (1 - b2^t)) + eps)
The step uses m' and v' unrounded; they are stored rounded to the moment dtype (round to nearest even). bfloat16
moments (DeepSeek-V3 trained with them, with b2 = 0.95) hold 2 + 2 bytes per parameter instead of 4 + 4. The
update reads the f32 master, its f32 gradient and both moments and writes the master and both moments: 20 bytes
per parameter instead of 28, besides the compute copies it writes (llama.compute_copies). It is memory-bound, so
the bytes are its time, and with one device's tokens few against its parameters it is a large share of the step
(a quarter of the 2-layer Mixtral step on one GPU, benchmarks/RESULTS.md). Round to nearest stops a moment from
decaying once 1 - b falls under half of bf16's spacing (up to 2^-8 of the value): config.py refuses b1, b2 above
1 - 2^-8 with bf16 moments. float32 moments are optax.adamw's arithmetic exactly.

Weight decay applies to matrices that multiply activations (attention, MLP, expert and head weights); the embedding
table, norm scales and biases are excluded, as in GPT-2/Llama practice. Gradient accumulation happens in the train
step (a scan over microbatches summing gradients), so the optimizer sees one averaged gradient per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from mx_jax.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    decay = cfg.decay_steps or total_steps
    warmup = min(cfg.warmup_steps, decay)
    if cfg.schedule == "wsd":
        peak, r = cfg.lr_peak, cfg.lr_final_ratio
        start = max(warmup, decay - round(cfg.cooldown_fraction * decay))

        def wsd(step):
            s = jnp.asarray(step, jnp.float32)
            q = jnp.clip((s - start) / max(decay - start, 1), 0.0, 1.0)
            after = peak * (r + (1 - r) * (1 - jnp.sqrt(q)))
            return jnp.where(s < warmup, peak * (1 + (warmup - 1) * s / max(warmup, 1)) / max(warmup, 1), after)

        return wsd
    return optax.warmup_cosine_decay_schedule(
        init_value=cfg.lr_peak / warmup if warmup else cfg.lr_peak, peak_value=cfg.lr_peak, warmup_steps=warmup,
        decay_steps=max(decay, warmup + 1),
        end_value=cfg.lr_peak * cfg.lr_final_ratio)


ATTENTION_BIASES = ("bq", "bk", "bv")  # layers.Attention's (model.attention_bias)


def decay_mask(params) -> dict:
    """True for parameters that get weight decay: every >=2-D weight except the embedding table, the norm scales and
    the attention biases (excluded by name: stacked per layer, a norm scale or a bias is 2-D or 3-D)."""

    def keep(path, x) -> bool:
        names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
        return (x.ndim >= 2 and "embed" not in names and not any("norm" in str(n) for n in names)
                and names[-1] not in ATTENTION_BIASES)

    return jax.tree_util.tree_map_with_path(keep, params)


def global_norm(tree) -> jax.Array:
    """sqrt(sum of squares) over every leaf of `tree`, in float32; a leaf of rank >= 3 (a stacked layer parameter,
    (L, in, out) or (L, E, in, out)) is summed slice by slice along its leading axis.

    The gradient of a stacked parameter is the concatenation of the per-layer gradients (llama.unstack), each a
    GEMM output or a slice of one (the fused q|k|v and gate|up GEMMs). XLA fuses that concatenation into the norm's
    reduction; summed in one piece, every element pays the concatenation's index arithmetic and the reduction runs
    at ~1.1 TB/s (the 8B step's gate/up gradients, 0.84 ms each). Per layer, each slice of the concatenation folds
    back to the GEMM output it came from, and XLA reduces all the slices in one multi-output kernel at ~4.3 TB/s
    (0.22 ms; all norms of the step 3.4 -> 1.7 ms, benchmarks/RESULTS.md).
    """
    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        x = x.astype(jnp.float32)
        total += sum(jnp.sum(x[i] * x[i]) for i in range(x.shape[0])) if x.ndim >= 3 else jnp.sum(x * x)
    return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm (same state, same arithmetic), with the norm from `global_norm`."""

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        keep = norm < max_norm
        return jax.tree.map(lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def scale_by_adam(b1: float, b2: float, eps: float, moment_dtype) -> optax.GradientTransformation:
    """optax.scale_by_adam with both moments stored in `moment_dtype` (module doc) and the same state, so that a
    checkpoint restores across moment dtypes (Orbax casts to the target's dtype). optax computes the new moments in
    float32 from float32 gradients and casts mu to mu_dtype and nu to the dtype it was initialized with."""
    dt = jnp.dtype(moment_dtype)
    inner = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, mu_dtype=dt)

    def init(params):
        state = inner.init(params)
        return state._replace(nu=jax.tree.map(lambda v: v.astype(dt), state.nu))

    return optax.GradientTransformation(init, inner.update)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip_norm > 0:
        parts.append(clip_by_global_norm(cfg.grad_clip_norm))
    # optax.adamw's chain, with the moments' dtype: the same state tree (checkpoints written before stay readable).
    parts.append(optax.chain(
        scale_by_adam(cfg.b1, cfg.b2, cfg.eps, cfg.moment_dtype),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule(cfg, total_steps)),
    ))
    return optax.chain(*parts)
