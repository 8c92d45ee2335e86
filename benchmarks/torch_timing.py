"""The PyTorch anchors' timer (benchmarks/torch_*_anchor.py): `pallas_kernels.bench.time_fn`'s protocol in PyTorch,
so that both frameworks are timed the same way in one call.

    time_ms(fn, batch=...)  ->  `warmup` calls, then the median over `samples` of the mean of `batch` back-to-back
                                calls ended by a device sync, host clock, in ms
"""

from __future__ import annotations

import statistics
import time

import torch


def time_ms(fn, samples: int = 10, batch: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / batch * 1e3)
    return statistics.median(times)
