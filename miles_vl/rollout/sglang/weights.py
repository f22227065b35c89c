"""SGLang's side of the weight sync: its wire (the tensor payload, the HTTP endpoints) and trainer rank 0's NCCL group.

The engine-agnostic parts (buckets, the bound of one bucket, the colocated and disaggregated strategies the driver
runs) are in miles_vl/rollout/weight_sync.py; orchestration/factories.py's engine table hands `open_trainer_group`
and the `rollout.sglang.*` timeouts to them (`weight_sync.GroupSync`).

The tensor path (colocated), per engine, called by the sglang engine (`SGLangRolloutEngine.load_weight_bucket`):

    for each bucket:  POST /update_weights_from_tensor  {serialized_named_tensors: [payload_rank0, ...],
                                                         load_format: null, flush_cache: false}   # send_tensor_bucket
    POST /update_weight_version {new_version}          # responses now carry meta_info.weight_version = version
    POST /flush_cache?timeout=...                       # drop the prefix cache computed with the old weights
                                                        # (the last two: finish_tensor_sync)

A payload is base64 of a `multiprocessing.reduction.ForkingPickler` dump of `[(name, tensor), ...]`: for CUDA
tensors only an IPC handle crosses, the server maps the memory and copies it (0.5.16: `TpModelWorker.
update_weights_from_tensor` in `python/sglang/srt/managers/tp_worker.py` indexes the list by TP rank and
deserializes with `MultiprocessingSerializer` from `python/sglang/srt/utils/common.py`, under a `SafeUnpickler`
allowlist that admits `torch.*` and `multiprocessing.resource_sharer.*`). The device of a CUDA tensor is written as
its GPU UUID, not its index, because the trainer and the server see different `CUDA_VISIBLE_DEVICES`; 0.5.16's
`monkey_patch_torch_reductions` (`python/sglang/srt/utils/patch_torch.py`) accepts either on the receiving side.
The sender must keep the tensors alive until the call returns (it does: the bucket is held during the call). SGLang's
`load_format="flattened_bucket"` is what the colocated IPC path below uses.

The colocated IPC path (`ColocatedWeightSender`, formed by `open_colocated_sender` inside every trainer rank, the
default for colocated jobs: `rollout.sglang.colocated_sync=ipc`): no weight byte passes through the CPU or Ray's
object store. Every train rank exports on its GPU (the export is collective: each rank gets the full tensors); each
rank that shares a GPU with a TP rank of a server (`ipc_sources`: engine e's TP rank r runs on the r-th GPU of its
CUDA_VISIBLE_DEVICES, `EngineAddress.gpu_ids`) packs each bucket into one of two persistent flat buffers on that GPU
(`weight_sync.pack_bucket`); rank 0 gathers the handles and POSTs, per engine and bucket, one
`/update_weights_from_tensor` with `load_format="flattened_bucket"` whose payload r is a CUDA IPC handle of the buffer
on TP rank r's own GPU and the entries' metadata (`serialize_flat_bucket`). A TP rank cannot use another GPU's buffer:
the first 8B run handed rank 0's buffer to every TP rank of two TP-2 engines, and the engine on GPUs 2-3 refused it
("Invalid device_uuid") while TP rank 1 on GPU 1 died copying from it ("CUDA error: invalid argument";
docs/gpu-runs/2026-11-27-loop-8b-tp2cp2-ipc-fail-4xh200). The ranks go bucket by bucket in lock step over the
trainer's process group (`DistExchange`): rank 0 fences the bucket's buffer slot and broadcasts go, or stop after an
error (the others then only consume their export), the packing ranks serialize, rank 0 gathers; a rank that fails to
pack says so in the gather, so an error on any rank ends the sync on every rank, never a hang. The last bucket's request
carries `weight_version` and `flush_cache: true` (0.5.16's
`TokenizerControlMixin.update_weights_from_tensor` labels the version after a successful load; the scheduler flushes
after it, `flush_cache_after_weight_update`), so a sync is `buckets` requests and nothing else. 0.5.16 rebuilds the
bucket in `WeightUpdater._update_weights_from_flattened_bucket` (`model_runner_components/weight_updater.py`): it reads
`flattened_tensor` and, per entry, the attributes name, shape, dtype, start_idx, end_idx, numel, and loads the views
`flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape)` with the model's `load_weights`; the entries travel as
`types.SimpleNamespace` (its allowlist admits `types.`; sglang's own `FlattenedTensorMetadata` would need sglang on the
trainer). The requests of two buckets may be in flight at once (and arrive in either order); the last one is sent only
after every earlier one answered, so the version label and the flush follow the whole sync. A buffer is written again
only after every engine answered the request that read it (`_fence`). The answer comes once the server's
`load_weights` has enqueued its copies from the buffer on its stream; 0.5.16 does not synchronize that stream before
answering, so the fence is the answer, not the copies' completion: those copies are alone on an idle stream (generate
is refused during a sync; 512 MiB copy in about half a millisecond) while the answer's way back (scheduler, tokenizer
manager, HTTP) takes longer. A strict fence needs a server-side event (not in
0.5.16). The buffers are plain allocations of the train process's CUDA caching allocator, which no memory saver
manages (SGLang's torch_memory_saver pauses only the server process's own regions; the trainer runs none), sized to
the bucket bound and grown for a single larger tensor; they stay allocated for the job (2 x 512 MiB on the GPU of
each trainer rank that shares one with a server). Names are checked on every sync and values (`/weights_checker`,
verify.py) on the first sync after the
sender formed (the job's first, and the first after a relaunch: `repair` forms it again), then every
`rollout.sglang.verify_weights_every`-th (`weight_sync.verify_due`).

The NCCL path (disaggregated), trainer rank 0 of a group of `1 + sum(tp_size)` ranks (`DistributedWeightSender`,
formed by `open_trainer_group` inside the train actor):

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

A failed or stalled NCCL sync never hangs (issue 32.2). Every bucket has a deadline (`weight_sync.bucket_timeout_s`:
`rollout.sglang.sync_timeout_s`, or 60 s + its bytes at 50 MiB/s). The trainer enqueues a bucket's broadcasts with
`async_op=True` and waits for them while it watches the engines' HTTP answers and the deadline: an engine's 4xx/5xx, a
dead server (connection refused) or the deadline ends the sync with one `SGLangError` naming the endpoint and the
server's message, and the group is aborted and marked broken (`close` then neither posts
`/destroy_weights_update_group`, whose NCCL teardown would wait for the broken peer, nor destroys the group here). Each
group gets a fresh name, so a server that still holds a broken group can join the next one. A thread backs this up for a
trainer stuck inside a C call (NCCL's blocking communicator init in the first broadcast): past the deadline plus
`weight_sync.ABORT_GRACE_S` it aborts the group, and if the call still has not returned after as long again, it writes
the error to stderr and ends the process, so Ray reports the train actor dead instead of waiting. Before a group forms
over NCCL, `check_cumem_agrees` refuses servers whose NCCL_CUMEM_ENABLE differs from the trainer's (issue 32.1).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import io
import logging
import os
import socket
import sys
import threading
import time
import types
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
from torch import Tensor

from miles_vl.gpu_env import CUMEM_ENV
from miles_vl.rollout.sglang.client import RequestPolicy, SGLangClient, SGLangError
from miles_vl.rollout.sglang.verify import SyncVerifier, checkpoint_names
from miles_vl.rollout.weight_sync import (
    ABORT_GRACE_S,
    DEFAULT_BUCKET_BYTES,
    IPC_SYNC_BUFFERS,
    SYNC_BYTES_PER_S,
    SYNC_FLOOR_S,
    FlatEntry,
    PhaseClock,
    SyncReport,
    TensorMeta,
    bucket_timeout_s,
    check_bucket_bytes,
    flat_layout,
    iter_buckets,
    pack_bucket,
    verify_due,
)

log = logging.getLogger(__name__)

_ABANDONED_GROUPS: list = []  # weight-update groups broken by a failed sync (`DistributedWeightSender.close`)
_POLL_S = 0.01  # how often the wait for one broadcast looks at it (torch's Work has no completion callback on CPU)

__all__ = [
    "ColocatedWeightSender",
    "DistExchange",
    "DistributedWeightSender",
    "EngineAddress",
    "EngineEndpoint",
    "GroupRendezvous",
    "check_cumem_agrees",
    "finish_tensor_sync",
    "group_layout",
    "init_trainer_group",
    "ipc_sources",
    "open_colocated_sender",
    "open_trainer_group",
    "send_tensor_bucket",
    "serialize_flat_bucket",
    "serialize_named_tensors",
]


# ---------------------------------------------------------------------------------------------------------------------
# the tensor path: update_weights_from_tensor


def serialize_named_tensors(named_tensors: Sequence[tuple[str, Tensor]]) -> str:
    """Base64 of a ForkingPickler dump of `[(name, tensor), ...]`, CUDA devices written as GPU UUIDs.

    CPU tensors are shared through file descriptors, which only a process that can reach ours (e.g. a thread of this
    process) can open: that is what the CPU tests do. A real SGLang server needs CUDA tensors.
    """
    return _serialize([(str(name), tensor) for name, tensor in named_tensors])


def serialize_flat_bucket(flat: Tensor, entries: Sequence[FlatEntry]) -> str:
    """The payload of one `load_format="flattened_bucket"` request (module docstring): base64 of a ForkingPickler dump
    of `{"flattened_tensor": flat, "metadata": [entry, ...]}`, each entry a `types.SimpleNamespace` with the
    attributes 0.5.16's `FlattenedTensorMetadata` has (byte offsets into `flat`). One call per receiving TP rank."""
    metadata = [
        types.SimpleNamespace(
            name=e.name,
            shape=torch.Size(e.shape),
            dtype=e.dtype,
            start_idx=e.start,
            end_idx=e.start + e.nbytes,
            numel=e.nbytes,
        )
        for e in entries
    ]
    return _serialize({"flattened_tensor": flat, "metadata": metadata})


