"""HF Llama, Mixtral, DeepSeekMoE, DeepSeek-V2, DeepSeek-V3 and Qwen3 interop: exact round trips of checkpoints the test
writes in HF layout, the key/shape errors, Orbax import/export, fp8 checkpoints, and logits against transformers' Llama,
Mixtral, DeepSeek-V2, DeepSeek-V3, Qwen3 and Qwen3-MoE models and DeepSeekMoE's published model (kept in tests/data;
live where torch and transformers are installed)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from mx_jax import hf  # noqa: E402
from mx_jax.config import ConfigError, ModelConfig, MTPConfig, RopeScaling  # noqa: E402
from mx_jax.llama import Llama, buffers_of, params_of  # noqa: E402
from mx_jax.train import train  # noqa: E402
from tests.helpers import NO_IO, tiny_config  # noqa: E402

from tests.transformers_golden import (DEEPSEEK_CONFIG, DEEPSEEK_V2_CONFIG, DEEPSEEK_V2_Q_LORA_CONFIG,  # noqa: E402
                                       DEEPSEEK_V3_CONFIG, DEEPSEEK_V3_HALVES_CONFIG, HF_CONFIG, MISTRAL_CONFIG,
                                       MIXTRAL_CONFIG, PHI3_CONFIG, QWEN2_CONFIG, QWEN3_CONFIG, QWEN3_MOE_CONFIG)


def _hf_tensors(c: dict, dtype, seed: int = 0, tied: bool = False) -> dict[str, np.ndarray]:
    """Fresh random weights under HF's names and (out, in) shapes, norms included (never ones)."""
    rng = np.random.default_rng(seed)
    D, F, V, K = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    HK, GK = c["num_attention_heads"] * K, c["num_key_value_heads"] * K

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    out = {"model.embed_tokens.weight": r(V, D)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": r(D), p + "self_attn.q_proj.weight": r(HK, D),
                    p + "self_attn.k_proj.weight": r(GK, D), p + "self_attn.v_proj.weight": r(GK, D),
                    p + "self_attn.o_proj.weight": r(D, HK), p + "post_attention_layernorm.weight": r(D),
                    p + "mlp.gate_proj.weight": r(F, D), p + "mlp.up_proj.weight": r(F, D),
                    p + "mlp.down_proj.weight": r(D, F)})
    out["model.norm.weight"] = r(D)
    if not tied:
        out["lm_head.weight"] = r(V, D)
    return out


