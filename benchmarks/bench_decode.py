"""Decode throughput of the embedded `hf` rollout engine on one GPU, against the memory-bandwidth bound.

    PYTHONPATH=. python benchmarks/bench_decode.py [--batch 32] [--max-new-tokens 256] [--temperature 1.0]
    PYTHONPATH=. python benchmarks/bench_decode.py --profile   # 16 tokens under torch.profiler, per SDPA setting
    PYTHONPATH=. python benchmarks/bench_decode.py --tiny      # CPU smoke run of the same code, seconds

Model: random-init Qwen3-VL with the real Qwen3-VL-2B shapes, bf16 (`bench_train_throughput.qwen3_vl_2b_config`).
Prompts: `--batch` geo3k-like prompts (one image of 150-250 vision tokens, ~350 tokens), one response each. EOS is
disabled so that every sequence decodes `--max-new-tokens` tokens: the engine is given a banned vision token
(<|vision_end|>) as its only EOS id, and every generation is checked to end with finish_reason "length".

Measured (medians of `--repeats` calls of `HFRolloutEngine.generate`):
- engine tokens/s: batch * max_new_tokens / wall time of `generate` (prefill, decode, and the engine's own work
  after `model.generate`: logprobs from the returned scores on the CPU);
- decode tokens/s: batch * (N - 1) / (t(N) - t(1)), with t(n) the time of `model.generate` inside the engine at
  max_new_tokens = n: the decode steps alone, prefill and post-processing cancel out.
Each is measured once per `--sdpa` setting: `default` (PyTorch picks the backend: cuDNN attention on H100, whose
host-side cost per call grows the step time, as the KV length changes every step) and `no_cudnn`
(`torch.backends.cuda.enable_cudnn_sdp(False)`: flash / memory-efficient kernels).
Bound: a decode step must read every weight the text model uses once (all language-model weights; the tied
embedding is read whole as the lm_head, the vision tower not at all), so tokens/s <= batch * bandwidth / weight_bytes,
with bandwidth measured in the same run as a device-to-device copy (bytes read + bytes written over the time). A
tighter bound also counts the KV cache each step reads (batch * mean context * layers * 2 * kv_heads * head_dim *
2 bytes). Last stdout line: one JSON object with the settings and results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch
from bench_train_throughput import TOKENS, build, geo3k_prompts, sync

from miles_vl.rollout import HFRolloutEngine, SamplingParams


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy of `nbytes`, counting the read and the write (median of `repeats`)."""
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)  # random data, never zeros
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    assert torch.equal(dst, src), "the copy is wrong"
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def decode_rates(batch: int, new_tokens: int, *, wall_s: float, generate_s: float, prefill_s: float) -> dict:
    """Rates of `batch` sequences decoding `new_tokens` each: the engine's tokens over its whole call (`wall_s`),
    and the decode steps alone (the generate time minus that of a one-token call, `prefill_s`)."""
    decode_s = generate_s - prefill_s
    return dict(
        ms_per_decode_step=round(1e3 * decode_s / (new_tokens - 1), 2),
        engine_tokens_per_s=round(batch * new_tokens / wall_s, 1),
        decode_tokens_per_s=round(batch * (new_tokens - 1) / decode_s, 1),
    )


def timed_generate(engine: HFRolloutEngine, prompts, params: SamplingParams) -> tuple[float, float, list]:
    """(wall time of engine.generate, time of the model.generate call inside it, generations)."""
    model, inner = engine.model, engine.model.generate
    spent = []

    def wrapped(*a, **kw):
        sync(engine.device)
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        sync(engine.device)
        spent.append(time.perf_counter() - t0)
        return out

    model.generate = wrapped  # instance attribute: shadows the method for this call only
    try:
        sync(engine.device)
        t0 = time.perf_counter()
        gens = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        del model.generate
    return wall, sum(spent), gens


