"""The driver with `train.backend=megatron`, end to end on CPU: Ray with two stand-in GPUs, two train ranks at CP=2
(gloo), the real placement group shared with the colocated hf engine, the real train actors and weight sync, the
megatron backend built by tests/orchestration/megatron_cpu.py from the same HF checkpoint.

The reference is the same job with the embedded torch backend (transformers' Qwen3-VL, one process, no CP): both
start from the checkpoint and roll out with the same engine and seeds, so step 1's rollouts are identical and its
train metrics must agree to fp32 noise; after the first sync the engine must hold the megatron ranks' exported
weights, so its logprobs of step 2's samples must equal the trainer's (`train_rollout_logprob_abs_diff`).
"""

from __future__ import annotations

import functools
import math
import os
import signal
from pathlib import Path

import pytest
import ray

from miles_vl import stack
from miles_vl.config import ConfigError, load_config
from miles_vl.orchestration import run_job
from miles_vl.orchestration.checkpoint import list_checkpoints
from miles_vl.orchestration.engines import RolloutEngines
from miles_vl.orchestration.factories import build_megatron
from miles_vl.orchestration.loop import JobInterrupted
from miles_vl.orchestration.placement import engine_slots, reserve_gpus
from miles_vl.orchestration.trainer import Trainer
from miles_vl.rollout.weight_sync import WeightSyncOptions
from tests.orchestration import megatron_cpu
from tests.orchestration.jobs import REPO, metrics, pretrained, stand_ins, tiny_job, wait_for, write_checkpoint
from tests.patches.harness.shims import require_bridge
from tests.rollout.sglang.conftest import free_port
from tests.rollout.sglang.fake_server import read_journal

FAKE_GPUS = 4


@pytest.fixture(scope="module")
def bridge():
    require_bridge("0.6.2")


