"""Probe (2 GPUs, real SGLang 0.5.16): does the disaggregated NCCL weight sync work, and what makes it work?

Run inside the GPU stack on a 2-GPU machine (issue 32.1: found the cause of the disaggregated sync's failure):

    bash scripts/gpu/stack.sh python scripts/gpu/probe_nccl_sync.py [--variants a,b,c] [--ckpt DIR]

What it does (our code path: miles_vl's ServerSpec/build_server_argv/build_server_env for the server, miles_vl's
DistributedWeightSender for the trainer side):
- starts one real SGLang server on GPU 1 (CUDA_VISIBLE_DEVICES=<gpu 1>, as Ray gives an engine actor) with the tiny
  random Qwen3-VL checkpoint;
- for each variant, a FRESH trainer process on GPU 0 (CUDA_VISIBLE_DEVICES=<gpu 0>, as Ray gives a train rank;
  fresh because NCCL reads NCCL_CUMEM_ENABLE once per process) forms the weight-update group with the server and
  broadcasts every checkpoint tensor, perturbed (+0.25), then the originals; the server's /weights_checker checksum
  must change after the first sync and come back to its start value after the second (the tensors landed exactly).

Variants (default: fix_trainer_cumem0,today,fix_server_cumem1):
    fix_trainer_cumem0   trainer NCCL_CUMEM_ENABLE=0 (= what SGLang sets for itself)        -> expect ok
    today                trainer env as today (NCCL default: cuMem on; server: SGLang's 0)  -> expect HTTP 400
                         'invalid argument' from the server and the trainer stuck in its broadcast (killed here)
    today_nonblocking    as today + TORCH_NCCL_USE_COMM_NONBLOCKING=1, TORCH_NCCL_NONBLOCKING_TIMEOUT=20: does a
                         stuck comm init then raise by itself? (item 2 of issue 32)
    fix_server_cumem1    server launched with NCCL_CUMEM_ENABLE=1 (SGLang keeps a value set in its env), trainer
                         as today -> expect ok (needs its own server: started after the others)
Prints one JSON line last: {"variants": {name: {...}}, "nccl": ..., "torch": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_UP = Path(__file__).resolve().parents[2]
REPO = _UP if (_UP / "miles_vl").exists() else Path.cwd()
BASE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_DEBUG": "WARN",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "SGLANG_USE_SGL_FA3_KERNEL": "1",
}
TRAINER_ENV = {
    "fix_trainer_cumem0": {"NCCL_CUMEM_ENABLE": "0"},
    "today": {},
    "today_nonblocking": {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "20"},
    "fix_server_cumem1": {},
}
SERVER_ENV = {"fix_server_cumem1": {"NCCL_CUMEM_ENABLE": "1"}}  # the others share the default server
EXPECT_FAIL = {"today", "today_nonblocking"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def physical_gpus() -> list[str]:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    return cvd.split(",") if cvd else ["0", "1"]


# ---------------------------------------------------------------------------------------------------------------------
# the trainer side: one process per variant


def child(url: str, variant: str, group_timeout_s: float, ckpt: str) -> None:
    import torch
    from safetensors.torch import load_file

    from miles_vl.rollout.sglang.client import RequestPolicy, SGLangClient
    from miles_vl.rollout.sglang.weights import DistributedWeightSender, EngineEndpoint

    out: dict = {
        "variant": variant,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE"),
        "steps": [],
    }

    def say(step: str, **kw) -> None:
        out["steps"].append({"step": step, "t": round(time.monotonic() - t0, 2), **kw})
        print("PROGRESS " + json.dumps(out["steps"][-1]), flush=True)

    t0 = time.monotonic()
    torch.cuda.set_device(0)
    weights = load_file(str(Path(ckpt) / "model.safetensors"))
    names = sorted(weights)
    client = SGLangClient(url, policy=RequestPolicy(timeout_s=max(60.0, group_timeout_s * 3), max_retries=0))

    def checksum():  # /weights_checker; the NCCL result stands without it
        try:
            return client.check_weights()["per_engine_checksum"]
        except Exception as e:  # noqa: BLE001
            return f"unavailable: {e}"[:200]

    before = checksum()
    sender = DistributedWeightSender(
        [EngineEndpoint(client)],
        master_address="127.0.0.1",
        master_port=free_port(),
        backend="nccl",
        group_name=f"probe_{variant}",
        timeout_s=group_timeout_s,
    )
    sender.init_group()
    say("group formed")
    perturbed = [
        (n, ((w.float() + 0.25).to(w.dtype) if w.is_floating_point() else w).cuda())
        for n, w in ((n, weights[n]) for n in names)
    ]
    report = sender.send(perturbed, weight_version=f"{variant}-1")
    mid = checksum()
    say("sync 1", bytes=report.bytes, tensors=report.tensors, seconds=round(report.seconds, 3))
    report = sender.send([(n, weights[n].cuda()) for n in names], weight_version=f"{variant}-2")
    after = checksum()
    say("sync 2", seconds=round(report.seconds, 3))
    sender.close()
    say("group closed")
    out.update(
        ok=True,
        changed=mid != before,
        restored=after == before,
        nccl=".".join(map(str, torch.cuda.nccl.version())),
        torch=torch.__version__,
    )
    print("RESULT " + json.dumps(out), flush=True)


def run_variant(url: str, variant: str, gpu0: str, ckpt: str, server_log: Path, timeout_s: float) -> dict:
    offset = server_log.stat().st_size if server_log.exists() else 0
    env = {**os.environ, **BASE_ENV, **TRAINER_ENV[variant], "CUDA_VISIBLE_DEVICES": gpu0}
    if "NCCL_CUMEM_ENABLE" not in TRAINER_ENV[variant]:
        env.pop("NCCL_CUMEM_ENABLE", None)  # today: nothing sets it for the trainer (NCCL's default, cuMem on)
    group_timeout_s = 30.0 if variant in EXPECT_FAIL else 120.0
    cmd = [sys.executable, __file__, "--child", url, variant, str(group_timeout_s), ckpt]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        text, _ = proc.communicate(timeout=timeout_s)
        rc, hung = proc.returncode, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        rc, hung = None, True
    lines = text.splitlines()
    result = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
    server_text = server_log.read_text(errors="replace")[offset:] if server_log.exists() else ""

    def pick(ls: list[str]) -> list[str]:
        keep = ("NCCL WARN", "invalid argument", "Error", "Failed")
        return [x.strip()[:300] for x in ls if any(k in x for k in keep)][-8:]

    return {
        "ok": bool(result and result.get("ok")),
        "expected": "fail" if variant in EXPECT_FAIL else "ok",
        "result": result,
        "rc": rc,
        "hung_killed_after_s": timeout_s if hung else None,
        "wall_s": round(time.monotonic() - start, 1),
        "progress": [line[9:] for line in lines if line.startswith("PROGRESS ")],
        "trainer_errors": pick(lines) or lines[-6:],
        "server_errors": pick(server_text.splitlines()),
    }


# ---------------------------------------------------------------------------------------------------------------------
# the server: our launch path


def start_server(ckpt: str, gpu1: str, extra_env: dict, log_path: Path):
    from miles_vl.rollout import sglang as sg
    from miles_vl.rollout.sglang.client import RequestPolicy, SGLangClient

    spec = sg.ServerSpec(
        model_path=ckpt,
        port=free_port(),
        mem_fraction_static=0.3,
        colocated=False,
        random_seed=0,
        extra_args=("--disable-cuda-graph", "--context-length", "4096", "--grammar-backend", "none"),
    )
    env = {**sg.build_server_env(spec), **BASE_ENV, **extra_env, "CUDA_VISIBLE_DEVICES": gpu1}
    if "NCCL_CUMEM_ENABLE" not in extra_env:
        env.pop("NCCL_CUMEM_ENABLE", None)  # as in production today: SGLang sets 0 for itself
    server = sg.ServerProcess(sg.build_server_argv(spec, module=sg.SGLANG_LAUNCH_MODULE), env=env, log_path=log_path)
    server.start()
    client = SGLangClient(spec.url, policy=RequestPolicy(timeout_s=60, max_retries=0))
    waited = sg.wait_until_healthy(client, server, timeout_s=240, poll_s=0.5)
    return server, client, spec.url, waited


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="fix_trainer_cumem0,today,fix_server_cumem1")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--fail-wait-s", type=float, default=75.0, help="how long an expected failure may hang")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "/tmp/probe_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    gpus = physical_gpus()
    report: dict = {"gpus": gpus, "variants": {}}
    t0 = time.monotonic()

    ckpt = args.ckpt or "/tmp/ckpt_loop_tiny"
    if not (Path(ckpt) / "model.safetensors").exists():
        import importlib.util

        spec = importlib.util.spec_from_file_location("mk", REPO / "scripts" / "gpu" / "make_tiny_qwen3vl.py")
        mk = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mk)
        ckpt = "/tmp/ckpt_probe_tiny"
        mk.write_checkpoint(ckpt, shape="tiny", seed=0)
    report["ckpt_s"] = round(time.monotonic() - t0, 1)

    variants = [v for v in args.variants.split(",") if v]
    groups = [("default", [v for v in variants if v not in SERVER_ENV])]
    groups += [(v, [v]) for v in variants if v in SERVER_ENV]
    for server_name, names in groups:
        if not names:
            continue
        log_path = out_dir / f"sglang_{server_name}.log"
        try:
            server, client, url, waited = start_server(ckpt, gpus[1], SERVER_ENV.get(server_name, {}), log_path)
        except Exception as e:  # noqa: BLE001
            for v in names:
                report["variants"][v] = {"ok": False, "server_start_error": str(e)[:500]}
            continue
        report[f"server_{server_name}_start_s"] = round(waited, 1)
        try:
            for v in names:
                wait = args.fail_wait_s if v in EXPECT_FAIL else 240.0
                report["variants"][v] = run_variant(url, v, gpus[0], ckpt, log_path, wait)
                report["variants"][v]["server_alive_after"] = server.is_alive() and client.is_healthy(timeout_s=5)
        finally:
            server.stop()
    report["total_s"] = round(time.monotonic() - t0, 1)
    (out_dir / "probe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5])
    else:
        main()
