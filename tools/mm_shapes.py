"""
fp32 GFLOP/s of the compiled K = 5 step's largest matmul shapes (M, K, N) on their own, 2 threads, with each
operand contiguous (N) or a transposed view (T): median of 20 after 3 warm-ups. Output on an Intel Xeon without AMX:
results/bench/mm_shapes_intel_noamx.txt.

    python tools/mm_shapes.py
"""
import statistics
import time

import torch


def median_time(f, n=20):
    for _ in range(3):
        f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


shapes = [(1024, 3840, 128), (3840, 128, 1024), (3840, 1024, 128), (128, 3840, 512), (3840, 512, 128),
          (3840, 128, 512), (2048, 2048, 2048)]
for M, K, N in shapes:
    gflop = 2 * M * K * N / 1e9
    row = []
    for ta in (False, True):
        for tb in (False, True):
            a = torch.randn(K, M).t() if ta else torch.randn(M, K)
            b = torch.randn(N, K).t() if tb else torch.randn(K, N)
            row.append(f"{'T' if ta else 'N'}{'T' if tb else 'N'} {gflop / median_time(lambda: a @ b):6.1f}")
    print((M, K, N), " | ".join(row), flush=True)
