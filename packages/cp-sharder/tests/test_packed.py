"""Packed (THD) batches through the sharder on unmodified transformers models, float64.

The token-sum loss and every parameter gradient must equal each document run alone, at cp=1
(in process) and cp=2 (real gloo ranks), with no dense attention mask built anywhere.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import _packed_workers as workers
from train_testing.reference import token_sum_cross_entropy

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
    from cp_sharder.attention import portable

    spec = portable.MaskSpec(q_index=torch.arange(4), k_index=torch.arange(4))
    with workers.no_dense_masks(), pytest.raises(AssertionError, match="dense attention mask"):
        spec.mask(causal=True, window=None, device=torch.device("cpu"))
    model = workers.tiny_model("llama")
    ids = torch.randint(1, workers.VOCAB, (1, 9))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])  # packed rows the old way
    with workers.no_dense_masks(), pytest.raises(AssertionError, match="dense attention mask"):
        model(input_ids=ids, position_ids=positions)


# The tiny random vision tower's backward is ill-conditioned: splitting its upstream gradient in
# two (as two CP ranks do) and summing already moves patch_embed's float64 gradient by ~1e-9
# relative, in a single process. Logic errors show up at 1e-2.
VLM_GRAD_TOL = 1e-7


def _check_vlm(r: dict[str, Any], label: str) -> None:
    assert r["loss_rel_err"] < TOL and r["grad_rel_err"] < VLM_GRAD_TOL, f"{label}: {r}"
    assert not r["missing_grads"] and r["backend"] == "varlen", f"{label}: {r}"
    assert r["vision_grads"] > 0, f"{label}: the vision tower got no gradient: {r}"


def test_packed_vlm_rows_at_cp1_equal_documents_alone() -> None:
    """Qwen2.5-VL: images, [4, B, S] M-RoPE ids and packed documents, varlen at cp=1, as THD
    and as [B, S] rows packed by position restarts."""
    for case, r in workers.vlm_parity(0, 1).items():
        _check_vlm(r, f"qwen2.5-vl cp=1 {case}")


@pytest.mark.timeout(300)
def test_packed_vlm_rows_at_cp2_equal_documents_alone(rank_pool: Any) -> None:
    """At cp=2 the sharder embeds the images before sharding, so no placeholder token is cut
    from its features; M-RoPE ids follow the token layout. Also as [B, S] rows whose documents
    are marked by restarting position ids only (the loader's collate today)."""
    for rank, r in enumerate(rank_pool.run(2, workers.vlm_parity, timeout_s=240)):
        for case in ("thd", "bshd"):
            _check_vlm(r[case], f"qwen2.5-vl cp=2 rank {rank} {case}")
            assert r[case]["layout"] == "head_tail", r


class _PlainAttention(torch.nn.Module):
    """A plain PyTorch causal self-attention LM calling SDPA (no transformers), GQA 2/1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(workers.VOCAB, 16)
        self.q = torch.nn.Linear(16, 16)
        self.kv = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, workers.VOCAB)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.emb(input_ids)
        b, s, _ = h.shape
        q = self.q(h).view(b, s, 2, 8).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, 1, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(a.transpose(1, 2).reshape(b, s, 16) + h)


def test_plain_pytorch_model_on_packed_rows_through_the_sdpa_override() -> None:
    from cp_sharder import ContextParallelSharder

    model = _PlainAttention().double()
    batch, docs = workers.packed_batch([[5, 7], [9]], None, 12, seed=3)
    result = ContextParallelSharder(model).shard(batch)
    local = dict(result.batch)
    labels = local.pop("labels")
    original = F.scaled_dot_product_attention
    with workers.no_dense_masks(), result.train_ctx():
        logits = model(**local)
    assert F.scaled_dot_product_attention is original
    assert result.layout.backend.value == "varlen"
    loss = token_sum_cross_entropy(logits, labels)
    loss.backward()
    ref = copy.deepcopy(model)
    ref.zero_grad()
    ref_loss = sum(token_sum_cross_entropy(ref(d[None])[0, :-1], d[1:]) for d in docs)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
