"""Row-times-matrix products with the matrix picked per row, for decoding mixture-of-experts models.

A decoding step of a MoE model has R = B T k assignments (a token and one of its experts), each a single row times
that expert's matrices. Without sorting the rows by expert:

    indexed_matmul:  y[r] = bf(x[r] @ W[idx[r]])                          x (R, K), W (E, K, N), idx (R,) -> (R, N)
    indexed_swiglu:  h[r] = bf(silu(g) * u),  g = bf(x[r] @ Wg[idx[r]]),  u = bf(x[r] @ Wu[idx[r]])
                     bf(.) rounds to x's dtype; the sums are float32, as the model's GEMMs with 16-bit outputs
                     and its SwiGLU (layers.swiglu) on their rounded outputs

Each assignment reads its expert's whole (K, N) matrices once, so a step reads R K N itemsize bytes per matrix
(an expert chosen twice is read twice; the second read is often served by L2). That is what the products cost at
the memory's bandwidth: an H200 moves ~4.8 TB/s against ~990 dense bf16 TFLOP/s.

Why a kernel: XLA does not send these products to cuBLAS. A dot whose sizes multiply to fewer than ~10^7 is
rewritten into a multiply-reduce fusion (its GPU algebraic simplifier), and a batched dot of one row per batch
always is. With the weights gathered by index those fusions streamed 1.1-1.7 TB/s for DeepSeekMoE 16B's
2048 x 1408 experts and 1.3-1.5 TB/s for Mixtral's 4096 x 14336 (benchmarks/RESULTS.md, session 64).

Kernel (Mosaic GPU, `plgpu.kernel`, one warpgroup per CTA, grid (N / tile_n, R)):
- CTA (n, r) streams expert idx[r]'s (K, tile_n) column block of each weight through a `stages`-deep TMA ring of
  (tile_k, tile_n) tiles (the weights' stored orientation, N minor: 16-bit wgmma reads it transposed).
- wgmma needs 64 rows of A. The A tile is the 64 rows of x from 8 floor(r / 8) on (a TMA load into a tiled SMEM
  operand needs a row offset that is a multiple of 8), so x is padded with zero rows to 8 ceil(R / 8) + 56; row
  r mod 8 of the f32 accumulator is the product, the others are discarded. Per K step that is
  64 x tile_n x tile_k x 2 FLOP against tile_k x tile_n x 2 bytes of weights, 64 FLOP per byte: at 4.8 TB/s the
  tensor cores would need 307 TFLOP/s, so the products stay memory-bound. The A tiles come from L2 (x is small).
- A stage is released one K step late (`delay_release=1`): each step issues its wgmma groups, then waits until
  only the last is in flight, so a step's wgmma overlaps the next step's wait for its tiles.
- Epilogue: the f32 accumulator (or silu(g) u) in registers -> SMEM staging (64 x tile_n) -> one row stored by TMA.
- Shared memory at the default 128 columns and 4 stages: 4 x (64 + 128 per weight) x 64 x 2 B of ring plus a
  16 KiB staging tile, 176 KiB with two weights (one CTA per SM), 112 KiB with one (two per SM); 16 KiB of each
  weight per stage in flight. Over the problems of pallas_kernels/bench_indexed.py on an H200 this tile had the
  lowest total time of 32-128 columns and 3-8 stages; it streams 3.1-4.8 TB/s once R N / 128 fills the SMs, 1.5-3.2
  for a single token's products, a scan's per-layer overhead included (benchmarks/RESULTS.md, session 65).

impl: "pallas" (the kernel; NotImplementedError outside its cover: 16-bit x and W of one dtype, K a multiple of
tile_k, N of tile_n), "xla" (the gathered weights in an einsum: what XLA makes of the model's expression), or
"auto" (pallas on a Hopper GPU when covered, else xla). Forward only: decoding takes no gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device
from pallas_kernels.grouped_matmul import operand_transforms

Impl = Literal["auto", "pallas", "xla"]
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ROWS = 64  # wgmma's M per warpgroup
_ALIGN = 8  # TMA row offset granularity into a tiled SMEM operand
_SMEM_BYTES = 227 * 1024  # Hopper opt-in shared memory per block


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    tile_n: int = 64  # output columns per CTA; multiple of 8, <= 256
    tile_k: int = 64  # contraction per stage: 64 16-bit elements = 128 B rows, the widest swizzle
    stages: int = 4  # TMA ring depth

    def name(self) -> str:
        return f"n{self.tile_n} k{self.tile_k} s{self.stages}"

    def smem_bytes(self, n_weights: int, itemsize: int) -> int:
        ring = self.stages * (_ROWS + n_weights * self.tile_n) * self.tile_k * itemsize
        return ring + _ROWS * self.tile_n * itemsize + 1024


# Tried in order (the first that covers the operands). 128 columns per CTA ran fastest over the problems of
# bench_indexed on an H200, 64 (more CTAs) next: within 4% on average, up to 24% apart at single shapes.
DEFAULTS = (Config(tile_n=128), Config(tile_n=64))


def _check(x: jax.Array, weights: tuple[jax.Array, ...], idx: jax.Array, name: str) -> None:
    if x.ndim != 2 or any(w.ndim != 3 for w in weights) or idx.shape != (x.shape[0],):
        raise ValueError(f"{name} wants x (R, K), W (E, K, N) and idx (R,); got x {x.shape}, "
                         f"W {[w.shape for w in weights]}, idx {idx.shape}")
    if any(w.shape != weights[0].shape for w in weights):
        raise ValueError(f"{name}: the weights differ in shape: {[w.shape for w in weights]}")
    if weights[0].shape[1] != x.shape[1]:
        raise ValueError(f"{name}: x {x.shape} does not contract with W {weights[0].shape} (E, K, N)")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"{name}: idx must be integer, got {idx.dtype}")


def _cover(x, weights, config: Config) -> str | None:
    dtypes = {jnp.dtype(a.dtype) for a in (x, *weights)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
        return f"x and W must share a 16-bit dtype (bfloat16, float16), got {sorted(map(str, dtypes))}"
    k, n = weights[0].shape[1:]
    if k % config.tile_k or n % config.tile_n:
        return f"K={k} must be a multiple of tile_k={config.tile_k} and N={n} of tile_n={config.tile_n}"
    smem = config.smem_bytes(len(weights), x.dtype.itemsize)
    if smem > _SMEM_BYTES:
        return f"{config.name()} needs {smem} B of shared memory for {len(weights)} weight(s), over {_SMEM_BYTES}"
    return None


def pick(x, weights: tuple, config: Config | None = None) -> tuple[Config, str | None]:
    """(the given config or the first of DEFAULTS that covers x and weights, None), or (a config, why the kernel
    does not take them). x and weights: arrays or anything with .shape and .dtype."""
    for c in (config,) if config is not None else DEFAULTS:
        reason = _cover(x, weights, c)
        if reason is None:
            return c, None
    return c, reason


def _silu_mul(g, u):
    return g / (1.0 + jnp.exp(-g)) * u


def _kernel(idx_gmem, x_gmem, *refs, config: Config, swiglu: bool):
    *w_gmems, out_gmem = refs
    c = config
    ni, r = lax.axis_index("n"), lax.axis_index("r")
    e = idx_gmem[r]
    row0 = lax.div(r, _ALIGN) * _ALIGN  # a multiple of 8 that Mosaic can see
    dtype = x_gmem.dtype
    a_spec = plgpu.BlockSpec((_ROWS, c.tile_k), lambda kk: (0, kk), transforms=operand_transforms(dtype, c.tile_k),
                             delay_release=1)
    b_spec = plgpu.BlockSpec((c.tile_k, c.tile_n), lambda kk: (kk, 0), transforms=operand_transforms(dtype, c.tile_n),
                             delay_release=1)
    cols = pl.ds(ni * c.tile_n, c.tile_n)

    def acc_scope(*accs):
        def step(_, a_smem, *b_smems):
            for acc, b_smem in zip(accs, b_smems):
                plgpu.wgmma(acc, a_smem, b_smem)
            plgpu.wgmma_wait(1)  # the previous step's groups are done: its stage may be refilled

        plgpu.emit_pipeline(
            step,
            grid=(x_gmem.shape[1] // c.tile_k,),
            in_specs=[a_spec] + [b_spec] * len(w_gmems),
            max_concurrent_steps=c.stages,
        )(x_gmem.at[pl.ds(row0, _ROWS)], *(w.at[e].at[:, cols] for w in w_gmems))
        return tuple(acc[...] for acc in accs)  # reading an accumulator waits for its last wgmma

    accs = pl.run_scoped(acc_scope, *(plgpu.ACC((_ROWS, c.tile_n), jnp.float32) for _ in w_gmems))
    if swiglu:
        g, u = (a.astype(dtype).astype(jnp.float32) for a in accs)
        y = _silu_mul(g, u)
    else:
        (y,) = accs

    @functools.partial(pl.run_scoped, staging=plgpu.SMEM((_ROWS, c.tile_n), out_gmem.dtype))
    def _store(staging):
        staging[...] = y.astype(out_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(staging.at[pl.ds(r - row0, 1)], out_gmem.at[pl.ds(r, 1), cols])
        plgpu.wait_smem_to_gmem(0)


@device.lowered_once(("swiglu", "config", "interpret"))
def _launch(x, weights, idx, *, swiglu: bool, config: Config, interpret):
    rows = x.shape[0]
    e, _, n = weights[0].shape
    padded = pl.cdiv(rows, _ALIGN) * _ALIGN + _ROWS - _ALIGN
    x = jnp.pad(x, ((0, padded - rows), (0, 0)))
    idx = idx.astype(jnp.int32)
    idx = jnp.clip(jnp.where(idx < 0, idx + e, idx), 0, e - 1)  # as jnp indexing: negative from the end, clamped
    f = plgpu.kernel(
        functools.partial(_kernel, config=config, swiglu=swiglu),
        out_type=jax.ShapeDtypeStruct((rows, n), x.dtype),
        grid=(n // config.tile_n, rows),
        grid_names=("n", "r"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
        kernel_name="indexed_swiglu" if swiglu else "indexed_matmul",
    )
    return f(idx, x, *weights)


def _xla(x, weights, idx, swiglu: bool):
    """The gathered weights in an einsum; XLA fuses the gather into a multiply-reduce (no copy of the weights)."""
    dot = lambda w: jnp.einsum("rk,rkn->rn", x, w[idx].astype(x.dtype),
                               preferred_element_type=jnp.float32).astype(x.dtype)
    if not swiglu:
        return dot(weights[0])
    g, u = (dot(w) for w in weights)
    return (jax.nn.silu(g) * u).astype(x.dtype)  # layers.swiglu on the rounded products


def _dispatch(x, weights, idx, swiglu: bool, impl: Impl, config: Config | None, interpret, name: str):
    _check(x, weights, idx, name)
    config, reason = pick(x, weights, config)
    if impl == "auto":
        impl = "pallas" if reason is None and device.kernels_apply() else "xla"
    if impl == "pallas":
        if reason is not None:
            raise NotImplementedError(f"{name}: {reason}")
        return _launch(x, weights, idx, swiglu=swiglu, config=config, interpret=interpret)
    if impl == "xla":
        return _xla(x, weights, idx, swiglu)
    raise ValueError(f"{name}: impl must be one of auto, pallas, xla; got {impl!r}")


def indexed_matmul(x: jax.Array, w: jax.Array, idx: jax.Array, *, impl: Impl = "auto", config: Config | None = None,
                   interpret=None) -> jax.Array:
    """y[r] = x[r] @ w[idx[r]] in x's dtype (float32 sums). x (R, K), w (E, K, N), idx (R,) -> (R, N).

    `interpret`: None on the GPU, or a `compat.InterpretGPUParams` to run the kernel on CPU."""
    return _dispatch(x, (w,), idx, False, impl, config, interpret, "indexed_matmul")


def indexed_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, idx: jax.Array, *, impl: Impl = "auto",
                   config: Config | None = None, interpret=None) -> jax.Array:
    """h[r] = silu(x[r] @ w_gate[idx[r]]) * (x[r] @ w_up[idx[r]]), each product rounded to x's dtype first.
    x (R, K), w_gate and w_up (E, K, N), idx (R,) -> (R, N)."""
    return _dispatch(x, (w_gate, w_up), idx, True, impl, config, interpret, "indexed_swiglu")
