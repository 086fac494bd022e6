"""pathattn.tasks reproduces the engine's long-context text tasks byte for byte: whole examples and the hashes
of many more (tests/data/longctx_examples.json, printed by the engine's `pathattn tasks show --json`), and
the same errors for bad settings."""
import json
import pathlib

import pytest

from pathattn import tasks

REF = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "longctx_examples.json"


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & ((1 << 64) - 1)
    return h


@pytest.fixture(scope="module")
def ref():
    if not REF.exists():
        pytest.skip("tests/data/longctx_examples.json is not here (the tests run outside the source tree)")
    return json.loads(REF.read_text())


def test_whole_examples_match_the_engine(ref):
    assert len(ref["examples"]) >= 10
    for k in ref["examples"]:
        ex = tasks.example(k["settings"], k["seed"], k["a"], k["b"])
        assert ex.prompt == k["prompt"], k["settings"]
        assert ex.answer == k["answer"], k["settings"]
        assert ex.pad == k["pad"], k["settings"]


def test_hashed_examples_match_the_engine(ref):
    n = 0
    for k in ref["hashes"]:
        for i, want in enumerate(k["fnv1a64"]):
            ex = tasks.example(k["settings"], k["seed"], k["a"], i)
            got = fnv1a64((ex.prompt + ex.answer).encode("ascii") + bytes(ex.pad))
            assert "%016x" % got == want, (k["settings"], i)
            n += 1
    assert n >= 300


def test_tokens_targets_score_only_the_answer():
    s = {"name": "phonebook", "seq_len": 300}
    ex = tasks.test_example(s, 3)
    assert ex == tasks.test_example(s, 3)
    tok, tgt = ex.tokens_targets()
    assert len(tok) == len(tgt) == 299
    scored = [t for t in range(299) if tgt[t] >= 0]
    assert scored == list(range(len(ex.prompt) - 1, len(ex.prompt) + len(ex.answer) - 1))
    assert bytes(tgt[t] for t in scored).decode() == ex.answer
    assert tasks.train_example(s, 1, 2, 3) == tasks.example(s, 1, 2, 3)


@pytest.mark.parametrize("settings, key", [
    ({"name": "niah", "seq_len": 100}, "task.seq_len"),
    ({"name": "niah", "n_needles": 3}, "task.n_needles"),
    ({"name": "vartrack", "depths": [0.5]}, "task.depths"),
    ({"name": "babi", "babi_task": 3, "n_facts": 2}, "task.n_facts"),
    ({"name": "phonebook", "n_entries": 5000}, "task.n_entries"),
    ({"name": "niah", "haystack": "essays"}, "task.haystack"),
    ({"name": "a5"}, "task.name"),
    ({"name": "niah", "n_needle": 2}, "task.n_needle"),
])
def test_bad_settings_name_the_key(settings, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        tasks.example(settings, 1, 0, 0)
