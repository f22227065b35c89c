"""Trainer weights -> rollout engines after every train step, and again for engines that lost them.

Two ways, picked by `make_weight_sync`:

    tensors  (through the driver: hf engines, sglang colocated) — Ray's object store, one bucket at a time:
        every engine  begin_weight_sync()
        for bucket in trainer.weight_buckets(WEIGHT_BUCKET_BYTES, ahead=2)  # streamed from train rank 0
            every engine  load_weight_bucket(bucket)                        # sglang: POST /update_weights_from_tensor
        every engine  finish_weight_sync(version)                           # sglang: label the version, flush

    nccl  (an engine kind with `nccl_when_disaggregated`, disaggregated: sglang) — train rank 0 broadcasts:
        once:      trainer.open_weight_group(engine addresses)  # every engine POST /init_weights_update_group while
                                                                 # the trainer joins as rank 0
        each sync: trainer.send_weights(version)                 # per bucket: every engine POST
                                                                 # /update_weights_from_distributed while the trainer
                                                                 # broadcasts; then /update_weight_version, /flush_cache
                   every engine  expect_weight_version(version)  # responses must carry this label from now on
        repair:    trainer.close_weight_group(); open again; send to all   # a restarted server left the group

`push` and `repair` return the engines that failed ({index: error}) instead of raising, so that the caller
(engines.py) can replace the dead ones and re-sync the others; it raises what it cannot repair.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable, Sequence

import ray
import torch
from torch import Tensor

from miles_vl.config import JobConfig
from miles_vl.rollout.sglang import DistributedWeightSender, EngineEndpoint, SGLangClient, SyncReport
from miles_vl.rollout.sglang.host import EngineAddress
from miles_vl.rollout.sglang.weights import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)

# Bound of one bucket in the object store (tests lower it to see several buckets).
WEIGHT_BUCKET_BYTES = DEFAULT_BUCKET_BYTES
# Buckets the trainer may export ahead of the engines: bounds the object store's share of the weights.
BUCKETS_AHEAD = 2
# Backend of the NCCL sync's group; None: nccl when the trainer has GPUs, else gloo (tests with stand-in GPUs set it).
GROUP_BACKEND: str | None = None

Failed = dict[int, BaseException]


def make_weight_sync(cfg: JobConfig, trainer, nccl: bool) -> WeightSync:
    """The sync from `trainer` (orchestration/trainer.py) to the engines: over NCCL when `nccl`, else tensors."""
    if nccl:
        return NcclWeightSync(
            trainer,
            backend=GROUP_BACKEND or ("nccl" if cfg.train.num_gpus > 0 else "gloo"),
            request_timeout_s=cfg.rollout.sglang.request_timeout_s,
        )
    return TensorWeightSync(trainer)


class TensorWeightSync:
    """Through the object store (hf engines; sglang colocated): the trainer's buckets go to every engine actor."""

    def __init__(self, trainer):
        self.trainer = trainer

    def push(self, engines: Sequence, version: str, only: Sequence[int] | None = None) -> Failed:
        """Sync `engines` (or only those at the indices `only`) to the trainer's weights, labelled `version`."""
        targets = {i: engines[i] for i in (range(len(engines)) if only is None else only)}
        failed: Failed = {}
        _call_each(targets, failed, "begin_weight_sync")
        n = 0
        # an ObjectRef per bucket: each engine fetches it from the object store
        for bucket in self.trainer.weight_buckets(WEIGHT_BUCKET_BYTES, ahead=BUCKETS_AHEAD):
            _call_each(targets, failed, "load_weight_bucket", bucket)
            n += 1
        _call_each(targets, failed, "finish_weight_sync", version)
        log.info("weights %s: %d bucket(s) to %d engine(s), %d failed", version, n, len(targets), len(failed))
        return failed

    def repair(self, engines: Sequence, indices: Sequence[int], version: str) -> Failed:
        """Engines `indices` lost their weights (restarted or replaced): sync those again."""
        return self.push(engines, version, only=indices)

    def close(self) -> None:
        pass


