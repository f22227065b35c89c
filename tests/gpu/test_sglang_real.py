"""Contract (GPU, real SGLang 0.5.16 or 0.5.17): `SGLangRolloutHost` launches a real server on 127.0.0.1
(`python -m sglang.launch_server` with miles_vl's SGLang plugin, miles_vl/sglang_plugin/, opted in as
`rollout.sglang.launcher: miles_vl` does; the host checks the plugin's marker in `/server_info`) with a tiny random
Qwen3-VL checkpoint (scripts/gpu/make_tiny_qwen3vl.py) and the engine's HTTP contract holds against it:
- the plugin: its marker names the installed release, its adapter and every patch live;

- `/generate` with `input_ids` (one `<|image_pad|>` per image block) + `image_data` + `return_logprob`: SGLang's
  `prompt_token_ids` equal our canonical ids (decode -> re-process with the checkpoint's processor -> each pad expanded
  gives back our ids), one logprob per output token; the expanded ids are an HTTP 500 (StopIteration in the processor);
- the engine's default request with miles_vl's plugin: the canonical ids and each prompt's own pixel values
  (processor_output items whose pixels are files the plugin reads, generate.py `pixel_media`): our ids come back, a
  batch's prompts are prefilled in one batch and their copies in another, the files are gone after the call, pixel
  values in a dtype the model would not cast from are a 400, and stock `sglang.launch_server` cannot read them (500);
  video prompts go the same way (our frames, grids and timestamps);
- train/rollout consistency: the torch train backend (transformers Qwen3-VL, bf16, packed THD) scores SGLang's
  sampled responses; the mean |difference| is `train_rollout_logprob_abs_diff` (printed; ~0.01 is healthy in bf16),
  for both request forms, and for video prompts;
- a single prompt with two images and `n > 1` is a batch of one for 0.5.16: the flat image list is a 400, the batch
  form the engine sends works;
- `/update_weights_from_tensor` over CUDA IPC: a zero `lm_head` makes every logit 0, so every sampled token's
  logprob is -log(V - 4) (uniform over the vocabulary minus the 4 vision tokens the engine bans with a -1e9 bias);
  restoring the weights brings back the greedy generation of before;
- `/flush_cache`, `/release_memory_occupation` (GPU memory really freed) and `/resume_memory_occupation` (weights
  undefined until the next sync: the engine refuses to generate, a full sync makes it generate as before);
- a killed server is relaunched by the host on the same port; having lost the weights synced before (the test syncs
  them first), the engine refuses to generate until weights are synced again, then generates as before;
- weights land under the names the trainer exports: `/get_weights_by_name` is refused for Qwen3-VL (why the engine
  verifies with `/weights_checker` hashes, miles_vl/rollout/sglang/verify.py); the names of
  `TorchTrainBackend.export_weights` (megatron's `export_hf_weights` yields the same HF names) are the checkpoint's;
  a perturbed vision-tower tensor and `lm_head` change exactly their server parameters and the engine's own check
  confirms them; a name the checkpoint lacks is accepted with HTTP 200 and changes nothing (skipped silently); the
  server's parameter names are the stand-ins' `sglang_parameter` of the checkpoint's names.

One server serves the whole module (tests run in file order and share it).
Run with scripts/gpu/run_sglang_checks.sh, which installs the SGLang bundle and writes the checkpoint first.
Environment: MILES_VL_SGLANG_CKPT (checkpoint directory; default: written to a temp dir here),
MILES_VL_SGLANG_STARTUP_S (server start timeout; default 300 s: the first start JIT-compiles SGLang's kernels),
OUT (when set, the server log is written to $OUT/sglang_server.log).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import math
import os
import signal
import stat
import tempfile
import time
from pathlib import Path

import pytest
import torch

from miles_vl.config.schema import PLUGIN_PROMPTS_PER_REQUEST
from miles_vl.rollout import SamplingParams
from miles_vl.rollout.sglang import (
    EngineOptions,
    EngineStateError,
    RequestPolicy,
    ServerSpec,
    SGLangRequestError,
    SGLangRolloutHost,
)
from miles_vl.rollout.sglang.generate import (
    batch_payload,
    build_generate_payload,
    image_data_url,
    image_hash,
    pixel_media,
    remove_files,
    request_input_ids,
)
from miles_vl.sglang_plugin import MARKER_KEY, sglang_release
from miles_vl.sglang_plugin.settings import PluginSettings
from miles_vl.sglang_plugin.wire import FILE_KEY
from tests.rollout.sglang.conftest import Prompt, free_port
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
HAS_SGLANG = importlib.util.find_spec("sglang") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_SGLANG, reason="needs sglang (scripts/gpu/bundle_sglang.sh + install)"),
]

# Server settings for a test-sized run: decode CUDA graphs up to batch 8 only (capture is quick), no prefill CUDA
# graph, short contexts and few running requests (small request tables), no grammar backend (the RL path never
# constrains decoding). The KV pool fills mem_fraction_static (0.3) of the GPU, which release/resume frees and takes.
EXTRA_ARGS = (
    "--cuda-graph-max-bs-decode",
    "8",
    "--disable-prefill-cuda-graph",
    "--context-length",
    "8192",
    "--max-running-requests",
    "64",
    "--grammar-backend",
    "none",
)
SERVER_ENV = {"SGLANG_USE_SGL_FA3_KERNEL": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
N_PROMPTS = 4


def _writer():
    return load_script("scripts/gpu/make_tiny_qwen3vl.py")


WRITER = _writer()
MIN_PIXELS, MAX_PIXELS = WRITER.DEFAULT_MIN_PIXELS, WRITER.DEFAULT_MAX_PIXELS


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    given = os.environ.get("MILES_VL_SGLANG_CKPT")
    if given and (Path(given) / "config.json").exists():
        return Path(given)
    path = tmp_path_factory.mktemp("tiny_qwen3vl")
    WRITER.write_checkpoint(path, shape="tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def processor(ckpt):
    from miles_vl.data import load_processor

    return load_processor("offline", MIN_PIXELS, MAX_PIXELS)


@pytest.fixture(scope="module")
def tokens(processor):
    from miles_vl.models.qwen3_vl.tokens import special_tokens

    return special_tokens(processor)


@pytest.fixture(scope="module")
def prompts(processor) -> list[Prompt]:
    """Geo3k-like prompts (one image each) built exactly as miles_vl.data builds them."""
    from miles_vl.data import PromptEncoder, generate_problems

    encoder = PromptEncoder(processor, instruction="Let's think step by step and output the final answer in \\boxed{}.")
    out = []
    for problem in generate_problems(N_PROMPTS, seed=0):
        enc = processor(text=[encoder.render(problem.problem)], images=[problem.image], return_tensors="pt")
        out.append(
            Prompt(enc["input_ids"][0].long(), enc["pixel_values"], enc["image_grid_thw"].long(), [problem.image])
        )
    return out


@pytest.fixture(scope="module")
def ckpt_weights(ckpt) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def _start_host(
    ckpt,
    tokens,
    *,
    extra_args=EXTRA_ARGS,
    mem_fraction=0.3,
    colocated=True,
    log_name="sglang_server",
    plugin=True,
    vision_cuda_graphs=0,
):
    """A host as `rollout.sglang.launcher: miles_vl` makes it (`plugin`: the plugin opted in, prompts_per_request 16,
    pixel values), or as `launcher: sglang` (`plugin=False`: SGLang's own server, PNG images, one prompt a request)."""
    out = os.environ.get("OUT")
    spec = ServerSpec(
        model_path=str(ckpt),
        port=free_port(),
        mem_fraction_static=mem_fraction,
        colocated=colocated,  # --enable-memory-saver: release/resume
        random_seed=0,
        image_min_pixels=MIN_PIXELS,
        image_max_pixels=MAX_PIXELS,
        plugin=PluginSettings(vision_graphs=vision_cuda_graphs) if plugin else None,
        extra_args=extra_args,
    )
    host = SGLangRolloutHost(
        spec,
        tokens,
        EngineOptions(prompts_per_request=PLUGIN_PROMPTS_PER_REQUEST if plugin else 1),
        startup_timeout_s=float(os.environ.get("MILES_VL_SGLANG_STARTUP_S", "300")),
        requests=RequestPolicy(timeout_s=120.0, max_retries=1),
        max_restarts=1,
        log_path=Path(out) / f"{log_name}.log" if out else None,
        env=SERVER_ENV,
        health_poll_s=0.5,
        send_pixel_values=plugin,
    )
    _note_pid(host)
    return host


@pytest.fixture(scope="module")
def host(ckpt, tokens):
    host = _start_host(ckpt, tokens)
    try:
        yield host
    finally:
        print(f"\n[sglang server log tail: {host.log_path}]\n{host.server.log_tail(max_lines=15)}")
        host.shutdown()


def _note_pid(host: SGLangRolloutHost) -> None:
    """Append the server's pid (= its process group) to $MILES_VL_SGLANG_PIDFILE, so that the driver script can stop
    a server that a killed test run left behind (servers run in their own session)."""
    path = os.environ.get("MILES_VL_SGLANG_PIDFILE")
    if path and host.server.pid is not None:
        with open(path, "a") as f:
            f.write(f"{host.server.pid}\n")


@pytest.fixture(scope="module")
def checkpoint_greedy(host, prompts) -> tuple[list[int], torch.Tensor]:
    """The greedy answer to the first prompt on the checkpoint's weights, taken when a test first asks for it, before
    that test changes any weight: test_generate_uses_our_prompt_ids asks first in the whole file; in a shard of it
    (`run_sglang_checks.sh --shard`) the first test of the shard that needs it (a test that changed the weights of
    this module's server restores them before it ends)."""
    return _greedy(host, prompts[0])


GREEDY = SamplingParams(n=1, max_new_tokens=12, temperature=0.0, seed=0)


def _greedy(host, prompt) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and logprobs of one prompt alone, after a cache flush: a full prefill and batch-1 decode steps,
    so the same weights give the same kernels and the same numbers every time."""
    host.client.flush_cache(timeout_s=60)
    (gen,) = host.generate([prompt], GREEDY)[0]
    return gen.response_ids.tolist(), gen.logprobs


# ---------------------------------------------------------------------------------------------------------------------


def test_the_plugins_marker_names_the_release_its_adapter_and_every_patch(host):
    """What the host checked at start (`SGLangRolloutHost._check_plugin`), in full: the release installed here, its
    adapter from the plugin's table, every patch the settings ask for live (the schedulers' too: a scheduler whose
    patches did not take ends the server at start). Under 0.5.17 the multimodal feature transport is cpu (0.5.17
    would resolve cuda_ipc: the host passes cpu, the plugin checks it, v0_5_17/transport.py)."""
    info = host.client.server_info()
    marker = info[MARKER_KEY]
    release = sglang_release()
    assert marker["release"] == release and marker["adapter"] == "v" + release.replace(".", "_")
    assert marker["patches"] == dict.fromkeys(("tokenizer", "receiver", "marker"), "live")
    assert marker["settings"]["share_copy_pixels"] and marker["settings"]["vision_graphs"] == 0
    if release == "0.5.17":
        assert marker["mm_feature_transport"] == info["mm_feature_transport"] == "cpu"


def test_generate_uses_our_prompt_ids(host, prompts, tokens, checkpoint_greedy):
    ids = prompts[0].prompt_ids.tolist()
    payload = build_generate_payload(
        request_input_ids(ids, tokens.image_token_id, 1),  # one pad per image: SGLang expands it again
        [image_data_url(prompts[0].images[0])],
        SamplingParams(max_new_tokens=8),
        seed=0,
        stop_token_ids=tokens.eos_token_ids,
        banned_token_ids=host.engine.banned_token_ids,
    )
    body = host.client.generate(payload)
    assert body["prompt_token_ids"] == ids
    assert body["meta_info"]["prompt_tokens"] == len(ids)
    assert len(body["meta_info"]["output_token_logprobs"]) == len(body["output_ids"]) >= 1

    assert host.engine.pixel_dir is not None  # miles_vl's plugin: the engine sends ids + pixel values
    params = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=1)
    # the engine checks every response's prompt ids against ours (with pixel values 0.5.16 keeps the ids it is sent, so
    # that check is the request's shape; what shows the server used our image tokens is the logprob agreement below)
    groups = host.generate(prompts, params)
    assert list(Path(host.engine.pixel_dir).iterdir()) == []  # the pixel files went with the answers
    assert [len(g) for g in groups] == [2] * len(prompts)
    for group in groups:
        for gen in group:
            assert 1 <= gen.response_ids.numel() <= 16 and gen.logprobs.shape == gen.response_ids.shape
            assert bool((gen.logprobs <= 0).all()) and bool(torch.isfinite(gen.logprobs).all())
            assert gen.finish_reason in ("stop", "length")
            assert not set(gen.response_ids.tolist()) & set(host.engine.banned_token_ids)


def test_a_prompts_n_samples_in_one_request(host, prompts, tokens):
    """`sampling_params.n` on the real server (what the engine sends by default, and the stand-ins' list answer):
    one body per sample, each with our prompt ids, sampled apart (no deterministic inference: the shared
    sampling_seed is ignored)."""
    ids = prompts[0].prompt_ids.tolist()
    payload = build_generate_payload(
        request_input_ids(ids, tokens.image_token_id, 1),
        [image_data_url(prompts[0].images[0])],
        SamplingParams(max_new_tokens=16, temperature=1.0),
        seed=0,
        stop_token_ids=tokens.eos_token_ids,
        banned_token_ids=host.engine.banned_token_ids,
        n=4,
    )
    bodies = host.client.generate_n(payload, 4)
    assert all(b["prompt_token_ids"] == ids for b in bodies)
    assert len({tuple(b["output_ids"]) for b in bodies}) > 1
    assert host.engine.one_request_per_prompt


def test_a_batch_of_prompts_with_n_in_one_request(host, prompts, tokens):
    """What `prompts_per_request` sends (and the stand-in's batch answers), on the real server with miles_vl's
    launcher: `k x n` bodies, prompt by prompt, each with its own prompt's ids; every copy got its prompt's pixels
    back, and all copies were prefilled in one batch (the plugin sends them in one message); a batch that mixes n
    is refused with 400."""
    import re

    from miles_vl.rollout.sglang.generate import batch_payload

    k, n = 3, 4
    urls = [image_data_url(prompts[i].images[0]) for i in range(k)]
    payloads = [
        build_generate_payload(
            request_input_ids(prompts[i].prompt_ids.tolist(), tokens.image_token_id, 1),
            [urls[i]],
            SamplingParams(max_new_tokens=8, temperature=1.0),
            seed=i,
            stop_token_ids=tokens.eos_token_ids,
            banned_token_ids=host.engine.banned_token_ids,
            n=n,
            image_hashes=[image_hash(urls[i])],
        )
        for i in range(k)
    ]
    host.client.flush_cache(timeout_s=60)
    bodies = host.client.generate_n(batch_payload(payloads), k * n)
    for i in range(k):  # answers in prompt order (0.5.16 keeps the ids of a preprocessed request as sent)
        assert all(b["prompt_token_ids"] == prompts[i].prompt_ids.tolist() for b in bodies[i * n : (i + 1) * n])
    time.sleep(1.0)  # the scheduler's log lines of this request
    log = host.server.log_tail(max_lines=400, max_bytes=1 << 17)
    assert "no pixel values remembered" not in log
    assert re.search(rf"Prefill batch, #new-seq: {k * n}, ", log), "the copies were not prefilled in one batch"
    mixed = batch_payload(payloads[:1]) | {
        "input_ids": [payloads[0]["input_ids"], payloads[1]["input_ids"]],
        "image_data": [[urls[0]], [urls[1]]],
        "sampling_params": [payloads[0]["sampling_params"], {**payloads[1]["sampling_params"], "n": 2}],
    }
    mixed.pop("mm_hashes", None)
    with pytest.raises(SGLangRequestError, match="parallel_sample_num should be the same"):
        host.client.generate_n(mixed, 6)


def _prefill_batches(host, since: int) -> list[int]:
    """#new-seq of each prefill batch the server logged after byte `since` of its log."""
    import re

    time.sleep(1.0)  # the scheduler's log lines of the last request
    with open(host.log_path, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    return [int(m) for m in re.findall(r"Prefill batch, #new-seq: (\d+),", text)]


def test_pixel_values_of_a_batch_in_one_request(host, prompts, tokens):
    """The engine's default request form with miles_vl's plugin, on the real server: k prompts with n samples each
    as ids + pixel values (files the plugin reads): `k x n` bodies with our ids; the k prefixes are ready together
    (nothing to decode or process) and prefilled in one batch, the copies in another; every copy got its prompt's
    pixels back; pixel values in a dtype the model does not cast from are refused with 400, naming both."""
    k, n = 3, 4
    media = host.engine.prompt_media(prompts[:k])
    payloads = [
        build_generate_payload(
            media[i].input_ids,
            media[i].image_data,
            SamplingParams(max_new_tokens=8, temperature=1.0),
            seed=i,
            stop_token_ids=tokens.eos_token_ids,
            banned_token_ids=host.engine.banned_token_ids,
            n=n,
        )
        for i in range(k)
    ]
    assert all(m.input_ids == p.prompt_ids.tolist() for m, p in zip(media, prompts, strict=False))
    assert media[0].image_data[0]["format"] == "processor_output"
    wrong_dtype = pixel_media(prompts[0], 0, tokens, directory=host.engine.pixel_dir, dtype=torch.float16,
                              spatial_merge_size=2)  # fmt: skip
    host.client.flush_cache(timeout_s=60)
    since = host.log_path.stat().st_size
    try:
        bodies = host.client.generate_n(batch_payload(payloads), k * n)
        with pytest.raises(SGLangRequestError, match="arrived as torch.float16 but the model runs torch.bfloat16"):
            host.client.generate(build_generate_payload(wrong_dtype.input_ids, wrong_dtype.image_data,
                                                        SamplingParams(max_new_tokens=2), seed=0,
                                                        stop_token_ids=tokens.eos_token_ids))  # fmt: skip
    finally:
        remove_files(host.engine.pixel_dir, [f for m in [*media, wrong_dtype] for f in m.files])
    for i in range(k):  # answers in prompt order (0.5.16 keeps the ids of a preprocessed request as sent)
        assert all(b["prompt_token_ids"] == prompts[i].prompt_ids.tolist() for b in bodies[i * n : (i + 1) * n])
    batches = _prefill_batches(host, since)
    print(f"SGLANG-REAL pixel values, {k} prompts x {n}: prefill batches (#new-seq) {batches}")
    assert batches[:2] == [k, k * n], batches
    assert "no pixel values remembered" not in host.server.log_tail(max_lines=400, max_bytes=1 << 17)


def test_a_request_naming_a_pixel_file_not_its_own_is_refused(host, prompts, tokens, tmp_path):
    """Issue 30.6, on the real server: the engine's pixel files are 0600 in a 0700 directory, and the plugin's read
    (`read_tensor`, what `tests/sglang_plugin/test_v0_5_16.py::test_the_server_reads_only_its_own_private_pixel_files`
    tests on stand-in classes) refuses a reference to a symbolic link (to a file of the right size outside the
    directory) or to a file other users can read: HTTP 400 naming the file and why; the server serves on, its own file
    included."""
    (media,) = host.engine.prompt_media(prompts[:1])
    directory = Path(host.engine.pixel_dir)
    ref = media.image_data[0]["pixel_values"]
    own = directory / ref[FILE_KEY]
    assert stat.S_IMODE(own.stat().st_mode) == 0o600 and stat.S_IMODE(directory.stat().st_mode) == 0o700
    outside = tmp_path / "outside.bin"
    outside.write_bytes(own.read_bytes())
    outside.chmod(0o600)
    (directory / "link.bin").symlink_to(outside)
    (directory / "readable.bin").write_bytes(own.read_bytes())
    (directory / "readable.bin").chmod(0o644)

    def payload(item):
        return build_generate_payload(media.input_ids, [item], SamplingParams(max_new_tokens=2), seed=0,
                                      stop_token_ids=tokens.eos_token_ids)  # fmt: skip

    try:
        for name, why in (("link.bin", "not a file but l"), ("readable.bin", "lets other users reach it")):
            item = {**media.image_data[0], "pixel_values": {**ref, FILE_KEY: name}}
            with pytest.raises(SGLangRequestError, match=f"HTTP 400: pixel values {name} in .* refused: .*{why}"):
                host.client.generate(payload(item))
        assert host.client.generate(payload(media.image_data[0]))["output_ids"]
    finally:
        remove_files(str(directory), [*media.files, "link.bin", "readable.bin"])


def test_a_prompt_with_two_images_and_n_samples(host, processor, tokens, ckpt):
    """0.5.16 makes a batch of one of a single prompt with n > 1, whose `image_data` must then hold one entry: the flat
    list of two images is a 400 (the stand-in's answer too); the batch form the engine sends works, as pixel values
    (with a text-only prompt beside it: an empty entry in the batch's `image_data`) and as PNGs, and its responses
    score under the trainer as the server sampled them (two images' pixel rows split by their grids)."""
    from miles_vl.data import PromptEncoder, generate_problems
    from miles_vl.models.qwen3_vl.model import build_model

    a, b = (p.image for p in generate_problems(2, seed=3))
    encoder = PromptEncoder(processor, instruction="Answer.")
    enc = processor(text=[encoder.render("Compare <image> with <image>.")], images=[a, b], return_tensors="pt")
    prompt = Prompt(enc["input_ids"][0].long(), enc["pixel_values"], enc["image_grid_thw"].long(), [a, b])
    plain = Prompt(processor(text=[encoder.render("What is 2 + 3?")], return_tensors="pt")["input_ids"][0].long(),
                   None, None, [])  # fmt: skip
    urls = [image_data_url(a), image_data_url(b)]
    flat = build_generate_payload(request_input_ids(prompt.prompt_ids.tolist(), tokens.image_token_id, 2), urls,
                                  SamplingParams(max_new_tokens=4), seed=0, stop_token_ids=tokens.eos_token_ids,
                                  n=2)  # fmt: skip
    with pytest.raises(SGLangRequestError, match="length of image_data should be equal to the batch size"):
        host.client.generate_n(flat, 2)
    params = SamplingParams(n=2, max_new_tokens=24, temperature=1.0, seed=6)
    forms = {"pixel values": ([prompt, plain], host.generate([prompt, plain], params))}
    directory, host.engine.pixel_dir = host.engine.pixel_dir, None
    try:
        forms["PNG images"] = ([prompt], host.generate([prompt], params))  # one pad per image
    finally:
        host.engine.pixel_dir = directory
    model = build_model(tokens, path=str(ckpt), dtype=torch.bfloat16, device="cuda")
    for form, (batch, groups) in forms.items():
        assert [len(g) for g in groups] == [2] * len(batch)
        train, rollout = _scored(model, tokens, batch, groups, host.engine.banned_token_ids)
        diff = (train - rollout).abs()
        result = {
            "request_form": form,
            "prompts": "two images" + (" + text only" if len(batch) > 1 else ""),
            "train_rollout_logprob_abs_diff": round(float(diff.mean()), 5),
            "train_rollout_logprob_abs_diff_max": round(float(diff.max()), 5),
            "tokens": int(diff.numel()),
        }
        print("SGLANG-REAL two images " + json.dumps(result))  # fmt: skip
        assert float(diff.mean()) < 0.1, result
    del model
    torch.cuda.empty_cache()


def _prompt_logprobs(body) -> torch.Tensor:
    """The logprob of every prompt token after the first (`logprob_start_len = 0`)."""
    return torch.tensor([lp for lp, *_ in body["meta_info"]["input_token_logprobs"] if lp is not None])


def test_vision_graphs_replay_what_the_eager_tower_computes(ckpt, processor, tokens):
    """miles_vl.sglang_plugin.vision.VisionGraphs on a real server of its own (`rollout.sglang.vision_cuda_graphs: 4`;
    off by default): a prompt with one image of 8x16 patches and a prompt with its two halves (2 x 8x8 patches, one
    vision batch: one request's images go through the tower together) have the same patch count and other image
    boundaries, which 0.5.16's own runner confuses (it would replay the first layout's boundaries for the second). Each
    layout runs eagerly at its first sighting, is captured at its second and replayed after, the two interleaved; the
    prompt tokens' logprobs of every call equal those of the layout's eager call, far closer than the same text gets
    with another image of that size (replayed by the one-image graph: a replay reads its new pixels). Replays are not
    bitwise the eager tower: 0.5.16's graph path runs the rotary embedding uncompiled
    (`apply_rotary_pos_emb_native_eager`, srt/layers/attention/vision.py:1345) and computes the bilinear position
    weights in numpy; measured max 0.024, mean 0.008 (H200, 2026-11-26). The bound sits between that and what a real
    difference gave: with 0.5.16's default `enable_precise_embedding_interpolation` off, the graph path samples the
    position-embedding table at half-pixel centres where the eager tower (and transformers) use linspace, and this test
    measured max 0.069, mean 0.014; the plugin turns the flag on with the graphs."""
    from PIL import Image

    from miles_vl.data import PromptEncoder, generate_problems

    encoder = PromptEncoder(processor, instruction="Answer.")
    wide, other = (p.image.convert("RGB").resize((256, 128)) for p in generate_problems(2, seed=11))

    def prompt(text: str, images: list[Image.Image]) -> Prompt:
        enc = processor(text=[encoder.render(text)], images=images, return_tensors="pt")
        return Prompt(enc["input_ids"][0].long(), enc["pixel_values"], enc["image_grid_thw"].long(), images)

    halves = [wide.crop((0, 0, 128, 128)), wide.crop((128, 0, 256, 128))]
    layouts = {
        "one": prompt("Describe <image> in one word.", [wide]),
        "two": prompt("Describe <image> and <image> in one word.", halves),
        "other": prompt("Describe <image> in one word.", [other]),
    }
    patches = {name: int(p.image_grid_thw.prod(-1).sum()) for name, p in layouts.items()}
    assert patches["one"] == patches["two"] == patches["other"], patches
    host = _start_host(ckpt, tokens, mem_fraction=0.2, colocated=False, log_name="sglang_server_vision_graphs",
                       vision_cuda_graphs=4)  # fmt: skip
    media = dict(zip(layouts, host.engine.prompt_media(list(layouts.values())), strict=True))
    params = SamplingParams(max_new_tokens=1, temperature=0.0)

    def call(name: str) -> torch.Tensor:
        m = media[name]
        payload = build_generate_payload(m.input_ids, m.image_data, params, seed=0, stop_token_ids=tokens.eos_token_ids)
        host.client.flush_cache(timeout_s=60)  # the prompt is prefilled again: the vision tower runs
        return _prompt_logprobs(host.client.generate(payload | {"logprob_start_len": 0}))

    calls: dict[str, list[torch.Tensor]] = {"one": [], "two": []}
    try:
        for name in ("two", "two", "one", "one", "two", "one", "two", "one"):
            calls[name].append(call(name))
        with_other = call("other")
    finally:
        remove_files(host.engine.pixel_dir, [f for m in media.values() for f in m.files])
        log_text = host.log_path.read_text(errors="replace")  # before the host's private directory goes
        host.shutdown()
    captured = [line for line in log_text.splitlines() if "vision tower CUDA graph captured" in line]
    assert len(captured) == 2, captured  # one graph for each layout, "other" replays the one-image graph
    assert f"for 2 images of {patches['two']} patches" in captured[0], captured
    assert f"for 1 images of {patches['one']} patches" in captured[1], captured
    diffs = torch.cat([(runs[0] - later).abs() for runs in calls.values() for later in runs[1:]])
    worst, mean = float(diffs.max()), float(diffs.mean())
    image_effect = float((calls["one"][0] - with_other).abs().max())  # same text and image size, another image
    print(f"SGLANG-REAL vision graphs: replays vs eager |d logprob| max {worst:.2e} mean {mean:.2e}; another image "
          f"{image_effect:.2e}; {captured}")  # fmt: skip
    assert worst < 0.04 and worst * 20 < image_effect, (worst, mean, image_effect)


def test_mm_hashes_key_the_prefix_cache_for_single_requests(host, prompts, tokens):
    """What `image_hash` (generate.py) assumes of the real server: with n = 1 the `mm_hashes` we send, not the pixels,
    key an image's prefix: the same text with another image but the first image's hash reuses the cached prompt past
    the image; with its own hash it stops at the image. 0.5.16 drops `mm_hashes` from a request with n > 1 (its
    `GenerateReqInput.__getitem__` does not copy them); miles_vl's plugin (the host's default) gives them back, so
    such a request caches the image under our hash too."""
    ids = prompts[0].prompt_ids.tolist()
    first_image_token = ids.index(tokens.image_token_id)
    urls = [image_data_url(prompts[k].images[0]) for k in (0, 1)]
    assert urls[0] != urls[1]

    def cached(k: int, hash_of: int, n: int = 1) -> int:
        payload = build_generate_payload(
            request_input_ids(ids, tokens.image_token_id, 1),
            [urls[k]],
            SamplingParams(max_new_tokens=1, temperature=1.0),
            seed=0,
            stop_token_ids=tokens.eos_token_ids,
            n=n,
            image_hashes=[image_hash(urls[hash_of])],
        )
        bodies = host.client.generate_n(payload, n) if n > 1 else [host.client.generate(payload)]
        return int(bodies[0]["meta_info"]["cached_tokens"])

    host.client.flush_cache(timeout_s=60)
    assert cached(0, hash_of=0) == 0
    assert cached(1, hash_of=0) >= len(ids) - 1  # another image under the same hash: the whole prompt is a hit
    assert cached(1, hash_of=1) <= first_image_token  # its own hash: the cache stops where the image starts
    host.client.flush_cache(timeout_s=60)
    cached(0, hash_of=0, n=2)  # n > 1: the plugin keeps our hash, the prefix is cached under it
    assert cached(1, hash_of=0) >= len(ids) - 1


def test_a_one_image_items_hash_keys_its_prefix_and_its_file_reaches_the_scheduler_by_link(host, prompts, tokens):
    """What `pixel_hash` and `link_pixel_files` assume of the real server (miles_vl's plugin, pixel values): the
    `hash` of a one-image processor_output item is the image's hash in the prefix cache (another image's pixels under
    the first image's hash reuse the cached prompt past the image; under their own hash the cache stops at the image),
    so the tokenizer takes it instead of hashing the pixels; the pixel files reach the scheduler by a second name in
    /dev/shm, which the scheduler removes once it has read it (no 0.5.16 segment name is left; the plugin's log line
    is written once per server process, so it shows that this server links, not which request did)."""
    ids = prompts[0].prompt_ids.tolist()
    first_image_token = ids.index(tokens.image_token_id)
    media = host.engine.prompt_media(prompts[:2])
    hashes = [m.image_data[0]["hash"] for m in media]
    assert hashes[0] != hashes[1] and all(len(m.image_data[0]["image_grid_thw"]) == 1 for m in media)

    def cached(k: int, hash_of: int) -> int:
        item = dict(media[k].image_data[0], hash=hashes[hash_of])
        payload = build_generate_payload(ids, [item], SamplingParams(max_new_tokens=1, temperature=1.0), seed=0,
                                         stop_token_ids=tokens.eos_token_ids)  # fmt: skip
        return int(host.client.generate(payload)["meta_info"]["cached_tokens"])

    def segments() -> set[str]:  # 0.5.16's segment names (`make_shm_name`): sgl_shm_mm_<pid>_<random>
        return {n for n in os.listdir("/dev/shm") if n.startswith("sgl_shm_mm_")}

    before = segments()
    try:
        host.client.flush_cache(timeout_s=60)
        assert cached(0, hash_of=0) == 0
        assert cached(1, hash_of=0) >= len(ids) - 1  # other pixels under the first image's hash: a hit past the image
        assert cached(1, hash_of=1) <= first_image_token  # under their own hash the cache stops where the image starts
    finally:
        remove_files(host.engine.pixel_dir, [f for m in media for f in m.files])
    assert segments() <= before  # every linked name was read and removed by the scheduler
    assert "pixel files reach the scheduler by a second name" in host.log_path.read_text(errors="replace")


def test_expanded_image_pads_are_an_http_500(host, prompts, tokens):
    """What the stand-ins answer to the canonical (expanded) ids, on the real server: SGLang's processor runs out of
    images (StopIteration, not caught by the route: HTTP 500 "Internal Server Error", the reason in the log), and the
    server keeps serving. 0.5.16 processes in the event loop ("RuntimeError: coroutine raised StopIteration"); 0.5.17
    in worker threads, from which the StopIteration left the request hanging for ever (and holding the lock every
    weight update waits for) until the plugin re-raised it as a RuntimeError (v0_5_17/processor.py): the same 500 on
    both releases."""
    from miles_vl.rollout.sglang import SGLangUnavailableError

    payload = build_generate_payload(
        prompts[0].prompt_ids.tolist(),  # expanded: what miles_vl sent before the one-pad fix
        [image_data_url(prompts[0].images[0])],
        SamplingParams(max_new_tokens=4),
        seed=0,
        stop_token_ids=tokens.eos_token_ids,
    )
    with pytest.raises(SGLangUnavailableError, match=r"HTTP 500: Internal Server Error"):
        host.client.request("POST", "/generate", json=payload, retry=False)
    # the server writes the traceback (a RuntimeError naming the StopIteration) after it answered: wait for it
    deadline = time.monotonic() + 15
    while "StopIteration" not in host.server.log_tail(max_lines=400, max_bytes=1 << 17) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "StopIteration" in host.server.log_tail(max_lines=400, max_bytes=1 << 17)
    assert host.health()


def _scored(model, tokens, prompts, groups, banned_token_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(the torch train backend's logprobs of every generated response under `model` in bf16, the rollout's)."""
    from miles_vl.train import LossOptions, OptimizerOptions, TorchTrainBackend, TrainOptions, TrainSample

    def gpu(t):
        return None if t is None else t.to("cuda", torch.bfloat16)

    loss = LossOptions(suppress_token_ids=tuple(banned_token_ids))
    backend = TorchTrainBackend(model.to("cuda", torch.bfloat16), tokens, TrainOptions(OptimizerOptions(lr=0.0), loss))
    samples = [
        TrainSample(
            input_ids=torch.cat([prompt.prompt_ids, gen.response_ids]),
            prompt_len=prompt.prompt_ids.numel(),
            advantage=0.0,
            rollout_logprobs=gen.logprobs,
            image_grid_thw=prompt.image_grid_thw,
            pixel_values=gpu(prompt.pixel_values),
            video_grid_thw=getattr(prompt, "video_grid_thw", None),
            pixel_values_videos=gpu(getattr(prompt, "pixel_values_videos", None)),
        )
        for prompt, group in zip(prompts, groups, strict=True)
        for gen in group
    ]
    return torch.cat(backend.compute_logprobs(samples)).cpu(), torch.cat([s.rollout_logprobs for s in samples])


def test_train_rollout_logprobs_agree(host, prompts, tokens, ckpt):
    """Both request forms on one server (pixel values, the default; PNG images, which SGLang processes again)."""
    from miles_vl.models.qwen3_vl.model import build_model

    params = SamplingParams(n=2, max_new_tokens=32, temperature=1.0, seed=2)
    model = build_model(tokens, path=str(ckpt), dtype=torch.bfloat16, device="cuda")
    directory = host.engine.pixel_dir
    results = {}
    for form in ("pixel values", "PNG images"):
        host.engine.pixel_dir = directory if form == "pixel values" else None
        try:
            groups = host.generate(prompts, params)
        finally:
            host.engine.pixel_dir = directory
        train, rollout = _scored(model, tokens, prompts, groups, host.engine.banned_token_ids)
        diff = (train - rollout).abs()
        results[form] = {
            "request_form": form,
            "train_rollout_logprob_abs_diff": round(float(diff.mean()), 5),
            "train_rollout_logprob_abs_diff_max": round(float(diff.max()), 5),
            "tokens": int(diff.numel()),
            "mean_rollout_logprob": round(float(rollout.mean()), 4),
            "model": "tiny Qwen3-VL, random init (std 0.1), bf16",
        }
        print("SGLANG-REAL " + json.dumps(results[form]))
        # The distribution is far from uniform (mean logprob above -log V), so agreement is informative.
        assert float(rollout.mean()) > -math.log(tokens.vocab_size) + 0.5
        assert float(diff.mean()) < 0.1, results[form]
    del model
    torch.cuda.empty_cache()


def test_video_prompts_go_as_pixel_values(host, tokens, ckpt):
    """Issue 18, item 3, on the real server: synthetic motion videos (alone, and after an image) built by miles_vl's
    data path go as our ids, frames and grids; SGLang answers with our ids (the engine checks each), computes its
    MRoPE positions from them (`MRotaryEmbedding.get_rope_index`, frame groups split by time) and its responses score
    under the trainer as for images."""
    from miles_vl.data import (
        LoadOptions,
        PromptEncoder,
        VideoSettings,
        load_processor,
        load_prompt_records,
        synth_records,
    )
    from miles_vl.models.qwen3_vl.model import build_model

    video = VideoSettings(fps=2.0, min_frames=2, max_frames=8, min_pixels=64 * 64, max_pixels=4 * 128 * 128)
    processor = load_processor("offline", MIN_PIXELS, MAX_PIXELS, video)
    encoder = PromptEncoder(processor, instruction="Answer with one word.")
    motions, images = synth_records(2, seed=1, task="motion"), synth_records(1, seed=1)
    both = dict(motions[1], problem="<image>" + motions[1]["problem"], images=images[0]["images"])
    options = LoadOptions(max_prompt_len=4096, layout="generic")
    rows, report = load_prompt_records([motions[0], both], encoder, options, source="video")
    assert report.n_kept == 2, report.summary()
    prompts = [encoder.encode(r) for r in rows]
    assert all(p.video_grid_thw is not None and int(p.video_grid_thw[0, 0]) >= 2 for p in prompts)
    groups = host.generate(prompts, SamplingParams(n=2, max_new_tokens=32, temperature=1.0, seed=9))
    model = build_model(tokens, path=str(ckpt), dtype=torch.bfloat16, device="cuda")
    train, rollout = _scored(model, tokens, prompts, groups, host.engine.banned_token_ids)
    del model
    torch.cuda.empty_cache()
    diff = (train - rollout).abs()
    result = {
        "videos": "synthetic motion, grids " + str([p.video_grid_thw.tolist()[0] for p in prompts]),
        "train_rollout_logprob_abs_diff": round(float(diff.mean()), 5),
        "train_rollout_logprob_abs_diff_max": round(float(diff.max()), 5),
        "tokens": int(diff.numel()),
    }
    print("SGLANG-REAL video " + json.dumps(result))
    assert float(diff.mean()) < 0.1, result


def test_weight_update_changes_logprobs_as_expected(host, prompts, tokens, ckpt_weights, checkpoint_greedy):
    lm_head = ckpt_weights["lm_head.weight"]
    report = host.load_weights([("lm_head.weight", torch.zeros_like(lm_head))], weight_version="zero-lm-head")
    assert report.tensors == 1
    gens = [g for group in host.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=8, seed=3)) for g in group]
    logprobs = torch.cat([g.logprobs for g in gens])
    uniform = -math.log(tokens.vocab_size - len(host.engine.banned_token_ids))
    print(
        f"SGLANG-REAL zero lm_head: logprobs in [{float(logprobs.min()):.5f}, {float(logprobs.max()):.5f}], "
        f"expected {uniform:.5f}"
    )
    assert torch.allclose(logprobs, torch.full_like(logprobs, uniform), atol=1e-3)

    restored = host.load_weights([("lm_head.weight", lm_head)], weight_version="restored")
    # The engine's check (verify.py): lm_head was sent with new values, and the server's hash of it changed.
    assert restored.verified == ("lm_head.weight",)
    ids, lps = _greedy(host, prompts[0])
    before_ids, before_lps = checkpoint_greedy
    assert ids == before_ids
    assert torch.allclose(lps, before_lps, atol=1e-3)


def test_flush_release_and_resume_memory(host, prompts, ckpt_weights, checkpoint_greedy):
    host.client.flush_cache(timeout_s=60)
    free_before = torch.cuda.mem_get_info()[0]
    host.release_memory()
    time.sleep(1.0)
    free_released = torch.cuda.mem_get_info()[0]
    host.resume_memory()
    free_resumed = torch.cuda.mem_get_info()[0]
    gib = 2**30
    print(
        f"SGLANG-REAL memory free: {free_before / gib:.2f} GiB -> released {free_released / gib:.2f} GiB "
        f"-> resumed {free_resumed / gib:.2f} GiB"
    )
    # mem_fraction_static=0.3 of the GPU holds the weights and the KV pool: releasing frees most of it.
    total = torch.cuda.get_device_properties(0).total_memory
    assert free_released - free_before > 0.05 * total
    assert free_resumed < free_released - 0.05 * total
    with pytest.raises(EngineStateError):  # no CPU backup: the weights are undefined until the next sync
        host.generate(prompts[:1], GREEDY)
    report = host.load_weights(ckpt_weights.items(), weight_version="after-resume")
    assert report.tensors == len(ckpt_weights)
    assert _greedy(host, prompts[0])[0] == checkpoint_greedy[0]


def test_killed_server_is_restarted(host, prompts, ckpt_weights, checkpoint_greedy):
    """What a restart loses is the weights synced since the start (`SGLangRolloutEngine.server_restarted`: a server
    that was never synced reloads the very weights it served, and generates on). So the test syncs first, the
    checkpoint's weights under a label of its own, whatever ran before it (alone, `-k killed_server`, nothing had)."""
    host.load_weights(ckpt_weights.items(), weight_version="before-kill")
    assert host.weights_missing is None and host.engine.weight_version == "before-kill"
    restarts = host.restarts
    os.killpg(host.server.pid, signal.SIGKILL)  # the server's own process group (scheduler, detokenizer too)
    deadline = time.monotonic() + 30
    while host.server.is_alive():
        assert time.monotonic() < deadline, "the killed server did not exit"
        time.sleep(0.1)
    # relaunched with model_path's weights: the synced ones are lost, and the engine says which
    lost = "restarted and reloaded model_path, losing the synced weights 'before-kill'"
    with pytest.raises(EngineStateError, match=lost):
        host.generate(prompts[:1], GREEDY)
    _note_pid(host)
    assert host.restarts == restarts + 1 and host.health()
    assert host.needs_weights()  # still refused: only a sync ends it
    host.load_weights(ckpt_weights.items(), weight_version="after-restart")
    assert not host.needs_weights()
    assert _greedy(host, prompts[0])[0] == checkpoint_greedy[0]


def _process_group(pgid: int) -> list[int]:
    """The live processes of a process group (the server and the scheduler and detokenizer SGLang starts)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def test_a_server_refuses_calls_without_its_key(host):
    """Issue 30.4, on the real server. The host gave it a random key (no `api_key` in its spec), and 0.5.16's API-key
    middleware enforces it as the stand-in (`fake_server.sglang_authorizes`) does: no key, another key, the key
    without "Bearer" or with another scheme -> 401 `{"error": "Unauthorized"}` on the generate, weight, memory and
    cache routes and on a path that does not exist (the middleware runs before routing); the key, "Bearer" in any
    case -> through (an unknown path then 404); `/health`, `/health_generate` and `/metrics` (404 here: metrics are
    off) need none. The key is on no command line and in no environment of the server's processes, and in its log
    only as `<redacted>`, though SGLang (0.5.16 and 0.5.17) logs its arguments, the key among them, once at every start
    (this module's server starts twice when test_killed_server_is_restarted ran before, once in a `-k` selection without
    it): every start's line is there, redacted. The config file that held it is gone once the server is healthy
    (`SGLangRolloutHost._launch`), and the key is enforced all the same, after a relaunch too (written again for it):
    SGLang reads the file once, at its start."""
    import httpx

    key = host.spec.api_key
    assert key and len(key) >= 43
    refused = (401, {"error": "Unauthorized"})
    with httpx.Client(base_url=host.url, trust_env=False, timeout=60) as raw:
        wrong = ({}, {"Authorization": "Bearer x" + key}, {"Authorization": key}, {"Authorization": f"Basic {key}"})
        for path in ("/generate", "/update_weights_from_tensor", "/update_weights_from_distributed",
                     "/init_weights_update_group", "/release_memory_occupation", "/resume_memory_occupation",
                     "/flush_cache", "/weights_checker", "/update_weight_version", "/no_such_route"):  # fmt: skip
            for headers in wrong:
                answer = raw.post(path, json={}, headers=headers)
                assert (answer.status_code, answer.json()) == refused, (path, headers)
        for headers in wrong:
            answer = raw.get("/server_info", headers=headers)
            assert (answer.status_code, answer.json()) == refused, headers
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert raw.get("/model_info", headers={"Authorization": f"{scheme} {key}"}).status_code == 200, scheme
        assert raw.get("/no_such_route", headers={"Authorization": f"Bearer {key}"}).status_code == 404
        assert raw.get("/health").status_code == 200 and raw.get("/health_generate").status_code == 200
        assert raw.get("/metrics").status_code != 401
    pids = _process_group(host.server.pid)
    assert host.server.pid in pids and len(pids) >= 2  # the scheduler and the detokenizer too
    for pid in pids:
        for what in ("cmdline", "environ"):
            assert key.encode() not in Path(f"/proc/{pid}/{what}").read_bytes(), (pid, what)
    log = host.log_path.read_text(errors="replace")
    starts, lines = host.server.starts, log.count("server_args=ServerArgs(")
    print(f"SGLANG-REAL key: {lines} server_args lines in the log of {starts} start(s)")
    assert starts >= 1 and lines >= starts and log.count("api_key='<redacted>'") >= starts and key not in log
    # the config file that held the key (0600 in a 0700 directory while the server started: tests/rollout/sglang/
    # test_host.py) is gone: SGLang read it once, before it loaded the model, and every start enforced the key
    config = Path(host.server.argv[host.server.argv.index("--config") + 1])
    assert not config.exists()
    left = [p for p in config.parent.glob("*") if p.is_file()] if config.parent.is_dir() else []
    assert not any(key.encode() in p.read_bytes() for p in left)


def test_the_trainers_weight_names_land_and_others_are_skipped(host, tokens, ckpt):
    from miles_vl.models.qwen3_vl.model import build_model
    from miles_vl.rollout.sglang import checkpoint_names
    from miles_vl.rollout.sglang.verify import PROBE_MAX_NUMEL, parse_checksums, server_name
    from miles_vl.rollout.sglang.weights import send_tensor_bucket
    from miles_vl.train import OptimizerOptions, TorchTrainBackend, TrainOptions
    from tests.rollout.sglang.fake_server import sglang_parameter

    # 0.5.16's Qwen3-VL has no get_weights_by_name: the route answers 400 (weight_exporter.py:142, http_server.py:1403)
    with pytest.raises(SGLangRequestError, match="Get parameter by name failed"):
        host.client.post_json("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 2})

    def hashes() -> dict[str, tuple[str, ...]]:
        return parse_checksums(host.client.check_weights(), host.url)

    names = checkpoint_names(ckpt)
    model = build_model(tokens, path=str(ckpt), dtype=torch.bfloat16, device="cuda")
    exported = dict(TorchTrainBackend(model, tokens, TrainOptions(OptimizerOptions(lr=0.0))).export_weights())
    del model
    torch.cuda.empty_cache()
    assert set(exported) == names  # untied checkpoint, nothing frozen: every tensor, under the checkpoint's names

    before = hashes()
    # the vision tensor the engine probes (the first small one that loads 1:1), and lm_head (the last bucket's)
    vision = next(
        n
        for n, t in exported.items()
        if n.startswith("model.visual.") and t.numel() <= PROBE_MAX_NUMEL and server_name(n, before)
    )
    perturbed = {**exported, vision: exported[vision] + 0.5, "lm_head.weight": exported["lm_head.weight"] * 2}
    report = host.load_weights(perturbed.items(), weight_version="perturbed")
    after = hashes()
    changed = {n for n in after if after[n] != before.get(n)}
    print(f"SGLANG-REAL perturbed {vision} and lm_head.weight: server parameters changed {sorted(changed)}")
    print(f"SGLANG-REAL engine-verified probes of that sync: {report.verified}")
    assert {server_name(vision, after), "lm_head.weight"} <= changed
    # The engine's own check: this sync's probes (lm_head closes the only bucket; `vision` is the first vision probe)
    # were sent with new values again when restoring, so it compares the server's hashes of both.
    restored = host.load_weights(exported.items(), weight_version="exported")
    assert set(restored.verified) == {vision, "lm_head.weight"}

    # a name the checkpoint does not have: 200, and no parameter changes (the engine would refuse to send it)
    quiet = hashes()
    send_tensor_bucket(host.client, [("model.visual.not_a_parameter.weight", torch.ones(4, 4))], device="cuda")
    assert hashes() == quiet

    # every checkpoint name loads into a parameter named as the stand-ins name it (fake_server.sglang_parameter)
    mapped = {sglang_parameter(n) for n in names}
    print(f"SGLANG-REAL /weights_checker entries that are no checkpoint tensor: {sorted(set(after) - mapped)}")
    assert mapped <= set(after), sorted(mapped - set(after))


def test_a_deterministic_server_gives_a_requests_n_samples_one_seed(ckpt, tokens, prompts):
    """Why a deterministic engine sends one request per sample (and the stand-in's deterministic answer to n > 1):
    with --enable-deterministic-inference every sample of one request gets its sampling_seed, so the n samples are
    the same response; requests with two seeds differ."""
    det = _start_host(
        ckpt,
        tokens,
        extra_args=(*EXTRA_ARGS, "--enable-deterministic-inference"),
        mem_fraction=0.2,
        colocated=False,
        log_name="sglang_server_deterministic",
        plugin=False,  # stock SGLang: also checks that it cannot read pixel files
    )
    try:
        assert not det.engine.one_request_per_prompt and det.engine.pixel_dir is None
        ids = prompts[0].prompt_ids.tolist()

        def sample(seed: int, n: int) -> list[tuple[int, ...]]:
            payload = build_generate_payload(
                request_input_ids(ids, tokens.image_token_id, 1),
                [image_data_url(prompts[0].images[0])],
                SamplingParams(max_new_tokens=16, temperature=1.0),
                seed=seed,
                stop_token_ids=tokens.eos_token_ids,
                banned_token_ids=det.engine.banned_token_ids,
                n=n,
            )
            bodies = det.client.generate_n(payload, n) if n > 1 else [det.client.generate(payload)]
            return [tuple(b["output_ids"]) for b in bodies]

        same = sample(7, 3)
        print(f"SGLANG-REAL deterministic server, one request with n=3: {len(set(same))} distinct response(s)")
        assert len(set(same)) == 1
        assert sample(7, 1) == same[:1] and sample(8, 1) != same[:1]
        groups = det.generate(prompts[:1], SamplingParams(n=3, max_new_tokens=16, temperature=1.0, seed=1))
        assert len({tuple(g.response_ids.tolist()) for g in groups[0]}) == 3  # one request (one seed) per sample

        # stock 0.5.16 takes a pixel file reference for the pixel values (the stand-in's answers without the
        # launcher): it cannot hash it (HTTP 500), and a one-image item that brings its hash reaches the vision tower
        # as the reference, which kills the scheduler; why send_pixel_values needs miles_vl's plugin
        from miles_vl.rollout.sglang import SGLangUnavailableError

        directory = tempfile.mkdtemp(prefix="pixels_")  # stock 0.5.16 reads no file: the reference is enough
        media = pixel_media(prompts[0], 0, tokens, directory=directory, dtype=torch.bfloat16, spatial_merge_size=2)
        unhashed = [{k: v for k, v in media.image_data[0].items() if k != "hash"}]

        def body(image_data):
            return build_generate_payload(media.input_ids, image_data, SamplingParams(max_new_tokens=2), seed=0,
                                          stop_token_ids=tokens.eos_token_ids)  # fmt: skip

        def log_shows(text: str) -> str:
            deadline = time.monotonic() + 15
            while text not in (tail := det.server.log_tail(max_lines=400, max_bytes=1 << 17)):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            print(
                "SGLANG-REAL stock 0.5.16 with a pixel file: "
                + next((ln for ln in tail.splitlines() if text in ln), "")
            )
            return tail

        try:
            with pytest.raises(SGLangUnavailableError, match=r"HTTP 500"):
                det.client.request("POST", "/generate", json=body(unhashed), retry=False)
            assert "TypeError" in log_shows("TypeError") and det.health()
            with pytest.raises(SGLangUnavailableError, match=r"disconnected"):
                det.client.request("POST", "/generate", json=body(media.image_data), retry=False)
            # the vision tower's refusal of the reference: torch.cat's in 0.5.16, 0.5.17's own
            # (`materialize_multimodal_features`, srt/multimodal/mm_utils.py:86)
            refusal = {"0.5.16": "expected Tensor as element 0 in argument 0, but got dict",
                       "0.5.17": "expected torch.Tensor, got <class 'dict'>"}[sglang_release()]  # fmt: skip
            assert refusal in log_shows(refusal)
        finally:
            remove_files(directory, media.files)
    finally:
        det.shutdown()


def test_sglang_serves_a_directory_written_by_export(ckpt, processor, tokens, prompts, tmp_path):
    """`checkpoint.save_hf` / `miles-vl export` (orchestration/export.py `write_hf_dir` over the torch backend's
    `save_hf`) write a directory a real SGLang server loads and serves: our prompt ids come back, and its logprobs are
    those of the exported (perturbed) weights, not of the checkpoint the model started from."""
    from miles_vl.models.qwen3_vl.model import build_model
    from miles_vl.orchestration.export import write_hf_dir
    from miles_vl.train import OptimizerOptions, TorchTrainBackend, TrainOptions

    model = build_model(tokens, path=str(ckpt), dtype=torch.float32)
    with torch.no_grad():  # other weights than the checkpoint's: the server must serve these
        gen = torch.Generator().manual_seed(0)
        model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape, generator=gen) * 0.2)
    options = TrainOptions(OptimizerOptions(lr=0.0))
    out = write_hf_dir(tmp_path / "exported", TorchTrainBackend(model, tokens, options).save_hf, processor,
                       str(ckpt), force=False)  # fmt: skip
    server = _start_host(out, tokens, mem_fraction=0.2, colocated=False, log_name="sglang_server_exported")
    try:
        params = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=4)
        groups = server.generate(prompts, params)  # the engine checks each answer's prompt ids against ours
    finally:
        server.shutdown()

    train, rollout = _scored(model, tokens, prompts, groups, server.engine.banned_token_ids)
    original, _ = _scored(build_model(tokens, path=str(ckpt)), tokens, prompts, groups, server.engine.banned_token_ids)
    exported_diff = float((train - rollout).abs().mean())
    original_diff = float((original - rollout).abs().mean())
    print(f"SGLANG-REAL exported dir: logprob diff {exported_diff:.5f} vs its weights, {original_diff:.5f} vs the "
          "checkpoint it started from")  # fmt: skip
    assert exported_diff < 0.1
    assert original_diff > 5 * exported_diff


def _wait_until_running(host, requests: int, pending, timeout_s: float = 60.0) -> None:
    """Return once SGLang's scheduler runs `requests` requests: `GET /v1/loads` (0.5.16 and 0.5.17) reports
    `num_running_reqs`, the running batch, which a request joins after its prefill with its first token, so that an
    abort from then on returns output so far. The scheduler publishes it at every prefill and every 15 decode steps
    (`--load-snapshot-publish-interval`): it trails the batch by milliseconds.

    Args:
        pending: the future of the call that sends the requests: ending first (an answer, or an error) fails the test
            with what it returned, as does `timeout_s` without it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        loads = host.client.get_json("/v1/loads", params={"include": "core"})["loads"]
        if sum(load["num_running_reqs"] for load in loads) >= requests:
            return
        # waiting on the call's end is the pause between polls: nothing signals the running batch
        done, _ = concurrent.futures.wait([pending], timeout=0.05)
        if done:
            outcome = pending.exception() or pending.result()
            pytest.fail(f"the call ended before SGLang ran {requests} request(s) of it: {str(outcome)[:300]}")
        if time.monotonic() > deadline:
            pytest.fail(f"SGLang did not run {requests} request(s) within {timeout_s:g} s; /v1/loads: {loads}")


def test_an_aborted_request_returns_its_output_so_far(host, prompts, tokens):
    """Issue 34 (partial rollouts, not built yet; docs/async.md, "Not done yet"): what SGLang does with
    `POST /abort_request {"rid": ...}` while the request decodes, as read from 0.5.16's source (the scheduler sets
    `to_finish = FINISH_ABORT()`, the request runs one more decode step and finishes normally): `/generate` answers
    HTTP 200 with `finish_reason.type == "abort"`, the output ids so far and one logprob for each. A stand-in of a
    partial rollout must answer the same."""
    ids = prompts[0].prompt_ids.tolist()
    max_new = 4000  # long enough to still be decoding when the abort arrives (a tiny model: ~1-2 ms a token)
    payload = build_generate_payload(
        request_input_ids(ids, tokens.image_token_id, 1),
        [image_data_url(prompts[0].images[0])],
        SamplingParams(max_new_tokens=max_new, temperature=1.0),
        seed=0,
        stop_token_ids=tokens.eos_token_ids,
        banned_token_ids=host.engine.banned_token_ids,
    )
    payload["rid"] = "issue34-abort"
    payload["sampling_params"]["ignore_eos"] = True
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(host.client.generate, payload)
        _wait_until_running(host, 1, answer)  # decoding: an earlier abort finds no request, or no output yet
        host.client.post_json("/abort_request", {"rid": "issue34-abort"})
        body = answer.result(timeout=120)
    finish = body["meta_info"]["finish_reason"]
    assert finish["type"] == "abort", finish
    assert 0 < len(body["output_ids"]) < max_new
    assert len(body["meta_info"]["output_token_logprobs"]) == len(body["output_ids"])
    print(f"\n[abort] finish_reason {finish}, {len(body['output_ids'])} output ids kept")


def test_abort_all_returns_every_sample_so_far_and_the_engine_continues_them(host, prompts):
    """Issue 34, partial rollouts (rollout/sglang/engine.py `pause_generation` / `continue_generation`): with
    `n = 2` samples in one request (SGLang gives the copies fresh rids of its own, so the engine aborts with
    `{"abort_all": true}`), each aborted sample comes back with its output so far and its logprobs (HTTP 200); the
    engine keeps them and, after a relabelled weight version, sends each as prompt + tokens so far with the prompt's
    image: SGLang's prompt ids of the continuation are ours + the first span (the engine checks them), and the
    sample is one generation whose spans carry both versions. What the stand-in's `Handler._hold` does.

    Both samples must still be decoding when the pause comes: the tiny random checkpoint samples an EOS within a few
    dozen tokens (GPU runs of 2026-11-26: both samples had ended by EOS after 0.5 s), so the engine bans its EOS ids
    here (its own `banned_token_ids`, a -1e9 logit bias: nothing else stops a sample before `max_new_tokens`), and the
    pause waits until SGLang's scheduler runs both samples (`_wait_until_running`). An `abort_all` that reached the
    request before that would not test this: 0.5.16 lets such a request through (the engine's next `abort_all`, a
    second later, aborts it), 0.5.17 fails it with HTTP 499 (its tokenizer marks the request aborted,
    `TokenizerManager._raise_if_logical_rid_aborted`). Once the samples decode, both releases abort the same way
    (scheduler.py `abort_request`: `to_finish = FINISH_ABORT()`, one more decode step, the output so far)."""
    engine = host.engine
    engine.partial_rollouts = True
    banned = engine.banned_token_ids
    engine.banned_token_ids = (*banned, *engine.stop_token_ids)
    before = engine.weight_version
    params = SamplingParams(n=2, max_new_tokens=3000, temperature=1.0, seed=0)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(engine.generate, prompts[:1], params)
            _wait_until_running(host, params.n, answer)
            in_flight = engine.pause_generation()
            host.client.post_json("/update_weight_version", {"new_version": "issue34-continued"})
            engine.expect_weight_version("issue34-continued")
            engine.continue_generation()
            [group] = answer.result(timeout=300)
    finally:
        engine.partial_rollouts = False
        engine.banned_token_ids = banned
        host.client.post_json("/update_weight_version", {"new_version": before or "default"})  # the label of before
        if before is not None:
            engine.expect_weight_version(before)
        else:
            engine.weight_version = None
    print(f"\n[abort_all] spans {[g.spans for g in group]}")
    assert in_flight == 1 and len(group) == 2
    for g in group:  # aborted while decoding, continued to max_new_tokens (no EOS to end either span)
        assert len(g.spans) == 2, [g.spans for g in group]
        (s0, e0, v0), (s1, e1, v1) = g.spans
        assert (s0, v0, s1, e1, v1) == (0, before, e0, params.max_new_tokens, "issue34-continued"), g.spans
        assert 0 < e0 < params.max_new_tokens
        assert g.response_ids.numel() == params.max_new_tokens and g.finish_reason == "length"
        assert not set(g.response_ids.tolist()) & set(engine.stop_token_ids)
        assert g.logprobs.numel() == g.response_ids.numel() and bool((g.logprobs <= 0).all())
