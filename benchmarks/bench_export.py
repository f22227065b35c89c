"""Where the colocated weight sync's "export" phase goes: megatron-bridge's HF export of a Qwen3-VL megatron model.

    PYTHONPATH=. python benchmarks/bench_export.py                                  # tiny shapes, CPU, seconds
    PYTHONPATH=. python benchmarks/bench_export.py --shape 2b --text-layers 2 --vision-layers 2   # 2B widths, CPU
    PYTHONPATH=. python benchmarks/bench_export.py --device cuda --hf-dir /tmp/ckpt_loop_2b   # the 2B job, one GPU

The sync's "export" phase (`sync/export_s`, PhaseClock in miles_vl/rollout/sglang/weights.py) is the time spent
pulling tensors out of `MegatronTrainBackend.export_weights` (miles_vl/train/megatron/export.py), which calls
megatron-bridge's `get_conversion_tasks(model)` (a walk over the model's parameters, one name lookup in the mapping
registry per parameter, a check that the HF checkpoint has the names) and then `export_hf_weights(model,
conversion_tasks=tasks)` (per task: `mapping.megatron_to_hf`, i.e. TP gather, PP broadcast and the layout
conversion: QKV split, gate/up split; then the move to the CPU with `cpu=True`). Timed here, each over `--repeats`
runs (the median), with every tensor consumed as the sync consumes it:

- `tensors`, `bytes`, `dtypes`: what one sync exports (`dtypes`: tensors per dtype: all bf16, as on the train ranks,
  unless `--fp32`);
- `tasks_s`: `get_conversion_tasks` alone;
- `loop_s`: the export loop over prebuilt tasks;
- `sync_uncached_s`: `export_hf_weights` of export.py without a task cache (what every sync paid before the cache);
- `sync_cached_s`: the same through an `ExportPlan` (export.py), whose tasks are built on the first sync only
  (`plan_builds`: how often they were built over all the runs; 1 unless the model's parameter objects changed);
- `per_mapping`: per mapping class (ordered by time): tasks, tensors, bytes, seconds in `megatron_to_hf` (host time:
  on CUDA the kernels run asynchronously), and how many outputs are copies rather than views of the parameter
  (`copies`: the QKV splits gather; gate/up splits are views; `cpu=True` adds a move to the CPU after the mapping);
  and, inside the QKV mappings, `remove_non_pickleables` and `split_qkv_weights` / `split_qkv_biases` timed apart.

The model: `--hf-dir` (a Qwen3-VL HF checkpoint, e.g. the GPU loop's /tmp/ckpt_loop_2b written by
scripts/gpu/make_tiny_qwen3vl.py --shape 2b), or one written to a temporary folder: `--shape tiny` (the CPU tests'
tiny config) or `2b` (Qwen3-VL-2B's widths, `benchmarks.bench_train_throughput.qwen3_vl_2b_config`), with
`--text-layers` / `--vision-layers` fewer layers (the export's cost is per tensor, so per-layer cost x 28 + the
rest estimates the full depth). Built through `build_provider` (train/megatron/build.py) as the train ranks build it,
random weights (`load_weights=False`: values do not change the export's work), bf16 unless `--fp32`, TP = PP = 1 on
one rank. On the CPU the TE layers are the CPU tests' stand-ins with TE's parameter names (tests/train/megatron/
jobs.py), so the tasks and mappings are the production ones. `--cpu-out` exports with `cpu=True` (the Ray path);
the default is `cpu=False`, as the colocated IPC sync exports. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--hf-dir", default=None, help="an existing Qwen3-VL checkpoint (default: write one of --shape)")
    ap.add_argument("--shape", choices=("tiny", "2b"), default="tiny")
    ap.add_argument("--text-layers", type=int, default=None, help="fewer text layers than the shape has")
    ap.add_argument("--vision-layers", type=int, default=None, help="fewer vision layers than the shape has")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fp32", action="store_true", help="fp32 parameters (default bf16, as the train ranks)")
    ap.add_argument("--cpu-out", action="store_true", help="export with cpu=True (default cpu=False)")
    ap.add_argument("--skip-vision", action="store_true", help="leave the vision tower out (train.freeze_vision)")
    return ap.parse_args(argv)


def write_checkpoint(
    directory: str, shape: str, text_layers: int | None, vision_layers: int | None, device: str
) -> None:
    """A random bf16 Qwen3-VL checkpoint of `shape` with the layer counts given (config + safetensors only), drawn on
    `device` (the full 2B in fp32 takes minutes on a few CPU cores, seconds on a GPU)."""
    from transformers import Qwen3VLForConditionalGeneration

    from miles_vl.models.qwen3_vl.model import tiny_config
    from tests.train.megatron.jobs import tokens

    if shape == "tiny":
        cfg = tiny_config(tokens(), deepstack_visual_indexes=[0, 1])
    else:
        from benchmarks.bench_train_throughput import qwen3_vl_2b_config

        cfg = qwen3_vl_2b_config()
    if text_layers is not None:
        cfg.text_config.num_hidden_layers = text_layers
    if vision_layers is not None:
        cfg.vision_config.depth = vision_layers
        cfg.vision_config.deepstack_visual_indexes = [
            i for i in cfg.vision_config.deepstack_visual_indexes if i < vision_layers
        ] or [0]
    cfg.architectures = ["Qwen3VLForConditionalGeneration"]
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration(cfg)
    model.to(torch.bfloat16).save_pretrained(directory)


def init_single_rank(device: str, folder: str, seed: int = 0) -> None:
    """One-rank process group and megatron's parallel state (TP = PP = CP = 1); on CUDA also megatron's model-parallel
    CUDA RNG, seeded with `seed`."""
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{folder}/pg", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    if device == "cuda":
        # The layers built on the GPU draw their initial weights inside get_cuda_rng_tracker().fork(), which raises
        # "cuda rng state model-parallel-rng is not added" unless the tracker is seeded (the train ranks seed it in
        # provider.initialize_model_parallel(seed=...), tests/gpu/nccl.py as here). The CPU build
        # (use_cpu_initialization) draws with torch's CPU generator and never forks it.
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)


def build_model(hf_dir: str, device: str, bf16: bool):
    """(bridge, model chunks) as the train rank builds them (build_provider), random weights."""
    from miles_vl.train.megatron.build import build_provider

    if device == "cpu":  # CPU stand-ins for TE's layers, with TE's parameter names (as the CPU tests build them)
        import megatron.bridge.models.qwen_vl.qwen3_vl_provider as provider_module

        from tests.patches.harness.shims import MODEL_MODULE
        from tests.train.megatron.jobs import cpu_te_named_gpt_spec, cpu_te_named_vit_spec

        provider_module.get_gpt_layer_with_transformer_engine_spec = lambda **kw: cpu_te_named_gpt_spec()
        sys.modules[MODEL_MODULE].get_vit_layer_with_transformer_engine_spec = cpu_te_named_vit_spec
    bridge, provider = build_provider(hf_dir, bf16=bf16, load_weights=False)
    model = provider.provide_distributed_model(
        wrap_with_ddp=False,
        use_cpu_initialization=device == "cpu",
        bf16=bf16,
        fp16=False,
    )  # megatron's Float16Module, as on the train ranks: the vision tower in bf16 too (without it, fp32: 2026-11-27)
    return bridge, model


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of `fn()` over `repeats` runs (CUDA synchronized around each)."""
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def consume(weights, dtypes: dict[str, int] | None = None) -> tuple[int, int]:
    """(tensors, bytes) of an export stream, every tensor pulled as the sync pulls it; `dtypes` counts them by dtype."""
    n = nbytes = 0
    for _, t in weights:
        n += 1
        nbytes += t.numel() * t.element_size()
        if dtypes is not None:
            name = str(t.dtype).removeprefix("torch.")
            dtypes[name] = dtypes.get(name, 0) + 1
    return n, nbytes


