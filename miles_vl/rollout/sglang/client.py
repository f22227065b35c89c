"""HTTP client for one SGLang server: every call has a timeout, retries are bounded, failures say what to do.

The endpoints and their request/response schemas are those of SGLang 0.5.16 (PyPI wheel
`sglang-0.5.16-cp312-cp312-manylinux_2_34_x86_64.whl`, sha256 b8ed16e7...b826ea8e; see docs/sglang.md):

- routes: `python/sglang/srt/entrypoints/http_server.py` (`/health_generate`, `/model_info`, `/server_info`,
  `/generate`, `/flush_cache`, `/update_weights_from_tensor`, `/init_weights_update_group`,
  `/update_weights_from_distributed`, `/destroy_weights_update_group`, `/update_weight_version`,
  `/release_memory_occupation`, `/resume_memory_occupation`, `/weights_checker`);
- bodies: `python/sglang/srt/managers/io_struct.py` (`GenerateReqInput`, `UpdateWeightsFromTensorReqInput`,
  `UpdateWeightsFromDistributedReqInput`, `InitWeightsUpdateGroupReqInput`, `DestroyWeightsUpdateGroupReqInput`,
  `UpdateWeightVersionReqInput`, `ReleaseMemoryOccupationReqInput`, `ResumeMemoryOccupationReqInput`,
  `CheckWeightsReqInput`);
- auth: `python/sglang/srt/utils/auth.py` (`Authorization: Bearer <api_key>` on every route but `/health*` and
  `/metrics*`, which are always open).

What the server answers on failure (0.5.16): `/generate` 400 `{"error": {"message": ...}}` (bad input, or a request
the scheduler aborted with 400, e.g. an over-long prompt), 500/503 `{"object": "error", "message": ..., "code": ...}`
(a request aborted for memory or a queue timeout: `TokenizerManager._handle_abort_finish_reason`), 500 "Internal
Server Error" for an exception the route does not catch (the reason is in the server log only); the weight routes 400
`{"success": false, "message": ...}`; `/flush_cache` 400 with a plain-text body when requests are still running;
auth 401 `{"error": "Unauthorized"}`; `/health_generate` 503 while the server starts or is unhealthy. An exception in
the scheduler (releasing memory while a request runs, resuming memory that is not released) kills the whole server:
the call gets no answer.

Retry rule: connection errors, timeouts and 429/500/502/503/504 are retried `max_retries` times with exponential
backoff; any other 4xx is the caller's mistake and raises at once. Calls that must not run twice are sent once: the
NCCL weight calls (their broadcasts pair up with the trainer's) and memory release/resume (not idempotent in 0.5.16).
A `liveness` callback (the supervising process's `death_reason`) turns "connection refused" into "the server process
died" without waiting out the retries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from miles_vl.rollout.types import EngineDiedError

log = logging.getLogger(__name__)
# httpx logs every request at INFO: one line per weight bucket and engine, a third of the 8B run's driver log
# (docs/gpu-runs/2026-11-27-loop-8b-tp2cp2-4xh200). This client logs its retries and raises its failures itself.
# A level the user's program set for httpx stands.
if logging.getLogger("httpx").level == logging.NOTSET:
    logging.getLogger("httpx").setLevel(logging.WARNING)

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class SGLangError(RuntimeError):
    """Base class of everything that goes wrong while talking to an SGLang server."""


class SGLangUnavailableError(SGLangError):
    """The server did not answer usefully within the allowed attempts (down, overloaded, or too slow)."""


class SGLangRequestError(SGLangError):
    """The server answered and refused the request (4xx, or `"success": false`)."""

    def __init__(self, message: str, *, status_code: int, path: str):
        super().__init__(message)
        self.status_code = status_code
        self.path = path


class SGLangServerDiedError(SGLangError, EngineDiedError):
    """The supervised server process is gone (exit code and the tail of its log are in the message)."""


class SGLangResponseError(SGLangError):
    """The server answered 200 with a body that does not follow the SGLang 0.5.16 schema we rely on."""


@dataclass(frozen=True)
class RequestPolicy:
    """How an `SGLangClient` times out and retries its calls (the retry rule of this module).

    Attributes:
        timeout_s: per-attempt timeout of every call (read, write and pool); connecting gets at most 10 s
            (rollout.sglang.request_timeout_s).
        max_retries: extra attempts for retryable failures (0: try once; rollout.sglang.max_retries).
        backoff_s: sleep before the first retry; doubled per retry, capped at `max_backoff_s`.
        max_backoff_s: cap of the backoff.

    Raises:
        ValueError: `timeout_s` <= 0 or `max_retries` < 0.
    """

    timeout_s: float = 600.0
    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, found {self.timeout_s} (rollout.sglang.request_timeout_s)")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, found {self.max_retries} (rollout.sglang.max_retries)")


class SGLangClient:
    """Calls one SGLang server. Thread-safe: the engine shares one client across its request threads.

    Args:
        base_url: e.g. `http://127.0.0.1:30000` (no trailing slash needed).
        api_key: sent as `Authorization: Bearer <api_key>` when set (the server's `--api-key`).
        policy: timeouts and retries (`RequestPolicy`).
        liveness: returns None while the server process lives, else why it died; checked before each attempt
            and after each failure, so a dead server fails fast with `SGLangServerDiedError`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        policy: RequestPolicy = RequestPolicy(),
        liveness: Callable[[], str | None] | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.policy = policy
        self.liveness = liveness
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(policy.timeout_s, connect=min(10.0, policy.timeout_s)),
            # The engine runs up to `max_concurrency` requests at once; keep that many connections.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            trust_env=False,  # never route loopback traffic through an HTTP(S)_PROXY from the environment
        )

    # ------------------------------------------------------------------------------------------------------------
    # transport

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        retry: bool = True,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """One call with the retry rule of this module; returns the 2xx response.

        Args:
            method: "GET" or "POST".
            path: route, e.g. "/generate".
            json: request body (sent as JSON) or None.
            params: query parameters.
            retry: False for calls that must not be sent twice.
            timeout_s: this call's per-attempt timeout instead of the client's.

        Returns:
            The successful response.

        Raises:
            SGLangServerDiedError: `liveness` reports the server process dead.
            SGLangRequestError: a non-retryable 4xx.
            SGLangUnavailableError: every attempt failed with a retryable error.
        """
        attempts = 1 + (self.policy.max_retries if retry else 0)
        timeout = None if timeout_s is None else httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
        last = ""
        for attempt in range(attempts):
            self._check_alive(path)
            try:
                kwargs: dict[str, Any] = {"json": json, "params": params}
                if timeout is not None:
                    kwargs["timeout"] = timeout
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as e:  # connect/read/write errors and timeouts
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                if response.is_success:
                    return response
                detail = _error_detail(response)
                if response.status_code not in RETRY_STATUSES:
                    raise SGLangRequestError(
                        f"SGLang {method} {path} at {self.base_url} was refused with HTTP {response.status_code}: "
                        f"{detail}",
                        status_code=response.status_code,
                        path=path,
                    )
                last = f"HTTP {response.status_code}: {detail}"
            self._check_alive(path)
            if attempt + 1 < attempts:
                delay = min(self.policy.backoff_s * 2**attempt, self.policy.max_backoff_s)
                log.warning(
                    "SGLang %s %s failed (%s); retry %d/%d in %.2fs",
                    method,
                    path,
                    last,
                    attempt + 1,
                    attempts - 1,
                    delay,
                )
                time.sleep(delay)
        raise SGLangUnavailableError(
            f"SGLang {method} {path} at {self.base_url} failed {attempts} time(s); last error: {last}. "
            + (
                "Check the server log; raise rollout.sglang.request_timeout_s if generations are long, or "
                "rollout.sglang.max_retries if the server is briefly overloaded."
                if retry
                else "This call is not retried: sending it twice is not safe (the NCCL weight calls pair with the "
                "trainer's collectives; releasing or resuming memory twice kills an SGLang 0.5.16 server)."
            )
        )

    def get_json(self, path: str, **kwargs: Any) -> Any:
        """GET `path`; returns the parsed JSON answer."""
        return self._parse(self.request("GET", path, **kwargs), path)

    def post_json(self, path: str, body: Any, **kwargs: Any) -> Any:
        """POST `body`; returns the parsed JSON answer (None for an empty or `null` body)."""
        return self._parse(self.request("POST", path, json=body, **kwargs), path)

    def _parse(self, response: httpx.Response, path: str) -> Any:
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as e:
            raise SGLangResponseError(
                f"{path} at {self.base_url} answered HTTP {response.status_code} with a body that is not JSON: "
                f"{response.text[:200]!r}"
            ) from e

    def close(self) -> None:
        self._http.close()

    def _check_alive(self, path: str) -> None:
        reason = self.liveness() if self.liveness is not None else None
        if reason is not None:
            raise SGLangServerDiedError(f"SGLang server at {self.base_url} is not running ({path}): {reason}")

    # ------------------------------------------------------------------------------------------------------------
    # health and information

    def is_healthy(self, timeout_s: float = 5.0) -> bool:
        """One `GET /health_generate` (the server generates one token when idle): True on 200, never raises."""
        try:
            response = self._http.get("/health_generate", timeout=httpx.Timeout(timeout_s, connect=timeout_s))
        except httpx.TransportError:
            return False
        return response.status_code == 200

    def model_info(self) -> dict[str, Any]:
        """`GET /model_info`: model_path, is_generation, has_image_understanding, weight_version, ..."""
        return self.get_json("/model_info")

    def server_info(self) -> dict[str, Any]:
        """`GET /server_info`: the server arguments, scheduler info and `version`."""
        return self.get_json("/server_info")

    # ------------------------------------------------------------------------------------------------------------
    # generation and caches

    def generate(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """`POST /generate` with a `GenerateReqInput` body (one request, not a batch); returns the response dict."""
        body = self.post_json("/generate", dict(payload))
        if not isinstance(body, dict):
            raise SGLangResponseError(
                f"/generate at {self.base_url} answered {type(body).__name__}, expected an object"
            )
        return body

    def generate_n(self, payload: Mapping[str, Any], n: int) -> list[dict[str, Any]]:
        """`POST /generate` of a request that asks for `n` samples in all (one prompt with `sampling_params.n = n`,
        or a batch of prompts: prompts x their n); returns the `n` response dicts in SGLang's order (prompt by
        prompt)."""
        body = self.post_json("/generate", dict(payload))
        if not isinstance(body, list) or len(body) != n or not all(isinstance(b, dict) for b in body):
            got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
            raise SGLangResponseError(
                f"/generate for {n} samples at {self.base_url} answered {got}, expected a list of {n} "
                "objects (SGLang 0.5.16 answers one body per sample)"
            )
        return body

    def flush_cache(self, *, timeout_s: float = 0.0) -> None:
        """`POST /flush_cache?timeout=...`: drop the radix (prefix) cache.

        With `timeout_s > 0` the server waits up to that long for running requests to finish before flushing; with 0
        it refuses at once when any request is running. 0.5.16 answers a refusal with HTTP 400 and a plain-text body:
        "Flush cache failed." (busy), "Timed out waiting for idle state." or "Another flush_cache is already in
        progress." (`scheduler_components/flush_wrapper.py`, `http_server.py:905`).

        Raises:
            SGLangRequestError: the server refused (it was not idle).
        """
        try:
            self.request(
                "POST", "/flush_cache", params={"timeout": timeout_s}, timeout_s=max(self.policy.timeout_s, timeout_s)
            )
        except SGLangRequestError as e:
            if e.status_code != 400:
                raise
            raise SGLangRequestError(
                f"{e}. SGLang flushes its cache only when no request is running or waiting, and requests were still "
                f"there after waiting {timeout_s:g}s (requests of another client, or of an attempt that timed out on "
                "our side); wait for them, or raise the flush timeout",
                status_code=400,
                path="/flush_cache",
            ) from e

    # ------------------------------------------------------------------------------------------------------------
    # weights

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> None:
        """`POST /update_weights_from_tensor`: one base64 payload per TP rank of the server (see
        miles_vl/rollout/sglang/weights.py).

        Safe to retry: loading the same tensors twice gives the same weights.
        """
        body = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "weight_version": weight_version,
        }
        self._expect_success("/update_weights_from_tensor", self.post_json("/update_weights_from_tensor", body))

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """`POST /init_weights_update_group`: the server's TP ranks join a process group as ranks
        `rank_offset + tp_rank`. Returns only once the group has formed, so the trainer (rank 0) must be joining it
        concurrently. Not retried."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._expect_success(
            "/init_weights_update_group", self.post_json("/init_weights_update_group", body, retry=False)
        )

    def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> None:
        """`POST /update_weights_from_distributed`: the server allocates these tensors and receives each one, in
        order, by a broadcast from group rank 0. Returns after the last broadcast arrived. Not retried."""
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": False,
            "weight_version": weight_version,
        }
        self._expect_success(
            "/update_weights_from_distributed", self.post_json("/update_weights_from_distributed", body, retry=False)
        )

    def destroy_weights_update_group(self, group_name: str) -> None:
        """`POST /destroy_weights_update_group`."""
        body = self.post_json("/destroy_weights_update_group", {"group_name": group_name}, retry=False)
        self._expect_success("/destroy_weights_update_group", body)

    def update_weight_version(self, new_version: str) -> None:
        """`POST /update_weight_version`: the label `meta_info.weight_version` carries from now on."""
        body = self.post_json("/update_weight_version", {"new_version": new_version, "abort_all_requests": False})
        self._expect_success("/update_weight_version", body)

    # ------------------------------------------------------------------------------------------------------------
    # memory (colocated placement; the server needs --enable-memory-saver)

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """`POST /release_memory_occupation`; tags among "kv_cache", "weights", "cuda_graph" (None: all).

        The server must be idle: 0.5.16's scheduler asserts it (`scheduler_components/weight_updater.py:187`), and a
        failed assert kills the whole server. Not retried: a second release of paused memory is not a no-op there.
        """
        self.post_json("/release_memory_occupation", {"tags": None if tags is None else list(tags)}, retry=False)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """`POST /resume_memory_occupation`; same tags as release. Resuming a tag that is not released raises a
        KeyError in 0.5.16's scheduler (`offload_tags.remove`, `weight_updater.py:238`), which kills the server, so
        this call is never retried (a retry after a timeout would resume twice)."""
        self.post_json("/resume_memory_occupation", {"tags": None if tags is None else list(tags)}, retry=False)

    def check_weights(self, action: str = "checksum") -> dict[str, Any]:
        """`POST /weights_checker` (`CheckWeightsReqInput`): with "checksum", `{"success", "message", "ranks": [{
        "checksums": {parameter: hash}, "per_gpu_checksum", "parallelism_info": {"tp_rank", ...}}, ...],
        "per_engine_checksum"}`, one entry per TP rank, under SGLang's own parameter names. HTTP 400 on failure."""
        body = self.post_json("/weights_checker", {"action": action})
        self._expect_success("/weights_checker", body)
        return body

    def _expect_success(self, path: str, body: Any) -> None:
        if not isinstance(body, dict) or "success" not in body:
            raise SGLangResponseError(f"{path} at {self.base_url} answered {body!r}; expected {{'success': ...}}")
        if not body["success"]:  # 0.5.16 answers 400 on failure, which raises earlier; this guards a 200 + false
            raise SGLangRequestError(
                f"SGLang {path} at {self.base_url} failed: {body.get('message')}", status_code=200, path=path
            )


def _error_detail(response: httpx.Response, limit: int = 500) -> str:
    """The server's own words: `error.message`, `message` or `error` of a JSON body, else the text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:limit].strip() or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:limit]
        if "message" in body:
            return str(body["message"])[:limit]
        if error is not None:
            return str(error)[:limit]
        if "detail" in body:  # FastAPI's HTTPException and validation errors
            return str(body["detail"])[:limit]
    return str(body)[:limit]
