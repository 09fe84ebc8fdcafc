"""
Variants of the compiled K = 5 training step (16 pairs, batch 32, fp32, 2 threads), each timed in its own
process: median s/step of `steps` steps after 2 warm-up steps (the first compiles). One line per run.

    V=VARIANT python tools/compile_variants.py MODE K STEPS

MODE: default | max-autotune-no-cudagraphs (torch.compile's mode for gradmem.write_grad).
V (comma-separated, empty for train.py's --compile step as it is):
    swiglu     SwiGLU written as gate * sigmoid(gate) * up instead of F.silu(gate) * up
    rope       RoPE's cos/sin tables computed once outside the compiled graph (not recomputed inside its kernels)
    budgetX    torch._functorch.config.activation_memory_budget = X (the partitioner recomputes more below 1.0)
Results on an Intel Xeon without AMX: results/bench/compile_variants_intel_noamx.txt.
"""
import os
import resource
import statistics
import sys
import time

import torch
import torch._functorch.config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import model as M  # noqa: E402
import train  # noqa: E402
from gradmem import write_grad  # noqa: E402

if len(sys.argv) != 4:
    sys.exit(__doc__)
mode, K, nsteps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
V = os.environ.get("V", "")
if "swiglu" in V:
    def mlp_forward(self, x):
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.c_proj(gate * torch.sigmoid(gate) * up)
    M.MLP.forward = mlp_forward
if "rope" in V:
    cache, rope_tables = {}, M.rope_tables

    def cached_rope_tables(inv, pos, dtype):
        if pos.numel() not in cache:
            with torch.no_grad():
                cache[pos.numel()] = tuple(t.clone() for t in rope_tables(inv, torch.arange(pos.numel()), dtype))
        return cache[pos.numel()]
    M.rope_tables = cached_rope_tables
if "budget" in V:
    torch._functorch.config.activation_memory_budget = float(V.split("budget")[1].split(",")[0])

cfgs = train.parse_args(f"--pairs 16 --K {K} --batch_size 32 --queries 1".split())
train.tune_malloc()
torch.manual_seed(0)
task = train.KVTask(16, 0, 1, 100)
gm = train.build(cfgs)
opt = torch.optim.AdamW(gm.parameters(), lr=1e-4)
if "rope" in V:   # fill the cache outside the compiled region
    for T in range(1, 300):
        M.rope_tables(gm.model.rope_inv_freq, torch.arange(T), torch.float32)
torch._dynamo.config.recompile_limit = 64
gm.compiled_grad = torch.compile(lambda mem, ctx: write_grad(gm, mem, ctx), dynamic=False,
                                 mode=None if mode == "default" else mode)
times = []
for step in range(nsteps + 2):
    b = task.train_batch(step, 32)
    t = time.perf_counter()
    gm(b["ctx"], b["q"], b["y"])["loss"].backward()
    torch.nn.utils.clip_grad_norm_(gm.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t)
print(V, mode, K, "median", round(statistics.median(times[2:]), 3), "peak_gb",
      round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2), flush=True)
