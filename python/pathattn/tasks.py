"""pathattn.tasks: the engine's long-context text tasks (niah, vartrack, phonebook, babi) in pure Python.

A byte-for-byte port of the C++ generators (src/engine/longctx.cpp; docs/tasks.md specifies them): the same
settings, seed and index give the same bytes, which python/tests/test_tasks.py checks against examples
printed by the engine. Use it to build data for other trainers or to inspect the tasks::

    from pathattn import tasks
    ex = tasks.test_example({"name": "niah", "seq_len": 1024, "niah_variant": "multikey"}, index=0)
    print(ex.prompt + ex.answer)
    tokens, targets = ex.tokens_targets()   # what the engine's model reads and is scored on

Settings are the engine config's ``task`` keys (docs/engine.md); missing keys take the engine's defaults.
Bad settings raise ValueError naming the key, with the engine's messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["TEXT_TASKS", "Inserted", "TextExample", "Rng", "mix_seed", "example", "test_example",
           "train_example", "haystack_sentences"]

TEXT_TASKS = ("niah", "vartrack", "phonebook", "babi")
_MASK = (1 << 64) - 1
_MAX_LEN = 1 << 20
_DEFAULTS = {
    "name": "niah", "seq_len": 0, "haystack": "filler", "niah_variant": "single", "n_needles": 0, "depths": [],
    "n_chains": 2, "n_hops": 4, "n_entries": 0, "babi_task": 1, "n_facts": 12, "data_seed": 1234,
}


def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return x, z ^ (z >> 31)


def mix_seed(a, b, c=0):
    """engine/rng.h's mix_seed: one seed from three words."""
    _, h = _splitmix64(a & _MASK)
    _, h = _splitmix64(h ^ (b & _MASK))
    _, h = _splitmix64(h ^ (c & _MASK))
    return h


class Rng:
    """engine/rng.h's Rng: xoshiro256** seeded by splitmix64; below(n) = (next() * n) >> 64."""

    def __init__(self, seed):
        x = seed & _MASK
        self.s = []
        for _ in range(4):
            x, z = _splitmix64(x)
            self.s.append(z)

    def next(self):
        s = self.s
        r = (((((s[1] * 5) & _MASK) << 7 | ((s[1] * 5) & _MASK) >> 57) & _MASK) * 9) & _MASK
        t = (s[1] << 17) & _MASK
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = ((s[3] << 45) | (s[3] >> 19)) & _MASK
        return r

    def below(self, n):
        return (self.next() * n) >> 64


_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")

