"""SGLang 0.5.16's server with one change to how a prompt's `n` samples reach the scheduler:
`python -m miles_vl.sglang_launch <the flags of python -m sglang.launch_server>`.

For a request with `sampling_params.n > 1`, 0.5.16's tokenizer process sends the prompt alone first
(`max_new_tokens = 0`: it fills the prefix cache) and then `n` copies of the tokenized request, each with the
prompt's pixel values in a new shared-memory segment that the scheduler copies out again
(`TokenizerManager._handle_batch_request`, `srt/managers/tokenizer_manager.py:1630-1683`; `wrap_shm_features`,
`srt/managers/mm_utils.py:1966`; `SchedulerRequestReceiver._finalize_shm_features`,
`srt/managers/scheduler_components/request_receiver.py:238`). Measured on an H100 (docs/benchmarks.md): about 7.6 ms
of the tokenizer process and 3.9 ms of the scheduler per copy, serially; for 8 prompts x 8 samples that is 0.5 s of
a 1.0 s wait before the first decode step.

Here the copies travel without pixel values and the scheduler gives each copy the pixel tensor of its prompt back,
by the image's content hash, from the prompt's own request, which always reaches the scheduler first (the tokenizer
awaits the prompt's answer before it sends the copies):
- tokenizer process: a copy's image items whose `hash` is set (`SGLANG_MM_PRECOMPUTE_HASH=1`, which miles_vl's
  servers run with) are sent with `feature = None`; items without a hash keep their pixels;
- scheduler: every received request's pixel tensors are remembered by hash (least recently used first out, at most
  `MILES_VL_SGLANG_PIXEL_CACHE_MB`, 4096 by default), and a copy's missing ones are set to the remembered tensor. The
  model then sees exactly the objects stock SGLang would give it. A copy whose pixels were already dropped from the
  memory (more than the budget of other images arrived between a prompt and its copies) is logged and left
  without them: if its prompt is in the prefix cache it needs none (the vision tower runs only for images not all
  in the prefix, `_get_chunked_prefill_embedding`, `mm_utils.py:754`), otherwise the scheduler fails on the missing
  tensor and the server dies, which miles_vl's host relaunches (never a wrong sample).

The tokenizer also sends a batch of prompts with `n > 1` (one HTTP request: `SGLangRolloutEngine`'s
`prompts_per_request`) in two steps instead of 0.5.16's `2 x batch` (`_handle_batch_request`, `:1630-1683`: each
prompt's prefix request is sent and awaited before the next prompt's, then every copy is sent on its own, and the
scheduler starts on the copies while the rest still trickle in, one extend batch per trickle):
- each prompt's prefix request goes out as soon as that prompt is tokenized (the scheduler prefills the first prompts
  while the tokenizer processes the next images); prefixes ready in the same turn of the event loop go in one message
  (one receive, one prefill batch), which is every prompt of the request when tokenizing does not wait (pixel values
  from the engine: no image to load); the prefix answers are awaited together;
- then every copy of every prompt goes to the scheduler in one message (`BatchTokenizedGenerateReqInput`, which the
  scheduler takes in one receive: one extend batch), each with its own sampling parameters and ids;
- the prompts' `mm_hashes`, which 0.5.16 drops from the prompts of a batch (`GenerateReqInput.__getitem__`), are
  given back to them, so the tokenizer does not hash the pixel values again;
- the request states 0.5.16 creates for every normalized rid but never uses (all but the first `batch`) are dropped
  (0.5.16 keeps them, and the request's image URLs with them, for the server's life).
Under the settings that would break the pixel sharing (`sharing_blockers`) the copies keep their pixels and are sent
one by one, as 0.5.16 sends them (the prefixes are still pipelined). Streaming requests keep 0.5.16's path.

Pixel values from the engine (`write_tensor` / `resolve_media`): the engine and its server always run on one node (the
engine's host starts the server as its own child), so instead of images for SGLang to decode and process again, the
engine writes each prompt's own `pixel_values` (and `pixel_values_videos`) as raw bytes into a private directory
(`MILES_VL_SGLANG_PIXEL_DIR`, set by the host in the server's environment) and sends, in 0.5.16's `processor_output`
image format, a small reference to the file with its dtype and shape, the grids, and the expanded prompt ids. The
tokenizer process reads the file before 0.5.16 tokenizes the request (`TokenizerManager._tokenize_one_request`), so
0.5.16 takes its fast path for preprocessed input (`BaseMultimodalProcessor.load_mm_data`,
`srt/multimodal/processors/base_processor.py:823`): no decode of the ids to text, no image decoding, no second run of
the image processor, no re-tokenization; the model runs on exactly the pixels and ids the trainer uses. Pixel values
arrive in the dtype the model casts them to (`Qwen3VLForConditionalGeneration.get_image_feature`,
`srt/models/qwen3_vl.py:1334`) or in float32, which is cast here, as the model would; any other dtype is refused (a
lossy cast the model would not make). The files are 0600 in a 0700 directory (stock 0.5.16's own segments are 0600),
and the server reads only its own: a plain name, directly in that directory, which must be this user's alone, naming a
regular file of this user that no one else can read (`read_tensor`: another user's file, a path, `..` or a symbolic
link is a 400); the engine deletes them when the request is answered.

On their way to the scheduler (docs/sglang.md §4, "without copies"): the tokenizer maps a file rather than reading it
(`read_tensor`); where 0.5.16 would copy a tensor into a new shared-memory segment, a whole mapped file gets a second
name in /dev/shm instead, which the scheduler reads and removes as it does 0.5.16's segments (`link_pixel_files`);
the scheduler copies the segments of one receive out in threads side by side (`materialize_side_by_side`); and a
prompt's `n` copies are built while its prefix prefills. A one-image item comes with the engine's hash of its pixels
(`generate.pixel_hash`), so 0.5.16's tokenizer does not hash them.

The vision tower's CUDA graphs (`MILES_VL_SGLANG_VISION_GRAPHS`, from `rollout.sglang.vision_cuda_graphs`; 0, off, by
default): 0.5.16 runs the tower eagerly (its own `SGLANG_VIT_ENABLE_CUDA_GRAPH` replays wrong image boundaries and a
freed rotary table, so it is forced off here). `VisionGraphs` keeps one 0.5.16 graph runner per image layout (the
patch grids of one vision batch), captured at a layout's second sighting and replayed after; it pays off when
layouts repeat (images of one size in batches of one size: the vision step 43-51 -> 26-27 ms for 8 images of 784
patches on an H200, docs/benchmarks.md) and costs nothing where they do not.

How the patches reach every server process: this module is the server's `__main__`, and SGLang starts its
scheduler, detokenizer and tokenizer workers with the `spawn` start method, which imports the parent's main module
(as `__mp_main__`) in each child; running it installs a meta-path hook that patches the SGLang classes above when
SGLang imports their modules. Nothing else of miles_vl is imported in the server.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import copy
import importlib.abc
import logging
import math
import os
import stat
import sys
import uuid

CACHE_ENV = "MILES_VL_SGLANG_PIXEL_CACHE_MB"
DEFAULT_CACHE_MB = 4096
ENABLED_ENV = "MILES_VL_SGLANG_SHARE_COPY_PIXELS"  # "0": the copies keep their pixels (set below for the blockers)
GROUP_ENV = "MILES_VL_SGLANG_GROUP_COPIES"  # "0": a batch's prefixes and copies go as in 0.5.16 (the bench's baseline)
PIXEL_DIR_ENV = "MILES_VL_SGLANG_PIXEL_DIR"  # where the engine writes pixel values for this server (set by its host)
FILE_KEY = "miles_vl_file"  # a processor_output value given as {FILE_KEY: name, "dtype": ..., "shape": [...]}
WIRE_DTYPES = ("float32", "bfloat16", "float16")
FEATURE_GRIDS = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}
TOKENIZER_MODULE = "sglang.srt.managers.tokenizer_manager"
RECEIVER_MODULE = "sglang.srt.managers.scheduler_components.request_receiver"
VISION_MODULE = "sglang.srt.models.qwen3_vl"
LINK_ENV = "MILES_VL_SGLANG_LINK_PIXELS"  # "0": pixel files copied into new segments, as 0.5.16 does (bench baseline)
RECEIVE_THREADS_ENV = "MILES_VL_SGLANG_RECEIVE_THREADS"  # threads taking a receive's pixels out of shared memory
DEFAULT_RECEIVE_THREADS = 8  # 1: one request after another, as 0.5.16 does (the bench's baseline)
LINKED_FILE = "_miles_vl_file"  # set on a tensor that `read_tensor` mapped from a pixel file: that file's path
SHM_DIR = "/dev/shm"  # where POSIX shared-memory segments live on Linux (`shm_open`)
VISION_GRAPHS_ENV = "MILES_VL_SGLANG_VISION_GRAPHS"  # image layouts whose vision-tower CUDA graphs are kept; 0: eager
VISION_GRAPH_MAX_PATCHES = 32768  # larger batches of images run eagerly (a graph's memory grows with its patches)
SGLANG_VIT_GRAPH_ENV = "SGLANG_VIT_ENABLE_CUDA_GRAPH"  # 0.5.16's own vision graphs: unsafe (VisionGraphs), kept off

log = logging.getLogger("miles_vl.sglang_launch")

# True inside the task of an HTTP request whose prompts have `n > 1` samples (the tokenizer's parallel sampling).
_PARALLEL_SAMPLING: contextvars.ContextVar[bool] = contextvars.ContextVar("miles_vl_parallel_sampling", default=False)


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


def sharing_enabled() -> bool:
    """Whether the copies travel without their pixels (off where `sharing_blockers` found a blocker)."""
    return os.environ.get(ENABLED_ENV, "1") != "0"


def drop_copy_pixels(tokenized_obj, parallel_sampling: bool) -> int:
    """Tokenizer side: a copy of a parallel-sampling request (not its prefix request, `max_new_tokens == 0`) loses
    the pixel values of every image item that has a hash. Returns how many items lost them.

    The items are the copy's own (0.5.16 copies each item per copy before sending), so the prompt's request keeps its
    pixels."""
    if not parallel_sampling or tokenized_obj.sampling_params.max_new_tokens == 0:
        return 0
    if not sharing_enabled():
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
                            "it runs only if its prompt is still in the prefix cache; raise %s (now %d MB)",
                            item.hash,
                            getattr(sub, "rid", "?"),
                            self.missing,
                            CACHE_ENV,
                            self.max_bytes >> 20,
                        )
                        continue
                    self.tensors.move_to_end(item.hash)
                    item.feature = tensor
                    self.restored += 1


# ---------------------------------------------------------------------------------------------------------------------
# pixel values handed over as files (module docstring)


def write_tensor(directory: str, tensor) -> dict:
    """Engine side: `tensor`'s raw bytes as a new file in `directory`; returns the reference that stands for it in a
    `processor_output` item (`resolve_media` reads it back). The caller deletes the file (`os.path.join(directory,
    ref[FILE_KEY])`) once the request is answered."""
    import torch

    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"pixel values go to the server as one of {WIRE_DTYPES}, found {tensor.dtype}")
    data = tensor.detach().to("cpu").contiguous()
    name = f"{uuid.uuid4().hex}.bin"
    # 0600 from its creation (never readable by another user, not even while it is written); a new name only
    fd = os.open(
        os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    with open(fd, "wb") as f:
        f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
    return {FILE_KEY: name, "dtype": dtype, "shape": list(data.shape)}


def _why_not_private(st, kind: str) -> str | None:
    """Why `st` (an `os.lstat` result) is not a `kind` ("directory" or "file") of this user alone, or None."""
    if not (stat.S_ISDIR if kind == "directory" else stat.S_ISREG)(st.st_mode):
        return f"it is not a {kind} but {stat.filemode(st.st_mode)} (a symbolic link is not followed)"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this server's user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return f"its mode {stat.filemode(st.st_mode)} lets other users reach it"
    return None


def check_pixel_directory(directory: str) -> None:
    """Raise unless `directory` is a private directory of this user (0700 or stricter, not a symbolic link), as the
    engine's host makes it (`pixel_directory`): a directory others can write to (/dev/shm itself) could hold their
    files under any name.

    Raises:
        ValueError: naming the directory, what is wrong and the fix.
    """
    try:
        problem = _why_not_private(os.lstat(directory), "directory")
    except OSError as e:
        problem = str(e)
    if problem:
        raise ValueError(
            f"{PIXEL_DIR_ENV}={directory} is not a private pixel directory: {problem}. The server reads pixel files "
            "only from a 0700 directory of its own user: start it through miles_vl's SGLang host, which makes one"
        )


def read_tensor(ref: dict, directory: str | None):
    """Server side: the tensor of a `write_tensor` reference, mapping the file (its pages, not a copy of them; the
    engine never writes a file again, and its deleting the name leaves the mapping whole), tagged with the file's path
    and inode for `link_pixel_files`.

    Only the server's own files are read: a plain name (no path), in a directory of this user that no one else can
    reach (`check_pixel_directory`), naming a regular file (not a symbolic link) of this user with no access for
    others, as `write_tensor` makes them. The name is checked, then mapped: only this user can change what it names
    in between.

    Raises:
        ValueError: no pixel directory, or one that is not private; a name that is not a plain file name in it, a
            missing file, a file that is not private to this user, an unknown dtype or a shape that does not match the
            file's size (SGLang answers a ValueError with HTTP 400).
    """
    import torch

    name, dtype, shape = ref.get(FILE_KEY), ref.get("dtype"), ref.get("shape")
    if not directory:
        raise ValueError(
            f"a request refers to pixel values in a file, but this server has no {PIXEL_DIR_ENV}: start it through "
            "miles_vl's SGLang host (rollout.sglang.send_pixel_values), which sets it"
        )
    if not isinstance(name, str) or not name or name != os.path.basename(name) or name.startswith("."):
        raise ValueError(f"{FILE_KEY}={name!r} is not a file name in {PIXEL_DIR_ENV}")
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"pixel values of dtype {dtype!r}: expected one of {WIRE_DTYPES}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"pixel values of shape {shape!r}: expected a list of non-negative ints")
    check_pixel_directory(directory)
    path = os.path.join(directory, name)
    numel = math.prod(shape)
    nbytes = numel * getattr(torch, dtype).itemsize
    try:
        st = os.lstat(path)  # the name itself: a symbolic link is refused below, never followed
    except OSError as e:
        raise ValueError(f"pixel values {name} not found in {directory}: {e}") from e
    if problem := _why_not_private(st, "file"):
        raise ValueError(
            f"pixel values {name} in {directory} refused: {problem}. The server reads only the 0600 files its engine "
            "wrote into its own pixel directory"
        )
    if st.st_size != nbytes:
        raise ValueError(f"pixel values {name}: {st.st_size} bytes for shape {shape} of {dtype} ({nbytes} expected)")
    if numel == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    # mapped, not read (the file's pages, which `link_pixel_files` hands on); private: opened read-only, and a file the
    # engine removed meanwhile is an error (shared=True would open it read-write and make a new zero-filled one)
    try:
        tensor = torch.from_file(path, shared=False, size=numel, dtype=getattr(torch, dtype)).reshape(shape)
    except RuntimeError as e:
        raise ValueError(f"pixel values {name} could not be mapped from {directory}: {e}") from e
    setattr(tensor, LINKED_FILE, (path, st.st_ino))
    return tensor


def _is_file_ref(value) -> bool:
    return isinstance(value, dict) and FILE_KEY in value


def resolve_item(item: dict, model_dtype, directory: str | None) -> dict:
    """One `processor_output` item with its file references read: pixel values as tensors in `model_dtype` (from
    float32 or that dtype; anything else is a ValueError), grids as int64 tensors [n, 3] whose patches add up to the
    pixel rows."""
    import torch

    out = dict(item)
    for key, value in item.items():
        if _is_file_ref(value):
            out[key] = read_tensor(value, directory)
    for key, grid_key in FEATURE_GRIDS.items():
        if key not in out:
            continue
        pixels = out[key]
        if not isinstance(pixels, torch.Tensor) or pixels.ndim != 2:
            raise ValueError(f"{key} must be a 2-D tensor [patches, dim], found {type(pixels).__name__}")
        if pixels.dtype != model_dtype:
            if pixels.dtype != torch.float32:
                raise ValueError(
                    f"{key} arrived as {pixels.dtype} but the model runs {model_dtype}: casting would lose precision "
                    "the model's own cast keeps; send float32 or the model's dtype"
                )
            pixels = out[key] = pixels.to(model_dtype)  # what get_image_feature's .type(visual.dtype) would do
        grid = torch.as_tensor(out.get(grid_key), dtype=torch.long) if out.get(grid_key) is not None else None
        if grid is None or grid.ndim != 2 or grid.shape[-1] != 3:
            raise ValueError(f"{key} needs {grid_key} as rows [t, h, w], found {out.get(grid_key)!r}")
        if int(grid.prod(dim=-1).sum()) != pixels.shape[0]:
            raise ValueError(
                f"{grid_key} {grid.tolist()} covers {int(grid.prod(dim=-1).sum())} patches but {key} has "
                f"{pixels.shape[0]} rows"
            )
        out[grid_key] = grid
    return out


def resolve_media(obj, model_dtype, directory: str | None = None) -> int:
    """Read the file references of a request's `processor_output` items in place (`image_data`, `video_data`);
    returns how many items were read. `directory`: default `$MILES_VL_SGLANG_PIXEL_DIR`."""
    if directory is None:
        directory = os.environ.get(PIXEL_DIR_ENV)
    resolved = 0
    for field in ("image_data", "video_data"):
        items = getattr(obj, field, None)
        if isinstance(items, dict):  # 0.5.16 hands a prompt of a batch its one video item unwrapped
            if any(_is_file_ref(v) for v in items.values()):
                setattr(obj, field, resolve_item(items, model_dtype, directory))
                resolved += 1
            continue
        if not isinstance(items, list):
            continue
        for k, item in enumerate(items):  # lists shared with the request's other prompts: read once, in place
            if isinstance(item, dict) and any(_is_file_ref(v) for v in item.values()):
                items[k] = resolve_item(item, model_dtype, directory)
                resolved += 1
    return resolved


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


def groups_batch(obj) -> bool:
    """Whether `handle_grouped` takes this request (module docstring)."""
    return (
        getattr(obj, "parallel_sample_num", 1) > 1
        and not getattr(obj, "stream", False)
        and os.environ.get(GROUP_ENV, "1") != "0"
    )


async def handle_grouped(manager, obj, request=None):
    """The parallel-sampling branch of 0.5.16's `TokenizerManager._handle_batch_request` (`:1630-1683`), with the
    prefixes pipelined and the copies sent in one message (module docstring). Yields the list of the
    `batch x n` answers, prompt by prompt, as 0.5.16 does."""
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
            one = _copy_request(tok, sample.regenerate_rid())
            manager._init_req_state(sample)
            made.append(sample.rid)
            state = manager.rid_to_state[sample.rid]
            one.time_stats = state.time_stats
            if sample.return_prompt_token_ids:
                state.prompt_token_ids = list(tok.input_ids)
            drop_copy_pixels(one, parallel_sampling=True)
            copies.append(one)
            waiters.append(manager._wait_one_response(sample, request))
        return copies, waiters

    async def tokenize_and_prefill(sub):
        tokenized = await manager._tokenize_one_request(sub)
        head = copy.copy(sub)
        prefix = _copy_request(tokenized, head.regenerate_rid())
        prefix.sampling_params.max_new_tokens = 0  # prefill only: the prompt enters the prefix cache
        prefix.stream = False
        manager._init_req_state(head)

        def forget_if_unsent(sending: asyncio.Future) -> None:  # no answer will remove the state of a failed send
            if sending.cancelled() or sending.exception() is not None:
                manager.rid_to_state.pop(head.rid, None)

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
            manager.rid_to_state.pop(rid, None)
        raise

    copies = [one for prompt_copies, _ in built for one in prompt_copies]
    waiters = [w for _, prompt_waiters in built for w in prompt_waiters]
    for sub in prompts:
        state = manager.rid_to_state.pop(sub.rid, None)  # the prompt's own entry: its samples answer for it
        if state is not None:
            state.time_stats.set_finished_time()
    # generate_request made an entry for each of the batch x n rids it normalized; 0.5.16 uses (and removes) only the
    # first batch_size of them (its copies get new rids), so the others would stay for the server's life
    for rid in list(getattr(obj, "rid", None) or ())[obj.batch_size :]:
        manager.rid_to_state.pop(rid, None)
    try:
        if sharing_enabled():
            manager._send_batch_request(copies)  # one message: one receive, one prefill batch
        else:  # a sharing blocker (--dp-size > 1, ...): the copies keep their pixels and go as 0.5.16 sends them
            for one in copies:
                manager._send_one_request(one)
    except BaseException:
        for one in copies:
            manager.rid_to_state.pop(one.rid, None)
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
    pointer = pointer_cls.__new__(pointer_cls)  # the fields of 0.5.16's __init__, without its copy
    pointer.shape, pointer.dtype, pointer.precomputed_hash = tensor.shape, tensor.dtype, precomputed_hash
    pointer.shm_name, pointer._shm_handle, pointer.tensor = name, None, tensor
    return pointer


def link_pixel_files(obj, pointer_cls, make_name) -> int:
    """Tokenizer side, before 0.5.16's `wrap_shm_features` copies a request's pixel tensors into new segments: the
    items whose pixels are a whole mapped pixel file go as a `linked_segment` instead (measured on an H100, 0.5.16's
    copy of one 196-token image took 8-12 ms; docs/benchmarks.md). Returns how many items were linked; off with
    `MILES_VL_SGLANG_LINK_PIXELS=0`."""
    global _linked_any
    if os.environ.get(LINK_ENV, "1") == "0":
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


def _stock_wraps(mm_utils) -> bool:
    """Whether 0.5.16's `wrap_shm_features` moves pixel tensors into segments in this server (it leaves them inline
    in its "default" transport, chosen with `--dist-init-addr`, and with `--skip-tokenizer-init`,
    `srt/managers/mm_utils.py:1970`); False for anything that is not 0.5.16's module."""
    try:
        return not (mm_utils._get_is_default_transport() or mm_utils.get_server_args().skip_tokenizer_init) and all(
            hasattr(mm_utils, name) for name in ("ShmPointerMMData", "make_shm_name")
        )
    except AttributeError:
        return False


