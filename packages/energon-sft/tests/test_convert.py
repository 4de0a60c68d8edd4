"""`energon-sft convert`: every row validated, ShareGPT / Alpaca mapped, counts and limits.

The expected `messages` of each mapped row are written out by hand here (not computed with the
mapping under test); the written dataset is read back through the loader and compared with the
encoder's output for those hand-written messages.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from _esft_data import ONE_RANK_IN_ORDER, build_processor, chat_sample, image_question, png_bytes
from energon_sft import SFTTaskEncoder, build_sft_loader
from energon_sft.cli import main
from energon_sft.schema import ChatSample


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    """One row per line; a row given as a str is written verbatim (bad JSON, blank lines)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _convert(
    capsys: pytest.CaptureFixture[str], *args: str | Path
) -> tuple[int, list[str], list[str]]:
    rc = main(["convert", "--no-progress", *map(str, args)])
    cap = capsys.readouterr()
    return rc, cap.out.splitlines(), cap.err.splitlines()


def _tar_rows(ds: Path) -> list[dict[str, Any]]:
    """The `.json` members of every shard, in key order."""
    rows: dict[str, dict[str, Any]] = {}
    for shard in sorted(ds.glob("chat-*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    data = tar.extractfile(member)
                    assert data is not None
                    rows[member.name] = json.loads(data.read())
    return [rows[k] for k in sorted(rows)]


def _loaded(ds: Path, enc: SFTTaskEncoder) -> list[Any]:
    """Every sample of the dataset through the loader, in order (batch size 1)."""
    n = len(_tar_rows(ds))
    batches = []
    with build_sft_loader(ds, encoder=enc, batch_size=1, **ONE_RANK_IN_ORDER) as loader:
        for batch in loader:
            batches.append(batch)
            if len(batches) == n:
                break
    return batches


def _assert_batch_encodes(batch: Any, enc: SFTTaskEncoder, sample: ChatSample) -> None:
    """The loaded batch (batch size 1, no padding) equals the encoder on `sample`."""
    want = enc.encode_chat(sample)
    assert torch.equal(batch.input_ids[0], want.input_ids)
    assert torch.equal(batch.labels[0], want.labels)
    assert torch.equal(batch.image_grid_thw, want.image_grid_thw)
    if want.pixel_values is None:
        assert batch.pixel_values is None or batch.pixel_values.numel() == 0
    else:
        assert torch.equal(batch.pixel_values, want.pixel_values)


SHAREGPT = [
    {
        "id": "sg-0",
        "conversations": [
            {"from": "system", "value": "You are a helpful assistant."},
            {"from": "human", "value": "<image>What is in the picture?"},
            {"from": "gpt", "value": "A red square."},
        ],
        "images": ["a.png"],
    },
    {
        "id": "sg-1",
        "conversations": [
            {"from": "human", "value": "Hello! How are you?"},
            {"from": "gpt", "value": "I am fine, thank you."},
            {"from": "human", "value": "Tell me a joke."},
            {"from": "gpt", "value": "The weather in Paris is sunny."},
        ],
    },
]

# The same conversations written by hand in the canonical form.
SHAREGPT_AS_MESSAGES = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": image_question("What is in the picture?")},
        {"role": "assistant", "content": "A red square."},
    ],
    [
        {"role": "user", "content": "Hello! How are you?"},
        {"role": "assistant", "content": "I am fine, thank you."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "The weather in Paris is sunny."},
    ],
]


