// check/harness.h: shared test machinery. Owning host tensors with guard regions (poisoned sentinels
// around every output to catch out-of-bounds writes), seeded random PaTH inputs, and runners that fill the
// one params struct and call any backend, so a test builds a case once and compares backends.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "pathattn/pathattn.h"

namespace pathattn::test {

// An owning, contiguous host tensor with `kGuard` poisoned bytes before and after its data.
class HostTensor {
 public:
  static constexpr int64_t kGuard = 64;
  HostTensor() = default;
  HostTensor(DType dt, std::vector<int64_t> shape);
  TensorView view() const { return view_; }
  TensorView& mutable_view() { return view_; }
  bool present() const { return view_.data != nullptr; }
  int64_t numel() const { return view_.numel(); }
  DType dtype() const { return view_.dtype; }
  // Element access through fp64 (rounding on store for low-precision dtypes).
  double get(int64_t i) const;
  void set(int64_t i, double x);
  std::vector<double> to_f64() const;
  void fill_f64(const std::vector<double>& x);
  void poison();              // data := NaN (floats) / 0x7f bytes; guards keep their sentinel
  bool guards_intact() const; // true iff no byte of either guard region was written
  HostTensor clone() const;
  HostTensor cast(DType dt) const;

 private:
  std::shared_ptr<std::vector<uint8_t>> buf_;
  TensorView view_;
};

// How beta is drawn.
enum class BetaMode { uniform02, two, zero, near2 };

struct CaseSpec {
  int64_t B = 1, T = 16, HQ = 2, H = 2, K = 16, V = 16;
  bool path = true, gate = false;
  DType dtype = DType::f64;             // q, k, v (w, beta, g: f64 if dtype is f64, else f32)
  std::vector<int64_t> seqlens;         // non-empty: varlen with B = 1 and T = sum(seqlens)
  BetaMode beta = BetaMode::uniform02;
  uint64_t seed = 1;
  double gate_scale = kDefaultScale;
  double q_scale = 1;                   // q ~ N(0, q_scale^2) (range cases: entries beyond fp16's)
  double do_scale = 1;                  // random_dout ~ N(0, do_scale^2) (gradients outside fp16's range)
  std::string name() const;
};
// gtest prints parameters through this (readable test logs instead of a byte dump).
inline void PrintTo(const CaseSpec& s, std::ostream* os) { *os << s.name(); }

// Inputs of one case, drawn fresh from the seed: q, k, v ~ N(0, 1); w = L2-normalised N(0, 1) rows;
// beta per BetaMode; g = logsigmoid(N(0,1) + 3).
struct Case {
  CaseSpec spec;
  HostTensor q, k, v, w, beta, g, cu;
  static Case make(const CaseSpec& s);
  PathFwdParams fwd_params(const HostTensor& o, const HostTensor* lse) const;
};

struct FwdOut {
  HostTensor o, lse;
  Status status;
};
struct BwdOut {
  HostTensor dq, dk, dv, dw, dbeta, dg;
  Status status;
};

// Runs the forward on `backend` into fresh poisoned outputs (dtype of v for o; f64/f32 for lse).
FwdOut run_fwd(const Case& c, Backend backend, int num_threads = 0, int chunk_size = 0);
// Runs the backward given the forward outputs and an output gradient; dw, dbeta, dg in the dtypes of w, beta, g.
BwdOut run_bwd(const Case& c, const FwdOut& f, const HostTensor& dout, Backend backend, int num_threads = 0,
               int chunk_size = 0);
// A random output gradient [B, T, HQ, V] in the dtype of v.
HostTensor random_dout(const Case& c, uint64_t seed);

// Cases cut from others (the decode tests' prompts and steps).
// The positions `rows` of a [1, T, ...] tensor as a new contiguous [B, Tn, ...] tensor (B * Tn == rows.size()).
HostTensor gather_t(const HostTensor& x, const std::vector<int64_t>& rows, int64_t B, int64_t Tn);
// A case made of the positions `rows` of `full` (B = 1), laid out [B, Tn]; varlen when seqlens is given.
Case sub_case(const Case& full, const std::vector<int64_t>& rows, int64_t B, int64_t Tn, std::vector<int64_t> seqlens);
// The same case with every float tensor in f64 (values unchanged).
Case to_f64(const Case& c);
// A view of positions [t0, t0 + len) along dimension 1 (absent stays absent).
TensorView slice_t(const TensorView& x, int64_t t0, int64_t len);

// Error metrics over fp64 copies.
double rel_l2(const std::vector<double>& a, const std::vector<double>& ref);
double max_rel(const std::vector<double>& a, const std::vector<double>& ref);  // max|a-r| / max|r|
bool all_finite(const std::vector<double>& a);

}  // namespace pathattn::test
