"""`python -m mx_jax.sample RUN_DIR`: text from a checkpoint, the look at a model during or after a run.

    python -m mx_jax.sample runs/llama3_debug --prompt "def " --tokens 200 --temperature 0.8 --top-k 40
    python -m mx_jax.sample runs/8b --step 2000 --num 4 quant.recipe=bf16     # key=value: the run's config, changed

The model is the run's (`RUN_DIR/config.yaml`, or `--config`), built on one device with `quant.recipe=bf16` unless
an override says otherwise (the fp8 recipes speed up training's large GEMMs; here they would add kernel compiles to
a few small forwards); the parameters and MoE router biases are read from the checkpoint (the latest, or `--step`)
without the optimizer state. The tokenizer is the
data's: bytes for `data.source=embedded`, else what `data.path/meta.json` names (bytes or a HF tokenizer.json);
`--tokenizer` overrides it.

Decoding keeps no KV cache. Each new token runs the model over one fixed window of W positions (the prompt plus
`--tokens`, rounded up to a multiple of 128), right-padded with token 0: attention is causal, so the logits at
position t depend on tokens 0..t only and the padding never reaches them, and one compiled forward serves every
step. A token costs one forward over W positions, which is fine for reading a model's output and wasteful for
serving (export with `python -m mx_jax.hf export` and use an inference engine for that). Two settings let the
padding in: a capacity factor (`model.moe.capacity_factor` > 0; padding rows compete for expert capacity like real
ones; dropless MoE, the default, is exact) and `quant.recipe=fp8_tensorwise` (padding rows enter the per-tensor
scales; the default bf16 and the rowwise recipes scale each row alone).

Sampling, per sequence: logits over the tokenizer's vocabulary (ids the model has beyond it are never drawn),
divided by the temperature, restricted to the top k, then drawn; temperature 0 is greedy (argmax). A sample ends at
the data's end-of-text token (meta.json's eos_id, NUL for the embedded corpus), shown as "[end of text]", and drawing
stops once every sample has ended; `--no-stop` draws all `--tokens`.

`--chat` asks a model fine-tuned on chat examples: the prompt is one user message (after `--system`, if given),
rendered with the chat template the data was converted with (meta.json's chat_template; `--chat-template` overrides
it) and its generation prompt, and the sample is the reply the model writes after it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mx_jax import checkpoint, data, sharding, train
from mx_jax.config import ConfigError, TrainConfig, load_config, mixture_entries
from mx_jax.llama import compute_copies, with_compute

WINDOW_MULTIPLE = 128


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
        tok = HFTokenizer.from_file(str(path))
        self.vocab_size = tok.get_vocab_size()
        self.encode = lambda s: tok.encode(s, add_special_tokens=False).ids
        self.decode = lambda ids: tok.decode(ids)


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


def load_model_state(cfg: TrainConfig, setup: train.Setup, path: pathlib.Path, step: int | None) -> tuple[dict, dict]:
    """(params with the GEMM weights in the compute dtype, MoE buffers) of a checkpoint, placed per `setup`."""
    import orbax.checkpoint as ocp

    from mx_jax.hf import state_dir

    sdir = state_dir(path, step)
    wanted = {"params": setup.abstract["params"], "buffers": setup.abstract["buffers"]}
    shardings = {"params": setup.state_shardings["params"], "buffers": setup.state_shardings["buffers"]}
    wanted = {k: v for k, v in wanted.items() if jax.tree.leaves(v)}  # a dense model has no buffers
    on_disk = ocp.PyTreeCheckpointHandler().metadata(sdir)
    on_disk = getattr(on_disk, "tree", on_disk)
    saved = checkpoint.array_shapes({k: on_disk.get(k, {}) for k in wanted})
    bad = checkpoint.shape_mismatches(saved, checkpoint.array_shapes(wanted))
    if bad:
        raise ConfigError(f"the checkpoint {sdir} does not fit this model ({len(bad)} array(s) differ: "
                          f"{'; '.join(bad[:4])}{'; ...' if len(bad) > 4 else ''}); a key=value override or --config "
                          f"changed the model section of the run's config")
    item = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), wanted,
                        {k: shardings[k] for k in wanted})
    with ocp.PyTreeCheckpointer() as ckpt:
        out = ckpt.restore(sdir, args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
    cast = jax.jit(lambda p: with_compute(p, compute_copies(cfg.model, p)))
    return cast(out["params"]), out.get("buffers", {})


def make_step(setup: train.Setup, vocab_limit: int, temperature: float, top_k: int):
    """step(params, buffers, tokens (B, W), pos, key) -> tokens with position `pos` drawn from the logits at pos-1."""
    graphdef = setup.graphdef

    def step(params, buffers, tokens, pos, key):
        logits, _ = nnx.merge(graphdef, params, buffers)(tokens, logits_dtype=jnp.float32)
        last = jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=1, keepdims=False)  # (B, V)
        last = jnp.where(jnp.arange(last.shape[-1]) < vocab_limit, last, -jnp.inf)
        if temperature == 0:
            nxt = jnp.argmax(last, axis=-1)
        else:
            last = last / temperature
            if top_k and top_k < vocab_limit:
                kth = jax.lax.top_k(last, top_k)[0][:, -1:]
                last = jnp.where(last < kth, -jnp.inf, last)
            nxt = jax.random.categorical(key, last, axis=-1)
        return jax.lax.dynamic_update_index_in_dim(tokens, nxt.astype(tokens.dtype), pos, axis=1)

    return jax.jit(step, donate_argnums=2)


def generate(setup: train.Setup, params: dict, buffers: dict, prompt: list[int], n_tokens: int, *, num: int = 1,
             temperature: float = 0.8, top_k: int = 0, seed: int = 0, vocab_limit: int | None = None,
             window: int | None = None, times: list[float] | None = None, stop_id: int | None = None) -> np.ndarray:
    """(num, len(prompt) + n_tokens) token ids: the prompt, then n_tokens drawn one at a time (the wall time of
    each draw appended to `times`, the first one with the compile); with `stop_id`, fewer once every row has drawn
    it."""
    if not prompt:
        raise ConfigError("--prompt: an empty prompt has no last token to continue from")
    total = len(prompt) + n_tokens
    window = window or -(-total // WINDOW_MULTIPLE) * WINDOW_MULTIPLE
    step = make_step(setup, vocab_limit or setup.cfg.model.vocab_size, temperature, top_k)
    tokens = np.zeros((num, window), np.int32)
    tokens[:, :len(prompt)] = prompt
    tokens = jnp.asarray(tokens)
    key = jax.random.key(seed)
    ended = np.zeros(num, bool)
    for pos in range(len(prompt), total):
        t0 = time.perf_counter()
        tokens = step(params, buffers, tokens, pos, jax.random.fold_in(key, pos))
        if times is not None:
            tokens.block_until_ready()
            times.append(time.perf_counter() - t0)
        if stop_id is not None:
            ended |= np.asarray(tokens[:, pos]) == stop_id
            if ended.all():
                total = pos + 1
                break
    return np.asarray(tokens)[:, :total]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mx_jax.sample", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="the run directory (or a checkpoints / step directory inside it)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ap.add_argument("--config", help="the run's YAML (default: RUN_DIR/config.yaml)")
    ap.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens to draw per sample")
    ap.add_argument("--num", type=int, default=1, help="samples, drawn as one batch")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="draw from the k likeliest tokens only (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", help="'byte' or a HF tokenizer.json (default: the run's data)")
    ap.add_argument("--no-stop", action="store_true", help="draw all --tokens, past the data's end-of-text token")
    ap.add_argument("--chat", action="store_true", help="--prompt is a user message, rendered with the data's chat "
                    "template; the sample is the model's reply")
    ap.add_argument("--chat-template", help="with --chat: 'chatml', a template file or a tokenizer_config.json "
                    "(default: the one the data was converted with)")
    ap.add_argument("--system", help="with --chat: a system message before the prompt")
    ap.add_argument("overrides", nargs="*", help="key=value changes to the run's config, e.g. quant.recipe=bf16")
    args = ap.parse_intermixed_args(argv)  # key=value overrides may follow the options
    train.apply_default_xla_flags()
    try:
        path = pathlib.Path(args.run_dir).absolute()
        if not path.exists():
            raise ConfigError(f"{path} does not exist (a run directory, or a checkpoint directory inside one)")
        # the run directory: this one or the nearest above it (from a checkpoints / step / state directory)
        run_dir = next((p for p in (path, *path.parents) if (p / "config.yaml").is_file() and
                        (p / "checkpoints").is_dir()), path)
        cfg_file = pathlib.Path(args.config) if args.config else run_dir / "config.yaml"
        if not cfg_file.is_file():
            raise ConfigError(f"{cfg_file} does not exist: pass the run directory, or --config with the run's YAML")
        for flag, value, low in (("--tokens", args.tokens, 1), ("--num", args.num, 1), ("--top-k", args.top_k, 0)):
            if value < low:
                raise ConfigError(f"{flag}: must be >= {low}, got {value}")
        if not args.temperature >= 0:
            raise ConfigError(f"--temperature: must be >= 0, got {args.temperature}")
        # bf16 unless asked: the fp8 recipes speed up training GEMMs, here they would only add kernel compiles
        one_device = ["mesh.data=1", "mesh.fsdp=1", "mesh.expert=1", "mesh.context=1"]
        cfg = load_config(str(cfg_file), ["quant.recipe=bf16", *args.overrides, *one_device])
        tok = Tokenizer(args.tokenizer or tokenizer_of(cfg))
        text = args.prompt
        if args.chat:
            spec = args.chat_template or chat_template_of(cfg)
            if spec is None:
                raise ConfigError("--chat: the run's data has no chat template (meta.json chat_template: it was not "
                                  "converted from chat messages); pass --chat-template")
            template = data.ChatTemplate(spec, tok.spec, "--chat")
            system = [{"role": "system", "content": args.system}] if args.system else []
            text = template.render([*system, {"role": "user", "content": args.prompt}], True, "--chat")
        elif args.system or args.chat_template:
            raise ConfigError("--system and --chat-template go with --chat")
        prompt = tok.encode(text)
        if max(prompt, default=0) >= cfg.model.vocab_size:
            raise ConfigError(f"--prompt: token id {max(prompt)} is outside the model's vocabulary "
                              f"(model.vocab_size={cfg.model.vocab_size}); is --tokenizer the run's?")
        mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
        with jax.set_mesh(mesh):
            setup = train.build(cfg, mesh)
            params, buffers = load_model_state(cfg, setup, path, args.step)
            total = len(prompt) + args.tokens
            if total > cfg.data.seq_len:
                print(f"note: {total} positions exceed the run's data.seq_len={cfg.data.seq_len}; the model never "
                      f"trained on positions that far", file=sys.stderr)
            times: list[float] = []
            stop_id = None if args.no_stop else eos_of_run(cfg)
            out = generate(setup, params, buffers, prompt, args.tokens, num=args.num,
                           temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                           vocab_limit=min(tok.vocab_size, cfg.model.vocab_size), times=times, stop_id=stop_id)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, ids in enumerate(out):
        ids = [int(t) for t in ids]
        end = next((j for j in range(len(prompt), len(ids)) if ids[j] == stop_id), None)
        print(f"----- sample {i}")
        print(tok.decode(ids[:end]) + ("\n[end of text]" if end is not None else ""))
    window = -(-total // WINDOW_MULTIPLE) * WINDOW_MULTIPLE
    rest = f", then {(len(times) - 1) / sum(times[1:]):.1f} draws/s over a {window}-position window" \
        if len(times) > 1 else ""
    print(f"----- {args.num} x {len(times)} tokens, {tok.spec} tokenizer, quant.recipe={cfg.quant.recipe}: first draw "
          f"{times[0]:.1f} s (compile included){rest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