@pytest.fixture(scope="module")
def fake_gpu_ray():
    """A local Ray that believes it has 4 GPUs: placement and CUDA_VISIBLE_DEVICES are Ray's real logic; torch
    finds no CUDA, so the ranks run on the CPU over gloo."""
    ray.init(num_cpus=FAKE_GPUS, num_gpus=FAKE_GPUS, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny_qwen3vl"), initializer_range=0.2)


def config(tmp_path: Path, checkpoint: Path, name: str, *overrides: str):
    return tiny_job(
        tmp_path,
        name,
        *pretrained(checkpoint),
        "num_steps=2",
        "rollout.max_response_len=8",
        # large steps: an engine left with the weights before a step would be off by far more than 1e-4 (a
        # random-sign 1e-3 step of every weight of this model moves token logprobs by ~3e-2 on average)
        "train.optimizer.lr=1e-3",
        "eval.interval=0",
        "checkpoint.interval=0",
        *overrides,
    )


def test_megatron_cp2_job_matches_the_torch_backend(bridge, tmp_path, checkpoint, fake_gpu_ray):
    torch_rows = metrics(run_job(config(tmp_path, checkpoint, "torch")))
    megatron = ("train.backend=megatron", "train.num_gpus=2", "train.cp=2", "model.dtype=fp32")
    run = run_job(config(tmp_path, checkpoint, "megatron", *megatron), hooks=stand_ins(megatron=True))
    mega_rows = metrics(run)
    assert [r["step"] for r in mega_rows] == [1, 2]

    # step 1: the same rollouts (same engine, weights and seeds), then the same RL step on two CP ranks
    t, m = torch_rows[0], mega_rows[0]
    for key in ("reward/mean", "rollout/response_tokens", "rollout/response_len_mean"):
        assert m[key] == t[key], key
    # train/tokens counts the rows megatron trains on, CP padding included (each segment padded to 2 * cp), and
    # train/micro_batches the passes each backend's own plan makes of them: figures of the layout, not of the step
    layout_keys = ("train/tokens", "train/micro_batches")
    train_keys = sorted(k for k in t if k.startswith("train/") and k in m and k not in layout_keys)
    assert {"train/pg_loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff"} <= set(train_keys)
    for key in train_keys:
        print(f"{key}: megatron {m[key]:.8g} torch {t[key]:.8g}")
        assert math.isclose(m[key], t[key], rel_tol=1e-5, abs_tol=1e-6), (key, m[key], t[key])  # fp32 noise
    assert math.isclose(m["train/grad_norm"], t["train/grad_norm"], rel_tol=1e-6)  # measured 5e-8
    assert 0 <= m["train/tokens"] - t["train/tokens"] < 8 * 2 * 2  # < 2*cp pads per sample and row (4 + <4 rows)
    assert m["train/grad_norm"] > 0 and m["train/optimizer_steps"] == 1

    # step 2: the engine scores like the megatron trainer, so the sync delivered its weights under HF names
    for rows in (torch_rows, mega_rows):
        print("step 2 train_rollout_logprob_abs_diff", rows[1]["train/train_rollout_logprob_abs_diff"])
        assert rows[1]["train/train_rollout_logprob_abs_diff"] < 1e-4, rows[1]
    saved = run / "checkpoints" / "step_00000002"  # megatron's distributed checkpoint, complete
    assert {"metadata.json", ".metadata", "__0_0.distcp"} <= {p.name for p in saved.iterdir()}


def test_megatron_cp2_disaggregated_nccl_sync(bridge, tmp_path, checkpoint, fake_gpu_ray):
    """Rank 0 broadcasts each bucket to an SGLang-API server (tests/rollout/sglang/hf_server.py, gloo in place of
    NCCL) while rank 1 takes part in the collective export: one group for the job, one POST per bucket."""
    journal = tmp_path / "journal"
    journal.mkdir()
    cfg = config(
        tmp_path,
        checkpoint,
        "disaggregated",
        *("train.backend=megatron", "train.num_gpus=2", "train.cp=2", "model.dtype=fp32"),
        *("rollout.backend=sglang", "ray.placement=disaggregate", f"rollout.sglang.port={free_port()}"),
        *("rollout.sglang.startup_timeout_s=120", f"rollout.sglang.extra_args=[--fake-journal,{journal}]"),
    )
    sync = WeightSyncOptions(bucket_bytes=64 * 1024, group_backend="gloo")  # several buckets; gloo in place of NCCL
    rows = metrics(run_job(cfg, hooks=stand_ins(sglang=True, megatron=True, weight_sync=sync)))
    for r in rows:
        print("step", r["step"], "train_rollout_logprob_abs_diff", r["train/train_rollout_logprob_abs_diff"])
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-4  # step 2: the server holds step 1's weights
    [records] = read_journal(journal).values()
    paths = [r["path"] for r in records if "path" in r]
    assert paths.count("/init_weights_update_group") == 1
    posts = paths.count("/update_weights_from_distributed")
    assert posts >= 4 and posts % 2 == 0 and paths.count("/update_weight_version") == 2  # 2 syncs, >= 2 buckets


def test_megatron_cp2_colocated_ipc_sync_runs_on_every_rank(bridge, tmp_path, checkpoint, fake_gpu_ray):
    """The colocated IPC sync with two train ranks (`GroupSync.colocated`): both ranks open the sender (an exchange
    over a gloo group of the trainer's ranks) and go through every bucket in lock step; on the CPU every TP rank maps
    rank 0's shared-memory buffer. The server holds the trainer's weights after each sync: one request per bucket."""
    journal = tmp_path / "journal"
    journal.mkdir()
    cfg = config(
        tmp_path,
        checkpoint,
        "colocated-ipc",
        *("train.backend=megatron", "train.num_gpus=2", "train.cp=2", "model.dtype=fp32"),
        *("rollout.backend=sglang", f"rollout.sglang.port={free_port()}", "rollout.sglang.colocated_sync=ipc"),
        *("rollout.sglang.startup_timeout_s=120", f"rollout.sglang.extra_args=[--fake-journal,{journal}]"),
    )
    sync = WeightSyncOptions(bucket_bytes=64 * 1024)  # several buckets
    rows = metrics(run_job(cfg, hooks=stand_ins(sglang=True, megatron=True, weight_sync=sync)))
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in rows), rows
    [records] = read_journal(journal).values()
    paths = [r["path"] for r in records if "path" in r]
    posts = paths.count("/update_weights_from_tensor")
    assert posts >= 4 and "/update_weights_from_distributed" not in paths  # 2 syncs of >= 2 buckets, over IPC


