#!/usr/bin/env bash
# Round 5 of issue 30: the turn rule (copies of an earlier chat turn verified exactly) and numbers as pivots.
# Task accuracy: follow-ups (each item a chat's second turn), the development items (task seed 0, greedy and T 0.7)
# and a fresh validation draw (task seed 2, run once after the changes were made); then the held-out prompts'
# tokens per call and wall clock (run those on a quiet machine).
# usage: bash docs/results/tasks/turns/run.sh OUTDIR
set -u
out=${1:-docs/results/tasks/turns}
mkdir -p "$out"
run() { [ -s "$out/$1.json" ] || ptp-bench "${@:2}" --json "$out/$1.json" --plot "$out/$1.png" > "$out/$1.txt"; }
T="--tasks 210 --max-tokens 32"
run after $T --follow-ups --rules "exact;entropy;entropy:pivot=1;entropy:pivot=2"
run g0n $T --rules "exact;entropy:pivot=1;entropy:pivot=2"
run t0n $T --temp 0.7 --top-p 0.95 --seed 0 --rules "exact;entropy:pivot=1;entropy:pivot=2"
run g2n $T --seed 2 --rules "exact;entropy;entropy:pivot=1;entropy:pivot=2"
H="--prompts ptp_mlx/data/heldout_prompts.jsonl --limit 6 --max-tokens 64 --methods mlx-lm,ptp,ptp-lenient"
for p in 1 2; do
  [ -s "$out/held-greedy-p$p.txt" ] || ptp-bench $H --accept entropy:pivot=$p > "$out/held-greedy-p$p.txt"
  [ -s "$out/held-t07-p$p.txt" ] || ptp-bench $H --temp 0.7 --top-p 0.95 --seed 0 --accept entropy:pivot=$p \
    > "$out/held-t07-p$p.txt"
done
[ -s "$out/held-t07-entropy.txt" ] || ptp-bench $H --temp 0.7 --top-p 0.95 --seed 0 --accept entropy > "$out/held-t07-entropy.txt"
