// cuda/kernels/fwd_far.cu: the forward's far part on Hopper (sm_90a). fwd_scan, run with p.ofar set, stops at its own
// superblock's first chunk and leaves the query state moved to the superblock's start (fp16, qtl), the output
// so far (normalized, fp32, ofar) and its log2-sum-exp (lsefar). This kernel continues each query chunk across
// the earlier superblocks: attention against their keys moved to the superblock's end (ks), then the query
// across the superblock, qt <- qt PS (fp16, as fwd_scan's). The loop is dev/cuda/far_tiling.cu's fastest
// (docs/cuda.md): 128 query rows a CTA (a superblock pair's two chunks, a warpgroup each), 128-key tiles by TMA
// into 128-byte swizzled shared memory with full / empty mbarriers, S = q k~^T and P V on wgmma with the scores
// of a chunk issued together with P V of the previous one. Between crossings the query state stays in shared
// memory as the fp16 fragments the next crossing multiplies (a global round trip cost far more); its room comes
// from keeping two k~ stages against three of v.
#include <algorithm>
#include <atomic>

#include "cuda/device/hopper.cuh"
#include "cuda/launchers.h"
#include "cuda/tensor_map.h"

namespace pathattn::cuda {
namespace {

constexpr int kFarThreads = 256;                                    // two warpgroups
constexpr int kFarKeys = 128;                                       // keys per far chunk
constexpr int kFarStages = 3;                                       // v: chunk c - 1, c, c + 1
constexpr int kFarKStages = 2;                                      // k~: chunk c, c + 1

// The tensor maps of one call: ks [NT][H][K] (3-D), v [B][T][H][V] with its strides (4-D), ps
// [nsuper H K][K] (2-D); boxes of 64 columns (128 bytes, 128-byte swizzle) by 128 key rows (K rows for ps).
struct FarMaps {
  CUtensorMap ks, v, ps;
  const int32_t* tiles;  // chunk-table index of each tile's first chunk (an even chunk past superblock 0)
};

// k~ and v stages, the superblock product (fp16), the query state (K / 16 16-byte fragments a thread), the keys'
// gate terms a v stage (with the gate), barriers.
template <int K, int V>
struct FarSmem {
  static constexpr size_t kTile = size_t(kFarKeys) * K * 2, vTile = size_t(kFarKeys) * V * 2;
  static constexpr size_t state = size_t(K / 16) * kFarThreads * 16, gate = size_t(kFarStages) * kFarKeys * 4;
  static constexpr size_t bytes = 1024 + kFarKStages * kTile + kFarStages * vTile + size_t(K) * K * 2 + state +
                                  gate + 8 * (2 * kFarStages + kFarKStages + 2);
};

// The CTA's mbarriers (thread 0): full / empty a v stage, kempty a k~ stage, then ps_full and ps_empty.
__device__ __forceinline__ void init_far_barriers(uint64_t* full) {
  uint64_t* empty = full + kFarStages;
  uint64_t* kempty = empty + kFarStages;
  uint64_t* ps_full = kempty + kFarKStages;
  uint64_t* ps_empty = ps_full + 1;
  if (threadIdx.x == 0) {
    for (int st = 0; st < kFarStages; ++st) {
      mbar_init(&full[st], 1);
      mbar_init(&empty[st], kFarThreads / 32);
    }
    for (int st = 0; st < kFarKStages; ++st) mbar_init(&kempty[st], kFarThreads / 32);
    mbar_init(ps_full, 1);
    mbar_init(ps_empty, kFarThreads / 32);
    mbar_init_fence();
  }
}

// The thread's fp16 query-state fragments (K / 16 k-steps of four words) in its own slots of Sq.
template <int K>
__device__ __forceinline__ void put_state(uint4* Sq, const uint32_t (&f)[K / 16][4]) {
#pragma unroll
  for (int kt = 0; kt < K / 16; ++kt)
    Sq[kt * kFarThreads + threadIdx.x] = make_uint4(f[kt][0], f[kt][1], f[kt][2], f[kt][3]);
}
template <int K>
__device__ __forceinline__ void get_state(const uint4* Sq, uint32_t (&f)[K / 16][4]) {
#pragma unroll
  for (int kt = 0; kt < K / 16; ++kt) {
    const uint4 u = Sq[kt * kFarThreads + threadIdx.x];
    f[kt][0] = u.x;
    f[kt][1] = u.y;
    f[kt][2] = u.z;
    f[kt][3] = u.w;
  }
}

// The state fwd_scan left for rows rr: queries qt (fp32), the output so far, m = its lse, l = 1 (once a row), the
// gate term. Rows past the sequence: zero, finite, never stored.
template <int K, int V, bool kGate>
__device__ __forceinline__ void load_far_rows(const KernelParams& p, int64_t tokq0, int hq, const int (&rr)[2],
                                              int nq, int t4, float gl2, float (&qt)[K / 8][4], float (&o)[V / 8][4],
                                              float (&m)[2], float (&l)[2], float (&Gq)[2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = rr[hr];
    const bool ok = r < nq;
    const int64_t row = (tokq0 + r) * p.HQ + hq;
    const __half* qrow = p.qtl + row * K;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt) {
      const float2 v2 = ok ? pair_f(qrow + 8 * nt + 2 * t4) : make_float2(0.f, 0.f);
      qt[nt][2 * hr] = v2.x;
      qt[nt][2 * hr + 1] = v2.y;
    }
    const float* orow = p.ofar + row * V;
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt) {
      const float2 v2 = ok ? *reinterpret_cast<const float2*>(orow + 8 * nt + 2 * t4) : make_float2(0.f, 0.f);
      o[nt][2 * hr] = v2.x;
      o[nt][2 * hr + 1] = v2.y;
    }
    m[hr] = ok ? p.lsefar[row] : 0.f;
    l[hr] = t4 == 0 ? 1.f : 0.f;
    Gq[hr] = (kGate && ok) ? p.G[row] * gl2 : 0.f;
  }
}

