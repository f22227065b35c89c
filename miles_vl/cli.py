"""`miles-vl`: the command line.

    miles-vl check configs/geo3k_tiny_cpu.yaml rollout.n_samples_per_prompt=8   # dry run: every problem, or the config
    miles-vl train configs/geo3k_tiny_cpu.yaml                                 # run the RL job
    miles-vl doctor                                                            # the installed stack; what can run
    miles-vl configs geo3k_tiny_cpu my_job.yaml                                # copy a shipped config to edit
    miles-vl export runs/geo3k_tiny_cpu hf_model [--step N]                 # a checkpoint as an HF model

Every subcommand that takes a config accepts `key.sub=value` overrides after it, and `--log-level` before or after
the subcommand (else the config's `logging.level`). Bad input exits with status 2 and one message listing every
problem before anything starts (no run directory, no Ray, no model): a config that does not validate, and
(`orchestration/preflight.py`, run by both `check` and `train`) a backend whose packages do not import, a dataset file
that cannot be read, a reward or dataset_fn that cannot be resolved, a model or processor that is not there, a
checkpoint that cannot be resumed, a run or checkpoint directory that cannot be written. `miles-vl export` refuses
the same way an OUT_DIR it may not write (a run, anything inside one, a directory that is not an earlier export,
even with --force: orchestration/export.py). `miles-vl train` stopped by SIGINT or SIGTERM writes the checkpoint of
its last completed step and exits with 128 + the signal number (130, 143); the same command resumes it (once the last
step trains, the run finishes instead: exit 0, orchestration/loop.py). A full disk
during a save or an export ends it with one message naming the place and the fix, exit 1.

`module:function` extension points resolve from the working directory, searched after the installed packages
(`import_path`: a stray `math_verify.py` there never shadows the package). A secret field given as an override
(`rollout.sglang.api_key=...`) is redacted in `sys.argv` itself before anything reads it (wandb records the command
line), with a warning that other local users can read it in `ps`: give it as `${oc.env:VAR}` instead.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from miles_vl.import_path import put_working_dir_last

if __name__ == "__main__":  # `python -m miles_vl.cli` put the working directory first: not for the imports below
    put_working_dir_last()

import yaml  # noqa: E402

import miles_vl  # noqa: E402
from miles_vl.config import ConfigError, JobConfig, load_config, redact_overrides, redacted  # noqa: E402
from miles_vl.data import cli as data_cli  # noqa: E402
from miles_vl.data.layouts import DataError  # noqa: E402
from miles_vl.logs import setup_logging  # noqa: E402

log = logging.getLogger("miles_vl")

EXIT_CONFIG = 2
# A GPU's memory in GiB, what `check --gpu-memory-gib` compares its estimate with: an "80 GB" H100 has 81,559 MiB
# (79.65 GiB) by nvidia-smi and leaves a process about 79.4 (scripts/gpu/cap_memory.py's H100_GIB); an H200 139.8.
H100_80GB_GIB = 79.4
H200_141GB_GIB = 139.8

_EPILOG = """\
quickstart:
  make run                      set up .venv if needed, then run the tiny CPU GRPO job (vision_tiny_cpu)
  make test                     set up .venv if needed, then the CPU test suite

examples:
  miles-vl check configs/geo3k_tiny_cpu.yaml
  miles-vl check configs/geo3k_tiny_cpu.yaml rollout.n_samples_per_prompt=8 algo.kl_coef=0.01
  miles-vl train configs/geo3k_tiny_cpu.yaml num_steps=2 --log-level DEBUG
  miles-vl configs                                      the configs that ship with miles-vl
  miles-vl configs geo3k_tiny_cpu my_job.yaml           copy one to edit (from a wheel install too)
  miles-vl doctor                                       what is installed, and which backends can run
  miles-vl export runs/geo3k_tiny_cpu hf_model       the newest checkpoint as a Hugging Face model directory

