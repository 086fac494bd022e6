#!/usr/bin/env bash
# dev/cuda/build_diag.sh: diagnostic builds of the far kernels (dev/cuda/patches/far_diag.patch), one C ABI
# library per setting, for taking a kernel's time apart on a GPU machine: each setting skips parts of a kernel
# (its results are wrong; only the [profile] split's kernel times mean anything). A setting is MACRO=VALUE
# (PA_FAR_DIAG for fwd_far, PA_QF_DIAG for bwd_q_far, PA_KF_DIAG for bwd_k_far; the bits are listed in the
# patch), several joined by commas. The head's own build goes to OUT_DIR/head/, each setting's to
# OUT_DIR/<setting with '=' and ',' as '_'>/. The tree must have no uncommitted changes to the patched files.
#   dev/cuda/build_diag.sh build-cuda diag PA_FAR_DIAG=4 PA_QF_DIAG=1 PA_QF_DIAG=2 PA_KF_DIAG=1
# Then on the GPU machine, per library: PATHATTN_CUDA_PROFILE=1 with dev/cuda/shape.py --ws-limit-mib -1 (one
# slice: the kernels' own times), comparing each kernel's line against the head's.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 BUILD_DIR OUT_DIR MACRO=VALUE[,MACRO=VALUE] ..." >&2
  exit 2
fi
build=$1 out=$2
shift 2
cd "$(dirname "$0")/../.."
patch=dev/cuda/patches/far_diag.patch
files=(src/cuda/fwd_far.cu src/cuda/bwd_q_far.cu src/cuda/bwd_k_far.cu)
collect() {  # $1: variant name
  cmake --build "$build" -j "$(nproc)" --target pathattn_capi
  mkdir -p "$out/$1"
  cp "$build/libpathattn_capi.so" "$out/$1/"
  echo "built $out/$1"
}
set_macros() {  # $1: MACRO=VALUE[,MACRO=VALUE]
  local kv
  for kv in ${1//,/ }; do
    sed -i "s/^#define ${kv%%=*} .*/#define ${kv%%=*} ${kv#*=}/" "${files[@]}"
  done
}
collect head
git apply "$patch"
trap 'set_macros PA_FAR_DIAG=0,PA_QF_DIAG=0,PA_KF_DIAG=0; git apply -R "$patch"' EXIT
for setting in "$@"; do
  set_macros "$setting"
  name=${setting//=/_}
  collect "${name//,/_}"
  set_macros PA_FAR_DIAG=0,PA_QF_DIAG=0,PA_KF_DIAG=0
done
set_macros PA_FAR_DIAG=0,PA_QF_DIAG=0,PA_KF_DIAG=0
git apply -R "$patch"
trap - EXIT
cmake --build "$build" -j "$(nproc)" --target pathattn_capi > /dev/null  # back to the head's build
