"""Contract (GPU, real Transformer Engine): megatron-bridge's Qwen3VLModel fed miles_vl's pre-sharded THD rows under
context parallelism gives the logits of each sample run alone at CP=1, in bf16, over NCCL.

One spawn per layout holds both phases with the same seeded weights (checked by checksum):
1. reference: TP=tp, CP=1, sequence parallel off; every sample alone (BSHD, batch 1) with transformers' own
   `get_rope_index` positions;
2. under test: TP=tp, CP=cp (sequence parallel as asked); the packed row (text-only, one-image and two-image samples)
   zigzag-sharded by `miles_vl.packing.pack_thd`, each rank fed its local row with
   - "data": the rank-local per-segment positions of `PackedBatch.shard` (what miles_vl passes), and, as negative
     controls that must be far off:
   - "contiguous": the full row's per-segment positions cut into C contiguous blocks instead of the zigzag chunks
     (positions that do not belong to the rank's tokens: the layout bug that CP integrations make);
   - "local_arange": 0..T/C-1 on all three rows (what a caller that forgets MRoPE gets).
   Reported, not asserted: "whole_row", the positions of the whole packed row computed as ONE sequence (what
   megatron-bridge 0.5.x does), zigzag-sliced. Measured on 2-4 H200: as close to the reference as "data" (rel 1.3e-2
   vs 1.1e-2): within a segment they are the per-segment positions plus one constant on all three MRoPE axes, and
   rotary attention depends only on position differences, so with THD attention (no cross-segment terms) they are
   harmless. 0.5.x's real breakage under CP is the double split and the vision rows (tests/patches).

The tolerance is bf16 noise: measured relative L2 error ~1e-2 (DESIGN/DEVELOPERS); the negative controls must exceed
it tenfold. Each run prints one `GPU-PARITY {json}` line (pytest -s) with its figures.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None or importlib.util.find_spec("megatron") is None,
        reason="needs Transformer Engine and megatron-bridge (scripts/gpu_check.sh installs the bundle)",
    ),
]

REL_TOL = 4e-2  # relative L2 error over all real tokens; measured bf16 noise is ~1e-2
MODES = ("data", "contiguous", "local_arange", "whole_row")
NEGATIVE = ("contiguous", "local_arange")


def _positions(mode: str, batch, cp: int, cp_rank: int) -> torch.Tensor:
    from miles_vl.packing import get_rope_index, zigzag_index
    from tests.patches.harness.tiny import TOKENS

    if mode == "data":
        return batch.shard(cp_rank).position_ids  # [3, 1, T/C]
    if mode == "whole_row":
        whole = get_rope_index(batch.input_ids, batch.image_grid_thw, batch.video_grid_thw, **TOKENS)  # [3, T]
        return whole[:, zigzag_index(batch.cu_seqlens, cp, cp_rank)][:, None, :]
    if mode == "contiguous":
        local = batch.input_ids.numel() // cp
        return batch.position_ids[:, cp_rank * local : (cp_rank + 1) * local][:, None, :]
    if mode == "local_arange":
        return torch.arange(batch.input_ids.numel() // cp).expand(3, 1, -1)
    raise ValueError(mode)


def job_parity(ctx, samples, tp: int, cp: int, sp: bool) -> dict:
    from megatron.core import parallel_state as ps

    from miles_vl.packing import pack_thd
    from tests.gpu.te_model import build_te_model, packed_shard_logits, unpacked_logits, weights_checksum
    from tests.patches.harness.tiny import PAD, TOKENS

    ctx.init_parallel(tp=tp, cp=1)
    model = build_te_model(cp=1, tp=tp, sp=False, device=ctx.device)
    reference = unpacked_logits(model, samples, ctx.device)
    ref_checksum = weights_checksum(model)
    del model

    ctx.init_parallel(tp=tp, cp=cp)
    model = build_te_model(cp=cp, tp=tp, sp=sp, device=ctx.device)
    cp_rank = ps.get_context_parallel_rank()
    batch = pack_thd(samples, cp_size=cp, tp_size=tp, pad_token_id=PAD, **TOKENS)
    logits = {
        mode: packed_shard_logits(model, batch, samples, cp_rank, _positions(mode, batch, cp, cp_rank), ctx.device)
        for mode in MODES
    }
    return {
        "cp_rank": cp_rank,
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "checksums": (ref_checksum, weights_checksum(model)),
        "reference": reference if ctx.rank == 0 else None,
        "logits": logits if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0 else None,
        "batch": batch if ctx.rank == 0 else None,
    }


def relative_error(batch, full: torch.Tensor, reference: list[torch.Tensor]) -> tuple[float, float]:
    """(relative L2 error, max abs diff) of the packed full-row logits against the per-sample references."""
    got, want = [], []
    for i, ref in enumerate(reference):
        start = int(batch.cu_seqlens[i])
        got.append(full[start : start + ref.shape[0]])
        want.append(ref)
    got, want = torch.cat(got), torch.cat(want)
    return float((got - want).norm() / want.norm()), float((got - want).abs().max())


@pytest.mark.parametrize(
    "tp, cp, sp",
    [(1, 2, False), (1, 4, False), (2, 2, True)],
    ids=["cp2", "cp4", "tp2_cp2_sp"],
)
def test_presharded_thd_matches_unpacked(tp, cp, sp):
    from miles_vl.packing import unzigzag
    from tests.gpu.nccl import run_ranks
    from tests.patches.harness.tiny import default_samples

    world = tp * cp
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    samples = default_samples()
    results = run_ranks(job_parity, world, args=(samples, tp, cp, sp))

    for r in results:  # the reference and the CP model hold the same weights on every TP rank
        assert r["checksums"][0] == pytest.approx(r["checksums"][1], rel=1e-6), r["checksums"]
    batch, reference = results[0]["batch"], results[0]["reference"]
    by_cp_rank = {r["cp_rank"]: r["logits"] for r in results if r["logits"] is not None}
    assert sorted(by_cp_rank) == list(range(cp))
    figures = {"tp": tp, "cp": cp, "sp": sp, "tokens": int(batch.cu_seqlens[-1]), "samples": len(samples)}
    for mode in MODES:
        full = unzigzag([by_cp_rank[k][mode] for k in range(cp)], batch.cu_seqlens, cp, dim=0)  # [T, V]
        rel, max_abs = relative_error(batch, full, reference)
        figures[mode] = {"rel_l2": round(rel, 5), "max_abs": round(max_abs, 4)}
    print("GPU-PARITY " + json.dumps(figures))
    assert figures["data"]["rel_l2"] < REL_TOL, figures
    for negative in NEGATIVE:
        assert figures[negative]["rel_l2"] > 10 * max(figures["data"]["rel_l2"], REL_TOL / 10), figures
