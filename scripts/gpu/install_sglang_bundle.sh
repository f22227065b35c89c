#!/usr/bin/env bash
# Reassemble the parts made by bundle_sglang.sh and install the wheels into a folder to put on PYTHONPATH.
# The parts may lie in PARTS_DIR itself or in PARTS_DIR/part*/ (any order); SHA256SUMS (from the last part) names
# every part, so a missing or truncated part is reported by name before anything is unpacked.
#
# usage: install_sglang_bundle.sh PARTS_DIR [TARGET]     (TARGET defaults to /tmp/sglang_site)
#        then: export PYTHONPATH=TARGET
#
# Same semantics as ../shared/gpu/install_bundle.sh (pip --no-index --no-deps --target, one version of each
# package), with xz in place of a plain tar. Without the xz program, Python's lzma module decompresses.
set -euo pipefail
parts=${1:?usage: install_sglang_bundle.sh PARTS_DIR [TARGET]}
target=${2:-/tmp/sglang_site}
py=${PYTHON:-python3}

sums=$(find "$parts" -name SHA256SUMS | head -1)
if [ -z "$sums" ]; then
  echo "install_sglang_bundle: no SHA256SUMS under $parts (it comes with the last part): carry every part" >&2
  exit 2
fi
files=()
missing=()
while read -r sum name; do
  f=$(find "$parts" -name "$name" | head -1)
  if [ -z "$f" ]; then missing+=("$name"); continue; fi
  if [ "$(sha256sum "$f" | cut -d' ' -f1)" != "$sum" ]; then
    echo "install_sglang_bundle: $f is damaged (sha256 differs from SHA256SUMS): carry that part again" >&2
    exit 2
  fi
  files+=("$f")
done < "$sums"
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_sglang_bundle: missing part(s) under $parts: ${missing[*]} (of $(wc -l < "$sums"))" >&2
  exit 2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if command -v xz > /dev/null; then
  cat "${files[@]}" | xz -dc -T0 | tar xf - -C "$work"
else
  cat "${files[@]}" | "$py" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 22)" \
    | tar xf - -C "$work"
fi
n=$(ls "$work"/*.whl | wc -l)
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$work"/*.whl
echo "installed $n wheels into $target; now: export PYTHONPATH=$target NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
