#!/usr/bin/env bash
# How the GEMM records of tuning_db/h200.sqlite are made: the bf16 gemm_llama suite in three
# slices by M, each searched exhaustively (grid) over a space narrowed to the tiles that can win
# there (benchmarks/NOTES.md says why), in two stages:
#
#   bash tuning_db/h200_gemm.sh compile SLICE   # any machine with nvcc: fill the kernel cache
#   bash tuning_db/h200_gemm.sh tune SLICE      # the H200, with that cache: measure and record
#   bash tuning_db/h200_gemm.sh export          # the H200's records into tuning_db/h200.sqlite
#
# SLICE is decode (M = 1, 16), m64 (M = 64) or prefill (M = 256 ... 8192). Kernels are compiled
# for sm_90a into $TILELANG_CACHE_DIR; tuning resumes where it stopped (the Optuna journal beside
# $DB), so a slice may take several runs.
set -euo pipefail

DB=${DB:-$HOME/.cache/tileops/h200-gemm.sqlite}
H200='{"kind": "cuda", "arch": "sm_90a", "device": "NVIDIA H200", "units": 132}'
NK="6144x4096 4096x4096 28672x4096 4096x14336 10240x8192 8192x8192 57344x8192 8192x28672"

# Decode: the weight takes the wgmma M side (swap_ab); split-K for more CTAs.
DECODE='{"block_M": [16], "block_N": [64, 128], "block_K": [128, 256], "num_stages": [3, 4],
  "threads": [128], "swizzle": [0], "split_k": [1, 2, 4], "swap_ab": [1]}'
M64='{"block_M": [64], "block_N": [64, 128], "block_K": [128], "num_stages": [3, 4],
  "threads": [128], "swizzle": [0], "split_k": [1, 2, 4], "swap_ab": [1]}'
# Prefill: 64-256-row tiles, two consumer warpgroups for the larger ones, rasterised.
PREFILL='{"block_M": [64, 128, 256], "block_N": [128, 256], "block_K": [64], "num_stages": [3, 4],
  "threads": [128, 256], "swizzle": [8], "split_k": [1], "swap_ab": [0]}'

shapes() {
  for m in $1; do for nk in $NK; do printf -- '--shape %sx%s:nk ' "$m" "$nk"; done; done
}

usage() { sed -n '2,14p' "$0"; exit 2; }

case "${2:-}" in
  decode) ms="1 16"; space=$DECODE ;;
  m64) ms="64"; space=$M64 ;;
  prefill) ms="256 1024 4096 8192"; space=$PREFILL ;;
  *) [[ ${1:-} == export ]] || usage ;;
esac

# shellcheck disable=SC2046  # $(shapes ...): one --shape argument per word
case "${1:-}" in
  compile)
    python3 -m tuner tune --op gemm $(shapes "$ms") --dtype bfloat16 --device "$H200" \
      --space "$space" --sampler grid --dry-run --compile > /dev/null ;;
  tune)
    python3 -m tuner tune --op gemm $(shapes "$ms") --dtype bfloat16 --device cuda \
      --space "$space" --sampler grid --trials 64 --db "$DB" ;;
  export)
    python3 -m tuner db export tuning_db/h200.sqlite --db "$DB" --op gemm
    python3 -m tuner db verify --db tuning_db/h200.sqlite ;;
  *) usage ;;
esac
