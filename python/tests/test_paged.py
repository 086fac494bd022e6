"""PagedCache / paged_prefill / paged_decode (numpy, and torch on the CPU): the paged cache against the dense
PathCache and the fp64 reference on the same tokens, slots joining and leaving a running batch, the page
allocator (reserve across page boundaries, pool exhaustion, reuse of evicted pages), chunks of T tokens
against T single steps, and argument errors naming the argument."""
import numpy as np
import pytest

import pathattn
from conftest import make_inputs, ref_forward, rel_l2

NAMES = ("q", "k", "v", "w", "beta", "g")


def tok(x, a, b):
    return {n: (None if t is None else t[:, a:b]) for n, t in x.items()}


def cat_rows(xs):
    """Sequences [1, L_i, ...] packed along T (for cu_seqlens)."""
    return {n: (None if xs[0][n] is None else np.concatenate([x[n] for x in xs], axis=1)) for n in NAMES}


def stack(xs, a, b):
    """Tokens a..b of each sequence, one batch row per sequence."""
    return {n: (None if xs[0][n] is None else np.concatenate([x[n][:, a:b] for x in xs], axis=0)) for n in NAMES}


def new_cache(x, slots=2, pages=64, page=4, pending=5, key_dtype=np.float32, **kw):
    _, _, HQ, K = x["q"].shape
    H, V = x["k"].shape[2], x["v"].shape[3]
    return pathattn.PagedCache(slots, pages, page, H, K, V, HQ, x["q"].dtype, gate=x["g"] is not None,
                               pending=pending, key_dtype=key_dtype, path=x["w"] is not None, **kw)


# Bars, against the dense cache and the fp64 reference (conftest.ref_forward) over the same tokens. f32 key pages:
# fp32 arithmetic throughout, in another order than the dense cache's: measured 1e-7 .. 3e-7 (200 steps with beta
# near 2 included); the bar leaves about 6x. f16 key pages: each flush rounds every cached key to f16 (unit
# roundoff 2^-11 = 4.9e-4), so a logit scale * q.kc carries a relative error of that order and the outputs, with
# softmax weights of order one, move by a fraction of it: measured 1.4e-4 .. 3.6e-4 (the long run the largest);
# the bar is 4 unit roundoffs.
BAR = {np.float32: 2e-6, np.float16: 2e-3}


