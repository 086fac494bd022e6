"""The C++ engine's Hugging Face export (`pathattn export-hf`) loaded by pathattn.models: the committed fixture
tests/data/hf_interop (a tiny PaTH-FoX GQA model the engine exported, and the engine's fp32 logits on fixed
tokens; tests/cpp/test_engine_hf.cpp keeps it in step with the engine) loads strictly and gives the engine's
logits."""
import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pathattn.models import PaTHForCausalLM  # noqa: E402
from conftest import rel_l2  # noqa: E402

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "hf_interop"


def test_engine_export_loads_and_gives_the_engines_logits():
    if not (FIXTURE / "config.json").exists():
        pytest.skip("tests/data/hf_interop is not here (the tests run outside the source tree)")
    model, info = PaTHForCausalLM.from_pretrained(FIXTURE, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    cfg = model.config
    assert (cfg.use_forget_gate, cfg.num_kv_heads, cfg.intermediate_size, cfg.tie_word_embeddings) == (True, 1, 24, False)
    ref = json.loads((FIXTURE / "logits.json").read_text())
    ids = torch.tensor([ref["tokens"]])
    with torch.no_grad():
        got = model.eval()(ids, use_cache=False).logits[0].double().numpy()
    want = np.asarray(ref["logits"], dtype=np.float64).reshape(got.shape)
    # Both sides fp32 with the same weights; measured 2.2e-7 (different GEMM and reduction orders).
    assert rel_l2(got, want) <= 2e-6
