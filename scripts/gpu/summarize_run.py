"""Summarize a run of the production loop (scripts/gpu/loop_run.sh): the figures docs/gpu.md quotes, from the run's own
metrics.jsonl and config.yaml, so that every figure can be checked against the committed run.

    PYTHONPATH=. python scripts/gpu/summarize_run.py RUN_DIR [--ckpt CKPT] [--peak-tflops 989.4] [--gpu-memory CSV]
        [--gpu-ballast CSV]

Last stdout line: one JSON object with
- `steps`, `first_step`, `last_step`; `reward_first` / `reward_last` (mean of the first and last 5 steps'
  `reward/mean`) and `reward_slope` (least squares, per step);
- `logprob_abs_diff_step1`: `train/train_rollout_logprob_abs_diff` of the first step (trainer vs engine, same weights);
- per phase (rollout = generation, reward, train, sync, step): the median seconds over the steps after the first
  (the first compiles kernels and allocates), profiled steps left out (`time/profile_s` in their row: the profiler
  slows the train phase and its reading adds to the step); every figure below that is a median takes the same steps;
  `profiled_steps` lists the steps left out;
- `sync_bytes`, `sync_tensors`, `sync_buckets` (what each sync moved) and `sync_gb_per_s`; for a group sync (NCCL or
  colocated IPC) `sync_phases_s`: the median seconds of each of its phases (`sync/<phase>_s`: export, pack, send,
  wait, check, label; miles_vl/rollout/weight_sync.py `PhaseClock`), where a sync's time goes;
- `train_peak_mem_gib` (the fullest train rank's peak allocated memory in the train phase: the trainer reports the
  maximum over ranks), `train_resident_gib` (what the fullest train rank keeps allocated after its train phase, into
  the rollout; null for runs from before it was logged) and `gpu_used_gib_rollout` (everything on train rank 0's GPU
  while the engine and trainer are both resident): maxima over the steps;
- `train_micro_batches`: the median packed forward-backward passes of one train rank a step (`train/micro_batches`,
  over every optimizer update; null for runs from before it was logged): the train phase's fixed cost is per pass;
- `sample_len_max` (the longest prompt + response any step generated, `rollout/sample_len_max`) and
  `train_tokens_per_s_per_gpu` (the median `perf/train_tokens_per_s` over `train_gpus`): the long-context figures;
- with `--gpu-memory` (the `nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total --format=csv,noheader,
  nounits -l 2` samples loop_run.sh takes of the job's GPUs): `gpu_mem_used_gib_max`, the largest memory in use on
  each GPU (by every process on it) over the run, keyed by the GPU's index, and `gpu_mem_total_gib`;
- with `--gpu-ballast` (loop_run.sh's GPU_MEMORY_GIB: scripts/gpu/cap_memory.py's `index, ballast MiB` lines): the
  ballast held on each GPU, `gpu_ballast_gib`, left out of `gpu_mem_used_gib_max` and of `gpu_used_gib_rollout` (train
  rank 0's GPU: the first line's), and `gpu_mem_total_gib` is what the ballast left the run (the card it stands for);
- `train_gpus` (`train.num_gpus`) and `job_gpus` (those plus the engines' own GPUs when `ray.placement=disaggregate`;
  colocated engines share the train GPUs);
- `step_tokens_per_s_per_gpu`: the job's end-to-end throughput, the median over the steps after the first of
  `train/tokens` / `time/step_s` / `job_gpus` (what a synchronous and an asynchronous run compare on: issue 34);
- disaggregated runs only, `idle_fraction`: of each step, the share the trainer's GPUs spend outside the train phase
  (1 - train_s / step_s) and the engines' outside generation (1 - rollout_s / step_s), medians over the steps after
  the first. Colocated, the two share their GPUs and take turns: no such figure.
- `train_tflops_per_gpu`, `train_mfu`: useful FLOPs of the train phase over its median time, per train GPU, and over
  the dense bf16 peak of one GPU: flops / train_s / (train_gpus * peak). `step_mfu`: the same FLOPs over the median
  step time and every GPU of the job, flops / step_s / (job_gpus * peak): what the whole job gets out of its GPUs.
  FLOPs per step = (2 * forward passes + 6 * forward-backward passes) * (N_text * T + N_vis * P)
  + the attention terms of bench_train_throughput.py with every sample at the step's mean length, where T is the
  trained tokens (`train/tokens`), P the image patches (4 per visual token), N_text / N_vis the text (lm_head once)
  and vision matmul parameters of the checkpoint's architecture (counted on the meta device). The vision attention
  is counted per block, an image or a video frame group (`rollout/vision_blocks_per_sample`; the tower does not attend
  across them), each block at the mean size: 2 * depth * hidden * P^2 / blocks per sample. Runs recorded before
  that metric: `--vision-blocks` (default 1, one image a sample). Forward passes: 1 (old logprobs; 2 with a KL
  reference), forward-backward passes: `train.ppo_epochs`. Without --ckpt: no MFU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from miles_vl.metrics import read_metrics  # noqa: E402


def matmul_params(ckpt: str) -> tuple[int, int, dict]:
    """(text matmul params with lm_head counted once, vision matmul params, text config numbers) of a checkpoint's
    architecture, counted on the meta device (no weights are read)."""
    import torch
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    cfg = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(cfg)
    visual = model.model.visual
    n_vis = sum(p.numel() for p in visual.parameters()) - visual.pos_embed.weight.numel()
    n_text = sum(p.numel() for p in model.model.language_model.parameters())
    if model.lm_head.weight is not model.model.language_model.embed_tokens.weight:
        n_text += model.lm_head.weight.numel()
    t = cfg.text_config
    return n_text, n_vis, dict(layers=t.num_hidden_layers, attn_dim=t.num_attention_heads * t.head_dim,
                               vis_depth=cfg.vision_config.depth, vis_hidden=cfg.vision_config.hidden_size)  # fmt: skip


def step_flops(row: dict, cfg: dict, n_text: int, n_vis: int, arch: dict, vision_blocks: float = 1.0) -> float:
    """Useful FLOPs of one step's train phase (module docstring); `vision_blocks`: the blocks per sample of a run
    whose rows lack `rollout/vision_blocks_per_sample`."""
    samples = row["rollout/prompts"] * cfg["rollout"]["n_samples_per_prompt"]
    tokens = row["train/tokens"]
    patches_per_sample = 4 * row.get("rollout/visual_tokens_per_sample", 0.0)
    blocks = max(row.get("rollout/vision_blocks_per_sample", vision_blocks), 1.0)
    mean_len = tokens / samples
    per_pass = (
        n_text * tokens
        + n_vis * patches_per_sample * samples
        + arch["layers"] * arch["attn_dim"] * mean_len**2 * samples  # causal: 2 L^2 d of 4 L^2 d per forward
        + 2 * arch["vis_depth"] * arch["vis_hidden"] * patches_per_sample**2 / blocks * samples  # blocks x (P/blocks)^2
    )
    forwards = 1 + (1 if cfg["algo"]["kl_coef"] > 0 else 0)
    return (2 * forwards + 6 * cfg["train"]["ppo_epochs"]) * per_pass


def gpu_counts(cfg: dict) -> tuple[int, int]:
    """(train GPUs, GPUs of the whole job) of a run's resolved config.yaml; a CPU run (num_gpus 0) counts as 1."""
    train_gpus = max(cfg["train"]["num_gpus"], 1)
    engine_gpus = cfg["rollout"]["num_engines"] * cfg["rollout"]["gpus_per_engine"]
    return train_gpus, train_gpus + (engine_gpus if cfg["ray"]["placement"] == "disaggregate" else 0)


