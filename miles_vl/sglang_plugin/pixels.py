"""Shared by every adapter: how pixel values travel between SGLang's tokenizer process and its scheduler.

- The `n` copies of a parallel-sampling prompt travel without pixel values (`drop_copy_pixels`) and the scheduler
  gives each copy the pixel tensor of its prompt back, by the image's content hash (`PixelMemory`), from the prompt's
  own request, which always reaches the scheduler first. A copy whose pixels were dropped from the memory is logged
  and left without them: if its prompt is in the prefix cache it needs none, otherwise the scheduler fails on the
  missing tensor and the server dies, which miles_vl's host relaunches (never a wrong sample).
- A batch message's pixel tensors go into shared-memory segments side by side (`move_to_shared_memory`), and a whole
  pixel file the tokenizer mapped (`wire.read_tensor`) gets a second name in /dev/shm instead of a copy
  (`link_pixel_files`); the scheduler copies one receive's segments out in threads side by side
  (`materialize_side_by_side`).
Measured on an H100/H200 in docs/benchmarks.md. Takes SGLang's classes and functions as arguments (the adapters pass
their release's), so that this module imports no SGLang.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copyreg
import logging
import os
from collections.abc import Callable

from miles_vl.sglang_plugin.settings import PluginSettings
from miles_vl.sglang_plugin.wire import LINKED_FILE

log = logging.getLogger("miles_vl.sglang_plugin")

SHM_DIR = "/dev/shm"  # where POSIX shared-memory segments live on Linux (`shm_open`)


def _mm_items(req) -> list:
    mm = getattr(req, "mm_inputs", None)
    return list(getattr(mm, "mm_items", None) or [])


def _mm_values(req) -> list:
    """Every pixel value a request's items hold (`feature`, `precomputed_embeddings`; the elements of a list): tensors,
    or 0.5.16's shared-memory pointers once moved."""
    values = []
    for item in _mm_items(req):
        for value in (item.feature, getattr(item, "precomputed_embeddings", None)):
            values.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None)
    return values


def _single_requests(recv_reqs) -> list:
    """The requests of a receive, those inside batch messages (`.batch`) included, in order."""
    return [sub for req in recv_reqs for sub in getattr(req, "batch", None) or (req,)]


def sharing_blockers(server_args) -> list[str]:
    """Server settings under which a copy might reach a scheduler that never saw its prompt's pixels, or pixels that
    are not plain tensors: there the copies keep their own (stock 0.5.16)."""
    blockers = []
    if getattr(server_args, "dp_size", 1) > 1:
        blockers.append(f"--dp-size {server_args.dp_size} (the copies may go to another scheduler than their prompt)")
    if getattr(server_args, "use_ray", False):
        blockers.append("--use-ray (its schedulers are Ray actors, which this module does not reach)")
    if getattr(server_args, "mm_feature_transport", None) not in (None, "cpu"):
        blockers.append(f"--mm-feature-transport {server_args.mm_feature_transport} (pixels are not plain tensors)")
    return blockers


def drop_copy_pixels(tokenized_obj, parallel_sampling: bool, enabled: bool = True) -> int:
    """Tokenizer side: a copy of a parallel-sampling request (not its prefix request, `max_new_tokens == 0`) loses
    the pixel values of every image item that has a hash; nothing where `enabled` is False (the setting
    `share_copy_pixels`, or a `sharing_blockers` server). Returns how many items lost them.

    The items are the copy's own (SGLang copies each item per copy before sending), so the prompt's request keeps its
    pixels."""
    if not enabled or not parallel_sampling or tokenized_obj.sampling_params.max_new_tokens == 0:
        return 0
    dropped = 0
    for item in _mm_items(tokenized_obj):
        if item.hash is not None and item.feature is not None:
            item.feature = None
            dropped += 1
    return dropped


