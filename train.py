"""
Train GradMem (arXiv:2603.13875v2) or a baseline on associative key-value retrieval (§3.1, Table 1).

    python train.py --task kv --pairs 8 --K 1 --out_dir out/kv8     # from scratch: 1 -> 2 -> 4 -> 8 pairs (App. B)
    python train.py --task kv --pairs 16 --K 1 --init_from out/kv8/best.pt --out_dir out/kv16   # the next stage by hand
    python train.py --task kv --pairs 8 --K 1 --out_dir out/kv8 --resume   # continue a stopped run (same flags)
    python train.py --pairs 16 --K 5 --batch_size 32 --queries 1 --bench 5   # median s/step and peak memory (bench.py)
    torchrun --nproc_per_node 2 train.py --task kv --pairs 8 --K 1 --out_dir out/kv8   # 2 processes (see below)

Every flag is a field of GPTConfig (model.py), GradMemConfig (gradmem.py) or TrainConfig (below). Ctrl-C or SIGTERM
stops training after the current step and writes out_dir/ckpt.pt, which --resume continues.

Under torchrun every process (rank) builds the step's global --batch_size batch and trains on its own contiguous
slice of it (in --grad_accum micro-batches); the gradients are averaged over the ranks before the optimizer step, so
the weights stay the same on every rank and equal one process's on the same global batch. Rank 0 alone evaluates,
prints and writes files (its checkpoints resume under any number of processes); the others follow its decisions.
"""
import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields

import torch
from tqdm import tqdm

from baselines import ARMT, RMT, FullContext, LaCT, LaCTLM, Mamba, TTTLinearLM
from cuda_graph import GraphedStep, GraphError
from data import VOCAB, KVTask, save_jsonl
from ddp import (RANKS, DistributedError, average_over_ranks, distributed, rank0_decides, rank_slice,
                 same_weights_on_every_rank, stop_signal, wait_for_rank0)
from ema import RESET_GAP, WeightEMA
from gradmem import GradMem, GradMemConfig, score, write_grad
from model import GPT, GPTConfig


