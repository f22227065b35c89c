"""Contracts of the driver loop on the embedded backends (Ray on CPU, tiny random Qwen3-VL, generated data):
- a run writes metrics, checkpoints and plots;
- 4 steps straight == 2 steps + resume + 2 steps, metric for metric (fixed seeds);
- a rollout engine killed mid-step is replaced and its prompts retried: no sample is lost;
- Ctrl-C writes a final checkpoint; a bad reward path fails before Ray starts.
- the next step's batch is prepared during training, with the same prompts.
- a checkpoint without the optimizer's state (checkpoint.optimizer_state=false) resumes only under that setting.
- the engines start while the trainer builds (they share no GPU); a trainer that fails to build ends the job with
  its error and stops the engines.
"""

import dataclasses
import functools
import json
import threading
import time

import pytest
import ray
import torch

from miles_vl.config import load_config
from miles_vl.data import PromptDataset, build_datasets, load_processor
from miles_vl.orchestration import loop, run_job
from miles_vl.orchestration.checkpoint import CheckpointError, list_checkpoints, step_dir_name
from miles_vl.orchestration.factories import ENGINES, TRAIN_BACKENDS, Hooks, launch_hf
from miles_vl.orchestration.loop import Job
from tests.orchestration.jobs import (
    FAST,
    REPO,
    EngineThatFailsToStart,
    EngineThatSignalsItsStart,
    FrozenClock,
    build_torch_after,
    build_torch_held,
    metrics,
    stand_ins,
)
from tests.orchestration.jobs import tiny_job as config
from tests.procs import gone_within

TINY = str(REPO / "configs" / "geo3k_tiny_cpu.yaml")


def comparable(record: dict) -> dict:
    """Everything but wall-clock figures."""
    return {k: v for k, v in record.items() if not k.startswith(("time/", "perf/"))}


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def test_resume_reproduces_the_straight_run(tmp_path, caplog):
    """... and a profile step the resume has passed is named (it was skipped silently), the later one is taken; so is
    a save_hf step passed without its HF directory (the key added on resume), and the later one is written."""
    from miles_vl.orchestration.loop import describe_start

    straight = run_job(config(tmp_path, "straight", "num_steps=4", "checkpoint.interval=0"))
    first = run_job(config(tmp_path, "split", "num_steps=2", "checkpoint.interval=1"))
    assert [s for s, _ in list_checkpoints(first / "checkpoints")] == [1, 2]  # keep_last=2
    (first / "hf" / step_dir_name(2)).mkdir(parents=True)  # as if the first run had written step 2's: not named
    cfg = config(tmp_path, "split", "num_steps=4", "train.profile_steps=[2,3]", "checkpoint.save_hf.steps=[1,2,3]")
    passed = "train.profile_steps [2] are at or before step 2, which this run resumes from"
    unsaved = "checkpoint.save_hf asks for steps [1], at or before step 2, which this run resumes from"
    start = describe_start(cfg, None)
    assert start["profile_steps"].startswith(passed) and start["save_hf"].startswith(unsaved)
    assert "miles-vl export RUN_DIR OUT_DIR --step N" in start["save_hf"]
    with caplog.at_level("WARNING", logger="miles_vl.orchestration.loop"):
        resumed = run_job(cfg)
    notes = [r.getMessage() for r in caplog.records]
    assert [m for m in notes if m.startswith(passed)] and [m for m in notes if m.startswith(unsaved)]
    assert sorted(p.name for p in (resumed / "profile").iterdir()) == ["step_3.json"]
    assert sorted(p.name for p in (resumed / "hf").iterdir()) == [step_dir_name(2), step_dir_name(3)]
    a, b = metrics(straight), metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [comparable(r) for r in a] == [comparable(r) for r in b]
    assert any(r["train/grad_norm"] > 0 for r in a)  # the rewards vary, so training does something
    assert (resumed / "plots" / "reward.png").is_file()
    assert "eval/reward_mean" in a[1] and "eval/reward_mean" not in a[0]


def saved_state(checkpoint) -> tuple[bool, set[str]]:
    """A checkpoint's driver.json `optimizer_state` and the entries of its trainer_state.pt."""
    driver = json.loads((checkpoint / "driver.json").read_text())
    return driver["optimizer_state"], set(torch.load(checkpoint / "trainer_state.pt", weights_only=True))


