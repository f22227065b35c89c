"""CPU test harness for the real megatron-bridge Qwen3-VL model (tests only; miles_vl never imports it).

- `shims.load_qwen3vl_module(version)`: import the bridge's Qwen3-VL model module on CPU (TE stub during import,
  local layer specs, CPU device, no-op NVTX, uneven all_gather on gloo); "0.6.2" (site-packages) or "0.5.1"
  (side install with megatron-core 0.18.2, see scripts/setup_megatron.sh; `root=` another 0.5.1 tree, e.g. a
  source-patched copy). `shims.bridge_available(version)` says why a version cannot load, without importing megatron.
- `attention.ReferenceCoreAttention`: THD-segment, causal and CP-aware core attention (all-gathers K/V).
- `tiny.build_tiny_qwen3vl`, `tiny.default_samples` / `tiny.parity_samples` (text, images, a video, image + video
  + image), `tiny.reference_positions`: the model and its inputs.
- `runner.run_cp(job, cp_size, version=..., setup=..., model_kwargs=...)`: spawn CP gloo ranks and run a job;
  `runner.run_packed` / `runner.run_packed_many` / `runner.packed_logits` / `runner.unpacked_logits`: the canned
  runs (`bridge_root=`: a 0.5.1 tree to import) whose equality is the
  proof; `probes.run_probes`: record what the language model received and where a version fails.

Nothing here imports megatron at import time (see runner.py for why).
"""
