"""
train.py on several processes: `torchrun --nproc_per_node N train.py ...` (gloo on the CPU, nccl on GPUs).

Every rank builds the step's global batch (a pure function of (seed, step), data.py) and trains its contiguous
slice; after the step's micro-batches, one all-reduce replaces every gradient (and logged scalar) by its mean over
the ranks, so N processes take the same optimizer step as one process on the whole batch. Rank 0 alone evaluates,
logs and writes checkpoints (which hold the plain model, so any world size resumes them); the other ranks follow its
decisions (curriculum stage, stop) by broadcast. Not DistributedDataParallel: WRITE differentiates with
torch.autograd.grad (Eq. 5, second order), which DDP does not support, and --grad_accum would need no_sync.
"""
import os
from contextlib import contextmanager, nullcontext, redirect_stdout
from dataclasses import dataclass

import torch
import torch.distributed as dist


class DistributedError(Exception):
    """Flags or an environment that cannot run on several processes: train.py prints it as one line."""


@dataclass
class Ranks:
    """This process among torchrun's: rank 0 evaluates, prints and writes every file. device: where the collectives'
    tensors live (the GPU under nccl)."""
    rank: int = 0
    world: int = 1
    device: str = "cpu"


RANKS = Ranks()  # one process unless distributed() joins a process group


@contextmanager
def distributed(tcfg, device):
    """Under torchrun (WORLD_SIZE > 1): refuse flags that do not split over the ranks, join the process group from
    torchrun's environment (nccl on CUDA, gloo on the CPU) and send the stdout of ranks other than 0 to /dev/null
    (errors still reach stderr from every rank). A plain `python train.py`: nothing. Bad input: DistributedError."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        yield
        return
    if tcfg.batch_size % (world * max(tcfg.grad_accum, 1)):
        raise DistributedError(f"--batch_size {tcfg.batch_size} is the global batch: it must split into {world} processes x "
                       f"--grad_accum {max(tcfg.grad_accum, 1)} equal parts")
    for flag in ("cuda_graph", "write_split"):
        if getattr(tcfg, flag):
            raise DistributedError(f"--{flag} runs in one process only: start it with python train.py, not torchrun")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    except (ValueError, RuntimeError) as e:
        raise DistributedError(f"WORLD_SIZE={world} but cannot join the process group (start with torchrun): {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    RANKS.rank, RANKS.world, RANKS.device = dist.get_rank(), world, device
    quiet = open(os.devnull, "w") if RANKS.rank else None        # rank 0 alone prints
    try:
        with redirect_stdout(quiet) if quiet else nullcontext():
            yield
    finally:
        RANKS.rank, RANKS.world, RANKS.device = 0, 1, "cpu"
        dist.destroy_process_group()
        if quiet:
            quiet.close()


def rank_slice(batch):
    """This rank's contiguous part of the step's global batch (all of it in one process)."""
    n = batch["ctx"].size(0) // RANKS.world
    return {k: v[RANKS.rank * n:(RANKS.rank + 1) * n] for k, v in batch.items()}


def average_over_ranks(gm, logs):
    """Each gradient and logged scalar replaced by its mean over the ranks, in one all-reduce. The ranks trained
    equal slices of the batch, so the mean is the whole batch's gradient and every rank takes the same step.
    Not DistributedDataParallel: its hooks would reduce once per micro-batch, and GraphedStep's autograd.grad
    bypasses them; here one reduction per step covers every path (eager, --compile, --grad_accum)."""
    if RANKS.world == 1:
        return
    grads = [p.grad for p in gm.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads] + [grads[0].new_tensor(list(logs.values()))])
    dist.all_reduce(flat)
    flat /= RANKS.world
    *means, log_means = flat.split([g.numel() for g in grads] + [len(logs)])
    for g, v in zip(grads, means):
        g.copy_(v.view_as(g))
    logs.update(zip(logs, log_means.tolist()))


def same_weights_on_every_rank(gm):
    """Rank 0's weights on every rank (they start equal from --seed or a checkpoint; this makes sure)."""
    if RANKS.world > 1:
        for t in gm.state_dict().values():
            dist.broadcast(t, 0)


def rank0_decides(*flags):
    """Rank 0's decisions after an evaluation, as booleans, on every rank."""
    if RANKS.world == 1:
        return tuple(map(bool, flags))
    t = torch.tensor([bool(f) for f in flags], device=RANKS.device)
    dist.broadcast(t, 0)
    return tuple(bool(v) for v in t.tolist())


def stop_signal(stop):
    """The signal (SIGINT, SIGTERM) that ends the run after this step, caught by this rank or by any other; None while
    there is none. Every rank gets the same answer: only the reduced value counts, so a signal that arrives during the
    all-reduce stops the run a step later on every rank."""
    if RANKS.world == 1:
        return stop.signum
    t = torch.tensor([stop.signum or 0], device=RANKS.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t) or None


def wait_for_rank0():
    """Every rank waits here until rank 0 arrives (after it wrote a checkpoint)."""
    if RANKS.world > 1:
        dist.barrier()
