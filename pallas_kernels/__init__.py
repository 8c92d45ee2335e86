"""Pallas GPU kernels for mx_jax. Each module is reference -> kernel -> dispatcher; this file re-exports the dispatchers."""
