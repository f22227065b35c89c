"""Contract: the megatron backend trains the real megatron-bridge Qwen3VLModel on pre-sharded THD micro-batches with
the policy loss of the torch backend, and its results do not depend on how the work is split.

All on CPU (fp32, gloo), with the harness's tiny model and the CPU stand-ins of cpu_parts.py (megatron's DDP,
finalize and optimizer semantics). Checked against independent references:
- CP=2, DP=2 and TP=2 (two ranks) vs each sample run alone (BSHD, transformers' positions) through the same weights,
  with logprobs from a plain log_softmax, the loss from `policy_loss` with hand-written global weights and
  gradients from autograd: logprobs, loss, every parameter gradient (reduced as megatron's DDP with per-token loss
  does: summed over DP x CP, divided by the reported tokens); and a full RL step's metrics across layouts;
- the AutoBridge path: a tiny HF checkpoint loaded by megatron-bridge exports back bit-exactly, and the megatron
  backend on it gives the torch backend's logprobs and RL-step metrics on the same checkpoint.

Left for tests/gpu/test_megatron_train_gpu.py: Transformer Engine attention, megatron's DDP buffers, the distributed
optimizer, megatron's schedules and dist checkpointing (they need CUDA).
"""

from __future__ import annotations

import pytest
import torch

from tests.train.megatron import cpu_parts, jobs

REDUCTION = "seq_mean_token_mean"  # per-sequence counts across shards: the harder reduction
TOL = 1e-5  # relative; fp32 sums in different orders


pytestmark = pytest.mark.usefixtures("megatron_bridge")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_qwen3vl")
    return str(directory), jobs.write_tiny_hf_checkpoint(str(directory))


@pytest.fixture(scope="module")
def runs(hf_checkpoint):
    """What each of the two ranks computed (jobs.job_all)."""
    return cpu_parts.spawn(
        jobs.job_all, 2, args=(jobs.train_samples(0), REDUCTION, hf_checkpoint[0], jobs.hf_train_samples())
    )


@pytest.fixture(scope="module")
def reference(runs):
    return runs[0]["reference"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _max_abs(xs, ys) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys, strict=True))


def _assert_grads_close(grads: dict, reference: dict, tol: float = TOL) -> None:
    assert set(grads) == set(reference)
    assert any("vision_model" in n for n in reference) and any("output_layer" in n for n in reference)
    worst = max((_rel(grads[n], g), n) for n, g in reference.items())
    assert worst[0] < tol, worst


def test_reference_exercises_the_loss(reference):
    """The old logprobs are perturbed: ratios differ from 1, so clipping, dual clip and TIS all take part."""
    zero = [n for n, g in reference["grads"].items() if not g.abs().max() > 0]
    # the deepstack features of the last vision layer are added after the last language layer, at vision (prompt)
    # positions only, which carry no loss: their merger gets no gradient, in the reference as in the backend
    assert reference["loss"] != 0 and all("deepstack_merger_list.1." in n for n in zero), zero


@pytest.mark.parametrize("layout", ["cp2", "dp2"])
def test_cp2_and_dp2_match_the_reference(runs, reference, layout):
    """Pre-sharded packed THD at CP=2 (resp. each DP rank's packed share at CP=1) through the backend: the per-sample
    logprobs, the loss and every parameter gradient (vision tower included) of running each sample alone."""
    for rank in runs:
        got = rank[layout]
        assert _max_abs(got["logprobs"], reference["logprobs"]) < 1e-5
        assert abs(got["metrics"]["loss"] - reference["loss"]) <= TOL * abs(reference["loss"])
        _assert_grads_close(got["grads"], reference["grads"])
        assert got["metrics"]["clip_frac"] > 0 and got["metrics"]["ratio_max"] > 1.28
    _assert_train_metrics_close(runs[0][layout]["train"], runs[0]["cp2"]["train"])
    _assert_train_metrics_close(runs[1][layout]["train"], runs[0]["cp2"]["train"])


def test_tp2_matches_the_reference(runs, reference):
    """TP=2: vocab-parallel logprobs and loss; TP-split gradients reassembled equal the reference."""
    ranks = sorted((r["tp2"] for r in runs), key=lambda r: r["tp_rank"])
    for r in ranks:
        assert _max_abs(r["logprobs"], reference["logprobs"]) < 1e-5
        assert abs(r["metrics"]["loss"] - reference["loss"]) <= TOL * abs(reference["loss"])
        _assert_train_metrics_close(r["train"], runs[0]["cp2"]["train"])
    full = {n: _unshard([r["grads"][n] for r in ranks], *ranks[0]["partition"][n]) for n in ranks[0]["grads"]}
    _assert_grads_close(full, reference["grads"])
    assert any(dim >= 0 for dim, _ in ranks[0]["partition"].values())  # something was really split


def test_vocab_parallel_logprobs_over_tp2(runs):
    """Each TP rank holding half of the vocabulary: logprobs, entropy and the gradient of the logits equal a plain
    log_softmax over the whole (temperature-scaled, suppressed, unpadded) vocabulary."""
    jobs.assert_vocab_parallel_matches([r["vocab_parallel"] for r in runs])


