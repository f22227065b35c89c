#!/usr/bin/env bash
# Run the GPU test suite (and, with --bench, the GPU benchmarks) on a machine with CUDA.
#
# usage: scripts/gpu_check.sh [--bundle PARTS_DIR] [--bench] [pytest args ...]
#        bash scripts/gpu/stack.sh bash scripts/gpu_check.sh [...]   # on a machine without a package index: inside
#                                                                   # the offline GPU stack (docs/gpu.md)
#
#   --bundle PARTS_DIR  first install the offline wheel bundle made by ../shared/gpu/bundle.sh (Transformer Engine,
#                       megatron-core, megatron-bridge) into $GPU_SITE (default /tmp/miles_vl_gpu_site) and put it on
#                       PYTHONPATH; without it, megatron/TE must already be importable (pip install -e '.[gpu,megatron]')
#                       or the tests that need them skip.
#   --bench             after the tests, run benchmarks/bench_megatron_cp.py (needs 2 GPUs),
#                       bench_train_throughput.py and bench_decode.py (or the names in $GPU_BENCHES); each
#                       prints one JSON line.
#
# Python: $PYTHON, else .venv/bin/python when it exists, else python3. Logs go to $OUT/ when OUT is set.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 ...): on shared hosts a program that uses it can take the GPUs down.
set -euo pipefail
cd "$(dirname "$0")/.."

bundle="" bench=0 pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=${2:?--bundle needs a folder}; shift 2 ;;
    --bench) bench=1; shift ;;
    *) pytest_args+=("$1"); shift ;;
  esac
done

py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
logs=${OUT:-$(mktemp -d)}

if [ -n "$bundle" ]; then
  site=${GPU_SITE:-/tmp/miles_vl_gpu_site}
  if [ ! -d "$site/megatron/bridge" ]; then
    bash "$bundle/install_bundle.sh" "$bundle" "$site"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

"$py" - <<'EOF'
import importlib, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs: {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-'}")
for name in ("transformers", "transformer_engine", "megatron.core", "megatron.bridge", "sglang"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
if not torch.cuda.is_available():
    raise SystemExit("error: no CUDA device; scripts/gpu_check.sh runs the GPU tests on a GPU machine")
EOF

# GPU tests live in tests/gpu and next to the code they test; only these paths are collected, so that the GPU
# machine needs none of the CPU suite's extras (ray, wandb).
set +e
"$py" -m pytest -m gpu -v -s -p no:cacheprovider tests/gpu tests/rollout/sglang/test_gpu.py \
  "${pytest_args[@]}" 2>&1 | tee "$logs/gpu_tests.log"
rc=${PIPESTATUS[0]}
set -e
grep -h "^GPU-" "$logs/gpu_tests.log" > "$logs/gpu_figures.jsonl" || true

if [ "$bench" = 1 ]; then
  for name in ${GPU_BENCHES:-bench_megatron_cp bench_train_throughput bench_decode}; do
    "$py" "benchmarks/$name.py" 2>&1 | tee "$logs/$name.log" | tail -1 || echo "$name failed (see $logs/$name.log)"
  done
fi
exit "$rc"
