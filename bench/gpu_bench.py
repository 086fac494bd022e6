"""bench/gpu_bench.py: the training-op benchmark of docs/benchmarks.md on one GPU, in one process on the same inputs:
pathattn's CUDA backend (through the C ABI library libpathattn_capi.so, loaded with ctypes), torch SDPA with
the cuDNN and the flash backends, and flash-linear-attention's parallel_path_attn (Triton, fla-core wheel).
Also: bf16 accuracy of ours and of FLA against an fp64 brute-force reference, and peak memory of fwd+bwd.
Writes a markdown table (--out) and prints it. Benchmarks never gate anything.
"""
import argparse
import ctypes
import datetime
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import kernel_flops

LIB = None


def load_lib(path):
    global LIB
    LIB = ctypes.CDLL(path)
    f = LIB.pathattn_cuda_fwd
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6 + [ctypes.c_int, ctypes.c_double, ctypes.c_double,
                                                                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                                  ctypes.c_char_p, ctypes.c_int]
    b = LIB.pathattn_cuda_bwd
    b.restype = ctypes.c_int
    b.argtypes = [ctypes.c_void_p] * 15 + [ctypes.c_int64] * 6 + [ctypes.c_int, ctypes.c_double, ctypes.c_double,
                                                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                                                   ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]


def ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def set_workspace_limit(nbytes):
    """The workspace limit of the following calls (0: the library's default; -1: none)."""
    LIB.pathattn_cuda_set_workspace_limit(ctypes.c_int64(nbytes))


def dtype_code(q, w, beta, g):
    """The C ABI's dtype argument: q's type in bits 0-1, then w, beta, g two bits each (0 fp32, 1 bf16, 2 fp16)."""
    def pc(t):
        return 0 if t is None or t.dtype == torch.float32 else 1 if t.dtype == torch.bfloat16 else 2
    return (0 if q.dtype == torch.float16 else 1) | pc(w) << 2 | pc(beta) << 4 | pc(g) << 6


def ours_fwd(q, k, v, w, beta, g, o, lse):
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[3]
    err = ctypes.create_string_buffer(512)
    rc = LIB.pathattn_cuda_fwd(ptr(q), ptr(k), ptr(v), ptr(w), ptr(beta), ptr(g), ptr(o), ptr(lse), B, T, HQ, H, K, V,
                               dtype_code(q, w, beta, g), math.nan, math.nan, None, 0,
                               ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), err, 512)
    if rc != 0:
        raise RuntimeError(err.value.decode())


def ours_bwd(q, k, v, w, beta, g, o, lse, do, dq, dk, dv, dw, dbeta, dg, deterministic=False):
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[3]
    err = ctypes.create_string_buffer(512)
    rc = LIB.pathattn_cuda_bwd(ptr(q), ptr(k), ptr(v), ptr(w), ptr(beta), ptr(g), ptr(o), ptr(lse), ptr(do), ptr(dq),
                               ptr(dk), ptr(dv), ptr(dw), ptr(dbeta), ptr(dg), B, T, HQ, H, K, V,
                               dtype_code(q, w, beta, g), math.nan, math.nan, None, 0,
                               1 if deterministic else 0, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                               err, 512)
    if rc != 0:
        raise RuntimeError(err.value.decode())


