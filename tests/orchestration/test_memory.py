"""Issue 35.4: `miles-vl check`'s memory estimate per GPU, against hand computations for the shipped 2B and 8B configs.

Parameter counts come from transformers' Qwen3-VL classes (the model built on the meta device), never typed in; the
rest of each computation is written out below with the config's numbers, in bytes, as the formulas in
miles_vl/orchestration/memory.py's docstring state them.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from miles_vl.cli import main
from miles_vl.config import load_config
from miles_vl.models.qwen3_vl.shapes import RELEASED_SHAPES, hf_config_dict, model_shape
from miles_vl.orchestration.memory import estimate_memory, trainer_memory
from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3


def transformers_params(name: str) -> tuple[int, int]:
    """(all parameters, vision tower's) of the released shape `name`, counted by transformers' own model class."""
    shape = {k: v for k, v in RELEASED_SHAPES[name].items() if k != "model_type"}
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**shape))
    params = sum(p.numel() for p in model.parameters())
    return params, sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))


def ipc_buffers(vocab: int, h: int) -> int:
    """The colocated IPC sync's two bucket buffers on a GPU, bytes: each the 512 MiB bound, grown by a larger bf16
    tensor (the embedding: vocab x h)."""
    return 2 * max(512 * 2**20, 2 * vocab * h)


def config(name: str, *overrides: str):
    return load_config(str(REPO / "configs" / name), list(overrides))


def test_the_2b_shape_is_the_one_the_benchmarks_build():
    """The 2B entry matches the architecture bench_train_throughput.py builds as Qwen3-VL-2B-Instruct's config.json."""
    from benchmarks.bench_train_throughput import qwen3_vl_2b_config

    bench = qwen3_vl_2b_config()
    mine = Qwen3VLConfig(**{k: v for k, v in RELEASED_SHAPES["Qwen3-VL-2B"].items() if k != "model_type"})
    for sub in ("text_config", "vision_config"):
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if hasattr(getattr(bench, sub), key):
                assert getattr(getattr(mine, sub), key) == getattr(getattr(bench, sub), key), (sub, key)
    assert mine.tie_word_embeddings == bench.tie_word_embeddings
    assert model_shape(RELEASED_SHAPES["Qwen3-VL-2B"]).params == transformers_params("Qwen3-VL-2B")[0]


def test_2b_on_one_gpu_by_hand():
    """configs/geo3k_qwen3vl_1gpu.yaml: 1 GPU, TP=PP=CP=1, micro-batch 12,288 tokens (all of them may be loss
    positions: under the 14,134 rows of logits the plan allows), full recompute, one colocated engine at
    mem_fraction_static 0.35, 80 GiB."""
    p, _ = transformers_params("Qwen3-VL-2B")
    h, q, kv, m, layers, vocab = 2048, 16 * 128, 8 * 128, 6144, 28, 151936
    weights, grads, optimizer = 2 * p, 4 * p, 12 * p  # bf16; fp32 grads; fp32 main + 2 Adam moments over 1 rank
    tokens = 12288
    layer_token = 8 * h + 6 * (q + kv + m)
    activations = layers * tokens * 2 * h + tokens * layer_token  # full recompute: layer inputs + one layer
    logits = tokens * vocab * 16
    sync = ipc_buffers(vocab, h)  # 2 x 622 MB: the 2B's embedding is larger than a bucket
    peak = (weights + grads + optimizer + sync + activations + logits) / GIB + 3.0 + 2.0  # CUDA/NCCL, released engine
    free = 80 - (weights + grads + optimizer) / GIB - 3.0  # at the engine's start: the sync's buffers come later
    share = 0.35 * free
    kv_gib = share - 2 * p / GIB
    kv_tokens = int(kv_gib * GIB / (2 * 2 * layers * 8 * 128))

    est = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml"), 80.0)
    assert est.trainer.weights == pytest.approx(weights / GIB)
    assert est.trainer.gradients == pytest.approx(grads / GIB)
    assert est.trainer.optimizer == pytest.approx(optimizer / GIB)
    assert est.trainer.activations == pytest.approx(activations / GIB)
    assert est.trainer.logits == pytest.approx(logits / GIB)
    assert est.trainer.sync_buffers == pytest.approx(sync / GIB)
    assert est.train_phase_gib() == pytest.approx(peak)
    assert est.engine.share == pytest.approx(share)
    assert est.engine.kv_tokens == kv_tokens
    assert est.engine.step_tokens == 16 * 8 * (1024 + 1024)
    assert est.problems() == []  # measured: it ran, 71.1 GiB on an 80 GB card (docs/gpu-runs/2026-11-28-ship-2b-12k-*)


def test_recomputing_the_first_layers_only_keeps_the_others_whole_set():
    """train.recompute_layers = N with full recompute (megatron's block method): N layers keep their input (2h a
    token), the other L - N their full set, plus one recomputed layer's set while it runs again; with pp = 2 each
    stage recomputes N of its L/2 and the first stage holds 2 micro-batches: 2N recomputed layers' worth. `check`
    says the memory of a choice; N = L is null's figure."""
    h, q, kv, m, layers = 2048, 16 * 128, 8 * 128, 6144, 28
    tokens = 12288
    layer_token = 8 * h + 6 * (q + kv + m)
    for n in (1, 20, 28):
        est = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", f"train.recompute_layers={n}"), 80.0)
        kept = (n * 2 * h + (layers - n) * layer_token + layer_token) * tokens
        assert est.trainer.activations == pytest.approx(kept / GIB), n
    every = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml"), 80.0).trainer
    assert every.activations == pytest.approx(
        estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", "train.recompute_layers=28"), 80.0).trainer.activations
    )
    # recompute=language differs from full in the vision tower only, which the estimate does not count
    language = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", "train.recompute=language"), 80.0).trainer
    assert language.activations == pytest.approx(every.activations)
    language_20 = ("train.recompute=language", "train.recompute_layers=20")
    kept_8 = (20 * 2 * h + 8 * layer_token + layer_token) * tokens / GIB
    assert estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", *language_20), 80.0).trainer.activations == (
        pytest.approx(kept_8)
    )
    staged = trainer_memory(
        model_shape(RELEASED_SHAPES["Qwen3-VL-2B"]),
        num_gpus=2, pp=2, tp=1, cp=1, ep=1, sp=False, micro_batch_max_tokens=tokens,
        recompute="full", recompute_layers=5,
    )  # fmt: skip
    assert staged.activations == pytest.approx((10 * 2 * h + 18 * layer_token + layer_token) * tokens / GIB)
    # 20 layers kept whole at 12,288 tokens: 15.5 GiB more than recomputing all, past the 90 % of an 80 GB card
    (problem,) = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", "train.recompute_layers=8"), 80.0).problems()
    assert "the trainer needs about" in problem and "train.recompute_layers null or larger" in problem


