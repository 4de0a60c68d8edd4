"""The model-ready batch contract: document lengths per row and flat, padding as its own segment,
the THD marker, M-RoPE ids built in the loader workers, and errors that name the fix."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from _esft_data import (
    ONE_RANK_IN_ORDER,
    build_dataset,
    build_processor,
    build_tokenizer,
    chat_rows,
    chat_sample,
    png_bytes,
)
from _esft_docs import hand_made_doc, packed_row
from energon_sft import (
    SFTTaskEncoder,
    build_sft_loader,
    mrope_position_ids,
)
from energon_sft.batch import collate, greedy_pack


def test_packed_rows_give_per_row_documents_flat_segments_and_padding_apart() -> None:
    # Row 0: documents of 3 and 2 tokens; row 1: one document of 4. Padded to a multiple of 4:
    # S = 8, so row 0 ends in 3 padding tokens and row 1 in 4.
    rows = [
        packed_row(hand_made_doc(3, first_id=10), hand_made_doc(2, first_id=20)),
        hand_made_doc(4, first_id=30),
    ]
    out = collate(rows, pad_token_id=0, pad_to_multiple_of=4, qkv_format="thd")
    assert out["qkv_format"] == "thd"
    assert out["input_ids"].shape == (2, 8)
    assert out["seq_lens"].tolist() == [[3, 2], [4, -1]]
    assert out["seq_lens"].dtype == torch.int32
    assert out["segment_lengths"].tolist() == [3, 2, 3, 4, 4]
    assert out["segment_is_padding"].tolist() == [False, False, True, False, True]
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 8, 12, 16]
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["max_seqlen"] == 4
    # Padding continues the last document's positions: no restart (0) where no document is.
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert out["attention_mask"].tolist() == [[True] * 5 + [False] * 3, [True] * 4 + [False] * 4]
    assert out["input_ids"][0].tolist() == [10, 11, 12, 20, 21, 0, 0, 0]
    assert out["labels"][0].tolist() == [11, 12, -100, 21, -100, -100, -100, -100]
    assert out["mrope_position_ids"] is None
    # One document per row: the same fields, marked bshd.
    single = collate([hand_made_doc(3, first_id=1)], pad_token_id=0, pad_to_multiple_of=4)
    assert single["qkv_format"] == "bshd"
    assert single["seq_lens"].tolist() == [[3]]
    assert single["segment_lengths"].tolist() == [3, 1]
    assert single["max_seqlen"] == 3


def test_mrope_ids_are_packed_per_document_and_padding_continues() -> None:
    first = hand_made_doc(3, first_id=10, mrope=[[0, 1, 4], [0, 2, 4], [0, 3, 4]])
    second = hand_made_doc(2, first_id=20, mrope=[[0, 1], [0, 1], [0, 1]])
    out = collate(
        [packed_row(first, second)], pad_token_id=0, pad_to_multiple_of=8, qkv_format="thd"
    )
    got = out["mrope_position_ids"]
    assert got.shape == (3, 1, 8)
    # Each axis continues from its own last value over the 3 padding tokens.
    assert got[:, 0].tolist() == [
        [0, 1, 4, 0, 1, 2, 3, 4],
        [0, 2, 4, 0, 1, 2, 3, 4],
        [0, 3, 4, 0, 1, 2, 3, 4],
    ]


def test_inconsistent_rows_raise_with_the_fix() -> None:
    with pytest.raises(ValueError, match="M-RoPE family or for none"):
        collate(
            [hand_made_doc(2, first_id=1, mrope=[[0, 1]] * 3), hand_made_doc(2, first_id=5)],
            pad_token_id=0,
            pad_to_multiple_of=1,
        )
    bad = hand_made_doc(3, first_id=1)
    bad.seq_lens = [2]
    with pytest.raises(ValueError, match=r"row 0 has 3 tokens but .* \[2\]"):
        collate([bad], pad_token_id=0, pad_to_multiple_of=1)
    with pytest.raises(ValueError, match="qkv_format"):
        collate(
            [hand_made_doc(2, first_id=1)], pad_token_id=0, pad_to_multiple_of=1, qkv_format="sbhd"
        )
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens.*capacity 8.*max_length to >= 9"):
        greedy_pack([3, 9], 8)


def _long_chat(key: str) -> Any:
    return chat_sample(
        [
            {"role": "user", "content": "Hello! How are you?"},
            {"role": "assistant", "content": "I am fine, thank you. " * 4},
        ],
        key=key,
    )


def test_overlong_document_is_reported_once_with_its_length_and_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tok = build_tokenizer()
    enc = SFTTaskEncoder(tok, model_family="text", max_length=12)
    with caplog.at_level(logging.WARNING, logger="energon_sft"):
        outs = [enc.encode_chat(_long_chat(f"long-{i}")) for i in range(5)]
    assert all(o.input_ids.numel() == 12 and o.sample_weights == [0.0] for o in outs)
    # Counted five times, logged once (a dataset of long rows is one line, not one per row).
    assert enc.error_handler.snapshot() == {"truncated": 5}
    assert len(caplog.records) == 1
    message = caplog.text
    full = SFTTaskEncoder(tok, model_family="text", max_length=512)
    n = len(full.encode_chat(_long_chat("x")).input_ids)
    assert f"{n} tokens > max_length=12" in message
    assert f"raise max_length to >= {n}" in message and "overlong='skip'" in message
    # A text-only row has no image to expand and no media to strip.
    assert "image" not in message and "media" not in message


def test_overlong_skip_drops_without_budget_and_error_stops_naming_the_row() -> None:
    from megatron.energon import SkipSample

    from energon_sft import OverlongSampleError

    tok = build_tokenizer()
    skip = SFTTaskEncoder(tok, model_family="text", max_length=12, overlong="skip")
    for i in range(3):
        with pytest.raises(SkipSample):
            skip.encode_chat(_long_chat(f"long-{i}"))
    assert skip.error_handler.snapshot() == {"skipped/overlong": 3}
    assert skip.error_handler.skipped == 0  # the failure budget is for broken rows
    error = SFTTaskEncoder(tok, model_family="text", max_length=12, overlong="error")
    with pytest.raises(OverlongSampleError, match=r"long-7.*tokens > max_length=12"):
        error.encode_chat(_long_chat("long-7"))


def test_truncated_vlm_sample_gets_text_mrope_ids() -> None:
    proc = build_processor()
    enc = SFTTaskEncoder(proc, model_family="qwen2_5_vl", max_length=20)
    sample = chat_sample(
        [
            {"role": "user", "content": [{"type": "image", "media_index": 0}]},
            {"role": "assistant", "content": "I am fine, thank you. " * 4},
        ],
        [png_bytes(300, 200, 0)],
        key="long",
    )
    out = enc.encode_chat(sample)
    assert out.mrope_position_ids is not None
    assert torch.equal(out.mrope_position_ids, torch.arange(20).expand(3, 20))


@pytest.mark.parametrize("packing", [False, True])
def test_worker_mrope_ids_equal_the_host_computation(tmp_path: Path, packing: bool) -> None:
    """The ids that arrive with the batch (built in one loader worker process) equal what the
    training loop used to compute on the host from the collated batch; no pin_memory warning
    on a CPU-only machine."""
    proc = build_processor()
    ds = build_dataset(tmp_path, chat_rows(12, image_every=2))
    enc = SFTTaskEncoder(
        proc,
        model_family="qwen2_5_vl",
        max_length=256,
        pad_to_multiple_of=8,
        packing_buffer_size=6 if packing else None,
    )
    # One loader worker process: the ids are built there, not on the host.
    loader = build_sft_loader(
        ds, encoder=enc, batch_size=2, **{**ONE_RANK_IN_ORDER, "num_workers": 1}
    )
    with loader, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = next(iter(loader))
    assert not [w for w in caught if "pin_memory" in str(w.message)], [str(w) for w in caught]
    assert batch.qkv_format == ("thd" if packing else "bshd")
    assert batch.image_mask.any(), "no image in the batch: the comparison would be vacuous"
    if packing:
        assert (batch.seq_lens >= 0).sum() > batch.input_ids.shape[0], "rows are not packed"
    ours = batch.mrope_position_ids
    assert ours is not None and ours.shape == (3, *batch.input_ids.shape)
    # The old host path: position ids 0 on padding, ids from the collated rows.
    real = batch.attention_mask
    old_positions = torch.where(real, batch.position_ids, 0)
    host = mrope_position_ids(
        old_positions, batch.image_mask, batch.image_grid_thw, spatial_merge_size=2
    )
    assert torch.equal(ours[:, real], host[:, real])
    # With the new (continuing) padding positions the host function agrees everywhere.
    host_new = mrope_position_ids(
        batch.position_ids, batch.image_mask, batch.image_grid_thw, spatial_merge_size=2
    )
    assert torch.equal(ours, host_new)
    # Teeth: after an image the M-RoPE ids differ from the 1-D ids.
    assert not torch.equal(ours[0][real], batch.position_ids[real])


def test_image_tokens_that_do_not_match_the_images_are_refused_with_the_fix() -> None:
    from energon_sft import BadSampleError

    proc = build_processor()
    enc = SFTTaskEncoder(proc, model_family="qwen2_5_vl", max_length=256)
    literal = chat_sample(
        [
            {"role": "user", "content": "What is <|image_pad|> here?"},
            {"role": "assistant", "content": "Nothing."},
        ],
        key="lit",
    )
    with pytest.raises(BadSampleError, match=r"more image placeholders than the 0 image\(s\)"):
        enc.encode_chat(literal)
    with pytest.raises(BadSampleError, match="remove it from the text"):
        enc.encode_chat(literal)
    # Grids that do not fill the image tokens (a collated batch built elsewhere): the M-RoPE
    # builder names the image, its grid and the tokens left.
    with pytest.raises(ValueError, match=r"image 0 \(grid \(1, 4, 4\), merge 2\) has 4 tokens"):
        mrope_position_ids(
            torch.arange(6)[None],
            torch.tensor([[False, True, True, True, False, False]]),
            torch.tensor([[1, 4, 4]]),
            spatial_merge_size=2,
        )
