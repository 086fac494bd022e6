// tests/cuda/test_cuda_paged.cpp: the paged decode cache on the GPU (include/pathattn/paged.h) against an exact fp64
// recurrence and against the CPU backend's paged cache on the same inputs; chunked steps, paging, free and bad
// slots, CUDA-graph capture, and the 32k-step accuracy soak. Every test skips without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "check/harness.h"
#include "gpu_skip.h"

namespace pathattn::test {
namespace {

// A byte buffer mirrored between the host and the device.
struct Buf {
  std::vector<uint8_t> host;
  void* dev = nullptr;
  TensorView view{};  // host view; dv() gives the device one
  Buf() = default;
  Buf(DType dt, std::vector<int64_t> shape) {
    HostTensor t(dt, shape);
    view = t.view();
    host.resize(size_t(view.numel() * dtype_size(dt)));
    view.data = host.data();
    EXPECT_EQ(cudaMalloc(&dev, std::max<size_t>(host.size(), 1)), cudaSuccess);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf(Buf&& o) noexcept { *this = std::move(o); }
  Buf& operator=(Buf&& o) noexcept {
    std::swap(host, o.host);
    std::swap(dev, o.dev);
    std::swap(view, o.view);
    view.data = host.data();
    o.view.data = o.host.data();
    return *this;
  }
  ~Buf() {
    if (dev) cudaFree(dev);
  }
  TensorView hv() const { return dev ? view : TensorView{}; }
  TensorView dv() const {
    if (!dev) return TensorView{};
    TensorView v = view;
    v.data = dev;
    v.device = Device::cuda;
    return v;
  }
  void up() { EXPECT_EQ(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess); }
  void down() { EXPECT_EQ(cudaMemcpy(host.data(), dev, host.size(), cudaMemcpyDeviceToHost), cudaSuccess); }
  template <typename T>
  T* as() { return reinterpret_cast<T*>(host.data()); }
};

// Inputs of a call on the backend `be`: host tensors as they are, or device copies kept alive here.
struct Inputs {
  Backend be;
  std::vector<Buf> dev;
  explicit Inputs(Backend b = Backend::cuda) : be(b) { dev.reserve(16); }
  TensorView put(const HostTensor& h) {
    if (!h.present()) return TensorView{};
    if (be != Backend::cuda) return h.view();
    dev.emplace_back(h.dtype(), std::vector<int64_t>(h.view().shape, h.view().shape + h.view().ndim));
    std::memcpy(dev.back().host.data(), h.view().data, dev.back().host.size());
    dev.back().up();
    return dev.back().dv();
  }
};

struct Shape {
  int64_t N, HQ, H, K, V, S, page, max_pages, pool;
  bool path, gate;
  DType kdt, dt;
};

// A paged cache with host and device storage.
struct Cache {
  Shape s;
  Buf kp, vp, gp, bt, len, fl, pk, pw, pb;
  explicit Cache(const Shape& sh) : s(sh) {
    kp = Buf(s.kdt, {s.pool, s.page, s.H, s.K});
    vp = Buf(s.dt, {s.pool, s.page, s.H, s.V});
    if (s.gate) gp = Buf(DType::f64, {s.pool, s.page, s.HQ});
    bt = Buf(DType::i32, {s.N, s.max_pages});
    len = Buf(DType::i32, {s.N});
    fl = Buf(DType::i32, {s.N});
    pk = Buf(DType::f32, {s.N, s.S, s.H, s.K});
    if (s.path) {
      pw = Buf(DType::f32, {s.N, s.S, s.H, s.K});
      pb = Buf(DType::f32, {s.N, s.S, s.H});
    }
    for (Buf* b : all()) std::fill(b->host.begin(), b->host.end(), 0);
    for (int64_t n = 0; n < s.N; ++n) len.as<int32_t>()[n] = fl.as<int32_t>()[n] = -1;
  }
  std::vector<Buf*> all() { return {&kp, &vp, &gp, &bt, &len, &fl, &pk, &pw, &pb}; }
  // A shuffled page assignment (slot n gets max_pages distinct pages of the pool).
  void shuffle_pages(uint64_t seed) {
    std::vector<int32_t> ids(size_t(s.pool));
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int64_t i = 0; i < s.N * s.max_pages; ++i) bt.as<int32_t>()[i] = ids[size_t(i)];
  }
  void up() {
    for (Buf* b : all())
      if (b->dev) b->up();
  }
  void down() {
    for (Buf* b : all())
      if (b->dev) b->down();
  }
  PagedCache view(bool device) const {
    auto v = [&](const Buf& b) { return device ? b.dv() : b.hv(); };
    return PagedCache{v(kp), v(vp), v(gp), v(bt), v(len), v(fl), v(pk), v(pw), v(pb)};
  }
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> r;
    for (const Buf* b : {&kp, &vp, &gp, &bt, &len, &fl, &pk, &pw, &pb}) r.insert(r.end(), b->host.begin(), b->host.end());
    return r;
  }
};

// The inputs of every slot's sequence: a case of N rows of T tokens (bf16 q, k, v; f32 w, beta, g).
Case make_case(const Shape& s, int64_t T, BetaMode bm, uint64_t seed) {
  CaseSpec c;
  c.B = s.N;
  c.T = T;
  c.HQ = s.HQ;
  c.H = s.H;
  c.K = s.K;
  c.V = s.V;
  c.path = s.path;
  c.gate = s.gate;
  c.dtype = s.dt;
  c.beta = bm;
  c.seed = seed;
  return Case::make(c);
}

// Tokens pos[n] of every row of x [N, T, heads, d] as a new host tensor [N, 1, heads, d].
HostTensor gather(const HostTensor& x, const std::vector<int64_t>& pos) {
  if (!x.present()) return HostTensor();
  const TensorView v = x.view();
  const int64_t N = v.shape[0], T = v.shape[1], inner = v.ndim == 4 ? v.shape[2] * v.shape[3] : v.shape[2];
  HostTensor r(v.dtype, v.ndim == 4 ? std::vector<int64_t>{N, 1, v.shape[2], v.shape[3]} : std::vector<int64_t>{N, 1, v.shape[2]});
  const int64_t es = dtype_size(v.dtype);
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(static_cast<char*>(r.mutable_view().data) + n * inner * es,
                static_cast<const char*>(v.data) + (n * T + pos[size_t(n)]) * inner * es, size_t(inner * es));
  return r;
}

// The case's inputs in fp64, for the exact recurrence.
struct Exact {
  const Case* c;
  std::vector<double> q, k, v, w, beta, g;
  explicit Exact(const Case& cs) : c(&cs) {
    auto f = [](const HostTensor& x) { return x.present() ? x.to_f64() : std::vector<double>{}; };
    q = f(cs.q), k = f(cs.k), v = f(cs.v), w = f(cs.w), beta = f(cs.beta), g = f(cs.g);
  }
  // Query i of row n, query head hq: u = q_i; for j = i .. 0: s_j = u . k_j, u <- H_j u; softmax; o, lse.
  void row(int64_t n, int64_t hq, int64_t i, std::vector<double>& o, double& lse) const {
    const CaseSpec& s = c->spec;
    const int64_t h = hq / (s.HQ / s.H), K = s.K, V = s.V;
    std::vector<double> u(q.begin() + ((n * s.T + i) * s.HQ + hq) * K, q.begin() + ((n * s.T + i) * s.HQ + hq + 1) * K);
    std::vector<double> z(size_t(i + 1));
    double gi = 0;
    if (s.gate)
      for (int64_t t = 0; t <= i; ++t) gi += g[size_t((n * s.T + t) * s.HQ + hq)];
    double gj = gi;
    for (int64_t j = i; j >= 0; --j) {
      const double* kj = k.data() + ((n * s.T + j) * s.H + h) * K;
      const double* wj = s.path ? w.data() + ((n * s.T + j) * s.H + h) * K : nullptr;
      double dk = 0, dw = 0;
      for (int64_t e = 0; e < K; ++e) {
        dk += u[size_t(e)] * kj[e];
        if (wj) dw += u[size_t(e)] * wj[e];
      }
      z[size_t(j)] = kDefaultScale * dk + (s.gate ? s.gate_scale * (gi - gj) : 0.0);
      if (s.gate) gj -= g[size_t((n * s.T + j) * s.HQ + hq)];
      if (wj) {
        const double b = beta[size_t((n * s.T + j) * s.H + h)] * dw;
        for (int64_t e = 0; e < K; ++e) u[size_t(e)] -= b * wj[e];
      }
    }
    const double mx = *std::max_element(z.begin(), z.end());
    double sum = 0;
    o.assign(size_t(V), 0.0);
    for (int64_t j = 0; j <= i; ++j) {
      const double p = std::exp(z[size_t(j)] - mx);
      sum += p;
      const double* vj = v.data() + ((n * s.T + j) * s.H + h) * V;
      for (int64_t e = 0; e < V; ++e) o[size_t(e)] += p * vj[e];
    }
    for (double& x : o) x /= sum;
    lse = mx + std::log(sum);
  }
};

// Prefills slot n with the first P tokens of row n (one call per slot, into that slot only).
void prefill_slot(const Case& c, Cache& cache, int64_t n, int64_t P, Backend be, cudaStream_t stream = nullptr) {
  if (P == 0) {  // an empty prompt: an active slot with nothing cached
    cache.len.as<int32_t>()[n] = cache.fl.as<int32_t>()[n] = 0;
    if (be == Backend::cuda) {
      const int32_t z = 0;
      EXPECT_EQ(cudaMemcpy(static_cast<int32_t*>(cache.len.dev) + n, &z, 4, cudaMemcpyHostToDevice), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(static_cast<int32_t*>(cache.fl.dev) + n, &z, 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
    return;
  }
  const CaseSpec& s = c.spec;
  auto row = [&](const HostTensor& x) {
    if (!x.present()) return HostTensor();
    const TensorView v = x.view();
    const int64_t inner = v.ndim == 4 ? v.shape[2] * v.shape[3] : v.shape[2];
    HostTensor r(v.dtype, v.ndim == 4 ? std::vector<int64_t>{1, P, v.shape[2], v.shape[3]} : std::vector<int64_t>{1, P, v.shape[2]});
    std::memcpy(r.mutable_view().data, static_cast<const char*>(v.data) + n * s.T * inner * dtype_size(v.dtype),
                size_t(P * inner * dtype_size(v.dtype)));
    return r;
  };
  HostTensor q = row(c.q), k = row(c.k), v = row(c.v), w = row(c.w), beta = row(c.beta), g = row(c.g);
  HostTensor o(s.dtype, {1, P, s.HQ, s.V});
  HostTensor slot(DType::i32, {1});
  slot.set(0, double(n));
  Inputs in(be);
  auto put = [&](const HostTensor& h) { return in.put(h); };
  PathPagedPrefillParams p;
  p.fwd.q = put(q), p.fwd.k = put(k), p.fwd.v = put(v), p.fwd.w = put(w), p.fwd.beta = put(beta), p.fwd.g = put(g);
  p.fwd.o = put(o);
  p.fwd.gate_scale = s.gate_scale;
  p.fwd.backend = be;
  p.fwd.stream = stream;
  p.cache = cache.view(be == Backend::cuda);
  p.slots = slot.view();
  const Status st = path_attn_paged_prefill(p);
  ASSERT_TRUE(st.ok()) << st.message();
  if (be == Backend::cuda) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
}

struct StepOut {
  HostTensor o, lse;
};

// One decode step of every slot: slot n's token pos[n] (host inputs gathered, device copies for cuda).
StepOut step(const Case& c, Cache& cache, const std::vector<int64_t>& pos, Backend be, bool validate = true,
             cudaStream_t stream = nullptr) {
  const CaseSpec& s = c.spec;
  HostTensor q = gather(c.q, pos), k = gather(c.k, pos), v = gather(c.v, pos), w = gather(c.w, pos);
  HostTensor beta = gather(c.beta, pos), g = gather(c.g, pos);
  StepOut r{HostTensor(s.dtype, {s.B, 1, s.HQ, s.V}), HostTensor(DType::f32, {s.B, 1, s.HQ})};
  r.o.poison();
  r.lse.poison();
  Inputs in(be);
  auto put = [&](const HostTensor& h) { return in.put(h); };
  PathPagedDecodeParams p;
  p.q = put(q), p.k = put(k), p.v = put(v), p.w = put(w), p.beta = put(beta), p.g = put(g);
  p.o = put(r.o);
  p.lse = put(r.lse);
  p.gate_scale = s.gate_scale;
  p.cache = cache.view(be == Backend::cuda);
  p.validate = validate;
  p.backend = be;
  p.stream = stream;
  const Status st = path_attn_paged_decode(p);
  EXPECT_TRUE(st.ok()) << st.message();
  if (be == Backend::cuda) {
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    Buf& o = in.dev[in.dev.size() - 2];
    Buf& lse = in.dev[in.dev.size() - 1];
    o.down();
    lse.down();
    std::memcpy(r.o.mutable_view().data, o.host.data(), o.host.size());
    std::memcpy(r.lse.mutable_view().data, lse.host.data(), lse.host.size());
  }
  return r;
}

double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// GPU and CPU paged caches from the same prompts (lengths `prompt`, slot 1 left free when free_slot), then
// `steps` steps on both: every active slot's output against the exact recurrence and the two backends against
// each other; the free slot gives zeros and stays untouched.
void check_against_exact(const Shape& sh, std::vector<int64_t> prompt, int64_t steps, BetaMode bm, uint64_t seed,
                         double tol_exact, bool free_slot = false) {
  const int64_t T = *std::max_element(prompt.begin(), prompt.end()) + steps;
  const Case c = make_case(sh, T, bm, seed);
  Cache gpu(sh), cpu(sh);
  gpu.shuffle_pages(seed);
  cpu.shuffle_pages(seed);
  gpu.up();
  for (int64_t n = 0; n < sh.N; ++n) {
    if (free_slot && n == 1) continue;
    prefill_slot(c, gpu, n, prompt[size_t(n)], Backend::cuda);
    prefill_slot(c, cpu, n, prompt[size_t(n)], Backend::cpu);
  }
  const Exact ex(c);
  double worst_exact = 0, worst_cross = 0, worst_lse = 0;
  for (int64_t t = 0; t < steps; ++t) {
    std::vector<int64_t> pos(size_t(sh.N));
    for (int64_t n = 0; n < sh.N; ++n) pos[size_t(n)] = prompt[size_t(n)] + t;
    if (free_slot) pos[1] = 0;
    const StepOut g = step(c, gpu, pos, Backend::cuda);
    const StepOut h = step(c, cpu, pos, Backend::cpu);
    for (int64_t n = 0; n < sh.N; ++n) {
      for (int64_t hq = 0; hq < sh.HQ; ++hq) {
        std::vector<double> og(size_t(sh.V)), oc(size_t(sh.V)), ox;
        for (int64_t e = 0; e < sh.V; ++e) {
          og[size_t(e)] = g.o.get((n * sh.HQ + hq) * sh.V + e);
          oc[size_t(e)] = h.o.get((n * sh.HQ + hq) * sh.V + e);
        }
        if (free_slot && n == 1) {
          for (int64_t e = 0; e < sh.V; ++e) ASSERT_EQ(og[size_t(e)], 0.0) << "free slot output";
          continue;
        }
        double lse;
        ex.row(n, hq, pos[size_t(n)], ox, lse);
        worst_exact = std::max(worst_exact, rel_l2(og, ox));
        worst_cross = std::max(worst_cross, rel_l2(og, oc));
        worst_lse = std::max(worst_lse, std::abs(g.lse.get(n * sh.HQ + hq) - h.lse.get(n * sh.HQ + hq)));
      }
    }
  }
  std::printf("[paged] K %lld HQ/H %lld/%lld S %lld page %lld %s%s keys %s: o vs exact %.2e, gpu vs cpu o %.2e lse %.2e\n",
              (long long)sh.K, (long long)sh.HQ, (long long)sh.H, (long long)sh.S, (long long)sh.page,
              sh.path ? "path" : "plain", sh.gate ? "+gate" : "", sh.kdt == DType::f16 ? "f16" : "f32", worst_exact,
              worst_cross, worst_lse);
  EXPECT_LE(worst_exact, tol_exact);
  EXPECT_LE(worst_cross, tol_exact);
  gpu.down();
  for (int64_t n = 0; n < sh.N; ++n) {
    if (free_slot && n == 1) {
      EXPECT_EQ(gpu.len.as<int32_t>()[1], -1);
      continue;
    }
    EXPECT_EQ(gpu.len.as<int32_t>()[n], prompt[size_t(n)] + steps);
    EXPECT_EQ(gpu.len.as<int32_t>()[n], cpu.len.as<int32_t>()[n]);
    EXPECT_EQ(gpu.fl.as<int32_t>()[n], cpu.fl.as<int32_t>()[n]);
  }
}

Shape shape(int64_t K, int64_t HQ, int64_t H, int64_t S, int64_t page, bool gate, DType kdt) {
  const int64_t N = 3, max_pages = (160 + 64 + page - 1) / page + 1;
  return Shape{N, HQ, H, K, K, S, page, max_pages, N * max_pages + 5, true, gate, kdt, DType::bf16};
}

// bf16 outputs: one rounding of o is 2^-9 relative; the tolerance leaves room for the exact reference's
// difference in the unrounded inputs' products (fp32 math) and, with f16 keys, one rounding of each key a flush.
TEST(CudaPaged, MatchesExactAndCpuF32Keys) {
  REQUIRE_GPU();
  for (int64_t K : {64, 128})
    for (bool gate : {false, true}) check_against_exact(shape(K, 4, 2, 8, 16, gate, DType::f32), {37, 0, 130}, 20, BetaMode::uniform02, 11 + K, 4e-3);
}

TEST(CudaPaged, MatchesExactAndCpuF16Keys) {
  REQUIRE_GPU();
  check_against_exact(shape(128, 8, 2, 16, 16, false, DType::f16), {65, 7, 160}, 40, BetaMode::uniform02, 21, 6e-3);
  check_against_exact(shape(64, 2, 2, 64, 1, true, DType::f16), {1, 63, 64}, 70, BetaMode::two, 22, 6e-3);
  check_against_exact(shape(128, 12, 2, 3, 16, true, DType::f16), {100, 9, 33}, 10, BetaMode::near2, 23, 6e-3);
}

TEST(CudaPaged, FreeSlotSkippedAndUntouched) {
  REQUIRE_GPU();
  check_against_exact(shape(128, 4, 2, 8, 16, true, DType::f16), {20, 0, 50}, 12, BetaMode::uniform02, 31, 6e-3, true);
}

TEST(CudaPaged, PlainAttentionWithoutW) {
  REQUIRE_GPU();
  Shape sh = shape(64, 4, 2, 1, 16, false, DType::f16);
  sh.path = false;
  check_against_exact(sh, {30, 5, 80}, 10, BetaMode::uniform02, 41, 6e-3);
}

// The same sequence through pages of 4 tokens in shuffled order and through one contiguous run of 64-token
// pages (equal capacity, so the same splits): bitwise equal outputs and lse at every step.
TEST(CudaPaged, PagingIsInvisibleBitwise) {
  REQUIRE_GPU();
  Shape a = shape(128, 4, 2, 16, 4, true, DType::f16), b = a;
  a.max_pages = 64, a.pool = a.N * 64 + 3;
  b.page = 64, b.max_pages = 4, b.pool = b.N * 4;
  const Case c = make_case(a, 256, BetaMode::uniform02, 51);
  Cache ca(a), cb(b);
  ca.shuffle_pages(5);
  for (int64_t i = 0; i < b.N * b.max_pages; ++i) cb.bt.as<int32_t>()[i] = int32_t(i);
  ca.up();
  cb.up();
  const std::vector<int64_t> prompt = {100, 3, 47};
  for (int64_t n = 0; n < a.N; ++n) {
    prefill_slot(c, ca, n, prompt[size_t(n)], Backend::cuda);
    prefill_slot(c, cb, n, prompt[size_t(n)], Backend::cuda);
  }
  for (int64_t t = 0; t < 40; ++t) {
    std::vector<int64_t> pos(3);
    for (int n = 0; n < 3; ++n) pos[size_t(n)] = prompt[size_t(n)] + t;
    const StepOut x = step(c, ca, pos, Backend::cuda), y = step(c, cb, pos, Backend::cuda);
    ASSERT_EQ(std::memcmp(x.o.view().data, y.o.view().data, size_t(x.o.numel() * 2)), 0) << "step " << t;
    ASSERT_EQ(std::memcmp(x.lse.view().data, y.lse.view().data, size_t(x.lse.numel() * 4)), 0) << "step " << t;
  }
}

// Two caches of the same shape with the same shuffled pages, each prefilled with the first P tokens of every row.
void prefill_pair(const Case& c, Cache& a, Cache& b, int64_t P, uint64_t seed) {
  for (Cache* x : {&a, &b}) {
    x->shuffle_pages(seed);
    x->up();
  }
  for (int64_t n = 0; n < a.s.N; ++n) {
    prefill_slot(c, a, n, P, Backend::cuda);
    prefill_slot(c, b, n, P, Backend::cuda);
  }
}

// T tokens in one call equal T single-token calls bitwise (the same launches in the same order).
TEST(CudaPaged, ChunkEqualsSingleStepsBitwise) {
  REQUIRE_GPU();
  const Shape sh = shape(128, 4, 2, 8, 16, true, DType::f16);
  const int64_t P = 40, T = 13;
  const Case c = make_case(sh, P + T, BetaMode::uniform02, 61);
  Cache a(sh), b(sh);
  prefill_pair(c, a, b, P, 1);
  std::vector<StepOut> singles;
  for (int64_t t = 0; t < T; ++t) singles.push_back(step(c, a, std::vector<int64_t>(size_t(sh.N), P + t), Backend::cuda));
  // The chunk: tokens P .. P + T - 1 of every row as one [N, T, ...] call.
  auto chunk = [&](const HostTensor& x) {
    if (!x.present()) return HostTensor();
    const TensorView v = x.view();
    const int64_t inner = v.ndim == 4 ? v.shape[2] * v.shape[3] : v.shape[2], es = dtype_size(v.dtype);
    HostTensor r(v.dtype, v.ndim == 4 ? std::vector<int64_t>{sh.N, T, v.shape[2], v.shape[3]} : std::vector<int64_t>{sh.N, T, v.shape[2]});
    for (int64_t n = 0; n < sh.N; ++n)
      std::memcpy(static_cast<char*>(r.mutable_view().data) + n * T * inner * es,
                  static_cast<const char*>(v.data) + (n * (P + T) + P) * inner * es, size_t(T * inner * es));
    return r;
  };
  HostTensor q = chunk(c.q), k = chunk(c.k), v = chunk(c.v), w = chunk(c.w), beta = chunk(c.beta);
  HostTensor o(sh.dt, {sh.N, T, sh.HQ, sh.V});
  Inputs in;
  auto put = [&](const HostTensor& h) { return in.put(h); };
  PathPagedDecodeParams p;
  p.q = put(q), p.k = put(k), p.v = put(v), p.w = put(w), p.beta = put(beta), p.o = put(o);
  p.cache = b.view(true);
  p.backend = Backend::cuda;
  const Status st = path_attn_paged_decode(p);
  ASSERT_TRUE(st.ok()) << st.message();
  Buf& od = in.dev.back();
  od.down();
  for (int64_t n = 0; n < sh.N; ++n)
    for (int64_t t = 0; t < T; ++t)
      ASSERT_EQ(std::memcmp(od.host.data() + ((n * T + t) * sh.HQ * sh.V) * 2,
                            static_cast<const char*>(singles[size_t(t)].o.view().data) + n * sh.HQ * sh.V * 2,
                            size_t(sh.HQ * sh.V * 2)), 0) << "slot " << n << " token " << t;
  a.down();
  b.down();
  EXPECT_EQ(a.bytes(), b.bytes());
}

// Bad metadata with validate off: the slot's outputs are NaN and the whole cache stays bitwise unchanged; with
// validate on: a named error before anything is written.
TEST(CudaPaged, BadMetadataSkippedOrRefused) {
  REQUIRE_GPU();
  const Shape sh = shape(64, 4, 2, 8, 16, true, DType::f16);
  const Case c = make_case(sh, 80, BetaMode::uniform02, 71);
  Cache a(sh);
  a.shuffle_pages(2);
  a.up();
  for (int64_t n = 0; n < sh.N; ++n) prefill_slot(c, a, n, 30, Backend::cuda);
  // Slot 2's second page out of the pool.
  int32_t badpg = int32_t(sh.pool + 7);
  EXPECT_EQ(cudaMemcpy(static_cast<int32_t*>(a.bt.dev) + 2 * sh.max_pages + 1, &badpg, 4, cudaMemcpyHostToDevice), cudaSuccess);
  a.down();
  const StepOut r = step(c, a, std::vector<int64_t>(3, 30), Backend::cuda, /*validate=*/false);
  for (int64_t e = 0; e < sh.HQ * sh.V; ++e) {
    EXPECT_TRUE(std::isnan(r.o.get(2 * sh.HQ * sh.V + e)));
    EXPECT_TRUE(std::isfinite(r.o.get(e)));
  }
  a.down();
  // Slots 0 and 1 advanced; slot 2 did not.
  EXPECT_EQ(a.len.as<int32_t>()[2], 30);
  EXPECT_EQ(a.len.as<int32_t>()[0], 31);
  // Validated: refused, naming the block table, and nothing changes.
  a.down();
  const std::vector<uint8_t> mid = a.bytes();
  PathPagedDecodeParams p;
  HostTensor q = gather(c.q, {31, 31, 31}), k = gather(c.k, {31, 31, 31}), v = gather(c.v, {31, 31, 31});
  HostTensor w = gather(c.w, {31, 31, 31}), beta = gather(c.beta, {31, 31, 31}), o(sh.dt, {sh.N, 1, sh.HQ, sh.V});
  Inputs in;
  auto put = [&](const HostTensor& h) { return in.put(h); };
  p.q = put(q), p.k = put(k), p.v = put(v), p.w = put(w), p.beta = put(beta), p.o = put(o);
  p.cache = a.view(true);
  p.backend = Backend::cuda;
  const Status st = path_attn_paged_decode(p);
  EXPECT_EQ(st.code(), Status::Code::invalid_argument);
  EXPECT_NE(st.message().find("block_table"), std::string::npos) << st.message();
  a.down();
  EXPECT_EQ(a.bytes(), mid);
}

// A step captured in a CUDA graph (validate off, everything on the device) and replayed: the same outputs as
// the same steps run eagerly on a copy of the cache, across flushes.
TEST(CudaPaged, CapturedStepReplays) {
  REQUIRE_GPU();
  const Shape sh = shape(128, 4, 2, 4, 16, true, DType::f16);
  const int64_t P = 20, steps = 12;
  const Case c = make_case(sh, P + steps, BetaMode::uniform02, 81);
  Cache a(sh), b(sh);
  prefill_pair(c, a, b, P, 3);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  // Fixed device buffers for one step's inputs and outputs (the graph reads whatever they hold at replay).
  HostTensor q0 = gather(c.q, std::vector<int64_t>(3, P)), k0 = gather(c.k, std::vector<int64_t>(3, P));
  HostTensor v0 = gather(c.v, std::vector<int64_t>(3, P)), w0 = gather(c.w, std::vector<int64_t>(3, P));
  HostTensor b0 = gather(c.beta, std::vector<int64_t>(3, P)), o0(sh.dt, {sh.N, 1, sh.HQ, sh.V});
  std::vector<Buf> io;
  io.reserve(6);
  for (const HostTensor* h : {&q0, &k0, &v0, &w0, &b0, &o0})
    io.emplace_back(h->dtype(), std::vector<int64_t>(h->view().shape, h->view().shape + h->view().ndim));
  PathPagedDecodeParams p;
  p.q = io[0].dv(), p.k = io[1].dv(), p.v = io[2].dv(), p.w = io[3].dv(), p.beta = io[4].dv(), p.o = io[5].dv();
  p.cache = a.view(true);
  p.backend = Backend::cuda;
  p.validate = false;
  p.stream = s;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status st = path_attn_paged_decode(p);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int64_t t = 0; t < steps; ++t) {
    const std::vector<int64_t> pos(3, P + t);
    HostTensor in[5] = {gather(c.q, pos), gather(c.k, pos), gather(c.v, pos), gather(c.w, pos), gather(c.beta, pos)};
    for (int i = 0; i < 5; ++i) {
      std::memcpy(io[size_t(i)].host.data(), in[i].view().data, io[size_t(i)].host.size());
      io[size_t(i)].up();
    }
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    io[5].down();
    const StepOut e = step(c, b, pos, Backend::cuda, /*validate=*/false);
    ASSERT_EQ(std::memcmp(io[5].host.data(), e.o.view().data, io[5].host.size()), 0) << "step " << t;
  }
  a.down();
  b.down();
  EXPECT_EQ(a.bytes(), b.bytes());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// The accuracy bar: a 4096-token prompt, then 32768 steps; the outputs of the last 256 steps against the exact
// recurrence in fp64 (relative L2 over them), with beta ~ U(0, 2) and with beta = 2 (every factor a reflection).
TEST(CudaPaged, Soak32kStepsF16Keys) {
  REQUIRE_GPU();
  for (BetaMode bm : {BetaMode::uniform02, BetaMode::two}) {
    Shape sh{1, 2, 1, 128, 128, kPagedMaxPending, 16, (4096 + 32768) / 16 + 1, (4096 + 32768) / 16 + 1, true, false,
             DType::f16, DType::bf16};
    const int64_t P = 4096, steps = 32768;
    const Case c = make_case(sh, P + steps, bm, 91);
    Cache a(sh);
    for (int64_t i = 0; i < sh.max_pages; ++i) a.bt.as<int32_t>()[i] = int32_t(i);
    a.up();
    prefill_slot(c, a, 0, P, Backend::cuda);
    const Exact ex(c);
    // Every step's inputs go up once, as [1, steps, ...] device tensors; a step reads token t of them.
    Inputs in;
    auto put = [&](const HostTensor& h) { return in.put(h); };
    const TensorView dq = put(c.q), dk = put(c.k), dvv = put(c.v), dw = put(c.w), db = put(c.beta);
    Buf od(sh.dt, {1, 1, sh.HQ, sh.V});
    auto tok = [&](TensorView x, int64_t t) {
      x.data = static_cast<char*>(x.data) + t * x.stride[1] * dtype_size(x.dtype);
      x.shape[1] = 1;
      return x;
    };
    double num = 0, den = 0;
    for (int64_t t = 0; t < steps; ++t) {
      PathPagedDecodeParams p;
      const int64_t i = P + t;
      p.q = tok(dq, i), p.k = tok(dk, i), p.v = tok(dvv, i), p.w = tok(dw, i), p.beta = tok(db, i), p.o = od.dv();
      p.cache = a.view(true);
      p.backend = Backend::cuda;
      p.validate = false;
      const Status st = path_attn_paged_decode(p);
      ASSERT_TRUE(st.ok()) << st.message();
      if (t < steps - 256) continue;
      od.down();
      HostTensor oh(sh.dt, {1, 1, sh.HQ, sh.V});
      std::memcpy(oh.mutable_view().data, od.host.data(), od.host.size());
      for (int64_t hq = 0; hq < sh.HQ; ++hq) {
        std::vector<double> ox;
        double lse;
        ex.row(0, hq, i, ox, lse);
        for (int64_t e = 0; e < sh.V; ++e) {
          const double x = oh.get(hq * sh.V + e);
          num += (x - ox[size_t(e)]) * (x - ox[size_t(e)]);
          den += ox[size_t(e)] * ox[size_t(e)];
        }
      }
    }
    const double err = std::sqrt(num / den);
    std::printf("[paged soak] %s: 4096-token prompt + 32768 steps, f16 keys, S = 64: o rel L2 over the last 256 steps %.2e\n",
                bm == BetaMode::two ? "beta = 2" : "beta ~ U(0, 2)", err);
    EXPECT_LE(err, 1e-2);
  }
}

}  // namespace
}  // namespace pathattn::test
