"""Expert-parallel dispatch and combine for MoE: flat, and rail-aligned hierarchical (the idea of PXN / DeepEP).

Called per device inside `shard_map` (moe.MoE). A device holds n tokens x (n,D) with top-k choices idx (n,k),
weights g (n,k) and a keep mask (capacity). The `expert` mesh axis has P devices; device p owns experts
[p E_l, (p+1) E_l), E_l = E/P. For the hierarchical path the axis is read as (node, local) with L = gpus_per_node
devices per node: p = node L + local, and GPU `local` of every node hangs off rail `local`.

Flat (one stage): every (token, expert) assignment is a row sent straight to the expert's device; the expert
device sorts its rows by local expert, runs the grouped-GEMM SwiGLU, and the reverse exchange brings each row's
output home, where y_t = sum_j g_tj out_tj.

Hierarchical (two stages, as DeepEP's normal kernels):
    1. rail stage: each token goes ONCE to every node that holds at least one of its experts, to the GPU with the
       same local index there (same rail: one hop, no spine), carrying its k expert ids and weights;
    2. node stage: that GPU forwards one row per (token, expert on this node) over NVLink to the expert's GPU;
    combine: the node-stage outputs return to the rail GPU, which forms the weighted partial sum over the token's
       experts on its node; one partial row per (token, node) travels back over the rail, and the source adds them.
    Cross-node rows per token = distinct destination nodes, against flat's expert copies on other nodes.

Exchanges move rows to peers inside a group of the expert axis (all of it, a rail, or a node):
    "dense"  each peer's chunk is padded to the same worst-case bound (`peer_bound`: min(k, E_l) rows per token,
             or the capacity's); the per-row metadata (expert ids, weights, validity) move packed in 32-bit words
             in one all-to-all (`moved_together`), then the hidden states in a second. Over the whole axis the
             all-to-all is pallas_kernels.all_to_all, an NVLink Mosaic-GPU kernel, where it applies, else
             lax.all_to_all. The kernel is given each chunk's row count (sent: the rows packed for that peer;
             received: the validity mask's count), so it copies only the rows that hold data and the padding
             arrives as zeros, as lax.all_to_all would move it; the combine's way back likewise. Chosen on CPU (XLA
             has no ragged all-to-all there) and, where "land" does not apply (the hierarchical stages, several
             processes), for groups of up to 8 GPUs, where it measured 4x faster than the ragged one on 4 x H200
             while it still moved P x the bytes. Sending only the rows took the flat
             dispatch+combine of 4,096 tokens per GPU from 2.78 to 1.86 ms (Mixtral's top-2 of 8) and from 4.05 to
             2.39 ms (DeepSeekMoE's top-6 of 64) on 4 x H200, and the 2-layer Mixtral fp8 step at expert=4 from
             198,600 to 208,000 tokens/s (benchmarks/RESULTS.md, session 44).
    "ragged" jax.lax.ragged_all_to_all moves only real rows; the receive buffer holds the same worst case from
             every peer, so nothing is ever dropped. Chosen for larger groups on GPU.
    "land"   (flat dispatch; "auto" chooses it where its kernel runs, one process holding the GPUs of the expert
             axis, on axes of up to LAND_MAX_PEERS = 4 devices, the sizes verified on GPUs so far) each
             (token, expert) row is pushed by pallas_kernels/row_exchange.py straight to its row of the expert
             device's buffer sorted by expert, and the padding there is zeroed in runs. `landing` plans it: one
             all_gather of every device's per-expert counts gives each group's start and each sender's offset in
             it, in the order ExpertFFN.run sorts a dense receive buffer into. The experts run on the buffer as it
             landed (`run_landed`), and each output row is pulled home into its (token,
             choice) slot. No send buffer, no sort or unsort gathers, no metadata exchange; the transposes swap
             push and pull. On 2 x H200 at expert=2, fp8_rowwise, two 4,096-token sequences per GPU (RESULTS.md,
             session 48): the 4-layer DeepSeekMoE step 190,229 -> 202,138 tokens/s (+6.3%; scatter/gather kernels
             5.16 -> 0.66 ms, the row kernels 7.0 ms against the dense exchange's 6.2), the 2-layer Mixtral step
             157,076 -> 160,645 (+2.3%). On 4 x H200 at expert=4, the DeepSeekMoE step 328,105 -> 372,216
             (+13.4%; session 50).
All have the same semantics; tests/test_moe.py checks flat == hierarchical == single device and land == dense
(outputs, gradients).

Sorting by expert (`ExpertFFN`) uses gathers only, forward and backward (`take_rows`, whose transpose is a gather by
the inverse permutation): XLA transposes a gather into a scatter-add with atomics on every element. Without expert
parallelism the rows are gathered straight from the n tokens (each read k times) instead of from a repeated copy.
On an H200 that took the Mixtral layer's fwd+bwd from 30.9 to 29.9 ms and DeepSeekMoE's from 5.65 to 5.05 ms (bf16).
Expert parallelism in bf16 (one row per assignment, no padding) once sorted by a gather and unsorted by a scatter,
written when the gathers-only form segfaulted jax 0.11.2's Shardy partitioner; the cause was an empty concatenation (see
`ExpertFFN.run`). On the worst-case receive buffers that form spent 15.5 ms a step in scatter/gather kernels at
DeepSeekMoE's shape, gathers only 11.4: they took the 4-layer DeepSeekMoE step at expert=4 (its experts bf16) from
193,100 to 208,000 tokens/s and the bf16 Mixtral step at expert=4 from 178,900 to 184,800 (4 x H200, session 44).
The exchanges fill their send buffers and bring the outputs home in row order the same way (`exchange`): each row's
slot in the (peers, bound) send buffer and each slot's row are one map and its inverse, so packing is one gather
from the tokens (a token is passed once, not repeated k times) and unpacking one gather, and their transposes are
gathers. Packing by a scatter, an argsort gather and a repeat (with scatter-adds as their transposes) spent 9.3 ms
of the 4-layer DeepSeekMoE step's 75.9 at expert=4 in scatter/gather kernels, 2.4 ms now; the step went from
204,737 to 236,042 tokens/s (+15%) and the 2-layer Mixtral step from 215,946 to 229,992 (+6.5%), fp8_rowwise,
4 x H100 (benchmarks/RESULTS.md, session 47).
Under fp8_rowwise every expert's rows are padded with zero rows to a multiple of 64, so that the grad-weight casts
read them in place (`ExpertFFN.align`).

Rematerialization: without expert parallelism the experts' three grouped-GEMM outputs are named "matmul", as every
dense linear's are, so model.remat=save_matmuls keeps them (`ExpertFFN.name_outputs`). Unnamed, the backward ran
all three forward GEMMs again: on one H200 with the configs' scanned layers, naming them (behind an optimization
barrier) took the 2-layer Mixtral step from 54,450 to 62,230 tokens/s in bf16 (59,444 to 62,989 in fp8_rowwise) and
the 4-layer DeepSeekMoE step from 106,678 to 112,893, for 1.0-1.3 GiB (benchmarks/RESULTS.md). With expert
parallelism they stay unnamed: there the GEMMs run on the receive buffer, padded to the worst routing (P peers x
min(k, E_l) rows per token: `peer_bound`), and keeping that per layer would cost up to P x the memory. The price is
that the backward recomputes the experts there (next paragraph), unless model.moe.ep_save_gate_up keeps the compact
buffer's gate and up outputs (the paragraph after it).

Two expert buffers (expert parallelism, model.moe.ep_buffer_factor = f > 0). A device receives n k rows on average
(n tokens x top-k per device, for its E/P experts) but its sorted buffer is sized for the worst routing, W = P x
peer_bound rows, W / (n k) = P min(k, E_l) / k: 4 at expert=4 for Mixtral and DeepSeekMoE, 8 for DeepSeekMoE at
expert=8. The grouped GEMMs write zeros past the data, and the SwiGLU, the fp8 casts and their amax run over all W
rows, forward and in the backward. So the experts run on a compact buffer of C = ceil(f n k) rows (plus the
padding's room, in 256-row tiles) on every device whose rows with data fit, with one row to spare (sum of the padded
group sizes < C), and on all W rows elsewhere: a per-device lax.cond with no collective inside, so devices may
differ, and nothing is ever dropped (the metric moe_ep_overflow_frac is the share of devices and layers that ran W).
Under "land" the rows are pushed into the compact buffer itself (`run_landed`): push, experts and pull run inside
the cond, so it takes one branch on every device, compact when every device's rows fit (`Landing.totals`, known to
all from the plan's all_gather) and whole otherwise. The step time is the slowest device's either way. No W-row
buffer is then zeroed, sliced or padded, and the cond keeps no W-row residual. On 2 x H200 at expert=2 with f =
1.5 (so that the cond runs) the 4-layer DeepSeekMoE step ran 196,157 tokens/s against 195,927 with the W-row landing
and a cond around the experts alone (RESULTS.md, session 49): at P = 2, W is only 1.33 C, and both ran below the
step without a cond (f = 2: 199,568), which pays the conditional's host sync and copies (benchmarks/JAX_NOTES.md).
The gain should grow with W / C = P min(k, E_l) / (f k), but has not been measured at P >= 4.
A plain lax.cond would not pay: its backward saves the union of both branches' residuals, so the compact branch
wrote zeros of the whole buffer's (W, F) activations (on 4 x H200 the DeepSeekMoE step ran 6% slower than with one
buffer). `_either` is a custom VJP whose backward is one cond: its branch recomputes the experts' forward and
transposes it, and the experts' combined output (n k, D) is saved under model.remat=save_matmuls, so the layer's
rematerialization does not run them a third time: the experts' forward runs twice per step, as before, and the
combine's exchange is no longer run again there. On 4 x H200 at expert=4, fp8_rowwise, 4,096 tokens per GPU, f = 2:
the 2-layer Mixtral step 215,800 -> 244,399 tokens/s (+13%, peak 21.06 -> 22.04 GiB), the 4-layer DeepSeekMoE step
230,700 -> 233,767 (+1.3%: its experts run bf16 there, so no row casts are saved, and they take a smaller share of
its step) (benchmarks/RESULTS.md, session 46). Under model.remat=none the experts' forward now runs twice where it
ran once, for none of the (W, F) activations kept.

Saving the gate and up outputs (model.moe.ep_save_gate_up; `_either`'s keep). The experts' forward that the backward
runs again is the gate and up GEMMs and what feeds them (XLA drops the down GEMM, whose output nothing reads). With
the option the compact branch's forward also returns g and u (C x 2F, the compact buffer's rows; zeros where a
device runs the whole buffer), named "matmul" so that save_matmuls keeps them, and its backward transposes the
SwiGLU and down GEMM at the saved g and u, and the gather or push and the gate and up GEMMs at their inputs: the
gate and up GEMMs' outputs are unused there, so XLA drops them (the row casts and the push still run, for the
grad-weight GEMMs). Per MoE layer and device that keeps 4 C F bytes more. On 4 x H200 at expert=4, fp8_rowwise,
two 4,096-token sequences per GPU (RESULTS.md, session 59): the 2-layer Mixtral step 327,602 -> 349,193 tokens/s
(+6.6%; peak 25.6 -> 31.2 GiB), the 4-layer DeepSeekMoE step 380,262 -> 386,880 (+1.7%; 18.0 -> 20.1 GiB), the
whole 28-layer DeepSeekMoE 16B 60,471 -> 61,592 (+1.9%; 84.2 -> 98.8 GiB). Off by default: at the whole Mixtral's
32 layers the saved outputs alone would be about 60 GB per GPU at that batch.

When the experts run fp8. Per expert with r rows, an fp8 recipe saves GEMM time ~ r K N and pays for casting
the rows ~ r (K + N) and the weights ~ K N (the experts' GEMMs have (K, N) = (D, F) and (F, D)). Per row, the row
casts take a share ~ c (1/D + 1/F) of the saving, the same for every r, and the weight casts are repaid once r
rows are left after that. So with R rows expected on a device for its E_l experts, `expert_recipe` runs fp8 iff

    R / E_l * (1 - c (1/D + 1/F)) >= min_rows          (quant.expert_min_rows; 0 = always fp8)

c = ROW_CAST_WIDTH = 565 and min_rows = 700 fit the whole-step crossovers measured with the experts in fp8
against bf16 (the rest fp8 either way; benchmarks/RESULTS.md, sessions 27-28). On one H100 both models break even
near 900 such rows: Mixtral (D 4096, F 14336: factor 0.82) 0.99x at 1,024 rows and 1.09x at 2,048; DeepSeekMoE
(D 2048, F 1408: factor 0.32) 0.92x at 768, 0.97x at 1,536, 1.01x at 3,072. On one H200 they break even sooner:
Mixtral 1.09x at 1,024 rows, DeepSeekMoE 1.00x at 1,536 and 1.03x at 3,072. 700 picks the faster side at all nine
points or loses at most 1% (Mixtral at 1,024 rows on the H100), where a threshold on rows alone lost 3% or 8%.
moe.MoE decides it in the trace; llama.plan_for_run decides it the same way for the weights' operands.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Callable

import jax
import jax.numpy as jnp

from mx_jax import grouped_linear
from mx_jax.layers import saved_output, swiglu
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import row_exchange
from pallas_kernels.all_to_all import all_to_all


ROW_MULTIPLE = 256
FP8_GROUP_ALIGN = 64  # the fp8 transposed cast's row tile: expert rows padded to it are cast in place


@jax.custom_vjp
def take_rows(x: jax.Array, src: jax.Array, back: jax.Array) -> jax.Array:
    """x[src]: rows of x (S, D) gathered by src (R,) int32, in range.

    `back` (S, f) int32 lists, for every row of x, the f output rows that read it (-1: none). The transpose is then
    a gather too: dx[s] = sum_j dout[back[s, j]], instead of the scatter-add XLA emits for a gather's transpose
    (atomics on every element). An output row that `back` does not list (padding that reads some row so that it
    holds finite values) must get a zero cotangent, as the grouped GEMMs give their padding rows."""
    return _take_rows_fwd(x, src, back)[0]


def _take_rows_fwd(x, src, back):
    return jnp.take(x, src, axis=0, mode="clip"), back


def _take_rows_bwd(back, dout):
    got = jnp.take(dout, jnp.clip(back, 0, dout.shape[0] - 1), axis=0, mode="clip")  # (S, f, D)
    dx = jnp.sum(jnp.where((back >= 0)[..., None], got.astype(jnp.float32), 0.0), axis=1).astype(dout.dtype)
    return dx, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _inverse(order: jax.Array) -> jax.Array:
    """The inverse of a permutation (int32): inverse[order[i]] = i (a 1-D int scatter, cheap beside the rows)."""
    return jnp.zeros(order.shape, jnp.int32).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))


def _room(rows: int, n_local: int, align: int) -> int:
    """Rows of a sorted expert buffer for `rows` assignments: room for every expert's padding to `align`, rounded
    up to the grouped-GEMM kernels' 256-row tiles (the tail outputs zero)."""
    n = rows + n_local * (align - 1)
    return n + -n % ROW_MULTIPLE


