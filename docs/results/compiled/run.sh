#!/usr/bin/env bash
# Before/after measurement for issue 29, one after the other on a quiet machine (nothing else running).
# usage: bash docs/results/compiled/run.sh BEFORE_TREE AFTER_TREE OUTDIR   (trees: checkouts sharing one venv)
set -u
before=$1; after=$2; out=$3
H=ptp_mlx/data/heldout_prompts.jsonl
mkdir -p "$out"
for side in before after; do
  tree=$before; [ "$side" = after ] && tree=$after
  ( cd "$tree" && uptime && python -m ptp_mlx.bench.cli --profile --max-tokens 48 --prompts $H --json "$out/profile-$side.json" ) > "$out/profile-$side.txt" 2>&1
done
for side in before after; do
  tree=$before; [ "$side" = after ] && tree=$after
  ( cd "$tree" && uptime && python -m ptp_mlx.bench.cli --prompts $H --limit 6 --max-tokens 64 --methods mlx-lm,ar,ptp --json "$out/greedy-$side.json" ) > "$out/greedy-$side.txt" 2>&1
  ( cd "$tree" && uptime && python -m ptp_mlx.bench.cli --prompts $H --limit 6 --max-tokens 64 --methods mlx-lm,ar,ptp --temp 0.7 --top-p 0.95 --seed 0 --json "$out/t07-$side.json" ) > "$out/t07-$side.txt" 2>&1
done
echo done > "$out/DONE"
