#!/bin/bash
# The H200: tune a slice into .call/h200/h200.sqlite (a copy of the shipped DB, resumable),
# bring DB, journal and costs back through $OUT/h200/.
mkdir -p .call/h200 $OUT/h200
export DB=$PWD/.call/h200/h200.sqlite REPORTS=$PWD/.call/h200/costs
[ -f "$DB" ] || cp tuning_db/h200.sqlite "$DB"
t0=$(date +%s)
case "$1" in
  gemm) timeout -s INT ${T:-500} bash tuning_db/h200.sh tune gemm prefill ;;
  gemm16) DTYPE=float16 timeout -s INT ${T:-500} bash tuning_db/h200.sh tune gemm prefill ;;
  hd64) timeout -s INT ${T:-500} bash tuning_db/h200.sh tune attention hd64 ;;
  suite) TILEOPS_USER_DB=$DB timeout 540 python3 benchmarks/harness.py --suite ${SUITE:-gemm_llama} --dtype bfloat16 --out $OUT/h200/${SUITE:-gemm_llama}.json 2>&1 | tail -8 ;;
esac
echo "phase took $(( $(date +%s) - t0 )) s"
cp "$DB" .call/h200/*.journal $OUT/h200/ 2>/dev/null
cat .call/h200/costs/*.jsonl > $OUT/h200/costs.jsonl 2>/dev/null
ls -la $OUT/h200
