"""Qwen3-VL's special tokens: the ids every part needs, read from the processor, and those a policy must not generate.

tokens = special_tokens(load_processor("offline", 3136, 12544))
banned = vision_token_ids(tokens)        # <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>
"""

from __future__ import annotations

from typing import Any

from miles_vl.models import SpecialTokens


def special_tokens(processor: Any) -> SpecialTokens:
    """The token ids that packing, the engines and the tiny model config need, read from the processor.

    Args:
        processor: a Qwen-VL-style processor (`image_token`, `video_token`, a tokenizer with
            `<|vision_start|>`/`<|vision_end|>`), e.g. from `load_processor`.

    Returns:
        `SpecialTokens`: image/video/vision_start/vision_end ids, the pad id, the EOS ids (the
        tokenizer's EOS first, then `<|im_end|>` and `<|endoftext|>` where present, as in Qwen3-VL's generation
        config) and the tokenizer's size (a checkpoint's embedding may be larger).

    Raises:
        ValueError: a required token is not in the vocabulary, or the tokenizer has no pad token.
    """
    tok = processor.tokenizer
    vocab = tok.get_vocab()

    def token_id(token: str) -> int:
        if token not in vocab:
            raise ValueError(
                f"the tokenizer of {type(processor).__name__} has no {token!r}; a Qwen3-VL processor is needed"
            )
        return vocab[token]

    if tok.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; Qwen3-VL's is <|endoftext|>: set it in tokenizer_config.json")
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    eos += [vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab and vocab[t] not in eos]
    return SpecialTokens(
        image_token_id=token_id(getattr(processor, "image_token", "<|image_pad|>")),
        video_token_id=token_id(getattr(processor, "video_token", "<|video_pad|>")),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
        pad_token_id=int(tok.pad_token_id),
        eos_token_ids=tuple(int(i) for i in eos),
        vocab_size=len(tok),
    )


def vision_token_ids(tokens: SpecialTokens) -> tuple[int, ...]:
    """The tokens a policy must not generate: they only make sense with an image behind them."""
    return (tokens.image_token_id, tokens.video_token_id, tokens.vision_start_token_id, tokens.vision_end_token_id)
