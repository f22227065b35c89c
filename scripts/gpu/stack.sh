#!/usr/bin/env bash
# Run a command on the GPU machine inside the offline GPU stack (SGLang, TE + megatron, Ray, miles_vl's imports).
#
# usage (in the repository root on the GPU machine):
#   bash scripts/gpu/stack.sh --stage              # only copy the carried part(s) of .bundle_stack to $STACK_PARTS
#   bash scripts/gpu/stack.sh COMMAND [ARG ...]    # stage, install once, set the environment up, run COMMAND
#
# The stack (scripts/gpu/bundle_stack.sh .bundle_stack) travels one part per device call, carried as
# .bundle_stack/partN; every call copies what it finds there to $STACK_PARTS (/tmp/stack_parts), which lives as long
# as the machine stays warm (about 30 s after a call). Plan for N parts, back to back:
#   calls 1..N-1: carry .bundle_stack/partK,  run: bash scripts/gpu/stack.sh --stage
#   call N:       carry .bundle_stack/partN,  run: bash scripts/gpu/stack.sh bash scripts/gpu/loop_run.sh ...
# Later calls on the same warm machine carry nothing: the stack stays installed in $STACK_SITE (/tmp/stack_site).
#
# The environment COMMAND gets: PYTHONPATH=$STACK_SITE:<repo>, NVLink multicast off (NCCL_NVLS_ENABLE=0
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; inherited by Ray workers and SGLang servers), Hugging Face
# offline, CUDA_HOME for SGLang's JIT kernels, libcudart.so.13 on LD_LIBRARY_PATH for torch_memory_saver, and
# SGLANG_USE_SGL_FA3_KERNEL=1 (FA3 from sgl-kernel, not from the hub). Logs of the install go to $OUT/stack.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
py=${PYTHON:-python3}
stage_dir=${STACK_PARTS:-/tmp/stack_parts}
site=${STACK_SITE:-/tmp/stack_site}
log=${OUT:-/tmp}/stack.log
say() { echo "[stack +$(( $(date +%s) - start ))s] $*" | tee -a "$log" >&2; }

mkdir -p "$stage_dir"
found=$(find .bundle_stack -type f 2> /dev/null)
for f in $found; do cp -f "$f" "$stage_dir/"; done
say "staged $(echo "$found" | grep -c 'stack.tar.xz' || true) part(s); $stage_dir holds $(ls "$stage_dir" | grep -c 'stack.tar.xz') of $(wc -l < "$stage_dir/SHA256SUMS" 2> /dev/null || echo '?')"
[ "${1:-}" = "--stage" ] && exit 0
[ $# -gt 0 ] || { echo "usage: stack.sh --stage | stack.sh COMMAND [ARG ...]" >&2; exit 2; }

env -u PYTHONPATH "$py" scripts/gpu/install_stack.py "$stage_dir" "$site" 2>&1 | tee -a "$log" >&2
[ "${PIPESTATUS[0]}" = 0 ] || { say "install failed (see above)"; exit 2; }

export PYTHONPATH="$site:$PWD" PATH="$site/bin:$PATH" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_USE_SGL_FA3_KERNEL=1 RAY_USAGE_STATS_ENABLED=0

# torch_memory_saver preloads a library linked against libcudart.so.13 into the SGLang scheduler: make sure the
# dynamic loader finds one (the pip CUDA runtime next to torch) when the system has none registered.
if ! ldconfig -p 2> /dev/null | grep -q 'libcudart.so.13'; then
  cudart=$("$py" - << 'EOF'
import glob, os, site
hits = [p for d in site.getsitepackages() for p in glob.glob(os.path.join(d, "nvidia", "**", "libcudart.so.13*"), recursive=True)]
print(os.path.dirname(hits[0]) if hits else "")
EOF
)
  [ -n "$cudart" ] && export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
nvcc_path=$(command -v nvcc || { [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"; } || true)
[ -n "$nvcc_path" ] && export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc_path")")}
say "environment ready (CUDA_HOME=${CUDA_HOME:-none}); running: $*"
exec "$@"
