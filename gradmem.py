"""
GradMem WRITE and READ: "GradMem: Learning to Write Context into Memory with Test-Time Gradient Descent",
Kuratov et al., arXiv:2603.13875v2, §2.2 and Appendix K.

    L_write(M; C) = - sum_i log f(t_i | [M; t_<i])                  Eq. (4)  reconstruction of C from memory M
                    (used here as the mean over C's tokens, as the authors' code does: alpha is per token)
    M_{k+1}       = M_k - alpha * grad_M L_write(M_k; C),  k < K     Eq. (5)  WRITE: K steps from the learned M_0
    L_task        = - sum_j log f(y_j | [M_K; Q; y_<j])              Eq. (8)  READ: the context is gone

M is m vectors of width d prepended to the input embeddings. The weights theta (and the WRITE head) are
frozen inside WRITE: only M moves. In training, theta and M_0 are learned through the unrolled WRITE
(meta-learning, MAML-style):
    meta_grad="second"  backprop through grad_M L_write itself (create_graph=True): the full meta-gradient;
    meta_grad="first"   grad_M L_write is a constant, so dL/dM_0 = dL/dM_K and theta gets nothing through WRITE;
    meta_grad="none"    M is detached around every step: nothing learns through WRITE, M_0 stays at init.
"""
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import add_lora, lora_enabled

PAD = -1  # padding: never a token id (model.embed maps it to row 0); losses ignore it, pack() moves it to the end
BOS = 1   # data.py's [BOS], the first input of --memory kv; gradmem.py imports no project file but model.py


@dataclass
class GradMemConfig:
    n_mem: int = field(default=8, metadata={"help": "memory vectors m, §2.2"})
    K: int = field(default=1, metadata={"help": "WRITE steps K, Eq. (5)"})
    K_eval: int = field(default=-1, metadata={"help": "WRITE steps at evaluation (-1: same as K), Fig. 4a"})
    alpha: float = field(default=0.5, metadata={"help": "inner lr alpha, Eq. (5)"})
    meta_grad: str = field(default="second", metadata={"choices": ["second", "first", "none"], "help": "meta-gradient "
                           "through WRITE: full second order, first order (grad_M L_write held constant), or none"})
    write_head: bool = field(default=True, metadata={"help": "separate WRITE head, init from the LM head (App. B)"})
    aux_write: float = field(default=0.5, metadata={"help": "weight of the auxiliary WRITE loss in the outer loss"})
    rmt_rec: float = field(default=0.0, metadata={"help": "RMT only: weight of the reconstruction loss of C from each "
                           "written memory M_1..M_K in the outer loss (the authors' RMT KV script at 2bc0b12: 1.0)"})
    segment: int = field(default=0, metadata={"help": "ARMT only: context tokens per WRITE segment; 0: the whole "
                         "context as one (the paper's two-segment setup, §3.2); 7: one KV pair per segment (the "
                         "authors' ARMT KV script)"})
    memory: str = field(default="input", metadata={"choices": ["input", "kv"], "help": "M as m input vectors "
                        "(§2.2) or as m key/value slots in every layer (App. J)"})
    attn: str = field(default="hvp", metadata={"choices": ["hvp", "eager"],
                                                 "help": "attention for twice-differentiated passes"})
    lora_rank: int = field(default=0, metadata={"help": "rank of low-rank adapters on every block's projections, on "
                           "during WRITE only: READ is the base model (App. I; 0: none)"})

    def __post_init__(self):
        if self.K < 0 or self.K_eval < -1:
            raise ValueError(f"--K must be >= 0 and --K_eval >= 0 (or -1), got K={self.K}, K_eval={self.K_eval}")
        if not 0 < self.alpha < float("inf"):
            raise ValueError(f"--alpha (inner lr) must be finite and > 0, got {self.alpha}")
        if self.n_mem < 1 or self.segment < 0:
            raise ValueError(f"--n_mem must be >= 1 and --segment >= 0, got {self.n_mem}, {self.segment}")
        if self.lora_rank < 0:
            raise ValueError(f"--lora_rank must be >= 0 (0: no adapters), got {self.lora_rank}")
        if not (0 <= self.aux_write < float("inf") and 0 <= self.rmt_rec < float("inf")):
            raise ValueError(f"--aux_write and --rmt_rec must be finite and >= 0, got {self.aux_write}, {self.rmt_rec}")
        for f in fields(self):                      # choices: argparse checks the flags, this the Python API
            if "choices" in f.metadata and getattr(self, f.name) not in f.metadata["choices"]:
                raise ValueError(f"{f.name} must be one of {f.metadata['choices']}, got {getattr(self, f.name)!r}")


