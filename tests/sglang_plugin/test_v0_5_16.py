"""Contract: the SGLang 0.5.16 adapter of miles_vl's SGLang plugin (miles_vl/sglang_plugin/v0_5_16/ over the shared
mechanisms of miles_vl/sglang_plugin/), its hooks applied to stand-ins of 0.5.16's classes (rollout.sglang.launcher:
miles_vl).

- tokenizer side: the copies of a parallel-sampling request lose the pixel values of their hashed image items; the
  prompt's own request (max_new_tokens 0), unhashed items and requests without `n > 1` keep theirs;
- scheduler side: a copy gets back the very tensor its prompt's request carried, by image hash; least recently used
  tensors leave above the byte budget; a copy whose tensor is gone is counted and left without it;
- a batch of prompts with `n > 1` (grouped handler): each prompt's prefix request leaves as soon as that prompt is
  tokenized, the copies of all prompts leave after every prefix has answered, in one batch message, prompt by prompt,
  each with sampling parameters of its own and without the pixels the scheduler gives back; the prompts get the
  client's `mm_hashes` back; the answers come prompt by prompt;
- pixel files: written by the engine, read only from the server's private directory, linked into /dev/shm rather than
  copied; the vision tower's graphs keep one runner per image layout.
How the plugin is loaded and refuses: test_plugin.py; 0.5.17's differences: test_v0_5_17.py. The real server with the
plugin: tests/gpu/test_sglang_real.py and the GPU runs in docs/gpu-runs (docs/sglang.md).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import itertools
import json
import os
import time
import types
from pathlib import Path

import pytest
import torch

from miles_vl.sglang_plugin import grouping, vision, wire
from miles_vl.sglang_plugin import pixels as plugin_pixels
from miles_vl.sglang_plugin.adapter import Context
from miles_vl.sglang_plugin.pixels import PixelMemory, drop_copy_pixels
from miles_vl.sglang_plugin.settings import SETTINGS_ENV, PluginSettings
from miles_vl.sglang_plugin.v0_5_16 import receiver as receiver_0516
from miles_vl.sglang_plugin.v0_5_16 import tokenizer as tokenizer_0516
from miles_vl.sglang_plugin.v0_5_16 import vision as vision_0516

REPO = Path(__file__).resolve().parents[3]


def _item(h, feature):
    return types.SimpleNamespace(hash=h, feature=feature, precomputed_embeddings=None)


def _tokenizer_module(cls, wrap_shm_features=lambda obj: obj) -> types.SimpleNamespace:
    """A stand-in of 0.5.16's tokenizer_manager module: the class and the shared-memory wrapper it imports by name
    (`wrap_shm_features`; identity here: the stand-ins' messages are deep copies, not pickles)."""
    for name in ("_send_one_request", "_send_batch_request"):  # 0.5.16's send methods the patch wraps
        if not hasattr(cls, name):
            setattr(cls, name, lambda self, obj: None)
    if not hasattr(cls, "server_args"):
        cls.server_args = _PLAIN_SERVER
    return types.SimpleNamespace(TokenizerManager=cls, wrap_shm_features=wrap_shm_features)


# a server without sharing blockers (`pixels.sharing_blockers`), as the stand-in tokenizers' `server_args`
_PLAIN_SERVER = types.SimpleNamespace(dp_size=1, use_ray=False, mm_feature_transport="cpu")
SETTINGS = PluginSettings()  # the host's defaults


def _context(settings: PluginSettings = SETTINGS, launching: bool = True) -> Context:
    return Context(settings, launching, {"patches": {}})


def _patch_tokenizer(module, settings: PluginSettings = SETTINGS, mm_utils=None) -> None:
    """0.5.16's tokenizer hook (the adapter's own `apply`) on a stand-in tokenizer_manager module."""
    modules = {tokenizer_0516.TOKENIZER_MODULE: module, tokenizer_0516.MM_UTILS_MODULE: mm_utils}
    tokenizer_0516.apply(modules, _context(settings))


def _patch_receiver(module, settings: PluginSettings = SETTINGS) -> None:
    """0.5.16's receiver hook on a stand-in request_receiver module."""
    receiver_0516.apply({receiver_0516.RECEIVER_MODULE: module}, _context(settings))


def _req(items, max_new_tokens, rid="r"):
    return types.SimpleNamespace(
        rid=rid,
        mm_inputs=types.SimpleNamespace(mm_items=items),
        sampling_params=types.SimpleNamespace(max_new_tokens=max_new_tokens),
    )


def test_only_the_copies_hashed_items_lose_their_pixels():
    px = torch.randn(4, 6)
    prefix = _req([_item(1, px)], max_new_tokens=0)
    assert drop_copy_pixels(prefix, parallel_sampling=True) == 0 and prefix.mm_inputs.mm_items[0].feature is px
    copy_req = _req([_item(1, px), _item(None, px)], max_new_tokens=16)
    assert drop_copy_pixels(copy_req, parallel_sampling=True) == 1
    assert copy_req.mm_inputs.mm_items[0].feature is None and copy_req.mm_inputs.mm_items[1].feature is px
    single = _req([_item(1, px)], max_new_tokens=16)
    assert drop_copy_pixels(single, parallel_sampling=False) == 0 and single.mm_inputs.mm_items[0].feature is px
    text_only = types.SimpleNamespace(mm_inputs=None, sampling_params=types.SimpleNamespace(max_new_tokens=4))
    assert drop_copy_pixels(text_only, parallel_sampling=True) == 0


def test_copies_get_their_prompts_tensor_back_by_hash():
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    memory = PixelMemory(max_bytes=1 << 20)
    memory.fill([_req([_item(10, a)], 0), _req([_item(20, b)], 0)])
    copies = [_req([_item(10, None)], 8), _req([_item(20, None)], 8), _req([_item(10, None)], 8)]
    memory.fill(copies)
    assert [c.mm_inputs.mm_items[0].feature for c in copies] == [a, b, a]  # identity: the prompt's own tensors
    assert all(c.mm_inputs.mm_items[0].feature is t for c, t in zip(copies, (a, b, a), strict=True))
    assert memory.restored == 3 and memory.missing == 0


def test_least_recently_used_pixels_leave_first_and_a_miss_is_counted():
    t = [torch.zeros(256, dtype=torch.float32) for _ in range(3)]  # 1 KiB each
    memory = PixelMemory(max_bytes=2048)
    memory.fill([_req([_item(1, t[0])], 0), _req([_item(2, t[1])], 0)])
    memory.fill([_req([_item(1, None)], 8)])  # 1 used again: 2 is now the oldest
    memory.fill([_req([_item(3, t[2])], 0)])  # over budget: 2 leaves
    assert list(memory.tensors) == [1, 3] and memory.bytes == 2048
    lost = _req([_item(2, None)], 8, rid="lost")
    memory.fill([lost])
    assert lost.mm_inputs.mm_items[0].feature is None and memory.missing == 1


def test_batch_requests_and_precomputed_embeddings():
    px = torch.randn(2, 3)
    memory = PixelMemory(max_bytes=1 << 20)
    batch = types.SimpleNamespace(batch=[_req([_item(5, px)], 0), _req([_item(5, None)], 4)])
    memory.fill([batch])
    assert batch.batch[1].mm_inputs.mm_items[0].feature is px
    embedded = _item(5, None)
    embedded.precomputed_embeddings = torch.ones(1)
    memory.fill([_req([embedded], 4)])
    assert embedded.feature is None  # an item that brings its embeddings needs no pixels


def test_patched_classes_carry_a_prompts_pixels_from_its_request_to_its_copies(monkeypatch):
    """The two patches together on stand-in classes with 0.5.16's method names: the parallel-sampling handler sends
    the prompt, then its copies (copies of the items, as 0.5.16 makes them); the objects cross a process boundary
    (deep copies); the receiver hands them to the scheduler. (0.5.16's own handler: the grouped one is off.)"""
    sent = []

    class TokenizerManager:
        async def _tokenize_one_request(self, obj):
            return obj

        async def _handle_batch_request(self, obj, request=None):
            prefix = _req([_item(7, obj.pixels)], 0, rid="prefix")
            self._send_one_request(prefix)
            for k in range(obj.parallel_sample_num):
                c = _req([copy.copy(prefix.mm_inputs.mm_items[0])], 16, rid=f"copy{k}")
                self._send_one_request(c)
            yield "done"

        def _send_one_request(self, tokenized_obj):
            sent.append(copy.deepcopy(tokenized_obj))  # pickled to the scheduler

    class SchedulerRequestReceiver:
        def recv_requests(self):
            return list(sent)

        def _finalize_shm_features(self, recv_reqs):  # 0.5.16's: segments to tensors (none here)
            pass

    _patch_tokenizer(_tokenizer_module(TokenizerManager), PluginSettings(group_copies=False))
    _patch_receiver(types.SimpleNamespace(SchedulerRequestReceiver=SchedulerRequestReceiver))
    pixels = torch.randn(8, 4)

    async def run():
        return [
            x
            async for x in TokenizerManager()._handle_batch_request(
                types.SimpleNamespace(parallel_sample_num=3, pixels=pixels)
            )
        ]

    assert asyncio.run(run()) == ["done"]
    assert [r.mm_inputs.mm_items[0].feature is None for r in sent] == [False, True, True, True]  # what travels
    received = SchedulerRequestReceiver().recv_requests()
    features = [r.mm_inputs.mm_items[0].feature for r in received]
    assert all(torch.equal(f, pixels) for f in features)
    assert all(f is features[0] for f in features)  # one tensor in the scheduler, as the prompt's request brought it
    assert SchedulerRequestReceiver.miles_vl_pixel_memory.restored == 3


def test_settings_that_could_lose_a_copys_pixels_keep_sglangs_own_transfer(monkeypatch):
    """--dp-size > 1 routes a prompt and its copies to different schedulers, --use-ray starts schedulers this module
    does not reach, CUDA IPC sends proxies: there the copies keep their pixels (0.5.16 server_args.py: dp_size,
    use_ray, mm_feature_transport), as they do where the host's settings say so (share_copy_pixels: false)."""
    from miles_vl.sglang_plugin.pixels import sharing_blockers

    ok = types.SimpleNamespace(dp_size=1, use_ray=False, mm_feature_transport="cpu")
    assert sharing_blockers(ok) == [] and sharing_blockers(types.SimpleNamespace(mm_feature_transport=None)) == []
    for field, value, word in (
        ("dp_size", 2, "--dp-size"),
        ("use_ray", True, "--use-ray"),
        ("mm_feature_transport", "cuda_ipc", "cuda_ipc"),
    ):
        (blocker,) = sharing_blockers(types.SimpleNamespace(**(vars(ok) | {field: value})))
        assert word in blocker
    px = torch.randn(2, 2)
    kept = _req([_item(1, px)], max_new_tokens=8)
    assert drop_copy_pixels(kept, parallel_sampling=True, enabled=False) == 0
    assert kept.mm_inputs.mm_items[0].feature is px


def test_only_plain_tensors_are_remembered():
    class Proxy:  # e.g. 0.5.16's CudaIpcTensorTransportProxy: neither sized nor a tensor of the scheduler's own
        pass

    memory = PixelMemory(max_bytes=1 << 20)
    memory.fill([_req([_item(1, Proxy())], 0), _req([_item(2, [torch.ones(2)])], 0)])
    assert memory.tensors == {} and memory.bytes == 0


def test_the_parallel_sampling_flag_ends_with_its_request(monkeypatch):
    """An in-process caller (Engine.async_generate) may send n > 1 and then n = 1 in one task: the second request's
    pixels must travel. (0.5.16's own handler; the grouped one runs in the same context, below.)"""

    class TokenizerManager:
        async def _tokenize_one_request(self, obj):
            return obj

        async def _handle_batch_request(self, obj, request=None):
            yield "ok"

        def _send_one_request(self, tokenized_obj):
            pass

    _patch_tokenizer(_tokenizer_module(TokenizerManager), PluginSettings(group_copies=False))

    async def run():
        async for _ in TokenizerManager()._handle_batch_request(types.SimpleNamespace(parallel_sample_num=4)):
            assert grouping.PARALLEL_SAMPLING.get()
        return grouping.PARALLEL_SAMPLING.get()

    assert asyncio.run(run()) is False


class _Prompt:
    """0.5.16's GenerateReqInput of one prompt of a batch, the fields the grouped handler reads."""

    rids = 0

    def __init__(self, rid, ids, pixels):
        self.rid, self.ids, self.pixels = rid, ids, pixels
        self.return_prompt_token_ids = True
        self.mm_hashes = None  # 0.5.16's __getitem__ leaves it out

    def regenerate_rid(self):  # called on a copy of the prompt: each copy gets a new rid (0.5.16: a uuid)
        _Prompt.rids += 1
        self.rid = f"{self.rid.split('+')[0]}+{_Prompt.rids}"
        return self.rid


class _Batch:
    def __init__(self, prompts, n, hashes, stream=False):
        self.prompts, self.parallel_sample_num, self.mm_hashes, self.stream = prompts, n, hashes, stream
        self.batch_size = len(prompts)
        # 0.5.16 normalizes batch x n rids (io_struct.py:564), the prompts' own first
        self.rid = [p.rid for p in prompts] + [f"unused{k}" for k in range(len(prompts) * (n - 1))]

    def __getitem__(self, i):
        return self.prompts[i]


_EOS = 99  # the token every stand-in answer samples


class _StandInTokenizer:
    """0.5.16's TokenizerManager methods the grouped handler calls; `log` records the order of events; what is sent
    is deep-copied per message (pickled to the scheduler).

    A prompt's tokenization takes `delays[rid]` seconds, or, for a rid in `after`, until the prefix request of the
    prompt named there has left (an event: the order then holds however loaded the machine is, where sleeps of a few
    ms let a stalled event loop wake several prompts in one turn and merge their prefixes into one message), or, for
    a rid in `after_states` (rid -> (prompt, k)), until k request states of that prompt were made."""

    model_config = types.SimpleNamespace(dtype=torch.bfloat16)  # what the launcher casts pixel values to
    deadlock_s = 10.0  # what `after` or `after_states` waits for never happened (a test failure)

    def __init__(self, delays, after=None, after_states=None):
        self.delays, self.log, self.messages, self.seen_hashes = delays, [], [], {}
        self.after = after or {}
        self.after_states = after_states or {}
        self.states_made = collections.Counter()  # prompt rid -> request states made for it (prefix and copies)
        self.enough_states = {rid: asyncio.Event() for rid in self.after_states}
        self.rid_to_state = {}
        self.prefix_left = collections.defaultdict(asyncio.Event)  # prompt rid -> its prefix request has been sent

    async def _until(self, event: asyncio.Event, never: str) -> None:
        """Wait for `event`; one that does not come within `deadlock_s` fails the test, saying `never`."""
        try:
            await asyncio.wait_for(event.wait(), self.deadlock_s)
        except TimeoutError:
            raise AssertionError(never) from None

    async def _tokenize_one_request(self, sub):
        if sub.rid in self.after:
            waited = self.after[sub.rid]
            await self._until(
                self.prefix_left[waited],
                f"{sub.rid} is tokenized once {waited}'s prefix has left, which it never did: the handler waits for "
                "every prompt's tokens before it sends a prefix (not pipelined)",
            )
        elif sub.rid in self.after_states:
            prompt, k = self.after_states[sub.rid]
            await self._until(
                self.enough_states[sub.rid],
                f"{sub.rid} is tokenized once {k} request states of {prompt} were made, which never happened",
            )
        else:
            await asyncio.sleep(self.delays[sub.rid])
        if sub.ids is None:
            raise ValueError(f"prompt {sub.rid} cannot be tokenized")
        self.log.append(("tokenized", sub.rid))
        self.seen_hashes[sub.rid] = sub.mm_hashes
        item = types.SimpleNamespace(hash=int(sub.mm_hashes[0], 16), feature=sub.pixels, precomputed_embeddings=None)
        return types.SimpleNamespace(
            rid=sub.rid,
            input_ids=list(sub.ids),
            mm_inputs=types.SimpleNamespace(mm_items=[item]),
            sampling_params=types.SimpleNamespace(max_new_tokens=16, stop={"x"}),
            stream=False,
            time_stats=None,
        )

    def _init_req_state(self, sub):
        self.log.append(("state", sub.rid))
        self.states_made[sub.rid.split("+")[0]] += 1
        for rid, (prompt, k) in self.after_states.items():
            if self.states_made[prompt] >= k:
                self.enough_states[rid].set()
        self.rid_to_state[sub.rid] = types.SimpleNamespace(
            time_stats=types.SimpleNamespace(set_finished_time=lambda: None), prompt_token_ids=None
        )

    def _send_one_request(self, tok):
        self.log.append(("prefix" if tok.sampling_params.max_new_tokens == 0 else "one", tok.rid))
        self.messages.append(copy.deepcopy(tok))
        self._left([tok])

    def _send_batch_request(self, toks):
        if getattr(self, "fail_batch_send", False):
            raise ConnectionError("zmq send failed")
        self.log.append(("batch", len(toks)))
        self.messages.append(copy.deepcopy(types.SimpleNamespace(batch=toks)))
        self._left(toks)

    def _left(self, toks):
        for tok in toks:
            if tok.sampling_params.max_new_tokens == 0:  # a prefix; its rid is the prompt's + a copy suffix
                self.prefix_left[tok.rid.split("+")[0]].set()

    async def _wait_one_response(self, sub, request=None):
        sent = {m.rid for m in self.messages if not hasattr(m, "batch")}
        sent |= {t.rid for m in self.messages if hasattr(m, "batch") for t in m.batch}
        assert sub.rid in sent, "awaited before it was sent"
        self.log.append(("answered", sub.rid))
        state = self.rid_to_state.pop(sub.rid)  # 0.5.16 drops a finished request's state (_handle_batch_output)
        # the body as 0.5.16's _handle_batch_output builds it (tokenizer_manager.py:2063-2076): one EOS sampled,
        # prompt_token_ids only from the request state, where the handler that sent the request put them
        body = {
            "rid": sub.rid,
            "text": "",
            "output_ids": [_EOS],
            "meta_info": {
                "id": sub.rid,
                "finish_reason": {"type": "stop", "matched": _EOS},
                "prompt_tokens": len(sub.ids),
                "weight_version": "default",
                "output_token_logprobs": [[-0.5, _EOS, None]],
            },
        }
        if state.prompt_token_ids is not None:
            body["prompt_token_ids"] = state.prompt_token_ids
        yield body


def test_a_batchs_prefixes_are_pipelined_and_its_copies_leave_in_one_message():
    class TokenizerManager(_StandInTokenizer):
        async def _handle_batch_request(self, obj, request=None):  # 0.5.16's path: must not run here
            raise AssertionError("the grouped handler should take a non-streaming batch with n > 1")
            yield

    class SchedulerRequestReceiver:
        def recv_requests(self):
            return list(manager.messages)

        def _finalize_shm_features(self, recv_reqs):
            pass

    _patch_tokenizer(_tokenizer_module(TokenizerManager))
    _patch_receiver(types.SimpleNamespace(SchedulerRequestReceiver=SchedulerRequestReceiver))
    pixels = [torch.randn(4, 6) for _ in range(3)]
    prompts = [_Prompt(f"p{i}", [i, i + 1], pixels[i]) for i in range(3)]
    hashes = [["a1"], ["b2"], ["c3"]]
    # p0 is tokenized at once, p1 once p0's prefix has left, p2 once p1's has: a handler that waits for all tokens
    # before sending a prefix never sends one (the stand-in then fails the test); three prefixes, three messages
    manager = TokenizerManager({"p0": 0.0}, after={"p1": "p0", "p2": "p1"})
    batch = _Batch(prompts, 2, hashes)
    for rid in batch.rid:  # generate_request's _init_req_state: one entry per normalized rid
        manager._init_req_state(types.SimpleNamespace(rid=rid))

    async def run():
        return [x async for x in manager._handle_batch_request(batch)]

    [answers] = asyncio.run(run())
    log = manager.log
    # pipelined: prompt 0's prefix is sent (and answered) before prompt 2 is tokenized
    prefix0 = next(e for e in log if e[0] == "prefix" and e[1].startswith("p0+"))
    assert log.index(prefix0) < log.index(("tokenized", "p2"))
    # the copies leave once, after every prefix has answered, and nothing leaves on its own afterwards
    batch_at = log.index(("batch", 6))
    prefixes = [rid for kind, rid in log if kind == "prefix"]
    assert len(prefixes) == 3 and all(log.index(("answered", rid)) < batch_at for rid in prefixes)
    assert [e for e in log if e[0] in ("one", "batch")] == [("batch", 6)]
    # each prompt's copies were made (their request states) while its prefix was being prefilled, not after
    for i, rid in enumerate(prefixes):
        made = [k for k, e in enumerate(log) if e[0] == "state" and e[1].startswith(f"p{rid[1]}+") and e[1] != rid]
        assert len(made) == 2 and max(made) < log.index(("answered", rid)), (i, log)
    copies = manager.messages[-1].batch
    assert [c.input_ids for c in copies] == [[0, 1], [0, 1], [1, 2], [1, 2], [2, 3], [2, 3]]  # prompt by prompt
    assert len({c.rid for c in copies}) == 6 and all(c.sampling_params.max_new_tokens == 16 for c in copies)
    assert len({id(c.sampling_params) for c in copies}) == 6  # not shared after the message is unpickled
    assert len({id(c.sampling_params.stop) for c in copies}) == 6
    assert all(c.mm_inputs.mm_items[0].feature is None for c in copies)  # what travels
    assert [a["rid"] for a in answers] == [c.rid for c in copies]
    assert manager.seen_hashes == {"p0": ["a1"], "p1": ["b2"], "p2": ["c3"]}  # the client's hashes, per prompt
    # the prompts' own entries are done, and the n - 1 further rids 0.5.16 normalizes but never uses are dropped
    assert manager.rid_to_state == {}
    received = SchedulerRequestReceiver().recv_requests()
    restored = [c.mm_inputs.mm_items[0].feature for c in received[-1].batch]
    prefix_tensors = [m.mm_inputs.mm_items[0].feature for m in received[:3]]
    by_hash = {m.mm_inputs.mm_items[0].hash: m.mm_inputs.mm_items[0].feature for m in received[:3]}
    assert all(f is by_hash[c.mm_inputs.mm_items[0].hash] for f, c in zip(restored, received[-1].batch, strict=True))
    assert all(torch.equal(t, pixels[i]) for i, t in enumerate(prefix_tensors))


def test_every_copy_answers_with_its_prompts_ids_which_the_engine_requires():
    """Issue 31.5: the grouped copies' request states lost `prompt_token_ids` (the mutation passed every test, since
    the engine checked prompt ids only when a response had them). Now the engine refuses a response without them,
    and each copy's answer carries its own prompt's ids (0.5.16 puts them in the state of each copy it makes,
    tokenizer_manager.py:1678), which the engine's check passes, prompt by prompt."""
    from miles_vl.rollout.sglang.generate import parse_generate_response

    prompts = [_Prompt(f"p{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3][: i + 1], None) for i in range(3)]
    manager = _StandInTokenizer({p.rid: 0.0 for p in prompts})
    [answers] = _grouped(manager, _Batch(prompts, 2, [["a1"], ["b2"], ["c3"]]))
    assert len(answers) == 6
    for k, body in enumerate(answers):  # prompt by prompt, n each
        ids = prompts[k // 2].ids
        generation, _ = parse_generate_response(  # without the ids: SGLangResponseError naming the prompt
            body, prompt_ids=ids, stop_token_ids={_EOS}, max_new_tokens=4, prompt_index=k // 2
        )
        assert generation.response_ids.tolist() == [_EOS] and body["prompt_token_ids"] == ids


def test_which_requests_the_grouped_handler_takes(monkeypatch):
    prompts = [_Prompt("p0", [1], None)]
    assert grouping.groups_batch(_Batch(prompts, 2, None))
    assert not grouping.groups_batch(_Batch(prompts, 1, None))  # no parallel sampling: 0.5.16's path
    assert not grouping.groups_batch(_Batch(prompts, 2, None, stream=True))
    assert not grouping.groups_batch(_Batch(prompts, 2, None), enabled=False)  # the setting group_copies


async def _collect(manager, batch, share: bool = True) -> list:
    return [x async for x in grouping.handle_grouped(manager, batch, states=tokenizer_0516.STATES, share=share)]


def _grouped(manager, batch, share: bool = True):
    return asyncio.run(_collect(manager, batch, share))


def test_under_a_sharing_blocker_the_copies_keep_their_pixels_and_go_one_by_one(monkeypatch):
    """--dp-size > 1 and the like (sharing_blockers): the prefixes are still pipelined, but every copy carries its
    prompt's pixels and is sent on its own, as 0.5.16 sends it. Through the patched class: the blocker is read from
    the tokenizer's own server arguments."""
    pixels = torch.randn(4, 6)

    class TokenizerManager(_StandInTokenizer):
        server_args = types.SimpleNamespace(dp_size=2, use_ray=False, mm_feature_transport="cpu")

        async def _handle_batch_request(self, obj, request=None):  # 0.5.16's path: must not run here
            raise AssertionError("the grouped handler should take a non-streaming batch with n > 1")
            yield

    _patch_tokenizer(_tokenizer_module(TokenizerManager))
    manager = TokenizerManager({"p0": 0.0, "p1": 0.0})
    batch = _Batch([_Prompt("p0", [1], pixels), _Prompt("p1", [2], pixels)], 2, [["a1"], ["b2"]])

    async def run():
        return [x async for x in manager._handle_batch_request(batch)]

    [answers] = asyncio.run(run())
    assert len(answers) == 4
    kinds = [kind for kind, _ in manager.log if kind in ("prefix", "one", "batch")]
    assert kinds == ["batch", "one", "one", "one", "one"]  # the two prefixes were ready together
    sent = [r for m in manager.messages for r in getattr(m, "batch", [m])]
    assert len(sent) == 6 and all(torch.equal(r.mm_inputs.mm_items[0].feature, pixels) for r in sent)


def test_a_prompt_that_fails_stops_the_others_and_a_failed_send_leaves_no_state():
    # "bad" fails once p0's prefix and its 2 copies have request states (an event, not a delay: on a loaded machine
    # a 10 ms sleep could end before p0 made its copies); p1 is still tokenizing then (0.5 s)
    manager = _StandInTokenizer({"p0": 0.0, "p1": 0.5}, after_states={"bad": ("p0", 3)})
    batch = _Batch([_Prompt("p0", [1], None), _Prompt("p1", [2], None), _Prompt("bad", None, None)], 2, None)
    for p in batch.prompts[:2]:
        p.mm_hashes = None
    batch.mm_hashes = [["a1"], ["b2"], ["c3"]]

    async def fail_then_wait():
        with pytest.raises(ValueError, match="cannot be tokenized"):
            [x async for x in grouping.handle_grouped(manager, batch, states=tokenizer_0516.STATES)]
        await asyncio.sleep(1.0)  # the server goes on: a prompt still running would finish now

    asyncio.run(fail_then_wait())
    assert ("tokenized", "p1") not in manager.log  # cancelled, never sent its prefix
    assert any(kind == "state" and rid.startswith("p0+") for kind, rid in manager.log[2:])  # p0's copies were made
    assert manager.rid_to_state == {}  # and their request states went with the failed request
    assert [rid for kind, rid in manager.log if kind == "prefix"] == [
        rid for kind, rid in manager.log if kind == "prefix" and rid.startswith("p0+")
    ]

    manager = _StandInTokenizer({"p0": 0.0})
    manager.fail_batch_send = True
    with pytest.raises(ConnectionError):
        _grouped(manager, _Batch([_Prompt("p0", [1], None)], 3, [["a1"]]))
    assert manager.rid_to_state == {}  # neither the copies' entries nor the prefix's stay behind


def test_a_single_prompts_flat_hashes_and_odd_shapes():
    one = [_Prompt("p0", [1], None)]
    grouping._own_mm_hashes(types.SimpleNamespace(mm_hashes=["ab", "cd"]), one)
    assert one[0].mm_hashes == ["ab", "cd"]  # a single prompt with n > 1: the client's flat list
    two = [_Prompt("p0", [1], None), _Prompt("p1", [2], None)]
    grouping._own_mm_hashes(types.SimpleNamespace(mm_hashes=["ab", "cd"]), two)  # not one list per prompt
    assert [p.mm_hashes for p in two] == [None, None]


# ---------------------------------------------------------------------------------------------------------------------
# pixel values handed over as files (the engine writes them, the launcher reads them in the tokenizer process)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_tensor_written_by_the_engine_is_read_back_bit_for_bit(tmp_path, dtype):
    from miles_vl.sglang_plugin.wire import FILE_KEY, read_tensor, write_tensor

    t = (torch.randn(37, 1536) * 3).to(dtype)
    ref = write_tensor(str(tmp_path), t)
    assert ref["dtype"] == str(dtype).removeprefix("torch.") and ref["shape"] == [37, 1536]
    path = tmp_path / ref[FILE_KEY]
    assert path.stat().st_size == t.numel() * t.element_size()  # raw bytes, nothing else
    back = read_tensor(ref, str(tmp_path))
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))  # bits, NaN-safe
    assert read_tensor(write_tensor(str(tmp_path), torch.empty(0, 4)), str(tmp_path)).shape == (0, 4)
    with pytest.raises(ValueError, match="one of"):
        write_tensor(str(tmp_path), torch.zeros(2, dtype=torch.int64))  # not pixel values


def test_reading_refuses_anything_but_a_pixel_file_of_its_own_directory(tmp_path):
    from miles_vl.sglang_plugin.wire import FILE_KEY, PIXEL_DIR_ENV, read_tensor, write_tensor

    ref = write_tensor(str(tmp_path / ""), torch.ones(2, 3))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.bin").write_bytes(bytes(24))
    bad = {
        "no directory": (ref, None, PIXEL_DIR_ENV),
        "a path": ({**ref, FILE_KEY: "sub/x.bin"}, str(tmp_path), "not a file name"),
        "a parent": ({**ref, FILE_KEY: "../x.bin"}, str(tmp_path / "sub"), "not a file name"),
        "an absolute path": ({**ref, FILE_KEY: str(tmp_path / "sub" / "x.bin")}, str(tmp_path), "not a file name"),
        "hidden": ({**ref, FILE_KEY: ".x.bin"}, str(tmp_path), "not a file name"),
        "missing": ({**ref, FILE_KEY: "gone.bin"}, str(tmp_path), "not found"),
        "wrong size": ({**ref, "shape": [2, 4]}, str(tmp_path), "24 bytes for shape"),
        "unknown dtype": ({**ref, "dtype": "uint8"}, str(tmp_path), "dtype"),
        "bad shape": ({**ref, "shape": [2, -3]}, str(tmp_path), "shape"),
    }
    for case, (r, directory, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            read_tensor(r, directory)
            pytest.fail(case)
    assert torch.equal(read_tensor(ref, str(tmp_path)), torch.ones(2, 3))


def test_the_server_reads_only_its_own_private_pixel_files(tmp_path, monkeypatch):
    """Issue 30.6: the server read whatever a request named in its pixel directory. Now a request is refused
    (ValueError: SGLang's 400) and the file is never mapped unless it is one the engine wrote there: a symbolic link
    (out of the directory, to /etc/passwd, even to a pixel file of its own), a file other users can read, a pipe,
    another user's file; and no file at all of a directory that is not this user's alone (open to others, a symbolic
    link to the private one, another user's). The patched tokenizer (`resolve_media`, before 0.5.16 tokenizes) refuses
    the same, and the request goes no further."""
    from miles_vl.sglang_plugin.wire import FILE_KEY, PIXEL_DIR_ENV, read_tensor, write_tensor

    own = tmp_path / "pixels"
    own.mkdir(mode=0o700)
    ref = write_tensor(str(own), torch.ones(2, 3))  # 24 bytes: every file below has the size the reference asks for
    outside = tmp_path / "outside.bin"
    outside.write_bytes(bytes(24))
    (own / "out.bin").symlink_to(outside)
    (own / "passwd.bin").symlink_to("/etc/passwd")
    (own / "own.bin").symlink_to(own / ref[FILE_KEY])
    (own / "readable.bin").write_bytes(bytes(24))
    (own / "readable.bin").chmod(0o644)
    os.mkfifo(own / "pipe.bin", 0o600)
    shared = tmp_path / "shared"  # a directory others may enter (and a 0600 file the engine wrote in it)
    shared.mkdir(mode=0o700)
    in_shared = write_tensor(str(shared), torch.ones(2, 3))
    shared.chmod(0o755)
    (tmp_path / "link").symlink_to(own)
    bad = {
        "a symbolic link out": ("out.bin", own, "not a file but l"),
        "a symbolic link to /etc/passwd": ("passwd.bin", own, "not a file but l"),
        "a symbolic link to its own file": ("own.bin", own, "not a file but l"),
        "a file others can read": ("readable.bin", own, r"mode -rw-r--r-- lets other users"),
        "a pipe": ("pipe.bin", own, "not a file but p"),
        "a directory open to others": (in_shared[FILE_KEY], shared, "not a private pixel directory.*drwxr-xr-x"),
        "a symbolic link to the directory": (ref[FILE_KEY], tmp_path / "link", "not a private pixel directory.*not a"),
    }
    if os.geteuid() == 0:  # only root can give a file to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        theirs_ref = write_tensor(str(theirs), torch.ones(2, 3))
        os.chown(theirs, 65534, 65534)
        (own / "theirs.bin").write_bytes(bytes(24))
        (own / "theirs.bin").chmod(0o600)
        os.chown(own / "theirs.bin", 65534, 65534)
        bad["another user's file"] = ("theirs.bin", own, "belongs to uid 65534")
        bad["another user's directory"] = (theirs_ref[FILE_KEY], theirs, "not a private pixel directory.*uid 65534")
    mapped = []
    from_file = torch.from_file
    monkeypatch.setattr(torch, "from_file", lambda path, *a, **k: mapped.append(path) or from_file(path, *a, **k))
    for case, (name, directory, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            read_tensor({**ref, FILE_KEY: name}, str(directory))
            pytest.fail(case)
    assert mapped == []  # none of them was read
    # the same through the patched tokenizer of a stand-in TokenizerManager: the request never reaches 0.5.16's
    monkeypatch.setenv(PIXEL_DIR_ENV, str(own))
    tokenized = []

    class TokenizerManager:
        model_config = types.SimpleNamespace(dtype=torch.float32)

        async def _tokenize_one_request(self, obj):
            tokenized.append(obj)
            return obj

        async def _handle_batch_request(self, obj, request=None):
            yield None

    _patch_tokenizer(_tokenizer_module(TokenizerManager))
    item = {
        "format": "processor_output",
        "pixel_values": {**ref, FILE_KEY: "passwd.bin"},
        "image_grid_thw": [[1, 1, 2]],
    }
    request = types.SimpleNamespace(image_data=[item], video_data=None)
    with pytest.raises(ValueError, match="passwd.bin.*refused"):
        asyncio.run(TokenizerManager()._tokenize_one_request(request))
    assert request.image_data == [item] and mapped == [] and tokenized == []
    assert torch.equal(read_tensor(ref, str(own)), torch.ones(2, 3)) and len(mapped) == 1  # its own file: read


def test_pixel_files_their_directory_and_their_shm_links_are_private():
    """Issue 30.6: pixel files and their /dev/shm links were written 0644 (stock 0.5.16's segments are 0600). The host's
    pixel directory is 0700; each file is 0600 from its creation, whatever the umask (the mode the file is made with,
    not a chmod after its bytes are in); its second name in /dev/shm (`link_pixel_files`) is the same inode, so 0600
    too."""
    import shutil
    import stat

    from miles_vl.rollout.sglang.server import pixel_directory
    from miles_vl.sglang_plugin.pixels import SHM_DIR
    from miles_vl.sglang_plugin.wire import FILE_KEY, read_tensor, write_tensor

    directory = pixel_directory()
    segment = None
    try:
        assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700 and stat.S_ISDIR(os.lstat(directory).st_mode)
        umask = os.umask(0)  # a process that creates with 0666 would make the file readable by everyone here
        try:
            ref = write_tensor(str(directory), torch.randn(16, 24))
        finally:
            os.umask(umask)
        path = directory / ref[FILE_KEY]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        if directory.parent != Path(SHM_DIR):
            pytest.skip("no /dev/shm: pixel files are not linked")
        req = _req([_item(1, read_tensor(ref, str(directory)))], 0)
        assert plugin_pixels.link_pixel_files(req, _Pointer, _names()) == 1
        segment = os.path.join(SHM_DIR, req.mm_inputs.mm_items[0].feature.shm_name)
        linked = os.stat(segment)
        assert linked.st_ino == os.stat(path).st_ino and stat.S_IMODE(linked.st_mode) == 0o600
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if segment is not None:
            os.unlink(segment)


def test_pixel_values_are_cast_as_the_model_casts_them_or_refused(tmp_path):
    """The model casts pixel values to its dtype (qwen3_vl.py:1334 `.type(self.visual.dtype)`): float32 is cast the
    same way here, the model's own dtype passes, a third dtype would lose precision and is refused; the grids become
    int64 [n, 3] and must cover the pixel rows."""
    from miles_vl.sglang_plugin.wire import resolve_item, write_tensor

    d = str(tmp_path)
    pixels = torch.randn(8 + 4, 6)
    item = {
        "format": "processor_output",
        "pixel_values": write_tensor(d, pixels),
        "image_grid_thw": [[1, 2, 4], [1, 2, 2]],
    }
    out = resolve_item(item, torch.bfloat16, d)
    assert out["pixel_values"].dtype == torch.bfloat16 and torch.equal(out["pixel_values"], pixels.type(torch.bfloat16))
    assert out["image_grid_thw"].dtype == torch.long and out["image_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 2]]
    assert out["format"] == "processor_output" and item["pixel_values"] != out["pixel_values"]  # a new dict
    assert torch.equal(resolve_item(item, torch.float32, d)["pixel_values"], pixels)
    half = {**item, "pixel_values": write_tensor(d, pixels.to(torch.bfloat16))}
    assert resolve_item(half, torch.bfloat16, d)["pixel_values"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="lose precision"):
        resolve_item(half, torch.float16, d)
    with pytest.raises(ValueError, match="covers 10 patches but pixel_values has 12 rows"):
        resolve_item({**item, "image_grid_thw": [[1, 2, 4], [1, 1, 2]]}, torch.float32, d)
    with pytest.raises(ValueError, match="needs image_grid_thw"):
        resolve_item({"format": "processor_output", "pixel_values": item["pixel_values"]}, torch.float32, d)
    videos = {"format": "processor_output", "pixel_values_videos": write_tensor(d, torch.randn(16, 6)),
              "video_grid_thw": [[2, 2, 4]]}  # fmt: skip
    assert resolve_item(videos, torch.float32, d)["video_grid_thw"].tolist() == [[2, 2, 4]]


def test_the_tokenizer_reads_a_requests_pixel_files_before_sglang_tokenizes_it(tmp_path, monkeypatch):
    """The patched `_tokenize_one_request` of a stand-in TokenizerManager sees tensors in the model's dtype where the
    request held file references: in a prompt's image list (shared by its n copies in 0.5.16's normalized request:
    read once, in place), in the unwrapped video item 0.5.16 hands a prompt of a batch; data URLs are left alone."""
    from miles_vl.sglang_plugin.wire import PIXEL_DIR_ENV, write_tensor

    monkeypatch.setenv(PIXEL_DIR_ENV, str(tmp_path))
    seen = []

    class TokenizerManager:
        model_config = types.SimpleNamespace(dtype=torch.bfloat16)

        async def _tokenize_one_request(self, obj):
            seen.append((obj.image_data, obj.video_data))
            return obj

        async def _handle_batch_request(self, obj, request=None):
            yield None

        def _send_one_request(self, tokenized_obj):
            pass

    _patch_tokenizer(_tokenizer_module(TokenizerManager))
    pixels, frames = torch.randn(4, 6), torch.randn(8, 6)
    images = [{"format": "processor_output", "pixel_values": write_tensor(str(tmp_path), pixels),
               "image_grid_thw": [[1, 2, 2]]}]  # fmt: skip
    video = {"format": "processor_output", "pixel_values_videos": write_tensor(str(tmp_path), frames),
             "video_grid_thw": [[2, 2, 2]]}  # fmt: skip
    first = types.SimpleNamespace(image_data=images, video_data=video)
    second = types.SimpleNamespace(image_data=images, video_data=None)  # another copy of the same prompt
    urls = types.SimpleNamespace(image_data=["data:image/png;base64,AAAA"], video_data=None)

    async def run():
        for obj in (first, second, urls):
            await TokenizerManager()._tokenize_one_request(obj)

    asyncio.run(run())
    (im1, vid1), (im2, _), (url_images, _) = seen
    assert im1 is im2 and torch.equal(im1[0]["pixel_values"], pixels.to(torch.bfloat16))
    assert im1[0]["pixel_values"].dtype == torch.bfloat16 and im1[0]["image_grid_thw"].tolist() == [[1, 2, 2]]
    assert torch.equal(vid1["pixel_values_videos"], frames.to(torch.bfloat16))
    assert url_images == ["data:image/png;base64,AAAA"]
    assert wire.resolve_media(second, torch.bfloat16) == 0  # already read: nothing left to read


def test_prefixes_ready_together_leave_in_one_message():
    """Prompts that tokenize without waiting (pixel values from the engine: no image to load) have their prefixes
    sent together, in one message (one prefill batch), then the copies in another; a prompt that waits (here until
    the others' prefixes left, as an image load might) still leaves as soon as it is ready. A failed prefix message
    fails its prompts and leaves no state."""
    pixels = torch.randn(4, 6)
    manager = _StandInTokenizer({"p0": 0.0, "p1": 0.0, "p2": 0.0}, after={"late": "p2"})
    batch = _Batch([_Prompt(r, [k], pixels) for k, r in enumerate(("p0", "p1", "p2", "late"))], 2,
                   [["a1"], ["b2"], ["c3"], ["d4"]])  # fmt: skip
    [answers] = _grouped(manager, batch)
    sends = [e for e in manager.log if e[0] in ("prefix", "one", "batch")]
    assert sends == [("batch", 3), ("prefix", sends[1][1]), ("batch", 8)] and sends[1][1].startswith("late+")
    prefixes = manager.messages[0].batch
    assert [p.input_ids for p in prefixes] == [[0], [1], [2]] and all(
        p.sampling_params.max_new_tokens == 0 for p in prefixes
    )
    assert all(p.mm_inputs.mm_items[0].feature is not None for p in prefixes)  # the prompts bring their pixels
    assert len(answers) == 8 and manager.rid_to_state == {}

    failing = _StandInTokenizer({"p0": 0.0, "p1": 0.0})
    failing.fail_batch_send = True
    with pytest.raises(ConnectionError):
        _grouped(failing, _Batch([_Prompt("p0", [1], pixels), _Prompt("p1", [2], pixels)], 2, [["a1"], ["b2"]]))
    assert failing.rid_to_state == {} and not any(hasattr(m, "batch") for m in failing.messages)


def test_a_batch_message_moves_pixels_into_shared_memory_as_a_single_send_does():
    """0.5.16's `_send_batch_request` pickles pixel tensors into the message; the patched one first moves each
    request's tensors as `_send_one_request` does (`wrap_shm_features`), so prefixes coalesced into one message do not
    carry them inline (a multi-image prompt: once per image, each a view with the prompt's whole storage)."""

    class Shm:  # 0.5.16's ShmPointerMMData, as far as this test needs
        def __init__(self, tensor):
            self.tensor = tensor

    def wrap(obj):
        for item in obj.mm_inputs.mm_items:
            if isinstance(item.feature, torch.Tensor):
                item.feature = Shm(item.feature)
        return obj

    class TokenizerManager(_StandInTokenizer):
        async def _handle_batch_request(self, obj, request=None):  # 0.5.16's path: not taken here
            raise AssertionError("the grouped handler should take a non-streaming batch with n > 1")
            yield

    _patch_tokenizer(_tokenizer_module(TokenizerManager, wrap))
    pixels = torch.randn(4, 6)
    manager = TokenizerManager({"p0": 0.0, "p1": 0.0})
    [answers] = _grouped(manager, _Batch([_Prompt("p0", [1], pixels), _Prompt("p1", [2], pixels)], 2, [["a1"], ["b2"]]))
    prefixes, copies = (m.batch for m in manager.messages)
    assert len(prefixes) == 2 and all(isinstance(p.mm_inputs.mm_items[0].feature, Shm) for p in prefixes)
    assert all(torch.equal(p.mm_inputs.mm_items[0].feature.tensor, pixels) for p in prefixes)
    assert len(copies) == 4 and all(c.mm_inputs.mm_items[0].feature is None for c in copies)
    assert len(answers) == 4


@pytest.mark.parametrize("send_fails", [False, True])
def test_a_request_cancelled_while_its_prefix_leaves(send_fails):
    """A client that disconnects (its request's task is cancelled) as the prefix message leaves: a prefix that was
    sent keeps its request state, which its answer removes (0.5.16 drops a finished request's state); one whose send
    failed leaves none."""
    manager = _StandInTokenizer({"p0": 0.0})

    async def run():
        task = asyncio.ensure_future(_collect(manager, _Batch([_Prompt("p0", [1], None)], 2, [["a1"]])))

        def send(tokenized):
            task.cancel()  # the disconnect arrives as the message leaves
            if send_fails:
                raise ConnectionError("zmq send failed")
            manager.messages.append(tokenized)

        manager._send_one_request = send
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)

    asyncio.run(run())
    sent = [m.rid for m in manager.messages]
    assert len(sent) == (0 if send_fails else 1)
    assert list(manager.rid_to_state) == sent


def test_a_remembered_view_counts_the_storage_it_keeps():
    """A tensor that arrived inline as a view (one image of a multi-image prompt) keeps its whole storage alive."""
    whole = torch.randn(100, 10)
    memory = plugin_pixels.PixelMemory(max_bytes=whole.untyped_storage().nbytes() + 1)
    memory.remember(1, whole[:10])
    memory.remember(2, whole[10:20])
    assert list(memory.tensors) == [2] and memory.bytes == whole.untyped_storage().nbytes()


def test_a_batch_messages_pixels_move_to_shared_memory_side_by_side():
    """The requests of a batch message that carry pixels are moved into shared memory in threads side by side (0.5.16's
    copy of a 196-token image took 8-12 ms on an H100, serially 60-85 ms for 8 prefixes): two moves must be running at
    once to pass the barrier; a request without pixels is not given to the threads; a failure reaches the caller."""
    import threading

    together = threading.Barrier(2, timeout=10)
    moved = []

    def wrap(obj):
        together.wait()  # only returns once another request is being moved at the same time
        moved.append(obj.rid)
        return obj

    with_pixels = [_req([_item(k, torch.randn(2, 2))], 0, rid=f"p{k}") for k in range(4)]
    without = _req([_item(9, None)], 16, rid="copy")
    plugin_pixels.move_to_shared_memory(wrap, [*with_pixels, without])
    assert sorted(moved) == ["p0", "p1", "p2", "p3"]

    def broken(obj):
        raise MemoryError("no memory for the copy")

    with pytest.raises(MemoryError, match="no memory"):
        plugin_pixels.move_to_shared_memory(broken, with_pixels[:2])


def test_a_failed_move_leaves_no_shared_memory_segment():
    """When one request's move fails, the others' segments are removed after every thread has finished: nothing will
    send them, and only the scheduler's read (or the death of this process) would remove them otherwise."""
    import threading
    from multiprocessing import shared_memory

    made, started = [], threading.Barrier(3, timeout=10)

    def wrap(obj):  # as 0.5.16's wrap_shm_features: the tensor becomes a pointer to a new segment
        started.wait()
        if obj.rid == "bad":
            raise MemoryError("no memory for the copy")
        time.sleep(0.2)  # still copying when the failure is known
        item = obj.mm_inputs.mm_items[0]
        segment = shared_memory.SharedMemory(create=True, size=item.feature.numel() * 4)
        segment.close()
        made.append(segment.name)
        item.feature = types.SimpleNamespace(shm_name=segment.name)

    reqs = [_req([_item(k, torch.randn(4, 4))], 0, rid=rid) for k, rid in enumerate(("a", "bad", "b"))]
    with pytest.raises(MemoryError):
        plugin_pixels.move_to_shared_memory(wrap, reqs)
    assert len(made) == 2
    for name in made:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)


# -- the vision tower's CUDA graphs -----------------------------------------------------------------------------------


class _RunnerOf0516:
    """0.5.16's `ViTCudaGraphRunner` as far as these tests need it: graphs keyed by the total patch count only, each
    baking in the segment boundaries it was captured with, and one output buffer that every replay overwrites. Its
    "graph" sums the patches of each segment (what attention within segments depends on)."""

    made = 0

    def __init__(self, vit):
        type(self).made += 1
        self.captured: dict[int, list[int]] = {}
        self.out: dict[int, torch.Tensor] = {}

    def run(self, x, cu_seqlens):
        key = x.shape[0]
        if key not in self.captured:
            self.captured[key], self.out[key] = list(cu_seqlens), torch.empty_like(x)
        cu = self.captured[key]
        for a, b in itertools.pairwise(cu):
            self.out[key][a:b] = x[a:b].sum(0)
        return self.out[key]


def _segment_sums(x, grid):
    cu = [0]
    for t, h, w in grid:
        cu += [cu[-1] + h * w * (i + 1) for i in range(t)]
    return cu, torch.cat([x[a:b].sum(0, keepdim=True).expand(b - a, -1) for a, b in itertools.pairwise(cu)])


def _vision_module():
    class Qwen3VLMoeVisionModel:  # the two forwards of srt/models/qwen3_vl.py, 0.5.16
        device = torch.device("cpu")

        def __init__(self):
            self.graph_runners = _RunnerOf0516(self)
            self.eager_calls = 0

        def forward(self, x, grid_thw):  # 0.5.16 goes to forward_with_cuda_graph when the variable is on
            assert os.environ.get(vision.SGLANG_VIT_GRAPH_ENV, "0") == "0"
            self.eager_calls += 1
            return _segment_sums(x, grid_thw.tolist())[1]

        def forward_with_cuda_graph(self, x, grid_thw):  # the attention backends need the variable on here
            assert os.environ.get(vision.SGLANG_VIT_GRAPH_ENV) == "1"
            return self.graph_runners.run(x, _segment_sums(x, grid_thw.tolist())[0])

    return types.SimpleNamespace(
        Qwen3VLMoeVisionModel=Qwen3VLMoeVisionModel,
        graph_runners_dict=collections.defaultdict(lambda: _RunnerOf0516),
    )


def test_vision_graphs_replay_each_layout_with_its_own_boundaries(monkeypatch):
    """Two batches with the same patch count but other image boundaries (one image of 2x4 patches; two of 2x2), and a
    larger one between them: with 0.5.16's runner the second layout replays the first one's boundaries (sglang issue
    #29216 is the same class: a graph reading what another capture left). Through the patch every call equals the
    eager forward, a layout's first call runs eagerly, its second captures, and what a call returned stays as it was
    after later replays."""
    module = _vision_module()
    stock = module.Qwen3VLMoeVisionModel()
    one, two, big = torch.tensor([[1, 2, 4]]), torch.tensor([[1, 2, 2], [1, 2, 2]]), torch.tensor([[2, 2, 4]])
    x8, x16 = torch.randn(8, 3), torch.randn(16, 3)
    monkeypatch.setenv(vision.SGLANG_VIT_GRAPH_ENV, "1")  # 0.5.16's own graphs
    stock.forward_with_cuda_graph(x8, one)
    assert not torch.equal(stock.forward_with_cuda_graph(x8, two), _segment_sums(x8, [[1, 2, 2], [1, 2, 2]])[1])
    monkeypatch.setenv(vision.SGLANG_VIT_GRAPH_ENV, "0")  # as the launcher leaves it

    vision.patch_vision_forward(module.Qwen3VLMoeVisionModel, module.graph_runners_dict, max_graphs=2)
    vit = module.Qwen3VLMoeVisionModel()
    outputs = []
    for grid, x in ((one, x8), (one, x8), (two, x8), (two, x8), (big, x16), (big, x16), (one, x8), (two, x8)):
        x = x + torch.randn_like(x)  # new pixels every call: a graph must not return an earlier call's result
        outputs.append((x, grid, vit.forward(x, grid)))
    for x, grid, out in outputs:
        assert torch.equal(out, _segment_sums(x, grid.tolist())[1])
    graphs = vit.miles_vl_graphs
    assert vit.eager_calls == 4  # each layout's first sighting, and `one`'s first again after its graph was dropped
    assert (graphs.captured, graphs.dropped, graphs.replayed) == (3, 1, 1)  # `one`, least recently used, left for `big`
    assert graphs.runners.keys() == {((1, 2, 2), (1, 2, 2)), ((2, 2, 4),)}


def test_vision_graphs_keep_the_recent_layouts_and_leave_large_batches_eager():
    graphs = vision.VisionGraphs(max_graphs=2, max_patches=100)
    made = []

    def make():
        made.append(object())
        return made[-1]

    a, b, c, huge = ((1, 2, 2),), ((1, 2, 4),), ((1, 4, 4),), ((1, 10, 12),)
    assert [graphs.runner(a, make), graphs.runner(a, make), graphs.runner(a, make)] == [None, made[0], made[0]]
    assert graphs.runner(huge, make) is graphs.runner(huge, make) is None  # 120 patches > 100: never captured
    for layout in (b, b, c, c):
        graphs.runner(layout, make)
    assert list(graphs.runners) == [b, c] and graphs.dropped == 1  # a, least recently used, went first
    assert (graphs.captured, graphs.replayed, graphs.eager) == (3, 1, 5)
    for i in range(20):  # layouts seen once are forgotten beyond 4 x max_graphs
        graphs.runner(((1, 2, 2 * i + 100),), make)
    assert len(graphs.seen) == 8


@dataclasses.dataclass
class ServerArgs0516:
    """The fields of 0.5.16's srt/server_args.py the vision hook reads and sets; `resolved` once constructed."""

    mm_attention_backend: str | None = None
    tp_size: int = 1
    base_gpu_id: int = 0
    enable_deterministic_inference: bool = False
    enable_precise_embedding_interpolation: bool = False

    def __post_init__(self):
        object.__setattr__(self, "resolved", True)


def test_vision_graphs_run_under_the_backend_sglang_would_choose_or_not_at_all(monkeypatch):
    """0.5.16's runner reads --mm-attention-backend (fa3 or triton_attn) instead of the backend the model chose; unset,
    the hook sets it to what 0.5.16 chooses on the GPU (fa3 on SM 9.x, fa4 on SM 10.x but 10.3, else triton_attn), so
    the numerics stay; where that is another backend, or the server is deterministic, the tower stays eager, as it
    does with tensor parallelism: the schedulers the launcher starts inherit settings with vision_graphs 0 and the
    marker says why. With the graphs on, the graph path's position embeddings are made to sample the table as the
    eager tower does (`enable_precise_embedding_interpolation`: linspace, not half-pixel centres). Applied once SGLang
    resolved its arguments (after `ServerArgs.__post_init__`), in the launching process only. SGLang's own graphs are
    turned off (they replay wrong boundaries), and the variable the scheduler toggles exists before any child
    starts."""
    from miles_vl.sglang_plugin.vision import SGLANG_VIT_GRAPH_ENV, stock_graphs_off, vision_graph_backend

    assert vision_graph_backend(None, (9, 0)) == "fa3"
    assert vision_graph_backend(None, (8, 0)) == vision_graph_backend(None, (10, 3)) == "triton_attn"
    assert vision_graph_backend(None, (10, 0)) is None  # fa4
    assert vision_graph_backend("triton_attn", (9, 0)) == "triton_attn" and vision_graph_backend("sdpa", (9, 0)) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    ServerArgs = ServerArgs0516

    settings = PluginSettings(vision_graphs=4)
    cases = (
        ({}, 4, "fa3", True),
        ({"mm_attention_backend": "sdpa"}, 0, "sdpa", False),
        ({"enable_deterministic_inference": True}, 0, None, False),
        ({"tp_size": 2}, 0, None, False),
    )
    for fields, graphs, backend, precise in cases:
        monkeypatch.setenv(SETTINGS_ENV, settings.to_env())
        modules = {
            vision_0516.VISION_MODULE: _vision_module(),
            vision_0516.SERVER_ARGS_MODULE: types.SimpleNamespace(ServerArgs=type("ServerArgs", (ServerArgs,), {})),
        }
        context = _context(settings)
        vision_0516.apply(modules, context)
        args = modules[vision_0516.SERVER_ARGS_MODULE].ServerArgs(**fields)
        assert args.resolved and (args.mm_attention_backend, args.enable_precise_embedding_interpolation) == (
            backend,
            precise,
        ), fields
        assert json.loads(os.environ[SETTINGS_ENV])["vision_graphs"] == graphs, fields  # what the schedulers inherit
        assert ("vision" in context.patches) is (graphs == 0), context.patches  # "off: why" in the marker
    modules[vision_0516.VISION_MODULE] = _vision_module()
    forward = modules[vision_0516.VISION_MODULE].Qwen3VLMoeVisionModel.forward
    post_init = modules[vision_0516.SERVER_ARGS_MODULE].ServerArgs.__post_init__
    vision_0516.apply(modules, _context(settings, launching=False))  # a scheduler: its tower only
    assert modules[vision_0516.VISION_MODULE].Qwen3VLMoeVisionModel.forward is not forward
    assert modules[vision_0516.SERVER_ARGS_MODULE].ServerArgs.__post_init__ is post_init
    monkeypatch.setenv(SGLANG_VIT_GRAPH_ENV, "1")
    stock_graphs_off()
    assert os.environ[SGLANG_VIT_GRAPH_ENV] == "0"
    monkeypatch.delenv(SGLANG_VIT_GRAPH_ENV)
    stock_graphs_off()
    assert os.environ[SGLANG_VIT_GRAPH_ENV] == "0"  # set all the same


# -- pixel files handed to the scheduler by a second name --------------------------------------------------------------


class _Pointer:
    """0.5.16's `ShmPointerMMData` as far as these tests need (`srt/managers/mm_utils.py:1847-1917`): pickled as
    its segment's name, shape, dtype and hash; unpickled by opening the segment; `materialize()` copies the tensor out
    and unlinks the segment. That the real scheduler reads a linked segment so: tests/gpu/test_sglang_real.py."""

    def __getstate__(self):
        return {"shm_name": self.shm_name, "shape": self.shape, "dtype": self.dtype, "hash": self.precomputed_hash}

    def __setstate__(self, state):
        from multiprocessing import shared_memory

        self.shm_name, self.shape, self.dtype = state["shm_name"], state["shape"], state["dtype"]
        self.precomputed_hash = state["hash"]
        self._shm_handle = shared_memory.SharedMemory(name=self.shm_name)
        self.tensor = torch.frombuffer(self._shm_handle.buf, dtype=self.dtype).reshape(self.shape)

    def materialize(self):
        out = self.tensor.clone()
        del self.tensor
        self._shm_handle.close()
        self._shm_handle.unlink()
        return out


def _names():
    count = itertools.count()
    return lambda kind: f"miles_vl_test_{kind}_{os.getpid()}_{next(count)}_{time.time_ns()}"


@pytest.fixture
def shm_dir():
    """A pixel directory in /dev/shm, as the engine's host makes it (`pixel_directory`)."""
    if not os.path.isdir(plugin_pixels.SHM_DIR):
        pytest.skip("no /dev/shm")
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="miles_vl_test_pixels_", dir=plugin_pixels.SHM_DIR)
    yield path
    shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(plugin_pixels.SHM_DIR):  # names a failed test left (`_names`)
        if name.startswith(f"miles_vl_test_mm_{os.getpid()}_"):
            os.unlink(os.path.join(plugin_pixels.SHM_DIR, name))


def test_a_pixel_file_reaches_the_scheduler_by_a_second_name_not_a_copy(shm_dir):
    """The tokenizer maps the engine's file (`read_tensor`); `link_pixel_files` gives it a second name in /dev/shm
    instead of copying it into a new segment; the scheduler's pickled pointer opens that name, copies the pixels out
    and unlinks it, as it does a segment 0.5.16 filled. The engine's own name stays until the engine removes it. The
    pointer is a subclass with a constructor of its own (0.5.16's would copy), and it reaches the scheduler as exactly
    0.5.16's class: the scheduler need not import miles_vl to read it."""
    import pickle
    from multiprocessing import shared_memory

    from miles_vl.sglang_plugin.wire import read_tensor, write_tensor

    pixels = torch.randn(16, 24).to(torch.bfloat16)
    ref = write_tensor(shm_dir, pixels)
    path = os.path.join(shm_dir, ref[wire.FILE_KEY])
    mapped = read_tensor(ref, shm_dir)
    assert torch.equal(mapped, pixels)
    req = _req([_item(0xABC, mapped)], 0)
    assert plugin_pixels.link_pixel_files(req, _Pointer, _names()) == 1
    pointer = req.mm_inputs.mm_items[0].feature
    assert isinstance(pointer, _Pointer) and pointer.tensor is mapped and pointer.precomputed_hash == 0xABC
    segment = os.path.join(plugin_pixels.SHM_DIR, pointer.shm_name)
    assert os.stat(segment).st_ino == os.stat(path).st_ino and os.stat(path).st_nlink == 2  # one file, two names
    received = pickle.loads(pickle.dumps(req))  # to the scheduler (the message is pickled)
    assert type(received.mm_inputs.mm_items[0].feature) is _Pointer
    restored = received.mm_inputs.mm_items[0].feature.materialize()
    assert torch.equal(restored, pixels) and restored.dtype == torch.bfloat16
    assert not os.path.exists(segment) and os.stat(path).st_nlink == 1
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=pointer.shm_name)


def test_only_a_whole_mapped_file_is_linked_the_rest_is_left_to_sglangs_copy(shm_dir, tmp_path, monkeypatch):
    """Left as they are (0.5.16's `wrap_shm_features` copies them): a view of one image of a mapped file, a tensor
    that was cast (not the file), a file the engine already removed, a directory on another file system than
    /dev/shm, and everything with MILES_VL_SGLANG_LINK_PIXELS=0."""
    from miles_vl.sglang_plugin.pixels import linked_segment
    from miles_vl.sglang_plugin.wire import read_tensor, write_tensor

    names = _names()
    mapped = read_tensor(ref := write_tensor(shm_dir, torch.randn(16, 24)), shm_dir)
    tag = getattr(mapped, wire.LINKED_FILE)
    assert linked_segment(mapped[:8], _Pointer, names) is None
    for part in (mapped[:8], mapped[8:], mapped[:, :12]):  # even if a view carried the file's tag
        setattr(part, wire.LINKED_FILE, tag)
        assert linked_segment(part, _Pointer, names) is None
    other = read_tensor(write_tensor(shm_dir, torch.randn(16, 24)), shm_dir)
    setattr(other, wire.LINKED_FILE, (tag[0], tag[1] + 1))  # a name that is not the mapped file
    assert linked_segment(other, _Pointer, names) is None
    assert linked_segment(mapped.to(torch.bfloat16), _Pointer, names) is None
    assert linked_segment(torch.randn(4, 4), _Pointer, names) is None
    gone = read_tensor(ref := write_tensor(shm_dir, torch.randn(4, 4)), shm_dir)
    os.unlink(os.path.join(shm_dir, ref[wire.FILE_KEY]))
    assert linked_segment(gone, _Pointer, names) is None
    if os.stat(tmp_path).st_dev != os.stat(plugin_pixels.SHM_DIR).st_dev:
        on_disk = read_tensor(write_tensor(str(tmp_path), torch.randn(4, 4)), str(tmp_path))
        assert linked_segment(on_disk, _Pointer, names) is None  # EXDEV: no link across file systems
    req = _req([_item(1, mapped)], 0)
    assert plugin_pixels.link_pixel_files(req, _Pointer, names, enabled=False) == 0  # the setting link_pixels
    assert req.mm_inputs.mm_items[0].feature is mapped
    left = [n for n in os.listdir(plugin_pixels.SHM_DIR) if n.startswith(f"miles_vl_test_mm_{os.getpid()}_")]
    assert left == []  # a refused link leaves no second name behind


def test_a_pixel_file_removed_before_it_is_mapped_is_an_error_and_stays_removed(shm_dir, monkeypatch):
    """The engine removes a request's files when it gives up on it: if that happens between the tokenizer's size check
    and its mapping, the request fails (400) and no file comes back (a read-write mapping would make a zero-filled one,
    whose pixels would then go under the engine's hash of the real image)."""
    from miles_vl.sglang_plugin.wire import read_tensor, write_tensor

    ref = write_tensor(shm_dir, torch.randn(4, 4))
    path = os.path.join(shm_dir, ref[wire.FILE_KEY])
    real_lstat = os.lstat

    def lstat_then_remove(p, *args, **kwargs):
        out = real_lstat(p, *args, **kwargs)
        if p == path:
            os.unlink(path)  # the engine, just after the size check
        return out

    monkeypatch.setattr(wire.os, "lstat", lstat_then_remove)
    with pytest.raises(ValueError, match="could not be mapped"):
        read_tensor(ref, shm_dir)
    monkeypatch.undo()
    assert not os.path.exists(path)


def _kind(feature) -> str:
    return "pointer" if isinstance(feature, _Pointer) else type(feature).__name__


def _tokenizer_patched_over(monkeypatch, wrap_shm_features, default_transport=lambda: False) -> types.SimpleNamespace:
    """A stand-in tokenizer_manager module, patched, whose `wrap_shm_features` (0.5.16's) lives in a stand-in of
    0.5.16's mm_utils module: the `_Pointer` class, `_names()`, and the transport switch `_stock_wraps` reads."""
    mm_utils = types.ModuleType(f"stand_in_mm_utils_{id(wrap_shm_features)}")
    mm_utils.ShmPointerMMData, mm_utils.make_shm_name = _Pointer, _names()
    mm_utils._get_is_default_transport = default_transport
    mm_utils.get_server_args = lambda: types.SimpleNamespace(skip_tokenizer_init=False)

    class TokenizerManager:
        async def _handle_batch_request(self, obj, request=None):
            yield None

        async def _tokenize_one_request(self, obj):
            return obj

    module = _tokenizer_module(TokenizerManager, wrap_shm_features)
    _patch_tokenizer(module, mm_utils=mm_utils)
    return module


def test_names_linked_for_a_request_that_is_not_sent_are_removed(shm_dir, monkeypatch):
    """0.5.16's copy of a request's other tensors fails after its pixel file was linked: the request is not sent, so
    no scheduler will read (and remove) the linked name; the patched `wrap_shm_features` removes it."""
    from miles_vl.sglang_plugin.wire import read_tensor, write_tensor

    def wrap_shm_features(obj):
        raise OSError(28, "No space left on device")

    module = _tokenizer_patched_over(monkeypatch, wrap_shm_features)
    req = _req([_item(1, read_tensor(write_tensor(shm_dir, torch.randn(4, 4)), shm_dir))], 0)
    with pytest.raises(OSError, match="No space"):
        module.wrap_shm_features(req)
    pointer = req.mm_inputs.mm_items[0].feature
    assert isinstance(pointer, _Pointer) and not os.path.exists(os.path.join(plugin_pixels.SHM_DIR, pointer.shm_name))


def test_the_tokenizer_links_only_where_sglang_itself_would_use_segments(shm_dir, monkeypatch):
    """The patched module's `wrap_shm_features` (what 0.5.16's `_send_one_request` calls) links first and then calls
    0.5.16's, which copies what is left; where 0.5.16 keeps tensors inline ("default" transport with
    --dist-init-addr, --skip-tokenizer-init) nothing is linked, since its scheduler would not read segments."""
    from miles_vl.sglang_plugin.wire import read_tensor, write_tensor

    calls = []
    default_transport = [False]

    def wrap_shm_features(obj):  # 0.5.16's: copies the plain tensors left
        calls.append([_kind(item.feature) for item in obj.mm_inputs.mm_items])
        return obj

    module = _tokenizer_patched_over(monkeypatch, wrap_shm_features, lambda: default_transport[0])
    for default in (False, True):
        default_transport[0] = default
        req = _req([_item(1, read_tensor(write_tensor(shm_dir, torch.randn(4, 4)), shm_dir)), _item(2, None)], 0)
        module.wrap_shm_features(req)
        if not default:
            copy.deepcopy(req).mm_inputs.mm_items[0].feature.materialize()  # the scheduler's read removes the name
    assert calls == [["pointer", "NoneType"], ["Tensor", "NoneType"]]


def test_a_receives_pixels_are_copied_out_side_by_side():
    """The scheduler materializes the requests of one receive that hold segments in threads side by side: two must
    run at once to pass the barrier; a failure is raised after every thread is done. Left to 0.5.16's loop (False):
    one request, one thread, or one pointer object in two requests."""
    import threading

    together = threading.Barrier(2, timeout=10)
    done = []

    def unwrap(req):
        together.wait()
        done.append(req.rid)

    reqs = [_req([_item(k, object())], 0, rid=f"p{k}") for k in range(4)]
    assert plugin_pixels.materialize_side_by_side(unwrap, reqs, threads=8) and sorted(done) == ["p0", "p1", "p2", "p3"]
    assert not plugin_pixels.materialize_side_by_side(unwrap, reqs[:1], threads=8)
    assert not plugin_pixels.materialize_side_by_side(unwrap, reqs, threads=1)
    shared = object()
    assert not plugin_pixels.materialize_side_by_side(
        unwrap, [_req([_item(1, shared)], 0), _req([_item(1, [shared])], 0)], threads=8
    )
    finished = []

    def broken(req):
        if req.rid == "p0":
            raise MemoryError("no memory for the copy")
        time.sleep(0.1)
        finished.append(req.rid)

    with pytest.raises(MemoryError):
        plugin_pixels.materialize_side_by_side(broken, reqs, threads=8)
    assert sorted(finished) == ["p1", "p2", "p3"]


@pytest.mark.parametrize("ranks", ["one", "tp2", "dp_attention"])
def test_the_receiver_copies_out_in_threads_only_on_a_single_rank(ranks, monkeypatch):
    """On one scheduler rank the patched `_finalize_shm_features` copies a receive's segments out in threads (the
    requests inside a batch message too; a request without segments is left alone); with tensor parallelism or
    attention data parallelism 0.5.16's own method runs (its barrier orders the other ranks' reads before the
    unlinks)."""
    seen = []

    class Segment:  # what has_shm_features looks for (0.5.16's ShmPointerMMData)
        pass

    class Req:
        def __init__(self, rid, feature):
            self.rid, self.mm_inputs = rid, types.SimpleNamespace(mm_items=[_item(1, feature)])

    class SchedulerRequestReceiver:
        server_args = types.SimpleNamespace(enable_dp_attention=ranks == "dp_attention")
        ps = types.SimpleNamespace(tp_size=2 if ranks == "tp2" else 1)
        model_config = types.SimpleNamespace(is_multimodal=True)

        def recv_requests(self):
            batch = types.SimpleNamespace(batch=[Req("b", Segment()), Req("copy", None), Req("c", Segment())])
            reqs = [Req("a", Segment()), batch]
            self._finalize_shm_features(reqs)
            return reqs

        def _finalize_shm_features(self, recv_reqs):
            seen.append("stock")

    def unwrap_shm_features(req):
        seen.append((req.rid, threading.current_thread().name.startswith("miles_vl_unwrap")))

    import threading

    def has_shm_features(reqs):
        subs = [s for r in reqs for s in getattr(r, "batch", None) or [r]]
        return any(isinstance(item.feature, Segment) for s in subs for item in s.mm_inputs.mm_items)

    module = types.SimpleNamespace(
        SchedulerRequestReceiver=SchedulerRequestReceiver,
        has_shm_features=has_shm_features,
        unwrap_shm_features=unwrap_shm_features,
    )
    monkeypatch.setattr(plugin_pixels, "_receive_pool", None)
    _patch_receiver(module)
    SchedulerRequestReceiver().recv_requests()
    if ranks == "one":
        assert sorted(seen) == [("a", True), ("b", True), ("c", True)]
    else:
        assert seen == ["stock"]
