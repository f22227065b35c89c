"""Contract: the torch backend's packed loss and gradients equal the unpacked ones (and an independent reference
from transformers' own per-sample forward); a step moves logprobs in the advantage's direction; non-finite steps
are skipped and counted; a checkpoint round trip continues identically."""

import copy
import logging
import threading

import pytest
import torch
from safetensors.torch import save_model

from miles_vl.models.qwen3_vl.model import build_model
from miles_vl.train import LossOptions, OptimizerOptions, TorchTrainBackend, TrainOptions, TrainSample, train_step
from miles_vl.train.types import MiniBatch
from tests.packing.samples import IMAGE, VEND, VIDEO, VSTART
from tests.rollout.hf.test_engine import PATCH, SPECIAL


def make_samples():
    g = torch.Generator().manual_seed(0)
    image = [VSTART] + [IMAGE] * 4 + [VEND]
    specs = [  # (prompt, response, advantage, n images)
        ([11, 12] + image + [13], [40, 41, 42, 43], 1.0, 1),
        ([21, 22, 23], [50, 51], -0.5, 0),
        ([31] + image + image + [32], [60, 61, 62, 63, 64, 65, 66], 0.25, 2),
        ([71, 72], [80, 81, 82], 0.0, 0),
    ]
    out = []
    for prompt, response, adv, n_img in specs:
        grid = torch.tensor([[1, 4, 4]] * n_img) if n_img else None
        out.append(
            TrainSample(
                input_ids=torch.tensor(prompt + response),
                prompt_len=len(prompt),
                advantage=adv,
                rollout_logprobs=-torch.rand(len(response), generator=g),
                image_grid_thw=grid,
                pixel_values=torch.randn(16 * n_img, PATCH, generator=g) if n_img else None,
            )
        )
    return out


def backend(model, *, warmup_steps: int = 0, loss: LossOptions | None = None, **kw):
    optimizer = OptimizerOptions(lr=1e-2, warmup_steps=warmup_steps)
    return TorchTrainBackend(model, SPECIAL, TrainOptions(optimizer, loss or LossOptions(), **kw))


@pytest.fixture(scope="module")
def base_model():
    return build_model(SPECIAL, tiny=dict(initializer_range=0.2), seed=0)


