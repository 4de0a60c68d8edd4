"""Rank functions for plain local vocabulary shards + a process group (Megatron's layout).

Imported by every spawned rank: keep it light.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import _vp_reference as reference
import vocab_parallel as vp
from _vp_reference import IGNORE
from train_testing.reference import token_log_probs


def _close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, what: str) -> None:
    torch.testing.assert_close(
        actual.detach().double(),
        expected.detach().double(),
        atol=atol,
        rtol=1e-5,
        equal_nan=True,
        msg=lambda m: f"rank {dist.get_rank()}, {what}: {m}",
    )


def _split_points(vocab: int, world: int, uneven: bool) -> list[int]:
    """Column boundaries of each rank's shard: even (Megatron) or deliberately lopsided."""
    if not uneven:
        assert vocab % world == 0
        return [r * (vocab // world) for r in range(world + 1)]
    # Rank 0 holds about two thirds: an offset no even-split rule would produce.
    first = (2 * vocab) // 3
    rest = [first + (vocab - first) * r // (world - 1) for r in range(world)]
    return [0, *rest]


def check_plain_logits(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[str]:
    """Log-probs, entropy and cross-entropy on a plain [S, B, Vl] shard vs float64 and DTensor."""
    group = dist.group.WORLD
    mesh = init_device_mesh("cpu", (world_size,))
    done = []
    for case in cases:
        vocab, uneven, seed = case["vocab"], case["uneven"], case.get("seed", 0)
        temp, shape = 0.7, (5, 2)  # Megatron's [S, B] leading dims
        bounds = _split_points(vocab, world_size, uneven)
        start, stop = bounds[rank], bounds[rank + 1]
        layout: Any = group
        if uneven:
            layout = vp.VocabSplit(group=group, vocab_start=start, vocab_size=vocab)
        what = f"V={vocab} uneven={uneven}"

        full = reference.make_logits(shape, vocab, seed=seed)
        labels = reference.make_labels(shape, vocab, seed=seed, ignore_index=IGNORE)
        ref = full.double().requires_grad_()
        local = full[..., start:stop].clone().requires_grad_()
        log_p, ent = vp.token_log_probs_and_entropy(
            local, labels, temperature=temp, vocab_group=layout
        )
        lp_only = vp.token_log_probs(local, labels, temperature=temp, vocab_group=layout)
        ent_only = vp.token_entropy(local, temperature=temp, vocab_group=layout)
        ce = vp.cross_entropy(local, labels, vocab_group=layout, label_smoothing=0.1)
        ref_lp = token_log_probs(ref, labels, temperature=temp)
        ref_h = reference.ref_entropy(ref, temp)
        ref_ce = reference.ref_cross_entropy(ref, labels, IGNORE, "mean", 0.1)
        for name, value, expected in (
            ("log-probs", log_p, ref_lp),
            ("token_log_probs", lp_only, ref_lp),
            ("entropy", ent, ref_h),
            ("token_entropy", ent_only, ref_h),
            ("cross-entropy", ce, ref_ce),
        ):
            _close(value, expected, atol=3e-5, what=f"{what} {name}")
        w1, w2 = reference.upstream(shape, seed=seed), reference.upstream(shape, seed=seed + 3)
        (log_p.double() * w1 + ent.double() * w2 + ce.double()).sum().backward()
        (ref_lp * w1 + ref_h * w2 + ref_ce).sum().backward()
        assert local.grad is not None
        # Each rank's gradient is its own columns of the full gradient; no collective needed.
        _close(local.grad, ref.grad[..., start:stop], atol=3e-6, what=f"{what} gradient")

        if not uneven:  # DTensor's Shard(-1) is the same even split: the paths agree exactly
            x = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
            dt_lp, dt_ent = vp.token_log_probs_and_entropy(x, labels, temperature=temp)
            torch.testing.assert_close(log_p, dt_lp, rtol=0, atol=0)
            torch.testing.assert_close(ent, dt_ent, rtol=0, atol=0)
            (dt_lp.double() * w1 + dt_ent.double() * w2).sum().backward()
            local.grad = None
            log_p, ent = vp.token_log_probs_and_entropy(
                local, labels, temperature=temp, vocab_group=layout
            )
            (log_p.double() * w1 + ent.double() * w2).sum().backward()
            torch.testing.assert_close(local.grad, x.grad.to_local(), rtol=0, atol=0)
        done.append(what)
    return done


def check_plain_fused_linear(rank: int, world_size: int, uneven: bool) -> str:
    """The fused linear forms on a plain [Vl, H] output-layer shard vs float64 autograd."""
    group = dist.group.WORLD
    vocab, hidden_size, shape, temp = 40, 8, (6, 2), 1.3
    bounds = _split_points(vocab, world_size, uneven)
    start, stop = bounds[rank], bounds[rank + 1]
    layout: Any = group
    if uneven:
        layout = vp.VocabSplit(group=group, vocab_start=start, vocab_size=vocab)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.6
    hidden_full = torch.randn(*shape, hidden_size, generator=gen)
    labels = reference.make_labels(shape, vocab, seed=5, ignore_index=IGNORE)
    coef = reference.upstream(shape, seed=9).float()

    wd = weight.double().requires_grad_()
    hd = hidden_full.double().requires_grad_()
    ref_lp = token_log_probs(hd @ wd.T, labels, temperature=temp)
    ref_ce = reference.ref_cross_entropy(hd @ wd.T, labels, IGNORE, "mean", 0.0)
    for name, fn, ref_value in (
        (
            "linear_token_log_probs",
            lambda h, w: (
                vp.linear_token_log_probs(
                    h, w, labels, temperature=temp, vocab_group=layout, chunk_size=3
                ).double()
                * coef.double()
            ).sum(),
            (ref_lp * coef.double()).sum(),
        ),
        (
            "fused_linear_token_loss",
            lambda h, w: vp.fused_linear_token_loss(
                h, w, labels, coef, temperature=temp, vocab_group=layout
            ),
            (ref_lp * coef.double()).sum(),
        ),
        (
            "linear_cross_entropy",
            lambda h, w: vp.linear_cross_entropy(h, w, labels, vocab_group=layout),
            ref_ce,
        ),
    ):
        ref_w_grad, ref_h_grad = torch.autograd.grad(ref_value, [wd, hd], retain_graph=True)
        local_w = weight[start:stop].clone().requires_grad_()
        h = hidden_full.clone().requires_grad_()
        value = fn(h, local_w)
        _close(value, ref_value, atol=2e-5, what=f"{name} value")
        value.backward()
        assert local_w.grad is not None and h.grad is not None
        _close(local_w.grad, ref_w_grad[start:stop], atol=2e-5, what=f"{name} weight grad")
        # The hidden gradient is summed over the vocabulary ranks: full on every rank.
        _close(h.grad, ref_h_grad, atol=2e-5, what=f"{name} hidden grad")
    return f"rank {rank}: rows [{start}, {stop}) of {vocab}"


def check_plain_errors(rank: int, world_size: int) -> str:
    """Bad layouts are refused before any collective, naming the value and the fix."""
    group = dist.group.WORLD
    mesh = init_device_mesh("cpu", (world_size,))
    logits = torch.randn(3, 4)
    labels = torch.zeros(3, dtype=torch.long)
    with pytest.raises(TypeError, match="to_local"):
        vp.token_log_probs(
            distribute_tensor(torch.randn(3, 8), mesh, [Shard(-1)]), labels, vocab_group=group
        )
    with pytest.raises(ValueError, match="give both"):
        vp.token_entropy(logits, vocab_group=vp.VocabSplit(group=group, vocab_start=0))
    with pytest.raises(ValueError, match="does not fit"):
        vp.cross_entropy(
            logits, labels, vocab_group=vp.VocabSplit(group=group, vocab_start=6, vocab_size=8)
        )
    with pytest.raises(TypeError, match="ProcessGroup"):
        vp.token_log_probs(logits, labels, vocab_group=2)  # type: ignore[arg-type]
    return "ok"
