"""The offline Qwen3-VL processor: a real `Qwen3VLProcessor` with a small vocabulary, built without any download.

It is what tests and the tiny CPU demo use in place of a checkpoint's processor (`model.processor: offline`):

- tokenizer: transformers' own `Qwen2Tokenizer` (the class Qwen3-VL ships with: NFC, Qwen's pre-tokenizer regex with
  single digits, byte-level BPE) over a small vocabulary: the 256 byte tokens (id = byte value), then the merges
  learned on `CORPUS` by `train_merges` (deterministic: ties go to the smallest pair), then Qwen3-VL's 26 added
  tokens with the same *strings*, order and special flags as Qwen3-VL (`<|endoftext|>` ... `</think>`).
  `eos_token` is `<|im_end|>` and `pad_token` is `<|endoftext|>`, as in Qwen3-VL-Instruct.
- chat template: Qwen3-VL-Instruct's (`offline/chat_template.jinja`, from the Qwen/Qwen3-VL-*-Instruct
  checkpoints, Apache-2.0).
- image processor: transformers' `Qwen2VLImageProcessor` with Qwen3-VL's settings (patch 16, merge 2, temporal
  patch 2, mean = std = 0.5); video processor: `Qwen3VLVideoProcessor` with the same patch settings.

The files in `offline/` are this build, saved with `save_pretrained`, so that `load_processor("offline")`
goes through `AutoProcessor.from_pretrained` exactly like a real checkpoint. Rebuild them (only when the
vocabulary must change; every offline token id and every tiny checkpoint depends on it) with:

    python -m miles_vl.models.qwen3_vl.processor
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

OFFLINE_PROCESSOR_DIR = Path(__file__).with_name("offline")

# Qwen3-VL's added tokens in id order (151643 ...), with their `special` flag as in its tokenizer_config.json.
QWEN3_VL_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

MAX_MERGES = 768  # with the 256 byte tokens: at most 1024 BPE tokens before the added ones

# The text the merges are learned from: geometry problems, the default instruction, chat roles and answers.
# Changing it changes the vocabulary (and every offline token id): rebuild the shipped files after an edit.
CORPUS = r"""
system user assistant You are a helpful assistant.
Think step by step inside <think></think>, then put the final answer in \boxed{}.
Let's think step by step and output the final answer in \boxed{}.
The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \boxed{}.
So the answer is \boxed{x}. Therefore the answer is \boxed{}. The answer is
Find x. Find y. Find z. Find x and y. Find the value of x. Find the value of the variable in the figure.
Find the measure of the angle. Find the measure of \angle 1. Find m \angle A. Find m \angle B. Find m \angle C.
Find the length of the side. Find the length of AB. Find the perimeter of the triangle. Find the area of the
triangle. Find the area of the circle. Find the circumference of the circle. Find the area of the shaded region.
Find the area of the figure. Find the area of the parallelogram. Find the area of the trapezoid. Find the
perimeter of the rectangle. Find the area of the rhombus. Find the radius of the circle. Find the diameter.
Round to the nearest tenth. Round to the nearest tenth if necessary. Round to the nearest hundredth.
Round your answer to the nearest degree. Express your answer in terms of \pi. Assume that segments that appear
to be tangent are tangent. Lines m and n are parallel. Lines a and b are parallel. In the figure, the two lines
are parallel. The triangle is a right triangle. In \triangle ABC, the measure of angle A is given.
In \odot O, the radius is given. The diameter of the circle is given. Two angles of a triangle are given.
The sum of the angles of a triangle is 180 degrees. The angles of a linear pair are supplementary.
Corresponding angles are congruent. Alternate interior angles are congruent. Vertical angles are congruent.
Same-side interior angles are supplementary. By the Pythagorean theorem, c^2 = a^2 + b^2.
The circumference is 2 \pi r and the area is \pi r^2. The hypotenuse is the longest side. The leg is shorter.
\frac{1}{2} \sqrt{3} \sqrt{2} \frac{\sqrt{3}}{2} \sin \cos \tan \theta \pi \angle \triangle \odot \parallel
\cong \sim \perp ^\circ degrees cm in ft m units square units x^2 y^2 = + - * / ( ) [ ] { } , . : ;
triangle triangles angle angles side sides length lengths circle circles radius radii diameter chord tangent
secant arc arcs segment segments line lines point points vertex vertices parallel perpendicular bisector
median altitude hypotenuse legs leg right acute obtuse isosceles equilateral scalene similar congruent
quadrilateral rectangle square rhombus trapezoid parallelogram polygon pentagon hexagon regular interior
exterior inscribed central supplementary complementary adjacent vertical corresponding alternate measure
value variable figure shown below given find solve compute determine what is the of and to in a an for if
with by from that this which each are be as at on or not its it their then so we use since because
First, Next, Then, Finally, Since Because Thus Hence Therefore We know that Using the So
"""


def train_merges(words: Counter[str], max_merges: int) -> list[tuple[str, str]]:
    """Byte-pair merges learned greedily on pre-tokenized words (the classic BPE algorithm).

    Args:
        words: pre-token (in byte-level characters) -> count.
        max_merges: stop after this many merges (or earlier, once no pair occurs twice).

    Returns:
        The merges in rank order. Ties between equally frequent pairs go to the lexicographically smallest pair, so
        the result depends only on `words`.
    """
    pieces = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, count in words.items():
            p = pieces[w]
            for a, b in zip(p, p[1:], strict=False):
                pairs[a, b] += count
        if not pairs:
            break
        pair, count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merges.append(pair)
        for w, p in pieces.items():
            out, i = [], 0
            while i < len(p):
                if i + 1 < len(p) and (p[i], p[i + 1]) == pair:
                    out.append(p[i] + p[i + 1])
                    i += 2
                else:
                    out.append(p[i])
                    i += 1
            pieces[w] = out
    return merges


def build_offline_tokenizer():
    """The offline Qwen3-VL tokenizer (a transformers `Qwen2Tokenizer`), built from `CORPUS`.

    Returns:
        A `Qwen2Tokenizer` with vocabulary = 256 byte tokens + learned merges + Qwen3-VL's added tokens.
    """
    from tokenizers import AddedToken, pre_tokenizers
    from transformers import Qwen2Tokenizer

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_vocab = {c: i for i, c in enumerate(sorted(byte_chars, key=_byte_of))}  # id = byte value
    bytes_only = Qwen2Tokenizer(vocab=dict(byte_vocab), merges=[])
    pipeline = bytes_only.backend_tokenizer
    words = Counter(
        piece
        for line in CORPUS.strip().splitlines()
        for piece, _ in pipeline.pre_tokenizer.pre_tokenize_str(pipeline.normalizer.normalize_str(line + "\n"))
    )
    merges = train_merges(words, MAX_MERGES)
    vocab = dict(byte_vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    first_added = len(vocab)
    for offset, (token, _) in enumerate(QWEN3_VL_ADDED_TOKENS):
        vocab[token] = first_added + offset
    specials = [t for t, special in QWEN3_VL_ADDED_TOKENS if special and t not in ("<|endoftext|>", "<|im_end|>")]
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=list(merges),
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=specials,
        model_max_length=262144,
        errors="replace",
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, special in QWEN3_VL_ADDED_TOKENS if not special]
    )
    for token, _ in QWEN3_VL_ADDED_TOKENS:  # the added tokens kept the ids reserved for them in `vocab`
        assert tokenizer.convert_tokens_to_ids(token) == vocab[token], token
    return tokenizer


def build_offline_processor():
    """The offline `Qwen3VLProcessor`: offline tokenizer, Qwen3-VL chat template and image/video settings.

    Returns:
        A transformers `Qwen3VLProcessor` with Qwen3-VL's default pixel range (`load_processor` sets yours).
    """
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    vision = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": 64 * 32 * 32, "longest_edge": 16384 * 32 * 32}, **vision
    )
    video_processor = Qwen3VLVideoProcessor(**vision)
    template = (OFFLINE_PROCESSOR_DIR / "chat_template.jinja").read_text()
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=build_offline_tokenizer(),
        video_processor=video_processor,
        chat_template=template,
    )


def _byte_of(char: str) -> int:
    """The byte a byte-level character stands for (GPT-2's bytes_to_unicode, inverted)."""
    code = ord(char)
    if 33 <= code <= 126 or 161 <= code <= 172 or 174 <= code <= 255:
        return code
    # The other bytes (0-32, 127-160, 173) map in order to 256, 257, ... in bytes_to_unicode.
    others = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return others[code - 256]


def main() -> int:
    """Rebuild the shipped files in `offline/` (the chat template there is the source, kept as is)."""
    processor = build_offline_processor()
    processor.save_pretrained(str(OFFLINE_PROCESSOR_DIR))
    print(f"wrote {OFFLINE_PROCESSOR_DIR} ({len(processor.tokenizer)} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
