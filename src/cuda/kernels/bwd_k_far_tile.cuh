// cuda/kernels/bwd_k_far_tile.cuh: one key tile of the key side's far backward (bwd_k_far.cu, which holds the
// kernel and its launchers): the maps, the shared memory, and the tile's phases as member functions of KfTile.
#pragma once

#include <cstdint>

#include "cuda/device/hopper.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

constexpr int kKfThreads = 256;  // two warpgroups
constexpr int kKfKeys = 128;     // keys per tile: the two chunks of a superblock pair
// Query stages: items j - 1, j, j + 1; at K = 64 with kFuse a fourth (j - 2, whose dq reductions may still be
// reading it while item j + 1 loads into j - 3's).

struct KfMaps {
  CUtensorMap ks;    // [NT][H][K]: boxes of 64 columns x 128 keys
  CUtensorMap v;     // [B][T][H][V] with v's strides: the same boxes
  CUtensorMap park;  // [rows][K] this call's parked key states (kp.scratch): 64 columns x 128 rows
  CUtensorMap qhat;  // [NT][HQ][K]: 64 columns x 64 query rows
  CUtensorMap dout;  // [B][T][HQ][V] with dO's strides: 64 columns x 64 query rows
  CUtensorMap ps;    // [nsuper H K][K] fp16: 64 columns x K rows
  CUtensorMap dqt;   // kFuse: [NT][HQ][K] fp32, the reductions' target: 32 columns x 64 query rows, paired
  // p.far_half > 0 (double blocks): the chains' ks (odd halves' key tiles), qhat and dqt (even halves' queries).
  CUtensorMap ks1, qhat1, dqt1;
  const int32_t* tiles;  // chunk-table index of each tile's first (even) chunk, most work first
  int* next;             // items handed out past the first gridDim.x (zeroed before the launch)
  const float2* lsd;     // [HQ][nchunks][64] (lse in base 2, delta) per query row; +inf past the sequence
  const int32_t* park_first;  // [grid + 1] each CTA's first parked state (128 x K each), from far_park_first
};

template <int K, bool kFuse>
struct KfSmem {
  static constexpr int stages = kFuse && K == 64 ? 4 : 3;
  static constexpr size_t kt = size_t(kKfKeys) * K * 2, q = size_t(kChunk) * K * 2, lsd = size_t(kChunk) * 8;
  // With kFuse: two buffers of dS^T ([128 keys][64 query rows], 16-bit), the staged h over both at a crossing.
  static constexpr size_t ds = kFuse ? 2 * size_t(kKfKeys) * kChunk * 2 : 0;
  // Kt, Vt, the stages' q / dO tiles, the superblock product (fp16), dS^T, the stages' scalars, barriers.
  static constexpr size_t bytes =
      1024 + 2 * kt + stages * 2 * q + size_t(K) * K * 2 + ds + stages * lsd + 8 * 16;
  static_assert(!kFuse || ds >= kt, "bwd_k_far: the staged h lies over the dS^T buffers");
};

// The CTA's state for KfTile, set by the kernel: the shared-memory carve-up, the barriers, the thread's
// coordinates, the wgmma descriptor bases; the product pipe and the running barrier counts by reference (the
// kernel's, kept across tiles).
template <typename T>
struct KfCta {
  T *Kt, *Vt, *Qs, *Ds, *Dss;
  float2* Ls;
  uint64_t *full, *empty, *kv_full, *kt_full, *kt_empty;
  PsPipe& ps;
  float* hred;             // kFuse: the warps' largest |h| at a crossing
  const int& park_row0_s;  // this CTA's first parked row (in shared memory)
  int warp, lane, g, t4, wg;
  float sl2, gl2;
  uint32_t &n_q, &n_kv, &n_kt;
  uint64_t ka, va;
};

// A tile's coordinates, set by the kernel: kv head h, first chunk ch, key chunk kc in superblock sbk, odd_keys,
// the last query chunk and superblock, the superblock crossings n1, token offsets, pass 2's query items.
struct KfPos {
  int h;
  ChunkDesc ch;
  int kc, sbk;
  bool odd_keys;
  int last, last_sb, n1;
  int64_t seq_tok0, tokk0;
  int n_last, nit;
};