def _serialize(obj) -> str:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    # ForkingPickler copies its reducers into this instance's dispatch_table: override here, not globally.
    for cls in list(pickler.dispatch_table):
        if isinstance(cls, type) and issubclass(cls, torch.Tensor):
            pickler.dispatch_table[cls] = _reduce_tensor_with_uuid
    pickler.dump(obj)
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


def send_tensor_bucket(
    client: SGLangClient,
    bucket: Sequence[tuple[str, Tensor]],
    *,
    tp_size: int = 1,
    device: torch.device | str | None = None,
) -> int:
    """One `/update_weights_from_tensor` call of the colocated sync: the tensors of one bucket.

    The sglang engine calls this per bucket of a sync and `finish_tensor_sync` after the last one.

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
# the colocated IPC path, trainer rank 0's side: flat buckets, one IPC handle per bucket


class RankExchange(Protocol):
    """How the trainer ranks of a colocated sync agree, bucket by bucket (`DistExchange`; tests: threads)."""

    rank: int
    world: int

    def broadcast(self, obj: object) -> object:
        """Rank 0's `obj` on every rank."""
        ...

    def gather(self, obj: object) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        ...


_EXCHANGE_GROUP: list = []  # the gloo group of every trainer rank, made once per process (`DistExchange.current`)


