"""Contract: how miles_vl's SGLang plugin is loaded, refuses, and reports (miles_vl/sglang_plugin/__init__.py,
adapter.py, settings.py, marker.py).

- `register()` does nothing unless the host opted in (`MILES_VL_SGLANG_PLUGIN`); its settings must have every key
  and no other;
- an unknown release, a missing symbol or a changed signature is refused before anything is patched, with one message
  naming the release, the symbol and the fix (`rollout.sglang.launcher: sglang`); the refusal is a `SystemExit`, which
  SGLang's `load_plugins` does not swallow: the server process ends at start with the message;
- each hook is checked to have taken; the marker in `/server_info` lists the release, the adapter and the patches;
- loaded through the entry point in the launching process and in a `spawn` child (a scheduler), as SGLang loads it;
- under 0.5.17 the multimodal feature transport is cpu (an unset one pinned, in the launcher and so in its
  schedulers; an explicit cuda_ipc refused with the fix) and the marker reports it;
- every target of each adapter exists, with the parameters it relies on, in that release's own source (the unpacked
  wheels, where this machine has them).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_vl import sglang_plugin
from miles_vl.sglang_plugin import PluginRefused, PluginSettings, adapter_for, install, register
from miles_vl.sglang_plugin.marker import MARKER_KEY
from miles_vl.sglang_plugin.settings import SETTINGS_ENV, from_env
from miles_vl.sglang_plugin.vision import SGLANG_VIT_GRAPH_ENV
from tests.sglang_plugin.stand_in import write_stand_in

REPO = Path(__file__).resolve().parents[2]
SGLANG_SOURCES = Path("/work/sglang_src")  # the unpacked wheels of the supported releases (absent: skipped)
ALL_HOOKS = PluginSettings(vision_graphs=2)  # asks for every patch


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """`make(release, drop=None)`: the stand-in SGLang of `release` importable in this process (removed after)."""

    def make(release: str, drop=None):
        site = write_stand_in(tmp_path / f"site_{release}_{len(list(tmp_path.iterdir()))}", release, drop=drop)
        monkeypatch.syspath_prepend(str(site))
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            monkeypatch.delitem(sys.modules, name)
        return site

    yield make
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    monkeypatch.setenv(SGLANG_VIT_GRAPH_ENV, "0")  # `install` sets it: restored after each test
    monkeypatch.setattr(sglang_plugin, "_installed", None)


def test_register_does_nothing_without_the_hosts_opt_in():
    assert register({}) is None
    assert not any(m == "sglang" or m.startswith("sglang.") for m in sys.modules)  # nothing imported either


def test_settings_need_every_key_and_no_other():
    """A setting that drifts between host and plugin (renamed, added, dropped) is an error, never a default."""
    full = json.loads(PluginSettings().to_env())
    assert from_env({SETTINGS_ENV: json.dumps(full)}) == PluginSettings()
    for broken, words in (
        ({k: v for k, v in full.items() if k != "link_pixels"}, "missing keys ['link_pixels']"),
        (full | {"share_pixels": True}, "unknown keys ['share_pixels']"),
        (full | {"receive_threads": "8"}, "receive_threads must be a int"),
        (full | {"group_copies": 1}, "group_copies must be a bool"),
        (full | {"receive_threads": 0}, "receive_threads >= 1"),
    ):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            from_env({SETTINGS_ENV: json.dumps(broken)})
        with pytest.raises(PluginRefused, match="refused to start"):
            register({SETTINGS_ENV: json.dumps(broken)}, release="0.5.16")
    with pytest.raises(ValueError, match="is not JSON"):
        from_env({SETTINGS_ENV: "vision_graphs=2"})


def test_a_refusal_is_not_an_exception_that_load_plugins_would_swallow():
    """0.5.16/0.5.17's `load_plugins` wraps each plugin in `except Exception` and logs: the server would start
    unpatched. `PluginRefused` is a `SystemExit`, whose message Python prints as the process's last words."""
    refused = PluginRefused("SGLang 9.9: x")
    assert isinstance(refused, SystemExit) and not isinstance(refused, Exception)
    assert str(refused.code).startswith("miles_vl SGLang plugin refused to start: SGLang 9.9")


