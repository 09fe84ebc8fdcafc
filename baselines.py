"""
Baselines that GradMem (arXiv:2603.13875v2) is compared with on KV retrieval (§3.2, Table 1), on the same model.py.

RMT, Recurrent Memory Transformer (Bulatov et al., NeurIPS 2022), two segments as in §3.2. WRITE is forward-only:
    H      = f_theta([M_k; C; M_k])            the memory tokens are read at the start and written at the end
    M_{k+1} = W H[-m:]                          the last m hidden states, through a Linear W initialised to identity
K > 1 re-reads the context K times ("x2 ... x5 memory updates" rows of Table 1). READ is GradMem's: [M_K; Q; Y].
With --rmt_rec w > 0 (the authors' RMT KV script at commit 2bc0b12 uses w = 1; the paper's text does not mention it)
training adds w * mean_{k=1..K} L_rec(M_k) to the task loss, with
    L_rec(M; C) = -(1/T) sum_i log h(t_i | [M; t_<i])     (GradMem's Eq. (4), token mean, through a head h)
h is a reconstruction head initialised from the LM head (or the LM head itself with --no-write_head). L_rec(M_k)
for k < K is read off the pass that writes M_{k+1}; one more pass over [M_K; C] gives L_rec(M_K). Unlike the authors'
"proj_rw" variant (a Linear on the memory going into each write pass, another one on the memory READ takes), one W
here feeds both READ and the next pass, so L_rec constrains the memory READ sees.

Full-context transformer (the upper bound of Table 1): the same model on [C; Q; Y]; its "memory" is the KV cache.

ARMT, Associative Recurrent Memory Transformer (Rodkin et al., 2024), two segments. Every layer l keeps an associative
memory A_l (d_key x d) and a normaliser z_l (d_key), written from the layer's outputs at the m memory tokens appended
to the context, [C; M], and read by every token of [Q; Y] before that layer:
    phi(x)  = normalize(DPFP_nu(x)),  DPFP_nu(x) = [x'; ...; x'] * [roll(x', 1); ...; roll(x', nu)], x' = [relu x; relu -x]
    write   k = phi(W_k t), v = W_v t, beta = sigmoid(W_b t), v_old = A^T k / (z . k)   (0 for the first write)
            A <- A + sum_t beta_t k_t (v_t - v_old_t)^T,   z <- z + sum_t gamma_t k_t,  gamma = clip(1 - z.k / |k|^2, 0, 1)
            (gamma is a constant in backprop, a stop-gradient)
    read    q = phi(W_q h),  h <- h + A^T q / (z . q)
with d_mem = 64 (d_key = 2 * 64 * nu), nu = 3, as in the paper's KV runs.
With --segment L the context is written L tokens at a time, [C_1; M], [C_2; M], ... (positions from 0 in each): from
the second segment on, every layer reads its memory into its input before the block, as [Q; Y] does, and writes
after it. The paper's text uses one context segment; the authors' ARMT KV script, one 7-token pair per segment.

Mamba (Gu & Dao 2023; the SSD layer of Mamba-2, Dao & Gu, ICML 2024), reading [C; Q; Y] with a per-layer state.
Per head h (scalar decay A_h < 0), state H_t in R^{P x N}, input x_t in R^P, B_t, C_t in R^N, step dt_t > 0:
    H_t = exp(dt_t A_h) H_{t-1} + dt_t x_t B_t^T,      y_t = H_t C_t + D_h x_t
computed chunk by chunk: inside a chunk as a masked, decayed C B^T "attention", across chunks by passing H.

TTT-Linear (Sun et al., 2025, App. H): per-head linear fast weights trained by mini-batch gradient descent on a
reconstruction loss as the context streams by (see TTTLinear). LaCT (Zhang et al., 2026, App. H): SwiGLU fast
weights updated once per large chunk on a dot-product loss, beside sliding-window attention (see LaCT).

Every class returns the dict GradMem.forward returns (loss, task_loss, logits, mem, losses, nll, grad_norm), so
train.py and eval.py drive them unchanged.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradmem import PAD, at_target, context_nll, pack, read_loss
from model import MLP, CausalSelfAttention, RMSNorm, apply_rope, rope_frequencies, rope_tables


def outputs(task_loss, logits, mem=None):
    """GradMem.forward's dict for a model without a WRITE loss."""
    return dict(loss=task_loss, task_loss=task_loss, logits=logits, mem=mem, losses=[], nll=[], grad_norm=torch.zeros(()))


