"""Contracts of the megatron backend's pure parts (no megatron import): vocab-parallel logprobs, the data-parallel
plan, the loss inputs of a CP shard."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_vl.algo import loss_denominators, loss_token_weights, sequence_loss_tokens
from miles_vl.packing import pack_thd, padded_length, zigzag_index
from miles_vl.train.megatron.batch import attach_loss_inputs, pack_micro_batch, sample_loss_rows, sample_loss_tokens
from miles_vl.train.megatron.plan import (
    MicroBatchSpec,
    forward_only_max_tokens,
    plan_data_parallel,
    split_for_data_parallel,
)
from miles_vl.train.types import TrainSample
from tests.train.megatron.jobs import assert_vocab_parallel_matches, vocab_parallel_case


def test_vocab_parallel_logprobs_equal_the_plain_log_softmax():
    """One rank holding the whole vocabulary (the TP=2 case runs inside the megatron ranks, see
    test_megatron_backend.py): logprobs, entropy and the gradient of the logits equal a log_softmax over the whole
    temperature-scaled vocabulary without the suppressed ids and megatron's padding."""
    assert_vocab_parallel_matches([vocab_parallel_case(0, 1, None)])


def test_split_for_data_parallel_is_equal_and_balanced():
    lengths = [50, 10, 40, 10, 30, 20, 20, 60]
    shares = split_for_data_parallel(lengths, 2)
    assert sorted(i for s in shares for i in s) == list(range(8))
    assert [len(s) for s in shares] == [4, 4]
    totals = [sum(lengths[i] for i in s) for s in shares]
    assert abs(totals[0] - totals[1]) <= 20
    assert [len(s) for s in split_for_data_parallel(lengths[:5], 2)] == [3, 2]


def test_plan_gives_every_dp_rank_the_same_number_of_micro_batches():
    lengths = [60, 60, 60, 5]  # rank 0 gets two long samples (2 micro-batches), rank 1 fits in one
    plans = plan_data_parallel(lengths, dp_size=2, max_tokens=64, cp_size=1)
    assert len(plans[0]) == len(plans[1]) == 2
    real = sorted(i for plan in plans for spec in plan if not spec.dummy for i in spec.samples)
    assert real == [0, 1, 2, 3] and not any(spec.dummy for plan in plans for spec in plan)
    # fewer samples than micro-batches on one rank (forward only): a dummy repeats one of its samples
    plans = plan_data_parallel([60, 60, 5], dp_size=2, max_tokens=64, cp_size=1)
    assert [len(p) for p in plans] == [2, 2]
    assert sum(spec.dummy for plan in plans for spec in plan) == 1
    with pytest.raises(ValueError, match="budget"):
        plan_data_parallel([100], dp_size=1, max_tokens=64)


def _tokens():
    from tests.train.megatron.jobs import tokens

    return tokens()


def _samples():
    from tests.train.megatron.jobs import train_samples

    samples = train_samples(0)[:3]
    mask = torch.zeros(samples[2].input_ids.numel(), dtype=torch.long)
    mask[samples[2].prompt_len + 1 :: 2] = 1  # a custom loss mask on the last sample
    samples[2].loss_mask = mask
    return samples


