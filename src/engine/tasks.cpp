// engine/tasks.cpp: generators of the engine's tasks (engine/tasks.h; formats in docs/tasks.md).
#include "engine/tasks.h"

#include "engine/longctx.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

namespace pathattn::engine {

std::vector<int32_t> Task::encode(const std::string& text) const {
  std::vector<int32_t> out;
  std::istringstream ss(text);
  std::string w;
  while (ss >> w) {
    bool found = false;
    for (int32_t t = 0; t < vocab_size(); ++t) {
      std::string s = token_str(t);
      while (!s.empty() && s.back() == ' ') s.pop_back();
      if (s == w) {
        out.push_back(t);
        found = true;
        break;
      }
    }
    if (!found) throw EngineError("prompt: \"" + w + "\" is not a token of task " + name());
  }
  return out;
}

void Task::train_batch(uint64_t seed, int64_t step, int64_t B, Batch* out) const {
  const int64_t T = model_len();
  out->B = B;
  out->T = T;
  out->tokens.assign(B * T, 0);
  out->targets.assign(B * T, -1);
  for (int64_t b = 0; b < B; ++b) {
    Rng rng(mix_seed(seed, uint64_t(step), uint64_t(b)));
    train_example(rng, step, &out->tokens[b * T], &out->targets[b * T]);
  }
}

void Task::eval_batch(int set, int64_t first, int64_t count, Batch* out) const {
  const int64_t T = model_len();
  out->B = count;
  out->T = T;
  out->tokens.assign(count * T, 0);
  out->targets.assign(count * T, -1);
  for (int64_t b = 0; b < count; ++b) eval_example(set, first + b, &out->tokens[b * T], &out->targets[b * T]);
}

int default_seq_len(const std::string& task) {
  if (task == "flipflop") return 512;
  if (task == "a5") return 20;
  if (task == "mqrar") return 768;
  if (is_text_task(task)) return 1024;
  return 256;
}

namespace {

int seq_len_of(const TaskConfig& c) { return c.seq_len > 0 ? c.seq_len : default_seq_len(c.name); }

// ---------------------------------------------------------------------------------------------------
// Flip-flop: tokens w=0 r=1 i=2 '0'=3 '1'=4. A sequence of L tokens is L/2 (instruction, bit) pairs; the first
// instruction is w, the last is r, the others i / w / r with probabilities p, (1-p)/2, (1-p)/2. The bit after
// w and i is uniform; the bit after r is the bit of the most recent w. The model reads tokens 0..L-2 and
// predicts each next token; the scored positions are the r instructions (target: the following bit).
class FlipFlop final : public Task {
 public:
  FlipFlop(const TaskConfig& c) : c_(c), L_(seq_len_of(c)) {
    if (L_ < 4 || L_ % 2 != 0) throw EngineError("task.seq_len: flipflop needs an even length >= 4");
  }
  std::string name() const override { return "flipflop"; }
  int vocab_size() const override { return 5; }
  int64_t model_len() const override { return L_ - 1; }
  bool reports_error() const override { return true; }
  std::string token_str(int32_t t) const override {
    static const char* s[] = {"w ", "r ", "i ", "0 ", "1 "};
    return (t >= 0 && t < 5) ? s[t] : "? ";
  }
  void train_example(Rng& rng, int64_t, int32_t* tok, int32_t* tgt) const override {
    generate(rng, c_.p_train, c_.loss_on == "all", tok, tgt);
  }
  std::vector<EvalSet> eval_sets() const override {
    return {{"id", c_.eval_id}, {"sparse", c_.eval_sparse}, {"dense", c_.eval_dense}};
  }
  void eval_example(int set, int64_t index, int32_t* tok, int32_t* tgt) const override {
    static const double p[] = {0.8, 0.98, 0.1};
    Rng rng(mix_seed(c_.data_seed, 100 + uint64_t(set), uint64_t(index)));
    generate(rng, p[set], false, tok, tgt);
  }
  // Writes tokens [L-1] and targets [L-1] of one FFL(p) sequence.
  void generate(Rng& rng, double p, bool all, int32_t* tok, int32_t* tgt) const {
    std::vector<int32_t> s(L_);
    int32_t mem = 3;
    const int64_t pairs = L_ / 2;
    for (int64_t j = 0; j < pairs; ++j) {
      int32_t ins;
      if (j == 0) ins = 0;
      else if (j == pairs - 1) ins = 1;
      else {
        const double u = rng.uniform();
        ins = u < p ? 2 : (u < p + (1.0 - p) / 2 ? 0 : 1);
      }
      int32_t bit = ins == 1 ? mem : int32_t(3 + rng.below(2));
      if (ins == 0) mem = bit;
      s[2 * j] = ins;
      s[2 * j + 1] = bit;
    }
    for (int64_t t = 0; t + 1 < L_; ++t) {
      tok[t] = s[t];
      tgt[t] = (all || s[t] == 1) ? s[t + 1] : -1;
    }
  }

