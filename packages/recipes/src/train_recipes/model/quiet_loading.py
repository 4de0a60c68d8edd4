"""Hugging Face ``from_pretrained`` without the output that asks nothing of the user.

transformers draws a "Loading weights" bar in every process that loads (every rank), and logs
a LOAD REPORT table for every checkpoint key that did not match the model, including keys a
recipe leaves out on purpose (the retrieval encoder's pooler, dropped with
``add_pooling_layer=False``). :func:`from_pretrained_quietly` loads without the bar and holds
the report back; it is still logged, unchanged, when it names something to act on: a weight
the checkpoint lacks (randomly initialised), a shape mismatch, an unused key the caller did not
expect, or a load that fails.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar, cast

__all__ = ["from_pretrained_quietly"]

# transformers' loading report is a warning of this logger, headed "<Model> LOAD REPORT".
_REPORT_LOGGER = "transformers.modeling_utils"
_REPORT_MARK = "LOAD REPORT"

_Model = TypeVar("_Model")


class _HeldReports(logging.Filter):
    """Keeps the loading report's records back (the logger's other records pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if _REPORT_MARK in record.getMessage():
            self.records.append(record)
            return False
        return True


def from_pretrained_quietly(
    load: Callable[..., _Model],
    path: str | os.PathLike[str],
    *,
    unused_ok: Callable[[str], bool] | None = None,
    **kwargs: object,
) -> _Model:
    """``load(path, **kwargs)`` without transformers' weights bar and its needless report.

    Args:
        load: a ``from_pretrained`` (``AutoModel.from_pretrained``, ...).
        path: the model folder or Hub id.
        unused_ok: checkpoint keys the caller leaves out on purpose (True: not worth a report).
        **kwargs: passed to ``load``.

    Returns:
        The model (of the type ``load`` declares).
    """
    from transformers.utils import logging as hf_logging

    report_logger = logging.getLogger(_REPORT_LOGGER)
    held = _HeldReports()
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    report_logger.addFilter(held)
    failed = True
    try:
        # output_loading_info=True: (model, {"missing_keys": [...], "unexpected_keys": [...], ...})
        model, info = cast(
            "tuple[_Model, dict[str, list[str]]]",
            load(path, output_loading_info=True, **kwargs),
        )
        failed = False
    finally:
        report_logger.removeFilter(held)
        if bar_was_on:
            hf_logging.enable_progress_bar()
        if failed:  # the report explains the error
            _release(report_logger, held)
    unused = [k for k in info["unexpected_keys"] if unused_ok is None or not unused_ok(k)]
    if info["missing_keys"] or info["mismatched_keys"] or unused:
        _release(report_logger, held)
    return model


def _release(report_logger: logging.Logger, held: _HeldReports) -> None:
    for record in held.records:
        report_logger.handle(record)
    held.records.clear()
