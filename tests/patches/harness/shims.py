"""Import the real megatron-bridge Qwen3-VL model module on a CPU-only machine (test-only shims).

    model_module = load_qwen3vl_module("0.6.2")   # or "0.5.1"; once per process, before anything imports megatron
    model_module = load_qwen3vl_module("0.5.1", root=tree)   # a 0.5.1 tree elsewhere (e.g. a source-patched copy)

What the shims do, and why each is needed (DESIGN §5):
- bridge version: 0.6.2 comes from site-packages; 0.5.1 lives in a `pip install --target` folder
  (`scripts/setup_megatron.sh`; or `root`, a copy of such a folder) that is put first on `sys.path`. `megatron`
  is a namespace package, so `megatron.bridge` then resolves to 0.5.1 while `megatron.core` still comes from
  site-packages. Switching versions needs a fresh interpreter: the harness runs every model in spawned worker
  processes.
- `transformer_engine`: megatron-core is imported first, with no TE, so it takes its local (torch) code paths;
  then a `MagicMock` stands in for `transformer_engine` only while `megatron.bridge` is imported (its modules import
  TE names at module level) and is removed afterwards. 0.5.1 also imports `modelopt` (nvidia-modelopt) from
  `megatron.bridge.models.conversion.auto_bridge`; the Qwen3-VL model path never uses it, so it is mocked the same
  way when it is not installed.
- layer specs: the model module builds its vision tower from TE specs (`get_vit_layer_with_transformer_engine_spec`,
  `TENorm`, `TEColumnParallelLinear`, `TERowParallelLinear`); those names are rebound in the model module to
  megatron-core's local modules, with `ReferenceCoreAttention` as the core attention. The language model spec is
  the caller's (`language_layer_spec()` gives the local GPT spec with the same core attention).
- CPU device: `torch.cuda.current_device()` returns "cpu" (rotary `inv_freq` and a few buffers are created on it);
  NVTX ranges are no-ops; `torch.distributed.all_gather` accepts uneven per-rank sizes on gloo as it does on NCCL
  (needed by `vision_dp_when_cp`); `torch.cuda.synchronize()` is a no-op for megatron-core's checkpoint writer
  (`install_cpu_checkpointing`).

Never import this from `miles_vl`: it rewires global torch state of the process that calls it.
"""

from __future__ import annotations

import os
import sys
import unittest.mock
from pathlib import Path
from types import ModuleType

SUPPORTED_VERSIONS = ("0.6.2", "0.5.1")
MODEL_MODULE = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model"

_loaded_version: tuple[str, Path | None] | None = None  # (version, 0.5.1 folder)


def bridge_051_dir() -> Path:
    """Where `scripts/setup_megatron.sh` installs megatron-bridge 0.5.1 (override: MILES_VL_BRIDGE_051_DIR)."""
    return Path(os.environ.get("MILES_VL_BRIDGE_051_DIR", Path(sys.prefix) / "megatron-bridge-0.5.1"))


def require_bridge(version: str) -> None:
    """Fail the calling test when megatron-bridge `version` cannot be loaded here: the CPU suite needs it
    (`make setup` installs it), so its absence is an error, never a skip."""
    if reason := bridge_available(version):
        import pytest

        pytest.fail(f"the CPU harness cannot load megatron-bridge {version}: {reason}")


