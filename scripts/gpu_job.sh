#!/usr/bin/env bash
# The prepared GPU distillation run (issue 24), on a CUDA machine with PyTorch's Python but no MLX and no network.
#
# Here:   python -m ptp_mlx.train.gpu_job stage --prompts P1.jsonl P2.jsonl --val val.jsonl   (writes .stage/p1..pN)
# There:  one transfer per shard folder (each call carries .stage/pK; the folder stays between back-to-back calls),
#         then:  bash scripts/gpu_job.sh run      (joins and checks the shards, installs the wheels, runs the job)
# Here:   python -m ptp_mlx.train.gpu_job join <returned folder> my-adapter
#
# Environment: STAGE (default .stage), WORK (default /tmp/ptp-gpu-job), OUT (results; default runs/gpu-out),
# PTP_JOB_ARGS (extra arguments of `gpu_job run`), PTP_JOB_NO_INSTALL=1 (the CPU dry run: MLX already installed).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE="${STAGE:-.stage}"
WORK="${WORK:-/tmp/ptp-gpu-job}"
OUT="${OUT:-runs/gpu-out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"

case "${1:-run}" in
  receive)  # a shard transfer: say what is here so far
    ls -la "$STAGE"/*/ 2>/dev/null || echo "no shards yet"
    exit 0 ;;
  run) ;;
  *) echo "usage: scripts/gpu_job.sh receive|run" >&2; exit 2 ;;
esac

n=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['shards'])" "$STAGE/p1/manifest.json")
sha=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['sha256'])" "$STAGE/p1/manifest.json")
mkdir -p "$WORK"
rm -f "$WORK/pack.tar"
for k in $(seq 1 "$n"); do
  [ -f "$STAGE/p$k/part" ] || { echo "gpu_job: shard p$k is missing (transfer it first)" >&2; exit 2; }
  cat "$STAGE/p$k/part" >> "$WORK/pack.tar"
done
echo "$sha  $WORK/pack.tar" | sha256sum -c --quiet - || { echo "gpu_job: the joined pack is corrupt" >&2; exit 2; }
tar -xf "$WORK/pack.tar" -C "$WORK" && rm -f "$WORK/pack.tar"

if [ -z "${PTP_JOB_NO_INSTALL:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile "$WORK"/wheels/*.whl
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/run.txt" 2>&1 || true
fi
# MLX's CUDA library finds cuBLAS, cuDNN, NVRTC, NCCL through its rpath into site-packages/nvidia; name them too.
LD_LIBRARY_PATH="$("$PY" -c "import glob, site; print(':'.join(sorted(glob.glob(site.getsitepackages()[0] + '/nvidia/*/lib'))))")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
export PTP_MLX_BLAS=none PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC2086
"$PY" -m ptp_mlx.train.gpu_job run --work "$WORK" --out "$OUT" ${PTP_JOB_ARGS:-} 2>&1 | tee -a "$OUT/run.txt" | grep -v "it/s\]$\|s/it\]$" || true
test -f "$OUT/summary.json"
