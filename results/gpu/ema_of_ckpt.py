"""The averaged weights (train.py --ema) of a run's ckpt.pt, written as a checkpoint that eval.py reads, so a run's
last model can be evaluated without choosing it by its held-out EM (best.pt is chosen that way). Not used by train.py.
Since session 31 `python eval.py RUN/ckpt.pt --weights ema` evaluates the same weights in one step (test_all.py checks both
against the best.pt train.py saves).

    python results/gpu/ema_of_ckpt.py RUN/ckpt.pt OUT.pt
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch  # noqa: E402

from train import CONFIGS, WeightEMA, build, load_checkpoint  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
ckpt = load_checkpoint(src, resume=True)
if "ema" not in ckpt:
    sys.exit(f"{src} holds no averaged weights (a run without --ema)")
cfgs = {k: CONFIGS[k](**ckpt["config"][k]) for k in CONFIGS}
gm = build(cfgs)
gm.load_state_dict(ckpt["model"])
ema = WeightEMA(gm, cfgs["train"].ema)
ema.load_state_dict(ckpt["ema"], src)
with ema.swapped(gm):                       # as train.py saves a best.pt whose averaged weights scored higher
    model = {k: v.detach().clone().cpu() for k, v in gm.state_dict().items()}
out = {k: ckpt[k] for k in ("step", "best_em", "pairs", "config")}
torch.save(dict(out, model=model, weights="ema"), dst)
print(f"{src}: the averaged weights at step {ckpt['step']} -> {dst}")