def test_an_unknown_release_is_refused_naming_it_and_the_fix():
    with pytest.raises(PluginRefused) as refused:
        register({SETTINGS_ENV: PluginSettings().to_env()}, release="0.5.18")
    message = str(refused.value)
    assert "SGLang 0.5.18 has no adapter" in message and "0.5.16, 0.5.17" in message
    assert "rollout.sglang.launcher: sglang" in message


@pytest.mark.parametrize("release", ["0.5.16", "0.5.17"])
def test_every_hook_applies_is_verified_and_listed_in_the_marker(stand_in, release):
    stand_in(release)
    adapter = adapter_for(release)
    marker = install(adapter, ALL_HOOKS, launching=True)
    assert marker == {
        "release": release,
        "adapter": adapter.name,
        "patches": dict.fromkeys(("tokenizer", "receiver", "vision", "marker"), "live"),
        "settings": dataclasses.asdict(ALL_HOOKS),
    }
    from sglang.srt.entrypoints import http_server
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    assert TokenizerManager._send_one_request.__module__ == "miles_vl.sglang_plugin.grouping"
    state = http_server._GlobalState(None, None, {"max_req_input_len": 8})
    http_server.set_global_state(state)  # what the launcher calls once its schedulers are up
    assert http_server._global_state.scheduler_info == {"max_req_input_len": 8, MARKER_KEY: marker}
    assert os.environ[SGLANG_VIT_GRAPH_ENV] == "0"


def test_without_vision_graphs_the_vision_tower_is_left_alone(stand_in):
    stand_in("0.5.16")
    marker = install(adapter_for("0.5.16"), PluginSettings(), launching=True)
    from sglang.srt.models.qwen3_vl import Qwen3VLMoeVisionModel

    assert (
        "vision" not in marker["patches"] and Qwen3VLMoeVisionModel.forward.__module__ == "sglang.srt.models.qwen3_vl"
    )


@pytest.mark.parametrize(
    ("release", "drop", "symbol"),
    [
        (  # a method the tokenizer hook patches
            "0.5.16",
            ("sglang/srt/managers/tokenizer_manager.py", "def _send_batch_request(self, tokenized_objs):"),
            "TokenizerManager._send_batch_request",
        ),
        (  # one the grouped path calls, which 0.5.17 added
            "0.5.17",
            ("sglang/srt/managers/tokenizer_manager.py", "def _remove_req_state(self, rid, lifecycle_id=None):"),
            "TokenizerManager._remove_req_state",
        ),
        ("0.5.16", ("sglang/srt/managers/mm_utils.py", "def make_shm_name(kind):"), "make_shm_name"),
        ("0.5.17", ("sglang/srt/server_args.py", "def override(self, source, **fields):"), "ServerArgs.override"),
    ],
)
def test_a_missing_symbol_is_refused_before_anything_is_patched(stand_in, release, drop, symbol):
    stand_in(release, drop=drop)
    with pytest.raises(PluginRefused) as refused:
        install(adapter_for(release), ALL_HOOKS, launching=True)
    message = str(refused.value)
    assert f"SGLang {release}" in message and symbol in message and "rollout.sglang.launcher: sglang" in message
    from sglang.srt.managers.scheduler_components.request_receiver import SchedulerRequestReceiver
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    assert TokenizerManager._handle_batch_request.__module__ == "sglang.srt.managers.tokenizer_manager"
    assert SchedulerRequestReceiver.recv_requests.__module__.startswith("sglang.")  # nothing patched


def test_a_changed_signature_is_refused(stand_in):
    """0.5.17's grouped path calls `_init_child_req_state(logical_rid, obj)`: a release where it takes other
    parameters is refused, naming what was expected and found."""
    tm = "sglang/srt/managers/tokenizer_manager.py"
    stand_in(
        "0.5.17",
        drop=(
            tm,
            "def _init_child_req_state(self, logical_rid, obj, request=None):",
            "def _init_child_req_state(self, obj, request=None):",
        ),
    )
    with pytest.raises(PluginRefused) as refused:
        install(adapter_for("0.5.17"), PluginSettings(), launching=True)
    assert (
        "TokenizerManager._init_child_req_state('self', 'logical_rid', 'obj'), found ('self', 'obj', 'request')"
        in str(refused.value)
    )


