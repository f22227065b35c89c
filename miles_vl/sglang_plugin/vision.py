"""Shared by every adapter: the vision tower's CUDA graphs (the setting `vision_graphs`; 0, off, by default).

SGLang 0.5.16 and 0.5.17 run Qwen3-VL's tower eagerly; their own `SGLANG_VIT_ENABLE_CUDA_GRAPH` keeps graphs by the
batch's total patch count only (`ViTCudaGraphRunner._get_graph_key`, unchanged in 0.5.17), so it replays wrong image
boundaries and a freed rotary table (sglang issue #29216): it is forced off here. `VisionGraphs` keeps one SGLang
graph runner per image layout (the patch grids of one vision batch), captured at a layout's second sighting and
replayed after; it pays off when layouts repeat (the vision step 43-51 -> 26-27 ms for 8 images of 784 patches on an
H200, docs/benchmarks.md) and costs nothing where they do not.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os

from miles_vl.sglang_plugin.settings import SETTINGS_ENV

log = logging.getLogger("miles_vl.sglang_plugin")

VISION_GRAPH_MAX_PATCHES = 32768  # larger batches of images run eagerly (a graph's memory grows with its patches)
SGLANG_VIT_GRAPH_ENV = "SGLANG_VIT_ENABLE_CUDA_GRAPH"  # SGLang's own vision graphs: unsafe (VisionGraphs), kept off


def image_layout(grid_thw) -> tuple[tuple[int, int, int], ...]:
    """The (t, h, w) patch grids of a vision batch's images, in order: everything a captured graph bakes in (the
    attention's segment boundaries and longest segment) follows from it."""
    rows = grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw
    return tuple((int(t), int(h), int(w)) for t, h, w in rows)


def layout_patches(layout: tuple) -> int:
    return sum(t * h * w for t, h, w in layout)


class VisionGraphs:
    """Scheduler side: which vision batches replay a CUDA graph, one 0.5.16 `ViTCudaGraphRunner` per image layout.

    0.5.16's runner keeps its graphs by the batch's total patch count only: a batch with the same total but other
    image boundaries replays the boundaries captured first, and a larger batch replaces the rotary workspace every
    earlier graph still reads (sglang issue #29216; fixed upstream after 0.5.16 by sglang PR #37043). One runner per
    layout avoids both: it only ever sees one total and one set of boundaries. A layout is run eagerly the first time
    it is seen and captured the second time (a layout seen once, common with images of many sizes, costs no capture
    and no graph memory); at most `max_graphs` are kept, the least recently used dropped first, and batches of more
    than `max_patches` patches always run eagerly. The decisions depend only on the sequence of layouts; with tensor
    parallelism the graphs stay off (`_configure_vision_graphs`)."""

    def __init__(self, max_graphs: int, max_patches: int = VISION_GRAPH_MAX_PATCHES):
        self.max_graphs, self.max_patches = max_graphs, max_patches
        self.runners: collections.OrderedDict[tuple, object] = collections.OrderedDict()  # layout -> runner; LRU first
        self.seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()  # layouts run once, eagerly
        self.captured = self.replayed = self.eager = self.dropped = 0

    def runner(self, layout: tuple, make_runner):
        """The runner that replays `layout` (made with `make_runner()` when this is its second sighting), or None: run
        it eagerly."""
        runner = self.runners.get(layout)
        if runner is not None:
            self.runners.move_to_end(layout)
            self.replayed += 1
            return runner
        if layout not in self.seen:  # its first sighting (or forgotten since): remembered, run eagerly
            self.seen[layout] = None
            while len(self.seen) > 4 * self.max_graphs:
                self.seen.popitem(last=False)
            self.eager += 1
            return None
        if layout_patches(layout) > self.max_patches:
            self.eager += 1
            return None
        del self.seen[layout]
        if len(self.runners) >= self.max_graphs:
            self.runners.popitem(last=False)  # its graph and buffers are freed with it
            self.dropped += 1
        runner = self.runners[layout] = make_runner()
        self.captured += 1
        return runner


def patch_vision_forward(cls, graph_runners_dict, max_graphs: int) -> None:
    """Replace `cls.forward` (SGLang's `Qwen3VLMoeVisionModel.forward(x, grid_thw)`) by one that replays a graph per
    image layout (`VisionGraphs`), made with `graph_runners_dict[device type](model)` (SGLang's runner table)."""
    import torch  # the scheduler has it loaded

    eager_forward = cls.forward

    def reserved_mib(device) -> float:
        return torch.cuda.memory_reserved(device) / 2**20 if device.type == "cuda" else 0.0

    def forward(self, x, grid_thw):
        graphs = self.__dict__.get("miles_vl_graphs")
        if graphs is None:
            graphs = self.miles_vl_graphs = VisionGraphs(max_graphs)
        layout = image_layout(grid_thw)
        captured = graphs.captured
        runner = graphs.runner(layout, lambda: graph_runners_dict[self.device.type](self))
        if runner is None:
            return eager_forward(self, x, grid_thw)
        self.graph_runners = runner
        # SGLang's vision attention backends read SGLANG_VIT_ENABLE_CUDA_GRAPH at every call to take the runner's form
        # of the segment boundaries (`VisionFlash3Attention.forward`, srt/layers/attention/vision.py:516): on for this
        # call only, so that the first, eager batch of a layout runs as stock SGLang does. The runner returns its own
        # output buffer, which its next replay overwrites: SGLang's embedding cache may keep views of what we return,
        # so it gets a tensor of its own (a copy of the merged tokens, microseconds).
        capturing = graphs.captured != captured
        reserved = reserved_mib(self.device) if capturing else 0.0
        os.environ[SGLANG_VIT_GRAPH_ENV] = "1"
        try:
            out = self.forward_with_cuda_graph(x, grid_thw).clone()
        finally:
            os.environ[SGLANG_VIT_GRAPH_ENV] = "0"
        if capturing:  # the memory the graph keeps: its pool and buffers (what a dropped graph gives back)
            log.info(
                "miles_vl: vision tower CUDA graph captured for %d images of %d patches (%d kept, %d dropped; "
                "+%.0f MiB reserved)",
                len(layout),
                layout_patches(layout),
                len(graphs.runners),
                graphs.dropped,
                reserved_mib(self.device) - reserved,
            )
        return out

    cls.forward = forward


