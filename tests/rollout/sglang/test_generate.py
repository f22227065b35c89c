"""Contract: the `/generate` body is exactly the SGLang 0.5.16 `GenerateReqInput` we intend (one pad per image block
and PNG data URLs of the decoded pixels for SGLang's own server; the canonical ids and one `processor_output` item per
modality, whose pixel values are files of the server's pixel directory, for miles_vl's launcher; EOS as stop ids,
banned vision tokens, logprobs and prompt ids requested); ids that disagree with the grids never leave; a response
becomes a `Generation` only if it scores every output token, stops on one of our EOS ids, and SGLang's prompt ids
equal ours; otherwise the error names what differs (for prompts, the first differing position)."""

from __future__ import annotations

import base64
import errno
import hashlib
import io

import pytest
import torch
from PIL import Image

from miles_vl.rollout.sglang import PromptMismatchError, SGLangResponseError
from miles_vl.rollout.sglang.generate import (
    GenerationAbortedError,
    batch_payload,
    build_generate_payload,
    check_prompt_tokens,
    image_data_url,
    image_hash,
    parse_generate_response,
    pixel_media,
    prompt_images,
    request_input_ids,
    sampling_seed,
    vision_inputs,
)
from miles_vl.rollout.types import SamplingParams
from miles_vl.sglang_plugin.wire import FILE_KEY, read_tensor
from tests.rollout.sglang.conftest import EOS, TOKENS, VEND, VIDEO, Prompt, make_prompt, make_video_prompt
from tests.rollout.sglang.fake_server import IMAGE_TOKEN_ID, VISION_START_TOKEN_ID


def decode_url(url: str) -> Image.Image:
    head, data = url.split(",", 1)
    assert head == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data, validate=True)))


def test_payload_is_exactly_the_intended_request():
    params = SamplingParams(n=4, max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20, seed=5)
    body = build_generate_payload([1, 2, 3], ["data:image/png;base64,AAAA"], params, seed=99, stop_token_ids=[EOS],
                                  banned_token_ids=[151655, 151652])  # fmt: skip
    assert body == {
        "input_ids": [1, 2, 3],
        "image_data": ["data:image/png;base64,AAAA"],
        "sampling_params": {
            "max_new_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "stop_token_ids": [EOS],
            "sampling_seed": 99,
            "logit_bias": {"151655": -1e9, "151652": -1e9},
        },
        "return_logprob": True,
        "return_prompt_token_ids": True,
        "stream": False,
    }
    text_only = build_generate_payload([7], [], SamplingParams(top_k=0), seed=0, stop_token_ids=[EOS])
    assert "image_data" not in text_only and "logit_bias" not in text_only["sampling_params"]
    assert text_only["sampling_params"]["top_k"] == -1  # SGLang: -1 disables top-k, 0 is rejected


def test_image_hashes_go_as_mm_hashes_one_per_image_and_follow_the_bytes():
    """`mm_hashes` keys SGLang's prefix cache: equal image bytes must give equal hashes, different bytes different
    ones (else two images would share a cached prefix); the reference is BLAKE2b written out here."""
    red, blue = image_data_url(Image.new("RGB", (8, 8), "red")), image_data_url(Image.new("RGB", (8, 8), "blue"))
    assert image_hash(red) == image_hash(image_data_url(Image.new("RGB", (8, 8), "red")))
    assert image_hash(red) != image_hash(blue)
    assert image_hash(red) == hashlib.blake2b(red.encode(), digest_size=8).hexdigest()
    assert int(image_hash(red), 16) < 2**64  # SGLang parses each entry with int(h, 16)
    body = build_generate_payload([1], [red, blue], SamplingParams(), seed=0, stop_token_ids=[EOS],
                                  image_hashes=[image_hash(red), image_hash(blue)])  # fmt: skip
    assert body["mm_hashes"] == [image_hash(red), image_hash(blue)]
    assert "mm_hashes" not in build_generate_payload([1], [red], SamplingParams(), seed=0, stop_token_ids=[EOS])
    with pytest.raises(ValueError, match="1 image hashes for 2 images"):
        build_generate_payload([1], [red, blue], SamplingParams(), seed=0, stop_token_ids=[EOS], image_hashes=["ab"])


