"""``model.compile_memory_budget``: the compiled decoder layers save less for backward under a
budget, still give the eager loss and gradients, and leave torch's global setting alone."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config as functorch_config
from torch import nn

from train_recipes.config import ConfigError, SFTConfig, load_config, validate_sft
from train_recipes.model.build import compile_decoder_layers
from train_testing.tiny_hf import tiny_model

VOCAB = 50


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return tiny_model("llama", vocab_size=VOCAB, dtype=dtype)


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def _saved_activation_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages a forward saves for backward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False)
    return sum(storages.values())


def _loss_and_grads(
    model: nn.Module, ids: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    # The reference loss: plain log-softmax next-token loss, summed.
    loss = -torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().double() for n, p in model.named_parameters()}


def _check_budgets(
    backend: str, dtype: torch.dtype, budgets: list[float], tol: dict[str, float]
) -> None:
    ids = _batch()
    ref_loss, ref_grads = _loss_and_grads(_model(torch.float64), ids)
    saved: dict[float | None, int] = {}
    for budget in [None, *budgets]:
        torch._dynamo.reset()  # each budget traces and partitions anew
        model = _model(dtype)
        assert compile_decoder_layers(model, backend=backend, memory_budget=budget) == 2
        loss, grads = _loss_and_grads(model, ids)  # the first call compiles
        # The budget was in force while the layers compiled, and only then.
        assert functorch_config.activation_memory_budget == 1.0
        torch.testing.assert_close(loss, ref_loss, **tol, msg=f"loss, budget {budget}")
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], **tol, msg=f"{name}, budget {budget}")
        saved[budget] = _saved_activation_bytes(model, ids)
    # Each lower budget saves strictly less than the one before (None: torch's default, 1.0).
    amounts = [saved[b] for b in [None, *budgets]]
    assert amounts == sorted(amounts, reverse=True) and len(set(amounts)) == len(amounts), saved


def test_memory_budget_saves_less_and_matches_float64_eager() -> None:
    # aot_eager_decomp_partition: the min-cut partitioner inductor uses, without generating code.
    tol = {"rtol": 1e-10, "atol": 1e-12}
    _check_budgets("aot_eager_decomp_partition", torch.float64, [0.9], tol)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_budget_with_inductor_saves_less_and_matches_float64_eager() -> None:
    _check_budgets("inductor", torch.float32, [0.9], {"rtol": 1e-4, "atol": 1e-5})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["model.compile=true", "model.compile_memory_budget=1.5"], r"must be in \[0, 1\]"),
        (["model.compile=true", "model.compile_memory_budget=-0.1"], r"must be in \[0, 1\]"),
        (["model.compile_memory_budget=0.9"], "model.compile=false"),
    ],
)
def test_compile_memory_budget_rejects(overrides: list[str], match: str) -> None:
    config = load_config(SFTConfig, None, overrides)
    with pytest.raises(ConfigError, match=match) as info:
        validate_sft(config, world_size=1)
    assert info.value.key == "model.compile_memory_budget"


def test_compile_memory_budget_accepted() -> None:
    for value, expected in (("0.9", 0.9), ("0", 0.0), ("1", 1.0), ("null", None)):
        config = load_config(
            SFTConfig, None, ["model.compile=true", f"model.compile_memory_budget={value}"]
        )
        validate_sft(config, world_size=1)
        assert config.model.compile_memory_budget == expected