_PROSE = (
    "The town sits where the river bends toward the sea, and most mornings begin with fog.",
    "Fishing boats leave the harbor before dawn and return when the tide turns.",
    "Along the main street there is a bakery, a small library and a shop that sells rope and nails.",
    "The baker opens her doors early, and the smell of warm bread drifts down to the water.",
    "Children walk to school along the old stone wall, counting the gulls that sit on it.",
    "In winter the wind comes from the north and rattles every loose shutter in town.",
    "In summer the hills behind the town turn yellow, and the evenings stay light until late.",
    "The library keeps maps of the coast drawn by sailors who once lived here.",
    "Some of those maps show islands that nobody has been able to find since.",
    "An old lighthouse stands on the point, though its lamp has been dark for many years.",
    "People still climb its stairs to watch storms roll in over the gray water.",
    "The ferry crosses the bay twice a day when the weather allows it.",
    "Farmers from the valley bring cheese, eggs and onions to the market every week.",
    "The market fills the square with voices, carts and the barking of dogs.",
    "A blacksmith works at the edge of town, and the ring of his hammer carries far.",
    "He mends gates, shoes horses and sometimes makes small iron birds for the children.",
    "The church bell is cracked, so it gives a dull note instead of a clear one.",
    "Nobody wants to replace it, because the town has grown fond of the sound.",
    "When the rain is heavy, the river rises and floods the lowest fields.",
    "The water leaves behind dark soil that makes the next harvest rich.",
    "A narrow bridge of wood and stone joins the two halves of the town.",
    "Carts must wait their turn to cross, and drivers often talk while they wait.",
    "Stories travel quickly here, and most of them grow a little on the way.",
    "The schoolteacher collects these stories in a thick notebook with a green cover.",
    "She says that one day she will write a history of the whole coast.",
    "Her students doubt it, since the notebook only ever gets thicker.",
    "On clear nights the sky above the bay is full of stars.",
    "Old sailors can name most of them and tell which ones guide a boat home.",
    "Younger people prefer to watch the lights of passing ships far out at sea.",
    "The hills hold a forest of pine and oak where deer move quietly in the shade.",
    "Hunters are rare now, and the deer have grown bold enough to visit the orchards.",
    "The orchards grow pears and plums, and the fruit is sold in baskets at the square.",
    "A painter rents a room above the bakery and paints the harbor in every season.",
    "His pictures hang in the inn, where travelers stop to rest their horses.",
    "The innkeeper serves fish soup, dark bread and a sharp cheese from the valley.",
    "Travelers often stay longer than they planned, waiting for the roads to dry.",
    "The road over the pass is steep, and snow closes it for weeks at a time.",
    "When it opens again, the first wagon through is greeted with cheers.",
    "Traders bring cloth, salt, tools and news from the cities beyond the mountains.",
    "The news is usually old by the time it arrives, but people read it anyway.",
    "Gulls follow the boats into the harbor and fight over scraps on the docks.",
    "Cats wait patiently nearby, hoping to catch a gull that is careless.",
    "The tide pools below the cliffs are full of crabs, shells and bright weed.",
    "Children spend whole afternoons there, turning over stones to see what hides beneath.",
    "Every autumn the town holds a festival to thank the sea for its fish.",
    "Lanterns are hung along the harbor wall, and music plays until midnight.",
    "The oldest boat in the harbor is painted blue and has a crooked mast.",
    "Its owner refuses to sell it, saying it knows the way home by itself.",
    "The mill by the river grinds grain for the bakery and for the farms.",
    "Its wheel turns slowly, and in dry summers it sometimes stops altogether.",
    "Then the miller sits on the bank and waits for rain, whistling to himself.",
    "Letters arrive once a week with the ferry and are sorted at the inn.",
    "A letter from far away is an event, and its news is shared by everyone.",
    "The weather is the most common topic of talk, followed closely by fish.",
    "Nobody here trusts a calm sea, since storms can come without warning.",
    "Still, most people would not trade the town for any city in the world.",
)

_ADJECTIVES = (
    "amber", "bold", "brave", "bright", "calm", "clever", "crisp", "dark",
    "eager", "early", "fair", "fancy", "gentle", "glad", "grand", "happy",
    "humble", "jolly", "keen", "kind", "lively", "lucky", "merry", "noble",
    "proud", "quiet", "rapid", "silent", "steady", "swift", "tidy", "witty",
)
_NOUNS = (
    "badger", "beetle", "canyon", "cedar", "comet", "copper", "falcon", "ferret",
    "glacier", "harbor", "heron", "island", "lantern", "maple", "meadow", "otter",
    "panther", "pebble", "pigeon", "quartz", "raven", "river", "saddle", "salmon",
    "spruce", "summit", "thistle", "tiger", "tulip", "walnut", "willow", "zebra",
)
_FIRST = (
    "Alice", "Bruno", "Clara", "Dmitri", "Elena", "Felix", "Grace", "Hugo",
    "Irene", "Jonas", "Karin", "Louis", "Maya", "Nadia", "Oscar", "Paula",
    "Quinn", "Rosa", "Simon", "Tara", "Umar", "Vera", "Walter", "Xenia",
    "Yusuf", "Zoe", "Anton", "Beatrix", "Cyril", "Delia", "Emil", "Fiona",
)
_LAST = (
    "Abbott", "Baxter", "Castillo", "Dunn", "Eriksen", "Fischer", "Garcia", "Holm",
    "Ivanova", "Jensen", "Kowalski", "Lindqvist", "Moreau", "Novak", "Okafor", "Petrov",
    "Quist", "Romano", "Sato", "Tanaka", "Ullmann", "Varga", "Weber", "Xu",
    "Yilmaz", "Zeller", "Alvarez", "Brennan", "Chen", "Duarte", "Engel", "Ferreira",
)
_AGENTS = (
    "Mary", "John", "Daniel", "Sandra",
)
_PLACES = (
    "bathroom", "hallway", "kitchen", "garden", "office", "bedroom",
)
_OBJECTS = (
    "football", "apple", "milk",
)
_MOVE_VERBS = (
    "went to the", "moved to the", "journeyed to the", "travelled to the", "went back to the",
)
_PICK_VERBS = (
    "picked up the", "got the", "grabbed the", "took the",
)
_DROP_VERBS = (
    "dropped the", "put down the", "discarded the", "left the",
)