VS, PAD, VE = 151652, 151655, 151653  # Qwen3-VL <|vision_start|>, <|image_pad|>, <|vision_end|>


def test_request_ids_collapse_each_image_block_to_one_pad():
    """Contract: every run of `<|image_pad|>` (one image's expanded block) becomes one pad, everything else is kept
    verbatim and in order; the number of runs must equal the number of images sent. Expected ids written out."""
    ids = [1, 2, VS, PAD, PAD, PAD, VE, 3, VS, PAD, PAD, VE, 4]
    assert request_input_ids(ids, PAD, 2) == [1, 2, VS, PAD, VE, 3, VS, PAD, VE, 4]
    # adjacent blocks (no text between them) stay two blocks: <|vision_end|><|vision_start|> separates the runs
    adjacent = [VS, PAD, PAD, PAD, PAD, VE, VS, PAD, VE, VS, PAD, PAD, VE]
    assert request_input_ids(adjacent, PAD, 3) == [VS, PAD, VE, VS, PAD, VE, VS, PAD, VE]
    assert request_input_ids([5, 6, 7], PAD, 0) == [5, 6, 7]  # text only: unchanged
    assert request_input_ids([VS, PAD, VE], PAD, 1) == [VS, PAD, VE]  # already one pad: unchanged
    with pytest.raises(ValueError, match=r"2 block\(s\) of image tokens \(151655\) but 1 image\(s\)"):
        request_input_ids(ids, PAD, 1)
    with pytest.raises(ValueError, match=r"0 block\(s\) of image tokens .* but 1 image\(s\)"):
        request_input_ids([1, 2], PAD, 1)


def test_sampling_seeds_are_distinct_per_sample_and_reproducible():
    seeds = {sampling_seed(3, i, j, 4) for i in range(5) for j in range(4)}
    assert len(seeds) == 20
    assert sampling_seed(3, 2, 1, 4) == sampling_seed(3, 2, 1, 4) != sampling_seed(4, 2, 1, 4)


def test_images_travel_as_png_of_the_decoded_pixels():
    image = Image.frombytes("RGB", (5, 3), bytes(v for i in range(15) for v in (i * 13 % 256, i * 7 % 256, 255 - i)))
    assert decode_url(image_data_url(image)).tobytes() == image.tobytes()

    jpeg = io.BytesIO()
    image.save(jpeg, format="JPEG", quality=50)
    pil_decoded = Image.open(io.BytesIO(jpeg.getvalue())).convert("RGB").tobytes()
    assert decode_url(image_data_url(jpeg.getvalue())).convert("RGB").tobytes() == pil_decoded

    png = io.BytesIO()
    image.save(png, format="PNG")
    assert base64.b64decode(image_data_url(png.getvalue()).split(",", 1)[1]) == png.getvalue()  # sent as it is
    with pytest.raises(TypeError, match="PIL image or encoded bytes"):
        image_data_url("/data/img.png")


def test_prompt_images_are_required_and_counted():
    assert len(prompt_images(make_prompt([1], 2), 0)) == 2
    assert prompt_images(make_prompt([1, 2]), 0) == []
    with pytest.raises(ValueError, match=r"prompt 3 has 2 image\(s\).*no `images` attribute"):
        prompt_images(make_prompt([1], 2, with_images=False), 3)
    short = make_prompt([1], 2)
    short.images = short.images[:1]
    with pytest.raises(ValueError, match=r"1 image\(s\) in `images` but 2 image_grid_thw row\(s\)"):
        prompt_images(short, 0)


def test_video_prompts_are_refused_before_any_request():
    """SGLang 0.5.16 would re-sample and re-time the frames (docs/sglang.md, Videos): a prompt with a video grid or
    with video tokens never reaches it, and the message names the backend that takes videos."""
    video = make_prompt([1, 2])
    video.video_grid_thw = torch.tensor([[2, 4, 4]])
    with pytest.raises(ValueError, match=r"prompt 4 holds a video.*docs/sglang.md.*rollout.backend=hf"):
        prompt_images(video, 4, VIDEO)
    pads_only = make_prompt([1, VIDEO, 2])  # video tokens without a grid: still a video prompt
    with pytest.raises(ValueError, match="holds a video"):
        prompt_images(pads_only, 0, VIDEO)


