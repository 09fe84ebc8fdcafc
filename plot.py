"""
Figures for GradMem (arXiv:2603.13875v2) from this project's own logs: reads only out_dir/log.jsonl and eval.json.

    python plot.py curves results/kv4/log.jsonl results/kv8/log.jsonl -o results/curves.png   # held-out EM vs step
    python plot.py keval results/kv8/eval.json -o results/fig4.png                           # Figure 4a/4b
    python plot.py memsize out/appF_*/log.jsonl -o appF.png        # App. F: EM vs m, K (runs that reached their --pairs)

`curves` plots held-out exact match against training step (and wall time) for each run, with a dotted line where a
run's curriculum moved on to more pairs;
`keval` plots EM against K_eval (Fig. 4a) and the WRITE loss on key and value tokens (Fig. 4b, App. E);
`memsize` plots each run's best held-out EM against its number of memory vectors m, one line per (pairs, K) (App. F).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def header(recs):
    """The first header record (argv, config, commit) of a log, or None."""
    return next((r for r in recs if r.get("kind") == "header"), None)


def label_of(path, recs):
    head = header(recs)
    if head is None:
        return os.path.basename(os.path.dirname(path)) or path
    t, g = head["config"]["train"], head["config"]["gradmem"]
    name, model = os.path.basename(os.path.dirname(path)), t.get("model", "gradmem")
    if model == "gradmem":
        return f"{name}: N={t['pairs']} K={g['K']} m={g['n_mem']} {g['meta_grad']}"
    return f"{name}: {model} N={t['pairs']}" + (f" K={g['K']}" if model == "rmt" else "")


def wall_minutes(ev):
    """Each record's run clock restarts at 0 after --resume: continue it from the record resumed from."""
    out, offset, prev = [], 0.0, 0.0
    for r in ev:
        if r["time"] < prev:
            offset += prev
        prev = r["time"]
        out.append((offset + r["time"]) / 60)
    return out


def best_em(rec):
    """An evaluation's EM: of the trained weights, or of their average (train.py --ema) where that is higher, as
    train.py picks best.pt."""
    return max(rec["em"], rec.get("ema_em", -1.0))


def stage_changes(recs):
    """The curriculum's stage records (train.py --curriculum_em), each with the step and the new number of pairs."""
    return [r for r in recs if r.get("kind") == "stage"]


def plot_curves(paths, out):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.cm.tab20.colors if len(paths) > 10 else plt.cm.tab10.colors     # one colour per run
    for i, path in enumerate(paths):
        recs = read_jsonl(path)
        ev = [r for r in recs if r.get("kind") == "eval"]
        if not ev:
            raise ValueError(f"{path}: no eval records")
        lab = label_of(path, recs)
        line, = ax1.plot([r["step"] for r in ev], [100 * r["em"] for r in ev], label=lab, color=colors[i % len(colors)])
        ax2.plot(wall_minutes(ev), [100 * r["em"] for r in ev], label=lab, color=line.get_color())
        avg = [r for r in ev if "ema_em" in r]         # train.py --ema: the averaged weights, dashed
        if avg:
            ax1.plot([r["step"] for r in avg], [100 * r["ema_em"] for r in avg], ls="--", lw=1, color=line.get_color(),
                     label=f"{lab} (averaged weights)")
            ax2.plot(wall_minutes(avg), [100 * r["ema_em"] for r in avg], ls="--", lw=1, color=line.get_color())
        for r in stage_changes(recs):      # --curriculum_em: where the run moved on to more pairs
            ax1.axvline(r["step"], ls=":", lw=0.8, color=line.get_color())
            ax1.annotate(f" N={r['pairs']}", (r["step"], 0.02), xycoords=("data", "axes fraction"), fontsize=7,
                         color=line.get_color(), rotation=90, va="bottom")
    ax1.set(xlabel="training step", ylabel="held-out exact match (%)", title="KV retrieval")
    ax2.set(xlabel="wall time of the run (min)", ylabel="held-out exact match (%)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_keval(paths, out):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for path in paths:
        with open(path) as f:
            ev = json.load(f)
        res = ev["results"]
        ks = [r["K_eval"] for r in res]
        lab = f"N={ev['pairs']}, K_train={ev['K_train']}"
        ax1.plot(ks, [100 * r["em"] for r in res], "o-", label=lab)
        ax1.axvline(ev["K_train"], ls="--", color="r", lw=0.8)     # extrapolation starts here (Fig. 4a)
        ax2.plot(ks, [r["write_loss_key"] for r in res], "o-", label=f"{lab}: key tokens")
        ax2.plot(ks, [r["write_loss_value"] for r in res], "s--", label=f"{lab}: value tokens")
    ax1.set(xlabel="WRITE steps at test time K_eval", ylabel="exact match (%)", title="Fig. 4a: more WRITE steps")
    ax2.set(xlabel="WRITE steps at test time K_eval", ylabel="L_write(M_K) per token (nats)", title="Fig. 4b: inner loss")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def memsize_points(paths):
    """App. F: {(pairs, K): [(n_mem, best EM at the run's final number of pairs), ...] sorted by n_mem}."""
    points = {}
    for path in paths:
        recs = read_jsonl(path)
        head = header(recs)
        if head is None:
            raise ValueError(f"{path}: no header record")
        t, g = head["config"]["train"], head["config"]["gradmem"]
        ev = [r for r in recs if r.get("kind") == "eval" and r.get("pairs", t["pairs"]) == t["pairs"]]
        if not ev:
            raise ValueError(f"{path}: no eval records at {t['pairs']} pairs")
        points.setdefault((t["pairs"], g["K"]), []).append((g["n_mem"], max(best_em(r) for r in ev)))
    return {key: sorted(v) for key, v in sorted(points.items())}


def plot_memsize(paths, out):
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for (pairs, K), pts in memsize_points(paths).items():
        ax.plot([m for m, _ in pts], [100 * em for _, em in pts], "o-" if K == 1 else "s--", label=f"N={pairs}, K={K}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="memory vectors m", ylabel="best held-out exact match (%)", title="App. F: memory size vs WRITE steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("figure", choices=["curves", "keval", "memsize"])
    p.add_argument("inputs", nargs="+", help="log.jsonl files (curves, memsize) or eval.json files (keval)")
    p.add_argument("-o", "--out", required=True, help="output image (.png, .pdf)")
    args = p.parse_args(argv)
    try:
        dict(curves=plot_curves, keval=plot_keval, memsize=plot_memsize)[args.figure](args.inputs, args.out)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"plot.py: error: {e.__class__.__name__}: {e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
