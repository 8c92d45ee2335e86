"""Hugging Face Llama, Mistral, Phi-3, Mixtral, DeepSeekMoE, DeepSeek-V2, DeepSeek-V3, Qwen2 and Qwen3 checkpoints in
and out (config.json + safetensors).

    python -m mx_jax.hf import HF_DIR OUT_DIR              # -> OUT_DIR/checkpoints/0/state + OUT_DIR/config.yaml
                                                           # (+ OUT_DIR/hf_config.json and the other SIDECARS);
                                                           # the state holds "params" and, for MoE, "buffers"
    python -m mx_jax.hf export RUN_DIR HF_OUT [--step N]   # a trainer checkpoint -> config.json + safetensors,
                                                           # the data's tokenizer files (export_tokenizer) and the
                                                           # model's sidecars (export_base)

Layout. HF stores every linear as a torch `nn.Linear` weight (out, in) and computes y = x W^T; mx_jax stores
(in, out) and computes y = x W, so each linear is transposed once on the way in and once on the way out. The
embedding is (V, D) in both. The L decoder layers are separate tensors `model.layers.{i}.*` in HF and one stacked
array with a leading L axis in mx_jax (llama.py scans over it):

    model.embed_tokens.weight                    (V, D)     embed                  (V, D)
    model.layers.{i}.input_layernorm.weight      (D,)       blocks.attn_norm.scale (L, D)
    model.layers.{i}.self_attn.q_proj.weight     (H*K, D)   blocks.attn.wq         (L, D, H*K)   transposed
    model.layers.{i}.self_attn.k_proj.weight     (G*K, D)   blocks.attn.wk         (L, D, G*K)   transposed
    model.layers.{i}.self_attn.v_proj.weight     (G*K, D)   blocks.attn.wv         (L, D, G*K)   transposed
    model.layers.{i}.self_attn.o_proj.weight     (D, H*K)   blocks.attn.wo         (L, H*K, D)   transposed
    model.layers.{i}.post_attention_layernorm.weight        blocks.mlp_norm.scale  (L, D)
    model.layers.{i}.mlp.gate_proj.weight        (F, D)     blocks.mlp.w_gate      (L, D, F)     transposed
    model.layers.{i}.mlp.up_proj.weight          (F, D)     blocks.mlp.w_up        (L, D, F)     transposed
    model.layers.{i}.mlp.down_proj.weight        (D, F)     blocks.mlp.w_down      (L, F, D)     transposed
    model.norm.weight                            (D,)       final_norm.scale       (D,)
    lm_head.weight                               (V, D)     head                   (D, V)        transposed

Why q and k need no permutation. Meta's original Llama checkpoints rotate *interleaved* pairs (x_{2i}, x_{2i+1});
HF's conversion script (transformers/models/llama/convert_llama_weights_to_hf.py, `permute`) reorders the output
rows of wq and wk inside every head so that HF's `apply_rotary_pos_emb` can rotate the two *halves* of the head
instead: with cos = cat(cos(p w), cos(p w)) and rotate_half(x) = cat(-x2, x1) (modeling_llama.py),

    q * cos + rotate_half(q) * sin = cat(x1 cos(p w) - x2 sin(p w),  x2 cos(p w) + x1 sin(p w)),

with x1 = q[..., :K/2], x2 = q[..., K/2:], and w_i = theta^(-2i/K) for i < K/2 — exactly `layers.apply_rope`. So a
checkpoint in HF layout is already in mx_jax's layout, and row j of HF's q_proj is column j of our wq, where the reshape
(B, T, H*K) -> (B, T, H, K) puts head h at columns [h K, (h+1) K) in both. GQA matches too: HF's `repeat_kv` gives query
head h the key/value head h // (H/G), as jax.nn.dot_product_attention does. Llama 3.1 frequency scaling (HF
`_compute_llama3_parameters`, rope_type "llama3", attention factor 1) and YaRN's (`_compute_yarn_parameters`, rope_type
"yarn": its attention factor scales cos and sin, so q k^T by its square) are `layers.rope_inv_freq` and
`layers.rope_attention_factor`. tests/test_hf.py checks logits against transformers' LlamaForCausalLM (when torch is
installed); an interleaved q layout or a missing rope band there moves the logits by ~5, the match is ~1e-5.

Trade-offs. Reading is lazy, one tensor at a time (safetensors `safe_open`, memory-mapped): the only full copy is
the output tree, so an 8B checkpoint never sits in memory twice; the transposes are the price of keeping every
weight (in, out) for quant.linear. Writing buffers one shard (`max_shard_bytes`, HF's default 5 GB) at a time.
Tied embeddings (`tie_word_embeddings`) are untied on import by copying, as mx_jax trains an untied head (a stored
`lm_head.weight` is read instead, as transformers 5 does); export always writes an untied `lm_head.weight`.

Mistral (MistralForCausalLM, `model_type: mistral`: Mistral 7B v0.2 and v0.3, Mistral NeMo's head_dim 128 beside
hidden 5120 / 32 heads) is Llama's architecture under Llama's names, with `sliding_window` null; a window shorter
than max_position_embeddings (v0.1's 4096 beside 32768; MistralConfig's default 4096 where config.json has no such
key) is refused. Phi-3 (Phi3ForCausalLM, `phi3`: the Phi-3 and Phi-4 models without such a window, LongRoPE or
partial rotary) is Llama's architecture with two fused tensors per layer (`_fusions`):

    model.layers.{i}.self_attn.qkv_proj.weight   (H*K + 2 G*K, D)   rows [wq^T; wk^T; wv^T]
    model.layers.{i}.mlp.gate_up_proj.weight     (2 F, D)           rows [w_gate^T; w_up^T]

An export of a run whose config.json came from a Mistral or Phi-3 model writes that architecture again (a Phi-3 model
given Llama 3.1 RoPE scaling, which Phi3Config does not take, is written as LlamaForCausalLM, with a warning).

Mixtral (MixtralForCausalLM, `model_type: mixtral`): every layer's MLP rows above are replaced by its MoE block,

    model.layers.{i}.block_sparse_moe.gate.weight           (E, D)  blocks.moe.router  (L, D, E)     transposed
    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight (F, D)  blocks.moe.w_gate  (L, E, D, F)  transposed
    model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight (F, D)  blocks.moe.w_up    (L, E, D, F)  transposed
    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight (D, F)  blocks.moe.w_down  (L, E, F, D)  transposed

and HF's routing (softmax over the router logits, top-k, the k weights renormalized) is moe.py's score=softmax,
normalize_top_k=True.

DeepSeekMoE (DeepseekForCausalLM, `model_type: deepseek`: deepseek-ai/deepseek-moe-16b-base and -chat, whose
modeling code ships with the checkpoint; vLLM and SGLang load it natively): the first `first_k_dense_replace` layers
keep the dense MLP above (mx_jax's `dense_blocks` stack, model.moe.n_dense_first), the others hold

    model.layers.{i}.mlp.gate.weight                        (E, D)   blocks.moe.router         (L', D, E)     transp.
    model.layers.{i}.mlp.experts.{j}.gate_proj.weight       (F, D)   blocks.moe.w_gate         (L', E, D, F)  transp.
    model.layers.{i}.mlp.experts.{j}.up_proj.weight         (F, D)   blocks.moe.w_up           (L', E, D, F)  transp.
    model.layers.{i}.mlp.experts.{j}.down_proj.weight       (D, F)   blocks.moe.w_down         (L', E, F, D)  transp.
    model.layers.{i}.mlp.shared_experts.gate_proj.weight    (S F, D) blocks.moe.shared.w_gate  (L', D, S F)   transp.
    model.layers.{i}.mlp.shared_experts.up_proj.weight      (S F, D) blocks.moe.shared.w_up    (L', D, S F)   transp.
    model.layers.{i}.mlp.shared_experts.down_proj.weight    (D, S F) blocks.moe.shared.w_down  (L', S F, D)   transp.

with L' = L - n_dense_first, F = moe_intermediate_size (model.moe.d_expert) and S = n_shared_experts. DeepSeek runs
its S shared experts as one MLP S F wide, and so does moe.py: the sum of S SwiGLU experts is one SwiGLU over their
concatenated columns, sum_s (silu(x G_s) * x U_s) D_s = (silu(x [G_1..G_S]) * x [U_1..U_S]) [D_1; ..; D_S].
Its `MoEGate` is moe.py's router: softmax over x W_r^T, top-k, the k weights renormalized only when
`norm_topk_prob` (false for the 16B), and the shared experts added unweighted. `aux_loss_alpha` is
model.moe.aux_loss_coef as it is: both losses are alpha x 1 at balance; `seq_aux` (true in DeepSeek's configs, its
default) is model.moe.aux_loss_scope=sequence, the loss per sequence, and an export writes it back. The attention, norms and RoPE are Llama's (head_dim = D / heads, no
rope scaling). Other MoE layouts (sigmoid scores and trained router biases without latent attention, MoE layers every
N-th) have no HF counterpart here and are refused naming the key.

DeepSeek-V2 (DeepseekV2ForCausalLM, `model_type: deepseek_v2`: deepseek-ai/DeepSeek-V2 and -V2-Lite, in transformers
itself) has DeepSeekMoE's layers, MLP names and routing below, with multi-head latent attention (model.mla,
layers.LatentAttention) in place of q, k, v and o. With n, r, v = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
(model.mla.nope_dim, rope_dim, v_dim), C = kv_lora_rank (kv_rank) and Q = q_lora_rank (q_rank; null is 0: the
queries come from x through q_proj, else through q_a_proj, its norm and q_b_proj):

    model.layers.{i}.self_attn.q_proj.weight             (H(n+r), D)  blocks.attn.wq              (L, D, H(n+r))  T, R
    model.layers.{i}.self_attn.q_a_proj.weight           (Q, D)       blocks.attn.wq_a            (L, D, Q)       T
    model.layers.{i}.self_attn.q_a_layernorm.weight      (Q,)         blocks.attn.q_a_norm.scale  (L, Q)
    model.layers.{i}.self_attn.q_b_proj.weight           (H(n+r), Q)  blocks.attn.wq_b            (L, Q, H(n+r))  T, R
    model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight (C+r, D)     blocks.attn.wkv_a           (L, D, C+r)     T, R
    model.layers.{i}.self_attn.kv_a_layernorm.weight     (C,)         blocks.attn.kv_norm.scale   (L, C)
    model.layers.{i}.self_attn.kv_b_proj.weight          (H(n+v), C)  blocks.attn.wkv_b           (L, C, H(n+v))  T
    model.layers.{i}.self_attn.o_proj.weight             (D, H v)     blocks.attn.wo              (L, H v, D)     T

(T: transposed.) The rows of q are head by head [n without RoPE, r rotated], those of kv_a [the C latent, the r of
the one rotated key], those of kv_b head by head [n of the key, v of the value]. R: DeepSeek rotates interleaved
pairs (x_2i, x_2i+1) (transformers' `apply_rotary_emb`, a complex product; the Hub's code permutes to the same), mx_jax
the halves (x_i, x_i+r/2), so each head's r rotated rows of q, and those of kv_a, are in mx_jax's order HF's rows
0, 2, ..., r-2, 1, 3, ..., r-1 of that block (`_rope_rows`; q . k sums over the same pairs either way). RoPE runs
over the r dims (DeepseekV2Config's head_dim is r); YaRN's attention factor scales the rotated parts of q and k only
(transformers scales cos and sin), and rope_scaling's `mscale_all_dim` (model.rope_scaling.mscale_all_dim) multiplies
the softmax scale 1 / sqrt(n + r) by m^2, m = 0.1 mscale_all_dim ln(factor) + 1 (`yarn_apply_mscale`). The latent
norms have eps 1e-6 whatever rms_norm_eps, in transformers, the Hub's code and mx_jax alike. Routing is
transformers' `DeepseekV2TopkRouter`: softmax, the top-k weights times `routed_scaling_factor` (model.moe.routed_scale),
never renormalized: transformers does not read `norm_topk_prob`, which the Hub's modeling_deepseek.py applies instead
of the scaling (false in V2 and V2-Lite; an import follows transformers, with a warning). `group_limited_greedy` keeps
a token's `topk_group` best of `n_group` groups, a group scored by its best expert: model.moe.route_groups,
route_top_groups and route_group_top = 1 (DeepSeek-V2's top-6 in 3 of 8 groups; V2-Lite is greedy). A dense model
with model.mla exports as first_k_dense_replace = L.

DeepSeek-V3 (DeepseekV3ForCausalLM, `model_type: deepseek_v3`: deepseek-ai/DeepSeek-V3 and -R1, moonshotai/Moonlight-
16B-A3B; Kimi K2's config.json names the same architecture `kimi_k2`, read as deepseek_v3 and written back so) is
DeepSeek-V2's layout above with sigmoid routing and a trained bias per routed expert in each MoE layer:

    model.layers.{i}.mlp.gate.e_score_correction_bias    (E,)         buffers: blocks.moe.bias    (L', E)   float32

That bias is moe.py's RouterBias, a buffer and not a parameter (the model's `buffers` tree, llama.buffers_of; the
train step moves it when model.moe.bias_update_rate > 0, which the import leaves at 0): `import` saves it as the
checkpoint's "buffers" beside its "params" (`save_params`), `init_from` returns it with the parameters
(`load_hf_buffers` from an HF directory, `load_buffers` from a checkpoint: zeros where a source holds none), and
`export` writes it back in float32 (transformers keeps it so). Routing is transformers' `DeepseekV3TopkRouter`
(topk_method noaux_tc, which transformers runs whatever config.json says): s = sigmoid(x W_r^T); each group of E /
n_group experts scored by the sum of its two best s + b, a token's topk_group best groups kept, its top-k experts
among theirs by s + b; their weights are the unbiased s, divided by their sum when norm_topk_prob, times
routed_scaling_factor. That is model.moe.score=sigmoid, route_groups, route_top_groups, route_group_top = 2 (set,
whatever moe.py's default gives), normalize_top_k and routed_scale; n_group 1, or topk_group = n_group, is greedy
(route_groups 0). The Hub's modeling_deepseek.py differs from transformers in two corners, where an import follows
transformers: it renormalizes only for top-k > 1, and it fills the dropped groups' scores with 0 instead of -inf (the
same choice while k of the kept experts have s + b > 0). RoPE: with `rope_interleave` (DeepseekV3Config's default
true; the Hub's code always) the rotated dims are interleaved pairs as in DeepSeek-V2
(`apply_rotary_pos_emb_interleave`), and the rotated rows are reordered as `_rope_rows` gives; false rotates halves,
mx_jax's order, rows as stored. An export writes rope_interleave true. The `num_nextn_predict_layers`
multi-token prediction layers stored after the L decoder layers (DeepSeek-V3's model.layers.61.*; transformers
does not load them) are model.mtp (llama.MTPLayer), each a MoE decoder layer's tensors under their usual names plus

    model.layers.{L+k}.enorm.weight / hnorm.weight    (D,)        mtp.enorm.scale / hnorm.scale    (depth, D)
    model.layers.{L+k}.eh_proj.weight                 (D, 2D)     mtp.eh_proj                      (depth, 2D, D)
    model.layers.{L+k}.shared_head.norm.weight        (D,)        mtp.norm.scale                   (depth, D)
    model.layers.{L+k}.embed_tokens.weight, shared_head.head.weight: copies of the embedding and the head

An import reads the first model.mtp.depth of them (config_from_hf sets it to num_nextn_predict_layers) and skips
the rest with a warning; the copies stay unread (the model shares its own, as DeepSeek-V3 does). transformers saves
V3 without those layers while its config.json keeps num_nextn_predict_layers 1: read as none, with a warning. An
export writes model.mtp's layers with the copies (vLLM's and SGLang's MTP loaders read them) and
num_nextn_predict_layers = model.mtp.depth; every other format here has no MTP layers and leaves them out.

FP8 checkpoints (config.json's quantization_config with quant_method "fp8" and weight_block_size [b0, b1]: DeepSeek-V3's
and Kimi K2's, whatever the model_type): a weight W8 (out, in) stored in float8 with `<key>_scale_inv` beside it,
(ceil(out / b0), ceil(in / b1)) float32, is dequantized as it is read, W[r, c] = W8[r, c] scale_inv[r // b0, c // b1]
(DeepSeek-V3's inference/fp8_cast_bf16.py `weight_dequant`; transformers' `_dequantize_fp8_weight`), slices too. The
parameters are then float32 masters as for any import; an export writes 16- or 32-bit weights and drops
quantization_config. Other quantization (GPTQ, AWQ, bitsandbytes, ...) is refused naming quantization_config.

Qwen3 (Qwen3ForCausalLM, `model_type: qwen3`) is Llama's layout plus each layer's per-head norms of q and k
(model.qk_norm), applied before RoPE:

    model.layers.{i}.self_attn.q_norm.weight     (K,)       blocks.attn.q_norm.scale  (L, K)
    model.layers.{i}.self_attn.k_norm.weight     (K,)       blocks.attn.k_norm.scale  (L, K)

Qwen2 (Qwen2ForCausalLM, `qwen2`, the architecture of Qwen2.5) is Llama's layout plus biases on q, k and v
(model.attention_bias; none on o): `model.layers.{i}.self_attn.{q,k,v}_proj.bias` (H K,) or (G K,) <->
blocks.attn.bq, bk, bv (L, H K) or (L, G K). Its MoE (Qwen2-MoE) gates its shared expert and is not mapped.

Qwen3-MoE (Qwen3MoeForCausalLM, `qwen3_moe`) names its MoE layers as DeepSeekMoE does, without shared experts: routing
softmax, top-k renormalized when `norm_topk_prob`; `mlp_only_layers` (which must be the first layers) are the dense
ones, and its `router_aux_loss_coef` is Mixtral's (x top_k here). `hf.model_type` picks the architecture an export
writes; an import reads the names of config.json's own model_type, whatever routing the run's config asks for.

Trainer hook: `init_from(path, model_cfg, param_shardings, buffer_shardings)` returns (parameters, buffers) from an HF
directory or an mx_jax checkpoint, placed on the mesh (the config key `init_from` calls it on a fresh start).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import sys
import tempfile
import warnings
from typing import Any, Iterator, NamedTuple

import jax
import ml_dtypes
import numpy as np
import yaml

from mx_jax.config import (ConfigError, MLAConfig, ModelConfig, MoEConfig, MTPConfig, RopeScaling, load_config,
                           read_json_object, to_dict)
from mx_jax.moe import group_score_experts

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF save_pretrained's default max_shard_size="5GB"
EXPORT_DTYPES = ("bfloat16", "float32", "float16")


class HFFormatError(ValueError):
    """An HF checkpoint does not match the expected layout; the message names the file, key and shapes."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
    hf: str  # HF key; "{i}" stands for the layer index of per-layer tensors
    path: tuple[str, ...]  # path in the mx_jax params dict (in the buffers dict, with buffer)
    transpose: bool  # nn.Linear (out, in) <-> (in, out)
    buffer: bool = False  # a buffer (moe.RouterBias), not a parameter: float32, outside the optimizer

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf


# In the order HF writes them (embedding, layers, final norm, head).
LAYOUT: tuple[_Tensor, ...] = (
    _Tensor("model.embed_tokens.weight", ("embed",), False),
    _Tensor("model.layers.{i}.input_layernorm.weight", ("blocks", "attn_norm", "scale"), False),
    _Tensor("model.layers.{i}.self_attn.q_proj.weight", ("blocks", "attn", "wq"), True),
    _Tensor("model.layers.{i}.self_attn.k_proj.weight", ("blocks", "attn", "wk"), True),
    _Tensor("model.layers.{i}.self_attn.v_proj.weight", ("blocks", "attn", "wv"), True),
    _Tensor("model.layers.{i}.self_attn.o_proj.weight", ("blocks", "attn", "wo"), True),
    _Tensor("model.layers.{i}.post_attention_layernorm.weight", ("blocks", "mlp_norm", "scale"), False),
    _Tensor("model.layers.{i}.mlp.gate_proj.weight", ("blocks", "mlp", "w_gate"), True),
    _Tensor("model.layers.{i}.mlp.up_proj.weight", ("blocks", "mlp", "w_up"), True),
    _Tensor("model.layers.{i}.mlp.down_proj.weight", ("blocks", "mlp", "w_down"), True),
    _Tensor("model.norm.weight", ("final_norm", "scale"), False),
    _Tensor("lm_head.weight", ("head",), True),
)
# Mixtral (MixtralForCausalLM): the dense MLP of every layer is a sparse MoE block. Its router `gate` is an
# nn.Linear (E, D); expert j's w1 / w3 / w2 are the gate / up / down projections, stacked in mx_jax on an expert axis
# after the layer axis. HF's routing is moe.py's softmax score, top-k, top-k weights renormalized to sum to 1.
MIXTRAL_MLP: tuple[_Tensor, ...] = (
    _Tensor("model.layers.{i}.block_sparse_moe.gate.weight", ("blocks", "moe", "router"), True),
    _Tensor("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", ("blocks", "moe", "w_gate"), True),
    _Tensor("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", ("blocks", "moe", "w_down"), True),
    _Tensor("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", ("blocks", "moe", "w_up"), True),
)


# DeepSeekMoE (DeepseekForCausalLM): a MoE layer's `mlp` holds the router `gate` (E, D), the routed experts and, with
# n_shared_experts, one MLP S x moe_intermediate_size wide for the shared experts.
DEEPSEEK_MLP: tuple[_Tensor, ...] = (
    _Tensor("model.layers.{i}.mlp.gate.weight", ("blocks", "moe", "router"), True),
    _Tensor("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", ("blocks", "moe", "w_gate"), True),
    _Tensor("model.layers.{i}.mlp.experts.{j}.up_proj.weight", ("blocks", "moe", "w_up"), True),
    _Tensor("model.layers.{i}.mlp.experts.{j}.down_proj.weight", ("blocks", "moe", "w_down"), True),
)
DEEPSEEK_SHARED: tuple[_Tensor, ...] = (
    _Tensor("model.layers.{i}.mlp.shared_experts.gate_proj.weight", ("blocks", "moe", "shared", "w_gate"), True),
    _Tensor("model.layers.{i}.mlp.shared_experts.up_proj.weight", ("blocks", "moe", "shared", "w_up"), True),
    _Tensor("model.layers.{i}.mlp.shared_experts.down_proj.weight", ("blocks", "moe", "shared", "w_down"), True),
)
# Qwen3 (Qwen3ForCausalLM, Qwen3MoeForCausalLM): each layer's per-head RMSNorm scales of q and k (model.qk_norm); its
# MoE layers are named as DeepSeekMoE's, without shared experts.
QK_NORMS: tuple[_Tensor, ...] = (
    _Tensor("model.layers.{i}.self_attn.q_norm.weight", ("blocks", "attn", "q_norm", "scale"), False),
    _Tensor("model.layers.{i}.self_attn.k_norm.weight", ("blocks", "attn", "k_norm", "scale"), False),
)
# Qwen2 (Qwen2ForCausalLM): Llama's layout with biases on the q, k and v projections (model.attention_bias).
QKV_BIASES: tuple[_Tensor, ...] = (
    _Tensor("model.layers.{i}.self_attn.q_proj.bias", ("blocks", "attn", "bq"), False),
    _Tensor("model.layers.{i}.self_attn.k_proj.bias", ("blocks", "attn", "bk"), False),
    _Tensor("model.layers.{i}.self_attn.v_proj.bias", ("blocks", "attn", "bv"), False),
)
# DeepSeek-V2 (DeepseekV2ForCausalLM): multi-head latent attention (model.mla) in place of q, k, v and o; its queries
# from x (q_lora_rank null) or from a latent of their own, its keys and values from one latent and one rotated key.
MLA_Q: tuple[_Tensor, ...] = (_Tensor("model.layers.{i}.self_attn.q_proj.weight", ("blocks", "attn", "wq"), True),)
MLA_Q_LATENT: tuple[_Tensor, ...] = (
    _Tensor("model.layers.{i}.self_attn.q_a_proj.weight", ("blocks", "attn", "wq_a"), True),
    _Tensor("model.layers.{i}.self_attn.q_a_layernorm.weight", ("blocks", "attn", "q_a_norm", "scale"), False),
    _Tensor("model.layers.{i}.self_attn.q_b_proj.weight", ("blocks", "attn", "wq_b"), True),
)
MLA_KV: tuple[_Tensor, ...] = (
    _Tensor("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight", ("blocks", "attn", "wkv_a"), True),
    _Tensor("model.layers.{i}.self_attn.kv_a_layernorm.weight", ("blocks", "attn", "kv_norm", "scale"), False),
    _Tensor("model.layers.{i}.self_attn.kv_b_proj.weight", ("blocks", "attn", "wkv_b"), True),
    _Tensor("model.layers.{i}.self_attn.o_proj.weight", ("blocks", "attn", "wo"), True),
)
# DeepSeek-V3 (DeepseekV3ForCausalLM): DeepSeek-V2's tensors and each MoE layer's router bias, a buffer
# (`buffer_shapes`), whose place in the buffers tree `path` gives.
ROUTER_BIAS = _Tensor("model.layers.{i}.mlp.gate.e_score_correction_bias", ("blocks", "moe", "bias"), False, True)
# DeepSeek-V3's multi-token prediction layers (model.mtp, llama.MTPLayer), stored as layers L, L + 1, ... after the
# decoder's: each holds its RMSNorms of the embedding and the hidden state, their projection W_eh (D, 2D), the norm
# before the head, and a decoder layer's tensors under the same names (a MoE layer in a MoE model). Each also stores
# copies of the embedding and of the head it shares (MTP_SHARED), which an import leaves unread and an export writes.
MTP_LAYER: tuple[_Tensor, ...] = (
    _Tensor("model.layers.{i}.enorm.weight", ("mtp", "enorm", "scale"), False),
    _Tensor("model.layers.{i}.hnorm.weight", ("mtp", "hnorm", "scale"), False),
    _Tensor("model.layers.{i}.eh_proj.weight", ("mtp", "eh_proj"), True),
    _Tensor("model.layers.{i}.shared_head.norm.weight", ("mtp", "norm", "scale"), False),
)
MTP_SHARED: tuple[_Tensor, ...] = (
    _Tensor("model.layers.{i}.embed_tokens.weight", ("embed",), False),
    _Tensor("model.layers.{i}.shared_head.head.weight", ("head",), True),
)
_DENSE_MLP = tuple(t for t in LAYOUT if t.path[:2] == ("blocks", "mlp"))
_BEFORE_MLP = tuple(t for t in LAYOUT if t.per_layer and t.path[:2] != ("blocks", "mlp"))


