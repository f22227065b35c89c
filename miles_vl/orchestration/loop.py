"""The driver loop: the whole RL algorithm on one screen.

    format warm-up when configured (fresh start only; warmup.py), eval: the step-0 record
    for step in range(start, num_steps):
        prompts  = next batch of the training set
        groups   = rollout (n_samples_per_prompt each; engines restarted and prompts retried if one dies)
        rewards  = reward function on every response, in worker processes (errors and timeouts score 0, counted)
        samples  = group advantages (zero for groups whose rewards are all equal)
        --- from here the trainer changes: the step runs to its end ---
        metrics  = train on the samples (packed THD micro-batches)
        sync     = trainer weights -> every engine (then each flushes its caches)
        eval, log, commit the step; checkpoint (and checkpoint.save_hf's HF directory) when due
        (the next step's first batch of prompts is encoded in a background thread while this step trains and syncs;
        a periodic checkpoint is written in the background while the next steps run: checkpoint.async_save;
        with rollout.max_staleness > 0 the rollout, reward and advantages of the next steps run on a rollout thread
        while this step trains, and the sync waits for it: ahead.py, docs/async.md; with rollout.partial_rollouts the
        sync pauses the engines instead and the generations in flight continue under the new weights)

Everything that can be wrong with the config, the data, the reward function or the checkpoint to resume from is
found before Ray starts (`ConfigError`, `DataError`, `RewardResolutionError`, `RewardWorkerError`,
`CheckpointError`: the CLI exits with status 2). The engines (hf or sglang) and their recovery live in engines.py, the
weight sync in miles_vl/rollout/weight_sync.py; checkpoint files in checkpoint.py.

Stopping (SIGINT, SIGTERM). A first signal during the rollout phase abandons the step at once (nothing has changed
but the data cursor, which a checkpoint takes from the last committed step); from training on it lets the step
finish (train, sync, eval, log). Either way the job then waits for a checkpoint still being written in the
background (it appears complete), writes the checkpoint of the last completed step, unless it has one, and raises
`JobInterrupted` (CLI exit 128 + signal number). A first signal once the last step trains changes nothing: the run
finishes as it would have (the step, its checkpoint, any Hugging Face export, the report, the engines stopped) and
returns normally (exit 0), saying so. A second signal stops at once and writes nothing: the newest
complete checkpoint stands (a background write it cut short leaves a temporary directory, removed by the next
save). A checkpoint is only ever written from a committed step, so it is never half-advanced (a cursor past its
weights, or weights past its cursor), and a resume repeats the straight run.

Run directories. A run directory (`logging.output_dir/logging.run_name`) belongs to one run: a fresh start
(`checkpoint.resume=never`, or `auto` with no checkpoint) refuses a directory that holds another run's metrics or
checkpoints. Without a run_name the directory is named after the config file, so that the same command resumes it;
only `checkpoint.resume=never` adds a timestamp (a new directory each start, claimed by an atomic create: two
starts in the same second get `<stem>-<time>` and `<stem>-<time>-2`). A resume continues its own directory
from its newest checkpoint: metrics.jsonl keeps the steps before the checkpoint, and an earlier config.yaml that differs
is kept beside it. An older checkpoint of the run is resumed only into a new directory (a branch: `checkpoint.resume=
<path> logging.run_name=<new name>`), which leaves the run it came from as it was. A resume of the run under a
config that differs from the checkpoint's recorded one (driver.json) is refused, listing the changed keys, unless they
are keys a resume may change (`schema.RESUME_MAY_CHANGE`: num_steps, logging, checkpoint, ...) or the user accepts
them (`checkpoint.accept_changes`); at num_steps nothing runs and the changes are only reported. `describe_start` is
what `miles-vl check` prints: the run directory and whether it would start fresh or resume, from which step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from miles_vl.algo import TrainSample, to_train_samples
from miles_vl.config import ConfigError, JobConfig, redacted
from miles_vl.config.schema import RESUME_MAY_CHANGE
from miles_vl.data import PromptDataset, build_datasets, load_processor, processor_metadata, video_settings
from miles_vl.logs import run_log
from miles_vl.metrics import (
    METRICS_FILE,
    JsonlSink,
    Sinks,
    TensorBoardSink,
    WandbSink,
    read_metrics,
    write_report,
)
from miles_vl.metrics.profile import write_profile
from miles_vl.models import SpecialTokens
from miles_vl.models.qwen3_vl.tokens import special_tokens
from miles_vl.orchestration.ahead import RolloutsAhead, read_batches, write_batches
from miles_vl.orchestration.checkpoint import (
    MODEL_PARALLEL_KEYS,
    CheckpointError,
    PendingSave,
    find_resume_point,
    list_checkpoints,
    parallel_layout_problem,
    read_driver_state,
    resolve_resume,
    start_checkpoint,
    step_dir_name,
)
from miles_vl.orchestration.engines import RolloutEngines
from miles_vl.orchestration.export import HF_DIR, save_hf_due, save_hf_during_run
from miles_vl.orchestration.factories import ENGINES, EngineKind, Hooks, build_rewards, check_colocated_group
from miles_vl.orchestration.placement import GpuPlacement, ray_session, reserve_gpus
from miles_vl.orchestration.progress import Progress
from miles_vl.orchestration.samples import sample_records, show_samples, warn_if_stuck, write_samples
from miles_vl.orchestration.trainer import Trainer
from miles_vl.orchestration.warmup import format_warmup
from miles_vl.reward import WeightedRewards
from miles_vl.rollout import Generation, SamplingParams
from miles_vl.rollout.collect import (
    CollectedBatch,
    GeneratedGroup,
    collect,
    has_reward_variance,
    mean,
    rollout_metrics,
    round_prompts,
    score_groups,
    trim_to_whole_batches,
)
from miles_vl.rollout.types import WEIGHTS_MEMORY
from miles_vl.rollout.weight_sync import PhaseClock, make_weight_sync

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# the job


def run_job(
    cfg: JobConfig,
    config_path: str | None = None,
    hooks: Hooks | None = None,
    *,
    reward_fn: Callable[..., Any] | None = None,
    dataset: Sequence[dict[str, Any]] | None = None,
) -> Path:
    """Run the RL job described by `cfg`; returns the run directory (metrics.jsonl, checkpoints, plots). `hooks`:
    what the job builds its parts with (factories.py; tests pass stand-ins).

    For use as a library (docs/library.md): `reward_fn`, a reward callable (`miles_vl.reward.types`; a lambda or a
    closure too: it is sent to the reward workers by value), in place of `reward.name` (which must be null);
    `dataset`, the training rows as dicts in the columns of `data.format`, with `data.in_memory=true`.

    Raises:
        ConfigError, DataError, CheckpointError, RewardResolutionError, RewardWorkerError: bad input, found before
            Ray starts (module docstring).
        JobInterrupted: SIGINT or SIGTERM; the checkpoint of the last completed step was written first.
    """
    hooks = hooks or Hooks()
    check_backends(cfg, config_path, hooks.engines)
    run_dir = choose_run_dir(cfg, config_path)  # a fresh start without a run_name claims a new directory here
    with _removed_if_unused(run_dir, claimed=_new_dir_each_start(cfg)):
        ckpt_root = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
        resume = resolve_resume(ckpt_root, cfg.checkpoint.resume)
        resume_state = check_start(cfg, run_dir, ckpt_root, resume)
        if resume_state and resume_state["step"] == cfg.num_steps:
            log.info("nothing to do: %s already holds step %d of num_steps=%d", resume, cfg.num_steps, cfg.num_steps)
            if changed := unaccepted_changes(cfg, resume_state):
                log.warning(
                    "this config differs from the one %s was trained with (nothing was run with it): %s",
                    resume,
                    format_changes(changed),
                )
            return run_dir
        reward_terms = build_rewards(cfg, reward_fn)
        processor = load_processor(
            cfg.model.processor or cfg.model.path, cfg.data.min_pixels, cfg.data.max_pixels, video_settings(cfg.data)
        )
        tokens = special_tokens(processor)
        splits = build_datasets(cfg.data, processor, seed=cfg.seed, records=dataset)
        if resume_state:  # a cursor saved for other data fails here, before Ray starts
            splits.train.load_state_dict(resume_state["data"])
            for note in passed_step_notes(cfg, resume_state["step"], run_dir).values():
                log.warning("%s", note)
        write_run_files(run_dir, cfg, processor_metadata(processor))
    with run_log(run_dir):  # from here on, the console's lines also go to <run dir>/driver.log
        r = cfg.reward
        with (
            WeightedRewards(
                reward_terms, timeout_s=r.timeout_s, num_workers=r.num_workers, async_concurrency=r.async_concurrency
            ) as rewards,
            ray_session(cfg.ray.address, num_cpus=cfg.ray.num_cpus, dashboard=cfg.ray.dashboard),
            StopSignals() as signals,
        ):
            job = Job(cfg, run_dir, ckpt_root, processor, tokens, splits.train, splits.eval, rewards, signals, hooks)
            finished = False
            try:  # from here on, close() stops what the job started (sglang servers outlive their actors)
                start = job.restore(resume, resume_state) if resume else 0
                job.open_sinks(start)
                if start == 0 and cfg.train.format_warmup_steps:
                    job.log(format_warmup(job))  # supervised format steps (no image information), then eval: step 0
                for step in range(start, cfg.num_steps):
                    batch = job.collect_batch(step)  # rollout, reward, advantages: a stop here abandons the step
                    last = step + 1 == cfg.num_steps
                    # the trainer changes from here on: a stop waits for the step's end (once the last step trains,
                    # a stop changes nothing: the run finishes as it would have)
                    with signals.deferred(FINISHING if last else FINISHING_STEP, stop_after=not last):
                        metrics = job.train_and_sync(step, batch)
                        metrics |= job.evaluate_if_due(step)
                        job.log(metrics)
                        job.commit(step + 1)
                        if not last:  # the last step's checkpoint and export come next, whatever the intervals
                            job.save_if_due()
                            job.save_hf_if_due()
                with signals.deferred(FINISHING, stop_after=False):
                    job.save()
                    job.save_hf_if_due()
                if signals.signum is not None:
                    log.warning(
                        "%s came while the run was finishing: all %d steps are done and saved, so the run ends as "
                        "finished",
                        signal.Signals(signals.signum).name,
                        cfg.num_steps,
                    )
                finished = True
            except BaseException as err:
                job.save_after(err)  # the last completed step, if the trainer still holds it and it has no checkpoint
                raise
            finally:  # a first signal while a finished run's engines and trainer stop: it stays finished
                with signals.deferred(CLOSING, stop_after=False) if finished else contextlib.nullcontext():
                    job.close()
        write_report(run_dir)
        log.info("run finished: %s", run_dir)
    return run_dir


def check_backends(
    cfg: JobConfig, config_path: str | None = None, engines: dict[str, EngineKind] | None = None
) -> None:
    """What the chosen rollout engine cannot do with the config, as one ConfigError (before Ray starts). Whether the
    backends' packages import is for `preflight` (the CLI runs it before `run_job`)."""
    problems = (engines or ENGINES)[cfg.rollout.backend].config_problems(cfg)
    if problems:
        raise ConfigError(problems, config_path)


