#!/usr/bin/env bash
# Task accuracy of the acceptance rules (issue 30): 210 generated questions with checkable answers, every rule on
# the same items with the same uniforms, greedy and T 0.7 top-p 0.95. Tokens per call and accuracy do not depend
# on machine load; the tok/s column does (the held-out benches in docs/results/lenient/ give wall clock, quiet).
# usage: bash docs/results/tasks/run.sh OUTDIR
set -u
out=${1:-docs/results/tasks}
mkdir -p "$out"
G="exact;entropy;entropy:eps=0.5,delta=0.2;entropy:eps=0.15,delta=0.05;threshold:0.1;threshold:0.2"
T="exact;entropy;entropy:eps=0.5,delta=0.2;threshold:0.2"
if [ ! -s "$out/greedy.json" ]; then
  ptp-bench --tasks 210 --max-tokens 32 --rules "$G" --json "$out/greedy.json" --plot "$out/greedy.png" > "$out/greedy.txt"
fi
if [ ! -s "$out/t07.json" ]; then
  ptp-bench --tasks 210 --max-tokens 32 --temp 0.7 --top-p 0.95 --seed 0 --rules "$T" --json "$out/t07.json" --plot "$out/t07.png" > "$out/t07.txt"
fi
# The entropy rule with a floor (a least probability every accepted draft needs), greedy and T 0.7.
F="exact;entropy:floor=0.05;entropy:floor=0.1"
if [ ! -s "$out/greedy-floor.json" ]; then
  ptp-bench --tasks 210 --max-tokens 32 --rules "$F" --json "$out/greedy-floor.json" --plot "$out/greedy-floor.png" > "$out/greedy-floor.txt"
fi
if [ ! -s "$out/t07-floor.json" ]; then
  ptp-bench --tasks 210 --max-tokens 32 --temp 0.7 --top-p 0.95 --seed 0 --rules "$F" --json "$out/t07-floor.json" --plot "$out/t07-floor.png" > "$out/t07-floor.txt"
fi
echo done > "$out/DONE"
