"""Forward a transformers Qwen3-VL over one packed THD row (the embedded `torch` backend's model call).

The row holds several samples; attention must never cross a segment boundary. transformers' masking detects
packed sequences from text position ids that restart (`find_packed_sequence_indices`), so the language model gets
4-row position ids: row 0 is the segment-local text position (0, 1, ... per segment, used only for the mask) and
rows 1-3 are our per-segment MRoPE positions. With sdpa/eager/flex this builds a block-diagonal causal mask;
with flash-attention it selects the varlen path.

Vision embeddings are inserted here rather than by `Qwen3VLModel.forward`, because that method treats every
`<|image_pad|>` in the row as media, and a policy may generate such tokens in a response: only `vision_mask`
(the prompt spans) receives embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import Qwen3VLForConditionalGeneration

from miles_vl.models.qwen3_vl.vision_once import distinct_images

if TYPE_CHECKING:  # models sit below packing (which imports this family's rope): the row is only read here
    from miles_vl.packing import PackedBatch


def segment_text_positions(cu_seqlens: Tensor) -> Tensor:
    """[T] position of every token inside its segment (restarts at 0 on each segment)."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    total = int(cu[-1])
    return torch.arange(total, device=cu.device) - torch.repeat_interleave(cu[:-1], lens, output_size=total)


def packed_hidden_states(
    model: Qwen3VLForConditionalGeneration,
    packed: PackedBatch,
    pixel_values: Tensor | None = None,
    pixel_values_videos: Tensor | None = None,
    *,
    vision_once_per_image: bool = False,
) -> Tensor:
    """Final hidden states [T, H] of a packed row (cp_size 1: the embedded backend has no CP).

    Args:
        model: a transformers Qwen3-VL.
        packed: the row from `pack_thd(..., cp_size=1)`.
        pixel_values: [n_patches, C*T*P*P] of all the row's images, in sample order (as its grids), or None.
        pixel_values_videos: likewise for videos.
        vision_once_per_image: run the vision tower once per distinct image (or video) of the row and read its
            output at every use (vision_once.py); the same embeddings, gradients summed over the uses.

    Raises:
        ValueError: the batch was packed for CP, or the vision embeddings do not match `vision_mask`.
    """
    if packed.cp_size != 1:
        raise ValueError(f"the torch backend runs a full row; found a PackedBatch for cp_size={packed.cp_size}")
    inner = model.model
    device = next(model.parameters()).device
    ids = packed.input_ids.to(device)
    embeds = inner.get_input_embeddings()(ids)  # [T, H]
    vision_mask = packed.vision_mask.to(device)
    visual, deepstack = _vision_embeddings(
        inner, packed, pixel_values, pixel_values_videos, ids, embeds.dtype, vision_once_per_image
    )
    if visual is not None:
        if visual.shape[0] != int(vision_mask.sum()):
            raise ValueError(
                f"the vision tower gave {visual.shape[0]} embeddings for {int(vision_mask.sum())} vision tokens; "
                "pixel values and grids must be the ones the processor returned for these prompts"
            )
        embeds = embeds.masked_scatter(vision_mask[:, None], visual)
    text_pos = segment_text_positions(packed.cu_seqlens.to(device))
    position_ids = torch.cat([text_pos[None], packed.position_ids.to(device)], dim=0)[:, None, :]  # [4, 1, T]
    out = inner.language_model(
        input_ids=None,
        inputs_embeds=embeds[None],
        position_ids=position_ids,
        attention_mask=None,
        visual_pos_masks=vision_mask[None] if visual is not None else None,
        deepstack_visual_embeds=deepstack,
        use_cache=False,
    )
    return out.last_hidden_state[0]


