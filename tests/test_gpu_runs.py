"""Contract: the committed GPU runs (docs/gpu-runs, README.md there) back the docs that quote them and stay small
(issue 31.4: the tree travels with every GPU call, in 64 MiB beside the stack). Every `docs/gpu-runs/...` path the
docs cite exists; each committed timing summary follows from its compressed trace; raw traces, SGLang server logs
and large files are committed xz-compressed."""

import json
import re
from pathlib import Path

import pytest

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "docs" / "gpu-runs"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "docs" / "gpu-runs" / "README.md"]
PLAIN_LIMIT = 64 * 1024  # bytes; metrics.jsonl of a 30-step loop run is about 45 KB
LOG_LIMIT = 16 * 1024


def _summarize_module():
    return load_script("benchmarks/sglang_timing/summarize.py", "timing_summarize")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cited_run_path_exists(doc):
    cited = re.findall(r"`(docs/gpu-runs/[^`\s]*)", doc.read_text())
    missing = [path for path in cited if not list(REPO.glob(path.rstrip("/")))]
    assert not missing, f"{doc.name} cites paths that are not committed: {missing}"


@pytest.mark.parametrize("trace", sorted(RUNS.glob("*/sglang_timing*.jsonl.xz")), ids=lambda p: p.parent.name)
def test_each_timing_summary_follows_from_its_trace(trace):
    """The committed trace is trimmed (`summarize.py --trim`: no idle polls), the summary was made from the whole one:
    they agree on everything but `sched.next_batch`."""
    summarize = _summarize_module()
    summary = trace.with_name(trace.name.replace("sglang_timing", "timing_summary").removesuffix(".xz"))
    calls, records = summarize.load(str(trace))
    ours = [summarize.summarize(call, records) for call in calls]
    theirs = [json.loads(line) for line in summary.read_text().splitlines() if line.strip()]
    for row in ours + theirs:
        row["steps"].pop("sched.next_batch", None)
    assert ours == theirs


def test_raw_traces_server_logs_and_large_files_are_compressed():
    plain = [p for p in RUNS.rglob("*") if p.is_file() and p.suffix not in (".xz", ".gz")]
    raw = [p for p in plain if re.match(r"(tests_)?sglang_.*\.(log|jsonl)$", p.name)]
    large = [p for p in plain if p.stat().st_size > (LOG_LIMIT if p.suffix == ".log" else PLAIN_LIMIT)]
    assert not raw + large, (
        f"compress with `xz -9e` (docs/gpu-runs/README.md): {[str(p.relative_to(REPO)) for p in raw + large]}"
    )
