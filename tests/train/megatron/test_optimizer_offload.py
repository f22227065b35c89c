"""Contract: `train.optimizer.cpu_offload` reaches megatron-core's optimizer config as its CPU offload, with what
megatron-core 0.19.2 requires of it: the precision-aware optimizer's code path (megatron/training/arguments.py asserts
it), the distributed optimizer, Adam in AdamW mode (`get_megatron_optimizer` asserts `decoupled_weight_decay`) and
fp32 main weights and moments; 0 leaves the optimizer as it was (all on the GPU, no precision-aware path).

The HybridDeviceOptimizer itself needs CUDA (CUDA streams and pinned host memory in its constructor), so its step and
its checkpoint round trip run on the GPU machine (scripts/gpu/loop_run.sh 8b_1gpu); this pins the wiring, in one CPU
rank of the harness (importing build.py needs its Transformer Engine stand-ins)."""

from __future__ import annotations

import pytest
import torch

from tests.patches.harness.shims import bridge_available
from tests.train.megatron import cpu_parts

FIELDS = (
    "optimizer",
    "optimizer_cpu_offload",
    "optimizer_offload_fraction",
    "use_precision_aware_optimizer",
    "use_distributed_optimizer",
    "decoupled_weight_decay",
    "main_params_dtype",
    "main_grads_dtype",
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
    "lr",
    "weight_decay",
)


def job_optimizer_configs(ctx, fractions: list[float]) -> dict:
    """{fraction: the config's FIELDS as strings, or the error's message}."""
    from miles_vl.train.megatron.build import optimizer_config
    from miles_vl.train.types import OptimizerOptions

    out = {}
    for f in fractions:
        try:
            cfg = optimizer_config(OptimizerOptions(lr=2e-6, weight_decay=0.1, cpu_offload=f), bf16=True)
        except ValueError as e:
            out[f] = str(e)
            continue
        out[f] = {name: str(getattr(cfg, name)) for name in FIELDS}
    return out


@pytest.fixture(scope="module")
def configs() -> dict:
    if reason := bridge_available("0.6.2"):
        pytest.fail(f"the CPU harness cannot load megatron-bridge 0.6.2: {reason}")
    (out,) = cpu_parts.spawn(job_optimizer_configs, 1, args=([0.0, 0.25, 1.0, 1.5],))
    return out


def test_cpu_offload_sets_megatrons_offload_and_what_it_needs(configs):
    cfg = configs[1.0]
    assert cfg["optimizer_cpu_offload"] == "True" and cfg["optimizer_offload_fraction"] == "1.0"
    assert cfg["use_precision_aware_optimizer"] == "True" and cfg["use_distributed_optimizer"] == "True"
    assert cfg["optimizer"] == "adam" and cfg["decoupled_weight_decay"] == "True"
    dtypes = [cfg[k] for k in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")]
    assert dtypes == ["torch.float32"] * 4
    assert cfg["lr"] == "2e-06" and cfg["weight_decay"] == "0.1"


def test_a_fraction_is_passed_through(configs):
    assert configs[0.25]["optimizer_cpu_offload"] == "True" and configs[0.25]["optimizer_offload_fraction"] == "0.25"


def test_no_offload_leaves_the_gpu_optimizer_unchanged(configs):
    cfg = configs[0.0]
    assert cfg["optimizer_cpu_offload"] == "False" and cfg["use_precision_aware_optimizer"] == "False"
    assert cfg["use_distributed_optimizer"] == "True"


def test_a_fraction_outside_0_1_is_refused(configs):
    assert "optimizer.cpu_offload must be in [0, 1]" in configs[1.5] and "found 1.5" in configs[1.5]


def test_a_load_hands_the_state_to_every_offloaded_optimizer(tmp_path, monkeypatch):
    """megatron-core 0.19.2's dp_reshardable load leaves the HybridDeviceOptimizer's `_sync_hdo_state_to_sub_optimizers`
    out (its other two loads call it): `load_checkpoint` calls it, after the optimizer's `load_state_dict`, for each
    offloaded optimizer in the chain and for nothing else (megatron's load stubbed; the real round trip:
    tests/gpu/test_megatron_train_gpu.py)."""
    from types import SimpleNamespace

    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from miles_vl.train.megatron import checkpoint

    events = []
    offloaded = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)  # its constructor needs CUDA
    offloaded._sync_hdo_state_to_sub_optimizers = lambda: events.append("synced")
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    chain = SimpleNamespace(
        chained_optimizers=[SimpleNamespace(optimizer=offloaded), SimpleNamespace(optimizer=plain)],
        sharded_state_dict=lambda state, **kw: {},
        load_state_dict=lambda state: events.append(("loaded", state)),
    )
    (tmp_path / "metadata.json").write_text("{}")
    saved = {"optimizer": {"param_state": 1}, "trainer_state": {"optimizer_steps": 3}}
    monkeypatch.setattr(dist_checkpointing, "load", lambda state, directory: saved)
    monkeypatch.setattr(dist_checkpointing, "load_content_metadata", lambda directory: None)  # as older checkpoints
    assert checkpoint.load_checkpoint(tmp_path, [], chain) == {"optimizer_steps": 3}
    assert events == [("loaded", {"param_state": 1}), "synced"]
    assert checkpoint.sync_offloaded_optimizer(SimpleNamespace(optimizer=plain)) == 0 and len(events) == 2


