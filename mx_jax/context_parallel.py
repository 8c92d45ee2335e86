"""Context parallelism: exact causal attention over a sequence split across the `context` mesh axis.

Layout. With C shards a sequence of T tokens is cut into 2C chunks of s = T / (2C) tokens, and shard c holds chunks
c and 2C-1-c (the load-balanced "zigzag" order of the Llama 3 paper's all-gather context parallelism). Under a
causal mask query chunk j attends to j whole chunks and half of its own, so shard c does

    (c + 1/2) + (2C-1-c + 1/2) = 2C   chunk-by-chunk blocks of work,

the same on every shard and 1/C of the whole causal attention. (Contiguous halves, chunks 2c and 2c+1, would give
shard c 4c + 2 blocks: 2 for the first shard, 4C - 2 for the last, and the slowest shard sets the step.)
`Llama.__call__` puts the tokens and their positions into this order on entry (`to_zigzag`) and the hidden states
back before the output head (`from_zigzag`), so logits, losses and checkpoints never see it; RoPE uses the global
positions.

Attention on shard c. K and V are all-gathered over the axis (with grouped-query attention they are G/H the size of
Q) and put into global order, K_0 .. K_{2C-1}. For a local query chunk j, the keys it sees split into a prefix that
is wholly visible and a diagonal block that is causal:

    prefix    (O_P, L_P) = attention(q_j, K[0 : j s], V[0 : j s])             no mask; absent for j = 0
    diagonal  (O_D, L_D) = attention(q_j, K_j, V_j)                            causal, square
    merge     L = logaddexp(L_P, L_D),   O = exp(L_P - L) O_P + exp(L_D - L) O_D

where L is the row's log-sum-exp of the scaled logits (the "softmax statistics" a flash-attention kernel keeps).
The backward is FlashAttention-2's, which splits over key blocks given the merged O and L: for a block b of keys
with P_b = exp(S_b - L),

    dV_b = P_b^T dO,   dS_b = P_b * (dO V_b^T - rowsum(dO * O)),   dQ += scale dS_b K_b,   dK_b = scale dS_b^T Q,

so each part's backward is one call of the kernel's own backward with the merged (O, L) in place of its own. The
gradients of the gathered K and V go back to their owners through the all-gather's transpose (a reduce-scatter).

Which prefix a shard has depends on c, and kernels need static shapes. Chunk A = c has its prefix inside the first
(C-1) s keys and chunk B = 2C-1-c inside the first (2C-1) s, so each prefix call takes that static window with a
padding mask at its true length (cuDNN's kv_seqlen; its kernel skips key tiles past it): one program on every
shard, with no branch on c. (A `lax.switch` over c was the first version: XLA:GPU runs a conditional by copying the
branch index to the host and waiting for it, so every layer's attention blocked the host thread.) Two kernels
compute the parts (`impl`):
- "cudnn": cuDNN's flash attention (the forward and backward primitives behind jax.nn.dot_product_attention, bound
  through `compat.cudnn_attention_fwd/bwd` so that the backward can take the merged O and L);
- "xla": the same formulas in jnp (float32 softmax), for CPU and as the reference the GPU test compares against.

Documents (model.attention_mask=documents): a query attends only to its own document's keys; see "Documents" below.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mx_jax import compat


# ---------------------------------------------------------------------------------------------------------------
# Sequence layout

def to_zigzag(x: jax.Array, n_shards: int, axis: int = 1) -> jax.Array:
    """Natural order -> zigzag order along `axis` (length divisible by 2 n_shards): chunk order
    0, 2C-1, 1, 2C-2, ..., C-1, C, so that contiguous sharding over C devices gives shard c chunks c and 2C-1-c."""
    axis = axis % x.ndim
    shape = x.shape
    c = n_shards
    y = x.reshape(shape[:axis] + (2, c, shape[axis] // (2 * c)) + shape[axis + 1:])
    first = jax.lax.index_in_dim(y, 0, axis, keepdims=False)  # chunks 0 .. C-1
    second = jnp.flip(jax.lax.index_in_dim(y, 1, axis, keepdims=False), axis)  # chunks 2C-1 .. C
    return jnp.stack([first, second], axis=axis + 1).reshape(shape)


def from_zigzag(x: jax.Array, n_shards: int, axis: int = 1) -> jax.Array:
    """Inverse of `to_zigzag`."""
    axis = axis % x.ndim
    shape = x.shape
    c = n_shards
    y = x.reshape(shape[:axis] + (c, 2, shape[axis] // (2 * c)) + shape[axis + 1:])
    first = jax.lax.index_in_dim(y, 0, axis + 1, keepdims=False)
    second = jnp.flip(jax.lax.index_in_dim(y, 1, axis + 1, keepdims=False), axis)
    return jnp.concatenate([first, second], axis=axis).reshape(shape)


def global_order(gathered: jax.Array) -> jax.Array:
    """(C, B, 2s, ...) all-gathered zigzag shards -> (B, 2Cs, ...) in natural order."""
    s = gathered.shape[2] // 2
    first = jnp.concatenate(list(gathered[:, :, :s]), axis=1)  # chunks 0 .. C-1
    second = jnp.concatenate(list(gathered[::-1, :, s:]), axis=1)  # chunks C .. 2C-1
    return jnp.concatenate([first, second], axis=1)


# ---------------------------------------------------------------------------------------------------------------
# One block of attention: forward with its log-sum-exp, backward given the (merged) output and log-sum-exp.
# q (B, t, H, K); k, v (B, u, G, K) with H a multiple of G; lse (B, H, t) float32 (cuDNN's softmax statistics).
# kv_len (an int32 scalar or one per row (B,), may be traced): only keys [0, kv_len) exist, the rest is padding (>= 1
# key must exist). segments (B, t) int32, counting up from 0 along each row, for a causal square block: a query
# attends only to the keys of its own segment (model.attention_mask=documents; cuDNN's packed layout).

def _per_row(x, ndim: int):
    """A scalar, or a (B,) vector shaped to broadcast against (B, ...) of `ndim` dims."""
    x = jnp.asarray(x)
    return x if x.ndim == 0 else x.reshape(x.shape + (1,) * (ndim - 1))


def _scores(q, k, causal, kv_len, scale, segments=None):
    b, t, h, d = q.shape
    g, u = k.shape[2], k.shape[1]
    qg = q.reshape(b, t, g, h // g, d).astype(jnp.float32)
    s = jnp.einsum("btgrd,bugd->bgrtu", qg, k.astype(jnp.float32)) * scale
    if causal:
        mask = jnp.tril(jnp.ones((t, u), bool))
        if segments is not None:
            mask = (mask & (segments[:, :, None] == segments[:, None, :]))[:, None, None]
        s = jnp.where(mask, s, -jnp.inf)
    if kv_len is not None:
        s = jnp.where(jnp.arange(u) < _per_row(kv_len, 5), s, -jnp.inf)
    return qg, s


def _block_fwd_xla(q, k, v, causal, kv_len, scale, segments=None):
    b, t, h, d = q.shape
    _, s = _scores(q, k, causal, kv_len, scale, segments)
    lse = jax.nn.logsumexp(s, axis=-1)  # (B, G, R, t)
    o = jnp.einsum("bgrtu,bugd->btgrd", jnp.exp(s - lse[..., None]), v.astype(jnp.float32))
    return o.reshape(b, t, h, d).astype(q.dtype), lse.reshape(b, h, t)


def _block_bwd_xla(q, k, v, o, lse, do, causal, kv_len, scale, segments=None):
    b, t, h, d = q.shape
    g = k.shape[2]
    f32 = jnp.float32
    qg, s = _scores(q, k, causal, kv_len, scale, segments)
    og, dog = (a.reshape(b, t, g, h // g, d).astype(f32) for a in (o, do))
    p = jnp.exp(s - lse.reshape(b, g, h // g, t)[..., None])
    dv = jnp.einsum("bgrtu,btgrd->bugd", p, dog)
    dp = jnp.einsum("btgrd,bugd->bgrtu", dog, v.astype(f32))
    delta = jnp.einsum("btgrd,btgrd->bgrt", dog, og)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bgrtu,bugd->btgrd", ds, k.astype(f32)).reshape(b, t, h, d)
    dk = jnp.einsum("bgrtu,btgrd->bugd", ds, qg)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def block_fwd(q, k, v, *, causal: bool, impl: str, kv_len=None, segments=None, max_documents: int = 0, q_len=None):
    """-> (o like q, lse (B, H, t) float32): softmax(q k^T / sqrt(K)) v over keys [0, kv_len), causal if asked
    (square blocks only), within each segment if given (at most max_documents per row). q_len (with kv_len, one per
    row): only the rows [0, q_len) are needed; cuDNN skips the others, whose results are then not defined."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if impl == "cudnn" and segments is not None:
        lengths, starts = packed_layout(segments, max_documents)
        o, stats = compat.cudnn_attention_fwd(q, k, v, causal=True, scale=scale, documents=(lengths, starts))
        return o, _row_stats(stats, lengths, starts, segments)
    if impl == "cudnn":
        return compat.cudnn_attention_fwd(q, k, v, causal=causal, scale=scale, kv_len=kv_len, q_len=q_len)
    return _block_fwd_xla(q, k, v, causal, kv_len, scale, segments)


