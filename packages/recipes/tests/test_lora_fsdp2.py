"""LoRA under FSDP2 (dp=2, and tp=2): only the adapters train, and the merged and adapter-only
exports (gathered from the shards) reproduce the sharded model's logits; at tp=2 the adapter
gradients equal the single-process float64 model's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from _scale_workers import lora_fsdp2_on_rank
from conftest import check_lora_run, merged_lora_run

pytest.importorskip("peft", reason="needs the lora extra (peft)")

PROBE = [[3, 23, 24, 17, 25, 35, 5, 4]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2])
def test_lora_under_fsdp2_trains_adapters_and_exports(
    rank_pool: Any, demo_data: Any, tmp_path: Path, tp: int
) -> None:
    run = rank_pool.run(
        2,
        lora_fsdp2_on_rank,
        merged_lora_run(demo_data, tmp_path / "lora", 12)
        .but(data_parallel="fsdp2", tp=tp)
        .overrides(),
        PROBE,
        str(tmp_path / "adapter"),
        timeout_s=240,
    )[0]
    # The frozen-weight check must have compared the base weights, not an empty set.
    assert run["compared"] > 10, run["compared"]
    check_lora_run(run, tmp_path / "adapter", PROBE, window=4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_lora_at_tp2_matches_single_process_gradients(
    rank_pool: Any, sequence_parallel: bool
) -> None:
    """Adapters on column- and row-parallel projections: the loss and every adapter gradient
    at tp=2 equal the single-process float64 model's, with sequence-parallel norms too (the
    row-parallel adapters' B then sees only each rank's tokens)."""
    from _scale_workers import (
        batch_for,
        lora_model,
        lora_tp_loss_and_grads,
        reference_token_sum_loss,
    )

    results = rank_pool.run(2, lora_tp_loss_and_grads, sequence_parallel, timeout_s=240)
    reference = lora_model()
    loss = reference_token_sum_loss(reference, batch_for("llama"))
    loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert len(ref_grads) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(float(loss.detach()), rel=1e-6), rank
        assert result["grads"].keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            scale = float(grad.abs().max())
            err = float((result["grads"][name] - grad).abs().max())
            assert scale > 0 and err <= 1e-6 * scale, f"{name}: error {err}, scale {scale}"