@dataclass
class Inserted:
    """A record in the context: byte offset in the prompt, length, and slot (haystack sentences before it)."""
    offset: int
    length: int
    slot: int


@dataclass
class TextExample:
    """prompt + answer + pad zero bytes = seq_len bytes; the answer span (final newline included) is scored."""
    prompt: str = ""
    answer: str = ""
    pad: int = 0
    context_len: int = 0
    n_sentences: int = 0
    items: list = field(default_factory=list)

    def tokens_targets(self):
        """The engine's (tokens, targets) of this example: seq_len - 1 positions; target -1 = not scored."""
        s = (self.prompt + self.answer).encode("ascii") + bytes(self.pad)
        a0, a1 = len(self.prompt), len(self.prompt) + len(self.answer)
        tokens = list(s[:-1])
        targets = [s[t + 1] if a0 <= t + 1 < a1 else -1 for t in range(len(s) - 1)]
        return tokens, targets


def haystack_sentences(kind):
    """The sentences of a haystack source: "filler" or "text"."""
    if kind == "filler":
        return _FILLER
    if kind == "text":
        return _PROSE
    raise ValueError(f'task.haystack: expected filler or text, got "{kind}"')


def _longest(v):
    return max(len(x) for x in v)


def _longest_word(v):
    return next(x for x in v if len(x) == _longest(v))


def _niah_needle(key, value):
    return "The special magic number for " + key + " is " + value + ". "


def _niah_question(variant, keys):
    if variant == "multivalue":
        return "What are all the special magic numbers for " + keys[0] + "?"
    if variant == "multiquery":
        return "What are the special magic numbers for " + ", ".join(keys) + "?"
    return "What is the special magic number for " + keys[0] + "?"


def _vt_statement(name, rhs):
    return "VAR " + name + " = " + rhs + ". "


def _vt_question(value):
    return "Which variables are assigned the value " + value + "?"


def _pb_entry(name, number):
    return name + ": " + number + "\n"


def _pb_question(name):
    return "What is the number of " + name + "?"


def _qa_bytes(q, a):
    return len(q) + len(a) + 9


def _draw_distinct(rng, lo, span, used):
    while True:
        v = lo + rng.below(span)
        if v not in used:
            used.add(v)
            return v


def _settings(s):
    unknown = set(s) - set(_DEFAULTS) - {"eval_sequences"}
    if unknown:
        raise ValueError(f"task.{sorted(unknown)[0]}: unknown key")
    c = dict(_DEFAULTS)
    c.update(s)
    if c["name"] not in TEXT_TASKS:
        raise ValueError(f'task.name: "{c["name"]}" is not a long-context text task')
    if c["seq_len"] == 0:
        c["seq_len"] = 1024
    return c


def _niah_needles(c):
    return c["n_needles"] if c["n_needles"] > 0 else (1 if c["niah_variant"] == "single" else 4)


def _worst_fixed(c):
    name = c["name"]
    if name == "niah":
        n = _niah_needles(c)
        key, val = _longest_word(_ADJECTIVES) + "-" + _longest_word(_NOUNS), "9999999"
        keys = [key] * (n if c["niah_variant"] == "multiquery" else 1)
        vals = [val] * (n if c["niah_variant"] in ("multivalue", "multiquery") else 1)
        return n * len(_niah_needle(key, val)) + _qa_bytes(_niah_question(c["niah_variant"], keys), ", ".join(vals))
    if name == "vartrack":
        nv = c["n_hops"] + 1
        return c["n_chains"] * nv * len(_vt_statement("XXXXX", "99999")) + _qa_bytes(
            _vt_question("99999"), ", ".join(["XXXXX"] * nv))
    if name == "babi":
        fact = _longest(_AGENTS) + max(_longest(_MOVE_VERBS), _longest(_PICK_VERBS), _longest(_DROP_VERBS)) + max(
            _longest(_PLACES), _longest(_OBJECTS)) + 4
        q = "Where was the " + _longest_word(_OBJECTS) + " before the " + _longest_word(_PLACES) + "?"
        return c["n_facts"] * fact + _qa_bytes(q, _longest_word(_PLACES))
    name_ = _longest_word(_FIRST) + " " + _longest_word(_LAST)
    return max(c["n_entries"], 1) * len(_pb_entry(name_, "999-9999")) + _qa_bytes(_pb_question(name_), "999-9999")


