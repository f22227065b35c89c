"""The production rollout engine: `RolloutEngine` over one SGLang server's HTTP API.

    engine = SGLangRolloutEngine(SGLangClient("http://127.0.0.1:30000"), tokens, weight_version="base")
    groups = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=1024))   # prompts carry `.images`

Prompts (`PromptLike`): with `pixel_dir` (a server with miles_vl's SGLang plugin, which reads pixel values from that
directory) the engine sends each prompt's canonical ids, `pixel_values` / `pixel_values_videos` and grids, as the
trainer sees them (generate.py, `pixel_media`); videos go too. Without it (SGLang's own server), every prompt
with images needs `images`: the decoded images (PIL, or encoded bytes) in the order their blocks appear in
`prompt_ids`, which SGLang processes again (`png_media`); videos are refused there. Every response is checked to
have used exactly our prompt ids (`PromptMismatchError` names the first differing position).

`n` samples per prompt go out as one request with `sampling_params.n = n` (`one_request_per_prompt`, the default
unless the server samples deterministically): SGLang then decodes the prompt's images, runs its image processor and
hashes the pixels once per prompt instead of once per sample, and prefills the prompt once (generate.py). That work
is serial in SGLang's one tokenizer process and dominated the time before the first decode step (docs/benchmarks.md).
A sample that SGLang aborts (200 with an abort finish reason) is sent again alone. With
`--enable-deterministic-inference` SGLang gives all `n` samples of a request the one `sampling_seed`, so the `n`
samples would be the same: there each sample is its own request, with its own seed (a pure function of
`params.seed`, the prompt index and the sample index), reproducible per sample; the shared prompt prefix is still
computed once per batch wave by SGLang's radix cache. Either way results come back in a fixed order.

With `prompts_per_request` > 1 (miles_vl's SGLang plugin: `miles_vl/sglang_plugin/grouping.py`), up to that many
prompts, each with its `n` samples, go out as one batched request: the plugin prefills them as they are tokenized and
then sends every sample to the scheduler at once, so they start decoding together instead of trickling in
(docs/sglang.md). SGLang's own server takes such a request too, but waits for each prompt's prefill in turn, so the
engine sends it one prompt per request.

Partial rollouts (`partial_rollouts=True`, docs/async.md): `pause_generation()` before a weight sync aborts every
request in flight (`POST /abort_request {"abort_all": true}`) and holds new ones; SGLang 0.5.16 answers each aborted
request with its output so far and one logprob per token (generate.py, `parse_aborted_response`), which the engine
keeps. `continue_generation()` after the sync sends each kept sample again as prompt + tokens so far (its images with
it: the server rebuilds the prefix from them) for the remaining `max_new_tokens`, under the new weights; the sample's
response is the concatenation and `Generation.spans` records the weight version of each span, whose logprobs are the
ones that version's server returned. A sample whose first span ended with EOS or reached `max_new_tokens` is finished
there. `abort_all`, not a rid: SGLang gives the `n` copies of a request fresh rids (`regenerate_rid`), which the
engine never sees, and the server serves this engine alone. An abort that reaches a request before SGLang started it
(0.5.17 answers it with HTTP 499 and no output: `UNSTARTED_ABORT`) keeps nothing and sends the sample again after the
sync, as one aborted in the queue.

Weights: `load_weights` is the colocated path (`/update_weights_from_tensor`, rollout/sglang/weights.py); a caller
that receives the buckets one at a time calls `begin_weight_sync`, `load_weight_bucket` per bucket and
`finish_weight_sync` (a server restart in between is detected and the sync must begin again); after an NCCL sync driven
by the trainer (`DistributedWeightSender`), call `expect_weight_version(version)`. Every response's
`meta_info.weight_version` must equal the version last synced: a server that restarted (and reloaded `model_path`)
cannot silently serve stale weights. Colocated memory: `release_memory()` / `resume_memory(tags)` around training need
a server started with `--enable-memory-saver`; the weights can be resumed alone (`["weights"]`, before the sync, which
refuses released weights) and the KV cache and CUDA graphs after it; after the weights' resume they are undefined
(unless the server keeps a CPU backup) and `generate` refuses to run until `load_weights` has been called and all
memory is resumed. Every colocated sync is verified
(verify.py): names the server's checkpoint does not have are refused before they are sent (SGLang would skip them
silently), and a few small tensors sent with new values must have changed on the server.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image
from torch import Tensor

from miles_vl.models import SpecialTokens
from miles_vl.models.qwen3_vl.tokens import vision_token_ids
from miles_vl.rollout.sglang.client import SGLangClient, SGLangError, SGLangRequestError, SGLangResponseError
from miles_vl.rollout.sglang.generate import (
    GenerationAbortedError,
    PromptMedia,
    batch_payload,
    build_generate_payload,
    parse_aborted_response,
    parse_generate_response,
    pixel_media,
    png_media,
    prompt_images,
    remove_files,
    sampling_seed,
    vision_inputs,
)
from miles_vl.rollout.sglang.verify import SyncVerifier, WeightSyncError
from miles_vl.rollout.sglang.weights import finish_tensor_sync, send_tensor_bucket
from miles_vl.rollout.types import MEMORY_TAGS, Generation, PromptLike, SamplingParams
from miles_vl.rollout.weight_sync import DEFAULT_BUCKET_BYTES, SyncReport, iter_buckets

log = logging.getLogger(__name__)


class SGLangPrompt(PromptLike, Protocol):
    """A canonical prompt plus its images (PIL images or encoded bytes, prompt order), which the sglang engine sends
    to a server without a pixel directory."""

    images: Sequence[Image.Image | bytes]


class WeightVersionError(SGLangError):
    """The server's weights are not the ones last synced (restart, or a sync that did not complete)."""


