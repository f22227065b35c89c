"""The `/generate` exchange: request building, response parsing, and the check that SGLang saw our prompt ids.

Schema source: SGLang 0.5.16 (see docs/sglang.md for the wheel and its hash):

- request body `GenerateReqInput` (`python/sglang/srt/managers/io_struct.py`) with `input_ids`, `image_data`,
  `sampling_params` (fields of `SamplingParams` in `python/sglang/srt/sampling/sampling_params.py`; an unknown key
  is a TypeError there), `return_logprob` and `return_prompt_token_ids`;
- response (`TokenizerManager._handle_batch_output` and `add_logprob_to_meta_info` in
  `python/sglang/srt/managers/tokenizer_manager.py`): `output_ids` (the stop token included: the detokenizer trims
  it from `text` only), `prompt_token_ids` (the ids after SGLang's multimodal processor, real image token ids,
  before the scheduler's hash padding; required: every request asks for them), and `meta_info` with `finish_reason`
  (`{"type": "stop", "matched": id}`, `{"type": "length", "length": n}` or `{"type": "abort", "message": ...}`;
  `python/sglang/srt/managers/schedule_batch.py`), `prompt_tokens`, `weight_version` and `output_token_logprobs` =
  `[[logprob, token_id, text|null], ...]`, one per output id.

How SGLang 0.5.16 reads `input_ids` + `image_data` for Qwen3-VL (`srt/multimodal/processors/base_processor.py`,
`BaseMultimodalProcessor.load_mm_data` -> `fast_load_mm_data` -> `process_and_combine_mm_data` -> `process_mm_data`,
and `qwen_vl.py` `process_mm_data_async`): it decodes the ids back to text and runs the HF processor on that text and
the images. The processor expands EVERY `<|image_pad|>` it finds into that image's token count, so the canonical
(already expanded) ids run it out of images: `StopIteration` in transformers' `get_text_with_replacements`, HTTP 500
(measured on an H100, 2026-11-23). So the request carries one `<|image_pad|>` per image block (`request_input_ids`);
the processor expands each, and with `SGLANG_MM_AVOID_RETOKENIZE` (on by default in 0.5.16, `srt/environ.py`)
SGLang keeps our other tokens verbatim and only re-expands the pads (`_expand_input_ids`). The prompt it finally
uses can still differ from ours (other min/max pixels, an image that is not the one the prompt was built from), so
every response is checked against our canonical ids with `return_prompt_token_ids`.

Logprobs: 0.5.16 returns log softmax(logits / T) of the sampled token (`Sampler.forward` in
`python/sglang/srt/layers/sampler.py`): top-p/top-k truncation is not applied to the reported value, and
`logit_bias` is. With top_p=1 and top_k=-1 this is the distribution the trainer scores and equals the hf engine's.

`sampling_params.n` > 1 (`TokenizerManager._handle_batch_request`, `srt/managers/tokenizer_manager.py:1630-1683`):
SGLang tokenizes the prompt and runs its image processor, hash and transfer once (`_tokenize_one_request`), sends a
prefill-only copy (`max_new_tokens = 0`) that puts the prompt in the radix cache and waits for it, then sends `n`
copies of the same tokenized request with fresh rids and the same sampling parameters, `sampling_seed` included
(so with `--enable-deterministic-inference` all `n` samples would be the same). The answer is a JSON list of the `n`
bodies, each as for one request, in order; an abort with a status code fails the whole call, one without (200 with
`finish_reason.type == "abort"`) only its own body.

Images are sent as PNG data URLs of the decoded pixels: lossless, and the server never decodes a JPEG with nvJPEG
(0.5.16 does so on the GPU in `python/sglang/srt/utils/common.py:_load_image`), whose output can differ from PIL's.

With miles_vl's SGLang plugin (`miles_vl/sglang_plugin/`) a prompt goes as what the trainer sees instead
(`pixel_media`): its canonical ids (image and video tokens expanded), and one `processor_output` item per modality
holding its grids and a reference to its pixel values, which the engine writes into the server's pixel directory
(`write_tensor`) in the server model's dtype. SGLang then runs neither its image processor nor its tokenizer on the
prompt; its MRoPE positions come from our ids and grids (`QwenVLImageProcessor.process_mm_data_async`,
`qwen_vl.py:770-810`), and videos keep our frames and timestamps. The ids are checked here against the grids
(`vision_inputs`), since the server no longer re-derives them. A one-image item also carries our hash of its pixels
(`pixel_hash`), which SGLang takes as the image's hash instead of computing its own.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from miles_vl.models import SpecialTokens
from miles_vl.rollout.sglang.client import SGLangResponseError
from miles_vl.rollout.types import Generation, SamplingParams
from miles_vl.sglang_plugin.wire import FEATURE_GRIDS, FILE_KEY, write_tensor

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BANNED_LOGIT_BIAS = -1.0e9  # JSON has no -inf; exp(-1e9) is exactly 0 in fp32


class PromptMismatchError(ValueError):
    """SGLang's prompt ids differ from the canonical ones (DESIGN §2: a mismatch is an error)."""


