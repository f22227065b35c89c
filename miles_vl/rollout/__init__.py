"""Rollout engines behind one protocol, `RolloutEngine`: `hf` (embedded, transformers generate) and `sglang`."""

from miles_vl.rollout.hf import HFRolloutEngine
from miles_vl.rollout.types import EngineDiedError, Generation, RolloutEngine, SamplingParams

__all__ = ["EngineDiedError", "Generation", "HFRolloutEngine", "RolloutEngine", "SamplingParams"]
