"""MXFP8 training recipe for a linear layer y = x @ w: all three GEMMs in MX, after TorchAO's MXFP8 training.

    out    y      = x  @ w        x (T, K), w (K, N)   contraction over K
    grad_x grad_x = g  @ wᵀ       g = dL/dy (T, N)     contraction over N
    grad_w grad_w = xᵀ @ g                             contraction over T

Every operand of every GEMM is MX-quantized (OCP MX v1.0: blocks of 32 along one axis, one E8M0 power-of-two scale
per block, e4m3 elements) along that GEMM's contraction axis, and handed to `pallas_kernels.mx_matmul` K-major:

| GEMM   | left operand, blocked along | right operand (stored K-major), blocked along | casts          |
|--------|-----------------------------|-----------------------------------------------|----------------|
| out    | x  (T, K)  along K          | wᵀ (N, K)  along K                            | x dim0, w dim1 |
| grad_x | g  (T, N)  along N          | w  (K, N)  along N                            | g dim0, w dim0 |
| grad_w | xᵀ (K, T)  along T          | gᵀ (N, T)  along T                            | x dim1, g dim1 |

A block scale is constant only inside its 32 elements along the contraction axis, so each GEMM needs its own
blocking: x, w and g are each cast twice, once per layout, by the dim01 cast kernel (`pallas_kernels/mx_quantize.py`:
dim0 along the last axis, dim1 along the first axis written transposed) from one read of the tensor. The forward
casts x and w both ways and keeps the backward layouts (x dim1, w dim0: 1.03 bytes per element) as residuals
instead of x itself.

Scale mode: "rceil" (NVIDIA's: the smallest power of two that keeps the block max <= 448, so nothing saturates),
element dtype float8_e4m3fn for x, w and g. Source: TorchAO torchao/prototype/moe_training/config.py,
`MXFP8TrainingConfig` (later `MXFP8TrainingOpConfig`): `scale_calculation_mode = ScaleCalculationMode.RCEIL` by
default and every MXFP8 training recipe (mxfp8_rceil, mxfp8_rceil_wgrad_with_hp, mxfp8_emulated_rceil) is RCEIL
("TODO: add floor variants"); `_to_mxfp8_then_scaled_mm` in torchao/prototype/mx_formats/mx_linear.py fixes e4m3
for input, weight and grad_output and block 32, and casts each operand along its GEMM's contraction dim (dim0 /
dim1 casts) exactly as in the table. (The older emulation config `MXLinearConfig` defaulted to FLOOR, the spec's
rule; TorchAO's training recipes moved to RCEIL.) Differences: grad_w comes out in w's dtype (f32 for f32 master
weights; summed across devices in `reduce_dtype` first where the tokens are split, as in mx_jax/quant.py) instead
of bf16, and a w in float32 is cast from float32 directly (the cast kernels read 16-bit inputs,
so that cast runs through XLA).

Shapes: K and N must be multiples of 32 (`mx_kernel_support`); T (the flattened leading dims of x) is zero-padded
to a multiple of 32 for the grad_w blocking (zero rows change no amax and add nothing to xᵀ g).

Public API: `mx_linear(x, w, *, impl, reduce_dtype)`, `mx_kernel_support(k, n)`, MODE, ELEM_DTYPE.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mx_jax import sharding

mxmm = importlib.import_module("pallas_kernels.mx_matmul")  # modules: tests intercept mxmm.mx_matmul
mxq = importlib.import_module("pallas_kernels.mx_quantize")

BLOCK = 32
MODE = "rceil"  # TorchAO MXFP8TrainingConfig.scale_calculation_mode default
ELEM_DTYPE = jnp.dtype(jnp.float8_e4m3fn)  # x, w and g
IMPLS = ("auto", "pallas", "xla", "reference")


def mx_kernel_support(k: int, n: int) -> str | None:
    """None when a (K, N) weight can run the mxfp8 recipe, else a short reason to keep it bf16.

    MX blocks need K and N to be multiples of 32 (out blocks along K, grad_x along N). Any such shape runs in MX:
    where the Pallas kernels do not tile it (they want multiples of 128), impl="auto" takes the XLA path.
    """
    if k % BLOCK or n % BLOCK:
        return f"MX blocks of {BLOCK} need K and N multiples of {BLOCK}, got K={k}, N={n}"
    return None


def _cast_impl(t: jax.Array, impl: str) -> str:
    """The cast kernels read bf16/f16; a float32 tensor (an f32 master weight) is cast by XLA even under "pallas"."""
    if impl == "pallas" and jnp.dtype(t.dtype) not in mxq.KERNEL_DTYPES:
        return "xla"
    return impl


def _dim01(t: jax.Array, impl: str):
    """t (R, C) -> ((elements (R, C), scales (R, C/32)): along C, (elements (C, R), scales (C, R/32)): along R)."""
    e0, s0, e1, s1 = mxq.mx_quantize_dim01(t, mode=MODE, elem_dtype=ELEM_DTYPE, impl=_cast_impl(t, impl))
    return (e0, s0), (e1, s1)


def _gemm(lhs, rhs_t, out_dtype, impl: str):
    """lhs (M, C) and rhs_t (N, C), each (elements, scales) blocked along C -> (M, N) in out_dtype."""
    (a, sa), (b, sb) = lhs, rhs_t
    return mxmm.mx_matmul(a, b, sa, sb, out_dtype=out_dtype, impl=impl)


@functools.lru_cache(maxsize=None)
def _make_linear2d(impl: str, x_dtype: jnp.dtype, w_dtype: jnp.dtype, reduce_dtype: jnp.dtype):
    # The primal dtypes are static (mx_jax/quant.py's _make_linear2d says why).
    def forward(x, w):
        # x (T, K), w (K, N); T a multiple of 32
        x_k, x_t = _dim01(x, impl)  # x along K (T, K); xᵀ along T (K, T): for grad_w
        w_n, w_k = _dim01(w, impl)  # w along N (K, N): for grad_x; wᵀ along K (N, K)
        y = _gemm(x_k, w_k, x.dtype, impl)  # (T, N)
        # xᵀ is named like the linear outputs, so model.remat=save_matmuls keeps it (mx_jax/quant.py, docstring).
        return y, (checkpoint_name(x_t, "matmul"), w_n)

    def backward(res, g):
        x_t, w_n = res
        g_n, g_t = _dim01(g, impl)  # g along N (T, N); gᵀ along T (N, T)
        grad_x = _gemm(g_n, w_n, g.dtype, impl)  # (T, K): contraction over N
        gw_dtype = reduce_dtype if sharding.tokens_split() else jnp.float32  # the dtype of the sum across devices
        grad_w = _gemm(x_t, g_t, gw_dtype, impl)  # (K, N): contraction over T
        return grad_x, grad_w

    @jax.custom_vjp
    def linear2d(x, w):
        return forward(x, w)[0]

    def bwd(res, g):
        grad_x, grad_w = backward(res, g.astype(x_dtype))
        return grad_x.astype(x_dtype), grad_w.astype(w_dtype)

    linear2d.defvjp(forward, bwd)
    return linear2d


def mx_linear(x: jax.Array, w: jax.Array, *, impl: str = "auto", reduce_dtype="float32") -> jax.Array:
    """y = x @ w with all three GEMMs in MXFP8 (e4m3, rceil, blocks of 32), differentiable in x and w.

    x (..., K) in the compute dtype (bf16); w (K, N) the parameter (f32 master or bf16). Returns y (..., N) in
    x.dtype; grads come back in x's and w's dtypes. impl ("auto" | "pallas" | "xla" | "reference") goes to the
    cast dispatchers (pallas_kernels.mx_quantize) and the GEMM dispatcher (pallas_kernels.mx_matmul).
    reduce_dtype: the dtype in which w's gradient is summed across the devices that split the tokens.
    """
    if impl not in IMPLS:
        raise ValueError(f"mx_linear: impl must be one of {IMPLS}, got {impl!r}")
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"mx_linear: need x (..., K) and w (K, N), got x {x.shape} {x.dtype}, w {w.shape} {w.dtype}")
    for name, t in (("x", x), ("w", w)):
        if not jnp.issubdtype(t.dtype, jnp.floating) or jnp.dtype(t.dtype).itemsize < 2:
            raise ValueError(f"mx_linear: `{name}` must be bf16/f16/f32, got shape {t.shape} dtype {t.dtype}")
    if (reason := mx_kernel_support(*w.shape)) is not None:
        raise ValueError(f"mx_linear: {reason} (x {x.shape}, w {w.shape})")
    lead = x.shape[:-1]
    t = math.prod(lead)
    x2 = x.reshape(t, x.shape[-1])
    pad = -t % BLOCK  # grad_w blocks along T
    if pad:
        x2 = jnp.pad(x2, ((0, pad), (0, 0)))
    y = _make_linear2d(impl, jnp.dtype(x.dtype), jnp.dtype(w.dtype), jnp.dtype(reduce_dtype))(x2, w)[:t]
    return y.reshape(*lead, w.shape[1])
