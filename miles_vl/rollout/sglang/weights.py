"""Weight sync trainer -> SGLang: byte-bounded buckets and the exact call sequences of both paths.

Colocated (trainer and engine share GPUs) — `sync_weights_from_tensors` (or, for buckets that arrive one at a time,
`send_tensor_bucket` per bucket then `finish_tensor_sync`), per engine:

    for each bucket:  POST /update_weights_from_tensor  {serialized_named_tensors: [payload_rank0, ...],
                                                         load_format: null, flush_cache: false}
    POST /update_weight_version {new_version}          # responses now carry meta_info.weight_version = version
    POST /flush_cache?timeout=...                       # drop the prefix cache computed with the old weights

A payload is base64 of a `multiprocessing.reduction.ForkingPickler` dump of `[(name, tensor), ...]`: for CUDA
tensors only an IPC handle crosses, the server maps the memory and copies it (0.5.16: `TpModelWorker.
update_weights_from_tensor` in `python/sglang/srt/managers/tp_worker.py` indexes the list by TP rank and
deserializes with `MultiprocessingSerializer` from `python/sglang/srt/utils/common.py`, under a `SafeUnpickler`
allowlist that admits `torch.*` and `multiprocessing.resource_sharer.*`). The device of a CUDA tensor is written as
its GPU UUID, not its index, because the trainer and the server see different `CUDA_VISIBLE_DEVICES`; 0.5.16's
`monkey_patch_torch_reductions` (`python/sglang/srt/utils/patch_torch.py`) accepts either on the receiving side.
The sender must keep the tensors alive until the call returns (it does: the bucket is held during the call). SGLang's
`load_format="flattened_bucket"` (one tensor per bucket, `python/sglang/srt/weight_sync/tensor_bucket.py`) is not
used: its metadata class lives in sglang, which the trainer need not import.

Disaggregated (engines on their own GPUs) — `DistributedWeightSender`, trainer rank 0 of a group of
`1 + sum(tp_size)` ranks:

    init_group():  every engine  POST /init_weights_update_group {master_address, master_port,
                                     rank_offset, world_size, group_name, backend}     } concurrently: all
                   trainer       joins the same group as rank 0 (rendezvous at tcp://master:port)  } block until formed
    send():  for each bucket:   every engine POST /update_weights_from_distributed {names, dtypes, shapes,
                                     group_name, flush_cache: false}  (in threads) while the trainer broadcasts each
                                     tensor of the bucket, in order, from rank 0; then the POSTs return
             every engine:      POST /update_weight_version, POST /flush_cache
    close(): every engine POST /destroy_weights_update_group  } concurrently (NCCL teardown waits for peers)
             the trainer destroys its group                     }

0.5.16 receives one `torch.distributed.broadcast(src=0)` per tensor in list order into freshly allocated tensors
(`WeightUpdater.update_weights_from_distributed` in `python/sglang/srt/model_executor/model_runner_components/
weight_updater.py`) and builds the group with `init_custom_process_group` (`python/sglang/srt/utils/common.py`):
rendezvous on `tcp://master_address:master_port`, a `PrefixStore(group_name)`, then torch's
`_new_process_group_helper`. `init_trainer_group` does the same on the trainer side so the store keys agree.

Buckets bound the bytes in flight (and the server's temporary allocation): a bucket closes before the tensor that
would push it past `max_bucket_bytes`; a single tensor larger than the bound travels alone.
"""

from __future__ import annotations

import base64
import io
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import Tensor

