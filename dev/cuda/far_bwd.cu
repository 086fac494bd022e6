// dev/cuda/far_bwd.cu: the query side of the backward's far loop, alone: bwd_q's pass 2 over the keys of far
// superblocks without the crossings. Per 64-key chunk: S = q k^T, dP = dO v^T, P = 2^(S scale log2(e) - lse2),
// dS = P (dP - delta), gq += scale dS k; bf16 operands, fp32 accumulation. How fast does it run on mma.sync, as
// bwd_q runs it, and on wgmma with TMA tiles, as fwd_far runs the forward's (HISTORY.md v3.15: 545 TFLOP/s for the
// forward's loop in dev/cuda/far_tiling.cu vw6 against 320 on mma.sync)? Versions:
//   bq16: 4 warps x 16 rows (a 64-row tile), q and dO staged in shared memory once, k / v tiles double-buffered
//         by cp.async, S and dP by ldmatrix-fed mma.sync, gq += dS k with dS from registers: bwd_q's far loop;
//   bqw:  two warpgroups (128 rows), q and dO as register fragments (loaded once), 64-key chunks of k and v in
//         128-byte swizzled tiles loaded by TMA (one thread issues; three stages, full / empty mbarriers), S and
//         dP of chunk c issued together with gq += dS k of chunk c - 1, dS of chunk c computed while that runs.
//         Registers: q and dO fragments 64, S and dP 64, gq 64, dS fragments 16.
//   bkw:  the key side (bwd_k's far loop): two warpgroups of 64 keys each (a 128-key tile, k and v staged once
//         and read by the tensor cores as A operands from shared memory), 64-row query chunks of q and dO by
//         TMA and their lse / delta by bulk copies (three stages); per chunk S^T = k q^T and dP^T = v dO^T issued
//         together with dv += P^T dO and dk += scale dS^T q of the previous chunk. Registers: S^T and dP^T 64,
//         dv and dk 128, P^T and dS^T fragments 32 (ptxas: 255 and 56 bytes of spills);
//   bkw0: bkw with one group in flight at a time (dv / dk of chunk c - 1, then S^T / dP^T of chunk c), so that
//         P^T / dS^T fragments and the scores are never live together.
// Check: gq of head 0's first 128 rows against a host double computation (lse and delta exact for the first 256
// rows; the other rows get lse = 10, delta = 0: finite values for the timing); dk / dv of head 0's first 128 keys
// over the first 256 rows (bkw run on 256 rows for the check). Timing: H = 32 heads x 16384 rows x 8192 keys,
// K = V = 128 (the T = 16k shape's far work, as far_tiling): three products on the query side (6.6 TFLOP per
// run), four on the key side (8.8).
// Prediction (written before any run): bq16 near bwd_q's far-loop rate, ~200-250 TFLOP/s (two products from
// shared memory by ldmatrix, one with A from registers, 16 rows a warp); bqw 1.5-1.8x bq16 (fwd_far's ratio
// over fwd_scan on the forward's loop was ~1.7x); bkw at bqw's rate within 15% (one product more per chunk,
// the same overlap, A operands from shared memory).
// Build and run (from the repository root):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Idev/cuda dev/cuda/far_bwd.cu -o far_bwd
//   ./far_bwd            (or ./far_bwd bqw: only the versions whose name starts with that)
#include <algorithm>
#include <cmath>
#include <cstring>

#include "far_common.cuh"

using namespace pathattn::cuda;
using namespace pathattn::cuda::dev::far;

