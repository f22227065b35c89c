"""Module-level functions the harness runs inside its worker processes (no megatron import at import time)."""


def install(module) -> None:
    """`setup` for runner.run_cp: install miles_vl's patches twice (the second must be a no-op)."""
    import miles_vl.patches

    miles_vl.patches.install(module)
    miles_vl.patches.install(module)


def job_status(ctx) -> dict:
    import miles_vl.patches

    forward = ctx.module.Qwen3VLModel.forward
    return {
        "patches": [(s.name, s.state) for s in miles_vl.patches.status(ctx.module)["patches"]],
        "wrapped_once": not hasattr(getattr(forward, "__miles_vl_original__", None), "__miles_vl_original__"),
    }