from miles_vl.rollout.sglang.client import SGLangClient, SGLangError

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class TensorMeta:
    """What `/update_weights_from_distributed` needs to know about one tensor before receiving it."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16" (the server calls getattr(torch, ...))
    shape: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, name: str, tensor: Tensor) -> TensorMeta:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape), tensor.numel() * tensor.element_size())


@dataclass(frozen=True)
class SyncReport:
    """What one weight sync moved."""

    buckets: int
    tensors: int
    bytes: int
    seconds: float
    weight_version: str
    verified: tuple[str, ...] = ()  # tensors whose landing the server confirmed (colocated syncs, see verify.py)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------------------------
# bucket planning


def plan_buckets(metas: Sequence[TensorMeta], max_bucket_bytes: int) -> list[list[TensorMeta]]:
    """Split tensors, in order, into buckets of at most `max_bucket_bytes` (a larger tensor goes alone).

    Args:
        metas: tensors in sync order.
        max_bucket_bytes: bound of one bucket.

    Returns:
        Consecutive runs of `metas`; concatenated they are `metas`.
    """
    _check_bound(max_bucket_bytes)
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for meta in metas:
        if current and size + meta.nbytes > max_bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        buckets.append(current)
    return buckets


def iter_buckets(
    named_tensors: Iterable[tuple[str, Tensor]], max_bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """`plan_buckets` over a stream: holds one bucket at a time, so a lazy exporter never materializes the model.

    Yields:
        Lists of (name, tensor), the same grouping `plan_buckets` gives for the same tensors.
    """
    _check_bound(max_bucket_bytes)
    current: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bucket_bytes:
            yield current
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        yield current


def _check_bound(max_bucket_bytes: int) -> None:
    if max_bucket_bytes <= 0:
        raise ValueError(f"max_bucket_bytes must be > 0, found {max_bucket_bytes}")


# ---------------------------------------------------------------------------------------------------------------------
# colocated: update_weights_from_tensor


def serialize_named_tensors(named_tensors: Sequence[tuple[str, Tensor]]) -> str:
    """Base64 of a ForkingPickler dump of `[(name, tensor), ...]`, CUDA devices written as GPU UUIDs.

    CPU tensors are shared through file descriptors, which only a process that can reach ours (e.g. a thread of this
    process) can open: that is what the CPU tests do. A real SGLang server needs CUDA tensors.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    # ForkingPickler copies its reducers into this instance's dispatch_table: override here, not globally.
    for cls in list(pickler.dispatch_table):
        if isinstance(cls, type) and issubclass(cls, torch.Tensor):
            pickler.dispatch_table[cls] = _reduce_tensor_with_uuid
    pickler.dump([(str(name), tensor) for name, tensor in named_tensors])
    return base64.b64encode(buf.getvalue()).decode("ascii")


_CUDA_DEVICE_ARG = 6  # position of `storage_device` in torch.multiprocessing.reductions.rebuild_cuda_tensor's args


def _reduce_tensor_with_uuid(tensor: Tensor):
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if getattr(rebuild, "__name__", "") == "rebuild_cuda_tensor":
        device = args[_CUDA_DEVICE_ARG]
        if not isinstance(device, int):
            raise TypeError(
                f"torch {torch.__version__} changed rebuild_cuda_tensor's arguments (device slot holds "
                f"{device!r}); update _CUDA_DEVICE_ARG in miles_vl/rollout/sglang/weights.py"
            )
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1 :])
    return rebuild, args


def sync_weights_from_tensors(
    client: SGLangClient,
    named_tensors: Iterable[tuple[str, Tensor]],
    *,
    weight_version: str,
    tp_size: int = 1,
    max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    device: torch.device | str | None = None,
    flush_timeout_s: float = 60.0,
) -> SyncReport:
    """The colocated sync of one engine (sequence in the module docstring).

    Args:
        client: the engine's server.
        named_tensors: HF-named tensors, possibly a lazy iterator.
        weight_version: label set after the last bucket.
        tp_size: the server's TP size (one payload per rank, each its own dump of the same tensors: every rank
            loads the full tensors and keeps its shard).
        max_bucket_bytes: bound of one bucket.
        device: move tensors here before serializing (e.g. "cuda" in an engine actor); None keeps them.
        flush_timeout_s: how long `/flush_cache` may wait for running requests.

    Returns:
        A `SyncReport`.

    Raises:
        ValueError: no tensors at all.
        SGLangError: a call failed (the message says which and why).
    """
    start = time.monotonic()
    buckets = tensors = nbytes = 0
    for bucket in iter_buckets(named_tensors, max_bucket_bytes):
        nbytes += send_tensor_bucket(client, bucket, tp_size=tp_size, device=device)
        buckets += 1
        tensors += len(bucket)
        del bucket  # the server has copied the tensors; release our references (and IPC-shared blocks) early
    if buckets == 0:
        raise ValueError("no tensors to sync: named_tensors was empty")
    finish_tensor_sync(client, weight_version=weight_version, flush_timeout_s=flush_timeout_s)
    return SyncReport(buckets, tensors, nbytes, time.monotonic() - start, weight_version)


