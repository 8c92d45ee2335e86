"""Every jax / flax / orbax version shim in mx_jax lives here, and nowhere else.

Supported range: jax 0.10.2 (CPU machines and CI, Python 3.11) to jax 0.11.2 (the GPU image, Python 3.12).
Each shim names the versions that differ and what changed.
"""

import contextlib

import jax

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3])


# ---------------------------------------------------------------------------------------------------------------
# XLA:CPU flags that compile the test suite's tiny programs fast (tests/helpers.FAST_CPU_COMPILE): LLVM at -O0, and
# in jaxlib 0.10.2 the older elemental fusion emitters. jaxlib 0.11 removed `--xla_cpu_use_fusion_emitters`, and an
# unknown flag in XLA_FLAGS aborts the process there.
XLA_CPU_FAST_COMPILE = "--xla_backend_optimization_level=0" + (
    "" if JAX_VERSION >= (0, 11, 0) else " --xla_cpu_use_fusion_emitters=false"
)


# ---------------------------------------------------------------------------------------------------------------
# GPU plugin detection (train.py --dry-run): the CUDA PJRT plugin is `jax_plugins.xla_cuda13` in the GPU image
# (jax-cuda13-plugin 0.11.2) and `xla_cuda12` in CUDA-12 installs; finding it starts no backend.
def cuda_plugin_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.{name}") is not None for name in ("xla_cuda13", "xla_cuda12"))


# ---------------------------------------------------------------------------------------------------------------
# Pallas Mosaic-GPU: fp8 GEMM / quantize kernels (pallas_kernels/fp8_matmul.py, quantize.py)
# ---------------------------------------------------------------------------------------------------------------
# - InterpretGPUParams (run a Mosaic-GPU kernel on CPU): exported on `plgpu` from 0.11; in 0.10.2 it lives only in
#   jax._src.pallas.mosaic_gpu.interpret.params.
# - wgmma with one e4m3 and one e5m2 operand: accepted from 0.11 (0.10.2 requires equal dtypes).
# - `pl.pallas_call(compiler_params=plgpu.CompilerParams())` fails on 0.11.2, so kernels use `plgpu.kernel`, whose
#   signature (out_type=, scratch_types=, interpret=) is the same in both versions.
try:
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams  # jax >= 0.11
except ImportError:  # jax 0.10.2
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: F401

MGPU_MIXED_FP8_WGMMA = JAX_VERSION >= (0, 11, 0)

# Run every Mosaic-GPU kernel launched inside the context on CPU (0.11 exports it on `plgpu`; 0.10.2 does not).
try:
    from jax.experimental.pallas.mosaic_gpu import force_gpu_interpret_mode  # jax >= 0.11
except ImportError:  # jax 0.10.2
    from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode  # noqa: F401


def gpu_interpret_forced() -> bool:
    """Inside `force_gpu_interpret_mode`: kernels launched without `interpret=` still run in the interpreter (jax
    keeps the context's params in this config value in 0.10.2 and 0.11)."""
    from jax._src import config as jax_config

    return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


# ---------------------------------------------------------------------------------------------------------------
# Pallas Mosaic-GPU interpret mode: MX cast kernels (pallas_kernels/mx_quantize.py)
# ---------------------------------------------------------------------------------------------------------------
# - `plgpu.layout_cast` in a kernel run by the GPU interpreter: 0.11 treats it as the identity; 0.10.2 has no CPU
#   lowering for `layout_cast_p` ("MLIR translation rule ... not found for platform cpu"). A layout is meaningless
#   to the interpreter, so `enable_mgpu_interpret_layout_cast()` registers the identity as that lowering on 0.10.2.
# - Reading a transposed SMEM view (`ref.T[...]`): 0.11's interpreter reads it; 0.10.2's rejects the
#   TransposeTransform ("Unsupported transform"). MGPU_INTERPRET_REF_TRANSPOSE says which; on 0.10.2 the cast
#   kernels transpose the value instead when interpreted (the GPU path always reads the transposed view).
MGPU_INTERPRET_REF_TRANSPOSE = JAX_VERSION >= (0, 11, 0)
_mgpu_layout_cast_cpu_rule_registered = False


