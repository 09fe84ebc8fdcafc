"""
Associative key-value retrieval, the task of GradMem (arXiv:2603.13875v2) §3.1, generated on the fly.

    context C = !k1:v1!!k2:v2!...!kN:vN!|     query Q = ?!k:     target Y = v!|

Keys and values are 2 characters from a-z A-Z 0-9 (62 symbols, so 62^2 = 3844 distinct keys); keys are
unique within a sample, values may repeat, the queried key is uniform among the N pairs. Character
tokenizer of 70 ids: [PAD] [BOS] [EOS] [UNK], the 62 characters, then ! ? : | (no BOS/EOS added).

Every batch is a pure function of (seed, step), so a run is reproducible and resumes exactly without
saving a data cursor. The held-out set comes from its own seed and training never draws one of its
contexts (rejected and redrawn), so train and eval are disjoint by construction (and checked in tests).
A split can be written to JSONL and trained from, for byte-for-byte reproducible data.
"""
import json
import re
import string

import numpy as np
import torch

SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits  # the 62 key/value symbols
VOCAB = SPECIALS + list(CHARS) + list("!?:|")
STOI = {s: i for i, s in enumerate(VOCAB)}
PAD, UNK = 0, 3
BANG, QMARK, COLON, BAR = (STOI[c] for c in "!?:|")
N_KEYS = len(CHARS) ** 2
# token kinds inside a context, for the WRITE loss split of Figure 4b
SEP, KEY, VALUE = 0, 1, 2


def encode(s):
    return [STOI.get(c, UNK) for c in s]


def decode(ids):
    return "".join(VOCAB[i] if i >= len(SPECIALS) else "" for i in ids)


def check_pairs(n_pairs):
    if not 1 <= n_pairs <= N_KEYS:
        raise ValueError(f"--pairs must be in 1..{N_KEYS} (distinct 2-character keys), got {n_pairs}")


