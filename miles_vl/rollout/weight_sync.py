"""Weight sync trainer -> rollout engines, engine-agnostic: byte-bounded buckets, the deadline of one bucket, and the
two ways the driver (`make_weight_sync`) moves weights after every train step, and again for engines that lost them
(a restarted server, a replaced actor). This module imports no engine: each engine's own wire lives in its folder
(SGLang's: miles_vl/rollout/sglang/weights.py), and orchestration/factories.py's engine table hands it here.

    tensors  (through the driver: hf engines, sglang colocated) — Ray's object store, one bucket at a time:
        every engine  begin_weight_sync()
        for bucket in trainer.weight_buckets(bucket_bytes, ahead=2)  # streamed from train rank 0 (`iter_buckets`)
            every engine  load_weight_bucket(bucket)                 # the engine's wire (sglang: send_tensor_bucket)
        every engine  finish_weight_sync(version)

    group  (an engine kind whose table row has a `GroupSync`, disaggregated: sglang) — train rank 0 broadcasts:
        once:      trainer.open_weight_group(group.open_group, engine.endpoint() of all)  # runs in the train actor
        each sync: trainer.send_weights(version)                     # the opened `WeightGroup`'s send
                   every engine  expect_weight_version(version)      # responses must carry this label from now on
        repair:    trainer.close_weight_group(); open again; send to all  # a restarted server left the group

    colocated group  (an engine kind whose table row has a colocated `GroupSync`: sglang) — the same calls as the group
        path, but on every trainer rank (`GroupSync.colocated`): `open_group` returns a sender that hands each TP rank
        of the engines' servers a CUDA IPC handle of a persistent flat buffer on its own GPU, packed by the trainer
        rank that shares that GPU (`pack_bucket`; sglang: `ColocatedWeightSender`, `ipc_sources`); only metadata
        crosses Ray and HTTP, and the server's value check runs when `verify_due` says so.

`push` and `repair` return the engines that failed ({index: error}) instead of raising, so that the caller
(orchestration/engines.py) can replace the dead ones and re-sync the others; they raise what they cannot repair.

Buckets bound the bytes in flight (and the receiver's temporary allocation): a bucket closes before the tensor that
would push it past `max_bucket_bytes`; a single tensor larger than the bound travels alone. A group sync never hangs:
every bucket has a deadline (`bucket_timeout_s`: the engine's sync timeout, or SYNC_FLOOR_S + its bytes at
SYNC_BYTES_PER_S), and a sender stuck past it is aborted after ABORT_GRACE_S (the sglang sender's watchdog).

A new engine adds a row to the engine table and a module in its folder (a `GroupSync` whose `open_group` returns a
`WeightGroup`, if the trainer should broadcast to it); nothing here changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024**2
IPC_SYNC_BUFFERS = 2  # the colocated IPC sync's rotating bucket buffers: one fills while the engines copy the other
SYNC_FLOOR_S = 60.0  # the derived bound of one bucket: this much, plus its bytes at SYNC_BYTES_PER_S
SYNC_BYTES_PER_S = 50 * 1024**2  # conservative: a cross-node link far slower than NVLink (4.26 GB took 3.8 s there)
ABORT_GRACE_S = 10.0  # how long the watchdog waits past a deadline before aborting the group, and again before exiting


def bucket_timeout_s(nbytes: int, sync_timeout_s: float | None = None) -> float:
    """The deadline of one bucket of a group sync (its broadcasts and the engines' answers; sglang: its
    `/update_weights_from_distributed`):
    `sync_timeout_s` when given, else SYNC_FLOOR_S + nbytes / SYNC_BYTES_PER_S (60 s + 10.2 s for 512 MiB)."""
    if sync_timeout_s is not None:
        if sync_timeout_s <= 0:
            raise ValueError(f"sync_timeout_s must be > 0 (or None: derived from the bytes), found {sync_timeout_s}")
        return sync_timeout_s
    return SYNC_FLOOR_S + nbytes / SYNC_BYTES_PER_S


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver of a broadcast needs to know about one tensor before receiving it (sglang:
    `/update_weights_from_distributed`'s names, dtypes and shapes)."""

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
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of the sync (`PhaseClock`)


