"""bench/kernel_flops.py: the tensor-core work each CUDA kernel of pathattn issues in one forward or one
forward+backward call, read off src/cuda/*.cu, for the per-kernel table of gpu_bench.py (--kernels).

What the counts are (2 FLOP a multiply-add):
- Tensor-core products only: every mma / wgmma a kernel issues, with its M x N x K as the code tiles it. Softmax,
  exponentials, scaling, row sums, the inverse's 16 x 16 diagonal blocks on CUDA cores, copies and reductions are
  not counted; gate_cumsum, bwd_delta and bwd_dg issue no products and count 0.
- Issued, not needed: the chunk kernels (chunk_prep, bwd_chunk) skip only the k-steps a warp's tile cannot use
  (kspan.h's KSpan, mirrored here tile by tile), so their triangular products count the steps the warps run, in
  steps of 8 (tf32) or 16 (16-bit); every other product counts whole, masked parts (causal diagonals, rows past a
  sequence) included.
- Split products count every pass: split tf32 (chunk_prep's A, W2 and the inverse's blocks) three, super_prep's
  bf16 head-and-tail ks product two.
- The launch sequence is backend.cu's default on Hopper with the far kernels usable (sm_90a build, K == V): fwd_run
  and bwd_run over one slice (the workspace limit off, so super_bwd's M_c come from the first super_prep launch),
  the superblock sizes of fwd_super_chunks / bwd_super_chunks and the far-path choices of far_worth_it, the gate's
  rule and the fused far kernel (kfuse). Not modeled: the environment overrides other than the superblock sizes,
  the two-size backward (far_glue), plain attention (no w), varlen. Every sequence has length T, a multiple of 128.
    python3 bench/kernel_flops.py --selftest        # CPU checks of the model
    python3 bench/kernel_flops.py --K 128 --T 4096  # the per-kernel counts of a shape
"""
import argparse
import math
import sys

C = 64                                             # kChunk
SUPER_SHORT, SUPER_MID, SUPER_LONG = 4, 6, 8       # kSuperChunksShort, kSuperChunksMid, kSuperChunks
KERNELS = ("gate_cumsum_kernel", "chunk_prep_kernel", "bwd_delta_kernel", "super_prep_kernel", "fwd_scan_kernel",
           "fwd_far_kernel", "bwd_q_kernel", "bwd_q_far_kernel", "bwd_k_far_kernel", "bwd_k_kernel",
           "super_bwd_kernel", "bwd_chunk_kernel", "bwd_dg_kernel")


# ---- mirrors of backend.cu's choices
def bwd_super_chunks(T, K, V, gate, deterministic=False):
    """Mirror of backend.cu bwd_super_chunks (without its environment override): chunks per superblock of the
    backward, by the longest sequence T."""
    if T <= 2048:
        return SUPER_SHORT
    if gate or deterministic or T > 8192:
        return SUPER_LONG
    if K == 128 and V == 128:
        return SUPER_MID
    return SUPER_LONG if T > 4096 else SUPER_SHORT


def fwd_super_chunks():
    """Mirror of backend.cu fwd_super_chunks (without its environment override)."""
    return SUPER_LONG


def nsuper_of(nc, sc):
    """Superblocks of a sequence of nc chunks that a later query reaches across (build_tables' super_first)."""
    return (nc - 1) // sc


def far_worth_it(nc, sc):
    """Mirror of backend.cu far_worth_it for one sequence length (path on): more than two superblocks."""
    return nsuper_of(nc, sc) > 0 and nc > 2 * sc


# ---- tensor-core tiles (common.cuh): TcTile's warp grid and KSpan's k ranges
class Span:
    """Mirror of kspan.h KSpan: bounds on the inner index k relative to the output row r and column c."""
    NONE = 1 << 20

    def __init__(self, kmin_r=-NONE, kmax_r=NONE, kmin_c=-NONE, kmax_c=NONE, out=NONE):
        self.kmin_r, self.kmax_r, self.kmin_c, self.kmax_c, self.out = kmin_r, kmax_r, kmin_c, kmax_c, out

    def range(self, r0, r1, c0, c1, KD):
        lo = max(r0 + self.kmin_r, c0 + self.kmin_c, 0)
        hi = min(r1 + self.kmax_r, c1 + self.kmax_c, KD)
        if c0 > r1 - 1 + self.out or hi <= lo:
            return 0, 0
        return lo & ~7, (hi + 7) & ~7


