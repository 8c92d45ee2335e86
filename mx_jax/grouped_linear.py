"""Differentiable grouped linear layer for MoE experts: y[r] = x[r] @ w[e(r)] over tokens sorted by expert.

    x (M, K) token rows sorted by expert, w (E, K, N) the expert weights (f32 master or bf16),
    group_sizes (E,) int32: rows of each expert in order; rows past sum(group_sizes) are padding (y = 0 there,
    no gradient flows through them; they must hold finite values). Returns y (M, N) in x.dtype.

Three grouped GEMMs (pallas_kernels/grouped_matmul.py), each contracting a different axis:

    out     y  = gmm(x, w)                        (M, K) x (E, K, N)   contraction over K
    grad_x  dx = gmm(dy, w, transpose_rhs=True)   (M, N) x (E, K, N)ᵀ  contraction over N: w as stored is the
                                                                       K-major operand of this GEMM, no copy
    grad_w  dw = tgmm(x, dy)                      (M, K) x (M, N)      contraction over each group's rows

| recipe      | GEMM   | left operand, scales           | right operand, scales                              |
|-------------|--------|--------------------------------|----------------------------------------------------|
| bf16        | all    | x.dtype (bf16)                 | x.dtype (bf16)                                     |
| fp8_rowwise | out    | x  e4m3, per row (M,)          | w  e4m3, per (e, n) (E, N), K-major copy (E, N, K) |
|             | grad_x | dy e4m3, per row (M,)          | w  e4m3, per (e, k) (E, K), as stored (E, K, N)    |
|             | grad_w | x  e4m3, per (group, k) (E, K) | dy e4m3, per (group, n) (E, N)                     |

Every fp8 operand is scaled along its own GEMM's contraction axis (for grad_w: the group's rows, TorchAO's
"per group colwise" scales), so the scales factor out of the sums and the kernels apply them in the epilogue.
grad_w's quantization and its K-major token layout are one step (`grouped_matmul.tgmm_fp8_rowwise`).
Scales are dynamic, amax floored at 1e-12, rounded to powers of two, casts saturate (pallas_kernels/quantize.py).
Accumulation is f32; y and dx come out in x.dtype, dw in w.dtype.

Weights. Every GEMM reads w's compute-dtype copy w.astype(x.dtype) (bf16 in training), and the fp8 operands are
quantized from that copy, as TorchAO's are from the bf16 parameter that FSDP's mixed precision hands it. The
forward quantizes both layouts the two GEMMs need in one `quantize_dual` over the batch of experts, rounding the
f32 master to bf16 inside the kernels (one read of w for both amaxes, one for both casts, no bf16 copy in HBM),
and keeps the backward's layout as a residual, as mx_jax.quant does for a dense linear: 1 byte per weight element
held from forward to backward (fp8_rowwise; the bf16 recipe holds the bf16 copy, 2 bytes), instead of quantizing
the f32 master again in the backward. HBM bytes per f32 weight element: 4 + 4+1+1 = 10, where converting to bf16
first costs 4+2 + 2 + 2+1+1 = 12, and each direction reading the f32 weight twice (amax, then cast) costs 18.
x is kept in high precision and requantized by the backward, because grad_w needs it scaled along another axis.
In the train step the weights' operands come ready (`operands`, made at the optimizer update by
mx_jax.quant.prequantize with batched=True, the same rounding and casts, from the bf16 copy the update fusion
writes: 2 + 2+2+1+1 bytes per element): the forward then casts no weight, and a rematerialized backward does not
cast it again (+6.3% on the 2-layer Mixtral fp8 step on an H100, RESULTS.md).

Source: TorchAO's fp8 rowwise MoE training, torchao/prototype/moe_training/fp8_grouped_mm.py (`_Float8GroupedMM`,
pytorch/ao): A rowwise and B_t per output column for the forward; grad_output rowwise and B per output column of
grad_A (`triton_fp8_rowwise_3d_transpose_rhs`) for grad_input; grad_output and A with per-group column-wise scales
(`triton_fp8_per_group_colwise_scales`) for grad_weight -- i.e. TorchAO keeps grad_weight in fp8, and so do we;
all e4m3, round_scales_to_power_of_2=True, A and B_t saved in high precision. TorchAO returns grad_B in bf16; we
return w.dtype (f32 for f32 master weights).

Works under jit, grad and shard_map, check_vma on or off (the op sees local arrays: with experts sharded the caller
passes its local w and its local group sizes). group_sizes gets no gradient.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from mx_jax import quant

gmm_ops = importlib.import_module("pallas_kernels.grouped_matmul")
qz = importlib.import_module("pallas_kernels.quantize")

RECIPES = ("bf16", "fp8_rowwise")
E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def recipe_for(recipe: str) -> str | None:
    """The grouped recipe that a model-wide `quant.recipe` (mx_jax.quant.RECIPES) gives the routed experts, or None
    when the grouped GEMMs have no such recipe (fp8_tensorwise, fp8_rowwise_gw_hp, mxfp8: the experts stay bf16)."""
    return recipe if recipe in RECIPES else None


def _quant_impl(impl: str) -> str:
    """The cast dispatcher's impl: its own Pallas kernels where the GEMMs may use ours, plain XLA otherwise."""
    return "xla" if impl in ("xla", "reference") else "auto"