class GenerationAbortedError(RuntimeError):
    """SGLang finished a request with `finish_reason.type == "abort"` (retried a bounded number of times)."""


# ---------------------------------------------------------------------------------------------------------------------
# images


def image_data_url(image: Image.Image | bytes | bytearray) -> str:
    """A `data:image/png;base64,...` URL of the image's decoded pixels.

    Args:
        image: a PIL image, or encoded image bytes (PNG bytes are sent as they are; other formats are decoded with
            PIL and re-encoded as PNG so the server sees the pixels our processor saw).

    Returns:
        The data URL SGLang's `load_image` accepts.

    Raises:
        TypeError: anything else (paths and URLs are not accepted: the server would fetch them itself).
    """
    if isinstance(image, bytes | bytearray):
        raw = bytes(image)
        if not raw.startswith(PNG_SIGNATURE):
            with Image.open(io.BytesIO(raw)) as decoded:
                raw = _png(decoded)
    elif isinstance(image, Image.Image):
        raw = _png(image)
    else:
        raise TypeError(
            f"an image for SGLang must be a PIL image or encoded bytes, found {type(image).__name__}; "
            "load paths/URLs into PIL images when building the prompt record"
        )
    return "data:image/png;base64," + base64.b64encode(raw).decode("ascii")


def image_hash(url: str) -> str:
    """The content hash SGLang gets for an image in `mm_hashes` (16 hex digits of a BLAKE2b of its data URL).

    With it the server keys its prefix cache on our hash instead of a SHA-256 of the processed pixel values
    (`GenerateReqInput.mm_hashes`, `srt/managers/io_struct.py:193`; read in `srt/managers/tokenizer_manager.py:946`).
    Same bytes, same pixels: equal images share a prefix, different images do not (64 bits; SGLang itself keeps 30
    of them for the pad value). 0.5.16 drops `mm_hashes` from a request with `sampling_params.n > 1`
    (`GenerateReqInput.__getitem__` does not copy it); there the server hashes the pixels once per request
    (`SGLANG_MM_PRECOMPUTE_HASH`, server.py).
    """
    return hashlib.blake2b(url.encode("ascii"), digest_size=8).hexdigest()


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)  # speed over size: the bytes only cross loopback
    return buf.getvalue()


def prompt_images(prompt: Any, index: int, video_token_id: int | None = None) -> list[Image.Image | bytes]:
    """The images of prompt `index`, checked against its `image_grid_thw` rows.

    Without pixel values (SGLang's own `launch_server`, or `rollout.sglang.send_pixel_values: false`) the sglang
    engine needs `prompt.images` (PIL images or encoded bytes, in the order their blocks appear in `prompt_ids`):
    SGLang runs its image processor again on the original images.

    Raises:
        ValueError: images missing or not one per `image_grid_thw` row; a prompt with video tokens (in this form
            SGLang would re-sample our video its own way: videos go as pixel values only).
    """
    grid_v = getattr(prompt, "video_grid_thw", None)
    has_video_tokens = video_token_id is not None and bool((torch.as_tensor(prompt.prompt_ids) == video_token_id).any())
    if (grid_v is not None and int(grid_v.shape[0])) or has_video_tokens:
        raise ValueError(
            f"prompt {index} holds a video, and this engine sends PNG images (SGLang 0.5.16 re-samples and re-sizes "
            "`video_data` its own way and writes other frame timestamps, so its prompt ids would not be ours: "
            "docs/sglang.md, section 4, Pixel values). Send pixel values (rollout.sglang.send_pixel_values: true, "
            "with launcher: miles_vl, miles_vl's SGLang plugin), or use rollout.backend=hf for video prompts"
        )
    grid = getattr(prompt, "image_grid_thw", None)
    n_grid = 0 if grid is None else int(grid.shape[0])
    images = getattr(prompt, "images", None)
    if images is None:
        if n_grid:
            raise ValueError(
                f"prompt {index} has {n_grid} image(s) (image_grid_thw rows) but no `images` attribute: the sglang "
                "engine sends the original images with the prompt ids (SGLang runs its own image processor and takes "
                "no pixel_values). Keep the decoded images on the prompt record as `images` (PIL images or encoded "
                "bytes, in prompt order)"
            )
        return []
    images = list(images)
    if len(images) != n_grid:
        raise ValueError(
            f"prompt {index} carries {len(images)} image(s) in `images` but {n_grid} image_grid_thw row(s); they "
            "must be the same images, one per vision block of prompt_ids, in order"
        )
    return images


