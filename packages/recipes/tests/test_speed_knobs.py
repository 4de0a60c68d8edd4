"""The recipe's speed knobs: compiled decoder layers (under FSDP2), SDPA backend selection,
the optional position ids and the config keys that switch them on."""

from __future__ import annotations

import pytest
import torch

from _recipes_workers import compiled_layers_under_fsdp2
from train_recipes.config import ConfigError, SFTConfig, load_config, validate_sft
from train_recipes.model.attention import sdpa_backends
from train_recipes.model.build import decoder_layers
from train_testing.tiny_hf import tiny_model


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "memory_budget",
    [
        None,
        # 0.5 recomputes projections and attention in backward: FSDP2 must have gathered their
        # weights again by then (model.compile_memory_budget).
        pytest.param(0.5, marks=pytest.mark.slow),
    ],
)
def test_compiled_layers_under_fsdp2_match_float64_eager(
    rank_pool: object, memory_budget: float | None
) -> None:
    results = rank_pool.run(2, compiled_layers_under_fsdp2, memory_budget)  # type: ignore[attr-defined]
    for rank, r in enumerate(results):
        assert r["compiled"] == 3 and r["names_unchanged"], rank
        assert r["loss_err"] < 1e-5, (rank, r["loss_err"])
        assert r["unique_graphs"] >= 1, "nothing was compiled"
    # FSDP2's gradient is the mean over ranks of each rank's gradient.
    for name, grad in results[0]["grads"].items():
        expected = (results[0]["ref_grads"][name] + results[1]["ref_grads"][name]) / 2
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=name)


def _tiny_llama() -> torch.nn.Module:
    return tiny_model("llama", vocab_size=50, dtype=torch.float64)


def test_decoder_layers_requires_a_transformers_model() -> None:
    with pytest.raises(ValueError, match="found no decoder layers in Sequential"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_sdpa_backends_restrict_the_choice() -> None:
    q = torch.randn(1, 2, 8, 16)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with sdpa_backends(("math",)):
        got = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(got, expected)
    # cuDNN alone has no CPU kernel: the restriction is really in force.
    with sdpa_backends(("cudnn",)), pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with pytest.raises(ValueError, match="unknown SDPA backends"), sdpa_backends(("fast",)):
        pass


def test_token_sum_loss_without_position_ids_is_the_same_for_unpacked_rows() -> None:
    from train_recipes.sft.run import token_sum_loss

    model = _tiny_llama()
    ids = torch.randint(0, 50, (2, 10))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    with_pos = token_sum_loss(
        model, {"input_ids": ids, "labels": labels, "position_ids": torch.arange(10).expand(2, 10)}
    )
    without = token_sum_loss(model, {"input_ids": ids, "labels": labels})
    # Reference computed another way: plain log_softmax over the model's logits.
    logits = model(input_ids=ids).logits
    ref = -torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).sum()
    # (the loss is float32 whatever the logits' dtype)
    torch.testing.assert_close(with_pos.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(without.double(), ref, rtol=1e-6, atol=1e-6)


def test_speed_config_keys() -> None:
    config = load_config(
        SFTConfig,
        None,
        ["model.compile=true", "model.sdpa_backends=[cudnn,flash]", "optim.fused=false"],
    )
    assert config.model.compile and config.model.sdpa_backends == ("cudnn", "flash")
    assert config.optim.fused is False
    with pytest.raises(ConfigError, match=r"model\.sdpa_backends"):
        load_config(SFTConfig, None, ["model.sdpa_backends=[fastest]"])
    empty = load_config(SFTConfig, None, ["model.sdpa_backends=[]"])
    with pytest.raises(ConfigError, match=r"model\.sdpa_backends"):
        validate_sft(empty, world_size=1)


def test_causal_fast_path_matches_transformers_sdpa_and_switches_back() -> None:
    from train_recipes.model.attention import CAUSAL_ATTENTION, CausalFastPath, rows_are_packed
    from train_recipes.sft.run import token_sum_loss

    model = _tiny_llama()
    ids = torch.randint(0, 50, (2, 12))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    plain = torch.arange(12).expand(2, 12)
    packed = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)
    assert not rows_are_packed(plain) and rows_are_packed(packed)

    def loss_and_grads(position_ids: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        batch = {"input_ids": ids, "labels": labels, "position_ids": position_ids}
        loss = token_sum_loss(model, batch)
        loss.backward()
        return float(loss), [p.grad.clone() for p in model.parameters()]

    ref_plain, ref_packed = loss_and_grads(plain), loss_and_grads(packed)
    fast = CausalFastPath(model)
    assert fast.enabled
    with fast.selected(packed=False):
        assert model.config._attn_implementation == CAUSAL_ATTENTION
        got = loss_and_grads(plain)
        # Packed rows need a per-document mask: the fast path refuses a prepared (4-D) mask...
        with pytest.raises(RuntimeError, match="got a mask"):
            model(input_ids=ids, attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool))
    assert got[0] == pytest.approx(ref_plain[0], rel=1e-12)
    for a, b in zip(got[1], ref_plain[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # ...the block's end restores transformers' SDPA, also when the block raises...
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ZeroDivisionError), fast.selected(packed=False):
        1 / 0  # noqa: B018
    assert model.config._attn_implementation == "sdpa"
    # ...and selected(packed=True) keeps transformers' SDPA with its document masking.
    with fast.selected(packed=True):
        assert model.config._attn_implementation == "sdpa"
        got = loss_and_grads(packed)
    assert got[0] == pytest.approx(ref_packed[0], rel=1e-12)
    assert abs(ref_packed[0] - ref_plain[0]) > 1e-3  # packing changes the loss: the test can fail


def test_causal_fast_path_is_off_for_other_attention_implementations() -> None:
    from train_recipes.model.attention import CausalFastPath

    model = _tiny_llama()
    model.config._attn_implementation = "eager"
    fast = CausalFastPath(model)
    with fast.selected(packed=False):
        assert not fast.enabled and model.config._attn_implementation == "eager"
