"""The SFT run's summary: the table rank 0 prints (also summary.json) and the result it returns."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from train_recipes.config.sft import SFTConfig
from train_recipes.data.plane import DataPlane

if TYPE_CHECKING:
    from train_recipes.loop.records import RunEnd
    from train_recipes.run.process_group import RankContext

__all__ = [
    "SFTResult",
    "attention_line",
    "format_value",
    "header_line",
    "sft_summary_text",
    "skipped_text",
    "summary_table",
    "throughput_text",
]


def format_value(value: Any) -> str:
    """A number for the table: 4 decimals, ``nan``/``inf`` as such, ``-`` for None."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def attention_line(config: SFTConfig) -> str:
    """``sdpa (backends cudnn, flash)``: the attention implementation and SDPA backend order."""
    backends = config.model.sdpa_backends
    order = ", ".join(backends) if backends else "torch's default order"
    return f"{config.model.attn_implementation} (backends {order}), {config.model.dtype}"


def header_line(ctx: RankContext, config: SFTConfig, device: str, attention: str) -> str:
    """The run's first line: ranks and their layout, device and backend, attention."""
    return (
        f"sft: {ctx.world_size} ranks (dp={ctx.dp_size}, cp={ctx.cp_size}, tp={ctx.tp_size}, "
        f"{config.parallel.data_parallel}) on {device}; attention {attention}"
    )


def skipped_text(steps: list[int]) -> str:
    """``19 (steps 2, 3, ...)``: the count and the first ten skipped step numbers."""
    shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
    return f"{len(steps)} (steps {shown})" if steps else "0"


def throughput_text(summary: dict[str, Any]) -> str | None:
    """``1,234 tokens/s per GPU, MFU 41.2% of 989 TFLOPS, peak memory 12.3 GiB``, or None.

    None when the run measured no rate (this process trained no step).
    """
    rate = summary.get("tokens_per_s_per_gpu")
    if rate is None:
        return None
    parts = [f"{rate:,.0f} tokens/s per GPU"]
    if summary.get("mfu") is not None:  # None: no peak known (CPU, a GPU not in the table)
        parts.append(f"MFU {summary['mfu']:.1%} of {summary['peak_tflops']:g} TFLOPS")
    if summary.get("peak_memory_gib") is not None:
        parts.append(f"peak memory {summary['peak_memory_gib']:.1f} GiB")
    return ", ".join(parts)


def summary_table(
    summary: dict[str, Any], out_dir: Path, png: Path | None, export_dir: Path | None
) -> str:
    """The SFT run's closing table from its ``summary.json`` data, the plot and the export."""
    acc0, acc1 = summary["accuracy_before"], summary["accuracy_after"]
    lines = [
        "",
        f"run            {out_dir}",
        f"ranks          {summary['world_size']} "
        f"(dp={summary['dp']}, cp={summary['cp']}, tp={summary['tp']})",
        f"device         {summary['device']}",
        f"attention      {summary['attention']}",
        "start-up       " + ", ".join(f"{k} {v:.1f} s" for k, v in summary["startup_s"].items()),
        f"steps          {summary['steps']}",
        f"skipped        {skipped_text(summary['skipped_steps'])}",
        f"loss           {format_value(summary['first_loss'])} -> {format_value(summary['last_loss'])}",
    ]
    if summary["eval_loss_last"] is not None:
        lines.append(
            f"eval loss      {format_value(summary['eval_loss_first'])} -> "
            f"{format_value(summary['eval_loss_last'])} (held-out)"
        )
    if acc0 is not None and acc1 is not None:
        lines.append(f"exact match    {acc0:.1%} -> {acc1:.1%} (held-out, greedy)")
    if (speed := throughput_text(summary)) is not None:
        lines.append(f"throughput     {speed}")
    lines.append(f"loss curve     {png if png is not None else '-'}")
    if export_dir is not None:
        lines.append(f"HF export      {export_dir}")
    return "\n".join(lines)


def sft_summary_text(end: RunEnd, output_dir: Path, png: Path | None) -> str:
    """The SFT summary table of a finished run (``format_summary`` of :func:`drive`)."""
    return summary_table(end.summary, output_dir, png, end.export_dir)


@dataclass(kw_only=True, slots=True, frozen=True)
class SFTResult:
    """What a finished run reports (identical on every rank).

    Attributes:
        output_dir: the run directory.
        steps: optimizer steps done in total.
        first_loss: the loss of the first logged step of the run (also across resumes).
        last_loss: the loss of the last step.
        accuracy_before: held-out exact match before training (None when not measured).
        accuracy_after: held-out exact match after training.
        export_dir: the Hugging Face export, when written.
        model: the trained model (unwrapped from DDP; FSDP2 models stay sharded).
        data_plane: the samples each step trained on (this rank's replica; with ``--resume``,
            the earlier steps' too).
        loaders_built: energon-sft loaders this rank built (1 on a replica's first rank, else 0).
    """

    output_dir: Path
    steps: int
    first_loss: float | None
    last_loss: float | None
    accuracy_before: float | None
    accuracy_after: float | None
    export_dir: Path | None
    model: torch.nn.Module
    data_plane: DataPlane | None = None
    loaders_built: int = 0