def _either(small_fits: jax.Array, small: Callable, large: Callable, diff: tuple, rest: tuple,
            keep: tuple[Callable, Callable, bool] | None = None) -> jax.Array:
    """small(diff, rest) where small_fits, else large(diff, rest): two ways to the same function, differentiable in
    the floating arrays `diff`. Neither may close over a traced array (a custom_vjp must not): `rest` carries them.

    A plain lax.cond would have its backward union both branches' residuals: the compact branch then writes zeros
    of the large branch's saved (rows, F) activations, and both are kept (on 4 x H200, the DeepSeekMoE step ran 6%
    slower than without the compact buffer). Here nothing inside is saved: the backward is one cond whose branch
    recomputes its forward and transposes it, as the rematerialized backward of expert parallelism did before.

    keep = (head, tail, scanned), with small(d, r) = tail(d, head(d, r), r): the forward also saves head's output
    where the small branch runs (zeros where the large one does), named like a GEMM output (`saved_output`), and
    the backward's small branch transposes tail at it and head at its inputs, so that head's forward does not run
    again (its output unused, XLA drops its GEMMs; module doc, "Two expert buffers")."""

    @jax.custom_vjp
    def f(diff, rest, small_fits):
        return jax.lax.cond(small_fits, small, large, diff, rest)

    def transposed(fn):
        return lambda diff, rest, ct: jax.vjp(lambda d: fn(d, rest), diff)[1](ct)[0]

    if keep is None:
        def fwd(diff, rest, small_fits):
            return f(diff, rest, small_fits), (diff, rest, small_fits)

        def bwd(res, ct):
            diff, rest, small_fits = res
            return jax.lax.cond(small_fits, transposed(small), transposed(large), diff, rest, ct), None, None

        f.defvjp(fwd, bwd)
        return f(diff, rest, small_fits)

    head, tail, scanned = keep
    mid_like = jax.eval_shape(head, diff, rest)

    def small_saving(diff, rest):
        mid = head(diff, rest)
        return tail(diff, mid, rest), mid

    def large_saving(diff, rest):
        return large(diff, rest), jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), mid_like)

    def fwd_keep(diff, rest, small_fits):
        y, mid = jax.lax.cond(small_fits, small_saving, large_saving, diff, rest)
        return y, (diff, rest, small_fits, saved_output(mid, scanned))

    def small_t(diff, rest, mid, ct):
        d_tail, d_mid = jax.vjp(lambda d, m: tail(d, m, rest), diff, mid)[1](ct)
        (d_head,) = jax.vjp(lambda d: head(d, rest), diff)[1](d_mid)
        return jax.tree.map(jnp.add, d_tail, d_head)

    def large_t(diff, rest, mid, ct):
        return transposed(large)(diff, rest, ct)

    def bwd_keep(res, ct):
        diff, rest, small_fits, mid = res
        return jax.lax.cond(small_fits, small_t, large_t, diff, rest, mid, ct), None, None

    f.defvjp(fwd_keep, bwd_keep)
    return f(diff, rest, small_fits)


