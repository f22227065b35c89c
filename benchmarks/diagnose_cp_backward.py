"""Which part of the RL job's train step makes the first backward fail with `CUDA error: invalid argument` at 32K
tokens, CP=2, when the Megatron bench of the same model, layout and length trains (docs/long_context.md, "What ran
so far"): one launch of 2 GPUs, <= 9 minutes.

    python benchmarks/diagnose_cp_backward.py [--variants a,b] [--budget-s 420] [--out F] [--logs DIR]

Runs `benchmarks/bench_megatron_cp.py` once per variant (`VARIANTS`, in order: the parts of the RL job's train step
that the bench lacks, the most suspect first), at 32K tokens (rl_loss also 24K), CP=2 with `vision_dp_when_cp` (the
RL job's default), full recompute, the warm-up step only. The first variant that fails with an error (not a timeout,
not out of memory) runs again at once under `CUDA_LAUNCH_BLOCKING=1`, so that the error is raised by the launch that
caused it and the traceback names the op (`where`: the last frames of the log); later failures run so at the end,
while the budget lasts. One JSON line per run on stdout (and appended to `--out`): variant, blocking, ok, error, the
result per length (peak GiB per GPU or what stopped it), wall seconds, where. Each run's log is kept in `--logs`. A
variant the budget leaves no time for is reported "not run: budget".

Reading the result (docs/long_context.md): rl_loss failing at 32K only, rl_loss_where and rl_step_where training, is
the RL loss's backward over the `[T/C, V]` logits past 2^31 elements (`train.logits_only_where_loss` avoids it);
bench_env failing is the environment; rl_step failing where rl_loss trains is the rest of the step (old-logprob pass,
schedule, distributed optimizer); every variant training puts the cause in what only the Ray job has (the colocated
SGLang server on GPU 0, Ray's placement): run the job itself under CUDA_LAUNCH_BLOCKING=1 next.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench_megatron_cp.py"

# The environment the RL job's train actors have and the bench's ranks have not: megatron's TP/SP overlap setting
# (orchestration/trainer.py `setup`) and SGLang's NCCL cuMem choice for every NCCL peer (gpu_env.nccl_peer_env)
RL_TRAINER_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_CUMEM_ENABLE": "0"}
COMMON = ("--gpus", "2", "--layouts", "cp2_vdp", "--lengths", "32768", "--recompute", "full", "--steps", "0")
BLOCKING_ENV = {"CUDA_LAUNCH_BLOCKING": "1", "TORCH_SHOW_CPP_STACKTRACES": "1"}


@dataclass(frozen=True)
class Variant:
    name: str
    has: str  # what of the RL job's train step it runs
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 150.0

    def argv(self) -> list[str]:
        """The bench's command line (the environment goes in with `--env`, so the bench's JSON line records it; a
        later `--lengths` wins over COMMON's)."""
        return [*COMMON, *self.args, *(f"--env={k}={v}" for k, v in self.env.items())]


RL = ("--response", "128")  # the RL job's responses: rollout.max_response_len=128, every one cut there
VARIANTS = (
    # the first suspect: the RL loss on the full bf16 logits [T/C, V], whose backward only the RL path runs
    # (IndexSelectBackward0 and SelectBackward0 fill [T/C, V] tensors); at 24K (12,288 x 151,936 = 1.87e9 elements
    # per rank, under 2^31) and at 32K (2.49e9, over it) in one launch
    Variant(
        "rl_loss",
        "the RL loss on the model's bf16 logits (index_select of the response rows, vocab_parallel_logprobs, PPO "
        "loss), fp32 pixels, the vision input mask, the trainer's environment; 24K then 32K",
        ("--path", "rl_loss", *RL, "--lengths", "24576,32768"),
        RL_TRAINER_ENV,
    ),
    Variant(
        "rl_loss_where",
        "rl_loss at 32K with train.logits_only_where_loss (logits at the loss positions only: no [T/C, V] tensor)",
        ("--path", "rl_loss", *RL, "--logits-only-where-loss"),
        RL_TRAINER_ENV,
    ),
    Variant(
        "rl_step_where",
        "the whole RL train step (4 samples, old-logprob pass, megatron schedule, distributed optimizer and its "
        "step) with train.logits_only_where_loss, the trainer's environment",
        ("--path", "rl_step", *RL, "--samples", "4", "--logits-only-where-loss"),
        RL_TRAINER_ENV,
        timeout_s=200.0,
    ),
    Variant(
        "bench_env",
        "the bench's step (it trained: docs/gpu-runs/2026-11-26-bench-cp-2xh100) in the trainer's environment",
        ("--path", "bench"),
        RL_TRAINER_ENV,
    ),
    Variant(
        "rl_step",
        "the whole RL train step as the failing job runs it, less Ray and SGLang",
        ("--path", "rl_step", *RL, "--samples", "4"),
        RL_TRAINER_ENV,
        timeout_s=200.0,
    ),
)
BY_NAME = {v.name: v for v in VARIANTS}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring).

    Raises:
        SystemExit: (argparse, exit 2) an unknown variant, a budget below one variant's bound.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(BY_NAME), help=f"which of {', '.join(BY_NAME)}, in order")
    parser.add_argument("--budget-s", type=float, default=420.0, help="bound of the whole launch, reruns included")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--logs", default="diagnose_logs", help="a folder for each run's log")
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    if unknown := [name for name in args.variants if name not in BY_NAME]:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(BY_NAME)}")
    shortest = min(BY_NAME[name].timeout_s for name in args.variants)
    if args.budget_s < shortest:
        parser.error(f"--budget-s {args.budget_s:g} is below one variant's bound ({shortest:g} s)")
    return args


