"""A variant of miles_vl's launcher for bench_sglang_decode.py's `pixels_recv` variant; not used by miles_vl.

    python -m sglang_launch_threaded_receive --model-path ... (the flags of `python -m sglang.launch_server`)

The scheduler takes each request's pixel tensors out of their shared-memory segments one request after another
(`SchedulerRequestReceiver._finalize_shm_features`, `srt/managers/scheduler_components/request_receiver.py:238`:
`unwrap_shm_features` -> `ShmPointerMMData.materialize`, `srt/managers/mm_utils.py:1901`, a clone of the mapped
segment into new memory, then close and unlink). Timed on an H200 (docs/benchmarks.md), the receive of the GRPO
batch's 8 prefixes took about 22 ms of t(1). This variant materializes the requests of one receive (and the requests
inside a batch message) in threads side by side, as the launcher's tokenizer already makes their segments; with more
than one scheduler rank (tensor or attention parallelism) it keeps 0.5.16's path, whose barrier orders the ranks'
reads before the unlinks. To measure whether the receive is worth changing in miles_vl's launcher.
"""

from __future__ import annotations

import concurrent.futures
import sys

from miles_vl import sglang_launch

_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _requests(recv_reqs) -> list:
    """The single requests of a receive, those inside batch messages included, in order."""
    out = []
    for req in recv_reqs:
        out.extend(getattr(req, "batch", None) or [req])  # BaseBatchReq: its .batch; a single request: itself
    return out


def _patch_receiver(module) -> None:
    sglang_launch._patch_receiver(module)  # miles_vl's own (the copies' pixels by hash), around recv_requests
    cls = module.SchedulerRequestReceiver
    stock = cls._finalize_shm_features

    def finalize_shm_features(self, recv_reqs):
        global _pool
        single_rank = not self.server_args.enable_dp_attention and self.ps.tp_size == 1
        if not (recv_reqs and single_rank and self.model_config.is_multimodal and module.has_shm_features(recv_reqs)):
            return stock(self, recv_reqs)
        requests = _requests(recv_reqs)
        if len(requests) < 2:
            return stock(self, recv_reqs)
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="miles_vl_unwrap")
        for _ in _pool.map(module.unwrap_shm_features, requests):  # re-raises the first failure, as the loop would
            pass

    cls._finalize_shm_features = finalize_shm_features


sglang_launch.PATCHES[sglang_launch.RECEIVER_MODULE] = _patch_receiver

# as miles_vl/sglang_launch.py: in the launching process and in every `spawn` child (which runs this as __mp_main__)
if __name__ in ("__main__", "__mp_main__"):
    sglang_launch.install()

if __name__ == "__main__":
    sglang_launch.main(sys.argv[1:])
