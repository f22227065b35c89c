"""Partial rollouts in the driver loop (issue 34, item 2: `rollout.partial_rollouts`), end to end on CPU with the
SGLang stand-in servers of test_sglang_loop.py (tests/rollout/sglang/hf_server.py: the tiny HF Qwen3-VL behind
SGLang 0.5.16's HTTP API, launched by the real host), disaggregated, `max_staleness=1`.

The stand-in holds one sample of the batch generated ahead (its "hold" fault, from a fault file: it decodes 2 tokens
and waits for an `/abort_request`): the batch cannot finish before the trainer is done with the step, so the weight
sync that ends the step meets a generation in flight (each test's first pause waits until the stand-in holds it:
`wait_for_the_hold`). The driver pauses the engine (abort_all), syncs, and continues:
the held sample comes back with its 3 tokens so far, is sent again as prompt + those tokens under the new weights, and
is trained at the next step as one sample whose tokens carry two versions (span 1: the weights of step 0, span 2:
those of step 1): nothing lost, nothing trained twice; the step's per-token staleness is below its per-sample one.

An engine killed near that sync (while paused, or just before the pause) is found dead by two threads: the driver's
pause or sync and the rollout thread's generate. The pause counts it as paused, one of the two replaces it and the
other uses the replacement (one relaunch), the replacement waits for the sync, and the engine's prompts are generated
again from the start under the new weights: the step completes and nothing is lost.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import threading
import time
from contextlib import suppress
from pathlib import Path

import httpx
import pytest
import ray

from miles_vl.orchestration import run_job
from miles_vl.orchestration.engines import RolloutEngines
from miles_vl.orchestration.loop import JobInterrupted
from miles_vl.orchestration.trainer import Trainer
from miles_vl.rollout.weight_sync import WeightSyncOptions
from tests.orchestration.jobs import metrics, stand_ins, write_checkpoint
from tests.orchestration.test_sglang_loop import config
from tests.procs import kill_actor

SAMPLES = 4  # rollout.batch_size=2 x n_samples_per_prompt=2 (the tiny job)


def was_continued(sample) -> bool:
    """Sampled by two weight versions (a partial rollout continued it); every sample of the mode has token_versions."""
    return sample.token_versions is not None and len(set(sample.token_versions.tolist())) > 1


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_qwen3vl"))


class Recorder:
    """The samples of every train call the driver makes."""

    def __init__(self, monkeypatch):
        self.trained: list[list] = []
        train = Trainer.train

        def record_train(trainer, samples):
            self.trained.append(list(samples))
            return train(trainer, samples)

        monkeypatch.setattr(Trainer, "train", record_train)

    def prompt_counts(self) -> collections.Counter:
        return collections.Counter(tuple(s.input_ids[: s.prompt_len].tolist()) for ss in self.trained for s in ss)


def partial_job(tmp_path: Path, checkpoint: Path, name: str, fault: Path | None = None):
    """3 steps, max_staleness 1, partial rollouts; with `fault`: the stand-in's fault file (read when it starts)."""
    extra = f"rollout.sglang.extra_args=[--fake-fault-file,{fault}]" if fault else "rollout.sglang.extra_args=[]"
    return config(
        tmp_path,
        checkpoint,
        name,
        "num_steps=3",
        "ray.placement=disaggregate",
        "rollout.num_engines=1",
        "eval.interval=0",
        "rollout.max_staleness=1",
        "rollout.partial_rollouts=true",
        "algo.tis.enabled=true",
        extra,
    )


def hold_after_batch_0(path: Path) -> Path:
    """The first sample after batch 0's (generated before the trainer starts) with at least 4 tokens holds after 2 until
    an abort reaches it: the abort's extra step makes 3, and the sample goes on after it (continued). The stand-in
    samples a fresh seed per request, so which sample comes first and how long it is vary: without `min_tokens` a
    sample ending within its first 3 tokens took the fault and none was continued (flaky)."""
    fault = {"path": "/generate", "kind": "hold", "value": 2, "times": 1, "after": SAMPLES, "min_tokens": 4}
    path.write_text(json.dumps(fault))
    return path


WAIT_S = 120  # a test's own wait for the other thread: far above what it takes, so that a hang fails the test


