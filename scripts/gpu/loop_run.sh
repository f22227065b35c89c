#!/usr/bin/env bash
# The production loop on the GPU machine: `miles-vl train configs/geo3k_qwen3vl_1gpu.yaml` (SGLang rollouts + the
# Megatron trainer under Ray, colocated on one GPU) on a random-init checkpoint written here, with a learnable reward.
# Run inside the GPU stack (scripts/gpu/stack.sh).
#
# usage: bash scripts/gpu/loop_run.sh [--check] SHAPE NAME NUM_STEPS [override ...]
#        bash scripts/gpu/loop_run.sh --checkpoint SHAPE   (only write SHAPE's checkpoint, if missing: before runs
#                                                          of one shape start side by side, whose writes would race)
#   --check    first: the stack's imports and a GPU probe (sglang, sgl_kernel, transformer_engine, megatron, ray)
#   SHAPE      tiny | 2b | 8b | 8b_1gpu | 2b_long16k | 2b_long32k | 2b_long64k  (scripts/gpu/loop_job.py; the
#              checkpoint, scripts/gpu/make_tiny_qwen3vl.py --shape tiny|2b|8b, is written once per machine to
#              /tmp/ckpt_loop_<SHAPE>, one for the three 2b_long shapes: /tmp/ckpt_loop_2b_long, whose processor keeps
#              1024x1024 images whole, and one for 8b and 8b_1gpu; 8b runs configs/geo3k_qwen3vl_8b.yaml on 4 GPUs,
#              8b_1gpu the same model on ONE GPU (CUDA_VISIBLE_DEVICES=0 unless set) with its optimizer state in host
#              memory: it refuses to start on a host with less than 150 GiB of RAM or without room for its checkpoints
#              (~123 GB; ~18 GB with checkpoint.optimizer_state=false, the weights alone) in /dev/shm or on the disk)
#   NAME       run name: the run directory is $RUNS/NAME (RUNS=/tmp/gpu_runs); running NAME again with a larger
#              NUM_STEPS resumes it from its newest checkpoint (checkpoint.resume=auto), appending to its metrics
#   NUM_STEPS  the job's num_steps
#   override   more `key=value` overrides, last
# GPU_MEMORY_GIB=79.4 (env): each of the run's GPUs held to that much memory for the run (scripts/gpu/cap_memory.py's
#              ballast, gpu_ballast.csv beside the run's files; the summary's memory figures leave it out): an H200
#              answers whether a run fits an 80 GB H100
#
# The job (scripts/gpu/loop_job.py): configs/geo3k_qwen3vl_1gpu.yaml with generated geo3k-style problems, wandb off,
# and the learnable reward `benchmarks.learning_smoke:digit_fraction`, sized per SHAPE.
# Output: $OUT/NAME.tar.gz holding NAME/metrics.jsonl, config.yaml, driver.log, sglang_0.log (the server's log,
# trimmed), gpu_memory.csv (nvidia-smi's samples every 2 s of the GPUs in CUDA_VISIBLE_DEVICES, else all, during the
# run: the summary's memory per GPU) and summary.json (scripts/gpu/summarize_run.py); where `xz` is installed, the
# server's log and a driver.log over 16 KB come xz-compressed (`.log.xz`, as docs/gpu-runs commits them: its
# README.md). The run is stopped (SIGINT, which writes a checkpoint) early enough that the stop, its checkpoint
# included, ends within $BUDGET_S (default 540 s from this script's start; the grace is computed below).
# Exit status: the job's own (`timeout --preserve-status`): 0 when it ran all its steps, also when the budget's SIGINT
# came during the last one or its final save (the run then finishes as it would have); 130 when the SIGINT stopped it
# earlier (its last completed step saved: the same command resumes it); 137 when it was killed after the grace.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
budget=${BUDGET_S:-540}
py=${PYTHON:-python3}
runs=${RUNS:-/tmp/gpu_runs}
out=${OUT:-/tmp/gpu_out}
check=0 ckpt_only=0
case "${1:-}" in --check) check=1; shift ;; --checkpoint) ckpt_only=1; shift ;; esac
shape=${1:?usage: loop_run.sh [--check] SHAPE NAME NUM_STEPS [override ...] | loop_run.sh --checkpoint SHAPE}
case "$shape" in tiny | 2b | 8b | 8b_1gpu | 2b_long16k | 2b_long32k | 2b_long64k) ;;
  *) echo "loop_run: unknown shape $shape (tiny | 2b | 8b | 8b_1gpu | 2b_long16k | 2b_long32k | 2b_long64k)" >&2
     exit 2 ;; esac
