#!/usr/bin/env bash
# How the records of tuning_db/h200.sqlite are made: each operator's workload suite in slices (GEMM
# and MXFP4 by M, attention and MLA whole), each searched over a space narrowed to the tiles that
# can win there (benchmarks/NOTES.md says why), compiling in the background while the GPU measures:
#
#   bash tuning_db/h200.sh tune OP SLICE      # the H200: search, record; resumable
#   bash tuning_db/h200.sh all                # every slice below in turn (GEMM in bf16 and fp16)
#   bash tuning_db/h200.sh export             # the records into tuning_db/h200.sqlite, verified
#   bash tuning_db/h200.sh compile OP SLICE   # optional, any machine with nvcc: fill the cache
#
# OP SLICE: gemm decode (M = 1, 16), gemm m64, gemm prefill (M = 256 ... 8192), mxfp4_gemm decode
# (M = 1 ... 64), mxfp4_gemm prefill (M = 256 ... 4096), mxfp4_gemm_packed decode (M = 1, 16:
# the prepacked weight), mxfp4_gemm_packed decode_p0 (the same without a producer warpgroup),
# mxfp4_gemm_packed m64 and m64_p0, attention all (grid), attention hd64 (grid: the head_dim 64
# half, 192-query tiles), attention_varlen all (grid),
# attention_paged all (grid), attention_backward all (grid, over the attention suite),
# attention_varlen_backward all (grid, over the attention_varlen suite), mla_decode all (TPE): the whole suites; mla_decode seesaw: the suite over the seesaw schedule's points
# (after `all`: a record it does not beat stays). A stopped slice resumes where it stopped (the
# Optuna journal beside $DB), and every run appends what it cost (trials, wall seconds by part:
# GPU time, the machine being held throughout) to $REPORTS/OP-SLICE-DTYPE.jsonl, which
# benchmarks/tuning_cost.py sums.
# WORKERS=N tunes on N GPUs at once (worker i on cuda:i, one study per problem shared by all);
# JOBS sets the compile processes (default: all cores but one); DTYPE the element type of the
# GEMM slices (default bfloat16; float16 records are separate ones).
set -euo pipefail

DB=${DB:-$HOME/.cache/tileops/h200.sqlite}
REPORTS=${REPORTS:-$HOME/.cache/tileops/h200-costs}
WORKERS=${WORKERS:-1}
DTYPE=${DTYPE:-bfloat16}
JOBS=${JOBS:-$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))}  # one core stays with the timing process
H200='{"kind": "cuda", "arch": "sm_90a", "device": "NVIDIA H200", "units": 132}'
# (N, K) of the Llama-3-8B and -70B projections, shared by the GEMM and MXFP4 suites.
NK="6144x4096 4096x4096 28672x4096 4096x14336 10240x8192 8192x8192 57344x8192 8192x28672"
SLICES="gemm:decode gemm:m64 gemm:prefill mxfp4_gemm:decode mxfp4_gemm:prefill
  mxfp4_gemm_packed:decode mxfp4_gemm_packed:decode_p0 mxfp4_gemm_packed:m64
  mxfp4_gemm_packed:m64_p0 attention:all attention:hd64 attention_varlen:all
  attention_paged:all attention_backward:all attention_varlen_backward:all mla_decode:all
  mla_decode:seesaw"

usage() { sed -n '2,24p' "$0"; exit 2; }

