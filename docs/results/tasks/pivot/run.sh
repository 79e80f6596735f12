#!/usr/bin/env bash
# The pivot guards of lenient lookup drafts (issue 30): task accuracy on the development items (task seed 0) and on
# a validation draw (task seed 1, measured once, after the guards were chosen), greedy and T 0.7; then the held-out
# prompts' tokens per call and wall clock (run those on a quiet machine).
# usage: bash docs/results/tasks/pivot/run.sh OUTDIR
set -u
out=${1:-docs/results/tasks/pivot}
mkdir -p "$out"
run() { [ -s "$out/$1.json" ] || ptp-bench "${@:2}" --json "$out/$1.json" --plot "$out/$1.png" > "$out/$1.txt"; }
run g0 --tasks 210 --max-tokens 32 --rules "exact;entropy;entropy:pivot=1;entropy:floor=0.05,pivot=1"
run g0p2 --tasks 210 --max-tokens 32 --rules "exact;entropy:pivot=2"
run g1 --tasks 210 --max-tokens 32 --seed 1 --rules "exact;entropy;entropy:pivot=1;entropy:pivot=2"
run t0 --tasks 210 --max-tokens 32 --temp 0.7 --top-p 0.95 --seed 0 --rules "exact;entropy:pivot=1;entropy:pivot=2"
H="--prompts ptp_mlx/data/heldout_prompts.jsonl --limit 6 --max-tokens 64 --methods mlx-lm,ptp,ptp-lenient"
for p in 1 2; do
  [ -s "$out/held-greedy-p$p.txt" ] || ptp-bench $H --accept entropy:pivot=$p > "$out/held-greedy-p$p.txt"
done
[ -s "$out/held-t07-p1.txt" ] || ptp-bench $H --temp 0.7 --top-p 0.95 --seed 0 --accept entropy:pivot=1 > "$out/held-t07-p1.txt"
