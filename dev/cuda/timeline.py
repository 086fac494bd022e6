"""dev/cuda/timeline.py: where the GPU is idle during one forward+backward of a benchmark shape (docs/benchmarks.md).

Runs the shape through pathattn's C ABI under torch.profiler (CUDA activity: every kernel, memset and copy on
the device, with start and end), then prints the call's span, the time some activity was running, the idle
gaps summed by what ran before them, the largest gaps, and the host time of the enqueuing calls. A sliced
call (workspace limit) that takes longer than its kernels add up to shows here where the rest went:
    python3 dev/cuda/timeline.py --lib build-cuda/libpathattn_capi.so --K 128 --T 16384 [--ws-limit-mib N]
"""
import argparse
import collections
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import gpu_bench as gb  # noqa: E402


def short(name):
    name = name.replace("(anonymous namespace)", "").split("(")[0].split("<")[0]
    return name.split("::")[-1].strip()[:40]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build-cuda/libpathattn_capi.so")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--ws-limit-mib", type=int, default=0)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    gb.load_lib(a.lib)
    gb.set_workspace_limit(a.ws_limit_mib * 2**20)
    K, T = a.K, a.T
    HQ = H = 2048 // K
    B = max(1, a.tokens // T)
    q, k, v, w, beta, g, do = gb.make_inputs(B, T, HQ, H, K, K, False, seed=T + K)
    o, lse, dq, dk, dv, dw, dbeta, _ = gb.make_outputs(q, k, v, w, beta, None)

    def fb():
        gb.ours_fwd(q, k, v, w, beta, None, o, lse)
        gb.ours_bwd(q, k, v, w, beta, None, o, lse, do, dq, dk, dv, dw, dbeta, None)

    for _ in range(3):
        fb()
    torch.cuda.synchronize()
    n = 5
    t0 = time.perf_counter()
    for _ in range(n):
        fb()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"K {K} T {T} limit {a.ws_limit_mib} MiB: host enqueue {1e3 * (t1 - t0) / n:.2f} ms a call, "
          f"wall {1e3 * (t2 - t0) / n:.2f} ms a call (no sync between calls)")
    hf = hb = 0.0
    for _ in range(n):  # the host's share of each half, with the device idle at the start of each
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gb.ours_fwd(q, k, v, w, beta, None, o, lse)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        gb.ours_bwd(q, k, v, w, beta, None, o, lse, do, dq, dk, dv, dw, dbeta, None)
        t3 = time.perf_counter()
        hf, hb = hf + t1 - t0, hb + t3 - t2
    torch.cuda.synchronize()
    med = do_bench(fb, warmup=25, rep=100, return_mode="median")
    print(f"host enqueue: forward {1e3 * hf / n:.2f} ms, backward {1e3 * hb / n:.2f} ms; do_bench median "
          f"{med:.2f} ms a call")

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fb()
        torch.cuda.synchronize()
    ev = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ev.append((e.time_range.start, e.time_range.end, short(e.name)))
    ev.sort()
    if not ev:
        print("no device events recorded")
        return
    span = ev[-1][1] - ev[0][0]
    busy, cur_s, cur_e = 0.0, ev[0][0], ev[0][1]
    gaps = []
    by_name = collections.defaultdict(float)
    gap_after = collections.defaultdict(float)
    last = ev[0][2]
    for s, e, name in ev:
        by_name[name] += e - s
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, last, name))
            gap_after[last] += s - cur_e
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
        if e >= cur_e:
            last = name
    busy += cur_e - cur_s
    print(f"device span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms "
          f"in {len(gaps)} gaps; {len(ev)} activities")
    # Time with at least two activities running at once (a sliced call's two streams overlapping).
    edges = sorted([(s, 1) for s, _, _ in ev] + [(e, -1) for _, e, _ in ev])
    depth, prev, two = 0, edges[0][0], 0.0
    for t, d in edges:
        if depth >= 2:
            two += t - prev
        depth, prev = depth + d, t
    print(f"two or more activities at once {two / 1e3:.2f} ms of the busy time")
    print("time by activity (ms, count):")
    counts = collections.Counter(name for _, _, name in ev)
    for name, t in sorted(by_name.items(), key=lambda x: -x[1]):
        print(f"  {name:40s} {t / 1e3:8.3f}  x{counts[name]}")
    print("idle by what ran before (ms):")
    for name, t in sorted(gap_after.items(), key=lambda x: -x[1])[:a.top]:
        print(f"  after {name:40s} {t / 1e3:8.3f}")
    print("largest gaps (us: before -> after):")
    for d, before, after in sorted(gaps, reverse=True)[:a.top]:
        print(f"  {d:9.1f}  {before} -> {after}")


if __name__ == "__main__":
    main()
