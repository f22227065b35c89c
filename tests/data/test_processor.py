"""Contract: `load_processor("offline")` is a real transformers `Qwen3VLProcessor` with Qwen3-VL's token strings,
chat template and image settings, a small vocabulary, and the pixel range asked for; the shipped files are exactly
what `build_offline_processor` builds; `special_tokens` reads ids that a tiny Qwen3-VL config accepts."""

import json

import pytest
import torch
from PIL import Image
from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor

from miles_vl.data import DataError, load_processor, processor_metadata
from miles_vl.models.qwen3_vl.model import tiny_config
from miles_vl.models.qwen3_vl.processor import QWEN3_VL_ADDED_TOKENS, build_offline_processor
from miles_vl.models.qwen3_vl.tokens import special_tokens
from tests.data.helpers import MAX_PIXELS, MIN_PIXELS

QWEN3_VL_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                     "<|video_pad|>", "<|endoftext|>", "<think>", "</think>"]  # fmt: skip


def test_offline_is_a_real_qwen3_vl_processor(processor):
    assert type(processor) is Qwen3VLProcessor
    assert isinstance(processor.tokenizer, Qwen2Tokenizer)
    assert isinstance(processor.image_processor, Qwen2VLImageProcessor)
    ip = processor.image_processor
    assert (ip.patch_size, ip.merge_size, ip.temporal_patch_size) == (16, 2, 2)
    assert list(ip.image_mean) == [0.5] * 3 and list(ip.image_std) == [0.5] * 3
    assert (ip.size.shortest_edge, ip.size.longest_edge) == (MIN_PIXELS, MAX_PIXELS)
    tok = processor.tokenizer
    assert 300 <= len(tok) <= 4000  # small: a tiny random model stays cheap
    vocab = tok.get_vocab()
    for token in QWEN3_VL_SPECIALS:
        assert token in vocab, token
        assert tok.convert_ids_to_tokens(tok(token)["input_ids"]) == [token]  # one token, never split
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    # Added tokens keep Qwen3-VL's relative order (ids 151643.. there) and its special flags.
    ids = [vocab[t] for t, _ in QWEN3_VL_ADDED_TOKENS]
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    assert "<think>" not in tok.all_special_tokens and "<|image_pad|>" in tok.all_special_tokens


def test_tokenizer_round_trips_text(processor):
    tok = processor.tokenizer
    text = "Find x. Round to the nearest tenth: 12.5° ∠ABC <think>\nstep</think> \\boxed{3\\sqrt{2}} ünïcode"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # the learned merges do compress the text they were built for
    assert tok.convert_ids_to_tokens(tok("2024")["input_ids"]) == ["2", "0", "2", "4"]  # Qwen: single digits


def test_shipped_files_are_the_build(processor):
    built = build_offline_processor()
    shipped, fresh = (
        json.loads(processor.tokenizer.backend_tokenizer.to_str()),
        json.loads(built.tokenizer.backend_tokenizer.to_str()),
    )
    assert shipped["model"]["vocab"] == fresh["model"]["vocab"]
    assert shipped["model"]["merges"] == fresh["model"]["merges"]
    assert shipped["added_tokens"] == fresh["added_tokens"]
    assert shipped["pre_tokenizer"] == fresh["pre_tokenizer"]
    assert processor.chat_template == built.chat_template


def test_chat_template_expands_image_tokens(processor):
    """The processor's own apply_chat_template gives t*h*w/4 `<|image_pad|>` per image, between vision markers."""
    img = Image.new("RGB", (100, 60), "white")
    messages = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "Find x."}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        text
        == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.<|im_end|>\n<|im_start|>assistant\n"
    )
    out = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt"
    )
    ids, grid = out["input_ids"][0], out["image_grid_thw"]
    tokens = special_tokens(processor)
    n_pad = int((ids == tokens.image_token_id).sum())
    assert n_pad == int(grid.prod()) // 4 > 0
    start = int((ids == tokens.vision_start_token_id).nonzero())
    assert int(ids[start + n_pad + 1]) == tokens.vision_end_token_id
    assert out["pixel_values"].shape == (int(grid.prod()), 3 * 2 * 16 * 16)


def test_special_tokens_fit_a_tiny_model(processor):
    tokens = special_tokens(processor)
    tok = processor.tokenizer
    assert tokens.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") == processor.image_token_id
    assert tokens.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert tokens.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert tokens.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert tokens.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert tokens.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))
    assert tokens.vocab_size == len(tok)
    cfg = tiny_config(tokens)
    assert cfg.text_config.vocab_size == len(tok) and cfg.image_token_id == tokens.image_token_id
    assert max(tok.get_vocab().values()) < cfg.text_config.vocab_size


