// engine/model.h: the decoder-only transformer (token embedding, pre-norm RMSNorm blocks of attention and
// SwiGLU MLP, final norm, LM head tied or untied) with hand-written forward and backward, templated on the
// scalar type. Parameters, gradients and optimizer state are flat arrays described by one layout table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/ops.h"
#include "pathattn/decode.h"
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

// Model FLOPs of one trained token (forward and backward) at context T, as MFU counts them: 6 per weight of every
// matrix product (projections, MLP, the output head; a tied embedding once, as the head) and 6 K T per query head
// and layer for the causal attention's two products. PaTH's transport work is not counted, so MFU compares
// with a plain-attention model of the same shape.
double train_flops_per_token(const ModelConfig& m, int64_t T);

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

  // Incremental inference for one sequence with the attention decode cache (docs/spec.md).
  // prefill: forward() over the prompt tokens [T] (T >= 1; its activations are kept as forward() keeps them)
  // that also fills one decode cache per layer, with room for `capacity` >= T tokens; returns the logits
  // [vocab] of the prompt's last position. decode_step: one more token through every block (the attention by
  // path_attn_decode against the cache, everything else by the same per-token code as forward(); RoPE at the
  // token's absolute position; the PaTH conv over the last two raw w rows kept per layer); returns its logits
  // [vocab]. A returned pointer stays valid until the next prefill / decode_step. Nothing here depends on
  // task.seq_len: only `capacity` bounds the length. Throws EngineError on a token outside the vocab, a
  // decode_step without a prefill or with a full cache, or an attention error.
  const T* prefill(const int32_t* tokens, int64_t T_, int64_t capacity);
  const T* decode_step(int32_t token);
  int64_t cached_tokens() const { return dec_len_; }  // tokens in the caches (prompt + decoded)

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
  // Inference state of one layer: the attention cache (kc, vc [1, H, capacity, K] in T: f32 for float models,
  // f64 for double, as decode.h asks; gc [1, HQ, capacity] f64 with a gate; len = lengths[0]) and the raw w
  // rows [<= 2, H*K] of the last tokens, what the width-3 causal conv of the next token reads.
  struct LayerCache {
    std::vector<T> kc, vc;
    std::vector<double> gc;
    int64_t len = 0, capacity = 0;
    std::vector<T> wprev;
  };
  DecodeCache cache_view(LayerCache& c);

  StepStats forward_impl(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T_, int32_t* pred,
                         std::vector<LayerCache>* caches);
  // The per-token pieces of a block shared by forward() and decode_step(), over N rows of a.x:
  //   block_inputs: ln1 = rmsnorm(x); q, k, v; the raw w projection (wlr, wraw); beta; g.
  //   block_output: x = x_mid + Wproj swiglu(Wfc rmsnorm(x_mid)), x_mid = a.x + Wo a.o (keeps xmid, ln2, h, m).
  //   head_fwd:     logits [N, vocab] = LM head of rmsnorm(x) (ln, rstd kept).
  void block_inputs(LayerActs& a, const BlockOffsets& o, int64_t N);
  void block_output(LayerActs& a, const BlockOffsets& o, int64_t N, std::vector<T>& x);
  void head_fwd(const T* x, std::vector<T>& ln, std::vector<T>& rstd, std::vector<T>& logits, int64_t N);
  // The attention call's inputs and outputs (q, k, v, w, beta, g, o, lse of `a`) and execution settings.
  PathFwdParams attention_params(LayerActs& a, int64_t B, int64_t T_);
  // path_attn_fwd over [B, T_] rows, or path_attn_prefill into `cache` when given (B = 1).
  void attention_fwd(LayerActs& a, int64_t B, int64_t T_, LayerCache* cache = nullptr);
  void attention_decode(LayerActs& a, LayerCache& c);
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
  // Inference: per-layer caches, the tokens they hold, one token's activations and logits.
  std::vector<LayerCache> caches_;
  int64_t dec_len_ = 0;
  LayerActs step_;
  std::vector<T> step_x_, step_lnf_, step_rstdf_, step_logits_;
};

extern template class Model<float>;
extern template class Model<double>;

}  // namespace pathattn::engine
