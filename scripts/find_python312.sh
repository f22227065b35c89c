#!/usr/bin/env bash
# Print the path of a Python 3.12 interpreter: `python3.12` on PATH if it runs, else a pyenv install.
# Exit 1 with what to install when there is none (megatron-bridge requires Python 3.12).
set -u
ok() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
if command -v python3.12 >/dev/null 2>&1 && ok python3.12; then command -v python3.12; exit 0; fi
roots=()
command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)")
roots+=("${PYENV_ROOT:-$HOME/.pyenv}")
for root in "${roots[@]}"; do
  for cand in $(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r); do
    if ok "$cand"; then echo "$cand"; exit 0; fi
  done
done
echo "error: Python 3.12 not found (needed by megatron-bridge). Install it, e.g. 'pyenv install 3.12' or your" \
     "distribution's python3.12 package, or set PYTHON=/path/to/python3.12." >&2
exit 1
