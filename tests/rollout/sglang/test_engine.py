"""Contract: `SGLangRolloutEngine` generates and takes weights over the SGLang 0.5.16 HTTP API: `n` generations per
prompt in order, one request per prompt with `sampling_params.n` (one per sample on a deterministic server) with the
canonical ids and the prompt's images; a prompt-id mismatch, a
prompt without its images, or a response from other weights than the last synced is a loud error; the colocated
weight sync sends byte-bounded buckets of the exact tensors, then labels the version and flushes the cache (also when
the buckets are handed over one call at a time, where a server restart in the middle voids the sync); memory
release/resume is refused when it cannot work and leaves the engine refusing to generate until weights are synced."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from miles_vl.rollout.sglang import (
    EngineStateError,
    PromptMismatchError,
    SGLangError,
    SGLangRequestError,
    SGLangRolloutEngine,
    WeightVersionError,
)
from miles_vl.rollout.sglang.generate import image_hash, sampling_seed
from miles_vl.rollout.types import SamplingParams
from tests.rollout.sglang.conftest import EOS, MAX_PIXELS, MIN_PIXELS, TOKENS, make_engine, make_prompt, quick_client
from tests.rollout.sglang.fake_server import FakeSGLang, fake_tokens


def engine(fake, **kwargs) -> SGLangRolloutEngine:
    kwargs.setdefault("weight_version", "base")
    # The stand-in runs in this process, where CUDA IPC handles of our own memory cannot be opened: keep the
    # weights on the CPU (shared by file descriptor) even on a GPU machine. test_gpu.py covers the CUDA path.
    kwargs.setdefault("weight_device", None)
    return make_engine(quick_client(fake.url), **kwargs)


def prompts():
    return [make_prompt([11, 12], 1, color=1), make_prompt([21, 22, 23]), make_prompt([31], 2, color=2)]


def generate_bodies(fake) -> list[dict]:
    return [c["body"] for c in fake.calls if c["path"] == "/generate"]


@pytest.fixture
def deterministic_fake():
    """A stand-in run with --enable-deterministic-inference: its answers are a function of the request's seed."""
    with FakeSGLang(weight_version="base", image_min_pixels=MIN_PIXELS, image_max_pixels=MAX_PIXELS,
                    deterministic=True) as server:  # fmt: skip
        yield server


def test_generate_sends_one_request_per_sample_and_keeps_prompt_order(deterministic_fake):
    fake = deterministic_fake
    eng = engine(fake, deterministic=True)
    ps = prompts()
    params = SamplingParams(n=3, max_new_tokens=6, temperature=0.9, seed=11)
    groups = eng.generate(ps, params)
    assert [len(g) for g in groups] == [3, 3, 3]

    bodies = generate_bodies(fake)
    assert len(bodies) == 9
    for body in bodies:
        assert body["return_logprob"] is True and body["return_prompt_token_ids"] is True
        assert body["sampling_params"]["stop_token_ids"] == [EOS]
        assert set(body["sampling_params"]["logit_bias"]) == {str(t) for t in (151655, 151656, 151652, 151653)}
    by_request = {(tuple(b["input_ids"]), b["sampling_params"]["sampling_seed"]): b for b in bodies}
    assert len(by_request) == 9  # every sample has its own seed
    # What goes over the wire: each image block collapsed to one <|image_pad|> (SGLang 0.5.16 expands it again).
    vs, pad, ve = 151652, 151655, 151653
    request_ids = [(11, 12, vs, pad, ve), (21, 22, 23), (31, vs, pad, ve, vs, pad, ve)]
    for p, wire, group in zip(ps, request_ids, groups, strict=True):
        sent = [b for (i, _), b in by_request.items() if i == wire]
        assert len(sent) == 3 and all(len(b.get("image_data", [])) == len(p.images) for b in sent)
        # one content hash per image (SGLang's prefix-cache key): the hash of the image it goes with
        assert all(b.get("mm_hashes", []) == [image_hash(u) for u in b.get("image_data", [])] for b in sent)
        # Each generation is exactly what the server produced for one of this prompt's requests, from the
        # canonical (expanded) prompt it rebuilt.
        ids = p.prompt_ids.tolist()
        expected = {tuple(fake_tokens(ids, b["sampling_params"], "base")[0]) for b in sent}
        assert {tuple(g.response_ids.tolist()) for g in group} == expected
        for g in group:
            assert g.logprobs.shape == g.response_ids.shape and bool((g.logprobs <= 0).all())
            assert (g.finish_reason == "stop") == (int(g.response_ids[-1]) == EOS)
            assert g.finish_reason == "stop" or len(g.response_ids) == 6

    again = eng.generate(ps, params)  # same seed, same prompts, same weights: same responses (deterministic mode)
    assert [[g.response_ids.tolist() for g in gs] for gs in again] == [
        [g.response_ids.tolist() for g in gs] for gs in groups
    ]