class NcclWeightSync:
    """Disaggregated: one weight-update group of trainer rank 0 and every engine, formed on the first push."""

    def __init__(self, trainer, *, backend: str, request_timeout_s: float, timeout_s: float = 600.0):
        self.trainer = trainer
        self.backend = backend
        self.request_timeout_s = request_timeout_s
        self.timeout_s = timeout_s
        self.open = False

    def push(self, engines: Sequence, version: str) -> Failed:
        """Broadcast the trainer's weights to every engine, labelled `version`. A failure leaves every engine with
        partly updated weights, so all of them are returned as failed (the caller re-syncs them)."""
        failed: Failed = {}
        _call_each(dict(enumerate(engines)), failed, "begin_weight_sync")  # generate refuses until the sync ends
        if failed:
            return failed
        try:
            if not self.open:
                addresses = ray.get([e.endpoint.remote() for e in engines])
                options = dict(
                    backend=self.backend,
                    max_bucket_bytes=WEIGHT_BUCKET_BYTES,
                    timeout_s=self.timeout_s,
                    request_timeout_s=self.request_timeout_s,
                )
                self.trainer.open_weight_group(addresses, **options)
                self.open = True
            report = self.trainer.send_weights(version)
        except ray.exceptions.RayTaskError as error:
            log.warning("NCCL weight sync %s failed: %s", version, error)
            self.close()
            return _blame(engines, error)
        _call_each(dict(enumerate(engines)), failed, "expect_weight_version", version)
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


def _call_each(targets: dict, failed: Failed, method: str, *args) -> None:
    """`method(*args)` on every target engine not failed yet, concurrently; failures are recorded, not raised."""
    refs = {i: getattr(e, method).remote(*args) for i, e in targets.items() if i not in failed}
    for i, ref in refs.items():
        try:
            ray.get(ref)
        except ray.exceptions.RayError as error:
            failed[i] = error


def _blame(engines: Sequence, error: BaseException) -> Failed:
    """Every engine after a failed NCCL sync: those that died with their own error, the others with `error`."""
    failed: Failed = {}
    for i, e in enumerate(engines):
        try:
            ray.get(e.needs_weights.remote())
            failed[i] = error
        except ray.exceptions.RayError as probe_error:
            failed[i] = probe_error
    return failed


WeightSync = TensorWeightSync | NcclWeightSync


# ---------------------------------------------------------------------------------------------------------------------
# the trainer's side of the NCCL sync (runs inside the train actor)


class TrainerWeightGroup:
    """Trainer rank 0's weight-update group with every engine (`DistributedWeightSender`), formed on construction.

    Args:
        engines: the engines' addresses, in engine order.
        backend: "nccl" (tensors go to this process's GPU first) or "gloo" (CPU; tests).
        max_bucket_bytes: bound of one bucket (one `/update_weights_from_distributed` call).
        timeout_s: the group's timeout (rendezvous and every broadcast).
        request_timeout_s: per-attempt timeout of the HTTP calls to the servers.

    Raises:
        ValueError: an engine bound to loopback on another node (the trainer could not reach it).
    """

    def __init__(
        self,
        engines: Sequence[EngineAddress],
        *,
        backend: str,
        max_bucket_bytes: int,
        timeout_s: float = 600.0,
        request_timeout_s: float,
    ):
        here = ray.util.get_node_ip_address()
        far = [i for i, e in enumerate(engines) if e.loopback and e.node_ip != here]
        if far:
            raise ValueError(
                f"engines {far} bind 127.0.0.1 on another node than the trainer ({here}), so the NCCL weight sync "
                "cannot reach them; set rollout.sglang.host=0.0.0.0 and rollout.sglang.api_key"
            )
        local = all(e.node_ip == here for e in engines)
        self.backend = backend
        self.sender = DistributedWeightSender(
            [
                EngineEndpoint(SGLangClient(e.url, api_key=e.api_key, timeout_s=request_timeout_s), e.tp_size)
                for e in engines
            ],
            master_address="127.0.0.1" if local else here,
            master_port=_free_port(),
            backend=backend,
            max_bucket_bytes=max_bucket_bytes,
            timeout_s=timeout_s,
        )
        try:
            self.sender.init_group()
        except BaseException:
            self.sender.close()
            raise

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], weight_version: str) -> SyncReport:
        """Broadcast the tensors bucket by bucket, then label and flush every engine."""
        if self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            named_tensors = ((name, t.to(device)) for name, t in named_tensors)
        return self.sender.send(named_tensors, weight_version=weight_version)

    def close(self) -> None:
        self.sender.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
