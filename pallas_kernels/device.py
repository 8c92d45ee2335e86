"""What the kernel dispatchers need to know about the device they run on.

- `compute_capability()`: (major, minor) of the first device when it is an NVIDIA GPU, else None.
- `kernels_apply()`: impl="auto" may run a Hopper kernel: an sm_90 GPU, and no SPMD partitioner that would have to
  split the kernel's custom call (a multi-device mesh set outside shard_map). Inside shard_map every array is
  local; outside, XLA's own ops are used because the partitioner splits those and cannot split a Mosaic kernel.
- `one_process_sees_all_devices()`: a single process drives every device of the job (the condition for Mosaic-GPU
  collective kernels on XLA's collective metadata path, without NVSHMEM).
- `lowered_once(static_argnames)`: a decorator for kernel launchers. On a GPU the call goes through `jax.jit`, so
  every call site of a program with the same shapes and static arguments shares one lowered kernel (jit's lowering
  cache); Python lowering of a Mosaic-GPU kernel takes ~0.5-1 s, and an unrolled 8-layer fp8 step launches ~190
  kernels of ~25 kinds (its first step took 149 s before this). In interpret mode the call runs as written.
- `num_sms(interpret)`: the persistent grid's size: the abstract device's cores when tracing under a mesh (AOT, and
  inside shard_map), the GPU's SM count, or 2 when interpreted on CPU (so every CTA walks several tiles, as on
  the GPU).
- `profiler_params()`: Mosaic GPU's on-device profiler, switched on by the environment (MX_JAX_MGPU_PROFILE).
"""

from __future__ import annotations

import functools
import os

import jax

PROFILE_ENV = "MX_JAX_MGPU_PROFILE"


def compute_capability() -> tuple[int, int] | None:
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if dev.platform != "gpu" or not cc:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def on_hopper() -> bool:
    return compute_capability() == (9, 0)


def _multi_device_mesh():
    """The abstract mesh set now where it spans several devices, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def _all_manual(mesh) -> bool:
    return all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


def partitioned_context() -> bool:
    """A multi-device mesh is set and we are not inside shard_map (all axes Manual there)."""
    mesh = _multi_device_mesh()
    return mesh is not None and not _all_manual(mesh)


def per_device_of_many() -> bool:
    """Inside shard_map over a multi-device mesh: the kernel runs on each of several devices, beside their
    collectives."""
    mesh = _multi_device_mesh()
    return mesh is not None and _all_manual(mesh)


def kernels_apply() -> bool:
    return on_hopper() and not partitioned_context()


def one_process_sees_all_devices() -> bool:
    return jax.process_count() == 1 and jax.device_count() == jax.local_device_count()


def num_sms(interpret) -> int:
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and abstract.num_cores:  # (a CPU mesh's abstract device has num_cores None)
        return abstract.num_cores
    dev = jax.devices()[0]
    if interpret is not None or dev.platform != "gpu":
        return 2
    return dev.core_count


def lowered_once(static_argnames: tuple[str, ...]):
    """Decorator: see the module docstring. `interpret` must be among the launcher's keyword arguments."""

    def decorate(launch):
        jitted = jax.jit(launch, static_argnames=static_argnames)

        @functools.wraps(launch)
        def wrapper(*args, **kwargs):
            if kwargs.get("interpret") is None and jax.default_backend() == "gpu":
                return jitted(*args, **kwargs)
            return launch(*args, **kwargs)

        return wrapper

    return decorate


def profiler_params() -> dict:
    """`plgpu.CompilerParams` fields for Mosaic GPU's on-device profiler, from MX_JAX_MGPU_PROFILE=DIR[:SPANS].

    Unset: {}. Set: every launch of a kernel lowered afterwards writes DIR/<kernel>-<ns>-trace.json, a Chrome trace
    with one track per warpgroup of each CTA and one span per `jax.named_scope` region its code passes through; span
    times are SM clock cycles / 1000 (the events read %clock). SPANS (default 64) is the spans each warpgroup can
    record. The buffer takes 16 B of shared memory per span and warpgroup, so a kernel that already fills shared
    memory (the grouped GEMM's default: 226 of 227 KiB) only fits a few dozen: profile a problem with few tiles per
    CTA. benchmarks/profile_tiles.py runs and reads such a profile."""
    spec = os.environ.get(PROFILE_ENV, "")
    if not spec:
        return {}
    path, _, spans = spec.partition(":")
    if not path or (spans and not spans.isdigit()):
        raise ValueError(f"{PROFILE_ENV}={spec!r}: expected DIR or DIR:SPANS (a positive integer)")
    return dict(profile_space=int(spans or 64), profile_dir=path)