def bridge_available(version: str, root: str | Path | None = None) -> str | None:
    """None when `version` can be loaded here, else the reason. Reads package metadata only (importing, or even
    `find_spec("megatron.core")`, would import the `megatron` namespace before the version is chosen).
    `root`: the folder holding `megatron/bridge` of 0.5.1 (default `bridge_051_dir()`)."""
    from importlib import metadata

    if version not in SUPPORTED_VERSIONS:
        return f"unsupported megatron-bridge version {version!r}; supported: {SUPPORTED_VERSIONS}"
    try:
        metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return "megatron-core is not installed; run scripts/setup_megatron.sh"
    if root is not None and version != "0.5.1":
        return f"a bridge root folder is supported for 0.5.1 only, not {version!r}"
    if version == "0.5.1":
        folder = bridge_051_dir() if root is None else Path(root)
        if not (folder / "megatron" / "bridge" / "__init__.py").exists():
            return f"megatron-bridge 0.5.1 not found in {folder}; run scripts/setup_megatron.sh"
        return None
    try:
        installed = metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        return "megatron-bridge is not installed; run scripts/setup_megatron.sh"
    if installed != version:
        return f"megatron-bridge {installed} is installed, not {version}; run scripts/setup_megatron.sh"
    return None


def install_cpu_device() -> None:
    """`torch.cuda.current_device()` -> "cpu", no-op NVTX ranges and uneven all_gather on gloo, for this process."""
    import torch

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.nvtx.range_push = lambda *args, **kwargs: None
    torch.cuda.nvtx.range_pop = lambda *args, **kwargs: None
    install_uneven_all_gather()


def install_cpu_checkpointing() -> None:
    """megatron-core's `dist_checkpointing` save on the CPU (the megatron backend's checkpoints, sync and async):
    `torch.cuda.synchronize()` is a no-op (its host staging, `FileSystemWriterAsync.preload_tensors`, and its forked
    writer, `TemporalAsyncCaller.schedule_async_call`, wait for the GPU's copies), and where psutil is not installed
    (it is on the GPU stack, not in the CPU test environment) the writer's debug memory figure
    (`filesystem_async._process_memory`) is 0 instead of a RuntimeError that fails every write. With
    `install_cpu_device` (its CPU tensors for the "is any rank still writing" all-reduce) that is all it needs."""
    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    torch.cuda.synchronize = lambda *args, **kwargs: None
    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0


def install_uneven_all_gather() -> None:
    """Let `torch.distributed.all_gather` take per-rank tensors of different first-dim sizes on gloo.

    NCCL accepts an output list whose shapes differ (megatron-bridge's `AllGatherVisionEmbeddings`, used with
    `vision_dp_when_cp`, relies on it: each CP rank encodes a different number of images); gloo rejects it. The
    wrapper pads every rank's input to the largest size, gathers, and copies each rank's rows into its output.
    Equal shapes go straight to the original.
    """
    import torch
    import torch.distributed as dist

    if getattr(dist.all_gather, "_miles_vl_uneven", False):
        return
    original = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list) or async_op:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        original(gathered, padded, group=group)
        for out, full in zip(tensor_list, gathered, strict=True):
            out.copy_(full[: out.shape[0]])
        return None

    all_gather._miles_vl_uneven = True
    dist.all_gather = all_gather


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def _mock_modules(names: tuple[str, ...], **attrs) -> dict[str, ModuleType | None]:
    """Put one MagicMock tree in sys.modules under `names` (a package and its submodules); returns what it replaced."""
    saved = {name: sys.modules.get(name) for name in names}
    root = unittest.mock.MagicMock(name=names[0])
    for key, value in attrs.items():
        setattr(root, key, value)
    for name in names:
        node = root
        for part in name.split(".")[1:]:
            node = getattr(node, part)
        sys.modules[name] = node
    return saved