Overrides are key.sub=value pairs with YAML values: train.optimizer.lr=1e-6, data.system_prompt=null.
Every key, its default and its meaning: miles_vl/config/schema.py (docs/configs.md).
"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML job config, e.g. configs/geo3k_tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides applied on top of the file")


def _add_check_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument(
        "--config-only",
        action="store_true",
        help="only validate the config (e.g. a cluster's config on a laptop): skip the checks of this machine",
    )
    p.add_argument(
        "--gpu-memory-gib",
        type=_positive_gib,
        default=H100_80GB_GIB,
        metavar="GIB",
        help=f"memory of the GPUs the job will run on as CUDA counts it (GiB), for the memory estimate (default "
        f"{H100_80GB_GIB}: an H100 80GB; {H200_141GB_GIB} for an H200 141GB)",
    )


def _positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of GiB (e.g. {H100_80GB_GIB} or {H200_141GB_GIB}), found {text!r}"
        )
    return value


def _load(args: argparse.Namespace) -> JobConfig:
    """The validated config; its `logging.level` applies unless `--log-level` was given."""
    cfg = load_config(args.config, args.overrides)
    if args.log_level is None:
        setup_logging(cfg.logging.level)
    return cfg


def cmd_check(args: argparse.Namespace) -> int:
    """A dry run: validate the config, check this machine for the job (`preflight`: packages, files, model), then
    print the resolved config (YAML, secrets redacted) and the derived values; or list every problem (exit 2)."""
    cfg = _load(args)
    if not args.config_only:
        try:
            _preflight(cfg, args.config)
        except ConfigError as e:  # say how to check a config where the job cannot run
            return _bad_input(
                ValueError(
                    f"{e}\nSome of these checks need the machine the job runs on (its packages, data files and "
                    f"model). To validate the config without them (on a laptop, before sending it to the cluster): "
                    f"miles-vl check --config-only {args.config}"
                    + (" with the same overrides" if args.overrides else "")
                )
            )
    resolved = redacted(cfg)
    sys.stdout.write(yaml.safe_dump(resolved, sort_keys=False))
    sys.stdout.write("# derived\n" + yaml.safe_dump({"derived": cfg.derived()}, sort_keys=False))
    if not args.config_only:  # the run directory of this machine: what `train` would do there
        from miles_vl.orchestration.checkpoint import CheckpointError
        from miles_vl.orchestration.loop import describe_start

        try:
            start = describe_start(cfg, args.config)
        except CheckpointError as e:
            return _bad_input(e)
        sys.stdout.write("# start\n" + yaml.safe_dump({"start": start}, sort_keys=False))
    _print_memory(cfg, args.gpu_memory_gib)
    log.info("config OK%s: %s", "" if args.config_only else " and this machine can run it", args.config)
    return 0


def _print_memory(cfg: JobConfig, gpu_gib: float) -> None:
    """`check`'s estimate of memory per GPU (orchestration/memory.py), as YAML comments; a warning when it does not
    fit. An estimate, so never an error: the job may still be started."""
    from miles_vl.orchestration.memory import estimate_memory

    estimate = estimate_memory(cfg, gpu_gib)
    if isinstance(estimate, str):
        sys.stdout.write(f"# memory per GPU: not estimated: {estimate}\n")
        return
    sys.stdout.write("# memory per GPU (estimate)\n" + "".join(f"#   {line}\n" for line in estimate.lines()))
    for problem in estimate.problems():
        log.warning("memory estimate: %s", problem)