ROW_CAST_WIDTH = 565  # c in the module doc: the row casts take all of fp8's GEMM saving where 1/D + 1/F = 1/c


def expert_recipe(recipe: str, rows: int, n_local: int, min_rows: int, dims: tuple[int, int]) -> str:
    """The recipe for `n_local` experts of dims (D, F) that expect `rows` rows between them: `recipe`, or bf16
    where the rows each expert keeps after the row casts fall short of `min_rows` (module doc), which logs a
    warning once per case."""
    keep = 1 - ROW_CAST_WIDTH * (1 / dims[0] + 1 / dims[1])
    if recipe == "bf16" or min_rows == 0 or rows / n_local * keep >= min_rows:
        return recipe
    _warn_bf16(recipe, rows, n_local, min_rows, tuple(dims), keep)
    return "bf16"


@functools.lru_cache(maxsize=None)
def _warn_bf16(recipe: str, rows: int, n_local: int, min_rows: int, dims: tuple[int, int], keep: float) -> None:
    logging.getLogger("mx_jax").warning(
        "MoE: the routed experts run bf16 instead of %s: %d rows for %d experts is %.0f rows each, and x %.2f (what "
        "the row casts leave of fp8's saving at D=%d, F=%d) %.0f, below quant.expert_min_rows=%d, where fp8's casts "
        "of the weights and rows cost more than its GEMMs save (quant.expert_min_rows=0 forces %s)",
        recipe, rows, n_local, rows / n_local, keep, *dims, rows / n_local * keep, min_rows, recipe)


