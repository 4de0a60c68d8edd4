"""The data report: a sample of the training rows measured before launch, in two lines.

The launching process reads the first :data:`SAMPLE_ROWS` rows of the training data (energon-sft's
``first_samples``; the demo's chats when ``data.path`` is unset), renders and tokenizes them with
the run's tokenizer and chat template exactly as the loader will (energon-sft's encoder, without
a length limit) and reports their token lengths, the rows over ``data.max_length`` and the
trained (assistant) tokens per row. A run that would lose most of its trained tokens to
``data.max_length`` (over-long rows train nothing, whatever ``data.overlong`` does with them) is
refused before any rank starts, naming ``data.max_length`` and ``data.overlong``; so is one whose
sampled rows hold no trained token at all, and ``data.overlong=error`` with an over-long row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from train_recipes.config.loader import ConfigError
from train_recipes.config.sft import SFTConfig

if TYPE_CHECKING:
    from energon_sft import ChatSample
    from train_recipes.data.processors import Processor

__all__ = ["SAMPLE_ROWS", "DataReport", "data_report", "measure_rows"]

#: Rows read from the start of the training data.
SAMPLE_ROWS = 256
#: The share of the sample's trained tokens over-long rows may take before the run is refused.
MOST = 0.5


@dataclass(kw_only=True, slots=True, frozen=True)
class DataReport:
    """Token counts of the sampled rows, as the run's encoder makes them (no length limit).

    Attributes:
        source: where the rows came from.
        lengths: tokens per row (after the chat template and image expansion).
        trained: trained (target) tokens per row, in the same order.
        rejected: rows that could not be read or encoded (the loader skips them too).
        max_length: ``data.max_length``.
    """

    source: str
    lengths: tuple[int, ...]
    trained: tuple[int, ...]
    rejected: int
    max_length: int

    @property
    def over(self) -> list[int]:
        """Indices of the rows longer than ``max_length``."""
        return [i for i, n in enumerate(self.lengths) if n > self.max_length]

    @property
    def lost(self) -> float:
        """The share of trained tokens in over-long rows (they train nothing)."""
        total = sum(self.trained)
        return sum(self.trained[i] for i in self.over) / total if total else 0.0


def _percentile(values: list[int], q: float) -> int:
    """The nearest-rank percentile of sorted ``values``."""
    return values[max(0, math.ceil(q * len(values)) - 1)]


def measure_rows(
    processor: Processor,
    samples: list[ChatSample],
    config: SFTConfig,
    *,
    source: str,
    rejected: int = 0,
) -> DataReport:
    """Encode cooked ``samples`` as the run's loader would, without cutting any.

    Args:
        processor: the run's tokenizer (or VLM processor), chat template applied.
        samples: energon-sft ``ChatSample`` rows.
        config: the run's config (model family, ``train_on``, ``max_length``).
        source: where the rows came from, for the report.
        rejected: rows already found unreadable (counted with those the encoder rejects).
    """
    from energon_sft import BadSampleError
    from train_recipes.data import energon_api as data_api

    encoder = data_api.build_encoder(
        processor,
        model_family=config.data.model_family,
        max_length=2**62,  # measure, never cut
        train_on=config.data.train_on,
        pad_to_multiple_of=1,
        packing=False,
    )
    lengths: list[int] = []
    trained: list[int] = []
    for sample in samples:
        try:
            encoded = encoder.encode_chat(sample)
        except BadSampleError:
            rejected += 1
            continue
        lengths.append(int(encoded.input_ids.numel()))
        trained.append(int((encoded.labels != -100).sum()))
    return DataReport(
        source=source,
        lengths=tuple(lengths),
        trained=tuple(trained),
        rejected=rejected,
        max_length=config.data.max_length,
    )


def _sample(config: SFTConfig) -> tuple[list[ChatSample], int, str] | None:
    """The cooked rows at the start of the training data, the rows rejected, and the source."""
    from energon_sft import cook_chat, first_samples

    data = config.data
    if data.path is not None:
        try:
            read = first_samples(data.path, limit=SAMPLE_ROWS)
        except (FileNotFoundError, ValueError, OSError):
            return None  # a layout this reader does not know (the loader still may)
        return read.samples, read.rejected, f"the start of {data.path}"
    if data.demo == "shapes":
        return None  # pictures are generated with the dataset, in the ranks
    from train_recipes.data.demo import demo_chats

    chats, _ = demo_chats(data.demo, train_size=SAMPLE_ROWS, eval_size=0, seed=config.train.seed)
    crude = [
        {"json": row, "__key__": f"{i:09d}", "__restore_key__": (), "__sources__": ()}
        for i, row in enumerate(chats)
    ]
    return [cook_chat(c) for c in crude], 0, f"the demo's {data.demo} chats"


def _lines(report: DataReport, config: SFTConfig) -> list[str]:
    lengths, trained = sorted(report.lengths), sorted(report.trained)
    rows = len(lengths)
    skipped = f", {report.rejected} unreadable" if report.rejected else ""
    first = (
        f"data: {rows} rows from {report.source}{skipped}: tokens per row min {lengths[0]}, "
        f"median {_percentile(lengths, 0.5)}, p99 {_percentile(lengths, 0.99)}, max "
        f"{lengths[-1]}; trained tokens per row median {_percentile(trained, 0.5)} "
        f"({sum(trained)} in all)"
    )
    over = len(report.over)
    if not over:
        return [first, f"data: no row is over data.max_length={report.max_length}"]
    fate = {"truncate": "cut, weight 0", "skip": "dropped", "error": "the run stops"}
    second = (
        f"data: {over} of {rows} rows are over data.max_length={report.max_length} and train "
        f"nothing (data.overlong={config.data.overlong}: {fate[config.data.overlong]}): "
        f"{report.lost:.0%} of the trained tokens"
    )
    return [first, second]


def _refusal(report: DataReport, config: SFTConfig) -> ConfigError | None:
    rows, over, longest = len(report.lengths), len(report.over), max(report.lengths)
    if not sum(report.trained):
        return ConfigError(
            "data.chat_template",
            f"none of the {rows} rows read from {report.source} has an assistant token to "
            f"train on (data.train_on={config.data.train_on}); check the rows' roles and the "
            "chat template",
        )
    if over and config.data.overlong == "error":
        return ConfigError(
            "data.overlong",
            f"'error', and {over} of the {rows} rows read from {report.source} are over "
            f"data.max_length={report.max_length} (the longest has {longest} tokens); raise "
            f"data.max_length to >= {longest}, or set data.overlong=skip|truncate",
        )
    skip_all = config.data.overlong == "skip" and report.lost == 1.0
    if report.lost > MOST and (config.data.overlong != "skip" or skip_all):
        return ConfigError(
            "data.max_length",
            f"{over} of the {rows} rows read from {report.source} are longer than "
            f"{report.max_length} tokens (the longest has {longest}), so {report.lost:.0%} of "
            f"the trained tokens would be lost; raise data.max_length to >= {longest}, or "
            "set data.overlong=skip to drop those rows and train on the others",
        )
    return None


def data_report(config: SFTConfig) -> list[str]:
    """The report's lines for a run on your own model or data (none for the plain demo).

    Raises:
        ConfigError: the run would train (almost) nothing; see the module docstring.
    """
    if config.model.path is None and config.data.path is None:
        return []
    sampled = _sample(config)
    if sampled is None:
        return []
    samples, unreadable, source = sampled
    from train_recipes.data.processors import load_processor

    processor = load_processor(config)
    report = measure_rows(processor, samples, config, source=source, rejected=unreadable)
    if not report.lengths:
        return [f"data: none of the first rows of {source} could be read or encoded"]
    refusal = _refusal(report, config)
    if refusal is not None:
        raise refusal
    return _lines(report, config)
