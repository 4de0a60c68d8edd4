"""Packed (THD) batches through the sharder on unmodified transformers models, float64.

The token-sum loss and every parameter gradient must equal each document run alone, at cp=1
(in process) and cp=2 (real gloo ranks), with no dense attention mask built anywhere.
"""

from __future__ import annotations

from typing import Any

import pytest

import _packed_workers as workers

TOL = 1e-9  # float64 throughout


def _check(results: dict[str, dict[str, Any]], label: str) -> None:
    for case, r in results.items():
        assert r["loss_rel_err"] < TOL, f"{label}/{case}: loss differs: {r}"
        assert r["grad_rel_err"] < TOL, f"{label}/{case}: gradients differ: {r}"
        assert not r["missing_grads"], f"{label}/{case}: {r}"
        assert r["backend"] == "varlen", f"{label}/{case}: {r}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_rows_at_cp1_equal_documents_alone(arch: str) -> None:
    results = workers.packed_parity(0, 1, arch)
    _check(results, f"{arch} cp=1")
    assert {r["layout"] for r in results.values()} == {"identity"}


@pytest.mark.timeout(300)
def test_packed_rows_at_cp2_equal_documents_alone(rank_pool: Any) -> None:
    for arch in ("llama", "qwen3"):
        results = rank_pool.run(2, workers.packed_parity, arch, timeout_s=240)
        for r in results:
            _check(r, f"{arch} cp=2")
        # Unpadded documents: head/tail over the stream; 2*cp-padded ones: per document.
        assert results[0]["unpadded"]["layout"] == "head_tail"
        assert results[0]["padded"]["layout"] == "thd"


def test_dense_mask_guard_fires_on_the_portable_path() -> None:
    """The guard is real: the old dense-mask path trips it."""
    import torch

    from cp_sharder.attention import portable

    spec = portable.MaskSpec(q_index=torch.arange(4), k_index=torch.arange(4))
    with workers.no_dense_masks(), pytest.raises(AssertionError, match="dense attention mask"):
        spec.mask(causal=True, window=None, device=torch.device("cpu"))
    model = workers.tiny_model("llama")
    ids = torch.randint(1, workers.VOCAB, (1, 9))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])  # packed rows the old way
    with workers.no_dense_masks(), pytest.raises(AssertionError, match="dense attention mask"):
        model(input_ids=ids, position_ids=positions)