def send_tensor_bucket(
    client: SGLangClient,
    bucket: Sequence[tuple[str, Tensor]],
    *,
    tp_size: int = 1,
    device: torch.device | str | None = None,
) -> int:
    """One `/update_weights_from_tensor` call of the colocated sync: the tensors of one bucket.

    Callers that stream buckets (the driver hands them over one at a time) call this per bucket and
    `finish_tensor_sync` after the last one; `sync_weights_from_tensors` does both.

    Args:
        client: the engine's server.
        bucket: HF-named tensors (e.g. one bucket of `iter_buckets`).
        tp_size: the server's TP size (one payload per rank).
        device: move tensors here before serializing; None keeps them.

    Returns:
        Bytes sent.
    """
    if device is not None:
        bucket = [(name, t.to(device, non_blocking=True)) for name, t in bucket]
        if torch.device(device).type == "cuda":
            torch.cuda.current_stream().synchronize()  # the copies must land before the server maps them
    # One dump per TP rank: each dump registers its own sharing handles (CUDA IPC reference counts, CPU file
    # descriptors), and a handle must not be consumed by two receiving processes.
    payloads = [serialize_named_tensors(bucket) for _ in range(tp_size)]
    client.update_weights_from_tensor(payloads, flush_cache=False)
    return sum(t.numel() * t.element_size() for _, t in bucket)


def finish_tensor_sync(client: SGLangClient, *, weight_version: str, flush_timeout_s: float = 60.0) -> None:
    """End of a colocated sync: label the weights `weight_version`, then drop the prefix cache of the old ones."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
    client.update_weight_version(weight_version)
    client.flush_cache(timeout_s=flush_timeout_s)


# ---------------------------------------------------------------------------------------------------------------------
# disaggregated: update_weights_from_distributed


@dataclass(frozen=True)
class EngineEndpoint:
    """One engine as the trainer sees it for the NCCL path."""

    client: SGLangClient
    tp_size: int = 1


def group_layout(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Rank offsets of the engines in the weight-update group and its world size (rank 0 is the trainer).

    Returns:
        (rank_offsets, world_size), e.g. tp_sizes [2, 2] -> ([1, 3], 5).
    """
    offsets, next_rank = [], 1
    for tp in tp_sizes:
        if tp < 1:
            raise ValueError(f"an engine's tp_size must be >= 1, found {tp}")
        offsets.append(next_rank)
        next_rank += tp
    return offsets, next_rank


def init_trainer_group(
    *, master_address: str, master_port: int, world_size: int, group_name: str, backend: str, timeout_s: float
):
    """Join the weight-update group as rank 0, the way SGLang 0.5.16's `init_custom_process_group` builds it.

    Uses torch's private `_new_process_group_helper` (what SGLang uses on its side): a group independent of the
    trainer's default process group, so it works whether or not `torch.distributed` is initialized.

    Returns:
        The process group.
    """
    from torch.distributed import distributed_c10d as c10d

    missing = [n for n in ("rendezvous", "PrefixStore", "_new_process_group_helper", "_world") if not hasattr(c10d, n)]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} lacks torch.distributed.distributed_c10d.{missing}, which the NCCL weight "
            "sync uses to build a group independent of the default one; use the torch version SGLang pins (2.11)"
        )
    timeout = timedelta(seconds=timeout_s)
    store, rank, _ = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {r: r for r in range(world_size)}  # group rank == "global" rank, as SGLang
    return group


