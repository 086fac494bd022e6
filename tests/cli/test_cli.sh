#!/usr/bin/env bash
# tests/cli/test_cli.sh PATHATTN: bad arguments to every `pathattn` subcommand end promptly (no hang: each
# run has a time limit) with a non-zero exit code and a message naming the option. ctest runs it.
set -uo pipefail
P=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fails=0

# expect_fail "EXPECTED TEXT" ARGS...: the command must fail within 60 s, printing EXPECTED TEXT.
expect_fail() {
  local want=$1 out rc
  shift
  out=$(timeout 60 "$P" "$@" 2>&1)
  rc=$?
  if ((rc == 124)); then
    echo "FAIL (hung): pathattn $*"; fails=$((fails + 1))
  elif ((rc == 0)) || [[ "$out" != *"$want"* ]]; then
    echo "FAIL (rc $rc): pathattn $*: expected '$want', got: $out"; fails=$((fails + 1))
  else
    echo "ok: pathattn $* -> ${out%%$'\n'*}"
  fi
}

tiny=(--set model.d_model=16 --set model.head_dim=8 --set task.seq_len=16 --set task.eval_id=2
      --set task.eval_sparse=2 --set task.eval_dense=2 --set train.steps=2 --set train.batch_size=2 --no-progress)
timeout 120 "$P" train "${tiny[@]}" --out "$dir/run" > /dev/null || { echo "FAIL: the tiny training run"; exit 1; }
ck=$dir/run/ckpt.safetensors

expect_fail "--batch" eval "$ck" --batch 0
expect_fail "--batch" eval "$ck" --batch -1
expect_fail "--threads" eval "$ck" --threads -1
expect_fail "temperature: expected a finite number >= 0" sample "$ck" --temperature -1
expect_fail "temperature: expected a finite number >= 0" sample "$ck" --temperature nan
expect_fail "temperature: expected a finite number >= 0" sample "$ck" --temperature inf
expect_fail "--tokens: expected an integer >= 0" sample "$ck" --tokens -3
expect_fail "--top-k: expected an integer >= 0" sample "$ck" --top-k -2
expect_fail "--seed: expected an integer >= 0" sample "$ck" --seed -1
expect_fail "--seq-len" eval "$ck" --seq-len 1
expect_fail "--sequences, --tokens and --bucket go with --seq-len" eval "$ck" --bucket 4
expect_fail "--tokens: give --tokens or --sequences" eval "$ck" --seq-len 16 --tokens 40 --sequences 2
expect_fail "--seq-len evaluates on the cpu device" eval "$ck" --seq-len 16 --device cuda
expect_fail "--attn" convert "$ck" --attn stick --out "$dir/conv.safetensors"
expect_fail "--out" convert "$ck" --attn path
expect_fail "--out: must differ" convert "$ck" --attn path --out "$ck"
expect_fail "mlp.wfc" convert "$ck" --attn path --out "$dir/conv.safetensors" --set model.mlp_hidden=8
expect_fail "--max-layers" repro a5 --max-layers 0 --out "$dir/a5"
expect_fail "scales: expected multiples" repro long-context --small --scales 1,0 --out "$dir/lc"
expect_fail "depths: expected needle depths" repro long-context --small --depths 0,2 --out "$dir/lc"
expect_fail "models: expected attention kinds" repro long-context --small --models path,bogus --out "$dir/lc"
expect_fail "give --small or --preset" repro long-context --small --preset repro_long_context_cpu --out "$dir/lc"
expect_fail "task.mixture[0].bogus: unknown key" train --set 'task.mixture=[{"name":"niah","bogus":1}]' \
  --set task.name=mixture --set task.seq_len=300 --out "$dir/t"
expect_fail "task.seq_len" tasks show niah --set task.seq_len=50
expect_fail "task.n_needles" tasks show niah --set task.n_needles=2
expect_fail "not one of niah" tasks show a5
expect_fail "--index" tasks show niah --index -1
expect_fail "--seeds: expected an integer >= 0" repro flipflop --seeds 1,-2 --out "$dir/ff"
expect_fail "--seed: expected an integer >= 0, got -1" check --seed -1
expect_fail "--set train.steps: given more than once" train --set train.steps=3 --set train.steps=4 --out "$dir/t"
expect_fail 'duplicate key "a"' train --set 'train.steps={"a":1,"a":2}' --out "$dir/t"
printf '{"train": {"steps": 5, "steps": 6}}' > "$dir/dup.json"
expect_fail 'duplicate key "train.steps"' train --config "$dir/dup.json" --out "$dir/t"

# export-hf then import-hf then export-hf: the same Hugging Face weights file, byte for byte; bad input named.
if timeout 60 "$P" export-hf "$ck" "$dir/hf" > /dev/null && timeout 60 "$P" import-hf "$dir/hf" "$dir/back.safetensors" > /dev/null \
   && timeout 60 "$P" export-hf "$dir/back.safetensors" "$dir/hf2" > /dev/null \
   && cmp -s "$dir/hf/model.safetensors" "$dir/hf2/model.safetensors"; then
  echo "ok: export-hf / import-hf round trip"
else
  echo "FAIL: export-hf / import-hf round trip"; fails=$((fails + 1))
fi
expect_fail "cannot open checkpoint file" export-hf "$dir/missing.safetensors" "$dir/x"
expect_fail "config.json: cannot open" import-hf "$dir/nowhere" "$dir/y.safetensors"
expect_fail "give --config or --preset" import-hf "$dir/hf" "$dir/y.safetensors" --config a.json --preset b
expect_fail "dir is required" export-hf "$ck"

# Resuming a finished run reports its last loss and adds no second final evaluation to the log.
first=$(timeout 60 "$P" train --resume "$ck" --no-progress) || { echo "FAIL: resume of a finished run"; fails=$((fails + 1)); }
if [[ "$first" == *'"last_loss":0.0'* ]]; then echo "FAIL: resumed finished run reports last_loss 0.0"; fails=$((fails + 1)); fi
n_eval=$(grep -c '"eval"' "$dir/run/metrics.jsonl")
if ((n_eval != 1)); then echo "FAIL: $n_eval final evaluations in metrics.jsonl after resuming a finished run"; fails=$((fails + 1)); fi

if ((fails)); then echo "$fails failed"; exit 1; fi
echo "all passed"