def _patch_tokenizer(module) -> None:
    cls = module.TokenizerManager
    handle, send, tokenize = cls._handle_batch_request, cls._send_one_request, cls._tokenize_one_request
    send_batch, stock_wrap = cls._send_batch_request, module.wrap_shm_features
    mm_utils = sys.modules.get(getattr(stock_wrap, "__module__", ""))  # 0.5.16's srt/managers/mm_utils.py

    def wrap_shm(obj):
        if _stock_wraps(mm_utils):  # only where 0.5.16 itself would hand the tensors over in segments
            link_pixel_files(obj, mm_utils.ShmPointerMMData, mm_utils.make_shm_name)
        try:
            return stock_wrap(obj)  # copies what was not linked (it leaves a pointer as it is)
        except BaseException:  # nothing was sent: no scheduler will read (and remove) the names made so far
            unlink_segments([obj])
            raise

    async def tokenize_one_request(self, obj):
        resolve_media(obj, self.model_config.dtype)  # every request is tokenized here, whatever its path
        return await tokenize(self, obj)

    async def handle_batch_request(self, obj, request=None):
        token = _PARALLEL_SAMPLING.set(getattr(obj, "parallel_sample_num", 1) > 1)  # this request's task
        try:
            async for out in (handle_grouped if groups_batch(obj) else handle)(self, obj, request):
                yield out
        finally:
            try:
                _PARALLEL_SAMPLING.reset(token)  # a caller that goes on in the same task (Engine.async_generate)
            except ValueError:  # closed from another context: that context never saw the flag
                pass

    def send_one_request(self, tokenized_obj):
        drop_copy_pixels(tokenized_obj, _PARALLEL_SAMPLING.get())
        return send(self, tokenized_obj)

    def send_batch_request(self, tokenized_objs):
        # 0.5.16's batch send pickles pixel tensors into the message (only `_send_one_request` moves them into shared
        # memory), a view of a multi-image prompt's tensor with its whole storage, once per image: move them as one
        # request's send does (a tensor already moved is left as it is), the requests side by side
        move_to_shared_memory(wrap_shm, tokenized_objs)
        return send_batch(self, tokenized_objs)  # (a failed send leaves its segments, as 0.5.16's own send does)

    cls._handle_batch_request, cls._send_one_request = handle_batch_request, send_one_request
    cls._send_batch_request = send_batch_request
    cls._tokenize_one_request = tokenize_one_request
    module.wrap_shm_features = wrap_shm  # what 0.5.16's `_send_one_request` calls by this module's global name


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


