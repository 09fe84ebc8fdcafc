"""
Evaluate a GradMem checkpoint (arXiv:2603.13875v2) on held-out KV retrieval, rebuilt from the checkpoint alone.

    python eval.py out/quick/best.pt                          # at the K the checkpoint was trained and picked at
    python eval.py out/quick/best.pt --K_eval 0 1 2 5          # Figure 4a: more WRITE steps at test time
    python eval.py out/quick/best.pt --K_eval 2 --alpha 0.15 --out out/quick/eval_a0.15.json   # another inner lr

For each K in --K_eval it reports exact match and token accuracy of the value characters after K WRITE steps,
and the WRITE loss L_write(M_K) (Eq. 4) split into key, value and separator tokens (Figure 4b, Appendix E),
and EM split by the position of the queried pair in the context (which pairs the memory keeps) and by whether
another key shares a character with the queried one. A group no held-out sample falls in prints "no samples" and
is null in the JSON. Prints a table and writes the same numbers as JSON (--out, default <ckpt dir>/eval.json; an
existing file only with --overwrite).
"""
import argparse
import json
import os
import sys
import zipfile

import torch
from tqdm import tqdm

from data import KEY, SEP, VALUE, KVTask, context_kinds, key_overlap, queried_pair
from gradmem import GradMem, GradMemConfig, read_loss, score, token_hits, write, write_loss
from model import GPTConfig
from train import RunError, TrainConfig, build, load_checkpoint, one_line, set_pairs


def check_ckpt_path(path):
    """The checkpoint path names an existing file (a directory: say which checkpoint in it to give)."""
    if os.path.isdir(path):
        inside = [f for f in ("best.pt", "ckpt.pt") if os.path.isfile(os.path.join(path, f))]
        raise RunError(f"cannot read checkpoint {path}: it is a directory"
                       + (f"; give a checkpoint in it, e.g. {os.path.join(path, inside[0])}" if inside else ""))
    if not os.path.exists(path):
        raise RunError(f"checkpoint not found: {path}")


def read_checkpoint(path):
    """train.load_checkpoint, with a path that is no file and a file that is no PyTorch checkpoint each refused in a
    line of its own: torch's own error for such a file advises loading it unrestricted, which is no help here."""
    check_ckpt_path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise RunError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    if not zipfile.is_zipfile(path) and not head.startswith(b"\x80"):     # torch.save: a zip (or a legacy pickle)
        what = ("an empty file" if not head else "a zip archive cut short or corrupted" if head.startswith(b"PK")
                else "not a PyTorch checkpoint file")
        raise RunError(f"cannot read checkpoint {path}: {what}")
    try:
        return load_checkpoint(path)
    except RunError as e:
        if "weights_only" not in str(e):
            raise
        raise RunError(f"cannot read checkpoint {path}: not a train.py checkpoint (it holds objects other than the "
                       f"tensors and plain Python types train.py saves)") from None


def load_model(path, device="cpu", weights="saved"):
    """Rebuild the model of a checkpoint from its stored config alone. weights="saved": the weights its model entry
    holds (a best.pt: whichever of the trained and averaged weights scored higher; a ckpt.pt: the trained ones);
    "ema": the averaged weights (train.py --ema) a ckpt.pt keeps beside them, e.g. the last ones of a run, which no
    held-out evaluation chose."""
    ckpt = read_checkpoint(path)
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
    another pair's instead (a value retrieved without matching the key). A group with no samples has EM None."""

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
        """EM of each group, None (null in the JSON) for a group no sample fell in, beside each group's count."""
        def ratio(hits, count):
            return [h / c if c else None for h, c in zip(hits.tolist(), count.long().tolist())]
        total = self.count.sum().item()
        return dict(em_by_pair=ratio(self.hits, self.count), n_by_pair=self.count.long().tolist(),
                    em_by_key_overlap=ratio(self.ov_hits, self.ov_count), n_by_key_overlap=self.ov_count.long().tolist(),
                    other_pair=self.wrong / total if total else None)


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


def em_of(em):
    """An EM for the printed report; a group without samples has none."""
    return "no samples" if em is None else f"EM {em:.4f}"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in its help, the description's examples as laid out."""


