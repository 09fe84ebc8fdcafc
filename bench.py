"""
train.py --bench N: the median wall time of one optimizer step, peak memory, matmul FLOPs and the machine's matmul
peak, for the run's flags; --profile adds torch.profiler's self time per op. Nothing is trained or written.

    python train.py --pairs 16 --K 5 --batch_size 32 --queries 1 --bench 5             # one JSON line
    python train.py --pairs 16 --K 5 --batch_size 32 --queries 1 --bench 5 --compile   # the same, WRITE step compiled
"""
import json
import resource
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode


def peak_memory_gb(device):
    """Peak GPU memory allocated, or on the CPU the process's peak resident set (Linux reports KiB)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def matmul_peak_gflops(device, n=2048):
    """The machine's fp32 matmul throughput, measured: median of 10 (n x n) @ (n x n) after 2 warm-ups."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    times = []
    for _ in range(12):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times[2:]) / 1e9


def bench(step_fn, net, steps, device, graphed=None, profile=False, **info):
    """Median wall time of step_fn(step, graphed) over `steps` steps after 2 warm-up steps, and peak memory.
    FLOPs and the profile come from an eager step (a graph replay bypasses the counters; a compiled WRITE step is
    swapped for the eager one, which runs the same matmuls). net: the model trained; info: fields copied into the printed JSON line."""
    def median_step(graphed):
        times = []
        for step in range(steps + 2):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            step_fn(step, graphed)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:])

    sec = median_step(graphed)
    peak_gb = peak_memory_gb(device)
    extra = {} if graphed is None else dict(eager_s_per_step=median_step(None))   # the gain, side by side
    compiled = getattr(net, "compiled_grad", None)
    if compiled is not None:
        net.compiled_grad = None
    with FlopCounterMode(display=False) as fc:    # matmul FLOPs of one step, backward and double backward included
        step_fn(0, None)
    if compiled is not None:
        net.compiled_grad = compiled
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            step_fn(0, None)
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=40))
    flops = fc.get_total_flops()
    res = dict(median_s_per_step=sec, **extra, peak_gb=peak_gb, device=device, threads=torch.get_num_threads(),
               **info, cuda_graph=graphed is not None, steps=steps, gflop_per_step=flops / 1e9,
               achieved_gflops=flops / 1e9 / sec, matmul_peak_gflops=matmul_peak_gflops(device))
    print(json.dumps(res))
    return res
