"""A schema-level stand-in for an SGLang 0.5.16 server: the routes miles_vl calls, nothing else.

It validates request bodies against the 0.5.16 request classes (field names copied below from
`python/sglang/srt/managers/io_struct.py` and `python/sglang/srt/sampling/sampling_params.py` of the
`sglang==0.5.16` wheel), answers with 0.5.16's response shapes (`python/sglang/srt/entrypoints/http_server.py`,
`python/sglang/srt/managers/tokenizer_manager.py`), enforces 0.5.16's bearer auth (`python/sglang/srt/utils/auth.py`,
`sglang_authorizes`) and, as a process, logs its arguments with the API key as 0.5.16 does,
deserializes `/update_weights_from_tensor` payloads under 0.5.16's unpickling allowlist
(`SafeUnpickler` in `python/sglang/srt/utils/common.py`), and for the NCCL path joins the weight-update group the
way 0.5.16's `init_custom_process_group` does and receives one broadcast per tensor from rank 0. It is stricter than
SGLang in one way: unknown top-level request keys are refused (FastAPI would ignore them), to catch typos.

Images are taken as 0.5.16 takes them for Qwen3-VL (`expand_image_pads`): `input_ids` must hold one
`<|vision_start|><|image_pad|>+<|vision_end|>` block per image; more `<|image_pad|>` tokens than images is 0.5.16's
HTTP 500 (its processor raises StopIteration: "Internal Server Error", the reason in the server log); one pad per image
is expanded to that image's token count, from the PNG's size through Qwen's smart_resize (patch 16, merge 2, the
min/max pixels of `--mm-process-config`), and `prompt_token_ids` echoes the expanded ids. A batch (`input_ids` a list
of lists, `image_data` one list per prompt, `sampling_params` one dict or one per prompt, the same `n` for all) is
answered as 0.5.16 answers it: `prompts x n` bodies, prompt by prompt (`_batch_prompts`); a single prompt with
`n > 1` is a batch of one there, so its `image_data` must be one entry (0.5.16's ValueError, HTTP 400, otherwise).

Pixel values as 0.5.16 with miles_vl's SGLang plugin takes them (`miles_vl/sglang_plugin/`, the default server): a
prompt's `image_data` / `video_data` may be one `processor_output` item (0.5.16 refuses more than one item per modality
then, 400) whose pixel values are files in `$MILES_VL_SGLANG_PIXEL_DIR`; they are read with the plugin's own
`resolve_item` (the plugin is the server here; its reading is tested on its own, and the real server confirms the pair),
against the model dtype of `--dtype` (float32 without it: the stand-in's models run in float32, where 0.5.16 would run a
float32 checkpoint in float16), and the ids are used as sent (0.5.16's fast path for preprocessed input). The process
stand-in runs "with the plugin" where its environment opts in as the host does (`MILES_VL_SGLANG_PLUGIN`, parsed by the
plugin's own `from_env`), and then reports the plugin's marker in `/server_info` as the real plugin does; `--fake-stock`
makes it an install where the plugin does not load although asked for (no marker: the host must refuse it). Without the
plugin (`FakeState(launcher=False)`) such an item is what stock 0.5.16 makes of it: the file reference becomes the
item's feature, which its hashing cannot read (TypeError in the tokenizer: HTTP 500).

Weights as 0.5.16's Qwen3-VL takes them: a name the server does not know (the model's names with hf_server.py;
`FakeState.param_names` here, None = every name) is skipped without an error and only reported (log, journal,
`GET /_fake/skipped`); `/weights_checker` answers per-rank hashes under SGLang's parameter names (`sglang_parameter`:
fused `qkv_proj` / `gate_up_proj`, `visual.*`); `/get_weights_by_name` is refused with 400, as for Qwen3-VL. Flush,
release and resume follow 0.5.16's scheduler: a busy server is not flushed (400), and releasing while a request runs,
resuming memory that is not released, or loading weights (`/update_weights_from_tensor`) while the `weights` tag is
released (the KV cache may stay released) kills the server (`_die`). Faults (`inject`) add 5xx answers, delays, exits,
aborts (200 with an abort finish reason, or 400/500/503) and servers that ignore the weights they are sent.
`POST /abort_request` (`rid`, or `abort_all`) ends the samples the "hold" fault keeps decoding as 0.5.16 ends a running
request (`Handler._hold`: 200, finish reason abort, the output so far with its logprobs): partial rollouts.

The "model" draws output tokens from a generator seeded by the prompt, the weight version and, only when the server
runs with `--enable-deterministic-inference` (as 0.5.16, which otherwise ignores `sampling_seed`), the request's
sampling seed: without the flag two identical sampled requests differ. A response ends with the first stop token id
unless its drawn length exceeds max_new_tokens.
A real model can be plugged in instead (`FakeHTTPServer(model=...)`, see `ServerModel`; hf_server.py serves the
tiny HF Qwen3-VL this way, for the driver's end-to-end tests).

In-process (tests):      fake = FakeSGLang(); fake.start(); fake.url; fake.calls; fake.inject("/generate", "status",
                         503, times=1); fake.stop()
As a process (supervision tests): python tests/rollout/sglang/fake_server.py (or -m tests.rollout.sglang.fake_server)
                         --model-path M --host 127.0.0.1 --port P
                         [--config secrets.yaml] [--fake-startup-delay S] [--fake-bind-delay S]
                         [any flag build_server_argv emits]
                         (--config merged into the arguments as SGLang 0.5.16 and 0.5.17 do it: `merge_config`)
                         [--fake-journal DIR]  (append every call to DIR/sglang_<port>.jsonl: survives the process)
                         [--fake-exit-file F]  (the first /generate after a weight sync deletes F and exits, if F
                                                exists: a crash the host must recover from, once);
                         [--fake-fault-file F] (at start, if F exists: delete it and inject the fault it holds, JSON
                                                {"path", "kind", "value", "times", "after", "min_tokens"}: a
                                                relaunched server is healthy);
                         control routes: POST /_fake/inject, GET /_fake/calls, GET /_fake/weights, GET /_fake/log,
                         GET /_fake/skipped, GET /_fake/held.
Stdlib only at import time (plus PyYAML for --config and torch, imported lazily, for weights).
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import io
import json
import math
import os
import pickle
import random
import secrets
import signal
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlparse

from miles_vl.sglang_plugin.marker import MARKER_KEY, new_marker
from miles_vl.sglang_plugin.settings import from_env

VERSION = "0.5.16"
IMAGE_TOKEN_ID = 151655  # Qwen3-VL <|image_pad|>
VISION_START_TOKEN_ID = 151652  # Qwen3-VL <|vision_start|>
VISION_END_TOKEN_ID = 151653  # Qwen3-VL <|vision_end|>
VOCAB_SIZE = 151936
# Qwen3-VL's image processor: 16-pixel patches, 2x2 of them merged into one token; a checkpoint's preprocessor
# config resizes into [65536, 16777216] pixels unless `--mm-process-config` says otherwise.
PATCH_SIZE, MERGE_SIZE = 16, 2
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 65536, 16777216

# GenerateReqInput fields of 0.5.16, plus BaseReq's rid/http_worker_ipc on the other request classes.
GENERATE_FIELDS = frozenset(
    "rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes use_audio_in_video "
    "sampling_params return_logprob logprob_start_len top_logprobs_num token_ids_logprob return_sampling_mask "
    "return_text_in_logprobs stream log_metrics return_hidden_states return_routed_experts routed_experts_start_len "
    "return_indexer_topk modalities session_params lora_path lora_id custom_logit_processor positional_embed_overrides "
    "bootstrap_host bootstrap_port bootstrap_room bootstrap_pair_key decode_tp_size routed_dp_rank "
    "disagg_prefill_dp_rank routing_key conversation_id http_worker_ipc background require_reasoning priority "
    "extra_key "
    "no_logs custom_labels return_bytes return_entropy return_prompt_token_ids external_trace_header received_time "
    "need_wait_for_mm_inputs num_items_assigned mm_data_mooncake encoder_urls max_dynamic_patch min_dynamic_patch "
    "image_max_dynamic_patch video_max_dynamic_patch images_config multi_item_delimiter_indices".split()
)
# SamplingParams API fields of 0.5.16 (an unknown keyword is a TypeError there).
SAMPLING_FIELDS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty presence_penalty "
    "repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos skip_special_tokens "
    "spaces_between_special_tokens no_stop_trim custom_params stream_interval logit_bias sampling_seed".split()
)
BASE_REQ = {"rid", "http_worker_ipc"}
REQUEST_FIELDS = {
    "/update_weights_from_tensor": BASE_REQ
    | {
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "disable_draft_model",
        "torch_empty_cache",
    },
    "/update_weights_from_distributed": BASE_REQ
    | {
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "load_format",
        "torch_empty_cache",
    },
    "/init_weights_update_group": BASE_REQ
    | {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"},
    "/destroy_weights_update_group": BASE_REQ | {"group_name"},
    "/update_weight_version": BASE_REQ | {"new_version", "abort_all_requests"},
    "/get_weights_by_name": BASE_REQ | {"name", "truncate_size"},
    "/weights_checker": BASE_REQ | {"action", "allow_quant_error"},
    "/release_memory_occupation": BASE_REQ | {"tags"},
    "/resume_memory_occupation": BASE_REQ | {"tags"},
}
ABORT_FIELDS = BASE_REQ | {"abort_all", "finished_reason", "abort_message"}  # AbortReq (io_struct.py:1795)
MEMORY_TAGS = {"kv_cache", "weights", "cuda_graph"}
# SafeUnpickler.ALLOWED_MODULE_PREFIXES of 0.5.16 (the prefixes a weight payload may reference).
ALLOWED_MODULE_PREFIXES = (
    "builtins.",
    "collections.",
    "copyreg.",
    "functools.",
    "itertools.",
    "operator.",
    "types.",
    "weakref.",
    "torch.",
    "multiprocessing.resource_sharer.",
    "multiprocessing.reduction.",
    "pickletools.",
    "peft.",
    "transformers.",
    "huggingface_hub.",
    "sglang.srt.weight_sync.tensor_bucket.",
    "sglang.srt.model_executor.model_runner.",
    "sglang.srt.model_executor.model_runner_components.weight_updater.",
    "sglang.srt.layers.",
    "sglang.srt.utils.",
    "sglang.srt.disaggregation.",
    "sglang.srt.managers.",
    "torch_npu.",
)


class BadRequest(Exception):
    """Answered as HTTP 400 with the route's error shape."""


