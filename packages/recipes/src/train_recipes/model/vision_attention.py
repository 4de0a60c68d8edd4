"""Vision-tower attention of the VLM path: one variable-length call per block, not per window.

# T patches (all images of the batch), H heads, D head dim, N windows or images

Transformers' Qwen2.5-VL vision attention has two paths. Unless the vision config's attention
implementation names flash attention, it reads the window lengths to the host
(``cu_seqlens.tolist()``, a device sync per block) and calls the attention function once per
window: windows are 8 x 8 patches in most blocks (whole images in the full-attention blocks), so
a batch of twenty 448 x 448 images makes a few hundred calls per block and thousands per step,
each too small to fill a GPU. With a name containing "flash" it makes one call per block with
the packed ``cu_seq_lens_q/k`` and ``max_length_q/k``, which is what a variable-length kernel
takes. :func:`use_varlen_vision_attention` registers such a function (cp-sharder's
``varlen_attention``: torch's FlashAttention varlen kernel on CUDA in bf16/fp16, per-window SDPA
elsewhere) and points the vision config, and only that config, at it.

Nothing else of the tower changes with the name: the tower builds no mask (its windows are the
``cu_seqlens``), and the only other reader of the name, ``get_max_seqlen``, then computes the
longest window once per forward (one host read for the windows, one for the images) instead of
none. The text model keeps its own configuration (cp-sharder's sharder points the text configs
at its packed attention and leaves vision towers alone). Checked against transformers 5.17 and
5.22 (``Qwen2_5_VLVisionAttention.forward`` is the same in both).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = ["VISION_VARLEN_ATTENTION", "use_varlen_vision_attention", "varlen_vision_attention"]

#: The registered name. transformers' vision attention takes its packed (one call) path when
#: the name contains "flash" (``transformers.utils.generic.is_flash_attention_requested``).
VISION_VARLEN_ATTENTION = "train_recipes_flash_varlen_vision"

# Vision towers whose attention modules were read and take the packed path by name (their
# forwards pass cu_seq_lens_q/k and max_length_q/k and build no mask): transformers 5.17-5.22.
_SUPPORTED_TOWERS = frozenset({"Qwen2_5_VisionTransformerPretrainedModel"})


def varlen_vision_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: Tensor,
    cu_seq_lens_k: Tensor,
    max_length_q: int,
    max_length_k: int,
    is_causal: bool = False,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """Attention of each window (or image) over itself, in one call for all of them.

    The signature transformers' attention interface calls with (its flash-attention keywords).

    Args:
        module: the attention module (unused: its ``scaling`` arrives as ``scaling``).
        query: [1, H, T, D].
        key: [1, H, T, D].
        value: [1, H, T, D].
        attention_mask: must be None (windows come from ``cu_seq_lens_q/k``).
        scaling: softmax scale; None means 1/sqrt(D).
        dropout: must be 0 (transformers' vision attention has none).
        cu_seq_lens_q: [N+1] int cumulative window lengths, 0 to T.
        cu_seq_lens_k: [N+1], the same windows for the keys.
        max_length_q: the longest window.
        max_length_k: the longest key window.
        is_causal: causal within each window (False for vision towers).
        **kwargs: the tower's other keywords (e.g. ``position_ids``), unused.

    Returns:
        ([1, T, H, D], None): the layout transformers' attention functions return, no weights.

    Raises:
        ValueError: a mask, dropout, or tensors with a batch dimension other than 1.
    """
    from cp_sharder.attention.varlen import Segments, varlen_attention

    if attention_mask is not None or dropout:
        raise ValueError(
            f"the {VISION_VARLEN_ATTENTION!r} attention takes windows from cu_seq_lens_q/k only; "
            f"got a mask ({attention_mask is not None}) or dropout {dropout}: use "
            "attn_implementation='sdpa' for this vision config"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"expected packed vision states [1, H, T, D]; got query {tuple(query.shape)}"
        )
    # transformers passes one tensor for both; comparing values would read them to the host.
    segments = Segments(
        cu_seqlens_q=cu_seq_lens_q,
        cu_seqlens_k=cu_seq_lens_k,
        max_seqlen_q=int(max_length_q),
        max_seqlen_k=int(max_length_k),
    )
    # [1, H, T, D] -> [T, H, D] views; the kernel reads the last dim contiguously.
    out = varlen_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        segments,
        causal=bool(is_causal),
        scale=scaling,
    )
    return out.unsqueeze(0), None


def _vision_towers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in _SUPPORTED_TOWERS]


def use_varlen_vision_attention(model: nn.Module) -> bool:
    """Point the model's vision tower at :data:`VISION_VARLEN_ATTENTION` (the text model keeps its).

    Registers the function with transformers' ``AttentionInterface`` (its registry is global by
    design; registering the same function under the same name again is harmless, and nothing
    uses the name unless a config selects it). Call before wrapping or compiling; works on the
    plain transformers model (DDP/FSDP2/peft wrappers are searched through ``modules()``).

    Args:
        model: a transformers image-text model.

    Returns:
        Whether a supported vision tower was found and switched; False leaves the model as is
        (text models and vision towers whose attention has not been checked for this path).
    """
    towers = _vision_towers(model)
    if not towers:
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(VISION_VARLEN_ATTENTION, varlen_vision_attention)
    for tower in towers:
        config: Any = tower.config
        if config._attn_implementation != VISION_VARLEN_ATTENTION:
            logger.info(
                "vision attention: %s -> %s (one varlen call per block)",
                config._attn_implementation,
                VISION_VARLEN_ATTENTION,
            )
        # Vision configs have no sub-configs: this reaches the tower's modules only.
        config._attn_implementation = VISION_VARLEN_ATTENTION
    return True
