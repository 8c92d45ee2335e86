"""Pallas GPU kernels for mx_jax. Each module is reference -> kernel -> dispatcher; this file re-exports the
dispatchers.

A dispatcher shares its module's name, so after this import `pallas_kernels.fp8_matmul` is the function: reach a
module's other names with `from pallas_kernels.fp8_matmul import TileConfig` or
`importlib.import_module("pallas_kernels.fp8_matmul")`, never `import pallas_kernels.fp8_matmul as m`.
"""

from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.quantize import quantize, quantize_dual, quantize_t

__all__ = ["fp8_matmul", "quantize", "quantize_dual", "quantize_t"]
