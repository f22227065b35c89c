"""One train phase under torch.profiler, as a summary (`train.profile_steps`): where the time goes, kernels against the
rest.

`profiled()` runs its block under torch.profiler (CPU activity, and CUDA's when there is a GPU); the block's
`summary()`, taken after it, is `summarize`'s dict:

- `wall_s`: the block's wall time (the device synchronized at its end);
- `busy_s`, `busy_fraction`: the device's kernel time (the sum of every kernel's own time; kernels on several streams
  that overlap count twice, so a fraction over 1 means overlap) over the wall time; without CUDA, the CPU operators'
  own time;
- `classes_s`: that time by kind of kernel (`kernel_class`): matmul, attention, communication, other;
- `top`: the operators and kernels with the most own time (name, calls, seconds, class);
- with CUDA, the host's side of the same block: `host_top`, the CPU operators and CUDA runtime calls with the most own
  host time (name, calls, seconds), `host_s` their sum over the host's threads (the autograd engine's backward thread
  too, so it can exceed the wall time), and `host_waits_s`, the host's own time in the runtime calls that wait for
  the device (`HOST_WAITS`: synchronizations and the blocking copy). A phase whose device is idle much of its wall
  time (the 2B job: 58 %) is held back by the host; these say by what;
- with CUDA, where the host waits: `syncs`, the synchronizing calls torch reported in the block, and `sync_sites`,
  the Python call sites with the most (`synchronizations`: torch's sync debug mode "warn", on only for the block).
  Python code that runs in a backward pass (a custom Function's backward, a recomputed forward) is named where it
  runs; autograd's own C++ backward functions where that backward was called (torch replays their warnings there).
  torch calls the mode a prototype that "does not yet detect all synchronizing operations": `syncs` below the
  runtime's count of waiting calls (`HOST_WAITS`' rows in `host_top`, which lists the 15 costliest) says how many it
  missed. The profile of 2026-11-29 (docs/benchmarks.md) counted 1,002 host waits in one 2B train phase without
  saying whose.

The profiler slows what it watches (more on the host than on the device), so a profiled step's wall time is above an
unprofiled one's; compare its parts, not its total, with other steps. `write_profile` keeps every rank's summary of a
step in `<run dir>/profile/step_N.json` and says rank 0's in the log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_vl.metrics.sinks import replace_text

# a kernel's class: the first whose substring (lower case) its name holds; else "other"
KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "sendrecv")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm")),
)
TOP = 25  # operators in `top`
HOST_TOP = 15  # operators and runtime calls in `host_top`
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")  # exact names
PROFILE_DIR = "profile"
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's warning in sync debug mode 1 (c10/cuda)
SYNC_SITES_TOP = 20  # call sites in `sync_sites`
SITE_FRAMES = 3  # frames of a call site, innermost first, outside torch and this module

log = logging.getLogger(__name__)


def kernel_class(name: str) -> str:
    """matmul, attention, communication or other, from a kernel's or operator's name (`KERNEL_CLASSES`)."""
    lower = name.lower()
    for cls, needles in KERNEL_CLASSES:
        if any(n in lower for n in needles):
            return cls
    return "other"


def summarize(events: Any, wall_s: float, device: bool, top: int = TOP) -> dict[str, Any]:
    """The summary (module docstring) of torch.profiler's `key_averages()` over a block of `wall_s` seconds; `device`:
    count the CUDA kernels' own time (else the CPU operators')."""
    from torch.autograd import DeviceType

    rows, host = [], []  # (seconds, name, calls): the counted time; with CUDA, the host's own too
    for e in events:
        if device and e.device_type == DeviceType.CUDA:
            if (seconds := e.self_device_time_total / 1e6) > 0:
                rows.append((seconds, e.key, e.count))
        elif (seconds := e.self_cpu_time_total / 1e6) > 0:
            (host if device else rows).append((seconds, e.key, e.count))
    rows.sort(reverse=True)
    host.sort(reverse=True)
    busy = sum(s for s, _, _ in rows)
    classes = {cls: 0.0 for cls, _ in KERNEL_CLASSES} | {"other": 0.0}
    for seconds, name, _ in rows:
        classes[kernel_class(name)] += seconds
    out = {
        # Seconds to the profiler's microsecond, all alike: a class's sum is never below one of its rows' figures.
        "wall_s": round(wall_s, 6),
        "device": "cuda" if device else "cpu",
        "busy_s": round(busy, 6),
        "busy_fraction": round(busy / wall_s, 4) if wall_s > 0 else None,
        "classes_s": {k: round(v, 6) for k, v in classes.items()},
        "top": [
            {"name": name, "calls": calls, "seconds": round(seconds, 6), "class": kernel_class(name)}
            for seconds, name, calls in rows[:top]
        ],
    }
    if device:
        out["host_s"] = round(sum(seconds for seconds, _, _ in host), 6)
        out["host_waits_s"] = round(sum(seconds for seconds, name, _ in host if name in HOST_WAITS), 6)
        out["host_top"] = [
            {"name": name, "calls": calls, "seconds": round(seconds, 6)} for seconds, name, calls in host[:HOST_TOP]
        ]
    return out


@dataclass
class ProfiledBlock:
    """What `profiled` saw of its block; `summary()` reads it (module docstring). The reading costs seconds per 100K
    events (torch.profiler's `key_averages`: 11 s for 255K on a CPU, where stopping took 0.7), so it is its own call,
    made after the block's timed phase: a profiled train step's `time/train_s` is its train phase, not the reading
    (the tiny CPU job's step 2: train 2.33 s against 1.88 and 1.81 unprofiled; `time/profile_s` 7.39)."""

    device: bool  # CUDA kernels counted (else the CPU operators)
    wall_s: float | None = None  # set when the block ended normally
    prof: Any = None
    syncs: Counter | None = None  # with CUDA: the synchronizing calls by call site (`synchronizations`)

    def summary(self) -> dict[str, Any] | None:
        """The summary, once; None if the block raised or the summary was taken."""
        if self.prof is None or self.wall_s is None:
            return None
        events, self.prof = self.prof.key_averages(), None
        out = summarize(events, self.wall_s, device=self.device)
        if self.syncs is not None:
            out["syncs"] = sum(self.syncs.values())
            out["sync_sites"] = [
                {"site": call_site(frames), "calls": n} for frames, n in self.syncs.most_common(SYNC_SITES_TOP)
            ]
        return out


Frame = tuple[str, int, str]  # (file, line, function)
_NOT_SITES = (os.path.dirname(torch.__file__) + os.sep, "<frozen")  # path prefixes: torch itself, frozen modules
_OWN_FILES = {__file__, warnings.__file__}  # this module and the warnings machinery
_ROOT = str(Path(__file__).resolve().parents[2]) + os.sep


def caller_frames(frame: Any, frames: int = SITE_FRAMES) -> tuple[Frame, ...]:
    """The innermost `frames` frames from `frame` outwards (a `sys._getframe()`) that are neither torch's (its package
    folder, not any path with a folder named torch: the GPU machine's /opt/torch/.venv holds pytest and more) nor this
    module's nor the warnings machinery's. A walk of frame objects, not `traceback.extract_stack`: the host runs this
    once per synchronization, while the device waits for it, so it must cost microseconds, not a read of every
    frame's source line."""
    out: list[Frame] = []
    while frame is not None and len(out) < frames:
        code = frame.f_code
        if code.co_filename not in _OWN_FILES and not code.co_filename.startswith(_NOT_SITES):
            out.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(out)


def call_site(frames: Sequence[Frame]) -> str:
    """`caller_frames`' frames, innermost first, as "path:line:function <- ...", paths from the package folder on
    (`site-packages/` and the repository's root cut off)."""
    names = [f.split(f"site-packages{os.sep}")[-1].removeprefix(_ROOT) for f, _, _ in frames]
    return " <- ".join(f"{n}:{line}:{fn}" for n, (_, line, fn) in zip(names, frames, strict=True))


@contextmanager
def synchronizations(counts: Counter) -> Iterator[None]:
    """Count in `counts`, by `caller_frames`, every synchronizing CUDA call torch reports in the block: its sync debug
    mode "warn" (`torch.cuda.set_sync_debug_mode`) on for the block, each of its warnings taken here and not shown; the
    mode, the warning filters and `warnings.showwarning` as they were afterwards. Other warnings are shown as before.

    Python's warning filters and `showwarning` are the process's, not the block's thread's: a warning another thread
    raises meanwhile (a checkpoint's writer) passes here too, a `catch_warnings` of another thread that ends inside
    the block restores the filters it found, and code in the block that turns warnings into errors
    (`simplefilter("error")`) would turn a synchronization into one. A diagnostic for a profiled step, not for every
    step."""
    before_mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def take(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE in str(message):
                counts[caller_frames(sys._getframe(1))] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")  # once a process
        warnings.showwarning = take
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before_mode)


@contextmanager
def profiled() -> Iterator[ProfiledBlock]:
    """Run the block under torch.profiler (CPU activity, and CUDA's when there is a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if not cuda:
        # kineto's "gpuGetDeviceCount failed" ERROR line on a machine without a GPU, in this process's kineto and
        # those it starts; a level set before stands
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    block = ProfiledBlock(device=cuda, syncs=Counter() if cuda else None)
    prof = profile(activities=activities)
    with warnings.catch_warnings():  # "clears events at the end of each cycle": there is one cycle
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        prof.__enter__()  # entered and left by hand: the warning filter must not cover the profiled block
    try:
        with synchronizations(block.syncs) if cuda else contextlib.nullcontext():
            start = time.perf_counter()
            yield block
        if cuda:
            torch.cuda.synchronize()
        block.wall_s = time.perf_counter() - start
    finally:
        prof.__exit__(None, None, None)  # 0.7 s for 255K CPU events; reading them is `summary()`'s
    block.prof = prof


def write_profile(run_dir: Path, step: int, summaries: Sequence[dict[str, Any]]) -> Path:
    """`<run_dir>/profile/step_<step>.json` ({"step", "ranks": the summaries}), written atomically; a line of rank 0's
    figures in the log."""
    path = Path(run_dir) / PROFILE_DIR / f"step_{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, json.dumps({"step": step, "ranks": list(summaries)}, indent=1))
    if summaries:
        s = summaries[0]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in s["classes_s"].items())
        waits = f"; the host waited for it {s['host_waits_s']:.2f} s" if "host_waits_s" in s else ""
        log.info(
            "step %d's train phase under the profiler (rank %s): %.2f s, the %s busy %.2f s (%.0f %%: %s s)%s; "
            "the top operators and every rank in %s",
            step, s.get("rank", 0), s["wall_s"], s["device"], s["busy_s"], 100 * (s["busy_fraction"] or 0), parts,
            waits, path,
        )  # fmt: skip
    return path
