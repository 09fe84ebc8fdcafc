"""
Causal attention with a hand-derived double backward, for GradMem's second-order meta-gradient
("GradMem: Learning to Write Context into Memory with Test-Time Gradient Descent", arXiv:2603.13875v2,
§4 and Appendix C). Fused SDPA/FlashAttention have no double backward, and autograd's generic graph through
explicit softmax attention keeps several (B, nh, T, T) tensors per layer and per WRITE step. Here nothing of
size T x T is saved: each pass recomputes P block by block from the saved row log-sum-exp, and causal blocks
above the diagonal are skipped.

Per (batch, head), with Q, K, V, O of shape (T, hs), s = 1/sqrt(hs) and a causal (plus key-padding) mask:

  forward           S = s Q K^T (masked: -inf),  L = logsumexp_rows(S),  P = exp(S - L),  O = P V
  first backward    given dO (the VJP of O):
                    dV = P^T dO,   dP = dO V^T,   D = rowsum(dO * O)  (= rowsum(P * dP)),
                    dS = P * (dP - D),   dQ = s dS K,   dK = s dS^T Q
  second backward   the first backward is a function (Q, K, V, dO) -> (dQ, dK, dV); given cotangents
                    (gQ, gK, gV) of its outputs, Phi = <gQ, dQ> + <gK, dK> + <gV, dV> = <dS, A> + <P, dO gV^T> with
                    A   = s (gQ K^T + Q gK^T)                    (T, T)
                    r   = rowsum(P * A),   G = P * (A - r)       d<dS, A>/d(dP)  (D depends on dP too)
                    W   = (dP - D) * A - r * dP + dO gV^T        dPhi/dP
                    dS2 = P * (W - rowsum(P * W))                 through the softmax
                    dPhi/dQ  = s (dS gK + dS2 K)
                    dPhi/dK  = s (dS^T gQ + dS2^T Q)
                    dPhi/dV  = G^T dO
                    dPhi/ddO = P gV + G V
Masked entries have P = 0, so every term that carries a factor P vanishes there. O and L enter the first
backward only as cached functions of (Q, K, V): their dependence is inside the formulas above, so they get no
gradient of their own. Under bf16 autocast (`--dtype bfloat16`) the kernels take fp32 copies of Q, K, V and run
with autocast off (softmax and the in-place block accumulations in one dtype); the output is cast back.

`python attention_hvp.py` benchmarks forward + backward(create_graph) + second backward against the
explicit-math attention at T = 128 ... 2048 (B = 8, nh = 4, hs = 32), time and peak memory side by side.
"""
import math

import torch

BLOCK = 128   # query rows per block on the CPU, where it was the fastest of 128 ... 1024 rows (README)
CUDA_BLOCK_FLOATS = 2 ** 25   # on CUDA, as many rows as keep each (B*nh, rows, T) transient within this (128 MB)
BLOCK_FIXED = None            # an int forces the rows per block (tests, `--block`)