def test_0_5_17s_rust_tokenizer_is_refused(stand_in, monkeypatch):
    """0.5.17's `SGLANG_RUST_SERVER=1` runs a Rust tokenizer in place of the TokenizerManager the hooks patch."""
    stand_in("0.5.17")
    monkeypatch.setenv("SGLANG_RUST_SERVER", "1")
    with pytest.raises(PluginRefused, match="SGLANG_RUST_SERVER=1"):
        install(adapter_for("0.5.17"), PluginSettings(), launching=True)


def test_0_5_17s_feature_transport_is_pinned_to_cpu_and_reported(stand_in, monkeypatch):
    """0.5.17 resolves an unset --mm-feature-transport to cuda_ipc on one CUDA node (0.5.16: cpu); the plugin's pixel
    handling is written for cpu, and under cuda_ipc every server died in its warmup request (GPU run of 2026-11-26).
    With the plugin an unset transport resolves to cpu, SGLang's own switch for its children says so, and the marker
    reports it; an explicit cpu is kept."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # the vision hook's graphs
    monkeypatch.delenv("SGLANG_USE_CUDA_IPC_TRANSPORT", raising=False)  # the stand-in's resolution sets it
    stand_in("0.5.17")
    from sglang.srt.server_args import ServerArgs

    assert ServerArgs().mm_feature_transport == "cuda_ipc"  # the stand-in resolves as 0.5.17 does
    monkeypatch.delenv("SGLANG_USE_CUDA_IPC_TRANSPORT")
    marker = install(adapter_for("0.5.17"), ALL_HOOKS, launching=True)
    assert "mm_feature_transport" not in marker  # not resolved yet
    args = ServerArgs()
    assert args.mm_feature_transport == "cpu" and os.environ["SGLANG_USE_CUDA_IPC_TRANSPORT"] == "0"
    assert marker["mm_feature_transport"] == "cpu"
    assert args.enable_precise_embedding_interpolation  # the vision hook's wrapper still runs after this one
    assert ServerArgs(mm_feature_transport="cpu").mm_feature_transport == "cpu"


@pytest.mark.parametrize(
    ("fields", "env", "given", "undo"),
    [
        ({"mm_feature_transport": "cuda_ipc"}, None, "--mm-feature-transport cuda_ipc", "drop --mm-feature-transport"),
        ({"keep_mm_feature_on_device": True}, None, "--keep-mm-feature-on-device", "drop --keep-mm-feature-on-device"),
        ({}, "1", "SGLANG_USE_CUDA_IPC_TRANSPORT=1", "unset SGLANG_USE_CUDA_IPC_TRANSPORT"),
    ],
)
def test_0_5_17s_cuda_ipc_transport_is_refused_naming_the_setting_and_the_fix(
    stand_in, monkeypatch, fields, env, given, undo
):
    """A transport the user set to cuda_ipc (the flag, 0.5.17's deprecated flag or variable) is not overridden
    silently: the server ends at start with the plugin's refusal naming what was given, what is needed and the fix."""
    if env is None:
        monkeypatch.delenv("SGLANG_USE_CUDA_IPC_TRANSPORT", raising=False)
    else:
        monkeypatch.setenv("SGLANG_USE_CUDA_IPC_TRANSPORT", env)
    stand_in("0.5.17")
    marker = install(adapter_for("0.5.17"), PluginSettings(), launching=True)
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(PluginRefused) as refused:
        ServerArgs(**fields)
    message = str(refused.value)
    assert message.startswith("miles_vl SGLang plugin refused to start: SGLang 0.5.17 with " + given), message
    assert "resolves the multimodal feature transport to 'cuda_ipc'" in message
    assert (
        "needs --mm-feature-transport cpu" in message and f"{undo}, or set rollout.sglang.launcher: sglang" in message
    )
    assert "mm_feature_transport" not in marker


def test_0_5_17s_schedulers_run_with_the_launchers_cpu_transport(tmp_path):
    """Through SGLang's own loading: the launching process resolves cpu and its spawned scheduler gets the same
    arguments and variable (it is handed the resolved arguments, not resolving them again); an explicit cuda_ipc ends
    the server at start with the refusal as its last line, before any scheduler starts."""
    site = write_stand_in(tmp_path / "site", "0.5.17")
    env = {SETTINGS_ENV: PluginSettings().to_env()}
    clean = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CUDA_IPC_TRANSPORT"}
    done = _launch(site, tmp_path / "out.json", env, base=clean)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("out.json.transport", "out.json.scheduler.transport"):
        assert json.loads((tmp_path / name).read_text()) == ["cpu", "0"], name
    done = _launch(site, tmp_path / "ipc.json", env, "--mm-feature-transport", "cuda_ipc", base=clean)
    assert done.returncode == 1 and not (tmp_path / "ipc.json.scheduler").exists()
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "miles_vl SGLang plugin refused to start: SGLang 0.5.17 with --mm-feature-transport cuda_ipc"
    ), done.stderr[-2000:]


