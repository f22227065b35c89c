"""SGLang 0.5.17's receiver hook: `pixels.patch_receiver` on 0.5.17's `SchedulerRequestReceiver`. 0.5.17 reads the
parallel settings from its runtime context (`get_parallel().enable_dp_attention`, `request_receiver.py:154`) rather
than from the server arguments, and so does this hook.
"""

from __future__ import annotations

from miles_vl.sglang_plugin.adapter import Context, Hook, Target
from miles_vl.sglang_plugin.pixels import patch_receiver
from miles_vl.sglang_plugin.v0_5_16.receiver import PATCHED, RECEIVER_MODULE
from miles_vl.sglang_plugin.v0_5_16.receiver import TARGETS as TARGETS_0_5_16

RUNTIME_CONTEXT_MODULE = "sglang.srt.runtime_context"

TARGETS = tuple(t for t in TARGETS_0_5_16 if t.module == RECEIVER_MODULE) + (
    Target(RUNTIME_CONTEXT_MODULE, "get_parallel"),
)


def single_rank(receiver) -> bool:
    from sglang.srt.runtime_context import get_parallel  # checked (TARGETS) before the hook was applied

    return not get_parallel().enable_dp_attention and receiver.ps.tp_size == 1


def apply(modules: dict, context: Context) -> None:
    patch_receiver(modules[RECEIVER_MODULE], context.settings, single_rank)


HOOK = Hook("receiver", TARGETS, apply, PATCHED)
