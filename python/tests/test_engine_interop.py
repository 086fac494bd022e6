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
    assert cfg.use_forget_gate and cfg.num_kv_heads == 1 and cfg.intermediate_size == 24
    assert not cfg.tie_word_embeddings
    ref = json.loads((FIXTURE / "logits.json").read_text())
    ids = torch.tensor([ref["tokens"]])
    with torch.no_grad():
        got = model.eval()(ids, use_cache=False).logits[0].double().numpy()
    want = np.asarray(ref["logits"], dtype=np.float64).reshape(got.shape)
    # Both sides fp32 with the same weights; measured 2.2e-7 (different GEMM and reduction orders).
    assert rel_l2(got, want) <= 2e-6


def test_pathattn_models_checkpoint_through_the_engine(tmp_path):
    """A checkpoint written by transformers' save_pretrained (no engine checksum; bf16 too) through
    `pathattn import-hf` then `export-hf` comes back with the same weights. Needs the `pathattn` program:
    set PATHATTN_CLI to its path (the C++ build's apps/pathattn)."""
    import os
    import subprocess

    cli = os.environ.get("PATHATTN_CLI")
    if not cli:
        pytest.skip("set PATHATTN_CLI to the pathattn program to run the engine side")
    from pathattn.models import PaTHConfig

    torch.manual_seed(0)
    cfg = PaTHConfig(hidden_size=32, num_hidden_layers=2, num_heads=4, num_kv_heads=2, use_forget_gate=True,
                     use_low_rank_w=False, intermediate_size=48, vocab_size=20, tie_word_embeddings=True)
    for dtype in (torch.float32, torch.bfloat16):
        model = PaTHForCausalLM(cfg).to(dtype)
        src, back = tmp_path / f"src_{dtype}", tmp_path / f"back_{dtype}"
        model.save_pretrained(src)
        ck = tmp_path / f"ck_{dtype}.safetensors"
        subprocess.run([cli, "import-hf", str(src), str(ck)], check=True, capture_output=True)
        subprocess.run([cli, "export-hf", str(ck), str(back)], check=True, capture_output=True)
        again = PaTHForCausalLM.from_pretrained(back)
        for k, v in model.state_dict().items():
            assert torch.equal(again.state_dict()[k], v.float()), k
