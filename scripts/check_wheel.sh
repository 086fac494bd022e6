#!/usr/bin/env bash
# scripts/check_wheel.sh WHEEL: checks that a built pathattn wheel (scripts/build_wheels.sh) stands alone.
# A fresh venv gets the wheel and numpy with pip alone (binary wheels only, nothing compiled); then, from
# outside this tree, with LD_LIBRARY_PATH and PYTHONPATH unset:
#   - ldd of the extension: every library resolves, and OpenBLAS is the copy inside the wheel (no system
#     libopenblas);
#   - fp32 and fp64 forwards of the cpu backend against the fp64 oracle (rel_l2 2e-5 and 1e-10, the bars
#     of docs/numerics.md), T = 300 (several chunks, threads on: the BLAS path), MHA and GQA, gate on;
#   - /proc/self/maps after those calls: no libopenblas of the system mapped into the process.
# Exit code non-zero on any failure.
#   PYTHON               the interpreter of the venv (default python3; its version must match the wheel's tag)
#   PATHATTN_WHEEL_VENV  where to create the venv (default: a temporary folder, removed at exit)
set -euo pipefail

wheel=${1:?usage: scripts/check_wheel.sh WHEEL}
[ -f "$wheel" ] || { echo "check_wheel: no such wheel: $wheel" >&2; exit 2; }
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
python=${PYTHON:-python3}
if [ -n "${PATHATTN_WHEEL_VENV:-}" ]; then
  venv=$PATHATTN_WHEEL_VENV
  rm -rf "$venv"
else
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  venv=$tmp/venv
fi

"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --only-binary :all: "$wheel"
echo "check_wheel: installed $(basename "$wheel") with $("$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | grep -E '^(numpy|pathattn) ' | tr -s ' ' | paste -sd ',' -)"

cd /tmp
run=(env -u LD_LIBRARY_PATH -u PYTHONPATH -u LD_PRELOAD "$venv/bin/python")
pkg=$("${run[@]}" -c 'import os, pathattn; print(os.path.dirname(pathattn.__file__))')
ext=$(ls "$pkg"/_pathattn*.so)
echo "check_wheel: ldd $ext"
deps=$(env -u LD_LIBRARY_PATH ldd "$ext")
echo "$deps" | sed 's/^/  /'
if echo "$deps" | grep -q "not found"; then
  echo "check_wheel: FAILED: a library of the extension is not found" >&2; exit 1
fi
if echo "$deps" | grep -i "openblas" | grep -qv "=> $pkg/"; then
  echo "check_wheel: FAILED: the extension resolves an OpenBLAS outside the wheel" >&2; exit 1
fi
echo "$deps" | grep -q "=> $pkg/libscipy_openblas" \
  || { echo "check_wheel: FAILED: the wheel's OpenBLAS (libscipy_openblas) is not what the extension loads" >&2; exit 1; }

"${run[@]}" - <<'EOF'
import os
import numpy as np
import pathattn

def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

print("check_wheel: pathattn", pathattn.__version__, "| backends:", pathattn.build_info(), "| numpy", np.__version__)
rng = np.random.default_rng(20240611)
worst = {}
for B, T, HQ, H, K, V in [(2, 300, 4, 4, 64, 64), (1, 300, 8, 2, 32, 48)]:
    w = rng.standard_normal((B, T, H, K))
    x = dict(q=rng.standard_normal((B, T, HQ, K)), k=rng.standard_normal((B, T, H, K)),
             v=rng.standard_normal((B, T, H, V)), w=w / np.linalg.norm(w, axis=-1, keepdims=True),
             beta=rng.uniform(0.0, 2.0, (B, T, H)), g=np.log(rng.uniform(0.9, 1.0, (B, T, HQ))))
    o_ref, _, lse_ref = pathattn.parallel_path_attn(**x, return_lse=True, backend="oracle")
    for dtype, bar in ((np.float32, 2e-5), (np.float64, 1e-10)):
        xd = {n: a.astype(dtype) for n, a in x.items()}
        # The oracle on the same (rounded) inputs, so the bar measures the kernel alone.
        o_r, _, lse_r = (o_ref, None, lse_ref) if dtype == np.float64 else \
            pathattn.parallel_path_attn(**{n: a.astype(np.float64) for n, a in xd.items()}, return_lse=True,
                                        backend="oracle")
        o, _, lse = pathattn.parallel_path_attn(**xd, return_lse=True, backend="cpu")
        e = max(rel_l2(o, o_r), rel_l2(lse, lse_r))
        print(f"check_wheel: cpu {np.dtype(dtype).name} vs fp64 oracle, B={B} T={T} HQ={HQ} H={H} K={K} V={V}: "
              f"rel_l2 {e:.2e} (bar {bar:.0e})")
        assert np.isfinite(e) and e < bar, f"cpu {np.dtype(dtype).name} forward misses the oracle: {e:.2e}"

maps = open("/proc/self/maps").read().split("\n")
libs = sorted({l.split()[-1] for l in maps if ".so" in l and "/" in l})
blas = [p for p in libs if "openblas" in os.path.basename(p)]
print("check_wheel: OpenBLAS libraries mapped:", ", ".join(blas))
system = [p for p in blas if os.path.basename(p).startswith("libopenblas")]
assert not system, f"a system OpenBLAS is mapped: {system}"
pkg = os.path.dirname(pathattn.__file__)
assert any(p.startswith(pkg + "/") for p in blas), "the wheel's OpenBLAS is not mapped"
print("check_wheel: ok")
EOF