def block_rows(N, T, cuda):
    """Query rows per block for N = B*nh sequences of length T. CUDA gets larger blocks: each block launches the
    same ~10 kernels, which at these sizes cost more than their arithmetic (README, "On a GPU")."""
    return BLOCK_FIXED or (max(BLOCK, CUDA_BLOCK_FLOATS // (N * T)) if cuda else BLOCK)


def _blocks(x):
    """Near-equal row blocks of x (B*nh, T, hs): T = 257 with 128 rows per block gives 85, 86, 86, not 128, 128, 1."""
    N, T = x.shape[:2]
    n = -(-T // block_rows(N, T, x.is_cuda))
    edges = [T * i // n for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _mask_bias(i0, i1, key_mask, nh, like):
    """Additive mask for query rows [i0, i1) and keys [0, i1): 0 where visible (causal, key padding), else -inf."""
    rows = torch.arange(i0, i1, device=like.device)[:, None]
    allowed = (torch.arange(i1, device=like.device)[None, :] <= rows)[None]               # (1, R, i1)
    if key_mask is not None:
        allowed = allowed & key_mask.repeat_interleave(nh, 0)[:, None, :i1]             # (B*nh, R, i1)
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(~allowed, float("-inf"))


def _probs(q, k, lse, i0, i1, bias, scale):
    """P = exp(s Q K^T + bias - L) for query rows [i0, i1) and keys [0, i1), from the saved log-sum-exp L."""
    s = torch.baddbmm(bias, q[:, i0:i1], k[:, :i1].transpose(1, 2), alpha=scale)
    return s.sub_(lse[:, i0:i1]).exp_()


def _no_autocast(x):
    """Autocast off inside the hand-written kernels: their in-place accumulations need one dtype throughout."""
    return torch.autocast(x.device.type, enabled=False)


class _AttentionBackward(torch.autograd.Function):
    """(Q, K, V, O, L, dO) -> (dQ, dK, dV), with its own hand-written backward (the second-order terms).
    All tensors are (B*nh, T, hs); L is (B*nh, T, 1)."""

    @staticmethod
    def forward(ctx, q, k, v, o, lse, do, key_mask, nh):
        scale = 1.0 / math.sqrt(q.size(-1))
        neg_D = -(do * o).sum(-1, keepdim=True)                                   # -D = -rowsum(dO * O)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i0, i1 in _blocks(q):
            p = _probs(q, k, lse, i0, i1, _mask_bias(i0, i1, key_mask, nh, q), scale)   # (N, R, i1)
            dv[:, :i1].baddbmm_(p.transpose(1, 2), do[:, i0:i1])                  # dV = P^T dO
            ds = torch.baddbmm(neg_D[:, i0:i1], do[:, i0:i1], v[:, :i1].transpose(1, 2)).mul_(p)   # dS = P * (dP - D)
            dq[:, i0:i1] = scale * (ds @ k[:, :i1])                               # dQ = s dS K
            dk[:, :i1].baddbmm_(ds.transpose(1, 2), q[:, i0:i1], alpha=scale)     # dK = s dS^T Q
        ctx.save_for_backward(q, k, v, o, lse, do)
        ctx.key_mask, ctx.nh = key_mask, nh
        return dq, dk, dv

    @staticmethod
    def backward(ctx, gq, gk, gv):
        with _no_autocast(gq if gq is not None else ctx.saved_tensors[0]):
            return _AttentionBackward._backward(ctx, gq, gk, gv)

    @staticmethod
    def _backward(ctx, gq, gk, gv):
        q, k, v, o, lse, do = ctx.saved_tensors
        gq, gk, gv = (torch.zeros_like(q) if g is None else g for g in (gq, gk, gv))
        scale = 1.0 / math.sqrt(q.size(-1))
        neg_D = -(do * o).sum(-1, keepdim=True)
        sq, sgq = scale * q, scale * gq
        d_q, d_k, d_v, d_do = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.empty_like(do)
        for i0, i1 in _blocks(q):
            R, J = slice(i0, i1), slice(0, i1)
            p = _probs(q, k, lse, i0, i1, _mask_bias(i0, i1, ctx.key_mask, ctx.nh, q), scale)
            dp_c = torch.baddbmm(neg_D[:, R], do[:, R], v[:, J].transpose(1, 2))   # dP - D
            ds = p * dp_c                                                          # dS
            a = torch.baddbmm(sgq[:, R] @ k[:, J].transpose(1, 2), sq[:, R], gk[:, J].transpose(1, 2))  # A = s(gQ K^T + Q gK^T)
            r = (sgq[:, R] * (p @ k[:, J]) + sq[:, R] * (p @ gk[:, J])).sum(-1, keepdim=True)  # r = rowsum(P * A)
            a.sub_(r)                                                              # A - r
            g = p * a                                                              # G = P * (A - r)
            # W = (dP - D) A - r dP + dO gV^T; its row-constant part -r D cancels in dS2, leaving (dP - D)(A - r) + dO gV^T
            w = dp_c.mul_(a).baddbmm_(do[:, R], gv[:, J].transpose(1, 2))
            ds2 = p * w
            ds2.addcmul_(p, ds2.sum(-1, keepdim=True), value=-1.0)                 # dS2 = P * (W - rowsum(P * W))
            d_q[:, R] = scale * (ds @ gk[:, J] + ds2 @ k[:, J])                    # s (dS gK + dS2 K)
            d_k[:, J].baddbmm_(ds.transpose(1, 2), sgq[:, R]).baddbmm_(ds2.transpose(1, 2), sq[:, R])  # s (dS^T gQ + dS2^T Q)
            d_v[:, J].baddbmm_(g.transpose(1, 2), do[:, R])                        # G^T dO
            d_do[:, R] = (p @ gv[:, J]).baddbmm_(g, v[:, J])                       # P gV + G V
        return d_q, d_k, d_v, None, None, d_do, None, None


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_mask, nh):
        scale = 1.0 / math.sqrt(q.size(-1))
        o, lse = torch.empty_like(q), torch.empty(q.shape[:-1] + (1,), dtype=q.dtype, device=q.device)
        for i0, i1 in _blocks(q):
            s = torch.baddbmm(_mask_bias(i0, i1, key_mask, nh, q), q[:, i0:i1], k[:, :i1].transpose(1, 2), alpha=scale)
            l = torch.logsumexp(s, dim=-1, keepdim=True)
            l = torch.where(torch.isinf(l), torch.zeros_like(l), l)   # a row with no visible key: P = 0, O = 0
            lse[:, i0:i1] = l
            o[:, i0:i1] = s.sub_(l).exp_() @ v[:, :i1]                 # O = P V, P = exp(S - L)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.key_mask, ctx.nh = key_mask, nh
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        # a Function call, so that with create_graph=True the first backward is itself differentiable
        with _no_autocast(do):
            dq, dk, dv = _AttentionBackward.apply(q, k, v, o.detach(), lse.detach(), do.contiguous(), ctx.key_mask, ctx.nh)
        return dq, dk, dv, None, None


def attention(q, k, v, key_mask=None):
    """Causal softmax attention, twice differentiable without a T x T autograd graph.
    q, k, v: (B, nh, T, hs). key_mask: optional (B, T) bool, True for keys that may be attended to."""
    B, nh, T, hs = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)       # bf16 autocast: the kernels run in fp32, output cast back
    flat = lambda x: x.reshape(B * nh, T, hs).to(dt)
    with _no_autocast(q):
        o = _Attention.apply(flat(q), flat(k), flat(v), key_mask, nh)
    return o.to(q.dtype).view(B, nh, T, hs)


def attention_reference(q, k, v, key_mask=None):
    """Explicit-math attention (autograd differentiates it twice through softmax): the baseline."""
    T = q.size(-2)
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    s = ((q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))).masked_fill(~allowed, float("-inf"))
    return s.softmax(-1).nan_to_num(0.0) @ v


def _bench(fn, T, device, B=8, nh=4, hs=32, reps=3):
    """Median time and peak memory of forward + backward(create_graph) + second backward."""
    import resource, statistics, time
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, nh, T, hs, generator=g).to(device).requires_grad_() for _ in range(3))
    w = torch.randn(B, nh, T, hs, generator=g).to(device)
    times = []
    for i in range(reps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device == "cuda" else 0
        t = time.perf_counter()
        o = fn(q, k, v)
        dq, dk, dv = torch.autograd.grad((o * w).sum(), (q, k, v), create_graph=True)
        ((dq ** 2).sum() + (dk * dv).sum()).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        q.grad = k.grad = v.grad = None
        del o, dq, dk, dv
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else None
    return statistics.median(times[1:]), peak


def _cpu_peak_mb(fn, T):
    """Peak resident-memory growth of one benchmark, in a fresh process (CPU has no allocator statistics).
    Reads VmHWM, which a new program starts afresh (ru_maxrss would inherit the parent's peak)."""
    import os, subprocess, sys
    code = (f"import attention_hvp as a\n"
            f"hwm = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\n"
            f"a.BLOCK_FIXED = {BLOCK_FIXED}\nh0 = hwm(); a._bench(a.{fn}, {T}, 'cpu', reps=1); print((hwm() - h0) / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    return float(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="explicit-math vs hand-derived attention: time and peak memory")
    p.add_argument("--block", type=int, default=None,
                   help=f"query rows per block (default: {BLOCK} on CPU; on CUDA within {CUDA_BLOCK_FLOATS} floats)")
    p.add_argument("--T", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    args = p.parse_args()
    if (args.block is not None and args.block < 1) or min(args.T) < 1:
        p.error(f"--block and --T must be >= 1, got {args.block}, {args.T}")
    BLOCK_FIXED = args.block
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"forward + backward(create_graph) + second backward, B=8 nh=4 hs=32, block {BLOCK_FIXED or 'default'} rows, {device}, "
          f"{torch.get_num_threads()} threads; median of 3; peak = {'CUDA max allocated' if device == 'cuda' else 'RSS growth, fresh process'}")
    print(f"{'T':>5} {'explicit s':>10} {'hvp s':>8} {'speedup':>7} {'explicit MB':>11} {'hvp MB':>8} {'mem ratio':>9}")
    for T in args.T:
        te, me = _bench(attention_reference, T, device)
        th, mh = _bench(attention, T, device)
        if device == "cpu":
            me, mh = _cpu_peak_mb("attention_reference", T), _cpu_peak_mb("attention", T)
        print(f"{T:>5} {te:>10.3f} {th:>8.3f} {te / th:>6.2f}x {me:>11.0f} {mh:>8.0f} {me / max(mh, 1e-9):>8.2f}x", flush=True)
