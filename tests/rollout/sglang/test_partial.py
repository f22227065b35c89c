"""Partial rollouts on the SGLang engine (issue 34, item 2): `pause_generation` before a weight sync aborts the
requests in flight (`/abort_request {"abort_all": true}`) and keeps what they generated; `continue_generation` after
it sends each kept sample again as prompt + tokens so far, with its images, for the remaining max_new_tokens, under
the new weights. The sample is one generation: span 1 + span 2, each span's logprobs those its weights' server
returned, `Generation.spans` naming the version of each. A sample whose first span ended with EOS or reached
max_new_tokens is finished there; an abort the engine did not ask for is sent again from the start, as before.

The stand-in answers an abort as 0.5.16 does (fake_server.py `Handler._hold`, checked on a real server by
tests/gpu/test_sglang_real.py::test_an_aborted_request_returns_its_output_so_far): everything here waits on its
events (a sample reached its hold; the abort arrived), never on time.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading

import pytest
import torch

from miles_vl.algo import tis_weights, to_train_samples
from miles_vl.rollout.sglang import EngineStateError
from miles_vl.rollout.sglang.generate import sampling_seed
from miles_vl.rollout.types import SamplingParams
from tests.rollout.sglang.conftest import EOS, MAX_PIXELS, MIN_PIXELS, make_prompt
from tests.rollout.sglang.fake_server import FakeSGLang, Fault, fake_tokens
from tests.rollout.sglang.test_engine import engine, generate_bodies

HOLD = 3  # the stand-in stops a held sample after HOLD tokens; the abort's extra decode step makes HOLD + 1


@pytest.fixture
def fake():
    """--enable-deterministic-inference: each answer is a function of the prompt, the seed and the weights, so the
    tests can say which tokens each span must hold."""
    with FakeSGLang(weight_version="base", image_min_pixels=MIN_PIXELS, image_max_pixels=MAX_PIXELS,
                    deterministic=True) as server:  # fmt: skip
        yield server


def sampling(seed: int, max_new: int, n: int = 1) -> dict:
    """The sampling params the stand-in sees for sample 0 of prompt 0 (what `fake_tokens` draws from)."""
    return {"max_new_tokens": max_new, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [EOS],
            "sampling_seed": sampling_seed(seed, 0, 0, n)}  # fmt: skip


def drawn(prompt, seed: int, max_new: int, version: str, prefix: tuple = (), n: int = 1) -> list[int]:
    """What the stand-in generates for prompt 0 (+ `prefix`) with these settings."""
    return fake_tokens(prompt.prompt_ids.tolist() + list(prefix), sampling(seed, max_new, n), version)[0]


def seed_where(prompt, max_new: int, ok) -> int:
    """The first seed whose draw under "base" satisfies `ok` (the stand-in is deterministic: no flakiness)."""
    return next(s for s in range(1000) if ok(drawn(prompt, s, max_new, "base")))


def wait_held(fake, samples: int) -> None:
    """Until `samples` samples are decoding at their hold (the stand-in's event)."""
    with fake.state.aborted:
        assert fake.state.aborted.wait_for(lambda: fake.state.held >= samples, timeout=30)


def sync(fake, eng, version: str) -> None:
    """A weight sync as the trainer's NCCL path ends one: the server's label, then the engine's."""
    eng.client.post_json("/update_weight_version", {"new_version": version})
    eng.expect_weight_version(version)


def across_a_sync(fake, eng, prompt, params: SamplingParams, version: str = "v1") -> tuple[list, int]:
    """Generate `prompt` while a sync happens: once a sample holds (the stand-in's event), pause the engine (the
    abort), label `version`, continue; returns (the prompt's group, what pause_generation returned)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(eng.generate, [prompt], params)
        wait_held(fake, 1)
        in_flight = eng.pause_generation()
        sync(fake, eng, version)
        eng.continue_generation()
        [group] = answer.result(timeout=30)
    return group, in_flight


def generate_in_a_daemon(eng, prompt, params: SamplingParams) -> concurrent.futures.Future:
    """`eng.generate([prompt], params)` in a daemon thread, its answer (or error) in the future: a generation that
    waits forever fails the test at the future's timeout instead of hanging it at exit."""
    answer: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            answer.set_result(eng.generate([prompt], params)[0])
        except BaseException as e:  # noqa: BLE001 (handed to the test through the future)
            answer.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return answer


class Gate(threading.Condition):
    """The engine's gate, telling when a thread found it closed (an event, so the test needs no sleep)."""

    def __init__(self):
        super().__init__()
        self.blocked = threading.Event()

    def wait_for(self, predicate, timeout=None):
        if not predicate():
            self.blocked.set()
        return super().wait_for(predicate, timeout)


def test_an_aborted_sample_is_continued_under_the_new_weights_as_one_generation(fake):
    """Span 1 (HOLD + 1 tokens of "base") + span 2 (the rest, drawn by "v1" from prompt + span 1): one generation,
    its logprobs each span's own, its spans ((0, 4, base), (4, R, v1)); the continuation carries the prompt's image
    again and asks for the remaining tokens only."""
    prompt = make_prompt([11, 12], 1, color=1)
    max_new = 40
    seed = seed_where(prompt, max_new, lambda out: len(out) > HOLD + 1)
    eng = engine(fake, deterministic=True, partial_rollouts=True)
    fake.inject("/generate", "hold", HOLD)
    [g], in_flight = across_a_sync(fake, eng, prompt, SamplingParams(n=1, max_new_tokens=max_new, seed=seed))
    assert in_flight == 1

    first = fake_tokens(prompt.prompt_ids.tolist(), sampling(seed, max_new), "base")
    span1, span1_logprobs = first[0][: HOLD + 1], first[1][: HOLD + 1]
    second = fake_tokens(prompt.prompt_ids.tolist() + span1, sampling(seed, max_new - len(span1)), "v1")
    assert g.response_ids.tolist() == span1 + second[0]
    assert torch.equal(g.logprobs, torch.tensor(span1_logprobs + second[1], dtype=torch.float32))
    assert g.spans == ((0, HOLD + 1, "base"), (HOLD + 1, HOLD + 1 + len(second[0]), "v1"))
    assert g.finish_reason == ("stop" if second[0][-1] == EOS else "length")

    bodies = generate_bodies(fake)
    assert len(bodies) == 2
    assert bodies[1]["input_ids"] == bodies[0]["input_ids"] + span1  # prompt + the tokens so far
    assert bodies[1]["image_data"] == bodies[0]["image_data"] and len(bodies[1]["image_data"]) == 1
    assert bodies[1]["sampling_params"]["max_new_tokens"] == max_new - len(span1)
    assert [c["body"] for c in fake.calls if c["path"] == "/abort_request"] == [{"abort_all": True}]


def test_every_sample_of_a_group_request_is_kept_and_continued(fake):
    """n = 3 samples in one request (SGLang gives the copies rids of its own: abort_all reaches them): all three are
    aborted at their hold and each is continued alone, none lost, none generated again from the start."""
    prompt = make_prompt([21, 22], 1, color=2)
    max_new, n = 40, 3
    eng = engine(fake, one_request_per_prompt=True, partial_rollouts=True)  # the stand-in honours the shared seed
    seed = next(s for s in range(1000) if len(drawn(prompt, s, max_new, "base", n=n)) > HOLD + 1)
    fake.inject("/generate", "hold", HOLD, times=n)
    # the first copy holds; the other two reach their hold after the abort: aborted at once
    group, in_flight = across_a_sync(fake, eng, prompt, SamplingParams(n=n, max_new_tokens=max_new, seed=seed))
    assert in_flight == 1  # one request in flight, three samples

    span1 = drawn(prompt, seed, max_new, "base", n=n)[: HOLD + 1]
    assert len(group) == n
    bodies = generate_bodies(fake)
    assert len(bodies) == 1 + n  # the group, then one continuation per sample
    for j, (g, body) in enumerate(zip(group, bodies[1:], strict=True)):
        assert body["input_ids"][-len(span1) :] == span1
        rest = fake_tokens(
            prompt.prompt_ids.tolist() + span1,
            {**sampling(seed, max_new - len(span1)), "sampling_seed": sampling_seed(seed, 0, j, n)},
            "v1",
        )[0]
        assert g.response_ids.tolist() == span1 + rest
        assert g.spans == ((0, HOLD + 1, "base"), (HOLD + 1, HOLD + 1 + len(rest), "v1"))


def test_the_importance_weights_use_each_spans_own_behaviour_logprobs(fake):
    """A continued sample trains with the logprobs of the engine that produced each token: with b_t = the "base"
    server's logprob for t < 4 (span 1) and the "v1" server's for t >= 4 (span 2), and old_t the trainer's, the
    importance weight of token t is w_t = min(exp(old_t - b_t), cap) (clip) and, masked, w_t = exp(old_t - b_t) if
    that is <= cap else 0."""
    prompt = make_prompt([51, 52], 1, color=5)
    max_new = 40
    seed = seed_where(prompt, max_new, lambda out: len(out) > HOLD + 1)
    eng = engine(fake, deterministic=True, partial_rollouts=True)
    fake.inject("/generate", "hold", HOLD)
    [g], _ = across_a_sync(fake, eng, prompt, SamplingParams(n=1, max_new_tokens=max_new, seed=seed))
    first = fake_tokens(prompt.prompt_ids.tolist(), sampling(seed, max_new), "base")
    span1 = first[0][: HOLD + 1]
    second = fake_tokens(prompt.prompt_ids.tolist() + span1, sampling(seed, max_new - len(span1)), "v1")
    behaviour = first[1][: HOLD + 1] + second[1]  # b_t, span by span, as each server returned them

    reward = type("Reward", (), {"overall": 1.0})()
    [sample], _ = to_train_samples([prompt], [[g]], [[reward]], estimator="grpo", norm_adv_by_std=False)
    old = torch.linspace(-3.0, -0.1, sample.response_len)  # the trainer's logprobs of the same tokens
    cap = 1.5
    clipped, capped = tis_weights(old, sample.rollout_logprobs, mode="clip", cap=cap)
    masked, _ = tis_weights(old, sample.rollout_logprobs, mode="mask", cap=cap)
    for t in range(sample.response_len):
        ratio = math.exp(float(old[t]) - float(torch.tensor(behaviour[t], dtype=torch.float32)))
        assert float(clipped[t]) == pytest.approx(min(ratio, cap), rel=1e-5)
        assert float(masked[t]) == pytest.approx(ratio if ratio <= cap else 0.0, rel=1e-5)
        assert bool(capped[t]) == (ratio > cap)
    assert 0 < int(capped.sum()) < sample.response_len  # both branches of the formula are exercised


@pytest.mark.parametrize("ending", ["eos", "max_new_tokens"])
def test_a_sample_that_ended_in_its_first_span_is_not_continued(fake, ending):
    """The abort's extra decode step emitted EOS, or reached max_new_tokens: the sample is finished (stop / length)
    with its one span; no continuation is sent."""
    prompt = make_prompt([31, 32], 1, color=3)
    if ending == "eos":  # a draw ending with EOS after HOLD + 1 tokens: held, it comes back whole, as an abort
        max_new = 40
        seed = seed_where(prompt, max_new, lambda out: len(out) == HOLD + 1 and out[-1] == EOS)
    else:  # max_new_tokens = HOLD + 1 and a draw that does not stop before
        max_new = HOLD + 1
        seed = seed_where(prompt, max_new, lambda out: len(out) == max_new and EOS not in out)
    eng = engine(fake, deterministic=True, partial_rollouts=True)
    fake.inject("/generate", "hold", HOLD)
    [g], _ = across_a_sync(fake, eng, prompt, SamplingParams(n=1, max_new_tokens=max_new, seed=seed))
    assert g.response_ids.tolist() == drawn(prompt, seed, max_new, "base")
    assert g.finish_reason == ("stop" if ending == "eos" else "length")
    assert g.spans == ((0, HOLD + 1, "base"),)
    assert len(generate_bodies(fake)) == 1


def test_the_hold_is_used_up_only_by_a_sample_that_reaches_it(fake):
    """The stand-in's "hold" fault (which the loop tests use to keep one sample in flight at a sync) applies to the
    first sample of at least `min_tokens` tokens, at least HOLD + 1: a sample that ends before it (HOLD tokens with its
    EOS; then HOLD + 1 with its EOS, below min_tokens = HOLD + 2: held, it would come back finished, not continued) is
    answered whole, as SGLang answers a request that ended before the abort, and the fault waits for the next sample,
    which is held and continued. Before, the first sample used the fault up (flaky in the loop test: its stand-in
    samples a fresh seed per request, so the held sample sometimes ended early and none was continued)."""
    prompt = make_prompt([81, 82], 1, color=9)
    max_new = 40
    seeds = [seed_where(prompt, max_new, lambda out, n=n: len(out) == n and out[-1] == EOS) for n in (HOLD, HOLD + 1)]
    eng = engine(fake, deterministic=True, partial_rollouts=True)
    with fake.state.lock:
        fake.state.faults["/generate"] = [Fault("hold", HOLD, min_tokens=HOLD + 2)]
    for seed in seeds:  # a sample held by mistake would wait for an abort that never comes
        answer = generate_in_a_daemon(eng, prompt, SamplingParams(n=1, max_new_tokens=max_new, seed=seed))
        try:
            [g] = answer.result(timeout=30)
        finally:
            eng.client.post_json("/abort_request", {"abort_all": True})  # releases a sample held by mistake
        assert g.response_ids.tolist() == drawn(prompt, seed, max_new, "base") and g.finish_reason == "stop"
    assert fake.state.held == 0
    long = seed_where(prompt, max_new, lambda out: len(out) >= HOLD + 2)
    [g], in_flight = across_a_sync(fake, eng, prompt, SamplingParams(n=1, max_new_tokens=max_new, seed=long))
    assert in_flight == 1 and [v for *_, v in g.spans] == ["base", "v1"]


def test_requests_wait_while_paused_and_an_abort_not_asked_for_starts_over(fake):
    """A generate that starts during a pause sends nothing until continue_generation; an abort the engine did not
    ask for (the server's own) is sent again from the start, as without partial rollouts; pausing an engine built
    without partial rollouts, or continuing before the sync completed, is refused."""
    prompt = make_prompt([41], 1, color=4)
    eng = engine(fake, deterministic=True, partial_rollouts=True)
    eng._gate = Gate()
    assert eng.pause_generation() == 0  # nothing in flight: no abort sent
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(eng.generate, [prompt], SamplingParams(n=1, max_new_tokens=8, seed=1))
        assert eng._gate.blocked.wait(timeout=30)  # the request waits at the gate ...
        assert not generate_bodies(fake) and not answer.done()  # ... unsent
        eng.continue_generation()
        [[g]] = answer.result(timeout=30)
    assert (
        g.spans == ((0, g.response_ids.numel(), "base"),) and len(generate_bodies(fake)) == 1
    )  # one span, one version
    assert not [c for c in fake.calls if c["path"] == "/abort_request"]

    fake.inject("/generate", "abort")  # the server's own abort (no pause): the sample starts over, nothing kept
    [[g]] = eng.generate([prompt], SamplingParams(n=1, max_new_tokens=8, seed=1))
    assert g.spans == ((0, g.response_ids.numel(), "base"),) and g.response_ids.tolist() == drawn(prompt, 1, 8, "base")

    with pytest.raises(EngineStateError, match="partial_rollouts=True"):
        engine(fake).pause_generation()
    eng.begin_weight_sync()  # a sync begun and not finished: the weights are not usable yet
    with pytest.raises(EngineStateError, match="finish the sync first"):
        eng.continue_generation()


def test_a_sample_sent_only_after_the_sync_is_tagged_with_the_new_version(fake):
    """Review finding: with one request at a time (max_concurrency=1), prompt 1 waits in the engine while prompt 0
    holds; the pause aborts prompt 0 (kept, continued) and prompt 1 is sent only after the sync: all its tokens are the
    new weights', so its one span says "v1" (before: no spans, read as the batch's older version)."""
    prompts = [make_prompt([61, 62], 1, color=6), make_prompt([63, 64], 1, color=7)]
    max_new = 40
    seed = seed_where(prompts[0], max_new, lambda out: len(out) > HOLD + 1)
    eng = engine(fake, deterministic=True, partial_rollouts=True, max_concurrency=1)
    fake.inject("/generate", "hold", HOLD)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(eng.generate, prompts, SamplingParams(n=1, max_new_tokens=max_new, seed=seed))
        wait_held(fake, 1)
        assert eng.pause_generation() == 1
        sync(fake, eng, "v1")
        eng.continue_generation()
        [[first], [second]] = answer.result(timeout=30)
    assert [v for _, _, v in first.spans] == ["base", "v1"]
    assert second.spans == ((0, second.response_ids.numel(), "v1"),)


def test_a_groups_kept_samples_are_continued_at_once(fake):
    """Review finding: the n kept samples of a group request were continued one after another (n times the time on
    the step's path). Now at once: after the first sync their n continuations are all decoding together (each holds at
    the stand-in; one after another, only the first would be, and this test would time out), the next pause aborts
    all n requests, and after a second sync every sample ends with three spans."""
    prompt = make_prompt([71, 72], 1, color=8)
    max_new, n = 40, 3
    eng = engine(fake, one_request_per_prompt=True, partial_rollouts=True)

    def long_enough(seed: int) -> bool:  # every sample outlives its first two holds
        first = drawn(prompt, seed, max_new, "base", n=n)
        span1 = first[: HOLD + 1]
        rests = [
            fake_tokens(
                prompt.prompt_ids.tolist() + span1,
                {**sampling(seed, max_new - len(span1)), "sampling_seed": sampling_seed(seed, 0, j, n)},
                "v1",
            )[0]
            for j in range(n)
        ]
        return len(first) > HOLD + 1 and all(len(rest) > HOLD + 1 for rest in rests)

    seed = next(s for s in range(1000) if long_enough(s))
    fake.inject("/generate", "hold", HOLD, times=n)
    # were the continuations sent one after another, one would stay held
    answer = generate_in_a_daemon(eng, prompt, SamplingParams(n=n, max_new_tokens=max_new, seed=seed))
    try:
        wait_held(fake, 1)
        assert eng.pause_generation() == 1
        sync(fake, eng, "v1")
        fake.inject("/generate", "hold", HOLD, times=n)
        eng.continue_generation()
        wait_held(fake, 2 * n)  # the group's n holds, then its n continuations', all at once
        assert eng.pause_generation() == n
        sync(fake, eng, "v2")
        eng.continue_generation()
        group = answer.result(timeout=30)
    finally:  # a failed check leaves a sample held in the engine's own threads: abort until the generation ends
        for _ in range(60):
            if answer.done():
                break
            if eng._paused:  # a check failed between a pause and its continue
                eng.continue_generation()
            eng.client.post_json("/abort_request", {"abort_all": True})
            concurrent.futures.wait([answer], timeout=0.5)
    assert [[version for *_, version in g.spans] for g in group] == [["base", "v1", "v2"]] * n


@pytest.mark.parametrize("n", [1, 3])
def test_a_sample_aborted_before_sglang_started_it_is_sent_again_after_the_sync(fake, n):
    """SGLang 0.5.17 answers an abort_all that reaches a request still being tokenized (or its group's prefix
    prefilled) with HTTP 499 and no output (the stand-in's "unstarted_abort"). For a pause of ours that is an abort
    with nothing kept: each sample is sent again whole after the sync, under the new weights, one span of that
    version; nothing fails, nothing is lost. Without the pause a 499 stays an error."""
    prompt = make_prompt([31, 32], 1, color=3)
    max_new = 12
    # n = 3 goes as one request (the stand-in then honours the shared seed, as the group test above)
    eng = engine(fake, deterministic=n == 1, partial_rollouts=True, one_request_per_prompt=n > 1)
    fake.inject("/generate", "unstarted_abort")
    group, in_flight = across_a_sync(fake, eng, prompt, SamplingParams(n=n, max_new_tokens=max_new, seed=5))
    assert in_flight == 1 and len(group) == n
    for g in group:  # drawn whole by the new weights: one span of "v1", no token kept from before the sync
        assert g.spans == ((0, g.response_ids.numel(), "v1"),) and g.response_ids.numel() > 0
    if n == 1:
        assert group[0].response_ids.tolist() == drawn(prompt, 5, max_new, "v1")
    bodies = generate_bodies(fake)
    assert len(bodies) == 1 + n  # the aborted request, then each sample alone
    first = bodies[0]["input_ids"][0] if n > 1 else bodies[0]["input_ids"]  # a group goes in the batch form
    assert all(b["input_ids"] == first for b in bodies[1:])  # the prompt alone: nothing kept
    assert [b["sampling_params"]["max_new_tokens"] for b in bodies[1:]] == [max_new] * n


def test_a_499_without_a_pause_is_an_error(fake):
    from miles_vl.rollout.sglang.client import SGLangRequestError

    eng = engine(fake, partial_rollouts=True)
    fake.inject("/generate", "status", 499)
    with pytest.raises(SGLangRequestError, match="499"):
        eng.generate([make_prompt([41], 1)], SamplingParams(n=1, max_new_tokens=4, seed=0))
