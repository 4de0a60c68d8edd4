"""Cookers (stateless, subflavor routing, JSONL) and batching: padding, packing, cu_seqlens."""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.energon import Cooker, stateless
from megatron.energon.task_encoder.base import get_stateless

from _esft_data import (
    ONE_RANK_IN_ORDER,
    build_dataset,
    chat_rows,
    image_chat_row,
    image_question,
    png_bytes,
)
from energon_sft import (
    IGNORE_INDEX,
    SFTTaskEncoder,
    build_sft_loader,
    check_cookers,
    cook_chat,
    cook_sharegpt,
    make_stateless_cooker,
    write_chat_shards,
)
from energon_sft.batch import greedy_pack
from energon_sft.dataset import prepare_dataset


def _crude(row: dict[str, Any], **members: bytes) -> dict[str, Any]:
    return {
        "__key__": "k",
        "__restore_key__": ("x", 0),
        "json": json.dumps(row).encode(),
        **members,
    }


def test_cookers_are_stateless_and_partial_is_rejected() -> None:
    assert get_stateless(cook_chat) and get_stateless(cook_sharegpt)

    @stateless
    def with_option(crude: dict[str, Any], *, prefix: str, **aux: Any) -> Any:
        sample = cook_chat(crude)
        sample.source_id = prefix + sample.source_id
        return sample

    bad = Cooker(functools.partial(with_option, prefix="x-"))
    assert not get_stateless(bad.cook)  # the trap: partial drops the mark
    with pytest.raises(ValueError, match=r"not @stateless \(functools.partial drops the mark"):
        check_cookers([bad])
    good = Cooker(make_stateless_cooker(with_option, prefix="x-"))
    check_cookers([good])
    row = {
        "id": "r",
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    }
    assert good.cook(_crude(row)).source_id == "x-r"
    with pytest.raises(ValueError, match="no subflavor filter but is not last"):
        check_cookers([Cooker(cook_chat), Cooker(cook_sharegpt, has_subflavors={"a": 1})])


def test_cook_chat_exact_member_lookup_and_sharegpt() -> None:
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "media_index": 1}]},
            {"role": "assistant", "content": "b"},
        ],
        "media": ["m0.png", {"member": "m1.png"}],
    }
    s = cook_chat(_crude(row, **{"m0.png": b"zero", "m1.png": b"one", "xm1.png": b"decoy"}))
    assert [m.data for m in s.media] == [b"zero", b"one"]
    assert s.source_id == "k" and s.__restore_key__ == ("x", 0)
    from energon_sft import BadSampleError

    with pytest.raises(BadSampleError, match="missing_media"):
        cook_chat(_crude({**row, "media": ["m1.jpg"]}, **{"xm1.jpg": b"decoy"}))
    share = {
        "conversations": [
            {"from": "human", "value": "<image>What is this?"},
            {"from": "gpt", "value": "A cat."},
        ],
        "images": ["m0.png"],
    }
    s = cook_sharegpt(_crude(share, **{"m0.png": b"img"}))
    assert s.messages == [
        {"role": "user", "content": image_question("What is this?")},
        {"role": "assistant", "content": "A cat."},
    ]


