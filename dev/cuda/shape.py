"""dev/cuda/shape.py: one benchmark shape (docs/benchmarks.md) through pathattn's CUDA backend, self-checking
and self-timing.

Checks the bf16 output of the current build against an fp64 brute-force reference on the first sequence's
first `--check-rows` query rows of one head, then times forward and forward+backward (median of triton's
do_bench) and prints the per-kernel split (PATHATTN_CUDA_PROFILE). Meant for kernel work and for profilers:
    python3 dev/cuda/shape.py --lib build-cuda/libpathattn_capi.so --K 128 --T 4096
    ncu -k regex:bwd_chunk --launch-count 1 python3 dev/cuda/shape.py --no-time ...
"""
import argparse
import ctypes
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import gpu_bench as gb  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build-cuda/libpathattn_capi.so")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32768, help="B * T")
    ap.add_argument("--HQ", type=int, default=0, help="query heads (0: 2048 / K, as docs/benchmarks.md)")
    ap.add_argument("--H", type=int, default=0, help="kv heads (0: HQ; fewer for GQA)")
    ap.add_argument("--gate", action="store_true")
    ap.add_argument("--deterministic", action="store_true", help="the backward in deterministic mode")
    ap.add_argument("--check-rows", type=int, default=1024)
    ap.add_argument("--no-time", action="store_true", help="one forward and one backward only (profilers)")
    ap.add_argument("--stall-check", action="store_true",
                    help="host time of a small forward queued right after this shape's forward+backward, no sync "
                         "in between: near the long call's GPU time means a call's uploads wait for the stream")
    ap.add_argument("--ws-limit-mib", type=int, default=0,
                    help="the calls' workspace limit in MiB (0: the library's default, -1: none)")
    ap.add_argument("--dump", default="", help="save o, lse and the gradients of the first call to this file")
    ap.add_argument("--compare", default="",
                    help="a --dump file of another build on the same shape: print which tensors differ and by how "
                         "much (bitwise comparisons need --deterministic on both)")
    a = ap.parse_args()
    gb.load_lib(a.lib)
    gb.set_workspace_limit(a.ws_limit_mib * 2**20)
    gb.LIB.pathattn_cuda_pool_high_water.restype = ctypes.c_int64
    K, T = a.K, a.T
    HQ = a.HQ or 2048 // K
    H = a.H or HQ
    B = max(1, a.tokens // T)
    q, k, v, w, beta, g, do = gb.make_inputs(B, T, HQ, H, K, K, a.gate, seed=T + K)
    o, lse, dq, dk, dv, dw, dbeta, dg = gb.make_outputs(q, k, v, w, beta, g)
    gb.LIB.pathattn_cuda_pool_high_water(1)
    gb.ours_fwd(q, k, v, w, beta, g, o, lse)
    gb.ours_bwd(q, k, v, w, beta, g, o, lse, do, dq, dk, dv, dw, dbeta, dg, a.deterministic)
    torch.cuda.synchronize()
    print(f"workspace high-water {gb.LIB.pathattn_cuda_pool_high_water(0) / 2**20:.0f} MiB "
          f"(limit {'default' if a.ws_limit_mib == 0 else a.ws_limit_mib})", flush=True)
    outs = dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv, dw=dw, dbeta=dbeta, dg=dg)
    if a.dump:
        torch.save({n: x.cpu() for n, x in outs.items() if x is not None}, a.dump)
    if a.compare:
        other = torch.load(a.compare)
        for n, x in outs.items():
            if x is None or n not in other:
                continue
            x, y = x.cpu().contiguous(), other[n].contiguous()
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            x, y = x.float(), y.float()
            diff = (x - y).abs().max().item()
            rel = ((x - y).norm() / y.norm().clamp_min(1e-30)).item()
            print(f"[compare] {n}: {'bitwise equal' if same else 'differs'} (max abs {diff:.3e}, rel L2 {rel:.2e})",
                  flush=True)
    if a.no_time:
        return
    if a.stall_check:
        stall_check(gb, q, k, v, w, beta, g, o, lse, do, dq, dk, dv, dw, dbeta, dg)
    n = min(a.check_rows, T)
    sl = lambda x: None if x is None else x[:1, :n, :1].contiguous()  # noqa: E731
    ref = gb.ref_fp64(sl(q), sl(k), sl(v), sl(w), sl(beta), sl(g))
    err = gb.rel(o[:1, :n, :1], ref)
    print(f"K {K} T {T} B {B} HQ {HQ} H {H}: o rel L2 vs fp64 (first {n} rows, head 0) {err:.2e}", flush=True)
    tf = do_bench(lambda: gb.ours_fwd(q, k, v, w, beta, g, o, lse), warmup=25, rep=100, return_mode="median")

    def fb():
        gb.ours_fwd(q, k, v, w, beta, g, o, lse)
        gb.ours_bwd(q, k, v, w, beta, g, o, lse, do, dq, dk, dv, dw, dbeta, dg, a.deterministic)
    tfb = do_bench(fb, warmup=25, rep=100, return_mode="median")
    print(f"fwd {tf:.3f} ms  fwd+bwd {tfb:.3f} ms", flush=True)
    os.environ["PATHATTN_CUDA_PROFILE"] = "1"
    fb()
    torch.cuda.synchronize()


def stall_check(gb, q, k, v, w, beta, g, o, lse, do, dq, dk, dv, dw, dbeta, dg):
    """Host seconds of a B = 1, T = 64 forward queued behind this shape's forward+backward."""
    import time
    sm = [x[:1, :64].contiguous() if x is not None else None for x in (q, k, v, w, beta, g)]
    so = torch.empty_like(sm[0][..., :v.shape[-1]])
    slse = torch.empty(1, 64, q.shape[2], device="cuda", dtype=torch.float32)
    gb.ours_fwd(*sm, so, slse)
    torch.cuda.synchronize()
    for _ in range(3):
        t0 = time.perf_counter()
        gb.ours_fwd(q, k, v, w, beta, g, o, lse)
        gb.ours_bwd(q, k, v, w, beta, g, o, lse, do, dq, dk, dv, dw, dbeta, dg)
        t1 = time.perf_counter()
        gb.ours_fwd(*sm, so, slse)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        print(f"[stall] host: long f+b queued {1e3 * (t1 - t0):.2f} ms, small fwd queued {1e3 * (t2 - t1):.2f} ms, "
              f"sync {1e3 * (t3 - t2):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
