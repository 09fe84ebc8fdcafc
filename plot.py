"""
Figures for GradMem (arXiv:2603.13875v2) from this project's own logs: reads only out_dir/log.jsonl, eval.json and
eval.py --cost's JSON.

    python plot.py curves out/quick/log.jsonl -o out/quick/curves.png  # held-out EM vs step (a line per log)
    python plot.py keval out/quick/eval.json -o out/quick/fig4.png     # Fig. 4a/4b from eval.py --K_eval 0 1 2 5
    python plot.py memsize out/appF_*/log.jsonl -o appF.png  # App. F: EM vs m, K (runs that reached their --pairs)
    python plot.py cost out/quick/cost.json -o out/quick/cost.png      # App. D from eval.py --cost: break-even
    python plot.py compress out/compress.jsonl -o out/appI.png        # App. I: tools/compress_curve.py token accuracy

`curves` plots held-out exact match against training step (and wall time) for each run, one marker per evaluation,
with a dotted line where a run's curriculum moved on to more pairs;
`keval` plots EM against K_eval (Fig. 4a) and the WRITE loss on key and value tokens (Fig. 4b, App. E);
`memsize` plots each run's best held-out EM against its number of memory vectors m, one line per (pairs, K) (App. F);
`cost` plots the total time and FLOPs of answering q queries about one context, GradMem per K against the
full-context transformer with a KV cache, with the break-even q* marked (App. D, Fig. 7).
"""
import argparse
import json
import os
import sys
from contextlib import contextmanager

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backend_bases import FigureCanvasBase  # noqa: E402


class InputError(Exception):
    """Bad input: main prints it as one line and exits non-zero."""


