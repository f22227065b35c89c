#!/usr/bin/env bash
# Real-SGLang checks on the GPU machine, inside the GPU stack: check that SGLang imports and that its prebuilt kernels
# run, write the tiny checkpoint, run the real-server GPU tests, run the decode benchmark.
#
# usage (in the repository root on the GPU machine, inside scripts/gpu/stack.sh, which stages and installs SGLang):
#   bash scripts/gpu/stack.sh bash scripts/gpu/run_sglang_checks.sh [--keep-going] [--skip-bench] [--skip-tests]
#                                                                  [--bench-args "ARGS"] [-k EXPR] [--shard K/N]
#   STACK_VARIANT=sglang0517 bash scripts/gpu/stack.sh bash scripts/gpu/run_sglang_checks.sh ...   # SGLang 0.5.17
# Under a stack variant (STACK_VARIANT, set for stack.sh) its logs go to $OUT/<variant>/, its import check is its own
# and its server pid file too, so that the base and a variant can run side by side (each on its own GPUs:
# CUDA_VISIBLE_DEVICES); the import stage checks that SGLang comes from the variant's site folder.
#
# On a fresh machine the tests (SGLang's first import ~90 s, two servers) and the benchmark no longer fit one 10-minute
# call together (2026-11-24: the tests got 262 s and the last one was cut): run them in two calls, --skip-bench then
# --skip-tests. The tests alone no longer fit the 450 s bound either (2026-11-26, 2 x H100: 19 of 23 in 445 s):
# `--shard K/N` runs the K-th of N contiguous parts of the collected tests (after -k), in pytest's order, so that
# a part's tests share the module's first server as the whole file does; `--shard 1/2` and `--shard 2/2` in two
# calls (or at once on two GPUs) run every test once.
# Each stage runs under what is left of $BUDGET_S (570 s, inside one 10-minute call) and the script stops at the first
# failure with one line naming the stage and the log (--keep-going runs the benchmark even after a failed test).
# Servers a killed stage left behind are stopped by their recorded pids ($MILES_VL_SGLANG_PIDFILE).
#
# Logs: $OUT/driver.log (every stage), $OUT/sglang_server.log and $OUT/sglang_bench_<variant>.log (the servers),
# $OUT/bench.json (the benchmark's JSON line); without OUT, a temp dir. On exit, where `xz` is installed, a `timed`
# server's trace $OUT/sglang_timing_<variant>.jsonl is summarized per call into $OUT/timing_summary_<variant>.jsonl and
# trimmed to the calls (benchmarks/sglang_timing/summarize.py), and the traces and server logs are xz-compressed: what
# docs/gpu-runs commits (its README.md; `xzcat` reads them).
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
budget=${BUDGET_S:-570}
py=${PYTHON:-python3}
export OUT=${OUT:-$(mktemp -d)}
variant=${STACK_VARIANT:-}
[ -n "$variant" ] && export OUT=$OUT/$variant
mkdir -p "$OUT"
log=$OUT/driver.log
keep_going=0 skip_bench=0 skip_tests=0 bench_args="" select=() shard=
while [ $# -gt 0 ]; do
  case "$1" in
    --keep-going) keep_going=1; shift ;;
    --skip-bench) skip_bench=1; shift ;;
    --skip-tests) skip_tests=1; shift ;;
    --bench-args) bench_args=${2:?--bench-args needs a string}; shift 2 ;;
    -k) select=(-k "${2:?-k needs a pytest expression}"); shift 2 ;;
    --shard) shard=${2:?--shard needs K/N}; shift 2
      [[ "$shard" =~ ^([1-9][0-9]*)/([1-9][0-9]*)$ ]] && [ "${BASH_REMATCH[1]}" -le "${BASH_REMATCH[2]}" ] \
        || { echo "run_sglang_checks: --shard $shard: expected K/N with 1 <= K <= N, e.g. --shard 1/2" >&2; exit 2; } ;;
    *) echo "run_sglang_checks: unknown argument $1" >&2; exit 2 ;;
  esac
done