def per_mapping(bridge, model, tasks) -> dict:
    """One export with every mapping class's `megatron_to_hf` timed (host time; the outermost call only: mappings
    delegate to each other) and its outputs checked for copies; inside the QKV mappings, `remove_non_pickleables` (a
    copy of the transformer config made on every call, even with PP = 1) and `split_qkv_weights` / `split_qkv_biases`
    (index tensors built on the CPU, then three gathers) timed apart."""
    import megatron.bridge.models.conversion.param_mapping as param_mapping

    stats: dict[str, dict] = defaultdict(lambda: dict(tasks=0, tensors=0, bytes=0, seconds=0.0, copies=0))
    depth = [0]
    originals = {}
    for task in tasks:
        for cls in type(task.mapping).__mro__:
            if "megatron_to_hf" not in cls.__dict__ or cls in originals:
                continue
            originals[cls] = cls.__dict__["megatron_to_hf"]

            def wrapped(self, weights, module, _orig=originals[cls]):
                depth[0] += 1
                t0 = time.perf_counter()
                try:
                    out = _orig(self, weights, module)
                finally:
                    depth[0] -= 1
                if depth[0] == 0:
                    s = stats[type(self).__name__]
                    s["seconds"] += time.perf_counter() - t0
                    s["tasks"] += 1
                    for t in out.values():
                        s["tensors"] += 1
                        s["bytes"] += t.numel() * t.element_size()
                        base = weights.untyped_storage().data_ptr() if weights is not None else None
                        s["copies"] += t.untyped_storage().data_ptr() != base
                return out

            cls.megatron_to_hf = wrapped
    helpers = ("remove_non_pickleables", "split_qkv_weights", "split_qkv_biases")
    helper_stats = {name: dict(calls=0, seconds=0.0) for name in helpers}
    helper_originals = {name: getattr(param_mapping, name) for name in helpers}

    def timed_helper(name):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = helper_originals[name](*args, **kwargs)
            helper_stats[name]["seconds"] += time.perf_counter() - t0
            helper_stats[name]["calls"] += 1
            return out

        return call

    for name in helpers:  # module globals: the QKV mappings look them up at call time
        setattr(param_mapping, name, timed_helper(name))
    try:
        consume(bridge.export_hf_weights(model, cpu=False, show_progress=False, conversion_tasks=tasks))
    finally:
        for cls, fn in originals.items():
            cls.megatron_to_hf = fn
        for name, fn in helper_originals.items():
            setattr(param_mapping, name, fn)
    out = {k: v | {"seconds": round(v["seconds"], 5)} for k, v in stats.items()}
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]["seconds"]))
    return out | {name: v | {"seconds": round(v["seconds"], 5)} for name, v in helper_stats.items()}