def _vision_embeddings(inner, packed: PackedBatch, pixel_values, pixel_values_videos, ids, dtype, once: bool = False):
    """Embeddings [n_vision, H] for the row's vision tokens in row order, and the deepstack features likewise."""
    parts = []  # (token mask among vision tokens, embeds, deepstack list)
    in_vision = ids[packed.vision_mask.to(ids.device)]
    for values, grid, token_id, fn in (
        (pixel_values, packed.image_grid_thw, inner.config.image_token_id, inner.get_image_features),
        (pixel_values_videos, packed.video_grid_thw, inner.config.video_token_id, inner.get_video_features),
    ):
        if values is None:
            if grid is not None:
                raise ValueError("the packed row has vision grids but no pixel values were given")
            continue
        emb, deep = _tower(fn, values.to(ids.device), grid.to(ids.device), inner.config.vision_config, once)
        parts.append((in_vision == token_id, emb.to(dtype), deep))
    if not parts:
        return None, None
    n, hidden = in_vision.numel(), parts[0][1].shape[-1]
    visual = parts[0][1].new_zeros(n, hidden)
    deepstack = [parts[0][1].new_zeros(n, hidden) for _ in parts[0][2]]
    for mask, emb, deep in parts:
        if int(mask.sum()) != emb.shape[0]:
            raise ValueError(f"{emb.shape[0]} vision embeddings for {int(mask.sum())} placeholder tokens")
        visual = visual.masked_scatter(mask[:, None], emb)
        deepstack = [d.masked_scatter(mask[:, None], e.to(dtype)) for d, e in zip(deepstack, deep, strict=True)]
    return visual, deepstack


def _tower(fn, values: Tensor, grid: Tensor, vision_config, once: bool) -> tuple[Tensor, list[Tensor]]:
    """The tower's merged embeddings [rows, H] and deepstack features of the images `values` / `grid` (`fn`:
    `get_image_features` or `get_video_features`), run once per distinct image when `once`."""
    distinct = distinct_images(values, grid, vision_config.spatial_merge_size) if once else None
    if distinct is None:
        out = fn(values, grid, return_dict=True)
        return torch.cat(out.pooler_output), list(out.deepstack_features)
    out = fn(distinct.pixel_values, distinct.grid_thw, return_dict=True)
    return distinct.expand(torch.cat(out.pooler_output)), [distinct.expand(d) for d in out.deepstack_features]


def packed_logits(
    model: Qwen3VLForConditionalGeneration, packed: PackedBatch, pixel_values=None, pixel_values_videos=None
) -> Tensor:
    """Logits [T, V] of a packed row."""
    return model.lm_head(packed_hidden_states(model, packed, pixel_values, pixel_values_videos))


def label_logprobs(
    model: Qwen3VLForConditionalGeneration,
    packed: PackedBatch,
    pixel_values: Tensor | None = None,
    pixel_values_videos: Tensor | None = None,
    *,
    temperature: float = 1.0,
    suppress_token_ids: Sequence[int] = (),
    with_entropy: bool = False,
    chunk_tokens: int = 4096,
    positions: Tensor | None = None,
    vision_once_per_image: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability [T] of `packed.labels` (the next token) at every position, and optionally the entropy [T].
    With `positions` ([n] row positions, e.g. those whose label carries loss): only there, `[n]` each; the
    vocabulary projection then runs on those hidden states only (prompt positions cost no logits).
    `vision_once_per_image`: as `packed_hidden_states` takes it.

    The distribution is the one the rollout engine samples from: logits divided by `temperature`, and the tokens
    the engine bans (`suppress_token_ids`, e.g. vision special tokens) removed. The vocabulary projection runs in
    chunks of `chunk_tokens` to bound memory. Labels that are suppressed tokens (only ever prompt positions,
    which carry no loss) get -inf.
    """
    hidden = packed_hidden_states(
        model, packed, pixel_values, pixel_values_videos, vision_once_per_image=vision_once_per_image
    )
    labels = packed.labels.to(hidden.device)
    if positions is not None:
        positions = positions.to(hidden.device)
        hidden, labels = hidden.index_select(0, positions), labels.index_select(0, positions)
    banned = torch.tensor(list(suppress_token_ids), dtype=torch.long, device=hidden.device)
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = model.lm_head(hidden[start : start + chunk_tokens]).float()
        if temperature != 1.0:
            logits = logits / temperature
        if banned.numel():
            logits = logits.index_fill(-1, banned, float("-inf"))
        logp = torch.log_softmax(logits, dim=-1)
        logps.append(logp.gather(-1, labels[start : start + chunk_tokens, None]).squeeze(-1))
        if with_entropy:
            # Suppressed ids have logp = -inf and p = 0: zero their logp before the product, so that neither the
            # value nor the gradient sees 0 * -inf (a where() after the product still back-propagates NaN).
            ents.append(-(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1))
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)
