"""SGLang 0.5.17's multimodal processor threads under the plugin (part of the tokenizer hook).

New in 0.5.17: Qwen-VL processors run `process_and_combine_mm_data` in worker threads (`--mm-processor-worker-num`,
0 = the model's default, 2 for Qwen2/2.5/3-VL: `QwenVLImageProcessor.__init__`, `srt/multimodal/processors/qwen_vl.py
:313`; `BaseMultimodalProcessor.process_and_combine_mm_data_async`, `base_processor.py:1639`, through
`MultimodalProcessorExecutor.run`, `executor.py:28`, `loop.run_in_executor`). 0.5.16 ran it inline in the tokenizer's
event loop. Two consequences, both met on an H100 (GPU run of 2026-11-26, tests/gpu/test_sglang_real.py):

- **A batch's prefixes left one by one.** The grouped handler (`grouping.handle_grouped`) sends the prefixes that are
  tokenized in the same turn of the event loop in one message. With a thread hop per prompt, a batch of three prompts
  given as pixel values (nothing to decode or process) was tokenized over three turns and prefilled as batches of
  1 and 2 instead of one of 3. So a request whose media are all preprocessed (`processor_output` or
  `precomputed_embedding` items: what the engine sends with the plugin, `wire.resolve_media`) is combined inline, as
  0.5.16 and 0.5.17 with one worker do: for such items the processor only gathers the dicts' tensors into items.
  Raw images and videos keep 0.5.17's threads (there the processing is the work, and the prefixes still pipeline).
- **A StopIteration hung the request for ever.** transformers' processor raises `StopIteration` when a prompt has
  more image placeholders than images (`ProcessorMixin.get_text_with_replacements`: the expanded ids miles_vl sent
  before the one-pad fix). Inline, Python turns it into `RuntimeError("coroutine raised StopIteration")` and the
  route answers HTTP 500 (0.5.16). From a thread, asyncio cannot put a `StopIteration` into the request's future
  (`_chain_future._set_state` -> `Future.set_exception` raises `TypeError`, logged as "Exception in callback"), so the
  future never finishes: the client waits until its timeout, the request's state (made by `generate_request` before
  tokenizing) stays for the server's life, and so does its hold on `model_update_lock.reader_lock`, which blocks every
  later weight update (`update_weights_from_tensor` takes the writer lock). So the worker's call re-raises a
  `StopIteration` as a `RuntimeError` naming it (chained): the request fails as on 0.5.16 (HTTP 500, the reason in the
  server's log), its state and lock are released (`generate_request`'s own `except`), and the server keeps serving.
"""

from __future__ import annotations

from miles_vl.sglang_plugin.adapter import Context, Target

BASE_PROCESSOR_MODULE = "sglang.srt.multimodal.processors.base_processor"
EXECUTOR_MODULE = "sglang.srt.multimodal.processors.executor"
BASE = "BaseMultimodalProcessor"
EXECUTOR = "MultimodalProcessorExecutor"

TARGETS = (
    Target(BASE_PROCESSOR_MODULE, f"{BASE}.process_and_combine_mm_data_async", ("self", "base_output", "mm_tokens")),
    Target(BASE_PROCESSOR_MODULE, f"{BASE}.process_and_combine_mm_data", ("self", "base_output", "mm_tokens")),
    Target(BASE_PROCESSOR_MODULE, f"{BASE}._all_mm_data_is_preprocessed"),
    Target(EXECUTOR_MODULE, f"{EXECUTOR}._run", ("self", "function", "args", "kwargs")),
)
PATCHED = (
    (BASE_PROCESSOR_MODULE, f"{BASE}.process_and_combine_mm_data_async"),
    (EXECUTOR_MODULE, f"{EXECUTOR}._run"),
)


def patch_processor(base_cls, executor_cls) -> None:
    """Wrap 0.5.17's `BaseMultimodalProcessor.process_and_combine_mm_data_async` (`base_cls`): preprocessed media are
    combined inline; and `MultimodalProcessorExecutor._run` (`executor_cls`): a `StopIteration` leaves the worker
    thread as a `RuntimeError` (module docstring)."""
    combine_async, run = base_cls.process_and_combine_mm_data_async, executor_cls._run

    async def process_and_combine_mm_data_async(self, base_output, mm_tokens, **kwargs):
        if self._all_mm_data_is_preprocessed(base_output.images, base_output.videos, base_output.audios):
            return self.process_and_combine_mm_data(base_output, mm_tokens, **kwargs)
        return await combine_async(self, base_output, mm_tokens, **kwargs)

    def _run(self, function, args, kwargs):
        try:
            return run(self, function, args, kwargs)
        except StopIteration as e:  # would leave the request's future unfinished for ever (module docstring)
            name = getattr(function, "__qualname__", repr(function))
            raise RuntimeError(
                f"{name} raised StopIteration in SGLang's multimodal processor thread (transformers' processor does "
                "when the prompt holds more image or video placeholders than the request's media: send one "
                "placeholder per image, not the expanded ids); raised as this error so that the request fails "
                "instead of hanging"
            ) from e

    base_cls.process_and_combine_mm_data_async = process_and_combine_mm_data_async
    executor_cls._run = _run


def apply(modules: dict, context: Context) -> None:
    """In every process that loads the plugin (the processor threads run in the launching one; elsewhere unused)."""
    patch_processor(getattr(modules[BASE_PROCESSOR_MODULE], BASE), getattr(modules[EXECUTOR_MODULE], EXECUTOR))
