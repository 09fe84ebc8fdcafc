"""Is a longer weight average than --ema 0.999 a lever on the 8-pair plateau? (README, session 36)

Runs train.py unchanged and, beside its own --ema average, keeps more exponential averages of the same trained
weights with longer horizons (decays in DECAYS), restarted whenever train.py restarts its own (each curriculum
stage, EMA_RESET after a loss spike). train.py's warm-up min(decay, (1 + n) / (10 + n)) holds the horizon near n / 9
steps, so a longer decay would change nothing before ~9,000 steps at 0.999 and ~45,000 at 0.9998; these use
min(decay, n / (1 + n)), a uniform average of the n steps since the restart until n reaches the horizon
1 / (1 - decay), an exponential one after. They only watch: the run,
its evaluations, best.pt and the curriculum are those of the plain command. Every SNAP_EVERY steps it writes the
averages, and every TRAINED_EVERY steps the trained weights, under OUT_DIR_probe/; `make` turns one of them into a
checkpoint eval.py reads with --weights ema.

    python results/compile_train/ema_probe.py run --task kv --pairs 8 --K 1 --compile --out_dir out/kv8_s36
    python results/compile_train/ema_probe.py make out/kv8_s36 STEP DECAY OUT.pt     # DECAY: 0.999, 0.9995, 0.9998
    python results/compile_train/ema_probe.py make out/kv8_s36 last DECAY OUT.pt     # the averages in ckpt.pt
    python results/compile_train/ema_probe.py make out/kv8_s36 FIRST:LAST swa OUT.pt # uniform average of the trained
                                                                                     # snapshots FIRST..LAST
    python eval.py OUT.pt --weights ema --eval_seed 777 --n_eval 5000 --out ...

Not used by train.py. The extra averages are also kept in ckpt.pt's "ema" entry ("extra"), so --resume continues them.
"""
import glob
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import train  # noqa: E402

DECAYS = (0.9995, 0.9998)
SNAP_EVERY, TRAINED_EVERY = 2500, 250


class ProbeEMA(train.WeightEMA):
    probe_dir = None

    def reset(self, gm, warmup=True):
        super().reset(gm, warmup)
        self.extra = {d: {k: v.clone() for k, v in self.avg.items()} for d in DECAYS}
        self.steps = getattr(self, "steps", 0)

    @torch.no_grad()
    def update(self, gm):
        super().update(gm)                                 # train.py's own average, and self.n += 1
        params = dict(gm.named_parameters())
        for d, avg in self.extra.items():
            w = 1 - min(d, self.n / (1 + self.n))
            for k, p in params.items():
                avg[k].lerp_(p, w)
        self.steps += 1
        if self.steps % TRAINED_EVERY == 0:
            save(os.path.join(self.probe_dir, f"trained_{self.steps}.pt"),
                 {"step": self.steps, "avg": {k: p.detach().clone() for k, p in params.items()}})
        if self.steps % SNAP_EVERY == 0:
            save(os.path.join(self.probe_dir, f"avgs_{self.steps}.pt"),
                 {"step": self.steps, "n": self.n, "avgs": {str(self.decay): self.avg, **{str(d): a for d, a in self.extra.items()}}})

    def state_dict(self):
        return {**super().state_dict(), "extra": {str(d): a for d, a in self.extra.items()}, "steps": self.steps}

    def load_state_dict(self, state, path):
        super().load_state_dict(state, path)
        self.steps = int(state.get("steps", 0))
        for d in DECAYS:
            if str(d) in state.get("extra", {}):
                for k, v in state["extra"][str(d)].items():
                    self.extra[d][k].copy_(v)


def save(path, obj):
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def make(out_dir, which, decay, out):
    """ckpt.pt of the run with its "ema" entry replaced by the chosen average (eval.py --weights ema reads it)."""
    probe = out_dir.rstrip("/") + "_probe"
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"), weights_only=True)
    if decay == "swa":
        first, last = map(int, which.split(":"))
        snaps = sorted((int(re.search(r"trained_(\d+)\.pt$", p).group(1)), p)
                       for p in glob.glob(os.path.join(probe, "trained_*.pt")))
        snaps = [p for s, p in snaps if first <= s <= last]
        if not snaps:
            sys.exit(f"no trained_<N>.pt in {probe} with {first} <= N <= {last}")
        total = None
        for p in snaps:
            w = {k: v.double() for k, v in torch.load(p, weights_only=True)["avg"].items()}
            total = w if total is None else {k: total[k] + w[k] for k in total}
        avg, step = {k: (v / len(snaps)).float() for k, v in total.items()}, last
    elif which == "last":                              # the averages ckpt.pt holds (its last evaluation)
        own = {str(ckpt["config"]["train"]["ema"]): ckpt["ema"]["avg"]}
        avgs = {**ckpt["ema"].get("extra", {}), **own}
        if decay not in avgs:
            sys.exit(f"{out_dir}/ckpt.pt holds decays {sorted(avgs)}, not {decay}")
        avg, step = avgs[decay], ckpt["step"]
    else:
        snap = torch.load(os.path.join(probe, f"avgs_{which}.pt"), weights_only=True)
        if decay not in snap["avgs"]:
            sys.exit(f"avgs_{which}.pt holds decays {sorted(snap['avgs'])}, not {decay}")
        avg, step = snap["avgs"][decay], snap["step"]
    ckpt["ema"] = {"n": 0, "avg": avg}
    ckpt["step"] = step
    ckpt.pop("optimizer", None)
    save(out, ckpt)
    print(f"{decay} average at step(s) {which} -> {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["make"] and len(sys.argv) == 6:
        make(*sys.argv[2:])
    elif sys.argv[1:2] == ["run"]:
        argv = sys.argv[2:]
        out_dir = argv[argv.index("--out_dir") + 1]
        ProbeEMA.probe_dir = out_dir.rstrip("/") + "_probe"
        os.makedirs(ProbeEMA.probe_dir, exist_ok=True)
        train.WeightEMA = ProbeEMA
        train.main(argv)
    else:
        sys.exit(__doc__)
