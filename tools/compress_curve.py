"""
Text compression from memory alone with a pretrained model and no training (App. I, test-time WRITE only): N tokens
of text are written into m memory vectors by K steps of Eq. (5) from an M_0 drawn at the scale of the model's token
embeddings, and read back teacher-forced from [M_K] alone; token accuracy and the WRITE loss per (N, m, K, alpha).
K = 0 is the model's guess with no information about the text (M_0 only). Nothing is meta-learned: App. I's models
also learn M_0, the WRITE head and adapters, so this is the floor of what its WRITE rule gives on this model.

    python tools/compress_curve.py --init_from smollm2 --data_dir DIR --N 8 16 32 64 --n_mem 1 2 --K 0 1 2 5 \
        --alpha 1 4 16 --n_eval 32 --out results/appI/smollm2_untrained.jsonl

DIR holds wiki.valid.raw (WikiText-103 raw, or any English text under that name); the first n_eval chunks are used.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import BPE, compress_task  # noqa: E402
from gradmem import GradMem, GradMemConfig  # noqa: E402
from tokenizer import tokenizer_for  # noqa: E402
from train import evaluate_text, load_pretrained, parse_args, pretrained_path  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init_from", default="smollm2", help="pretrained model (train.py --init_from)")
    p.add_argument("--data_dir", required=True, help="folder with wiki.valid.raw")
    p.add_argument("--N", type=int, nargs="+", default=[8, 16, 32, 64], help="tokens written")
    p.add_argument("--n_mem", type=int, nargs="+", default=[1, 2], help="memory vectors m")
    p.add_argument("--K", type=int, nargs="+", default=[0, 1, 2, 5], help="WRITE steps")
    p.add_argument("--alpha", type=float, nargs="+", default=[1.0], help="inner lr of Eq. (5)")
    p.add_argument("--n_eval", type=int, default=32, help="text chunks per N")
    p.add_argument("--seed", type=int, default=0, help="seed of M_0")
    p.add_argument("--out", required=True, help="JSONL, one line per (N, m, K, alpha)")
    args = p.parse_args()
    # the validation file serves as both splits: nothing is trained
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    cfgs = parse_args(["--init_from", args.init_from])
    t0 = time.time()
    gpt = load_pretrained(cfgs).eval()
    tok = BPE(tokenizer_for(pretrained_path(args.init_from)))
    print(f"loaded {args.init_from} in {time.time() - t0:.1f} s; {torch.get_num_threads()} threads", flush=True)
    scale = float(gpt.transformer.wte.weight.detach().std())
    with open(args.out, "w") as f:
        for N in args.N:
            task = compress_task(args.data_dir, tok, N, n_eval=args.n_eval, limit=1,
                                 files={"train": "wiki.valid.raw", "eval": "wiki.valid.raw"})
            for m in args.n_mem:
                torch.manual_seed(args.seed)
                gm = GradMem(gpt, GradMemConfig(n_mem=m, K=1, write_head=False)).eval()
                with torch.no_grad():
                    gm.mem0.normal_(0.0, scale)
                for alpha in args.alpha:
                    gm.cfg.alpha = alpha
                    for K in args.K:
                        if K == 0 and alpha != args.alpha[0]:
                            continue                       # M_0 alone does not depend on alpha
                        t = time.time()
                        r = evaluate_text(gm, task, K, "cpu", batch_size=8)
                        rec = dict(model=args.init_from, N=N, n_mem=m, K=K, alpha=alpha, n_eval=len(task.eval),
                                   token_acc=r["acc"], ce=r["ce"], write_loss0=r["write_loss0"], write_lossK=r["write_lossK"],
                                   seconds=round(time.time() - t, 2), threads=torch.get_num_threads())
                        print(json.dumps(rec), flush=True)
                        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
