"""The loader-vs-step benchmark's model: the recipe's Qwen2.5-VL at a preset's sizes, step variants.

``PRESETS`` holds the model shapes; ``build_vlm`` makes the model the recipe's builder
describes, with the preset's vision tower and vocabulary; ``StepVariant`` names one way of running
the step. Used by ``loader_vs_step.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from train_testing.tiny_hf import parameters_to

# Qwen2.5-VL-3B's shapes; "tiny" is the quick/CPU preset.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": {
        "text": {
            "hidden_size": 2048,
            "num_layers": 36,
            "num_heads": 16,
            "num_kv_heads": 2,
            "intermediate_size": 11008,
        },
        "vision": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
        "vocab_size": 151936,
    },
    "tiny": {
        "text": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
        "vision": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        "vocab_size": None,  # the tokenizer's own size
    },
}


class _PaddedVocab:
    """The tokenizer as the model builder sees it, with ``len()`` = the preset's vocabulary."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        self._tokenizer = tokenizer
        self._size = max(size, len(tokenizer))

    def __len__(self) -> int:
        return self._size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def build_vlm(
    config: Any, tokenizer: Any, preset: dict[str, Any], device: torch.device, dtype: str
) -> Any:
    """The recipe's ``build_model`` with the preset's vision tower and vocabulary size.

    The builder runs on the meta device (no weights) to get its Qwen2.5-VL config; the vision
    fields are set on it and the model is made on ``device`` from that config, with transformers'
    stock vision attention (the variants switch it).
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    from train_recipes.model.build import build_model

    if preset["vocab_size"] is not None:
        tokenizer = _PaddedVocab(tokenizer, preset["vocab_size"])
    with torch.device("meta"):
        skeleton = build_model(config, tokenizer)
    hf_config: Any = skeleton.config
    del skeleton
    for key, value in preset["vision"].items():
        setattr(hf_config.vision_config, key, value)
    hf_config.vision_config._attn_implementation = config.model.attn_implementation
    model_class: Any = Qwen2_5_VLForConditionalGeneration
    with torch.device(device):
        model = model_class(hf_config)
    return parameters_to(model, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])


_EXTRAS = ("linearpatch", "fusedadam", "compile", "fsdp2", "allpositions")

#: The before/after run of ``--step-only``: today's step, then each speed-up added.
STEP_ONLY_VARIANTS = ",".join(
    [
        "stock",
        "varlen",
        "varlen+linearpatch",
        "varlen+linearpatch+fusedadam",
        "varlen+linearpatch+fusedadam+fsdp2",
        "varlen+linearpatch+fusedadam+compile",  # last: their compilation takes the longest
        # The best step with the loss over every position (model.fused_loss_trained_only=false):
        # what selecting the trained rows saves.
        "varlen+linearpatch+fusedadam+compile+allpositions",
    ]
)


@dataclass(kw_only=True, slots=True, frozen=True)
class StepVariant:
    """One way of running the step; named by its parts joined with "+" (e.g. "varlen+compile").

    Attributes:
        name: as given on the command line.
        varlen: the vision tower through ``train_recipes.model.vision_attention`` (one varlen call
            per block); "stock" is transformers' per-window attention.
        linear_patch: the patch embedding as a matmul (``train_recipes.model.patch_embed``), not
            cuDNN's Conv3d.
        fused_adam: ``AdamW(fused=True)``, the recipe's optimizer on CUDA (the Engine then clips
            and skips inside the kernel, without the host sync of the foreach AdamW's step).
        compile: every decoder layer and vision block compiled (``compile_decoder_layers``).
        fsdp2: fp32 weights under a 1-rank FSDP2 with bf16 compute (else ``--wrap``).
        trained_only: the fused loss over the trained positions only (the recipe's default,
            ``model.fused_loss_trained_only``); "+allpositions" runs it over every position.
    """

    name: str
    varlen: bool
    linear_patch: bool
    fused_adam: bool
    compile: bool
    fsdp2: bool
    trained_only: bool

    @classmethod
    def parse(cls, name: str) -> StepVariant:
        base, *extras = name.split("+")
        unknown = [e for e in extras if e not in _EXTRAS]
        if base not in ("stock", "varlen") or unknown or len(set(extras)) != len(extras):
            raise SystemExit(
                f"unknown step variant {name!r}: stock or varlen, then any of "
                f"{', '.join('+' + e for e in _EXTRAS)} (e.g. {STEP_ONLY_VARIANTS})"
            )
        return cls(
            name=name,
            varlen=base == "varlen",
            linear_patch="linearpatch" in extras,
            fused_adam="fusedadam" in extras,
            compile="compile" in extras,
            fsdp2="fsdp2" in extras,
            trained_only="allpositions" not in extras,
        )
