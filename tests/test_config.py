"""Config: YAML tree = dataclass tree = dotted overrides; errors name the key; nothing written on error."""

import dataclasses
import pathlib

import jax
import pytest
import yaml

from mx_jax import hf, llama, train
from mx_jax.config import ConfigError, MTPConfig, load_config, to_yaml
from mx_jax.moe import group_score_experts

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
    ("data.prefetch=-1", "data.prefetch"),
    ("model.moe.n_experts=-1", "model.moe.n_experts"),
    ("log.peak_tflops=-1", "log.peak_tflops"),
    ("seed=-1", "seed"),  # numpy's generator refused it on the data thread, after the run directory was written
    ("seed=18446744073709551616", "seed"),
    ("compile_cache=false", "compile_cache"),  # would be a directory named "false"
    ("log.wandb=[a]", "log.wandb"),
    ("model.mtp.depth=-1", "model.mtp.depth"),
    ("model.mtp.depth=512", "model.mtp.depth"),  # not below data.seq_len: no position would have a target
    ("model.mtp.loss_scale=-0.3", "model.mtp.loss_scale"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, [override])


@pytest.mark.parametrize("override, key", [
    ("model.moe.d_expert=-4", "model.moe.d_expert"),
    ("model.moe.n_shared=-1", "model.moe.n_shared"),
    ("model.moe.z_loss_coef=-1", "model.moe.z_loss_coef"),
    ("model.moe.routed_scale=0", "model.moe.routed_scale"),
])
def test_bad_moe_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, ["model.moe.n_experts=4", override])


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.route_groups=3"], "'model.moe.route_groups'.*divide n_experts=8"),
    (["model.moe.route_groups=4"], "'model.moe.route_top_groups'.*got 0"),
    (["model.moe.route_groups=4", "model.moe.route_top_groups=5"], "'model.moe.route_top_groups'.*got 5"),
    (["model.moe.route_groups=4", "model.moe.route_top_groups=1", "model.moe.top_k=3"],  # 2 experts per group
     "'model.moe.route_top_groups'.*top_k=3"),
    (["model.moe.route_top_groups=2"], "'model.moe.route_top_groups'.*needs model.moe.route_groups > 0"),
])
def test_group_limited_routing_is_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.moe.n_experts=8"] + overrides)
    ok = load_config(None, ["model.moe.n_experts=8", "model.moe.route_groups=4", "model.moe.route_top_groups=1"])
    assert (ok.model.moe.route_groups, ok.model.moe.route_top_groups) == (4, 1)


def test_saving_the_experts_gate_and_up_needs_the_compact_buffer():
    with pytest.raises(ConfigError, match="'model.moe.ep_save_gate_up'.*ep_buffer_factor > 0"):
        load_config(None, ["model.moe.n_experts=4", "model.moe.ep_save_gate_up=true", "model.moe.ep_buffer_factor=0"])
    assert load_config(None, ["model.moe.n_experts=4", "model.moe.ep_save_gate_up=true"]).model.moe.ep_save_gate_up


MLA = ["model.n_kv_heads=8", "model.mla.kv_rank=16", "model.mla.nope_dim=16", "model.mla.rope_dim=8"]


@pytest.mark.parametrize("overrides, key", [
    (["model.mla.rope_dim=7"], "model.mla.rope_dim"),  # odd nope_dim + rope_dim: not reported as model.head_dim
    (["model.mla.v_dim=0"], "model.mla.v_dim"),
    (["model.mla.q_rank=-1"], "model.mla.q_rank"),
    (["model.n_kv_heads=4"], "model.n_kv_heads"),
    (["model.head_dim=24"], "model.head_dim"),
    (["model.qk_norm=true"], "model.qk_norm"),
    (["model.attention_bias=true"], "model.attention_bias"),
    (["model.rope_scaling.mscale_all_dim=1"], "model.rope_scaling.mscale_all_dim"),  # without yarn
])
def test_latent_attention_is_checked(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, [*MLA, *overrides])


def test_latent_attention_takes_its_head_dims_from_model_mla():
    """Under model.mla, n_heads need not divide d_model (no head dim comes from it), and nope_dim + rope_dim may be
    odd (RoPE turns rope_dim only)."""
    m = load_config(None, [*MLA, "model.n_heads=6", "model.n_kv_heads=6", "model.d_model=64",
                           "model.mla.nope_dim=7"]).model
    assert (m.d_head, m.rope_dim, m.v_dim) == (15, 8, 128)
    with pytest.raises(ConfigError, match="'model.mla.q_rank'.*needs model.mla.kv_rank"):
        load_config(None, ["model.mla.q_rank=8"])


