"""
bAbI QA1-QA5 (Weston et al., arXiv:1502.05698; released files tasks_1-20_v1-2.tar.gz), the reasoning
tasks of the GradMem NLP evaluation (arXiv:2603.13875v2, Table 2). numpy + stdlib only.

- read and write the released text format byte-exactly (BABI_SPEC.md §1) and find its files;
- a generator faithful to the released data (§3 world, §4 reader knowledge, §5 per-task rules), for
  machines without the tarball; every story is a pure function of (qa, n_stories, seed);
- replay(): recompute every answer and support from the statements alone (§4, §6), and stats() (§6).

A story is a list of Line(id, text, answer, support); statements have answer None and support ().
"""
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

TASKS = {1: "qa1_single-supporting-fact", 2: "qa2_two-supporting-facts", 3: "qa3_three-supporting-facts",
         4: "qa4_two-arg-relations", 5: "qa5_three-arg-relations"}
LOCS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")                 # §3
ACTORS = {1: ("Mary", "John", "Sandra", "Daniel"), 5: ("Bill", "Fred", "Jeff", "Mary")}
ACTORS[2] = ACTORS[3] = ACTORS[1]
OBJECTS = ("apple", "football", "milk")
OPP = {"north": "south", "south": "north", "east": "west", "west": "east"}
VERBS = {"move": ("moved", "went", "journeyed", "travelled", "went back"),                # §3, uniform
         "get": ("got", "grabbed", "took", "picked up"),
         "drop": ("dropped", "discarded", "left", "put down"),
         "give": ("gave", "handed", "passed")}
STATEMENT = {"move": "{a} {v} to the {l}.", "get": "{a} {v} the {o}{t}.", "drop": "{a} {v} the {o}{t}.",
             "give": "{a} {v} the {o} to {b}.", "rel": "The {x} is {d} of the {y}."}
QUESTION = {1: ["Where is {a}?"], 2: ["Where is the {o}?"], 3: ["Where was the {o} before the {l}?"],
            4: ["What is {d} of the {y}?", "What is the {y} {d} of?"],            # §5: 1/2 each
            5: ["What did {a} give to {b}?", "Who received the {o}?", "Who gave the {o}?",
                "Who did {a} give the {o} to?", "Who gave the {o} to {b}?"]}
QA5_ANSWER, QA5_W = "obaba", (2, 1, 1, 1, 1)                   # §5 QA5: answer slot and weight (/6) per template
ACTION_W = {1: (1, 0, 0, 0), 2: (.50, .30, .20, 0), 3: (.50, .27, .23, 0), 5: (.35, .20, .10, .35)}  # §3, calibrated
P_THERE = {2: (1.0, .21), 3: (.19, .22), 5: (1.0, .17)}          # §3: P(" there") for (get, drop)
P_ASK2 = (0, .55, .72, .75)                                      # §5 QA2: by number of candidates
BACK_W = (.66, .30, .03, .01)    # §5 QA3: latest / 1 / 2 / 3+ eligible transitions back, renormalised to those that exist;
                                 # calibrated (ours) to the released 79/16/3/1 %
QA3_MAX_STATEMENTS = 228         # §5 QA3 "optionally resample": we redraw stories longer than the released max


@dataclass
class Line:
    id: int
    text: str
    answer: str | None = None
    support: tuple = ()


def _regex(tmpl, verbs=()):
    """A template as a regex: {v} = one of verbs, {t} = optional ' there', other {slot} = one word."""
    special = {"v": "(?:" + "|".join(sorted(verbs, key=len, reverse=True)) + ")", "t": "(?P<t> there)?"}
    parts = re.split(r"\{(\w)\}", tmpl)
    return re.compile("".join(re.escape(p) if i % 2 == 0 else special.get(p, f"(?P<{p}>[A-Za-z]+)")
                              for i, p in enumerate(parts)))


STATEMENT_RE = {k: _regex(t, VERBS.get(k, ())) for k, t in STATEMENT.items()}
QUESTION_RE = {qa: [_regex(t) for t in qs] for qa, qs in QUESTION.items()}


def _match(regexes, text, what):
    for key, rx in regexes:
        if m := rx.fullmatch(text):
            return key, m.groupdict()
    raise ValueError(f"not a {what}: {text!r}")


