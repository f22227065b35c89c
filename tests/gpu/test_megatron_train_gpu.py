"""Contract (GPU, the real production path): the megatron train backend built by `build_megatron_backend` from an HF
checkpoint (AutoBridge, Transformer Engine layer specs, megatron DDP, the distributed optimizer, bf16, megatron's
schedule, NCCL) gives the same RL step at TP x CP as at TP=1 x CP=1, exports the checkpoint back, and resumes from
its distributed checkpoint.

    pytest -m gpu tests/gpu/test_megatron_train_gpu.py -s   # 2 GPUs: (tp, cp) = (1, 2); 4 GPUs: also (1, 4), (2, 2)

Each case spawns one process per GPU (world = tp * cp). In that one spawn:
1. reference: TP=1, CP=1 (DP = world): export_weights() (must equal the HF state dict cast to bf16, bit for bit),
   compute_logprobs, one train() step;
2. layout under test: TP=tp (sequence parallel on when tp > 1), CP=cp: compute_logprobs and train() on the same
   samples; loss and gradient norm within bf16 noise of the reference (rel 2e-2), per-sample logprobs within
   0.1 mean absolute difference;
3. checkpoint: save, take another step, load, and the logprobs and the next step repeat those after the save; the
   same state also saved in the background (`start_checkpoint`, megatron-core's async save: host staging, a forked
   writer, the collective finalize) while that step runs, and its load gives the same logprobs and the same next step;
4. negative control at the same 0.1 bound: the layout fed contiguous-block positions (the full row's positions cut
   into C blocks instead of the zigzag chunks) must be off by more than 0.1; it runs in every case (cp2 on 2 GPUs,
   cp4 and tp2_cp2 on 4; a case needing more GPUs than the machine has skips).

`test_full_recompute_keeps_the_vision_towers_deepstack_gradients_on_gpu` (1 GPU, passed on one H200, 2026-11-29:
`owed.sh p16-x1`): the vision tower's gradients under full recompute with miles_vl's deepstack patch equal no
recompute's.

`test_optimizer_offload_trains_and_resumes_its_fp32_state` (1 GPU): train.optimizer.cpu_offload=1.0 trains, and a
fresh backend resumed from its checkpoint repeats the two steps after the save (the fp32 state on the CPU restored).

Self-contained: a tiny random Qwen3-VL (deepstack into both language layers, GQA, interleaved MRoPE, large init std
0.2 so that positions matter) written with transformers' `save_pretrained`, and its samples, are built here. Prints
one `GPU-MEGATRON-TRAIN {json}` line per case with the measured differences.

Measured 2026-11-22 on 4x H200 (torch 2.11.0+cu130, TE 2.20.2, megatron-core 0.19.2, megatron-bridge 0.6.2,
transformers 5.17): (tp, cp) = (1, 2): loss 0.1835285 vs 0.1835286, grad norm 7.851 vs 7.835 (rel 2.0e-3),
logprobs mean abs diff <= 0.033; (2, 2): loss equal to 1e-7, grad norm 7.807 vs 7.835 (rel 3.6e-3), logprobs
<= 0.055; export bit-exact; resume: loaded logprobs diff 0.0 and the next step's loss identical.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from miles_vl.train import LossOptions, OptimizerOptions, TrainOptions, train_step
from miles_vl.train.megatron.parallel import ParallelOptions
from tests.gpu.nccl import RankContext, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None or importlib.util.find_spec("megatron") is None,
        reason="needs Transformer Engine and megatron-bridge",
    ),
]

VOCAB, PAD, IMAGE, VIDEO, VSTART, VEND = 128, 0, 120, 121, 122, 123
PIXEL_DIM = 3 * 2 * 16 * 16  # channels * temporal patch * patch * patch of the real processor
REL_TOL = 2e-2
OPTIONS = TrainOptions(
    OptimizerOptions(lr=1e-5, grad_clip=1.0),
    LossOptions(
        clip_low=0.2,
        clip_high=0.28,
        kl_coef=0.0,
        entropy_coef=0.0,
        reduction="token_mean",
        temperature=0.7,
        suppress_token_ids=(IMAGE, VIDEO),
    ),
    micro_batch_max_tokens=96,
    global_batch_size=8,
)


def _tokens():
    from miles_vl.models import SpecialTokens

    return SpecialTokens(
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        pad_token_id=PAD,
        eos_token_ids=(VEND,),
        vocab_size=VOCAB,
    )


def write_checkpoint(directory: str) -> dict[str, torch.Tensor]:
    """A tiny random Qwen3-VL saved with transformers; returns its state dict (fp32, CPU)."""
    from transformers import Qwen3VLForConditionalGeneration

    from miles_vl.models.qwen3_vl.model import tiny_config

    config = tiny_config(_tokens(), initializer_range=0.2, deepstack_visual_indexes=[0, 1])
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).float()
    model.save_pretrained(directory)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_samples(n: int = 8, seed: int = 0):
    """`n` TrainSamples: text only, one image, two images (patch grids in units of 16-pixel patches), cycling."""
    from miles_vl.train import TrainSample

    g = torch.Generator().manual_seed(seed)
    layouts = [[11], [3, (1, 4, 6), 4], [2, (1, 4, 4), 1, (1, 2, 4), 3]]
    out = []
    for i in range(n):
        ids, grids = [], []
        for piece in layouts[i % len(layouts)]:
            if isinstance(piece, int):
                ids += torch.randint(1, IMAGE, (piece,), generator=g).tolist()
            else:
                grids.append(list(piece))
                ids += [VSTART] + [IMAGE] * (piece[0] * piece[1] * piece[2] // 4) + [VEND]
        prompt_len = len(ids)
        response_len = 5 + (3 * i) % 7
        ids += torch.randint(1, IMAGE, (response_len,), generator=g).tolist()
        patches = sum(t * h * w for t, h, w in grids)
        out.append(
            TrainSample(
                input_ids=torch.tensor(ids),
                prompt_len=prompt_len,
                advantage=float(torch.randn((), generator=g)),
                rollout_logprobs=-torch.rand(response_len, generator=g) * 3,
                image_grid_thw=torch.tensor(grids) if grids else None,
                pixel_values=torch.randn(patches, PIXEL_DIM, generator=g) if grids else None,
            )
        )
    return out


# ----------------------------------------------------------------------------------------------------------------
# the job each GPU runs


def _phase(hf_dir: str, tp: int, cp: int, samples, *, export: bool, checkpoint_dir: str | None) -> dict:
    from megatron.core import parallel_state

    from miles_vl.train.megatron import build_megatron_backend

    backend = build_megatron_backend(
        hf_dir, _tokens(), OPTIONS, ParallelOptions(tp_size=tp, cp_size=cp, sp=tp > 1, bf16=True, seed=0)
    )
    out: dict = {}
    if export:
        out["export"] = {name: t.clone() for name, t in backend.export_weights()}
    out["logprobs"] = backend.compute_logprobs(samples)
    out["train"] = train_step(backend, samples)
    if checkpoint_dir is not None:
        backend.save_checkpoint(checkpoint_dir)
        write = backend.start_checkpoint(f"{checkpoint_dir}-async")  # the same state, written in the background
        out["async_done_at_once"] = write.done()
        saved_logprobs = backend.compute_logprobs(samples)
        out["after_save"] = train_step(backend, samples)  # while the background write may still run
        write.wait()
        for name, directory in (("load", checkpoint_dir), ("async_load", f"{checkpoint_dir}-async")):
            backend.load_checkpoint(directory)
            out[f"{name}ed_logprobs_diff"] = max(
                float((a - b).abs().max())
                for a, b in zip(saved_logprobs, backend.compute_logprobs(samples), strict=True)
            )
            out[f"after_{name}"] = train_step(backend, samples)
            out[f"optimizer_steps_after_{name}"] = backend.optimizer_steps
    del backend
    parallel_state.destroy_model_parallel()
    torch.cuda.empty_cache()
    return out


def _contiguous_block_logprobs(hf_dir: str, tp: int, cp: int, samples) -> list[torch.Tensor]:
    """The negative control: the layout under test fed the full row's positions cut into C contiguous blocks instead
    of the zigzag chunks (positions that belong to other tokens: the layout bug CP integrations make)."""
    import megatron.core.parallel_state as ps

    from miles_vl.train.megatron import build_megatron_backend, step

    real = step.model_inputs

    def contiguous(mb, device, **kw):
        out = real(mb, device, **kw)
        local = mb.num_local_tokens
        rank = ps.get_context_parallel_rank()
        out["position_ids"] = mb.packed.position_ids[:, rank * local : (rank + 1) * local][:, None, :].to(device)
        return out

    step.model_inputs = contiguous
    try:
        backend = build_megatron_backend(
            hf_dir, _tokens(), OPTIONS, ParallelOptions(tp_size=tp, cp_size=cp, sp=tp > 1, bf16=True, seed=0)
        )
        logprobs = backend.compute_logprobs(samples)
    finally:
        step.model_inputs = real
    del backend
    ps.destroy_model_parallel()
    torch.cuda.empty_cache()
    return logprobs


def job(ctx: RankContext, hf_dir: str, tp: int, cp: int, checkpoint_dir: str) -> dict:
    samples = make_samples()
    reference = _phase(hf_dir, 1, 1, samples, export=True, checkpoint_dir=None)  # export is collective
    layout = _phase(hf_dir, tp, cp, samples, export=False, checkpoint_dir=checkpoint_dir)
    layout["contiguous_logprobs"] = _contiguous_block_logprobs(hf_dir, tp, cp, samples)
    if ctx.rank != 0:
        reference.pop("export")
    return {"reference": reference, "layout": layout}


# ----------------------------------------------------------------------------------------------------------------
# the test


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-6)


@pytest.mark.parametrize("tp, cp", [(1, 2), (1, 4), (2, 2)], ids=["cp2", "cp4", "tp2_cp2"])
def test_megatron_train_step_matches_across_layouts(tmp_path, tp, cp):
    world = tp * cp
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    hf_dir = str(tmp_path / "hf")
    hf_state = write_checkpoint(hf_dir)
    ranks = run_ranks(job, world, args=(hf_dir, tp, cp, str(tmp_path / "ckpt")), timeout_s=900.0)
    ref, got = ranks[0]["reference"], ranks[0]["layout"]

    # export: the HF checkpoint back, every name, bit for bit in the training dtype
    export = ref["export"]
    assert set(export) == set(hf_state)
    different = [n for n, t in hf_state.items() if not torch.equal(export[n].cpu(), t.to(export[n].dtype))]
    assert not different, different

    lp_diff = [float((a - b).abs().mean()) for a, b in zip(got["logprobs"], ref["logprobs"], strict=True)]
    wrong = [float((a - b).abs().mean()) for a, b in zip(got["contiguous_logprobs"], ref["logprobs"], strict=True)]
    report = {
        "tp": tp,
        "cp": cp,
        "loss": (got["train"]["train/loss"], ref["train"]["train/loss"]),
        "grad_norm": (got["train"]["train/grad_norm"], ref["train"]["train/grad_norm"]),
        "logprob_mean_abs_diff": max(lp_diff),
        "contiguous_positions_logprob_diff": max(wrong),
        "loaded_logprobs_diff": got["loaded_logprobs_diff"],
        "after_save_vs_after_load": (got["after_save"]["train/loss"], got["after_load"]["train/loss"]),
        "async_loaded_logprobs_diff": got["async_loaded_logprobs_diff"],
        "after_async_load_vs_after_load": (got["after_async_load"]["train/loss"], got["after_load"]["train/loss"]),
        "async_done_at_once": got["async_done_at_once"],
    }
    print("GPU-MEGATRON-TRAIN " + json.dumps(report))

    # every rank of the layout agrees on the metrics (they are reduced over the whole grid)
    for r in ranks[1:]:
        assert r["layout"]["train"] == got["train"]
    # bf16 noise of this tiny model (init std 0.2: logits of tens): measured 0.033 (CP=2), 0.055 (TP=2 x CP=2, SP)
    assert max(lp_diff) < 0.1
    # the negative control at the same bound (issue 20.6): positions of other tokens are far outside it
    assert max(wrong) > 0.1, wrong
    assert _rel(got["train"]["train/loss"], ref["train"]["train/loss"]) < REL_TOL
    assert _rel(got["train"]["train/grad_norm"], ref["train"]["train/grad_norm"]) < REL_TOL
    assert got["train"]["train/n_loss_tokens"] == ref["train"]["train/n_loss_tokens"]
    assert got["train"]["train/skipped_nonfinite_steps"] == 0.0

    # resume: the loaded weights give the saved logprobs, and the step after the load repeats the one after the save
    assert got["loaded_logprobs_diff"] < 1e-5
    assert got["optimizer_steps_after_load"] == 2
    for key in ("train/loss", "train/grad_norm"):
        assert _rel(got["after_load"][key], got["after_save"][key]) < 1e-2, key
    # issue 33.3: the background save (megatron-core's async save) of the same state resumes as the synchronous one
    # (the same bound: GPU kernels need not repeat a step bit for bit)
    assert got["async_loaded_logprobs_diff"] < 1e-5
    assert got["optimizer_steps_after_async_load"] == 2
    for key in ("train/loss", "train/grad_norm"):
        assert _rel(got["after_async_load"][key], got["after_load"][key]) < 1e-2, key


# ----------------------------------------------------------------------------------------------------------------
# the optimizer's state on the CPU (issue 33.5)


def job_offload(ctx: RankContext, hf_dir: str, checkpoint_dir: str) -> dict:
    """train.optimizer.cpu_offload=1.0 on one GPU: step, save, two steps; then a FRESH backend (as a resumed run
    builds one) loads the checkpoint and takes the same two steps."""
    import dataclasses

    from megatron.core import parallel_state

    from miles_vl.train.megatron import build_megatron_backend

    options = dataclasses.replace(OPTIONS, optimizer=dataclasses.replace(OPTIONS.optimizer, cpu_offload=1.0))
    samples = make_samples()
    out: dict = {}
    for phase in ("saved", "loaded"):
        backend = build_megatron_backend(
            hf_dir, _tokens(), options, ParallelOptions(tp_size=1, cp_size=1, bf16=True, seed=0)
        )
        if phase == "saved":
            first = getattr(backend.optimizer, "chained_optimizers", [backend.optimizer])[0]
            out["offloaded"] = type(first.optimizer).__name__
            out["first"] = train_step(backend, samples)
            backend.save_checkpoint(checkpoint_dir)
        else:
            backend.load_checkpoint(checkpoint_dir)
        out[phase] = [train_step(backend, samples) for _ in range(2)]
        out[f"{phase}_steps"] = backend.optimizer_steps
        del backend
        parallel_state.destroy_model_parallel()
        torch.cuda.empty_cache()
    return out


def test_optimizer_offload_trains_and_resumes_its_fp32_state(tmp_path):
    """With the optimizer's state in host memory (megatron's HybridDeviceOptimizer), the two steps after a resume
    repeat the two after the save: the second depends on the fp32 main weights and Adam moments the checkpoint
    restored (megatron-core 0.19.2's dp_reshardable load leaves them out of the CPU optimizer unless
    checkpoint.sync_offloaded_optimizer hands them over; the first step only reads the bf16 weights)."""
    hf_dir = str(tmp_path / "hf")
    write_checkpoint(hf_dir)
    (out,) = run_ranks(job_offload, 1, args=(hf_dir, str(tmp_path / "ckpt")), timeout_s=900.0)
    print("GPU-MEGATRON-OFFLOAD " + json.dumps({k: out[k] for k in ("offloaded", "saved_steps", "loaded_steps")}))
    assert out["offloaded"] == "HybridDeviceOptimizer"
    assert out["first"]["train/skipped_nonfinite_steps"] == 0.0
    assert (out["saved_steps"], out["loaded_steps"]) == (3, 3)
    for k in range(2):
        for key in ("train/loss", "train/grad_norm"):
            saved, loaded = out["saved"][k][key], out["loaded"][k][key]
            assert _rel(loaded, saved) < 1e-3, (k, key, saved, loaded)


def job_weights_only(ctx: RankContext, hf_dir: str, checkpoint_dir: str, hf_saved: str) -> dict:
    """checkpoint.optimizer_state=false with the optimizer offloaded (as 8b_1gpu): a trained backend saves its weights
    alone (and, as the reference, an HF export of the same weights); a FRESH backend built on the original weights
    loads that checkpoint and takes two steps; a backend built from the export takes the same two."""
    import dataclasses
    import shutil
    from pathlib import Path

    from megatron.core import parallel_state

    from miles_vl.train.megatron import build_megatron_backend

    options = dataclasses.replace(OPTIONS, optimizer=dataclasses.replace(OPTIONS.optimizer, cpu_offload=1.0))
    samples = make_samples()
    out: dict = {}
    for phase in ("trained", "loaded", "reference"):
        source = hf_saved if phase == "reference" else hf_dir
        backend = build_megatron_backend(
            source, _tokens(), options, ParallelOptions(tp_size=1, cp_size=1, bf16=True, seed=0)
        )
        if phase == "trained":
            train_step(backend, samples)
            backend.save_checkpoint(checkpoint_dir, optimizer_state=False)
            backend.save_hf(Path(hf_saved))
            for f in Path(hf_dir).iterdir():  # the tokenizer's and processor's files the export does not write
                if not (Path(hf_saved) / f.name).exists():
                    shutil.copy(f, hf_saved)
        else:
            if phase == "loaded":
                backend.load_checkpoint(checkpoint_dir)
            out[phase] = [train_step(backend, samples) for _ in range(2)]
        del backend
        parallel_state.destroy_model_parallel()
        torch.cuda.empty_cache()
    return out


def test_a_weights_only_checkpoint_resumes_as_an_optimizer_built_on_its_weights(tmp_path):
    """The real-component check of tests/train/megatron/test_optimizer_state.py's stand-in optimizer: megatron's own
    distributed optimizer, offloaded to the CPU (HybridDeviceOptimizer), after a load of a checkpoint without its
    state (`reload_model_params`), steps as one built on the checkpoint's weights; without the reload it would step
    the weights it was built on."""
    hf_dir = str(tmp_path / "hf")
    write_checkpoint(hf_dir)
    args = (hf_dir, str(tmp_path / "ckpt"), str(tmp_path / "hf_saved"))
    (out,) = run_ranks(job_weights_only, 1, args=args, timeout_s=900.0)
    for k in range(2):
        for key in ("train/loss", "train/grad_norm"):
            loaded, reference = out["loaded"][k][key], out["reference"][k][key]
            print(f"GPU-MEGATRON-WEIGHTS-ONLY step {k} {key}: loaded {loaded} reference {reference}")
            assert _rel(loaded, reference) < 1e-3, (k, key, loaded, reference)


def job_recompute_grads(ctx: RankContext, hf_dir: str) -> dict:
    """One mini-batch's gradients with no recompute, with full recompute, and with full recompute through upstream's
    `tensor_parallel` (miles_vl's `vision_recompute_deepstack_grads` patch taken out): the norm of each deepstack
    merger parameter's and each vision layer's gradient, read from megatron DDP's `main_grad` buffers."""
    from megatron.core import parallel_state

    from miles_vl.train.megatron import build_megatron_backend  # installs miles_vl.patches
    from miles_vl.train.types import MiniBatch

    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import transformer_block  # isort: skip

    samples = make_samples()
    patched = transformer_block.tensor_parallel
    out: dict = {"patched": hasattr(patched, "__miles_vl_original__")}
    for name, recompute, tp_module in (
        ("none", "none", patched),
        ("full", "full", patched),
        ("full_upstream", "full", getattr(patched, "__miles_vl_original__", patched)),
    ):
        transformer_block.tensor_parallel = tp_module
        try:
            backend = build_megatron_backend(
                hf_dir, _tokens(), OPTIONS, ParallelOptions(recompute=recompute, bf16=True, seed=0)
            )
            logprobs = backend.compute_logprobs(samples)
            for chunk in backend.model:
                chunk.zero_grad_buffer()
            backend.accumulate_gradients(MiniBatch(samples, list(range(len(samples))), logprobs, logprobs))
            out[name] = {
                n: float(p.main_grad.float().norm())
                for n, p in backend.model[0].named_parameters()
                if "vision_model" in n and ("deepstack_merger_list" in n or "decoder.layers." in n)
            }
        finally:
            transformer_block.tensor_parallel = patched
        del backend
        parallel_state.destroy_model_parallel()
        torch.cuda.empty_cache()
    return out


def test_full_recompute_keeps_the_vision_towers_deepstack_gradients_on_gpu(tmp_path):
    """The real-component check of tests/train/megatron/test_train_levers.py's CPU test (megatron's CheckpointFunction
    with its CUDA RNG stubbed, the CPU layers): with Transformer Engine's layers, CUDA's RNG and megatron's DDP,
    full recompute with the patch gives the vision tower's gradients of no recompute (bf16), and upstream's gives
    the deepstack mergers none."""
    hf_dir = str(tmp_path / "hf")
    write_checkpoint(hf_dir)
    (out,) = run_ranks(job_recompute_grads, 1, args=(hf_dir,), timeout_s=900.0)
    none, full, upstream = out["none"], out["full"], out["full_upstream"]
    mergers = [n for n in none if "deepstack_merger_list" in n and n.endswith("weight")]
    print(
        "GPU-MEGATRON-DEEPSTACK "
        + json.dumps({k: {n: out[k][n] for n in mergers} for k in ("none", "full", "full_upstream")})
    )
    # merger k's features join the output of language layer k at the image's positions; the last layer's (merger 1 of
    # tiny_config's 2 layers) reach only those positions' logits, which carry no loss: no gradient in any mode (the
    # first run on a GPU, 2026-11-29, asked all mergers for one and failed on it: 0.0 in all three)
    fed = [n for n in mergers if ".deepstack_merger_list.0." in n]
    last = [n for n in mergers if ".deepstack_merger_list.1." in n]
    assert out["patched"] and fed and all(none[n] > 0 for n in fed)
    assert last and all(out[k][n] == 0 for k in ("none", "full", "full_upstream") for n in last)
    for n, value in none.items():
        assert abs(full[n] - value) <= REL_TOL * value + 1e-6, (n, full[n], value)
    assert all(upstream[n] == 0 for n in mergers), {n: upstream[n] for n in mergers}
