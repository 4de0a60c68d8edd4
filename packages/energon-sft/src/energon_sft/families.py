"""Model-family adapters: how a family's processor turns images into pixels and tokens.

An adapter knows three things the generic encoder does not: where the tokenizer and image
processor live on the object the user passed, which token the chat template emits per image
(and which marker tokens surround it), and how many tokens one image expands to. The registry
maps a family name to an adapter; unknown names raise with the list of known ones.
"""

from __future__ import annotations

import hashlib
import io
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from energon_sft.errors import BadSampleError
from energon_sft.rope import mrope_position_ids
from energon_sft.schema import MediaItem

__all__ = [
    "ImageFeatures",
    "ModelFamilyAdapter",
    "Qwen25VLAdapter",
    "TextAdapter",
    "get_model_family",
    "known_model_families",
    "register_model_family",
]


@dataclass(kw_only=True, slots=True)
class ImageFeatures:
    """Processed images of one sample, in the order the template renders them.

    Attributes:
        pixel_values: [P, D] patches of all images concatenated (variable resolution, no padding).
        grids: [N, 3] int64 per-image (t, h, w) patch grid.
        tokens_per_image: N ints, how many placeholder tokens each image expands to.
    """

    pixel_values: Tensor
    grids: Tensor
    tokens_per_image: list[int] = field(default_factory=list)


def decode_image(item: MediaItem) -> Any:
    """Decode one media item into an RGB PIL image, or raise `BadSampleError(corrupt_media)`."""
    from PIL import Image, UnidentifiedImageError

    if item.kind != "image":
        raise BadSampleError(
            "unsupported_media", f"media {item.name!r} has kind {item.kind!r}; only images"
        )
    try:
        with Image.open(io.BytesIO(item.data)) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise BadSampleError("corrupt_media", f"cannot decode image {item.name!r}: {exc}") from exc


class ModelFamilyAdapter(ABC):
    """What the encoder needs from a model family (subclass and `register_model_family` it)."""

    #: Whether samples with images can be encoded at all.
    supports_images: bool = False
    #: The token the chat template emits once per image; expanded to `tokens_per_image`.
    image_token: str | None = None
    #: Marker tokens around an image block (never trained, dropped with the media on truncation).
    image_marker_tokens: tuple[str, ...] = ()

    def tokenizer(self, processor_or_tokenizer: Any) -> Any:
        """The text tokenizer (a `PreTrainedTokenizerFast`) inside what the user passed."""
        return getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)

    @abstractmethod
    def process_images(self, processor_or_tokenizer: Any, images: Sequence[Any]) -> ImageFeatures:
        """Turn decoded PIL images into pixel values, grids and token counts."""

    @abstractmethod
    def identity(self, processor_or_tokenizer: Any) -> dict[str, Any]:
        """JSON-able settings that change the encoded stream (part of the loader fingerprint)."""

    def mrope_position_ids(
        self,
        processor_or_tokenizer: Any,
        position_ids: Tensor,
        image_mask: Tensor,
        image_grid_thw: Tensor,
    ) -> Tensor | None:
        """M-RoPE ids of one document, for families that rotate by (time, height, width).

        Runs in the loader workers (once per encoded sample), so the training loop gets the
        ids with the batch instead of computing them on the host.

        Args:
            processor_or_tokenizer: what the user passed to the encoder.
            position_ids: [L] int64 1-D ids of the document (0, 1, ...).
            image_mask: [L] bool, True on image placeholder tokens.
            image_grid_thw: [N, 3] int64 grids of the document's images, in order.

        Returns:
            [3, L] int64, or None for families with 1-D rotary positions (the default).
        """
        return None


class TextAdapter(ModelFamilyAdapter):
    """Text-only causal LMs: any sample with an image is a bad sample (`unsupported_media`)."""

    def process_images(self, processor_or_tokenizer: Any, images: Sequence[Any]) -> ImageFeatures:
        """Refuse images: the family has no vision input."""
        raise BadSampleError(
            "unsupported_media",
            f"the sample has {len(images)} image(s) but model family 'text' has no vision "
            "input; use a vision family (e.g. 'qwen2_5_vl') or drop the images",
        )

    def identity(self, processor_or_tokenizer: Any) -> dict[str, Any]:
        """The adapter's name (a text family has no processing parameters)."""
        return {"adapter": type(self).__name__}


