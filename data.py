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
import os
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


# ---------------------------------------------------------------------------------------------------------------
# Natural-language tasks of Table 2 and App. I, as the same (context C, query Q, target Y) triples. Token ids come
# from a Tokenizer (words for bAbI, a pretrained model's BPE otherwise); a batch is right-padded with TEXT_PAD, which
# is no token id (gradmem.PAD): the models pack each sample's pieces so that a pad never precedes a real token.

TEXT_PAD = -1                 # = gradmem.PAD
TEXT_TASKS = ("babi", "squad", "lm", "compress")
WORD_RE = re.compile(r"[a-z]+|[.?]")


class Words:
    """bAbI's closed vocabulary as one id per lower-case word, "." and "?"; id 0 is the end of an answer ("\\n")."""

    def __init__(self, words):
        self.vocab = ["\n"] + list(words)
        self.ids = {w: i for i, w in enumerate(self.vocab)}
        self.n_vocab, self.eos = len(self.vocab), 0

    def encode(self, text):
        try:
            return [self.ids[w] for w in WORD_RE.findall(text.lower())]
        except KeyError as e:
            raise ValueError(f"the word {e.args[0]!r} of {text!r} is not in the bAbI vocabulary") from None

    def decode(self, ids):
        return " ".join(self.vocab[i] for i in ids if 0 < i < self.n_vocab)


class BPE:
    """A tiktoken Encoding (tokenizer.tokenizer_for) with "\\n" ending an answer."""

    def __init__(self, enc):
        self.enc, self.n_vocab = enc, enc.n_vocab
        nl = enc.encode_ordinary("\n")
        if len(nl) != 1:
            raise ValueError(f"tokenizer {enc.name}: '\\n' is {len(nl)} tokens, not one; it ends answers")
        self.eos = nl[0]

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode([i for i in ids if 0 <= i < self.n_vocab])