def summarize(run_dir: Path, ckpt: str | None, peak_tflops: float, vision_blocks: float = 1.0) -> dict:
    rows = read_metrics(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    # the steps after the first (it compiles and allocates), less those run under the profiler (train.profile_steps:
    # their train phase is slower and their step carries the profile's reading, `time/profile_s`)
    later = [r for r in rows[1:] if "time/profile_s" not in r] or rows[1:] or rows

    def med(key: str) -> float | None:
        values = [r[key] for r in later if key in r]
        return round(statistics.median(values), 3) if values else None

    def largest(key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return round(max(values), 2) if values else None

    train_gpus, job_gpus = gpu_counts(cfg)
    rewards = [r["reward/mean"] for r in rows]
    n = len(rewards)
    mean_step = (n - 1) / 2
    slope = sum((i - mean_step) * (x - statistics.fmean(rewards)) for i, x in enumerate(rewards)) / max(
        sum((i - mean_step) ** 2 for i in range(n)), 1e-9
    )
    out = dict(
        run=run_dir.name,
        steps=n,
        first_step=rows[0]["step"],
        last_step=rows[-1]["step"],
        reward_first=round(statistics.fmean(rewards[:5]), 4),
        reward_last=round(statistics.fmean(rewards[-5:]), 4),
        reward_slope=round(slope, 5),
        logprob_abs_diff_step1=rows[0].get("train/train_rollout_logprob_abs_diff"),
        **{f"{phase}_s": med(f"time/{phase}_s") for phase in ("rollout", "reward", "train", "sync", "step")},
        sync_bytes=rows[-1].get("sync/bytes"),
        sync_tensors=rows[-1].get("sync/tensors"),
        sync_buckets=rows[-1].get("sync/buckets"),
        train_peak_mem_gib=largest("perf/train_peak_mem_gib"),
        train_resident_gib=largest("perf/train_resident_gib"),
        gpu_used_gib_rollout=largest("perf/gpu_used_gib_rollout"),
        train_gpus=train_gpus,
        job_gpus=job_gpus,
        response_len_mean=med("rollout/response_len_mean"),
        rollout_tokens_per_s=med("perf/rollout_tokens_per_s"),
        train_tokens_per_s=med("perf/train_tokens_per_s"),
        sample_len_max=largest("rollout/sample_len_max"),
        train_micro_batches=med("train/micro_batches"),
    )  # fmt: skip
    if profiled := [r["step"] for r in rows if "time/profile_s" in r]:
        out["profiled_steps"] = profiled
    if out["train_tokens_per_s"] is not None:
        out["train_tokens_per_s_per_gpu"] = round(out["train_tokens_per_s"] / train_gpus, 1)
    if per_step := [
        r["train/tokens"] / r["time/step_s"] for r in later if r.get("train/tokens") and r.get("time/step_s")
    ]:
        out["step_tokens_per_s_per_gpu"] = round(statistics.median(per_step) / job_gpus, 1)
    if job_gpus > train_gpus:  # disaggregated: the trainer's GPUs and the engines' are not the same
        shares = {"trainer": "time/train_s", "engine": "time/rollout_s"}
        idle = {
            side: [1 - r[key] / r["time/step_s"] for r in later if key in r and r.get("time/step_s")]
            for side, key in shares.items()
        }
        out["idle_fraction"] = {side: round(statistics.median(v), 3) for side, v in idle.items() if v}
    phases = sorted({k for r in later for k in r if k.startswith("sync/") and k.endswith("_s")})
    if phases:
        out["sync_phases_s"] = {k.removeprefix("sync/").removesuffix("_s"): med(k) for k in phases}
    if out["sync_bytes"] and out["sync_s"]:
        out["sync_gb_per_s"] = round(out["sync_bytes"] / 1e9 / out["sync_s"], 2)
    if ckpt:
        n_text, n_vis, arch = matmul_params(ckpt)
        flops = statistics.median(step_flops(r, cfg, n_text, n_vis, arch, vision_blocks) for r in later)
        out["train_flops_per_step"] = flops
        out["train_tflops_per_gpu"] = round(flops / out["train_s"] / train_gpus / 1e12, 1)
        out["train_mfu"] = round(flops / out["train_s"] / (train_gpus * peak_tflops * 1e12), 4)
        if out["step_s"]:
            out["step_mfu"] = round(flops / out["step_s"] / (job_gpus * peak_tflops * 1e12), 4)
        out["matmul_params"] = dict(text=n_text, vision=n_vis)
    return out


def gpu_memory(csv_path: Path) -> dict:
    """`gpu_mem_used_gib_max` {GPU index: GiB} and `gpu_mem_total_gib` of nvidia-smi's samples (module docstring).

    Raises:
        ValueError: a line that is not `timestamp, index, used MiB, total MiB` (named with its line number).
    """
    used: dict[str, float] = {}
    total = 0.0
    for n, line in enumerate(csv_path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        try:
            _, index, mib, total_mib = fields
            gib, total = float(mib) / 1024, float(total_mib) / 1024
        except ValueError:
            raise ValueError(
                f"{csv_path}:{n}: expected 'timestamp, index, memory.used, memory.total' (MiB, nvidia-smi's "
                f"--format=csv,noheader,nounits), found {line!r}"
            ) from None
        used[index] = max(used.get(index, 0.0), gib)
    by_index = dict(sorted(used.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else kv[0]))
    return {"gpu_mem_used_gib_max": {k: round(v, 2) for k, v in by_index.items()}, "gpu_mem_total_gib": round(total, 2)}


def leave_out_ballast(out: dict, csv_path: Path) -> dict:
    """`out` (the summary, with gpu_memory's figures) with the ballast of cap_memory.py's `csv_path` left out of its
    memory figures (module docstring).

    Raises:
        ValueError: a line that is not `index, MiB`, or a ballast on a GPU the samples do not have.
    """
    ballast: dict[str, float] = {}
    for n, line in enumerate(csv_path.read_text().splitlines(), start=1):
        try:
            index, mib = (f.strip() for f in line.split(","))
            ballast[index] = float(mib) / 1024
        except ValueError:
            raise ValueError(f"{csv_path}:{n}: expected 'index, ballast MiB' (cap_memory.py), found {line!r}") from None
    out = dict(out)
    used = out.get("gpu_mem_used_gib_max", {})
    if used:
        if missing := sorted(set(ballast) - set(used)):
            raise ValueError(f"{csv_path}: ballast on GPU {missing} but no memory samples of it (--gpu-memory)")
        out["gpu_mem_used_gib_max"] = {k: round(v - ballast.get(k, 0.0), 2) for k, v in used.items()}
        out["gpu_mem_total_gib"] = round(out["gpu_mem_total_gib"] - max(ballast.values(), default=0.0), 2)
    if out.get("gpu_used_gib_rollout") is not None and ballast:
        out["gpu_used_gib_rollout"] = round(out["gpu_used_gib_rollout"] - next(iter(ballast.values())), 2)
    out["gpu_ballast_gib"] = {k: round(v, 2) for k, v in ballast.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--ckpt", default=None, help="the checkpoint the run started from (for the MFU)")
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak (H100 SXM / H200)")
    ap.add_argument("--gpu-memory", type=Path, default=None, help="nvidia-smi samples of the job's GPUs (CSV)")
    ap.add_argument("--gpu-ballast", type=Path, default=None, help="cap_memory.py's ballast per GPU (CSV)")
    ap.add_argument("--vision-blocks", type=float, default=1.0,
                    help="images + video frame groups per sample, for runs recorded before "
                    "rollout/vision_blocks_per_sample (the metric wins where a row has it)")  # fmt: skip
    args = ap.parse_args()
    if args.vision_blocks < 1:
        ap.error(f"--vision-blocks must be at least 1 (the blocks of one sample), found {args.vision_blocks}")
    out = summarize(args.run_dir, args.ckpt, args.peak_tflops, args.vision_blocks)
    if args.gpu_memory is not None:
        out.update(gpu_memory(args.gpu_memory))
    if args.gpu_ballast is not None:
        out = leave_out_ballast(out, args.gpu_ballast)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