model_shape=${shape%%_*}      # the checkpoint's architecture: 2b_long64k -> 2b, 8b_1gpu -> 8b
ckpt_name=${shape%[0-9][0-9]k}  # one checkpoint for the 2b_long lengths: 2b_long64k -> 2b_long
[ "$shape" = 8b_1gpu ] && ckpt_name=8b
ckpt=${CKPTS:-/tmp}/ckpt_loop_$ckpt_name  # CKPTS: for the tests (tests/test_loop_run.py)

write_checkpoint() {  # OUTPUT_FILE: the shape's random-init checkpoint, unless one is complete
  local min_px max_px
  [ -f "$ckpt/.complete" ] && return 0
  read -r min_px max_px < <("$py" scripts/gpu/loop_job.py --pixels "$shape")
  say "checkpoint: writing $shape to $ckpt (processor pixels $min_px..$max_px)"
  "$py" scripts/gpu/make_tiny_qwen3vl.py "$ckpt" --shape "$model_shape" --min-pixels "$min_px" --max-pixels "$max_px" \
    >> "$1" 2>&1 && touch "$ckpt/.complete"
}

if [ "$ckpt_only" = 1 ]; then
  say() { echo "[loop_run +$(( $(date +%s) - start ))s] $*" >&2; }
  mkdir -p "$out"
  ckpt_log=$out/checkpoint_$shape.log
  write_checkpoint "$ckpt_log" || { say "checkpoint FAILED: $(tail -3 "$ckpt_log")"; exit 1; }
  exit 0
fi
name=${2:?run name}
steps=${3:?num_steps}
shift 3
mkdir -p "$out/$name" "$runs"
min_run_s=60  # seconds the run needs at least, after the checkpoint is written, before the stop's grace (below)
# Where the checkpoints go, and how long a stop may take. A stop (the budget's SIGINT below, or the job's end) finishes
# the step in training, syncs it and writes its checkpoint: bf16 weights, fp32 main params and Adam's two moments, ~14
# bytes a parameter (2B: 30 GB, 8B: 123 GB). They go to /dev/shm (RAM) where that holds the run's checkpoints at their
# peak (loop_job.py saves every 10 steps and at the end and keeps 3: with the one being written, up to 4) and leaves the
# host 64 GiB of its available memory (+131 GiB for 8b_1gpu's optimizer state), else to $RUNS, a disk (2B in 73-77 s:
# ~0.4 GB/s). A run that has checkpoints keeps their place (a resume finds them); a checkpoint.dir override of the
# caller's counts as a disk. The SIGINT comes $grace s before the end: 60 s for the step, then the write at 1 GB/s in
# RAM (assumed; the log's "checkpoint saved: ... (N GB, S s after its write began)" of the stop's save measures it) or
# 0.4 GB/s on a disk. A stop killed in its write leaves the newest complete checkpoint, never a partial one, but the
# run's last step unsaved (the 2026-11-27 8B and 2B runs, killed 60 s after the SIGINT, lost theirs).
weights_only=0  # checkpoint.optimizer_state=false: checkpoints of the weights alone, 2 bytes a parameter
for arg in "$@"; do [ "$arg" = checkpoint.optimizer_state=false ] && weights_only=1; done
case $model_shape in tiny) ckpt_gb=1 ;; 2b) ckpt_gb=$(( weights_only ? 5 : 30 )) ;; *) ckpt_gb=$(( weights_only ? 18 : 123 )) ;; esac
peak=$(( steps / 10 + 1 )); [ "$peak" -gt 4 ] && peak=4  # checkpoints at once: keep_last 3 + the one being written
host_gib=64; [ "$shape" = 8b_1gpu ] && host_gib=195
shm=${LOOP_SHM:-/dev/shm}
shm_dir=$shm/miles_vl_ckpt/$name
# available, not total: what /dev/shm already holds (earlier runs on this machine) is not available
avail_gib=${LOOP_RAM_GIB:-$(( $(awk '/^MemAvailable:/ {print $2}' /proc/meminfo) / 1048576 ))}
shm_kb=$(df -Pk "$shm" 2> /dev/null | awk 'NR == 2 {print $4}')
shm_gib=$(( ${shm_kb:-0} / 1048576 ))
disk_gb=$(( $(df -Pk "$runs" | awk 'NR == 2 {print $4}') / 1000000 ))
own_dir=0
for arg in "$@"; do case $arg in checkpoint.dir=*) own_dir=1 ;; esac; done
in_ram=0
if [ "$own_dir" = 1 ]; then
  in_ram=0
