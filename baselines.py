"""
Baselines that GradMem (arXiv:2603.13875v2) is compared with on KV retrieval (§3.2, Table 1), on the same model.py.

RMT, Recurrent Memory Transformer (Bulatov et al., NeurIPS 2022), two segments as in §3.2. WRITE is forward-only:
    H      = f_theta([M_k; C; M_k])            the memory tokens are read at the start and written at the end
    M_{k+1} = W H[-m:]                          the last m hidden states, through a Linear W initialised to identity
K > 1 re-reads the context K times ("x2 ... x5 memory updates" rows of Table 1). READ is GradMem's: [M_K; Q; Y].

Full-context transformer (the upper bound of Table 1): the same model on [C; Q; Y]; its "memory" is the KV cache.

Every class returns the dict GradMem.forward returns (loss, task_loss, logits, mem, losses, nll, grad_norm), so
train.py and eval.py drive them unchanged.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradmem import read_loss


class RMT(nn.Module):
    def __init__(self, model, n_mem, K):
        super().__init__()
        self.model, self.K = model, K
        d = model.config.n_embd
        self.mem0 = nn.Parameter(0.02 * torch.randn(n_mem, d))
        self.write_proj = nn.Linear(d, d)                       # W, initialised to identity (authors' code)
        nn.init.eye_(self.write_proj.weight)
        nn.init.zeros_(self.write_proj.bias)

    def memory_floats(self, ctx_len):
        return self.mem0.numel()

    def write(self, ctx, K):
        """K forward-only memory updates M_{k+1} = W f([M_k; C; M_k])[-m:]."""
        m = self.mem0.size(0)
        mem = self.mem0.expand(ctx.size(0), -1, -1)
        emb = self.model.embed(ctx)
        for _ in range(K):
            h = self.model(torch.cat([mem, emb, mem], dim=1))   # (B, m + T + m, C)
            mem = self.write_proj(h[:, -m:])
        return mem

    def forward(self, ctx, q, y, K=None):
        mem = self.write(ctx, self.K if K is None else K)
        task_loss, logits = read_loss(self.model, mem, q, y)
        return dict(loss=task_loss, task_loss=task_loss, logits=logits, mem=mem, losses=[], nll=[],
                    grad_norm=torch.zeros(()))


class FullContext(nn.Module):
    """The transformer reads [C; Q; Y] directly: nothing is compressed."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def memory_floats(self, ctx_len):
        c = self.model.config
        return c.n_layer * ctx_len * c.n_embd * 2          # the KV cache of the context

    def forward(self, ctx, q, y, K=None):
        L = y.size(1)
        x = self.model.embed(torch.cat([ctx, q, y[:, :-1]], dim=1))
        logits = self.model.lm_head(self.model(x)[:, -L:])
        task_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=0)
        return dict(loss=task_loss, task_loss=task_loss, logits=logits, mem=None, losses=[], nll=[],
                    grad_norm=torch.zeros(()))