def _write_hf(path: pathlib.Path, c: dict, tensors: dict, sharded: bool) -> None:
    """config.json + one model.safetensors, or one shard per layer (embedding with layer 0, head with the last)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(c, indent=2))
    if not sharded:
        save_file(tensors, str(path / hf.SINGLE_FILE), metadata={"format": "pt"})
        return
    n = c["num_hidden_layers"]
    groups: list[dict] = [{} for _ in range(n)]
    for k, v in tensors.items():
        layer = int(k.split(".")[2]) if k.startswith("model.layers.") else (0 if "embed" in k else n - 1)
        groups[layer][k] = v
    weight_map = {}
    for j, g in enumerate(groups):
        name = f"model-{j + 1:05d}-of-{n:05d}.safetensors"
        save_file(g, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in g})
    total = sum(v.nbytes for v in tensors.values())
    (path / hf.INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def _read_all(path: pathlib.Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(_read_all_file(f))
    return out


def _read_all_file(f: pathlib.Path) -> dict[str, np.ndarray]:
    with safe_open(str(f), framework="np") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)  # bitwise


# ---------------------------------------------------------------------------------------------------------------
# Layout and exact round trips


def test_config_maps_both_ways():
    cfg = hf.config_from_hf(HF_CONFIG)
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_ff) == \
        (96, 48, 3, 4, 2, 8, 80)
    assert cfg.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=16)
    assert (cfg.rope_theta, cfg.norm_eps) == (10000.0, 1e-5)
    back = hf.config_to_hf(cfg, "float32", HF_CONFIG)
    assert back == HF_CONFIG  # the base's other keys (token ids, max positions) survive
    documents = dataclasses.replace(cfg, eos_id=0)  # trained on data whose documents end with token 0
    assert hf.config_to_hf(documents, "float32")["eos_token_id"] == 0
    assert hf.config_to_hf(documents, "float32", {**HF_CONFIG, "eos_token_id": 2})["eos_token_id"] == 2
    assert "eos_token_id" not in hf.config_to_hf(cfg, "float32")
    # transformers 5 spelling: rope_parameters with rope_theta inside, no head_dim (= hidden / heads).
    v5 = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_scaling", "rope_theta", "head_dim")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    cfg5 = hf.config_from_hf(v5)
    assert (cfg5.head_dim, cfg5.d_head, cfg5.rope_theta, cfg5.rope_scaling) == (0, 12, 500000.0, RopeScaling())


def test_param_shapes_pin_the_model():
    cfg = hf.config_from_hf(HF_CONFIG)
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    got = jax.tree.map(lambda x: tuple(x.shape), params_of(abstract))
    assert got == hf.param_shapes(cfg)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_single_file_roundtrip_is_byte_exact(tmp_path, dtype):
    c = {**HF_CONFIG, "torch_dtype": np.dtype(dtype).name}
    tensors = _hf_tensors(c, dtype)
    _write_hf(tmp_path / "src", c, tensors, sharded=False)
    params, cfg = hf.load_hf_llama(tmp_path / "src")
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))  # ModelConfig.param_dtype
    written = hf.export_hf_llama(params, cfg, tmp_path / "out", dtype=np.dtype(dtype).name,
                                 hf_config=json.loads((tmp_path / "src" / "config.json").read_text()))
    assert [p.name for p in written] == [hf.SINGLE_FILE, "config.json"]
    assert (tmp_path / "out" / hf.SINGLE_FILE).read_bytes() == (tmp_path / "src" / hf.SINGLE_FILE).read_bytes()
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == c


def test_sharded_roundtrip_maps_every_tensor(tmp_path):
    c = HF_CONFIG
    tensors = _hf_tensors(c, ml_dtypes.bfloat16, seed=1)
    _write_hf(tmp_path / "src", c, tensors, sharded=True)
    params, cfg = hf.load_hf_llama(tmp_path / "src")
    # The mapping itself, written out independently of hf.LAYOUT.
    f32 = lambda k: tensors[k].astype(np.float32)  # noqa: E731
    np.testing.assert_array_equal(params["embed"], f32("model.embed_tokens.weight"))
    np.testing.assert_array_equal(params["head"], f32("lm_head.weight").T)
    np.testing.assert_array_equal(params["final_norm"]["scale"], f32("model.norm.weight"))
    b = params["blocks"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        np.testing.assert_array_equal(b["attn_norm"]["scale"][i], f32(p + "input_layernorm.weight"))
        np.testing.assert_array_equal(b["mlp_norm"]["scale"][i], f32(p + "post_attention_layernorm.weight"))
        for ours, theirs in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")):
            np.testing.assert_array_equal(b["attn"][ours][i], f32(p + f"self_attn.{theirs}_proj.weight").T)
        for ours, theirs in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down")):
            np.testing.assert_array_equal(b["mlp"][ours][i], f32(p + f"mlp.{theirs}_proj.weight").T)
    # Export in shards of at most ~one layer: several files and an index that names every tensor once.
    written = hf.export_hf_llama(params, cfg, tmp_path / "out", dtype="bfloat16", max_shard_bytes=20_000)
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "out" / hf.SINGLE_FILE).exists()
    index = json.loads((tmp_path / "out" / hf.INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    for f in shards:
        assert f.stat().st_size <= 20_000 + 4096  # the limit counts tensor bytes, not the JSON header
    _assert_same_tensors(_read_all(tmp_path / "out"), tensors)
    # ... and the export reads back to the same params, and re-exports to identical files.
    params2, cfg2 = hf.load_hf_llama(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    hf.export_hf_llama(params2, cfg2, tmp_path / "out2", dtype="bfloat16", max_shard_bytes=20_000)
    for f in written:
        assert (tmp_path / "out2" / f.name).read_bytes() == f.read_bytes(), f.name


def test_tied_embeddings_are_untied_by_copy(tmp_path):
    c = {**HF_CONFIG, "tie_word_embeddings": True}
    tensors = _hf_tensors(c, np.float32, seed=2, tied=True)
    _write_hf(tmp_path / "src", c, tensors, sharded=False)
    params, cfg = hf.load_hf_llama(tmp_path / "src")
    np.testing.assert_array_equal(params["head"], tensors["model.embed_tokens.weight"].T)
    assert not np.shares_memory(params["head"], params["embed"])
    hf.export_hf_llama(params, cfg, tmp_path / "out", dtype="float32")
    out = _read_all(tmp_path / "out")
    np.testing.assert_array_equal(out["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    # A tied config beside a stored lm_head that differs: transformers 5 unties them and reads the stored head
    head = np.random.default_rng(3).standard_normal(tensors["model.embed_tokens.weight"].shape).astype(np.float32)
    _write_hf(tmp_path / "stored", c, {**tensors, "lm_head.weight": head}, sharded=True)
    params, _ = hf.load_hf_llama(tmp_path / "stored")
    np.testing.assert_array_equal(params["head"], head.T)


def test_keys_a_config_lacks_take_its_config_classes_defaults():
    """A config.json without rope_theta, rms_norm_eps, num_key_value_heads or head_dim means the defaults of its
    model_type's config class, which differ from LlamaConfig's for Mixtral (1e6, 1e-5, 8), Mistral, Phi-3, Qwen3 and
    Qwen3-MoE (a Mixtral imported with Llama's rope_theta and eps moved the logits by 5.5); against transformers'
    classes where it is installed."""
    from tests import transformers_golden as golden

    trimmed = {k: v for k, v in golden.MIXTRAL_CONFIG.items()
               if k not in ("rope_theta", "rope_scaling", "rms_norm_eps", "num_key_value_heads")}
    cfg = hf.config_from_hf(trimmed)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.n_kv_heads) == (1e6, 1e-5, 8)
    assert hf.config_from_hf({**trimmed, "num_key_value_heads": None}).n_kv_heads == 8
    qwen3 = {k: v for k, v in golden.QWEN3_CONFIG.items() if k != "head_dim"}
    assert hf.config_from_hf(qwen3).d_head == 128  # not hidden / heads = 12
    try:
        import transformers
    except ImportError:
        return
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "mixtral": "MixtralConfig", "phi3": "Phi3Config",
               "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}
    for model_type, name in classes.items():
        d = getattr(transformers, name)().to_dict()
        theta = (d.get("rope_parameters") or {}).get("rope_theta") or d.get("rope_theta")
        want = {"rms_norm_eps": d["rms_norm_eps"], "rope_theta": theta}
        if d["num_key_value_heads"] != d["num_attention_heads"]:
            want["num_key_value_heads"] = d["num_key_value_heads"]
        if d.get("head_dim") not in (None, d["hidden_size"] // d["num_attention_heads"]):
            want["head_dim"] = d["head_dim"]
        ours = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, **hf.HF_CLASS_DEFAULTS.get(model_type, {})}
        assert {k: ours.get(k) for k in want} == want, model_type


def test_given_config_keeps_its_dtypes_and_must_match_shapes(tmp_path):
    _write_hf(tmp_path / "src", HF_CONFIG, _hf_tensors(HF_CONFIG, np.float32), sharded=False)
    base = hf.config_from_hf(HF_CONFIG)
    mine = dataclasses.replace(base, param_dtype="bfloat16", compute_dtype="float32", head_dim=8)
    params, cfg = hf.load_hf_llama(tmp_path / "src", mine)
    assert cfg == mine and params["embed"].dtype == jnp.bfloat16
    with pytest.raises(ConfigError, match=r"model\.d_ff.*96.*80"):
        hf.load_hf_llama(tmp_path / "src", dataclasses.replace(base, d_ff=96))
    with pytest.warns(UserWarning, match="rope_theta"):
        _, cfg = hf.load_hf_llama(tmp_path / "src", dataclasses.replace(base, rope_theta=1e6))
    assert cfg.rope_theta == 1e6


# ---------------------------------------------------------------------------------------------------------------
# Errors name the file, the key and the shapes


def test_missing_wrong_shape_and_unexpected_tensors(tmp_path):
    tensors = _hf_tensors(HF_CONFIG, np.float32)
    key = "model.layers.1.mlp.up_proj.weight"
    missing = {k: v for k, v in tensors.items() if k != key}
    _write_hf(tmp_path / "missing", HF_CONFIG, missing, sharded=True)
    with pytest.raises(hf.HFFormatError, match=rf"'{key}' is missing"):
        hf.load_hf_llama(tmp_path / "missing")
    wrong = {**tensors, key: tensors[key][:, :-1].copy()}
    _write_hf(tmp_path / "wrong", HF_CONFIG, wrong, sharded=False)
    with pytest.raises(hf.HFFormatError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' "
                                               r"has shape \(80, 47\); config.json implies \(80, 48\)"):
        hf.load_hf_llama(tmp_path / "wrong")
    extra = {**tensors, "model.layers.3.mlp.up_proj.weight": tensors[key],
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}  # the latter is ignored
    _write_hf(tmp_path / "extra", HF_CONFIG, extra, sharded=False)
    with pytest.raises(hf.HFFormatError, match=r"no place.*model\.layers\.3\.mlp\.up_proj\.weight"):
        hf.load_hf_llama(tmp_path / "extra")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(hf.HFFormatError, match="only safetensors"):
        hf.load_hf_llama(tmp_path / "nothing")
    # a download cut short: the header of one file (single), the data of a shard (sharded)
    (tmp_path / "nothing" / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(hf.HFFormatError, match=r"nothing/model.safetensors: not a readable safetensors file "
                                               r"\(SafetensorError: .*is the download whole"):
        hf.load_hf_llama(tmp_path / "nothing")
    _write_hf(tmp_path / "cut", HF_CONFIG, tensors, sharded=True)
    shard = max((tmp_path / "cut").glob("*.safetensors"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    with pytest.raises(hf.HFFormatError, match=rf"{shard.name}: (not a readable safetensors file|cannot read tensor)"):
        hf.load_hf_llama(tmp_path / "cut")


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}}, "yarn with truncate=False"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"model_type": "gemma"}, "model_type is 'gemma'"),
    ({"hidden_size": None}, "missing key 'hidden_size'"),
])
def test_unsupported_configs_are_refused(change, match):
    with pytest.raises(hf.HFFormatError, match=match):
        hf.config_from_hf({**HF_CONFIG, **change})


def test_model_type_missing_is_llama_only_if_architectures_agree():
    c = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    assert hf.config_from_hf(c).d_model == 48
    with pytest.raises(hf.HFFormatError, match=r"no model_type, and architectures is \['Qwen2ForCausalLM'\]"):
        hf.config_from_hf({**c, "architectures": ["Qwen2ForCausalLM"]})


@pytest.mark.parametrize("text, match", [("{\"vocab_size\": 96,", "config.json is not valid JSON"),
                                         ("[1, 2]", "config.json must hold a JSON object, got list")])
def test_bad_config_json_names_the_file(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(hf.HFFormatError, match=match):
        hf.load_hf_llama(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / hf.INDEX_FILE).write_text("[]")
    with pytest.raises(hf.HFFormatError, match="index.json must hold a JSON object"):
        hf.load_hf_llama(tmp_path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_checks_params_and_existing_files(tmp_path):
    cfg = hf.config_from_hf(HF_CONFIG)
    params = jax.tree.map(lambda s: np.random.default_rng(0).standard_normal(s).astype(np.float32),
                          hf.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    bad = {**params, "blocks": {**params["blocks"], "mlp": {**params["blocks"]["mlp"], "w_up": params["head"]}}}
    with pytest.raises(ValueError, match=r"params\['blocks/mlp/w_up'\] has shape \(48, 96\).*\(3, 48, 80\)"):
        hf.export_hf_llama(bad, cfg, tmp_path / "bad")
    with pytest.raises(ValueError, match="missing.*head"):
        hf.export_hf_llama({k: v for k, v in params.items() if k != "head"}, cfg, tmp_path / "bad")
    hf.export_hf_llama(params, cfg, tmp_path / "out")
    with pytest.raises(FileExistsError, match="overwrite"):
        hf.export_hf_llama(params, cfg, tmp_path / "out")
    hf.export_hf_llama(params, cfg, tmp_path / "out", dtype="float32", max_shard_bytes=50_000, overwrite=True)
    assert not (tmp_path / "out" / hf.SINGLE_FILE).exists()  # the old single file went away
    before = {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()}
    assert all((f.stat().st_mode & 0o777) == (0o666 & ~_umask()) for f in (tmp_path / "out").iterdir())
    # an export that fails once writing has begun leaves the old one whole, and nothing beside it
    calls = []

    def fails_late(x, dtype):
        calls.append(1)
        if len(calls) > 5:
            raise OSError("disk full")
        return np.asarray(x, dtype)

    import unittest.mock
    with unittest.mock.patch.object(hf, "_host", fails_late), pytest.raises(OSError, match="disk full"):
        hf.export_hf_llama(params, cfg, tmp_path / "out", max_shard_bytes=20_000, overwrite=True)
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()} == before
    assert sorted(f.name for f in tmp_path.iterdir()) == ["out"]
    # a model HF cannot hold is refused before anything is written, an old export or not
    biased = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, n_experts=4, top_k=2, bias_update_rate=0.01))
    moe_params = jax.tree.map(lambda sh: np.zeros(sh, np.float32), hf.param_shapes(biased),
                              is_leaf=lambda x: isinstance(x, tuple))
    with pytest.raises(ConfigError, match="bias_update_rate"):
        hf.export_hf_llama(moe_params, biased, tmp_path / "out", overwrite=True)
    assert {f.name: f.read_bytes() for f in (tmp_path / "out").iterdir()} == before
    with pytest.raises(ConfigError, match="bias_update_rate"):
        hf.export_hf_llama(moe_params, biased, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    sigmoid = dataclasses.replace(cfg.moe, n_experts=4, n_shared=1, score="sigmoid")  # DeepSeek-V3's: no HF mapping
    with pytest.raises(ConfigError, match="model.moe.score.*DeepSeekMoE has moe.score='softmax'"):
        hf.export_hf_llama(params, dataclasses.replace(cfg, moe=sigmoid), tmp_path / "moe")
    assert not (tmp_path / "moe").exists()
    # Mixtral's form in all but group-limited routing, which Mixtral's config cannot say
    grouped = dataclasses.replace(cfg.moe, n_experts=4, top_k=2, route_groups=2, route_top_groups=1)
    assert hf.model_type(dataclasses.replace(cfg, moe=dataclasses.replace(grouped, route_groups=0,
                                                                           route_top_groups=0))) == "mixtral"
    with pytest.raises(ConfigError, match="model.moe.route_groups"):
        hf.export_hf_llama(params, dataclasses.replace(cfg, moe=grouped), tmp_path / "moe")
    scaled = dataclasses.replace(grouped, route_groups=0, route_top_groups=0, routed_scale=2.5)
    with pytest.raises(ConfigError, match="model.moe.routed_scale"):
        hf.export_hf_llama(params, dataclasses.replace(cfg, moe=scaled), tmp_path / "moe")
    assert not (tmp_path / "moe").exists()


# ---------------------------------------------------------------------------------------------------------------
# Orbax checkpoints, the CLI, and init_from


def test_cli_import_export_through_orbax(tmp_path):
    tensors = _hf_tensors(HF_CONFIG, ml_dtypes.bfloat16, seed=3)
    c = {**HF_CONFIG, "torch_dtype": "bfloat16"}
    _write_hf(tmp_path / "src", c, tensors, sharded=True)
    assert hf.main(["import", str(tmp_path / "src"), str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "checkpoints" / "0" / "state").is_dir()
    assert hf.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max-shard-bytes", "3e4"]) == 0
    _assert_same_tensors(_read_all(tmp_path / "out"), tensors)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == c  # hf_config.json carried the rest
    assert hf.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2  # exists, no --overwrite
    assert hf.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--step", "7"]) == 2
    step_dir = tmp_path / "ckpt" / "checkpoints" / "0"  # a step's directory and another --step: refused
    assert hf.main(["export", str(step_dir), str(tmp_path / "out2"), "--step", "5"]) == 2
    assert not (tmp_path / "out2").exists()
    before = (tmp_path / "ckpt" / "config.yaml").read_text()
    assert hf.main(["import", str(tmp_path / "src"), str(tmp_path / "ckpt")]) == 2  # a run dir is never overwritten
    assert (tmp_path / "ckpt" / "config.yaml").read_text() == before


def test_export_from_a_trainer_run(tmp_path):
    cfg = tiny_config(tmp_path / "run", "steps=1", "log.eval_every_steps=-1", "ckpt.async_save=false")
    result = train(cfg, jax.devices()[:2])
    assert hf.main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    params, mcfg = hf.load_hf_llama(tmp_path / "out", cfg.model)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), params, result.state["params"])


def test_init_from_places_hf_and_orbax_params_on_a_mesh(tmp_path):
    tensors = _hf_tensors(HF_CONFIG, np.float32, seed=4)
    _write_hf(tmp_path / "src", HF_CONFIG, tensors, sharded=False)
    want, cfg = hf.load_hf_llama(tmp_path / "src")
    mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
    shard = NamedSharding(mesh, P(None, "fsdp"))  # dim 1 divides by 2 for every leaf of this config

    def spec_for(shape):
        return shard if len(shape) > 1 else NamedSharding(mesh, P())

    shardings = jax.tree.map(spec_for, hf.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    hf.save_params(want, tmp_path / "ckpt")
    for src in (tmp_path / "src", tmp_path / "ckpt", tmp_path / "ckpt" / "checkpoints" / "0"):
        got, buffers = hf.init_from(src, cfg, shardings, {})
        jax.tree.map(lambda g, s: g.sharding == s or pytest.fail(f"{src}: sharding {g.sharding}"), got, shardings)
        jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), w), got, want)
        assert buffers == {}  # a dense model's
    host, _ = hf.init_from(tmp_path / "ckpt", cfg)
    assert isinstance(host["embed"], np.ndarray)
    with pytest.raises(ValueError, match=r"params\['embed'\] has shape \(96, 48\).*\(100, 48\)"):
        hf.load_params(tmp_path / "ckpt", dataclasses.replace(cfg, vocab_size=100))
    with pytest.raises(FileNotFoundError, match="no mx_jax checkpoint"):
        hf.init_from(tmp_path, cfg)


def _corner_shardings(cfg):
    """A (2, 2) mesh of axes a and b, and `cfg`'s parameters over it: the first dim over b and the last over a,
    where they divide (so that slices cut each tensor at both ends)."""
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])

    def spec_for(shape):
        spec = [None] * len(shape)
        if len(shape) > 1 and shape[0] % 2 == 0:
            spec[0] = "b"
        if shape[-1] % 2 == 0:
            spec[-1] = "a"
        return NamedSharding(mesh, P(*spec))

    return mesh, jax.tree.map(spec_for, hf.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))


@pytest.mark.parametrize("case", ["deepseek", "qwen3", "mixtral", "phi3", "deepseek_v2_q_lora", "deepseek_v3"])
def test_init_from_an_hf_directory_reads_only_each_devices_slices(tmp_path, case, monkeypatch):
    """init_from on a mesh (hf.load_hf_sharded): the same values as the whole read, placed as asked, over the
    stacked layer and expert axes and the transposed matrices alike, a tied head from the embedding, DeepSeek-V2's
    and V3's reordered rotary rows; and no tensor read whole, only the slices of the shards (but DeepSeek-V3's router
    biases, E floats each, which come as the buffers, placed as asked too)."""
    from tests import transformers_golden as golden

    want_case = golden.load()[case]
    golden.write(tmp_path / "hf", want_case["config"], golden.case_weights(want_case))
    want, cfg = hf.load_hf_llama(tmp_path / "hf")
    mesh, shardings = _corner_shardings(cfg)
    reads = []
    whole_read = hf._Weights.read
    monkeypatch.setattr(hf._Weights, "read", lambda self, key, index=None: reads.append((key, index)) or
                        whole_read(self, key, index))
    buffer_shardings = jax.tree.map(lambda s: NamedSharding(mesh, P(None, "a")), hf.buffer_shapes(cfg),
                                    is_leaf=lambda x: isinstance(x, tuple))
    got, buffers = hf.init_from(tmp_path / "hf", cfg, shardings, buffer_shardings)
    n_reads = len(reads)
    jax.tree.map(lambda g, s: g.sharding == s or pytest.fail(f"sharding {g.sharding}"), got, shardings)
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), w), got, want)
    jax.tree.map(lambda g, s: g.sharding == s or pytest.fail(f"sharding {g.sharding}"), buffers, buffer_shardings)
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), w), buffers,
                 hf.load_hf_buffers(tmp_path / "hf", cfg))
    biases = [key for key, _ in reads[:n_reads] if key.endswith("e_score_correction_bias")]
    assert len(biases) == (2 if case == "deepseek_v3" else 0)  # read whole, once each
    slices = [(key, index) for key, index in reads[:n_reads] if key not in biases]
    assert slices and all(index is not None for _, index in slices)
    embed = [index for key, index in slices if key == "model.embed_tokens.weight"]
    assert len(embed) == (8 if case == "qwen3" else 4)  # 4 shards of the embedding, and of a tied head
    assert all(i[0].stop - i[0].start == 128 and i[1].stop - i[1].start == 24 for i in embed)


# ---------------------------------------------------------------------------------------------------------------
# Against transformers: its logits kept in tests/data (every run), and a live model (where torch is installed)


def _our_logits(params: dict, cfg: ModelConfig, tokens: np.ndarray, buffers: dict | None = None) -> np.ndarray:
    """Float32 logits of the model; buffers: its MoE router biases (DeepSeek-V3's, hf.load_hf_buffers), default 0."""
    cfg = dataclasses.replace(cfg, compute_dtype="float32")
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    graphdef, _, _ = nnx.split(abstract, nnx.Param, ...)
    if buffers is None:
        buffers = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), buffers_of(abstract))
    model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, buffers))
    return np.asarray(model(jnp.asarray(tokens))[0])