ALPACA = [
    {"instruction": "Add the numbers.", "input": "12 + 30", "output": "42"},
    {"instruction": "Say hello.", "input": "", "output": "Hello!", "system": "Be brief."},
    {"id": "al-2", "instruction": "Name a city.", "output": "Paris"},
]
ALPACA_AS_MESSAGES = [
    [
        {"role": "user", "content": "Add the numbers.\n\n12 + 30"},
        {"role": "assistant", "content": "42"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello!"},
    ],
    [
        {"role": "user", "content": "Name a city."},
        {"role": "assistant", "content": "Paris"},
    ],
]


@dataclass(frozen=True, kw_only=True)
class _OtherFormat:
    """A JSONL file of another format: what convert writes for it and how it loads back.

    Attributes:
        rows: the input rows.
        written: the rows convert writes (hand-written canonical messages, media renamed).
        source_ids: the loaded samples' ids (a row without an id is named by its Energon key,
            as the loader names it).
        files: media files beside the JSONL.
        images: the images of each row, in order.
        family: the model family that encodes the rows.
        first_target: the trained text of the first row.
    """

    rows: list[dict[str, Any]]
    written: list[dict[str, Any]]
    source_ids: list[str]
    files: dict[str, bytes] = field(default_factory=dict)
    images: list[list[bytes]]
    family: str
    first_target: str


_IMAGE = png_bytes(56, 84, 3)
OTHER_FORMATS = {
    "sharegpt": _OtherFormat(
        rows=SHAREGPT,
        written=[
            {"id": "sg-0", "messages": SHAREGPT_AS_MESSAGES[0], "media": ["m0.png"]},
            {"id": "sg-1", "messages": SHAREGPT_AS_MESSAGES[1]},
        ],
        source_ids=["sg-0", "sg-1"],
        files={"a.png": _IMAGE},
        images=[[_IMAGE], []],
        family="qwen2_5_vl",
        first_target="A red square.<|im_end|>\n",
    ),
    "alpaca": _OtherFormat(
        rows=ALPACA,
        written=[
            {"messages": ALPACA_AS_MESSAGES[0]},
            {"messages": ALPACA_AS_MESSAGES[1]},
            {"id": "al-2", "messages": ALPACA_AS_MESSAGES[2]},
        ],
        source_ids=["000000000", "000000001", "al-2"],
        images=[[], [], []],
        family="text",
        first_target="42<|im_end|>\n",
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row_format", sorted(OTHER_FORMATS))
def test_rows_of_another_format_are_rejected_without_format_and_converted_with_it(
    row_format: str, tmp_path: Path, tok: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    case = OTHER_FORMATS[row_format]
    for name, data in case.files.items():
        (tmp_path / name).write_bytes(data)
    jsonl = _write_jsonl(tmp_path / f"{row_format}.jsonl", case.rows)
    out = tmp_path / "ds"
    n = len(case.rows)

    rc, stdout, stderr = _convert(capsys, jsonl, out)
    assert rc == 1
    assert stdout[0] == f"rows read {n}, written 0, rejected {n} (wrong_format {n})"
    for line_no, line in enumerate(stdout[2 : 2 + n], start=1):
        assert line.startswith(f"  {jsonl.name}:{line_no}: [wrong_format] "), line
        assert f"pass --format {row_format}" in line
    assert len(stderr) == 1 and f"none of the {n} rows is usable" in stderr[0]
    assert not out.exists(), "a refused conversion leaves nothing behind"

    rc, stdout, stderr = _convert(capsys, jsonl, out, "--format", row_format)
    assert rc == 0, stderr
    assert stdout[0] == f"rows read {n}, written {n}, rejected 0"
    assert stdout[-1].startswith(f"prepared Energon dataset at {out}: {n} rows in 1 shard(s)")
    assert (out / ".nv-meta" / "index.sqlite").is_file()
    assert _tar_rows(out) == case.written
    processor = tok if case.family == "text" else build_processor(tok)
    enc = SFTTaskEncoder(processor, model_family=case.family, max_length=512)
    batches = _loaded(out, enc)
    assert [b.source_ids[0] for b in batches] == case.source_ids
    for batch, row, images in zip(batches, case.written, case.images, strict=True):
        sample = chat_sample(row["messages"], images, source_id=batch.source_ids[0])
        _assert_batch_encodes(batch, enc, sample)
        assert int(batch.image_grid_thw.shape[0]) == len(images)
    targets = [t for t in batches[0].labels[0].tolist() if t != -100]
    assert tok.decode(targets) == case.first_target


def _good(i: int) -> dict[str, Any]:
    return {
        "id": f"good-{i}",
        "messages": [
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}."},
        ],
    }


# (line content, reason) of bad rows; line numbers are physical lines of the file.
BAD_ROWS: list[tuple[Any, str]] = [
    (
        {"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]},
        "unknown_role",
    ),
    ("{not json", "bad_json"),
    ({"messages": [{"role": "user", "content": "no answer"}]}, "no_assistant"),
    (
        {
            "id": "img",
            "messages": [
                {"role": "user", "content": [{"type": "image", "media_index": 0}]},
                {"role": "assistant", "content": "x"},
            ],
            "media": ["missing.png"],
        },
        "missing_media",
    ),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "wrong_format"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "media_index": 2}]},
                {"role": "assistant", "content": "x"},
            ]
        },
        "media_index_out_of_range",
    ),
    ("[1, 2]", "bad_json"),
]


