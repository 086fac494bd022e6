// cpu/decode.cpp: prefill and decode entry points (SPEC.md section 6). Work in progress.
#include "pathattn/decode.h"

namespace pathattn {

Status path_attn_prefill(const PathPrefillParams&) {
  return Status(Status::Code::unavailable, "path_attn_prefill: not implemented yet");
}
Status path_attn_decode(const PathDecodeParams&) {
  return Status(Status::Code::unavailable, "path_attn_decode: not implemented yet");
}

}  // namespace pathattn
