#!/usr/bin/env bash
# The GPU runs that issues 33 and 34 still owe, one device call each, on one 4-GPU machine (nvidia-h100-x4 or
# nvidia-h200-x4); p7-sync, p7-s1, p8, p9-x2, p9-x2b, p9-x2c and p10-p13 use two GPUs and fit a 2-GPU machine too.
# Written down here so that a session with device time runs them as planned, and each run's commands.txt can name
# the call it came from (`owed.sh p1` at commit C).
#
# usage, in the repository root on the GPU machine:   bash scripts/gpu/plans/owed.sh [--dry-run] CALL
#   --dry-run  print each run's GPUs, end second and loop_run.sh arguments, one line each, and run nothing (the
#              CPU suite validates every run's overrides and GPU count this way: tests/test_gpu_plans.py)
#   CALL   p1  #34: the 2B job disaggregated, synchronous (GPUs 0,1) beside staleness 1 (GPUs 2,3), 6 steps each
#          p2  #33: one profiled train phase of the 2B job (GPU 0), bench_export in bf16 then the optimizer-offload
#              GPU test (GPU 1); #34: the tiny job at staleness 1 with partial rollouts and long responses, so that
#              a sync finds generations in flight and continues them, then #33's async-save GPU test (the cp2 case
#              of tests/gpu/test_megatron_train_gpu.py, which saves in the background too) (GPUs 2,3)
#          p3  #32's question: the 8B job with TP=1 engines (its step-1 diff was 0.0359 with TP=2 engines)
#          p4  #33: the 8B shapes full-parameter on ONE GPU (8b_1gpu; needs >= 150 GiB of available RAM), its
#              checkpoints the weights alone (checkpoint.optimizer_state=false: ~18 GB, not ~123, so that a 2-GPU host's
#              256 GiB hold one in /dev/shm beside the 131 GiB of offloaded optimizer state); on GPU 1 the GPU test
#              of a weights-only resume with megatron's own offloaded optimizer (-k weights_only); ran three times on
#              2026-11-28 on 2 x H200, the third (7e20245) all 4 steps (docs/benchmarks.md, issue 33.5)
#          p5  #34: the tiny job's learning pair, synchronous (GPUs 0,1) beside staleness 1 (GPUs 2,3), 20 steps each
#          p6  #34: the 2B pair again with staleness 2 (the synchronous run is the same invocation's baseline)
#          p7  #34's 1.6x goal: a 2B job whose rollout outlasts its train phase (1024-token responses, 4 prompts x 8
#              samples a step: ~40K trained tokens against 63K, each response 4x longer to generate; the pairs of
#              p1 and p6 gained 1.25x because their rollout was a quarter of their train phase), synchronous vs
#              staleness 1, the same GPUs as p1
#          p7-sync, p7-s1   p7 on a 2-GPU host (nvidia-h100-x2 / nvidia-h200-x2), one half a call, each on GPUs 0,1:
#              the two calls back to back on one warm machine (the comparison's condition: one machine; the pair is
#              two runs of one machine, not of one call, and its docs say so)
#          p8  #33: train.pinned_input_copies against today's copies, one invocation: the 2B job colocated with the
#              three levers on GPU 0 (off) and GPU 1 (on), step 3's train phase profiled (kernels and the host), 5 steps
#              (summarize_run's medians leave the profiled step out: steps 2, 4, 5);
#              the profile of 2026-11-27 found the device idle 58 % of the phase
#          p9  #33: fewer, larger pieces of host work (p8's profile: the host busy 6.5 s of a 6.7 s train phase, the GPU
#              a third of it): the 2B job colocated as p8 (the levers, one update a step), 5 steps, one GPU a run
#              (not 6: p8's two final saves into /dev/shm at once took 65-69 s, four at once may take longer):
#              today's 8,192-token micro-batches (GPU 0) beside 14,080 (GPU 1), 12,288 (GPU 2) and 8,192 with
#              selective recompute (GPU 3); the summaries' train_peak_mem_gib say which fit an 80 GB card. Not more
#              than 14,080: the preflight counts a micro-batch's tokens as its loss positions (at most; the prompts'
#              lengths are not known before the rollout), and 14,135 x 151,936 logits reach the 2^31 elements a train
#              forward may have (step.py); the plan of 2026-11-27 asked for 16,384 and 24,576, refused at start
#              (since 2026-11-28 the plan keeps a micro-batch's loss positions under that instead: p11)
#          p9-x2  p9's first two runs, for a 2-GPU machine (on 2026-11-28 its second run asked for 16,384 and stopped
#              at start with the preflight's logits error; p9-x2b and p9-x2c then ran the 14,080 it allows)
#          p9-x2b  14,080-token micro-batches (GPU 0) beside 8,192 with selective recompute (GPU 1)
#          p9-x2c  today's 8,192 (GPU 0) beside 14,080 (GPU 1), one invocation: the before/after of the larger
#              micro-batch (p9-x2, p9-x2b and p9-x2c ran back to back on one warm 2 x H200, 2026-11-28)
#          p10  #33's step 4 in one invocation, on an 80 GB card (nvidia-h100-x2: the memory of the largest setting on
#              the card it must fit): the 2B job as main ran it before issue 33 (the sync through Ray's object store,
#              no lever, 8,192-token micro-batches; one optimizer update a step, which only shortens its step) on
#              GPU 0 beside everything since (the IPC sync, the three levers, 14,080-token micro-batches) on GPU 1
#          p11  #33: micro-batches past the 14,134 tokens the preflight allowed until 2026-11-28 (the plan now keeps each
#              micro-batch's loss positions under the logits' limit instead): the 2B job as p9-x2c's 14,080 run (GPU 0)
#              beside 28,160-token micro-batches (GPU 1; ~3 a step instead of 5), on an 80 GB H100 pair (peak memory)
#          p12  #33: the tiny loop still learns with the levers and 28,160-token micro-batches, 20 steps (GPU 0), beside
#              the 2B job with 28,160 and the levers at the shipped one-GPU config's 1,024-token responses (GPU 1:
#              peak memory of the longest micro-batches it would form)
#          (p11, p10 and p12 ran back to back on one warm 2 x H200 asked as nvidia-h100-x2, 2026-11-28)
#          p13  #33: whether the shipped one-GPU config may take a faster setting: its own shape (responses up to 1,024
#              tokens, two optimizer updates a step) at today's 8,192-token micro-batches (GPU 0) beside 12,288 with
#              `logits_only_where_loss` and `vision_once_per_image` (GPU 1), on the 80 GB card it must fit. 12,288 is
#              the longest `miles-vl check` passes for that config (71.8 GiB estimated; 14,080: 76.1, past its 90 %;
#              p12's 28,160 held 72.2 GiB on the card). nvidia-h100-x1 does not do (two runs): ask nvidia-h100-x2
#          p14  #33's 35 % MFU: `train.recompute_layers` (full recompute of the first N of the 28 decoder layers only;
#              the rest keep their activations and skip their second forward), the 2B job as p11's 14,080 run (GPU 0)
#              beside the same with recompute_layers=18 (GPU 1: 10 layers kept whole, ~0.9 GiB each at 14,080 tokens,
#              on p11's 57.2 GiB peak), each card held to an H100's memory, one invocation, 5 steps
#          p14b  the same at p11's best, 28,160 tokens (32.4 % MFU, 72.1 GiB on the card): full (GPU 0) beside
#              recompute_layers=26 (GPU 1: 2 layers kept whole, ~1.8 GiB each)
#          p15  #33's 35 % MFU on a 4-GPU machine, four settings of the 2B job as p11's 14,080 run side by side (each
#              card held to an H100's memory, one invocation, 5 steps): full recompute (GPU 0), recompute_layers=18
#              (GPU 1), train.recompute=language (GPU 2: the vision tower keeps its activations and skips its 24
#              layers' second forward, ~4 images' patches a micro-batch), language with recompute_layers=22 (GPU 3)
#          p15b  the same at 28,160 (p11's best): full (GPU 0), recompute_layers=26 (GPU 1), language (GPU 2), and
#              language at 20,480 (GPU 3: fewer images a micro-batch, in case 28,160's do not fit beside p11's 72.1 GiB)
#              (p15 and p15b ran on 2026-11-28: docs/benchmarks.md, "Recompute less")
#          p16  the GPU check of the `vision_recompute_deepstack_grads` patch (docs/cp_layout.md §7), on a 4-GPU
#              machine: p15b's 28,160 full-recompute run (GPU 0) beside `recompute: language` (GPU 1), one
#              invocation. Patched, their step-1 gradient norms agree (2026-11-28, unpatched: 1.391 vs 1.446), and
#              the pair is the language lever's before/after with full recompute's deepstack gradients back; on
#              GPU 2 the GPU test `-k deepstack` (tests/gpu/test_megatron_train_gpu.py: the vision tower's
#              gradients with full recompute equal no recompute's, upstream's deepstack mergers get none)
#          p16-x1, p16-x1-full, p16-x1-lang   p16 on ONE GPU (nvidia-h200 / nvidia-h100), three calls back to back on one
#              warm machine: the GPU test `-k deepstack` and the 2B checkpoint, then the full-recompute run, then the
#              language run (each its own call: two 5-step runs of ~450 s do not fit one call's 600 s); the pair is two
#              runs of one machine, not of one call, and its docs say so (ran 2026-11-29 on nvidia-h200: 35.0 % and
#              38.0 % train MFU; p16-x1-lang alone on a fresh machine installs and writes the checkpoint itself, and on
#              an nvidia-h100 answers #33's goal as written, 35 % MFU on one H100, which no session has measured yet)
# p4, p13, p14, p14b, p15, p15b and p16 hold each card to an 80 GB H100's memory, 79.4 GiB as CUDA counts it (GPU_MEMORY_GIB, loop_run.sh: a
# ballast on a larger card, none on an H100), so that an H200 answers whether they fit one
# p1-p6 follow the issues' priority; p7 and p8 were planned from the runs of 2026-11-27 (p8 first: #33 comes before
# #34). A session's 30 device minutes hold the staging and about three calls.
#
# Before the first call, the stack is staged as docs/install-gpu.md says: 10 calls `bash scripts/gpu/stack.sh
# --stage` carrying .bundle_stack/part1..10, back to back (the machine keeps files only while warm, 30 s after a
# call), then the first call of this plan carrying .bundle_stack/part11: it installs the stack, then drops the
# carried bundle so that the runs' own stack.sh calls stage nothing. Later calls on the same warm machine carry
# nothing. Every call stays inside the device tool's 600 s: BUDGET_S counts from the call's start (bash's SECONDS).
# Each loop run leaves $OUT/NAME.tar.gz (loop_run.sh's header) and NAME.out (its own lines, in call_logs.tar.gz
# with the call's logs): commit them under docs/gpu-runs/<date>-<name>-<machine>/ with scripts/gpu/take_runs.py
# (docs/gpu-runs/README.md). The runs of a call go side by side; the call exits 1 when one of them failed (or the
# checkpoint they share could not be written: then none starts).
set -uo pipefail
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
dry=0
[ "${1:-}" = "--dry-run" ] && { dry=1; shift; }
O=${OUT:-/tmp/owed_out}
S=${OWED_STACK:-scripts/gpu/stack.sh}  # OWED_STACK, OWED_BUNDLE, CKPTS: for the tests (tests/test_gpu_plans.py)
bundle=${OWED_BUNDLE:-.bundle_stack}  # the carried stack bundle's parts (docs/install-gpu.md)
ckpts=${CKPTS:-/tmp}  # where loop_run.sh keeps its checkpoints (its CKPTS)
ts() { echo "[owed $(date +%T) +${SECONDS}s] $*"; }

