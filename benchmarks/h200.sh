#!/usr/bin/env bash
# How the H200's results files (benchmarks/results/h200/) are made: each by one benchmark command
# on the H200, dispatching as a user's call does (the shipped databases, plus $TILEOPS_USER_DB
# where set), resumable case by case, then rendered to markdown and PNG where report.py reads it:
#
#   bash benchmarks/h200.sh list              # the files and the command behind each
#   bash benchmarks/h200.sh run NAME...       # measure them (a stopped run resumes where it was)
#   bash benchmarks/h200.sh defaults NAME...  # the same with no database at all (what a user with
#                                             # no records gets), into NAME_default.json
#   bash benchmarks/h200.sh run NAME -- ARG.. # ARGs passed on (--limit 4, --where M=256, ...)
#
# NAME: a file's stem below (gemm, attention, mxfp4_gemm_packed, ...), or `all`. OUT sets the
# folder (default benchmarks/results/<this card>/); the tuning databases come from
# tuning_db/h200.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

H="python3 benchmarks/harness.py"
declare -A COMMAND=(
  [gemm]="$H --suite gemm_llama"  # bf16 and fp16
  [gemm_offsuite]="$H --suite gemm_offsuite"
  [attention]="$H --suite attention"
  [attention_offsuite]="$H --suite attention_offsuite"
  [attention_backward]="$H --suite attention --op attention_backward"
  [attention_varlen]="$H --suite attention_varlen"
  [attention_varlen_backward]="$H --suite attention_varlen --op attention_varlen_backward"
  [attention_varlen_dense]="python3 benchmarks/varlen_vs_dense.py"
  [attention_paged]="$H --suite attention_paged"
  [mxfp4_gemm]="$H --suite mxfp4_llama"  # the OCP tensors
  [mxfp4_gemm_offsuite]="$H --suite mxfp4_offsuite"
  [mxfp4_gemm_packed]="$H --suite mxfp4_llama --op mxfp4_gemm_packed"
  [mxfp4_gemm_packed_offsuite]="$H --suite mxfp4_offsuite --op mxfp4_gemm_packed"
  [mla_decode]="$H --suite mla_decode"
  [mla_decode_offsuite]="python3 benchmarks/mla_offsuite.py"
)
NAMES=$(printf '%s\n' "${!COMMAND[@]}" | sort)

usage() { sed -n '2,15p' "$0"; exit 2; }

measure() {  # measure MODE NAME: one results file, resumed where the harness can, then rendered
  local mode=$1 name=$2 out
  [[ -n ${COMMAND[$name]:-} ]] || { echo "h200.sh: no results file named $name" >&2; exit 2; }
  out=${OUT:-benchmarks/results/$(cd benchmarks && python3 -c \
    'from harness import device_dir, resolve_device; print(device_dir(resolve_device("auto")[0]))')}
  mkdir -p "$out"
  local file=$out/$name.json resume=()
  [[ $mode == defaults ]] && file=$out/${name}_default.json
  [[ ${COMMAND[$name]} == "$H "* && -f $file ]] && resume=(--resume)
  echo "== $file: ${COMMAND[$name]}"
  if [[ $mode == defaults ]]; then
    TILEOPS_SHIPPED_DB=0 TILEOPS_USER_DB=$(mktemp -u --suffix=.sqlite) \
      ${COMMAND[$name]} --out "$file" "${resume[@]}" "${extra[@]}"
  else
    ${COMMAND[$name]} --out "$file" "${resume[@]}" "${extra[@]}"
  fi
  # The table and the plot (not every file is one: host_overhead and the like are not)
  python3 benchmarks/report.py "$file" | sed '/^plot: /d' > "${file%.json}.md" || rm -f "${file%.json}.md"
}

case "${1:-}" in
  list) for n in $NAMES; do printf '%-28s %s\n' "$n" "${COMMAND[$n]}"; done ;;
  run|defaults)
    mode=$1; shift; names=() extra=()
    while [[ $# -gt 0 && $1 != -- ]]; do names+=("$1"); shift; done
    [[ $# -gt 0 ]] && { shift; extra=("$@"); }
    [[ ${#names[@]} -gt 0 ]] || usage
    [[ ${names[*]} == all ]] && read -ra names <<< "$(echo $NAMES)"
    for n in "${names[@]}"; do measure "$mode" "$n"; done ;;
  *) usage ;;
esac
