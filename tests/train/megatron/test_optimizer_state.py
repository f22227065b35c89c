"""Contract of `checkpoint.optimizer_state=false` in the megatron backend (train/megatron/checkpoint.py): a save
without the optimizer writes the model's shards only and says so in its content metadata; its load gives back the
weights, leaves the optimizer's moments as built, and refreshes the optimizer's fp32 main weights from the loaded
model (megatron's `reload_model_params`), so that the step after it is the step of an optimizer built on the saved
weights. Two gloo ranks at TP=2 on the CPU, the tiny real Qwen3VLModel, the real megatron-core 0.19 save and load; the
optimizer is the stand-in with fp32 main weights of its own (tests/train/megatron/cpu_parts.py), whose main weights,
like megatron's, follow a load into the model only through `reload_model_params`."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests.train.megatron import cpu_parts, jobs

pytestmark = pytest.mark.usefixtures("megatron_bridge")


def tensor_keys(directory) -> set[str]:
    """The keys of the tensors a torch_dist checkpoint holds (its `.metadata` index)."""
    return set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def size(directory) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizer_state")
    return root, cpu_parts.spawn(jobs.job_model_only_checkpoint, 2, args=(jobs.train_samples(0)[:4], str(root)))


def test_a_model_only_checkpoint_holds_no_optimizer_shards(ranks):
    """The full checkpoint's index holds the Adam moments ("optimizer." keys), the model-only one holds the same keys
    without them; its shards are about a third of the full one's (fp32 weights, two fp32 moments); the content
    metadata tells them apart, and a checkpoint written before it said so counts as holding them."""
    from miles_vl.train.megatron.checkpoint import saved_optimizer_state

    root, _ = ranks
    full, model_only = tensor_keys(root / "full"), tensor_keys(root / "model_only")
    optimizer = {k for k in full if k.startswith("optimizer.")}
    assert optimizer and {k for k in optimizer if "exp_avg_sq" in k}
    assert model_only == full - optimizer
    assert size(root / "model_only") < 0.4 * size(root / "full")
    assert saved_optimizer_state(root / "full") is True and saved_optimizer_state(root / "model_only") is False


def test_a_model_only_load_refreshes_the_main_weights_and_steps_like_a_fresh_optimizer(ranks):
    _, out = ranks
    for rank, o in enumerate(out):
        saved, loaded = o["at_save"], o["loaded"]
        names = list(saved["weights"])
        saved_weights = [saved["weights"][n] for n in names]
        # the case is built: the fresh backend's main weights are the initial ones, not the saved ones
        assert any(not torch.equal(m, w) for m, w in zip(o["main_before_load"], saved_weights, strict=True)), rank
        assert all(torch.equal(loaded["weights"][n], saved["weights"][n]) for n in names), rank
        assert all(torch.equal(m, w) for m, w in zip(loaded["main"], saved_weights, strict=True)), rank
        assert loaded["counters"] == saved["counters"] == {"optimizer_steps": 1, "skipped_steps": 0}
        assert all(m == {} for m in loaded["moments"])  # the optimizer as built: no Adam state yet
        # the step after the load is that of an optimizer built on the saved weights (moments zero, same counters)
        resumed, reference = o["resumed"], o["reference"]
        assert resumed["counters"] == reference["counters"] == {"optimizer_steps": 2, "skipped_steps": 0}
        assert all(torch.equal(resumed["weights"][n], reference["weights"][n]) for n in names), rank
        for x, y in zip(resumed["moments"], reference["moments"], strict=True):
            assert x.keys() == y.keys() == {"step", "exp_avg", "exp_avg_sq"} and all(torch.equal(x[k], y[k]) for k in x)
        assert any(not torch.equal(resumed["weights"][n], saved["weights"][n]) for n in names)  # it did step


def test_a_full_load_restores_the_moments(ranks):
    """The contrast: a checkpoint with the optimizer's state gives back the Adam moments of the saved step."""
    _, out = ranks
    for o in out:
        saved, full = o["at_save"], o["full_loaded"]
        assert all(torch.equal(full["weights"][n], w) for n, w in saved["weights"].items())
        assert len(full["moments"]) == len(saved["moments"]) and all(saved["moments"])
        for x, y in zip(full["moments"], saved["moments"], strict=True):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
