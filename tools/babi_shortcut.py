"""
How often a bAbI QA1 model answers with the location the story names last, whoever moved there: the shortcut a model
sits on before it binds actors to their moves. For each checkpoint: EM of greedy answers from memory, the share of
answers that are the story's last location, and the share of questions whose gold answer is that location.

    python tools/babi_shortcut.py out/table2/*/ckpt.pt --eval_seed 777 --out results/table2/shortcut.jsonl
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eval import load_model  # noqa: E402
from gradmem import PAD, greedy  # noqa: E402
from train import TrainConfig, make_task  # noqa: E402

LOCATIONS = {"bathroom", "bedroom", "garden", "hallway", "kitchen", "office"}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpts", nargs="+", help="train.py checkpoints of --task babi --qa 1 runs")
    p.add_argument("--eval_seed", type=int, default=777, help="seed of the generated test stories")
    p.add_argument("--weights", default="ema", choices=["saved", "ema"], help="as eval.py --weights")
    p.add_argument("--out", required=True, help="JSONL, one line per checkpoint")
    args = p.parse_args()
    with open(args.out, "w") as f:
        for path in args.ckpts:
            gm, cfg = load_model(path, weights=args.weights)
            task = make_task(TrainConfig(**dict(cfg["train"], resume=False, eval_seed=args.eval_seed)))
            n = right = last = gold_last = 0
            for b in task.eval_batches(100):
                with torch.no_grad():
                    state, _ = gm.memorize(b["ctx"], gm.cfg.K if hasattr(gm, "cfg") else None)
                    pred = greedy(gm, state, b["q"], 3, task.tok.eos)
                for ids, i in zip(pred.tolist(), b["index"]):
                    c, _, _, golds = task.eval[i]
                    answer = task.tok.decode([t for t in ids if t not in (PAD, task.tok.eos)])
                    story_last = [w for w in task.tok.decode(c).split() if w in LOCATIONS][-1]
                    n, right = n + 1, right + (answer == golds[0])
                    last, gold_last = last + (answer == story_last), gold_last + (golds[0] == story_last)
            rec = dict(ckpt=path, model=cfg["train"]["model"], step=cfg["step"], n=n, em=right / n,
                       answer_is_last_location=last / n, gold_is_last_location=gold_last / n)
            print(json.dumps(rec), flush=True)
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