install_once() {  # the call that carries the last part installs; the later ones find the stack installed
  [ "$dry" = 1 ] && return 0
  if [ -d "$bundle" ]; then
    STACK_BUNDLE="$bundle" bash $S true > "$O/install.out" 2>&1 \
      || { ts "stack install failed: $(tail -3 "$O/install.out")"; exit 1; }
    rm -rf "$bundle" "$O/install.out"  # kept only when it failed: the device tool returns 8 files at most
  fi
  ts "stack ready"
}

checkpoint() {  # SHAPE: written once per machine, before runs of one shape start side by side (their own writes
  # would race)
  [ "$dry" = 1 ] && return 0
  OUT=$O bash $S bash scripts/gpu/loop_run.sh --checkpoint "$1" >> "$O/checkpoints.log" 2>&1 \
    || { ts "checkpoint $1 FAILED: $(tail -3 "$O/checkpoints.log")"; exit 1; }
  ts "checkpoint $1 ready"
}

pids=()
loop() {  # GPUS END_S SHAPE NAME STEPS [override ...]: loop_run.sh on GPUS, stopped by second END_S of this call,
  # in the background (the call waits for all of them: finish)
  local gpus=$1 end_s=$2 name=$4
  [ "$dry" = 1 ] && { echo "$*"; return 0; }
  shift 2
  CUDA_VISIBLE_DEVICES=$gpus OUT=$O BUDGET_S=$(( end_s - SECONDS )) bash $S bash scripts/gpu/loop_run.sh "$@" \
    > "$O/$name.out" 2>&1 &
  pids+=($!)
}