def parse_statement(text):
    """'Mary went back to the garden.' -> ('move', {'a': 'Mary', 'l': 'garden'})."""
    return _match(STATEMENT_RE.items(), text, "bAbI QA1-5 statement")


def parse_question(text, qa):
    """'Who gave the milk?' -> (template index, slots)."""
    return _match(enumerate(QUESTION_RE[qa]), text, f"qa{qa} question")


# ---------------------------------------------------------------- §4 reader knowledge

class Reader:
    """What a reader can infer from the statements so far (§4); the generator asks from it, replay() checks it."""

    def __init__(self):
        self.stmts = []                        # (line id, kind, slots) of every statement
        self.aloc = {}                         # actor -> (location, line of its latest move)
        self.event = {}                        # object -> (line, holder or None, (location, move line) or None)
        self.hist = {o: [] for o in OBJECTS}   # object -> [(location, support)], one entry per change of place
        self.rel = {}                          # qa4: (x, d, y) "the x is d of the y" -> line

    def read(self, lid, text):
        kind, s = parse_statement(text)
        self.stmts.append((lid, kind, s))
        if kind == "move":
            self.aloc[s["a"]] = (s["l"], lid)
        elif kind in ("get", "give"):           # held by the taker / the receiver
            self.event[s["o"]] = (lid, s["b"] if kind == "give" else s["a"], None)
        elif kind == "drop":                    # left where the dropper was last narrated to be, if anywhere
            self.event[s["o"]] = (lid, None, self.aloc.get(s["a"]))
        else:
            self.rel[s["x"], s["d"], s["y"]] = self.rel[s["y"], OPP[s["d"]], s["x"]] = lid
        for o in OBJECTS:                       # hist: a new entry only when the location name changes;
            w = self.where(o)                   # an unknown location is no change (a choice §4 leaves open)
            if w and (not self.hist[o] or self.hist[o][-1][0] != w[0]):
                self.hist[o].append(w)

    def where(self, o):
        """(location, (event line, location line)) of object o, or None if not inferable."""
        if o not in self.event:
            return None
        line, holder, place = self.event[o]
        place = self.aloc.get(holder) if holder else place
        return (place[0], (line, place[1])) if place else None

    def window(self):
        """Line id of the oldest of the last 5 statements: the recency window R (§5)."""
        return self.stmts[-5:][0][0]

    def before(self, o, l2):
        """QA3: the latest transition of o into l2 -> (previous location, sorted union support), or None."""
        h = self.hist[o]
        for k in range(len(h) - 1, 0, -1):
            if h[k][0] == l2:
                return h[k - 1][0], tuple(sorted(set(h[k][1]) | set(h[k - 1][1])))
        return None

    def transitions3(self, o):
        """QA3: (l2, answer, support) of the latest transition of o into each location l2, newest first, where
        |S_k U S_k-1| == 3. Only the latest transition into l2 is asked about, so each question has one answer."""
        l2s = dict.fromkeys(h[0] for h in reversed(self.hist[o][1:]))      # distinct, newest first
        return [(l2, *b) for l2 in l2s if len((b := self.before(o, l2))[1]) == 3]

    def askable3(self, o):                      # §5 QA3: the LAST transition has a 3-line support
        t = self.transitions3(o)
        return bool(t) and t[0][0] == self.hist[o][-1][0]


# ---------------------------------------------------------------- §3 hidden world and §5 story loop

def _pick(rng, seq, weights=None):
    """A uniform (or weighted) element of seq; one rng.random() draw, much faster than rng.choice."""
    if weights is None:
        return seq[int(rng.random() * len(seq))]
    cum = np.cumsum(weights)
    return seq[int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))]


