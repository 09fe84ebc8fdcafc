"""
Time the authors' own GradMem training step (github.com/yurakuratov/gradmem) at the Table 1 step config (16 pairs,
batch 32, fp32) on this machine, so this repo's step can be compared with it side by side
(tools/authors_side_by_side.sh runs both; results in results/bench/authors_side_by_side_*.jsonl).

Nothing of the authors' code is in this repo: clone theirs (we read commit 004aca68 of grad_memgpt.py; see the
README for the other files' commits and the one patch) and install transformers 4.53 (their pin) beside torch:

    python tools/bench_authors.py --repo /path/to/gradmem --K 5 --steps 5

The model is their GradMemGPT over a Llama backbone built from config (4 layers, width 128, 4 heads, MLP 512,
RoPE 5e5 with Llama-3 scaling, tied embeddings: their KV run script's overrides of the Llama-3.2-1B config), with
their KV defaults (configs/gradmemgpt/kv_retrieval/default.yaml: 8 memory tokens, WRITE head, SGD inner step,
second order, inner loss added to the outer loss with weight 0.5) and every one of the K steps second order.
A batch is our data.py's KV samples spelled as text and tokenized by their character tokenizer, padded to a
multiple of 8 as their collator does (context 113 -> 120 tokens, query+target 9 -> 16), labels on the target's
4 tokens only. One step = forward (K WRITE steps and READ), backward, grad-norm clip 1.0, AdamW (lr 1e-4).
Prints one JSON line: median s/step after --warmup steps, and the process's peak RSS.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from data import decode, sample_kv  # noqa: E402


def pad_to(rows, multiple, pad_id):
    n = -(-max(len(r) for r in rows) // multiple) * multiple
    return torch.tensor([r + [pad_id] * (n - len(r)) for r in rows])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", required=True, help="a checkout of github.com/yurakuratov/gradmem")
    p.add_argument("--K", type=int, default=5)
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--attn", default="eager", help="their attn_implementation (KV default: eager)")
    args = p.parse_args()
    if not os.path.isfile(os.path.join(args.repo, "grad_memgpt.py")):
        sys.exit(f"bench_authors.py: error: no grad_memgpt.py in --repo {args.repo}")
    sys.path.insert(0, args.repo)
    from transformers import AutoTokenizer, LlamaConfig
    from grad_memgpt import GradMemGPT, GradMemGPTConfig

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(os.path.join(args.repo, "tokenizers", "kv_alphabet_62"))
    base = LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                       head_dim=32, intermediate_size=512, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=5e5,
                       rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192),
                       tie_word_embeddings=True, attention_bias=False, mlp_bias=False, use_cache=False,
                       max_position_embeddings=131072,
                       vocab_size=tok.vocab_size, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)
    model = GradMemGPT(GradMemGPTConfig(
        base_config=base, n_mem_tokens=8, K=args.K, last_K_second_order=args.K, lr=0.04, use_adam=False,
        grad_mode="second", use_write_head=True, attn_implementation=args.attn,
        add_inner_loss_to_outer=True, inner_loss_weight=0.5))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

    rng = np.random.default_rng(0)
    enc = lambda strings: [tok(s, add_special_tokens=True).input_ids for s in strings]
    batches = []
    for _ in range(args.warmup + args.steps):
        ctx, q, y = sample_kv(rng, args.batch_size, args.pairs)
        c = enc([decode(r) for r in ctx])
        qy = enc([decode(a) + decode(b) for a, b in zip(q, y)])
        qids = pad_to(qy, 8, tok.pad_token_id)
        labels = torch.full_like(qids, -100)
        for i, r in enumerate(qy):                         # the target (y: 4 characters) ends each row
            labels[i, len(r) - y.shape[1]:len(r)] = qids[i, len(r) - y.shape[1]:len(r)]
        batches.append(dict(input_ids=dict(context_input_ids=pad_to(c, 8, tok.pad_token_id),
                                           query_input_ids=qids), labels=labels))

    times = []
    for i, b in enumerate(batches):
        t = time.perf_counter()
        model.zero_grad()
        loss = model(**b)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
        if not torch.isfinite(loss):
            sys.exit(f"bench_authors.py: error: non-finite loss at step {i}")
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    print(json.dumps(dict(impl="authors", K=args.K, pairs=args.pairs, batch_size=args.batch_size,
                          threads=torch.get_num_threads(), median_s_per_step=statistics.median(times),
                          step_times_s=[round(x, 3) for x in times],
                          peak_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20,
                          context_tokens=batches[0]["input_ids"]["context_input_ids"].size(1),
                          query_tokens=batches[0]["input_ids"]["query_input_ids"].size(1),
                          loss=loss.item(), params_without_grad=no_grad)))


if __name__ == "__main__":
    main()
