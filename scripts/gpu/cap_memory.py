"""Make a larger GPU hold only an 80 GB card's memory: a ballast process takes the rest of each visible GPU, so that a
run on an H200 (139.8 GiB) that fits here also fits an H100 (H100_GIB below), and one that does not runs out of memory
here as it would there. Only the capacity is an H100's: bandwidth and clocks stay the H200's.

    python scripts/gpu/cap_memory.py GIB READY_CSV      (runs until killed; scripts/gpu/loop_run.sh's GPU_MEMORY_GIB)

For each GPU of CUDA_VISIBLE_DEVICES (else every GPU) it creates a CUDA context, reads the free memory, and holds
`free - GIB` more in one allocation (nothing, where the card has no more than GIB free), so that what every other
process on the GPU can use is GIB: this process's own context counts as part of the ballast, as the memory a card of
GIB would not have. Then it writes READY_CSV, one line `index, ballast MiB` per GPU (the index as nvidia-smi numbers
it: the entry of CUDA_VISIBLE_DEVICES), the ballast counting everything this process holds on that GPU (context
included: what nvidia-smi's memory.used adds for it; loop_run.sh starts it before the job, on GPUs nothing else
uses), and sleeps until SIGTERM / SIGINT.
scripts/gpu/summarize_run.py's --gpu-ballast subtracts it from the run's memory figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

# What an H100 80GB leaves a process, in CUDA's count: nvidia-smi says 81,559 MiB (79.65 GiB), but held to 79.65 an H200
# left SGLang 54.04 GiB beside the colocated 2B trainer where H100s left 53.81 (2026-11-28, docs/gpu-runs/*-ship-2b-*),
# so 0.25 less
H100_GIB = 79.4


def ballast_bytes(free: int, cap: int) -> int:
    """Bytes to hold so that `cap` of the `free` remain (0 when no more than `cap` is free)."""
    return max(free - cap, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gib", type=float, help=f"memory left to the other processes per GPU (H100 80GB: {H100_GIB})")
    ap.add_argument("ready_csv", type=Path, help="written once every ballast is held: `index, ballast MiB` per GPU")
    args = ap.parse_args()
    if not 1 <= args.gib <= 1024:
        ap.error(f"GIB is the memory left per GPU in GiB (e.g. {H100_GIB}), found {args.gib}")
    import torch

    if not torch.cuda.is_available():
        sys.exit("cap_memory: no CUDA device: the cap is for a GPU machine")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    held, lines = [], []
    cap = int(args.gib * 2**30)
    for device, name in enumerate(names):
        torch.cuda.set_device(device)
        free, total = torch.cuda.mem_get_info(device)
        n = ballast_bytes(free, cap)
        if n:
            held.append(torch.empty(n, dtype=torch.uint8, device=device))
        free_after, _ = torch.cuda.mem_get_info(device)
        lines.append(f"{name}, {(total - free_after) // 2**20}\n")  # the GPU is otherwise idle: all of it is ours
        print(
            f"cap_memory: GPU {name}: {total / 2**30:.2f} GiB, {free_after / 2**30:.2f} GiB left free "
            f"({n / 2**30:.2f} GiB held)",
            flush=True,
        )
    tmp = args.ready_csv.with_name(args.ready_csv.name + ".tmp")
    tmp.write_text("".join(lines))
    tmp.replace(args.ready_csv)  # complete when it appears
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    while not stop:
        time.sleep(1)


if __name__ == "__main__":
    main()