class GradMem(nn.Module):
    """A frozen-inside-WRITE language model plus the meta-learned M_0 (and optional WRITE head)."""

    def __init__(self, model, cfg):
        super().__init__()
        self.model, self.cfg = model, cfg
        c = model.config
        shape = (cfg.n_mem, c.n_embd) if cfg.memory == "input" else (c.n_layer, 2, cfg.n_mem, c.n_embd)
        self.mem0 = nn.Parameter(0.02 * torch.randn(shape))                # M_0, N(0, 0.02^2)
        self.write_head = None
        self.compiled_grad = None       # train.py --compile sets a torch.compile'd write_grad (second order only)
        if cfg.write_head:
            self.write_head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False)
            self.write_head.weight.data.copy_(model.lm_head.weight.data)
        if cfg.lora_rank:
            add_lora(model, cfg.lora_rank)                         # App. I: WRITE's adapters, off outside WRITE

    def memory_floats(self, ctx_len):
        return self.mem0.numel()                                   # m x d, whatever the context length (§2.2)

    def forward(self, ctx, q, y, K=None):
        """Train/eval pass: WRITE ctx into memory, READ y from [M_K; q]. Returns the outer loss and parts.
        q (B, n, 5) and y (B, n, 4) ask each context n keys; the task loss is then their mean, logits (B n, L, V)."""
        K = self.cfg.K if K is None else K
        mem, info = self.memorize(ctx, K)
        task_loss, logits = self.read(mem, q, y)
        loss = task_loss
        if self.training and K > 0 and self.cfg.aux_write > 0:
            loss = loss + self.cfg.aux_write * info["losses"][-1] / ctx.size(0)  # aux: L_write(M_{K-1}), batch mean
        return dict(loss=loss, task_loss=task_loss, logits=logits, mem=mem, **info)


    def memorize(self, ctx, K):
        """WRITE, Eq. (5): the state READ answers from, M_K, and write()'s info."""
        return write(self, ctx, K)

    def read(self, mem, q, y):
        """READ, Eq. (8), from M_K: (task loss, logits (B, L, V))."""
        return read_loss(self.model, mem, q, y)


def write_loss(model, head, mem, ctx, attn="sdpa"):
    """Eq. (4): next-token NLL of every non-pad context token given [M; C]; t_1 is predicted from the
    last memory position. Per-sample mean over tokens, summed over the batch, so a sample's gradient
    does not depend on the batch size. Returns (loss, per-token NLL (B, T)).
    mem: (B, m, C) input vectors, or (B, n_layer, 2, m, C) per-layer key/value slots (App. J): then the input
    is [BOS; C] and BOS predicts t_1."""
    B, T = ctx.shape
    if mem.dim() == 3:
        m = mem.size(1)
        x = torch.cat([mem, model.embed(ctx[:, :-1])], dim=1)  # [M; t_1..t_{T-1}]: (B, m+T-1, C)
        logits = head(model(x, attn)[:, m - 1:])               # positions m-1.. predict t_1..t_T
    else:
        x = model.embed(torch.cat([torch.full_like(ctx[:, :1], BOS), ctx[:, :-1]], dim=1))
        logits = head(model(x, attn, prefix=mem))
    return context_nll(logits, ctx)


def context_nll(logits, ctx):
    """logits (B, T, V) for the tokens ctx (B, T) -> (per-sample mean NLL over non-pad tokens summed over the
    batch, per-token NLL (B, T))."""
    nll = F.cross_entropy(logits.flatten(0, 1), ctx.flatten(), reduction="none", ignore_index=PAD).view(ctx.shape)
    n_tok = (ctx != PAD).sum(1).clamp(min=1)
    return (nll.sum(1) / n_tok).sum(), nll


