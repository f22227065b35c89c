"""Contracts of the driver loop with `rollout.backend=sglang`, end to end on CPU. The "SGLang servers" are
tests/rollout/sglang/hf_server.py: processes launched by the real host from the real argv (the test substitutes only
the module run with `python -m`), speaking SGLang 0.5.16's HTTP API and generating with the tiny HF Qwen3-VL of a
checkpoint directory. Each server journals the calls it received and a digest of its weights at every sync.

Colocated (`/update_weights_from_tensor`), both ways of `rollout.sglang.colocated_sync`:
- every step: release memory -> train -> resume -> weights in several buckets, then the version label and the cache
  flush: with `ipc` (the default) trainer rank 0 sends flat buckets itself and the label and flush ride on the last
  bucket's request (the server's value check before the first sync of each sender: the job's first, and the re-sync
  after the relaunch); with `tensor` the engine actor sends them, then `/update_weight_version` and `/flush_cache`
  (the value check before every sync);
- after each sync the server's weights equal the trainer's checkpoint of that step, bit for bit, and its samples
  score like the trainer's (`train_rollout_logprob_abs_diff` ~ 0 in fp32);
- a server killed after a sync is relaunched by its host, refuses to generate with its reloaded weights, is re-synced
  by the driver (counted) and its prompts are retried: no sample is lost.
Disaggregated (`/update_weights_from_distributed`, gloo in place of NCCL): the group is formed once, then per sync
one POST per bucket while the trainer broadcasts, the version label, the flush; the weights arrive exactly.
Prompts reach the servers as pixel values by default (`rollout.sglang.send_pixel_values`: their ids and own pixel
values, through a directory the host owns); video prompts go that way too, and their packed training logprobs equal
the server's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from miles_vl.config import ConfigError
from miles_vl.config.schema import SGLangConfig
from miles_vl.orchestration import run_job
from miles_vl.orchestration.factories import server_spec
from miles_vl.orchestration.loop import check_backends
from miles_vl.rollout.sglang import build_server_env
from miles_vl.rollout.weight_sync import WeightSyncOptions
from tests.orchestration.jobs import metrics, pretrained, stand_ins, tiny_job, write_checkpoint
from tests.rollout.sglang.conftest import free_port
from tests.rollout.sglang.fake_server import read_journal
from tests.rollout.sglang.hf_server import tensor_digest

SYNC_PATHS = ("/update_weights_from_tensor", "/update_weights_from_distributed", "/update_weight_version")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny random Qwen3-VL and the offline processor as an HF checkpoint directory (what SGLang would load)."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny_qwen3vl"))


@pytest.fixture
def hooks():
    # 64 KiB buckets: the tiny model then takes several
    return stand_ins(sglang=True, weight_sync=WeightSyncOptions(bucket_bytes=64 * 1024))


def config(tmp_path: Path, checkpoint: Path, name: str, *overrides: str):
    return tiny_job(
        tmp_path,
        name,
        *pretrained(checkpoint),
        "num_steps=2",
        "rollout.backend=sglang",
        f"rollout.sglang.port={free_port()}",
        "rollout.sglang.startup_timeout_s=120",
        "rollout.sglang.request_timeout_s=60",
        "rollout.sglang.max_retries=1",
        "checkpoint.interval=1",
        *overrides,
    )


def trainer_digests(run_dir: Path, step: int) -> dict[str, str]:
    tensors = load_file(run_dir / "checkpoints" / f"step_{step:08d}" / "model.safetensors")
    return {name: tensor_digest(t) for name, t in tensors.items()}


# Tensors a checkpoint stores once for two names (the server's digest would list one name the trainer's checkpoint
# lacks): none here, the tiny Qwen3-VL does not tie its embedding (checked in `check_weights_match_the_trainer`).
TIED: frozenset[str] = frozenset()


def check_weights_match_the_trainer(run_dir: Path, journal: dict[int, list[dict]], checkpoint: Path) -> None:
    """Every weight version a server reported holds exactly the trainer's weights of that step: the same set of
    names (no tensor the server lacks, none it has that the sync missed) and the same bytes; no name was skipped."""
    config = json.loads((checkpoint / "config.json").read_text())
    assert not config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings"))
    trainer = {k: trainer_digests(run_dir, k) for k in (1, 2)}
    seen = 0
    for records in journal.values():
        assert not [r for r in records if r.get("event") == "skipped"]  # SGLang would have skipped them silently
        for r in records:
            if r.get("event") == "weights":
                want = trainer[int(r["version"].removeprefix("step-"))]
                assert set(r["digest"]) == set(want) | TIED, r["version"]
                assert r["digest"] == {**want, **{n: r["digest"][n] for n in TIED}}, r["version"]
                seen += 1
    assert seen >= 2


def sync_sequences(records: list[dict]) -> list[list[str]]:
    """The calls of each weight sync: from its first weight call to the flush after the version label."""
    out, current = [], None
    for r in records:
        path = r.get("path")
        if path in SYNC_PATHS and current is None:
            current = []
        if current is not None and path is not None:
            current.append(path)
            if path == "/flush_cache" and current[-2] == "/update_weight_version":
                out.append(current)
                current = None
    return out


def ipc_sync_sequences(records: list[dict]) -> list[list[str]]:
    """The calls of each `colocated_sync=ipc` sync: its buckets up to the one that labelled the version."""
    out, current = [], []
    for r in records:
        if r.get("path") == "/update_weights_from_tensor":
            current.append(r["path"])
        elif r.get("event") == "weights" and current:
            out.append(current)
            current = []
    return out


@pytest.mark.parametrize("way", ["ipc", "tensor"])
def test_colocated_sync_restart_and_resync(tmp_path, checkpoint, hooks, local_ray, way):
    journal_dir, crash = tmp_path / "journal", tmp_path / "crash-once"
    journal_dir.mkdir()
    crash.touch()
    extra = f"rollout.sglang.extra_args=[--fake-journal,{journal_dir},--fake-exit-file,{crash}]"
    run = run_job(config(tmp_path, checkpoint, "colocated", extra, f"rollout.sglang.colocated_sync={way}"), hooks=hooks)
    rows = metrics(run)

    assert not crash.exists()  # a server did crash (on its first generate after the step-1 sync) ...
    assert rows[-1]["rollout/engine_restarts"] == 1  # ... its host relaunched it ...
    assert rows[-1]["rollout/weight_resyncs"] == 1  # ... and the driver gave it the step-1 weights again
    for r in rows:
        assert r["rollout/prompts"] == 2  # no prompt lost
        assert r["train/n_loss_tokens"] == r["rollout/response_tokens"]  # every sample trained on
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-4  # the servers sampled with the trainer's weights
    assert "eval/reward_mean" in rows[-1]

    [records] = read_journal(journal_dir).values()
    check_weights_match_the_trainer(run, {0: records}, checkpoint)
    paths = [r["path"] for r in records if "path" in r]
    starts = [k for k, p in enumerate(paths) if p == "/update_weights_from_tensor" and paths[k - 1] != p]
    assert len(starts) == 3  # step 1, the re-sync of the relaunched server, step 2
    if way == "tensor":
        syncs = sync_sequences(records)
        assert len(syncs) == 3
        for seq in syncs:  # several buckets, then the version label, then the flush
            assert len(seq) >= 4 and seq[:-2] == ["/update_weights_from_tensor"] * (len(seq) - 2)
        # Each colocated sync is verified: the server's hashes are read before its first bucket (verify.py).
        assert all(paths[k - 1] == "/weights_checker" for k in starts)
    else:
        syncs = ipc_sync_sequences(records)
        assert len(syncs) == 3 and all(len(seq) >= 2 for seq in syncs)  # several buckets, the last one labels
        assert "/update_weight_version" not in paths  # the label rode on the last bucket, and so did the flush:
        assert all(paths[k + 1] == "/release_memory_occupation" for k, p in enumerate(paths) if p == "/flush_cache")
        flushed = [r for r in records if r.get("event") == "flushed"]
        assert len(flushed) == 3
        # values checked on the first sync and on the re-sync (a new sender), not on step 2 (verify_weights_every=10)
        assert [paths[k - 1] == "/weights_checker" for k in starts] == [True, True, False]
        # where each sync's seconds went (issue 33.1), logged every step
        assert all({"sync/export_s", "sync/pack_s", "sync/wait_s", "sync/check_s"} <= set(r) for r in rows)
    assert "/update_weights_from_distributed" not in paths
    # Colocated memory: all of it released before each of the 2 train steps; after it the weights resumed alone, the
    # sync, then the KV cache and CUDA graphs (an 8B engine on one GPU cannot hold its KV cache beside the sync).
    memory = [(r["release"], r["tags"]) for r in records if r.get("event") == "memory"]
    everything = ["cuda_graph", "kv_cache", "weights"]  # the stand-in's tags=None
    assert memory == [(True, everything), (False, ["weights"]), (False, ["kv_cache", "cuda_graph"])] * 2
    resumed = [k for k, r in enumerate(records) if r.get("event") == "memory" and not r["release"]]
    for weights_at, rest_at in zip(resumed[::2], resumed[1::2], strict=True):
        between = [r.get("path") for r in records[weights_at:rest_at]]
        assert "/update_weights_from_tensor" in between and "/generate" not in between
    # The relaunched server (second pid) got the step-1 weights before its first generate (it refused until then).
    pids = list(dict.fromkeys(r["pid"] for r in records))
    assert len(pids) == 2
    second = [r for r in records if r["pid"] == pids[1]]
    first_generate = next(k for k, r in enumerate(second) if r.get("path") == "/generate")
    assert [r["version"] for r in second[:first_generate] if r.get("event") == "weights"] == ["step-1"]


def test_video_prompts_through_sglang_score_as_the_server_sampled_them(tmp_path, checkpoint, hooks, local_ray):
    """The motion video task with rollout.backend=sglang (issue 18, item 3): each video prompt goes as its ids, its
    own frames' pixel values and its grid (no PNGs, no re-sampling of frames), the server generates from them, and
    the trainer's packed video samples score the responses as the server did (fp32 on both sides)."""
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    small_videos = ("data.video_min_pixels=1024", "data.video_max_pixels=16384", "data.video_min_frames=2")
    extra = f"rollout.sglang.extra_args=[--fake-journal,{journal_dir}]"
    run = run_job(
        config(tmp_path, checkpoint, "video", "data.synthetic_task=motion", "eval.interval=0", extra, *small_videos),
        hooks=hooks,
    )
    rows = metrics(run)
    diffs = [r["train/train_rollout_logprob_abs_diff"] for r in rows]
    print(f"video through the SGLang stand-in: train_rollout_logprob_abs_diff per step {diffs}")
    assert len(rows) == 2 and max(diffs) < 1e-4, diffs
    [records] = read_journal(journal_dir).values()
    prompts = [p for r in records if r.get("event") == "generate" for p in r["prompts"]]
    assert len(prompts) >= 4  # two steps of two prompts
    for prompt in prompts:  # one processor_output item per prompt: a grid of >= 2 frame groups, and no image
        [item] = prompt["videos"]
        assert prompt["images"] == [] and item["format"] == "processor_output" and item["video_grid_thw"][0][0] >= 2