# -- run directories and the start point ----------------------------------------------------------------------------


def choose_run_dir(cfg: JobConfig, config_path: str | None) -> Path:
    """`logging.output_dir/logging.run_name`; without a run_name, `<config stem>` when resuming, else a new
    `<config stem>-<timestamp>` directory, created here (`claim_new_dir`: two starts in the same second get two
    directories). Only the latter creates anything."""
    name = cfg.logging.run_name or f"{Path(config_path).stem if config_path else 'job'}"
    run_dir = Path(cfg.logging.output_dir) / name
    if _new_dir_each_start(cfg):
        run_dir = claim_new_dir(run_dir.with_name(f"{name}-{datetime.now():%Y%m%d-%H%M%S}"))
    return run_dir


def _new_dir_each_start(cfg: JobConfig) -> bool:
    return cfg.logging.run_name is None and cfg.checkpoint.resume == "never"


def claim_new_dir(path: Path) -> Path:
    """Create `path`, else `path-2`, `path-3`, ...: the first name that is free, returned. `mkdir` without exist_ok
    creates or fails in one step, so concurrent callers (threads or processes) never get the same directory, where
    a check for a free name followed by a create would let two of them through."""
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = path, 1
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1
            candidate = path.with_name(f"{path.name}-{n}")


@contextlib.contextmanager
def _removed_if_unused(run_dir: Path, claimed: bool) -> Iterator[None]:
    """A directory `choose_run_dir` claimed for this start is removed again if the start fails while it is still
    empty (bad input found before Ray starts leaves no run directory); nothing else is ever removed."""
    try:
        yield
    except BaseException:
        if claimed:
            with contextlib.suppress(OSError):  # not empty: something was written, keep it
                run_dir.rmdir()
        raise


def describe_start(cfg: JobConfig, config_path: str | None) -> dict[str, Any]:
    """What `miles-vl train` would do with `cfg`, for `miles-vl check`: the run directory and whether the job starts
    fresh or resumes, from which step and checkpoint. Writes nothing (a broken checkpoint `auto` would set aside, a
    metrics.jsonl a restart would keep aside: named, left in place).

    Raises:
        CheckpointError: the start `check_start` refuses (e.g. a resume whose config changed: the changed keys).
    """
    if _new_dir_each_start(cfg):
        stem = Path(config_path).stem if config_path else "job"
        run_dir = f"{Path(cfg.logging.output_dir) / stem}-<YYYYmmdd-HHMMSS> (a new directory)"
        return {"run_dir": run_dir, "start": "fresh"}
    run_dir = choose_run_dir(cfg, config_path)
    ckpt_root = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    point = find_resume_point(ckpt_root, cfg.checkpoint.resume, set_aside=False)
    out: dict[str, Any] = {"run_dir": str(run_dir)}
    state = check_start(cfg, run_dir, ckpt_root, point.path, dry_run=True)
    if state is None:
        records = _metric_records(run_dir)
        out["start"] = "fresh" + (f" (again: the {records} logged steps' metrics.jsonl kept aside)" * bool(records))
        return out
    out |= {"start": "resume", "from_step": state["step"], "checkpoint": str(point.path)}
    if not has_optimizer_state(state) and state["step"] < cfg.num_steps:
        out["optimizer_state"] = fresh_optimizer_note(point.path, state["step"])
    out |= passed_step_notes(cfg, state["step"], run_dir)
    if point.skipped:
        out["broken_checkpoints_to_set_aside"] = [str(p) for p, _ in point.skipped]
    if state["step"] == cfg.num_steps:
        out["start"] = f"nothing to do (step {state['step']} of num_steps={cfg.num_steps} is done)"
        if changed := unaccepted_changes(cfg, state):
            out["config_changed"] = format_changes(changed)
    return out