def test_a_checkpoint_without_optimizer_state_resumes_only_under_optimizer_state_false(tmp_path, caplog, monkeypatch):
    """checkpoint.optimizer_state: a run saved with true (step 1) resumes with false (a key a resume may change):
    its step 2 checkpoint records `optimizer_state: false` in driver.json and its trainer_state.pt holds no optimizer
    entry (the setting reached the train actor). Resuming step 2 under true is refused before Ray starts, naming the
    checkpoint, why, and the two ways on (false, or step 1, which has the state, as a branch); `miles-vl check` says
    so too. Under false it resumes, and says once that the optimizer starts afresh at step 2."""
    from miles_vl.orchestration.loop import describe_start

    run = run_job(config(tmp_path, "light", "num_steps=1", "checkpoint.interval=1"))
    with caplog.at_level("WARNING", logger="miles_vl.orchestration.loop"):
        run_job(config(tmp_path, "light", "num_steps=2", "checkpoint.interval=1", "checkpoint.optimizer_state=false"))
    assert not [r for r in caplog.records if "afresh" in r.getMessage()]  # step 1 had the optimizer's state
    step_1, step_2 = (path for _, path in list_checkpoints(run / "checkpoints"))
    rest = {"scheduler", "optimizer_steps", "skipped_steps", "rng_cpu", "rng_cuda"}
    assert saved_state(step_1) == (True, {"optimizer", *rest}) and saved_state(step_2) == (False, rest)

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    strict = config(tmp_path, "light", "num_steps=3")
    with pytest.raises(CheckpointError) as refused:
        describe_start(strict, None)
    monkeypatch.setattr(loop, "ray_session", no_ray)
    with pytest.raises(CheckpointError) as refused_too:
        run_job(strict)
    monkeypatch.undo()
    assert str(refused.value) == str(refused_too.value)
    message = str(refused.value)
    assert f"{step_2} was saved with checkpoint.optimizer_state=false: it holds no optimizer state" in message
    assert "Set checkpoint.optimizer_state=false to resume it with the optimizer started afresh" in message
    assert f"resume an older checkpoint that has it (checkpoint.resume={step_1} logging.run_name=" in message

    light = config(tmp_path, "light", "num_steps=3", "checkpoint.optimizer_state=false")
    afresh = f"{step_2} was saved with checkpoint.optimizer_state=false: the optimizer starts afresh at step 2"
    assert describe_start(light, None)["optimizer_state"].startswith(afresh)
    caplog.clear()
    with caplog.at_level("WARNING", logger="miles_vl.orchestration.loop"):
        run_job(light)
    assert [r.levelname for r in caplog.records if r.getMessage().startswith(afresh)] == ["WARNING"]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert saved_state(list_checkpoints(run / "checkpoints")[-1][1])[0] is False


def test_killed_engine_is_replaced_and_no_sample_is_lost(tmp_path):
    fault = tmp_path / "kill-once"
    fault.touch()
    run = run_job(config(tmp_path, "fault", "num_steps=2"), hooks=stand_ins(kill_once=fault))
    rows = metrics(run)
    assert not fault.exists()  # the engine did die
    assert rows[-1]["rollout/engine_restarts"] == 1
    for r in rows:  # every prompt of every step was rolled out and trained on
        assert r["rollout/prompts"] == 2
        assert r["train/n_loss_tokens"] == r["rollout/response_tokens"]


