"""Per-token log-probs of given labels (the preference and RL recipes' building block): through
the fused head (hidden states + head weight, vocab-parallel's recompute form) and through the
logits, equal to float64 log_softmax + gather on the float64 model's logits, with gradients
of a loss that mixes tokens (a weighted sum of sequence sums); segment sums equal a plain loop."""

from __future__ import annotations

import copy

import pytest
import torch

from train_recipes.loss.fused_loss import fused_head
from train_recipes.loss.sequence_log_probs import segment_sums, sequence_sums, token_log_probs_of
from train_testing.reference import token_log_probs as ref_token_log_probs
from train_testing.tiny_hf import tiny_model


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 12), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[0, :4] = -100  # a prompt
    labels[2, 7:] = -100  # right padding
    return ids, labels


@pytest.mark.parametrize("fused", [True, False])
def test_token_log_probs_equal_float64_log_softmax(fused: bool) -> None:
    model = tiny_model("llama", seed=0, tie_word_embeddings=False)
    ref = copy.deepcopy(model).double()
    ids, labels = _batch(model.config.vocab_size)
    head = fused_head(model) if fused else None
    assert (head is not None) == fused
    inputs = {"input_ids": ids}
    log_p = token_log_probs_of(model, head, inputs, labels, temperature=0.8)
    assert log_p.dtype == torch.float32 and log_p.shape == ids.shape
    assert torch.all(log_p[labels == -100] == 0)
    expected = ref_token_log_probs(ref(input_ids=ids).logits, labels, temperature=0.8)
    torch.testing.assert_close(log_p.double(), expected, rtol=1e-5, atol=1e-5)

    # A loss that mixes tokens: random weights on each row's sum.
    weights = torch.tensor([0.7, -1.3, 2.1])
    (weights * sequence_sums(log_p, labels)).sum().backward()
    ref_sums = expected.sum(-1)  # 0 at ignored positions already
    (weights.double() * ref_sums).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        scale = float(q.grad.abs().max()) + 1e-12
        err = float((p.grad.double() - q.grad).abs().max())
        assert err <= 1e-5 * scale + 1e-9, f"{name}: max error {err}, scale {scale}"
    assert "forward" not in vars(model.get_output_embeddings()), "head not restored"


def test_no_grad_reference_log_probs() -> None:
    """A frozen reference under no_grad gives the same values (the fused form, no graph)."""
    model = tiny_model("llama", seed=0).requires_grad_(False).eval()
    ids, labels = _batch(model.config.vocab_size)
    with torch.no_grad():
        fused = token_log_probs_of(model, fused_head(model), {"input_ids": ids}, labels)
        plain = token_log_probs_of(model, None, {"input_ids": ids}, labels)
    assert not fused.requires_grad
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)


def test_segment_sums_equal_a_loop() -> None:
    gen = torch.Generator().manual_seed(2)
    log_p = -torch.rand(2, 10, generator=gen, dtype=torch.float64)
    segments = torch.randint(-1, 4, (2, 10), generator=gen)
    got = segment_sums(log_p, segments, 5)
    expected = torch.zeros(5, dtype=torch.float64)
    for b in range(2):
        for t in range(10):
            if segments[b, t] >= 0:
                expected[segments[b, t]] += log_p[b, t]
    torch.testing.assert_close(got, expected)
    assert float(got[4]) == 0.0 or bool((segments == 4).any())


def test_reference_model_is_the_frozen_initial_policy() -> None:
    """The reference built with the run's seed equals a policy built right after that seeding,
    is frozen and in eval mode, leaves the global RNG alone; another vocabulary is refused."""
    from typing import cast

    from torch.distributed.device_mesh import DeviceMesh

    from train_recipes.config.sft import SFTConfig
    from train_recipes.data.demo import build_char_tokenizer
    from train_recipes.model.build import build_model
    from train_recipes.model.reference import build_reference_model, check_same_vocabulary
    from train_recipes.run.process_group import RankContext

    config = SFTConfig()
    tokenizer = build_char_tokenizer()
    torch.manual_seed(5)
    policy = build_model(config, tokenizer)
    ctx = RankContext(
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        mesh=cast(DeviceMesh, None),  # read only for tp > 1 or FSDP2
        dp_rank=0,
        dp_size=1,
        cp_size=1,
    )
    state = torch.random.get_rng_state()
    reference = build_reference_model(config, tokenizer, ctx, init_seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not reference.training
    for (name, p), (_, q) in zip(
        policy.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name
        assert not q.requires_grad, name
    check_same_vocabulary(policy, reference)
    other = tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match="vocabulary has 128 entries"):
        check_same_vocabulary(policy, other)