@dataclass(frozen=True)
class DistExchange:
    """`RankExchange` of the trainer's ranks over a gloo group of torch.distributed's default group (one rank: no
    collective). Gloo, not the trainer's NCCL: the objects are small, and a rank that waits here (for rank 0, while the
    servers copy on these GPUs) runs no kernel on its GPU, and a wait past the group's timeout raises instead of
    aborting the process."""

    rank: int = 0
    world: int = 1
    group: object = None

    @classmethod
    def current(cls) -> DistExchange:
        """This rank's exchange; collective the first time in a process of several ranks (every rank calls it)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        if not _EXCHANGE_GROUP:
            _EXCHANGE_GROUP.append(dist.new_group(backend="gloo"))
        return cls(dist.get_rank(), dist.get_world_size(), _EXCHANGE_GROUP[0])

    def broadcast(self, obj: object) -> object:
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: object) -> list | None:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def all_gather(self, obj: object) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


def ipc_sources(
    engines: Sequence[EngineAddress], trainer_gpus: Sequence[tuple[str, str] | None], *, cuda: bool = True
) -> list[list[int]]:
    """Which trainer rank hands each engine's TP rank its buffer: `sources[e][r]` is the trainer rank on the GPU of
    engine e's TP rank r. Each TP rank of a server maps the handle on its own GPU and copies from it, so the buffer must
    live there: rank 0's buffer handed to every TP rank of every engine failed on the first 8B run (an engine on other
    GPUs refused it, "Invalid device_uuid"; TP rank 1 on the next GPU died copying from it, "CUDA error: invalid
    argument": docs/gpu-runs/2026-11-27-loop-8b-tp2cp2-ipc-fail-4xh200). SGLang's TP rank r runs on the r-th GPU of
    its server's CUDA_VISIBLE_DEVICES (`EngineAddress.gpu_ids`).

    Args:
        engines: the engines, in engine order.
        trainer_gpus: (node IP, Ray's GPU id) of each trainer rank, in rank order; None: not known.
        cuda: the trainer runs on GPUs; False (a CPU job: the buffers are shared memory, which every process of the
            node maps): every entry is rank 0.

    Returns:
        `sources[e][r]` for every engine e and TP rank r.

    Raises:
        ValueError: a trainer rank whose GPU is unknown, a TP rank on a GPU no trainer rank holds, or an engine whose
            GPUs are unknown, naming it and the fix.
    """
    if not cuda:
        return [[0] * e.tp_size for e in engines]
    unknown = [k for k, gpu in enumerate(trainer_gpus) if gpu is None]
    if unknown:
        raise ValueError(
            f"trainer ranks {unknown} run on CUDA but hold no single GPU of Ray's (Ray's accelerator ids), so the "
            "colocated IPC weight sync cannot tell which server TP ranks share their GPUs; run the trainer as Ray "
            "actors of one GPU each (as miles-vl does), or set rollout.sglang.colocated_sync=tensor"
        )
    where: dict[tuple[str, str], int] = {}
    for k, gpu in enumerate(trainer_gpus):
        if gpu is not None:
            where.setdefault(gpu, k)
    sources, missing = [], []
    for i, e in enumerate(engines):
        gpus = list(e.gpu_ids or ())
        if len(gpus) != e.tp_size:
            raise ValueError(
                f"colocated engine {i} ({e.url}) reports GPUs {gpus or 'none'} for its {e.tp_size} TP rank(s), so the "
                "colocated IPC weight sync cannot tell which trainer rank shares each of its GPUs; set "
                "rollout.sglang.colocated_sync=tensor"
            )
        ranks = [where.get((e.node_ip, g)) for g in gpus]
        missing += [
            f"engine {i} TP rank {r} (GPU {g} of {e.node_ip})"
            for r, (g, k) in enumerate(zip(gpus, ranks, strict=True))
            if k is None
        ]
        sources.append(ranks)
    if missing:
        raise ValueError(
            f"the colocated IPC weight sync needs a trainer rank on every GPU of every engine, but none runs on "
            f"{'; '.join(missing)} (the trainer's GPUs: {sorted({g for g in trainer_gpus if g is not None})}); "
            "colocated engines take the trainer's GPUs (placement.engine_slots), or set "
            "rollout.sglang.colocated_sync=tensor"
        )
    return sources


class ColocatedWeightSender:
    """One trainer rank's part of the colocated sync to SGLang servers on its node (sequence in the module docstring):
    a `weight_sync.WeightGroup` whose `send` packs buckets into persistent flat buffers on this rank's GPU and, on
    rank 0, hands each server's TP rank one IPC handle per bucket, of the buffer on its own GPU (`ipc_sources`).

    Every rank of the trainer runs `send` on the same export, bucket by bucket in lock step (`exchange`): rank 0
    fences the bucket's buffer slot and says go (or stop, after an error: the other ranks then only consume their
    export, which is collective), the ranks that hold a TP rank's GPU pack and serialize, rank 0 gathers the handles
    and posts one request per engine.

    Args:
        engines: the engines, each with its client and TP size (rank 0's; other ranks post nothing).
        known_names: the tensor names of the checkpoint the servers loaded (`verify.checkpoint_names`); None:
            unchecked.
        max_bucket_bytes: bound of one bucket (and the size of each buffer).
        verify_every: the value check runs on the first sync, then every this many (0: only the first).
        device: where the buffers live; None: this process's current GPU, else the CPU (tests: CPU tensors travel
            as file descriptors, which a stand-in server of this host can open).
        buffers: how many buffers rotate (2: one bucket packs while the servers copy the other).
        sources: `ipc_sources`: the trainer rank whose buffer each engine's TP rank maps; None: this rank's for all.
        exchange: the trainer's ranks (`DistExchange`); None: this rank alone.
    """

    def __init__(
        self,
        engines: Sequence[EngineEndpoint],
        *,
        known_names: frozenset[str] | None = None,
        max_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        verify_every: int = 10,
        device: torch.device | str | None = None,
        buffers: int = IPC_SYNC_BUFFERS,
        sources: Sequence[Sequence[int]] | None = None,
        exchange: RankExchange | None = None,
    ):
        self.exchange = exchange if exchange is not None else DistExchange()
        if not engines:
            raise ValueError("ColocatedWeightSender needs at least one engine")
        check_bucket_bytes(max_bucket_bytes)
        if verify_every < 0 or buffers < 1:
            raise ValueError(f"verify_every must be >= 0 and buffers >= 1, found {verify_every} and {buffers}")
        self.engines = list(engines) if self.exchange.rank == 0 else []
        if sources is None:
            sources = [[self.exchange.rank] * e.tp_size for e in engines]
        self.sources = [list(ranks) for ranks in sources]
        if self.exchange.rank == 0 and [len(r) for r in self.sources] != [e.tp_size for e in self.engines]:
            raise ValueError(f"sources {self.sources} do not give one rank per TP rank of the engines")
        # the (engine, TP rank) pairs whose buffer is this rank's
        self.roles = [
            (e, r) for e, ranks in enumerate(self.sources) for r, k in enumerate(ranks) if k == self.exchange.rank
        ]
        self.verifiers = [SyncVerifier(e.client, known_names) for e in self.engines]
        self.max_bucket_bytes = max_bucket_bytes
        self.verify_every = verify_every
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.syncs = 0  # syncs sent by this sender (`verify_due` counts from its first)
        self._buffers: list[Tensor | None] = [None] * buffers
        self._in_flight: list[list[Future]] = [[] for _ in range(buffers)]  # the requests reading each buffer
        self._pool = ThreadPoolExecutor(
            max_workers=max(len(self.engines), 1) * buffers, thread_name_prefix="sglang-ipc"
        )

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], *, weight_version: str) -> SyncReport:
        """Send all tensors bucket by bucket; the last bucket's request labels `weight_version` and flushes the cache.
        Every trainer rank calls it with its own export of the same weights.

        Returns:
            A `SyncReport` (`verified`: the probes whose landing the servers' hashes confirmed, on a checked sync;
            tensors and bytes: those sent, on rank 0, or packed here, on the other ranks).

        Raises:
            WeightSyncError: a name the servers' checkpoint lacks (nothing of its bucket is sent), or a probe that did
                not land (after the sync).
            SGLangError: an engine refused a bucket or is gone, or a rank failed to pack (the servers' weights are
                then partly updated).
            ValueError: no tensors.
        """
        lead = self.exchange.rank == 0
        self.syncs += 1
        values = verify_due(self.syncs, self.verify_every)
        clock = PhaseClock()
        # the lock step of several ranks (one rank: none to time)
        step = clock if self.exchange.world > 1 else lambda phase: contextlib.nullcontext()
        start = time.monotonic()
        # rank 0: the first failure. Whatever fails on rank 0 (a server that cannot answer /weights_checker, a refused
        # name, ...) is kept, not raised, until every bucket is through: the other ranks wait for rank 0 at each one
        error: BaseException | None = None
        with clock("check"):
            try:
                for v in self.verifiers:
                    v.begin(values)
            except Exception as err:  # the other ranks are told to stop at the first bucket
                error = err
        buckets = tensors = nbytes = 0
        pending = iter_buckets(named_tensors, self.max_bucket_bytes)
        with clock("export"):
            bucket = next(pending, None)
        if bucket is None:
            raise ValueError("no tensors to sync: named_tensors was empty")
        try:
            while bucket is not None:
                with clock("export"):
                    following = next(pending, None)  # the last bucket's request carries the version and the flush
                last = following is None
                slot = buckets % len(self._buffers)
                if lead and error is None:
                    try:
                        with clock("check"):
                            for v in self.verifiers:
                                v.bucket(bucket)  # refuses a name the servers would skip, before any of it is sent
                        with clock("wait"):  # every rank packs slot's buffers again only once their readers answered
                            for other in range(len(self._buffers)) if last else [slot]:
                                self._fence(other)  # the last: the label and the flush follow every earlier load
                    except Exception as err:
                        error = err
                with step("exchange"):
                    go = self.exchange.broadcast(error is None)
                handles: dict | str = {}
                if go and self.roles:
                    try:
                        with clock("pack"):
                            entries = pack_bucket(bucket, self._buffer(slot, flat_layout(bucket)[1]))
                            if self.device.type == "cuda":
                                torch.cuda.current_stream(self.device).synchronize()  # packed before a server maps it
                        handles = {role: serialize_flat_bucket(self._buffers[slot], entries) for role in self.roles}
                    except Exception as err:  # said to rank 0 (which raises it); every rank stays in step
                        handles = f"trainer rank {self.exchange.rank} could not pack bucket {buckets}: {err!r}"
                with step("exchange"):
                    gathered = self.exchange.gather(handles)
                if lead and go:
                    failed = [h for h in gathered if isinstance(h, str)]
                    try:
                        if failed:
                            raise SGLangError("; ".join(failed))
                        merged = {role: h for part in gathered for role, h in part.items()}
                        self._post(slot, merged, last=last, weight_version=weight_version)
                        tensors += len(bucket)
                        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                    except Exception as err:
                        error = err
                elif go and self.roles and not isinstance(handles, str):
                    tensors += len(bucket)
                    nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                buckets += 1
                bucket = following
        finally:
            with clock("wait"):
                errors = self._drain()  # never leave a request reading a buffer behind, also when raising
        if error is not None:
            if errors:  # the servers' own refusals of buckets sent before the error: said, not lost
                log.warning("colocated sync %s: %s", weight_version, "; ".join(errors))
            raise error
        if errors:
            raise SGLangError("update_weights_from_tensor failed on:\n" + "\n".join(errors))
        with clock("check"):
            verified = [n for v in self.verifiers for n in v.finish()]
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # the servers' references to earlier buffers (a grown one) are released
        seconds = time.monotonic() - start
        return SyncReport(buckets, tensors, nbytes, seconds, weight_version, tuple(verified), clock.seconds)

    def close(self) -> None:
        """Free the buffers (after every request that reads them answered)."""
        self._drain()
        self._buffers = [None] * len(self._buffers)
        self._pool.shutdown(wait=True)

    def _post(self, slot: int, handles: dict, *, last: bool, weight_version: str) -> None:
        """Rank 0: one request per engine for the bucket in buffer `slot`, each TP rank's handle from its own GPU."""
        self._in_flight[slot] = [
            self._pool.submit(
                e.client.update_weights_from_tensor,
                [handles[(i, r)] for r in range(e.tp_size)],
                load_format="flattened_bucket",
                flush_cache=last,
                weight_version=weight_version if last else None,
            )
            for i, e in enumerate(self.engines)
        ]

    def _fence(self, slot: int) -> None:
        """Wait until every request that reads buffer `slot` answered: only then may it be packed again."""
        wait_futures(self._in_flight[slot])

    def _buffer(self, slot: int, nbytes: int) -> Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:  # a single tensor larger than the bound grows it for good
            buf = torch.empty(max(nbytes, self.max_bucket_bytes), dtype=torch.uint8, device=self.device)
            self._buffers[slot] = buf
        return buf

    def _drain(self) -> list[str]:
        """Wait for every request in flight; the failures, one line per engine and bucket."""
        errors = []
        for slot, futures in enumerate(self._in_flight):
            for e, f in zip(self.engines if futures else [], futures, strict=True):
                try:
                    f.result()
                except Exception as err:  # collect every engine's failure, then raise one error naming them all
                    errors.append(f"{e.client.base_url}/update_weights_from_tensor: {err}")
            self._in_flight[slot] = []
        return errors