FULL = Span()


def tc(M, N, KD, span=FULL, passes=1, step=8):
    """Multiply-adds a 16-warp TcTile<M, N> product (mma_tc_acc / block_mm_tc, step 8; mma_tc_acc16, step 16)
    issues: each warp's 16-row m-tiles times its n-group, over the k range its tile needs. passes: 3 for split
    tf32 (kX3)."""
    mtiles = M // 16
    wm = min(mtiles, 16)
    wn = 16 // wm
    mpw, ncols = mtiles // wm, N // wn
    total = 0
    for i in range(wm):
        for j in range(wn):
            lo, hi = span.range(16 * i, 16 * (i + wm * (mpw - 1)) + 16, ncols * j, ncols * (j + 1), KD)
            if step == 16:
                lo, hi = lo & ~15, (hi + 15) & ~15
            total += max(0, hi - lo) * 16 * mpw * ncols
    return total * passes


# ---- per-item multiply-adds, read off each kernel
def chunk_prep_item(K, G):
    """chunk_prep (prep.cu), per (chunk, kv head) with its G query heads."""
    inverse = 3 * (2 * 2 * 2 * 16 * 8 * 16 + 4 * 2 * 2 * 16 * 8 * 32)  # unit_lower_inverse's split-tf32 levels
    kv = (tc(C, C, K, Span(out=-1), 3)                       # A = W W^T (split tf32)
          + inverse
          + tc(C, K, C, Span(kmax_r=0), 3)                   # W2 = E diag(b) W (split tf32)
          + tc(C, C, K, Span(out=-1))                        # Z = W K^T
          + tc(C, C, C, Span(kmax_r=0, kmin_c=1))            # U = E diag(b) Z
          + tc(C, K, C, Span(kmin_r=1)))                     # k~ = K - U^T W
    head = (tc(C, C, K, Span(out=0))                         # X = Q W^T
            + tc(C, K, C, Span(kmax_r=0))                    # q~ = Q - X W2
            + tc(C, C, K, Span(out=0), step=16)              # A_loc: Q K^T (16-bit)
            + tc(C, C, C, Span(out=0, kmax_r=0, kmin_c=1)))  #        - X U
    return kv + G * head


def super_prep_item(K, sc, ks=True, bf16=True):
    """super_prep (prep.cu), per (superblock, kv head), all K rows of M: per chunk step ks_c = M k~^T (bf16: head and
    tail, two passes), y = M W^T, M -= y W2. ks false: the backward's M_c-only launch."""
    return sc * ((K * C * K * (2 if bf16 else 1) if ks else 0) + K * C * K + K * K * C)


def super_bwd_item(K, sc):
    """super_bwd (prep.cu), per (superblock, kv head), all row blocks: dP_c += M_c^T R_c each step, and between
    steps Y = R W2^T, R -= Y W, R += dks^T k~."""
    return sc * K * K * K + (sc - 1) * (K * C * K + 2 * K * K * C)