def wait_for_the_hold(engines: RolloutEngines) -> None:
    """Until engine 0's stand-in holds batch 1's sample and that is the engine's one request in flight (the other
    prompt's is answered). Each test's first pause calls this: the pause raced the rollout thread before, since the
    tiny CPU train step can end before batch 1 is sent (the pause then finds nothing in flight, and batch 1, sent after
    the sync, holds with no abort to come)."""
    engine = engines.engines[0]
    url = ray.get(engine.__ray_call__.remote(lambda host: host.url))
    deadline = time.monotonic() + WAIT_S
    while True:
        held = httpx.get(f"{url}/_fake/held", timeout=10).json()["held"]
        in_flight = ray.get(engine.__ray_call__.remote(lambda host: host.engine._sending))
        if held >= 1 and in_flight == 1:
            return
        assert time.monotonic() < deadline, f"batch 1 not held at the stand-in: {held} held, {in_flight} in flight"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, checkpoint, local_ray):
    tmp_path = tmp_path_factory.mktemp("partial")
    fault = hold_after_batch_0(tmp_path / "fault.json")
    pause = RolloutEngines.pause_generation
    with pytest.MonkeyPatch.context() as m:
        rec = Recorder(m)

        def wait_then_pause(engines):
            m.setattr(RolloutEngines, "pause_generation", pause)  # once
            wait_for_the_hold(engines)
            return pause(engines)

        m.setattr(RolloutEngines, "pause_generation", wait_then_pause)
        run = run_job(partial_job(tmp_path, checkpoint, "straight", fault), hooks=hooks_())
    assert not fault.exists()  # the server took the fault
    return run, rec


def hooks_():
    return stand_ins(sglang=True, weight_sync=WeightSyncOptions(bucket_bytes=64 * 1024))


def test_a_generation_in_flight_at_a_sync_is_continued_and_trained_once(straight):
    run, rec = straight
    rows = metrics(run)
    assert [r["rollout/continued_samples"] for r in rows] == [0.0, 1.0, 0.0]
    assert rows[1]["rollout/staleness_mean"] == 1.0  # every sample began under the weights of step 0 ...
    assert rows[1]["rollout/token_staleness_mean"] < 1.0  # ... but the continued one's second span is fresh

    assert [len(samples) for samples in rec.trained] == [SAMPLES] * 3  # nothing lost
    [continued] = [s for samples in rec.trained for s in samples if was_continued(s)]
    assert any(s is continued for s in rec.trained[1])  # trained once, at the step its batch belongs to
    versions = continued.token_versions.tolist()
    assert versions[:3] == [0, 0, 0] and set(versions[3:]) == {1} and len(versions) > 3  # span 1: 2 + 1 tokens
    assert continued.weight_version == 0  # the bound is measured by its oldest span
    assert sum(rec.prompt_counts().values()) == 3 * SAMPLES
    log = (run / "driver.log").read_text()
    assert "Traceback" not in log


def test_a_stop_at_the_sync_that_continues_a_sample_resumes_with_the_same_prompts(tmp_path, checkpoint, straight):
    """SIGINT as the sync of step 1 pauses the engine with a sample in flight: the step finishes (the sample is
    continued and its batch completed before the commit), the checkpoint of step 1 holds that batch, continued sample
    included, and the resumed run trains it at step 2: over both runs every prompt is trained as often as in the
    straight run, and the continued sample once, with its two versions."""
    _, reference = straight
    fault = hold_after_batch_0(tmp_path / "fault.json")
    counts: collections.Counter = collections.Counter()
    pause = RolloutEngines.pause_generation
    with pytest.MonkeyPatch.context() as m:
        rec = Recorder(m)

        def stop_then_pause(engines):
            m.setattr(RolloutEngines, "pause_generation", pause)  # once
            wait_for_the_hold(engines)
            os.kill(os.getpid(), signal.SIGINT)
            return pause(engines)

        m.setattr(RolloutEngines, "pause_generation", stop_then_pause)
        with pytest.raises(JobInterrupted) as info:
            run_job(partial_job(tmp_path, checkpoint, "chain", fault), hooks=hooks_())
    assert info.value.checkpoint == 1
    counts += rec.prompt_counts()
    assert [len(samples) for samples in rec.trained] == [SAMPLES]
    with pytest.MonkeyPatch.context() as m:
        rec = Recorder(m)
        assert not fault.exists()  # taken by the first run's server: the resumed one holds nothing
        run = run_job(partial_job(tmp_path, checkpoint, "chain", fault), hooks=hooks_())
    counts += rec.prompt_counts()
    assert counts == reference.prompt_counts()
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    [continued] = [s for s in rec.trained[0] if was_continued(s)]  # from the checkpoint's batch ahead
    versions = continued.token_versions.tolist()
    assert versions[:3] == [0, 0, 0] and set(versions[3:]) == {1}
    assert sum(was_continued(s) for ss in rec.trained for s in ss) == 1


def kill_engine(engine) -> None:
    """End engine `engine`'s actor, then its server (its process group outlives the actor: nobody would stop it)."""
    pid = ray.get(engine.__ray_call__.remote(lambda host: host.server.pid))
    kill_actor(engine)
    with suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def on_rollout_thread() -> bool:
    return threading.current_thread().name.startswith("rollouts-ahead")


