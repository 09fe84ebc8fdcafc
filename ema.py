"""
Weight averaging for train.py --ema: an exponential moving average of the trained weights (Polyak averaging).

At a constant lr the weights wander around a minimum with the noise of their batch gradient; their average sits
nearer that minimum, which is what a decayed lr buys, without stopping the climb. train.py evaluates the averaged
weights beside the trained ones at every evaluation and keeps whichever scores higher in best.pt.

    avg <- d * avg + (1 - d) * theta,    d = min(decay, (1 + n) / (10 + n))

n counts the updates since the last reset (TensorFlow's ExponentialMovingAverage warm-up), so a fresh average follows
the weights closely and settles to a horizon of 1 / (1 - decay) steps. An average taken across a loss spike can be far
worse than both of its ends, so train.py restarts it from the trained weights when its held-out EM falls RESET_GAP
below theirs.
"""
from contextlib import contextmanager

import torch

RESET_GAP = 0.05  # train.py restarts the average when its held-out EM is this far below the trained weights'


class WeightEMA:
    def __init__(self, model, decay):
        self.decay = decay
        self.reset(model)

    def reset(self, model, warmup=True):
        """The average set to the trained weights; warmup=False keeps the decay where it is."""
        self.avg = {k: p.detach().clone() for k, p in model.named_parameters()}
        self.n = 0 if warmup else self.n

    @torch.no_grad()
    def update(self, model):
        self.n += 1
        d = min(self.decay, (1 + self.n) / (10 + self.n))
        for k, p in model.named_parameters():
            self.avg[k].lerp_(p, 1 - d)                       # avg <- d avg + (1 - d) p

    @contextmanager
    def swapped(self, model):
        """The model with the averaged weights in place (the same tensors, so a compiled step is not retraced)."""
        params = dict(model.named_parameters())
        kept = {k: p.detach().clone() for k, p in params.items()}
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(self.avg[k])
        try:
            yield model
        finally:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(kept[k])

    def state_dict(self):
        return {"n": self.n, "avg": self.avg}

    def load_state_dict(self, state):
        """Copied into this model's tensors (a checkpoint is loaded on the CPU, a run may resume on a GPU).
        Raises ValueError when the saved average does not fit the model."""
        if state["avg"].keys() != self.avg.keys() or any(v.shape != self.avg[k].shape for k, v in state["avg"].items()):
            raise ValueError("its --ema average does not fit this run's model")
        with torch.no_grad():
            for k, v in state["avg"].items():
                self.avg[k].copy_(v)
        self.n = int(state["n"])
