// pathattn/pathattn.h: umbrella header of the pathattn C++ API.
//   types.h      tensor views, dtypes, devices, Status, Backend
//   attention.h  PaTH / PaTH-FoX / plain causal attention forward and backward (PathFwdParams, PathBwdParams)
//   decode.h     prefill into a transported key cache and single-token decode steps
//   paged.h      the paged, lazily transported decode cache for serving (device-side metadata, CUDA graphs)
//   w_conv_norm.h  the layer's w preparation: short convolution, SiLU and per-head L2 norm in one op
#pragma once

#include "pathattn/attention.h"
#include "pathattn/decode.h"
#include "pathattn/paged.h"
#include "pathattn/types.h"
#include "pathattn/w_conv_norm.h"