def _statement(rng, qa, loc, holder):
    """Draw one valid action (§3), apply it to the hidden world (loc, holder), return its text."""
    actors = ACTORS[qa]
    while True:
        kind = _pick(rng, ("move", "get", "drop", "give"), ACTION_W[qa])
        valid = {"move": lambda: [(a, l) for a in actors for l in LOCS if l != loc[a]],
                 "get": lambda: [(a, o) for a in actors for o in OBJECTS if holder[o] is None and loc[o] == loc[a]],
                 "drop": lambda: [(holder[o], o) for o in OBJECTS if holder[o]],
                 "give": lambda: [(holder[o], o, b) for o in OBJECTS if holder[o] for b in actors
                                  if b != holder[o] and loc[b] == loc[holder[o]]]}[kind]()
        if valid:
            break                               # else redraw the type
    inst, verb = _pick(rng, valid), _pick(rng, VERBS[kind])
    if kind == "move":
        loc[inst[0]] = inst[1]
        for o in OBJECTS:                       # held objects move with the holder
            if holder[o] == inst[0]:
                loc[o] = inst[1]
        return STATEMENT[kind].format(a=inst[0], v=verb, l=inst[1])
    if kind == "give":
        holder[inst[1]] = inst[2]
        return STATEMENT[kind].format(a=inst[0], v=verb, o=inst[1], b=inst[2])
    holder[inst[1]] = inst[0] if kind == "get" else None
    there = rng.random() < P_THERE[qa][kind == "drop"]   # (get, drop)[kind == "drop"]
    return STATEMENT[kind].format(a=inst[0], v=verb, o=inst[1], t=" there" if there else "")


def _ask(rng, qa, rd, prev):
    """The question at a pair boundary (§5): (text, answer, support) or None."""
    if qa == 1:                                 # actor of a uniform statement among the last 5
        a = _pick(rng, rd.stmts[-5:])[2]["a"]
        return QUESTION[1][0].format(a=a), rd.aloc[a][0], (rd.aloc[a][1],)
    if qa == 2:
        cands = [o for o in OBJECTS if rd.where(o) and max(rd.where(o)[1]) >= rd.window()]
        if rng.random() < P_ASK2[len(cands)]:
            o = _pick(rng, cands)
            return QUESTION[2][0].format(o=o), *rd.where(o)
        return None
    if qa == 3:
        # repeat the identical Q&A; that it still has the same answer and support is our addition (§5 leaves it
        # open), so that the question stays unambiguous and replay() reproduces it
        if prev and rd.askable3(prev[3]) and rd.before(prev[3], prev[4]) == prev[1:3] and rng.random() < .55:
            return prev
        askable = [o for o in OBJECTS if rd.askable3(o)]
        if askable and rng.random() < 1 - 0.9 ** len(askable):
            o = _pick(rng, askable)
            ts = rd.transitions3(o)             # weights: BACK_W[3] shared by all 3+ back, cut to len(ts)
            l2, ans, sup = _pick(rng, ts, (BACK_W[:3] + (BACK_W[3] / max(1, len(ts) - 3),) * len(ts))[:len(ts)])
            return QUESTION[3][0].format(o=o, l=l2), ans, sup, o, l2
        return None
    lid, _, s = next((st for st in reversed(rd.stmts) if st[1] == "give"), (0, None, None))
    if lid < rd.window():                       # QA5: ask iff the most recent give is within R
        return None
    i = _pick(rng, range(5), QA5_W)
    return QUESTION[5][i].format(**s), s[QA5_ANSWER[i]], (lid,)


def _story_qa4(rng):
    """§5 QA4: a 3-location chain x1 - m - x3; two statements about (x1, m), (m, x3); one question."""
    x1, m, x3 = (LOCS[i] for i in rng.permutation(len(LOCS))[:3])
    d = "north" if rng.random() < .5 else "east"          # x1 is d of m, x3 is opp(d) of m
    facts = [(x1, d, m), (x3, OPP[d], m)]
    facts = [facts[i] for i in rng.permutation(2)]        # random order
    facts = [f if rng.random() < 2 / 3 else (f[2], OPP[f[1]], f[0]) for f in facts]   # m the object w.p. 2/3
    lines = [Line(i + 1, STATEMENT["rel"].format(x=x, d=dd, y=y)) for i, (x, dd, y) in enumerate(facts)]
    i, j = rng.integers(2, size=2)                        # which statement, which template
    x, dd, y = facts[i]                                   # "What is dd of the y?" = "What is the y opp(dd) of?"
    return lines + [Line(3, QUESTION[4][j].format(d=OPP[dd] if j else dd, y=y), x, (int(i) + 1,))]


