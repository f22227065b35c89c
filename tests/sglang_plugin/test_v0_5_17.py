"""Contract: the SGLang 0.5.17 adapter (miles_vl/sglang_plugin/v0_5_17/), where its code differs from 0.5.16's, on
stand-ins of 0.5.17's classes (the mechanisms both share: test_v0_5_16.py).

- tokenizer: a prompt's prefix and copies are children of its logical rid (`_init_child_req_state`, rids
  `<logical>_<n>`, `_remove_req_state`), as 0.5.17's own parallel-sampling branch makes them, so that aborting the
  prompt aborts them; a prompt aborted meanwhile stops its request, leaving only what 0.5.17 discards itself; 0.5.16's
  removal of the unused `batch x n` rids is not carried (0.5.17 normalizes one rid per prompt);
- receiver: one scheduler rank is read from 0.5.17's runtime context (`get_parallel().enable_dp_attention`);
- vision: 0.5.17's server arguments are read-only once resolved, so the graphs' one argument goes through
  `ServerArgs.override`, and `--mm-attention-backend` is not pinned (0.5.17's runner reads the model's backend).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import sys
import threading
import types

import pytest
import torch

from miles_vl.sglang_plugin.settings import PluginSettings
from miles_vl.sglang_plugin.v0_5_17 import processor as processor_0517
from miles_vl.sglang_plugin.v0_5_17 import receiver as receiver_0517
from miles_vl.sglang_plugin.v0_5_17 import tokenizer as tokenizer_0517
from miles_vl.sglang_plugin.v0_5_17 import vision as vision_0517
from tests.sglang_plugin.test_v0_5_16 import (
    ServerArgs0516,
    _Batch,
    _context,
    _Prompt,
    _StandInTokenizer,
    _tokenizer_module,
    _vision_module,
)


class RequestAbortedError(Exception):
    """0.5.17's RequestAbortedError (what `_raise_if_logical_rid_aborted` raises)."""


class _Prompt0517(_Prompt):
    def regenerate_rid(self, prefix=None):  # 0.5.17: `<prefix>_<uuid hex>` (io_struct.py:326)
        _Prompt.rids += 1
        self.rid = f"{prefix}_{_Prompt.rids}"
        return self.rid


class _Tokenizer0517(_StandInTokenizer):
    """0.5.17's request states (tokenizer_manager.py:3365-3410): a child's state is made only while its logical
    request's state exists and is not aborted, and is registered under it; `_remove_req_state` removes a state and
    that registration."""

    async def _handle_batch_request(self, obj, request=None):  # 0.5.17's own path: must not run here
        raise AssertionError("the grouped handler should take a non-streaming batch with n > 1")
        yield

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.children: dict[str, set[str]] = {}
        self.aborted: set[str] = set()

    def _init_child_req_state(self, logical_rid, sub, request=None):
        if logical_rid not in self.rid_to_state or logical_rid in self.aborted:
            raise RequestAbortedError(f"Request {logical_rid} was aborted")
        self._init_req_state(sub)
        self.children.setdefault(logical_rid, set()).add(sub.rid)

    def _remove_req_state(self, rid, lifecycle_id=None):
        self.log.append(("removed", rid))
        state = self.rid_to_state.pop(rid, None)
        for logical, kids in list(self.children.items()):
            kids.discard(rid)
            if not kids:
                del self.children[logical]
        return state

    async def _wait_one_response(self, sub, request=None):  # an answered child leaves as 0.5.17 removes it
        async for body in super()._wait_one_response(sub, request):
            self._remove_req_state(sub.rid)
            yield body


def _batch_0517(prompts, n, hashes) -> _Batch:
    batch = _Batch(prompts, n, hashes)
    batch.rid = [p.rid for p in prompts]  # 0.5.17 normalizes one logical rid per prompt (io_struct.py:602)
    return batch


def _run(manager, batch) -> list:
    _tokenizer_0517_patched(type(manager))
    for rid in batch.rid:  # generate_request's _init_req_state: the logical requests' states
        manager._init_req_state(types.SimpleNamespace(rid=rid))

    async def run():
        return [x async for x in manager._handle_batch_request(batch)]

    return asyncio.run(run())


