// tests/cuda/gpu_skip.h: the CUDA backend's GPU tests skip (exit code 0, with a message) where no CUDA device is
// present, so CPU-only CI passes.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace pathattn::test {

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace pathattn::test

#define REQUIRE_GPU() \
  if (!::pathattn::test::have_gpu()) GTEST_SKIP() << "no CUDA device: CUDA backend tests skipped"