def test_a_prompts_n_samples_go_as_one_request_by_default(fake):
    """Without deterministic inference, prompt i's n samples are one request with sampling_params.n = n: the server
    processes its images once (0.5.16 tokenizes once and sends n copies); the answer's n bodies are the group, each
    checked against our prompt ids and weight version."""
    eng = engine(fake)
    assert eng.one_request_per_prompt
    ps = prompts()
    groups = eng.generate(ps, SamplingParams(n=4, max_new_tokens=8, temperature=1.0, seed=3))
    bodies = generate_bodies(fake)
    # a batch of one prompt each (0.5.16 makes one of a single prompt with n > 1 anyway, generate.py)
    assert len(bodies) == len(ps) and all(len(b["input_ids"]) == 1 for b in bodies)
    assert all([sp["n"] for sp in b["sampling_params"]] == [4] for b in bodies)
    assert sorted(len(b.get("image_data", [[]])[0]) for b in bodies) == sorted(len(p.images) for p in ps)
    assert [len(g) for g in groups] == [4, 4, 4]
    for group in groups:
        # sampled without a shared seed, they differ: by their logprobs too (two draws of a lone EOS, 1 in 13 each,
        # have the same tokens; the ids alone made this fail about once in 10,000 runs)
        assert len({(tuple(g.response_ids.tolist()), tuple(g.logprobs.tolist())) for g in group}) == len(group)
        assert all(g.logprobs.shape == g.response_ids.shape for g in group)

    fake.inject("/generate", "prompt_ids", {"position": 4, "token": 7})  # one body of the group: still an error
    with pytest.raises(PromptMismatchError, match="position 4"):
        eng.generate([make_prompt([11, 12], 1)], SamplingParams(n=3, max_new_tokens=4))
    fake.inject("/generate", "weight_version", "stale")
    with pytest.raises(WeightVersionError):
        eng.generate([make_prompt([11, 12], 1)], SamplingParams(n=3, max_new_tokens=4))
    assert len(eng.generate([make_prompt([5])], SamplingParams(n=1, max_new_tokens=4))[0]) == 1
    assert "n" not in generate_bodies(fake)[-1]["sampling_params"]  # n=1: a plain single request


def test_an_aborted_sample_of_a_group_is_sent_again_alone(fake):
    eng = engine(fake, max_abort_retries=1)
    fake.inject("/generate", "abort", times=1)  # the first body of the group: 200 with an abort finish reason
    [group] = eng.generate([make_prompt([5, 6], 1)], SamplingParams(n=3, max_new_tokens=4, temperature=1.0))
    assert len(group) == 3
    bodies = generate_bodies(fake)
    assert [b["sampling_params"][0]["n"] for b in bodies[:1]] == [3] and "n" not in bodies[1]["sampling_params"]


def test_a_prompt_with_two_images_and_n_samples(fake):
    """0.5.16 turns a single prompt with n > 1 into a batch of one, whose image_data must then hold one entry: the
    flat list of a prompt's two images is its HTTP 400 (the stand-in's too); the engine sends the batch form."""
    with pytest.raises(SGLangRequestError, match="length of image_data should be equal to the batch size"):
        quick_client(fake.url).generate_n(
            {"input_ids": [1], "image_data": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "n": 2}}, 2
        )
    [group] = engine(fake).generate([make_prompt([5, 6], 2)], SamplingParams(n=2, max_new_tokens=4))
    assert len(group) == 2
    assert len(generate_bodies(fake)[-1]["image_data"]) == 1 and len(generate_bodies(fake)[-1]["image_data"][0]) == 2


def test_prompts_per_request_batches_prompts_with_their_n_samples(fake):
    """With prompts_per_request = 2, five prompts go as three batched requests (2 + 2 + 1 prompts, each body with its
    own ids, images, hashes and seed); the answers, prompt by prompt, land with their own prompts (each body checked
    against its prompt's ids), and the result equals what one request per prompt gives on a deterministic server."""
    ps = [*prompts(), make_prompt([41, 42], 1, color=3), make_prompt([51])]
    params = SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=5)
    groups = engine(fake, prompts_per_request=2, max_concurrency=1).generate(ps, params)  # requests in order
    bodies = generate_bodies(fake)
    assert [len(b["input_ids"]) for b in bodies] == [2, 2, 1]  # the last prompt alone, in the batch form too
    first = bodies[0]
    assert [sp["sampling_seed"] for sp in first["sampling_params"]] == [
        sampling_seed(params.seed, i, 0, params.n) for i in (0, 1)
    ]
    assert all(sp["n"] == 3 for b in bodies[:2] for sp in b["sampling_params"])
    assert first["image_data"][1] == [] and len(first["image_data"][0]) == 1  # prompt 1 has no image
    assert first["mm_hashes"] == [[image_hash(u) for u in urls] for urls in first["image_data"]]
    assert [len(g) for g in groups] == [3] * 5  # each body was checked against its own prompt's ids

    fake.inject("/generate", "prompt_ids", {"position": 2, "token": 7})  # one body of a batch: still an error
    with pytest.raises(PromptMismatchError, match="position 2"):
        engine(fake, prompts_per_request=4).generate(ps[:2], params)


