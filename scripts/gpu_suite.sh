#!/usr/bin/env bash
# scripts/gpu_suite.sh: everything the CUDA backend needs checked on a GPU machine, in one go: build (unless
# a prebuilt build directory is given), the GPU tests against the fp64 oracle (among them non-finite input
# confinement and a 32k-step decode soak), compute-sanitizer memcheck, racecheck and initcheck on small
# cases, and the training-op benchmark (bench/gpu_bench.py, docs/benchmarks.md) writing
# results/bench/gpu_h200.md.
# Then the Python package's GPU tests (python/tests/test_gpu.py: parity with flash-linear-attention, CUDA
# opcheck / torch.compile, prefill and decode on the GPU) with a pathattn wheel built with the CUDA backend for
# this machine's Python: one found in .whl/ (or WHEELS), else built here (sm_90a) when WHEELS/build holds the
# build backend's wheels (scikit-build-core, nanobind, scipy-openblas32 and their dependencies; a GPU machine
# without a package index gets them that way: `pip download -d .whl/build scikit-build-core==1.1.2
# nanobind==3.1.0 scipy-openblas32==0.3.34.481.3` (pyproject.toml's pins), plus cmake and ninja where the
# machine has none). The wheel
# is installed with the fla wheels found there into a private target directory. A wheel built beforehand on another
# machine with the GPU machine's Python version (`pip wheel . -Ccmake.define.PATHATTN_CUDA=ON
# "-Ccmake.define.PATHATTN_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a"`) and put in .whl/ saves that build;
# remove it once the tree changes (a wheel found there is used as it is).
# Usage: scripts/gpu_suite.sh [--build DIR] [--quick | --extra-only] [--profile] [--Ts 1024,4096] [--no-bench] [--no-tests] [--no-python] [--probe] [--playgrounds] [--sm80 DIR] [--python-only] [--layers] [--out DIR]
#   --layers: after the Python tests, with the same wheel: the whole-layer benchmark (bench/layer_bench.py), the
#   decode benchmark (bench/decode_bench.py) and, where DIR has the `pathattn` program (a CUDA build with the
#   apps), the engine against PyTorch with the engine's kernels under ncu (bench/engine_bench.py --kernels); their
#   tables go to the output folder.
#   --sm80 DIR: also the Ampere code path on this GPU: test_cuda of a build with compute_80 PTX only
#   (-DPATHATTN_CUDA_GENCODE="-gencode=arch=compute_80,code=compute_80", prebuilt in DIR or built there), which
#   the driver compiles for the device at load, with the code that __CUDA_ARCH__ = 800 selects (no far kernels).
#   The GPU tests include the engine's (tests/cuda/test_engine_cuda) when DIR has them; --probe also runs the
#   chunk kernels' phase probe (dev/cuda/phase_probe.cu); --playgrounds the playgrounds (dev/cuda/far_tiling.cu,
#   far_bwd.cu: each version alone; swizzle_tiles.cu, inverse.cu, chain_floor.cu: once; self-checking; prebuilt
#   in DIR or built by dev/cuda/Makefile).
#   --python-only: only the Python package's GPU tests (no build directory, no C++ tests, no benchmark);
#   --no-python: the C++ tests without the Python package's (a machine that limits one command's time can run
#   the two parts as two commands: the wheel's build and its tests take minutes).
#   --quick: MHA rows only (results/bench/gpu_h200.md); --extra-only: the GQA and PaTH-FoX rows only, into
#   results/bench/gpu_h200_extra.md (the full run writes every row into gpu_h200.md).
#   A prebuilt DIR may carry libs.tar.xz (shared libraries the test binary needs, e.g. OpenBLAS) and the
#   fla-core wheel may sit in .whl/ (installed into a private target directory, nothing system-wide), with the
#   flash-linear-attention wheel beside it for the Python layer test (fla.layers; skipped without it).
#   The model tests (pathattn.models, and against fla.models) also need transformers: the wheels of it and of
#   the dependencies the GPU machine lacks, for its Python, in .whl/hf/ (e.g. `pip download -d .whl/hf
#   "transformers>=5.6,<6" --python-version X.Y --only-binary=:all:`, less numpy and torch); skipped without.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=build-cuda QUICK="" TABLE=results/bench/gpu_h200.md BENCH=1 TESTS=1 PROBE=0 PLAY=0 OUTDIR=${OUT:-gpu_out} TS=1024,2048,4096,8192,16384
SM80="" PYONLY=0 PY=1 LAYERS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift ;;
    --quick) QUICK="$QUICK --quick" ;;
    --extra-only) QUICK="$QUICK --extra-only"; TABLE=results/bench/gpu_h200_extra.md ;;
    --profile) QUICK="$QUICK --profile" ;;
    --Ts) TS=$2; shift ;;
    --no-bench) BENCH=0 ;;
    --no-tests) TESTS=0 ;;
    --probe) PROBE=1 ;;
    --playgrounds) PLAY=1 ;;
    --sm80) SM80=$2; shift ;;
    --python-only) PYONLY=1; BENCH=0 ;;
    --no-python) PY=0 ;;
    --layers) LAYERS=1 ;;
    --out) OUTDIR=$2; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUTDIR"
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUTDIR/gpu.txt"