def _check(c):
    L, name = c["seq_len"], c["name"]
    if L < 2 or L > _MAX_LEN:
        raise ValueError(f"task.seq_len: {name} needs a length in [2, {_MAX_LEN}], got {L}")
    if c["depths"] and name != "niah":
        raise ValueError(f"task.depths: only niah places its needles at given depths (got {name})")
    if name == "niah":
        n = _niah_needles(c)
        if c["niah_variant"] == "single" and n != 1:
            raise ValueError(f"task.n_needles: the single variant hides one needle, got {n}")
        if c["niah_variant"] != "single" and n < 2:
            raise ValueError(f"task.n_needles: the {c['niah_variant']} variant needs at least 2 needles, got {n}")
        if len(c["depths"]) > n:
            raise ValueError(f"task.depths: {len(c['depths'])} depths for {n} needle(s)")
    if name == "vartrack" and c["n_chains"] > 90000:
        raise ValueError("task.n_chains: at most 90000 (one distinct five-digit value per chain)")
    if name == "phonebook" and c["n_entries"] > len(_FIRST) * len(_LAST):
        raise ValueError(f"task.n_entries: at most {len(_FIRST) * len(_LAST)} distinct names, got {c['n_entries']}")
    if name == "babi" and c["n_facts"] < c["babi_task"]:
        raise ValueError(f"task.n_facts: babi task {c['babi_task']} needs at least {c['babi_task']} facts, "
                         f"got {c['n_facts']}")
    fixed = _worst_fixed(c)
    hay = 0 if name == "phonebook" else _longest(haystack_sentences(c["haystack"])) + 1
    if fixed + hay > L:
        what = {"niah": f"{_niah_needles(c)} needle(s)", "vartrack": f"{c['n_chains']} chain(s) of {c['n_hops']} hops",
                "babi": f"{c['n_facts']} facts"}.get(name, f"{max(c['n_entries'], 1)} entries")
        raise ValueError(f"task.seq_len: {L} bytes are too short for {what}: need task.seq_len >= {fixed + hay}")


def _lay_out(S, start, budget, rng, recs, depths, ordered, ex):
    sent, used, i = [], 0, start
    while used + len(S[i]) + 1 <= budget:
        sent.append(i)
        used += len(S[i]) + 1
        i = (i + 1) % len(S)
    ns = len(sent)
    if depths:
        slot = [min(ns, math.floor(depths[i % len(depths)] * ns)) for i in range(len(recs))]
    else:
        slot = [rng.below(ns + 1) for _ in recs]
    if ordered:
        slot.sort()
    order = sorted(range(len(recs)), key=lambda i: slot[i])  # stable
    parts, at, r = [], 0, 0
    for k in range(ns + 1):
        while r < len(order) and slot[order[r]] == k:
            ex.items.append(Inserted(at, len(recs[order[r]]), k))
            parts.append(recs[order[r]])
            at += len(recs[order[r]])
            r += 1
        if k < ns:
            parts.append(S[sent[k]] + " ")
            at += len(S[sent[k]]) + 1
    ex.prompt = "".join(parts)
    ex.n_sentences = ns
    ex.context_len = len(ex.prompt)
    return budget - used


def _finish(q, a, pad, ex):
    ex.prompt += "\nQ: " + q + "\nA: "
    ex.answer = a + "\n"
    ex.pad = pad