@dataclasses.dataclass(frozen=True)
class ExpertFFN:
    """SwiGLU experts as grouped GEMMs. w_gate, w_up (E_l,D,F), w_down (E_l,F,D): this device's experts."""

    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    recipe: str
    impl: str
    group_align: int | None = None  # None: 64 for fp8_rowwise, 1 otherwise (see `align`)
    name_outputs: bool = False  # name the GEMM outputs for remat policies (module docstring: compact rows only)
    scanned: bool = False  # the layer runs inside lax.scan (`_saved`)
    # Under expert parallelism with a compact buffer: save the gate and up outputs for the backward (`_either`'s keep)
    keep_gate_up: bool = False
    # (gate, up, down) fp8 operands made at the update (quant.prequantize, batched); the weights are then slots
    operands: tuple | None = None

    @property
    def n_local(self) -> int:
        return self.w_gate.shape[0]

    @property
    def align(self) -> int:
        if self.group_align is not None:
            return self.group_align
        return FP8_GROUP_ALIGN if self.recipe == "fp8_rowwise" else 1

    def __call__(self, rows: jax.Array, local_expert: jax.Array, fan_out: int = 1) -> jax.Array:
        """Row a of the result is Expert_{local_expert[a]}(rows[a // fan_out]), zero where local_expert[a] = E_l
        (padding, dropped). rows (S, D), local_expert (S fan_out,) in [0, E_l] -> (S fan_out, D). See `run`."""
        return self.run(rows, local_expert, fan_out)[0]

    def run(self, rows: jax.Array, local_expert: jax.Array, fan_out: int = 1, compact: int = 0
            ) -> tuple[jax.Array, jax.Array | None]:
        """`__call__`, and whether the rows overflowed the compact buffer (a bool scalar; None where there is no
        compact buffer: `compact` is 0 or not smaller than the whole one).

        The rows are sorted by expert with gathers only (`take_rows`): in by source row, out by sorted position,
        and the backward likewise, so no (S fan_out, D) copy of the repeated rows and no scatter is ever made.
        With `align` > 1 each expert's rows are padded with zero rows to a multiple of it (at most align - 1 per
        expert), so that the fp8 grad-weight casts read every expert's rows in place (`grouped_linear`'s
        group_align); the padding rows compute zeros and get no gradient.

        `compact` > 0: the experts run on a sorted buffer of about that many rows (plus the padding's room) when
        the rows that hold data fit in it, else on the whole one (module doc, "Two expert buffers")."""
        e, a = self.n_local, self.align
        s, r = rows.shape[0], local_expert.shape[0]
        if r != s * fan_out:
            raise ValueError(f"ExpertFFN: {r} expert ids for {s} rows x fan_out {fan_out}")
        r_pad = _room(r, e, a)
        counts = jnp.bincount(local_expert, length=e + 1)[:e].astype(jnp.int32)
        sizes = counts + (-counts % a)  # a multiple of `a`, the excess zero rows
        # position of each assignment: its expert's (padded) start + its rank among that expert's assignments
        # (No zero-size piece: jax 0.11.2's Shardy partitioner segfaulted on the scanned layer's backward when a
        # concatenation here joined an empty array, whenever the rows needed no tail; RESULTS.md, session 34.)
        ids = local_expert if r_pad == r else jnp.concatenate(
            [local_expert, jnp.full((r_pad - r,), e, local_expert.dtype)])
        order = jnp.argsort(ids, stable=True).astype(jnp.int32)  # sorted -> assignment (>= r: the tail)
        rank = _inverse(order)[:r]
        shift = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes - counts)])  # padding before expert
        pos = rank + shift[local_expert]  # assignment -> row of the expert layout
        src = jnp.full((r_pad,), r, jnp.int32).at[pos].set(jnp.arange(r, dtype=jnp.int32))  # row -> assignment
        real = src < r
        # The row indices are materialized: fused into the (rows, D) gathers that read them, XLA computed them again
        # for every element (the padding's prefix sum, a signed division), which doubled the combine's time
        # (DeepSeekMoE fp8 layer on an H100, RESULTS.md).
        layout = jax.lax.optimization_barrier(
            (pos, jnp.where(real, src // fan_out, 0), jnp.where(real, src, -1), real, sizes))
        diff = (rows, self.w_gate, self.w_up, self.w_down)
        rest = (layout, self.operands)  # (everything the branches read goes in as an argument: see _either)
        small = _room(compact, e, a) if compact > 0 else r_pad
        if small >= r_pad:
            return self._sorted(r_pad, diff, rest), None
        fits = jnp.sum(sizes) < small  # (<: the compact buffer's last row is always padding, see _sorted)
        keep = self.split_for_keep(functools.partial(self._sorted_head, small),
                                   functools.partial(self._sorted_tail, small))
        y = _either(fits, functools.partial(self._sorted, small), functools.partial(self._sorted, r_pad), diff, rest,
                    keep)
        return y, ~fits

    def split_for_keep(self, head: Callable, tail: Callable) -> tuple[Callable, Callable, bool] | None:
        """`_either`'s keep for the compact buffer's experts, split as head (to the gate and up outputs) and tail."""
        return (head, tail, self.scanned) if self.keep_gate_up else None

    @property
    def params(self) -> tuple[jax.Array, ...]:
        """The differentiable weights (w_gate, w_up, w_down), as `with_params` takes them back."""
        return self.w_gate, self.w_up, self.w_down

    def with_params(self, params: tuple[jax.Array, ...], operands: tuple | None) -> ExpertFFN:
        return dataclasses.replace(self, w_gate=params[0], w_up=params[1], w_down=params[2], operands=operands)

    def _sorted(self, n_rows: int, diff: tuple, rest: tuple) -> jax.Array:
        """The experts on a sorted buffer of n_rows rows (all of them, or the compact buffer when the data fits)."""
        return self._sorted_tail(n_rows, diff, self._sorted_head(n_rows, diff, rest), rest)

    def _sorted_head(self, n_rows: int, diff: tuple, rest: tuple) -> tuple[jax.Array, jax.Array]:
        """`_sorted` up to the gate and up GEMMs' outputs."""
        rows, *params = diff
        (pos, src_row, src, real, sizes), operands = rest
        pos, src_row, src, real = self._clipped(n_rows, pos, src_row, src, real)
        xs = take_rows(rows, src_row, pos.reshape(rows.shape[0], -1))
        if self.align > 1:
            xs = jnp.where(real[:, None], xs, jnp.zeros((), xs.dtype))  # padding rows inside a group must be zero
        return self.with_params(tuple(params), operands).gate_up(xs, sizes, self.align)

    def _sorted_tail(self, n_rows: int, diff: tuple, gate_up: tuple, rest: tuple) -> jax.Array:
        """`_sorted` from the gate and up GEMMs' outputs: SwiGLU, the down GEMM, and the rows back in order."""
        params = diff[1:]
        (pos, src_row, src, real, sizes), operands = rest
        pos, src_row, src, real = self._clipped(n_rows, pos, src_row, src, real)
        ys = self.with_params(tuple(params), operands).down(*gate_up, sizes, self.align)
        return take_rows(ys, pos, src[:, None])

    @staticmethod
    def _clipped(n_rows: int, pos, src_row, src, real) -> tuple[jax.Array, ...]:
        """The layout's indices for a sorted buffer of n_rows rows."""
        if n_rows < src.shape[0]:
            # Assignments placed past the data (padding, dropped) read the compact buffer's last row instead, which
            # `fits` keeps padding: a zero output, and its cotangent dies in the grouped GEMMs' backward.
            pos = jnp.minimum(pos, n_rows - 1)
            src_row, src, real = src_row[:n_rows], src[:n_rows], real[:n_rows]
        return pos, src_row, src, real

    def _swiglu(self, xs: jax.Array, sizes: jax.Array, group_align: int = 1) -> jax.Array:
        """The experts on rows sorted by expert (group sizes `sizes`); zero past sum(sizes) (padding, dropped)."""
        return self.down(*self.gate_up(xs, sizes, group_align), sizes, group_align)

    def _gl(self, a: jax.Array, w, sizes: jax.Array, group_align: int, op) -> jax.Array:
        return grouped_linear.grouped_linear(a, w, sizes, recipe=self.recipe, impl=self.impl,
                                             group_align=group_align, operands=op)

    def gate_up(self, xs: jax.Array, sizes: jax.Array, group_align: int) -> tuple[jax.Array, jax.Array]:
        """The gate and up GEMMs' outputs (g, u) on rows sorted by expert, each expert's rows padded to group_align
        (the "land" exchange's buffers arrive so; zero past sum(sizes)). `down` finishes the experts."""
        # gate and up in one call: under fp8 the rows are cast once for both (forward and grad-weight)
        ops = None if self.operands is None else self.operands[:2]
        return self._saved(*self._gl(xs, (self.w_gate, self.w_up), sizes, group_align, ops))

    def down(self, g: jax.Array, u: jax.Array, sizes: jax.Array, group_align: int) -> jax.Array:
        """The experts' outputs from `gate_up`'s: SwiGLU and the down GEMM."""
        op = None if self.operands is None else self.operands[2]
        (y,) = self._saved(self._gl(swiglu(g, u).astype(g.dtype), self.w_down, sizes, group_align, op).astype(g.dtype))
        return y

    def _saved(self, *ys: jax.Array) -> tuple[jax.Array, ...]:
        """With `name_outputs`, the grouped GEMMs' outputs go through `layers.saved_output` like every dense
        linear's, so that model.remat=save_matmuls keeps them instead of running the forward GEMMs again in the
        backward. Named without its barrier, the scanned steps ran 2.5-2.8% slower than unnamed instead of faster
        (not profiled; for the dense gate|up GEMM the profile showed the GEMM running twice)."""
        return tuple(saved_output(ys, self.scanned)) if self.name_outputs else ys


# ---------------------------------------------------------------------------------------------------------------
# One exchange: rows to peers of a group, and the way back


@dataclasses.dataclass(frozen=True)
class Group:
    """Peers of one exchange inside the expert axis: `size` peers; `groups` as lax axis_index_groups (None = all)."""

    axis: str
    size: int
    groups: list[list[int]] | None = None


_VALID = "__valid"  # the dense exchange's validity mask rides with the payload
_OWN_EXCHANGE_BYTES = 256  # a floating payload with rows at least this wide (the hidden states) moves on its own
_WORD = jnp.uint32
_ALIGN_WORDS = 4  # a packed row is padded to 16 bytes (the NVLink kernel's bulk copies move multiples of 16 bytes)


def _to_words(v: jax.Array) -> jax.Array:
    """(P, A, ...) -> (P, A, m) uint32: 4-byte values bit for bit, narrower ones (and bool) widened to a word each."""
    v = v.reshape(v.shape[0], v.shape[1], -1)
    if v.dtype == jnp.bool_:
        return v.astype(_WORD)
    size = jnp.dtype(v.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(v, _WORD)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(v, jnp.dtype(f"uint{8 * size}")).astype(_WORD)
    raise NotImplementedError(f"dispatch: cannot pack a {v.dtype} payload into 32-bit words")


def _from_words(w: jax.Array, like: jax.Array) -> jax.Array:
    if like.dtype == jnp.bool_:
        return (w != 0).reshape(like.shape)
    size = jnp.dtype(like.dtype).itemsize
    if size < 4:
        w = w.astype(jnp.dtype(f"uint{8 * size}"))
    return jax.lax.bitcast_convert_type(w, like.dtype).reshape(like.shape)


def _pack_rows(arrays: dict[str, jax.Array]) -> jax.Array:
    """Small (P, A, ...) arrays -> one (P, A, W) uint32 array, their rows side by side, W padded to 16 bytes."""
    parts = [_to_words(arrays[k]) for k in sorted(arrays)]
    if pad := -sum(p.shape[-1] for p in parts) % _ALIGN_WORDS:
        parts.append(jnp.zeros(parts[0].shape[:2] + (pad,), _WORD))
    return jnp.concatenate(parts, axis=-1)


def _unpack_rows(buf: jax.Array, like: dict[str, jax.Array]) -> dict[str, jax.Array]:
    out, at = {}, 0
    for k in sorted(like):
        m = math.prod(like[k].shape[2:])
        out[k] = _from_words(buf[:, :, at:at + m], like[k])
        at += m
    return out


def _moved_packed(bufs: dict[str, jax.Array], a2a) -> dict[str, jax.Array]:
    @jax.custom_vjp
    def move(bufs):
        return _unpack_rows(a2a(_pack_rows(bufs)), bufs)

    def fwd(bufs):
        return move(bufs), None

    def bwd(_, cts):  # an all-to-all is its own transpose: the float cotangents travel the same way
        floats = {k: v for k, v in cts.items() if jnp.issubdtype(v.dtype, jnp.floating)}
        moved = _unpack_rows(a2a(_pack_rows(floats)), floats) if floats else {}
        return ({k: moved.get(k) for k in cts},)

    move.defvjp(fwd, bwd)
    return move(bufs)


def moved_together(bufs: dict[str, jax.Array], a2a: Callable[..., jax.Array], sent: jax.Array | None = None
                   ) -> tuple[dict[str, jax.Array], tuple[jax.Array, jax.Array] | None]:
    """a2a applied to every (P, A, ...) array of `bufs` in at most two exchanges: all the small per-row metadata
    (expert ids, weights, the validity mask) packed side by side in 32-bit words into one, then the wide floating
    payloads (the hidden states) each on their own. Each exchange is a launch and a synchronisation of every GPU of
    the axis; packing the hidden states too would cost a copy of them. Differentiable in the floating arrays.

    `sent` (P,) int32: the rows of each chunk that hold data (a prefix, as `exchange` packs them), with the validity
    mask in bufs[_VALID]. The mask's count per chunk is then what each peer sent here, and the wide payloads move
    only those rows (a2a(x, rows=(sent, received))). Returns the moved arrays and (sent, received), or None."""
    row_bytes = {k: math.prod(v.shape[2:]) * v.dtype.itemsize for k, v in bufs.items()}
    wide = {k for k, v in bufs.items() if jnp.issubdtype(v.dtype, jnp.floating) and row_bytes[k] >= _OWN_EXCHANGE_BYTES}
    small = {k: v for k, v in bufs.items() if k not in wide}
    out = _moved_packed(small, a2a) if small else {}
    if sent is None:
        return out | {k: a2a(bufs[k]) for k in wide}, None
    counts = (sent, jnp.sum(out[_VALID], axis=1, dtype=jnp.int32))
    return out | {k: a2a(bufs[k], rows=counts) for k in wide}, counts


def exchange(payload: dict[str, jax.Array], dest: jax.Array, group: Group, method: str, bound: int | None = None,
             a2a_impl: str = "auto") -> tuple[dict[str, jax.Array], jax.Array, Callable[[jax.Array], jax.Array]]:
    """Send row i of the exchange to peer dest[i] (dest == group.size: not sent).

    The exchange has R = dest.shape[0] rows. A payload array may hold R / f rows for a whole f: row i of the
    exchange then carries its row i // f (a token sent once per expert choice is passed once, not repeated).
    `bound` is the most rows any one peer can be sent (default: all of them, the worst case), so no row drops.
    Returns (received payloads (group.size * bound, ...), valid mask (group.size * bound,), back) where
    back(out (group.size * bound, D)) returns each received row's output to its sender, as (R, D) in the
    exchange's row order (zeros for rows that were not sent).

    The send buffers are filled and the outputs brought back in row order by gathers only, forward and backward
    (`_gathered`, module doc).
    """
    n = group.size
    rows_in = dest.shape[0]
    a = rows_in if bound is None else bound
    order = jnp.argsort(dest, stable=True).astype(jnp.int32)  # rows by peer, each peer's in row order
    sizes = jnp.bincount(dest, length=n + 1)[:n].astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    at = _inverse(order)  # row -> sorted position

    def a2a(x, split_axis=0, concat_axis=0, tiled=False, rows=None):
        if group.groups is None and not tiled:  # the whole axis: the NVLink kernel where it applies
            return all_to_all(x, group.axis, rows=rows, impl=a2a_impl)
        # (rows past `rows` are zeros in every buffer given here, so moving them all gives the same result)
        return jax.lax.all_to_all(x, group.axis, split_axis, concat_axis, tiled=tiled,
                                  axis_index_groups=group.groups)

    if method == "dense":
        # row -> slot p a + j of the (n, a) send buffer (-1: not sent), and slot -> row (-1: padding)
        rank = at - starts[jnp.minimum(dest, n - 1)]
        sent = (dest < n) & (rank < a)
        slot = jnp.where(sent, dest * a + rank, -1)
        j = jnp.arange(a, dtype=jnp.int32)
        held = j[None, :] < jnp.minimum(sizes, a)[:, None]  # (n, a): the slots that hold a row, a prefix per peer
        row = jnp.where(held, order[jnp.minimum(starts[:, None] + j[None, :], rows_in - 1)], -1).reshape(-1)
        bufs = {k: _gathered(v, row, slot, held.reshape(-1)).reshape((n, a) + v.shape[1:])
                for k, v in payload.items()} | {_VALID: held}
        # the hidden states move only the rows each peer is sent (the rest arrive as zeros, as packed)
        moved, counts = moved_together(bufs, a2a, sent=jnp.minimum(sizes, a))  # (sent to, received from) each peer
        recv = {k: moved[k].reshape((n * a,) + v.shape[1:]) for k, v in payload.items()}
        valid = moved[_VALID].reshape(n * a)

        def back(out):  # a row returns only where one arrived (the rest of `out` is zero: padding and dropped rows)
            ret = a2a(out.reshape((n, a) + out.shape[1:]), rows=counts[::-1])
            return _gathered(ret.reshape((n * a,) + out.shape[1:]), slot, row, sent)

        return recv, valid, back

    # ragged: offsets of my chunk in each peer's receive buffer come from an exchange of the sizes.
    sent = dest < n
    sorted_payload = {k: _gathered(v, order, at) for k, v in payload.items()}
    recv_sizes = a2a(sizes, tiled=True)
    recv_off = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    out_off = a2a(recv_off, tiled=True)
    in_off = starts.astype(jnp.int32)

    peer_in_off = a2a(in_off, tiled=True)  # where each sender's chunk for me sat in its send buffer
    there = (in_off, sizes, out_off, recv_sizes)  # (input offsets, send sizes, output offsets, receive sizes)
    home = (recv_off, recv_sizes, peer_in_off, sizes)  # the same exchange reversed

    def ragged(rows_out: int, rows_back: int) -> Callable:
        """x (rows_back, ...) moved `way` into a zero (rows_out, ...) buffer. Its transpose is the reverse exchange:
        JAX's own transpose of ragged_all_to_all ignores axis_index_groups (it all-to-alls the offsets over the
        whole axis), so the hierarchical rail stage could not be differentiated."""

        @jax.custom_vjp
        def move(x, way, reverse):
            return jax.lax.ragged_all_to_all(x, jnp.zeros((rows_out,) + x.shape[1:], x.dtype), *way,
                                             axis_name=group.axis, axis_index_groups=group.groups)

        def bwd(res, ct):
            way, reverse = res
            return ragged(rows_back, rows_out)(ct, reverse, way), None, None

        move.defvjp(lambda x, way, reverse: (move(x, way, reverse), (way, reverse)), bwd)
        return move

    recv = {k: ragged(n * a, rows_in)(v, there, home) for k, v in sorted_payload.items()}
    valid = jnp.arange(n * a) < jnp.sum(recv_sizes)

    def back(out):
        return _gathered(ragged(rows_in, n * a)(out, home, there), at, order, sent)

    return recv, valid, back


def _gathered(v: jax.Array, src: jax.Array, back: jax.Array, keep: jax.Array | None = None) -> jax.Array:
    """Row i of the result is v[src[i] // f] where keep[i] (None: everywhere), else zeros (src[i] is then ignored).
    src indexes a space of R = back.shape[0] rows of which v holds every f-th (f = R / v.shape[0]: a row repeated f
    times is passed once); `back` (R,) maps each of those rows to the result row that reads it (-1: none), the
    inverse of src. The transpose is then a gather too (`take_rows`); non-floating payloads carry no gradient and
    are gathered plainly."""
    f = back.shape[0] // v.shape[0]
    if f * v.shape[0] != back.shape[0]:
        raise ValueError(f"dispatch: a payload of {v.shape[0]} rows for an exchange of {back.shape[0]}")
    flat = v.reshape(v.shape[0], -1)
    src = src // f if keep is None else jnp.where(keep, src // f, 0)
    if jnp.issubdtype(v.dtype, jnp.floating):
        got = take_rows(flat, src, back.reshape(v.shape[0], f))
    else:
        got = jnp.take(flat, src, axis=0)
    if keep is not None:
        got = jnp.where(keep[:, None], got, jnp.zeros((), v.dtype))
    return got.reshape((src.shape[0],) + v.shape[1:])


# ---------------------------------------------------------------------------------------------------------------
# Landing: each row written straight to its place in the expert device's sorted buffer, and read back from there


@dataclasses.dataclass(frozen=True)
class Landing:
    """Where every assignment of this device goes (module doc, "land"), as the row kernels' work lists.

    out: this device's assignments (row i = token i // k, choice i % k), the live ones first, each to row `dst` of
    its expert device's sorted buffer; `zero` lists this device's buffer rows that no assignment fills (each
    expert's padding to `align`, and the tail). back: the same assignments read back from those rows into row i
    of an (n k, D) array; `zero` lists the assignments that are not live (dropped by capacity). sizes (E_l,): the
    padded group sizes of this device's buffer; got (E_l,): the rows that hold data in each; totals (P,): every
    device's sum of padded sizes, the rows its buffer needs (the same on every device)."""

    out: row_exchange.Items
    back: row_exchange.Items
    sizes: jax.Array
    got: jax.Array
    totals: jax.Array
    rows: int  # the sorted buffers' rows
    fan_out: int  # k

    def resized(self, rows: int) -> Landing:
        """The same plan into sorted buffers of `rows` rows (at least max(totals): the caller checks)."""
        if rows == self.rows:
            return self
        zero, n_chunks, n_zero = _buffer_padding(self.sizes, self.got, rows, self.out.chunk)
        out = dataclasses.replace(self.out, zero=zero, n_zero=n_zero, n_chunks=n_chunks)
        return dataclasses.replace(self, out=out, rows=rows)


jax.tree_util.register_dataclass(Landing, data_fields=["out", "back", "sizes", "got", "totals"],
                                 meta_fields=["rows", "fan_out"])


def _buffer_padding(sizes: jax.Array, got: jax.Array, rows: int, chunk: int) -> tuple[jax.Array, ...]:
    """`row_exchange.zero_work` for a sorted buffer of `rows` rows whose group e spans sizes[e] rows, the first
    got[e] of them data: its padding and its tail."""
    start = jnp.cumsum(sizes) - sizes
    r = jnp.arange(rows, dtype=jnp.int32)
    group = gm.searchsorted(start, r, side="right").astype(jnp.int32) - 1  # (of equal starts, the last)
    data = (r >= start[group]) & (r < start[group] + got[group])
    return row_exchange.zero_work(~data, chunk)


def landing(eid: jax.Array, axis: str, n_local: int, align: int, rows: int, row_bytes: int) -> Landing:
    """The plan for eid (n, k) (global expert ids, -1: dropped) over the P devices of `axis`, each owning n_local
    experts, into sorted buffers of `rows` rows of `row_bytes` bytes (which sets the zeroing stores' width). Every
    device learns how many rows every device sends to each expert (one all_gather of P x E ints); expert e's group
    on device q starts at the padded sizes of q's lower experts, and inside it sender s's rows follow those of
    senders < s, each sender's in row order: the order `ExpertFFN.run` sorts a dense receive buffer into."""
    n, k = eid.shape
    n_dev, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    n_exp = n_dev * n_local
    flat = eid.reshape(-1)
    live = flat >= 0
    ge = jnp.where(live, flat, n_exp)
    per = jnp.bincount(ge, length=n_exp + 1).astype(jnp.int32)
    sent = jax.lax.all_gather(per[:n_exp].reshape(n_dev, n_local), axis)  # (senders, devices, experts)
    got = jnp.sum(sent, axis=0)  # (devices, experts): rows each device receives per expert
    padded = got + (-got % align)
    start = jnp.cumsum(padded, axis=1) - padded  # each group's first row
    lower = (jnp.cumsum(sent, axis=0) - sent)[me]  # (devices, experts): rows lower senders put in my groups first
    rank = _inverse(jnp.argsort(ge, stable=True).astype(jnp.int32)) - (jnp.cumsum(per) - per)[ge]
    peer, e = jnp.minimum(ge // n_local, n_dev - 1), ge % n_local
    dst = (start + lower)[peer, e] + rank
    # the live assignments first, in row order (consecutive items go to different peers)
    order = jnp.argsort(~live, stable=True).astype(jnp.int32)
    n_live = jnp.sum(live, dtype=jnp.int32)
    chunk = row_exchange.zero_chunk(row_bytes)
    zero_out, chunks_out, n_zero_out = _buffer_padding(padded[me], got[me], rows, chunk)
    zero_back, chunks_back, n_zero_back = row_exchange.zero_work(~live, chunk)
    dst_o, peer_o = dst[order], peer[order]
    out = row_exchange.Items(order // k, peer_o, dst_o, n_live, zero_out, n_zero_out, chunks_out, chunk)
    back = row_exchange.Items(dst_o, peer_o, order, n_live, zero_back, n_zero_back, chunks_back, chunk)
    return Landing(out, back, padded[me], got[me], jnp.sum(padded, axis=1), rows, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def land(x: jax.Array, plan: Landing, axis: str, impl: str = "auto") -> jax.Array:
    """The tokens x (n, D) in the expert devices' sorted buffers (W, D); its transpose reads each assignment's
    cotangent back (`fetch`'s items) and sums the k of each token."""
    return row_exchange.move(x, plan.out, plan.rows, "push", axis, impl)


def _land_bwd(axis, impl, plan, ct):
    rows = row_exchange.move(ct, plan.back, plan.back.src.shape[0], "pull", axis, impl)  # (n k, D)
    dx = jnp.sum(rows.reshape(-1, plan.fan_out, rows.shape[-1]).astype(jnp.float32), axis=1).astype(ct.dtype)
    return dx, None


land.defvjp(lambda x, plan, axis, impl: (land(x, plan, axis, impl), plan), _land_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def fetch(ys: jax.Array, plan: Landing, axis: str, impl: str = "auto") -> jax.Array:
    """Each assignment's row of the expert devices' outputs ys (W, D), home as (n k, D) in row order (zero where
    not live); its transpose writes the cotangents back to those rows (`land`'s items, one row each)."""
    return row_exchange.move(ys, plan.back, plan.back.src.shape[0], "pull", axis, impl)


def _fetch_bwd(axis, impl, plan, ct):
    items = dataclasses.replace(plan.out, src=plan.back.dst)  # row i of ct, not token i // k
    return row_exchange.move(ct, items, plan.rows, "push", axis, impl), None


fetch.defvjp(lambda ys, plan, axis, impl: (fetch(ys, plan, axis, impl), plan), _fetch_bwd)


def run_landed(x: jax.Array, plan: Landing, ffn: ExpertFFN, axis: str, impl: str = "auto", whole: int = 0
               ) -> tuple[jax.Array, jax.Array | None]:
    """The experts on the "land" exchange: x (n, D) pushed into the sorted buffers of `plan`, the experts run there
    (`ExpertFFN.gate_up`, `down`), and each (token, choice)'s output pulled home as (n k, D). With `whole` >
    plan.rows, plan's buffers are the compact ones: every device uses them when every device's rows fit in them, and
    all use buffers of `whole` rows otherwise (module doc, "Two expert buffers"). Returns the outputs and whether the
    whole buffers ran (None where there is one size)."""

    def head(which: int, diff, rest):  # pushed, to the gate and up GEMMs' outputs
        (x, *params), (plans, operands) = diff, rest
        return ffn.with_params(tuple(params), operands).gate_up(land(x, plans[which], axis, impl),
                                                                 plans[which].sizes, ffn.align)

    def tail(which: int, diff, gate_up, rest):  # SwiGLU, the down GEMM, pulled home
        (_, *params), (plans, operands) = diff, rest
        ys = ffn.with_params(tuple(params), operands).down(*gate_up, plans[which].sizes, ffn.align)
        return fetch(ys, plans[which], axis, impl)

    def branch(which: int):
        return lambda diff, rest: tail(which, diff, head(which, diff, rest), rest)

    if whole <= plan.rows:
        return branch(0)((x, *ffn.params), ((plan,), ffn.operands)), None
    fits = jnp.max(plan.totals) <= plan.rows  # the same on every device: the pushes and pulls stay matched
    # (both plans made here, not in the branches: a conditional's kernels launch one by one after a host sync)
    rest = ((plan, plan.resized(whole)), ffn.operands)
    keep = ffn.split_for_keep(functools.partial(head, 0), functools.partial(tail, 0))
    return _either(fits, branch(0), branch(1), (x, *ffn.params), rest, keep), ~fits


# ---------------------------------------------------------------------------------------------------------------
# Flat and hierarchical dispatch + combine


# Measured on 4 x H200 (NVLink), 64 MB per GPU, dispatch+combine bus bandwidth: padded all_to_all ("dense") 49.7
# GB/s, ragged_all_to_all 12.0 GB/s even with XLA's decomposer (benchmarks/RESULTS.md). Padding to the worst case
# costs P x the bytes where lax.all_to_all moves it (the NVLink kernel sends only the rows that hold data), so the
# dense exchange wins inside a node and the ragged one is kept for large groups.
DENSE_MAX_PEERS = 8


EXCHANGES = ("auto", "dense", "ragged", "land")
# "auto" takes "land" only on expert axes this size or smaller, the sizes its kernel and tests have run on (2 and 4
# GPUs; no 8-GPU machine was lent yet). On 4 x H200 (expert=4) land took the 4-layer DeepSeekMoE step from 328,105 to
# 372,216 tokens/s and compiled in 75 s against the dense exchange's 87 (benchmarks/RESULTS.md, session 50).
LAND_MAX_PEERS = 4


def pick_exchange(method: str, n_peers: int, x: jax.Array | None = None, axis: str | None = None,
                  impl: str = "auto") -> str:
    """The exchange for `method` ("auto" or one of EXCHANGES). "land" is a flat dispatch's alone: given the tokens x
    and the expert axis, "auto" picks it where the row kernel runs, on up to LAND_MAX_PEERS devices (impl "xla" runs
    its reference anywhere, for tests); a stage of the hierarchical dispatch (no x) picks between "dense" and
    "ragged"."""
    if method not in EXCHANGES:
        raise ValueError(f"dispatch: exchange must be one of {EXCHANGES}, got {method!r}")
    if (x is not None and method == "auto" and impl != "xla" and n_peers <= LAND_MAX_PEERS
            and row_exchange.pallas_cover(x, axis) is None):
        return "land"
    if method != "auto":
        if method == "land" and x is None:
            raise ValueError("dispatch: exchange 'land' is for the flat dispatch (model.moe.dispatch=flat)")
        if method == "land" and impl == "auto" and (why := row_exchange.pallas_cover(x, axis)) is not None:
            _warn_land_reference(why)
        return method
    if jax.default_backend() != "gpu":
        return "dense"  # XLA:CPU has no ragged all-to-all
    return "dense" if n_peers <= DENSE_MAX_PEERS else "ragged"


@functools.lru_cache(maxsize=None)
def _warn_land_reference(why: str) -> None:
    logging.getLogger("mx_jax").warning(
        "MoE: model.moe.exchange=land, but its NVLink row kernel cannot run here (%s); land runs on its XLA "
        "reference, which moves P x the rows of the dense exchange (model.moe.exchange=auto picks the fastest that "
        "runs)", why)


def dispatch_combine(x: jax.Array, idx: jax.Array, g: jax.Array, keep: jax.Array, ffn: ExpertFFN, *,
                     axis: str | None, method: str = "flat", gpus_per_node: int = 8, exchange_method: str = "auto",
                     a2a_impl: str = "auto", capacity: int = 0, buffer_factor: float = 0.0
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """y (n,D) = sum_j g[:, j] * Expert_{idx[:, j]}(x) with experts spread over mesh axis `axis` (None: all local).

    `capacity` > 0: `keep` holds at most that many of this device's assignments per expert (moe.capacity_keep),
    which bounds the rows a peer can receive (`peer_bound`). `buffer_factor` > 0: with `axis`, the experts run on a
    compact buffer of that many times the rows a device receives on average when its rows fit (`compact_rows`;
    module doc, "Two expert buffers"). Also returns traffic: the rows this device sent for dispatch to devices on
    other nodes and to other devices of its own node (the combine sends the same numbers back), and "overflow",
    1.0 where this device received more rows than its compact buffer holds and ran the whole buffer.
    """
    n, k = idx.shape
    e_l = ffn.n_local
    eid = jnp.where(keep, idx, -1)  # (n,k); -1: dropped by capacity
    if axis is None:
        out = ffn(x, jnp.where(eid >= 0, eid, e_l).reshape(-1), fan_out=k)
        zero = jnp.zeros((), jnp.int32)
        return combine(out, g, x.dtype), {"rows_cross_node": zero, "rows_intra_node": zero,
                                          "overflow": jnp.zeros((), jnp.float32)}
    if method == "flat":
        out, traffic = _flat(x, eid, ffn, axis, gpus_per_node, exchange_method, a2a_impl, capacity, buffer_factor)
        return combine(out, g, x.dtype), traffic
    return _hierarchical(x, eid, g, ffn, axis, gpus_per_node, exchange_method, a2a_impl, capacity, buffer_factor)


def peer_bound(tokens: int, k: int, n_local: int, capacity: int = 0) -> int:
    """The most rows a device owning `n_local` experts can be sent by one peer with `tokens` tokens of k choices.

    A token's k choices are distinct experts, so at most min(k, n_local) of its rows go to one device; with a
    capacity, the peer keeps at most `capacity` rows per expert. Exact: a routing that reaches it exists (every
    token choosing this device's experts), so no row can drop. Mixtral on 8 devices (k = 2, one expert each) needs
    half the worst case that counts every row (tokens x k). With a capacity the saving is larger: the 2-layer
    Mixtral step with capacity_factor=1.25 on 4 H100s (expert=4) went from 171,600-171,900 to 209,400-215,900
    tokens/s, peak 20.9 -> 17.4 GiB (benchmarks/RESULTS.md)."""
    bound = tokens * min(k, n_local)
    return min(bound, n_local * capacity) if capacity > 0 else bound


def compact_rows(tokens: int, k: int, factor: float) -> int:
    """The compact expert buffer's rows under expert parallelism: `factor` x the tokens k rows a device receives
    on average (0: none). Nothing is dropped for it: a device that receives more runs the whole buffer."""
    return math.ceil(factor * tokens * k) if factor > 0 else 0


def combine(out: jax.Array, g: jax.Array, dtype) -> jax.Array:
    """out (n k, D) expert outputs per assignment, g (n,k) -> sum_j g_j out_j (n,D), accumulated in float32."""
    n, k = g.shape
    y = out.reshape(n, k, -1).astype(jnp.float32) * g[..., None].astype(jnp.float32)
    return jnp.sum(y, axis=1).astype(dtype)


def _node_layout(axis: str, gpus_per_node: int) -> tuple[int, int, jax.Array]:
    """(P devices on the expert axis, L of them per node, this device's node)."""
    p = jax.lax.axis_size(axis)
    l = min(gpus_per_node, p)
    if p % l:
        raise ValueError(f"mesh.expert={p} is not a multiple of model.moe.gpus_per_node={gpus_per_node}")
    return p, l, jax.lax.axis_index(axis) // l


def _home(out: jax.Array, overflow: jax.Array | None, scanned: bool) -> tuple[jax.Array, jax.Array]:
    """The experts' outputs back home, named for remat policies where they ran on two buffers (module doc, "Two
    expert buffers"), and the overflow flag (False where there was one buffer)."""
    if overflow is None:
        return out, jnp.zeros((), bool)
    return saved_output(out, scanned), overflow


def _flat(x, eid, ffn: ExpertFFN, axis: str, gpus_per_node: int, how: str, a2a_impl: str, capacity: int,
          buffer_factor: float):
    n_dev, l, my_node = _node_layout(axis, gpus_per_node)
    n, k = eid.shape
    e_l = ffn.n_local
    flat_e = eid.reshape(-1)
    dest = jnp.where(flat_e >= 0, flat_e // e_l, n_dev)
    bound = peer_bound(n, k, e_l, capacity)
    compact = compact_rows(n, k, buffer_factor)
    how = pick_exchange(how, n_dev, x, axis, a2a_impl)
    if how == "land":
        whole = _room(n_dev * bound, e_l, ffn.align)
        rows = min(whole, _room(compact, e_l, ffn.align)) if compact > 0 else whole
        plan = landing(eid, axis, e_l, ffn.align, rows, x.shape[1] * x.dtype.itemsize)
        out, overflow = _home(*run_landed(x, plan, ffn, axis, a2a_impl, whole), ffn.scanned)
    else:
        recv, valid, back = exchange({"x": x, "e": flat_e % e_l}, dest, Group(axis, n_dev),
                                     how, bound=bound, a2a_impl=a2a_impl)
        y, overflow = ffn.run(recv["x"], jnp.where(valid, recv["e"], e_l), compact=compact)
        out, overflow = _home(back(y), overflow, ffn.scanned)
    off_dev = (dest < n_dev) & (dest != jax.lax.axis_index(axis))
    cross = off_dev & (dest // l != my_node)
    traffic = {"rows_cross_node": jnp.sum(cross).astype(jnp.int32),
               "rows_intra_node": jnp.sum(off_dev & ~cross).astype(jnp.int32),
               "overflow": overflow.astype(jnp.float32)}
    return out, traffic


def _hierarchical(x, eid, g, ffn: ExpertFFN, axis: str, gpus_per_node: int, how: str, a2a_impl: str, capacity: int,
                  buffer_factor: float):
    n_dev, l, my_node = _node_layout(axis, gpus_per_node)
    n_nodes = n_dev // l
    n, k = eid.shape
    d = x.shape[1]
    e_l = ffn.n_local
    rail = Group(axis, n_nodes, [[nd * l + j for nd in range(n_nodes)] for j in range(l)])  # same local index
    node = Group(axis, l, [[nd * l + j for j in range(l)] for nd in range(n_nodes)])  # same node
    # Stage 1 (rail): one row per (token, destination node); rows to my own node stay on this device.
    node_of = jnp.where(eid >= 0, (eid // e_l) // l, n_nodes)  # (n,k)
    need = jnp.any(node_of[:, :, None] == jnp.arange(n_nodes)[None, None, :], axis=1)  # (n, N)
    dest1 = jnp.where(need, jnp.arange(n_nodes)[None, :], n_nodes).reshape(-1)  # row i = token i // N, node i % N
    payload1 = {"x": x, "e": eid, "g": g.astype(jnp.float32)}  # each row stands for its N rows (`exchange`)
    # (N n, ...): the tokens that need my node
    recv1, valid1, back1 = exchange(payload1, dest1, rail, pick_exchange(how, n_nodes), bound=n, a2a_impl=a2a_impl)
    # Stage 2 (node): one row per (received token, its expert on this node) to the expert's GPU.
    e2 = recv1["e"].reshape(-1)  # (N n k,)
    mine = jnp.repeat(valid1, k) & (e2 >= 0) & ((e2 // e_l) // l == my_node)
    dest2 = jnp.where(mine, (e2 // e_l) % l, l)
    # A node peer gets rows from my N rail sources' tokens, each source's within its own bound.
    bound2 = n_nodes * peer_bound(n, k, e_l, capacity)
    recv2, valid2, back2 = exchange({"x": recv1["x"], "e": e2 % e_l}, dest2, node,
                                    pick_exchange(how, l), bound=bound2, a2a_impl=a2a_impl)
    y2, overflow = ffn.run(recv2["x"], jnp.where(valid2, recv2["e"], e_l), compact=compact_rows(n, k, buffer_factor))
    out2, overflow = _home(back2(y2), overflow, ffn.scanned)  # (N n k, D); zero where not mine
    # Combine inside the node: the weighted partial sum over this token's experts here, then one row home.
    partial = jnp.sum(out2.reshape(-1, k, d).astype(jnp.float32) * recv1["g"][..., None], axis=1)
    parts = back1(partial)  # (n N, D) in row order
    y = jnp.sum(parts.reshape(n, n_nodes, d), axis=1).astype(x.dtype)
    me_local = jax.lax.axis_index(axis) % l
    traffic = {"rows_cross_node": jnp.sum((dest1 < n_nodes) & (dest1 != my_node)).astype(jnp.int32),
               "rows_intra_node": jnp.sum((dest2 < l) & (dest2 != me_local)).astype(jnp.int32),
               "overflow": overflow.astype(jnp.float32)}
    return y, traffic