if [ -f "$BUILD/libs.tar.xz" ]; then
  mkdir -p /tmp/pathattn_libs && tar xJf "$BUILD/libs.tar.xz" -C /tmp/pathattn_libs
  export LD_LIBRARY_PATH=/tmp/pathattn_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# configure_build DIR GENCODE TARGET...: a CUDA build without the apps, for the given architectures.
configure_build() {
  local dir=$1 gencode=$2
  shift 2
  cmake -S . -B "$dir" -DPATHATTN_CUDA=ON -DPATHATTN_BUILD_APPS=OFF -DCMAKE_BUILD_TYPE=Release \
    -DPATHATTN_CUDA_GENCODE="$gencode" > /dev/null && cmake --build "$dir" -j "$(nproc)" --target "$@"
}
if [ "$PYONLY" = 0 ] && [ ! -x "$BUILD/tests/cuda/test_cuda" ] && [ ! -x "$BUILD/test_cuda" ]; then
  configure_build "$BUILD" "-gencode=arch=compute_90a,code=sm_90a" test_cuda test_cuda_paged pathattn_capi || exit 1
fi
TEST=$BUILD/tests/cuda/test_cuda
[ -x "$TEST" ] || TEST=$BUILD/test_cuda
CAPI=$BUILD/libpathattn_capi.so

if [ "$TESTS" = 1 ] && [ "$PYONLY" = 0 ]; then
  echo "== GPU tests"
  "$TEST" --gtest_color=no 2>&1 | tee "$OUTDIR/test_cuda.log" | grep -E "^\[(acc|race|long|soak)\]|OK \]|FAILED|PASSED|SKIPPED|Failure|error|Expected|Which is|actual" || true
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  echo "== paged decode cache"
  "$BUILD/tests/cuda/test_cuda_paged" --gtest_color=no 2>&1 | tee "$OUTDIR/test_cuda_paged.log" | grep -E "^\[paged|OK \]|FAILED|PASSED|SKIPPED|Failure|Expected|Which is|actual" || true
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  if command -v compute-sanitizer > /dev/null; then
    echo "== compute-sanitizer memcheck / racecheck (small cases)"
    compute-sanitizer --tool memcheck --error-exitcode 9 "$TEST" --gtest_filter='CudaBackend.Varlen:CudaBackend.PlainAttentionWithoutW' \
      > "$OUTDIR/memcheck.log" 2>&1; echo "memcheck rc=$?" | tee -a "$OUTDIR/memcheck.log"
    tail -3 "$OUTDIR/memcheck.log"
    # The rare paths and the smaller ops: chunk_prep's repair launch (non-finite inputs), the padded head dims,
    # the w preparation op.
    compute-sanitizer --tool memcheck --error-exitcode 9 "$TEST" \
      --gtest_filter='CudaBackend.NonFiniteInputsStayConfined:CudaBackend.HeadDims16And32Padded:CudaWConvNorm.*' \
      > "$OUTDIR/memcheck_rare.log" 2>&1; echo "memcheck (rare paths) rc=$?" | tee -a "$OUTDIR/memcheck_rare.log"
    tail -3 "$OUTDIR/memcheck_rare.log"
    # The paged cache's kernels: flush, step, combine, prefill's scatter, the skipped bad slot.
    compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/tests/cuda/test_cuda_paged" \
      --gtest_filter='CudaPaged.ChunkEqualsSingleStepsBitwise:CudaPaged.BadMetadataSkippedOrRefused:CudaPaged.PlainAttentionWithoutW' \
      > "$OUTDIR/memcheck_paged.log" 2>&1; echo "memcheck (paged) rc=$?" | tee -a "$OUTDIR/memcheck_paged.log"
    tail -3 "$OUTDIR/memcheck_paged.log"
    # The out-of-memory path: its failed allocations are the test, so API errors are not counted.
    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 "$TEST" \
      --gtest_filter='CudaBackend.OutOfMemoryFailsCleanly' > "$OUTDIR/memcheck_oom.log" 2>&1
    echo "memcheck (out of memory) rc=$?" | tee -a "$OUTDIR/memcheck_oom.log"
    tail -3 "$OUTDIR/memcheck_oom.log"
    # racecheck on a case without far superblocks (T = 150): it takes the far kernels' bulk copies into shared
    # memory, which complete on mbarrier transaction counts it does not follow, for writes racing with the reads
    # that wait for them (docs/cuda.md, "Checks"); the 100-run race test covers those kernels.
    compute-sanitizer --tool racecheck --error-exitcode 9 "$TEST" --gtest_filter='CudaBackend.PlainAttentionWithoutW' \
      > "$OUTDIR/racecheck.log" 2>&1; echo "racecheck rc=$?" | tee -a "$OUTDIR/racecheck.log"
    tail -3 "$OUTDIR/racecheck.log"
    # initcheck: no kernel reads device memory nothing wrote (outputs are poisoned, workspaces are not): the
    # scan and far forward paths, the backward, prefill and decode.
    compute-sanitizer --tool initcheck --error-exitcode 9 "$TEST" \
      --gtest_filter='CudaBackend.Varlen:CudaBackend.PlainAttentionWithoutW:CudaBackend.ForwardFarPath:CudaDecode.PrefillVarlenWithEmptySequence:CudaWConvNorm.*' \
      > "$OUTDIR/initcheck.log" 2>&1; echo "initcheck rc=$?" | tee -a "$OUTDIR/initcheck.log"
    tail -3 "$OUTDIR/initcheck.log"
  fi
  # The engine's CUDA device (CPU vs CUDA parity), when the build directory has it (a build with the apps).
  ENG=$BUILD/tests/cuda/test_engine_cuda
  [ -x "$ENG" ] || ENG=$BUILD/test_engine_cuda
  if [ -x "$ENG" ]; then
    echo "== engine GPU tests"
    "$ENG" --gtest_color=no > "$OUTDIR/test_engine_cuda.log" 2>&1 || status=1
    grep -E "FAILED|PASSED|Failure|K [0-9]+ \(Kp" "$OUTDIR/test_engine_cuda.log"
  fi
