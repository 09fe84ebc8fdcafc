"""
Text <-> token ids for pretrained checkpoints, as tiktoken Encodings (`encode(str) -> list[int]`,
`decode(list[int]) -> str`). `tokenizer_for(path_or_name)` picks one:
  "gpt2" / "r50k_base"       GPT-2's BPE, tiktoken's r50k_base (downloaded by tiktoken, or from its cache);
  a `.tiktoken` file          ranks in tiktoken's format with GPT-2's pattern and <|endoftext|> after the ranks
                              (shared/data/r50k_base.tiktoken beside the project is exactly r50k_base);
  a `tokenizer.model` file    Llama-3's tiktoken-format ranks, its pattern and its 256 special tokens;
  a `tokenizer.json` file     a Hugging Face byte-level BPE (model.vocab + model.merges): ranks are the vocab ids,
                              bytes through the inverse of GPT-2's byte-to-unicode map;
  a `.gguf` file              the byte-level BPE in its metadata (tokenizer.ggml.tokens / merges / pre);
  a checkpoint folder         tokenizer.json, else tokenizer.model (also under original/), else config.json
                              model_type gpt2 -> r50k_base.
The KV task's character tokenizer lives in data.py. tiktoken merges any adjacent pair whose concatenation is a
token, by lowest id; Hugging Face applies the listed merges by priority. The two agree when merge i produces a token
whose id grows with i, which `byte_level_bpe` checks.
"""
import json
import os

# r50k_base's pattern as tiktoken writes it (the GPT-2 release's, equivalent and faster)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# Llama-3's (Meta's tokenizer.py and the Split regex of its tokenizer.json)
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# every digit alone, then GPT-2's pattern on the text between digits (SmolLM2: Digits + ByteLevel; llama.cpp "smollm");
# whitespace before a digit ends its piece as at the end of the text
DIGITS_GPT2_PATTERN = r"""\p{N}|'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?![^\s\p{N}])|\s"""
LLAMA3_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
                   + [f"<|reserved_special_token_{i}|>" for i in range(2, 247)])            # 256 in all
GGUF_PATTERNS = {"gpt2": GPT2_PATTERN, "smollm": DIGITS_GPT2_PATTERN, "llama-bpe": LLAMA3_PATTERN}


class TokenizerError(ValueError):
    """A tokenizer that cannot be read: the message names the file and what is wrong."""


def tiktoken_lib():
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        raise TokenizerError("tiktoken is not installed: pip install tiktoken") from None
    return tiktoken


def unicode_to_byte():
    """The inverse of GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other 68 for chr(256 + n)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + n): b for n, b in enumerate(rest)}}


def r50k_base():
    """tiktoken's r50k_base, downloaded (or read from TIKTOKEN_CACHE_DIR) by tiktoken itself."""
    tiktoken = tiktoken_lib()
    try:
        return tiktoken.get_encoding("r50k_base")
    except Exception as e:        # offline: requests' connection errors
        raise TokenizerError(f"r50k_base: tiktoken could not download it ({type(e).__name__}); pass a local "
                             f"r50k_base.tiktoken file instead") from None


def read_ranks(path):
    tiktoken = tiktoken_lib()
    try:
        return tiktoken.load.load_tiktoken_bpe(path)
    except Exception as e:
        raise TokenizerError(f"{path} is not in tiktoken's format (base64 token and rank per line): "
                             f"{type(e).__name__}") from None


def tiktoken_file(path):
    """GPT-2's pattern over the ranks of `path`, <|endoftext|> right after them (50256 for r50k_base)."""
    ranks = read_ranks(path)
    return tiktoken_lib().Encoding(name=os.path.basename(path), pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                   special_tokens={"<|endoftext|>": len(ranks)})


