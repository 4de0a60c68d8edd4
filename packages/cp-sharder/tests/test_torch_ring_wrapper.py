"""The autograd wrapper that re-enters torch's ring dispatch for backward (CPU mechanics).

The ring kernels themselves need CUDA (tests/test_sharder_cuda.py); here a recording context stands in
for torch's, to prove that backward runs inside it and that gradients are those of plain SDPA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from cp_sharder.attention.torch_ring import hf_ring_attention


class _Module(torch.nn.Module):
    is_causal = True


def test_backward_runs_inside_the_reentered_context_and_matches_sdpa() -> None:
    torch.manual_seed(0)
    entered: list[bool] = []
    inside = [False]

    @contextlib.contextmanager
    def reenter() -> Iterator[None]:
        entered.append(torch.is_grad_enabled())
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    up = torch.randn(2, 6, 4, 8, dtype=torch.float64)

    out, _ = hf_ring_attention(_Module(), q, k, v, None, scaling=0.3, reenter=reenter)
    assert entered == [], "forward must not re-enter (it already runs inside train_ctx)"
    (out * up).sum().backward()
    assert len(entered) == 1, "backward must run inside the ring context exactly once"

    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        qr, kr.repeat_interleave(2, 1), vr.repeat_interleave(2, 1), is_causal=True, scale=0.3
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref.detach())
    (ref * up).sum().backward()
    for got, want in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(got.grad, want.grad)


def test_no_graph_is_kept_without_gradients() -> None:
    q = torch.randn(1, 2, 4, 8)
    with torch.no_grad():
        out, _ = hf_ring_attention(_Module(), q, q, q, None, reenter=contextlib.nullcontext)
    assert out.grad_fn is None
