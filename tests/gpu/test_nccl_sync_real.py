"""Contract (2 GPUs, real SGLang 0.5.16): after the disaggregated NCCL weight sync, the engine computes the trainer's
logprobs. A sync that did nothing, or landed the wrong tensors, fails it.

Set-up, as a disaggregated job runs it: one real SGLang server on the second visible GPU (`CUDA_VISIBLE_DEVICES` of
that GPU only, as Ray gives an engine actor; environment `build_server_env`, so `NCCL_CUMEM_ENABLE=0`) loads a tiny
random Qwen3-VL (scripts/gpu/make_tiny_qwen3vl.py). This process is trainer rank 0 on the first visible GPU: every
weight of the checkpoint (vision tower and lm_head included) perturbed by seeded noise of PERTURB x the tensor's own
std, sent through the production path (`open_trainer_group`: the cuMem check, the group, then
`DistributedWeightSender.send` in 1 MiB buckets so that several buckets go, the version label and the cache flush).

Compared: the logprob of every given token of fixed prompts (teacher forcing, `return_logprob` with
`logprob_start_len=0`: no sampling involved): two text prompts of random ids, and a geo3k-style prompt with one image
(only the text tokens after the image block are compared, so the vision tower's output conditions them). The
reference is transformers' forward of the same checkpoint on the first GPU, in bf16.

- method check: before the sync, the server (original weights) agrees with the HF forward of the original weights;
- the contract: after the sync, the server agrees with the HF forward of the perturbed weights;
- the control: the server before the sync (= weights a sync that did nothing would leave) is far outside the bound
  against the perturbed forward.

The bound, BOUND = 0.05 mean |difference| per token: the tiny model (init std 0.1) in bf16 against fp32 on these
prompts is 0.017 mean, 0.055 max (measured on CPU when writing this test); two bf16 implementations (SGLang's FA3
kernels vs transformers' SDPA) each carry that much, ~0.024 combined if independent; the loop's
`train_rollout_logprob_abs_diff` with this checkpoint is 0.012 (docs/gpu.md). The perturbation moves the logprobs by
1.4 mean on CPU (fp32), 28x the bound; the control asserts > 10x.

Run as its own pytest process (this process must start NCCL with the server's NCCL_CUMEM_ENABLE, which NCCL reads
once per process; the module sets it before its first NCCL call):

    bash scripts/gpu/stack.sh timeout -k 10 300 python -m pytest -q -s tests/gpu/test_nccl_sync_real.py

Environment: MILES_VL_SGLANG_CKPT (the tiny checkpoint; default: written here), MILES_VL_SGLANG_STARTUP_S (server
start timeout, default 240 s), OUT (server log as $OUT/sglang_nccl_sync.log), MILES_VL_SGLANG_PIDFILE (the server's
pid is appended, as tests/gpu/test_sglang_real.py does). Prints one `GPU-NCCL-SYNC {json}` line with the figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
HAS_SGLANG = importlib.util.find_spec("sglang") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_SGLANG, reason="needs sglang (scripts/gpu/stack.sh)"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2,
        reason=f"needs 2 GPUs (server on one, trainer on the other), found {torch.cuda.device_count()}",
    ),
]

PERTURB = 0.25  # noise std relative to each weight tensor's std
BOUND = 0.05  # mean |logprob difference| per token (module docstring)
CONTROL_FACTOR = 10.0
BUCKET_BYTES = 1024**2  # several buckets for the 5.5 MB checkpoint
N_TEXT, TEXT_LEN = 2, 96
EXTRA_ARGS = (
    "--disable-cuda-graph",  # quick start; the prefill path scores the prompts either way
    "--disable-radix-cache",  # every scoring is a full prefill
    "--context-length",
    "4096",
    "--grammar-backend",
    "none",
)


def _writer():
    return load_script("scripts/gpu/make_tiny_qwen3vl.py")


def visible_gpus() -> list[str]:
    """The physical ids of the visible GPUs (what a child's CUDA_VISIBLE_DEVICES must name)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in cvd.split(",")] if cvd else [str(i) for i in range(torch.cuda.device_count())]


def perturbed(weights: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """Every floating tensor with more than one value plus seeded noise of PERTURB x its std (norm weights of all
    ones have std 0 and stay), in its own dtype."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(weights):
        w = weights[name]
        if w.is_floating_point() and w.numel() > 1:
            noise = torch.randn(w.shape, generator=g) * (PERTURB * float(w.float().std()))
            w = (w.float() + noise).to(w.dtype)
        out[name] = w.contiguous()
    return out


def write_like(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    """`src`'s checkpoint directory with other weights (config, processor and generation config copied)."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def make_prompts(processor, tokens) -> list[dict]:
    """Fixed prompts: N_TEXT of random ordinary ids, and one geo3k-style prompt with one image as miles_vl builds it.

    Each: `ids` (canonical, image tokens expanded), `first` (the first target position compared: after the image
    block), and for the image prompt `image` (the PIL image) and `hf` (the processor's tensors for transformers).
    """
    from miles_vl.data import PromptEncoder, generate_problems

    ordinary = min(tokens.image_token_id, tokens.video_token_id, tokens.vision_start_token_id, tokens.pad_token_id)
    g = torch.Generator().manual_seed(0)
    out = [{"ids": torch.randint(0, ordinary, (TEXT_LEN,), generator=g).tolist(), "first": 1} for _ in range(N_TEXT)]
    encoder = PromptEncoder(processor, instruction="Let's think step by step and output the final answer in \\boxed{}.")
    (problem,) = generate_problems(1, seed=0)
    enc = processor(text=[encoder.render(problem.problem)], images=[problem.image], return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    end = len(ids) - 1 - ids[::-1].index(tokens.vision_end_token_id)
    out.append({"ids": ids, "first": end + 1, "image": problem.image, "hf": enc})
    return out


def server_logprobs(client, prompt: dict, image_token_id: int) -> torch.Tensor:
    """The server's logprob of each prompt token from `first` on (teacher forcing over the whole prompt)."""
    from miles_vl.rollout.sglang.generate import image_data_url, request_input_ids

    body = {
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if "image" in prompt:  # one pad per image: SGLang's processor expands it again
        body["input_ids"] = request_input_ids(prompt["ids"], image_token_id, 1)
        body["image_data"] = [image_data_url(prompt["image"])]
    else:
        body["input_ids"] = prompt["ids"]
    answer = client.generate(body)
    got = answer["meta_info"]["input_token_logprobs"]
    if len(got) != len(prompt["ids"]):
        raise AssertionError(
            f"the server scored {len(got)} prompt tokens, expected {len(prompt['ids'])} (its prompt_token_ids: "
            f"{answer.get('prompt_token_ids', '?')!s:.300})"
        )
    return torch.tensor([float(x[0]) for x in got[prompt["first"] :]])


@torch.no_grad()
def hf_logprobs(path: Path, prompts: list[dict]) -> list[torch.Tensor]:
    """transformers' bf16 forward of the checkpoint at `path` on cuda:0: each prompt's logprobs from `first` on."""
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.bfloat16, local_files_only=True)
    model = model.to("cuda:0").eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p["ids"]], device="cuda:0")
        extra = {}
        if "hf" in p:
            # pixel values, grids and whatever else this transformers' forward wants with them (mm_token_type_ids)
            extra = {k: v.to("cuda:0") for k, v in p["hf"].items() if k != "input_ids"}
        logits = model(input_ids=ids, **extra).logits.float()[0]
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]  # lp[j-1]: token j
        out.append(lp[p["first"] - 1 :].cpu())
    del model
    torch.cuda.empty_cache()
    return out