def test_a_hook_that_does_not_take_is_refused(stand_in, monkeypatch):
    """`install` looks at every attribute a hook patches again after it ran: one left as SGLang had it (here the
    receiver hook's `apply` does nothing) ends the server rather than running it half-patched."""
    from miles_vl.sglang_plugin.v0_5_16 import receiver

    stand_in("0.5.16")
    monkeypatch.setattr(receiver, "HOOK", dataclasses.replace(receiver.HOOK, apply=lambda modules, context: None))
    adapter = dataclasses.replace(
        adapter_for("0.5.16"),
        hooks=tuple(receiver.HOOK if h.name == "receiver" else h for h in adapter_for("0.5.16").hooks),
    )
    with pytest.raises(PluginRefused, match="receiver patch left .*SchedulerRequestReceiver.recv_requests unpatched"):
        install(adapter, PluginSettings(), launching=True)


def _launch(site: Path, out: Path, env: dict, *args: str, base: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m sglang.launch_server` of the stand-in (the plugin found through its entry point), with `args`, in
    `base` (default: our environment) plus `env`."""
    env = {**(os.environ if base is None else base), "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), **env}
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_plugin_reaches_the_launching_process_and_its_spawned_schedulers(tmp_path):
    site = write_stand_in(tmp_path / "site", "0.5.16")
    done = _launch(site, tmp_path / "out.json", {SETTINGS_ENV: PluginSettings().to_env()})
    assert done.returncode == 0, done.stderr[-2000:]
    patched = {
        "tokenizer": "patch_tokenizer.<locals>.send_one_request",
        "receiver": "patch_receiver.<locals>.recv_requests",
    }
    assert json.loads((tmp_path / "out.json").read_text()) == patched
    assert json.loads((tmp_path / "out.json.scheduler").read_text()) == patched
    done = _launch(site, tmp_path / "stock.json", {})  # not opted in: SGLang as it is
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "stock.json").read_text())["tokenizer"] == "TokenizerManager._send_one_request"


@pytest.mark.parametrize(
    ("release", "drop", "words"),
    [
        ("0.5.15", None, "SGLang 0.5.15 has no adapter in miles_vl.sglang_plugin"),
        (
            "0.5.16",
            ("sglang/srt/managers/scheduler_components/request_receiver.py", "def recv_requests(self):"),
            "needs sglang.srt.managers.scheduler_components.request_receiver.SchedulerRequestReceiver.recv_requests",
        ),
    ],
)
def test_a_refusal_ends_the_server_at_start_with_one_message(tmp_path, release, drop, words):
    """Through SGLang's own loading (`load_plugins` catches `Exception`): the server process exits 1 before any
    scheduler starts, and its last line (what the host shows of a server that died at start) is the message."""
    site = write_stand_in(tmp_path / "site", release, drop=drop)
    done = _launch(site, tmp_path / "out.json", {SETTINGS_ENV: PluginSettings().to_env()})
    assert done.returncode == 1 and not (tmp_path / "out.json.scheduler").exists()
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("miles_vl SGLang plugin refused to start") and words in last, done.stderr[-2000:]
    assert "rollout.sglang.launcher: sglang" in last


def _defined(tree: ast.Module, attribute: str) -> ast.AST | None:
    """The node defining `attribute` (dotted: class, then member) at module level, or None. Members assigned in a
    class body (dataclass fields) count."""
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in attribute.split("."):
        node = None
        for stmt in scope:
            names = []
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [stmt.name]
            elif isinstance(stmt, ast.Assign):
                names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                names = [stmt.target.id]
            elif isinstance(stmt, ast.ImportFrom):
                names = [a.asname or a.name for a in stmt.names]
            if part in names:
                node = stmt
        if node is None:
            return None
        scope = getattr(node, "body", [])
    return node


@pytest.mark.parametrize("release", sorted(sglang_plugin.ADAPTERS))
def test_every_target_exists_in_its_releases_source(release):
    """Each adapter's table against its release's own code (parsed, not imported: SGLang needs a GPU stack): every
    module, attribute (a definition, a class-body field or an import into the module) and the leading parameters a
    hook relies on. The stand-ins above copy these names; this pins them to the real releases."""
    root = SGLANG_SOURCES / release
    if not root.is_dir():
        pytest.skip(f"no unpacked SGLang {release} at {root}")
    problems = []
    for hook in adapter_for(release).hooks:
        for target in hook.targets:
            path = root / (target.module.replace(".", "/") + ".py")
            if not path.exists():
                problems.append(f"{target}: no {path}")
                continue
            node = _defined(ast.parse(path.read_text()), target.attribute)
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:  # imported into the module
                origin = root / (node.module.replace(".", "/") + ".py")
                if not origin.exists():
                    origin = root / node.module.replace(".", "/") / "__init__.py"
                node = _defined(ast.parse(origin.read_text()), target.attribute) if origin.exists() else None
            if node is None:
                problems.append(f"{target}: not defined")
            elif target.params:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    problems.append(f"{target}: not a function")
                    continue
                found = tuple(a.arg for a in node.args.posonlyargs + node.args.args)[: len(target.params)]
                if found != target.params:
                    problems.append(f"{target}: parameters {found}, expected {target.params}")
    assert problems == [], "\n".join(problems)


def test_the_host_and_the_plugin_read_one_settings_format():
    """What `build_server_env` writes is what `register` reads (the stand-in server reads it with `from_env` too)."""
    from miles_vl.rollout.sglang.server import ServerSpec, build_server_env

    settings = PluginSettings(vision_graphs=3, receive_threads=2)
    env = build_server_env(ServerSpec(model_path="m", port=1, plugin=settings), base={SETTINGS_ENV: "stale"})
    assert from_env(env) == settings
    assert SETTINGS_ENV not in build_server_env(ServerSpec(model_path="m", port=1), base={SETTINGS_ENV: "stale"})


def test_the_host_shows_the_refusal_of_a_server_that_died_at_start(tmp_path):
    """What the user sees: the host's error for a server that ended at start ends with the server's last log lines,
    whose last is the refusal (release, symbol, fix)."""
    from miles_vl.rollout.sglang import ServerSpec, SGLangRolloutHost, SGLangServerDiedError
    from tests.rollout.sglang.conftest import TOKENS, free_port

    site = write_stand_in(tmp_path / "site", "0.5.15")
    spec = ServerSpec(model_path="/ckpt/m", port=free_port(), plugin=PluginSettings())
    with pytest.raises(SGLangServerDiedError) as died:
        SGLangRolloutHost(
            spec,
            TOKENS,
            startup_timeout_s=60,
            log_path=tmp_path / "server.log",
            env={"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])},
            health_poll_s=0.05,
        )
    message = str(died.value)
    assert "died while starting" in message and "exited with code 1" in message
    assert message.rstrip().endswith(
        "miles_vl SGLang plugin refused to start: SGLang 0.5.15 has no adapter in miles_vl.sglang_plugin (supported "
        "releases: 0.5.16, 0.5.17); set rollout.sglang.launcher: sglang to run SGLang's own server without miles_vl's "
        "patches (slower, and no pixel values from the engine), or install a supported SGLang release (docs/sglang.md, "
        "'The plugin')"
    )