def write(gm, ctx, K, mem=None):
    """WRITE, Eq. (5): K steps of gradient descent on the memory, from M_0 (or from `mem`).
    Returns M_K ((B, m, C), or (B, n_layer, 2, m, C) with --memory kv) and info: L_write(M_k) for k < K (summed over the batch), their per-token
    NLLs (B, T), and the mean per-sample norm of the last grad_M."""
    cfg = gm.cfg
    head = gm.write_head if gm.write_head is not None else gm.model.lm_head
    train = gm.training and torch.is_grad_enabled()
    second = train and cfg.meta_grad == "second"
    keep_last = train and cfg.aux_write > 0                   # the aux loss backprops L_write(M_{K-1}) into theta
    if mem is None:
        mem = gm.mem0.expand(ctx.size(0), *gm.mem0.shape)     # (B, m, C): every sample starts at M_0
    info = dict(losses=[], nll=[], grad_norm=torch.zeros(()))
    with torch.enable_grad():                                  # WRITE needs grad_M even when evaluating
        for k in range(K):
            if cfg.meta_grad == "none" or not train:        # cut the graph: nothing learns through this step
                mem = mem.detach().requires_grad_()
            if second and gm.compiled_grad is not None:     # train.py --compile: the same gradient, traced and fused
                with lora_enabled(gm.model):
                    g, loss, nll = gm.compiled_grad(mem, ctx)
            else:
                with lora_enabled(gm.model):                # App. I: WRITE's adapters (if any) on, READ's off
                    loss, nll = write_loss(gm.model, head, mem, ctx, cfg.attn if second else "sdpa")   # Eq. (4)
                g, = torch.autograd.grad(loss, mem, create_graph=second, retain_graph=second or (keep_last and k == K - 1))
            mem = mem - cfg.alpha * g                          # Eq. (5): M_{k+1} = M_k - alpha grad_M L_write
            info["losses"].append(loss if train else loss.detach())
            info["nll"].append(nll.detach())
            info["grad_norm"] = g.detach().flatten(1).norm(dim=1).mean()
    return (mem if train else mem.detach()), info


def write_grad(gm, mem, ctx):
    """grad_M L_write(M; C) of Eq. (5), with L_write and its per-token NLL, as one pure function (torch.func.grad):
    autograd differentiates its result again for the second-order meta-gradient, and torch.compile can trace the
    whole of it, backward included, and fuse it (train.py --compile). Attention is the explicit math, which the
    compiler fuses. Same numbers as write()'s autograd.grad(create_graph=True) (test_write_grad_equals_autograd_grad)."""
    head = gm.write_head if gm.write_head is not None else gm.model.lm_head

    def loss_fn(m):
        with lora_enabled(gm.model):
            loss, nll = write_loss(gm.model, head, m, ctx, "eager")
        return loss, (loss, nll)

    g, (loss, nll) = torch.func.grad(loss_fn, has_aux=True)(mem)
    return g, loss, nll


def pack(pieces, keeps):
    """Concatenate right-padded pieces (B, L_i) or (B, L_i, C) per sample with their pads moved to the end, so a causal
    model never sees a pad before a real token: [a_b; b_b; ...; pads]. keeps: (B, L_i) bools, True at real tokens.
    Returns the packed (B, sum L_i[, C]) and the (B,) position where each piece starts in it."""
    x, keep = torch.cat(pieces, 1), torch.cat(keeps, 1)
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices      # real tokens first, in order
    lengths = torch.stack([k.sum(1) for k in keeps], 1)
    starts = (lengths.cumsum(1) - lengths).unbind(1)
    return x.gather(1, order if x.dim() == 2 else order[..., None].expand_as(x)), starts


def at_target(h, start, L):
    """h (B, T, C): the states that predict y_1..y_L when y starts at position start (B,) of h's input: the state
    before y_j is at start + j - 1 (clamped for the pad positions of a short y)."""
    pos = (start[:, None] - 1 + torch.arange(L, device=h.device)).clamp(0, h.size(1) - 1)
    return h.gather(1, pos[..., None].expand(-1, -1, h.size(-1)))