def _with_video(prompt: Prompt, frames: int = 3) -> Prompt:
    video = make_video_prompt([], frames, seed=5)
    prompt.prompt_ids = torch.cat([prompt.prompt_ids, video.prompt_ids])
    prompt.pixel_values_videos, prompt.video_grid_thw = video.pixel_values_videos, video.video_grid_thw
    return prompt


def test_pixel_media_is_the_canonical_ids_and_the_prompts_own_pixels(tmp_path):
    """For miles_vl's launcher a prompt goes as the trainer sees it: its canonical ids (expanded), one
    processor_output item per modality with the grids and a reference to a file holding exactly the prompt's pixel
    values in the wire dtype (0.5.16 takes one such item per modality; `get_new_expanded_mm_items` splits it by image);
    no PNGs, no `mm_hashes`, and no item hash for two images (0.5.16 would give the split images the one hash)."""
    prompt = _with_video(make_prompt([11, 12], 2, color=4, with_images=False))
    media = pixel_media(prompt, 0, TOKENS, directory=str(tmp_path), dtype=torch.bfloat16, spatial_merge_size=2)
    assert media.input_ids == prompt.prompt_ids.tolist() and media.mm_hashes == []
    [image], [video] = media.image_data, media.video_data
    assert image["format"] == video["format"] == "processor_output"
    assert image["image_grid_thw"] == [[1, 4, 4], [1, 4, 4]] and video["video_grid_thw"] == [[3, 4, 4]]
    assert "hash" not in image and "hash" not in video
    pixels = read_tensor(image["pixel_values"], str(tmp_path))
    frames = read_tensor(video["pixel_values_videos"], str(tmp_path))
    assert torch.equal(pixels, prompt.pixel_values.to(torch.bfloat16))
    assert torch.equal(frames, prompt.pixel_values_videos.to(torch.bfloat16))
    assert sorted(media.files) == sorted(p.name for p in tmp_path.iterdir())
    assert sorted(media.files) == sorted([image["pixel_values"][FILE_KEY], video["pixel_values_videos"][FILE_KEY]])
    body = build_generate_payload(media.input_ids, media.image_data, SamplingParams(), seed=0, stop_token_ids=[EOS],
                                  video_data=media.video_data)  # fmt: skip
    assert body["image_data"] == [image] and body["video_data"] == [video] and "mm_hashes" not in body
    text = pixel_media(make_prompt([1, 2]), 1, TOKENS, directory=str(tmp_path), dtype=torch.float32,
                       spatial_merge_size=2)  # fmt: skip
    assert (text.image_data, text.video_data, text.files) == ([], [], [])
    batch = batch_payload([body, build_generate_payload(text.input_ids, [], SamplingParams(), seed=1,
                                                        stop_token_ids=[EOS])])  # fmt: skip
    assert batch["image_data"] == [[image], []] and batch["video_data"] == [[video], []]