 private:
  TaskConfig c_;
  int64_t L_;
};

// ---------------------------------------------------------------------------------------------------
// A5 word problem: tokens are the 60 group elements (uniform); the target at position t is the index of the
// running product x_0 x_1 ... x_t. Every position is scored.
class A5Task final : public Task {
 public:
  A5Task(const TaskConfig& c) : c_(c), L_(seq_len_of(c)), min_len_(c.min_len > 0 ? c.min_len : L_) {
    if (min_len_ > L_)
      throw EngineError("task.min_len: expected <= task.seq_len (" + std::to_string(L_) + "), got " +
                        std::to_string(c.min_len));
    if (c.curriculum_steps > 0 && c.min_len == 0)
      throw EngineError("task.curriculum_steps: needs task.min_len (the length the curriculum starts from)");
  }
  std::string name() const override { return "a5"; }
  int vocab_size() const override { return 60; }
  int64_t model_len() const override { return L_; }
  // A word of L_ elements of which the first `len` are scored, len uniform in [min_len, longest(step)]:
  // with a causal model the scored prefix is exactly a word of that length.
  void train_example(Rng& rng, int64_t step, int32_t* tok, int32_t* tgt) const override {
    generate(rng, tok, tgt);
    const int64_t hi = longest(step);
    if (hi == min_len_ && hi == L_) return;  // fixed length: no extra draw (runs stay as they were)
    const int64_t len = min_len_ + int64_t(rng.below(uint64_t(hi - min_len_ + 1)));
    for (int64_t t = len; t < L_; ++t) tgt[t] = -1;
  }
  // The longest training word at `step`: grows linearly from min_len to seq_len over curriculum_steps.
  int64_t longest(int64_t step) const {
    if (c_.curriculum_steps <= 0 || step >= c_.curriculum_steps) return L_;
    return min_len_ + (L_ - min_len_) * step / c_.curriculum_steps;
  }
  // "test": every position scored (token accuracy, the "solved" criterion); "last": the same words, only the
  // final position scored (accuracy of the whole product x_0 ... x_{L-1}).
  std::vector<EvalSet> eval_sets() const override {
    return {{"test", c_.eval_sequences}, {"last", c_.eval_sequences}};
  }
  bool reports_by_position(int set) const override { return set == 0; }
  void eval_example(int set, int64_t index, int32_t* tok, int32_t* tgt) const override {
    Rng rng(mix_seed(c_.data_seed, 200, uint64_t(index)));
    generate(rng, tok, tgt);
    if (set == 1)
      for (int64_t t = 0; t + 1 < L_; ++t) tgt[t] = -1;
  }
  void generate(Rng& rng, int32_t* tok, int32_t* tgt) const {
    int p = 0;
    for (int64_t t = 0; t < L_; ++t) {
      const int x = int(rng.below(60));
      p = g_.mul[p * 60 + x];
      tok[t] = x;
      tgt[t] = p;
    }
  }