class PhaseClock:
    """Wall seconds spent in each named phase of one sync, summed over its buckets (`with clock("pack"): ...`), so
    that a sync's time says where it goes. The phases a sender names (the group senders, miles_vl/rollout/sglang/
    weights.py): `export` (waiting for the trainer's next tensors: the backend's export, on the CPU side; its GPU
    kernels finish in the next phase that synchronizes), `pack` (copies into the flat buffer and the stream sync
    before a server maps it), `send` (the broadcast of a bucket, NCCL/gloo, until every engine answered), `wait`
    (waiting for the servers' answers: the copies out of a buffer before it is packed again, and the last ones),
    `check` (the name and value checks: `/weights_checker`), `label` (the version label and the cache flush),
    `exchange` (the colocated sync's lock step of several trainer ranks: go, and the gathered IPC handles)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


@dataclass
class ExportStats:
    """What one export of the trainer's weights held: tensors, bytes and buckets (and, for a group sync, the seconds
    of each phase: `SyncReport.phases`)."""

    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    phases: dict[str, float] = field(default_factory=dict)

    def add(self, bucket: Sequence[tuple[str, Tensor]]) -> None:
        self.buckets += 1
        self.tensors += len(bucket)
        self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------------------------
# buckets


def iter_buckets(
    named_tensors: Iterable[tuple[str, Tensor]], max_bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """Split tensors, in order, into buckets of at most `max_bucket_bytes` (a larger tensor goes alone). Holds one
    bucket at a time, so a lazy exporter never materializes the model.

    Yields:
        Lists of (name, tensor): consecutive runs of `named_tensors`.
    """
    check_bucket_bytes(max_bucket_bytes)
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


def check_bucket_bytes(max_bucket_bytes: int) -> None:
    """Raises ValueError unless `max_bucket_bytes` > 0."""
    if max_bucket_bytes <= 0:
        raise ValueError(f"max_bucket_bytes must be > 0, found {max_bucket_bytes}")


FLAT_ALIGN = 256  # byte alignment of each tensor in a flat bucket (any dtype's view of its slice is then aligned)


@dataclass(frozen=True)
class FlatEntry:
    """Where one tensor of a flat bucket lies: bytes [start, start + nbytes) of the buffer, as `dtype` and `shape`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def flat_layout(named_tensors: Sequence[tuple[str, Tensor]]) -> tuple[list[FlatEntry], int]:
    """The entries of `named_tensors` packed in order into one byte buffer, each at a FLAT_ALIGN-aligned offset.

    Returns:
        (entries, bytes the buffer needs).
    """
    entries, offset = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        entries.append(FlatEntry(name, t.dtype, tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // FLAT_ALIGN) * FLAT_ALIGN
    return entries, offset


def pack_bucket(named_tensors: Sequence[tuple[str, Tensor]], buffer: Tensor) -> list[FlatEntry]:
    """Copy a bucket's tensors into `buffer` (1-D uint8, on any device: a GPU buffer takes GPU tensors without the
    CPU) at the offsets of `flat_layout`. The copies are enqueued on the current stream: synchronize before another
    process reads the buffer.

    Raises:
        ValueError: `buffer` is not 1-D uint8, or smaller than the bucket needs.
    """
    entries, size = flat_layout(named_tensors)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"pack_bucket needs a 1-D uint8 buffer, found {buffer.dtype} with shape {tuple(buffer.shape)}")
    if buffer.numel() < size:
        raise ValueError(f"the bucket needs {size} bytes but the buffer holds {buffer.numel()}: allocate a larger one")
    for e, (_, t) in zip(entries, named_tensors, strict=True):
        # a typed view of the slice: the copy converts nothing and handles non-contiguous sources
        buffer[e.start : e.start + e.nbytes].view(e.dtype).view(e.shape).copy_(t, non_blocking=True)
    return entries


def unpack_bucket(buffer: Tensor, entries: Sequence[FlatEntry]) -> list[tuple[str, Tensor]]:
    """The tensors of a packed bucket, as views of `buffer` (what a receiver of the flat buffer rebuilds)."""
    return [(e.name, buffer[e.start : e.start + e.nbytes].view(e.dtype).view(e.shape)) for e in entries]


def verify_due(sync: int, every: int) -> bool:
    """Whether sync number `sync` (1 = the first since the engines' group opened: the job's first sync, or the first
    after a relaunch re-formed it) runs the server's value check: the first, then every `every`-th; `every` = 0:
    only the first.

    Raises:
        ValueError: `sync` < 1 or `every` < 0.
    """
    if sync < 1 or every < 0:
        raise ValueError(f"verify_due needs sync >= 1 and every >= 0, found sync={sync}, every={every}")
    return sync == 1 or (every > 0 and sync % every == 0)


# ---------------------------------------------------------------------------------------------------------------------
# the driver


@dataclass(frozen=True)
class WeightSyncOptions:
    """How weights travel (production defaults; tests lower the bucket bound to see several buckets).

    Args:
        bucket_bytes: bound of one bucket (an object-store object, or one bucket of the group's broadcasts).
        buckets_ahead: buckets the trainer may export ahead of the engines (bounds the object store's share).
        group_backend: backend of the group path's group; None: nccl when the trainer has GPUs, else gloo.
        timeout_s: the group's timeout (rendezvous and every broadcast).
        repair_from_last_sync: the driver path keeps the buckets of the last sync (one copy of the weights in the
            object store) and repairs engines from them, not from a new export: with rollouts ahead of training
            (rollout.max_staleness > 0) the trainer may already be past the weights the other engines generate with.
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    buckets_ahead: int = 2
    group_backend: str | None = None
    timeout_s: float = 600.0
    repair_from_last_sync: bool = False


Failed = dict[int, BaseException]


class WeightGroup(Protocol):
    """Trainer rank 0's formed weight-update group with a set of engines (what `GroupSync.open_group` returns; it
    lives in the train actor). sglang: `rollout.sglang.weights.DistributedWeightSender`."""

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], *, weight_version: str) -> SyncReport:
        """Broadcast every tensor, bucket by bucket, each bucket within its deadline (`bucket_timeout_s`); then the
        engines serve `weight_version`. Raises when an engine failed or a deadline passed (the group is then broken:
        `close` it and open a new one)."""
        ...

    def close(self) -> None:
        """Leave the group on every engine and here; never waits for a peer of a broken group."""
        ...


# (engines' `endpoint()` results, *, backend, max_bucket_bytes, request_timeout_s, timeout_s, sync_timeout_s) -> a
# formed group. A module-level function: it travels to the train actor by reference.
GroupOpener = Callable[..., WeightGroup]


@dataclass(frozen=True)
class GroupSync:
    """An engine kind's group path, as trainer rank 0 drives it (its row of orchestration/factories.py's table).

    Args:
        open_group: forms the group with the engines (sglang: `rollout.sglang.weights.open_trainer_group`; colocated:
            `open_colocated_sender`).
        request_timeout_s: per-attempt timeout of the calls to the engines' servers.
        sync_timeout_s: the deadline of one bucket; None: derived from its bytes (`bucket_timeout_s`).
    """

    open_group: GroupOpener
    request_timeout_s: float
    sync_timeout_s: float | None = None
    # the group is the colocated IPC path: no broadcast backend, and `open_group` and the group's `send` run on every
    # trainer rank (each packs for the servers' TP ranks on its GPU); else on rank 0 alone
    colocated: bool = False


def make_weight_sync(trainer, *, group: GroupSync | None, trainer_gpus: bool, options: WeightSyncOptions) -> WeightSync:
    """The sync from `trainer` (orchestration/trainer.py: `weight_buckets`, `open_weight_group`, `send_weights`,
    `close_weight_group`) to the engines: trainer rank 0 sends over a group opened by `group.open_group` when `group`
    is given (the engine kind has one for this placement), else through the driver."""
    if group is not None:
        if group.colocated:
            backend = "ipc"
        else:
            backend = options.group_backend or ("nccl" if trainer_gpus else "gloo")
        return NcclWeightSync(trainer, group, backend=backend, options=options)
    return TensorWeightSync(trainer, options)


class TensorWeightSync:
    """Through the driver: the trainer's buckets (object-store refs) go to every engine actor."""

    def __init__(self, trainer, options: WeightSyncOptions):
        self.trainer = trainer
        self.options = options
        self.last: tuple[str, list] | None = None  # (version, bucket refs) of the last sync: repair_from_last_sync

    def push(
        self, engines: Sequence, version: str, only: Sequence[int] | None = None, buckets: Iterable | None = None
    ) -> Failed:
        """Sync `engines` (or only those at the indices `only`) to the trainer's weights (or to `buckets`, refs
        of an earlier export), labelled `version`."""
        targets = {i: engines[i] for i in (range(len(engines)) if only is None else only)}
        failed: Failed = {}
        call_each(targets, failed, "begin_weight_sync")
        kept = []
        if buckets is None:
            buckets = self.trainer.weight_buckets(self.options.bucket_bytes, ahead=self.options.buckets_ahead)
        # an ObjectRef per bucket: each engine fetches it from the object store
        for bucket in buckets:
            call_each(targets, failed, "load_weight_bucket", bucket)
            kept.append(bucket)
        call_each(targets, failed, "finish_weight_sync", version)
        if self.options.repair_from_last_sync:
            self.last = (version, kept)
        log.info("weights %s: %d bucket(s) to %d engine(s), %d failed", version, len(kept), len(targets), len(failed))
        return failed

    def repair(self, engines: Sequence, indices: Sequence[int], version: str) -> Failed:
        """Engines `indices` lost their weights (restarted or replaced): sync those again (from the last sync's
        buckets when they are kept and are `version`'s)."""
        if self.last is not None and self.last[0] == version:
            return self.push(engines, version, only=indices, buckets=self.last[1])
        return self.push(engines, version, only=indices)

    def close(self) -> None:
        pass