say() { echo "[run_sglang_checks +$(( $(date +%s) - start ))s] $*" | tee -a "$log"; }
left() { echo $(( budget - ($(date +%s) - start) )); }
fail() { say "FAILED at stage '$1': $2 (log: $log)"; cleanup_servers; exit 1; }

# The SGLang servers run in their own sessions (so that stopping one stops its workers); a stage killed by its
# timeout may leave one behind, holding the GPU. The tests and the benchmark write each server's pid here: one file
# per variant and shard, so that the shards running at once on two GPUs stop only their own servers.
export MILES_VL_SGLANG_PIDFILE=/tmp/miles_vl_sglang_pids${variant:+_$variant}${shard:+_shard${shard%/*}of${shard#*/}}
cleanup_servers() {
  [ -f "$MILES_VL_SGLANG_PIDFILE" ] || return 0
  while read -r pid; do
    [ -n "$pid" ] && kill -KILL -- "-$pid" 2> /dev/null && say "killed the process group of leftover server $pid"
  done < "$MILES_VL_SGLANG_PIDFILE"
  rm -f "$MILES_VL_SGLANG_PIDFILE"
}

# The raw outputs as docs/gpu-runs commits them (docs/gpu-runs/README.md): each trace summarized and trimmed, then
# the traces and the server logs compressed whole.
pack_outputs() {
  command -v xz > /dev/null || return 0
  for t in "$OUT"/sglang_timing*.jsonl; do
    [ -f "$t" ] || continue
    s=$(dirname "$t")/$(basename "$t" | sed 's/^sglang_timing/timing_summary/')
    "$py" benchmarks/sglang_timing/summarize.py "$t" --trim "$t.trim" > "$s" 2>> "$log" && mv -f "$t.trim" "$t"
  done
  for f in "$OUT"/sglang_timing*.jsonl "$OUT"/sglang_*.log; do [ -f "$f" ] && xz -9 -f "$f"; done
  return 0
}
trap pack_outputs EXIT

cleanup_servers
say "servers' pid file: $MILES_VL_SGLANG_PIDFILE"
site=${STACK_ACTIVE_SITE:-${STACK_SITE:-/tmp/stack_site}}  # the variant's site folder under a variant

# -- stage: imports and prebuilt kernels --------------------------------------------------------------------------
if [ -f "$site/.miles_vl_import_ok" ]; then
  say "import: checked by an earlier run"
else
  say "import: sglang, sgl_kernel (+FA3), flashinfer, xgrammar, the server modules"
  timeout -k 10 "$(( $(left) > 180 ? 180 : $(left) ))" "$py" - >> "$log" 2>&1 << 'EOF' || fail import "$(tail -5 "$log")"
import importlib, os, time
from importlib.metadata import version
t0 = time.time()
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "transformers", transformers.__version__)
import sglang, sgl_kernel, flashinfer, xgrammar, tvm_ffi, torch_memory_saver  # noqa: F401
print({d: version(d) for d in ("sglang", "sglang-kernel", "flashinfer-python", "xgrammar", "apache-tvm-ffi", "tokenizers")})
active = os.environ.get("STACK_ACTIVE_SITE")  # set by stack.sh: the variant's site folder under a variant
for module, dist in ((sglang, "sglang"), (flashinfer, "flashinfer-python")):
    assert not active or module.__file__.startswith(active + os.sep), f"{dist} imported from {module.__file__}, not {active}"
assert sglang.__version__ == version("sglang"), f"sglang {sglang.__version__} imported, metadata says {version('sglang')}"
for m in ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler", "sglang.srt.model_executor.model_runner",
          "sglang.srt.models.qwen3_vl", "sglang.srt.multimodal.processors.qwen_vl",
          "sglang.srt.layers.attention.flashattention_backend", "sglang.srt.layers.sampler"):
    importlib.import_module(m)
