"""The rollout engines as one group: launch, generate with recovery, memory release around training, weight sync.

    rollout = RolloutEngines(cfg, tokens, kind, weights, log_dir, gpus)   # rollout.num_engines actors of `kind`
    groups = rollout.generate(prompts, params)                   # prompts split over the engines, prompt order kept
    rollout.release_memory(); <train>; rollout.resume_memory(WEIGHTS_MEMORY)   # colocated placement only
    rollout.sync_weights("step-3")       # trainer -> every engine (miles_vl/rollout/weight_sync.py)
    rollout.resume_memory()              # colocated: the KV cache and CUDA graphs, after the sync

Every engine is a Ray actor that implements `miles_vl.rollout.RolloutEngine`; `kind` (factories.py) launches it.

Recovery. When a call fails on engine i, the group looks at why:
- the engine is dead (its actor died, or it raised `EngineDiedError`: e.g. its sglang host gave up relaunching the
  server): a new actor replaces it;
- the engine lives but has lost the current weights (its SGLang server restarted and reloaded model.path, or a sync
  to it broke off; the engine refuses to generate in that state);
then syncs the current weights to it again (`repair`) and retries the call, at most `rollout.max_restarts` times per
call: no prompt is lost and no sample comes from stale weights. Any other error is raised. The same recovery covers
every call of the loop: generate, release_memory, resume_memory (an engine that dies while the trainer runs is found
here) and the weight sync. A replacement starts with its memory held: after release_memory it is released too, after
resume_memory it needs nothing more. Counted in the step metrics: `rollout/engine_restarts` (actors replaced +
servers relaunched) and `rollout/weight_resyncs`.

Two threads. With batches generated ahead (orchestration/ahead.py) the rollout thread runs `generate` beside the
driver's calls (with partial rollouts: pause, sync, continue), and both may find one dead engine. A lock serializes
every recovery and every weight sync, and a recovery replaces engine i only if the handle that failed is still engine
i's: when the other thread already replaced it (and gave it the current weights), the caller uses the new engine and
nothing is relaunched twice. Between `pause_generation` and `continue_generation` a replacement is paused as it
starts, so that a retried generate waits for the sync like the others. An engine found dead by the pause or the
continue counts as paused (continued) with nothing in flight: its generate in flight fails, and the rollout thread's
recovery replaces it and sends its prompts again from the start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from miles_vl.config import JobConfig
from miles_vl.models import SpecialTokens
from miles_vl.orchestration.factories import GENERATE_GROUP, EngineKind, EngineSlot
from miles_vl.orchestration.placement import COLOCATED_GPU_SHARE, GpuPlacement, cpu_only_options, engine_slots
from miles_vl.rollout import EngineDiedError, Generation, RolloutEngine, SamplingParams
from miles_vl.rollout.weight_sync import Failed, WeightSync, call_each

log = logging.getLogger(__name__)


class RolloutEngines:
    """`rollout.num_engines` rollout actors of one kind and the way weights reach them.

    Args:
        cfg: the job config.
        tokens: special token ids.
        kind: the engine (`factories.ENGINES[rollout.backend]`).
        weights: the weight sync from the trainer (`miles_vl.rollout.weight_sync.make_weight_sync`).
        log_dir: where engines write their logs (an sglang server's `sglang_<i>.log`).
        gpus: the trainer's GPU slots; colocated engines take theirs (`placement.engine_slots`). None: no GPUs.

    Raises:
        ray.exceptions.RayActorError: an engine could not start (for sglang, the message quotes the server's log).
    """

    def __init__(
        self,
        cfg: JobConfig,
        tokens: SpecialTokens,
        kind: EngineKind,
        weights: WeightSync,
        log_dir: Path,
        gpus: GpuPlacement | None = None,
    ):
        self.cfg = cfg
        r = cfg.rollout
        self.gpus = gpus if cfg.ray.placement == "colocate" else None
        self.slots = engine_slots(gpus.slots, r.num_engines, r.gpus_per_engine) if self.gpus else None
        self.tokens = tokens
        self.kind = kind
        self.log_dir = log_dir
        self.weight_sync = weights
        self.weight_version: str | None = None  # None: the engines still hold the initial weights
        self.replaced = 0
        self.resyncs = 0
        self.restarts_before = 0  # engine restarts of the run before a resume
        self.closed = False  # after close(): a failed call is not recovered (a rollout thread may still call)
        self._server_restarts = [0] * cfg.rollout.num_engines  # last seen per engine
        self._server_restarts_of_replaced = 0
        self._lock = threading.RLock()  # recovery and weight syncs, from the driver and the rollout thread
        self._paused = False  # between pause_generation and continue_generation: a replacement starts paused
        self.engines: list[RolloutEngine] = [self._launch(i) for i in range(cfg.rollout.num_engines)]  # actor handles
        try:
            ray.get([e.ready.remote() for e in self.engines])  # a server that cannot start fails here, with its log
        except BaseException:
            self.close()
            raise

    # -- the calls of the driver loop ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence, params: SamplingParams) -> list[list[Generation]]:
        """`params.n` generations per prompt, in prompt order; a failed engine is recovered and its prompts retried.

        Raises:
            RuntimeError: one engine failed more than `rollout.max_restarts` times in this call.
        """
        if not self.kind.sends_pixels(self.cfg):
            prompts = strip_pixels(prompts)
        chunks = _split(list(prompts), len(self.engines))
        results: dict[int, list[list[Generation]]] = {}
        pending = {i: self._generate(i, c, params) for i, c in enumerate(chunks) if c}  # i -> (engine, its call)
        failures = 0
        while pending:
            i = next(iter(pending))
            engine, ref = pending.pop(i)
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayError as error:
                failures += 1
                if failures > self.cfg.rollout.max_restarts:
                    raise RuntimeError(
                        f"rollout engine {i} failed {failures} times in one call (rollout.max_restarts="
                        f"{self.cfg.rollout.max_restarts}); see its log above"
                    ) from error
                log.warning("rollout engine %d failed; recovering it and retrying its %d prompts", i, len(chunks[i]))
                self._recover({i: error}, {i: engine})
                pending[i] = self._generate(i, chunks[i], params)
        return [g for i in range(len(chunks)) for g in results.get(i, [])]

    def _generate(self, i: int, prompts: list, params: SamplingParams) -> tuple[RolloutEngine, ray.ObjectRef]:
        """Engine `i` and its generate call; with partial rollouts in the actor's generate group, so that a pause
        reaches the engine while it runs (factories.py `actor_class`)."""
        engine = self.engines[i]
        method = engine.generate
        if self.cfg.rollout.partial_rollouts:
            method = method.options(concurrency_group=GENERATE_GROUP)
        return engine, method.remote(prompts, params)

    def pause_generation(self) -> int:
        """Partial rollouts, before a weight sync: every engine aborts its requests in flight and keeps their samples
        (rollout/sglang/engine.py); returns once none runs, with how many requests were aborted. An engine that is
        dead counts as paused with nothing in flight (module docstring); an engine replaced until
        `continue_generation` starts paused.

        Raises:
            ray.exceptions.RayError: an engine failed its pause without being dead (e.g. `EngineStateError`).
        """
        with self._lock:  # a replacement is either in this list or launched after the flag is set
            self._paused = True
            engines = list(self.engines)
        return sum(_each_alive(engines, "pause_generation", "paused with nothing in flight"))

    def continue_generation(self) -> None:
        """Partial rollouts, after the sync: the paused generations go on under the new weights. A dead engine is
        skipped (the rollout thread's recovery replaces it, unpaused)."""
        with self._lock:
            self._paused = False
            engines = list(self.engines)
        _each_alive(engines, "continue_generation", "nothing to continue")

    def release_memory(self) -> None:
        """Colocated: the engines free their accelerator memory for the trainer (no-op when disaggregated); a dead
        engine is replaced and its replacement released."""
        if self.cfg.ray.placement == "colocate":
            self._on_every_engine("release_memory", again_after_recovery=True)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Colocated: the engines take their memory back, `tags` of it (`miles_vl.rollout.types.MEMORY_TAGS`; None:
        all still released; sglang weights are then undefined until the sync); an engine that died meanwhile (e.g.
        while the trainer ran) is replaced, with all its memory and the current weights."""
        if self.cfg.ray.placement == "colocate":
            self._on_every_engine("resume_memory", False, tags)

    def sync_weights(self, version: str) -> None:
        """The trainer's current weights to every engine, labelled `version` (engines that fail are recovered)."""
        with self._lock:  # not beside a recovery of the rollout thread: that one would sync or replace engines too
            self.weight_version = version
            engines = list(self.engines)
            failed = self.weight_sync.push(engines, version)
            if failed:
                self._recover(failed, dict(enumerate(engines)))

    def restarts(self) -> int:
        """Engine restarts of the whole run: actors replaced plus SGLang servers relaunched by their hosts (an engine
        that died since its last call keeps its last count; the next call replaces it)."""
        refs = [e.server_restarts.remote() for e in self.engines]
        for i, ref in enumerate(refs):
            with contextlib.suppress(ray.exceptions.RayActorError):
                self._server_restarts[i] = ray.get(ref)
        return self.restarts_before + self.replaced + self._server_restarts_of_replaced + sum(self._server_restarts)

    def close(self) -> None:
        """Leave any weight-update group, stop every server, end the actors."""
        self.closed = True
        with contextlib.suppress(ray.exceptions.RayError):
            self.weight_sync.close()
        for engine in self.engines:
            _end(engine)

    # -- recovery ------------------------------------------------------------------------------------------------

    def _on_every_engine(self, method: str, again_after_recovery: bool, *args: Any) -> None:
        """Call `method(*args)` on every engine; engines that fail are recovered (`_recover`), and called again when
        `again_after_recovery` (a fresh engine is in the state `method` leaves the others in otherwise).

        Raises:
            RuntimeError: an engine failed more than `rollout.max_restarts` times in this call.
        """
        used = dict(enumerate(self.engines))
        pending = {i: getattr(e, method).remote(*args) for i, e in used.items()}
        for attempt in range(self.cfg.rollout.max_restarts + 1):
            failed: Failed = {}
            for i, ref in pending.items():
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as error:
                    failed[i] = error
            if not failed:
                return
            if attempt == self.cfg.rollout.max_restarts:
                raise RuntimeError(
                    f"rollout engines {sorted(failed)} failed {method} {attempt + 1} times (rollout.max_restarts="
                    f"{self.cfg.rollout.max_restarts}); see their logs"
                ) from next(iter(failed.values()))
            log.warning("rollout engine(s) %s failed in %s; recovering them", sorted(failed), method)
            self._recover(failed, used)
            if not again_after_recovery:
                return
            used = {i: self.engines[i] for i in failed}
            pending = {i: getattr(e, method).remote(*args) for i, e in used.items()}

    def _recover(self, failed: Failed, used: Mapping[int, RolloutEngine]) -> None:
        """Bring the failed engines back with the current weights (module docstring); at most
        `rollout.max_restarts` rounds when the repair itself fails. `used`: the engine each failed call went to; one
        that is no longer engine i's was replaced (and given the current weights) by the other thread: skipped."""
        with self._lock:
            self._recover_locked(failed, used)

    def _recover_locked(self, failed: Failed, used: Mapping[int, RolloutEngine]) -> None:
        if self.closed:
            raise RuntimeError("the rollout engines were closed (the job is ending): not recovering them")
        for i in sorted(i for i in failed if self.engines[i] is not used[i]):
            log.warning("rollout engine %d was already replaced by another call's recovery; using the new one", i)
        failed = {i: error for i, error in failed.items() if self.engines[i] is used[i]}
        if not failed:
            return
        for _ in range(self.cfg.rollout.max_restarts + 1):
            for i, error in failed.items():
                self._triage(i, error)
            if self.weight_version is None:
                return  # fresh or restarted engines hold the initial weights, which are still current
            self.resyncs += len(failed)
            log.warning("syncing weights %s again to engine(s) %s", self.weight_version, sorted(failed))
            failed = self.weight_sync.repair(self.engines, sorted(failed), self.weight_version)
            if not failed:
                return
        raise RuntimeError(
            f"rollout engines {sorted(failed)} could not be given weights {self.weight_version} in "
            f"{self.cfg.rollout.max_restarts + 1} attempts (rollout.max_restarts); see their logs"
        ) from next(iter(failed.values()))

    def _triage(self, i: int, error: BaseException) -> None:
        """Replace engine i if it is dead; return if it lives but lost its weights (the repair syncs it); raise
        `error` otherwise (e.g. a prompt-id mismatch: retrying would not help)."""
        dead = _is_dead(error)
        if not dead:
            try:
                lost_weights = ray.get(self.engines[i].needs_weights.remote())
            except ray.exceptions.RayActorError:
                lost_weights, dead = False, True
            if lost_weights:
                log.warning("rollout engine %d lost its weights (its server restarted or a sync broke off)", i)
                return
            if not dead:
                raise error
        log.warning("rollout engine %d is dead (%s); replacing it", i, str(error).splitlines()[0][:300])
        _end(self.engines[i])
        self._server_restarts_of_replaced += self._server_restarts[i]
        self._server_restarts[i] = 0
        self.engines[i] = self._launch(i)
        ray.get(self.engines[i].ready.remote())
        if self._paused:  # its retried generate must wait for the sync like the other engines' requests
            ray.get(self.engines[i].pause_generation.remote())
        self.replaced += 1

    def _launch(self, i: int):
        r = self.cfg.rollout
        gpu_ids = None
        if self.slots is not None:  # colocated: the actor in the bundle of its first GPU, its server on all of them
            slots = self.slots[i]
            options = dict(num_cpus=0, num_gpus=COLOCATED_GPU_SHARE, scheduling_strategy=self.gpus.strategy(slots[0]))
            gpu_ids = [s.gpu_id for s in slots]
        elif self.cfg.train.num_gpus > 0:  # disaggregated: whole GPUs of its own
            options = dict(num_cpus=1, num_gpus=r.gpus_per_engine)
        else:
            options = cpu_only_options()
        options["max_restarts"] = 0
        return self.kind.launch(self.cfg, self.tokens, EngineSlot(i, options, gpu_ids, self.log_dir))


def strip_pixels(prompts: Sequence) -> list:
    """The prompts without `pixel_values`, for an engine that processes the `images` itself (sglang): the pixels would
    only cost object-store traffic (tens of MB per prompt at geo3k resolutions)."""
    return [dataclasses.replace(p, pixel_values=None) for p in prompts]


def _is_dead(error: BaseException) -> bool:
    """The engine's actor died, or it raised `EngineDiedError` (e.g. its sglang server is gone)."""
    return isinstance(error, ray.exceptions.RayActorError) or isinstance(getattr(error, "cause", None), EngineDiedError)


def _each_alive(engines: Sequence[RolloutEngine], method: str, dead_means: str) -> list[Any]:
    """`method()` on every engine, each apart; the answers of the live ones. A dead engine is logged (`dead_means`:
    how the caller counts it) and left out; any other failure is raised."""
    failed: Failed = {}
    answers = call_each(dict(enumerate(engines)), failed, method)
    for i, error in failed.items():
        if not _is_dead(error):
            raise error
        log.warning("rollout engine %d is dead at %s (%s): %s", i, method, str(error).splitlines()[0][:300], dead_means)
    return list(answers.values())


def _end(engine) -> None:
    """Stop the engine's server (sglang: its whole process group, which outlives a killed actor) and the actor."""
    with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        ray.get(engine.shutdown.remote(), timeout=120)
    with contextlib.suppress(ValueError):
        ray.kill(engine, no_restart=True)


def _split(items: list, n: int) -> list[list]:
    k, m = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + k + (1 if i < m else 0)
        out.append(items[start:end])
        start = end
    return out