def model_type(cfg: ModelConfig) -> str:
    """The HF model_type that holds cfg, or a ConfigError naming the key where none does:
    - "llama": dense; "qwen3": dense with model.qk_norm; "qwen2": dense with model.attention_bias;
    - "mixtral": every layer MoE, no shared experts, softmax routing with the top-k weights renormalized, experts as
      wide as model.d_ff (and no qk_norm);
    - "deepseek" (DeepSeekMoE): softmax routing, every layer after the dense first ones MoE, head_dim = d_model /
      n_heads;
    - "qwen3_moe": with model.qk_norm, softmax routing, every layer after the dense first ones MoE, no shared
      experts;
    - "deepseek_v2": with model.mla; dense, or softmax routing without renormalization, every layer after the dense
      first ones MoE, group-limited routing only where a group's score is its best expert's (`_deepseek_v2_moe`);
    - "deepseek_v3": with model.mla, MoE with sigmoid routing (or router biases that train: bias_update_rate > 0),
      every layer after the dense first ones MoE, shared experts, group-limited routing only where a group's score
      sums its best two (`_deepseek_v3_kind`)."""
    m = cfg.moe
    if cfg.mla.kv_rank:
        if m.n_experts and (m.score == "sigmoid" or m.bias_update_rate > 0):
            return _deepseek_v3_kind(cfg)
        return _deepseek_v2_kind(cfg)
    # DeepSeek-V2's and V3's, which HF holds beside multi-head latent attention only
    for key, value, off in (("route_groups", m.route_groups, 0), ("routed_scale", m.routed_scale, 1.0)):
        if m.n_experts and value != off:
            raise ConfigError(f"config key 'model.moe.{key}': {value!r}; no HF model mapped here has it without "
                              f"model.mla (DeepSeek-V2 and V3 have it, beside their multi-head latent attention)")
    if cfg.attention_bias:  # Qwen2's; its MoE (Qwen2-MoE) gates its shared expert, which mx_jax does not
        for key, value in (("qk_norm", cfg.qk_norm), ("moe.n_experts", m.n_experts)):
            if value:
                raise ConfigError(f"config key 'model.{key}': {value!r}; with model.attention_bias HF interop covers "
                                  f"dense Qwen2 models ({key} off)")
        return "qwen2"
    if not m.n_experts:
        return "qwen3" if cfg.qk_norm else "llama"
    if not cfg.qk_norm and (m.n_shared, m.every_n_layers, m.n_dense_first, m.score, m.normalize_top_k,
                            m.d_expert or cfg.d_ff) == (0, 1, 0, "softmax", True, cfg.d_ff):
        return "mixtral"
    name, wants = ("Qwen3-MoE", (("moe.every_n_layers", m.every_n_layers, 1), ("moe.score", m.score, "softmax"),
                                 ("moe.n_shared", m.n_shared, 0))) if cfg.qk_norm else \
        ("DeepSeekMoE", (("moe.every_n_layers", m.every_n_layers, 1), ("moe.score", m.score, "softmax"),
                         ("head_dim", cfg.d_head, cfg.d_model // cfg.n_heads)))
    for key, value, want in wants:
        if value != want:
            raise ConfigError(f"config key 'model.{key}': {value!r}; HF interop covers dense Llama and Qwen3, and "
                              f"Mixtral-, DeepSeekMoE- and Qwen3-MoE-style models ({name} has {key}={want!r})")
    return "qwen3_moe" if cfg.qk_norm else "deepseek"


def _deepseek_v2_kind(cfg: ModelConfig) -> str:
    """"deepseek_v2" for a model with multi-head latent attention that transformers' DeepseekV2ForCausalLM holds, or
    a ConfigError naming the key it cannot: its router scores by softmax and never renormalizes the top-k weights
    (norm_topk_prob is read by the Hub's modeling_deepseek.py but not by transformers), its MoE layers are every
    layer after the first dense ones, and its groups score by their best expert."""
    m = cfg.moe
    wants = [("qk_norm", cfg.qk_norm, False), ("attention_bias", cfg.attention_bias, False),
             ("n_kv_heads", cfg.n_kv_heads, cfg.n_heads)]
    if m.n_experts:
        wants += [("moe.every_n_layers", m.every_n_layers, 1), ("moe.score", m.score, "softmax"),
                  ("moe.normalize_top_k", m.normalize_top_k, False)]
    for key, value, want in wants:
        if value != want:
            raise ConfigError(f"config key 'model.{key}': {value!r}; with model.mla HF interop covers DeepSeek-V2's "
                              f"architecture (DeepseekV2ForCausalLM has {key}={want!r})")
    best = m.route_groups and group_score_experts(m.top_k, m.n_experts, m.route_groups, m.route_top_groups,
                                                  m.route_group_top)
    if m.n_experts and m.route_groups and best != 1:
        raise ConfigError(f"config key 'model.moe.route_group_top': {m.route_group_top} scores a group by the sum of "
                          f"its best {best} experts; DeepSeek-V2's group_limited_greedy scores it by its best one "
                          f"(model.moe.route_group_top=1)")
    return "deepseek_v2"


def _deepseek_v3_kind(cfg: ModelConfig) -> str:
    """"deepseek_v3" for a MoE model with multi-head latent attention that transformers' DeepseekV3ForCausalLM holds,
    or a ConfigError naming the key it cannot: its router scores by sigmoid with a bias per expert for the choice,
    its MoE layers are every layer after the first dense ones and have shared experts, and a group scores by the sum
    of its best two experts' biased scores (a group of one expert cannot)."""
    m = cfg.moe
    wants = [("qk_norm", cfg.qk_norm, False), ("attention_bias", cfg.attention_bias, False),
             ("n_kv_heads", cfg.n_kv_heads, cfg.n_heads), ("moe.every_n_layers", m.every_n_layers, 1),
             ("moe.score", m.score, "sigmoid")]
    for key, value, want in wants:
        if value != want:
            raise ConfigError(f"config key 'model.{key}': {value!r}; with model.mla and trained router biases HF "
                              f"interop covers DeepSeek-V3's architecture (DeepseekV3ForCausalLM has {key}={want!r})")
    if m.n_shared < 1:
        raise ConfigError("config key 'model.moe.n_shared': 0; DeepseekV3ForCausalLM always runs shared experts "
                          "(n_shared_experts >= 1)")
    best = group_score_experts(m.top_k, m.n_experts, m.route_groups, m.route_top_groups, m.route_group_top) \
        if m.route_groups else 2
    if best != 2:
        raise ConfigError(f"config key 'model.moe.route_group_top': {m.route_group_top} scores a group by the sum of "
                          f"its best {best} expert(s); DeepSeek-V3's noaux_tc sums its best 2 "
                          f"(model.moe.route_group_top=2, with at least 2 experts in a group)")
    return "deepseek_v3"


def _n_dense_first(cfg: ModelConfig) -> int:
    return cfg.moe.n_dense_first if cfg.moe.n_experts else 0


def _layer_layout(cfg: ModelConfig, i: int, kind: str) -> tuple[str, int, tuple[_Tensor, ...]]:
    """(stack, index in it, tensors) of HF layer i, named as `kind` names them: the first model.moe.n_dense_first
    layers are the `dense_blocks` stack of dense MLPs, the rest the `blocks` stack; from layer L on, the `mtp`
    stack's layers (DeepSeek-V3's MTP_LAYER and a block laid out as a MoE layer's)."""
    if i >= cfg.n_layers:
        _, _, block = _layer_layout(cfg, cfg.n_layers - 1 if cfg.moe.n_experts else 0, kind)
        block = tuple(dataclasses.replace(t, path=("mtp", "block", *t.path[1:])) for t in block)
        return "mtp", i - cfg.n_layers, MTP_LAYER + block
    n_first = _n_dense_first(cfg)
    if cfg.mla.kv_rank:
        attn_norm, *_, mlp_norm = _BEFORE_MLP
        before = (attn_norm, *(MLA_Q_LATENT if cfg.mla.q_rank else MLA_Q), *MLA_KV, mlp_norm)
    else:
        before = _BEFORE_MLP + (QK_NORMS if cfg.qk_norm else ()) + (QKV_BIASES if cfg.attention_bias else ())
    if i < n_first:
        dense = tuple(dataclasses.replace(t, path=("dense_blocks", *t.path[1:])) for t in (*before, *_DENSE_MLP))
        return "dense_blocks", i, dense
    if not cfg.moe.n_experts:
        mlp = _DENSE_MLP
    elif kind == "mixtral":
        mlp = MIXTRAL_MLP
    else:
        router, *experts = DEEPSEEK_MLP
        mlp = (router, *((ROUTER_BIAS,) if kind == "deepseek_v3" else ()), *experts,
               *(DEEPSEEK_SHARED if cfg.moe.n_shared else ()))
    return "blocks", i - n_first, before + mlp


def _fusions(hf_model_type: str | None, cfg: ModelConfig) -> list[tuple[str, list[tuple[str, int]]]]:
    """The tensors `hf_model_type` stores fused: [(stored key, [(the Llama key of each part, its rows), ...])], the
    parts in row order. Phi-3 keeps each layer's q, k and v projections as one `qkv_proj` (H K + 2 G K, D) and its
    gate and up projections as one `gate_up_proj` (2 F, D), gate first (Phi3MLP's `chunk(2)`); every other tensor
    is Llama's. Imports read each part as a row range of the stored tensor, exports concatenate them."""
    if hf_model_type != "phi3":
        return []
    hk, gk, out = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head, []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out.append((p + "self_attn.qkv_proj.weight", [(p + "self_attn.q_proj.weight", hk),
                                                        (p + "self_attn.k_proj.weight", gk),
                                                        (p + "self_attn.v_proj.weight", gk)]))
        out.append((p + "mlp.gate_up_proj.weight", [(p + "mlp.gate_proj.weight", cfg.d_ff),
                                                     (p + "mlp.up_proj.weight", cfg.d_ff)]))
    return out


def _rope_rows(hf: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """{HF key: the row of it that each mx_jax column reads} of the tensors whose rows the model of config.json `hf`
    orders otherwise. DeepSeek-V2 rotates interleaved pairs (x_2i, x_2i+1) (transformers' `apply_rotary_emb`, a
    complex product), and so does DeepSeek-V3 with rope_interleave (`apply_rotary_pos_emb_interleave`), mx_jax the
    halves (x_i, x_i+r/2) (`layers.apply_rope`): in the rotated rows of each head of q_proj (q_b_proj) and of
    kv_a_proj_with_mqa, mx_jax's order is HF's rows 0, 2, ..., r-2, 1, 3, ..., r-1. The other rows keep their place,
    as q . k is a sum over pairs that both sides permute alike."""
    kind = _family(hf.get("model_type"))
    # (transformers tests rope_interleave for truth: null rotates halves)
    interleaved = kind == "deepseek_v2" or (kind == "deepseek_v3" and bool(hf.get("rope_interleave", True)))
    if not interleaved or not cfg.mla.kv_rank:
        return {}
    a, h = cfg.mla, cfg.n_heads
    rope = np.concatenate([np.arange(0, a.rope_dim, 2), np.arange(1, a.rope_dim, 2)])
    k = a.nope_dim + a.rope_dim
    q = np.concatenate([np.concatenate([np.arange(j * k, j * k + a.nope_dim), j * k + a.nope_dim + rope])
                        for j in range(h)])
    kv = np.concatenate([np.arange(a.kv_rank), a.kv_rank + rope])
    q_name = "q_b_proj" if a.q_rank else "q_proj"
    out = {}
    for i in range(cfg.n_layers):
        out[f"model.layers.{i}.self_attn.{q_name}.weight"] = q
        out[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] = kv
    return out


def _part_rows(fusions: list[tuple[str, list[tuple[str, int]]]]) -> dict[str, tuple[str, int, int, int]]:
    """{part key: (stored key, first row, end row, the stored tensor's rows)} of `_fusions`."""
    out = {}
    for stored, parts in fusions:
        total, start = sum(n for _, n in parts), 0
        for key, n in parts:
            out[key] = (stored, start, start + n, total)
            start += n
    return out


# Buffers some older HF checkpoints saved; recomputed from the config, so they are skipped.
_IGNORED_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _safetensors():
    try:
        import safetensors
        import safetensors.numpy  # noqa: F401
    except ImportError as e:
        raise ImportError("mx_jax.hf needs the `safetensors` package: pip install 'mx_jax[hf]'") from e
    return safetensors


# ---------------------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig

# ModelConfig fields that set parameter shapes: a given cfg must agree with config.json on these.
_SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff", "qk_norm",
                 "attention_bias", "mla")
_NUMERIC_FIELDS = ("rope_theta", "rope_scaling", "norm_eps")
# The ModelConfig keys config.json determines (what `import` writes into OUT/config.yaml).
_ARCH_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "qk_norm",
              "attention_bias", "mla", *_NUMERIC_FIELDS)


# Where a config class of transformers (5.24) defaults a key otherwise than LlamaConfig, which `config_from_hf` falls
# back to (rms_norm_eps 1e-6, rope_theta 10000, as many key/value heads as heads, head_dim = hidden / heads): a
# config.json without the key means the class's default (tests/test_hf.py checks them against transformers).
HF_CLASS_DEFAULTS = {
    "mistral": {"num_key_value_heads": 8},
    "mixtral": {"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "phi3": {"rms_norm_eps": 1e-5},
    "qwen3": {"head_dim": 128},
    "qwen3_moe": {"num_key_value_heads": 4},
    # (q_lora_rank 1536, n_routed_experts 64 and n_shared_experts 2 are its defaults too, where the key is absent: a
    # null there means none, as the Hub's modeling_deepseek.py reads it; `config_from_hf`)
    "deepseek_v2": {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "moe_intermediate_size": 1407, "intermediate_size": 11008},
    # (q_lora_rank 1536, n_routed_experts 256 and n_shared_experts 1 too, null meaning none as for deepseek_v2;
    # rope_interleave true, num_nextn_predict_layers 1: `_rope_rows`, `_plan`)
    "deepseek_v3": {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "moe_intermediate_size": 2048, "intermediate_size": 18432, "num_experts_per_tok": 8,
                    "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5},
}


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """An HF LlamaConfig dict (config.json) -> ModelConfig; architecture fields only, the rest at their defaults (a
    key config.json lacks: its config class's default, HF_CLASS_DEFAULTS). Kimi K2's `kimi_k2` is read as
    deepseek_v3, the architecture its config.json names (DeepseekV3ForCausalLM)."""
    if hf.get("model_type") in _ALIASES:
        hf = {**hf, "model_type": _ALIASES[hf["model_type"]]}
    hf = {**hf, **{k: v for k, v in HF_CLASS_DEFAULTS.get(hf.get("model_type"), {}).items() if hf.get(k) is None}}

    def get(key: str, default: Any = None) -> Any:
        if hf.get(key) is None and default is None:
            raise HFFormatError(f"{source}: missing key '{key}'")
        return default if hf.get(key) is None else hf[key]

    archs = hf.get("architectures") or []
    if "model_type" not in hf and any(a != "LlamaForCausalLM" for a in archs):
        raise HFFormatError(f"{source}: no model_type, and architectures is {archs}; only LlamaForCausalLM, "
                            f"MistralForCausalLM, Phi3ForCausalLM, MixtralForCausalLM, DeepseekForCausalLM, "
                            f"DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and "
                            f"Qwen3MoeForCausalLM map to mx_jax")
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "mistral", "phi3", "mixtral", "deepseek", "deepseek_v2", "deepseek_v3", "qwen2",
                          "qwen3", "qwen3_moe"):
        raise HFFormatError(f"{source}: model_type is {model_type!r}; only 'llama' (LlamaForCausalLM), 'mistral' "
                            f"(MistralForCausalLM), 'phi3' (Phi3ForCausalLM), 'mixtral' (MixtralForCausalLM), "
                            f"'deepseek' (DeepseekForCausalLM, DeepSeekMoE), 'deepseek_v2' (DeepseekV2ForCausalLM), "
                            f"'deepseek_v3' and 'kimi_k2' (DeepseekV3ForCausalLM), 'qwen2' (Qwen2ForCausalLM), "
                            f"'qwen3' (Qwen3ForCausalLM) and 'qwen3_moe' (Qwen3MoeForCausalLM) map to mx_jax")
    if model_type in ("mistral", "phi3"):
        # A window no shorter than the model's context never applies; where config.json has no such keys, the
        # classes' defaults: MistralConfig 4096 and 131072, Phi3Config none and 4096.
        window = hf.get("sliding_window", 4096 if model_type == "mistral" else None)
        context = hf.get("max_position_embeddings") or (131072 if model_type == "mistral" else 4096)
        if window is not None and window < int(context):
            raise HFFormatError(f"{source}: sliding_window={window}"
                                f"{'' if 'sliding_window' in hf else ' (no key: MistralConfig defaults to it)'} is not "
                                f"supported below max_position_embeddings={context} (mx_jax attends to the whole "
                                f"causal context)")
    moe, mla = MoEConfig(), MLAConfig()
    d_model, n_heads = int(get("hidden_size")), int(get("num_attention_heads"))
    head_dim = int(get("head_dim", d_model // n_heads))
    n_kv_heads = int(get("num_key_value_heads", n_heads))
    if model_type == "deepseek":
        head_dim = d_model // n_heads  # DeepSeek's attention has no head_dim key of its own
        moe = _deepseek_moe(hf, source, int(get("num_hidden_layers")))
    if model_type in ("deepseek_v2", "deepseek_v3"):
        # its head_dim key is the rotated width (DeepseekV2Config and V3Config set it so); each head has its own key
        # and value
        name = "DeepSeek-V2" if model_type == "deepseek_v2" else "DeepSeek-V3"
        if n_kv_heads != n_heads:
            raise HFFormatError(f"{source}: num_key_value_heads={n_kv_heads} is not supported ({name}'s latent "
                                f"attention makes a key and a value for each of the {n_heads} heads)")
        q_rank = hf.get("q_lora_rank", 1536)  # the config class's default where absent; null: queries from x
        mla = MLAConfig(kv_rank=int(get("kv_lora_rank")), q_rank=int(q_rank or 0),
                        nope_dim=int(get("qk_nope_head_dim")), rope_dim=int(get("qk_rope_head_dim")),
                        v_dim=int(get("v_head_dim")))
        if mla.kv_rank <= 0 or mla.q_rank < 0:
            raise HFFormatError(f"{source}: kv_lora_rank={mla.kv_rank}, q_lora_rank={q_rank}: {name}'s latent "
                                f"attention needs kv_lora_rank > 0 and q_lora_rank null or > 0")
        head_dim = d_model // n_heads
        n_layers = int(get("num_hidden_layers"))
        moe = _deepseek_v2_moe(hf, source, n_layers) if model_type == "deepseek_v2" else \
            _deepseek_v3_moe(hf, source, n_layers)
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if hf.get("use_sliding_window"):
            raise HFFormatError(f"{source}: use_sliding_window=true is not supported (mx_jax attends to the whole "
                                f"causal context)")
        if any(t != "full_attention" for t in hf.get("layer_types") or ()):
            raise HFFormatError(f"{source}: layer_types {sorted(set(hf['layer_types']))}: only full_attention layers "
                                f"are supported")
    if model_type == "qwen3_moe":
        moe = _qwen3_moe(hf, source, int(get("num_hidden_layers")))
    if model_type == "mixtral":
        if hf.get("sliding_window") is not None:
            raise HFFormatError(f"{source}: sliding_window={hf['sliding_window']} is not supported (mx_jax attends "
                                f"to the whole causal context)")
        if hf.get("router_jitter_noise", 0.0):
            raise HFFormatError(f"{source}: router_jitter_noise={hf['router_jitter_noise']} is not supported")
        top_k = int(get("num_experts_per_tok"))
        # HF's balancing loss is top_k at balance, ours 1 (moe.py): the same pull takes coefficient x top_k
        moe = MoEConfig(n_experts=int(get("num_local_experts")), top_k=top_k,
                        aux_loss_coef=float(get("router_aux_loss_coef", 0.001)) * top_k)
    for key, want in (("hidden_act", "silu"), ("attention_bias", model_type == "qwen2"), ("mlp_bias", False)):
        if key in hf and hf[key] != want:
            raise HFFormatError(f"{source}: {key}={hf[key]!r} is not supported (mx_jax's Llama has {key}={want!r})")
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})  # transformers 4.x name, then 5.x name
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFFormatError(f"{source}: partial_rotary_factor != 1 is not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        try:
            scaling = RopeScaling(
                factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_len=int(rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]))
        except KeyError as e:
            raise HFFormatError(f"{source}: rope_scaling of type llama3 lacks {e}") from None
    elif rope_type == "yarn":
        scaling = _yarn(rope, hf, source)
    elif rope_type == "default":
        scaling = RopeScaling()
    else:
        raise HFFormatError(f"{source}: rope_scaling type {rope_type!r} is not supported (only 'llama3', 'yarn' and "
                            f"none)")
    if model_type in ("deepseek_v2", "deepseek_v3") and rope.get("mscale_all_dim"):
        # transformers' yarn_apply_mscale: the softmax scale times m^2, m from mscale_all_dim and the factor
        if rope_type != "yarn":
            raise HFFormatError(f"{source}: rope_scaling's mscale_all_dim with type {rope_type!r} is not supported "
                                f"(only with 'yarn')")
        scaling = dataclasses.replace(scaling, mscale_all_dim=float(rope["mscale_all_dim"]))
    return ModelConfig(
        vocab_size=int(get("vocab_size")),
        d_model=d_model,
        n_layers=int(get("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=0 if head_dim * n_heads == d_model else head_dim,
        d_ff=int(get("intermediate_size")),
        rope_theta=float(rope.get("rope_theta") or get("rope_theta", 10000.0)),  # HF LlamaConfig's default
        rope_scaling=scaling,
        norm_eps=float(get("rms_norm_eps", 1e-6)),  # HF LlamaConfig's default
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        attention_bias=model_type == "qwen2",  # Qwen2's q, k and v projections always have biases
        mla=mla,
        moe=moe,
        # DeepSeek-V3's multi-token prediction layers (transformers' default 1 where the key is absent); `_plan`
        # reads none where config.json announces them but the safetensors lack them
        mtp=MTPConfig(depth=int(hf.get("num_nextn_predict_layers", 1) or 0)) if model_type == "deepseek_v3" else
        MTPConfig(),
    )


def _yarn(rope: dict, hf: dict, source: str) -> RopeScaling:
    """YaRN's rope_scaling as transformers reads it (`_compute_yarn_parameters`): the original context defaults to
    max_position_embeddings and the factor to their ratio; the attention factor, when not given, is YaRN's
    0.1 ln(factor) + 1, or DeepSeek's ratio of that form with mscale and mscale_all_dim."""
    if rope.get("truncate", True) is not True:
        raise HFFormatError(f"{source}: rope_scaling of type yarn with truncate={rope['truncate']!r} is not supported")
    try:
        original = int(rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                       or hf["max_position_embeddings"])
        factor = float(rope.get("factor") or hf["max_position_embeddings"] / original)
    except KeyError as e:
        raise HFFormatError(f"{source}: rope_scaling of type yarn lacks {e}") from None

    def get_mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = rope.get("attention_factor")
    if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):
        attention = get_mscale(float(rope["mscale"])) / get_mscale(float(rope["mscale_all_dim"]))
    return RopeScaling(kind="yarn", factor=factor, original_max_len=original,
                       beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                       attention_factor=float(attention or 0.0))


def _deepseek_moe(hf: dict, source: str, n_layers: int) -> MoEConfig:
    """The MoE of a DeepseekConfig (config.json of model_type deepseek); MoEConfig() where every layer is dense."""
    first = int(hf.get("first_k_dense_replace") or 0)
    if hf.get("n_routed_experts") is None or first >= n_layers:
        return MoEConfig()
    for key, want in (("moe_layer_freq", 1), ("scoring_func", "softmax"), ("topk_method", "greedy")):
        if hf.get(key, want) != want:
            raise HFFormatError(f"{source}: {key}={hf[key]!r} is not supported (mx_jax maps DeepSeekMoE with "
                                f"{key}={want!r})")
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if hf.get(key) is None:
            raise HFFormatError(f"{source}: missing key '{key}'")
    return MoEConfig(n_experts=int(hf["n_routed_experts"]), top_k=int(hf["num_experts_per_tok"]),
                     d_expert=int(hf["moe_intermediate_size"]), n_shared=int(hf.get("n_shared_experts") or 0),
                     n_dense_first=first, score="softmax", normalize_top_k=bool(hf.get("norm_topk_prob", False)),
                     aux_loss_coef=float(hf.get("aux_loss_alpha", 0.001)),  # alpha x 1 at balance in both
                     aux_loss_scope="sequence" if hf.get("seq_aux", True) else "batch")


def _deepseek_v2_moe(hf: dict, source: str, n_layers: int) -> MoEConfig:
    """The MoE of a DeepseekV2Config as transformers runs it (DeepseekV2Moe, DeepseekV2TopkRouter): softmax scores,
    the top-k weights times routed_scaling_factor and never renormalized (transformers does not read norm_topk_prob,
    which the Hub's modeling_deepseek.py applies in place of the scaling; false in DeepSeek-V2 and V2-Lite), the
    shared experts added unweighted. group_limited_greedy keeps the topk_group groups (of n_group) whose best expert
    scores highest: moe.py's route_groups with route_group_top = 1. n_routed_experts null (the Hub's dense models)
    or first_k_dense_replace >= the layers: dense."""
    first = int(hf.get("first_k_dense_replace") or 0)
    n_experts = hf.get("n_routed_experts", 64)  # DeepseekV2Config's default where absent
    if n_experts is None or first >= n_layers:
        return MoEConfig()
    n_experts = int(n_experts)
    for key, want in (("moe_layer_freq", 1), ("scoring_func", "softmax")):
        if hf.get(key, want) != want:
            raise HFFormatError(f"{source}: {key}={hf[key]!r} is not supported (mx_jax maps DeepSeek-V2 with "
                                f"{key}={want!r})")
    if hf.get("num_experts_per_tok") is None:
        raise HFFormatError(f"{source}: missing key 'num_experts_per_tok'")
    top_k = int(hf["num_experts_per_tok"])
    method = hf.get("topk_method") or "greedy"
    groups = top_groups = 0
    if method == "group_limited_greedy":
        try:
            groups, top_groups = int(hf["n_group"]), int(hf["topk_group"])
        except (KeyError, TypeError):
            raise HFFormatError(f"{source}: topk_method='group_limited_greedy' needs n_group and topk_group (got "
                                f"{hf.get('n_group')!r} and {hf.get('topk_group')!r})") from None
        groups, top_groups = _route_groups(source, "topk_method='group_limited_greedy' with ", n_experts, top_k,
                                           groups, top_groups, 1)
    elif method != "greedy":
        raise HFFormatError(f"{source}: topk_method={method!r} is not supported (only 'greedy' and "
                            f"'group_limited_greedy')")
    if hf.get("norm_topk_prob"):
        warnings.warn(f"{source}: norm_topk_prob=true, which transformers' DeepseekV2 does not read (the Hub's "
                      f"modeling_deepseek.py renormalizes the top-k weights instead of scaling them by "
                      f"routed_scaling_factor); imported as transformers runs it, not renormalized", stacklevel=3)
    shared = hf.get("n_shared_experts", 2)  # DeepseekV2Config's default where absent; null: none (the Hub's code)
    return MoEConfig(n_experts=n_experts, top_k=top_k, d_expert=int(hf["moe_intermediate_size"]),
                     n_shared=int(shared or 0), n_dense_first=first, score="softmax", normalize_top_k=False,
                     route_groups=groups, route_top_groups=top_groups, route_group_top=1 if groups else 0,
                     routed_scale=float(hf.get("routed_scaling_factor") or 1.0),
                     aux_loss_coef=float(hf.get("aux_loss_alpha", 0.001)),  # alpha x 1 at balance in both
                     aux_loss_scope="sequence" if hf.get("seq_aux", True) else "batch")


def _route_groups(source: str, what: str, n_experts: int, top_k: int, groups: int, top_groups: int,
                  best: int) -> tuple[int, int]:
    """(route_groups, route_top_groups) of DeepSeek's n_group and topk_group, each group scored by its `best` best
    experts; (0, 0) where every group is kept (greedy). An HFFormatError, after `what`, for groups that cannot be."""
    if not (groups > 0 and n_experts % groups == 0 and n_experts // groups >= best and 0 < top_groups <= groups
            and top_k <= top_groups * (n_experts // groups)):
        into = f" into groups of at least {best}, whose best {best} score the group," if best > 1 else ","
        raise HFFormatError(f"{source}: {what}n_group={groups}, topk_group={top_groups} is not supported for "
                            f"{n_experts} experts, top-{top_k} (n_group must divide them{into} and topk_group groups "
                            f"hold the top_k)")
    return (0, 0) if top_groups == groups else (groups, top_groups)


def _deepseek_v3_moe(hf: dict, source: str, n_layers: int) -> MoEConfig:
    """The MoE of a DeepseekV3Config as transformers runs it (DeepseekV3MoE, DeepseekV3TopkRouter; module docstring):
    sigmoid scores, each expert's e_score_correction_bias added for the choice only, noaux_tc's groups scored by the
    sum of their best two biased scores (route_group_top = 2), the top-k weights renormalized when norm_topk_prob,
    times routed_scaling_factor, the shared experts added unweighted. Keys transformers ignores but the Hub's code
    reads (scoring_func, topk_method, moe_layer_freq) must say what transformers does. n_group 1, or topk_group =
    n_group, keeps every group: greedy. n_routed_experts null (the Hub's code: dense) or first_k_dense_replace >=
    the layers: dense."""
    first = int(hf["first_k_dense_replace"])
    n_experts = hf.get("n_routed_experts", 256)  # DeepseekV3Config's default where absent
    if n_experts is None or first >= n_layers:
        return MoEConfig()
    n_experts = int(n_experts)
    for key, want in (("moe_layer_freq", 1), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, want) != want:
            raise HFFormatError(f"{source}: {key}={hf[key]!r} is not supported (transformers' DeepseekV3 runs "
                                f"{key}={want!r} whatever the key says, and so does mx_jax)")
    top_k, groups, top_groups = int(hf["num_experts_per_tok"]), int(hf["n_group"]), int(hf["topk_group"])
    groups, top_groups = _route_groups(source, "", n_experts, top_k, groups, top_groups, 2)
    shared = hf.get("n_shared_experts", 1)  # DeepseekV3Config's default where absent; null: none (the Hub's code)
    return MoEConfig(n_experts=n_experts, top_k=top_k, d_expert=int(hf["moe_intermediate_size"]),
                     n_shared=int(shared or 0), n_dense_first=first, score="sigmoid",
                     normalize_top_k=bool(hf["norm_topk_prob"]), route_groups=groups, route_top_groups=top_groups,
                     route_group_top=2 if groups else 0, routed_scale=float(hf["routed_scaling_factor"]),
                     aux_loss_coef=float(hf.get("aux_loss_alpha", 0.001)),  # as DeepSeek-V2's
                     aux_loss_scope="sequence" if hf.get("seq_aux", True) else "batch")


def _qwen3_moe(hf: dict, source: str, n_layers: int) -> MoEConfig:
    """The MoE of a Qwen3MoeConfig: its `mlp_only_layers` must be the first layers (model.moe.n_dense_first), and
    `decoder_sparse_step` 1. HF's balancing loss is top_k at balance, ours 1 (moe.py): coefficient x top_k."""
    dense = sorted(int(i) for i in hf.get("mlp_only_layers") or ())
    if dense != list(range(len(dense))):
        raise HFFormatError(f"{source}: mlp_only_layers={dense} is not supported (only the first layers may be dense)")
    if hf.get("decoder_sparse_step", 1) != 1:
        raise HFFormatError(f"{source}: decoder_sparse_step={hf['decoder_sparse_step']} is not supported (mx_jax maps "
                            f"Qwen3-MoE with every layer after the dense ones MoE)")
    n_experts = hf.get("num_experts") or hf.get("num_local_experts")  # the Hub's name; transformers 5 writes the other
    if hf.get("num_experts") and hf.get("num_local_experts") and hf["num_experts"] != hf["num_local_experts"]:
        raise HFFormatError(f"{source}: num_experts={hf['num_experts']} and num_local_experts="
                            f"{hf['num_local_experts']} disagree")
    if not n_experts or len(dense) >= n_layers:
        return MoEConfig()
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if hf.get(key) is None:
            raise HFFormatError(f"{source}: missing key '{key}'")
    top_k = int(hf["num_experts_per_tok"])
    return MoEConfig(n_experts=int(n_experts), top_k=top_k, d_expert=int(hf["moe_intermediate_size"]),
                     n_dense_first=len(dense), score="softmax", normalize_top_k=bool(hf.get("norm_topk_prob", False)),
                     aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)) * top_k)


# config.json keys that describe an architecture's shape or routing, which config_to_hf writes for the model_type it
# chooses and never keeps from a base.
_ARCH_HF_KEYS = frozenset((
    "rope_parameters", "rope_scaling", "layer_types", "head_dim", "num_local_experts", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
    "moe_layer_freq", "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "scoring_func", "topk_method",
    "router_aux_loss_coef", "aux_loss_alpha", "sliding_window", "use_sliding_window", "max_window_layers",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
    "routed_scaling_factor", "n_group", "topk_group", "rope_interleave", "num_nextn_predict_layers",
    # the exported weights are 16- or 32-bit: an imported fp8 checkpoint's quantization_config would misdescribe them
    "quantization_config"))
# The keys of a base config.json kept whatever its architecture.
_GENERIC_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "initializer_range",
                 "transformers_version")
# model_types that are another's architecture, in every config key mx_jax maps: Mistral (v0.2 on, without a sliding
# window) and Phi-3 (its q, k, v and gate, up projections stored fused: `_fusions`) are Llama's, Kimi K2's is
# DeepSeek-V3's. {model_type: (the model_type it maps as, its architecture)}.
_SAME_AS = {"mistral": ("llama", "MistralForCausalLM"), "phi3": ("llama", "Phi3ForCausalLM"),
            "kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM")}
# Those whose config.json config_from_hf reads as the other's: all its keys are the other's (Mistral's and Phi-3's
# have checks and class defaults of their own).
_ALIASES = {"kimi_k2": "deepseek_v3"}


def _family(hf_model_type: str | None) -> str:
    """The model_type (`model_type(cfg)`'s names) whose mapping a config.json of `hf_model_type` takes."""
    t = hf_model_type or "llama"
    return _SAME_AS[t][0] if t in _SAME_AS else t


def _rope_scaling_to_hf(sc: RopeScaling) -> dict | None:
    if sc.factor <= 1.0:
        return None
    if sc.kind == "yarn":
        return {"rope_type": "yarn", "factor": sc.factor, "original_max_position_embeddings": sc.original_max_len,
                "beta_fast": sc.beta_fast, "beta_slow": sc.beta_slow,
                **({"attention_factor": sc.attention_factor} if sc.attention_factor else {}),
                **({"mscale_all_dim": sc.mscale_all_dim} if sc.mscale_all_dim else {})}  # DeepSeek-V2's
    return {"rope_type": "llama3", "factor": sc.factor, "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor, "original_max_position_embeddings": sc.original_max_len}


def config_to_hf(cfg: ModelConfig, dtype: str, base: dict | None = None) -> dict:
    """ModelConfig -> config.json of the architecture `model_type` names. `base` (an imported config.json) keeps its
    other keys (token ids, max_position_embeddings, ...), or only _GENERIC_KEYS where it describes another
    model_type; the architecture keys are overwritten."""
    kind = model_type(cfg)
    if cfg.moe.bias_update_rate > 0 and kind != "deepseek_v3":
        raise ConfigError("config key 'model.moe.bias_update_rate': the router biases it trains change which experts "
                          "are chosen, and no HF MoE mapped here has a place for them but DeepSeek-V3's (model.mla, "
                          "model.moe.score=sigmoid)")
    sc = cfg.rope_scaling
    scaled = sc.factor > 1.0
    if kind == "deepseek" and scaled:
        raise ConfigError("config key 'model.rope_scaling': DeepSeekMoE's code scales RoPE linearly or by dynamic NTK, "
                          "not as Llama 3.1 or YaRN do")
    if base and _family(base.get("model_type")) != kind:  # another architecture's keys would not describe this one
        base = {k: v for k, v in base.items() if k in _GENERIC_KEYS}
    # The base's architecture keys go, whether or not this model_type writes them again: a base of another shape
    # (--hf-config) must not leave transformers 5's num_local_experts beside num_experts, or its layer_types.
    # (rope_parameters is transformers 5's name; rope_scaling below is read by 4.x and 5.x alike.)
    out = {k: v for k, v in (base or {}).items() if k not in _ARCH_HF_KEYS}
    out.update({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.d_head,
        "intermediate_size": cfg.d_ff,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling_to_hf(sc),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    })
    out.setdefault("max_position_embeddings", int(sc.original_max_len * (sc.factor if scaled else 1)))
    if cfg.eos_id >= 0:  # the token the training data ended documents with (model.attention_mask=documents)
        out.setdefault("eos_token_id", cfg.eos_id)
    if "dtype" in out:  # transformers 5 writes `dtype` instead of `torch_dtype`
        out["dtype"] = dtype
    m = cfg.moe
    same = base.get("model_type") if base and _SAME_AS.get(base.get("model_type"), ("",))[0] == kind else None
    if same == "phi3" and scaled:  # the same model under Llama's names: Phi3Config takes only LongRoPE scaling
        warnings.warn(f"model.rope_scaling is {'YaRN' if sc.kind == 'yarn' else 'Llama 3.1'}'s, which Phi3Config does "
                      f"not take: the export is written as LlamaForCausalLM (q, k, v and gate, up unfused)",
                      stacklevel=2)
        same = None
    if same and kind == "llama":  # MistralConfig's or Phi3Config's keys
        for key in ("attention_bias", "mlp_bias"):
            out.pop(key)
        out.update({"architectures": [_SAME_AS[same][1]], "model_type": same, "sliding_window": None})
    elif kind == "mixtral":
        out.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                    "num_local_experts": m.n_experts, "num_experts_per_tok": m.top_k,
                    "router_aux_loss_coef": m.aux_loss_coef / m.top_k, "output_router_logits": False,
                    "router_jitter_noise": 0.0, "sliding_window": None})
    elif kind == "deepseek":  # DeepseekConfig's keys; it derives head_dim from hidden_size / heads
        for key in ("head_dim", "mlp_bias"):
            out.pop(key)
        out.update({"architectures": ["DeepseekForCausalLM"], "model_type": "deepseek",
                    "n_routed_experts": m.n_experts, "num_experts_per_tok": m.top_k,
                    "moe_intermediate_size": m.d_expert or cfg.d_ff, "n_shared_experts": m.n_shared or None,
                    "first_k_dense_replace": m.n_dense_first, "moe_layer_freq": 1, "scoring_func": "softmax",
                    "norm_topk_prob": m.normalize_top_k, "aux_loss_alpha": m.aux_loss_coef, "pretraining_tp": 1})
        out["seq_aux"] = m.aux_loss_scope == "sequence"
    elif kind in ("deepseek_v2", "deepseek_v3"):  # DeepseekV2Config's and V3Config's keys; their head_dim is the
        a = cfg.mla  # rotated width, which they set themselves
        out.pop("head_dim")
        out.update({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                    "kv_lora_rank": a.kv_rank, "q_lora_rank": a.q_rank or None, "qk_nope_head_dim": a.nope_dim,
                    "qk_rope_head_dim": a.rope_dim, "v_head_dim": a.v_dim,
                    "first_k_dense_replace": m.n_dense_first if m.n_experts else cfg.n_layers})
        if m.n_experts:  # (a dense model: every layer before first_k_dense_replace, the MoE keys at their defaults)
            out.update({"n_routed_experts": m.n_experts, "num_experts_per_tok": m.top_k,
                        "moe_intermediate_size": m.d_expert or cfg.d_ff, "n_shared_experts": m.n_shared,
                        "moe_layer_freq": 1, "routed_scaling_factor": m.routed_scale,
                        "aux_loss_alpha": m.aux_loss_coef})
            out["seq_aux"] = m.aux_loss_scope == "sequence"
        if kind == "deepseek_v2" and m.n_experts:
            out.update({"scoring_func": "softmax", "norm_topk_prob": False,
                        "topk_method": "group_limited_greedy" if m.route_groups else "greedy"})
            if m.route_groups:
                out.update({"n_group": m.route_groups, "topk_group": m.route_top_groups})
        if kind == "deepseek_v3":  # rotated rows interleaved (`_rope_rows`), model.mtp's layers after the L
            out.update({"architectures": ["DeepseekV3ForCausalLM"], "model_type": same or "deepseek_v3",
                        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": m.route_groups or 1,
                        "topk_group": m.route_top_groups or 1, "norm_topk_prob": m.normalize_top_k,
                        "rope_interleave": True, "num_nextn_predict_layers": cfg.mtp.depth})
    elif kind in ("qwen2", "qwen3", "qwen3_moe"):
        out.pop("mlp_bias")
        out.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
                    "sliding_window": None, "max_window_layers": cfg.n_layers})
        if kind == "qwen2":  # its q, k and v biases are not a config key
            out.pop("attention_bias")
            out.update({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
        if kind == "qwen3_moe":  # HF's balancing loss is top_k at balance, as Mixtral's
            out.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                        "num_experts": m.n_experts, "num_experts_per_tok": m.top_k,
                        "moe_intermediate_size": m.d_expert or cfg.d_ff, "norm_topk_prob": m.normalize_top_k,
                        "decoder_sparse_step": 1, "mlp_only_layers": list(range(m.n_dense_first)),
                        "router_aux_loss_coef": m.aux_loss_coef / m.top_k, "output_router_logits": False})
    return out


