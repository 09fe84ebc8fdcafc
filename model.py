"""
One decoder-only transformer for GradMem (arXiv:2603.13875v2), in nanoGPT's layout.

GPT-2 style (learned positions, LayerNorm, GELU MLP, biases), GPT-NeoX style (parallel residual, RoPE on a
fraction of each head) and Llama style (RoPE, RMSNorm, SwiGLU, grouped-query attention) are fields of one
GPTConfig, not class trees; `GPT.from_pretrained(folder)` reads a Hugging Face checkpoint of any of the three.
The model takes *input embeddings* (B, T, C), not token ids, so GradMem can prepend its memory vectors M:
the input of WRITE is [M; C] and of READ [M; Q; Y] (§2.2). Positions run 0..T-1 over the whole
input, memory first.

Attention is computed three ways, chosen per call (`attn=`):
  "sdpa"  fused F.scaled_dot_product_attention: fastest, but has no double backward;
  "eager" explicit softmax(QK^T/sqrt(hs)) V: generic autograd graph, twice differentiable;
  "hvp"   attention_hvp.attention: the hand-derived double backward of Appendix C.
GradMem asks for "eager"/"hvp" only on passes it differentiates twice (WRITE with create_graph).

Low-rank adapters (App. I): `add_lora(model, r)` gives every block's attention and MLP projections a rank-r adapter,
off by default; `with lora_enabled(model):` switches them on, for WRITE only. The base weights keep their names.
"""
import contextlib
import json
import math
import os
import re
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
    rope_factor: float = field(default=32.0, metadata={"help": "Llama-3 RoPE scaling: factor"})
    rope_low_freq_factor: float = field(default=1.0, metadata={"help": "Llama-3 RoPE scaling: low_freq_factor"})
    rope_high_freq_factor: float = field(default=4.0, metadata={"help": "Llama-3 RoPE scaling: high_freq_factor"})
    rope_original_max_pos: int = field(default=8192, metadata={"help": "Llama-3 RoPE scaling: original context"})
    rotary_pct: float = field(default=1.0, metadata={"help": "fraction of each head's channels RoPE rotates (Pythia: 0.25)"})
    n_kv_head: int = field(default=0, metadata={"help": "key/value heads, grouped-query attention (Llama); 0: n_head"})
    parallel_residual: bool = field(default=False, metadata={"help": "x + attn(ln_1(x)) + mlp(ln_2(x)) (GPT-NeoX)"})
    gelu_approx: str = field(default="tanh", metadata={"choices": ["tanh", "none"],
                                                       "help": "GELU: tanh approximation (GPT-2) or exact (GPT-NeoX)"})
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
        if self.n_kv_head < 0 or self.n_head % (self.n_kv_head or self.n_head):
            raise ValueError(f"--n_kv_head must divide --n_head, got {self.n_kv_head} and {self.n_head}")
        rot = int(self.n_embd // self.n_head * self.rotary_pct)
        if self.pos == "rope" and (not 0 < self.rotary_pct <= 1 or rot < 2 or rot % 2):
            raise ValueError(f"--rotary_pct must rotate an even number >= 2 of the {self.n_embd // self.n_head} "
                             f"channels of a head, got {self.rotary_pct} ({rot} channels)")
        lo, hi = self.rope_low_freq_factor, self.rope_high_freq_factor
        if self.rope_llama3 and not (self.rope_factor > 0 and hi > lo > 0 and self.rope_original_max_pos > 0):
            raise ValueError(f"Llama-3 RoPE scaling needs --rope_factor > 0, --rope_high_freq_factor > "
                             f"--rope_low_freq_factor > 0 and --rope_original_max_pos > 0, got {self.rope_factor}, "
                             f"{self.rope_high_freq_factor}, {self.rope_low_freq_factor}, {self.rope_original_max_pos}")


def rope_frequencies(hs, theta, llama3, scaling=(32.0, 1.0, 4.0, 8192)):
    """Inverse frequencies theta^(-2i/hs), i < hs/2 (hs: the rotated channels); with llama3=True the Llama-3.1/3.2
    rescaling, scaling = (factor, low_freq_factor, high_freq_factor, original context); the default (32, 1, 4, 8192)
    is Llama-3.2's, which the reference setup inherits."""
    inv = 1.0 / theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    if llama3:
        factor, lo, hi, old = scaling
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
    """Rotate pairs (x_i, x_{i+r/2}) of the first r = 2 * cos.size(-1) channels by angle pos*freq_i (GPT-NeoX/HF-Llama
    halves layout); channels r.. pass unrotated (GPT-NeoX rotary_pct < 1). x: (B, nh, T, hs); cos, sin: (T, r/2)."""
    r = 2 * cos.size(-1)
    if r < x.size(-1):
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
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
        self.n_head, self.hs = config.n_head, config.n_embd // config.n_head
        self.n_kv_head = config.n_kv_head or config.n_head
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * self.n_kv_head * self.hs, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x, rope, attn, prefix=None, window=None):
        """prefix: optional (keys, values), each (B, P, C): P extra key/value slots that every query sees
        (GradMem's per-layer KV memory, App. J). They carry no position (no rotation).
        window: if set, each query sees only its last `window` positions (sliding window, SDPA only; LaCT)."""
        B, T, C = x.size()
        heads = lambda t: t.view(B, -1, t.size(-1) // self.hs, self.hs).transpose(1, 2)     # (B, nh or n_kv, T, hs)
        kv = self.n_kv_head * self.hs
        q, k, v = (heads(t) for t in self.c_attn(x).split([C, kv, kv], dim=2))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if prefix is not None:   # prepend the slots; P dummy query rows keep the causal mask square, then are dropped
            P = prefix[0].size(1)
            q, k, v = torch.cat([q.new_zeros(B, self.n_head, P, q.size(-1)), q], 2), \
                torch.cat([heads(prefix[0]), k], 2), torch.cat([heads(prefix[1]), v], 2)
        if self.n_kv_head < self.n_head:   # GQA: K/V head j serves query heads j*g .. j*g+g-1 (HF Llama's repeat_kv)
            g = self.n_head // self.n_kv_head
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)                # (B, nh, T, hs)
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
        self.swiglu, self.gelu_approx = config.mlp == "swiglu", config.gelu_approx
        n_out = 2 * config.n_hidden if self.swiglu else config.n_hidden  # SwiGLU: gate and up, fused
        self.c_fc = nn.Linear(config.n_embd, n_out, bias=config.bias)
        self.c_proj = nn.Linear(config.n_hidden, config.n_embd, bias=config.bias)

    def forward(self, x):
        h = self.c_fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.gelu_approx)
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1, self.attn = make_norm(config), CausalSelfAttention(config)
        self.ln_2, self.mlp = make_norm(config), MLP(config)
        self.parallel = config.parallel_residual

    def forward(self, x, rope, attn, prefix=None):
        if self.parallel:                  # GPT-NeoX: attention and MLP both read the block's input
            return x + self.attn(self.ln_1(x), rope, attn, prefix) + self.mlp(self.ln_2(x))
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
            c = config
            scaling = (c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_max_pos)
            inv = rope_frequencies(int(c.n_embd // c.n_head * c.rotary_pct), c.rope_theta, c.rope_llama3, scaling)
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
        """Token ids (B, T) -> input embeddings (B, T, C); a padding id (negative, gradmem.PAD) embeds as id 0."""
        return self.transformer.wte(idx.clamp(min=0))

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

    @classmethod
    def from_pretrained(cls, path):
        """A Hugging Face checkpoint folder (config.json + model.safetensors, sharded *.safetensors with their
        index.json, or pytorch_model.bin) of a GPT-2, GPT-NeoX/Pythia or Llama model, as float32 weights of this
        class; a hub name (gpt2, EleutherAI/pythia-160m) is fetched when huggingface_hub is installed and online;
        a .gguf file of a llama-architecture model goes through from_gguf. Logits: model.lm_head(model(model.embed(idx)))."""
        if str(path).endswith(".gguf") and os.path.isfile(path):
            return from_gguf(path, cls)
        folder = hub_folder(path)
        with open(os.path.join(folder, "config.json")) as f:
            hf = json.load(f)
        if hf.get("model_type") not in HF_ARCHS:
            raise PretrainedError(f"{folder}/config.json: model_type {hf.get('model_type')!r} is not one of "
                                  f"gpt2, gpt_neox or llama")
        to_config, prefix, table, ignore = HF_ARCHS[hf["model_type"]]
        try:
            config = GPTConfig(**to_config(hf))
        except KeyError as e:
            raise PretrainedError(f"{folder}/config.json has no {e.args[0]!r}") from None
        model = cls(config)
        state = read_weights(folder)
        if not any(k.startswith(prefix) for k in state):    # saved from the base model: no "transformer."/"model."
            state = {k if k.startswith(("lm_head.", "embed_out.")) else prefix + k: t for k, t in state.items()}
        model.load_state_dict(convert_state(table, ignore, state, model))
        return model


# ---------------------------------------------------------------- low-rank adapters active only during WRITE (App. I)
# "During WRITE, learned LoRA adapters optimize memory vectors at test time, while the pretrained base model remains
# frozen during READ" (App. I; Hu et al., 2022). An adapter is off unless switched on by `lora_enabled`, so READ and
# every pass outside that context manager is the base model itself.

LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")   # every block's four projection Linears


class LoRALinear(nn.Linear):
    """An nn.Linear plus a rank-r adapter: y = x W^T + b + (x A^T B^T) * alpha / r while `lora_on`, x W^T + b otherwise.
    Built from an existing Linear, it holds that Linear's own `weight` and `bias` Parameters (the same objects, so
    optimizers and tied references keep working) under the same names: the state-dict keys of the base weights do not
    change, the adapter adds `<name>.lora_A` (r, in) and `<name>.lora_B` (out, r). A is Kaiming-uniform (as in LoRA
    and peft), B is zero, so a fresh adapter switched on changes nothing until B learns."""

    def __init__(self, base, r, alpha=None):
        nn.Module.__init__(self)                    # no new weight: the base Linear's Parameters are taken over
        if r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {r}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.r, self.alpha = r, float(r if alpha is None else alpha)
        self.scale = self.alpha / r
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_on = False

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if self.lora_on:
            y = y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale
        return y

    def extra_repr(self):
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha:g}, lora_on={self.lora_on}"


def add_lora(model, r, targets=LORA_TARGETS, alpha=None):
    """Replace every transformer block's Linears named by `targets` (suffixes after `h.<i>.`; default LORA_TARGETS:
    attn.c_attn (fused q, k, v), attn.c_proj, mlp.c_fc (fused gate/up or fc), mlp.c_proj) by LoRALinear of rank r,
    off. `model`: a GPT, or any module holding one (GradMem). Returns the new adapter Parameters [A, B, A, B, ...] in
    module order. Base weights keep their names, Parameters and requires_grad: freeze them yourself for App. I's
    frozen base. Load a checkpoint saved with adapters after add_lora with the same r and targets."""
    found = [(name, m) for name, m in model.named_modules()
             if any(re.search(rf"(^|\.)h\.\d+\.{re.escape(t)}$", name) for t in targets)]
    if not found:
        raise ValueError(f"add_lora: no module of the model matches the targets {list(targets)}")
    params = []
    for name, m in found:
        if isinstance(m, LoRALinear):
            raise ValueError(f"add_lora: {name} already has an adapter")
        if type(m) is not nn.Linear:
            raise ValueError(f"add_lora: {name} is a {type(m).__name__}, not an nn.Linear")
        parent, _, leaf = name.rpartition(".")
        lora = LoRALinear(m, r, alpha)
        setattr(model.get_submodule(parent), leaf, lora)
        params += [lora.lora_A, lora.lora_B]
    return params


def lora_parameters(model):
    """The adapter Parameters of `model` (add_lora's list), for an optimizer group."""
    return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A, m.lora_B)]