def enable_mgpu_interpret_layout_cast() -> None:
    """Make `plgpu.layout_cast` interpretable on CPU (a no-op on jax >= 0.11; idempotent)."""
    global _mgpu_layout_cast_cpu_rule_registered
    if JAX_VERSION >= (0, 11, 0) or _mgpu_layout_cast_cpu_rule_registered:
        return
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu import core as mgpu_core

    mlir.register_lowering(mgpu_core.layout_cast_p, lambda ctx, x, *, new_layout: [x], platform="cpu")
    _mgpu_layout_cast_cpu_rule_registered = True


# ---------------------------------------------------------------------------------------------------------------
# Pallas Mosaic-GPU interpret mode: grouped GEMMs (pallas_kernels/grouped_matmul.py)
# ---------------------------------------------------------------------------------------------------------------
# - Thread-block clusters (a 2-CTA cluster multicasting a TMA load): 0.11's GPU interpreter runs them; 0.10.2's
#   fails on the cluster barrier ("NotImplementedError: nan + cluster_barrier"). Tests of clustered configs run
#   where MGPU_INTERPRET_CLUSTERS holds; the GPU lowering is the same in both versions.
MGPU_INTERPRET_CLUSTERS = JAX_VERSION >= (0, 11, 0)
# - Single-warp regions (plgpu.warp_map, the fp8 GEMM's producer warp): 0.11 runs them in its GPU interpreter and
#   lowers them for the GPU. 0.10.2's interpreter fails ("Higher-order primitive core_map"), and so does its GPU
#   lowering of the producer's tile loop inside one ("Named axes can only refer to the warp axis name", then
#   "Unimplemented primitive ... jit" for planar_snake's floor division). Where MGPU_WARP_MAP does not hold, the
#   kernel runs that region on the whole memory warpgroup (the same loads and barrier waits, the loads issued by
#   its leader thread; the first static ring measured on the H200, RESULTS.md fifteenth fp8 pass).
MGPU_WARP_MAP = JAX_VERSION >= (0, 11, 0)
# - The fp8 casts' transposed SMEM view (pallas_kernels/quantize.py, the K-major copies of every dual cast):
#   0.10.2 interprets it but does not lower it for the GPU ("Tiled strides must be a multiple of the vector length").
#   Where MGPU_TRANSPOSED_CAST does not hold, impl="auto" casts those copies with XLA and impl="pallas" says why.
MGPU_TRANSPOSED_CAST = JAX_VERSION >= (0, 11, 0)
# - The dynamic tile schedule (pallas_kernels/tile_queue.py) takes its tiles with an atomic add written as inline
#   PTX (`mgpu.utils.inline_ptx`, which 0.10.2 lacks). Where MGPU_TILE_QUEUE does not hold, the kernels' covers
#   refuse `schedule="dynamic"` and impl="auto" keeps the static schedule.
MGPU_TILE_QUEUE = JAX_VERSION >= (0, 11, 0)


# ---------------------------------------------------------------------------------------------------------------
# Pallas Mosaic-GPU collective kernels: NVLink all-to-all and row exchange (pallas_kernels/all_to_all.py, ...)
# ---------------------------------------------------------------------------------------------------------------
# - A kernel that writes into peers' memory (plgpu.remote_ref, remote semaphore_signal) runs on XLA's collective
#   metadata path. jaxlib 0.11.2's `mosaic_gpu_v2` handler launches a multi-GPU barrier on the stream before each
#   such kernel unless CompilerParams(skip_device_barrier=True) (seen in jax-cuda13-pjrt 0.11.2: the attribute and
#   the "Starting multi-GPU barrier" log line; 0.11's Python passes skip_device_barrier=false). The all-to-all
#   kernel's first remote write is safe only behind that barrier; it is not checked for jax 0.10.2 (CPU only
#   here, and 0.10.2 emits no such attribute), so impl="pallas" refuses there.
MGPU_COLLECTIVE_PRELAUNCH_BARRIER = JAX_VERSION >= (0, 11, 0)
# - Bulk copies from a peer's memory into SMEM (plgpu.remote_ref as a copy's source: pallas_kernels/row_exchange.py,
#   "pull") need jaxlib 0.11.1 (jax/_src/pallas/mosaic_gpu/primitives.py raises NotImplementedError before it).
MGPU_REMOTE_LOAD = JAX_VERSION >= (0, 11, 1)


def varying_axes(x) -> set:
    """The shard_map axes along which x varies (jax's check_vma typing), empty outside shard_map. Read from the
    aval's `mat.varying` where this jax has it (0.10.2 and 0.11.2 both do); a jax without it gives the empty set,
    and the kernels' outputs then get no pcast."""
    return set(getattr(getattr(jax.typeof(x), "mat", None), "varying", None) or ())


