"""Shared by every adapter: the tokenizer's path for a batch of prompts with `n > 1` samples (`handle_grouped`).

SGLang 0.5.16 and 0.5.17 send such a batch in `2 x batch` steps (`TokenizerManager._handle_batch_request`: each
prompt's prefix request is sent and awaited before the next prompt's, then every copy is sent on its own, and the
scheduler starts on the copies while the rest still trickle in, one extend batch per trickle). Here:
- each prompt's prefix request goes out as soon as that prompt is tokenized; prefixes ready in the same turn of the
  event loop go in one message (one receive, one prefill batch); the prefix answers are awaited together;
- then every copy of every prompt goes to the scheduler in one message (`BatchTokenizedGenerateReqInput`: one extend
  batch), each with its own sampling parameters and ids, without pixel values (`pixels.drop_copy_pixels`);
- the prompts' `mm_hashes`, which SGLang drops from the prompts of a batch (`GenerateReqInput.__getitem__`), are given
  back to them, so the tokenizer does not hash the pixel values again;
- the request states SGLang creates for every normalized rid but never uses (all but the first `batch`) are dropped.
Where the copies must keep their pixels (`share=False`) they are sent one by one, as SGLang sends them. Streaming
requests keep SGLang's path. Works on the `TokenizerManager` it is given (no SGLang import).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
from collections.abc import Callable
from dataclasses import dataclass

from miles_vl.sglang_plugin.pixels import (
    drop_copy_pixels,
    link_pixel_files,
    log,
    move_to_shared_memory,
    sharing_blockers,
    unlink_segments,
)
from miles_vl.sglang_plugin.settings import PluginSettings
from miles_vl.sglang_plugin.wire import resolve_media

# True inside the task of an HTTP request whose prompts have `n > 1` samples (the tokenizer's parallel sampling).
PARALLEL_SAMPLING: contextvars.ContextVar[bool] = contextvars.ContextVar("miles_vl_parallel_sampling", default=False)


def _own_mm_hashes(obj, sub_requests: list) -> None:
    """Give each prompt of a batch request the `mm_hashes` entry the client sent for it (0.5.16's `__getitem__`
    leaves the field out); anything not shaped one list per prompt is left alone (SGLang then hashes the pixels)."""
    hashes = getattr(obj, "mm_hashes", None)
    if not hashes:
        return
    if len(sub_requests) == 1 and all(isinstance(h, str) for h in hashes):
        sub_requests[0].mm_hashes = list(hashes)
    elif len(hashes) == len(sub_requests) and all(isinstance(h, list) for h in hashes):
        for sub, own in zip(sub_requests, hashes, strict=True):
            sub.mm_hashes = list(own)


def _copy_request(tokenized_obj, rid: str):
    """A copy of a tokenized request that shares no mutable field with it: the copies of a batch travel pickled in
    one message, where shared objects would stay shared in the scheduler."""
    out = copy.copy(tokenized_obj)
    out.rid = rid
    out.sampling_params = copy.deepcopy(tokenized_obj.sampling_params)
    out.input_ids = copy.copy(tokenized_obj.input_ids)
    mm = getattr(tokenized_obj, "mm_inputs", None)
    if mm is not None:
        out.mm_inputs = copy.copy(mm)
        out.mm_inputs.mm_items = [copy.copy(item) for item in mm.mm_items]
    return out


@dataclass(frozen=True)
class RequestStates:
    """How one SGLang release keeps the tokenizer's states of a prompt's requests (its prefix and its `n` copies).

    Args:
        add: `add(manager, logical_rid, sample)`: give `sample` (a copy of the prompt's request) a new rid and its
            request state, as the release's own parallel-sampling branch does.
        remove: `remove(manager, rid)`: remove that state (and whatever the release keeps beside it); None if absent.
        normalized_extra: the release's `generate_request` made a state for each of `batch x n` rids but uses only the
            first `batch` (0.5.16); they are removed here, or would stay for the server's life.
    """

    add: Callable[[object, str, object], None]
    remove: Callable[[object, str], object]
    normalized_extra: bool


def groups_batch(obj, enabled: bool = True) -> bool:
    """Whether `handle_grouped` takes this request (module docstring); never where `enabled` is False (the setting
    `group_copies`)."""
    return enabled and getattr(obj, "parallel_sample_num", 1) > 1 and not getattr(obj, "stream", False)


async def handle_grouped(manager, obj, request=None, *, states: RequestStates, share: bool = True):
    """The parallel-sampling branch of SGLang's `TokenizerManager._handle_batch_request` (0.5.16 `:1630-1683`), with
    the prefixes pipelined and the copies sent in one message (module docstring); `states`: the release's request
    states; `share`: the copies travel without their pixels (False: they keep them and go one by one). Yields the list
    of the `batch x n` answers, prompt by prompt, as SGLang does."""
    n = obj.parallel_sample_num
    prompts = [obj[i] for i in range(obj.batch_size)]
    _own_mm_hashes(obj, prompts)
    send_prefix = _coalesced(manager)

    made: list[str] = []  # the rids of the copies built so far (their states go if the request fails)

    def make_copies(sub, tok) -> tuple[list, list]:
        """A prompt's `n` copies, ready to send, with their request states and the answers' waiters."""
        copies, waiters = [], []
        for _ in range(n):
            sample = copy.copy(sub)
            states.add(manager, sub.rid, sample)
            one = _copy_request(tok, sample.rid)
            made.append(sample.rid)
            state = manager.rid_to_state[sample.rid]
            one.time_stats = state.time_stats
            if sample.return_prompt_token_ids:
                state.prompt_token_ids = list(tok.input_ids)
            drop_copy_pixels(one, parallel_sampling=True, enabled=share)
            copies.append(one)
            waiters.append(manager._wait_one_response(sample, request))
        return copies, waiters

    async def tokenize_and_prefill(sub):
        tokenized = await manager._tokenize_one_request(sub)
        head = copy.copy(sub)
        states.add(manager, sub.rid, head)
        prefix = _copy_request(tokenized, head.rid)
        prefix.sampling_params.max_new_tokens = 0  # prefill only: the prompt enters the prefix cache
        prefix.stream = False

        def forget_if_unsent(sending: asyncio.Future) -> None:  # no answer will remove the state of a failed send
            if sending.cancelled() or sending.exception() is not None:
                states.remove(manager, head.rid)

        sending = send_prefix(prefix)
        sending.add_done_callback(forget_if_unsent)
        await asyncio.shield(sending)  # a task cancelled while it waits leaves the message to the others
        # built while the scheduler prefills the prefix, not after its answer: 64 copies are several ms of this loop
        built = make_copies(sub, tokenized)
        await manager._wait_one_response(head, request).__anext__()
        return built

    tasks = [asyncio.ensure_future(tokenize_and_prefill(sub)) for sub in prompts]
    try:
        built = await asyncio.gather(*tasks)
    except BaseException:  # one prompt failed (or the request was cancelled): the others stop too
        for task in tasks:
            task.cancel()
        for rid in made:
            states.remove(manager, rid)
        raise

    copies = [one for prompt_copies, _ in built for one in prompt_copies]
    waiters = [w for _, prompt_waiters in built for w in prompt_waiters]
    for sub in prompts:
        state = states.remove(manager, sub.rid)  # the prompt's own entry: its samples answer for it
        if state is not None:
            state.time_stats.set_finished_time()
    if states.normalized_extra:  # (RequestStates; 0.5.17 normalizes one rid per prompt)
        for rid in list(obj.rid or ())[obj.batch_size :]:
            states.remove(manager, rid)
    try:
        if share:
            manager._send_batch_request(copies)  # one message: one receive, one prefill batch
        else:  # a sharing blocker (--dp-size > 1, ...): the copies keep their pixels and go as SGLang sends them
            for one in copies:
                manager._send_one_request(one)
    except BaseException:
        for one in copies:
            states.remove(manager, one.rid)
        raise
    yield list(await asyncio.gather(*(w.__anext__() for w in waiters)))


def _coalesced(manager):
    """`send(tokenized) -> asyncio.Future`: the requests given to it in one turn of the event loop leave together, in
    one message (`_send_batch_request`; one alone: `_send_one_request`), at the end of that turn; the future is that
    message's, done when it has left, with the send's exception if it failed. The tasks of a batch's prompts are all
    queued before the first runs, so the prompts that tokenize without waiting are all sent at once."""
    loop = asyncio.get_running_loop()
    pending: list = []
    sent: list[asyncio.Future] = []

    def flush() -> None:
        batch, done = list(pending), sent.pop()
        pending.clear()
        try:
            manager._send_one_request(batch[0]) if len(batch) == 1 else manager._send_batch_request(batch)
        except BaseException as e:  # noqa: BLE001 (handed to the waiting tasks)
            done.set_exception(e)
        else:
            done.set_result(None)

    def send(tokenized) -> asyncio.Future:
        if not pending:
            sent.append(loop.create_future())
            loop.call_soon(flush)
        pending.append(tokenized)
        return sent[-1]

    return send


def _stock_wraps(mm_utils) -> bool:
    """Whether SGLang's `wrap_shm_features` moves pixel tensors into segments in this server (it leaves them inline
    in its "default" transport, chosen with `--dist-init-addr`, and with `--skip-tokenizer-init`,
    `srt/managers/mm_utils.py:1970`); False for anything that is not SGLang's module."""
    try:
        return not (mm_utils._get_is_default_transport() or mm_utils.get_server_args().skip_tokenizer_init) and all(
            hasattr(mm_utils, name) for name in ("ShmPointerMMData", "make_shm_name")
        )
    except AttributeError:
        return False