class Parser(argparse.ArgumentParser):
    """A bad flag value: one line naming it, exit status 2 (the usage is under --help)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser():
    """The command line: every flag with its help and its default shown."""
    p = Parser(prog="eval.py", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("ckpt", help="checkpoint written by train.py (best.pt or ckpt.pt of its --out_dir)")
    p.add_argument("--K_eval", type=int, nargs="+", default=None, metavar="K",
                   help="WRITE steps at test time, one evaluation per value, each >= 0; None: the checkpoint's "
                   "trained --K_eval, else its K (the K best.pt was picked at)")
    p.add_argument("--alpha", type=float, default=None, help="inner lr alpha of Eq. (5) at test time, finite and > 0 "
                   "(GradMem checkpoints only); None: the trained alpha")
    p.add_argument("--pairs", type=int, default=None, help="KV pairs per context, >= 1; None: the pairs the "
                   "checkpoint was trained at")
    p.add_argument("--n_eval", type=int, default=None, help="held-out samples, >= 1; None: the trained --n_eval. "
                   "Another value or --pairs draws a set training did not exclude: at 1 pair a few percent of it "
                   "may repeat training contexts")
    p.add_argument("--eval_seed", type=int, default=None, help="draw the held-out set from this seed, >= 0; None: "
                   "the trained --eval_seed, the set best.pt was picked on. Another seed gives a set nothing was "
                   "chosen on (--eval_seed 777 --n_eval 5000: README's independent 8-pair set)")
    p.add_argument("--weights", default="saved", choices=["saved", "ema"], help="saved: the checkpoint's model "
                   "weights; ema: the averaged weights a ckpt.pt keeps (train.py --ema), e.g. a run's last ones")
    p.add_argument("--eval_file", default=None, help="evaluate on this JSONL split (data.py save_jsonl) instead of "
                   "a drawn set; None: draw it from --eval_seed")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to evaluate; auto: "
                   "cuda when available, else cpu")
    p.add_argument("--out", default=None, help="JSON output, a new .json file; None: eval.json beside the checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (otherwise an existing "
                   "result is never replaced)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), "eval.json")
    try:
        if args.K_eval is not None and min(args.K_eval) < 0:          # flags first: nothing loaded for a bad one
            raise RunError(f"--K_eval must be >= 0, got {' '.join(map(str, args.K_eval))}")
        if (args.pairs is not None and args.pairs < 1) or (args.n_eval is not None and args.n_eval < 1):
            raise RunError(f"--pairs and --n_eval must be >= 1, got {args.pairs}, {args.n_eval}")
        if args.alpha is not None and not 0 < args.alpha < float("inf"):
            raise RunError(f"--alpha must be finite and > 0, got {args.alpha}")
        if args.eval_seed is not None and args.eval_seed < 0:
            raise RunError(f"--eval_seed must be >= 0, got {args.eval_seed}")
        if args.eval_seed is not None and args.eval_file:
            raise RunError("--eval_seed draws a held-out set and --eval_file reads one: give one of them")
        if args.eval_file and not os.path.isfile(args.eval_file):
            raise RunError(f"--eval_file {args.eval_file}: " + ("it is a directory" if os.path.isdir(args.eval_file)
                                                                   else "no such file"))
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        if device == "cuda" and not torch.cuda.is_available():
            raise RunError("--device cuda but no CUDA device is available")
        check_ckpt_path(args.ckpt)
        check_out(out, args.overwrite)                      # before the evaluation, not after it
        gm, cfg = load_model(args.ckpt, device, args.weights)
        tc = cfg["train"]
        K_list = args.K_eval or [cfg["gradmem"]["K"] if cfg["gradmem"]["K_eval"] < 0 else cfg["gradmem"]["K_eval"]]
        if args.alpha is not None:
            if not isinstance(gm, GradMem):
                raise RunError(f"--alpha needs a GradMem checkpoint; {args.ckpt} is a {tc.get('model', 'gradmem')} one")
            gm.cfg.alpha = args.alpha
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
        by_pair = ", ".join(f"{i}: " + ("no samples" if x is None else f"{x:.2f}") for i, x in enumerate(r["em_by_pair"], 1))
        other = "no samples" if r["other_pair"] is None else f"{r['other_pair']:.3f}"
        print(f"K_eval={r['K_eval']}: EM by queried pair, in the order written: {by_pair}; "
              f"first value character from another pair: {other}")
        (e0, e1), (n0, n1) = r["em_by_key_overlap"], r["n_by_key_overlap"]
        print(f"K_eval={r['K_eval']}: {em_of(e0)} where no other key shares a character with the queried one "
              f"({n0} samples), {em_of(e1)} where one does ({n1})")
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
