"""Contract: every call has a timeout; 503s, 5xx, timeouts and refused connections are retried a bounded number of
times and then reported with the last error; a 4xx is reported at once with the server's own message; calls that
pair with collectives are never sent twice; a dead server process fails fast; the API key is sent as a bearer token
and health checks need none (SGLang 0.5.16 auth)."""

from __future__ import annotations

import threading
import time

import pytest

from miles_vl.rollout.sglang import (
    SGLangRequestError,
    SGLangServerDiedError,
    SGLangUnavailableError,
)
from tests.rollout.sglang.conftest import free_port, quick_client
from tests.rollout.sglang.fake_server import FakeSGLang


def test_503_then_200_succeeds_after_retries(fake):
    fake.inject("/model_info", "status", 503, times=2)
    info = quick_client(fake.url, max_retries=3).model_info()
    assert info["weight_version"] == "base" and info["has_image_understanding"] is True
    assert fake.paths() == ["/model_info"] * 3


def test_retries_are_bounded_and_the_last_error_reported(fake):
    fake.inject("/model_info", "status", 503, times=10)
    with pytest.raises(SGLangUnavailableError, match=r"failed 3 time\(s\); last error: HTTP 503: injected HTTP 503"):
        quick_client(fake.url, max_retries=2).model_info()
    assert fake.paths() == ["/model_info"] * 3


def test_a_timed_out_attempt_is_retried(fake):
    fake.inject("/model_info", "delay", 3.0, times=1)
    start = time.monotonic()
    assert quick_client(fake.url, timeout_s=0.5, max_retries=1).model_info()["model_path"] == "fake/model"
    assert time.monotonic() - start < 2.5  # the second attempt did not wait for the first (~0.5 s; 3 s if it did)
    fake.inject("/model_info", "delay", 3.0, times=2)
    with pytest.raises(SGLangUnavailableError, match=r"failed 2 time\(s\); last error: ReadTimeout"):
        quick_client(fake.url, timeout_s=0.5, max_retries=1).model_info()


def test_client_errors_are_not_retried_and_carry_the_server_message(fake):
    with pytest.raises(
        SGLangRequestError, match="HTTP 400: SamplingParams.*unexpected keyword argument 'temprature'"
    ) as e:
        quick_client(fake.url).generate({"input_ids": [1, 2], "sampling_params": {"temprature": 1.0}})
    assert e.value.status_code == 400 and e.value.path == "/generate"
    with pytest.raises(SGLangRequestError, match="Please call `init_weights_update_group` first"):
        quick_client(fake.url).update_weights_from_distributed(
            names=["w"], dtypes=["float32"], shapes=[[2]], group_name="g"
        )
    assert fake.paths() == ["/generate", "/update_weights_from_distributed"]


def test_calls_paired_with_collectives_are_sent_once(fake):
    fake.inject("/init_weights_update_group", "status", 503, times=5)
    with pytest.raises(SGLangUnavailableError, match="not retried"):
        quick_client(fake.url, max_retries=3).init_weights_update_group(
            master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2, group_name="g", backend="gloo"
        )
    assert fake.paths() == ["/init_weights_update_group"]


def test_a_refused_connection_is_retried_then_reported():
    start = time.monotonic()
    with pytest.raises(SGLangUnavailableError, match=r"failed 3 time\(s\); last error: ConnectError"):
        quick_client(f"http://127.0.0.1:{free_port()}").model_info()
    assert time.monotonic() - start < 5


def test_a_dead_server_fails_fast():
    client = quick_client("http://127.0.0.1:9", liveness=lambda: "process 42 exited with code 1")
    with pytest.raises(SGLangServerDiedError, match="exited with code 1"):
        client.generate({"input_ids": [1]})


def test_api_key_is_a_bearer_token_and_health_is_open():
    with FakeSGLang(api_key="k3y") as server:
        assert quick_client(server.url).is_healthy()
        with pytest.raises(SGLangRequestError, match="HTTP 401: Unauthorized"):
            quick_client(server.url).model_info()
        assert quick_client(server.url, api_key="k3y").model_info()["model_type"] == "qwen3_vl"
        assert [c["auth"] for c in server.calls] == [True, False, True]
        with pytest.raises(SGLangRequestError, match="HTTP 401: Unauthorized"):
            quick_client(server.url, api_key="k3y-not").generate({"input_ids": [1]})


def test_the_stand_in_checks_the_key_as_sglang_0_5_16_does():
    """`sglang_authorizes` is 0.5.16's `decide_request_auth` for a server with only `--api-key`: `/health*` and
    `/metrics*` open by prefix, everything else (an unknown path too: the middleware runs before routing) needs
    `<bearer in any case> <key>`. tests/gpu/test_sglang_real.py::test_a_server_refuses_calls_without_its_key checks
    the same cases on a real server."""
    from tests.rollout.sglang.fake_server import sglang_authorizes

    for path in ("/health", "/health_generate", "/healthz", "/metrics", "/metrics/x"):
        assert sglang_authorizes(path, None, "k3y")
    for header in (None, "", "Bearer", "Bearer ", "k3y", "Bearer k3y ", "Bearer  k3y", "Basic k3y", "Bearer K3Y"):
        assert not sglang_authorizes("/generate", header, "k3y"), header
        assert not sglang_authorizes("/no_such_route", header, "k3y"), header
    for header in ("Bearer k3y", "bearer k3y", "BEARER k3y"):
        assert sglang_authorizes("/generate", header, "k3y")
    assert sglang_authorizes("/generate", None, None)  # a server without a key (miles_vl starts none)


