"""`demo-data` and `plot`: the small subcommands, in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train_recipes.cli.main import main
from train_recipes.data.demo import build_char_tokenizer, demo_chats, read_jsonl
from train_recipes.loop.metrics import read_metrics


def test_demo_data_writes_disjoint_splits_in_energon_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    assert main(["demo-data", str(out), "--train-size", "300", "--eval-size", "40"]) == 0
    assert "Energon dataset" in capsys.readouterr().out
    assert (out / "energon" / ".nv-meta" / "dataset.yaml").is_file()
    train = list(read_jsonl(out / "train.jsonl"))
    held = list(read_jsonl(out / "eval.jsonl"))
    assert len(train) == 300 and len(held) == 40
    questions = {r["messages"][0]["content"] for r in train}
    assert not questions & {r["messages"][0]["content"] for r in held}
    for row in train[:50]:
        q, a = row["messages"][0]["content"], row["messages"][1]["content"]
        x, y = q.rstrip("=").split("+")
        assert int(x) + int(y) == int(a)
    # Deterministic from the seed.
    again, _ = demo_chats("addition", train_size=300, eval_size=40, seed=0)
    assert again == train


def test_char_tokenizer_round_trips_and_renders_the_template() -> None:
    tok = build_char_tokenizer()
    chat = [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}]
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert tok.decode(ids) == "<|user|>12+30=<|end|><|assistant|>42<|end|>"
    prompt = tok.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|assistant|>")
    assert tok.decode(tok("reverse abc")["input_ids"]) == "reverse abc"


def test_plot_draws_the_loss_curve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "eval/exact_match": 0.0}] + [
        {"step": s, "loss": 3.0 / s, "loss_avg_window": 3.0 / s + 0.1} for s in range(1, 40)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(run)]) == 0
    png = Path(capsys.readouterr().out.strip())
    assert png == run / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    assert len(read_metrics(run)) == 40
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl"):
        read_metrics(tmp_path / "missing")
