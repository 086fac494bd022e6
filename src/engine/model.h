// engine/model.h: the decoder-only transformer (token embedding, pre-norm RMSNorm blocks of attention and
// SwiGLU MLP, final norm, LM head tied or untied) with hand-written forward and backward, templated on the
// scalar type. Parameters, gradients and optimizer state are flat arrays described by one layout table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/ops.h"
#include "pathattn/types.h"

namespace pathattn::engine {

// One named parameter tensor inside the flat parameter array.
struct ParamInfo {
  std::string name;             // e.g. "blocks.0.attn.wq"
  std::vector<int64_t> shape;   // [In, Out] for projections
  int64_t offset = 0, numel = 0;
  bool decay = false;           // AdamW weight decay applies
};

// Builds the parameter table of a model config (names, shapes, offsets). The order is fixed: it is the
// checkpoint's tensor order.
std::vector<ParamInfo> param_layout(const ModelConfig& m);

// Where each tensor of a layout starts in the flat array (-1: not in this config), by role: what the forward
// and backward of every device read. w_in is ww1 (low rank) or ww (full w projection).
struct BlockOffsets {
  int64_t ln1, wq, wk, wv, wo, ww1, ww2, wconv, wb, bb, wg, bg, ln2, wfc, wproj;
};
struct ParamOffsets {
  int64_t wte = -1, lnf = -1, head = -1;  // head: untied LM head
  std::vector<BlockOffsets> blocks;
};
ParamOffsets param_offsets(const ModelConfig& m, const std::vector<ParamInfo>& layout);

// Statistics of one forward pass over the rows that carry a target.
struct StepStats {
  double loss = 0;            // mean cross-entropy over counted rows (0 when none)
  int64_t count = 0, correct = 0;
};

template <typename T>
class Model {
 public:
  explicit Model(const ModelConfig& cfg);

  // Draws the initial parameters from `seed` (normal(0, init_std) matrices, residual output projections
  // scaled by 1/sqrt(2 n_layer), norms 1, biases 0 except b_g = gate_bias_init, conv U(+-1/sqrt(3))).
  void init(uint64_t seed);

  // Forward over tokens [B, T] (int32 ids in [0, vocab)) with targets [B, T] (-1: no loss), both row-major.
  // Keeps the activations for backward(). pred [B, T] (optional) receives the argmax of each row's logits.
  // Returns the loss stats; throws EngineError if the attention op rejects its input or is unavailable.
  StepStats forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T_, int32_t* pred = nullptr);
  // Backward of the last forward: grads += d(mean loss)/d(params). Call zero_grad() first.
  void backward();
  void zero_grad();

  // Logits [B, T, vocab] of the last forward.
  const std::vector<T>& logits() const { return logits_; }

  const ModelConfig& config() const { return cfg_; }
  const std::vector<ParamInfo>& layout() const { return layout_; }
  T* param(const std::string& name);
  T* grad(const std::string& name);

  std::vector<T> params, grads;
  Backend backend = Backend::cpu;  // attention backend
  int threads = 0;                 // attention threads (0: OpenMP default)

 private:
  struct LayerActs {
    std::vector<T> x, ln1, rstd1, q, k, v, wlr, wraw, wc, ws, w, wrinv, beta, g, o, lse;
    std::vector<T> xmid, ln2, rstd2, h, m;
  };
  void attention_fwd(LayerActs& a, int64_t B, int64_t T_);
  void attention_bwd(LayerActs& a, const std::vector<T>& dO, std::vector<T>& dq, std::vector<T>& dk,
                     std::vector<T>& dv, std::vector<T>& dw, std::vector<T>& dbeta, std::vector<T>& dg,
                     int64_t B, int64_t T_);

  ModelConfig cfg_;
  std::vector<ParamInfo> layout_;
  std::vector<BlockOffsets> lo_;
  int64_t off_wte_ = 0, off_lnf_ = 0, off_head_ = -1;
  // Saved activations of the last forward.
  int64_t nb_ = 0, nt_ = 0;
  std::vector<int32_t> tokens_, targets_;
  std::vector<LayerActs> acts_;
  std::vector<T> xfinal_, lnf_, rstdf_, logits_;
  int64_t count_ = 0;
};

extern template class Model<float>;
extern template class Model<double>;

}  // namespace pathattn::engine