def mean_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [round(float((x - y).abs().mean()), 5) for x, y in zip(a, b, strict=True)]


def max_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [round(float((x - y).abs().max()), 4) for x, y in zip(a, b, strict=True)]


def tiny_checkpoint(tmp_path_factory, writer) -> Path:
    """$MILES_VL_SGLANG_CKPT when it holds a checkpoint, else a tiny random Qwen3-VL written here."""
    given = os.environ.get("MILES_VL_SGLANG_CKPT")
    if given and (Path(given) / "model.safetensors").exists():
        return Path(given)
    ckpt = tmp_path_factory.mktemp("tiny_qwen3vl")
    writer.write_checkpoint(ckpt, shape="tiny", seed=0)
    return ckpt


def server_for(ckpt: Path, processor, *, colocated: bool, gpu: str, log_name: str):
    """(spec, environment, ServerProcess not yet started) of a real SGLang server for `ckpt` on GPU `gpu`, resizing
    images with the processor's pixel range; its log in $OUT/`log_name` (else a temporary folder)."""
    from miles_vl.rollout import sglang as sg
    from tests.rollout.sglang.conftest import free_port

    size = processor.image_processor.size
    spec = sg.ServerSpec(
        model_path=str(ckpt),
        port=free_port(),
        mem_fraction_static=0.3,
        colocated=colocated,
        random_seed=0,
        image_min_pixels=size.shortest_edge,
        image_max_pixels=size.longest_edge,
        extra_args=EXTRA_ARGS,
    )
    env = {**sg.build_server_env(spec), "CUDA_VISIBLE_DEVICES": gpu}
    out_dir = os.environ.get("OUT")
    log_path = Path(out_dir) / log_name if out_dir else Path(tempfile.mkdtemp()) / "sglang.log"
    return (
        spec,
        env,
        sg.ServerProcess(sg.build_server_argv(spec, module=sg.SGLANG_LAUNCH_MODULE), env=env, log_path=log_path),
    )


