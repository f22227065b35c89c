"""Contract: micro-batch plans respect the padded-token budget, place every sample exactly once, report
their padding honestly, and reject a sample that cannot fit."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_vl.packing import padded_length, plan_micro_batches


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=60), st.integers(1, 8), st.integers(1, 4))
def test_plan_is_a_partition_within_budget(lengths, cp_size, min_mb):
    budget = 1024
    if len(lengths) < min_mb:
        min_mb = 1
    plan = plan_micro_batches(lengths, budget, cp_size=cp_size, min_micro_batches=min_mb)
    placed = sorted(i for mb in plan.micro_batches for i in mb)
    assert placed == list(range(len(lengths)))
    assert plan.num_micro_batches >= min_mb
    padded = [padded_length(n, cp_size) for n in lengths]
    for mb in plan.micro_batches:
        assert sum(padded[i] for i in mb) <= budget
    assert plan.real_tokens == sum(lengths) and plan.padded_tokens == sum(padded)
    # first-fit decreasing never opens a bin while the contents of two bins would fit into one
    if min_mb == 1:
        loads = sorted(sum(padded[i] for i in mb) for mb in plan.micro_batches)
        assert len(loads) < 2 or loads[0] + loads[1] > budget


def test_padding_fraction_is_derived():
    plan = plan_micro_batches([3, 5], 64, cp_size=2)  # padded 4 and 8
    assert plan.padded_tokens == 12 and plan.padding_fraction == pytest.approx(4 / 12)


def test_sample_over_budget_is_named():
    with pytest.raises(ValueError, match="sample 1 needs 104 tokens .* budget is 100; raise train.micro_batch"):
        plan_micro_batches([10, 101], 100, cp_size=4)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(2, 500), st.floats(0.0, 1.0)), min_size=1, max_size=60),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(250, 1500),
)
def test_a_second_budget_holds_in_every_micro_batch_beside_the_tokens(samples, cp_size, min_mb, max_rows):
    """`loss_rows` / `max_loss_rows` (the megatron trainer's loss positions a rank against the train logits' limit):
    every micro-batch sums to at most `max_loss_rows` and fits the tokens, every sample is placed once, and no two
    micro-batches could have been one under both budgets."""
    budget = 1024
    lengths = [n for n, _ in samples]
    rows = [min(int(n * share), 250) for n, share in samples]  # each sample alone fits (max_rows >= 250)
    min_mb = min(min_mb, len(lengths))
    plan = plan_micro_batches(
        lengths, budget, cp_size=cp_size, min_micro_batches=min_mb, loss_rows=rows, max_loss_rows=max_rows
    )
    assert sorted(i for mb in plan.micro_batches for i in mb) == list(range(len(lengths)))
    padded = [padded_length(n, cp_size) for n in lengths]
    for mb in plan.micro_batches:
        assert sum(padded[i] for i in mb) <= budget and sum(rows[i] for i in mb) <= max_rows
    if min_mb == 1:  # first fit: a bin was opened only when an earlier one had no room in one budget or the other
        for a in range(len(plan.micro_batches)):
            for b in range(a + 1, len(plan.micro_batches)):
                both = plan.micro_batches[a] + plan.micro_batches[b]
                assert sum(padded[i] for i in both) > budget or sum(rows[i] for i in both) > max_rows


def test_the_second_budget_splits_what_the_tokens_alone_would_put_together():
    """Four samples of 100 tokens fit one 1,024-token micro-batch; with 60 loss rows each and at most 100 a
    micro-batch, each goes alone: the second budget, not the first, decides."""
    assert plan_micro_batches([100] * 4, 1024).num_micro_batches == 1
    plan = plan_micro_batches([100] * 4, 1024, loss_rows=[60] * 4, max_loss_rows=100)
    assert plan.micro_batches == [[0], [1], [2], [3]]
    assert plan_micro_batches([100] * 4, 1024, loss_rows=[50] * 4, max_loss_rows=100).num_micro_batches == 2


def test_a_sample_over_the_second_budget_is_named_and_the_budgets_go_together():
    with pytest.raises(ValueError, match=r"sample 1 adds 101 loss rows, more than one micro-batch may hold \(100\)"):
        plan_micro_batches([10, 200], 1024, loss_rows=[5, 101], max_loss_rows=100)
    with pytest.raises(ValueError, match="go together"):
        plan_micro_batches([10], 1024, loss_rows=[5])
    with pytest.raises(ValueError, match="go together"):
        plan_micro_batches([10, 20], 1024, loss_rows=[5], max_loss_rows=100)
