"""The embedded rollout engine: transformers `generate` in-process, also the engine's Ray actor."""

from miles_vl.rollout.hf.engine import HFRolloutEngine

__all__ = ["HFRolloutEngine"]