class SchedulerCrash(Exception):
    """An exception in 0.5.16's scheduler process (a failed assert, a KeyError): the whole server dies."""


def _weights_resident(s: FakeState) -> None:
    """0.5.16 loads weights into the parameters' memory, which torch_memory_saver unmaps while the `weights` tag is
    released: the copy faults (CUDA illegal memory access) and the scheduler dies. The KV cache may stay released."""
    if "weights" in s.released:
        raise SchedulerCrash("CUDA error: an illegal memory access was encountered (weights loaded while released)")


class ServerError(Exception):
    """An exception 0.5.16's route does not catch (e.g. the processor's StopIteration, which leaves the coroutine as
    `RuntimeError: coroutine raised StopIteration`): FastAPI answers HTTP 500 with Starlette's plain-text body
    "Internal Server Error" and the traceback goes to the server log only. The stand-in logs the message."""


@dataclass
class Fault:
    # "status" | "delay" | "exit" | "abort" (200 with finish_reason abort) | "abort_status" (value 400, 500 or 503) |
    # "prompt_ids" | "prompt_tokens" | "weight_version" | "logprobs" | "hold" (a sample stops decoding after `value`
    # tokens until an /abort_request reaches it: `Handler._hold`) | "unstarted_abort" (the request waits before the
    # scheduler until an abort_all reaches it, then HTTP 499 as 0.5.17: `Handler._unstarted_abort`)
    kind: str
    value: Any = None
    times: int = 1
    after: int = 0  # calls of the path answered normally before this fault applies (e.g. the 2nd bucket of a sync)
    # "hold": the fault waits for a sample of at least this many tokens (at least `value` + 1: one that reaches its
    # hold); a shorter one is answered normally, as a sample that ends before the abort is. E.g. `value` + 2: the sample
    # still decodes after the abort's extra step, so it is continued (never one whose extra token was its EOS or last)
    min_tokens: int = 0


def _reaches_hold(tokens: int, fault: Fault) -> bool:
    """A sample of `tokens` tokens is one the "hold" `fault` applies to."""
    return tokens >= max(int(fault.value) + 1, fault.min_tokens)


@dataclass
class FakeState:
    model_path: str = "fake/model"
    api_key: str | None = None
    tp_size: int = 1
    deterministic: bool = False  # --enable-deterministic-inference: sampling_seed is honoured
    image_min_pixels: int = DEFAULT_MIN_PIXELS  # --mm-process-config {"image": {"min_pixels": ...}}
    image_max_pixels: int = DEFAULT_MAX_PIXELS
    weight_version: str = "default"
    initial_weight_version: str = "default"
    startup_delay_s: float = 0.0
    exit_file: str | None = None  # see --fake-exit-file
    launcher: bool = True  # with miles_vl's SGLang plugin: processor_output items with pixel files are read
    marker: dict | None = None  # what /server_info reports under the plugin's MARKER_KEY (None: no marker)
    pixel_dir: str | None = None  # $MILES_VL_SGLANG_PIXEL_DIR
    model_dtype: str = "float32"  # --dtype (the stand-in's models run in float32)
    allow_exit: bool = False  # os._exit on an "exit" fault: only when this is its own process
    started_at: float = field(default_factory=time.monotonic)
    released: set[str] = field(default_factory=set)
    running: int = 0  # /generate requests in flight (0.5.16: running or waiting in the scheduler)
    flush_pending: bool = False  # a /flush_cache?timeout>0 waiting for the server to become idle
    dead: bool = False  # in-process stand-in whose scheduler "crashed": every connection is dropped from then on
    groups: dict[str, Any] = field(default_factory=dict)
    group_devices: dict[str, str] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)
    weights: list[dict[str, Any]] = field(default_factory=list)
    # The parameters a model-less stand-in knows (HF names), None: every name; and {HF name: hash of its value}.
    param_names: set[str] | None = None
    params: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # names load_weights skipped, in order
    faults: dict[str, list[Fault]] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)  # what the server wrote to its log (also on stderr as a process)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # /abort_request: every abort so far as (abort_all, rid), and a condition held samples wait on (`Handler._hold`)
    aborts: list[tuple[bool, str]] = field(default_factory=list)
    aborted: threading.Condition = field(default_factory=threading.Condition)
    held: int = 0  # samples that have reached their hold (tests wait for this, under `aborted`)

    def take_fault(
        self, path: str, kinds: tuple[str, ...], applies: Callable[[Fault], bool] | None = None
    ) -> Fault | None:
        """The first fault of `kinds` on `path` whose `after` calls are spent and that `applies` to this call (None:
        every call); it is used up once per call it applies to."""
        with self.lock:
            for fault in self.faults.get(path, []):
                if fault.kind in kinds and fault.times > 0:
                    if fault.after > 0:
                        fault.after -= 1
                        continue
                    if applies is not None and not applies(fault):
                        continue
                    fault.times -= 1
                    return fault
        return None


# ---------------------------------------------------------------------------------------------------------------------
# the deterministic "model"


def vision_blocks(input_ids: list[int]) -> int:
    """Blocks `<|vision_start|> <|image_pad|>+ <|vision_end|>`: what 0.5.16's Qwen-VL processor counts as images in
    the decoded prompt (its `image_token_regex`, srt/multimodal/processors/qwen_vl.py:301)."""
    blocks, k = 0, 0
    while k < len(input_ids):
        if input_ids[k] == VISION_START_TOKEN_ID:
            j = k + 1
            while j < len(input_ids) and input_ids[j] == IMAGE_TOKEN_ID:
                j += 1
            if j > k + 1 and j < len(input_ids) and input_ids[j] == VISION_END_TOKEN_ID:
                blocks += 1
                k = j
        k += 1
    return blocks


def png_size(raw: bytes) -> tuple[int, int]:
    """(height, width) of a PNG, read from its IHDR chunk."""
    if len(raw) < 24 or raw[12:16] != b"IHDR":
        raise BadRequest("an image is not a PNG with an IHDR chunk")
    width, height = struct.unpack(">II", raw[16:24])
    return height, width