namespace {

constexpr int kStages = 3;

struct Args {
  const T* q;       // [H][kRows][K]
  const T* k;       // [H][kKeys][K]
  const T* v;       // [H][kKeys][V]
  const T* dO;      // [H][kRows][V]
  const float* lse2;   // [H][kRows] log2-sum-exp of the scaled scores (base 2)
  const float* delta;  // [H][kRows] rowsum(dO o)
  float* gq;        // [H][kRows][K] out
  float* dk;        // [H][kKeys][K] out (bkw)
  float* dv;        // [H][kKeys][V] out (bkw)
  float sl2, scale;
  int rows;         // query rows bkw walks per head (<= kRows)
  CUtensorMap tk, tv;  // k and v as 2-D [H kKeys][K] tensors, boxes of 64 keys x 64 columns, 128-byte swizzle
  CUtensorMap tk128, tv128;  // the same, boxes of 128 keys (bkw's key tile)
  CUtensorMap tq, tdo;  // q and dO as 2-D [H kRows][K] tensors, boxes of 64 rows x 64 columns (bkw)
};

// This warp's 16 rows of gq (C layout) to global, fp32.
__device__ __forceinline__ void store_gq(float* row0, const float (&gq)[K / 8][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
      *reinterpret_cast<float2*>(row0 + size_t(g + 8 * hr) * K + 8 * nt + 2 * t) =
          make_float2(gq[nt][2 * hr], gq[nt][2 * hr + 1]);
}

// dS = scale P (dP - delta) in place of s, P = 2^(s sl2 - lse2) (rows: lse2 / delta of this lane's two rows).
template <int NT>
__device__ __forceinline__ void ds_from(float (&s)[NT][4], const float (&dp)[NT][4], const float (&lse2)[2],
                                        const float (&dl)[2], float sl2, float scale) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pr = fast_exp2(s[nt][e] * sl2 - lse2[e >> 1]);
      s[nt][e] = scale * pr * (dp[nt][e] - dl[e >> 1]);
    }
}

// bq16: bwd_q's far loop.
__global__ void __launch_bounds__(128) bq16_kernel(Args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + kChunk * LK;
  T* Ks = dOs + kChunk * LV;
  T* Vs = Ks + 2 * kChunk * LK;
  const int head = blockIdx.x / (kRows / kChunk), tile = blockIdx.x % (kRows / kChunk);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const size_t row0 = size_t(head) * kRows + size_t(tile) * kChunk;
  const T* kp = a.k + size_t(head) * kKeys * K;
  const T* vp = a.v + size_t(head) * kKeys * V;
  load_tile_async<K>(Qs, a.q + row0 * K, K, kChunk);
  load_tile_async<V>(dOs, a.dO + row0 * V, V, kChunk);
  auto load = [&](int c, int st) {
    load_tile_async<K>(Ks + st * kChunk * LK, kp + size_t(c) * kChunk * K, K, kChunk);
    load_tile_async<V>(Vs + st * kChunk * LV, vp + size_t(c) * kChunk * V, V, kChunk);
    cp_async_commit();
  };
  load(0, 0);
  const size_t r0 = row0 + 16 * warp + g, r1 = r0 + 8;
  const float lse2[2] = {a.lse2[r0], a.lse2[r1]}, dl[2] = {a.delta[r0], a.delta[r1]};
  float gq[K / 8][4];
  zero_acc(gq);
  for (int c = 0; c < kNK; ++c) {
    const int st = c & 1;
    cp_async_wait_all();
    __syncthreads();
    if (c + 1 < kNK) load(c + 1, st ^ 1);
    const T* Kst = Ks + st * kChunk * LK;
    const T* Vst = Vs + st * kChunk * LV;
    float s[1][8][4], dp[1][8][4];
    zero_acc(s);
    zero_acc(dp);
    warp_mma_ss<T, 1, 8, false, false>(s, Qs, LK, 16 * warp, Kst, LK, 0, K);
    warp_mma_ss<T, 1, 8, false, false>(dp, dOs, LV, 16 * warp, Vst, LV, 0, V);
    ds_from(s[0], dp[0], lse2, dl, a.sl2, a.scale);
    warp_mma_rs<T, 4, K / 8, true>(gq, s[0], 1.f, Kst, LK, 0);
  }
  store_gq(a.gq + (row0 + 16 * warp) * K, gq);
}

// bqw: two warpgroups on wgmma, TMA tiles.
constexpr size_t kBqwSmem = 1024 + size_t(kStages) * kChunk * (K + V) * sizeof(T) + 2 * kStages * sizeof(uint64_t);

