"""A variant of miles_vl's SGLang plugin for bench_sglang_decode.py's `pixels_inline` variant; not used by miles_vl.

    python -m sglang_launch_inline_prefixes --model-path ... (the flags of `python -m sglang.launch_server`; the
    plugin opted in as the host does, MILES_VL_SGLANG_PLUGIN)

miles_vl's plugin moves the pixel tensors of a batch message (the prefixes of a batched request that were ready
together) into shared memory, one new segment per tensor, as SGLang's single send does (`wrap_shm_features`,
0.5.16 `srt/managers/mm_utils.py:1966`; the scheduler copies each out again). SGLang's own batch send pickles them into
the message instead, where a view (one image of a multi-image prompt) carries its whole storage. This variant pickles
them into the message, each as a tensor of its own: to measure which transfer is faster for a batch of prefixes. It
changes only the tokenizer's batch send, which runs in this (the launching) process: the plugin's tokenizer hook is
given `own_tensors` as the wrapper of a batch message's tensors, and a single send keeps SGLang's segments.
"""

from __future__ import annotations

import functools
import runpy
import types

import torch

from miles_vl.sglang_plugin.v0_5_16 import tokenizer as tokenizer_0516
from miles_vl.sglang_plugin.v0_5_17 import tokenizer as tokenizer_0517


def own_tensors(tokenized_obj):
    """Each pixel tensor of the request as a tensor of its own (a view is cloned), for pickling into the message."""
    for item in getattr(getattr(tokenized_obj, "mm_inputs", None), "mm_items", None) or ():
        feature = item.feature
        if isinstance(feature, torch.Tensor) and feature.untyped_storage().nbytes() > feature.nbytes:
            item.feature = feature.clone()
    return tokenized_obj


def _inline(patch_tokenizer):
    def patch(module, mm_utils, settings, states):
        stock_wrap = module.wrap_shm_features
        patch_tokenizer(types.SimpleNamespace(TokenizerManager=module.TokenizerManager, wrap_shm_features=own_tensors),
                        None, settings, states)  # fmt: skip
        # a single send keeps SGLang's segments (a wrapper of its own: the plugin checks that the name was patched)
        module.wrap_shm_features = functools.wraps(stock_wrap)(lambda obj: stock_wrap(obj))

    return patch


for _adapter in (tokenizer_0516, tokenizer_0517):  # the hook the plugin's register() applies here
    _adapter.patch_tokenizer = _inline(_adapter.patch_tokenizer)

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