def test_ctrl_c_writes_a_final_checkpoint(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised in step 2's rollout (not through the job's signal handler): step 1 is saved."""
    original = Job.collect_batch

    def interrupt_at_step_2(self, step):
        if step == 1:
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(Job, "collect_batch", interrupt_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        run_job(config(tmp_path, "ctrlc", "num_steps=3", "checkpoint.interval=0"))
    assert [s for s, _ in list_checkpoints(tmp_path / "ctrlc" / "checkpoints")] == [1]


def test_bad_reward_fails_before_any_actor(tmp_path):
    from miles_vl.reward import RewardResolutionError

    with pytest.raises(RewardResolutionError, match="no_such_module"):
        run_job(config(tmp_path, "bad", "reward.name=no_such_module:fn"))
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_a_fresh_start_that_fails_before_ray_leaves_no_directory(tmp_path):
    """A `checkpoint.resume=never` start without a run_name claims its directory first (issue 30.3); bad input found
    after that, before Ray, removes it again."""
    from miles_vl.reward import RewardResolutionError

    cfg = config(
        tmp_path, "unused", "logging.run_name=null", "checkpoint.resume=never", "reward.name=no_such_module:fn"
    )
    with pytest.raises(RewardResolutionError, match="no_such_module"):
        run_job(cfg, config_path=TINY)
    assert list(tmp_path.iterdir()) == []


def test_miles_vl_train_claims_its_new_directory_before_it_loads_anything(tmp_path, monkeypatch):
    """Issue 30.3 on the CLI path: a second fresh start in the same second, made while `miles-vl train` loads its
    processor and data (before it writes anything), used to get the same directory. Now it gets `-2`, and the first
    run's files are all in its own directory."""
    from miles_vl.cli import main
    from miles_vl.orchestration import loop

    monkeypatch.setattr(loop, "datetime", FrozenClock)
    args = [*FAST, f"logging.output_dir={tmp_path}", "checkpoint.resume=never", "num_steps=1", "reward.num_workers=1"]
    second: list = []
    load_processor = loop.load_processor

    def second_start_meanwhile(*a, **kw):
        second.append(loop.choose_run_dir(load_config(TINY, args), TINY))
        return load_processor(*a, **kw)

    monkeypatch.setattr(loop, "load_processor", second_start_meanwhile)
    assert main(["train", TINY, *args]) == 0
    first = tmp_path / "geo3k_tiny_cpu-20261126-120000"
    assert second == [first.with_name(f"{first.name}-2")]
    assert [r["step"] for r in metrics(first)] == [1] and list(second[0].iterdir()) == []


def test_dynamic_sampling_drops_flat_groups_and_refills(tmp_path):
    run = run_job(
        config(
            tmp_path,
            "dapo",
            "num_steps=2",
            "rollout.dynamic_sampling.enabled=true",
            "rollout.dynamic_sampling.max_rounds=8",
            "reward.name=tests.orchestration.rewards:half_constant_reward",
        )
    )
    for r in metrics(run):
        assert r["rollout/dynamic_sampling_drop_rate"] > 0  # even rows were drawn and dropped ...
        assert r["rollout/prompts"] == 2  # ... and the batch was refilled
        assert r["rollout/zero_adv_group_fraction"] == 0.0  # only groups with signal are trained on


def test_short_dynamic_sampling_batch_trains_on_whole_mini_batches(tmp_path):
    """max_rounds=1 with half the groups flat: the kept groups often fall short of rollout.batch_size=4. No crash
    (before: `N samples are not a multiple of global_batch_size`): the step trains on whole mini-batches of 4 samples,
    counts the groups it cut, and skips training when not even one mini-batch is left."""
    run = run_job(
        config(
            tmp_path,
            "dapo_short",
            "num_steps=3",
            "rollout.batch_size=4",
            "train.global_batch_size=4",
            "rollout.dynamic_sampling.enabled=true",
            "rollout.dynamic_sampling.max_rounds=1",
            "reward.name=tests.orchestration.rewards:half_constant_reward",
        )
    )
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        kept = r["rollout/prompts"] - r["rollout/short_batch_dropped_groups"]  # groups trained on
        assert r["rollout/short_batch_dropped_samples"] == 2 * r["rollout/short_batch_dropped_groups"]
        assert (kept * 2) % 4 == 0 and r["rollout/short_batch_dropped_groups"] == r["rollout/prompts"] % 2
        if kept == 0:
            assert r["train/skipped_steps"] == 1 and "train/optimizer_steps" not in r
        else:
            assert r["train/skipped_steps"] == 0 and r["train/optimizer_steps"] == kept * 2 / 4
    assert any(r["rollout/prompts"] < 4 for r in rows)  # a short batch did happen


