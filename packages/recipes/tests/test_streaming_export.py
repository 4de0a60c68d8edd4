"""Streaming HF export: shards written by different ranks, never the whole model on one; the
folder loads with from_pretrained and gives the distributed model's logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from _scale_workers import export_on_rank, save_tiny


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "layout"), [("qwen3", "fsdp2"), ("llama", "tp")])
def test_streaming_export_round_trips(
    rank_pool: Any, kind: str, layout: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny(kind, tmp_path / "saved")
    out = tmp_path / "export"
    results = rank_pool.run(2, export_on_rank, kind, str(folder), layout, str(out), timeout_s=240)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    if kind == "qwen3":  # tied: the output projection is not written separately
        assert "lm_head.weight" not in index["weight_map"]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[kind]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 17, 33, 2, 90, 41]])).logits
    torch.testing.assert_close(logits, results[0]["logits"], rtol=1e-5, atol=1e-5)
    # The saved (untrained) weights would give other logits: the export holds the new ones.
    original = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        before = original(input_ids=torch.tensor([[5, 17, 33, 2, 90, 41]])).logits
    assert not torch.allclose(before, logits, atol=1e-3)