def _check_against_transformers(tmp_path, arch: str, hf_config: dict, keep_config: bool = False) -> None:
    """A random transformers `<arch>ForCausalLM` of hf_config, imported: our logits equal transformers' (float32);
    our export (from hf_config, as `import` keeps it, with keep_config), read back by transformers, gives them
    again."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model_cls, config_cls = getattr(transformers, f"{arch}ForCausalLM"), getattr(transformers, f"{arch}Config")
    c = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    # initializer_range 0.15 gives logits of size ~4, so a wrong rope band or q/k layout moves them by ~5, not 5e-3.
    ref = model_cls(config_cls(**c, initializer_range=0.15))
    with torch.no_grad():  # HF initializes norms to ones and DeepSeek-V3's router biases to zeros; make them random
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.15 * torch.randn_like(b))
    ref = ref.float().eval()
    ref.config._attn_implementation = "eager"
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tokens = np.random.default_rng(0).integers(0, c["vocab_size"], (2, 40))  # 40 > original context 16
    with torch.no_grad():
        want = ref(torch.as_tensor(tokens)).logits.numpy()

    params, cfg = hf.load_hf_llama(tmp_path / "hf")
    buffers = hf.load_hf_buffers(tmp_path / "hf", cfg)
    np.testing.assert_allclose(_our_logits(params, cfg, tokens, buffers), want, atol=1e-4, rtol=0)  # float32
    hf.export_hf_llama(params, cfg, tmp_path / "ours", buffers=buffers, dtype="float32",
                       hf_config=hf_config if keep_config else None)
    if keep_config:
        assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == [f"{arch}ForCausalLM"]
    back = model_cls.from_pretrained(tmp_path / "ours", attn_implementation="eager").float()
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.as_tensor(tokens)).logits.numpy(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["llama", "llama_tied", "mixtral", "deepseek", "deepseek_top_k_normalized", "qwen3",
                                  "qwen3_moe", "qwen2", "mistral", "phi3", "qwen2_yarn", "llama_yarn", "deepseek_v2",
                                  "deepseek_v2_q_lora", "deepseek_v3", "deepseek_v3_halves"])
def test_logits_match_those_transformers_computed(tmp_path, case):
    """The checkpoint tests/transformers_golden.py gave transformers (config.json and safetensors in the Hub's
    layout, weights drawn again here from their recorded names and shapes), imported with its router biases: our
    float32 logits are the ones transformers computed from it (eager attention; the file says which versions)."""
    from tests import transformers_golden as golden

    want = golden.load()[case]
    golden.write(tmp_path / "hf", want["config"], golden.case_weights(want))
    params, cfg = hf.load_hf_llama(tmp_path / "hf")
    assert cfg.vocab_size == want["logits"].shape[-1] and 3 < np.abs(want["logits"]).max() < 10
    buffers = hf.load_hf_buffers(tmp_path / "hf", cfg)
    np.testing.assert_allclose(_our_logits(params, cfg, want["tokens"], buffers), want["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tmp_path, tied):
    _check_against_transformers(tmp_path, "Llama", {**HF_CONFIG, "tie_word_embeddings": tied})


# ---------------------------------------------------------------------------------------------------------------
# Mixtral (MixtralForCausalLM): the MoE block's router and experts

def test_mixtral_maps_router_and_experts_both_ways(tmp_path):
    cfg = hf.config_from_hf(MIXTRAL_CONFIG)
    assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.aux_loss_coef) == (4, 2, 0.04)  # HF's coef x top_k (moe.py)
    assert hf.config_to_hf(cfg, "float32")["router_aux_loss_coef"] == pytest.approx(0.02)
    shapes = hf.param_shapes(cfg)
    assert "mlp" not in shapes["blocks"] and shapes["blocks"]["moe"]["w_down"] == (3, 4, 80, 48)
    # the same shapes as the model builds
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    assert jax.tree.map(lambda x: tuple(x.shape), params_of(abstract)) == shapes
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
    hf.export_hf_llama(params, cfg, tmp_path / "hf", dtype="float32", max_shard_bytes=60_000)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == "mixtral" and written["architectures"] == ["MixtralForCausalLM"]
    index = json.loads((tmp_path / "hf" / hf.INDEX_FILE).read_text())["weight_map"]
    assert not any(".mlp." in k for k in index) and len(index) == 3 + 3 * (6 + 1 + 3 * 4)
    moe = params["blocks"]["moe"]
    for key, want in (("model.layers.2.block_sparse_moe.gate.weight", moe["router"][2].T),  # written out by hand
                      ("model.layers.1.block_sparse_moe.experts.3.w1.weight", moe["w_gate"][1, 3].T),
                      ("model.layers.0.block_sparse_moe.experts.2.w2.weight", moe["w_down"][0, 2].T),
                      ("model.layers.2.block_sparse_moe.experts.0.w3.weight", moe["w_up"][2, 0].T)):
        with safe_open(str(tmp_path / "hf" / index[key]), framework="np") as f:
            np.testing.assert_array_equal(f.get_tensor(key), want)
    back, cfg2 = hf.load_hf_llama(tmp_path / "hf")
    assert cfg2.moe == cfg.moe
    jax.tree.map(np.testing.assert_array_equal, back, params)
    # A trainer run starts from it (the config names the MoE; init_from checks the experts match).
    result = train(tiny_config(tmp_path / "run", "model.vocab_size=256", "model.d_model=48", "model.n_layers=3",
                               "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.d_ff=80",
                               "model.moe.n_experts=4", "model.moe.top_k=2", f"init_from={tmp_path / 'hf'}",
                               "steps=1", "optim.warmup_steps=0", "mesh.data=2", "mesh.fsdp=1", "mesh.expert=4",
                               *NO_IO))
    assert np.isfinite(result.metrics["loss"])
    with pytest.raises(ConfigError, match="model.moe.n_experts"):
        hf.load_hf_llama(tmp_path / "hf", dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, n_experts=8)))
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0  # the MoE keys reach config.yaml
    imported = yaml.safe_load((tmp_path / "imported" / "config.yaml").read_text())["model"]
    assert imported["moe"] == {"n_experts": 4, "top_k": 2, "aux_loss_coef": 0.04}


@pytest.mark.parametrize("change, match", [
    ({"sliding_window": 4096}, "sliding_window"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
])
def test_unsupported_mixtral_configs_are_refused(change, match):
    with pytest.raises(hf.HFFormatError, match=match):
        hf.config_from_hf({**MIXTRAL_CONFIG, **change})


def test_router_biases_block_export(tmp_path):
    cfg = hf.config_from_hf(MIXTRAL_CONFIG)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, bias_update_rate=0.01))
    with pytest.raises(ConfigError, match="bias_update_rate"):
        hf.config_to_hf(cfg, "float32")


def test_mixtral_logits_match_transformers(tmp_path):
    _check_against_transformers(tmp_path, "Mixtral", MIXTRAL_CONFIG)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeekMoE (DeepseekForCausalLM): dense first layers, routed experts of their own width, shared experts


def _deepseek_cfg() -> ModelConfig:
    return hf.config_from_hf(DEEPSEEK_CONFIG)


DEEPSEEK_TRAIN = ("model.vocab_size=256", "model.d_model=48", "model.n_layers=3", "model.n_heads=4",
                  "model.n_kv_heads=2", "model.d_ff=80", "model.moe.n_experts=6", "model.moe.top_k=3",
                  "model.moe.d_expert=24", "model.moe.n_shared=2", "model.moe.n_dense_first=1",
                  "model.moe.normalize_top_k=false", "model.rope_theta=10000", "model.norm_eps=1e-6")


def test_deepseek_config_maps_both_ways():
    cfg = _deepseek_cfg()
    m = cfg.moe
    assert (m.n_experts, m.top_k, m.d_expert, m.n_shared, m.n_dense_first, m.score, m.normalize_top_k,
            m.aux_loss_coef) == (6, 3, 24, 2, 1, "softmax", False, 0.001)
    assert (cfg.d_ff, cfg.d_head, cfg.head_dim) == (80, 12, 0)
    assert hf.model_type(cfg) == "deepseek"
    assert hf.config_to_hf(cfg, "float32", DEEPSEEK_CONFIG) == DEEPSEEK_CONFIG
    fresh = hf.config_to_hf(cfg, "float32")  # without a base: every key DeepSeek's code reads
    assert hf.config_from_hf(fresh) == cfg and "head_dim" not in fresh and fresh["n_shared_experts"] == 2
    none = hf.config_from_hf({**DEEPSEEK_CONFIG, "n_shared_experts": None, "first_k_dense_replace": 0})
    assert (none.moe.n_shared, none.moe.n_dense_first) == (0, 0)
    assert hf.config_to_hf(none, "float32")["n_shared_experts"] is None
    dense = hf.config_from_hf({**DEEPSEEK_CONFIG, "n_routed_experts": None})  # DeepSeek's dense models
    assert dense.moe.n_experts == 0 and dense.d_ff == 80
    # the shapes the model builds
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    assert jax.tree.map(lambda x: tuple(x.shape), params_of(abstract)) == hf.param_shapes(cfg)


@pytest.mark.parametrize("change, match", [
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear' is not supported"),
    ({"moe_intermediate_size": None}, "missing key 'moe_intermediate_size'"),
])
def test_unsupported_deepseek_configs_are_refused(change, match):
    with pytest.raises(hf.HFFormatError, match=match):
        hf.config_from_hf({**DEEPSEEK_CONFIG, **change})


def test_deepseek_export_names_each_tensor_and_reads_back(tmp_path):
    cfg = _deepseek_cfg()
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), hf.param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    hf.export_hf_llama(params, cfg, tmp_path / "hf", dtype="float32", max_shard_bytes=60_000)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == "deepseek" and written["architectures"] == ["DeepseekForCausalLM"]
    index = json.loads((tmp_path / "hf" / hf.INDEX_FILE).read_text())["weight_map"]
    # embedding, norm, head; layer 0 dense (9); layers 1-2: attention and norms (6), router, 6 x 3 experts, 3 shared
    assert len(index) == 3 + 9 + 2 * (6 + 1 + 18 + 3)
    moe, dense = params["blocks"]["moe"], params["dense_blocks"]
    for key, want in (("model.layers.0.mlp.up_proj.weight", dense["mlp"]["w_up"][0].T),  # written out by hand
                      ("model.layers.0.self_attn.k_proj.weight", dense["attn"]["wk"][0].T),
                      ("model.layers.1.self_attn.q_proj.weight", params["blocks"]["attn"]["wq"][0].T),
                      ("model.layers.2.input_layernorm.weight", params["blocks"]["attn_norm"]["scale"][1]),
                      ("model.layers.2.mlp.gate.weight", moe["router"][1].T),
                      ("model.layers.1.mlp.experts.5.gate_proj.weight", moe["w_gate"][0, 5].T),
                      ("model.layers.2.mlp.experts.1.down_proj.weight", moe["w_down"][1, 1].T),
                      ("model.layers.1.mlp.shared_experts.up_proj.weight", moe["shared"]["w_up"][0].T),
                      ("model.layers.2.mlp.shared_experts.down_proj.weight", moe["shared"]["w_down"][1].T)):
        with safe_open(str(tmp_path / "hf" / index[key]), framework="np") as f:
            np.testing.assert_array_equal(f.get_tensor(key), want)
    back, cfg2 = hf.load_hf_llama(tmp_path / "hf")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, back, params)
    with pytest.raises(ConfigError, match="model.moe.n_shared"):  # a config must match the checkpoint's shapes
        hf.load_hf_llama(tmp_path / "hf", dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, n_shared=1)))
    with pytest.raises(ConfigError, match="model.rope_scaling"):  # DeepSeek's code has no Llama 3.1 scaling
        hf.config_to_hf(dataclasses.replace(cfg, rope_scaling=RopeScaling(factor=8.0)), "float32")


def _deepseek_dir(path: pathlib.Path, code: bool) -> dict:
    """The golden DeepSeekMoE checkpoint in `path`, with a generation_config.json and, with `code`, the model's code
    that its config.json's auto_map names (stand-ins: the files are copied, not run)."""
    from tests import transformers_golden as golden

    want = golden.load()["deepseek"]
    config = dict(want["config"])
    if code:
        config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekConfig",
                              "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM"}
    golden.write(path, config, golden.case_weights(want))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7]}))
    if code:
        for name in ("configuration_deepseek.py", "modeling_deepseek.py"):
            (path / name).write_text(f"# {name}\n")
    return want


