"""benchmarks/bench_export.py on the CPU (tiny shapes): one JSON object on the last stdout line, with every tensor of
the tiny model exported (vision tower included), the QKV mappings found among the copies, and the cached tasks
built once over all its syncs; and its GPU set-up (megatron's CUDA RNG tracker seeded) run on the CPU."""

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
    # every tensor in bf16, as the train ranks hold them (megatron's Float16Module): the vision tower too, which the
    # bench built in fp32 until 2026-11-27 (its H200 run exported 5.07 GB where the loop's sync moves 4.26)
    assert result["dtypes"] == {"bfloat16": 70}
    mappings = result["per_mapping"]
    assert mappings["QKVMapping"]["copies"] == mappings["QKVMapping"]["tensors"] > 0
    assert sum(m["tasks"] for k, m in mappings.items() if k.endswith("Mapping")) == result["tasks"]
    # one config copy and one split per QKV task: 2 text weights, 2 vision weights and 2 vision biases
    splits = mappings["split_qkv_weights"]["calls"] + mappings["split_qkv_biases"]["calls"]
    assert splits == mappings["remove_non_pickleables"]["calls"] == 6
    assert all(result[k] > 0 for k in ("tasks_s", "loop_s", "sync_uncached_s", "sync_cached_s"))


def cuda_init_on_the_cpu(folder: str) -> None:
    """bench_export.init_single_rank(device="cuda") on a machine without a GPU: torch.cuda's device and RNG calls on
    the CPU generator, gloo for nccl; then the fork every layer built on the GPU draws its initial weights in
    (megatron's `_initialize_affine_weight_gpu`). Run in a child process: it leaves megatron's global state set."""
    import torch
    import torch.distributed as dist

    from benchmarks import bench_export

    init_process_group = dist.init_process_group
    dist.init_process_group = lambda backend, **kw: init_process_group("gloo", **kw)
    torch.cuda.set_device = lambda device: None
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    bench_export.init_single_rank("cuda", folder)
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        pass


def test_the_cuda_init_seeds_megatrons_model_parallel_rng(tmp_path):
    # 2026-11-27, --device cuda on an H200 stopped before timing anything: "cuda rng state model-parallel-rng is not
    # added", raised by that fork in the first embedding's init (init_single_rank never seeded the tracker)
    code = (
        f"from tests.benchmarks.test_bench_export import cuda_init_on_the_cpu; cuda_init_on_the_cpu({str(tmp_path)!r})"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
