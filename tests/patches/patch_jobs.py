"""Module-level functions the harness runs inside its worker processes (no megatron import at import time)."""


def install(module) -> None:
    """`setup` for runner.run_cp: install miles_vl's patches twice (the second must be a no-op)."""
    import miles_vl.patches

    miles_vl.patches.install(module)
    miles_vl.patches.install(module)


def job_status(ctx) -> dict:
    """Patch states, how many miles_vl wrappers `Qwen3VLModel.forward` carries, and whether one more install changes
    anything (it must not)."""
    import miles_vl.patches

    forward = ctx.module.Qwen3VLModel.forward
    names = {name: getattr(ctx.module, name) for name in ("get_rope_index", "reorganize_inputs")}
    wrappers, f = 0, forward
    while hasattr(f, "__miles_vl_original__"):
        wrappers, f = wrappers + 1, f.__miles_vl_original__
    miles_vl.patches.install(ctx.module)
    unchanged = ctx.module.Qwen3VLModel.forward is forward and all(
        getattr(ctx.module, n) is v for n, v in names.items()
    )
    return {
        "patches": [(s.name, s.state) for s in miles_vl.patches.status(ctx.module)["patches"]],
        "forward_wrappers": wrappers,
        "install_is_noop": unchanged,
    }


def _loss_weights(batch, vocab: int):
    """A fixed random weight per (sample, token of the sample, vocab entry), laid out on `batch`'s row; 0 on
    padding, so the loss is the same function of each sample's logits whatever the packing. [T, V]"""
    import torch

    w = torch.zeros(batch.num_tokens, vocab)
    for i, n in enumerate(batch.seq_lens.tolist()):
        start = int(batch.cu_seqlens[i])
        w[start : start + n] = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1000 + i))
    return w


def job_grads(ctx, samples, mode: str) -> dict:
    """Gradients of L = sum(logits * W) over real tokens: mode "packed" (this rank's pre-sharded shard, data-side
    positions) or "unpacked" (CP=1, each sample alone). Returns {param name: grad} of this rank."""

    from miles_vl.packing import pack_thd, zigzag_index
    from tests.patches.harness.runner import _logits, thd_params
    from tests.patches.harness.tiny import PAD, TOKENS, concat_pixels, reference_positions

    model = ctx.model
    model.zero_grad(set_to_none=True)
    batch = pack_thd(samples, cp_size=ctx.cp_size, pad_token_id=PAD, **TOKENS)
    if mode == "packed":
        shard = batch.shard(ctx.cp_rank)
        logits = _logits(
            model(
                input_ids=shard.input_ids,
                position_ids=shard.position_ids,
                packed_seq_params=thd_params(shard.cu_seqlens),
                pixel_values=concat_pixels(samples),
                image_grid_thw=batch.image_grid_thw,
            )
        )[0]
        w = _loss_weights(batch, logits.shape[-1])[zigzag_index(batch.cu_seqlens, ctx.cp_size, ctx.cp_rank)]
        loss = (logits.float() * w).sum()
    else:
        w = _loss_weights(batch, _logits_vocab(model))
        loss = 0.0
        for i, s in enumerate(samples):
            out = model(
                input_ids=s.input_ids[None],
                position_ids=reference_positions(s)[:, None, :],
                pixel_values=s.pixel_values,
                image_grid_thw=s.image_grid_thw,
            )
            start = int(batch.cu_seqlens[i])
            loss = loss + (_logits(out)[0].float() * w[start : start + s.input_ids.numel()]).sum()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _logits_vocab(model) -> int:
    return model.language_model.output_layer.weight.shape[0]
