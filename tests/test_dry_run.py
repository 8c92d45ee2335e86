"""--dry-run: parameter count and per-device memory from shapes alone."""

import pathlib

from mx_jax import memory_estimate, train
from mx_jax.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_8b_parameter_count_without_allocating(capsys):
    assert train.main(["--config", str(ROOT / "configs/llama3_8b.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "8,030,261,248" in out  # Llama 3.1 8B: 8.03 B
    assert "per device" in out and "fits H200" in out


def test_70b_memory_shrinks_with_fsdp():
    one = memory_estimate.estimate(load_config(str(ROOT / "configs/llama3_70b.yaml"), ["mesh.fsdp=8"]))
    many = memory_estimate.estimate(load_config(str(ROOT / "configs/llama3_70b.yaml"), ["mesh.fsdp=64"]))
    assert abs(one["n_params"] - 70.55e9) / 70.55e9 < 0.005
    assert abs(one["params_gb"] / many["params_gb"] - 8) < 0.05  # every large weight is fsdp-sharded
    assert many["devices"] == 64
