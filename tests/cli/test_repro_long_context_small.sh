#!/usr/bin/env bash
# tests/cli/test_repro_long_context_small.sh PATHATTN: `pathattn repro long-context --small` end to end (ctest
# runs it): four kinds, one seed, 9 tasks at 1x to 8x the training length; checks that every evaluation is in
# results.jsonl, and that the table, the per-run JSON lines and well-formed SVG plots are written. Prints its
# wall time.
set -euo pipefail
P=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
t0=$SECONDS
"$P" repro long-context --small --out "$dir/out" --no-progress > "$dir/stdout"
echo "repro long-context --small: $((SECONDS - t0)) s"
fail() { echo "FAIL: $*"; exit 1; }
# 4 kinds x 1 seed x 4 scales x (8 tasks + niah single at 5 depths)
n=$(wc -l < "$dir/out/results.jsonl")
((n == 4 * 4 * 13)) || fail "results.jsonl has $n lines, expected 208"
for k in rope path fox path-fox; do
  [ -s "$dir/out/${k}_s1/long_context.jsonl" ] || fail "no ${k}_s1/long_context.jsonl"
  [ -s "$dir/out/${k}_s1/metrics.jsonl" ] || fail "no ${k}_s1/metrics.jsonl"
done
for t in niah_single niah_multikey niah_multivalue niah_multiquery vartrack phonebook babi_qa1 babi_qa2 babi_qa3; do
  grep -q "| $t | PaTH-FoX |" "$dir/out/table.md" || fail "table.md has no row for $t"
done
grep -q "2048 (8x)" "$dir/out/table.md" || fail "table.md has no 8x column"
cmp -s "$dir/stdout" "$dir/out/table.md" || fail "stdout and table.md differ"
for f in plot.svg plot_accuracy.svg; do
  python3 -c 'import sys, xml.etree.ElementTree as E; E.parse(sys.argv[1])' "$dir/out/$f" || fail "$f is not well-formed"
done
echo "all passed"