 private:
  TaskConfig c_;
  int64_t L_, min_len_;
  A5Group g_;
};

// ---------------------------------------------------------------------------------------------------
// MQRAR-N: keys 0..nk-1, values nk..nk+nv-1, query marker '?' = nk+nv. A stream of events: an assignment
// "k v" (uniform key and value), or, with probability query_prob when some key has >= N assignments, a query
// "? k a" for a uniform such key, whose answer a is the N-th most recent value assigned to k. The stream is
// cut to L tokens; the model reads tokens 0..L-2 and is scored on predicting each answer (from the key).
class Mqrar final : public Task {
 public:
  Mqrar(const TaskConfig& c) : c_(c), L_(seq_len_of(c)) {
    if (L_ < 8) throw EngineError("task.seq_len: mqrar needs a length >= 8");
  }
  std::string name() const override { return "mqrar"; }
  int vocab_size() const override { return c_.n_keys + c_.n_values + 1; }
  int64_t model_len() const override { return L_ - 1; }
  std::string token_str(int32_t t) const override {
    if (t < c_.n_keys) return "k" + std::to_string(t) + " ";
    if (t < c_.n_keys + c_.n_values) return "v" + std::to_string(t - c_.n_keys) + " ";
    return "? ";
  }
  void train_example(Rng& rng, int64_t, int32_t* tok, int32_t* tgt) const override { generate(rng, tok, tgt); }
  std::vector<EvalSet> eval_sets() const override { return {{"test", c_.eval_sequences}}; }
  void eval_example(int set, int64_t index, int32_t* tok, int32_t* tgt) const override {
    Rng rng(mix_seed(c_.data_seed, 300 + uint64_t(set), uint64_t(index)));
    generate(rng, tok, tgt);
  }
  void generate(Rng& rng, int32_t* tok, int32_t* tgt) const {
    const int nk = c_.n_keys, N = c_.n_back;
    std::vector<std::vector<int32_t>> hist(nk);
    std::vector<int32_t> s, answer;  // answer[t] = 1 where s[t] is a query answer
    std::vector<int> ready;          // keys with >= N assignments
    while (int64_t(s.size()) < L_) {
      if (!ready.empty() && rng.uniform() < c_.query_prob) {
        const int k = ready[rng.below(ready.size())];
        const auto& h = hist[k];
        s.insert(s.end(), {int32_t(nk + c_.n_values), int32_t(k), h[h.size() - N]});
        answer.insert(answer.end(), {0, 0, 1});
      } else {
        const int k = int(rng.below(nk));
        const int32_t v = int32_t(nk + rng.below(c_.n_values));
        hist[k].push_back(v);
        if (int(hist[k].size()) == N) ready.push_back(k);
        s.insert(s.end(), {int32_t(k), v});
        answer.insert(answer.end(), {0, 0});
      }
    }
    for (int64_t t = 0; t + 1 < L_; ++t) {
      tok[t] = s[t];
      tgt[t] = answer[t + 1] ? s[t + 1] : -1;
    }
  }

