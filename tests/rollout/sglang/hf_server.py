"""A stand-in SGLang server that really generates: fake_server.py's routes and schema checks, with the tiny HF
Qwen3-VL of a checkpoint directory behind them (miles_vl's `HFRolloutEngine`), for the driver's end-to-end tests.

    python -m tests.rollout.sglang.hf_server --model-path CKPT --port P [the flags build_server_argv emits]
        [--fake-journal DIR] [--fake-exit-file F]

What it does as SGLang 0.5.16 does, so that the driver's wiring is exercised for real:
- loads the processor and the weights from `--model-path` at start (and again after a restart);
- takes `input_ids` + `image_data` (PNG data URLs) as 0.5.16 does (`sglang_prompt`): decodes the ids, runs the
  checkpoint's processor on the text and the images with `--mm-process-config`'s min/max pixels (the expanded form
  raises StopIteration there: HTTP 500), and expands each single `<|image_pad|>` to its image's token count: the
  prompt ids it answers with are its own, so images that do not match the prompt show up as a prompt-id mismatch;
- takes `input_ids` + `processor_output` items (images and videos) as 0.5.16 run by miles_vl's launcher does
  (fake_server.py): the ids as sent, the pixel values read from the pixel directory;
- samples with the request's temperature/top-p/top-k (and its `sampling_seed` only with
  `--enable-deterministic-inference`, as 0.5.16), bans the tokens given a -1e9 `logit_bias`, stops on
  `stop_token_ids`, and reports the sampled tokens' logprobs;
- `/update_weights_from_tensor` and `/update_weights_from_distributed` copy the received tensors into the model;
- with `--enable-memory-saver`, resuming the `weights` tag without `--enable-weights-cpu-backup` leaves the weights
  undefined (NaN here), and `/generate` is refused while memory is released.
Every weight-version update journals a digest of the weights (`--fake-journal`), so a test can compare the server's
weights with the trainer's after each sync.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import re
import threading
from dataclasses import dataclass

import torch
from PIL import Image

from miles_vl.data import load_processor
from miles_vl.models.qwen3_vl.model import build_model
from miles_vl.models.qwen3_vl.tokens import special_tokens
from miles_vl.rollout import HFRolloutEngine, SamplingParams
from tests.rollout.sglang.fake_server import BadRequest, ServerError, parse_args, serve

VISION_BLOCK = re.compile(r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>")  # qwen_vl.py:301


@dataclass
class _Prompt:
    prompt_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None


class HFServerModel:
    """`fake_server.ServerModel` over a checkpoint directory (weights and processor files)."""

    def __init__(
        self,
        model_path: str,
        *,
        mm_process_config: str | None,
        memory_saver: bool,
        cpu_backup: bool,
        deterministic: bool = False,
    ):
        image = (json.loads(mm_process_config) if mm_process_config else {}).get("image", {})
        self.image_kwargs = image  # SGLang passes them as the processor's images_kwargs (base_processor.py:431)
        self.processor = load_processor(model_path, image.get("min_pixels", 3136), image.get("max_pixels", 12544))
        self.tokens = special_tokens(self.processor)
        self.model = build_model(self.tokens, path=model_path, dtype=torch.float32)
        self.merge = int(self.processor.image_processor.merge_size)
        self.vision_ids = {
            self.tokens.image_token_id,
            self.tokens.video_token_id,
            self.tokens.vision_start_token_id,
            self.tokens.vision_end_token_id,
        }
        self.engines = {ban: HFRolloutEngine(self.model, self.tokens, ban_vision_tokens=ban) for ban in (True, False)}
        self.memory_saver = memory_saver
        self._names = set(self.model.state_dict())
        self.deterministic = deterministic
        self.cpu_backup = cpu_backup
        self.lock = threading.Lock()  # one generation at a time: the engine seeds torch's global generator

    def generate(self, input_ids, pngs, sampling, *, pixels=None):
        t = self.tokens
        images = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in pngs]
        pixel_values = grid = None
        prompt_ids = list(input_ids)
        pixels = pixels or {}
        if images:
            prompt_ids, pixel_values, grid = sglang_prompt(self.processor, input_ids, images, self.image_kwargs)
        elif pixels:  # processor_output items, read by the launcher: the ids as sent (0.5.16's fast path)
            pixel_values, grid = pixels.get("pixel_values"), pixels.get("image_grid_thw")
        banned = {int(k) for k, v in (sampling.get("logit_bias") or {}).items() if v <= -1e8}
        if banned and banned != self.vision_ids:
            raise BadRequest(f"this stand-in bans either the vision tokens or nothing, got logit_bias on {banned}")
        if set(sampling.get("stop_token_ids") or []) != set(t.eos_token_ids):
            raise BadRequest(
                f"stop_token_ids {sampling.get('stop_token_ids')} differ from the model's {t.eos_token_ids}"
            )
        params = SamplingParams(
            n=1,
            max_new_tokens=int(sampling["max_new_tokens"]),
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)),
            top_k=int(sampling.get("top_k", -1)),
            # 0.5.16 samples with the request's seed only with --enable-deterministic-inference (42 when absent),
            # else from the global generator: a fresh seed per request here.
            seed=int(sampling.get("sampling_seed", 42)) if self.deterministic else random.getrandbits(63),
        )
        videos, video_grid = pixels.get("pixel_values_videos"), pixels.get("video_grid_thw")
        prompt = _Prompt(torch.tensor(prompt_ids), pixel_values, grid, videos, video_grid)
        with self.lock:
            [[gen]] = self.engines[bool(banned)].generate([prompt], params)
        out_ids = gen.response_ids.tolist()
        if gen.finish_reason == "stop":
            finish = {"type": "stop", "matched": out_ids[-1]}
        else:
            finish = {"type": "length", "length": len(out_ids)}
        return out_ids, gen.logprobs.tolist(), finish, prompt_ids

    def names(self) -> set[str]:
        return self._names

    def load(self, named_tensors) -> None:
        with self.lock:
            try:
                self.engines[True].load_weights([(n, t.detach().clone()) for n, t in named_tensors])
            except ValueError as e:
                raise BadRequest(str(e)) from e

    def resumed(self, tags) -> None:
        if "weights" in tags and self.memory_saver and not self.cpu_backup:
            with self.lock, torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))  # released weights come back undefined: only a sync makes them usable

    def digest(self) -> dict[str, str]:
        with self.lock:
            return {name: tensor_digest(p) for name, p in self.model.named_parameters()}


def sglang_prompt(
    processor, input_ids: list[int], images: list[Image.Image], image_kwargs: dict
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """What SGLang 0.5.16 does with `input_ids` + images for Qwen3-VL, with the real processor: decode the ids
    (`load_mm_data`), check one `<|vision_start|><|image_pad|>+<|vision_end|>` block per image (else its legacy path,
    not modelled), run the processor on the decoded text and the images with `--mm-process-config`'s image kwargs
    (`process_mm_data`; more pads than images raise StopIteration there: the real server's HTTP 500), then keep our
    ids and expand the i-th pad to image i's token count when the counts agree (`SGLANG_MM_AVOID_RETOKENIZE`,
    `_expand_input_ids`), else keep the processor's re-tokenized ids (0.5.16 logs a warning then).

    Returns:
        (the prompt ids the server runs, pixel_values, image_grid_thw).

    Raises:
        ServerError: more image pads than images.
        BadRequest: not one vision block per image.
    """
    text = processor.tokenizer.decode(input_ids)
    blocks = len(VISION_BLOCK.findall(text))
    if blocks != len(images):
        raise BadRequest(
            f"{len(images)} image(s) for {blocks} vision block(s) in input_ids (0.5.16 would take its legacy "
            "multimodal path here, which this stand-in does not model)"
        )
    try:
        out = processor(text=[text], images=images, images_kwargs=dict(image_kwargs), return_tensors="pt")
    except StopIteration as e:
        raise ServerError(
            f"StopIteration in the HF processor ({type(processor).__name__}) called by "
            "BaseMultimodalProcessor.process_mm_data: the decoded prompt holds more <|image_pad|> tokens than the "
            f"{len(images)} image(s) sent; send one <|image_pad|> per image block, SGLang expands it"
        ) from e
    processed = out["input_ids"][0].tolist()
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    counts = processor._get_num_multimodal_tokens(image_sizes=[(im.height, im.width) for im in images])
    counts = [int(c) for c in counts.num_image_tokens]
    if processed.count(image_id) != sum(counts) or input_ids.count(image_id) != len(counts):
        return processed, out["pixel_values"], out["image_grid_thw"]
    expanded, k = [], 0
    for token in input_ids:
        if token == image_id:
            expanded += [image_id] * counts[k]
            k += 1
        else:
            expanded.append(token)
    return expanded, out["pixel_values"], out["image_grid_thw"]


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hf-sglang")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    args = parse_args(argv, parser)
    torch.set_num_threads(1)
    model = HFServerModel(
        args.model_path,
        mm_process_config=args.mm_process_config,
        memory_saver=args.enable_memory_saver,
        cpu_backup=args.enable_weights_cpu_backup,
        deterministic=args.enable_deterministic_inference or args.rl_on_policy_target is not None,
    )
    serve(args, model)


if __name__ == "__main__":
    main()
