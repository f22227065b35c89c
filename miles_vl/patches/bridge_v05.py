"""megatron-bridge 0.5.x: make `Qwen3VLModel` correct for pre-sharded THD input under context parallelism.

The contract (the one 0.6 supports natively, DESIGN §4/§5): `input_ids [1, T/C]` is this CP rank's zigzag shard,
`packed_seq_params` (qkv_format "thd") describes the FULL row's segments, `position_ids` is rank-local
`[3, 1, T/C]` (or None), and every rank gets the whole micro-batch's `pixel_values` and grids.

What 0.5.x gets wrong (paths under megatron/bridge/models/qwen_vl/modelling_qwen3_vl/ of 0.5.1):
1. model.py:390 `position_ids = None` drops the caller's positions and model.py:600 `get_rope_index(...)` computes
   them over the whole input row as ONE sequence: on a rank-local zigzag row they are wrong.
2. `preprocess_packed_seqs` (utils.py:684, called at model.py:509/531/543/567/613) pads and zigzag-splits the
   already sharded row again: the language model gets T/C^2 tokens.
3. model.py:501 `combined_embeddings[vision_mask] = vision_embeds` scatters every image's rows into the local row
   (no CP-local selection): shape mismatch; the deepstack rows (model.py:527) likewise.
4. model.py:482/488 `AllGatherVisionEmbeddings.apply(..., cp_group=...)`: autograd `Function.apply` takes no
   keyword arguments, so `vision_dp_when_cp` with CP > 1 raises TypeError.
5. model.py:405/513 `reorganize_inputs(input_ids=...)` (utils.py:315): with both `pixel_values` and
   `pixel_values_videos` (images AND videos in one micro-batch) it orders the vision blocks by scanning the row it
   is given; on a rank-local zigzag row blocks are cut or absent and `assert len_split == len(vision_indexs)`
   fails (0.6.2 has the same bug: bridge_v06). One modality alone takes an early return and is right.

Detection (capability, not version string): a release whose model module has `_is_packed_input_pre_sharded`
(0.6+), or 0.5.1 with the source patch applied (its model module imports `prepare_pre_sharded`), handles items
1-3 itself (item 5: the source patch does, 0.6 needs bridge_v06's patch), so those patches report native there;
item 4 and the empty-rank dtype are detected in the forward's source (an `AllGatherVisionEmbeddings.apply(` call
passing `cp_group=` by keyword; a bfloat16 `torch.zeros` placeholder). So `install()` on a source-patched tree
installs nothing. A release lacking a symbol a needed patch rebinds raises `PatchTargetMissing` at install.

What replaces it (all in the model module's namespace; helpers imported there, so `rope`/`utils` stay untouched):
- `v05_presharded_thd_forward` wraps `Qwen3VLModel.forward`. For a pre-sharded THD call (batch 1, qkv_format thd,
  no attention_mask, `T/C * C == cu_seqlens[-1]`, detected with `miles_vl.packing.detect_layout` as 0.6's
  `_is_packed_input_pre_sharded` does) it computes, once per call and before the original forward runs, the
  rank-local positions (the caller's `[3, 1, T/C]` when given, else model-side reconstruction with one all-gather,
  `miles_vl.packing.distributed.model_side_position_ids`) and the CP-local vision index (per-chunk counts gathered
  over the CP group, `count_based_vision_index`), and publishes them to the rebound helpers below through a
  context variable for the duration of the call. Every other call goes straight to the original forward.
- `v05_per_segment_positions` rebinds `get_rope_index`: inside such a call it returns the prepared positions.
- `v05_no_double_split` rebinds `preprocess_packed_seqs`: inside such a call it is the identity.
- `v05_allgather_keyword_shim` rebinds `AllGatherVisionEmbeddings` to a subclass whose `apply` accepts
  `cp_group=` and passes it positionally.
- `v05_cp_local_vision_rows` selects this rank's rows of the vision embeddings and deepstack features: after
  `Qwen3VLVisionModel.forward` (class attribute wrapped), or after the all-gather when `vision_dp_when_cp` is on.
- `v05_empty_vision_rank_dtype` (model.py:470/478 `torch.zeros(..., dtype=torch.bfloat16)`: with
  `vision_dp_when_cp` a CP rank that gets no image builds bfloat16 placeholders and the all-gather of an fp32/fp16
  model mismatches): a thin forward wrapper records the vision model's dtype and the `AllGatherVisionEmbeddings`
  wrapper casts an empty input to it. Detected in the forward's source; 0.6 builds the placeholder in the right dtype.
- `v05_mixed_media_row_order` (item 5): when a pre-sharded call has both images and videos, the forward wrapper
  also all-gathers the local ids (the full row, `gather_full_row`) and the rebound `reorganize_inputs` orders
  pixels and grids by scanning the full row and returns the local vision mask (`bridge_v06.reorganize_in_row_order`).
Outside a pre-sharded call every rebound name behaves exactly as upstream's (the dtype fix applies to every call).
The same fixes as a source patch of the 0.5.1 release: patches/megatron-bridge-0.5.1-qwen3vl-thd-cp.patch.

Known limit: the model side cannot know where prompts end, so every media token counts as media; pass data-side
positions when responses may contain vision tokens.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import re
from dataclasses import dataclass
from types import ModuleType

import torch

from miles_vl.packing import MediaTokens, detect_layout
from miles_vl.packing.distributed import count_based_vision_index, gather_full_row, model_side_position_ids
from miles_vl.patches.bridge_v06 import rebind_reorganize_inputs
from miles_vl.patches.core import Patch, PatchTargetMissing, require, wrap_forward


@dataclass(frozen=True)
class _PreShardedCall:
    """What one pre-sharded forward call needs, prepared by the forward wrapper."""

    position_ids: torch.Tensor  # [3, 1, T/C] rank-local
    vision_index: torch.Tensor | None  # [n_local_vision] into the natural order of the row's vision embeddings
    select_after_gather: bool  # vision_dp_when_cp: rows are selected after AllGatherVisionEmbeddings
    full_input_ids: torch.Tensor | None  # [T] the full row, only when the call has both images and videos


_CALL: contextvars.ContextVar[_PreShardedCall | None] = contextvars.ContextVar("miles_vl_v05_call", default=None)


def _handles_presharded_natively(module: ModuleType) -> bool:
    # 0.6+: native pre-sharded THD support; `prepare_pre_sharded`: 0.5.1 with our source patch applied
    return hasattr(module, "_is_packed_input_pre_sharded") or hasattr(module, "prepare_pre_sharded")


def _detect_v05(*symbols: str):
    def detect(module: ModuleType) -> str:
        if _handles_presharded_natively(module):
            return "native"
        require(module, *symbols)
        return "needed"

    return detect


# ---------------------------------------------------------------------------------------------------------------
# v05_presharded_thd_forward


def _cu_seqlens(packed_seq_params) -> torch.Tensor:
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    return packed_seq_params.cu_seqlens_q if cu is None else cu


def _prepare(model, args: dict) -> _PreShardedCall | None:
    """The prepared call for a pre-sharded THD forward, None for every other layout (upstream handles those)."""
    input_ids, psp = args.get("input_ids"), args.get("packed_seq_params")
    if (
        psp is None
        or getattr(psp, "qkv_format", None) != "thd"
        or args.get("attention_mask") is not None  # 0.5.x's own contract: batched [B, S] + attention_mask
        or not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.size(0) != 1
    ):
        return None
    cp_group = model.pg_collection.cp
    cp_size = cp_group.size()
    cu = _cu_seqlens(psp)
    if cp_size == 1 or detect_layout(input_ids.size(1), cu, cp_size) != "pre_sharded":
        return None
    local_len = input_ids.size(1)

    position_ids = args.get("position_ids")
    if position_ids is None:
        position_ids = model_side_position_ids(
            input_ids[0],
            cu,
            args.get("image_grid_thw"),
            args.get("video_grid_thw"),
            MediaTokens(model.config.spatial_merge_size, model.image_token_id, model.video_token_id),
            group=cp_group,
        ).unsqueeze(1)
    elif position_ids.dim() == 2 and position_ids.shape == (3, local_len):
        position_ids = position_ids.unsqueeze(1)
    elif tuple(position_ids.shape) != (3, 1, local_len):
        raise ValueError(
            f"pre-sharded THD input of {local_len} local tokens needs rank-local MRoPE position_ids of shape "
            f"[3, 1, {local_len}] (or None to rebuild them); found {tuple(position_ids.shape)}"
        )

    vision_index = None
    has_images = args.get("pixel_values") is not None
    has_videos = args.get("pixel_values_videos") is not None
    if has_images or has_videos:
        mask = torch.zeros_like(input_ids, dtype=torch.bool)
        if has_images:
            given = args.get("image_input_mask")
            mask |= (input_ids == model.image_token_id) if given is None else given.bool()
        if has_videos:
            given = args.get("video_input_mask")
            mask |= (input_ids == model.video_token_id) if given is None else given.bool()
        vision_index = count_based_vision_index(mask[0], cu, group=cp_group)
    full_input_ids = gather_full_row(input_ids[0], cu, cp_group) if has_images and has_videos else None
    return _PreShardedCall(
        position_ids.to(input_ids.device), vision_index, bool(model.config.vision_dp_when_cp), full_input_ids
    )


def _apply_forward(module: ModuleType) -> None:
    wrap_forward(module.Qwen3VLModel, _CALL, _prepare)


# ---------------------------------------------------------------------------------------------------------------
# v05_per_segment_positions / v05_no_double_split


def _apply_positions(module: ModuleType) -> None:
    original = module.get_rope_index

    @functools.wraps(original)
    def get_rope_index(*args, **kwargs):
        call = _CALL.get()
        if call is None:
            return original(*args, **kwargs)
        return call.position_ids, None  # [3, 1, T/C] rank-local per-segment positions

    get_rope_index.__miles_vl_original__ = original
    module.get_rope_index = get_rope_index


def _apply_no_double_split(module: ModuleType) -> None:
    original = module.preprocess_packed_seqs

    @functools.wraps(original)
    def preprocess_packed_seqs(input_ids, attention_mask, pre_process=True, pg_collection=None):
        if _CALL.get() is None:
            return original(input_ids, attention_mask, pre_process=pre_process, pg_collection=pg_collection)
        return input_ids, None  # already this rank's zigzag shard of an already padded row

    preprocess_packed_seqs.__miles_vl_original__ = original
    module.preprocess_packed_seqs = preprocess_packed_seqs


# ---------------------------------------------------------------------------------------------------------------
# v05_allgather_keyword_shim / v05_cp_local_vision_rows


def _forward_source(module: ModuleType) -> str:
    """Source of the release's own `Qwen3VLModel.forward` (under any of our wrappers)."""
    forward = inspect.unwrap(module.Qwen3VLModel.forward)
    try:
        return inspect.getsource(forward)
    except (OSError, TypeError) as e:
        raise PatchTargetMissing(
            f"{module.__name__}.Qwen3VLModel.forward has no readable source ({e}); the 0.5.x source checks need it"
        ) from e


