"""Contract: a request with images is one SGLang 0.5.16 can take, and it comes back as exactly our canonical ids.

0.5.16 decodes `input_ids` to text and runs the HF processor on that text and the images (base_processor.py:812
`load_mm_data` -> :893 `fast_load_mm_data` -> :1320 `process_and_combine_mm_data` -> `process_mm_data`); the processor
expands EVERY `<|image_pad|>`, so canonical (already expanded) ids run it out of images: StopIteration, HTTP 500 (seen
on an H100 on 2026-11-23). With one pad per image block it expands each once, and `SGLANG_MM_AVOID_RETOKENIZE` (on by
default) keeps our other ids verbatim (`_expand_input_ids`, :1285).

The reference is the project's own processor (`miles_vl.data.load_processor` on the offline Qwen3-VL processor),
called here as SGLang calls it, independently of the request code: these tests fail if `request_input_ids` sent the
expanded ids again. The stand-ins (fake_server.py without a model, hf_server.py with the processor) are held to the
same behaviour: the expanded form is an HTTP 500 whose log names StopIteration, the one-pad form is echoed expanded.
"""

from __future__ import annotations

import base64
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from miles_vl.data import PromptEncoder, load_processor
from miles_vl.models.qwen3_vl.tokens import special_tokens
from miles_vl.rollout.sglang import EngineOptions, SGLangRolloutEngine, SGLangUnavailableError
from miles_vl.rollout.sglang.generate import request_input_ids
from miles_vl.rollout.types import SamplingParams
from tests.rollout.sglang.conftest import EOS, MAX_PIXELS, MIN_PIXELS, TOKENS, make_prompt, quick_client
from tests.rollout.sglang.fake_server import BadRequest, ServerError, image_token_count
from tests.rollout.sglang.hf_server import sglang_prompt

IMAGE_KWARGS = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}  # what --mm-process-config passes


@pytest.fixture(scope="module")
def processor():
    return load_processor("offline", MIN_PIXELS, MAX_PIXELS)


def images() -> list[Image.Image]:
    """Three images of different sizes. Qwen's smart_resize rounds each side to a multiple of 32 and scales the area
    into [MIN_PIXELS, MAX_PIXELS]: 64x48 -> 64x64 (grid 4x4, 4 tokens); 40x90 -> 32x96 = 3072 < 3136, grown to
    64x96 (grid 6x4, 6 tokens); 120x100 -> 128x96 = 12288 (grid 6x8, 12 tokens)."""
    return [
        Image.new("RGB", (64, 48), (200, 10, 10)),
        Image.new("RGB", (40, 90), (10, 200, 10)),
        Image.new("RGB", (120, 100), (10, 10, 200)),
    ]


@pytest.fixture(scope="module")
def canonical(processor):
    """A chat prompt with three images, two of them adjacent, encoded as miles_vl.data encodes prompts."""
    encoder = PromptEncoder(processor, instruction="Answer in \\boxed{}.")
    text = encoder.render("Compare <image> with <image><image>: which is larger?")
    ims = images()
    out = processor(text=[text], images=ims, return_tensors="pt")
    return out["input_ids"][0].tolist(), ims, out["image_grid_thw"], out["pixel_values"]