# SGLang 0.5.17 answers an abort_all that reaches a request before its scheduler holds it (still tokenizing, or its
# group's prefix being prefilled: tokenizer_manager.py `_raise_if_logical_rid_aborted`) with HTTP 499 and no output;
# 0.5.16 lets such a request start and the next abort_all reaches it. For a pause of ours, the 499 stands for this
# answer: aborted, no tokens so far (`parse_aborted_response`), so the sample is sent again whole after the sync.
UNSTARTED_ABORT = {"meta_info": {"finish_reason": {"type": "abort", "message": "aborted before it started (HTTP 499)"}}}


class EngineStateError(RuntimeError):
    """A call that the engine's memory/weights state does not allow (e.g. generate while memory is released)."""


@dataclass
class _SyncInProgress:
    restarts: int  # the server's restart count when the sync began
    start: float
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class EngineOptions:
    """How an `SGLangRolloutEngine` sends requests and weights, whatever server it talks to: the settings its host
    (`SGLangRolloutHost(..., options=...)`) hands over unchanged. What the engine must know of its server (TP size,
    memory saver, pixel directory, ...) is given to the engine itself.

    Attributes:
        ban_vision_tokens: give `<|image_pad|>` and friends a -1e9 logit bias (as the hf engine does).
        max_concurrency: requests in flight at once; with `prompts_per_request` > 1, prompts (one request carries
            up to that many: a prompt's pixels wait in the server's memory until its samples are sent).
        weight_bucket_bytes: bound of one `/update_weights_from_tensor` bucket.
        weight_device: where `load_weights` moves tensors before sharing them with the server ("cuda" needs this
            process to see the engine's GPU); "auto": "cuda" when available and the server has one TP rank, else the
            tensors stay where they are (the CPU: every TP rank maps them).
        flush_timeout_s: how long `/flush_cache` may wait for running requests after a sync.
        max_abort_retries: times a request that SGLang aborted is sent again.
        verify_weights: after every colocated sync, check with `/weights_checker` that a few small tensors sent with
            new values changed on the server (verify.py).
        one_request_per_prompt: send a prompt's `n` samples as one request (module docstring); None: yes unless the
            server is deterministic (where it is refused: the samples would be identical).
        prompts_per_request: with `one_request_per_prompt`, how many prompts (each with its `n` samples) one request
            carries; more than 1 only for a server with miles_vl's SGLang plugin (module docstring).

    Raises:
        ValueError: `max_concurrency` or `prompts_per_request` below 1.
    """

    ban_vision_tokens: bool = True
    max_concurrency: int = 128
    weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    weight_device: str | None = "auto"
    flush_timeout_s: float = 60.0
    max_abort_retries: int = 2
    verify_weights: bool = True
    one_request_per_prompt: bool | None = None
    prompts_per_request: int = 1

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, found {self.max_concurrency}")
        if self.prompts_per_request < 1:
            raise ValueError(f"prompts_per_request must be >= 1, found {self.prompts_per_request}")


