"""Contract: a caller holding only its zigzag shard rebuilds, over a gloo CP group, exactly the positions and the
vision index that the data side computed from the full row (2 and 4 processes)."""

import pytest
import torch
from hypothesis import HealthCheck, find, settings
from hypothesis import strategies as st

from miles_vl.packing import MediaTokens, pack_thd
from miles_vl.packing.distributed import count_based_vision_index, gather_full_row, model_side_position_ids
from tests.dist import run_gloo
from tests.packing.samples import IMAGE, PAD, TOKENS, VIDEO, samples


def _batch(seed: int):
    """A deterministic mixed pack: some images, a video, a text-only sample, media tokens in a response."""
    strategy = st.lists(samples(max_side=6), min_size=4, max_size=6)
    cfg = settings(database=None, max_examples=500, suppress_health_check=list(HealthCheck), derandomize=True)

    def mixed(batch):
        has = lambda s, t: bool((s.input_ids[: s.prompt_len] == t).any())  # noqa: E731
        return (
            any(has(s, IMAGE) for s in batch)
            and any(has(s, VIDEO) for s in batch)
            and any(not has(s, IMAGE) and not has(s, VIDEO) for s in batch)
            and any(bool((s.input_ids[s.prompt_len :] == IMAGE).any()) for s in batch)
        )

    del seed
    return find(strategy, mixed, settings=cfg)


def _worker(rank, world_size, batch):
    packed = pack_thd(batch, cp_size=world_size, pad_token_id=PAD, **TOKENS)
    shard = packed.shard(rank)
    media_ends = packed.prompt_lens.tolist() + [0] * (packed.cu_seqlens.numel() - 1 - packed.num_samples)
    positions = model_side_position_ids(
        shard.input_ids[0],
        packed.cu_seqlens,
        packed.image_grid_thw,
        packed.video_grid_thw,
        MediaTokens(TOKENS["spatial_merge_size"], TOKENS["image_token_id"], TOKENS["video_token_id"]),
        media_ends=media_ends,
    )
    return {
        "full_ids": gather_full_row(shard.input_ids[0], packed.cu_seqlens),
        "positions": positions,
        "vision_index": count_based_vision_index(shard.vision_mask[0], packed.cu_seqlens),
        "packed": packed,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_model_side_equals_data_side(world_size):
    batch = _batch(world_size)
    results = run_gloo(_worker, world_size, batch)
    packed = results[0]["packed"]
    assert packed.vision_mask.any()
    for rank, res in enumerate(results):
        shard = packed.shard(rank)
        assert torch.equal(res["full_ids"], packed.input_ids)
        assert torch.equal(res["positions"], shard.position_ids[:, 0])
        assert torch.equal(res["vision_index"], shard.vision_embed_index)