x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
assert torch.allclose(sgl_kernel.rmsnorm(x, w, 1e-6).float(), ref, atol=3e-2), "sgl_kernel.rmsnorm is wrong"
from sgl_kernel.flash_attn import flash_attn_varlen_func  # loads the 1.1 GB FA3 library
q = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, 8], device="cuda", dtype=torch.int32)
out = flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, causal=True)
out = out[0] if isinstance(out, tuple) else out
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), q.transpose(0, 1), q.transpose(0, 1), is_causal=True).transpose(0, 1)
assert torch.allclose(out.float(), ref.float(), atol=2e-2), "FA3 differs from SDPA"
print(f"imports and prebuilt kernels OK in {time.time() - t0:.1f}s")
EOF
  say "import: $(tail -1 "$log")"
  touch "$site/.miles_vl_import_ok"
fi

status=0
# -- stages: tiny checkpoint, GPU tests ---------------------------------------------------------------------------
if [ "$skip_tests" = 0 ]; then
  export MILES_VL_SGLANG_CKPT=${MILES_VL_SGLANG_CKPT:-/tmp/ckpt_tiny}  # the directory scripts/gpu/loop_run.sh reuses
  if [ ! -f "$MILES_VL_SGLANG_CKPT/.complete" ]; then
    "$py" scripts/gpu/make_tiny_qwen3vl.py "$MILES_VL_SGLANG_CKPT" --shape tiny > "$OUT/ckpt.json" 2>> "$log" \
      || fail checkpoint "$(tail -5 "$log")"
    say "checkpoint: $(tail -1 "$OUT/ckpt.json")"
    cat "$OUT/ckpt.json" >> "$log"; rm -f "$OUT/ckpt.json"; touch "$MILES_VL_SGLANG_CKPT/.complete"
  fi

  t=$(( $(left) - (skip_bench ? 10 : 200) ))
  [ "$t" -gt 450 ] && t=450
  [ "$t" -lt 60 ] && fail tests "only ${t}s left for the tests"
  files=(tests/gpu/test_sglang_real.py tests/rollout/sglang/test_gpu.py)
  targets=("${files[@]}" "${select[@]}")
  if [ -n "$shard" ]; then  # the K-th of N contiguous parts of what pytest collects (after -k)
    mapfile -t ids < <("$py" -m pytest --collect-only -q -p no:cacheprovider "${files[@]}" "${select[@]}" 2>> "$log" \
      | grep '::')
    k=${shard%/*} n=${shard#*/} m=${#ids[@]}
    lo=$(( (k - 1) * m / n )) hi=$(( k * m / n ))
    [ "$hi" -gt "$lo" ] || fail tests "--shard $shard of $m collected tests selects none"
    targets=("${ids[@]:lo:hi-lo}")
    say "tests: shard $shard: tests $((lo + 1))-$hi of $m (${ids[lo]##*::} .. ${ids[hi-1]##*::})"
  fi
  say "tests: pytest -v -s (timeout ${t}s)"
  timeout -s INT -k 30 "$t" "$py" -m pytest "${targets[@]}" -v -s -p no:cacheprovider >> "$log" 2>&1
  status=$?
  cleanup_servers
  grep -oE "SGLANG-REAL.*|[0-9]+ (passed|failed|skipped|errors?)[^=]*" "$log" | tail -8 | while read -r line; do say "tests: $line"; done
  if [ "$status" != 0 ]; then
    [ "$status" = 124 ] && say "tests: timed out after ${t}s"
    [ "$keep_going" = 1 ] || fail tests "pytest exited $status"
  fi
fi

# -- stage: decode benchmark --------------------------------------------------------------------------------------
if [ "$skip_bench" = 0 ]; then
  t=$(( $(left) - 10 ))
  [ "$t" -lt 120 ] && fail bench "only ${t}s left for the benchmark"
  say "bench: benchmarks/bench_sglang_decode.py $bench_args (timeout ${t}s)"
  # shellcheck disable=SC2086
  timeout -s INT -k 20 "$t" "$py" benchmarks/bench_sglang_decode.py $bench_args >> "$log" 2>&1
  bstatus=$?
  cleanup_servers
  [ "$bstatus" = 0 ] || fail bench "exited $bstatus: $(tail -3 "$log")"
  tail -1 "$log" > "$OUT/bench.json"
  say "bench: $(cat "$OUT/bench.json")"
fi
[ "$status" = 0 ] || { say "done, with failed tests (exit $status)"; exit 1; }
say "all stages passed"