def sample_kv(rng, B, n_pairs):
    """B samples as token-id arrays: ctx (B, 7N+1), q (B, 5), y (B, 4)."""
    keys = np.stack([rng.choice(N_KEYS, n_pairs, replace=False) for _ in range(B)])   # unique per sample
    vals = rng.integers(0, N_KEYS, size=(B, n_pairs))                                  # may repeat
    k1, k2, v1, v2 = (a + len(SPECIALS) for a in (keys // 62, keys % 62, vals // 62, vals % 62))
    sep = lambda tok: np.full((B, n_pairs), tok)
    pairs = np.stack([sep(BANG), k1, k2, sep(COLON), v1, v2, sep(BANG)], axis=-1)    # (B, N, 7): !kk:vv!
    ctx = np.concatenate([pairs.reshape(B, -1), np.full((B, 1), BAR)], axis=1)
    which = rng.integers(0, n_pairs, size=B)
    r = np.arange(B)
    q = np.stack([np.full(B, QMARK), np.full(B, BANG), k1[r, which], k2[r, which], np.full(B, COLON)], axis=1)
    y = np.stack([v1[r, which], v2[r, which], np.full(B, BANG), np.full(B, BAR)], axis=1)
    return ctx, q, y


def queried_pair(ctx, q):
    """Index (0..N-1) of the pair whose key the query asks for, from the token ids: ctx (B, 7N+1), q (B, 5)."""
    pairs = ctx[:, :-1].reshape(ctx.shape[0], -1, 7)                       # (B, N, 7): ! k k : v v !
    hit = (pairs[:, :, 1] == q[:, 2:3]) & (pairs[:, :, 2] == q[:, 3:4])
    return hit.int().argmax(1)


def more_queries(ctx, q, n):
    """Every context asked n of its keys (train.py --queries): the sampled query's pair and the n-1 pairs after it,
    cyclically. Returns q (B, n, 5) and y (B, n, 4); row [:, 0] is the sampled query. The sampled pair is uniform,
    so each asked key is uniform too and the mean loss over the n has the one-query loss's expectation (Eq. 8)."""
    B, N = ctx.shape[0], (ctx.shape[1] - 1) // 7
    if not 1 <= n <= N:
        raise ValueError(f"--queries must be in 1..{N} for {N}-pair contexts, got {n}")
    pairs = ctx[:, :-1].reshape(B, N, 7)                                   # ! k k : v v !
    which = (np.asarray(queried_pair(torch.as_tensor(ctx), torch.as_tensor(q)))[:, None] + np.arange(n)) % N
    k1, k2, v1, v2 = (np.take_along_axis(pairs[:, :, i], which, 1) for i in (1, 2, 4, 5))
    full = lambda tok: np.full((B, n), tok)
    return (np.stack([full(QMARK), full(BANG), k1, k2, full(COLON)], axis=-1),
            np.stack([v1, v2, full(BANG), full(BAR)], axis=-1))


def key_overlap(ctx, q):
    """(B,) bool: another pair's key shares a character with the queried key (either character, either place),
    the samples where a write must tell similar keys apart."""
    keys = ctx[:, :-1].reshape(ctx.shape[0], -1, 7)[:, :, 1:3]             # (B, N, 2)
    asked = (keys[:, :, 0] == q[:, 2:3]) & (keys[:, :, 1] == q[:, 3:4])   # the queried pair itself
    share = (keys[:, :, :, None] == q[:, None, None, 2:4]).flatten(2).any(2)
    return (share & ~asked).any(1)


def context_kinds(n_pairs):
    """(7N+1,) array marking each context position SEP, KEY or VALUE."""
    one = [SEP, KEY, KEY, SEP, VALUE, VALUE, SEP]
    return np.array(one * n_pairs + [SEP])


def to_batch(ctx, q, y, device="cpu"):
    """Arrays -> dict of LongTensors; y_mask marks the value characters that EM and accuracy score
    (the trailing ! and | of the target are trained on but not scored)."""
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.long, device=device)
    y = t(y)
    return dict(ctx=t(ctx), q=t(q), y=y, y_mask=(y != BANG) & (y != BAR))


class KVTask:
    """Train batches keyed by (seed, step) and a fixed held-out set keyed by eval_seed.
    Optionally both come from JSONL files written by `save_jsonl`."""

    def __init__(self, n_pairs, seed=0, eval_seed=12345, n_eval=1000, train_file=None, eval_file=None):
        check_pairs(n_pairs)
        self.n_pairs, self.seed = n_pairs, seed
        self.train = load_jsonl(train_file) if train_file else None
        if eval_file:
            self.eval = load_jsonl(eval_file)
        else:
            self.eval = unique_rows(sample_kv(np.random.default_rng([eval_seed, n_pairs]), n_eval, n_pairs))
        for name, split in (("train", self.train), ("eval", self.eval)):
            if split is not None and split[0].shape[1] != 7 * n_pairs + 1:
                raise ValueError(f"{name} file holds {(split[0].shape[1] - 1) // 7}-pair contexts, not --pairs {n_pairs}")
        self.eval_contexts = {row.tobytes() for row in self.eval[0]}
        if self.train is not None:
            overlap = sum(row.tobytes() in self.eval_contexts for row in self.train[0])
            if overlap:
                raise ValueError(f"{overlap} training contexts of {train_file} also occur in the eval set")

    def train_batch(self, step, B, device="cpu", queries=1):
        """Batch `step`; queries > 1 asks each context that many keys (more_queries): q (B, queries, 5), y (B, queries, 4).
        The contexts and the first query are the same whatever `queries` is."""
        rng = np.random.default_rng([self.seed, step])
        if self.train is not None:
            idx = rng.integers(0, len(self.train[0]), size=B)
            ctx, q, y = (a[idx] for a in self.train)
        else:
            ctx, q, y = sample_kv(rng, B, self.n_pairs)
            for i in range(B):  # keep the held-out contexts out of training
                while ctx[i].tobytes() in self.eval_contexts:
                    c, qq, yy = sample_kv(rng, 1, self.n_pairs)
                    ctx[i], q[i], y[i] = c[0], qq[0], yy[0]
        if queries > 1:
            q, y = more_queries(ctx, q, queries)
        return to_batch(ctx, q, y, device=device)

    def eval_batches(self, B, device="cpu"):
        n = len(self.eval[0])
        for i in range(0, n, B):
            yield to_batch(*(a[i:i + B] for a in self.eval), device=device)


def unique_rows(arrays):
    """Drop samples whose context repeats an earlier one (only possible for tiny N)."""
    _, first = np.unique(arrays[0], axis=0, return_index=True)
    keep = np.sort(first)
    return tuple(a[keep] for a in arrays)


def save_jsonl(path, arrays):
    with open(path, "w") as f:
        for c, q, y in zip(*arrays):
            f.write(json.dumps(dict(context=decode(c), query=decode(q), target=decode(y))) + "\n")


PAIR_RE = re.compile(f"!([{CHARS}]{{2}}):([{CHARS}]{{2}})!")


def check_sample(context, query, target):
    """The §3.1 format, checked: context !k1:v1!...!kN:vN!| with unique keys, query ?!k:, target v!| with v the
    value of k in the context. Raises ValueError naming what is off."""
    pairs = PAIR_RE.findall(context[:-1])
    if not context.endswith("|") or "".join(f"!{k}:{v}!" for k, v in pairs) != context[:-1] or not pairs:
        raise ValueError(f"context {context!r} is not !k1:v1!...!kN:vN!| over a-z, A-Z, 0-9")
    table = dict(pairs)
    if len(table) != len(pairs):
        raise ValueError(f"context {context!r} repeats a key")
    if not (len(query) == 5 and query.startswith("?!") and query.endswith(":") and query[2:4] in table):
        raise ValueError(f"query {query!r} is not ?!k: for a key k of the context")
    if target != table[query[2:4]] + "!|":
        raise ValueError(f"target {target!r} is not {table[query[2:4]] + '!|'!r}, the value of {query[2:4]!r} in the context")


def load_jsonl(path):
    """JSONL of {"context", "query", "target"} strings -> (ctx, q, y) arrays; every row the same lengths."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(lines, 1):
        try:
            d = json.loads(line)
            check_sample(d["context"], d["query"], d["target"])
            rows.append((encode(d["context"]), encode(d["query"]), encode(d["target"])))
        except (KeyError, TypeError, AttributeError, ValueError) as e:     # JSONDecodeError is a ValueError
            raise ValueError(f"{path}:{n}: not a KV sample ({e.__class__.__name__}: {e})") from None
    if not rows:
        raise ValueError(f"{path}: no samples")
    try:
        return tuple(np.array(col) for col in zip(*rows))
    except ValueError:
        raise ValueError(f"{path}: samples differ in length (one --pairs per file)") from None
