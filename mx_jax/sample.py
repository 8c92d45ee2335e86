"""`python -m mx_jax.sample RUN_DIR`: text from a checkpoint, the look at a model during or after a run.

    python -m mx_jax.sample runs/llama3_debug --prompt "def " --tokens 200 --temperature 0.8 --top-k 40
    python -m mx_jax.sample runs/8b --step 2000 --num 4 quant.recipe=bf16     # key=value: the run's config, changed

The model is the run's (`RUN_DIR/config.yaml`, or `--config`), built on one device with `quant.recipe=bf16` unless
an override says otherwise (the fp8 recipes speed up training's large GEMMs; here they would add kernel compiles to
a few small forwards); the parameters and MoE router biases are read from the checkpoint (the latest, or `--step`)
without the optimizer state. The tokenizer is the
data's: bytes for `data.source=embedded`, else what `data.path/meta.json` names (bytes or a HF tokenizer.json);
`--tokenizer` overrides it.

Decoding keeps a KV cache (`llama.Llama.decode`). The prompts of a batch are left-padded to a common length P
(rounded up to a multiple of 128) and run through the model once, which writes every layer's keys and values into a
cache of S = P + `--tokens` positions (rounded up likewise); from then on each new token runs the model over itself
alone and attends to the cache. A row's tokens see the cache from the row's first position on, and a RoPE score
depends only on the distance between two positions, so a padded row draws what it would alone (tests/test_sample.py
checks the logits against full forwards). A token costs one read of the weights and of the cache instead of a
forward over the whole sequence: H200 figures in benchmarks/RESULTS.md (session 63; MoE models, whose experts a
step reads by index, `moe.MoE.decode`: sessions 64-65; one token's products as 8-row GEMMs, `quant._few_rows`:
session 65). One compiled prefill serves
each (batch, P), one compiled step each (batch, S). `--devices N` splits a model over N local devices, each
weight along its heads, hidden or vocabulary dimension (`tensor_parallel`; a MoE model's routed experts along their
hidden width, `moe.hidden_split`), for a model one device cannot hold (a 70B in bf16, Mixtral 8x7B on 80 GB GPUs);
its tokens are one device's (tests/test_sample.py, on CPU devices; not yet timed on GPUs). Out of device memory,
the sampler stops with exit code 5, quoting XLA's allocation and naming --devices. For
serving, export with `python -m mx_jax.hf export` and use an inference engine: this decoder has no continuous
batching. Two settings let the padding in: a capacity factor (`model.moe.capacity_factor` > 0; padding rows compete
for expert capacity like real ones; dropless MoE, the default, is exact) and `quant.recipe=fp8_tensorwise` (the
batch's rows share the per-tensor scales; the default bf16 and the rowwise recipes scale each row alone).

`--speculative` (a model with multi-token prediction modules, model.mtp: DeepSeek-V3's, or one trained with them)
decodes with drafts: the first MTP module proposes the token after next from the model's hidden states, and each
step runs the model over a row's last token and that draft, keeps the draft with speculative sampling's probability
(`speculative_choice`: where it is the model's argmax, greedily) and then a token after it as well: up to two tokens
for one step of the model over two positions (`Decoder._run_speculative`; the rows of a batch advance apart, each at
its own cache positions). The tokens are distributed as plain sampling's at the same temperature and top-k, and at
temperature 0 they are plain greedy decoding's (tests/test_mtp.py), for --prompt, --num and --prompts alike, on one
device or split over --devices (the MTP module's weights and cache split like a layer's). The 142M byte-level model
trained 1,000 steps with model.mtp.depth=1 drew 1,024 greedy tokens on an H200 at 704 tokens/s against 447 (96% of
its drafts kept on its repetitive greedy text), and at temperature 0.8 906 against 548 (89% kept;
benchmarks/RESULTS.md, session 72).

Sampling, per sequence: logits over the tokenizer's vocabulary (ids the model has beyond it are never drawn),
divided by the temperature, restricted to the top k, then drawn; temperature 0 is greedy (argmax). A sample ends at
the data's end-of-text token (meta.json's eos_id, NUL for the embedded corpus), shown as "[end of text]", and drawing
stops once every sample has ended; `--no-stop` draws all `--tokens`.

`--chat` asks a model fine-tuned on chat examples: the prompt is one user message (after `--system`, if given),
rendered with the chat template the data was converted with (meta.json's chat_template; `--chat-template` overrides
it) and its generation prompt, and the sample is the reply the model writes after it.

`--prompts FILE` answers every record of a JSON-lines or Parquet file in `data convert`'s formats: "prompt" (with
its "completion" as the reference), chat "messages" (a last assistant message is the reference and the rest the
prompt, rendered as the converter rendered it: the template's pieces tokenized one by one, then the generation
prompt), or plain text (`--text-key`). They run `--batch` rows at a time, longest first, and `--out` (default:
standard output; written whole, then renamed into place) gets one JSON line per sample in the file's order:
{"index", "prompt", "output", "ended", "reference", "exact"}, exact meaning the output is the reference followed by
the end-of-text token, as the example was trained. A held-out set of a fine-tune's examples gives its exact-answer
rate that way:

    python -m mx_jax.sample runs/sft --prompts held_out.jsonl --out answers.jsonl --temperature 0 --tokens 256

`--choices FILE` samples nothing: it prints the checkpoint's accuracy on a file of multiple-choice records, scored by
log-likelihood (mx_jax/choices.py), `--batch` records at a time, each context run once into a KV cache and every
choice against it (`choices.CachedScorer`); `--out` gets one JSON line per record, {"file", "line", "answer",
"scores", "chars", "choice", "choice_norm", "right", "right_norm"}, to look at which records a checkpoint gets
wrong:

    python -m mx_jax.sample runs/llama3_1b --choices hellaswag_val.jsonl,arc_easy.jsonl --out choices.jsonl

`--loss FILE[,FILE]` samples nothing either: it prints the checkpoint's loss (nats per token), perplexity and bits per
byte on each file of text (JSON lines or Parquet under `--text-key`, or a plain text file; prompt / completion records
score the completion, chat records the replies), long documents in windows of data.seq_len tokens `--stride` apart
(mx_jax/perplexity.py); `--out` gets each document's.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mx_jax import checkpoint, choices, data, moe, perplexity, sharding, train
from mx_jax.config import ConfigError, TrainConfig, load_config, mixture_entries
from mx_jax.llama import compute_copies, init_cache, with_compute

WINDOW_MULTIPLE = 128  # prompts are left-padded, and caches sized, to multiples of this
STOP_CHECK = 8  # tokens drawn between looks at whether every row has ended (each look waits for the GPU)


class Tokenizer:
    """encode(str) -> ids, decode(ids) -> str, and the vocabulary size."""

    def __init__(self, spec: str):
        self.spec = spec
        if spec == "byte":
            self.vocab_size = 256
            self.encode: Callable[[str], list[int]] = lambda s: list(s.encode("utf-8"))
            self.decode: Callable[[list[int]], str] = lambda ids: bytes(ids).decode("utf-8", errors="replace")
            return
        path = pathlib.Path(spec)
        if not path.is_file():
            raise ConfigError(f"tokenizer {spec!r} is neither 'byte' nor an existing tokenizer.json (--tokenizer)")
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ConfigError(f"the tokenizer {path} needs the `tokenizers` package (pip install tokenizers)")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a JSON file of another kind
            raise ConfigError(f"tokenizer {path}: not a tokenizers tokenizer.json ({e}) (--tokenizer)") from None
        self.vocab_size = tok.get_vocab_size()
        self.encode = lambda s: tok.encode(s, add_special_tokens=False).ids
        # Special tokens kept, as encode reads them: a chat reply ends with its end-of-turn token (Llama 3's
        # <|eot_id|>, ChatML's <|im_end|>), which the reference of an exact answer holds too.
        self.decode = lambda ids: tok.decode(ids, skip_special_tokens=False)


def tokenizer_of(cfg: TrainConfig) -> str:
    """The tokenizer the run's data was written with: 'byte' or a tokenizer.json path."""
    if cfg.data.source == "embedded":
        return "byte"
    first = mixture_entries(cfg.data.mixture)[0][1] if cfg.data.mixture else cfg.data.path  # sources share it
    meta = pathlib.Path(first) / "meta.json"
    try:
        return json.loads(meta.read_text()).get("tokenizer", "byte")
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the tokenizer from {meta} ({e}); pass --tokenizer byte|tokenizer.json")