class DistributedWeightSender:
    """Trainer rank 0's side of the NCCL weight sync to a set of SGLang engines (sequence in the module docstring).

    Args:
        engines: the engines, each with its client and TP size.
        master_address: address of this process that the engines can reach (the group's rendezvous).
        master_port: a free port on it.
        group_name: the group's name on both sides.
        backend: "nccl" (tensors on CUDA) or "gloo" (tensors on CPU; tests).
        max_bucket_bytes: bound of one bucket.
        flush_timeout_s: how long `/flush_cache` may wait for running requests.
        timeout_s: the group's timeout (rendezvous and every collective).
    """

    def __init__(
        self,
        engines: Sequence[EngineEndpoint],
        *,
        master_address: str,
        master_port: int,
        group_name: str = "miles_vl_weight_sync",
        backend: str = "nccl",
        max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flush_timeout_s: float = 60.0,
        timeout_s: float = 600.0,
    ):
        if not engines:
            raise ValueError("DistributedWeightSender needs at least one engine")
        _check_bound(max_bucket_bytes)
        self.engines = list(engines)
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.backend = backend
        self.max_bucket_bytes = max_bucket_bytes
        self.flush_timeout_s = flush_timeout_s
        self.timeout_s = timeout_s
        self.rank_offsets, self.world_size = group_layout([e.tp_size for e in self.engines])
        self.group = None
        self._pool = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="sglang-weights")

    def init_group(self) -> None:
        """Form the group: every engine's POST and the trainer's own join run concurrently (all block until then)."""
        if self.group is not None:
            raise RuntimeError(f"weight-update group {self.group_name!r} is already initialized")
        futures = [
            self._pool.submit(
                e.client.init_weights_update_group,
                master_address=self.master_address,
                master_port=self.master_port,
                rank_offset=offset,
                world_size=self.world_size,
                group_name=self.group_name,
                backend=self.backend,
            )
            for e, offset in zip(self.engines, self.rank_offsets, strict=True)
        ]
        self.group = init_trainer_group(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
            timeout_s=self.timeout_s,
        )
        self._wait(futures, "init_weights_update_group")
        log.info("weight-update group %r formed: %d ranks", self.group_name, self.world_size)

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], *, weight_version: str) -> SyncReport:
        """Send all tensors bucket by bucket, then label the version and flush every engine's cache.

        Args:
            named_tensors: HF-named tensors on the group's device (CUDA for nccl, CPU for gloo), possibly lazy.
            weight_version: label the engines report from now on.

        Returns:
            A `SyncReport`.

        Raises:
            RuntimeError: `init_group` was not called.
            SGLangError: an engine refused a call; the engines' weights are then partially updated.
        """
        if self.group is None:
            raise RuntimeError("call init_group() before send(): the engines have not joined the weight-update group")
        start = time.monotonic()
        buckets = tensors = nbytes = 0
        for bucket in iter_buckets(named_tensors, self.max_bucket_bytes):
            metas = [TensorMeta.of(name, t) for name, t in bucket]
            futures = [
                self._pool.submit(
                    e.client.update_weights_from_distributed,
                    names=[m.name for m in metas],
                    dtypes=[m.dtype for m in metas],
                    shapes=[m.shape for m in metas],
                    group_name=self.group_name,
                    flush_cache=False,
                )
                for e in self.engines
            ]
            for _, tensor in bucket:
                self._raise_early(futures)  # an engine that refused at once will never join this broadcast
                torch.distributed.broadcast(tensor.contiguous(), src=0, group=self.group)
            self._wait(futures, "update_weights_from_distributed")
            buckets += 1
            tensors += len(metas)
            nbytes += sum(m.nbytes for m in metas)
        if buckets == 0:
            raise ValueError("no tensors to sync: named_tensors was empty")
        for e in self.engines:
            e.client.update_weight_version(weight_version)
            e.client.flush_cache(timeout_s=self.flush_timeout_s)
        return SyncReport(buckets, tensors, nbytes, time.monotonic() - start, weight_version)

    def close(self) -> None:
        """Leave the group on every engine and here, concurrently: tearing down an NCCL communicator waits for its
        peers, so an engine's destroy returns only once the trainer destroys its side too. Engines that are gone
        are skipped with a warning."""
        if self.group is not None:
            futures = [self._pool.submit(e.client.destroy_weights_update_group, self.group_name) for e in self.engines]
            torch.distributed.destroy_process_group(self.group)
            self.group = None
            for e, f in zip(self.engines, futures, strict=True):
                try:
                    f.result()
                except SGLangError as err:
                    log.warning("could not destroy the weight-update group on %s: %s", e.client.base_url, err)
        self._pool.shutdown(wait=True)

    def _raise_early(self, futures: list[Future]) -> None:
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def _wait(self, futures: list[Future], what: str) -> None:
        errors = []
        for e, f in zip(self.engines, futures, strict=True):
            try:
                f.result()
            except Exception as err:  # collect every engine's failure, then raise one error naming them all
                errors.append(f"{e.client.base_url}: {err}")
        if errors:
            raise SGLangError(f"{what} failed on {len(errors)} engine(s):\n" + "\n".join(errors))