 private:
  TaskConfig c_;
  int64_t L_;
};

// ---------------------------------------------------------------------------------------------------
// Bytes: byte-level LM over the concatenation of text files. The validation split is the concatenation of
// val_files when given, else the last val_fraction of the bytes. Training windows of L bytes start uniformly
// in the training split; test window i starts at a position drawn from (data_seed, i) in the validation
// split. Every next byte is scored.
class Bytes final : public Task {
 public:
  Bytes(const TaskConfig& c) : c_(c), L_(seq_len_of(c)) {
    if (c.files.empty()) throw EngineError("task.files: the bytes task needs at least one text file");
    // One allocation for all files (growing the vector file by file would double a gigabyte corpus).
    std::error_code ec;
    uintmax_t total = 0;
    for (const auto* list : {&c.files, &c.val_files})
      for (const std::string& f : *list) {
        const uintmax_t n = std::filesystem::file_size(f, ec);
        if (!ec) total += n;
      }
    data_.reserve(size_t(total));
    for (const std::string& f : c.files) append_file("task.files", f);
    if (c.val_files.empty()) {
      n_train_ = int64_t(double(data_.size()) * (1.0 - c.val_fraction));
    } else {
      n_train_ = int64_t(data_.size());
      for (const std::string& f : c.val_files) append_file("task.val_files", f);
    }
    const int64_t n_val = int64_t(data_.size()) - n_train_;
    if (L_ < 2) throw EngineError("task.seq_len: bytes needs a length >= 2");
    if (n_train_ < L_ || n_val < L_)
      throw EngineError("task.files: " + std::to_string(data_.size()) + " bytes give a training split of " +
                        std::to_string(n_train_) + " and a validation split of " + std::to_string(n_val) +
                        " bytes; each must hold at least task.seq_len = " + std::to_string(L_) + " bytes");
  }
  std::string name() const override { return "bytes"; }
  int vocab_size() const override { return 256; }
  int64_t model_len() const override { return L_ - 1; }
  std::string token_str(int32_t t) const override { return std::string(1, char(t)); }
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> out;
    for (unsigned char ch : text) out.push_back(ch);
    return out;
  }
  void train_example(Rng& rng, int64_t, int32_t* tok, int32_t* tgt) const override {
    window(uint64_t(rng.below(uint64_t(n_train_ - L_ + 1))), tok, tgt);
  }
  std::vector<EvalSet> eval_sets() const override { return {{"val", c_.eval_sequences}}; }
  void eval_example(int, int64_t index, int32_t* tok, int32_t* tgt) const override {
    Rng rng(mix_seed(c_.data_seed, 400, uint64_t(index)));
    const int64_t n_val = int64_t(data_.size()) - n_train_;
    window(uint64_t(n_train_) + rng.below(uint64_t(n_val - L_ + 1)), tok, tgt);
  }
  // Appends the bytes of file `f` (read straight into data_: corpora of a gigabyte are read once, uncopied).
  void append_file(const char* key, const std::string& f) {
    std::ifstream in(f, std::ios::binary | std::ios::ate);
    if (!in) throw EngineError(std::string(key) + ": cannot open data file \"" + f + "\"");
    const std::streamoff n = in.tellg();
    if (n <= 0) throw EngineError(std::string(key) + ": data file \"" + f + "\" is empty");
    const size_t at = data_.size();
    data_.resize(at + size_t(n));
    in.seekg(0);
    if (!in.read(reinterpret_cast<char*>(data_.data() + at), n))
      throw EngineError(std::string(key) + ": cannot read data file \"" + f + "\"");
  }
  void window(uint64_t start, int32_t* tok, int32_t* tgt) const {
    for (int64_t t = 0; t + 1 < L_; ++t) {
      tok[t] = data_[start + t];
      tgt[t] = data_[start + t + 1];
    }
  }