def _patch_receiver(module) -> None:
    cls = module.SchedulerRequestReceiver
    recv, finalize = cls.recv_requests, cls._finalize_shm_features
    memory = PixelMemory(int(os.environ.get(CACHE_ENV, DEFAULT_CACHE_MB)) << 20)
    threads = int(os.environ.get(RECEIVE_THREADS_ENV, DEFAULT_RECEIVE_THREADS))

    def recv_requests(self, *args, **kwargs):
        reqs = recv(self, *args, **kwargs)
        memory.fill(reqs)
        return reqs

    def finalize_shm_features(self, recv_reqs):
        # one scheduler rank: no other rank reads these segments, so 0.5.16's barrier before the unlinks
        # (`request_receiver.py:238-256`) has nothing to order; with more ranks, 0.5.16's own loop
        single_rank = not self.server_args.enable_dp_attention and self.ps.tp_size == 1
        if not (recv_reqs and single_rank and self.model_config.is_multimodal):
            return finalize(self, recv_reqs)
        with_segments = [req for req in _single_requests(recv_reqs) if module.has_shm_features([req])]
        if not materialize_side_by_side(module.unwrap_shm_features, with_segments, threads):
            return finalize(self, recv_reqs)  # (none or one request with segments: 0.5.16's loop, as before)

    cls.recv_requests, cls._finalize_shm_features = recv_requests, finalize_shm_features
    cls.miles_vl_pixel_memory = memory


