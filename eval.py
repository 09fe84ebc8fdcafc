"""
Evaluate a GradMem checkpoint (arXiv:2603.13875v2) on held-out KV retrieval, rebuilt from the checkpoint alone.

    python eval.py out/kv8/best.pt --K_eval 1 2 5 10        # Figure 4a: more WRITE steps at test time

For each K in --K_eval it reports exact match and token accuracy of the value characters after K WRITE steps,
and the WRITE loss L_write(M_K) (Eq. 4) split into key, value and separator tokens (Figure 4b, Appendix E),
and EM split by the position of the queried pair in the context (which pairs the memory keeps).
Prints a table and writes the same numbers as JSON (--out, default <ckpt dir>/eval.json; an existing file only
with --overwrite).
"""
import argparse
import json
import os
import sys

import torch
from tqdm import tqdm

from data import KEY, SEP, VALUE, KVTask, context_kinds, key_overlap, queried_pair
from gradmem import GradMem, GradMemConfig, read_loss, score, token_hits, write, write_loss
from model import GPTConfig
from train import RunError, TrainConfig, build, load_checkpoint, one_line, set_pairs


def load_model(path, device="cpu", weights="saved"):
    """Rebuild the model of a checkpoint from its stored config alone. weights="saved": the weights its model entry
    holds (a best.pt: whichever of the trained and averaged weights scored higher; a ckpt.pt: the trained ones);
    "ema": the averaged weights (train.py --ema) a ckpt.pt keeps beside them, e.g. the last ones of a run, which no
    held-out evaluation chose."""
    ckpt = load_checkpoint(path)
    cfg = ckpt["config"]
    if weights == "ema" and "ema" not in ckpt:
        raise RunError(f"--weights ema: {path} keeps no averaged weights (only a train.py ckpt.pt of a run with --ema "
                       f"does; this one's model entry holds the {ckpt.get('weights', 'trained')} weights)")
    try:
        gm = build(dict(model=GPTConfig(**cfg["model"]), gradmem=GradMemConfig(**cfg["gradmem"]),
                        train=TrainConfig(**cfg["train"])))
        gm.load_state_dict(ckpt["model"])
        if weights == "ema":                      # into the parameters, as train.py's WeightEMA.swapped puts them
            avg, params = ckpt["ema"]["avg"], dict(gm.named_parameters())
            if avg.keys() != params.keys() or any(avg[k].shape != p.shape for k, p in params.items()):
                raise KeyError("its averaged weights do not match the model's parameters in name or shape")
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(avg[k])
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError, AttributeError) as e:
        raise RunError(f"checkpoint {path} does not rebuild its model: {one_line(e)}") from None
    bad = [name for name, t in gm.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise RunError(f"checkpoint {path} has non-finite weights ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
    return gm.to(device).eval(), dict(cfg, pairs=ckpt.get("pairs", cfg["train"]["pairs"]),   # pairs trained at
                                      weights=weights if weights == "ema" else ckpt.get("weights", "trained"),
                                      step=ckpt["step"])


@torch.no_grad()
def evaluate_baseline(gm, task, K_list, device, batch_size=250):
    """EM and token accuracy of a baselines.py model for each K (RMT re-reads the context K times)."""
    res = []
    for K in K_list:
        em = acc = 0.0
        by_pair = ByPair(task.n_pairs, device)
        for b in task.eval_batches(batch_size, device):
            logits = gm(b["ctx"], b["q"], b["y"], K=K)["logits"]
            e, a = score(logits, b["y"], b["y_mask"])
            em, acc = em + e, acc + a * len(b["y"])
            by_pair.add(logits, b)
        res.append(dict(K_eval=K, em=em / len(task.eval[0]), acc=acc / len(task.eval[0]), **by_pair.result()))
    return res


class ByPair:
    """Exact match split by the position of the queried pair in the context (1st ... N-th written) and by whether
    another key shares a character with the queried one; and how often the answer's first value character is
    another pair's instead (a value retrieved without matching the key)."""

    def __init__(self, n_pairs, device):
        self.hits, self.count = torch.zeros(n_pairs, device=device), torch.zeros(n_pairs, device=device)
        self.ov_hits, self.ov_count = torch.zeros(2, device=device), torch.zeros(2, device=device)
        self.wrong = 0.0

    def add(self, logits, b):
        hit = token_hits(logits, b["y"], b["y_mask"]).all(1).float()
        i = queried_pair(b["ctx"], b["q"])
        self.hits.index_add_(0, i, hit)
        self.count.index_add_(0, i, torch.ones_like(hit))
        ov = key_overlap(b["ctx"], b["q"]).long()                              # 0: keys all distinct in chars
        self.ov_hits.index_add_(0, ov, hit)
        self.ov_count.index_add_(0, ov, torch.ones_like(hit))
        first = logits[:, 0].argmax(-1)                                        # y = v v ! |: the first value char
        firsts = b["ctx"][:, :-1].reshape(len(first), -1, 7)[:, :, 4]          # every pair's first value char
        other = torch.arange(firsts.size(1), device=first.device)[None] != i[:, None]
        self.wrong += ((firsts == first[:, None]) & other).any(1).logical_and(first != b["y"][:, 0]).sum().item()

    def result(self):
        return dict(em_by_pair=(self.hits / self.count.clamp(min=1)).tolist(), n_by_pair=self.count.long().tolist(),
                    em_by_key_overlap=(self.ov_hits / self.ov_count.clamp(min=1)).tolist(),
                    n_by_key_overlap=self.ov_count.long().tolist(),
                    other_pair=self.wrong / self.count.sum().item())


@torch.no_grad()
def evaluate_ks(gm, task, K_list, device, batch_size=250):
    """One WRITE trajectory of max(K_list) steps per batch; READ and score at every K in K_list."""
    if not isinstance(gm, GradMem):
        return evaluate_baseline(gm, task, K_list, device, batch_size)
    kinds = torch.as_tensor(context_kinds(task.n_pairs), device=device)
    head = gm.write_head if gm.write_head is not None else gm.model.lm_head
    sums = {K: dict(em=0.0, acc=0.0, **{f"write_loss_{n}": 0.0 for n in ("all", "key", "value", "sep")}) for K in K_list}
    by_pair = {K: ByPair(task.n_pairs, device) for K in K_list}
    n = 0
    for b in tqdm(list(task.eval_batches(batch_size, device)), desc="eval", disable=None):
        B, mem = b["ctx"].size(0), None
        for k in range(max(K_list) + 1):
            mem = write(gm, b["ctx"], 0)[0] if mem is None else write(gm, b["ctx"], 1, mem)[0]   # M_0, then M_k
            if k not in sums:
                continue
            with torch.enable_grad():
                _, nll = write_loss(gm.model, head, mem, b["ctx"])        # Eq. (4) at M_k, per token
            _, logits = read_loss(gm.model, mem, b["q"], b["y"])
            n_em, acc = score(logits, b["y"], b["y_mask"])
            by_pair[k].add(logits, b)
            s = sums[k]
            s["em"] += n_em
            s["acc"] += acc * B
            for name, sel in (("all", None), ("key", KEY), ("value", VALUE), ("sep", SEP)):
                tok = nll if sel is None else nll[:, kinds == sel]
                s[f"write_loss_{name}"] += tok.mean(1).sum().item()
        n += B
    return [dict(K_eval=K, **{k: v / n for k, v in sums[K].items()}, **by_pair[K].result()) for K in K_list]


def check_out(out, overwrite):
    """--out must be a new .json file (or --overwrite) in an existing directory: never a checkpoint, never a
    directory, and an earlier result is not replaced unless asked."""
    parent = os.path.dirname(os.path.abspath(out))
    if not out.endswith(".json"):
        raise RunError(f"--out {out}: the output is JSON; give a path ending in .json")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise RunError(f"--out {out}: {parent} is not a writable directory")
    if os.path.isdir(out) or (os.path.exists(out) and not overwrite):
        raise RunError(f"--out {out} exists: pass --overwrite to replace it, or choose another --out")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", help="checkpoint written by train.py (best.pt or ckpt.pt)")
    p.add_argument("--K_eval", type=int, nargs="+", default=None,
                   help="WRITE steps at test time (default: the trained --K_eval, else K: the K best.pt was picked at)")
    p.add_argument("--alpha", type=float, default=None, help="inner lr alpha of Eq. (5) at test time (default: the trained one)")
    p.add_argument("--pairs", type=int, default=None, help="KV pairs (default: the pairs the checkpoint was trained at)")
    p.add_argument("--n_eval", type=int, default=None, help="held-out samples (default: the trained --n_eval; "
                   "another value or --pairs draws a set training did not exclude: at 1 pair a few percent "
                   "of it may repeat training contexts)")
    p.add_argument("--eval_seed", type=int, default=None, help="draw the held-out set from this seed (default: the "
                   "trained --eval_seed, the set best.pt was picked on; another seed gives a set nothing was chosen "
                   "on: --eval_seed 777 --n_eval 5000 is README's independent 8-pair set)")
    p.add_argument("--weights", default="saved", choices=["saved", "ema"], help="saved: the checkpoint's model "
                   "weights; ema: the averaged weights a ckpt.pt keeps (train.py --ema), e.g. a run's last ones")
    p.add_argument("--eval_file", default="", help="evaluate on this JSONL split")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default="", help="JSON output (default: <ckpt dir>/eval.json)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (by default an earlier "
                   "result is never replaced)")
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), "eval.json")
    try:
        check_out(out, args.overwrite)                      # before the evaluation, not after it
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        if device == "cuda" and not torch.cuda.is_available():
            raise RunError("--device cuda but no CUDA device is available")
        if args.eval_seed is not None and args.eval_seed < 0:
            raise RunError(f"--eval_seed must be >= 0, got {args.eval_seed}")
        if args.eval_seed is not None and args.eval_file:
            raise RunError("--eval_seed draws a held-out set and --eval_file reads one: give one of them")
        gm, cfg = load_model(args.ckpt, device, args.weights)
        tc = cfg["train"]
        K_list = args.K_eval or [cfg["gradmem"]["K"] if cfg["gradmem"]["K_eval"] < 0 else cfg["gradmem"]["K_eval"]]
        if args.alpha is not None:
            if not isinstance(gm, GradMem) or not 0 < args.alpha < float("inf"):
                raise RunError(f"--alpha needs a GradMem checkpoint and a finite alpha > 0, got {args.alpha}")
            gm.cfg.alpha = args.alpha
        if min(K_list) < 0:
            raise RunError(f"--K_eval must be >= 0, got {K_list}")
        if (args.pairs is not None and args.pairs < 1) or (args.n_eval is not None and args.n_eval < 1):
            raise RunError(f"--pairs and --n_eval must be >= 1, got {args.pairs}, {args.n_eval}")
        pairs = args.pairs or cfg["pairs"]            # a curriculum stage's checkpoint: its own number of pairs
        if not args.pairs and cfg["pairs"] != tc["pairs"]:
            print(f"note: {args.ckpt} is from the curriculum's {cfg['pairs']}-pair stage of a --pairs {tc['pairs']} "
                  f"run; evaluating at {cfg['pairs']} pairs (--pairs to choose)")
        try:
            eval_seed = tc["eval_seed"] if args.eval_seed is None else args.eval_seed
            task = KVTask(pairs, tc["seed"], eval_seed, args.n_eval or tc["n_eval"], eval_file=args.eval_file or None)
        except (ValueError, OSError) as e:
            raise RunError(str(e)) from None
        set_pairs(gm, pairs)
        results = evaluate_ks(gm, task, sorted(set(K_list)), device)
    except RunError as e:
        sys.exit(f"eval.py: error: {e}")
    print(f"{args.ckpt} (step {cfg['step']}): {pairs} pairs, {len(task.eval[0])} held-out samples, trained with K={cfg['gradmem']['K']}"
          + (", the averaged weights (train.py --ema)" if cfg["weights"] == "ema" else ""))
    print(f"{'K_eval':>6} {'EM':>7} {'tok acc':>8} {'L_write':>8} {'key':>7} {'value':>7} {'sep':>7}")
    for r in results:
        wl = " ".join(f"{r[f'write_loss_{n}']:>{w}.4f}" if f"write_loss_{n}" in r else f"{'-':>{w}}"   # baselines:
                      for n, w in (("all", 8), ("key", 7), ("value", 7), ("sep", 7)))                      # no WRITE loss
        print(f"{r['K_eval']:>6} {r['em']:>7.4f} {r['acc']:>8.4f} {wl}")
    for r in results:
        print(f"K_eval={r['K_eval']}: EM by queried pair, in the order written (1 .. {pairs}): "
              + " ".join(f"{x:.2f}" for x in r["em_by_pair"])
              + f"; first value character from another pair: {r['other_pair']:.3f}")
        (e0, e1), (n0, n1) = r["em_by_key_overlap"], r["n_by_key_overlap"]
        print(f"K_eval={r['K_eval']}: EM {e0:.4f} where no other key shares a character with the queried one "
              f"({n0} samples), {e1:.4f} where one does ({n1})")
    with open(out + ".tmp", "w") as f:
        json.dump(dict(ckpt=args.ckpt, weights=cfg["weights"], step=cfg["step"], pairs=pairs, n_eval=len(task.eval[0]),
                       eval_set=args.eval_file or f"eval_seed {eval_seed}", K_train=cfg["gradmem"]["K"],
                       alpha=gm.cfg.alpha if isinstance(gm, GradMem) else None,
                       results=results), f, indent=1)
    os.replace(out + ".tmp", out)
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
