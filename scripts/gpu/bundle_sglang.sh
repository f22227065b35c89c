#!/usr/bin/env bash
# Build an offline wheel bundle of SGLang 0.5.16 for the GPU machine (Python 3.12, torch 2.11.0+cu130, triton 3.6.0,
# transformers 5.17, no package index), as parts of at most PART_MB MiB (default 58) that travel one per call.
#
# usage: scripts/gpu/bundle_sglang.sh OUT_DIR        (e.g. .bundle_sglang: ignored by the repo's /.bundle*/ rule)
#        then on the GPU machine: bash OUT_DIR/partN/install_sglang_bundle.sh PARTS_DIR [TARGET]
#
# What goes in (exact versions, resolved on 2026-11-22 by `pip install --dry-run --report` for sglang==0.5.16 on
# cp312 manylinux x86-64): only what the server imports on `python -m sglang.launch_server` + `/generate` for a
# Qwen3-VL checkpoint on a Hopper GPU and the GPU machine lacks (its package list: /work/.library/device/KINDS.md).
# Checked against the 0.5.16 wheel's source by a static import trace from sglang.launch_server, the HTTP server,
# the tokenizer/detokenizer managers, the scheduler, the model runner, the fa3 attention backend, the sampler, the
# model loader and sglang/srt/models/qwen3_vl.py (module-level imports followed; try- and function-level ones read):
#
#   needed at import: sglang, sglang-kernel (sgl_kernel; its FA3 `flash_ops` is the default attention on Hopper),
#   flashinfer-python (imported by layers/sampler.py and layers/attention/vision.py) + apache-tvm-ffi (also runs
#   SGLang's JIT kernels, compiled with the machine's own nvcc), xgrammar (server_args -> function_call_parser ->
#   inkling_detector), transformers==5.12.1 (pinned by sglang; the machine has 5.17) + tokenizers 0.22.2 (5.12.1
#   needs <=0.23.0), openai, fastapi/starlette/uvicorn/python-multipart, pydantic 2, jsonschema, compressed-tensors,
#   gguf, IPython (sglang/utils.py), soundfile, msgspec, orjson, pybase64, pyzmq, setproctitle, zstandard,
#   partial-json-parser, dill, torch_memory_saver (--enable-memory-saver), and their own requirements.
#
#   left out (imported only on paths a bf16 Qwen3-VL server on Hopper does not take):
#     tilelang, z3-solver             DeepSeek sparse-attention (DSA/DSV4) kernels, function-level imports
#     tokenspeed-mla, tokenspeed-triton   the tokenspeed MLA attention backend (MLA models / explicit flag)
#     nvidia-cutlass-dsl(-libs-*), nvidia-cuda-nvdisasm, flash-attn-4, quack-kernels
#                                     CuTe-DSL kernels: FA4, Blackwell GDN/KDA, DSA; none is imported for Qwen3-VL
#     nvidia-cuda-nvcc/-nvvm/-crt/-cccl, nvidia-mathdx, cuda-tile, nvidia-cudnn-frontend
#                                     JIT toolchains and headers: SGLang's and FlashInfer's JIT use the machine's
#                                     CUDA 13.0 (CUDA_HOME or nvcc on PATH); cudnn is a try-import in flashinfer
#     sgl-deep-gemm                   FP8 GEMMs; absent => ENABLE_JIT_DEEPGEMM is False (layers/deep_gemm_wrapper)
#     helion, humming-kernels         Inkling MoE and humming quantization only
#     kernels, kernels-data           FA3 from the HF hub (no network there); SGLang falls back to sgl-kernel's FA3,
#                                     and run_sglang_checks.sh sets SGLANG_USE_SGL_FA3_KERNEL=1
#     outlines(-core), llguidance, interegular, lark, airportsdata, diskcache, nest-asyncio
#                                     non-default grammar backends (the default is xgrammar)
#     openai-harmony                  /v1/responses only, loaded in a try/except (the route is disabled)
#     anthropic, httpx2, httpcore2, truststore, docstring-parser   sglang.lang's Anthropic backend only
#     modelscope(-hub), cryptography  only with SGLANG_USE_MODELSCOPE
#     datasets, multiprocess, blobfile, pycryptodomex   eval scripts, Azure connector
#     mistral-common, pycountry, pydantic-extra-types   the Voxtral model only
#     torchao (only with --torchao-config), torchcodec (video decoding), easydict, watchfiles (TLS reload), py-spy,
#     smg-grpc-*, grpcio-* (gRPC server), cuda-python (a meta package: cuda-bindings is there), torch-c-dlpack-ext
#     (torch 2.11 has the DLPack exchange API already), tzdata; sglang's pins timm==1.0.16 and numba==0.65.1 are
#     not carried (the machine's own are used; neither is imported for Qwen3-VL)
#   already on the machine (not carried): torch, triton, torchvision, torchaudio, numpy, scipy, pillow, safetensors,
#     huggingface-hub, einops, jinja2, aiohttp, requests, psutil, prometheus-client, uvloop, sentencepiece, tiktoken,
#     nvidia-ml-py, ninja, cuda-bindings, pyyaml, tqdm, packaging, filelock, regex, click, h11, httpx, ...
#
# Size: the wheels are rewritten uncompressed (ZIP_STORED; same files, same RECORD) and the tar of them is
# compressed with xz, which packs sgl-kernel's 1.1 GB of CUDA kernels about 3x smaller than the wheels' deflate.
# Nothing is built from an sdist: every package here has a manylinux or pure-Python wheel. Built 2026-11-22 on 2 CPU
# cores in 27 min (xz): 55 wheels, 475 MiB as downloaded (1.6 GB installed), 4 parts, 221 MiB in all.
set -euo pipefail
out=${1:?usage: bundle_sglang.sh OUT_DIR}
part_mb=${PART_MB:-58}
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for n in 34 28 27 26 24 17 12 5; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

