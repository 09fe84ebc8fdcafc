"""
Memory as a file: WRITE a context into GradMem's memory once, then answer queries from the file alone.
"GradMem: Learning to Write Context into Memory with Test-Time Gradient Descent", arXiv:2603.13875v2, §2.2.

    L_write(M; C) = - sum_i log f(t_i | [M; t_<i])          Eq. (4)  per token, as in gradmem.py
    M_{k+1}       = M_k - alpha grad_M L_write(M_k; C)      Eq. (5)  K steps, or until L_write(M_k) < --write_until
    y_j           = argmax_v f(v | [M_K; Q; y_<j])          Eq. (8)  READ, decoded greedily up to the end marker |

    python memory.py write out/quick/ckpt.pt --weights ema --context '!qT:bb!!FQ:k1!!0R:YA!!ND:Oq!|' --out mem.pt
    python memory.py read out/quick/ckpt.pt mem.pt --query '?!FQ:' --query '?!ND:'
    python memory.py curve out/quick/ckpt.pt --weights ema --thresholds 2.0 1.5 1.0 0.5 --eval_seed 777 --out curve.json

A memory file is a torch.save dict of tensors and plain types (read with torch.load(weights_only=True)): M_K
(float32, n_mem x n_embd), the sha256 of the weights that wrote it, K, alpha, L_write(M_k) per token for k = 0..K,
the context's token count, n_mem and n_embd. The sha256 is over the model's state_dict as loaded (with --weights ema,
the averaged weights), each tensor's name, dtype, shape and bytes in sorted name order; only weights with the same
hash read the file.
"""
import hashlib
import json
import math
import os
import sys
import time
import zipfile

import torch
from tqdm import tqdm

from data import BAR, PAD, STOI, VOCAB, KVTask
from eval import HelpFormatter, Parser, check_ckpt_path, check_out, load_model
from gradmem import GradMem, read_loss, token_hits, write, write_loss, write_until
from train import RunError, one_line

FORMAT, VERSION = "gradmem-memory", 1
MAX_NEW = 8                                   # READ decodes at most this many tokens (a KV target v1 v2 ! | has 4)
CHARS = "".join(c for c in STOI if len(c) == 1)                   # the tokenizer's characters (no special tokens)
FIELDS = dict(format=str, version=int, memory=torch.Tensor, weights_sha256=str, weights=str, K=int, alpha=float,
              write_loss=list, n_tokens=int, n_mem=int, n_embd=int)


def weights_sha256(module):
    """sha256 over the module's state_dict: each tensor's name, dtype, shape and bytes, in sorted name order."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tokenize(text, what):
    """data.py's character tokenizer; a character outside it, or no text, is one RunError naming it."""
    if not text:
        raise RunError(f"{what} is empty")
    bad = next((i for i, c in enumerate(text) if c not in CHARS), None)
    if bad is not None:
        raise RunError(f"{what} has {text[bad]!r} at character {bad + 1}, outside the tokenizer's characters "
                       f"(a-z A-Z 0-9 ! ? : |)")
    return [STOI[c] for c in text]