 private:
  TaskConfig c_;
  int64_t L_;
  std::vector<unsigned char> data_;
  int64_t n_train_ = 0;
};

// ---------------------------------------------------------------------------------------------------
// Mixture: every training row comes from one component task, chosen by the row's first draw (u uniform in
// [0, 1), the first component whose cumulative weight exceeds u * total); the component then draws the row
// from the same stream, so a row stays a pure function of (seed, step, row). Test sets: each component's,
// named by mixture_label (with "/<set>" when a component has several), examples exactly the component's own.
class Mixture final : public Task {
 public:
  explicit Mixture(const TaskConfig& c) {
    if (c.mixture.empty()) throw EngineError("task.mixture: a mixture needs at least one component");
    if (c.seq_len <= 0)
      throw EngineError("task.seq_len: a mixture needs an explicit length (its components inherit it), got " +
                        std::to_string(c.seq_len));
    double total = 0;
    for (size_t i = 0; i < c.mixture.size(); ++i) {
      const TaskConfig ci = mixture_component(c, i);
      const std::string where = "task.mixture[" + std::to_string(i) + "]";
      try {
        parts_.push_back(make_task(ci));
      } catch (const EngineError& e) {
        throw EngineError(where + " (" + mixture_label(c, i) + "): " + e.what());
      }
      if (parts_.back()->model_len() != parts_[0]->model_len())
        throw EngineError(where + ".seq_len: the rows of a batch share one length; this component's model length is " +
                          std::to_string(parts_.back()->model_len()) + ", task.mixture[0]'s " +
                          std::to_string(parts_[0]->model_len()));
      total += c.mixture[i].weight;
      cum_.push_back(total);
      const std::string label = mixture_label(c, i);
      const auto sets = parts_.back()->eval_sets();
      for (size_t k = 0; k < sets.size(); ++k) {
        EvalSet e = sets[k];
        e.name = sets.size() == 1 ? label : label + "/" + sets[k].name;
        for (const EvalSet& prev : sets_)
          if (prev.name == e.name)
            throw EngineError(where + ".label: the test set \"" + e.name + "\" is named twice; give the " +
                              "components distinct labels");
        sets_.push_back(e);
        where_.push_back({i, int(k)});
      }
    }
    if (!(total > 0)) throw EngineError("task.mixture: the weights sum to 0; give some component a weight > 0");
  }
  std::string name() const override { return "mixture"; }
  int vocab_size() const override {
    int v = 0;
    for (const auto& p : parts_) v = std::max(v, p->vocab_size());
    return v;
  }
  int64_t model_len() const override { return parts_[0]->model_len(); }
  void train_example(Rng& rng, int64_t step, int32_t* tok, int32_t* tgt) const override {
    const double u = rng.uniform() * cum_.back();
    size_t k = 0;
    while (k + 1 < cum_.size() && !(u < cum_[k])) ++k;
    parts_[k]->train_example(rng, step, tok, tgt);
  }
  std::vector<EvalSet> eval_sets() const override { return sets_; }
  void eval_example(int set, int64_t index, int32_t* tok, int32_t* tgt) const override {
    const auto [k, local] = where_[size_t(set)];
    parts_[k]->eval_example(local, index, tok, tgt);
  }
  bool reports_by_position(int set) const override {
    const auto [k, local] = where_[size_t(set)];
    return parts_[k]->reports_by_position(local);
  }
  bool reports_exact_match() const override {
    for (const auto& p : parts_)
      if (!p->reports_exact_match()) return false;
    return true;
  }
  std::string token_str(int32_t t) const override { return parts_[0]->token_str(t); }
  std::vector<int32_t> encode(const std::string& text) const override { return parts_[0]->encode(text); }

 private:
  std::vector<std::unique_ptr<Task>> parts_;
  std::vector<double> cum_;                    // cumulative weights
  std::vector<EvalSet> sets_;
  std::vector<std::pair<size_t, int>> where_;  // test set -> (component, its set)
};

}  // namespace

A5Group::A5Group() {
  std::vector<int> p = {0, 1, 2, 3, 4};
  do {
    int inv = 0;
    for (int i = 0; i < 5; ++i)
      for (int j = i + 1; j < 5; ++j) inv += p[i] > p[j];
    if (inv % 2 == 0) perms.push_back(p);
  } while (std::next_permutation(p.begin(), p.end()));
  const int n = int(perms.size());
  mul.assign(n * n, -1);
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) {
      std::vector<int> c(5);
      for (int i = 0; i < 5; ++i) c[i] = perms[a][perms[b][i]];
      mul[a * n + b] = int(std::find(perms.begin(), perms.end(), c) - perms.begin());
    }
}

std::unique_ptr<Task> make_task(const TaskConfig& c) {
  if (c.name == "flipflop") return std::make_unique<FlipFlop>(c);
  if (c.name == "a5") return std::make_unique<A5Task>(c);
  if (c.name == "mqrar") {
    if (c.n_keys < 1 || c.n_values < 2) throw EngineError("task: mqrar needs n_keys >= 1 and n_values >= 2");
    return std::make_unique<Mqrar>(c);
  }
  if (c.name == "bytes") return std::make_unique<Bytes>(c);
  if (is_text_task(c.name)) return make_text_task(c);
  if (c.name == "mixture") return std::make_unique<Mixture>(c);
  throw EngineError("task.name: unknown task \"" + c.name + "\"");
}

}  // namespace pathattn::engine
