"""The fused loss over the trained rows only (``model.fused_loss_trained_only``): its loss and the
gradients of the input embeddings and the head's weight equal the all-positions fused loss and
an independent float64 reference (plain PyTorch log-softmax on ``hidden @ W.T``), on a tiny
Llama with prompt-like and padding spans, a row without a trained token, a batch without any
(K == 0) and one trained everywhere (K == B*S); the head's matmuls see K rows; the count helper
reads the count on the CPU without touching a device, and the loss then selects the rows
without the synchronising ``torch.nonzero``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _scale_workers import tiny_hf_model
from train_recipes.data.trained_rows import TrainedRows
from train_recipes.loss.fused_loss import token_sum_loss_of
from vocab_parallel import _fused_linear

_B, _S, _V = 3, 10, 101


def _labels(kind: str) -> torch.Tensor:
    """[B, S] shifted labels: "mixed" has a prompt prefix, a padding tail and an untrained row."""
    labels = torch.randint(0, _V, (_B, _S), generator=torch.Generator().manual_seed(2))
    if kind == "none":
        labels[:] = -100
    elif kind == "mixed":
        labels[0, :4] = -100  # the prompt
        labels[0, 8:] = -100  # right padding
        labels[1, :] = -100  # a row with no trained token (all prompt)
        labels[2, :2] = -100
        labels[2, 6] = -100  # an image token inside the answer
    return labels


def _reference(model: Any, embeds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-sum over trained positions of log p(label): float64 logits = hidden @ W.T by hand."""
    hidden = model.model(inputs_embeds=embeds, use_cache=False).last_hidden_state  # [B, S, H]
    logits = hidden.double() @ model.lm_head.weight.double().T  # [B, S, V]
    log_p = torch.log_softmax(logits, dim=-1)
    trained = labels != -100
    picked = log_p.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, S]
    return -(picked * trained).sum()


def _loss_and_grads(
    model: Any, embeds: torch.Tensor, labels: torch.Tensor, how: str
) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    x = embeds.detach().clone().requires_grad_(True)
    if how == "reference":
        loss = _reference(model, x, labels)
    else:
        loss = token_sum_loss_of(
            model, {"inputs_embeds": x}, labels, trained_only=how == "trained only"
        )
    loss.backward()
    head_grad = model.lm_head.weight.grad
    assert x.grad is not None
    return float(loss.detach()), x.grad, None if head_grad is None else head_grad.clone()


