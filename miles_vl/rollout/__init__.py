"""Rollout engines behind one protocol: `hf` (embedded, transformers generate) and `sglang` (production)."""

from miles_vl.rollout.hf_engine import HFRolloutEngine
from miles_vl.rollout.types import Generation, PromptLike, RolloutEngine, SamplingParams

__all__ = ["Generation", "HFRolloutEngine", "PromptLike", "RolloutEngine", "SamplingParams"]
