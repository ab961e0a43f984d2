#!/bin/bash
# The GPU step-time checks, each part sized for one 10-minute call on a lent H100 / H200.
#   bash bench/gpu_check.sh [DEST] [peer|told|plan|audio]
# Every part starts with a tiny smoke run (stops early if CUDA or the model breaks), then:
#   peer (default): the paper-like regime (1280-token images, 512 / dp 4 / 32), sequential,
#          entrain and the balance bench's best keeping peer on that row (orchmllm), each
#          microbatch timed 3 times (median kept): 404 s on an H200 on 2026-11-26
#   told:  as peer, with the plan's depth told (--pp 4, as bench/balance.py tells entrain): the
#          light-work layout's uneven microbatches, simulated on 4 stages laid as entrain's proxy lays them
#   plan:  as told, with the stages at the planner's layer ranges and entrain told their shares
#          (--layout plan: assign(stage_shares=), as the loader service tells it)
#   audio: vision-audio at 128 / dp 2 / 16, sequential and entrain, 3 repeats (129 s on an H100)
# Use 3 repeats or more: with 2 the median is the mean, and the H200's slow calls decided
# the order of two methods 2% apart (bench/RESULTS.md, "On a GPU", sixteenth session).
# Writes JSON and a log to DEST, else $OUT, else bench/results/gpu-run.
# Needs torch with CUDA, numpy, pyarrow (the repository on PYTHONPATH is enough).
set -u
cd "$(dirname "$0")/.."
dest=${1:-${OUT:-bench/results/gpu-run}}
part=${2:-peer}
case $part in
    peer | told | plan | audio) ;;
    *) echo "unknown part: $part (peer, told, plan or audio)" >&2; exit 2 ;;
esac
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
case $part in
    peer | told | plan)
        told=()
        [ "$part" = told ] && told=(--pp 4)
        [ "$part" = plan ] && told=(--pp 4 --layout plan)
        run 480 --vision-preset qwen2.5-vl-vision-1280 --global-batch 512 --dp 4 --microbatches 32 \
            --iterations 1 --warmup 4 --repeats 3 --methods sequential,entrain,orchmllm "${told[@]}" \
            --out "$dest/train_step_1280_gb512_$part.json"
        ;;
    audio)
        run 300 --workload vision-audio --repeats 3 --out "$dest/train_step_vision_audio.json"
        ;;
esac
date | tee -a "$log"