def _restore(saved: dict[str, ModuleType | None]) -> None:
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def load_qwen3vl_module(version: str, root: str | Path | None = None) -> ModuleType:
    """Import `megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model` of megatron-bridge `version` with the CPU
    shims installed and the TE layer specs rebound; idempotent within a process.

    `root` (0.5.1 only): the folder to import 0.5.1 from, holding `megatron/bridge` (and, optionally, the
    megatron-core it was released with in `megatron/core`); default `bridge_051_dir()`.

    Raises:
        RuntimeError: megatron was already imported in this process with another bridge version, or the version
            that got imported is not the one asked for.
        ValueError: unsupported or missing version.
    """
    global _loaded_version
    folder = None if version != "0.5.1" else (bridge_051_dir() if root is None else Path(root))
    if _loaded_version is not None:
        if _loaded_version != (version, folder):
            raise RuntimeError(
                f"megatron-bridge {_loaded_version} is already loaded; {(version, folder)} needs a new process"
            )
        return sys.modules[MODEL_MODULE]
    if "megatron" in sys.modules:
        raise RuntimeError("load_qwen3vl_module must run before anything imports megatron in this process")
    reason = bridge_available(version, root)
    if reason:
        raise ValueError(reason)

    if folder is not None:
        sys.path.insert(0, str(folder))
    install_cpu_device()

    import logging
    import warnings

    # The bridge logs every optional TE/apex symbol it cannot import, with a traceback; keep test output readable.
    logging.disable(logging.INFO)
    warnings.filterwarnings("ignore", message=".*(Apex|absl|transformer.engine|Transformer Engine).*")

    import megatron.core  # noqa: F401  (first, without TE: mcore picks its local code paths)
    import megatron.core.extensions.transformer_engine  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

    install_cpu_checkpointing()

    te_names = ("transformer_engine", "transformer_engine.pytorch")
    saved = _mock_modules(te_names, __version__="0.0.0")  # 0.0.0: mcore's TE version checks say "no TE"
    if not _importable("modelopt.torch.quantization.utils"):
        saved |= _mock_modules(
            ("modelopt", "modelopt.torch", "modelopt.torch.quantization", "modelopt.torch.quantization.utils")
        )
    try:
        import importlib

        model_module = importlib.import_module(MODEL_MODULE)
        from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import transformer_block
    finally:
        _restore(saved)
        logging.disable(logging.NOTSET)
    import megatron.core.utils as mcore_utils

    mcore_utils._te_version = None  # forget the mocked version; later checks see no TE

    from megatron.bridge import package_info

    if package_info.__shortversion__ != version:
        raise RuntimeError(
            f"asked for megatron-bridge {version} but imported {package_info.__version__} from {package_info.__file__}"
        )
    if folder is not None and not Path(package_info.__file__).resolve().is_relative_to(folder.resolve()):
        raise RuntimeError(f"megatron.bridge came from {package_info.__file__}, not from {folder}")
    if folder is not None and (folder / "megatron" / "core").is_dir():
        import megatron.core as mcore

        if not Path(mcore.__file__).is_relative_to(folder):
            raise RuntimeError(f"megatron.core came from {mcore.__file__}, not from {folder}")
    transformer_block.HAVE_TE = False  # it saw the mock; there is no te_checkpoint on CPU
    _rebind_specs(model_module)
    _loaded_version = (version, folder)
    return model_module


def loaded_versions() -> dict[str, str]:
    """{"megatron-bridge": ..., "megatron-core": ...} of this process (after `load_qwen3vl_module`)."""
    from megatron.bridge import package_info as bridge_info
    from megatron.core import package_info as core_info

    return {"megatron-bridge": bridge_info.__shortversion__, "megatron-core": core_info.__shortversion__}


def _rebind_specs(model_module: ModuleType) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    model_module.get_vit_layer_with_transformer_engine_spec = vision_layer_spec
    model_module.TENorm = WrappedTorchNorm
    model_module.TEColumnParallelLinear = ColumnParallelLinear
    model_module.TERowParallelLinear = RowParallelLinear


def vision_layer_spec():
    """megatron-core's local ViT layer spec with the reference core attention."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    from tests.patches.harness.attention import ReferenceCoreAttention

    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.submodules.core_attention = ReferenceCoreAttention
    return spec


def language_layer_spec():
    """megatron-core's local GPT layer spec (Qwen3: RMSNorm, q/k layernorm) with the reference core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.patches.harness.attention import ReferenceCoreAttention

    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = ReferenceCoreAttention
    return spec