def test_a_batch_gives_what_one_request_per_prompt_gives(deterministic_fake):
    """On a stand-in whose answers are a function of the request (prompt, seed), a batch of prompts gets exactly the
    samples that one request per prompt gets: the bodies are matched to the right prompts, in order."""
    ps = [*prompts(), make_prompt([41, 42], 1, color=3)]
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=8)
    kw = dict(deterministic=True, one_request_per_prompt=False)
    per_sample = engine(deterministic_fake, **kw).generate(ps, params)
    eng = engine(deterministic_fake, deterministic=False, one_request_per_prompt=True, prompts_per_request=3)
    batched = eng.generate(ps, params)  # seeds per prompt: sample j of prompt i shares prompt i's seed here
    per_prompt = engine(deterministic_fake, deterministic=False, one_request_per_prompt=True).generate(ps, params)
    assert [[g.response_ids.tolist() for g in group] for group in batched] == [
        [g.response_ids.tolist() for g in group] for group in per_prompt
    ]
    assert [[g.response_ids.tolist() for g in group] for group in per_sample] != [
        [g.response_ids.tolist() for g in group] for group in batched
    ]  # a control: per-sample seeds give other samples, so the equality above is not vacuous


def test_batched_requests_keep_about_max_concurrency_prompts_in_flight(fake):
    """max_concurrency counts prompts when a request carries several: 8 prompts, 2 per request, max_concurrency 4 ->
    at most 2 requests (4 prompts) at once; a prompt's pixels wait in the server until its samples are sent."""
    eng = engine(fake, prompts_per_request=2, max_concurrency=4)
    original, lock, state = eng.client.generate_n, threading.Lock(), {"now": 0, "most": 0, "calls": 0}
    both = threading.Barrier(2, timeout=30)  # the first two requests meet: a pool of one fails here, not by chance

    def counted(payload, n):
        with lock:
            state["now"] += 1
            state["calls"] += 1
            first_two = state["calls"] <= 2
            state["most"] = max(state["most"], state["now"])
        try:
            if first_two:
                both.wait()
            time.sleep(0.05)  # long enough for every request the pool would allow to overlap
            return original(payload, n)
        finally:
            with lock:
                state["now"] -= 1

    eng.client.generate_n = counted
    ps = [make_prompt([60 + k, 61], 1, color=k % 3) for k in range(8)]
    groups = eng.generate(ps, SamplingParams(n=2, max_new_tokens=4, temperature=1.0))
    assert [len(g) for g in groups] == [2] * 8 and state["most"] == 2


def test_an_aborted_sample_of_a_batch_is_sent_again_alone(fake):
    eng = engine(fake, max_abort_retries=1, prompts_per_request=8)
    fake.inject("/generate", "abort", times=1)  # the first body of the batch
    groups = eng.generate(prompts(), SamplingParams(n=2, max_new_tokens=4, temperature=1.0))
    assert [len(g) for g in groups] == [2, 2, 2]
    bodies = generate_bodies(fake)
    assert len(bodies) == 2 and len(bodies[0]["input_ids"]) == 3
    assert bodies[1]["input_ids"] == bodies[0]["input_ids"][0] and "n" not in bodies[1]["sampling_params"]


def test_mixed_n_in_one_batch_is_refused_by_the_server_and_by_us(fake):
    from miles_vl.rollout.sglang.generate import batch_payload

    body = {"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 2}]}
    with pytest.raises(SGLangRequestError, match="parallel_sample_num should be the same"):
        quick_client(fake.url).generate_n(body, 3)
    one = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "n": 2}, "return_logprob": True}
    with pytest.raises(ValueError, match="same n"):
        batch_payload([one, {**one, "sampling_params": {"max_new_tokens": 2}}])
    with pytest.raises(ValueError, match="differ in more than"):
        batch_payload([one, {**one, "return_logprob": False}])
    with pytest.raises(ValueError, match=">= 1"):
        engine(fake, prompts_per_request=0)


