"""Measurement shared by the vocab-parallel benches: timing, peak memory and exactness of
variants against an fp32 reference, one row each (see log_probs.py, policy_loss.py)."""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _variants import Variant

from train_testing.bench.runtime import sync, times_ms

GIB = 1024**3


@dataclass(kw_only=True, slots=True)
class Row:
    """One variant's measurements; a variant that did not run keeps the defaults (no numbers)."""

    variant: str
    baseline: str
    median_ms: float | None = None
    peak_extra_gib: float | None = None
    extra_over_logits: float | None = None
    grad_gib: float = 0.0
    transient_over_logits: float | None = None
    speedup: float | None = None
    over_floor: float | None = None
    status: str = "ok"
    loss_rel_err: float | None = None
    grad_rel_err: float | None = None


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    return statistics.median(times_ms(fn, device, warmup=warmup, iters=repeats))


def peak_extra(
    fn: Callable[[], object], reset: Callable[[], None], device: torch.device
) -> float | None:
    if device.type != "cuda":
        return None
    reset()  # free the previous run's gradients, so that they count in this peak
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / GIB


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm().clamp(min=1e-30))


def fp32_reference(
    inputs: list[torch.Tensor], loss_fn: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fp32 loss and gradients of ``loss_fn`` at fp32 copies of ``inputs`` (plain PyTorch)."""
    leaves = [x.detach().float().requires_grad_() for x in inputs]
    loss = loss_fn(*leaves)
    grads = list(torch.autograd.grad(loss, leaves))
    return loss.detach(), grads


def check(
    variant: Variant, ref_loss: torch.Tensor, ref_grads: list[torch.Tensor]
) -> tuple[float, float]:
    variant.reset()
    if variant.prepare is not None:
        variant.prepare()
    loss, grads = variant.step()
    assert loss is not None and len(grads) == len(ref_grads), (loss, len(grads))
    grad_err = max(rel(g, r) for g, r in zip(grads, ref_grads, strict=True))
    loss_err = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-30)
    variant.reset()
    return loss_err, grad_err


def measure(
    variants: dict[str, Variant],
    *,
    device: torch.device,
    warmup: int,
    repeats: int,
    logits_bytes: int,
    reference: tuple[torch.Tensor, list[torch.Tensor]],
) -> list[Row]:
    rows = []
    for name, variant in variants.items():
        if variant.status not in ("ok", "bound"):
            rows.append(Row(variant=name, baseline=variant.baseline, status=variant.status))
            continue
        loss_err = grad_err = None
        try:
            if variant.status == "ok":
                loss_err, grad_err = check(variant, *reference)
            ms = time_ms(variant.step, device, warmup, repeats)
            peak = peak_extra(variant.step, variant.reset, device)
        except (RuntimeError, AssertionError, TypeError, ValueError) as error:
            # A form that cannot run these inputs (a peer's dtype assertion, say) is a row
            # that says why, not the end of the run for every other form.
            variant.reset()
            message = " ".join(str(error).split())[:120]
            rows.append(
                Row(
                    variant=name,
                    baseline=variant.baseline,
                    status=f"failed: {type(error).__name__}: {message}",
                )
            )
            continue
        rows.append(
            Row(
                variant=name,
                baseline=variant.baseline,
                median_ms=ms,
                peak_extra_gib=peak,
                extra_over_logits=None if peak is None else peak * GIB / logits_bytes,
                grad_gib=variant.grad_bytes / GIB,
                transient_over_logits=(
                    None if peak is None else (peak * GIB - variant.grad_bytes) / logits_bytes
                ),
                status="ok",
                loss_rel_err=loss_err,
                grad_rel_err=grad_err,
            )
        )
        variant.reset()
    return rows


def rounding_floor(grads: list[torch.Tensor], dtype: torch.dtype) -> float:
    return max(rel(g.to(dtype), g) for g in grads)


def peer_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("liger-kernel", "cut-cross-entropy", "triton"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def run_info(device: torch.device) -> dict[str, object]:
    """What every report starts with: the device, torch, vocab-parallel and the peers' versions."""
    import vocab_parallel as vp

    return {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "vocab_parallel": vp.__version__,
        "peers": peer_versions(),
        "python": platform.python_version(),
    }