# MoEConfig fields that set parameter shapes (d_expert as the width it gives, with d_ff for 0).
_MOE_SHAPE_FIELDS = ("n_experts", "top_k", "d_expert", "n_shared", "n_dense_first")


def _moe_field(cfg: ModelConfig, f: str) -> Any:
    if f == "d_expert":
        return cfg.moe.d_expert or cfg.d_ff if cfg.moe.n_experts else 0
    return _n_dense_first(cfg) if f == "n_dense_first" else getattr(cfg.moe, f) if cfg.moe.n_experts else 0


def _merge_config(hf_cfg: ModelConfig, cfg: ModelConfig | None, source: str) -> ModelConfig:
    """cfg's values win; shape fields must agree with the checkpoint, numeric ones may differ (with a warning)."""
    if cfg is None:
        return hf_cfg
    for f in _SHAPE_FIELDS:
        if getattr(cfg, f) != getattr(hf_cfg, f):
            raise ConfigError(f"config key 'model.{f}': {getattr(cfg, f)} does not match the checkpoint's "
                              f"{getattr(hf_cfg, f)} ({source})")
    if cfg.mtp.depth > hf_cfg.mtp.depth:
        raise ConfigError(f"config key 'model.mtp.depth': {cfg.mtp.depth}, but the checkpoint holds "
                          f"{hf_cfg.mtp.depth} multi-token prediction layer(s) (num_nextn_predict_layers, {source})")
    for f in _MOE_SHAPE_FIELDS:
        if _moe_field(cfg, f) != _moe_field(hf_cfg, f):
            raise ConfigError(f"config key 'model.moe.{f}': {_moe_field(cfg, f)} does not match the checkpoint's "
                              f"{_moe_field(hf_cfg, f)} ({source})")
    for f in ("score", "normalize_top_k", "routed_scale", "route_groups", "route_top_groups", "route_group_top"):
        if cfg.moe.n_experts and getattr(cfg.moe, f) != getattr(hf_cfg.moe, f):
            warnings.warn(f"model.moe.{f}={getattr(cfg.moe, f)} differs from the checkpoint's "
                          f"{getattr(hf_cfg.moe, f)} ({source}); using model.moe.{f}={getattr(cfg.moe, f)}",
                          stacklevel=3)
    for f in _NUMERIC_FIELDS:
        if getattr(cfg, f) != getattr(hf_cfg, f):
            warnings.warn(f"model.{f}={getattr(cfg, f)} differs from the checkpoint's {getattr(hf_cfg, f)} "
                          f"({source}); using model.{f}={getattr(cfg, f)}", stacklevel=3)
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# Shapes