def test_deterministic_servers_get_one_request_per_sample(deterministic_fake):
    """SGLang gives all n samples of a request its one sampling_seed: on a deterministic server they would be the same
    response n times (what the stand-in answers; tests/gpu/test_sglang_real.py checks it on the real server). So a
    deterministic engine sends one request per sample, and asking for grouping there is refused."""
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 9,
                                                     "n": 3, "stop_token_ids": [EOS]}}  # fmt: skip
    answers = quick_client(deterministic_fake.url).generate_n(body, 3)
    assert len({tuple(a["output_ids"]) for a in answers}) == 1
    assert not engine(deterministic_fake, deterministic=True).one_request_per_prompt
    with pytest.raises(ValueError, match="would be identical.*one_request_per_prompt"):
        engine(deterministic_fake, deterministic=True, one_request_per_prompt=True)


def test_an_answer_that_is_not_n_bodies_is_an_error(fake):
    from miles_vl.rollout.sglang import SGLangResponseError

    with pytest.raises(SGLangResponseError, match="expected a list of 3 objects"):
        quick_client(fake.url).generate_n({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "n": 2}}, 3)


def test_prompt_mismatch_is_an_error(fake):
    fake.inject("/generate", "prompt_ids", {"position": 4, "token": 7})
    with pytest.raises(PromptMismatchError, match=r"position 4 \(miles_vl 151655, SGLang 7"):
        engine(fake).generate([make_prompt([11, 12], 1)], SamplingParams(n=1, max_new_tokens=4))


def test_prompts_without_images_fail_before_any_request(fake):
    with pytest.raises(ValueError, match="no `images` attribute"):
        engine(fake).generate([make_prompt([1]), make_prompt([2], 1, with_images=False)], SamplingParams(n=2))
    assert generate_bodies(fake) == []


def test_transient_503s_and_aborts_are_absorbed_but_bounded(fake):
    eng = engine(fake, max_abort_retries=1)
    fake.inject("/generate", "status", 503, times=2)
    fake.inject("/generate", "abort", times=1)
    [[gen]] = eng.generate([make_prompt([5, 6])], SamplingParams(n=1, max_new_tokens=4))
    assert len(generate_bodies(fake)) == 4  # 503, 503, aborted, answered
    fake.inject("/generate", "abort", times=5)
    with pytest.raises(SGLangError, match=r"aborted the request.*\(2 attempts\)"):
        eng.generate([make_prompt([5, 6])], SamplingParams(n=1, max_new_tokens=4))


def test_invalid_sampling_parameters_are_rejected_before_sending(fake):
    with pytest.raises(ValueError, match=r"n=0 \(need >= 1\), top_p=1.5"):
        engine(fake).generate([make_prompt([1])], SamplingParams(n=0, top_p=1.5))
    assert fake.calls == []


def test_colocated_weight_sync_sequence_and_payloads(fake):
    fake.state.tp_size = 2
    eng = engine(fake, tp_size=2, weight_bucket_bytes=64, verify_weights=False)  # verification: test_verify.py
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("model.language_model.layers.0.mlp.up_proj.weight", torch.randn(4, 3, generator=g)),  # 48 B
        ("model.language_model.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16)),  # 6 B
        ("model.visual.merger.linear_fc1.weight", torch.randn(5, 5, generator=g)),  # 100 B: alone, above the bound
        ("lm_head.weight", torch.randn(2, 2, generator=g).t()),  # 16 B, non-contiguous
    ]
    report = eng.load_weights(iter(tensors))
    assert (report.buckets, report.tensors, report.bytes, report.weight_version) == (3, 4, 170, "miles_vl-1")

    calls = fake.calls
    assert [c["path"] for c in calls] == ["/update_weights_from_tensor"] * 3 + [
        "/update_weight_version",
        "/flush_cache",
    ]
    for c in calls[:3]:
        body = c["body"]
        assert len(body["serialized_named_tensors"]) == 2  # one payload per TP rank
        assert (body["load_format"], body["flush_cache"], body["abort_all_requests"]) == (None, False, False)
    assert calls[3]["body"] == {"new_version": "miles_vl-1", "abort_all_requests": False}
    assert calls[4]["query"] == {"timeout": "60.0"}
    received = fake.state.weights
    assert [w["names"] for w in received] == [[tensors[0][0], tensors[1][0]], [tensors[2][0]], [tensors[3][0]]]
    assert [w["tp_ranks"] for w in received] == [2, 2, 2]
    flat = [
        (n, d, s, v)
        for w in received
        for n, d, s, v in zip(w["names"], w["dtypes"], w["shapes"], w["sums"], strict=True)
    ]
    assert flat == [(n, str(t.dtype)[6:], list(t.shape), pytest.approx(float(t.double().sum()))) for n, t in tensors]

    [[gen]] = eng.generate([make_prompt([1, 2])], SamplingParams(n=1, max_new_tokens=3))
    assert eng.weight_version == "miles_vl-1" and fake.state.weight_version == "miles_vl-1"
    assert eng.load_weights(tensors[:1], weight_version="step-7").weight_version == "step-7"


