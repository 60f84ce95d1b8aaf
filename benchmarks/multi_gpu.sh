#!/usr/bin/env bash
# One slice of the H200 tuning recipe tuned twice: by two workers (worker i on cuda:i, sharing
# one Optuna journal and writing one tuning database), then by one worker on cuda:0, each from
# scratch. OUTDIR gets each run's journal, database and log, and a per-second log of the
# processes holding a context on each GPU; `python3 benchmarks/multi_gpu.py OUTDIR` reports.
# Stopped runs resume where they stopped when the same command runs again.
#
#   bash benchmarks/multi_gpu.sh OUTDIR [OP SLICE]      (default: gemm decode, 16 problems)
set -euo pipefail
out=$1 op=${2:-gemm} slice=${3:-decode}
mkdir -p "$out"
nvidia-smi --query-compute-apps=timestamp,gpu_uuid,pid,used_memory --format=csv,noheader \
  -lms 1000 >> "$out/gpu_apps.csv" &
monitor=$!
trap 'kill $monitor 2>/dev/null || true' EXIT
nvidia-smi --query-gpu=index,uuid,name --format=csv,noheader > "$out/gpus.csv"

for run in two:2 one:1; do
  name=${run%:*} workers=${run#*:}
  DB=$out/$name.sqlite WORKERS=$workers JOBS=${JOBS:-4} \
    bash tuning_db/h200.sh tune "$op" "$slice" 2>&1 | tee -a "$out/$name.log"
done