def test_loss_inputs_of_cp_shards_cover_the_full_row_once():
    """Over the CP ranks the local label positions are the full row's, with the full row's weights and the
    per-sample arrays read at the right response index."""
    samples = _samples()
    spec = MicroBatchSpec([0, 1, 2])
    counts = torch.tensor([sample_loss_tokens(s) for s in samples])
    full = pack_thd(
        samples, pad_token_id=0, spatial_merge_size=2, image_token_id=90, video_token_id=91, vision_start_token_id=92
    )
    assert torch.equal(counts, sequence_loss_tokens(full.label_mask, full.sample_index, 3))
    den = loss_denominators(counts)
    old = [torch.arange(s.response_len, dtype=torch.float32) + 100 * i for i, s in enumerate(samples)]
    weights_full = loss_token_weights(full.label_mask, full.sample_index, counts, den, reduction="seq_mean_token_mean")
    seen = []
    for rank in range(2):
        mb = pack_micro_batch(samples, spec, tokens=_tokens(), spatial_merge_size=2, cp_size=2, cp_rank=rank)
        mb = attach_loss_inputs(mb, samples, old, None, den, reduction="seq_mean_token_mean")
        li = mb.loss
        full_pos = zigzag_index(mb.packed.cu_seqlens, 2, rank)[li.positions]
        seq_start = mb.packed.cu_seqlens[:-1].long()[li.sample]
        resp_idx = full_pos + 1 - seq_start - mb.packed.prompt_lens[li.sample]
        assert torch.equal(li.old_logprobs, (resp_idx + 100 * li.sample).float())
        assert torch.allclose(li.weights, weights_full[_full_positions(full, mb, full_pos)])
        seen += [(int(s), int(r)) for s, r in zip(li.sample, resp_idx, strict=True)]
    want = [
        (i, j - s.prompt_len) for i, s in enumerate(samples) for j in range(1, s.input_ids.numel()) if _has_loss(s, j)
    ]
    assert sorted(seen) == sorted(want)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_a_samples_loss_rows_are_its_largest_share_of_loss_positions_on_a_cp_rank(cp):
    """`sample_loss_rows(s, C)`, what the micro-batch plan adds up against the train logits' limit, is the most loss
    positions the packed shard of any CP rank holds of that sample, counted from `attach_loss_inputs`' own positions
    of a micro-batch of six samples (custom loss masks, one short with most of its tokens in the loss, one without a
    prompt)."""
    samples = _samples()
    short = TrainSample(input_ids=torch.arange(3, 9), prompt_len=1, advantage=1.0, rollout_logprobs=torch.zeros(5))
    no_prompt = TrainSample(
        input_ids=torch.arange(10, 22), prompt_len=0, advantage=1.0, rollout_logprobs=torch.zeros(12)
    )
    # loss on tokens 4 and 13 only: label positions 3 and 12, on one CP rank at C = 2 and 4 (read a
    # position off: 4 and 13, on two ranks)
    edges = torch.zeros(16, dtype=torch.long)
    edges[[4, 13]] = 1
    edge = TrainSample(
        input_ids=torch.arange(30, 46), prompt_len=2, advantage=1.0, rollout_logprobs=torch.zeros(14), loss_mask=edges
    )
    samples += [short, no_prompt, edge]
    spec = MicroBatchSpec(list(range(len(samples))))
    counts = torch.tensor([sample_loss_tokens(s) for s in samples])
    den = loss_denominators(counts)
    held = torch.zeros(cp, len(samples), dtype=torch.long)
    for rank in range(cp):
        mb = pack_micro_batch(samples, spec, tokens=_tokens(), spatial_merge_size=2, cp_size=cp, cp_rank=rank)
        mb = attach_loss_inputs(mb, samples, None, None, den, reduction="seq_mean_token_mean")
        held[rank] = torch.bincount(mb.loss.sample, minlength=len(samples))
    assert torch.equal(held.sum(0), counts)
    assert [sample_loss_rows(s, cp) for s in samples] == held.max(0).values.tolist()
    if cp > 1:  # shares differ between ranks: the largest is what a micro-batch must leave room for
        assert (held.max(0).values > held.min(0).values).any()


def test_the_plan_keeps_each_micro_batchs_loss_rows_under_the_limit_on_every_dp_rank():
    """`plan_data_parallel` with the second budget: every DP rank's micro-batches stay under it, the counts stay
    equal across ranks, and the limit (not the tokens) is what splits them."""
    lengths, rows = [60, 60, 60, 60], [40, 40, 40, 40]
    assert [len(p) for p in plan_data_parallel(lengths, dp_size=2, max_tokens=256)] == [1, 1]
    plans = plan_data_parallel(lengths, dp_size=2, max_tokens=256, loss_rows=rows, max_loss_rows=79)
    assert [len(p) for p in plans] == [2, 2]
    for plan in plans:
        assert all(sum(rows[i] for i in spec.samples) <= 79 for spec in plan)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 4), st.integers(1, 200))
