"""The per-kernel FLOP model of the benchmark (bench/kernel_flops.py, pure Python): its self-test against
independent counts, and its errors on shapes it does not model."""
import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "kernel_flops.py"
_spec = importlib.util.spec_from_file_location("kernel_flops", _PATH)
kernel_flops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_flops)


def test_selftest():
    assert kernel_flops.selftest()


@pytest.mark.parametrize("kwargs, name", [(dict(T=1000), "T"), (dict(K=96, V=96), "K"), (dict(HQ=6), "HQ"),
                                          (dict(B=0), "B")])
def test_bad_shape_names_the_argument(kwargs, name):
    shape = dict(B=1, T=1024, H=4, HQ=4, K=64, V=64) | kwargs
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        kernel_flops.kernel_flops(**shape)
