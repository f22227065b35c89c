"""The train role: one Ray actor per train rank, driven as a single trainer.

    trainer = Trainer(cfg, tokens, gpus)            # train.num_gpus ranks (megatron) or one (torch); process group
    metrics = trainer.train(samples)                # every rank gets the same samples; rank 0's metrics
    for ref in trainer.weight_buckets(max_bytes):   # rank 0 streams HF-named buckets, the other ranks take part in
        ...                                         # the collective export and drop their copy
    trainer.open_weight_group(opener, addresses); trainer.send_weights(version); trainer.close_weight_group()
    trainer.save_checkpoint(dir); trainer.load_checkpoint(dir); trainer.save_hf(dir, max_shard_bytes); trainer.close()
    wait = trainer.write_checkpoint(dir)               # written before it returns (checkpoint.async_save=false)
    wait = trainer.start_checkpoint(dir); ...; wait()  # state as of the call, written in the background (torch: a
                                                       # thread of the actor; megatron: megatron-core's async save)

Rank r sits in the trainer's GPU slot r (placement.py: node-major, so a TP group shares a node) and sees that GPU as
device 0. The ranks form one `torch.distributed` group (NCCL; gloo without CUDA) at `tcp://<rank 0's node>:<free port>`
before the backend is built (factories.py: megatron's `build_megatron_backend` with the job's parallel sizes, or the
embedded `TorchTrainBackend` on one rank); `train` runs `miles_vl.train.train_step` on every rank. Exports are
collective on every rank of the model, so every call that exports (buckets, NCCL send) runs on all ranks at once, and
rank 0 always drains its export to the end, even when sending fails, so that no rank is left waiting in a gather.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import ray
import torch

from miles_vl.config import JobConfig
from miles_vl.metrics.profile import ProfiledBlock, profiled
from miles_vl.models import SpecialTokens
from miles_vl.orchestration.factories import TrainBackendBuilder, set_threads
from miles_vl.orchestration.placement import COLOCATED_GPU_SHARE, GpuPlacement, cpu_only_options
from miles_vl.rollout.weight_sync import ExportStats, GroupOpener, SyncReport, WeightGroup, iter_buckets
from miles_vl.train import CheckpointWrite, train_step

log = logging.getLogger(__name__)

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # first NCCL collectives include model loading on every rank
STOP_GRACE_S = 10.0  # a stop during an NCCL weight sync lets it run this long, then ends it (the job exits in < 30 s)
_STOP_POLL_S = 0.5  # how often a wait for the sync looks at the stop request


def train_world_size(cfg: JobConfig) -> int:
    """Train ranks: one per train GPU for megatron, one for the embedded torch backend."""
    return cfg.train.num_gpus if cfg.train.backend == "megatron" else 1


# ---------------------------------------------------------------------------------------------------------------------
# the actor of one rank


RESIDENT = "perf/train_resident_gib"  # what a train rank holds after its train phase, into the rollout


def merge_rank_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """The step's metrics from every rank's: rank 0's (train_step reduces the train metrics over ranks), except
    `perf/train_peak_mem_gib`, the maximum over ranks: under CP, TP or vision_dp_when_cp the ranks hold different
    shards and images, and the fullest one is what must fit on a GPU (`perf/train_peak_mem_gib_rank0` keeps rank 0's);
    and `perf/train_resident_gib`, the maximum over ranks, for the same reason.
    """
    metrics = dict(per_rank[0])
    peaks = [m["perf/train_peak_mem_gib"] for m in per_rank if "perf/train_peak_mem_gib" in m]
    if len(peaks) > 1:
        metrics["perf/train_peak_mem_gib_rank0"] = metrics["perf/train_peak_mem_gib"]
        metrics["perf/train_peak_mem_gib"] = max(peaks)
    if resident := [m[RESIDENT] for m in per_rank if RESIDENT in m]:
        metrics[RESIDENT] = max(resident)
    return metrics


def release_build_memory() -> tuple[float, float] | None:
    """Hand the GPU memory a backend's build freed back to the device, and log what the trainer holds then: (allocated
    GiB, GiB returned), None without CUDA.

    megatron's DDP copies every weight into its contiguous param buffer and frees the weights megatron-bridge loaded
    (a bf16 copy of the model: 16.3 GiB at 8B), and the CPU-offloaded optimizer clones each weight on the GPU on its
    way to the host; PyTorch's caching allocator keeps that memory reserved, where a colocated engine that starts next
    cannot have it. On 2026-11-28 (docs/gpu-runs/2026-11-28-8b-1gpu-2xh200) the 8B trainer held 67.5 GiB of the card
    after its build where its tensors need ~51, and SGLang found 11.27 GiB for its 16.3 GiB of weights.
    """
    gc.collect()  # cycles that still hold freed tensors (the offloaded optimizer's hooks form some)
    if not torch.cuda.is_available():
        return None
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    allocated, returned = torch.cuda.memory_allocated() / 2**30, (reserved - torch.cuda.memory_reserved()) / 2**30
    log.info(
        "trainer built: %.1f GiB allocated; %.1f GiB the build left cached returned to the device", allocated, returned
    )
    return allocated, returned


def release_export_memory() -> None:
    """Hand what a weight export made and freed (the merged and split tensors of bridge's HF names) back to the
    device, on every rank that exported: a colocated engine resumes its KV cache right after the sync, where the 8B
    job on one GPU has ~2.6 GiB to spare (docs/benchmarks.md, issue 33.5)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@ray.remote
class TrainWorker:
    """Train rank `rank` of `world_size`: `setup` forms the process group and builds the backend with `build`."""

    def __init__(
        self, cfg: JobConfig, tokens: SpecialTokens, build: TrainBackendBuilder, rank: int = 0, world_size: int = 1
    ):
        set_threads(cfg)
        self.cfg, self.tokens = cfg, tokens
        self.rank, self.world_size = rank, world_size
        self.build = build
        self.backend = None
        self.weight_group: WeightGroup | None = None
        self.exported: ExportStats | None = None
        self.saving: CheckpointWrite | None = None  # the checkpoint write in flight
        self.said_sync_save = False
        self.profile_next = False  # the next `train` runs under torch.profiler (`profile_next_train`)
        self.profile: ProfiledBlock | None = None  # what the profiler saw of it, until `take_profile` summarizes it

    def rendezvous(self) -> str:
        """Where the process group meets: this actor's node and a free port on it (asked of rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, init_method: str | None) -> None:
        """Join the process group at `init_method` (None: a torch run on one rank, no group), build the backend."""
        if init_method is not None:
            # megatron's TP/SP communication overlap expects it; read when the CUDA context is created (below)
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(0)  # Ray shows each rank its own GPU only
            torch.distributed.init_process_group(
                "nccl" if cuda else "gloo",
                init_method=init_method,
                rank=self.rank,
                world_size=self.world_size,
                timeout=PROCESS_GROUP_TIMEOUT,
            )
        self.backend = self.build(self.cfg, self.tokens)
        release_build_memory()

    def train(self, samples: Sequence) -> dict[str, float]:
        """One RL step; with CUDA also the rank's peak allocated memory during it (`perf/train_peak_mem_gib`), and
        the allocator's cached blocks are returned to the device afterwards, so that colocated engines can resume;
        what stays allocated then is `perf/train_resident_gib` (what the rank holds through the rollout: on
        2026-11-28 the 8B trainer on one GPU held 4.2 GiB more from its second step on than before its first, seen
        only through nvidia-smi)."""
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if self.profile_next:
            self.profile_next = False
            with profiled() as self.profile:
                metrics = train_step(self.backend, samples)
        else:
            metrics = train_step(self.backend, samples)
        if cuda:
            metrics["perf/train_peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()
            metrics[RESIDENT] = torch.cuda.memory_allocated() / 2**30
        return metrics

    def profile_next_train(self) -> None:
        """Run the next `train` under torch.profiler (`train.profile_steps`); `take_profile` returns its summary."""
        self.profile_next = True

    def take_profile(self) -> dict | None:
        """The summary of the last profiled `train` (metrics/profile.py), once; None if none since the last call.
        Made here, not in `train`: reading the profiler's events takes seconds, outside the step's train time."""
        block, self.profile = self.profile, None
        summary = block.summary() if block is not None else None
        return None if summary is None else {"rank": self.rank, **summary}

    def set_lr(self, lr: float) -> None:
        self.backend.set_lr(lr)

    def set_vision_trainable(self, trainable: bool) -> None:
        self.backend.set_vision_trainable(trainable)

    def device_memory_used_gib(self) -> float | None:
        """GiB in use on this rank's GPU by every process (e.g. a colocated SGLang server too); None without CUDA."""
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30

    def export_weight_buckets(self, max_bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The trainable weights in byte-bounded buckets, one at a time: call with
        `.options(num_returns="streaming")` so that each bucket is its own object (miles_vl/rollout/weight_sync.py).
        The sizes of the last export are kept for `last_export`."""
        self.exported = ExportStats()
        for bucket in iter_buckets(self.backend.export_weights(), max_bucket_bytes):
            self.exported.add(bucket)
            yield bucket
        release_export_memory()

    def last_export(self) -> ExportStats | None:
        """Tensors, bytes and buckets of the last `export_weight_buckets` (None before the first)."""
        return self.exported

    def drain_weights(self) -> None:
        """This rank's part of a collective export whose tensors rank 0 sends (ranks > 0)."""
        for _ in self.backend.export_weights(on_device=True):  # nothing kept: no copy to the CPU either
            pass
        release_export_memory()

    # NCCL weight sync (disaggregated engines whose kind has a group path): rank 0 is the group's source rank.

    def open_weight_group(self, open_group: GroupOpener, engines: Sequence, **options) -> None:
        """Form the weight-update group with these engines (their `endpoint()`s) with the engine kind's `open_group`
        (they join concurrently; returns once formed). `options`: backend, max_bucket_bytes, timeouts
        (`weight_sync.GroupOpener`)."""
        if self.weight_group is not None:
            raise RuntimeError("a weight-update group is already open: close_weight_group() first")
        self.weight_group = open_group(engines, **options)

    def send_weights(self, weight_version: str) -> SyncReport:
        """Broadcast the trainable weights to every engine of the group, labelled `weight_version`."""
        if self.weight_group is None:
            raise RuntimeError("send_weights() before open_weight_group()")
        # where the trainer holds them: the group's sender moves them to its GPU (NCCL) or packs them there (IPC)
        weights = iter(self.backend.export_weights(on_device=True))
        try:
            report = self.weight_group.send(weights, weight_version=weight_version)
        finally:
            _drain(weights)  # the other ranks are still in the collective export
            release_export_memory()
        self.exported = ExportStats(report.tensors, report.bytes, report.buckets, dict(report.phases))
        return report

    def close_weight_group(self) -> None:
        if self.weight_group is not None:
            group, self.weight_group = self.weight_group, None
            group.close()

    def save_checkpoint(self, directory: str) -> None:
        """The backend's checkpoint files, with the optimizer's state unless checkpoint.optimizer_state is false."""
        self.backend.save_checkpoint(Path(directory), optimizer_state=self.cfg.checkpoint.optimizer_state)

    def start_checkpoint(self, directory: str) -> None:
        """Start writing the backend's checkpoint state as of now into `directory`, while this actor goes on
        (`wait_checkpoint` ends it): a backend with `start_checkpoint` writes it itself (megatron: megatron-core's
        async save; collective, so every rank is called), one with `checkpoint_snapshot` is written in a thread here;
        any other writes here, before this returns. The optimizer's state is in it unless checkpoint.optimizer_state
        is false."""
        if self.saving is not None:
            raise RuntimeError("a checkpoint write is still in flight: wait_checkpoint() first")
        start = getattr(self.backend, "start_checkpoint", None)
        snapshot = getattr(self.backend, "checkpoint_snapshot", None)
        optimizer_state = self.cfg.checkpoint.optimizer_state
        if start is not None:
            self.saving = start(Path(directory), optimizer_state=optimizer_state)
        elif snapshot is not None:
            self.saving = _ThreadWrite(snapshot(optimizer_state=optimizer_state), Path(directory))
        else:
            if self.cfg.checkpoint.async_save and not self.said_sync_save:
                self.said_sync_save = True  # once per rank: the setting is not silently ignored
                log.warning(
                    "checkpoint.async_save: the %s backend has no background write; its checkpoints are written "
                    "before training goes on",
                    type(self.backend).__name__,
                )
            self.backend.save_checkpoint(Path(directory), optimizer_state=optimizer_state)
            self.saving = _ThreadWrite(None, Path(directory))

    def checkpoint_written(self) -> bool:
        """Whether the write `start_checkpoint` began has ended (or none is in flight); does not wait. Collective for
        megatron (the driver asks every rank)."""
        return self.saving is None or self.saving.done()

    def wait_checkpoint(self) -> None:
        """Wait for the write `start_checkpoint` began; raises the write's own error (a full disk, ...)."""
        if self.saving is not None:
            saving, self.saving = self.saving, None
            saving.wait()

    def load_checkpoint(self, directory: str) -> None:
        self.backend.load_checkpoint(Path(directory))

    def save_hf(self, directory: str, max_shard_bytes: int) -> None:
        self.backend.save_hf(Path(directory), max_shard_bytes)

    def shutdown(self) -> None:
        if torch.distributed.is_initialized():
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group()


def _drain(items: Iterable) -> None:
    for _ in items:
        pass


class _ThreadWrite:
    """A `CheckpointWrite` (train/types.py) of `write(directory)` in a thread of this actor (None: already written).
    An error in the thread is kept for `wait`, so that it reaches the driver."""

    def __init__(self, write: Callable[[Path], None] | None, directory: Path):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        if write is None:
            self.future.set_result(None)
            return

        def run() -> None:
            try:
                write(directory)
                self.future.set_result(None)
            except BaseException as err:  # kept for wait(): an error in this thread reaches the driver
                self.future.set_exception(err)

        threading.Thread(target=run, name="checkpoint-write", daemon=True).start()

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


# ---------------------------------------------------------------------------------------------------------------------
# the group, as the driver sees it


class Trainer:
    """The train ranks as one trainer (module docstring).

    Args:
        cfg: the job config.
        tokens: special token ids.
        gpus: the trainer's GPU slots (`placement.reserve_gpus`); None on a CPU-only run.
        build: builds each rank's backend (`factories.TRAIN_BACKENDS[train.backend]`).
        stop: the error to raise when the job was asked to stop (SIGINT/SIGTERM), else None; the NCCL weight sync
            looks at it while it waits (`send_weights`).
        wait: return once every rank has built its backend (else at once: `wait_built` waits, and raises).

    Raises:
        ray.exceptions.RayActorError / RayTaskError: a rank failed to start or to build its backend (with `wait`).
    """

    def __init__(
        self,
        cfg: JobConfig,
        tokens: SpecialTokens,
        gpus: GpuPlacement | None,
        build: TrainBackendBuilder,
        stop: Callable[[], BaseException | None] | None = None,
        wait: bool = True,
    ):
        self.cfg = cfg
        self.stop = stop
        self.killed = False  # a sync was ended by a stop: the ranks are gone
        self.group_ranks: list = []  # the ranks in the open weight-update group (`open_weight_group`)
        # Calls that every rank runs (collectives inside) are submitted to all ranks under this lock, so that every
        # rank queues them in the same order: with rollout.max_staleness > 0 the driver's rollout thread may re-sync
        # a replaced engine (an export) while the main thread trains.
        self.submit_lock = threading.Lock()
        world = train_world_size(cfg)
        self.workers = [
            TrainWorker.options(**_rank_options(cfg, gpus, r)).remote(cfg, tokens, build, r, world)
            for r in range(world)
        ]
        grouped = world > 1 or cfg.train.backend == "megatron"
        # rank 0's address as a ref: every rank's setup waits for it in Ray, not here
        init_method = self.workers[0].rendezvous.remote() if grouped else None
        self._building: list | None = [w.setup.remote(init_method) for w in self.workers]  # the group forms here
        if wait:
            self.wait_built()

    def wait_built(self) -> None:
        """Wait until every rank has joined the group and built its backend (at once after the constructor unless it
        was given `wait=False`: the caller starts something else meanwhile, `loop.Job` the engines that share no GPU
        with the trainer).

        Raises:
            ray.exceptions.RayActorError / RayTaskError: a rank failed to start or to build its backend (the ranks
                are closed).
        """
        if self._building is None:
            return
        try:
            ray.get(self._building)
        except BaseException:
            self.close()
            raise
        self._building = None
        log.info("trainer: %s backend on %d rank(s)", self.cfg.train.backend, len(self.workers))

    @property
    def source(self):
        """Rank 0: the rank that hands weights to the engines."""
        return self.workers[0]

    def train(self, samples: Sequence) -> dict[str, float]:
        """One RL step on `samples` on every rank (one object-store copy); rank 0's metrics (reduced over ranks), with
        the peak memory of the fullest rank (`merge_rank_metrics`)."""
        ref = ray.put(list(samples))
        with self.submit_lock:
            refs = [w.train.remote(ref) for w in self.workers]
        return merge_rank_metrics(ray.get(refs))

    def profile_next_train(self) -> None:
        """Every rank runs the next `train` under torch.profiler (`train.profile_steps`)."""
        ray.get([w.profile_next_train.remote() for w in self.workers])

    def take_profiles(self) -> list[dict]:
        """Each rank's summary of the last profiled `train` (metrics/profile.py), in rank order."""
        return [p for p in ray.get([w.take_profile.remote() for w in self.workers]) if p is not None]

    def set_lr(self, lr: float) -> None:
        """The peak learning rate of every rank from the next optimizer step on (the format warm-up uses its own)."""
        ray.get([w.set_lr.remote(lr) for w in self.workers])

    def set_vision_trainable(self, trainable: bool) -> None:
        """Train the vision tower on every rank from the next optimizer step on, or not (the format warm-up)."""
        ray.get([w.set_vision_trainable.remote(trainable) for w in self.workers])

    def weight_buckets(self, max_bucket_bytes: int, ahead: int) -> Iterator:
        """ObjectRefs of rank 0's weight buckets, streamed at most `ahead` buckets before the consumer."""
        with self.submit_lock:
            others = [w.drain_weights.remote() for w in self.workers[1:]]
            buckets = self.source.export_weight_buckets.options(
                num_returns="streaming", _generator_backpressure_num_objects=ahead
            ).remote(max_bucket_bytes)
        yield from buckets
        ray.get(others)

    def last_export(self) -> ExportStats | None:
        """Sizes of the last `weight_buckets` export (rank 0's)."""
        return ray.get(self.source.last_export.remote())

    def device_memory_used_gib(self) -> float | None:
        """GiB in use on rank 0's GPU by every process on it (None without CUDA)."""
        return ray.get(self.source.device_memory_used_gib.remote())

    def open_weight_group(
        self, open_group: GroupOpener, engines: Sequence, *, every_rank: bool = False, **options
    ) -> None:
        """Form the weight-update group in rank 0, or in every rank (`every_rank`: the colocated IPC sync, where each
        rank packs for the engines' TP ranks on its GPU); `options` go to `open_group`."""
        ranks = self.workers if every_rank else [self.source]
        with self.submit_lock:
            refs = [w.open_weight_group.remote(open_group, engines, **options) for w in ranks]
        failed = []
        for ref in refs:  # every rank's answer, so that none is left with a group when another failed
            try:
                self._get_unless_stopped(ref, "forming its group")
            except ray.exceptions.RayTaskError as error:
                failed.append(error)
        if failed:
            with contextlib.suppress(ray.exceptions.RayError):  # the next open must find no group on any rank
                ray.get([w.close_weight_group.remote() for w in ranks])
            raise failed[0]
        self.group_ranks = ranks

    def send_weights(self, weight_version: str) -> SyncReport:
        """Rank 0 sends (the colocated IPC group: with every rank), the other ranks take part in the export. Every
        bucket has a deadline in rank 0 (sglang: `DistributedWeightSender` in rollout/sglang/weights.py), whose
        watchdog ends the actor if the deadline cannot free it; a stop request still pending STOP_GRACE_S into the
        sync ends it here (`_get_unless_stopped`)."""
        ranks = self.group_ranks or [self.source]
        with self.submit_lock:
            senders = [w.send_weights.remote(weight_version) for w in ranks]
            others = [w.drain_weights.remote() for w in self.workers if w not in ranks]
        try:
            return self._get_all_unless_stopped(senders, "sending weights")[0]
        finally:
            if not self.killed:
                ray.get(others)  # rank 0 drained its export even if sending failed, so these finish too

    def close_weight_group(self) -> None:
        if not self.killed:
            ranks, self.group_ranks = self.group_ranks or [self.source], []
            self._get_all_unless_stopped([w.close_weight_group.remote() for w in ranks], "closing its group")

    def _get_all_unless_stopped(self, refs: list, doing: str) -> list:
        """`_get_unless_stopped` of each ref, rank 0's first (its error is the one that says why)."""
        first = self._get_unless_stopped(refs[0], doing)
        return [first, *(self._get_unless_stopped(ref, doing) for ref in refs[1:])]

    def _get_unless_stopped(self, ref, doing: str):
        """`ray.get(ref)`, unless the job is asked to stop and `ref` is still not ready STOP_GRACE_S later: then the
        train ranks are killed (a sync that is stuck waits for a peer, and a half-synced trainer holds nothing to
        save: checkpoints come from committed steps only) and the stop is raised."""
        stopped_at = None
        while True:
            ready, _ = ray.wait([ref], timeout=_STOP_POLL_S)
            if ready:
                return ray.get(ref)
            error = self.stop() if self.stop is not None else None
            if error is None:
                continue
            stopped_at = stopped_at or time.monotonic()
            if time.monotonic() - stopped_at >= STOP_GRACE_S:
                log.warning(
                    "stop requested: the weight sync (%s) has not ended %.0f s later; ending the train "
                    "ranks without it (the newest checkpoint stands)",
                    doing,
                    STOP_GRACE_S,
                )
                self.kill()
                raise error

    def save_checkpoint(self, directory: str | Path) -> None:
        ray.get([w.save_checkpoint.remote(str(directory)) for w in self.workers])

    def write_checkpoint(self, directory: str | Path) -> Callable[[], None]:
        """`start_checkpoint` in the foreground: every rank writes its files before this returns (the backend's
        `save_checkpoint`: megatron's synchronous save); returns a wait with nothing left to wait for."""
        self.save_checkpoint(directory)
        return lambda: None

    def start_checkpoint(self, directory: str | Path) -> Callable[[], None]:
        """Every rank snapshots its checkpoint state and writes it into `directory` in the background (the next
        `train` does not change what is written); returns what waits for the writes (raising a rank's error)."""
        ray.get([w.start_checkpoint.remote(str(directory)) for w in self.workers])
        return self.wait_checkpoint

    def checkpoint_written(self) -> bool:
        """Whether every rank's checkpoint write has ended; does not wait."""
        return all(ray.get([w.checkpoint_written.remote() for w in self.workers]))

    def wait_checkpoint(self) -> None:
        ray.get([w.wait_checkpoint.remote() for w in self.workers])

    def load_checkpoint(self, directory: str | Path) -> None:
        ray.get([w.load_checkpoint.remote(str(directory)) for w in self.workers])

    def save_hf(self, directory: str | Path, max_shard_bytes: int) -> None:
        """The policy as an HF model directory (config.json, safetensors): every rank exports, rank 0 writes."""
        ray.get([w.save_hf.remote(str(directory), max_shard_bytes) for w in self.workers])

    def close(self) -> None:
        """End every rank: built ranks shut down cleanly (60 s at most), then are killed. Ranks still building (the
        job stopped before `wait_built` returned: an engine failed to start beside the build) are killed at once:
        their `shutdown` would wait behind the build, minutes for a large Megatron model, and they hold nothing to
        save."""
        if not self.killed and self._building is None:
            with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        self.kill()

    def kill(self) -> None:
        """End every rank now (what it was doing is lost)."""
        self.killed = True
        for w in self.workers:
            with contextlib.suppress(ValueError):
                ray.kill(w, no_restart=True)


def _rank_options(cfg: JobConfig, gpus: GpuPlacement | None, rank: int) -> dict:
    """Ray options of train rank `rank`: its slot's bundle (half its GPU when colocated), or 0 CPUs on a CPU run."""
    if gpus is None:
        return cpu_only_options() | dict(max_restarts=0)
    share = COLOCATED_GPU_SHARE if cfg.ray.placement == "colocate" else 1.0
    return dict(num_cpus=0, num_gpus=share, scheduling_strategy=gpus.strategy(gpus.slots[rank]), max_restarts=0)
