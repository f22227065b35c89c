"""Run the tiny real Qwen3-VL on C gloo processes (one per CP rank) and bring back what each rank computed.

    from tests.patches.harness import runner
    per_sample = runner.unpacked_logits(samples, version="0.6.2")           # list of [L_i, V], CP=1
    batch, full = runner.packed_logits(samples, cp_size=2, version="0.6.2")  # full-row [T, V], rebuilt from ranks
    runs = runner.run_packed_many({"a": samples, "b": other}, cp_size=2)     # several packs, one set of processes
    results = runner.run_cp(my_job, cp_size=2, version="0.5.1", args=(...))  # any module-level job(ctx, ...)

Every model runs in freshly spawned processes, even at CP=1: the shims rewire torch globals and the bridge version
is chosen per interpreter. A job is a module-level function `job(ctx: WorkerContext, *args)`; its module (and the
modules of its arguments) must not import megatron at import time, because the children unpickle them before the
bridge version is selected. An exception in a rank comes back as `WorkerError` carrying its type and message.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tests.dist import rank_main, spawn_ranks


@dataclass
class WorkerContext:
    """What a job gets in each rank's process."""

    module: Any  # the imported megatron.bridge...modelling_qwen3_vl.model module
    model: Any  # the tiny Qwen3VLModel (eval, fp32)
    version: str
    cp_rank: int
    cp_size: int
    cp_group: Any