class RMT(nn.Module):
    """RMT (Bulatov et al., NeurIPS 2022), two segments: forward-only WRITE M_{k+1} = W f([M_k; C; M_k])[-m:],
    K times; READ [M_K; Q; Y] as GradMem's (module docstring)."""

    def __init__(self, model, n_mem, K, rec=0.0, rec_head=True):
        super().__init__()
        self.model, self.K, self.rec = model, K, rec
        d = model.config.n_embd
        self.mem0 = nn.Parameter(0.02 * torch.randn(n_mem, d))
        self.write_proj = nn.Linear(d, d)                       # W, initialised to identity (authors' code)
        nn.init.eye_(self.write_proj.weight)
        nn.init.zeros_(self.write_proj.bias)
        self.rec_head = None                                    # h of L_rec: its own copy of the LM head
        if rec > 0 and rec_head:
            self.rec_head = nn.Linear(d, model.config.vocab_size, bias=False)
            self.rec_head.weight.data.copy_(model.lm_head.weight.data)

    def memory_floats(self, ctx_len):
        return self.mem0.numel()

    def write(self, ctx, K, rec=False):
        """K forward-only memory updates M_{k+1} = W f([M_k; C; M_k])[-m:]. Returns M_K, or with rec=True
        (M_K, [L_rec(M_1), ..., L_rec(M_K)]), each L_rec summed over the batch."""
        m, T = self.mem0.size(0), ctx.size(1)
        head = self.rec_head or self.model.lm_head
        mem = self.mem0.expand(ctx.size(0), -1, -1)
        emb, real, ones = self.model.embed(ctx), ctx != PAD, torch.ones(ctx.size(0), m, dtype=torch.bool, device=ctx.device)
        losses = []
        for k in range(K + 1 if rec else K):                    # with rec, one more pass for L_rec(M_k)
            if k < K:                                           # [M; C; M], a padded context's pads moved to the end
                x, (_, _, at) = pack([mem, emb, mem], [ones, real, ones])
            else:                                               # the extra pass needs no write tokens
                x = torch.cat([mem, emb], dim=1)
            h = self.model(x)                                   # (B, m + T (+ m), C)
            if k > 0 and rec:                                   # L_rec(M_k): position m - 1 + i predicts t_{i+1}
                losses.append(context_nll(head(h[:, m - 1:m - 1 + T]), ctx)[0])
            if k < K:                                           # the states of the second M, the last m when unpadded
                mem = self.write_proj(at_target(h, at + 1, m))
        return (mem, losses) if rec else mem

    def forward(self, ctx, q, y, K=None):
        K = self.K if K is None else K
        rec = self.training and self.rec > 0 and K > 0
        mem, losses = self.write(ctx, K, rec=True) if rec else (self.write(ctx, K), [])
        task_loss, logits = self.read(mem, q, y)
        out = outputs(task_loss, logits, mem)
        if losses:                                              # logged write_loss: L_rec(M_1), as GradMem's L(M_0)
            out.update(loss=task_loss + self.rec * torch.stack(losses).mean() / ctx.size(0), losses=losses)
        return out

    def memorize(self, ctx, K=None):
        return self.write(ctx, self.K if K is None else K), {}

    def read(self, mem, q, y):
        return read_loss(self.model, mem, q, y)


