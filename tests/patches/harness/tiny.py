"""A tiny random Qwen3-VL built through the real megatron-bridge `Qwen3VLModel`, and samples to feed it.

    module = load_qwen3vl_module("0.6.2")           # tests.patches.harness.shims
    model = build_tiny_qwen3vl(module, cp_size=2)   # needs megatron's parallel state (see runner.py)

Sizes are small enough for two CPU cores but keep every feature the CP layout can break: GQA, q/k RMSNorm,
interleaved MRoPE (section [4, 2, 2] of head_dim 16), a 2-layer vision tower with deepstack into both language
layers, spatial merge 2. Samples hold images and videos laid out as the transformers Qwen3-VL processor lays them
out (see `make_sample`). Weights are fp32 with a large init std (0.2) so that positions and attention masks move
the logits well above float noise, and depend only on `seed` (every CP rank builds the same model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

# Token ids of the tiny vocabulary (the real Qwen3-VL ids would need a 152k-row embedding).
VOCAB = 96
PAD, IMAGE, VIDEO, VSTART, VEND = 0, 90, 91, 92, 93
MERGE = 2
PATCH = 2  # pixels per patch side; a patch row has 3 * TEMPORAL_PATCH * PATCH * PATCH values
TEMPORAL_PATCH = 2
PIXEL_DIM = 3 * TEMPORAL_PATCH * PATCH * PATCH
TOKENS = dict(spatial_merge_size=MERGE, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART)


TIMESTAMP_LEN = 3  # text tokens standing in for a frame group's "<0.5 seconds>" (several tokens in Qwen3's vocab)


class Video(NamedTuple):
    """A video piece of `make_sample`: `t` frame groups of an `h x w` patch grid (`video_grid_thw` row (t, h, w))."""

    t: int
    h: int
    w: int


@dataclass
class TinySample:
    """One training sample as `miles_vl.packing.pack_thd` reads it, plus its pixels."""

    input_ids: torch.Tensor  # [L]
    image_grid_thw: torch.Tensor | None  # [n_images, 3]
    prompt_len: int
    pixel_values: torch.Tensor | None  # [sum(t*h*w) over images, PIXEL_DIM]
    video_grid_thw: torch.Tensor | None = None  # [n_videos, 3]
    loss_mask: torch.Tensor | None = None
    name: str = field(default="")
    pixel_values_videos: torch.Tensor | None = None  # [sum(t*h*w) over videos, PIXEL_DIM]


def make_sample(name: str, pieces: list, response_len: int, generator: torch.Generator) -> TinySample:
    """`pieces`: ints = that many random text tokens, tuples (t, h, w) = an image with that patch grid,
    `Video(t, h, w)` = a video.

    Token layout of the transformers 5.12.1 Qwen3-VL processor: an image is `<|vision_start|>`, `t*h*w/4`
    `<|image_pad|>`, `<|vision_end|>` (the chat template's `<|vision_start|><|image_pad|><|vision_end|>`, the pad
    expanded). A video keeps the template's outer `<|vision_start|>` ... `<|vision_end|>` and the processor's
    `replace_video_token` puts, per frame group (one per temporal step of the grid), a timestamp text
    (`<0.5 seconds>`), `<|vision_start|>`, `h*w/4` `<|video_pad|>`, `<|vision_end|>` inside it.
    """
    ids, grids, video_grids = [], [], []

    def text(n: int) -> list[int]:
        return torch.randint(1, IMAGE, (n,), generator=generator).tolist()

    for piece in pieces:
        if isinstance(piece, int):
            ids += text(piece)
        elif isinstance(piece, Video):
            t, h, w = piece
            video_grids.append([t, h, w])
            ids.append(VSTART)
            for _ in range(t):
                ids += text(TIMESTAMP_LEN) + [VSTART] + [VIDEO] * (h * w // MERGE**2) + [VEND]
            ids.append(VEND)
        else:
            t, h, w = piece
            grids.append([t, h, w])
            ids += [VSTART] + [IMAGE] * (t * h * w // MERGE**2) + [VEND]
    prompt_len = len(ids)
    ids += text(response_len)
    n_patches = sum(t * h * w for t, h, w in grids)
    n_video_patches = sum(t * h * w for t, h, w in video_grids)
    return TinySample(
        input_ids=torch.tensor(ids, dtype=torch.long),
        image_grid_thw=torch.tensor(grids, dtype=torch.long) if grids else None,
        prompt_len=prompt_len,
        pixel_values=torch.randn(n_patches, PIXEL_DIM, generator=generator) if grids else None,
        video_grid_thw=torch.tensor(video_grids, dtype=torch.long) if video_grids else None,
        name=name,
        pixel_values_videos=torch.randn(n_video_patches, PIXEL_DIM, generator=generator) if video_grids else None,
    )


def default_samples(seed: int = 0) -> list[TinySample]:
    """Three samples of odd lengths: text only, one image, two images of different shapes."""
    g = torch.Generator().manual_seed(seed)
    return [
        make_sample("text", [9], 6, g),  # L = 15
        make_sample("one_image", [3, (1, 4, 6), 4], 7, g),  # 3 + 8 + 4 + 7 = 22
        make_sample("two_images", [2, (1, 4, 4), 1, (1, 2, 4), 3], 5, g),  # 2 + 6 + 1 + 4 + 3 + 5 = 21
    ]


def video_sample(seed: int = 1) -> TinySample:
    """One video of 2 frame groups (4x6 patches: 6 tokens each), text around it: L = 2 + 2*(3+8) + 2 + 3 + 6 = 35."""
    return make_sample("video", [2, Video(2, 4, 6), 3], 6, torch.Generator().manual_seed(seed))


def image_and_video_sample(seed: int = 2) -> TinySample:
    """An image, then a video, then another image in one prompt (natural order image, video frames, image)."""
    g = torch.Generator().manual_seed(seed)
    return make_sample("image_video_image", [2, (1, 2, 4), 1, Video(2, 2, 4), 2, (1, 4, 4), 1], 5, g)


def parity_samples(seed: int = 0) -> list[TinySample]:
    """The parity pack: text only, one image, two images, one video, and image + video + image in one prompt. As
    one micro-batch it mixes images and videos (what megatron-bridge's `reorganize_inputs` orders by scanning the row).
    """
    return [*default_samples(seed), video_sample(seed + 1), image_and_video_sample(seed + 2)]


def concat_pixels(samples: list[TinySample]) -> torch.Tensor | None:
    """Pixel rows of every image of `samples`, in sample order (the order of the packed `image_grid_thw`)."""
    parts = [s.pixel_values for s in samples if s.pixel_values is not None]
    return torch.cat(parts) if parts else None


def concat_video_pixels(samples: list[TinySample]) -> torch.Tensor | None:
    """Pixel rows of every video of `samples`, in sample order (the order of the packed `video_grid_thw`)."""
    parts = [s.pixel_values_videos for s in samples if s.pixel_values_videos is not None]
    return torch.cat(parts) if parts else None


def reference_positions(sample: TinySample) -> torch.Tensor:
    """[3, L] MRoPE positions of `sample` alone from transformers' own `Qwen3VLModel.get_rope_index`."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as HFQwen3VLModel

    ids = sample.input_ids
    types = torch.zeros_like(ids)
    in_prompt = torch.arange(ids.numel()) < sample.prompt_len
    types[(ids == IMAGE) & in_prompt] = 1
    types[(ids == VIDEO) & in_prompt] = 2
    # get_rope_index reads only self.config.vision_config.spatial_merge_size and self.get_vision_position_ids.
    fake = _HFRopeSelf()
    video = None if sample.video_grid_thw is None else sample.video_grid_thw.clone()  # it edits its input
    pos, _ = HFQwen3VLModel.get_rope_index(
        fake, ids[None], mm_token_type_ids=types[None], image_grid_thw=sample.image_grid_thw, video_grid_thw=video
    )
    return pos[:, 0]


class _HFRopeSelf:
    class config:  # noqa: N801  (mirrors the attribute path transformers reads)
        class vision_config:  # noqa: N801
            spatial_merge_size = MERGE

    def get_vision_position_ids(self, *args, **kwargs):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as HFQwen3VLModel

        return HFQwen3VLModel.get_vision_position_ids(self, *args, **kwargs)


def build_tiny_qwen3vl(
    model_module,
    *,
    cp_size: int,
    seed: int = 0,
    init_std: float = 0.2,
    vision_dp_when_cp: bool = False,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    layer_spec=None,
    dtype: torch.dtype = torch.float32,
    parallel_output: bool = True,
):
    """The real `Qwen3VLModel` of `model_module`; eval mode, deterministic in `seed` (for a given `tp_size`).

    Megatron's parallel state must be initialized (tensor/context parallel sizes as given) before calling this.
    `vision_dp_when_cp` splits the vision tower's work across CP ranks (then all-gathers the embeddings).
    `layer_spec`: the language layer spec; default the CPU harness's local spec with the reference core attention
    (the GPU tests pass Transformer Engine's). `dtype`: parameter dtype (fp32 on CPU; bf16 with TE on GPU).
    """
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    from tests.patches.harness.shims import language_layer_spec

    vision_config = Qwen3VLVisionConfig(
        depth=2,
        hidden_size=32,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL_PATCH,
        out_hidden_size=64,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
    )
    config = model_module.Qwen3VLTransformerConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=init_std,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        context_parallel_size=cp_size,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=sequence_parallel,
        calculate_per_token_loss=True,  # the model asserts it under CP
        vocab_size=VOCAB,
        language_max_sequence_length=4096,
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL_PATCH,
        in_channels=3,
        spatial_merge_size=MERGE,
        num_position_embeddings=16,
        out_hidden_size=64,
        mrope_section=[4, 2, 2],
        rotary_base=1000,
        apply_rope_fusion=False,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_dp_when_cp=vision_dp_when_cp,
    )
    torch.manual_seed(seed)
    model = model_module.Qwen3VLModel(
        language_transformer_config=config,
        language_transformer_layer_spec=layer_spec if layer_spec is not None else language_layer_spec(),
        vision_transformer_config=vision_config,
        parallel_output=parallel_output,
        pre_process=True,
        post_process=True,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    # Non-megatron parameters (vision pos_embed, norms) take torch's default init; make them large too.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and ("norm" in name or "layernorm" in name):
                param.copy_(1.0 + init_std * torch.randn_like(param))
    return model.eval()