def test_a_response_from_other_weights_is_refused(fake):
    eng = engine(fake)
    eng.load_weights([("w", torch.ones(2))])
    fake.inject("/generate", "weight_version", "base")  # e.g. a server that restarted behind our back
    with pytest.raises(WeightVersionError, match=r"answered with weights 'base', but 'miles_vl-1' were synced"):
        eng.generate([make_prompt([1])], SamplingParams(max_new_tokens=2))


def test_release_resume_sequence_and_the_weights_it_invalidates(fake):
    eng = engine(fake, memory_saver=True)
    params = SamplingParams(max_new_tokens=2)
    eng.release_memory()
    assert [(c["path"], c["body"]) for c in fake.calls] == [
        ("/flush_cache", None),
        ("/release_memory_occupation", {"tags": None}),
    ]
    assert fake.state.released == {"kv_cache", "weights", "cuda_graph"}
    with pytest.raises(EngineStateError, match="call resume_memory"):
        eng.generate([make_prompt([1])], params)
    with pytest.raises(EngineStateError, match="call resume_memory"):
        eng.load_weights([("w", torch.ones(1))])
    eng.resume_memory()
    assert fake.paths()[-1] == "/resume_memory_occupation" and fake.state.released == set()
    with pytest.raises(EngineStateError, match="keeps no CPU backup"):
        eng.generate([make_prompt([1])], params)
    eng.load_weights([("w", torch.ones(1))])
    assert len(eng.generate([make_prompt([1])], params)[0]) == 1

    backed_up = engine(fake, memory_saver=True, weights_cpu_backup=True, weight_version="miles_vl-1")
    backed_up.release_memory()
    backed_up.resume_memory()
    assert len(backed_up.generate([make_prompt([1])], params)[0]) == 1


def test_weights_resume_before_the_sync_and_the_kv_cache_after_it(fake):
    """Issue 33: an 8B engine colocated on one GPU cannot hold its KV cache beside the weight sync, so the loop resumes
    the weights alone (0.5.16's `tags=["weights"]`), syncs into them while the KV cache and CUDA graphs stay released,
    then resumes the rest; generate is refused until everything is back, and each tag is resumed once (0.5.16 kills the
    scheduler on resuming a tag that is not released)."""
    eng = engine(fake, memory_saver=True)
    params = SamplingParams(max_new_tokens=2)
    eng.release_memory()
    eng.resume_memory(["weights"])
    assert fake.calls[-1]["body"] == {"tags": ["weights"]} and fake.state.released == {"kv_cache", "cuda_graph"}
    with pytest.raises(EngineStateError, match=r"memory is released \(\['cuda_graph', 'kv_cache'\]\)"):
        eng.generate([make_prompt([1])], params)
    eng.load_weights([("w", torch.ones(1))])  # the stand-in dies on weights loaded while released: they are not
    assert not fake.state.dead and fake.state.weights
    eng.resume_memory(["weights"])  # already resumed: nothing is sent
    eng.resume_memory()
    assert fake.calls[-1]["body"] == {"tags": ["kv_cache", "cuda_graph"]} and fake.state.released == set()
    assert fake.paths().count("/resume_memory_occupation") == 2 and not fake.state.dead
    assert len(eng.generate([make_prompt([1])], params)[0]) == 1
    with pytest.raises(ValueError, match=r"unknown memory tags \['kv'\]; expected some of"):
        eng.resume_memory(["kv"])


def test_the_stand_in_dies_on_weights_loaded_while_released(fake):
    """What the order above avoids: 0.5.16 copies the weights into memory torch_memory_saver has unmapped."""
    released = engine(fake, memory_saver=True)
    released.release_memory()
    fresh = engine(fake)  # knows nothing of the release: it sends
    with pytest.raises(SGLangError):
        fresh.load_weights([("w", torch.ones(1))])
    assert fake.state.dead and "illegal memory access" in fake.state.log[-2]


def test_release_needs_a_memory_saver_server(fake):
    with pytest.raises(EngineStateError, match="--enable-memory-saver"):
        engine(fake).release_memory()
    assert fake.calls == []