class PixelMemory:
    """Scheduler side: pixel tensors by image hash, least recently used out first above `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.tensors: collections.OrderedDict[int, object] = collections.OrderedDict()
        self.restored = 0
        self.missing = 0

    @staticmethod
    def _size(tensor) -> int:
        # what keeping it holds: a view (one image of a prompt's pixel tensor, pickled inline) keeps its whole storage
        return tensor.untyped_storage().nbytes()

    def remember(self, key: int, tensor) -> None:
        """Keep `tensor` (a plain torch tensor; anything else, e.g. a CUDA IPC proxy or a list, is not kept)."""
        import torch  # the scheduler has it loaded; imported here so that importing this module stays light

        if type(tensor) is not torch.Tensor:
            return
        if key in self.tensors:
            self.tensors.move_to_end(key)
            return
        self.tensors[key] = tensor
        self.bytes += self._size(tensor)
        while self.bytes > self.max_bytes and len(self.tensors) > 1:
            _, old = self.tensors.popitem(last=False)
            self.bytes -= self._size(old)

    def fill(self, reqs) -> None:
        """Remember the pixels of every image item that has them; give them to the items that came without."""
        for sub in _single_requests(reqs or ()):
            for item in _mm_items(sub):
                if item.hash is None:
                    continue
                if item.feature is not None:
                    self.remember(item.hash, item.feature)
                elif getattr(item, "precomputed_embeddings", None) is None:
                    tensor = self.tensors.get(item.hash)
                    if tensor is None:
                        self.missing += 1
                        log.error(
                            "miles_vl: no pixel values remembered for image %x of request %s (%d missing so far): "
                            "it runs only if its prompt is still in the prefix cache; raise the plugin's %s (%d MB)",
                            item.hash,
                            getattr(sub, "rid", "?"),
                            self.missing,
                            "pixel_cache_mb",
                            self.max_bytes >> 20,
                        )
                        continue
                    self.tensors.move_to_end(item.hash)
                    item.feature = tensor
                    self.restored += 1


_SHM_THREADS = 8
_shm_pool: concurrent.futures.ThreadPoolExecutor | None = None


def move_to_shared_memory(wrap, tokenized_objs: list) -> None:
    """`wrap` (0.5.16's `wrap_shm_features`: each pixel tensor of a request copied into a new shared-memory segment)
    on every request, those with pixels in threads side by side: measured on an H100, 8-12 ms for a 196-token image in
    bfloat16, one after another 60-85 ms for the 8 prefixes of a GRPO batch (docs/benchmarks.md). The copies release
    the GIL; the tokenizer's event loop waits for all of them, as it waited for the serial loop."""
    global _shm_pool
    with_pixels = [
        obj
        for obj in tokenized_objs
        if any(item.feature is not None or getattr(item, "precomputed_embeddings", None) is not None
               for item in _mm_items(obj))
    ]  # fmt: skip
    if len(with_pixels) < 2:
        for obj in with_pixels:
            wrap(obj)
        return
    if _shm_pool is None:
        _shm_pool = concurrent.futures.ThreadPoolExecutor(_SHM_THREADS, thread_name_prefix="miles_vl_shm")
    moves = [_shm_pool.submit(wrap, obj) for obj in with_pixels]
    # `exception()` waits for its move: every thread is done before any segment is removed
    if failed := [e for m in moves if (e := m.exception()) is not None]:
        unlink_segments(with_pixels)  # only the scheduler removes a segment, when it reads it: none will
        raise failed[0]


def unlink_segments(tokenized_objs: list) -> None:
    """Remove the shared-memory segments of requests that will not reach the scheduler (`move_to_shared_memory` failed
    for one of them); 0.5.16's own stale-segment clean-up only takes those of processes that died."""
    from multiprocessing import shared_memory

    for obj in tokenized_objs:
        for pointer in _mm_values(obj):
            name = getattr(pointer, "shm_name", None)
            if name is None:
                continue
            try:
                segment = shared_memory.SharedMemory(name=name)
            except FileNotFoundError:
                continue
            segment.close()
            segment.unlink()


def linked_segment(tensor, pointer_cls, make_name, precomputed_hash=None):
    """A `pointer_cls` (0.5.16's `ShmPointerMMData`) for `tensor`, a whole pixel file mapped by `read_tensor`, made
    without copying: the file gets a second name in `SHM_DIR`, `make_name("mm")` (0.5.16's `make_shm_name`, which its
    stale-segment clean-up knows), and the scheduler opens, copies out and unlinks that name exactly as it does a
    segment 0.5.16 filled (`ShmPointerMMData.__setstate__` / `materialize`, `srt/managers/mm_utils.py:1890-1911`).
    None where that cannot be: a tensor that is not a whole mapped file (a view of one image of several, a cast), a
    pixel directory on another file system than `SHM_DIR`, a file already deleted; 0.5.16 then copies the tensor."""
    tag = getattr(tensor, LINKED_FILE, None)
    if tag is None:
        return None
    path, inode = tag
    nbytes = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous() or tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != nbytes:
        return None
    name = make_name("mm")
    segment = os.path.join(SHM_DIR, name)
    try:
        os.link(path, segment, follow_symlinks=False)  # the same inode: 0600 as the engine wrote it
        if os.stat(segment).st_ino != inode:  # not the file that was mapped (the engine never reuses a name)
            os.unlink(segment)
            return None
    except OSError as e:
        log.debug("miles_vl: pixel file %s copied, not linked: %s", path, e)
        return None
    return _linked_class(pointer_cls)(tensor, name, precomputed_hash)


_linked_classes: dict[type, type] = {}


def _linked_class(pointer_cls: type) -> type:
    """A subclass of SGLang's `ShmPointerMMData` for a segment that already exists (`linked_segment`).

    Why not `ShmPointerMMData(tensor)`: its constructor's only work is to create a new segment and copy the tensor into
    it (0.5.16/0.5.17 `srt/managers/mm_utils.py`, `ShmPointerMMData.__init__`), the copy this avoids; the pointer's
    other fields are the four its `__getstate__` sends. The subclass's own constructor sets those fields for the
    linked name, and it pickles as a plain `pointer_cls` (what SGLang's own pickling of one is: `__new__` then
    `__setstate__`), so the scheduler receives exactly the object stock SGLang sends."""
    linked = _linked_classes.get(pointer_cls)
    if linked is None:

        class LinkedShmPointer(pointer_cls):
            def __init__(self, tensor, shm_name: str, precomputed_hash=None):  # noqa: B027 (see the docstring above)
                self.shape, self.dtype, self.precomputed_hash = tensor.shape, tensor.dtype, precomputed_hash
                self.shm_name, self._shm_handle, self.tensor = shm_name, None, tensor

            def __reduce__(self):  # unpickled as `pointer_cls`, by the standard library alone (no miles_vl needed)
                return copyreg._reconstructor, (pointer_cls, object, None), self.__getstate__()

        linked = _linked_classes[pointer_cls] = LinkedShmPointer
    return linked


def link_pixel_files(obj, pointer_cls, make_name, enabled: bool = True) -> int:
    """Tokenizer side, before 0.5.16's `wrap_shm_features` copies a request's pixel tensors into new segments: the
    items whose pixels are a whole mapped pixel file go as a `linked_segment` instead (measured on an H100, 0.5.16's
    copy of one 196-token image took 8-12 ms; docs/benchmarks.md). Returns how many items were linked; none where
    `enabled` is False (the setting `link_pixels`)."""
    global _linked_any
    if not enabled:
        return 0
    linked = 0
    for item in _mm_items(obj):
        if (pointer := linked_segment(item.feature, pointer_cls, make_name, item.hash)) is not None:
            item.feature = pointer
            linked += 1
            if not _linked_any:  # once per process: what tests/gpu/test_sglang_real.py looks for in the log
                _linked_any = True
                log.info("miles_vl: pixel files reach the scheduler by a second name, not a copy (first: %s)",
                         pointer.shm_name)  # fmt: skip
    return linked


_linked_any = False

_receive_pool: concurrent.futures.ThreadPoolExecutor | None = None


def materialize_side_by_side(unwrap, requests: list, threads: int) -> bool:
    """Scheduler side: `unwrap` (0.5.16's `unwrap_shm_features`: each pixel tensor copied out of its segment, which is
    then unlinked) on `requests` (the single requests of one receive that hold segments) in `threads` threads side by
    side instead of one after another (timed on an H200, 22 ms for the 8 prefixes of a GRPO batch;
    docs/benchmarks.md). Returns False, having done nothing, where that does not apply: fewer than two requests, one
    thread, or a pointer object shared by two requests (materializing it twice at once would race on its handle); the
    caller then runs 0.5.16's loop. Raises the first request's failure, in order, after every thread is done."""
    global _receive_pool
    if threads < 2 or len(requests) < 2:
        return False
    ids = [i for req in requests for i in {id(v) for v in _mm_values(req)}]
    if len(ids) != len(set(ids)):
        return False
    if _receive_pool is None:
        _receive_pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="miles_vl_unwrap")
    done = [_receive_pool.submit(unwrap, req) for req in requests]
    if failed := [e for d in done if (e := d.exception()) is not None]:
        raise failed[0]
    return True