def test_dynamic_sampling_that_keeps_no_group_skips_the_step_and_the_run_goes_on(tmp_path, monkeypatch):
    """A reward equal for every response: no group has signal, in any round. Each step is logged with every group
    dropped and no train phase, and the run reaches num_steps (before: RuntimeError, the run was lost). Its reward and
    rollout statistics are those of what it generated (issue 30.14: they were 0.0, means over no kept group)."""
    from miles_vl.orchestration.engines import RolloutEngines

    generated: list[list] = []  # per step, every generation of its rounds
    collect_batch, generate = Job.collect_batch, RolloutEngines.generate

    def new_step(self, step):
        generated.append([])
        return collect_batch(self, step)

    def recorded(self, prompts, params):
        groups = generate(self, prompts, params)
        generated[-1].extend(g for group in groups for g in group)
        return groups

    monkeypatch.setattr(Job, "collect_batch", new_step)
    monkeypatch.setattr(RolloutEngines, "generate", recorded)
    run = run_job(
        config(
            tmp_path,
            "dapo_none",
            "num_steps=2",
            "eval.interval=0",  # every generate() is a training round
            "rollout.dynamic_sampling.enabled=true",
            "rollout.dynamic_sampling.max_rounds=1",
            "reward.name=tests.orchestration.rewards:constant_reward",
        )
    )
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r, gens in zip(rows, generated, strict=True):
        assert r["rollout/prompts"] == 0 and r["rollout/dynamic_sampling_drop_rate"] == 1.0
        assert r["train/skipped_steps"] == 1 and "train/optimizer_steps" not in r
        assert len(gens) == r["rollout/generated_prompts"] * 2 == 2 * 2 * 2  # 2 rounds of 2 prompts, 2 samples each
        lengths = [g.response_ids.numel() for g in gens]
        assert r["rollout/response_len_mean"] == sum(lengths) / len(lengths) > 0
        assert r["rollout/response_tokens"] == sum(lengths)
        assert r["reward/mean"] == 1.0  # constant_reward of every generated sample


def test_the_next_batch_is_prepared_during_training_and_the_prompts_stay_the_same(tmp_path, monkeypatch):
    """Issue 33.3: step N+1's prompts are encoded (images processed) in the prefetch thread while step N trains and
    syncs. Each step gets the prompts a dataset without prefetch serves, in order; steps 2 and 3 take a prefetched
    batch; nothing is prefetched past the last step."""
    cfg = config(tmp_path, "prefetch", "num_steps=3", "checkpoint.interval=0")
    served, threads = [], []
    next_batch, encode = PromptDataset.next_batch, PromptDataset._encode

    def recording_next_batch(self, batch_size):
        batch = next_batch(self, batch_size)
        served.append([p.index for p in batch])
        return batch

    def recording_encode(self, picked):
        threads.append(threading.current_thread().name)
        return encode(self, picked)

    monkeypatch.setattr(PromptDataset, "next_batch", recording_next_batch)
    monkeypatch.setattr(PromptDataset, "_encode", recording_encode)
    run_job(cfg)
    monkeypatch.undo()
    processor = load_processor(cfg.model.processor, cfg.data.min_pixels, cfg.data.max_pixels)
    plain = build_datasets(cfg.data, processor, seed=cfg.seed).train
    assert served == [[p.index for p in plain.next_batch(cfg.rollout.batch_size)] for _ in range(3)]
    assert threads == [threading.current_thread().name, "data-prefetch_0", "data-prefetch_0"]


def test_a_profiled_step_writes_its_train_phase_summary_and_trains_as_the_others(tmp_path):
    """train.profile_steps=[2]: step 2's train phase ran under torch.profiler on the train rank; its summary is in
    <run>/profile/step_2.json (within the step's train time; reading the profiler's events is timed apart, as
    time/profile_s), no other step is profiled, and the metrics are the same as a run without the profiler's."""
    run = run_job(config(tmp_path, "profiled", "num_steps=3", "train.profile_steps=[2]"))
    plain = run_job(config(tmp_path, "plain", "num_steps=3"))
    assert sorted(p.name for p in (run / "profile").iterdir()) == ["step_2.json"]
    record = json.loads((run / "profile" / "step_2.json").read_text())
    (rank,) = record["ranks"]
    assert record["step"] == 2 and rank["rank"] == 0 and rank["device"] == "cpu"
    rows = metrics(run)
    assert 0 < rank["wall_s"] <= rows[1]["time/train_s"]
    assert [("time/profile_s" in r) for r in rows] == [False, True, False] and rows[1]["time/profile_s"] > 0
    assert rank["classes_s"]["matmul"] > 0 and any(r["name"] == "aten::mm" for r in rank["top"])
    same = [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]
    assert same == [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in metrics(plain)]