def _mixed_file(tmp_path: Path, n_good: int) -> tuple[Path, list[tuple[int, str]]]:
    """Good rows, then a blank line, then the bad rows interleaved with good ones."""
    lines: list[Any] = [_good(i) for i in range(n_good)] + [""]
    where = []
    for j, (row, reason) in enumerate(BAD_ROWS):
        lines.append(row)
        where.append((len(lines), reason))
        lines.append(_good(n_good + j))
    return _write_jsonl(tmp_path / "rows.jsonl", lines), where


@pytest.mark.timeout(120)
def test_counts_and_first_rejections_with_line_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jsonl, where = _mixed_file(tmp_path, n_good=6)
    n_bad, n_good = len(BAD_ROWS), 6 + len(BAD_ROWS)
    rc, stdout, stderr = _convert(capsys, jsonl, tmp_path / "ds", "--max-bad-fraction", "0.5")
    assert rc == 0, stderr
    counts = ", ".join(
        f"{r} {n}"
        for r, n in [
            ("bad_json", 2),
            ("unknown_role", 1),
            ("no_assistant", 1),
            ("missing_media", 1),
            ("wrong_format", 1),
            ("media_index_out_of_range", 1),
        ]
    )
    assert stdout[0] == f"rows read {n_good + n_bad}, written {n_good}, rejected {n_bad} ({counts})"
    assert stdout[1] == "first 5 rejected row(s):"
    shown = stdout[2:7]
    for line, (lineno, reason) in zip(shown, where[:5], strict=True):
        assert line.startswith(f"  rows.jsonl:{lineno}: [{reason}] "), line
    assert "missing.png" in shown[3] and "does not exist" in shown[3]
    assert stdout[7].startswith("prepared Energon dataset at ")
    assert [r["id"] for r in _tar_rows(tmp_path / "ds")] == [f"good-{i}" for i in range(n_good)]


@pytest.mark.timeout(120)
def test_max_bad_fraction_exceeded_fails_within_converts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [_good(i) for i in range(3)] + [BAD_ROWS[0][0]]  # 1 of 4 bad = 0.25
    jsonl = _write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "ds"
    for fraction in (None, "0.2"):
        extra = [] if fraction is None else ["--max-bad-fraction", fraction]
        rc, stdout, stderr = _convert(capsys, jsonl, out, *extra)
        assert rc == 1
        assert stdout[0] == "rows read 4, written 3, rejected 1 (unknown_role 1)"
        assert stdout[2].startswith("  rows.jsonl:4: [unknown_role]")
        assert len(stderr) == 1
        assert "1 of 4 rows rejected (25.0%) > --max-bad-fraction" in stderr[0]
        assert "--max-bad-fraction (e.g. 0.25)" in stderr[0]
        assert not out.exists()
    rc, stdout, stderr = _convert(capsys, jsonl, out, "--max-bad-fraction", "0.25")
    assert rc == 0, stderr
    assert stdout[0] == "rows read 4, written 3, rejected 1 (unknown_role 1)"
    assert len(_tar_rows(out)) == 3


@pytest.mark.timeout(60)
def test_nothing_usable_fails_even_with_every_row_allowed_bad(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _write_jsonl(tmp_path / "bad.jsonl", [row for row, _ in BAD_ROWS[:3]])
    with bad.open("ab") as fh:
        fh.write(b'{"messages": "\xff\xfe"}\n')  # not UTF-8
    rc, stdout, stderr = _convert(capsys, bad, tmp_path / "ds", "--max-bad-fraction", "1")
    assert rc == 1
    assert stdout[0].startswith("rows read 4, written 0, rejected 4 ")
    assert stdout[-1].startswith("  bad.jsonl:4: [bad_json] the line is not UTF-8")
    assert len(stderr) == 1 and "none of the 4 rows is usable; the first: bad.jsonl:1:" in stderr[0]
    empty = _write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    rc, stdout, stderr = _convert(capsys, empty, tmp_path / "ds", "--max-bad-fraction", "1")
    assert rc == 1 and len(stderr) == 1 and "no rows in" in stderr[0]
    assert not (tmp_path / "ds").exists()


@pytest.mark.timeout(120)
def test_used_output_folder_is_refused_and_overwrite_replaces_stale_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ds"
    big = _write_jsonl(tmp_path / "big.jsonl", [_good(i) for i in range(5)])
    small = _write_jsonl(tmp_path / "small.jsonl", [_good(i) for i in range(2)])
    assert _convert(capsys, big, out, "--samples-per-shard", "2")[0] == 0
    assert len(list(out.glob("chat-*.tar"))) == 3
    rc, _, stderr = _convert(capsys, small, out, "--samples-per-shard", "2")
    assert rc == 2 and len(stderr) == 1 and "--overwrite" in stderr[0]
    rc, _, stderr = _convert(capsys, small, out, "--samples-per-shard", "2", "--overwrite")
    assert rc == 0, stderr
    # The earlier run's third shard would otherwise be indexed into the new dataset.
    assert sorted(p.name for p in out.glob("chat-*.tar")) == ["chat-000000.tar"]
    assert [r["id"] for r in _tar_rows(out)] == ["good-0", "good-1"]
    (out / "notes.txt").write_text("mine")
    rc, _, stderr = _convert(capsys, small, out, "--overwrite")
    assert rc == 2 and "notes.txt" in stderr[0], "never deletes files convert did not write"


@pytest.mark.timeout(60)
def test_check_images_rejects_corrupt_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ok.png").write_bytes(png_bytes(28, 28, 0))
    (tmp_path / "bad.png").write_bytes(b"not a png")
    rows = []
    for name in ("ok.png", "bad.png"):
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "media_index": 0}]},
                    {"role": "assistant", "content": "x"},
                ],
                "media": [name],
            }
        )
    jsonl = _write_jsonl(tmp_path / "rows.jsonl", rows)
    rc, stdout, _ = _convert(capsys, jsonl, tmp_path / "a")
    assert rc == 0 and stdout[0] == "rows read 2, written 2, rejected 0"
    rc, stdout, _ = _convert(capsys, jsonl, tmp_path / "b", "--check-images")
    assert rc == 1
    assert stdout[0] == "rows read 2, written 1, rejected 1 (corrupt_media 1)"
    assert stdout[2].startswith("  rows.jsonl:2: [corrupt_media] ")


