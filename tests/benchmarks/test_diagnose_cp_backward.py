"""CPU parts of benchmarks/diagnose_cp_backward.py (its runs need 2 GPUs): the variant table is bench command lines the
bench accepts, each adding the RL job's differences to the one before; the command line; how a run's log becomes its
JSON record (ok, the error, where the blocking rerun points), which failures get a blocking rerun, and the budget."""

import json

import pytest

from benchmarks import bench_megatron_cp as bench
from benchmarks import diagnose_cp_backward as diag


def test_every_variant_is_a_bench_command_line_at_the_failing_shape():
    table = {v.name: bench.parse_args(v.argv()) for v in diag.VARIANTS}
    assert list(table) == ["rl_loss", "rl_loss_where", "rl_step_where", "bench_env", "rl_step"]
    for variant in diag.VARIANTS:
        args = table[variant.name]
        assert (args.gpus, args.layouts, args.recompute, args.steps) == (2, ["cp2_vdp"], "full", 0)
        assert args.env == variant.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_CUMEM_ENABLE": "0"}
        assert args.lengths == ([24576, 32768] if variant.name == "rl_loss" else [32768])
        assert args.response == (1024 if variant.name == "bench_env" else 128)
    assert [table[n].path for n in table] == ["rl_loss", "rl_loss", "rl_step", "bench", "rl_step"]
    assert [table[n].logits_only_where_loss for n in table] == [False, True, True, False, False]
    assert table["rl_step"].samples == table["rl_step_where"].samples == 4
    # 24K is under 2^31 logits elements per rank, 32K over it (the first suspect)
    assert 24576 // 2 * 151936 < 2**31 < 32768 // 2 * 151936
    # the environment is the one the job gives its workers (the driver's runtime env), not a copy that could drift
    from miles_vl.gpu_env import CUMEM_ENV, nccl_peer_env

    assert diag.RL_TRAINER_ENV[CUMEM_ENV] == nccl_peer_env({})[CUMEM_ENV]


def test_parse_args(capsys):
    args = diag.parse_args([])
    assert args.variants == [v.name for v in diag.VARIANTS] and args.budget_s == 420
    assert diag.parse_args(["--variants", "rl_step"]).variants == ["rl_step"]
    for argv, message in ((["--variants", "rl"], "unknown ['rl']"), (["--budget-s", "60"], "below one variant")):
        with pytest.raises(SystemExit) as info:
            diag.parse_args(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err, argv


def bench_line(results, error=None):
    return json.dumps({"bench": "megatron_cp", "error": error, "results": results})


def test_outcome_of_a_run():
    v = diag.BY_NAME["rl_loss"]
    line = bench_line({"cp2_vdp_L24576": {"peak_gib_per_gpu": 40.5}, "cp2_vdp_L32768": {"peak_gib_per_gpu": 55.5}})
    ok = diag.outcome(v, 0, "noise\n" + line + "\n", False, 61.04)
    assert ok["ok"] and ok["error"] is None and ok["peak_gib_per_gpu"] == 55.5 and ok["where"] == []
    assert ok["results"] == {"cp2_vdp_L24576": 40.5, "cp2_vdp_L32768": 55.5}
    assert ok["wall_s"] == 61.0 and ok["variant"] == "rl_loss" and ok["blocking"] is False
    error = "RankError: rank 0 raised AcceleratorError: CUDA error: invalid argument"
    log = (
        "rank 0 raised AcceleratorError: CUDA error: invalid argument\n--- rank traceback ---\n"
        '  File "a.py", line 1, in f\n  File "torch/autograd/graph.py", line 2, in _engine_run_backward\n'
        "torch.AcceleratorError: CUDA error: invalid argument\n"
        + bench_line({"cp2_vdp_L24576": {"peak_gib_per_gpu": 40.5}, "cp2_vdp_L32768": "error"}, error)
    )
    bad = diag.outcome(v, 1, log, True, 10.0)
    assert not bad["ok"] and bad["error"] == error and bad["peak_gib_per_gpu"] == 40.5
    assert bad["results"] == {"cp2_vdp_L24576": 40.5, "cp2_vdp_L32768": "error"}
    assert bad["where"] == [
        'File "a.py", line 1, in f',
        'File "torch/autograd/graph.py", line 2, in _engine_run_backward',
        "torch.AcceleratorError: CUDA error: invalid argument",
    ]
    assert diag.rerun_worth(bad)
    oom = diag.outcome(v, 0, bench_line({"cp2_vdp_L24576": "oom", "cp2_vdp_L32768": "skipped: oom at 24576"}), False, 1)
    assert oom["error"] == "oom" and not oom["ok"] and not diag.rerun_worth(oom)
    timed_out = diag.outcome(v, None, "", False, 150.0)
    assert timed_out["error"] == "timeout after 150 s" and not diag.rerun_worth(timed_out)
    crashed = diag.outcome(v, 1, "Traceback\nImportError: no megatron\n", False, 1.0)
    assert crashed["error"] == "ImportError: no megatron" and diag.rerun_worth(crashed)


def test_main_reruns_the_failures_under_blocking_launches_within_the_budget(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(variant, blocking, logs, timeout_s):
        calls.append((variant.name, blocking))
        ok = variant.name in ("rl_loss_where", "rl_step_where", "bench_env")
        error = None if ok else "RankError: CUDA error: invalid argument"
        return {"variant": variant.name, "blocking": blocking, "ok": ok, "error": error}

    monkeypatch.setattr(diag, "run", fake_run)
    out = tmp_path / "diag.jsonl"
    assert diag.main(["--out", str(out), "--logs", str(tmp_path / "logs")]) == 0
    # the first failure at once under blocking launches, the later ones at the end
    assert calls == [
        ("rl_loss", False), ("rl_loss", True), ("rl_loss_where", False), ("rl_step_where", False),
        ("bench_env", False), ("rl_step", False), ("rl_step", True),
    ]  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == [json.loads(line) for line in out.read_text().splitlines()]
    # no time left: the rest is reported, not run
    clock = iter([0.0] + [1000.0] * 20)
    monkeypatch.setattr(diag.time, "monotonic", lambda: next(clock))
    calls.clear()
    diag.main(["--logs", str(tmp_path / "logs")])
    assert calls == [] and all('"not run: budget"' in line for line in capsys.readouterr().out.splitlines())
