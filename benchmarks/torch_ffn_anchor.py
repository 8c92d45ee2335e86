"""The PyTorch anchor of issue 3's FFN-block target, measured on the same GPU as ours.

    python3 benchmarks/torch_ffn_anchor.py

Issue 3 sets the FFN block (SwiGLU, D=4096, F=14336, 8192 tokens, forward and backward, every cast included) at
<= 7.5 ms against PyTorch 2.11 + TorchAO 0.18 + torch.compile on another H200: bf16 12.4 ms, rowwise 12.0,
tensorwise 8.3. Our hosts run the same GEMMs several percent slower than the issue's (issue 5's anchor
`torch._grouped_mm` read 779 there and 673 here), so this script times the block in PyTorch alone and
`benchmarks/run_on_gpu.sh ffn_vs_torch` puts it beside `python3 -m pallas_kernels.bench fp8 --shapes none --quick`
in one call on one GPU.

The block and one timed call:

    y = (silu(x W_gateᵀ) * (x W_upᵀ)) W_downᵀ        three bias-free nn.Linear, x (T, D) bf16, requires grad
    y.backward(dy)                                   dx, dW_gate, dW_up, dW_down (weight grads reset to None)

under `torch.compile` (default mode). Recipes:
- `bf16`: plain bf16 linears.
- `tensorwise`, `rowwise`: TorchAO's float8 training, `convert_to_float8_training(block,
  config=Float8LinearConfig.from_recipe_name(name))`, when `torchao` imports. Otherwise the same recipes written
  here on `torch._scaled_mm` (what TorchAO's Float8Linear calls), marked "hand-written" in the table:

      GEMM           operands (fp8 dtype, scaled along)                      tensorwise        rowwise
      y  = x Wᵀ      x (e4m3, along D per token),  W (e4m3, along D per out)   one scale each    per row, 2^k
      dx = dy W      dy (e5m2 | e4m3, along D_out), W (e4m3, along D_out)       one scale each    per row, 2^k
      dW = dyᵀ x     dy (e5m2 | e4m3, along T),     x (e4m3, along T)           one scale each    per row, 2^k

  scale = fmax / amax (amax over the scaled axis, or the whole tensor), rounded down to a power of two for
  rowwise (TorchAO's round_scales_to_power_of_2); inductor fuses the amaxes, casts and transposes.

Timing is `pallas_kernels.bench.time_fn`'s protocol with the FFN bench's batch: 3 warm-up calls, then the median over
10 samples of the mean of 5 back-to-back calls ended by a device sync, host clock. Prints one table; a variant
PyTorch rejects prints its error instead.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch_timing import time_ms  # benchmarks/ (the script's own directory)

T, D, FF = 8192, 4096, 14336


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, FF, bias=False)
        self.up = nn.Linear(D, FF, bias=False)
        self.down = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


# --- The recipes on torch._scaled_mm, for hosts without torchao. -------------------------------------------------
def _cast(t: torch.Tensor, dtype, rowwise: bool):
    """t (R, C) -> (fp8 (R, C), f32 dequant multiplier (R, 1) or ()), scaled along C (rowwise) or as a whole."""
    fmax = torch.finfo(dtype).max
    amax = (t.abs().amax(dim=1, keepdim=True) if rowwise else t.abs().amax()).float().clamp_min(1e-12)
    scale = fmax / amax
    if rowwise:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


def _mm(a, b_t, rowwise: bool, a_dtype, b_dtype):
    """a (M, K) @ b_t (N, K)ᵀ in fp8, both scaled along K; bf16 out."""
    aq, sa = _cast(a, a_dtype, rowwise)
    bq, sb = _cast(b_t, b_dtype, rowwise)
    return torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t() if rowwise else sb, out_dtype=torch.bfloat16)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, rowwise: bool):
        ctx.save_for_backward(x, w)
        ctx.rowwise = rowwise
        e4 = torch.float8_e4m3fn
        return _mm(x, w, rowwise, e4, e4)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        e4 = torch.float8_e4m3fn
        g = e4 if ctx.rowwise else torch.float8_e5m2
        dx = _mm(dy, w.t().contiguous(), ctx.rowwise, g, e4)
        dw = _mm(dy.t().contiguous(), x.t().contiguous(), ctx.rowwise, g, e4)
        return dx, dw, None


class _HandFp8(nn.Module):
    def __init__(self, linear: nn.Linear, rowwise: bool):
        super().__init__()
        self.weight = linear.weight
        self.rowwise = rowwise

    def forward(self, x):
        return _Fp8Linear.apply(x, self.weight, self.rowwise)


def build(recipe: str, dev) -> tuple[nn.Module, str]:
    torch.manual_seed(0)
    block = Block().to(device=dev, dtype=torch.bfloat16)
    if recipe == "bf16":
        return block, "bf16"
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        for name in ("gate", "up", "down"):
            setattr(block, name, _HandFp8(getattr(block, name), rowwise=recipe == "rowwise"))
        return block, f"{recipe} (hand-written, torch._scaled_mm)"
    import torchao

    convert_to_float8_training(block, config=Float8LinearConfig.from_recipe_name(recipe))
    return block, f"{recipe} (torchao {torchao.__version__})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--recipe", action="append", choices=("bf16", "tensorwise", "rowwise"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g)
    ref_block = Block().to(device=dev)  # f32, takes each recipe's bf16 weights below
    rows = []
    for recipe in args.recipe or ["bf16", "tensorwise", "rowwise"]:
        try:
            block, label = build(recipe, dev)
            with torch.no_grad():
                for name in ("gate", "up", "down"):
                    getattr(ref_block, name).weight.copy_(getattr(block, name).weight.float())
            step_block = torch.compile(block)

            def step():
                for p in block.parameters():
                    p.grad = None
                x.grad = None
                y = step_block(x)
                y.backward(dy)
                return y

            t0 = time.perf_counter()
            y = step()
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            xf = x.detach().float().requires_grad_()
            y_ref = ref_block(xf)
            y_ref.backward(dy.float())
            err_y = ((y.float() - y_ref).norm() / y_ref.norm()).item()
            err_dx = ((x.grad.float() - xf.grad).norm() / xf.grad.norm()).item()
            ms = time_ms(step, samples=args.samples, batch=5)  # the FFN bench's batch
            rows.append((label, ms, err_y, err_dx))
            print(f"  {label:45s} {ms:8.3f} ms  rel.err y {err_y:.1e} dx {err_dx:.1e}  (first call {compile_s:.1f}s)",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  {recipe:45s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    print(f"\n| PyTorch FFN fwd+bwd, T={T} D={D} F={FF} | ms | rel.err y | rel.err dx |\n|---|---|---|---|")
    for label, ms, ey, edx in rows:
        print(f"| {label} | {ms:.3f} | {ey:.1e} | {edx:.1e} |")


if __name__ == "__main__":
    main()
