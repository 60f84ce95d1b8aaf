#!/bin/bash
# Any other Hopper: the head_dim 64 GPU tests on the final default, then hd128 stages x persistent.
mkdir -p $OUT/h100
timeout 200 python3 -m pytest -q -x tests/test_attention_gpu.py -k "test_attention_cuda and 64" 2>&1 | tail -4
timeout 330 python3 -m tileops.tuner tune --suite attention --where head_dim=128 --device cuda \
  --sampler grid --trials 8 --db .call/g128.sqlite --quiet --jobs 15 \
  --space '{"block_M":[128],"block_N":[128],"num_stages":[1,2],"threads":[256],"overlap":[2],"pingpong":[0],"persistent":[0,1]}'
python3 benchmarks/trials.py .call/g128.optuna.journal --db .call/g128.sqlite > $OUT/h100/hd128_grid.txt 2>&1
tail -40 $OUT/h100/hd128_grid.txt
