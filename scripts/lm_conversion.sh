#!/usr/bin/env bash
# scripts/lm_conversion.sh: one arm of the conversion experiment (results/conversion.md): converts the
# pretrained RoPE checkpoint of scripts/lm_extrapolation.sh to TARGET (path, path-fox, or rope for "RoPE
# continued") with `pathattn convert`, continues training for STEPS steps on fresh windows (train.seed 101),
# and evaluates at 1x .. 16x T_train. The PaTH-from-scratch arm is `STEPS=<pretrain + continued> bash
# scripts/lm_extrapolation.sh path 1 RUNS_DIR`.
#
#   bash scripts/lm_conversion.sh TARGET ROPE_CKPT [RUNS_DIR]
#
# Environment: PATHATTN (default build/apps/pathattn), STEPS (continued steps, default 100), EVAL_TOKENS
# (default 64). The init rule is convert's default (docs/engine.md): beta = 2 sigmoid(-3), W_beta = 0; gate
# bias 5, W_g = 0; w projections and conv drawn as for a fresh model.
set -euo pipefail

target=$1
src=$2
runs=${3:-runs/lm_conv}
exe=${PATHATTN:-build/apps/pathattn}
steps=${STEPS:-100}
out="$runs/conv_${target}"
mkdir -p "$out"
export OMP_NUM_THREADS=1
"$exe" convert "$src" --attn "$target" --out "$out/ckpt.safetensors" --set "train.steps=$steps" \
  --set train.seed=101 --set train.warmup_steps=10 > "$out.convert.json"
# The converted model before any continued training (where conversion starts from).
"$exe" eval "$out/ckpt.safetensors" --seq-len 512 --tokens "${EVAL_TOKENS:-131072}" --threads 1 > "$out/eval_step0.json"
"$exe" train --resume "$out/ckpt.safetensors" --no-progress > "$out.train.json"
"$exe" eval "$out/ckpt.safetensors" --seq-len 512,1024,2048,4096,8192 --tokens "${EVAL_TOKENS:-131072}" \
  --threads 1 > "$out/eval.json"
echo "lm_conversion: $out/eval.json"
