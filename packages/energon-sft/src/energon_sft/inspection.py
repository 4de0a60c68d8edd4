"""What `energon-sft inspect` prints: encoded rows with the trained tokens marked.

A prepared dataset is shown through the loader (`show_loader`); a chat JSONL file is read
directly (`show_jsonl`): every row is checked as `energon-sft convert` checks it, the first few
are encoded and shown, then the row count and the validation summary.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from energon_sft.batch import IGNORE_INDEX
from energon_sft.convert_report import ConvertReport
from energon_sft.errors import BadSampleError
from energon_sft.formats import RowFormat
from energon_sft.row_check import RowChecker, iter_checked_rows

__all__ = ["render_trained", "sample_header", "show_jsonl", "show_loader"]

_GREEN, _RESET = "\x1b[32m", "\x1b[0m"


def render_trained(tokenizer: Any, input_ids: list[int], labels: list[int], *, color: bool) -> str:
    """Decode a row, marking target tokens (green, or [[...]] without color).

    Token t is a target when `labels[t - 1] != -100` (labels are shifted). Runs of more than
    three identical special tokens (image placeholders) collapse to `<tok>xN`.
    """
    targets = [False] + [lab != IGNORE_INDEX for lab in labels[:-1]]
    special = set(getattr(tokenizer, "all_special_ids", []))
    segments: list[tuple[str, bool]] = []
    i = 0
    while i < len(input_ids):
        j = i + 1
        while j < len(input_ids) and input_ids[j] == input_ids[i] and targets[j] == targets[i]:
            j += 1
        if j - i > 3 and input_ids[i] in special:
            text = f"{tokenizer.convert_ids_to_tokens(input_ids[i])}x{j - i}"
        else:
            text = tokenizer.decode(input_ids[i:j])
        if segments and segments[-1][1] == targets[i]:
            segments[-1] = (segments[-1][0] + text, targets[i])
        else:
            segments.append((text, targets[i]))
        i = j
    return "".join(_wrap(text, trained, color) for text, trained in segments)


def _wrap(text: str, trained: bool, color: bool) -> str:
    if not trained:
        return text
    return f"{_GREEN}{text}{_RESET}" if color else f"[[{text}]]"


def sample_header(
    source_id: str, where: str, *, n_tokens: int, trained: int, images: int, weight: float
) -> str:
    """`=== <id> (<where>): N tokens, T trained, I image(s), weight W`."""
    return (
        f"=== {source_id} ({where}): {n_tokens} tokens, {trained} trained, "
        f"{images} image(s), weight {weight}"
    )


def show_loader(
    loader: Any, tokenizer: Any, *, num_samples: int, color: bool, out: Callable[[str], None]
) -> None:
    """Print the first `num_samples` rows of a batch-size-1 loader, then its data stats."""
    for n, batch in enumerate(loader):
        if n == num_samples:
            break
        length = int(batch.attention_mask[0].sum())
        ids = batch.input_ids[0, :length].tolist()
        labels = batch.labels[0, :length].tolist()
        out(
            sample_header(
                batch.source_ids[0],
                f"key {batch.__key__[0]}",
                n_tokens=length,
                trained=int(batch.num_trainable_tokens),
                images=int(batch.image_grid_thw.shape[0]),
                weight=float(batch.sample_weights[0]),
            )
        )
        out(render_trained(tokenizer, ids, labels, color=color))
    stats = loader.data_stats()
    if stats:
        out(f"data stats: {json.dumps(stats, sort_keys=True)}")


def show_jsonl(
    path: Path,
    encoder: Any,
    *,
    row_format: RowFormat,
    media_root: Path,
    num_samples: int,
    color: bool,
    out: Callable[[str], None],
) -> ConvertReport:
    """Check every row of a chat JSONL, print the first `num_samples` encoded, then a summary.

    Args:
        path: the JSONL file (media as paths relative to `media_root`, or inline base64).
        encoder: an `SFTTaskEncoder`; shown rows go through its `encode_chat`.
        row_format: as for `energon-sft convert --format`.
        media_root: base folder of relative media paths.
        num_samples: rows to encode and print.
        color: mark trained tokens in green (else `[[...]]`).
        out: where each output line goes.

    Returns:
        The schema-check counts (`rows_written` = rows that pass).
    """
    checker = RowChecker(row_format=row_format, media_root=media_root)
    report = ConvertReport(files=[path], out_dir=path, row_format=row_format)
    encoder_rejects: Counter[str] = Counter()
    shown = 0

    # Keys as convert gives them (the count of rows that passed before this one), so a row
    # without an id has the same name here and in the converted dataset.
    def next_key(f: Path, n: int) -> str:
        return f"{report.rows_read - 1 - report.rows_rejected:09d}"

    for f, n, checked in iter_checked_rows([path], checker, report, next_key=next_key):
        if shown == num_samples:
            continue  # keep checking the rest for the summary
        shown += 1
        where = f"{f.name}:{n}"
        source_id = checked.sample.source_id
        try:
            sample = encoder.encode_chat(checked.sample)
        except BadSampleError as exc:
            encoder_rejects[exc.reason] += 1
            out(f"=== {source_id} ({where}): rejected by the encoder: {exc}")
            continue
        ids = sample.input_ids.tolist()
        labels = sample.labels.tolist()
        out(
            sample_header(
                source_id,
                where,
                n_tokens=len(ids),
                trained=sum(lab != IGNORE_INDEX for lab in labels),
                images=int(sample.image_grid_thw.shape[0]),
                weight=float(sample.sample_weights[0]),
            )
        )
        out(render_trained(encoder.tokenizer, ids, labels, color=color))
    report.rows_written = report.rows_read - report.rows_rejected
    reasons = ", ".join(f"{r} {c}" for r, c in report.rejected.most_common())
    out(
        f"{path.name}: {report.rows_read} rows ({row_format}), {report.rows_written} pass the "
        f"schema, {report.rows_rejected} rejected" + (f" ({reasons})" if reasons else "")
    )
    for ex in report.examples:
        out(f"  {ex}")
    if encoder_rejects:
        out(f"of the {shown} shown, rejected by the encoder: {dict(encoder_rejects)}")
    return report