def block_bwd(q, k, v, o, lse, do, *, causal: bool, impl: str, kv_len=None, segments=None, max_documents: int = 0,
              q_len=None):
    """-> (dq, dk, dv) of this block's keys, given the output and log-sum-exp over all the keys q attends to. The
    padding keys' dk and dv are zero."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if impl == "cudnn" and segments is not None:
        lengths, starts = packed_layout(segments, max_documents)
        stats = _packed_stats(lse, lengths, starts, segments)
        dq, dk, dv = compat.cudnn_attention_bwd(q, k, v, o, stats, do, causal=True, scale=scale,
                                                documents=(lengths, starts))
    elif impl == "cudnn":
        dq, dk, dv = compat.cudnn_attention_bwd(q, k, v, o, lse, do, causal=causal, scale=scale, kv_len=kv_len,
                                                q_len=q_len)
    else:
        dq, dk, dv = _block_bwd_xla(q, k, v, o, lse, do, causal, kv_len, scale, segments)
    if kv_len is not None:
        real = (jnp.arange(k.shape[1]) < _per_row(kv_len, 2))[..., None, None]
        dk, dv = jnp.where(real, dk, 0), jnp.where(real, dv, 0)
    return dq, dk, dv


def packed_layout(segments: jax.Array, max_documents: int) -> tuple[jax.Array, jax.Array]:
    """(B,t) segments -> cuDNN's packed description of each row: lengths (B, M) and starts (B, M+1), -1 where a row
    has fewer than M documents (segments count up from 0 along a row, so the present ones come first)."""
    m = jnp.arange(max_documents, dtype=segments.dtype)
    lengths = jnp.sum(segments[:, :, None] == m, axis=1, dtype=jnp.int32)  # (B, M)
    starts = jnp.sum(segments[:, :, None] < m, axis=1, dtype=jnp.int32)
    present = lengths > 0
    lengths, starts = jnp.where(present, lengths, -1), jnp.where(present, starts, -1)
    return lengths, jnp.pad(starts, ((0, 0), (0, 1)), constant_values=-1)


def _packed_index(lengths, starts, segments):
    """Where cuDNN's packed statistics (B M, N, t) keep row (b, t): entry g of the batch's present segments, left
    packed in order (measured on an H200: benchmarks/RESULTS.md, session 61), at the row's place r in its segment."""
    present = jnp.sum(lengths > 0, axis=1)
    before = jnp.cumsum(present) - present  # (B,) segments of the rows above
    g = before[:, None] + segments
    r = jnp.arange(segments.shape[1])[None, :] - jnp.take_along_axis(starts, segments, axis=1)
    return g, r


