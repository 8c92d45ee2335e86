"""The device mesh and the one table that maps logical array axes to mesh axes.

Mesh axes (outermost first):
    data     replicated data parallelism; in HSDP it spans hosts while fsdp stays inside a host
    fsdp     ZeRO-3: parameters, gradients and optimizer state sharded, batch split
    expert   MoE experts sharded; for everything else one more fsdp axis (batch split, dense weights sharded)
    context  the sequence is split in load-balanced zigzag chunks; attention all-gathers K and V over it
             (mx_jax/context_parallel.py)

Parameters carry logical axis names (layers.py); activations are constrained at block boundaries only. `RULES` is
the only place mesh axis names meet logical names: change the parallelism by changing this table or the mesh
shape, never the model. Dense, attention and embedding weights are sharded over fsdp, expert and context (a context
axis never duplicates their memory) and replicated over data only; expert weights are sharded over expert, and
their fsdp and context shards go on the expert axis too where they divide it (`param_spec`). Sharding the dense
weights over expert as well (ZeRO-3 over every axis that splits the batch inside a data replica, as TorchTitan's
FSDP spans the ranks its expert parallelism borrows) took the whole DeepSeekMoE 16B at expert=4 on 4 x H200 from
95.4 to 84.2 GiB per GPU and from 58,337 to 59,876 tokens/s: their gradients are reduce-scattered instead of
all-reduced in f32, and AdamW updates a quarter of them (benchmarks/RESULTS.md, session 58). Where a microbatch has
few enough tokens, the output head runs vocab-parallel instead, split on V over data and expert and on D over fsdp
and context ("head_embed"; `head_vocab_axes`; the run's plan names its V "head_vocab"). The embedding table's
gradient sums the data replicas' sparse partials by all-gathering their rows (`embed_lookup`).
Changing the mesh never changes the math: GSPMD inserts the collectives, and the manual regions (the embedding
lookup, context attention, expert dispatch) are written to be exact.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from mx_jax.config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "expert", "context")

# logical axis -> mesh axis, tuple of mesh axes, or None (replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": ("data", "fsdp", "expert"),
    "seq": "context",
    "act_embed": None,
    "act_heads": None,
    "act_kv": None,
    "act_vocab": None,
    # parameters
    "embed": ("fsdp", "expert", "context"),  # the d_model dimension of every weight
    "vocab": None,
    # the output head's vocab dim, split where the batch is but D is not; `head_vocab_axes` says when the head then
    # runs vocab-parallel, whose rows and logits are split over "head_batch": the batch's other axes
    "head_vocab": ("data", "expert"),
    "head_embed": ("fsdp", "context"),  # the vocab-parallel head's D: "embed" without the expert axis that splits V
    "head_batch": "fsdp",
    "q_heads": None,  # H*K of the query / output projections
    "kv_heads": None,  # G*K of the key / value projections
    # multi-head latent attention (layers.LatentAttention): the latents' width as the output of x W_kva and x W_qa
    # (whose D is "embed"), and as the input of W_kvb and W_qb, split like "embed" (these matrices have no D)
    "latent": None,
    "latent_in": ("fsdp", "expert", "context"),
    "mlp": None,
    "expert": "expert",
    "expert_mlp": ("fsdp", "context"),  # an expert weight's hidden dim (its embed dim stays whole for the GEMM)
    "router": None,
    "norm": None,
    "layers": None,
}


def entry_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes of one RULES or PartitionSpec entry (an axis, a tuple of them, or None), as a tuple."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def rule_axes(name: str) -> tuple[str, ...]:
    """The mesh axes RULES gives logical axis `name`, as a tuple (empty when replicated)."""
    return entry_axes(RULES[name])


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the mesh; a -1 axis takes what the others leave. Errors name the mesh key and the device count."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    shape = {k: getattr(cfg, k) for k in MESH_AXES}
    fixed = math.prod(v for v in shape.values() if v != -1)
    free = [k for k, v in shape.items() if v == -1]
    if free:
        if n % fixed:
            raise ConfigError(
                f"config key 'mesh.{free[0]}': the other axes use {fixed} devices, which does not divide the "
                f"{n} available")
        shape[free[0]] = n // fixed
    total = math.prod(shape.values())
    if total != n:
        desc = " x ".join(f"{k}={v}" for k, v in shape.items())
        cpu = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={total} gives {total} devices"
               if devices[0].platform == "cpu" and total > n else "")
        raise ConfigError(f"config key 'mesh': {desc} = {total} devices, but {n} are available "
                          f"(set one axis to -1 to fill{cpu})")
    dims = tuple(shape[k] for k in MESH_AXES)
    return jax.make_mesh(dims, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def describe(mesh: Mesh, process_hosts: Sequence[object] | None = None) -> str:
    """Which mesh axes cross process and host boundaries: HSDP wants `data` across hosts and `fsdp` inside one.
    `process_hosts[i]` names process i's host (any comparable value); without it processes stand for hosts."""
    devs = mesh.devices
    parts = []
    for i, name in enumerate(mesh.axis_names):
        if mesh.shape[name] == 1:
            continue
        # an axis crosses processes if moving along it changes the process of some device; hosts alike
        moved = np.moveaxis(devs, i, 0)
        procs = np.vectorize(lambda d: d.process_index)(moved)
        where = "within a process"
        if np.any(procs != procs[:1]):
            where = "across processes"
            if process_hosts is not None:
                hosts = np.vectorize(lambda p: process_hosts[p], otypes=[object])(procs)
                where = "across hosts" if np.any(hosts != hosts[:1]) else "across processes, within a host"
        parts.append(f"{name}={mesh.shape[name]} ({where})")
    return ", ".join(parts) or "single device"