def test_the_forward_only_pass_stays_within_the_logits_rows_or_one_samples_row(lengths, cp, max_rows):
    """With `logits_only_where_loss` the forward-only logprob pass still forms every position's logits: under
    `forward_only_max_tokens` no micro-batch has more rows a rank (its padded tokens / C) than `max_rows` or than
    the longest sample alone forms, and the budget never passes `micro_batch_max_tokens`."""
    mbt = 1024
    budget = forward_only_max_tokens(mbt, lengths, cp_size=cp, max_rows=max_rows)
    assert budget <= mbt
    padded = [padded_length(n, cp) for n in lengths]
    bound = max(max_rows, max(padded) // cp)
    for plan in plan_data_parallel(lengths, dp_size=1, max_tokens=budget, cp_size=cp):
        for spec in plan:
            assert sum(padded[i] for i in spec.samples) // cp <= bound
    if max(padded) // cp <= max_rows < mbt // cp:  # the rows, not micro_batch_max_tokens, bound the pass
        assert budget == cp * max_rows


def _full_positions(full, mb, cp_full_pos):
    """Map positions of the CP-padded row to the same token in the cp_size=1 row."""
    cu2, cu1 = mb.packed.cu_seqlens.long(), full.cu_seqlens.long()
    seg = torch.bucketize(cp_full_pos, cu2[1:], right=True)
    return cp_full_pos - cu2[seg] + cu1[seg]


def _has_loss(sample: TrainSample, j: int) -> bool:
    if sample.loss_mask is not None:
        return bool(sample.loss_mask[j])
    return j >= sample.prompt_len


# ----------------------------------------------------------------------------------------------------------------
# GSPO at CP=2: a sample's tokens lie on both CP ranks, so its sequence ratio needs the CP all-reduce of the loss func

VOCAB_GSPO = 97


def _gspo_tables(samples) -> list[torch.Tensor]:
    """Stand-in logits: one leaf [L_i, V] per sample (row j scores token j+1 of the sample)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randn(s.input_ids.numel(), VOCAB_GSPO, generator=g).requires_grad_() for s in samples]


def _gspo_old(samples) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    return [-torch.rand(s.response_len, generator=g) for s in samples]


def _gspo_cp_worker(rank: int, world_size: int) -> dict:
    """One CP rank: `train_loss_func` on this rank's zigzag shard of stand-in logits; its loss and table gradients."""
    import torch.distributed as dist

    from miles_vl.train.megatron.parallel import ParallelGroups
    from miles_vl.train.megatron.step import ForwardOptions, train_loss_func
    from miles_vl.train.types import LossOptions

    singles = [dist.new_group([r]) for r in range(world_size)]  # collective: every rank makes every group
    me = singles[rank]
    groups = ParallelGroups(tp=me, cp=dist.group.WORLD, dp=me, dp_cp=dist.group.WORLD, pp=me)
    samples = _samples()
    tables = _gspo_tables(samples)
    den = loss_denominators(torch.tensor([sample_loss_tokens(s) for s in samples]))
    mb = pack_micro_batch(
        samples, MicroBatchSpec([0, 1, 2]), tokens=_tokens(), spatial_merge_size=2, cp_size=2, cp_rank=rank
    )
    mb = attach_loss_inputs(mb, samples, _gspo_old(samples), None, den, reduction="seq_mean_token_mean")
    cu = mb.packed.cu_seqlens.long()
    row = torch.zeros(int(cu[-1]), VOCAB_GSPO)
    rows = [row[: int(cu[0])]]
    for i, t in enumerate(tables):  # each sample's logits at its span of the CP-padded row, zeros on the padding
        pad = int(cu[i + 1] - cu[i]) - t.shape[0]
        rows += [t, torch.zeros(pad, VOCAB_GSPO)]
    full = torch.cat(rows)  # [T, V]
    local = full[zigzag_index(mb.packed.cu_seqlens, 2, rank)]  # [T/2, V]
    loss = LossOptions(policy_loss_type="gspo", reduction="seq_mean_token_mean")
    options = ForwardOptions(mode="train", groups=groups, device="cpu", loss=loss, vocab_size=VOCAB_GSPO)
    out, _, _ = train_loss_func(options, mb, local[None])
    out.backward()
    return {"loss": out.item(), "grads": [t.grad for t in tables]}


def test_gspo_over_cp_ranks_equals_the_paper_objective():
    """The sum over the two CP ranks of megatron's train loss equals GSPO written out per sample (geometric-mean
    ratio over the whole response, sequence clip, mean over samples), in value and gradient. Without the all-reduce
    each rank would use the mean over its half of the response."""
    from tests.dist import run_gloo

    samples = _samples()
    ranks = run_gloo(_gspo_cp_worker, 2)
    tables, old = _gspo_tables(samples), _gspo_old(samples)
    total = 0.0
    for s, t, o in zip(samples, tables, old, strict=True):
        logp = torch.log_softmax(t[:-1], -1).gather(1, s.input_ids[1:, None]).squeeze(1)  # token j+1 given j
        on = torch.tensor([_has_loss(s, j) for j in range(1, s.input_ids.numel())])
        resp = torch.arange(1, s.input_ids.numel()) - s.prompt_len  # response index of each label
        ratio = torch.exp((logp[on] - o[resp[on]]).mean())
        total = total + torch.maximum(-s.advantage * ratio, -s.advantage * ratio.clamp(0.8, 1.28))
    total = total / len(samples)
    total.backward()
    assert sum(r["loss"] for r in ranks) == pytest.approx(total.item(), abs=1e-6)
    for i, t in enumerate(tables):
        torch.testing.assert_close(ranks[0]["grads"][i] + ranks[1]["grads"][i], t.grad, rtol=1e-5, atol=1e-7)


def test_to_device_pins_and_skips_the_wait_only_for_a_cuda_target(monkeypatch):
    """`train.pinned_input_copies`: a CPU tensor bound for CUDA is pinned and copied with non_blocking=True (torch's
    plain copy from pageable memory synchronizes the stream: the 2B train phase's device sat idle 58 % of it,
    docs/benchmarks.md); without the key, or to the CPU, the copy is torch's plain one. Recorded on stand-ins of
    Tensor.pin_memory and Tensor.to (this machine has no GPU; the loop's A/B is scripts/gpu/plans/owed.sh p8)."""
    from miles_vl.train.megatron.batch import to_device

    calls = []
    real_to = torch.Tensor.to

    def pin_memory(self):
        calls.append("pin")
        return self.clone()

    def to(self, *args, **kwargs):
        calls.append(("to", str(args[0]), kwargs.get("non_blocking", False)))
        return real_to(self, "cpu") if str(args[0]).startswith("cuda") else real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    t = torch.arange(6)
    for device, pinned, expected in [
        ("cuda", True, ["pin", ("to", "cuda", True)]),
        (torch.device("cuda", 1), True, ["pin", ("to", "cuda:1", True)]),
        ("cuda", False, [("to", "cuda", False)]),
        ("cpu", True, [("to", "cpu", False)]),
    ]:
        calls.clear()
        assert torch.equal(to_device(t, device, pinned=pinned), t)
        assert calls == expected, (device, pinned, calls)


def _routed_worker(rank: int, world_size: int) -> dict:
    """With `pinned_input_copies`, every tensor of a micro-batch that the forward and the loss take to the device
    passes through `to_device` with pinned=True: a stand-in records each one (the CPU is the device here)."""
    import torch.distributed as dist

    from miles_vl.train.megatron import batch, step
    from miles_vl.train.megatron.parallel import ParallelGroups
    from miles_vl.train.types import LossOptions

    me = dist.group.WORLD
    groups = ParallelGroups(tp=me, cp=me, dp=me, dp_cp=me, pp=me)
    samples = _samples()
    den = loss_denominators(torch.tensor([sample_loss_tokens(s) for s in samples]))
    mb = pack_micro_batch(
        samples, MicroBatchSpec([0, 1, 2]), tokens=_tokens(), spatial_merge_size=2, cp_size=1, cp_rank=0
    )
    mb = attach_loss_inputs(mb, samples, _gspo_old(samples), None, den, reduction="seq_mean_token_mean")
    sources, outputs = [], []

    def recorder(t, device, *, pinned=False):
        assert pinned, "a tensor went to the device without the key's pinned copy"
        sources.append(t)
        outputs.append(t.to(device).clone())
        return outputs[-1]

    kwargs_plain = batch.model_inputs(mb, "cpu")
    batch.to_device = step.to_device = recorder
    kwargs = batch.model_inputs(mb, "cpu", pinned=True)
    tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)] + [kwargs["packed_seq_params"].cu_seqlens_q]
    forward_routed = all(any(t is o for o in outputs) for t in tensors) and len(tensors) >= 4
    forward_equal = all(torch.equal(kwargs[k], kwargs_plain[k]) for k in kwargs if isinstance(kwargs[k], torch.Tensor))
    logits = torch.randn(mb.shard.input_ids.shape[1], VOCAB_GSPO, generator=torch.Generator().manual_seed(1))
    loss = LossOptions(reduction="seq_mean_token_mean")
    results = {}
    for pinned in (False, True):
        sources.clear()
        options = step.ForwardOptions(
            mode="train", groups=groups, device="cpu", loss=loss, vocab_size=VOCAB_GSPO, pinned_input_copies=pinned
        )
        if not pinned:
            step.to_device = batch.to_device = lambda t, device, *, pinned=False: t.to(device)
        else:
            step.to_device = recorder
        value, count, _ = step.train_loss_func(options, mb, logits[None])
        results[pinned] = (value.item(), int(count))
    li = mb.loss
    wanted = [li.positions, mb.shard.labels[0], li.advantages, li.weights, li.rollout_logprobs, li.old_logprobs]
    loss_routed = all(any(w.data_ptr() == s.data_ptr() and w.shape == s.shape for s in sources) for w in wanted)
    return {"forward_routed": forward_routed, "forward_equal": forward_equal, "loss_routed": loss_routed,
            "results": results}  # fmt: skip


def test_with_pinned_input_copies_every_tensor_goes_through_to_device():
    from tests.dist import run_gloo

    (out,) = run_gloo(_routed_worker, 1)
    assert out["forward_routed"] and out["forward_equal"]
    assert out["loss_routed"]
    assert out["results"][True] == out["results"][False]  # the same loss and token count: the count filled on device