slice() {  # sets ms, space, sampler, trials, extra for OP SLICE
  sampler=grid trials=64 space= extra=() dtype=$DTYPE suite=$1 where=
  case "$1:$2" in
    gemm:decode)  # the weight takes the wgmma M side (swap_ab); split-K for more CTAs, summed
      # by a second kernel or in the cluster
      ms="1 16"; space='{"block_M": [16], "block_N": [64, 128], "block_K": [128, 256],
        "num_stages": [3, 4], "threads": [128], "swizzle": [0], "split_k": [1, 2, 4],
        "cluster_sum": [0, 1], "swap_ab": [1], "full_row": [0], "staged_store": [0],
        "stream_k": [0]}' ;;
    gemm:m64)
      ms="64"; space='{"block_M": [64], "block_N": [64, 128], "block_K": [128],
        "num_stages": [3, 4], "threads": [128], "swizzle": [0], "split_k": [1, 2, 4],
        "cluster_sum": [0, 1], "swap_ab": [1], "full_row": [0], "staged_store": [0],
        "stream_k": [0]}' ;;
    gemm:prefill)  # 64- and 128-row tiles (256 never won), one or two consumer warpgroups,
      # rasterised; whole rows per warpgroup and the tile stored through shared memory (each
      # won or tied on all 32 shapes of the 2026-12-05 probe, NOTES), block_N in steps of 32
      # (the tile count by waves), 3-8 stages (the L2 bytes in flight), the stream-K program or
      # not: 224 points a problem (fewer fit shared memory), searched
      # by TPE until it stops improving
      ms="256 1024 4096 8192"; sampler=tpe trials=32; extra=(--patience 10)
      space='{"block_M": [64, 128], "block_N": [64, 96, 128, 160, 192, 224, 256],
        "block_K": [64], "num_stages": [3, 4, 6, 8], "threads": [128, 256], "swizzle": [8],
        "split_k": [1], "cluster_sum": [0], "swap_ab": [0], "full_row": [1], "staged_store": [1],
        "stream_k": [0, 1]}' ;;
    mxfp4_gemm:decode)  # decoded in shared memory or in registers; 512-wide K steps for TMA scales
      ms="1 16 64"; dtype=bfloat16; space='{"block_M": [16], "block_N": [64, 128],
        "block_K": [256, 512], "num_stages": [2, 3], "threads": [128], "dequant": ["bits", "reg"],
        "swizzle": [0], "split_k": [1, 4], "swap_ab": [1], "ctas_per_sm": [1]}' ;;
    mxfp4_gemm_packed:decode)  # the prepacked weight, decoded in the registers that feed wgmma;
      # 8 tokens a CTA at M = 1 (refused at 16),
      # CTAs sharing an SM (benchmarks/NOTES.md: 3 stages or 5 within 2% of 4)
      # one or two 64-row groups per CTA; one CTA per SM never won here
      ms="1 16"; dtype=bfloat16; space='{"block_M": [8, 16], "block_N": [64, 128],
        "block_K": [128, 256], "num_stages": [4], "threads": [128], "split_k": [1, 2, 4],
        "ctas_per_sm": [2, 3], "cluster_sum": [0, 1], "producer": [1]}' ;;
    mxfp4_gemm_packed:decode_p0)  # no producer warpgroup: four or five one-warpgroup CTAs an
      # SM loading by cp.async (after `decode`; 56 points; one 64-row group: NOTES.md)
      ms="1 16"; dtype=bfloat16; space='{"block_M": [8, 16], "block_N": [64],
        "block_K": [128, 256], "num_stages": [2, 3, 4], "threads": [128],
        "split_k": [1, 2, 4, 8], "ctas_per_sm": [4, 5], "cluster_sum": [0, 1], "producer": [0]}' ;;
    mxfp4_gemm_packed:m64)
      # 64-deep steps: two 64-row groups of 64 tokens fit two CTAs an SM (never won: NOTES.md)
      ms="64"; dtype=bfloat16; space='{"block_M": [64], "block_N": [64, 128],
        "block_K": [64, 128, 256], "num_stages": [4], "threads": [128], "split_k": [1, 2, 4],
        "ctas_per_sm": [1, 2], "cluster_sum": [0, 1], "producer": [1]}' ;;
    mxfp4_gemm_packed:m64_p0)  # as decode_p0, 64 tokens: 128-deep steps, three or four CTAs
      ms="64"; dtype=bfloat16; space='{"block_M": [64], "block_N": [64], "block_K": [128],
        "num_stages": [2, 3], "threads": [128], "split_k": [1, 2, 4, 8], "ctas_per_sm": [3, 4],
        "cluster_sum": [0, 1], "producer": [0]}' ;;
    mxfp4_gemm:prefill)  # the weight decoded once, then the GEMM loop
      ms="256 1024 4096"; dtype=bfloat16; space='{"block_M": [64, 128], "block_N": [128, 256],
        "block_K": [64], "num_stages": [3, 4], "threads": [128, 256], "dequant": ["global"],
        "swizzle": [8], "split_k": [1], "swap_ab": [0], "ctas_per_sm": [1]}' ;;
    attention:all)  # the tiles that came within 3% of a problem's best in the whole space's
      # grid, in each schedule (28-35 valid points with persistent; benchmarks/NOTES.md),
      # FlashAttention-3's 176-key blocks, and at head_dim 64 its 192 queries over three
      # consumer warpgroups; a kernel compiled for one problem serves the others of its heads,
      # head_dim and causal flag (the scheduler barrier, `pingpong`, never won: NOTES.md)
      ms=""; dtype=bfloat16; space='{"block_M": [64, 128, 192], "block_N": [64, 128, 176],
        "num_stages": [1, 2], "threads": [128, 256, 384], "overlap": [0, 1, 2], "pingpong": [0],
        "persistent": [0, 1]}' ;;
    attention:hd64)  # the suite's head_dim 64 half over the warp-specialised schedule's two
      # tiles, 128 queries on two consumer warpgroups or 192 on three (after `all`: a record it
      # does not beat stays)
      ms=""; dtype=bfloat16; where=head_dim=64; space='{"block_M": [128, 192],
        "block_N": [128], "num_stages": [1, 2], "threads": [256, 384], "overlap": [2],
        "pingpong": [0], "persistent": [0, 1]}' ;;
    attention_varlen:all)  # the paged kernel's winners at head_dim 128 (128 x 128 tiles, one or
      # two stages, 12 of 13 problems; benchmarks/NOTES.md), persistent or not: a packed kernel
      # takes ~80 s to lower
      ms=""; dtype=bfloat16; space='{"block_M": [128], "block_N": [128], "num_stages": [1, 2],
        "threads": [256], "persistent": [0, 1]}' ;;
    attention_paged:all)  # the paged kernel's whole space (configs/attention_paged.toml)
      ms=""; dtype=bfloat16 ;;
    attention_backward:all)  # over the attention suite's problems: 128-key tiles, two consumer
      # warpgroups, the hand schedules (64-key tiles or one warpgroup lose by 40%: NOTES.md)
      ms=""; dtype=bfloat16; suite=attention; space='{"block_M": [64, 128], "block_N": [128],
        "num_stages": [1, 2], "threads": [256], "overlap": [1, 2]}' ;;
    attention_varlen_backward:all)  # the dense backward's slice over the packed suite
      ms=""; dtype=bfloat16; suite=attention_varlen; space='{"block_M": [64, 128],
        "block_N": [128], "num_stages": [1, 2], "threads": [256], "overlap": [1, 2]}' ;;
    mla_decode:all)  # the whole space, searched by TPE until it stops improving
      ms=""; dtype=bfloat16; sampler=tpe trials=24; extra=(--patience 8) ;;
    mla_decode:seesaw)  # two consumer warpgroups on alternate key blocks (threads 384), its
      # splits from the plan balanced by keys (benchmarks/NOTES.md): one point per problem
      ms=""; dtype=bfloat16; space='{"block_H": [64], "block_N": [64], "num_stages": [2],
        "threads": [384], "num_splits": [1]}' ;;
    *) usage ;;
  esac
}

