// cuda/device/common.cuh: the device helpers every PaTH kernel uses, one header per topic. No torch or
// framework headers: kernels see raw pointers only.
#pragma once

#include "cuda/device/copies.cuh"
#include "cuda/device/finite.cuh"
#include "cuda/device/inverse.cuh"
#include "cuda/device/launch.cuh"
#include "cuda/device/mma.cuh"
#include "cuda/device/probe.cuh"
#include "cuda/device/scale.cuh"
#include "cuda/device/softmax.cuh"
#include "cuda/device/tiles.cuh"
#include "cuda/device/types.cuh"
