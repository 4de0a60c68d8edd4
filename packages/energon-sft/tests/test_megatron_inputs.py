"""energon-sft batches as megatron-core GPTModel inputs: every packed document is one cu_seqlens
segment of the flat [1, B * S] row, with its own tokens, shifted labels and loss mask."""

from __future__ import annotations

import itertools

import pytest
import torch

from _esft_docs import hand_made_doc, packed_row
from energon_sft import IGNORE_INDEX, to_megatron_inputs
from energon_sft.batch import collate


def test_packed_batch_becomes_one_thd_row_with_one_segment_per_document() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [[int(n) for n in torch.randint(2, 9, (3,), generator=gen)], [5], [4, 6]]
    docs = [
        [
            hand_made_doc(n, first_id=100 * r + 10 * i, untrained_prompt=True)
            for i, n in enumerate(row)
        ]
        for r, row in enumerate(lengths)
    ]
    batch = collate(
        [packed_row(*row) for row in docs], pad_token_id=0, pad_to_multiple_of=8, qkv_format="thd"
    )
    inputs = to_megatron_inputs(batch)
    rows, seq = batch["input_ids"].shape
    assert inputs.qkv_format == "thd"
    assert inputs.tokens.shape == inputs.labels.shape == inputs.loss_mask.shape == (1, rows * seq)
    assert inputs.loss_mask.dtype == torch.float32
    cu = inputs.cu_seqlens.tolist()
    assert inputs.cu_seqlens.dtype == torch.int32
    # Walk the segments: each document in order, then the row's padding as a segment of its own.
    k = 0
    for row in docs:
        for doc in row:
            lo, hi = cu[k], cu[k + 1]
            assert inputs.tokens[0, lo:hi].tolist() == doc.input_ids.tolist()
            assert inputs.labels[0, lo:hi].tolist() == doc.labels.tolist()
            assert (
                inputs.loss_mask[0, lo:hi].tolist() == (doc.labels != IGNORE_INDEX).float().tolist()
            )
            assert inputs.position_ids[0, lo:hi].tolist() == list(range(hi - lo))
            k += 1
        if sum(d.input_ids.numel() for d in row) < seq:  # trailing padding: no loss at all
            lo, hi = cu[k], cu[k + 1]
            assert inputs.loss_mask[0, lo:hi].sum() == 0
            k += 1
    assert k == len(cu) - 1 and cu[-1] == rows * seq
    assert inputs.max_seqlen == max(b - a for a, b in itertools.pairwise(cu))

    params = inputs.packed_seq_params()
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q is inputs.cu_seqlens and params.cu_seqlens_kv is inputs.cu_seqlens
    assert params.max_seqlen_q == params.max_seqlen_kv == inputs.max_seqlen
    moved = inputs.to("cpu")
    assert (
        torch.equal(moved.cu_seqlens, inputs.cu_seqlens) and moved.max_seqlen == inputs.max_seqlen
    )


def test_unpacked_batch_keeps_rows_and_needs_no_packed_params() -> None:
    batch = collate(
        [
            hand_made_doc(3, first_id=1, untrained_prompt=True),
            hand_made_doc(6, first_id=20, untrained_prompt=True),
        ],
        pad_token_id=0,
        pad_to_multiple_of=4,
    )
    inputs = to_megatron_inputs(batch)
    assert inputs.qkv_format == "sbhd" and inputs.packed_seq_params() is None
    assert torch.equal(inputs.tokens, batch["input_ids"])
    assert torch.equal(inputs.labels, batch["labels"])
    assert torch.equal(inputs.loss_mask, batch["loss_mask"])
    assert inputs.cu_seqlens is None and inputs.max_seqlen is None


def test_images_and_broken_offsets_are_refused() -> None:
    batch = collate(
        [
            packed_row(
                hand_made_doc(3, first_id=1, untrained_prompt=True),
                hand_made_doc(2, first_id=9, untrained_prompt=True),
            )
        ],
        pad_token_id=0,
        pad_to_multiple_of=4,
        qkv_format="thd",
    )
    with pytest.raises(ValueError, match="text-only"):
        to_megatron_inputs({**batch, "pixel_values": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match="must run from 0"):
        to_megatron_inputs({**batch, "cu_seqlens": torch.tensor([0, 3, 5], dtype=torch.int32)})
    with pytest.raises(KeyError, match="cu_seqlens"):
        to_megatron_inputs({k: v for k, v in batch.items() if k != "cu_seqlens"})