def _tokenizer_0517_patched(cls, processor_cls=None, executor_cls=None) -> None:
    """0.5.17's tokenizer hook (the adapter's own `apply`) on the stand-in `cls`, and on the stand-in processor and
    executor classes where given (else throwaway ones)."""
    environ = types.SimpleNamespace(envs=types.SimpleNamespace(SGLANG_RUST_SERVER=types.SimpleNamespace(get=bool)))
    processor_cls = processor_cls or type("BaseMultimodalProcessor", (_Processor0517,), {})
    executor_cls = executor_cls or type("MultimodalProcessorExecutor", (_Executor0517,), {})
    modules = {
        tokenizer_0517.TOKENIZER_MODULE: _tokenizer_module(cls),
        tokenizer_0517.MM_UTILS_MODULE: None,
        tokenizer_0517.ENVIRON_MODULE: environ,  # SGLANG_RUST_SERVER off (`bool()` is False)
        processor_0517.BASE_PROCESSOR_MODULE: types.SimpleNamespace(BaseMultimodalProcessor=processor_cls),
        processor_0517.EXECUTOR_MODULE: types.SimpleNamespace(MultimodalProcessorExecutor=executor_cls),
    }
    tokenizer_0517.apply(modules, _context(launching=False))  # the request states (the transport: test_plugin.py)


def test_a_prompts_prefix_and_copies_are_children_of_its_logical_request():
    class TokenizerManager(_Tokenizer0517):
        pass

    pixels = torch.randn(4, 6)
    manager = TokenizerManager({"p0": 0.0, "p1": 0.0})
    batch = _batch_0517([_Prompt0517("p0", [1], pixels), _Prompt0517("p1", [2], pixels)], 3, [["a1"], ["b2"]])
    [answers] = _run(manager, batch)
    assert len(answers) == 6
    made = [rid for kind, rid in manager.log if kind == "state" and rid not in ("p0", "p1")]
    assert len(made) == 8  # per prompt: its prefix and 3 copies
    assert all(rid.split("_")[0] in ("p0", "p1") for rid in made)  # named after their prompt, as 0.5.17 names them
    assert ("removed", "p0") in manager.log and ("removed", "p1") in manager.log  # the logical states, 0.5.17's way
    assert manager.rid_to_state == {} and manager.children == {}


def test_a_prompt_aborted_while_its_prefix_prefills_stops_the_request():
    class TokenizerManager(_Tokenizer0517):
        def _send_one_request(self, tok):
            super()._send_one_request(tok)
            if tok.rid.startswith("p0_"):  # /abort_request for p0 arrives while its prefix prefills
                self.aborted.add("p0")

    manager = TokenizerManager({"p0": 0.0})
    with pytest.raises(RequestAbortedError, match="p0 was aborted"):
        _run(manager, _batch_0517([_Prompt0517("p0", [1], None)], 2, [["a1"]]))
    # the copies made before the abort are gone; the prefix that was sent keeps its state until its answer (as with
    # 0.5.16), registered under p0, whose discarding 0.5.17's generate_request does on the way out
    # (`_discard_pending_req_states`: every child of the logical rid)
    left = [rid for rid in manager.rid_to_state if rid != "p0"]
    assert len(left) == 1 and left[0].startswith("p0_") and manager.children == {"p0": set(left)}
    assert not any(kind == "batch" for kind, _ in manager.log)  # no copy left


def test_the_unused_normalized_rids_of_0_5_16_are_not_removed_here():
    """0.5.16's adapter removes the states of rids `batch` to `batch x n` (0.5.16 made them and never used them);
    0.5.17 makes none, so its adapter leaves whatever else is in the table alone."""
    assert tokenizer_0517.STATES.normalized_extra is False

    class TokenizerManager(_Tokenizer0517):
        pass

    manager = TokenizerManager({"p0": 0.0})
    batch = _batch_0517([_Prompt0517("p0", [1], None)], 2, [["a1"]])
    batch.rid = ["p0", "another_request"]  # where 0.5.16's table held an unused rid: here another request's
    [answers] = _run(manager, batch)
    assert len(answers) == 2 and list(manager.rid_to_state) == ["another_request"]


HANG_S = 10.0  # a processor call that has not answered by then never will (the failure this guards against)