def read_packed(model, embed, head, ctx, q, y):
    """Full-context READ: [C; Q; Y] packed per sample (pads to the end), the logits of y (B, L, V) and their
    cross-entropy. model maps input embeddings to final states."""
    seq, (_, _, start) = pack([ctx, q, y], [ctx != PAD, q != PAD, y != PAD])
    logits = head(at_target(model(embed(seq[:, :-1])), start, y.size(1)))
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=PAD), logits


class FullContext(nn.Module):
    """The transformer reads [C; Q; Y] directly: nothing is compressed."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def memory_floats(self, ctx_len):
        c = self.model.config
        return c.n_layer * ctx_len * c.n_embd * 2          # the KV cache of the context

    def forward(self, ctx, q, y, K=None):
        return outputs(*self.read(ctx, q, y))

    def memorize(self, ctx, K=None):
        return ctx, {}                                       # nothing is written: READ sees the context itself

    def read(self, ctx, q, y):
        return read_packed(self.model, self.model.embed, self.model.lm_head, ctx, q, y)


def dpfp(x, nu=3):
    """Deterministic parameter-free projection (Schlag et al., 2021): (..., n) -> (..., 2 n nu), non-negative."""
    x = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
    return torch.cat([x] * nu, dim=-1) * torch.cat([x.roll(i, dims=-1) for i in range(1, nu + 1)], dim=-1)


class AssociativeMemory(nn.Module):
    """One layer's ARMT memory: the delta-rule write and the normalised read of the module docstring."""

    def __init__(self, d, d_mem=64, nu=3, eps=1e-5):
        super().__init__()
        self.nu, self.eps, self.d_key = nu, eps, 2 * d_mem * nu
        self.W_q, self.W_k = nn.Linear(d, d_mem, bias=False), nn.Linear(d, d_mem, bias=False)
        self.W_v, self.W_b = nn.Linear(d, d, bias=False), nn.Linear(d, 1)
        for w in (self.W_q.weight, self.W_k.weight, self.W_b.weight):
            nn.init.uniform_(w, -d ** -0.5, d ** -0.5)
        nn.init.zeros_(self.W_v.weight)          # the memory starts out adding nothing (ARMT's init)
        nn.init.ones_(self.W_b.bias)

    def phi(self, x):
        return F.normalize(dpfp(x, self.nu), dim=-1)

    def write(self, t, A=None, z=None):
        """t: (B, m, d) memory-token outputs. Returns the new (A (B, d_key, d), z (B, d_key))."""
        k, v, beta = self.phi(self.W_k(t)), self.W_v(t), torch.sigmoid(self.W_b(t))          # (B, m, d_key), (B, m, d), (B, m, 1)
        if A is None:
            A, z, v_old, gamma = 0.0, 0.0, torch.zeros_like(v), 1.0
        else:
            zk = (k @ z[..., None]) + self.eps                                                  # (B, m, 1): z . k
            v_old = (k @ A) / zk
            gamma = (1 - zk / (k * k).sum(-1, keepdim=True)).clamp(0, 1).detach()
        A = A + k.transpose(1, 2) @ (beta * (v - v_old))                                        # sum_t beta k (v - v_old)^T
        z = z + (gamma * k).sum(1)
        return A, z

    def read(self, h, A, z):
        q = self.phi(self.W_q(h))                                                               # (B, T, d_key)
        return (q @ A) / ((q @ z[..., None]) + self.eps)