@contextlib.contextmanager
def lora_enabled(model, on=True):
    """Switch every adapter of `model` on (or off) inside the block, restoring each one's previous state after it
    (also on an exception). Wrap the WRITE loss in it; READ, outside, runs the base model. No adapters: a no-op."""
    mods = [m for m in model.modules() if isinstance(m, LoRALinear)]
    before = [m.lora_on for m in mods]
    for m in mods:
        m.lora_on = on
    try:
        yield model
    finally:
        for m, b in zip(mods, before):
            m.lora_on = b


class PretrainedError(ValueError):
    """A pretrained checkpoint that cannot be read into GPT: the message names the file, key or tensor."""


def hf_gpt2(c):
    if c.get("scale_attn_by_inverse_layer_idx") or not c.get("scale_attn_weights", True):
        raise PretrainedError("config.json: GPT-2 attention scaled by layer index or unscaled does not load")
    return dict(n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"], n_hidden=c.get("n_inner") or 4 * c["n_embd"],
                vocab_size=c["vocab_size"], block_size=c["n_positions"], norm_eps=c.get("layer_norm_epsilon", 1e-5),
                mlp="gelu", gelu_approx=hf_gelu(c.get("activation_function", "gelu_new")), norm="layer", pos="learned",
                bias=True, tie=c.get("tie_word_embeddings", True))