def test_a_sync_bucket_by_bucket_and_a_restart_in_its_middle(fake):
    """Buckets handed over one call at a time (as the driver streams them from the trainer) make the same calls as
    `load_weights`; a server restart between two buckets voids the sync (its earlier buckets are lost), so the rest of
    it is refused until it begins again, and generate refuses until a sync completes."""
    eng = engine(fake, verify_weights=False)  # the bare call sequence; verification: test_verify.py
    params = SamplingParams(max_new_tokens=2)
    eng.begin_weight_sync()
    with pytest.raises(EngineStateError, match="weight sync started and did not complete"):
        eng.generate([make_prompt([1])], params)
    eng.load_weight_bucket([("a", torch.ones(2))])
    eng.load_weight_bucket([("b", torch.zeros(3))])
    report = eng.finish_weight_sync("step-1")
    assert (report.buckets, report.tensors, report.bytes, report.weight_version) == (2, 2, 20, "step-1")
    assert fake.paths() == ["/update_weights_from_tensor"] * 2 + ["/update_weight_version", "/flush_cache"]
    assert len(eng.generate([make_prompt([1])], params)[0]) == 1

    eng.begin_weight_sync()
    eng.load_weight_bucket([("a", torch.ones(2))])
    eng.server_restarted()  # what the host reports after relaunching a dead server
    with pytest.raises(EngineStateError, match="server restarted during the weight sync"):
        eng.load_weight_bucket([("b", torch.zeros(3))])
    with pytest.raises(EngineStateError, match="server restarted during the weight sync"):
        eng.finish_weight_sync("step-2")
    with pytest.raises(EngineStateError, match="restarted and reloaded model_path"):
        eng.generate([make_prompt([1])], params)
    eng.begin_weight_sync()
    eng.load_weight_bucket([("a", torch.ones(2))])
    assert eng.finish_weight_sync("step-2").buckets == 1
    assert len(eng.generate([make_prompt([1])], params)[0]) == 1
    with pytest.raises(EngineStateError, match="without begin_weight_sync"):
        eng.load_weight_bucket([("a", torch.ones(2))])


def test_aborts_answered_with_400_500_or_503(fake):
    """0.5.16 turns a scheduler abort with a status code into an HTTP error (tokenizer_manager.py:1438): 503 (waiting
    or running timeout) and 500 (out of memory) are transient, so the request is sent again and succeeds; 400 (e.g. an
    over-long input) is the request's fault, so it fails at once with the server's words."""
    eng = engine(fake)
    prompt = make_prompt([5, 6])
    fake.inject("/generate", "abort_status", 503)
    fake.inject("/generate", "abort_status", 500)
    [[gen]] = eng.generate([prompt], SamplingParams(n=1, max_new_tokens=4))
    assert len(generate_bodies(fake)) == 3 and gen.response_ids.numel() >= 1
    fake.inject("/generate", "abort_status", 503, times=3)  # every attempt
    with pytest.raises(SGLangError, match=r"failed 3 time\(s\); last error: HTTP 503: Request waiting timeout reached"):
        eng.generate([prompt], SamplingParams(n=1, max_new_tokens=4))
    before = len(generate_bodies(fake))
    fake.inject("/generate", "abort_status", 400)
    with pytest.raises(SGLangRequestError, match=r"HTTP 400: Input length \(9000 tokens\) exceeds the maximum") as e:
        eng.generate([prompt], SamplingParams(n=1, max_new_tokens=4))
    assert e.value.status_code == 400 and len(generate_bodies(fake)) == before + 1


def test_release_refuses_a_busy_server_instead_of_crashing_it(fake):
    """0.5.16 kills itself when memory is released while a request runs (an assert in its scheduler). The engine
    flushes with a timeout first; a refused flush means the server is still busy, so it refuses to release, says why,
    and leaves the server alive and resident."""
    eng = engine(fake, memory_saver=True, flush_timeout_s=0.2)
    fake.inject("/generate", "delay", 3.0)  # busy well past the flush's 0.2 s on a loaded machine
    busy = threading.Thread(target=eng.generate, args=([make_prompt([1])], SamplingParams(max_new_tokens=2)))
    busy.start()
    while fake.state.running == 0:
        time.sleep(0.01)
    with pytest.raises(EngineStateError, match=r"release_memory\(\) refused: .*Timed out waiting for idle state"):
        eng.release_memory()
    assert not eng.released and not fake.state.dead and fake.state.released == set()
    assert "/release_memory_occupation" not in fake.paths()
    busy.join()
    eng.release_memory()  # idle now
    assert eng.released and fake.state.released == {"kv_cache", "weights", "cuda_graph"}
    eng.resume_memory()
    eng.resume_memory()  # not released any more: nothing is sent (a second resume would kill the server)
    assert fake.paths().count("/resume_memory_occupation") == 1 and not fake.state.dead


def test_a_sync_whose_flush_is_refused_can_be_finished_again(fake):
    """The weights landed and were labelled, but the prefix cache of the old weights is still there: generate stays
    refused and `finish_weight_sync` can be called again; once the server is idle it completes."""
    eng = engine(fake, flush_timeout_s=0.2)
    eng.begin_weight_sync()
    eng.load_weight_bucket([("a", torch.ones(2))])
    fake.inject("/flush_cache", "status", 400)
    with pytest.raises(EngineStateError, match=r"could not be dropped.*call it again once the server is idle"):
        eng.finish_weight_sync("step-1")
    with pytest.raises(EngineStateError, match="weight sync started and did not complete"):
        eng.generate([make_prompt([1])], SamplingParams(max_new_tokens=2))
    assert eng.finish_weight_sync("step-1").weight_version == "step-1"
    assert len(eng.generate([make_prompt([1])], SamplingParams(max_new_tokens=2))[0]) == 1