# ---------------------------------------------------------------------------------------------------------------
# cuDNN flash attention with its softmax statistics (mx_jax/context_parallel.py)
# ---------------------------------------------------------------------------------------------------------------
# Context parallelism merges attention over key blocks and runs each block's backward with the merged output and
# log-sum-exp. The public API (jax.nn.dot_product_attention, and cudnn's `return_residual=True`) returns the
# statistics but drops their cotangent and computes the backward from each call's own output, so the forward and
# backward primitives behind it are bound directly. Their signatures are the same in jax 0.10.2 and 0.11.2
# (jax/_src/cudnn/fused_attention_stablehlo.py: 10 array operands for the forward, 13 for the backward; BTNH layout
# = 0; the statistics are (B, N, T) float32, natural-log log-sum-exp of the scaled logits, checked against
# jnp by tests/test_context_parallel.py on a GPU).
#
# Documents (model.attention_mask=documents): cuDNN's packed layout runs several documents per row, each attending
# causally within itself. `documents` = (lengths (B, M), starts (B, M+1)): per row the documents' lengths and first
# positions, -1 where a row has fewer than M (the format of jax._src.cudnn.fused_attention_stablehlo's
# dot_product_attention q_seqlen and q_offsets; the wrapper primitives turn it into cuDNN's, the same in 0.10.2 and
# 0.11.2). The statistics are then (B M, N, T) float32 (context_parallel._packed_index says where each row's is).
# Checked on an H200 (jax 0.11.2, cuDNN 9.19) against XLA's masked scores with grouped-query heads, through our path
# and through jax's function: PADDING_CAUSAL and CAUSAL gave the same results (benchmarks/RESULTS.md, session 61).
def _cudnn_attention_args(q, k, causal: bool, scale: float, kv_len, q_len=None, documents=None):
    """The primitives' 7 optional operands (bias, q/kv sequence lengths, offsets, page tables) and parameters."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    unused = jax.numpy.zeros(0, q.dtype)
    offsets = (unused, unused)
    if documents is not None:
        assert causal and kv_len is None, "documents are causal square blocks"
        lengths, starts = documents
        lengths, offsets, mask = (lengths, lengths), (starts, starts), fa.MaskType.PADDING_CAUSAL
    elif kv_len is None:
        lengths, mask = (unused, unused), fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    else:  # keys [kv_len, S) are padding, and queries [q_len, T) where given
        assert not causal, "a padded block is never the causal diagonal"
        b = q.shape[0]
        per_row = lambda n: jax.numpy.broadcast_to(jax.numpy.asarray(n, jax.numpy.int32), (b,))
        lengths = (per_row(q.shape[1] if q_len is None else q_len), per_row(kv_len))
        mask = fa.MaskType.PADDING
    operands = (unused, *lengths, *offsets, unused, unused)
    params = dict(scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask,
                  layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)
    return fa, operands, params


def cudnn_attention_fwd(q, k, v, *, causal: bool, scale: float, kv_len=None, q_len=None, documents=None):
    """q (B,T,N,H), k and v (B,S,G,H) -> (output like q, log-sum-exp (B,N,T) float32). Causal: top-left, T == S.
    kv_len: only keys [0, kv_len) are attended to (an int32 scalar or one per row, may be traced); q_len (with it):
    only queries [0, q_len) are computed, the other rows' outputs and statistics are not defined. documents: causal
    within each document of a row (above); the statistics are then (B M, N, T)."""
    fa, operands, params = _cudnn_attention_args(q, k, causal, scale, kv_len, q_len, documents)
    # The checks jax.nn.dot_product_attention runs, so that a dtype, layout or head dim cuDNN cannot take fails here
    # with jax's message instead of inside XLA.
    if not _CUDNN_SHAPES_ONLY:
        lengths, starts = documents if documents is not None else (None, None)
        fa.check_layout(q, k, v, None, lengths, lengths, starts, starts, None, None, fa.AttentionLayout.BTNH)
        fa.check_is_flash_attention(q, k, v, fa.AttentionLayout.BTNH.value, fa.check_cudnn_version(), False, True,
                                    is_packed=documents is not None)
    out, lse = fa._dot_product_attention_fwd_p_wrapper.bind(q, k, v, *operands, **params, is_training=True)
    return out, lse


def cudnn_attention_bwd(q, k, v, out, lse, dout, *, causal: bool, scale: float, kv_len=None, q_len=None,
                        documents=None):
    """(dq, dk, dv) of these keys given the output and log-sum-exp of the rows over all the keys they attend to
    (with q_len, of the rows [0, q_len) only; with documents, the statistics as the forward gave them)."""
    fa, operands, params = _cudnn_attention_args(q, k, causal, scale, kv_len, q_len, documents)
    dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(q, k, v, *operands, lse, out, dout, **params)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------------------
# Shape-only traces (mx_jax/memory_estimate.py)
# ---------------------------------------------------------------------------------------------------------------
# - `saved_residuals(f, *args)`: the residuals jax keeps for f's backward, as (aval, origin) pairs. Public only as
#   `jax.ad_checkpoint.print_saved_residuals` in 0.10.2 and 0.11.2; the list itself is jax._src.ad_checkpoint's.
# - cuDNN attention checks the installed cuDNN and the GPU when it is traced. Inside `cudnn_shapes_only()` those
#   checks are skipped, so a machine without either can trace (never run) the GPU's attention for its shapes; the
#   primitives' abstract evaluation needs neither (0.10.2 and 0.11.2).
from jax._src.ad_checkpoint import saved_residuals  # noqa: E402,F401  (the list print_saved_residuals prints)

_CUDNN_SHAPES_ONLY = False


@contextlib.contextmanager
def cudnn_shapes_only():
    global _CUDNN_SHAPES_ONLY
    saved, _CUDNN_SHAPES_ONLY = _CUDNN_SHAPES_ONLY, True
    try:
        yield
    finally:
        _CUDNN_SHAPES_ONLY = saved


# ---------------------------------------------------------------------------------------------------------------
# lax.scan's stacked outputs, left uninitialized (mx_jax/llama.py's scanned layers)
# ---------------------------------------------------------------------------------------------------------------
# A scan's stacked outputs (the per-layer residuals of a scanned model's forward) are while-loop buffers that the
# loop overwrites slice by slice. jax 0.10.2 and 0.11.2 create them in `loops._empty_array` as a broadcast of
# `lax.empty2`, which lowers to zeros: on the GPU a memset of every buffer before the first layer (~4.6 ms of the
# 8-layer 8B fp8 step on an H200, RESULTS.md "The configs' layout"). jax's own TODO there is to use `lax.empty`,
# whose GPU lowering is XLA's AllocateBuffer (no kernel), once "AllocateBuffer issues" are fixed; it is kept on
# empty2 for host-offloaded outputs (lax.empty takes no memory space). `uninitialize_scan_outputs()` swaps in that
# form for device-memory outputs and keeps jax's function for the rest. The values are the same: every slice of a
# stacked output is written by its iteration before anything reads it. On CPU lax.empty still lowers to zeros.
# Measured on an H200 (RESULTS.md, session 25): +2.9% on the 8B fp8, Mixtral and DeepSeekMoE scanned steps; the
# DeepSeekMoE step's peak grew by 1.7 GiB: its backward scan's stacked expert-weight gradients, allocated, are live
# from the start of the step, where their zero fill had been placed just before the backward loop (the dense and
# Mixtral peaks did not move).
# On a multi-device mesh a bare AllocateBuffer cannot be split by XLA's SPMD partitioner: every device allocated the
# whole stacked buffer, all batch rows and all layers' weight gradients, and the loop gathered each layer's slice
# into it (the full 8B on 4 x H200 at fsdp=4: 98 GiB of temporaries, and an OOM at data=2 x fsdp=2; RESULTS.md,
# session 38). So there the allocation is a `custom_partitioning` op with a free sharding rule: the partitioner gives
# it the sharding of the slices written into it, as it did the zero fill, and its partition callback allocates each
# device's shard (`_sharded_empty`). A sharding that does not split the shape evenly is answered with a replicated
# allocation, which the partitioner slices locally. Inside shard_map (any manual axis) the scan keeps jax's zero fill.
# Measured on 4 x H200 (RESULTS.md, session 40): the whole 8B at fsdp=4 no longer zero-fills 19 ms per step of
# residual buffers: +2.7-2.8% in fp8_rowwise, +0.8% in bf16; the 2-layer Mixtral at data=2 x fsdp=2: +1.0%.
# The lowered op names its partition callback by a Python object address, different in every process, so the
# persistent compilation cache's key changed from run to run and no multi-device scanned step ever came back from it
# until session 53 (train.COMPILE_CACHE_VAR says how the trainer's cache deals with it).
_JAX_EMPTY_ARRAY = None


def _sharded_empty(shape: tuple[int, ...], dtype) -> jax.Array:
    """`lax.empty(shape, dtype)` that XLA's SPMD partitioner splits like its users: each device allocates its shard."""
    from jax.experimental.custom_partitioning import custom_partitioning
    from jax._src.lax import lax as lax_internal
    from jax.sharding import NamedSharding, PartitionSpec

    @custom_partitioning
    def empty(anchor):  # Shardy's rule parser needs an operand: a scalar, sharded on no factor
        del anchor
        return lax_internal.empty(shape, dtype)

    def partition(mesh, arg_shapes, result_shape):
        sharding = result_shape.sharding
        try:
            local = sharding.shard_shape(shape)
        except ValueError:  # uneven: allocate whole and let the partitioner take the device's part
            sharding, local = NamedSharding(mesh, PartitionSpec()), shape
        return mesh, lambda anchor: lax_internal.empty(local, dtype), sharding, (NamedSharding(mesh, PartitionSpec()),)

    def user_sharding(mesh, user_shape):  # the GSPMD partitioner's propagation (Shardy reads sharding_rule)
        return user_shape.sharding

    def replicated(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, PartitionSpec())

    factors = " ".join(f"d{i}" for i in range(len(shape)))
    empty.def_partition(partition=partition, infer_sharding_from_operands=replicated,
                        propagate_user_sharding=user_sharding, sharding_rule=f"-> {factors}")
    return empty(jax.numpy.zeros((), jax.numpy.int32))


