"""
The outer gradient of a K = 1 GradMem checkpoint split into its two terms, over N training batches:
the task loss's (READ, Eq. 8) and the auxiliary WRITE loss's (aux_write * L_write(M_0) / B). Prints, per term,
the mean per-batch gradient norm, the norm of the gradient averaged over the N batches (the signal), and the
ratio of the two (near 1/sqrt(N) when a term is pure batch noise), plus the clip factor the sum gets.

    python tools/grad_split.py CKPT [N]

A diagnostic of whether a plateau is gradient noise (a ratio near 1/sqrt(N)); not used by train.py.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from data import KVTask  # noqa: E402
from eval import load_model  # noqa: E402

if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    sys.exit(__doc__)
path = sys.argv[1]; N = int(sys.argv[2]) if len(sys.argv) > 2 else 16
gm, cfg = load_model(path)
gm.train()
task = KVTask(cfg["pairs"], 0, 12345, 10)
params = [p for p in gm.parameters() if p.requires_grad]
flat = lambda gs: torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(gs, params)])
task_g, aux_g, tot_norm = [], [], []
for i in range(N):
    b = task.train_batch(10_000_000 + i, 64)
    out = gm(b["ctx"], b["q"], b["y"])
    aux = out["loss"] - out["task_loss"]
    gt = flat(torch.autograd.grad(out["task_loss"], params, retain_graph=True, allow_unused=True))
    ga = flat(torch.autograd.grad(aux, params, allow_unused=True))
    task_g.append(gt); aux_g.append(ga); tot_norm.append((gt + ga).norm().item())
for name, gs in (("task", task_g), ("aux", aux_g)):
    G = torch.stack(gs)
    per = G.norm(dim=1).mean().item(); mean = G.mean(0).norm().item()
    print(f"{name:5s} mean per-batch norm {per:.4f}  norm of the {N}-batch mean {mean:.4f}  ratio {mean / per:.3f}")
cos = torch.stack([torch.nn.functional.cosine_similarity(a, t, dim=0) for a, t in zip(aux_g, task_g)])
print(f"total per-batch norm {sum(tot_norm) / N:.4f} (clip at 1.0 scales by {min(1.0, 1.0 / (sum(tot_norm) / N)):.3f}); "
      f"cosine(task, aux) per batch mean {cos.mean().item():+.3f}; 1/sqrt(N) = {N ** -0.5:.3f}")
