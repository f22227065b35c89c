#!/usr/bin/env bash
# Build the offline GPU stack for the GPU machine (Python 3.12, torch 2.11.0+cu130, no package index): every wheel of
# scripts/gpu/stack_requirements.txt (SGLang 0.5.16, Transformer Engine 2.20.2 + megatron-core 0.19.2 +
# megatron-bridge 0.6.2, Ray 2.60.0 and what miles_vl imports), as parts of at most PART_MB MiB (default 56) that
# travel one per device call (a part and the working tree, about 7 MB on 2026-11-25, must fit in the call's 64 MiB;
# 58 MiB parts stopped fitting then).
#
# usage: scripts/gpu/bundle_stack.sh OUT_DIR        (e.g. .bundle_stack: ignored by the repo's /.bundle*/ rule)
#        then on the GPU machine: scripts/gpu/stack.sh (stages the parts, installs, runs a command)
#
# How: the wheels are downloaded without dependency resolution (the list is the closure; bundle_stack.sh checks that
# exactly one wheel per line arrives, at its version), rewritten uncompressed (ZIP_STORED: same members; RECORD hashes
# are over contents, so the wheels stay valid) so that xz sees raw bytes, tarred and xz-compressed as one stream, and
# split. Ray's Java jar and dashboard web client are dropped from its wheel (the driver starts Ray with the dashboard
# off and runs no Java workers): 45 MB less to carry. The last part also holds MANIFEST (wheel, distribution,
# policy) and SHA256SUMS (every part), which install_stack.py checks before it unpacks anything.
# Environment: PART_MB (56), XZ_LEVEL (6), XZ_THREADS (2), PYTHON (python3), TE_WHEELS (the folder holding the
# transformer_engine_torch 2.20.2 wheel built from its sdist against torch 2.11.0+cu130: docs/gpu.md says how).
set -euo pipefail
out=${1:?usage: bundle_stack.sh OUT_DIR}
part_mb=${PART_MB:-56}
here=$(cd "$(dirname "$0")" && pwd)
te_wheels=${TE_WHEELS:-$here/../../../shared/gpu/wheels}  # default: where this project's build machine keeps it
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for n in 34 28 27 26 24 17 12 5; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

# name==version of every line but transformer-engine-torch (built from its sdist: $TE_WHEELS)
mapfile -t reqs < <(grep -v '^#' "$here/stack_requirements.txt" | awk 'NF {print $1}' | grep -v '^transformer-engine-torch==')
echo "downloading ${#reqs[@]} wheels (no dependency resolution: stack_requirements.txt is the closure)"
"$py" -m pip download -q --no-deps "${plat[@]}" -d "$tmp/dl" "${reqs[@]}" 2> >(grep -v "is ignored" >&2)
cp "$te_wheels"/transformer_engine_torch-2.20.2-*.whl "$tmp/dl/"

mkdir -p "$tmp/stored" "$tmp/meta"
"$py" - "$here/stack_requirements.txt" "$tmp/dl" "$tmp/stored" "$tmp/meta/MANIFEST" <<'EOF'
"""Check the wheel set against the list (one wheel per line, right version), rewrite each uncompressed, write MANIFEST."""
import copy, re, shutil, sys, zipfile
from pathlib import Path

reqs_file, src, dst, manifest = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
want = {}
for line in reqs_file.read_text().splitlines():
    if line.strip() and not line.startswith("#"):
        spec, policy = line.split()
        name, version = spec.split("==")
        assert policy in ("always", "if-missing"), line
        want[norm(name)] = (name, version, policy)
wheels = {}
for whl in sorted(src.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    if norm(name) in wheels:
        sys.exit(f"bundle: two wheels of {name}: {wheels[norm(name)].name} and {whl.name}")
    if norm(name) not in want:
        sys.exit(f"bundle: {whl.name} is not in {reqs_file.name}")
    if version != want[norm(name)][1]:
        sys.exit(f"bundle: {whl.name} is not version {want[norm(name)][1]}")
    wheels[norm(name)] = whl
missing = sorted(want[n][0] for n in set(want) - set(wheels))
if missing:
    sys.exit(f"bundle: no wheel for {missing}")
# Dropped members: Ray's Java jar and the dashboard's web client (dashboard off, no Java workers).
DROP = {"ray": ("ray/jars/", "ray/dashboard/client/build/")}
rows = []
for key, whl in sorted(wheels.items()):
    drop = DROP.get(key, ())
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(dst / whl.name, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if info.filename.startswith(drop):
                continue
            out = copy.copy(info)
            out.compress_type = zipfile.ZIP_STORED
            with zin.open(info) as r, zout.open(out, "w", force_zip64=info.file_size > 2**31) as w:
                shutil.copyfileobj(r, w, 1 << 22)
    rows.append(f"{whl.name}\t{want[key][0]}\t{want[key][2]}")
manifest.write_text("\n".join(rows) + "\n")
mib = sum(w.stat().st_size for w in wheels.values()) / 2**20
print(f"bundle: {len(wheels)} wheels, {mib:.1f} MiB as downloaded, {sum(f.stat().st_size for f in dst.iterdir()) / 2**20:.1f} MiB stored")
EOF

echo "compressing with xz -${XZ_LEVEL:-6} (tens of minutes on 2 cores: ~3.5 GB of wheels, most of it CUDA kernels)"
rm -rf "$out"; mkdir -p "$out"
(cd "$tmp/stored" && tar cf - --sort=name *.whl) | xz "-${XZ_LEVEL:-6}" -T"${XZ_THREADS:-2}" -c \
  | split -b "${part_mb}m" -d -a 2 - "$out/stack.tar.xz."
i=0; for f in "$out"/stack.tar.xz.*; do i=$((i+1)); mkdir -p "$out/part$i"; mv "$f" "$out/part$i/"; done
for d in "$out"/part*/; do (cd "$d" && sha256sum stack.tar.xz.*); done | sort -k2 > "$out/part$i/SHA256SUMS"
cp "$tmp/meta/MANIFEST" "$out/part$i/MANIFEST"
echo "bundle: $i parts under $out ($(du -sch "$out"/part*/stack.tar.xz.* | tail -1 | cut -f1) compressed); the last"
echo "        part holds MANIFEST and SHA256SUMS"
