"""The PyTorch anchor of issue 5's grouped-GEMM targets, measured on the same GPU as ours.

    python3 benchmarks/torch_grouped_anchor.py

The issue's targets (bf16 780 / 650, fp8 rowwise 1,150 / 900 TFLOP/s, balanced / skewed) are PyTorch 2.11's
`torch._grouped_mm` (779 / 649) and `torch._scaled_grouped_mm` (1,112 / 876) on another H200. This script runs the
same problem through PyTorch only (no JAX) so that both frameworks meet on one host in one call
(`benchmarks/run_on_gpu.sh grouped_vs_torch`): E=8 experts, M=16384 token rows sorted by expert, K=4096, N=14336,
balanced routing (2048 rows each) and skewed routing (expert 0 holds 40%, the rest split evenly; the same sizes as
`pallas_kernels.bench_grouped.routings`).

    bf16:  out = torch._grouped_mm(x (M, K), w (E, K, N), offs)                       both layouts of w are tried
    fp8:   out = torch._scaled_grouped_mm(xq (M, K), wq (E, N, K)ᵀ, x_scale (M,), w_scale (E, N), offs,
                                          out_dtype=bf16)                               e4m3, rowwise scales

`offs` holds the groups' end rows (int32 cumulative sizes). Timing is `pallas_kernels.bench.time_fn`'s protocol:
3 warm-up calls, then the median over 10 samples of the mean of 10 back-to-back calls ended by a device sync,
host clock. TFLOP/s = 2 M K N / time. Prints one table; a variant PyTorch rejects prints its error instead.
"""

from __future__ import annotations

import argparse

import torch
from torch_timing import time_ms  # benchmarks/ (the script's own directory)

E, M, K, N = 8, 16384, 4096, 14336


def routings() -> dict[str, list[int]]:
    balanced = [M // E] * E
    big = round(0.4 * M)
    rest = [(M - big) // (E - 1)] * (E - 1)
    for i in range(M - big - sum(rest)):
        rest[i] += 1
    return {"balanced": balanced, "skewed": [big, *rest]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    w = (torch.randn(E, K, N, device=dev, dtype=torch.float32, generator=g) / K**0.5).to(torch.bfloat16)
    w_kmajor = w.transpose(1, 2).contiguous()  # (E, N, K)
    f8 = torch.float8_e4m3fn
    x_scale = (x.float().abs().amax(dim=1).clamp_min(1e-12) / 448.0)
    xq = (x.float() / x_scale[:, None]).to(f8)
    w_scale = (w_kmajor.float().abs().amax(dim=2).clamp_min(1e-12) / 448.0)  # (E, N)
    wq = (w_kmajor.float() / w_scale[:, :, None]).to(f8)  # (E, N, K) K-major
    flop = 2.0 * M * K * N
    rows = []
    for name, sizes in routings().items():
        offs = torch.tensor(sizes, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        variants = {
            "torch._grouped_mm bf16, w (E, K, N)": lambda: torch._grouped_mm(x, w, offs=offs),
            "torch._grouped_mm bf16, w K-major": lambda: torch._grouped_mm(x, w_kmajor.transpose(1, 2), offs=offs),
            "torch._scaled_grouped_mm fp8 rowwise": lambda: torch._scaled_grouped_mm(
                xq, wq.transpose(1, 2), x_scale, w_scale, offs=offs, out_dtype=torch.bfloat16),
            "torch._scaled_grouped_mm fp8 rowwise, fast accum": lambda: torch._scaled_grouped_mm(
                xq, wq.transpose(1, 2), x_scale, w_scale, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True),
        }
        for label, fn in variants.items():
            try:
                out = fn()
                ref_rows = slice(0, 64)  # rows of expert 0: x[:64] @ w[0]
                ref = x[ref_rows].float() @ w[0].float()
                err = ((out[ref_rows].float() - ref).norm() / ref.norm()).item()
                ms = time_ms(fn, samples=args.samples)
                rows.append((name, label, flop / (ms * 1e-3) / 1e12, ms, err))
                print(f"  {name:9s} {label:50s} {rows[-1][2]:7.0f} TFLOP/s  {ms:.3f} ms  rel.err {err:.1e}",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  {name:9s} {label:50s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                      flush=True)
    print("\n| routing | PyTorch variant | TFLOP/s | ms |\n|---|---|---|---|")
    for name, label, tf, ms, _ in rows:
        print(f"| {name} | {label} | {tf:,.0f} | {ms:.3f} |")


if __name__ == "__main__":
    main()