@dataclass
class TrainConfig:
    task: str = field(default="kv", metadata={"choices": ["kv"], "help": "the task: associative key-value retrieval, §3.1"})
    model: str = field(default="gradmem", metadata={"choices": ["gradmem", "rmt", "armt", "transformer", "mamba", "ttt_linear", "lact"],
                                                     "help": "the memory model (GradMem, or a baseline of baselines.py); --K and "
                                                             "--n_mem apply to rmt too"})
    pairs: int = field(default=16, metadata={"help": "key-value pairs N per context, §3.1"})
    batch_size: int = field(default=64, metadata={"help": "effective batch (split over --grad_accum)"})
    grad_accum: int = field(default=0, metadata={"help": "micro-batches per step; 0: as few as keep each micro-batch's "
                                                         "WRITE within 40,000 tokens x K (bounds peak memory)"})
    lr: float = field(default=3e-4, metadata={"help": "AdamW peak lr (the paper's: 1e-4; README, Deviations)"})
    warmup: int = field(default=200, metadata={"help": "linear warmup steps"})
    decay_steps: int = field(default=0, metadata={"help": "cosine decay to --min_lr over this many steps after warmup "
                                                           "(with the curriculum: from the start of its last stage), "
                                                           "then --min_lr (0: constant lr after warmup)"})
    min_lr: float = field(default=0.0, metadata={"help": "the lr at the end of --decay_steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (the authors': 0)"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this"})
    queries: int = field(default=-1, metadata={"help": "keys asked of each training context, all READ from its one M_K "
                                                       "(0: every pair; capped at the stage's pairs); evaluation asks one. GradMem "
                                                       "and RMT only; -1: 0 for GradMem, 1 for the other models (1 is the "
                                                       "paper's protocol)"})
    ema: float = field(default=0.999, metadata={"help": "decay of an exponential moving average of the weights "
                       "(ema.py), evaluated beside them; best.pt holds whichever scores higher (0: off)"})
    max_steps: int = field(default=20000, metadata={"help": "optimizer steps in all, over every curriculum stage"})
    eval_interval: int = field(default=250, metadata={"help": "evaluate and checkpoint every this many steps"})
    log_interval: int = field(default=50, metadata={"help": "log a training line every this many steps"})
    n_eval: int = field(default=1000, metadata={"help": "held-out samples per evaluation"})
    eval_seed: int = field(default=12345, metadata={"help": "seed of the held-out set (training data: --seed)"})
    target_em: float = field(default=1.0, metadata={"help": "stop once held-out EM reaches this"})
    patience: int = field(default=0, metadata={"help": "stop after this many evals without a better EM (0: never)"})
    curriculum_em: float = field(default=0.75, metadata={"help": "from scratch: train at 1, 2, 4, ... pairs up to --pairs, "
                                 "moving on when held-out EM reaches this (App. B); 0: --pairs from the first step. "
                                 "Off with --init_from or data files"})
    train_file: str = field(default="", metadata={"help": "train from this JSONL split instead of on-the-fly data"})
    eval_file: str = field(default="", metadata={"help": "evaluate on this JSONL split"})
    write_split: int = field(default=0, metadata={"help": "write N train samples and the eval set to out_dir as JSONL, then exit"})
    out_dir: str = field(default="out", metadata={"help": "where config.json, log.jsonl, ckpt.pt and best.pt go"})
    resume: bool = field(default=False, metadata={"help": "continue the run in --out_dir from its ckpt.pt (same flags)"})
    init_from: str = field(default="", metadata={"help": "start from this checkpoint's weights (curriculum over --pairs); "
                           "steps count from 0 again and batches are keyed by (--seed, step), so at the same --pairs and "
                           "--seed batches the start was trained on come again: pass another --seed for fresh ones"})
    device: str = field(default="auto", metadata={"choices": ["auto", "cpu", "cuda"], "help": "auto: CUDA if available"})
    dtype: str = field(default="float32", metadata={"choices": ["float32", "bfloat16"],
                                                   "help": "bfloat16: CUDA autocast (M and the WRITE update stay float32)"})
    seed: int = field(default=0, metadata={"help": "seed of the weights' initialisation and of the training data"})
    bench: int = field(default=0, metadata={"help": "time this many steps after warm-up, print median s/step and peak "
                                                      "memory as one JSON line, train nothing (bench.py; 0: off)"})
    profile: bool = field(default=False, metadata={"help": "with --bench: also print torch.profiler's self time per op for one step"})
    cuda_graph: bool = field(default=False, metadata={"help": "CUDA: record one micro-batch's WRITE, READ and meta-gradient "
                                                               "as a CUDA graph and replay it every step (skipped on CPU)"})
    compile: bool = field(default=False, metadata={"help": "GradMem, second order: torch.compile one WRITE step's gradient "
                                                            "(gradmem.write_grad) so its double backward runs fused; each "
                                                            "curriculum stage compiles once (about a minute on a CPU)"})

    def __post_init__(self):
        if self.batch_size < 1 or self.grad_accum < 0 or (self.grad_accum and self.batch_size % self.grad_accum):
            raise ValueError(f"--batch_size ({self.batch_size}) must be a positive multiple of --grad_accum ({self.grad_accum})")
        if self.resume and self.init_from:
            raise ValueError("--resume and --init_from exclude each other")
        if self.profile and not self.bench:
            raise ValueError("--profile profiles a --bench step: give --bench N as well")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be finite and > 0, got {self.lr}")
        if self.queries == -1:                    # the default: every key for GradMem, the one query elsewhere
            self.queries = 0 if self.model == "gradmem" else 1
        for name in ("warmup", "seed", "eval_seed", "bench", "write_split", "queries"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.decay_steps < 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--decay_steps must be >= 0 and --min_lr in [0, --lr], got {self.decay_steps}, {self.min_lr}")
        if self.n_eval < 1:
            raise ValueError(f"--n_eval must be >= 1, got {self.n_eval}")
        if not 0 <= self.curriculum_em <= 1:
            raise ValueError(f"--curriculum_em must be in [0, 1], got {self.curriculum_em}")
        if not 0 <= self.ema < 1:
            raise ValueError(f"--ema must be in [0, 1), got {self.ema}")
        if not self.grad_clip > 0 or self.patience < 0 or not 0 <= self.weight_decay < float("inf"):
            raise ValueError(f"--grad_clip must be > 0, --patience and --weight_decay >= 0, got {self.grad_clip}, "
                             f"{self.patience}, {self.weight_decay}")
        if self.max_steps < 0 or self.eval_interval < 1 or self.log_interval < 1:
            raise ValueError(f"--max_steps must be >= 0, --eval_interval and --log_interval >= 1, got {self.max_steps}, "
                             f"{self.eval_interval}, {self.log_interval}")


CONFIGS = {"model": GPTConfig, "gradmem": GradMemConfig, "train": TrainConfig}
NOT_FLAGS = {"vocab_size", "block_size"}  # set by the task
# fields a resumed run may change; every other field must equal the checkpoint's
RESUMABLE = {"K_eval", "attn", "grad_accum", "max_steps", "eval_interval", "log_interval", "target_em", "patience",
             "resume", "init_from", "device", "bench", "profile", "cuda_graph", "compile",
             "out_dir", "write_split", "curriculum_em"}
TOKEN_STEPS = 40_000  # automatic --grad_accum: 64 pairs, K = 5 -> micro-batch 16, 8.3 GB peak RSS (README)


def auto_grad_accum(batch_size, write_len, K):
    """Smallest divisor of batch_size whose micro-batch keeps micro * write_len * K within TOKEN_STEPS."""
    return next(a for a in range(1, batch_size + 1)
                if batch_size % a == 0 and (batch_size // a) * write_len * max(K, 1) <= TOKEN_STEPS or a == batch_size)


def curriculum(tcfg):
    """The stages of --pairs: 1, 2, 4, ... then --pairs itself. The paper trains its KV models from scratch with a
    curriculum over the number of pairs, each stage starting from the previous one's weights (App. B)."""
    if not tcfg.curriculum_em or tcfg.init_from or tcfg.train_file or tcfg.eval_file:
        return [tcfg.pairs]
    stages = [1]
    while 2 * stages[-1] < tcfg.pairs:
        stages.append(2 * stages[-1])
    return stages if stages[-1] == tcfg.pairs else stages + [tcfg.pairs]


def lr_at(step, tcfg, decay_from=0):
    """Linear warmup to --lr, then (with --decay_steps) a cosine down to --min_lr that starts at step decay_from or at
    the end of warmup, whichever is later. The curriculum passes the step its last stage began (None before that:
    the earlier stages keep --lr)."""
    if step < tcfg.warmup:
        return tcfg.lr * (step + 1) / tcfg.warmup
    if not tcfg.decay_steps or decay_from is None:
        return tcfg.lr
    t = min(1.0, max(0, step - max(tcfg.warmup, decay_from)) / tcfg.decay_steps)
    return tcfg.min_lr + 0.5 * (tcfg.lr - tcfg.min_lr) * (1 + math.cos(math.pi * t))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


class RunError(Exception):
    """Bad input or a diverging run: main prints it as one line and exits non-zero."""


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    seen = set()
    for cls in CONFIGS.values():
        for f in fields(cls):
            if f.name in NOT_FLAGS:
                continue
            assert f.name not in seen, f"flag --{f.name} defined twice"
            seen.add(f.name)
            assert f.metadata.get("help"), f"flag --{f.name} has no help"
            kw = dict(type=f.type, default=f.default, help=f.metadata["help"], choices=f.metadata.get("choices"))
            if f.type is bool:
                kw = dict(action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
            p.add_argument(f"--{f.name}", **kw)
    args = vars(p.parse_args(argv))
    try:
        return {k: cls(**{f.name: args[f.name] for f in fields(cls) if f.name in args}) for k, cls in CONFIGS.items()}
    except ValueError as e:
        raise RunError(str(e)) from None


def load_checkpoint(path, resume=False):
    """A train.py checkpoint (weights_only); --resume also needs the optimizer state, RNG state and best EM."""
    if not os.path.isfile(path):
        raise RunError(f"checkpoint not found: {path}")
    need = {"model", "config", "step"} | ({"optimizer", "rng", "best_em"} if resume else set())
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        assert isinstance(ckpt, dict) and need <= ckpt.keys(), f"missing {sorted(need - set(ckpt))}"
        cfg = ckpt["config"]
        assert isinstance(cfg, dict) and all(isinstance(cfg.get(k), dict) for k in CONFIGS), \
            f"its config lacks a {'/'.join(CONFIGS)} section"
        assert all(torch.is_tensor(v) for v in ckpt["model"].values()), "its model entry is not a state dict"
    except Exception as e:
        raise RunError(f"cannot read checkpoint {path}: not a complete train.py checkpoint ({one_line(e)})") from None
    return ckpt


def one_line(e):
    """An exception as one line: its class and its message's lines joined (load_state_dict puts the cause on line 2)."""
    msg = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return f"{e.__class__.__name__}: {msg[:300] if msg else 'no message'}"


def load_state(module, state, path):
    """module.load_state_dict, its mismatch as a one-line RunError naming the checkpoint."""
    try:
        module.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as e:
        raise RunError(f"checkpoint {path} does not fit this run's model: {one_line(e)}") from None


def check_match(path, saved, cfgs, sections, skip=RESUMABLE):
    """Raise naming the first config field that differs between the checkpoint and this run."""
    for sec in sections:
        for name, value in asdict(cfgs[sec]).items():
            if name in skip or name in NOT_FLAGS:
                continue
            if name not in saved.get(sec, {}):
                raise RunError(f"checkpoint {path} has no {name} in its config; this run has {name}={value!r}")
            old = saved[sec][name]
            if old != value:
                raise RunError(f"checkpoint {path} has {name}={old!r} but this run has {name}={value!r}")


def init_from(gm, path, cfgs):
    """--init_from: another run's weights, for a curriculum over --pairs, another K / alpha / meta_grad, or fewer
    memory vectors (App. F: the first n_mem rows of its M_0). The model config must match exactly."""
    ckpt = load_checkpoint(path)
    check_match(path, ckpt["config"], cfgs, ["model"])
    saved = ckpt["config"]["train"].get("model", "gradmem")
    if saved != cfgs["train"].model:
        raise RunError(f"checkpoint {path} is a {saved} model, this run trains {cfgs['train'].model}")
    check_match(path, ckpt["config"], cfgs, ["gradmem"], skip=RESUMABLE | {"K", "alpha", "meta_grad", "aux_write", "n_mem", "rmt_rec", "segment"})
    state = ckpt["model"]
    own = gm.state_dict()
    if isinstance(gm, RMT) and ("rec_head.weight" in own) != ("rec_head.weight" in state):   # --rmt_rec changed
        state.pop("rec_head.weight", None)
        if "rec_head.weight" in own:                                 # the new head starts from the loaded LM head
            state["rec_head.weight"] = state["model.lm_head.weight"].clone()
    if "mem0" in state:                           # (m, C), or (n_layer, 2, m, C) for --memory kv: m is dim -2
        if state["mem0"].size(-2) < gm.mem0.size(-2):
            raise RunError(f"checkpoint {path} has n_mem={state['mem0'].size(-2)}, fewer than this run's {gm.mem0.size(-2)}")
        state["mem0"] = state["mem0"].narrow(-2, 0, gm.mem0.size(-2)).clone()
    load_state(gm, state, path)


def save_checkpoint(path, gm, opt, step, best_em, cfgs, pairs, since_best=0, last_stage_from=0, ema=None,
                    weights="trained"):
    """pairs: the number of pairs trained at (a curriculum stage below --pairs, or --pairs); since_best: evaluations
    without a better EM (--patience counts on across --resume); last_stage_from: the step the curriculum's last stage
    began (--decay_steps starts there); ema: the WeightEMA to resume; weights: which weights "model" holds
    ("trained", or "ema" for a best.pt whose averaged weights scored higher)."""
    ckpt = {"model": gm.state_dict(), "optimizer": opt.state_dict(), "step": step, "best_em": best_em,
            "since_best": since_best, "last_stage_from": last_stage_from, "weights": weights,
            "pairs": pairs, "config": {k: asdict(c) for k, c in cfgs.items()}, "rng": torch.get_rng_state()}
    if ema is not None:
        ckpt["ema"] = ema.state_dict()
    torch.save(ckpt, path + ".tmp")
    os.replace(path + ".tmp", path)  # atomic: a crash never leaves a half-written checkpoint


def build(cfgs):
    """The model of --model around one GPT; every one returns GradMem.forward's dict."""
    mcfg, gcfg, kind = cfgs["model"], cfgs["gradmem"], cfgs["train"].model
    mcfg.vocab_size = len(VOCAB)
    if kind == "rmt":
        return RMT(GPT(mcfg), gcfg.n_mem, gcfg.K, gcfg.rmt_rec, gcfg.write_head)
    if kind == "armt":
        return ARMT(GPT(mcfg), gcfg.n_mem, segment=gcfg.segment)
    if kind == "transformer":
        return FullContext(GPT(mcfg))
    if kind == "mamba":
        return Mamba(mcfg)
    if kind == "ttt_linear":
        return TTTLinearLM(mcfg)
    if kind == "lact":
        return LaCTLM(mcfg, chunk=7 * cfgs["train"].pairs + 1)     # one fast-weight update per context
    return GradMem(GPT(mcfg), gcfg)


def set_pairs(gm, pairs):
    """A model evaluated or trained at another number of pairs than it was built for: LaCT's one fast-weight update
    per context follows the context length (7 N + 1 tokens); the other models have no such setting."""
    for m in gm.modules():
        if isinstance(m, LaCT):
            m.chunk = 7 * pairs + 1


@torch.no_grad()
def evaluate(gm, task, K, device, batch_size=250):
    """Held-out exact match and token accuracy of the value characters after K WRITE steps."""
    gm.eval()
    em = acc = wl = 0.0
    n = 0
    for b in task.eval_batches(batch_size, device):
        out = gm(b["ctx"], b["q"], b["y"], K=K)
        e, a = score(out["logits"], b["y"], b["y_mask"])
        B = b["y"].size(0)
        em, acc, n = em + e, acc + a * B, n + B
        wl += out["losses"][0].item() if out["losses"] else 0.0  # summed over the batch
    gm.train()
    return dict(em=em / n, acc=acc / n, write_loss0=wl / n)


def compile_write(gm):
    """--compile: gradmem.write_grad traced and fused by torch.compile (Inductor), used by every second-order WRITE
    step; its backward is the double backward. A curriculum stage (another context length) compiles anew."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    gm.compiled_grad = torch.compile(lambda mem, ctx: write_grad(gm, mem, ctx), dynamic=False)


def tune_malloc():
    """CPU: keep glibc malloc from handing freed tensor memory back to the OS and faulting it in again for the next
    tensor (glibc returns blocks above its mmap threshold at once, and trims the heap top). Measured side by side:
    1-10 % off a K = 5 step and less system time (README, "--compile"). Off glibc it does nothing and returns False."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    return all(libc.mallopt(opt, val) == 1 for opt, val in
               ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 34), (M_TOP_PAD, 512 << 20)))


def make_graphed(gm, task, tcfg, device, autocast):
    """--cuda_graph: a GraphedStep on CUDA; on CPU a one-line notice and None (the eager step)."""
    if not tcfg.cuda_graph:
        return None
    if device != "cuda":
        print("--cuda_graph: needs a CUDA device; skipped, running eagerly on CPU")
        return None
    micro = tcfg.batch_size // tcfg.grad_accum
    batch = {k: v[:micro] for k, v in task.train_batch(0, tcfg.batch_size, device, n_queries(tcfg, task)).items()}
    try:
        graphed = GraphedStep(gm, batch, 1.0 / tcfg.grad_accum, autocast)
    except GraphError as e:
        raise RunError(str(e)) from None
    gm.zero_grad(set_to_none=True)
    return graphed


def n_queries(tcfg, task):
    """--queries for the current curriculum stage: 0 means every pair; never more than the stage's pairs."""
    return task.n_pairs if tcfg.queries == 0 else min(tcfg.queries, task.n_pairs)


def train_step(gm, opt, task, step, tcfg, device, autocast, graphed=None):
    """One optimizer step on batch `step` (this rank's slice of it, split into grad_accum micro-batches). Returns
    logged scalars. graphed: a GraphedStep that replaces each micro-batch's forward and backward (--cuda_graph)."""
    batch = rank_slice(task.train_batch(step, tcfg.batch_size, device, n_queries(tcfg, task)))
    micro = batch["ctx"].size(0) // tcfg.grad_accum
    logs = dict(loss=0.0, task_loss=0.0, write_loss=0.0, em=0.0, g_mem=0.0)
    for i in range(tcfg.grad_accum):
        b = {k: v[i * micro:(i + 1) * micro] for k, v in batch.items()}
        if graphed is None:
            with autocast:
                out = gm(b["ctx"], b["q"], b["y"])
        else:
            out = graphed(b)                      # forward and backward, gradients already in .grad
        wl = out["losses"][0].item() / micro if out["losses"] else 0.0
        if graphed is None:
            (out["loss"] / tcfg.grad_accum).backward()
        flat = [b[k].reshape(-1, b[k].size(-1)) for k in ("y", "y_mask")]      # one row per query
        for k, v in (("loss", out["loss"].item()), ("task_loss", out["task_loss"].item()), ("write_loss", wl),
                     ("em", score(out["logits"], *flat)[0] / flat[0].size(0)), ("g_mem", out["grad_norm"].item())):
            logs[k] += v / tcfg.grad_accum
    average_over_ranks(gm, logs)              # a non-finite loss on any rank reaches every rank's logs
    if not (math.isfinite(logs["loss"]) and math.isfinite(logs["write_loss"])):
        raise RunError(f"non-finite loss at step {step + 1} (task {logs['task_loss']}, WRITE {logs['write_loss']}); "
                       "stopped without saving (try a smaller --alpha or --lr)")
    norm = torch.nn.utils.clip_grad_norm_(gm.parameters(), tcfg.grad_clip)
    if not torch.isfinite(norm):
        raise RunError(f"non-finite gradient norm at step {step + 1}; stopped without saving")
    opt.step()
    opt.zero_grad(set_to_none=True)
    logs["norm"] = norm.item()
    return logs


def pick_device(tcfg):
    return ("cuda" if torch.cuda.is_available() else "cpu") if tcfg.device == "auto" else tcfg.device


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def run(cfgs, argv):
    tcfg, gcfg = cfgs["train"], cfgs["gradmem"]
    device = pick_device(tcfg)
    if device == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda but no CUDA device is available")
    if device == "cpu" and tcfg.dtype == "bfloat16":
        raise RunError("--dtype bfloat16 is CUDA autocast; this run is on CPU, where it trains in float32: drop the flag")
    if tcfg.model in ("gradmem", "rmt") and gcfg.K < 1:
        raise RunError(f"--K {gcfg.K}: {tcfg.model} needs at least one WRITE step (with none, M_K = M_0 for every "
                       "context and nothing about it can be answered); use --K >= 1 (--K_eval 0 evaluates M_0 alone)")
    if gcfg.rmt_rec and tcfg.model != "rmt":
        raise RunError(f"--rmt_rec is RMT's reconstruction loss; this run trains --model {tcfg.model}")
    if gcfg.segment and tcfg.model != "armt":
        raise RunError(f"--segment splits ARMT's WRITE into segments; this run trains --model {tcfg.model}")
    if tcfg.queries != 1 and tcfg.model not in ("gradmem", "rmt"):
        raise RunError(f"--queries asks one written memory several keys (GradMem, RMT); this run trains --model {tcfg.model}")
    if tcfg.compile and (tcfg.model != "gradmem" or gcfg.meta_grad != "second" or tcfg.cuda_graph):
        raise RunError(f"--compile compiles GradMem's second-order WRITE step; this run has --model {tcfg.model}, "
                       f"--meta_grad {gcfg.meta_grad}{', --cuda_graph' if tcfg.cuda_graph else ''}")
    if device == "cpu":
        tune_malloc()
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not tcfg.cuda_graph)  # no cast cache in a graph
                if device == "cuda" and tcfg.dtype == "bfloat16" else nullcontext())
    torch.manual_seed(tcfg.seed)
    try:
        task = KVTask(tcfg.pairs, tcfg.seed, tcfg.eval_seed, tcfg.n_eval, tcfg.train_file or None, tcfg.eval_file or None)
    except (ValueError, OSError) as e:
        raise RunError(str(e)) from None
    if tcfg.resume and not os.path.isfile(os.path.join(tcfg.out_dir, "ckpt.pt")):   # before out_dir is made
        raise RunError(f"checkpoint not found: {os.path.join(tcfg.out_dir, 'ckpt.pt')} (--resume continues a run in --out_dir)")
    try:
        os.makedirs(tcfg.out_dir, exist_ok=True)
    except OSError as e:
        raise RunError(f"--out_dir {tcfg.out_dir}: cannot make that directory ({e.strerror})") from None
    if tcfg.write_split:
        for name in ("train.jsonl", "eval.jsonl", "ckpt.pt"):
            if os.path.exists(os.path.join(tcfg.out_dir, name)):
                raise RunError(f"--write_split: {os.path.join(tcfg.out_dir, name)} exists; choose another --out_dir")
        save_jsonl(os.path.join(tcfg.out_dir, "train.jsonl"), sample_kv_split(task, tcfg.write_split))
        save_jsonl(os.path.join(tcfg.out_dir, "eval.jsonl"), task.eval)
        print(f"wrote {tcfg.write_split} train and {len(task.eval[0])} eval samples to {tcfg.out_dir}")
        return None
    one = task.train_batch(0, 1)
    longest = sum(one[k].size(1) for k in ("ctx", "q", "y")) + 2 * gcfg.n_mem     # [M; C; M] or [C; Q; Y] and more
    if cfgs["model"].pos == "learned" and longest > cfgs["model"].block_size:
        raise RunError(f"--pairs {tcfg.pairs} needs {longest} positions, more than the {cfgs['model'].block_size} "
                       "learned positions (--pos rope has no limit)")
    auto_accum = not tcfg.grad_accum
    if auto_accum:
        write_len = one["ctx"].size(1) + 2 * gcfg.n_mem
        tcfg.grad_accum = auto_grad_accum(tcfg.batch_size // RANKS.world, write_len, gcfg.K)
    gm = build(cfgs).to(device)
    if tcfg.compile:
        compile_write(gm)
    opt = torch.optim.AdamW(gm.parameters(), lr=tcfg.lr, betas=(0.9, 0.999), weight_decay=tcfg.weight_decay)
    ckpt_path, step, best_em, since_best, last_stage_from = os.path.join(tcfg.out_dir, "ckpt.pt"), 0, -1.0, 0, 0
    ema = None
    for old in (ckpt_path, os.path.join(tcfg.out_dir, "best.pt")):   # --init_from included: never overwrite a run
        if not tcfg.resume and not tcfg.bench and os.path.exists(old):
            raise RunError(f"{old} exists: pass --resume to continue that run, or choose another --out_dir")
    if tcfg.resume:
        ckpt = load_checkpoint(ckpt_path, resume=True)
        check_match(ckpt_path, ckpt["config"], cfgs, ["model", "gradmem", "train"])
        load_state(gm, ckpt["model"], ckpt_path)
        load_state(opt, ckpt["optimizer"], ckpt_path)
        step, best_em, since_best = ckpt["step"], ckpt["best_em"], ckpt.get("since_best", 0)
        if step >= tcfg.max_steps and not tcfg.bench:
            raise RunError(f"{ckpt_path} is at step {step}, already at --max_steps {tcfg.max_steps}: "
                           "raise --max_steps to train on")
        last_stage_from = ckpt.get("last_stage_from", 0)
        torch.set_rng_state(ckpt["rng"])
        best_path = os.path.join(tcfg.out_dir, "best.pt")  # saved just before ckpt.pt: a kill between the two leaves
        if os.path.exists(best_path):                      # it ahead; never overwrite it with a worse model
            best = load_checkpoint(best_path)
            if best.get("pairs") == ckpt.get("pairs"):
                best_em = max(best_em, best["best_em"])
    elif tcfg.init_from:
        init_from(gm, tcfg.init_from, cfgs)
    same_weights_on_every_rank(gm)
    if tcfg.ema and not tcfg.bench and RANKS.rank == 0:   # rank 0 alone evaluates and saves the average
        ema = WeightEMA(gm, tcfg.ema)                 # from the weights trained on (a checkpoint's, if any)
        if tcfg.resume:                               # --ema is fixed on --resume, so ckpt.pt holds its average
            try:
                ema.load_state_dict(ckpt["ema"])
            except (KeyError, ValueError) as e:
                raise RunError(f"checkpoint {ckpt_path}: {e if isinstance(e, ValueError) else 'it holds no --ema average'}") from None
    if tcfg.bench:
        from bench import bench
        return bench(lambda step, graphed: train_step(gm, opt, task, step, tcfg, device, autocast, graphed), gm,
                     tcfg.bench, device, make_graphed(gm, task, tcfg, device, autocast), tcfg.profile,
                     model=tcfg.model, pairs=tcfg.pairs, batch_size=tcfg.batch_size, grad_accum=tcfg.grad_accum,
                     K=gcfg.K, attn=gcfg.attn, compile=tcfg.compile, memory_floats=gm.memory_floats(one["ctx"].size(1)),
                     processes=RANKS.world)
    ctx_len = one["ctx"].size(1)
    print(f"{tcfg.model}: {sum(p.numel() for p in gm.parameters()) / 1e6:.3f} M trained parameters; memory state "
          f"{gm.memory_floats(ctx_len)} floats for a {ctx_len}-token context (App. G); device {device}")
    stages = curriculum(tcfg)
    pairs = ckpt.get("pairs", tcfg.pairs) if tcfg.resume else stages[0]     # the stage a resumed run was in
    stages = sorted({pairs, tcfg.pairs} | {n for n in stages if n > pairs})   # from the stage trained now to --pairs
    if tcfg.curriculum_em and tcfg.pairs > 1 and (tcfg.train_file or tcfg.eval_file) and not tcfg.init_from:
        print("curriculum off: --train_file / --eval_file fix the number of pairs")
    if len(stages) > 1:
        print(f"curriculum over pairs: {' -> '.join(map(str, stages))}, the next stage once held-out EM >= "
              f"{tcfg.curriculum_em} (--curriculum_em 0: train at --pairs {tcfg.pairs} from the start)")

    def stage(n):
        """Data, LaCT's chunk and the automatic micro-batch for a curriculum stage of n pairs."""
        if auto_accum:
            tcfg.grad_accum = auto_grad_accum(tcfg.batch_size // RANKS.world, 7 * n + 1 + 2 * gcfg.n_mem, gcfg.K)
        set_pairs(gm, n)
        return KVTask(n, tcfg.seed, tcfg.eval_seed, tcfg.n_eval)

    if pairs != tcfg.pairs:
        task = stage(pairs)
    graphed = make_graphed(gm, task, tcfg, device, autocast)
    header = dict(kind="header", argv=argv, config={k: asdict(c) for k, c in cfgs.items()}, torch=torch.__version__,
                  commit=git_commit(), device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  threads=torch.get_num_threads(), processes=RANKS.world, resumed_at=step)
    log_path = os.path.join(tcfg.out_dir, "log.jsonl")
    if RANKS.rank == 0:
        with open(os.path.join(tcfg.out_dir, "config.json"), "w") as f:
            json.dump(header, f, indent=1)
        keep_log(log_path, step)

    def log(rec):
        if RANKS.rank == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    log(header)
    K_eval = gcfg.K if gcfg.K_eval < 0 else gcfg.K_eval
    t0, last = time.time(), None
    speed = StageSpeed(stages, pairs, tcfg.max_steps, tcfg.eval_interval)
    bar = tqdm(range(step, tcfg.max_steps), initial=step, total=tcfg.max_steps, dynamic_ncols=True,
               disable=None if RANKS.rank == 0 else True,
               bar_format="{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}] {postfix}")
    stop = StopOnSignal()
    with stop:
        for step in bar:
            lr = lr_at(step, tcfg, last_stage_from if pairs == tcfg.pairs else None)
            for g in opt.param_groups:
                g["lr"] = lr
            t_step = time.perf_counter()
            logs = train_step(gm, opt, task, step, tcfg, device, autocast, graphed)
            speed.add(time.perf_counter() - t_step)
            if ema is not None:
                ema.update(gm)
            done = step + 1
            if done % tcfg.log_interval == 0:
                rec = dict(kind="train", step=done, pairs=pairs, lr=lr, time=time.time() - t0, **logs)
                log(rec)
                if bar.disable:                   # no terminal: a plain progress line instead of the bar
                    print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in rec.items() if k not in ("kind", "pairs", "time"))
                          + " | " + speed.text(done), flush=True)
            stage_em = last["em"] if last is not None and last["pairs"] == pairs else None
            bar.set_postfix_str(f"{speed.text(done)} | loss {logs['loss']:.3f} | held-out EM "
                                + (f"{stage_em:.3f}" if stage_em is not None else "-"), refresh=False)
            if done % tcfg.eval_interval == 0 or done == tcfg.max_steps:
                if not all(torch.isfinite(p).all() for p in gm.parameters()):     # every rank: the weights are equal
                    raise RunError(f"non-finite weights after step {done}; stopped without saving (try a smaller --lr)")
                move_on, finish = False, ""
                if RANKS.rank == 0:                       # rank 0 evaluates and decides; the other ranks follow
                    t_eval = time.perf_counter()
                    last = dict(kind="eval", step=done, pairs=pairs, K_eval=K_eval, time=time.time() - t0,
                                **evaluate(gm, task, K_eval, device))
                    if ema is not None:                       # the averaged weights on the same held-out set
                        with ema.swapped(gm):
                            avg = evaluate(gm, task, K_eval, device)
                        last.update(ema_em=avg["em"], ema_acc=avg["acc"])
                    speed.eval_seconds = time.perf_counter() - t_eval
                    use_ema = ema is not None and last["ema_em"] > last["em"]
                    em = last["ema_em"] if use_ema else last["em"]       # the better of the two decides from here on
                    if ema is not None and last["ema_em"] < last["em"] - RESET_GAP:
                        ema.reset(gm, warmup=False)   # it averaged across a loss spike the trained weights have left behind
                        last["ema_reset"] = True
                    log(last)
                    tqdm.write(f"eval step {done} ({pairs} pairs): EM {last['em']:.4f} | token acc {last['acc']:.4f} | "
                               f"WRITE loss(M_0) {last['write_loss0']:.3f}"
                               + (f" | averaged weights: EM {last['ema_em']:.4f}" if ema is not None else ""))
                    if em > best_em:
                        best_em, since_best = em, 0
                        with ema.swapped(gm) if use_ema else nullcontext():
                            save_checkpoint(os.path.join(tcfg.out_dir, "best.pt"), gm, opt, done, best_em, cfgs, pairs,
                                            weights="ema" if use_ema else "trained")
                    else:
                        since_best += 1
                    move_on = pairs < tcfg.pairs and em >= tcfg.curriculum_em
                    if last["pairs"] == tcfg.pairs and em >= tcfg.target_em:
                        finish = f"reached target EM {tcfg.target_em} at step {done} ({time.time() - t0:.0f} s)"
                    elif tcfg.patience and since_best >= tcfg.patience and not move_on:
                        finish = f"no better EM for {tcfg.patience} evaluations: stopping at step {done}"
                move_on, finish_now = rank0_decides(move_on, finish)
                if move_on:                               # curriculum: on to the next stage
                    if RANKS.rank == 0:
                        keep = os.path.join(tcfg.out_dir, f"best_n{pairs}.pt")      # the stage's best, kept; best.pt
                        shutil.copyfile(os.path.join(tcfg.out_dir, "best.pt"), keep + ".tmp")   # stays until the next
                        os.replace(keep + ".tmp", keep)                                 # stage's first evaluation
                    pairs = stages[stages.index(pairs) + 1]
                    task, best_em, since_best, last_stage_from = stage(pairs), -1.0, 0, done
                    speed.enter(pairs)
                    if ema is not None:
                        ema.reset(gm)                     # the new stage's average starts from the trained weights
                    graphed = None                        # free the old graph's memory pool before capturing anew
                    graphed = make_graphed(gm, task, tcfg, device, autocast)
                    log(dict(kind="stage", step=done, pairs=pairs, time=time.time() - t0))
                    tqdm.write(f"curriculum: {pairs} pairs from step {done}")
                if RANKS.rank == 0:
                    save_checkpoint(ckpt_path, gm, opt, done, best_em, cfgs, pairs, since_best, last_stage_from, ema)
                if finish_now:
                    tqdm.write(finish)
                    break
            signum = stop_signal(stop)
            if signum is not None:                # Ctrl-C / SIGTERM, on any rank: checkpoint this step, then exit
                if RANKS.rank == 0:
                    save_checkpoint(ckpt_path, gm, opt, done, best_em, cfgs, pairs, since_best, last_stage_from, ema)
                wait_for_rank0()                  # no rank exits (and has torchrun stop the others) before that
                log(dict(kind="stop", step=done, pairs=pairs, signal=signal.Signals(signum).name, time=time.time() - t0))
                bar.close()
                print(f"stopped by {signal.Signals(signum).name} after step {done}: {ckpt_path} written; "
                      f"continue with the same command plus --resume", flush=True)
                raise SystemExit(128 + signum)
    bar.close()
    trained_at = last["pairs"] if last is not None else pairs     # a stage entered at the last evaluation: not trained
    if trained_at == tcfg.pairs:
        tqdm.write(f"best.pt is the best of {'both weights at ' if ema is not None else ''}every evaluation on the held-out "
                   f"set it was scored on, so that score tends to run high. On a set nothing was picked on: "
                   f"python eval.py {ckpt_path}{' --weights ema' if ema is not None else ''} --eval_seed "
                   f"{778 if tcfg.eval_seed == 777 else 777} --n_eval 5000 (the {'averaged' if ema is not None else 'trained'} "
                   f"weights of the last step; with few pairs the set may repeat some training contexts)")
    if trained_at < tcfg.pairs:
        tqdm.write(f"note: stopped in the curriculum's {trained_at}-pair stage, before --pairs {tcfg.pairs}; eval.py "
                   "evaluates a checkpoint at the pairs it was trained at; --resume continues the curriculum")
    return last


class StopOnSignal:
    """Within `with`: SIGINT (Ctrl-C) and SIGTERM set .signum instead of killing the process, so the training loop
    can finish its step and write a checkpoint. A second signal stops at once (KeyboardInterrupt)."""

    def __init__(self):
        self.signum, self.old = None, {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this step and writing a checkpoint "
              "(again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():    # signal handlers live in the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


class StageSpeed:
    """The progress line: the curriculum stage, its pairs, the median s/step measured in this stage (the last 50
    steps, so a compile or warm-up step does not dominate), and what the remaining step budget costs at that speed.
    In the last stage that is an upper bound at this speed (--target_em or --patience may end the run sooner);
    in an earlier stage it is only the budget priced at this stage's speed, since the stage may end at any evaluation
    and later stages, with longer contexts, are slower."""

    def __init__(self, stages, pairs, max_steps, eval_interval):
        self.stages, self.max_steps, self.eval_interval, self.eval_seconds = stages, max_steps, eval_interval, 0.0
        self.enter(pairs)

    def enter(self, pairs):
        self.pairs, self.times = pairs, []

    def add(self, seconds):
        self.times = self.times[-49:] + [seconds]

    def text(self, done):
        i = self.stages.index(self.pairs)
        head = f"stage {i + 1}/{len(self.stages)}: {self.pairs} pairs"
        if not self.times:
            return head
        sec = statistics.median(self.times)
        steps = self.max_steps - done
        left = fmt_duration(sec * steps + self.eval_seconds * math.ceil(steps / self.eval_interval))
        if self.pairs == self.stages[-1]:
            return f"{head} | {sec:.3g} s/step | at most {left} left at this speed"
        return f"{head} | {sec:.3g} s/step | {steps} steps left: {left} at this stage's speed"


def fmt_duration(seconds):
    """3725 -> '1h02m', 95 -> '1m35s'."""
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def keep_log(path, step):
    """On resume, drop log records past the checkpoint's step (they will be produced again), and a last line cut
    short by a kill. Headers of the earlier segments stay: they record how the run began (argv, --init_from, commit)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    recs = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:                        # a write interrupted mid-line: drop it
                print(f"note: dropped a cut-off last line of {path}")
                continue
            raise RunError(f"{path} line {i + 1} is not JSON: fix or move the log before --resume") from None
        if rec.get("step", rec.get("resumed_at", 0)) <= step:
            recs.append(line)
    with open(path + ".tmp", "w") as f:
        f.writelines(recs)
    os.replace(path + ".tmp", path)


def sample_kv_split(task, n):
    rows = [task.train_batch(s, 1000) for s in range((n + 999) // 1000)]
    return tuple(torch.cat([r[k] for r in rows])[:n].numpy() for k in ("ctx", "q", "y"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfgs = parse_args(argv)
        with distributed(cfgs["train"], pick_device(cfgs["train"])):
            return run(cfgs, argv)
    except (RunError, DistributedError) as e:
        sys.exit(f"train.py: error: {e}")


if __name__ == "__main__":
    main()
