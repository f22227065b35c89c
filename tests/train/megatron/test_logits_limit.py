"""Contract (issue 32): the megatron backend refuses a train forward whose logits on some rank would have
`step.MAX_TRAIN_LOGITS_ELEMENTS` (2^31) elements or more, before that forward runs, on every rank alike, with one
message that names the rows, V/TP, their product, the limit, the symptom it avoids and the fixes; the rows are the
local row T/C, or the loss positions with `logits_only_where_loss`. On the CPU harness (two gloo ranks: DP 2, CP 2,
TP 2) with the limit lowered to exactly what a layout forms (refused) and one element above it (trains). With
`logits_only_where_loss` the micro-batch plan keeps each micro-batch's loss positions under the limit (a second budget
beside the tokens, `batch.sample_loss_rows` a sample): at the limit a step whose samples each fit it trains in more,
smaller train forwards, every one under the limit; one whose single sample reaches it is refused, naming one sample's
loss positions.
"""

from __future__ import annotations

import pytest

from miles_vl.packing import padded_length
from miles_vl.train.megatron import step
from miles_vl.train.megatron.batch import sample_loss_rows
from tests.train.megatron import cpu_parts, jobs

LAYOUTS = jobs.TWO_RANK_LAYOUTS


pytestmark = pytest.mark.usefixtures("megatron_bridge")


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    # a text sample of 15 tokens and an image sample of 22: under DP 2 each rank trains one (rows 16 and 22), under CP 2
    # the two ranks hold different numbers of loss positions. A rank that went on alone would wait in a collective:
    # the spawn's bound ends such a run instead of a hang.
    return cpu_parts.spawn(jobs.job_train_logits_limit, 2, args=(jobs.train_samples()[:2], LAYOUTS), timeout_s=240)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("only", [False, True], ids=["full_logits", "logits_only_where_loss"])
def test_train_logits_at_the_limit_are_refused_before_the_forward_on_every_rank(runs, layout, only):
    name = "only" if only else "full"
    largest = max(rank[layout][name]["rows"] for rank in runs)
    # the most loss positions one sample may put on a rank (its loss tokens, at most its padded length / C)
    one_sample = max(sample_loss_rows(s, LAYOUTS[layout]["cp"]) for s in jobs.train_samples()[:2])
    refused = not only or one_sample >= largest  # else the plan splits the micro-batch under the limit
    for rank in runs:
        run = rank[layout][name]
        vocab = run["vocab"]
        assert run["largest"] == largest  # every rank decides on the largest rows of any rank
        at, above = run["at"], run["above"]
        what = "loss positions" if only else "tokens"
        if refused:  # on every rank (the DP ranks' own rows differ: the all-reduce, or the shared plan, makes them
            # agree), before any train forward reached the output layer
            rows = one_sample if only else largest
            assert at["error"] is not None and at["train_rows"] == []
            assert f"{rows:,} {what}" in at["error"]
            assert f"x {vocab:,} vocabulary entries (vocab 96 / train.tp={96 // vocab})" in at["error"]
            assert f"= {rows * vocab:,} elements, at or past the limit of {largest * vocab:,}" in at["error"]
            assert "`CUDA error: invalid argument`" in at["error"]
            assert f"at most {largest - 1:,} {what}" in at["error"]
            first_fix = "lower rollout.max_response_len" if only else "set train.logits_only_where_loss=true"
            assert at["error"].split(": ")[-1].startswith(first_fix)
            if only:
                assert "one sample's loss positions on a rank, which no micro-batch plan can split" in at["error"]
        else:  # trained, in more train forwards than at the real limit, each under the lowered one
            assert at["error"] is None and len(at["train_rows"]) > len(above["train_rows"])
            assert at["metrics"]["train/micro_batches"] == len(at["train_rows"])  # the step reports its forwards
            assert max(at["train_rows"]) < largest
            # the forward-only logprob pass (every position's logits) is cut under the lowered limit too, but for a
            # sample whose row alone is longer (`forward_only_max_tokens`)
            cp = LAYOUTS[layout]["cp"]
            one_row = max(padded_length(s.input_ids.numel(), cp) for s in jobs.train_samples()[:2]) // cp
            assert at["eval_rows"] and max(at["eval_rows"]) <= max(largest - 1, one_row)
            assert max(at["eval_rows"]) < max(run["measured_eval_rows"])  # at the real limit: one pass, both samples
            # the same step: the loss and the gradient do not depend on how the samples are cut into micro-batches
            for key in ("train/loss", "train/grad_norm", "train/n_loss_tokens"):
                assert at["metrics"][key] == pytest.approx(above["metrics"][key], rel=1e-5, abs=1e-7), key
        # one element more and the same step trains, its largest train forward exactly at the measured rows
        assert above["error"] is None and above["train_rows"] and max(above["train_rows"]) == run["rows"]
        assert above["metrics"]["train/micro_batches"] == len(above["train_rows"])
    if layout == "dp2" or (layout, name) == ("cp2", "only"):  # the all-reduce's case: one rank's own rows would pass
        assert min(rank[layout][name]["rows"] for rank in runs) < largest


def test_logits_only_where_loss_forms_fewer_rows_than_the_local_row(runs):
    """The fix the message offers first: the same step's loss positions are fewer than its local rows."""
    for rank in runs:
        for layout in LAYOUTS:
            assert rank[layout]["only"]["rows"] < rank[layout]["full"]["rows"]


def test_the_message_at_the_real_sizes():
    """The numbers of the failing GPU jobs (issue 32): 16,384 tokens a rank (32K at CP=2, 64K at CP=4) x 151,936 =
    2,489,319,424 elements, past 2^31 = 2,147,483,648; 14,134 x 151,936 = 2,147,463,424 is the most that passes."""
    assert step.MAX_TRAIN_LOGITS_ELEMENTS == 2**31
    full = step.train_logits_problem(16384, 151936, 1, logits_only_where_loss=False, tokens_from="32768 / cp 2")
    assert full is not None
    assert "16,384 tokens (32768 / cp 2) x 151,936 vocabulary entries (vocab 151,936 / train.tp=1)" in full
    assert "= 2,489,319,424 elements, at or past the limit of 2,147,483,648" in full
    assert "at most 14,134 tokens" in full
    assert step.train_logits_problem(14134, 151936, 1, logits_only_where_loss=False, tokens_from="") is None
    assert step.train_logits_problem(14135, 151936, 1, logits_only_where_loss=False, tokens_from="") is not None
    # TP splits the vocabulary: 16,384 x 75,968 = 1.24e9, what the 8K-token runs trained with at TP=1
    assert step.train_logits_problem(16384, 151936, 2, logits_only_where_loss=False, tokens_from="") is None
