"""What the kernel dispatchers need to know about the device they run on.

- `compute_capability()`: (major, minor) of the first device when it is an NVIDIA GPU, else None.
- `kernels_apply()`: impl="auto" may run a Hopper kernel: an sm_90 GPU, and no SPMD partitioner that would have to
  split the kernel's custom call (a multi-device mesh set outside shard_map). Inside shard_map every array is
  local; outside, XLA's own ops are used because the partitioner splits those and cannot split a Mosaic kernel.
- `num_sms(interpret)`: the persistent grid's size: the abstract device's cores when tracing under a mesh (AOT, and
  inside shard_map), the GPU's SM count, or 2 when interpreted on CPU (so every CTA walks several tiles, as on
  the GPU).
"""

from __future__ import annotations

import jax


def compute_capability() -> tuple[int, int] | None:
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    if dev.platform != "gpu" or not cc:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def on_hopper() -> bool:
    return compute_capability() == (9, 0)


def partitioned_context() -> bool:
    """A multi-device mesh is set and we are not inside shard_map (all axes Manual there)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return False
    return not all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


def kernels_apply() -> bool:
    return on_hopper() and not partitioned_context()


def num_sms(interpret) -> int:
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and abstract.num_cores:  # (a CPU mesh's abstract device has num_cores None)
        return abstract.num_cores
    dev = jax.devices()[0]
    if interpret is not None or dev.platform != "gpu":
        return 2
    return dev.core_count
