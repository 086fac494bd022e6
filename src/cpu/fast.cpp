// cpu/fast.cpp: the blockwise CPU fast path. Work in progress.
#include "cpu/cpu_backend.h"

namespace pathattn::cpu {
int default_chunk_size(int64_t) { return 64; }
Status fast_fwd(const PathFwdParams&, const core::Problem&) {
  return Status(Status::Code::unavailable, "cpu: fast path not implemented yet");
}
Status fast_bwd(const PathBwdParams&, const core::Problem&) {
  return Status(Status::Code::unavailable, "cpu: fast path not implemented yet");
}
}  // namespace pathattn::cpu
