#!/bin/bash
# The GPU step-time checks, sized for one 10-minute call on a lent H100 / H200 (474 s on an H100
# on 2026-11-26): a tiny smoke run first (stops early if CUDA or the model breaks), then the
# paper-like regime (1280-token images, 512 / dp 4 / 32) and vision-audio, each microbatch
# timed 3 times (median kept). Writes JSON and a log to $1, else $OUT, else bench/results/gpu-run.
# Needs torch with CUDA, numpy, pyarrow (the repository on PYTHONPATH is enough).
set -u
cd "$(dirname "$0")/.."
dest=${1:-${OUT:-bench/results/gpu-run}}
mkdir -p "$dest"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log=$dest/gpu_check.log
run() {  # run LIMIT_S ARGS...: one bench run, logged
    local limit=$1
    shift
    echo "== python bench/train_step.py $*" | tee -a "$log"
    timeout "$limit" python3 bench/train_step.py "$@" 2>&1 | tee -a "$log"
}
{
    date
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee -a "$log"
run 90 --device cuda --tiny --out /tmp/gpu_check_tiny.json
grep -q "wrote /tmp/gpu_check_tiny.json" "$log" || { echo "smoke run failed" | tee -a "$log"; exit 3; }
run 330 --vision-preset qwen2.5-vl-vision-1280 --global-batch 512 --dp 4 --microbatches 32 \
    --iterations 1 --warmup 4 --repeats 3 --out "$dest/train_step_1280_gb512.json"
run 170 --workload vision-audio --repeats 3 --out "$dest/train_step_vision_audio.json"
date | tee -a "$log"