// Scores to P in s (scaled to base 2, the gate terms with kGate: Gk = the chunk's keys' G gl2); alpha rescales o.
template <bool kGate, int NS>
__device__ __forceinline__ void far_softmax(float (&s)[NS][4], const float* Gk, const float (&Gq)[2], float sl2, int t4,
                                            float (&m)[2], float (&l)[2], float (&alpha)[2]) {
  if constexpr (kGate) {
#pragma unroll
    for (int nt = 0; nt < NS; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = s[nt][e] * sl2 + Gq[e >> 1] - Gk[8 * nt + 2 * t4 + (e & 1)];
  } else {
#pragma unroll
    for (int nt = 0; nt < NS; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= sl2;
  }
  softmax_step(s, m, l, alpha);
}

// Crossing n (superblock S - 1 - n's chunks done): qt <- qt PS with fp16 operands, the state from Sq (the fp32
// result rounded to fp16, as the next crossing would round it); qa = the new state in T, Sq too where `more`.
template <typename T, int K>
__device__ __forceinline__ void far_cross(int n, bool more, uint4* Sq, uint64_t* ps_full, uint64_t* ps_empty,
                                          const __half* PSs, int lane, uint32_t (&qa)[K / 16][4]) {
  uint32_t qh[K / 16][4];
  get_state<K>(Sq, qh);
  mbar_wait(ps_full, uint32_t(n) & 1);
  float y[K / 8][4];
  fence_regs(qh);
  wg_fence();
#pragma unroll
  for (int kt = 0; kt < K / 16; ++kt)
    wg_rs<__half, 1>(y, qh[kt], smem_desc_sw128(reinterpret_cast<const char*>(PSs) + kt * 16 * 128, K * 128, 1024),
                     kt > 0);
  wg_commit();
  wg_wait<0>();
  fence_regs(y);
  __syncwarp();
  if (lane == 0) mbar_arrive(ps_empty);
  if (more) {  // another crossing follows
    pack_frags<__half, K / 16>(qh, y);
    put_state<K>(Sq, qh);
  }
  pack_frags<T, K / 16>(qa, y);
}

template <typename T, int K, int V, bool kGate>
__global__ void __launch_bounds__(kFarThreads, 1) fwd_far_kernel(const __grid_constant__ KernelParams p,
                                                                 const __grid_constant__ FarMaps mp) {
#ifdef PA_SM90A
  constexpr int NS = kFarKeys / 8, PK = kFarKeys / 16;
  extern __shared__ __align__(16) uint8_t smem[];
  T* Ks = reinterpret_cast<T*>(align1k(smem));
  T* Vs = Ks + kFarKStages * kFarKeys * K;
  __half* PSs = reinterpret_cast<__half*>(Vs + kFarStages * kFarKeys * V);
  uint4* Sq = reinterpret_cast<uint4*>(PSs + K * K);  // [K / 16][threads]: a thread's fp16 state fragments
  float* Gst = reinterpret_cast<float*>(Sq + (K / 16) * kFarThreads);  // [v stage][128 keys] gate terms (gc)
  uint64_t* full = reinterpret_cast<uint64_t*>(Gst + kFarStages * kFarKeys);
  uint64_t* empty = full + kFarStages;    // v stage free (P V done), one arrival a warp
  uint64_t* kempty = empty + kFarStages;  // k~ stage free (scores done), one arrival a warp
  uint64_t* ps_full = kempty + kFarKStages;
  uint64_t* ps_empty = ps_full + 1;
  init_far_barriers(full);
  __syncthreads();
  const int hq = blockIdx.x % p.HQ, h = hq / p.group;
  const ChunkDesc ch = p.chunks[mp.tiles[blockIdx.x / p.HQ]];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int qc = ch.c + (warp >> 2);                       // this warpgroup's query chunk
  const int nq = max(0, min(kChunk, ch.len - qc * kChunk));  // 0: the pair's second chunk is past the end
  const int rr[2] = {16 * (warp & 3) + g, 16 * (warp & 3) + g + 8};
  const int sc = p.sc, fps = sc * kChunk / kFarKeys;  // chunks a superblock, far chunks a superblock (sc even)
  const int S = ch.c / sc, nfc = S * fps;             // far superblocks S - 1 .. 0, their far chunks
  const int64_t seq_tok0 = ch.b * p.T + ch.t0, tokq0 = seq_tok0 + int64_t(qc) * kChunk;
  const float LOG2E = 1.4426950408889634f;
  const float sl2 = p.scale * LOG2E, gl2 = kGate ? p.gate_scale * LOG2E : 0.f;
  // Far chunk c: superblock S - 1 - c / fps, its 128 keys from c % fps (the order within a superblock is free).
  auto key0 = [&](int c) { return int64_t(S - 1 - c / fps) * sc * kChunk + (c % fps) * kFarKeys; };
  // Thread 0: chunk c's k~ (stage c % 2), v and gate terms (stage c % 3) once released; all arrive on full[c % 3].
  auto issue = [&](int c) {
    const int st = c % kFarStages, kst = c % kFarKStages;
    if (c >= kFarStages) mbar_wait(&empty[st], uint32_t(c / kFarStages - 1) & 1);
    if (c >= kFarKStages) mbar_wait(&kempty[kst], uint32_t(c / kFarKStages - 1) & 1);
    mbar_expect_tx(&full[st], uint32_t(kFarKeys * (K + V) * 2 + (kGate ? kFarKeys * 4 : 0)));
    const int64_t t = ch.t0 + key0(c);
    if constexpr (kGate)
      bulk_load(Gst + st * kFarKeys, p.gc + (int64_t(hq) * p.nchunks + ch.first + key0(c) / kChunk) * kChunk,
                kFarKeys * 4, &full[st]);
#pragma unroll 1
    for (int j = 0; j < K / 64; ++j)
      tma_load(Ks + kst * kFarKeys * K + j * kFarKeys * 64, &mp.ks, 64 * j, h, int(seq_tok0 + key0(c)), &full[st]);
#pragma unroll 1
    for (int j = 0; j < V / 64; ++j)
      tma_load(Vs + st * kFarKeys * V + j * kFarKeys * 64, &mp.v, 64 * j, h, int(t), int(ch.b), &full[st]);
  };
  // Thread 0: the product of superblock S - 1 - n (the n-th crossing), once every warp released the (n - 1)-th.
  auto issue_ps = [&](int n) {
    if (n >= 1) mbar_wait(ps_empty, uint32_t(n - 1) & 1);
    mbar_expect_tx(ps_full, uint32_t(K * K * 2));
    const int row = int((int64_t(ch.sfirst + S - 1 - n) * p.H + h) * K);
#pragma unroll 1
    for (int j = 0; j < K / 64; ++j) tma_load(PSs + j * K * 64, &mp.ps, 64 * j, row, ps_full);
  };
  auto kdesc = [&](int c, int kt) {  // k~ K-major: a k-step is 16 columns (32 bytes) within a 64-column block
    const char* t = reinterpret_cast<const char*>(Ks + (c % kFarKStages) * kFarKeys * K);
    return smem_desc_sw128(t + (kt / 4) * kFarKeys * 128 + (kt % 4) * 32, 16, 1024);
  };
  auto vdesc = [&](int c, int kt) {  // v N-major: a k-step is 16 keys (2 KB); column blocks kFarKeys rows apart
    const char* t = reinterpret_cast<const char*>(Vs + (c % kFarStages) * kFarKeys * V);
    return smem_desc_sw128(t + kt * 16 * 128, kFarKeys * 128, 1024);
  };
  // P V of chunk c done: its v stage; the scores of chunk c done: its k~ stage.
  auto release = [&](int c) { __syncwarp(); if (lane == 0) mbar_arrive(&empty[c % kFarStages]); };
  auto release_k = [&](int c) { __syncwarp(); if (lane == 0) mbar_arrive(&kempty[c % kFarKStages]); };
  // The first chunks' tiles and the first product load while the state below does.
  if (threadIdx.x == 0) {
    issue(0);
    if (nfc > 1) issue(1);
    if (S > 1) issue_ps(0);
  }
  // The state fwd_scan left: queries (qa in T; fp16 fragments in Sq for the crossings), output so far, its lse.
  float o[V / 8][4];
  float m[2], l[2], alpha[2], Gq[2];
  uint32_t qa[K / 16][4];
  {
    float qt[K / 8][4];
    load_far_rows<K, V, kGate>(p, tokq0, hq, rr, nq, t4, gl2, qt, o, m, l, Gq);
    pack_frags<T, K / 16>(qa, qt);
    if (S > 1) {
      uint32_t qh[K / 16][4];
      pack_frags<__half, K / 16>(qh, qt);
      put_state<K>(Sq, qh);
    }
  }

  float s[NS][4];
  uint32_t pa[PK][4];
  auto issue_scores = [&](int c) {
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) wg_rs<T, 0>(s, qa[kt], kdesc(c, kt), kt > 0);
    wg_commit();
  };
  auto issue_pv = [&](int c) {
#pragma unroll
    for (int kt = 0; kt < PK; ++kt) wg_rs<T, 1>(o, pa[kt], vdesc(c, kt));
    wg_commit();
  };
  auto softmax = [&](int c) { far_softmax<kGate>(s, Gst + (c % kFarStages) * kFarKeys, Gq, sl2, t4, m, l, alpha); };
  auto cross = [&](int c) {  // across superblock S - c / fps, its chunks done
    const int n = c / fps - 1;
    far_cross<T, K>(n, n + 1 < S - 1, Sq, ps_full, ps_empty, PSs, lane, qa);
  };


  __syncwarp();
  mbar_wait(&full[0], 0);
  fence_regs(s);
  wg_fence();
  issue_scores(0);
  wg_wait<0>();
  fence_regs(s);
  release_k(0);
  softmax(0);
  scale_rows(o, alpha);  // o starts from fwd_scan's output, relative to the initial m
  pack_frags<T, PK>(pa, s);
  for (int c = 1; c < nfc; ++c) {
    if (threadIdx.x == 0) {
      if (c + 1 < nfc) issue(c + 1);
      // The next superblock product once every warp is past this one (its crossing ran at c - 1).
      if (c % fps == 1 && c > 1 && c / fps < S - 1) issue_ps(c / fps);
    }
    __syncwarp();
    mbar_wait(&full[c % kFarStages], uint32_t(c / kFarStages) & 1);
    if (c % fps == 0) cross(c);
    fence_regs(s, o, pa, qa);
    wg_fence();
    issue_scores(c);
    issue_pv(c - 1);
    wg_wait<1>();  // S_c done; P V of chunk c - 1 may still run
    fence_regs(s);
    release_k(c);
    softmax(c);
    wg_wait<0>();  // P V done: o and pa are ours again
    release(c - 1);
    fence_regs(o, pa);
    scale_rows(o, alpha);
    pack_frags<T, PK>(pa, s);
  }
  fence_regs(o, pa);
  wg_fence();
  issue_pv(nfc - 1);
  wg_wait<0>();
  fence_regs(o);

  store_fwd_rows<T, V>(p, ch, qc, hq, rr, nq, o, m, l);
#endif
}

template <typename T, int K, bool kGate>
cudaError_t far_t(const KernelParams& p, const FarMaps& mp, int ntiles, cudaStream_t s) {
  return launch_with_smem(fwd_far_kernel<T, K, K, kGate>, dim3(unsigned(int64_t(ntiles) * p.HQ)), kFarThreads,
                          FarSmem<K, K>::bytes, s, p, mp);
}

template <typename T>
cudaError_t far_dispatch(const KernelParams& p, const FarMaps& mp, int ntiles, cudaStream_t s) {
  if (p.K == 64) return p.gate ? far_t<T, 64, true>(p, mp, ntiles, s) : far_t<T, 64, false>(p, mp, ntiles, s);
  return p.gate ? far_t<T, 128, true>(p, mp, ntiles, s) : far_t<T, 128, false>(p, mp, ntiles, s);
}

}  // namespace