def test_the_seed_counts_only_with_deterministic_inference(fake, deterministic_fake, caplog):
    """0.5.16 ignores `sampling_seed` unless the server runs with --enable-deterministic-inference: the same sampled
    request gives other responses each time (greedy ones do not change), and the engine says so once; with the flag the
    seed decides the responses and the engine does not warn."""
    prompt, sampled = make_prompt([3, 4], 1), SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=5)
    eng = engine(fake)
    with caplog.at_level("WARNING", logger="miles_vl.rollout.sglang.engine"):
        first, second = (responses(eng.generate([prompt], sampled)) for _ in range(2))
    assert first != second
    assert sum("ignores sampling_seed" in r.message for r in caplog.records) == 1  # once per engine
    greedy = SamplingParams(n=2, max_new_tokens=12, temperature=0.0)
    assert responses(eng.generate([prompt], greedy)) == responses(eng.generate([prompt], greedy))

    caplog.clear()
    det = engine(deterministic_fake, deterministic=True)
    with caplog.at_level("WARNING", logger="miles_vl.rollout.sglang.engine"):
        assert responses(det.generate([prompt], sampled)) == responses(det.generate([prompt], sampled))
    assert not caplog.records
    other_seed = SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=6)
    assert responses(det.generate([prompt], other_seed)) != responses(det.generate([prompt], sampled))


def test_min_p_with_a_seed_kills_a_deterministic_server_and_the_engine_never_sends_it(deterministic_fake):
    """The one sampling combination 0.5.16 asserts on in deterministic mode is `min_p > 0` (sampler.py:570, in the
    scheduler: the server dies). The stand-in models it; the engine's requests carry no min_p at all."""
    det = engine(deterministic_fake, deterministic=True)
    det.generate([make_prompt([1])], SamplingParams(max_new_tokens=2, top_p=0.9, top_k=20))  # top-p/top-k are fine
    assert all("min_p" not in b["sampling_params"] for b in generate_bodies(deterministic_fake))
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_p": 0.1}}
    with pytest.raises(SGLangError, match="RemoteProtocolError"):
        quick_client(deterministic_fake.url, max_retries=0).generate(body)
    assert deterministic_fake.state.dead and "multinomial_with_seed" in deterministic_fake.state.log[-2]


def responses(groups) -> list[list[list[int]]]:
    return [[g.response_ids.tolist() for g in gs] for gs in groups]


# ---------------------------------------------------------------------------------------------------------------------
# pixel values (a server started by miles_vl's launcher: pixel_dir)


@pytest.fixture
def pixel_fake(tmp_path):
    """The stand-in as miles_vl's launcher runs 0.5.16: it reads processor_output items' pixel files in tmp_path."""
    with FakeSGLang(weight_version="base", image_min_pixels=MIN_PIXELS, image_max_pixels=MAX_PIXELS,
                    pixel_dir=str(tmp_path)) as server:  # fmt: skip
        yield server


def test_with_a_pixel_directory_prompts_go_as_their_ids_and_pixel_values(pixel_fake, tmp_path):
    """Images, several images, no image and a video, batched and single: every body carries the canonical ids and the
    prompt's own pixel values (read back by the stand-in with the launcher's reader, which refuses anything else),
    prompts need no `images`, the server ran those ids, and the directory is empty afterwards."""
    from miles_vl.sglang_plugin.wire import FILE_KEY
    from tests.rollout.sglang.conftest import make_video_prompt

    ps = [make_prompt([11, 12], 1, color=1, with_images=False), make_prompt([21, 22, 23]),
          make_prompt([31], 2, color=2, with_images=False), make_video_prompt([41], 3, seed=4)]  # fmt: skip
    eng = engine(pixel_fake, pixel_dir=str(tmp_path), prompts_per_request=2)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=2)
    groups = eng.generate(ps, params)
    assert [len(g) for g in groups] == [2] * 4
    bodies = sorted(generate_bodies(pixel_fake), key=lambda b: b["input_ids"][0][0])  # the 2 requests run side by side
    assert [ids for b in bodies for ids in b["input_ids"]] == [p.prompt_ids.tolist() for p in ps]
    items = [(b.get("image_data") or [[]] * 2, b.get("video_data") or [[]] * 2) for b in bodies]
    images = [im for ims, _ in items for im in ims]
    videos = [v for _, vids in items for v in vids]
    assert [len(im) for im in images] == [1, 0, 1, 0] and [len(v) for v in videos] == [0, 0, 0, 1]
    assert images[2][0]["image_grid_thw"] == [[1, 4, 4], [1, 4, 4]] and FILE_KEY in images[2][0]["pixel_values"]
    assert videos[3][0]["video_grid_thw"] == [[3, 4, 4]]
    assert all("mm_hashes" not in b for b in bodies)
    # (each answer's prompt ids, the ids the server ran, were checked against ours by the engine)
    assert list(tmp_path.iterdir()) == []
    [[one]] = eng.generate(ps[3:], SamplingParams(n=1, max_new_tokens=4))  # a single request: same form
    assert generate_bodies(pixel_fake)[-1]["video_data"][0]["video_grid_thw"] == [[3, 4, 4]]
    assert list(tmp_path.iterdir()) == []