# ---------------------------------------------------------------------------------------------------------------------
# the vision tower's CUDA graphs (module docstring)


def image_layout(grid_thw) -> tuple[tuple[int, int, int], ...]:
    """The (t, h, w) patch grids of a vision batch's images, in order: everything a captured graph bakes in (the
    attention's segment boundaries and longest segment) follows from it."""
    rows = grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw
    return tuple((int(t), int(h), int(w)) for t, h, w in rows)


def layout_patches(layout: tuple) -> int:
    return sum(t * h * w for t, h, w in layout)


class VisionGraphs:
    """Scheduler side: which vision batches replay a CUDA graph, one 0.5.16 `ViTCudaGraphRunner` per image layout.

    0.5.16's runner keeps its graphs by the batch's total patch count only: a batch with the same total but other
    image boundaries replays the boundaries captured first, and a larger batch replaces the rotary workspace every
    earlier graph still reads (sglang issue #29216; fixed upstream after 0.5.16 by sglang PR #37043). One runner per
    layout avoids both: it only ever sees one total and one set of boundaries. A layout is run eagerly the first time
    it is seen and captured the second time (a layout seen once, common with images of many sizes, costs no capture
    and no graph memory); at most `max_graphs` are kept, the least recently used dropped first, and batches of more
    than `max_patches` patches always run eagerly. The decisions depend only on the sequence of layouts; with tensor
    parallelism the graphs stay off (`_configure_vision_graphs`)."""

    def __init__(self, max_graphs: int, max_patches: int = VISION_GRAPH_MAX_PATCHES):
        self.max_graphs, self.max_patches = max_graphs, max_patches
        self.runners: collections.OrderedDict[tuple, object] = collections.OrderedDict()  # layout -> runner; LRU first
        self.seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()  # layouts run once, eagerly
        self.captured = self.replayed = self.eager = self.dropped = 0

    def runner(self, layout: tuple, make_runner):
        """The runner that replays `layout` (made with `make_runner()` when this is its second sighting), or None: run
        it eagerly."""
        runner = self.runners.get(layout)
        if runner is not None:
            self.runners.move_to_end(layout)
            self.replayed += 1
            return runner
        if layout not in self.seen:  # its first sighting (or forgotten since): remembered, run eagerly
            self.seen[layout] = None
            while len(self.seen) > 4 * self.max_graphs:
                self.seen.popitem(last=False)
            self.eager += 1
            return None
        if layout_patches(layout) > self.max_patches:
            self.eager += 1
            return None
        del self.seen[layout]
        if len(self.runners) >= self.max_graphs:
            self.runners.popitem(last=False)  # its graph and buffers are freed with it
            self.dropped += 1
        runner = self.runners[layout] = make_runner()
        self.captured += 1
        return runner


