"""Test setup: 8 fake CPU devices (set before jax is imported), and the `gpu` / `slow` markers."""

import os
import shutil
import tempfile

# Must happen before jax initialises its backends. Tests that need another device count run a subprocess.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if os.environ.get("MX_JAX_TEST_GPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tests.helpers import FAST_CPU_COMPILE  # noqa: E402  (imports jax, whose backends start later)

    if FAST_CPU_COMPILE not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + FAST_CPU_COMPILE
else:
    # The GPU tests' own process takes GPU memory as it needs it, not JAX's 75% up front: several GPU tests start a
    # trainer process (90% of what is free), which found too little left after in-process GPU tests had run
    # (test_cli's deterministic repeat, out of memory on 2 x H200, session 37).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One XLA compilation cache for the run, shared by the xdist workers and the trainer processes the tests start (they
# inherit the environment): many tests train the same tiny model again (a resume, a second process, a restored
# checkpoint), and each compile of its step and of Orbax's slicing ops cost seconds of a 2-core CI machine. A fresh
# directory per run (no state from earlier runs), removed by the process that made it. jax keys each entry on the
# HLO, the compile options, the devices and its own version.
_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mx_jax_test_xla_cache_")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_unconfigure(config):
    if _XLA_CACHE is not None:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with MX_JAX_TEST_GPU=1 on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
