"""Bad data: every kind is skipped and counted within the tolerance, with a log line naming the
sample; above the tolerance the run stops with one clear error."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from _esft_data import ONE_RANK_IN_ORDER, build_processor, image_chat_row, png_bytes
from energon_sft import SFTTaskEncoder, TooManyBadSamplesError, build_sft_loader, write_chat_shards
from energon_sft.dataset import prepare_dataset


def _good(i: int) -> dict[str, Any]:
    return image_chat_row(f"good-{i}", "What is in the picture?", f"A red square {i}.", "ok.png")


BAD = {
    "corrupt_media": {**_good(0), "id": "bad-corrupt", "media": ["corrupt.png"]},
    "missing_field": {"id": "bad-missing", "media": []},
    "unknown_role": {
        "id": "bad-role",
        "messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "ok"}],
    },
    "media_index_out_of_range": {
        **_good(0),
        "id": "bad-index",
        "messages": [
            {"role": "user", "content": [{"type": "image", "media_index": 3}]},
            {"role": "assistant", "content": "ok"},
        ],
    },
    "overlong": {
        **_good(0),
        "id": "bad-long",
        "messages": [
            {"role": "user", "content": "Tell me a joke."},
            {"role": "assistant", "content": "Hello! How are you? " * 40},
        ],
        "media": [],
    },
}


@pytest.fixture(scope="module")
def bad_ds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], dict[str, str]]:
    root = tmp_path_factory.mktemp("bad")
    (root / "ok.png").write_bytes(png_bytes(56, 56, 0))
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    rows: list[dict[str, Any]] = []
    bad_keys = {}
    for j, (reason, row) in enumerate(BAD.items()):
        rows.append(_good(j))
        bad_keys[reason] = f"{len(rows):09d}"
        rows.append(row)
    rows.append(_good(len(BAD)))
    write_chat_shards(rows, root / "ds", media_root=root, samples_per_shard=4)
    good = [r["id"] for r in rows if r["id"].startswith("good")]
    return prepare_dataset(root / "ds"), good, bad_keys


def _loader(ds: Path, tolerance: int, n_batches: int) -> Any:
    enc = SFTTaskEncoder(
        build_processor(),
        model_family="qwen2_5_vl",
        max_length=120,
        overlong="skip",
        failure_tolerance=tolerance,
    )
    return build_sft_loader(
        ds, encoder=enc, batch_size=1, virtual_epoch_length=n_batches, **ONE_RANK_IN_ORDER
    )


def test_each_bad_sample_is_skipped_counted_and_named(
    bad_ds: tuple[Path, list[str], dict[str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    ds, good, bad_keys = bad_ds
    loader = _loader(ds, tolerance=len(BAD), n_batches=len(good))
    with caplog.at_level(logging.WARNING, logger="energon_sft"):
        seen = [sid for b in loader for sid in b.source_ids]
    assert seen == good
    stats = loader.data_stats()
    assert stats == {f"skipped/{reason}": 1 for reason in BAD}
    for reason, key in bad_keys.items():
        lines = [r.getMessage() for r in caplog.records if f"sample {key}" in r.getMessage()]
        assert len(lines) == 1 and reason in lines[0], (reason, key, lines)


def test_more_bad_samples_than_the_tolerance_is_fatal(
    bad_ds: tuple[Path, list[str], dict[str, str]],
) -> None:
    ds, good, bad_keys = bad_ds
    loader = _loader(ds, tolerance=3, n_batches=len(good))
    fourth = list(bad_keys.values())[3]
    with pytest.raises(
        TooManyBadSamplesError, match=rf"exceed failure_tolerance=3; the last was {fourth}"
    ):
        for _ in loader:
            pass


def test_failure_tolerance_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="failure_tolerance=0 must be >= 1"):
        SFTTaskEncoder(
            build_processor(), model_family="qwen2_5_vl", max_length=64, failure_tolerance=0
        )
