"""
One decoder-only transformer for GradMem (arXiv:2603.13875v2), in nanoGPT's layout.

GPT-2 style (learned positions, LayerNorm, GELU MLP, biases) and Llama style (RoPE, RMSNorm,
SwiGLU, tied embeddings) are fields of one GPTConfig, not two class trees. The model takes
*input embeddings* (B, T, C), not token ids, so GradMem can prepend its memory vectors M:
the input of WRITE is [M; C] and of READ [M; Q; Y] (§2.2). Positions run 0..T-1 over the whole
input, memory first.

Attention is computed three ways, chosen per call (`attn=`):
  "sdpa"  fused F.scaled_dot_product_attention: fastest, but has no double backward;
  "eager" explicit softmax(QK^T/sqrt(hs)) V: generic autograd graph, twice differentiable;
  "hvp"   attention_hvp.attention: the hand-derived double backward of Appendix C.
GradMem asks for "eager"/"hvp" only on passes it differentiates twice (WRITE with create_graph).
"""
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention_hvp import attention as attention_hvp



@dataclass
class GPTConfig:
    # defaults: the paper's KV-retrieval model (Table 1), a 4-layer Llama of ~1.07 M parameters
    block_size: int = 2048
    vocab_size: int = field(default=70, metadata={"help": "vocabulary size (70 for the KV task)"})
    n_layer: int = field(default=4, metadata={"help": "transformer layers"})
    n_head: int = field(default=4, metadata={"help": "attention heads"})
    n_embd: int = field(default=128, metadata={"help": "width d (memory vectors are d-dim)"})
    n_hidden: int = field(default=512, metadata={"help": "MLP hidden width"})
    mlp: str = field(default="swiglu", metadata={"choices": ["swiglu", "gelu"], "help": "MLP: Llama's SwiGLU or GPT-2's GELU"})
    norm: str = field(default="rms", metadata={"choices": ["rms", "layer"], "help": "RMSNorm (Llama) or LayerNorm (GPT-2)"})
    pos: str = field(default="rope", metadata={"choices": ["rope", "learned"], "help": "positions: RoPE or learned (GPT-2)"})
    bias: bool = field(default=False, metadata={"help": "biases in the linear layers (GPT-2)"})
    tie: bool = field(default=True, metadata={"help": "tie input and output embeddings"})
    rope_theta: float = field(default=500000.0, metadata={"help": "RoPE base (Llama-3.2's; the baselines need 10000)"})
    rope_llama3: bool = field(default=True, metadata={"help": "Llama-3 RoPE frequency scaling"})
    norm_eps: float = field(default=1e-5, metadata={"help": "epsilon of the norm layers"})

    def __post_init__(self):
        for f in fields(self):                      # choices: argparse checks the flags, this the Python API
            if "choices" in f.metadata and getattr(self, f.name) not in f.metadata["choices"]:
                raise ValueError(f"{f.name} must be one of {f.metadata['choices']}, got {getattr(self, f.name)!r}")
        if min(self.n_layer, self.n_head, self.n_embd, self.n_hidden) < 1 or self.n_embd % self.n_head:
            raise ValueError(f"--n_layer, --n_head, --n_embd, --n_hidden must be >= 1 and --n_embd a multiple of "
                             f"--n_head, got {self.n_layer}, {self.n_head}, {self.n_embd}, {self.n_hidden}")
        if self.pos == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"RoPE rotates pairs of channels: the head size --n_embd / --n_head must be even, "
                             f"got {self.n_embd} / {self.n_head}")
        if not 0 < self.rope_theta < float("inf") or not 0 < self.norm_eps < 1:
            raise ValueError(f"--rope_theta must be finite and > 0, --norm_eps in (0, 1), "
                             f"got {self.rope_theta}, {self.norm_eps}")


def rope_frequencies(hs, theta, llama3):
    """Inverse frequencies theta^(-2i/hs), i < hs/2; with llama3=True the Llama-3.1/3.2 rescaling
    (factor 32, low/high freq factors 1/4, original context 8192) that the reference setup inherits."""
    inv = 1.0 / theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    if llama3:
        factor, lo, hi, old = 32.0, 1.0, 4.0, 8192.0
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        medium = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv


def rope_tables(inv_freq, pos, dtype):
    """RoPE's (cos, sin) tables, (T, hs/2) each, for positions pos (T,): angle pos * freq_i."""
    ang = pos.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate pairs (x_i, x_{i+hs/2}) by angle pos*freq_i (GPT-NeoX/HF-Llama halves layout).
    x: (B, nh, T, hs); cos, sin: (T, hs/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


EAGER_BLOCK = 40   # query rows per block in attention_eager: the fastest compiled K = 5 step at 16 pairs (README)


def attention_eager(q, k, v, block=None):
    """Explicit causal softmax attention, (B, nh, T, hs) -> (B, nh, T, hs). Twice differentiable.
    The query rows go in near-equal blocks of at most `block` (default EAGER_BLOCK); rows [a, b) multiply only
    the keys [0, b), so the blocks above the diagonal, all -inf under the causal mask, are never computed
    (3 blocks at T = 120: 67 % of the T x T work). Exact: each row's softmax runs over the same visible keys."""
    T = q.size(-2)
    n = -(-T // (block or EAGER_BLOCK))
    edges = [T * i // n for i in range(n + 1)]
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        att = (q[..., a:b, :] @ k[..., :b, :].transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, nh, b-a, b)
        causal = torch.ones(b - a, b, dtype=torch.bool, device=q.device).tril(diagonal=a)  # key j <= row a+i
        out.append(att.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v[..., :b, :])
    return out[0] if n == 1 else torch.cat(out, dim=-2)


def attention(q, k, v, attn):
    if attn == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if attn == "eager":
        return attention_eager(q, k, v)
    if attn == "hvp":
        return attention_hvp(q, k, v)
    raise ValueError(f"unknown attention implementation {attn!r} (sdpa|eager|hvp)")


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)     # x / rms(x) * weight


def make_norm(config):
    if config.norm == "rms":
        return RMSNorm(config.n_embd, config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x, rope, attn, prefix=None, window=None):
        """prefix: optional (keys, values), each (B, P, C): P extra key/value slots that every query sees
        (GradMem's per-layer KV memory, App. J). They carry no position (no rotation).
        window: if set, each query sees only its last `window` positions (sliding window, SDPA only; LaCT)."""
        B, T, C = x.size()
        heads = lambda t: t.view(B, -1, self.n_head, C // self.n_head).transpose(1, 2)      # (B, nh, T, hs)
        q, k, v = (heads(t) for t in self.c_attn(x).split(C, dim=2))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if prefix is not None:   # prepend the slots; P dummy query rows keep the causal mask square, then are dropped
            P = prefix[0].size(1)
            q, k, v = torch.cat([q.new_zeros(B, self.n_head, P, q.size(-1)), q], 2), \
                torch.cat([heads(prefix[0]), k], 2), torch.cat([heads(prefix[1]), v], 2)
        if window is None:
            y = attention(q, k, v, attn)[:, :, -T:]
        else:
            i = torch.arange(T, device=x.device)
            seen = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)           # (T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        n_out = 2 * config.n_hidden if self.swiglu else config.n_hidden  # SwiGLU: gate and up, fused
        self.c_fc = nn.Linear(config.n_embd, n_out, bias=config.bias)
        self.c_proj = nn.Linear(config.n_hidden, config.n_embd, bias=config.bias)

    def forward(self, x):
        h = self.c_fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.attn = make_norm(config), CausalSelfAttention(config)
        self.ln_2, self.mlp = make_norm(config), MLP(config)

    def forward(self, x, rope, attn, prefix=None):
        x = x + self.attn(self.ln_1(x), rope, attn, prefix)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=make_norm(config),
        ))
        if config.pos == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:
            inv = rope_frequencies(config.n_embd // config.n_head, config.rope_theta, config.rope_llama3)
            self.register_buffer("rope_inv_freq", inv.float(), persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx):
        """Token ids (B, T) -> input embeddings (B, T, C)."""
        return self.transformer.wte(idx)

    def forward(self, x, attn="sdpa", wrap=None, prefix=None):
        """x: input embeddings (B, T, C) -> final hidden states (B, T, C) after ln_f.
        Apply `self.lm_head` (or a separate WRITE head) to get logits. `wrap(i, block, x, rope, attn)`, if given,
        runs block i in place of `block(x, rope, attn)`: per-layer memories (ARMT, baselines.py) hook in there.
        prefix: optional (B, n_layer, 2, P, C) per-layer key/value slots seen by every query (App. J)."""
        B, T, C = x.size()
        rope = None
        if self.config.pos == "learned":                     # RoPE has no length limit; learned positions do
            assert T <= self.config.block_size, f"sequence of {T} tokens exceeds block_size {self.config.block_size}"
            x = x + self.transformer.wpe(torch.arange(T, device=x.device))
        else:
            rope = rope_tables(self.rope_inv_freq, torch.arange(T, device=x.device), x.dtype)
        for i, block in enumerate(self.transformer.h):
            if wrap is not None:
                x = wrap(i, block, x, rope, attn)
            else:
                x = block(x, rope, attn, None if prefix is None else (prefix[:, i, 0], prefix[:, i, 1]))
        return self.transformer.ln_f(x)
