"""The embedded rollout engine: transformers `generate` in-process (CPU or one GPU), batched, with images and videos.

    engine = HFRolloutEngine(model, tokens)                            # in this process (tests, benchmarks)
    actor = ray.remote(HFRolloutEngine).remote(build_model, tokens)   # a Ray actor: the model is built where it runs

Logprobs are those of the sampled tokens under the distribution the sampler drew from (temperature, top-k and
top-p applied; with the defaults top_p=1, top_k=-1 this is softmax(logits / T), the same distribution the
trainer scores, so `train_rollout_logprob_abs_diff` is ~0 in fp32). Vision special tokens are banned from
sampling by default: a generated `<|image_pad|>` has no image behind it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor
from transformers import Qwen3VLForConditionalGeneration

from miles_vl.models import SpecialTokens
from miles_vl.models.qwen3_vl.tokens import vision_token_ids
from miles_vl.packing import cat_present
from miles_vl.rollout.types import Generation, PromptLike, RolloutEngine, SamplingParams

log = logging.getLogger(__name__)


class HFRolloutEngine(RolloutEngine):
    """`RolloutEngine` over a transformers model in this process.

    Args:
        model: the policy, or a function that builds it, called here (how a Ray actor gets its model: built where it
            runs, never shipped through the object store).
        tokens: special token ids (EOS ids stop generation; vision ids are banned when asked).
        max_batch_size: sequences per `generate` call.
        ban_vision_tokens: forbid sampling vision special tokens.
    """

    def __init__(
        self,
        model: Qwen3VLForConditionalGeneration | Callable[[], Qwen3VLForConditionalGeneration],
        tokens: SpecialTokens,
        *,
        max_batch_size: int = 32,
        ban_vision_tokens: bool = True,
    ):
        if not isinstance(model, torch.nn.Module):
            model = model()
        self.model = model.eval()
        self.tokens = tokens
        self.max_batch_size = max_batch_size
        self.banned = list(vision_token_ids(tokens)) if ban_vision_tokens else []

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[Generation]]:
        expanded = [p for p in prompts for _ in range(params.n)]
        out: list[Generation] = []
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(params.seed)
            for start in range(0, len(expanded), self.max_batch_size):
                out += self._generate_batch(expanded[start : start + self.max_batch_size], params)
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    @torch.no_grad()
    def _generate_batch(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[Generation]:
        t = self.tokens
        lengths = [p.prompt_ids.numel() for p in prompts]
        width = max(lengths)
        ids = torch.full((len(prompts), width), t.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: generation continues from the right edge
            ids[i, width - lengths[i] :] = p.prompt_ids
            mask[i, width - lengths[i] :] = 1
        types = torch.zeros_like(ids)
        types[(ids == t.image_token_id) & (mask == 1)] = 1
        types[(ids == t.video_token_id) & (mask == 1)] = 2
        pixel_values = cat_present([p.pixel_values for p in prompts])
        grids = cat_present([p.image_grid_thw for p in prompts])
        video_values = cat_present([p.pixel_values_videos for p in prompts])
        video_grids = cat_present([p.video_grid_thw for p in prompts])
        greedy = params.temperature == 0
        kwargs = dict(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            mm_token_type_ids=types.to(self.device),
            max_new_tokens=params.max_new_tokens,
            do_sample=not greedy,
            eos_token_id=list(t.eos_token_ids),
            pad_token_id=t.pad_token_id,
            suppress_tokens=self.banned or None,
            return_dict_in_generate=True,
            output_scores=True,
        )
        if not greedy:
            kwargs.update(
                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else 0
            )
        if pixel_values is not None:
            kwargs.update(pixel_values=pixel_values.to(self.device), image_grid_thw=grids.to(self.device))
        if video_values is not None:
            kwargs.update(pixel_values_videos=video_values.to(self.device), video_grid_thw=video_grids.to(self.device))
        result = self.model.generate(**kwargs)
        self.model.model.rope_deltas = None  # transformers caches per-batch deltas on the module
        new_dev = result.sequences[:, width:]  # [B, R]
        # One [B, V] step at a time, on the device: stacking every step's scores ([B, R, V] in fp32) and moving
        # them to the host cost seconds per batch on a GPU (benchmarks/bench_decode.py).
        logprobs = torch.stack(
            [
                torch.log_softmax(step.float(), dim=-1).gather(-1, new_dev[:, j, None]).squeeze(-1)
                for j, step in enumerate(result.scores)  # processed logits of step j, [B, V]
            ],
            dim=1,
        ).cpu()  # [B, R]
        new = new_dev.cpu()
        gens = []
        eos = torch.tensor(t.eos_token_ids)
        for i in range(len(prompts)):
            is_eos = torch.isin(new[i], eos).nonzero()
            if is_eos.numel():
                end, reason = int(is_eos[0, 0]) + 1, "stop"
            else:
                end, reason = new.shape[1], "length"
            gens.append(Generation(new[i, :end].clone(), logprobs[i, :end].clone(), reason))
        return gens

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy the given tensors in (HF names). Tensors not sent (e.g. a frozen vision tower) keep their values."""
        state = dict(named_tensors)
        _, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"weights with names this model does not have: {sorted(unexpected)[:5]}")
        log.debug("rollout engine loaded %d tensors", len(state))
        self.model.model.rope_deltas = None

    def load_weight_bucket(self, named_tensors: Sequence[tuple[str, Tensor]]) -> None:
        """`load_weights` of one bucket: buckets load as they come, and nothing here depends on the version label."""
        self.load_weights(named_tensors)

    def release_memory(self) -> None:
        """Move the model to the CPU while the trainer uses the GPU (no-op on CPU)."""
        self._home = self.device
        if self._home.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """The model back on its device: it is all weights, so any tag brings it (the first call; then a no-op)."""
        home = getattr(self, "_home", None)
        if home is not None and home != self.device:
            self.model.to(home)
