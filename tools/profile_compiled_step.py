"""
Where the compiled K = 5 step's time goes (16 pairs, batch 32, fp32, 2 threads): torch.profiler self time
per aten op and per Inductor C++ kernel (cpp.enable_kernel_profile), of one step after 3 warm-up steps, then the same
grouped by input shape, then the step's matmul FLOPs. train.py --bench --profile profiles the eager step only;
this one profiles the --compile step with Inductor's per-kernel records. Output on an Intel Xeon without AMX:
results/bench/profile_compiled_n16_k5_b32_intel_noamx.txt.

    python tools/profile_compiled_step.py
"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

torch._inductor.config.cpp.enable_kernel_profile = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train  # noqa: E402

cfgs = train.parse_args("--pairs 16 --K 5 --batch_size 32 --queries 1".split())
train.tune_malloc()
torch.manual_seed(0)
task = train.KVTask(16, 0, 1, 100)
gm = train.build(cfgs)
train.compile_write(gm)
opt = torch.optim.AdamW(gm.parameters(), lr=1e-4)


def step(i):
    b = task.train_batch(i, 32)
    gm(b["ctx"], b["q"], b["y"])["loss"].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for i in range(3):
    step(i)
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    step(3)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60))
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30,
                                                          max_name_column_width=30, max_shapes_column_width=60))

# The matmul FLOPs of the same step: counted on one uncompiled step with the blocked explicit attention that the
# compiled step traces (--attn eager); the counter does not see inside compiled graphs.
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

cfgs["gradmem"].attn = "eager"
torch.manual_seed(0)
gm = train.build(cfgs)
b = task.train_batch(0, 32)
with FlopCounterMode(display=False) as fc:
    gm(b["ctx"], b["q"], b["y"])["loss"].backward()
counts = fc.get_flop_counts()["Global"]
print("GFLOP per step:", {str(k): round(v / 1e9, 2) for k, v in counts.items()}, "total", round(sum(counts.values()) / 1e9, 1))
