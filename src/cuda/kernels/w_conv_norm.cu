// cuda/kernels/w_conv_norm.cu: the w preparation op (include/pathattn/w_conv_norm.h) on the device: forward, backward
// and the backward's fixed-order sum of the weight and bias gradients, with their launchers (launchers.h).
// Memory-bound: one pass over x (and dout) per direction. One warp per (token tile, channel group): each lane owns
// C = head_dim / 32 adjacent channels (one channel, two heads per warp, at head_dim 16), walks its tile's tokens in
// order and keeps the last inputs of the convolution in registers; the head's sum of squares is a shuffle reduction.
#include <type_traits>

#include "cuda/device/common.cuh"
#include "cuda/launchers.h"
#include "pathattn/w_conv_norm.h"

namespace pathattn::cuda {
namespace {

constexpr int kMaxW = kWConvNormMaxWidthCuda;  // taps held in registers (right-aligned: tap i at kMaxW - W + i)
constexpr int kThreads = 128;                  // 4 warps a block, adjacent channel groups of one tile
constexpr int kTile = 64;  // tokens a warp walks: the backward recomputes W - 1 halo rows per tile (< 5% at 64)

template <int kHD> struct Lanes {
  static constexpr int C = kHD >= 32 ? kHD / 32 : 1;  // channels per lane
  static constexpr int LH = kHD / C;                 // lanes per head (16 or 32)
};

__device__ __forceinline__ float load_any(const void* p, int dt, int64_t i) {
  if (dt == int(DType::bf16)) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (dt == int(DType::f16)) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_any(void* p, int dt, int64_t i, float x) {
  if (dt == int(DType::bf16)) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  else if (dt == int(DType::f16)) static_cast<__half*>(p)[i] = __float2half_rn(x);
  else static_cast<float*>(p)[i] = x;
}

// C adjacent elements at p as floats: vector loads of up to 16 bytes when `vec` (p aligned to min(16, C elements)).
template <typename E, int C>
__device__ __forceinline__ void load_row(const E* p, bool vec, float (&v)[C]) {
  constexpr int kBytes = int(sizeof(E)) * C;
  if (vec && kBytes >= 4) {
    constexpr int kPiece = kBytes >= 16 ? 16 : kBytes, kN = kPiece / int(sizeof(E));
    using U = std::conditional_t<kPiece == 16, uint4, std::conditional_t<kPiece == 8, uint2, uint32_t>>;
#pragma unroll
    for (int k = 0; k < C; k += kN) {
      const U u = *reinterpret_cast<const U*>(p + k);
      const E* e = reinterpret_cast<const E*>(&u);
#pragma unroll
      for (int j = 0; j < kN; ++j) v[k + j] = to_f(e[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < C; ++j) v[j] = to_f(p[j]);
  }
}

template <typename E, int C>
__device__ __forceinline__ void store_row(E* p, bool vec, const float (&v)[C]) {
  constexpr int kBytes = int(sizeof(E)) * C;
  if (vec && kBytes >= 4) {
    constexpr int kPiece = kBytes >= 16 ? 16 : kBytes, kN = kPiece / int(sizeof(E));
    using U = std::conditional_t<kPiece == 16, uint4, std::conditional_t<kPiece == 8, uint2, uint32_t>>;
#pragma unroll
    for (int k = 0; k < C; k += kN) {
      U u;
      E* e = reinterpret_cast<E*>(&u);
#pragma unroll
      for (int j = 0; j < kN; ++j) e[j] = from_f<E>(v[k + j]);
      *reinterpret_cast<U*>(p + k) = u;
    }
  } else {
#pragma unroll
    for (int j = 0; j < C; ++j) p[j] = from_f<E>(v[j]);
  }
}

// Element offset of flat token f's row in a [B, T, D] view with batch / token strides s.
__device__ __forceinline__ int64_t row_at(const WConvNormKernelParams& p, const int64_t (&s)[2], int f) {
  const unsigned b = unsigned(f) / unsigned(p.T), t = unsigned(f) - b * unsigned(p.T);
  return int64_t(b) * s[0] + int64_t(t) * s[1];
}

// [beg, end) of the sequence holding flat token f: its batch row, or the varlen sequence (the last n with cu[n] <= f,
// so empty sequences are skipped).
__device__ __forceinline__ void seq_of(const WConvNormKernelParams& p, int f, int& beg, int& end) {
  if (p.cu == nullptr) {
    beg = f - f % p.T;
    end = beg + p.T;
    return;
  }
  int lo = 0, hi = p.nseq;  // cu[lo] <= f < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (p.cu[mid] <= f) lo = mid;
    else hi = mid;
  }
  beg = int(p.cu[lo]);
  end = int(p.cu[lo + 1]);
}

// Sum over the lanes of one head (LH lanes: 16 or 32, aligned groups of the warp).
template <int LH>
__device__ __forceinline__ float head_sum(float v) {
#pragma unroll
  for (int o = LH / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// What a lane holds of the convolution: right-aligned taps (0 where unused) and bias for its C channels.
template <int C>
struct Taps {
  float w[kMaxW][C];
  float b[C];
  __device__ void load(const WConvNormKernelParams& p, int c0, bool valid) {
#pragma unroll
    for (int j = 0; j < C; ++j) {
      b[j] = valid && p.bias != nullptr ? load_any(p.bias, p.bias_dt, int64_t(c0 + j) * p.bias_s) : 0.f;
#pragma unroll
      for (int k = 0; k < kMaxW; ++k) {
        const int i = k - (kMaxW - p.W);
        w[k][j] = valid && i >= 0 ? load_any(p.weight, p.weight_dt, int64_t(c0 + j) * p.weight_s + i) : 0.f;
      }
    }
  }
  // z = sum of the used taps, tap 0 first (flash-linear-attention's order), then the bias. xs[k]: x at f - (kMaxW-1-k).
  __device__ __forceinline__ float conv(const WConvNormKernelParams& p, const float (&xs)[kMaxW][C], int j) const {
    if (p.W == 0) return xs[kMaxW - 1][j];
    float z = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxW; ++k) {
      if (k >= kMaxW - p.W) z = fmaf(w[k][j], xs[k][j], z);
    }
    return p.bias != nullptr ? z + b[j] : z;
  }
};

// expf, not __expf: the kernel is bound by memory, and fp32 callers get the CPU backend's SiLU to an ulp.
__device__ __forceinline__ float silu(float z) { return z / (1.f + expf(-z)); }
__device__ __forceinline__ float dsilu(float z) {
  const float s = 1.f / (1.f + expf(-z));
  return s * (1.f + z * (1.f - s));
}

// Forward: out = a / ||a||_head with a = act(conv(x)). Warp (tile, group): tokens [f0, f0 + kTile) x channels
// [group * 32 C, +32 C). The next token's row is loaded before the current one is computed (one load in flight
// beyond the occupancy's).
template <typename E, int kHD>
__global__ void __launch_bounds__(kThreads) w_conv_norm_fwd_kernel(WConvNormKernelParams p) {
  constexpr int C = Lanes<kHD>::C, LH = Lanes<kHD>::LH;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  if (warp >= int64_t(p.ngroups) * p.ntiles) return;
  const int group = int(warp % p.ngroups), tile = int(warp / p.ngroups);
  const int c0 = group * 32 * C + lane * C;
  const bool valid = c0 < p.D;
  Taps<C> tp;
  tp.load(p, c0, valid);
  const E* x = static_cast<const E*>(p.x) + c0;
  E* out = static_cast<E*>(p.out) + c0;
  const int f0 = tile * kTile, f1 = min(f0 + kTile, p.ntok);
  int beg, end;
  seq_of(p, f0, beg, end);
  float xs[kMaxW][C];  // xs[k] = x at f - (kMaxW - 1 - k), 0 before the sequence's start
#pragma unroll
  for (int k = 0; k < kMaxW - 1; ++k) {
    const int u = f0 - (kMaxW - 1 - k);
    if (valid && k >= kMaxW - p.W && u >= beg) load_row<E, C>(x + row_at(p, p.x_s, u), p.vec, xs[k]);
    else
#pragma unroll
      for (int j = 0; j < C; ++j) xs[k][j] = 0.f;
  }
  float nxt[C];
  if (valid) load_row<E, C>(x + row_at(p, p.x_s, f0), p.vec, nxt);
  for (int f = f0; f < f1; ++f) {
    if (f == end) {  // a new sequence: the window restarts from zeros
      seq_of(p, f, beg, end);
#pragma unroll
      for (int k = 0; k < kMaxW - 1; ++k)
#pragma unroll
        for (int j = 0; j < C; ++j) xs[k][j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < C; ++j) xs[kMaxW - 1][j] = nxt[j];
    if (valid && f + 1 < f1) load_row<E, C>(x + row_at(p, p.x_s, f + 1), p.vec, nxt);
    float a[C], ss = 0.f;
#pragma unroll
    for (int j = 0; j < C; ++j) {
      const float z = tp.conv(p, xs, j);
      a[j] = p.activation ? silu(z) : z;
      ss = fmaf(a[j], a[j], ss);
    }
    const float r = rsqrtf(head_sum<LH>(ss) + p.eps);
#pragma unroll
    for (int j = 0; j < C; ++j) a[j] *= r;
    if (valid) store_row<E, C>(out + row_at(p, p.out_s, f), p.vec, a);
#pragma unroll
    for (int k = 0; k < kMaxW - 1; ++k)
#pragma unroll
      for (int j = 0; j < C; ++j) xs[k][j] = xs[k + 1][j];
  }
}

// Backward, warp (tile, group) as the forward's. Tokens from the tile's halo top (the next W - 1 tokens of the
// sequence of its last token) down to f0: recompute z, a and r exactly as the forward; dz = r (g - o (g . o))
// act'(z); dx[f] = sum_i w_i dz[f + W - 1 - i] from the last W - 1 dz kept in registers (zero past the sequence's
// end). Tile tokens add dz x into the lane's dweight / dbias sums, written to p.partial (no atomics).
template <typename E, int kHD>
__global__ void __launch_bounds__(kThreads) w_conv_norm_bwd_kernel(WConvNormKernelParams p) {
  constexpr int C = Lanes<kHD>::C, LH = Lanes<kHD>::LH;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (int64_t(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  if (warp >= int64_t(p.ngroups) * p.ntiles) return;
  const int group = int(warp % p.ngroups), tile = int(warp / p.ngroups);
  const int c0 = group * 32 * C + lane * C;
  const bool valid = c0 < p.D;
  Taps<C> tp;
  tp.load(p, c0, valid);
  const E* x = static_cast<const E*>(p.x) + c0;
  const E* dout = static_cast<const E*>(p.dout) + c0;
  E* dx = static_cast<E*>(p.dx) + c0;
  const int f0 = tile * kTile, f1 = min(f0 + kTile, p.ntok);
  int beg, end;
  seq_of(p, f1 - 1, beg, end);
  const int top = min(f1 - 1 + max(p.W - 1, 0), end - 1);
  float xs[kMaxW][C], dzs[kMaxW - 1][C], pw[kMaxW][C], pb[C];  // dzs[m] = dz at f + 1 + m
#pragma unroll
  for (int j = 0; j < C; ++j) {
    pb[j] = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxW; ++k) pw[k][j] = 0.f;
#pragma unroll
    for (int m = 0; m < kMaxW - 1; ++m) dzs[m][j] = 0.f;
  }
  const int wu = max(p.W, 1);  // window rows in use: x[f - wu + 1 .. f] (x[f] alone without the convolution)
  bool fresh = true;          // the x window must be loaded whole (first step, or a new sequence below)
  for (int f = top; f >= f0; --f) {
    if (f < beg) {  // the previous sequence: nothing of the later one reaches it
      seq_of(p, f, beg, end);
      fresh = true;
#pragma unroll
      for (int m = 0; m < kMaxW - 1; ++m)
#pragma unroll
        for (int j = 0; j < C; ++j) dzs[m][j] = 0.f;
    }
    if (fresh) {
#pragma unroll
      for (int k = 0; k < kMaxW; ++k) {
        const int u = f - (kMaxW - 1 - k);
        if (valid && k >= kMaxW - wu && u >= beg) load_row<E, C>(x + row_at(p, p.x_s, u), p.vec, xs[k]);
        else
#pragma unroll
          for (int j = 0; j < C; ++j) xs[k][j] = 0.f;
      }
      fresh = false;
    }
    float g[C];
    if (valid) load_row<E, C>(dout + row_at(p, p.dout_s, f), p.vec, g);
    else
#pragma unroll
      for (int j = 0; j < C; ++j) g[j] = 0.f;
    float z[C], a[C], ss = 0.f;
#pragma unroll
    for (int j = 0; j < C; ++j) {
      z[j] = tp.conv(p, xs, j);
      a[j] = p.activation ? silu(z[j]) : z[j];
      ss = fmaf(a[j], a[j], ss);
    }
    const float r = rsqrtf(head_sum<LH>(ss) + p.eps);
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < C; ++j) dot = fmaf(g[j], a[j] * r, dot);
    dot = head_sum<LH>(dot);
    float dz[C];
#pragma unroll
    for (int j = 0; j < C; ++j) {
      dz[j] = r * (g[j] - a[j] * r * dot);
      if (p.activation) dz[j] *= dsilu(z[j]);
    }
    if (f < f1) {
      float d[C];
#pragma unroll
      for (int j = 0; j < C; ++j) {
        if (p.W == 0) {
          d[j] = dz[j];
          continue;
        }
        // x[f] reaches z[f + m] through tap k = kMaxW - 1 - m.
        float s = tp.w[kMaxW - 1][j] * dz[j];
#pragma unroll
        for (int m = 1; m < kMaxW; ++m) s = fmaf(tp.w[kMaxW - 1 - m][j], dzs[m - 1][j], s);
        d[j] = s;
        pb[j] += dz[j];
#pragma unroll
        for (int k = 0; k < kMaxW; ++k) pw[k][j] = fmaf(dz[j], xs[k][j], pw[k][j]);
      }
      if (valid) store_row<E, C>(dx + row_at(p, p.dx_s, f), p.vec, d);
    }
    // Slide both windows one token down.
#pragma unroll
    for (int j = 0; j < C; ++j) {
#pragma unroll
      for (int m = kMaxW - 2; m > 0; --m) dzs[m][j] = dzs[m - 1][j];
      dzs[0][j] = dz[j];
#pragma unroll
      for (int k = kMaxW - 1; k > 0; --k) xs[k][j] = xs[k - 1][j];
    }
    if (f - 1 >= f0) {  // the window's new lowest row in use, x[f - wu]
#pragma unroll
      for (int k = 0; k < kMaxW; ++k) {
        if (k != kMaxW - wu) continue;
        const int u = f - 1 - (kMaxW - 1 - k);
        if (valid && u >= beg) load_row<E, C>(x + row_at(p, p.x_s, u), p.vec, xs[k]);
        else
#pragma unroll
          for (int j = 0; j < C; ++j) xs[k][j] = 0.f;
      }
    }
  }
  if (p.partial == nullptr || !valid || p.W == 0) return;
  float* part = p.partial + (int64_t(tile) * p.D + c0) * (p.W + 1);
#pragma unroll
  for (int j = 0; j < C; ++j) {
#pragma unroll
    for (int k = 0; k < kMaxW; ++k) {
      if (k >= kMaxW - p.W) part[j * (p.W + 1) + k - (kMaxW - p.W)] = pw[k][j];
    }
    part[j * (p.W + 1) + p.W] = pb[j];
  }
}

// dweight[c, i] (i < W) and dbias[c] (i == W): the tiles' partial sums added in tile order, one thread per (c, i).
__global__ void w_conv_norm_reduce_kernel(WConvNormKernelParams p) {
  const int64_t n = int64_t(p.D) * (p.W + 1);
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  float s = 0.f;
#pragma unroll 16  // loads run ahead of the (ordered) adds: 512 tiles at 32k tokens, one latency per 16
  for (int t = 0; t < p.ntiles; ++t) s += p.partial[int64_t(t) * n + e];
  const int c = int(e / (p.W + 1)), i = int(e % (p.W + 1));
  if (i < p.W) {
    if (p.dweight != nullptr) store_any(p.dweight, p.weight_dt, int64_t(c) * p.dweight_s + i, s);
  } else if (p.dbias != nullptr) {
    store_any(p.dbias, p.bias_dt, int64_t(c) * p.dbias_s, s);
  }
}

// The kernel instance for (element type, head dim), or null for a head dim without one.
template <bool kBwd, typename E>
auto kernel_for(int hd) -> void (*)(WConvNormKernelParams) {
  switch (hd) {
    case 16: return kBwd ? w_conv_norm_bwd_kernel<E, 16> : w_conv_norm_fwd_kernel<E, 16>;
    case 32: return kBwd ? w_conv_norm_bwd_kernel<E, 32> : w_conv_norm_fwd_kernel<E, 32>;
    case 64: return kBwd ? w_conv_norm_bwd_kernel<E, 64> : w_conv_norm_fwd_kernel<E, 64>;
    case 128: return kBwd ? w_conv_norm_bwd_kernel<E, 128> : w_conv_norm_fwd_kernel<E, 128>;
    case 256: return kBwd ? w_conv_norm_bwd_kernel<E, 256> : w_conv_norm_fwd_kernel<E, 256>;
    default: return nullptr;
  }
}

template <bool kBwd>
cudaError_t launch(const WConvNormKernelParams& p, int dtype, int hd, cudaStream_t s) {
  void (*fn)(WConvNormKernelParams) = nullptr;
  if (dtype == int(DType::bf16)) fn = kernel_for<kBwd, __nv_bfloat16>(hd);
  else if (dtype == int(DType::f16)) fn = kernel_for<kBwd, __half>(hd);
  else if (dtype == int(DType::f32)) fn = kernel_for<kBwd, float>(hd);
  if (fn == nullptr) return cudaErrorInvalidValue;
  const int64_t warps = int64_t(p.ngroups) * p.ntiles;
  const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  if (blocks == 0) return cudaSuccess;
  fn<<<unsigned(blocks), kThreads, 0, s>>>(p);
  return cudaGetLastError();
}

}  // namespace

int w_conv_norm_tile() { return kTile; }

cudaError_t launch_w_conv_norm_fwd(const WConvNormKernelParams& p, int dtype, int hd, cudaStream_t s) {
  return launch<false>(p, dtype, hd, s);
}

cudaError_t launch_w_conv_norm_bwd(const WConvNormKernelParams& p, int dtype, int hd, cudaStream_t s) {
  return launch<true>(p, dtype, hd, s);
}

cudaError_t launch_w_conv_norm_reduce(const WConvNormKernelParams& p, cudaStream_t s) {
  const int64_t n = int64_t(p.D) * (p.W + 1);
  if (n == 0) return cudaSuccess;
  constexpr int kT = 256;
  w_conv_norm_reduce_kernel<<<unsigned((n + kT - 1) / kT), kT, 0, s>>>(p);
  return cudaGetLastError();
}

}  // namespace pathattn::cuda