@pytest.mark.parametrize("key_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("path", [True, False])
def test_paged_decode_equals_dense_decode(rng, key_dtype, gate, path):
    # Three prompts of different lengths (one empty), 14 steps: pending 5 means flushes at different steps per
    # slot; page 4 means the block tables grow across page boundaries while decoding (one token reserved a step).
    lens, steps = [7, 0, 12], 14
    seqs = [make_inputs(rng, 1, L + steps, 4, 2, 16, 8, gate=gate, path=path) for L in lens]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    prompt = cat_rows([tok(s, 0, L) for s, L in zip(seqs, lens)])
    o_dense, dense = pathattn.prefill(*(prompt[n] for n in NAMES), cu_seqlens=cu)
    cache = new_cache(seqs[0], slots=3, key_dtype=key_dtype)
    o_paged = pathattn.paged_prefill(*(prompt[n] for n in NAMES), cache, cu_seqlens=cu)
    assert cache.host_lengths().tolist() == lens and cache.flushed.tolist() == lens
    assert rel_l2(o_paged, o_dense) < 2e-5  # the same forward
    dec_d, dec_p = [], []
    for t in range(steps):
        x = {n: (None if seqs[0][n] is None else np.concatenate([s[n][:, L + t:L + t + 1] for s, L in
                                                                  zip(seqs, lens)], 0)) for n in NAMES}
        cache.reserve(None, 1)
        dec_p.append(pathattn.paged_decode(*(x[n] for n in NAMES), cache))
        dec_d.append(pathattn.decode_step(dense, *(x[n] for n in NAMES)))
    assert cache.host_lengths().tolist() == [L + steps for L in lens]
    for n, L in enumerate(lens):
        assert cache.capacity(n) == -(-(L + steps) // 4) * 4  # exactly the pages the tokens need
    dec_p, dec_d = np.concatenate(dec_p, 1), np.concatenate(dec_d, 1)
    e_dense = rel_l2(dec_p, dec_d)
    e_ref = max(rel_l2(dec_p[n:n + 1], ref_forward(s)[0][:, L:]) for n, (s, L) in enumerate(zip(seqs, lens)))
    print(f"[paged vs dense] key pages {np.dtype(key_dtype).name}, gate {gate}, path {path}: "
          f"vs dense {e_dense:.2e}, vs fp64 {e_ref:.2e}")
    assert e_ref < BAR[key_dtype] and e_dense < BAR[key_dtype]


def test_paged_decode_long_run_f16_pages(rng):
    # 200 steps at S = 8 (25 flushes, every key re-rounded to f16 each time), beta near 2 (reflections that damp
    # nothing): the f16 bar still holds against fp64; f32 key pages stay at the dense cache's accuracy.
    L, steps = 40, 200
    x = make_inputs(rng, 1, L + steps, 2, 1, 32, 16, gate=True, beta_range=(1.8, 2.0))
    ro = ref_forward(x)[0][:, L:]
    for kdt in (np.float32, np.float16):
        cache = new_cache(x, slots=1, pages=64, page=16, pending=8, key_dtype=kdt)
        pathattn.paged_prefill(*(tok(x, 0, L)[n] for n in NAMES), cache, extra=steps)
        outs = [pathattn.paged_decode(*(tok(x, t, t + 1)[n] for n in NAMES), cache) for t in range(L, L + steps)]
        e = rel_l2(np.concatenate(outs, 1), ro)
        print(f"[paged long run] key pages {np.dtype(kdt).name}: vs fp64 {e:.2e}")
        assert e < BAR[kdt]


@pytest.mark.parametrize("key_dtype", [np.float32, np.float16])
def test_slots_join_and_leave(rng, key_dtype):
    # Six requests through a cache of 3 slots and a pool too small to hold them all at once: each joins a free
    # slot (prefill) while the others keep decoding, decodes, and leaves (evict), its pages reused by the next.
    # Every request's outputs equal those of the same request alone in a cache of its own.
    reqs = [(5, 9), (11, 4), (0, 7), (8, 12), (3, 3), (14, 6)]  # (prompt length, steps)
    xs = [make_inputs(rng, 1, L + s, 2, 1, 16, 8, gate=True) for L, s in reqs]
    page, pages = 4, 14

    def alone(i):
        L, s = reqs[i]
        c = new_cache(xs[i], slots=1, pages=pages, page=page, key_dtype=key_dtype)
        out = [pathattn.paged_prefill(*(tok(xs[i], 0, L)[n] for n in NAMES), c, extra=s)]
        out += [pathattn.paged_decode(*(tok(xs[i], t, t + 1)[n] for n in NAMES), c) for t in range(L, L + s)]
        return np.concatenate(out, 1)

    cache = new_cache(xs[0], slots=3, pages=pages, page=page, key_dtype=key_dtype)
    waiting = list(range(len(reqs)))
    running = {}  # slot -> [request, tokens done, outputs]
    got = {}
    zeros = {n: (None if xs[0][n] is None else np.zeros((1, 1) + xs[0][n].shape[2:], np.float32)) for n in NAMES}
    peak_pages = 0
    while waiting or running:
        for slot in range(3):  # join: the next request takes a free slot if its pages fit
            if slot not in running and waiting:
                i = waiting[0]
                L, s = reqs[i]
                if -(-(L + 1) // page) > cache.free_pages:
                    break
                waiting.pop(0)
                o = cache.insert(slot, *(tok(xs[i], 0, L)[n] for n in NAMES))
                running[slot] = [i, L, [o]]
        if not running:
            break
        cache.reserve(list(running), 1)
        peak_pages = max(peak_pages, pages - cache.free_pages)
        step = {n: (None if zeros[n] is None else np.concatenate(
            [tok(xs[running[sl][0]], running[sl][1], running[sl][1] + 1)[n] if sl in running else zeros[n]
             for sl in range(3)], 0)) for n in NAMES}
        o = pathattn.paged_decode(*(step[n] for n in NAMES), cache)
        for slot in range(3):
            if slot not in running:
                assert not o[slot].any()  # a free slot's outputs are zeros
                continue
            r = running[slot]
            r[2].append(o[slot:slot + 1])
            r[1] += 1
            if r[1] == sum(reqs[r[0]]):
                got[r[0]] = np.concatenate(r[2], 1)
                cache.evict(slot)
                del running[slot]
                assert cache.host_lengths()[slot] == -1 and cache.flushed[slot] == -1
    assert sorted(got) == list(range(len(reqs)))
    assert cache.free_pages == pages and not any(cache.in_use(s) for s in range(3))
    assert peak_pages > pages // 2  # the pool was really shared (pages reused after evictions)
    for i in range(len(reqs)):
        # The same arithmetic on the same values, only in other pages and beside other slots: bitwise equal.
        np.testing.assert_array_equal(got[i], alone(i), err_msg=f"request {i}")


def test_reserve_across_page_boundaries_and_capacity_errors(rng):
    x = make_inputs(rng, 1, 20, 2, 2, 8, 8, gate=False)
    cache = new_cache(x, slots=2, pages=8, page=4, pending=3)
    assert cache.block_table.tolist() == [[-1] * 8] * 2 and cache.free_pages == 8
    pathattn.paged_prefill(*(tok(x, 0, 3)[n] for n in NAMES), cache, slots=[1])
    assert cache.pages(1) == [0] and cache.capacity(1) == 4 and cache.in_use(1) and not cache.in_use(0)
    cache.reserve(1, 1)  # 3 + 1 tokens: still one page
    assert cache.pages(1) == [0]
    cache.reserve(1, 2)  # 5 tokens: a second page
    assert cache.pages(1) == [0, 1] and cache.block_table[1].tolist() == [0, 1] + [-1] * 6
    cache.reserve(1, 9)  # 12 tokens: three pages
    assert cache.pages(1) == [0, 1, 2] and cache.free_pages == 5
    zero = {n: (None if t is None else np.zeros((1,) + t.shape[1:], t.dtype)) for n, t in tok(x, 0, 1).items()}

    def step(t, **kw):
        s = {n: (None if x[n] is None else np.concatenate([zero[n], x[n][:, t:t + 1]], 0)) for n in NAMES}
        return pathattn.paged_decode(*(s[n] for n in NAMES), cache, **kw)

    for t in range(3, 12):
        step(t)
    assert cache.lengths.tolist() == [-1, 12] and cache.flushed.tolist()[1] in range(12 - 3, 13)
    before = {n: a.copy() for n, a in cache._views().items() if a is not None}
    # Token 12 needs a fourth page that was not reserved: the row's next entry is still -1.
    with pytest.raises(ValueError, match=r"^cache\.block_table: slot 1 page 3 is -1, outside the pool of 8 pages"):
        step(12)
    o = step(12, validate=False)  # unchecked: the slot out of range is skipped, its outputs NaN
    assert np.isnan(o[1]).all() and not o[0].any()
    for n, a in before.items():  # neither call touched the cache
        np.testing.assert_array_equal(getattr(cache, n), a, err_msg=n)
    cache.reserve(1, 1)
    assert cache.pages(1) == [0, 1, 2, 3]
    step(12)
    assert cache.lengths.tolist() == [-1, 13]
    with pytest.raises(ValueError, match=r"^n_tokens: slot 1 would need 29 pages for 113 tokens, more than "
                                         r"max_pages = 8"):
        cache.reserve(1, 100)  # beyond max_pages (8) even if the pool had room
    with pytest.raises(ValueError, match=r"^slot: slot 0 is free"):
        cache.reserve(0, 1)


def test_pool_exhaustion(rng):
    x = make_inputs(rng, 1, 12, 2, 1, 8, 8, gate=True)
    cache = new_cache(x, slots=3, pages=4, page=4, max_pages=4)
    cache.insert(0, *(tok(x, 0, 10)[n] for n in NAMES))  # 3 pages
    assert cache.free_pages == 1
    state = (cache.free_pages, cache.block_table.copy(), cache.lengths.copy())
    with pytest.raises(pathattn.PoolExhaustedError, match=r"pool is exhausted: 2 more pages needed \(slots \[1\]\), "
                                                          r"1 of 4 free"):
        cache.insert(1, *(tok(x, 0, 5)[n] for n in NAMES))
    assert isinstance(pathattn.PoolExhaustedError("x"), RuntimeError)
    # All or none: the refused insert took no page and left slot 1 free.
    assert (cache.free_pages, cache.block_table.tolist(), cache.lengths.tolist()) == \
        (state[0], state[1].tolist(), state[2].tolist())
    assert not cache.in_use(1)
    cache.insert(1, *(tok(x, 0, 2)[n] for n in NAMES))  # one page: fits
    with pytest.raises(pathattn.PoolExhaustedError, match=r"2 more pages needed \(slots \[0, 1\]\), 0 of 4 free"):
        cache.reserve([0, 1], 3)  # slot 0: 13 tokens, slot 1: 5 tokens
    assert cache.pages(0) == [0, 1, 2] and cache.pages(1) == [3]
    cache.evict(0)
    assert cache.free_pages == 3 and cache.lengths.tolist() == [-1, 2, -1]
    cache.reserve(1, 3)
    assert cache.pages(1) == [3, 0]  # an evicted page, reused


@pytest.mark.parametrize("key_dtype", [np.float32, np.float16])
def test_chunk_equals_single_steps(rng, key_dtype):
    # T = 6 tokens in one call against 6 calls of one token, from the same state (pending 4: the chunk crosses a
    # flush); then a chunk that starts exactly at a flush.
    L = 9
    x = make_inputs(rng, 2, L + 12, 4, 2, 16, 8, gate=True)
    cache = new_cache(x, slots=2, pages=32, page=4, pending=4, key_dtype=key_dtype)
    pathattn.paged_prefill(*(tok(x, 0, L)[n] for n in NAMES), cache, extra=12)
    pathattn.paged_decode(*(tok(x, L, L + 2)[n] for n in NAMES), cache)  # 2 pending
    for a, b in ((L + 2, L + 8), (L + 8, L + 12)):
        single = cache.clone()
        o_chunk, lse_chunk = pathattn.paged_decode(*(tok(x, a, b)[n] for n in NAMES), cache, return_lse=True)
        steps = [pathattn.paged_decode(*(tok(x, t, t + 1)[n] for n in NAMES), single, return_lse=True)
                 for t in range(a, b)]
        np.testing.assert_array_equal(o_chunk, np.concatenate([s[0] for s in steps], 1))
        np.testing.assert_array_equal(lse_chunk, np.concatenate([s[1] for s in steps], 1))
        for n, arr in cache._views().items():
            if arr is not None:
                np.testing.assert_array_equal(arr, getattr(single, n), err_msg=n)
    ro, rlse, _ = ref_forward(x)
    assert rel_l2(o_chunk, ro[:, L + 8:]) < BAR[key_dtype]


def test_free_slots_and_lse(rng):
    x = make_inputs(rng, 3, 8, 2, 2, 8, 8, gate=True)
    cache = new_cache(x, slots=3)
    pathattn.paged_prefill(*(tok(x, 0, 5)[n] for n in NAMES), cache, slots=np.array([2, 0, 1], np.int64))
    cache.evict(1)
    cache.reserve(None, 1)
    # Sequence 0 went to slot 2, sequence 1 to slot 0, sequence 2 to slot 1 (evicted): the step's rows follow.
    step = {n: (None if t is None else t[[1, 2, 0]]) for n, t in tok(x, 5, 6).items()}
    o, lse = pathattn.paged_decode(*(step[n] for n in NAMES), cache, return_lse=True)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert not o[1].any() and np.isneginf(lse[1]).all()
    ro, rlse, _ = ref_forward(tok(x, 0, 6))
    assert rel_l2(o[2], ro[0, 5:6]) < 2e-5 and rel_l2(lse[2], rlse[0, 5:6]) < 2e-5
    assert rel_l2(o[0], ro[1, 5:6]) < 2e-5 and rel_l2(lse[0], rlse[1, 5:6]) < 2e-5
    assert cache.lengths.tolist() == [6, -1, 6]


def test_torch_cpu_matches_numpy(rng):
    torch = pytest.importorskip("torch")
    if not pathattn.HAS_TORCH:
        pytest.skip("pathattn was imported without torch (PATHATTN_NO_TORCH=1)")
    x = make_inputs(rng, 2, 14, 4, 2, 16, 8, gate=True)
    xt = {n: (None if a is None else torch.from_numpy(a)) for n, a in x.items()}
    c_np = new_cache(x, key_dtype=np.float16, pending=3)
    c_t = pathattn.PagedCache(2, 64, 4, 2, 16, 8, 4, torch.float32, "cpu", gate=True, pending=3)
    assert c_t.k_pages.dtype == torch.float16 and c_t.block_table.dtype == torch.int32
    assert c_t.g_pages.dtype == torch.float64 and c_t.pend_k.dtype == torch.float32
    o_np = [pathattn.paged_prefill(*(tok(x, 0, 6)[n] for n in NAMES), c_np, extra=8)]
    o_t = [pathattn.paged_prefill(*(tok(xt, 0, 6)[n] for n in NAMES), c_t, extra=8)]
    for t in range(6, 14):
        o_np.append(pathattn.paged_decode(*(tok(x, t, t + 1)[n] for n in NAMES), c_np))
        o_t.append(pathattn.paged_decode(*(tok(xt, t, t + 1)[n] for n in NAMES), c_t))
    assert isinstance(o_t[-1], torch.Tensor) and o_t[-1].shape == (2, 1, 4, 8)
    np.testing.assert_array_equal(np.concatenate(o_np, 1), torch.cat(o_t, 1).numpy())
    np.testing.assert_array_equal(c_np.k_pages, c_t.k_pages.numpy())
    with pytest.raises(TypeError, match=r"^q: the cache holds torch arrays but q is a numpy array"):
        pathattn.paged_decode(*(tok(x, 0, 1)[n] for n in NAMES), c_t)
    with pytest.raises(TypeError, match=r"^key_dtype: expected torch.float16 or torch.float32"):
        pathattn.PagedCache(1, 4, 4, 1, 8, 8, 1, torch.bfloat16, key_dtype=torch.bfloat16)


def test_errors(rng):
    x = make_inputs(rng, 2, 6, 2, 2, 8, 8, gate=True)
    cache = new_cache(x)
    pathattn.paged_prefill(*(tok(x, 0, 4)[n] for n in NAMES), cache, extra=2)
    s = tok(x, 4, 5)
    args = [s[n] for n in NAMES]
    snapshot = {n: a.copy() for n, a in cache._views().items() if a is not None}

    def call(**kw):
        a = dict(zip(NAMES, args))
        a.update(kw)
        return pathattn.paged_decode(*(a[n] for n in NAMES), cache)

    with pytest.raises(TypeError, match=r"^cache: expected a pathattn.PagedCache"):
        pathattn.paged_decode(*args, None)
    with pytest.raises(ValueError, match=r"^cache\.g_pages: the cache has gate pages but g is absent"):
        call(g=None)
    with pytest.raises(ValueError, match=r"^q"):
        call(q=s["q"][:, :, :1])
    with pytest.raises(ValueError, match=r"^q: expected 4 dimensions"):
        call(q=s["q"][:, 0])
    with pytest.raises(ValueError, match=r"^beta: w and beta must be given together"):
        call(beta=None)
    with pytest.raises(ValueError, match=r"^(q|cache\.block_table)"):  # 1 row, the cache has 2 slots
        call(q=s["q"][:1], k=s["k"][:1], v=s["v"][:1], w=s["w"][:1], beta=s["beta"][:1], g=s["g"][:1])
    with pytest.raises(TypeError, match=r"^w: expected dtype"):
        call(w=s["w"].astype(np.int32))
    with pytest.raises(TypeError, match=r"^validate: expected a bool"):
        pathattn.paged_decode(*args, cache, validate=1)
    bad = cache.clone()
    bad.lengths[0] = 3  # 3 tokens but flushed at 4
    with pytest.raises(ValueError, match=r"^cache\.flushed: slot 0's flush point 4 is outside \[0, length 3\]"):
        pathattn.paged_decode(*args, bad)
    bad = cache.clone()
    bad.block_table[1, 0] = 99
    with pytest.raises(ValueError, match=r"^cache\.block_table: slot 1 page 0 is 99, outside the pool of 64 pages"):
        pathattn.paged_decode(*args, bad)
    with pytest.raises(ValueError, match=r"^cache\.pend_w: given, but w and beta are absent"):
        pathattn.paged_decode(args[0], args[1], args[2], None, None, args[5], cache)
    for n, a in snapshot.items():  # failed calls leave the cache alone
        np.testing.assert_array_equal(getattr(cache, n), a, err_msg=n)

    # paged_prefill and the allocator.
    p = tok(x, 0, 2)
    pargs = [p[n] for n in NAMES]
    with pytest.raises(ValueError, match=r"^slots: slot 0 is in use; evict it first"):
        pathattn.paged_prefill(*pargs, cache)
    fresh = new_cache(x, slots=3)
    with pytest.raises(ValueError, match=r"^slots: expected one slot per sequence \(2\), got 1"):
        pathattn.paged_prefill(*pargs, fresh, slots=[0])
    with pytest.raises(ValueError, match=r"^slots: expected distinct slots"):
        pathattn.paged_prefill(*pargs, fresh, slots=[1, 1])
    with pytest.raises(ValueError, match=r"^slots: expected a slot in \[0, 3\), got 3"):
        pathattn.paged_prefill(*pargs, fresh, slots=[0, 3])
    with pytest.raises(TypeError, match=r"^slots: expected an int, got float"):
        pathattn.paged_prefill(*pargs, fresh, slots=[0, 1.0])
    with pytest.raises(ValueError, match=r"^cu_seqlens"):
        pathattn.paged_prefill(*pargs, fresh, cu_seqlens=[0, 1])
    with pytest.raises(ValueError, match=r"^k: expected shape"):
        pathattn.paged_prefill(pargs[0], pargs[1][:, :1], *pargs[2:], fresh)
    with pytest.raises(ValueError, match=r"^extra: expected an int >= 0"):
        pathattn.paged_prefill(*pargs, fresh, extra=-1)
    assert fresh.free_pages == 64 and fresh.lengths.tolist() == [-1] * 3  # nothing allocated by the refusals
    with pytest.raises(ValueError, match=r"^slot: slot 2 is already free"):
        fresh.evict(2)
    with pytest.raises(ValueError, match=r"^slot: expected a slot in \[0, 3\), got -1"):
        fresh.evict(-1)
    with pytest.raises(ValueError, match=r"^n_tokens: expected an int >= 0"):
        cache.reserve(0, -1)

    # The constructor.
    base = dict(num_slots=1, num_pages=4, page_size=4, H=2, K=8, V=8, HQ=4, dtype=np.float32)
    for kw, err, msg in [(dict(pending=0), ValueError, r"^pending: expected an int >= 1"),
                         (dict(pending=pathattn.PAGED_MAX_PENDING + 1), ValueError, r"^pending: expected 1 \.\. 64"),
                         (dict(HQ=3), ValueError, r"^HQ: expected a multiple of H = 2"),
                         (dict(num_pages=0), ValueError, r"^num_pages: expected an int >= 1"),
                         (dict(page_size=2.0), TypeError, r"^page_size: expected an int"),
                         (dict(key_dtype=np.float64), TypeError, r"^key_dtype: expected numpy.float16"),
                         (dict(dtype=np.float64), TypeError, r"^dtype: float64 is not supported by the paged cache"),
                         (dict(dtype="nonsense"), TypeError, r"^dtype: expected a torch or numpy dtype"),
                         (dict(device="cuda"), ValueError, r"^device: numpy caches live in host memory"),
                         (dict(backend="gpu"), ValueError, r"^backend"),
                         (dict(scale=float("inf")), ValueError, r"^scale: expected a finite number")]:
        with pytest.raises(err, match=msg):
            pathattn.PagedCache(**dict(base, **kw))
