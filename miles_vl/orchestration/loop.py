"""The driver loop: the whole RL algorithm on one screen.

    for step in range(start, num_steps):
        prompts  = next batch of the training set
        groups   = rollout (n_samples_per_prompt each; engines restarted and prompts retried if one dies)
        rewards  = reward function on every response (errors and timeouts score 0 and are counted)
        samples  = group advantages (zero for groups whose rewards are all equal)
        metrics  = train on the samples (packed THD micro-batches)
        sync     = trainer weights -> every engine (then each flushes its caches)
        eval / checkpoint when due

Everything that can be wrong with the config, the data or the reward function is found before Ray starts.
The engines (hf or sglang), their recovery and the weight sync live in engines.py and weight_sync.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
import yaml

from miles_vl.algo import compute_advantages
from miles_vl.config import ConfigError, JobConfig
from miles_vl.data import PromptDataset, build_datasets, load_processor, processor_metadata, special_tokens
from miles_vl.metrics import JsonlSink, Sinks, WandbSink, write_report
from miles_vl.model import SpecialTokens
from miles_vl.orchestration.checkpoint import read_driver_state, resolve_resume, save_checkpoint
from miles_vl.orchestration.engines import RolloutEngines
from miles_vl.orchestration.placement import GpuPlacement, ray_session, reserve_gpus
from miles_vl.orchestration.progress import Progress
from miles_vl.orchestration.sglang_engines import config_problems as sglang_config_problems
from miles_vl.orchestration.trainer import Trainer
from miles_vl.reward import RewardSample, resolve_reward, score_batch
from miles_vl.rollout import Generation, SamplingParams
from miles_vl.train import TrainSample

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# the job


def run_job(cfg: JobConfig, config_path: str | None = None) -> Path:
    """Run the RL job described by `cfg`; returns the run directory (metrics.jsonl, checkpoints, plots).

    Raises:
        ConfigError: a backend this build does not have (before anything starts).
    """
    check_backends(cfg, config_path)
    run_dir = make_run_dir(cfg, config_path)
    processor = load_processor(cfg.model.processor or cfg.model.path, cfg.data.min_pixels, cfg.data.max_pixels)
    tokens = special_tokens(processor)
    (run_dir / "processor.yaml").write_text(yaml.safe_dump(processor_metadata(processor), sort_keys=False))
    splits = build_datasets(cfg.data, processor, seed=cfg.seed)
    reward_fn = resolve_reward(cfg.reward.name, **reward_options(cfg))
    ckpt_root = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    resume = resolve_resume(ckpt_root, cfg.checkpoint.resume)

    with ray_session(cfg.ray.address, num_cpus=cfg.ray.num_cpus, dashboard=cfg.ray.dashboard):
        job = Job(cfg, run_dir, ckpt_root, processor, tokens, splits.train, splits.eval, reward_fn)
        try:  # from here on, close() stops what the job started (sglang servers outlive their actors)
            start = job.restore(resume) if resume else 0
            job.open_sinks(start)
            for step in range(start, cfg.num_steps):
                metrics = job.rl_step(step)
                if cfg.eval.interval and (step + 1) % cfg.eval.interval == 0:
                    metrics |= job.evaluate(step)
                job.log(metrics)
                if cfg.checkpoint.interval and (step + 1) % cfg.checkpoint.interval == 0:
                    job.save(step + 1)
            job.save(cfg.num_steps)
        except KeyboardInterrupt:
            log.warning("interrupted: writing a final checkpoint of %d completed steps", job.completed_steps)
            job.save(job.completed_steps)
            raise
        finally:
            job.close()
    write_report(run_dir)
    log.info("run finished: %s", run_dir)
    return run_dir


# Packages a backend needs beyond the core install (checked before Ray starts), and the backend to use instead.
BACKEND_PACKAGES = {("train", "megatron"): (("megatron.bridge", "megatron.core"), "torch")}


def check_backends(cfg: JobConfig, config_path: str | None = None) -> None:
    """What the config asks of this environment that it cannot do, as one ConfigError (before Ray starts)."""
    problems = []
    for (role, name), (packages, fallback) in BACKEND_PACKAGES.items():
        missing = [p for p in packages if getattr(cfg, role).backend == name and not _importable(p)]
        if missing:
            problems.append(
                f"{role}.backend={name} needs {', '.join(missing)}, which this environment does not have; install "
                f"miles-vl[{name}] (docs/cluster.md lists the versions) or set {role}.backend={fallback}"
            )
    if cfg.rollout.backend == "sglang":
        problems += sglang_config_problems(cfg)
    if problems:
        raise ConfigError(problems, config_path)


def make_run_dir(cfg: JobConfig, config_path: str | None) -> Path:
    name = cfg.logging.run_name or f"{Path(config_path).stem if config_path else 'job'}"
    run_dir = Path(cfg.logging.output_dir) / name
    if cfg.logging.run_name is None and cfg.checkpoint.resume == "never":
        run_dir = run_dir.with_name(f"{name}-{datetime.now():%Y%m%d-%H%M%S}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return run_dir


def reward_options(cfg: JobConfig) -> dict:
    if cfg.reward.name == "geo3k":
        return {"format_weight": cfg.reward.format_weight, "format_pattern": cfg.reward.format_pattern}
    return {}


# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Job:
    cfg: JobConfig
    run_dir: Path
    ckpt_root: Path
    processor: object
    tokens: SpecialTokens
    train_set: PromptDataset
    eval_set: PromptDataset | None
    reward_fn: object
    completed_steps: int = 0
    saved_step: int | None = None  # the newest step this job saved or resumed from: never saved again
    sinks: Sinks | None = None
    progress: Progress | None = None
    rollout: RolloutEngines | None = None
    trainer: Trainer | None = None
    gpus: GpuPlacement | None = None

    def __post_init__(self):
        try:  # the caller's close() cannot run before the constructor returns: undo a partial start here
            self.gpus = reserve_gpus(self.cfg.train.num_gpus) if self.cfg.train.num_gpus else None
            self.trainer = Trainer(self.cfg, self.tokens, self.gpus)
            self.rollout = RolloutEngines(self.cfg, self.tokens, self.trainer, self.run_dir / "logs", self.gpus)
        except BaseException:
            self.close()
            raise

    # -- one RL step ---------------------------------------------------------------------------------------------

    def rl_step(self, step: int) -> dict[str, float]:
        timer = Timer()
        with timer("rollout"):
            prompts, groups, rewards, stats = self.collect(step)
        with timer("advantages"):
            samples, adv_stats = self.to_train_samples(prompts, groups, rewards)
        with timer("train"):
            self.rollout.release_memory()  # colocated: the trainer gets the devices
            train_metrics = self.trainer.train(samples)
            self.rollout.resume_memory()
        with timer("sync"):
            self.rollout.sync_weights(weight_version(step + 1))
        self.completed_steps = step + 1
        n_tokens = sum(s.input_ids.numel() for s in samples)
        perf = {
            "perf/train_tokens_per_s": n_tokens / max(timer.seconds["train"], 1e-9),
            "perf/rollout_tokens_per_s": stats["rollout/response_tokens"] / max(timer.seconds["rollout"], 1e-9),
        }
        return {"step": step + 1, **stats, **adv_stats, **train_metrics, **perf, **timer.metrics()}

    def collect(self, step: int):
        """Rollout + reward, with DAPO-style dynamic sampling when enabled (bounded extra rounds)."""
        ds = self.cfg.rollout.dynamic_sampling
        want = self.cfg.rollout.batch_size
        prompts, groups, rewards, dropped, rounds = [], [], [], 0, 0
        reward_stats = []
        while len(prompts) < want:
            batch = self.train_set.next_batch(want - len(prompts))
            gens = self.rollout.generate(batch, self.sampling(step, round_=rounds))
            scored = self.score(batch, gens)
            reward_stats.append(scored[1])
            for p, g, r in zip(batch, gens, scored[0], strict=True):
                if ds.enabled and len({x.overall for x in r}) == 1:
                    dropped += 1
                    continue
                prompts.append(p)
                groups.append(g)
                rewards.append(r)
            rounds += 1
            if not ds.enabled or rounds > ds.max_rounds:
                break
        if not prompts:
            raise RuntimeError(
                f"dynamic sampling kept no group in {rounds} rounds (every group had equal rewards); raise "
                "rollout.dynamic_sampling.max_rounds or check the reward function"
            )
        flat = [r for rs in rewards for r in rs]
        gens = [g for gs in groups for g in gs]
        stats = {
            "reward/mean": _mean([r.overall for r in flat]),
            "reward/std": float(torch.tensor([r.overall for r in flat]).std()) if len(flat) > 1 else 0.0,
            "reward/errors": float(sum(s.n_errors for s in reward_stats)),
            "reward/timeouts": float(sum(s.n_timeouts for s in reward_stats)),
            "rollout/prompts": float(len(prompts)),
            "rollout/response_len_mean": _mean([g.response_ids.numel() for g in gens]),
            "rollout/truncated_fraction": _mean([g.finish_reason == "length" for g in gens]),
            "rollout/response_tokens": float(sum(g.response_ids.numel() for g in gens)),
            "rollout/visual_tokens_per_sample": _mean([_visual_tokens(p, self.tokens) for p in prompts]),
            "rollout/engine_restarts": float(self.rollout.restarts()),
            "rollout/weight_resyncs": float(self.rollout.resyncs),
            "rollout/rounds": float(rounds),
        }
        for part in ("accuracy", "format"):
            values = [getattr(r, part) for r in flat if getattr(r, part) is not None]
            if values:
                stats[f"reward/{part}"] = _mean(values)
        if ds.enabled:
            stats["rollout/dynamic_sampling_drop_rate"] = dropped / max(dropped + len(prompts), 1)
        return prompts, groups, rewards, stats

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
        decode = self.processor.tokenizer.decode
        samples = [
            RewardSample(decode(g.response_ids, skip_special_tokens=True), p.label, {"index": p.index, **p.metadata})
            for p, gs in zip(prompts, groups, strict=True)
            for g in gs
        ]
        results, stats = score_batch(self.reward_fn, samples, timeout_s=self.cfg.reward.timeout_s)
        n = len(groups[0]) if groups else 0
        return [results[i * n : (i + 1) * n] for i in range(len(groups))], stats

    def to_train_samples(self, prompts, groups, rewards) -> tuple[list[TrainSample], dict[str, float]]:
        a = self.cfg.algo
        flat_rewards = torch.tensor([r.overall for rs in rewards for r in rs], dtype=torch.float32)
        adv = compute_advantages(
            flat_rewards,
            len(groups[0]),
            estimator=a.estimator,
            norm_adv_by_std=a.norm_adv_by_std,
            token_counts=torch.tensor([g.response_ids.numel() for gs in groups for g in gs]),
        )
        samples, k = [], 0
        for p, gs in zip(prompts, groups, strict=True):
            for g in gs:
                samples.append(
                    TrainSample(
                        input_ids=torch.cat([p.prompt_ids, g.response_ids]),
                        prompt_len=p.prompt_ids.numel(),
                        advantage=float(adv.advantages[k]),
                        rollout_logprobs=g.logprobs,
                        image_grid_thw=p.image_grid_thw,
                        pixel_values=p.pixel_values,
                    )
                )
                k += 1
        return samples, {"rollout/zero_adv_group_fraction": adv.zero_adv_group_fraction}

    # -- eval, checkpoints, logging -------------------------------------------------------------------------------

    def evaluate(self, step: int) -> dict[str, float]:
        if self.eval_set is None or len(self.eval_set) == 0:
            return {}
        prompts = [p for batch in self.eval_set.ordered_batches(256, self.cfg.eval.max_prompts) for p in batch]
        groups = self.rollout.generate(prompts, self.sampling(step, eval_=True))
        rewards, _ = self.score(prompts, groups)
        flat = [r for rs in rewards for r in rs]
        out = {"eval/reward_mean": _mean([r.overall for r in flat]), "eval/prompts": float(len(prompts))}
        acc = [r.accuracy for r in flat if r.accuracy is not None]
        if acc:
            out["eval/accuracy"] = _mean(acc)
        return out

    def save(self, step: int) -> None:
        if step == self.saved_step:
            return
        state = {
            "data": self.train_set.state_dict(),
            "engine_restarts": self.rollout.restarts(),
            "weight_resyncs": self.rollout.resyncs,
            "config": self.cfg.model_dump(mode="json"),
        }
        save_checkpoint(
            self.ckpt_root,
            step,
            state,
            self.trainer.save_checkpoint,
            keep_last=self.cfg.checkpoint.keep_last,
        )
        self.saved_step = step

    def restore(self, path: Path) -> int:
        state = read_driver_state(path)
        self.trainer.load_checkpoint(path)
        self.train_set.load_state_dict(state["data"])
        self.completed_steps = self.saved_step = state["step"]
        self.rollout.restarts_before = state["engine_restarts"]
        self.rollout.resyncs = state.get("weight_resyncs", 0)  # absent from checkpoints written before it existed
        self.rollout.sync_weights(weight_version(state["step"]))
        log.info("resumed from %s at step %d", path, state["step"])
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
                    config=self.cfg.model_dump(mode="json"),
                )
            )
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
        if self.trainer:
            self.trainer.close()
        if self.gpus:
            self.gpus.release()


# ---------------------------------------------------------------------------------------------------------------------


class Timer:
    """Wall-clock seconds per named phase of one step: `with timer("train"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out["time/step_s"] = time.perf_counter() - self.start
        return out


def weight_version(step: int) -> str:
    """The label of the weights after `step` completed RL steps (what sglang responses must carry)."""
    return f"step-{step}"


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else 0.0


def _visual_tokens(prompt, tokens: SpecialTokens) -> int:
    return int((prompt.prompt_ids == tokens.image_token_id).sum() + (prompt.prompt_ids == tokens.video_token_id).sum())


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False