def vision_graph_backend(mm_attention_backend: str | None, capability: tuple[int, int]) -> str | None:
    """The `--mm-attention-backend` under which the vision graphs run, or None where they cannot: 0.5.16's runner
    supports fa3 and triton_attn. Unset, it is set to what 0.5.16 would choose on this GPU anyway (`VisionAttention.
    _determine_attention_backend`: fa3 on SM 9.x, fa4 on SM 10.x but 10.3, triton_attn otherwise), so the numerics
    do not change."""
    if mm_attention_backend is None:
        major, minor = capability
        mm_attention_backend = "fa3" if major == 9 else "fa4" if major == 10 and minor != 3 else "triton_attn"
    return mm_attention_backend if mm_attention_backend in ("fa3", "triton_attn") else None


def stock_graphs_off() -> None:
    """In every server process, before SGLang runs: SGLang's own vision graphs off (the module docstring). Set, not
    removed, so that `forward` only ever changes the value of a variable that exists (native threads may read the
    environment while it sets it: a new variable can move glibc's environ array under them)."""
    if os.environ.get(SGLANG_VIT_GRAPH_ENV, "0").lower() not in ("0", "false", ""):
        log.warning(
            "miles_vl: %s=1 ignored: SGLang's vision graphs replay wrong image boundaries and rotary tables "
            "(miles_vl.sglang_plugin.vision.VisionGraphs); the plugin's setting vision_graphs sets miles_vl's",
            SGLANG_VIT_GRAPH_ENV,
        )
    os.environ[SGLANG_VIT_GRAPH_ENV] = "0"


def vision_graph_args(server_args, pin_backend: bool) -> tuple[str | None, dict]:
    """In the launching process, before SGLang starts a scheduler (it inherits the arguments): why the graphs cannot
    run with these server arguments (None: they can), and the arguments they need changed (the release's adapter
    applies them, each release in its own way).

    `pin_backend`: the release's graph runner reads `--mm-attention-backend` rather than the backend the vision model
    chose (0.5.16; 0.5.17's reads the model's), so it is set to what SGLang would choose anyway."""
    if server_args.enable_deterministic_inference:
        return "--enable-deterministic-inference (a layout's first, eager batch and its replays may round apart)", {}
    if (server_args.tp_size or 1) > 1:
        return (
            f"--tp-size {server_args.tp_size} (each capture registers its buffers with the custom all-reduce of every "
            "rank, and a dropped graph's registrations are never undone; not measured)"
        ), {}
    import torch

    capability = torch.cuda.get_device_capability(server_args.base_gpu_id or 0)
    backend = vision_graph_backend(server_args.mm_attention_backend, capability)
    if backend is None:
        name = server_args.mm_attention_backend or "this GPU's"
        return f"--mm-attention-backend {name} (SGLang's graph runner takes fa3 or triton_attn)", {}
    # The graph path's position embeddings (`Qwen3VLMoeVisionModel._prepare_graph_inputs` -> `fast_pos_embed_
    # interpolate`) sample the table at half-pixel centres unless this flag is on, while the eager tower (and
    # transformers, which the trainer runs) samples it with `linspace` (align corners); the flag is read nowhere else
    # (0.5.16 `srt/models/qwen3_vl.py:329`, `:464`; 0.5.17 `:332`, through its runtime context).
    changes = {"enable_precise_embedding_interpolation": True}
    if pin_backend:
        changes["mm_attention_backend"] = backend
    return None, changes


def patch_vision(vision_module, server_args_cls, context, apply_args, pin_backend: bool) -> None:
    """The vision hook of a release: `VisionGraphs` in the vision tower of `vision_module` (the release's
    `srt/models/qwen3_vl.py`) and, in the launching process, the server arguments the graphs need, set once SGLang
    has resolved them (after `server_args_cls.__post_init__`) by `apply_args(server_args, changes)`, the release's way
    to change a resolved argument. Where the graphs cannot run (`vision_graph_args`), the schedulers the launcher
    starts get `vision_graphs: 0` in the settings they inherit, a warning says why, and the marker reports the patch
    "off: why" (`context.patches`)."""
    settings = context.settings
    patch_vision_forward(vision_module.Qwen3VLMoeVisionModel, vision_module.graph_runners_dict, settings.vision_graphs)
    if not context.launching:
        return
    post_init = server_args_cls.__post_init__

    def __post_init__(self):
        post_init(self)
        why_not, changes = vision_graph_args(self, pin_backend)
        if why_not is None:
            apply_args(self, changes)
            return
        log.warning("miles_vl: the vision tower runs without CUDA graphs here: %s", why_not)
        context.patches["vision"] = f"off: {why_not}"
        os.environ[SETTINGS_ENV] = dataclasses.replace(settings, vision_graphs=0).to_env()  # what children inherit

    server_args_cls.__post_init__ = __post_init__