__global__ void __launch_bounds__(256, 1) bqw_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  T* Ks = reinterpret_cast<T*>(align1k(smem));
  T* Vs = Ks + kStages * kChunk * K;
  uint64_t* full = reinterpret_cast<uint64_t*>(Vs + kStages * kChunk * V);
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbar_init(&full[st], 1);
      mbar_init(&empty[st], 8);
    }
    mbar_init_fence();
  }
  __syncthreads();
  constexpr int kTile = 2 * kChunk;
  const int head = blockIdx.x / (kRows / kTile), tile = blockIdx.x % (kRows / kTile);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const size_t row0 = size_t(head) * kRows + size_t(tile) * kTile + 16 * warp;
  uint32_t qa[K / 16][4], da[V / 16][4];
  load_frags<T>(qa, a.q + row0 * K, K);
  load_frags<T>(da, a.dO + row0 * V, V);
  const float lse2[2] = {a.lse2[row0 + g], a.lse2[row0 + g + 8]};
  const float dl[2] = {a.delta[row0 + g], a.delta[row0 + g + 8]};

  auto issue = [&](int c) {  // thread 0: chunk c's k and v tiles into stage c % 3
    const int st = c % kStages;
    if (c >= kStages) mbar_wait(&empty[st], uint32_t(c / kStages - 1) & 1);
    mbar_expect_tx(&full[st], uint32_t(kChunk * (K + V) * sizeof(T)));
    const int row = head * kKeys + c * kChunk;
#pragma unroll 1
    for (int j = 0; j < K / 64; ++j) tma_load(Ks + st * kChunk * K + j * kChunk * 64, &a.tk, 64 * j, row, &full[st]);
#pragma unroll 1
    for (int j = 0; j < V / 64; ++j) tma_load(Vs + st * kChunk * V + j * kChunk * 64, &a.tv, 64 * j, row, &full[st]);
  };
  // K-major reads (S = q k^T, dP = dO v^T): a k-step is 16 columns (32 bytes) within a 64-column block of 64
  // rows (8 KB); N-major reads of k (gq += dS k): a k-step is 16 keys (2 KB), column blocks 8 KB apart.
  auto kmaj = [&](const T* base, int c, int kt, int D) {
    const char* t = reinterpret_cast<const char*>(base + (c % kStages) * kChunk * D);
    return smem_desc_sw128(t + (kt / 4) * kChunk * 128 + (kt % 4) * 32, 16, 1024);
  };
  auto knmaj = [&](int c, int kt) {
    const char* t = reinterpret_cast<const char*>(Ks + (c % kStages) * kChunk * K);
    return smem_desc_sw128(t + kt * 16 * 128, kChunk * 128, 1024);
  };
  float s[8][4], dp[8][4], gq[K / 8][4];
  uint32_t dsa[4][4];
  zero_acc(gq);
  auto issue_sdp = [&](int c) {
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) wg_rs<T, 0>(s, qa[kt], kmaj(Ks, c, kt, K), kt > 0);
#pragma unroll
    for (int kt = 0; kt < V / 16; ++kt) wg_rs<T, 0>(dp, da[kt], kmaj(Vs, c, kt, V), kt > 0);
    wg_commit();
  };
  auto issue_gq = [&](int c) {
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) wg_rs<T, 1>(gq, dsa[kt], knmaj(c, kt));
    wg_commit();
  };
  if (threadIdx.x == 0) {
    issue(0);
    issue(1);
  }
  __syncwarp();
  mbar_wait(&full[0], 0);
  fence_regs(s);
  fence_regs(dp);
  wg_fence();
  issue_sdp(0);
  wg_wait<0>();
  fence_regs(s);
  fence_regs(dp);
  ds_from(s, dp, lse2, dl, a.sl2, a.scale);
  pack_frags<T, 4>(dsa, s);
  for (int c = 1; c < kNK; ++c) {
    if (threadIdx.x == 0 && c + 1 < kNK) issue(c + 1);
    __syncwarp();
    mbar_wait(&full[c % kStages], uint32_t(c / kStages) & 1);
    fence_regs(s);
    fence_regs(dp);
    fence_regs(gq);
    fence_regs(dsa);
    wg_fence();
    issue_sdp(c);
    issue_gq(c - 1);
    wg_wait<1>();  // S_c, dP_c done; gq += dS k of chunk c - 1 may still run
    fence_regs(s);
    fence_regs(dp);
    ds_from(s, dp, lse2, dl, a.sl2, a.scale);
    wg_wait<0>();
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[(c - 1) % kStages]);
    fence_regs(gq);
    fence_regs(dsa);
    pack_frags<T, 4>(dsa, s);
  }
  fence_regs(gq);
  fence_regs(dsa);
  wg_fence();
  issue_gq(kNK - 1);
  wg_wait<0>();
  fence_regs(gq);
  store_gq(a.gq + row0 * K, gq);
}

// bkw: the key side on wgmma.
constexpr size_t kBkwSmem = 1024 + size_t(2 * kChunk) * (K + V) * sizeof(T) +
                            size_t(kStages) * kChunk * (K + V) * sizeof(T) +
                            size_t(kStages) * 2 * kChunk * sizeof(float) +
                            (2 * kStages + 1) * sizeof(uint64_t);