def _gen_niah(c, rng):
    n, L, variant = _niah_needles(c), c["seq_len"], c["niah_variant"]
    used_keys, used_vals, keys, vals, recs = set(), set(), [], [], []
    for i in range(n):
        if variant != "multivalue" or i == 0:
            while True:
                a, b = rng.below(len(_ADJECTIVES)), rng.below(len(_NOUNS))
                if a * len(_NOUNS) + b not in used_keys:
                    used_keys.add(a * len(_NOUNS) + b)
                    keys.append(_ADJECTIVES[a] + "-" + _NOUNS[b])
                    break
        vals.append(str(_draw_distinct(rng, 1000000, 9000000, used_vals)))
        recs.append(_niah_needle(keys[-1], vals[-1]))
    asked = rng.below(n) if variant == "multikey" else 0
    q = _niah_question(variant, keys if variant == "multiquery" else [keys[asked]])
    a = ", ".join(vals) if variant in ("multivalue", "multiquery") else vals[asked]
    S = haystack_sentences(c["haystack"])
    start = rng.below(len(S))
    ex = TextExample()
    pad = _lay_out(S, start, L - sum(map(len, recs)) - _qa_bytes(q, a), rng, recs, c["depths"], False, ex)
    if variant == "multivalue":
        a = ", ".join(ex.prompt[it.offset + it.length - 9:it.offset + it.length - 2] for it in ex.items)
    _finish(q, a, pad, ex)
    return ex


def _gen_vartrack(c, rng):
    L, nv = c["seq_len"], c["n_hops"] + 1
    used_names, used_vals, chains, names0, value0 = set(), set(), [], None, None
    for ch in range(c["n_chains"]):
        names = []
        for _ in range(nv):
            while True:
                s = "".join(chr(ord("A") + rng.below(26)) for _ in range(5))
                if s not in used_names:
                    used_names.add(s)
                    names.append(s)
                    break
        value = str(_draw_distinct(rng, 10000, 90000, used_vals))
        chains.append([_vt_statement(names[0], value)] + [_vt_statement(names[v], names[v - 1]) for v in range(1, nv)])
        if ch == 0:
            names0, value0 = names, value
    recs, nxt, live = [], [0] * len(chains), list(range(len(chains)))
    while live:
        j = rng.below(len(live))
        ch = live[j]
        recs.append(chains[ch][nxt[ch]])
        nxt[ch] += 1
        if nxt[ch] == len(chains[ch]):
            del live[j]
    q, a = _vt_question(value0), ", ".join(names0)
    S = haystack_sentences(c["haystack"])
    start = rng.below(len(S))
    ex = TextExample()
    pad = _lay_out(S, start, L - sum(map(len, recs)) - _qa_bytes(q, a), rng, recs, None, True, ex)
    _finish(q, a, pad, ex)
    return ex


