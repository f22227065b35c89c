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