def test_a_model_only_load_reloads_the_main_weights_and_hands_no_state_to_an_offloaded_optimizer(tmp_path, monkeypatch):
    """A checkpoint saved without the optimizer's state (checkpoint.optimizer_state=false): the load asks megatron's
    optimizer for no shards and calls its `reload_model_params` (for an offloaded one, megatron-core 0.19.2 copies
    the model into its fp32 copies: `update_fp32_param_by_new_param`), not `_sync_hdo_state_to_sub_optimizers`, which
    on an optimizer that has not stepped fails (its state has no `master_param`: shown here on a hand-built one)."""
    from types import SimpleNamespace

    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from miles_vl.train.megatron import checkpoint

    events = []
    offloaded = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)  # its constructor needs CUDA
    offloaded._sync_hdo_state_to_sub_optimizers = lambda: events.append("synced")
    chain = SimpleNamespace(
        chained_optimizers=[SimpleNamespace(optimizer=offloaded)],
        sharded_state_dict=lambda state, **kw: events.append("optimizer shards asked for"),
        load_state_dict=lambda state: events.append("loaded"),
        reload_model_params=lambda: events.append("reloaded"),
    )
    (tmp_path / "metadata.json").write_text("{}")
    monkeypatch.setattr(dist_checkpointing, "load", lambda state, directory: {"trainer_state": {"optimizer_steps": 3}})
    monkeypatch.setattr(dist_checkpointing, "load_content_metadata", lambda directory: {"optimizer_state": False})
    assert checkpoint.load_checkpoint(tmp_path, [], chain) == {"optimizer_steps": 3}
    assert events == ["reloaded"]

    # what the sync would meet: a HybridDeviceOptimizer (bf16 parameter, fp32 copy) that has not stepped
    param = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    fresh = HybridDeviceOptimizer.__new__(HybridDeviceOptimizer)
    torch.optim.Optimizer.__init__(fresh, [param], {"cpu_optimizer_cls": torch.optim.AdamW})
    fp32 = param.detach().float()
    fresh.param_update_in_fp32, fresh.param_to_fp32_param, fresh.inner_param_to_orig_param = True, {param: fp32}, {}
    fresh.inner_param_to_orig_param[fp32] = param
    fresh.cpu_optimizers, fresh.gpu_optimizer = [torch.optim.AdamW([fp32])], None  # all of it offloaded
    with torch.no_grad():
        param.add_(1.0)  # a load into the model
    fresh.update_fp32_param_by_new_param()  # what reload_model_params reaches (DistributedOptimizer)
    assert torch.equal(fp32, param.detach().float())
    with pytest.raises(KeyError, match="master_param"):
        fresh._sync_hdo_state_to_sub_optimizers()


def test_a_megatron_core_without_the_sync_it_needs_is_refused_by_name(monkeypatch):
    """`build_megatron_backend` checks, before it builds an offloaded optimizer, that megatron-core has the private
    method a resume of it calls (`require_offload_support`): the installed 0.19.2 passes; a release without it is one
    error naming the release, the method and both fixes, not an AttributeError at the first resume."""
    import importlib.metadata

    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from miles_vl.train.megatron.checkpoint import require_offload_support

    require_offload_support()
    monkeypatch.delattr(HybridDeviceOptimizer, "_sync_hdo_state_to_sub_optimizers")
    with pytest.raises(RuntimeError) as refused:
        require_offload_support()
    message = str(refused.value)
    assert f"megatron-core {importlib.metadata.version('megatron-core')} has none" in message
    assert "_sync_hdo_state_to_sub_optimizers" in message
    assert "install megatron-core 0.19.2" in message and "train.optimizer.cpu_offload=0" in message
