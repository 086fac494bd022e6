"""bench/decode_bench.py: one decode step of pathattn against plain attention's, on one device in one process.

For each shape (N requests x L cached tokens): pathattn.prefill fills a cache of L tokens per request, then
pathattn.decode_step appends one token to every request and returns its output; the baseline is torch's
scaled_dot_product_attention of one query per request over a 16-bit K/V cache of the same length (GQA by
enable_gqa, as a serving stack's decode). The two take turns in rounds (the order reversed every other round)
and each cell is the median of every timed step; on a GPU each step is timed by CUDA events around a run of
steps, and with --graphs the baseline is also timed replaying a captured CUDA graph of its steps. With --paged
(default) a third case: pathattn.paged_decode over a PagedCache of the same prompts (f16 key pages, page 16,
pending S = 64, validate=False), eager and (GPU, --graphs) replayed from a CUDA graph; it is timed in runs of a
multiple of S steps, so every run holds exactly its share of flushes. Besides the times: the bytes each step must
move (pathattn: its cache read and the transported keys written back; paged: its f16 keys and values read, plus a
flush's read and write of the keys every S steps; the baseline: its K and V read) and the rate that makes. Writes
a markdown table (--out) and prints it.
    python3 bench/decode_bench.py [--shapes 1x4096,1x32768] [--out results/bench/decode_h200.md]
    python3 bench/decode_bench.py --device cpu --tiny --out ''          # a smoke test; numbers mean nothing
"""
import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_bench import git_commit, write_report  # noqa: E402


def parse_shapes(text):
    """'1x4096,16x32768' -> [(1, 4096), (16, 32768)]."""
    out = []
    for item in text.split(","):
        n, sep, length = item.strip().partition("x")
        if not sep or not n.isdigit() or not length.isdigit() or int(n) < 1 or int(length) < 1:
            raise ValueError(f"--shapes: expected NxL items such as 1x4096, got {item!r}")
        out.append((int(n), int(length)))
    return out


