"""Shared fixtures: the offline Qwen3-VL processor with a small pixel range, and an encoder over it."""

import pytest

from miles_vl.data import PromptEncoder, load_processor
from tests.data.helpers import MAX_PIXELS, MIN_PIXELS

INSTRUCTION = "Put the final answer in \\boxed{}."


@pytest.fixture(scope="session")
def processor():
    return load_processor("offline", MIN_PIXELS, MAX_PIXELS)


@pytest.fixture(scope="session")
def encoder(processor):
    return PromptEncoder(processor, instruction=INSTRUCTION)