def param_shapes(cfg: ModelConfig) -> dict:
    """The mx_jax params tree of a model `model_type` maps, as nested dicts of shapes (what llama.params_of
    returns)."""
    D, V, F, m, a = cfg.d_model, cfg.vocab_size, cfg.d_ff, cfg.moe, cfg.mla
    HK, GK = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head

    def stack(n: int, moe: bool) -> dict:
        if moe:
            E, Fe, Fs = m.n_experts, m.d_expert or F, m.n_shared * (m.d_expert or F)
            shared = {"shared": {"w_gate": (n, D, Fs), "w_up": (n, D, Fs), "w_down": (n, Fs, D)}} if Fs else {}
            mlp = {"moe": {"router": (n, D, E), "w_gate": (n, E, D, Fe), "w_up": (n, E, D, Fe),
                           "w_down": (n, E, Fe, D), **shared}}
        else:
            mlp = {"mlp": {"w_gate": (n, D, F), "w_up": (n, D, F), "w_down": (n, F, D)}}
        if a.kv_rank:  # layers.LatentAttention
            q = {"wq_a": (n, D, a.q_rank), "q_a_norm": {"scale": (n, a.q_rank)}, "wq_b": (n, a.q_rank, HK)} \
                if a.q_rank else {"wq": (n, D, HK)}
            attn = {**q, "wkv_a": (n, D, a.kv_rank + a.rope_dim), "kv_norm": {"scale": (n, a.kv_rank)},
                    "wkv_b": (n, a.kv_rank, cfg.n_heads * (a.nope_dim + a.v_dim)),
                    "wo": (n, cfg.n_heads * a.v_dim, D)}
        else:
            attn = {"wq": (n, D, HK), "wk": (n, D, GK), "wv": (n, D, GK), "wo": (n, HK, D)}
        if cfg.qk_norm:
            attn.update({"q_norm": {"scale": (n, cfg.d_head)}, "k_norm": {"scale": (n, cfg.d_head)}})
        if cfg.attention_bias:
            attn.update({"bq": (n, HK), "bk": (n, GK), "bv": (n, GK)})
        return {"attn_norm": {"scale": (n, D)}, "mlp_norm": {"scale": (n, D)}, "attn": attn, **mlp}

    n_first, n_mtp = _n_dense_first(cfg), cfg.mtp.depth
    mtp = {"mtp": {"enorm": {"scale": (n_mtp, D)}, "hnorm": {"scale": (n_mtp, D)}, "eh_proj": (n_mtp, 2 * D, D),
                   "block": stack(n_mtp, m.n_experts > 0), "norm": {"scale": (n_mtp, D)}}} if n_mtp else {}
    return {
        "embed": (V, D),
        **({"dense_blocks": stack(n_first, False)} if n_first else {}),
        "blocks": stack(cfg.n_layers - n_first, m.n_experts > 0),
        "final_norm": {"scale": (D,)},
        "head": (D, V),
        **mtp,
    }


def buffer_shapes(cfg: ModelConfig) -> dict:
    """The mx_jax buffers tree of a model `model_type` maps (what llama.buffers_of returns), as nested dicts of
    shapes: each MoE layer's router bias (moe.RouterBias, float32); {} for a dense model."""
    if not cfg.moe.n_experts:
        return {}
    mtp = {"mtp": {"block": {"moe": {"bias": (cfg.mtp.depth, cfg.moe.n_experts)}}}} if cfg.mtp.depth else {}
    return {"blocks": {"moe": {"bias": (cfg.n_layers - _n_dense_first(cfg), cfg.moe.n_experts)}}, **mtp}


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _hf_shape(t: _Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    one = shape[t.per_layer + t.per_expert:]
    return tuple(reversed(one)) if t.transpose else tuple(one)


def _mtp_layers(cfg: ModelConfig, kind: str) -> int:
    """The multi-token prediction layers (model.mtp) an HF checkpoint of `kind` holds: DeepSeek-V3's; 0 for every
    other architecture here (an export leaves them out, with a warning)."""
    return cfg.mtp.depth if kind == "deepseek_v3" else 0


def _hf_keys(cfg: ModelConfig, kind: str | None = None, copies: bool = False
             ) -> Iterator[tuple[str, _Tensor, tuple[int, ...]]]:
    """(HF key, layout entry, index into the stacked array: () or (layer,) or (layer, expert), the layer counted in
    its stack) in HF's order: embedding, layer 0's tensors (expert by expert), layer 1's, ..., then the multi-token
    prediction layers L, L + 1, ... (`_mtp_layers`), final norm, head; named as `kind` names them (default:
    model_type(cfg)). copies: also each MTP layer's copies of the embedding and the head (MTP_SHARED), which an
    export writes and an import does not read."""
    kind = kind or model_type(cfg)
    yield LAYOUT[0].hf, LAYOUT[0], ()
    for i in range(cfg.n_layers + _mtp_layers(cfg, kind)):
        _, k, tensors = _layer_layout(cfg, i, kind)
        for t in tensors:
            if t.per_expert:
                yield from ((t.hf.format(i=i, j=j), t, (k, j)) for j in range(cfg.moe.n_experts))
            else:
                yield t.hf.format(i=i), t, (k,)
        if copies and i >= cfg.n_layers:
            yield from ((t.hf.format(i=i), t, ()) for t in MTP_SHARED)
    yield from ((t.hf, t, ()) for t in LAYOUT[1:] if not t.per_layer)


def check_params(params: dict, cfg: ModelConfig, what: str = "params") -> None:
    """Raise naming the path when params lack a leaf of the model of cfg, have an extra one, or a shape differs;
    what="buffers": the same of its buffers (`buffer_shapes`)."""
    want = param_shapes(cfg) if what == "params" else buffer_shapes(cfg)
    want_leaves = {"/".join(map(str, _path_keys(p))): s for p, s in
                   jax.tree_util.tree_flatten_with_path(want, is_leaf=lambda x: isinstance(x, tuple))[0]}
    have = {"/".join(map(str, _path_keys(p))): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    missing, extra = sorted(set(want_leaves) - set(have)), sorted(set(have) - set(want_leaves))
    if missing or extra:
        raise ValueError(f"{what} do not match a model of this config: missing {missing}, unexpected {extra}")
    for k, shape in want_leaves.items():
        if tuple(have[k].shape) != shape:
            raise ValueError(f"{what}['{k}'] has shape {tuple(have[k].shape)} ({have[k].dtype}); the config wants "
                             f"{shape}")


def _path_keys(path) -> list:
    return [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]


# ---------------------------------------------------------------------------------------------------------------
# Import


def _open_weights(st, file: pathlib.Path, stack: contextlib.ExitStack):
    """safetensors' handle on `file`, or an HFFormatError naming it where its header cannot be read."""
    try:
        return stack.enter_context(st.safe_open(str(file), framework="np"))
    except (st.SafetensorError, OSError) as e:
        raise HFFormatError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e}); is the download "
                            f"whole?") from None


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF key -> the safetensors file holding it (single file, or sharded with an index)."""
    st = _safetensors()
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index, HFFormatError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFFormatError(f"{index}: not a safetensors index (needs a 'weight_map' object)")
        files = {k: path / v for k, v in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise HFFormatError(f"{index} names {f.name}, which does not exist")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        with contextlib.ExitStack() as stack:
            return {k: single for k in _open_weights(st, single, stack).keys()}
    found = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    raise HFFormatError(f"{path}: no {SINGLE_FILE} and no {INDEX_FILE} (found {found[:10]}); only safetensors "
                        "checkpoints are read")


def read_hf_config(path: str | pathlib.Path) -> dict:
    p = pathlib.Path(path) / "config.json"
    if not p.is_file():
        raise HFFormatError(f"{p} does not exist: an HF checkpoint directory has config.json and safetensors")
    return read_json_object(p, HFFormatError)


# safetensors dtypes that its numpy reader does not return (numpy has no float8): read through a memory map instead
_FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu}
_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")  # of a weight_scale_inv (F8_E8M0: bare exponents, ue8m0)


def _fp8_block(hf: dict, source: str) -> tuple[int, int] | None:
    """config.json's fp8 scale blocks (b0, b1) (quantization_config's weight_block_size), None where it quantizes
    nothing; an HFFormatError naming quantization_config for any other quantization."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if not (isinstance(q, dict) and q.get("quant_method") == "fp8" and isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise HFFormatError(f"{source}: quantization_config {q!r} is not supported (mx_jax reads 16- and 32-bit "
                            f"weights, and block-scaled fp8 ones: quant_method 'fp8' with a weight_block_size)")
    return block[0], block[1]