def run(args: argparse.Namespace, folder: str) -> dict:
    if args.device == "cpu":
        from tests.patches.harness.shims import load_qwen3vl_module

        load_qwen3vl_module("0.6.2")  # the TE stub and CPU shims, before anything imports megatron
    import miles_vl.train.megatron.backend  # noqa: F401  (installs miles_vl.patches, as on the train ranks)
    from miles_vl.train.megatron.build import FROZEN_VISION_PREFIXES
    from miles_vl.train.megatron.export import ExportPlan, export_hf_weights

    hf_dir = args.hf_dir
    if hf_dir is None:
        hf_dir = os.path.join(folder, "ckpt")
        write_checkpoint(hf_dir, args.shape, args.text_layers, args.vision_layers, args.device)
    init_single_rank(args.device, folder)
    bridge, model = build_model(hf_dir, args.device, bf16=not args.fp32)
    skip = FROZEN_VISION_PREFIXES if args.skip_vision else ()
    cpu, r, dev = args.cpu_out, args.repeats, args.device

    def tasks_now():
        return [
            t
            for t in bridge.get_conversion_tasks(model)
            if t is not None and not t.global_param_name.startswith(skip or ("\0",))
        ]

    tasks = tasks_now()
    consume(export_hf_weights(bridge, model, skip_prefixes=skip, cpu=cpu))  # warm-up (first-call imports, caches)
    plan = ExportPlan(bridge, skip_prefixes=skip)
    dtypes: dict[str, int] = {}
    n, nbytes = consume(plan.weights(model, cpu=cpu), dtypes)  # builds the plan's tasks: later syncs reuse them
    result = dict(
        device=dev if dev == "cpu" else torch.cuda.get_device_name(0),
        hf_dir=args.hf_dir,
        shape=None if args.hf_dir else args.shape,  # --shape only shapes the checkpoint written here
        text_layers=args.text_layers,
        vision_layers=args.vision_layers,
        dtype="fp32" if args.fp32 else "bf16",
        cpu_out=cpu,
        skip_vision=args.skip_vision,
        repeats=r,
        tensors=n,
        bytes=nbytes,
        dtypes=dtypes,
        tasks=len(tasks),
        tasks_s=timed(tasks_now, r, dev),
        loop_s=timed(
            lambda: consume(bridge.export_hf_weights(model, cpu=cpu, show_progress=False, conversion_tasks=tasks)),
            r,
            dev,
        ),
        sync_uncached_s=timed(lambda: consume(export_hf_weights(bridge, model, skip_prefixes=skip, cpu=cpu)), r, dev),
        sync_cached_s=timed(lambda: consume(plan.weights(model, cpu=cpu)), r, dev),
    )
    result["plan_builds"] = plan.builds  # 1: the cached tasks held over every sync above
    result["loop_us_per_tensor"] = round(1e6 * result["loop_s"] / max(n, 1), 1)
    result["tasks_us_per_task"] = round(1e6 * result["tasks_s"] / max(len(tasks), 1), 1)
    result["per_mapping"] = per_mapping(bridge, model, tasks)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_export_") as folder:
        result = run(args, folder)
    for key in ("tasks_s", "loop_s", "sync_uncached_s", "sync_cached_s"):
        result[key] = round(result[key], 5)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
