"""transformers' logits for tiny Llama, Mistral, Phi-3, Mixtral, DeepSeekMoE, DeepSeek-V2, DeepSeek-V3, Qwen2, Qwen3 and
Qwen3-MoE models (and Llama 3.1 and YaRN RoPE scaling), kept so that CI (no torch) checks our import against them.

    python tests/transformers_golden.py     # needs numpy, torch, transformers; rewrites tests/data/transformers.npz

test_hf.py checks our logits against a live transformers model where torch and transformers are installed (the GPU
image has them), and against this file everywhere. Each case's weights are not stored: they are drawn again from
the names and shapes recorded here, by `weights` (numpy's legacy RandomState, whose streams numpy keeps fixed), so
the file holds only configs, names, shapes, the token ids and transformers' float32 logits (eager attention).
Nothing here imports jax or mx_jax, so the script runs in an environment that only has torch.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

GOLDEN = pathlib.Path(__file__).resolve().parent / "data" / "transformers.npz"

# Tiny Llama with GQA (4 query heads on 2 kv heads), head_dim 8 != hidden/heads, and llama3 rope scaling whose
# original context (16) puts the K/2 = 4 frequencies in all three bands (kept, interpolated, divided by factor).
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 48,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 80, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16},
    "max_position_embeddings": 128, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}
MIXTRAL_CONFIG = {**{k: v for k, v in HF_CONFIG.items() if k not in ("attention_bias", "mlp_bias")},
                  "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
                  "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "sliding_window": None,
                  "output_router_logits": False, "router_jitter_noise": 0.0, "vocab_size": 256}  # a byte corpus
# DeepSeekMoE (deepseek-ai/deepseek-moe-16b-base's config.json keys): a dense first layer, then 6 routed experts of
# width 24 (top-3, weights not renormalized) and 2 shared ones; GQA, which its attention allows though the 16B has none.
# The vocabulary of a byte corpus, so that a trainer run starts from it.
DEEPSEEK_CONFIG = {
    "architectures": ["DeepseekForCausalLM"], "model_type": "deepseek", "vocab_size": 256, "hidden_size": 48,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 80,
    "moe_intermediate_size": 24, "n_routed_experts": 6, "num_experts_per_tok": 3, "n_shared_experts": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "scoring_func": "softmax", "norm_topk_prob": False,
    "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": None, "max_position_embeddings": 128, "attention_bias": False, "tie_word_embeddings": False,
    "pretraining_tp": 1, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}
# DeepSeek-V2 (deepseek-ai/DeepSeek-V2-Lite's config.json keys): multi-head latent attention, queries from x (no
# q_lora_rank), value heads (12) narrower than the query and key heads (8 + 8); YaRN whose original context (256)
# puts the r/2 = 4 rotated frequencies in all three bands, with mscale != mscale_all_dim, so that the rotated parts
# are scaled (attention factor 0.957) and the softmax too (m^2 = 1.29); a dense first layer, then 6 routed experts
# (top-3, weights times routed_scaling_factor) and 2 shared ones. The second: queries through their own latent (12),
# no rope scaling, and group-limited routing: the top-3 experts within the 2 of 3 groups whose best expert scores
# highest (with top_k <= topk_group it would choose as greedy does: the best k experts lie in the best k groups).
DEEPSEEK_V2_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 256, "hidden_size": 48,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 80,
    "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "moe_intermediate_size": 24, "n_routed_experts": 6, "num_experts_per_tok": 3, "n_shared_experts": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "scoring_func": "softmax", "topk_method": "greedy",
    "norm_topk_prob": False, "routed_scaling_factor": 1.5, "aux_loss_alpha": 0.001, "seq_aux": True,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0},
    "max_position_embeddings": 1024, "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "float32",
}
DEEPSEEK_V2_Q_LORA_CONFIG = {
    **DEEPSEEK_V2_CONFIG, "q_lora_rank": 12, "rope_scaling": None, "max_position_embeddings": 128,
    "num_experts_per_tok": 3, "topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 2,
    "routed_scaling_factor": 2.0,
}
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3's config.json keys): latent attention with a query latent (12) and a rotated
# width of 4; YaRN as V3 writes it (mscale = mscale_all_dim = 1: an attention factor of exactly 1, the softmax scaled
# by m^2 = 1.30) over an original context (1024) that keeps the first of the r/2 = 2 frequencies and ramps the other;
# a dense first layer, then sigmoid routing (noaux_tc) over 8 experts in 4 groups of 2: a group scored by the sum of
# its top-2 biased scores, the best 2 groups kept, the top-2 experts in them (moe.py's own default would score a
# group by its best expert here), their unbiased scores renormalized and times 2.5, and 1 shared expert. The weights
# give every e_score_correction_bias 0.15 N(0, 1), which changes the choice of many tokens (test_hf checks that
# dropping them moves the logits). The second: queries from x and one group (greedy) as Moonlight-16B-A3B has them,
# rope_interleave false (the rotated rows in halves), top-3 weights not renormalized, 2 shared experts, no rope scaling.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 48,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 80,
    "kv_lora_rank": 16, "q_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12,
    "moe_intermediate_size": 24, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "n_group": 4, "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1, "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 4096, "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "torch_dtype": "float32",
}
DEEPSEEK_V3_HALVES_CONFIG = {
    **DEEPSEEK_V3_CONFIG, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 3,
    "norm_topk_prob": False, "routed_scaling_factor": 1.5, "n_shared_experts": 2, "rope_interleave": False,
    "num_nextn_predict_layers": 0, "rope_scaling": None, "max_position_embeddings": 128,
}
# Qwen3: per-head RMSNorm of q and k (model.qk_norm), head_dim 16 != hidden / heads, tied embeddings as its small
# models have them; Qwen3-MoE with a dense first layer (mlp_only_layers) and the top-k weights renormalized.
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 48,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 80,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
    "max_position_embeddings": 128, "attention_bias": False, "tie_word_embeddings": True, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 3, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}
QWEN3_MOE_CONFIG = {
    **QWEN3_CONFIG, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "tie_word_embeddings": False,
    "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 24, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [0], "router_aux_loss_coef": 0.001, "output_router_logits": False,
}
# Qwen2 (Qwen2.5's architecture): biases on q, k and v (model.attention_bias), tied embeddings.
QWEN2_CONFIG = {**{k: v for k, v in QWEN3_CONFIG.items() if k not in ("head_dim", "attention_bias")},
                "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
# Mistral (v0.2 on): Llama's architecture; head_dim 16 != hidden / heads (as Mistral NeMo's), no sliding window.
MISTRAL_CONFIG = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 256, "hidden_size": 48,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 80,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 128,
    "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}
# Phi-3 (Phi-4's form): Llama's architecture with q, k, v stored as one qkv_proj and gate, up as one gate_up_proj.
PHI3_CONFIG = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 256, "hidden_size": 48,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 80,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 250000.0, "max_position_embeddings": 128,
    "original_max_position_embeddings": 128, "sliding_window": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
    "attention_dropout": 0.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
    "torch_dtype": "float32",
}
CASES = {  # name: (transformers architecture, config.json)
    "llama": ("Llama", HF_CONFIG),
    "llama_tied": ("Llama", {**HF_CONFIG, "tie_word_embeddings": True}),
    "mixtral": ("Mixtral", MIXTRAL_CONFIG),
    "deepseek": ("Deepseek", DEEPSEEK_CONFIG),
    "deepseek_top_k_normalized": ("Deepseek", {**DEEPSEEK_CONFIG, "norm_topk_prob": True, "n_shared_experts": None,
                                               "first_k_dense_replace": 0}),
    "qwen3": ("Qwen3", QWEN3_CONFIG),
    "qwen3_moe": ("Qwen3Moe", QWEN3_MOE_CONFIG),
    "qwen2": ("Qwen2", QWEN2_CONFIG),
    "mistral": ("Mistral", MISTRAL_CONFIG),
    "phi3": ("Phi3", PHI3_CONFIG),
    "deepseek_v2": ("DeepseekV2", DEEPSEEK_V2_CONFIG),
    "deepseek_v2_q_lora": ("DeepseekV2", DEEPSEEK_V2_Q_LORA_CONFIG),
    "deepseek_v3": ("DeepseekV3", DEEPSEEK_V3_CONFIG),
    "deepseek_v3_halves": ("DeepseekV3", DEEPSEEK_V3_HALVES_CONFIG),
    # YaRN as Qwen2.5's long-context recipe writes it (head dim 12, original context 1024: frequency 0 kept, 1-4
    # mixed, 5 divided by the factor), and with DeepSeek's mscale / mscale_all_dim attention factor and beta_fast 16
    "qwen2_yarn": ("Qwen2", {**QWEN2_CONFIG, "max_position_embeddings": 4096, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}),
    "llama_yarn": ("Llama", {**HF_CONFIG, "rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "beta_fast": 16, "mscale": 0.707,
        "mscale_all_dim": 1.0}, "max_position_embeddings": 8192}),
}
TOKENS = (2, 40)  # 40 positions > the rope scaling's original context of 16


def weights(names: list[str], shapes: list[tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights by HF name: norms 1 + 0.5 N(0, 1) (never ones), the rest 0.15 N(0, 1), which gives logits of
    size ~4, so that a wrong rope band or q/k layout moves them by ~5, not by 5e-3."""
    rs = np.random.RandomState(seed)
    out = {}
    for name, shape in zip(names, shapes):
        v = rs.standard_normal(shape).astype(np.float32)
        out[name] = 1 + 0.5 * v if name.endswith("norm.weight") else 0.15 * v
    return out