class _Executor0517:
    """0.5.17's MultimodalProcessorExecutor (srt/multimodal/processors/executor.py:15-51): `run` hands the call to a
    worker thread through `loop.run_in_executor(..., self._run, ...)`, which calls it with the thread's processor."""

    def __init__(self, max_workers: int = 2):
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers)

    async def run(self, function, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._run, function, args, kwargs)

    def _run(self, function, args, kwargs):
        return function(*args, processor="the thread's clone", **kwargs)


class _Processor0517:
    """0.5.17's BaseMultimodalProcessor as far as the hook reaches (base_processor.py:701-720, 1456, 1639-1654), with
    Qwen-VL's two worker threads (qwen_vl.py:313). `process_and_combine_mm_data` records the thread it ran in; a
    request whose `base_output.expanded` is set raises StopIteration as transformers' processor does on more
    placeholders than images; `base_output.after` (a prompt's rid) makes a call in a worker thread wait until that
    prompt's prefix has left (`prefix_sent`: an event, so the order holds on a loaded machine)."""

    def __init__(self, prefix_sent=None):
        self.mm_processor_executor = _Executor0517(2)
        self.calls: list[tuple[str, bool]] = []  # (the request, ran in the event loop's thread)
        self.prefix_sent = prefix_sent or collections.defaultdict(threading.Event)

    @classmethod
    def _all_mm_data_is_preprocessed(cls, *data_lists):
        items = [item for data in data_lists for item in data or () if item is not None]
        return bool(items) and all(
            isinstance(i, dict) and i.get("format") in ("processor_output", "precomputed_embedding") for i in items
        )

    def process_and_combine_mm_data(self, base_output, mm_tokens, processor=None, **kwargs):
        in_loop = threading.current_thread() is threading.main_thread()
        self.calls.append((base_output.rid, in_loop))
        if base_output.after is not None and not in_loop:
            assert self.prefix_sent[base_output.after].wait(HANG_S), f"{base_output.after}'s prefix never left"
        if base_output.expanded:
            raise StopIteration
        return [], None, {}

    async def process_and_combine_mm_data_async(self, base_output, mm_tokens, **kwargs):
        if self.mm_processor_executor is None:
            return self.process_and_combine_mm_data(base_output, mm_tokens, **kwargs)
        return await self.mm_processor_executor.run(self.process_and_combine_mm_data, base_output, mm_tokens, **kwargs)


def _output(rid, images, after=None, expanded=False):
    """0.5.17's BaseMultiModalProcessorOutput (base_processor.py:48) of request `rid`, plus the stand-in's knobs."""
    return types.SimpleNamespace(rid=rid, images=images, videos=[], audios=[], after=after, expanded=expanded)


PIXEL_VALUES = {"format": "processor_output", "pixel_values": None}  # what wire.resolve_media makes of a pixel file


def test_a_stop_iteration_in_the_processor_thread_fails_the_request_instead_of_hanging():
    """0.5.17 runs Qwen-VL's processor in worker threads; transformers' StopIteration (the expanded image pads) cannot
    cross back into asyncio (`Future.set_exception` refuses it): the request waited for ever, holding its state and
    the weight-update lock (GPU run of 2026-11-26). Under the plugin it is a RuntimeError naming it, chained, as the
    inline call of 0.5.16 gave (HTTP 500), and the next request is served."""

    class Processor(_Processor0517):
        pass

    class Executor(_Executor0517):
        pass

    class TokenizerManager(_Tokenizer0517):
        pass

    _tokenizer_0517_patched(TokenizerManager, Processor, Executor)
    processor = Processor()
    processor.mm_processor_executor = Executor(2)

    async def combine(output):
        return await asyncio.wait_for(processor.process_and_combine_mm_data_async(output, None), HANG_S)

    with pytest.raises(RuntimeError, match="raised StopIteration in SGLang's multimodal processor thread") as failed:
        asyncio.run(combine(_output("expanded", ["an image"], expanded=True)))
    assert isinstance(failed.value.__cause__, StopIteration) and "placeholders" in str(failed.value)
    assert asyncio.run(combine(_output("next", ["an image"]))) == ([], None, {})
    assert processor.calls == [("expanded", False), ("next", False)]  # raw images: in 0.5.17's threads


