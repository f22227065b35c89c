"""A stand-in SGLang server that really generates: fake_server.py's routes and schema checks, with the tiny HF
Qwen3-VL of a checkpoint directory behind them (miles_vl's `HFRolloutEngine`), for the driver's end-to-end tests.

    python -m tests.rollout.sglang.hf_server --model-path CKPT --port P [the flags build_server_argv emits]
        [--fake-journal DIR] [--fake-exit-file F]

What it does as SGLang 0.5.16 does, so that the driver's wiring is exercised for real:
- loads the processor and the weights from `--model-path` at start (and again after a restart);
- takes `input_ids` + `image_data` (PNG data URLs), re-runs the image processor with `--mm-process-config`'s
  min/max pixels and re-expands every vision block from the grid it finds: the prompt ids it answers with are its
  own, so images that do not match the prompt show up as a prompt-id mismatch;
- samples with the request's temperature/top-p/top-k and seed, bans the tokens given a -1e9 `logit_bias`, stops on
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
import threading
from dataclasses import dataclass

import torch
from PIL import Image

from miles_vl.data import load_processor, special_tokens
from miles_vl.model import build_model
from miles_vl.rollout import HFRolloutEngine, SamplingParams
from tests.rollout.sglang.fake_server import BadRequest, parse_args, serve


@dataclass
class _Prompt:
    prompt_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None


class HFServerModel:
    """`fake_server.ServerModel` over a checkpoint directory (weights and processor files)."""

    def __init__(self, model_path: str, *, mm_process_config: str | None, memory_saver: bool, cpu_backup: bool):
        image = (json.loads(mm_process_config) if mm_process_config else {}).get("image", {})
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
        self.cpu_backup = cpu_backup
        self.lock = threading.Lock()  # one generation at a time: the engine seeds torch's global generator

    def generate(self, input_ids, pngs, sampling):
        t = self.tokens
        images = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in pngs]
        pixel_values = grid = None
        if images:
            out = self.processor.image_processor(images=images, return_tensors="pt")
            pixel_values, grid = out["pixel_values"], out["image_grid_thw"]
        prompt_ids = self._expand(input_ids, grid)
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
            seed=int(sampling.get("sampling_seed", 0)),
        )
        prompt = _Prompt(torch.tensor(prompt_ids), pixel_values, grid)
        with self.lock:
            [[gen]] = self.engines[bool(banned)].generate([prompt], params)
        out_ids = gen.response_ids.tolist()
        if gen.finish_reason == "stop":
            finish = {"type": "stop", "matched": out_ids[-1]}
        else:
            finish = {"type": "length", "length": len(out_ids)}
        return out_ids, gen.logprobs.tolist(), finish, prompt_ids

    def _expand(self, input_ids: list[int], grid: torch.Tensor | None) -> list[int]:
        """The prompt ids with each `<vision_start><image_pad>...<vision_end>` block re-expanded from our own grid."""
        t = self.tokens
        counts = [] if grid is None else [int(g.prod()) // self.merge**2 for g in grid]
        out, k, i = [], 0, 0
        while i < len(input_ids):
            out.append(input_ids[i])
            if (
                input_ids[i] == t.vision_start_token_id
                and i + 1 < len(input_ids)
                and input_ids[i + 1] == t.image_token_id
            ):
                if k == len(counts):
                    raise BadRequest(f"more image blocks in input_ids than the {len(counts)} images sent")
                out += [t.image_token_id] * counts[k]
                k += 1
                i += 1
                while i < len(input_ids) and input_ids[i] == t.image_token_id:
                    i += 1
                continue
            i += 1
        if k != len(counts):
            raise BadRequest(f"{len(counts)} images sent for {k} image blocks in input_ids")
        return out

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


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hf-sglang")
    parser.add_argument("--mm-process-config", default=None)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    args = parse_args(argv, parser)
    torch.set_num_threads(1)
    model = HFServerModel(
        args.model_path,
        mm_process_config=args.mm_process_config,
        memory_saver=args.enable_memory_saver,
        cpu_backup=args.enable_weights_cpu_backup,
    )
    serve(args, model)


if __name__ == "__main__":
    main()