@pytest.mark.parametrize("kind", ["mixed", "none", "all"])
def test_trained_rows_loss_equals_all_positions_and_float64_reference(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vocab_parallel as vp

    torch.manual_seed(0)
    model = tiny_hf_model("llama")  # float64, untied head
    labels = _labels(kind)
    embeds = torch.randn(_B, _S, model.config.hidden_size, dtype=torch.float64)
    calls: list[tuple[tuple[int, ...], object, object]] = []
    original = vp.linear_cross_entropy

    def spy(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((tuple(hidden.shape), kwargs["skip_ignored"], kwargs["trained_count"]))
        return original(hidden, *args, **kwargs)

    logit_rows: list[int] = []
    chunk_logits = _fused_linear._chunk_logits

    def count_rows(h_chunk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logit_rows.append(h_chunk.shape[0])
        return chunk_logits(h_chunk, weight)

    monkeypatch.setattr(vp, "linear_cross_entropy", spy)
    ref = _loss_and_grads(model, embeds, labels, "reference")
    off = _loss_and_grads(model, embeds, labels, "all positions")
    monkeypatch.setattr(_fused_linear, "_chunk_logits", count_rows)
    on = _loss_and_grads(model, embeds, labels, "trained only")

    k = int((labels != -100).sum())
    full = (_B, _S, model.config.hidden_size)
    assert calls == [(full, False, None), (full, True, k)], (kind, k, calls)
    # Only the K trained positions reach the head's matmuls (none at all for K == 0).
    assert sum(logit_rows) == k, (kind, k, logit_rows)
    # The fused loss computes in fp32 whatever the input dtype: ~1e-7 relative.
    for name, got in (("all positions", off), ("trained only", on)):
        assert got[0] == pytest.approx(ref[0], rel=1e-6, abs=1e-12), name
        # K == 0 still reaches the head: its gradient exists (zero), as every rank's must.
        assert got[2] is not None, f"{name}: the head's weight got no gradient"
        assert ref[2] is not None
        for what, g, r in (("embeddings", got[1], ref[1]), ("head weight", got[2], ref[2])):
            err, scale = float((g - r).abs().max()), float(r.abs().max())
            assert err <= 1e-5 * scale + 1e-12, f"{name} {what}: max error {err}, scale {scale}"
    if kind == "none":
        assert ref[0] == 0.0 and float(on[2].abs().max()) == 0.0  # type: ignore[union-attr]
    else:
        assert ref[0] > 0 and float(ref[1][0].abs().max()) > 0  # the test can fail


def test_trained_rows_on_cpu_read_the_count_without_a_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU path never creates a CUDA event, synchronises or pins memory; the loss given its
    count finds the rows without torch.nonzero and equals the float64 reference."""

    def no_cuda(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the CPU path touched CUDA")

    for name in ("Event", "synchronize", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(torch.Tensor, "pin_memory", no_cuda)
    monkeypatch.setattr(torch.Tensor, "nonzero", no_cuda)  # the synchronising selection
    labels = _labels("mixed")
    rows = TrainedRows(labels)
    trained = (labels != -100).reshape(-1)
    assert rows.count() == int(trained.sum()) == 11  # 4 + 0 + 7
    # The loss, given that count, selects the rows with nonzero_static: never torch.nonzero,
    # which would read the number back from the device.
    torch.manual_seed(0)
    model = tiny_hf_model("llama")
    embeds = torch.randn(_B, _S, model.config.hidden_size, dtype=torch.float64)
    ref_loss, _, ref_head = _loss_and_grads(model, embeds, labels, "reference")

    def no_sync(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the trained rows were found with torch.nonzero")

    monkeypatch.setattr(torch, "nonzero", no_sync)
    loss, _, head = _loss_and_grads(model, embeds, labels, "trained only")
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert head is not None and ref_head is not None
    # The fused loss computes in fp32: ~1e-7 of the gradient's scale.
    assert float((head - ref_head).abs().max()) <= 1e-5 * float(ref_head.abs().max())


def test_trained_rows_of_cp_local_labels_count_only_those() -> None:
    """A non-contiguous slice (a cp rank's half of each row) counts its own trained positions."""
    labels = _labels("mixed")
    local = labels[:, ::2]  # strided, as a zig-zag shard's view could be
    rows = TrainedRows(local)
    assert rows.count() == int((local != -100).sum()) > 0


def test_trained_only_switch_is_a_documented_key_a_resume_applies() -> None:
    """``model.fused_loss_trained_only``: on by default, set from the command line, listed by
    ``sft --help`` with its description, and applied on resume (a speed knob: same results)."""
    from train_recipes.config import SFTConfig, load_config
    from train_recipes.config.key_help import config_keys
    from train_recipes.config.loader import to_dict
    from train_recipes.run.resume_changes import config_changes

    default = load_config(SFTConfig, None, [])
    assert default.model.fused_loss_trained_only is True
    off = load_config(SFTConfig, None, ["model.fused_loss_trained_only=false"])
    assert off.model.fused_loss_trained_only is False
    docs = {d.key: d for d in config_keys(SFTConfig)}
    doc = docs["model.fused_loss_trained_only"]
    assert (doc.type, doc.default) == ("bool", "true") and "trained positions" in doc.description
    changes = config_changes(to_dict(default), off, saved_shards=None, new_shards=1)
    assert changes == {"model.fused_loss_trained_only": (True, False)}