def test_trainer_gpus_are_node_major_and_shared_by_colocated_engines(fake_gpu_ray):
    gpus = reserve_gpus(FAKE_GPUS)
    try:
        ids = [s.gpu_id for s in gpus.slots]
        assert sorted(ids, key=int) == ids and len(set(ids)) == FAKE_GPUS  # one GPU per slot, in order
        assert sorted(s.bundle for s in gpus.slots) == list(range(FAKE_GPUS))

        @ray.remote
        class Where:
            def gpu(self) -> list[str]:
                return [str(i) for i in ray.get_runtime_context().get_accelerator_ids()["GPU"]]

        engines = engine_slots(gpus.slots, num_engines=2, gpus_per_engine=2)
        assert [[s.gpu_id for s in e] for e in engines] == [ids[:2], ids[2:]]
        # a train rank and the engine actor in the same slot share its GPU (half each)
        ranks = [
            Where.options(num_cpus=0, num_gpus=0.5, scheduling_strategy=gpus.strategy(s)).remote() for s in gpus.slots
        ]
        firsts = [
            Where.options(num_cpus=0, num_gpus=0.5, scheduling_strategy=gpus.strategy(e[0])).remote() for e in engines
        ]
        assert ray.get([r.gpu.remote() for r in ranks]) == [[i] for i in ids]
        assert ray.get([e.gpu.remote() for e in firsts]) == [[ids[0]], [ids[2]]]
    finally:
        gpus.release()
    with pytest.raises(ValueError, match="need rollout.num_engines \\* rollout.gpus_per_engine = 6 GPUs"):
        engine_slots(gpus.slots, num_engines=3, gpus_per_engine=2)
    split = [type(s)(s.bundle, "10.0.0.1" if i < 3 else "10.0.0.2", s.gpu_id) for i, s in enumerate(gpus.slots)]
    with pytest.raises(ValueError, match="colocated engine 1 would span nodes"):
        engine_slots(split, num_engines=2, gpus_per_engine=2)


def test_megatron_config_errors_name_the_fix(tmp_path, checkpoint, monkeypatch):
    with pytest.raises(ConfigError, match="model.init=random; set model.init=pretrained"):
        config(tmp_path, checkpoint, "x", "train.backend=megatron", "train.num_gpus=2", "model.init=random")
    with pytest.raises(ConfigError, match=r"rollout.gpus_per_engine = 4 > train.num_gpus=2"):
        config(tmp_path, checkpoint, "x", "train.backend=megatron", "train.num_gpus=2", "rollout.gpus_per_engine=4")
    # Without megatron the preflight of `miles-vl check` / `train` (miles_vl.stack) names each package and the fix.
    missing = (None, "ModuleNotFoundError: No module named 'megatron'", [])
    monkeypatch.setattr(
        stack, "quiet_import", lambda name: missing if name.startswith("megatron") else (stack, None, [])
    )
    problems = stack.backend_problems("hf", "megatron")
    assert len(problems) == 2 and all("or set train.backend=torch" in p for p in problems), problems
    assert "train.backend=megatron needs megatron-core" in problems[0] and "scripts/setup_megatron.sh" in problems[0]


def test_driver_arguments_fit_the_real_megatron_builder(tmp_path):
    """The driver calls `build_megatron_backend` (train/megatron/build.py) on GPUs only, and the CPU stand-in is
    another function, so a renamed argument would surface only on a cluster: bind the driver's arguments to the real
    signature, read from the source (importing build.py needs megatron and Transformer Engine)."""
    import ast
    import inspect

    from miles_vl.data import load_processor
    from miles_vl.models.qwen3_vl.tokens import special_tokens
    from miles_vl.orchestration.factories import parallel_options, train_options

    tree = ast.parse((REPO / "miles_vl" / "train" / "megatron" / "build.py").read_text())
    [fn] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_megatron_backend"]
    params = [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in fn.args.args]
    params += [  # kw_defaults: None where a keyword-only argument has no default
        inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY, default=inspect.Parameter.empty if d is None else d)
        for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True)
    ]
    signature = inspect.Signature(params)
    tokens = special_tokens(load_processor("offline", 3136, 12544))
    for path in sorted((REPO / "configs").glob("geo3k_qwen3vl_*.yaml")):
        cfg = load_config(path)
        assert cfg.train.backend == "megatron", path.name
        bound = signature.bind(cfg.model.path, tokens, train_options(cfg, tokens), parallel_options(cfg))
        assert (
            bound.arguments["parallel"].tp_size == cfg.train.tp and bound.arguments["parallel"].ep_size == cfg.train.ep
        )