def passed_step_notes(cfg: JobConfig, from_step: int, run_dir: Path) -> dict[str, str]:
    """What a resume from `from_step` says of the steps it has passed that asked for something the run will not do:
    `train.profile_steps` (a passed step is not trained again) and `checkpoint.save_hf` (a passed step's HF directory
    that <run dir>/hf lacks, say because the key was added on resume, is not written). Keyed by the config key."""
    notes = {}
    if passed := [s for s in cfg.train.profile_steps if s <= from_step]:
        notes["profile_steps"] = (
            f"train.profile_steps {passed} are at or before step {from_step}, which this run resumes from: they are "
            f"not trained again, so not profiled; pick steps in {from_step + 1}..num_steps"
        )
    h = cfg.checkpoint.save_hf
    due = [s for s in range(1, from_step + 1) if save_hf_due(s, h.steps, h.interval, final=False, last=False)]
    if missing := [s for s in due if not (run_dir / HF_DIR / step_dir_name(s)).is_dir()]:
        shown = ", ".join(map(str, missing[:8])) + (f", ... ({len(missing)} steps)" if len(missing) > 8 else "")
        notes["save_hf"] = (
            f"checkpoint.save_hf asks for steps [{shown}], at or before step {from_step}, which this run resumes "
            f"from, and {run_dir / HF_DIR} has none of them: they are not written now; `miles-vl export RUN_DIR "
            f"OUT_DIR --step N` writes one from step N's checkpoint, in the run whose checkpoints hold it"
        )
    return notes


def fresh_optimizer_note(checkpoint: Path, step: int) -> str:
    """What a resume from a checkpoint without the optimizer's state says (a warning at the resume; `miles-vl
    check`)."""
    return (
        f"{checkpoint} was saved with checkpoint.optimizer_state=false: the optimizer starts afresh at step {step} "
        "from its weights (Adam's moments zero, the fp32 main weights the checkpoint's), so the steps from here "
        "differ from those of a run that kept its optimizer state"
    )


def check_start(
    cfg: JobConfig, run_dir: Path, ckpt_root: Path, resume: Path | None, dry_run: bool = False
) -> dict[str, Any] | None:
    """The driver state to resume from (None: a fresh start), after checking that the start is safe. `dry_run`:
    only check (a run restarted by `auto` keeps its metrics.jsonl in place).

    `checkpoint.resume=auto` in a directory whose run logged steps but left no checkpoint (it died before its first
    one) starts that run again; its metrics.jsonl is kept as `metrics.<time>.jsonl`. A resume from the newest
    checkpoint of the run rewrites metrics.jsonl without the records past that checkpoint (a run killed after logging
    them: the resume computes them again, the same).

    Raises:
        CheckpointError: a fresh start in a directory that holds another run (metrics or checkpoints), a resume of
            this run whose config differs from the checkpoint's on a key a resume may not change by itself
            (`unaccepted_changes`; not at num_steps, where nothing runs), a resume of
            another directory's checkpoint into one that holds metrics, a resume of a checkpoint of this run that has
            a newer one (it would drop the newer steps' records and mix two histories: resume the newest, or branch
            into a new run directory), a resume from a checkpoint past `num_steps` (its state would be saved under an
            earlier label), a resume whose metrics.jsonl has a bad line (it is rewritten on resume), a megatron
            checkpoint resumed at other train.tp/pp/cp/ep (`parallel_layout_problem`), or a checkpoint without the
            optimizer's state resumed under checkpoint.optimizer_state=true (not at num_steps, where nothing runs).
    """
    if resume is None:
        _check_fresh_start(cfg, run_dir, ckpt_root, dry_run)
        return None
    same_run = resume.resolve().parent == ckpt_root.resolve()
    if not same_run and _metric_records(run_dir):
        own = (
            ", or resume it from its own newest checkpoint (checkpoint.resume=auto)"
            if list_checkpoints(ckpt_root)
            else ""
        )
        raise CheckpointError(
            f"checkpoint.resume={resume} belongs to another run than {run_dir}, which holds metrics of its own; "
            f"resume into a new logging.run_name{own}"
        )
    state = read_driver_state(resume)
    sizes = {k: getattr(cfg.train, k) for k in MODEL_PARALLEL_KEYS}
    if problem := parallel_layout_problem(state, cfg.train.backend, sizes):  # another train.num_gpus is fine
        raise CheckpointError(f"checkpoint.resume: {resume}: {problem}")
    if not has_optimizer_state(state) and cfg.checkpoint.optimizer_state and state["step"] < cfg.num_steps:
        raise CheckpointError(
            f"checkpoint.resume: {resume} was saved with checkpoint.optimizer_state=false: it holds no optimizer "
            "state (fp32 main weights, Adam moments), and this run sets checkpoint.optimizer_state=true. Set "
            "checkpoint.optimizer_state=false to resume it with the optimizer started afresh from its weights (the "
            "steps after it then differ from a straight run's), or resume an older checkpoint that has it"
            + _older_with_optimizer_state(resume, state["step"])
        )
    newer = [(s, p) for s, p in list_checkpoints(ckpt_root) if s > state["step"]] if same_run else []
    if newer:
        step, (last, last_path) = state["step"], newer[-1]
        also = " and another checkpoint.dir" if cfg.checkpoint.dir else ""
        raise CheckpointError(
            f"checkpoint.resume={resume} is step {step} of {run_dir}, which has a newer checkpoint, step {last} "
            f"({last_path}); resuming step {step} there would drop the records of the later steps from its "
            f"metrics.jsonl and mix two histories in {ckpt_root}: resume the newest (checkpoint.resume=auto), or "
            f"branch from step {step} into a new run directory (checkpoint.resume={resume} "
            f"logging.run_name=<new name>{also})"
        )
    if state["step"] > cfg.num_steps:
        earlier = [str(p) for s, p in list_checkpoints(resume.parent) if s <= cfg.num_steps]
        raise CheckpointError(
            f"the checkpoint to resume from, {resume}, is at step {state['step']}, past num_steps={cfg.num_steps}; "
            f"its state would be saved as step {cfg.num_steps}: raise num_steps to {state['step']} or more"
            + (f", or resume an earlier one (checkpoint.resume={earlier[-1]})" if earlier else "")
        )
    ahead = state.get("rollouts_ahead") or []  # (step, weight version) of the batches generated ahead it holds
    if ahead and max(t - v for t, v in ahead) > cfg.rollout.max_staleness:
        worst = max(t - v for t, v in ahead)
        raise CheckpointError(
            f"checkpoint.resume={resume} holds {len(ahead)} batch(es) generated ahead, up to {worst} steps older than "
            f"the weights they will be trained with, but rollout.max_staleness={cfg.rollout.max_staleness}; resume "
            f"with rollout.max_staleness >= {worst} (checkpoint.accept_changes=[rollout.max_staleness] if it changed)"
        )
    changed = unaccepted_changes(cfg, state) if same_run else []
    if changed and state["step"] < cfg.num_steps:  # at num_steps nothing runs: run_job says so, with the changes
        keys = ",".join(key for key, _, _ in changed)
        raise CheckpointError(
            f"the config differs from the one {run_dir} was trained with up to step {state['step']} ({resume}): "
            f"{format_changes(changed)}; resuming would continue that run under other settings. Start a new run "
            f"with these settings (logging.run_name=<new name>), or resume this one accepting the change "
            f"(checkpoint.accept_changes=[{keys}])"
        )
    if (run_dir / METRICS_FILE).is_file():  # the resume rewrites it (JsonlSink), once Ray is up: read it here
        try:
            read_metrics(run_dir)
        except ValueError as err:
            raise CheckpointError(f"{err} before resuming {run_dir}, which rewrites this file") from None
    return state