def profile_decode(engine: HFRolloutEngine, prompts, params: SamplingParams, top: int = 20) -> None:
    """Where `generate` spends time: device busy fraction and the top ops by device and by CPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = engine.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        wall, gen, _ = timed_generate(engine, prompts, params)
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6
    print(f"[profile] generate {params.max_new_tokens} tokens: wall {wall:.3f} s, model.generate {gen:.3f} s")
    print(f"[profile] device busy {busy:.3f} s ({busy / wall:.0%} of the wall time)")
    for key in ("self_device_time_total", "self_cpu_time_total") if device.type == "cuda" else ("self_cpu_time_total",):
        print(events.table(sort_by=key, row_limit=top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model and prompts (CPU smoke run)")
    ap.add_argument("--batch", type=int, default=32, help="prompts decoded together (the engine's max_batch_size)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--copy-gib", type=float, default=2.0, help="size of the bandwidth-measuring copy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sdpa",
        default="default,no_cudnn",
        help="SDPA backend settings to measure in turn: default (PyTorch picks; cuDNN on H100) and/or no_cudnn",
    )
    ap.add_argument("--profile", action="store_true", help="only profile one generate of 16 tokens, print tables")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.tiny:
        args.batch, args.max_new_tokens, args.repeats, args.copy_gib = 2, 8, 1, 0.0625
        prompts = geo3k_prompts(args.batch, seed=args.seed, vision_tokens=(4, 9), tail=(5, 20))
    else:
        prompts = geo3k_prompts(args.batch, seed=args.seed)

    model = build(args.tiny, device, dtype, args.seed)
    tokens = replace(TOKENS, eos_token_ids=(TOKENS.vision_end_token_id,))  # banned below: EOS never sampled
    engine = HFRolloutEngine(model, tokens, max_batch_size=args.batch, ban_vision_tokens=True)
    assert TOKENS.vision_end_token_id in engine.banned

    bandwidth = copy_bandwidth(device, int(args.copy_gib * 2**30))
    lm = model.model.language_model
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    if model.lm_head.weight is not lm.embed_tokens.weight:
        weight_bytes += model.lm_head.weight.numel() * model.lm_head.weight.element_size()

    def params(n: int) -> SamplingParams:
        return SamplingParams(n=1, max_new_tokens=n, temperature=args.temperature, seed=args.seed)

    n, b = args.max_new_tokens, args.batch
    cfg = model.config.text_config
    prompt_len = sum(p.prompt_ids.numel() for p in prompts) / b
    kv_bytes = b * (prompt_len + n / 2) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    bound = b * bandwidth / weight_bytes
    bound_kv = b * bandwidth / (weight_bytes + kv_bytes)

    runs = {}
    for sdpa in args.sdpa.split(","):
        if sdpa not in ("default", "no_cudnn"):
            raise ValueError(f"--sdpa: unknown setting {sdpa!r}; use default or no_cudnn")
        torch.backends.cuda.enable_cudnn_sdp(sdpa == "default")
        timed_generate(engine, prompts, params(4))  # warm-up: kernels, cuBLAS handles, allocator
        if args.profile:
            print(f"[profile] sdpa={sdpa}")
            profile_decode(engine, prompts, params(16))
            continue
        short = [timed_generate(engine, prompts, params(1))[1] for _ in range(args.repeats + 1)]
        long = [timed_generate(engine, prompts, params(n)) for _ in range(args.repeats)]
        lengths = {len(g[0].response_ids) for r in long for g in r[2]}
        reasons = {g[0].finish_reason for r in long for g in r[2]}
        if lengths != {n} or reasons != {"length"}:
            raise RuntimeError(f"not every sequence decoded {n} tokens: {lengths}, {reasons}")
        wall = statistics.median(r[0] for r in long)
        gen = statistics.median(r[1] for r in long)
        t1 = statistics.median(short)
        decode = b * (n - 1) / (gen - t1)
        runs[sdpa] = dict(
            engine_wall_s=round(wall, 3),
            generate_s=round(gen, 3),
            prefill_s=round(t1, 3),
            **decode_rates(b, n, wall_s=wall, generate_s=gen, prefill_s=t1),
            fraction_of_bound=round(decode / bound, 4),
            fraction_of_bound_with_kv=round(decode / bound_kv, 4),
        )
        print(f"[sdpa={sdpa}] {json.dumps(runs[sdpa])}", flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    if args.profile:
        return

    first = runs[args.sdpa.split(",")[0]]
    summary = dict(
        benchmark="decode",
        device=name,
        dtype=str(dtype).removeprefix("torch."),
        model="tiny Qwen3-VL" if args.tiny else "Qwen3-VL-2B shapes, random init",
        batch=b,
        max_new_tokens=n,
        temperature=args.temperature,
        mean_prompt_tokens=round(prompt_len, 1),
        repeats=args.repeats,
        copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
        weight_bytes=weight_bytes,
        bound_tokens_per_s=round(bound, 1),
        kv_bytes_per_step=int(kv_bytes),
        bound_with_kv_tokens_per_s=round(bound_kv, 1),
        decode_tokens_per_s=first["decode_tokens_per_s"],
        fraction_of_bound=first["fraction_of_bound"],
        runs=runs,
        peak_mem_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        torch=torch.__version__,
        transformers=__import__("transformers").__version__,
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
