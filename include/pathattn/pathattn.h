// pathattn/pathattn.h: umbrella header of the pathattn C++ API.
//   types.h      tensor views, dtypes, devices, Status, Backend
//   attention.h  PaTH / PaTH-FoX / plain causal attention forward and backward (PathFwdParams, PathBwdParams)
//   decode.h     prefill into a transported key cache and single-token decode steps
#pragma once

#include "pathattn/attention.h"
#include "pathattn/decode.h"
#include "pathattn/types.h"