def _one_line_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.timeout(60)
def test_user_mistakes_print_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jsonl = _write_jsonl(tmp_path / "rows.jsonl", [_good(0)])
    out = str(tmp_path / "ds")
    line = _one_line_usage_error(["convert", str(jsonl), out, "--format", "xml"], capsys)
    assert "invalid choice: 'xml'" in line
    for bad in ("1.5", "-0.1", "lots"):
        line = _one_line_usage_error(
            ["convert", str(jsonl), out, "--max-bad-fraction", bad], capsys
        )
        assert "--max-bad-fraction" in line and bad in line
    assert main(["convert", str(tmp_path / "nope.jsonl"), out]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"energon-sft convert: error: input file {tmp_path / 'nope.jsonl'} does not exist"
    ]
    assert main(["convert", str(jsonl), out, "--media-root", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert not Path(out).exists()
    # inspect / bench: a folder that was never prepared, a JSONL that bench cannot read.
    assert main(["inspect", str(tmp_path), "--tokenizer", "unused"]) == 2
    assert "is not a prepared Energon dataset" in capsys.readouterr().err
    assert main(["bench", str(jsonl), "--tokenizer", "unused"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "inspect reads JSONL directly" in err[0]
    # A real process: exit status 2, one line, no traceback.
    script = Path(sys.executable).parent / "energon-sft"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "energon_sft.cli"]
    proc = subprocess.run(
        [*cmd, "convert", str(tmp_path / "nope.jsonl"), out],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"energon-sft convert: error: input file {tmp_path / 'nope.jsonl'} does not exist"
    ]


@pytest.mark.timeout(120)
def test_inspect_reads_jsonl_directly(
    tmp_path: Path, tok: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    rows = [ALPACA[0], {"instruction": "An answer is missing."}, ALPACA[2]]
    jsonl = _write_jsonl(tmp_path / "alpaca.jsonl", rows)
    assert not jsonl.with_suffix(".jsonl.idx").exists()
    argv = ["inspect", str(jsonl), "--tokenizer", str(tok_dir), "--no-color", "-n", "1"]
    assert main([*argv, "--format", "alpaca"]) == 0
    text = capsys.readouterr().out
    blocks = text.split("=== ")[1:]
    assert len(blocks) == 1, "-n 1 shows one row"
    header, body = blocks[0].split("\n", 1)
    # The user turn is rendered, only the answer (with its end of turn) is trained.
    n_trained = len(tok(ALPACA[0]["output"] + "<|im_end|>\n")["input_ids"])
    assert header.startswith("000000000 (alpaca.jsonl:1): ") and f"{n_trained} trained" in header
    assert "Add the numbers.\n\n12 + 30" in body
    assert body.count("[[") == 1 and "[[42<|im_end|>\n]]" in body
    summary = text.strip().splitlines()[-2:]
    assert summary[0] == (
        "alpaca.jsonl: 3 rows (alpaca), 2 pass the schema, 1 rejected (missing_field 1)"
    )
    assert summary[1].startswith(
        "  alpaca.jsonl:2: [missing_field] the Alpaca row needs a string 'output'"
    )
    assert not jsonl.with_suffix(".jsonl.idx").exists(), "inspect writes nothing"
    # Without --format the same file is reported as Alpaca rows, with the flag to use.
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 rows (messages), 0 pass the schema, 3 rejected" in out
    assert "pass --format alpaca" in out


# Direct inputs: the same three rows as a JSONL file, a Parquet file (written here with pyarrow)
# and a `datasets.save_to_disk` folder (written by `datasets` itself: data/make_save_to_disk.py).
DATA = Path(__file__).parent / "data"


@pytest.mark.timeout(180)
def test_jsonl_parquet_and_save_to_disk_folder_convert_to_the_same_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (DATA / "chats.jsonl").read_text().splitlines()]
    assert "id" not in rows[1]  # Arrow stores it as a null, which must not reach the row
    parquet = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for name, source in [
        ("jsonl", DATA / "chats.jsonl"),
        ("parquet", parquet),
        ("save_to_disk", DATA / "chats_save_to_disk"),
    ]:
        out = tmp_path / name
        rc, stdout, stderr = _convert(capsys, source, out)
        assert rc == 0, (name, stderr)
        assert stdout[0] == "rows read 3, written 3, rejected 0", name
        assert (out / ".nv-meta" / "index.sqlite").is_file(), name
        assert _tar_rows(out) == rows, name
    # A DatasetDict folder names its splits; an unknown file type says what is read.
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    (tmp_path / "rows.csv").write_text("a,b\n")
    for bad, expect in [
        (tmp_path / "dd", "holds a DatasetDict with splits ['train', 'test']; name one split's"),
        (tmp_path / "rows.csv", "unknown input type .csv; expected a chat JSONL (.jsonl), a Par"),
    ]:
        rc, _, stderr = _convert(capsys, bad, tmp_path / "never")
        assert rc == 2 and len(stderr) == 1 and expect in stderr[0], stderr
    assert not (tmp_path / "never").exists()


@pytest.mark.timeout(120)
def test_held_out_rows_go_to_their_jsonl_with_absolute_media_and_not_into_shards(
    tmp_path: Path,
) -> None:
    from energon_sft.convert import convert_files

    (tmp_path / "pic.png").write_bytes(png_bytes(28, 28, 0))
    rows = [_good(i) for i in range(5)]
    rows[3] = {
        "id": "good-3",
        "messages": [
            {"role": "user", "content": image_question("What is it?")},
            {"role": "assistant", "content": "A picture."},
        ],
        "media": ["pic.png"],
    }
    rows.insert(2, BAD_ROWS[0][0])  # a rejected row still counts as a row read
    jsonl = _write_jsonl(tmp_path / "rows.jsonl", rows)
    held = tmp_path / "held.jsonl"
    report = convert_files(
        [jsonl], tmp_path / "ds", holdout={1, 4}, holdout_path=held, max_bad_fraction=0.5
    )
    assert report.summary_lines()[0] == (
        "rows read 6, written 3, held out 2, rejected 1 (unknown_role 1)"
    )
    assert report.summary_lines()[-1] == f"held-out rows (never trained on) in {held}"
    assert [r["id"] for r in _tar_rows(tmp_path / "ds")] == ["good-0", "good-2", "good-4"]
    want = [_good(1), {**rows[4], "media": [str((tmp_path / "pic.png").resolve())]}]
    assert [json.loads(line) for line in held.read_text().splitlines()] == want
    # Holding out every usable row leaves nothing to train on: refused, nothing left behind.
    with pytest.raises(ValueError, match="all 1 usable rows were held out"):
        convert_files(
            [_write_jsonl(tmp_path / "one.jsonl", [_good(0)])],
            tmp_path / "ds2",
            holdout={0},
            holdout_path=tmp_path / "held2.jsonl",
        )
    assert not (tmp_path / "ds2").exists() and not (tmp_path / "held2.jsonl").exists()


@pytest.mark.timeout(60)
def test_convert_to_jsonl_maps_alpaca_rows_to_canonical_ones(tmp_path: Path) -> None:
    from energon_sft.convert import convert_to_jsonl

    out = tmp_path / "eval.jsonl"
    report = convert_to_jsonl(
        [_write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)], out, row_format="alpaca"
    )
    assert (report.rows_read, report.rows_written) == (3, 3)
    assert [json.loads(line) for line in out.read_text().splitlines()] == OTHER_FORMATS[
        "alpaca"
    ].written