def process_hosts() -> list[tuple[int, ...]] | None:
    """Each process's host, by process index, as 62 bits of a digest of its host name (one small all-gather; int32
    words, as jax without x64 moves them), or None in a one-process run."""
    if jax.process_count() == 1:
        return None
    import hashlib
    import socket

    from jax.experimental import multihost_utils

    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    mine = np.array([int.from_bytes(digest[i:i + 4], "little") >> 1 for i in (0, 4)], np.int32)
    return [tuple(int(w) for w in row) for row in np.asarray(multihost_utils.process_allgather(mine))]


def spec(logical: Sequence[str | None] | None) -> P:
    """PartitionSpec for a tuple of logical axis names. A mesh axis is used at most once (first wins)."""
    if logical is None:
        return P()
    used: set[str] = set()
    out = []
    for name in logical:
        axes = rule_axes(name) if name is not None else ()
        if not axes:
            out.append(None)
            continue
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(axes if len(axes) > 1 else (axes[0] if axes else None))
    return P(*out)


def fit_spec(pspec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Drop mesh axes from a dimension they do not divide (small models on big meshes stay correct)."""
    out = []
    for dim, entry in zip(shape, tuple(pspec) + (None,) * (len(shape) - len(pspec))):
        if entry is None:
            out.append(None)
            continue
        axes = entry_axes(entry)
        kept = []
        size = 1
        for a in axes:
            if dim % (size * mesh.shape[a]) == 0:
                kept.append(a)
                size *= mesh.shape[a]
        out.append(tuple(kept) if len(kept) > 1 else (kept[0] if kept else None))
    return P(*out)


def param_spec(logical: Sequence[str | None] | None, shape: Sequence[int], mesh) -> P:
    """A parameter's PartitionSpec: `spec` fitted to its shape, except that an array with an "expert" axis (a routed
    expert weight, its fp8 operands and scales) puts the mesh axes of the experts' hidden dim (fsdp, context) on its
    expert axis instead, after "expert", wherever they all divide it. Each device then holds whole expert matrices,
    and the MoE layer's all-gather over fsdp (into its shard_map, which takes the experts split over "expert" only)
    joins them along the major axis. Gathered along the hidden dim (the minor one of w_gate and w_up), XLA
    transposed the gathered weights: on 2 x H200 at fsdp=2 the bf16 Mixtral step spent 18.1 ms per step in copies
    and transposes, now 5.6, and took 123.3 ms, now 109.2 (RESULTS.md, session 34). Where they do not all divide
    the expert axis (8 experts on fsdp=16), the hidden dim keeps them, as `spec` says."""
    base = spec(logical)
    fitted = fit_spec(base, shape, mesh)
    if not logical or "expert" not in logical:
        return fitted
    axes = [*rule_axes("expert"), *rule_axes("expert_mlp")]
    entries = [None if name == "expert_mlp" else entry for name, entry in zip(logical, base)]
    e = logical.index("expert")
    entries[e] = tuple(dict.fromkeys(axes))
    moved = fit_spec(P(*entries), shape, mesh)
    return moved if set(entry_axes(moved[e])) == set(axes) else fitted


def named(mesh: Mesh, logical: Sequence[str | None] | None, shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, param_spec(logical, shape, mesh))


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names, under the mesh set with jax.set_mesh; a no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, fit_spec(spec(logical), x.shape, mesh))


# the logical axes of a weight matrix's own two dimensions (the others are "layers" and "expert")
MATRIX_AXES = ("embed", "head_embed", "vocab", "q_heads", "kv_heads", "latent", "latent_in", "mlp",
               "expert_mlp")


def matrices_whole() -> bool:
    """True unless the set mesh has an axis of more than one device that RULES puts on a weight matrix's own
    dimensions (MATRIX_AXES; fsdp, expert and context today): every device then holds whole matrices, split at most
    over their layer and expert axes."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = {a for name in MATRIX_AXES for a in rule_axes(name)}
    return mesh.empty or all(mesh.shape.get(a, 1) == 1 for a in axes)