elif [ -n "$(ls -A "$shm_dir" 2> /dev/null)" ]; then
  in_ram=1  # this run's checkpoints are there
elif [ -n "$(ls -A "$runs/$name/checkpoints" 2> /dev/null)" ]; then
  in_ram=0
elif [ "$shm_gib" -ge $(( ckpt_gb * peak * 11 / 10 )) ] && [ $(( avail_gib - ckpt_gb * peak )) -ge "$host_gib" ]; then
  in_ram=1
fi
if [ "$in_ram" = 1 ]; then
  set -- "checkpoint.dir=$shm_dir" "$@"  # first: an override of the caller's still wins
  ckpt_where="$shm (RAM)"; grace=$(( 60 + ckpt_gb ))
else
  ckpt_where="a disk"; grace=$(( 60 + ckpt_gb * 10 / 4 ))
fi
if [ "$shape" = 8b_1gpu ]; then  # one GPU of the host; the host holds the optimizer's 131 GiB (loop_job.py)
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  min_run_s=300  # start (~3 min: two 8B loads), 4 steps
  if [ "$avail_gib" -lt 150 ] || { [ "$in_ram" = 0 ] && [ "$disk_gb" -lt $(( ckpt_gb + 7 )) ]; }; then
    echo "loop_run: 8b_1gpu needs >= 150 GiB of available RAM (the offloaded optimizer state is 131 GiB) and >= $ckpt_gb" \
      "GB free for its checkpoint, in /dev/shm (with >= $(( host_gib + ckpt_gb * peak )) GiB available) or in $runs" \
      "(then the stop's grace is ${grace} s); this host has ${avail_gib} GiB of RAM available, ${shm_gib} GiB free in" \
      "/dev/shm, ${disk_gb} GB in $runs: use a larger machine (one of its GPUs), or checkpoints of the weights alone" \
      "(checkpoint.optimizer_state=false: ~18 GB)" >&2
    exit 2
  fi
fi
log=$out/$name/driver.log
say() { echo "[loop_run +$(( $(date +%s) - start ))s] $*" | tee -a "$log" >&2; }
left() { echo $(( budget - ($(date +%s) - start) )); }

if [ "$check" = 1 ]; then
  say "check: imports and GPU"
  timeout -k 10 240 "$py" - >> "$log" 2>&1 << 'EOF' || { say "check FAILED: $(tail -5 "$log")"; exit 1; }
import time
t0 = time.time()
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), flush=True)
from importlib.metadata import version
import ray, sglang, sgl_kernel, transformer_engine.pytorch, megatron.core, megatron.bridge, transformers  # noqa: F401
print({d: version(d) for d in ("ray", "sglang", "sglang-kernel", "transformer-engine", "megatron-core",
                               "megatron-bridge", "transformers", "pydantic", "omegaconf")}, flush=True)
import miles_vl.patches
miles_vl.patches.install()
print("patches:", miles_vl.patches.status(), flush=True)
print(f"imports OK in {time.time() - t0:.0f}s", flush=True)
EOF
  say "check: $(tail -1 "$log")"
fi

write_checkpoint "$log" || { say "checkpoint FAILED"; exit 1; }

t=$(( $(left) - 25 - grace ))
[ "$t" -lt "$min_run_s" ] && { say "only ${t}s left before the stop's ${grace}s: not starting the run" \
  "(the same command again, with a larger BUDGET_S, starts it)"; exit 1; }
