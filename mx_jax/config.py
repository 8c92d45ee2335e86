"""Configuration: one dataclass tree = one YAML tree = one dotted CLI path.

    python -m mx_jax.train --config configs/llama3_debug.yaml optim.lr_peak=1e-3 mesh.fsdp=4 run_dir=/tmp/r1

Precedence is defaults < YAML < `dotted.key=value` overrides. Every key is checked: an unknown key is an error that
names it and the closest valid key; a value that does not parse as the field's type, or is outside its allowed
choices, is an error naming the key. Cross-field rules (heads divide the model width, accumulation divides the
batch, ...) are checked by `validate()`; the rules that need the resolved mesh (the batch, the sequence and the
experts divide over it) by `train.check_against_mesh`. Nothing is written before the whole config is valid.

Each module takes its own section (ModelConfig, MeshConfig, ...), never the whole TrainConfig.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import pathlib
import typing
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling for a context past pre-training's (factor 1.0 = off): Llama 3.1's or YaRN's (Qwen2.5 and
    Qwen3 long-context, DeepSeek-V2/V3). See layers.rope_inv_freq."""

    kind: Literal["llama3", "yarn"] = "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_len: int = 8192  # the pre-training context
    beta_fast: float = 32.0  # yarn: rotations over the original context above which a frequency is kept
    beta_slow: float = 1.0  # yarn: ... below which it is divided by factor
    attention_factor: float = 0.0  # yarn: q and k scaled by it after RoPE; 0 = 0.1 ln(factor) + 1 (YaRN's)
    # yarn under multi-head latent attention (model.mla): the softmax scale 1/sqrt(K) times m^2 with
    # m = 0.1 mscale_all_dim ln(factor) + 1 (DeepSeek-V2/V3's); 0 = m is 1
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3; layers.LatentAttention) in place of grouped-query attention when
    kv_rank > 0: keys and values are made per head from one compressed latent of each token, the queries from x or
    from a compressed latent of their own, and each head's query and key are a part without RoPE (nope_dim) joined to
    a rotated part (rope_dim) whose key is one for all heads."""

    kv_rank: int = 0  # width of the key-value latent (DeepSeek's kv_lora_rank); 0 = grouped-query attention
    q_rank: int = 0  # width of the query latent (q_lora_rank); 0 = queries projected from x directly
    nope_dim: int = 128  # per head, the query and key dims without RoPE (qk_nope_head_dim)
    rope_dim: int = 64  # per head, the rotated query dims, and the width of the rotated key (qk_rope_head_dim)
    v_dim: int = 128  # per head, the value dims (v_head_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3's MTP; llama.MTPLayer): `depth` more modules after the model, the k-th
    predicting the token k + 1 ahead of each position from the (k-1)-th's hidden state and the token k ahead's
    embedding, through one more transformer block and the shared output head. Training adds their cross-entropy,
    times loss_scale / depth, to the loss (metric mtp_loss: their mean; mtp_loss/k each one's where depth > 1);
    the held-out loss and export to a format without MTP layers use the main model only, and sampling drafts with
    the first module where asked (`sample --speculative`)."""

    depth: int = 0  # MTP modules (DeepSeek-V3's num_nextn_predict_layers: 1); 0 = off
    loss_scale: float = 0.3  # lambda: DeepSeek-V3's 0.3 for its first 10T tokens, 0.1 for the last 4.8T


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Sparse mixture-of-experts feed-forward (n_experts 0 = dense model). See moe.py."""

    n_experts: int = 0
    top_k: int = 2
    d_expert: int = 0  # hidden width of one routed expert; 0 = model.d_ff
    n_shared: int = 0  # DeepSeek-style always-on shared experts (each d_expert wide)
    every_n_layers: int = 1  # after n_dense_first: MoE in layers l with (l - n_dense_first + 1) % every_n_layers == 0
    n_dense_first: int = 0  # DeepSeek keeps its first layers dense
    score: Literal["softmax", "sigmoid"] = "softmax"
    # Group-limited routing (DeepSeek-V3's node-limited, V2's device-limited; moe.route): the experts form
    # route_groups equal groups of consecutive ids, each token picks route_top_groups of them and its top_k experts
    # inside those. With the expert axis over nodes and route_groups = its nodes, a token's rows cross to at most
    # route_top_groups nodes (model.moe.dispatch=hierarchical sends one row per node). 0 = off.
    route_groups: int = 0
    route_top_groups: int = 0
    # A group's score: the sum of its best route_group_top (biased) scores; 0 = max(1, top_k // route_top_groups)
    # (DeepSeek-V3's: 2 of 8 experts in 4 groups); 1 = its best expert's (DeepSeek-V2's group_limited_greedy).
    route_group_top: int = 0
    routed_scale: float = 1.0  # the routed experts' weights g times this (DeepSeek-V3's routed_scaling_factor, 2.5)
    normalize_top_k: bool = True
    aux_loss_coef: float = 0.01  # Switch/Mixtral load-balancing loss
    # "batch": over all the tokens of a micro-batch (Switch, Mixtral); "sequence": per sequence on scores normalized
    # to sum 1, averaged over the sequences (DeepSeek-V3's complementary sequence-wise loss). moe.py has both.
    aux_loss_scope: Literal["batch", "sequence"] = "batch"
    bias_update_rate: float = 0.0  # DeepSeek-V3 auxiliary-loss-free balancing (0 = off)
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE)
    capacity_factor: float = 0.0  # 0 = dropless
    dispatch: Literal["flat", "hierarchical"] = "flat"
    gpus_per_node: int = 8  # for hierarchical dispatch: the expert axis is (node, local)
    # Under expert parallelism the experts run on a compact buffer of this many times the rows a device receives on
    # average (tokens x top_k), where its rows fit; a device that receives more runs the worst-case buffer (slower;
    # no row is dropped; metric moe_ep_overflow_frac). 0 = always the worst case (dispatch.py: "Two expert buffers").
    ep_buffer_factor: float = 2.0
    # With that compact buffer, keep the experts' gate and up outputs for the backward, 2 x 2F bytes per row of it
    # and MoE layer (where model.remat keeps GEMM outputs: save_matmuls, none), instead of running those GEMMs again
    # there (dispatch.py: "Two expert buffers"). Without expert parallelism they are kept under save_matmuls anyway.
    ep_save_gate_up: bool = False
    # How a flat dispatch moves the rows (mx_jax/dispatch.py): "land" writes each row straight to its place in the
    # expert device's buffer sorted by expert and reads the outputs back from there (pallas_kernels/row_exchange.py);
    # "dense" pads each peer's chunk to the worst case; "ragged" is lax.ragged_all_to_all. "auto": land where its
    # NVLink kernel runs (one process holding the GPUs of the expert axis) on up to 4 of them (dispatch.LAND_MAX_PEERS:
    # the sizes verified on GPUs), else dense up to 8 peers, else ragged.
    exchange: Literal["auto", "dense", "ragged", "land"] = "auto"
    all_to_all: Literal["auto", "pallas", "xla"] = "auto"  # the NVLink kernels of the exchanges over the whole expert
    # axis (pallas_kernels/all_to_all.py, row_exchange.py) where they apply, or XLA's collectives (NCCL)
    impl: Literal["auto", "pallas", "xla", "reference"] = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 0  # 0 = d_model // n_heads
    # RMSNorm over each head's query and key before RoPE, with a learned (head_dim,) scale each per layer (Qwen3,
    # OLMo 2's per-head form): q_h <- q_h / rms(q_h) * s_q, k_h <- k_h / rms(k_h) * s_k (layers.Attention)
    qk_norm: bool = False
    attention_bias: bool = False  # learned biases on the query, key and value projections (Qwen2, Qwen2.5)
    d_ff: int = 768
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling = RopeScaling()
    norm_eps: float = 1e-5
    init_std: float = 0.02
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # The dtype in which the dense linears' weight gradients are summed across the devices that split the tokens
    # (quant._grad_w_dtype; TorchTitan's mixed_precision_reduce, float32 by default there too). bfloat16 halves the
    # reduce-scatters' bytes: the whole 8B at fsdp=4 on 4 x H200 ran 3.7% (bf16) and 3.7-4.6% (fp8_rowwise)
    # faster, and the 142M model's held-out loss after 1000 steps on 4 GPUs stayed within the run-to-run spread
    # (benchmarks/RESULTS.md, session 39). Each hop of a ring sum rounds to bf16, so the error grows with the number
    # of devices summed; measured on 4 only. The routed experts' gradients are summed in bf16 either way (train.py).
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "save_matmuls"] = "none"
    scan_layers: bool = True  # lax.scan over the stacked layers; false unrolls them (llama.py: when that wins)
    attention: Literal["auto", "cudnn", "xla"] = "auto"
    # "documents": a token attends only to the earlier tokens of its own document, documents ending with the
    # end-of-text token `eos_id` (Llama 3's training; TorchTitan's block_causal); "causal": to every earlier token of
    # its sequence. RoPE positions count from the sequence's start either way (layers.document_segments).
    attention_mask: Literal["causal", "documents"] = "causal"
    eos_id: int = -1  # the end-of-text token; -1 = the data's (meta.json's eos_id; NUL, 0, for bytes)
    # The documents of one sequence kept apart (M); from the M-th on they attend to each other (metric
    # doc_overflow_frac). Under context parallelism, of each chunk of T / (2 mesh.context) tokens, the block a
    # packed call runs. cuDNN's packed attention costs M: B M N T (8 K + 4) bytes of backward workspace (N heads,
    # K head dim: 8.7 GB at M = 32 for one 8B sequence of 8192) and ~22 us per unit of M per 8B layer (fwd+bwd).
    # 0 = from the data: the 99th percentile of documents per sequence (or chunk) over 1,024 training windows,
    # rounded up to a multiple of 8; train.py logs it (benchmarks/RESULTS.md, sessions 61-62).
    max_documents: int = 0
    mla: MLAConfig = MLAConfig()
    moe: MoEConfig = MoEConfig()
    mtp: MTPConfig = MTPConfig()

    @property
    def d_head(self) -> int:
        """The query and key head dim K (under model.mla: nope_dim + rope_dim)."""
        if self.mla.kv_rank:
            return self.mla.nope_dim + self.mla.rope_dim
        return self.head_dim or self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The dims of each head that RoPE rotates: all K, or model.mla.rope_dim."""
        return self.mla.rope_dim if self.mla.kv_rank else self.d_head

    @property
    def v_dim(self) -> int:
        """The value head dim: K, or model.mla.v_dim."""
        return self.mla.v_dim if self.mla.kv_rank else self.d_head

    @property
    def attention_dim(self) -> int:
        """The head dim attention runs at: the larger of K and the value dim (layers.attend_padded)."""
        return max(self.d_head, self.v_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh shape. One axis may be -1: it takes the devices the others leave."""

    data: int = 1  # replicated data parallel (across hosts in HSDP)
    fsdp: int = -1  # parameters, gradients and optimizer state sharded; batch split
    expert: int = 1  # MoE experts sharded; for the other weights one more fsdp axis (batch split, weights sharded)
    context: int = 1  # the sequence is split (2 zigzag chunks per shard); attention all-gathers K and V


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: Literal["embedded", "bin"] = "embedded"
    path: str = ""  # directory of token shards (source=bin), as written by `python -m mx_jax.data convert`
    mixture: tuple[str, ...] = ()  # source=bin from several directories: "WEIGHT:DIR" entries (data.Mixture)
    seq_len: int = 256
    batch_size: int = 32  # global sequences per optimizer step (all hosts, all microbatches)
    grad_accum_steps: int = 1
    eval_batches: int = 8
    prefetch: int = 2  # training batches built ahead of the loop in a background thread (data.Prefetch); 0 = none


# A bf16 moment m decays by m (1 - b) a step. Round to nearest keeps m unless that exceeds half of bf16's spacing at
# m, which is at most 2^-8 of m (8 significant bits): so 1 - b >= 2^-8 always moves it (optim.py).
BF16_MOMENT_MIN_STEP = 2.0 ** -8


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr_peak: float = 3e-3
    lr_final_ratio: float = 0.1  # the decay ends at lr_peak * lr_final_ratio
    warmup_steps: int = 50
    decay_steps: int = 0  # where the decay ends; 0 = the run's `steps`
    schedule: Literal["cosine", "wsd"] = "cosine"  # wsd: warmup, stable at lr_peak, then a 1-sqrt cooldown (optim.py)
    cooldown_fraction: float = 0.2  # wsd: the last fraction of decay_steps that cools down
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # not applied to norms and embeddings
    grad_clip_norm: float = 1.0  # 0 = off
    # AdamW's two moments, stored in this dtype (whatever model.param_dtype is) and updated in float32 (optim.py).
    # bfloat16 (as DeepSeek-V3) saves 4 of the 12 bytes of state per parameter and 8 of the 28 bytes the update
    # moves; it needs b1, b2 <= 0.996.
    moment_dtype: Literal["float32", "bfloat16"] = "float32"


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Low-precision recipe for the block linears. See quant.py for what each recipe does."""

    recipe: str = "bf16"
    # Which linears convert: any of attn (q/k/v/o), mlp (gate/up/down; model.mtp's eh_proj), experts (MoE), head
    # (the output head).
    modules: tuple[str, ...] = ("attn", "mlp", "experts")
    impl: Literal["auto", "pallas", "xla", "reference"] = "auto"
    # MoE: the routed experts run an fp8 recipe only where each of a device's experts gets at least this many rows
    # a step (token assignments / local experts) after discounting the row casts' share for the experts' dims:
    # rows x (1 - 565 (1/D + 1/F)) >= expert_min_rows (dispatch.expert_recipe); below it they run bf16, with a
    # warning. fp8 quantizes every expert weight each step (cost ~ parameters) and casts every row (cost ~ rows x
    # (D + F)) to save GEMM time (~ rows x D x F). Fit to whole train steps, fp8 experts against bf16 experts:
    # Mixtral (factor 0.82) breaks even near 1,100 rows per expert on an H100 and below 1,024 on an H200,
    # DeepSeekMoE-16B (factor 0.32) near 2,800 and 1,536 (benchmarks/RESULTS.md, sessions 27-28). 0 = always fp8.
    expert_min_rows: int = 700


@dataclasses.dataclass(frozen=True, kw_only=True)
class CkptConfig:
    every_steps: int = 200  # 0 = only at the end; -1 = never (benchmarks)
    keep: int = 3
    async_save: bool = True
    resume: str = "latest"  # "latest" (resume when the run dir has a checkpoint), "never", or a step number


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogConfig:
    every_steps: int = 10
    eval_every_steps: int = 100  # 0 = only at the end; -1 = never (benchmarks)
    peak_tflops: float = 0.0  # per device, for MFU; 0 = known value for the device kind (none on CPU)
    tensorboard: bool = True
    # A Weights & Biases project to log the same scalars to ("" = off; process 0, needs the wandb package). W&B reads
    # its own environment: WANDB_API_KEY, WANDB_ENTITY, WANDB_MODE=offline (the run under run_dir/wandb, for `wandb
    # sync` later). A resumed run continues the same W&B run (its id is kept in run_dir/wandb_id).
    wandb: str = ""
    # JSON-lines files of multiple-choice records, comma-separated, scored at every evaluation (choice_acc,
    # choice_acc_norm; mx_jax/choices.py); "" = none
    eval_choices: str = ""
    # Files of text (JSON lines, Parquet, plain text), comma-separated, whose loss is measured at every evaluation
    # (text_loss/<stem>, text_bpb/<stem>; mx_jax/perplexity.py); "" = none
    eval_texts: str = ""
    progress: bool = True
    profile_steps: int = 0  # > 0: trace this many steps with jax.profiler into run_dir/profile (mx_jax/profiling.py)
    profile_from: int = 10  # the first traced step (step 1 compiles)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    run_dir: str = ""  # "" = runs/<config file stem>
    steps: int = 600
    seed: int = 0
    # GPU runs repeat bit for bit (XLA's --xla_gpu_deterministic_ops; 0.87x tokens/s on the 2-layer Mixtral step)
    deterministic: bool = False
    init_from: str = ""  # start a fresh run from HF safetensors or an mx_jax checkpoint (see mx_jax/hf.py)
    # Compiled programs kept on disk for the next run of the same program (a resume, a restart): "auto" =
    # $JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/mx_jax/jax (~/.cache/mx_jax/jax); "" = off
    compile_cache: str = "auto"
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    quant: QuantConfig = QuantConfig()
    ckpt: CkptConfig = CkptConfig()
    log: LogConfig = LogConfig()


# ---------------------------------------------------------------------------------------------------------------
# Loading, overrides, validation.


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _hint(cls, name: str):
    return typing.get_type_hints(cls)[name]


def _unknown_key(path: str, key: str, cls) -> ConfigError:
    valid = list(_fields(cls))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    where = f"{path}.{key}" if path else key
    msg = f"unknown config key '{where}'"
    if close:
        msg += f"; did you mean '{(path + '.') if path else ''}{close[0]}'?"
    msg += f" (valid keys{' in ' + path if path else ''}: {', '.join(valid)})"
    return ConfigError(msg)


def _coerce(key: str, hint, value: Any) -> Any:
    """Convert a YAML or CLI value to the field's type, or raise an error naming the key."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"config key '{key}' must be one of {list(choices)}, got {value!r}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        return tuple(str(v) for v in value)
    try:
        if hint is bool:
            if isinstance(value, str):
                low = value.lower()
                if low in ("true", "1", "yes", "on"):
                    return True
                if low in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if isinstance(value, bool):
                return value
            raise ValueError
        if hint is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, str) and any(c in value for c in ".eE"):
                value = float(value)  # "1e3" is an int; "4.5" is not
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if hint is float:
            if isinstance(value, bool):
                raise ValueError
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"config key '{key}' must be a finite number, got {value}")
            return value
        if hint is str:
            if isinstance(value, bool):  # compile_cache: false would be a directory named "False"
                raise ConfigError(f"config key '{key}' expects a string, got {value!r} (YAML reads true/false, yes/no "
                                  f"and on/off as booleans: quote the word, or leave the value empty for none)")
            if isinstance(value, (list, dict)):
                raise ConfigError(f"config key '{key}' expects a string, got {value!r}")
            return "" if value is None else str(value)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        pass
    else:
        raise ConfigError(f"config key '{key}' has unsupported type {hint}")
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"config key '{key}' expects {name}, got {value!r}")


def _merge(cls, base, updates: dict, path: str = ""):
    """Return a copy of dataclass `base` with `updates` (a nested dict) applied, checking every key."""
    if not isinstance(updates, dict):
        raise ConfigError(f"config section '{path or '<root>'}' must be a mapping, got {updates!r}")
    fields = _fields(cls)
    changes = {}
    for key, value in updates.items():
        if key not in fields:
            raise _unknown_key(path, str(key), cls)
        hint = _hint(cls, key)
        full = f"{path}.{key}" if path else key
        if dataclasses.is_dataclass(hint):
            changes[key] = _merge(hint, getattr(base, key), value if value is not None else {}, full)
        else:
            changes[key] = _coerce(full, hint, value)
    return dataclasses.replace(base, **changes)


def _dotted_to_nested(overrides: list[str]) -> list[dict]:
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        if not key:
            raise ConfigError(f"override '{item}' has an empty key")
        # YAML gives lists and null; scalars stay strings and are coerced by the field's type.
        value: Any = raw
        if raw.startswith("[") or raw in ("null", "~"):
            value = yaml.safe_load(raw)
        nested: dict = {}
        cur = nested
        parts = key.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = value
        out.append(nested)
    return out


def read_json_object(path: pathlib.Path, error: type[Exception] = ConfigError) -> dict:
    """The JSON object in file `path`; anything else (bad JSON, not UTF-8, a list) raises `error` naming the file."""
    try:
        out = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path} is not valid JSON: {e}") from None
    if not isinstance(out, dict):
        raise error(f"{path} must hold a JSON object, got {type(out).__name__}")
    return out


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key repeated in one mapping is an error instead of last-one-wins (merge keys,
    `<<: *anchor`, still fill in the keys a mapping does not give)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # SafeConstructor merges these itself
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults < YAML file < dotted overrides; validated. `run_dir` defaults to runs/<yaml stem>."""
    cfg = TrainConfig()
    if path is not None:
        p = pathlib.Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            raw = yaml.load(p.read_text(encoding="utf-8"), Loader=_StrictLoader) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file '{path}' is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
        cfg = _merge(TrainConfig, cfg, raw)
    for nested in _dotted_to_nested(list(overrides)):
        cfg = _merge(TrainConfig, cfg, nested)
    if not cfg.run_dir:
        stem = pathlib.Path(path).stem if path else "default"
        cfg = dataclasses.replace(cfg, run_dir=str(pathlib.Path("runs") / stem))
    validate(cfg)
    return cfg


def to_dict(cfg) -> dict:
    def conv(v):
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        return v

    return conv(cfg)


def to_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


def mixture_entries(entries: tuple[str, ...]) -> list[tuple[float, str]]:
    """data.mixture's "WEIGHT:DIR" entries as (weight / sum of weights, DIR); ConfigError naming a bad entry."""
    out = []
    for e in entries:
        w, sep, path = e.partition(":")
        try:
            weight = float(w) if sep and path.strip() else math.nan
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"config key 'data.mixture': entry {e!r} is not 'WEIGHT:DIR' with a positive weight")
        out.append((weight, path.strip()))
    paths = [p for _, p in out]
    if len(set(paths)) < len(paths):
        raise ConfigError(f"config key 'data.mixture': a directory is listed twice ({paths})")
    total = sum(w for w, _ in out)
    return [(w / total, p) for w, p in out]


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks that need no devices. The mesh against the devices: sharding.make_mesh; the config against
    the resolved mesh: train.check_against_mesh."""
    m, d, o, c, lg = cfg.model, cfg.data, cfg.optim, cfg.ckpt, cfg.log
    _check(cfg.steps > 0, "steps", f"must be positive, got {cfg.steps}")
    _check(0 <= cfg.seed < 2**63, "seed", f"must be in [0, 2**63), got {cfg.seed}")  # numpy's and jax's generators
    _check(cfg.compile_cache.lower() not in ("false", "off", "no", "none", "0"), "compile_cache",
           f"is 'auto', a directory, or empty for no cache; got {cfg.compile_cache!r} (write compile_cache= to turn "
           f"it off)")
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
        _check(getattr(m, k) > 0, f"model.{k}", f"must be positive, got {getattr(m, k)}")
    _check(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
           f"must divide model.n_heads ({m.n_heads}), got {m.n_kv_heads}")
    a = m.mla
    # under model.mla the head dims are model.mla's, checked below: RoPE rotates rope_dim of them only
    _check(a.kv_rank > 0 or m.head_dim > 0 or m.d_model % m.n_heads == 0, "model.n_heads",
           f"must divide model.d_model ({m.d_model}) when model.head_dim is 0, got {m.n_heads}")
    _check(a.kv_rank > 0 or m.d_head % 2 == 0, "model.head_dim",
           f"the head dimension must be even for RoPE, got {m.d_head}")
    for k in ("kv_rank", "q_rank"):
        _check(getattr(a, k) >= 0, f"model.mla.{k}", f"must be >= 0 (0 = off), got {getattr(a, k)}")
    if a.kv_rank:
        for k in ("nope_dim", "rope_dim", "v_dim"):
            _check(getattr(a, k) > 0, f"model.mla.{k}", f"must be positive, got {getattr(a, k)}")
        _check(a.rope_dim % 2 == 0, "model.mla.rope_dim", f"must be even for RoPE, got {a.rope_dim}")
        _check(m.head_dim == 0, "model.head_dim",
               f"is set by model.mla (nope_dim + rope_dim) and must be 0 there, got {m.head_dim}")
        _check(m.n_kv_heads == m.n_heads, "model.n_kv_heads",
               f"must equal model.n_heads ({m.n_heads}) under model.mla (each head has its own key and value), "
               f"got {m.n_kv_heads}")
        for k in ("qk_norm", "attention_bias"):
            _check(not getattr(m, k), f"model.{k}", "is not supported with model.mla")
    else:
        _check(a.q_rank == 0, "model.mla.q_rank", f"needs model.mla.kv_rank > 0, got {a.q_rank}")
    rs = m.rope_scaling
    _check(rs.factor >= 1.0, "model.rope_scaling.factor", f"must be >= 1, got {rs.factor}")
    if rs.factor > 1.0 and rs.kind == "llama3":  # layers.rope_inv_freq divides by both
        _check(0 < rs.low_freq_factor < rs.high_freq_factor, "model.rope_scaling.low_freq_factor",
               f"must be positive and below model.rope_scaling.high_freq_factor ({rs.high_freq_factor}), got "
               f"{rs.low_freq_factor}")
    if rs.factor > 1.0 and rs.kind == "yarn":
        _check(0 < rs.beta_slow < rs.beta_fast, "model.rope_scaling.beta_slow",
               f"must be positive and below model.rope_scaling.beta_fast ({rs.beta_fast}), got {rs.beta_slow}")
        _check(rs.attention_factor >= 0, "model.rope_scaling.attention_factor",
               f"must be >= 0 (0 = 0.1 ln(factor) + 1), got {rs.attention_factor}")
    _check(rs.mscale_all_dim >= 0, "model.rope_scaling.mscale_all_dim", f"must be >= 0, got {rs.mscale_all_dim}")
    _check(not rs.mscale_all_dim or (a.kv_rank and rs.kind == "yarn"), "model.rope_scaling.mscale_all_dim",
           "applies to yarn scaling under model.mla only (it scales the latent attention's softmax)")
    if rs.factor > 1.0:
        _check(rs.original_max_len > 0, "model.rope_scaling.original_max_len",
               f"must be positive, got {rs.original_max_len}")
    _check(m.rope_theta > 0, "model.rope_theta", f"must be positive, got {m.rope_theta}")
    _check(m.head_dim >= 0, "model.head_dim", f"must be >= 0 (0 = d_model // n_heads), got {m.head_dim}")
    _check(m.norm_eps > 0, "model.norm_eps", f"must be positive, got {m.norm_eps}")
    _check(m.init_std > 0, "model.init_std", f"must be positive, got {m.init_std}")
    _check(m.max_documents >= 0, "model.max_documents", f"must be >= 0 (0 = from the data), got {m.max_documents}")
    _check(-1 <= m.eos_id < m.vocab_size, "model.eos_id",
           f"must be a token id below model.vocab_size ({m.vocab_size}), or -1 (the data's), got {m.eos_id}")
    _check(m.mtp.depth >= 0, "model.mtp.depth", f"must be >= 0 (0 = off), got {m.mtp.depth}")
    _check(m.mtp.loss_scale >= 0, "model.mtp.loss_scale", f"must be >= 0, got {m.mtp.loss_scale}")
    e = m.moe
    _check(e.n_experts >= 0, "model.moe.n_experts", f"must be >= 0 (0 = dense model), got {e.n_experts}")
    if e.n_experts:
        for k in ("d_expert", "n_shared"):
            _check(getattr(e, k) >= 0, f"model.moe.{k}", f"must be >= 0, got {getattr(e, k)}")
        _check(e.routed_scale > 0, "model.moe.routed_scale", f"must be positive, got {e.routed_scale}")
        for k in ("aux_loss_coef", "bias_update_rate", "z_loss_coef"):
            _check(getattr(e, k) >= 0, f"model.moe.{k}", f"must be >= 0, got {getattr(e, k)}")
        _check(1 <= e.top_k <= e.n_experts, "model.moe.top_k", f"must be in [1, n_experts={e.n_experts}], got {e.top_k}")
        _check(e.every_n_layers >= 1, "model.moe.every_n_layers", f"must be >= 1, got {e.every_n_layers}")
        _check(e.route_groups >= 0 and (e.route_groups == 0 or e.n_experts % e.route_groups == 0),
               "model.moe.route_groups", f"must be 0 (off) or divide n_experts={e.n_experts}, got {e.route_groups}")
        if e.route_groups:
            per = e.n_experts // e.route_groups
            _check(1 <= e.route_top_groups <= e.route_groups and e.top_k <= e.route_top_groups * per,
                   "model.moe.route_top_groups", f"must be in [1, route_groups={e.route_groups}] with top_k={e.top_k} "
                   f"experts in that many groups of {per}, got {e.route_top_groups}")
            _check(0 <= e.route_group_top <= per, "model.moe.route_group_top",
                   f"must be in [0, {per}] (0 = max(1, top_k // route_top_groups); a group holds {per} experts), got "
                   f"{e.route_group_top}")
        else:
            for k in ("route_top_groups", "route_group_top"):
                _check(getattr(e, k) == 0, f"model.moe.{k}",
                       f"needs model.moe.route_groups > 0 (group-limited routing), got {getattr(e, k)}")
        _check(0 <= e.n_dense_first < m.n_layers, "model.moe.n_dense_first",
               f"must be in [0, n_layers={m.n_layers}), got {e.n_dense_first}")
        _check((m.n_layers - e.n_dense_first) % e.every_n_layers == 0, "model.moe.every_n_layers",
               f"must divide the {m.n_layers - e.n_dense_first} layers after model.moe.n_dense_first")
        _check(e.gpus_per_node >= 1, "model.moe.gpus_per_node", f"must be >= 1, got {e.gpus_per_node}")
        _check(not (e.exchange == "land" and e.dispatch == "hierarchical"), "model.moe.exchange",
               "'land' is for model.moe.dispatch=flat (the hierarchical stages exchange dense or ragged)")
        _check(e.capacity_factor == 0 or e.capacity_factor >= 1, "model.moe.capacity_factor",
               f"must be 0 (dropless) or >= 1, got {e.capacity_factor}")
        _check(e.ep_buffer_factor == 0 or e.ep_buffer_factor >= 1, "model.moe.ep_buffer_factor",
               f"must be 0 (always the worst-case buffer) or >= 1, got {e.ep_buffer_factor}")
        _check(not e.ep_save_gate_up or e.ep_buffer_factor > 0, "model.moe.ep_save_gate_up",
               "saves the compact expert buffer's outputs: it needs model.moe.ep_buffer_factor > 0")
    _check(d.seq_len > 0, "data.seq_len", f"must be positive, got {d.seq_len}")
    _check(m.mtp.depth < d.seq_len, "model.mtp.depth",
           f"must be below data.seq_len ({d.seq_len}): the module of depth k predicts k + 1 tokens ahead, got "
           f"{m.mtp.depth}")
    _check(d.batch_size > 0, "data.batch_size", f"must be positive, got {d.batch_size}")
    _check(d.grad_accum_steps > 0 and d.batch_size % d.grad_accum_steps == 0, "data.grad_accum_steps",
           f"must divide data.batch_size ({d.batch_size}), got {d.grad_accum_steps}")
    _check(d.eval_batches >= 1, "data.eval_batches", f"must be >= 1, got {d.eval_batches}")
    _check(d.prefetch >= 0, "data.prefetch", f"must be >= 0 (0 builds each batch in the loop), got {d.prefetch}")
    _check(d.source != "bin" or bool(d.path) or bool(d.mixture), "data.path",
           "must name a token-shard directory when data.source=bin (or set data.mixture)")
    if d.mixture:
        _check(d.source == "bin", "data.mixture", "needs data.source=bin (a mixture of token-shard directories)")
        _check(not d.path, "data.mixture", f"data.path={d.path!r} is set too: use one of them")
        _check(len(d.mixture) >= 2, "data.mixture", f"needs two or more 'WEIGHT:DIR' entries, got {list(d.mixture)} "
               f"(one directory: data.path)")
        mixture_entries(d.mixture)
    _check(o.lr_peak > 0, "optim.lr_peak", f"must be positive, got {o.lr_peak}")
    _check(0 <= o.lr_final_ratio <= 1, "optim.lr_final_ratio", f"must be in [0, 1], got {o.lr_final_ratio}")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _check(0 <= o.b1 < 1 and 0 <= o.b2 < 1, "optim.b1", "b1 and b2 must be in [0, 1)")
    _check(o.decay_steps >= 0, "optim.decay_steps", f"must be >= 0 (0 = the run's steps), got {o.decay_steps}")
    _check(0 < o.cooldown_fraction <= 1, "optim.cooldown_fraction", f"must be in (0, 1], got {o.cooldown_fraction}")
    _check(o.eps > 0, "optim.eps", f"must be positive, got {o.eps}")
    _check(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _check(o.grad_clip_norm >= 0, "optim.grad_clip_norm", f"must be >= 0, got {o.grad_clip_norm}")
    if o.moment_dtype == "bfloat16":
        for key, b in (("optim.b1", o.b1), ("optim.b2", o.b2)):
            _check(1 - b >= BF16_MOMENT_MIN_STEP, key,
                   f"{b} with optim.moment_dtype=bfloat16: a step moves the moment by at most 1 - {key[-2:]} = "
                   f"{100 * (1 - b):.2g}% of itself, under half of bf16's rounding step (up to 0.39%), so the stored "
                   f"moment could stop decaying; use {key} <= {1 - BF16_MOMENT_MIN_STEP:.4f} or "
                   f"optim.moment_dtype=float32")
    _check(c.every_steps >= -1, "ckpt.every_steps", f"must be >= -1, got {c.every_steps}")
    _check(c.keep >= 1, "ckpt.keep", f"must be >= 1, got {c.keep}")
    _check(c.resume in ("latest", "never") or c.resume.isdigit(), "ckpt.resume",
           f"must be 'latest', 'never' or a step number, got {c.resume!r}")
    _check(lg.every_steps > 0, "log.every_steps", f"must be positive, got {lg.every_steps}")
    _check(lg.eval_every_steps >= -1, "log.eval_every_steps", f"must be >= -1, got {lg.eval_every_steps}")
    _check(lg.peak_tflops >= 0, "log.peak_tflops", f"must be >= 0 (0 = known value for the device), got "
           f"{lg.peak_tflops}")
    _check(lg.profile_steps >= 0, "log.profile_steps", f"must be >= 0 (0 = no trace), got {lg.profile_steps}")
    _check(lg.profile_from >= 1, "log.profile_from", f"must be >= 1 (a step number), got {lg.profile_from}")
    for k in ("data", "fsdp", "expert", "context"):
        v = getattr(cfg.mesh, k)
        _check(v == -1 or v >= 1, f"mesh.{k}", f"must be -1 or >= 1, got {v}")
    _check([getattr(cfg.mesh, k) for k in ("data", "fsdp", "expert", "context")].count(-1) <= 1, "mesh",
           "at most one axis may be -1")
    _check(cfg.mesh.expert == 1 or e.n_experts > 0, "mesh.expert", "needs a MoE model (model.moe.n_experts > 0)")
    from mx_jax.quant import RECIPES  # the recipe table lives with the recipes

    _check(cfg.quant.recipe in RECIPES, "quant.recipe", f"must be one of {list(RECIPES)}, got {cfg.quant.recipe!r}")
    allowed = {"attn", "mlp", "experts", "head"}
    bad = [x for x in cfg.quant.modules if x not in allowed]
    _check(not bad, "quant.modules", f"unknown module kind(s) {bad}; choose from {sorted(allowed)}")
    _check(isinstance(cfg.quant.expert_min_rows, int) and cfg.quant.expert_min_rows >= 0, "quant.expert_min_rows",
           f"must be an integer >= 0, got {cfg.quant.expert_min_rows!r}")