class _Weights:
    """The safetensors of an HF directory, read a tensor or a slice of one at a time (memory-mapped), each error
    naming the file and the key; an fp8 weight with its `<key>_scale_inv` beside it comes dequantized (module
    docstring, FP8 checkpoints). Use inside the ExitStack given, which closes the files."""

    def __init__(self, path: pathlib.Path, files: dict[str, pathlib.Path], stack: contextlib.ExitStack,
                 parts: dict[str, tuple[str, int, int, int]] | None = None, rows: dict[str, np.ndarray] | None = None,
                 block: tuple[int, int] | None = None):
        self.st, self.path, self.files, self.stack = _safetensors(), path, files, stack
        self.parts = parts or {}  # keys read as row ranges of a fused tensor (`_part_rows`)
        self.rows = rows or {}  # keys whose rows are read in another order (`_rope_rows`)
        self.block = block  # the fp8 scale blocks (`_fp8_block`)
        self.handles: dict[pathlib.Path, Any] = {}
        self.headers: dict[pathlib.Path, tuple[int, dict]] = {}
        self.used: set[str] = set()

    def _handle(self, key: str):
        if key not in self.files:
            raise HFFormatError(f"{self.path}: tensor '{key}' is missing (looked in "
                                f"{sorted({f.name for f in self.files.values()})})")
        file = self.files[key]
        if file not in self.handles:
            self.handles[file] = _open_weights(self.st, file, self.stack)
        if key not in self.handles[file].keys():
            raise HFFormatError(f"{file}: tensor '{key}' is missing (the index names this file)")
        return self.handles[file], file

    def check(self, key: str, want: tuple[int, ...]) -> None:
        if key in self.parts:  # a row range of a fused tensor: check the whole one
            key, _, _, rows = self.parts[key]
            want = (rows, *want[1:])
        f, file = self._handle(key)
        got, dtype = tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype()
        if got != want:
            raise HFFormatError(f"{file}: tensor '{key}' has shape {got}; config.json implies {want}")
        scale = key + "_scale_inv"
        if scale in self.files:
            if self.block is None:
                raise HFFormatError(f"{file}: tensor '{scale}' scales '{key}', but config.json has no "
                                    f"quantization_config with a weight_block_size")
            if dtype not in ("F8_E4M3", "F8_E5M2") or len(got) != 2:
                raise HFFormatError(f"{file}: tensor '{key}' ({dtype}, {got}) beside '{scale}' is not supported "
                                    f"(only fp8 matrices, F8_E4M3 or F8_E5M2, are dequantized)")
            sf, sfile = self._handle(scale)
            s_got, s_dtype = tuple(sf.get_slice(scale).get_shape()), sf.get_slice(scale).get_dtype()
            s_want = tuple(-(-n // b) for n, b in zip(got, self.block))
            if s_got != s_want or s_dtype not in _SCALE_DTYPES:
                raise HFFormatError(f"{sfile}: tensor '{scale}' is {s_dtype} {s_got}; '{key}' {got} in blocks of "
                                    f"{self.block} (quantization_config's weight_block_size) implies {s_want}, in "
                                    f"one of {_SCALE_DTYPES}")
            self.used.add(scale)
        elif dtype in _FLOAT8:
            raise HFFormatError(f"{file}: tensor '{key}' is {dtype} without '{scale}' to scale it")
        self.used.add(key)

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        if key in self.rows:  # the rows that span the ones asked for, then those in order
            rows, *rest = index or (slice(None),)
            want = self.rows[key][rows]
            first = int(want.min()) if want.size else 0
            stop = int(want.max()) + 1 if want.size else 0
            return self._read(key, (slice(first, stop), *rest))[want - first]
        return self._read(key, index)

    def _read(self, key: str, index: tuple[slice, ...] | None) -> np.ndarray:
        if key in self.parts:
            key, start, end, _ = self.parts[key]
            rows, *rest = index or (slice(None),)
            first, stop, step = rows.indices(end - start)
            if step != 1:
                raise ValueError(f"_Weights.read: a fused tensor's part is read in row ranges of step 1, got {rows}")
            index = (slice(start + first, max(start + first, start + stop)), *rest)
        if key + "_scale_inv" in self.files:
            return self._dequantized(key, index)
        return self._stored(key, index)

    def _stored(self, key: str, index: tuple[slice, ...] | None) -> np.ndarray:
        """The tensor as stored (a float8 one through a memory map of its bytes, viewed as its ml_dtypes type)."""
        f, file = self._handle(key)
        try:
            dtype = f.get_slice(key).get_dtype()
            if dtype not in _FLOAT8:
                return f.get_tensor(key) if index is None else f.get_slice(key)[index]
            if file not in self.headers:  # safetensors: 8 bytes of header length, the JSON header, the data
                with open(file, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    self.headers[file] = (8 + n, json.loads(fh.read(n)))
            start, header = self.headers[file]
            begin, end = header[key]["data_offsets"]
            x = np.memmap(file, np.uint8, "r", offset=start + begin, shape=(end - begin,)).view(_FLOAT8[dtype])
            x = x.reshape(header[key]["shape"])
            return np.array(x if index is None else x[index])
        except (self.st.SafetensorError, OSError, ValueError, KeyError) as e:
            raise HFFormatError(f"{file}: cannot read tensor '{key}' ({type(e).__name__}: {e}); is the download "
                                f"whole?") from None

    def _dequantized(self, key: str, index: tuple[slice, ...] | None) -> np.ndarray:
        """W8[rows, cols] * scale_inv of their blocks, float32; the scale rows one block row at a time, so that no
        scale array as large as the slice is made."""
        f, _ = self._handle(key)
        shape = f.get_slice(key).get_shape()
        (b0, b1), spans = self.block, []
        index = (*(index or ()), slice(None), slice(None))[:2]  # (rows,) or none: the rest whole
        for sl, n in zip(index, shape):
            first, stop, step = sl.indices(n)
            if step != 1:
                raise ValueError(f"_Weights.read: an fp8 tensor is read in slices of step 1, got {sl}")
            spans.append((first, max(first, stop)))
        (r0, r1), (c0, c1) = spans
        w = self._stored(key, (slice(r0, r1), slice(c0, c1)))
        scale = self._stored(key + "_scale_inv", (slice(r0 // b0, -(-r1 // b0)), slice(c0 // b1, -(-c1 // b1))))
        scale = np.repeat(scale.astype(np.float32), b1, axis=1)[:, c0 % b1:c0 % b1 + c1 - c0]  # (row blocks, cols)
        out = np.empty(w.shape, np.float32)
        for j, s in enumerate(scale):
            a, b = max(r0, (r0 // b0 + j) * b0) - r0, min(r1, (r0 // b0 + j + 1) * b0) - r0
            out[a:b] = w[a:b].astype(np.float32) * s
        return out

    def check_plan(self, plan: _Plan) -> None:
        """Every key of the plan's entries there with the shape its leaf implies, and no tensor left without a place
        (but the ignored ones, and the skipped multi-token-prediction layers, said in a warning): headers only,
        before anything is read."""
        for entries, shapes in ((plan.entries, plan.shapes), (plan.buffers, buffer_shapes(plan.cfg))):
            for leaf, items in entries.items():
                one = _get(shapes, leaf)[len(items[0][2]):]
                for key, transpose, _ in items:
                    self.check(key, one[::-1] if transpose else one)
        unused = sorted(k for k in set(self.files) - self.used - plan.ignored - set(plan.skipped)
                        if not _IGNORED_KEYS.fullmatch(k))
        if unused:
            raise HFFormatError(f"{self.path}: {len(unused)} tensor(s) have no place in a model of this config, e.g. "
                                f"{unused[:5]}")
        if plan.skipped:
            layers = sorted({int(k.split(".")[2]) for k in plan.skipped})
            warnings.warn(f"{self.path}: skipped the {len(plan.skipped)} tensors of the multi-token-prediction "
                          f"layer(s) {', '.join(f'model.layers.{i}' for i in layers)} (num_nextn_predict_layers): "
                          f"the model's config has model.mtp.depth={plan.cfg.mtp.depth}, and an export writes "
                          f"num_nextn_predict_layers {plan.cfg.mtp.depth}", stacklevel=3)


class _Plan(NamedTuple):
    """What an HF directory holds for a model of `cfg`, named as its config.json's model_type names it."""

    cfg: ModelConfig  # the model's config (`_merge_config`)
    shapes: dict  # its param_shapes
    entries: dict[tuple[str, ...], list[tuple[str, bool, tuple[int, ...]]]]  # {param path: [(HF key, transposed,
    # index in the stacked leading axes)]}
    buffers: dict[tuple[str, ...], list[tuple[str, bool, tuple[int, ...]]]]  # the same of its buffers
    files: dict[str, pathlib.Path]  # {HF key: file}
    ignored: set[str]  # keys without a place that are not an error: a tied head's stored lm_head, the MTP layers'
    # copies of the embedding and head
    skipped: list[str]  # the keys of the multi-token-prediction layers beyond model.mtp.depth
    parts: dict  # the keys stored fused (`_part_rows`)
    rows: dict  # the keys whose rows are ordered otherwise (`_rope_rows`)
    block: tuple[int, int] | None  # fp8 scale blocks (`_fp8_block`)

    def weights(self, path: pathlib.Path, stack: contextlib.ExitStack) -> _Weights:
        return _Weights(path, self.files, stack, self.parts, self.rows, self.block)


def _plan(path: pathlib.Path, cfg: ModelConfig | None) -> _Plan:
    """The `_Plan` of an HF directory. A tied head is read from the embedding, transposed, unless the checkpoint
    stores an lm_head, which transformers 5 then reads (it unties a stored head that differs from the embedding, with
    a warning). DeepSeek-V3's num_nextn_predict_layers layers after the L decoder layers are multi-token prediction
    (transformers' default 1 where the key is absent): the first model.mtp.depth of them are read (config_from_hf
    takes them all), the rest skipped."""
    hf = read_hf_config(path)
    source = str(path / "config.json")
    hf_cfg = config_from_hf(hf, source)
    kind = _family(hf.get("model_type"))  # the checkpoint's names, whatever cfg's routing (_merge_config warns)
    files = _weight_files(path)
    n, extra = hf_cfg.n_layers, hf_cfg.mtp.depth
    if extra and not any(k.startswith(f"model.layers.{n}.") for k in files):
        warnings.warn(f"{source}: num_nextn_predict_layers is {extra}, but the safetensors hold no model.layers.{n}.*: "
                      f"the checkpoint has no multi-token prediction layers (read as model.mtp.depth=0)", stacklevel=3)
        hf_cfg, extra = dataclasses.replace(hf_cfg, mtp=MTPConfig()), 0
    out_cfg = _merge_config(hf_cfg, cfg, source)
    tied = bool(hf.get("tie_word_embeddings", False)) and "lm_head.weight" not in files
    entries: dict[tuple[str, ...], list] = {}
    buffers: dict[tuple[str, ...], list] = {}
    for key, t, i in _hf_keys(out_cfg, kind):
        if key == "lm_head.weight" and tied:  # (V, D) as lm_head's
            key = "model.embed_tokens.weight"
        (buffers if t.buffer else entries).setdefault(t.path, []).append((key, t.transpose, i))
    # the MTP layers read share the model's embedding and head: their stored copies stay unread; the MTP layers
    # beyond model.mtp.depth are skipped (a warning)
    ignored = {"lm_head.weight"} if tied else set()
    ignored |= {t.hf.format(i=i) for i in range(n, n + out_cfg.mtp.depth) for t in MTP_SHARED}
    skipped = sorted(k for k in files if (m := re.match(r"model\.layers\.(\d+)\.", k))
                     and n + out_cfg.mtp.depth <= int(m.group(1)) < n + extra)
    return _Plan(out_cfg, param_shapes(out_cfg), entries, buffers, files, ignored, skipped,
                 _part_rows(_fusions(hf.get("model_type"), out_cfg)), _rope_rows(hf, out_cfg), _fp8_block(hf, source))


def load_hf_llama(path: str | pathlib.Path, cfg: ModelConfig | None = None) -> tuple[dict, ModelConfig]:
    """Read an HF directory (config.json + safetensors) -> (params as numpy arrays, ModelConfig).

    cfg None: the architecture comes from config.json, every other field at its ModelConfig default. cfg given:
    it is returned as is, after checking that its shape fields match config.json (ConfigError otherwise); a
    different rope_theta / rope_scaling / norm_eps only warns (e.g. long-context fine-tuning). Arrays come out
    in cfg.param_dtype, laid out as `llama.params_of` gives them. DeepSeek-V3's router biases are buffers, not
    parameters: `load_hf_buffers` reads them.
    """
    path = pathlib.Path(path)
    plan = _plan(path, cfg)
    dtype = np.dtype(jax.numpy.dtype(plan.cfg.param_dtype))
    params: dict = {}
    with contextlib.ExitStack() as stack:
        weights = plan.weights(path, stack)
        weights.check_plan(plan)
        for leaf, items in plan.entries.items():
            dst = np.empty(_get(plan.shapes, leaf), dtype)
            _set(params, leaf, dst)
            for key, transpose, i in items:
                x = weights.read(key)
                dst[i] = x.T if transpose else x  # casts to param_dtype in place
                del x
    return params, plan.cfg


def load_hf_buffers(path: str | pathlib.Path, cfg: ModelConfig) -> dict:
    """The buffers (llama.buffers_of) of the model in an HF directory, float32 numpy arrays shaped as
    `buffer_shapes(cfg)`: each MoE layer's router bias, DeepSeek-V3's e_score_correction_bias, and zeros where the
    checkpoint's architecture has none (every other MoE model here routes without one); {} for a dense model. cfg:
    the model's (load_hf_llama's, or one it accepts), whose shapes the bias tensors must have."""
    path = pathlib.Path(path)
    out = jax.tree.map(lambda s: np.zeros(s, np.float32), buffer_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    kind = _family(read_hf_config(path).get("model_type"))
    with contextlib.ExitStack() as stack:
        weights = _Weights(path, _weight_files(path), stack)
        for key, t, i in _hf_keys(cfg, kind):
            if t.buffer:
                dst = _get(out, t.path)
                weights.check(key, dst.shape[len(i):])
                dst[i] = weights.read(key)
    return out


def load_hf_sharded(path: str | pathlib.Path, cfg: ModelConfig, shardings: dict) -> dict:
    """load_hf_llama's parameters placed per `shardings` (a params-shaped tree of jax.sharding.Sharding), each
    process reading only the slices its own devices hold: jax.make_array_from_callback asks for each local shard,
    and the safetensors are memory-mapped, so a process holds its devices' shards, not the model (a replicated
    parameter is read whole, a transposed slice touches the rows it spans, an fp8 one the scale blocks it spans).
    Every key and shape is checked before anything is read."""
    path = pathlib.Path(path)
    plan = _plan(path, cfg)
    dtype = np.dtype(jax.numpy.dtype(plan.cfg.param_dtype))
    with contextlib.ExitStack() as stack:
        weights = plan.weights(path, stack)
        weights.check_plan(plan)

        def place(leaf: tuple[str, ...], shape: tuple[int, ...], sharding) -> jax.Array:
            items = plan.entries[leaf]
            lead = len(items[0][2])

            def shard(index: tuple[slice, ...]) -> np.ndarray:
                spans = [range(*sl.indices(n)) for sl, n in zip(index, shape)]
                out = np.empty([len(r) for r in spans], dtype)
                rest = tuple(slice(r.start, r.stop) for r in spans[lead:])
                for key, transpose, i in items:
                    if all(j in r for j, r in zip(i, spans[:lead])):
                        x = weights.read(key, rest[::-1] if transpose else rest)
                        out[tuple(j - r.start for j, r in zip(i, spans[:lead]))] = x.T if transpose else x
                return out

            return jax.make_array_from_callback(shape, sharding, shard)

        flat = {tuple(_path_keys(p)): s for p, s in
                jax.tree_util.tree_flatten_with_path(plan.shapes, is_leaf=lambda x: isinstance(x, tuple))[0]}
        out: dict = {}
        for leaf, shape in flat.items():
            _set(out, leaf, place(leaf, shape, _get(shardings, leaf)))
        return out


# ---------------------------------------------------------------------------------------------------------------
# Export


def _host(x: Any, dtype: np.dtype) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError("export_hf_llama: a parameter spans several processes; export from one process with "
                         "`python -m mx_jax.hf export RUN_DIR OUT`, which reads the checkpoint")
    return np.asarray(x).astype(dtype, copy=False)


def export_hf_llama(params: dict, cfg: ModelConfig, path: str | pathlib.Path, *, buffers: dict | None = None,
                    dtype: str = "bfloat16", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    hf_config: dict | None = None, overwrite: bool = False,
                    extra_files: dict[str, pathlib.Path] | None = None) -> list[pathlib.Path]:
    """Write params (numpy or addressable jax arrays) as an HF Llama directory; returns the files written.

    One `model.safetensors` when the weights fit in max_shard_bytes, else `model-0000k-of-0000n.safetensors` shards
    plus `model.safetensors.index.json`. dtype: "bfloat16" (HF's usual), "float32" or "float16". hf_config: a
    config.json to start from (its architecture keys are overwritten). extra_files: {name in `path`: file to copy},
    moved in with the weights (generation_config.json, a model's own code). An existing checkpoint in `path` is an
    error unless overwrite=True, which replaces its safetensors files, and removes its sidecars, code and tokenizer
    files, once the new ones are whole (they are written beside `path` first: an export that stops leaves `path` as
    it was). buffers: the model's (llama.buffers_of, `load_buffers`), which DeepSeek-V3 needs: it stores each MoE
    layer's router bias, written in float32 whatever dtype; no other MoE here has a place for router biases, and
    nonzero ones (which model.moe.bias_update_rate > 0 trains) are refused there.
    """
    _safetensors()
    import safetensors.numpy as stnp

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export_hf_llama: dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"export_hf_llama: max_shard_bytes must be positive, got {max_shard_bytes}")
    config = config_to_hf(cfg, dtype, hf_config)  # refuses what HF cannot hold before anything is written
    check_params(params, cfg)
    kind = model_type(cfg)
    if kind == "deepseek_v3":
        if buffers is None:
            raise ValueError("export_hf_llama: DeepSeek-V3 stores each MoE layer's router bias "
                             "(e_score_correction_bias): pass buffers= (llama.buffers_of(model), hf.load_buffers)")
        check_params(buffers, cfg, "buffers")
    elif buffers and any(np.any(np.asarray(b) != 0) for b in jax.tree.leaves(buffers)):
        raise ValueError(f"export_hf_llama: the router biases are not zero (model.moe.bias_update_rate trained "
                         f"them), and {kind}'s router has no place for them: they change which experts are chosen "
                         f"(DeepSeek-V3 holds them: model.mla with model.moe.score=sigmoid)")
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    old = sorted(path.glob("model*.safetensors")) + sorted(path.glob(INDEX_FILE)) if path.is_dir() else []
    if old and not overwrite:
        raise FileExistsError(f"{path} already holds {[p.name for p in old]}; pass overwrite=True (--overwrite)")
    if old:  # the old export's sidecars, code and tokenizer go with it (`main` copies the run's tokenizer after)
        try:
            old_config = read_json_object(path / "config.json", HFFormatError) if (path / "config.json").is_file() \
                else {}
        except HFFormatError:
            old_config = {}
        old += [path / n for n in (*SIDECARS, *code_files(old_config), *TOKENIZER_FILES) if (path / n).is_file()]

    # Plan shards from shapes alone, greedily in HF's key order; a tensor larger than the limit gets its own shard,
    # and the parts of a fused tensor (`_fusions`, consecutive in that order) stay in one.
    shapes = param_shapes(cfg)
    parts = _part_rows(_fusions(config["model_type"], cfg))
    orders = _rope_rows(config, cfg)
    shards: list[list[tuple[str, _Tensor, tuple[int, ...]]]] = [[]]
    size = 0
    total = 0
    bias_shapes = buffer_shapes(cfg)
    if cfg.mtp.depth and not _mtp_layers(cfg, kind):
        warnings.warn(f"export_hf_llama: {kind} has no multi-token prediction layers: model.mtp's {cfg.mtp.depth} "
                      f"layer(s) are not written (DeepSeek-V3's format holds them)", stacklevel=2)
    for key, t, i in _hf_keys(cfg, copies=True):
        nbytes = math.prod(_hf_shape(t, _get(bias_shapes if t.buffer else shapes, t.path))) * (
            4 if t.buffer else np_dtype.itemsize)
        _, start, end, rows = parts.get(key, (key, 0, 1, 1))
        whole = nbytes * rows // (end - start)  # a fused tensor's bytes, at its first part
        if shards[-1] and start == 0 and size + whole > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, t, i))
        size += nbytes
        total += nbytes
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    # Everything is written into a staging directory beside `path` and moved in once whole, so an export that
    # stops (an error, a kill) leaves `path` as it was; an old export is removed only then.
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        weight_map = {}
        for name, shard in zip(names, shards):
            tensors, fused = {}, {}
            for key, t, i in shard:
                x = _host(_get(buffers, t.path)[i], np.dtype(np.float32)) if t.buffer else \
                    _host(_get(params, t.path)[i], np_dtype)
                x = x.T if t.transpose else x
                if key in orders:  # HF row orders[key][r] is mx_jax's column r
                    x = x[np.argsort(orders[key])]
                if key in parts:  # rows of a fused tensor: stored once its last part is there
                    stored, _, end, rows = parts[key]
                    fused.setdefault(stored, []).append(x)
                    key, x = stored, (np.concatenate(fused.pop(stored)) if end == rows else None)
                if x is not None:
                    tensors[key] = np.ascontiguousarray(x)
                    weight_map[key] = name
            stnp.save_file(tensors, str(staging / name), metadata={"format": "pt"})  # transformers checks "format"
            del tensors
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, staging / name)
        for f in staging.iterdir():  # safetensors writes 0600: the files get the mode the umask gives
            f.chmod(0o666 & ~umask)
        files = [*names, *([INDEX_FILE] if n > 1 else []), "config.json", *(extra_files or {})]
        if not path.exists():
            staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would keep other users (an inference server) out
            staging.rename(path)
        else:
            for p in old:
                p.unlink()
            for f in files:
                (staging / f).replace(path / f)
        return [path / f for f in files]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# mx_jax Orbax checkpoints of params: `<dir>/checkpoints/<step>/state` holding {"params": ...} (the trainer writes
# the whole train state there; the "params" subtree is restored alone).


def state_dir(path: str | pathlib.Path, step: int | None = None) -> pathlib.Path:
    """The Orbax `state` directory for a run dir, its checkpoints dir, a step dir, or a state dir (latest step
    unless `step`)."""
    p = pathlib.Path(path).absolute()
    given = p if p.name == "state" and (p / "_METADATA").exists() else p / "state" if (p / "state").is_dir() else None
    if given is not None:  # a step's own directory: --step may only name that step
        if step is not None and given.parent.name != str(step):
            raise FileNotFoundError(f"{path} is the checkpoint of step {given.parent.name}, not of step {step}: pass "
                                    f"the run directory to choose a step")
        return given
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    steps = sorted(int(d.name) for d in root.iterdir() if d.name.isdigit() and (d / "state").is_dir()) \
        if root.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"{path}: no mx_jax checkpoint (expected <run_dir>/checkpoints/<step>/state)")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"{root}: no checkpoint for step {step} (have {steps})")
    return root / str(step) / "state"


@contextlib.contextmanager
def reading_step(sdir: pathlib.Path, what: str = "parameters"):
    """Inside: Orbax reads of the step whose `state` directory is `sdir`. A failure of Orbax's (a damaged or
    half-copied step) becomes a checkpoint.CheckpointError naming the step and the run's other steps to read instead
    (`--step N`); mx_jax's own errors (ConfigError, HFFormatError) pass as they are."""
    from mx_jax import checkpoint

    checkpoint.quiet_abandoned_reads()
    try:
        yield
    except (ConfigError, HFFormatError):
        raise
    except Exception as e:  # noqa: BLE001 -- Orbax raises many types for a damaged directory
        others = sorted(int(d.name) for d in sdir.parent.parent.iterdir()
                        if d.name.isdigit() and d != sdir.parent and (d / "state").is_dir())
        hint = f"--step N reads another (this run has {others})" if others else "the run has no other step"
        raise checkpoint.CheckpointError(f"cannot read the {what} of the checkpoint at {sdir.parent} "
                                         f"({checkpoint.read_failure(e)}); {hint}") from e


def save_params(params: dict, out_dir: str | pathlib.Path, step: int = 0, buffers: dict | None = None
                ) -> pathlib.Path:
    """Write {"params": params} (and "buffers", given: a MoE model's router biases) as
    `<out_dir>/checkpoints/<step>/state` (the trainer's layout and names); returns that dir."""
    import orbax.checkpoint as ocp

    target = pathlib.Path(out_dir).absolute() / "checkpoints" / str(step) / "state"
    if target.exists():
        raise FileExistsError(f"{target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(target, {"params": params, **({"buffers": buffers} if buffers else {})})
    ckpt.wait_until_finished()
    ckpt.close()
    return target


def _restore(sdir: pathlib.Path, name: str, shapes: dict, dtype, shardings: dict | None) -> dict:
    """The subtree `name` of the Orbax state in sdir, as `shapes` (nested dicts of shape tuples) in `dtype`:
    numpy arrays (shardings None) or jax arrays placed per shardings (any mesh: Orbax reshards)."""
    import orbax.checkpoint as ocp

    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    if shardings is None:
        item = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=is_shape)
        restore_args = jax.tree.map(lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype), item)
    else:
        item = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s, dtype, sharding=sh), shapes, shardings,
                            is_leaf=is_shape)
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    with reading_step(sdir), ocp.PyTreeCheckpointer() as ckpt:
        out = ckpt.restore(sdir, args=ocp.args.PyTreeRestore(
            item={name: item}, restore_args={name: restore_args}, partial_restore=True))
    return out[name]