def _story(rng, qa):
    if qa == 4:
        return _story_qa4(rng)
    loc = {k: _pick(rng, LOCS) for k in ACTORS[qa] + OBJECTS}   # hidden start, never narrated (§3)
    holder = dict.fromkeys(OBJECTS)
    rd, lines, prev, n_q = Reader(), [], None, 0
    while n_q < 5:
        for _ in range(2):                       # statements come in pairs (§5)
            lines.append(Line(len(lines) + 1, _statement(rng, qa, loc, holder)))
            rd.read(lines[-1].id, lines[-1].text)
        prev = _ask(rng, qa, rd, prev)
        if prev:
            lines.append(Line(len(lines) + 1, *prev[:3]))
            n_q += 1
    return lines


def generate(qa, n_stories, seed):
    """n_stories stories of task qa, deterministic per (qa, n_stories, seed)."""
    rng, out = np.random.default_rng([seed, qa]), []
    while len(out) < n_stories:
        s = _story(rng, qa)
        if qa != 3 or len(s) - 5 <= QA3_MAX_STATEMENTS:
            out.append(s)
    return out


# ---------------------------------------------------------------- §1 file format

def format_story(story, qa):
    sp = "" if qa == 4 else " "                 # qa4 has no space before the tab (§1)
    return "".join(f"{ln.id} {ln.text}\n" if ln.answer is None else
                   f"{ln.id} {ln.text}{sp}\t{ln.answer}\t{' '.join(map(str, ln.support))}\n" for ln in story)


def write_file(stories, path, qa):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("".join(format_story(s, qa) for s in stories))


def parse_file(path):
    """Stories of a released file; a new story starts where the id goes back to 1."""
    name, stories, statements = os.path.basename(path), [], set()
    with open(path, encoding="utf-8") as f:
        rows = f.read().splitlines()
    for n, row in enumerate(rows, 1):
        def bad(why):
            return ValueError(f"{name}:{n}: {why}: {row!r}")
        head, *tail = row.rstrip().split("\t")
        m = re.fullmatch(r"([0-9]+) (\S.*)", head.rstrip())
        if not m:
            raise bad("not '<id> <text>'")
        lid, text = int(m[1]), m[2]
        if lid == 1:
            stories.append([])
            statements = set()
        elif not stories or lid != stories[-1][-1].id + 1:
            raise bad(f"id {lid} where {stories[-1][-1].id + 1 if stories else 1} or 1 (a new story) was expected")
        if not tail and not text.endswith("?"):
            statements.add(lid)
            stories[-1].append(Line(lid, text))
            continue
        if len(tail) != 2 or not tail[0].strip() or not tail[1].strip():
            raise bad("question line is not '<id> <question>?\\t<answer>\\t<support ids>'")
        if not re.fullmatch(r"[0-9]+( +[0-9]+)*", tail[1].strip()):
            raise bad("support ids are not space-separated integers")
        support = tuple(int(t) for t in tail[1].split())
        if not set(support) <= statements:
            raise bad("support id is not an earlier statement of this story")
        stories[-1].append(Line(lid, text, tail[0].strip(), support))
    if not stories:
        raise ValueError(f"{name}: empty file")
    return stories


def find_file(data_dir, qa, split, size="1k"):
    """{data_dir}/{en,en-10k}/qaN_<name>_{train,test}.txt; data_dir may also be that en/ or en-10k/ folder."""
    if size not in ("1k", "10k") or split not in ("train", "test"):
        raise ValueError(f"size must be 1k or 10k and split train or test, got {size!r}, {split!r}")
    folder, fname = "en" if size == "1k" else "en-10k", f"{TASKS[qa]}_{split}.txt"
    expected = os.path.join(data_dir, folder, fname)
    for p in (expected, os.path.join(data_dir, fname)):
        if os.path.isfile(p) and os.path.basename(os.path.dirname(os.path.abspath(p))) == folder:
            return p
    raise FileNotFoundError(f"bAbI file not found: {expected} (unpack tasks_1-20_v1-2.tar.gz there)")


# ---------------------------------------------------------------- samples, vocabulary, replay, stats

def samples(stories):
    """(context, question, answer) per question; context = the story's statements before it."""
    return [(" ".join(ln.text for ln in story[:i] if ln.answer is None), q.text, q.answer)
            for story in stories for i, q in enumerate(story) if q.answer is not None]


def tokens(text):
    return re.findall(r"[a-z]+|[.?]", text.lower())


