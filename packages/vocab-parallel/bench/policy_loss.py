"""Forward+backward time, peak extra memory and exactness of a clipped policy loss (GRPO / PPO,
token level) over hidden states and the output projection: ours and Liger-Kernel's side by side
in one process.

    python packages/vocab-parallel/bench/policy_loss.py --device cuda --sequences 8 --length 2048

B sequences of L completion tokens (lengths uniform in [L/2, L], the rest padding, labelled
ignore_index), one advantage per sequence, old log-probs within a spread of the current ones
(so that some ratios fall outside the clip range). The loss is Liger's and TRL's "bnpo":
sum over completion tokens of -min(r A, clip(r, 0.8, 1.2) A), r = exp(log p - old log p),
divided by the number of completion tokens (beta = 0: no KL term).

Variants (baseline: naive):
    naive           hidden @ weight.T, fp32 log_softmax + gather, the loss in PyTorch
    fused_policy    vocab_parallel.fused_linear_log_prob_loss: gradients formed in forward
                    (three logits-sized matmuls; defaults: fp32 weight-gradient sum)
    fused_policy_lean   the same with fp32_weight_grad=False (the weight gradient summed in
                    its bf16 dtype: no fp32 weight-sized buffer)
    fused_policy_all    the same with skip_ignored=False (the padding through the matmuls too)
    fused_policy_entropy   the same with with_entropy=True: each token's entropy formed in the
                    statistics pass and returned (for logging; the loss does not read it)
    recompute       vocab_parallel.linear_token_log_probs, then the loss in PyTorch (the
                    logits recomputed in backward: four matmuls)
    liger_grpo      liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss(loss_type="bnpo",
                    beta=0.0): its torch.compile'd loss over one sequence per chunk (CUDA,
                    optional import)

Exactness: the loss and the worst gradient against an fp32 reference computed by plain PyTorch
from the same inputs (relative error), next to the rounding floor of that reference in the
input dtype. Memory (CUDA): peak allocated during forward+backward above the inputs, also as a
multiple of the [T, V] logits in the input dtype ("x logits"; "transient" without the returned
gradients). Prints one table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch
from _measure import (
    GIB,
    Row,
    device_name,
    fp32_reference,
    measure,
    rounding_floor,
    run_info,
)
from _variants import IGNORE, Variant, backward_variant, peer_status, skipped

import vocab_parallel as vp
from train_testing.bench.runtime import add_device_argument


def clipped_loss_terms(
    log_p: torch.Tensor, old_log_p: torch.Tensor, advantage: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """Per-token -min(r A, clip(r, 0.8, 1.2) A) * weight, r = exp(log p - old log p)."""
    ratio = torch.exp(log_p - old_log_p)
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
    return -surrogate * weight


def _batch(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Hidden [B, L, H], weight [V, H] (leaves), labels [B, L], mask, advantages [B], old [B, L]."""
    gen = torch.Generator().manual_seed(0)
    b, length, h, v = args.sequences, args.length, args.hidden, args.vocab
    hidden = torch.randn(b, length, h, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device, dtype).requires_grad_()
    lengths = torch.randint(length // 2, length + 1, (b,), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(device)
    tokens = torch.randint(0, v, (b, length), generator=gen).to(device)
    labels = torch.where(mask, tokens, IGNORE)
    advantages = torch.randn(b, generator=gen).to(device)
    with torch.no_grad():  # the current log-probs, in fp32, one sequence at a time
        current = torch.stack(
            [vp.token_log_probs(hidden[i].float() @ weight.float().T, labels[i]) for i in range(b)]
        )
    old = current + args.spread * torch.randn(b, length, generator=gen).to(device)
    return {
        "hidden": hidden,
        "weight": weight,
        "labels": labels,
        "mask": mask,
        "advantages": advantages,
        "old": torch.where(mask, old, 0.0),
    }


def _variants(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, Variant]:
    hidden, weight, labels, mask = batch["hidden"], batch["weight"], batch["labels"], batch["mask"]
    advantages, old = batch["advantages"], batch["old"]
    per_token_advantage = advantages.unsqueeze(1).expand_as(old)
    scale = 1.0 / mask.sum().clamp(min=1).float()  # bnpo: over all completion tokens

    def make(fn) -> Variant:  # type: ignore[no-untyped-def]
        return backward_variant(fn, [hidden, weight], baseline="naive")

    def from_log_probs(log_p: torch.Tensor) -> torch.Tensor:
        terms = clipped_loss_terms(log_p, old, per_token_advantage, scale)
        return torch.where(mask, terms, 0.0).sum()

    def naive() -> torch.Tensor:
        logits = hidden @ weight.T
        log_p = torch.log_softmax(logits.float(), dim=-1)
        picked = log_p.gather(-1, torch.where(mask, labels, 0).unsqueeze(-1)).squeeze(-1)
        return from_log_probs(picked)

    def fused(**options: bool) -> torch.Tensor:
        loss = vp.fused_linear_log_prob_loss(
            hidden, weight, labels, clipped_loss_terms, (old, per_token_advantage, scale), **options
        )
        assert isinstance(loss, torch.Tensor)
        return loss

    def with_logged_entropy() -> torch.Tensor:
        loss, _log_p, _entropy = vp.fused_linear_log_prob_loss(  # type: ignore[misc]
            hidden,
            weight,
            labels,
            lambda log_p, _entropy, *rest: clipped_loss_terms(log_p, *rest),
            (old, per_token_advantage, scale),
            return_log_probs=True,
            with_entropy=True,
        )
        return loss

    out = {
        "naive": make(naive),
        "fused_policy": make(fused),
        "fused_policy_lean": make(lambda: fused(fp32_weight_grad=False)),
        "fused_policy_all": make(lambda: fused(skip_ignored=False)),
        "fused_policy_entropy": make(with_logged_entropy),
        "recompute": make(
            lambda: from_log_probs(vp.linear_token_log_probs(hidden, weight, labels))
        ),
    }
    status = peer_status("liger_kernel", device)
    if status != "ok":
        out["liger_grpo"] = skipped("naive", status)
        return out
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    liger = LigerFusedLinearGRPOLoss(
        beta=0.0, use_ref_model=False, loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.2
    )
    token_ids = torch.where(mask, labels, 0)

    def liger_loss() -> torch.Tensor:
        loss, _metrics = liger(
            hidden, weight, token_ids, mask.long(), advantages, old_per_token_logps=old
        )
        return loss

    out["liger_grpo"] = make(liger_loss)
    return out


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_argument(parser)
    parser.add_argument("--sequences", type=int, default=8, help="B completions")
    parser.add_argument("--length", type=int, default=2048, help="L tokens per completion")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--spread", type=float, default=0.15, help="std of old log-probs around the current"
    )
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: stdout only)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences, args.length, args.vocab, args.hidden = 2, 32, 500, 32
        args.repeats, args.warmup = 2, 1
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    batch = _batch(args, device, dtype)
    tokens = batch["labels"].numel()
    logits_bytes = tokens * args.vocab * batch["hidden"].element_size()
    variants = _variants(batch, device)
    reference = fp32_reference(
        [batch["hidden"], batch["weight"]], lambda h, w: _naive_fp32(batch, h, w)
    )
    floor = rounding_floor(reference[1], dtype)
    rows = measure(
        variants,
        device=device,
        warmup=args.warmup,
        repeats=args.repeats,
        logits_bytes=logits_bytes,
        reference=reference,
    )
    base = rows[0].median_ms
    for row in rows:
        if row.median_ms is not None and base is not None:
            row.speedup = base / row.median_ms
    trained = int(batch["mask"].sum())
    print(
        f"B={args.sequences} L={args.length} ({trained} of {tokens} tokens trained) "
        f"V={args.vocab} H={args.hidden} {args.dtype} on {device} ({device_name(device)}); "
        f"logits {logits_bytes / GIB:.4g} GiB; gradient rounding floor {floor:.2e}"
    )
    print(
        f"{'variant':<22}{'median ms':>11}{'peak GiB':>10}{'x logits':>10}{'transient':>11}"
        f"{'vs naive':>10}{'loss err':>10}{'grad err':>10}  status"
    )
    for row in rows:
        print(
            f"{row.variant:<22}{_fmt(row.median_ms, '.2f'):>11}{_fmt(row.peak_extra_gib, '.3f'):>10}"
            f"{_fmt(row.extra_over_logits, '.3f'):>10}{_fmt(row.transient_over_logits, '.3f'):>11}"
            f"{_fmt(row.speedup, '.3f'):>10}{_fmt(row.loss_rel_err, '.1e'):>10}"
            f"{_fmt(row.grad_rel_err, '.1e'):>10}  {row.status}"
        )
    report = {
        **run_info(device),
        "sequences": args.sequences,
        "length": args.length,
        "tokens": tokens,
        "trained_tokens": trained,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "spread": args.spread,
        "repeats": args.repeats,
        "logits_gib": logits_bytes / GIB,
        "rounding_floor_rel_err": floor,
        "rows": [asdict(r) for r in rows],
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return rows


def _naive_fp32(
    batch: dict[str, torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """The loss from fp32 logits (plain PyTorch), for the reference."""
    mask, labels = batch["mask"], batch["labels"]
    log_p = torch.log_softmax(hidden @ weight.T, dim=-1)
    picked = log_p.gather(-1, torch.where(mask, labels, 0).unsqueeze(-1)).squeeze(-1)
    advantage = batch["advantages"].unsqueeze(1).expand_as(picked)
    scale = 1.0 / mask.sum().clamp(min=1).float()
    terms = clipped_loss_terms(picked, batch["old"], advantage, scale)
    return torch.where(mask, terms, 0.0).sum()


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    main()
