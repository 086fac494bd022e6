"""dev/cuda/ab_interleaved.py: forward+backward times of several builds of the C ABI library in one process, the
builds taking turns round by round on the same inputs (bench/gpu_bench.py's bench_rounds), so that a drift of the
GPU's speed over the run (clocks, other work on the machine) falls on every build alike. Prints each build's median
over the rounds of its per-round medians and, per round, its time over the first build's (median, lowest and
highest of those ratios).
    python3 dev/cuda/ab_interleaved.py --libs a/libpathattn_capi.so b/libpathattn_capi.so --shapes 128:8192 128:4096
A tuning switch is an A/B between builds: the library reads no switch at run time, so configure a second build
directory with the switch (src/cuda/heuristics.h) and pass both libraries:
    cmake -S . -B build-b -G Ninja -DPATHATTN_CUDA=ON -DPATHATTN_BUILD_APPS=OFF -DPATHATTN_BUILD_TESTS=OFF \
      -DPATHATTN_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" -DPATHATTN_CUDA_DEFINES="-DPATHATTN_CUDA_BWD_OUT_WS=1"
    cmake --build build-b --target pathattn_capi
    --libs build-cuda/libpathattn_capi.so build-b/libpathattn_capi.so
"""
import argparse
import os
import statistics
import sys

import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import gpu_bench as gb  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--libs", nargs="+", required=True)
    ap.add_argument("--shapes", nargs="+", default=["128:8192", "128:4096", "64:4096"],
                    help="K:T, B * T = 32768; K:T:g with the forget gate")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--runs", type=int, default=4, help="timed runs of each build a round")
    ap.add_argument("--params", choices=["fp32", "bf16"], default="fp32",
                    help="dtype of w, beta, g (and their gradients); bf16 adds a case: the first build with them cast "
                         "to fp32 first and the gradients cast back, as autograd would")
    a = ap.parse_args()
    libs, names = [], []
    for path in a.libs:  # each in its own ctypes handle (RTLD_LOCAL): the builds' symbols do not meet
        gb.load_lib(path)
        libs.append(gb.LIB)
        names.append(os.path.basename(os.path.dirname(os.path.abspath(path))) or path)
    for shape in a.shapes:
        K, T = (int(x) for x in shape.split(":")[:2])
        gate = shape.endswith(":g")
        HQ = 2048 // K
        B = max(1, 32768 // T)
        q, k, v, w, beta, g, do = gb.make_inputs(B, T, HQ, HQ, K, K, gate, seed=T + K)
        if a.params == "bf16":
            w, beta, g = (None if x is None else x.bfloat16() for x in (w, beta, g))
        o, lse, dq, dk, dv, dw, dbeta, dg = gb.make_outputs(q, k, v, w, beta, g)

        def case(i):
            def fb():
                gb.LIB = libs[i]
                gb.ours_fwd(q, k, v, w, beta, g, o, lse)
                gb.ours_bwd(q, k, v, w, beta, g, o, lse, do, dq, dk, dv, dw, dbeta, dg)
            return fb, None

        def cast_first():
            def fb():
                gb.LIB = libs[0]
                w32, b32, g32 = (None if x is None else x.float() for x in (w, beta, g))
                o2, lse2, dq2, dk2, dv2, dw2, db2, dg2 = gb.make_outputs(q, k, v, w32, b32, g32)
                gb.ours_fwd(q, k, v, w32, b32, g32, o, lse)
                gb.ours_bwd(q, k, v, w32, b32, g32, o, lse, do, dq, dk, dv, dw2, db2, dg2)
                for x, x2 in ((dw, dw2), (dbeta, db2), (dg, dg2)):
                    if x is not None:
                        x.copy_(x2)
            return fb, None
        cases = {i: case(i) for i in range(len(libs))}
        labels = list(names)
        if a.params == "bf16":
            cases[len(libs)] = cast_first()
            labels.append(names[0] + " (cast first)")
        rounds = gb.bench_rounds(cases, a.rounds, a.runs, warmup_ms=10)
        times = [[statistics.median(rnd) for rnd in rounds[i]] for i in range(len(cases))]
        print(f"K {K} T {T}{' gate' if gate else ''}{' bf16 w/beta/g' if a.params == 'bf16' else ''} "
              f"({a.rounds} rounds)")
        for i, name in enumerate(labels):
            ratios = [t / t0 for t, t0 in zip(times[i], times[0])]
            print(f"  {name:36s} median {statistics.median(times[i]):7.3f} ms (min {min(times[i]):7.3f}, max "
                  f"{max(times[i]):7.3f}) | / {names[0]}: median {statistics.median(ratios):.4f} "
                  f"[{min(ratios):.4f}, {max(ratios):.4f}]", flush=True)
        del q, k, v, w, beta, g, do, o, lse, dq, dk, dv, dw, dbeta, dg
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
