"""Sparse mixture-of-experts feed-forward: router, top-k, balancing, and SwiGLU experts on a grouped GEMM.

For N tokens x (N,D), E routed experts of hidden width F, top-k:
    logits = x W_r (N,E), in float32
    s      = softmax(logits) or sigmoid(logits)                          (Mixtral / DeepSeek-V3)
    idx    = top-k over (s + b) per token; b is the balancing bias, used for the choice only (DeepSeek-V3 §2.1.2)
             With route_groups G (group-limited routing, DeepSeek-V3's node-limited): the E experts form G groups
             of E/G consecutive ids; a group's score is the sum of its top route_group_top values of s + b, by
             default max(1, floor(k/M)) (2 of 8 experts on 4 nodes in DeepSeek-V3; 1, the group's best, in
             DeepSeek-V2), the token keeps its M = route_top_groups best groups, and the top-k runs over their
             experts only (the others at -inf).
             Experts lie on the expert axis in id order, so with G = its nodes a token reaches at most M nodes.
    g      = s[idx], divided by its row sum when normalize_top_k, times routed_scale (DeepSeek-V3: 2.5)
    y      = sum_j g_j Expert_{idx_j}(x) + sum_shared Expert_shared(x)  (DeepSeekMoE shared experts)
    Expert(x) = (silu(x W_gate) * (x W_up)) W_down, run for all experts at once as a grouped GEMM over the tokens
    sorted by expert (mx_jax.grouped_linear: Pallas on Hopper, jax.lax.ragged_dot_general elsewhere). Under fp8_rowwise
    the experts run fp8 where they get enough rows each for their dims (quant.expert_min_rows), else bf16
    (dispatch.expert_recipe).

Balancing, each optional:
    aux loss   coef * E * sum_e f_e P_e,  f_e = share of the N k assignments that chose e, P_e = mean_n s[n,e]
               (Switch Transformer eq. 4; Mixtral); f carries no gradient and counts choices before any capacity
               drop. With softmax scores it is 1 at perfect balance (Hugging Face's Mixtral loss is k there: its
               coefficient acts k times stronger); sigmoid scores do not sum to 1, so there it is sum_e P_e.
               aux_loss_scope=sequence (DeepSeek-V3's sequence-wise loss, eqs. 17-20): for each sequence j of T
               tokens, E sum_e f_je P_je with f_je the share of its T k assignments that chose e and P_je the mean
               over its tokens of s'[t,e] = s[t,e] / sum_e' s[t,e'], then the mean over the sequences; 1 at
               balance whatever the scores. Under context parallelism a sequence's sums run over the context axis.
    bias       after each step b_e += rate * sign(mean load - load_e)  (DeepSeek-V3 auxiliary-loss-free balancing),
               applied by the train step outside the gradient; b is a RouterBias variable, not a parameter.
    z-loss     coef * mean_n logsumexp(logits_n)^2                       (ST-MoE eq. 5)
Capacity: dropless by default. With capacity_factor c > 0, each expert keeps at most ceil(c N k / E) of each
device's assignments (in token order) and the rest are dropped (weight 0), as in GShard.

Decoding (`MoE.decode`): a step of a few tokens reads each assignment's expert weights by index
(pallas_kernels.indexed_matmul) instead of sorting rows for the grouped GEMM; same values, fewer kernels.

Decoding over several devices (`hidden_split`, for a model one device cannot hold: `sample --devices`): each of P
devices holds every expert's columns F_p of W_gate and W_up and rows F_p of W_down (F/P of the hidden width), and
runs the whole layer on every token for its slice, in shard_map over the split's one axis:
    y = sum_p sum_j g_j (silu(x W_gate[:, F_p]) * (x W_up[:, F_p])) W_down[F_p, :]
the sum over p an all-reduce in float32 of the partial outputs (N D 4 bytes per layer; by index they stay float32,
through the grouped GEMM they come rounded to the activations' dtype). Routing runs on every device on
the same tokens, so all choose the same experts; a device reads 1/P of each chosen expert per token, whatever the
routing (splitting the experts themselves over the devices would leave the devices of unchosen experts idle).

Expert parallelism: the layer body runs per device inside `shard_map` over the whole mesh (routing and sorting
are local), and the rows for experts on other devices travel through mx_jax.dispatch over the `expert` axis.
Statistics (f, P, loads, z-loss) are summed over every mesh axis, so losses and gradients do not depend on the
mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from mx_jax import dispatch, sharding
from mx_jax.config import ModelConfig
from mx_jax.layers import SwiGLU, _param, weight_and_operands
from pallas_kernels import device, indexed_matmul


# MoE.decode reads experts by index (MoE._by_index_impl): with pallas_kernels.indexed_matmul's kernels while the
# weights read again for experts chosen twice stay under BY_INDEX_REREAD_BYTES (the grouped GEMM's fixed cost of
# ~150 us per layer at ~4 TB/s); through XLA where the expert matrices have at most BY_INDEX_ELEMENTS elements
# (d_model x d_expert: DeepSeekMoE 16B's 2.9 M yes, DeepSeek-V3's 14.7 M and Mixtral's 58.7 M no). Measured, see
# MoE.decode.
BY_INDEX_REREAD_BYTES = 600e6
BY_INDEX_ELEMENTS = 1 << 22
STATS = ("aux_loss", "z_loss", "load", "dropped", "rows_cross_node", "rows_intra_node", "ep_overflow")


_HIDDEN_SPLIT: contextvars.ContextVar = contextvars.ContextVar("mx_jax_moe_hidden_split", default=None)


@contextlib.contextmanager
def hidden_split(mesh: jax.sharding.Mesh):
    """Inside: every MoE layer traced splits its routed experts' hidden width over the devices of `mesh` (one axis;
    module docstring, "Decoding over several devices"). Its expert weights must be laid out so: W_gate and W_up
    (..., E, D, F) split along F, W_down (..., E, F, D) along its F (sample.tensor_parallel)."""
    if len(mesh.axis_names) != 1:
        raise ValueError(f"hidden_split: a mesh of one axis, got axes {mesh.axis_names}")
    token = _HIDDEN_SPLIT.set(mesh)
    try:
        yield
    finally:
        _HIDDEN_SPLIT.reset(token)


class RouterBias(nnx.Variable):
    """The per-expert selection bias of auxiliary-loss-free balancing; updated by the train step, not the optimizer."""


def group_score_experts(top_k: int, n_experts: int, groups: int, top_groups: int, group_top: int = 0) -> int:
    """How many of a group's best scores its score sums under group-limited routing (module docstring)."""
    return min(group_top or max(1, top_k // top_groups), n_experts // groups)


def route(logits: jax.Array, bias: jax.Array, top_k: int, score: str, normalize: bool, groups: int = 0,
          top_groups: int = 0, scale: float = 1.0, group_top: int = 0):
    """logits (N,E) f32 -> (scores (N,E), top-k expert ids (N,k) int32, top-k weights (N,k) f32). `groups`,
    `top_groups`, `group_top`: group-limited routing (module docstring; 0 = off); `scale`: routed_scale."""
    s = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    choice = jax.lax.stop_gradient(s) + bias[None, :]
    if groups:
        n, e = choice.shape
        per = choice.reshape(n, groups, e // groups)
        best_of = group_score_experts(top_k, e, groups, top_groups, group_top)
        group_score = jnp.sum(jax.lax.top_k(per, best_of)[0], axis=-1)
        _, best = jax.lax.top_k(group_score, top_groups)  # (N, M)
        kept = jnp.any(best[:, :, None] == jnp.arange(groups)[None, None, :], axis=1)  # (N, G)
        choice = jnp.where(jnp.repeat(kept, e // groups, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, top_k)
    g = jnp.take_along_axis(s, idx, axis=-1)
    if normalize:
        g = g / jnp.sum(g, axis=-1, keepdims=True)
    return s, idx.astype(jnp.int32), g * scale if scale != 1.0 else g


def capacity_keep(idx: jax.Array, n_experts: int, capacity: int) -> jax.Array:
    """(N,k) bool: assignment kept when fewer than `capacity` earlier assignments (token-major order) chose its expert."""
    flat = idx.reshape(-1)
    onehot = jax.nn.one_hot(flat, n_experts, dtype=jnp.int32)
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - onehot, flat[:, None], axis=1)[:, 0]
    return (rank < capacity).reshape(idx.shape)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, recipe: str, impl: str, shared_recipes: dict[str, str], *,
                 min_rows: int = 0, rngs: nnx.Rngs):
        m = cfg.moe
        d, e = cfg.d_model, m.n_experts
        f = m.d_expert or cfg.d_ff
        pd = jnp.dtype(cfg.param_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.router = _param(rngs, (d, e), cfg.init_std, ("embed", "router"), pd)
        self.w_gate = _param(rngs, (e, d, f), cfg.init_std, ("expert", None, "expert_mlp"), pd)
        self.w_up = _param(rngs, (e, d, f), cfg.init_std, ("expert", None, "expert_mlp"), pd)
        self.w_down = _param(rngs, (e, f, d), out_std, ("expert", "expert_mlp", None), pd)
        self.bias = RouterBias(jnp.zeros((e,), jnp.float32), logical_axes=("router",))
        self.shared = SwiGLU(cfg, m.n_shared * f, shared_recipes, impl, rngs=rngs) if m.n_shared else None
        self.cfg, self.recipe, self.impl, self.scanned = m, recipe, impl, cfg.scan_layers
        self.min_rows = min_rows  # quant.expert_min_rows: fewer rows per expert run the experts in bf16
        self.expert_dims = (d, f)  # with min_rows, decides whether the experts run fp8 (dispatch.expert_recipe)

    def __call__(self, x: jax.Array, fused: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x (B,T,D) -> (y (B,T,D), stats). stats: aux_loss, z_loss (scalars), load (E,) the router's choices
        per expert (before capacity drops), dropped. fused: the shared experts' gate and up as one GEMM
        (layers.SwiGLU)."""
        # The expert weights, or in the train step their gradient slots and fp8 operands (llama.with_operands).
        (w_gate, ops_gate), (w_up, ops_up), (w_down, ops_down) = (
            weight_and_operands(w) for w in (self.w_gate, self.w_up, self.w_down))
        ops = None if ops_gate is None else (ops_gate, ops_up, ops_down)
        weights = (self.router[...], self.bias[...], w_gate, w_up, w_down, ops)
        mesh = jax.sharding.get_abstract_mesh()
        split = _HIDDEN_SPLIT.get()
        if split is not None:
            if ops is not None:
                raise ValueError("MoE: hidden_split decodes; the train step's fp8 operands do not split")
            y, stats = self._split(split, lambda x, *w: self._local(x, *w, None, axes=()), x, *weights[:5])
        elif mesh.empty:
            y, stats = self._local(x, *weights, axes=())
        else:
            batch = tuple(a for a in sharding.batch_axes() if a in mesh.axis_names)
            x_spec = P(batch, "context", None)
            w_spec = P("expert", None, None)
            ops_spec = jax.tree.map(lambda a: P("expert"), ops)
            body = jax.shard_map(
                lambda *args: self._local(*args, axes=tuple(mesh.axis_names)), mesh=mesh,
                in_specs=(x_spec, P(), P(), w_spec, w_spec, w_spec, ops_spec),
                out_specs=(x_spec, {k: P() for k in STATS}),
                check_vma=False)
            y, stats = body(x, *weights)
        if self.shared is not None:
            y = y + self.shared(x, fused)
        return y, stats

    def decode(self, x: jax.Array) -> jax.Array:
        """x (B,T,D) -> y (B,T,D): `__call__`'s output without its statistics, for a decoding step.

        A step of B T k assignments, no more than the experts, can read each assignment's expert weights by index
        (`_by_index`, pallas_kernels.indexed_matmul) instead of sorting rows into the grouped GEMM, whose bookkeeping
        (sort, row layout, tile lists) costs ~150 us per layer whatever the rows. Where the Mosaic-GPU kernels run
        (a Hopper GPU, 16-bit weights), it does so while the weights it reads again, for experts that uniform
        routing would choose twice, stay under BY_INDEX_REREAD_BYTES: Mixtral's experts for 1-2 tokens but not 4
        (measured: 8 layers at B = 4, 3.58 ms per step on the grouped GEMM, 3.73 by index). Elsewhere XLA runs the
        gathered products as multiply-reduce fusions at 0.4-1.7 TB/s, so only matrices of at most
        BY_INDEX_ELEMENTS elements go by index. Per layer on an H200, routed experts alone (RESULTS.md, sessions
        64-65): DeepSeekMoE 16B (2048 x 1408), 1 token, 200 us grouped, 71 us through XLA, 54 us on the kernels
        (gate and up 31, down 23, loop overhead included); Mixtral (4096 x 14336), 1 token, 308 us grouped, 248
        on the kernels.
        The same values as `__call__` (capacity drops included) on one device or under `hidden_split`; elsewhere,
        or under another recipe, `__call__` runs."""
        b, t, d = x.shape
        split = _HIDDEN_SPLIT.get()
        impl = self._by_index_impl(b * t, x.dtype, 1 if split is None else split.size)
        if impl is None:
            return self(x, fused=False)[0]
        weights = (self.router[...], self.bias[...], self.w_gate[...], self.w_up[...], self.w_down[...])
        xt = x.reshape(b * t, d)
        if split is None:
            y = self._by_index(xt, *weights, impl, x.dtype)
        else:
            y, _ = self._split(split, lambda xt, *w: (self._by_index(xt, *w, impl, jnp.float32), {}), xt, *weights)
        y = y.astype(x.dtype).reshape(b, t, d)
        if self.shared is not None:
            y = y + self.shared(x, False)
        return y

    def _by_index_impl(self, tokens: int, dtype, parts: int = 1) -> str | None:
        """`decode`'s choice for a step of `tokens` tokens in `dtype`, each device holding 1/`parts` of every
        expert's hidden width (`hidden_split`): None (the grouped GEMM), or the impl of
        pallas_kernels.indexed_matmul that reads the experts by index ("pallas": its kernels, "xla")."""
        m = self.cfg
        mesh = jax.sharding.get_abstract_mesh()
        assignments = tokens * m.top_k
        if self.recipe != "bf16" or assignments > m.n_experts or not (mesh.empty or mesh.size == 1):
            return None
        e, d, f = self.w_gate.shape[-3:]
        weights = (jax.ShapeDtypeStruct((e, d, f // parts), self.w_gate.dtype),) * 2
        x = jax.ShapeDtypeStruct((assignments, d), dtype)
        elements = math.prod(self.expert_dims) // parts  # of one expert matrix on one device
        if self.impl == "pallas" or (self.impl == "auto" and device.kernels_apply()
                                     and indexed_matmul.pick(x, weights)[1] is None):
            # experts that a uniform router would choose for the step: the grouped GEMM reads each of them once
            chosen = m.n_experts * (1 - (1 - m.top_k / m.n_experts) ** tokens)
            rereads = (assignments - chosen) * 3 * elements * jnp.dtype(self.w_gate.dtype).itemsize
            return "pallas" if rereads <= BY_INDEX_REREAD_BYTES else None
        return "xla" if elements <= BY_INDEX_ELEMENTS else None

    def _routed(self, xt: jax.Array, w_router: jax.Array, bias: jax.Array):
        """Tokens xt (n,D) routed: (logits (n,E) f32, scores (n,E), expert ids (n,k), weights (n,k) with the
        capacity's drops zeroed, keep (n,k), the capacity (0: dropless))."""
        m = self.cfg
        logits = jnp.dot(xt.astype(jnp.float32), w_router.astype(jnp.float32))
        s, idx, g = route(logits, bias, m.top_k, m.score, m.normalize_top_k, m.route_groups, m.route_top_groups,
                          m.routed_scale, m.route_group_top)
        keep = jnp.ones(idx.shape, bool)
        n = xt.shape[0]
        capacity = math.ceil(m.capacity_factor * n * m.top_k / m.n_experts) if m.capacity_factor > 0 else 0
        if capacity:
            keep = capacity_keep(idx, m.n_experts, capacity)
        return logits, s, idx, jnp.where(keep, g, 0.0), keep, capacity

    def _sequence_aux(self, idx: jax.Array, s: jax.Array, b: int, t: int, axes: tuple[str, ...]) -> jax.Array:
        """The sequence-wise balance loss (module docstring) of this device's b rows of t tokens (idx (b t, k),
        scores s (b t, E)); a row's sums are summed over the context axis, which splits its tokens."""
        m = self.cfg
        ctx = ("context",) if "context" in axes else ()

        def over_context(v):
            return jax.lax.psum(v, ctx) if ctx else v

        chosen = over_context(jnp.sum(jax.nn.one_hot(idx, m.n_experts, dtype=jnp.float32).reshape(b, -1, m.n_experts),
                                      axis=1))  # (b, E): the row's choices
        shares = over_context(jnp.sum((s / jnp.sum(s, axis=-1, keepdims=True)).reshape(b, t, -1), axis=1))
        tokens = over_context(jnp.float32(t))
        per_row = m.n_experts * jnp.sum(jax.lax.stop_gradient(chosen) / (tokens * m.top_k) * shares / tokens, axis=-1)
        # every context device of a row holds its loss: the ratio of the two sums counts each row once
        total, rows = jnp.sum(per_row), jnp.float32(b)
        if axes:
            total, rows = jax.lax.psum(total, axes), jax.lax.psum(rows, axes)
        return total / rows

    def _by_index(self, xt, w_router, bias, w_gate, w_up, w_down, impl: str, dtype) -> jax.Array:
        """The routed experts of tokens xt (n,D) in `dtype`, each assignment's weights read by its expert id
        (pallas_kernels.indexed_matmul with `impl`)."""
        m = self.cfg
        _, _, idx, g, _, _ = self._routed(xt, w_router, bias)
        flat = idx.reshape(-1)  # (n k,) token-major, as dispatch's assignments
        xr = jnp.repeat(xt, m.top_k, axis=0)
        h = indexed_matmul.indexed_swiglu(xr, w_gate, w_up, flat, impl=impl)
        return dispatch.combine(indexed_matmul.indexed_matmul(h, w_down, flat, impl=impl), g, dtype)

    def _split(self, mesh, fn, x, w_router, bias, w_gate, w_up, w_down):
        """fn(x, w_router, bias, w_gate, w_up, w_down) -> (y, stats) per device of the `hidden_split` mesh, on its
        slice of the experts' hidden width, every device on all of x; y summed over the devices in float32 and
        returned in x's dtype, stats (the same on every device) from the first."""
        (axis,) = mesh.axis_names
        f = w_gate.shape[-1]
        if f % mesh.size:
            raise ValueError(f"hidden_split: the experts' hidden width {f} does not split over {mesh.size} devices")
        cols, rows = P(None, None, axis), P(None, axis, None)

        def local(x, w_router, bias, w_gate, w_up, w_down):
            y, stats = fn(x, w_router, bias, w_gate, w_up, w_down)
            return jax.lax.psum(y.astype(jnp.float32), axis).astype(x.dtype), stats

        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), cols, cols, rows), out_specs=(P(), P()),
                             check_vma=False)(x, w_router, bias, w_gate, w_up, w_down)

    def _local(self, x, w_router, bias, w_gate, w_up, w_down, ops, *, axes: tuple[str, ...]):
        """One device's tokens. x (b,t,D); expert weights (E_local, ...). `axes`: mesh axes to reduce statistics over."""
        m = self.cfg
        b, t, d = x.shape
        xt = x.reshape(b * t, d)
        n = xt.shape[0]
        logits, s, idx, g, keep, capacity = self._routed(xt, w_router, bias)

        def psum(v):
            return jax.lax.psum(v, axes) if axes else v

        n_global = psum(jnp.float32(n))
        # The router's choices before any capacity drop (Switch, GShard): an over-full expert must look over-full to
        # the balancing loss and the bias update, not balanced by the drops.
        load = psum(jnp.sum(jax.nn.one_hot(idx, m.n_experts, dtype=jnp.float32), axis=(0, 1)))
        if m.aux_loss_scope == "sequence":
            aux = self._sequence_aux(idx, s, b, t, axes)
        else:
            f = jax.lax.stop_gradient(load) / (n_global * m.top_k)
            aux = m.n_experts * jnp.sum(f * psum(jnp.sum(s, axis=0)) / n_global)
        z = psum(jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)) / n_global
        dropped = psum(jnp.sum(~keep).astype(jnp.float32)) / (n_global * m.top_k)

        ep = "expert" in axes and jax.lax.axis_size("expert") > 1  # no exchange at all without expert parallelism
        # n k rows arrive on a device on average (all of its own without expert parallelism) for its E / P experts
        # With operands made at the update (the run's rows suffice, llama.plan_for_run) the experts run their fp8
        # recipe; otherwise the trace decides from the rows it sees.
        recipe = self.recipe if ops is not None else dispatch.expert_recipe(
            self.recipe, n * m.top_k, w_gate.shape[0], self.min_rows, self.expert_dims)
        ffn = dispatch.ExpertFFN(w_gate, w_up, w_down, recipe, self.impl, name_outputs=not ep, scanned=self.scanned,
                                 keep_gate_up=m.ep_save_gate_up, operands=ops)
        y, traffic = dispatch.dispatch_combine(xt, idx, g, keep, ffn, axis="expert" if ep else None,
                                               method=m.dispatch, gpus_per_node=m.gpus_per_node,
                                               exchange_method=m.exchange, a2a_impl=m.all_to_all, capacity=capacity,
                                               buffer_factor=m.ep_buffer_factor)
        stats = {"aux_loss": aux, "z_loss": z, "load": load, "dropped": dropped,
                 **{k: psum(traffic[k]) for k in ("rows_cross_node", "rows_intra_node")},
                 # the share of devices whose rows overflowed the compact expert buffer (they ran the whole one)
                 "ep_overflow": psum(traffic["overflow"]) / psum(jnp.float32(1))}
        return y.reshape(b, t, d), stats


def update_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3 auxiliary-loss-free balancing: b_e += rate * sign(mean load - load_e). bias, load (..., E)."""
    err = jnp.mean(load, axis=-1, keepdims=True) - load
    return bias + rate * jnp.sign(err)