def test_a_single_images_item_carries_the_hash_of_exactly_what_is_sent(tmp_path):
    """A one-image item carries `hash`: 63 bits of a SHA-256 of the wire dtype, shape, grid and bytes (written out here
    independently of the code); equal pixels in another file give the same hash (they may share a prefix), a change
    of one value, of the wire dtype or of the grid a different one."""
    media = pixel_media(make_prompt([11], 1, color=3), 0, TOKENS, directory=str(tmp_path), dtype=torch.bfloat16,
                        spatial_merge_size=2)  # fmt: skip
    [image] = media.image_data
    sent = read_tensor(image["pixel_values"], str(tmp_path))
    expected = hashlib.sha256(b"torch.bfloat16 [16, 1536] [[1, 4, 4]]" + sent.view(torch.uint8).numpy().tobytes())
    assert image["hash"] == int.from_bytes(expected.digest()[:8], "big") >> 1 and 0 <= image["hash"] < 2**63

    def hash_of(prompt, dtype=torch.bfloat16):
        return pixel_media(prompt, 0, TOKENS, directory=str(tmp_path), dtype=dtype, spatial_merge_size=2).image_data[0][
            "hash"
        ]

    assert hash_of(make_prompt([99, 98], 1, color=3)) == image["hash"]  # same pixels, other text and file
    changed = make_prompt([11], 1, color=3)
    changed.pixel_values[5, 7] += 1.0
    assert hash_of(changed) != image["hash"]
    assert hash_of(make_prompt([11], 1, color=3), torch.float32) != image["hash"]
    regridded = make_prompt([11], 1, color=3)
    regridded.prompt_ids = torch.tensor([11, VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * 4 + [VEND])  # 2x8 / 2^2
    regridded.image_grid_thw = torch.tensor([[1, 2, 8]])
    assert hash_of(regridded) != image["hash"]


def test_ids_that_disagree_with_the_grids_never_leave(tmp_path):
    """The server uses the ids as sent now (0.5.16's fast path for preprocessed input re-derives nothing), so the
    engine checks them: each image one run of t*h*w/4 pads, each video frame group one run of h*w/4, the pixel rows
    those of the grids; a failure names the prompt, writes nothing and leaves no file."""
    ok = _with_video(make_prompt([1], 1))
    assert [k for k, _, _ in vision_inputs(ok, 0, TOKENS, 2)] == ["pixel_values", "pixel_values_videos"]
    short = make_prompt([1], 2)
    short.prompt_ids = short.prompt_ids[:-2]  # the second image's block lost a pad
    wide = make_prompt([1], 1)
    wide.image_grid_thw = torch.tensor([[1, 4, 8]])
    no_pixels = make_prompt([1], 1)
    no_pixels.pixel_values = None
    rows = make_prompt([1], 1)
    rows.pixel_values = rows.pixel_values[:15]
    orphan = make_prompt([1, TOKENS.image_token_id, 2])  # pads without a grid
    frames = _with_video(make_prompt([1]), frames=2)
    frames.video_grid_thw = torch.tensor([[3, 4, 4]])  # three frame groups for two blocks
    cases = {
        r"prompt 3: its image blocks in prompt_ids hold \[4, 3\] tokens": short,
        r"image_grid_thw \[\[1, 4, 8\]\] asks for \[8\]": wide,
        "no pixel_values": no_pixels,
        r"pixel_values has shape \(15, 1536\)": rows,
        r"image blocks in prompt_ids hold \[1\] tokens, but image_grid_thw \[\] asks for \[\]": orphan,
        r"video blocks in prompt_ids hold \[4, 4\] tokens, but video_grid_thw \[\[3, 4, 4\]\]": frames,
    }
    for message, prompt in cases.items():
        with pytest.raises(ValueError, match=message):
            pixel_media(prompt, 3, TOKENS, directory=str(tmp_path), dtype=torch.float32, spatial_merge_size=2)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="spatial merge 4"):  # another merge size reads the same ids otherwise
        vision_inputs(ok, 0, TOKENS, 4)


def test_a_failed_write_removes_the_prompts_other_files(tmp_path, monkeypatch):
    from miles_vl.rollout.sglang import generate

    real, calls = generate.write_tensor, []

    def write_once(directory, tensor):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(directory, tensor)

    monkeypatch.setattr(generate, "write_tensor", write_once)
    with pytest.raises(
        OSError, match="prompt 0's pixel_values_videos .* No space.* --shm-size.*send_pixel_values=false"
    ):
        pixel_media(_with_video(make_prompt([1], 1)), 0, TOKENS, directory=str(tmp_path), dtype=torch.float32,
                    spatial_merge_size=2)  # fmt: skip
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


PROMPT = (1, 2, 3)  # the prompt ids `parse` checks against by default


def response(output_ids, logprobs, finish, *, prompt_ids=PROMPT, prompt_tokens=None, version="v1"):
    """A /generate response in SGLang 0.5.16's shape (tokenizer_manager.py); `prompt_ids=None` leaves out
    `prompt_token_ids`."""
    meta = {
        "id": "abc",
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "weight_version": version,
        "completion_tokens": len(output_ids),
        "cached_tokens": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids, strict=True)],
    }
    body = {"text": "…", "output_ids": output_ids, "meta_info": meta}
    if prompt_ids is not None:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def parse(body, prompt=PROMPT, max_new_tokens=8):
    return parse_generate_response(
        body, prompt_ids=list(prompt), stop_token_ids={EOS}, max_new_tokens=max_new_tokens, prompt_index=0
    )