def _older_with_optimizer_state(resume: Path, step: int) -> str:
    """How to resume the newest checkpoint beside `resume`, older than `step`, that holds the optimizer's state (a
    branch: a new logging.run_name), as the end of a sentence; empty when there is none."""
    for s, path in reversed(list_checkpoints(resume.parent)):
        with contextlib.suppress(CheckpointError):
            if s < step and has_optimizer_state(read_driver_state(path)):
                return f" (checkpoint.resume={path} logging.run_name=<new name>)"
    return ""


def has_optimizer_state(state: dict[str, Any]) -> bool:
    """Whether a checkpoint (its driver `state`) holds the optimizer's state: false when it was saved with
    checkpoint.optimizer_state=false; a checkpoint written before driver.json said so holds it."""
    return state.get("optimizer_state", True) is not False


def unaccepted_changes(cfg: JobConfig, state: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, recorded, now) for each key on which `cfg` differs from the config recorded in a checkpoint's
    driver `state`, except the keys a resume may change (`schema.RESUME_MAY_CHANGE`) and those
    `checkpoint.accept_changes` lists. Both sides are redacted (a secret reads `<redacted>` on both)."""
    free = (*RESUME_MAY_CHANGE, *cfg.checkpoint.accept_changes)
    return [
        change
        for change in config_changes(state.get("config") or {}, redacted(cfg))
        if not any(change[0] == k or change[0].startswith(k + ".") for k in free)
    ]


def config_changes(recorded: Any, now: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, recorded, now) for every key both configs hold whose value differs (dicts compared key by key,
    lists whole). A key only one of them holds is no change: one added to or removed from miles_vl since (as
    `write_run_files` treats it)."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        return [c for k in recorded if k in now for c in config_changes(recorded[k], now[k], f"{prefix}{k}.")]
    return [] if recorded == now else [(prefix.rstrip("."), recorded, now)]


def format_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """`key: old -> new` per change, values as YAML flow text."""
    return "; ".join(f"{key}: {_flow(old)} -> {_flow(new)}" for key, old, new in changes)


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def _check_fresh_start(cfg: JobConfig, run_dir: Path, ckpt_root: Path, dry_run: bool = False) -> None:
    """A fresh start: refused in a directory that holds another run; `auto` restarts a run that left no checkpoint
    (check_start)."""
    records = _metric_records(run_dir)
    others = [p.name for _, p in list_checkpoints(ckpt_root)]
    if cfg.checkpoint.resume == "auto" and records and not others:
        if dry_run:
            return
        kept = run_dir / f"{Path(METRICS_FILE).stem}.{datetime.now():%Y%m%d-%H%M%S}.jsonl"
        os.replace(run_dir / METRICS_FILE, kept)
        log.warning(
            "%s logged %d steps but left no checkpoint: starting it again; its metrics are kept as %s",
            run_dir,
            records,
            kept,
        )
    elif records or others:
        held = " and ".join([f"{records} logged steps"] * bool(records) + [f"checkpoints {others}"] * bool(others))
        how = f"checkpoint.resume={cfg.checkpoint.resume}" + (" and no checkpoint" if not others else "")
        raise CheckpointError(
            f"{run_dir} (checkpoints in {ckpt_root}) holds another run ({held}); a fresh start ({how}) would "
            "overwrite its metrics and prune its checkpoints: set another logging.run_name (or unset it for a "
            "new timestamped directory), resume that run with checkpoint.resume=auto, or delete it"
        )


def _metric_records(run_dir: Path) -> int:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return 0
    try:
        return len(read_metrics(path))
    except ValueError:  # unreadable, but it is someone's
        return 1


def write_run_files(run_dir: Path, cfg: JobConfig, processor_meta: dict) -> None:
    """config.yaml (secrets redacted) and processor.yaml; an earlier file that differs is kept as `<name>.<time>`.

    Differs: on a key both files hold. A file written by an older miles_vl lacks the keys added since (the video
    settings of processor.yaml, new config fields); gaining them is no change and is logged at info level.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, data in (("config.yaml", redacted(cfg)), ("processor.yaml", processor_meta)):
        text = yaml.safe_dump(data, sort_keys=False)
        path = run_dir / name
        if path.is_file() and (old_text := path.read_text()) != text:
            try:
                earlier = yaml.safe_load(old_text)
            except yaml.YAMLError:
                earlier = None
            if _same_on_recorded_keys(earlier, data):
                if added := _added_keys(earlier, data):
                    log.info("%s: recorded the keys added since this run started: %s", path, ", ".join(added))
            else:
                kept = path.with_name(f"{path.stem}.{datetime.now():%Y%m%d-%H%M%S}{path.suffix}")
                os.replace(path, kept)
                log.warning("%s differs from the one this run started with, which is kept as %s", path, kept)
        path.write_text(text)


def _same_on_recorded_keys(earlier: Any, now: Any) -> bool:
    """`now` equals `earlier` on every key `earlier` holds (dicts compared key by key, at any depth)."""
    if isinstance(earlier, dict) and isinstance(now, dict):
        return all(k in now and _same_on_recorded_keys(v, now[k]) for k, v in earlier.items())
    return earlier == now


def _added_keys(earlier: dict, now: dict, prefix: str = "") -> list[str]:
    """The dotted keys of `now` that `earlier` lacks."""
    added = []
    for k, v in now.items():
        if k not in earlier:
            added.append(f"{prefix}{k}")
        elif isinstance(v, dict) and isinstance(earlier[k], dict):
            added += _added_keys(earlier[k], v, f"{prefix}{k}.")
    return added