def test_pixel_range_decides_the_grid(tmp_path):
    img = Image.new("RGB", (256, 256), "white")
    small = load_processor("offline", 32 * 32, 64 * 64)
    large = load_processor("offline", 32 * 32, 256 * 256)
    g_small = small.image_processor(images=[img], return_tensors="pt")["image_grid_thw"]
    g_large = large.image_processor(images=[img], return_tensors="pt")["image_grid_thw"]
    assert g_small.tolist() == [[1, 4, 4]] and g_large.tolist() == [[1, 16, 16]]
    assert processor_metadata(small)["max_pixels"] == 64 * 64
    # A saved processor directory loads like a checkpoint's (local files only) and keeps the new range.
    small.save_pretrained(str(tmp_path))
    again = load_processor(str(tmp_path), 32 * 32, 64 * 64)
    assert type(again) is Qwen3VLProcessor
    assert torch.equal(again.image_processor(images=[img], return_tensors="pt")["image_grid_thw"], g_small)


def test_load_processor_errors(tmp_path):
    with pytest.raises(DataError, match="model.processor") as nope:
        load_processor(str(tmp_path / "nope"), 1024, 4096)
    assert "hf download" not in str(nope.value)  # a path, not a hub id
    # a hub id not in the cache (issue 35.3): the message says how to fetch it; local files only, so no network
    with pytest.raises(DataError, match=r"fetch the hub id with `hf download acme/not-cached-vl`"):
        load_processor("acme/not-cached-vl", 1024, 4096)
    with pytest.raises(ValueError, match="min_pixels <= max_pixels"):
        load_processor("offline", 4096, 1024)


def test_a_checkpoints_video_settings_are_kept_unless_given(tmp_path):
    """Pins a bug: the data.video_* defaults (transformers' class defaults) replaced a checkpoint's own video
    processor settings in every run, video or not, and export wrote them out. Unset (None) keeps the checkpoint's
    value; a given one replaces only itself; processor.yaml records what is used; the resolved settings are checked."""
    from miles_vl.data import VideoSettings

    load_processor("offline", 32 * 32, 64 * 64).save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "processor_config.json").read_text())
    vp = config["video_processor"]
    vp.update(fps=1, min_frames=2, max_frames=32, size={"shortest_edge": 2048, "longest_edge": 65536})
    (tmp_path / "processor_config.json").write_text(json.dumps(config))
    video_keys = ("video_fps", "video_min_frames", "video_max_frames", "video_min_pixels", "video_max_pixels")

    def recorded(processor):
        return tuple(processor_metadata(processor)[k] for k in video_keys)

    assert recorded(load_processor(str(tmp_path), 32 * 32, 64 * 64)) == (1.0, 2, 32, 2048, 65536)
    assert recorded(load_processor(str(tmp_path), 32 * 32, 64 * 64, VideoSettings())) == (1.0, 2, 32, 2048, 65536)
    given = load_processor(str(tmp_path), 32 * 32, 64 * 64, VideoSettings(fps=4.0, max_pixels=32768))
    assert recorded(given) == (4.0, 2, 32, 2048, 32768)
    assert recorded(load_processor("offline", 32 * 32, 64 * 64)) == (2.0, 4, 768, 131072, 786432)  # Qwen3-VL's
    with pytest.raises(
        ValueError, match=r"min_frames=64, max_frames=32, .*given: min_frames=64\); fix .*data.video_min_frames"
    ):
        load_processor(str(tmp_path), 32 * 32, 64 * 64, VideoSettings(min_frames=64))  # above the checkpoint's max


def test_image_keys_of_processor_yaml_are_as_before_videos():
    """processor.yaml of an image-only run starts with the keys and values main wrote before videos (the text of
    `yaml.safe_dump(processor_metadata(...), sort_keys=False)` from main at 5ab13b4); the video keys follow."""
    import yaml

    text = yaml.safe_dump(processor_metadata(load_processor("offline", 32 * 32, 64 * 64)), sort_keys=False)
    before = (
        "processor_class: Qwen3VLProcessor\npatch_size: 16\ntemporal_patch_size: 2\nmerge_size: 2\nmin_pixels: 1024\n"
        "max_pixels: 4096\ntokenizer_size: 590\n"
    )
    assert text.startswith(before) and text[len(before) :].startswith("video_fps: 2.0\n")