def _patch_vision(module) -> None:
    max_graphs = int(os.environ.get(VISION_GRAPHS_ENV, "0"))
    if max_graphs <= 0:
        return
    import torch  # the scheduler has it loaded

    cls = module.Qwen3VLMoeVisionModel
    eager_forward = cls.forward

    def reserved_mib(device) -> float:
        return torch.cuda.memory_reserved(device) / 2**20 if device.type == "cuda" else 0.0

    def forward(self, x, grid_thw):
        graphs = self.__dict__.get("miles_vl_graphs")
        if graphs is None:
            graphs = self.miles_vl_graphs = VisionGraphs(max_graphs)
        layout = image_layout(grid_thw)
        captured = graphs.captured
        runner = graphs.runner(layout, lambda: module.graph_runners_dict[self.device.type](self))
        if runner is None:
            return eager_forward(self, x, grid_thw)
        self.graph_runners = runner
        # 0.5.16's vision attention backends read SGLANG_VIT_ENABLE_CUDA_GRAPH at every call to take the runner's form
        # of the segment boundaries (`VisionFlash3Attention.forward`, srt/layers/attention/vision.py:516): on for this
        # call only, so that the first, eager batch of a layout runs as stock 0.5.16 does. The runner returns its own
        # output buffer, which its next replay overwrites: SGLang's embedding cache may keep views of what we return,
        # so it gets a tensor of its own (a copy of the merged tokens, microseconds).
        capturing = graphs.captured != captured
        reserved = reserved_mib(self.device) if capturing else 0.0
        os.environ[SGLANG_VIT_GRAPH_ENV] = "1"
        try:
            out = self.forward_with_cuda_graph(x, grid_thw).clone()
        finally:
            os.environ[SGLANG_VIT_GRAPH_ENV] = "0"
        if capturing:  # the memory the graph keeps: its pool and buffers (what a dropped graph gives back)
            log.info(
                "miles_vl: vision tower CUDA graph captured for %d images of %d patches (%d kept, %d dropped; "
                "+%.0f MiB reserved)",
                len(layout),
                layout_patches(layout),
                len(graphs.runners),
                graphs.dropped,
                reserved_mib(self.device) - reserved,
            )
        return out

    cls.forward = forward


