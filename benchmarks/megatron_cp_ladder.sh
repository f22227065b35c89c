#!/usr/bin/env bash
# The per-layout / per-length ladder of benchmarks/bench_megatron_cp.py on one 4-GPU machine (docs/long_context.md):
# CP=1 on GPU 0 and CP=2 (+ vision_dp_when_cp) on GPUs 1-2 at the same time, then CP=4, CP=4 + vision_dp_when_cp and
# TP=2 x CP=2 on GPUs 0-3; every layout at 16K, 32K and 64K tokens of the many_images task's shape, full recompute.
# Run inside the GPU stack:  bash scripts/gpu/stack.sh bash benchmarks/megatron_cp_ladder.sh
#
# Each launch has a hard bound (its --timeout-s, then `timeout` 30 s later) and reports what it measured until then.
# Output under $OUT (default /tmp/gpu_out): bench_cp.jsonl (one JSON line per launch: bench_megatron_cp.py's), and
# bench_<launch>.log (each launch's log, the JSON line last). Environment: LENGTHS, STEPS (2), RECOMPUTE (full).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
py=${PYTHON:-python3}
out=${OUT:-/tmp/gpu_out}
lengths=${LENGTHS:-16384,32768,65536}
steps=${STEPS:-2}
recompute=${RECOMPUTE:-full}
start=$(date +%s)
mkdir -p "$out"

launch() {  # NAME DEVICES GPUS LAYOUTS TIMEOUT_S
  CUDA_VISIBLE_DEVICES=$2 timeout -k 15 $(($5 + 30)) "$py" benchmarks/bench_megatron_cp.py --gpus "$3" --layouts "$4" \
    --lengths "$lengths" --steps "$steps" --recompute "$recompute" --timeout-s "$5" --out "$out/bench_cp.jsonl" \
    > "$out/bench_$1.log" 2>&1
  local rc=$?
  echo "[ladder +$(($(date +%s) - start))s] $1 ($4 on GPUs $2) exit $rc: $(tail -c 1500 "$out/bench_$1.log" | tail -1)"
}

launch cp1 0 1 cp1 200 &
launch cp2 1,2 2 cp2,cp2_vdp 200 &
wait
launch cp4 0,1,2,3 4 cp4,cp4_vdp,tp2cp2 270
echo "[ladder +$(($(date +%s) - start))s] done: $(wc -l < "$out/bench_cp.jsonl") launch(es) in $out/bench_cp.jsonl"