def check_the_dead_engines_batch_was_generated_again(run: Path, rec: Recorder, reference: Recorder) -> None:
    """One relaunch; every step trained its samples, the prompts of the straight run each as often; the batch in flight
    at the kill was generated again from the start, after the sync: each of its tokens carries version 1 (its kept span
    of version 0 died with the engine), none was continued."""
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["rollout/engine_restarts"] == 1  # the engine was relaunched once, not by each thread
    assert [len(samples) for samples in rec.trained] == [SAMPLES] * 3
    assert rec.prompt_counts() == reference.prompt_counts()
    assert [set(s.token_versions.tolist()) for s in rec.trained[1]] == [{1}] * SAMPLES
    assert [r["rollout/continued_samples"] for r in rows] == [0.0, 0.0, 0.0]


def test_an_engine_killed_while_paused_is_relaunched_once_by_the_sync(tmp_path, checkpoint, straight):
    """The engine dies after the pause of step 1 returned, with its held sample kept. The driver's sync finds it dead
    and replaces it first (the rollout thread's recovery is held until the sync returns); the rollout thread's
    recovery then finds its failed engine already replaced and sends the prompts to the new one instead of relaunching
    it again."""
    _, reference = straight
    fault = hold_after_batch_0(tmp_path / "fault.json")
    killed, synced = threading.Event(), threading.Event()
    pause, sync, recover = RolloutEngines.pause_generation, RolloutEngines.sync_weights, RolloutEngines._recover
    with pytest.MonkeyPatch.context() as m:
        rec = Recorder(m)

        def pause_then_kill(engines):
            m.setattr(RolloutEngines, "pause_generation", pause)  # once
            wait_for_the_hold(engines)
            aborted = pause(engines)
            assert aborted == 1  # the held sample was in flight
            kill_engine(engines.engines[0])
            killed.set()
            return aborted

        def sync_then_tell(engines, version):
            sync(engines, version)
            if killed.is_set():
                synced.set()

        def recover_after_the_sync(engines, *args):
            if on_rollout_thread():
                assert synced.wait(WAIT_S), "the driver's sync did not return"
            return recover(engines, *args)

        m.setattr(RolloutEngines, "pause_generation", pause_then_kill)
        m.setattr(RolloutEngines, "sync_weights", sync_then_tell)
        m.setattr(RolloutEngines, "_recover", recover_after_the_sync)
        run = run_job(partial_job(tmp_path, checkpoint, "killed-paused", fault), hooks=hooks_())
    assert synced.is_set()
    check_the_dead_engines_batch_was_generated_again(run, rec, reference)


def test_an_engine_killed_just_before_the_pause_is_counted_paused_and_its_replacement_waits(
    tmp_path, checkpoint, straight
):
    """The engine dies as the pause of step 1 begins, its sample held in flight. The pause counts it as paused with
    nothing in flight instead of failing the step; the rollout thread's recovery replaces it before the driver's sync
    (which is held until then), and the replacement starts paused: the retried prompts wait for the sync and are
    generated under the new weights."""
    _, reference = straight
    fault = hold_after_batch_0(tmp_path / "fault.json")
    paused, recovered = threading.Event(), threading.Event()
    pause, sync, recover = RolloutEngines.pause_generation, RolloutEngines.sync_weights, RolloutEngines._recover
    with pytest.MonkeyPatch.context() as m:
        rec = Recorder(m)

        def kill_then_pause(engines):
            m.setattr(RolloutEngines, "pause_generation", pause)  # once
            wait_for_the_hold(engines)
            kill_engine(engines.engines[0])
            try:
                return pause(engines)
            finally:
                paused.set()

        def sync_after_the_recovery(engines, version):
            if paused.is_set():
                assert recovered.wait(WAIT_S), "the rollout thread did not recover the engine"
            return sync(engines, version)

        def recover_after_the_pause(engines, *args):
            if not on_rollout_thread():
                return recover(engines, *args)
            assert paused.wait(WAIT_S), "the driver did not pause"
            try:
                return recover(engines, *args)
            finally:
                recovered.set()

        m.setattr(RolloutEngines, "pause_generation", kill_then_pause)
        m.setattr(RolloutEngines, "sync_weights", sync_after_the_recovery)
        m.setattr(RolloutEngines, "_recover", recover_after_the_pause)
        run = run_job(partial_job(tmp_path, checkpoint, "killed-at-pause", fault), hooks=hooks_())
    assert recovered.is_set()
    check_the_dead_engines_batch_was_generated_again(run, rec, reference)
