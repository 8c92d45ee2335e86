"""NCCL's all_to_all_single through PyTorch, the same sizes and convention as bench_dispatch.py (the reference).

    torchrun --nproc_per_node=4 benchmarks/nccl_a2a_torch.py --sizes-mb 8 64 512

busbw = 2 x bytes per GPU x (P-1)/P / t for dispatch+combine (two all_to_all_single calls), median of --reps.
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    for mb in args.sizes_mb:
        n = mb * 2**20 // 2 // world * world
        x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        y, z = torch.empty_like(x), torch.empty_like(x)
        for _ in range(3):
            dist.all_to_all_single(y, x)
            dist.all_to_all_single(z, y)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_to_all_single(y, x)
            dist.all_to_all_single(z, y)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        t = statistics.median(times)
        if rank == 0:
            busbw = 2 * n * 2 * (world - 1) / world / t / 1e9
            print(f"nccl all_to_all_single  {mb:>4} MB/GPU  {1e3 * t:8.3f} ms  busbw {busbw:7.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