@dataclass(frozen=True)
class PromptMedia:
    """What one prompt puts into a `/generate` body besides its sampling parameters.

    Attributes:
        input_ids: the ids sent: `request_input_ids` of the canonical ids with PNG images, the canonical ids themselves
            with pixel values.
        image_data: PNG data URLs, one per image; or one `processor_output` item holding all the prompt's images.
        video_data: one `processor_output` item holding all the prompt's videos, or none.
        mm_hashes: `image_hash` of each data URL (PNG images only).
        files: names written into the server's pixel directory for this prompt (the engine deletes them).
    """

    input_ids: list[int]
    image_data: list = field(default_factory=list)
    video_data: list = field(default_factory=list)
    mm_hashes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def png_media(prompt: Any, index: int, tokens: SpecialTokens) -> PromptMedia:
    """A prompt for SGLang's own launch_server: one pad per image block and the images as PNG data URLs (module
    docstring). Raises what `prompt_images` raises."""
    urls = [image_data_url(im) for im in prompt_images(prompt, index, tokens.video_token_id)]
    ids = [int(t) for t in prompt.prompt_ids.tolist()]
    return PromptMedia(
        input_ids=request_input_ids(ids, tokens.image_token_id, len(urls)) if urls else ids,
        image_data=urls,
        mm_hashes=[image_hash(u) for u in urls],
    )


def _runs(ids: list[int], token: int) -> list[int]:
    """Lengths of the maximal runs of `token` in `ids`, in order."""
    runs: list[int] = []
    previous = None
    for t in ids:
        if t == token:
            if previous == token:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = t
    return runs


