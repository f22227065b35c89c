"""Ray placement, the rollout and train actors, and the driver loop (`run_job`). Only `cli` imports this."""

from miles_vl.orchestration.loop import run_job

__all__ = ["run_job"]