def test_a_stop_while_a_megatron_checkpoint_is_written_in_the_background_waits_for_it(
    bridge, tmp_path, checkpoint, fake_gpu_ray, monkeypatch
):
    """Issue 33.3 on the megatron backend (two CP ranks, megatron-core's async save): SIGINT in step 3's rollout while
    the writer of step 2's checkpoint is held (only its temporary directory exists): the stop waits for
    the write, step 2 appears complete, its shard files byte for byte those of a run that saved synchronously
    (`checkpoint.async_save=false`), no temporary directory is left, and the same command resumes from it to the
    synchronous run's step 3, record for record."""
    megatron = ("train.backend=megatron", "train.num_gpus=2", "train.cp=2", "model.dtype=fp32")
    steps = ("num_steps=3", "checkpoint.interval=1", "checkpoint.keep_last=3")
    sync = config(tmp_path, checkpoint, "sync", *megatron, *steps, "checkpoint.async_save=false")
    straight = run_job(sync, hooks=stand_ins(megatron=True))
    gate = tmp_path / "gate"
    hooks = stand_ins(megatron=True)
    builder = functools.partial(megatron_cpu.build_gated_save, gate=str(gate))
    hooks.train_backends["megatron"] = functools.partial(build_megatron, builder=builder)
    background = config(tmp_path, checkpoint, "background", *megatron, *steps)
    run_dir, started, rollout, seen = tmp_path / "background", Trainer.start_checkpoint, RolloutEngines.generate, {}

    def start_checkpoint(self, directory):
        saves = seen.setdefault("saves", [])
        saves.append(Path(directory))
        if len(saves) == 2:  # step 2's: its writers wait for the gate
            Path(f"{gate}.go").unlink()
        return started(self, directory)

    def generate(self, *args, **kwargs):
        if len(seen.get("saves", [])) == 2 and "stopped" not in seen:  # step 3's rollout; step 2's save is held
            seen["stopped"] = True
            try:
                # rank 0's writer: at CP=2 the ranks hold replicas, which rank 0 alone writes (rank 1 forks none)
                wait_for(Path(f"{gate}.writing-0"))
                assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [1]
                assert seen["saves"][1].name.startswith(".step_00000002.tmp-") and seen["saves"][1].is_dir()
                assert not (seen["saves"][1] / "metadata.json").exists()
                os.kill(os.getpid(), signal.SIGINT)
            finally:
                Path(f"{gate}.go").touch()  # the writer goes on while the stop is handled
        return rollout(self, *args, **kwargs)

    Path(f"{gate}.go").touch()  # step 1's save is not held
    monkeypatch.setattr(Trainer, "start_checkpoint", start_checkpoint)
    monkeypatch.setattr(RolloutEngines, "generate", generate)
    with pytest.raises(JobInterrupted) as info:
        run_job(background, hooks=hooks)
    assert "stopped" in seen and info.value.checkpoint == 2
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [1, 2]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    ours, theirs = run_dir / "checkpoints" / "step_00000002", straight / "checkpoints" / "step_00000002"
    shards = sorted(p.name for p in theirs.glob("*.distcp"))
    assert shards and sorted(p.name for p in ours.glob("*.distcp")) == shards
    assert (ours / "metadata.json").is_file() and (ours / ".metadata").is_file()
    for name in shards:
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    monkeypatch.undo()
    run_job(background, hooks=stand_ins(megatron=True))
    assert [comparable(r) for r in metrics(run_dir)] == [comparable(r) for r in metrics(straight)]


def comparable(record: dict) -> dict:
    """Everything but wall-clock figures."""
    return {k: v for k, v in record.items() if not k.startswith(("time/", "perf/"))}
