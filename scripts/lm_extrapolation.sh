#!/usr/bin/env bash
# scripts/lm_extrapolation.sh: one model of the length-extrapolation experiment (results/extrapolation.md):
# trains attention kind KIND with seed SEED on the corpus of scripts/get_corpus.sh at T_train = 512
# (configs/bytes_linux_small.json), then evaluates the checkpoint on the validation split at 1x .. 16x T_train.
#
#   bash scripts/lm_extrapolation.sh KIND SEED [RUNS_DIR]    (KIND: rope, path, fox, path-fox)
#
# Environment: PATHATTN (the program, default build/apps/pathattn), PATHATTN_DATA (the corpus directory,
# default ~/.cache/pathattn/linux-c), EVAL_TOKENS (scored positions per length, default 131072), STEPS (default: the
# config's). Writes RUNS_DIR/KIND_sSEED/{ckpt.safetensors, metrics.jsonl, eval.json}.
set -euo pipefail

kind=$1
seed=$2
runs=${3:-runs/lm}
exe=${PATHATTN:-build/apps/pathattn}
data=${PATHATTN_DATA:-$HOME/.cache/pathattn/linux-c}
[ -f "$data/train.txt" ] || { echo "lm_extrapolation: no corpus in $data (run scripts/get_corpus.sh)" >&2; exit 1; }

# Equal parameters: PaTH's w / beta projections (2 x 2370 parameters at this size) and FoX's gate (2 x 130)
# are balanced by the SwiGLU width (3 x 64 parameters per unit): 117056 + 4608 (rope), + 4868 (fox),
# + 4740 (path), + 5000 (path-fox) parameters in all.
case $kind in
  rope | fox) hidden=188 ;;
  path | path-fox) hidden=176 ;;
  *) echo "lm_extrapolation: KIND must be rope, path, fox or path-fox, got \"$kind\"" >&2; exit 1 ;;
esac
sets=(--set "model.attn=$kind" --set "model.mlp_hidden=$hidden" --set "train.seed=$seed"
      --set "task.files=[\"$data/train.txt\"]" --set "task.val_files=[\"$data/valid.txt\"]")
if [ -n "${STEPS:-}" ]; then sets+=(--set "train.steps=$STEPS"); fi
out="$runs/${kind}_s$seed"
export OMP_NUM_THREADS=1
"$exe" train --config configs/bytes_linux_small.json "${sets[@]}" --out "$out" --no-progress > "$out.train.json"
"$exe" eval "$out/ckpt.safetensors" --seq-len 512,1024,2048,4096,8192 --tokens "${EVAL_TOKENS:-131072}" \
  --threads 1 > "$out/eval.json"
echo "lm_extrapolation: $out/eval.json"