def _row_stats(stats, lengths, starts, segments):
    """cuDNN's packed statistics (B M, N, t) -> per-row log-sum-exp (B, N, t)."""
    g, r = _packed_index(lengths, starts, segments)
    return stats.transpose(0, 2, 1)[g, r].transpose(0, 2, 1)


def _packed_stats(lse, lengths, starts, segments):
    """Inverse of `_row_stats` (the entries no row maps to are 0)."""
    g, r = _packed_index(lengths, starts, segments)
    b, n, t = lse.shape
    out = jnp.zeros((b * lengths.shape[1], t, n), lse.dtype)
    return out.at[g, r].set(lse.transpose(0, 2, 1)).transpose(0, 2, 1)


@jax.custom_vjp
def cudnn_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention on one device through cuDNN (jax.nn.dot_product_attention's kernels), with its output and
    softmax statistics tagged "attention" for remat policies (see `_remat_tags`)."""
    return _cudnn_causal_fwd(q, k, v)[0]


def _cudnn_causal_fwd(q, k, v):
    o, lse = _remat_tags(*block_fwd(q, k, v, causal=True, impl="cudnn"))
    return o, (q, k, v, o, lse)


def _cudnn_causal_bwd(res, do):
    return block_bwd(*res, do, causal=True, impl="cudnn")


cudnn_causal_attention.defvjp(_cudnn_causal_fwd, _cudnn_causal_bwd)


@jax.custom_vjp
def cudnn_document_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                             starts: jax.Array) -> jax.Array:
    """Causal attention within each document of a row (model.attention_mask=documents), one device's rows, through
    cuDNN's packed layout (`packed_layout` describes the documents); residuals tagged as above."""
    return _cudnn_document_fwd(q, k, v, lengths, starts)[0]


def _cudnn_document_fwd(q, k, v, lengths, starts):
    scale = 1.0 / math.sqrt(q.shape[-1])
    o, stats = _remat_tags(*compat.cudnn_attention_fwd(q, k, v, causal=True, scale=scale,
                                                        documents=(lengths, starts)))
    return o, (q, k, v, o, stats, lengths, starts)


def _cudnn_document_bwd(res, do):
    q, k, v, o, stats, lengths, starts = res
    scale = 1.0 / math.sqrt(q.shape[-1])
    return (*compat.cudnn_attention_bwd(q, k, v, o, stats, do, causal=True, scale=scale,
                                        documents=(lengths, starts)), None, None)


cudnn_document_attention.defvjp(_cudnn_document_fwd, _cudnn_document_bwd)


def _remat_tags(o, lse):
    """Name a forward's residuals "attention", the name model.remat=save_matmuls saves. A custom_vjp's residuals are
    otherwise invisible to the policy, so the backward would run the forward kernels again to rebuild them. Unrolled,
    XLA merges that second forward with the first; inside lax.scan it cannot (forward and backward are separate
    loop bodies), and on the 8B shape every layer ran cuDNN's forward twice (benchmarks/RESULTS.md)."""
    return checkpoint_name(o, "attention"), checkpoint_name(lse, "attention")


# ---------------------------------------------------------------------------------------------------------------
# One shard's attention. Shard c of n: chunk A = c, whose prefix [0, c s) lies within the first (n-1) s keys, and
# chunk B = 2n-1-c, whose prefix [0, (2n-1-c) s) lies within the first (2n-1) s. The prefixes are padded to those
# static lengths (kv_len masks the rest; cuDNN skips the padded key tiles), so every shard runs one program with no
# branch on c. Chunk A of shard 0 has no prefix: its call sees one key (kv_len >= 1) and its result is dropped.

def _merge(o_p, l_p, o_d, l_d):
    l = jnp.logaddexp(l_p, l_d)  # (B, H, t)
    w_p = jnp.exp(l_p - l).transpose(0, 2, 1)[..., None]  # (B, t, H, 1)
    w_d = jnp.exp(l_d - l).transpose(0, 2, 1)[..., None]
    return (w_p * o_p.astype(jnp.float32) + w_d * o_d.astype(jnp.float32)).astype(o_d.dtype), l


def _pair(a, s, axis=1):
    """(B, 2s, ...) -> (2B, s, ...): the two local chunks (along `axis`: 2 for lse) stacked on the batch axis."""
    first, second = jnp.split(a, [s], axis=axis)
    return jnp.concatenate([first, second])


def _unpair(a, b, axis=1):
    """Inverse of `_pair`."""
    return jnp.concatenate([a[:b], a[b:]], axis=axis)


def _prefixes(c, n, s):
    """[(rows of q, static key window, kv_len, present, first key of the chunk)] for chunk A and chunk B of shard c."""
    a = (slice(0, s), (n - 1) * s, jnp.maximum(c * s, 1), c > 0, c * s)
    b = (slice(s, 2 * s), (2 * n - 1) * s, (2 * n - 1 - c) * s, None, (2 * n - 1 - c) * s)
    return [a, b] if n > 1 else [b]


# Documents (model.attention_mask=documents; `segments`, (B, T) in natural order, as layers.document_segments
# counts them over the whole sequence, uncapped). A query at t attends to the keys [start of its document, t]. In
# chunk j (keys from j s on), only the rows of its first document can see keys before the chunk: those in [a, j s),
# a the start of the document holding position j s. So the diagonal block runs the chunk's documents as a packed
# causal block (its segments counted from the chunk's first and capped at max_documents - 1: M is per chunk, the
# block a packed call runs, as cuDNN's time and workspace grow with it), and the prefix block takes the key window
# starting at a (kv_len = j s - a, one per row) for the first document's rows only: they are the chunk's first q_len
# rows, and cuDNN computes no others (a padding mask on both sides); the other rows' prefix is dropped in the merge,
# and their cotangent zeroed (with a log-sum-exp that makes their probabilities 0) in its backward.

def _local_segments(segments, c, n, s, max_documents: int = 0):
    """Shard c's two chunks' segments, each counted from its first token's and capped at max_documents - 1 (if
    given): (B, 2s) in the local order."""
    chunk = lambda j0: jax.lax.dynamic_slice_in_dim(segments, j0, s, axis=1)
    parts = [chunk(c * s), chunk((2 * n - 1 - c) * s)]
    local = jnp.concatenate([p - p[:, :1] for p in parts], axis=1)
    return jnp.minimum(local, max_documents - 1) if max_documents else local


def _document_prefix(segments, j0, s):
    """For the chunk from key j0 on: (a (B,) the first key its first document holds, kv_len (B,) = j0 - a, rows
    (B, s) whether each row belongs to that document and has a prefix)."""
    first = jax.lax.dynamic_index_in_dim(segments, j0, axis=1, keepdims=False)  # (B,)
    a = jnp.sum(segments < first[:, None], axis=1, dtype=jnp.int32)
    kv_len = j0 - a
    rows = (jax.lax.dynamic_slice_in_dim(segments, j0, s, axis=1) == first[:, None]) & (kv_len > 0)[:, None]
    return a, kv_len, rows


def _window(x, a, window):
    """x (B, T, ...) -> (B, window, ...): each row's keys from a[b] on (zeros past the end)."""
    pad = jnp.pad(x, [(0, 0), (0, window)] + [(0, 0)] * (x.ndim - 2))
    return jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i, window, axis=0))(pad, a)