template <bool kOverlap>
__global__ void __launch_bounds__(256, 1) bkw_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  T* Kt = reinterpret_cast<T*>(align1k(smem));  // [128 keys][K], 64-column blocks
  T* Vt = Kt + 2 * kChunk * K;
  T* Qs = Vt + 2 * kChunk * V;  // [kStages][64][K]
  T* Ds = Qs + kStages * kChunk * K;  // [kStages][64][V]
  float* Ls = reinterpret_cast<float*>(Ds + kStages * kChunk * V);  // [kStages][64] lse2
  float* Dl = Ls + kStages * kChunk;                                 // [kStages][64] delta
  uint64_t* full = reinterpret_cast<uint64_t*>(Dl + kStages * kChunk);
  uint64_t* empty = full + kStages;
  uint64_t* kvbar = empty + kStages;
  if (threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbar_init(&full[st], 1);
      mbar_init(&empty[st], 8);
    }
    mbar_init(kvbar, 1);
    mbar_init_fence();
  }
  __syncthreads();
  constexpr int kTile = 2 * kChunk;
  const int head = blockIdx.x / (kKeys / kTile), ktile = blockIdx.x % (kKeys / kTile);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t4 = lane & 3, wg = warp >> 2;
  const int nqc = a.rows / kChunk;
  auto issue = [&](int c) {  // thread 0: query chunk c's q, dO tiles and its lse2 / delta into stage c % 3
    const int st = c % kStages;
    if (c >= kStages) mbar_wait(&empty[st], uint32_t(c / kStages - 1) & 1);
    mbar_expect_tx(&full[st], uint32_t(kChunk * (K + V) * sizeof(T) + 2 * kChunk * sizeof(float)));
    const int row = head * kRows + c * kChunk;
#pragma unroll 1
    for (int j = 0; j < K / 64; ++j) tma_load(Qs + st * kChunk * K + j * kChunk * 64, &a.tq, 64 * j, row, &full[st]);
#pragma unroll 1
    for (int j = 0; j < V / 64; ++j) tma_load(Ds + st * kChunk * V + j * kChunk * 64, &a.tdo, 64 * j, row, &full[st]);
    bulk_load(Ls + st * kChunk, a.lse2 + row, kChunk * sizeof(float), &full[st]);
    bulk_load(Dl + st * kChunk, a.delta + row, kChunk * sizeof(float), &full[st]);
  };
  // Descriptors as a base per tile plus compile-time offsets (>> 4) per k-step, so that the unrolled k-steps do
  // not hold a 64-bit descriptor each. A operands: this warpgroup's 64 keys of the key / value tile (K-major,
  // 128-row column blocks, 16 KB apart); B K-major: 64-row tiles, column blocks 8 KB apart, a k-step 32 bytes
  // within a block; B N-major: a k-step is 16 query rows (2 KB), column blocks 8 KB apart.
  const uint64_t ka = smem_desc_sw128(reinterpret_cast<const char*>(Kt) + wg * kChunk * 128, 16, 1024);
  const uint64_t va = smem_desc_sw128(reinterpret_cast<const char*>(Vt) + wg * kChunk * 128, 16, 1024);
  auto a_off = [](int kt) { return uint64_t(((kt / 4) * kTile * 128 + (kt % 4) * 32) >> 4); };
  auto k_off = [](int kt) { return uint64_t(((kt / 4) * kChunk * 128 + (kt % 4) * 32) >> 4); };
  auto n_off = [](int kt) { return uint64_t((kt * 16 * 128) >> 4); };
  auto kmaj = [&](const T* base, int c, int D) {
    return smem_desc_sw128(base + (c % kStages) * kChunk * D, 16, 1024);
  };
  auto nmaj = [&](const T* base, int c, int D) {
    return smem_desc_sw128(base + (c % kStages) * kChunk * D, kChunk * 128, 1024);
  };
  float s[8][4], dp[8][4], dv[V / 8][4], dk[K / 8][4];
  uint32_t pa[4][4], dsa[4][4];
  zero_acc(dv);
  zero_acc(dk);
  auto issue_sdp = [&](int c) {
    const uint64_t qb = kmaj(Qs, c, K), db = kmaj(Ds, c, V);
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) wg_ss<T, 0, 0>(s, ka + a_off(kt), qb + k_off(kt), kt > 0);
#pragma unroll
    for (int kt = 0; kt < V / 16; ++kt) wg_ss<T, 0, 0>(dp, va + a_off(kt), db + k_off(kt), kt > 0);
    wg_commit();
  };
  auto issue_acc = [&](int c) {
    const uint64_t dn = nmaj(Ds, c, V), qn = nmaj(Qs, c, K);
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) wg_rs<T, 1>(dv, pa[kt], dn + n_off(kt));
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) wg_rs<T, 1>(dk, dsa[kt], qn + n_off(kt));
    wg_commit();
  };
  auto pds = [&](int c) {  // P^T into s, scale dS^T into dp (columns are query rows)
    const float* l2 = Ls + (c % kStages) * kChunk;
    const float* dl = Dl + (c % kStages) * kChunk;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * nt + 2 * t4 + (e & 1);
        const float pr = fast_exp2(s[nt][e] * a.sl2 - l2[col]);
        s[nt][e] = pr;
        dp[nt][e] = a.scale * pr * (dp[nt][e] - dl[col]);
      }
  };
  if (threadIdx.x == 0) {
    mbar_expect_tx(kvbar, uint32_t(kTile * (K + V) * sizeof(T)));
    const int row = head * kKeys + ktile * kTile;
    for (int j = 0; j < K / 64; ++j) tma_load(Kt + j * kTile * 64, &a.tk128, 64 * j, row, kvbar);
    for (int j = 0; j < V / 64; ++j) tma_load(Vt + j * kTile * 64, &a.tv128, 64 * j, row, kvbar);
    issue(0);
    if (nqc > 1) issue(1);
  }
  __syncwarp();
  mbar_wait(kvbar, 0);
  mbar_wait(&full[0], 0);
  fence_regs(s);
  fence_regs(dp);
  wg_fence();
  issue_sdp(0);
  wg_wait<0>();
  fence_regs(s);
  fence_regs(dp);
  pds(0);
  pack_frags<T, 4>(pa, s);
  pack_frags<T, 4>(dsa, dp);
  for (int c = 1; c < nqc; ++c) {
    if (threadIdx.x == 0 && c + 1 < nqc) issue(c + 1);
    __syncwarp();
    mbar_wait(&full[c % kStages], uint32_t(c / kStages) & 1);
    fence_regs(s);
    fence_regs(dp);
    fence_regs(dv);
    fence_regs(dk);
    fence_regs(pa);
    fence_regs(dsa);
    wg_fence();
    if constexpr (kOverlap) {
      issue_sdp(c);
      issue_acc(c - 1);
      wg_wait<1>();  // S^T_c, dP^T_c done; the accumulations of chunk c - 1 may still run
      fence_regs(s);
      fence_regs(dp);
      pds(c);
      wg_wait<0>();
    } else {  // one group at a time: the fragments of chunk c - 1 are dead before chunk c's scores start
      issue_acc(c - 1);
      wg_wait<0>();
      fence_regs(pa);
      fence_regs(dsa);
      wg_fence();
      issue_sdp(c);
      wg_wait<0>();
      fence_regs(s);
      fence_regs(dp);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[(c - 1) % kStages]);
    fence_regs(dv);
    fence_regs(dk);
    fence_regs(pa);
    fence_regs(dsa);
    if constexpr (!kOverlap) pds(c);
    pack_frags<T, 4>(pa, s);
    pack_frags<T, 4>(dsa, dp);
  }
  fence_regs(dv);
  fence_regs(dk);
  fence_regs(pa);
  fence_regs(dsa);
  wg_fence();
  issue_acc(nqc - 1);
  wg_wait<0>();
  fence_regs(dv);
  fence_regs(dk);
  const size_t key0 = size_t(head) * kKeys + size_t(ktile) * kTile + 16 * warp;
  store_gq(a.dk + key0 * K, dk);
  store_gq(a.dv + key0 * V, dv);
}

