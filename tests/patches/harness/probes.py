"""Probe jobs for investigating how a bridge version handles pre-sharded THD under CP (used by the upstream tests).

`job_probe` runs one packed forward per rank and records, instead of raising, what the language model received
(input ids, positions, embeddings, vision mask, deepstack rows) and any exception with the file:line it came from.
"""

from __future__ import annotations

import traceback

import torch

from tests.patches.harness.runner import WorkerContext, thd_params


def job_probe(
    ctx: WorkerContext, batch, pixel_values, pass_position_ids: bool = True, vision_dp_when_cp: bool = False
) -> dict:
    shard = batch.shard(ctx.cp_rank)
    saved_vision_dp = ctx.model.config.vision_dp_when_cp
    ctx.model.config.vision_dp_when_cp = vision_dp_when_cp
    seen: dict = {}

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        pos = kwargs.get("position_ids")
        emb = kwargs.get("decoder_input")
        mask = kwargs.get("visual_pos_masks")
        deep = kwargs.get("deepstack_visual_embeds")
        seen.update(
            input_ids=None if ids is None else ids.clone(),
            position_ids=None if pos is None else pos.clone(),
            decoder_input_shape=None if emb is None else tuple(emb.shape),
            visual_pos_masks=None if mask is None else mask.clone(),
            deepstack_rows=None if deep is None else [tuple(d.shape) for d in deep],
        )

    handle = ctx.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    out = {"local_len": shard.input_ids.shape[1], "full_len": int(batch.cu_seqlens[-1])}
    try:
        with torch.no_grad():
            result = ctx.model(
                input_ids=shard.input_ids,
                position_ids=shard.position_ids if pass_position_ids else None,
                packed_seq_params=thd_params(shard.cu_seqlens),
                pixel_values=pixel_values,
                image_grid_thw=batch.image_grid_thw,
            )
        out["logits"] = (result[0] if isinstance(result, tuple) else result)[0]
    except Exception as exc:  # noqa: BLE001  (recorded for the report)
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f for f in reversed(frames) if "megatron" in f.filename), frames[-1])
        out["error"] = (
            type(exc).__name__,
            str(exc),
            f"{where.filename.split('site-packages/')[-1]}:{where.lineno} in {where.name}",
            traceback.format_exc(),
        )
    finally:
        handle.remove()
        ctx.model.config.vision_dp_when_cp = saved_vision_dp
    out["seen"] = seen
    return out


def job_probe_many(ctx: WorkerContext, cases) -> dict:
    """`job_probe` for each `name -> (batch, pixel_values, probe kwargs)` of `cases`, in one process."""
    return {name: job_probe(ctx, batch, pixels, **kw) for name, (batch, pixels, kw) in cases.items()}


def run_probes(cases: dict, *, cp_size: int, version: str, **kwargs) -> dict:
    """{name: [per-rank probe dict]} for `cases` = {name: samples or (samples, job_probe kwargs)}, packed for
    `cp_size`; "_batches" maps each name to its PackedBatch."""
    from tests.patches.harness.runner import pack, run_cp
    from tests.patches.harness.tiny import concat_pixels

    cases = {name: case if isinstance(case, tuple) else (case, {}) for name, case in cases.items()}
    packed = {name: (pack(s, cp_size), concat_pixels(s), kw) for name, (s, kw) in cases.items()}
    per_rank = run_cp(job_probe_many, cp_size, version=version, args=(packed,), **kwargs)
    return {name: [rank[name] for rank in per_rank] for name in cases} | {
        "_batches": {name: b for name, (b, _, _) in packed.items()}
    }