def test_deepseek_import_train_and_export_keep_the_model_files(tmp_path, capsys):
    """hf import keeps the model's code and generation defaults; a run started from the HF directory itself
    (init_from) exports with that directory's config.json keys and files; without the code, the export says what
    transformers needs."""
    want = _deepseek_dir(tmp_path / "hf", code=True)
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    model = yaml.safe_load((tmp_path / "imported" / "config.yaml").read_text())["model"]
    assert model["moe"] == {"n_experts": 6, "top_k": 3, "aux_loss_coef": 0.001, "d_expert": 24, "n_shared": 2,
                            "n_dense_first": 1, "normalize_top_k": False, "aux_loss_scope": "sequence"}
    assert sorted(f.name for f in (tmp_path / "imported").glob("hf_*")) == [
        "hf_config.json", "hf_configuration_deepseek.py", "hf_generation_config.json", "hf_modeling_deepseek.py"]
    kept = hf.config_from_hf(want["config"])  # a run from the import that routes otherwise is told, as from HF
    renormalized = dataclasses.replace(kept, moe=dataclasses.replace(kept.moe, normalize_top_k=True))
    with pytest.warns(UserWarning, match="normalize_top_k=True differs from the checkpoint's False"):
        hf.init_from(tmp_path / "imported", renormalized)
    assert hf.main(["export", str(tmp_path / "imported"), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]["AutoConfig"] == \
        "configuration_deepseek.DeepseekConfig"
    for name in ("generation_config.json", "modeling_deepseek.py", "configuration_deepseek.py"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    _assert_same_tensors(_read_all(tmp_path / "out"), _read_all(tmp_path / "hf"))
    params, cfg = hf.load_hf_llama(tmp_path / "out")
    np.testing.assert_allclose(_our_logits(params, cfg, want["tokens"]), want["logits"], atol=1e-4, rtol=0)

    # the sampler reads the imported parameters and router biases (zeros: DeepSeekMoE has none), and decodes greedily
    # what the forward's argmax gives (it stopped at 'buffers.blocks.moe.bias: in this model, not in the checkpoint'
    # when imports saved no buffers)
    from mx_jax import sample, sharding, train as train_mod

    scfg = sample.load_config(str(tmp_path / "imported" / "config.yaml"), ["mesh.data=1", "mesh.fsdp=1"])
    mesh = sharding.make_mesh(scfg.mesh, jax.devices()[:1])
    setup = train_mod.build(scfg, mesh)
    params, buffers = sample.load_model_state(scfg, setup, tmp_path / "imported", None)
    assert [float(np.abs(b).max()) for b in jax.tree.leaves(buffers)] == [0.0]
    prompt = list(b"def f(x):")
    with jax.set_mesh(mesh):
        out = sample.generate(setup, params, buffers, prompt, 6, temperature=0)
        logits, _ = nnx.merge(setup.graphdef, params, buffers)(jnp.asarray(out), logits_dtype=jnp.float32)
    np.testing.assert_array_equal(out[:, len(prompt):], np.argmax(np.asarray(logits), -1)[:, len(prompt) - 1:-1])
    assert sample.main([str(tmp_path / "imported"), "--tokens", "4", "--temperature", "0"]) == 0

    # a run from the HF directory: its MoE layers on an expert axis, exported with the directory's keys and files
    result = train(tiny_config(tmp_path / "run", *DEEPSEEK_TRAIN, f"init_from={tmp_path / 'hf'}", "steps=1",
                               "optim.warmup_steps=0", "mesh.data=4", "mesh.fsdp=1", "mesh.expert=2",
                               "ckpt.async_save=false", "log.eval_every_steps=-1"))
    assert np.isfinite(result.metrics["loss"])
    assert sorted(f.name for f in (tmp_path / "run").glob("hf_*")) == [  # kept at the start, for the export
        "hf_config.json", "hf_configuration_deepseek.py", "hf_generation_config.json", "hf_modeling_deepseek.py"]
    capsys.readouterr()
    assert hf.main(["export", str(tmp_path / "run"), str(tmp_path / "run_out"), "--dtype", "float32"]) == 0
    assert f"from {tmp_path / 'run' / 'hf_config.json'}" in capsys.readouterr().out
    written = json.loads((tmp_path / "run_out" / "config.json").read_text())
    assert (written["bos_token_id"], written["max_position_embeddings"], written["model_type"]) == (1, 128, "deepseek")
    assert (tmp_path / "run_out" / "modeling_deepseek.py").is_file()
    back, _ = hf.load_hf_llama(tmp_path / "run_out")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), back, result.state["params"])

    # the same model without its code: no auto_map naming files that are not there, and a note
    _deepseek_dir(tmp_path / "bare", code=False)
    assert hf.main(["import", str(tmp_path / "bare"), str(tmp_path / "bare_imported")]) == 0
    capsys.readouterr()
    assert hf.main(["export", str(tmp_path / "bare_imported"), str(tmp_path / "bare_out")]) == 0
    assert "transformers needs the model's own code" in capsys.readouterr().out
    assert "auto_map" not in json.loads((tmp_path / "bare_out" / "config.json").read_text())
    assert (tmp_path / "bare_out" / "generation_config.json").is_file()


def test_deepseek_logits_match_its_published_model(tmp_path):
    """Live, where torch and transformers are installed: a random DeepSeekMoE (transformers_golden.deepseek_model),
    imported from its state dict under the checkpoint's names, gives our logits; our export loads back into it
    (strict: every name, no other) with the same logits."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests import transformers_golden as golden

    torch.manual_seed(0)
    ref = golden.deepseek_model(DEEPSEEK_CONFIG)
    values = golden.weights(sorted(ref.state_dict()), [tuple(v.shape) for _, v in sorted(ref.state_dict().items())])
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in values.items()}, strict=True)
    ref.config._attn_implementation = "eager"
    ref = ref.float().eval()
    golden.write(tmp_path / "hf", DEEPSEEK_CONFIG, values)
    tokens = np.random.default_rng(0).integers(0, DEEPSEEK_CONFIG["vocab_size"], (2, 40))
    with torch.no_grad():
        want = ref(torch.as_tensor(tokens)).logits.numpy()
    params, cfg = hf.load_hf_llama(tmp_path / "hf")
    np.testing.assert_allclose(_our_logits(params, cfg, tokens), want, atol=1e-4, rtol=0)
    hf.export_hf_llama(params, cfg, tmp_path / "ours", dtype="float32")
    ref.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in _read_all(tmp_path / "ours").items()}, strict=True)
    with torch.no_grad():
        np.testing.assert_allclose(ref(torch.as_tensor(tokens)).logits.numpy(), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V2 (DeepseekV2ForCausalLM): multi-head latent attention (model.mla), DeepSeekMoE's MoE with its scaling and
# group-limited routing


def test_deepseek_v2_configs_map_both_ways():
    cfg = hf.config_from_hf(DEEPSEEK_V2_CONFIG)
    a, m = cfg.mla, cfg.moe
    assert (a.kv_rank, a.q_rank, a.nope_dim, a.rope_dim, a.v_dim) == (16, 0, 8, 8, 12)
    assert (cfg.head_dim, cfg.d_head, cfg.n_kv_heads, cfg.d_ff, cfg.norm_eps) == (0, 16, 4, 80, 1e-6)
    assert (m.n_experts, m.top_k, m.d_expert, m.n_shared, m.n_dense_first, m.score, m.normalize_top_k,
            m.routed_scale, m.route_groups, m.aux_loss_coef) == (6, 3, 24, 2, 1, "softmax", False, 1.5, 0, 0.001)
    sc = cfg.rope_scaling  # transformers' attention factor from mscale / mscale_all_dim, and the softmax's m
    assert (sc.kind, sc.factor, sc.original_max_len, sc.mscale_all_dim) == ("yarn", 4.0, 256, 1.0)
    assert sc.attention_factor == pytest.approx((0.1 * 0.707 * np.log(4) + 1) / (0.1 * np.log(4) + 1))
    assert hf.model_type(cfg) == "deepseek_v2"
    written = hf.config_to_hf(cfg, "float32", DEEPSEEK_V2_CONFIG)
    assert written == {**DEEPSEEK_V2_CONFIG, "mlp_bias": False, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
        "beta_slow": 1.0, "attention_factor": sc.attention_factor, "mscale_all_dim": 1.0}}
    assert hf.config_from_hf(written) == cfg
    q = hf.config_from_hf(DEEPSEEK_V2_Q_LORA_CONFIG)
    assert (q.mla.q_rank, q.moe.top_k, q.moe.route_groups, q.moe.route_top_groups, q.moe.routed_scale) == \
        (12, 3, 3, 2, 2.0)
    assert hf.config_to_hf(q, "float32", DEEPSEEK_V2_Q_LORA_CONFIG) == {**DEEPSEEK_V2_Q_LORA_CONFIG, "mlp_bias": False}
    for c in (cfg, q):
        fresh = hf.config_to_hf(c, "float32")  # without a base: every key DeepseekV2Config reads
        assert hf.config_from_hf(fresh) == c and "head_dim" not in fresh
        abstract = nnx.eval_shape(lambda c=c: Llama(c, rngs=nnx.Rngs(0)))  # the shapes the model builds
        assert jax.tree.map(lambda x: tuple(x.shape), params_of(abstract)) == hf.param_shapes(c)
    # every group kept is greedy; a dense model with latent attention: every layer before first_k_dense_replace
    assert hf.config_from_hf({**DEEPSEEK_V2_Q_LORA_CONFIG, "topk_group": 3}).moe.route_groups == 0
    dense = dataclasses.replace(q, moe=dataclasses.replace(q.moe, n_experts=0))
    out = hf.config_to_hf(dense, "float32", DEEPSEEK_V2_Q_LORA_CONFIG)
    assert out["first_k_dense_replace"] == 3 and "n_routed_experts" not in out and "topk_method" not in out
    assert hf.config_from_hf(out).moe.n_experts == 0
    assert hf.config_from_hf({**DEEPSEEK_V2_CONFIG, "n_routed_experts": None}).moe.n_experts == 0  # the Hub's dense
    # keys the config lacks: DeepseekV2Config's defaults (q_lora_rank 1536 where absent; null is none)
    trimmed = {k: v for k, v in DEEPSEEK_V2_CONFIG.items()
               if k not in ("q_lora_rank", "kv_lora_rank", "n_shared_experts", "n_routed_experts")}
    t = hf.config_from_hf(trimmed)
    assert (t.mla.q_rank, t.mla.kv_rank, t.moe.n_shared, t.moe.n_experts) == (1536, 512, 2, 64)
    try:
        import transformers
    except ImportError:
        return
    d = transformers.DeepseekV2Config().to_dict()
    assert {k: d[k] for k in hf.HF_CLASS_DEFAULTS["deepseek_v2"]} == hf.HF_CLASS_DEFAULTS["deepseek_v2"]
    assert (d["q_lora_rank"], d["n_routed_experts"], d["n_shared_experts"]) == (1536, 64, 2)


def test_norm_topk_prob_is_read_as_transformers_reads_it():
    """transformers' DeepseekV2TopkRouter never renormalizes (it does not read norm_topk_prob; the Hub's
    modeling_deepseek.py does, instead of scaling): an import follows transformers and says so."""
    with pytest.warns(UserWarning, match="norm_topk_prob=true, which transformers' DeepseekV2 does not read"):
        cfg = hf.config_from_hf({**DEEPSEEK_V2_CONFIG, "norm_topk_prob": True})
    assert (cfg.moe.normalize_top_k, cfg.moe.routed_scale) == (False, 1.5)


@pytest.mark.parametrize("change, match", [
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid' is not supported"),
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}, "n_group=4, topk_group=2"),
    ({"topk_method": "group_limited_greedy", "n_group": None}, "needs n_group and topk_group"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"kv_lora_rank": 0}, "kv_lora_rank=0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16, "mscale_all_dim": 1.0}}, "mscale_all_dim with type"),
    ({"attention_bias": True}, "attention_bias=True"),
])
def test_unsupported_deepseek_v2_configs_are_refused(change, match):
    with pytest.raises(hf.HFFormatError, match=match):
        hf.config_from_hf({**DEEPSEEK_V2_CONFIG, **change})


def test_deepseek_v2_group_limited_routing_scores_a_group_by_its_best_expert():
    """group_limited_greedy maps to route_group_top = 1 (a group scored by its best expert), also where moe.py's
    default would sum more (DeepSeek-V2's own top-6 in 3 of 8 groups: 2); a group score that sums more than one
    expert is what DeepseekV2ForCausalLM cannot hold, and is named."""
    three = hf.config_from_hf(DEEPSEEK_V2_Q_LORA_CONFIG)
    assert (three.moe.top_k, three.moe.route_groups, three.moe.route_top_groups, three.moe.route_group_top) == \
        (3, 3, 2, 1)
    v2 = hf.config_from_hf({**DEEPSEEK_V2_Q_LORA_CONFIG, "n_routed_experts": 16, "n_group": 8, "topk_group": 3,
                            "num_experts_per_tok": 6})
    assert (v2.moe.route_groups, v2.moe.route_top_groups, v2.moe.route_group_top) == (8, 3, 1)
    assert hf.config_to_hf(v2, "float32")["topk_method"] == "group_limited_greedy"
    four = dataclasses.replace(three, moe=dataclasses.replace(three.moe, top_k=4, route_group_top=0))
    with pytest.raises(ConfigError, match=r"model\.moe\.route_group_top.*sum of its best 2 experts"):
        hf.config_to_hf(four, "float32")
    for key, value in (("normalize_top_k", True), ("every_n_layers", 2)):
        with pytest.raises(ConfigError, match=rf"model\.moe\.{key}.*DeepseekV2ForCausalLM has"):
            hf.config_to_hf(dataclasses.replace(three, moe=dataclasses.replace(three.moe, **{key: value})), "float32")
    # sigmoid scores are DeepSeek-V3's, whose groups score by their best two experts
    with pytest.raises(ConfigError, match=r"model\.moe\.route_group_top.*noaux_tc sums its best 2"):
        hf.config_to_hf(dataclasses.replace(three, moe=dataclasses.replace(three.moe, score="sigmoid")), "float32")


@pytest.mark.parametrize("case", ["deepseek_v2", "deepseek_v2_q_lora"])
def test_deepseek_v2_export_reorders_the_rotary_rows_back(tmp_path, case):
    """The golden checkpoint, imported: column h (n + r) + n + i of wq (i < r/2) is HF's row h (n + r) + n + 2 i of
    q_proj, column n + r/2 + i its row n + 2 i + 1, and so for kv_a_proj_with_mqa's r rows after the latent; the
    export writes every tensor back as it was (bitwise), in shards too, and reads back to the same parameters."""
    from tests import transformers_golden as golden

    want = golden.load()[case]
    values = golden.case_weights(want)
    golden.write(tmp_path / "hf", want["config"], values)
    params, cfg = hf.load_hf_llama(tmp_path / "hf")
    a, attn = cfg.mla, params["blocks"]["attn"]
    k, half = a.nope_dim + a.rope_dim, a.rope_dim // 2
    q_key = "q_b_proj" if a.q_rank else "q_proj"
    q_hf, q_ours = values[f"model.layers.2.self_attn.{q_key}.weight"], attn["wq_b" if a.q_rank else "wq"][1].T
    kv_hf, kv_ours = values["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"], attn["wkv_a"][1].T
    for h in range(cfg.n_heads):
        rope = h * k + a.nope_dim
        np.testing.assert_array_equal(q_ours[h * k:rope], q_hf[h * k:rope])
        np.testing.assert_array_equal(q_ours[rope:rope + half], q_hf[rope:rope + a.rope_dim:2])
        np.testing.assert_array_equal(q_ours[rope + half:rope + a.rope_dim], q_hf[rope + 1:rope + a.rope_dim:2])
    np.testing.assert_array_equal(kv_ours[:a.kv_rank], kv_hf[:a.kv_rank])
    np.testing.assert_array_equal(kv_ours[a.kv_rank:a.kv_rank + half], kv_hf[a.kv_rank::2])
    np.testing.assert_array_equal(kv_ours[a.kv_rank + half:], kv_hf[a.kv_rank + 1::2])
    np.testing.assert_array_equal(attn["wkv_b"][0], values["model.layers.1.self_attn.kv_b_proj.weight"].T)
    np.testing.assert_array_equal(params["dense_blocks"]["attn"]["kv_norm"]["scale"][0],
                                  values["model.layers.0.self_attn.kv_a_layernorm.weight"])
    np.testing.assert_array_equal(params["blocks"]["moe"]["w_up"][1, 4],
                                  values["model.layers.2.mlp.experts.4.up_proj.weight"].T)
    hf.export_hf_llama(params, cfg, tmp_path / "out", dtype="float32", hf_config=want["config"],
                       max_shard_bytes=sum(v.nbytes for v in values.values()) // 4)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    _assert_same_tensors(_read_all(tmp_path / "out"), values)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["DeepseekV2ForCausalLM"] and written["kv_lora_rank"] == 16
    back, cfg2 = hf.load_hf_llama(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_deepseek_v2_import_writes_a_config_the_trainer_runs(tmp_path):
    """`import` writes the latent attention and the routing into config.yaml; a run from it trains and exports as
    DeepSeek-V2 again."""
    from mx_jax.config import load_config
    from tests import transformers_golden as golden

    want = golden.load()["deepseek_v2_q_lora"]
    golden.write(tmp_path / "hf", want["config"], golden.case_weights(want))
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "imp")]) == 0
    model = yaml.safe_load((tmp_path / "imp" / "config.yaml").read_text())["model"]
    assert model["mla"] == {"kv_rank": 16, "q_rank": 12, "nope_dim": 8, "rope_dim": 8, "v_dim": 12}
    assert {k: model["moe"][k] for k in ("routed_scale", "route_groups", "route_top_groups", "normalize_top_k")} == \
        {"routed_scale": 2.0, "route_groups": 3, "route_top_groups": 2, "normalize_top_k": False}
    cfg = load_config(str(tmp_path / "imp" / "config.yaml"), [
        f"init_from={tmp_path / 'imp'}", f"run_dir={tmp_path / 'run'}", "data.source=embedded", "data.seq_len=32",
        "data.batch_size=8", "steps=1", "optim.warmup_steps=0", "log.every_steps=1", "log.progress=false",
        "log.tensorboard=false", "log.eval_every_steps=-1", "ckpt.async_save=false", "mesh.data=2", "mesh.fsdp=1"])
    assert cfg.model == hf.config_from_hf(want["config"])
    result = train(cfg, jax.devices()[:2])
    assert np.isfinite(result.metrics["loss"])
    assert hf.main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["topk_method"] == "group_limited_greedy"
    back, _ = hf.load_hf_llama(tmp_path / "out")
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, np.asarray(y)), back, result.state["params"])


@pytest.mark.parametrize("config", [DEEPSEEK_V2_CONFIG, DEEPSEEK_V2_Q_LORA_CONFIG], ids=["greedy_yarn", "q_lora"])
def test_deepseek_v2_logits_match_transformers(tmp_path, config):
    _check_against_transformers(tmp_path, "DeepseekV2", config, keep_config=True)


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 (DeepseekV3ForCausalLM): DeepSeek-V2's latent attention, sigmoid routing with a trained bias per expert
# (a buffer), noaux_tc's groups, multi-token-prediction layers, fp8 checkpoints


def test_deepseek_v3_configs_map_both_ways():
    from mx_jax.moe import group_score_experts

    cfg = hf.config_from_hf(DEEPSEEK_V3_CONFIG)
    a, m = cfg.mla, cfg.moe
    assert (a.kv_rank, a.q_rank, a.nope_dim, a.rope_dim, a.v_dim) == (16, 12, 8, 4, 12)
    assert (m.n_experts, m.top_k, m.d_expert, m.n_shared, m.n_dense_first, m.score, m.normalize_top_k,
            m.routed_scale, m.route_groups, m.route_top_groups, m.route_group_top, m.aux_loss_coef,
            m.bias_update_rate) == (8, 2, 24, 1, 1, "sigmoid", True, 2.5, 4, 2, 2, 0.001, 0.0)
    assert group_score_experts(2, 8, 4, 2) == 1  # moe.py's default would score a group by its best expert here
    sc = cfg.rope_scaling  # mscale = mscale_all_dim: an attention factor of exactly 1 (not YaRN's own), m^2 apart
    assert (sc.kind, sc.factor, sc.original_max_len, sc.attention_factor, sc.mscale_all_dim) == \
        ("yarn", 4.0, 1024, 1.0, 1.0)
    assert hf.model_type(cfg) == "deepseek_v3"
    written = hf.config_to_hf(cfg, "float32", DEEPSEEK_V3_CONFIG)
    assert cfg.mtp.depth == DEEPSEEK_V3_CONFIG["num_nextn_predict_layers"] == 1
    assert written == {**DEEPSEEK_V3_CONFIG, "mlp_bias": False, "rope_interleave": True,
                       "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0,
                                        "mscale_all_dim": 1.0}}
    assert hf.config_from_hf(written) == cfg
    halves = hf.config_from_hf(DEEPSEEK_V3_HALVES_CONFIG)  # one group: greedy; queries from x; not renormalized
    assert (halves.mla.q_rank, halves.moe.route_groups, halves.moe.route_group_top, halves.moe.normalize_top_k,
            halves.moe.top_k, halves.moe.n_shared) == (0, 0, 0, False, 3, 2)
    assert hf.config_to_hf(halves, "float32", DEEPSEEK_V3_HALVES_CONFIG) == {
        **DEEPSEEK_V3_HALVES_CONFIG, "mlp_bias": False, "rope_interleave": True}  # written interleaved: _rope_rows
    for c in (cfg, halves):
        fresh = hf.config_to_hf(c, "float32")  # without a base: every key DeepseekV3Config reads
        assert hf.config_from_hf(fresh) == c and "head_dim" not in fresh and fresh["model_type"] == "deepseek_v3"
        abstract = nnx.eval_shape(lambda c=c: Llama(c, rngs=nnx.Rngs(0)))  # the shapes the model builds
        assert jax.tree.map(lambda x: tuple(x.shape), params_of(abstract)) == hf.param_shapes(c)
        assert jax.tree.map(lambda x: tuple(x.shape), buffers_of(abstract)) == hf.buffer_shapes(c)
    assert hf.buffer_shapes(cfg) == {"blocks": {"moe": {"bias": (2, 8)}}, "mtp": {"block": {"moe": {"bias": (1, 8)}}}}
    assert halves.mtp.depth == 0 and hf.buffer_shapes(halves) == {"blocks": {"moe": {"bias": (2, 8)}}}
    # every group kept is greedy; a dense model with latent attention is DeepSeek-V2's
    assert hf.config_from_hf({**DEEPSEEK_V3_CONFIG, "topk_group": 4}).moe.route_groups == 0
    assert hf.config_from_hf({**DEEPSEEK_V3_CONFIG, "n_routed_experts": None}).moe.n_experts == 0
    assert hf.model_type(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, n_experts=0))) == "deepseek_v2"
    # keys the config lacks: DeepseekV3Config's defaults (q_lora_rank 1536 where absent; null is none)
    absent = ("q_lora_rank", "kv_lora_rank", "n_shared_experts", "n_routed_experts", "n_group", "topk_group",
              "num_experts_per_tok", "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace")
    t = hf.config_from_hf({**{k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k not in absent},
                           "num_hidden_layers": 5})
    assert (t.mla.q_rank, t.mla.kv_rank, t.moe.n_shared, t.moe.n_experts, t.moe.route_groups, t.moe.route_top_groups,
            t.moe.top_k, t.moe.normalize_top_k, t.moe.routed_scale, t.moe.n_dense_first) == \
        (1536, 512, 1, 256, 8, 4, 8, True, 2.5, 3)
    try:
        import transformers
    except ImportError:
        return
    d = transformers.DeepseekV3Config().to_dict()
    assert {k: d[k] for k in hf.HF_CLASS_DEFAULTS["deepseek_v3"]} == hf.HF_CLASS_DEFAULTS["deepseek_v3"]
    assert (d["q_lora_rank"], d["n_routed_experts"], d["n_shared_experts"], d["rope_interleave"],
            d["num_nextn_predict_layers"]) == (1536, 256, 1, True, 1)


@pytest.mark.parametrize("change, match", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy' is not supported"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"n_group": 3}, "n_group=3, topk_group=2"),  # does not divide 8
    ({"n_group": 8, "topk_group": 4}, "n_group=8, topk_group=4"),  # groups of one expert: no best two
    ({"topk_group": 0}, "n_group=4, topk_group=0"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
])
def test_unsupported_deepseek_v3_configs_are_refused(tmp_path, change, match):
    _golden_dir(tmp_path, "deepseek_v3", change)
    with pytest.raises(hf.HFFormatError, match=match):
        hf.load_hf_llama(tmp_path)


def _golden_dir(path: pathlib.Path, case: str, change: dict | None = None) -> tuple[dict, dict]:
    """The golden case's checkpoint written in `path` (its config.json changed by `change`): (its case, tensors)."""
    from tests import transformers_golden as golden

    want = golden.load()[case]
    values = golden.case_weights(want)
    golden.write(path, {**want["config"], **(change or {})}, values)
    return want, values


def test_deepseek_v3_exports_refuse_what_it_cannot_hold():
    """A model with latent attention and sigmoid routing (or router biases that train) is DeepSeek-V3's, and what
    DeepseekV3ForCausalLM cannot hold is named."""
    cfg = hf.config_from_hf(DEEPSEEK_V3_CONFIG)
    for key, value, match in (("route_group_top", 1, r"route_group_top.*best 1 expert\(s\).*sums its best 2"),
                              ("route_group_top", 0, r"route_group_top.*best 1 expert\(s\)"),
                              ("every_n_layers", 2, r"model\.moe\.every_n_layers.*DeepseekV3ForCausalLM has"),
                              ("n_shared", 0, r"model\.moe\.n_shared.*always runs shared experts")):
        with pytest.raises(ConfigError, match=match):
            hf.config_to_hf(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **{key: value})), "float32")
    with pytest.raises(ConfigError, match=r"model\.qk_norm.*DeepseekV3ForCausalLM has"):
        hf.config_to_hf(dataclasses.replace(cfg, qk_norm=True), "float32")
    softmax = dataclasses.replace(cfg.moe, score="softmax", normalize_top_k=False, route_group_top=1)
    assert hf.model_type(dataclasses.replace(cfg, moe=softmax)) == "deepseek_v2"
    trained = dataclasses.replace(softmax, bias_update_rate=0.01)  # router biases that train: only V3 holds them
    with pytest.raises(ConfigError, match=r"model\.moe\.score.*'softmax'.*DeepseekV3ForCausalLM has moe.score"):
        hf.config_to_hf(dataclasses.replace(cfg, moe=trained), "float32")
    rated = dataclasses.replace(cfg.moe, bias_update_rate=0.01)  # a fine-tuning run that moves them: exported
    assert hf.config_to_hf(dataclasses.replace(cfg, moe=rated), "float32")["model_type"] == "deepseek_v3"


