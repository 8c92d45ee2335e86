"""AdamW with linear warmup and cosine decay, global-norm clipping, and no weight decay on norms and embeddings.

    lr(s) = lr_peak * (s + 1) / warmup                              for s < warmup (step 0 already learns)
          = lr_peak * (r + (1 - r) * (1 + cos(pi * p)) / 2)         p = (s - warmup) / (decay - warmup), clipped
    with r = lr_final_ratio. Updates: g <- g * min(1, c / ||g||_2);  AdamW(b1, b2, eps, wd) (Loshchilov & Hutter).

Weight decay applies to matrices that multiply activations (attention, MLP, expert and head weights); the embedding
table, norm scales and biases are excluded, as in GPT-2/Llama practice. Gradient accumulation happens in the train
step (a scan over microbatches summing gradients), so the optimizer sees one averaged gradient per step.
"""

from __future__ import annotations

import jax
import optax

from mx_jax.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    decay = cfg.decay_steps or total_steps
    warmup = min(cfg.warmup_steps, decay)
    return optax.warmup_cosine_decay_schedule(
        init_value=cfg.lr_peak / warmup if warmup else cfg.lr_peak, peak_value=cfg.lr_peak, warmup_steps=warmup,
        decay_steps=max(decay, warmup + 1),
        end_value=cfg.lr_peak * cfg.lr_final_ratio)


def decay_mask(params) -> dict:
    """True for parameters that get weight decay: every >=2-D weight except the embedding table."""

    def keep(path, x) -> bool:
        names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
        return x.ndim >= 2 and "embed" not in names and not any("norm" in str(n) for n in names)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.grad_clip_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
    parts.append(optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
