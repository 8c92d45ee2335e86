"""Decoding with the KV cache (mx_jax.sample.Decoder) against decoding without one, on one GPU or split over several.

    python benchmarks/bench_decode.py --config configs/llama3_8b.yaml [--batch 1,8,32] [--prompt 512] [--tokens 256]
        [--devices N] [key=value ...]

The model is the config's with random weights (bf16 compute copies, as `python -m mx_jax.sample` loads them), B
copies of a random prompt of P tokens, greedy. Per row of the table:
- "cache": `Decoder.run`, the prefill over the left-padded prompts (ms, compiled beforehand) and then the wall
  time per drawn token of all B rows (ms per step: the Python loop and its dispatch included);
- "no cache": what the sampler did before session 63 and the plain way without a cache: each token one forward over
  the whole window of P + tokens positions (rounded up to 128), right-padded, the next token read at its position
  (ms per step, timed over 8 steps after a compiled one);
- "bound": the step's bytes per device at 4.8 TB/s (H200 HBM): every GEMM weight once, plus the cache's keys and
  values (latent attention: its latents) once, over the devices;
  of a MoE model's routed experts only the share that B tokens choose under uniform routing, 1 - (1 - k/E)^B
  (an estimate: random weights route unevenly, onto fewer experts, so a MoE step can beat it);
- tokens/s of both, B / step time, and the share of the first 9 greedy tokens both paths drew alike (random
  weights give nearly flat logits, so bf16 rounding differences between the two attention paths can flip a few),
  and the largest difference of the prefill's last logits from a forward over the prompt, relative to the largest
  logit.
`--devices N` splits the model over N devices as `python -m mx_jax.sample --devices N` does (`sample.tensor_parallel`,
the routed experts under `moe.hidden_split`); the no-cache rows then need --no-baseline.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mx_jax import moe, profiling, sample, sharding, train
from mx_jax.config import load_config
from mx_jax.llama import Llama, buffers_of, compute_copies, init_cache, params_of, with_compute

HBM_BYTES_PER_S = 4.8e12


def random_state(setup: train.Setup) -> tuple[dict, dict]:
    """Random parameters with the GEMM weights and the embedding in the compute dtype, and the MoE buffers."""
    cfg = setup.cfg

    def init():
        model = Llama(cfg.model, cfg.quant, rngs=nnx.Rngs(0))
        params = params_of(model)
        params = with_compute(params, compute_copies(cfg.model, params))
        params["embed"] = params["embed"].astype(cfg.model.compute_dtype)  # as sample.load_model_state reads it
        return params, buffers_of(model)

    return jax.jit(init)()


def no_cache_step(setup: train.Setup):
    """tokens (B, W), pos -> tokens with position pos set to the argmax after pos - 1: one forward over W."""

    def step(params, buffers, tokens, pos):
        logits, _ = nnx.merge(setup.graphdef, params, buffers)(tokens, logits_dtype=jnp.float32)
        nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=1, keepdims=False), axis=-1)
        return jax.lax.dynamic_update_index_in_dim(tokens, nxt.astype(tokens.dtype), pos, axis=1)

    return jax.jit(step, donate_argnums=2)


def logit_error(setup: train.Setup, params: dict, buffers: dict, prompt: list[int]) -> float:
    """max |decode's logits - the forward's| after the prompt's last token (both in the compute dtype), relative to
    the largest |logit|."""
    def model(p, b):
        return nnx.merge(setup.graphdef, p, b)

    cache = init_cache(setup.cfg.model, 1, len(prompt), jnp.dtype(setup.cfg.model.compute_dtype))
    tokens = jnp.asarray([prompt], jnp.int32)
    got, _ = jax.jit(lambda p, b, t, c: model(p, b).decode(t, c, 0, jnp.zeros(1, jnp.int32)))(params, buffers, tokens,
                                                                                             cache)
    want = jax.jit(lambda p, b, t: model(p, b)(t)[0][:, -1])(params, buffers, tokens)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/llama3_8b.yaml")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--no-baseline", action="store_true", help="skip the no-cache rows")
    ap.add_argument("--profile", type=int, default=0, help="trace this many steps of the first batch size and "
                    "print where their device time went (mx_jax.profiling.summarize; the prefill is traced too)")
    ap.add_argument("--top", type=int, default=15, help="with --profile: how many of the longest ops to list")
    ap.add_argument("--devices", type=int, default=1, help="split the model over this many devices (sample --devices)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.devices > 1 and not args.no_baseline:
        ap.error("--devices N > 1 times the cache path only: add --no-baseline")
    train.apply_default_xla_flags()
    cfg = load_config(args.config, ["quant.recipe=bf16", "mesh.data=1", "mesh.fsdp=1", "mesh.expert=1",
                                    "mesh.context=1", *args.overrides])
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    rows = []
    with jax.set_mesh(mesh):
        setup = train.build(cfg, mesh)
        params, buffers = random_state(setup)
    split = sample.tensor_parallel(setup, jax.local_devices()[:args.devices]) if args.devices > 1 else None
    if split is not None:
        params, buffers = jax.device_put(params, split.params), jax.device_put(buffers, split.buffers)
    with jax.set_mesh(mesh) if split is None else moe.hidden_split(split.mesh):
        weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params) if a.ndim >= 2)
        expert_bytes = sum(a.size * a.dtype.itemsize for path, a in jax.tree_util.tree_flatten_with_path(params)[0]
                           if re.search(r"\['moe'\]\['w_(gate|up|down)'\]", jax.tree_util.keystr(path)))
        decoder = sample.Decoder(setup, params, buffers, temperature=0, cache_sharding=split and split.cache)
        old = None if args.no_baseline else no_cache_step(setup)
        m = cfg.model
        for b in map(int, args.batch.split(",")):
            prompt = [int(t) for t in np.random.default_rng(b).integers(1, m.vocab_size, args.prompt)]
            decoder.run([prompt] * b, args.tokens)  # compiles the prefill and the step of this shape
            stats: dict = {}
            drawn = decoder.run([prompt] * b, args.tokens, stats=stats)
            step_ms = 1e3 * stats["decode_s"] / stats["steps"]
            length = -(-(len(prompt) + args.tokens) // 128) * 128
            per_position = m.mla.kv_rank + m.mla.rope_dim if m.mla.kv_rank else 2 * m.n_kv_heads * m.d_head
            cache_bytes = m.n_layers * b * length * per_position * 2
            if expert_bytes:  # the routed experts B tokens choose on average, if they chose uniformly
                e, k = m.moe.n_experts, m.moe.top_k
                read = weight_bytes - expert_bytes * (1 - k / e) ** b
            else:
                read = weight_bytes
            bound_ms = 1e3 * (read + cache_bytes) / HBM_BYTES_PER_S / args.devices
            row = [cfg.model.n_layers, args.devices, b, args.prompt, length, 1e3 * stats["prefill_s"], step_ms,
                   bound_ms, b * 1e3 / step_ms]
            if old is not None:
                tokens = np.zeros((b, length), np.int32)
                tokens[:, :len(prompt)] = prompt
                tokens = old(params, buffers, jnp.asarray(tokens), len(prompt))
                tokens.block_until_ready()
                t0 = time.perf_counter()
                for pos in range(len(prompt) + 1, len(prompt) + 9):
                    tokens = old(params, buffers, tokens, pos)
                tokens.block_until_ready()
                old_ms = 1e3 * (time.perf_counter() - t0) / 8
                same = float((np.asarray(tokens)[:, len(prompt):len(prompt) + 9] == drawn[:, :9]).mean())
                row += [old_ms, b * 1e3 / old_ms, old_ms / step_ms, same, logit_error(setup, params, buffers, prompt)]
            rows.append(row)
            print(row, flush=True)
            if args.profile and len(rows) == 1:
                trace_dir = tempfile.mkdtemp(prefix="bench_decode_")
                with jax.profiler.trace(trace_dir):
                    decoder.run([prompt] * b, args.profile + 1)
                lines = profiling.summarize(profiling.latest_trace(trace_dir), args.profile, args.top)
                print("\n".join(lines), flush=True)
    print(f"\n{args.config} {' '.join(args.overrides)}: weights {weight_bytes / 1e9:.1f} GB (bf16 GEMM weights), "
          f"prompt {args.prompt}, {args.tokens} tokens, greedy")
    head = "| layers | devices | B | P | S | prefill ms | cache: ms/step | bound ms | tokens/s |"
    if not args.no_baseline:
        head += " no cache: ms/step | tokens/s | speedup | same tokens | logit error |"
    print(head)
    print("|" + "---|" * head.count(" |"))
    for r in rows:
        cells = [f"{v:,.2f}" if isinstance(v, float) else str(v) for v in r]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
