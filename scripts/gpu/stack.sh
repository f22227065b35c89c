#!/usr/bin/env bash
# Run a command on the GPU machine inside the offline GPU stack (SGLang, TE + megatron, Ray, miles_vl's imports).
#
# usage (in the repository root on the GPU machine):
#   bash scripts/gpu/stack.sh --stage              # only copy the carried part(s) of .bundle_stack* to $STACK_PARTS*
#   bash scripts/gpu/stack.sh COMMAND [ARG ...]    # stage, install once, set the environment up, run COMMAND
#   STACK_VARIANT=sglang0517 bash scripts/gpu/stack.sh COMMAND [ARG ...]   # the same, in a variant of the stack
#
# The stack (scripts/gpu/bundle_stack.sh .bundle_stack) travels one part per device call, carried as
# .bundle_stack/partN; every call copies what it finds there to $STACK_PARTS (/tmp/stack_parts), which lives as long
# as the machine stays warm (about 30 s after a call). Plan for N parts, back to back:
#   calls 1..N-1: carry .bundle_stack/partK,  run: bash scripts/gpu/stack.sh --stage
#   call N:       carry .bundle_stack/partN,  run: bash scripts/gpu/stack.sh bash scripts/gpu/loop_run.sh ...
# Later calls on the same warm machine carry nothing: the stack stays installed in $STACK_SITE (/tmp/stack_site).
#
# A variant (STACK_VARIANT=V, listed in scripts/gpu/stack_requirements_V.txt: only the wheels that differ from the
# base, e.g. SGLang 0.5.17) is bundled into .bundle_stack_V (`STACK_VARIANT=V bundle_stack.sh .bundle_stack_V`),
# staged to $STACK_PARTS_V and installed into a site folder of its own, $STACK_SITE_V (/tmp/stack_site_V), which goes
# BEFORE the base's on PYTHONPATH; the base stack must be installed too (staged in this or an earlier call). Every
# call stages every .bundle_stack* it carries, whatever STACK_VARIANT says. The base site is never changed by a
# variant, so one warm machine can run the base and a variant at the same time (on different GPUs).
#
# The environment COMMAND gets: PYTHONPATH=[$STACK_SITE_V:]$STACK_SITE:<repo>, STACK_ACTIVE_SITE (the site folder
# first on it), miles_vl's entry points (a miles_vl-<version>.dist-info written into $STACK_SITE from pyproject.toml:
# miles_vl is on PYTHONPATH, not installed, and SGLang finds its plugin through `importlib.metadata`), NVLink multicast off (NCCL_NVLS_ENABLE=0
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; inherited by Ray workers and SGLang servers), Hugging Face
# offline, CUDA_HOME for SGLang's JIT kernels, libcudart.so.13 on LD_LIBRARY_PATH for torch_memory_saver, and
# SGLANG_USE_SGL_FA3_KERNEL=1 (FA3 from sgl-kernel, not from the hub). Logs of the install go to $OUT/stack.log
# ($OUT/stack_V.log in a variant). STACK_BUNDLE (.bundle_stack) names the carried bundle folder.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
py=${PYTHON:-python3}
variant=${STACK_VARIANT:-}
bundle=${STACK_BUNDLE:-.bundle_stack}
stage_dir=${STACK_PARTS:-/tmp/stack_parts}
site=${STACK_SITE:-/tmp/stack_site}
log=${OUT:-/tmp}/stack${variant:+_$variant}.log
say() { echo "[stack +$(( $(date +%s) - start ))s] $*" | tee -a "$log" >&2; }

if [ -n "$variant" ]; then  # before anything is staged or installed: a wrong name is one line, exit 2
  if ! [[ "$variant" =~ ^[A-Za-z0-9_]+$ ]] || [ ! -f "scripts/gpu/stack_requirements_$variant.txt" ]; then
    known=$(cd scripts/gpu && ls stack_requirements_*.txt 2> /dev/null | sed 's/^stack_requirements_//; s/\.txt$//' | tr '\n' ' ')
    echo "stack: STACK_VARIANT=$variant names no variant (expected one of: ${known:-none}; a variant V is listed in scripts/gpu/stack_requirements_V.txt)" >&2
    exit 2
  fi
fi

# every carried bundle: $bundle -> $stage_dir, ${bundle}_V -> ${stage_dir}_V
for src in "$bundle" "$bundle"_*; do
  [ -d "$src" ] || continue
  dest=$stage_dir${src#"$bundle"}
  mkdir -p "$dest"
  found=$(find "$src" -type f)
  for f in $found; do cp -f "$f" "$dest/"; done
  say "staged $(echo "$found" | grep -c 'stack.tar.xz' || true) part(s) of $src; $dest holds $(ls "$dest" | grep -c 'stack.tar.xz') of $(wc -l < "$dest/SHA256SUMS" 2> /dev/null || echo '?')"
done
[ "${1:-}" = "--stage" ] && exit 0
[ $# -gt 0 ] || { echo "usage: [STACK_VARIANT=V] stack.sh --stage | stack.sh COMMAND [ARG ...]" >&2; exit 2; }

install_into() {  # install_stack.py PARTS SITE, with the machine's own packages only on sys.path (its if-missing policy)
  env -u PYTHONPATH "$py" scripts/gpu/install_stack.py "$1" "$2" 2>&1 | tee -a "$log" >&2
  [ "${PIPESTATUS[0]}" = 0 ] || { say "install into $2 failed (see above; carry every part of $3)"; exit 2; }
}
install_into "$stage_dir" "$site" "$bundle"
active=$site
if [ -n "$variant" ]; then
  install_into "${stage_dir}_$variant" "${site}_$variant" "${bundle}_$variant"
  active=${site}_$variant
fi
# miles_vl's entry points (its SGLang plugin) for `importlib.metadata`: the repo is on PYTHONPATH, not installed
"$py" scripts/gpu/install_stack.py --dist-info pyproject.toml "$site" 2>&1 | tee -a "$log" >&2
[ "${PIPESTATUS[0]}" = 0 ] || { say "writing miles_vl's dist-info into $site failed (see above)"; exit 2; }

if [ -n "$variant" ]; then
  export PYTHONPATH="$active:$site:$PWD" PATH="$active/bin:$site/bin:$PATH"
else
  export PYTHONPATH="$site:$PWD" PATH="$site/bin:$PATH"
fi
export STACK_ACTIVE_SITE=$active PYTHONUNBUFFERED=1
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
say "environment ready (${variant:-base} stack, CUDA_HOME=${CUDA_HOME:-none}); running: $*"
exec "$@"
