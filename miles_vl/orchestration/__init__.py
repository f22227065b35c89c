"""Ray placement, the rollout and train actors, and the driver loop (`run_job`). Only `cli` imports this.

`run_job` is imported on first use: a Ray actor of this package (a train rank, an engine) imports only its own
module's stack, not the driver loop's (plots, rewards), a second or so of each actor's start on a small machine."""

__all__ = ["run_job"]


def __getattr__(name: str):
    if name == "run_job":
        from miles_vl.orchestration.loop import run_job

        return run_job
    raise AttributeError(f"module 'miles_vl.orchestration' has no attribute {name!r}")