// One tile's phases (pass 1, pass 2's superblock loop, its crossings and items) and the steps they share, as
// member functions; the accumulators are the kernel's arrays.
template <typename T, int K, bool kGate, bool kFuse>
struct KfTile : KfCta<T>, KfPos {
  using Cta = KfCta<T>;
  using Cta::Kt, Cta::Vt, Cta::Qs, Cta::Ds, Cta::Dss, Cta::Ls, Cta::full, Cta::empty, Cta::kv_full, Cta::kt_full,
      Cta::kt_empty, Cta::ps, Cta::hred, Cta::park_row0_s, Cta::warp, Cta::lane, Cta::g, Cta::t4, Cta::wg, Cta::sl2,
      Cta::gl2, Cta::n_q, Cta::n_kv, Cta::n_kt, Cta::ka, Cta::va;
  static constexpr int V = K, KB = K / 64;  // 64-column blocks of a row
  static constexpr int kKfStages = KfSmem<K, kFuse>::stages;
  // Fused at K = 128: each warpgroup stages and adds its own half of dq's boxes, waiting only for its own warps'
  // stores (a named barrier) and for both warpgroups' release of the item's stage (its empty barrier), not for two
  // CTA barriers an item (faster at K = 128 only).
  static constexpr bool kWgDq = kFuse && K == 128;
  static constexpr int kDqN = K / 16;  // dq's n-blocks of 8 a warpgroup
  static constexpr bool kOverlap = K == 64;  // item j's scores with item j - 1's dv / h (pass2)

  const KernelParams& p;
  const KfMaps& mp;
  // Pass 2's accumulators: S^T, dP^T (then P^T, dS^T), dv, h, the A fragments P^T / dS^T, dq (kFuse).
  float (&s)[8][4], (&dp)[8][4], (&dv)[K / 8][4], (&hk)[K / 8][4];
  uint32_t (&pa)[4][4], (&dsa)[4][4];
  float (&dq)[kDqN][4];

  __device__ __forceinline__ KfTile(const KernelParams& kp, const KfMaps& kmp, const Cta& c, const KfPos& pos,
                                    float (&s_)[8][4], float (&dp_)[8][4], float (&dv_)[K / 8][4],
                                    float (&hk_)[K / 8][4], uint32_t (&pa_)[4][4], uint32_t (&dsa_)[4][4],
                                    float (&dq_)[kDqN][4])
      : Cta(c), KfPos(pos), p(kp), mp(kmp), s(s_), dp(dp_), dv(dv_), hk(hk_), pa(pa_), dsa(dsa_), dq(dq_) {}

  // Descriptor offsets: B K-major: a query stage's 64-row blocks; B N-major: k-steps of 16 query rows within a
  // block, blocks 64 rows apart.
  static __device__ __forceinline__ uint64_t a_off(int kt) {
    return uint64_t(((kt / 4) * kKfKeys * 128 + (kt % 4) * 32) >> 4);
  }
  static __device__ __forceinline__ uint64_t k_off(int kt) {
    return uint64_t(((kt / 4) * kChunk * 128 + (kt % 4) * 32) >> 4);
  }
  static __device__ __forceinline__ uint64_t n_off(int kt) { return uint64_t((kt * 16 * 128) >> 4); }
  static __device__ __forceinline__ uint64_t stage_kmaj(const T* base, uint32_t n) {
    return smem_desc_sw128(base + (n % kKfStages) * kChunk * K, 16, 1024);
  }
  static __device__ __forceinline__ uint64_t stage_nmaj(const T* base, uint32_t n) {
    return smem_desc_sw128(base + (n % kKfStages) * kChunk * K, kChunk * 128, 1024);
  }
  __device__ __forceinline__ bool odd_half(int c) const { return (c / p.far_half) % 2 != 0; }
  __device__ __forceinline__ int chunk_of(int j) const {  // item j's query chunk
    const int c = j / p.group;
    return c < n_last ? last - c : (last_sb - 1 - (c - n_last) / p.sc) * p.sc + p.sc - 1 - (c - n_last) % p.sc;
  }
  __device__ __forceinline__ int head_of(int j) const { return h * p.group + j % p.group; }  // item j's query head