def _on_disk(sdir: pathlib.Path) -> dict:
    """The Orbax state's tree of array metadata (shape, dtype), read from its metadata alone."""
    import orbax.checkpoint as ocp

    with reading_step(sdir):
        on_disk = ocp.PyTreeCheckpointHandler().metadata(sdir)
    return getattr(on_disk, "tree", on_disk)


def load_params(path: str | pathlib.Path, cfg: ModelConfig, *, step: int | None = None,
                shardings: dict | None = None, dtype: str | None = None) -> dict:
    """The "params" subtree of an mx_jax checkpoint (see state_dir for `path`), checked against cfg's shapes.

    shardings: a params-shaped tree of jax.sharding.Sharding -> jax arrays placed so (any mesh: Orbax reshards);
    None -> numpy arrays on the host. dtype: cast on read (default: cfg.param_dtype).
    """
    sdir = state_dir(path, step)
    on_disk = _on_disk(sdir)
    if "params" not in on_disk:
        raise HFFormatError(f"{sdir}: the checkpoint has no 'params' subtree (has {sorted(on_disk)})")
    check_params(jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), on_disk["params"]), cfg)
    return _restore(sdir, "params", param_shapes(cfg), jax.numpy.dtype(dtype or cfg.param_dtype), shardings)


def load_buffers(path: str | pathlib.Path, cfg: ModelConfig, *, step: int | None = None,
                 shardings: dict | None = None) -> dict:
    """The "buffers" subtree of an mx_jax checkpoint (a MoE model's router biases: a trainer's step, or an `import`),
    float32, checked against cfg's shapes (`buffer_shapes`); zeros where the checkpoint holds none (an import made
    before imports kept them: the biases every run started from then). shardings: a buffers-shaped tree of
    jax.sharding.Sharding -> jax arrays placed so; None -> numpy arrays."""
    shapes = buffer_shapes(cfg)
    if not shapes:
        return {}
    sdir = state_dir(path, step)
    on_disk = _on_disk(sdir).get("buffers")
    if not on_disk:
        return _placed(jax.tree.map(lambda s: np.zeros(s, np.float32), shapes,
                                    is_leaf=lambda x: isinstance(x, tuple)), shardings)
    check_params(jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), on_disk), cfg, "buffers")
    return _restore(sdir, "buffers", shapes, np.dtype(np.float32), shardings)


def _placed(tree: dict, shardings: dict | None) -> dict:
    """numpy arrays (the same in every process) placed per shardings, each process giving its own devices' slices;
    as they are without shardings."""
    if shardings is None:
        return tree
    return jax.tree.map(lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda index: x[index]), tree,
                        shardings)