def vision_graph_backend(mm_attention_backend: str | None, capability: tuple[int, int]) -> str | None:
    """The `--mm-attention-backend` under which the vision graphs run, or None where they cannot: 0.5.16's runner
    needs the flag set (it reads the server argument, not the backend the vision model chose) and supports fa3 and
    triton_attn. Unset, it is set to what 0.5.16 would choose on this GPU anyway (`VisionAttention.
    _determine_attention_backend`: fa3 on SM 9.x, fa4 on SM 10.x but 10.3, triton_attn otherwise), so the numerics
    do not change."""
    if mm_attention_backend is None:
        major, minor = capability
        mm_attention_backend = "fa3" if major == 9 else "fa4" if major == 10 and minor != 3 else "triton_attn"
    return mm_attention_backend if mm_attention_backend in ("fa3", "triton_attn") else None


def _configure_vision_graphs(server_args) -> None:
    """In the launching process, before SGLang starts a child (they inherit the environment and the arguments)."""
    if os.environ.get(SGLANG_VIT_GRAPH_ENV, "0").lower() not in ("0", "false", ""):
        log.warning(
            "miles_vl: %s=1 ignored: 0.5.16's vision graphs replay wrong image boundaries and rotary tables "
            "(miles_vl.sglang_launch.VisionGraphs); %s sets miles_vl's",
            SGLANG_VIT_GRAPH_ENV,
            VISION_GRAPHS_ENV,
        )
    # set here, so that the scheduler only ever changes the value of a variable that exists (native threads may read
    # the environment while `forward` sets it: a new variable can move glibc's environ array under them)
    os.environ[SGLANG_VIT_GRAPH_ENV] = "0"
    if int(os.environ.get(VISION_GRAPHS_ENV, "0")) <= 0:
        return
    why_not = None
    if getattr(server_args, "enable_deterministic_inference", False):
        why_not = "--enable-deterministic-inference (a layout's first, eager batch and its replays may round apart)"
    elif (getattr(server_args, "tp_size", 1) or 1) > 1:
        why_not = (
            f"--tp-size {server_args.tp_size} (each capture registers its buffers with the custom all-reduce of every "
            "rank, and a dropped graph's registrations are never undone; not measured)"
        )
    else:
        import torch

        capability = torch.cuda.get_device_capability(getattr(server_args, "base_gpu_id", 0) or 0)
        backend = vision_graph_backend(server_args.mm_attention_backend, capability)
        if backend is None:
            name = server_args.mm_attention_backend or "this GPU's"
            why_not = f"--mm-attention-backend {name} (0.5.16's graph runner takes fa3 or triton_attn)"
        else:
            server_args.mm_attention_backend = backend
            # The graph path's position embeddings (`Qwen3VLMoeVisionModel._prepare_graph_inputs` ->
            # `fast_pos_embed_interpolate`) sample the table at half-pixel centres unless this flag is on, while the
            # eager tower (and transformers, which the trainer runs) samples it with `linspace` (align corners); the
            # flag is read nowhere else in 0.5.16 (`srt/models/qwen3_vl.py:329`, `:464`).
            server_args.enable_precise_embedding_interpolation = True
    if why_not:
        os.environ[VISION_GRAPHS_ENV] = "0"
        log.warning("miles_vl: the vision tower runs without CUDA graphs here: %s", why_not)


