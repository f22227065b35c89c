"""Contract (DESIGN §4): `pack_thd` lays samples out as padded segments with per-sample positions, and every
rank's `shard` holds exactly the zigzag slice of the full row, with a vision index that picks the embeddings
of its own vision tokens. References: transformers' get_rope_index per sample, the partition formula."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_vl.packing import pack_thd, unzigzag
from tests.packing.samples import IMAGE, PAD, TOKENS, VIDEO, VSTART, Sample, reference_positions, samples
from tests.packing.test_zigzag import partition_formula


def pack(batch, cp_size=1, tp_size=1, **kw):
    return pack_thd(batch, cp_size=cp_size, tp_size=tp_size, pad_token_id=PAD, **TOKENS, **kw)


@settings(max_examples=60, deadline=None)
@given(st.lists(samples(max_side=6), min_size=1, max_size=5), st.integers(1, 8), st.sampled_from([1, 2, 4]))
def test_full_row_layout(batch, cp_size, tp_size):
    packed = pack(batch, cp_size, tp_size)
    cu = packed.cu_seqlens.tolist()
    assert packed.cu_seqlens.dtype == torch.int32
    assert all((b - a) % (2 * cp_size) == 0 for a, b in zip(cu[:-1], cu[1:], strict=True))
    assert (cu[-1] // cp_size) % tp_size == 0
    assert len(cu) - 1 in (len(batch), len(batch) + 1)  # one trailing alignment segment at most
    for i, s in enumerate(batch):
        start, length = cu[i], s.input_ids.numel()
        assert cu[i + 1] - start == -(-length // (2 * cp_size)) * 2 * cp_size
        seg = slice(start, cu[i + 1])
        assert torch.equal(packed.input_ids[start : start + length], s.input_ids)
        assert bool((packed.input_ids[start + length : cu[i + 1]] == PAD).all())
        # positions: transformers' reference for the sample alone, with its pads as trailing text
        padded = Sample(packed.input_ids[seg], s.image_grid_thw, s.video_grid_thw, s.prompt_len)
        assert torch.equal(packed.position_ids[:, seg], reference_positions(padded))
        # masks: loss on response tokens only; vision only inside the prompt
        in_seg = torch.arange(cu[i + 1] - start)
        assert torch.equal(packed.loss_mask[seg], ((in_seg >= s.prompt_len) & (in_seg < length)).long())
        media = (packed.input_ids[seg] == IMAGE) | (packed.input_ids[seg] == VIDEO)
        assert torch.equal(packed.vision_mask[seg], media & (in_seg < s.prompt_len))
        assert bool((packed.sample_index[seg] == i).all())
    assert bool((packed.sample_index[cu[len(batch)] :] == -1).all())
    assert packed.seq_lens.tolist() == [s.input_ids.numel() for s in batch]
    images = [s.image_grid_thw for s in batch if s.image_grid_thw is not None]
    assert (packed.image_grid_thw is None) == (not images)
    if images:
        assert torch.equal(packed.image_grid_thw, torch.cat(images))


@settings(max_examples=60, deadline=None)
@given(st.lists(samples(max_side=6), min_size=1, max_size=5), st.integers(1, 8))
def test_shards_are_the_zigzag_slices(batch, cp_size):
    packed = pack(batch, cp_size)
    cu = packed.cu_seqlens.tolist()
    vision_positions = packed.vision_mask.nonzero().squeeze(1)  # natural order of all vision tokens
    # stand-in vision embeddings: embedding k "is" the full-row position of vision token k
    vision_embeds = vision_positions.clone()
    shards = [packed.shard(r) for r in range(cp_size)]
    for r, shard in enumerate(shards):
        idx = torch.tensor(partition_formula(cu, cp_size, r), dtype=torch.long)
        assert shard.input_ids.shape == (1, cu[-1] // cp_size)
        assert shard.position_ids.shape == (3, 1, cu[-1] // cp_size)
        assert torch.equal(shard.input_ids[0], packed.input_ids[idx])
        assert torch.equal(shard.position_ids[:, 0], packed.position_ids[:, idx])
        assert torch.equal(shard.loss_mask[0], packed.loss_mask[idx])
        assert torch.equal(shard.labels[0], packed.labels[idx])
        assert torch.equal(shard.cu_seqlens, packed.cu_seqlens)
        # the vision index picks exactly the embeddings of this rank's vision tokens, in local order
        local_vision_positions = idx[shard.vision_mask[0]]
        assert torch.equal(vision_embeds[shard.vision_embed_index], local_vision_positions)
    for name in ("input_ids", "loss_mask", "vision_mask", "label_mask", "sample_index"):
        rebuilt = unzigzag([getattr(s, name)[0] for s in shards], packed.cu_seqlens, cp_size)
        assert torch.equal(rebuilt, getattr(packed, name)), name
    rebuilt = unzigzag([s.position_ids[:, 0] for s in shards], packed.cu_seqlens, cp_size)
    assert torch.equal(rebuilt, packed.position_ids)


def test_labels_are_next_tokens_within_segments():
    a = Sample(torch.tensor([11, 12, 13]), None, None, prompt_len=1)
    b = Sample(torch.tensor([21, 22]), None, None, prompt_len=1)
    packed = pack([a, b], cp_size=1)  # segments of 4 and 2
    assert packed.input_ids.tolist() == [11, 12, 13, PAD, 21, 22]
    assert packed.labels.tolist() == [12, 13, PAD, PAD, 22, PAD]
    assert packed.loss_mask.tolist() == [0, 1, 1, 0, 0, 1]
    assert packed.label_mask.tolist() == [1, 1, 0, 0, 1, 0]


def test_explicit_loss_mask_is_kept():
    s = Sample(torch.tensor([1, 2, 3, 4]), None, None, prompt_len=1, loss_mask=torch.tensor([0, 1, 0, 1]))
    assert pack([s]).loss_mask.tolist() == [0, 1, 0, 1]


def test_trailing_alignment_segment():
    s = Sample(torch.arange(10, 15), None, None, prompt_len=2)  # 5 tokens -> 8 at cp 2
    packed = pack([s], cp_size=2, tp_size=3)
    # local row 8/2 = 4 -> needs a multiple of 3: add 2C*k = 4k tokens, k=1 gives local 6
    assert packed.cu_seqlens.tolist() == [0, 8, 12]
    assert packed.position_ids[:, 8:].tolist() == [[0, 1, 2, 3]] * 3
    assert packed.num_padding == 7


def test_grid_mismatch_names_the_sample():
    good = Sample(torch.tensor([VSTART] + [IMAGE] * 4), torch.tensor([[1, 4, 4]]), None, prompt_len=5)
    bad = Sample(torch.tensor([VSTART] + [IMAGE] * 4), None, None, prompt_len=5)
    with pytest.raises(ValueError, match="sample 1: its ids contain 1 image blocks .* but it has 0 image grid rows"):
        pack([good, bad])


def test_bad_inputs():
    s = Sample(torch.tensor([1, 2]), None, None, prompt_len=1)
    with pytest.raises(ValueError, match="at least one sample"):
        pack([])
    with pytest.raises(ValueError, match="prompt_len=3 is outside"):
        pack([Sample(torch.tensor([1, 2]), None, None, prompt_len=3)])
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 tokens"):
        pack([Sample(torch.tensor([1, 2]), None, None, 1, loss_mask=torch.tensor([1]))])
    with pytest.raises(ValueError, match="pad_token_id=151655 is a media token"):
        pack_thd([s], pad_token_id=IMAGE, **TOKENS)
