// engine/config.h: run configuration (model, task, training) with every default in one place, parsed from
// JSON with strict checking (unknown keys, wrong types and out-of-range values are errors that name the key).
// docs/engine.md documents each field; keep the two in step.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace pathattn::engine {

// Every engine failure the user can cause (bad config, bad checkpoint, bad data file) is an EngineError
// whose message says what is wrong and where.
struct EngineError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class AttnKind { path, path_fox, fox, rope, nope };
const char* attn_kind_name(AttnKind k);
AttnKind parse_attn_kind(const std::string& s);  // throws EngineError
inline bool attn_has_path(AttnKind k) { return k == AttnKind::path || k == AttnKind::path_fox; }
inline bool attn_has_gate(AttnKind k) { return k == AttnKind::path_fox || k == AttnKind::fox; }

struct ModelConfig {
  AttnKind attn = AttnKind::path;
  int vocab_size = 0;      // 0: taken from the task
  int d_model = 64;        // C
  int n_layer = 1;
  int n_head = 2;          // HQ
  int n_kv_head = 0;       // H; 0: = n_head
  int head_dim = 0;        // K = V; 0: d_model / n_head
  int mlp_hidden = 0;      // F; 0: 4 * d_model * 2 / 3 rounded up to a multiple of 8
  bool tie_embeddings = true;
  int w_rank = 32;         // PaTH w projection: hidden -> w_rank -> H*K; 0: one full hidden -> H*K projection
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  double gate_bias_init = 0.0;  // initial b_g of the forget gate (fox, path-fox)
  // Resolved sizes (after resolve()).
  int H() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int K() const { return head_dim > 0 ? head_dim : d_model / n_head; }
  int F() const { return mlp_hidden > 0 ? mlp_hidden : ((4 * d_model * 2 / 3 + 7) / 8) * 8; }
};

// One task of a mixture: its weight, its test-set name and the task keys it sets (a JSON object, kept as text
// so that the keys it does not set follow the mixture's own: see mixture_component).
struct MixtureComponent {
  double weight = 1.0;
  std::string label;      // test-set name; empty: derived from the task (mixture_label)
  std::string overrides;  // JSON object of task keys ("name" required)
};

struct TaskConfig {
  std::string name = "flipflop";  // flipflop | a5 | mqrar | bytes | niah | vartrack | phonebook | babi | mixture
  int seq_len = 0;                // 0: task default (flipflop 512, a5 20, mqrar 768, bytes 256, others 1024)
  // flipflop
  double p_train = 0.8;           // FFL(p) of the training stream
  std::string loss_on = "read";   // "read": loss on the bit after each r only; "all": every next token
  int eval_id = 1000, eval_sparse = 2000, eval_dense = 200;  // test-set sizes (sequences)
  // a5
  int eval_sequences = 1000;      // a5, mqrar, bytes: test-set size (sequences)
  int min_len = 0;                // a5: shortest training word; lengths uniform in [min_len, longest]
                                  // (0: every training word has seq_len elements)
  int curriculum_steps = 0;       // a5: the longest training word grows linearly from min_len to seq_len
                                  // over this many steps (0: seq_len from the start)
  // mqrar
  int n_back = 1;                 // N: a query asks for the N-th most recent value of its key
  int n_keys = 32, n_values = 32;
  double query_prob = 0.25;       // probability that an event is a query (when one is possible)
  // bytes
  std::vector<std::string> files;      // text files, concatenated in order
  std::vector<std::string> val_files;  // validation text files; empty: the last val_fraction of `files`
  double val_fraction = 0.1;           // last fraction of the bytes is the validation split (no val_files)
  // long-context text tasks (niah, vartrack, phonebook, babi; docs/tasks.md)
  std::string haystack = "filler";      // niah, vartrack, babi: "filler" (repeated noise) or "text" (prose)
  std::string niah_variant = "single";  // single | multikey | multivalue | multiquery
  int n_needles = 0;                    // niah: needles (0: 1 for single, 4 for the others)
  std::vector<double> depths;           // niah: depth of needle i is depths[i % size] (empty: uniform slots)
  int n_chains = 2, n_hops = 4;         // vartrack: chains (the first is asked) and hops per chain
  int n_entries = 0;                    // phonebook: entries (0: as many as fit in seq_len)
  int babi_task = 1;                    // babi: 1, 2, 3 supporting facts
  int n_facts = 12;                     // babi: story sentences
  uint64_t data_seed = 1234;       // seeds the test sets (independent of the training seed)
  // mixture: each training row comes from one component, drawn with probability weight / sum of weights
  std::vector<MixtureComponent> mixture;
};