def _unshard(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """Megatron's TP split inverted: each rank holds pieces r, r + tp, ... of size shard/stride along `dim`."""
    if dim < 0:
        assert all(torch.equal(s, shards[0]) for s in shards[1:]) or _rel(shards[1], shards[0]) < TOL
        return shards[0]
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(len(shards))], dim=dim)


def _assert_train_metrics_close(got: dict, want: dict, tol: float = 1e-4) -> None:
    assert set(got) == set(want)
    assert got["train/optimizer_steps"] == want["train/optimizer_steps"] == 3.0
    assert got["train/skipped_nonfinite_steps"] == 0.0
    for key in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm", "train/entropy", "train/ratio_mean"):
        assert abs(got[key] - want[key]) <= tol * max(abs(want[key]), 1e-3), (key, got[key], want[key])
    assert got["train/clip_frac"] == want["train/clip_frac"]


def test_export_round_trips_the_hf_checkpoint(runs, hf_checkpoint):
    export = runs[0]["export"]
    hf_state = hf_checkpoint[1]
    assert set(export["full"]) == set(hf_state)
    different = [n for n, t in hf_state.items() if not torch.equal(export["full"][n], t)]
    assert not different, different
    # frozen vision tower: nothing under model.visual is sent, everything else is
    assert export["trainable_names"] == sorted(n for n in hf_state if not n.startswith("model.visual."))
    names = [n for bucket in export["buckets"] for n in bucket]
    assert sorted(names) == sorted(hf_state) and len(export["buckets"]) > 1
    for bucket in export["buckets"]:
        size = sum(hf_state[n].numel() * hf_state[n].element_size() for n in bucket)
        assert size <= 64 << 10 or len(bucket) == 1


def test_megatron_backend_matches_torch_backend(runs, hf_checkpoint):
    """Same HF checkpoint, same samples and options (DP=2 for megatron): the same logprobs and RL-step metrics."""
    from miles_vl.models.qwen3_vl.model import build_model
    from miles_vl.train import TorchTrainBackend, train_step

    torch_backend = TorchTrainBackend(
        build_model(jobs.tokens(), path=hf_checkpoint[0]), jobs.tokens(), jobs.cross_backend_options()
    )
    samples = jobs.hf_train_samples()
    export = runs[0]["export"]
    assert _max_abs(export["logprobs"], torch_backend.compute_logprobs(samples)) < 1e-5
    want = train_step(torch_backend, samples)
    got = export["train"]
    for key in ("train/loss", "train/pg_loss", "train/kl_loss", "train/entropy_loss", "train/grad_norm"):
        assert abs(got[key] - want[key]) <= 1e-4 * max(abs(want[key]), 1e-3), (key, got[key], want[key])
    assert got["train/n_loss_tokens"] == want["train/n_loss_tokens"]
    assert got["train/optimizer_steps"] == want["train/optimizer_steps"] == 3.0
    assert got["train/skipped_nonfinite_steps"] == want["train/skipped_nonfinite_steps"] == 0.0
    assert got["train/clip_frac"] == want["train/clip_frac"]


def test_pipeline_parallel_matches_torch_backend(tmp_path):
    """PP=2 (megatron's 1F1B schedule over gloo, variable lengths, the vision tower on stage 0 only): the same
    logprobs on both stages and the same RL step as the torch backend on the same checkpoint. Four layers: megatron-
    bridge needs every deepstack layer (two here) on the first stage."""
    from miles_vl.models.qwen3_vl.model import build_model
    from miles_vl.train import TorchTrainBackend, train_step

    jobs.write_tiny_hf_checkpoint(str(tmp_path), num_hidden_layers=4)
    hf_checkpoint = (str(tmp_path),)
    samples = jobs.hf_train_samples()
    stages = cpu_parts.spawn(jobs.job_pipeline, 2, args=(hf_checkpoint[0], samples))
    assert [s["stage"] for s in stages] == [0, 1] and all(s["variable_seq_lengths"] for s in stages)
    assert any("vision_model" in n for n in stages[0]["params"]) and not any(
        "vision_model" in n for n in stages[1]["params"]
    )
    assert any("output_layer" in n for n in stages[1]["params"]) and not any(
        "output_layer" in n for n in stages[0]["params"]
    )
    torch_backend = TorchTrainBackend(
        build_model(jobs.tokens(), path=hf_checkpoint[0]), jobs.tokens(), jobs.cross_backend_options()
    )
    want_logprobs = torch_backend.compute_logprobs(samples)
    want = train_step(torch_backend, samples)
    for stage in stages:
        got = stage["train"]
        print(
            f"PP=2 stage {stage['stage']}: logprobs max abs diff {_max_abs(stage['logprobs'], want_logprobs):.2e}, "
            f"grad norm {got['train/grad_norm']:.8g} vs {want['train/grad_norm']:.8g}"
        )
        assert _max_abs(stage["logprobs"], want_logprobs) < 1e-5
        for key in ("train/loss", "train/pg_loss", "train/kl_loss", "train/grad_norm"):
            assert abs(got[key] - want[key]) <= 1e-4 * max(abs(want[key]), 1e-3), (key, got[key], want[key])
        assert got["train/n_loss_tokens"] == want["train/n_loss_tokens"]
        assert got["train/optimizer_steps"] == want["train/optimizer_steps"] == 3.0