class WorkerError(RuntimeError):
    """An exception raised inside a rank; `exc_type` is its class name (e.g. "ValueError")."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str) -> None:
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n--- worker traceback ---\n{tb}")
        self.rank, self.exc_type, self.message, self.worker_traceback = rank, exc_type, message, tb


def _child(rank, world_size, init_file, out_dir, version, root, setup, model_kwargs, timeout_s, job, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

    def load():
        from tests.patches.harness.shims import load_qwen3vl_module

        module = load_qwen3vl_module(version, root=root)
        if setup is not None:
            setup(module)  # e.g. install miles_vl.patches before the model is built
        return module

    def body(module):
        from megatron.core import parallel_state

        from tests.patches.harness.tiny import build_tiny_qwen3vl

        parallel_state.initialize_model_parallel(context_parallel_size=world_size)
        model = build_tiny_qwen3vl(module, cp_size=world_size, **model_kwargs)
        ctx = WorkerContext(module, model, version, rank, world_size, parallel_state.get_context_parallel_group())
        return job(ctx, *args)

    rank_main(rank, world_size, init_file, out_dir, backend="gloo", timeout_s=timeout_s, setup=load, body=body)


def run_cp(
    job: Callable[..., Any],
    cp_size: int,
    *,
    version: str = "0.6.2",
    args: Sequence[Any] = (),
    model_kwargs: dict | None = None,
    setup: Callable[[Any], None] | None = None,
    timeout_s: float = 240.0,
    bridge_root: str | None = None,
) -> list[Any]:
    """Run `job(ctx, *args)` on `cp_size` processes (gloo, CP group = world) and return each rank's result.

    `model_kwargs` go to `build_tiny_qwen3vl` (seed, init_std, vision_dp_when_cp). `setup(model_module)`, a
    module-level function, runs in every rank right after the bridge is imported and before the model is built: the
    place to install `miles_vl.patches` (which rebind names in the model module). `bridge_root` (0.5.1 only): the
    folder to import megatron-bridge from instead of the side install (e.g. a source-patched copy).

    Raises:
        WorkerError: a rank raised (the lowest such rank is reported).
        TimeoutError: the ranks did not finish within `timeout_s` (they are killed).
    """
    extra = (version, bridge_root, setup, dict(model_kwargs or {}), timeout_s, job, tuple(args))
    try:
        results = spawn_ranks(_child, cp_size, extra, timeout_s)
    except TimeoutError as exc:
        raise TimeoutError(f"CP={cp_size} harness run did not finish in {timeout_s} s") from exc
    for rank, res in enumerate(results):
        if "error" in res:
            raise WorkerError(rank, *res["error"])
    return [res["ok"] for res in results]


# ----------------------------------------------------------------------------------------------------------------
# Canned jobs: unpacked reference runs and packed (pre-sharded under CP) runs.

# How a packed run passes positions to the model:
#   "data"          the shard's data-side positions (miles_vl.packing), [3, 1, T/C]
#   "none"          no position_ids: the model must compute them (0.6.2 raises for pre-sharded input)
#   "local_arange"  arange over the local row on all three rows: wrong on purpose, proves the harness notices
#   "data_vision_dp" like "data", with config.vision_dp_when_cp switched on for that forward (images split over CP)
POSITION_MODES = ("data", "none", "local_arange", "data_vision_dp")


@dataclass
class PackedRun:
    """One packed forward, rebuilt to the full row from every rank (or the error a rank raised)."""

    logits: torch.Tensor | None  # [T, V] in full-row order
    lm_position_ids: torch.Tensor | None  # [3, T] the positions the language model received, full-row order
    error: tuple[str, str, str] | None  # (exception type, message, "file:line in function") raised in rank 0


def thd_params(cu_seqlens: torch.Tensor):
    """PackedSeqParams for a THD row whose segments are `cu_seqlens` ([n+1], full row, already padded): the megatron
    backend's, on the row's device."""
    from miles_vl.train.megatron.batch import thd_params as backend_thd_params

    return backend_thd_params(cu_seqlens, cu_seqlens.device)


def _logits(output) -> torch.Tensor:
    """[1, S, V] logits out of whatever the model returned (0.6.2 may return (output, loss_mask))."""
    return output[0] if isinstance(output, tuple) else output


class _CaptureLanguageModelInputs:
    """Forward pre-hook on `model.language_model` that keeps the `position_ids` it was called with."""

    def __init__(self, model) -> None:
        self.position_ids = None
        self._handle = model.language_model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.position_ids = kwargs.get("position_ids")

    def remove(self) -> None:
        self._handle.remove()


def unpacked_forward(model, samples) -> list[torch.Tensor]:
    """Each sample alone (BSHD, batch 1) with transformers' reference positions: list of [L_i, V]."""
    from tests.patches.harness.tiny import reference_positions

    outs = []
    with torch.no_grad():
        for s in samples:
            out = model(
                input_ids=s.input_ids[None],  # [1, L]
                position_ids=reference_positions(s)[:, None, :],  # [3, 1, L]
                pixel_values=s.pixel_values,
                image_grid_thw=s.image_grid_thw,
                pixel_values_videos=s.pixel_values_videos,
                video_grid_thw=s.video_grid_thw,
            )
            outs.append(_logits(out)[0])
    return outs


def packed_forward(ctx: WorkerContext, batch, pixel_values, position_mode: str = "data", pixel_values_videos=None):
    """This rank's shard of `batch` (a miles_vl PackedBatch) through the model as THD (pre-sharded under CP).

    `pixel_values` / `pixel_values_videos`: the pixel rows of every image / video of the micro-batch (row order).

    Returns (logits [T/C, V], positions the language model saw [3, T/C] or None).
    """
    shard = batch.shard(ctx.cp_rank)
    vision_dp = position_mode == "data_vision_dp"
    if position_mode in ("data", "data_vision_dp"):
        position_ids = shard.position_ids  # [3, 1, T/C]
    elif position_mode == "none":
        position_ids = None
    elif position_mode == "local_arange":
        position_ids = torch.arange(shard.input_ids.shape[1]).expand(3, 1, -1)
    else:
        raise ValueError(f"position_mode must be one of {POSITION_MODES}, found {position_mode!r}")
    capture = _CaptureLanguageModelInputs(ctx.model)
    saved_vision_dp = ctx.model.config.vision_dp_when_cp  # read by Qwen3VLModel.forward on every call
    ctx.model.config.vision_dp_when_cp = saved_vision_dp or vision_dp
    try:
        with torch.no_grad():
            out = ctx.model(
                input_ids=shard.input_ids,  # [1, T/C]
                position_ids=position_ids,
                packed_seq_params=thd_params(shard.cu_seqlens),  # the full row's segments
                pixel_values=pixel_values,  # every image of the micro-batch, on every rank
                image_grid_thw=batch.image_grid_thw,
                pixel_values_videos=pixel_values_videos,  # every video of the micro-batch, on every rank
                video_grid_thw=batch.video_grid_thw,
            )
    finally:
        capture.remove()
        ctx.model.config.vision_dp_when_cp = saved_vision_dp
    seen = capture.position_ids
    return _logits(out)[0], None if seen is None else seen.reshape(3, -1)