def hf_neox(c):
    rope = c.get("rope_parameters") or {}     # transformers >= 5 nests rotary_pct and rotary_emb_base here
    return dict(n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"], n_embd=c["hidden_size"],
                n_hidden=c["intermediate_size"], vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"],
                norm_eps=c.get("layer_norm_eps", 1e-5), mlp="gelu", gelu_approx=hf_gelu(c.get("hidden_act", "gelu")),
                norm="layer", pos="rope", bias=True, tie=c.get("tie_word_embeddings", False), rope_llama3=False,
                rope_theta=rope.get("rope_theta", c.get("rotary_emb_base", c.get("rope_theta", 10000.0))),
                rotary_pct=rope.get("partial_rotary_factor", c.get("rotary_pct", 0.25)),
                parallel_residual=c.get("use_parallel_residual", True))


def hf_llama(c):
    rope = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}   # transformers < 5, >= 5
    kind = rope.get("rope_type", rope.get("type", "default"))
    hs = c["hidden_size"] // c["num_attention_heads"]
    if kind not in ("default", "llama3") or c.get("head_dim", hs) != hs or c.get("hidden_act", "silu") != "silu":
        raise PretrainedError(f"config.json: rope_type {kind!r}, head_dim {c.get('head_dim')} (hidden_size / heads "
                              f"= {hs}), hidden_act {c.get('hidden_act')!r}: only default/llama3, {hs} and silu load")
    scaling = dict(rope_factor=rope["factor"], rope_low_freq_factor=rope["low_freq_factor"],
                   rope_high_freq_factor=rope["high_freq_factor"],
                   rope_original_max_pos=rope["original_max_position_embeddings"]) if kind == "llama3" else {}
    return dict(n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"], n_embd=c["hidden_size"],
                n_kv_head=c.get("num_key_value_heads") or c["num_attention_heads"], n_hidden=c["intermediate_size"],
                vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"], norm_eps=c.get("rms_norm_eps", 1e-6),
                mlp="swiglu", norm="rms", pos="rope", bias=c.get("attention_bias", False),
                tie=c.get("tie_word_embeddings", False), rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                rope_llama3=kind == "llama3", **scaling)


