"""Shared pieces of the sglang engine tests: the in-process stand-in server, prompts with images, quick clients."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image

from miles_vl.models import SpecialTokens
from miles_vl.rollout.sglang import EngineOptions, RequestPolicy, SGLangClient, SGLangRolloutEngine
from miles_vl.rollout.sglang.server import free_port as server_free_port
from tests.rollout.sglang.fake_server import IMAGE_TOKEN_ID, VISION_START_TOKEN_ID, FakeSGLang

FAKE_SERVER = Path(__file__).with_name("fake_server.py")
VIDEO, VEND, PAD, EOS = 151656, 151653, 151643, 151645
MIN_PIXELS, MAX_PIXELS = 3136, 12544  # the image range the test servers run with (--mm-process-config)
TOKENS = SpecialTokens(IMAGE_TOKEN_ID, VIDEO, VISION_START_TOKEN_ID, VEND, PAD, (EOS,), vocab_size=151936)


@dataclass
class Prompt:
    """A canonical prompt as miles_vl.data builds it, plus the `images` the sglang engine sends to a server without a
    pixel directory."""

    prompt_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    images: list | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None


def make_prompt(text: list[int], n_images: int = 0, *, color: int = 0, with_images: bool = True) -> Prompt:
    """`text` followed by `n_images` vision blocks of 64x64-pixel images: with patch 16 and merge 2 (Qwen3-VL), an
    image of 64 * 64 = 4096 pixels in [MIN_PIXELS, MAX_PIXELS] keeps its size, so its grid is 1x4x4 and its block
    holds 4x4 / 2^2 = 4 merged tokens. Its pixel values are random (seeded by `color`): 16 patches of 1536 per image."""
    ids = list(text)
    for _ in range(n_images):
        ids += [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * 4 + [VEND]
    grid = torch.tensor([[1, 4, 4]] * n_images) if n_images else None
    pixels = torch.randn(16 * n_images, 1536, generator=torch.Generator().manual_seed(color)) if n_images else None
    images = [Image.new("RGB", (64, 64), (color, 10 * k, 200)) for k in range(n_images)]
    return Prompt(torch.tensor(ids), pixels, grid, images if with_images else None)


def make_video_prompt(text: list[int], frames: int = 2, *, seed: int = 0) -> Prompt:
    """`text` followed by a video of `frames` frame groups of 64x64 pixels, as Qwen3-VL lays it out: each frame group
    its own `<|vision_start|>` + 4 `<|video_pad|>` + `<|vision_end|>` block behind a timestamp token (here one id,
    7); grid (frames, 4, 4), 16 random patches of 1536 per frame group."""
    ids = list(text)
    for _ in range(frames):
        ids += [7, VISION_START_TOKEN_ID] + [VIDEO] * 4 + [VEND]
    pixels = torch.randn(16 * frames, 1536, generator=torch.Generator().manual_seed(seed))
    return Prompt(torch.tensor(ids), None, None, None, pixels, torch.tensor([[frames, 4, 4]]))


def free_port() -> int:
    """A free loopback port (the host's own `free_port`, for tests that start servers or groups themselves)."""
    return server_free_port("127.0.0.1")


def fake_argv(argv: list[str]) -> list[str]:
    """`build_server_argv`'s command with the stand-in script in place of `-m sglang.launch_server`."""
    assert argv[1:3] == ["-m", "sglang.launch_server"], argv
    return [sys.executable, str(FAKE_SERVER), *argv[3:]]


def quick_client(url: str, **kwargs) -> SGLangClient:
    """A client with test-sized timeouts and backoff (every retry loop here ends within a few seconds); `kwargs` are
    `RequestPolicy` fields and the client's own keywords, by name."""
    policy = {"timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.01}
    policy |= {k: kwargs.pop(k) for k in [k for k in kwargs if k in policy]}
    return SGLangClient(url, policy=RequestPolicy(**policy), **kwargs)


def make_engine(client: SGLangClient, **kwargs) -> SGLangRolloutEngine:
    """An engine on `client` with TOKENS; `kwargs` are `EngineOptions` fields and the engine's own keywords, by name."""
    fields = {f.name for f in dataclasses.fields(EngineOptions)}
    options = EngineOptions(**{k: v for k, v in kwargs.items() if k in fields})
    return SGLangRolloutEngine(client, TOKENS, options, **{k: v for k, v in kwargs.items() if k not in fields})


@pytest.fixture
def fake() -> Iterator[FakeSGLang]:
    with FakeSGLang(weight_version="base", image_min_pixels=MIN_PIXELS, image_max_pixels=MAX_PIXELS) as server:
        yield server
