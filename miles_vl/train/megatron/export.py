"""Weights for the rollout engines: megatron-bridge's HF export, minus frozen tensors, as a stream of (name, tensor).

    named = export_hf_weights(bridge, model, skip_prefixes=("vision_model.",))   # (HF name, full tensor) pairs
    for bucket in iter_buckets(named, 512 << 20):   # miles_vl.rollout.sglang: the driver's weight sync buckets
        engine.update_weights(bucket)
    plan = ExportPlan(bridge, skip_prefixes=("vision_model.",))   # the same, conversion tasks built once per model
    named = plan.weights(model, cpu=False)

`bridge.export_hf_weights` gathers TP shards and broadcasts PP stages, so every rank yields every full tensor with
its HF name (vision tower included), converting fused layouts back (QKV, gate/up). With a frozen vision tower the
engines already hold those weights: the conversion tasks of megatron parameters under `skip_prefixes` are dropped
before any gathering, so they cost nothing.

Cost (benchmarks/bench_export.py): with `cpu=False` (the colocated sync) the export copies no data but the QKV
splits (gate/up splits are views), so a sync pays mostly per-task host time. Building the conversion tasks walks the
model and looks every name up in the mapping registry (~65 us a task on a loaded CPU core, ~40 ms for the 625 tasks
of the 2B model): `ExportPlan`, which the megatron backend uses, builds them on the first sync only. Each text QKV
task also copies the transformer config (`remove_non_pickleables`, even with PP = 1; 0.4-2.3 ms) and splits with
index tensors built on the CPU (`split_qkv_weights`; 1.4-2.7 ms, even for a 16 KB weight), ~3.7 ms a task on the
same core, 28 tasks at 2B; left to megatron-bridge for now.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from torch import Tensor


def export_hf_weights(
    bridge, model: list, *, skip_prefixes: Sequence[str] = (), cpu: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) of every exported weight; collective: every rank of the model must iterate it fully.

    Args:
        bridge: the `megatron.bridge.AutoBridge` the model was built from.
        model: the model chunks (DDP-wrapped or not).
        skip_prefixes: megatron parameter names (unwrapped, global, e.g. "vision_model.") not to export.
        cpu: move each tensor to the CPU.
    """
    tasks = conversion_tasks(bridge, model, skip_prefixes)
    # HFWeightTuple is a NamedTuple (param_name, weight): it unpacks as the (name, tensor) pair
    yield from bridge.export_hf_weights(model, cpu=cpu, show_progress=False, conversion_tasks=tasks)


def conversion_tasks(bridge, model: list, skip_prefixes: Sequence[str] = ()) -> list:
    """megatron-bridge's conversion tasks of `model`, minus those of megatron parameters under `skip_prefixes`.
    Collective over the pipeline group on a bridge's first call (it gathers every stage's parameter names)."""
    tasks = [t for t in bridge.get_conversion_tasks(model) if t is not None]
    if skip_prefixes:
        tasks = [t for t in tasks if not t.global_param_name.startswith(tuple(skip_prefixes))]
    return tasks


class ExportPlan:
    """`export_hf_weights` with the conversion tasks built once per model instead of on every sync.

    A task (megatron-bridge's `WeightConversionTask`) holds the model's structure, not its values: the parameter
    names, the mapping that converts the layout (QKV, gate/up), the owning module and a reference to the parameter
    object itself, whose values the export reads when it runs. So tasks stay right while values change in place
    (optimizer steps, `load_state_dict` of a checkpoint, megatron's offload and memory-saver pauses keep the
    parameter objects), and are wrong for another model, or for a model whose parameter objects were replaced. Each
    `weights` call checks, before reusing the tasks, that the chunks and the identities of their parameters and
    persistent buffers are those the tasks were built from (a walk over the module tree, no tensor data read) and
    builds them again otherwise. The old tasks keep the old parameter objects alive until then, so no id is reused.
    """

    def __init__(self, bridge, *, skip_prefixes: Sequence[str] = ()) -> None:
        self.bridge = bridge
        self.skip_prefixes = tuple(skip_prefixes)
        self.builds = 0  # how many times the tasks were built (the tests read it)
        self._tasks: list | None = None
        self._key: tuple | None = None

    def weights(self, model: list, *, cpu: bool = True) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) of every exported weight, as `export_hf_weights`; collective likewise."""
        key = _structure_key(model)
        if self._tasks is None or key != self._key:
            self._tasks, self._key = conversion_tasks(self.bridge, model, self.skip_prefixes), key
            self.builds += 1
        yield from self.bridge.export_hf_weights(model, cpu=cpu, show_progress=False, conversion_tasks=self._tasks)


def _structure_key(model: list) -> tuple:
    """The identities of the chunks and of every tensor a task can reference: parameters and persistent buffers
    (megatron-bridge exports both), in order. Non-persistent buffers are not exported, and some are replaced on
    every forward (they would rebuild the tasks on every sync for nothing)."""
    from megatron.bridge.models.conversion.utils import persistent_buffers

    tensors = (itertools.chain(c.parameters(), (b for _, b in persistent_buffers(c))) for c in model)
    return tuple(id(x) for x in itertools.chain(model, *tensors))