def _unwindow(g, a, length):
    """The transpose of `_window`: (B, window, ...) gradients back to their keys, (B, length, ...) float32."""
    zeros = jnp.zeros((g.shape[1] + length,) + g.shape[2:], jnp.float32)
    put = lambda r, i: jax.lax.dynamic_update_slice_in_dim(zeros, r.astype(jnp.float32), i, axis=0)
    return jax.vmap(put)(g, a)[:, :length]


def shard_fwd(c, n: int, impl: str, q, k, v, kg, vg, segments=None, max_documents: int = 0):
    """Shard c's (traced or static) forward: q, k, v (B, 2s, ., K) its zigzag chunks, kg and vg (B, 2ns, G, K) the
    whole sequence in natural order (and its segments, (B, 2ns)) -> (o (B, 2s, H, K), lse (B, H, 2s))."""
    b, s = q.shape[0], q.shape[1] // 2
    local = None if segments is None else _pair(_local_segments(segments, c, n, s, max_documents), s)
    o_d, l_d = block_fwd(_pair(q, s), _pair(k, s), _pair(v, s), causal=True, impl=impl, segments=local,
                         max_documents=max_documents)
    o_d, l_d = _unpair(o_d, b), _unpair(l_d, b, axis=2)
    o, lse = o_d, l_d
    for rows, window, kv_len, present, j0 in _prefixes(c, n, s):
        q_len = None
        if segments is None:
            kw, vw = kg[:, :window], vg[:, :window]
        else:
            a, kv_len, in_first = _document_prefix(segments, j0, s)
            kw, vw = _window(kg, a, window), _window(vg, a, window)
            kv_len, present = jnp.maximum(kv_len, 1), in_first[:, None, :]
            q_len = jnp.maximum(jnp.sum(in_first, axis=1), 1)
        o_p, l_p = block_fwd(q[:, rows], kw, vw, causal=False, impl=impl, kv_len=kv_len, q_len=q_len)
        if present is not None:
            l_p = jnp.where(present, l_p, -jnp.inf)
            if q_len is not None:  # the skipped rows' outputs are not defined: never 0 x NaN in the merge
                o_p = jnp.where(present[:, 0, :, None, None], o_p, 0)
        o_r, l_r = _merge(o_p, l_p, o_d[:, rows], l_d[:, :, rows])
        o, lse = o.at[:, rows].set(o_r), lse.at[:, :, rows].set(l_r)
    return o, lse


