"""benchmarks/bench_export.py on the CPU (tiny shapes): one JSON object on the last stdout line, with every tensor of
the tiny model exported (vision tower included), the QKV mappings found among the copies, and the cached tasks
built once over all its syncs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_export_tiny_cpu_prints_one_json_line():
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_export.py", "--repeats", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # the tiny checkpoint: 70 HF tensors from 64 megatron tasks (QKV -> q, k, v; gate/up -> gate, up)
    assert (result["tensors"], result["tasks"], result["plan_builds"]) == (70, 64, 1)
    mappings = result["per_mapping"]
    assert mappings["QKVMapping"]["copies"] == mappings["QKVMapping"]["tensors"] > 0
    assert sum(m["tasks"] for k, m in mappings.items() if k.endswith("Mapping")) == result["tasks"]
    # one config copy and one split per QKV task: 2 text weights, 2 vision weights and 2 vision biases
    splits = mappings["split_qkv_weights"]["calls"] + mappings["split_qkv_biases"]["calls"]
    assert splits == mappings["remove_non_pickleables"]["calls"] == 6
    assert all(result[k] > 0 for k in ("tasks_s", "loop_s", "sync_uncached_s", "sync_cached_s"))
