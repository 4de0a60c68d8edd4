"""The DPO run's result and its closing lines."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from train_recipes.loop.records import RunEnd

__all__ = ["DPOResult", "dpo_summary_text"]


@dataclass(kw_only=True, slots=True, frozen=True)
class DPOResult:
    """What a DPO run returns (the same on every rank).

    Attributes:
        output_dir: the run folder.
        first_loss: the first logged loss (mean over the step's pairs).
        last_loss: the last logged loss; None when a finished run was resumed.
        accuracy_before: held-out exact match before training (None without held-out rows).
        accuracy_after: after training.
        metrics: the last logged reward margin, accuracy and log-probs.
    """

    output_dir: Path
    first_loss: float | None
    last_loss: float | None
    accuracy_before: float | None
    accuracy_after: float | None
    metrics: dict[str, float] = field(default_factory=dict)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def dpo_summary_text(end: RunEnd, output_dir: Path, png: Path | None) -> str:
    """The closing lines: losses, exact match before and after, the last reward metrics."""
    s = end.summary
    first, last = s.get("first_loss"), s.get("last_loss")
    losses = "-" if first is None or last is None else f"{first:.4f} -> {last:.4f}"
    lines = [
        "",
        f"run            {output_dir}",
        f"ranks          {s['world_size']} (dp={s['dp']})",
        f"pairs          {s['pairs']} ({s['loss_type']})",
        f"steps          {s['steps']}",
        f"loss           {losses}",
    ]
    if "rewards/margin" in s:
        lines.append(
            f"rewards        margin {s['rewards/margin']:.4f}, accuracy "
            f"{s['rewards/accuracy']:.1%} (last logged step)"
        )
        lines.append(
            f"log-probs      chosen {s['logps/chosen']:.4f}, rejected {s['logps/rejected']:.4f}"
        )
    before, after = s.get("accuracy_before"), s.get("accuracy_after")
    if before is not None or after is not None:
        lines.append(f"exact match    {_pct(before)} -> {_pct(after)} (held-out, greedy)")
    lines.append(f"loss curve     {png if png is not None else '-'}")
    if end.export_dir is not None:
        lines.append(f"HF export      {end.export_dir}")
    return "\n".join(lines)