// The host's double reference: lse2 / delta of head 0's first 256 rows (exact over all keys), gq of its first
// 128 rows; dk / dv of its first 128 keys over those 256 rows with the float lse2 / delta the device gets.
constexpr int kCheckRows = 4 * kChunk, kCheckKeys = 2 * kChunk;
struct HostRef {
  std::vector<double> gq, dk, dv;  // [128][K], [128][K], [128][V]
  std::vector<float> lse2, delta;  // [256]
};
HostRef host_ref(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                 const std::vector<float>& dO, double scale) {
  const double log2e = 1.4426950408889634;
  HostRef r{std::vector<double>(size_t(kCheckKeys) * K, 0.0), std::vector<double>(size_t(kCheckKeys) * K, 0.0),
            std::vector<double>(size_t(kCheckKeys) * V, 0.0), std::vector<float>(kCheckRows),
            std::vector<float>(kCheckRows)};
  auto dot = [](const float* x, const float* y, int n) {
    double d = 0;
    for (int i = 0; i < n; ++i) d += double(x[i]) * y[i];
    return d;
  };
  std::vector<double> sc(kKeys), dp(kKeys);
  for (int i = 0; i < kCheckRows; ++i) {
    double mx = -1e300;
    for (int j = 0; j < kKeys; ++j) {
      sc[j] = dot(&q[size_t(i) * K], &k[size_t(j) * K], K) * scale;
      dp[j] = dot(&dO[size_t(i) * V], &v[size_t(j) * V], V);
      mx = std::max(mx, sc[j]);
    }
    double sum = 0;
    for (int j = 0; j < kKeys; ++j) sum += std::exp(sc[j] - mx);
    const double lse = mx + std::log(sum);
    double delta = 0;
    for (int j = 0; j < kKeys; ++j) delta += std::exp(sc[j] - lse) * dp[j];
    r.lse2[i] = float(lse * log2e);
    r.delta[i] = float(delta);
    if (i >= kCheckKeys) continue;
    for (int j = 0; j < kKeys; ++j) {
      const double ds = scale * std::exp(sc[j] - lse) * (dp[j] - delta);
      for (int x = 0; x < K; ++x) r.gq[size_t(i) * K + x] += ds * k[size_t(j) * K + x];
    }
  }
  for (int j = 0; j < kCheckKeys; ++j)
    for (int i = 0; i < kCheckRows; ++i) {
      const double s = dot(&q[size_t(i) * K], &k[size_t(j) * K], K) * scale;
      const double pr = std::exp(s - double(r.lse2[i]) / log2e);
      const double ds = scale * pr * (dot(&dO[size_t(i) * V], &v[size_t(j) * V], V) - double(r.delta[i]));
      for (int x = 0; x < V; ++x) r.dv[size_t(j) * V + x] += pr * dO[size_t(i) * V + x];
      for (int x = 0; x < K; ++x) r.dk[size_t(j) * K + x] += ds * q[size_t(i) * K + x];
    }
  return r;
}

