// cuda/profile.h: per-kernel timing, a diagnostic that chooses no path: with PATHATTN_CUDA_PROFILE set in the
// environment (docs/design.md, user-facing settings), events between launches printed to stderr after a
// synchronize. Off: no events, no synchronization.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

namespace pathattn::cuda {

// Read at every call: a program may set and clear it between calls.
inline bool profile_enabled() { return std::getenv("PATHATTN_CUDA_PROFILE") != nullptr; }

class Profile {
 public:
  Profile(cudaStream_t s, const char* what) : s_(s), what_(what), on_(profile_enabled()) { mark("start"); }
  void mark(const char* name) {
    if (!on_) return;
    cudaEvent_t e;
    cudaEventCreate(&e);
    cudaEventRecord(e, s_);
    ev_.push_back({name, e});
  }
  ~Profile() {
    if (!on_ || ev_.size() < 2) return;
    cudaEventSynchronize(ev_.back().second);
    std::fprintf(stderr, "[profile] %s:", what_);
    for (size_t i = 1; i < ev_.size(); ++i) {
      float ms = 0;
      cudaEventElapsedTime(&ms, ev_[i - 1].second, ev_[i].second);
      std::fprintf(stderr, " %s %.3f ms;", ev_[i].first, ms);
    }
    std::fprintf(stderr, "\n");
    for (auto& e : ev_) cudaEventDestroy(e.second);
  }

 private:
  cudaStream_t s_;
  const char* what_;
  bool on_;
  std::vector<std::pair<const char*, cudaEvent_t>> ev_;
};

}  // namespace pathattn::cuda