def is_hf_dir(path: str | pathlib.Path) -> bool:
    p = pathlib.Path(path)
    return (p / "config.json").is_file() and ((p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file())


def init_from(path: str | pathlib.Path, model_cfg: ModelConfig, param_shardings: dict | None = None,
              buffer_shardings: dict | None = None) -> tuple[dict, dict]:
    """(parameters, buffers) to start a run from: an HF Llama directory, or an mx_jax checkpoint (run dir / step
    dir). The buffers are a MoE model's router biases (DeepSeek-V3's from an HF directory, `load_hf_buffers`; a
    checkpoint's own, `load_buffers`), zeros where the source holds none; {} for a dense model.

    Shape fields of model_cfg must match the checkpoint. With param_shardings and buffer_shardings
    (`Setup.param_shardings`, `Setup.state_shardings["buffers"]`) the arrays are placed on the mesh (each process
    reads only the slices of the HF safetensors that its own devices hold, `load_hf_sharded`; Orbax checkpoints are
    read shard by shard and resharded to any mesh). The trainer calls this for the config key `init_from` on a fresh
    start (never on resume, where the checkpoint holds the params). The optimizer state stays as initialized
    (AdamW's moments start at zero whatever the parameters).
    """
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path} does not exist (an HF Llama directory or an mx_jax run/step directory)")
    if not (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        raise HFFormatError(f"{path} has safetensors but no config.json; an HF checkpoint needs both")
    if is_hf_dir(path):
        if param_shardings is None:
            params, cfg = load_hf_llama(path, model_cfg)
        else:
            params, cfg = load_hf_sharded(path, model_cfg, param_shardings), model_cfg
        return params, _placed(load_hf_buffers(path, cfg), buffer_shardings)
    kept = _source_config(p)  # an imported run: the HF model's routing and rope settings against model_cfg's
    if kept is not None and kept.name == "hf_config.json":
        try:
            hf_cfg = config_from_hf(read_json_object(kept, HFFormatError), str(kept))
        except HFFormatError:
            hf_cfg = None
        if hf_cfg is not None:
            _merge_config(hf_cfg, model_cfg, str(kept))  # warns where they differ; load_params checks the shapes
    return (load_params(path, model_cfg, shardings=param_shardings),
            load_buffers(path, model_cfg, shardings=buffer_shardings))


# ---------------------------------------------------------------------------------------------------------------
# CLI


def _model_config_of(run_dir: pathlib.Path, override: str | None) -> ModelConfig:
    cfg_file = pathlib.Path(override) if override else run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ConfigError(f"{cfg_file} does not exist: pass --config with the run's YAML (its model section is used)")
    return load_config(str(cfg_file)).model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export_tokenizer(cfg_file: pathlib.Path, out: pathlib.Path) -> str:
    """Put the run's tokenizer beside exported weights, so that transformers or an inference engine can load the
    directory as it is: the tokenizer.json the run's data was converted with (its meta.json names it) and the
    tokenizer_config.json, special_tokens_map.json and chat_template.jinja beside it, and the chat template the
    fine-tuning examples were rendered with (meta.json's chat_template) as tokenizer_config.json's. Returns what was
    done, for the log."""
    from mx_jax import data, sample

    try:
        cfg = load_config(str(cfg_file))
        spec = sample.tokenizer_of(cfg)
        template = sample.chat_template_of(cfg)
    except ConfigError as e:
        return f"tokenizer: not copied ({e})"
    if spec == "byte":
        return "tokenizer: bytes (ids 0-255), no files to copy"
    src = pathlib.Path(spec)
    if not src.is_file():
        return f"tokenizer: {src}, which the data's meta.json names, is gone; copy the tokenizer files by hand"
    copied = []
    for name in TOKENIZER_FILES:
        if (src.parent / name).is_file():
            shutil.copyfile(src.parent / name, out / name)
            copied.append(name)
    if template and pathlib.Path(template).resolve() not in {(src.parent / n).resolve() for n in TOKENIZER_FILES}:
        tokenizer_config = out / "tokenizer_config.json"
        tc = read_json_object(tokenizer_config) if tokenizer_config.is_file() else {}
        tc["chat_template"] = data.ChatTemplate(template, spec, "export").source
        tokenizer_config.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
        (out / "chat_template.jinja").unlink(missing_ok=True)  # it would take precedence over tokenizer_config's
        copied.append(f"the chat template {template} into tokenizer_config.json")
    return f"tokenizer: {', '.join(copied)} from {src.parent}"


# Files beside an HF model's weights that an exported copy carries too: its generation defaults (the end-of-turn
# ids a chat model stops at, sampling settings) and, for a model whose code ships with the checkpoint (config.json's
# auto_map: DeepSeekMoE), that code. `import`, and the trainer on a fresh start from `init_from`, keep them in the run
# directory as hf_<name>, beside hf_config.json (the model's config.json); `export` puts them back.
SIDECARS = ("generation_config.json",)
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def code_files(config: dict) -> list[str]:
    """The local Python files config.json's auto_map names ("modeling_deepseek.DeepseekForCausalLM" ->
    modeling_deepseek.py). An entry "repo--module.Class" names another repository's code, not a file here."""
    auto = config.get("auto_map")
    refs = [r for v in auto.values() for r in (v if isinstance(v, list) else [v])] if isinstance(auto, dict) else []
    modules = {r.rsplit(".", 1)[0] for r in refs if isinstance(r, str) and "--" not in r and "." in r}
    return sorted(f"{m}.py" for m in modules if _MODULE.fullmatch(m))


def _local_ref_ok(ref: Any, present: set[str]) -> bool:
    """An auto_map entry an export may keep: another repository's code, or a module whose file it carries."""
    if not isinstance(ref, str) or "--" in ref:
        return True
    module = ref.rsplit(".", 1)[0]
    return f"{module}.py" in present


def _model_files(config_file: pathlib.Path) -> dict[str, pathlib.Path]:
    """{name: file} of the sidecars and model code beside a config.json (HF layout: config.json, generation_config.
    json, ...) or an hf_config.json (a run directory: hf_config.json, hf_generation_config.json, ...)."""
    prefix = "hf_" if config_file.name == "hf_config.json" else ""
    config = read_json_object(config_file, HFFormatError)
    names = (*SIDECARS, *code_files(config))
    return {n: config_file.parent / f"{prefix}{n}" for n in names if (config_file.parent / f"{prefix}{n}").is_file()}


def _source_config(path: pathlib.Path) -> pathlib.Path | None:
    """The config.json describing the model in `path`: an HF directory's config.json, or the hf_config.json kept in
    an mx_jax run (the run directory above a step or state directory)."""
    if is_hf_dir(path):
        return path / "config.json"
    kept = _run_dir_of(path.absolute()) / "hf_config.json"
    return kept if kept.is_file() else None


def keep_model_files(source: str | pathlib.Path, run_dir: str | pathlib.Path) -> list[str]:
    """Copy the config.json and sidecars of the model in `source` (an HF directory or an mx_jax run or step directory
    holding them) into run_dir as hf_config.json and hf_<name>, so that an export of the run, or of a run started
    from it, writes them back (`export_base`). Returns the names copied ([] where source has none)."""
    config = _source_config(pathlib.Path(source))
    if config is None:
        return []
    run_dir = pathlib.Path(run_dir)
    files = {"config.json": config, **_model_files(config)}
    for name, src in files.items():
        dst = run_dir / f"hf_{name}"
        if src.resolve() != dst.resolve():
            shutil.copyfile(src, dst)
    return sorted(files)


def _init_from_of(cfg_file: pathlib.Path) -> str:
    try:
        return load_config(str(cfg_file)).init_from if cfg_file.is_file() else ""
    except ConfigError:
        return ""


def export_base(run_dir: pathlib.Path, cfg_file: pathlib.Path, hf_config: str | None, kind: str
                ) -> tuple[dict | None, dict[str, pathlib.Path], str]:
    """(config.json to start from, {name: file} to put beside the weights, what the log says about them) for an export
    of the run in run_dir as HF model_type `kind`: --hf-config (a config.json, hf_config.json or a directory holding
    one); else the run's hf_config.json (kept by `import` and by the trainer from init_from); else, for runs made
    before it kept one, that of the model its init_from names, followed through runs that started from runs. The
    sidecars come from beside it. A base of another model_type gives no code, and an auto_map entry whose module is
    not there is left out of config.json."""
    if hf_config:
        given = pathlib.Path(hf_config)
        if given.is_dir():
            given = next((given / n for n in ("config.json", "hf_config.json") if (given / n).is_file()), given)
        if not given.is_file():
            raise FileNotFoundError(f"--hf-config {hf_config}: no such file, nor a directory holding config.json")
        found: pathlib.Path | None = given
        note = ""
    else:
        found, note, seen = None, "", set()
        rd, cfg_path = run_dir, cfg_file
        while found is None and rd not in seen and len(seen) < 16:
            seen.add(rd)
            if (rd / "hf_config.json").is_file():
                found = rd / "hf_config.json"
                break
            init = _init_from_of(cfg_path)
            if not init:
                break
            if not pathlib.Path(init).exists():
                note = (f"; the run started from {init}, which is not found from here, so config.json takes no keys "
                        f"from it (--hf-config FILE names one)")
                break
            found = _source_config(pathlib.Path(init))
            rd = _run_dir_of(pathlib.Path(init).absolute())
            cfg_path = rd / "config.yaml"
    if found is None:
        return None, {}, note.lstrip("; ")
    base = read_json_object(found, HFFormatError)
    extra = _model_files(found)
    if _family(base.get("model_type")) != kind:  # config_to_hf keeps only its generic keys: no code either
        extra = {n: p for n, p in extra.items() if n in SIDECARS}
    auto = base.pop("auto_map", None)
    if isinstance(auto, dict) and _family(base.get("model_type")) == kind:
        kept = {k: v for k, v in auto.items()
                if all(_local_ref_ok(r, set(extra)) for r in (v if isinstance(v, list) else [v]))}
        if kept:
            base["auto_map"] = kept
    extra = {n: p for n, p in extra.items() if n in SIDECARS or n in code_files(base)}
    return base, extra, f"config.json: the keys it does not set from {found}" + (
        f"; {', '.join(extra)} from beside it" if extra else "") + note


def _run_dir_of(path: pathlib.Path) -> pathlib.Path:
    """The run dir above a step / state / checkpoints dir, where config.yaml lives."""
    for p in (path, *path.parents):
        if (p / "checkpoints").is_dir():
            return p
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mx_jax.hf", description="Convert between HF checkpoints (Llama, "
                                 "Mistral, Phi-3, Mixtral, DeepSeekMoE, DeepSeek-V2, DeepSeek-V3, Qwen2, Qwen3, "
                                 "Qwen3-MoE) and mx_jax.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="HF directory -> OUT/checkpoints/<step>/state + OUT/config.yaml")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    imp.add_argument("--step", type=int, default=0)
    exp = sub.add_parser("export", help="mx_jax checkpoint (run dir, step dir) -> HF directory")
    exp.add_argument("checkpoint")
    exp.add_argument("hf_dir")
    exp.add_argument("--step", type=int, default=None, help="default: the latest")
    exp.add_argument("--config", help="YAML whose model section describes the checkpoint (default: "
                     "<run_dir>/config.yaml)")
    exp.add_argument("--dtype", default="bfloat16", choices=EXPORT_DTYPES)
    exp.add_argument("--max-shard-bytes", type=float, default=DEFAULT_MAX_SHARD_BYTES)
    exp.add_argument("--hf-config", help="config.json (or a directory holding it) to start from (default: the run's "
                     "hf_config.json, kept from the model it was imported or started from)")
    exp.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "import":
            src, out = pathlib.Path(args.hf_dir), pathlib.Path(args.out_dir)
            taken = [x.name for x in (out / "config.yaml", out / "checkpoints") if x.exists()
                     ] + sorted(x.name for x in out.glob("hf_*"))
            if taken:
                raise FileExistsError(f"{out} already holds {taken} (a run or an earlier import); import into a new "
                                      f"directory")
            params, cfg = load_hf_llama(src)
            buffers = load_hf_buffers(src, cfg)
            arch = {k: v for k, v in to_dict(cfg).items() if k in _ARCH_KEYS}
            if not cfg.mla.kv_rank:
                arch.pop("mla")
            if cfg.mtp.depth:  # DeepSeek-V3's multi-token prediction layers, read into model.mtp
                arch["mtp"] = {"depth": cfg.mtp.depth}
            if cfg.moe.n_experts:
                keys = ("n_experts", "top_k", "aux_loss_coef")
                if model_type(cfg) != "mixtral":
                    keys += ("d_expert", "n_shared", "n_dense_first", "normalize_top_k")
                if model_type(cfg) in ("deepseek", "deepseek_v2", "deepseek_v3"):
                    keys += ("aux_loss_scope",)
                if model_type(cfg) in ("deepseek_v2", "deepseek_v3"):
                    keys += ("routed_scale", "route_groups", "route_top_groups", "route_group_top")
                if model_type(cfg) == "deepseek_v3":
                    keys += ("score",)
                arch["moe"] = {k: getattr(cfg.moe, k) for k in keys}
            made = not out.exists()
            try:
                target = save_params(params, out, args.step, buffers)
                (out / "config.yaml").write_text(yaml.safe_dump({"model": arch}, sort_keys=False))
                keep_model_files(src, out)  # what an export puts back beside the weights
            except BaseException:  # nothing half-written stays: the directory, or what this import added to it
                if made:
                    shutil.rmtree(out, ignore_errors=True)
                else:
                    shutil.rmtree(out / "checkpoints", ignore_errors=True)
                    for f in [out / "config.yaml", *out.glob("hf_*")]:
                        f.unlink(missing_ok=True)
                raise
            n = sum(x.size for x in jax.tree.leaves(params))
            print(f"imported {n / 1e6:,.1f} M parameters -> {target}; the model section is in {out / 'config.yaml'}")
        else:
            ckpt = pathlib.Path(args.checkpoint)
            run_dir = _run_dir_of(ckpt.absolute())
            cfg = _model_config_of(run_dir, args.config)
            cfg_file = pathlib.Path(args.config) if args.config else run_dir / "config.yaml"
            base, extra, said = export_base(run_dir, cfg_file, args.hf_config, model_type(cfg))
            params = load_params(ckpt, cfg, step=args.step, dtype=args.dtype)
            buffers = load_buffers(ckpt, cfg, step=args.step)
            files = export_hf_llama(params, cfg, args.hf_dir, buffers=buffers, dtype=args.dtype,
                                    max_shard_bytes=int(args.max_shard_bytes), hf_config=base,
                                    overwrite=args.overwrite, extra_files=extra)
            print(f"exported {state_dir(ckpt, args.step)} -> {', '.join(f.name for f in files)} in {args.hf_dir}")
            if said:
                print(said)
            if model_type(cfg) == "deepseek" and not (base or {}).get("auto_map"):
                print("DeepseekForCausalLM: vLLM and SGLang load it as it is; transformers needs the model's own code "
                      "(configuration_deepseek.py and modeling_deepseek.py from deepseek-ai/deepseek-moe-16b-base, "
                      "and its config.json's auto_map)")
            print(export_tokenizer(cfg_file, pathlib.Path(args.hf_dir)))
    except (ConfigError, HFFormatError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from mx_jax.checkpoint import CheckpointError

        if not isinstance(e, CheckpointError):
            raise
        print(f"error: {e}", file=sys.stderr)  # a step Orbax cannot read, as the trainer's and sample's exit code
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
