"""Uniform average (SWA) of the trained weights saved in a run's checkpoint snapshots, written as a checkpoint that
eval.py reads: is a longer average than --ema 0.999's ~1,000 steps a lever on the 8-pair plateau? (README, session 25)

    python results/compile_train/swa_snapshots.py SNAP_DIR FIRST_STEP LAST_STEP OUT.pt

SNAP_DIR holds copies of a run's ckpt.pt named step_<N>.pt (one per --eval_interval); the trained weights ("model")
of those with FIRST_STEP <= N <= LAST_STEP are averaged in float64. Not used by train.py.
"""
import glob
import os
import re
import sys

import torch

snap_dir, first, last, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
snaps = sorted((int(re.search(r"step_(\d+)\.pt$", p).group(1)), p) for p in glob.glob(os.path.join(snap_dir, "step_*.pt")))
snaps = [(s, p) for s, p in snaps if first <= s <= last]
if not snaps:
    sys.exit(f"no step_<N>.pt in {snap_dir} with {first} <= N <= {last}")
total = None
for s, p in snaps:
    ckpt = torch.load(p, weights_only=True)
    if ckpt["step"] != s:
        sys.exit(f"{p} holds step {ckpt['step']}, not {s}")
    w = {k: v.double() for k, v in ckpt["model"].items()}
    total = w if total is None else {k: total[k] + w[k] for k in total}
ckpt["model"] = {k: (v / len(snaps)).float() for k, v in total.items()}
ckpt["weights"] = f"swa of the trained weights at steps {snaps[0][0]}..{snaps[-1][0]} ({len(snaps)} snapshots)"
for k in ("optimizer", "ema"):
    ckpt.pop(k, None)
torch.save(ckpt, out)
print(f"averaged {len(snaps)} snapshots, steps {snaps[0][0]}..{snaps[-1][0]} -> {out}")
