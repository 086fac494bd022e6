#!/usr/bin/env bash
# scripts/test_python.sh: builds and tests the Python package the way a user installs it.
# Creates a fresh virtual environment, runs `pip install .` (scikit-build-core + nanobind, the C++ tests and
# apps off), installs pytest and torch (PyPI's wheel; set PATHATTN_PY_TORCH=0 to test numpy alone), and
# runs the pytest suite in python/tests. Exits non-zero on any failure, and also when pytest collects no
# test (its exit code 5). GPU tests skip on machines without a CUDA device.
#   PATHATTN_PY_VENV   where to create the environment (default: a new temporary folder, removed at exit)
#   PATHATTN_PY_TORCH  1 (default) to install torch and run the torch tests, 0 to skip them
#   PATHATTN_PY_HF     1 (default, with torch) to install transformers (pyproject's hf extra) for the
#                      pathattn.models tests, 0 to skip them
#   PATHATTN_PY_CUDA   OFF (default), ON or AUTO: the CUDA backend of the build (-Ccmake.define.PATHATTN_CUDA;
#                      a plain `pip install .` has AUTO, on where nvcc is found, which takes many minutes)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
with_torch="${PATHATTN_PY_TORCH:-1}"
cuda="${PATHATTN_PY_CUDA:-OFF}"

if [[ -n "${PATHATTN_PY_VENV:-}" ]]; then
  venv="$PATHATTN_PY_VENV"
  rm -rf "$venv"
else
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  venv="$tmp/venv"
fi

t0=$(date +%s)
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
echo "test_python: pip install . (building the extension, CUDA backend $cuda)"
"${pip[@]}" install --quiet -Ccmake.define.PATHATTN_CUDA="$cuda" .
t1=$(date +%s)
echo "test_python: package built and installed in $((t1 - t0)) s"

deps=(pytest numpy)
if [[ "$with_torch" == "1" ]]; then
  # PyPI's Linux torch wheel pulls its CUDA libraries: about 5.5 GB installed. Without room for it, test
  # numpy alone and say so loudly rather than fail the run half-way through an install.
  free_kb=$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 {print $4}')
  if (( free_kb < 9 * 1024 * 1024 )); then
    echo "test_python: WARNING: only $((free_kb / 1024)) MiB free next to the venv (torch needs ~5.5 GB): torch tests skipped" >&2
    with_torch=0
  else
    deps+=(torch)
    # the hf extra's range (pyproject.toml), for pathattn.models
    [[ "${PATHATTN_PY_HF:-1}" == "1" ]] && deps+=("transformers>=5.6,<6")
  fi
fi
"${pip[@]}" install --quiet --no-cache-dir "${deps[@]}"
t2=$(date +%s)
echo "test_python: test dependencies (${deps[*]}) installed in $((t2 - t1)) s"

# Import from outside the source tree so the installed package is the one tested.
(cd /tmp && "$venv/bin/python" -c "import pathattn; print('test_python: import pathattn OK, backends:', pathattn.build_info(), '| torch:', pathattn.HAS_TORCH)")
if [[ "$with_torch" == "1" ]]; then
  "$venv/bin/python" -c "import torch" || { echo "test_python: torch was installed but does not import" >&2; exit 1; }
fi

set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts="" --rootdir "$root/python/tests" \
  "$root/python/tests" "$@"
rc=$?
set -e
t3=$(date +%s)
echo "test_python: pytest finished in $((t3 - t2)) s (total $((t3 - t0)) s), exit code $rc"
if [[ $rc -eq 5 ]]; then
  echo "test_python: FAILED: pytest collected no tests" >&2
  exit 1
fi
exit $rc
