"""Damaged shard files of a prepared dataset: one error naming the file and the command that
rebuilds it, when the loader is built, when a read fails in a loader worker, and from the
`energon-sft` command line (before the tokenizer loads); the `energon prepare` command it names
repairs the index."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest

from _esft_data import ONE_RANK_IN_ORDER, build_dataset, chat_rows
from energon_sft import SFTTaskEncoder, ShardFileError, build_sft_loader, check_shard_files
from energon_sft.cli import main


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 text chats in 2 shards of 12, through real `energon prepare`."""
    return build_dataset(
        tmp_path_factory.mktemp("shards"), chat_rows(24, image_every=0), samples_per_shard=12
    )


def _copy(prepared: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "ds"))


def _loader(ds: Path, tok: object, **kw: object) -> object:
    encoder = SFTTaskEncoder(tok, model_family="text", max_length=256)
    return build_sft_loader(ds, encoder=encoder, batch_size=2, **{**ONE_RANK_IN_ORDER, **kw})


def _assert_names_index_and_fix(message: str, index: Path, ds: Path) -> None:
    assert "\n" not in message, message
    assert message.startswith(f"{index}: truncated"), message
    assert f"energon prepare --tar-index-only --non-interactive {ds}" in message, message
    assert "energon-sft convert --overwrite" in message, message


def test_truncated_index_is_named_when_the_loader_is_built(
    prepared: Path, tmp_path: Path, tok: object
) -> None:
    ds = _copy(prepared, tmp_path)
    index = ds / "chat-000001.tar.idx"
    index.write_bytes(index.read_bytes()[:52])  # 6.5 of 13 offsets
    with pytest.raises(ShardFileError) as err:
        _loader(ds, tok)
    _assert_names_index_and_fix(str(err.value), index, ds)
    assert "52 bytes where 12 samples need 104" in str(err.value)
    # A metadataset naming the folder is followed to it.
    meta = tmp_path / "blend.yaml"
    meta.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
        "    blend:\n      - weight: 1\n        path: ds\n"
    )
    with pytest.raises(ShardFileError, match=r"chat-000001\.tar\.idx: truncated"):
        check_shard_files(meta)


@pytest.mark.timeout(180)
def test_index_damaged_after_the_start_is_named_from_a_worker_and_prepare_repairs_it(
    prepared: Path, tmp_path: Path, tok: object, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = _copy(prepared, tmp_path)
    index = ds / "chat-000000.tar.idx"
    good = index.read_bytes()
    loader = _loader(ds, tok, num_workers=1)  # sound when built: the worker reads it later
    index.write_bytes(good[:52])
    try:
        with pytest.raises(ShardFileError) as err:
            for _ in loader:  # type: ignore[attr-defined]
                pass
    finally:
        loader.close()  # type: ignore[attr-defined]
    message = str(err.value)
    _assert_names_index_and_fix(message, index, ds)
    assert "reading it failed with" in message and "Traceback" not in message, message

    # The command line: one line, no traceback, before the tokenizer loads (there is none).
    no_tok = str(tmp_path / "no-tokenizer")
    args = ["inspect", str(ds), "--tokenizer", no_tok, "--model-family", "text", "-n", "1"]
    assert main(args) == 1
    out = capsys.readouterr().err
    assert out.count("\n") == 1 and out.startswith("energon-sft inspect: error: ")
    _assert_names_index_and_fix(out.split("error: ", 1)[1].strip(), index, ds)

    # The fix the message names rebuilds the index (the shards are kept).
    from click.testing import CliRunner
    from megatron.energon.cli.main import main as energon_main

    quoted = message.split("`energon prepare ", 1)[1].split("`", 1)[0]
    result = CliRunner().invoke(energon_main, ["prepare", *shlex.split(quoted)])
    assert result.exit_code == 0, result.output[-2000:]
    assert index.read_bytes() == good
    check_shard_files(ds, deep=True)


def test_missing_shard_is_named(prepared: Path, tmp_path: Path) -> None:
    ds = _copy(prepared, tmp_path)
    (ds / "chat-000001.tar").unlink()
    with pytest.raises(ShardFileError) as err:
        check_shard_files(ds)
    message = str(err.value)
    assert message.startswith(f"{ds / 'chat-000001.tar'}: missing"), message
    assert "energon-sft convert --overwrite" in message and "--tar-index-only" not in message, (
        message
    )
    check_shard_files(prepared, deep=True)  # the sound dataset passes