def test_disaggregated_nccl_sequence_over_gloo(tmp_path, checkpoint, hooks, local_ray):
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    run = run_job(
        config(
            tmp_path,
            checkpoint,
            "disaggregated",
            "ray.placement=disaggregate",
            "rollout.num_engines=1",
            "eval.interval=0",
            f"rollout.sglang.extra_args=[--fake-journal,{journal_dir}]",
            "rollout.sglang.port=null",  # the default: the engine's actor picks a free port, which the trainer is told
        ),
        hooks=hooks,
    )
    rows = metrics(run)
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in rows)
    [records] = read_journal(journal_dir).values()
    check_weights_match_the_trainer(run, {0: records}, checkpoint)
    paths = [r["path"] for r in records if "path" in r]
    assert paths.count("/init_weights_update_group") == 1  # formed once, used by both syncs
    sync = paths[paths.index("/init_weights_update_group") :]
    n = sync.index("/update_weight_version") - 1
    assert n >= 2 and sync[1 : n + 1] == ["/update_weights_from_distributed"] * n  # one POST per bucket
    assert sync[n + 1 : n + 3] == ["/update_weight_version", "/flush_cache"]
    assert len(sync_sequences(records)) == 2
    assert paths[-1] == "/destroy_weights_update_group"  # the group is left at the end of the job
    assert not {"/update_weights_from_tensor", "/release_memory_occupation"} & set(paths)


