"""A stand-in SGLang package on disk, for the plugin's tests: every module and symbol an adapter's hooks patch or read
(miles_vl/sglang_plugin/v0_5_*/), with the release's names and signatures and no behaviour, plus the two pieces of
SGLang's plugin system the plugin relies on: `load_plugins()` runs each entry point of the group
`sglang.srt.plugins` and logs, without re-raising, an `Exception` it raises (as 0.5.16/0.5.17's
`srt/plugins/__init__.py` do), and `python -m sglang.launch_server` calls it before anything else, then builds its
`ServerArgs` (0.5.17's resolves an unset `mm_feature_transport` to cuda_ipc, as the real one does on one CUDA node),
and starts a `spawn` child (a scheduler) that is handed those arguments and calls it again. That the real releases have
these symbols: test_plugin.py::test_every_target_exists_in_its_releases_source (the unpacked wheels) and
tests/gpu/test_sglang_real.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

COMMON = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/managers/__init__.py": "",
    "sglang/srt/managers/scheduler_components/__init__.py": "",
    "sglang/srt/entrypoints/__init__.py": "",
    "sglang/srt/models/__init__.py": "",
    "sglang/srt/managers/mm_utils.py": """
        class ShmPointerMMData:
            def __getstate__(self):
                return {}

            def __setstate__(self, state):
                pass

        def make_shm_name(kind):
            return kind

        def _get_is_default_transport():
            return False

        def get_server_args():
            return None

        def wrap_shm_features(obj):
            return obj

        def has_shm_features(recv_reqs):
            return False

        def unwrap_shm_features(obj):
            return obj
    """,
    "sglang/srt/managers/scheduler_components/request_receiver.py": """
        from sglang.srt.managers.mm_utils import has_shm_features, unwrap_shm_features

        class SchedulerRequestReceiver:
            def recv_requests(self):
                return []

            def _finalize_shm_features(self, recv_reqs):
                pass
    """,
    "sglang/srt/entrypoints/http_server.py": """
        import dataclasses

        @dataclasses.dataclass
        class _GlobalState:
            tokenizer_manager: object
            template_manager: object
            scheduler_info: dict

        _global_state = None

        def set_global_state(global_state):
            global _global_state
            _global_state = global_state
    """,
    "sglang/srt/models/qwen3_vl.py": """
        graph_runners_dict = {}

        class Qwen3VLMoeVisionModel:
            def forward(self, x, grid_thw):
                return x

            def forward_with_cuda_graph(self, x, grid_thw):
                return x
    """,
    "sglang/srt/plugins/__init__.py": """
        import logging
        from importlib.metadata import entry_points

        _loaded = False

        def load_plugins():
            global _loaded
            if _loaded:
                return
            _loaded = True
            for ep in entry_points(group="sglang.srt.plugins"):
                try:
                    ep.load()()
                except Exception:
                    logging.getLogger(__name__).exception("Failed to execute general plugin: %s", ep.name)
    """,
    "sglang/launch_server.py": """
        import json, multiprocessing as mp, os, sys

        from sglang.srt.plugins import load_plugins

        def report():
            from sglang.srt.managers.tokenizer_manager import TokenizerManager
            from sglang.srt.managers.scheduler_components.request_receiver import SchedulerRequestReceiver
            return {"tokenizer": TokenizerManager._send_one_request.__qualname__,
                    "receiver": SchedulerRequestReceiver.recv_requests.__qualname__}

        def transport(path, server_args):  # what this process runs with: the resolved argument and the variable
            with open(path + ".transport", "w") as f:
                json.dump([getattr(server_args, "mm_feature_transport", None),
                           os.environ.get("SGLANG_USE_CUDA_IPC_TRANSPORT")], f)

        def scheduler(path, server_args):
            load_plugins()  # as run_scheduler_process does
            with open(path, "w") as f:
                json.dump(report(), f)
            transport(path, server_args)

        if __name__ == "__main__":
            load_plugins()
            from sglang.srt.server_args import ServerArgs  # built after load_plugins, from the command line

            out = sys.argv[sys.argv.index("--out") + 1]
            flag = "--mm-feature-transport"
            server_args = ServerArgs(**({"mm_feature_transport": sys.argv[sys.argv.index(flag) + 1]}
                                        if flag in sys.argv else {}))
            # the scheduler gets the resolved arguments pickled, as SGLang's launcher hands them over
            child = mp.get_context("spawn").Process(target=scheduler, args=(out + ".scheduler", server_args))
            child.start()
            child.join()
            with open(out, "w") as f:
                json.dump(report(), f)
            transport(out, server_args)
            sys.exit(child.exitcode)
    """,
}

RELEASES = {
    "0.5.16": {
        "sglang/srt/managers/io_struct.py": """
            class GenerateReqInput:
                def regenerate_rid(self):
                    pass

                def __getitem__(self, i):
                    pass
        """,
        "sglang/srt/managers/tokenizer_manager.py": """
            from sglang.srt.managers.mm_utils import wrap_shm_features

            class TokenizerManager:
                async def _handle_batch_request(self, obj, request=None):
                    yield None

                def _send_one_request(self, tokenized_obj):
                    pass

                def _send_batch_request(self, tokenized_objs):
                    pass

                async def _tokenize_one_request(self, obj):
                    return obj

                def _init_req_state(self, obj, request=None):
                    pass

                async def _wait_one_response(self, obj, request=None):
                    yield None
        """,
        "sglang/srt/server_args.py": """
            import dataclasses

            @dataclasses.dataclass
            class ServerArgs:
                enable_dp_attention: bool = False
                tp_size: int = 1
                base_gpu_id: int = 0
                mm_attention_backend: str = None
                enable_deterministic_inference: bool = False
                enable_precise_embedding_interpolation: bool = False

                def __post_init__(self):
                    pass
        """,
    },
}
RELEASES["0.5.17"] = {
    "sglang/srt/managers/io_struct.py": """
        class GenerateReqInput:
            def regenerate_rid(self, prefix=None):
                pass

            def __getitem__(self, i):
                pass
    """,
    "sglang/srt/managers/tokenizer_manager.py": RELEASES["0.5.16"]["sglang/srt/managers/tokenizer_manager.py"]
    + """
                def _init_child_req_state(self, logical_rid, obj, request=None):
                    pass

                def _remove_req_state(self, rid, lifecycle_id=None):
                    pass
    """,
    "sglang/srt/server_args.py": """
        import dataclasses, os

        @dataclasses.dataclass
        class ServerArgs:
            enable_dp_attention: bool = False
            tp_size: int = 1
            base_gpu_id: int = 0
            mm_attention_backend: str = None
            enable_deterministic_inference: bool = False
            enable_precise_embedding_interpolation: bool = False
            mm_feature_transport: str = None
            keep_mm_feature_on_device: bool = False

            def __post_init__(self):
                # 0.5.17's _handle_multimodal_feature_transport (server_args.py:7564) on one node with CUDA: unset
                # resolves to cuda_ipc (0.5.16: cpu); the deprecated flag and variable still choose
                transport = "cuda_ipc" if self.keep_mm_feature_on_device else self.mm_feature_transport
                legacy = os.environ.get("SGLANG_USE_CUDA_IPC_TRANSPORT")
                if transport is None:
                    transport = "cuda_ipc" if legacy is None or legacy in ("1", "true") else "cpu"
                self.mm_feature_transport, self.keep_mm_feature_on_device = transport, False
                os.environ["SGLANG_USE_CUDA_IPC_TRANSPORT"] = "1" if transport == "cuda_ipc" else "0"
                self._declarations_materialized = True

            def __setattr__(self, name, value):  # read-only once resolved (server_args.py:8582)
                if not name.startswith("_") and getattr(self, "_declarations_materialized", False) and not getattr(
                    self, "_in_override", False
                ):
                    raise AttributeError(f"server_args.{name} assigned after resolution")
                object.__setattr__(self, name, value)

            def override(self, source, **fields):
                object.__setattr__(self, "_in_override", True)
                for name, value in fields.items():
                    setattr(self, name, value)
                object.__setattr__(self, "_in_override", False)
    """,
    "sglang/srt/environ.py": """
        import os

        class _EnvBool:
            def __init__(self, name):
                self.name = name

            def get(self):
                return os.environ.get(self.name, "0") in ("1", "true")

            def is_set(self):
                return self.name in os.environ

        class Envs:
            SGLANG_RUST_SERVER = _EnvBool("SGLANG_RUST_SERVER")
            SGLANG_USE_CUDA_IPC_TRANSPORT = _EnvBool("SGLANG_USE_CUDA_IPC_TRANSPORT")

        envs = Envs()
    """,
    "sglang/srt/runtime_context.py": """
        class _Parallel:
            enable_dp_attention = False

        def get_parallel():
            return _Parallel()
    """,
    "sglang/srt/multimodal/__init__.py": "",
    "sglang/srt/multimodal/processors/__init__.py": "",
    "sglang/srt/multimodal/processors/executor.py": """
        class MultimodalProcessorExecutor:
            async def run(self, function, *args, **kwargs):
                return self._run(function, args, kwargs)

            def _run(self, function, args, kwargs):
                return function(*args, **kwargs)
    """,
    "sglang/srt/multimodal/processors/base_processor.py": """
        class BaseMultimodalProcessor:
            @classmethod
            def _all_mm_data_is_preprocessed(cls, *data_lists):
                return False

            def process_and_combine_mm_data(self, base_output, mm_tokens, processor=None, **kwargs):
                return [], None, {}

            async def process_and_combine_mm_data_async(self, base_output, mm_tokens, **kwargs):
                return self.process_and_combine_mm_data(base_output, mm_tokens, **kwargs)
    """,
}


def write_stand_in(site: Path, release: str, *, drop: tuple[str, ...] | None = None, plugin_entry: bool = True) -> Path:
    """Write the stand-in of `release` under `site` (a directory to put on `sys.path`), with its dist-info (so that
    `importlib.metadata.version("sglang")` is `release`) and, with `plugin_entry`, a distribution that declares
    miles_vl's entry point as pyproject.toml does. `drop`: (file, line) to remove a symbol (the line that defines it
    is renamed away), or (file, line, new line) to change it. Returns `site`."""
    files = COMMON | RELEASES.get(release, RELEASES["0.5.16"])
    for rel, text in files.items():
        text = textwrap.dedent(text)
        if drop is not None and drop[0] == rel:
            assert drop[1] in text, drop
            gone = drop[1].replace("def ", "def _gone_", 1)
            text = text.replace(drop[1], drop[2] if len(drop) == 3 else gone)
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    meta = site / f"sglang-{release}.dist-info"
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {release}\n")
    if plugin_entry:
        entry = site / "miles_vl_plugin_entry-0.dist-info"
        entry.mkdir(exist_ok=True)
        (entry / "METADATA").write_text("Metadata-Version: 2.1\nName: miles-vl-plugin-entry\nVersion: 0\n")
        (entry / "entry_points.txt").write_text("[sglang.srt.plugins]\nmiles_vl = miles_vl.sglang_plugin:register\n")
    return site