def embed_lookup(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """table (V, D), tokens (B, S) -> rows (B, S, D) in `dtype`, laid out as the activations (batch, seq, act_embed).

    Without a mesh, or where every device holds the whole table and all the tokens, this is `jnp.take`. Otherwise
    the lookup runs per device in one shard_map, with its collectives written out, and so does its gradient
    (a custom_vjp). Let `split` be the mesh axes that split the table's D (RULES["embed"]: fsdp, expert, context)
    and `summed` the axes that split the tokens but not D (data: the table is replicated there):
    - each device all-gathers the tokens over the split axes that split them (fsdp, expert: B; context: S): tiny int
      arrays;
    - it looks up its own D columns for those tokens and casts them to `dtype`;
    - for each split axis, minor first, an all-to-all sends every device its own tokens' columns (split the token
      dim, join D). A split axis that does not split the tokens (they do not divide it) all-gathers D instead.
    The gradient undoes the data movement (the reverse all-to-alls, or each device's own D columns of the
    replicated cotangent) and scatter-adds the cotangent rows into the device's columns of the table, in f32. The
    devices along `summed` then hold partial gradients of the same table shard. A dense sum is a ring all-reduce of
    the (V, D_l) f32 table: 2 (P-1)/P V D_l 4 bytes per device. But the partials are sparse: a device's N rows of
    tokens touch at most N of the V rows. So where it moves fewer bytes, every device all-gathers the cotangent rows
    and token ids of its `summed` peers, (P-1)/P T (D_l c + 4) bytes with T = P N the tokens of the group and c the
    cotangent's itemsize, and scatter-adds all of them itself:

        sparse  iff  T (D_l c + 4) < 8 V D_l        (bf16: T < ~4 V; `sparse_table_grad`)

    which holds on small data-parallel meshes (Llama3's V = 128,256 against 16,384 tokens per microbatch at data=2;
    until session 58 also at expert=4, whose devices held the whole table: Mixtral's 32,000 against 16,384), and not
    for large global batches. The sum is the same f32 sum of the same bf16 rows that one device forms (only its order
    differs).

    Left to the partitioner (a gather, then a sharding constraint), XLA replicated the whole (B, S, D) array on
    every device ("Involuntary full rematerialization") on fsdp x context, fsdp x expert and data x fsdp x expert
    meshes (a Mixtral-shaped train step compiled for 12 meshes on 8 CPU devices). A chain of constraints through a
    middle layout cleared most of those warnings on CPU, but on 4 x H200 at fsdp x context it added six f32
    all-reduces and cost 7% of the step. The shard_map matches the single constraint's speed there and moves fewer
    bytes on every mesh with context or expert (benchmarks/RESULTS.md, session 37)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(t == AxisType.Manual for t in mesh.axis_types):  # no mesh, or inside a shard_map
        return jnp.take(table, tokens, axis=0).astype(dtype)
    (v, d), n_tokens = table.shape, math.prod(tokens.shape)
    table_spec = fit_spec(spec(("vocab", "embed")), table.shape, mesh)
    split = tuple(a for a in entry_axes(table_spec[1]) if mesh.shape[a] > 1)
    out_spec = fit_spec(spec(("batch", "seq", "act_embed")), (*tokens.shape, d), mesh)
    tok_spec = P(*out_spec[:2])
    token_dim = {a: dim for dim in (0, 1) for a in entry_axes(tok_spec[dim]) if mesh.shape[a] > 1}
    summed = tuple(a for a in token_dim if a not in split)
    if not split and not summed:
        return jax.lax.with_sharding_constraint(jnp.take(table, tokens, axis=0).astype(dtype), out_spec)
    d_l = d // math.prod(mesh.shape[a] for a in split)
    sparse = bool(summed) and sparse_table_grad(n_tokens, v, d_l, jnp.dtype(dtype).itemsize)
    table_only = P(None, table_spec[1])

    def gathered_tokens(tok):
        for a in split:
            if a in token_dim:
                tok = jax.lax.all_gather(tok, a, axis=token_dim[a], tiled=True)
        return tok

    def fwd_local(tab, tok):
        x = jnp.take(tab, gathered_tokens(tok), axis=0).astype(dtype)
        for a in reversed(split):  # minor first: the D columns each step joins are contiguous
            if a in token_dim:
                x = jax.lax.all_to_all(x, a, split_axis=token_dim[a], concat_axis=2, tiled=True)
            else:
                x = jax.lax.all_gather(x, a, axis=2, tiled=True)
        return x

    def grad_local(dx, tok):
        for a in split:  # the forward's steps undone, major first
            if a in token_dim:
                dx = jax.lax.all_to_all(dx, a, split_axis=2, concat_axis=token_dim[a], tiled=True)
            else:  # dx is the same on every device of `a`: keep this device's columns
                w = dx.shape[2] // mesh.shape[a]
                dx = jax.lax.dynamic_slice_in_dim(dx, jax.lax.axis_index(a) * w, w, axis=2)
        rows, ids = dx.reshape(-1, dx.shape[2]), gathered_tokens(tok).reshape(-1)
        if sparse:
            rows = jax.lax.all_gather(rows, summed, axis=0, tiled=True)
            ids = jax.lax.all_gather(ids, summed, axis=0, tiled=True)
        grad = jnp.zeros((v, rows.shape[1]), jnp.float32).at[ids].add(rows.astype(jnp.float32))
        if summed and not sparse:
            grad = jax.lax.psum(grad, summed)
        return grad.astype(table.dtype)

    @jax.custom_vjp
    def lookup(tab, tok):
        return jax.shard_map(fwd_local, mesh=mesh, in_specs=(table_only, tok_spec), out_specs=out_spec,
                             check_vma=False)(tab, tok)

    def lookup_bwd(tok, dx):
        grad = jax.shard_map(grad_local, mesh=mesh, in_specs=(out_spec, tok_spec), out_specs=table_only,
                             check_vma=False)(dx, tok)
        return grad, None

    lookup.defvjp(lambda tab, tok: (lookup(tab, tok), tok), lookup_bwd)
    return lookup(table, tokens)


def sparse_table_grad(n_tokens: int, vocab: int, d_l: int, itemsize: int) -> bool:
    """embed_lookup's choice: all-gather `n_tokens` cotangent rows of d_l columns (itemsize bytes) and their int32
    token ids instead of all-reducing the (vocab, d_l) f32 table gradient (a ring moves it twice)."""
    return n_tokens * (d_l * itemsize + 4) < 2 * vocab * d_l * 4


def head_vocab_axes(n_tokens: int, vocab: int, d: int, reduce_itemsize: int,
                    mesh_shape: dict[str, int] | None = None) -> tuple[str, ...]:
    """The mesh axes over which the output head (D, V) runs vocab-parallel for a microbatch of `n_tokens` tokens, on a
    mesh of `mesh_shape` (default: the set mesh; () inside shard_map); () where it runs as every other weight does.

    Vocab-parallel (Megatron-LM's parallel output layer): the head is split on V over the group's axes
    (RULES["head_vocab"]); the group's P devices all-gather their rows x, each computes the logits of its V / P
    vocabulary entries for all of the group's T tokens, the loss reduces (T,) maxima and sums across them, and the
    backward sums dx across them. No weight moves: per device (P-1)/P T D 2 bytes each way, in bf16. A head
    replicated over the group instead all-reduces its gradient, a ring's 2 (P-1)/P V D_l r bytes with r the
    reduce itemsize (model.grad_reduce_dtype) and D_l the head's D per device. (Over expert, which splits the head's
    D when it does not run vocab-parallel, the alternative is a reduce-scatter of the gradient and an all-gather of
    the bf16 weight: (P-1)/P V D_l (r + 2) bytes, 3/4 of the all-reduce's in f32 and as many in bf16; the same
    rule is kept.) So vocab-parallel iff

        4 T D < 2 V D_l r        (T < 2 V in f32, T < V in bf16, where D_l = D: fsdp splits T and D alike)

    a few vocabularies' worth of tokens per microbatch, as on expert-parallel and small data-parallel meshes. The
    group's axes must be the batch's minor split axes, so that its rows are one block of B: data x fsdp meshes
    keep the replicated head."""
    if mesh_shape is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or any(t == AxisType.Manual for t in mesh.axis_types):
            return ()
        mesh_shape = dict(mesh.shape)
    shape = {a: mesh_shape.get(a, 1) for a in MESH_AXES}
    abstract = AbstractMesh(tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * len(shape))
    w_spec = fit_spec(spec(("head_embed", "head_vocab")), (d, vocab), abstract)
    axes = tuple(a for a in entry_axes(w_spec[1]) if shape[a] > 1)
    tokens = [a for a in (*batch_axes(), *rule_axes("seq")) if shape[a] > 1]
    batch = [a for a in tokens if a in batch_axes()]
    if not axes or batch[len(batch) - len(axes):] != list(axes):
        return ()
    d_l = d // math.prod(shape[a] for a in entry_axes(w_spec[0]))
    group_tokens = n_tokens // math.prod(shape[a] for a in tokens if a not in axes)
    return axes if 4 * group_tokens * d < 2 * vocab * d_l * reduce_itemsize else ()


def batch_axes() -> tuple[str, ...]:
    return rule_axes("batch")


def token_axes() -> tuple[str, ...]:
    """The set mesh's axes of more than one device that split the tokens: the batch's, then the sequence's (the
    order in which they split a layer's (batch * seq) rows)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in (*batch_axes(), *rule_axes("seq")) if mesh.shape.get(a, 1) > 1)


def tokens_split() -> bool:
    """True under a set mesh that splits the tokens (batch or sequence) over more than one device: a weight
    gradient is then a sum of per-device partial sums."""
    return bool(token_axes())


def batch_size_divisor(shape) -> int:
    """The global batch must be a multiple of this: the product of the mesh axes the batch is split over, of a mesh's
    `shape` ({axis: size}, as Mesh.shape)."""
    return int(np.prod([shape[a] for a in batch_axes()]))
