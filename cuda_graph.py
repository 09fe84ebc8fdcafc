"""
train.py --cuda_graph: one micro-batch's whole training pass -- the K WRITE steps (Eq. 5) with their create_graph
backward, READ (Eq. 8) and the meta-gradient of the outer loss -- recorded once as a CUDA graph on static input
buffers, then replayed for every micro-batch (the KV task's shapes never change within a curriculum stage).

The graph's outputs are the loss terms and one gradient per parameter; they are added into .grad outside the graph,
so gradient accumulation and the eager optimizer step are unchanged. On capture the replay is checked against an
eager pass on the same batch. capture=False runs the same static-buffer pass eagerly (the CPU test of the plumbing).
"""
import torch


class GraphError(RuntimeError):
    """Capture failed, or the replay does not reproduce the eager pass."""


class GraphedStep:
    def __init__(self, model, batch, scale, autocast, capture=True, tol=1e-3):
        self.model, self.scale, self.autocast, self.graph = model, scale, autocast, None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inputs = {k: v.clone() for k, v in batch.items()}
        if not capture:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):             # warm-up off the capture stream (cuBLAS handles, lazy caches)
            for _ in range(3):
                self._pass()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph):
                self.out = self._pass()
        except RuntimeError as e:
            raise GraphError(f"--cuda_graph: capture failed ({str(e).splitlines()[0]}); run without --cuda_graph") from None
        ref = [g.clone() for g in self._pass()["grads"]]          # eager, same inputs
        self.graph.replay()
        err = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(self.out["grads"], ref))
        if not err <= tol:
            raise GraphError(f"--cuda_graph: the replayed graph's gradients differ from the eager pass by {err:.2e} "
                             f"(relative, > {tol}); run without --cuda_graph")

    def _pass(self):
        b = self.inputs
        with self.autocast:
            out = self.model(b["ctx"], b["q"], b["y"])
        grads = torch.autograd.grad(out["loss"] * self.scale, self.params, allow_unused=True)
        zero = out["loss"].new_zeros(())
        return dict(loss=out["loss"].detach(), task_loss=out["task_loss"].detach(), logits=out["logits"].detach(),
                    losses=[out["losses"][0].detach()] if out["losses"] else [], grad_norm=out["grad_norm"].detach() + zero,
                    grads=[torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)])

    def __call__(self, batch):
        """Copy the batch into the static buffers, replay, and add the gradients into .grad."""
        for k, v in batch.items():
            if v.shape != self.inputs[k].shape:
                raise GraphError(f"--cuda_graph needs static shapes: {k} {tuple(v.shape)} vs captured "
                                 f"{tuple(self.inputs[k].shape)}")
            self.inputs[k].copy_(v)
        if self.graph is None:
            self.out = self._pass()
        else:
            self.graph.replay()
        for p, g in zip(self.params, self.out["grads"]):
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)
        return self.out