bool far_device_ok(size_t smem) {
#ifndef PATHATTN_CUDA_SM90A_CODE
  (void)smem;
  return false;  // no sm_90a device code in this build: the far kernels are empty
#endif
  if (!kFarKernels) return false;  // a dev build without the far kernels (heuristics.h)
  // Per device (cached): an sm_90a binary of the far kernels (they have a body only there), a Hopper device,
  // its opt-in shared memory a block, and the driver's tensor-map encoder. Errors of these queries are cleared.
  constexpr int kDevs = 64;
  static std::atomic<int> cache[kDevs] = {};   // 0: unknown, 1: sm_90a binary on Hopper with an encoder, 2: not
  static std::atomic<int> optin[kDevs] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (dev < 0 || dev >= kDevs) return false;
  if (cache[dev].load() == 0) {
    int major = 0, opt = 0;
    cudaFuncAttributes attr{};
    bool failed = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
                  cudaDeviceGetAttribute(&opt, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess;
    bool ok = !failed && major == 9;
    if (ok) {
      failed = cudaFuncGetAttributes(&attr, fwd_far_kernel<__half, 64, 64, false>) != cudaSuccess;
      ok = !failed && attr.binaryVersion == 90 && tensor_map_encoder() != nullptr;
    }
    if (failed) cudaGetLastError();  // only this function's own failed query
    optin[dev].store(opt);
    cache[dev].store(ok ? 1 : 2);
  }
  return cache[dev] == 1 && size_t(optin[dev].load()) >= smem;
}

int far_grid(int64_t items) {
  int sms = 0;
  if (device_attr(cudaDevAttrMultiProcessorCount, &sms) != cudaSuccess) return 0;
  return int(std::min<int64_t>(items, sms));
}

bool fwd_far_usable(const KernelParams& p) {
  if (!p.path || p.K != p.V || (p.K != 64 && p.K != 128)) return false;
  if (!tma_aligned(p.v, p.v_s)) return false;
  if (int64_t(p.B) * p.T >= (int64_t(1) << 31) || int64_t(p.B) * p.T * p.H * p.K >= (int64_t(1) << 40)) return false;
  return far_device_ok(FarSmem<128, 128>::bytes);
}

cudaError_t launch_fwd_far(const KernelParams& p, const int32_t* tiles, int ntiles, int dtype, cudaStream_t s) {
  if (ntiles == 0) return cudaSuccess;
  const CUtensorMapDataType dt = dtype == 0 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  FarMaps mp{};
  mp.tiles = tiles;
  const int64_t NT = int64_t(p.B) * p.T;
  if (!map_tokens(&mp.ks, dt, p.ks, p.K, p.H, NT, kFarKeys) ||
      !map_bthd(&mp.v, dt, p.v, p.v_s, p.V, p.H, p.T, p.B, kFarKeys) ||
      !map_matrix(&mp.ps, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, p.ps, p.K, int64_t(p.nsuper) * p.H * p.K, p.K))
    return cudaErrorInvalidValue;
  return dtype == 0 ? far_dispatch<__half>(p, mp, ntiles, s) : far_dispatch<__nv_bfloat16>(p, mp, ntiles, s);
}

}  // namespace pathattn::cuda
