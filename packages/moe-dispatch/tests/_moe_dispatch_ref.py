"""Test helpers: seeded global weights and an independent float64 dense MoE reference.

The reference never sorts or dispatches: it runs every expert on every token and weights the
results with a dense [T, E] routing matrix, so it shares no index math with the library.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moe_dispatch import MoEConfig


@dataclass(slots=True, frozen=True)
class Case(MoEConfig):
    """A layer's config (the workers pass it to ExpertParallelMoE as is) and its tokens.

    ``Case((0, 23), seed=11, hidden_size=16, ...)``: the tokens of each rank, the seed of the
    weights and inputs, then the :class:`MoEConfig` fields.
    """

    counts: tuple[int, ...]  # tokens per rank
    _: KW_ONLY
    seed: int


@dataclass(kw_only=True, slots=True)
class Weights:
    router: Tensor  # [E, H]
    gate_up: Tensor  # [E, 2F, H]
    down: Tensor  # [E, H, F]
    x: Tensor  # [T_total, H]
    grad_out: Tensor  # [T_total, H]


def make_weights(case: Case, dtype: torch.dtype = torch.float32) -> Weights:
    g = torch.Generator().manual_seed(case.seed)
    total = sum(case.counts)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    experts, hidden, ffn = case.num_experts, case.hidden_size, case.intermediate_size
    return Weights(
        router=randn(experts, hidden, scale=hidden**-0.5),
        gate_up=randn(experts, 2 * ffn, hidden, scale=hidden**-0.5),
        down=randn(experts, hidden, ffn, scale=ffn**-0.5),
        x=randn(total, hidden),
        grad_out=randn(total, hidden),
    )


def reference_moe(
    x: Tensor, router: Tensor, gate_up: Tensor, down: Tensor, top_k: int, norm: bool
) -> tuple[Tensor, Tensor]:
    """Dense MoE: returns ([T, H] output, [T, K] chosen ids)."""
    probs = torch.softmax(x @ router.t(), dim=-1)
    vals, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        vals = vals / vals.sum(-1, keepdim=True)
    dense = torch.zeros_like(probs).scatter(1, ids, vals)
    h = torch.einsum("th,efh->tef", x, gate_up)
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("tef,ehf->teh", F.silu(gate) * up, down)
    return torch.einsum("te,teh->th", dense, y), ids


def reference_grads(case: Case, w: Weights) -> dict[str, Tensor]:
    """Float64 output and gradients (x, router, experts) of sum(out * grad_out)."""
    x = w.x.double().requires_grad_()
    router = w.router.double().requires_grad_()
    gate_up = w.gate_up.double().requires_grad_()
    down = w.down.double().requires_grad_()
    out, ids = reference_moe(x, router, gate_up, down, case.top_k, case.norm_topk_prob)
    (out * w.grad_out.double()).sum().backward()
    assert x.grad is not None and router.grad is not None
    assert gate_up.grad is not None and down.grad is not None
    return {
        "out": out.detach(),
        "ids": ids,
        "x": x.grad,
        "router": router.grad,
        "gate_up": gate_up.grad,
        "down": down.grad,
    }


def assert_close(name: str, got: Tensor, want: Tensor, *, atol: float, rtol: float = 1e-5) -> None:
    got64, want64 = got.double(), want.double()
    if got64.shape != want64.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if got64.numel() == 0:
        return
    err = (got64 - want64).abs()
    bound = atol + rtol * want64.abs()
    if bool((err > bound).any()):
        raise AssertionError(
            f"{name}: max abs error {err.max().item():.3e} exceeds atol={atol} rtol={rtol} "
            f"(max |ref| {want64.abs().max().item():.3e})"
        )
