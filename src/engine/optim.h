// engine/optim.h: AdamW with decoupled weight decay, warm-up + cosine learning-rate schedule and global
// gradient-norm clipping, over the flat parameter / gradient arrays of a Model.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config.h"
#include "engine/model.h"

namespace pathattn::engine {

// Learning rate at step s (0-based) of `steps`: linear warm-up from lr/warmup to lr over warmup_steps, then
// cosine from lr down to lr * min_lr_ratio at the last step.
double lr_at(const TrainConfig& c, int64_t step);

// Global L2 norm of g[n] (accumulated in double, fixed order).
template <typename T>
double global_norm(const T* g, int64_t n);

template <typename T>
struct AdamW {
  std::vector<T> m, v;  // first and second moments, same layout as the parameters
  int64_t t = 0;        // number of updates applied
  void init(int64_t n) {
    m.assign(n, T(0));
    v.assign(n, T(0));
    t = 0;
  }
  // One update of every parameter: grads are clipped to norm <= clip first (clip > 0), then
  //   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  p -= lr (m^ / (sqrt(v^) + eps) + wd p [decay]).
  // Returns the gradient norm before clipping.
  double step(Model<T>& model, const TrainConfig& c, double lr);
};

extern template struct AdamW<float>;
extern template struct AdamW<double>;

}  // namespace pathattn::engine