def record_pid(server) -> None:
    """The started server's pid appended to $MILES_VL_SGLANG_PIDFILE (run_sglang_checks.sh ends leftovers)."""
    if os.environ.get("MILES_VL_SGLANG_PIDFILE") and server.pid is not None:
        with open(os.environ["MILES_VL_SGLANG_PIDFILE"], "a") as f:
            f.write(f"{server.pid}\n")


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> dict:
    """Start the server, score, sync the perturbed weights through the production sender, score again, stop."""
    import ray
    from safetensors.torch import load_file

    from miles_vl.data import load_processor
    from miles_vl.models.qwen3_vl.tokens import special_tokens
    from miles_vl.rollout import sglang as sg
    from miles_vl.rollout.sglang.client import RequestPolicy, SGLangClient
    from miles_vl.rollout.sglang.weights import EngineAddress, open_trainer_group

    writer = _writer()
    ckpt = tiny_checkpoint(tmp_path_factory, writer)
    original = load_file(str(ckpt / "model.safetensors"))
    new = perturbed(original)
    new_dir = write_like(ckpt, tmp_path_factory.mktemp("perturbed"), new)
    # the processor that builds the prompts; the server resizes images with the same pixel range (ServerSpec below)
    processor = load_processor(str(ckpt), writer.DEFAULT_MIN_PIXELS, writer.DEFAULT_MAX_PIXELS)
    tokens = special_tokens(processor)
    prompts = make_prompts(processor, tokens)

    spec, env, server = server_for(
        ckpt, processor, colocated=False, gpu=visible_gpus()[1], log_name="sglang_nccl_sync.log"
    )
    log_path = server.log_path
    saved_cumem = os.environ.get("NCCL_CUMEM_ENABLE")
    os.environ["NCCL_CUMEM_ENABLE"] = env["NCCL_CUMEM_ENABLE"]  # as the job's runtime env gives the train actor
    server.start()
    record_pid(server)
    client = SGLangClient(spec.url, policy=RequestPolicy(timeout_s=120, max_retries=0), liveness=server.death_reason)
    try:
        startup = float(os.environ.get("MILES_VL_SGLANG_STARTUP_S", "240"))
        started_s = sg.wait_until_healthy(client, server, timeout_s=startup, poll_s=0.5)
        before = [server_logprobs(client, p, tokens.image_token_id) for p in prompts]

        torch.cuda.set_device(0)
        here = ray.util.get_node_ip_address()
        address = EngineAddress(
            url=spec.url, api_key=None, tp_size=1, node_ip=here, loopback=True, nccl_cumem=env["NCCL_CUMEM_ENABLE"]
        )
        sender = open_trainer_group([address], backend="nccl", max_bucket_bytes=BUCKET_BYTES, request_timeout_s=60.0)
        try:
            report = sender.send(((n, t) for n, t in new.items()), weight_version="perturbed")
        finally:
            sender.close()
        version = client.model_info().get("weight_version")
        after = [server_logprobs(client, p, tokens.image_token_id) for p in prompts]
    except BaseException:
        print(f"\n[sglang server log tail: {log_path}]\n{server.log_tail(max_lines=25)}")
        raise
    finally:
        server.stop()
        client.close()
        if saved_cumem is None:
            os.environ.pop("NCCL_CUMEM_ENABLE", None)
        else:
            os.environ["NCCL_CUMEM_ENABLE"] = saved_cumem

    run = {
        "before": before,
        "after": after,
        "hf_original": hf_logprobs(ckpt, prompts),
        "hf_perturbed": hf_logprobs(new_dir, prompts),
        "report": report,
        "version": version,
        "tensors": len(new),
        "bytes": sum(t.numel() * t.element_size() for t in new.values()),
    }
    figures = {
        "server_start_s": round(started_s, 1),
        "sync": {"tensors": report.tensors, "bytes": report.bytes, "buckets": report.buckets, "s": report.seconds},
        "weight_version": version,
        **agreement_figures(run),
    }
    print("GPU-NCCL-SYNC " + json.dumps(figures))
    return run


