"""App. F probe, no training: a GradMem checkpoint with its M_0 cut to m rows (the first m, as train.py --init_from
does, or with --last the last m, next to the context), held-out EM after K WRITE steps over a grid of alpha.

    python tools/appF_truncation_probe.py out/n8_cos/best.pt results/appF/truncation_probe/first.json
    python tools/appF_truncation_probe.py out/n8_cos/best.pt results/appF/truncation_probe/last.json --last

Writes one JSON row per (m, K, alpha): m in {8, 4, 2, 1}, K in {1, 2}, alpha in {0.02, 0.05, 0.1, 0.2, 0.5}.
"""
import argparse, json, os, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train  # noqa: E402
from data import KVTask  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("ckpt"), p.add_argument("out"), p.add_argument("--last", action="store_true")
p.add_argument("--n_eval", type=int, default=300)
args = p.parse_args()
saved = torch.load(args.ckpt, weights_only=True)
pairs = saved["config"]["train"]["pairs"]
task = KVTask(pairs, seed=0, eval_seed=saved["config"]["train"]["eval_seed"], n_eval=args.n_eval)
rows = []
for m in [8, 4, 2, 1]:
    for K in [1, 2]:
        for a in [0.02, 0.05, 0.1, 0.2, 0.5]:
            cfgs = train.parse_args(["--pairs", str(pairs), "--n_mem", str(m), "--K", str(K), "--alpha", str(a)])
            gm = train.build(cfgs)
            state = {k: v.clone() for k, v in saved["model"].items()}
            state["mem0"] = state["mem0"][-m:] if args.last else state["mem0"][:m]
            gm.load_state_dict(state)
            rows.append(dict(n_mem=m, K=K, alpha=a, **train.evaluate(gm, task, K, "cpu")))
            print(json.dumps(rows[-1]), flush=True)
with open(args.out, "w") as f:
    json.dump(rows, f, indent=1)
