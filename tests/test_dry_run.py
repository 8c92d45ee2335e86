"""--dry-run: parameter count and per-device memory from shapes, then an AOT compile on faked devices."""

import os
import pathlib
import re
import subprocess
import sys

from mx_jax import memory_estimate
from mx_jax.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _dry_run(*args):
    env = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-m", "mx_jax.train", "--dry-run", *args], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_8b_parameter_count_shapes_only():
    report = memory_estimate.estimate(load_config(str(ROOT / "configs/llama3_8b.yaml"), ["mesh.fsdp=1"]))
    assert report["n_params"] == 8_030_261_248  # Llama 3.1 8B: 8.03 B
    assert abs(report["params_gb"] - 4 * 8.03) < 0.1  # float32 masters on one device
    assert abs(report["copies_gb"] - 2 * (8.03 - 0.525)) < 0.05  # bf16 GEMM weights: all but the embedding


def test_70b_compiles_for_64_devices_it_does_not_have():
    out = _dry_run("--config", str(ROOT / "configs/llama3_70b.yaml"), "mesh.fsdp=64")
    assert "70,553,706,496" in out and "= 64 devices" in out
    assert "compiled train step for 64 fake CPU devices" in out
    args_gb = float(re.search(r"arguments\s+([\d.]+) GB", out).group(1))
    # parameters + two AdamW moments, f32, sharded 64 ways: 3 x 4 B x 70.55e9 / 64 = 13.23 GB, plus the bf16
    # copies of the GEMM weights (all but the 1.05e9 embedding entries and the norms): 2 B x 69.50e9 / 64 = 2.17 GB
    assert 15.3 < args_gb < 15.5
    assert re.search(r"fits H200 141GB\s+yes", out) and re.search(r"fits H100 80GB\s+no", out)


def test_70b_memory_shrinks_with_fsdp():
    one = memory_estimate.estimate(load_config(str(ROOT / "configs/llama3_70b.yaml"), ["mesh.fsdp=8"]))
    many = memory_estimate.estimate(load_config(str(ROOT / "configs/llama3_70b.yaml"), ["mesh.fsdp=64"]))
    assert abs(one["params_gb"] / many["params_gb"] - 8) < 0.05  # every large weight is fsdp-sharded
    assert many["devices"] == 64