  // Producer (thread 0): the superblock product of crossing i (pass 1: PS_{sbk+1+i}; pass 2: PS_{last_sb-1-(i-n1)}),
  // once the previous one was released.
  __device__ __forceinline__ void issue_ps(int i) {
    const int a = i < n1 ? sbk + 1 + i : last_sb - 1 - (i - n1);
    ps.template load<K>(&mp.ps, int((int64_t(ch.sfirst + a) * p.H + h) * K));
  }
  // Producer: query item j (qhat, dO, scalars) into stage n_q + j.
  __device__ __forceinline__ void issue_q(int j) {
    // The stage is read by dq's reductions (add_dq): with four stages the latest group may still read its own.
    if constexpr (kFuse) bulk_wait<kKfStages - 3, true>();
    const uint32_t n = n_q + uint32_t(j);
    const int st = int(n % kKfStages);
    if (n >= kKfStages) mbar_wait(&empty[st], (n / kKfStages - 1) & 1);
    mbar_expect_tx(&full[st], uint32_t(kChunk * (K + V) * 2 + kChunk * 8));
    const int qc = chunk_of(j), hq = head_of(j);
    const int64_t t = ch.t0 + int64_t(qc) * kChunk;
    const CUtensorMap* qmap = p.far_half > 0 && !odd_half(qc) ? &mp.qhat1 : &mp.qhat;
#pragma unroll 1
    for (int b = 0; b < KB; ++b) {
      tma_load(Qs + st * kChunk * K + b * kChunk * 64, qmap, 64 * b, hq, int(seq_tok0 + int64_t(qc) * kChunk),
               &full[st]);
      tma_load(Ds + st * kChunk * V + b * kChunk * 64, &mp.dout, 64 * b, hq, int(t), int(ch.b), &full[st]);
    }
    bulk_load(Ls + st * kChunk, mp.lsd + (int64_t(hq) * p.nchunks + ch.first + qc) * kChunk, kChunk * 8, &full[st]);
  }
  // Producer: kt_a into Kt (from ks for a = sbk + 1, else from its parking slot), completing `bar`.
  __device__ __forceinline__ void issue_kt(int a, uint64_t* bar) {
#pragma unroll 1
    for (int b = 0; b < KB; ++b) {
      if (a == sbk + 1) tma_load(Kt + b * kKfKeys * 64, odd_keys ? &mp.ks1 : &mp.ks, 64 * b, h, int(tokk0), bar);
      else tma_load(Kt + b * kKfKeys * 64, &mp.park, 64 * b, park_row0_s + (a - sbk - 2) * kKfKeys, bar);
    }
  }

  // The tile's start: the first product and query item issued once the previous tile is done with shared memory.
  __device__ __forceinline__ void begin() {
    // (kWgDq: the second warpgroup's dq reductions have read the stages issue_q(0) may load into.)
    if (kWgDq && threadIdx.x == 128) bulk_wait<kKfStages - 3, true>();
    __syncthreads();  // the previous tile is done with Kt, Vt and every warp's reads
    if (threadIdx.x == 0) {
      if (n1 > 0) issue_ps(0);
      issue_q(0);  // item j + 1 is issued at item j (its stage was released at item j - 1)
    }
  }
  // Pass 1: kt (this warp's 16 keys, fp32) from ks across superblocks sbk + 1 .. last_sb - 1, each state parked;
  // then the tile's v and kt_{last_sb} issued.
  __device__ __forceinline__ void pass1() {
    const int n1 = this->n1;  // (read in the loop, thread 0's condition below compiled to two branches)
    if (n1 > 0) {
      float kt[K / 8][4];
      const T* ksp = static_cast<const T*>(odd_keys ? p.far1_ks : p.ks);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const T* src = ksp + ((tokk0 + 16 * warp + g + 8 * hr) * p.H + h) * K;
#pragma unroll
        for (int nt = 0; nt < K / 8; ++nt) {
          kt[nt][2 * hr] = to_f(src[8 * nt + 2 * t4]);
          kt[nt][2 * hr + 1] = to_f(src[8 * nt + 2 * t4 + 1]);
        }
      }
      for (int i = 0; i < n1; ++i) {
        ps.template apply<K, true, false>(kt);  // kt <- kt PS^T
        if (threadIdx.x == 0 && i + 1 < 2 * n1) issue_ps(i + 1);
        T* const park = static_cast<T*>(static_cast<void*>(p.scratch)) + size_t(park_row0_s) * K;
        store_tile<T, K>(park + size_t(i) * kKfKeys * K, K, kt);  // kt_{sbk+2+i}
      }
      // The parked states are read back by TMA (the async proxy).
      asm volatile("fence.proxy.async.global;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      mbar_expect_tx(kv_full, uint32_t(kKfKeys * (K + V) * 2));
#pragma unroll 1
      for (int b = 0; b < KB; ++b) tma_load(Vt + b * kKfKeys * 64, &mp.v, 64 * b, h, int(ch.t0 + int64_t(kc) * kChunk),
                                            int(ch.b), kv_full);
      issue_kt(last_sb, kv_full);
    }
  }