def bench_result(log: str) -> dict | None:
    """The bench's JSON line (its last line starting with {"bench"), or None when it printed none."""
    for line in reversed(log.splitlines()):
        if line.startswith('{"bench"'):
            return json.loads(line)
    return None


def where(log: str, frames: int = 4) -> list[str]:
    """The last `frames` source locations of the log's last traceback and its error line: what names the op."""
    lines = log.splitlines()
    located = [line.strip() for line in lines if re.match(r'\s*File "', line)]
    errors = [line.strip() for line in lines if re.search(r"(Error|error):", line) and not line.startswith("{")]
    return located[-frames:] + errors[-1:]


def outcome(variant: Variant, returncode: int | None, log: str, blocking: bool, wall_s: float) -> dict:
    """One JSON record of a run: ok, the error (the bench's, else the log's last line), each length's result (peak
    memory per GPU, or what stopped it), the fullest GPU, where."""
    record = {"variant": variant.name, "has": variant.has, "blocking": blocking, "wall_s": round(wall_s, 1)}
    result = bench_result(log)
    values = result["results"] if result else {}
    values = {k: v for k, v in values.items() if not k.startswith("L")}  # no ratios between layouts
    failed = next((v for v in values.values() if not isinstance(v, dict)), None)
    if returncode is None:
        error = f"timeout after {variant.timeout_s:g} s"
    elif result is None:
        error = (log.strip().splitlines() or ["no output"])[-1]
    else:
        error = result["error"] or failed or (None if values else "no result")
    record["ok"] = returncode == 0 and error is None
    record["error"] = error
    record["results"] = {k: v["peak_gib_per_gpu"] if isinstance(v, dict) else v for k, v in values.items()}
    peaks = [v["peak_gib_per_gpu"] for v in values.values() if isinstance(v, dict)]
    record["peak_gib_per_gpu"] = max(peaks) if peaks else None
    record["where"] = [] if record["ok"] else where(log)
    return record


def rerun_worth(record: dict) -> bool:
    """A failed run whose error a blocking launch can locate (not a timeout, not out of memory)."""
    error = record["error"] or ""
    return not record["ok"] and not error.startswith("timeout") and "oom" not in error and "OutOfMemory" not in error


def run(variant: Variant, blocking: bool, logs: Path, timeout_s: float) -> dict:
    """One bench launch in its own process group, killed with it after `timeout_s`."""
    env = {**os.environ, **(BLOCKING_ENV if blocking else {})}
    cmd = [sys.executable, str(BENCH), *variant.argv(), "--timeout-s", str(max(timeout_s - 10, 10))]
    log_path = logs / f"{variant.name}{'_blocking' if blocking else ''}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
    record = outcome(variant, returncode, log_path.read_text(errors="replace"), blocking, time.monotonic() - t0)
    record["log"] = str(log_path)
    return record


def emit(record: dict, out: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s

    def attempt(variant: Variant, blocking: bool) -> dict | None:
        left = deadline - time.monotonic()
        if left < min(variant.timeout_s, 60.0):
            emit({"variant": variant.name, "blocking": blocking, "ok": None, "error": "not run: budget"}, args.out)
            return None
        record = run(variant, blocking, logs, min(variant.timeout_s * (1.5 if blocking else 1.0), left))
        emit(record, args.out)
        return record

    failed: list[Variant] = []
    for name in args.variants:
        record = attempt(BY_NAME[name], False)
        if record is not None and rerun_worth(record):
            if not failed:  # the first failure names its op at once: the rest of the budget may not reach the end
                attempt(BY_NAME[name], True)
            failed.append(BY_NAME[name])
    for variant in failed[1:]:
        attempt(variant, True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
