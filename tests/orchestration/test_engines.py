"""`RolloutEngines.pause_generation` / `continue_generation` with engines that die (issue 34, partial rollouts): each
engine is paused apart; one found dead (its actor gone, or `EngineDiedError`: its server gone) counts as paused with
nothing in flight and the others' counts are kept; any other failure (the `EngineStateError` of a misuse) is raised.

The engines are Ray actors of `PausingEngine`, a stand-in that only answers the calls these contracts need.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from miles_vl.orchestration.engines import RolloutEngines
from miles_vl.orchestration.factories import EngineKind, EngineSlot
from miles_vl.rollout import EngineDiedError
from miles_vl.rollout.sglang.engine import EngineStateError
from tests.orchestration.jobs import tiny_job
from tests.procs import kill_actor


class PausingEngine:
    """A stand-in engine: its pause answers `in_flight` requests aborted, or raises `fail` (an exception)."""

    def __init__(self, in_flight: int, fail: BaseException | None = None):
        self.in_flight = in_flight
        self.fail = fail
        self.continued = False

    def ready(self) -> bool:
        return True

    def pause_generation(self) -> int:
        if self.fail is not None:
            raise self.fail
        return self.in_flight

    def continue_generation(self) -> None:
        if self.fail is not None:
            raise self.fail
        self.continued = True

    def was_continued(self) -> bool:
        return self.continued

    def server_restarts(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def engines(tmp_path: Path, *answers: int | BaseException) -> RolloutEngines:
    """One stand-in engine per answer: an int is its count of aborted requests, an exception what its calls raise."""

    def launch(cfg, tokens, slot: EngineSlot):
        answer = answers[slot.index]
        args = (answer, None) if isinstance(answer, int) else (0, answer)
        return ray.remote(PausingEngine).options(**slot.ray_options).remote(*args)

    cfg = tiny_job(tmp_path, "engines", f"rollout.num_engines={len(answers)}", "rollout.max_restarts=1")
    no_weight_sync = SimpleNamespace(close=lambda: None)  # the pause and the continue sync nothing
    return RolloutEngines(cfg, None, EngineKind(launch=launch), no_weight_sync, tmp_path)


def test_a_dead_engine_counts_as_paused_and_the_others_are_paused_as_usual(tmp_path, caplog):
    """Engine 1's actor is dead and engine 3's server is gone (`EngineDiedError`): the pause returns the other two
    engines' counts (2 + 3), logs each dead one by index, and the continue reaches the live ones."""
    group = engines(tmp_path, 2, 7, 3, EngineDiedError("server exited with code 1"))
    kill_actor(group.engines[1])
    with caplog.at_level(logging.WARNING, logger="miles_vl.orchestration.engines"):
        assert group.pause_generation() == 2 + 3
        group.continue_generation()
    dead = [r.getMessage() for r in caplog.records if "is dead at" in r.getMessage()]
    assert [m.split(" is dead at ")[0] for m in dead] == ["rollout engine 1", "rollout engine 3"] * 2
    assert ray.get([group.engines[i].was_continued.remote() for i in (0, 2)]) == [True, True]
    assert group.replaced == 0  # the pause and the continue relaunch nothing: the rollout thread's recovery does
    group.close()


def test_a_pause_that_fails_without_a_death_still_raises(tmp_path):
    """A misuse (the engine's `EngineStateError`) is not a death: the pause fails, as before."""
    group = engines(tmp_path, 2, EngineStateError("pause_generation() needs an engine built with partial_rollouts"))
    with pytest.raises(EngineStateError, match="needs an engine built with partial_rollouts"):
        group.pause_generation()
    group.close()


class SyncingEngine:
    """A stand-in engine for the NCCL sync's first steps: `begin_weight_sync` answers; `endpoint` answers an address,
    or (`dies`) ends the actor's process, as an engine killed between the two calls."""

    def __init__(self, dies: bool):
        self.dies = dies

    def begin_weight_sync(self) -> None:
        pass

    def endpoint(self) -> str:
        if self.dies:
            os._exit(1)
        return "http://127.0.0.1:1"


def test_an_engine_that_dies_before_the_nccl_group_forms_is_reported_failed_not_raised():
    """`NcclWeightSync.push` on the first sync asks every engine for its endpoint after `begin_weight_sync`: an engine
    that died in between (seen under load in test_partial_rollouts.py's killed-while-paused test) is returned as
    failed, for the caller to recover and sync again, instead of an ActorDiedError that failed the step."""
    from miles_vl.rollout.weight_sync import NcclWeightSync

    actor = ray.remote(SyncingEngine)
    engines = [actor.remote(dies=False), actor.remote(dies=True)]
    sync = NcclWeightSync(trainer=None, group=None, backend="gloo", options=None)  # not reached: no group forms
    failed = sync.push(engines, "v1")
    assert list(failed) == [1] and isinstance(failed[1], ray.exceptions.RayActorError)
    assert not sync.open