def _scan_output_buffer(prefix, length_spec, aval):
    from jax._src import core
    from jax._src.lax import lax as lax_internal
    from jax._src.mesh import get_abstract_mesh, use_abstract_mesh
    from jax.sharding import AxisType

    mesh = get_abstract_mesh()
    if aval.memory_space != core.MemorySpace.Device or any(t == AxisType.Manual for t in mesh.axis_types):
        return _JAX_EMPTY_ARRAY(prefix, length_spec, aval)
    if not mesh.empty and mesh.size > 1:
        return _sharded_empty((*prefix, *aval.shape), aval.dtype)
    if mesh.empty and jax.device_count() > 1:  # no mesh to name the shards: jax's zero fill
        return _JAX_EMPTY_ARRAY(prefix, length_spec, aval)
    sharding = aval.sharding
    if JAX_VERSION >= (0, 11, 0) and sharding.mesh.empty:  # 0.11 takes the context's mesh; 0.10.2 does not
        sharding = sharding.update(mesh=get_abstract_mesh())
    sharding = sharding.update(spec=sharding.spec.update(partitions=(*length_spec, *sharding.spec.partitions)))
    with use_abstract_mesh(sharding.mesh):
        out = lax_internal.empty((*prefix, *aval.shape), aval.dtype, out_sharding=sharding)
    return core.pvary(out, tuple(aval.mat.varying))


