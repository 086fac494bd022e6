"""The benchmark scripts that run on a CPU too: bench/decode_bench.py's smoke run (its paged cache column too), and
bench/engine_bench.py's reading of Nsight Compute's per-launch CSV (its --kernels table), on a made-up file in ncu's
format."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_bench_cpu_smoke(tmp_path):
    out = tmp_path / "decode.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(_BENCH / "decode_bench.py"), "--device", "cpu", "--tiny", "--rounds", "2",
                        "--steps", "2", "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = out.read_text().splitlines()
    header = [c.strip() for c in next(x for x in lines if x.startswith("| requests x context |")).strip("|").split("|")]
    assert "paged us" in header and "paged graph us" not in header  # the paged cache's column; no graphs on a CPU
    rows = [x for x in lines if x.startswith("| 1 x 256 |") or x.startswith("| 2 x 128 |")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(header)
        assert float(cells[1]) > 0 and float(cells[2]) > 0  # both sides timed
        assert float(cells[header.index("paged us")]) > 0 and float(cells[header.index("paged GB/s")]) >= 0


def test_decode_bench_rejects_bad_shapes():
    r = subprocess.run([sys.executable, str(_BENCH / "decode_bench.py"), "--device", "cpu", "--shapes", "4x",
                        "--out", ""], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--shapes" in r.stderr


_NCU = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","pathattn","h","void pathattn::engine::gpu::adamw_kernel(float *, const float *, long)","1","7","(256, 1, 1)","(40, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","2,336"
"1","1","pathattn","h","void pathattn::cuda::(anonymous namespace)::fwd_scan_kernel<__nv_bfloat16, 64, 64, 1, false>(pathattn::cuda::KernelParams, const int *)","1","7","(128, 1, 1)","(9, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","12.50"
"2","1","pathattn","h","void pathattn::engine::gpu::sumsq_final_kernel(const double *, double *)","1","7","(256, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,500"
"3","1","pathattn","h","void pathattn::engine::gpu::adamw_kernel(float *, const float *, long)","1","7","(256, 1, 1)","(40, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,664"
"4","1","pathattn","h","void pathattn::engine::gpu::sumsq_final_kernel(const double *, double *)","1","7","(256, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,500"
'''


def test_engine_bench_reads_ncu_launches():
    eb = _load("engine_bench")
    kernels, steps = eb.ncu_kernel_times(_NCU)
    assert steps == 2
    by_name = {k: (n, us) for k, n, us in kernels}
    assert by_name["pathattn::engine::gpu::adamw_kernel"] == (2, pytest.approx(4.0))
    assert by_name["pathattn::cuda::fwd_scan_kernel<__nv_bfloat16, 64, 64, 1, false>"] == (1, pytest.approx(12.5))
    assert kernels[0][0].startswith("pathattn::cuda::fwd_scan_kernel")  # largest first
    table = "\n".join(eb.kernel_table("a5", kernels, steps, 0.001))
    assert "2 steps in the window" in table and "kernels 10 us a step against 1,000 us" in table