def test_a_batch_of_pixel_value_prompts_leaves_its_prefixes_in_one_message():
    """0.5.17's processor threads tokenized a batch's prompts over several turns of the event loop, so their prefixes
    were prefilled as [1, 2] instead of [3] (GPU run of 2026-11-26). Preprocessed media (the engine's pixel values)
    are combined in the event loop under the plugin, so the prompts are ready together and their prefixes leave in
    one message. (The stand-in's worker threads let a prompt go only once the previous prompt's prefix has left: a
    thread hop per prompt sends three prefix messages.)"""

    class Processor(_Processor0517):
        pass

    class Executor(_Executor0517):
        pass

    class TokenizerManager(_Tokenizer0517):
        async def _tokenize_one_request(self, sub):
            previous = {"p1": "p0", "p2": "p1"}.get(sub.rid)
            await self.mm_processor.process_and_combine_mm_data_async(_output(sub.rid, [PIXEL_VALUES], previous), None)
            return await super()._tokenize_one_request(sub)

        def _left(self, toks):
            super()._left(toks)
            for tok in toks:
                if tok.sampling_params.max_new_tokens == 0:  # a prefix: `<prompt rid>_<n>`
                    self.mm_processor.prefix_sent[tok.rid.split("_")[0]].set()

    manager = TokenizerManager({"p0": 0.0, "p1": 0.0, "p2": 0.0})
    manager.mm_processor = Processor()
    manager.mm_processor.mm_processor_executor = Executor(2)
    pixels = torch.randn(4, 6)
    prompts = [_Prompt0517(f"p{i}", [i], pixels) for i in range(3)]
    _tokenizer_0517_patched(TokenizerManager, Processor, Executor)
    [answers] = _run(manager, _batch_0517(prompts, 4, [["a1"], ["b2"], ["c3"]]))
    sends = [e for e in manager.log if e[0] in ("prefix", "one", "batch")]
    assert sends == [("batch", 3), ("batch", 12)], sends
    assert manager.mm_processor.calls == [("p0", True), ("p1", True), ("p2", True)]  # in the event loop's thread
    assert len(answers) == 12 and manager.rid_to_state == {}


def test_one_scheduler_rank_is_read_from_0_5_17s_runtime_context(monkeypatch):
    parallel = types.SimpleNamespace(enable_dp_attention=False)
    runtime_context = types.ModuleType("sglang.srt.runtime_context")
    runtime_context.get_parallel = lambda: parallel
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name, types.ModuleType(name)))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", runtime_context)
    receiver = types.SimpleNamespace(
        server_args=types.SimpleNamespace(enable_dp_attention=False), ps=types.SimpleNamespace(tp_size=1)
    )
    assert receiver_0517.single_rank(receiver)
    parallel.enable_dp_attention = True  # resolved in the runtime context; the (read-only) argument says False
    assert not receiver_0517.single_rank(receiver)
    parallel.enable_dp_attention, receiver.ps.tp_size = False, 2
    assert not receiver_0517.single_rank(receiver)


def test_the_graphs_argument_goes_through_override_and_the_backend_is_not_pinned(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    overrides = []

    @dataclasses.dataclass
    class ServerArgs(ServerArgs0516):  # 0.5.17: read-only once resolved (server_args.py:8582); `override` changes it
        def __setattr__(self, name, value):
            if getattr(self, "resolved", False) and not getattr(self, "_in_override", False):
                raise AttributeError(f"server_args.{name} assigned after resolution")
            object.__setattr__(self, name, value)

        def override(self, source, **fields):
            overrides.append((source, fields))
            object.__setattr__(self, "_in_override", True)
            for name, value in fields.items():
                setattr(self, name, value)
            object.__setattr__(self, "_in_override", False)

    settings = PluginSettings(vision_graphs=2)
    monkeypatch.setenv("MILES_VL_SGLANG_PLUGIN", settings.to_env())
    modules = {
        vision_0517.VISION_MODULE: _vision_module(),
        vision_0517.SERVER_ARGS_MODULE: types.SimpleNamespace(ServerArgs=ServerArgs),
    }
    vision_0517.apply(modules, _context(settings))
    args = ServerArgs()
    assert args.enable_precise_embedding_interpolation and args.mm_attention_backend is None
    assert [fields for _, fields in overrides] == [{"enable_precise_embedding_interpolation": True}]
