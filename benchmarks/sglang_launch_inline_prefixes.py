"""A variant of miles_vl's launcher for bench_sglang_decode.py's `pixels_inline` variant; not used by miles_vl.

    python -m sglang_launch_inline_prefixes --model-path ... (the flags of `python -m sglang.launch_server`)

miles_vl's launcher moves the pixel tensors of a batch message (the prefixes of a batched request that were ready
together) into shared memory, one new segment per tensor, as 0.5.16's single send does (`wrap_shm_features`,
`srt/managers/mm_utils.py:1966`; the scheduler copies each out again). 0.5.16's own batch send pickles them into the
message instead, where a view (one image of a multi-image prompt) carries its whole storage. This variant pickles them
into the message, each as a tensor of its own: to measure which transfer is faster for a batch of prefixes.
"""

from __future__ import annotations

import sys
import types

import torch

from miles_vl import sglang_launch


def own_tensors(tokenized_obj):
    """Each pixel tensor of the request as a tensor of its own (a view is cloned), for pickling into the message."""
    for item in getattr(getattr(tokenized_obj, "mm_inputs", None), "mm_items", None) or ():
        feature = item.feature
        if isinstance(feature, torch.Tensor) and feature.untyped_storage().nbytes() > feature.nbytes:
            item.feature = feature.clone()
    return tokenized_obj


def _patch_tokenizer(module) -> None:
    sglang_launch._patch_tokenizer(
        types.SimpleNamespace(TokenizerManager=module.TokenizerManager, wrap_shm_features=own_tensors)
    )


sglang_launch.PATCHES[sglang_launch.TOKENIZER_MODULE] = _patch_tokenizer

# as miles_vl/sglang_launch.py: in the launching process and in every `spawn` child (which runs this as __mp_main__)
if __name__ in ("__main__", "__mp_main__"):
    sglang_launch.install()

if __name__ == "__main__":
    sglang_launch.main(sys.argv[1:])