class ARMT(nn.Module):
    """ARMT (Rodkin et al., 2024): the context is written segment by segment, [C_s; M] for s = 1 .. S, each layer
    reading its AssociativeMemory into its input (from the second segment on) and then writing its memory-token
    outputs into it (delta rule, module docstring); [Q; Y] reads it in every layer. segment = 0: the whole context is
    one segment, the paper's two-segment setup (§3.2); segment = 7 at KV: one pair per segment, as the authors'
    ARMT KV script runs it. Every segment starts from the same learned memory tokens M and from position 0."""

    def __init__(self, model, n_mem, d_mem=64, nu=3, segment=0):
        super().__init__()
        self.model, self.segment = model, segment
        d = model.config.n_embd
        self.mem0 = nn.Parameter(0.02 * torch.randn(n_mem, d))
        self.assoc = nn.ModuleList([AssociativeMemory(d, d_mem, nu) for _ in range(model.config.n_layer)])

    def memory_floats(self, ctx_len):
        return sum(a.d_key * (self.model.config.n_embd + 1) for a in self.assoc)

    def write(self, ctx):
        """[C_s; M] for each context segment in turn. Returns every layer's (A, z)."""
        m, T = self.mem0.size(0), ctx.size(1)
        state = [None] * len(self.assoc)

        def wrap_at(at):
            def wrap(i, block, x, rope, attn):
                if state[i] is not None:                        # what earlier segments wrote, read before block i
                    x = x + self.assoc[i].read(x, *state[i])
                out = block(x, rope, attn)                      # the m memory tokens' outputs, from position at
                state[i] = self.assoc[i].write(at_target(out, at + 1, m), *(state[i] or ()))
                return out
            return wrap

        mem = self.mem0.expand(ctx.size(0), -1, -1)
        if self.segment and (ctx == PAD).any():
            raise ValueError("ARMT --segment needs contexts of one length; this batch is padded (use --segment 0)")
        for s in range(0, T, self.segment or T):
            seg = ctx[:, s:s + (self.segment or T)]             # [C_s; M], a padded context's pads moved to the end
            x, (_, at) = pack([self.model.embed(seg), mem], [seg != PAD, torch.ones_like(mem[..., 0], dtype=torch.bool)])
            self.model(x, wrap=wrap_at(at))
        return state

    def forward(self, ctx, q, y, K=None):
        return outputs(*self.read(self.write(ctx), q, y))

    def memorize(self, ctx, K=None):
        return self.write(ctx), {}

    def read(self, state, q, y):
        def wrap(i, block, x, rope, attn):                      # segment 2, [Q; Y]: every layer reads its memory
            return block(x + self.assoc[i].read(x, *state[i]), rope, attn)

        return read_packed(lambda x: self.model(x, wrap=wrap), self.model.embed, self.model.lm_head,
                           q[:, :0], q, y)


def ssd_sequential(x, dt, A, B, C):
    """Reference recurrence, one step at a time. x: (b, T, H, P), dt: (b, T, H), A: (H,), B, C: (b, T, N)."""
    h = x.new_zeros(x.size(0), x.size(2), x.size(3), B.size(-1))                        # (b, H, P, N)
    ys = []
    for t in range(x.size(1)):
        h = torch.exp(dt[:, t, :, None, None] * A[:, None, None]) * h \
            + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, None, None, :]        # H_t = e^{dt A} H + dt x B^T
        ys.append(h @ C[:, t, None, :, None])                                           # y_t = H_t C_t
    return torch.stack(ys, 1).squeeze(-1), h


def ssd_chunked(x, dt, A, B, C, chunk=16):
    """The same recurrence, parallel inside chunks of `chunk` steps; returns (y (b, T, H, P), final state)."""
    b, T, H, P = x.shape
    h = x.new_zeros(b, H, P, B.size(-1))
    ys = []
    for t0 in range(0, T, chunk):
        xs, dts, Bs, Cs = x[:, t0:t0 + chunk], dt[:, t0:t0 + chunk], B[:, t0:t0 + chunk], C[:, t0:t0 + chunk]
        L = xs.size(1)
        cum = torch.cumsum(dts * A, dim=1).transpose(1, 2)                              # (b, H, L): sum_{r<=t} dt_r A
        seg = cum[..., :, None] - cum[..., None, :]                                     # (b, H, t, s): decay s -> t
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(seg.masked_fill(~causal, float("-inf")))
        u = (dts[..., None] * xs).transpose(1, 2)                                       # (b, H, L, P): dt_s x_s
        y = (decay * (Cs @ Bs.transpose(1, 2))[:, None]) @ u                            # intra-chunk
        y = y + torch.exp(cum)[..., None] * (Cs[:, None] @ h.transpose(-1, -2))         # from the incoming state
        h = torch.exp(cum[..., -1:, None]) * h \
            + (torch.exp(cum[..., -1:] - cum)[..., None] * u).transpose(-1, -2) @ Bs[:, None]   # state at chunk end
        ys.append(y.transpose(1, 2))
    return torch.cat(ys, 1), h


