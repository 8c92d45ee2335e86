"""Config: YAML tree = dataclass tree = dotted overrides; errors name the key; nothing written on error."""

import pathlib

import pytest
import yaml

from mx_jax import train
from mx_jax.config import ConfigError, load_config, to_yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_defaults_yaml_overrides_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("steps: 7\noptim:\n  lr_peak: 1.0e-3\nmodel:\n  n_layers: 3\n")
    cfg = load_config(str(f), ["optim.lr_peak=2e-3", "mesh.fsdp=4", "quant.modules=attn,head"])
    assert cfg.steps == 7 and cfg.model.n_layers == 3  # YAML over defaults
    assert cfg.optim.lr_peak == 2e-3 and cfg.mesh.fsdp == 4  # CLI over YAML; "2e-3" parsed as a float
    assert cfg.quant.modules == ("attn", "head")
    assert cfg.run_dir == "runs/c"


def test_unknown_key_names_it_and_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lr_pek'; did you mean 'optim.lr_peak'"):
        load_config(None, ["optim.lr_pek=1"])
    f = tmp_path / "c.yaml"
    f.write_text("modle:\n  d_model: 8\n")
    with pytest.raises(ConfigError, match=r"'modle'; did you mean 'model'"):
        load_config(str(f))


@pytest.mark.parametrize("override, key", [
    ("steps=ten", "steps"),
    ("model.remat=sometimes", "model.remat"),
    ("optim.lr_peak=fast", "optim.lr_peak"),
    ("log.tensorboard=maybe", "log.tensorboard"),
    ("model.n_kv_heads=3", "model.n_kv_heads"),  # does not divide n_heads=8
    ("data.grad_accum_steps=5", "data.grad_accum_steps"),  # does not divide batch 32
    ("ckpt.resume=yesterday", "ckpt.resume"),
    ("quant.recipe=fp4", "quant.recipe"),
    ("quant.expert_min_rows=-1", "quant.expert_min_rows"),
    ("quant.expert_min_rows=many", "quant.expert_min_rows"),
    ("steps=4.5", "steps"),  # not truncated to 4
    ("optim.lr_peak=inf", "optim.lr_peak"),  # would write non-finite weights
    ("optim.b1=nan", "optim.b1"),
    ("optim.eps=-1e-8", "optim.eps"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"),
    ("optim.decay_steps=-5", "optim.decay_steps"),
    ("model.init_std=-0.02", "model.init_std"),
    ("model.norm_eps=-1e-5", "model.norm_eps"),
    ("model.head_dim=-8", "model.head_dim"),
    ("data.eval_batches=0", "data.eval_batches"),  # the eval loss would be the mean of nothing
    ("model.moe.n_experts=-1", "model.moe.n_experts"),
    ("log.peak_tflops=-1", "log.peak_tflops"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, [override])


@pytest.mark.parametrize("override, key", [
    ("model.moe.d_expert=-4", "model.moe.d_expert"),
    ("model.moe.n_shared=-1", "model.moe.n_shared"),
    ("model.moe.z_loss_coef=-1", "model.moe.z_loss_coef"),
])
def test_bad_moe_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, ["model.moe.n_experts=4", override])


def test_integral_floats_are_ints():
    assert load_config(None, ["steps=1e3", "data.seq_len=64.0"]).steps == 1000


def test_bad_files_name_the_problem(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("steps: 5 # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.yaml' is not UTF-8"):
        load_config(str(f))
    f = tmp_path / "dup.yaml"
    f.write_text("optim:\n  lr_peak: 1.0e-3\nsteps: 5\noptim:\n  warmup_steps: 2\n")
    with pytest.raises(ConfigError, match="dup.yaml.*duplicate key 'optim'"):
        load_config(str(f))  # last-one-wins would silently drop lr_peak


@pytest.mark.parametrize("overrides, key", [
    (["mesh.expert=8", "mesh.fsdp=1", "model.moe.n_experts=4"], "'mesh.expert'"),  # 4 experts over 8 devices
    (["mesh.expert=8", "mesh.fsdp=1", "model.moe.n_experts=8", "model.moe.gpus_per_node=3"],
     "'model.moe.gpus_per_node'"),
])
def test_expert_layout_is_checked_against_the_mesh(tmp_path, capsys, overrides, key):
    assert train.main([f"run_dir={tmp_path / 'run'}", *overrides]) == 2
    assert key in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_bad_input_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train.main([f"run_dir={run_dir}", "optim.lr_pek=1"]) == 2
    assert "optim.lr_peak" in capsys.readouterr().err
    assert not run_dir.exists()
    # a mesh that does not fit the 8 devices fails before anything is written too
    assert train.main([f"run_dir={run_dir}", "mesh.fsdp=3"]) == 2
    assert "mesh" in capsys.readouterr().err
    assert not run_dir.exists()


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(str(ROOT / "configs/llama3_8b.yaml"), ["optim.lr_peak=1e-4"])
    f = tmp_path / "resolved.yaml"
    f.write_text(to_yaml(cfg))
    assert load_config(str(f)) == cfg
    assert yaml.safe_load(f.read_text())["model"]["rope_scaling"]["factor"] == 8.0


@pytest.mark.parametrize("name", ["llama3_debug", "llama3_1b", "llama3_8b", "llama3_70b"])
def test_shipped_configs_load(name):
    cfg = load_config(str(ROOT / f"configs/{name}.yaml"))
    if name != "llama3_debug":
        assert cfg.model.vocab_size == 128256 and cfg.model.rope_theta == 500000.0 and cfg.model.n_kv_heads == 8