def test_integral_floats_are_ints():
    assert load_config(None, ["steps=1e3", "data.seq_len=64.0"]).steps == 1000


@pytest.mark.parametrize("overrides, key", [
    (["model.rope_scaling.low_freq_factor=0"], "model.rope_scaling.low_freq_factor"),  # rope_inv_freq divides by it
    (["model.rope_scaling.low_freq_factor=4"], "model.rope_scaling.low_freq_factor"),  # = high: divides by 0 too
    (["model.rope_scaling.original_max_len=0"], "model.rope_scaling.original_max_len"),
])
def test_llama31_rope_scaling_is_checked(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, ["model.rope_scaling.factor=8", *overrides])
    assert load_config(None, ["model.rope_scaling.factor=1", *overrides])  # off: the other keys are not read


@pytest.mark.parametrize("overrides, key", [
    (["model.rope_scaling.beta_slow=0"], "model.rope_scaling.beta_slow"),
    (["model.rope_scaling.beta_slow=40"], "model.rope_scaling.beta_slow"),  # above beta_fast 32
    (["model.rope_scaling.attention_factor=-1"], "model.rope_scaling.attention_factor"),
    (["model.rope_scaling.kind=ntk"], "model.rope_scaling.kind"),
])
def test_yarn_rope_scaling_is_checked(overrides, key):
    yarn = ["model.rope_scaling.kind=yarn", "model.rope_scaling.factor=4"]
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, [*yarn, *overrides])
    sc = load_config(None, [*yarn, "model.rope_scaling.low_freq_factor=0"]).model.rope_scaling  # llama3's: unread
    assert (sc.kind, sc.factor, sc.beta_fast, sc.beta_slow) == ("yarn", 4.0, 32.0, 1.0)


def test_yaml_merge_keys_fill_in_and_explicit_keys_win(tmp_path):
    f = tmp_path / "merge.yaml"
    f.write_text("small: &small {d_model: 64, n_heads: 2, n_layers: 3}\n"
                 "model:\n  <<: *small\n  n_layers: 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'small'"):
        load_config(str(f))  # the anchor's own key is still a key of the file
    f.write_text("model:\n  <<: {d_model: 64, n_heads: 2, n_kv_heads: 1, n_layers: 3}\n  n_layers: 1\n")
    m = load_config(str(f)).model
    assert (m.d_model, m.n_heads, m.n_kv_heads, m.n_layers) == (64, 2, 1, 1)
    f.write_text("compile_cache: false\n")  # YAML's boolean, where a directory is meant
    with pytest.raises(ConfigError, match="'compile_cache' expects a string, got False"):
        load_config(str(f))


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


def test_flags_go_anywhere_among_the_overrides():
    args = train.parse_args(["--config", "c.yaml", "steps=1", "--dry-run", "model.n_layers=1"])
    assert (args.config, args.dry_run, args.overrides) == ("c.yaml", True, ["steps=1", "model.n_layers=1"])


def test_a_path_the_run_cannot_take_is_a_config_error_before_anything_is_written(tmp_path, capsys):
    """cuDNN attention asked for on CPU (and in float32), and the Pallas kernels forced on shapes they do not tile:
    exit 2 naming the key, no traceback, no run directory contents beyond what a failed start leaves."""
    from tests.helpers import NO_IO, TINY

    run_dir = tmp_path / "run"
    assert train.main([*TINY, *NO_IO, f"run_dir={run_dir}", "steps=1", "model.attention=cudnn"]) == 2
    err = capsys.readouterr().err
    assert "'model.attention': cudnn needs an NVIDIA GPU" in err and "Traceback" not in err, err
    assert not run_dir.exists()
    assert train.main([*TINY, *NO_IO, f"run_dir={run_dir}", "steps=1", "quant.recipe=mxfp8", "quant.impl=pallas"]) == 2
    err = capsys.readouterr().err
    assert "'quant.impl': pallas forces that path" in err and "must be multiples of" in err, err
    assert not (run_dir / "config.yaml").exists()
    moe = [*TINY, *NO_IO, f"run_dir={tmp_path / 'moe'}", "steps=1", "model.moe.n_experts=4", "mesh.expert=2",
           "mesh.fsdp=1", "mesh.data=-1"]
    for override, key in (("model.moe.exchange=ragged", "'model.moe.exchange': ragged"),
                          ("model.moe.all_to_all=pallas", "'model.moe.all_to_all': pallas")):
        assert train.main([*moe, override]) == 2, override
        err = capsys.readouterr().err
        assert key in err and "runs on NVIDIA GPUs only, not cpu" in err and "Traceback" not in err, err
        assert not (tmp_path / "moe").exists()


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


