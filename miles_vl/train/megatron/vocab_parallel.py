"""Log-probabilities and entropy of next-token labels from vocab-parallel logits (megatron's output layer).

Under tensor parallelism (TP) each rank holds the logits of one contiguous vocabulary slice, `[N, V/TP]`, rank r
owning ids `[r * V/TP, (r + 1) * V/TP)`. The distribution is the one the rollout engine samples from (as the torch
backend's `label_logprobs`): logits divided by `temperature`, the `suppress_token_ids` removed, and megatron's vocab
padding (ids >= `vocab_size`) removed. Per token, with x = logits / temperature:

    logZ    = m + log(sum_r sum_v exp(x_v - m))           m = max over the whole vocabulary (all-reduce MAX)
    logp    = x_label - logZ                              x_label lives on one rank (all-reduce SUM of a one-hot pick)
    entropy = logZ - sum_v p_v x_v                        (all-reduce SUM)

Every TP rank of a group ends with the same `[N]` values and computes the same (replicated) loss from them, so the
backward needs no collective: the gradient of the local slice is
`d/dx_v = g_logp * ([v == label] - p_v) - g_entropy * p_v * (x_v - E_p[x])`, built from the two per-token scalars
`logZ` and `E_p[x]` saved in the forward. The forward and backward run over chunks of tokens in fp32, so memory
beyond the logits themselves is O(chunk * V/TP).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def vocab_parallel_logprobs(
    logits: Tensor,
    labels: Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    suppress_token_ids: Sequence[int] = (),
    vocab_size: int | None = None,
    with_entropy: bool = False,
    chunk_tokens: int = 4096,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability `[N]` of `labels` and optionally the entropy `[N]` (fp32), differentiable w.r.t. `logits`.

    Args:
        logits: `[N, V/TP]` this rank's vocabulary slice (any float dtype); TP rank r owns ids from r * V/TP.
        labels: `[N]` target ids (global vocabulary ids).
        tp_group: the tensor-parallel group; None or a group of size 1: the logits hold the whole vocabulary.
        temperature: the sampling temperature (> 0).
        suppress_token_ids: ids the engine never samples; they get probability 0 (a suppressed label gets -inf).
        vocab_size: the real vocabulary size; columns at or beyond it (megatron's padding) get probability 0.
        with_entropy: also return the entropy of the distribution.
        chunk_tokens: tokens per fp32 chunk.

    Raises:
        ValueError: shapes that do not match, or a temperature <= 0.
    """
    if logits.dim() != 2 or labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        raise ValueError(
            f"expected logits [N, V/TP] and labels [N]; found {tuple(logits.shape)}, {tuple(labels.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, found {temperature}")
    group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
    start = logits.shape[1] * (dist.get_rank(group) if group is not None else 0)
    logp, entropy = _VocabParallelLogprobs.apply(
        logits,
        labels,
        group,
        start,
        float(temperature),
        tuple(int(t) for t in suppress_token_ids),
        vocab_size,
        with_entropy,
        chunk_tokens,
    )
    return logp, (entropy if with_entropy else None)


def _scaled_chunk(logits: Tensor, temperature: float, banned: Tensor | None) -> Tensor:
    """fp32 logits / temperature of one chunk with the removed columns at -inf. [n, V/TP]"""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if banned is not None:
        x = x.index_fill(1, banned, float("-inf"))
    return x


def _removed_columns(
    local_vocab: int, start: int, suppress: tuple[int, ...], vocab_size: int | None, device
) -> Tensor | None:
    """Local column indices of suppressed ids and of vocab padding (ids >= vocab_size)."""
    cols = [t - start for t in suppress if start <= t < start + local_vocab]
    if vocab_size is not None and vocab_size < start + local_vocab:
        cols += range(max(vocab_size - start, 0), local_vocab)
    return torch.tensor(sorted(set(cols)), dtype=torch.long, device=device) if cols else None