def sglang_0_5_16(processor, input_ids: list[int], ims: list[Image.Image]) -> list[int]:
    """The prompt ids SGLang 0.5.16 runs for `input_ids` + `ims` (Qwen3-VL, default environment), from the processor:
    decode, process text + images with the image kwargs, then keep the request's ids with the i-th pad expanded to
    image i's count (the processor's own count)."""
    text = processor.tokenizer.decode(input_ids)
    processed = processor(text=[text], images=ims, images_kwargs=dict(IMAGE_KWARGS), return_tensors="pt")
    pad = processor.image_token_id
    counts = [int(g.prod()) // 4 for g in processed["image_grid_thw"]]  # merge 2: t*h*w / 2^2
    assert processed["input_ids"][0].tolist().count(pad) == sum(counts)
    assert input_ids.count(pad) == len(counts)  # _expand_input_ids's precondition
    out, k = [], 0
    for t in input_ids:
        out += [pad] * counts[k] if t == pad else [t]
        k += t == pad
    assert out == processed["input_ids"][0].tolist()  # no token drift for this prompt either way
    return out


def test_canonical_ids_make_sglangs_processor_raise_stopiteration(processor, canonical):
    """The real failure, reproduced with our processor: decode the canonical ids and process them with the images."""
    ids, ims, grid, _ = canonical
    assert [int(g.prod()) // 4 for g in grid] == [4, 6, 12] and ids.count(processor.image_token_id) == 22
    with pytest.raises(StopIteration):
        processor(text=[processor.tokenizer.decode(ids)], images=ims, images_kwargs=dict(IMAGE_KWARGS))


def test_the_engines_request_round_trips_to_the_canonical_ids(processor, canonical):
    """The request the engine really sends (captured from `SGLangRolloutEngine.generate`), processed as 0.5.16
    processes it, gives back exactly the canonical ids, so the engine's prompt check passes."""
    ids, ims, grid, _ = canonical
    tokens = special_tokens(processor)
    sent = []

    class Processing:  # the /generate of a server that processes the request as 0.5.16 does (no model)
        base_url = "processor://"

        def generate(self, payload):
            sent.append(payload)
            decoded = [
                Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB")
                for u in payload["image_data"]
            ]
            prompt = sglang_0_5_16(processor, payload["input_ids"], decoded)
            eos = tokens.eos_token_ids[0]
            meta = {"finish_reason": {"type": "stop", "matched": eos}, "prompt_tokens": len(prompt),
                    "weight_version": None, "output_token_logprobs": [[-0.5, eos, None]]}  # fmt: skip
            return {"output_ids": [eos], "prompt_token_ids": prompt, "meta_info": meta}

    prompt = type("P", (), {"prompt_ids": torch.tensor(ids), "image_grid_thw": grid, "images": ims})()
    engine = SGLangRolloutEngine(Processing(), tokens, EngineOptions(weight_device=None))
    [[gen]] = engine.generate([prompt], SamplingParams(max_new_tokens=4))  # raises on any prompt-id mismatch
    assert gen.finish_reason == "stop"
    [payload] = sent
    pad = processor.image_token_id
    assert payload["input_ids"].count(pad) == 3 == len(payload["image_data"])
    assert sglang_0_5_16(processor, payload["input_ids"], ims) == ids


@settings(max_examples=60, deadline=None)
@given(st.integers(8, 400), st.integers(8, 400), st.sampled_from([(MIN_PIXELS, MAX_PIXELS), (65536, 16777216)]))
def test_fake_servers_token_count_is_the_processors(processor, height, width, pixels):
    """fake_server.py counts an image's tokens with its own smart_resize; transformers' processor is the reference."""
    counts = processor._get_num_multimodal_tokens(
        image_sizes=[(height, width)], min_pixels=pixels[0], max_pixels=pixels[1]
    )
    assert image_token_count(height, width, *pixels) == counts.num_image_tokens[0]


def test_fake_server_answers_expanded_ids_with_500_and_echoes_one_pad_expanded(fake):
    """As 0.5.16: the canonical (expanded) ids are an HTTP 500 ("Internal Server Error", retried by the client) with
    StopIteration in the server log; one pad per block is expanded by each image's size (64x64 -> 4 tokens)."""
    prompt = make_prompt([11, 12], 2)
    client = quick_client(fake.url, max_retries=1)
    payload = {
        "input_ids": prompt.prompt_ids.tolist(),
        "image_data": [_png_url(im) for im in prompt.images],
        "sampling_params": {"max_new_tokens": 2, "stop_token_ids": [EOS]},
        "return_prompt_token_ids": True,
    }
    with pytest.raises(
        SGLangUnavailableError, match=r"failed 2 time\(s\); last error: HTTP 500: Internal Server Error"
    ):
        client.generate(payload)
    assert sum("StopIteration" in line for line in fake.state.log) == 2
    one_pad = request_input_ids(payload["input_ids"], TOKENS.image_token_id, 2)
    body = client.generate({**payload, "input_ids": one_pad})
    assert body["prompt_token_ids"] == prompt.prompt_ids.tolist()
    wide = Image.new("RGB", (128, 64))  # 8192 pixels, in range: grid 1x4x8 -> 8 tokens
    body = client.generate({**payload, "input_ids": one_pad, "image_data": [_png_url(wide), payload["image_data"][1]]})
    assert body["prompt_token_ids"] == [11, 12, 151652] + [151655] * 8 + [151653, 151652] + [151655] * 4 + [151653]


def test_hf_servers_processing_is_sglangs(processor, canonical):
    """hf_server.py's `sglang_prompt` (what it runs for a request) against the reference above: one pad per block
    gives the canonical ids and the processor's pixels; the expanded ids are its HTTP 500; a block count that does not
    match the images is refused; the image kwargs decide the size (a larger min_pixels gives more tokens)."""
    ids, ims, grid, pixels = canonical
    one_pad = request_input_ids(ids, processor.image_token_id, 3)
    got, pixel_values, got_grid = sglang_prompt(processor, one_pad, ims, IMAGE_KWARGS)
    assert got == ids and torch.equal(got_grid, grid) and torch.equal(pixel_values, pixels)
    with pytest.raises(ServerError, match="StopIteration"):
        sglang_prompt(processor, ids, ims, IMAGE_KWARGS)
    with pytest.raises(BadRequest, match=r"2 image\(s\) for 3 vision block\(s\)"):
        sglang_prompt(processor, one_pad, ims[:2], IMAGE_KWARGS)
    larger, _, _ = sglang_prompt(processor, one_pad, ims, {"min_pixels": 4 * MIN_PIXELS, "max_pixels": 4 * MAX_PIXELS})
    assert larger.count(processor.image_token_id) > ids.count(processor.image_token_id)


def _png_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