def test_a_profile_that_cannot_be_written_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    import miles_vl.orchestration.loop as loop_module

    def full_disk(run_dir, step, summaries):
        assert summaries and summaries[0]["rank"] == 0  # the step was profiled; only its file fails
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(loop_module, "write_profile", full_disk)
    with caplog.at_level("WARNING", logger="miles_vl.orchestration.loop"):
        run = run_job(config(tmp_path, "full", "num_steps=2", "train.profile_steps=[1]"))
    assert [r["step"] for r in metrics(run)] == [1, 2]
    assert any("step 1's profile was not written" in r.getMessage() for r in caplog.records)


def _start_hooks(engine: type, build, **engine_kwargs) -> Hooks:
    """The driver's parts with the hf engine `engine` (given `engine_kwargs`) and the torch backend built by `build`."""
    launch = functools.partial(launch_hf, engine=engine, **engine_kwargs)
    return Hooks(
        engines={**ENGINES, "hf": dataclasses.replace(ENGINES["hf"], launch=launch)},
        train_backends={**TRAIN_BACKENDS, "torch": build},
    )


def _engine_first(started, fail: bool = False) -> Hooks:
    """The hf engine, which signals its start, and a torch trainer that builds only after it (or then fails)."""
    build = functools.partial(build_torch_after, started=str(started), fail=fail)
    return _start_hooks(EngineThatSignalsItsStart, build, started=str(started))


def test_an_engine_that_fails_beside_the_build_ends_the_job_at_once_and_the_trainer_with_it(tmp_path):
    """An engine that fails to start while the trainer builds ends the job with its error, without waiting for the
    build (here 300 s; a large Megatron model's takes minutes): the ranks still building are killed, not asked to
    shut down behind their build (which took Trainer.close's 60 s timeout before 2026-11-29)."""
    failed, pid_file = tmp_path / "failed", tmp_path / "trainer_pid"
    build = functools.partial(build_torch_held, pid_file=str(pid_file))
    hooks = _start_hooks(EngineThatFailsToStart, build, failed=str(failed), after=str(pid_file))
    with pytest.raises(ray.exceptions.RayActorError, match="the engine failed to start"):
        run_job(config(tmp_path, "engine-fails", "num_steps=1"), hooks=hooks)
    ended = time.time() - float(failed.read_text())
    assert ended < 30, f"the job ended {ended:.0f} s after the engine failed"
    pid = int(pid_file.read_text())
    assert gone_within(pid, 30), "the trainer's rank outlived the job"


def test_the_engines_start_while_the_trainer_builds(tmp_path):
    """A job whose engines share no GPU with the trainer starts them while the trainer builds: each is an actor
    that imports its stack and builds its model, half of a tiny job's time on 2 cores; on a cluster the SGLang
    servers' start beside the Megatron build. Here the trainer's build waits for the engine's start: had the driver
    waited for the build before starting the engines, the build would time out and the job fail."""
    run = run_job(
        config(tmp_path, "beside", "num_steps=1", "checkpoint.interval=0"), hooks=_engine_first(tmp_path / "e")
    )
    assert [r["step"] for r in metrics(run)] == [1]


def test_a_trainer_that_fails_to_build_ends_the_job_with_its_error_and_stops_the_engines(tmp_path):
    """The engines started beside the build are stopped when the build fails, and the job ends with the build's
    error (not an engine's, not a hang)."""
    started = tmp_path / "e"
    with pytest.raises(ray.exceptions.RayTaskError, match="the trainer's build failed"):
        run_job(config(tmp_path, "failed", "num_steps=1"), hooks=_engine_first(started, fail=True))
    pid = int(started.read_text())
    assert gone_within(pid, 30), "the engine's actor outlived the job"
