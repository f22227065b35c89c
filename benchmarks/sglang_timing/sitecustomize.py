"""Where an SGLang 0.5.16 server's time goes, per process: bench_sglang_decode.py's `timed` variant.

Put this directory first on PYTHONPATH and set MILES_VL_SGLANG_TIMING=<file>: every Python process of the server (the
HTTP/tokenizer process, the scheduler, the detokenizer; spawned children import sitecustomize too) then appends one
JSON line per timed call to <file>:

    {"t": <end, time.time()>, "pid": ..., "what": "sched.run_batch", "ms": 3.1, "n": 64, "mode": "DECODE"}

Timed, once their module is imported (`PatchOnImport`, a meta-path hook of this file, patches the classes as they
load, nothing is imported early; miles_vl's SGLang plugin, where it is on, imports them from `load_plugins` and wraps
what this file timed: the timed methods are SGLang's own, inside the plugin's):
- tokenizer (`srt/managers/tokenizer_manager.py`): `_tokenize_one_request` (base64 + PNG decode, the image processor,
  the hash), `_send_one_request` (the shared-memory copy of the pixel values and the pickle to the scheduler);
- scheduler (`srt/managers/scheduler.py`, `scheduler_components/request_receiver.py`): `recv_requests` (zmq receive,
  unpickling, the shared-memory copy back), `process_input_requests` (building `Req`s), `get_next_batch_to_run`
  (scheduling, prefix matching), `run_batch` (launch; with the overlap scheduler the GPU work is waited for in the
  next `process_batch_result`), `process_batch_result`; `_send_batch_request` (a batch's copies in one message,
  miles_vl's plugin);
- model (`srt/models/qwen3_vl.py`), with the GPU work waited for: `forward` of extend batches (vision tower +
  language model; decode replays a CUDA graph and is not timed), `get_image_feature` (the pixel values' concatenation
  and cast, then the vision tower), inside it the tower's `forward`, `rot_pos_emb`, `fast_pos_embed_interpolate` and
  every block's `forward`, and the language model's `forward` of extend batches. These add CUDA syncs, so a `timed`
  run's own t(1) is not comparable with the other variants'.
The benchmark writes its own markers (`bench.call`) to the same file. Not used by miles_vl; measurement only.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys
import time

_PATH = os.environ.get("MILES_VL_SGLANG_TIMING")


def record(what: str, seconds: float, **extra) -> None:
    line = json.dumps(
        {"t": round(time.time(), 6), "pid": os.getpid(), "what": what, "ms": round(seconds * 1e3, 3)} | extra
    )
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write per line: O_APPEND keeps the processes' lines whole
    finally:
        os.close(fd)


def _timed(fn, what, describe=None):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        extra = describe(args, out) if describe else {}
        if extra is not None:
            record(what, time.perf_counter() - t0, **extra)
        return out

    return wrapper


def _timed_async(fn, what):
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = await fn(*args, **kwargs)
        record(what, time.perf_counter() - t0)
        return out

    return wrapper


def _batch(args, _out):
    batch = args[1] if len(args) > 1 else None
    if batch is None:
        return None
    return {"n": batch.batch_size(), "mode": getattr(batch.forward_mode, "name", str(batch.forward_mode))}


def _received(_args, out):
    return {"n": len(out)} if out else None  # idle polls are not recorded


def _send(args, _out):
    obj = args[1]
    items = getattr(getattr(obj, "mm_inputs", None), "mm_items", None) or []
    return {
        "pixels": sum(1 for i in items if getattr(i, "feature", None) is not None),
        "new": obj.sampling_params.max_new_tokens,
    }


def _wrapped(args, _out):
    items = getattr(getattr(args[0], "mm_inputs", None), "mm_items", None) or []
    return {"pixels": sum(1 for i in items if getattr(i, "feature", None) is not None)}


def _patch_tokenizer(module) -> None:
    cls = module.TokenizerManager
    cls._tokenize_one_request = _timed_async(cls._tokenize_one_request, "tok.tokenize")
    cls._send_one_request = _timed(cls._send_one_request, "tok.send", _send)
    cls._send_batch_request = _timed(cls._send_batch_request, "tok.send_batch", lambda a, _o: {"n": len(a[1])})
    # the move of a request's pixel tensors into shared memory (0.5.16's single send, and miles_vl's launcher's batch
    # send, which looks it up here after this patch)
    module.wrap_shm_features = _timed(module.wrap_shm_features, "tok.wrap_shm", _wrapped)


def _synced(fn, what, describe=None):
    """Like `_timed`, with the GPU work included: waits for the queued work before (not counted) and for the call's
    own work after. Only for the breakdown: the syncs cost the overlap scheduler its overlap."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        extra = describe(args, kwargs) if describe else {}
        if extra is None or torch.cuda.is_current_stream_capturing():  # no syncs inside a CUDA graph's capture
            return fn(*args, **kwargs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        record(what, time.perf_counter() - t0, **extra)
        return out

    return wrapper


def _extend(args, kwargs):
    batch = args[3] if len(args) > 3 else kwargs.get("forward_batch")  # forward(self, input_ids, positions, fb, ...)
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not mode.is_extend():
        return None  # decode runs as a CUDA graph replay, not through here
    return {"n": getattr(batch, "batch_size", None), "tokens": int(getattr(batch, "extend_num_tokens", 0) or 0)}


def _patch_model(module) -> None:
    cls = module.Qwen3VLForConditionalGeneration
    cls.get_image_feature = _synced(cls.get_image_feature, "gpu.vision", lambda a, k: {"images": len(a[1])})
    cls.forward = _synced(cls.forward, "gpu.extend", _extend)
    # inside the vision tower (what of its time is fixed cost) and the language model of an extend
    tower = module.Qwen3VLMoeVisionModel
    tower.forward = _synced(tower.forward, "gpu.vision.tower", lambda a, k: {})
    tower.fast_pos_embed_interpolate = _synced(
        tower.fast_pos_embed_interpolate, "gpu.vision.pos_embed", lambda a, k: {}
    )
    tower.rot_pos_emb = _synced(tower.rot_pos_emb, "gpu.vision.rot_pos", lambda a, k: {})
    block = module.Qwen3_VisionBlock
    block.forward = _synced(block.forward, "gpu.vision.block", lambda a, k: {})
    lm = module.Qwen3LLMModel
    lm.forward = _synced(lm.forward, "gpu.lm", _extend)


def _patch_receiver(module) -> None:
    cls = module.SchedulerRequestReceiver
    cls.recv_requests = _timed(cls.recv_requests, "sched.recv", _received)


def _patch_scheduler(module) -> None:
    cls = module.Scheduler
    cls.process_input_requests = _timed(
        cls.process_input_requests, "sched.process_input", lambda a, _o: {"n": len(a[1])} if a[1] else None
    )
    cls.get_next_batch_to_run = _timed(cls.get_next_batch_to_run, "sched.next_batch")
    cls.run_batch = _timed(cls.run_batch, "sched.run_batch", _batch)
    cls.process_batch_result = _timed(cls.process_batch_result, "sched.result", _batch)


PATCHES = {
    "sglang.srt.managers.tokenizer_manager": _patch_tokenizer,
    "sglang.srt.managers.scheduler_components.request_receiver": _patch_receiver,
    "sglang.srt.managers.scheduler": _patch_scheduler,
    "sglang.srt.models.qwen3_vl": _patch_model,
}


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds no module itself: for a module in `patches`, wraps the loader that would load it, so that the patch runs
    right after the module has executed (nothing is imported earlier than SGLang imports it)."""

    def __init__(self, patches):
        self.patches = dict(patches)
        self._searching: set[str] = set()

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        if patch is None or name in self._searching:  # asked again by another hook of this kind that we asked
            return None
        self._searching.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)  # another PatchOnImport wraps its own patch in first
                if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    exec_module = spec.loader.exec_module

                    def exec_and_patch(module, _exec=exec_module):
                        _exec(module)
                        patch(module)

                    spec.loader.exec_module = exec_and_patch
                    del self.patches[name]  # once per process
                    return spec
            return None
        finally:
            self._searching.discard(name)


if _PATH:
    sys.meta_path.insert(0, PatchOnImport(PATCHES))