def test_logits_at_the_loss_positions_count_at_most_the_rows_the_plan_allows():
    """With train.logits_only_where_loss the micro-batch plan keeps a rank's loss positions under what the logits
    may hold (2^31 elements: 14,134 rows of 151,936), so a 28,160-token micro-batch counts 14,134 rows of logits,
    not 28,160; an 8,192-token one counts its 8,192 either way (every position might be a loss position)."""
    vocab = 151936
    rows = (2**31 - 1) // vocab
    assert rows == 14134
    long_mb = ("train.micro_batch_max_tokens=28160", "train.logits_only_where_loss=true")
    est = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", *long_mb), 80.0)
    assert est.trainer.logits == pytest.approx(rows * vocab * 16 / GIB)
    full = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", long_mb[0], "train.logits_only_where_loss=false"), 80.0)
    assert full.trainer.logits == pytest.approx(28160 * vocab * 16 / GIB)
    short = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", "train.micro_batch_max_tokens=8192"), 80.0)
    assert short.trainer.logits == pytest.approx(8192 * vocab * 16 / GIB)
    off = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", "train.micro_batch_max_tokens=8192",
                                 "train.logits_only_where_loss=false"), 80.0)  # fmt: skip
    assert off.trainer.logits == short.trainer.logits


def test_2b_on_one_gpu_without_recompute_does_not_fit():
    """The same job without recompute ran out of memory on an H100 (docs/gpu-runs/2026-11-23-loop-2b-oom-h100): the
    estimate says so; every layer keeps its activations."""
    p, _ = transformers_params("Qwen3-VL-2B")
    h, q, kv, m, layers, vocab, tokens = 2048, 2048, 1024, 6144, 28, 151936, 8192
    activations = layers * tokens * (8 * h + 6 * (q + kv + m))
    peak = (18 * p + ipc_buffers(vocab, h) + activations + tokens * vocab * 16) / GIB + 3.0 + 2.0
    no_recompute = ("train.recompute=none", "train.micro_batch_max_tokens=8192")
    est = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", *no_recompute), 80.0)
    assert est.train_phase_gib() == pytest.approx(peak)
    assert peak > 0.9 * 80
    (problem,) = est.problems()
    assert f"about {peak:.1f} GiB per GPU" in problem and "train.recompute=full" in problem
    assert estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", *no_recompute), 141.0).problems() == []


