"""The production rollout engine: SGLang 0.5.16 servers driven over HTTP (see docs/sglang.md).

- `server`: the launch command (`build_server_argv`, pure), its environment, process supervision, health wait.
- `client`: `SGLangClient`, one server's HTTP API with timeouts and bounded retries.
- `generate`: the `/generate` request and response, and the check that SGLang used our prompt ids.
- `weights`: byte-bounded buckets; the colocated (`/update_weights_from_tensor`) and NCCL
  (`/update_weights_from_distributed`) weight-sync sequences.
- `verify`: did a colocated sync land (names SGLang loads, server-side hashes of a few tensors).
- `engine`: `SGLangRolloutEngine`, the `RolloutEngine` over one server.
- `host`: `SGLangRolloutHost`, the `RolloutEngine`: launch + restart + engine in one object; Ray runs one per engine.
"""

from miles_vl.rollout.sglang.client import (
    SGLangClient,
    SGLangError,
    SGLangRequestError,
    SGLangResponseError,
    SGLangServerDiedError,
    SGLangUnavailableError,
)
from miles_vl.rollout.sglang.engine import EngineStateError, SGLangPrompt, SGLangRolloutEngine, WeightVersionError
from miles_vl.rollout.sglang.generate import PromptMismatchError
from miles_vl.rollout.sglang.host import SGLangRolloutHost, sglang_actor_class
from miles_vl.rollout.sglang.server import (
    ServerProcess,
    ServerSpec,
    build_server_argv,
    build_server_env,
    wait_until_healthy,
    write_server_config,
)
from miles_vl.rollout.sglang.verify import WeightSyncError, checkpoint_names
from miles_vl.rollout.sglang.weights import (
    DistributedWeightSender,
    EngineEndpoint,
    SyncReport,
    TensorMeta,
    iter_buckets,
    plan_buckets,
    serialize_named_tensors,
    sync_weights_from_tensors,
)

__all__ = [
    "DistributedWeightSender",
    "EngineEndpoint",
    "EngineStateError",
    "PromptMismatchError",
    "SGLangClient",
    "SGLangError",
    "SGLangPrompt",
    "SGLangRequestError",
    "SGLangResponseError",
    "SGLangRolloutEngine",
    "SGLangRolloutHost",
    "SGLangServerDiedError",
    "SGLangUnavailableError",
    "ServerProcess",
    "ServerSpec",
    "SyncReport",
    "TensorMeta",
    "WeightSyncError",
    "WeightVersionError",
    "build_server_argv",
    "build_server_env",
    "checkpoint_names",
    "iter_buckets",
    "plan_buckets",
    "serialize_named_tensors",
    "sglang_actor_class",
    "sync_weights_from_tensors",
    "wait_until_healthy",
    "write_server_config",
]
