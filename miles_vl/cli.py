"""`miles-vl`: the command line.

    miles-vl check configs/geo3k_tiny_cpu.yaml rollout.n_samples_per_prompt=8   # print the resolved config
    miles-vl train configs/geo3k_tiny_cpu.yaml                                 # run the RL job

Every subcommand that takes a config accepts `key.sub=value` overrides after it. Bad input exits with status 2 and
one message before anything starts (no Ray, no model): a config that does not validate (every problem listed), a
dataset file that cannot be read, a reward that cannot be resolved or loaded, a checkpoint that cannot be resumed.
`miles-vl train` stopped by SIGINT or SIGTERM writes the checkpoint of its last completed step and exits with
128 + the signal number (130, 143); the same command resumes it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

import yaml

import miles_vl
from miles_vl.config import ConfigError, JobConfig, load_config, redacted
from miles_vl.data import cli as data_cli
from miles_vl.data.layouts import DataError
from miles_vl.logs import setup_logging

log = logging.getLogger("miles_vl")

EXIT_CONFIG = 2

_EPILOG = """\
quickstart:
  make run                      set up .venv if needed, then run the tiny CPU GRPO job
  make test                     set up .venv if needed, then the CPU test suite

examples:
  miles-vl check configs/geo3k_tiny_cpu.yaml
  miles-vl check configs/geo3k_tiny_cpu.yaml rollout.n_samples_per_prompt=8 algo.kl_coef=0.01
  miles-vl train configs/geo3k_tiny_cpu.yaml num_steps=2

Overrides are key.sub=value pairs with YAML values: train.optimizer.lr=1e-6, data.system_prompt=null.
Every key, its default and its meaning: miles_vl/config/schema.py (docs/configs.md).
"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML job config, e.g. configs/geo3k_tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides applied on top of the file")


def _load(args: argparse.Namespace) -> JobConfig:
    return load_config(args.config, args.overrides)


def cmd_check(args: argparse.Namespace) -> int:
    """Print the resolved config (YAML, secrets redacted) and the derived values, or the problems."""
    cfg = _load(args)
    resolved = redacted(cfg)
    sys.stdout.write(yaml.safe_dump(resolved, sort_keys=False))
    sys.stdout.write("# derived\n" + yaml.safe_dump({"derived": cfg.derived()}, sort_keys=False))
    log.info("config OK: %s", args.config)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Validate, then hand the config to the driver loop."""
    cfg = _load(args)
    try:
        from miles_vl.orchestration import run_job
        from miles_vl.orchestration.checkpoint import CheckpointError
        from miles_vl.orchestration.loop import JobInterrupted
        from miles_vl.reward import RewardResolutionError, RewardWorkerError
    except ImportError as e:
        log.error("the training loop is not available in this build (%s)", e)
        return 1
    try:
        run_job(cfg, config_path=args.config)
    except (CheckpointError, RewardResolutionError, RewardWorkerError) as e:
        return _bad_input(e)
    except JobInterrupted as stop:
        where = (
            f"resume from step {stop.checkpoint} with the same command"
            if stop.checkpoint
            else "this run saved no checkpoint; the same command starts from the newest one there is, if any"
        )
        log.error("stopped by %s: %s", stop, where)
        return 128 + stop.signum
    return 0


def _bad_input(error: Exception) -> int:
    sys.stderr.write(f"error: {error}\n")
    return EXIT_CONFIG


def cmd_report(args: argparse.Namespace) -> int:
    """Plot the curves of a run directory's metrics.jsonl."""
    from miles_vl.metrics import write_report

    try:
        paths = write_report(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        log.error("%s", e)
        return 1
    for path in paths:
        sys.stdout.write(f"{path}\n")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Versions of megatron-bridge / megatron-core / Transformer Engine and the state of every patch."""
    import miles_vl.patches as patches

    try:
        patches.install()
    except patches.PatchTargetMissing as e:
        log.error("%s", e)
    report = patches.status()
    for dist, version in report["versions"].items():
        sys.stdout.write(f"{dist:28s} {version}\n")
    for st in report["patches"]:
        sys.stdout.write(f"{st.name:40s} {st.state:22s} {st.summary}\n")
        if st.detail:
            sys.stdout.write(f"{'':40s} {st.detail}\n")
    if "error" in report:
        sys.stdout.write(f"error: {report['error']}\n")
        return 1
    return 1 if any(st.state == "target missing" for st in report["patches"]) else 0


# name -> (help, configure parser, handler). Later subcommands (doctor, data, report) register here.
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "check": ("validate a config and print it resolved (exit 2 on errors)", _add_config_args, cmd_check),
    "train": ("run an RL job from a config", _add_config_args, cmd_train),
    "data": ("generate (data synth) or inspect (data inspect) datasets", data_cli.configure, data_cli.cmd_data),
    "doctor": (
        "megatron-bridge / megatron-core / TE versions and the state of miles_vl's patches",
        lambda p: None,
        cmd_doctor,
    ),
    "report": ("write PNG plots of a run's metrics (RUN_DIR/plots)", lambda p: p.add_argument("run_dir"), cmd_report),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-vl",
        description="Reinforcement learning for vision-language models (GRPO on Qwen3-VL).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"miles-vl {miles_vl.__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, configure, handler) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        configure(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_CONFIG
    setup_logging(args.log_level)
    # `module:function` extension points (rewards, dataset mappers) resolve from the working directory, as with
    # `python -m`: a console script's sys.path does not include it.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return args.handler(args)
    except (ConfigError, DataError) as e:
        return _bad_input(e)


if __name__ == "__main__":
    sys.exit(main())