def test_only_the_prompts_in_flight_have_pixel_files(pixel_fake, tmp_path):
    """Each request's prompts are written just before it leaves and deleted when it is answered, so the directory
    (shared memory) holds the pixels of the prompts in flight only: one request at a time here, one prompt each."""
    eng = engine(pixel_fake, pixel_dir=str(tmp_path), max_concurrency=1)
    seen, original = [], eng.client.generate_n

    def counted(payload, n):
        seen.append(len(list(tmp_path.iterdir())))
        return original(payload, n)

    eng.client.generate_n = counted
    groups = eng.generate([make_prompt([60 + k], 2, color=k) for k in range(4)], SamplingParams(n=2, max_new_tokens=3))
    assert [len(g) for g in groups] == [2] * 4 and seen == [1, 1, 1, 1]  # one file per prompt: its two images
    assert list(tmp_path.iterdir()) == []


def test_the_pixel_files_go_whatever_happens(pixel_fake, tmp_path):
    """A bad prompt fails before any request, a server error after the files were written: either way no file is
    left (the engine owns them until the request is answered)."""
    eng = engine(pixel_fake, pixel_dir=str(tmp_path))
    bad = make_prompt([1], 1)
    bad.pixel_values = bad.pixel_values[:3]
    with pytest.raises(ValueError, match="prompt 1: pixel_values has shape"):
        eng.generate([make_prompt([5], 1), bad, make_prompt([6], 2)], SamplingParams(n=2, max_new_tokens=4))
    assert generate_bodies(pixel_fake) == [] and list(tmp_path.iterdir()) == []
    pixel_fake.inject("/generate", "status", 500, times=10)
    with pytest.raises(SGLangError):
        eng.generate([make_prompt([5], 1)], SamplingParams(n=2, max_new_tokens=4))
    assert list(tmp_path.iterdir()) == []


def test_stock_sglang_cannot_read_pixel_files(tmp_path):
    """Without miles_vl's launcher, 0.5.16 takes the file reference for the pixel values: it fails hashing it
    (TypeError in its tokenizer: HTTP 500), or, for a one-image item that brings its hash, hands it to the vision
    tower, whose TypeError kills the scheduler and the server; the config therefore refuses send_pixel_values without
    the launcher."""
    from miles_vl.rollout.sglang.generate import build_generate_payload, pixel_media

    with FakeSGLang(weight_version="base", pixel_dir=str(tmp_path), launcher=False) as stock:
        media = pixel_media(make_prompt([1], 1), 0, TOKENS, directory=str(tmp_path), dtype=torch.float32,
                            spatial_merge_size=2)  # fmt: skip
        unhashed = [{k: v for k, v in media.image_data[0].items() if k != "hash"}]
        body = build_generate_payload(media.input_ids, unhashed, SamplingParams(), seed=0, stop_token_ids=[EOS])
        with pytest.raises(SGLangError, match="HTTP 500"):
            quick_client(stock.url, max_retries=0).generate(body)
        assert any("TypeError" in line for line in stock.state.log)
        body = build_generate_payload(media.input_ids, media.image_data, SamplingParams(), seed=0, stop_token_ids=[EOS])
        with pytest.raises(SGLangError, match="disconnected|Connection|reset|aborted"):
            quick_client(stock.url, max_retries=0).generate(body)
        assert any("Scheduler hit an exception: TypeError: expected Tensor" in line for line in stock.state.log)


def test_the_tensor_paths_auto_device_keeps_the_weights_on_the_cpu_for_a_server_of_several_tp_ranks(monkeypatch):
    """`weight_device="auto"` on a GPU machine: a one-rank server maps CUDA tensors of this process's GPU; a server of
    two TP ranks gets shared CPU tensors, since its TP rank 1 (another GPU) cannot copy from this GPU's memory (the
    8B run: docs/gpu-runs/2026-11-27-loop-8b-tp2cp2-ipc-fail-4xh200)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    client = quick_client("http://127.0.0.1:1")
    assert make_engine(client, weight_device="auto", tp_size=1).weight_device == "cuda"
    assert make_engine(client, weight_device="auto", tp_size=2).weight_device is None
    assert make_engine(client, weight_device="cuda", tp_size=2).weight_device == "cuda"  # said outright: kept
