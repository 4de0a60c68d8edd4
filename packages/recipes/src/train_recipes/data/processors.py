"""Tokenizers and processors of the SFT recipe: what energon-sft's encoder and the export take."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, cast

from train_recipes.config.sft import SFTConfig
from train_recipes.data.energon_api import is_vlm

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin
    from transformers.image_processing_utils import BaseImageProcessor

__all__ = [
    "LocalProcessor",
    "Processor",
    "demo_image_processor",
    "load_processor",
    "load_tokenizer",
    "tokenizer_of",
    "with_chat_template",
]


class LocalProcessor:
    """A tokenizer plus an image processor: the two parts a Qwen2.5-VL processor carries.

    Built locally for the demo VLM (no processor files to download); energon-sft's
    Qwen2.5-VL adapter reads ``.tokenizer`` and ``.image_processor``.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, image_processor: BaseImageProcessor
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor

    def save_pretrained(self, directory: str | Path) -> None:
        """Write both parts into one folder (tokenizer files + preprocessor_config.json)."""
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)


#: What energon-sft's encoder takes: the tokenizer (text), a transformers processor (VLM), or
#: the demo VLM's :class:`LocalProcessor`.
Processor: TypeAlias = "PreTrainedTokenizerBase | ProcessorMixin | LocalProcessor"


def demo_image_processor() -> BaseImageProcessor:
    """Qwen2-VL image processing (PIL backend: no torchvision) at the demo's image size."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from train_recipes.data.demo import IMAGE_SIZE

    pixels = IMAGE_SIZE * IMAGE_SIZE
    return Qwen2VLImageProcessorPil(
        min_pixels=pixels, max_pixels=pixels, patch_size=14, merge_size=2, temporal_patch_size=2
    )


def load_processor(
    config: SFTConfig, *, tokenizer: PreTrainedTokenizerBase | None = None
) -> Processor:
    """What energon-sft's encoder takes: the tokenizer (text) or a processor (VLM).

    Args:
        config: the run's config (``model.path``, ``data.model_family``).
        tokenizer: the run's tokenizer when it is already loaded (a run folder's
            ``tokenizer/``); None loads it with :func:`load_tokenizer`.
    """
    if not is_vlm(config):
        return load_tokenizer(config) if tokenizer is None else tokenizer
    if config.model.path is None:
        return LocalProcessor(
            load_tokenizer(config) if tokenizer is None else tokenizer, demo_image_processor()
        )
    from transformers import AutoProcessor

    processor: ProcessorMixin = AutoProcessor.from_pretrained(config.model.path)
    tokenizer = with_chat_template(tokenizer_of(processor), config)
    if config.data.chat_template is not None and hasattr(processor, "chat_template"):
        processor.chat_template = tokenizer.chat_template  # what save_pretrained writes
    return processor


def tokenizer_of(processor_or_tokenizer: Processor) -> PreTrainedTokenizerBase:
    """The tokenizer inside a processor (or the tokenizer itself)."""
    found = getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)
    return cast("PreTrainedTokenizerBase", found)


def load_tokenizer(config: SFTConfig) -> PreTrainedTokenizerBase:
    """The model's own tokenizer (``model.path``) or the demo character tokenizer."""
    if config.model.path is None:
        from train_recipes.data.demo import build_char_tokenizer

        return with_chat_template(build_char_tokenizer(), config)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return with_chat_template(tokenizer, config)


def with_chat_template(
    tokenizer: PreTrainedTokenizerBase, config: SFTConfig
) -> PreTrainedTokenizerBase:
    """``tokenizer`` with ``data.chat_template`` (a name or a Jinja file) when it is set.

    The key, set, replaces the tokenizer's own template; it is saved with the tokenizer into
    the run folder and the export, so the trained model is used with the template it learnt.
    """
    if config.data.chat_template is not None:
        from train_recipes.data.chat_templates import resolve_chat_template

        tokenizer.chat_template = resolve_chat_template(config.data.chat_template)
    return tokenizer
