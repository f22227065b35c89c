"""What the driver tests share: the tiny job (configs/geo3k_tiny_cpu.yaml made fast), a tiny HF checkpoint with the
offline processor (what `model.init=pretrained` and SGLang load), the metrics a run wrote, a frozen clock, and the
stand-ins the driver is built with (`stand_ins`: `Hooks` with SGLang servers served by
tests/rollout/sglang/hf_server.py, an engine that dies on cue, small weight buckets)."""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import time
from datetime import datetime
from pathlib import Path

from miles_vl.config import JobConfig, load_config
from miles_vl.config.schema import TinyModelConfig
from miles_vl.data import load_processor
from miles_vl.models.qwen3_vl.model import build_model
from miles_vl.models.qwen3_vl.tokens import special_tokens
from miles_vl.orchestration.factories import (
    ENGINES,
    TRAIN_BACKENDS,
    Hooks,
    build_megatron,
    build_torch,
    launch_hf,
    launch_sglang,
)
from miles_vl.rollout import HFRolloutEngine
from miles_vl.rollout.weight_sync import WeightSyncOptions
from tests.orchestration import megatron_cpu

REPO = Path(__file__).resolve().parents[2]
PIXELS = (3136, 12544)  # data.min_pixels / max_pixels of configs/geo3k_tiny_cpu.yaml
FAST = (
    "data.synthetic_n=24",
    "rollout.batch_size=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_response_len=6",
    "eval.interval=2",
    "eval.max_prompts=2",
    "logging.progress=false",
    "logging.wandb.mode=disabled",
    "reward.name=tests.orchestration.rewards:length_reward",
)


def tiny_job(tmp_path: Path, name: str, *overrides: str) -> JobConfig:
    """The tiny CPU job, fast, writing into `tmp_path/name`; `overrides` last."""
    return load_config(
        REPO / "configs" / "geo3k_tiny_cpu.yaml",
        [*FAST, f"logging.output_dir={tmp_path}", f"logging.run_name={name}", *overrides],
    )


def pretrained(checkpoint: Path) -> tuple[str, ...]:
    """Overrides that start the job from `checkpoint` (see `write_checkpoint`)."""
    return ("model.init=pretrained", f"model.path={checkpoint}", "model.processor=null")


def write_checkpoint(path: Path, seed: int = 7, **tiny) -> Path:
    """The tiny random Qwen3-VL (TinyModelConfig, `tiny` overriding it) and the offline processor, saved as an HF
    checkpoint directory."""
    processor = load_processor("offline", *PIXELS)
    model = build_model(special_tokens(processor), tiny=TinyModelConfig().model_dump() | tiny, seed=seed)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