def cmd_train(args: argparse.Namespace) -> int:
    """Validate, run the same checks as `check`, then hand the config to the driver loop."""
    cfg = _load(args)
    _preflight(cfg, args.config, fetch=True)
    try:
        from miles_vl.orchestration import run_job
        from miles_vl.orchestration.checkpoint import CheckpointError, DiskFullError
        from miles_vl.orchestration.loop import JobInterrupted
        from miles_vl.reward import RewardResolutionError, RewardWorkerError
    except ImportError as e:
        log.error("the training loop is not available in this build (%s)", e)
        return 1
    try:
        run_job(cfg, config_path=args.config)
    except (CheckpointError, RewardResolutionError, RewardWorkerError) as e:
        return _bad_input(e)
    except DiskFullError as e:
        return _failed(e)
    except JobInterrupted as stop:
        where = (
            f"resume from step {stop.checkpoint} with the same command"
            if stop.checkpoint
            else "this run saved no checkpoint; the same command starts from the newest one there is, if any"
        )
        log.error("stopped by %s: %s", stop, where)
        return 128 + stop.signum
    return 0


def _preflight(cfg: JobConfig, config_path: str, *, fetch: bool = False) -> None:
    """`orchestration.preflight`: raises one ConfigError with every problem of the job on this machine. `fetch`
    (`train`): first download the hub ids the job loads into the Hugging Face cache (`fetch_hub_models`)."""
    try:
        from miles_vl.orchestration.preflight import fetch_hub_models, preflight
    except ImportError as e:  # a core package is missing or broken
        raise ConfigError(
            [f"miles_vl's driver does not import here ({e}); `miles-vl doctor` says what is missing"]
        ) from None
    if fetch:
        fetch_hub_models(cfg, config_path)
    log.info("checking this machine for the job: packages, data files, reward, model")
    preflight(cfg, config_path)


def _bad_input(error: Exception) -> int:
    sys.stderr.write(f"error: {error}\n")
    return EXIT_CONFIG


def _failed(error: OSError) -> int:
    """A failure the message explains whole (a full disk: the place and the fix), without the traceback."""
    sys.stderr.write(f"error: {error.strerror or error}\n")
    return 1


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