def test_subflavor_routes_sharegpt_rows_and_jsonl_rows_load(tok: Any, tmp_path: Path) -> None:
    rows = [
        {
            "id": f"s{i}",
            "conversations": [
                {"from": "human", "value": f"Hello {i}"},
                {"from": "gpt", "value": f"Answer {i}."},
            ],
        }
        for i in range(8)
    ]
    write_chat_shards(rows, tmp_path / "share", samples_per_shard=4)
    ds = prepare_dataset(tmp_path / "share")
    enc = SFTTaskEncoder(tok, model_family="text", max_length=128)
    common: dict[str, Any] = dict(encoder=enc, batch_size=4, **ONE_RANK_IN_ORDER)
    batch = next(iter(build_sft_loader(ds, subflavors={"sft_format": "sharegpt"}, **common)))
    assert batch.source_ids == ["s0", "s1", "s2", "s3"]
    targets = [t for t in batch.labels[0].tolist() if t != IGNORE_INDEX]
    assert tok.decode(targets) == "Answer 0.<|im_end|>\n"
    # JSONL: rows arrive as dicts; media inline as base64.
    img = base64.b64encode(png_bytes(28, 28, 1)).decode()
    jsonl = tmp_path / "rows.jsonl"
    media = {"b64": img, "name": "inline.png"}
    lines = [json.dumps(image_chat_row(f"j{i}", "Hi", f"Answer {i}.", media)) for i in range(4)]
    jsonl.write_text("\n".join(lines) + "\n")
    prepare_dataset(jsonl)
    from _esft_data import build_processor

    venc = SFTTaskEncoder(build_processor(tok), model_family="qwen2_5_vl", max_length=256)
    batch = next(iter(build_sft_loader(jsonl, **{**common, "encoder": venc})))
    assert batch.source_ids == ["j0", "j1", "j2", "j3"]
    assert batch.image_grid_thw.tolist() == [[1, 4, 4]] * 4  # 28x28 -> min_pixels 56x56


def test_padding_to_multiple_and_packing_through_the_loader(tok: Any, tmp_path: Path) -> None:
    ds = build_dataset(tmp_path, chat_rows(16, image_every=0))
    plain = SFTTaskEncoder(tok, model_family="text", max_length=128, pad_to_multiple_of=8)
    b = next(iter(build_sft_loader(ds, encoder=plain, batch_size=4, **ONE_RANK_IN_ORDER)))
    assert b.input_ids.shape[1] % 8 == 0
    lens = b.attention_mask.sum(1)
    assert b.input_ids.shape[1] - int(lens.max()) < 8
    for r in range(4):
        n = int(lens[r])
        assert bool((b.input_ids[r, n:] == plain.pad_token_id).all())
        assert bool((b.labels[r, n - 1 :] == IGNORE_INDEX).all())
    assert b.cu_seqlens[-1].item() == b.input_ids.numel()
    hf = b.hf_labels()  # unshifted: the trained token itself, at its own position
    trained = hf != IGNORE_INDEX
    assert torch.equal(hf[trained], b.input_ids[trained])
    assert int(trained.sum()) == b.num_trainable_tokens == int(b.loss_mask.sum())
    singles = {sid: row for sid, row in zip(b.source_ids, b.input_ids, strict=True)}

    packer = SFTTaskEncoder(
        tok, model_family="text", max_length=256, pad_to_multiple_of=8, packing_buffer_size=8
    )
    pb = next(iter(build_sft_loader(ds, encoder=packer, batch_size=1, **ONE_RANK_IN_ORDER)))
    assert pb.input_ids.shape[0] == 1 and pb.input_ids.shape[1] <= 256
    parts = pb.segment_lengths.tolist()
    real = parts if int(pb.attention_mask.sum()) == sum(parts) else parts[:-1]
    assert len(real) == len(pb.source_ids) >= 2
    assert pb.qkv_format == "thd" and b.qkv_format == "bshd"
    assert pb.seq_lens.tolist() == [real]  # per row, padding not listed
    assert sum(real) == int(pb.attention_mask.sum())
    start = 0
    for sid, n in zip(pb.source_ids, real, strict=True):
        assert pb.position_ids[0, start : start + n].tolist() == list(range(n))
        # No target crosses into the next part.
        assert pb.labels[0, start + n - 1].item() == IGNORE_INDEX
        if sid in singles:
            ref = singles[sid]
            ref = ref[ref != plain.pad_token_id]
            assert torch.equal(pb.input_ids[0, start : start + n], ref)
        start += n
    assert pb.cu_seqlens.tolist() == [0, *torch.tensor(parts).cumsum(0).tolist()]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(50, 120))
def test_greedy_pack_is_a_partition_within_capacity(lengths: list[int], capacity: int) -> None:
    bins = greedy_pack(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # First-fit decreasing never leaves two bins that could be merged.
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > capacity
