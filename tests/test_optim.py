"""The optimizer's own pieces: the per-layer global norm and the clipping built on it, against optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mx_jax import optim


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"stacked": jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float32),
            "experts": jnp.asarray(rng.standard_normal((2, 4, 3, 5)), jnp.bfloat16),
            "matrix": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32),
            "scale": jnp.asarray(rng.standard_normal((9,)), jnp.float32), "scalar": jnp.float32(rng.normal())}


def test_global_norm_is_exact_on_every_leaf_rank():
    tree = _tree(0)
    want = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
    np.testing.assert_allclose(float(optim.global_norm(tree)), want, rtol=1e-6)  # bf16 leaves summed in f32


def test_clip_by_global_norm_matches_optax_below_and_above_the_threshold():
    tree = {k: v.astype(jnp.float32) for k, v in _tree(1).items()}
    norm = float(optax.tree.norm(tree))
    for max_norm in (norm / 3, norm * 2):
        ours, _ = optim.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        ref, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    clipped, _ = optim.clip_by_global_norm(norm / 3).update(tree, optax.EmptyState())
    np.testing.assert_allclose(float(optax.tree.norm(clipped)), norm / 3, rtol=1e-5)
