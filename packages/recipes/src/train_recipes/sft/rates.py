"""The SFT run's speed: tokens/s per GPU, MFU and peak memory, per log window and for the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from train_recipes.loop import throughput
from train_recipes.model.build import unwrap

if TYPE_CHECKING:
    from train_recipes.loop.metrics import TokenMeter, TokenWindow
    from train_recipes.run.process_group import RankContext

__all__ = ["StepRates"]


@dataclass(kw_only=True, slots=True, frozen=True)
class StepRates:
    """The model's FLOP counts and the device's peak, to turn token windows into rates.

    Attributes:
        counts: the model's FLOPs per token and per batch (:mod:`train_recipes.loop.throughput`).
        peak_tflops: the device's dense bf16 peak (``train.peak_tflops`` or known); None: no MFU.
        devices: the ranks of the job (tokens/s is per GPU).
        device: this rank's device (peak memory is read there).
    """

    counts: throughput.FlopCounts
    peak_tflops: float | None
    devices: int
    device: torch.device

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        *,
        megatron: bool,
        peak_tflops: float | None,
        ctx: RankContext,
    ) -> StepRates:
        """The rates of ``model`` (the distributed model; megatron: its GPTModel)."""
        return cls(
            counts=throughput.model_counts(_counted_model(model, megatron=megatron)),
            peak_tflops=throughput.resolve_peak_tflops(peak_tflops, ctx.device),
            devices=ctx.world_size,
            device=ctx.device,
        )

    def fields(self, window: TokenWindow | None) -> dict[str, float]:
        """Tokens/s per GPU, MFU (with a known peak) and peak memory (CUDA); collective."""
        fields: dict[str, float] = {}
        if window is not None:
            fields |= throughput.rate_fields(
                tokens=window.tokens,
                flops=window.flops,
                seconds=window.seconds,
                devices=self.devices,
                peak_tflops=self.peak_tflops,
            )
        memory = throughput.peak_memory_gib(self.device)
        if memory is not None:
            fields["peak_memory_gib"] = memory
        return fields

    def run_summary(self, meter: TokenMeter) -> dict[str, float | None]:
        """The summary's rates and peak memory; None where not measured. Collective.

        The rates are those of the log windows after the first (``TokenMeter.run_window``).
        """
        rates = self.fields(meter.run_window())
        keys = ("tokens_per_s_per_gpu", "mfu", "peak_memory_gib")
        return {**{k: rates.get(k) for k in keys}, "peak_tflops": self.peak_tflops}


def _counted_model(model: torch.nn.Module, *, megatron: bool) -> torch.nn.Module:
    """The model whose weights the FLOP count reads (megatron: its HF config's, on meta)."""
    if not megatron:
        return unwrap(model)
    from transformers import AutoModelForCausalLM

    from train_recipes.megatron.recipe import hf_config

    with torch.device("meta"):
        counted: torch.nn.Module = AutoModelForCausalLM.from_config(hf_config(model))
    return counted