def shard_bwd(c, n: int, impl: str, q, k, v, kg, vg, o, lse, do, segments=None, max_documents: int = 0):
    """-> (dq, then in float32: dk, dv of the local chunks' diagonal blocks, dkg, dvg of the whole sequence's
    keys)."""
    b, s = q.shape[0], q.shape[1] // 2
    local = None if segments is None else _pair(_local_segments(segments, c, n, s, max_documents), s)
    dq, dk, dv = block_bwd(_pair(q, s), _pair(k, s), _pair(v, s), _pair(o, s), _pair(lse, s, axis=2),
                           _pair(do, s), causal=True, impl=impl, segments=local, max_documents=max_documents)
    dq, dk, dv = (_unpair(g, b).astype(jnp.float32) for g in (dq, dk, dv))
    dkg = jnp.zeros(kg.shape, jnp.float32)
    dvg = jnp.zeros(vg.shape, jnp.float32)
    for rows, window, kv_len, present, j0 in _prefixes(c, n, s):
        if segments is None:
            dq_p, dk_p, dv_p = block_bwd(q[:, rows], kg[:, :window], vg[:, :window], o[:, rows], lse[:, :, rows],
                                         do[:, rows], causal=False, impl=impl, kv_len=kv_len)
            if present is not None:
                dq_p, dk_p, dv_p = (jnp.where(present, g, 0) for g in (dq_p, dk_p, dv_p))
            dkg = dkg.at[:, :window].add(dk_p.astype(jnp.float32))
            dvg = dvg.at[:, :window].add(dv_p.astype(jnp.float32))
        else:
            a, kv_len, present = _document_prefix(segments, j0, s)
            # A row without a prefix: no cotangent, and probabilities exp(S - 1e30) = 0 (never inf x 0).
            l_p = jnp.where(present[:, None, :], lse[:, :, rows], 1e30)
            do_p = jnp.where(present[:, :, None, None], do[:, rows], 0).astype(do.dtype)
            dq_p, dk_p, dv_p = block_bwd(q[:, rows], _window(kg, a, window), _window(vg, a, window), o[:, rows], l_p,
                                         do_p, causal=False, impl=impl, kv_len=jnp.maximum(kv_len, 1),
                                         q_len=jnp.maximum(jnp.sum(present, axis=1), 1))
            dq_p = jnp.where(present[:, :, None, None], dq_p, 0)
            dkg, dvg = dkg + _unwindow(dk_p, a, kg.shape[1]), dvg + _unwindow(dv_p, a, vg.shape[1])
        dq = dq.at[:, rows].add(dq_p.astype(jnp.float32))
    return dq.astype(q.dtype), dk, dv, dkg, dvg  # dk, dv, dkg, dvg in float32: summed over shards before rounding