def open_colocated_sender(
    engines: Sequence[EngineAddress],
    *,
    model_path: str | None,
    verify_every: int,
    max_bucket_bytes: int,
    request_timeout_s: float,
    backend: str = "ipc",
    timeout_s: float = 600.0,
    sync_timeout_s: float | None = None,
) -> ColocatedWeightSender:
    """This trainer rank's part of the colocated IPC sync to every engine (a `weight_sync.GroupOpener`; runs in every
    train actor: `GroupSync.colocated`; collective: the ranks learn each other's GPUs, for `ipc_sources`).

    Args:
        engines: the engines' addresses, in engine order.
        model_path: the checkpoint the servers loaded (its names are checked on every sync); None: unchecked.
        verify_every: `rollout.sglang.verify_weights_every`.
        max_bucket_bytes: bound of one bucket.
        request_timeout_s: per-attempt timeout of the HTTP calls to the servers.
        backend, timeout_s, sync_timeout_s: the group path's options; no group backend takes part here.

    Raises:
        ValueError: an engine on another node than this train rank (a CUDA IPC handle opens on its own node only), or
            a GPU of an engine that no train rank holds (`ipc_sources`).
    """
    exchange = DistExchange.current()
    known, problem = None, None
    if model_path and exchange.rank == 0:
        try:
            known = checkpoint_names(model_path)
        except Exception as err:  # said to every rank through the exchange: all raise it, none waits for rank 0
            problem = f"trainer rank 0 could not read the checkpoint's tensor names at {model_path}: {err!r}"
    # every rank learns where every rank runs (and whether one failed) first; then each makes the same checks and
    # table, so that each raises the same error
    ranks = exchange.all_gather((*_where_this_rank_runs(exchange.world), problem))
    problems = [p for *_, p in ranks if p is not None]
    if problems:
        raise RuntimeError("; ".join(problems))
    here = ranks[0][0]  # rank 0 posts every request
    far = [i for i, e in enumerate(engines) if e.node_ip != here]
    if far:
        raise ValueError(
            f"colocated engines {far} run on another node than trainer rank 0 ({here}), so the colocated IPC weight "
            "sync cannot hand them CUDA memory; set rollout.sglang.colocated_sync=tensor (through Ray's object store)"
        )
    cuda = any(c for _, _, c, _ in ranks)
    if not cuda:  # a CPU job (tests): buffers shared by shared-memory file name, as the host does
        torch.multiprocessing.set_sharing_strategy("file_system")
    if exchange.world == 1:  # one rank: every handle is its own (a colocated engine shares its GPU)
        sources = [[0] * e.tp_size for e in engines]
    else:
        sources = ipc_sources(
            engines, [(node, gpu) if gpu is not None else None for node, gpu, _, _ in ranks], cuda=cuda
        )
    return ColocatedWeightSender(
        [
            EngineEndpoint(
                SGLangClient(e.url, api_key=e.api_key, policy=RequestPolicy(timeout_s=request_timeout_s)), e.tp_size
            )
            for e in engines
        ],
        known_names=known,
        max_bucket_bytes=max_bucket_bytes,
        verify_every=verify_every,
        sources=sources,
        exchange=exchange,
    )