def llama3(path):
    """Llama-3's tokenizer.model: ranks in tiktoken's format, then its 256 special tokens."""
    ranks = read_ranks(path)
    return tiktoken_lib().Encoding(name="llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                   special_tokens={s: len(ranks) + i for i, s in enumerate(LLAMA3_SPECIALS)})


def byte_level_bpe(where, vocab, merges, pattern, specials):
    """A tiktoken Encoding from a byte-level BPE: vocab {token string: id} in GPT-2's byte-to-unicode alphabet,
    merges ["a b" or ["a", "b"]] in priority order, specials {text: id} matched as they are. A vocabulary may lack
    single bytes its training text never held (SmolLM2: 21 control and non-UTF-8 bytes); text with them does not encode."""
    to_byte, ranks = unicode_to_byte(), {}
    for tok, i in vocab.items():
        if tok in specials:
            continue
        if any(ch not in to_byte for ch in tok):
            raise TokenizerError(f"{where}: token {tok!r} (id {i}) is not in the byte-level alphabet")
        ranks[bytes(to_byte[ch] for ch in tok)] = i
    last = -1
    for m in merges:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        i = vocab.get(a + b)
        if i is None or i <= last:
            raise TokenizerError(f"{where}: merge {a!r} + {b!r} gives " + ("no token" if i is None else
                                 f"id {i}, not above the previous merge's {last}") + "; ids must follow merge order")
        last = i
    return tiktoken_lib().Encoding(name=where, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def json_pattern(path, pre):
    """The tiktoken pattern of a tokenizer.json pre_tokenizer: ByteLevel (GPT-2's regex), Split(regex) + ByteLevel
    without its regex (Llama-3), or Digits(individual) + ByteLevel (SmolLM2)."""
    steps = (pre or {}).get("pretokenizers", [pre]) if (pre or {}).get("type") == "Sequence" else [pre]
    kinds = [(s or {}).get("type") for s in steps]
    last = steps[-1] or {}
    if kinds[-1] != "ByteLevel" or last.get("add_prefix_space"):
        raise TokenizerError(f"{path}: pre_tokenizer {kinds} is not byte-level without add_prefix_space")
    if kinds == ["ByteLevel"] and last.get("use_regex", True):
        return GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True) and "Regex" in steps[0].get("pattern", {}) \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
        return steps[0]["pattern"]["Regex"]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and last.get("use_regex", True):
        return DIGITS_GPT2_PATTERN
    raise TokenizerError(f"{path}: pre_tokenizer {kinds} is not ByteLevel, Split + ByteLevel or Digits + ByteLevel")


def tokenizer_json(path):
    with open(path) as f:
        tj = json.load(f)
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or tj.get("normalizer") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        raise TokenizerError(f"{path}: model {model.get('type')!r} with normalizer {tj.get('normalizer')} is not a "
                             f"plain byte-level BPE")
    specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    return byte_level_bpe(path, model["vocab"], model["merges"], json_pattern(path, tj.get("pre_tokenizer")), specials)


def gguf_tokenizer(path):
    """The byte-level BPE of a GGUF file's metadata: tokenizer.ggml.tokens (control and user-defined ones special),
    .merges, and .pre naming the pattern."""
    try:
        import gguf
    except ImportError:
        raise TokenizerError("gguf is not installed: pip install gguf") from None
    fields = gguf.GGUFReader(path).fields
    get = lambda k: fields[k].contents() if k in fields else None                     # noqa: E731
    kind, pre = get("tokenizer.ggml.model"), get("tokenizer.ggml.pre") or "gpt2"
    if kind != "gpt2" or pre not in GGUF_PATTERNS:
        raise TokenizerError(f"{path}: tokenizer.ggml.model {kind!r} / pre {pre!r} is not a byte-level BPE with "
                             f"pre one of {list(GGUF_PATTERNS)}")
    tokens, types = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type") or []
    special = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)}   # CONTROL, USER_DEFINED
    return byte_level_bpe(path, {t: i for i, t in enumerate(tokens)}, get("tokenizer.ggml.merges") or [],
                          GGUF_PATTERNS[pre], special)


def tokenizer_for(path_or_name):
    """A tiktoken Encoding for a checkpoint folder, a tokenizer file, or the name gpt2 / r50k_base."""
    p = str(path_or_name)
    if p in ("gpt2", "r50k_base") and not os.path.exists(p):
        return r50k_base()
    if os.path.isdir(p):
        for name, read in (("tokenizer.json", tokenizer_json), ("tokenizer.model", llama3),
                           (os.path.join("original", "tokenizer.model"), llama3)):
            if os.path.isfile(os.path.join(p, name)):
                return read(os.path.join(p, name))
        config = os.path.join(p, "config.json")
        if os.path.isfile(config):
            with open(config) as f:
                if json.load(f).get("model_type") == "gpt2":
                    return r50k_base()
        raise TokenizerError(f"{p} holds no tokenizer.json or tokenizer.model and is not a gpt2 checkpoint")
    if not os.path.isfile(p):
        raise TokenizerError(f"{p}: no such file or folder (nor the name gpt2 / r50k_base)")
    if p.endswith(".gguf"):
        return gguf_tokenizer(p)
    if p.endswith(".json"):
        return tokenizer_json(p)
    if p.endswith(".tiktoken"):
        return tiktoken_file(p)
    if os.path.basename(p) == "tokenizer.model":
        return llama3(p)
    raise TokenizerError(f"{p}: not a tokenizer.json, tokenizer.model, .tiktoken or .gguf file")