fi

if [ -n "$SM80" ]; then
  echo "== GPU tests, sm_80 code path (compute_80 PTX compiled by the driver)"
  T80=$SM80/tests/cuda/test_cuda
  [ -x "$T80" ] || T80=$SM80/test_cuda
  if [ ! -x "$T80" ]; then
    configure_build "$SM80" "-gencode=arch=compute_80,code=compute_80" test_cuda > /dev/null
    T80=$SM80/tests/cuda/test_cuda
  fi
  if [ -x "$T80" ]; then
    "$T80" --gtest_color=no > "$OUTDIR/test_cuda_sm80.log" 2>&1 || status=1
    grep -E "OK \]|FAILED|PASSED|Failure" "$OUTDIR/test_cuda_sm80.log"
  else
    echo "sm_80 test binary: not built"; status=1
  fi
fi

if [ "$PROBE" = 1 ]; then
  # Per-phase cycles of the chunk kernels (dev/cuda/phase_probe.cu): prebuilt in the build directory, or
  # built here by dev/cuda/Makefile.
  echo "== chunk-kernel phase probe"
  PP=$BUILD/phase_probe
  if [ ! -x "$PP" ] && command -v nvcc > /dev/null; then
    make -s -C dev/cuda phase_probe && PP=dev/cuda/build/phase_probe
  fi
  if [ -x "$PP" ]; then "$PP" | tee "$OUTDIR/phase_probe.txt" || status=1; else echo "phase probe: not built (no nvcc)"; status=1; fi
fi