double rel_l2(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace

int main(int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : nullptr;
  const size_t nq = size_t(H) * kRows * K, nk = size_t(H) * kKeys * K, nv = size_t(H) * kKeys * V,
               nd = size_t(H) * kRows * V, nr = size_t(H) * kRows;
  uint64_t st = 0x9E3779B97F4A7C15ull;
  const std::vector<T> hq = uniform_bf16(nq, 2.f, st), hk = uniform_bf16(nk, 2.f, st), hv = uniform_bf16(nv, 1.f, st),
                       hd = uniform_bf16(nd, 1.f, st);
  const double scale = 1.0 / std::sqrt(double(K));
  const HostRef ref = host_ref(to_float(hq, size_t(kCheckRows) * K), to_float(hk, size_t(kKeys) * K),
                               to_float(hv, size_t(kKeys) * V), to_float(hd, size_t(kCheckRows) * V), scale);
  std::vector<float> hl(nr, float(10.0 * 1.4426950408889634)), hdl(nr, 0.f);
  std::copy(ref.lse2.begin(), ref.lse2.end(), hl.begin());
  std::copy(ref.delta.begin(), ref.delta.end(), hdl.begin());
  T *dq = upload(hq), *dk = upload(hk), *dv = upload(hv), *ddo = upload(hd);
  float *dl2 = upload(hl), *ddl = upload(hdl), *dgq, *ddk, *ddv;
  CK(cudaMalloc(&dgq, nq * sizeof(float)));
  CK(cudaMalloc(&ddk, nk * sizeof(float)));
  CK(cudaMalloc(&ddv, nv * sizeof(float)));
  Args args{dq, dk, dv, ddo, dl2, ddl, dgq, ddk, ddv, float(scale * 1.4426950408889634), float(scale), kRows,
            {}, {}, {}, {}, {}, {}};
  make_map(&args.tk, dk, K, kKeys, 64, kChunk, CU_TENSOR_MAP_SWIZZLE_128B);
  make_map(&args.tv, dv, V, kKeys, 64, kChunk, CU_TENSOR_MAP_SWIZZLE_128B);
  make_map(&args.tk128, dk, K, kKeys, 64, 2 * kChunk, CU_TENSOR_MAP_SWIZZLE_128B);
  make_map(&args.tv128, dv, V, kKeys, 64, 2 * kChunk, CU_TENSOR_MAP_SWIZZLE_128B);
  make_map(&args.tq, dq, K, kRows, 64, kChunk, CU_TENSOR_MAP_SWIZZLE_128B);
  make_map(&args.tdo, ddo, V, kRows, 64, kChunk, CU_TENSOR_MAP_SWIZZLE_128B);
  const double flop_q = 2.0 * H * double(kRows) * kKeys * (K + V + K);
  const double flop_k = 2.0 * H * double(kRows) * kKeys * 2 * (K + V);
  std::printf("far backward loops: H %d x %d rows x %d keys, K = V = %d, bf16 (query side %.2f, key side %.2f TFLOP "
              "per run)\n", H, kRows, kKeys, K, flop_q * 1e-12, flop_k * 1e-12);
  struct Ver {
    const char* name;
    void (*kern)(Args);
    bool key_side;
    int per_cta, threads;  // query rows (query side) or keys (key side) per CTA
    size_t smem;
  };
  const Ver vers[] = {
      {"bq16 (mma.sync, 16 rows / warp, q and dO in shared memory)", bq16_kernel, false, kChunk, 128,
       size_t(kChunk) * (LK + LV) * sizeof(T) + 2 * size_t(kChunk) * (LK + LV) * sizeof(T)},
      {"bqw  (wgmma, two warpgroups, TMA tiles, S / dP with the previous gq)", bqw_kernel, false, 2 * kChunk, 256,
       kBqwSmem},
      {"bkw  (wgmma, 128 keys, k / v as A from shared memory, S / dP with the previous dk / dv)", bkw_kernel<true>,
       true, 2 * kChunk, 256, kBkwSmem},
      {"bkw0 (bkw with one product group in flight at a time)", bkw_kernel<false>, true, 2 * kChunk, 256,
       kBkwSmem},
  };
  bool ok = true;
  std::vector<float> hg(size_t(kCheckKeys) * K), hdv(size_t(kCheckKeys) * V);
  for (const Ver& ver : vers) {
    if (only && std::strncmp(ver.name, only, std::strlen(only)) != 0) continue;
    CK(cudaFuncSetAttribute(ver.kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(ver.smem)));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ver.kern, ver.threads, ver.smem));
    const unsigned grid = unsigned(size_t(H) * (ver.key_side ? kKeys : kRows) / ver.per_cta);
    double err = 0;
    if (ver.key_side) {  // the check walks the first 256 rows only
      args.rows = kCheckRows;
      CK(cudaMemset(ddk, 0xff, nk * sizeof(float)));
      CK(cudaMemset(ddv, 0xff, nv * sizeof(float)));
      ver.kern<<<grid, ver.threads, ver.smem>>>(args);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(hg.data(), ddk, hg.size() * sizeof(float), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hdv.data(), ddv, hdv.size() * sizeof(float), cudaMemcpyDeviceToHost));
      err = std::max(rel_l2(hg, ref.dk), rel_l2(hdv, ref.dv));
      args.rows = kRows;
    } else {
      CK(cudaMemset(dgq, 0xff, nq * sizeof(float)));  // NaN: every output must be written
      ver.kern<<<grid, ver.threads, ver.smem>>>(args);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(hg.data(), dgq, hg.size() * sizeof(float), cudaMemcpyDeviceToHost));
      err = rel_l2(hg, ref.gq);
    }
    const bool pass = std::isfinite(err) && err <= 1e-2;
    ok = ok && pass;
    const float ms = dev::median_ms([&] { ver.kern<<<grid, ver.threads, ver.smem>>>(args); }, 5);
    const double flop = ver.key_side ? flop_k : flop_q;
    std::printf("%-90s %3d KB smem, %d CTAs / SM: %7.3f ms, %6.1f TFLOP/s, rel L2 %.2e %s\n", ver.name,
                int(ver.smem / 1024), per_sm, ms, flop / (ms * 1e-3) * 1e-12, err, pass ? "ok" : "FAIL");
  }
  std::printf(ok ? "all checks passed\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
}
