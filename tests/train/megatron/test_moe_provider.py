"""The provider `build_provider` makes of a Qwen3-VL-MoE checkpoint (megatron-bridge 0.6.2's MoE provider, what
configs/geo3k_qwen3vl_30b_a3b.yaml trains): its defaults would freeze the whole model and silently turn sequence
parallelism on, and pipeline stages need variable lengths with an all-to-all dispatcher. The model itself (TE grouped
experts) is built on GPUs only."""

from __future__ import annotations

import pytest

from tests.train.megatron import cpu_parts, jobs

pytestmark = pytest.mark.usefixtures("megatron_bridge")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict:
    directory = str(tmp_path_factory.mktemp("tiny_qwen3vl_moe"))
    jobs.write_tiny_moe_checkpoint(directory)
    [out] = cpu_parts.spawn(jobs.job_moe_provider, world_size=1, args=(directory,))
    return out


def test_moe_provider_trains_everything_unless_asked(moe):
    for layout in ("tp2_ep2", "pp2"):
        p = moe[layout]
        assert (p["num_moe_experts"], p["moe_router_topk"]) == (4, 2)  # the MoE provider, from the checkpoint
        assert not (p["freeze_language_model"] or p["freeze_vision_model"] or p["freeze_vision_projection"])
        assert p["calculate_per_token_loss"]
    frozen = moe["frozen_vision"]
    assert frozen["freeze_vision_model"] and frozen["freeze_vision_projection"] and not frozen["freeze_language_model"]


def test_moe_provider_layouts(moe):
    tp2 = moe["tp2_ep2"]
    assert tp2["expert_model_parallel_size"] == 2
    # the MoE provider turns SP on under TP whatever train.sp says; build_megatron_backend lays rows out for it
    assert tp2["sequence_parallel"] is True
    pp2 = moe["pp2"]
    assert pp2["variable_seq_lengths"] is True and pp2["moe_token_dispatcher_type"] == "alltoall"