def pad_rows(rows, device="cpu"):
    """Lists of ids -> (B, max len) LongTensor right-padded with TEXT_PAD."""
    out = torch.full((len(rows), max(1, max(map(len, rows)))), TEXT_PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out.to(device)


class TextTask:
    """Samples (C, Q, Y) as token-id lists, with the gold answer strings that score them. Train batch `step` draws
    B samples with the generator seeded by (seed, step), so a run resumes exactly. kind: "qa" (bAbI, SQuAD: scored by
    greedy decoding from memory, exact match and F1 against every gold answer), "lm" (WikiText: cross-entropy of Y)
    or "compress" (App. I: token accuracy of Y = C read back from memory)."""

    n_pairs = 1                                         # train.py's curriculum and --queries do not apply

    def __init__(self, kind, tok, train, eval, seed=0, name=""):
        self.kind, self.tok, self.train, self.eval, self.seed, self.name = kind, tok, train, eval, seed, name
        self.vocab_size = tok.n_vocab
        for split, rows in (("train", train), ("eval", eval)):
            if not rows:
                raise ValueError(f"{name}: no {split} samples")

    def batch(self, rows, device):
        y = pad_rows([r[2] for r in rows], device)
        mask = y != TEXT_PAD
        if self.kind == "qa":
            mask &= y != self.tok.eos                     # the end token is trained on, not scored
        return dict(ctx=pad_rows([r[0] for r in rows], device), q=pad_rows([r[1] for r in rows], device), y=y, y_mask=mask)

    def train_batch(self, step, B, device="cpu", queries=1):
        idx = np.random.default_rng([self.seed, step]).integers(0, len(self.train), size=B)
        return self.batch([self.train[i] for i in idx], device)

    def eval_batches(self, B, device="cpu"):
        for i in range(0, len(self.eval), B):
            b = self.batch(self.eval[i:i + B], device)
            b["index"] = list(range(i, min(i + B, len(self.eval))))
            yield b

    def max_answer(self):
        return max(len(r[2]) for r in self.eval) + 2      # greedy decoding's budget: the longest gold target and 2

    def score_answers(self, pred_ids, index):
        """Greedy answers (B, L) for eval samples `index` -> (exact matches, F1 sum) against every gold answer."""
        em = f1 = 0.0
        for ids, i in zip(pred_ids.tolist(), index):
            ids = ids[:ids.index(self.tok.eos)] if self.tok.eos in ids else ids
            pred, golds = self.tok.decode(ids), self.eval[i][3]
            em += max(float(normalize_answer(pred) == normalize_answer(g)) for g in golds)
            f1 += max(token_f1(pred, g) for g in golds)
        return em, f1


def normalize_answer(s):
    """SQuAD v1.1's normalisation: lower case, punctuation and the articles a/an/the removed, whitespace collapsed."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def token_f1(pred, gold):
    """SQuAD v1.1's F1 of the normalised answers' word bags."""
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    common = sum(min(p.count(w), g.count(w)) for w in set(p) & set(g))
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def qa_rows(tok, triples, space=""):
    """(context, question, [answers]) strings -> (C, Q, Y, golds) with Y = the first answer's tokens and the end token."""
    return [(tok.encode(c), tok.encode(space + q), tok.encode(space + golds[0]) + [tok.eos], golds)
            for c, q, golds in triples]


# The releases, fetched into --data_dir when their files are not there: (url, the folder the archive unpacks to)
RELEASES = {"babi": [("http://www.thespermwhale.com/jaseweston/babi/tasks_1-20_v1-2.tar.gz", "tasks_1-20_v1-2")],
            "squad": [(f"https://rajpurkar.github.io/SQuAD-explorer/dataset/{f}", "") for f in ("train-v1.1.json",
                                                                                                 "dev-v1.1.json")],
            "lm": [("https://wikitext.smerity.com/wikitext-103-raw-v1.zip", "wikitext-103-raw")]}


def fetch(task, data_dir, need):
    """The folder under data_dir that holds `need` (a relative path): data_dir itself, the folder a release unpacks
    to, or, when neither has it, that folder after downloading and unpacking the release (online only)."""
    import shutil
    import tarfile
    import urllib.request
    import zipfile
    folders = [data_dir] + [os.path.join(data_dir, sub) for _, sub in RELEASES[task]]
    for folder in folders:
        if os.path.exists(os.path.join(folder, need)):
            return folder
    os.makedirs(data_dir, exist_ok=True)
    for url, sub in RELEASES[task]:
        path = os.path.join(data_dir, os.path.basename(url))
        try:
            with urllib.request.urlopen(url, timeout=30) as r, open(path + ".part", "wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as e:
            raise ValueError(f"{os.path.join(data_dir, need)} not found and {url} could not be fetched "
                             f"({getattr(e, 'reason', e)}): download it by hand and unpack it in {data_dir}") from None
        os.replace(path + ".part", path)
        print(f"downloaded {url} to {path}")
        if path.endswith(".tar.gz"):
            with tarfile.open(path) as t:
                t.extractall(data_dir, filter="data")
        elif path.endswith(".zip"):
            with zipfile.ZipFile(path) as z:
                z.extractall(data_dir)
    return next((f for f in folders if os.path.exists(os.path.join(f, need))), data_dir)


BABI_STORIES = {"1k": (200, 200), "10k": (2000, 200)}    # (train, test) stories of the released sets; qa4: x5


def babi_task(qa, size="1k", data_dir="", tok=None, seed=0, eval_seed=12345):
    """bAbI QA`qa`: the released files under data_dir (en/ or en-10k/), or without data_dir the generator of
    babi.py (BABI_SPEC.md) with as many stories as the released set: train from `seed`, test from `eval_seed`.
    C = the story's statements before the question, Q = the question, Y = the one-word answer."""
    import babi
    if qa not in babi.TASKS:
        raise ValueError(f"--qa must be one of 1..5 (bAbI QA1-QA5), got {qa}")
    if size not in BABI_STORIES:
        raise ValueError(f"--babi_size must be 1k or 10k, got {size!r}")
    if data_dir:
        if os.path.basename(os.path.normpath(data_dir)) not in ("en", "en-10k"):     # the folder of the release
            data_dir = fetch("babi", data_dir, os.path.join("en" if size == "1k" else "en-10k", f"{babi.TASKS[qa]}_train.txt"))
        train, test = (babi.parse_file(babi.find_file(data_dir, qa, split, size)) for split in ("train", "test"))
    else:
        n_train, n_test = (n * (5 if qa == 4 else 1) for n in BABI_STORIES[size])
        if seed == eval_seed:
            raise ValueError(f"--seed and --eval_seed are both {seed}: the generated test stories would be the training stories")
        train, test = babi.generate(qa, n_train, seed), babi.generate(qa, n_test, eval_seed)
    tok = tok or Words(babi.words())
    space = "" if isinstance(tok, Words) else " "
    rows = [qa_rows(tok, [(c, q, [a]) for c, q, a in babi.samples(s)], space) for s in (train, test)]
    return TextTask("qa", tok, *rows, seed=seed, name=f"bAbI qa{qa} ({size})")


SENTENCE_RE = re.compile(r"[^.!?]+(?:[.!?]+[\"')\]]*|$)\s*")


def answer_sentences(context, start, text):
    """Short SQuAD: the sentence(s) of `context` that hold the answer span [start, start + len(text))."""
    spans = [(m.start(), m.end()) for m in SENTENCE_RE.finditer(context)]
    end = start + len(text)
    inside = [context[a:b] for a, b in spans if a < end and b > start]
    return "".join(inside).strip()


def squad_triples(path):
    """SQuAD v1.1 JSON -> (short context, question, [gold answers]); an answer whose offset does not point at its
    text in the paragraph is an error naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            articles = json.load(f)["data"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not a SQuAD v1.1 JSON file ({e.__class__.__name__}: {e})") from None
    out = []
    try:
        for art in articles:
            for para in art["paragraphs"]:
                context = para["context"]
                for qa in para["qas"]:
                    answers = qa["answers"]
                    if not answers:
                        raise ValueError(f"{path}: question {qa.get('id')} has no answer (SQuAD v2 data? this reads v1.1)")
                    for a in answers:
                        if context[a["answer_start"]:a["answer_start"] + len(a["text"])] != a["text"]:
                            raise ValueError(f"{path}: question {qa.get('id')}: answer {a['text']!r} is not at offset "
                                             f"{a['answer_start']} of its paragraph")
                    first = answers[0]
                    out.append((answer_sentences(context, first["answer_start"], first["text"]), qa["question"],
                                [a["text"] for a in answers]))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not in SQuAD v1.1's schema ({e.__class__.__name__}: {e})") from None
    return out


SQUAD_FILES = ("train-v1.1.json", "dev-v1.1.json")


def squad_task(data_dir, tok, seed=0, max_ctx=0):
    """Short SQuAD from data_dir/train-v1.1.json and dev-v1.1.json (scored on dev). max_ctx > 0 drops samples whose
    short context is longer than max_ctx tokens; how many is printed."""
    rows = []
    data_dir = fetch("squad", data_dir, SQUAD_FILES[0])
    for name in SQUAD_FILES:
        path = os.path.join(data_dir, name)
        if not os.path.isfile(path):
            raise ValueError(f"{path} not found: put SQuAD v1.1's {' and '.join(SQUAD_FILES)} in --data_dir "
                             "(https://rajpurkar.github.io/SQuAD-explorer/)")
        split = qa_rows(tok, squad_triples(path), space=" ")
        kept = [r for r in split if not max_ctx or len(r[0]) <= max_ctx]
        if len(kept) < len(split):
            print(f"{name}: skipped {len(split) - len(kept)} of {len(split)} samples with a context over --max_ctx {max_ctx} tokens")
        rows.append(kept)
    return TextTask("qa", tok, *rows, seed=seed, name="short SQuAD")


WIKITEXT_FILES = {"train": "wiki.train.raw", "eval": "wiki.valid.raw"}


def text_chunks(path, tok, length, limit=0):
    """Contiguous `length`-token chunks of a text file's tokens (at most `limit`, 0: all); the cut-off tail is
    dropped and counted."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found: --data_dir needs WikiText-103 raw's {' and '.join(WIKITEXT_FILES.values())}")
    ids = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            ids.extend(tok.encode(line))
            if limit and len(ids) >= limit * length:
                break
    n = len(ids) // length
    if limit:
        n = min(n, limit)
    if n == 0:
        raise ValueError(f"{path}: {len(ids)} tokens, fewer than one {length}-token chunk")
    if not limit and len(ids) % length:
        print(f"{path}: {n} chunks of {length} tokens; the last {len(ids) % length} tokens, short of a chunk, are left out")
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def lm_task(data_dir, tok, seed=0, half=128, limit=0, n_eval=1000):
    """WikiText-103 LM: 2 x half-token chunks, C = the first half, Y = the second, no query (Q empty); scored by the
    mean cross-entropy of Y."""
    rows = {}
    data_dir = fetch("lm", data_dir, WIKITEXT_FILES["eval"])
    for split, name in WIKITEXT_FILES.items():
        chunks = text_chunks(os.path.join(data_dir, name), tok, 2 * half, limit if split == "train" else n_eval)
        rows[split] = [(c[:half], [], c[half:], None) for c in chunks]
    return TextTask("lm", tok, rows["train"], rows["eval"], seed=seed, name="WikiText-103")


def compress_task(data_dir, tok, n_tokens, seed=0, limit=0, n_eval=1000, files=WIKITEXT_FILES):
    """Text compression (App. I): C = n_tokens of text, Q empty, Y = C again, read back from memory alone; scored by
    teacher-forced token accuracy. Text: the files of data_dir named in `files` (WikiText's, or any text so named)."""
    rows = {}
    for split, name in files.items():
        chunks = text_chunks(os.path.join(data_dir, name), tok, n_tokens, limit if split == "train" else n_eval)
        rows[split] = [(c, [], c, None) for c in chunks]
    return TextTask("compress", tok, rows["train"], rows["eval"], seed=seed, name=f"compression of {n_tokens} tokens")
