// cuda/device/probe.cuh: phase probes (dev/cuda/phase_probe.cu), compiled in only with -DPATHATTN_PHASE_PROBE.
#pragma once

#include <cstdint>

namespace pathattn::cuda {

// Phase probes (dev/cuda/phase_probe.cu), compiled in only with -DPATHATTN_PHASE_PROBE: thread 0 of each of
// the first kProbeCtas CTAs (blockIdx.x fastest) stamps clock64() at PA_PROBE(slot), into a table per
// translation unit that PA_PROBE_TABLE(name) exposes to the host as probe_table_name(). Callers place probes
// after a __syncthreads, so a stamp marks the end of a phase for the whole CTA.
#ifdef PATHATTN_PHASE_PROBE
inline constexpr int kProbeCtas = 2048, kProbeSlots = 24;
static __device__ long long g_probe[kProbeCtas][kProbeSlots];
#define PA_PROBE(slot)                                                                   \
  do {                                                                                   \
    const int cta_ = blockIdx.x + gridDim.x * blockIdx.y;                                \
    if (threadIdx.x == 0 && cta_ < kProbeCtas) g_probe[cta_][slot] = clock64();          \
  } while (0)
#define PA_PROBE_TABLE(name) \
  cudaError_t probe_table_##name(long long* host) { return cudaMemcpyFromSymbol(host, g_probe, sizeof(g_probe)); }
#else
#define PA_PROBE(slot) \
  do {                 \
  } while (0)
#define PA_PROBE_TABLE(name)
#endif

}  // namespace pathattn::cuda