PATCHES = {TOKENIZER_MODULE: _patch_tokenizer, RECEIVER_MODULE: _patch_receiver, VISION_MODULE: _patch_vision}


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


def install() -> None:
    """Patch the SGLang modules of this process when they are imported (or now, if they already are)."""
    pending = {}
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            pending[name] = patch
    if pending:  # runs once per process (module docstring); another PatchOnImport (the bench's timing) is chained
        sys.meta_path.insert(0, PatchOnImport(pending))


def main(argv: list[str]) -> None:
    """`python -m sglang.launch_server ARGV` with the patches (installed before: `install()`)."""
    from sglang.launch_server import run_server  # after the hook, so that SGLang's modules get patched
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    if blockers := sharing_blockers(server_args):  # before SGLang starts any child: they inherit the environment
        os.environ[ENABLED_ENV] = "0"
        log.warning("miles_vl: the n copies of a prompt keep their own pixel values here: %s", "; ".join(blockers))
    _configure_vision_graphs(server_args)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


# In the launching process (`__main__`) and in every process SGLang starts with `spawn`, which runs the parent's main
# module as `__mp_main__` before the child's target; importing this module elsewhere (tests) installs nothing.
if __name__ in ("__main__", "__mp_main__"):
    install()

if __name__ == "__main__":
    main(sys.argv[1:])
