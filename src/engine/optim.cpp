// engine/optim.cpp: AdamW, the learning-rate schedule and gradient clipping (engine/optim.h). Serial loops
// in a fixed order: the update is bitwise reproducible.
#include "engine/optim.h"

#include <cmath>

namespace pathattn::engine {

double lr_at(const TrainConfig& c, int64_t step) {
  if (step < c.warmup_steps) return c.lr * double(step + 1) / double(c.warmup_steps);
  const int64_t decay_steps = c.steps - c.warmup_steps;
  if (decay_steps <= 1) return c.lr;
  double frac = double(step - c.warmup_steps) / double(decay_steps - 1);
  if (frac > 1) frac = 1;
  const double min_lr = c.lr * c.min_lr_ratio;
  return min_lr + 0.5 * (c.lr - min_lr) * (1.0 + std::cos(3.14159265358979323846 * frac));
}

template <typename T>
double global_norm(const T* g, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(g[i]) * double(g[i]);
  return std::sqrt(s);
}

template <typename T>
double AdamW<T>::step(Model<T>& model, const TrainConfig& c, double lr) {
  const int64_t n = int64_t(model.params.size());
  T* g = model.grads.data();
  const double norm = global_norm(g, n);
  const T gscale = (c.grad_clip > 0 && norm > c.grad_clip) ? T(c.grad_clip / norm) : T(1);
  t += 1;
  const T b1 = T(c.beta1), b2 = T(c.beta2);
  const T bc1 = T(1.0 - std::pow(c.beta1, double(t))), bc2 = T(1.0 - std::pow(c.beta2, double(t)));
  const T tlr = T(lr), eps = T(c.adam_eps);
  for (const ParamInfo& pi : model.layout()) {
    const T wd = pi.decay ? T(c.weight_decay) : T(0);
    T* p = model.params.data() + pi.offset;
    T* gg = g + pi.offset;
    T* mm = m.data() + pi.offset;
    T* vv = v.data() + pi.offset;
    for (int64_t i = 0; i < pi.numel; ++i) {
      const T gi = gg[i] * gscale;
      mm[i] = b1 * mm[i] + (T(1) - b1) * gi;
      vv[i] = b2 * vv[i] + (T(1) - b2) * gi * gi;
      const T mh = mm[i] / bc1, vh = vv[i] / bc2;
      p[i] -= tlr * (mh / (std::sqrt(vh) + eps) + wd * p[i]);
    }
  }
  return norm;
}

template double global_norm<float>(const float*, int64_t);
template double global_norm<double>(const double*, int64_t);
template struct AdamW<float>;
template struct AdamW<double>;

}  // namespace pathattn::engine