def agreement_figures(run: dict) -> dict:
    """The logprob comparisons a sync test prints (its `before`/`after` server logprobs against transformers' forward
    of the original and the perturbed weights), as the three contract tests below assert them."""
    before, after = run["before"], run["after"]
    return {
        "tokens_compared": [len(x) for x in after],
        "before_vs_hf_original": mean_abs(before, run["hf_original"]),
        "after_vs_hf_perturbed": mean_abs(after, run["hf_perturbed"]),
        "after_vs_hf_perturbed_max": max_abs(after, run["hf_perturbed"]),
        "control_before_vs_hf_perturbed": mean_abs(before, run["hf_perturbed"]),
        "bound": BOUND,
    }


def test_sync_sends_every_tensor_in_buckets(sync_run):
    report = sync_run["report"]
    assert report.tensors == sync_run["tensors"]
    assert report.bytes == sync_run["bytes"]
    assert report.buckets > 1, report  # 1 MiB buckets of a 5.5 MB checkpoint
    assert sync_run["version"] == "perturbed", sync_run["version"]  # the label the sync set


# the contract tests, shared with tests/gpu/test_ipc_sync_real.py (which imports them: pytest runs them there on its own
# `sync_run`)
def test_method_agrees_before_the_sync(sync_run):
    """The scoring itself: the server's original weights against transformers' forward of the same checkpoint."""
    diffs = mean_abs(sync_run["before"], sync_run["hf_original"])
    assert max(diffs) < BOUND, diffs


def test_engine_logprobs_equal_the_trainers_after_the_sync(sync_run):
    diffs = mean_abs(sync_run["after"], sync_run["hf_perturbed"])
    assert max(diffs) < BOUND, diffs


def test_bound_catches_unsynced_weights(sync_run):
    """The server's logprobs before the sync are what a sync that did nothing leaves: far outside the bound."""
    diffs = mean_abs(sync_run["before"], sync_run["hf_perturbed"])
    assert min(diffs) > CONTROL_FACTOR * BOUND, diffs
