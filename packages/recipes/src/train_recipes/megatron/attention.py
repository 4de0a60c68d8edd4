"""A core-attention module for megatron-core's local layer spec that keeps packed documents apart.

# T packed tokens, B batch, S sequence, Nq query heads, Ng key/value groups (this TP rank), D head dim

megatron-core 0.16.1's local ``DotProductAttention`` refuses packed sequences ("Packed sequence
is not supported by DotProductAttention"), and without packed params it builds its default
causal mask with ``device="cuda"``. This module takes its place in the layer spec: causal
scaled-dot-product attention over each ``cu_seqlens`` segment of a packed ("thd") batch, or
over every row of an unpacked one. It is plain PyTorch (SDPA picks flash/efficient kernels
on CUDA) and works under tensor parallelism, where each rank holds its own heads.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType


class SegmentCausalAttention(nn.Module):
    """Causal attention within each packed sequence; a drop-in ``core_attention`` submodule.

    Takes the constructor arguments of megatron-core's ``DotProductAttention`` (Megatron builds
    it from the layer spec with them) and reads only what attention needs.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError(
                f"SegmentCausalAttention runs without context parallelism, but "
                f"context_parallel_size={config.context_parallel_size}; use Megatron's own CP "
                "(Transformer Engine attention) for cp > 1"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"attention_dropout={dropout}: SegmentCausalAttention has no dropout (SFT runs "
                "without it); set attention_dropout=0.0"
            )
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5

    def _attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Query [B, Nq, L, D], key/value [B, Ng, L, D] -> [B, Nq, L, D], causal."""
        if key.shape[1] != query.shape[1]:  # grouped-query attention: share each kv group
            repeat = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=self.softmax_scale
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """Attention output in Megatron's layout.

        Args:
            query: [T, Nq, D] packed ("thd"), else [S, B, Nq, D].
            key: [T, Ng, D] packed, else [S, B, Ng, D].
            value: like ``key``.
            attention_mask: ignored: attention is causal within each sequence (right padding
                precedes no real token, and packed padding is a segment of its own).
            attn_mask_type: ignored (always causal).
            attention_bias: must be None.
            packed_seq_params: megatron-core's ``PackedSeqParams`` with ``qkv_format="thd"``
                and ``cu_seqlens_q`` [K + 1], or None.

        Returns:
            [T, Nq, D] packed (Megatron reshapes it to [T, 1, Nq * D]), else [S, B, Nq * D].
        """
        if attention_bias is not None:
            raise ValueError("SegmentCausalAttention does not take an attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q.tolist()
            out = torch.empty_like(query)
            for start, end in itertools.pairwise(cu):
                if end == start:
                    continue
                # [L, N, D] -> [1, N, L, D]
                seg = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value)]
                out[start:end] = self._attend(*seg)[0].transpose(0, 1)
            return out
        # [S, B, N, D] -> [B, N, S, D]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._attend(q, k, v)  # [B, Nq, S, D]
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