def test_stop_and_length_responses_become_generations():
    gen, version = parse(response([5, 6, EOS], [-0.5, -1.0, -0.25], {"type": "stop", "matched": EOS},
                                  prompt_ids=[1, 2, 3], prompt_tokens=3))  # fmt: skip
    assert gen.response_ids.dtype == torch.long and gen.response_ids.tolist() == [5, 6, EOS]
    assert gen.logprobs.dtype == torch.float32 and gen.logprobs.tolist() == [-0.5, -1.0, -0.25]
    assert gen.finish_reason == "stop" and version == "v1"
    gen, _ = parse(response([5, 6], [-0.5, -1.0], {"type": "length", "length": 2}), max_new_tokens=2)
    assert gen.finish_reason == "length" and gen.response_ids.tolist() == [5, 6]


def test_prompt_mismatch_names_the_first_differing_position():
    with pytest.raises(PromptMismatchError, match=r"position 4 \(miles_vl 30, SGLang 31; lengths 8 vs 8"):
        check_prompt_tokens([1, 2, 3, 4, 30, 5, 6, 7], [1, 2, 3, 4, 31, 5, 6, 7], prompt_index=2)
    with pytest.raises(PromptMismatchError, match=r"position 3 \(miles_vl <end>, SGLang 9; lengths 3 vs 4"):
        check_prompt_tokens([1, 2, 3], [1, 2, 3, 9], prompt_index=0)
    with pytest.raises(PromptMismatchError, match="image_min_pixels"):
        parse(response([EOS], [-0.1], {"type": "stop", "matched": EOS}, prompt_ids=[1, 2, 4]))
    # The ids agree but the server's count does not: held to the count too.
    with pytest.raises(PromptMismatchError, match="counted 4 prompt tokens, miles_vl sent 3"):
        parse(response([EOS], [-0.1], {"type": "stop", "matched": EOS}, prompt_tokens=4))


def test_a_response_without_the_prompt_ids_it_was_asked_for_is_refused():
    """Issue 31.5: the check of SGLang's prompt ids ran only when the response carried them, so a server (or a patch
    of ours: the launcher's grouped copies) that dropped them turned it off silently. Every request asks for them
    (`return_prompt_token_ids`), and 0.5.16 answers them on every non-streaming path (tokenizer_manager.py:664,
    1609, 1626, 1679 set them; :2076, :2115 answer them): missing, the response is an error naming the request."""
    assert build_generate_payload([1, 2, 3], [], SamplingParams(), seed=0, stop_token_ids=[EOS])[
        "return_prompt_token_ids"
    ]
    body = response([EOS], [-0.1], {"type": "stop", "matched": EOS}, prompt_ids=None, prompt_tokens=3)
    with pytest.raises(SGLangResponseError, match=r"/generate for prompt 0: the response has no prompt_token_ids.*"
                       r"asked for \(return_prompt_token_ids\).*run a supported SGLang release"):  # fmt: skip
        parse(body)


def test_inconsistent_responses_are_refused():
    stop = {"type": "stop", "matched": EOS}
    with pytest.raises(SGLangResponseError, match="2 output ids but 1 output_token_logprobs"):
        body = response([5, EOS], [-0.1, -0.2], stop)
        body["meta_info"]["output_token_logprobs"].pop()
        parse(body)
    with pytest.raises(SGLangResponseError, match=r"output_token_logprobs\[0\].*does not score output_ids\[0\] = 5"):
        body = response([5, EOS], [-0.1, -0.2], stop)
        body["meta_info"]["output_token_logprobs"][0][1] = 6
        parse(body)
    with pytest.raises(SGLangResponseError, match="last token 7 is not one of our EOS ids"):
        parse(response([5, 7], [-0.1, -0.2], {"type": "stop", "matched": 7}))
    with pytest.raises(SGLangResponseError, match="max_new_tokens was 2"):
        parse(response([5, 6, 7], [-0.1] * 3, {"type": "length", "length": 3}), max_new_tokens=2)
    with pytest.raises(SGLangResponseError, match="`meta_info` is None"):
        parse({"output_ids": [1]})
    with pytest.raises(GenerationAbortedError, match="aborted the request: Abort before prefill"):
        parse(response([5], [-0.1], {"type": "abort", "message": "Abort before prefill", "status_code": None}))