def image_token_count(height: int, width: int, min_pixels: int, max_pixels: int) -> int:
    """Merged image tokens of one image: Qwen2-VL's `smart_resize` (both sides rounded to multiples of
    patch * merge = 32, then scaled into [min_pixels, max_pixels] keeping the aspect ratio), written out here so that
    the stand-in does not borrow the processor it stands in for."""
    unit = PATCH_SIZE * MERGE_SIZE
    h, w = round(height / unit) * unit, round(width / unit) * unit
    if h * w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        h = max(unit, math.floor(height / shrink / unit) * unit)
        w = max(unit, math.floor(width / shrink / unit) * unit)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * grow / unit) * unit, math.ceil(width * grow / unit) * unit
    return (h // PATCH_SIZE) * (w // PATCH_SIZE) // MERGE_SIZE**2


def expand_image_pads(input_ids: list[int], counts: list[int]) -> list[int]:
    """The prompt ids 0.5.16 runs for `input_ids` + one image per count (Qwen3-VL, default environment).

    0.5.16 decodes the ids to text (`BaseMultimodalProcessor.load_mm_data`, base_processor.py:812); with one
    `<|vision_start|><|image_pad|>+<|vision_end|>` block per image it takes `fast_load_mm_data` (:893) and runs the HF
    processor on the text and the images (`process_and_combine_mm_data` :1320 -> `process_mm_data`), which replaces
    EVERY `<|image_pad|>` with the next image's expansion: more pads than images runs it out of images
    (StopIteration, HTTP 500). With one pad per image, `SGLANG_MM_AVOID_RETOKENIZE` (on by default) keeps our ids and
    expands the i-th pad into counts[i] pads (`_expand_input_ids`, :1285).

    Raises:
        ServerError: more pads than images (the real server's HTTP 500).
        BadRequest: not one block per image (0.5.16 takes its legacy path then, which the stand-in does not model).
    """
    blocks = vision_blocks(input_ids)
    if blocks != len(counts):
        raise BadRequest(
            f"{len(counts)} image(s) for {blocks} vision block(s) in input_ids (0.5.16 would take its legacy "
            "multimodal path here, which this stand-in does not model)"
        )
    pads = input_ids.count(IMAGE_TOKEN_ID)
    if pads > len(counts):
        raise ServerError(
            f"StopIteration in transformers ProcessorMixin.get_text_with_replacements: the decoded prompt holds {pads} "
            f"<|image_pad|> tokens for {len(counts)} image(s) (BaseMultimodalProcessor.load_mm_data -> "
            "fast_load_mm_data -> process_and_combine_mm_data -> process_mm_data); send one <|image_pad|> per image "
            "block, SGLang expands it"
        )
    out: list[int] = []
    images = iter(counts)
    for t in input_ids:
        out += [IMAGE_TOKEN_ID] * next(images) if t == IMAGE_TOKEN_ID else [t]
    return out


def fake_tokens(
    input_ids: list[int], sampling: dict[str, Any], version: str, *, deterministic: bool = True
) -> tuple[list[int], list[float], dict]:
    """The fake model's answer: a function of the prompt, the weight version and, when the server runs with
    `--enable-deterministic-inference`, the request's `sampling_seed`. Without that flag 0.5.16 builds no seed tensor
    (sampling_batch_info.py:114) and samples from the global generator: the same request sampled twice differs (greedy
    decoding, temperature 0, does not)."""
    greedy = float(sampling.get("temperature", 1.0)) == 0.0
    if greedy:
        seed: Any = "greedy"
    elif deterministic:
        seed = sampling.get("sampling_seed", 42)  # 0.5.16's default seed in deterministic mode
    else:
        seed = uuid.uuid4().hex
    rng = random.Random(f"{input_ids}|{seed}|{version}")
    max_new = int(sampling.get("max_new_tokens", 128))
    stop_ids = [int(t) for t in sampling.get("stop_token_ids") or []]
    banned = {int(k) for k, v in (sampling.get("logit_bias") or {}).items() if v <= -1e8}
    length = rng.randint(1, max_new + max_new // 2 + 1)
    pool = [t for t in range(1000, 1100) if t not in banned and t not in stop_ids]
    if length <= max_new and stop_ids:
        out = [rng.choice(pool) for _ in range(length - 1)] + [stop_ids[0]]
        finish = {"type": "stop", "matched": stop_ids[0]}
    else:
        out = [rng.choice(pool) for _ in range(max_new)]
        finish = {"type": "length", "length": max_new}
    return out, [-4.0 * rng.random() for _ in out], finish


# ---------------------------------------------------------------------------------------------------------------------
# weights


def _unpickle_allowlisted(data: bytes):
    import torch  # noqa: F401  (torch.multiprocessing's rebuild functions must be importable)
    import torch.multiprocessing.reductions as reductions

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if not any((module + ".").startswith(p) for p in ALLOWED_MODULE_PREFIXES):
                raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return _rebuild_cuda_tensor_from_uuid(reductions.rebuild_cuda_tensor)
            return super().find_class(module, name)

    return Unpickler(io.BytesIO(data)).load()


def _rebuild_cuda_tensor_from_uuid(rebuild):
    """0.5.16's patched rebuild accepts the device as an index or a GPU UUID (utils/patch_torch.py)."""
    import torch

    def wrapped(*args):
        device = args[6]
        if isinstance(device, str):
            matches = [
                i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device
            ]
            if not matches:
                raise RuntimeError(f"Invalid device_uuid={device}")
            args = (*args[:6], matches[0], *args[7:])
        return rebuild(*args)

    return wrapped


def rebuild_flattened_bucket(payload) -> list:
    """A `load_format="flattened_bucket"` payload as 0.5.16 rebuilds it (`WeightUpdater._update_weights_from_flattened_
    bucket`, `weight_sync/tensor_bucket.py`): the entries' attributes only, each a view of the one flat tensor."""
    if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
        raise BadRequest(f"a flattened bucket is a dict of flattened_tensor and metadata, got {str(payload)[:100]}")
    flat = payload["flattened_tensor"]
    bad = [m.name for m in payload["metadata"] if m.end_idx - m.start_idx != m.numel]  # numel counts bytes there
    if bad:
        raise BadRequest(f"flattened bucket entries {bad[:3]}: end_idx - start_idx != numel")
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in payload["metadata"]]


def _summarize(named_tensors) -> dict[str, Any]:
    import torch

    if not isinstance(named_tensors, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)
        for x in named_tensors
    ):
        raise BadRequest(f"expected a list of (name, tensor) pairs, got {type(named_tensors).__name__}")
    return {
        "names": [n for n, _ in named_tensors],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
        "sums": [float(t.double().sum()) for _, t in named_tensors],
        "devices": [t.device.type for _, t in named_tensors],
    }