def _rowwise(t: jax.Array, impl: str) -> tuple[jax.Array, jax.Array]:
    """t (M, C) in e4m3 along its last axis with power-of-two scales: (t_fp8 (M, C), scale (M,))."""
    return qz.quantize(t, axis=1, dtype=E4M3, pow2_scale=True, impl=_quant_impl(impl))


quantize_group_cols = gmm_ops.quantize_group_cols  # t (M, C) -> e4m3 (M, C), per (group, column) scales (E, C)


def _forward(x, ws, group_sizes, ops, recipe: str, impl: str):
    """ys (one per weight of `ws`) and the residuals of the backward: (x, the weights' compute copies) for bf16,
    (x, per weight (w e4m3 (E, K, N), scales (E, K))) for fp8_rowwise. `ops`: per weight its operands made at the
    update (mx_jax.quant.prequantize, batched), or None."""
    if recipe == "bf16":
        w_cs = tuple(w.astype(x.dtype) for w in ws)
        return tuple(gmm_ops.gmm(x, w_c, group_sizes, out_dtype=x.dtype, impl=impl) for w_c in w_cs), (x, w_cs)
    xq, xs = _rowwise(x, impl)  # (M, K), (M,): once for every weight
    ys, w_ks = [], []
    for w, op in zip(ws, ops):
        # (E, K, N) scaled along N for grad_x, and the (E, N, K) copy scaled along K that the forward's 8-bit wgmma
        # reads (K-major operands only), from the same two passes over w, rounded to x.dtype on the way.
        if op is None:
            w_k, (w_n, ws_n) = qz.quantize_dual(w, dtype=E4M3, pow2_scale=True, impl=_quant_impl(impl),
                                                round_to=x.dtype)
        else:
            w_k, (w_n, ws_n) = op.grad_x, op.out
        ys.append(gmm_ops.gmm(
            xq, w_n, group_sizes, transpose_rhs=True, lhs_scale=xs, rhs_scale=ws_n, out_dtype=x.dtype, impl=impl
        ))
        w_ks.append(w_k)
    return tuple(ys), (x, tuple(w_ks))


def _backward(x, w_res, group_sizes, dys, recipe: str, impl: str, w_dtypes, group_align: int):
    """dx (the sum over the weights, in x.dtype, as autodiff adds the cotangents of a shared input) and each dw."""
    if recipe == "bf16":
        dys = tuple(dy.astype(x.dtype) for dy in dys)
        dxs = [gmm_ops.gmm(dy, w, group_sizes, transpose_rhs=True, out_dtype=x.dtype, impl=impl)
               for dy, w in zip(dys, w_res)]
        dws = tuple(gmm_ops.tgmm(x, dy, group_sizes, out_dtype=dt, impl=impl) for dy, dt in zip(dys, w_dtypes))
    else:
        dxs = []
        for dy, (wq, ws) in zip(dys, w_res):  # wq (E, K, N) scaled along N, ws (E, K): quantized by the forward
            dyq, dy_scale = _rowwise(dy, impl)  # (M, N), (M,)
            dxs.append(gmm_ops.gmm(
                dyq, wq, group_sizes, transpose_rhs=True, lhs_scale=dy_scale, rhs_scale=ws, out_dtype=x.dtype,
                impl=impl,
            ))
        # x and each dy in e4m3 per (group, column), cast straight into the kernel's token layout where it runs;
        # x once for every weight. The GEMMs write f32 for any weight that wants it, and the rest are rounded.
        dt = jnp.result_type(*w_dtypes)
        dws = gmm_ops.tgmm_fp8_rowwise(x, tuple(dys), group_sizes, out_dtype=dt, impl=impl, group_align=group_align)
        dws = tuple(dw.astype(t) for dw, t in zip(dws, w_dtypes))
    dx = dxs[0]
    for d in dxs[1:]:
        dx = dx + d
    return dx, dws


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _grouped_linear(x, ws, group_sizes, ops, recipe, impl, group_align, w_dtypes):
    return _forward(x, ws, group_sizes, ops, recipe, impl)[0]