def eos_of_run(cfg: TrainConfig) -> int | None:
    """The token that ends the run's documents (None where its data does not say)."""
    if cfg.data.source == "embedded":
        return data.SEPARATOR
    first = mixture_entries(cfg.data.mixture)[0][1] if cfg.data.mixture else cfg.data.path
    try:
        return data.eos_of(json.loads((pathlib.Path(first) / "meta.json").read_text()))
    except (OSError, ValueError):
        return None


def chat_template_of(cfg: TrainConfig) -> str | None:
    """The chat template the run's fine-tuning examples were rendered with (meta.json's chat_template), if any."""
    if cfg.data.source == "embedded":
        return None
    paths = [p for _, p in mixture_entries(cfg.data.mixture)] if cfg.data.mixture else [cfg.data.path]
    for p in paths:
        try:
            spec = json.loads((pathlib.Path(p) / "meta.json").read_text()).get("chat_template")
        except (OSError, ValueError):
            continue
        if spec:
            return spec
    return None


def load_model_state(cfg: TrainConfig, setup: train.Setup, path: pathlib.Path, step: int | None,
                     shardings: tuple | None = None) -> tuple[dict, dict]:
    """(params with the GEMM weights and the embedding in the compute dtype, MoE buffers) of a checkpoint, placed
    per `setup` or, given, the (params', buffers') `shardings` (`tensor_parallel`). Orbax casts the float32 masters
    of the GEMM weights to the compute dtype as it reads them, so a device holds 2 bytes per weight, never the 4 of
    the masters (Mixtral 8x7B: 93 GB in bf16 against 187 GB in float32), with the train step's rounding
    (`compute_copies`). The embedding too: its lookup casts each row to the compute dtype, the same values."""
    import orbax.checkpoint as ocp

    from mx_jax.hf import reading_step, state_dir

    sdir = state_dir(path, step)
    wanted = {"params": setup.abstract["params"], "buffers": setup.abstract["buffers"]}
    shardings = ({"params": setup.state_shardings["params"], "buffers": setup.state_shardings["buffers"]}
                 if shardings is None else dict(zip(("params", "buffers"), shardings)))
    wanted = {k: v for k, v in wanted.items() if jax.tree.leaves(v)}  # a dense model has no buffers
    with reading_step(sdir):
        on_disk = ocp.PyTreeCheckpointHandler().metadata(sdir)
    on_disk = getattr(on_disk, "tree", on_disk)
    fresh = {}
    if "buffers" in wanted and "buffers" not in on_disk:  # parameters alone (an `hf import` made before imports kept
        # the router biases): the biases a run starts with
        fresh = jax.tree.map(lambda s, sh: jax.device_put(jnp.zeros(s.shape, s.dtype), sh), wanted.pop("buffers"),
                             shardings["buffers"])
    saved = checkpoint.array_shapes({k: on_disk.get(k, {}) for k in wanted})
    bad = checkpoint.shape_mismatches(saved, checkpoint.array_shapes(wanted))
    if bad:
        raise ConfigError(f"the checkpoint {sdir} does not fit this model ({len(bad)} array(s) differ: "
                          f"{'; '.join(bad[:4])}{'; ...' if len(bad) > 4 else ''}); a key=value override or --config "
                          f"changed the model section of the run's config")
    # what the decoder reads: each GEMM weight and the embedding in the compute dtype (the lookup casts its rows to
    # it: the same values), the rest (norms, router) as stored
    wanted["params"] = jax.eval_shape(lambda p: with_compute(p, compute_copies(cfg.model, p)), wanted["params"])
    wanted["params"]["embed"] = jax.ShapeDtypeStruct(wanted["params"]["embed"].shape, cfg.model.compute_dtype)
    item = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), wanted,
                        {k: shardings[k] for k in wanted})
    with reading_step(sdir), ocp.PyTreeCheckpointer() as ckpt:
        out = ckpt.restore(sdir, args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
    return out["params"], out.get("buffers", fresh)


LOSS_TOKENS = 32768  # --loss's default windows per forward: this many tokens' worth (the logits are B x T x V)
TENSOR_SPLIT = ("q_heads", "kv_heads", "mlp", "expert_mlp", "vocab")  # the weight dimensions --devices splits


class Split(NamedTuple):
    """`tensor_parallel`'s layout: the params', buffers' and KV cache's shardings, and their one-axis mesh."""
    params: Any
    buffers: Any
    cache: Any
    mesh: jax.sharding.Mesh


def tensor_parallel(setup: train.Setup, devices: list) -> Split:
    """The layout that splits a model over `devices` for decoding: each weight along its first dimension named in
    TENSOR_SPLIT that the devices divide (W_q, W_k, W_v, W_gate, W_up by output column, W_o and W_down by input
    row, the routed experts' likewise along their hidden width, the head by vocabulary), the cache by key/value head
    (latent attention's cache of latents whole); the embedding, norms, routers and router biases whole on each. (Split by vocabulary, the embedding's one-row
    lookups made XLA all-gather the table every step on the GPU: 3.6 of the 8B's 11.3 ms per token on 2 H200s,
    benchmarks/RESULTS.md, session 67.) XLA's partitioner makes of the dense layers Megatron's layout: each device
    attends with its own heads and runs its own part of the hidden layer, then one all-reduce sums the attention
    output's and one the down projection's partial sums. The routed experts run so in shard_map, inside
    `moe.hidden_split(Split.mesh)`, which the decoding must be traced in. A device holds 1/n of the weights and reads
    1/n of them per token."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mx_jax.llama import Llama, param_axes

    n = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("tensor",))
    cfg = setup.cfg.model
    width = cfg.moe.d_expert or cfg.d_ff
    if cfg.moe.n_experts and width % n:
        raise ConfigError(f"--devices: {n} devices do not divide the experts' hidden width {width} "
                          f"(model.moe.d_expert, or model.d_ff where it is 0)")
    axes = param_axes(nnx.eval_shape(lambda: Llama(cfg, setup.cfg.quant, rngs=nnx.Rngs(0))))

    def split(shape, names):
        if tuple(names) == ("vocab", "embed"):  # read a row per token: whole on each device (in the compute dtype)
            return NamedSharding(mesh, P())
        at = next((i for i, (a, d) in enumerate(zip(names, shape)) if a in TENSOR_SPLIT and d % n == 0), None)
        return NamedSharding(mesh, P(*("tensor" if i == at else None for i in range(len(shape)))))

    params = jax.tree.map(lambda v, a: split(v.shape, a), setup.abstract["params"], axes)
    buffers = jax.tree.map(lambda v: NamedSharding(mesh, P()), setup.abstract["buffers"])
    heads = "tensor" if cfg.n_kv_heads % n == 0 and not cfg.mla.kv_rank else None  # latents: one for all heads
    cache = jax.tree.map(lambda c: NamedSharding(mesh, P(*([None] * (c.ndim - 2)), heads, None)),
                         jax.eval_shape(lambda: init_cache(cfg, 1, 1, mtp=cfg.mtp.depth > 0)))
    return Split(params, buffers, cache, mesh)


def _scaled(logits: jax.Array, vocab_limit: int, temperature: float, top_k: int) -> jax.Array:
    """(B, V) float32 logits with the ids >= vocab_limit at -inf and, at temperature > 0, divided by it and
    restricted to the top_k likeliest (0: all)."""
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    if temperature == 0:
        return logits
    logits = logits / temperature
    if top_k and top_k < vocab_limit:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return logits


def _draw(logits: jax.Array, key: jax.Array, vocab_limit: int, temperature: float, top_k: int) -> jax.Array:
    """(B, V) float32 logits -> (B,) int32 tokens: ids < vocab_limit only, greedy at temperature 0, else a draw
    from softmax(logits / temperature) over the top_k likeliest (0: all)."""
    logits = _scaled(logits, vocab_limit, temperature, top_k)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _probs(logits: jax.Array, vocab_limit: int, temperature: float, top_k: int) -> jax.Array:
    """(B, V) float32 logits -> (B, V) the distribution `_draw` draws from: one-hot on the argmax at temperature 0,
    else the softmax of `_scaled`'s logits."""
    logits = _scaled(logits, vocab_limit, temperature, top_k)
    if temperature == 0:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(logits, axis=-1)


def _sample(key: jax.Array, p: jax.Array) -> jax.Array:
    """(B,) int32 ids drawn from the rows of p (B, V); a one-hot row gives its id."""
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)