def _join_group(body: dict[str, Any], tp_rank: int):
    """Server side of init_weights_update_group, as 0.5.16's init_custom_process_group builds it."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    timeout = timedelta(seconds=60)
    rank = body["rank_offset"] + tp_rank
    init = f"tcp://{body['master_address']}:{body['master_port']}"
    store, rank, world_size = next(c10d.rendezvous(init, rank, body["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(body["group_name"], store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(body["backend"]), store, group_name=body["group_name"], timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _receive(body: dict[str, Any], group, device: str) -> list:
    import torch
    import torch.distributed as dist

    tensors, handles = [], []
    for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        handles.append(dist.broadcast(t, src=0, group=group, async_op=True))
        tensors.append((name, t))
    for h in handles:
        h.wait()
    return tensors


# ---------------------------------------------------------------------------------------------------------------------
# the server's parameters, as 0.5.16's Qwen3-VL model names them


FUSED_SHARDS = ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
                (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj."))  # fmt: skip


def sglang_parameter(hf_name: str) -> str:
    """The parameter of 0.5.16's `Qwen3VLForConditionalGeneration` an HF tensor loads into (`load_weights`,
    srt/models/qwen3_vl.py:1449-1532): the language model drops its `language_model.` level and fuses q/k/v and
    gate/up; the vision tower moves to the top level and calls its fused projection `qkv_proj`."""
    if hf_name.startswith("model.visual."):
        return "visual." + hf_name.removeprefix("model.visual.").replace(".attn.qkv.", ".attn.qkv_proj.")
    name = (
        "model." + hf_name.removeprefix("model.language_model.") if hf_name.startswith("model.language_") else hf_name
    )
    for shard, fused in FUSED_SHARDS:
        if shard in name:
            return name.replace(shard, fused)
    return name


def sglang_checksums(hashes: dict[str, str]) -> dict[str, str]:
    """{HF name: hash} -> {0.5.16 parameter name: hash} (a fused parameter hashes the hashes of its parts): what
    `/weights_checker` reports, per TP rank, for the weights a stand-in holds."""
    parts: dict[str, list[str]] = {}
    for name in sorted(hashes):
        parts.setdefault(sglang_parameter(name), []).append(hashes[name])
    return {name: hashlib.sha256("|".join(p).encode()).hexdigest()[:16] for name, p in parts.items()}


def value_hash(tensor) -> str:
    t = tensor.detach().contiguous().cpu()
    import torch

    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------------
# HTTP


def sglang_authorizes(path: str, authorization: str | None, api_key: str | None) -> bool:
    """Whether 0.5.16's API-key middleware lets a GET or POST through (`decide_request_auth` and
    `add_api_key_middleware`, `python/sglang/srt/utils/auth.py`, for a server with `--api-key` and no
    `--admin-api-key`, which miles_vl refuses): every path when the server has no key; else `/health*` and
    `/metrics*` (by prefix) without one, and every other path only with `Authorization: <scheme> <token>` where the
    scheme is "bearer" in any case and the token equals the key (`secrets.compare_digest`). A refusal is HTTP 401
    `{"error": "Unauthorized"}`, before the route runs (so also for a path that does not exist)."""
    if not api_key or path.startswith(("/health", "/metrics")):
        return True
    parts = (authorization or "").split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and secrets.compare_digest(parts[1], api_key)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeHTTPServer

    def log_message(self, format, *args):  # noqa: A002  (BaseHTTPRequestHandler's signature)
        if self.server.state.allow_exit:
            sys.stderr.write("fake-sglang: " + (format % args) + "\n")

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    # ---------------------------------------------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        state = self.server.state
        if state.dead:  # a dead server answers nothing (as a process it is gone: connection refused)
            self.close_connection = True
            return
        if self.path.split("?")[0] == "/generate":
            with state.lock:
                state.running += 1
            try:
                return self._dispatch_one(method)
            finally:
                with state.lock:
                    state.running -= 1
        return self._dispatch_one(method)

    def _dispatch_one(self, method: str) -> None:
        state = self.server.state
        url = urlparse(self.path)
        path, query = url.path, {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self._json(400, {"error": {"message": "body is not JSON"}})
        authorized = self._authorized(path)
        if not path.startswith("/_fake/"):
            with state.lock:
                state.calls.append({"method": method, "path": path, "query": query, "body": body, "auth": authorized})
            self.server.journal({"path": path, "query": query})
        if not authorized:
            return self._json(401, {"error": "Unauthorized"})
        fault = state.take_fault(path, ("status", "delay", "exit"))
        if fault is not None:
            if fault.kind == "exit" and state.allow_exit:
                sys.stderr.write(f"fake-sglang: injected fatal error on {path}\n")
                sys.stderr.flush()
                os._exit(int(fault.value or 1))
            if fault.kind == "delay":
                time.sleep(float(fault.value))
            if fault.kind == "status":
                return self._json(int(fault.value), {"error": {"message": f"injected HTTP {fault.value}"}})
        route = ROUTES.get((method, path))
        if route is None:
            return self._json(404, {"detail": "Not Found"})
        try:
            route(self, body, query)
        except BadRequest as e:
            if path == "/generate":
                self._json(400, {"error": {"message": str(e)}})
            else:
                self._json(400, {"success": False, "message": str(e)})
        except ServerError as e:
            self.server.log(f"Exception in ASGI application ({path}): {e}")
            self._send(500, b"Internal Server Error", "text/plain; charset=utf-8")
        except SchedulerCrash as e:
            self._die(str(e))

    def _die(self, reason: str) -> None:
        """0.5.16's scheduler raised: it logs "Scheduler hit an exception", sends SIGQUIT to the server process, whose
        handler kills the whole process tree (scheduler.py:4641, tokenizer_manager.py:3260): the request in flight
        gets no answer. As a process the stand-in kills itself the same way; in-process it drops every connection."""
        self.server.log(f"Scheduler hit an exception: {reason}")
        self.server.log("SIGQUIT received. It usually means one child failed.")
        if self.server.state.allow_exit:
            os.kill(os.getpid(), signal.SIGKILL)
        self.server.state.dead = True
        self.close_connection = True

    def _authorized(self, path: str) -> bool:
        if path.startswith("/_fake/"):  # the stand-in's own control routes (tests)
            return True
        return sglang_authorizes(path, self.headers.get("Authorization"), self.server.state.api_key)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # routes --------------------------------------------------------------------------------------------------------

    def health(self, body, query):
        state = self.server.state
        starting = time.monotonic() < state.started_at + state.startup_delay_s
        self._send(503 if starting else 200, b"", "text/plain")

    def model_info(self, body, query):
        s = self.server.state
        self._json(
            200,
            {
                "model_path": s.model_path,
                "tokenizer_path": s.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": s.weight_version,
                "has_image_understanding": True,
                "has_audio_understanding": False,
                "model_type": "qwen3_vl",
                "architectures": ["Qwen3VLForConditionalGeneration"],
            },
        )

    def server_info(self, body, query):
        s = self.server.state
        info = {"model_path": s.model_path, "tp_size": s.tp_size, "weight_version": s.weight_version,
                "internal_states": [{}], "version": VERSION}  # fmt: skip
        if s.marker is not None:  # as the plugin's marker hook adds it (miles_vl/sglang_plugin/marker.py)
            info[MARKER_KEY] = s.marker
        self._json(200, info)

    def generate(self, body, query):
        s = self.server.state
        if s.exit_file and s.weight_version != s.initial_weight_version and _claim(s.exit_file):
            sys.stderr.write(f"fake-sglang: {s.exit_file} found after a weight sync: exiting as a crash would\n")
            sys.stderr.flush()
            os._exit(1)
        _require_fields(body, GENERATE_FIELDS, "GenerateReqInput")
        prompts, batched = _batch_prompts(body)  # [(input_ids, images, videos, sampling params)], one per prompt
        n = {int((sampling or {}).get("n", 1)) for *_, sampling in prompts}
        if len(n) > 1:  # GenerateReqInput._handle_parallel_sampling (io_struct.py:411)
            raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
        [n] = n
        # what each prompt brought, for the journal: data URLs or processor_output items (with their grids)
        media = [{"images": [_kind(u) for u in im], "videos": [_kind(v) for v in vid]} for _, im, vid, _ in prompts]
        self.server.journal({"event": "generate", "prompts": media})
        work = []
        for input_ids, images, videos, sampling in prompts:
            sampling = sampling or {}
            unknown = set(sampling) - SAMPLING_FIELDS
            if unknown:
                raise BadRequest(f"SamplingParams.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}")
            _verify_sampling(sampling)
            if s.deterministic and float(sampling.get("min_p", 0.0)) > 0:  # sampler.py:570, in the scheduler
                raise SchedulerCrash(
                    "AssertionError: With sampling seed, multinomial_with_seed will provide wrong results"
                )
            if any(isinstance(item, dict) for item in [*images, *videos]):
                work.append((input_ids, [], sampling, self._pixels(images, videos)))
                continue
            if videos:
                raise BadRequest("this stand-in takes videos only as processor_output items (all miles_vl sends)")
            pngs = []
            for u in images:
                raw = base64.b64decode(u.split(",", 1)[1] if u.startswith("data:") else u, validate=True)
                if not raw.startswith(b"\x89PNG"):
                    raise BadRequest("an image is not a PNG")
                pngs.append(raw)
            work.append((input_ids, pngs, sampling, None))

        version = s.weight_version
        with s.aborted:  # an abort reaches the requests that arrived before it (`_hold`)
            arrived = len(s.aborts)
        rid = body.get("rid") if n == 1 and not batched else None  # 0.5.16 gives n > 1 copies fresh uuid rids
        if (f := s.take_fault("/generate", ("weight_version",))) is not None:
            version = str(f.value)
        if (f := s.take_fault("/generate", ("abort_status",))) is not None:
            return self._abort_with_status(int(f.value))
        if s.take_fault("/generate", ("unstarted_abort",)) is not None:
            return self._unstarted_abort(arrived, body.get("rid"))
        if self.server.model is not None and s.released:
            raise BadRequest(f"generate while memory is released ({sorted(s.released)}): resume it first")
        responses = []
        for input_ids, pngs, sampling, pixels in work:  # 0.5.16 answers prompt by prompt, its n samples together
            if self.server.model is None:  # the images are processed once per prompt, whatever n is
                counts = [image_token_count(*png_size(raw), s.image_min_pixels, s.image_max_pixels) for raw in pngs]
                prompt_ids = expand_image_pads(input_ids, counts) if pngs else list(input_ids)
            for _ in range(n):  # 0.5.16 sends n copies of the tokenized request, sampling_seed included
                if self.server.model is not None:
                    out, logprobs, finish, prompt_ids = self.server.model.generate(
                        input_ids, pngs, sampling, pixels=pixels
                    )
                else:
                    out, logprobs, finish = fake_tokens(prompt_ids, sampling, version, deterministic=s.deterministic)
                reaches = functools.partial(_reaches_hold, len(out))  # only a sample that reaches it uses it up
                if (f := s.take_fault("/generate", ("hold",), reaches)) is not None:
                    out, logprobs, finish = self._hold(out, logprobs, int(f.value), arrived, rid)
                responses.append(self._response(body, list(prompt_ids), out, logprobs, finish, version))
        self._json(200, responses if n > 1 or batched else responses[0])

    def _hold(self, out: list, logprobs: list, tokens: int, arrived: int, rid: str | None) -> tuple[list, list, dict]:
        """A sample that is still decoding when an `/abort_request` reaches it (the "hold" fault: it stops after
        `tokens` tokens until an abort with `abort_all`, or with a prefix of this request's `rid`, arrives after the
        request did). 0.5.16 (scheduler.py `abort_request`): the running request gets `to_finish = FINISH_ABORT()`,
        runs one more decode step and finishes normally, so `/generate` answers 200 with finish reason abort, the
        output ids so far (`tokens` + 1 here, or fewer where the sample ends there: the abort's finish reason wins
        over EOS and max_new_tokens in 0.5.16's `Req.update_finish_state`) and one logprob each. Checked on a real
        server by tests/gpu/test_sglang_real.py::test_an_aborted_request_returns_its_output_so_far (a rid) and
        ::test_abort_all_returns_every_sample_so_far_and_the_engine_continues_them (abort_all, n > 1). Driven by
        the abort, never by time."""
        s = self.server.state

        def reached() -> bool:
            return any(every or (rid is not None and rid.startswith(r)) for every, r in s.aborts[arrived:])

        with s.aborted:
            s.held += 1
            s.aborted.notify_all()
            s.aborted.wait_for(reached)
        finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        return out[: tokens + 1], logprobs[: tokens + 1], finish

    def _unstarted_abort(self, arrived: int, rid: str | None) -> None:
        """A request an `abort_all` reaches before the scheduler holds it (the "unstarted_abort" fault: it waits,
        counted in `held`, for an abort_all that arrives after it did). SGLang 0.5.17 marks every request state
        aborted and raises `RequestAbortedError` (tokenizer_manager.py `_raise_if_logical_rid_aborted`, its
        `status_code` 499) where the request would go on, which `/generate` answers as `{"error": {"message"}}` with
        HTTP 499 (http_server.py `_create_error_response`); 0.5.16 ignores such an abort (the request then starts and
        the next abort_all reaches it). Read from the 0.5.17 source, not confirmed on a real server: a pause that
        lands in that window cannot be timed from outside the server."""
        s = self.server.state
        with s.aborted:
            s.held += 1
            s.aborted.notify_all()
            s.aborted.wait_for(lambda: any(every for every, _ in s.aborts[arrived:]))
        self._json(499, {"error": {"message": f"Request {rid or '0'} was aborted"}})

    def abort_request(self, body, query):
        """`POST /abort_request` (`AbortReq`: `rid`, or `abort_all`): 200 with an empty body; 0.5.16 ignores an empty
        rid without abort_all (tokenizer_manager.py `abort_request`)."""
        _require_fields(body or {}, ABORT_FIELDS, "AbortReq")
        body = body or {}
        every, rid = bool(body.get("abort_all", False)), str(body.get("rid") or "")
        s = self.server.state
        if every or rid:
            with s.aborted:
                s.aborts.append((every, rid))
                s.aborted.notify_all()
        self._send(200, b"", "text/plain")

    def _pixels(self, images: list, videos: list) -> dict[str, Any]:
        """One prompt's processor_output items (images, videos) as 0.5.16 with miles_vl's launcher takes them: at most
        one item per modality (`BaseMultimodalProcessor.validate_mm_data`), its pixel files read by the launcher's
        `resolve_item`; returns {pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw} (those present)."""
        s = self.server.state
        out: dict[str, Any] = {}
        for modality, items in (("image", images), ("video", videos)):
            if not items:
                continue
            if len(items) != 1 or not isinstance(items[0], dict) or items[0].get("format") != "processor_output":
                raise BadRequest(
                    f"Modality.{modality.upper()}: when providing a 'processor_output' or 'precomputed_embedding', "
                    f"you must pass exactly one item; received {len(items)} items"
                )
            if not s.launcher and "hash" in items[0]:  # nothing to hash: the reference reaches the vision tower
                raise SchedulerCrash(
                    "TypeError: expected Tensor as element 0 in argument 0, but got dict (get_image_feature: a "
                    "processor_output item with its own hash keeps its file reference to the vision tower; stock "
                    "0.5.16 does not read miles_vl's pixel files; start the server with miles_vl's SGLang plugin)"
                )
            if not s.launcher:
                raise ServerError(
                    "TypeError: object supporting the buffer API required (MultimodalDataItem.set_pad_value -> "
                    "hash_feature of a processor_output feature that is a file reference: stock 0.5.16 does not "
                    "read miles_vl's pixel files; start the server with miles_vl's SGLang plugin)"
                )
            import torch

            from miles_vl.sglang_plugin.wire import resolve_item

            try:
                item = resolve_item(items[0], getattr(torch, s.model_dtype), s.pixel_dir)
            except ValueError as e:  # what the launcher raises in _tokenize_one_request: 0.5.16's 400
                raise BadRequest(str(e)) from e
            for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
                if key in item:
                    out[key] = item[key]
        return out

    def _response(self, body, prompt_ids, out, logprobs, finish, version) -> dict:
        s = self.server.state
        if s.take_fault("/generate", ("abort",)) is not None:
            out, logprobs, finish = out[:1], logprobs[:1], {"type": "abort", "message": "Abort before prefill",
                                                            "status_code": None, "err_type": None}  # fmt: skip
        if (f := s.take_fault("/generate", ("prompt_ids",))) is not None:
            prompt_ids[f.value["position"]] = f.value["token"]
        prompt_tokens = len(prompt_ids)
        if (f := s.take_fault("/generate", ("prompt_tokens",))) is not None:
            prompt_tokens += int(f.value)
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "weight_version": version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(out),
            "cached_tokens": 0,
        }
        if body.get("return_logprob"):
            rows = [[lp, t, None] for lp, t in zip(logprobs, out, strict=True)]
            if s.take_fault("/generate", ("logprobs",)) is not None:
                rows = rows[:-1]
            meta.update(input_token_logprobs=[], output_token_logprobs=rows, output_token_logprobs_length=len(rows))
        response = {"text": "", "output_ids": out, "meta_info": meta}
        if body.get("return_prompt_token_ids"):
            response["prompt_token_ids"] = prompt_ids
        return response

    def _abort_with_status(self, status: int) -> None:
        """A request the scheduler aborted with a status code (tokenizer_manager.py:1438 `_handle_abort_finish_reason`):
        400 is raised as a ValueError (`{"error": {"message"}}`, http_server.py:2006); 500 and 503 as an HTTPException,
        which 0.5.16's handler answers as an ErrorResponse (http_server.py:494)."""
        if status == 400:  # e.g. validate_input_length (managers/utils.py:181)
            too_long = (
                "Input length (9000 tokens) exceeds the maximum allowed length (8192 tokens). Use a shorter input or "
                "enable --allow-auto-truncate."
            )
            return self._json(400, {"error": {"message": too_long}})
        message = {
            500: "Out of memory even after retracting all other requests in the decode batch. Aborting the last "
            "request.",  # schedule_batch.py:2635
            503: "Request waiting timeout reached.",  # scheduler.py:2505
        }[status]
        self._json(status, error_response(message, str(status), status))

    def flush_cache(self, body, query):
        """0.5.16 (http_server.py:905, SchedulerFlushWrapper in scheduler_components/flush_wrapper.py, Scheduler.
        flush_cache in scheduler.py:3846): flushes only an idle server; `timeout` > 0 waits that long for it to become
        idle. Refusals are HTTP 400 with a plain-text body."""
        s = self.server.state
        try:
            timeout = float(query.get("timeout", 0.0))
        except ValueError:
            timeout = -1.0
        if timeout < 0:  # Query(ge=0.0): FastAPI's validation error, which 0.5.16 answers as 400 (http_server.py:551)
            message = f"query.timeout: Input should be greater than or equal to 0, got {query.get('timeout')!r}"
            return self._json(400, error_response(message, "Bad Request", 400))
        deadline = time.monotonic() + timeout
        with s.lock:
            if s.flush_pending:
                return self._send(400, b"Another flush_cache is already in progress.", TEXT)
            busy = s.running > 0
            s.flush_pending = busy and timeout > 0
        while busy and time.monotonic() < deadline:
            time.sleep(0.01)
            with s.lock:
                busy = s.running > 0
        with s.lock:
            s.flush_pending = False
        if not busy:
            self.server.log("Cache flushed successfully!")
            return self._send(200, FLUSHED, TEXT)
        if timeout > 0:
            self.server.log("Deferred flush_cache timed out while waiting for idle state.")
            return self._send(400, b"Timed out waiting for idle state.", TEXT)
        self.server.log(f"Cache not flushed because there are pending requests. #running-req: {s.running}")
        self._send(400, b"Flush cache failed.\n", TEXT)

    def update_weights_from_tensor(self, body, query):
        s = self.server.state
        _require_fields(body, REQUEST_FIELDS["/update_weights_from_tensor"], "UpdateWeightsFromTensorReqInput")
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
            raise BadRequest("serialized_named_tensors must be a list of base64 strings")
        if len(payloads) < s.tp_size:  # TpModelWorker indexes the list by tp_rank
            raise BadRequest(f"list index out of range: {len(payloads)} payloads for tp_size {s.tp_size}")
        load_format = body.get("load_format")
        if load_format not in (None, "direct", "flattened_bucket"):
            raise BadRequest(
                f"Unknown load_format={load_format} (this stand-in loads lists of tensors and flat buckets)"
            )
        try:
            received = [_unpickle_allowlisted(base64.b64decode(p, validate=True)) for p in payloads]
            if load_format == "flattened_bucket":
                received = [rebuild_flattened_bucket(r) for r in received]
            summaries = [_summarize(r) for r in received]
        except BadRequest:
            raise
        except Exception as e:
            raise BadRequest(f"Failed to deserialize named tensors: {type(e).__name__}: {e}") from e
        _weights_resident(s)
        skipped = self._load(received[0], "/update_weights_from_tensor")
        with s.lock:
            s.weights.append({"path": "/update_weights_from_tensor", "tp_ranks": len(summaries), **summaries[0],
                              "skipped": skipped})  # fmt: skip
            if body.get("weight_version") is not None:
                s.weight_version = body["weight_version"]
        if body.get("weight_version") is not None and self.server.model is not None:  # as /update_weight_version
            self.server.journal({"event": "weights", "version": s.weight_version, "digest": self.server.model.digest()})
        if body.get("flush_cache"):  # 0.5.16: the scheduler flushes after a successful load (flush_cache_after_...)
            self.server.log("Cache flushed successfully!")
            self.server.journal({"event": "flushed"})
        self._json(200, {"success": True, "message": "Success"})

    def _load(self, named_tensors: list, path: str) -> list[str]:
        """Load what the server knows and skip the rest without an error, as 0.5.16's Qwen3-VL `load_weights` does
        (`if name in params_dict ... else: continue`, qwen3_vl.py:1522-1525); the skipped names go to the log, the
        journal and `state.skipped` (GET /_fake/skipped). An "ignore" fault on `path` accepts the tensors and loads
        none (a server that does not apply what it is sent). Returns the skipped names."""
        s, model = self.server.state, self.server.model
        known = model.names() if model is not None else s.param_names
        skipped = [n for n, _ in named_tensors if known is not None and n not in known]
        loaded = [(n, t) for n, t in named_tensors if known is None or n in known]
        if skipped:
            self.server.log(f"load_weights skipped {len(skipped)} tensor(s) it does not know: {skipped}")
            self.server.journal({"event": "skipped", "names": skipped})
        if s.take_fault(path, ("ignore",)) is not None:
            loaded = []
        if model is not None:
            model.load(loaded)
        with s.lock:
            s.skipped += skipped
            s.params.update((n, value_hash(t)) for n, t in loaded)
        return skipped

    def get_weights_by_name(self, body, query):
        """0.5.16 (http_server.py:1403) asks the model's own `get_weights_by_name` (weight_exporter.py:142), which
        Qwen3-VL does not have: the AttributeError is logged and the route answers 400 "Get parameter by name
        failed"."""
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return self._json(400, error_response("body.name: Field required (GetWeightsByNameReqInput)",
                                                  "Bad Request", 400))  # fmt: skip
        _require_fields(body, REQUEST_FIELDS["/get_weights_by_name"], "GetWeightsByNameReqInput")
        self.server.log(
            f"Error when getting parameter {body['name']}: 'Qwen3VLForConditionalGeneration' object has no attribute "
            "'get_weights_by_name'"
        )
        self._json(400, {"error": {"message": "Get parameter by name failed"}})

    def weights_checker(self, body, query):
        """`/weights_checker` with action "checksum" (http_server.py:1443, WeightChecker._compute_checksum): per TP
        rank, a hash of every parameter under 0.5.16's names. Only "checksum" is implemented here."""
        s = self.server.state
        body = body if body is not None else {}
        _require_fields(body, REQUEST_FIELDS["/weights_checker"], "CheckWeightsReqInput")
        action = body.get("action", "checksum")
        if action != "checksum":
            raise BadRequest(f"Unsupported action={action!r} (this stand-in implements 'checksum' only)")
        if self.server.model is not None:
            hashes = self.server.model.digest()
        else:
            with s.lock:
                hashes = {n: hashlib.sha256(f"initial {n}".encode()).hexdigest()[:16] for n in s.param_names or ()}
                hashes.update(s.params)
        checksums = sglang_checksums(hashes)
        overall = hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest()
        ranks = [
            {"checksums": checksums, "per_gpu_checksum": overall,
             "parallelism_info": {"tp_rank": r, "tp_size": s.tp_size, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                                  "pp_size": 1, "rank": r, "size": s.tp_size}}
            for r in range(s.tp_size)
        ]  # fmt: skip
        engine = hashlib.sha256("".join(r["per_gpu_checksum"] for r in ranks).encode()).hexdigest()
        self._json(200, {"success": True, "message": "Success.", "ranks": ranks, "per_engine_checksum": engine})

    def init_weights_update_group(self, body, query):
        s = self.server.state
        _require_fields(body, REQUEST_FIELDS["/init_weights_update_group"], "InitWeightsUpdateGroupReqInput")
        for key, kind in (("master_address", str), ("master_port", int), ("rank_offset", int), ("world_size", int)):
            if not isinstance(body.get(key), kind):
                raise BadRequest(f"{key} must be {kind.__name__}")
        body.setdefault("group_name", "weight_update_group")
        body.setdefault("backend", "nccl")
        if body["group_name"] in s.groups:
            raise BadRequest(f"group {body['group_name']!r} already exists")
        group = None if self.server.record_only_groups else _join_group(body, tp_rank=0)
        s.groups[body["group_name"]] = group
        s.group_devices[body["group_name"]] = "cuda" if body["backend"] == "nccl" else "cpu"
        self._json(200, {"success": True, "message": "Succeeded to initialize custom process group."})

    def update_weights_from_distributed(self, body, query):
        s = self.server.state
        _require_fields(
            body, REQUEST_FIELDS["/update_weights_from_distributed"], "UpdateWeightsFromDistributedReqInput"
        )
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise BadRequest("names, dtypes and shapes are required lists")
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest("names, dtypes and shapes differ in length")
        name = body.get("group_name", "weight_update_group")
        if name not in s.groups:
            raise BadRequest(f"Group {name} not in {list(s.groups)}. Please call `init_weights_update_group` first.")
        group = s.groups[name]
        if group is not None:
            tensors = _receive(body, group, s.group_devices[name])
            summary = _summarize(tensors)
            skipped = self._load(tensors, "/update_weights_from_distributed")
        else:
            summary = {"names": names, "dtypes": dtypes, "shapes": shapes}
            skipped = []
        with s.lock:
            s.weights.append({"path": "/update_weights_from_distributed", **summary, "skipped": skipped})
            if body.get("weight_version") is not None:
                s.weight_version = body["weight_version"]
        self._json(200, {"success": True, "message": "Succeeded to update parameter online."})

    def destroy_weights_update_group(self, body, query):
        s = self.server.state
        _require_fields(body, REQUEST_FIELDS["/destroy_weights_update_group"], "DestroyWeightsUpdateGroupReqInput")
        group = s.groups.pop((body or {}).get("group_name", "weight_update_group"), False)
        if group is False:
            raise BadRequest("The group to be destroyed does not exist.")
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group)
        self._json(200, {"success": True, "message": "Succeeded to destroy custom process group."})

    def update_weight_version(self, body, query):
        s = self.server.state
        _require_fields(body, REQUEST_FIELDS["/update_weight_version"], "UpdateWeightVersionReqInput")
        if not isinstance(body.get("new_version"), str):
            raise BadRequest("new_version is a required string")
        s.weight_version = body["new_version"]
        if self.server.model is not None:
            self.server.journal({"event": "weights", "version": s.weight_version, "digest": self.server.model.digest()})
        self._json(200, {"success": True, "message": f"Weight version updated to {s.weight_version}",
                         "new_version": s.weight_version})  # fmt: skip

    def release_memory(self, body, query):
        self._memory(body, "/release_memory_occupation", release=True)

    def resume_memory(self, body, query):
        self._memory(body, "/resume_memory_occupation", release=False)

    def _memory(self, body, path, *, release: bool):
        s = self.server.state
        _require_fields(body or {}, REQUEST_FIELDS[path], path)
        tags = (body or {}).get("tags") or sorted(MEMORY_TAGS)
        if not set(tags) <= MEMORY_TAGS:
            return self._json(400, {"error": {"message": f"unknown tags {sorted(set(tags) - MEMORY_TAGS)}"}})
        with s.lock:
            if release and s.running:  # SchedulerWeightUpdaterManager.release_memory_occupation's assert (:187)
                raise SchedulerCrash(
                    "AssertionError: release_memory_occupation should be called only when server is idle."
                )
            if not release and not set(tags) <= s.released:  # offload_tags.remove(tag) of resume (:238)
                raise SchedulerCrash(f"KeyError: {sorted(set(tags) - s.released)[0]!r}")
            (s.released.update if release else s.released.difference_update)(tags)
        self.server.journal({"event": "memory", "release": release, "tags": list(tags)})
        if self.server.model is not None and not release:
            self.server.model.resumed(tags)
        self._json(200, None)  # the 0.5.16 handler returns None: FastAPI answers `null`

    # fake-only control ---------------------------------------------------------------------------------------------

    def fake_inject(self, body, query):
        s = self.server.state
        with s.lock:
            fields = ("value", "times", "after", "min_tokens")
            fault = Fault(body["kind"], **{k: body[k] for k in fields if k in body})
            s.faults.setdefault(body["path"], []).append(fault)
        self._json(200, {"ok": True})

    def fake_calls(self, body, query):
        with self.server.state.lock:
            self._json(200, self.server.state.calls)

    def fake_weights(self, body, query):
        with self.server.state.lock:
            self._json(200, self.server.state.weights)

    def fake_log(self, body, query):
        with self.server.state.lock:
            self._json(200, self.server.state.log)

    def fake_skipped(self, body, query):
        with self.server.state.lock:
            self._json(200, self.server.state.skipped)

    def fake_held(self, body, query):
        """How many samples have reached a "hold" so far (`FakeState.held`): a test waits for one before it pauses."""
        with self.server.state.aborted:
            self._json(200, {"held": self.server.state.held})