@pytest.mark.parametrize("name", ["llama3_debug", "llama3_1b", "llama3_8b", "llama3_70b", "llama3_140m", "moe_debug",
                                  "mixtral_8x7b", "deepseek_moe_16b", "qwen3_30b_a3b", "mistral_7b",
                                  "qwen2_5_7b", "deepseek_v2_lite", "deepseek_v3"])
def test_shipped_configs_load(name):
    cfg = load_config(str(ROOT / f"configs/{name}.yaml"))
    m = cfg.model
    if name in ("llama3_1b", "llama3_8b", "llama3_70b"):
        assert m.vocab_size == 128256 and m.rope_theta == 500000.0 and m.n_kv_heads == 8
    if name in ("llama3_debug", "llama3_140m", "moe_debug"):  # the embedded byte corpus
        assert m.vocab_size == 256 and cfg.data.source == "embedded"
    if name == "moe_debug":
        assert (m.moe.n_experts, m.moe.top_k, m.moe.n_shared) == (8, 2, 1)
    if name == "mixtral_8x7b":
        assert (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads) == (32000, 4096, 32, 32, 8)
        assert (m.moe.n_experts, m.moe.top_k, m.moe.d_expert, m.moe.n_shared) == (8, 2, 14336, 0)
    if name == "deepseek_moe_16b":
        assert (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads) == (102400, 2048, 28, 16, 16)
        assert (m.moe.n_experts, m.moe.top_k, m.moe.d_expert, m.moe.n_shared) == (64, 6, 1408, 2)
    if name == "qwen3_30b_a3b":
        assert (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_head) == (151936, 2048, 48, 32, 4, 128)
        assert (m.moe.n_experts, m.moe.top_k, m.moe.d_expert, m.qk_norm) == (128, 8, 768, True)
    if name == "mistral_7b":  # mistralai/Mistral-7B-v0.3: 7,248,023,552 parameters
        assert (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.rope_theta) == (32768, 4096, 32, 32, 8,
                                                                                               1e6)
        assert llama.param_count(m) == 7_248_023_552
    if name == "qwen2_5_7b":  # Qwen/Qwen2.5-7B: 7,615,616,512 parameters (6.53 B without the embedding and head)
        dims = (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_head)
        assert dims == (152064, 3584, 28, 28, 4, 128)
        assert m.attention_bias and llama.param_count(m) == 7_615_616_512
        assert hf.model_type(m) == "qwen2"  # exported as Qwen2ForCausalLM
    if name == "deepseek_v2_lite":  # deepseek-ai/DeepSeek-V2-Lite: 15.7 B parameters
        a = m.mla
        assert (a.kv_rank, a.q_rank, a.nope_dim, a.rope_dim, a.v_dim, m.d_head, m.v_dim) == (512, 0, 128, 64, 128, 192,
                                                                                            128)
        # by hand, per layer: W_q (D, H (n + r)), W_kva (D, c + r), the latent's norm (c,), W_kvb (c, H (n + v)),
        # W_o (H v, D) and two norms; one dense layer (d_ff 10944), 26 of router + 64 routed + 2 shared experts
        attn = 2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048 + 2 * 2048
        routed = 64 * 2048 + 3 * 2048 * 1408 * 66
        by_hand = 27 * attn + 3 * 2048 * 10944 + 26 * routed + 2 * 102400 * 2048 + 2048
        assert llama.param_count(m) == by_hand == 15_706_484_224
    if name == "deepseek_v3":  # deepseek-ai/DeepSeek-V3: 671 B parameters, and 685 B with its MTP module
        a, e = m.mla, m.moe
        assert (a.q_rank, a.kv_rank, m.n_heads, e.n_experts, e.top_k, e.route_groups, e.route_top_groups) == \
            (1536, 512, 128, 256, 8, 8, 4)
        assert (e.score, e.routed_scale, e.normalize_top_k, e.n_dense_first, e.aux_loss_scope) == \
            ("sigmoid", 2.5, True, 3, "sequence")
        assert group_score_experts(e.top_k, e.n_experts, e.route_groups, e.route_top_groups) == 2  # V3's top-2
        d = 7168  # per layer: W_qa, its norm, W_qb, W_kva, its norm, W_kvb, W_o, two norms
        attn = d * 1536 + 1536 + 1536 * 128 * 192 + d * 576 + 512 + 512 * 128 * 256 + 128 * 128 * d + 2 * d
        moe = 256 * d + 3 * d * 2048 * 257
        by_hand = 61 * attn + 3 * 3 * d * 18432 + 58 * moe + 2 * 129280 * d + d
        assert llama.param_count(dataclasses.replace(m, mtp=MTPConfig())) == by_hand == 671_026_404_352
        # the MTP module: W_eh (2D, D), a MoE layer and three norms; it shares the embedding and the head, of which
        # the checkpoint stores copies: 684.5 B in all, published as 685 B
        mtp = 2 * d * d + attn + moe + 3 * d
        assert m.mtp.depth == 1 and llama.param_count(m) == by_hand + mtp == 682_636_472_320
        assert abs(by_hand + mtp + 2 * 129280 * d - 685e9) < 1e9
        assert cfg.data.batch_size % cfg.data.grad_accum_steps == 0
    first, groups, per_group = llama.layer_kinds(m)
    assert first + groups * per_group == m.n_layers