def speculative_choice(key: jax.Array, p: jax.Array, q: jax.Array, d: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling's verification (Leviathan et al. 2023; Chen et al. 2023): the model's distribution p
    (B, V) at a position, the draft d (B,) drawn from q (B, V) -> (the token kept there, whether it is d). d is kept
    with probability min(1, p(d) / q(d)); otherwise a token is drawn from max(p - q, 0), normalized. The kept token
    is then distributed as p whatever q is:

        P(v) = q(v) min(1, p(v) / q(v)) + (1 - sum_u min(q(u), p(u))) (p(v) - q(v))+ / sum_u (p(u) - q(u))+ = p(v)

    since min(q, p) + (p - q)+ = p and sum_u (p(u) - q(u))+ = 1 - sum_u min(q(u), p(u)). With one-hot p and q
    (temperature 0) d is kept where it is p's argmax, else that argmax is taken: greedy decoding."""
    rows = jnp.arange(d.shape[0])
    u = jax.random.uniform(jax.random.fold_in(key, 0), d.shape)
    accept = u * q[rows, d] < p[rows, d]  # u < p(d) / q(d), without dividing by q(d)
    rest = jnp.maximum(p - q, 0.0)
    rest = jnp.where(jnp.sum(rest, axis=-1, keepdims=True) > 0, rest, p)  # p = q: nothing left (never drawn then)
    return jnp.where(accept, d, _sample(jax.random.fold_in(key, 1), rest)), accept


class Decoder:
    """A checkpoint's model decoding batches of prompts with a KV cache (module docstring). One compiled step
    serves every token of every batch of the same shape."""

    def __init__(self, setup: train.Setup, params: dict, buffers: dict, *, vocab_limit: int | None = None,
                 temperature: float = 0.8, top_k: int = 0, cache_sharding=None, speculative: bool = False):
        """cache_sharding: the KV cache's (`tensor_parallel`); None: where jax puts it (one device). speculative:
        `run` drafts with the model's first multi-token prediction module (`_run_speculative`; model.mtp)."""
        if speculative and not setup.cfg.model.mtp.depth:
            raise ConfigError("speculative decoding drafts with the model's multi-token prediction module, and this "
                              "model has none (model.mtp.depth=0)")
        self.setup, self.params, self.buffers = setup, params, buffers
        cfg = setup.cfg.model
        limit = vocab_limit or cfg.vocab_size

        def advance(params, buffers, tokens, cache, index, first, key, step):
            logits, cache = nnx.merge(setup.graphdef, params, buffers).decode(tokens, cache, index, first)
            return _draw(logits, jax.random.fold_in(key, step), limit, temperature, top_k), cache

        self._advance = jax.jit(advance, donate_argnums=3)

        # the cache with the first MTP module's (speculative decoding) or without it, as cache_sharding lays it out
        caches = {mtp: jax.jit(functools.partial(init_cache, cfg, dtype=jnp.dtype(cfg.compute_dtype), mtp=mtp),
                               static_argnums=(0, 1), out_shardings=cache_sharding and {
                                   k: v for k, v in cache_sharding.items() if mtp or k != "mtp"})
                  for mtp in (False, True)}
        self._cache = lambda batch, length, mtp=False: caches[mtp](batch, length)

        def dist(logits):  # (B, V) -> the distribution a token is drawn from (`_probs`)
            return _probs(logits.astype(jnp.float32), limit, temperature, top_k)

        def draft_prefill(params, buffers, tokens, cache, first, key):
            model = nnx.merge(setup.graphdef, params, buffers)
            h, cache = model.decode_hidden(tokens, cache, jnp.int32(0), first)
            keys = jax.random.split(key, 2)
            y = _sample(keys[0], dist(model.head_logits(h[:, -1])))  # (B,): the first token drawn
            g, cache = model.decode_mtp(jnp.concatenate([tokens[:, 1:], y[:, None]], axis=1), h, cache, jnp.int32(0),
                                        first)
            q = dist(model.head_logits(g[:, -1]))
            return y, _sample(keys[1], q), q, cache

        def draft_step(params, buffers, x, d, q, cache, index, count, n_tokens, first, key, step):
            model = nnx.merge(setup.graphdef, params, buffers)
            h, cache = model.decode_hidden(jnp.stack([x, d], axis=1), cache, index, first)
            z = model.head_logits(h)  # (B, 2, V): after x, and after the draft d
            keys = jax.random.split(jax.random.fold_in(key, step), 3)
            t, accept = speculative_choice(keys[0], dist(z[:, 0]), q, d)
            y = jnp.stack([t, _sample(keys[1], dist(z[:, 1]))], axis=1)  # (B, 2): the second kept with the draft
            g, cache = model.decode_mtp(y, h, cache, index, first)
            pick = accept.astype(jnp.int32)
            q_next = dist(jnp.take_along_axis(model.head_logits(g), pick[:, None, None], 1)[:, 0])  # the next draft's
            live = count < n_tokens  # a row with its tokens stays where it is
            advance = jnp.where(live, 1 + pick, 0)
            return (y, advance, jnp.where(live, jnp.take_along_axis(y, pick[:, None], 1)[:, 0], x),
                    jnp.where(live, _sample(keys[2], q_next), d), jnp.where(live[:, None], q_next, q), cache,
                    index + advance, count + advance)

        self._draft_prefill = jax.jit(draft_prefill, donate_argnums=3)
        self._draft_step = jax.jit(draft_step, donate_argnums=5)
        self.speculative = speculative

    def run(self, prompts: list[list[int]], n_tokens: int, *, seed: int = 0, stop_id: int | None = None,
            stats: dict | None = None) -> np.ndarray:
        """(B, n) int32: the tokens drawn after each prompt, n = n_tokens, or fewer once every row has drawn
        `stop_id` (checked every STOP_CHECK tokens; a row's tokens after its stop_id are whatever it drew).
        `stats` gets wall seconds: "prefill_s" (the first token's, with the prefill's compile where its shape is
        new), "first_step_s" (the second token's, with the step's compile) and "decode_s" (the rest, "steps"
        tokens)."""
        if self.speculative:
            return self._run_speculative(prompts, n_tokens, seed=seed, stop_id=stop_id, stats=stats)
        b = len(prompts)
        tokens, first, width = _left_padded(prompts)
        length = -(-(width + n_tokens) // WINDOW_MULTIPLE) * WINDOW_MULTIPLE
        key = jax.random.key(seed)
        t0 = time.perf_counter()
        nxt, cache = self._advance(self.params, self.buffers, jnp.asarray(tokens), self._cache(b, length, False),
                                   np.int32(0), first, key, np.int32(0))
        drawn = [nxt]
        nxt.block_until_ready()
        t1 = t2 = time.perf_counter()
        ended = np.zeros(b, bool)
        for i in range(1, n_tokens):
            if stop_id is not None and i % STOP_CHECK == 0:
                # gathered on the host: a jnp.stack would compile a program of its own mid-loop
                ended |= (np.stack(jax.device_get(drawn[-STOP_CHECK:]), axis=1) == stop_id).any(axis=1)
                if ended.all():
                    break
            nxt, cache = self._advance(self.params, self.buffers, nxt[:, None], cache, np.int32(width + i - 1),
                                       first, key, np.int32(i))
            drawn.append(nxt)
            if i == 1:  # the step's compile, where this shape is new, is not a step's time
                nxt.block_until_ready()
                t2 = time.perf_counter()
        out = np.stack(jax.device_get(drawn), axis=1)  # (a jnp.stack of n arrays compiles anew for each n)
        if stats is not None:
            stats.update(prefill_s=t1 - t0, first_step_s=t2 - t1, decode_s=time.perf_counter() - t2,
                         steps=max(len(drawn) - 2, 0))
        return _cut_at_stop(out, stop_id)


    def _run_speculative(self, prompts: list[list[int]], n_tokens: int, *, seed: int = 0,
                         stop_id: int | None = None, stats: dict | None = None) -> np.ndarray:
        """`run` with drafts from the model's first multi-token prediction module (model.mtp; DeepSeek-V3's
        speculative decoding), verified by the model: a step runs the model over each row's last token x and its
        draft d (positions p, p + 1) and keeps a token at p + 1 by `speculative_choice`: d, with the probability
        that keeps the model's distribution, and then also a token drawn after d (two tokens for one step), else one
        drawn from what the draft left out; the MTP module then drafts the next one from the model's hidden states
        and the tokens kept (a rejected draft's keys and values are overwritten at the next step). The rows advance
        apart, each at its own cache positions, and stop advancing at n_tokens. The tokens are distributed as the
        model's at this temperature and top-k, whatever the drafts; at temperature 0 they are its greedy tokens, up
        to ties the different GEMM shapes may break otherwise. `stats` as `run`'s, with "proposals" (drafts made for
        rows still drawing), "accepted" (those kept) and "tokens" (drawn by the steps)."""
        b = len(prompts)
        tokens, first, width = _left_padded(prompts)
        # a step writes two positions; a row stops advancing at n_tokens
        length = -(-(width + n_tokens + 2) // WINDOW_MULTIPLE) * WINDOW_MULTIPLE
        t0 = time.perf_counter()
        key = jax.random.key(seed)
        x, d, q, cache = self._draft_prefill(self.params, self.buffers, jnp.asarray(tokens),
                                             self._cache(b, length, True), first, key)
        kept = [[int(t)] for t in jax.device_get(x)]
        t1 = t2 = time.perf_counter()
        index, count = jnp.full((b,), width, jnp.int32), jnp.ones((b,), jnp.int32)
        pending, n_steps, accepted, proposals = [], 0, 0, 0

        def done(row: list[int]) -> bool:
            return len(row) >= n_tokens or (stop_id is not None and stop_id in row)

        while not all(map(done, kept)):
            y, advance, x, d, q, cache, index, count = self._draft_step(
                self.params, self.buffers, x, d, q, cache, index, count, np.int32(n_tokens), first, key,
                np.int32(n_steps))
            pending.append((y, advance))
            n_steps += 1
            if n_steps == 1:  # the step's compile, where this shape is new, is not a step's time
                x.block_until_ready()
                t2 = time.perf_counter()
            if len(pending) == STOP_CHECK or min(map(len, kept)) + 2 * len(pending) >= n_tokens:
                for y, adv in jax.device_get(pending):
                    for row, ys, a in zip(kept, y, adv):
                        row += ys[:a].tolist()
                        accepted, proposals = accepted + int(a == 2), proposals + int(a > 0)
                pending = []
        width_out = min(n_tokens, max(map(len, kept)))
        fill = stop_id if stop_id is not None else 0  # after a row's stop_id: whatever (as `run`'s rows)
        out = np.asarray([row[:width_out] + [fill] * (width_out - len(row)) for row in kept], np.int32)
        if stats is not None:
            stats.update(prefill_s=t1 - t0, first_step_s=t2 - t1, decode_s=time.perf_counter() - t2,
                         steps=max(n_steps - 1, 0), proposals=proposals, accepted=accepted,
                         tokens=sum(map(len, kept)) - b)
        return _cut_at_stop(out, stop_id)


def _left_padded(prompts: list[list[int]]) -> tuple[np.ndarray, jax.Array, int]:
    """(tokens (B, P) with each prompt at the end of its row, first (B,): where each starts, P): P is the longest
    prompt rounded up to a multiple of WINDOW_MULTIPLE."""
    if any(not p for p in prompts):
        raise ConfigError("an empty prompt has no last token to continue from")
    width = -(-max(map(len, prompts)) // WINDOW_MULTIPLE) * WINDOW_MULTIPLE
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = p
    return tokens, jnp.asarray([width - len(p) for p in prompts], jnp.int32), width


def _cut_at_stop(out: np.ndarray, stop_id: int | None) -> np.ndarray:
    """`out` (B, n) cut after the last row's stop_id, where every row has drawn it."""
    if stop_id is not None:
        hit = out == stop_id
        if hit.any(axis=1).all():
            out = out[:, :int(hit.argmax(axis=1).max()) + 1]
    return out


def generate(setup: train.Setup, params: dict, buffers: dict, prompt: list[int], n_tokens: int, *, num: int = 1,
             temperature: float = 0.8, top_k: int = 0, seed: int = 0, vocab_limit: int | None = None,
             stats: dict | None = None, stop_id: int | None = None) -> np.ndarray:
    """(num, len(prompt) + n) token ids: the prompt, then n = n_tokens drawn one at a time, or fewer once every row
    has drawn `stop_id` (Decoder.run). Each call builds and compiles a Decoder: to answer many prompts, keep one."""
    if not prompt:
        raise ConfigError("--prompt: an empty prompt has no last token to continue from")
    drawn = Decoder(setup, params, buffers, vocab_limit=vocab_limit, temperature=temperature, top_k=top_k).run(
        [prompt] * num, n_tokens, seed=seed, stop_id=stop_id, stats=stats)
    return np.concatenate([np.tile(np.asarray(prompt, np.int32), (num, 1)), drawn], axis=1)


class Prompt(NamedTuple):
    """One prompt of a --prompts file: its text pieces, each tokenized on its own as the converter tokenized the
    segments of a fine-tuning example (data.ChatTemplate.segments), and the reply it was given there, if any."""

    index: int
    pieces: list[str]
    reference: str | None


def read_prompts(path: pathlib.Path, template_spec: str | None, tokenizer: str, text_key: str) -> list[Prompt]:
    """The prompts of a JSON-lines or Parquet file of `data convert`'s records: a "prompt" (its "completion" the
    reference), chat "messages" (a last assistant message is the reference and not shown; the rest is rendered by
    the chat template up to its generation prompt) or plain text under `text_key`."""
    template = None
    out = []
    for i, rec, _ in data.read_records(path, text_key):
        where = f"{path}:{i + 1}" if i is not None else str(path)
        if isinstance(rec, bytes):  # read_records' whole file of another kind: one document, not records
            raise ConfigError(f"--prompts: {path} is not a file of records (.jsonl, .ndjson, .json or .parquet, "
                              f"optionally compressed); one text file is one prompt: --prompt \"$(cat {path})\"")
        if isinstance(rec, str):
            out.append(Prompt(len(out), [rec], None))
        elif isinstance(rec, tuple):
            out.append(Prompt(len(out), [rec[0]], rec[1]))
        else:
            if template is None:
                if template_spec is None:
                    raise ConfigError(f"{where}: a chat record needs a chat template, and the run's data has none "
                                      f"(meta.json chat_template); pass --chat-template")
                template = data.ChatTemplate(template_spec, tokenizer, "--chat-template")
            msgs, tools = rec["messages"], rec["tools"]
            reference = None
            if msgs and msgs[-1]["role"] == "assistant":
                segs = template.segments(msgs, where, tools)
                last = max(j for j, (_, trained) in enumerate(segs) if trained)
                pieces, reference = [t for t, _ in segs[:last]], segs[last][0]
            else:  # the replies before, then the context up to the generation prompt, as one piece
                segs = template.segments(msgs, where, tools)
                pieces = [t for t, _ in segs[:-1]] if segs and not segs[-1][1] else [t for t, _ in segs]
                pieces.append(template.render(msgs, True, where, tools)[sum(map(len, pieces)):])
            if not msgs or not "".join(pieces):
                raise ConfigError(f"{where}: no prompt before the reply")
            out.append(Prompt(len(out), pieces, reference))
    if not out:
        raise ConfigError(f"--prompts: {path} holds no records")
    return out


def answer_prompts(decoder: Decoder, tok: Tokenizer, prompts: list[Prompt], n_tokens: int, *, num: int, batch: int,
                   seed: int, stop_id: int | None, vocab_size: int, progress: bool = True) -> list[dict]:
    """One JSON-ready record per prompt and sample, in the file's order: {"index", "sample" (with num > 1),
    "prompt", "output", "ended" (drew `stop_id`, the end-of-text token), "reference", "exact" (output is the
    reference and ended, as the example was trained; not without a stop_id)}. Batches of `batch` rows, longest
    prompts first; the last batch is filled with copies of its last row, so every batch has one shape."""
    ids = []
    for p in prompts:
        ids.append([t for piece in p.pieces for t in tok.encode(piece)])
        if not ids[-1]:
            raise ConfigError(f"--prompts: prompt {p.index + 1} is empty (no last token to continue from)")
        if max(ids[-1]) >= vocab_size:
            raise ConfigError(f"--prompts: prompt {p.index + 1}: token id {max(ids[-1])} is outside the model's "
                              f"vocabulary (model.vocab_size={vocab_size}); is --tokenizer the run's?")
    longest = max(map(len, ids)) + n_tokens
    if longest > decoder.setup.cfg.data.seq_len:
        print(f"note: up to {longest} positions, past the run's data.seq_len={decoder.setup.cfg.data.seq_len}; the "
              f"model never trained on positions that far", file=sys.stderr)
    rows = sorted(((-len(ids[p.index]), p.index, j) for p in prompts for j in range(num)))
    results: dict[tuple[int, int], dict] = {}
    t0, drawn = time.perf_counter(), 0
    for start in range(0, len(rows), batch):
        part = [(i, j) for _, i, j in rows[start:start + batch]]
        filled = part + [part[-1]] * (batch - len(part))
        out = decoder.run([ids[i] for i, _ in filled], n_tokens, seed=seed + start, stop_id=stop_id)
        for (i, j), row in zip(part, out):
            row = [int(t) for t in row]
            end = row.index(stop_id) if stop_id in row else None
            drawn += len(row) if end is None else end + 1
            rec = {"index": i, **({"sample": j} if num > 1 else {}), "prompt": "".join(prompts[i].pieces),
                   "output": tok.decode(row[:end]), "ended": end is not None}
            if prompts[i].reference is not None:
                rec["reference"] = prompts[i].reference
                if stop_id is not None:  # the reference and then the end of text, as the example was trained
                    rec["exact"] = rec["ended"] and rec["output"] == rec["reference"]
            results[i, j] = rec
        if progress:
            done = min(start + batch, len(rows))
            print(f"sample: {done}/{len(rows)} rows, {drawn:,} tokens drawn, "
                  f"{drawn / (time.perf_counter() - t0):,.0f} tokens/s", file=sys.stderr)
    return [results[k] for k in sorted(results)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mx_jax.sample", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="the run directory (or a checkpoints / step directory inside it)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ap.add_argument("--config", help="the run's YAML (default: RUN_DIR/config.yaml)")
    ap.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    ap.add_argument("--prompts", help="a JSON-lines or Parquet file of prompts (data convert's records): one JSON "
                    "line per sample to --out")
    ap.add_argument("--choices", help="JSON-lines files of multiple-choice records, comma-separated "
                    "(mx_jax/choices.py): print the model's accuracy on each instead of sampling")
    ap.add_argument("--loss", help="files of text, comma-separated (mx_jax/perplexity.py): print the model's loss, "
                    "perplexity and bits per byte on each instead of sampling")
    ap.add_argument("--stride", type=int, default=0, help="with --loss: tokens between the starts of a long "
                    "document's windows (default: data.seq_len, disjoint windows)")
    ap.add_argument("--out", help="with --prompts: the JSON-lines file to write (default: standard output); with "
                    "--choices: each record's scores and choice (choices.per_record); with --loss: each document's "
                    "loss (perplexity.per_document)")
    ap.add_argument("--batch", type=int, default=None,
                    help="with --prompts: rows decoded together (default 16); with --choices: records scored "
                    "together (16); with --loss: windows per forward (default: 32768 tokens' worth)")
    ap.add_argument("--text-key", default="text", help="with --prompts or --loss: the field of plain text")
    ap.add_argument("--devices", type=int, default=1, help="split the model over this many local devices (each "
                    "weight along its heads, hidden or vocabulary dimension; MoE experts along their hidden width)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens to draw per sample")
    ap.add_argument("--num", type=int, default=1, help="samples per prompt, drawn in one batch")
    ap.add_argument("--speculative", action="store_true", help="draft with the model's multi-token prediction "
                    "module (model.mtp) and verify with the model: up to two tokens a step")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="draw from the k likeliest tokens only (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", help="'byte' or a HF tokenizer.json (default: the run's data)")
    ap.add_argument("--no-stop", action="store_true", help="draw all --tokens, past the data's end-of-text token")
    ap.add_argument("--chat", action="store_true", help="--prompt is a user message, rendered with the data's chat "
                    "template; the sample is the model's reply")
    ap.add_argument("--chat-template", help="with --chat, --prompts or --loss: 'chatml', a template file or a "
                    "tokenizer_config.json (default: the one the data was converted with)")
    ap.add_argument("--system", help="with --chat: a system message before the prompt")
    ap.add_argument("overrides", nargs="*", help="key=value changes to the run's config, e.g. quant.recipe=bf16")
    args = ap.parse_intermixed_args(argv)  # key=value overrides may follow the options
    train.apply_default_xla_flags()
    try:
        loss_batch = args.batch  # --loss's default depends on data.seq_len (below)
        args.batch = 16 if args.batch is None else args.batch
        path = pathlib.Path(args.run_dir).absolute()
        if not path.exists():
            raise ConfigError(f"{path} does not exist (a run directory, or a checkpoint directory inside one)")
        # the run directory: this one or the nearest above it (from a checkpoints / step / state directory)
        run_dir = next((p for p in (path, *path.parents) if (p / "config.yaml").is_file() and
                        (p / "checkpoints").is_dir()), path)
        cfg_file = pathlib.Path(args.config) if args.config else run_dir / "config.yaml"
        if not cfg_file.is_file():
            raise ConfigError(f"{cfg_file} does not exist: pass the run directory, or --config with the run's YAML")
        for flag, value, low in (("--tokens", args.tokens, 1), ("--num", args.num, 1), ("--top-k", args.top_k, 0),
                                 ("--batch", args.batch, 1)):
            if value < low:
                raise ConfigError(f"{flag}: must be >= {low}, got {value}")
        if not args.temperature >= 0:
            raise ConfigError(f"--temperature: must be >= 0, got {args.temperature}")
        if args.speculative:
            for flag, bad in (("--choices", args.choices is not None), ("--loss", args.loss is not None)):
                if bad:
                    raise ConfigError(f"--speculative draws samples; it does not go with {flag}")
        if args.choices is not None and (args.prompts is not None or args.prompt is not None or args.chat):
            raise ConfigError("--choices scores a file of choices; it does not go with --prompt, --prompts or --chat")
        if args.loss is not None and (args.choices is not None or args.prompts is not None or args.prompt is not None
                                      or args.chat):
            raise ConfigError("--loss scores files of text; it does not go with --choices, --prompt, --prompts or "
                              "--chat")
        if args.stride and args.loss is None:
            raise ConfigError("--stride goes with --loss")
        if args.prompts is not None:
            for flag, given in (("--prompt", args.prompt is not None), ("--chat", args.chat),
                                ("--system", args.system is not None)):
                if given:
                    raise ConfigError(f"{flag} does not go with --prompts (a file's chat records hold their messages)")
            if not pathlib.Path(args.prompts).is_file():
                raise ConfigError(f"--prompts: {args.prompts} is not a file")
        elif args.out is not None and args.choices is None and args.loss is None:
            raise ConfigError("--out goes with --prompts, --choices or --loss")
        if args.out is not None and not pathlib.Path(args.out).absolute().parent.is_dir():
            raise ConfigError(f"--out: the directory {pathlib.Path(args.out).absolute().parent} does not exist")
        if args.out is not None and pathlib.Path(args.out).is_dir():
            raise ConfigError(f"--out: {args.out} is a directory; give the file to write")
        # bf16 unless asked: the fp8 recipes speed up training GEMMs, here they would only add kernel compiles
        one_device = ["mesh.data=1", "mesh.fsdp=1", "mesh.expert=1", "mesh.context=1"]
        cfg = load_config(str(cfg_file), ["quant.recipe=bf16", *args.overrides, *one_device])
        tok = Tokenizer(args.tokenizer or tokenizer_of(cfg))
        stop_id = None if args.no_stop else eos_of_run(cfg)
        vocab_limit = min(tok.vocab_size, cfg.model.vocab_size)
        if args.choices is not None:
            sets = choices.load_files(args.choices, tok.encode, cfg.model.vocab_size, cfg.data.seq_len, args.batch)
        elif args.loss is not None:
            args.batch = max(1, LOSS_TOKENS // cfg.data.seq_len) if loss_batch is None else loss_batch
            texts = [perplexity.load(f, tok.encode, cfg.model.vocab_size, cfg.data.seq_len, eos_id=eos_of_run(cfg),
                                     stride=args.stride, batch=args.batch, text_key=args.text_key,
                                     chat_template=args.chat_template or chat_template_of(cfg), tokenizer=tok.spec)
                     for f in (f.strip() for f in args.loss.split(",")) if f]
            if not texts:
                raise ConfigError(f"--loss: {args.loss!r} names no file")
        elif args.prompts is not None:
            prompts = read_prompts(pathlib.Path(args.prompts), args.chat_template or chat_template_of(cfg), tok.spec,
                                   args.text_key)
        else:
            text = "\n" if args.prompt is None else args.prompt
            if args.chat:
                spec = args.chat_template or chat_template_of(cfg)
                if spec is None:
                    raise ConfigError("--chat: the run's data has no chat template (meta.json chat_template: it was "
                                      "not converted from chat messages); pass --chat-template")
                template = data.ChatTemplate(spec, tok.spec, "--chat")
                system = [{"role": "system", "content": args.system}] if args.system else []
                text = template.render([*system, {"role": "user", "content": text}], True, "--chat")
            elif args.system or args.chat_template:
                raise ConfigError("--system and --chat-template go with --chat or --prompts")
            prompt = tok.encode(text)
            if not prompt:
                raise ConfigError("--prompt: an empty prompt has no last token to continue from")
            if max(prompt, default=0) >= cfg.model.vocab_size:
                raise ConfigError(f"--prompt: token id {max(prompt)} is outside the model's vocabulary "
                                  f"(model.vocab_size={cfg.model.vocab_size}); is --tokenizer the run's?")
        if not 1 <= args.devices <= jax.local_device_count():
            raise ConfigError(f"--devices: {args.devices}, but this process has {jax.local_device_count()}")
        if args.speculative and not cfg.model.mtp.depth:  # before the checkpoint is read
            raise ConfigError("--speculative drafts with the model's multi-token prediction module, and this run's "
                              "model has none (model.mtp.depth=0)")
        mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
        with jax.set_mesh(mesh):
            setup = train.build(cfg, mesh)
        split = tensor_parallel(setup, jax.local_devices()[:args.devices]) if args.devices > 1 else None
        # one device: under its mesh, as training runs; several: no mesh set, the arrays' shardings lead, and the
        # routed experts split in shard_map
        with jax.set_mesh(mesh) if split is None else moe.hidden_split(split.mesh):
            params, buffers = load_model_state(cfg, setup, path, args.step, split and (split.params, split.buffers))
            decoder = Decoder(setup, params, buffers, vocab_limit=vocab_limit, temperature=args.temperature,
                              top_k=args.top_k, cache_sharding=split and split.cache, speculative=args.speculative)
            if args.choices is not None:
                scorer = choices.CachedScorer(setup.graphdef, cfg.model, split and split.cache)
                records = []
                for cs in sets:
                    t0 = time.perf_counter()
                    scores = scorer.score(params, buffers, cs, args.batch)
                    acc = choices.accuracy(cs, scores)
                    records += choices.per_record(cs, scores)
                    print(f"{cs.path}: {cs.records} records, accuracy {100 * acc['choice_acc']:.2f}% (per "
                          f"character: {100 * acc['choice_acc_norm']:.2f}%), {cs.rows} choices scored in "
                          f"{time.perf_counter() - t0:.1f} s")
                if args.out is not None:
                    _write_lines(records, args.out)
                    print(f"sample: {len(records)} records' scores -> {args.out}", file=sys.stderr)
                return 0
            if args.loss is not None:
                step = choices.make_step(setup.graphdef, cfg.model.compute_dtype)
                records = []
                for ts in texts:
                    t0 = time.perf_counter()
                    scores = choices.score(step, params, buffers, ts, args.batch)
                    got = perplexity.summary(ts, scores)
                    records += perplexity.per_document(ts, scores)
                    print(f"{ts.path}: {got['documents']} documents, {got['tokens']:,} tokens: loss {got['loss']:.4f} "
                          f"nats per token, perplexity {got['perplexity']:.3f}, {got['bits_per_byte']:.4f} bits per "
                          f"byte ({ts.rows} windows of up to {cfg.data.seq_len} tokens in "
                          f"{time.perf_counter() - t0:.1f} s)")
                if args.out is not None:
                    _write_lines(records, args.out)
                    print(f"sample: {len(records)} documents' losses -> {args.out}", file=sys.stderr)
                return 0
            if args.prompts is not None:
                t0 = time.perf_counter()
                records = answer_prompts(decoder, tok, prompts, args.tokens, num=args.num, batch=args.batch,
                                         seed=args.seed, stop_id=stop_id, vocab_size=cfg.model.vocab_size)
                seconds = time.perf_counter() - t0
            else:
                total = len(prompt) + args.tokens
                if total > cfg.data.seq_len:
                    print(f"note: {total} positions exceed the run's data.seq_len={cfg.data.seq_len}; the model "
                          f"never trained on positions that far", file=sys.stderr)
                stats: dict = {}
                out = decoder.run([prompt] * args.num, args.tokens, seed=args.seed, stop_id=stop_id, stats=stats)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # the record reader's and the chat template's errors name the file and line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except checkpoint.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    except jax.errors.JaxRuntimeError as e:
        if (what := train.out_of_memory(str(e))) is None:
            raise
        print(f"error: {what} Less memory per device: --devices N splits the model over N of this process's "
              f"{jax.local_device_count()} devices (this run: {args.devices}); fewer rows (--num, --batch) or "
              f"positions (prompt and --tokens) shrink the KV cache.", file=sys.stderr)
        return 5
    if args.prompts is not None:
        return _write_answers(records, args.out, seconds)
    for i, ids in enumerate(out):
        ids = [int(t) for t in ids]
        end = ids.index(stop_id) if stop_id in ids else None
        print(f"----- sample {i}")
        print(tok.decode(prompt + ids[:end]) + ("\n[end of text]" if end is not None else ""))
    rest = (f", then {stats['steps'] / stats['decode_s']:.1f} draws/s" if stats["steps"] else "")
    if args.speculative and stats["steps"]:
        per_step, rate = stats["tokens"] / stats["proposals"], stats["steps"] / stats["decode_s"]
        rest = (f", then {rate:.1f} steps/s of {per_step:.2f} tokens a row each (drafts kept: {stats['accepted']} of "
                f"{stats['proposals']}), {per_step * rate:.1f} tokens/s a row")
    where = f", split over {args.devices} devices" if args.devices > 1 else ""
    print(f"----- {args.num} x {out.shape[1]} tokens, {tok.spec} tokenizer, quant.recipe={cfg.quant.recipe}{where}: "
          f"prompt of {len(prompt)} tokens and first two draws {stats['prefill_s'] + stats['first_step_s']:.1f} s "
          f"(compiles included){rest}",
          file=sys.stderr)
    return 0


def _write_lines(records: list[dict], out: str | None) -> None:
    """The records as JSON lines to `out` (written beside it, then renamed: a file that exists is whole) or
    stdout."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if out is None:
        sys.stdout.write(text)
    else:
        train._write_atomic(pathlib.Path(out), text)


def _write_answers(records: list[dict], out: str | None, seconds: float) -> int:
    """`_write_lines`, and a summary on stderr: exact answers where the records have references."""
    _write_lines(records, out)
    refs = [r for r in records if "exact" in r]
    exact = f"; exact answers {sum(r['exact'] for r in refs)}/{len(refs)}" if refs else ""
    print(f"sample: {len(records)} samples in {seconds:.1f} s{exact}{f' -> {out}' if out else ''}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
