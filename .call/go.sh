#!/bin/bash
# go.sh PHASE: what this call does depends on the card that came.
source .devkit/setup.sh
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $name  phase: $1"
export JOBS=15
case "$name" in
  *H200*) bash .call/h200.sh "$1" ;;
  *) bash .call/h100.sh "$1" ;;
esac