def case_weights(case: dict) -> dict[str, np.ndarray]:
    """`weights` of a case `load` returns: its checkpoint's tensors, drawn again from the recorded names and shapes."""
    return weights(case["names"], [tuple(s) for s in case["shapes"]])


def tokens(vocab_size: int, seed: int = 1) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab_size, TOKENS)


def load() -> dict[str, dict]:
    """{case: {"config", "names", "shapes", "tokens", "logits"}} from GOLDEN, and "versions" (what made it)."""
    with np.load(GOLDEN) as f:
        index = json.loads(str(f["index"]))
        return {"versions": index["versions"],
                **{c: {**index["cases"][c], "tokens": f[f"{c}/tokens"], "logits": f[f"{c}/logits"]}
                   for c in index["cases"]}}


def write(path: pathlib.Path, config: dict, values: dict[str, np.ndarray]) -> None:
    """An HF checkpoint directory: config.json and one model.safetensors."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(values, str(path / "model.safetensors"), metadata={"format": "pt"})


def deepseek_model(config: dict):
    """DeepSeekMoE as transformers loads deepseek-ai/deepseek-moe-16b-base (its modeling_deepseek.py, in eval):
    transformers' Llama, whose attention, norms and RoPE that file copies, with each MoE layer's `mlp` replaced by the
    block below under the checkpoint's names. transformers has no DeepSeekMoE class of its own, and the checkpoint's
    code does not run on transformers 5."""
    import torch
    import transformers
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, d: int, f: int):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
            self.down_proj = nn.Linear(f, d, bias=False)

        def forward(self, x):
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class MoE(nn.Module):
        """MoEGate: scores = softmax(x gate.weight^T), the top-k scores as weights (divided by their sum only with
        norm_topk_prob); DeepseekMoE: the chosen experts' outputs times their weights, plus the shared experts' MLP
        (n_shared_experts x moe_intermediate_size wide) of the same input."""

        def __init__(self, c: dict):
            super().__init__()
            d, f, self.k, self.norm = c["hidden_size"], c["moe_intermediate_size"], c["num_experts_per_tok"], \
                c["norm_topk_prob"]
            self.gate = nn.Linear(d, c["n_routed_experts"], bias=False)
            self.experts = nn.ModuleList(MLP(d, f) for _ in range(c["n_routed_experts"]))
            self.shared_experts = MLP(d, f * c["n_shared_experts"]) if c["n_shared_experts"] else None

        def forward(self, x):
            w, idx = torch.topk(self.gate(x).softmax(dim=-1), k=self.k, dim=-1)
            if self.norm:
                w = w / w.sum(dim=-1, keepdim=True)
            y = sum((w * (idx == e)).sum(dim=-1, keepdim=True) * expert(x) for e, expert in enumerate(self.experts))
            return y if self.shared_experts is None else y + self.shared_experts(x)

    c = config
    llama = transformers.LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        intermediate_size=c["intermediate_size"], rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"],
        max_position_embeddings=c["max_position_embeddings"], tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(llama)
    for i, layer in enumerate(model.model.layers):
        if i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0:
            layer.mlp = MoE(c)
    return model


def main() -> int:
    import tempfile

    import torch
    import transformers
    from safetensors import safe_open

    index, arrays = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                     "cases": {}}, {}
    tmp = pathlib.Path(tempfile.mkdtemp())
    for case, (arch, config) in CASES.items():
        if arch == "Deepseek":  # the checkpoint's names are the module's (tensors by name, strict)
            model = deepseek_model(config)
            names = sorted(model.state_dict())
            shapes = [tuple(model.state_dict()[n].shape) for n in names]
            values = weights(names, shapes)
            model.load_state_dict({n: torch.from_numpy(v) for n, v in values.items()}, strict=True)
            model.config._attn_implementation = "eager"
            model = model.float().eval()
            write(tmp / case, config, values)
        else:
            # the names and shapes of the checkpoint format (what save_pretrained writes, what the Hub holds:
            # transformers 5 keeps Mixtral's experts fused in memory but reads and writes them one matrix per expert)
            c = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
            getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**c)).save_pretrained(
                tmp / f"{case}_layout", safe_serialization=True)
            names, shapes = [], []
            for f in sorted((tmp / f"{case}_layout").glob("*.safetensors")):
                with safe_open(str(f), framework="np") as st:
                    for n in sorted(st.keys()):
                        names.append(n)
                        shapes.append(tuple(st.get_slice(n).get_shape()))
            write(tmp / case, config, weights(names, shapes))
            model = getattr(transformers, f"{arch}ForCausalLM").from_pretrained(
                tmp / case, attn_implementation="eager", dtype=torch.float32).eval()
        ids = tokens(config["vocab_size"])
        with torch.no_grad():
            logits = model(torch.as_tensor(ids)).logits.numpy().astype(np.float32)
        index["cases"][case] = {"config": config, "names": names, "shapes": shapes}
        arrays[f"{case}/tokens"], arrays[f"{case}/logits"] = ids.astype(np.int32), logits
        print(f"{case}: {len(names)} tensors, logits {logits.shape}, |logits| max {np.abs(logits).max():.2f}")
    GOLDEN.parent.mkdir(exist_ok=True)
    np.savez_compressed(GOLDEN, index=np.asarray(json.dumps(index)), **arrays)
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size:,} bytes) with torch {torch.__version__}, transformers "
          f"{transformers.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