def uninitialize_scan_outputs() -> None:
    """Install `_scan_output_buffer` as jax's scan-output allocator (idempotent; process-wide, values unchanged)."""
    global _JAX_EMPTY_ARRAY
    from jax._src import dispatch
    from jax._src.lax.control_flow import loops

    if _JAX_EMPTY_ARRAY is None:
        _JAX_EMPTY_ARRAY = loops._empty_array
        loops._empty_array = _scan_output_buffer
        # custom_partitioning needs the device list at lowering time, which jax passes only to programs holding a
        # primitive that asks for it; the scan's buffers are made while the scan lowers, so the scan asks. A program
        # with a scan is then lowered for concrete devices: lowering one under an AbstractMesh alone raises.
        dispatch.prim_requires_devices_during_lowering.add(loops.scan_p)


def await_orbax_tmp_cleanup(manager) -> None:
    """Wait for the removal of stale temporary step directories that an Orbax CheckpointManager starts in a thread
    when it is made (orbax-checkpoint 0.12: awaited by its next save, never by close()). A run that stops before its
    first save (a config error found at resume) otherwise exits with that thread running: a traceback from the
    interpreter's shutdown ("cannot schedule new futures after interpreter shutdown"). No-op where the attribute is
    absent (another Orbax)."""
    future = getattr(manager, "_cleanup_tmp_directory_future", None)
    if future is not None:
        future.result()
        manager._cleanup_tmp_directory_future = None
