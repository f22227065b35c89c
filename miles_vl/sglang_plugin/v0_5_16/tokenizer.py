"""SGLang 0.5.16's tokenizer hook: `grouping.patch_tokenizer` on 0.5.16's `TokenizerManager`, with 0.5.16's request
states (one state per rid, `_init_req_state`; `generate_request` makes `batch x n` of them for a batch with `n > 1`
and uses only the first `batch`, `io_struct.GenerateReqInput._normalize_rid`: the rest are removed here).
"""

from __future__ import annotations

from miles_vl.sglang_plugin.adapter import Context, Hook, Target
from miles_vl.sglang_plugin.grouping import RequestStates, patch_tokenizer

TOKENIZER_MODULE = "sglang.srt.managers.tokenizer_manager"
MM_UTILS_MODULE = "sglang.srt.managers.mm_utils"
IO_STRUCT_MODULE = "sglang.srt.managers.io_struct"
TM = "TokenizerManager"

# what the hook patches (the first five) and what it calls or reads
TARGETS = (
    Target(TOKENIZER_MODULE, f"{TM}._handle_batch_request", ("self", "obj", "request")),
    Target(TOKENIZER_MODULE, f"{TM}._send_one_request", ("self", "tokenized_obj")),
    Target(TOKENIZER_MODULE, f"{TM}._send_batch_request", ("self", "tokenized_objs")),
    Target(TOKENIZER_MODULE, f"{TM}._tokenize_one_request", ("self", "obj")),
    Target(TOKENIZER_MODULE, "wrap_shm_features", ("obj",)),
    Target(TOKENIZER_MODULE, f"{TM}._init_req_state", ("self", "obj", "request")),
    Target(TOKENIZER_MODULE, f"{TM}._wait_one_response", ("self", "obj", "request")),
    Target(IO_STRUCT_MODULE, "GenerateReqInput.regenerate_rid", ("self",)),
    Target(IO_STRUCT_MODULE, "GenerateReqInput.__getitem__", ("self", "i")),
    Target(MM_UTILS_MODULE, "ShmPointerMMData.__getstate__"),
    Target(MM_UTILS_MODULE, "ShmPointerMMData.__setstate__"),
    Target(MM_UTILS_MODULE, "make_shm_name", ("kind",)),
    Target(MM_UTILS_MODULE, "_get_is_default_transport"),
    Target(MM_UTILS_MODULE, "get_server_args"),
)
PATCHED = tuple(
    (TOKENIZER_MODULE, name)
    for name in (
        f"{TM}._handle_batch_request",
        f"{TM}._send_one_request",
        f"{TM}._send_batch_request",
        f"{TM}._tokenize_one_request",
        "wrap_shm_features",
    )
)


def _add(manager, logical_rid: str, sample) -> None:
    sample.regenerate_rid()
    manager._init_req_state(sample)


def _remove(manager, rid: str):
    return manager.rid_to_state.pop(rid, None)


STATES = RequestStates(add=_add, remove=_remove, normalized_extra=True)


def apply(modules: dict, context: Context) -> None:
    patch_tokenizer(modules[TOKENIZER_MODULE], modules[MM_UTILS_MODULE], context.settings, STATES)


HOOK = Hook("tokenizer", TARGETS, apply, PATCHED)
