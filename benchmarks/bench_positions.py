"""Rank-local MRoPE positions + vision index: miles_vl vs megatron-bridge's get_rope_index, and padding waste.

    .venv/bin/python benchmarks/bench_positions.py [--samples 64] [--cp 2] [--repeats 20]

One packed micro-batch of geo3k-like samples (one image each, ~250 tokens, ~16K tokens in all) at cp=2:
- ours: `packed_position_ids` over the full THD row + the zigzag slice and the CP-local vision index of every rank;
- baseline: megatron-bridge's `get_rope_index` (the installed package, the one its Qwen3VLModel calls) on the same
  full row with the same packed-sequence boundaries, followed by the same zigzag slice.
The two position tensors are compared on the real tokens before timing (the bridge leaves pad positions at 1).
Padding: `pack_thd` at this cp vs padding every sample to the longest one. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from miles_vl.packing import MediaTokens, pack_thd, packed_position_ids, zigzag_index

IMAGE, VIDEO, VSTART, VEND, PAD = 151655, 151656, 151652, 151653, 151643
TOKENS = dict(spatial_merge_size=2, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART)


@dataclass
class Sample:
    input_ids: torch.Tensor
    image_grid_thw: torch.Tensor
    video_grid_thw: None
    prompt_len: int


def geo3k_like(n: int, seed: int) -> list[Sample]:
    """n samples: text, one image of 8x8..24x24 merged... patches, more text, a response of 40..160 tokens."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    out = []
    for _ in range(n):
        h, w = 2 * rnd(5, 10), 2 * rnd(5, 10)  # patches; (h/2)*(w/2) = 25..100 vision tokens
        head, tail, resp = rnd(15, 30), rnd(20, 60), rnd(40, 160)
        ids = (
            torch.randint(10, 5000, (head,), generator=g).tolist()
            + [VSTART]
            + [IMAGE] * (h * w // 4)
            + [VEND]
            + torch.randint(10, 5000, (tail,), generator=g).tolist()
        )
        prompt_len = len(ids)
        ids += torch.randint(10, 5000, (resp,), generator=g).tolist()
        out.append(Sample(torch.tensor(ids), torch.tensor([[1, h, w]]), None, prompt_len))
    return out


def ours(input_ids, cu, grids, prompt_lens, cp_size):
    media = MediaTokens(TOKENS["spatial_merge_size"], TOKENS["image_token_id"], TOKENS["video_token_id"])
    positions, vision = packed_position_ids(
        input_ids, cu, grids, None, media, media_ends=prompt_lens, return_media_mask=True
    )
    natural = torch.cumsum(vision.long(), 0) - 1
    per_rank = []
    for r in range(cp_size):
        idx = zigzag_index(cu, cp_size, r)
        per_rank.append((positions[:, idx], natural[idx][vision[idx]]))
    return per_rank


@functools.cache
def bridge_rope_module():
    """megatron-bridge's rope module, imported on CPU through the test harness's import shims (TE stub)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.patches.harness.shims import load_qwen3vl_module

    load_qwen3vl_module("0.6.2")
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import rope

    return rope


def bridge(input_ids, cu, seq_lens, grids, cp_size):
    rope = bridge_rope_module()
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_unpadded = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu_unpadded[1:] = torch.cumsum(torch.tensor(seq_lens), 0)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_unpadded,
        cu_seqlens_kv=cu_unpadded,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
    )
    positions, _ = rope.get_rope_index(
        TOKENS["spatial_merge_size"],
        IMAGE,
        VIDEO,
        VSTART,
        input_ids=input_ids[None],
        image_grid_thw=grids,
        packed_seq_params=params,
    )
    return [positions[:, 0, zigzag_index(cu, cp_size, r)] for r in range(cp_size)]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    samples = geo3k_like(args.samples, args.seed)
    packed = pack_thd(samples, cp_size=args.cp, pad_token_id=PAD, **TOKENS)
    cu, grids = packed.cu_seqlens, packed.image_grid_thw
    prompt_lens, seq_lens = packed.prompt_lens.tolist(), packed.seq_lens.tolist()

    # Same answer on every real token (samples have no media in responses, so the bridge's rule applies).
    mine = ours(packed.input_ids, cu, grids, prompt_lens, args.cp)
    theirs = bridge(packed.input_ids, cu, seq_lens, grids, args.cp)
    for r in range(args.cp):
        real = packed.shard(r).sample_index[0] >= 0
        idx = zigzag_index(cu, args.cp, r)
        in_sample = (idx - cu[:-1].long()[packed.sample_index[idx].clamp(min=0)]) < packed.seq_lens[
            packed.sample_index[idx].clamp(min=0)
        ]
        keep = real & in_sample
        if not torch.equal(mine[r][0][:, keep], theirs[r][:, keep]):
            raise SystemExit(f"rank {r}: positions differ between miles_vl and megatron-bridge on real tokens")

    t_ours = timed(lambda: ours(packed.input_ids, cu, grids, prompt_lens, args.cp), args.repeats)
    t_pack = timed(
        lambda: [pack_thd(samples, cp_size=args.cp, pad_token_id=PAD, **TOKENS).shard(r) for r in range(args.cp)],
        max(args.repeats // 4, 3),
    )
    t_bridge = timed(lambda: bridge(packed.input_ids, cu, seq_lens, grids, args.cp), args.repeats)

    longest = max(seq_lens)
    padded_to_max = longest * len(seq_lens)
    import megatron.bridge

    result = {
        "benchmark": "positions",
        "samples": args.samples,
        "cp_size": args.cp,
        "tokens": packed.num_tokens,
        "ours_positions_and_vision_index_ms": round(t_ours * 1e3, 3),
        "ours_full_pack_thd_and_shards_ms": round(t_pack * 1e3, 3),
        "bridge_get_rope_index_and_slice_ms": round(t_bridge * 1e3, 3),
        "speedup": round(t_bridge / t_ours, 1),
        "speedup_full_pack": round(t_bridge / t_pack, 1),
        "thd_padding_fraction": round(packed.num_padding / packed.num_tokens, 5),
        "pad_to_max_padding_fraction": round(1 - sum(seq_lens) / padded_to_max, 5),
        "megatron_bridge": megatron.bridge.__version__,
        "torch": torch.__version__,
        "threads": 1,
        "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
