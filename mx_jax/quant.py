"""Low-precision training recipes for a linear layer y = x @ w, after TorchAO's float8 recipes.

A linear layer runs three GEMMs; each is either all-fp8 (both operands quantized, f32 accumulation, the
dequantization scales applied in the GEMM epilogue) or all high precision (bf16 operands, f32 accumulation):

    out    y      = x  @ w        x (T, K), w (K, N)   contraction over K
    grad_x grad_x = g  @ wᵀ       g = dL/dy (T, N)     contraction over N
    grad_w grad_w = xᵀ @ g                             contraction over T

| recipe             | GEMM   | left operand           | right operand          | pow2 scales |
|--------------------|--------|------------------------|------------------------|-------------|
| bf16               | all    | bf16                   | bf16                   | -           |
| fp8_tensorwise     | out    | x  e4m3 tensorwise     | w  e4m3 tensorwise     | no          |
|                    | grad_x | g  e5m2 tensorwise     | w  e4m3 tensorwise     |             |
|                    | grad_w | x  e4m3 tensorwise     | g  e5m2 tensorwise     |             |
| fp8_rowwise        | out    | x  e4m3 along K        | w  e4m3 along K        | yes         |
|                    | grad_x | g  e4m3 along N        | w  e4m3 along N        |             |
|                    | grad_w | x  e4m3 along T        | g  e4m3 along T        |             |
| fp8_rowwise_gw_hp  | out    | x  e4m3 along K        | w  e4m3 along K        | no          |
|                    | grad_x | g  e4m3 along N        | w  e4m3 tensorwise     |             |
|                    | grad_w | x  bf16                | g  bf16                |             |

"along A" = rowwise (TorchAO "axiswise") scaling: one scale per slice, the amax taken along axis A, which is always
the operand's contraction axis in that GEMM, so a scale is constant along the sum and factors out of it. Scales are
dynamic (from the current tensor), amax floored at 1e-12, casts saturate (pallas_kernels/quantize.py has the math).

Source: TorchAO torchao/float8/config.py (pytorch/ao, read at c6c388b5), `Float8LinearConfig.from_recipe_name`
for Float8LinearRecipeName.TENSORWISE (the default Float8LinearConfig: e4m3 input/weight, e5m2 grad_output,
tensorwise), ROWWISE (AXISWISE e4m3 for all three tensors, round_scales_to_power_of_2=True) and ROWWISE_WITH_GW_HP
(input/weight AXISWISE, grad_output AXISWISE e4m3, weight TENSORWISE for grad_input, input and grad_output DISABLED
for grad_weight, no pow2 rounding); the axis each operand is scaled along is `get_maybe_axiswise_dim` in
torchao/float8/float8_linear.py (matmul_with_hp_or_float8_args). Differences: our GEMM kernel accumulates the
whole K in the wgmma accumulator (TorchAO's use_fast_accum=True, which it sets only for the forward by default);
grad_w comes out in w's dtype (f32 for f32 master weights) instead of bf16.

Trade-offs. Every operand that two GEMMs use with the same cast (x, w and g in fp8_rowwise; all three in
fp8_tensorwise, where the transpose of a tensorwise fp8 tensor is its other layout) is quantized once for both
layouts by `quantize_dual` (shared reads, see pallas_kernels/quantize.py); the forward then keeps x's and w's
backward-layout fp8 copies as residuals (1 byte per element instead of the bf16 x). Operands are always passed
K-major: the forward w operand is the transposed (N, K) copy the cast writes; so are the backward xᵀ and gᵀ.

Rematerialization (model.remat=save_matmuls keeps values named "matmul"): x's fp8 residual carries that name, so
the backward reads it instead of recomputing x (a norm or the SwiGLU) and casting it again (unnamed: 17 extra
kernels per 8B layer, 42,167 against 42,876 tokens/s for the scanned 8-layer 8B step on an H200).

Weight operands made at the update. A weight's two fp8 operands (`Operands`: wᵀ for out, w for grad_x) depend only
on the weight, so the train step makes them once per optimizer step from the updated masters (`prequantize`, called
by llama.compute_copies, one dual cast per fused weight, which reads the parts (w_q, w_k, w_v) where they are
instead of a concatenated copy; fp8_rowwise_gw_hp, whose two operands are scaled differently, casts a concatenated
copy twice) and keeps them in its state instead of the weight's bf16
copy: 2 bytes per weight either way. Each linear then receives `Prequantized`: a zero "slot" shaped like the weight,
which only receives the gradient (XLA never builds it), and the operands, which are not differentiated. The
forward and the rematerialized backward no longer concatenate the fused weights or cast any weight, and a scanned
layer's backward reads the same operands its forward did (no fp8 weight residual). Measured on the scanned
8-layer 8B step on an H100: 64 fewer kernels, +1.5% tokens/s, 1.4 GiB less peak memory (benchmarks/RESULTS.md,
session 26). The routed experts' grouped GEMMs take theirs the same way (mx_jax/grouped_linear.py; +6.3% on the
2-layer Mixtral fp8 step). Called with a plain weight, `linear` makes the operands itself (evaluation, sampling,
benchmarks).

Multi-device meshes. A Mosaic kernel sees only local arrays, so under a mesh set outside shard_map (where XLA's
partitioner splits the program) an fp8 linear of T rows runs per device: `_token_split` names the mesh axes that
split the tokens (data, fsdp and expert on the batch, context on the sequence), and the forward and the backward
each run in one shard_map over them, with the whole weight operands (XLA gathers them first under fsdp or expert).
With T_d a device's rows,

    y_d = x_d @ w,   grad_x_d = g_d @ wᵀ,   grad_w = Σ_d x_dᵀ @ g_d

Each device's grad_w partial is reduced in `reduce_dtype` (model.grad_reduce_dtype, f32 by default) inside the
shard_map where `linear` is given w's logical axes (the model's linears are): reduce-scattered over the mesh axes
that split w (fsdp, expert, context) on w's split dim, then the shard all-reduced over the other token axes (data),
as XLA's partitioner reduces bf16's. The grad_w GEMM writes that dim as its rows (where it is w's dim 1, with its
operands swapped: grad_wᵀ = gᵀ x), so the reduce-scatter takes contiguous blocks and only the shard is transposed
back; XLA otherwise transposed each whole partial first (session 41: 2.5 ms less copying per step on the whole 8B).
Without w's axes, the partials leave the shard_map stacked on a leading device axis and are summed outside; on HSDP
(data x fsdp) XLA then all-reduced whole weight gradients over data x fsdp, fsdp times bf16's bytes over the data
axis (4 x H200, data=2 x fsdp=2: collectives 43.7 -> 38.8 ms of device time per step, +0.6% tokens/s;
benchmarks/RESULTS.md, sessions 37-38). Reduced inside, the grad_w GEMM is fenced before the grad_x GEMM (an
optimization_barrier), so its reduce-scatter runs beside grad_x (session 40: +0.2-0.6% on the whole 8B at fsdp=4). A
second fence, on grad_x and the reduced grad_w, makes each linear's reduce-scatter finish before the layer's backward
goes on, where XLA had chained them all at its end: on 4 x H200 (whole 8B, fsdp=4) the communication nothing hid fell
from 57-61 to 39-40 ms per step and tokens/s rose 0.75-1.4%, for 2.4 GiB more peak memory (session 41). It pays with
the GEMM's dynamic tile schedule (pallas_kernels/fp8_matmul.py): with the static one, the GEMMs beside the
reduce-scatters slowed by what they hid. Inside or out, the sum is rounded to w's dtype after it. Scales are each
device's own, as TorchAO computes them under DDP and FSDP: scales along K or N (x and g for out and grad_x) equal one
device's, so y and grad_x are bit-identical; x and g along T for grad_w, and tensorwise scales, come from the
device's rows (each partial product is dequantized before the sum, so the math holds). Without this, cuBLASLt's fp8
GEMM and XLA's casts ran instead; on 2 x H200 the 4-layer 8B fp8 step's device time fell from 149.5 to 140.1 ms at
fsdp=2 (benchmarks/RESULTS.md, session 35). T not divisible by the token shards keeps the partitioner's path.

mxfp8 (OCP MX, blocks of 32 with a power-of-two E8M0 scale, TorchAO's MXFP8 training recipe): all three GEMMs in
MX e4m3, each operand blocked along its own contraction axis (out: x and w along K; grad_x: g and w along N;
grad_w: x and g along T), rceil scales. It lives in mx_jax/mx_linear.py (format: mx_jax/mx_format.py) and
`linear` hands it over.

Public API: `linear(x, w, *, recipe, impl, operands, w_axes, reduce_dtype, fence)`, `prequantize`, `Operands`,
`Prequantized`, `RECIPES`, `PREQUANTIZED`, `kernel_support(recipe, k, n)`, `mx_quantize` (the OCP MX cast,
re-exported from mx_format).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

fp8mm = importlib.import_module("pallas_kernels.fp8_matmul")  # the module: the package re-exports the function
qz = importlib.import_module("pallas_kernels.quantize")
dev = importlib.import_module("pallas_kernels.device")

from mx_jax import sharding  # noqa: E402
from mx_jax.mx_format import mx_quantize  # noqa: E402,F401  (public as mx_jax.quant.mx_quantize)
from mx_jax.mx_linear import mx_kernel_support, mx_linear  # noqa: E402

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
RECIPES = ("bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp", "mxfp8")
# the recipes whose weight operands `prequantize` makes (all three GEMMs' weight operands in fp8)
PREQUANTIZED = ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_gw_hp")


@dataclasses.dataclass(frozen=True)
class Cast:
    """How one operand enters one GEMM: an fp8 dtype and a scaling, or high precision (dtype None)."""

    dtype: jnp.dtype | None = None
    scaling: str | None = None  # "rowwise" (along the GEMM's contraction axis) | "tensorwise"

    @property
    def fp8(self) -> bool:
        return self.dtype is not None


HP = Cast()


@dataclasses.dataclass(frozen=True)
class Recipe:
    """(left, right) operand casts of the three GEMMs; see the table in the module docstring."""

    out: tuple[Cast, Cast]  # (x, w)
    grad_x: tuple[Cast, Cast]  # (g, w)
    grad_w: tuple[Cast, Cast]  # (x, g)
    pow2_scale: bool


_TW4, _TW5, _RW4 = Cast(E4M3, "tensorwise"), Cast(E5M2, "tensorwise"), Cast(E4M3, "rowwise")
RECIPE_TABLE: dict[str, Recipe] = {
    "bf16": Recipe(out=(HP, HP), grad_x=(HP, HP), grad_w=(HP, HP), pow2_scale=False),
    "fp8_tensorwise": Recipe(out=(_TW4, _TW4), grad_x=(_TW5, _TW4), grad_w=(_TW4, _TW5), pow2_scale=False),
    "fp8_rowwise": Recipe(out=(_RW4, _RW4), grad_x=(_RW4, _RW4), grad_w=(_RW4, _RW4), pow2_scale=True),
    "fp8_rowwise_gw_hp": Recipe(out=(_RW4, _RW4), grad_x=(_RW4, _TW4), grad_w=(HP, HP), pow2_scale=False),
}


def kernel_support(recipe: str, k: int, n: int) -> str | None:
    """None when a (K, N) weight can run `recipe` on the fp8 GEMM paths, else a short reason to keep it bf16.

    fp8 GEMMs (cuBLASLt through XLA, and the Pallas kernel) need K and N multiples of 16. Shapes the Pallas kernels
    do not tile (they want multiples of 128/256) still run in fp8: impl="auto" sends them to XLA's fp8 GEMM.
    """
    if recipe not in RECIPES:
        raise ValueError(f"kernel_support: unknown recipe {recipe!r}; choose from {RECIPES}")
    if recipe == "bf16":
        return None
    if recipe == "mxfp8":
        return mx_kernel_support(k, n)
    if k % 16 or n % 16:
        return f"fp8 GEMMs need K and N multiples of 16, got K={k}, N={n}"
    return None


# --------------------------------------------------------------------------------------------------------------
# Operand preparation: quantize along the contraction axis, K-major.
# --------------------------------------------------------------------------------------------------------------
def _rows(t, cast: Cast, pow2: bool, impl: str):
    """t (R, C) as a K-major operand contracting over C: (fp8 (R, C), scale (R,) or ())."""
    return qz.quantize(t, axis=1, dtype=cast.dtype, scaling=cast.scaling, pow2_scale=pow2, impl=impl)


def _cols_t(t, cast: Cast, pow2: bool, impl: str):
    """t (R, C) as a K-major operand contracting over R: (fp8 (C, R), scale (C,) or ())."""
    return qz.quantize_t(t, dtype=cast.dtype, scaling=cast.scaling, pow2_scale=pow2, impl=impl)


def _both(t, cast: Cast, pow2: bool, impl: str):
    """Both layouts of t with one cast: ((fp8 (R, C), scale), (fp8 (C, R), scale))."""
    return qz.quantize_dual(t, dtype=cast.dtype, scaling=cast.scaling, pow2_scale=pow2, impl=impl)


def _gemm_fp8(a_op, b_op, out_dtype, impl: str):
    (a, sa), (b_t, sb) = a_op, b_op
    return fp8mm.fp8_matmul(a, b_t, sa, sb, out_dtype=out_dtype, impl=impl)


def _dot_hp(lhs, rhs, contract: tuple[tuple[int, ...], tuple[int, ...]], out_dtype, compute_dtype):
    """High-precision GEMM: operands in compute_dtype (bf16), f32 accumulation, result in out_dtype; `contract`
    names the contracted dims of each operand.

    The GEMM writes out_dtype itself (cuBLAS accumulates bf16 products in f32 and rounds once, as the f32 result
    converted afterwards would). Asking for an f32 result and converting it made XLA keep every activation GEMM's
    output in f32 and fuse the convert into each consumer: twice the bytes written, and read again per consumer.
    """
    dims = (contract, ((), ()))
    return lax.dot_general(lhs.astype(compute_dtype), rhs.astype(compute_dtype), dims,
                           preferred_element_type=out_dtype)


def _grad_w_dtype(w_dtype, reduce_dtype) -> jnp.dtype:
    """The weight-gradient GEMM's output dtype: w's own (a bf16 weight gets a bf16 gradient, rounded once from the
    GEMM's f32 accumulator), except where the tokens are split over devices: the GEMM's per-device partial sums are
    then summed across devices in `reduce_dtype` (model.grad_reduce_dtype; float32 is TorchTitan's FSDP2 default,
    reduce_dtype=float32, rounded once after the sum)."""
    return jnp.dtype(reduce_dtype) if sharding.tokens_split() else jnp.dtype(w_dtype)


# --------------------------------------------------------------------------------------------------------------
# A weight's fp8 operands, made once per optimizer step (`prequantize`) or inside the forward (`_weight_operands`).
# --------------------------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Operands:
    """A weight w (K, N) as its two fp8 GEMMs take it, each a K-major (fp8 array, dequantization scale) pair:
    `out` = (wᵀ (N, K), scale (N,) or ()) for y = x @ w, `grad_x` = (w (K, N), scale (K,) or ()) for
    grad_x = g @ wᵀ. Stacked layers add leading axes to every array."""

    out: tuple[jax.Array, jax.Array]
    grad_x: tuple[jax.Array, jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prequantized:
    """What a linear's weight parameter holds in the train step when its operands were made at the last update:
    `slot` (K, N) in the compute dtype receives the weight's gradient and is never read (the step passes zeros,
    which XLA does not materialize); `operands` are the fused GEMM's (`layers.fused_linear`: on the first weight of
    a fused group, None on the others)."""

    slot: jax.Array
    operands: Operands | None


def _weight_operands(w, r: Recipe, impl: str) -> Operands:
    """The operands of w (K, N) under recipe `r`: one dual cast when both GEMMs use the same cast, else two
    casts. w may be a tuple of weights, the parts of a fused weight along N: the dual cast then reads each tile from
    its part (`quantize_dual`) instead of a concatenated copy."""
    (_, w_out), (_, w_gx) = r.out, r.grad_x
    if w_out == w_gx:
        gx, out = _both(w, w_out, r.pow2_scale, impl)
    else:
        w = jnp.concatenate(w, axis=-1) if isinstance(w, tuple) else w
        out, gx = _cols_t(w, w_out, r.pow2_scale, impl), _rows(w, w_gx, r.pow2_scale, impl)
    return Operands(out=out, grad_x=gx)


def prequantize(ws, *, recipe: str, impl: str = "auto", compute_dtype=jnp.bfloat16, batched: bool = False) -> Operands:
    """The operands of concatenate(ws, axis=-1) (one array or a tuple sharing all but the last axis), each weight
    first rounded to `compute_dtype`: exactly what `linear` quantizes from the compute copy of a (fused) weight.

    Each weight is rounded to `compute_dtype` whole, before anything else reads it: in the train step that rounding
    is an extra output of AdamW's update fusion, which has the new master in registers (2 bytes written per
    element), and the casts then read the rounded copy twice (2 + 2) and write 1 + 1. Rounding the f32 tiles inside
    the cast kernels instead reads the master twice (4 + 4): 2 bytes more per element (RESULTS.md, session 29).
    Where one dual cast makes both operands, the concatenation of a fused weight is never written: the Pallas casts
    read each tile from its own weight (fp8_rowwise_gw_hp's two differently scaled casts read a concatenation). With
    XLA's casts on one device, one layer's concatenated copy exists at a time: weights (..., K, N) with leading layer
    axes are quantized one layer at a time (`lax.map`). batched: the last leading axis is a batch of matrices
    quantized each on its own in one cast (the routed experts' (E, K, N), rowwise only; what mx_jax.grouped_linear's
    forward did).
    The train step calls this on the updated masters (llama.compute_copies) and passes the result to every `linear`
    of that weight through `Prequantized`: the forward and the backward then read the fp8 operands instead of
    concatenating and casting the weight again each time.

    Under a multi-device mesh that leaves every device whole matrices (`_whole_matrices_spec`: dense weights without
    fsdp or context; routed experts also under fsdp or context where `sharding.param_spec` puts those on their
    expert axis), each device casts its own weights inside shard_map, with the Pallas casts on Hopper. Otherwise the
    partitioner splits XLA's casts (a rowwise amax then spans the shards), and the layers are cast in one batched
    cast (vmap) instead of `lax.map`: on 2 GPUs with fsdp the map's loop made XLA transpose the carried copies as
    well (RESULTS.md, session 34).
    """
    if recipe not in PREQUANTIZED:
        raise ValueError(f"prequantize: recipe {recipe!r} has no fp8 weight operands; choose from {PREQUANTIZED}")
    ws = tuple(ws) if isinstance(ws, (tuple, list)) else (ws,)
    core = 3 if batched else 2  # the axes one cast takes
    lead = ws[0].shape[:-core]
    if any(w.ndim < core or w.shape[:-1] != ws[0].shape[:-1] for w in ws):
        raise ValueError(f"prequantize: weights must share every axis but the last, got {[w.shape for w in ws]}")
    r = RECIPE_TABLE[recipe]
    if batched and recipe != "fp8_rowwise":
        raise ValueError(f"prequantize: batched (expert) weights take fp8_rowwise only, got {recipe!r}")

    ws = tuple(qz.rounded(w, compute_dtype) for w in ws)  # whole arrays: XLA fuses this into the update

    def one(*layer):  # the cast kernels read each tile from its own weight
        return _weight_operands(layer if len(layer) > 1 else layer[0], r, impl)

    def cast(*ws):  # ws: the whole weights, or one device's
        local_lead = ws[0].shape[:-core]
        if not local_lead:
            return one(*ws)
        flat = [w.reshape(-1, *w.shape[-core:]) for w in ws]
        if dev.partitioned_context():  # XLA's casts, split by the partitioner: all layers in one batched cast
            ops = jax.vmap(one)(*flat)
        else:
            ops = jax.lax.map(lambda layer: one(*layer), flat)
        return jax.tree.map(lambda a: a.reshape(*local_lead, *a.shape[1:]), ops)

    spec = _whole_matrices_spec(ws[0].shape, batched) if dev.partitioned_context() else None
    if spec is not None:
        # Each device holds whole matrices (split at most over the layers' experts): it casts its own in shard_map,
        # where impl="auto" takes the Pallas casts. Left to the partitioner, XLA's casts inside the layer loop gave
        # the carried bf16 copies a transposed layout on 2 GPUs: AdamW's update that writes them became a
        # transpose, plus nine 1.9 GB copies of the experts' f32 masters and moments (RESULTS.md, sessions 33, 34).
        mesh = jax.sharding.get_abstract_mesh()
        return jax.shard_map(cast, mesh=mesh, in_specs=(spec,) * len(ws), out_specs=spec, check_vma=False)(*ws)
    return cast(*ws)


def _whole_matrices_spec(shape, batched: bool) -> P | None:
    """Under the set mesh, the spec of a weight (*layers, K, N), or batched (*layers, E, K, N), over its leading
    axes when every device holds its matrices whole, as the train state shards it (sharding.param_spec); else
    None. Dense weights are whole without fsdp, expert and context; the routed experts also under fsdp or context
    when those split their expert axis instead of their hidden dim."""
    if not batched:
        return P() if sharding.matrices_whole() else None
    mesh = jax.sharding.get_abstract_mesh()
    lead = len(shape) - 3
    spec = sharding.param_spec(("layers",) * lead + ("expert", None, "expert_mlp"), shape, mesh)
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))

    def size(entry) -> int:
        return math.prod(mesh.shape[a] for a in sharding.entry_axes(entry))

    return P(*spec[:lead + 1]) if size(spec[-2]) == size(spec[-1]) == 1 else None


def check_operands(ops, w, recipe: str, recipes: tuple[str, ...], caller: str) -> None:
    """Raise unless `ops` are `prequantize`'s Operands for a weight shaped like w (..., K, N) and `recipe` is one of
    `recipes` (the caller's fp8 recipes that take them)."""
    *lead, k, n = w.shape
    got = (ops.out[0].shape, ops.grad_x[0].shape) if isinstance(ops, Operands) else None
    if recipe not in recipes or got != ((*lead, n, k), (*lead, k, n)):
        raise ValueError(
            f"{caller}: operands must be quant.prequantize's for a {tuple(w.shape)} weight under {recipes}; got recipe "
            f"{recipe!r} and operands {jax.tree.map(lambda a: (a.shape, str(a.dtype)), ops)}")


# --------------------------------------------------------------------------------------------------------------
# The quantized dot: custom_vjp over x (T, K), or per device over x (..., K), and w (K, N); one per (recipe, impl,
# split).
# --------------------------------------------------------------------------------------------------------------
def _token_split(recipe: str, lead: tuple[int, ...], w_shape: tuple[int, ...], w_axes: tuple[str | None, ...] | None
                 ) -> tuple[P, tuple[str, ...], tuple[int, tuple[str, ...]] | None] | None:
    """How an fp8 linear whose x has leading dims `lead` runs per device (module docstring): (the spec of x, the
    token axes in the order they stack the per-device residuals, where grad_w is reduced), or None: not an fp8
    recipe with weight operands, no multi-device mesh set outside shard_map, or the tokens not split evenly.

    Where grad_w is reduced: None (its per-device partials leave the shard_map stacked and are summed outside), or
    (dim, axes) when the weight's logical axes `w_axes` split it over mesh axes that all split the tokens too: each
    device then reduce-scatters its partial over those axes on that dim, and all-reduces its shard over the other
    token axes, inside the shard_map. Summed outside, XLA all-reduced whole weight gradients over data x fsdp.

    x (B, S, ..., K) is split as the model lays out its activations, the batch axes on B and the sequence's on S;
    rows (T, K) over all of them. Splitting the flattened (B * S) rows instead would make XLA re-lay out x under
    context parallelism (a device's rows are then not one block of them)."""
    if recipe not in PREQUANTIZED or not dev.partitioned_context():
        return None
    mesh = jax.sharding.get_abstract_mesh()
    tokens = sharding.token_axes()
    seq = tuple(a for a in tokens if a in sharding.rule_axes("seq"))
    dims = [tokens] if len(lead) == 1 else [tuple(a for a in tokens if a not in seq), seq] + [()] * (len(lead) - 2)
    if not tokens or any(n % math.prod(mesh.shape[a] for a in d) for n, d in zip(lead, dims)):
        return None
    reduce = None
    if w_axes is not None:
        w_spec = sharding.param_spec(w_axes, w_shape, mesh)
        live = [(d, tuple(a for a in sharding.entry_axes(e) if mesh.shape[a] > 1)) for d, e in enumerate(w_spec)]
        live = [(d, axes) for d, axes in live if axes]
        if len(live) == 1 and set(live[0][1]) <= set(tokens):
            reduce = live[0]
    return P(*(d or None for d in dims), None), tokens, reduce


@functools.lru_cache(maxsize=None)
def _make_linear2d(recipe_name: str, impl: str, x_dtype: jnp.dtype, w_dtype: jnp.dtype, reduce_dtype: jnp.dtype,
                   split: tuple[P, tuple[str, ...]] | None = None, fence: bool = False):
    """The custom_vjp linear: over x (T, K), or with `split` (_token_split) per device over x (..., K).

    Under bf16, x keeps its leading dims (..., K) too. Flattening (B, S, K) to rows, where S is split over a context
    axis and B > 1, leaves no row split that matches x's layout: XLA's partitioner then gathered x over the sequence,
    contracted each GEMM over its device's half of K (the weight's fsdp/context shard) and all-reduced the f32
    outputs, one all-reduce of activations per linear (benchmarks/RESULTS.md, session 36).

    The primal dtypes are static, not carried as residuals: a zero-size residual inside shard_map crashed Shardy on
    jax 0.11.2 (mx_jax/grouped_linear.py), and a linear can be called inside one (the MoE layer's)."""
    r = RECIPE_TABLE[recipe_name]
    x_out, _ = r.out
    g_gx, _ = r.grad_x
    x_gw, g_gw = r.grad_w
    p2 = r.pow2_scale
    # An operand used by two fp8 GEMMs with the same cast is quantized once for both layouts.
    x_dual = x_out.fp8 and x_out == x_gw
    g_dual = g_gx.fp8 and g_gx == g_gw

    def forward(x, w, ops: Operands | None = None):
        # x (T, K), w (K, N) -> y (T, N) in x.dtype, plus the residuals the backward GEMMs need. With `ops` (the
        # weight's operands made by `prequantize`), w only gives the gradient's shape and dtype.
        if x_out.fp8:
            if x_dual:
                x_op, x_res = _both(x, x_out, p2, impl)  # (x (T,K), xᵀ (K,T)): xᵀ waits for grad_w
                # Named like the linear outputs, so model.remat=save_matmuls keeps the fp8 copy (1 byte per element)
                # instead of recomputing x and casting it again in the backward (module docstring).
                x_res = checkpoint_name(x_res, "matmul")
            else:
                x_op, x_res = _rows(x, x_out, p2, impl), x
            if ops is None:
                ops = _weight_operands(w, r, impl)
            y = _gemm_fp8(x_op, ops.out, x.dtype, impl)
            w_res = ops.grad_x
        else:
            # Keep w's compute-dtype copy as the residual: the backward GEMM then reuses it instead of casting the
            # f32 master again (one convert of every weight per step saved, at the cost of holding the copy).
            w_c = w.astype(x.dtype)
            y, x_res, w_res = _dot_hp(x, w_c, ((x.ndim - 1,), (0,)), x.dtype, x.dtype), x, w_c
        return y, (x_res, w_res)

    def backward(res, g, gw_dtype, w_first: bool = False, gw_t: bool = False):
        # gw_t: return grad_w transposed, (N, K), for a caller that reduce-scatters it on w's dim 1.
        x_res, w_res = res
        # The primal dtypes ride on the residuals: a raw x/w, or an fp8 pair when it was pre-quantized.
        if g_dual:
            g_rows, g_cols_t = _both(g, g_gx, p2, impl)
        else:
            g_rows = _rows(g, g_gx, p2, impl) if g_gx.fp8 else None
            g_cols_t = _cols_t(g, g_gw, p2, impl) if g_gw.fp8 else None
        # grad_w (K, N) = xᵀ @ g: contraction over T; operands xᵀ (K, T) and gᵀ (N, T). Swapped, the same GEMM
        # writes grad_wᵀ (N, K).
        if x_gw.fp8:
            x_op = x_res if x_dual else _cols_t(x_res, x_gw, p2, impl)
            grad_w = _gemm_fp8(*((g_cols_t, x_op) if gw_t else (x_op, g_cols_t)), gw_dtype, impl)
        else:
            lead = tuple(range(g.ndim - 1))  # every token dim (x and g keep their leading dims under bf16)
            grad_w = _dot_hp(*((g, x_res) if gw_t else (x_res, g)), (lead, lead), gw_dtype, g.dtype)
        if w_first:
            # grad_w's GEMM before grad_x's, so that the caller's reduce-scatter of grad_w runs beside the grad_x
            # GEMM. Off the critical path, XLA placed the grad_w GEMM late, leaving its reduce-scatter less to run
            # beside (benchmarks/RESULTS.md, session 40: 5-9 ms less busy time per step on the whole 8B at fsdp=4).
            g_rows, g, grad_w = jax.lax.optimization_barrier((g_rows, g, grad_w))
        # grad_x (T, K) = g (T, N) @ wᵀ: contraction over N; w (K, N) is already K-major for it.
        if g_gx.fp8:
            grad_x = _gemm_fp8(g_rows, w_res, g.dtype, impl)  # w_res: w's grad_x operand (_weight_operands)
        else:
            grad_x = _dot_hp(g, w_res, ((g.ndim - 1,), (1,)), g.dtype, g.dtype)
        return grad_x, grad_w

    # Per device (_token_split): the GEMMs and activation casts run inside shard_map over the token axes, each
    # device on its own rows (x (..., K) keeps its leading dims, flattened inside) with the whole weight operands.
    # Residuals leave it stacked on a new leading axis (one entry per device: its xᵀ rows or x, and its own scales),
    # and so does grad_w (each device's partial sum over its tokens, summed outside in the reduce dtype: f32, or
    # model.grad_reduce_dtype where the tokens are split) unless it is reduced
    # inside (module docstring).
    def forward_per_device(x, w, ops):
        x_spec, axes, _ = split
        if ops is None:
            ops = _weight_operands(w, r, impl)

        def local(x, ops):
            y, (x_res, _) = forward(x.reshape(-1, x.shape[-1]), None, ops)
            return y.reshape(*x.shape[:-1], -1), jax.tree.map(lambda a: a[None], x_res)

        y, x_res = jax.shard_map(local, in_specs=(x_spec, P()), out_specs=(x_spec, P(axes)), check_vma=False)(x, ops)
        return y, (checkpoint_name(x_res, "matmul") if x_dual else x_res, ops.grad_x)

    def backward_per_device(res, g, gw_dtype):
        g_spec, axes, reduce = split

        def local(x_res, w_res, g):
            x_res = jax.tree.map(lambda a: a[0], x_res)
            g2 = g.reshape(-1, g.shape[-1])
            if reduce is None:
                grad_x, grad_w = backward((x_res, w_res), g2, gw_dtype)
                return grad_x.reshape(*g.shape[:-1], -1), grad_w[None]
            dim, w_mesh_axes = reduce
            # Scattered on dim 0 of the GEMM's output: where w is split on dim 1, the GEMM writes grad_wᵀ and only
            # the shard is transposed back, instead of XLA transposing the whole partial before the reduce-scatter.
            grad_x, grad_w = backward((x_res, w_res), g2, gw_dtype, w_first=True, gw_t=dim == 1)
            grad_w = jax.lax.psum_scatter(grad_w, w_mesh_axes, scatter_dimension=0, tiled=True)
            # Second fence: the reduce-scatter is done before anything downstream of grad_x runs. Without it XLA put
            # every grad_w GEMM at the end of the layer's backward and chained the reduce-scatters there, leaving the
            # last one to nothing (module docstring).
            grad_x, grad_w = jax.lax.optimization_barrier((grad_x, grad_w))
            others = tuple(a for a in axes if a not in w_mesh_axes)
            grad_w = jax.lax.psum(grad_w, others) if others else grad_w
            return grad_x.reshape(*g.shape[:-1], -1), grad_w.T if dim == 1 else grad_w

        if reduce is None:
            gw_spec = P(axes)
        else:
            gw_spec = P(*[reduce[1] if d == reduce[0] else None for d in range(2)])
        grad_x, grad_w = jax.shard_map(local, in_specs=(P(axes), P(), g_spec), out_specs=(g_spec, gw_spec),
                                       check_vma=False)(*res, g)
        return grad_x, grad_w.astype(gw_dtype) if reduce else grad_w.sum(0, dtype=gw_dtype)

    @jax.custom_vjp
    def linear2d(x, w, ops):
        return fwd(x, w, ops)[0]

    def fwd(x, w, ops):
        return forward(x, w, ops) if split is None else forward_per_device(x, w, ops)

    def bwd(res, g):
        g, gw_dtype = g.astype(x_dtype), _grad_w_dtype(w_dtype, reduce_dtype)
        grad_x, grad_w = (backward if split is None else backward_per_device)(res, g, gw_dtype)
        if fence:  # grad_w is done before anything downstream of grad_x runs (`linear`'s fence)
            grad_x, grad_w = jax.lax.optimization_barrier((grad_x, grad_w))
        return grad_x.astype(x_dtype), grad_w.astype(w_dtype), None  # the operands are not differentiated

    linear2d.defvjp(fwd, bwd)
    return linear2d


# A bf16 product of fewer rows than this (a decoding step) runs padded to FEW_ROWS rows (`_few_rows`).
FEW_ROWS = 8


def _few_rows(x: jax.Array, w: jax.Array, dot) -> jax.Array:
    """`dot` (the bf16 linear) of x's rows padded to FEW_ROWS, then x's rows of the result.

    Two rewrites of XLA's GPU compiler make a decoding step's products slow, and padding undoes both:
    - its algebraic simplifier turns a dot whose sizes multiply to fewer than 10^7 into a multiply-reduce fusion
      instead of a cuBLAS call: one token of a 2048-wide model streamed each weight at ~1.1 TB/s, against twice that
      as an 8-row GEMM (benchmarks/RESULTS.md, session 65);
    - its dot merger joins the products of one x (q, k and v; gate and up) into one GEMM by concatenating their
      weights, a copy of every weight per step. The padding rows hold w[0, 0], so each product's padded x is its
      own operand and nothing is merged. (An optimization barrier beside x did not stop the merger; one on w made
      XLA copy a scanned layer's weight slice.)
    The padding rows' outputs are dropped; their value never reaches the result or a gradient."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    x8 = jnp.pad(x.reshape(rows, k), ((0, FEW_ROWS - rows), (0, 0)), constant_values=w[0, 0].astype(x.dtype))
    return dot(x8, w)[:rows].reshape(*lead, w.shape[1])


def linear(x: jax.Array, w: jax.Array, *, recipe: str, impl: str = "auto",
           operands: Operands | None = None, w_axes: tuple[str | None, ...] | None = None,
           reduce_dtype="float32", fence: bool = False) -> jax.Array:
    """y = x @ w under `recipe`, differentiable in x and w (grads in x's and w's dtypes).

    x (..., K) in the compute dtype (bf16); w (K, N) the parameter (f32 master or bf16; quantized from it directly).
    Returns y (..., N) in x.dtype. impl ("auto" | "pallas" | "xla" | "reference") goes to the GEMM and cast
    dispatchers (pallas_kernels.fp8_matmul / quantize); "bf16" ignores it.

    operands: w's fp8 operands, made by `prequantize(w, recipe=recipe, impl=impl)` when the weight was last
    updated. w's values are then never read (it can be a zero "slot" that XLA never materializes): it only receives
    the weight gradient.

    w_axes: w's logical axes (mx_jax/sharding.py's RULES), for the per-device fp8 path under a mesh: its weight
    gradient is then reduced where w is split (`_token_split`).

    reduce_dtype: the dtype in which w's gradient is summed across the devices that split the tokens
    (`_grad_w_dtype`, model.grad_reduce_dtype).

    fence: the backward passes (grad_x, grad_w) through one optimization barrier, so that grad_w's GEMM runs before
    anything downstream of grad_x. For the output head (mx_jax/llama.py): nothing in the layers' backward needs its
    grad_w, and XLA had scheduled that GEMM after them, holding the V-wide logits gradient it reads throughout.
    The MX recipe's path (mx_linear) has no fence.
    """
    # MX (block-scaled, mx_jax/mx_format.py) recipes join RECIPES and branch off here, before the fp8 table.
    if recipe not in RECIPES:
        raise ValueError(f"linear: unknown recipe {recipe!r}; choose from {RECIPES}")
    if impl not in ("auto", "pallas", "xla", "reference"):
        raise ValueError(f"linear: impl must be 'auto', 'pallas', 'xla' or 'reference', got {impl!r}")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"linear: need x (..., K) and w (K, N), got x {x.shape} {x.dtype}, w {w.shape} {w.dtype}")
    if operands is not None:
        check_operands(operands, w, recipe, PREQUANTIZED, "linear")
    if recipe == "mxfp8":
        return mx_linear(x, w, impl=impl, reduce_dtype=reduce_dtype)
    lead = x.shape[:-1]
    split = _token_split(recipe, lead, w.shape, w_axes)
    make = functools.partial(_make_linear2d, recipe, impl, jnp.dtype(x.dtype), jnp.dtype(w.dtype),
                             jnp.dtype(reduce_dtype), fence=fence)
    if split is not None:  # per device: x keeps its leading dims, laid out as the model splits them
        return make(split)(x, w, operands)
    if recipe == "bf16" and math.prod(lead) < FEW_ROWS:
        return _few_rows(x, w, lambda x8, w: make()(x8, w, operands))
    if recipe == "bf16":  # XLA's dot over x's own dims (_make_linear2d)
        return make()(x, w, operands)
    y = make()(x.reshape(math.prod(lead), x.shape[-1]), w, operands)
    return y.reshape(*lead, w.shape[1])