class Mamba2Block(nn.Module):
    """Mamba-2 mixer (Dao & Gu, ICML 2024): in-projection to z, [x B C], dt; causal depthwise conv and silu on
    [x B C]; the SSD recurrence H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T, y_t = H_t C_t + D x_t (ssd_chunked);
    gated by silu(z), RMS-normalised, out-projected."""

    def __init__(self, d, d_state=16, headdim=32, expand=2, d_conv=4):
        super().__init__()
        self.d_inner, self.d_state, self.headdim = expand * d, d_state, headdim
        self.n_heads = self.d_inner // headdim
        conv_dim = self.d_inner + 2 * d_state
        self.in_proj = nn.Linear(d, self.d_inner + conv_dim + self.n_heads, bias=False)   # z, [x B C], dt
        self.conv = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1)
        self.A_log = nn.Parameter(torch.log(torch.empty(self.n_heads).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(torch.log(torch.expm1(torch.exp(torch.empty(self.n_heads).uniform_(
            math.log(1e-3), math.log(1e-1))))))                                           # softplus^-1 of dt in [1e-3, 0.1]
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = RMSNorm(self.d_inner, 1e-5)
        self.out_proj = nn.Linear(self.d_inner, d, bias=False)

    def state_floats(self):
        return self.n_heads * self.headdim * self.d_state + self.conv.in_channels * (self.conv.kernel_size[0] - 1)

    def forward(self, u):
        b, T, _ = u.shape
        z, xBC, dt = self.in_proj(u).split([self.d_inner, self.conv.in_channels, self.n_heads], dim=-1)
        xBC = F.silu(self.conv(xBC.transpose(1, 2))[..., :T].transpose(1, 2))              # causal depthwise conv
        x, B, C = xBC.split([self.d_inner, self.d_state, self.d_state], dim=-1)
        x = x.view(b, T, self.n_heads, self.headdim)
        y, _ = ssd_chunked(x, F.softplus(dt + self.dt_bias), -torch.exp(self.A_log), B, C)
        y = (y + self.D[:, None] * x).reshape(b, T, self.d_inner)
        return self.out_proj(self.norm(y * F.silu(z)))


def rope_inv_freq(config):
    """The GPT's RoPE frequencies (model.py: GPT), for the baselines' own attention-like layers."""
    return rope_frequencies(config.n_embd // config.n_head, config.rope_theta, config.rope_llama3).float()


def ttt_linear_chunk(W, b, q, k, v, eta):
    """One mini-batch of TTT-Linear in dual form. Fast weights f(x) = W x + b, inner loss l_s = |f(k_s) - v_s|^2 / 2,
    every gradient of the mini-batch taken at its first (W, b) (mini-batch TTT), with E_s = W k_s + b - v_s:
        W_t = W - sum_{s<=t} eta_s E_s k_s^T,   b_t = b - sum_{s<=t} eta_s E_s,   z_t = W_t q_t + b_t
            = W q_t + b - sum_{s<=t} eta_s (k_s . q_t + 1) E_s.
    W: (..., hs, hs); b: (..., hs); q, k, v: (..., n, hs); eta: (..., n). Returns z (..., n, hs), next W, next b."""
    E = k @ W.transpose(-1, -2) + b[..., None, :] - v                                  # rows W k_s + b - v_s
    n = q.size(-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    z = q @ W.transpose(-1, -2) + b[..., None, :] - ((q @ k.transpose(-1, -2) + 1) * eta[..., None, :]).masked_fill(~causal, 0.0) @ E
    return z, W - (eta[..., None] * E).transpose(-1, -2) @ k, b - (eta[..., None] * E).sum(-2)


class TTTLinear(nn.Module):
    """TTT-Linear (Sun et al., ICML 2025), simplest form: per head a linear fast weight f(x) = W x + b trained at test
    time on the reconstruction l(W, b; x) = |f(theta_K x) - theta_V x|^2 / 2 with the learned per-token step
    eta = eta_base / hs * sigmoid(theta_lr x), in mini-batches of `chunk` tokens; output f(theta_Q x) with the fast
    weights so far. As in the authors' TTT layer, q and k carry RoPE of the position inside their mini-batch."""

    def __init__(self, config, chunk=16, eta_base=1.0):
        super().__init__()
        d = config.n_embd
        self.nh, self.hs, self.chunk, self.eta_base = config.n_head, d // config.n_head, chunk, eta_base
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.lr = nn.Linear(d, self.nh)
        self.W0 = nn.Parameter(0.02 * torch.randn(self.nh, self.hs, self.hs))
        self.b0 = nn.Parameter(torch.zeros(self.nh, self.hs))
        self.ln = nn.LayerNorm(self.hs)
        self.o = nn.Linear(d, d, bias=False)
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)

    def state_floats(self):
        return self.W0.numel() + self.b0.numel()

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.nh, self.hs).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        rope = rope_tables(self.rope_inv_freq, torch.arange(T, device=x.device) % self.chunk, x.dtype)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        eta = self.eta_base / self.hs * torch.sigmoid(self.lr(x)).transpose(1, 2)          # (B, nh, T)
        W, b, zs = self.W0.expand(B, -1, -1, -1), self.b0.expand(B, -1, -1), []
        for t0 in range(0, T, self.chunk):
            sl = slice(t0, t0 + self.chunk)
            z, W, b = ttt_linear_chunk(W, b, q[:, :, sl], k[:, :, sl], v[:, :, sl], eta[..., sl])
            zs.append(z)
        return self.o(self.ln(torch.cat(zs, dim=2)).transpose(1, 2).reshape(B, T, C))


def lact_grads(W1, W2, W3, k, v, eta):
    """Gradients of the LaCT fast-weight loss L = -sum_t eta_t <f(k_t), v_t>, f(x) = W2 (silu(W1 x) * (W3 x)),
    by hand. W1, W3: (..., h, d); W2: (..., d, h); k, v: (..., n, d); eta: (..., n). Returns (dW1, dW2, dW3)."""
    h1, h3 = k @ W1.transpose(-1, -2), k @ W3.transpose(-1, -2)                         # (..., n, h)
    a = F.silu(h1) * h3
    dv = -eta[..., None] * v                                                            # dL/df
    da = dv @ W2                                                                        # (..., n, h)
    sig = torch.sigmoid(h1)
    dh1 = da * h3 * sig * (1 + h1 * (1 - sig))                                          # silu'(x) = s (1 + x (1 - s))
    dh3 = da * F.silu(h1)
    return dh1.transpose(-1, -2) @ k, dv.transpose(-1, -2) @ a, dh3.transpose(-1, -2) @ k


class LaCT(nn.Module):
    """LaCT, large-chunk test-time training (Zhang et al., ICLR 2026), simplest form: per head a SwiGLU fast weight
    f(x) = W2 (silu(W1 x) * W3 x) takes one gradient step on L = -sum_t eta_t <f(k_t), v_t> per chunk, applied to a
    chunk's queries before that chunk's update (apply, then update); a sliding-window attention layer with RoPE beside
    it handles order inside chunks. Here a chunk is the whole context, so the context is written in one large update."""

    def __init__(self, config, chunk, window=16):
        super().__init__()
        d, self.nh = config.n_embd, config.n_head
        self.hs, self.chunk, self.window = d // self.nh, chunk, window
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.lr = nn.Linear(d, self.nh)
        self.W = nn.ParameterList([nn.Parameter(torch.randn(self.nh, self.hs, self.hs) / self.hs ** 0.5) for _ in range(3)])
        self.o = nn.Linear(d, d, bias=False)
        self.swa = CausalSelfAttention(config)
        self.register_buffer("rope_inv_freq", rope_inv_freq(config), persistent=False)

    def state_floats(self):
        return sum(w.numel() for w in self.W)

    def forward(self, x):
        B, T, C = x.shape
        local = self.swa(x, rope_tables(self.rope_inv_freq, torch.arange(T, device=x.device), x.dtype), "sdpa",
                         window=self.window)
        q, k, v = (t.view(B, T, self.nh, self.hs).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        eta = F.softplus(self.lr(x)).transpose(1, 2)                                     # (B, nh, T)
        W, outs = [w.expand(B, -1, -1, -1) for w in self.W], []
        for t0 in range(0, T, self.chunk):
            sl = slice(t0, t0 + self.chunk)
            outs.append((F.silu(q[:, :, sl] @ W[0].transpose(-1, -2)) * (q[:, :, sl] @ W[2].transpose(-1, -2)))
                        @ W[1].transpose(-1, -2))                                       # apply: f(q) with W so far
            W = [w - g for w, g in zip(W, lact_grads(*W, k[:, :, sl], v[:, :, sl], eta[:, :, sl]))]   # then update
        return local + self.o(torch.cat(outs, dim=2).transpose(1, 2).reshape(B, T, C))


class SequenceLM(nn.Module):
    """A language model whose token mixer is a recurrent layer (Mamba-2, TTT-Linear), of the GPT's width and depth,
    reading [C; Q; Y]: Table 1's per-layer-state baselines. With mlp=True each block also has the GPT's MLP."""

    def __init__(self, config, make_mixer, mlp=False):
        super().__init__()
        self.config = config
        d = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, d)
        self.mixers = nn.ModuleList([make_mixer() for _ in range(config.n_layer)])
        self.norms = nn.ModuleList([RMSNorm(d, 1e-5) for _ in range(config.n_layer)])
        self.mlps = nn.ModuleList([MLP(config) for _ in range(config.n_layer)]) if mlp else None
        self.mlp_norms = nn.ModuleList([RMSNorm(d, 1e-5) for _ in range(config.n_layer)]) if mlp else None
        self.ln_f = RMSNorm(d, 1e-5)
        nn.init.normal_(self.wte.weight, std=0.02)

    def memory_floats(self, ctx_len):
        return sum(mix.state_floats() for mix in self.mixers)

    def states(self, x):
        for i, mix in enumerate(self.mixers):
            x = x + mix(self.norms[i](x))
            if self.mlps is not None:
                x = x + self.mlps[i](self.mlp_norms[i](x))
        return self.ln_f(x)

    def forward(self, ctx, q, y, K=None):
        return outputs(*self.read(ctx, q, y))

    def memorize(self, ctx, K=None):
        return ctx, {}                                       # the state is built while reading [C; Q; Y]

    def read(self, ctx, q, y):                               # tied output head
        return read_packed(self.states, lambda ids: self.wte(ids.clamp(min=0)), lambda h: h @ self.wte.weight.T, ctx, q, y)


def Mamba(config):
    return SequenceLM(config, lambda: Mamba2Block(config.n_embd))


def TTTLinearLM(config):
    return SequenceLM(config, lambda: TTTLinear(config), mlp=True)


def LaCTLM(config, chunk):
    return SequenceLM(config, lambda: LaCT(config, chunk), mlp=True)