def patch_tokenizer(module, mm_utils, settings: PluginSettings, states: RequestStates) -> None:
    """Wrap the tokenizer's methods of `module` (a release's `srt/managers/tokenizer_manager.py`; `mm_utils`: its
    `srt/managers/mm_utils.py`, where `wrap_shm_features` and `ShmPointerMMData` live): a batch with
    `n > 1` takes `handle_grouped`, a request's pixel files are read before SGLang tokenizes it (`wire.resolve_media`),
    a copy's pixels are dropped (`pixels.drop_copy_pixels`), a batch message's pixels move to shared memory side by side
    and a mapped pixel file is linked, not copied (`pixels.link_pixel_files`). The targets were checked by the
    release's adapter before this runs."""
    cls = module.TokenizerManager
    handle, send, tokenize = cls._handle_batch_request, cls._send_one_request, cls._tokenize_one_request
    send_batch, stock_wrap = cls._send_batch_request, module.wrap_shm_features

    def share(manager) -> bool:  # the copies go without pixels: asked for, and no blocker in this server
        blockers = manager.__dict__.get("miles_vl_sharing_blockers")
        if blockers is None:
            blockers = manager.miles_vl_sharing_blockers = sharing_blockers(manager.server_args)
            if blockers and settings.share_copy_pixels:
                log.warning("miles_vl: the n copies of a prompt keep their own pixels here: %s", "; ".join(blockers))
        return settings.share_copy_pixels and not blockers

    def wrap_shm(obj):
        if _stock_wraps(mm_utils):  # only where SGLang itself would hand the tensors over in segments
            link_pixel_files(obj, mm_utils.ShmPointerMMData, mm_utils.make_shm_name, enabled=settings.link_pixels)
        try:
            return stock_wrap(obj)  # copies what was not linked (it leaves a pointer as it is)
        except BaseException:  # nothing was sent: no scheduler will read (and remove) the names made so far
            unlink_segments([obj])
            raise

    async def tokenize_one_request(self, obj):
        resolve_media(obj, self.model_config.dtype)  # every request is tokenized here, whatever its path
        return await tokenize(self, obj)

    async def handle_batch_request(self, obj, request=None):
        token = PARALLEL_SAMPLING.set(obj.parallel_sample_num > 1)  # this request's task
        try:
            if groups_batch(obj, settings.group_copies):
                answers = handle_grouped(self, obj, request, states=states, share=share(self))
            else:
                answers = handle(self, obj, request)
            async for out in answers:
                yield out
        finally:
            try:
                PARALLEL_SAMPLING.reset(token)  # a caller that goes on in the same task (Engine.async_generate)
            except ValueError:  # closed from another context: that context never saw the flag
                pass

    def send_one_request(self, tokenized_obj):
        drop_copy_pixels(tokenized_obj, PARALLEL_SAMPLING.get(), enabled=share(self))
        return send(self, tokenized_obj)

    def send_batch_request(self, tokenized_objs):
        # SGLang's batch send pickles pixel tensors into the message (only `_send_one_request` moves them into shared
        # memory), a view of a multi-image prompt's tensor with its whole storage, once per image: move them as one
        # request's send does (a tensor already moved is left as it is), the requests side by side
        move_to_shared_memory(wrap_shm, tokenized_objs)
        return send_batch(self, tokenized_objs)  # (a failed send leaves its segments, as SGLang's own send does)

    cls._handle_batch_request, cls._send_one_request = handle_batch_request, send_one_request
    cls._send_batch_request = send_batch_request
    cls._tokenize_one_request = tokenize_one_request
    module.wrap_shm_features = wrap_shm  # what SGLang's `_send_one_request` calls by this module's global name