def job_packed(
    ctx: WorkerContext, batch, pixel_values, position_modes, reference_samples=None, pixel_values_videos=None
) -> dict:
    """Run `packed_forward` once per position mode (a model error is recorded, not raised) and, at CP=1 when
    `reference_samples` is given, the unpacked reference too (same process, same weights)."""
    from tests.patches.harness.shims import loaded_versions

    result = {
        "modes": {},
        "weights_checksum": weights_checksum(ctx.model),
        "versions": loaded_versions(),
        "model_file": ctx.module.__file__,
        "miles_vl_patches": sorted(ctx.module.__dict__.get("_miles_vl_patches", ())),  # names installed
    }
    for mode in position_modes:
        try:
            result["modes"][mode] = packed_forward(ctx, batch, pixel_values, mode, pixel_values_videos)
        except (ValueError, TypeError, RuntimeError, AssertionError, IndexError) as exc:
            result["modes"][mode] = (type(exc).__name__, str(exc), _where(exc))
    if reference_samples is not None:
        if ctx.cp_size != 1:
            raise ValueError("the unpacked reference runs at CP=1")
        result["unpacked"] = unpacked_forward(ctx.model, reference_samples)
    return result


def _where(exc: BaseException) -> str:
    """ "path:line in function" of the innermost megatron frame of `exc` (path from `megatron/` on)."""
    frames = traceback.extract_tb(exc.__traceback__)
    frame = next((f for f in reversed(frames) if "/megatron/" in f.filename), frames[-1])
    path = frame.filename
    return f"{path[path.rfind('/megatron/') + 1 :] if '/megatron/' in path else path}:{frame.lineno} in {frame.name}"


def job_packed_many(ctx: WorkerContext, packs: dict) -> dict:
    """`job_packed` for each `name -> (batch, pixel_values, pixel_values_videos, position_modes)` of `packs`."""
    return {
        name: job_packed(ctx, batch, pixels, modes, None, videos)
        for name, (batch, pixels, videos, modes) in packs.items()
    }


def job_unpacked(ctx: WorkerContext, samples) -> dict:
    if ctx.cp_size != 1:
        raise ValueError("the unpacked reference runs at CP=1")
    return {"unpacked": unpacked_forward(ctx.model, samples), "weights_checksum": weights_checksum(ctx.model)}


def weights_checksum(model) -> float:
    """Sum of |w| over all parameters (float64): equal across runs iff the seeded build is deterministic."""
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def pack(samples, cp_size: int):
    """`miles_vl.packing.pack_thd` with the tiny model's token ids."""
    from miles_vl.packing import pack_thd
    from tests.patches.harness.tiny import PAD, TOKENS

    return pack_thd(samples, cp_size=cp_size, pad_token_id=PAD, **TOKENS)


def unpacked_logits(samples, *, version: str = "0.6.2", **kwargs) -> list[torch.Tensor]:
    """Reference: each sample run alone at CP=1. Returns a list of [L_i, V]."""
    return run_cp(job_unpacked, 1, version=version, args=(samples,), **kwargs)[0]["unpacked"]