struct TrainConfig {
  int steps = 1000;
  int batch_size = 16;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;    // cosine decays to lr * min_lr_ratio at the last step
  int warmup_steps = 50;
  double weight_decay = 0.1;    // decoupled (AdamW), on matrices and embeddings only
  double beta1 = 0.9, beta2 = 0.95, adam_eps = 1e-8;
  double grad_clip = 1.0;       // global L2 norm; 0: off
  uint64_t seed = 1;            // parameter init and the training data stream
  std::string dtype = "f32";    // f32 | f64
  std::string backend = "cpu";  // attention backend of the cpu device: cpu | oracle
  std::string device = "cpu";   // where the whole model trains: cpu | cuda (engine/cuda/, PATHATTN_CUDA=ON builds)
  // cuda GEMMs: "fp32" (CUDA cores, tight CPU parity), "tf32" or "bf16" (tensor cores: inputs rounded to 10 / 7
  // mantissa bits inside cuBLAS, fp32 accumulation, fp32 storage and master weights).
  std::string matmul = "fp32";
  int threads = 0;              // attention threads; 0: OpenMP default
  int eval_every = 0;           // 0: only at the end
  int checkpoint_every = 0;     // 0: only at the end
  int log_every = 10;
};

struct RunConfig {
  ModelConfig model;
  TaskConfig task;
  TrainConfig train;
};

// Parses JSON text like nlohmann::json::parse, but a key given twice in one object is an error (the parser
// would keep the last silently): throws EngineError "duplicate key \"a.b\"" naming the key's path; syntax
// errors throw nlohmann::json::parse_error as json::parse does.
nlohmann::json parse_json_unique(const std::string& text);

// The overlay of the command line's "--set section.key=value" overrides: value is parsed as JSON, or taken as
// a string when it is not JSON. Throws EngineError on a malformed override or a key given twice.
nlohmann::json overlay_from_sets(const std::vector<std::string>& sets);

// Parses a config; keys absent from `j` keep the defaults above. Throws EngineError naming the offending
// key ("train.lr: expected a number > 0, got \"x\"") on unknown keys, wrong types or invalid values.
RunConfig parse_config(const nlohmann::json& j);
RunConfig parse_config_text(const std::string& text, const std::string& origin);  // origin: for messages
RunConfig load_config_file(const std::string& path);
// Applies the keys of `overlay` on top of `base` (same strictness) and returns the result.
RunConfig overlay_config(const RunConfig& base, const nlohmann::json& overlay);
// The full config, every field written (what checkpoints and run directories store).
nlohmann::json config_to_json(const RunConfig& c);
// Component i of a mixture: the mixture's task keys (its mixture list emptied) with the component's own on top.
// Throws EngineError naming "task.mixture[i]" on a bad index.
TaskConfig mixture_component(const TaskConfig& mix, size_t i);
// The test-set name of component i: its label, else niah_<variant>, babi_qa<n>, or the task name.
std::string mixture_label(const TaskConfig& mix, size_t i);
// Checks cross-field consistency once the task's vocab is known (head dims, GQA, sizes). Throws EngineError.
void validate_config(const RunConfig& c);

}  // namespace pathattn::engine
