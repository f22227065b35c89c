"""GPU check of `miles-vl export` on a Megatron run's on-disk checkpoint: the exported directory, loaded by
transformers alone, scores samples as the Megatron model loaded from that checkpoint does.

    bash scripts/gpu/stack.sh bash -c 'bash scripts/gpu/loop_run.sh tiny NAME 20 checkpoint.save_hf.final=true &&
        python scripts/gpu/check_export.py /tmp/gpu_runs/NAME > $OUT/export_check.json'

1. `python -m miles_vl.cli export RUN_DIR OUT --force`: the user's command (Ray, the run's trainer on its GPU, the
   newest checkpoint that verifies, megatron-bridge's HF export);
2. reference: the run's Megatron backend (`factories.build_megatron`, one rank, Transformer Engine, bf16) with that
   checkpoint loaded, its logprobs of N_SAMPLES samples built as the run builds prompts (`PromptEncoder` over the
   run's processor, generated geo3k-style problems), each with a fixed response;
3. transformers' Qwen3-VL from OUT (bf16, scored by the torch backend): mean |diff| to 2 within bf16 noise (TOL);
4. control: transformers from `model.path`, the weights the run started from: at least CONTROL_RATIO times further off,
   so the check sees the trained weights and not the start;
5. when the run wrote `checkpoint.save_hf` directories (<run>/hf/step_N), the one of the exported step holds the same
   tensors as OUT, bit for bit (the live weights at the end of that step against the checkpoint's).
Prints one JSON object; exits 1 when a bound fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

N_SAMPLES = 8
TOL = 0.05  # mean |logprob diff| for the same weights in bf16: Megatron + TE against transformers' eager Qwen3-VL
CONTROL_RATIO = 5.0
RESPONSE = "The angle is 30 degrees, so the answer is \\boxed{30}."


def samples_for(cfg, processor, tokens):
    """N_SAMPLES TrainSamples as the run builds its prompts, each answered with RESPONSE (CPU tensors)."""
    from miles_vl.data import PromptEncoder, generate_problems
    from miles_vl.train import TrainSample

    encoder = PromptEncoder(processor, instruction=cfg.data.instruction)
    response = torch.tensor(
        processor.tokenizer(RESPONSE, add_special_tokens=False)["input_ids"] + [tokens.eos_token_ids[0]]
    )
    out = []
    for problem in generate_problems(N_SAMPLES, seed=7):
        enc = processor(text=[encoder.render(problem.problem)], images=[problem.image], return_tensors="pt")
        prompt = enc["input_ids"][0].long()
        out.append(
            TrainSample(
                input_ids=torch.cat([prompt, response]),
                prompt_len=prompt.numel(),
                advantage=0.0,
                rollout_logprobs=torch.zeros(response.numel()),
                image_grid_thw=enc["image_grid_thw"].long(),
                pixel_values=enc["pixel_values"],
            )
        )
    return out


def megatron_logprobs(cfg, tokens, checkpoint: Path, samples) -> list[torch.Tensor]:
    """The run's Megatron backend on this process's GPU (a process group of one), `checkpoint` loaded."""
    from miles_vl.orchestration.factories import build_megatron

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    backend = build_megatron(cfg, tokens)
    backend.load_checkpoint(checkpoint)
    out = [lp.float().cpu() for lp in backend.compute_logprobs(samples)]
    del backend
    torch.distributed.destroy_process_group()
    torch.cuda.empty_cache()
    return out


def hf_logprobs(path: str | Path, tokens, options, samples) -> list[torch.Tensor]:
    """transformers' Qwen3-VL from `path` (bf16 on the GPU), scored by the torch backend."""
    from transformers import AutoModelForImageTextToText

    from miles_vl.train import TorchTrainBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.bfloat16).to(device)
    out = [lp.float().cpu() for lp in TorchTrainBackend(model, tokens, options).compute_logprobs(samples)]
    del model
    torch.cuda.empty_cache()
    return out


def mean_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float((torch.cat(a) - torch.cat(b)).abs().mean())


def same_tensors(a: Path, b: Path) -> tuple[int, list[str]]:
    """(tensors compared, names that differ or exist in one directory only) of two HF directories' safetensors."""
    from safetensors.torch import load_file

    def load(d: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    x, y = load(a), load(b)
    bad = sorted(set(x) ^ set(y)) + sorted(n for n in set(x) & set(y) if not torch.equal(x[n], y[n]))
    return len(set(x) | set(y)), bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/export_check_hf"))
    args = parser.parse_args()

    from miles_vl.data import load_processor, video_settings
    from miles_vl.models.qwen3_vl.tokens import special_tokens
    from miles_vl.orchestration.export import HF_DIR, find_checkpoint
    from miles_vl.orchestration.factories import train_options

    cfg, checkpoint = find_checkpoint(args.run_dir, None)
    if cfg.train.backend != "megatron":
        raise SystemExit(f"{args.run_dir} trained with train.backend={cfg.train.backend}; this check is for megatron")
    result: dict = {"run_dir": str(args.run_dir), "checkpoint": str(checkpoint), "samples": N_SAMPLES}

    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "miles_vl.cli", "export", str(args.run_dir), str(args.out), "--force"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    result["export_s"] = round(time.perf_counter() - t0, 1)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
        result["error"] = f"miles-vl export exited {done.returncode}"
        print(json.dumps(result))
        return 1
    result["exported_files"] = sorted(p.name for p in args.out.iterdir())

    processor = load_processor(
        cfg.model.processor or cfg.model.path, cfg.data.min_pixels, cfg.data.max_pixels, video_settings(cfg.data)
    )
    tokens = special_tokens(processor)
    samples = samples_for(cfg, processor, tokens)
    with contextlib.redirect_stdout(sys.stderr):  # megatron prints its setup: stdout keeps the one JSON line
        reference = megatron_logprobs(cfg, tokens, checkpoint, samples)
    options = train_options(cfg, tokens)
    exported = hf_logprobs(args.out, tokens, options, samples)
    start = hf_logprobs(cfg.model.path, tokens, options, samples)
    result |= {
        "response_tokens": int(sum(r.numel() for r in reference)),
        "exported_vs_megatron": round(mean_abs_diff(exported, reference), 5),
        "exported_vs_megatron_max": round(float((torch.cat(exported) - torch.cat(reference)).abs().max()), 5),
        "start_vs_megatron": round(mean_abs_diff(start, reference), 5),
    }
    ok = (
        result["exported_vs_megatron"] < TOL
        and result["start_vs_megatron"] > CONTROL_RATIO * result["exported_vs_megatron"]
    )

    during = args.run_dir / HF_DIR / checkpoint.name  # save_hf's directory of the same step (step_dir_name)
    if during.is_dir():
        compared, differ = same_tensors(during, args.out)
        result["save_hf_during_run"] = {"dir": str(during), "tensors": compared, "differ": differ[:10]}
        ok = ok and not differ
    result["ok"] = ok
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
