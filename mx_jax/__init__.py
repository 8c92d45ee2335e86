"""mx_jax: a JAX/Pallas training stack for Llama-style dense and MoE models with fp8 and MXFP8 on Hopper."""

__version__ = "0.1.0"