def _gather(x: jax.Array, axis: str) -> jax.Array:
    return global_order(jax.lax.all_gather(x, axis))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, impl: str,
                      axis: str = "context", max_documents: int = 0) -> jax.Array:
    """Inside shard_map over `axis`: q (B, 2s, H, K), k and v (B, 2s, G, K), this shard's two zigzag chunks (and
    their segments, (B, 2s), or None) -> causal attention output for them (module docstring). The backward gathers K
    and V again rather than keeping the gathered copies (4 T G K bytes per layer in bf16) alive from forward to
    backward."""
    return _fwd(q, k, v, segments, impl, axis, max_documents)[0]


def _fwd(q, k, v, segments, impl, axis, max_documents):
    n, c = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    whole = None if segments is None else _gather(segments, axis)
    o, lse = shard_fwd(c, n, impl, q, k, v, _gather(k, axis), _gather(v, axis), whole, max_documents)
    o, lse = _remat_tags(o, lse)
    return o, (q, k, v, segments, o, lse)


def _bwd(impl, axis, max_documents, res, do):
    q, k, v, segments, o, lse = res
    n, c = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    whole = None if segments is None else _gather(segments, axis)
    dq, dk, dv, dkg, dvg = shard_bwd(c, n, impl, q, k, v, _gather(k, axis), _gather(v, axis), o, lse, do, whole,
                                     max_documents)
    # The gathered keys' gradients: back to zigzag order, summed over the shards in float32 (K and V are G/H the
    # size of Q, so this costs little), each shard keeping its own chunks; one rounding at the end.
    scatter = lambda g: jax.lax.psum_scatter(to_zigzag(g, n), axis, scatter_dimension=1, tiled=True)
    return dq, (dk + scatter(dkg)).astype(k.dtype), (dv + scatter(dvg)).astype(v.dtype), None


context_attention.defvjp(_fwd, _bwd)