def make_inputs(B, T, HQ, H, K, V, gate, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, HQ, K, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(B, T, H, K, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(B, T, H, V, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(B, T, H, K, device="cuda", dtype=torch.float32, generator=gen)
    w = w / w.norm(dim=-1, keepdim=True)
    beta = 2 * torch.rand(B, T, H, device="cuda", dtype=torch.float32, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HQ, device="cuda", dtype=torch.float32, generator=gen) + 3) if gate else None
    do = torch.randn(B, T, HQ, V, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, w, beta, g, do


def make_outputs(q, k, v, w, beta, g):
    """Empty tensors for our op's outputs: o, lse, then the gradients dq, dk, dv, dw, dbeta, dg (None without g)."""
    B, T, HQ, _ = q.shape
    o = torch.empty(B, T, HQ, v.shape[3], device="cuda", dtype=q.dtype)
    lse = torch.empty(B, T, HQ, device="cuda", dtype=torch.float32)
    grads = [torch.empty_like(x) for x in (q, k, v, w, beta)]
    return (o, lse, *grads, torch.empty_like(g) if g is not None else None)


def ref_fp64(q, k, v, w, beta, g, do=None, scale=None):
    """o of PaTH in fp64 by brute force (docs/spec.md): the queries are moved one Householder step at a time, each step
    making the moved rows anew (out of place) so that autograd can walk it. With do: (o, [dq, dk, dv, dw, dbeta,
    dg]) by autograd (dg None without g); else o alone, without the graph."""
    B, T, HQ, K = q.shape
    H = k.shape[2]
    G = HQ // H
    scale = scale if scale is not None else K ** -0.5
    with torch.set_grad_enabled(do is not None):
        leaves = [x.detach().double().requires_grad_(do is not None) for x in (q, k, v, w, beta)]
        gl = g.detach().double().requires_grad_(do is not None) if g is not None else None
        q64, k64, v64, w64, b64 = leaves
        qd = q64.transpose(1, 2)
        kd, vd, wd = (x.repeat_interleave(G, dim=2).transpose(1, 2) for x in (k64, v64, w64))
        bd = b64.repeat_interleave(G, dim=2).transpose(1, 2)
        cols = []
        moved = None  # rows j + 1 .. T - 1 of the queries, moved back to position j + 1
        for j in range(T - 1, -1, -1):
            tail = qd[:, :, j:j + 1, :] if moved is None else torch.cat([qd[:, :, j:j + 1, :], moved], dim=2)
            col = (tail * kd[:, :, j, None, :]).sum(-1)  # logits of rows j .. T - 1 against key j
            cols.append(F.pad(col, (j, 0), value=float("-inf")))
            if j > 0:
                c = (tail * wd[:, :, j, None, :]).sum(-1, keepdim=True) * bd[:, :, j, None, None]
                moved = tail - c * wd[:, :, j, None, :]
        logits = torch.stack(cols[::-1], dim=-1)  # [B, HQ, T (query), T (key)]
        s = logits * scale
        if gl is not None:
            Gc = gl.transpose(1, 2).cumsum(-1)
            s = s + scale * (Gc[..., :, None] - Gc[..., None, :])
        o = (torch.softmax(s, dim=-1) @ vd).transpose(1, 2)
    if do is None:
        return o
    o.backward(do.double())
    grads = [x.grad for x in leaves] + [gl.grad if gl is not None else None]
    return o.detach(), grads


def bench_rounds(cases, rounds, runs, warmup_ms=25, may_fail=()):
    """Times several callables side by side on one GPU. cases: {key: (fn, grad_to_none)}. Each case is first run
    for about warmup_ms (autotuning, allocator and pool growth fall there), then `rounds` rounds take the cases in
    turn, the order reversed every other round, each turn one triton do_bench of about `runs` timed runs
    (return_mode="all"; do_bench clears the L2 before each run), so that a drift of the GPU's speed over the
    measurement (clocks, temperature) falls on every case alike and no cell rests on one or two runs. A case in
    may_fail whose warm-up raises (a baseline that cannot run the shape) is left out; any other raises.
    Returns {key: [the timed runs' ms of round 0, of round 1, ...]} for the cases kept."""
    one = {}
    for key, (fn, gtn) in cases.items():
        try:
            one[key] = min(do_bench(fn, warmup=warmup_ms, rep=1, grad_to_none=gtn, return_mode="all"))
        except Exception as ex:  # noqa: BLE001
            if key not in may_fail:
                raise
            print(key, "failed:", ex)
    keys = list(one)
    out = {key: [] for key in keys}
    for r in range(rounds):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            fn, gtn = cases[key]
            # do_bench takes int(rep / its estimate) runs, its estimate including the L2 clear (~0.1 ms).
            out[key].append(do_bench(fn, warmup=0, rep=(runs + 0.5) * (one[key] + 0.1), grad_to_none=gtn,
                                     return_mode="all"))
    return out


def median_ms(rounds_of_runs):
    """(median over every timed run of every round, number of runs) of one case of bench_rounds."""
    runs = [t for rnd in rounds_of_runs for t in rnd]
    return statistics.median(runs), len(runs)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def shown_flags():
    """The command line's flags for the table header, without the machine-specific --lib / --out paths."""
    out, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a in ("--lib", "--out"):
            skip = True
        elif not a.startswith(("--lib=", "--out=")):
            out.append(a)
    return "".join(" " + a for a in out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build-cuda/libpathattn_capi.so")
    ap.add_argument("--out", default="results/bench/gpu_h200.md")
    ap.add_argument("--Ts", default="1024,2048,4096,8192,16384")
    ap.add_argument("--quick", action="store_true", help="MHA rows only (no GQA / FoX rows)")
    ap.add_argument("--extra-only", action="store_true",
                    help="GQA and PaTH-FoX rows only (no MHA rows, no accuracy or memory sections)")
    ap.add_argument("--rounds", type=int, default=4,
                    help="rounds of the speed measurement; the cases of a shape take turns in each (bench_rounds)")
    ap.add_argument("--runs", type=int, default=6, help="timed runs of each case a round")
    ap.add_argument("--profile", action="store_true", help="also print our per-kernel times (stderr) per shape")
    ap.add_argument("--ours-only", action="store_true", help="time only pathattn (development runs; no table)")
    ap.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=None,
                    help="our per-kernel time, FLOPs and rate at K = 128 and 64, T = 4096 (kernels_section; on by "
                         "default in the full run, i.e. without --quick / --extra-only)")
    ap.add_argument("--kernels-only", action="store_true", help="the per-kernel tables alone, printed (no --out file)")
    ap.add_argument("--gate", action="store_true", help="with --kernels-only: the shapes with the forget gate")
    ap.add_argument("--no-fla", action="store_true",
                    help="write the table without the public Triton kernel (its columns nan) where fla-core cannot "
                         "be imported; without this flag that is an error, since docs/benchmarks.md compares in the "
                         "same run")
    args = ap.parse_args()
    load_lib(args.lib)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.kernels_only:
        kernels_section([], gate=args.gate)
        return
    try:
        from fla.ops.path_attn import parallel_path_attn
    except Exception as e:  # noqa: BLE001
        print("fla import failed:", e)
        if not (args.no_fla or args.ours_only):
            print("error: fla-core (flash-linear-attention's parallel_path_attn) is not importable; install its "
                  "wheel (scripts/gpu_suite.sh takes it from .whl/) or pass --no-fla", file=sys.stderr)
            sys.exit(2)
        parallel_path_attn = None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lines = []
    dev = torch.cuda.get_device_name()
    commit = os.environ.get("PATHATTN_COMMIT", "?")
    lines.append(f"# PaTH training op on {dev}\n")
    lines.append(f"Date {datetime.date.today()}, commit {commit}, torch {torch.__version__}, "
                 f"fla-core {getattr(sys.modules.get('fla'), '__version__', '?')}. "
                 f"Command: `bench/gpu_bench.py{shown_flags()}` (scripts/gpu_suite.sh runs it). bf16, causal, B*T = 32768 tokens per call, "
                 f"each time the median of every timed run of triton do_bench over {args.rounds} rounds in which the "
                 f"cases of a shape take turns (bench_rounds). Ratios > 1 mean slower than the reference.\n")

    # ---- accuracy against fp64 (docs/benchmarks.md: ours must be no worse than FLA on the same inputs): o and every
    # gradient, relative L2 against fp64 brute force (autograd through the transport), ours / FLA.
    acc_cases = [] if args.extra_only else [(512, 64, False), (512, 64, True), (2048, 128, False), (2048, 128, True)]
    names = ["o", "dq", "dk", "dv", "dw", "dbeta", "dg"]
    if acc_cases:
        lines.append("## Accuracy (bf16, relative L2 against fp64 brute force; each cell ours / FLA)\n")
        lines.append("B = 1, HQ = H = 2, beta ~ U(0, 2), unit w, q, k, v, dO ~ N(0, 1); gradients from one backward "
                     "with that dO (FLA: torch autograd through parallel_path_attn).\n")
        lines.append("| T | K | gate | " + " | ".join(names) + " |")
        lines.append("|" + "---|" * (3 + len(names)))
    for T, K, gate in acc_cases:
        q, k, v, w, beta, g, do = make_inputs(1, T, 2, 2, K, K, gate, seed=T + K)
        ref_o, ref_g = ref_fp64(q, k, v, w, beta, g, do)
        o, lse, *ours_g = make_outputs(q, k, v, w, beta, g)
        ours_fwd(q, k, v, w, beta, g, o, lse)
        ours_bwd(q, k, v, w, beta, g, o, lse, do, *ours_g)
        torch.cuda.synchronize()
        e_ours = [rel(o, ref_o)] + [rel(a, b) if b is not None else None for a, b in zip(ours_g, ref_g)]
        e_fla = [float("nan")] * len(names)
        if parallel_path_attn is not None:
            try:
                xs = [x.detach().requires_grad_() for x in (q, k, v, w, beta)]
                gg = g.detach().requires_grad_() if g is not None else None
                of, _ = parallel_path_attn(*xs, g=gg)
                of.backward(do)
                fla_g = [x.grad for x in xs] + [gg.grad if gg is not None else None]
                e_fla = [rel(of, ref_o)] + [rel(a, b) if b is not None else None for a, b in zip(fla_g, ref_g)]
            except Exception as ex:  # noqa: BLE001
                print("FLA failed:", ex)
        cells = [f"{a:.2e} / {b:.2e}" if a is not None else "-" for a, b in zip(e_ours, e_fla)]
        lines.append(f"| {T} | {K} | {gate} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        del ref_o, ref_g
        torch.cuda.empty_cache()

    # ---- speed.
    lines.append("\n## Speed (ms; ratio = time / time of cuDNN or FLA)\n")
    lines.append("Ours at the library's default workspace limit (a call whose workspace would exceed the larger of "
                 "512 MiB and the bytes of q, k, v runs in slices of kv heads / batch rows); the last two columns "
                 "time the same call with no limit (workspace_limit = -1, one slice).\n")
    lines.append("| K | HQ:H | gate | T | cuDNN fwd | flash fwd | FLA fwd | ours fwd | cuDNN f+b | FLA f+b | ours f+b | "
                 "ours/cuDNN fwd | ours/FLA fwd | ours/cuDNN f+b | ours/FLA f+b | ours f+b, no limit | "
                 "no limit / FLA f+b |")
    lines.append("|" + "---|" * 17)
    Ts = [int(x) for x in args.Ts.split(",")]
    runs_seen = set()
    configs = [] if args.extra_only else [(128, 16, 16, False), (64, 32, 32, False)]
    if not args.quick:
        configs += [(128, 16, 4, False), (64, 32, 32, True)]
    for K, HQ, H, gate in configs:
        for T in Ts:
            B = 32768 // T
            q, k, v, w, beta, g, do = make_inputs(B, T, HQ, H, K, K, gate, seed=T)
            o, lse, dq, dk, dv, dw, dbeta, dg = make_outputs(q, k, v, w, beta, g)

            def f_ours():
                ours_fwd(q, k, v, w, beta, g, o, lse)

            def fb_ours():
                ours_fwd(q, k, v, w, beta, g, o, lse)
                ours_bwd(q, k, v, w, beta, g, o, lse, do, dq, dk, dv, dw, dbeta, dg)

            def fb_ours_nl():  # the same call in one slice
                set_workspace_limit(-1)
                try:
                    fb_ours()
                finally:
                    set_workspace_limit(0)

            cases = {"ours_f": (f_ours, None), "ours_fb": (fb_ours, None), "ours_fb_nl": (fb_ours_nl, None)}
            qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
            if HQ != H:
                ks = ks.repeat_interleave(HQ // H, dim=1)
                vs = vs.repeat_interleave(HQ // H, dim=1)
            qg, kg, vg = (x.detach().requires_grad_() for x in (qs, ks, vs))
            dos = do.transpose(1, 2)
            baselines = () if args.ours_only else (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))
            for name, be in baselines:
                def f_sdpa(be=be):
                    with sdpa_kernel(be):
                        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

                def fb_sdpa(be=be):
                    with sdpa_kernel(be):
                        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(dos)
                cases[name + "_f"] = (f_sdpa, None)
                cases[name + "_fb"] = (fb_sdpa, [qg, kg, vg])
            if parallel_path_attn is not None and not args.ours_only:
                fg = [x.detach().requires_grad_() for x in (q, k, v, w, beta)]
                gg = g.detach().requires_grad_() if g is not None else None

                def fbf():
                    out, _ = parallel_path_attn(*fg, g=gg)
                    out.backward(do)
                cases["fla_f"] = (lambda: parallel_path_attn(q, k, v, w, beta, g=g), None)
                cases["fla_fb"] = (fbf, [x for x in fg + [gg] if x is not None])
            baseline_keys = [key for key in cases if not key.startswith("ours")]
            medians = {key: median_ms(rt) for key, rt in
                       bench_rounds(cases, args.rounds, args.runs, may_fail=baseline_keys).items()}
            r = {key: ms for key, (ms, _) in medians.items()}
            runs_seen.update(n for _, n in medians.values())
            nan = float("nan")
            g_ = lambda key: r.get(key, nan)  # noqa: E731
            row = (f"| {K} | {HQ}:{H} | {gate} | {T} | {g_('cudnn_f'):.2f} | {g_('flash_f'):.2f} | {g_('fla_f'):.2f} | "
                   f"{g_('ours_f'):.2f} | {g_('cudnn_fb'):.2f} | {g_('fla_fb'):.2f} | {g_('ours_fb'):.2f} | "
                   f"{g_('ours_f') / g_('cudnn_f'):.2f} | {g_('ours_f') / g_('fla_f'):.2f} | "
                   f"{g_('ours_fb') / g_('cudnn_fb'):.2f} | {g_('ours_fb') / g_('fla_fb'):.2f} | "
                   f"{g_('ours_fb_nl'):.2f} | {g_('ours_fb_nl') / g_('fla_fb'):.2f} |")
            lines.append(row)
            print(row, flush=True)
            if args.profile:  # per kernel, one slice (no limit)
                set_workspace_limit(-1)
                os.environ["PATHATTN_CUDA_PROFILE"] = "1"
                fb_ours()
                torch.cuda.synchronize()
                del os.environ["PATHATTN_CUDA_PROFILE"]
                set_workspace_limit(0)
            del q, k, v, w, beta, g, do, o, lse, dq, dk, dv, dw, dbeta, dg
            torch.cuda.empty_cache()

    if runs_seen:
        lines.append(f"\nTimed runs behind each cell: {min(runs_seen)} .. {max(runs_seen)} ({args.rounds} rounds of "
                     f"about {args.runs}), after a warm-up of each case.")
    if args.kernels or (args.kernels is None and not (args.quick or args.extra_only)):
        kernels_section(lines)
    if not args.extra_only:
        deterministic_section(lines, [T for T in Ts if T in (1024, 16384)] or Ts[:1], args.rounds, args.runs)
        memory_section(lines, args.ours_only)
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write(text)
    print(text)


def kernels_section(lines, T=4096, gate=False):
    """Our per-kernel table (kernel_flops.table) for one MHA shape per head size, B * T = 32768, bf16: one forward
    and one forward+backward under torch.profiler after a warm-up, in one slice (workspace limit off), beside the
    FLOPs bench/kernel_flops.py counts for each kernel."""
    lines.append("\n## Per kernel (ours): time, FLOPs and rate\n")
    lines.append(kernel_flops.COUNTS_NOTE)
    print(lines[-1], flush=True)
    for K in (128, 64):
        HQ = H = 2048 // K
        B = 32768 // T
        q, k, v, w, beta, g, do = make_inputs(B, T, HQ, H, K, K, gate, seed=T + K)
        o, lse, dq, dk, dv, dw, dbeta, dg = make_outputs(q, k, v, w, beta, g)

        def f():
            ours_fwd(q, k, v, w, beta, g, o, lse)

        def fb():
            f()
            ours_bwd(q, k, v, w, beta, g, o, lse, do, dq, dk, dv, dw, dbeta, dg)

        set_workspace_limit(-1)
        try:
            for _ in range(3):
                fb()
            for what, fn, bwd in (("forward", f, False), ("forward+backward", fb, True)):
                rows = kernel_flops.table(f"K = V = {K}, HQ = H = {H}, T = {T}, B = {B}{', gate' if gate else ''}: "
                                          f"{what}", kernel_flops.profile_call(fn),
                                          kernel_flops.kernel_flops(B, T, H, HQ, K, K, gate=gate, backward=bwd),
                                          kernel_flops.attention_flops(B, T, HQ, K, backward=bwd))
                lines.extend(rows)
                print("\n".join(rows), flush=True)
        finally:
            set_workspace_limit(0)
        del q, k, v, w, beta, g, do, o, lse, dq, dk, dv, dw, dbeta, dg
        torch.cuda.empty_cache()


def deterministic_section(lines, Ts, rounds, runs):
    """Forward+backward time of the deterministic backward against the default one (the MHA shapes)."""
    lines.append("\n## Deterministic mode (forward+backward ms at the default workspace limit)\n")
    lines.append("| K | T | default | deterministic | ratio |")
    lines.append("|---|---|---|---|---|")
    for K, HQ in ((128, 16), (64, 32)):
        for T in Ts:
            B = 32768 // T
            q, k, v, w, beta, g, do = make_inputs(B, T, HQ, HQ, K, K, False, seed=T + 1)
            o, lse, dq, dk, dv, dw, dbeta, _ = make_outputs(q, k, v, w, beta, None)
            cases = {}
            for det in (False, True):
                def fb(det=det):
                    ours_fwd(q, k, v, w, beta, None, o, lse)
                    ours_bwd(q, k, v, w, beta, None, o, lse, do, dq, dk, dv, dw, dbeta, None, deterministic=det)
                cases[det] = (fb, None)
            t = {det: median_ms(rt)[0] for det, rt in bench_rounds(cases, rounds, runs).items()}
            row = f"| {K} | {T} | {t[False]:.2f} | {t[True]:.2f} | {t[True] / t[False]:.2f} |"
            lines.append(row)
            print(row, flush=True)
            del q, k, v, w, beta, g, do, o, lse, dq, dk, dv, dw, dbeta
            torch.cuda.empty_cache()


def memory_section(lines, ours_only):
    """Peak memory of forward + backward, extra over the inputs (docs/benchmarks.md, the memory shape)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lines.append("\n## Peak memory of forward+backward, extra over the inputs (B=4, T=16384, HQ=H=24, K=V=64, bf16)\n")
    lines.append("| op | GiB |")
    lines.append("|---|---|")
    B, T, HQ, H, K = 4, 16384, 24, 24, 64
    q, k, v, w, beta, g, do = make_inputs(B, T, HQ, H, K, K, False, seed=1)

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30

    def mem_ours():
        o = torch.empty(B, T, HQ, K, device="cuda", dtype=q.dtype)
        lse = torch.empty(B, T, HQ, device="cuda", dtype=torch.float32)
        ours_fwd(q, k, v, w, beta, None, o, lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dw, dbeta = torch.empty_like(w), torch.empty_like(beta)
        ours_bwd(q, k, v, w, beta, None, o, lse, do, dq, dk, dv, dw, dbeta, None)

    def mem_cudnn():
        qg, kg, vg = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            out.backward(do.transpose(1, 2))

    def mem_fla():
        from fla.ops.path_attn import parallel_path_attn
        qg, kg, vg, wg, bg = (x.detach().requires_grad_() for x in (q, k, v, w, beta))
        out, _ = parallel_path_attn(qg, kg, vg, wg, bg)
        out.backward(do)

    mems = (("cuDNN SDPA", mem_cudnn), ("FLA parallel_path_attn", mem_fla), ("ours (torch-allocated outputs)", mem_ours))
    for name, fn in mems[2:] if ours_only else mems:
        try:
            lines.append(f"| {name} | {peak(fn):.2f} |")
        except Exception as ex:  # noqa: BLE001
            lines.append(f"| {name} | failed: {str(ex)[:80]} |")
        print(lines[-1], flush=True)
    # Our workspace lives in the stream-ordered pool (cudaMallocAsync), which torch's counter does not see:
    # add the pool's high-water mark during the same call.
    try:
        LIB.pathattn_cuda_pool_high_water.restype = ctypes.c_int64
        LIB.pathattn_cuda_pool_high_water(1)
        outs = peak(mem_ours)
        ws = LIB.pathattn_cuda_pool_high_water(0) / 2**30
        lines.append(f"| ours: workspace high-water (stream-ordered pool) | {ws:.2f} |")
        lines.append(f"| ours: total (outputs + workspace) | {outs + ws:.2f} |")
        print(lines[-2], lines[-1], flush=True)
    except Exception as ex:  # noqa: BLE001
        print("pool query failed:", ex)


if __name__ == "__main__":
    main()