left() {  # END_S: the seconds until second END_S of this call, for `timeout`; fails (and says so) under 5, since
  # `timeout 0` would set no limit at all and a negative one is an error
  local n=$(( $1 - SECONDS ))
  [ "$n" -ge 5 ] || { ts "no time left before second $1: not started" >&2; return 1; }
  echo "$n"
}

gpu_test() {  # GPUS END_S K: the GPU tests of tests/gpu/test_megatron_train_gpu.py matching -k K, on GPUS, stopped
  # by second END_S of this call, in the foreground (a chain's next link), logged to gpu_test_K.log
  [ "$dry" = 1 ] && return 0
  local n
  n=$(left "$2") || return 1
  CUDA_VISIBLE_DEVICES=$1 timeout -k 10 "$n" bash $S python3 -m pytest -m gpu -s -q \
    -p no:cacheprovider tests/gpu/test_megatron_train_gpu.py -k "$3" > "$O/gpu_test_$3.log" 2>&1
}

finish() {  # wait for every run; the call fails when one did, and says which
  local rc=0 pid
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  [ "$dry" = 1 ] && exit 0
  ts "done (exit $rc)"
  local logs=() f
  for f in "$O"/*.out; do [ -f "$f" ] && echo "== ${f##*/}" && tail -2 "$f"; done
  [ -f "$O/bench_export.log" ] && tail -1 "$O/bench_export.log"
  for f in "$O"/gpu_test_*.log; do [ -f "$f" ] && echo "== ${f##*/}" && grep -E "^GPU-|passed|failed" "$f" | tail -4; done
  # the call's own logs (stack.sh's stack*.log, the checkpoints' logs) and each run's own lines (NAME.out, which
  # take_runs.py reads from here) in one file: the device tool returns 8 files at most; p2 leaves 5 besides it, p9 4
  for f in "$O"/stack*.log "$O"/checkpoint*.log "$O"/*.out; do [ -f "$f" ] && logs+=("${f##*/}"); done
  [ ${#logs[@]} -gt 0 ] && tar czf "$O/call_logs.tar.gz" -C "$O" "${logs[@]}" && (cd "$O" && rm -f "${logs[@]}")
  exit "$rc"
}

calls="p1 | p2 | p3 | p4 | p5 | p6 | p7 | p7-sync | p7-s1 | p8 | p9 | p9-x2 | p9-x2b | p9-x2c | p10 | p11 | p12 | p13 | p14 | p14b | p15 | p15b | p16 | p16-x1 | p16-x1-full | p16-x1-lang"
[ $# = 1 ] || { echo "usage: owed.sh [--dry-run] CALL, one of $calls (found: $*)" >&2; exit 2; }
call=$1
case $call in p[1-9] | p10 | p11 | p12 | p13 | p14 | p14b | p15 | p15b | p16 | p16-x1 | p16-x1-full | p16-x1-lang | p7-sync | p7-s1 | p9-x2 | p9-x2b | p9-x2c) ;; *) echo "owed.sh: unknown call $call ($calls)" >&2; exit 2 ;; esac
[ "$dry" = 1 ] || mkdir -p "$O"
install_once
DIS=(ray.placement=disaggregate train.num_gpus=1)  # the trainer on one GPU, the engine on the other
# the three levers on and one optimizer update a step, as the before/after pair of docs/benchmarks.md (p8-p12)
LEVERS=(train.global_batch_size=128 train.old_logprobs_from_train_forward=true train.logits_only_where_loss=true
  train.vision_once_per_image=true)