if [ "$PLAY" = 1 ]; then
  # The far-loop playgrounds, one process per version (a wrong descriptor or barrier parity faults or traps and
  # must not take the other versions with it); a program without a version list (swizzle_tiles: the chunk
  # kernels' fp32 tile layouts; inverse: their triangular inverse; chain_floor: a dependent chain step's cost)
  # runs once with its defaults.
  echo "== playgrounds"
  for prog in far_tiling:v16,v16p,v16x2,v32,vw,vw2,vw3,vw4,vw5,vw6,vw7 far_bwd:bq16,bqw,bkw,bkw0 swizzle_tiles: inverse: chain_floor:; do
    name=${prog%%:*} vers=${prog#*:}
    exe=$BUILD/$name
    if [ ! -x "$exe" ] && command -v nvcc > /dev/null; then
      make -s -C dev/cuda "$name" && exe=dev/cuda/build/$name
    fi
    if [ ! -x "$exe" ]; then echo "$name: not built (no nvcc)"; status=1; continue; fi
    if [ -z "$vers" ]; then
      timeout 300 "$exe" 2>&1 | tee -a "$OUTDIR/$name.txt" | tail -5
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      continue
    fi
    for v in ${vers//,/ }; do
      # "vw" alone would also select vw2 .. vw7: a version name is followed by a blank in the programs' tables.
      timeout 300 "$exe" "$v " 2>&1 | grep -vE "^all checks|^CHECK FAILED" | tee -a "$OUTDIR/$name.txt" | tail -1
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
  done
fi

if [ "$BENCH" = 1 ]; then
  echo "== benchmark"
  if ls .whl/fla_core-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pathattn_site \
      .whl/fla_core-*.whl $(ls .whl/flash_linear_attention-*.whl 2>/dev/null) \
      && export PYTHONPATH=/tmp/pathattn_site${PYTHONPATH:+:$PYTHONPATH}
  fi
  PATHATTN_COMMIT=${PATHATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")} PYTHONUNBUFFERED=1 \
    python3 bench/gpu_bench.py --lib "$CAPI" --out "$TABLE" --Ts "$TS" $QUICK 2>&1 | tee "$OUTDIR/bench.log"
  cp "$TABLE" "$OUTDIR/" 2>/dev/null || true
fi
WHEELS=${WHEELS:-.whl}
PYTAG=$(python3 -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
ABI3=$(python3 -c 'import sys; print("abi3" if sys.version_info >= (3, 12) else "none")')  # cp312-abi3 wheels
WHEEL=$(ls "$WHEELS"/pathattn-*-"$PYTAG"-*.whl "$WHEELS"/pathattn-*-cp312-"$ABI3"-*.whl 2>/dev/null | head -1)
if [ "$TESTS" = 1 ] && [ "$PY" = 1 ] && [ -z "$WHEEL" ] && ls "$WHEELS"/build/scikit_build_core-*.whl > /dev/null 2>&1; then
  echo "== building the pathattn wheel ($PYTAG, CUDA sm_90a)"
  # cmake / ninja wheels there too, if the machine lacks them (their scripts land in the target's bin/).
  python3 -m pip install -q --upgrade --no-index --find-links "$WHEELS/build" --target /tmp/pathattn_buildenv \
    scikit-build-core nanobind scipy-openblas32 $(cd "$WHEELS/build" && ls cmake-*.whl ninja-*.whl 2>/dev/null | sed 's/-.*//') \
    && PATH=/tmp/pathattn_buildenv/bin:$PATH PYTHONPATH=/tmp/pathattn_buildenv python3 -m pip wheel -q --no-build-isolation --no-deps -w "$OUTDIR/wheel" . \
      -Ccmake.define.PATHATTN_CUDA=ON "-Ccmake.define.PATHATTN_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a" \
      -Cbuild-dir=build-wheel > "$OUTDIR/wheel_build.log" 2>&1 \
    || { echo "wheel build failed: $OUTDIR/wheel_build.log"; status=1; }
  WHEEL=$(ls "$OUTDIR"/wheel/pathattn-*.whl 2>/dev/null | head -1)
fi
if [ "$TESTS" = 1 ] && [ "$PY" = 1 ] && [ -n "$WHEEL" ]; then
  echo "== Python GPU tests ($(basename "$WHEEL"))"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pathattn_py \
    "$WHEEL" $(ls "$WHEELS"/fla_core-*.whl "$WHEELS"/flash_linear_attention-*.whl "$WHEELS"/hf/*.whl 2>/dev/null) \
    || status=1
  (cd python/tests && PYTHONPATH=/tmp/pathattn_py${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
    python3 -m pytest -q -s -p no:cacheprovider test_gpu.py 2>&1 | tee "$OUTDIR/pytest_gpu.log" | grep -E "^\[fla|^\[model|passed|failed|^E ")
  grep -qE "[0-9]+ passed" "$OUTDIR/pytest_gpu.log" && ! grep -qE "[0-9]+ (failed|errors?)\b" "$OUTDIR/pytest_gpu.log" || status=1
fi
if [ "$LAYERS" = 1 ] && { [ "$TESTS" = 0 ] || [ "$PY" = 0 ] || [ -z "$WHEEL" ]; }; then
  echo "--layers: needs the Python tests' wheel (not with --no-tests or --no-python)"; status=1
elif [ "$LAYERS" = 1 ]; then
  echo "== layer, decode and engine benchmarks ($(basename "$WHEEL"))"
  export PYTHONPATH=/tmp/pathattn_py${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  export PATHATTN_COMMIT=${PATHATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}
  python3 bench/layer_bench.py --out "$OUTDIR/layer.md" 2>&1 | tail -30 || status=1
  python3 bench/decode_bench.py --out "$OUTDIR/decode.md" --commit "$PATHATTN_COMMIT" 2>&1 | tail -20 || status=1
  CLI=$BUILD/apps/pathattn
  if [ -x "$CLI" ]; then
    python3 bench/engine_bench.py --pathattn "$CLI" --kernels --out "$OUTDIR/engine.md" --commit "$PATHATTN_COMMIT" \
      2>&1 | tail -60 || status=1
  else
    echo "engine benchmark: $CLI not built (a CUDA build with the apps)"
  fi
fi
exit $status
