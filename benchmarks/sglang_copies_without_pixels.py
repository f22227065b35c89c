"""A prototype SGLang 0.5.16 launcher for bench_sglang_decode.py's `nopix` variant; not used by miles_vl.

    python -m sglang_copies_without_pixels --model-path ... (the flags of `python -m sglang.launch_server`)

For a request with `sampling_params.n > 1`, 0.5.16's tokenizer first sends the prompt alone with `max_new_tokens=0`
(it fills the prefix cache) and then sends the `n` copies, each with the prompt's pixel values in a new shared-memory
segment that the scheduler copies out again (`TokenizerManager._handle_batch_request`,
`srt/managers/tokenizer_manager.py:1630-1683`; `wrap_shm_features`, `srt/managers/mm_utils.py:1966`). A copy whose
prompt is in the prefix cache needs no pixels: the vision tower runs only for images that are not all prefix
(`_get_chunked_prefill_embedding`, `mm_utils.py:754`). This launcher drops the pixel values of those copies, when the
tokenizer has hashed them (SGLANG_MM_PRECOMPUTE_HASH=1, so the copies' pad values match the cached prefix), to
measure what the per-copy transfer costs. It is unsafe as it stands: a copy whose prefix was evicted between the
prefix request and the copy would reach the vision tower without pixels.
"""

from __future__ import annotations

import contextvars
import runpy

from sglang.srt.managers.tokenizer_manager import TokenizerManager

_IN_PARALLEL_SAMPLING = contextvars.ContextVar("in_parallel_sampling", default=False)
_handle_batch_request = TokenizerManager._handle_batch_request
_send_one_request = TokenizerManager._send_one_request


async def handle_batch_request(self, obj, request=None):
    _IN_PARALLEL_SAMPLING.set(getattr(obj, "parallel_sample_num", 1) > 1)  # this HTTP request's task only
    async for out in _handle_batch_request(self, obj, request):
        yield out


def send_one_request(self, tokenized_obj):
    mm = getattr(tokenized_obj, "mm_inputs", None)
    is_copy = _IN_PARALLEL_SAMPLING.get() and tokenized_obj.sampling_params.max_new_tokens != 0
    if is_copy and mm is not None and all(item.pad_value is not None for item in mm.mm_items):
        for item in mm.mm_items:  # the copy's own items (copied in _handle_batch_request)
            item.feature = None
    return _send_one_request(self, tokenized_obj)


TokenizerManager._handle_batch_request = handle_batch_request
TokenizerManager._send_one_request = send_one_request

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