reqs=(
  sglang==0.5.16 sglang-kernel==0.4.5 flashinfer-python==0.6.14 apache-tvm-ffi==0.1.11 xgrammar==0.2.1
  transformers==5.12.1 tokenizers==0.22.2 torch-memory-saver==0.0.10
  openai==2.6.1 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 anyio==4.16.0
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 python-multipart==0.0.34
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  compressed-tensors==0.20.0 loguru==0.7.3 gguf==0.19.0
  msgspec==0.22.0 orjson==3.13.0 pybase64==1.5.1 pyzmq==27.3.0 setproctitle==1.3.8 zstandard==0.25.0
  partial-json-parser==0.2.1.1.post7 dill==0.4.1 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
  ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2
  pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 stack-data==0.6.3 asttokens==3.0.2 executing==2.3.0
  pure-eval==0.2.4 traitlets==5.16.1 wcwidth==0.9.4
)

echo "downloading ${#reqs[@]} wheels (no dependencies resolved: the list above is the closure)"
"$py" -m pip download -q --no-deps "${plat[@]}" -d "$tmp/dl" "${reqs[@]}" 2> >(grep -v "is ignored" >&2)

# Exactly one wheel per requirement: two versions of one package would stop the install.
"$py" - "$tmp/dl" "${reqs[@]}" <<'EOF'
import re, sys
from pathlib import Path
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
names = [norm(w.name.split("-")[0]) for w in wheels]
want = [norm(r.split("==")[0]) for r in sys.argv[2:]]
dupes = {n for n in names if names.count(n) > 1}
missing = set(want) - set(names)
extra = set(names) - set(want)
if dupes or missing or extra or any(w.suffix != ".whl" for w in wheels):
    sys.exit(f"bundle: wrong wheel set: duplicates {sorted(dupes)}, missing {sorted(missing)}, extra {sorted(extra)}")
print(f"bundle: {len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB as downloaded")
EOF

# Rewrite every wheel uncompressed: identical members (RECORD hashes are over the file contents, so the wheels stay
# valid), but xz then sees the raw bytes.
mkdir -p "$tmp/stored"
"$py" - "$tmp/dl" "$tmp/stored" <<'EOF'
import copy, shutil, sys, zipfile
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for whl in sorted(src.glob("*.whl")):
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(dst / whl.name, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            out = copy.copy(info)
            out.compress_type = zipfile.ZIP_STORED
            with zin.open(info) as r, zout.open(out, "w", force_zip64=info.file_size > 2**31) as w:
                shutil.copyfileobj(r, w, 1 << 22)
    with zipfile.ZipFile(dst / whl.name) as check:
        bad = check.testzip()
        assert bad is None, f"{whl.name}: {bad} is damaged after rewriting"
EOF

echo "compressing with xz (minutes: the CUDA kernels are ~1.5 GB uncompressed)"
rm -rf "$out"; mkdir -p "$out"
(cd "$tmp/stored" && tar cf - --sort=name *.whl) | xz -9 -T"${XZ_THREADS:-2}" -c | split -b "${part_mb}m" -d -a 2 - "$out/sglang.tar.xz."
i=0; for f in "$out"/sglang.tar.xz.*; do i=$((i+1)); mkdir -p "$out/part$i"; mv "$f" "$out/part$i/"; done
cp "$here/install_sglang_bundle.sh" "$out/part$i/"
(cd "$tmp/dl" && ls -l *.whl | awk '{printf "%10d  %s\n", $5, $9}') > "$out/part$i/WHEELS.txt"
for d in "$out"/part*/; do (cd "$d" && sha256sum sglang.tar.xz.*); done | sort -k2 > "$tmp/SHA256SUMS"
mv "$tmp/SHA256SUMS" "$out/part$i/SHA256SUMS"
echo "bundle: $i parts under $out ($(du -sch "$out"/part*/sglang.tar.xz.* | tail -1 | cut -f1) compressed); the last part holds"
echo "        install_sglang_bundle.sh, WHEELS.txt and SHA256SUMS"
