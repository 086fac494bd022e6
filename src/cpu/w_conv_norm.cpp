// cpu/w_conv_norm.cpp: the w preparation op (short convolution, SiLU, per-head L2 norm) on the host, forward and
// backward, in fp32 or fp64 (core::WConvNormProblem::f64). Plain loops: the op is a few flops per element.
// Threads take (sequence, head) units in the forward and heads in the backward, so dweight / dbias are summed
// over sequences and tokens in one fixed order whatever the thread count.
#include <cmath>
#include <vector>

#include "core/convert.h"
#include "core/w_conv_norm.h"
#include "cpu/cpu_backend.h"

namespace pathattn::cpu {
namespace {

using core::load_elem;
using core::offset3;
using core::store_elem;
using core::WConvNormProblem;

// The op's per-head pieces for one (sequence, head): taps, bias, convolution, activation, norm.
template <typename Tc>
struct Head {
  const WConvNormProblem& pr;
  const TensorView& x;
  int64_t b, t0, len, c0;  // batch row, first token and length of the sequence, first channel of the head
  std::vector<Tc> w, bias;  // [hd][W], [hd] in the compute type

  Head(const WConvNormProblem& pr_, const TensorView& x_, const TensorView& weight, const TensorView& bias_v,
       int64_t h)
      : pr(pr_), x(x_), b(0), t0(0), len(0), c0(h * pr_.head_dim) {
    const int64_t hd = pr.head_dim, W = pr.W;
    w.assign(size_t(hd * W), Tc(0));
    bias.assign(size_t(hd), Tc(0));
    for (int64_t j = 0; j < hd; ++j) {
      for (int64_t i = 0; i < W; ++i) w[j * W + i] = load_elem<Tc>(weight.data, weight.dtype, (c0 + j) * weight.stride[0] + i);
      if (pr.bias) bias[j] = load_elem<Tc>(bias_v.data, bias_v.dtype, (c0 + j) * bias_v.stride[0]);
    }
  }
  void set_seq(const core::Seq& s) { b = s.b, t0 = s.t0, len = s.len; }
  // x at sequence position u (zero before the sequence's start), channel j of the head.
  Tc xat(int64_t u, int64_t j) const {
    return u < 0 ? Tc(0) : load_elem<Tc>(x.data, x.dtype, offset3(x, b, t0 + u, c0 + j));
  }
  // z at sequence position u: the taps in flash-linear-attention's order (tap 0 first), then the bias.
  Tc conv(int64_t u, int64_t j) const {
    if (pr.W == 0) return xat(u, j);
    Tc z = 0;
    for (int64_t i = 0; i < pr.W; ++i) z = z + w[j * pr.W + i] * xat(u - (pr.W - 1 - i), j);
    return pr.bias ? z + bias[j] : z;
  }
  Tc act(Tc z) const { return pr.activation ? z / (Tc(1) + std::exp(-z)) : z; }
  // d act / dz: SiLU'(z) = s (1 + z (1 - s)), s = sigmoid(z).
  Tc dact(Tc z) const {
    if (!pr.activation) return Tc(1);
    const Tc s = Tc(1) / (Tc(1) + std::exp(-z));
    return s * (Tc(1) + z * (Tc(1) - s));
  }
  // a[j] and z[j] of position u; returns r = 1 / sqrt(sum a^2 + eps).
  Tc row(int64_t u, Tc* z, Tc* a) const {
    Tc ss = 0;
    for (int64_t j = 0; j < pr.head_dim; ++j) {
      z[j] = conv(u, j);
      a[j] = act(z[j]);
      ss += a[j] * a[j];
    }
    return Tc(1) / std::sqrt(ss + Tc(pr.eps));
  }
};

template <typename Tc>
void fwd_impl(const WConvNormFwdParams& p, const WConvNormProblem& pr) {
  const int64_t H = pr.H, hd = pr.head_dim;
  const int64_t units = int64_t(pr.seqs.size()) * H;
  parallel_for(units, p.num_threads, [&](int64_t u) {
    Head<Tc> hh(pr, p.x, p.weight, p.bias, u % H);
    hh.set_seq(pr.seqs[size_t(u / H)]);
    std::vector<Tc> z(static_cast<size_t>(hd)), a(static_cast<size_t>(hd));
    for (int64_t t = 0; t < hh.len; ++t) {
      const Tc r = hh.row(t, z.data(), a.data());
      const int64_t off = offset3(p.out, hh.b, hh.t0 + t, hh.c0);
      for (int64_t j = 0; j < hd; ++j) store_elem<Tc>(p.out.data, p.out.dtype, off + j, a[j] * r);
    }
  });
}

// Backward of one head over every sequence: dz per token of a sequence, then dx from the taps, and the weight and
// bias sums in sequence and token order.
template <typename Tc>
void bwd_head(const WConvNormBwdParams& p, const WConvNormProblem& pr, int64_t h) {
  const int64_t hd = pr.head_dim, W = pr.W;
  Head<Tc> hh(pr, p.x, p.weight, p.bias, h);
  std::vector<Tc> z(static_cast<size_t>(hd)), a(static_cast<size_t>(hd)), dz;
  std::vector<Tc> dw(static_cast<size_t>(hd * W), Tc(0)), db(static_cast<size_t>(hd), Tc(0));
  for (const core::Seq& s : pr.seqs) {
    hh.set_seq(s);
    dz.assign(size_t(s.len * hd), Tc(0));
    for (int64_t t = 0; t < s.len; ++t) {
      const Tc r = hh.row(t, z.data(), a.data());
      const int64_t off = offset3(p.dout, s.b, s.t0 + t, hh.c0);
      Tc dot = 0;
      for (int64_t j = 0; j < hd; ++j) dot += load_elem<Tc>(p.dout.data, p.dout.dtype, off + j) * (a[j] * r);
      for (int64_t j = 0; j < hd; ++j) {
        const Tc g = load_elem<Tc>(p.dout.data, p.dout.dtype, off + j);
        dz[size_t(t * hd + j)] = r * (g - a[j] * r * dot) * hh.dact(z[j]);
      }
    }
    for (int64_t t = 0; t < s.len; ++t) {
      const int64_t off = offset3(p.dx, s.b, s.t0 + t, hh.c0);
      for (int64_t j = 0; j < hd; ++j) {
        Tc d = 0;
        if (W == 0) {
          d = dz[size_t(t * hd + j)];
        } else {
          // x[t] feeds z[t + W - 1 - i] through tap i.
          for (int64_t i = 0; i < W; ++i) {
            const int64_t u = t + W - 1 - i;
            if (u < s.len) d += hh.w[size_t(j * W + i)] * dz[size_t(u * hd + j)];
          }
          const Tc g = dz[size_t(t * hd + j)];
          for (int64_t i = 0; i < W; ++i) dw[size_t(j * W + i)] += g * hh.xat(t - (W - 1 - i), j);
          db[size_t(j)] += g;
        }
        store_elem<Tc>(p.dx.data, p.dx.dtype, off + j, d);
      }
    }
  }
  for (int64_t j = 0; j < hd; ++j) {
    if (p.dweight.present()) {
      for (int64_t i = 0; i < W; ++i) {
        store_elem<Tc>(p.dweight.data, p.dweight.dtype, (hh.c0 + j) * p.dweight.stride[0] + i, dw[size_t(j * W + i)]);
      }
    }
    if (p.dbias.present()) store_elem<Tc>(p.dbias.data, p.dbias.dtype, (hh.c0 + j) * p.dbias.stride[0], db[size_t(j)]);
  }
}

}  // namespace

Status w_conv_norm_fwd(const WConvNormFwdParams& p, const WConvNormProblem& pr) {
  if (pr.f64) fwd_impl<double>(p, pr);
  else fwd_impl<float>(p, pr);
  return Status::Ok();
}

Status w_conv_norm_bwd(const WConvNormBwdParams& p, const WConvNormProblem& pr) {
  parallel_for(pr.H, p.num_threads, [&](int64_t h) {
    if (pr.f64) bwd_head<double>(p, pr, h);
    else bwd_head<float>(p, pr, h);
  });
  return Status::Ok();
}

}  // namespace pathattn::cpu
