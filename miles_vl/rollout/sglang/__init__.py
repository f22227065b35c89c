"""The production rollout engine: SGLang 0.5.16 servers driven over HTTP (see docs/sglang.md).

- `server`: the launch command (`build_server_argv`, pure), its environment, process supervision, health wait.
- `client`: `SGLangClient`, one server's HTTP API with timeouts and bounded retries (`RequestPolicy`).
- `generate`: the `/generate` request and response, and the check that SGLang used our prompt ids.
- `verify`: did a colocated sync land (names SGLang loads, server-side hashes of a few tensors).
- `engine`: `SGLangRolloutEngine`, generation and weights over one server's HTTP API, sent as `EngineOptions` say.
- `host`: `SGLangRolloutHost`, the `RolloutEngine`: launch + restart + engine in one object; Ray runs one per engine;
  it checks that a server meant to run miles_vl's SGLang plugin (miles_vl/sglang_plugin/) reports it.
- `weights`: SGLang's weight-sync wire: the `/update_weights_from_tensor` payload (colocated) and trainer rank 0's
  NCCL group over `/init_weights_update_group` and `/update_weights_from_distributed` (`open_trainer_group`).

The engine-agnostic weight sync (buckets, deadlines, the two strategies the driver runs) is
miles_vl/rollout/weight_sync.py; orchestration/factories.py's engine table gives it `weights.open_trainer_group`.
"""

from miles_vl.rollout.sglang.client import (
    RequestPolicy,
    SGLangClient,
    SGLangError,
    SGLangRequestError,
    SGLangResponseError,
    SGLangServerDiedError,
    SGLangUnavailableError,
)
from miles_vl.rollout.sglang.engine import EngineOptions, EngineStateError, SGLangRolloutEngine, WeightVersionError
from miles_vl.rollout.sglang.generate import PromptMismatchError
from miles_vl.rollout.sglang.host import SGLangPluginMissingError, SGLangPortTakenError, SGLangRolloutHost
from miles_vl.rollout.sglang.server import (
    SGLANG_LAUNCH_MODULE,
    ServerProcess,
    ServerSpec,
    build_server_argv,
    build_server_env,
    wait_until_healthy,
    write_server_config,
)
from miles_vl.rollout.sglang.verify import WeightSyncError, checkpoint_names

__all__ = [
    "SGLANG_LAUNCH_MODULE",
    "EngineOptions",
    "EngineStateError",
    "PromptMismatchError",
    "RequestPolicy",
    "SGLangClient",
    "SGLangError",
    "SGLangPluginMissingError",
    "SGLangPortTakenError",
    "SGLangRequestError",
    "SGLangResponseError",
    "SGLangRolloutEngine",
    "SGLangRolloutHost",
    "SGLangServerDiedError",
    "SGLangUnavailableError",
    "ServerProcess",
    "ServerSpec",
    "WeightSyncError",
    "WeightVersionError",
    "build_server_argv",
    "build_server_env",
    "checkpoint_names",
    "wait_until_healthy",
    "write_server_config",
]