def fwd_scan_item(K, V, qc, sc, split):
    """fwd_scan (fwd.cu), per (query chunk qc, query head): the diagonal's P V, S and P V for each key chunk it
    walks, the chunk crossings of its own superblock and (not split) the superblock crossings below it."""
    first = (qc // sc) * sc
    stop = first if split else 0
    attn = C * V * C + (qc - stop) * (C * C * K + C * V * C)
    cross = max(0, qc - max(first, 1)) * 2 * C * C * K
    supers = 0 if split else len([kc for kc in range(1, first) if kc % sc == 0]) * C * K * K
    return attn + cross + supers


def fwd_far_tile(K, V, c, sc):
    """fwd_far (fwd_far.cu), per (tile of query chunks c, c + 1, query head): 128 rows against the S = c / sc far
    superblocks' keys (S and P V on 128-key chunks) and S - 1 crossings qt <- qt PS."""
    S = c // sc
    return S * sc * C * 128 * (K + V) + (S - 1) * 128 * K * K


def bwd_q_item(K, V, qc, sc, qfar):
    """bwd_q (bwd_q.cu), per (query chunk qc, query head). qfar 1: the qhat launch; 2: the last launch after the
    far kernel; 0: no far kernel (this kernel walks the far superblocks too)."""
    first = (qc // sc) * sc
    sbq = qc // sc
    if qfar == 1 and first == 0:
        return 0
    kc_end = first + 1 if qfar == 2 else max(first, 1)
    n = max(0, qc - kc_end) * 2 * C * C * K                   # pass 1: chunk steps
    if first > 0 and qfar == 0:
        n += max(0, sbq - 1) * C * K * K                       # pass 1: qt <- qt PS
    if qfar == 1:
        return n
    n += C * C * V + C * V * C                                 # diagonal: dP = dO V^T, dv = P^T dO
    score = C * C * K + C * C * V + C * K * C                  # S, dP, gbar += scale dS k
    if first > 0 and qfar == 0:
        n += max(0, sbq - 1) * (K * K * C + C * K * K)         # dPS += qt^T gbar, gbar <- gbar PS^T
        n += sbq * sc * score
    for kc in range(first, qc):
        n += score + (K * K * C + 2 * C * C * K if kc > 0 else 0)  # dP += qt^T gbar, gbar step
    return n


def bwd_k_item(K, V, G, kc, nc, sc, kfar):
    """bwd_k (bwd_k.cu), per (key chunk kc, kv head) with its G query heads; kfar: bwd_k_far took the far
    superblocks."""
    last = nc - 1
    sbk, last_sb = kc // sc, last // sc
    far = last_sb > sbk
    lastl = sbk * sc + sc - 1 if far else last
    qc_end = lastl - 1 if (far and kfar) else min(lastl, last - 1)
    n = max(0, qc_end - kc) * 2 * C * C * K                   # pass 1: chunk steps
    head = C * C * K + C * C * V + C * V * C + C * K * C       # S^T, dP^T, dv += P^T dO, h += scale dS^T q
    if far and not kfar:
        n += max(0, last_sb - sbk - 1) * 2 * C * K * K         # pass 1 and pass 2 superblock crossings
        for a in range(last_sb, sbk, -1):
            qend = min(last, a * sc + sc - 1)
            n += (qend - a * sc + 1) * G * head
    for qc in range(lastl, kc, -1):
        n += (2 * C * C * K if qc < last else 0) + G * head
    return n


def bwd_q_far_tile(K, V, c, sc):
    """bwd_q_far (bwd_q_far.cu), per (tile of query chunks c, c + 1, query head): S - 1 crossings in pass 1; in pass
    2 per earlier superblock after the first dPS += qt^T gbar and gbar <- gbar PS^T, and per far key chunk S, dP and
    gbar += scale dS ks over the tile's 128 rows."""
    S = c // sc
    return (S - 1) * (128 * K * K + K * K * 128 + 128 * K * K) + S * sc * 128 * C * (K + V + K)


def bwd_k_far_tile(K, V, G, c, nc, sc, fuse):
    """bwd_k_far (bwd_k_far.cu), per (key tile of chunks c, c + 1, kv head): the query chunks of the later
    superblocks, each with the G query heads, meet the 128 keys (S^T, dP^T, dv, h; fused also dq = dS kt), and
    n1 = later superblocks - 1 crossings in each pass (fused also dPS += h^T kt at each)."""
    last = nc - 1
    sbk, last_sb = c // sc, last // sc
    n1 = last_sb - sbk - 1
    items = (last + 1 - (sbk + 1) * sc) * G
    per_item = 128 * C * K + 128 * C * V + 128 * V * C + 128 * K * C + (C * K * 128 if fuse else 0)
    return items * per_item + n1 * 2 * 128 * K * K + (n1 * K * K * 128 if fuse else 0)


def bwd_chunk_item(K, G):
    """bwd_chunk (bwd_chunk.cu), per (chunk, kv head) with its G query heads, on Hopper (dA_loc and dq~ staged, D
    on 16-bit mma; at K = 128 Z recomputed after the heads' loop)."""
    z = tc(C, C, K, Span(out=-1))
    kv = (z * (2 if K > C else 1)                                    # Z = W K^T
          + tc(C, C, C, Span(kmax_r=0, kmin_c=1))                    # U = E diag(b) Z
          + tc(C, K, C, Span(kmax_r=-1))                             # dW -= U dk~
          + tc(C, C, K, Span(out=-1))                                # dU = -W dk~^T
          + 2 * tc(C, K, K, step=16)                                 # dW -= W2 D^T, dW2 -= W D (16-bit)
          + tc(C, C, C, Span(out=0, kmax_r=-1, kmax_c=-1)) + tc(C, C, K, Span(out=0))  # dE
          + tc(C, C, C, Span(kmin_r=0, kmin_c=1, out=-1))            # dZb = E^T dU
          + tc(C, K, C, Span(kmax_r=-1))                             # dW += diag(b) dZb K
          + tc(C, K, C, Span(kmin_r=1))                              # dK += dZb^T diag(b) W
          + tc(C, K, C, Span(kmin_r=0))                              # dWb = E^T dW2
          + tc(C, C, C, Span(kmax_r=0, kmax_c=0))                    # M1 = dE E^T
          + tc(C, C, C, Span(kmin_r=0, out=-1))                      # dA = -E^T M1
          + tc(C, C, K, Span(out=-1))                                # Gram W W^T (dbeta)
          + tc(C, K, C))                                             # dW += (diag(b) dA + dA^T diag(b)) W
    head = (tc(C, C, K, Span(out=0))                                 # X = Q W^T
            + tc(C, C, K, Span(out=0)) + tc(C, C, C, Span(out=0, kmax_r=0, kmax_c=-1))  # dX
            + 2 * tc(C, K, C, Span(kmax_r=0))                        # dq = dq~ + dA_loc K + dX W
            + 3 * tc(C, K, C, Span(kmin_r=0))                        # dK, dW, dW2 terms
            + tc(C, C, C, Span(kmin_r=0, kmin_c=0, out=-1)))         # dU -= X^T dA_loc
    return kv + G * head


# ---- the calls
def plan(B, T, H, HQ, K, V, gate=False, deterministic=False, fwd_sc=None, bwd_sc=None):
    """The superblock sizes and far-path choices backend.cu makes for the shape (fwd_sc / bwd_sc: the
    PATHATTN_CUDA_FWD_SUPER_CHUNKS / _BWD_SUPER_CHUNKS overrides)."""
    for name, x in (("B", B), ("T", T), ("H", H), ("HQ", HQ)):
        if x < 1:
            raise ValueError(f"{name} must be >= 1, got {x}")
    if T % 128:
        raise ValueError(f"T must be a multiple of 128 (the model's tiles are whole), got {T}")
    if K not in (64, 128) or V != K:
        raise ValueError(f"K and V must be equal and 64 or 128 (the far kernels' shapes), got K={K} V={V}")
    if HQ % H:
        raise ValueError(f"HQ must be a multiple of H, got HQ={HQ} H={H}")
    nc = T // C
    fsc = fwd_sc or fwd_super_chunks()
    bsc = bwd_sc or bwd_super_chunks(T, K, V, gate, deterministic)
    fwd_far = far_worth_it(nc, fsc)
    far = far_worth_it(nc, bsc) and (not gate or T > 4 * SUPER_LONG * C)
    qfar = far and not deterministic       # bwd_q_far_usable
    kfar = far                             # bwd_k_far_usable
    return dict(nc=nc, G=HQ // H, fwd_sc=fsc, bwd_sc=bsc, fwd_far=fwd_far, qfar=qfar,
                kfar=kfar, kfuse=qfar and kfar and not deterministic)


def kernel_flops(B, T, H, HQ, K, V, gate=False, backward=True, deterministic=False, fwd_sc=None, bwd_sc=None,
                 bf16=True):
    """{kernel name: FLOPs} of one forward (backward False) or one forward+backward call; names as the profiler
    shows the __global__ functions. Kernels the call does not launch are absent."""
    p = plan(B, T, H, HQ, K, V, gate, deterministic, fwd_sc, bwd_sc)
    nc, G = p["nc"], p["G"]
    out = {}

    def add(name, macs_per_seq_head, heads):
        out[name] = out.get(name, 0) + 2 * macs_per_seq_head * heads * B

    if gate:
        add("gate_cumsum_kernel", 0, HQ)
    # forward
    sc = p["fwd_sc"]
    add("chunk_prep_kernel", nc * chunk_prep_item(K, G), H)
    if nsuper_of(nc, sc):
        add("super_prep_kernel", nsuper_of(nc, sc) * super_prep_item(K, sc, bf16=bf16), H)
    add("fwd_scan_kernel", sum(fwd_scan_item(K, V, qc, sc, p["fwd_far"] and qc >= sc) for qc in range(nc)), HQ)
    if p["fwd_far"]:
        add("fwd_far_kernel", sum(fwd_far_tile(K, V, c, sc) for c in range(sc, nc, 2)), HQ)
    if not backward:
        return out
    # backward
    sc = p["bwd_sc"]
    if gate:
        add("gate_cumsum_kernel", 0, HQ)
    add("chunk_prep_kernel", nc * chunk_prep_item(K, G), H)
    add("bwd_delta_kernel", 0, HQ)
    if nsuper_of(nc, sc):
        add("super_prep_kernel", nsuper_of(nc, sc) * super_prep_item(K, sc, bf16=bf16), H)
    if p["qfar"]:
        add("bwd_q_kernel", sum(bwd_q_item(K, V, qc, sc, 1) for qc in range(nc)), HQ)
        if p["kfuse"]:
            add("bwd_k_far_kernel", sum(bwd_k_far_tile(K, V, G, c, nc, sc, True)
                                        for c in range(0, nc, 2) if (nc - 1) // sc > c // sc), H)
        else:
            add("bwd_q_far_kernel", sum(bwd_q_far_tile(K, V, c, sc) for c in range(sc, nc, 2)), HQ)
    add("bwd_q_kernel", sum(bwd_q_item(K, V, qc, sc, 2 if p["qfar"] else 0) for qc in range(nc)), HQ)
    if p["kfar"] and not p["kfuse"]:
        add("bwd_k_far_kernel", sum(bwd_k_far_tile(K, V, G, c, nc, sc, False)
                                    for c in range(0, nc, 2) if (nc - 1) // sc > c // sc), H)
    add("bwd_k_kernel", sum(bwd_k_item(K, V, G, kc, nc, sc, p["kfar"]) for kc in range(nc)), H)
    if nsuper_of(nc, sc):
        add("super_bwd_kernel", nsuper_of(nc, sc) * super_bwd_item(K, sc), H)
    add("bwd_chunk_kernel", nc * bwd_chunk_item(K, G), H)
    if gate:
        add("bwd_dg_kernel", 0, HQ)
    return out


def attention_flops(B, T, HQ, K, backward=False):
    """The FlashAttention formula for causal attention: forward 4 B HQ T^2 K / 2, forward+backward 3.5x that."""
    f = 4 * B * HQ * T * T * K / 2
    return 3.5 * f if backward else f


# ---- the table of measured times (gpu_bench.py --kernels; torch is imported only here)
COUNTS_NOTE = ("FLOP counts: bench/kernel_flops.py's model of the tensor-core products each kernel issues (2 FLOP a "
               "multiply-add, read off src/cuda): the chunk kernels' triangular products as the warps' k ranges run "
               "them, causal and masked tiles whole, split-precision products once per pass; softmax, exponentials, "
               "reductions, copies and other CUDA-core work count nothing. Times: device time of each kernel under "
               "torch.profiler, its launches summed, one call after a warm-up, one slice (workspace limit off).")


def kernel_name(raw):
    """The profiler's name of a device activity, shortened as dev/cuda/timeline.py's short() does (the kernel's
    function name), with the model's names found inside a mangled one."""
    for k in sorted(KERNELS, key=len, reverse=True):
        if k in raw:
            return k
    name = raw.replace("(anonymous namespace)", "").split("(")[0].split("<")[0]
    return name.split("::")[-1].strip()[:40] or raw[:40]


def profile_call(fn):
    """Runs fn once under torch.profiler (CUDA activity) and returns summarize() of its device activities."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return summarize([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA])


def summarize(events):
    """events: (start us, end us, profiler name) of device activities. Returns ({name: [ms, launches, first start]},
    device span ms, busy ms): each kernel's time summed over its launches (kernel_name's names; memsets and copies
    under their own), the span from the first start to the last end, and the time some activity ran."""
    ev = sorted((s, e, kernel_name(n)) for s, e, n in events)
    acc, busy, cur = {}, 0.0, None
    for s, e, name in ev:
        a = acc.setdefault(name, [0.0, 0, s])
        a[0] += (e - s) / 1e3
        a[1] += 1
        if cur is None or s > cur[1]:
            busy += 0 if cur is None else cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    busy += 0 if cur is None else cur[1] - cur[0]
    span = (ev[-1][1] - ev[0][0]) / 1e3 if ev else 0.0
    return acc, span, busy / 1e3


def table(title, measured, model, reference):
    """Markdown lines: kernel | launches | ms | GFLOP | TFLOP/s | share, in launch order, and the call's row.
    measured: profile_call's result; model: kernel_flops' dict; reference: the FlashAttention formula's FLOPs."""
    acc, span, busy = measured
    total_ms = sum(a[0] for a in acc.values())
    out = [f"\n### {title}\n", "| kernel | launches | ms | GFLOP | TFLOP/s | share of the call's time |",
           "|---|---|---|---|---|---|"]
    unknown = []
    for name, (ms, n, _) in sorted(acc.items(), key=lambda x: x[1][2]):
        copy = name.startswith(("Memcpy", "Memset"))
        fl = 0 if copy else model.get(name)
        if fl is None:
            unknown.append(name)
        gf = "-" if fl is None else f"{fl / 1e9:.1f}"
        rate = f"{fl / (ms * 1e-3) / 1e12:.0f}" if fl and ms > 0 else "-"
        out.append(f"| {name} | {n} | {ms:.3f} | {gf} | {rate} | {100 * ms / total_ms:.1f}% |")
    fl = sum(v for k, v in model.items() if k in acc)
    mark = " (modeled kernels only)" if unknown else ""
    out.append(f"| **call** (kernels summed) | {sum(a[1] for a in acc.values())} | {total_ms:.3f} | "
               f"{fl / 1e9:.1f}{mark} | {fl / (total_ms * 1e-3) / 1e12:.0f} | 100% |")
    out.append(f"\nDevice span {span:.3f} ms, {busy:.3f} ms of it with some activity running; the FlashAttention "
               f"formula for the shape {reference / 1e9:.1f} GFLOP ({reference / (total_ms * 1e-3) / 1e12:.0f} "
               f"TFLOP/s over the kernels' time).")
    missing = [k for k, v in model.items() if k not in acc]
    if unknown:
        out.append(f"\nWarning: not in the FLOP model (extend bench/kernel_flops.py): {', '.join(unknown)}.")
    if missing:
        out.append(f"\nWarning: the model expects kernels that did not run (its launch sequence differs from this "
                   f"build's or device's): {', '.join(missing)}.")
    return out


# ---- self-test (CPU)
def selftest():
    fails = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            fails.append(what)

    # KSpan tiles against a brute-force count of the k-steps each warp's tile can use.
    def brute(M, N, KD, nz):
        wn = 16 // (M // 16)
        total = 0
        for i in range(M // 16):
            for j in range(wn):
                cols = range(N // wn * j, N // wn * (j + 1))
                ks = [k for k in range(KD) if any(nz(r, k, c) for r in range(16 * i, 16 * i + 16) for c in cols)]
                if ks:
                    lo, hi = min(ks) & ~7, (max(ks) + 8) & ~7
                    total += (hi - lo) * 16 * (N // wn)
        return total
    check(tc(C, C, 128, Span(out=-1)) == brute(C, C, 128, lambda r, k, c: c < r), "tc: strict-lower output mask")
    check(tc(C, C, C, Span(kmax_r=0, kmin_c=1)) == brute(C, C, C, lambda r, k, c: k <= r and k >= c + 1),
          "tc: triangular A and B operands (U = E diag(b) Z)")
    check(tc(C, 128, C, Span(kmin_r=1)) == brute(C, 128, C, lambda r, k, c: k >= r + 1), "tc: k >= r + 1 (k~)")

    # fwd_far: its attention is the causal FlashAttention count less the superblock-diagonal blocks (n superblocks:
    # a fraction 1 - 1/n of it), plus one K x K crossing per earlier superblock after the first, per 128-row tile.
    B, T, K = 8, 4096, 128
    H = 2048 // K
    f = kernel_flops(B, T, H, H, K, K, backward=False)
    sc = fwd_super_chunks()
    n = T // (sc * C)
    crossings = sum(c // sc - 1 for c in range(sc, T // C, 2))
    want = attention_flops(B, T, H, K) * (1 - 1 / n) + 2 * B * H * crossings * 128 * K * K
    check(f["fwd_far_kernel"] == want, f"fwd_far at K = {K} T = {T}: {f['fwd_far_kernel'] / 1e9:.1f} GFLOP = "
          f"FlashAttention fwd x (1 - 1/{n}) + crossings ({want / 1e9:.1f})")
    # The fused far backward: five products a (query chunk, key tile) pair (S^T, dP^T, dv, dh, dq), FlashAttention's
    # backward (2.5x its forward) over the far pairs, plus its crossings.
    f = kernel_flops(B, T, H, H, K, K)
    p = plan(B, T, H, H, K, K)
    sc, nc = p["bwd_sc"], T // C
    n = -(-nc // sc)  # superblocks, the last one short where sc does not divide nc
    far_pairs = sum((nc - (c // sc + 1) * sc) * C * 128 for c in range(0, nc, 2) if (nc - 1) // sc > c // sc)
    n1 = sum((nc - 1) // sc - c // sc - 1 for c in range(0, nc, 2) if (nc - 1) // sc > c // sc)
    want = 2 * B * H * (far_pairs * 5 * K + n1 * 3 * 128 * K * K)
    check(p["kfuse"] and f["bwd_k_far_kernel"] == want,
          f"bwd_k_far (fused, sc = {sc}, {n} superblocks) at K = {K} T = {T}: "
          f"{f['bwd_k_far_kernel'] / 1e9:.1f} GFLOP = "
          f"5 products a far pair + 3 K x K a crossing ({want / 1e9:.1f}); "
          f"of which FlashAttention's backward over the same pairs {2.5 * 4 * B * H * far_pairs * K / 1e9:.1f}")
    # dev/cuda/NOTES.md's counts at K = 128 T = 4k (v3.46's table, sc = 8): chunk_prep 66 GFLOP a launch, bwd_chunk
    # 139 issued, super_prep 45 with ks one tf32 pass (now bf16 head and tail: two), super_bwd 96 with the 7-step M
    # chain (2 K x 64 x K products a step) it ran before it read M_c from super_prep; the fused far kernel at sc = 8:
    # 114,688 query items of 10.5 MFLOP.
    f8 = kernel_flops(B, T, H, H, K, K, bwd_sc=8)
    check(abs(f8["chunk_prep_kernel"] / 2e9 - 66) < 1, f"chunk_prep a launch: {f8['chunk_prep_kernel'] / 2e9:.1f} "
          "GFLOP (NOTES: 66)")
    check(abs(f8["bwd_chunk_kernel"] / 1e9 - 139) < 1, f"bwd_chunk: {f8['bwd_chunk_kernel'] / 1e9:.1f} GFLOP "
          "(NOTES: 139)")
    sp = 2 * B * H * nsuper_of(nc, 8) * super_prep_item(K, 8, bf16=False)
    check(abs(sp / 1e9 - 45) < 1, f"super_prep a launch, ks one pass: {sp / 1e9:.1f} GFLOP (NOTES: 45)")
    items = sum((nc - (c // 8 + 1) * 8) for c in range(0, nc, 2) if (nc - 1) // 8 > c // 8) * B * H
    per_item = 2 * 5 * 128 * C * K
    check(items == 114688 and abs(per_item / 1e6 - 10.5) < 0.05,
          f"fused far kernel at sc = 8: {items} query items of {per_item / 1e6:.2f} MFLOP (NOTES: 114,688 of 10.5)")
    old = f8["super_bwd_kernel"] + 2 * B * H * 7 * 7 * 2 * K * C * K
    check(abs(old / 1e9 - 96) < 1.5, f"super_bwd at sc = 8 with the old M chain: {old / 1e9:.1f} GFLOP (NOTES: 96)")
    # Monotone in T (B = 1): every kernel's count, and the call's, grows with T.
    prev = None
    for T_ in (1024, 2048, 4096, 8192, 16384):
        cur = kernel_flops(1, T_, 4, 4, 64, 64)
        if prev is not None:
            ok = sum(cur.values()) > sum(prev.values()) and all(cur[k] >= prev.get(k, 0) for k in cur)
            check(ok, f"K = 64: counts at T = {T_} >= at T = {T_ // 2} (call {sum(cur.values()) / 1e9:.2f} GFLOP)")
        prev = cur
    # GQA: the query-head kernels scale with HQ, the kv-head superblock kernels do not, and the per-chunk kernels
    # grow by their per-head parts only.
    for gate in (False, True):
        a = kernel_flops(2, 4096, 4, 4, 128, 128, gate=gate)
        b = kernel_flops(2, 4096, 4, 16, 128, 128, gate=gate)
        qside = [k for k in ("fwd_scan_kernel", "fwd_far_kernel", "bwd_q_far_kernel") if k in a]
        ok = all(b[k] == 4 * a[k] for k in qside)
        ok = ok and all(b[k] == a[k] for k in ("super_prep_kernel", "super_bwd_kernel"))
        ok = ok and all(a[k] < b[k] < 4 * a[k] for k in ("chunk_prep_kernel", "bwd_chunk_kernel", "bwd_k_kernel"))
        check(ok, f"GQA 16:4 against 4:4 (gate {gate}): {', '.join(qside)} x4; superblock kernels x1; "
                  f"per-chunk kernels between")
    # The forward's attention products (fwd_scan + fwd_far, S and P V) against the chunk-granular causal count.
    B, T, K = 1, 4096, 64
    fw = kernel_flops(B, T, 1, 1, K, K, backward=False)
    nc, sc = T // C, fwd_super_chunks()
    cross = sum(max(0, qc - max(qc // sc * sc, 1)) * 2 * C * C * K for qc in range(nc))
    cross += sum(c // sc - 1 for c in range(sc, nc, 2)) * 128 * K * K
    attn = (nc * (nc - 1) // 2) * C * C * 2 * K + nc * C * C * K
    check(fw["fwd_scan_kernel"] + fw["fwd_far_kernel"] == 2 * (attn + cross),
          "fwd_scan + fwd_far = chunk-granular causal S and P V + the transports")
    # The table from synthetic profiler events: launches summed per kernel, demangled and mangled names, memsets at
    # 0 FLOP, a kernel outside the model shown as "-" and named in a warning.
    ev = [(0, 100, "void pathattn::cuda::(anonymous namespace)::chunk_prep_kernel<__nv_bfloat16, 128>"
                   "(pathattn::cuda::KernelParams)"),
          (100, 110, "Memset (Device)"),
          (120, 320, "_ZN8pathattn4cuda12_GLOBAL__N_115fwd_scan_kernelI13__nv_bfloat16Li128E"),
          (320, 420, "void pathattn::cuda::(anonymous namespace)::chunk_prep_kernel<__nv_bfloat16, 128>(x)"),
          (420, 520, "void pathattn::cuda::(anonymous namespace)::new_kernel<float>(int)")]
    m = summarize(ev)
    lines = table("t", m, {"chunk_prep_kernel": 4e9, "fwd_scan_kernel": 1e9}, 1e9)
    ok = m[0]["chunk_prep_kernel"][:2] == [0.2, 2] and abs(m[1] - 0.52) < 1e-9 and abs(m[2] - 0.51) < 1e-9
    ok = ok and "| chunk_prep_kernel | 2 | 0.200 | 4.0 | 20 | 39.2% |" in lines
    ok = ok and "| Memset | 1 | 0.010 | 0.0 | - | 2.0% |" in lines
    ok = ok and "| new_kernel | 1 | 0.100 | - | - | 19.6% |" in lines
    call = "| **call** (kernels summed) | 5 | 0.510 | 5.0 (modeled kernels only) | 10 |"
    ok = ok and any(x.startswith(call) for x in lines)
    ok = ok and any("not in the FLOP model" in x and "new_kernel" in x for x in lines)
    check(ok, "table from synthetic profiler events (sums, names, '-' and the warning)")
    print("self-test:", "FAILED " + str(len(fails)) if fails else "passed")
    return not fails


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--selftest", action="store_true")
    ap.add_argument("--B", type=int, default=None)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--HQ", type=int, default=None)
    ap.add_argument("--H", type=int, default=None)
    ap.add_argument("--gate", action="store_true")
    ap.add_argument("--forward", action="store_true", help="the forward alone")
    a = ap.parse_args()
    if a.selftest:
        sys.exit(0 if selftest() else 1)
    HQ = a.HQ or 2048 // a.K
    H = a.H or HQ
    B = a.B or max(1, 32768 // a.T)
    p = plan(B, a.T, H, HQ, a.K, a.K, a.gate)
    f = kernel_flops(B, a.T, H, HQ, a.K, a.K, a.gate, backward=not a.forward)
    print(f"B {B} T {a.T} H {H} HQ {HQ} K = V = {a.K} gate {a.gate}: superblocks fwd {p['fwd_sc']} bwd {p['bwd_sc']} "
          f"chunks, fwd_far {p['fwd_far']}, bwd far {p['kfar']} (fused {p['kfuse']})")
    for k, v in f.items():
        print(f"  {k:20s} {v / 1e9:10.1f} GFLOP")
    print(f"  {'call':20s} {sum(f.values()) / 1e9:10.1f} GFLOP (FlashAttention "
          f"{attention_flops(B, a.T, HQ, a.K, not a.forward) / 1e9:.1f})")


if __name__ == "__main__":
    main()
