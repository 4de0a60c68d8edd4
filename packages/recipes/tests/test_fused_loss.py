"""The recipe's fused token-sum loss (hidden states + head weight through vocab-parallel's
grads-in-forward cross-entropy): its loss and every parameter gradient equal plain float64
cross-entropy on the materialised logits of the unmodified transformers model, alone, under
FSDP2 on 2 gloo ranks and under tensor parallelism (tp=2, Shard(0) head weight); models whose
head it cannot replace keep the logits path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _fused_loss_workers import fused_loss, fused_under_fsdp2, fused_under_tp
from _scale_workers import batch_for, reference_token_sum_loss, save_tiny, tiny_hf_model
from train_recipes.loss.fused_loss import fused_head, token_sum_loss_of


def _reference(model: nn.Module, batch: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    """Float64 F.cross_entropy (sum) on the model's logits, and every parameter's gradient."""
    loss = reference_token_sum_loss(model, batch)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _assert_close(loss: float, grads: dict[str, torch.Tensor], ref_loss: float, ref: dict) -> None:
    # The fused loss computes in fp32 whatever the input dtype: ~1e-7 relative.
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref.keys()
    for name, grad in ref.items():
        scale = float(grad.abs().max())
        err = float((grads[name] - grad).abs().max())
        assert err <= 1e-5 * scale + 1e-12, f"{name}: max error {err}, scale {scale}"


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2_5_vl"])
def test_fused_loss_equals_float64_cross_entropy_on_logits(kind: str) -> None:
    """Untied Llama, tied Qwen3, and Qwen2.5-VL with an image; the head is restored after."""
    torch.manual_seed(0)
    model = tiny_hf_model(kind)
    reference = tiny_hf_model(kind)
    reference.load_state_dict(model.state_dict())
    batch = batch_for(kind)
    loss = fused_loss(model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    _assert_close(float(loss.detach()), grads, *_reference(reference, batch))
    head = model.get_output_embeddings()
    assert "forward" not in vars(head), "the head's forward was not restored"
    x = torch.randn(3, head.in_features, dtype=torch.float64)
    assert head(x).shape == (3, head.out_features)


def test_chunk_tokens_reach_the_fused_loss_and_keep_its_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``model.fused_loss_chunk_tokens`` is the loss's chunk size; the loss and gradients stay
    those of the float64 reference whatever the chunking (a chunk of 3 tokens: many chunks)."""
    import vocab_parallel as vp

    seen: list[int | None] = []
    original = vp.linear_cross_entropy

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs.get("chunk_size"))
        return original(*args, **kwargs)

    monkeypatch.setattr(vp, "linear_cross_entropy", spy)
    torch.manual_seed(0)
    model = tiny_hf_model("llama")
    reference = tiny_hf_model("llama")
    reference.load_state_dict(model.state_dict())
    batch = batch_for("llama")
    loss = fused_loss(model, batch, chunk_tokens=3)
    loss.backward()
    assert seen == [3]
    grads = {n: p.grad for n, p in model.named_parameters()}
    _assert_close(float(loss.detach()), grads, *_reference(reference, batch))


def test_logits_path_where_the_head_cannot_be_replaced() -> None:
    """A head with a bias, logit soft-capping (Gemma 2) and grad-free evaluation use the logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    llama = tiny_hf_model("llama")
    assert fused_head(llama) is llama.lm_head
    gemma = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=101,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            final_logit_softcapping=30.0,
        )
    )
    assert fused_head(gemma) is None
    llama.lm_head = nn.Linear(64, 101, bias=True, dtype=torch.float64)
    assert fused_head(llama) is None
    batch = batch_for("llama")
    inputs = dict(batch)
    labels = inputs.pop("labels")
    with torch.no_grad():
        got = token_sum_loss_of(llama, inputs, labels)
        ref_loss = nn.functional.cross_entropy(
            llama(**inputs).logits.flatten(0, 1), labels.flatten(), reduction="sum"
        )
    assert float(got) == pytest.approx(float(ref_loss), rel=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reshard", [None, True])
def test_fused_loss_under_fsdp2_equals_float64_reference(
    rank_pool: Any, reshard: bool | None
) -> None:
    """FSDP2's defaults, and every unit resharded after forward (the root included)."""
    results = rank_pool.run(2, fused_under_fsdp2, reshard, timeout_s=240)
    references = []
    for rank, result in enumerate(results):
        torch.manual_seed(0)
        ref_loss, ref = _reference(tiny_hf_model("llama"), batch_for("llama", seed=10 + rank))
        assert result["loss"] == pytest.approx(ref_loss, rel=1e-6), rank
        references.append(ref)
    # FSDP2 averages the ranks' gradients (each rank had its own batch).
    mean = {n: (references[0][n] + references[1][n]) / 2 for n in references[0]}
    for result in results:
        _assert_close(0.0, result["grads"], 0.0, mean)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["llama", "qwen2_5_vl"])
def test_fused_loss_under_tensor_parallel_equals_float64_reference(
    rank_pool: Any, kind: str, tmp_path: Path
) -> None:
    """tp=2 over an uneven vocabulary (51 + 50 rows); Qwen2.5-VL with tied embeddings."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    model_dir = save_tiny(kind, tmp_path / kind)
    results = rank_pool.run(2, fused_under_tp, kind, str(model_dir), timeout_s=240)
    auto = AutoModelForImageTextToText if kind == "qwen2_5_vl" else AutoModelForCausalLM
    reference = auto.from_pretrained(model_dir, dtype=torch.float64)
    ref_loss, ref = _reference(reference, batch_for(kind))
    for result in results:
        _assert_close(result["loss"], result["grads"], ref_loss, ref)


def test_ddp_that_finds_unused_parameters_keeps_the_logits_path() -> None:
    """DDP(find_unused_parameters=True) would mark the passed-over head unused: no fused loss."""

    class Wrapper(nn.Module):  # what fused_head reads of a DDP wrapper: .module and the flag
        def __init__(self, module: nn.Module, find_unused: bool) -> None:
            super().__init__()
            self.module = module
            self.find_unused_parameters = find_unused

    llama = tiny_hf_model("llama")
    assert fused_head(Wrapper(llama, False)) is llama.lm_head
    assert fused_head(Wrapper(llama, True)) is None