def test_a_server_that_dies_mid_nccl_sync_is_relaunched_and_synced_again(
    tmp_path, checkpoint, hooks, local_ray, caplog
):
    """Issue 32.2: the server dies in the second bucket of the first sync (the trainer is mid-broadcast). The sync
    ends with an error naming the server's endpoint and what its client saw (gloo alone said only "Connection reset
    by peer"); its host relaunches it, the driver forms a new group and syncs it again, and the run goes on with
    weights equal to the trainer's."""
    journal_dir, fault = tmp_path / "journal", tmp_path / "fault.json"
    journal_dir.mkdir()
    fault.write_text(json.dumps({"path": "/update_weights_from_distributed", "kind": "exit", "value": 1, "after": 1}))
    extra = f"rollout.sglang.extra_args=[--fake-journal,{journal_dir},--fake-fault-file,{fault}]"
    cfg = config(tmp_path, checkpoint, "dies", *_disaggregated(extra))
    run = run_job(cfg, hooks=hooks)
    endpoint = f"127.0.0.1:{cfg.rollout.sglang.port}/update_weights_from_distributed"
    failed = [r.getMessage() for r in caplog.records if "weight sync step-1 over gloo failed" in r.getMessage()]
    assert failed and endpoint in failed[0] and "Server disconnected without sending a response" in failed[0]
    rows = metrics(run)
    assert not fault.exists()  # the server took the fault ...
    assert rows[-1]["rollout/engine_restarts"] == 1 and rows[-1]["rollout/weight_resyncs"] >= 1  # ... and came back
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in rows)
    [records] = read_journal(journal_dir).values()
    check_weights_match_the_trainer(run, {0: records}, checkpoint)
    inits = [r["pid"] for r in records if r.get("path") == "/init_weights_update_group"]
    assert len(inits) == 2 and inits[0] != inits[1]  # the relaunched server joined a new group