def test_deepseek_v3_router_biases_and_group_scores_move_the_logits(tmp_path):
    """The golden checkpoint's biases are read (as buffers, not parameters): without them, or with each group scored
    by its best expert alone (moe.py's default here, DeepSeek-V2's rule), our logits leave transformers' by ~1-4."""
    want, values = _golden_dir(tmp_path, "deepseek_v3")
    params, cfg = hf.load_hf_llama(tmp_path)
    buffers = hf.load_hf_buffers(tmp_path, cfg)
    assert "bias" not in params["blocks"]["moe"]
    bias = buffers["blocks"]["moe"]["bias"]
    assert bias.dtype == np.float32 and bias.shape == (2, 8)
    np.testing.assert_array_equal(bias[1], values["model.layers.2.mlp.gate.e_score_correction_bias"])
    logits = _our_logits(params, cfg, want["tokens"], buffers)
    np.testing.assert_allclose(logits, want["logits"], atol=1e-4, rtol=0)
    assert np.abs(_our_logits(params, cfg, want["tokens"]) - want["logits"]).max() > 1  # zero biases
    best_one = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, route_group_top=1))
    assert np.abs(_our_logits(params, best_one, want["tokens"], buffers) - want["logits"]).max() > 0.5
    greedy = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, route_groups=0, route_top_groups=0,
                                                              route_group_top=0))
    assert np.abs(_our_logits(params, greedy, want["tokens"], buffers) - want["logits"]).max() > 0.5
    # a dense model's buffers are none; V2's MoE has zeros, where the checkpoint has no bias
    assert hf.load_hf_buffers(tmp_path, dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, n_experts=0))) == {}
    _golden_dir(tmp_path / "v2", "deepseek_v2")
    v2 = hf.load_hf_buffers(tmp_path / "v2", hf.config_from_hf(DEEPSEEK_V2_CONFIG))
    assert v2["blocks"]["moe"]["bias"].shape == (2, 6) and not v2["blocks"]["moe"]["bias"].any()


