"""
Evaluate a GradMem checkpoint (arXiv:2603.13875v2) on held-out KV retrieval, rebuilt from the checkpoint alone.

    python eval.py out/quick/best.pt                          # at the K the checkpoint was trained and picked at
    python eval.py out/quick/best.pt --K_eval 0 1 2 5          # Figure 4a: more WRITE steps at test time
    python eval.py out/quick/best.pt --K_eval 2 --alpha 0.15 --out out/quick/eval_a0.15.json   # another inner lr
    python eval.py out/quick/best.pt --cost --out out/quick/cost.json    # App. D: compute break-even (no accuracy)
    python eval.py --cost --cost_T 256 --out out/cost.json              # the same for the default model, untrained

For each K in --K_eval it reports exact match and token accuracy of the value characters after K WRITE steps,
and the WRITE loss L_write(M_K) (Eq. 4) split into key, value and separator tokens (Figure 4b, Appendix E),
and EM split by the position of the queried pair in the context (which pairs the memory keeps) and by whether
another key shares a character with the queried one. A group no held-out sample falls in prints "no samples" and
is null in the JSON. Prints a table and writes the same numbers as JSON (--out, default <ckpt dir>/eval.json; an
existing file only with --overwrite).

--cost measures instead when writing a context into memory pays off (Appendix D). For each context length T (KV
contexts of N = (T - 1) // 7 pairs) it times (median of --cost_repeats runs) and counts the FLOPs (FlopCounterMode)
of a WRITE of K steps for each K in --cost_K (weights frozen, no meta-gradient); of a READ of one query from M_K,
both as gradmem.read_loss computes it (teacher forced over [M_K; Q; Y]) and over a KV cache of M_K built once per
context ([Q; Y] only); and of the same transformer answering from the context's KV cache: the prefill over C once,
then per query a forward of [Q; Y] over the cache. From these it finds the break-even number of queries q*, the
smallest q with (one-time + q per-query cost) of GradMem <= that of full context ("never" if none), in time and in
FLOPs, and lists the memory each keeps per context (m x d floats; n_layer x 2 x T x d for the KV cache). Timings
and FLOPs do not depend on the weights: without a checkpoint it builds the default KV model (4 layers, d = 128,
m = 8) untrained. Writes the numbers as JSON (--out, default <ckpt dir>/cost.json, or cost.json without a
checkpoint); plot.py cost draws them.
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import zipfile

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from tqdm import tqdm

from baselines import FullContext
from data import KEY, N_KEYS, SEP, VALUE, KVTask, context_kinds, key_overlap, queried_pair, sample_kv, to_batch
from gradmem import GradMem, GradMemConfig, read_loss, score, token_hits, write, write_loss
from model import GPTConfig, apply_rope, rope_tables
from train import RunError, TrainConfig, build, evaluate, load_checkpoint, make_task, one_line, score_text, set_pairs


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


# ---------------------------------------------------------------- --cost: the compute break-even of App. D


COST_DEFAULTS = dict(cost_T=[256, 1024], cost_K=[1, 2, 5], cost_batch=1, cost_repeats=5)   # App. D's lengths


def kv_cache_forward(model, x, cache, start):
    """model's forward for new input embeddings x (B, L, C) at positions start..start+L-1 of a sequence whose keys and
    values (after RoPE) are kept per layer in `cache`, a list of (keys, values) buffers (B, n_head, capacity, hs): the
    new tokens write theirs into buffer rows start..start+L-1 and attend to rows 0..start+L-1 (the cached ones and,
    causally, each other). Returns the final hidden states (B, L, C). With start = 0 it is the prefill; a later call
    at start = P answers a query over a P-token prefix and leaves rows 0..P-1 as they were, so every query sees the
    same context. Equal to model(whole sequence)[:, start:] (test_kv_cache_forward_equals_the_full_forward)."""
    B, L, C = x.shape
    cfg, end = model.config, start + L
    if cfg.n_kv_head not in (0, cfg.n_head) or cfg.parallel_residual:
        raise RunError("--cost measures the KV model's layout: no grouped-query attention, no parallel residual")
    pos = torch.arange(start, end, device=x.device)
    rope = None
    if cfg.pos == "learned":
        x = x + model.transformer.wpe(pos)
    else:
        rope = rope_tables(model.rope_inv_freq, pos, x.dtype)
    mask = None if start == 0 else torch.arange(end, device=x.device)[None, :] <= pos[:, None]   # (L, end)
    for block, (kbuf, vbuf) in zip(model.transformer.h, cache):
        att = block.attn
        q, k, v = (t.view(B, L, att.n_head, -1).transpose(1, 2) for t in att.c_attn(block.ln_1(x)).split(C, dim=2))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        kbuf[:, :, start:end], vbuf[:, :, start:end] = k, v
        y = F.scaled_dot_product_attention(q, kbuf[:, :, :end], vbuf[:, :, :end], attn_mask=mask, is_causal=start == 0)
        x = x + att.c_proj(y.transpose(1, 2).reshape(B, L, C))
        x = x + block.mlp(block.ln_2(x))
    return model.transformer.ln_f(x)


def new_kv_cache(model, B, capacity, device, dtype):
    """Empty per-layer (keys, values) buffers for kv_cache_forward: room for `capacity` positions."""
    c = model.config
    shape = (B, c.n_head, capacity, c.n_embd // c.n_head)
    return [(torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))
            for _ in range(c.n_layer)]


def break_even(write, read, prefill, per_query):
    """The smallest number of queries q >= 1 after which writing the context once and reading q answers from memory
    costs no more than full context: write + q read <= prefill + q per_query. None ("never") when no q does, i.e. when
    a READ is no cheaper than a full-context query and the first query is not already cheaper."""
    fits = lambda q: write + q * read <= prefill + q * per_query
    if fits(1):
        return 1
    if read >= per_query:
        return None
    q = max(1, math.ceil((write - prefill) / (per_query - read)))
    while not fits(q):                              # rounding of the division: step to the exact smallest q
        q += 1
    while q > 1 and fits(q - 1):
        q -= 1
    return q


def sdpa_cpu_flops(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


def sdpa_cpu_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, query, key, value)


# torch's FlopCounterMode counts the GPU attention kernels but not the CPU one (it would count 0 there): the same
# formulas for it, so a CPU and a GPU count agree. Attention is counted over the whole query x key score matrix
# (causal masking not discounted), as torch counts every attention kernel.
SDPA_CPU_FLOPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu_flops,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_cpu_backward_flops}


def count_flops(fn):
    """FLOPs of one call of fn() as FlopCounterMode counts them (matmuls and attention, forward and backward)."""
    with FlopCounterMode(display=False, custom_mapping=SDPA_CPU_FLOPS) as fc:
        fn()
    return fc.get_total_flops()


def median_time(fn, device, repeats):
    """Median wall time in seconds of `repeats` calls of fn() after one warm-up call."""
    times = []
    for i in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def measure_cost(gm, T, K_list, B, repeats, device, seed=0):
    """App. D at one context length T, for B contexts of N = (T - 1) // 7 KV pairs (7 N + 1 <= T tokens) with one
    query each: time and FLOPs of
      write           a WRITE of K steps, for each K in K_list;
      read            a READ of one query as gradmem.read_loss computes it: [M_K; Q; Y] through every layer;
      memory_prefill  the keys and values of the m memory positions, once per context (a KV cache of M_K), and
      read_cached     a READ over that cache: [Q; Y] only, as the full-context model answers over its cache;
      prefill         the same transformer keeping the context's KV cache, once per context, and
      per_query       one query [Q; Y] answered over that cache;
    the memory each keeps per context; and for each K the break-even number of queries in time and in FLOPs, with
    the cached READ (WRITE + memory_prefill once, read_cached per query: like for like with the full context's
    cache) and with the plain READ (WRITE once, read per query)."""
    N = (T - 1) // 7
    b = to_batch(*sample_kv(np.random.default_rng([seed, N]), B, N), device=device)
    ctx, q, y = b["ctx"], b["q"], b["y"]
    model, n, L = gm.model, ctx.size(1), q.size(1) + y.size(1) - 1           # READ input [Q; y_1 .. y_{L-1}]
    qy = model.embed(torch.cat([q, y[:, :-1]], dim=1))
    dtype = qy.dtype
    cache = new_kv_cache(model, B, n + L, device, dtype)

    def prefill():
        kv_cache_forward(model, model.embed(ctx), cache, 0)

    def per_query():                                   # the last y.size(1) positions predict y, as in READ
        model.lm_head(kv_cache_forward(model, qy, cache, n)[:, -y.size(1):])

    mem = write(gm, ctx, max(K_list))[0]
    m = mem.size(1)
    mem_cache = new_kv_cache(model, B, m + L, device, dtype)

    def memory_prefill():                              # M_K's keys and values, once per context
        kv_cache_forward(model, mem, mem_cache, 0)

    def read_cached():                                 # = read_loss's logits (test_cached_read_equals_read_loss)
        model.lm_head(kv_cache_forward(model, qy, mem_cache, m)[:, -y.size(1):])

    passes = dict(prefill=prefill, per_query=per_query, read=lambda: read_loss(model, mem, q, y),
                  memory_prefill=memory_prefill, read_cached=read_cached)
    prefill()                                          # the caches every per-query call reads
    memory_prefill()
    cost = {name: dict(time_s=median_time(fn, device, repeats), flops=count_flops(fn)) for name, fn in passes.items()}
    writes = []
    for K in K_list:
        step = lambda: write(gm, ctx, K)
        writes.append(dict(K=K, time_s=median_time(step, device, repeats), flops=count_flops(step)))
    c = model.config
    res = dict(T=T, pairs=N, ctx_tokens=n, query_tokens=q.size(1), answer_tokens=y.size(1),
               memory_floats=dict(gradmem=gm.memory_floats(n), gradmem_kv=c.n_layer * 2 * m * c.n_embd,
                                  full_context=FullContext(model).memory_floats(n)),
               write=writes, **cost, break_even=[])
    for w in writes:
        be = dict(K=w["K"])
        for unit, key in (("time", "time_s"), ("flops", "flops")):
            full = cost["prefill"][key], cost["per_query"][key]
            be[unit] = break_even(w[key] + cost["memory_prefill"][key], cost["read_cached"][key], *full) or "never"
            be[f"{unit}_plain_read"] = break_even(w[key], cost["read"][key], *full) or "never"
        res["break_even"].append(be)
    return res


def default_gradmem():
    """The paper's KV model (model.py's and gradmem.py's defaults: 4 layers, d = 128, m = 8), untrained: time and
    FLOPs do not depend on the weights."""
    torch.manual_seed(0)
    return build(dict(model=GPTConfig(), gradmem=GradMemConfig(), train=TrainConfig()))


def run_cost(args, out):
    """--cost: measure, print a table per context length, write the JSON."""
    for flag, value, default in (("--K_eval", args.K_eval, None), ("--alpha", args.alpha, None),
                                 ("--pairs", args.pairs, None), ("--n_eval", args.n_eval, None),
                                 ("--eval_seed", args.eval_seed, None), ("--eval_file", args.eval_file, None),
                                 ("--weights", args.weights, "saved")):
        if value != default:
            raise RunError(f"{flag} evaluates accuracy and does not apply to --cost (timings and FLOPs do not depend "
                           f"on the weights or the data)")
    if min(args.cost_T) < 8 or min(args.cost_K) < 1 or args.cost_batch < 1 or args.cost_repeats < 1:
        raise RunError(f"--cost_T must be >= 8 (one KV pair is 8 tokens), --cost_K, --cost_batch and --cost_repeats "
                       f">= 1, got {' '.join(map(str, args.cost_T))}; {' '.join(map(str, args.cost_K))}; "
                       f"{args.cost_batch}; {args.cost_repeats}")
    if max(args.cost_T) > 7 * N_KEYS + 1:
        raise RunError(f"--cost_T must be <= {7 * N_KEYS + 1}: a KV context holds at most {N_KEYS} distinct keys, "
                       f"got {max(args.cost_T)}")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda but no CUDA device is available")
    if args.ckpt:
        check_ckpt_path(args.ckpt)
    check_out(out, args.overwrite)
    if args.ckpt:
        gm, cfg = load_model(args.ckpt, device)
        if not isinstance(gm, GradMem):
            raise RunError(f"--cost needs a GradMem checkpoint; {args.ckpt} is a {cfg['train'].get('model')} one")
        if gm.cfg.memory != "input":
            raise RunError(f"--cost measures input memory (§2.2); {args.ckpt} keeps its memory as per-layer key/value "
                           f"slots (--memory {gm.cfg.memory}, App. J)")
    else:
        gm = default_gradmem().to(device).eval()
    c = gm.model.config
    K_list = sorted(set(args.cost_K))
    results = [measure_cost(gm, T, K_list, args.cost_batch, args.cost_repeats, device) for T in sorted(set(args.cost_T))]
    threads = torch.get_num_threads()
    print(f"{args.ckpt or 'the default KV architecture, untrained'}: {c.n_layer} layers, d = {c.n_embd}, "
          f"m = {gm.cfg.n_mem} ({gm.cfg.memory} memory); {device}, {threads} thread(s), batch {args.cost_batch}, "
          f"median of {args.cost_repeats} runs")
    for r in results:
        print(f"T = {r['T']}: {r['pairs']} pairs, {r['ctx_tokens']} context tokens; query {r['query_tokens']} + "
              f"answer {r['answer_tokens']} tokens")
        print(f"  {'':<28} {'ms':>9} {'GFLOP':>9}")
        rows = [(f"WRITE K={w['K']}", w) for w in r["write"]] + [
            ("READ [M_K; Q; Y]", r["read"]), ("KV cache of M_K, once", r["memory_prefill"]),
            ("READ [Q; Y] over that cache", r["read_cached"]), ("full context: prefill", r["prefill"]),
            ("full context: one query", r["per_query"])]
        for name, v in rows:
            print(f"  {name:<28} {1e3 * v['time_s']:>9.3f} {v['flops'] / 1e9:>9.4f}")
        for be in r["break_even"]:
            print(f"  break-even queries, K={be['K']}: {be['time']} in time, {be['flops']} in FLOPs (cached READ); "
                  f"{be['time_plain_read']} in time, {be['flops_plain_read']} in FLOPs (plain READ)")
        mf = r["memory_floats"]
        print(f"  memory per context (floats): GradMem {mf['gradmem']:,} (its KV cache {mf['gradmem_kv']:,}), "
              f"full context (KV cache) {mf['full_context']:,}, {mf['full_context'] / mf['gradmem']:.0f}x GradMem's")
    cpu = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    record = dict(
        source=args.ckpt or "default KV architecture, untrained (eval.py --cost without a checkpoint)",
        model=dict(n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head, n_hidden=c.n_hidden, vocab_size=c.vocab_size,
                   n_mem=gm.cfg.n_mem, memory=gm.cfg.memory, params=gm.model.num_params()),
        device=device, device_name=torch.cuda.get_device_name() if device == "cuda" else cpu, threads=threads,
        load_average=list(os.getloadavg()) if hasattr(os, "getloadavg") else None, torch=torch.__version__,
        dtype=str(next(gm.parameters()).dtype).replace("torch.", ""), batch=args.cost_batch, repeats=args.cost_repeats,
        method=dict(
            contexts="KV contexts of N = (T - 1) // 7 pairs (7 N + 1 tokens), B of them, one query each",
            write="evaluation WRITE: K gradient steps on M from M_0, weights frozen, no meta-gradient (gradmem.write)",
            read="one teacher-forced forward over [M_K; Q; y_1..y_{L-1}] with the LM head on the L answer positions "
                 "(gradmem.read_loss, as eval.py scores): the m memory positions go through every layer per query",
            read_cached="memory_prefill: one forward over M_K keeping each layer's keys and values, once per context; "
                        "read_cached: one forward over [Q; y_1..y_{L-1}] attending to them, LM head on the L answer "
                        "positions (the same logits as read)",
            full_context="the same model with the context's KV cache: prefill = one forward over C keeping each "
                         "layer's keys and values; per query = one forward over [Q; y_1..y_{L-1}] attending to the "
                         "cache and causally to itself, LM head on the L answer positions (kv_cache_forward)",
            time="median wall time of `repeats` calls after one warm-up",
            flops="torch FlopCounterMode: matmuls and attention, forward and backward; attention over the whole "
                  "query x key score matrix (causal masking not discounted)",
            break_even="smallest q >= 1 with once + q per-query-cost <= prefill + q per_query; 'never' if none. "
                       "time/flops: once = WRITE + memory_prefill, per query read_cached; *_plain_read: once = WRITE, "
                       "per query read",
            memory_floats="gradmem: its memory (m x d); gradmem_kv: the KV cache of M_K the cached READ keeps "
                          "(n_layer x 2 x m x d); full_context: its KV cache, n_layer x 2 x context tokens x d"),
        results=results)
    with open(out + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(out + ".tmp", out)
    print(f"wrote {out}")
    return record


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
    p.add_argument("ckpt", nargs="?", default=None, help="checkpoint written by train.py (best.pt or ckpt.pt of its "
                   "--out_dir); required except with --cost, which without one builds the default KV model untrained")
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
    p.add_argument("--data_dir", default=None, help="text tasks: the data folder, if not where training read it")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to evaluate; auto: "
                   "cuda when available, else cpu")
    p.add_argument("--cost", action="store_true", help="measure the compute break-even of App. D (time, FLOPs, "
                   "memory of WRITE, READ and a KV-cached full-context transformer) instead of evaluating accuracy")
    p.add_argument("--cost_T", type=int, nargs="+", default=COST_DEFAULTS["cost_T"], metavar="T", help="--cost: context lengths "
                   "in tokens, each >= 8: KV contexts of (T - 1) // 7 pairs, 7 N + 1 <= T tokens")
    p.add_argument("--cost_K", type=int, nargs="+", default=COST_DEFAULTS["cost_K"], metavar="K", help="--cost: WRITE steps, "
                   "one measurement each, each >= 1")
    p.add_argument("--cost_batch", type=int, default=COST_DEFAULTS["cost_batch"], help="--cost: contexts processed at once (one query each), >= 1")
    p.add_argument("--cost_repeats", type=int, default=COST_DEFAULTS["cost_repeats"], help="--cost: timed runs of each pass after one warm-up, "
                   "their median reported, >= 1")
    p.add_argument("--out", default=None, help="JSON output, a new .json file; None: eval.json (cost.json with "
                   "--cost) beside the checkpoint, or cost.json in the current directory with --cost and no checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (otherwise an existing "
                   "result is never replaced)")
    return p


def evaluate_text_ckpt(args, gm, cfg, K_list, device, out):
    """A text task's checkpoint (bAbI, SQuAD, LM, compression): its task rebuilt from the stored config (the
    generated bAbI test stories of --eval_seed; --n_eval chunks of LM and compression), its metrics and L_write(M_0)
    at each K (train.evaluate_text)."""
    tc = dict(cfg["train"])
    if args.pairs is not None or args.eval_file:
        raise RunError(f"--pairs and --eval_file are KV flags; {args.ckpt} is a --task {tc['task']} checkpoint")
    tc.update(eval_seed=tc["eval_seed"] if args.eval_seed is None else args.eval_seed, n_eval=args.n_eval or tc["n_eval"],
              resume=False, max_samples=1, data_dir=args.data_dir or tc.get("data_dir", ""))     # one training sample is read
    try:
        task = make_task(TrainConfig(**tc))
    except (ValueError, OSError) as e:
        raise RunError(str(e)) from None
    results = [dict(K_eval=K, **evaluate(gm, task, K, device)) for K in sorted(set(K_list))]
    print(f"{args.ckpt} (step {cfg['step']}): {task.name}, {len(task.eval)} held-out samples, trained with "
          f"K={cfg['gradmem']['K']}" + (", the averaged weights (train.py --ema)" if cfg["weights"] == "ema" else ""))
    for r in results:
        print(f"K_eval={r['K_eval']}: {score_text(r)}" + (f" | L_write(M_0) {r['write_loss0']:.4f} -> L_write(M_K) "
                                                           f"{r['write_lossK']:.4f}" if "write_lossK" in r else ""))
    with open(out + ".tmp", "w") as f:
        json.dump(dict(ckpt=args.ckpt, weights=cfg["weights"], step=cfg["step"], task=task.name, n_eval=len(task.eval),
                       eval_seed=tc["eval_seed"], K_train=cfg["gradmem"]["K"], results=results), f, indent=1)
    os.replace(out + ".tmp", out)
    print(f"wrote {out}")
    return results


def main(argv=None):
    args = build_parser().parse_args(argv)
    name = "cost.json" if args.cost else "eval.json"
    out = args.out or (os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), name) if args.ckpt else name)
    try:
        if args.cost:
            return run_cost(args, out)
        if args.ckpt is None:
            raise RunError("give a checkpoint to evaluate (only --cost runs without one)")
        for flag, default in COST_DEFAULTS.items():
            if getattr(args, flag) != default:
                raise RunError(f"--{flag} applies to --cost only")
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
        if tc.get("task", "kv") != "kv":
            return evaluate_text_ckpt(args, gm, cfg, K_list, device, out)
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