def _where_this_rank_runs(world: int) -> tuple[str, str | None, bool]:
    """(node IP, Ray's id of this actor's GPU, CUDA available): the GPU id in the names `EngineAddress.gpu_ids` uses;
    None where unknown (not in a Ray actor of one GPU; with one rank it is not needed). Never raises: the other ranks
    wait for this one in the exchange."""
    import ray

    node = ray.util.get_node_ip_address()
    cuda = torch.cuda.is_available()
    if not cuda or world == 1 or not ray.is_initialized():
        return node, None, cuda
    ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    return node, str(ids[0]) if len(ids) == 1 else None, cuda


# ---------------------------------------------------------------------------------------------------------------------
# the NCCL path, trainer rank 0's side: update_weights_from_distributed


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


@dataclass(frozen=True)
class GroupRendezvous:
    """Where and how the weight-update group forms: what both ends are told, the engines in the body of
    `/init_weights_update_group` (each with its own `rank_offset`), the trainer by `init_trainer_group`."""

    master_address: str  # rank 0's (the trainer's) address, reachable from the engines
    master_port: int
    world_size: int  # the trainer and every engine's TP ranks (`group_layout`)
    group_name: str
    backend: str  # "nccl" or "gloo"


def init_trainer_group(rendezvous: GroupRendezvous, *, timeout_s: float):
    """Join the weight-update group as rank 0, the way SGLang 0.5.16's `init_custom_process_group` builds it.

    Uses torch's private `_new_process_group_helper` (what SGLang uses on its side): a group independent of the
    trainer's default process group, so it works whether or not `torch.distributed` is initialized.

    Args:
        rendezvous: the group, as the engines are told it.
        timeout_s: the group's timeout (rendezvous and every collective).

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
    r, timeout = rendezvous, timedelta(seconds=timeout_s)
    store, rank, _ = next(
        c10d.rendezvous(f"tcp://{r.master_address}:{r.master_port}", 0, r.world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(r.group_name, store)
    group, _ = c10d._new_process_group_helper(
        r.world_size, rank, [], c10d.Backend(r.backend), store, group_name=r.group_name, timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(r.world_size)}  # group rank == "global" rank, as SGLang
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
        sync_timeout_s: the deadline of one bucket; None: `bucket_timeout_s` of its bytes. Forming the group may
            take SYNC_FLOOR_S, or this if longer.
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
        sync_timeout_s: float | None = None,
    ):
        if not engines:
            raise ValueError("DistributedWeightSender needs at least one engine")
        check_bucket_bytes(max_bucket_bytes)
        self.engines = list(engines)
        self.max_bucket_bytes = max_bucket_bytes
        self.flush_timeout_s = flush_timeout_s
        self.timeout_s = timeout_s
        self.sync_timeout_s = sync_timeout_s
        bucket_timeout_s(0, sync_timeout_s)  # a bad value fails here, not at the first sync
        self.broken = False  # a sync failed: the group is aborted and must not be torn down with the engines
        self.rank_offsets, world_size = group_layout([e.tp_size for e in self.engines])
        self.rendezvous = GroupRendezvous(master_address, master_port, world_size, group_name, backend)
        self.group = None
        self._pool = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="sglang-weights")

    def init_group(self) -> None:
        """Form the group: every engine's POST and the trainer's own join run concurrently (all block until then)."""
        if self.group is not None:
            raise RuntimeError(f"weight-update group {self.rendezvous.group_name!r} is already initialized")
        body = dataclasses.asdict(self.rendezvous)
        futures = [
            self._pool.submit(e.client.init_weights_update_group, rank_offset=offset, **body)
            for e, offset in zip(self.engines, self.rank_offsets, strict=True)
        ]
        # forming the group includes the servers' own set-up (a first import of torch.distributed): at least the floor
        deadline = time.monotonic() + max(SYNC_FLOOR_S, bucket_timeout_s(0, self.sync_timeout_s))
        with self._watchdog(deadline, "init_weights_update_group"):
            self.group = init_trainer_group(self.rendezvous, timeout_s=self.timeout_s)
            self._until(functools.partial(_all_done, futures), futures, deadline, "init_weights_update_group")
        self._wait(futures, "init_weights_update_group")
        log.info(
            "weight-update group %r formed: %d ranks; deadline of each bucket: %s",
            self.rendezvous.group_name,
            self.rendezvous.world_size,
            self._bound_text(),
        )

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], *, weight_version: str) -> SyncReport:
        """Send all tensors bucket by bucket, then label the version and flush every engine's cache.

        Args:
            named_tensors: HF-named tensors, possibly lazy (moved to this process's GPU for nccl; CPU for gloo).
            weight_version: label the engines report from now on.

        Returns:
            A `SyncReport`.

        Raises:
            RuntimeError: `init_group` was not called, or an earlier sync broke the group.
            SGLangError: an engine refused a call, its server is gone, or a bucket missed its deadline; the engines'
                weights are then partially updated and the group is broken (close it and form a new one).
        """
        if self.group is None:
            raise RuntimeError("call init_group() before send(): the engines have not joined the weight-update group")
        if self.broken:
            raise RuntimeError(
                f"weight-update group {self.rendezvous.group_name!r} broke in an earlier sync: close() it first"
            )
        if self.rendezvous.backend == "nccl":  # NCCL broadcasts from this process's GPU
            device = torch.device("cuda", torch.cuda.current_device())
            named_tensors = ((name, t.to(device)) for name, t in named_tensors)
        clock = PhaseClock()
        start = time.monotonic()
        buckets = tensors = nbytes = 0
        pending = iter_buckets(named_tensors, self.max_bucket_bytes)
        while True:
            with clock("export"):
                bucket = next(pending, None)
            if bucket is None:
                break
            metas = [TensorMeta.of(name, t) for name, t in bucket]
            futures = [
                self._pool.submit(
                    e.client.update_weights_from_distributed,
                    names=[m.name for m in metas],
                    dtypes=[m.dtype for m in metas],
                    shapes=[m.shape for m in metas],
                    group_name=self.rendezvous.group_name,
                    flush_cache=False,
                )
                for e in self.engines
            ]
            deadline = time.monotonic() + bucket_timeout_s(sum(m.nbytes for m in metas), self.sync_timeout_s)
            what = "update_weights_from_distributed"
            with self._watchdog(deadline, what), clock("send"):
                # every broadcast of the bucket enqueued at once (in order, as the server receives them), then
                # watched together: waiting per tensor would cost a poll interval per tensor
                sent = [t.contiguous() for _, t in bucket]  # held until their broadcasts completed
                works = [torch.distributed.broadcast(t, src=0, group=self.group, async_op=True) for t in sent]
                self._until(functools.partial(_all_completed, works), futures, deadline, what)
                try:
                    for work in works:
                        work.wait()  # raises what the backend saw (e.g. gloo: a peer closed its connection)
                except Exception as err:  # an engine's own answer says more: give it a moment to arrive
                    wait_futures(futures, timeout=ABORT_GRACE_S / 2, return_when=FIRST_EXCEPTION)
                    self._fail_if_refused(futures, what)
                    self._fail(f"{what} failed: the broadcast from the trainer broke off ({err})")
                self._until(functools.partial(_all_done, futures), futures, deadline, what)
            with clock("wait"):
                self._wait(futures, what)
            buckets += 1
            tensors += len(metas)
            nbytes += sum(m.nbytes for m in metas)
        if buckets == 0:
            raise ValueError("no tensors to sync: named_tensors was empty")
        with clock("label"):
            for e in self.engines:
                e.client.update_weight_version(weight_version)
                e.client.flush_cache(timeout_s=self.flush_timeout_s)
        return SyncReport(buckets, tensors, nbytes, time.monotonic() - start, weight_version, phases=clock.seconds)

    def close(self) -> None:
        """Leave the group on every engine and here, concurrently: tearing down an NCCL communicator waits for its
        peers, so an engine's destroy returns only once the trainer destroys its side too. Engines that are gone
        are skipped with a warning."""
        if self.broken:  # aborted: a destroy would wait for the broken peer, here and on the server
            # and so would the group's destructor (gloo joins its worker threads, stuck until the group's timeout):
            # the group is kept referenced until the process ends
            _ABANDONED_GROUPS.append(self.group)
            self.group = None
            self._pool.shutdown(wait=False, cancel_futures=True)  # a stalled server's request may never return
            return
        if self.group is not None:
            futures = [
                self._pool.submit(e.client.destroy_weights_update_group, self.rendezvous.group_name)
                for e in self.engines
            ]
            torch.distributed.destroy_process_group(self.group)
            self.group = None
            for e, f in zip(self.engines, futures, strict=True):
                try:
                    f.result()
                except SGLangError as err:
                    log.warning("could not destroy the weight-update group on %s: %s", e.client.base_url, err)
        self._pool.shutdown(wait=True)

    def _until(self, done, futures: list[Future], deadline: float, what: str) -> None:
        """Wait until `done()`, but end the sync (`_fail`) as soon as an engine's call failed or `deadline` passed:
        an engine that refused a bucket never joins its broadcasts, so waiting for them would never end."""
        while not done():
            self._fail_if_refused(futures, what)
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [e.client.base_url for e, f in zip(self.engines, futures, strict=True) if not f.done()]
                self._fail(
                    f"{what} did not complete within its deadline ({self._bound_text()}); no answer from "
                    f"{', '.join(f'{u}/{what}' for u in waiting) or 'none: the broadcast itself stalled'}. Raise "
                    "rollout.sglang.sync_timeout_s if the link is this slow, else see the server's log"
                )
            wait_futures(futures, timeout=min(_POLL_S, left), return_when=FIRST_EXCEPTION)

    def _fail_if_refused(self, futures: list[Future], what: str) -> None:
        failed = [(e, f) for e, f in zip(self.engines, futures, strict=True) if f.done() and f.exception()]
        if failed:
            lines = [f"{e.client.base_url}/{what}: {f.exception()}" for e, f in failed]
            self._fail(f"{what} failed on {len(failed)} engine(s):\n" + "\n".join(lines))

    def _bound_text(self) -> str:
        if self.sync_timeout_s is not None:
            return f"rollout.sglang.sync_timeout_s={self.sync_timeout_s:g} s"
        return f"{SYNC_FLOOR_S:g} s + its bytes at {SYNC_BYTES_PER_S / 1024**2:g} MiB/s"

    def _fail(self, message: str):
        """The group is unusable from here on: abort it (unblocks NCCL kernels already enqueued), mark it broken,
        and raise one error with `message`."""
        self._abort()
        raise SGLangError(message)

    def _abort(self) -> None:
        self.broken = True
        if self.group is not None:
            try:
                torch.distributed.distributed_c10d._abort_process_group(self.group)
            except Exception as err:  # noqa: BLE001  (a backend without abort: the group is dropped unused instead)
                log.debug("could not abort weight-update group %r: %s", self.rendezvous.group_name, err)

    @contextlib.contextmanager
    def _watchdog(self, deadline: float, what: str) -> Iterator[None]:
        """The backstop for a main thread stuck inside a C call past `deadline` (module docstring): abort the group
        after ABORT_GRACE_S more, end the process after as long again."""
        returned = threading.Event()

        def watch() -> None:
            if returned.wait(max(0.0, deadline - time.monotonic()) + ABORT_GRACE_S):
                return
            log.error("%s: stuck past its deadline (%s); aborting the weight-update group", what, self._bound_text())
            self._abort()
            if returned.wait(ABORT_GRACE_S):
                return
            sys.stderr.write(
                f"miles-vl: the weight sync ({what} to {', '.join(e.client.base_url for e in self.engines)}) is stuck "
                f"in the communication backend past its deadline ({self._bound_text()}) and an abort did not free "
                "it; ending the train actor\n"
            )
            sys.stderr.flush()
            os._exit(70)

        watcher = threading.Thread(target=watch, name="weight-sync-watchdog", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            returned.set()

    def _wait(self, futures: list[Future], what: str) -> None:
        errors = []
        for e, f in zip(self.engines, futures, strict=True):
            try:
                f.result()
            except Exception as err:  # collect every engine's failure, then raise one error naming them all
                errors.append(f"{e.client.base_url}: {err}")
        if errors:
            raise SGLangError(f"{what} failed on {len(errors)} engine(s):\n" + "\n".join(errors))


def _all_done(futures: list[Future]) -> bool:
    return all(f.done() for f in futures)


def _all_completed(works: list) -> bool:
    return all(w.is_completed() for w in works)


@dataclass(frozen=True)
class EngineAddress:
    """How the trainer reaches one engine's server for a group sync (`RolloutEngine.endpoint`): NCCL (rank 0) or
    colocated IPC (every rank: `ipc_sources`)."""

    url: str
    api_key: str | None = field(repr=False)  # the server's key (every sglang server has one)
    tp_size: int
    node_ip: str
    loopback: bool  # the server binds a loopback address: reachable from its own node only
    nccl_cumem: str | None = None  # the server's NCCL_CUMEM_ENABLE (None: unknown); the trainer must run the same
    gpu_ids: tuple[str, ...] | None = None  # the server's CUDA_VISIBLE_DEVICES (Ray's GPU ids; TP rank r on the r-th)


def check_cumem_agrees(engines: Sequence[EngineAddress], trainer_value: str | None) -> None:
    """Refuse an NCCL group whose peers would open each other's buffers two ways (`server.nccl_peer_env`).

    Raises:
        ValueError: an engine's server runs with another NCCL_CUMEM_ENABLE than the trainer (unset = NCCL's default,
            on); names both values and the fix.
    """
    mine = "1" if trainer_value is None else trainer_value
    wrong = {i: e.nccl_cumem for i, e in enumerate(engines) if e.nccl_cumem is not None and e.nccl_cumem != mine}
    if wrong:
        raise ValueError(
            f"the trainer runs NCCL with {CUMEM_ENV}={trainer_value if trainer_value is not None else '<unset: on>'} "
            f"but the SGLang servers of engines {sorted(wrong)} with {sorted(set(wrong.values()))}: NCCL's P2P "
            "transport fails between them at the first broadcast (\"Cuda failure 'invalid argument'\"). Set "
            f"{CUMEM_ENV} to one value for every process of the job (miles-vl sets it to 0, SGLang's own choice, in "
            "the job's Ray runtime env and every server's env, unless the driver's environment sets it)"
        )


def open_trainer_group(
    engines: Sequence[EngineAddress],
    *,
    backend: str,
    max_bucket_bytes: int,
    request_timeout_s: float,
    timeout_s: float = 600.0,
    sync_timeout_s: float | None = None,
) -> DistributedWeightSender:
    """Trainer rank 0's weight-update group with every engine, formed (runs inside the train actor).

    Args:
        engines: the engines' addresses, in engine order.
        backend: "nccl" (tensors go to this process's GPU first) or "gloo" (CPU; tests).
        max_bucket_bytes: bound of one bucket (one `/update_weights_from_distributed` call).
        request_timeout_s: per-attempt timeout of the HTTP calls to the servers.
        timeout_s: the group's timeout (rendezvous and every broadcast).
        sync_timeout_s: the deadline of one bucket; None: derived from its bytes (`bucket_timeout_s`).

    Raises:
        ValueError: an engine bound to loopback on another node (the trainer could not reach it); with NCCL, a server
            whose NCCL_CUMEM_ENABLE differs from this process's (their first broadcast would fail).
    """
    import ray

    if backend == "nccl":
        check_cumem_agrees(engines, os.environ.get(CUMEM_ENV))
    here = ray.util.get_node_ip_address()
    far = [i for i, e in enumerate(engines) if e.loopback and e.node_ip != here]
    if far:
        raise ValueError(
            f"engines {far} bind 127.0.0.1 on another node than the trainer ({here}), so the NCCL weight sync "
            "cannot reach them; set rollout.sglang.host=0.0.0.0 and rollout.sglang.api_key"
        )
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    sender = DistributedWeightSender(
        [
            EngineEndpoint(
                SGLangClient(e.url, api_key=e.api_key, policy=RequestPolicy(timeout_s=request_timeout_s)), e.tp_size
            )
            for e in engines
        ],
        master_address="127.0.0.1" if all(e.node_ip == here for e in engines) else here,
        master_port=port,
        # a fresh name per group: a server that still holds a group broken by a failed sync can join the next one
        group_name=f"miles_vl_weight_sync_{port}",
        backend=backend,
        max_bucket_bytes=max_bucket_bytes,
        timeout_s=timeout_s,
        sync_timeout_s=sync_timeout_s,
    )
    try:
        sender.init_group()
    except BaseException:
        sender.close()
        raise
    return sender