_KEYWORD_APPLY = re.compile(r"AllGatherVisionEmbeddings\.apply\([^)]*\bcp_group\s*=", re.S)


def _detect_keyword_shim(module: ModuleType) -> str:
    require(module, "Qwen3VLModel.forward", "AllGatherVisionEmbeddings")
    return "needed" if _KEYWORD_APPLY.search(_forward_source(module)) else "native"


def _apply_keyword_shim(module: ModuleType) -> None:
    base = module.AllGatherVisionEmbeddings

    class AllGatherVisionEmbeddings(base):
        """`apply(input, seqlens_on_cp_ranks, cp_group=...)`: the keyword 0.5.x passes goes positionally."""

        @classmethod
        def apply(cls, input, seqlens_on_cp_ranks, cp_group=None):  # noqa: A002  (upstream's name)
            return base.apply(input, seqlens_on_cp_ranks, cp_group)

    AllGatherVisionEmbeddings.__miles_vl_original__ = base
    module.AllGatherVisionEmbeddings = AllGatherVisionEmbeddings


def _select(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return tensor[index.to(tensor.device)]


def _detect_vision_rows(module: ModuleType) -> str:
    if hasattr(module, "_get_cp_local_vision_embed_indices") or _handles_presharded_natively(module):
        return "native"
    require(module, "Qwen3VLModel.forward", "Qwen3VLVisionModel.forward", "AllGatherVisionEmbeddings")
    return "needed"


def _apply_vision_rows(module: ModuleType) -> None:
    vision_forward = module.Qwen3VLVisionModel.forward

    @functools.wraps(vision_forward)
    def forward(self, *args, **kwargs):
        out = vision_forward(self, *args, **kwargs)
        call = _CALL.get()
        if call is None or call.vision_index is None or call.select_after_gather:
            return out
        embeds, deepstack = out
        return _select(embeds, call.vision_index), [_select(d, call.vision_index) for d in deepstack]

    forward.__miles_vl_original__ = vision_forward
    module.Qwen3VLVisionModel.forward = forward

    base = module.AllGatherVisionEmbeddings

    class AllGatherVisionEmbeddings(base):
        """After the all-gather of `vision_dp_when_cp`, keep only this CP rank's rows in a pre-sharded call."""

        @classmethod
        def apply(cls, *args, **kwargs):
            out = base.apply(*args, **kwargs)
            call = _CALL.get()
            if call is None or call.vision_index is None or not call.select_after_gather:
                return out
            return _select(out, call.vision_index)

    AllGatherVisionEmbeddings.__miles_vl_original__ = base
    module.AllGatherVisionEmbeddings = AllGatherVisionEmbeddings


# ---------------------------------------------------------------------------------------------------------------
# v05_mixed_media_row_order


def _full_input_ids() -> torch.Tensor | None:
    """The full row [T] of the current pre-sharded call, when it has both images and videos; else None."""
    call = _CALL.get()
    return None if call is None else call.full_input_ids


def _apply_mixed_media(module: ModuleType) -> None:
    rebind_reorganize_inputs(module, _full_input_ids)


# ---------------------------------------------------------------------------------------------------------------
# v05_empty_vision_rank_dtype

_VISION_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("miles_vl_v05_dtype", default=None)
_BF16_PLACEHOLDER = re.compile(r"torch\.zeros\(.{0,200}?dtype=torch\.bfloat16", re.S)  # the empty-rank placeholder


def _detect_empty_rank_dtype(module: ModuleType) -> str:
    require(module, "Qwen3VLModel.forward", "AllGatherVisionEmbeddings")
    return "needed" if _BF16_PLACEHOLDER.search(_forward_source(module)) else "native"


def _apply_empty_rank_dtype(module: ModuleType) -> None:
    original = module.Qwen3VLModel.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        vision = getattr(self, "vision_model", None)
        dtype = next(vision.parameters()).dtype if vision is not None else None
        token = _VISION_DTYPE.set(dtype)
        try:
            return original(self, *args, **kwargs)
        finally:
            _VISION_DTYPE.reset(token)

    forward.__miles_vl_original__ = original
    module.Qwen3VLModel.forward = forward

    base = module.AllGatherVisionEmbeddings

    class AllGatherVisionEmbeddings(base):
        """An empty rank's placeholder takes the vision model's dtype, so every rank gathers the same dtype."""

        @classmethod
        def apply(cls, input, *args, **kwargs):  # noqa: A002  (upstream's name)
            dtype = _VISION_DTYPE.get()
            if input.numel() == 0 and dtype is not None:
                input = input.to(dtype)
            return base.apply(input, *args, **kwargs)

    AllGatherVisionEmbeddings.__miles_vl_original__ = base
    module.AllGatherVisionEmbeddings = AllGatherVisionEmbeddings


PATCHES = [
    Patch(
        name="v05_presharded_thd_forward",
        summary="0.5.x forward does not know pre-sharded THD input under CP: wrap it to detect that layout and "
        "prepare rank-local positions (given or rebuilt) and the CP-local vision index for the patches below",
        detect=_detect_v05("Qwen3VLModel.forward"),
        apply=_apply_forward,
    ),
    Patch(
        name="v05_per_segment_positions",
        summary="0.5.x drops position_ids and runs get_rope_index over the whole local row as one sequence: "
        "use the rank-local per-segment positions instead",
        detect=_detect_v05("Qwen3VLModel.forward", "get_rope_index"),
        apply=_apply_positions,
    ),
    Patch(
        name="v05_no_double_split",
        summary="0.5.x preprocess_packed_seqs pads and zigzag-splits the already sharded row again: identity for "
        "pre-sharded input",
        detect=_detect_v05("Qwen3VLModel.forward", "preprocess_packed_seqs"),
        apply=_apply_no_double_split,
    ),
    Patch(
        name="v05_allgather_keyword_shim",
        summary="0.5.x calls AllGatherVisionEmbeddings.apply(..., cp_group=...) (TypeError with vision_dp_when_cp): "
        "accept the keyword and pass it positionally",
        detect=_detect_keyword_shim,
        apply=_apply_keyword_shim,
    ),
    Patch(
        name="v05_cp_local_vision_rows",
        summary="0.5.x scatters every image's embeddings into the local row (shape mismatch): select this CP "
        "rank's vision and deepstack rows (count-based index)",
        detect=_detect_vision_rows,
        apply=_apply_vision_rows,
    ),
    Patch(
        name="v05_mixed_media_row_order",
        summary="0.5.x reorganize_inputs orders images and videos by scanning the local zigzag row "
        "(AssertionError): order them by the full row (one all-gather of the ids, only when both are present)",
        detect=_detect_v05("Qwen3VLModel.forward", "reorganize_inputs"),
        apply=_apply_mixed_media,
    ),
    Patch(
        name="v05_empty_vision_rank_dtype",
        summary="0.5.x gives a CP rank without images (vision_dp_when_cp) a bfloat16 placeholder, so the all-gather "
        "breaks for fp32/fp16 models: use the vision model's dtype",
        detect=_detect_empty_rank_dtype,
        apply=_apply_empty_rank_dtype,
    ),
]