class SGLangRolloutEngine:
    """`RolloutEngine` backed by one SGLang server.

    Args:
        client: the server's client (timeouts and retries live there).
        tokens: special token ids; EOS ids become `stop_token_ids`, vision ids are banned when asked.
        options: how requests and weights are sent (`EngineOptions`).
        tp_size: the server's TP size (one weight payload per rank).
        weight_version: the version the server starts with (`ServerSpec.weight_version`); None: unchecked until the
            first sync.
        memory_saver: the server runs with `--enable-memory-saver` (colocated); required by `release_memory`.
        weights_cpu_backup: the server runs with `--enable-weights-cpu-backup` (weights survive release/resume).
        known_names: the tensor names of the checkpoint the server loaded (`verify.checkpoint_names(model_path)`):
            a colocated sync refuses any other name, which SGLang would skip silently; None: names are not checked.
        deterministic: the server runs with `--enable-deterministic-inference` (or `--rl-on-policy-target`, which turns
            it on): only then does it sample with each request's `sampling_seed`. Without it the engine warns once
            that sampled responses are not reproducible by `SamplingParams.seed`.
        pixel_dir: the server's pixel directory (`MILES_VL_SGLANG_PIXEL_DIR` of a server with miles_vl's SGLang
            plugin): prompts go as their own ids and pixel values; None: as one pad per image and PNG images.
        pixel_dtype: the dtype pixel values are written in: the server model's dtype (the model casts them to it),
            or float32.
        spatial_merge_size: the vision tower's merge (vision_config.spatial_merge_size): checks ids against grids.
        partial_rollouts: `pause_generation` keeps the samples it aborts and `continue_generation` continues them
            under the weights synced in between (module docstring).

    Raises:
        ValueError: `options.one_request_per_prompt` on a deterministic server.
    """

    def __init__(
        self,
        client: SGLangClient,
        tokens: SpecialTokens,
        options: EngineOptions = EngineOptions(),
        *,
        tp_size: int = 1,
        weight_version: str | None = None,
        memory_saver: bool = False,
        weights_cpu_backup: bool = False,
        known_names: frozenset[str] | None = None,
        deterministic: bool = False,
        pixel_dir: str | None = None,
        pixel_dtype: torch.dtype = torch.float32,
        spatial_merge_size: int = 2,
        partial_rollouts: bool = False,
    ):
        if options.one_request_per_prompt and deterministic:
            raise ValueError(
                "one_request_per_prompt with a deterministic server (--enable-deterministic-inference): SGLang gives "
                "every sample of a request the same sampling_seed, so the n samples of a prompt would be identical; "
                "set rollout.sglang.one_request_per_prompt to false (or null) for deterministic rollouts"
            )
        self.client = client
        self.tokens = tokens
        self.options = options
        self.stop_token_ids = tuple(int(t) for t in tokens.eos_token_ids)
        self.banned_token_ids = vision_token_ids(tokens) if options.ban_vision_tokens else ()
        self.tp_size = tp_size
        # a CUDA tensor of this process's GPU reaches TP rank 0's GPU only (a TP rank on another GPU cannot copy from
        # it: weights.ipc_sources); for more TP ranks the tensors stay in shared CPU memory, which each copies in
        auto = "cuda" if torch.cuda.is_available() and tp_size == 1 else None
        self.weight_device = auto if options.weight_device == "auto" else options.weight_device
        self.memory_saver = memory_saver
        self.weights_cpu_backup = weights_cpu_backup
        self.deterministic = deterministic
        grouped = options.one_request_per_prompt
        self.one_request_per_prompt = not deterministic if grouped is None else grouped
        self.pixel_dir = pixel_dir
        self.pixel_dtype = pixel_dtype
        self.spatial_merge_size = spatial_merge_size
        self.verifier = SyncVerifier(client, known_names, check_values=options.verify_weights)
        self._warned_seed = False
        self.initial_weight_version = weight_version
        self.weight_version = weight_version  # what every response must report
        self.syncs = 0
        self.released: set[str] = set()  # memory tags released (MEMORY_TAGS), not yet resumed
        self.weights_missing: str | None = None  # why the server's weights cannot be used now, if they cannot
        self.server_restarts = 0
        self._sync: _SyncInProgress | None = None
        self.partial_rollouts = partial_rollouts
        self._gate = threading.Condition()  # guards the three below; generate's threads wait on it while paused
        self._paused = False
        self._pauses = 0  # pause_generation calls so far: a request sent before the last one was aborted by it
        self._sending = 0  # /generate requests in flight

    # ------------------------------------------------------------------------------------------------------------
    # generation

    def generate(self, prompts: Sequence[SGLangPrompt], params: SamplingParams) -> list[list[Generation]]:
        """`params.n` generations per prompt, in prompt order (see the module docstring for how n is sent).

        Raises:
            ValueError: bad sampling parameters or prompts without their images.
            EngineStateError: memory released, or weights undefined since `resume_memory`.
            PromptMismatchError: SGLang used other prompt ids than ours.
            WeightVersionError: the server answers with other weights than the last synced ones.
            SGLangError: the server failed (after the client's bounded retries).
        """
        _check_params(params)
        if not self.partial_rollouts:  # else per request, once no pause holds it (a sync may be in progress now)
            self._check_ready()
        if params.temperature > 0 and not self.deterministic and not self._warned_seed:
            self._warned_seed = True
            log.warning(
                "SGLang %s runs without --enable-deterministic-inference: SGLang 0.5.16 then ignores sampling_seed "
                "(srt/sampling/sampling_batch_info.py:114), so sampled responses are not reproducible by "
                "SamplingParams.seed; add the flag to rollout.sglang.extra_args for reproducible rollouts",
                self.client.base_url,
            )
        if not prompts:
            return []
        for i, prompt in enumerate(prompts):  # a bad prompt fails here, before any request
            self._check_prompt(prompt, i)
        # a job: (prompt indices, sample index); None: all `n` samples of those prompts in one request
        if self.one_request_per_prompt and params.n > 1:
            step = self.options.prompts_per_request
            jobs = [(range(s, min(s + step, len(prompts))), None) for s in range(0, len(prompts), step)]
            in_flight = max(1, self.options.max_concurrency // step)  # about max_concurrency prompts at once, as step 1
        else:
            jobs = [(range(i, i + 1), j) for i in range(len(prompts)) for j in range(params.n)]
            in_flight = self.options.max_concurrency
        results: dict[int, list[Generation]] = {i: [] for i in range(len(prompts))}
        with ThreadPoolExecutor(max_workers=min(in_flight, len(jobs)), thread_name_prefix="sglang-gen") as pool:

            def run(indices: range, j: int | None) -> list[tuple[int, list[Generation]]]:
                media = dict(zip(indices, self.prompt_media(prompts, indices), strict=True))  # this job's files
                try:
                    if j is None:
                        return self._generate_groups(prompts, media, params, indices)
                    i = indices[0]
                    return [(i, [self._generate_one(prompts[i].prompt_ids, media[i], params, i, j)])]
                finally:
                    self.release_media(media.values())

            futures = [pool.submit(run, indices, j) for indices, j in jobs]
            try:
                for future in futures:
                    for i, generations in future.result():
                        results[i] += generations
            except BaseException:
                # Drop queued requests; those in flight end within the client's timeout.
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return [results[i] for i in range(len(prompts))]

    def _check_prompt(self, prompt: SGLangPrompt, i: int) -> None:
        """What `prompt_media` would refuse of prompt `i`, checked without encoding or writing anything."""
        if self.pixel_dir is None:
            prompt_images(prompt, i, self.tokens.video_token_id)
        else:
            vision_inputs(prompt, i, self.tokens, self.spatial_merge_size)

    def prompt_media(self, prompts: Sequence[SGLangPrompt], indices: Sequence[int] | None = None) -> list[PromptMedia]:
        """Prompts `indices` (default: all) as they go into a request (generate.py): PNG data URLs, or pixel values
        written into the pixel directory, built in a pool. If one fails, the files written for the others are
        removed and the first failure (in order) is raised. The caller hands what it gets to `release_media` once its
        requests are answered: the files of the prompts in flight are all the pixel directory holds."""
        indices = range(len(prompts)) if indices is None else indices

        def build(i: int) -> PromptMedia:
            if self.pixel_dir is None:
                return png_media(prompts[i], i, self.tokens)
            return pixel_media(
                prompts[i],
                i,
                self.tokens,
                directory=self.pixel_dir,
                dtype=self.pixel_dtype,
                spatial_merge_size=self.spatial_merge_size,
            )

        if len(indices) == 1:
            return [build(indices[0])]
        with ThreadPoolExecutor(
            max_workers=min(self.options.max_concurrency, len(indices)), thread_name_prefix="media"
        ) as pool:
            futures = [pool.submit(build, i) for i in indices]
        built, errors = [], []
        for future in futures:
            try:
                built.append(future.result())
            except Exception as e:  # noqa: BLE001 (re-raised below, after the clean-up)
                errors.append(e)
        if errors:
            self.release_media(built)
            raise errors[0]
        return built

    def release_media(self, media: Iterable[PromptMedia]) -> None:
        """Delete the pixel files of `media` (from `prompt_media`)."""
        if self.pixel_dir is not None:
            remove_files(self.pixel_dir, [f for m in media for f in m.files])

    def _generate_groups(
        self, prompts: Sequence[SGLangPrompt], media: dict[int, PromptMedia], params: SamplingParams, indices: range
    ) -> list[tuple[int, list[Generation]]]:
        """The `params.n` samples of each prompt in `indices`, as one request; a sample SGLang aborted is sent again
        alone. Returns (prompt index, its samples) in prompt order.

        Sent in the batch form even for one prompt: 0.5.16 turns a single prompt with `n > 1` into a batch of one
        whose `image_data` must then be one entry per prompt (`GenerateReqInput._normalize_image_data`,
        `srt/managers/io_struct.py:509`), so a flat list of two images would be refused."""
        n = params.n
        payloads = [self._payload(media[i], params, sampling_seed(params.seed, i, 0, n), n=n) for i in indices]
        count = n * len(indices)
        bodies, pauses, version = self._send(
            self.client.generate_n, batch_payload(payloads), count, unstarted=[UNSTARTED_ABORT] * count
        )

        def one(k: int, j: int, body: dict) -> Generation:
            i = indices[k]
            return self._generate_one(prompts[i].prompt_ids, media[i], params, i, j, answer=(body, pauses, version))

        jobs = [(k, j, body) for k in range(len(indices)) for j, body in enumerate(bodies[k * n : (k + 1) * n])]
        if self.partial_rollouts and len(jobs) > 1:  # the kept samples are continued at once, not one after another
            workers = min(len(jobs), self.options.max_concurrency)
            with ThreadPoolExecutor(workers, thread_name_prefix="sglang-continue") as pool:
                done = list(pool.map(lambda job: one(*job), jobs))
        else:
            done = [one(*job) for job in jobs]
        return [(i, done[k * n : (k + 1) * n]) for k, i in enumerate(indices)]  # SGLang answers prompt by prompt

    def _generate_one(
        self,
        prompt_ids: Tensor,
        media: PromptMedia,
        params: SamplingParams,
        i: int,
        j: int,
        answer: tuple[dict, int, str | None] | None = None,
    ) -> Generation:
        """Sample `j` of prompt `i`. `answer`: (body, pause count, weight version) of the request that already carried
        it (a group's, `_send`); None: sent here. A sample SGLang aborted on its own is sent again alone (at most
        `max_abort_retries` times); one `pause_generation` aborted is kept and continued (module docstring)."""
        prompt = [int(t) for t in prompt_ids.tolist()]
        seed = sampling_seed(params.seed, i, j, params.n)
        out: list[int] = []  # the response so far, over the spans of a continued sample
        logprobs: list[float] = []
        spans: list[tuple[int, int, str | None]] = []
        retries = 0 if answer is None else -1  # a group's sample aborted is sent alone max_abort_retries + 1 times
        while True:
            rest = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(out))
            if answer is None:
                payload = self._payload(media, rest, seed, prefix=out)
                answer = self._send(self.client.generate, payload, unstarted=UNSTARTED_ABORT)
            (body, pauses, version), answer = answer, None
            ours = self.partial_rollouts and pauses != self._pauses  # a pause_generation came since it was sent
            kept = parse_aborted_response(body, prompt_ids=prompt + out, prompt_index=i) if ours else None
            if kept is not None:  # aborted by that pause: keep its tokens, continue after it
                new, new_logprobs, reported = kept
                self._check_version(reported, i, version)
                if len(new) > rest.max_new_tokens:
                    raise SGLangResponseError(
                        f"/generate for prompt {i}: {len(new)} tokens returned, max_new_tokens was "
                        f"{rest.max_new_tokens}"
                    )
                if new:
                    spans.append((len(out), len(out) + len(new), version))
                    out, logprobs = out + new, logprobs + new_logprobs
                finished = "stop" if out and out[-1] in self.stop_token_ids else None
                if len(out) == params.max_new_tokens:
                    finished = finished or "length"
                if finished:
                    return _joined(out, logprobs, finished, spans)
                continue  # after the sync: continue_generation lets the request through
            try:  # partial rollouts: the version it was sent under (a sync may have come since); else the last synced
                generation = self._parse(body, prompt + out, rest, i, version if self.partial_rollouts else None)
            except GenerationAbortedError as e:
                retries += 1
                if retries > self.options.max_abort_retries:
                    raise SGLangError(f"{e} ({retries} attempts); see the server log for why it aborts") from e
                log.warning("%s (sample %d of %d); sending it again alone", e, j, params.n)
                continue
            if not self.partial_rollouts:  # one request: one version, the last synced
                return generation
            # the span of this request's tokens, in the version it was sent under: also for one sent only after a sync
            # (queued at the pause, aborted before its first token, a later round or batch), whose tokens are that
            # version's, not its batch's older one
            spans.append((len(out), len(out) + generation.response_ids.numel(), version))
            out, logprobs = out + generation.response_ids.tolist(), logprobs + generation.logprobs.tolist()
            return _joined(out, logprobs, generation.finish_reason, spans)

    def _send(self, call: Callable[..., object], *args: object, unstarted: object = None) -> tuple:
        """`call(*args)` (one /generate) once no pause holds new requests, counted as in flight while it runs;
        returns (its answer, the pause count and the weight version when it was sent). `unstarted`: the answer to
        return instead of SGLang 0.5.17's HTTP 499 for a request a pause of ours aborted before the scheduler held
        it (`UNSTARTED_ABORT`, one per sample: aborted with no tokens, sent again after the sync)."""
        with self._gate:
            self._gate.wait_for(lambda: not self._paused)
            if self.partial_rollouts:  # under the gate: no pause (and so no sync) can begin before it is counted
                self._check_ready()
            self._sending += 1
            sent = (self._pauses, self.weight_version)
        try:
            return (call(*args), *sent)
        except SGLangRequestError as e:
            with self._gate:
                ours = self.partial_rollouts and self._pauses != sent[0]
            if unstarted is None or e.status_code != 499 or not ours:
                raise
            log.info("a request aborted by the pause before SGLang started it (HTTP 499): sent again after the sync")
            return (unstarted, *sent)
        finally:
            with self._gate:
                self._sending -= 1
                self._gate.notify_all()

    def pause_generation(self, timeout_s: float = 60.0) -> int:
        """Before a weight sync (partial rollouts): abort every request in flight and hold new ones until
        `continue_generation`. The aborted samples are kept (module docstring). Returns once no request is in flight
        (the server runs none of ours: the sync may change the weights), with how many were.

        `abort_all` is sent again every second while requests remain (as SGLang's own `pause_generation` does in its
        abort mode): one that reached the server after an abort runs until the next one.

        Raises:
            EngineStateError: the engine was built without `partial_rollouts`, or requests still in flight after
                `timeout_s`.
        """
        if not self.partial_rollouts:
            raise EngineStateError(
                "pause_generation() needs an engine built with partial_rollouts=True (rollout.partial_rollouts)"
            )
        with self._gate:
            self._paused = True
            self._pauses += 1
            in_flight = self._sending
        deadline = time.monotonic() + timeout_s
        while True:
            with self._gate:
                if self._sending == 0:
                    return in_flight
            if time.monotonic() > deadline:
                raise EngineStateError(
                    f"pause_generation(): {self._sending} request(s) still in flight {timeout_s:.0f} s after "
                    f"/abort_request on {self.client.base_url}; check the server log"
                )
            self.client.post_json("/abort_request", {"abort_all": True})
            with self._gate:
                self._gate.wait_for(lambda: self._sending == 0, timeout=1.0)

    def continue_generation(self) -> None:
        """After the sync that `pause_generation` made way for: the held requests, and the samples it aborted, go on
        under the new weights.

        Raises:
            EngineStateError: the weights are not usable (a sync that did not complete).
        """
        if self.weights_missing is not None:
            raise EngineStateError(f"continue_generation() refused: {self.weights_missing}; finish the sync first")
        with self._gate:
            self._paused = False
            self._gate.notify_all()

    def _parse(
        self, body: dict, ids: list[int], params: SamplingParams, i: int, expected: str | None = None
    ) -> Generation:
        """One answer body as a Generation, checked against our prompt ids and the weight version the request was
        sent under (`expected`; default: the last synced one)."""
        generation, version = parse_generate_response(
            body,
            prompt_ids=ids,
            stop_token_ids=self.stop_token_ids,
            max_new_tokens=params.max_new_tokens,
            prompt_index=i,
        )
        self._check_version(version, i, expected)
        return generation

    def _payload(
        self, media: PromptMedia, params: SamplingParams, seed: int, n: int = 1, prefix: Sequence[int] = ()
    ) -> dict:
        """A request for `media`'s prompt, followed by `prefix` (a continued sample's response so far)."""
        return build_generate_payload(
            [*media.input_ids, *prefix],
            media.image_data,
            params,
            seed=seed,
            stop_token_ids=self.stop_token_ids,
            banned_token_ids=self.banned_token_ids,
            n=n,
            image_hashes=media.mm_hashes,
            video_data=media.video_data,
        )

    def _check_version(self, version: str | None, prompt_index: int, expected: str | None = None) -> None:
        expected = expected or self.weight_version
        if expected is not None and version is not None and version != expected:
            raise WeightVersionError(
                f"prompt {prompt_index} was answered with weights {version!r}, but {expected!r} were "
                "synced last: the server restarted (reloading model_path) or a sync did not finish; check its log "
                "and sync the weights again"
            )

    def _check_ready(self) -> None:
        if self.released:
            raise EngineStateError(
                f"generate() while the engine's memory is released ({sorted(self.released)}): call resume_memory() "
                "first"
            )
        if self.weights_missing is not None:
            raise EngineStateError(
                f"generate() refused: {self.weights_missing}; call load_weights() (or sync over NCCL and call "
                "expect_weight_version()) first"
            )

    # ------------------------------------------------------------------------------------------------------------
    # weights

    def load_weights(
        self, named_tensors: Iterable[tuple[str, Tensor]], *, weight_version: str | None = None
    ) -> SyncReport:
        """Colocated sync: `/update_weights_from_tensor` per bucket, then the version label and `/flush_cache`.

        Args:
            named_tensors: HF-named tensors (all of them, or only those that changed).
            weight_version: label for these weights; default `miles_vl-<k>` for the k-th sync of this engine.

        Returns:
            A `SyncReport`.
        """
        self.begin_weight_sync()
        for bucket in iter_buckets(named_tensors, self.options.weight_bucket_bytes):
            self.load_weight_bucket(bucket)
        return self.finish_weight_sync(weight_version)

    def begin_weight_sync(self) -> None:
        """Start a colocated sync whose buckets arrive one call at a time (`load_weight_bucket`, then
        `finish_weight_sync`). Until it finishes the server holds a mix of old and new tensors and generate refuses.
        Starting again abandons a sync in progress (e.g. one broken by a server restart)."""
        if "weights" in self.released:  # the KV cache may stay released: the sync does not touch it
            raise EngineStateError(
                "load_weights() while the engine's weights are released: call resume_memory(['weights']) first"
            )
        self.weights_missing = "a weight sync started and did not complete"
        self._sync = _SyncInProgress(restarts=self.server_restarts, start=time.monotonic())
        # the verifier begins with the first bucket: a sync the trainer drives itself (NCCL, colocated IPC) sends
        # none through here, and must not cost this engine's `/weights_checker` call

    def load_weight_bucket(self, named_tensors: Sequence[tuple[str, Tensor]]) -> None:
        """Send one bucket of the sync begun by `begin_weight_sync` (`/update_weights_from_tensor`).

        Raises:
            EngineStateError: no sync begun, or the server restarted since it began (the buckets sent before are
                gone with the old process): begin the sync again.
            WeightSyncError: a tensor name the server's checkpoint does not have (nothing of the bucket is sent).
        """
        sync = self._open_sync("load_weight_bucket")
        if sync.buckets == 0:
            self.verifier.begin()
        self.verifier.bucket(named_tensors)
        sync.bytes += send_tensor_bucket(self.client, named_tensors, tp_size=self.tp_size, device=self.weight_device)
        sync.buckets += 1
        sync.tensors += len(named_tensors)

    def finish_weight_sync(self, weight_version: str | None = None) -> SyncReport:
        """Label the synced weights and flush the cache; from now on every response must carry this label.

        Args:
            weight_version: label for these weights; default `miles_vl-<k>` for the k-th sync of this engine.

        Raises:
            EngineStateError: as `load_weight_bucket`, or no bucket was sent.
            WeightSyncError: a tensor sent with new values did not change on the server (generate then refuses).
        """
        sync = self._open_sync("finish_weight_sync")
        if sync.buckets == 0:
            raise EngineStateError("finish_weight_sync() without any bucket: there were no tensors to sync")
        version = weight_version or f"miles_vl-{self.syncs + 1}"
        try:
            finish_tensor_sync(self.client, weight_version=version, flush_timeout_s=self.options.flush_timeout_s)
        except SGLangRequestError as e:
            if e.path != "/flush_cache":
                raise
            raise EngineStateError(
                f"finish_weight_sync(): the weights were sent and labelled {version!r}, but the prefix cache computed "
                f"with the old weights could not be dropped ({e}); generate stays refused until finish_weight_sync() "
                "succeeds: call it again once the server is idle"
            ) from e
        self._sync = None
        try:
            verified = self.verifier.finish()
        except WeightSyncError as e:
            self.weights_missing = f"the last weight sync did not land ({e})"
            raise
        self.expect_weight_version(version)
        report = SyncReport(
            sync.buckets, sync.tensors, sync.bytes, time.monotonic() - sync.start, version, tuple(verified)
        )
        log.info(
            "synced %d tensors (%.1f MB, %d buckets) to %s in %.2fs as %r",
            report.tensors,
            report.bytes / 1e6,
            report.buckets,
            self.client.base_url,
            report.seconds,
            version,
        )
        return report

    def _open_sync(self, what: str) -> _SyncInProgress:
        if self._sync is None:
            raise EngineStateError(f"{what}() without begin_weight_sync(): start the sync first")
        if self._sync.restarts != self.server_restarts:
            raise EngineStateError(
                f"{what}(): the server restarted during the weight sync, so the buckets sent before are lost; "
                "begin the sync again"
            )
        return self._sync

    def expect_weight_version(self, version: str) -> None:
        """Record that the server now holds weights `version` (call after an NCCL sync driven by the trainer)."""
        self.syncs += 1
        self.weight_version = version
        self.weights_missing = None

    def server_restarted(self) -> None:
        """The server was relaunched: its memory is resident and its weights are `model_path`'s again."""
        self.server_restarts += 1
        self.released = set()
        self.verifier.server_restarted()
        if self.syncs:
            self.weights_missing = (
                f"the server restarted and reloaded model_path, losing the synced weights {self.weight_version!r}"
            )

    # ------------------------------------------------------------------------------------------------------------
    # memory

    def release_memory(self) -> None:
        """Free the server's GPU memory (KV cache, weights, CUDA graphs) while the trainer runs."""
        if not self.memory_saver:
            raise EngineStateError(
                "release_memory() needs a server started with --enable-memory-saver: launch colocated engines with "
                "ServerSpec(colocated=True) and build the engine with memory_saver=True"
            )
        tags = [t for t in MEMORY_TAGS if t not in self.released]
        if not tags:
            return
        # 0.5.16 asserts the scheduler is idle when releasing (a failed assert kills the server): flushing with a
        # timeout first waits out any request still running (e.g. one a timed-out client attempt left behind), and
        # its refusal means the server is not idle.
        try:
            self.client.flush_cache(timeout_s=self.options.flush_timeout_s)
        except SGLangRequestError as e:
            raise EngineStateError(
                f"release_memory() refused: {e}. Releasing a busy server would kill it (0.5.16 asserts an idle "
                "scheduler in release_memory_occupation)"
            ) from e
        # all tags, or the rest of them after a partial resume (0.5.16 pauses each tag it is given again)
        self.client.release_memory_occupation(None if len(tags) == len(MEMORY_TAGS) else tags)
        self.released.update(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take the GPU memory of `tags` back (MEMORY_TAGS; None: all still released); a tag not released is
        skipped (0.5.16 kills the scheduler on resuming one: `offload_tags.remove`). Without a CPU backup the
        weights must be synced after their resume, before the next generate.

        Raises:
            ValueError: a tag that is not one of MEMORY_TAGS.
        """
        if tags is not None and (unknown := sorted(set(tags) - set(MEMORY_TAGS))):
            raise ValueError(f"resume_memory: unknown memory tags {unknown}; expected some of {list(MEMORY_TAGS)}")
        todo = [t for t in MEMORY_TAGS if t in self.released and (tags is None or t in tags)]
        if not todo:
            return
        self.client.resume_memory_occupation(todo)
        self.released.difference_update(todo)
        if "weights" in todo and not self.weights_cpu_backup:
            self.weights_missing = "the server released its weights and keeps no CPU backup, so they are undefined"


def _joined(
    out: list[int], logprobs: list[float], finish_reason: str, spans: list[tuple[int, int, str | None]]
) -> Generation:
    """A continued sample's response: the spans' tokens and logprobs, in order, with their versions."""
    return Generation(
        response_ids=torch.tensor(out, dtype=torch.long),
        logprobs=torch.tensor(logprobs, dtype=torch.float32),
        finish_reason=finish_reason,
        spans=tuple(spans),
    )


def _check_params(params: SamplingParams) -> None:
    problems = []
    if params.n < 1:
        problems.append(f"n={params.n} (need >= 1)")
    if params.max_new_tokens < 1:
        problems.append(f"max_new_tokens={params.max_new_tokens} (need >= 1)")
    if params.temperature < 0:
        problems.append(f"temperature={params.temperature} (need >= 0)")
    if not 0 < params.top_p <= 1:
        problems.append(f"top_p={params.top_p} (need 0 < top_p <= 1)")
    if problems:
        raise ValueError("invalid sampling parameters for SGLang: " + ", ".join(problems))
