#!/usr/bin/env bash
# Install megatron-core + megatron-bridge for the CPU harness of the real Qwen3-VL model (tests/patches/harness).
#
#   scripts/setup_megatron.sh [PYTHON]     # PYTHON: the venv's interpreter (default .venv/bin/python)
#
# - megatron-core 0.19.2 + megatron-bridge 0.6.2 go into the venv's site-packages with --no-deps: their full
#   dependency lists (transformer-engine, flashinfer, nvidia-resiliency-ext, ...) need CUDA builds and would move
#   torch/transformers. What the Qwen3-VL import path needs beyond them (torch, transformers<=5.12.1, einops,
#   omegaconf, pyyaml, rich, tqdm, pydantic, packaging, numpy) is already in constraints.txt; with the harness's
#   import order (megatron.core before the TE stub) nothing else is imported, onnxscript included.
# - megatron-bridge 0.5.1 goes side by side into $VENV/megatron-bridge-0.5.1 (pip --target), together with the
#   megatron-core it was released with (0.18.2, same day): the harness puts that folder first on sys.path in a fresh
#   process. Both packages must be installed by ONE pip command: `megatron` is a namespace package shared by both,
#   and a second `pip install --target` into the same folder refuses (or, with --upgrade, replaces) `megatron/`.
#   0.5.1 declares transformers<5.9 but its Qwen3-VL model runs with 5.12.1 (checked by the harness tests); its
#   package __init__ imports nvidia-modelopt, which the harness stubs during import (the model never calls it).
#
# Idempotent: each step is skipped when the exact versions are already there.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
if [ ! -x "$PY" ]; then
  echo "error: $PY is not an executable Python; create the venv first (make setup) or pass its python as \$1" >&2
  exit 1
fi

MCORE_VERSION=0.19.2
BRIDGE_VERSION=0.6.2
BRIDGE_OLD_VERSION=0.5.1
MCORE_OLD_VERSION=0.18.2  # megatron-core released with megatron-bridge 0.5.1
VENV="$("$PY" -c 'import sys; print(sys.prefix)')"
OLD_DIR="$VENV/megatron-bridge-$BRIDGE_OLD_VERSION"

installed() {  # installed <dist name> [path]: prints the version found (in site-packages, or in path)
  "$PY" - "$@" <<'EOF'
import sys
from importlib import metadata
name = sys.argv[1]
dists = metadata.distributions(path=[sys.argv[2]]) if len(sys.argv) > 2 else metadata.distributions()
print(next((d.version for d in dists if d.metadata["Name"].lower().replace("_", "-") == name), ""))
EOF
}

if [ "$(installed megatron-core)" = "$MCORE_VERSION" ] && [ "$(installed megatron-bridge)" = "$BRIDGE_VERSION" ]; then
  echo "megatron-core $MCORE_VERSION + megatron-bridge $BRIDGE_VERSION: already installed"
else
  "$PY" -m pip install -q --no-deps "megatron-core==$MCORE_VERSION" "megatron-bridge==$BRIDGE_VERSION"
fi

if [ "$(installed megatron-bridge "$OLD_DIR")" = "$BRIDGE_OLD_VERSION" ] \
   && [ "$(installed megatron-core "$OLD_DIR")" = "$MCORE_OLD_VERSION" ]; then
  echo "megatron-bridge $BRIDGE_OLD_VERSION + megatron-core $MCORE_OLD_VERSION in $OLD_DIR: already installed"
else
  rm -rf "$OLD_DIR"
  "$PY" -m pip install -q --no-deps --target "$OLD_DIR" \
    "megatron-bridge==$BRIDGE_OLD_VERSION" "megatron-core==$MCORE_OLD_VERSION"
fi

echo "megatron: core $(installed megatron-core), bridge $(installed megatron-bridge);" \
     "side install $OLD_DIR: bridge $(installed megatron-bridge "$OLD_DIR"), core $(installed megatron-core "$OLD_DIR")"
