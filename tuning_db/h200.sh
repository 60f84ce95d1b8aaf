#!/usr/bin/env bash
# How the records of tuning_db/h200.sqlite are made: the bf16 workload suites in slices by M, each
# searched exhaustively (grid) over a space narrowed to the tiles that can win there
# (benchmarks/NOTES.md says why), in two stages:
#
#   bash tuning_db/h200.sh compile OP SLICE   # any machine with nvcc: fill the kernel cache
#   bash tuning_db/h200.sh tune OP SLICE      # the H200, with that cache: measure and record
#   bash tuning_db/h200.sh export             # the H200's records into tuning_db/h200.sqlite
#
# OP SLICE: gemm decode (M = 1, 16), gemm m64, gemm prefill (M = 256 ... 8192), mxfp4_gemm decode
# (M = 1, 16), mxfp4_gemm prefill (M = 256 ... 4096), attention all (the whole suite: its space is
# small enough to compile whole, and TPE picks 16 points of it). Kernels are compiled for sm_90a
# into $TILELANG_CACHE_DIR; tuning resumes where it stopped (the Optuna journal beside $DB).
# WORKERS=N tunes on N GPUs at once (worker i on cuda:i, one study per problem shared by all);
# JOBS sets the compile processes (few are needed when the cache holds every kernel); DTYPE the
# element type (default bfloat16; float16 records are separate ones).
set -euo pipefail

DB=${DB:-$HOME/.cache/tileops/h200.sqlite}
WORKERS=${WORKERS:-1}
DTYPE=${DTYPE:-bfloat16}
jobs_args=(); [[ -z ${JOBS:-} ]] || jobs_args=(--jobs "$JOBS")
H200='{"kind": "cuda", "arch": "sm_90a", "device": "NVIDIA H200", "units": 132}'
# (N, K) of the Llama-3-8B and -70B projections, shared by the GEMM and MXFP4 suites.
NK="6144x4096 4096x4096 28672x4096 4096x14336 10240x8192 8192x8192 57344x8192 8192x28672"

usage() { sed -n '2,16p' "$0"; exit 2; }
sampler=grid trials=64 space=

case "${2:-}:${3:-}" in
  gemm:decode)  # the weight takes the wgmma M side (swap_ab); split-K for more CTAs
    ms="1 16"; space='{"block_M": [16], "block_N": [64, 128], "block_K": [128, 256],
      "num_stages": [3, 4], "threads": [128], "swizzle": [0], "split_k": [1, 2, 4],
      "swap_ab": [1]}' ;;
  gemm:m64)
    ms="64"; space='{"block_M": [64], "block_N": [64, 128], "block_K": [128],
      "num_stages": [3, 4], "threads": [128], "swizzle": [0], "split_k": [1, 2, 4],
      "swap_ab": [1]}' ;;
  gemm:prefill)  # 64-256-row tiles, two consumer warpgroups for the larger ones, rasterised
    ms="256 1024 4096 8192"; space='{"block_M": [64, 128, 256], "block_N": [128, 256],
      "block_K": [64], "num_stages": [3, 4], "threads": [128, 256], "swizzle": [8],
      "split_k": [1], "swap_ab": [0]}' ;;
  mxfp4_gemm:decode)  # decoded in shared memory or in registers; 512-wide K steps for TMA scales
    ms="1 16"; space='{"block_M": [16], "block_N": [64, 128], "block_K": [256, 512],
      "num_stages": [2, 3], "threads": [128], "dequant": ["bits", "reg"], "swizzle": [0],
      "split_k": [1, 4], "swap_ab": [1]}' ;;
  mxfp4_gemm:prefill)  # the weight decoded once, then the GEMM loop
    ms="256 1024 4096"; space='{"block_M": [64, 128], "block_N": [128, 256], "block_K": [64],
      "num_stages": [3, 4], "threads": [128, 256], "dequant": ["global"], "swizzle": [8],
      "split_k": [1], "swap_ab": [0]}' ;;
  attention:all)
    ms=""; sampler=tpe trials=16 ;;
  *) [[ ${1:-} == export ]] || usage ;;
esac

problems() {  # the slice's problems: one --shape per (M, N, K) (GEMM: the w.t() layout), or a suite
  if [[ -z $ms ]]; then printf -- '--suite %s ' "$1"; return; fi
  local layout=""; [[ $1 == gemm ]] && layout=":nk"
  for m in $ms; do for nk in $NK; do printf -- '--shape %sx%s%s ' "$m" "$nk" "$layout"; done; done
}

space_args=()
[[ -z $space ]] || space_args=(--space "$space")
# shellcheck disable=SC2046  # $(problems ...): one argument per word
case "${1:-}" in
  compile)  # every point of the space (the grid), whatever the tuning sampler
    python3 -m tuner tune --op "$2" $(problems "$2") --dtype "$DTYPE" --device "$H200" \
      "${space_args[@]}" --sampler grid --dry-run --compile > /dev/null ;;
  tune)
    python3 -m tuner tune --op "$2" $(problems "$2") --dtype "$DTYPE" --device cuda \
      "${space_args[@]}" --sampler "$sampler" --trials "$trials" --db "$DB" \
      --workers "$WORKERS" "${jobs_args[@]}" ;;
  export)
    python3 -m tuner db export tuning_db/h200.sqlite --db "$DB"
    python3 -m tuner db verify --db tuning_db/h200.sqlite ;;
  *) usage ;;
esac