  // ---- Pass 2's products and steps (item n: the n-th query item of the CTA, n_q + j).
  __device__ __forceinline__ void issue_s(uint32_t n) {
    const uint64_t qb = stage_kmaj(Qs, n);
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) wg_ss<T, 0, 0>(s, ka + a_off(kt), qb + k_off(kt), kt > 0);
  }
  __device__ __forceinline__ void issue_dp(uint32_t n) {
    const uint64_t db = stage_kmaj(Ds, n);
#pragma unroll
    for (int kt = 0; kt < V / 16; ++kt) wg_ss<T, 0, 0>(dp, va + a_off(kt), db + k_off(kt), kt > 0);
  }
  __device__ __forceinline__ void issue_sdp(uint32_t n) {
    issue_s(n);
    issue_dp(n);
    wg_commit();
  }
  // kFuse: dq (64 query rows x this warpgroup's K / 2 features, 64 wg .. or 32 wg ..) = dS kt_a for item n,
  // over all 128 keys: A = dS from Dss[n & 1] (M-major), B = Kt (N-major).
  __device__ __forceinline__ void issue_dq(uint32_t n) {
    if constexpr (kFuse) {
      const char* a0 = reinterpret_cast<const char*>(Dss + (n & 1) * kKfKeys * kChunk);
      const int wgu = warp_uniform(wg);  // (the kernel's warp): ptxas 88 / 100 -> 0 / 0 bytes spilled at K = 128
      const char* b0 = reinterpret_cast<const char*>(Kt) + (K == 128 ? wgu * kKfKeys * 128 : wgu * 64);
#pragma unroll
      for (int k = 0; k < kKfKeys / 16; ++k)
        wg_ss<T, 1, 1>(dq, smem_desc_sw128(a0 + k * 16 * 128, kKfKeys * 128, 1024),
                       smem_desc_sw128(b0 + k * 16 * 128, kKfKeys * 128, 1024), k > 0);
    }
  }
  // kFuse: the CTA barrier that sees every warp's dS^T of the item before staged; with kWgDq (and jn >= 0) also
  // thread 128's dq reductions done reading the stage query item jn loads into, and thread 0's issue of jn after
  // it (thread 0 waits for its own reductions in issue_q).
  __device__ __forceinline__ void barrier_issue(int jn) {
    if (kWgDq && threadIdx.x == 128 && jn >= 0) bulk_wait<kKfStages - 3, true>();
    __syncthreads();
    if (kWgDq && threadIdx.x == 0 && jn >= 0 && jn < nit) issue_q(jn);
  }
  // kWgDq: dv and h first (this warp's own fragments), barrier_issue(jn) under them, then dq.
  __device__ __forceinline__ void issue_acc(uint32_t n, int jn) {
    const uint64_t dn = stage_nmaj(Ds, n), qn = stage_nmaj(Qs, n);
    if constexpr (!kWgDq) issue_dq(n);
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) wg_rs<T, 1>(dv, pa[kt], dn + n_off(kt));
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) wg_rs<T, 1>(hk, dsa[kt], qn + n_off(kt));
    if constexpr (kWgDq) {
      barrier_issue(jn);
      wg_fence();
      issue_dq(n);
    }
    wg_commit();
  }
  // kFuse: item n's dq (waited for) into dqt. It is staged over item n's stage (both warpgroups are done with
  // it) as K / 32 boxes of [64 rows][32 fp32] in 128-byte swizzled rows, the first K / 64 over the qhat tile,
  // the rest over the dO tile, rows past the sequence zero; thread 0 adds the boxes by TMA reductions and waits
  // for their reads before it loads the stage again (issue_q).
  __device__ __forceinline__ void add_dq(uint32_t n) {
    if constexpr (kFuse) {
      fence_regs(dq);
      const int j = int(n - n_q), qc = chunk_of(j), rows = ch.len - qc * kChunk, st = int(n % kKfStages);
      // Warpgroup wg's features are boxes K / 64 wg .., over the stage's qhat tile (wg 0) or dO tile (wg 1).
      auto box = [&](int b) {
        return reinterpret_cast<float*>(b < K / 64 ? Qs + st * kChunk * K : Ds + st * kChunk * V) +
               (b % (K / 64)) * kChunk * 32;
      };
      // The lane read here, not hoisted: the offsets are recomputed per item instead of held in registers.
      // Row r of the item sits in the box's row 2 (r % 32) + r / 32 (map_tokens_paired), swizzle phase
      // 2 (g & 3) + (warp & 3) / 2 for both of a thread's rows (g, g + 8), so that a half-warp's 16 float2
      // stores fill the 32 banks once (with rows in order, rows g and g ^ 1 met in the same chunks).
      const int ln = int(lane_id()), w4 = warp & 3, rg = 16 * w4 + (ln >> 2);
      const int x = ((ln & 3) >> 1) ^ (2 * ((ln >> 2) & 3) + (w4 >> 1));  // chunk (2 nt + t4 / 2) ^ phase
      float* const p0 = box(wg * (K / 64)) + (2 * (rg & 31) + (w4 >> 1)) * 32 + 2 * (ln & 1);
      // Both warpgroups are done reading item n's stage (kWgDq: once every warp has released it, release_q).
      if constexpr (kWgDq) mbar_wait(&empty[st], (n / kKfStages) & 1);
      else __syncthreads();
#pragma unroll
      for (int nt = 0; nt < kDqN; ++nt) {
        float* const pc = p0 + (nt / 4) * kChunk * 32 + ((((2 * nt) & 7) ^ x) << 2);
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const bool in = rg + 8 * hr < rows;
          *reinterpret_cast<float2*>(pc + 16 * hr * 32) =
              make_float2(in ? dq[nt][2 * hr] : 0.f, in ? dq[nt][2 * hr + 1] : 0.f);
        }
      }
      fence_async_smem();
      // Boxes [b0, b1) added by this thread once the stores are done.
      auto reduce_boxes = [&](int b0, int b1) {
        const int hq = head_of(j), row = int(seq_tok0 + int64_t(qc) * kChunk);
        const CUtensorMap* dmap = p.far_half > 0 && !odd_half(qc) ? &mp.dqt1 : &mp.dqt;
#pragma unroll
        for (int b = b0; b < b1; ++b) tma_reduce_add(dmap, box(b), 32 * b, hq, 0, row);
        bulk_commit();
      };
      if constexpr (kWgDq) {  // this warpgroup's stores (a named barrier of its 128 threads), its boxes
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
        if ((threadIdx.x & 127) == 0) reduce_boxes(wg * (K / 64), (wg + 1) * (K / 64));
      } else {
        __syncthreads();
        if (threadIdx.x == 0) reduce_boxes(0, K / 32);
      }
    }
  }
  // kFuse: this warp's dS^T rows of item n (its packed fragments) into Dss[n & 1], 128-byte swizzled rows of 64
  // query rows.
  __device__ __forceinline__ void stage_ds(uint32_t n) {
    if constexpr (kFuse) {
      T* buf = Dss + (n & 1) * kKfKeys * kChunk;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = 16 * warp + g + 8 * hr;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int c = 8 * nt + 2 * t4;
          *reinterpret_cast<uint32_t*>(buf + r * 64 + ((((c >> 3) ^ (r & 7)) << 3) | (c & 7))) =
              dsa[nt / 2][(nt & 1) * 2 + hr];
        }
      }
      fence_async_smem();
    }
  }
  // kFuse: dPS_a += h^T kt_a (kt_{a+1} = kt_a PS_a^T), A = the staged h (M-major), B = Kt (N-major): K = 128,
  // warpgroup wg takes the rows 64 wg .. over all keys, in two 64-column halves; K = 64, all of it over the
  // warpgroup's own keys (both add). fp32 vector reductions into dps.
  __device__ __forceinline__ float* dps_of(int a) {  // dPS_a
    return p.dps + (int64_t(ch.sfirst + a) * p.H + h) * K * K;
  }
  // This warp's fragments of dPS rows 64 mb .., columns 64 nh .. (a product of wg_rows_outer), times up, added.
  __device__ __forceinline__ void red_dps(float* dst, int mb, int nh, const float (&d)[8][4], float up) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) red_add_frag_v4(dst, K, mb * 64 + 16 * (warp & 3), nh * 64 + 8 * nt, d[nt], up);
  }
  __device__ __forceinline__ void add_dps(int a, float up) {
    __syncthreads();  // every warp's part of the staged h
    float* dst = dps_of(a);
    const int mb = K == 128 ? wg : 0, k0 = K == 128 ? 0 : 4 * wg;
    constexpr int nks = K == 128 ? 8 : 4;
#pragma unroll 1
    for (int nh = 0; nh < KB; ++nh) {
      float d[8][4];
      wg_rows_outer<T>(d, Dss, mb, Kt, nh, k0, nks);
      red_dps(dst, mb, nh, d, up);
    }
    __syncthreads();  // every warp is done reading the staged h (the next dS^T goes there)
  }
  // kWgDq: add_dps's first half (columns 0 .. 63, reductions now) and the second half's product into d1 (its
  // reductions go under the superblock's first scores; no barrier at the end: the first item's comes before
  // anything writes Dss again).
  __device__ __forceinline__ void add_dps_wg(float* dst, float up, float (&d1)[8][4]) {
    __syncthreads();  // every warp's part of the staged h
    {
      float d[8][4];
      wg_rows_outer<T>(d, Dss, wg, Kt, 0, 0, 8);
      red_dps(dst, wg, 0, d, up);
    }
    wg_rows_outer<T>(d1, Dss, wg, Kt, 1, 0, 8);
  }
  // kFuse with the gate, after pds and the packing: the gate's sums of item n's dS, which the fused kernel takes
  // in bwd_q_far's place and with its weights: per key (rows of dS^T) into dgcol, per query row (columns) into
  // dgrow (zeroed before the launch; bwd_q's last launch adds the own superblock's part). Keys and query rows
  // past the sequence's end are left out.
  __device__ __forceinline__ void gate_sums(uint32_t n) {
    const int j = int(n - n_q), qc = chunk_of(j), hq = head_of(j);
    const float w = p.gate_scale / p.scale;
    {
      const int rows = ch.len - qc * kChunk;
      float* const dst = p.dgrow + (seq_tok0 + int64_t(qc) * kChunk) * p.HQ + hq;
      float cs[8][2];
      warp_col_sums(dp, cs);
      if (lane < 4)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int r = 8 * nt + 2 * lane + e;
            if (r < rows) atomicAdd(dst + int64_t(r) * p.HQ, w * cs[nt][e]);
          }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float a = 0.f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) a += dp[nt][2 * hr] + dp[nt][2 * hr + 1];
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      a += __shfl_xor_sync(0xffffffffu, a, 2);
      const int key = kc * kChunk + 16 * warp + g + 8 * hr;
      if (t4 == 0 && key < ch.len) atomicAdd(p.dgcol + (seq_tok0 + key) * p.HQ + hq, -w * a);
    }
  }
  __device__ __forceinline__ void pds(uint32_t n) {  // P^T into s, scale dS^T into dp (columns are query rows)
    const float2* l2 = Ls + (n % kKfStages) * kChunk;
    float gk[2] = {0.f, 0.f};  // the keys' gate terms for item n's query head
    if constexpr (kGate) {
      const int hq = head_of(int(n - n_q));
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) gk[hr] = __ldg(p.G + (tokk0 + 16 * warp + g + 8 * hr) * p.HQ + hq) * gl2;
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 bd = l2[8 * nt + 2 * t4 + (e & 1)];
        const float pr = fast_exp2(s[nt][e] * sl2 - bd.x - gk[e >> 1]);
        s[nt][e] = pr;
        dp[nt][e] = p.scale * pr * (dp[nt][e] - bd.y);
      }
  }
  // h <- h PS_a, each row of h scaled into fp16's range first (gradients may lie far below it).
  __device__ __forceinline__ void cross_h() { ps.template apply<K, false, true>(hk); }
  __device__ __forceinline__ void release_kt() {  // this warp's last read of kt_a
    __syncwarp();
    if (lane == 0) mbar_arrive(kt_empty);
  }
  __device__ __forceinline__ void release_q(uint32_t n) {
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[n % kKfStages]);
  }
  // Superblock a's items are [item_begin(a), item_begin(a - 1)).
  __device__ __forceinline__ int item_begin(int a) const {
    return a == last_sb ? 0 : (n_last + p.sc * (last_sb - 1 - a)) * p.group;
  }
  // kWgDq with acc_next: the barrier and item j + 1's issue come in issue_acc(n - 1, j + 1) instead.
  __device__ __forceinline__ void wait_full(uint32_t n) {  // item n's stage loaded
    __syncwarp();
    mbar_wait(&full[n % kKfStages], (n / kKfStages) & 1);
  }
  // Thread 0 issues item j + 1 (kWgDq: after the barrier). nit is read before the branch (read in it, ptxas took
  // 22 more registers at K = 64, and 24 / 24 bytes of spills at K = 128 with the gate).
  __device__ __forceinline__ void wait_item(int j, bool acc_next) {
    const int nit = this->nit;
    if (!kWgDq && threadIdx.x == 0 && j + 1 < nit) issue_q(j + 1);
    wait_full(n_q + uint32_t(j));
    if (kFuse && !(kWgDq && acc_next)) barrier_issue(j + 1);
    fence_regs(s, dp, dv, hk, pa, dsa);
    wg_fence();
  }
  // Item n's S^T and dP^T, once done, into P^T and dS^T (the A fragments of its dv / h products; kFuse: dS^T
  // staged for dq).
  __device__ __forceinline__ void finish_scores(uint32_t n) {
    wg_wait<0>();
    fence_regs(s, dp);
    pds(n);
    pack_frags<T, 4>(pa, s);
    pack_frags<T, 4>(dsa, dp);
    if constexpr (kGate && kFuse) gate_sums(n);  // s is dead here: its registers take the sums
    stage_ds(n);
  }
  __device__ __forceinline__ void acc_alone(uint32_t n) {  // dv, h (and dq) of item n, waited for, its stage released
    issue_acc(n, -1);
    wg_wait<0>();
    fence_regs(dv, hk, pa, dsa);
    release_q(n);
    add_dq(n);
  }
  __device__ __forceinline__ void scores_alone(uint32_t n) {
    wg_fence();
    issue_sdp(n);
    finish_scores(n);
  }

  // The crossing into superblock a < last_sb (its first item j0): h of superblock a + 1 is complete; kt_a into Kt
  // once every warp is past its scores of a + 1, and h <- h PS_a (pass 2's crossing n1 + (last_sb - 1 - a)) while
  // it loads. kWgDq: also item j0's wait and scores.
  __device__ __forceinline__ void cross(int a, int j0) {
    if (threadIdx.x == 0) {
      mbar_wait(kt_empty, n_kt & 1);
      mbar_expect_tx(kt_full, uint32_t(kKfKeys * K * 2));
      issue_kt(a, kt_full);
    }
    // kFuse: h (the gradient w.r.t. kt_{a+1}, complete) staged over Dss for dPS_a before the crossing, once
    // every warp is done with Dss (its last item's dq).
    float up = 1.f;
    if constexpr (kFuse) up = stage_tile_scaled<T, K>(hk, Dss, hred);
    cross_h();
    if (threadIdx.x == 0 && a > sbk + 1) issue_ps(n1 + (last_sb - 1 - a) + 1);
    mbar_wait(kt_full, n_kt & 1);
    ++n_kt;
    if constexpr (kWgDq) {
      // The first item's S^T / dP^T issued before the second half of dPS_a is added, so that its vector
      // reductions run under them (docs/cuda.md); then wait_item's barrier and the scores.
      float d1[8][4];
      float* const dst = dps_of(a);
      add_dps_wg(dst, up, d1);
      const uint32_t n0 = n_q + uint32_t(j0);
      wait_full(n0);
      fence_regs(s, dp, dv, hk, pa, dsa, d1);
      wg_fence();
      issue_sdp(n0);
      red_dps(dst, wg, 1, d1, up);
      barrier_issue(j0 + 1);
      finish_scores(n0);
    } else if constexpr (kFuse) {
      add_dps(a, up);
    }
  }
  // Items j0 + 1 .. j1 - 1 of a superblock: each item's scores with the previous item's dv / h (and dq).
  __device__ __forceinline__ void far_items(int j0, int j1) {
#pragma unroll 1
    for (int j = j0 + 1; j < j1; ++j) {
      const uint32_t n = n_q + uint32_t(j);
      wait_item(j, true);
      if constexpr (kOverlap && kFuse) {
        // dv / h / dq of item j - 1 issued before item j's scores, so that j - 1's dq is staged and reduced
        // under them (P^T / dS^T then run with no product under them; faster at K = 64).
        issue_acc(n - 1, -1);
        issue_sdp(n);
        wg_wait<1>();  // dv / h / dq of item j - 1 done; S^T, dP^T of item j may still run
        fence_regs(dv, hk, pa, dsa);
        release_q(n - 1);
        add_dq(n - 1);
        finish_scores(n);
      } else if constexpr (kOverlap) {
        issue_sdp(n);
        issue_acc(n - 1, -1);
        wg_wait<1>();  // S^T, dP^T of item j done; dv / h of item j - 1 may still run
        fence_regs(s, dp);
        pds(n);
        wg_wait<0>();
        release_q(n - 1);
        fence_regs(dv, hk, pa, dsa);
        add_dq(n - 1);
        pack_frags<T, 4>(pa, s);
        pack_frags<T, 4>(dsa, dp);
        stage_ds(n);
      } else if constexpr (kFuse) {
        // dv / h / dq of item j - 1 waited for, then item j's S^T issued before j - 1's dq is staged and
        // reduced, dP^T after it: the staging's shared stores and barriers run under the S^T product (with
        // dP^T's accumulators live too, dv, h, dq and both would not fit the registers).
        issue_acc(n - 1, j + 1);
        wg_wait<0>();
        fence_regs(dv, hk, pa, dsa);
        release_q(n - 1);
        wg_fence();
        issue_s(n);
        wg_commit();
        add_dq(n - 1);
        wg_fence();
        issue_dp(n);
        wg_commit();
        finish_scores(n);
      } else {
        acc_alone(n - 1);
        scores_alone(n);
      }
    }
  }
  // Pass 2: per later superblock a, right to left, the far loop with kt_a resident. Each superblock's first item
  // is peeled out of the loop (no product under a branch: ptxas would serialize every wgmma). At K = 64 the
  // scores of item j are issued together with dv / h of item j - 1 (registers allow it: far_bwd's bkw); at
  // K = 128 one group at a time (bkw0: as fast there, without bkw's spills). Fused, item j - 1's dq is staged
  // while item j's S^T (K = 128) or scores (K = 64) run on the tensor cores (docs/cuda.md).
  __device__ __forceinline__ void pass2() {
    zero_acc(dv);
    zero_acc(hk);
    mbar_wait(kv_full, n_kv & 1);
    ++n_kv;
#pragma unroll 1
    for (int a = last_sb; a > sbk; --a) {
      const int j0 = item_begin(a), j1 = a == sbk + 1 ? nit : item_begin(a - 1);
      if (a < last_sb) cross(a, j0);
      if (!kWgDq || a == last_sb) {
        wait_item(j0, false);
        scores_alone(n_q + uint32_t(j0));
      }
      far_items(j0, j1);
      if (!kFuse && a > sbk + 1) release_kt();
      if constexpr (kFuse && !kWgDq) __syncthreads();  // every warp's dS^T of the last item is staged
      fence_regs(dv, hk, pa, dsa);
      wg_fence();
      acc_alone(n_q + uint32_t(j1) - 1);
      if (kFuse && a > sbk + 1) release_kt();  // (after the last item's dq)
    }
    n_q += uint32_t(nit);
  }
};

}  // namespace
}  // namespace pathattn::cuda
