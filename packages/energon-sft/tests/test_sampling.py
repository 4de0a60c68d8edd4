"""`first_samples`: the start of a prepared dataset without a loader, in the loader's order."""

from __future__ import annotations

import json
from pathlib import Path

from _esft_data import ONE_RANK_IN_ORDER, build_dataset, build_processor, chat_rows
from energon_sft import SFTTaskEncoder, build_sft_loader, first_samples


def test_first_samples_are_the_unshuffled_loaders_first_rows_with_their_media(
    tmp_path: Path,
) -> None:
    rows = chat_rows(12, image_every=3)
    rows.insert(5, {"id": "broken"})  # no messages: rejected by the cooker, counted
    ds = build_dataset(tmp_path, rows, samples_per_shard=4)
    got = first_samples(ds, limit=7)
    assert [s.source_id for s in got.samples] == [f"row-{i}" for i in range(7)]
    assert got.rejected == 1
    assert [len(s.media) for s in got.samples] == [1, 0, 0, 1, 0, 0, 1]
    # The loader (in order, one rank) gives the same rows, encoded alike.
    enc = SFTTaskEncoder(build_processor(), model_family="qwen2_5_vl", max_length=512)
    loader = build_sft_loader(
        ds, encoder=enc, batch_size=1, virtual_epoch_length=3, **ONE_RANK_IN_ORDER
    )
    for sample, batch in zip(got.samples, loader, strict=False):
        assert batch.source_ids == [sample.source_id]
        assert enc.encode_chat(sample).input_ids.tolist() == batch.input_ids[0].tolist()


def test_first_samples_of_a_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    rows = chat_rows(4, image_every=0)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = first_samples(path, limit=10)
    assert [s.source_id for s in got.samples] == [r["id"] for r in rows]
    assert got.samples[0].messages == rows[0]["messages"]