def _disaggregated(extra: str) -> tuple[str, ...]:
    return ("ray.placement=disaggregate", "rollout.num_engines=1", "eval.interval=0", extra)


def test_sigint_during_a_stalled_nccl_sync_stops_within_30_s_with_the_last_checkpoint(
    tmp_path, checkpoint, hooks, local_ray
):
    """Issue 32.2: the server stops answering in the step-2 sync (it neither receives nor answers), and SIGINT comes
    then. The sync's own deadline is far (600 s), so it is the stop that ends it: 10 s later the train ranks are
    ended, the job raises JobInterrupted (not forced) well within 30 s of the signal, step 1's checkpoint is byte for
    byte what it was and no checkpoint of the half-synced step 2 exists. Before, the driver waited for the sync
    (the real case: forever), a second signal (here at 40 s) did not end it either, as the clean-up waited for the
    stuck train actor too: the test then ends the process at 120 s with every thread's traceback."""
    import faulthandler
    import os
    import signal
    import threading
    import time

    import httpx

    from miles_vl.orchestration.engines import RolloutEngines
    from miles_vl.orchestration.loop import JobInterrupted

    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    extra = f"rollout.sglang.extra_args=[--fake-journal,{journal_dir}]"
    cfg = config(
        tmp_path,
        checkpoint,
        "stalled",
        *_disaggregated(extra),
        "rollout.sglang.sync_timeout_s=600",
        "rollout.sglang.request_timeout_s=600",
    )
    port = cfg.rollout.sglang.port
    original = RolloutEngines.sync_weights
    sent: dict[str, float] = {}
    step_1: dict[Path, bytes] = {}

    def stall_then_stop(self, version):
        if version == "step-2":
            ckpt = Path(cfg.logging.output_dir) / "stalled" / "checkpoints"
            step_1.update({p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()})
            fault = {"path": "/update_weights_from_distributed", "kind": "delay", "value": 3600}
            httpx.post(f"http://127.0.0.1:{port}/_fake/inject", json=fault, timeout=10).raise_for_status()
            sent["at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)
            again = threading.Timer(40, os.kill, (os.getpid(), signal.SIGINT))  # a stop that waits fails here ...
            again.daemon = True
            again.start()
            sent["timer"] = again
            faulthandler.dump_traceback_later(120, exit=True)  # ... and one that hangs in its clean-up ends here
        return original(self, version)

    RolloutEngines.sync_weights = stall_then_stop
    try:
        with pytest.raises(JobInterrupted) as stopped:
            run_job(cfg, hooks=hooks)
    finally:
        RolloutEngines.sync_weights = original
        faulthandler.cancel_dump_traceback_later()
        if "timer" in sent:
            sent["timer"].cancel()
    seconds = time.monotonic() - sent["at"]
    assert not stopped.value.forced, f"only the second signal stopped the job ({seconds:.0f} s)"
    assert seconds < 30, seconds
    assert stopped.value.checkpoint == 1
    ckpt = Path(cfg.logging.output_dir) / "stalled" / "checkpoints"
    assert step_1 and {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == step_1
    assert [p.name for p in ckpt.iterdir()] == ["step_00000001"]


def test_what_sglang_cannot_run_is_a_config_error_before_ray(tmp_path):
    checkpoint = tmp_path  # never read: the checks run on the config alone
    random_init = config(tmp_path, checkpoint, "x", "model.init=random", "model.processor=offline")
    with pytest.raises(ConfigError, match="model.init=random trains a random model the server cannot load"):
        check_backends(random_init)
    for wide in ("rollout.gpus_per_engine=2", "rollout.num_engines=2"):
        with pytest.raises(ConfigError, match=r"rollout.gpus_per_engine = 2 > train.num_gpus=1"):
            config(tmp_path, checkpoint, "x", "train.num_gpus=1", wide)
        check_backends(config(tmp_path, checkpoint, "x", "train.num_gpus=1", "ray.placement=disaggregate", wide))
    check_backends(config(tmp_path, checkpoint, "x", "train.num_gpus=1"))  # one engine on the trainer's GPU
    deterministic = "rollout.sglang.extra_args=[--enable-deterministic-inference]"
    with pytest.raises(ConfigError, match="one_request_per_prompt=true with a deterministic server"):
        check_backends(config(tmp_path, checkpoint, "x", deterministic, "rollout.sglang.one_request_per_prompt=true"))
    check_backends(config(tmp_path, checkpoint, "x", deterministic))  # null: one request per sample there
    for flags, message in (  # issue 30.4: flags that would undo the servers' keys, refused before Ray (not at launch)
        ("[--admin-api-key,x]", "sets --admin-api-key: a second key on the command line"),
        ("[--tokenizer-worker-num=2]", "sets --tokenizer-worker-num 2: .*checks no API key"),
        ("[--hos,0.0.0.0]", r"sets --hos \(a prefix of --host"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_backends(config(tmp_path, checkpoint, "x", f"rollout.sglang.extra_args={flags}"))
    # GPU run of 2026-11-26: a key SGLang's --config -> argv path cannot take killed the server at start; now the config
    # check refuses it, naming the problem and never the key
    for key, problem in (("-s3cret-dash", "starts with '-'"), ("s3cr\u00e9t", "non-ASCII"), ("s3cret ", "space")):
        with pytest.raises(
            ConfigError, match=r"rollout.sglang.api_key \(value <redacted>\) cannot be SGLang's"
        ) as info:
            check_backends(config(tmp_path, checkpoint, "x", f"rollout.sglang.api_key='{key}'"))
        assert problem in str(info.value) and "s3cr" not in str(info.value)
    last_port = ("rollout.sglang.port=65535", "rollout.num_engines=2", "ray.placement=disaggregate")
    with pytest.raises(ConfigError, match=r"ServerSpec.port=65536 is not a TCP port.*or leave it null"):
        check_backends(config(tmp_path, checkpoint, "x", *last_port))


def test_server_spec_follows_the_config(tmp_path):
    checkpoint = tmp_path  # never read
    cfg = config(tmp_path, checkpoint, "x", "rollout.gpus_per_engine=2", "train.num_gpus=2", "train.backend=megatron")
    spec = server_spec(cfg, index=1)
    assert (spec.port, spec.tp_size, spec.colocated) == (cfg.rollout.sglang.port + 1, 2, True)
    assert (
        server_spec(config(tmp_path, checkpoint, "x", "rollout.sglang.port=null"), index=1).port is None
    )  # host's pick
    assert SGLangConfig().port is None  # the default: a free port per engine, chosen on its node
    assert spec.vision_cache_mb == 0  # off unless asked: the cache would outlive weight syncs
    assert build_server_env(spec, base={})["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
    with pytest.raises(ConfigError, match="rollout.sglang.vision_cache_mb=256 keeps vision embeddings"):
        config(tmp_path, checkpoint, "x", "rollout.sglang.vision_cache_mb=256")
    frozen = config(tmp_path, checkpoint, "x", "rollout.sglang.vision_cache_mb=256", "train.freeze_vision=true")
    assert build_server_env(server_spec(frozen, index=0), base={})["SGLANG_VLM_CACHE_SIZE_MB"] == "256"
    plugin = "MILES_VL_SGLANG_PLUGIN"  # the vision graphs: off unless asked for (they pay off for repeated layouts)
    assert json.loads(build_server_env(spec, base={})[plugin])["vision_graphs"] == 0
    kept = config(tmp_path, checkpoint, "x", "rollout.sglang.vision_cuda_graphs=3")
    assert json.loads(build_server_env(server_spec(kept, index=0), base={})[plugin])["vision_graphs"] == 3
    stock = config(tmp_path, checkpoint, "x", "rollout.sglang.launcher=sglang")
    assert server_spec(stock, index=0).plugin is None and plugin not in build_server_env(
        server_spec(stock, 0), {plugin: "{}"}
    )