def run_packed(
    samples,
    *,
    cp_size: int,
    version: str = "0.6.2",
    position_modes=("data",),
    with_reference: bool = False,
    reference_samples=None,
    **kwargs,
):
    """Pack `samples` (THD, zigzag for `cp_size`), run every rank's shard once per position mode, rebuild full rows.

    Returns (PackedBatch, {mode: PackedRun}, extras) where extras has "weights_checksum" (per rank), "versions"
    (megatron-bridge/-core of the run), "model_file" (the model module's file), "miles_vl_patches" (names installed
    in it) and, with
    `with_reference` (CP=1 only), "unpacked": the per-sample reference logits from the same process, of
    `reference_samples` when given (default: `samples`).
    """
    from tests.patches.harness.tiny import concat_pixels, concat_video_pixels

    batch = pack(samples, cp_size)
    ref = (samples if reference_samples is None else reference_samples) if with_reference else None
    per_rank = run_cp(
        job_packed,
        cp_size,
        version=version,
        args=(batch, concat_pixels(samples), tuple(position_modes), ref, concat_video_pixels(samples)),
        **kwargs,
    )
    runs, extras = _rebuild(batch, per_rank, position_modes, cp_size)
    if with_reference:
        extras["unpacked"] = per_rank[0]["unpacked"]
    return batch, runs, extras


def run_packed_many(packs: dict, *, cp_size: int, version: str = "0.6.2", position_modes=("data",), **kwargs) -> dict:
    """`run_packed` for several packs in one set of worker processes (one model build, one import per rank).

    `packs`: {name: samples, or (samples, position_modes)}. Returns {name: (PackedBatch, {mode: PackedRun}, extras)}.
    """
    from tests.patches.harness.tiny import concat_pixels, concat_video_pixels

    jobs = {}
    for name, value in packs.items():
        samples, modes = value if isinstance(value, tuple) else (value, position_modes)
        jobs[name] = (pack(samples, cp_size), concat_pixels(samples), concat_video_pixels(samples), tuple(modes))
    per_rank = run_cp(job_packed_many, cp_size, version=version, args=(jobs,), **kwargs)
    out = {}
    for name, (batch, _, _, modes) in jobs.items():
        runs, extras = _rebuild(batch, [rank[name] for rank in per_rank], modes, cp_size)
        out[name] = (batch, runs, extras)
    return out


def _rebuild(batch, per_rank: list[dict], position_modes, cp_size: int) -> tuple[dict, dict]:
    """Full-row PackedRuns out of every rank's `job_packed` result, and the extras (checksums, versions)."""
    from miles_vl.packing import unzigzag

    runs = {}
    for mode in position_modes:
        outs = [r["modes"][mode] for r in per_rank]
        if isinstance(outs[0][0], str):  # (type, message, where): the model raised
            runs[mode] = PackedRun(None, None, outs[0])
            continue
        logits = unzigzag([o[0] for o in outs], batch.cu_seqlens, cp_size, dim=0)
        seen = None if outs[0][1] is None else unzigzag([o[1] for o in outs], batch.cu_seqlens, cp_size, dim=-1)
        runs[mode] = PackedRun(logits, seen, None)
    extras = {"weights_checksum": [r["weights_checksum"] for r in per_rank]}
    extras |= {key: per_rank[0][key] for key in ("versions", "model_file", "miles_vl_patches")}
    return runs, extras


def packed_logits(samples, *, cp_size: int, version: str = "0.6.2", position_mode: str = "data", **kwargs):
    """Shortcut: (PackedBatch, full-row logits [T, V]) of one packed run; raises WorkerError-like RuntimeError if
    the model raised."""
    batch, runs, _ = run_packed(samples, cp_size=cp_size, version=version, position_modes=(position_mode,), **kwargs)
    run = runs[position_mode]
    if run.error is not None:
        raise RuntimeError(f"{run.error[0]}: {run.error[1]}")
    return batch, run.logits


def max_diff_per_sample(batch, full_logits: torch.Tensor, reference: list[torch.Tensor]) -> list[float]:
    """Max |packed - unpacked| over the real (unpadded) tokens of each sample."""
    diffs = []
    for i, ref in enumerate(reference):
        start = int(batch.cu_seqlens[i])
        got = full_logits[start : start + ref.shape[0]]
        diffs.append(float((got - ref).abs().max()))
    return diffs