def hf_gelu(act):
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise PretrainedError(f"config.json: activation {act!r} is not gelu (exact), gelu_new or gelu_pytorch_tanh")
    return "none" if act == "gelu" else "tanh"


# ours <- Hugging Face transformers' tensor names: {i} the layer, {p} weight and bias (a bias only where ours has one);
# several HF names are concatenated along the output dim; "T": transposed (GPT-2's Conv1D stores (in, out)),
# "heads": GPT-NeoX's query_key_value rows [h0 q, h0 k, h0 v, h1 q, ...] regrouped to ours [q heads, k heads, v heads]
HF_GPT2 = [
    ("transformer.wte.weight", "transformer.wte.weight", ""),
    ("transformer.wpe.weight", "transformer.wpe.weight", ""),
    ("transformer.h.{i}.ln_1.{p}", "transformer.h.{i}.ln_1.{p}", ""),
    ("transformer.h.{i}.attn.c_attn.{p}", "transformer.h.{i}.attn.c_attn.{p}", "T"),
    ("transformer.h.{i}.attn.c_proj.{p}", "transformer.h.{i}.attn.c_proj.{p}", "T"),
    ("transformer.h.{i}.ln_2.{p}", "transformer.h.{i}.ln_2.{p}", ""),
    ("transformer.h.{i}.mlp.c_fc.{p}", "transformer.h.{i}.mlp.c_fc.{p}", "T"),
    ("transformer.h.{i}.mlp.c_proj.{p}", "transformer.h.{i}.mlp.c_proj.{p}", "T"),
    ("transformer.ln_f.{p}", "transformer.ln_f.{p}", ""),
    ("lm_head.weight", "lm_head.weight", ""),
]
HF_NEOX = [
    ("transformer.wte.weight", "gpt_neox.embed_in.weight", ""),
    ("transformer.h.{i}.ln_1.{p}", "gpt_neox.layers.{i}.input_layernorm.{p}", ""),
    ("transformer.h.{i}.attn.c_attn.{p}", "gpt_neox.layers.{i}.attention.query_key_value.{p}", "heads"),
    ("transformer.h.{i}.attn.c_proj.{p}", "gpt_neox.layers.{i}.attention.dense.{p}", ""),
    ("transformer.h.{i}.ln_2.{p}", "gpt_neox.layers.{i}.post_attention_layernorm.{p}", ""),
    ("transformer.h.{i}.mlp.c_fc.{p}", "gpt_neox.layers.{i}.mlp.dense_h_to_4h.{p}", ""),
    ("transformer.h.{i}.mlp.c_proj.{p}", "gpt_neox.layers.{i}.mlp.dense_4h_to_h.{p}", ""),
    ("transformer.ln_f.{p}", "gpt_neox.final_layer_norm.{p}", ""),
    ("lm_head.weight", "embed_out.weight", ""),
]
HF_LLAMA = [
    ("transformer.wte.weight", "model.embed_tokens.weight", ""),
    ("transformer.h.{i}.ln_1.weight", "model.layers.{i}.input_layernorm.weight", ""),
    ("transformer.h.{i}.attn.c_attn.{p}", [f"model.layers.{{i}}.self_attn.{x}_proj.{{p}}" for x in "qkv"], ""),
    ("transformer.h.{i}.attn.c_proj.{p}", "model.layers.{i}.self_attn.o_proj.{p}", ""),
    ("transformer.h.{i}.ln_2.weight", "model.layers.{i}.post_attention_layernorm.weight", ""),
    ("transformer.h.{i}.mlp.c_fc.{p}", [f"model.layers.{{i}}.mlp.{x}_proj.{{p}}" for x in ("gate", "up")], ""),
    ("transformer.h.{i}.mlp.c_proj.{p}", "model.layers.{i}.mlp.down_proj.{p}", ""),
    ("transformer.ln_f.weight", "model.norm.weight", ""),
    ("lm_head.weight", "lm_head.weight", ""),
]
# model_type -> (config.json -> GPTConfig fields, prefix of the base model's names, table, buffers we recompute)
HF_ARCHS = {"gpt2": (hf_gpt2, "transformer.", HF_GPT2, r"\.attn\.(masked_)?bias$"),
            "gpt_neox": (hf_neox, "gpt_neox.", HF_NEOX, r"\.attention\.(masked_)?bias$|rotary_emb\.inv_freq$"),
            "llama": (hf_llama, "model.", HF_LLAMA, r"rotary_emb\.inv_freq$")}