def test_flush_cache_passes_its_timeout_and_memory_calls_accept_null(fake):
    client = quick_client(fake.url)
    client.flush_cache(timeout_s=12.5)
    client.release_memory_occupation(["kv_cache"])
    client.resume_memory_occupation(["kv_cache"])
    client.release_memory_occupation()
    client.resume_memory_occupation()
    calls = fake.calls
    assert [(c["method"], c["path"], c["query"], c["body"]) for c in calls] == [
        ("POST", "/flush_cache", {"timeout": "12.5"}, None),
        ("POST", "/release_memory_occupation", {}, {"tags": ["kv_cache"]}),
        ("POST", "/resume_memory_occupation", {}, {"tags": ["kv_cache"]}),
        ("POST", "/release_memory_occupation", {}, {"tags": None}),
        ("POST", "/resume_memory_occupation", {}, {"tags": None}),
    ]
    assert not fake.state.dead and fake.state.released == set()


def _busy(fake, seconds: float) -> threading.Thread:
    """A /generate that runs for `seconds` (a delay fault), started in a thread; returns once the server counts it."""
    fake.inject("/generate", "delay", seconds)
    thread = threading.Thread(
        target=quick_client(fake.url, timeout_s=30).generate,
        args=({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},),
    )
    thread.start()
    deadline = time.monotonic() + 5
    while fake.state.running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return thread


def test_flush_cache_is_refused_while_requests_run_as_0_5_16_refuses_it(fake):
    """0.5.16 flushes only an idle server (flush_wrapper.py): with timeout 0 a busy server answers 400 "Flush cache
    failed.", with a timeout it waits and answers 400 "Timed out waiting for idle state." if still busy, and flushes as
    soon as the requests are done; a refusal is not retried and says what to do; a negative timeout is a 400 too."""
    client = quick_client(fake.url)
    thread = _busy(fake, 3.0)
    with pytest.raises(SGLangRequestError, match=r"HTTP 400: Flush cache failed\..*no request is running or waiting"):
        client.flush_cache(timeout_s=0)
    with pytest.raises(SGLangRequestError, match=r"HTTP 400: Timed out waiting for idle state.*after waiting 0.2s"):
        client.flush_cache(timeout_s=0.2)
    start = time.monotonic()
    client.flush_cache(timeout_s=10)  # waits for the request, then flushes
    assert time.monotonic() - start < 8 and fake.state.running == 0
    thread.join()
    assert [c["path"] for c in fake.calls].count("/flush_cache") == 3  # each refusal was sent once
    with pytest.raises(SGLangRequestError, match="HTTP 400: query.timeout: Input should be greater than or equal to 0"):
        client.flush_cache(timeout_s=-1)


def test_release_and_resume_are_never_sent_twice(fake):
    """Neither is idempotent in 0.5.16 (a second resume raises KeyError in the scheduler, which kills the server), so a
    5xx or a timeout is reported, not retried."""
    client = quick_client(fake.url, max_retries=3)
    for path, call in (
        ("/release_memory_occupation", client.release_memory_occupation),
        ("/resume_memory_occupation", client.resume_memory_occupation),
    ):
        fake.inject(path, "status", 503)
        with pytest.raises(SGLangUnavailableError, match=r"failed 1 time\(s\).*not retried"):
            call()
        assert fake.paths().count(path) == 1


def test_a_busy_release_or_a_resume_of_unreleased_memory_kills_the_server(fake):
    """The stand-in's model of 0.5.16's scheduler: release while a request runs fails its idle assert, resume of a tag
    never released fails `offload_tags.remove`; either exception kills the whole server (no answer, then nothing)."""
    client = quick_client(fake.url, max_retries=0)
    thread = _busy(fake, 0.5)
    with pytest.raises(SGLangUnavailableError, match="RemoteProtocolError"):
        client.release_memory_occupation()
    thread.join()
    assert (
        fake.state.dead
        and "AssertionError: release_memory_occupation should be called only when server is idle."
        in (fake.state.log[-2])
    )
    assert not quick_client(fake.url).is_healthy()
    with FakeSGLang() as fresh:
        with pytest.raises(SGLangUnavailableError):
            quick_client(fresh.url, max_retries=0).resume_memory_occupation(["weights"])
        assert fresh.state.dead and "KeyError: 'weights'" in fresh.state.log[-2]


def test_a_request_adds_no_line_to_an_info_log_and_a_retry_says_why(fake, caplog):
    """httpx's own line per request is off (it was a third of the 8B run's log); the client's retry warning is not."""
    import logging

    fake.inject("/model_info", "status", 503, times=1)
    with caplog.at_level(logging.INFO):
        quick_client(fake.url, max_retries=1).model_info()
        quick_client(fake.url).model_info()
    lines = [(r.name, r.getMessage()) for r in caplog.records]
    assert not [name for name, _ in lines if name.startswith("httpx")], lines
    assert [m for _, m in lines if "/model_info failed (HTTP 503" in m and "retry 1/1" in m], lines