case $call in
  p1 | p6)
    checkpoint 2b
    [ "$call" = p1 ] && ahead=1 || ahead=2
    loop 0,1 585 2b "async-2b-sync-$call" 6 "${DIS[@]}" algo.tis.enabled=true
    loop 2,3 585 2b "async-2b-s$ahead" 6 "${DIS[@]}" rollout.max_staleness=$ahead
    ;;
  p2)
    checkpoint 2b
    loop 0 560 2b prof-2b 4 'train.profile_steps=[3]'
    if [ "$dry" = 0 ]; then  # #33: where the export's time goes, on the 2B checkpoint, bf16 as the train ranks;
      # then the optimizer offload's GPU test (one GPU)
      (
        n=$(left 300) && CUDA_VISIBLE_DEVICES=1 timeout -k 10 "$n" bash $S python3 benchmarks/bench_export.py \
          --device cuda --hf-dir "$ckpts/ckpt_loop_2b" --repeats 5 > "$O/bench_export.log" 2>&1
        rc=$?
        gpu_test 1 570 offload || rc=1
        exit $rc
      ) &
      pids+=($!)
    fi
    (  # the tiny run, then the async save's GPU test (cp2: 2 GPUs; the 4-GPU cases of -k cp2 skip)
      loop 2,3 420 tiny async-tiny-partial 12 "${DIS[@]}" rollout.max_staleness=1 rollout.partial_rollouts=true \
        rollout.max_response_len=256
      [ "$dry" = 1 ] && exit 0
      wait "${pids[-1]}"
      rc=$?
      gpu_test 2,3 570 cp2 || rc=1  # 112 s on 2026-11-27
      exit $rc
    ) &
    pids+=($!)
    ;;
  p7 | p7-sync | p7-s1)
    checkpoint 2b
    LONG=(rollout.batch_size=4 rollout.max_response_len=1024 train.global_batch_size=32)
    SYNC=("${DIS[@]}" "${LONG[@]}" algo.tis.enabled=true) S1=("${DIS[@]}" "${LONG[@]}" rollout.max_staleness=1)
    case $call in  # the halves run p7's two jobs, one a call
      p7) loop 0,1 585 2b async-2b-long-sync 6 "${SYNC[@]}"; loop 2,3 585 2b async-2b-long-s1 6 "${S1[@]}" ;;
      p7-sync) loop 0,1 585 2b async-2b-long-sync-x2 6 "${SYNC[@]}" ;;
      p7-s1) loop 0,1 585 2b async-2b-long-s1-x2 6 "${S1[@]}" ;;
    esac
    ;;
  p8 | p9 | p9-x2 | p9-x2b | p9-x2c | p10 | p11)
    checkpoint 2b
    if [ "$call" = p10 ]; then
      loop 0 585 2b final-2b-before-33 5 train.global_batch_size=128 rollout.sglang.colocated_sync=tensor
      loop 1 585 2b final-2b-after-33 5 "${LEVERS[@]}" train.micro_batch_max_tokens=14080
    elif [ "$call" = p11 ]; then
      loop 0 585 2b mb-2b-14k-p11 5 "${LEVERS[@]}" train.micro_batch_max_tokens=14080
      loop 1 585 2b mb-2b-28k-p11 5 "${LEVERS[@]}" train.micro_batch_max_tokens=28160
    elif [ "$call" = p8 ]; then
      loop 0 585 2b copies-2b-plain 5 'train.profile_steps=[3]' "${LEVERS[@]}"
      loop 1 585 2b copies-2b-pinned 5 'train.profile_steps=[3]' "${LEVERS[@]}" train.pinned_input_copies=true
    elif [ "$call" = p9-x2b ]; then
      loop 0 585 2b mb-2b-14k-x2b 5 "${LEVERS[@]}" train.micro_batch_max_tokens=14080
      loop 1 585 2b mb-2b-8k-sel-x2b 5 "${LEVERS[@]}" train.recompute=selective
    elif [ "$call" = p9-x2c ]; then
      loop 0 585 2b mb-2b-8k-x2c 5 "${LEVERS[@]}"
      loop 1 585 2b mb-2b-14k-x2c 5 "${LEVERS[@]}" train.micro_batch_max_tokens=14080
    else
      loop 0 585 2b "mb-2b-8k-$call" 5 "${LEVERS[@]}"
      loop 1 585 2b "mb-2b-14k-$call" 5 "${LEVERS[@]}" train.micro_batch_max_tokens=14080
      if [ "$call" = p9 ]; then
        loop 2 585 2b mb-2b-12k 5 "${LEVERS[@]}" train.micro_batch_max_tokens=12288
        loop 3 585 2b mb-2b-8k-sel 5 "${LEVERS[@]}" train.recompute=selective
      fi
    fi
    ;;
  p3)
    loop 0,1,2,3 590 8b 8b-tp2cp2-eng-tp1 3 rollout.num_engines=4 rollout.gpus_per_engine=1 ;;
  p4)
    export GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-79.4}  # an 80 GB H100's memory on whatever card comes (cap_memory.py)
    loop 0 590 8b_1gpu 8b-1gpu 4 checkpoint.optimizer_state=false
    # beside it (a 2-GPU host's second GPU): the weights-only resume with megatron's own offloaded optimizer
    gpu_test 1 570 weights_only ;;
  p12)
    checkpoint tiny
    checkpoint 2b
    loop 0 585 tiny levers-tiny-28k 20 train.logits_only_where_loss=true train.vision_once_per_image=true \
      train.micro_batch_max_tokens=28160
    loop 1 585 2b mb-2b-28k-long 5 "${LEVERS[@]}" train.micro_batch_max_tokens=28160 rollout.max_response_len=1024
    ;;
  p14 | p14b)
    export GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-79.4}  # as p4
    checkpoint 2b
    if [ "$call" = p14 ]; then mb=14080 n=18; else mb=28160 n=26; fi
    loop 0 585 2b "rl-2b-$mb-full" 5 "${LEVERS[@]}" train.micro_batch_max_tokens=$mb
    loop 1 585 2b "rl-2b-$mb-first$n" 5 "${LEVERS[@]}" train.micro_batch_max_tokens=$mb train.recompute_layers=$n
    ;;
  p15 | p15b)
    export GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-79.4}  # as p4
    checkpoint 2b
    if [ "$call" = p15 ]; then mb=14080 n=18 lang=(14080 22); else mb=28160 n=26 lang=(20480 ""); fi
    loop 0 585 2b "lv-2b-$mb-full" 5 "${LEVERS[@]}" train.micro_batch_max_tokens=$mb
    loop 1 585 2b "lv-2b-$mb-first$n" 5 "${LEVERS[@]}" train.micro_batch_max_tokens=$mb train.recompute_layers=$n
    loop 2 585 2b "lv-2b-$mb-lang" 5 "${LEVERS[@]}" train.micro_batch_max_tokens=$mb train.recompute=language
    loop 3 585 2b "lv-2b-${lang[0]}-lang${lang[1]:+-first${lang[1]}}" 5 "${LEVERS[@]}" \
      train.micro_batch_max_tokens=${lang[0]} train.recompute=language ${lang[1]:+train.recompute_layers=${lang[1]}}
    ;;
  p16)
    export GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-79.4}  # as p4
    checkpoint 2b
    loop 0 585 2b dg-2b-28160-full 5 "${LEVERS[@]}" train.micro_batch_max_tokens=28160
    loop 1 585 2b dg-2b-28160-lang 5 "${LEVERS[@]}" train.micro_batch_max_tokens=28160 train.recompute=language
    if [ "$dry" = 0 ]; then
      ( gpu_test 2 570 deepstack ) &
      pids+=($!)
    fi
    ;;
  p16-x1)
    export GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-79.4}  # as p4
    checkpoint 2b  # the next two calls run from it
    if [ "$dry" = 0 ]; then
      ( gpu_test 0 585 deepstack ) &
      pids+=($!)
    fi
    ;;
  p16-x1-full | p16-x1-lang)
    export GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-79.4}  # as p4
    checkpoint 2b  # written by p16-x1 on this warm machine; written here if not
    if [ "$call" = p16-x1-full ]; then
      loop 0 585 2b dg-2b-28160-full-x1 5 "${LEVERS[@]}" train.micro_batch_max_tokens=28160
    else
      loop 0 585 2b dg-2b-28160-lang-x1 5 "${LEVERS[@]}" train.micro_batch_max_tokens=28160 train.recompute=language
    fi
    ;;
  p13)
    export GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-79.4}  # as p4
    checkpoint 2b
    SHIPPED=(rollout.max_response_len=1024)  # the 2b shape is the shipped config's but for its 256-token responses
    loop 0 585 2b ship-2b-8k 5 "${SHIPPED[@]}"
    loop 1 585 2b ship-2b-12k 5 "${SHIPPED[@]}" train.logits_only_where_loss=true train.vision_once_per_image=true \
      train.micro_batch_max_tokens=12288
    ;;
  p5)
    checkpoint tiny
    loop 0,1 560 tiny async-tiny-sync 20 "${DIS[@]}" algo.tis.enabled=true
    loop 2,3 560 tiny async-tiny-s1 20 "${DIS[@]}" rollout.max_staleness=1
    ;;
esac
finish
