"""SGLang 0.5.16's receiver hook: `pixels.patch_receiver` on 0.5.16's `SchedulerRequestReceiver`; one scheduler rank
is told by its server arguments (`server_args.enable_dp_attention`) and its parallel state (`ps.tp_size`).
"""

from __future__ import annotations

from miles_vl.sglang_plugin.adapter import Context, Hook, Target
from miles_vl.sglang_plugin.pixels import patch_receiver

RECEIVER_MODULE = "sglang.srt.managers.scheduler_components.request_receiver"
SERVER_ARGS_MODULE = "sglang.srt.server_args"

TARGETS = (
    Target(RECEIVER_MODULE, "SchedulerRequestReceiver.recv_requests", ("self",)),
    Target(RECEIVER_MODULE, "SchedulerRequestReceiver._finalize_shm_features", ("self", "recv_reqs")),
    Target(RECEIVER_MODULE, "has_shm_features", ("recv_reqs",)),
    Target(RECEIVER_MODULE, "unwrap_shm_features", ("obj",)),
    Target(SERVER_ARGS_MODULE, "ServerArgs.enable_dp_attention"),
)
PATCHED = (
    (RECEIVER_MODULE, "SchedulerRequestReceiver.recv_requests"),
    (RECEIVER_MODULE, "SchedulerRequestReceiver._finalize_shm_features"),
)


def single_rank(receiver) -> bool:
    return not receiver.server_args.enable_dp_attention and receiver.ps.tp_size == 1


def apply(modules: dict, context: Context) -> None:
    patch_receiver(modules[RECEIVER_MODULE], context.settings, single_rank)


HOOK = Hook("receiver", TARGETS, apply, PATCHED)