class FrozenClock(datetime):
    """`datetime` whose now() is always 2026-11-26 12:00:00: every fresh start stamps the same run directory name
    (`monkeypatch.setattr(miles_vl.orchestration.loop, "datetime", FrozenClock)`)."""

    @classmethod
    def now(cls, tz=None):
        return datetime(2026, 11, 26, 12, 0, 0)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class EngineThatDiesOnce(HFRolloutEngine):
    """The hf engine, except that the first generate() that finds `kill_file` deletes it and kills its process, as a
    crashed engine would (the driver must replace it and lose no sample)."""

    def __init__(self, *args, kill_file: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.kill_file = Path(kill_file)

    def generate(self, prompts, params):
        if self.kill_file.exists():
            self.kill_file.unlink()
            os._exit(1)
        return super().generate(prompts, params)


class EngineThatSignalsItsStart(HFRolloutEngine):
    """The hf engine, which creates `started` (holding its process id) as soon as its actor runs."""

    def __init__(self, *args, started: str, **kwargs):
        Path(started).write_text(str(os.getpid()))
        super().__init__(*args, **kwargs)


def build_torch_after(cfg: JobConfig, tokens, *, started: str, fail: bool = False):
    """The torch backend, built only once `started` exists (an engine created it: `EngineThatSignalsItsStart`);
    with `fail`, a build that then fails."""
    wait_for(Path(started), timeout_s=60.0)
    if fail:
        raise RuntimeError("the trainer's build failed (a test's)")
    return build_torch(cfg, tokens)


class EngineThatFailsToStart(HFRolloutEngine):
    """The hf engine, whose actor fails as it starts, once `after` exists (the trainer's build began:
    `build_torch_held`), after writing the time it did (`time.time()`) into `failed`."""

    def __init__(self, *args, failed: str, after: str, **kwargs):
        wait_for(Path(after))
        Path(failed).write_text(repr(time.time()))
        raise RuntimeError("the engine failed to start (a test's)")


def build_torch_held(cfg: JobConfig, tokens, *, pid_file: str, hold_s: float = 300.0):
    """A torch backend build that writes its process id into `pid_file`, then takes `hold_s` (a large model's build)
    before it builds."""
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(hold_s)
    return build_torch(cfg, tokens)


def stand_ins(
    *,
    sglang: bool = False,
    megatron: bool = False,
    kill_once: Path | None = None,
    weight_sync: WeightSyncOptions | None = None,
) -> Hooks:
    """The driver's parts with stand-ins: `sglang` servers are tests/rollout/sglang/hf_server.py (the real host runs
    it from the real argv, with this module in place of `sglang.launch_server`); the `megatron` backend is built by
    tests/orchestration/megatron_cpu.py on CPU stand-ins; with `kill_once`, the hf engines die once
    (`EngineThatDiesOnce`); `weight_sync`: e.g. small buckets, gloo in place of NCCL."""
    engines = dict(ENGINES)
    if sglang:
        launch = functools.partial(launch_sglang, launch_module="tests.rollout.sglang.hf_server")
        engines["sglang"] = dataclasses.replace(ENGINES["sglang"], launch=launch)
    if kill_once is not None:
        launch = functools.partial(launch_hf, engine=EngineThatDiesOnce, kill_file=str(kill_once))
        engines["hf"] = dataclasses.replace(ENGINES["hf"], launch=launch)
    backends = dict(TRAIN_BACKENDS)
    if megatron:
        backends["megatron"] = functools.partial(build_megatron, builder=megatron_cpu.build)
    return Hooks(engines=engines, train_backends=backends, weight_sync=weight_sync or WeightSyncOptions())


def wait_for(path: Path, timeout_s: float = 120.0) -> None:
    """Until `path` exists (another process creates it); TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s:.0f} s")
        time.sleep(0.02)


def build_torch_gated_save(cfg: JobConfig, tokens, *, gate: str):
    """The torch backend, whose checkpoint writes (in the train actor's background thread) create `<gate>.writing`
    and then wait for `<gate>.go` before writing anything: a test acts while a save is in flight."""
    backend = build_torch(cfg, tokens)
    snapshot = backend.checkpoint_snapshot

    def gated_snapshot(**options):
        write = snapshot(**options)

        def gated_write(directory: Path) -> None:
            Path(f"{gate}.writing").touch()
            wait_for(Path(f"{gate}.go"))
            write(directory)

        return gated_write

    backend.checkpoint_snapshot = gated_snapshot
    return backend


def build_torch_failing_save(cfg: JobConfig, tokens):
    """The torch backend, whose checkpoint writes (in the train actor's background thread) write the weights, then
    meet a full disk (ENOSPC) while the checkpoint directory's own disk has room for the driver's files."""
    backend = build_torch(cfg, tokens)
    snapshot = backend.checkpoint_snapshot

    def failing_snapshot(**options):
        write = snapshot(**options)

        def failing_write(directory: Path) -> None:
            write(directory)
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(directory) / "trainer_state.pt"))

        return failing_write

    backend.checkpoint_snapshot = failing_snapshot
    return backend