def open_input(path):
    """The input file opened for reading, or one InputError line naming what is wrong with the path."""
    if os.path.isdir(path):
        raise InputError(f"{path} is a directory, not a file")
    try:
        return open(path, encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None


def read_jsonl(path):
    """A train.py log.jsonl: one JSON object per line."""
    recs = []
    with open_input(path) as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError:
            raise InputError(f"{path}: not a train.py log.jsonl (not UTF-8 text)") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            if n == len(lines) and not line.endswith("\n") and recs:     # a last line cut short by a kill
                print(f"note: {path}:{n}: skipped its unfinished last line", file=sys.stderr)
                continue
            raise InputError(f"{path}:{n}: not a train.py log.jsonl (each line one JSON object)")
        recs.append(rec)
    return recs


def read_results(path, what, row_ok=lambda r: True):
    """A JSON object whose "results" is a non-empty list of rows that pass row_ok; otherwise one line naming `what`."""
    with open_input(path) as f:
        try:
            rec = json.load(f)
        except ValueError:            # JSONDecodeError, UnicodeDecodeError
            rec = None
    if not isinstance(rec, dict) or not isinstance(rec.get("results"), list) or not rec["results"] \
            or not all(row_ok(r) for r in rec["results"]):
        raise InputError(f"{path}: not {what}")
    return rec


def read_eval(path):
    """An eval.py eval.json."""
    return read_results(path, "an eval.py eval.json (a JSON object with its results)")


def header(recs):
    """The first header record (argv, config, commit) of a log, or None."""
    return next((r for r in recs if r.get("kind") == "header"), None)


def label_of(path, recs):
    head = header(recs)
    if head is None:
        return os.path.basename(os.path.dirname(path)) or path
    t, g = head["config"]["train"], head["config"]["gradmem"]
    name, model = os.path.basename(os.path.dirname(path)), t.get("model", "gradmem")
    task = f"N={t['pairs']}" if t.get("task", "kv") == "kv" else t["task"] + (f" qa{t['qa']}" if t["task"] == "babi" else "")
    if model == "gradmem":
        return f"{name}: {task} K={g['K']} m={g['n_mem']} {g['meta_grad']}"
    return f"{name}: {model} {task}" + (f" K={g['K']}" if model == "rmt" else "")


def task_title(recs_list):
    """The title of a curves figure: KV retrieval, or the text task its logs trained on."""
    tasks = {(header(r) or {}).get("config", {}).get("train", {}).get("task", "kv") for r in recs_list}
    names = dict(kv="KV retrieval", babi="bAbI", squad="short SQuAD", lm="WikiText LM (score: minus CE)", compress="compression")
    return " / ".join(names.get(t, t) for t in sorted(tasks))


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


@contextmanager
def fields_of(path, what):
    """A record of path without a field the figure reads (or with one of another type): one line naming the file."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise InputError(f"{path}: not {what} this figure reads ({e.__class__.__name__}: {e})") from None


def check_out(out):
    """-o: an image format matplotlib writes, in an existing directory; checked before any input is read."""
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext not in formats:
        raise InputError(f"-o {out}: give an image file ending in one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise InputError(f"-o {out}: {parent} is not a directory")
    if os.path.isdir(out):
        raise InputError(f"-o {out} is a directory")


def save(fig, out, rect=(0, 0, 1, 1)):
    """Write the figure and close it (its artists stay readable); returns it. rect: the part of the figure the axes
    fill (room left below for a legend)."""
    fig.tight_layout(rect=rect)
    try:
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise InputError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return fig


def plot_curves(paths, out):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.cm.tab20.colors if len(paths) > 10 else plt.cm.tab10.colors     # one colour per run
    all_recs = []
    for i, path in enumerate(paths):
        with fields_of(path, "a train.py log.jsonl"):
            recs = read_jsonl(path)
            all_recs.append(recs)
            ev = [r for r in recs if r.get("kind") == "eval"]
            if not ev:
                raise InputError(f"{path}: no eval records (train.py writes one every --eval_interval steps)")
            lab = label_of(path, recs)
            line, = ax1.plot([r["step"] for r in ev], [100 * r["em"] for r in ev], "o-", ms=4, label=lab,
                             color=colors[i % len(colors)])             # a marker per evaluation: one shows too
            ax2.plot(wall_minutes(ev), [100 * r["em"] for r in ev], "o-", ms=4, label=lab, color=line.get_color())
            avg = [r for r in ev if "ema_em" in r]         # train.py --ema: the averaged weights, dashed, triangles
            if avg:
                ax1.plot([r["step"] for r in avg], [100 * r["ema_em"] for r in avg], "^--", ms=3, lw=1,
                         color=line.get_color(), label=f"{lab} (averaged weights)")
                ax2.plot(wall_minutes(avg), [100 * r["ema_em"] for r in avg], "^--", ms=3, lw=1, color=line.get_color())
            for r in stage_changes(recs):      # --curriculum_em: where the run moved on to more pairs
                ax1.axvline(r["step"], ls=":", lw=0.8, color=line.get_color())
                ax1.annotate(f" N={r['pairs']}", (r["step"], 0.02), xycoords=("data", "axes fraction"), fontsize=7,
                             color=line.get_color(), rotation=90, va="bottom")
    ax1.set(xlabel="training step", ylabel="held-out exact match (%)", title=task_title(all_recs))
    ax2.set(xlabel="wall time of the run (min)", ylabel="held-out exact match (%)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    return save(fig, out)


def plot_keval(paths, out):
    """Fig. 4a / 4b: one colour per model (eval.json); WRITE loss on value tokens solid, on key tokens dotted; the
    model's training K marked on its line; the legend below the axes, off the data."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
    colors = plt.cm.tab10.colors
    for i, path in enumerate(paths):
        ev = read_eval(path)
        with fields_of(path, "an eval.py eval.json"):
            res, c = ev["results"], colors[i % len(colors)]
            ks = [r["K_eval"] for r in res]
            lab = f"N={ev['pairs']}, trained at K={ev['K_train']}"
            ax1.plot(ks, [100 * r["em"] for r in res], "o-", color=c, label=lab)
            at = [r for r in res if r["K_eval"] == ev["K_train"]]      # extrapolation starts here (Fig. 4a)
            if at:
                ax1.plot([ev["K_train"]], [100 * at[0]["em"]], "*", ms=14, color=c, mec="k")
            wl = [r for r in res if "write_loss_key" in r]           # a baseline's eval.json has no WRITE loss
            if wl:
                ax2.plot([r["K_eval"] for r in wl], [r["write_loss_value"] for r in wl], "o-", color=c)
                ax2.plot([r["K_eval"] for r in wl], [r["write_loss_key"] for r in wl], "o:", lw=1, ms=3, color=c)
    ax1.set(xlabel="WRITE steps at test time K_eval", ylabel="exact match (%)",
            title="Fig. 4a: EM vs test-time WRITE steps (star: trained K)")
    ax2.set(xlabel="WRITE steps at test time K_eval", ylabel="L_write(M_K) per token (nats)",
            title="Fig. 4b: WRITE loss, value tokens (solid) and keys (dotted)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.legend(*ax1.get_legend_handles_labels(), loc="lower center", ncol=min(4, len(paths)), fontsize=8, frameon=False)
    return save(fig, out, rect=(0, 0.07 + 0.04 * ((len(paths) - 1) // 4), 1, 1))


def memsize_points(paths):
    """App. F: {(pairs, K): [(n_mem, best EM at the run's final number of pairs), ...] sorted by n_mem}."""
    points = {}
    for path in paths:
        with fields_of(path, "a train.py log.jsonl"):
            recs = read_jsonl(path)
            head = header(recs)
            if head is None:
                raise InputError(f"{path}: no header record (not a train.py log.jsonl)")
            t, g = head["config"]["train"], head["config"]["gradmem"]
            ev = [r for r in recs if r.get("kind") == "eval" and r.get("pairs", t["pairs"]) == t["pairs"]]
            if not ev:
                raise InputError(f"{path}: no eval records at {t['pairs']} pairs")
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
    return save(fig, out)


def plot_compress(paths, out):
    """App. I: token accuracy of text read back from memory against the tokens N written, one line per (m, K), from
    tools/compress_curve.py's JSONL (the best alpha of each point)."""
    best = {}
    for path in paths:
        for r in read_jsonl(path):
            if not {"N", "n_mem", "K", "token_acc"} <= r.keys():
                raise InputError(f"{path}: a line without N, n_mem, K and token_acc: not tools/compress_curve.py output")
            key = (r["n_mem"], r["K"], r["N"])
            best[key] = max(best.get(key, 0.0), r["token_acc"])
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for m, K in sorted({(m, K) for m, K, _ in best}):
        Ns = sorted(N for mm, KK, N in best if (mm, KK) == (m, K))
        ax.plot(Ns, [100 * best[m, K, N] for N in Ns], "o-" if m == 1 else "s--", label=f"m={m}, K={K}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="tokens written N", ylabel="token accuracy from memory (%)", title="App. I: text compression")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, out)


def read_cost(path):
    """An eval.py --cost JSON."""
    return read_results(path, "an eval.py --cost JSON (a JSON object with its results per context length)",
                        lambda r: isinstance(r, dict) and "write" in r)


def cost_lines(r, unit):
    """One context length's cost lines: {name: (once, per query, break-even q or "never")} in `unit` (time_s or
    flops), GradMem with the cached READ (WRITE and M_K's KV cache once, then a READ over it) per K, then full
    context (prefill once, then a query over the KV cache, break-even None)."""
    key = "time" if unit == "time_s" else "flops"
    lines = {}
    for w, be in zip(r["write"], r["break_even"]):
        if w["K"] != be["K"]:
            raise KeyError(f"break_even K={be['K']} beside write K={w['K']}")
        lines[f"GradMem K={w['K']}"] = (w[unit] + r["memory_prefill"][unit], r["read_cached"][unit], be[key])
    lines["full context"] = (r["prefill"][unit], r["per_query"][unit], None)
    return lines


def plot_cost(paths, out):
    """App. D / Fig. 7: total cost of answering q queries about one context, GradMem (one colour per K) against the
    full-context transformer with a KV cache (black, dashed); time on top, FLOPs below, a column per context length;
    a star and q* where each GradMem line crosses the full-context one. One input file."""
    if len(paths) != 1:
        raise InputError(f"cost draws one eval.py --cost JSON, got {len(paths)} files")
    path = paths[0]
    rec = read_cost(path)
    with fields_of(path, "an eval.py --cost JSON"):
        res = rec["results"]
        fig, axes = plt.subplots(2, len(res), figsize=(5.2 * len(res), 7.4), squeeze=False)
        colors = plt.cm.tab10.colors
        for col, r in enumerate(res):
            for row, (unit, scale, ylabel) in enumerate((("time_s", 1e3, "total time (ms)"),
                                                         ("flops", 1e-9, "total GFLOP"))):
                ax, lines = axes[row][col], cost_lines(r, unit)
                finite = [q for *_, q in lines.values() if isinstance(q, int)]
                q_max = max(10, round(1.3 * max(finite))) if finite else 100
                qs = [0, q_max]
                never = []
                for i, (name, (once, per, q_star)) in enumerate(lines.items()):
                    full = name == "full context"
                    c = "k" if full else colors[i % len(colors)]
                    ax.plot(qs, [scale * (once + q * per) for q in qs], "--" if full else "-", color=c,
                            lw=2 if full else 1.6, label=name)
                    if isinstance(q_star, int):
                        ax.plot([q_star], [scale * (once + q_star * per)], "*", ms=13, color=c, mec="k", zorder=3)
                        ax.annotate(f"q*={q_star}", (q_star, scale * (once + q_star * per)), xytext=(6, -12),
                                    textcoords="offset points", fontsize=8, color=c,
                                    bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.5))
                    elif not full:
                        never.append(name.split()[-1])
                plain = ", ".join(f"K={be['K']}: {be[('time' if unit == 'time_s' else 'flops') + '_plain_read']}"
                                  for be in r["break_even"])
                note = ([f"never breaks even: {', '.join(never)}"] if never else []) + [f"plain READ q*: {plain}"]
                ax.text(0.02, 0.98, "\n".join(note), transform=ax.transAxes, fontsize=7, va="top", color="0.3")
                ax.set(xlim=(0, q_max), ylim=(0, None), xlabel="queries about the same context q", ylabel=ylabel)
                ax.grid(alpha=0.3)
            axes[0][col].set_title(f"T = {r['ctx_tokens']} context tokens ({r['pairs']} KV pairs)")
    dev = rec.get("device_name") or rec.get("device", "")
    fig.suptitle(f"App. D: cost of q queries, batch {rec.get('batch', '?')}, {dev}, {rec.get('threads', '?')} "
                 f"thread(s)", fontsize=10)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(lines), fontsize=8, frameon=False)
    fig.text(0.5, 0.045, "GradMem: WRITE (K steps) and the KV cache of M_K once, then per query a READ of [Q; Y] over "
             "it; full context: prefill once, then per query [Q; Y] over the context's KV cache",
             ha="center", fontsize=7, color="0.3")
    return save(fig, out, rect=(0, 0.07, 1, 0.97))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in its help, the description's examples as laid out."""


class Parser(argparse.ArgumentParser):
    """A bad flag value: one line naming it, exit status 2 (the usage is under --help)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser():
    """The command line: every flag with its help and its default shown."""
    p = Parser(prog="plot.py", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("figure", choices=["curves", "keval", "memsize", "cost", "compress"], help="which figure: curves (EM vs "
                   "step and wall time), keval (Fig. 4a/4b: EM and WRITE loss vs K_eval), memsize (App. F: best EM vs m), "
                   "cost (App. D: cost vs queries and the break-even), compress (App. I: token accuracy vs N)")
    p.add_argument("inputs", nargs="+", help="train.py log.jsonl files (curves, memsize), eval.py eval.json files "
                   "(keval), one line or point set each; one eval.py --cost JSON (cost); tools/compress_curve.py JSONL (compress)")
    p.add_argument("-o", "--out", required=True, default=argparse.SUPPRESS,
                   help="output image, e.g. a .png or .pdf path in an existing directory")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        check_out(args.out)
        dict(curves=plot_curves, keval=plot_keval, memsize=plot_memsize, cost=plot_cost,
             compress=plot_compress)[args.figure](args.inputs, args.out)
    except InputError as e:
        plt.close("all")
        sys.exit(f"plot.py: error: {e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
