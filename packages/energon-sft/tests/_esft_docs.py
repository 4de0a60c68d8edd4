"""Hand-made encoded documents and packed rows for the batch-contract tests (no dataset)."""

from __future__ import annotations

import torch

from energon_sft import IGNORE_INDEX, EncodedSample
from energon_sft.batch import pack_samples


def hand_made_doc(
    n: int,
    *,
    first_id: int,
    mrope: list[list[int]] | None = None,
    untrained_prompt: bool = False,
) -> EncodedSample:
    """One document of ``n`` tokens (ids first_id, first_id+1, ...) with shifted labels.

    Args:
        n: the document's length.
        first_id: its first token id (distinct per document, so tests can tell them apart).
        mrope: its [3, n] M-RoPE position ids, or None for a text-only model.
        untrained_prompt: also ignore the first label (a one-token prompt without loss).

    Returns:
        An unpacked sample: input_ids/labels/position_ids [n], one document, weight 1.
    """
    ids = torch.arange(first_id, first_id + n)
    labels = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])
    if untrained_prompt:
        labels[0] = IGNORE_INDEX
    return EncodedSample(
        __key__=f"d{first_id}",
        __restore_key__=(),
        input_ids=ids,
        labels=labels,
        position_ids=torch.arange(n),
        image_mask=torch.zeros(n, dtype=torch.bool),
        mrope_position_ids=torch.tensor(mrope) if mrope is not None else None,
        pixel_values=None,
        image_grid_thw=torch.zeros((0, 3), dtype=torch.int64),
        seq_lens=[n],
        sample_weights=[1.0],
        source_ids=[f"s{first_id}"],
    )


def packed_row(*docs: EncodedSample) -> EncodedSample:
    """The documents packed into one row, as the loader's packer forms it."""
    return EncodedSample.derive_from(docs[0], __restore_key__=(), **pack_samples(docs))
