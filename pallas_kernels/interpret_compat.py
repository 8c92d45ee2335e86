"""Test support: let jax 0.10.2's Mosaic-GPU interpreter read SMEM through a transposed ref view.

Two kernels read SMEM transposed: the fp8 GEMM passes B to wgmma as `b_smem.T` (8-bit wgmma needs both operands
K-major), and the transposed cast kernel loads `x_smem.T[...]`. jax 0.10.2's CPU interpreter turns every ref
transform into an index range and fails on a transpose ("'TransposeTransform' object has no attribute 'indices'" in
wgmma, "Unsupported transform: TransposeTransform" in a load); jax 0.11 handles both natively. `install()` wraps
the two interpreter callbacks so that a trailing TransposeTransform is removed from the transform chain before the
range is computed and applied to the value after it is read. The GPU lowering is untouched: this only runs on CPU,
under interpret mode, from tests and the benches' `--cpu-smoke` runs. It is a no-op on jax >= 0.11.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from mx_jax import compat

_installed = False


def _split_transpose(transforms) -> tuple[tuple, tuple[int, ...] | None]:
    """(transforms without a trailing TransposeTransform, its permutation or None)."""
    from jax._src.state.types import TransposeTransform

    transforms = tuple(transforms)
    if not transforms or not isinstance(transforms[-1], TransposeTransform):
        if any(isinstance(t, TransposeTransform) for t in transforms):
            raise NotImplementedError("interpret_compat handles only a transpose applied last")
        return transforms, None
    return transforms[:-1], tuple(transforms[-1].permutation)


def install() -> None:
    """Patch jax 0.10.2's GPU interpreter (idempotent; nothing to do on jax >= 0.11)."""
    global _installed
    if _installed or compat.JAX_VERSION >= (0, 11, 0):
        return
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb

    original = cb.wgmma

    @functools.wraps(original)
    def wgmma(
        *,
        token,
        device_id,
        grid_point_coords,
        thread_id,
        acc_allocation_key_as_array,
        acc_transforms,
        acc_dtype,
        a_allocation_key_as_array,
        a_transforms,
        b_allocation_key_as_array,
        b_transforms,
        source_info=None,
    ):
        a_transforms, a_perm = _split_transpose(cb._remove_noop_transforms(a_transforms))
        b_transforms, b_perm = _split_transpose(cb._remove_noop_transforms(b_transforms))
        if a_perm is None and b_perm is None:
            return original(
                token=token,
                device_id=device_id,
                grid_point_coords=grid_point_coords,
                thread_id=thread_id,
                acc_allocation_key_as_array=acc_allocation_key_as_array,
                acc_transforms=acc_transforms,
                acc_dtype=acc_dtype,
                a_allocation_key_as_array=a_allocation_key_as_array,
                a_transforms=a_transforms,
                b_allocation_key_as_array=b_allocation_key_as_array,
                b_transforms=b_transforms,
                source_info=source_info,
            )
        shm = cb._get_shared_memory()
        thread = shm.get_global_thread_id(int(device_id), int(thread_id))
        log = interpret_utils.GPULoggingInfo(
            device_id=int(device_id),
            grid_point_coords=tuple(int(x) for x in grid_point_coords),
            thread_id=int(thread_id),
            source_info=source_info,
        )

        def read(key_array, transforms, perm):
            key = cb.HostAllocationKey.from_array(key_array)
            rng = interpret_utils.to_range(jax.tree.map(int, transforms))
            value, _, _ = shm.get_buffer_content(key, rng, thread, logging_info=log)
            return value if perm is None else np.transpose(value, perm)

        a = read(a_allocation_key_as_array, a_transforms, a_perm)
        b = read(b_allocation_key_as_array, b_transforms, b_perm)
        acc_key = cb.HostAllocationKey.from_array(acc_allocation_key_as_array)
        acc_range = interpret_utils.to_range(jax.tree.map(int, cb._remove_noop_transforms(acc_transforms)))
        acc, _, _ = shm.get_buffer_content(acc_key, acc_range, thread, logging_info=log)
        shm.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype), thread, logging_info=log)
        return token

    original_get = cb._get

    @functools.wraps(original_get)
    def get(token, device_id, grid_point_coords, thread_id, allocation_key_as_array, transforms, *args, **kwargs):
        transforms, perm = _split_transpose(cb._remove_noop_transforms(transforms))
        token, value = original_get(
            token, device_id, grid_point_coords, thread_id, allocation_key_as_array, transforms, *args, **kwargs
        )
        return token, value if perm is None else value.transpose(perm)

    cb.wgmma = wgmma
    cb._get = get
    _installed = True