def vision_inputs(
    prompt: Any, index: int, tokens: SpecialTokens, spatial_merge_size: int
) -> list[tuple[str, Tensor, Tensor]]:
    """The prompt's pixel values with their grids, checked against its canonical ids, as (processor_output key,
    pixels [patches, dim], grid [n, 3]) for its images, then its videos (only the modalities it has).

    An image of grid (t, h, w) is one run of t*h*w / merge^2 `<|image_pad|>` tokens; a video is t runs of
    h*w / merge^2 `<|video_pad|>` tokens (Qwen3-VL gives every frame group its own block and timestamp); the pixel
    rows of a modality add up to its grids' t*h*w.

    Raises:
        ValueError: pads without grids or pixel values, or counts that disagree (named).
    """
    ids = [int(t) for t in prompt.prompt_ids.tolist()]
    merge2 = spatial_merge_size**2
    out = []
    for key, token, name in (
        ("pixel_values", tokens.image_token_id, "image"),
        ("pixel_values_videos", tokens.video_token_id, "video"),
    ):
        grid_key = FEATURE_GRIDS[key]
        grid, pixels, runs = getattr(prompt, grid_key, None), getattr(prompt, key, None), _runs(ids, token)
        rows = [] if grid is None else [[int(x) for x in row] for row in torch.as_tensor(grid).reshape(-1, 3).tolist()]
        if not rows and not runs:
            continue
        where = f"prompt {index}"
        if name == "image":
            expected = [t * h * w // merge2 for t, h, w in rows]
        else:  # one block per frame group
            expected = [h * w // merge2 for t, h, w in rows for _ in range(t)]
        if runs != expected:
            raise ValueError(
                f"{where}: its {name} blocks in prompt_ids hold {runs} tokens, but {grid_key} {rows} asks for "
                f"{expected} (spatial merge {spatial_merge_size}); the ids and grids must come from one processor call"
            )
        if pixels is None:
            raise ValueError(f"{where} has {len(rows)} {name} grid row(s) but no {key}")
        patches = sum(t * h * w for t, h, w in rows)
        if pixels.ndim != 2 or pixels.shape[0] != patches:
            raise ValueError(f"{where}: {key} has shape {tuple(pixels.shape)}, {grid_key} {rows} needs {patches} rows")
        out.append((key, pixels, torch.tensor(rows, dtype=torch.long)))
    return out


def pixel_media(
    prompt: Any,
    index: int,
    tokens: SpecialTokens,
    *,
    directory: str,
    dtype: torch.dtype,
    spatial_merge_size: int,
) -> PromptMedia:
    """A prompt for miles_vl's launcher: its canonical ids and its own pixel values, written into the server's pixel
    directory as `dtype` (module docstring). Raises what `vision_inputs` raises."""
    items: dict[str, dict] = {}
    files: list[str] = []
    try:
        for key, pixels, grid in vision_inputs(prompt, index, tokens, spatial_merge_size):
            wire = pixels.to(dtype)
            try:
                ref = write_tensor(directory, wire)
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"writing prompt {index}'s {key} into {directory} failed: {e.strerror or e}. It is shared memory: "
                    "a container's /dev/shm holds 64 MiB unless started with a larger --shm-size (SGLang itself needs "
                    "a large one); make it larger, or set rollout.sglang.send_pixel_values=false",
                ) from e
            files.append(ref[FILE_KEY])
            items[key] = {"format": "processor_output", key: ref, FEATURE_GRIDS[key]: grid.tolist()}
            if key == "pixel_values" and len(grid) == 1:
                items[key]["hash"] = pixel_hash(wire, grid)
    except BaseException:
        remove_files(directory, files)
        raise
    return PromptMedia(
        input_ids=[int(t) for t in prompt.prompt_ids.tolist()],
        image_data=[items["pixel_values"]] if "pixel_values" in items else [],
        video_data=[items["pixel_values_videos"]] if "pixel_values_videos" in items else [],
        files=files,
    )


def pixel_hash(pixels: Tensor, grid: Tensor) -> int:
    """The content hash a one-image `processor_output` item carries as `"hash"` (63 bits of a SHA-256 of the pixel
    values' dtype, shape, grid and bytes, as sent).

    0.5.16 keys the image's prefix in the radix cache on it and takes it as the item's hash
    (`collect_mm_items_from_processor_output`, `srt/multimodal/processors/base_processor.py:1201-1210`), so its
    tokenizer does not hash the pixel values itself: it does so in the processor (`set_pad_value` in
    `process_and_combine_mm_data`, `:1473-1478`, a SHA-256 of the 2.4 MB of a 196-token image, serially for every
    prompt of a request) before it reads `mm_hashes`. Equal pixels give equal hashes, so equal images share a prefix
    as with SGLang's own hash (whose pad value, the prefix cache's key, keeps 30 bits of either). Only for one image:
    0.5.16 splits an item of several images per image and drops the item's hash (`get_new_expanded_mm_items`,
    `srt/managers/mm_utils.py:1750`), so it hashes each of those images itself."""
    digest = hashlib.sha256(f"{pixels.dtype} {list(pixels.shape)} {grid.tolist()}".encode())
    data = pixels.detach().to("cpu").contiguous()
    digest.update(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
    return int.from_bytes(digest.digest()[:8], "big") >> 1


def remove_files(directory: str, names: Sequence[str]) -> None:
    """Delete the named files of the pixel directory (those already gone are skipped)."""
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------------------------------------------------
# request


def sampling_seed(seed: int, prompt_index: int, sample_index: int, n: int) -> int:
    """Per-request `sampling_seed`: distinct for every (prompt, sample) of a call, a pure function of the inputs.

    SGLang 0.5.16 honours it only with `--enable-deterministic-inference` (`SamplingBatchInfo.from_schedule_batch`,
    `srt/sampling/sampling_batch_info.py:114`, builds no seed tensor otherwise); without the flag sampling is not
    reproducible by seed. With the flag, top-p and top-k are fine (the flag forces the pytorch sampling backend,
    `srt/arg_groups/overrides.py:1586`, so flashinfer's "Sampling seed is not supported" assert,
    `srt/layers/sampler.py:250`, is not reached); the one combination 0.5.16 asserts on is a seed with `min_p > 0`
    (`sampler.py:570`, an assert in the scheduler that kills the server), and miles_vl never sends `min_p`.
    """
    return (seed * 1_000_003 + prompt_index * n + sample_index) % (2**63)


def request_input_ids(prompt_ids: Sequence[int], image_token_id: int, n_images: int) -> list[int]:
    """The `input_ids` SGLang 0.5.16 takes with `image_data`: the canonical ids with each run of `image_token_id`
    (one image's expanded block) collapsed to a single pad, which SGLang's processor expands again (module docstring).

    Args:
        prompt_ids: canonical ids, image tokens expanded.
        image_token_id: `<|image_pad|>`.
        n_images: images sent with the request; must equal the number of pad runs.

    Raises:
        ValueError: the runs of image pads are not one per image.
    """
    out: list[int] = []
    runs = 0
    for t in prompt_ids:
        t = int(t)
        if t == image_token_id:
            if out and out[-1] == image_token_id:
                continue
            runs += 1
        out.append(t)
    if runs != n_images:
        raise ValueError(
            f"the prompt has {runs} block(s) of image tokens ({image_token_id}) but {n_images} image(s) go with it; "
            "each image must have exactly one expanded block in prompt_ids, in order"
        )
    return out


def build_generate_payload(
    prompt_ids: Sequence[int],
    image_data: Sequence[str | Mapping[str, Any]],
    params: SamplingParams,
    *,
    seed: int,
    stop_token_ids: Sequence[int],
    banned_token_ids: Sequence[int] = (),
    n: int = 1,
    image_hashes: Sequence[str] = (),
    video_data: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """One `GenerateReqInput` body: one prompt, `n` samples (engine.py decides how a call's samples are split into
    requests; `params.n` is not read here).

    Args:
        prompt_ids: the ids to send (`PromptMedia.input_ids`).
        image_data: `image_data_url` of each image, in prompt order; or one `processor_output` item (`pixel_media`).
        params: sampling parameters.
        seed: this request's `sampling_seed` (SGLang gives it to all `n` samples).
        stop_token_ids: EOS ids; generation stops after emitting one (it stays in `output_ids`).
        banned_token_ids: ids given a -1e9 logit bias (e.g. vision tokens, as the hf engine bans them).
        n: samples of this prompt in this request (`sampling_params.n`); the server answers a list of `n` bodies
            when n > 1.
        image_hashes: `image_hash` of each image URL (sent as `mm_hashes`), or none.
        video_data: one `processor_output` item of the prompt's videos (`pixel_media`), or none.

    Returns:
        The JSON body.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, found {n}")
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 disables top-k; 0 is rejected
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "sampling_seed": seed,
    }
    if n > 1:
        sampling["n"] = n
    if banned_token_ids:
        sampling["logit_bias"] = {str(int(t)): BANNED_LOGIT_BIAS for t in banned_token_ids}
    payload: dict[str, Any] = {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": sampling,
        "return_logprob": True,
        "return_prompt_token_ids": True,
        "stream": False,
    }
    if image_data:
        payload["image_data"] = list(image_data)
    if video_data:
        payload["video_data"] = list(video_data)
    if image_hashes:
        if len(image_hashes) != len(image_data):
            raise ValueError(f"{len(image_hashes)} image hashes for {len(image_data)} images")
        payload["mm_hashes"] = list(image_hashes)
    return payload


def batch_payload(payloads: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One batched `GenerateReqInput` body from single-prompt bodies of `build_generate_payload` (same settings, each
    with its own ids, images, hashes and sampling parameters): SGLang answers `len(payloads) x n` bodies, prompt by
    prompt. Every body must ask for the same `n` (SGLang refuses a batch that mixes them)."""
    if not payloads:
        raise ValueError("batch_payload of no requests")
    ns = {p["sampling_params"].get("n", 1) for p in payloads}
    if len(ns) > 1:
        raise ValueError(f"the requests of one batch must ask for the same n, found {sorted(ns)}")
    per_prompt = ("input_ids", "sampling_params", "image_data", "video_data", "mm_hashes")
    shared = [{k: v for k, v in p.items() if k not in per_prompt} for p in payloads]
    if any(s != shared[0] for s in shared):
        raise ValueError("the requests of one batch differ in more than their prompts and sampling parameters")
    batch = dict(shared[0])
    batch["input_ids"] = [list(p["input_ids"]) for p in payloads]
    batch["sampling_params"] = [dict(p["sampling_params"]) for p in payloads]
    for key in ("image_data", "video_data"):  # a prompt without this modality: [] (SGLang: none)
        if any(key in p for p in payloads):
            batch[key] = [list(p.get(key, ())) for p in payloads]
    if any("mm_hashes" in p for p in payloads):  # 0.5.16 ignores these for a batch; miles_vl's launcher reads them
        batch["mm_hashes"] = [list(p.get("mm_hashes", ())) for p in payloads]
    return batch


# ---------------------------------------------------------------------------------------------------------------------
# response


def parse_generate_response(
    body: dict[str, Any],
    *,
    prompt_ids: Sequence[int],
    stop_token_ids: Collection[int],
    max_new_tokens: int,
    prompt_index: int,
) -> tuple[Generation, str | None]:
    """Turn one `/generate` response into a `Generation`, checking it against what we sent.

    Args:
        body: the response dict.
        prompt_ids: the canonical ids we sent.
        stop_token_ids: the EOS ids we sent.
        max_new_tokens: the limit we sent.
        prompt_index: for error messages.

    Returns:
        (generation, meta_info.weight_version).

    Raises:
        GenerationAbortedError: the server aborted the request.
        PromptMismatchError: SGLang's prompt ids differ from ours.
        SGLangResponseError: the body breaks the 0.5.16 schema or contradicts itself (`prompt_token_ids` missing
            included: every request asks for them).
    """
    where = f"/generate for prompt {prompt_index}"
    meta = _field(body, "meta_info", dict, where)
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or "type" not in finish:
        raise SGLangResponseError(f"{where}: meta_info.finish_reason is {finish!r}; expected {{'type': ...}}")
    if finish["type"] == "abort":
        raise GenerationAbortedError(f"{where}: SGLang aborted the request: {finish.get('message')}")

    # Every request asks for them (`build_generate_payload`), and 0.5.16 answers them on every non-streaming path
    # (`TokenizerManager._handle_batch_output`, from the request state that `generate_request` and
    # `_handle_batch_request` fill); without them the check that SGLang saw our ids would be off, silently.
    theirs = body.get("prompt_token_ids")
    if theirs is None:
        raise SGLangResponseError(
            f"{where}: the response has no prompt_token_ids, which the request asked for (return_prompt_token_ids), "
            "so the engine cannot check that SGLang saw our prompt ids. SGLang 0.5.16 returns them on every path; "
            "a server that leaves them out is another release, or a patch of its tokenizer (miles_vl's SGLang plugin: "
            "the grouped copies of `handle_grouped`) did not set them: run a supported SGLang release, or SGLang's own "
            "server (rollout.sglang.launcher=sglang) to tell the two apart"
        )
    check_prompt_tokens(prompt_ids, theirs, prompt_index=prompt_index)
    prompt_tokens = meta.get("prompt_tokens")
    if prompt_tokens is not None and int(prompt_tokens) != len(prompt_ids):
        raise PromptMismatchError(
            f"prompt {prompt_index}: SGLang counted {prompt_tokens} prompt tokens, miles_vl sent {len(prompt_ids)}. "
            + _MISMATCH_HINT
        )

    output_ids, logprobs = _output_tokens(body, meta, where)
    if not output_ids:
        raise SGLangResponseError(f"{where}: empty output_ids (finish_reason {finish})")
    if len(output_ids) > max_new_tokens:
        raise SGLangResponseError(f"{where}: {len(output_ids)} tokens returned, max_new_tokens was {max_new_tokens}")

    if finish["type"] == "stop":
        if int(output_ids[-1]) not in stop_token_ids:
            raise SGLangResponseError(
                f"{where}: SGLang stopped (matched {finish.get('matched')!r}) but the last token {output_ids[-1]} "
                f"is not one of our EOS ids {sorted(stop_token_ids)}; the server stops on the model's own EOS ids "
                "too: add them to SpecialTokens.eos_token_ids"
            )
        reason = "stop"
    elif finish["type"] == "length":
        reason = "length"
    else:
        raise SGLangResponseError(f"{where}: unknown finish_reason type {finish['type']!r}")
    generation = Generation(
        response_ids=torch.tensor(output_ids, dtype=torch.long),
        logprobs=torch.tensor(logprobs, dtype=torch.float32),
        finish_reason=reason,
    )
    version = meta.get("weight_version")
    return generation, None if version is None else str(version)


def parse_aborted_response(
    body: dict[str, Any], *, prompt_ids: Sequence[int], prompt_index: int
) -> tuple[list[int], list[float], str | None] | None:
    """The output so far of a request SGLang aborted (`finish_reason.type == "abort"`, HTTP 200), as 0.5.16 answers
    an `/abort_request` that reaches a decoding request (scheduler.py `abort_request`: `to_finish = FINISH_ABORT()`,
    one more decode step, then a normal answer with the output ids so far and, with `return_logprob`, one logprob
    each; one still waiting in the queue comes back with none).

    Returns:
        (output ids so far, their logprobs, meta_info.weight_version), or None when the body is not an abort.

    Raises:
        PromptMismatchError: the answer names other prompt ids than ours.
        SGLangResponseError: output ids and logprobs that do not pair up.
    """
    where = f"/generate for prompt {prompt_index}"
    meta = _field(body, "meta_info", dict, where)
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") != "abort":
        return None
    if body.get("prompt_token_ids") is not None:  # an abort in the waiting queue may come back before tokenizing
        check_prompt_tokens(prompt_ids, body["prompt_token_ids"], prompt_index=prompt_index)
    if not body.get("output_ids"):
        return [], [], None
    output_ids, logprobs = _output_tokens(body, meta, where)
    version = meta.get("weight_version")
    return [int(t) for t in output_ids], logprobs, None if version is None else str(version)


def _output_tokens(body: dict[str, Any], meta: dict[str, Any], where: str) -> tuple[list, list[float]]:
    """`output_ids` and the logprob of each (`meta_info.output_token_logprobs`), checked to pair up."""
    output_ids = _field(body, "output_ids", list, where)
    logprob_rows = _field(meta, "output_token_logprobs", list, where + " meta_info")
    if len(logprob_rows) != len(output_ids):
        raise SGLangResponseError(
            f"{where}: {len(output_ids)} output ids but {len(logprob_rows)} output_token_logprobs; was "
            "return_logprob sent?"
        )
    logprobs = []
    for k, (row, token) in enumerate(zip(logprob_rows, output_ids, strict=True)):
        if not isinstance(row, list | tuple) or len(row) < 2 or row[0] is None or int(row[1]) != int(token):
            raise SGLangResponseError(
                f"{where}: output_token_logprobs[{k}] = {row!r} does not score output_ids[{k}] = {token}"
            )
        logprobs.append(float(row[0]))
    return output_ids, logprobs


_MISMATCH_HINT = (
    "The engine must see exactly the canonical prompt ids (DESIGN §2). Likely causes: the server's image processor "
    "resizes differently (set ServerSpec.image_min_pixels/image_max_pixels to data.min_pixels/max_pixels), the "
    "`images` are not those the prompt was built from, or the prompt text does not survive decode + re-tokenize."
)


def check_prompt_tokens(ours: Sequence[int], theirs: Sequence[int], *, prompt_index: int) -> None:
    """Raise `PromptMismatchError` naming the first position where SGLang's prompt ids differ from ours."""
    ours = [int(t) for t in ours]
    theirs = [int(t) for t in theirs]
    if ours == theirs:
        return
    first = next((k for k, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    lo = max(0, first - 3)
    raise PromptMismatchError(
        f"prompt {prompt_index}: SGLang's prompt ids differ from miles_vl's at position {first} "
        f"(miles_vl {_at(ours, first)}, SGLang {_at(theirs, first)}; lengths {len(ours)} vs {len(theirs)}; "
        f"miles_vl[{lo}:{first + 4}] = {ours[lo : first + 4]}, SGLang[{lo}:{first + 4}] = {theirs[lo : first + 4]}). "
        + _MISMATCH_HINT
    )


def _at(ids: list[int], k: int) -> str:
    return str(ids[k]) if k < len(ids) else "<end>"


def _field(body: dict, key: str, kind: type, where: str) -> Any:
    value = body.get(key)
    if not isinstance(value, kind):
        raise SGLangResponseError(f"{where}: `{key}` is {value!r}; expected a {kind.__name__} (SGLang 0.5.16 schema)")
    return value