ROUTES = {
    ("GET", "/health"): Handler.health,
    ("GET", "/health_generate"): Handler.health,
    ("GET", "/model_info"): Handler.model_info,
    ("GET", "/server_info"): Handler.server_info,
    ("POST", "/generate"): Handler.generate,
    ("POST", "/abort_request"): Handler.abort_request,
    ("GET", "/flush_cache"): Handler.flush_cache,
    ("POST", "/flush_cache"): Handler.flush_cache,
    ("POST", "/update_weights_from_tensor"): Handler.update_weights_from_tensor,
    ("POST", "/init_weights_update_group"): Handler.init_weights_update_group,
    ("POST", "/update_weights_from_distributed"): Handler.update_weights_from_distributed,
    ("POST", "/destroy_weights_update_group"): Handler.destroy_weights_update_group,
    ("POST", "/update_weight_version"): Handler.update_weight_version,
    ("GET", "/release_memory_occupation"): Handler.release_memory,
    ("POST", "/release_memory_occupation"): Handler.release_memory,
    ("GET", "/resume_memory_occupation"): Handler.resume_memory,
    ("POST", "/resume_memory_occupation"): Handler.resume_memory,
    ("POST", "/_fake/inject"): Handler.fake_inject,
    ("GET", "/_fake/calls"): Handler.fake_calls,
    ("GET", "/_fake/weights"): Handler.fake_weights,
    ("GET", "/_fake/log"): Handler.fake_log,
    ("GET", "/_fake/skipped"): Handler.fake_skipped,
    ("GET", "/_fake/held"): Handler.fake_held,
    ("GET", "/get_weights_by_name"): Handler.get_weights_by_name,
    ("POST", "/get_weights_by_name"): Handler.get_weights_by_name,
    ("GET", "/weights_checker"): Handler.weights_checker,
    ("POST", "/weights_checker"): Handler.weights_checker,
}


