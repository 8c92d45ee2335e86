"""The PyTorch anchor of issue 2, measured on the same GPU as our step: Llama3-8B shape, n layers, bf16 training.

    python3 benchmarks/torch_llama_anchor.py --layers 8 --seq 8192 --steps 20 \
        --variant autocast:gqa:auto fsdp2:gqa:auto autocast:repeat:flash autocast:repeat:cudnn

A variant is mode:kv:backend. mode `fsdp2` or `autocast` (below); kv `gqa` passes the G key/value heads to
F.scaled_dot_product_attention(enable_gqa=True), `repeat` repeats them to H heads first (TorchTitan's repeat_kv);
backend `auto` lets PyTorch pick the SDPA kernel, `flash` / `cudnn` / `efficient` pin it (torch.nn.attention).

Built the way TorchTitan builds its single-node bf16 baseline, with PyTorch only (no mx_jax, no JAX):
- the same model as mx_jax's: RMSNorm, RoPE (half-split), grouped-query attention through
  F.scaled_dot_product_attention(is_causal=True) (kernel and GQA handling per variant), SwiGLU,
  untied head, float32 master weights;
- `fsdp2`: FSDP2 `fully_shard` on a one-GPU process group with MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32), per block and at the root, and `torch.compile` per block (TorchTitan's recipe);
  `autocast`: one `torch.compile` of the whole model under torch.autocast(bf16) (the residual stream stays fp32);
- AdamW(fused=True), weight decay 0.1, global-norm clipping at 1.0, cross-entropy on the float32-upcast logits;
- random tokens (speed only), batch 1; the timed steps follow --warmup untimed ones; CUDA events around them.

It prints one JSON line per mode and a table: tokens/s, the step time and peak memory. The reference figure in
the issue (34,300 tokens/s with PyTorch 2.11 + torch.compile on an H200) came from another host; this script puts
both frameworks on the same host in the same call (benchmarks/run_on_gpu.sh train_vs_torch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

D, H, G, F_DIM, V, THETA, EPS = 4096, 32, 8, 14336, 128256, 500000.0, 1e-5
K = D // H


def rope_tables(t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (THETA ** (torch.arange(0, K, 2, device=device, dtype=torch.float32) / K))
    ang = torch.arange(t, device=device, dtype=torch.float32)[:, None] * inv[None, :]  # (T, K/2)
    return ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, repeat_kv: bool):
        super().__init__()
        self.repeat_kv = repeat_kv
        self.attn_norm, self.mlp_norm = nn.RMSNorm(D, eps=EPS), nn.RMSNorm(D, eps=EPS)
        self.wq, self.wk, self.wv = nn.Linear(D, H * K, bias=False), nn.Linear(D, G * K, bias=False), \
            nn.Linear(D, G * K, bias=False)
        self.wo = nn.Linear(H * K, D, bias=False)
        self.w1, self.w3, self.w2 = nn.Linear(D, F_DIM, bias=False), nn.Linear(D, F_DIM, bias=False), \
            nn.Linear(F_DIM, D, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = rope(self.wq(h).view(b, t, H, K), cos, sin).transpose(1, 2)
        k = rope(self.wk(h).view(b, t, G, K), cos, sin).transpose(1, 2)
        v = self.wv(h).view(b, t, G, K).transpose(1, 2)
        if self.repeat_kv:
            k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, H * K))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, layers: int, repeat_kv: bool = False):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(repeat_kv) for _ in range(layers))
        self.norm = nn.RMSNorm(D, eps=EPS)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens, cos, sin):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def build(mode: str, layers: int, repeat_kv: bool) -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = Llama(layers, repeat_kv).cuda()
    for p in model.parameters():
        if p.ndim > 1:
            nn.init.trunc_normal_(p, std=0.02)
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
            fully_shard(model.blocks[i], mp_policy=mp, reshard_after_forward=False)
        fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    else:
        model = torch.compile(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


def sdpa(backend: str):
    """A context pinning the SDPA kernel, or a no-op for "auto"."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}
    return sdpa_kernel([kinds[backend]])


def run(variant: str, layers: int, seq: int, steps: int, warmup: int) -> dict:
    mode, kv, backend = variant.split(":")
    model, opt = build(mode, layers, kv == "repeat")
    cos, sin = rope_tables(seq, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def step():
        tokens = torch.randint(0, V, (1, seq + 1), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast"), sdpa(backend):
            logits = model(tokens[:, :-1], cos, sin)
        loss = F.cross_entropy(logits.float().view(-1, V), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.time()
    step().item()
    first = time.time() - t0
    for _ in range(warmup - 1):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        loss = step()
    end.record()
    torch.cuda.synchronize()
    dt = start.elapsed_time(end) / 1e3 / steps
    return {"name": f"torch_{variant}", "tokens_per_sec": seq / dt, "step_ms": dt * 1e3,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "first_step_s": round(first, 1),
            "loss": float(loss.detach()), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variant", nargs="+", default=["autocast:gqa:auto", "fsdp2:gqa:auto"],
                    help="mode:kv:backend, mode fsdp2|autocast, kv gqa|repeat, backend auto|flash|cudnn|efficient")
    args = ap.parse_args()
    for v in args.variant:
        parts = v.split(":")
        if len(parts) != 3 or parts[0] not in ("fsdp2", "autocast") or parts[1] not in ("gqa", "repeat") \
                or parts[2] not in ("auto", "flash", "cudnn", "efficient"):
            ap.error(f"--variant {v!r}: want mode:kv:backend (fsdp2|autocast, gqa|repeat, auto|flash|cudnn|efficient)")
    if any(v.startswith("fsdp2") for v in args.variant):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    results = []
    for variant in args.variant:
        try:
            r = run(variant, args.layers, args.seq, args.steps, args.warmup)
        except Exception as e:  # one variant failing (a compile error) must not hide the others' figures
            r = {"name": f"torch_{variant}", "error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps(r), flush=True)
        results.append(r)
        torch.cuda.empty_cache()
    print(f"\n{'variant':<28}{'tok/s':>10}{'step ms':>10}{'peak GiB':>10}{'1st step s':>12}")
    for r in results:
        if "error" in r:
            print(f"{r['name']:<28} failed: {r['error']}")
        else:
            print(f"{r['name']:<28}{r['tokens_per_sec']:>10,.0f}{r['step_ms']:>10.1f}{r['peak_mem_gib']:>10.1f}"
                  f"{r['first_step_s']:>12}")


if __name__ == "__main__":
    main()
