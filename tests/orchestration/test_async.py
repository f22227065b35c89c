"""Rollouts ahead of training (issue 34, `rollout.max_staleness`), on the tiny CPU job with disaggregated placement.

The contract (orchestration/ahead.py): every sample carries the weight version that sampled it, and that is the
version the engines held for the whole generation (the producer side); a batch of step t sampled with version v is
trained at step t with t - v <= max_staleness (the consumer side); the importance weights the loss logs are
min(exp(old_logprob - rollout_logprob), cap) with old logprobs under the weights being trained; a run stopped in any
phase and resumed trains every prompt as often as the straight run and equals it metric for metric; an engine killed
during a generation ahead is replaced, given the weights the others generate with, and its prompts generated again;
max_staleness=0 is the synchronous loop (no rollout thread, no batches in checkpoints).
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import signal
import threading
from pathlib import Path

import pytest
import ray
import torch

from miles_vl.data import load_processor
from miles_vl.models.qwen3_vl.tokens import special_tokens
from miles_vl.orchestration import run_job
from miles_vl.orchestration.ahead import AHEAD_FILE, read_batches
from miles_vl.orchestration.checkpoint import CheckpointError, list_checkpoints, read_driver_state
from miles_vl.orchestration.engines import RolloutEngines
from miles_vl.orchestration.factories import build_torch
from miles_vl.orchestration.loop import JobInterrupted, check_start
from miles_vl.orchestration.trainer import Trainer
from tests.orchestration.jobs import PIXELS, metrics, tiny_job
from tests.procs import kill_actor

K = 2  # max_staleness of the runs here
STEPS = 6
ASYNC = (
    "ray.placement=disaggregate",
    "algo.tis.enabled=true",
    "algo.tis.cap=1.02",  # low enough that a stale batch has capped tokens
    "checkpoint.interval=1",
    "checkpoint.keep_last=20",
    "reward.num_workers=1",
    f"num_steps={STEPS}",
)
ENGINE_COUNTERS = ("rollout/engine_restarts", "rollout/weight_resyncs")


def config(tmp_path: Path, name: str, *overrides: str):
    return tiny_job(tmp_path, name, *ASYNC, f"rollout.max_staleness={K}", *overrides)


def comparable(record: dict, drop: tuple[str, ...] = ()) -> dict:
    """Everything but wall-clock figures (and `drop`)."""
    return {k: v for k, v in record.items() if not k.startswith(("time/", "perf/")) and k not in drop}


class Recorder:
    """What the driver hands the trainer (each train call's samples) and what the engines were asked to generate
    (thread, the engines' weight label at the start and at the end of the call, sampling seed)."""

    def __init__(self, monkeypatch):
        self.trained: list[list] = []
        self.generated: list[tuple[str, str | None, str | None, int]] = []
        train, generate = Trainer.train, RolloutEngines.generate

        def record_train(trainer, samples):
            self.trained.append(list(samples))
            return train(trainer, samples)

        def record_generate(engines, prompts, params):
            before = engines.weight_version
            out = generate(engines, prompts, params)
            self.generated.append((threading.current_thread().name, before, engines.weight_version, params.seed))
            return out

        monkeypatch.setattr(Trainer, "train", record_train)
        monkeypatch.setattr(RolloutEngines, "generate", record_generate)
        self.save_dirs: list[list[str]] = []  # what each checkpoint's directory held when the trainer began its save
        for method in ("start_checkpoint", "write_checkpoint"):
            monkeypatch.setattr(Trainer, method, self.recording_save(getattr(Trainer, method)))

    def recording_save(self, save):
        def record_save(trainer, directory):
            self.save_dirs.append(sorted(p.name for p in Path(directory).iterdir()))
            return save(trainer, directory)

        return record_save

    def prompt_counts(self) -> collections.Counter:
        """How often each prompt (its ids and a digest of its pixels: synthetic prompts may share their ids) was
        trained on, over every train call recorded."""
        return collections.Counter(
            (tuple(s.input_ids[: s.prompt_len].tolist()), hashlib.sha256(s.pixel_values.numpy().tobytes()).hexdigest())
            for samples in self.trained
            for s in samples
        )


def version_of(label: str | None) -> int:
    """loop.weight_version's inverse; None: the initial weights (no sync yet)."""
    return 0 if label is None else int(label.removeprefix("step-"))


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: max_staleness=2 for 6 steps in one go, recorded."""
    with pytest.MonkeyPatch.context() as m:
        rec = Recorder(m)
        run = run_job(config(tmp_path_factory.mktemp("async"), "straight"))
    return run, rec


def test_samples_carry_the_weights_that_sampled_them_and_the_bound_holds(straight):
    """Producer: each step's batch was generated while the engines held one weight version, the one its samples
    carry. Consumer: step t trains on weights v with t - v <= K (here exactly min(t, K): the schedule is fixed)."""
    run, rec = straight
    cfg_seed = config(Path("/unused"), "x").seed * 1_000_003
    produced = {}
    for _thread, before, after, seed in rec.generated:
        step, offset = divmod(seed - cfg_seed, 101)
        assert before == after, f"the engines changed weights under step {step + 1}'s generation"
        if offset < 50:  # not an eval round
            produced[step] = version_of(before)
    assert sorted(produced) == list(range(STEPS))
    assert any(t.startswith("rollouts-ahead") for t, *_ in rec.generated)  # batches were generated on the thread
    assert len(rec.trained) == STEPS
    for t, samples in enumerate(rec.trained):
        versions = {s.weight_version for s in samples}
        assert versions == {produced[t]}, f"step {t + 1}: tagged {versions}, generated with {produced[t]}"
        assert t - produced[t] == min(t, K) <= K
    rows = metrics(run)
    assert [r["rollout/staleness_max"] for r in rows] == [float(min(t, K)) for t in range(STEPS)]
    assert [r["rollout/staleness_mean"] for r in rows] == [float(min(t, K)) for t in range(STEPS)]
    # the checkpoint of step 3 holds the batches of steps 4 and 5 (0-based 3, 4), sampled with the weights of 1 and 2
    state = read_driver_state(run / "checkpoints" / "step_00000003")
    assert state["rollouts_ahead"] == [[3, 1], [4, 2]]
    held = read_batches(run / "checkpoints" / "step_00000003")
    assert [(b["step"], b["weight_version"]) for b in held] == [(3, 1), (4, 2)]
    assert not (run / "checkpoints" / f"step_{STEPS:08d}" / AHEAD_FILE).exists()  # nothing ahead of the last step
    # the trainer's save began in an empty directory, the batches ahead came after it: megatron-core warns of an
    # "old incomplete / corrupted checkpoint" in a directory that is not (2026-11-27's 2B run at staleness 1)
    assert len(rec.save_dirs) == STEPS and all(listing == [] for listing in rec.save_dirs), rec.save_dirs


def test_importance_weights_equal_the_formula(straight):
    """train/tis_weight_mean, _max and tis_capped_frac of a stale step are those of w_t = min(exp(old_t - rollout_t),
    cap) over its response tokens, old_t under the weights the step starts from (its predecessor's checkpoint)."""
    run, rec = straight
    cfg = config(Path("/unused"), "x")
    cap = cfg.algo.tis.cap
    backend = build_torch(cfg, special_tokens(load_processor("offline", *PIXELS)))
    rows = metrics(run)
    for t in (3, 5):  # steps 4 and 6 (1-based), both trained on batches 2 steps old
        backend.load_checkpoint(run / "checkpoints" / f"step_{t:08d}")
        samples = rec.trained[t]
        assert {t - s.weight_version for s in samples} == {K}
        old = backend.compute_logprobs(samples)
        ratios = [math.exp(o - r) for s, lp in zip(samples, old, strict=True) for o, r in
                  zip(lp.tolist(), s.rollout_logprobs.tolist(), strict=True)]  # fmt: skip
        weights = [min(x, cap) for x in ratios]
        assert any(abs(x - 1) > 1e-3 for x in ratios)  # stale weights: the correction is not the identity
        row = rows[t]
        assert row["train/tis_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-4)
        assert row["train/tis_weight_max"] == pytest.approx(max(weights), rel=1e-4)
        assert row["train/tis_capped_frac"] == pytest.approx(sum(x > cap for x in ratios) / len(ratios), abs=1e-6)


def signal_during(monkeypatch, cls, method: str, call: int, signum: int, thread_prefix: str = "") -> None:
    """Send `signum` to this process at the start of the `call`-th call of `cls.method` made by a thread whose name
    starts with `thread_prefix`."""
    original = getattr(cls, method)
    seen = [0]

    def wrapper(self, *args, **kwargs):
        if threading.current_thread().name.startswith(thread_prefix):
            seen[0] += 1
            if seen[0] == call:
                os.kill(os.getpid(), signum)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, wrapper)


STOPS = [  # (phase, class, method, which call, thread)
    ("generation ahead", RolloutEngines, "generate", 2, "rollouts-ahead", signal.SIGTERM),
    ("train", Trainer, "train", 2, "", signal.SIGINT),
    ("sync", RolloutEngines, "sync_weights", 2, "", signal.SIGTERM),
]


def test_stopped_in_every_phase_and_resumed_trains_each_prompt_as_the_straight_run(tmp_path, straight):
    """Issue 34.2: three stops (during a generation on the rollout thread, in training, in the sync), each ending with
    the checkpoint of the last completed step, then the same command to the end: the prompts trained, counted over
    every segment, are those of the straight run, each as often (none twice, none skipped), and the run equals the
    straight one record for record."""
    reference, ref_rec = straight
    run_dir = tmp_path / "chain"
    counts: collections.Counter = collections.Counter()
    for phase, cls, method, call, thread, signum in STOPS:
        with pytest.MonkeyPatch.context() as m:
            rec = Recorder(m)
            signal_during(m, cls, method, call, signum, thread)
            with pytest.raises(JobInterrupted) as info:
                run_job(config(tmp_path, "chain"))
        saved = [s for s, _ in list_checkpoints(run_dir / "checkpoints")][-1]
        assert info.value.checkpoint == saved, phase
        assert [r["step"] for r in metrics(run_dir)] == list(range(1, saved + 1)), phase  # logged = saved
        counts += rec.prompt_counts()
    assert saved < STEPS
    with pytest.MonkeyPatch.context() as m:
        rec = Recorder(m)
        run_job(config(tmp_path, "chain"))
    counts += rec.prompt_counts()
    assert counts == ref_rec.prompt_counts()
    assert sum(counts.values()) == STEPS * 2 * 2  # steps x prompts x samples per prompt
    assert [comparable(r) for r in metrics(run_dir)] == [comparable(r) for r in metrics(reference)]


def test_an_engine_killed_during_a_generation_ahead_is_replaced_and_nothing_is_lost(tmp_path, monkeypatch, straight):
    """Issue 34.2: engine 0 dies as the rollout thread starts a batch ahead, while the trainer trains. It is replaced,
    given the weights the other engines generate with (the last sync's, not the trainer's newer ones), and its prompts
    generated again: the run equals the straight one but for the restart counters."""
    reference, ref_rec = straight
    original = RolloutEngines.generate
    seen = [0]

    def kill_then_generate(engines, prompts, params):
        if threading.current_thread().name.startswith("rollouts-ahead"):
            seen[0] += 1
            if seen[0] == 3:
                kill_actor(engines.engines[0])
        return original(engines, prompts, params)

    monkeypatch.setattr(RolloutEngines, "generate", kill_then_generate)
    run = run_job(config(tmp_path, "engine-death", "rollout.num_engines=2"))
    rows = metrics(run)
    assert rows[-1]["rollout/engine_restarts"] == 1
    monkeypatch.undo()  # the same job without the kill
    again = run_job(config(tmp_path, "no-death", "rollout.num_engines=2"))
    assert [comparable(r, ENGINE_COUNTERS) for r in rows] == [comparable(r, ENGINE_COUNTERS) for r in metrics(again)]


def test_a_resume_under_a_smaller_bound_is_refused_before_ray(tmp_path, straight):
    """A checkpoint's batches ahead were sampled up to K steps before the step that trains them: resuming it with a
    smaller max_staleness (0 included) is refused, naming the bound that would take them (here a branch of the
    straight run's step 3 into a new run directory; the bound K itself is accepted)."""
    run, _ = straight
    ckpt = run / "checkpoints" / "step_00000003"
    branch = tmp_path / "branch"
    assert check_start(config(tmp_path, "branch"), branch, branch / "checkpoints", ckpt, dry_run=True)["step"] == 3
    for smaller in (0, 1):
        cfg = tiny_job(tmp_path, "branch", *ASYNC, f"rollout.max_staleness={smaller}")
        with pytest.raises(
            CheckpointError, match=f"rollout.max_staleness={smaller}; resume with rollout.max_staleness >= 2"
        ):
            check_start(cfg, branch, branch / "checkpoints", ckpt, dry_run=True)


def test_staleness_0_is_the_synchronous_loop(tmp_path, monkeypatch):
    """max_staleness=0 (the default) with disaggregated placement: no rollout thread, every batch sampled with the
    weights it is trained from, no staleness metrics and no batches in checkpoints."""
    rec = Recorder(monkeypatch)
    run = run_job(tiny_job(tmp_path, "sync", *ASYNC, "num_steps=3"))
    assert {t for t, *_ in rec.generated} == {threading.main_thread().name}
    assert [{s.weight_version for s in samples} for samples in rec.trained] == [{0}, {1}, {2}]
    assert not any(k.startswith("rollout/staleness") or k == "time/rollout_wait_s" for r in metrics(run) for k in r)
    for _, path in list_checkpoints(run / "checkpoints"):
        assert not (path / AHEAD_FILE).exists() and "rollouts_ahead" not in read_driver_state(path)
    assert torch.is_tensor(rec.trained[0][0].input_ids)
