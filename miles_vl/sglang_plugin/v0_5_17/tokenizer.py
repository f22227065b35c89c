"""SGLang 0.5.17's tokenizer hook: `grouping.patch_tokenizer` with 0.5.17's request states.

0.5.17 tracks the requests of a parallel-sampling prompt under the prompt's logical rid (`_init_child_req_state`,
`_remove_req_state`, children named `<logical rid>_<hex>` by `regenerate_rid(prefix=...)`), so that aborting the
prompt aborts its samples; the grouped handler keeps that bookkeeping. 0.5.17 normalizes one rid per prompt
(`GenerateReqInput._normalize_rid`), so 0.5.16's removal of the unused `batch x n` states is not carried here. The
methods the hook wraps kept their signatures (diffed against 0.5.16). New in 0.5.17: `SGLANG_RUST_SERVER=1` replaces
the Python `TokenizerManager` by a Rust one in the scheduler (`srt/environ.py:1343`), where none of these hooks would
run: refused. Also new: an unset `--mm-feature-transport` resolves to cuda_ipc, which the plugin's pixel handling is
not written for: this hook pins it to cpu (`transport`). And new: Qwen-VL's processor runs in worker threads, which
split a batch's prefixes and turn a processor's StopIteration into a request that never ends: this hook keeps
preprocessed media inline and re-raises the StopIteration (`processor`).
"""

from __future__ import annotations

from miles_vl.sglang_plugin.adapter import FIX, Context, Hook, PluginRefused, Target
from miles_vl.sglang_plugin.grouping import RequestStates, patch_tokenizer
from miles_vl.sglang_plugin.v0_5_16.tokenizer import IO_STRUCT_MODULE, MM_UTILS_MODULE, TM, TOKENIZER_MODULE
from miles_vl.sglang_plugin.v0_5_16.tokenizer import PATCHED as PATCHED_0_5_16
from miles_vl.sglang_plugin.v0_5_16.tokenizer import TARGETS as TARGETS_0_5_16
from miles_vl.sglang_plugin.v0_5_17 import processor, transport

ENVIRON_MODULE = transport.ENVIRON_MODULE

# 0.5.16's targets but its request-state methods, which 0.5.17 changed
CHANGED = (f"{TM}._init_req_state", "GenerateReqInput.regenerate_rid")
TARGETS = (
    tuple(t for t in TARGETS_0_5_16 if t.attribute not in CHANGED)
    + (
        Target(TOKENIZER_MODULE, f"{TM}._init_child_req_state", ("self", "logical_rid", "obj")),
        Target(TOKENIZER_MODULE, f"{TM}._remove_req_state", ("self", "rid")),
        Target(IO_STRUCT_MODULE, "GenerateReqInput.regenerate_rid", ("self", "prefix")),
        Target(ENVIRON_MODULE, "envs"),
    )
    + transport.TARGETS
    + processor.TARGETS
)
PATCHED = PATCHED_0_5_16 + processor.PATCHED


def _add(manager, logical_rid: str, sample) -> None:
    sample.regenerate_rid(prefix=logical_rid)
    manager._init_child_req_state(logical_rid, sample)


def _remove(manager, rid: str):
    return manager._remove_req_state(rid)


STATES = RequestStates(add=_add, remove=_remove, normalized_extra=False)


def apply(modules: dict, context: Context) -> None:
    if modules[ENVIRON_MODULE].envs.SGLANG_RUST_SERVER.get():
        raise PluginRefused(
            "SGLang 0.5.17 with SGLANG_RUST_SERVER=1: its Rust tokenizer replaces the TokenizerManager the tokenizer "
            f"patch hooks; unset SGLANG_RUST_SERVER, or {FIX}"
        )
    transport.apply(modules, context)
    processor.apply(modules, context)
    patch_tokenizer(modules[TOKENIZER_MODULE], modules[MM_UTILS_MODULE], context.settings, STATES)


HOOK = Hook("tokenizer", TARGETS, apply, PATCHED)