TEXT = "text/plain; charset=utf-8"
FLUSHED = (
    b"Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the "
    b"operation will not be performed.)\n"
)


def error_response(message: str, kind: str, code: int) -> dict[str, Any]:
    """0.5.16's `ErrorResponse` (srt/entrypoints/openai/protocol.py:88), the body of its HTTPException and validation
    error handlers."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


def _batch_prompts(body: dict[str, Any]) -> tuple[list[tuple[list[int], list, list, dict[str, Any] | None]], bool]:
    """The prompts of one `/generate` body as (input_ids, images, videos, sampling params), as 0.5.16's
    `GenerateReqInput` normalizes them (io_struct.py:380-560), and whether it is a batch: `input_ids` is one prompt (a
    list of ints) or a batch (a list of such lists). A single prompt with `n > 1` becomes a batch of one
    (`_handle_parallel_sampling`), whose `image_data` must then hold one entry: a list of that prompt's images, or one
    image (`_normalize_image_data`: "The length of image_data should be equal to the batch size."). A batch's
    `image_data` / `video_data` hold one list per prompt (an image or video item: data URLs or processor_output
    dicts); 0.5.16 checks the length of a batch's `image_data` but not of its `video_data` (prompt i takes entry i: an
    IndexError, HTTP 500, when there is none; entries past the batch are unused); its `sampling_params` one dict for
    all or one per prompt. Text is not taken here (miles_vl sends ids)."""
    input_ids = body.get("input_ids")
    if not isinstance(input_ids, list) or not input_ids:
        raise BadRequest("this stand-in takes input_ids: a non-empty list of ints, or a list of such lists")
    batched = isinstance(input_ids[0], list)
    rows = input_ids if batched else [input_ids]
    if not all(isinstance(r, list) and r and all(isinstance(t, int) for t in r) for r in rows):
        raise BadRequest("input_ids should be a list of lists for batch processing.")
    images, videos = body.get("image_data"), body.get("video_data")
    sampling = body.get("sampling_params")
    n = int((sampling[0] if isinstance(sampling, list) and sampling else sampling or {}).get("n", 1))
    is_item = lambda x: isinstance(x, str | dict)  # noqa: E731
    if not batched and n == 1:  # a single request: its lists are the prompt's own
        for name, items in (("image_data", images), ("video_data", videos)):
            if items is not None and not (isinstance(items, list) and all(is_item(u) for u in items)):
                raise BadRequest(f"{name} must be a list of images or items here")
        return [(input_ids, list(images or []), list(videos or []), sampling)], False
    per_prompt = []
    for name, items in (("image_data", images), ("video_data", videos)):
        if items is None or items == []:
            per_prompt.append([[] for _ in rows])
            continue
        if name == "image_data" and (not isinstance(items, list) or len(items) != len(rows)):
            raise BadRequest("The length of image_data should be equal to the batch size.")
        if not isinstance(items, list):  # one video for every prompt (`_normalize_video_data`, io_struct.py:537)
            items = [items] * len(rows)
        if len(items) < len(rows):  # 0.5.16 does not check a batch's video_data: prompt i takes entry i, or fails
            raise ServerError("IndexError: list index out of range (GenerateReqInput.__getitem__, video_data)")
        entries = [[] if e is None else e if isinstance(e, list) else [e] for e in items[: len(rows)]]  # rest unused
        if not all(all(is_item(u) for u in e) for e in entries):
            raise BadRequest(f"a batch's {name} must hold a list of images or items per prompt here")
        per_prompt.append(entries)
    if isinstance(sampling, list):
        if len(sampling) != len(rows):
            raise BadRequest("The length of sampling_params should be equal to the batch size.")
    else:
        sampling = [sampling] * len(rows)
    hashes = body.get("mm_hashes")
    if batched and hashes is not None and (not isinstance(hashes, list) or len(hashes) != len(rows)):
        raise BadRequest("this stand-in takes a batch's mm_hashes as one list per prompt")
    prompts = zip(rows, per_prompt[0], per_prompt[1], sampling, strict=True)
    return [(r, list(im), list(vid), sp) for r, im, vid, sp in prompts], batched


def _kind(item: Any) -> Any:
    """A journal's view of one image or video item: "url", or a processor_output item's format and grids."""
    if isinstance(item, dict):
        return {k: v for k, v in item.items() if k in ("format", "image_grid_thw", "video_grid_thw")}
    return "url"


def _require_fields(body: Any, allowed: frozenset[str] | set[str], cls: str) -> None:
    if not isinstance(body, dict):
        raise BadRequest(f"{cls}: the body must be a JSON object")
    unknown = set(body) - set(allowed)
    if unknown:
        raise BadRequest(f"{cls}: unknown field(s) {sorted(unknown)}")


def _verify_sampling(p: dict[str, Any]) -> None:
    """SamplingParams.verify of 0.5.16, for the fields we send."""
    if float(p.get("temperature", 1.0)) < 0:
        raise BadRequest("temperature must be a non-negative finite number")
    if not 0 < float(p.get("top_p", 1.0)) <= 1:
        raise BadRequest("top_p must be in (0, 1]")
    top_k = int(p.get("top_k", -1))
    if top_k != -1 and top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if int(p.get("max_new_tokens", 128)) < 0:
        raise BadRequest("max_new_tokens must be at least 0")
    for key in p.get("logit_bias") or {}:
        if not 0 <= int(key) < VOCAB_SIZE:
            raise BadRequest(f"logit_bias must has keys in [0, {VOCAB_SIZE - 1}], got {key}.")


class ServerModel(Protocol):
    """A real model behind the stand-in's routes (hf_server.py); without one the deterministic fake answers."""

    def generate(
        self, input_ids: list[int], pngs: list[bytes], sampling: dict, *, pixels: dict | None = None
    ) -> tuple[list, list, dict, list]:
        """(output ids, their logprobs, finish_reason, the prompt ids the server used); BadRequest on bad input.
        `pixels`: the prompt's read processor_output items (`Handler._pixels`), in place of PNG images."""
        ...

    def names(self) -> set[str]:
        """The HF names of the model's tensors (what `load` takes; the stand-in skips any other name)."""
        ...

    def load(self, named_tensors: list) -> None:
        """Copy these (name, tensor) pairs into the weights (all names are known: see `names`)."""
        ...

    def resumed(self, tags: list[str]) -> None:
        """Memory of these tags came back (without a CPU backup the weights are then undefined)."""
        ...

    def digest(self) -> dict[str, str]:
        """{parameter name: hash of its bytes}, journaled at every weight-version update."""
        ...


class FakeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # The engine opens up to 128 connections at once (one per sample); socketserver's default backlog of 5 resets
    # the rest (ECONNRESET, then client retries). SGLang's uvicorn listens with a backlog of 2048.
    request_queue_size = 2048

    def __init__(
        self,
        address,
        state: FakeState,
        *,
        record_only_groups: bool,
        model: ServerModel | None = None,
        journal_dir: str | None = None,
    ):
        self.state = state
        self.record_only_groups = record_only_groups
        self.model = model
        self.journal_path = None if journal_dir is None else Path(journal_dir) / f"sglang_{address[1]}.jsonl"
        self._journal_lock = threading.Lock()
        super().__init__(address, Handler)

    def log(self, line: str) -> None:
        """A line of the server's log: kept in `state.log` (GET /_fake/log), on stderr when this is a process, and in
        the journal."""
        with self.state.lock:
            self.state.log.append(line)
        if self.state.allow_exit:
            sys.stderr.write(f"fake-sglang: {line}\n")
            sys.stderr.flush()
        self.journal({"log": line})

    def journal(self, record: dict[str, Any]) -> None:
        """Append one JSON line (with this process's pid) to the journal file, when there is one."""
        if self.journal_path is None:
            return
        line = json.dumps({"pid": os.getpid(), "time": time.time(), **record}) + "\n"
        with self._journal_lock, open(self.journal_path, "a") as f:
            f.write(line)