def patch_receiver(module, settings: PluginSettings, single_rank: Callable[[object], bool]) -> None:
    """Wrap the scheduler's receiver of `module` (a release's `request_receiver.py`): every received request's pixels
    are remembered and a copy's given back (`PixelMemory`), and one receive's segments are copied out side by side
    (`materialize_side_by_side`) where `single_rank(receiver)` (the release's way to tell that no other rank reads
    these segments)."""
    cls = module.SchedulerRequestReceiver
    recv, finalize = cls.recv_requests, cls._finalize_shm_features
    memory = PixelMemory(settings.pixel_cache_mb << 20)
    threads = settings.receive_threads

    def recv_requests(self, *args, **kwargs):
        reqs = recv(self, *args, **kwargs)
        memory.fill(reqs)
        return reqs

    def finalize_shm_features(self, recv_reqs):
        # one scheduler rank: no other rank reads these segments, so SGLang's barrier before the unlinks
        # (0.5.16 `request_receiver.py:238-256`) has nothing to order; with more ranks, SGLang's own loop
        if not (recv_reqs and single_rank(self) and self.model_config.is_multimodal):
            return finalize(self, recv_reqs)
        with_segments = [req for req in _single_requests(recv_reqs) if module.has_shm_features([req])]
        if not materialize_side_by_side(module.unwrap_shm_features, with_segments, threads):
            return finalize(self, recv_reqs)  # (none or one request with segments: SGLang's loop, as before)

    cls.recv_requests, cls._finalize_shm_features = recv_requests, finalize_shm_features
    cls.miles_vl_pixel_memory = memory