def _gen_phonebook(c, rng):
    L, n_entries = c["seq_len"], c["n_entries"]
    wname = _longest_word(_FIRST) + " " + _longest_word(_LAST)
    room = L - _qa_bytes(_pb_question(wname), "999-9999")
    pool = len(_FIRST) * len(_LAST)
    used_names, used_nums, names, nums, used = set(), set(), [], [], 0
    ex = TextExample()
    parts = []
    while True:
        if n_entries > 0 and len(names) == n_entries:
            break
        if len(used_names) == pool:
            break
        while True:
            i = rng.below(len(_FIRST)) * len(_LAST) + rng.below(len(_LAST))
            if i not in used_names:
                used_names.add(i)
                break
        name = _FIRST[i // len(_LAST)] + " " + _LAST[i % len(_LAST)]
        v = str(_draw_distinct(rng, 1000000, 9000000, used_nums))
        num = v[:3] + "-" + v[3:]
        e = _pb_entry(name, num)
        if n_entries == 0 and used + len(e) > room:
            break
        ex.items.append(Inserted(used, len(e), len(names)))
        parts.append(e)
        used += len(e)
        names.append(name)
        nums.append(num)
    q = rng.below(len(names))
    ex.prompt = "".join(parts)
    ex.context_len = len(ex.prompt)
    qs = _pb_question(names[q])
    _finish(qs, nums[q], L - ex.context_len - _qa_bytes(qs, nums[q]), ex)
    return ex


def _babi_story(c, rng):
    NA, NO, task = len(_AGENTS), len(_OBJECTS), c["babi_task"]
    aloc, holder, oloc, hist = [-1] * NA, [-1] * NO, [-1] * NO, [[] for _ in range(NO)]

    def set_loc(o, l):
        oloc[o] = l
        if not hist[o] or hist[o][-1] != l:
            hist[o].append(l)

    facts = []
    for _ in range(c["n_facts"]):
        ag, kind, obj = rng.below(NA), 0, 0
        if task >= 2:
            r = rng.below(10)
            cand = []
            if r in (6, 7):
                cand = [o for o in range(NO) if holder[o] < 0 and aloc[ag] >= 0 and (oloc[o] < 0 or oloc[o] == aloc[ag])]
                kind = 1 if cand else 0
            elif r >= 8:
                cand = [o for o in range(NO) if holder[o] == ag]
                kind = 2 if cand else 0
            if kind:
                obj = cand[rng.below(len(cand))]
        if kind == 0:
            if aloc[ag] < 0:
                l = rng.below(len(_PLACES))
            else:
                l = rng.below(len(_PLACES) - 1)
                if l >= aloc[ag]:
                    l += 1
            v = rng.below(len(_MOVE_VERBS))
            facts.append(_AGENTS[ag] + " " + _MOVE_VERBS[v] + " " + _PLACES[l] + ". ")
            aloc[ag] = l
            for o in range(NO):
                if holder[o] == ag:
                    set_loc(o, l)
        elif kind == 1:
            v = rng.below(len(_PICK_VERBS))
            facts.append(_AGENTS[ag] + " " + _PICK_VERBS[v] + " " + _OBJECTS[obj] + ". ")
            holder[obj] = ag
            set_loc(obj, aloc[ag])
        else:
            v = rng.below(len(_DROP_VERBS))
            facts.append(_AGENTS[ag] + " " + _DROP_VERBS[v] + " " + _OBJECTS[obj] + ". ")
            holder[obj] = -1
    if task == 1:
        cand = [i for i in range(NA) if aloc[i] >= 0]
    elif task == 2:
        cand = [o for o in range(NO) if oloc[o] >= 0]
    else:
        cand = [o for o in range(NO) if len(hist[o]) >= 2 and hist[o][-1] not in hist[o][:-1]]
    if not cand:
        return None
    x = cand[rng.below(len(cand))]
    if task == 1:
        return facts, "Where is " + _AGENTS[x] + "?", _PLACES[aloc[x]]
    if task == 2:
        return facts, "Where is the " + _OBJECTS[x] + "?", _PLACES[oloc[x]]
    h = hist[x]
    return facts, "Where was the " + _OBJECTS[x] + " before the " + _PLACES[h[-1]] + "?", _PLACES[h[-2]]


def _gen_babi(c, rng):
    for _ in range(1000):
        story = _babi_story(c, rng)
        if story is not None:
            break
    else:
        raise ValueError(f"task.n_facts: 1000 stories of {c['n_facts']} facts gave no question of babi task "
                         f"{c['babi_task']}; use more facts")
    facts, q, a = story
    S = haystack_sentences(c["haystack"])
    start = rng.below(len(S))
    ex = TextExample()
    pad = _lay_out(S, start, c["seq_len"] - sum(map(len, facts)) - _qa_bytes(q, a), rng, facts, None, True, ex)
    _finish(q, a, pad, ex)
    return ex


def example(settings, seed, a, b):
    """The example of Rng(mix_seed(seed, a, b)) for the task settings (a dict of the config's task keys)."""
    c = _settings(settings)
    _check(c)
    rng = Rng(mix_seed(seed, a, b))
    return {"niah": _gen_niah, "vartrack": _gen_vartrack, "phonebook": _gen_phonebook, "babi": _gen_babi}[c["name"]](c, rng)


def test_example(settings, index):
    """Test example `index` (the engine's test set: seed task.data_seed, a = 500)."""
    return example(settings, _settings(settings)["data_seed"], 500, index)


test_example.__test__ = False  # not a pytest test


def train_example(settings, train_seed, step, row):
    """Row `row` of the training batch of step `step` for training seed train.seed."""
    return example(settings, train_seed, step, row)
