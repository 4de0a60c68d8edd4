"""The `energon-sft` console script: convert (real energon prepare) and inspect."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _esft_data import build_image_processor, build_tokenizer, chat_rows, write_images
from energon_sft.cli import main


@pytest.mark.timeout(180)
def test_convert_then_inspect_highlights_exactly_the_targets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = chat_rows(6, image_every=2)
    media = tmp_path / "media"
    media.mkdir()
    write_images(media, rows)
    jsonl = media / "rows.jsonl"  # relative media paths resolve next to the JSONL file
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = Path(sys.executable).parent / "energon-sft"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "energon_sft.cli"]
    out = tmp_path / "ds"
    proc = subprocess.run(
        [*cmd, "convert", str(jsonl), str(out), "--samples-per-shard", "4"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == "rows read 6, written 6, rejected 0"
    assert "prepared Energon dataset" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert (out / ".nv-meta" / "index.sqlite").is_file()
    assert sorted(p.name for p in out.glob("*.tar")) == ["chat-000000.tar", "chat-000001.tar"]

    tok_dir, ip_dir = tmp_path / "tok", tmp_path / "ip"
    build_tokenizer().save_pretrained(tok_dir)
    build_image_processor().save_pretrained(ip_dir)
    args = ["inspect", str(out), "--tokenizer", str(tok_dir), "--image-processor", str(ip_dir)]
    assert main([*args, "--model-family", "qwen2_5_vl", "-n", "2", "--no-color"]) == 0
    text = capsys.readouterr().out
    blocks = text.split("=== ")[1:]
    assert len(blocks) == 2
    for i, block in enumerate(blocks):
        header, body = block.split("\n", 1)
        assert header.startswith(f"row-{i} ")
        answer = rows[i]["messages"][2]["content"]
        # The only highlighted span is the assistant answer with its end-of-turn.
        assert body.count("[[") == 1
        assert f"[[{answer}<|im_end|>\n]]" in body
    assert "<|image_pad|>x" in blocks[0] and "1 image(s)" in blocks[0]
    assert "0 image(s)" in blocks[1]
    # bench: loader throughput on the same dataset (only that it runs and reports).
    bench = ["bench", str(out), "--tokenizer", str(tok_dir), "--image-processor", str(ip_dir)]
    opts = ["--model-family", "qwen2_5_vl", "--batch-size", "2", "--num-workers", "0"]
    assert main([*bench, *opts, "--batches", "2", "--shuffle-buffer-size", "0"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["samples"] == 4 and report["samples_per_s"] > 0