problems() {  # the slice's problems: one --shape per (M, N, K) (GEMM: the w.t() layout), or a
  # suite, or those of its problems a field selects
  if [[ -z $ms ]]; then
    printf -- '--suite %s ' "$suite"  # attention (also for attention_backward), attention_varlen, ...
    [[ -z $where ]] || printf -- '--where %s ' "$where"
    return
  fi
  local layout=""; [[ $1 == gemm ]] && layout=":nk"
  for m in $ms; do for nk in $NK; do printf -- '--shape=%sx%s%s ' "$m" "$nk" "$layout"; done; done
}

run() {  # run ACTION OP SLICE
  slice "$2" "$3"
  local space_args=(); [[ -z $space ]] || space_args=(--space "$space")
  local op_args=(--op "$2"); [[ -z $ms && $2 == "$suite" ]] && op_args=()
  mkdir -p "$REPORTS"
  # shellcheck disable=SC2046  # $(problems ...): one argument per word
  case $1 in
    compile)  # every point of the space (the grid), whatever the tuning sampler
      ${exec:-} python3 -m tileops.tuner tune "${op_args[@]}" $(problems "$2") --dtype "$dtype" --device "$H200" \
        "${space_args[@]}" --sampler grid --dry-run --compile --jobs "$JOBS" > /dev/null ;;
    tune)
      ${exec:-} python3 -m tileops.tuner tune "${op_args[@]}" $(problems "$2") --dtype "$dtype" --device cuda \
        "${space_args[@]}" --sampler "$sampler" --trials "$trials" "${extra[@]}" --db "$DB" \
        --workers "$WORKERS" --jobs "$JOBS" --report "$REPORTS/$2-$3-$dtype.jsonl" ;;
  esac
}

case "${1:-}" in
  compile|tune) [[ $# -eq 3 ]] || usage; exec=exec run "$1" "$2" "$3" ;;  # signals reach python
  all)
    for s in $SLICES; do run tune "${s%%:*}" "${s##*:}"; done
    for s in gemm:decode gemm:m64 gemm:prefill; do DTYPE=float16 run tune gemm "${s##*:}"; done ;;
  export)
    python3 -m tileops.tuner db export tuning_db/h200.sqlite --db "$DB" --force
    python3 -m tileops.tuner db verify --db tuning_db/h200.sqlite ;;
  *) usage ;;
esac