say "train: $name to step $steps (SIGINT after ${t}s, killed ${grace}s later: checkpoints of ~${ckpt_gb} GB in $ckpt_where)"
cap_pid=""
trap '[ -n "$cap_pid" ] && kill "$cap_pid" 2> /dev/null' EXIT  # the ballast never outlives the run
if [ -n "${GPU_MEMORY_GIB:-}" ]; then  # a larger card held to GPU_MEMORY_GIB a GPU (an H100's: cap_memory.py)
  "$py" scripts/gpu/cap_memory.py "$GPU_MEMORY_GIB" "$out/$name/gpu_ballast.csv" >> "$log" 2>&1 &
  cap_pid=$!
  for _ in $(seq 120); do [ -f "$out/$name/gpu_ballast.csv" ] || ! kill -0 "$cap_pid" 2> /dev/null && break; sleep 0.5; done
  [ -f "$out/$name/gpu_ballast.csv" ] || { kill "$cap_pid" 2> /dev/null; say "GPU_MEMORY_GIB=$GPU_MEMORY_GIB: the" \
    "ballast was not held within 60 s ($(tail -1 "$log")): not starting the run"; exit 1; }
  say "GPUs held to $GPU_MEMORY_GIB GiB each: $(tr '\n' ';' < "$out/$name/gpu_ballast.csv") (index, ballast MiB)"
fi
smi_pid=""
if command -v nvidia-smi > /dev/null; then  # memory per GPU, by every process on it (the summary's maxima)
  nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total --format=csv,noheader,nounits -l 2 \
    ${CUDA_VISIBLE_DEVICES:+-i "$CUDA_VISIBLE_DEVICES"} > "$out/$name/gpu_memory.csv" 2>> "$log" &
  smi_pid=$!
fi
timeout --preserve-status -s INT -k "$grace" "$t" "$py" scripts/gpu/loop_job.py "$shape" "$ckpt" "$runs" "$name" "$steps" "$@" >> "$log" 2>&1
status=$?
[ -n "$smi_pid" ] && kill "$smi_pid" 2> /dev/null
[ -n "$cap_pid" ] && kill "$cap_pid" 2> /dev/null
say "train exited $status"

run_dir=$runs/$name
cp -f "$run_dir/metrics.jsonl" "$run_dir/config.yaml" "$out/$name/" 2> /dev/null
[ -d "$run_dir/profile" ] && cp -r "$run_dir/profile" "$out/$name/"  # train.profile_steps' summaries
server_log=$(ls "$run_dir"/logs/sglang_0.log 2> /dev/null | head -1)
if [ -n "$server_log" ] && [ "$(stat -c %s "$server_log")" -le 400000 ]; then  # whole (head + tail would repeat it)
  cp "$server_log" "$out/$name/sglang_0.log"
elif [ -n "$server_log" ]; then
  { head -c 200000 "$server_log"; echo; echo "[... trimmed ...]"; tail -c 200000 "$server_log"; } > "$out/$name/sglang_0.log"
fi
mem_args=()
[ -s "$out/$name/gpu_memory.csv" ] && mem_args=(--gpu-memory "$out/$name/gpu_memory.csv")
[ -s "$out/$name/gpu_ballast.csv" ] && mem_args+=(--gpu-ballast "$out/$name/gpu_ballast.csv")
if "$py" scripts/gpu/summarize_run.py "$run_dir" --ckpt "$ckpt" "${mem_args[@]}" > "$out/$name/summary.json" 2>> "$log"
then
  say "summary: $(cat "$out/$name/summary.json")"
else  # no empty summary.json beside the run (a run refused at start has no metrics): the log has the error
  rm -f "$out/$name/summary.json"
  say "no summary: $(tail -1 "$log")"
fi
if command -v xz > /dev/null; then  # as docs/gpu-runs commits them (its README.md)
  for f in "$out/$name"/*.log; do
    [ -f "$f" ] || continue
    [ "${f##*/}" = sglang_0.log ] || [ "$(stat -c %s "$f")" -gt 16384 ] && xz -9 -f "$f"
  done
fi
# one file per run comes back (the device tool returns at most 8 files a call)
tar czf "$out/$name.tar.gz" -C "$out" "$name" && rm -rf "${out:?}/$name"
exit "$status"
