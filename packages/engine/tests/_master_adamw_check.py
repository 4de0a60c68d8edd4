"""MasterWeightAdamW against a float64 torch.optim.AdamW on the master weights (shared checks).

Used in-process by the CPU tests (torch backend), in a subprocess under TRITON_INTERPRET=1 for
the Triton kernel on the CPU, and on CUDA by the GPU test. ``python _master_adamw_check.py
<backend> <device>`` prints the result as JSON.
"""

from __future__ import annotations

import json
import sys

import torch

from train_engine import MasterWeightAdamW
from train_testing.reference import relative_error

#: Odd sizes (blocks end mid-tensor), a 0-dim-like scalar, a tensor of several blocks.
SHAPES = [(37, 29), (5,), (1,), (3, 1031), (2500,)]


def reference_masters(
    initial: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    scales: list[float],
) -> list[torch.Tensor]:
    """The master weights after ``len(grads)`` float64 AdamW steps (grads divided by scales)."""
    # On the CPU whatever device ran the optimizer: the gradients live there too.
    masters = [t.detach().cpu().to(torch.float64).requires_grad_(True) for t in initial]
    opt = torch.optim.AdamW(masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    for step_grads, scale in zip(grads, scales, strict=True):
        for master, grad in zip(masters, step_grads, strict=True):
            master.grad = grad.cpu().to(torch.float64) / scale
        opt.step()
    return [m.detach() for m in masters]


def run(
    backend: str, device: str, *, dtype: torch.dtype = torch.bfloat16, lr: float = 2e-3
) -> dict[str, float]:
    """Three updates (the second with a grad_scale, one skipped); the worst errors.

    Returns:
        ``master_rel_err``: worst relative error of the fp32 masters against float64;
        ``param_ulps``: the largest |param - master rounded to nearest| in units of the
        parameter dtype's spacing (0: every parameter is its master rounded to nearest);
        ``skip_changed``: how much the skipped update moved anything (must be 0);
        ``step_count``: the counters after the run (must be 3).
    """
    gen = torch.Generator().manual_seed(7)
    params = [
        torch.nn.Parameter((0.1 * torch.randn(s, generator=gen)).to(device, dtype)) for s in SHAPES
    ]
    # The last parameter starts one element into its storage: 16-byte alignment is not
    # guaranteed (its group takes the unaligned path of the kernel, the other group the aligned).
    padded = torch.empty(params[-1].numel() + 1, device=device, dtype=dtype)
    padded[1:].copy_(params[-1].detach())
    params[-1] = torch.nn.Parameter(padded[1:])
    initial = [p.detach().clone() for p in params]
    settings = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt = MasterWeightAdamW(
        [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}],
        **settings,  # type: ignore[arg-type]
        backend=backend,  # type: ignore[arg-type]
    )
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in SHAPES] for _ in range(3)]
    scales = [1.0, 4.0, 1.0]
    skip_changed = 0.0
    for step, (step_grads, scale) in enumerate(zip(grads, scales, strict=True)):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.to(device)
        opt.grad_scale = torch.tensor(scale, device=device) if scale != 1.0 else None
        if step == 1:
            # A skipped update first: nothing may move.
            before = [t.clone() for t in _everything(opt, params)]
            opt.found_inf = torch.tensor(1.0, device=device)
            opt.step()
            after = _everything(opt, params)
            skip_changed = max(
                float((a - b).abs().max()) for a, b in zip(after, before, strict=True)
            )
            opt.found_inf = torch.tensor(0.0, device=device)
        opt.step()
        opt.grad_scale = opt.found_inf = None
    # The reference: group 0 decays, group 1 does not; run each group separately.
    expected = (
        reference_masters(
            initial[:3],
            [g[:3] for g in grads],
            scales=scales,
            **settings,  # type: ignore[arg-type]
        )
        + reference_masters(
            initial[3:],
            [g[3:] for g in grads],
            scales=scales,
            **{**settings, "weight_decay": 0.0},  # type: ignore[arg-type]
        )
    )
    rel = 0.0
    mismatch = 0.0
    for p, ref in zip(params, expected, strict=True):
        master = opt.state[p].get("master_param", p).detach().cpu().to(torch.float64)
        rel = max(rel, relative_error(master, ref))
        # In units of the parameter dtype's spacing at the master's magnitude.
        spacing = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(master.abs())))
        gap = (p.detach().cpu().to(torch.float64) - master.to(dtype).to(torch.float64)).abs()
        mismatch = max(mismatch, float((gap / spacing).max()))
    steps = {float(opt.state[p]["step"]) for p in params}
    return {
        "master_rel_err": rel,
        "param_ulps": mismatch,
        "skip_changed": skip_changed,
        "step_count": steps.pop() if len(steps) == 1 else -1.0,
    }


def _everything(opt: MasterWeightAdamW, params: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [p.detach().float() for p in params]
    for p in params:
        out += [t.detach().float().reshape(-1) for t in opt.state[p].values()]
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2])))