def _configure_export(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run directory (config.yaml, checkpoints/), e.g. runs/geo3k_tiny_cpu"
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face model directory to write")
    p.add_argument("--step", type=int, help="the checkpoint's step (default: the newest that verifies)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT_DIR if it is an earlier export (it holds .miles_vl_export.json); never a run's files",
    )
    p.add_argument(
        "--max-shard-bytes",
        metavar="BYTES",  # checked by export_run, so that a bad value is one line like every other refusal
        help="shard the safetensors above this size (default: the run's checkpoint.save_hf.max_shard_bytes, 5 GB)",
    )


def cmd_export(args: argparse.Namespace) -> int:
    """Write a run's checkpoint as a Hugging Face model directory (orchestration/export.py). Bad input (the run, the
    step, OUT_DIR, --max-shard-bytes) exits 2 before Ray starts; a full disk exits 1 with one message."""
    from miles_vl.orchestration.checkpoint import CheckpointError, DiskFullError
    from miles_vl.orchestration.export import ExportError, export_run

    try:  # export_run checks --max-shard-bytes (the text as given) before anything starts
        out = export_run(
            args.run_dir, args.out_dir, step=args.step, force=args.force, max_shard_bytes=args.max_shard_bytes
        )
    except (ExportError, CheckpointError) as e:
        return _bad_input(e)
    except DiskFullError as e:
        return _failed(e)
    sys.stdout.write(f"{out}\n")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """The stack (`miles_vl.stack`): each package's version, whether it imports, what it is needed for; CUDA; the
    state of every megatron-bridge patch; which backends can run. Exit 0 when the embedded backends can run."""
    import platform

    from miles_vl import stack

    out = sys.stdout.write
    out(f"miles-vl {miles_vl.__version__}, Python {platform.python_version()} ({sys.executable})\n\n")
    out(f"{'package':20s} {'version':22s} {'imports':8s} needed for\n")
    probes = [stack.probe(package) for package in stack.PACKAGES]
    for pr in probes:
        package = pr.package
        for line in pr.output:
            log.debug("import %s: %s", package.module, line)
        need = package.backend or "every job"
        out(f"{package.dist:20s} {pr.version or 'not installed':22s} {'yes' if pr.ok else 'NO':8s} {need}: ")
        out(f"{package.purpose}\n")
        if not pr.ok:
            fix = "the package it names (its own line)" if stack.fails_for_another(pr, probes) else package.install
            out(f"{'':20s} {pr.error}\n{'':20s} fix: {fix}\n")
        if package.dist == "torch" and pr.ok:
            out(f"{'':20s} {_cuda_line()}\n")
    ready = {}
    for backend in (None, *stack.FALLBACKS):
        missing = [pr.package.dist for pr in probes if pr.package.backend in (None, backend) and not pr.ok]
        ready[backend] = missing
    out("\nmegatron-bridge patches (train.backend=megatron)\n")
    out(_patch_lines(ready["train.backend=megatron"]))
    out("\n")
    names = {None: "embedded backends (rollout.backend=hf, train.backend=torch)", **{b: b for b in stack.FALLBACKS}}
    for backend, missing in ready.items():
        out(f"{names[backend]:60s} {'ready' if not missing else 'cannot run: missing ' + ', '.join(missing)}\n")
    return 0 if not ready[None] else 1


def _cuda_line() -> str:
    import torch

    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return f"CUDA {torch.version.cuda}: {torch.cuda.device_count()} GPU(s), {', '.join(names)}"
    build = f"a CUDA {torch.version.cuda} build, but no GPU is visible" if torch.version.cuda else "a CPU build"
    return f"CUDA: not available ({build}); jobs with train.num_gpus=0 run on the CPU"


def _patch_lines(megatron_missing: list[str]) -> str:
    """The state of every patch, or why it cannot be known here."""
    if megatron_missing:
        return f"  not checked: megatron-bridge's Qwen3-VL model needs {', '.join(megatron_missing)}\n"
    import miles_vl.patches as patches
    from miles_vl.stack import captured_output

    with captured_output():
        try:
            patches.install()
        except patches.PatchTargetMissing as e:
            return f"  error: {e}\n"
        report = patches.status()
    if "error" in report:
        return f"  error: {report['error']}\n"
    lines = []
    for st in report["patches"]:
        lines.append(f"  {st.name:40s} {st.state:22s} {st.summary}\n")
        if st.detail:
            lines.append(f"  {'':40s} {st.detail}\n")
    return "".join(lines)


def shipped_configs() -> Path:
    """The folder of the runnable configs: `miles_vl/configs` in an installed wheel (setup.py copies them there), else
    `configs/` of the checkout this package runs from."""
    package = Path(miles_vl.__file__).resolve().parent
    for folder in (package / "configs", package.parent / "configs"):
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    raise FileNotFoundError(f"no configs next to {package}: the installation is incomplete; reinstall miles-vl")


def _configure_configs(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="a shipped config, e.g. geo3k_tiny_cpu (without it: list them)")
    p.add_argument("dest", nargs="?", help="file or folder to copy it to (without it: print it)")
    p.add_argument("--force", action="store_true", help="overwrite DEST if it exists")


def cmd_configs(args: argparse.Namespace) -> int:
    """List the shipped configs, print one, or copy one to a path to edit and run."""
    folder = shipped_configs()
    configs = {path.stem: path for path in sorted(folder.glob("*.yaml"))}
    if not args.name:
        for name, path in configs.items():
            first = path.read_text().splitlines()[0] if path.read_text() else ""
            sys.stdout.write(f"{name:36s} {first.removeprefix('#').strip()}\n")
        sys.stdout.write(f"\n({folder}) copy one: miles-vl configs NAME my_job.yaml; then miles-vl train my_job.yaml\n")
        return 0
    name = args.name.removesuffix(".yaml")
    if name not in configs:
        near = difflib.get_close_matches(name, configs, n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        return _bad_input(ValueError(f"no shipped config {args.name!r}; {hint}the configs: {', '.join(configs)}"))
    if not args.dest:
        sys.stdout.write(configs[name].read_text())
        return 0
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / f"{name}.yaml"
    if dest.exists() and not args.force:
        return _bad_input(FileExistsError(f"{dest} exists; choose another path, or --force to overwrite it"))
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(configs[name], dest)
    sys.stdout.write(f"{dest}\n")
    log.info("wrote %s; check it with: miles-vl check %s", dest, dest)
    return 0


# name -> (help, configure parser, handler). Later subcommands (doctor, data, report) register here.
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "check": (
        "dry run: validate a config, check that this machine can run it, print it resolved (exit 2 on problems)",
        _add_check_args,
        cmd_check,
    ),
    "train": ("run an RL job from a config", _add_config_args, cmd_train),
    "data": ("generate (data synth) or inspect (data inspect) datasets", data_cli.configure, data_cli.cmd_data),
    "doctor": (
        "the installed stack (torch/CUDA, transformers, Ray, SGLang, megatron, TE), the patches, what can run",
        lambda p: None,
        cmd_doctor,
    ),
    "configs": (
        "list the shipped configs, print one (NAME), or copy one to a path (NAME DEST)",
        _configure_configs,
        cmd_configs,
    ),
    "export": (
        "write a run's checkpoint (newest, or --step N) as a Hugging Face model directory: config.json, safetensors "
        "(sharded above 5 GB), processor and chat template; transformers' from_pretrained and SGLang load it",
        _configure_export,
        cmd_export,
    ),
    "report": ("write PNG plots of a run's metrics (RUN_DIR/plots)", lambda p: p.add_argument("run_dir"), cmd_report),
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _log_level_parent(default: object) -> argparse.ArgumentParser:
    """`--log-level`, before the subcommand (default None) or after it (not set unless given, so that it does not
    hide one given before)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default,
        help="log level of this process (default: the config's logging.level, else INFO)",
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-vl",
        description="Reinforcement learning for vision-language models (GRPO on Qwen3-VL).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_log_level_parent(None)],
    )
    parser.add_argument("--version", action="version", version=f"miles-vl {miles_vl.__version__}")
    after = _log_level_parent(argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, configure, handler) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[after])
        if configure is data_cli.configure:
            configure(p, parents=[after])
        else:
            configure(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # `module:function` extension points (rewards, dataset mappers) resolve from the working directory, after the
    # installed packages (a console script's sys.path does not include it; `python -m` puts it first)
    put_working_dir_last()
    argv = list(sys.argv[1:] if argv is None else argv)
    secrets = _hide_secret_overrides()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `train CONFIG a=1 --log-level DEBUG b=2`: argparse ends the overrides at the option; what follows is more of them
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_CONFIG
    setup_logging(args.log_level or "INFO")
    if secrets:
        log.warning(
            "%s given on the command line: other users of this machine can read it there (ps, /proc) while the job "
            "runs; miles-vl keeps it out of what it writes. Set it from the environment instead: %s",
            ", ".join(secrets),
            " ".join(f"{key}='${{oc.env:{_env_name(key)}}}'" for key in secrets),
        )
    try:
        return args.handler(args)
    except (ConfigError, DataError) as e:
        return _bad_input(e)


def _hide_secret_overrides() -> list[str]:
    """Redact every secret override (`schema.secret_field`) in `sys.argv` itself, before anything reads it: wandb
    records the command line (and uploads it online), and Ray's job record gets it from here (`placement`). Returns the
    keys that were given a value."""
    sys.argv[1:], keys = redact_overrides(sys.argv[1:])
    return keys


def _env_name(key: str) -> str:
    """An environment variable name for a secret key: rollout.sglang.api_key -> SGLANG_API_KEY."""
    return "_".join(key.split(".")[-2:]).upper()


if __name__ == "__main__":
    sys.exit(main())
