#!/usr/bin/env python3
"""Writes tests/data/longctx_examples.json: reference examples of the long-context text tasks, printed by the
engine (`pathattn tasks show --json`): "examples", one whole example per case, and "hashes", the FNV-1a
64-bit hash of the bytes (prompt + answer + padding) of test examples 0..HASHED-1 of each case.
test_engine_longctx checks the engine still produces them and python/tests/test_tasks.py checks the Python
port against them.

Usage: python3 scripts/make_longctx_examples.py build/apps/pathattn > tests/data/longctx_examples.json
"""
import json
import subprocess
import sys

# (task settings, training step or None for a test example, index or batch row)
CASES = [
    ({"name": "niah", "seq_len": 300}, None, 0),
    ({"name": "niah", "seq_len": 700, "haystack": "text"}, None, 1),
    ({"name": "niah", "seq_len": 900, "niah_variant": "multikey"}, None, 2),
    ({"name": "niah", "seq_len": 900, "niah_variant": "multikey", "n_needles": 6, "haystack": "text",
      "depths": [0.0, 0.3, 1.0]}, None, 3),
    ({"name": "niah", "seq_len": 800, "niah_variant": "multivalue", "haystack": "text"}, None, 4),
    ({"name": "niah", "seq_len": 800, "niah_variant": "multiquery", "n_needles": 3}, 12, 5),
    ({"name": "niah", "seq_len": 4000, "depths": [0.5], "haystack": "text", "data_seed": 99}, None, 6),
    ({"name": "vartrack", "seq_len": 500}, None, 0),
    ({"name": "vartrack", "seq_len": 1200, "n_chains": 3, "n_hops": 5, "haystack": "text"}, 3, 1),
    ({"name": "vartrack", "seq_len": 400, "n_chains": 1, "n_hops": 1}, None, 7),
    ({"name": "phonebook", "seq_len": 300}, None, 0),
    ({"name": "phonebook", "seq_len": 600, "n_entries": 7}, 5, 2),
    ({"name": "babi", "seq_len": 700}, None, 0),
    ({"name": "babi", "seq_len": 900, "babi_task": 2, "haystack": "text"}, None, 1),
    ({"name": "babi", "seq_len": 1500, "babi_task": 3, "n_facts": 25}, 8, 3),
    ({"name": "babi", "seq_len": 2000, "babi_task": 3, "n_facts": 3, "haystack": "text"}, None, 4),
]


HASHED = 30


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) & ((1 << 64) - 1)
    return h


def show(binary, settings, step, index):
    cmd = [binary, "tasks", "show", settings["name"], "--json"]
    for k, v in settings.items():
        if k != "name":
            cmd += ["--set", f"task.{k}={json.dumps(v)}"]
    cmd += ["--step", str(step), "--row", str(index)] if step is not None else ["--index", str(index)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    examples, hashes = [], []
    for settings, step, index in CASES:
        ex = show(sys.argv[1], settings, step, index)
        examples.append({"settings": settings, "seed": ex["seed"], "a": ex["a"], "b": ex["b"],
                         "prompt": ex["prompt"], "answer": ex["answer"], "pad": ex["pad"]})
        fnv = []
        for i in range(HASHED):
            e = show(sys.argv[1], settings, None, i)
            fnv.append("%016x" % fnv1a64((e["prompt"] + e["answer"]).encode("ascii") + bytes(e["pad"])))
        hashes.append({"settings": settings, "seed": e["seed"], "a": e["a"], "fnv1a64": fnv})
    json.dump({"examples": examples, "hashes": hashes}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