def grads(b, samples):
    old = b.compute_logprobs(samples)
    b.optimizer.zero_grad(set_to_none=True)
    metrics, _, finite, _ = b.accumulate_gradients(MiniBatch(samples, list(range(len(samples))), old))
    assert finite
    return metrics, {n: p.grad.clone() for n, p in b.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_packed_equals_unpacked(base_model, reduction):
    samples = make_samples()
    loss = LossOptions(reduction=reduction, max_response_len=8)
    packed_b = backend(copy.deepcopy(base_model), loss=loss, micro_batch_max_tokens=4096)
    alone_b = backend(copy.deepcopy(base_model), loss=loss)
    alone_b._micro_batches = lambda batch: [[i] for i in range(len(batch))]  # every sample in its own row
    assert len(packed_b._micro_batches(samples)) == 1
    m1, g1 = grads(packed_b, samples)
    m2, g2 = grads(alone_b, samples)
    torch.testing.assert_close(m1.loss, m2.loss, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g2.keys() and any("visual" in k for k in g1)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("logits_only_where_loss", [False, True], ids=["all_logits", "logits_only_where_loss"])
def test_gradient_matches_transformers_reference(base_model, logits_only_where_loss):
    """At the first micro-step old == current, so the PPO loss is -sum_t A * ratio / N with ratio = 1 and its
    gradient is -sum_t A * grad(logp_t) / N: computed here with transformers' own unpacked forward. With
    `logits_only_where_loss` the train forward's lm_head sees the loss positions' hidden states only."""
    samples = make_samples()
    b = backend(copy.deepcopy(base_model), logits_only_where_loss=logits_only_where_loss)
    rows = []  # hidden states the lm_head projected: the old-logprob pass's, then the train forward's
    hook = b.model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    metrics, ours = grads(b, samples)
    hook.remove()
    n_tokens = sum(s.response_len for s in samples)
    assert len(rows) == 2  # one packed row (and one lm_head chunk) each: the whole row, then the train forward's
    assert rows[1] == (n_tokens if logits_only_where_loss else rows[0]) and rows[0] > n_tokens
    assert float(metrics.loss) == pytest.approx(
        -sum(s.advantage * s.response_len for s in samples) / n_tokens, abs=1e-5
    )

    ref_model = copy.deepcopy(base_model)
    ref_model.zero_grad(set_to_none=True)
    total = 0.0
    for s in samples:
        ids = s.input_ids
        types = torch.zeros_like(ids)
        types[ids == IMAGE] = 1
        types[ids == VIDEO] = 2
        logits = ref_model(
            input_ids=ids[None],
            pixel_values=s.pixel_values,
            image_grid_thw=s.image_grid_thw,
            mm_token_type_ids=types[None],
        ).logits[0]
        ref_model.model.rope_deltas = None
        logp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
        total = total + (-s.advantage * logp[s.prompt_len - 1 :]).sum() / n_tokens
    total.backward()
    for name, p in ref_model.named_parameters():
        if p.grad is not None and name in ours:
            torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gspo_packed_equals_unpacked_and_moves_along_the_advantage(base_model):
    """GSPO through the torch backend: one packed row and one row per sample give the same loss and gradients (the
    sequence ratio is per sample, never per row); a step raises the positive-advantage sample's logprobs."""
    samples = make_samples()
    loss = LossOptions(policy_loss_type="gspo", reduction="seq_mean_token_mean")
    packed_b = backend(copy.deepcopy(base_model), loss=loss, micro_batch_max_tokens=4096)
    alone_b = backend(copy.deepcopy(base_model), loss=loss)
    alone_b._micro_batches = lambda batch: [[i] for i in range(len(batch))]
    m1, g1 = grads(packed_b, samples)
    m2, g2 = grads(alone_b, samples)
    torch.testing.assert_close(m1.loss, m2.loss, rtol=1e-5, atol=1e-6)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)
    before = packed_b.compute_logprobs(samples)
    train_step(packed_b, samples)
    assert packed_b.compute_logprobs(samples)[0].sum() > before[0].sum()


def test_dr_grpo_loss_is_the_token_sum_over_a_constant(base_model):
    """Dr.GRPO's reduction at the first micro-step (ratio 1): loss = -sum_i A_i * |y_i| / (N_samples * max_len),
    written out here from the samples, not from the weights helper."""
    samples = make_samples()
    b = backend(copy.deepcopy(base_model), loss=LossOptions(reduction="seq_mean_token_sum_norm", max_response_len=8))
    metrics, _ = grads(b, samples)
    expected = -sum(s.advantage * s.response_len for s in samples) / (len(samples) * 8)
    assert float(metrics.loss) == pytest.approx(expected, abs=1e-6)


def test_step_follows_the_advantage(base_model):
    samples = make_samples()
    b = backend(copy.deepcopy(base_model), micro_batch_max_tokens=4096)
    before = b.compute_logprobs(samples)
    metrics = train_step(b, samples)
    after = b.compute_logprobs(samples)
    assert metrics["train/optimizer_steps"] == 1 and metrics["train/skipped_nonfinite_steps"] == 0
    assert after[0].sum() > before[0].sum()  # advantage +1
    assert after[1].sum() < before[1].sum()  # advantage -0.5
    for key in ("train/clip_frac", "train/approx_kl", "train/grad_norm", "train/train_rollout_logprob_abs_diff"):
        assert key in metrics


@pytest.mark.parametrize(
    ("options", "updates"),
    [(dict(), 1), (dict(global_batch_size=2), 2), (dict(ppo_epochs=2), 2)],
    ids=["one_update", "two_minibatches", "epochs"],
)
@pytest.mark.parametrize("max_tokens", [4096, 22])
def test_the_step_reports_its_train_forwards(base_model, options, updates, max_tokens):
    """`train/micro_batches` counts the packed forward-backward passes of every update: the text decoder's forwards
    with autograd on, counted here by a hook (the old-logprob pass runs under no_grad). 4096 tokens hold a whole
    mini-batch (one forward an update); 22 tokens, the longest sample padded to an even length, cannot hold the
    48 padded tokens of all four."""
    samples = make_samples()
    b = backend(copy.deepcopy(base_model), micro_batch_max_tokens=max_tokens, **options)
    train_forwards = []
    b.model.model.language_model.register_forward_hook(
        lambda m, args, out: train_forwards.append(1) if torch.is_grad_enabled() else None
    )
    metrics = train_step(b, samples)
    assert metrics["train/micro_batches"] == len(train_forwards)
    if max_tokens == 4096:
        assert len(train_forwards) == updates
    else:
        assert len(train_forwards) > updates


def test_nonfinite_loss_skips_the_step(base_model):
    samples = make_samples()
    samples[0].advantage = float("nan")
    b = backend(copy.deepcopy(base_model))
    weights = {n: p.clone() for n, p in b.model.named_parameters()}
    metrics = train_step(b, samples)
    assert metrics["train/skipped_nonfinite_steps"] == 1
    assert all(torch.equal(weights[n], p) for n, p in b.model.named_parameters())


def test_checkpoint_round_trip_continues_identically(base_model, tmp_path):
    samples = make_samples()
    a = backend(copy.deepcopy(base_model), warmup_steps=3)
    train_step(a, samples)
    a.save_checkpoint(tmp_path)
    b = backend(build_model(SPECIAL, tiny=dict(initializer_range=0.2), seed=99), warmup_steps=3)
    b.load_checkpoint(tmp_path)
    ma, mb = train_step(a, samples), train_step(b, samples)
    assert ma == mb
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_a_checkpoint_without_optimizer_state_resumes_with_a_fresh_optimizer(base_model, tmp_path):
    """checkpoint.optimizer_state=false: trainer_state.pt holds no optimizer entry (AdamW's moments, the size of the
    weights twice: the file keeps the schedule, counters and RNG only) and the weights file is the full checkpoint's.
    A backend that loads it has the saved weights and counters and an AdamW with no state; its next step equals one
    step, written out here with a plain AdamW built on the saved weights, at the learning rate the warm-up schedule
    gives the second optimizer step (2/3 of the peak; the freshly built optimizer holds the first's, 1/3), on the
    clipped gradients the backend computed. A full checkpoint restores the moments, and its next step differs."""
    samples = make_samples()
    a = backend(copy.deepcopy(base_model), warmup_steps=3)
    train_step(a, samples)
    full, light = tmp_path / "full", tmp_path / "light"
    full.mkdir(), light.mkdir()
    a.save_checkpoint(full)
    a.save_checkpoint(light, optimizer_state=False)
    assert (light / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    light_state = torch.load(light / "trainer_state.pt", weights_only=True)
    assert set(light_state) == {"scheduler", "optimizer_steps", "skipped_steps", "rng_cpu", "rng_cuda"}
    moments = sum(t.numel() for s in a.optimizer.state.values() for t in s.values() if t.dim())
    assert moments == 2 * sum(p.numel() for p in a.trainable)
    assert (light / "trainer_state.pt").stat().st_size * 100 < (full / "trainer_state.pt").stat().st_size

    b = backend(copy.deepcopy(base_model), warmup_steps=3)
    b.load_checkpoint(light)
    saved = [p.detach().clone() for p in a.trainable]
    assert all(torch.equal(x, y) for x, y in zip(b.trainable, saved, strict=True))
    assert len(b.optimizer.state) == 0 and (b.optimizer_steps, b.skipped_steps) == (1, 0)
    lr = 1e-2 * (2 / 3)  # LambdaLR's base lr x the warm-up factor of the second optimizer step
    assert b.lr() == lr and b.optimizer.param_groups[0]["lr"] == lr

    clipped = []  # the gradients b's optimizer steps with (clipped by optimizer_step)
    step = b.optimizer.step
    b.optimizer.step = lambda: (clipped.append([p.grad.clone() for p in b.trainable]), step())[1]
    train_step(b, samples)
    reference = [p.clone().requires_grad_(True) for p in saved]
    adam = torch.optim.AdamW(reference, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)  # `backend`'s
    for p, g in zip(reference, clipped[0], strict=True):
        p.grad = g
    adam.step()
    assert all(torch.equal(x.detach(), y.detach()) for x, y in zip(b.trainable, reference, strict=True))

    c = backend(copy.deepcopy(base_model), warmup_steps=3)
    c.load_checkpoint(full)
    state_a, state_c = a.optimizer.state_dict()["state"], c.optimizer.state_dict()["state"]
    assert state_a.keys() == state_c.keys() and state_a
    assert all(torch.equal(state_a[i][k], state_c[i][k]) for i in state_a for k in state_a[i])
    train_step(c, samples)
    assert any(not torch.equal(x, y) for x, y in zip(b.trainable, c.trainable, strict=True))


class _RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (type(self.marker).touch, (self.marker,))


def test_a_crafted_trainer_state_is_refused_and_never_run(base_model, tmp_path):
    """Issue 15.11: torch.load(weights_only=False) executed code from a crafted checkpoint given as
    checkpoint.resume=<path>. The real files load with weights_only=True (round trip above); a pickle that calls a
    function on load is refused with the file named, and the function never runs."""
    a = backend(copy.deepcopy(base_model))
    a.save_checkpoint(tmp_path)
    marker = tmp_path / "code-ran"
    torch.save({"optimizer": _RunsCodeWhenUnpickled(marker)}, tmp_path / "trainer_state.pt")
    with pytest.raises(ValueError, match=r"trainer_state.pt: refused to load"):
        backend(copy.deepcopy(base_model)).load_checkpoint(tmp_path)
    assert not marker.exists()
    torch.load(tmp_path / "trainer_state.pt", weights_only=False)  # the control: unguarded loading does run it
    assert marker.exists()


def test_frozen_vision_is_not_trained_or_exported(base_model):
    b = backend(copy.deepcopy(base_model), freeze_vision=True)
    names = [n for n, _ in b.export_weights()]
    assert names and not any(".visual." in n or n.startswith("model.visual") for n in names)
    before = {n: p.clone() for n, p in b.model.model.visual.named_parameters()}
    train_step(b, make_samples())
    assert all(torch.equal(before[n], p) for n, p in b.model.model.visual.named_parameters())


def test_rollout_logprob_length_checked(base_model):
    samples = make_samples()
    samples[1].rollout_logprobs = torch.zeros(5)
    with pytest.raises(ValueError, match="sample 1: 5 rollout logprobs for 2 response tokens"):
        train_step(backend(copy.deepcopy(base_model)), samples)


def test_old_and_new_logprobs_agree_at_the_first_micro_step(base_model):
    """The no-grad scoring pass and the training forward must describe the same distribution (temperature and
    banned tokens included), or every ratio starts away from 1."""
    samples = make_samples()
    b = backend(
        copy.deepcopy(base_model), loss=LossOptions(temperature=0.7, suppress_token_ids=(IMAGE, VIDEO, VSTART, VEND))
    )
    metrics, _ = grads(b, samples)
    d = metrics.as_dict()
    assert d["ratio_min"] == pytest.approx(1.0, abs=1e-5) and d["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert abs(d["approx_kl"]) < 1e-6


def test_a_checkpoint_snapshot_writes_its_moments_state_byte_for_byte(base_model, tmp_path):
    """Issue 33.3: a background save writes the state of the step it was taken at, though the next step changes the
    weights and the optimizer before the write runs: the files equal, byte for byte, a synchronous save at that
    moment, and that one equals what the backend wrote before snapshots existed (save_model + torch.save)."""
    samples = make_samples()
    b = backend(copy.deepcopy(base_model), warmup_steps=3)
    train_step(b, samples)  # optimizer moments exist
    sync, direct, background = (tmp_path / d for d in ("sync", "direct", "background"))
    for d in (sync, direct, background):
        d.mkdir()
    b.save_checkpoint(sync)
    save_model(b.model, str(direct / "model.safetensors"))
    state = {"optimizer": b.optimizer.state_dict(), "scheduler": b.scheduler.state_dict()}
    state |= {"optimizer_steps": b.optimizer_steps, "skipped_steps": b.skipped_steps}
    torch.save(state | {"rng_cpu": torch.get_rng_state(), "rng_cuda": None}, direct / "trainer_state.pt")
    write = b.checkpoint_snapshot()
    weights = [p.detach().clone() for p in b.model.parameters()]
    train_step(b, samples)  # the next step runs before the write does
    assert any(not torch.equal(w, p) for w, p in zip(weights, b.model.parameters(), strict=True))
    writer = threading.Thread(target=write, args=(background,))
    writer.start()
    writer.join()
    for name in ("model.safetensors", "trainer_state.pt"):
        assert (background / name).read_bytes() == (sync / name).read_bytes(), name
        assert (sync / name).read_bytes() == (direct / name).read_bytes(), name


def _rl_step(model, samples, **options):
    """One `train_step` on a copy of `model`: its metrics, the weights after it, and how many separate old-logprob
    passes (`compute_logprobs` calls) it made."""
    b = backend(copy.deepcopy(model), loss=LossOptions(temperature=0.7, tis_mode="clip"), **options)
    calls = []
    scoring = b.compute_logprobs
    b.compute_logprobs = lambda s, model=None: calls.append(len(s)) or scoring(s, model)
    metrics = train_step(b, samples)
    return metrics, {n: p.detach().clone() for n, p in b.model.named_parameters()}, len(calls)


def test_old_logprobs_from_the_train_forward_are_bit_identical(base_model):
    """One optimizer update per RL step: no separate old-logprob pass, and the step (every metric, the rollout
    logprob distance included, and every weight after it) is bit-identical to the one with the separate pass."""
    samples = make_samples()
    want, want_weights, passes = _rl_step(base_model, samples, micro_batch_max_tokens=24)
    assert passes == 1
    got, weights, passes = _rl_step(
        base_model, samples, micro_batch_max_tokens=24, old_logprobs_from_train_forward=True
    )
    assert passes == 0
    assert want["train/train_rollout_logprob_abs_diff"] > 0.1  # random rollout logprobs: the metric is exercised
    assert got == want
    assert all(torch.equal(weights[n], w) for n, w in want_weights.items())
    assert any(not torch.equal(w, p) for w, p in zip(want_weights.values(), base_model.parameters(), strict=True))


@pytest.mark.parametrize("options", [dict(global_batch_size=2), dict(ppo_epochs=2)], ids=["two_minibatches", "epochs"])
def test_several_updates_per_rl_step_keep_the_separate_old_logprob_pass(base_model, options, caplog, monkeypatch):
    """With more than one optimizer update the later ones run on moved weights: the separate pass still runs and
    the step is the one without the option; a warning (once per process) says the option has no effect and how to
    get one update."""
    import miles_vl.train.step as step

    monkeypatch.setattr(step, "_warned", set())
    samples = make_samples()
    want, want_weights, _ = _rl_step(base_model, samples, **options)
    with caplog.at_level(logging.WARNING, logger="miles_vl.train.step"):
        got, weights, passes = _rl_step(base_model, samples, old_logprobs_from_train_forward=True, **options)
        _rl_step(base_model, samples, old_logprobs_from_train_forward=True, **options)
    assert passes == 1 and got == want
    warned = [r.getMessage() for r in caplog.records if "old_logprobs_from_train_forward" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "makes 2 optimizer updates" in warned[0] and "train.global_batch_size to null" in warned[0]
    assert all(torch.equal(weights[n], w) for n, w in want_weights.items())


def group_samples():
    """make_samples() plus more responses to its image prompts (GRPO's n samples of a prompt): samples 4-6 carry
    sample 0's image and sample 2's two images again (equal values, separate tensors)."""
    import dataclasses

    samples = make_samples()
    g = torch.Generator().manual_seed(1)
    more = []
    for source, response, adv in ((0, [44, 45], -1.0), (0, [46, 47, 48], 0.5), (2, [67, 68], -0.75)):
        s = samples[source]
        more.append(
            dataclasses.replace(
                s,
                input_ids=torch.cat([s.input_ids[: s.prompt_len], torch.tensor(response)]),
                advantage=adv,
                rollout_logprobs=-torch.rand(len(response), generator=g),
                pixel_values=s.pixel_values.clone(),
                image_grid_thw=s.image_grid_thw.clone(),
            )
        )
    return samples + more


@pytest.mark.parametrize("micro_batch_max_tokens", [4096, 40], ids=["one_row", "several_rows"])
def test_vision_once_per_image_gives_todays_loss_and_gradients(base_model, micro_batch_max_tokens):
    """The tower runs on each distinct image of a row once (3 distinct images for 7 uses in one row); the loss and
    every gradient (the vision tower's: the sum over the uses) equal the per-sample path's."""
    samples = group_samples()
    patches = {}
    for once in (False, True):
        b = backend(
            copy.deepcopy(base_model), micro_batch_max_tokens=micro_batch_max_tokens, vision_once_per_image=once
        )
        seen = []
        hook = b.model.model.visual.register_forward_hook(lambda m, args, out, seen=seen: seen.append(args[0].shape[0]))
        metrics, g = grads(b, samples)
        hook.remove()
        patches[once] = sum(seen) // 2  # grads(): the old-logprob pass, then the train forward
        if not once:
            want_metrics, want = metrics, g
    assert patches[False] == 16 * 7
    if micro_batch_max_tokens == 4096:
        assert patches[True] == 16 * 3
    else:
        assert 16 * 3 <= patches[True] < patches[False]
    torch.testing.assert_close(metrics.loss, want_metrics.loss, rtol=1e-6, atol=1e-7)
    assert g.keys() == want.keys() and any("visual" in k for k in g)
    for name in want:
        torch.testing.assert_close(g[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
