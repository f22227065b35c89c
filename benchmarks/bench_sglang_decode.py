"""Decode throughput of a real SGLang 0.5.16 server against the embedded `hf` engine, same GPU, same prompts.

    PYTHONPATH=. python benchmarks/bench_sglang_decode.py [--batch 64] [--max-new-tokens 256] [--ckpt DIR]
    PYTHONPATH=. python benchmarks/bench_sglang_decode.py --tiny     # tiny model, 4 prompts, 16 tokens: a GPU smoke run

Needs CUDA and an importable `sglang` (scripts/gpu/run_sglang_checks.sh installs the bundle and runs this).

Model: random-init Qwen3-VL with the Qwen3-VL-2B shapes, bf16, written by scripts/gpu/make_tiny_qwen3vl.py
(`--shape 2b`: real 151936-row embedding, the offline 590-token processor), or `--ckpt`. Both engines load that
same directory. Prompts: `--batch` geo3k-like synthetic problems (miles_vl.data.synth), one 256x256 image each,
built by miles_vl.data's prompt encoder with a pixel range that gives ~196 vision tokens per image (SGLang decodes
prompt ids to text and re-runs the processor, so prompts must come from the real tokenizer, not random ids).
One response per prompt, `--max-new-tokens` tokens each, EOS ignored: SGLang requests carry `ignore_eos`; the hf
engine gets a banned vision token as its only EOS id (as in bench_decode.py). Every response is checked to have
exactly `--max-new-tokens` tokens and, for SGLang, to have used our prompt ids.

`--shapes GROUP:MODE,...` asks for the batch as the RL loop does: batch / GROUP prompts with GROUP samples each
(rollout.batch_size x n_samples_per_prompt), sent as one request per sample (`single`) or one request per prompt
with `sampling_params.n = GROUP` (`n`, the engine's default): SGLang then processes each prompt's image once. One
server per variant measures every shape (a row each).

Measured per engine (medians of `--repeats`, the SGLang radix cache flushed before every timed call so that each
call prefills in full):
- engine tokens/s = batch * N / wall time of one call for N new tokens (prefill, image processing, decode);
- decode tokens/s = batch * (N - 1) / (t(N) - t(1)): the decode steps alone (prefill and per-call work cancel).
For SGLang, t is the wall time of `batch` concurrent `/generate` requests (HTTP, image decoding and processing on
the server included); for hf, the time of `model.generate` inside `HFRolloutEngine.generate` (bench_decode.py's
definition), with cuDNN SDPA off (its faster setting on H100, docs/benchmarks.md). The SGLang server is stopped
before the hf model is loaded. The memory-bandwidth bound is bench_decode.py's (text weights read once per step).
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(REPO), str(REPO / "benchmarks")) if p not in sys.path]

from bench_decode import copy_bandwidth, decode_rates, timed_generate  # noqa: E402
from bench_train_throughput import sync  # noqa: E402

from miles_vl.data import PromptEncoder, generate_problems, load_processor  # noqa: E402
from miles_vl.models import SpecialTokens  # noqa: E402
from miles_vl.models.qwen3_vl.model import build_model  # noqa: E402
from miles_vl.models.qwen3_vl.tokens import special_tokens  # noqa: E402
from miles_vl.rollout import HFRolloutEngine, SamplingParams  # noqa: E402
from miles_vl.rollout.sglang import SGLANG_LAUNCH_MODULE, RequestPolicy, ServerSpec, SGLangRolloutHost  # noqa: E402
from miles_vl.rollout.sglang.generate import (  # noqa: E402
    PromptMedia,
    batch_payload,
    build_generate_payload,
    parse_generate_response,
)
from miles_vl.rollout.sglang.server import free_port  # noqa: E402
from miles_vl.sglang_plugin.settings import PluginSettings  # noqa: E402

MIN_PIXELS, MAX_PIXELS = 192 * 32 * 32, 256 * 32 * 32  # a 256x256 image becomes 448x448: 196 vision tokens
SERVER_ENV = {"SGLANG_USE_SGL_FA3_KERNEL": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Server variants (`--variants`): (extra flags, extra environment, whether requests carry `mm_hashes`, launch module,
# the settings of miles_vl's SGLang plugin: None = SGLang's own server).
# What each changes in 0.5.16's multimodal path (srt/multimodal/processors/base_processor.py, srt/managers/mm_utils.py,
# srt/managers/schedule_batch.py):
#   v0516       0.5.16 as shipped (what miles_vl ran before commit 437158a): pixel values sha256-hashed in the
#               scheduler process, once for every request and, with `sampling_params.n`, once for every copy
#   default     SGLang's own launch_server with miles_vl's request settings: SGLANG_MM_PRECOMPUTE_HASH=1 (the tokenizer
#               hashes once per request, before the `n` copies are made) and `mm_hashes` (our hash of the image bytes:
#               no pixel hash at all for n = 1); what the engine ran until `share` became its default
#   nopix       default + sglang_copies_without_pixels.py (the first prototype of `share`, without its scheduler half):
#               the `n` copies go to the scheduler without pixel values (their prompt is in the prefix cache)
#   cuda_ipc    `--mm-feature-transport cuda_ipc`: pixel values stay on the GPU, hashed there, handed over by CUDA IPC
#               (crashed the scheduler on an H100, 2026-11-23: `torch.cat` of image features on cuda:0 and cpu in
#               qwen3_vl.py get_image_feature, once the IPC pool fell back to the CPU for some images)
#   cuda_ipc_big  cuda_ipc with an 8 GiB pool (SGLANG_MM_FEATURE_CACHE_MB=8192, 1 GiB by default): does the crash
#               above come only from the pool running full? (H100, 2026-11-24: the server failed its own warm-up,
#               `CUDA error: invalid device context` rebuilding the IPC tensor in the tokenizer to hash it)
#   skip_hash   SGLANG_MM_SKIP_COMPUTE_HASH=1: a random id instead of the content hash (no prefix sharing of images)
#   timed       default, with benchmarks/sglang_timing/sitecustomize.py timing the tokenizer's and the scheduler's
#               steps into $OUT/sglang_timing_<variant>.jsonl (with this script's call markers): where t(1) goes
#   share       default, with miles_vl's SGLang plugin (the engine's default): the `n` copies reach the
#               scheduler without pixel values and get their prompt's tensor back there; a request's prefixes go out
#               as they are tokenized and all its copies in one message (shape `batch`: all prompts in one request)
#   share_nogroup  share with the plugin's group_copies off: 0.5.16's order of prefixes and copies (the launcher
#               of 2026-11-24, before the copies went in one message)
#   tok4, tok8  default + `--tokenizer-worker-num 4` / `8`: that many tokenizer processes (uvicorn workers) share the
#               per-request work (PNG decode, image processor, hash, the `n` copies' transfer to the scheduler);
#               connections are spread over them by the kernel
#   timed_share  timed, with the plugin: the breakdown of share
#   pixels      share, with each prompt sent as its canonical ids and its own pixel values (processor_output items whose
#               pixels are files of the host's directory, in the model's dtype): no PNG decoding, no second run of the
#               image processor, no re-tokenization in the server; the engine's default since 2026-11-25
#   timed_pixels  timed, the plugin, pixel values: the breakdown of pixels
#   pixels_inline  pixels through sglang_launch_inline_prefixes.py: a batch message's pixel tensors pickled into it
#               (each its own tensor) instead of moved into shared memory one segment each
#               (since 2026-11-26 with the hand-over below: one-image items carry the engine's hash, pixel files
#               reach the scheduler by a second name, the scheduler copies a receive's pixels out in threads)
#   pixels_prev  pixels as before that hand-over: no item hash (SGLang's tokenizer SHA-256es each image), pixel files
#               copied into new segments (the plugin's link_pixels off), one request's copy out after another
#               (receive_threads 1); its `n` copies are built while the prefixes prefill, as in pixels
#   graphs      pixels with the vision tower's CUDA graphs (the plugin's vision_graphs 4: a layout of images is
#               captured at its second sighting, then replayed; miles_vl.sglang_plugin.vision.VisionGraphs), opt-in
#               through rollout.sglang.vision_cuda_graphs (`pixels` is the same server with the tower eager)
#   timed_graphs  timed, graphs: the breakdown of graphs (the timing hook's syncs skip a graph's capture)
# (PNG data URLs, hashes and pixel files are made once per server before its calls, outside the timed calls.)
BENCH_DIR = str(Path(__file__).resolve().parent)
REQUESTS = {
    "single": "one per sample",
    "n": "one per prompt (sampling_params.n)",
    "batch": "one for all prompts (sampling_params.n each)",
}


@dataclass(frozen=True)
class Variant:
    flags: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    hashes: bool = True  # requests carry mm_hashes (PNG images only)
    launch_module: str = SGLANG_LAUNCH_MODULE
    plugin: PluginSettings | None = None  # miles_vl's SGLang plugin, opted in with these settings
    pixels: bool = False  # prompts as ids + pixel values (miles_vl's plugin reads them)
    item_hash: bool = True  # one-image processor_output items keep the engine's `hash` (pixels only)


TIMED_ENV = {"PYTHONPATH": "sglang_timing", "MILES_VL_SGLANG_TIMING": "sglang_timing.jsonl"}
PLUGIN = PluginSettings()  # the host's defaults (rollout.sglang.launcher: miles_vl)
VARIANTS = {
    "v0516": Variant(env={"SGLANG_MM_PRECOMPUTE_HASH": "0"}, hashes=False),
    "default": Variant(),
    "nopix": Variant(launch_module="sglang_copies_without_pixels"),
    "cuda_ipc": Variant(flags=("--mm-feature-transport", "cuda_ipc")),
    "cuda_ipc_big": Variant(flags=("--mm-feature-transport", "cuda_ipc"), env={"SGLANG_MM_FEATURE_CACHE_MB": "8192"}),
    "skip_hash": Variant(env={"SGLANG_MM_SKIP_COMPUTE_HASH": "1"}, hashes=False),
    "timed": Variant(env=TIMED_ENV),
    "share": Variant(plugin=PLUGIN),
    "share_nogroup": Variant(plugin=PluginSettings(group_copies=False)),
    "timed_share": Variant(env=TIMED_ENV, plugin=PLUGIN),
    "pixels": Variant(plugin=PLUGIN, pixels=True),
    "timed_pixels": Variant(env=TIMED_ENV, plugin=PLUGIN, pixels=True),
    "pixels_inline": Variant(launch_module="sglang_launch_inline_prefixes", plugin=PLUGIN, pixels=True),
    "pixels_prev": Variant(plugin=PluginSettings(link_pixels=False, receive_threads=1), pixels=True, item_hash=False),
    "graphs": Variant(plugin=PluginSettings(vision_graphs=4), pixels=True),
    "timed_graphs": Variant(env=TIMED_ENV, plugin=PluginSettings(vision_graphs=4), pixels=True),
    "tok4": Variant(flags=("--tokenizer-worker-num", "4")),
    "tok8": Variant(flags=("--tokenizer-worker-num", "8")),
}


@dataclass(frozen=True)
class Shape:
    """How a batch of sequences is asked for: `group` samples of each of batch / group prompts (GRPO's shape:
    rollout.batch_size x n_samples_per_prompt), sent as one request per sample ("single"), one request per
    prompt with sampling_params.n = group ("n": the engine with SGLang's own launch_server), or one request for all
    the prompts, each with sampling_params.n = group ("batch": the engine with miles_vl's plugin,
    `prompts_per_request`)."""

    group: int
    mode: str

    @classmethod
    def parse(cls, text: str) -> Shape:
        group, _, mode = text.partition(":")
        if not group.isdigit() or int(group) < 1 or mode not in ("single", "n", "batch"):
            raise argparse.ArgumentTypeError(f"{text!r}: expected GROUP:single, GROUP:n or GROUP:batch, e.g. 8:n")
        return cls(int(group), mode)


@dataclass
class Prompt:
    """A canonical prompt (satisfies `SGLangPrompt`): ids, vision inputs, and the images SGLang re-processes."""

    prompt_ids: torch.Tensor  # [L] long
    pixel_values: torch.Tensor  # [n_patches, 1536]
    image_grid_thw: torch.Tensor  # [1, 3]
    images: list
    pixel_values_videos: torch.Tensor | None = None  # no videos
    video_grid_thw: torch.Tensor | None = None


def build_prompts(processor, n: int, seed: int) -> list[Prompt]:
    encoder = PromptEncoder(processor, instruction="Let's think step by step and output the final answer in \\boxed{}.")
    out = []
    for p in generate_problems(n, seed=seed):
        enc = processor(text=[encoder.render(p.problem)], images=[p.image], return_tensors="pt")
        out.append(Prompt(enc["input_ids"][0].long(), enc["pixel_values"], enc["image_grid_thw"].long(), [p.image]))
    return out


# -------------------------------------------------------------------------------------------------------------------
# SGLang


def sglang_call(
    host: SGLangRolloutHost,
    prompts,
    media: list[PromptMedia],
    tokens: SpecialTokens,
    n: int,
    temperature: float,
    seed: int,
    shape: Shape,
    hashes: bool,
    timing: str | None = None,
):
    """(wall seconds, output lengths) of one batch of concurrent `/generate` requests, after a cache flush: the first
    `len(prompts) // shape.group` prompts, `shape.group` samples each, as one request per sample, one per prompt, or
    one for all (`Shape`)."""
    k = len(prompts) // shape.group
    per_request = 1 if shape.mode == "single" else shape.group
    payloads = []
    for i in range(k):
        m = media[i]  # the engine's own request form: PNG data URLs and hashes, or pixel values (generate.py)
        body = build_generate_payload(
            m.input_ids,
            m.image_data,
            SamplingParams(max_new_tokens=n, temperature=temperature),
            seed=seed + i,
            stop_token_ids=tokens.eos_token_ids,
            banned_token_ids=host.engine.banned_token_ids,
            n=per_request,
            image_hashes=m.mm_hashes if hashes else (),
            video_data=m.video_data,
        )
        body["sampling_params"]["ignore_eos"] = True  # 0.5.16: no token-based stop at all (EOS nor stop_token_ids)
        payloads += [((i,), body)] * (shape.group // per_request)
    if shape.mode == "batch" and k > 1:
        payloads = [(tuple(range(k)), batch_payload([body for _, body in payloads]))]

    def post(item):
        indices, body = item
        if per_request == 1:
            return [(indices[0], host.client.generate(body))]
        answers = host.client.generate_n(body, per_request * len(indices))  # prompt by prompt
        return [(indices[j // per_request], b) for j, b in enumerate(answers)]

    host.client.flush_cache(timeout_s=60)
    with ThreadPoolExecutor(max_workers=len(payloads)) as pool:
        t0 = time.perf_counter()
        start = time.time()
        answers = [a for group in pool.map(post, payloads) for a in group]
        wall = time.perf_counter() - t0
    if timing:  # the call's span, beside the server's own timings (sglang_timing/sitecustomize.py)
        with open(timing, "a") as f:
            mark = dict(what="bench.call", start=start, t=start + wall, ms=wall * 1e3, new_tokens=n)
            f.write(json.dumps(mark | dict(group=shape.group, mode=shape.mode)) + "\n")
    lengths = []
    for i, body in answers:
        gen, _ = parse_generate_response(  # also checks that SGLang used our prompt ids
            body,
            prompt_ids=prompts[i].prompt_ids.tolist(),
            stop_token_ids=tokens.eos_token_ids,
            max_new_tokens=n,
            prompt_index=i,
        )
        lengths.append(gen.response_ids.numel())
    if len(lengths) != len(prompts):
        raise RuntimeError(f"SGLang: {len(lengths)} responses for {len(prompts)} sequences")
    return wall, lengths


def bench_sglang(
    args, ckpt: str, prompts, tokens: SpecialTokens, variant: str = "default", log_name: str | None = None
) -> list[dict]:
    """One server of this variant (its log `sglang_bench_<log_name or variant>.log`); a row per `--shapes` entry."""
    b, n = len(prompts), args.max_new_tokens
    v = VARIANTS[variant]
    flags, env, hashes, launch_module = v.flags, v.env, v.hashes, v.launch_module
    if launch_module != SGLANG_LAUNCH_MODULE:  # a prototype launcher in benchmarks/
        env = env | {"PYTHONPATH": os.pathsep.join(p for p in (BENCH_DIR, os.environ.get("PYTHONPATH")) if p)}
    elif "PYTHONPATH" in env:  # a directory of benchmarks/ first on the server's path (the timing sitecustomize)
        first = os.path.join(BENCH_DIR, env["PYTHONPATH"])
        env = env | {"PYTHONPATH": os.pathsep.join(p for p in (first, os.environ.get("PYTHONPATH")) if p)}
    timing = None
    if "MILES_VL_SGLANG_TIMING" in env:  # the timing file, in $OUT when there is one, one per server
        name = env["MILES_VL_SGLANG_TIMING"].replace(".jsonl", f"_{log_name or variant}.jsonl")
        timing = os.path.join(os.environ.get("OUT") or tempfile.gettempdir(), name)
        env = env | {"MILES_VL_SGLANG_TIMING": timing}
    spec = ServerSpec(
        model_path=ckpt,
        port=free_port("127.0.0.1"),
        mem_fraction_static=args.mem_fraction,
        random_seed=args.seed,
        image_min_pixels=MIN_PIXELS,
        image_max_pixels=MAX_PIXELS,
        plugin=v.plugin,
        extra_args=(
            "--cuda-graph-max-bs-decode",
            str(max(8, b)),
            "--max-running-requests",
            str(max(8, b)),
            "--context-length",
            "4096",
            "--grammar-backend",
            "none",
            *flags,
        ),
    )
    t0 = time.perf_counter()
    log_dir = os.environ.get("OUT")
    host = SGLangRolloutHost(
        spec,
        tokens,
        startup_timeout_s=args.startup_timeout,
        requests=RequestPolicy(timeout_s=300.0, max_retries=0),
        max_restarts=0,
        log_path=Path(log_dir) / f"sglang_bench_{log_name or variant}.log" if log_dir else None,
        env=SERVER_ENV | env,
        launch_module=launch_module,
        send_pixel_values=v.pixels,
        health_poll_s=0.5,
    )
    startup_s = time.perf_counter() - t0
    if pidfile := os.environ.get("MILES_VL_SGLANG_PIDFILE"):  # lets scripts/gpu/run_sglang_checks.sh stop a leftover
        with open(pidfile, "a") as f:
            f.write(f"{host.server.pid}\n")
    rows = []
    try:
        t0 = time.perf_counter()
        media = host.engine.prompt_media(prompts)  # the pixel files live as long as the server (its host removes them)
        media_s = time.perf_counter() - t0  # the engine's part before a call (its hashes included), outside t(1)
        if not v.item_hash:
            for m in media:
                for item in m.image_data:
                    if isinstance(item, dict):
                        item.pop("hash", None)
        for shape in args.shapes:
            call = partial(
                sglang_call,
                host,
                prompts,
                media,
                tokens,
                temperature=args.temperature,
                shape=shape,
                hashes=hashes,
                timing=timing,
            )
            for _ in range(2):  # warm-up: twice, as the vision graphs capture a layout of images at its second sighting
                call(4, seed=args.seed)
            short = [call(1, seed=args.seed)[0] for _ in range(args.repeats)]
            runs = [call(n, seed=args.seed + k) for k in range(args.repeats)]
            lengths = {length for _, ls in runs for length in ls}
            if lengths != {n}:
                raise RuntimeError(f"SGLang: not every request decoded {n} tokens: {sorted(lengths)}")
            wall = statistics.median(w for w, _ in runs)
            t1 = statistics.median(short)
            rows.append(
                dict(
                    variant=variant,
                    request_form="pixel values" if v.pixels else "PNG images",
                    prompts=b // shape.group,
                    group=shape.group,
                    requests=REQUESTS[shape.mode],
                    startup_s=round(startup_s, 1),
                    media_ms=round(media_s * 1e3, 1),
                    wall_s=round(wall, 3),
                    prefill_s=round(t1, 3),
                    **decode_rates(b, n, wall_s=wall, generate_s=wall, prefill_s=t1),
                )
            )
            print(f"[sglang {variant}] {json.dumps(rows[-1])}", flush=True)
    finally:
        host.shutdown()
    return rows


# -------------------------------------------------------------------------------------------------------------------
# hf


def bench_hf(args, ckpt: str, prompts, tokens: SpecialTokens) -> tuple[dict, torch.nn.Module]:
    b, n = len(prompts), args.max_new_tokens
    model = build_model(tokens, path=ckpt, dtype=torch.bfloat16, device="cuda")
    engine_tokens = replace(tokens, eos_token_ids=(tokens.vision_end_token_id,))  # banned below: EOS never sampled
    engine = HFRolloutEngine(model, engine_tokens, max_batch_size=b, ban_vision_tokens=True)
    assert tokens.vision_end_token_id in engine.banned

    def params(k: int, seed: int = args.seed) -> SamplingParams:
        return SamplingParams(n=1, max_new_tokens=k, temperature=args.temperature, seed=seed)

    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        timed_generate(engine, prompts, params(4))  # warm-up
        short = [timed_generate(engine, prompts, params(1))[1] for _ in range(args.repeats)]
        runs = [timed_generate(engine, prompts, params(n, args.seed + k)) for k in range(args.repeats)]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    lengths = {len(g[0].response_ids) for r in runs for g in r[2]}
    if lengths != {n}:
        raise RuntimeError(f"hf: not every sequence decoded {n} tokens: {sorted(lengths)}")
    wall = statistics.median(r[0] for r in runs)
    gen = statistics.median(r[1] for r in runs)
    t1 = statistics.median(short)
    result = dict(
        sdpa="no_cudnn",
        wall_s=round(wall, 3),
        generate_s=round(gen, 3),
        prefill_s=round(t1, 3),
        **decode_rates(b, n, wall_s=wall, generate_s=gen, prefill_s=t1),
    )
    return result, model


# -------------------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (default: write the 2b shape to a temp dir)")
    ap.add_argument("--tiny", action="store_true", help="tiny model, 4 prompts, 16 tokens (GPU smoke run)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mem-fraction", type=float, default=0.5, help="SGLang --mem-fraction-static")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds the SGLang server may take to start")
    ap.add_argument("--engines", default="sglang,hf", help="which engines to measure, in order")
    ap.add_argument(
        "--variants", default="default", help=f"SGLang server variants to measure, in order: {', '.join(VARIANTS)}"
    )
    ap.add_argument(
        "--shapes",
        type=lambda text: [Shape.parse(t) for t in text.split(",")],
        default=[Shape(1, "single")],
        help="GROUP:MODE,... : batch / GROUP prompts with GROUP samples each, one request per sample (single), per "
        "prompt (n) or for all prompts (batch); default 1:single (every sequence its own prompt)",
    )
    ap.add_argument("--copy-gib", type=float, default=2.0, help="size of the bandwidth-measuring copy")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sglang_decode: needs CUDA (SGLang serves on a GPU)")
    engines = args.engines.split(",")
    if unknown := set(engines) - {"sglang", "hf"}:
        raise SystemExit(f"--engines: unknown {sorted(unknown)}; use sglang and/or hf")
    if args.tiny:
        args.batch, args.max_new_tokens, args.repeats = 4, 16, 1
    if bad := [sh.group for sh in args.shapes if args.batch % sh.group]:
        raise SystemExit(f"--shapes: group sizes {bad} do not divide --batch {args.batch}")
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {sorted(VARIANTS)}")

    spec = importlib.util.spec_from_file_location(
        "make_tiny_qwen3vl", REPO / "scripts" / "gpu" / "make_tiny_qwen3vl.py"
    )
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    ckpt = args.ckpt
    if ckpt is None:
        ckpt = tempfile.mkdtemp(prefix="miles_vl_bench_ckpt_")
        t0 = time.perf_counter()
        writer.write_checkpoint(
            ckpt, shape="tiny" if args.tiny else "2b", seed=args.seed, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
        )
        print(f"[bench] wrote the checkpoint to {ckpt} in {time.perf_counter() - t0:.1f}s", flush=True)
        torch.cuda.empty_cache()

    processor = load_processor("offline", MIN_PIXELS, MAX_PIXELS)
    tokens = special_tokens(processor)
    prompts = build_prompts(processor, args.batch, args.seed)
    prompt_len = sum(p.prompt_ids.numel() for p in prompts) / len(prompts)

    results: dict[str, dict] = {}
    sglang_rows: list[dict] = []
    model = None
    for name in engines:
        t0 = time.perf_counter()
        if name == "sglang":
            for i, v in enumerate(variants):  # each row printed as it finishes; a failed variant is recorded
                before = variants[:i].count(v)
                log_name = f"{v}_{before + 1}" if before else v  # a variant again: its own log
                try:
                    sglang_rows += bench_sglang(args, ckpt, prompts, tokens, v, log_name)
                except Exception as e:  # noqa: BLE001 (the server's log says why; the JSON line says which)
                    sglang_rows.append(dict(variant=v, error=f"{type(e).__name__}: {str(e)[:300]}"))
                    print(f"[sglang {v}] {json.dumps(sglang_rows[-1])}", flush=True)
            ok = [r for r in sglang_rows if "error" not in r]
            if not ok:
                raise SystemExit(f"bench_sglang_decode: every SGLang variant failed: {sglang_rows}")
            results[name] = ok[0]
        else:
            results[name], model = bench_hf(args, ckpt, prompts, tokens)
        print(f"[{name}] {json.dumps(results[name])} ({time.perf_counter() - t0:.1f}s)", flush=True)

    if model is None:
        model = build_model(tokens, path=ckpt, dtype=torch.bfloat16, device="cuda")
    lm = model.model.language_model
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    if model.lm_head.weight is not lm.embed_tokens.weight:
        weight_bytes += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    sync(torch.device("cuda"))
    bandwidth = copy_bandwidth(torch.device("cuda"), int(args.copy_gib * 2**30))
    bound = args.batch * bandwidth / weight_bytes
    for r in [*results.values(), *[r for r in sglang_rows if "error" not in r and r is not results.get("sglang")]]:
        r["fraction_of_bound"] = round(r["decode_tokens_per_s"] / bound, 4)
        r["engine_over_decode"] = round(r["engine_tokens_per_s"] / r["decode_tokens_per_s"], 3)

    summary = dict(
        benchmark="sglang_vs_hf_decode",
        device=torch.cuda.get_device_name(0),
        dtype="bfloat16",
        model="tiny Qwen3-VL" if args.tiny else "Qwen3-VL-2B shapes, random init",
        batch=args.batch,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        mean_prompt_tokens=round(prompt_len, 1),
        vision_tokens_per_prompt=int(prompts[0].image_grid_thw.prod()) // 4,
        repeats=args.repeats,
        copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
        weight_bytes=weight_bytes,
        bound_tokens_per_s=round(bound, 1),
        sglang=results.get("sglang"),
        sglang_rows=sglang_rows,
        hf=results.get("hf"),
        sglang_over_hf_decode=(
            round(results["sglang"]["decode_tokens_per_s"] / results["hf"]["decode_tokens_per_s"], 2)
            if len(results) == 2
            else None
        ),
        sglang_over_hf_engine=(
            round(results["sglang"]["engine_tokens_per_s"] / results["hf"]["engine_tokens_per_s"], 2)
            if len(results) == 2
            else None
        ),
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
        sglang_version=_version("sglang"),
    )
    print(json.dumps(summary))


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
