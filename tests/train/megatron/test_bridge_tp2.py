"""megatron-bridge's checkpoint load and export at TP=2, on the query-group shapes of the released models, against
transformers' own forward of the same checkpoint and the checkpoint's own tensors.

A TP=2 train rank loads its share of the HF weights through the bridge (`build_provider(tp_size=2)`): QKV split by
query group, gate/up by rows, the vocabulary by halves; a weight sync exports them back gathered over TP. The CPU
tests elsewhere check the bridge path at TP=1 (test_megatron_backend.py) and TP=2 on a model built directly (no
bridge). The 8B job at TP=2 x CP=2 (docs/gpu-runs/2026-11-27-loop-8b-tp2cp2-4xh200) measured a step-1 diff twice the
2B's; its shapes differ from the 2B's in the query groups (32 heads over 8 key-value heads: 4 a group, 2 for the 2B,
so each TP rank holds 4 groups of 4) and in three deepstack layers. Both are here at tiny widths:

- `gqa2`: 4 heads over 2 groups (the 2B's ratio; one group per TP rank), 2 deepstack layers;
- `gqa4`: 8 heads over 2 groups (the 8B's ratio of 4), 4 vision heads, 3 deepstack layers (the 8B's count);
- `gqa4x2`: 16 heads over 4 groups (the 8B's ratio, and several groups on each TP rank as the 8B's 8 over 2 ranks: a
  split that strides or reorders the groups within a rank shows only here).

References: transformers' Qwen3-VL forward of the checkpoint (the torch backend's logprobs, fp32) and the
checkpoint's tensors (the export must return them bit for bit)."""

from __future__ import annotations

import pytest

from tests.train.megatron import cpu_parts, jobs

pytestmark = pytest.mark.usefixtures("megatron_bridge")

SHAPES = {
    "gqa2": dict(num_attention_heads=4, num_key_value_heads=2),
    "gqa4": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=3,
        vision_depth=3,
        vision_num_heads=4,
        deepstack_visual_indexes=[0, 1, 2],
    ),
    "gqa4x2": dict(num_attention_heads=16, num_key_value_heads=4),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, shape in SHAPES.items():
        directory = tmp_path_factory.mktemp(name)
        out[name] = (str(directory), jobs.write_tiny_hf_checkpoint(str(directory), **shape))
    return out


@pytest.fixture(scope="module")
def ranks(checkpoints):
    dirs = {name: d for name, (d, _) in checkpoints.items()}
    return sorted(
        cpu_parts.spawn(jobs.job_bridge_tp2, 2, args=(dirs, jobs.hf_train_samples()), timeout_s=400),
        key=lambda r: r["gqa2"]["tp_rank"],
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_each_tp_rank_holds_half_of_the_query_groups(ranks, shape):
    """The split is what the test is about: each rank's fused QKV holds heads/2 queries and groups/2 key-value pairs
    (rows: (q per group + 2) x head_dim per group)."""
    heads, groups, head_dim = SHAPES[shape]["num_attention_heads"], SHAPES[shape]["num_key_value_heads"], 16
    rows = (heads // groups + 2) * head_dim * (groups // 2)
    for rank in ranks:
        text = {n: s for n, s in rank[shape]["local_qkv"].items() if "language_model" in n}
        assert text and all(s[0] == rows for s in text.values()), (rows, text)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_export_at_tp2_returns_the_checkpoint_bit_for_bit(ranks, checkpoints, shape):
    """What a weight sync from a TP=2 trainer sends an engine: every tensor of the checkpoint, equal."""
    hf_state = checkpoints[shape][1]
    for rank in ranks:
        export = rank[shape]["export"]
        assert set(export) == set(hf_state)
        different = [n for n, t in hf_state.items() if not (export[n].shape == t.shape and export[n].equal(t))]
        assert not different, different


@pytest.mark.parametrize("shape", SHAPES)
def test_logprobs_at_tp2_equal_transformers_forward_of_the_checkpoint(ranks, checkpoints, shape):
    from miles_vl.models.qwen3_vl.model import build_model
    from miles_vl.train import TorchTrainBackend

    torch_backend = TorchTrainBackend(
        build_model(jobs.tokens(), path=checkpoints[shape][0]), jobs.tokens(), jobs.cross_backend_options()
    )
    want = torch_backend.compute_logprobs(jobs.hf_train_samples())
    for rank in ranks:
        got = rank[shape]["logprobs"]
        worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
        assert worst < 1e-5, (shape, rank[shape]["tp_rank"], worst)