def test_deepseek_v3_export_writes_the_router_biases_back(tmp_path):
    """The golden checkpoint, imported and exported: every tensor as it was (bitwise), the biases from the buffers,
    in float32 whatever the dtype (transformers keeps them so), in shards too; the biases are needed, and nonzero
    ones are refused where another model would drop them. rope_interleave false reads the rotated rows as stored
    and writes them interleaved, with rope_interleave true."""
    want, values = _golden_dir(tmp_path / "hf", "deepseek_v3")
    params, cfg = hf.load_hf_llama(tmp_path / "hf")
    buffers = hf.load_hf_buffers(tmp_path / "hf", cfg)
    hf.export_hf_llama(params, cfg, tmp_path / "out", buffers=buffers, dtype="float32", hf_config=want["config"],
                       max_shard_bytes=sum(v.nbytes for v in values.values()) // 4)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    _assert_same_tensors(_read_all(tmp_path / "out"), values)
    hf.export_hf_llama(params, cfg, tmp_path / "bf16", buffers=buffers)
    written = _read_all(tmp_path / "bf16")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert written[bias].dtype == np.float32 and written["model.layers.1.mlp.gate.weight"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(written[bias], values[bias])
    with pytest.raises(ValueError, match="pass buffers="):
        hf.export_hf_llama(params, cfg, tmp_path / "none")
    with pytest.raises(ValueError, match=r"buffers\['blocks/moe/bias'\] has shape \(2, 6\)"):
        hf.export_hf_llama(params, cfg, tmp_path / "none", buffers={"blocks": {"moe": {"bias": np.zeros((2, 6))}}})
    assert not (tmp_path / "none").exists()
    _golden_dir(tmp_path / "v2", "deepseek_v2")
    v2_params, v2 = hf.load_hf_llama(tmp_path / "v2")
    zeros = hf.load_hf_buffers(tmp_path / "v2", v2)
    hf.export_hf_llama(v2_params, v2, tmp_path / "v2_out", buffers=zeros, dtype="float32")
    with pytest.raises(ValueError, match="router biases are not zero.*deepseek_v2's router has no place"):
        hf.export_hf_llama(v2_params, v2, tmp_path / "v2_bad", buffers=jax.tree.map(lambda b: b + 0.1, zeros))

    halves, halves_values = _golden_dir(tmp_path / "halves", "deepseek_v3_halves")
    params, cfg = hf.load_hf_llama(tmp_path / "halves")
    np.testing.assert_array_equal(params["blocks"]["attn"]["wkv_a"][0].T,  # rope_interleave false: rows as stored
                                  halves_values["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"])
    hf.export_hf_llama(params, cfg, tmp_path / "halves_out", buffers=hf.load_hf_buffers(tmp_path / "halves", cfg),
                       dtype="float32", hf_config=halves["config"])
    assert json.loads((tmp_path / "halves_out" / "config.json").read_text())["rope_interleave"] is True
    kv = _read_all(tmp_path / "halves_out")["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    stored = halves_values["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]  # kv_rank 16, rope 4: 16 18 17 19
    np.testing.assert_array_equal(kv[[16, 18, 17, 19]], stored[16:])
    back, cfg2 = hf.load_hf_llama(tmp_path / "halves_out")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_deepseek_v3_import_train_and_export_keep_the_router_biases(tmp_path):
    """`import` saves the biases as the checkpoint's buffers beside its params and writes the routing into
    config.yaml; a run from it starts from those biases (init_from), moves them by the sign of each expert's load
    error when asked (model.moe.bias_update_rate), and exports them; a run from the HF directory itself starts from
    them too, its buffers on an expert axis."""
    from mx_jax.config import load_config

    want, _ = _golden_dir(tmp_path / "hf", "deepseek_v3")
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "imp")]) == 0
    model = yaml.safe_load((tmp_path / "imp" / "config.yaml").read_text())["model"]
    assert {k: model["moe"][k] for k in ("score", "routed_scale", "route_groups", "route_top_groups",
                                         "route_group_top", "normalize_top_k")} == \
        {"score": "sigmoid", "routed_scale": 2.5, "route_groups": 4, "route_top_groups": 2, "route_group_top": 2,
         "normalize_top_k": True}
    # transformers saves DeepSeek-V3 without its multi-token prediction layer: the import has none
    cfg0 = dataclasses.replace(hf.config_from_hf(want["config"]), mtp=MTPConfig())
    assert "mtp" not in model
    imported = hf.load_buffers(tmp_path / "imp", cfg0)["blocks"]["moe"]["bias"]
    np.testing.assert_array_equal(imported, hf.load_hf_buffers(tmp_path / "hf", cfg0)["blocks"]["moe"]["bias"])
    from mx_jax import sample, sharding, train as train_mod  # the sampler decodes with them

    scfg = sample.load_config(str(tmp_path / "imp" / "config.yaml"), ["mesh.data=1", "mesh.fsdp=1"])
    setup = train_mod.build(scfg, sharding.make_mesh(scfg.mesh, jax.devices()[:1]))
    _, sampled = sample.load_model_state(scfg, setup, tmp_path / "imp", None)
    np.testing.assert_array_equal(np.asarray(sampled["blocks"]["moe"]["bias"]), imported)
    common = ["data.source=embedded", "data.seq_len=32", "data.batch_size=8", "steps=1", "optim.warmup_steps=0",
              "log.every_steps=1", "log.progress=false", "log.tensorboard=false", "log.eval_every_steps=-1",
              "ckpt.async_save=false", "mesh.fsdp=1"]
    rate = 0.01
    cfg = load_config(str(tmp_path / "imp" / "config.yaml"), [
        f"init_from={tmp_path / 'imp'}", f"run_dir={tmp_path / 'run'}", f"model.moe.bias_update_rate={rate}",
        "mesh.data=2", *common])
    assert dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, bias_update_rate=0)) == cfg0
    result = train(cfg, jax.devices()[:2])
    assert np.isfinite(result.metrics["loss"])
    moved = np.asarray(result.state["buffers"]["blocks"]["moe"]["bias"]) - imported
    assert np.allclose(np.abs(moved)[np.abs(moved) > 1e-6], rate) and np.abs(moved).max() > 0  # one step of sign
    assert hf.main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    out = _read_all(tmp_path / "out")
    for i in (1, 2):
        np.testing.assert_array_equal(out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"],
                                      np.asarray(result.state["buffers"]["blocks"]["moe"]["bias"][i - 1]))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["topk_method"] == "noaux_tc"
    back, _ = hf.load_hf_llama(tmp_path / "out")
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, np.asarray(y)), back, result.state["params"])

    direct = load_config(str(tmp_path / "imp" / "config.yaml"), [
        f"init_from={tmp_path / 'hf'}", f"run_dir={tmp_path / 'direct'}", "mesh.data=2", "mesh.expert=2", *common])
    result = train(direct, jax.devices()[:4])
    np.testing.assert_array_equal(np.asarray(result.state["buffers"]["blocks"]["moe"]["bias"]), imported)


def test_deepseek_v3_multi_token_prediction_layers_map_both_ways(tmp_path):
    """DeepSeek-V3 stores num_nextn_predict_layers MTP layers after the L decoder layers (its model.layers.61.*):
    each a MoE decoder layer's tensors under their names plus enorm, hnorm, eh_proj (D, 2D), shared_head.norm and
    copies of the embedding and head (vLLM's and SGLang's DeepSeek MTP loaders read all of them). An export writes
    them from model.mtp, an import reads them back (not the copies); a config with fewer MTP layers skips the rest
    with a warning, one with more is refused, and a layer beyond those announced has no place. transformers saves V3
    without them while its config keeps num_nextn_predict_layers 1: read as none, with a warning."""
    from tests import transformers_golden as golden

    want = golden.load()["deepseek_v3"]
    cfg = hf.config_from_hf(want["config"])
    assert cfg.mtp.depth == 1 and cfg.n_layers == 3
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), hf.param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    buffers = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), hf.buffer_shapes(cfg),
                           is_leaf=lambda x: isinstance(x, tuple))
    out = tmp_path / "out"
    hf.export_hf_llama(params, cfg, out, buffers=buffers, dtype="float32")
    import safetensors.numpy as stnp

    stored = stnp.load_file(str(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    layer = {k[len("model.layers.2."):] for k in stored if k.startswith("model.layers.2.")}  # a MoE layer
    mtp = {k[len("model.layers.3."):] for k in stored if k.startswith("model.layers.3.")}
    assert mtp == layer | {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                           "shared_head.head.weight", "embed_tokens.weight"}
    assert "mlp.gate.e_score_correction_bias" in mtp and "mlp.experts.7.down_proj.weight" in mtp
    np.testing.assert_array_equal(stored["model.layers.3.eh_proj.weight"], params["mtp"]["eh_proj"][0].T)
    np.testing.assert_array_equal(stored["model.layers.3.shared_head.head.weight"], params["head"].T)
    np.testing.assert_array_equal(stored["model.layers.3.embed_tokens.weight"], params["embed"])
    np.testing.assert_array_equal(stored["model.layers.3.mlp.gate.e_score_correction_bias"],
                                  buffers["mtp"]["block"]["moe"]["bias"][0])
    np.testing.assert_array_equal(stored["model.layers.3.self_attn.kv_a_layernorm.weight"],
                                  params["mtp"]["block"]["attn"]["kv_norm"]["scale"][0])
    back, back_cfg = hf.load_hf_llama(out)
    assert back_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, back, params)
    jax.tree.map(np.testing.assert_array_equal, hf.load_hf_buffers(out, cfg), buffers)
    assert hf.main(["import", str(out), str(tmp_path / "imp")]) == 0  # config.yaml names the MTP layers
    assert yaml.safe_load((tmp_path / "imp" / "config.yaml").read_text())["model"]["mtp"] == {"depth": 1}
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y), hf.load_params(tmp_path / "imp", cfg),
                 params)

    # the copies are not read: a copy that differs changes nothing
    copy = "model.layers.3.embed_tokens.weight"
    values = {**stored, copy: np.zeros_like(stored[copy])}
    jax.tree.map(np.testing.assert_array_equal,
                 hf.load_hf_llama(_written(tmp_path / "copy", want["config"], values))[0], params)
    # a config without MTP skips the layer, naming it; one with more MTP layers than the checkpoint is refused
    none = dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, depth=0))
    with pytest.warns(UserWarning, match=r"skipped the \d+ tensors of the multi-token-prediction layer\(s\) "
                                         r"model\.layers\.3 \(num_nextn_predict_layers\)"):
        plain, _ = hf.load_hf_llama(out, none)
    jax.tree.map(np.testing.assert_array_equal, plain, {k: v for k, v in params.items() if k != "mtp"})
    assert hf.load_hf_buffers(out, none).keys() == {"blocks"}
    with pytest.raises(ConfigError, match=r"model\.mtp\.depth': 2, but the checkpoint holds 1"):
        hf.load_hf_llama(out, dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, depth=2)))
    # a layer beyond those announced, and an MTP layer config.json does not announce, have no place
    mtp_keys = {k: v for k, v in stored.items() if k.startswith("model.layers.3.")}
    main = {k: v for k, v in stored.items() if k not in mtp_keys}
    beyond = _written(tmp_path / "beyond", want["config"],
                      {**stored, **{k.replace("layers.3", "layers.4"): v for k, v in mtp_keys.items()}})
    with pytest.raises(hf.HFFormatError, match=r"tensor\(s\) have no place.*model\.layers\.4\."):
        hf.load_hf_llama(beyond)
    unannounced = _written(tmp_path / "none", {**want["config"], "num_nextn_predict_layers": 0}, stored)
    with pytest.raises(hf.HFFormatError, match=r"have no place.*model\.layers\.3\."):
        hf.load_hf_llama(unannounced)
    # announced without its tensors (transformers' save): read as no MTP layers
    with pytest.warns(UserWarning, match=r"num_nextn_predict_layers is 1, but the safetensors hold no "
                                         r"model\.layers\.3\.\*"):
        bare, bare_cfg = hf.load_hf_llama(_written(tmp_path / "bare", want["config"], main))
    assert bare_cfg.mtp.depth == 0 and "mtp" not in bare
    # a format without MTP layers: the export leaves them out, with a warning
    llama_cfg = dataclasses.replace(hf.config_from_hf(golden.load()["llama"]["config"]), mtp=cfg.mtp)
    llama_params = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), hf.param_shapes(llama_cfg),
                                is_leaf=lambda x: isinstance(x, tuple))
    with pytest.warns(UserWarning, match=r"llama has no multi-token prediction layers: model\.mtp's 1 layer"):
        hf.export_hf_llama(llama_params, llama_cfg, tmp_path / "llama", dtype="float32")
    assert not any(".layers.3." in k for k in stnp.load_file(str(tmp_path / "llama" / "model.safetensors")))


def _written(path: pathlib.Path, config: dict, values: dict) -> pathlib.Path:
    from tests import transformers_golden as golden

    golden.write(path, config, values)
    return path


def _fp8(values: dict[str, np.ndarray], block: tuple[int, int]) -> tuple[dict, dict]:
    """(the tensors as DeepSeek-V3's fp8 checkpoints store them: every matrix but the embedding, head and routers
    in float8_e4m3fn with a float32 `weight_scale_inv` per block (amax / 448, the blocks at the edges partial), the
    float32 values those dequantize to: each block's W8 times its scale, written out block by block)."""
    stored, exact = {}, {}
    b0, b1 = block
    for k, v in values.items():
        if v.ndim != 2 or k in ("model.embed_tokens.weight", "lm_head.weight") or k.endswith("gate.weight"):
            stored[k] = exact[k] = v
            continue
        rows, cols = -(-v.shape[0] // b0), -(-v.shape[1] // b1)
        scale = np.empty((rows, cols), np.float32)
        w8, deq = np.empty(v.shape, ml_dtypes.float8_e4m3fn), np.empty(v.shape, np.float32)
        for i in range(rows):
            for j in range(cols):
                blk = (slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1))
                scale[i, j] = np.abs(v[blk]).max() / 448
                w8[blk] = (v[blk] / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
                deq[blk] = w8[blk].astype(np.float32) * scale[i, j]
        stored[k], stored[k + "_scale_inv"], exact[k] = w8, scale, deq
    return stored, exact


FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [8, 32]}


