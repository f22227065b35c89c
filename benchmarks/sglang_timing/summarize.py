"""Where each benchmark call's time went, from the timing file of bench_sglang_decode.py's `timed` variant.

    python benchmarks/sglang_timing/summarize.py sglang_timing.jsonl[.xz] [--trim OUT.jsonl]

One JSON line per `bench.call`: the call's wall time and, per timed step (sitecustomize.py), how many ran inside the
call and their summed milliseconds (the spans of async steps, `tok.tokenize`, overlap: their sum can exceed the
call); `tok.send` split into `prefix` (`new: 0`, the prompt sent alone before its `n` copies) and `sample` (a request
that samples tokens: one of the `n` copies, or a request of its own with `n = 1`). `--trim` writes only the records
inside the calls, without the scheduler's idle polls (`sched.next_batch` under 0.5 ms), for committing beside the run
(xz-compressed, docs/gpu-runs/README.md); a `.xz` or `.gz` timing file is read as it is. A summary of a trimmed file
differs from the whole file's only in `sched.next_batch` (the idle polls it left out).
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
from collections import defaultdict

IDLE_MS = 0.5


def load(path: str) -> tuple[list[dict], list[dict]]:
    opener = lzma.open if path.endswith(".xz") else gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    calls = [r for r in rows if r["what"] == "bench.call"]
    return calls, [r for r in rows if r["what"] != "bench.call"]


def inside(call: dict, records: list[dict]) -> list[dict]:
    """Records that ended inside the call (a step that started before it is counted whole)."""
    return [r for r in records if call["start"] <= r["t"] <= call["t"]]


def summarize(call: dict, records: list[dict]) -> dict:
    steps: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for r in inside(call, records):
        what = r["what"]
        if what == "tok.send":
            what += ".prefix" if r.get("new") == 0 else ".sample"
        steps[what][0] += 1
        steps[what][1] += r["ms"]
    return {
        "new_tokens": call["new_tokens"],
        "group": call["group"],
        "mode": call["mode"],
        "wall_ms": round(call["ms"], 1),
        "steps": {k: {"n": n, "ms": round(ms, 1)} for k, (n, ms) in sorted(steps.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timing")
    parser.add_argument("--trim")
    args = parser.parse_args()
    calls, records = load(args.timing)
    for call in calls:
        print(json.dumps(summarize(call, records)))
    if args.trim:
        keep = [
            r for c in calls for r in inside(c, records) if not (r["what"] == "sched.next_batch" and r["ms"] < IDLE_MS)
        ]
        with open(args.trim, "w") as f:
            for r in sorted(calls + keep, key=lambda r: r["t"]):
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