class Timer:
    """Seconds of a run of calls: CUDA events on a GPU (after a synchronize), wall time on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, steps):
        if self.cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(steps):
                fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return time.perf_counter() - t0


# The paged cache's settings: key pages in f16, vLLM's usual page of 16 tokens, a flush every 64 steps.
PAGE, PENDING = 16, 64


def graph_of(fn, warmup):
    """A CUDA graph of one call of fn, captured after `warmup` calls on a side stream: its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def make_cases(pathattn, N, L, HQ, H, K, dtype, device, gate, capacity_extra, graphs, paged):
    """The callables of one shape: {name: fn}; pathattn's appends a token each call (capacity is reserved for
    capacity_extra calls, so no call grows the cache), and so do the paged cache's (both of its cases share one
    cache: room for twice capacity_extra calls)."""
    g = torch.Generator(device=device).manual_seed(N * 1000003 + L)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dt)

    def unit(x):
        return (x.float() / x.float().norm(dim=-1, keepdim=True)).to(x.dtype)

    # The prompt: one sequence per request, L tokens each (a batch of N rows).
    q, k, v = rnd(N, L, HQ, K), unit(rnd(N, L, H, K)), rnd(N, L, H, K)
    w = unit(rnd(N, L, H, K))
    beta = 2 * torch.rand(N, L, H, generator=g, device=device)
    gg = -torch.rand(N, L, HQ, generator=g, device=device) * 0.1 if gate else None
    _, cache = pathattn.prefill(q, k, v, w, beta, gg, capacity=L + capacity_extra)
    pc = None
    if paged:
        pages = -(-(L + 2 * capacity_extra) // PAGE)  # a slot's pages
        pc = pathattn.PagedCache(N, N * pages, PAGE, H, K, K, HQ, dtype, device, gate=gate, pending=PENDING,
                                 max_pages=pages)
        pathattn.paged_prefill(q, k, v, w, beta, gg, pc, extra=2 * capacity_extra)
    del q, k, v, w, beta, gg
    # One token's inputs, reused every step (the cost does not depend on their values).
    q1, k1, v1 = rnd(N, 1, HQ, K), unit(rnd(N, 1, H, K)), rnd(N, 1, H, K)
    w1, b1 = unit(rnd(N, 1, H, K)), 2 * torch.rand(N, 1, H, generator=g, device=device)
    g1 = -torch.rand(N, 1, HQ, generator=g, device=device) * 0.1 if gate else None

    def ours():
        pathattn.decode_step(cache, q1, k1, v1, w1, b1, g1)

    # The baseline: one query per request over a bf16 / fp16 cache of the same length.
    kc, vc = rnd(N, H, L, K), rnd(N, H, L, K)
    qs = rnd(N, HQ, 1, K)

    def sdpa():
        F.scaled_dot_product_attention(qs, kc, vc, enable_gqa=HQ != H)

    cases = {"pathattn": ours, "sdpa": sdpa}
    if paged:
        def paged_step():
            pathattn.paged_decode(q1, k1, v1, w1 if pc.path else None, b1 if pc.path else None, g1, pc,
                                  validate=False)

        cases["paged"] = paged_step
    if graphs and device.type == "cuda":
        cases["sdpa_graph"] = graph_of(sdpa, 3)
        if paged:
            cases["paged_graph"] = graph_of(paged_step, 2)  # 3 calls: within the room reserved for warm-ups
    return cases, cache, pc


def paged_steps(steps):
    """Steps a run of the paged cases: a multiple of S, so that each run holds exactly its share of flushes."""
    return -(-steps // PENDING) * PENDING


def bench_shape(cases, timer, rounds, steps):
    """{name: [seconds a step of each round]}: the cases take turns, the order reversed every other round."""
    names = list(cases)
    for name in names:
        timer(cases[name], 3)  # warm-up (allocator, kernels' first launch)
    out = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            n = paged_steps(steps) if name.startswith("paged") else steps
            out[name].append(timer(cases[name], n) / n)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x4096,1x32768,1x131072,16x32768,64x8192",
                    help="comma-separated NxL: N requests of L cached tokens each")
    ap.add_argument("--HQ", type=int, default=32, help="query heads")
    ap.add_argument("--H", type=int, default=8, help="kv heads (HQ a multiple of it)")
    ap.add_argument("--K", type=int, default=128, help="head dim (keys and values)")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--gate", action="store_true", help="PaTH-FoX: a forget gate on pathattn's side")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each case a round")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="also the baseline replayed from a CUDA graph (GPU)")
    ap.add_argument("--paged", action=argparse.BooleanOptionalAction, default=True,
                    help="also pathattn's paged cache (paged_decode, validate=False; a CUDA graph of it with --graphs)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes and heads (a smoke test)")
    ap.add_argument("--out", default="results/bench/decode_h200.md", help="markdown table ('' : print only)")
    ap.add_argument("--commit", default=None, help="commit to report when git is not available")
    args = ap.parse_args()
    if args.tiny:
        args.shapes, args.HQ, args.H, args.K = "1x256,2x128", 4, 2, 64
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        ap.error(str(e))
    for name in ("HQ", "H", "K", "rounds", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be >= 1")
    if args.HQ % args.H:
        ap.error(f"--HQ: must be a multiple of --H ({args.HQ} is not a multiple of {args.H})")
    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        ap.error(f"--device: cuda, cuda:N or cpu, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device: no CUDA device is visible to torch")
    import pathattn
    device = torch.device("cuda:0" if args.device == "cuda" else args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if not pathattn.backend_available("cuda"):
            sys.exit("error: this pathattn build has no CUDA backend")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    timer = Timer(device)
    # Every call of pathattn's case appends a token (3 warm-ups, then the rounds); the paged cases' runs are longer.
    extra = 3 * 2 + args.rounds * max(args.steps, paged_steps(args.steps) if args.paged else 0) + 16

    rows, cache_dt = [], "?"
    for N, L in shapes:
        cases, cache, pc = make_cases(pathattn, N, L, args.HQ, args.H, args.K, dtype, device, args.gate, extra,
                                      args.graphs, args.paged)
        got = bench_shape(cases, timer, args.rounds, args.steps)
        med = {name: statistics.median(v) for name, v in got.items()}
        elems = N * args.H * L * args.K
        cache_bytes, cache_dt = cache.kc.element_size(), str(cache.kc.dtype).replace("torch.", "")
        # pathattn: keys read and written back, values read; the baseline: 16-bit keys and values read.
        ours_bytes, base_bytes = elems * 3 * cache_bytes, elems * 2 * 2
        # paged: f16 keys and 16-bit values read; a flush every S steps reads and writes the keys.
        paged_bytes = elems * (2 + 2) + elems * 2 * 2 / PENDING
        rows.append((N, L, med, ours_bytes, base_bytes, paged_bytes))
        print(f"{N}x{L}: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in med.items()), file=sys.stderr)
        del cases, cache, pc
        if device.type == "cuda":
            torch.cuda.empty_cache()

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = git_commit() or args.commit or os.environ.get("PATHATTN_COMMIT") or "unknown"
    graph_col = args.graphs and device.type == "cuda"
    lines = [f"# A decode step: pathattn against plain attention ({gpu})", "",
             f"- Date: {now}. Commit: {commit}. torch {torch.__version__}.",
             f"- HQ = {args.HQ}, H = {args.H}, K = V = {args.K}, inputs {args.dtype}"
             f"{', forget gate' if args.gate else ''}; pathattn's cache {cache_dt}, the "
             f"baseline's {args.dtype}. Each cell: the median over {args.rounds} rounds of {args.steps} steps" +
             (f" ({paged_steps(args.steps)} for the paged cache: a multiple of its S = {PENDING})." if args.paged
              else "."),
             "- Command: `python " + " ".join(["bench/decode_bench.py"] + sys.argv[1:]) + "`", "",
             "| requests x context | pathattn us | SDPA us |" + (" SDPA graph us |" if graph_col else "") +
             " pathattn / SDPA | pathattn GB/s | SDPA GB/s |" +
             ((" paged us |" + (" paged graph us |" if graph_col else "") + " paged / SDPA | paged GB/s |")
              if args.paged else ""),
             "|---|---|---|" + ("---|" if graph_col else "") + "---|---|---|" +
             (("---|" * (4 if graph_col else 3)) if args.paged else "")]
    for N, L, med, ob, bb, pb in rows:
        o, s = med["pathattn"], med["sdpa"]
        g = f" {med['sdpa_graph'] * 1e6:.1f} |" if graph_col else ""
        best = min(s, med.get("sdpa_graph", s))
        line = (f"| {N} x {L} | {o * 1e6:.1f} | {s * 1e6:.1f} |{g} {o / best:.2f} | {ob / o / 1e9:,.0f} | "
                f"{bb / s / 1e9:,.0f} |")
        if args.paged:
            p = med["paged"]
            pg = f" {med['paged_graph'] * 1e6:.1f} |" if graph_col else ""
            pbest = min(p, med.get("paged_graph", p))
            line += f" {p * 1e6:.1f} |{pg} {pbest / best:.2f} | {pb / pbest / 1e9:,.0f} |"
        lines.append(line)
    lines += ["", "pathattn / SDPA divides by the faster of the baseline's two timings. GB/s: the bytes a step must "
              "move (pathattn: cached keys read and written, values read; SDPA: keys and values read) over its "
              "time."]
    if args.paged:
        lines += ["", f"paged: pathattn.paged_decode over a PagedCache (f16 key pages, page {PAGE}, pending "
                  f"{PENDING}, validate=False){', eager and replayed from a CUDA graph' if graph_col else ''}. "
                  "paged / SDPA divides the faster paged timing by the faster baseline timing; its GB/s counts f16 "
                  "keys and 16-bit values read and a flush's read and write of the keys every "
                  f"{PENDING} steps, over the faster paged timing."]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