def _grouped_linear_fwd(x, ws, group_sizes, ops, recipe, impl, group_align, w_dtypes):
    ys, (x_res, w_res) = _forward(x, ws, group_sizes, ops, recipe, impl)
    return ys, (x_res, w_res, group_sizes)


def _grouped_linear_bwd(recipe, impl, group_align, w_dtypes, res, dys):
    # w_dtypes: the weights' dtypes, static (an empty array per weight carrying it as a residual was a zero-size
    # array in the expert shard_map's backward: see dispatch.ExpertFFN on jax 0.11.2's Shardy)
    x, w_res, group_sizes = res
    dx, dws = _backward(x, w_res, group_sizes, dys, recipe, impl, w_dtypes, group_align)
    dws = tuple(dw.astype(dt) for dw, dt in zip(dws, w_dtypes))
    return dx.astype(x.dtype), dws, None, None  # group sizes and operands: no gradient


_grouped_linear.defvjp(_grouped_linear_fwd, _grouped_linear_bwd)


def grouped_linear(
    x: jax.Array, w, group_sizes: jax.Array, *, recipe: str = "bf16", impl: str = "auto",
    group_align: int = 1, operands=None,
):
    """y (M, N) = x[r] @ w[e(r)] per token row, zero on padding rows; differentiable in x and w.

    x (M, K) float (bf16 in training), w (E, K, N) float, group_sizes (E,) integer. recipe: "bf16" (operands in
    x.dtype) | "fp8_rowwise". impl ("auto" | "pallas" | "xla" | "reference") goes to the grouped GEMMs.
    group_align: the caller's promise that every group size is a multiple of it, with the rows that pad a group to
    it zero (mx_jax.dispatch.ExpertFFN lays rows out so); 64 lets the fp8 backward cast tokens in place
    (`grouped_matmul.tgmm_fp8_rowwise`). The result does not depend on it.
    operands (fp8_rowwise): w's fp8 operands made when it was last updated (`mx_jax.quant.prequantize(w,
    recipe="fp8_rowwise", batched=True)`); w's values are then never read, it only receives the gradient.

    w may be a tuple of weights (E, K, N_i) that read the same x (the experts' gate and up), with operands then a
    tuple too (None or one per weight): the result is the tuple of their outputs, the same values as one call per
    weight, and under fp8_rowwise x's casts (rowwise for the forward, per group and column for grad_w) are made
    once for all of them instead of once per weight."""
    several = isinstance(w, tuple)
    ws = w if several else (w,)
    ops = (operands if several else (operands,)) if operands is not None else (None,) * len(ws)
    if recipe not in RECIPES:
        raise ValueError(f"grouped_linear: unknown recipe {recipe!r}; choose from {RECIPES}")
    if impl not in ("auto", "pallas", "xla", "reference"):
        raise ValueError(f"grouped_linear: impl must be 'auto', 'pallas', 'xla' or 'reference', got {impl!r}")
    if not ws or not isinstance(ops, tuple) or len(ops) != len(ws):
        raise ValueError(f"grouped_linear: need one or more weights and, if given, operands for each; got "
                         f"{len(ws)} weights and operands {type(operands).__name__}")
    for w in ws:
        if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or w.shape[0] != ws[0].shape[0]:
            raise ValueError(
                f"grouped_linear: need x (M, K) and w (E, K, N), got x {x.shape} {x.dtype}, w {w.shape} {w.dtype}"
            )
        if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(w.dtype, jnp.floating)):
            raise ValueError(f"grouped_linear: x and w must be floating, got x {x.dtype}, w {w.dtype}")
    e = ws[0].shape[0]
    if group_sizes.shape != (e,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"grouped_linear: group_sizes must be ({e},) integer for w {ws[0].shape}, "
            f"got {group_sizes.shape} {group_sizes.dtype}"
        )
    if not isinstance(group_align, int) or group_align < 1:
        raise ValueError(f"grouped_linear: group_align must be a positive int, got {group_align!r}")
    for w, op in zip(ws, ops):
        if op is not None:
            quant.check_operands(op, w, recipe, ("fp8_rowwise",), "grouped_linear")
    ys = _grouped_linear(x, ws, group_sizes.astype(jnp.int32), ops, recipe, impl, group_align,
                         tuple(jnp.dtype(w.dtype) for w in ws))
    return ys if several else ys[0]