def read_text(path, what):
    """A UTF-8 text file's contents without the trailing line break."""
    if os.path.isdir(path) or not os.path.isfile(path):
        raise RunError(f"{what} {path}: " + ("it is a directory" if os.path.isdir(path) else "no such file"))
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise RunError(f"{what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def load_gradmem(path, weights, device):
    """eval.load_model, for GradMem checkpoints only (the baselines have no gradient WRITE)."""
    check_ckpt_path(path)
    gm, cfg = load_model(path, device, weights)
    if not isinstance(gm, GradMem):
        raise RunError(f"{path} is a {cfg['train'].get('model')} checkpoint; memory.py needs a GradMem one")
    return gm, cfg


@torch.no_grad()
def greedy_read(model, mem, q, max_new=MAX_NEW):
    """READ, Eq. (8), decoded greedily: y_j = argmax f(. | [M_K; Q; y_<j]) until every row has produced the end
    marker | or max_new tokens. mem: (B, m, C) (or (B, n_layer, 2, m, C), App. J); q: (B, Lq) ids. Returns (B, <=max_new)."""
    y = q[:, :0]
    for _ in range(max_new):
        ids = torch.cat([q, y], 1)
        if mem.dim() == 3:
            h = model(torch.cat([mem, model.embed(ids)], 1), "sdpa")            # [M_K; Q; y_<j]
        else:
            h = model(model.embed(ids), "sdpa", prefix=mem)                     # App. J: [Q; y_<j] over the KV slots
        y = torch.cat([y, model.lm_head(h[:, -1]).argmax(-1, keepdim=True)], 1)
        if (y == BAR).any(1).all():
            break
    return y


def answer_text(ids):
    """Decoded READ output: up to the end marker, the target's trailing !| dropped (KV targets are v1 v2 ! |)."""
    ids = ids[:ids.index(BAR) + 1] if BAR in ids else ids
    text = "".join(VOCAB[i] for i in ids)
    return text[:-2] if text.endswith("!|") else f"{text} (no end marker !| in {len(ids)} tokens)"


def load_memory(path):
    """A memory file, checked: readable, complete, each field of its type, M_K float32, finite and n_mem x n_embd."""
    if os.path.isdir(path) or not os.path.isfile(path):
        raise RunError(f"memory file {path}: " + ("it is a directory" if os.path.isdir(path) else "no such file"))
    with open(path, "rb") as f:
        head = f.read(4)
    if not zipfile.is_zipfile(path):                                            # torch.save writes a zip archive
        what = ("an empty file" if not head else "truncated or corrupted (a zip archive without its end)"
                if head.startswith(b"PK") else "not a torch.save file")
        raise RunError(f"cannot read memory file {path}: {what}")
    try:
        rec = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RunError(f"cannot read memory file {path}: corrupted or not tensors and plain types "
                       f"({one_line(e)[:160]})") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        kind = ("a train.py checkpoint" if isinstance(rec, dict) and {"model", "config"} <= rec.keys()
                else f"it has no format entry {FORMAT!r}")
        raise RunError(f"{path} is not a memory file written by memory.py write ({kind})")
    bad = [k for k, t in FIELDS.items() if not isinstance(rec.get(k), t)]
    if bad or rec["version"] != VERSION:
        raise RunError(f"memory file {path} is incomplete or of another version (fields {', '.join(bad) or 'version'})")
    mem = rec["memory"]
    if (mem.dtype != torch.float32 or mem.dim() < 2 or tuple(mem.shape[-2:]) != (rec["n_mem"], rec["n_embd"])
            or not torch.isfinite(mem).all() or len(rec["write_loss"]) != rec["K"] + 1):
        raise RunError(f"memory file {path} is inconsistent: its memory is {mem.dtype} {tuple(mem.shape)}, its header "
                       f"says n_mem {rec['n_mem']} x n_embd {rec['n_embd']} after K={rec['K']} steps")
    return rec


def check_fits(rec, gm, sha, mem_path, ckpt_path, weights):
    """The memory file fits this model: the same memory shape, written by the same weights."""
    if tuple(rec["memory"].shape) != tuple(gm.mem0.shape):
        raise RunError(f"memory file {mem_path} holds a memory of shape {tuple(rec['memory'].shape)}, but {ckpt_path} "
                       f"reads one of shape {tuple(gm.mem0.shape)} (n_mem x n_embd)")
    if rec["weights_sha256"] != sha:
        raise RunError(f"memory file {mem_path} was written by weights sha256 {rec['weights_sha256']} (--weights "
                       f"{rec['weights']}), but {ckpt_path} --weights {weights} has sha256 {sha}: read it with the "
                       f"weights that wrote it")


def check_new_file(out, ckpt, overwrite):
    """--out: a file in a writable directory, not the checkpoint; an existing one is replaced only with --overwrite,
    and only if it is a memory file."""
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise RunError(f"--out {out}: " + ("it is a directory" if os.path.isdir(out) else f"{parent} is not a writable directory"))
    if os.path.exists(out):
        if os.path.samefile(out, ckpt):
            raise RunError(f"--out {out} is the checkpoint itself")
        if not overwrite:
            raise RunError(f"--out {out} exists: pass --overwrite to replace it, or choose another --out")
        load_memory(out)                                     # --overwrite replaces memory files only


def device_of(name):
    device = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    if device == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda but no CUDA device is available")
    return device


def check_alpha(alpha):
    if alpha is not None and not 0 < alpha < math.inf:
        raise RunError(f"--alpha must be finite and > 0, got {alpha}")


def cmd_write(args):
    """WRITE one context into a memory file (fixed --K, or --write_until with --K_max)."""
    if args.write_until is not None and args.K is not None:
        raise RunError("--K fixes the WRITE steps and --write_until stops them at a loss: give one of them")
    if args.write_until is None and args.K_max is not None:
        raise RunError("--K_max bounds --write_until: give --write_until LOSS, or --K for a fixed number of steps")
    if args.write_until is not None and not 0 < args.write_until < math.inf:
        raise RunError(f"--write_until must be a finite loss > 0 (nats per token), got {args.write_until}")
    K_max = 10 if args.K_max is None else args.K_max
    if (args.K is not None and args.K < 1) or K_max < 1:
        raise RunError(f"--K and --K_max must be >= 1 (with no step M_K = M_0 holds nothing of the context), "
                       f"got {args.K if args.K is not None else K_max}")
    check_alpha(args.alpha)
    text = args.context if args.context_file is None else read_text(args.context_file, "--context_file")
    ctx_ids = tokenize(text, "the context" if args.context_file is None else f"--context_file {args.context_file}")
    check_ckpt_path(args.ckpt)
    check_new_file(args.out, args.ckpt, args.overwrite)
    device = device_of(args.device)
    gm, cfg = load_gradmem(args.ckpt, args.weights, device)
    mc = gm.model.config
    if gm.cfg.n_mem + len(ctx_ids) - 1 > mc.block_size:
        raise RunError(f"the context has {len(ctx_ids)} tokens: with {gm.cfg.n_mem} memory vectors that is more than "
                       f"the model's {mc.block_size} positions")
    gc = cfg["gradmem"]
    K = args.K if args.K is not None else gc["K"] if gc["K_eval"] < 0 else gc["K_eval"]
    if K < 1:
        raise RunError(f"{args.ckpt} was trained with K={K} WRITE steps: give --K >= 1")
    alpha = gm.cfg.alpha if args.alpha is None else args.alpha
    ctx = torch.tensor([ctx_ids], device=device)
    threshold = -math.inf if args.write_until is None else args.write_until      # -inf: never stops, K steps
    mem, steps, losses = write_until(gm, ctx, threshold, K if args.write_until is None else K_max, alpha)
    steps, losses = int(steps[0]), losses[0].tolist()
    if not all(map(math.isfinite, losses)) or not torch.isfinite(mem).all():
        raise RunError(f"WRITE diverged (L_write per step: {', '.join(f'{x:.3g}' for x in losses)}); try a smaller --alpha")
    rec = dict(format=FORMAT, version=VERSION, memory=mem[0].float().cpu().contiguous(),
               weights_sha256=weights_sha256(gm), weights=args.weights, K=steps, alpha=float(alpha),
               write_until=args.write_until, K_max=None if args.write_until is None else K_max, write_loss=losses,
               n_tokens=len(ctx_ids), n_mem=gm.cfg.n_mem, n_embd=mc.n_embd, ckpt=os.path.abspath(args.ckpt))
    torch.save(rec, args.out + ".tmp")
    os.replace(args.out + ".tmp", args.out)                # atomic: never a half-written memory file
    size, cache = os.path.getsize(args.out), mc.n_layer * 2 * len(ctx_ids) * mc.n_embd * 4
    stop = (f", --write_until {args.write_until}: " + ("reached" if losses[-1] < args.write_until else "not reached")
            + f" in {steps} of at most {K_max}") if args.write_until is not None else ""
    print(f"wrote {args.out}: {len(ctx_ids)} context tokens into {tuple(mem.shape[1:])} memory, K={steps} WRITE steps "
          f"at alpha {alpha:g}{stop}; L_write per token " + " -> ".join(f"{x:.4f}" for x in losses))
    if steps == 0:
        print(f"note: L_write(M_0) is already below --write_until {args.write_until}: the memory is M_0, which holds "
              f"nothing of the context")
    print(f"memory file {size:,} bytes (M_K: {mem[0].numel() * 4:,} bytes of float32); a full-context transformer's "
          f"KV cache for these {len(ctx_ids)} tokens: n_layer {mc.n_layer} x 2 x T {len(ctx_ids)} x n_embd "
          f"{mc.n_embd} x 4 bytes = {cache:,} bytes")
    return dict(rec, size=size, kv_cache_bytes=cache)


def cmd_read(args):
    """Answer each query from the memory file alone (Eq. 8), one line each: QUERY -> ANSWER."""
    if args.queries_file is not None:
        queries = [line for line in read_text(args.queries_file, "--queries_file").splitlines() if line.strip()]
        if not queries:
            raise RunError(f"--queries_file {args.queries_file} holds no query")
    else:
        queries = args.query
    ids = [tokenize(q, f"query {q!r}") for q in queries]
    check_ckpt_path(args.ckpt)
    rec = load_memory(args.memory)
    device = device_of(args.device)
    weights = args.weights or rec["weights"]
    gm, _ = load_gradmem(args.ckpt, weights, device)
    check_fits(rec, gm, weights_sha256(gm), args.memory, args.ckpt, weights)
    longest = max(map(len, ids))
    if rec["n_mem"] + longest + MAX_NEW > gm.model.config.block_size:
        raise RunError(f"a query of {longest} tokens does not fit the model's {gm.model.config.block_size} positions")
    mem = rec["memory"].to(device)[None]
    answers = []
    for q, qi in zip(queries, ids):
        out = greedy_read(gm.model, mem, torch.tensor([qi], device=device))[0].tolist()
        answers.append(answer_text(out))
        print(f"{q} -> {answers[-1]}")
    return answers


@torch.no_grad()
def curve(gm, task, thresholds, K_max, alpha, device, batch_size=250):
    """Exact match and WRITE steps for each --write_until threshold, and for every fixed K = 0..K_max, from one WRITE
    trajectory M_0 .. M_K_max per batch: a sample stops at the first M_k with L_write(M_k) < threshold (Eq. 4, per
    token), as gradmem.write_until does (test_write_until_stops_each_sample_at_its_threshold checks the two agree).
    EM is teacher-forced (gradmem.score: equal to greedy decoding's)."""
    gm.cfg.alpha = alpha                                                  # write() reads alpha from the config
    head = gm.write_head if gm.write_head is not None else gm.model.lm_head
    em_k, loss_k, n = torch.zeros(K_max + 1), torch.zeros(K_max + 1, dtype=torch.float64), 0
    sums = {t: dict(em=0, steps=0, reached=0, write_loss=0.0, steps_hist=[0] * (K_max + 1)) for t in thresholds}
    for b in tqdm(list(task.eval_batches(batch_size, device)), desc="curve", disable=None):
        ctx, B = b["ctx"], b["ctx"].size(0)
        n_tok = (ctx != PAD).sum(1).clamp(min=1)
        mems, losses, hits = [write(gm, ctx, 0)[0]], [], []
        for k in range(K_max + 1):
            if k < K_max:
                mem, info = write(gm, ctx, 1, mems[-1])                   # Eq. (5): M_{k+1}, and L_write(M_k)
                mems.append(mem)
                nll = info["nll"][0]
            else:
                with torch.enable_grad():
                    nll = write_loss(gm.model, head, mems[-1], ctx)[1]    # Eq. (4) at M_K_max
            losses.append(nll.sum(1) / n_tok)
            logits = read_loss(gm.model, mems[k], b["q"], b["y"])[1]        # Eq. (8) from M_k
            hits.append(token_hits(logits, b["y"], b["y_mask"]).all(1))
        losses, hits = torch.stack(losses, 1), torch.stack(hits, 1)      # (B, K_max + 1)
        em_k += hits.sum(0).cpu()
        loss_k += losses.sum(0).double().cpu()
        rows = torch.arange(B, device=ctx.device)
        for t, s in sums.items():
            below = losses < t
            steps = torch.where(below.any(1), below.int().argmax(1), K_max)     # the first k with L_write(M_k) < t
            s["em"] += int(hits[rows, steps].sum())
            s["steps"] += int(steps.sum())
            s["reached"] += int(below.any(1).sum())
            s["write_loss"] += float(losses[rows, steps].sum())
            for k in steps.tolist():
                s["steps_hist"][k] += 1
        n += B
    until = [dict(threshold=t, em=s["em"] / n, mean_steps=s["steps"] / n, reached=s["reached"] / n,
                  write_loss=s["write_loss"] / n, steps_hist=s["steps_hist"]) for t, s in sums.items()]
    return until, [dict(K=k, em=em_k[k].item() / n, write_loss=loss_k[k].item() / n) for k in range(K_max + 1)]


def cmd_curve(args):
    """--write_until thresholds against fixed K on the KV task's held-out set, written as JSON."""
    if not all(0 < t < math.inf for t in args.thresholds):
        raise RunError(f"--thresholds must be finite losses > 0, got {' '.join(map(str, args.thresholds))}")
    if args.K_max < 1 or args.n_eval < 1 or (args.eval_seed is not None and args.eval_seed < 0):
        raise RunError(f"--K_max and --n_eval must be >= 1 and --eval_seed >= 0, got {args.K_max}, {args.n_eval}, "
                       f"{args.eval_seed}")
    check_alpha(args.alpha)
    check_ckpt_path(args.ckpt)
    check_out(args.out, args.overwrite)
    device = device_of(args.device)
    gm, cfg = load_gradmem(args.ckpt, args.weights, device)
    tc, pairs = cfg["train"], cfg["pairs"]
    eval_seed = tc["eval_seed"] if args.eval_seed is None else args.eval_seed
    task = KVTask(pairs, tc["seed"], eval_seed, args.n_eval)
    alpha = gm.cfg.alpha if args.alpha is None else args.alpha
    t0 = time.perf_counter()
    until, fixed = curve(gm, task, sorted(set(args.thresholds), reverse=True), args.K_max, alpha, device)
    res = dict(ckpt=args.ckpt, weights=args.weights, weights_sha256=weights_sha256(gm), step=cfg["step"], pairs=pairs,
               n_eval=len(task.eval[0]), eval_seed=eval_seed, alpha=alpha, K_max=args.K_max, K_train=cfg["gradmem"]["K"],
               seconds=round(time.perf_counter() - t0, 1), threads=torch.get_num_threads(), write_until=until, fixed_K=fixed)
    print(f"{args.ckpt} ({args.weights} weights, step {cfg['step']}): {pairs} pairs, {res['n_eval']} samples of "
          f"eval_seed {eval_seed}, alpha {alpha:g}, at most {args.K_max} WRITE steps")
    print(f"{'--write_until':>13} {'mean steps':>10} {'EM':>7} {'reached':>8} {'L_write at stop':>15}  samples stopped at k = 0..K_max")
    for r in until:
        print(f"{r['threshold']:>13g} {r['mean_steps']:>10.3f} {r['em']:>7.4f} {r['reached']:>8.3f} "
              f"{r['write_loss']:>15.4f}  {' '.join(map(str, r['steps_hist']))}")
    print("fixed K: " + ", ".join(f"K={r['K']} EM {r['em']:.4f} L_write {r['write_loss']:.3f}" for r in fixed))
    with open(args.out + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    print(f"wrote {args.out} ({res['seconds']:.0f} s)")
    return res


def build_parser():
    p = Parser(prog="memory.py", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = dict(formatter_class=HelpFormatter)
    w = sub.add_parser("write", help="WRITE a context into a memory file", **common)
    r = sub.add_parser("read", help="answer queries from a memory file alone", **common)
    c = sub.add_parser("curve", help="EM and WRITE steps of --write_until thresholds against fixed K", **common)
    for s in (w, r, c):
        s.add_argument("ckpt", help="GradMem checkpoint written by train.py (ckpt.pt or best.pt)")
        s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available")
    for s in (w, c):
        s.add_argument("--weights", default="saved", choices=["saved", "ema"], help="saved: the checkpoint's model "
                       "weights; ema: the averaged weights a ckpt.pt keeps (train.py --ema)")
        s.add_argument("--alpha", type=float, default=None, help="inner lr alpha of Eq. (5); None: the checkpoint's")
        s.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    src = w.add_mutually_exclusive_group(required=True)
    src.add_argument("--context", help="the context, e.g. '!qT:bb!!FQ:k1!!0R:YA!!ND:Oq!|'")
    src.add_argument("--context_file", help="a UTF-8 text file holding the context (a trailing line break is dropped)")
    w.add_argument("--out", required=True, help="the memory file to write")
    w.add_argument("--K", type=int, default=None, help="WRITE steps K of Eq. (5), >= 1; None: the checkpoint's K_eval, else K")
    w.add_argument("--write_until", type=float, default=None, metavar="LOSS", help="step only until L_write(M_k) "
                   "(Eq. 4, nats per token) is below LOSS, finite and > 0, at most --K_max steps")
    w.add_argument("--K_max", type=int, default=None, help="most WRITE steps with --write_until; None: 10")
    r.add_argument("memory", help="memory file written by memory.py write")
    qs = r.add_mutually_exclusive_group(required=True)
    qs.add_argument("--query", action="append", help="a query, e.g. '?!FQ:' (repeat for more)")
    qs.add_argument("--queries_file", help="a text file of queries, one a line")
    r.add_argument("--weights", default=None, choices=["saved", "ema"], help="None: the weights the file was written with")
    c.add_argument("--thresholds", type=float, nargs="+", required=True, metavar="LOSS", help="--write_until losses")
    c.add_argument("--K_max", type=int, default=10, help="most WRITE steps per threshold; fixed K = 0..K_max are "
                   "scored beside them")
    c.add_argument("--n_eval", type=int, default=2000, help="held-out KV samples, at the checkpoint's pairs")
    c.add_argument("--eval_seed", type=int, default=None, help="seed of the held-out set; None: the checkpoint's")
    c.add_argument("--out", required=True, help="JSON output, a new .json file")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return dict(write=cmd_write, read=cmd_read, curve=cmd_curve)[args.cmd](args)
    except RunError as e:
        sys.exit(f"memory.py: error: {e}")


if __name__ == "__main__":
    main()