def test_fp8_checkpoints_are_dequantized(tmp_path, monkeypatch):
    """A block-scaled fp8 checkpoint (quantization_config quant_method fp8; DeepSeek-V3's and Kimi K2's form) reads
    as the float32 values its blocks dequantize to, W8 * scale_inv, whole and in each device's slices (which cut
    through blocks: 8 x 32 here, partial at the edges of 12, 20, 48 and 80); its scales have their places, and what
    does not fit is named. An export of it is 16- or 32-bit, without quantization_config."""
    from tests import transformers_golden as golden

    want = golden.load()["deepseek_v3"]
    stored, exact = _fp8(golden.case_weights(want), (8, 32))
    fp8 = _written(tmp_path / "fp8", {**want["config"], "quantization_config": FP8_CONFIG}, stored)
    with safe_open(str(fp8 / hf.SINGLE_FILE), framework="np") as f:
        assert f.get_slice("model.layers.1.self_attn.q_b_proj.weight").get_dtype() == "F8_E4M3"
    want_params, cfg = hf.load_hf_llama(_written(tmp_path / "exact", want["config"], exact))
    params, cfg2 = hf.load_hf_llama(fp8)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params, want_params)
    mesh, shardings = _corner_shardings(cfg)
    got, buffers = hf.init_from(fp8, cfg, shardings)  # (its router biases are float32, as DeepSeek-V3's)
    jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), w), got, want_params)
    jax.tree.map(np.testing.assert_array_equal, buffers, hf.load_hf_buffers(tmp_path / "exact", cfg))
    assert "quantization_config" not in hf.config_to_hf(cfg, "bfloat16", {**want["config"],
                                                                         "quantization_config": FP8_CONFIG})
    try:  # transformers' own dequantization, where it is installed
        import torch
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    except ImportError:
        pass
    else:
        for k in ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                  "model.layers.2.mlp.experts.3.down_proj.weight"):
            w = torch.from_numpy(stored[k].view(np.uint8)).view(torch.float8_e4m3fn)
            theirs = _dequantize_fp8_weight(w, torch.from_numpy(stored[k + "_scale_inv"]), [8, 32], torch.float32)
            np.testing.assert_array_equal(theirs.numpy(), exact[k])

    scale = "model.layers.1.self_attn.q_a_proj.weight_scale_inv"
    for name, config, tensors, match in (
            ("no_config", want["config"], stored, r"q_a_proj.weight_scale_inv' scales .* no quantization_config"),
            ("block", {**want["config"], "quantization_config": {**FP8_CONFIG, "weight_block_size": [16, 32]}},
             stored, r"weight_scale_inv' is F32 \(2, 2\); .*\(12, 48\) in blocks of \(16, 32\).* implies \(1, 2\)"),
            ("unscaled", {**want["config"], "quantization_config": FP8_CONFIG},
             {k: v for k, v in stored.items() if k != scale}, r"q_a_proj.weight' is F8_E4M3 without"),
            ("method", {**want["config"], "quantization_config": {"quant_method": "awq", "bits": 4}}, stored,
             "quantization_config .*'awq'.* is not supported")):
        with pytest.raises(hf.HFFormatError, match=match):
            hf.load_hf_llama(_written(tmp_path / name, config, tensors))


def test_kimi_k2_reads_and_writes_as_deepseek_v3(tmp_path):
    """Kimi K2's config.json names DeepSeek-V3's architecture (DeepseekV3ForCausalLM) model_type kimi_k2: read as
    deepseek_v3 (its rotated rows interleaved, as the Hub's code rotates them), written back as kimi_k2 with its
    other keys (its own code, auto_map)."""
    from tests import transformers_golden as golden

    kimi = {**DEEPSEEK_V3_CONFIG, "model_type": "kimi_k2", "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}
    cfg = hf.config_from_hf(kimi)
    assert cfg == hf.config_from_hf(DEEPSEEK_V3_CONFIG)
    written = hf.config_to_hf(cfg, "float32", kimi)
    assert (written["model_type"], written["architectures"], written["auto_map"]) == \
        ("kimi_k2", ["DeepseekV3ForCausalLM"], kimi["auto_map"])
    assert hf.config_from_hf(written) == cfg
    want = golden.load()["deepseek_v3"]
    values = golden.case_weights(want)
    with pytest.warns(UserWarning, match="no multi-token prediction layers"):  # transformers saved none
        params, read = hf.load_hf_llama(_written(tmp_path / "kimi", kimi, values))
        same, _ = hf.load_hf_llama(_written(tmp_path / "v3", want["config"], values))
    jax.tree.map(np.testing.assert_array_equal, params, same)
    hf.export_hf_llama(params, read, tmp_path / "out", buffers=hf.load_hf_buffers(tmp_path / "kimi", read),
                       dtype="float32", hf_config=kimi)
    _assert_same_tensors(_read_all(tmp_path / "out"), values)


@pytest.mark.parametrize("config", [DEEPSEEK_V3_CONFIG, DEEPSEEK_V3_HALVES_CONFIG], ids=["groups_yarn", "halves"])
def test_deepseek_v3_logits_match_transformers(tmp_path, config):
    _check_against_transformers(tmp_path, "DeepseekV3", config, keep_config=True)


# ---------------------------------------------------------------------------------------------------------------
# Qwen3 and Qwen3-MoE: per-head q and k norms (model.qk_norm); MoE layers named as DeepSeekMoE's, no shared experts


def test_qwen3_configs_map_both_ways():
    cfg = hf.config_from_hf(QWEN3_CONFIG)
    assert (cfg.qk_norm, cfg.d_head, cfg.head_dim, cfg.moe.n_experts) == (True, 16, 16, 0)
    assert hf.model_type(cfg) == "qwen3"
    assert hf.config_to_hf(cfg, "float32", QWEN3_CONFIG) == {**QWEN3_CONFIG, "tie_word_embeddings": False}
    moe = hf.config_from_hf(QWEN3_MOE_CONFIG)
    m = moe.moe
    assert (m.n_experts, m.top_k, m.d_expert, m.n_shared, m.n_dense_first, m.normalize_top_k, m.aux_loss_coef) == \
        (6, 3, 24, 0, 1, True, pytest.approx(0.003))  # HF's coefficient x top_k, as Mixtral's
    assert hf.model_type(moe) == "qwen3_moe"
    assert hf.config_to_hf(moe, "float32", QWEN3_MOE_CONFIG) == QWEN3_MOE_CONFIG
    renamed = {**{k: v for k, v in QWEN3_MOE_CONFIG.items() if k != "num_experts"}, "num_local_experts": 6}
    assert hf.config_from_hf(renamed) == moe  # transformers 5 writes num_experts so
    for c in (cfg, moe):  # the shapes the model builds, q_norm and k_norm included
        abstract = nnx.eval_shape(lambda c=c: Llama(c, rngs=nnx.Rngs(0)))
        shapes = hf.param_shapes(c)
        assert jax.tree.map(lambda x: tuple(x.shape), params_of(abstract)) == shapes
        assert shapes["blocks"]["attn"]["q_norm"]["scale"] == (3 - c.moe.n_dense_first, 16)
    # a base of another architecture gives its token ids, not its keys
    assert hf.config_to_hf(moe, "float32", MIXTRAL_CONFIG)["model_type"] == "qwen3_moe"
    assert "num_local_experts" not in hf.config_to_hf(moe, "float32", MIXTRAL_CONFIG)
    shared = dataclasses.replace(moe, moe=dataclasses.replace(m, n_shared=1))
    with pytest.raises(ConfigError, match="model.moe.n_shared.*Qwen3-MoE has moe.n_shared=0"):
        hf.config_to_hf(shared, "float32")


@pytest.mark.parametrize("change, match", [
    ({"use_sliding_window": True}, "use_sliding_window=true"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "sliding_attention"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
])
def test_unsupported_qwen3_configs_are_refused(change, match):
    with pytest.raises(hf.HFFormatError, match=match):
        hf.config_from_hf({**QWEN3_MOE_CONFIG, **change})


@pytest.mark.parametrize("arch, config", [("Qwen3", QWEN3_CONFIG), ("Qwen3Moe", QWEN3_MOE_CONFIG),
                                          ("Qwen2", QWEN2_CONFIG)], ids=["qwen3", "qwen3_moe", "qwen2"])
def test_qwen_logits_match_transformers(tmp_path, arch, config):
    _check_against_transformers(tmp_path, arch, config)


def test_checkpoints_are_read_under_their_own_names_whatever_the_runs_routing(tmp_path):
    """Tensor names follow config.json's model_type, not the form the run's config would export as: a DeepSeekMoE
    checkpoint whose MoE has Mixtral's form, and a Mixtral one read by a config that does not renormalize (a
    warning)."""
    from tests import transformers_golden as golden

    mixtral_form = {**DEEPSEEK_CONFIG, "first_k_dense_replace": 0, "n_shared_experts": None, "norm_topk_prob": True,
                    "moe_intermediate_size": DEEPSEEK_CONFIG["intermediate_size"]}
    cfg = hf.config_from_hf(mixtral_form)
    assert hf.model_type(cfg) == "mixtral"  # it would export as Mixtral
    shapes = hf.param_shapes(cfg)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
    names = {k: (t, i) for k, t, i in hf._hf_keys(cfg, "deepseek")}
    tensors = {k: np.ascontiguousarray(hf._get(params, t.path)[i].T if t.transpose else hf._get(params, t.path)[i])
               for k, (t, i) in names.items()}
    golden.write(tmp_path / "ds", mixtral_form, tensors)
    back, got = hf.load_hf_llama(tmp_path / "ds")
    assert got == cfg and "model.layers.0.mlp.gate.weight" in names
    jax.tree.map(np.testing.assert_array_equal, back, params)
    mixtral = hf.config_from_hf(MIXTRAL_CONFIG)
    mixtral_params = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), hf.param_shapes(mixtral),
                                  is_leaf=lambda x: isinstance(x, tuple))
    hf.export_hf_llama(mixtral_params, mixtral, tmp_path / "mx", dtype="float32")
    plain = dataclasses.replace(mixtral, moe=dataclasses.replace(mixtral.moe, normalize_top_k=False))
    with pytest.warns(UserWarning, match="model.moe.normalize_top_k=False differs from the checkpoint's True"):
        hf.load_hf_llama(tmp_path / "mx", plain)


def test_export_base_and_sidecars_follow_the_model_and_nothing_else(tmp_path, capsys):
    """--hf-config of another shape leaves none of its architecture keys; an auto_map entry of another repository is
    kept with the local code, a module name that is not one is not followed, a non-dict auto_map is ignored; runs
    started from runs export with the first model's keys; an init_from that is gone is said; --overwrite removes the
    old export's sidecars; --hf-config takes a directory."""
    _deepseek_dir(tmp_path / "hf", code=True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["auto_map"]["AutoTokenizer"] = ["other-org/tok--tokenization_other.OtherTokenizer", None]
    config["auto_map"]["AutoModel"] = "../evil.Model"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert hf.code_files(config) == ["configuration_deepseek.py", "modeling_deepseek.py"]
    assert hf.code_files({"auto_map": ["modeling_x.X"]}) == []
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "imp")]) == 0
    assert hf.main(["export", str(tmp_path / "imp"), str(tmp_path / "out")]) == 0
    auto = json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]
    assert auto == {k: v for k, v in config["auto_map"].items() if k != "AutoModel"}
    assert sorted(f.name for f in (tmp_path / "out").glob("*.py")) == ["configuration_deepseek.py",
                                                                       "modeling_deepseek.py"]
    assert not (tmp_path / "evil.py").exists()

    # a chain of runs: run2 from run1 from the HF directory; run1's kept files are gone, so run2 kept them itself
    over = (*DEEPSEEK_TRAIN, "steps=1", "optim.warmup_steps=0", "mesh.fsdp=1", "ckpt.async_save=false",
            "log.eval_every_steps=-1")
    train(tiny_config(tmp_path / "run1", *over, f"init_from={tmp_path / 'imp'}"), jax.devices()[:1])
    train(tiny_config(tmp_path / "run2", *over, f"init_from={tmp_path / 'run1'}"), jax.devices()[:1])
    assert hf.main(["export", str(tmp_path / "run2"), str(tmp_path / "out2")]) == 0
    written = json.loads((tmp_path / "out2" / "config.json").read_text())
    assert (written["bos_token_id"], written["max_position_embeddings"]) == (1, 128)
    # a run from before runs kept the files, started from a directory that is gone: said, and nothing taken
    for f in (tmp_path / "run2").glob("hf_*"):
        f.unlink()
    (tmp_path / "run2" / "config.yaml").write_text(
        (tmp_path / "run2" / "config.yaml").read_text().replace(str(tmp_path / "run1"), str(tmp_path / "gone")))
    capsys.readouterr()
    assert hf.main(["export", str(tmp_path / "run2"), str(tmp_path / "out3")]) == 0
    assert "which is not found from here" in capsys.readouterr().out
    assert "bos_token_id" not in json.loads((tmp_path / "out3" / "config.json").read_text())

    # --hf-config of another shape (a Qwen3-MoE in transformers 5's spelling) for a Qwen3-MoE of 4 experts
    qcfg = dataclasses.replace(hf.config_from_hf(QWEN3_MOE_CONFIG),
                               moe=dataclasses.replace(hf.config_from_hf(QWEN3_MOE_CONFIG).moe, n_experts=4))
    other = {**QWEN3_MOE_CONFIG, "num_local_experts": 6, "layer_types": ["full_attention"] * 3}
    other.pop("num_experts")
    out = hf.config_to_hf(qcfg, "float32", other)
    assert out["num_experts"] == 4 and "num_local_experts" not in out and "layer_types" not in out

    # --overwrite: the old export's generation_config.json and code go; --hf-config takes a directory
    assert hf.main(["export", str(tmp_path / "run2"), str(tmp_path / "out"), "--overwrite"]) == 0
    assert not list((tmp_path / "out").glob("*.py")) and not (tmp_path / "out" / "generation_config.json").exists()
    assert hf.main(["export", str(tmp_path / "run2"), str(tmp_path / "out"), "--overwrite", "--hf-config",
                    str(tmp_path / "hf")]) == 0
    assert (tmp_path / "out" / "generation_config.json").is_file()
    assert hf.main(["export", str(tmp_path / "run2"), str(tmp_path / "o4"), "--hf-config", str(tmp_path / "no")]) == 2
    assert "no such file, nor a directory holding config.json" in capsys.readouterr().err