def table_rows(table, c, ours):
    """Expand {i} and {p} of a mapping table: (our tensor name, its HF tensor names, how), for tensors ours has."""
    for mine, theirs, how in table:
        theirs = [theirs] if isinstance(theirs, str) else theirs
        for i in range(c.n_layer) if "{i}" in mine else [0]:
            for p in ("weight", "bias") if "{p}" in mine else ["weight"]:
                if mine.format(i=i, p=p) in ours and not (c.tie and mine == "lm_head.weight"):  # tied: wte's tensor
                    yield mine.format(i=i, p=p), [k.format(i=i, p=p) for k in theirs], how


def convert_state(table, ignore, state, model):
    """Our state_dict from a checkpoint's tensors by `table`; a missing, unexpected or misshapen tensor is an error."""
    c, ours, out, used = model.config, model.state_dict(), {}, set()
    kv = (c.n_kv_head or c.n_head) * (c.n_embd // c.n_head)
    for name, keys, how in table_rows(table, c, ours):
        sizes = [c.n_embd, kv, kv] if len(keys) == 3 else [ours[name].size(0) // len(keys)] * len(keys)  # q k v; gate up
        parts = []
        for k, want in zip(keys, torch.empty(ours[name].shape, device="meta").split(sizes)):
            if k not in state:
                raise PretrainedError(f"checkpoint has no tensor {k} (for our {name})")
            parts.append(state[k].t() if how == "T" else state[k])
            if parts[-1].shape != want.shape:
                want = want.t() if how == "T" else want
                raise PretrainedError(f"tensor {k} has shape {tuple(state[k].shape)}, expected {tuple(want.shape)} "
                                      f"(for our {name})")
            used.add(k)
        t = torch.cat(parts)
        if how == "heads":                          # rows (nh, 3, hs) -> (3, nh, hs): [q heads; k heads; v heads]
            t = t.reshape(c.n_head, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        out[name] = t
    ignore += r"|^lm_head\.weight$" if c.tie else ""  # a tied head some files store again
    extra = sorted(k for k in state if k not in used and not re.search(ignore, k))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise PretrainedError(f"checkpoint has unexpected tensor {extra[0]}{more}")
    if c.tie:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


# llama.cpp's tensor names -> Hugging Face Llama's: blk.{i}.NAME.weight -> model.layers.{i}.HF.weight
GGUF_LLAMA = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def from_gguf(path, cls=None):
    """A llama-architecture GGUF file (llama.cpp's format) as a float32 GPT: every tensor dequantized by the gguf
    package, renamed to Hugging Face Llama's names and loaded as from_pretrained loads those. llama.cpp's converter
    interleaves the rows of each Q and K head for its RoPE (per head: rows (2, hs/2) -> (hs/2, 2)); this undoes it.
    The tokenizer of the same file: tokenizer.tokenizer_for(path)."""
    try:
        import gguf
    except ImportError:
        raise PretrainedError("gguf is not installed: pip install gguf (it reads .gguf files)") from None
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    if meta.get("general.architecture") != "llama":
        raise PretrainedError(f"{path}: general.architecture {meta.get('general.architecture')!r} is not llama")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names or meta.get("llama.rope.scaling.type", "none") not in ("none", "linear") \
            or meta.get("llama.rope.scaling.factor", 1.0) != 1.0:
        raise PretrainedError(f"{path}: RoPE scaling (rope_freqs or llama.rope.scaling.*) does not load")
    try:
        g = lambda k, *default: meta[f"llama.{k}"] if f"llama.{k}" in meta or not default else default[0]  # noqa: E731
        hf = dict(num_hidden_layers=g("block_count"), hidden_size=g("embedding_length"),
                  num_attention_heads=g("attention.head_count"), intermediate_size=g("feed_forward_length"),
                  num_key_value_heads=g("attention.head_count_kv", g("attention.head_count")),
                  max_position_embeddings=g("context_length"), rms_norm_eps=g("attention.layer_norm_rms_epsilon"),
                  rope_theta=g("rope.freq_base", 10000.0), tie_word_embeddings="output.weight" not in names,
                  vocab_size=int(next(t.shape[-1] for t in reader.tensors if t.name == "token_embd.weight")))
    except KeyError as e:
        raise PretrainedError(f"{path}: metadata has no {e.args[0]!r}") from None
    except StopIteration:
        raise PretrainedError(f"{path} has no tensor token_embd.weight") from None
    hs = hf["hidden_size"] // hf["num_attention_heads"]
    if g("rope.dimension_count", hs) != hs:
        raise PretrainedError(f"{path}: llama.rope.dimension_count {g('rope.dimension_count')} is not the head size {hs}")
    state = {}
    for t in reader.tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32").reshape(
            [int(n) for n in reversed(t.shape)]))
        m = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", t.name)
        if not m or m[2] not in GGUF_LLAMA:
            state[t.name] = w                   # convert_state names it as unexpected
            continue
        heads = {"attn_q": hf["num_attention_heads"], "attn_k": hf["num_key_value_heads"]}.get(m[2])
        if heads:                               # llama.cpp's permute undone: (nh, hs/2, 2, ...) -> (nh, 2, hs/2, ...)
            w = w.reshape(heads, hs // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
        state[f"model.layers.{m[1]}.{GGUF_LLAMA[m[2]]}.{m[3]}" if m[1] else f"{GGUF_LLAMA[m[2]]}.{m[3]}"] = w
    model = (cls or GPT)(GPTConfig(**hf_llama(hf)))
    _, _, table, ignore = HF_ARCHS["llama"]
    model.load_state_dict(convert_state(table, ignore, state, model))
    return model


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def read_safetensors(path):
    """The safetensors format: an 8-byte little-endian header size n, n bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}, then the tensors' raw little-endian bytes (offsets from there)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header, data = json.loads(f.read(n)), bytearray(f.read())
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        if h["dtype"] not in SAFETENSORS_DTYPES:
            raise PretrainedError(f"{path}: tensor {name} has dtype {h['dtype']}, not one of {list(SAFETENSORS_DTYPES)}")
        dt, (a, b) = SAFETENSORS_DTYPES[h["dtype"]], h["data_offsets"]
        count = (b - a) // dt.itemsize
        flat = torch.frombuffer(data, dtype=dt, count=count, offset=a) if count else torch.empty(0, dtype=dt)  # views
        out[name] = flat.reshape(h["shape"])
    return out


def read_weights(folder):
    """Every tensor of a checkpoint folder: model.safetensors, pytorch_model.bin, or the shards an index.json lists."""
    for single, read in (("model.safetensors", read_safetensors),
                         ("pytorch_model.bin", lambda p: torch.load(p, map_location="cpu", weights_only=True))):
        if os.path.isfile(os.path.join(folder, single)):
            return read(os.path.join(folder, single))
        index = os.path.join(folder, single + ".index.json")
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return {k: t for s in shards for k, t in read(os.path.join(folder, s)).items()}
    raise PretrainedError(f"{folder} holds no model.safetensors, pytorch_model.bin or their .index.json")


def hub_folder(name):
    """A local folder as it is; otherwise a Hugging Face hub name, fetched by huggingface_hub when installed and online."""
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise PretrainedError(f"{name} holds no config.json (a Hugging Face checkpoint folder has one)")
        return name
    try:
        from huggingface_hub import snapshot_download
        folder = snapshot_download(name, allow_patterns=["*.json", "*.safetensors"])
        if not any(f.endswith(".safetensors") for f in os.listdir(folder)):        # an older repository: .bin only
            folder = snapshot_download(name, allow_patterns=["*.json", "pytorch_model*.bin"])
        return folder
    except Exception as e:                           # not installed, offline, no such repo, gated
        why = "huggingface_hub is not installed" if isinstance(e, ImportError) else f"the hub gave {type(e).__name__}"
        raise PretrainedError(f"{name}: no local folder and {why}; download it with "
                              f"`hf download {name} --local-dir DIR` and pass DIR") from None