class NcclWeightSync:
    """Trainer rank 0 sends to every engine: one weight-update group (NCCL; gloo on CPU; "ipc": the colocated sender),
    formed on the first push by the engine kind's `GroupSync.open_group`, formed again by `repair`."""

    def __init__(self, trainer, group: GroupSync, *, backend: str, options: WeightSyncOptions):
        self.trainer = trainer
        self.group = group
        self.backend = backend
        self.options = options
        self.open = False

    def push(self, engines: Sequence, version: str) -> Failed:
        """Broadcast the trainer's weights to every engine, labelled `version`. A failure leaves every engine with
        partly updated weights, so all of them are returned as failed (the caller re-syncs them)."""
        import ray

        failed: Failed = {}
        call_each(dict(enumerate(engines)), failed, "begin_weight_sync")  # generate refuses until the sync ends
        if failed:
            return failed
        try:
            if not self.open:
                answers = call_each(dict(enumerate(engines)), failed, "endpoint")
                if failed:  # an engine that died after begin_weight_sync: the caller recovers it, then syncs again
                    return failed
                addresses = [answers[i] for i in range(len(engines))]
                self.trainer.open_weight_group(
                    self.group.open_group,
                    addresses,
                    every_rank=self.group.colocated,
                    backend=self.backend,
                    max_bucket_bytes=self.options.bucket_bytes,
                    timeout_s=self.options.timeout_s,
                    request_timeout_s=self.group.request_timeout_s,
                    sync_timeout_s=self.group.sync_timeout_s,
                )
                self.open = True
            report = self.trainer.send_weights(version)
        except ray.exceptions.RayTaskError as error:
            log.warning("weight sync %s over %s failed: %s", version, self.backend, error)
            self.close()
            return _blame(engines, error)
        call_each(dict(enumerate(engines)), failed, "expect_weight_version", version)
        log.info(
            "weights %s: %d bucket(s) over %s to %d engine(s)", version, report.buckets, self.backend, len(engines)
        )
        return failed

    def repair(self, engines: Sequence, indices: Sequence[int], version: str) -> Failed:
        """A restarted or replaced engine is no longer in the group: form it again and send to every engine."""
        self.close()
        return self.push(engines, version)

    def close(self) -> None:
        """Leave the group on every engine and the trainer (engines that are gone are skipped with a warning)."""
        if self.open:
            self.open = False
            self.trainer.close_weight_group()


WeightSync = TensorWeightSync | NcclWeightSync


def call_each(targets: Mapping[int, Any], failed: Failed, method: str, *args) -> dict[int, Any]:
    """`method(*args)` on every target engine (a Ray actor) not failed yet, concurrently; failures are recorded in
    `failed`, not raised. Returns {index: answer} of the engines that answered."""
    import ray

    refs = {i: getattr(e, method).remote(*args) for i, e in targets.items() if i not in failed}
    answers = {}
    for i, ref in refs.items():
        try:
            answers[i] = ray.get(ref)
        except ray.exceptions.RayError as error:
            failed[i] = error
    return answers


def _blame(engines: Sequence, error: BaseException) -> Failed:
    """Every engine after a failed NCCL sync: those that died with their own error, the others with `error`."""
    import ray

    failed: Failed = {}
    for i, e in enumerate(engines):
        try:
            ray.get(e.needs_weights.remote())
            failed[i] = error
        except ray.exceptions.RayError as probe_error:
            failed[i] = probe_error
    return failed