def _published_moe_count(vocab, d, n_layers, n_heads, n_kv_heads, d_head, d_dense, n_dense, n_experts, d_expert,
                         n_shared):
    """Parameters by hand: untied embedding and head, per layer q/k/v/o + 2 RMSNorm scales, then a SwiGLU MLP
    (dense layers) or router + routed experts + shared experts (3 matrices each), and the final norm."""
    attn = d * n_heads * d_head * 2 + d * n_kv_heads * d_head * 2 + 2 * d
    dense = attn + 3 * d * d_dense
    moe = attn + d * n_experts + 3 * d * d_expert * (n_experts + n_shared)
    return 2 * vocab * d + n_dense * dense + (n_layers - n_dense) * moe + d


@pytest.mark.parametrize("name, published, by_hand", [
    # Mixtral-8x7B: 46.7 B total (Mistral AI; Jiang et al. 2024, "Mixtral of Experts").
    ("mixtral_8x7b", 46.7e9, _published_moe_count(32000, 4096, 32, 32, 8, 128, 0, 0, 8, 14336, 0)),
    # DeepSeekMoE-16B: 16.4 B total (Dai et al. 2024); first layer dense (d_ff 10944), then 64 routed + 2 shared.
    ("deepseek_moe_16b", 16.4e9, _published_moe_count(102400, 2048, 28, 16, 16, 128, 10944, 1, 64, 1408, 2)),
])
def test_moe_parameter_counts_match_the_published_figures(name, published, by_hand):
    from flax import nnx

    cfg = load_config(str(ROOT / f"configs/{name}.yaml"))
    abstract = nnx.eval_shape(lambda: llama.Llama(cfg.model, rngs=nnx.Rngs(0)))  # shapes only: nothing allocated
    n = sum(x.size for x in jax.tree.leaves(llama.params_of(abstract)))
    assert n == by_hand  # mixtral 46,702,792,704; deepseek 16,375,728,128 (16.38 B, 0.15% under 16.4 B)
    assert abs(n - published) / published < 0.01
    assert llama.param_count(cfg.model) == n


def test_deepseek_moe_16b_first_layer_dense_then_moe():
    from flax import nnx

    cfg = load_config(str(ROOT / "configs/deepseek_moe_16b.yaml")).model
    assert llama.layer_kinds(cfg) == (1, 27, 1)  # 1 dense layer first, then 27 MoE layers, one per group
    params = llama.params_of(nnx.eval_shape(lambda: llama.Llama(cfg, rngs=nnx.Rngs(0))))
    dense, moe = params["dense_blocks"], params["blocks"]
    assert set(dense) == {"attn", "attn_norm", "mlp", "mlp_norm"} and dense["mlp"]["w_gate"].shape == (1, 2048, 10944)
    assert set(moe) == {"attn", "attn_norm", "moe", "mlp_norm"}
    assert moe["moe"]["w_gate"].shape == (27, 64, 2048, 1408) and moe["moe"]["router"].shape == (27, 2048, 64)
    assert moe["moe"]["shared"]["w_gate"].shape == (27, 2048, 2 * 1408)
    # Mixtral: every layer MoE, no dense blocks
    mixtral = load_config(str(ROOT / "configs/mixtral_8x7b.yaml")).model
    assert llama.layer_kinds(mixtral) == (0, 32, 1)
