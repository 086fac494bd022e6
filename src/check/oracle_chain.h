// check/oracle_chain.h: the oracle chain, shared by the ctest suite and `pathattn check`. Draws awkward
// random cases and compares a candidate backend (the cpu fast path) with the fp64 oracle, in fp64 (max
// relative error) and fp32 (relative L2), forward and every gradient. Bounds: docs/numerics.md.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "check/harness.h"

namespace pathattn::test {

// Bounds of the chain (docs/numerics.md gives the reasoning).
inline constexpr double kFp64MaxRel = 1e-10;      // fast fp64 vs oracle, every tensor
inline constexpr double kFp32RelL2Fwd = 1e-5;     // fast fp32 vs oracle: o and lse
inline constexpr double kFp32RelL2Grad = 1e-4;    // fast fp32 vs oracle: dq, dk, dv, dw, dbeta, dg

// One drawn case: T in {1, 7, 63, 64, 65, 200}; K and V multiples of 8 in [8, 256], K != V about half
// the time; MHA, GQA and MQA (H in {1, 2}, HQ / H in {1, 2, 4}); varlen (B = 1) about a third of the time
// with at least one empty and one length-1 sequence, else B in {1, 2}; gate on or off; beta ~ U(0, 2),
// beta = 2 or beta in [1.98, 2]; gate_scale default or 1. The spec's dtype is f64; the chain casts.
CaseSpec draw_check_spec(std::mt19937_64& rng);

// One comparison: a tensor of one case in one precision.
struct TensorCheck {
  std::string precision;  // "fp64" or "fp32"
  std::string tensor;     // "o", "lse", "dq", "dk", "dv", "dw", "dbeta", "dg"
  std::string metric;     // "max_rel" (fp64) or "rel_l2" (fp32)
  double error = 0, bound = 0;
  bool pass = false;
  std::string note;       // why it failed beyond the error, e.g. "guard region overwritten"
};

struct CaseCheck {
  CaseSpec spec;
  std::vector<TensorCheck> tensors;
  Status status;  // not ok when a backend call failed (then the case fails)
  bool pass() const;
};

// Compares one tensor: metric "max_rel" (max|a - r| / max|r|) or "rel_l2" (||a - r|| / ||r||) against
// `bound`. Non-finite errors never pass.
TensorCheck compare_tensor(const std::string& precision, const std::string& tensor, bool l2,
                           const std::vector<double>& got, const std::vector<double>& ref, double bound);

// Runs the case drawn from `spec` (f64 inputs) on the oracle and on `candidate`:
//   fp64: candidate on the f64 inputs vs the oracle on the same inputs, max_rel <= kFp64MaxRel.
//   fp32: candidate on the inputs rounded to f32 (q, k, v, w, beta, g, dout) vs the oracle on exactly
//         those rounded values, rel_l2 <= kFp32RelL2Fwd (o, lse) / kFp32RelL2Grad (gradients).
// The candidate's backward consumes its own forward's o and lse. Tensors: o, lse, dq, dk, dv, and dw,
// dbeta (PaTH), dg (gate). chunk_size is passed to the candidate (0 = its default).
CaseCheck check_case(const CaseSpec& spec, Backend candidate, int num_threads = 0, int chunk_size = 0);

// The case with q, k, v cast to `dt` (w, beta, g to f64 if dt is f64, else f32); cu_seqlens shared.
Case cast_case(const Case& c, DType dt);

}  // namespace pathattn::test