def test_2b_on_eight_gpus_by_hand():
    """configs/geo3k_qwen3vl_2b.yaml: 8 GPUs, TP=2 (sequence parallel) x CP=2 x DP=2, 16384 tokens per CP group,
    selective recompute (counted as none: flash attention), 4 colocated engines of 2 GPUs at 0.6."""
    p, _ = transformers_params("Qwen3-VL-2B")
    h, q, kv, m, layers, vocab, tp = 2048, 2048, 1024, 6144, 28, 151936, 2
    weights, grads, optimizer = 2 * p / tp, 4 * p / tp, 12 * p / 8  # the optimizer's state over all 8 ranks
    tokens = 16384 / 2  # per CP rank
    activations = layers * tokens * (8 * h / tp + 6 * (q + kv + m) / tp)
    logits = tokens * vocab / tp * 16
    sync = ipc_buffers(vocab, h)  # on every GPU: each hosts a TP rank of an engine
    est = estimate_memory(config("geo3k_qwen3vl_2b.yaml"), 80.0)
    assert est.trainer.optimizer == pytest.approx(optimizer / GIB)
    assert est.train_phase_gib() == pytest.approx(
        (weights + grads + optimizer + sync + activations + logits) / GIB + 5.0
    )
    free = 80 - (weights + grads + optimizer) / GIB - 3.0
    assert est.engine.weights == pytest.approx(2 * p / 2 / GIB)  # TP=2 engine
    assert est.engine.kv_tokens == int((0.6 * free - p / GIB) * GIB / (2 * 2 * layers * (8 // 2) * 128))
    assert est.engine.step_tokens == 64 * 8 // 4 * (2048 + 2048)


def test_8b_on_eight_gpus_by_hand():
    """configs/geo3k_qwen3vl_8b.yaml: 8 GPUs, TP=4 (SP) x CP=2, DP=1, 16384 tokens per CP group, full recompute,
    4 colocated engines of 2 GPUs at the default mem_fraction_static 0.6."""
    p, vision = transformers_params("Qwen3-VL-8B")
    assert 8.5e9 < p < 9e9 and vision > 0  # the released card says 8.77B
    h, q, kv, m, layers, vocab, tp = 4096, 32 * 128, 8 * 128, 12288, 36, 151936, 4
    weights, grads, optimizer = 2 * p / tp, 4 * p / tp, 12 * p / 8
    tokens = 16384 / 2
    activations = layers * tokens * 2 * h / tp + tokens * (8 * h / tp + 6 * (q + kv + m) / tp)
    logits = tokens * vocab / tp * 16
    cfg = config("geo3k_qwen3vl_8b.yaml")
    assert (cfg.rollout.num_engines, cfg.rollout.gpus_per_engine) == (4, 2)
    sync = ipc_buffers(vocab, h)  # 2 x 1.24 GB: the 8B's embedding and its untied output layer
    est = estimate_memory(cfg, 80.0)
    assert est.trainer.activations == pytest.approx(activations / GIB)
    assert est.train_phase_gib() == pytest.approx(
        (weights + grads + optimizer + sync + activations + logits) / GIB + 5.0
    )
    share = 0.6 * (80 - (weights + grads + optimizer) / GIB - 3.0)
    engine_weights = 2 * p / 2 / GIB
    assert est.engine.share == pytest.approx(share)
    assert est.engine.kv_cache == pytest.approx(share - engine_weights)
    assert est.engine.kv_tokens == int((share - engine_weights) * GIB / (2 * 2 * layers * (8 // 2) * 128))
    assert est.problems() == []


def loop_job():
    """scripts/gpu/loop_job.py (a script, not a package module)."""
    return load_script("scripts/gpu/loop_job.py")


def test_8b_on_one_gpu_with_the_optimizer_on_the_cpu_by_hand(capsys):
    """Issue 33.5: the `8b_1gpu` shape of scripts/gpu/loop_job.py: Qwen3-VL-8B full-parameter on ONE 80 GB GPU, TP=CP=1,
    4096-token micro-batches, full recompute, train.optimizer.cpu_offload=1.0, one colocated engine at 0.7. The
    offloaded optimizer state leaves the GPU figures and is counted as host memory (16 B a parameter: fp32 main
    weights, two fp32 moments, a pinned fp32 gradient copy); `check` prints it and says the job fits."""
    p, _ = transformers_params("Qwen3-VL-8B")
    h, q, kv, m, layers, vocab = 4096, 32 * 128, 8 * 128, 12288, 36, 151936
    weights, grads, host = 2 * p, 4 * p, 16 * p  # nothing sharded; the Adam state all on the host
    tokens = 4096
    activations = layers * tokens * 2 * h + tokens * (8 * h + 6 * (q + kv + m))  # full recompute
    logits = tokens * vocab * 16
    sync = ipc_buffers(vocab, h)
    peak = (weights + grads + sync + activations + logits) / GIB + 3.0 + 2.0  # CUDA/NCCL, the released engine
    share = 0.7 * (80 - (weights + grads) / GIB - 3.0)  # the engine starts beside the trainer's weights and grads
    kv_gib = share - 2 * p / GIB
    job = loop_job()
    overrides = job.overrides("8b_1gpu", "Qwen/Qwen3-VL-8B-Instruct", "/runs", "x", 4)
    cfg = load_config(str(job.CONFIGS["8b_1gpu"]), overrides)
    assert (cfg.train.num_gpus, cfg.rollout.num_engines, cfg.ray.placement) == (1, 1, "colocate")
    est = estimate_memory(cfg, 80.0)
    assert est.trainer.optimizer == 0.0
    assert est.trainer.host_optimizer == pytest.approx(host / GIB)  # ~131 GiB: a host larger than 128 GiB
    assert est.train_phase_gib() == pytest.approx(peak)
    assert est.engine.share == pytest.approx(share) and est.engine.kv_cache == pytest.approx(kv_gib)
    assert est.engine.kv_tokens == int(kv_gib * GIB / (2 * 2 * layers * 8 * 128))
    assert peak < 0.9 * 80 and kv_gib > 3 and est.problems() == []  # ~24K tokens; a step needs ~10K (shared prompts)
    # while generating: the trainer's resident state with the sync's buffers (made after the engine sized its share)
    generating = (weights + grads + sync) / GIB + 3.0 + share + 2.0  # + the engine's processes
    assert est.generation_phase_gib() == pytest.approx(generating) and generating <= 80
    greedy = load_config(str(job.CONFIGS["8b_1gpu"]), [*overrides, "rollout.sglang.mem_fraction_static=0.9"])
    (problem,) = estimate_memory(greedy, 80.0).problems()  # 0.9 of the same free memory: over the GPU by then
    assert problem.startswith("while the engines generate") and "mem_fraction_static" in problem
    # without the offload the same job holds 12 B a parameter more on the GPU and does not fit
    plain = load_config(str(job.CONFIGS["8b_1gpu"]), [*overrides, "train.optimizer.cpu_offload=0"])
    problems = estimate_memory(plain, 80.0).problems()  # the trainer's, and the engine's weights beside it
    assert f"about {peak + 12 * p / GIB:.1f} GiB per GPU" in problems[0]
    half = trainer_memory(
        model_shape(RELEASED_SHAPES["Qwen3-VL-8B"]),
        num_gpus=1, tp=1, pp=1, cp=1, ep=1, sp=False, micro_batch_max_tokens=4096, recompute="full", cpu_offload=0.5,
    )  # fmt: skip
    assert half.optimizer == pytest.approx(6 * p / GIB) and half.host_optimizer == pytest.approx(8 * p / GIB)
    assert main(["check", "--config-only", str(job.CONFIGS["8b_1gpu"]), *overrides]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"host memory per train rank: optimizer state {host / GIB:.1f} GiB" in out and "fits 79.4 GiB GPUs: yes" in out
    )


def test_frozen_vision_and_the_optimizer_without_distribution():
    """train.freeze_vision: the vision tower has no gradients nor optimizer state; without megatron's distributed
    optimizer every data-parallel rank would hold the whole state of its model-parallel shard."""
    p, vision = transformers_params("Qwen3-VL-8B")
    shape = model_shape(RELEASED_SHAPES["Qwen3-VL-8B"])
    common = dict(num_gpus=8, tp=4, pp=1, cp=2, ep=1, sp=True, micro_batch_max_tokens=16384, recompute="full")
    frozen = trainer_memory(shape, freeze_vision=True, **common)
    assert frozen.weights == pytest.approx(2 * p / 4 / GIB)
    assert frozen.gradients == pytest.approx(4 * (p - vision) / 4 / GIB)
    assert frozen.optimizer == pytest.approx(12 * (p - vision) / 8 / GIB)
    plain = trainer_memory(shape, distributed_optimizer=False, **common)
    assert plain.optimizer == pytest.approx(12 * p / 4 / GIB)


def test_engine_weights_that_do_not_fit_their_share():
    est = estimate_memory(
        config("geo3k_qwen3vl_8b.yaml", "rollout.gpus_per_engine=1", "rollout.sglang.mem_fraction_static=0.2"), 80.0
    )
    assert est.engine.kv_cache < 0 and est.engine.kv_tokens == 0
    (problem,) = est.problems()
    assert "rollout.sglang.mem_fraction_static" in problem


def test_a_trainer_that_leaves_no_free_memory_gives_the_engine_no_share_and_says_so():
    """A new user's `check --gpu-memory-gib 24` of the 8B config printed a share of -2.1 GiB and advised lowering
    mem_fraction_static: the trainer's resident state alone is more than the GPU, so no share helps."""
    est = estimate_memory(config("geo3k_qwen3vl_8b.yaml"), 24.0)
    assert est.trainer.resident_at_start > 24.0 and est.engine.share == 0.0 and est.engine.kv_tokens == 0
    problems = est.problems()
    assert not [p for p in problems if "lower rollout.sglang.mem_fraction_static" in p], problems
    (no_share,) = [p for p in problems if "finds no free memory" in p]
    assert f"keeps about {est.trainer.resident_at_start:.1f} GiB per GPU" in no_share and "disaggregate" in no_share
    assert "engine, per GPU: no free memory beside the trainer's resident state: no share" in est.lines()


def test_the_shape_comes_from_a_local_config_json(tmp_path):
    """A model.path on this machine: its config.json, whatever its name; unknown elsewhere: no estimate, saying why."""
    shape = dict(RELEASED_SHAPES["Qwen3-VL-2B"], text_config=dict(RELEASED_SHAPES["Qwen3-VL-2B"]["text_config"]))
    shape["text_config"]["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(shape))
    cfg = config("geo3k_qwen3vl_1gpu.yaml", f"model.path={tmp_path}")
    est = estimate_memory(cfg, 80.0)
    assert est.source == str(tmp_path / "config.json")
    assert est.trainer.weights < estimate_memory(config("geo3k_qwen3vl_1gpu.yaml"), 80.0).trainer.weights
    missing = estimate_memory(config("geo3k_qwen3vl_1gpu.yaml", f"model.path={tmp_path / 'My-Model'}"), 80.0)
    assert isinstance(missing, str) and "is not on this machine" in missing
    assert hf_config_dict("Qwen/Qwen3-VL-8B-Thinking")[0] is RELEASED_SHAPES["Qwen3-VL-8B"]
    (tmp_path / "config.json").write_text("{not json")
    broken = estimate_memory(cfg, 80.0)
    assert isinstance(broken, str) and broken.startswith(f"the model's shape could not be read from {tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "model_type must be qwen3_vl or qwen3_vl_moe" in estimate_memory(cfg, 80.0)


def test_check_prints_the_estimate_and_warns(capsys):
    """`check` prints the estimate as YAML comments, warns (exit 0: an estimate is no error) when it does not fit, and
    takes the GPUs' memory from --gpu-memory-gib."""
    one_gpu = str(REPO / "configs" / "geo3k_qwen3vl_1gpu.yaml")
    assert main(["check", "--config-only", one_gpu, "train.recompute=none"]) == 0
    captured = capsys.readouterr()
    yaml.safe_load(captured.out)  # still YAML: the estimate is in comments
    assert "# memory per GPU (estimate)" in captured.out and "fits 79.4 GiB GPUs: NO" in captured.out
    assert "memory estimate: the trainer needs about" in " ".join(captured.err.split())
    assert main(["check", "--config-only", "--gpu-memory-gib", "141", one_gpu, "train.recompute=none"]) == 0
    captured = capsys.readouterr()
    assert "fits 141 GiB GPUs: yes" in captured.out and "memory estimate" not in captured.err
    assert main(["check", "--config-only", str(REPO / "configs" / "geo3k_tiny_cpu.yaml")]) == 0
    assert "# memory per GPU: not estimated: no GPU in this job" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["check", "--config-only", "--gpu-memory-gib", "0", one_gpu])
    assert stop.value.code == 2
    assert "expected a positive number of GiB (e.g. 79.4 or 139.8), found '0'" in capsys.readouterr().err


def test_only_the_colocated_ipc_sync_holds_buffers_on_the_trainers_gpus(capsys):
    """The colocated ipc sync keeps two bucket buffers on every GPU that hosts a server's TP rank; the tensor sync
    (CPU copies) and a disaggregated job (NCCL from the trainer's own weights) none. `check` names them."""
    shape = model_shape(RELEASED_SHAPES["Qwen3-VL-2B"])
    base = "geo3k_qwen3vl_1gpu.yaml"
    ipc = estimate_memory(config(base), 80.0)
    tensor = estimate_memory(config(base, "rollout.sglang.colocated_sync=tensor"), 80.0)
    assert ipc.trainer.sync_buffers == pytest.approx(ipc_buffers(shape.vocab, shape.hidden) / GIB)
    assert ipc.trainer.sync_buffers > 1.1  # the embedding (622 MB) grows both past the 512 MiB bound
    assert tensor.trainer.sync_buffers == 0.0
    assert ipc.trainer.resident - tensor.trainer.resident == pytest.approx(ipc.trainer.sync_buffers)
    disaggregated = estimate_memory(config("geo3k_qwen3vl_2b_disaggregated.yaml"), 80.0)
    assert disaggregated.trainer.sync_buffers == 0.0
    assert main(["check", "--config-only", str(REPO / "configs" / base)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"+ weight-sync buffers {ipc.trainer.sync_buffers:.1f}" in out
