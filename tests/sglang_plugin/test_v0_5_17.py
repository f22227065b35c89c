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
import dataclasses
import sys
import types

import pytest
import torch

from miles_vl.sglang_plugin.settings import PluginSettings
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


def _tokenizer_0517_patched(cls) -> None:
    environ = types.SimpleNamespace(envs=types.SimpleNamespace(SGLANG_RUST_SERVER=types.SimpleNamespace(get=bool)))
    modules = {
        tokenizer_0517.TOKENIZER_MODULE: _tokenizer_module(cls),
        tokenizer_0517.MM_UTILS_MODULE: None,
        tokenizer_0517.ENVIRON_MODULE: environ,  # SGLANG_RUST_SERVER off (`bool()` is False)
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
