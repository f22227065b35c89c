"""Contract: a packed THD row through the torch backend's forward gives, on every real token, the logits that
transformers' own Qwen3-VL forward gives each sample alone (its own positions, mask and vision path)."""

import dataclasses

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_vl.models import SpecialTokens
from miles_vl.models.qwen3_vl.forward import label_logprobs, packed_logits, segment_text_positions
from miles_vl.models.qwen3_vl.model import build_model
from miles_vl.packing import pack_thd
from tests.packing.samples import IMAGE, PAD, TOKENS, VEND, VIDEO, VSTART, Sample, samples

SPECIAL = SpecialTokens(IMAGE, VIDEO, VSTART, VEND, PAD, (PAD,), vocab_size=151680)
PATCH = 3 * 2 * 16 * 16  # channels * temporal patch * patch * patch

_MODEL = {}


def model():
    if "m" not in _MODEL:
        _MODEL["m"] = build_model(SPECIAL, tiny=dict(initializer_range=0.2), seed=0).eval()
    return _MODEL["m"]


def pixels(grid, seed):
    if grid is None:
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(-1).sum()), PATCH, generator=g)


def reference_logits(sample, pv, pvv):
    ids = sample.input_ids
    types = torch.zeros_like(ids)
    types[ids == IMAGE] = 1
    types[ids == VIDEO] = 2
    video = None if sample.video_grid_thw is None else sample.video_grid_thw.clone()
    out = model()(
        input_ids=ids[None],
        pixel_values=pv,
        image_grid_thw=sample.image_grid_thw,
        pixel_values_videos=pvv,
        video_grid_thw=video,
        mm_token_type_ids=types[None],
    )
    model().model.rope_deltas = None  # transformers caches these between calls
    return out.logits[0]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(samples(max_images=2, max_videos=1, max_side=4, media_in_response=False), min_size=1, max_size=4))
def test_packed_equals_unpacked(batch):
    pvs = [pixels(s.image_grid_thw, i) for i, s in enumerate(batch)]
    pvvs = [pixels(s.video_grid_thw, 100 + i) for i, s in enumerate(batch)]
    packed = pack_thd(batch, cp_size=1, pad_token_id=PAD, **TOKENS)
    cat = lambda xs: torch.cat([x for x in xs if x is not None]) if any(x is not None for x in xs) else None  # noqa: E731
    with torch.no_grad():
        logits = packed_logits(model(), packed, cat(pvs), cat(pvvs))
        for i, s in enumerate(batch):
            start, n = int(packed.cu_seqlens[i]), s.input_ids.numel()
            ref = reference_logits(s, pvs[i], pvvs[i])
            torch.testing.assert_close(logits[start : start + n], ref, rtol=1e-4, atol=1e-4)


def test_positions_matter():
    """Negative control: 1-D positions (vision tokens numbered like text) change the logits visibly, so the parity
    above can fail. (A uniform shift of a whole segment would not: RoPE is relative.)"""
    image = [VSTART] + [IMAGE] * 4 + [VEND]
    batch = [
        Sample(torch.tensor([11, 12] + image + [13, 14, 15]), torch.tensor([[1, 4, 4]]), None, prompt_len=9),
        Sample(torch.tensor([21] + image + image + [22, 23]), torch.tensor([[1, 4, 4], [1, 4, 4]]), None, 14),
    ]
    packed = pack_thd(batch, cp_size=1, pad_token_id=PAD, **TOKENS)
    pv = pixels(packed.image_grid_thw, 0)
    flat = segment_text_positions(packed.cu_seqlens).expand(3, -1)
    wrong = dataclasses.replace(packed, position_ids=flat)
    with torch.no_grad():
        diff = (packed_logits(model(), packed, pv) - packed_logits(model(), wrong, pv)).abs().max()
    assert diff > 1e-1, diff


def test_label_logprobs_match_log_softmax():
    batch = [Sample(torch.arange(100, 109), None, None, 3), Sample(torch.arange(200, 205), None, None, 2)]
    packed = pack_thd(batch, cp_size=1, pad_token_id=PAD, **TOKENS)
    with torch.no_grad():
        logits = packed_logits(model(), packed)
        logp, ent = label_logprobs(model(), packed, temperature=0.7, with_entropy=True, chunk_tokens=5)
    ref = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(logp, ref.gather(-1, packed.labels[:, None]).squeeze(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1), rtol=1e-5, atol=1e-5)


def test_entropy_gradient_is_finite_with_suppressed_tokens():
    """Suppressed ids have p = 0 and logp = -inf; the entropy and its gradient must stay finite (0 * -inf is NaN)."""
    batch = [Sample(torch.arange(100, 109), None, None, 3)]
    packed = pack_thd(batch, cp_size=1, pad_token_id=PAD, **TOKENS)
    m = model()
    m.zero_grad(set_to_none=True)
    banned = (IMAGE, VIDEO)
    logp, ent = label_logprobs(m, packed, suppress_token_ids=banned, with_entropy=True)
    with torch.no_grad():
        ref = torch.log_softmax(packed_logits(m, packed).index_fill(-1, torch.tensor(banned), float("-inf")), -1)
        keep = torch.isfinite(ref)
        want = -(ref.exp() * torch.where(keep, ref, torch.zeros_like(ref))).sum(-1)
    torch.testing.assert_close(ent.detach(), want, rtol=1e-5, atol=1e-5)
    ent.sum().backward()
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
