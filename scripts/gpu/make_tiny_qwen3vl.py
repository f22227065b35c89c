"""Write a random-init Qwen3-VL checkpoint that SGLang (and transformers) can load with no network.

    PYTHONPATH=. python scripts/gpu/make_tiny_qwen3vl.py OUT_DIR [--shape tiny|2b|8b] [--seed 0] [--device auto]

What goes into OUT_DIR:
- `config.json` + `model.safetensors` (bf16): the real architecture, `Qwen3VLForConditionalGeneration` of
  transformers, random init (seeded), special-token ids taken from the processor below;
- `generation_config.json`: EOS = the processor's EOS ids (`<|im_end|>`, `<|endoftext|>`), so SGLang stops on the
  same ids as miles_vl's engines;
- the offline processor (miles_vl.models.qwen3_vl.processor: Qwen3-VL's tokenizer class, chat template and image
  processor over a 590-token vocabulary), saved with the pixel range given here, so that `AutoProcessor` and
  SGLang's multimodal processor resize images exactly as miles_vl's prompts were built.

Shapes:
- `tiny`: 2 text layers, hidden 256, 4 heads of 64 (2 KV heads), 2 vision layers of 128 with heads of 64, untied
  lm_head, vocabulary 590 (= the tokenizer). Head size 64 keeps every SGLang attention kernel (FA3 on Hopper) on
  its supported sizes. Weights are drawn with std `--init-std` (default 0.1, larger than HF's 0.02) so that the
  next-token distributions are peaked enough for logprob comparisons to mean something.
- `2b`: Qwen3-VL-2B-Instruct's shapes (`benchmarks.bench_train_throughput.qwen3_vl_2b_config`: hidden 2048, 28
  layers, 16 heads of 128, 8 KV heads, intermediate 6144, tied embeddings; vision depth 24, hidden 1024), with the
  real embedding size 151936 for realistic memory traffic while the tokenizer has 590 tokens. Ids >= 590 have no
  token string (they decode to nothing); that is fine for random weights and decode benchmarks, but prompts must be
  built with the offline processor (ids < 590) because SGLang decodes prompt ids to text and re-tokenizes them.
- `8b`: Qwen3-VL-8B-Instruct's shapes (`benchmarks.bench_train_throughput.qwen3_vl_8b_config`: hidden 4096, 36
  layers, 32 heads of 128, 8 KV heads, intermediate 12288, untied lm_head; vision depth 27, hidden 1152), 8.77B
  parameters, the real embedding size as for `2b`. 17.5 GB in bf16, saved in safetensors shards with an index.
  Built in fp32 (35 GB) then cast: on a GPU in seconds, or with `--device cpu` (no GPU needed, e.g. while the GPUs
  run something else) in minutes (not measured at 8B: torch's normal_ drew 200M values in 5 s on 2 busy cores),
  plus the write.

The model is built on `--device` (auto: CUDA when available; a 2B model on a CPU takes minutes) and saved in bf16.
Unless `--no-check`, the directory is read back with `AutoProcessor` and `AutoConfig` (local files only) and, for
`tiny`, with `Qwen3VLForConditionalGeneration.from_pretrained`, and the weights are compared. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a file: make miles_vl and benchmarks importable from the checkout
    sys.path.insert(0, str(REPO))

from miles_vl.data import load_processor  # noqa: E402
from miles_vl.models import SpecialTokens  # noqa: E402
from miles_vl.models.qwen3_vl.model import tiny_config  # noqa: E402
from miles_vl.models.qwen3_vl.tokens import special_tokens  # noqa: E402

REAL_VOCAB = 151936  # Qwen3-VL's embedding rows
DEFAULT_MIN_PIXELS = 16 * 32 * 32  # 16 merged vision tokens
DEFAULT_MAX_PIXELS = 256 * 32 * 32  # 256 merged vision tokens: geo3k-like images give 150-250

TINY_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vision_depth=2,
    vision_hidden_size=128,
    vision_num_heads=2,
    vision_intermediate_size=256,
    deepstack_visual_indexes=[1],
)


def checkpoint_config(shape: str, tokens: SpecialTokens, init_std: float | None):
    """The `Qwen3VLConfig` of `shape` ("tiny", "2b" or "8b") with the processor's special-token ids.

    Args:
        shape: "tiny", "2b" or "8b" (see the module docstring).
        tokens: the offline processor's ids (`special_tokens(processor)`).
        init_std: `initializer_range` of text and vision weights; None: 0.1 for tiny, HF's 0.02 for 2b and 8b.

    Raises:
        ValueError: an unknown shape.
    """
    if shape == "tiny":
        return tiny_config(tokens, initializer_range=0.1 if init_std is None else init_std, **TINY_SHAPE)
    if shape in ("2b", "8b"):
        from benchmarks.bench_train_throughput import qwen3_vl_2b_config, qwen3_vl_8b_config

        real_shapes = qwen3_vl_2b_config if shape == "2b" else qwen3_vl_8b_config
        cfg = real_shapes(replace(tokens, vocab_size=REAL_VOCAB))
        if init_std is not None:
            cfg.text_config.initializer_range = init_std
            cfg.vision_config.initializer_range = init_std
        return cfg
    raise ValueError(f"--shape must be tiny, 2b or 8b, found {shape!r}")


def write_checkpoint(
    out_dir: str | Path,
    *,
    shape: str = "tiny",
    seed: int = 0,
    device: str = "auto",
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    init_std: float | None = None,
) -> dict:
    """Write the checkpoint (module docstring) and return a summary dict (path, shape, parameters, token ids)."""
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    processor = load_processor("offline", min_pixels, max_pixels)
    tokens = special_tokens(processor)
    cfg = checkpoint_config(shape, tokens, init_std)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen3VLForConditionalGeneration(cfg)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    GenerationConfig(
        eos_token_id=list(tokens.eos_token_ids),
        pad_token_id=tokens.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    ).save_pretrained(str(out))
    n_params = sum(p.numel() for p in model.parameters())
    del model
    return dict(
        path=str(out),
        shape=shape,
        seed=seed,
        parameters=n_params,
        vocab_size=cfg.text_config.vocab_size,
        tokenizer_size=tokens.vocab_size,
        special_tokens=dict(
            image=tokens.image_token_id,
            video=tokens.video_token_id,
            vision_start=tokens.vision_start_token_id,
            vision_end=tokens.vision_end_token_id,
            pad=tokens.pad_token_id,
            eos=list(tokens.eos_token_ids),
        ),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        write_s=round(time.perf_counter() - t0, 2),
    )


def check_checkpoint(path: str | Path, summary: dict, *, load_weights: bool, seed: int, device: str) -> None:
    """Read the directory back as SGLang would (local files only) and compare with what was written.

    Raises:
        AssertionError: a file that does not load, or loads to something else.
    """
    from transformers import AutoConfig, AutoProcessor, Qwen3VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
    tokens = special_tokens(processor)
    assert tokens.image_token_id == summary["special_tokens"]["image"], tokens
    assert list(tokens.eos_token_ids) == summary["special_tokens"]["eos"], tokens
    size = processor.image_processor.size
    assert (size.shortest_edge, size.longest_edge) == (summary["min_pixels"], summary["max_pixels"]), size
    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    assert cfg.architectures == ["Qwen3VLForConditionalGeneration"], cfg.architectures
    assert cfg.image_token_id == tokens.image_token_id and cfg.text_config.vocab_size == summary["vocab_size"]
    if not load_weights:
        return
    loaded = Qwen3VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.bfloat16, local_files_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dev = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        with torch.device(dev):
            again = Qwen3VLForConditionalGeneration(cfg).to(torch.bfloat16)
    theirs = dict(loaded.named_parameters())
    for name, p in again.named_parameters():
        assert name in theirs, f"{name} missing from the saved checkpoint"
        assert torch.equal(theirs[name].cpu(), p.detach().cpu()), f"{name} differs after the round trip"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--shape", choices=("tiny", "2b", "8b"), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="where the model is built: auto (CUDA if any), cpu, cuda")
    ap.add_argument("--min-pixels", type=int, default=DEFAULT_MIN_PIXELS)
    ap.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS)
    ap.add_argument("--init-std", type=float, default=None, help="weight init std (default: 0.1 tiny, else 0.02)")
    ap.add_argument("--no-check", action="store_true", help="skip reading the checkpoint back")
    args = ap.parse_args()
    summary = write_checkpoint(
        args.out_dir,
        shape=args.shape,
        seed=args.seed,
        device=args.device,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        init_std=args.init_std,
    )
    if not args.no_check:
        t0 = time.perf_counter()
        check_checkpoint(args.out_dir, summary, load_weights=args.shape == "tiny", seed=args.seed, device=args.device)
        summary["check_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