def test_an_import_that_fails_leaves_nothing(tmp_path, monkeypatch):
    _deepseek_dir(tmp_path / "hf", code=True)

    def fails(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "keep_model_files", fails)
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "imp")]) == 2
    assert not (tmp_path / "imp").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "mine")]) == 2
    assert sorted(f.name for f in (tmp_path / "mine").iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------------------------------------------------------
# Qwen2 (Qwen2.5's architecture): q, k and v biases (model.attention_bias)


def test_qwen2_config_maps_both_ways_and_its_biases_have_their_names(tmp_path):
    cfg = hf.config_from_hf(QWEN2_CONFIG)
    assert (cfg.attention_bias, cfg.qk_norm, cfg.d_head) == (True, False, 12)
    assert hf.model_type(cfg) == "qwen2"
    out = hf.config_to_hf(cfg, "float32", QWEN2_CONFIG)
    assert out == {**QWEN2_CONFIG, "tie_word_embeddings": False, "head_dim": 12} and "attention_bias" not in out
    shapes = hf.param_shapes(cfg)
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    assert jax.tree.map(lambda x: tuple(x.shape), params_of(abstract)) == shapes
    assert shapes["blocks"]["attn"]["bq"] == (3, 48) and shapes["blocks"]["attn"]["bk"] == (3, 24)
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
    hf.export_hf_llama(params, cfg, tmp_path / "hf", dtype="float32")
    with safe_open(str(tmp_path / "hf" / hf.SINGLE_FILE), framework="np") as f:
        np.testing.assert_array_equal(f.get_tensor("model.layers.2.self_attn.v_proj.bias"),
                                      params["blocks"]["attn"]["bv"][2])
    back, cfg2 = hf.load_hf_llama(tmp_path / "hf")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, back, params)
    for change, key in (({"qk_norm": True}, "model.qk_norm"), ({"moe": hf.config_from_hf(MIXTRAL_CONFIG).moe},
                                                                "model.moe.n_experts")):
        with pytest.raises(ConfigError, match=f"{key}.*dense Qwen2"):
            hf.config_to_hf(dataclasses.replace(cfg, **change), "float32")


def test_mistral_is_llama_under_its_own_config_and_a_window_is_refused(tmp_path):
    """Mistral maps as Llama (its head_dim kept); an export from its config.json writes MistralConfig's keys again
    (no Llama-only keys, no window), from a run that `import` made as from the config itself. A sliding window
    shorter than the context, set or left to MistralConfig's default (no key), is refused naming it."""
    cfg = hf.config_from_hf(MISTRAL_CONFIG)
    assert (hf.model_type(cfg), cfg.d_head, cfg.rope_theta) == ("llama", 16, 1e6)
    assert hf.config_to_hf(cfg, "float32", MISTRAL_CONFIG) == {**MISTRAL_CONFIG, "rope_scaling": None}
    assert hf.config_to_hf(cfg, "float32")["architectures"] == ["LlamaForCausalLM"]  # from no base: Llama's
    v01 = {**MISTRAL_CONFIG, "max_position_embeddings": 32768}
    with pytest.raises(hf.HFFormatError, match=r"sliding_window=4096 is not supported below max_position_embeddings"
                                               r"=32768"):
        hf.config_from_hf({**v01, "sliding_window": 4096})
    with pytest.raises(hf.HFFormatError, match=r"sliding_window=4096 \(no key: MistralConfig defaults to it\)"):
        hf.config_from_hf({k: v for k, v in v01.items() if k != "sliding_window"})
    assert hf.config_from_hf({**MISTRAL_CONFIG, "sliding_window": 128}) == cfg  # the whole context: no window
    with pytest.raises(hf.HFFormatError, match=r"below max_position_embeddings=131072"):  # MistralConfig's defaults
        hf.config_from_hf({k: v for k, v in MISTRAL_CONFIG.items() if k not in ("sliding_window",
                                                                                "max_position_embeddings")})

    tensors = _hf_tensors(MISTRAL_CONFIG, np.float32, seed=5)
    _write_hf(tmp_path / "src", MISTRAL_CONFIG, tensors, sharded=False)
    assert hf.main(["import", str(tmp_path / "src"), str(tmp_path / "run")]) == 0
    assert hf.main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    _assert_same_tensors(_read_all(tmp_path / "out"), tensors)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {**MISTRAL_CONFIG, "rope_scaling": None}


@pytest.mark.parametrize("arch, config", [("Mistral", MISTRAL_CONFIG), ("Phi3", PHI3_CONFIG)], ids=["mistral", "phi3"])
def test_llama_architectures_logits_match_transformers(tmp_path, arch, config):
    _check_against_transformers(tmp_path, arch, config, keep_config=True)


def test_phi3_reads_and_writes_its_fused_projections(tmp_path):
    """Phi-3's qkv_proj and gate_up_proj are the row-stacked q, k, v and gate, up projections: read into wq, wk, wv,
    w_gate and w_up, written back fused under Phi3Config's keys, the parts of one tensor never split across
    shards; a window is refused by name, a wrongly sized fused tensor named with the shape config.json implies."""
    from tests import transformers_golden as golden

    want = golden.load()["phi3"]
    values = golden.case_weights(want)
    golden.write(tmp_path / "hf", PHI3_CONFIG, values)
    params, cfg = hf.load_hf_llama(tmp_path / "hf")
    assert (hf.model_type(cfg), cfg.d_head) == ("llama", 12)
    qkv = values["model.layers.1.self_attn.qkv_proj.weight"]
    np.testing.assert_array_equal(params["blocks"]["attn"]["wk"][1], qkv[48:72].T)
    gate_up = values["model.layers.2.mlp.gate_up_proj.weight"]
    np.testing.assert_array_equal(params["blocks"]["mlp"]["w_up"][2], gate_up[80:].T)
    assert hf.config_to_hf(cfg, "float32", PHI3_CONFIG) == {**PHI3_CONFIG, "head_dim": 12, "rope_scaling": None}
    nbytes = sum(v.nbytes for v in values.values())
    hf.export_hf_llama(params, cfg, tmp_path / "out", dtype="float32", hf_config=PHI3_CONFIG,
                       max_shard_bytes=nbytes // 4)
    got = _read_all(tmp_path / "out")
    assert set(got) == set(values)
    _assert_same_tensors(got, values)
    with pytest.raises(hf.HFFormatError, match=r"sliding_window=2047 is not supported below"):
        hf.config_from_hf({**PHI3_CONFIG, "sliding_window": 2047, "max_position_embeddings": 4096})  # Phi-3-mini-4k
    # shards: a fused tensor is planned by its whole size, so no shard passes the limit but one tensor alone
    hf.export_hf_llama(params, cfg, tmp_path / "small", dtype="float32", hf_config=PHI3_CONFIG, max_shard_bytes=30000)
    for f in (tmp_path / "small").glob("*.safetensors"):
        held = _read_all_file(f)
        assert len(held) == 1 or sum(v.nbytes for v in held.values()) <= 30000, (f.name, sorted(held))
    # Llama 3.1 scaling, which Phi3Config does not take: the same model as LlamaForCausalLM, unfused
    scaled = dataclasses.replace(cfg, rope_scaling=RopeScaling(factor=8.0, original_max_len=32))
    with pytest.warns(UserWarning, match="written as LlamaForCausalLM"):
        hf.export_hf_llama(params, scaled, tmp_path / "llama", dtype="float32", hf_config=PHI3_CONFIG)
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["model_type"] == "llama"
    assert "model.layers.0.self_attn.k_proj.weight" in _read_all(tmp_path / "llama")
    with contextlib.ExitStack() as stack:  # parts are read in row ranges of step 1
        weights = hf._Weights(tmp_path / "hf", hf._weight_files(tmp_path / "hf"), stack,
                              hf._part_rows(hf._fusions("phi3", cfg)))
        k_rows = weights.read("model.layers.1.self_attn.k_proj.weight", (slice(2, 5), slice(0, 3)))
        np.testing.assert_array_equal(k_rows, qkv[50:53, :3])
        with pytest.raises(ValueError, match="step 1"):
            weights.read("model.layers.1.self_attn.k_proj.weight", (slice(0, 24, 2), slice(None)))
    golden.write(tmp_path / "bad", PHI3_CONFIG, {**values, "model.layers.0.self_attn.qkv_proj.weight": qkv[:90]})
    with pytest.raises(hf.HFFormatError, match=r"'model.layers.0.self_attn.qkv_proj.weight' has shape \(90, 48\); "
                                               r"config.json implies \(96, 48\)"):
        hf.load_hf_llama(tmp_path / "bad")


def test_a_model_without_a_shipped_config_trains_from_its_import_and_exports_as_itself(tmp_path):
    """README's path for a model no shipped config describes: `import` writes OUT/config.yaml, `--config
    OUT/config.yaml init_from=OUT` trains from it (the import's weights, the model section as written), and the run
    exports under the model's own architecture (Phi-3's fused projections) with the trained weights."""
    from mx_jax.config import load_config
    from tests import transformers_golden as golden

    want = golden.load()["phi3"]
    golden.write(tmp_path / "hf", PHI3_CONFIG, golden.case_weights(want))
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "imp")]) == 0
    cfg = load_config(str(tmp_path / "imp" / "config.yaml"), [
        f"init_from={tmp_path / 'imp'}", f"run_dir={tmp_path / 'run'}", "data.source=embedded", "data.seq_len=32",
        "data.batch_size=8", "steps=2", "optim.warmup_steps=0", "log.every_steps=1", "log.progress=false",
        "log.tensorboard=false", "log.eval_every_steps=-1", "ckpt.async_save=false"])
    result = train(cfg)
    assert np.isfinite(result.metrics["loss"])
    imported, _ = hf.load_hf_llama(tmp_path / "hf")  # two AdamW steps move each weight by ~2 lr, not by ~0.15
    moved = jax.tree.map(lambda a, b: float(np.abs(a - np.asarray(b)).max()), imported, result.state["params"])
    assert 0 < max(jax.tree.leaves(moved)) < 0.01, moved
    assert hf.main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["architectures"], written["pad_token_id"]) == (["Phi3ForCausalLM"], 3)
    assert "model.layers.2.self_attn.qkv_proj.weight" in _read_all(tmp_path / "out")
    back, _ = hf.load_hf_llama(tmp_path / "out")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), back, result.state["params"])


def test_attention_biases_are_added_to_q_k_v_and_not_decayed():
    """q, k, v = x W + b (before RoPE), the biases in the activations' dtype, with gradients and no weight decay."""
    from mx_jax import optim
    from mx_jax.layers import Attention, Positions, apply_rope, rope_inv_freq

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, attention_bias=True,
                      compute_dtype="float32")
    attn = Attention(cfg, dict.fromkeys(("wq", "wk", "wv", "wo"), "bf16"), "auto", rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    b = {n: rng.standard_normal(getattr(attn, n)[...].shape).astype(np.float32) for n in ("bq", "bk", "bv")}
    for n, v in b.items():
        getattr(attn, n)[...] = jnp.asarray(v)
    x = rng.standard_normal((2, 8, 32)).astype(np.float32)
    inv_freq = rope_inv_freq(8, cfg.rope_theta, cfg.rope_scaling)
    q, k, v = attn._qkv(jnp.asarray(x), Positions(jnp.arange(8)), inv_freq)
    want_v = (x @ np.asarray(attn.wv[...]) + b["bv"]).reshape(2, 8, 2, 8)
    want_q = apply_rope(jnp.asarray((x @ np.asarray(attn.wq[...]) + b["bq"]).reshape(2, 8, 4, 8)), jnp.arange(8),
                        inv_freq)
    np.testing.assert_allclose(np.asarray(v), want_v, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(q), np.asarray(want_q), rtol=1e-5, atol=1e-5)
    model = Llama(cfg, rngs=nnx.Rngs(1))
    mask = optim.decay_mask(params_of(model))["blocks"]["attn"]
    assert (mask["bq"], mask["bk"], mask["bv"], mask["wq"]) == (False, False, False, True)
    grads = nnx.grad(lambda m: jnp.sum(m(jnp.asarray(rng.integers(0, 64, (2, 8))))[0] ** 2))(model)
    assert float(jnp.abs(grads.blocks.attn.bk[...]).sum()) > 0


@pytest.mark.parametrize("config", [DEEPSEEK_CONFIG, DEEPSEEK_V2_CONFIG, DEEPSEEK_V3_CONFIG],
                         ids=["deepseek", "deepseek_v2", "deepseek_v3"])
def test_deepseek_seq_aux_is_the_sequence_wise_balance_loss(config):
    """DeepSeek's seq_aux (its configs' default, true) is model.moe.aux_loss_scope=sequence, and an export writes
    the scope back; seq_aux false is the batch-wise loss."""
    cfg = hf.config_from_hf({k: v for k, v in config.items() if k != "seq_aux"})
    assert cfg.moe.aux_loss_scope == "sequence" and hf.config_from_hf(config) == cfg
    assert hf.config_from_hf({**config, "seq_aux": False}).moe.aux_loss_scope == "batch"
    assert hf.config_to_hf(cfg, "float32")["seq_aux"] is True
    batch = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, aux_loss_scope="batch"))
    assert hf.config_to_hf(batch, "float32")["seq_aux"] is False