class Qwen25VLAdapter(ModelFamilyAdapter):
    """Qwen2-VL / Qwen2.5-VL style: `<|vision_start|>` N x `<|image_pad|>` `<|vision_end|>`.

    The image processor resizes each image so both sides are multiples of patch*merge
    (`smart_resize`), cuts it into patch_size^2 * temporal_patch_size * 3 values per patch, and
    returns per-image `(t, h, w)` grids in patches. One placeholder token stands for
    merge_size^2 patches: N = t*h*w / merge_size^2.

    The processor object must expose `.image_processor` (a `Qwen2VLImageProcessor` or
    compatible) and `.tokenizer`, like `Qwen2_5_VLProcessor`.
    """

    supports_images = True
    image_token = "<|image_pad|>"
    image_marker_tokens = ("<|vision_start|>", "<|vision_end|>")

    def _image_processor(self, processor: Any) -> Any:
        ip = getattr(processor, "image_processor", None)
        if ip is None:
            raise ValueError(
                f"model family 'qwen2_5_vl' needs a processor with .image_processor and "
                f".tokenizer (e.g. Qwen2_5_VLProcessor); got {type(processor).__name__}"
            )
        return ip

    def process_images(self, processor_or_tokenizer: Any, images: Sequence[Any]) -> ImageFeatures:
        """Pixel values, (t, h, w) grids and placeholder counts from the image processor."""
        ip = self._image_processor(processor_or_tokenizer)
        out = ip(images=list(images), return_tensors="pt")
        grids = torch.as_tensor(out["image_grid_thw"], dtype=torch.int64).reshape(-1, 3)
        merge = int(ip.merge_size)
        tokens = [int(g.prod().item()) // (merge * merge) for g in grids]
        pixel_values = torch.as_tensor(out["pixel_values"])
        return ImageFeatures(pixel_values=pixel_values, grids=grids, tokens_per_image=tokens)

    def mrope_position_ids(
        self,
        processor_or_tokenizer: Any,
        position_ids: Tensor,
        image_mask: Tensor,
        image_grid_thw: Tensor,
    ) -> Tensor | None:
        """[3, L] M-RoPE (temporal, height, width) ids, as the Qwen2-VL models compute them."""
        merge = int(self._image_processor(processor_or_tokenizer).merge_size)
        ids = mrope_position_ids(
            position_ids[None], image_mask[None], image_grid_thw, spatial_merge_size=merge
        )
        return ids[:, 0]

    def identity(self, processor_or_tokenizer: Any) -> dict[str, Any]:
        """The image processor's parameters that change the encoding (saved with the state)."""
        ip = self._image_processor(processor_or_tokenizer)
        keys = ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size")
        params = {k: getattr(ip, k, None) for k in keys}
        params["image_mean"] = list(getattr(ip, "image_mean", []) or [])
        params["image_std"] = list(getattr(ip, "image_std", []) or [])
        digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
        return {
            "adapter": type(self).__name__,
            "image_processor": type(ip).__name__,
            "image_processor_sha256": digest.hexdigest(),
        }


class _Registry:
    """Name -> adapter map owned by the module (one per process, filled at import)."""

    def __init__(self) -> None:
        self._adapters: dict[str, ModelFamilyAdapter] = {}

    def register(self, name: str, adapter: ModelFamilyAdapter, *, replace: bool) -> None:
        if not isinstance(adapter, ModelFamilyAdapter):
            raise TypeError(
                f"adapter for {name!r} is a {type(adapter).__name__}; subclass "
                "energon_sft.ModelFamilyAdapter"
            )
        if name in self._adapters and not replace:
            raise ValueError(
                f"model family {name!r} is already registered; pass replace=True to override"
            )
        self._adapters[name] = adapter

    def get(self, name: str) -> ModelFamilyAdapter:
        try:
            return self._adapters[name]
        except KeyError:
            raise ValueError(
                f"unknown model_family {name!r}; known families: {sorted(self._adapters)}. "
                "Register yours with energon_sft.register_model_family(name, adapter)."
            ) from None

    def names(self) -> list[str]:
        return sorted(self._adapters)


_REGISTRY = _Registry()
_REGISTRY.register("text", TextAdapter(), replace=False)
_REGISTRY.register("qwen2_5_vl", Qwen25VLAdapter(), replace=False)
_REGISTRY.register("qwen2_vl", Qwen25VLAdapter(), replace=False)


def register_model_family(name: str, adapter: ModelFamilyAdapter, *, replace: bool = False) -> None:
    """Make `adapter` available as `SFTTaskEncoder(..., model_family=name)`."""
    _REGISTRY.register(name, adapter, replace=replace)


def get_model_family(name: str) -> ModelFamilyAdapter:
    """The adapter registered under `name`; raises `ValueError` listing the known names."""
    return _REGISTRY.get(name)


def known_model_families() -> list[str]:
    """Sorted names of the registered model families."""
    return _REGISTRY.names()