def _all_reduce(x: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, start, temperature, suppress, vocab_size, with_entropy, chunk_tokens):
        n, local_vocab = logits.shape
        device = logits.device
        banned = _removed_columns(local_vocab, start, suppress, vocab_size, device)
        local_label = labels.long() - start
        owned = (local_label >= 0) & (local_label < local_vocab)
        local_label = torch.where(owned, local_label, torch.zeros_like(local_label))

        maxes = torch.empty(n, dtype=torch.float32, device=device)
        picked = torch.zeros(n, dtype=torch.float32, device=device)
        for a in range(0, n, chunk_tokens):
            x = _scaled_chunk(logits[a : a + chunk_tokens], temperature, banned)
            maxes[a : a + chunk_tokens] = x.max(dim=1).values
            target = x.gather(1, local_label[a : a + chunk_tokens, None]).squeeze(1)
            picked[a : a + chunk_tokens] = torch.where(owned[a : a + chunk_tokens], target, torch.zeros_like(target))
        _all_reduce(maxes, group, dist.ReduceOp.MAX)
        maxes = torch.where(torch.isfinite(maxes), maxes, torch.zeros_like(maxes))  # a row with every id removed

        sums = torch.zeros(n, dtype=torch.float32, device=device)
        weighted = torch.zeros(n, dtype=torch.float32, device=device)  # sum_v exp(x_v - m) * x_v
        for a in range(0, n, chunk_tokens):
            x = _scaled_chunk(logits[a : a + chunk_tokens], temperature, banned)
            e = torch.exp(x - maxes[a : a + chunk_tokens, None])
            sums[a : a + chunk_tokens] = e.sum(dim=1)
            if with_entropy:
                weighted[a : a + chunk_tokens] = torch.where(e > 0, e * x, torch.zeros_like(e)).sum(dim=1)
        # picked is one-hot over ranks (only the owner adds a non-zero), so a SUM gives the label's logit
        _all_reduce(picked, group)
        _all_reduce(sums, group)
        log_z = maxes + torch.log(sums)
        logp = picked - log_z
        # a suppressed label: the owner picked -inf; others added 0, so the sum is -inf as wanted
        mean_x = torch.zeros_like(log_z)
        entropy = None
        if with_entropy:
            _all_reduce(weighted, group)
            mean_x = weighted / sums  # E_p[x]
            entropy = log_z - mean_x
        ctx.save_for_backward(logits, local_label, owned, log_z, mean_x)
        ctx.args = (start, temperature, suppress, vocab_size, chunk_tokens)
        return logp, entropy if entropy is not None else torch.zeros_like(logp)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, local_label, owned, log_z, mean_x = ctx.saved_tensors
        start, temperature, suppress, vocab_size, chunk_tokens = ctx.args
        n, local_vocab = logits.shape
        banned = _removed_columns(local_vocab, start, suppress, vocab_size, logits.device)
        grad = torch.empty_like(logits)
        g_lp = grad_logp.float() if grad_logp is not None else torch.zeros_like(log_z)
        g_ent = grad_entropy.float() if grad_entropy is not None else None
        for a in range(0, n, chunk_tokens):
            b = min(a + chunk_tokens, n)
            x = _scaled_chunk(logits[a:b], temperature, banned)
            p = torch.exp(x - log_z[a:b, None])  # 0 on removed columns
            g = -p * g_lp[a:b, None]
            pick = owned[a:b]
            rows = torch.arange(a, b, device=logits.device)[pick] - a
            g[rows, local_label[a:b][pick]] += g_lp[a:b][pick]
            if g_ent is not None:
                centred = torch.where(p > 0, x - mean_x[a:b, None], torch.zeros_like(x))
                g = g - g_ent[a:b, None] * p * centred
            if temperature != 1.0:
                g = g / temperature
            grad[a:b] = g.to(grad.dtype)
        return grad, None, None, None, None, None, None, None, None
