"""Reference core attention for the CPU harness: THD segments, causality and context parallelism, by the book.

It stands in for Transformer Engine's `TEDotProductAttention` in the layer specs of the real megatron-bridge
`Qwen3VLModel` (megatron-core's own `DotProductAttention` refuses packed input). It is deliberately naive so
that it can serve as a reference: every query attends, through one boolean mask and `scaled_dot_product_attention`,
to exactly the keys that TE would let it see.

Layout rules (DESIGN §4, written out here independently of `miles_vl.packing`):
- THD: `query` is `[t, heads, dim]`; segments come from `packed_seq_params.cu_seqlens_q_padded` (physical
  offsets, falling back to `cu_seqlens_q`); the valid length of segment i is `cu_seqlens_q[i+1] - cu_seqlens_q[i]`
  and keys beyond it are padding that nobody attends to.
- CP (language model only; the vision tower runs with `config.context_parallel_size == 1`): the local row holds,
  for every segment i of padded length P_i, chunks r and 2C-1-r of size P_i/(2C). Keys and values are
  all-gathered over the CP group and put back in full-row order; each local query keeps its full-row position,
  so causality is decided on global positions.
- BSHD: `query` is `[s, b, heads, dim]`; each batch row is one segment (of length s*C under CP, zigzag split).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


def zigzag_positions(cu_seqlens: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Full-row position of each token of rank `cp_rank`'s local row, in local order: LongTensor[cu[-1] / C].

    For each segment [a, b): chunk size c = (b - a) / (2C); the rank owns [a + r*c, a + (r+1)*c) then
    [a + (2C-1-r)*c, a + (2C-r)*c).
    """
    parts = []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        if (b - a) % (2 * cp_size):
            raise ValueError(f"segment [{a}, {b}) has length {b - a}, not divisible by 2*cp_size={2 * cp_size}")
        c = (b - a) // (2 * cp_size)
        parts.append(torch.arange(a + cp_rank * c, a + (cp_rank + 1) * c))
        parts.append(torch.arange(a + (2 * cp_size - 1 - cp_rank) * c, a + (2 * cp_size - cp_rank) * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class _GatherAlongFirstDim(torch.autograd.Function):
    """All-gather `[t_local, ...]` over `group` into `[C * t_local, ...]` (rank order); the gradient of each rank's
    input is its slice of the all-reduced output gradient (gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.group.size(), dim=0)[ctx.group.rank()], None


class ReferenceCoreAttention(MegatronModule):
    """Drop-in core attention (same constructor and forward signature as megatron's `DotProductAttention`)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"the reference attention is deterministic; set attention_dropout=0 (found {dropout})")
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        # The vision tower shares the model's pg_collection but is built with context_parallel_size=1.
        self.cp_group = cp_group if config.context_parallel_size > 1 else None
        if self.cp_group is not None and self.cp_group.size() != config.context_parallel_size:
            raise ValueError(
                f"config.context_parallel_size={config.context_parallel_size} but the CP group has "
                f"{self.cp_group.size()} ranks"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by the reference attention")
        causal = (attn_mask_type or self.attn_mask_type) in _CAUSAL
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise NotImplementedError(f"qkv_format={packed_seq_params.qkv_format!r}")
            if attention_mask is not None:
                raise ValueError("THD input takes no attention_mask")
            out = self._thd(query, key, value, packed_seq_params, causal)  # [t, heads, dim]
            return out.reshape(out.shape[0], -1)
        # BSHD: each batch row is one segment (zigzag-split under CP, as megatron splits unpacked input).
        if attention_mask is not None:
            raise NotImplementedError("the reference attention takes BSHD input without an attention_mask")
        s, b = query.shape[:2]
        cu = torch.tensor([0, s * self._cp_size()], dtype=torch.int32)
        outs = [self._attend(query[:, i], key[:, i], value[:, i], cu, cu, causal) for i in range(b)]
        out = torch.stack(outs, dim=1)  # [s, b, heads, dim]
        return out.reshape(s, b, -1)

    def _cp_size(self) -> int:
        return 1 if self.cp_group is None else self.cp_group.size()

    def _thd(self, q, k, v, params, causal):
        physical = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        kv_physical = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if not torch.equal(physical.cpu(), kv_physical.cpu()) or not torch.equal(
            params.cu_seqlens_q.cpu(), params.cu_seqlens_kv.cpu()
        ):
            raise NotImplementedError("self-attention only: q and kv cu_seqlens must match")
        return self._attend(q, k, v, physical.cpu(), params.cu_seqlens_q.cpu(), causal)

    def _attend(self, q, k, v, physical_cu, valid_cu, causal):
        """q/k/v: [t_local, heads, dim] in the local (zigzag under CP) order; returns [t_local, heads, dim]."""
        cp_size = self._cp_size()
        cu = [int(x) for x in physical_cu.tolist()]
        total = cu[-1]
        if total != cp_size * q.shape[0]:
            raise ValueError(
                f"cu_seqlens ends at {total} but the local row has {q.shape[0]} tokens at cp_size={cp_size} "
                f"(expected cu_seqlens[-1] == cp_size * local tokens)"
            )
        if cp_size > 1:
            rank = self.cp_group.rank()
            q_pos = zigzag_positions(cu, cp_size, rank)  # [t_local] full-row positions of local queries
            # Gather keys/values of every rank and put them back in full-row order.
            order = torch.cat([zigzag_positions(cu, cp_size, r) for r in range(cp_size)])  # [T]
            k_all = _GatherAlongFirstDim.apply(k, self.cp_group)
            v_all = _GatherAlongFirstDim.apply(v, self.cp_group)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel())
            k, v = k_all[inverse], v_all[inverse]
        else:
            q_pos = torch.arange(total)
        kv_pos = torch.arange(total)
        bounds = torch.tensor(cu)
        seg_of = torch.bucketize(kv_pos, bounds[1:], right=True)  # [T] segment of each full-row position
        valid_len = (valid_cu[1:] - valid_cu[:-1]).long()  # [n_seg]
        kv_offset = kv_pos - bounds[seg_of]
        kv_valid = kv_offset < valid_len[seg_of]
        allowed = (seg_of[q_pos][:, None] == seg_of[None, :]) & kv_valid[None, :]  # [t_local, T]
        if causal:
            allowed &= kv_pos[None, :] <= q_pos[:, None]

        n_heads, n_kv = q.shape[1], k.shape[1]
        if n_heads != n_kv:
            k = k.repeat_interleave(n_heads // n_kv, dim=1)
            v = v.repeat_interleave(n_heads // n_kv, dim=1)
        has_key = allowed.any(-1)  # queries with no visible key (empty padded segments) output zeros
        mask = allowed | ~has_key[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(),  # [heads, t_local, dim]
            k.transpose(0, 1).float(),
            v.transpose(0, 1).float(),
            attn_mask=mask.to(q.device),
            scale=self.softmax_scale,
        )
        out = out.transpose(0, 1).to(q.dtype) * has_key[:, None, None].to(q.dtype)
        return out