def read_journal(journal_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """The journals of every stand-in that ran with `--fake-journal journal_dir`: {port: records in order}."""
    out = {}
    for path in sorted(Path(journal_dir).glob("sglang_*.jsonl")):
        out[int(path.stem.split("_")[1])] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _claim(path: str) -> bool:
    """Delete `path` if it exists; True for the one process that deleted it."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


class FakeSGLang:
    """The stand-in running in a thread of this process (groups are recorded, not joined: one process cannot hold
    both ends of a process group with the same name).

    Args:
        port: 0 picks a free port.
        state: initial state (api_key, weight_version, tp_size, ...).
    """

    def __init__(self, port: int = 0, **state: Any):
        self.state = FakeState(**state)
        self.httpd = FakeHTTPServer(("127.0.0.1", port), self.state, record_only_groups=True)
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def calls(self) -> list[dict[str, Any]]:
        with self.state.lock:
            return list(self.state.calls)

    def paths(self) -> list[str]:
        return [c["path"] for c in self.calls]

    def inject(self, path: str, kind: str, value: Any = None, *, times: int = 1) -> None:
        with self.state.lock:
            self.state.faults.setdefault(path, []).append(Fault(kind, value, times))

    def start(self) -> FakeSGLang:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeSGLang:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def merge_config(argv: list[str]) -> list[str]:
    """`argv` with its `--config FILE` replaced by the file's settings as arguments, in front of the others: what
    SGLang 0.5.16 and 0.5.17 do before argparse sees them (`prepare_server_args` in srt/server_args.py calls
    `ConfigArgumentMerger.merge_config_with_args`, srt/server_args_config_parser.py; the same in both releases).
    Each `key: value` of the YAML (yaml.safe_load) becomes `--key str(value)`: a list gives `--key item...`, a dict
    `--key <its JSON>`, true a bare `--key` (the store_true flags, the only booleans the stand-in knows), false
    nothing."""
    if "--config" not in argv:
        return argv
    import yaml

    at = argv.index("--config")
    with open(argv[at + 1]) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise ValueError("Config file must contain a dictionary at root level")  # 0.5.16's words
    merged: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            merged += [f"--{key}"] if value else []
        elif isinstance(value, list):
            merged += [f"--{key}", *map(str, value)] if value else []
        elif isinstance(value, dict):
            merged += [f"--{key}", json.dumps(value)]
        else:
            merged += [f"--{key}", str(value)]
    return merged + argv[:at] + argv[at + 2 :]


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The flags build_server_argv emits that the stand-in reads, plus its own `--fake-*` ones (unknown SGLang flags
    are accepted and ignored), after `--config` is merged into them as SGLang does it (`merge_config`): a setting
    there that SGLang's argparse would refuse is refused here too, with the same message."""
    argv = merge_config(sys.argv[1:] if argv is None else list(argv))
    parser = parser or argparse.ArgumentParser(prog="fake-sglang")
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--config")
    parser.add_argument("--api-key")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--mm-process-config", default=None, help="JSON; its image min/max pixels are used")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--rl-on-policy-target", default=None, help="0.5.16 turns deterministic inference on with it")
    parser.add_argument("--dtype", default="auto", help="the model dtype pixel values are read in (auto: float32)")
    parser.add_argument(
        "--fake-stock", action="store_true", help="the plugin does not load although asked for (an old install)"
    )
    parser.add_argument("--fake-startup-delay", type=float, default=0.0)
    parser.add_argument(
        "--fake-bind-delay", type=float, default=0.0, help="seconds before the port is bound (SGLang loads its model)"
    )
    parser.add_argument("--fake-exit-after", type=float, default=None, help="exit with code 3 after this many seconds")
    parser.add_argument("--fake-journal", default=None, help="directory of the call journals")
    parser.add_argument("--fake-exit-file", default=None, help="crash on the first /generate after a sync, once")
    parser.add_argument("--fake-fault-file", default=None, help="a fault (JSON) injected at start, by one process")
    args, _ = parser.parse_known_args(argv)
    return args


def serve(args: argparse.Namespace, model: ServerModel | None = None) -> None:
    """Run the stand-in in this process until it is killed."""
    api_key = args.api_key  # from --config too (parse_args merged it)
    # what 0.5.16 logs at start, its arguments with the key merged from --config among them (`server_args=ServerArgs(
    # ..., api_key='...', ...)`, srt/entrypoints/engine.py:798): the host must keep it out of the log file
    logged = ", ".join(f"{k}={v!r}" for k, v in (vars(args) | {"api_key": api_key}).items())
    sys.stderr.write(f"fake-sglang: server_args=ServerArgs({logged})\n")
    image = (json.loads(args.mm_process_config) if args.mm_process_config else {}).get("image", {})
    plugin = None if args.fake_stock else from_env(os.environ)  # what the plugin's register() reads (None: off)
    state = FakeState(
        model_path=args.model_path,
        api_key=api_key,
        tp_size=args.tp_size,
        deterministic=args.enable_deterministic_inference or args.rl_on_policy_target is not None,
        image_min_pixels=int(image.get("min_pixels", DEFAULT_MIN_PIXELS)),
        image_max_pixels=int(image.get("max_pixels", DEFAULT_MAX_PIXELS)),
        weight_version=args.weight_version,
        initial_weight_version=args.weight_version,
        startup_delay_s=args.fake_startup_delay,
        exit_file=args.fake_exit_file,
        allow_exit=True,
        launcher=plugin is not None,
        marker=None
        if plugin is None
        else new_marker("fake", "stand-in", dict.fromkeys(plugin.patches(), "live"), vars(plugin)),
        pixel_dir=os.environ.get("MILES_VL_SGLANG_PIXEL_DIR"),
        model_dtype={"auto": "float32", "half": "float16", "float": "float32"}.get(args.dtype, args.dtype),
    )
    if args.fake_fault_file and os.path.exists(args.fake_fault_file):
        with open(args.fake_fault_file) as f:
            spec = json.load(f)
        if _claim(args.fake_fault_file):  # one server of the job takes it; its relaunch finds none
            state.faults.setdefault(spec.pop("path"), []).append(Fault(**spec))
    if args.host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"fake-sglang binds loopback only, got --host {args.host}")
    if args.fake_bind_delay:  # SGLang binds its port only once its model is loaded: minutes after its start
        sys.stderr.write(f"fake-sglang: loading for {args.fake_bind_delay}s before binding port {args.port}\n")
        sys.stderr.flush()
        time.sleep(args.fake_bind_delay)
    httpd = FakeHTTPServer(
        ("127.0.0.1", args.port), state, record_only_groups=False, model=model, journal_dir=args.fake_journal
    )
    if args.fake_exit_after is not None:
        threading.Timer(
            args.fake_exit_after, lambda: (sys.stderr.write("fake-sglang: scheduled exit\n"), os._exit(3))
        ).start()
    sys.stderr.write(f"fake-sglang {VERSION} listening on 127.0.0.1:{args.port} (pid {os.getpid()})\n")
    sys.stderr.flush()
    httpd.serve_forever(poll_interval=0.05)


def main(argv: list[str] | None = None) -> None:
    # As 0.5.16's `_set_envs_and_config` (srt/entrypoints/engine.py) does before its scheduler starts: cuMem off for
    # NCCL unless the environment says otherwise. The NCCL path's peers must agree (miles_vl/gpu_env.py).
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    serve(parse_args(argv))


if __name__ == "__main__":
    main()