def read_loss(model, mem, q, y):
    """READ, Eq. (8): cross-entropy of the target y given [M_K; Q] (teacher forced). Returns (loss, logits (B, L, V)).
    q and y may be right-padded with PAD (text tasks): [Q; Y] is packed per sample, so y follows its own query.
    q (B, n, Lq) and y (B, n, L) ask each context n queries (train.py --queries), all READ from the same M_K: the
    loss is then their mean and the logits (B n, L, V), sample-major."""
    if q.dim() == 3:
        n = q.size(1)
        return read_loss(model, mem.repeat_interleave(n, 0), q.flatten(0, 1), y.flatten(0, 1))
    L = y.size(1)
    seq, (_, start) = pack([q, y], [q != PAD, y != PAD])                    # [Q; Y; pads] per sample
    if mem.dim() == 3:
        x = torch.cat([mem, model.embed(seq[:, :-1])], dim=1)              # [M; Q; y_1..y_{L-1}]
        h = at_target(model(x, "sdpa"), start + mem.size(1), L)            # with no query, M's last state predicts y_1
    else:                                                                  # App. J: [Q; Y] over the KV slots
        h = at_target(model(model.embed(seq[:, :-1]), "sdpa", prefix=mem), start, L)
    logits = model.lm_head(h)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=PAD), logits


@torch.no_grad()
def greedy(gm, state, q, max_len, stop):
    """Answer by greedy decoding from a written state (gm.memorize), one token at a time until `stop` or max_len
    tokens: what the answer scores of text tasks are computed from (not teacher forcing). Returns (B, max_len) ids,
    PAD after a sample's stop token."""
    B = q.size(0)
    out = torch.full((B, max_len), PAD, dtype=torch.long, device=q.device)
    done = torch.zeros(B, dtype=torch.bool, device=q.device)
    for t in range(max_len):
        _, logits = gm.read(state, q, out[:, :t + 1])             # y_t's logits need only y_<t: out[:, t] is a dummy
        nxt = logits[:, t].argmax(-1).masked_fill(done, PAD)
        out[:, t] = nxt
        done |= nxt == stop
        if done.all():
            break
    return out


@torch.no_grad()
def token_hits(logits, y, y_mask):
    """(B, L) True where a target token is right or not scored."""
    return (logits.argmax(-1) == y) | ~y_mask


def score(logits, y, y_mask):
    """(number of samples whose scored target tokens are all right, an int: summed over batches and divided by
    the sample count it gives exact match without float error; token accuracy). Teacher-forced argmax equals
    greedy decoding here: a sample counts only if every scored token is right, in which case both agree."""
    hit = token_hits(logits, y, y_mask)
    return int(hit.all(1).sum()), ((hit & y_mask).sum() / y_mask.sum()).item()


@torch.no_grad()
def write_until(gm, ctx, threshold, K_max, alpha=None):
    """WRITE, Eq. (5), stopped per sample: sample b moves only while its per-token L_write(M_k; C) (Eq. 4) is not
    below `threshold`, for at most K_max steps (threshold -inf: exactly K_max steps, as write()). Evaluation only: no
    meta-gradient. Returns M ((B, m, C), or (B, n_layer, 2, m, C) with --memory kv), the steps each sample took (B,),
    and L_write per sample at M_0 .. M_k, (B, k+1): a stopped sample's value stays at the loss it stopped at."""
    head = gm.write_head if gm.write_head is not None else gm.model.lm_head
    alpha = gm.cfg.alpha if alpha is None else alpha
    mem = gm.mem0.expand(ctx.size(0), *gm.mem0.shape)
    n_tok = (ctx != PAD).sum(1).clamp(min=1)
    steps, losses = torch.zeros(ctx.size(0), dtype=torch.long, device=ctx.device), []
    for k in range(K_max + 1):
        with torch.enable_grad():
            mem = mem.detach().requires_grad_()
            with lora_enabled(gm.model):
                loss, nll = write_loss(gm.model, head, mem, ctx)              # Eq. (4) at M_k, summed over samples
            losses.append(nll.detach().sum(1) / n_tok)                       # per sample, per token
            move = ~(losses[-1] < threshold)                                 # NaN is not below: it does not stop
            if k == K_max or not move.any():
                break
            g, = torch.autograd.grad(loss, mem)
        step = move.view(-1, *[1] * (mem.dim() - 1))
        mem = torch.where(step, mem - alpha * g, mem)          # Eq. (5): M_{k+1} = M_k - alpha grad_M L_write, moving samples
        steps += move
    return mem.detach(), steps, torch.stack(losses, 1)