# ---------------------------------------------------------------------------------------------------------------------
# stopping on SIGINT / SIGTERM


class JobInterrupted(KeyboardInterrupt):
    """The job stopped on a signal; `checkpoint` is the step it can be resumed from (module docstring). A
    KeyboardInterrupt, so that code which handles Ctrl-C handles SIGTERM the same way."""

    def __init__(self, signum: int, forced: bool = False):
        self.signum = signum
        self.forced = forced
        self.checkpoint: int | None = None
        super().__init__(f"{signal.Signals(signum).name}{' (again: stopping at once)' if forced else ''}")


# what a first signal lets the job finish (its warning), in the blocks of `run_job` that defer it
FINISHING_STEP = (
    "finishing this step (its training has started), then writing its checkpoint; send it again to stop at once "
    "without one"
)
FINISHING = (
    "this is the run's last step: finishing the run as it would have (the step, its checkpoint, any Hugging Face "
    "export, the report); send it again to stop at once without the final checkpoint"
)
CLOSING = "the run is finished: stopping its engines and trainer; send it again to stop at once"


class StopSignals:
    """SIGINT and SIGTERM as stop requests, for the duration of a `with` block in the main thread.

    Outside `deferred()` blocks a first signal raises `JobInterrupted` at once; inside one it is remembered and raised
    when the block ends (or, with `stop_after=False`, left to the caller: `signum`). A second signal always raises at
    once (`forced`). Elsewhere than the main thread the handlers are not installed (Python allows it only there) and
    signals keep their previous behaviour.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._doing: str | None = None  # inside a deferred block: what the job finishes before it stops
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        else:
            log.warning("the job runs outside the main thread: SIGINT/SIGTERM will not write a final checkpoint")
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise JobInterrupted(signum, forced=True)
        self.signum = signum
        if self._doing is None:
            raise JobInterrupted(signum)
        log.warning("%s: %s", signal.Signals(signum).name, self._doing)

    @contextlib.contextmanager
    def deferred(self, doing: str = FINISHING_STEP, stop_after: bool = True) -> Iterator[None]:
        """A block that a first signal does not interrupt (the signal's warning says `doing`); the stop is raised
        when the block ends, or with `stop_after=False` only remembered (`signum`): the caller decides."""
        self._doing = doing
        try:
            yield
        finally:
            self._doing = None
        if self.signum is not None and stop_after:
            raise JobInterrupted(self.signum)


# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class StepBatch:
    """What the rollout phase of one step hands to training: the samples and the metrics gathered so far."""

    samples: list[TrainSample]
    metrics: dict[str, float]
    timer: Timer

    def to_state(self, step: int) -> dict[str, Any]:
        """Plain tensors and numbers (what `torch.load(weights_only=True)` reads back): a checkpoint's batch ahead."""
        samples = [{f.name: getattr(s, f.name) for f in dataclasses.fields(TrainSample)} for s in self.samples]
        return {"step": step, "samples": samples, "metrics": dict(self.metrics), "seconds": dict(self.timer.seconds)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StepBatch:
        timer = Timer()
        timer.seconds = dict(state["seconds"])
        return cls([TrainSample(**s) for s in state["samples"]], dict(state["metrics"]), timer)


@dataclass
class Job:
    """The running job: its actors, its data and what a checkpoint may hold.

    A checkpoint holds `committed`, the driver state at the end of step `completed_steps`, and the trainer's state,
    which is that of the same step while `trainer_at_commit` holds (from the start of training until the step is
    committed it is not, and nothing is saved)."""

    cfg: JobConfig
    run_dir: Path
    ckpt_root: Path
    processor: object
    tokens: SpecialTokens
    train_set: PromptDataset
    eval_set: PromptDataset | None
    rewards: WeightedRewards
    signals: StopSignals = field(default_factory=StopSignals)
    hooks: Hooks = field(default_factory=Hooks)
    completed_steps: int = 0
    committed: dict[str, Any] = field(default_factory=dict)  # driver state of `completed_steps` (checkpoint.py)
    trainer_at_commit: bool = True
    saved_step: int = 0  # the newest step this job saved or resumed from: never saved again
    pending_save: PendingSave | None = None  # a checkpoint being written in the background (checkpoint.async_save)
    save_blocked_s: float = 0.0  # seconds the loop waited on saving since the last record (`save`)
    sinks: Sinks | None = None
    progress: Progress | None = None
    rollout: RolloutEngines | None = None
    trainer: Trainer | None = None
    gpus: GpuPlacement | None = None
    ahead: RolloutsAhead[StepBatch] | None = None  # rollout.max_staleness > 0: the next steps' batches (ahead.py)
    committed_ahead: list[tuple[int, int, StepBatch]] = field(default_factory=list)  # at `completed_steps`

    def __post_init__(self):
        try:  # the caller's close() cannot run before the constructor returns: undo a partial start here
            self.gpus = reserve_gpus(self.cfg.train.num_gpus) if self.cfg.train.num_gpus else None
            kind = self.hooks.engines[self.cfg.rollout.backend]
            group = kind.weight_group(self.cfg)
            check_colocated_group(self.cfg, group, self.gpus.slots if self.gpus else None)
            build = self.hooks.train_backends[self.cfg.train.backend]
            # the engines start while the trainer builds (each an actor that imports its stack and builds its model,
            # a few seconds to minutes) unless they share its GPUs: a colocated engine sizes its memory beside the
            # built trainer
            shared_gpus = self.gpus is not None and self.cfg.ray.placement == "colocate"
            self.trainer = Trainer(self.cfg, self.tokens, self.gpus, build, stop=self.stop_requested, wait=shared_gpus)
            weights = make_weight_sync(
                self.trainer,
                group=group,
                trainer_gpus=self.cfg.train.num_gpus > 0,
                # rollouts ahead: a replaced engine gets the weights the others generate with, not the trainer's newer
                options=dataclasses.replace(
                    self.hooks.weight_sync, repair_from_last_sync=self.cfg.rollout.max_staleness > 0
                ),
            )
            self.rollout = RolloutEngines(self.cfg, self.tokens, kind, weights, self.run_dir / "logs", self.gpus)
            self.trainer.wait_built()
            if self.cfg.rollout.max_staleness > 0:
                k, n = self.cfg.rollout.max_staleness, self.cfg.num_steps
                self.ahead = RolloutsAhead(self.produce_batch, max_staleness=k, num_steps=n)
        except BaseException:
            self.close()
            raise
        self.committed = self.driver_state()

    # -- one RL step ---------------------------------------------------------------------------------------------

    def collect_batch(self, step: int) -> StepBatch:
        """Rollout, reward and advantages of `step`: the part of a step that changes nothing but the data cursor. With
        rollout.max_staleness > 0 the batch was (mostly) generated ahead, while earlier steps trained (ahead.py); its
        record adds `rollout/staleness_mean`/`_max` (steps between the weights that sampled it and the trainer's) and
        `time/rollout_wait_s` (how long training waited for it)."""
        if self.ahead is None:
            return self.produce_batch(step, step)
        timer = Timer()
        with timer("rollout_wait"):
            version, batch = self.ahead.take(step)
        timer.seconds |= batch.timer.seconds  # the rollout thread's rollout, reward and advantages seconds
        staleness = [step - s.weight_version for s in batch.samples] or [step - version]
        metrics = {"rollout/staleness_mean": mean(staleness), "rollout/staleness_max": float(max(staleness))}
        if self.cfg.rollout.partial_rollouts:  # per response token: a continued sample's later spans are fresher
            versions = [token_versions(s) for s in batch.samples]
            metrics["rollout/token_staleness_mean"] = mean([step - v for vs in versions for v in vs])
            metrics["rollout/continued_samples"] = float(sum(len(set(vs)) > 1 for vs in versions))  # two versions
        return StepBatch(batch.samples, batch.metrics | metrics, timer)

    def produce_batch(self, step: int, version: int) -> StepBatch:
        """Step `step`'s batch, generated by engines that hold the weights after `version` RL steps (`version` = `step`
        in the synchronous loop; the rollout thread's batches ahead are older: ahead.py)."""
        timer = Timer()
        ds = self.cfg.rollout.dynamic_sampling
        batch = collect(
            self.train_set.next_batch,
            lambda prompts, round_: self.rollout.generate(prompts, self.sampling(step, round_=round_)),
            self.score,
            want=self.cfg.rollout.batch_size,
            keep=has_reward_variance if ds.enabled else None,
            max_rounds=ds.max_rounds,
            over_sampling_factor=ds.over_sampling_factor,
            timer=timer,
        )
        media = (self.tokens.image_token_id, self.tokens.video_token_id)
        stats = rollout_metrics(batch, media_token_ids=media, dynamic_sampling=ds.enabled)
        n = self.cfg.rollout.n_samples_per_prompt
        batch = trim_to_whole_batches(
            batch, global_batch_size=self.cfg.effective_global_batch_size, n_samples_per_prompt=n
        )
        stats["rollout/short_batch_dropped_groups"] = float(batch.short_batch_dropped)
        stats["rollout/short_batch_dropped_samples"] = float(batch.short_batch_dropped * n)
        stats["rollout/engine_restarts"] = float(self.rollout.restarts())
        stats["rollout/weight_resyncs"] = float(self.rollout.resyncs)
        stats["rollout/rounds"] = float(batch.rounds)
        # engines and trainer both resident; not asked while the trainer trains (the call would wait for it)
        memory = self.device_memory("perf/gpu_used_gib_rollout") if self.ahead is None else {}
        with timer("advantages"):
            a = self.cfg.algo
            samples, adv_stats = [], {}
            if batch.prompts:  # else fewer kept samples than one mini-batch: train_and_sync skips training
                samples, adv_stats = to_train_samples(
                    batch.prompts,
                    batch.groups,
                    batch.rewards,
                    estimator=a.estimator,
                    norm_adv_by_std=a.norm_adv_by_std,
                    weight_version=version,
                    version_of=version_number,
                )
        warn_if_stuck(step + 1, stats | adv_stats, self.cfg.rollout.max_response_len)
        self.record_samples_if_due(step, batch, samples)
        return StepBatch(samples, {"step": step + 1, **stats, **adv_stats, **memory}, timer)

    def train_and_sync(self, step: int, batch: StepBatch) -> dict[str, float]:
        """Train on the batch and hand the new weights to the engines; returns the step's metrics."""
        timer = batch.timer
        if not batch.samples:
            log.warning("step %d: no whole mini-batch of samples was kept; the train phase is skipped", step + 1)
            self.wait_rollouts_ahead(timer)  # eval and the commit come next
            blocked = {"perf/save_blocked_s": self.take_save_blocked_s()}
            return {**batch.metrics, "train/skipped_steps": 1.0, **blocked, **timer.metrics()}
        self.trainer_at_commit = False  # from the first optimizer step the trainer is past the committed step
        self.prefetch_next_batch(step)
        try:
            profile = step + 1 in self.cfg.train.profile_steps
            with timer("train"):
                self.rollout.release_memory()  # colocated: the trainer gets the devices
                if profile:
                    self.trainer.profile_next_train()
                train_metrics = self.trainer.train(batch.samples)
                self.rollout.resume_memory(WEIGHTS_MEMORY)  # only what the sync writes: the KV cache comes after it
            if profile:
                try:
                    with timer("profile"):  # reading the profiler's events: seconds, not the train phase's
                        write_profile(self.run_dir, step + 1, self.trainer.take_profiles())
                except OSError as err:  # a diagnostic: the step it describes is trained and goes on to be saved
                    log.warning("step %d's profile was not written: %s", step + 1, err)
            self.publish_save_before_sync()
            if self.cfg.rollout.partial_rollouts:  # the generations ahead in flight are aborted, kept, continued
                with timer("sync_wait"):
                    self.rollout.pause_generation()
            else:
                self.wait_rollouts_ahead(timer)
            with timer("sync"):
                self.rollout.sync_weights(weight_version(step + 1))
            if self.cfg.rollout.partial_rollouts:
                self.rollout.continue_generation()
                with timer("continued"):  # the rest of the batches ahead, under the new weights, before eval/commit
                    self.ahead.wait()
            with timer("resume"):
                self.rollout.resume_memory()  # colocated: the KV cache and CUDA graphs, once the sync is done
        finally:
            self.train_set.wait_prefetch()  # the processor is the driver's own again (eval encodes with it)
        n_tokens = sum(s.input_ids.numel() for s in batch.samples)
        response_tokens = batch.metrics["rollout/response_tokens"]
        perf = {
            "perf/train_tokens_per_s": n_tokens / max(timer.seconds["train"], 1e-9),
            "perf/rollout_tokens_per_s": response_tokens / max(timer.seconds["rollout"], 1e-9),
            "perf/save_blocked_s": self.take_save_blocked_s(),
        }
        skipped = {"train/skipped_steps": 0.0}
        return {**batch.metrics, **train_metrics, **skipped, **self.sync_sizes(), **perf, **timer.metrics()}

    def wait_rollouts_ahead(self, timer: Timer) -> None:
        """With batches generated ahead: wait until the rollout thread is idle, so that the engines never change weights
        under a batch (ahead.py); the seconds are the record's `time/sync_wait_s`."""
        if self.ahead is not None:
            with timer("sync_wait"):
                self.ahead.wait()

    def prefetch_next_batch(self, step: int) -> None:
        """Step `step + 1`'s first batch of prompts (images loaded and processed) is prepared while step `step` trains
        and syncs; the cursor moves only when that step takes it, in the same order (dataset.py). Not with batches
        generated ahead: the rollout thread is already taking the next prompts."""
        if step + 1 < self.cfg.num_steps and self.ahead is None:
            ds = self.cfg.rollout.dynamic_sampling
            want = self.cfg.rollout.batch_size
            self.train_set.prefetch(
                round_prompts(want, filtered=ds.enabled, over_sampling_factor=ds.over_sampling_factor)
            )

    def take_save_blocked_s(self) -> float:
        """Seconds the loop spent on checkpoint saves since the last call (the snapshot, and waiting for a save in
        flight): the save after step N is in step N+1's record."""
        blocked, self.save_blocked_s = self.save_blocked_s, 0.0
        return blocked

    def stop_requested(self) -> JobInterrupted | None:
        """The stop a first SIGINT/SIGTERM asked for (None: none): a stalled weight sync ends with it (trainer.py)."""
        return JobInterrupted(self.signals.signum) if self.signals.signum is not None else None

    def commit(self, step: int) -> None:
        """Step `step` is complete (trained, synced, evaluated, logged): it is now what a checkpoint holds."""
        if self.ahead is not None:
            self.ahead.wait()  # idle already (train_and_sync waited): the cursor is past the batches ready
            self.committed_ahead = self.ahead.pending()
        self.completed_steps = step
        self.committed = self.driver_state()
        self.trainer_at_commit = True

    def device_memory(self, key: str) -> dict[str, float]:
        """GiB in use on train rank 0's GPU, by every process on it; nothing on a CPU run."""
        used = self.trainer.device_memory_used_gib() if self.gpus else None
        return {} if used is None else {key: used}

    def sync_sizes(self) -> dict[str, float]:
        """What the last weight sync moved (the trainer's export): tensors, bytes, buckets; for a group sync (NCCL
        or colocated IPC) also the seconds of each of its phases, `sync/<phase>_s` (`weight_sync.PhaseClock`)."""
        exported = self.trainer.last_export()
        if exported is None:
            return {}
        phases = {f"sync/{phase}_s": seconds for phase, seconds in exported.phases.items()}
        return {"sync/tensors": float(exported.tensors), "sync/bytes": float(exported.bytes),
                "sync/buckets": float(exported.buckets), **phases}  # fmt: skip

    def sampling(self, step: int, round_: int = 0, eval_: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        e = self.cfg.eval
        # one seed per (step, round): rollouts are reproducible, so a resumed run repeats the straight one
        seed = self.cfg.seed * 1_000_003 + step * 101 + round_ + (50 if eval_ else 0)
        return SamplingParams(
            n=e.n_samples_per_prompt if eval_ else r.n_samples_per_prompt,
            max_new_tokens=r.max_response_len,
            temperature=e.temperature if eval_ else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=seed,
        )

    def score(self, prompts: Sequence, groups: list[list[Generation]]):
        return score_groups(self.rewards, self.processor.tokenizer.decode, prompts, groups)

    # -- eval, checkpoints, logging -------------------------------------------------------------------------------

    def evaluate_if_due(self, step: int) -> dict[str, float]:
        """Eval metrics after step `step` when `eval.interval` divides its number, else none."""
        interval = self.cfg.eval.interval
        return self.evaluate(step) if interval and (step + 1) % interval == 0 else {}

    def evaluate(self, step: int) -> dict[str, float]:
        if self.eval_set is None or len(self.eval_set) == 0:
            return {}
        prompts = [p for batch in self.eval_set.ordered_batches(256, self.cfg.eval.max_prompts) for p in batch]
        groups = self.rollout.generate(prompts, self.sampling(step, eval_=True))
        rewards, _ = self.score(prompts, groups)
        generated = [
            GeneratedGroup(p.prompt_ids, g, r, p.label, p.index)
            for p, g, r in zip(prompts, groups, rewards, strict=True)
        ]
        self.record_samples(f"eval_step_{step + 1}", step + 1, generated)
        flat = [r for rs in rewards for r in rs]
        out = {"eval/reward_mean": mean([r.overall for r in flat]), "eval/prompts": float(len(prompts))}
        acc = [r.accuracy for r in flat if r.accuracy is not None]
        if acc:
            out["eval/accuracy"] = mean(acc)
        return out

    def record_samples_if_due(self, step: int, batch: CollectedBatch, samples: list[TrainSample]) -> None:
        """Step `step`'s samples, with the advantages of the groups trained on, when `logging.samples_interval`
        divides its number."""
        interval, n = self.cfg.logging.samples_interval, self.cfg.rollout.n_samples_per_prompt
        if interval and (step + 1) % interval == 0:
            advantages = {
                id(g): [s.advantage for s in samples[i * n : (i + 1) * n]] for i, g in enumerate(batch.groups)
            }
            self.record_samples(f"step_{step + 1}", step + 1, batch.generated, advantages)

    def record_samples(
        self, name: str, step: int, generated: list[GeneratedGroup], advantages: dict[int, list[float]] | None = None
    ) -> None:
        """Every sample of `generated` in rollouts/<name>.jsonl and a wandb table, a few on the console (samples.py)."""
        media = {self.tokens.image_token_id: "<image>", self.tokens.video_token_id: "<video>"}
        decode = self.processor.tokenizer.decode
        records = sample_records(step, generated, decode, media=media, advantages=advantages)
        path = write_samples(self.run_dir, name, records)
        self.sinks.log_samples(name, records, step)
        show_samples(name.replace("_", " "), records, self.cfg.logging.samples_shown, path)

    def driver_state(self) -> dict[str, Any]:
        """What a checkpoint of the current step holds besides the trainer's files (config with secrets redacted)."""
        state = {
            "data": self.train_set.state_dict(),
            "engine_restarts": self.rollout.restarts(),
            "weight_resyncs": self.rollout.resyncs,
            "optimizer_state": self.cfg.checkpoint.optimizer_state,  # whether the trainer's files hold it
            "config": redacted(self.cfg),
        }
        if self.committed_ahead:  # (step, weight version) of each batch in rollouts_ahead.pt (ahead.py)
            state["rollouts_ahead"] = [[t, v] for t, v, _ in self.committed_ahead]
        return state

    def publish_save_before_sync(self) -> None:
        """A background save still in flight is waited for and published before a weight sync: a stop during a
        stalled sync ends the train ranks (trainer.py), and a checkpoint whose write they had not confirmed would be
        lost with them. The save has had the rollout and the train phase to finish, so this rarely waits; the wait
        counts in `perf/save_blocked_s`."""
        if self.pending_save is not None:
            t0 = time.perf_counter()
            try:
                self.finish_save(wait=True)
            finally:
                self.save_blocked_s += time.perf_counter() - t0

    def save_if_due(self) -> None:
        """The checkpoint of the last completed step when `checkpoint.interval` divides its number, in the background
        with `checkpoint.async_save`; first, a background save that has ended is published (`finish_save`)."""
        self.finish_save(wait=False)
        interval = self.cfg.checkpoint.interval
        if interval and self.completed_steps % interval == 0:
            self.save(background=self.cfg.checkpoint.async_save)

    def save(self, background: bool = False) -> None:
        """The checkpoint of the last completed step, unless it has one (or no step completed yet). A save still in
        flight is waited for first (one at a time). `background`: return once the trainer's state is snapshotted; the
        files are written while the next steps run and the checkpoint appears when `finish_save` publishes it.
        The seconds spent here are the next record's `perf/save_blocked_s`."""
        t0 = time.perf_counter()
        try:
            step = self.completed_steps
            if self.pending_save is None or self.pending_save.step != step or not background:
                self.finish_save(wait=True)
            if step == self.saved_step or self.pending_save is not None:
                return
            if not self.trainer_at_commit:
                log.warning(
                    "not saving: the trainer is past step %d; the newest checkpoint is step %d", step, self.saved_step
                )
                return
            keep = self.cfg.checkpoint.keep_last
            write = self.start_checkpoint if background else self.write_checkpoint
            self.pending_save = start_checkpoint(self.ckpt_root, step, self.committed, write, keep)
            if not background:
                self.finish_save(wait=True)
        finally:
            self.save_blocked_s += time.perf_counter() - t0

    def start_checkpoint(self, directory: Path) -> Callable[[], None]:
        """The trainer's files into `directory` (in the background: returns what waits for them), then the committed
        batches generated ahead (if any). In that order: megatron-core's save warns of an "old incomplete / corrupted
        checkpoint" when its directory is not empty. If the batches cannot be written, the trainer's write is
        waited for before the error goes on (the caller then removes the directory); a second signal
        (`JobInterrupted`) goes on at once, as a forced stop does."""
        wait = self.trainer.start_checkpoint(directory)
        try:
            self.write_batches_ahead(directory)
        except Exception:
            with contextlib.suppress(Exception):  # the batches' error is the one to report
                wait()
            raise
        return wait

    def write_checkpoint(self, directory: Path) -> Callable[[], None]:
        """`start_checkpoint` in the foreground: the trainer's files are written before this returns."""
        wait = self.trainer.write_checkpoint(directory)
        self.write_batches_ahead(directory)
        return wait

    def write_batches_ahead(self, directory: Path) -> None:
        if self.committed_ahead:
            write_batches(directory, [b.to_state(t) | {"weight_version": v} for t, v, b in self.committed_ahead])

    def finish_save(self, wait: bool) -> None:
        """Publish the save in flight (checkpoint.py: rename into place, prune) once the trainer has written it;
        `wait`: wait for that, else only if it has already ended. Raises the write's error (a full disk, ...)."""
        pending = self.pending_save
        if pending is None or not (wait or self.trainer.checkpoint_written()):
            return
        self.pending_save = None
        pending.finish()
        self.saved_step = pending.step

    def save_hf_if_due(self) -> None:
        """<run dir>/hf/step_N of the last completed step when `checkpoint.save_hf` asks for it (export.py)."""
        h, step = self.cfg.checkpoint.save_hf, self.completed_steps
        if self.trainer_at_commit and save_hf_due(step, h.steps, h.interval, h.final, step == self.cfg.num_steps):
            write = functools.partial(self.trainer.save_hf, max_shard_bytes=h.max_shard_bytes)
            save_hf_during_run(self.run_dir, step, write, self.processor, self.cfg.model.path)

    def save_after(self, err: BaseException) -> None:
        """On the way out after `err`: the checkpoint of the last completed step, if it can be written (not after a
        second signal); a failure to write it is logged, and `err` stays the error the caller sees."""
        if isinstance(err, JobInterrupted):
            if err.forced:
                log.warning("stopped at once: no final checkpoint; the newest checkpoint is step %d", self.saved_step)
                err.checkpoint = self.saved_step or None
                return
            log.warning("%s: writing the checkpoint of the last completed step (%d)", err, self.completed_steps)
        try:
            self.save()
        except Exception as save_err:  # e.g. the trainer actor is gone, or the disk is full: `err` is the story
            log.error("could not write the checkpoint of step %d: %s", self.completed_steps, save_err)
        if isinstance(err, JobInterrupted):
            err.checkpoint = self.saved_step or None

    def restore(self, path: Path, state: dict[str, Any]) -> int:
        """Resume from checkpoint `path` (its driver `state`, already checked and its data cursor restored)."""
        self.trainer.load_checkpoint(path)
        self.completed_steps = self.saved_step = state["step"]
        self.rollout.restarts_before = state["engine_restarts"]
        self.rollout.resyncs = state.get("weight_resyncs", 0)  # absent from checkpoints written before it existed
        self.rollout.sync_weights(weight_version(state["step"]))
        if state.get("rollouts_ahead"):
            batches = [(b["step"], b["weight_version"], StepBatch.from_state(b)) for b in read_batches(path)]
            self.ahead.restore(batches)
            self.committed_ahead = self.ahead.pending()
        self.committed = self.driver_state()
        log.info("resumed from %s at step %d", path, state["step"])
        if not has_optimizer_state(state):
            log.warning("%s", fresh_optimizer_note(path, state["step"]))
        return state["step"]

    def open_sinks(self, start: int) -> None:
        sinks = [JsonlSink(self.run_dir, resume_step=start + 1)]
        w = self.cfg.logging.wandb
        if w.mode != "disabled":
            sinks.append(
                WandbSink(
                    self.run_dir,
                    project=w.project,
                    entity=w.entity,
                    mode=w.mode,
                    name=self.run_dir.name,
                    config=redacted(self.cfg),
                    resume=start > 0,
                )
            )
        if self.cfg.logging.tensorboard:
            sinks.append(TensorBoardSink(self.run_dir, resume_step=start + 1 if start else None))
        self.sinks = Sinks(sinks)
        self.progress = Progress(self.cfg.num_steps, start, enabled=self.cfg.logging.progress)

    def log(self, metrics: dict[str, float]) -> None:
        self.sinks.log(metrics)
        self.progress.update(metrics)

    def close(self) -> None:
        if self.progress:
            self.progress.close()
        if self.sinks:
            self.sinks.close()
        if self.rollout:
            self.rollout.close()  # stops sglang servers, which would outlive their actors
        if self.ahead:
            self.ahead.close()  # its calls to the closed engines fail: it ends
        if self.trainer:
            self.trainer.close()
        if self.gpus:
            self.gpus.release()


# ---------------------------------------------------------------------------------------------------------------------


class Timer(PhaseClock):
    """Wall-clock seconds per named phase of one step, summed over the phase's entries: `with timer("train"): ...`
    (`weight_sync.PhaseClock`), and the step's own seconds since the timer was made."""

    def __init__(self):
        super().__init__()
        self.start = time.perf_counter()

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out["time/step_s"] = time.perf_counter() - self.start
        return out


def weight_version(step: int) -> str:
    """The label of the weights after `step` completed RL steps (what sglang responses must carry)."""
    return f"step-{step}"


def version_number(label: str | None) -> int:
    """`weight_version`'s inverse; any other label (the engines' initial one, "base") is the initial weights: 0."""
    if label is not None and label.startswith("step-") and label.removeprefix("step-").isdigit():
        return int(label.removeprefix("step-"))
    return 0


def token_versions(sample: TrainSample) -> list[int]:
    """The RL step of the weights that sampled each response token of `sample`."""
    if sample.token_versions is not None:
        return sample.token_versions.tolist()
    return [sample.weight_version] * sample.response_len
