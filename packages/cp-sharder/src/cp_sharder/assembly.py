"""Model-input assembly: which local tensors the model's forward gets, and VLM pre-embedding.

Dimension letters: B batch, S sequence, H hidden.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cp_sharder.attention import Backend
from cp_sharder.planning import BatchPlan

__all__ = ["ForwardSignature", "assemble", "embed_multimodal", "has_media"]

# Optional buffers forwarded only when the model's forward names them.
OPTIONAL_BUFFERS = ("padding_mask", "loss_mask")
# Media inputs whose features replace placeholder tokens inside the model's forward.
MEDIA_KEYS = ("pixel_values", "pixel_values_videos")
# Media side inputs consumed together with MEDIA_KEYS.
MEDIA_SIDE_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids")


@dataclass(kw_only=True, slots=True, frozen=True)
class ForwardSignature:
    """The parameter names of a model's forward.

    Attributes:
        names: named parameters.
        var_keyword: the forward takes ``**kwargs``.
    """

    names: frozenset[str]
    var_keyword: bool

    @classmethod
    def of(cls, model: torch.nn.Module) -> ForwardSignature:
        """Read ``model.forward``'s signature (unknown signatures accept everything)."""
        try:
            sig = inspect.signature(model.forward)
        except (TypeError, ValueError):
            return cls(names=frozenset(), var_keyword=True)
        params = sig.parameters.values()
        names = frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
        return cls(names=names, var_keyword=any(p.kind is p.VAR_KEYWORD for p in params))

    def accepts(self, name: str, *, explicit: bool = False) -> bool:
        """Whether the forward takes ``name`` (``explicit``: only as a named parameter)."""
        return name in self.names or (self.var_keyword and not explicit)


def assemble(
    local: Mapping[str, Tensor],
    plan: BatchPlan,
    backend: Backend,
    signature: ForwardSignature,
    extra_names: frozenset[str],
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Split the local tensors into the model's inputs and the sharder's buffers.

    Returns:
        (model inputs plus ``labels``, buffers the forward does not take).
    """
    out: dict[str, Any] = {}
    buffers: dict[str, Tensor] = {}
    for name, t in local.items():
        if name == "labels":
            out[name] = t
        elif name == "attention_mask":
            # The CP and varlen backends build the pattern from the layout; TE's CP kernels take
            # no padding mask; only a model-owned hook or an unchanged cp=1 model consumes it.
            if backend in (Backend.MODEL_HOOK, Backend.NONE):
                out[name] = t
            elif backend is Backend.TE and not plan.thd and not bool(t.bool().all()):
                raise ValueError(
                    "Transformer Engine BSHD context parallelism cannot honour a padding "
                    "attention_mask with masked tokens; pack the batch (qkv_format='thd') or "
                    "right-pad and drop the mask"
                )
            else:
                buffers[name] = t
        elif name in OPTIONAL_BUFFERS or name in extra_names:
            if signature.accepts(name, explicit=True):
                out[name] = t
            buffers[name] = t
        else:
            out[name] = t
    for name, value in plan.passthrough.items():
        if signature.accepts(name):
            out[name] = value
    if backend is Backend.TE and plan.thd:
        from cp_sharder.attention import te

        cu = plan.sequence.cu_seqlens_padded
        assert cu is not None
        lens = cu.diff()
        device = local["position_ids"].device
        keys = te.thd_batch_keys(cu.to(device), int(lens.max()))
        out.update({k: v for k, v in keys.items() if signature.accepts(k)})
    return out, buffers


def has_media(batch: Mapping[str, Any]) -> bool:
    """Whether the batch carries images or videos (``pixel_values*``)."""
    return any(batch.get(k) is not None for k in MEDIA_KEYS)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _features(out: Any) -> Tensor:
    pooled = getattr(out, "pooler_output", out)
    if isinstance(pooled, (tuple, list)):
        return torch.cat(list(pooled), dim=0)
    return pooled


def embed_multimodal(model: torch.nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """Replace ``input_ids`` + media by ``inputs_embeds`` with the media features in place.

    A transformers VLM scatters its image (video) features into the placeholder tokens inside
    its forward and checks that their counts match; a sequence shard holds only some of the
    placeholders. So before sharding, the placeholder embeddings are computed once on the whole
    batch, exactly as the model's forward does (``get_input_embeddings``,
    ``get_image_features``/``get_video_features``, ``get_placeholder_mask``, ``masked_scatter``),
    and the model then runs on the sharded ``inputs_embeds``. Gradients reach the vision tower
    and the embedding table through the sharding (each rank's own tokens).

    Args:
        model: a transformers image-text model.
        batch: ``input_ids`` [B, S], ``pixel_values`` (and/or ``pixel_values_videos``) and their
            grids, ``position_ids`` ([3 or 4, B, S] M-RoPE ids, required: a model would derive
            them from ``input_ids``, which it no longer sees).

    Returns:
        The batch with ``inputs_embeds`` [B, S, H] instead of ``input_ids`` and the media keys.

    Raises:
        ValueError: no position ids, or a model without the transformers VLM methods.
    """
    inner = _unwrap(model)
    base: Any = getattr(inner, "model", inner)
    needed = ("get_input_embeddings", "get_placeholder_mask")
    if not all(hasattr(base, n) for n in needed) or "input_ids" not in batch:
        raise ValueError(
            f"{type(inner).__name__} got pixel_values under context parallelism, but it has no "
            "transformers VLM interface (get_input_embeddings, get_image_features, "
            "get_placeholder_mask) and the batch needs input_ids; pass inputs_embeds with the "
            "media features already in place instead"
        )
    if batch.get("position_ids") is None:
        raise ValueError(
            "a VLM batch under context parallelism needs its M-RoPE position_ids ([3, B, S], or "
            "[4, B, S] with the text ids first): the model would derive them from input_ids, "
            "which it no longer sees (energon-sft: mrope_position_ids)"
        )
    out = dict(batch)
    ids = out.pop("input_ids")
    embeds = base.get_input_embeddings()(ids)
    image = out.pop("pixel_values", None)
    video = out.pop("pixel_values_videos", None)
    if image is not None:
        feats = _features(base.get_image_features(image, out.get("image_grid_thw"))).to(embeds)
        mask, _ = base.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=feats)
        embeds = embeds.masked_scatter(mask, feats)
    if video is not None:
        feats = _features(base.get_video_features(video, out.get("video_grid_thw"))).to(embeds)
        _, mask = base.get_placeholder_mask(ids, inputs_embeds=embeds, video_features=feats)
        embeds = embeds.masked_scatter(mask, feats)
    for name in MEDIA_SIDE_KEYS:
        out.pop(name, None)
    out["inputs_embeds"] = embeds
    return out