def words():
    """The closed vocabulary of the five tasks' text (§6): templates, fillers, verbs and ' there'."""
    tmpls = list(STATEMENT.values()) + sum(QUESTION.values(), [])
    fill = LOCS + ACTORS[1] + ACTORS[5] + OBJECTS + tuple(OPP) + sum(VERBS.values(), ()) + ("there",)
    return sorted({w for t in tmpls + list(fill) for w in tokens(re.sub(r"\{\w\}", " ", t))})


def replay(story, qa):
    """(answer, support) of every question, recomputed from the statements before it (§4); None if not inferable."""
    rd, out = Reader(), []
    for ln in story:
        if ln.answer is None:
            rd.read(ln.id, ln.text)
            continue
        i, s = parse_question(ln.text, qa)
        if qa == 1:
            p = rd.aloc.get(s["a"])
            out.append(p and (p[0], (p[1],)))
        elif qa == 2:
            out.append(rd.where(s["o"]))
        elif qa == 3:
            out.append(rd.before(s["o"], s["l"]))
        elif qa == 4:                            # "What is the y d of?" = "What is opp(d) of the y?"
            k = next((k for k in rd.rel if k[1:] == (OPP[s["d"]] if i else s["d"], s["y"])), None)
            out.append(k and (k[0], (rd.rel[k],)))
        else:                                    # the latest give that fits the question's slots
            g = next(((lid, g) for lid, k, g in reversed(rd.stmts) if k == "give" and s.items() <= g.items()), None)
            out.append(g and (g[1][QA5_ANSWER[i]], (g[0],)))
    return out


def _freq(values):
    return {k: v / len(values) for k, v in sorted(Counter(values).items())}


def stats(stories, qa):
    """The §6 statistics of a set of stories: fractions in 0..1 and {value: fraction} histograms."""
    n_st = [sum(ln.answer is None for ln in s) for s in stories]
    f = defaultdict(list)                      # statistic -> one value per statement / question / follow-up
    for story in stories:
        rd, prev, prev_n = Reader(), None, 0
        for ln in story:
            if ln.answer is None:
                rd.read(ln.id, ln.text)
                _, kind, s = rd.stmts[-1]
                f["actions"].append(kind)
                if kind in ("get", "drop"):
                    f[f"there_{kind}"].append(s["t"] is not None)
                continue
            n, (i, s) = len(rd.stmts), parse_question(ln.text, qa)
            f["answers"].append(ln.answer)
            f["templates"].append(i)
            if prev is None:
                f["first_question"].append(n)
            else:
                f["gaps"].append(min(n - prev_n, 8))     # 8 stands for >= 8
            if prev is not None and n - prev_n == 2:   # follow-up 2 statements later: identical Q&A?
                f["repeat_at_gap2"].append((prev.text, prev.answer, prev.support) == (ln.text, ln.answer, ln.support))
            if qa == 1:                        # statements after the support: 0 = the newest
                f["support_distance"].append(sum(lid > ln.support[0] for lid, _, _ in rd.stmts))
            elif qa == 2:
                f["held"].append(next(k for lid, k, _ in rd.stmts if lid == ln.support[0]) == "get")
            elif qa == 3:
                f["latest"].append(rd.hist[s["o"]][-1][0] == s["l"])
            elif qa == 4:
                (_, _, f1), (_, _, f2) = rd.stmts
                middle = ({f1["x"], f1["y"]} & {f2["x"], f2["y"]}).pop()     # the location in both statements
                f["middle_reference"].append(s["y"] == middle)
                f["middle_object"] += [f1["y"] == middle, f2["y"] == middle]
            prev, prev_n = ln, n
        if qa == 1:                            # the two statements of a pair have the same actor
            f["same_actor_pair"] += [a[2]["a"] == b[2]["a"] for a, b in zip(rd.stmts[::2], rd.stmts[1::2])]
    first = f.pop("first_question")
    out = {"stories": len(stories), "statements_mean": float(np.mean(n_st)), "statements_min": min(n_st),
           "statements_max": max(n_st), "questions_per_story": len(f["answers"]) / len(stories),
           "first_question": {"median": float(np.median(first)), "min": min(first), "max": max(first),
                              "in_4_12": float(np.mean([4 <= x <= 12 for x in first]))}}
    hists = ("actions", "answers", "templates", "gaps", "support_distance")
    return out | {k: _freq(v) if k in hists else float(np.mean(v)) for k, v in f.items()}
