"""The variants that bench/log_probs.py times: ours and the peers, each a forward+backward
step of the token-sum cross-entropy that returns its loss and gradients (see log_probs.py)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

import vocab_parallel as vp

IGNORE = -100


# A step runs forward+backward once and returns (loss, gradients) for the exactness check.
Step = Callable[[], tuple[torch.Tensor | None, list[torch.Tensor]]]


@dataclass(kw_only=True, slots=True)
class Variant:
    baseline: str
    step: Step
    reset: Callable[[], None]
    grad_bytes: int  # memory the returned gradients take (0 when written in place)
    status: str = "ok"
    prepare: Callable[[], None] | None = None  # before the exactness run (fresh inputs)


def naive_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def naive_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-sum cross-entropy; ignored labels read column 0 and are masked out."""
    valid = labels != IGNORE
    log_p = naive_log_probs(logits, torch.where(valid, labels, 0))
    return -(log_p * valid).sum()


def peer_status(module: str, device: torch.device) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    return "ok" if device.type == "cuda" else "needs CUDA"


def skipped(baseline: str, status: str) -> Variant:
    def nothing() -> tuple[None, list[torch.Tensor]]:
        return None, []

    return Variant(baseline=baseline, step=nothing, reset=lambda: None, grad_bytes=0, status=status)


def logits_variants(
    logits: torch.Tensor, labels: torch.Tensor, device: torch.device
) -> dict[str, Variant]:
    """Variants on materialised logits [T, V] (a leaf that requires grad)."""
    # The in-place forms overwrite their input: they get a buffer of their own. Timed runs
    # reuse it as overwritten (the arithmetic does not depend on the values); the exactness
    # run refills it first.
    buffer = logits.detach().clone().requires_grad_()
    grad_bytes = logits.numel() * logits.element_size()

    def clear() -> None:
        logits.grad = None
        buffer.grad = None

    def refill() -> None:
        with torch.no_grad():
            buffer.copy_(logits)

    def on(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> Step:
        def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
            clear()
            loss = fn(x)
            loss.backward()
            assert x.grad is not None
            return loss.detach(), [x.grad]

        return step

    out = {
        "naive": Variant(
            baseline="naive",
            step=on(logits, lambda x: naive_loss(x, labels)),
            reset=clear,
            grad_bytes=grad_bytes,
        )
    }
    if device.type == "cuda":
        compiled = torch.compile(naive_loss, dynamic=False)
        out["naive_compiled"] = Variant(
            baseline="naive",
            step=on(logits, lambda x: compiled(x, labels)),
            reset=clear,
            grad_bytes=grad_bytes,
        )
    out["ours"] = Variant(
        baseline="naive",
        step=on(logits, lambda x: vp.cross_entropy(x, labels, reduction="sum")),
        reset=clear,
        grad_bytes=grad_bytes,
    )
    if device.type == "cuda":
        out["ours_torch"] = Variant(
            baseline="naive",
            step=on(
                logits, lambda x: vp.cross_entropy(x, labels, reduction="sum", backend="torch")
            ),
            reset=clear,
            grad_bytes=grad_bytes,
        )
    out["ours_in_place"] = Variant(
        baseline="naive",
        step=on(buffer, lambda x: vp.cross_entropy(x, labels, reduction="sum", in_place=True)),
        reset=clear,
        grad_bytes=0,
        prepare=refill,
    )
    status = peer_status("liger_kernel", device)
    if status != "ok":
        out["liger_ce"] = skipped("naive", status)
    else:
        from liger_kernel.transformers.functional import liger_cross_entropy

        out["liger_ce"] = Variant(
            baseline="naive",
            step=on(
                buffer,
                lambda x: liger_cross_entropy(x, labels, ignore_index=IGNORE, reduction="sum"),
            ),
            reset=clear,
            grad_bytes=0,
            prepare=refill,
        )
    return out


def backward_variant(
    loss_fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], *, baseline: str
) -> Variant:
    """A variant whose step runs ``loss_fn().backward()`` and returns the leaves' gradients."""
    grad_bytes = sum(x.numel() * x.element_size() for x in leaves)

    def clear() -> None:
        for leaf in leaves:
            leaf.grad = None

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        clear()
        loss = loss_fn()
        loss.backward()
        grads = [leaf.grad for leaf in leaves]
        assert all(g is not None for g in grads), "a leaf got no gradient"
        return loss.detach(), grads  # type: ignore[return-value]

    return Variant(baseline=baseline, step=step, reset=clear, grad_bytes=grad_bytes)


def linear_variants(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    device: torch.device,
    *,
    linear_blocks: list[int],
    fused_chunks: list[int],
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, Variant]:
    """Variants on hidden [T, H] and weight [V, H] (leaves that require grad).

    With ``autocast_dtype`` every forward runs under ``torch.autocast`` in that dtype (the
    leaves are then fp32 master tensors, as in an AMP loop); backward runs outside it.
    """

    def make(fn: Callable[[], torch.Tensor]) -> Variant:
        def forward() -> torch.Tensor:
            with torch.autocast(
                device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
            ):
                return fn()

        return backward_variant(forward, [hidden, weight], baseline="naive_linear")

    def recompute_form(**options: object) -> torch.Tensor:
        log_p = vp.linear_token_log_probs(hidden, weight, labels, **options)  # type: ignore[arg-type]
        return -log_p.sum()

    def grads_in_forward(**options: object) -> torch.Tensor:
        return vp.linear_cross_entropy(hidden, weight, labels, reduction="sum", **options)  # type: ignore[arg-type]

    out = {
        "naive_linear": make(lambda: naive_loss(hidden @ weight.T, labels)),
        "fused_linear": make(recompute_form),
        "fused_linear_all": make(lambda: recompute_form(skip_ignored=False)),
    }
    if device.type == "cuda":
        for rows in linear_blocks:
            out[f"fused_linear_b{rows}"] = make(lambda rows=rows: recompute_form(chunk_size=rows))
    out["grads_in_forward"] = make(grads_in_forward)
    out["grads_in_forward_fast"] = make(lambda: grads_in_forward(fp32_weight_grad=False))
    out["grads_in_forward_exact"] = make(lambda: grads_in_forward(fp32_logits=True))
    if device.type == "cuda":
        for tokens in fused_chunks:
            out[f"grads_in_forward_c{tokens}"] = make(
                lambda tokens=tokens: grads_in_forward(chunk_size=tokens)
            )
            out[f"grads_in_forward_fast_c{tokens}"] = make(
                lambda tokens=tokens: grads_in_forward(chunk_size=tokens, fp32_weight_grad=False)
            )
    status = peer_status("liger_kernel", device)
    if status != "ok":
        out["liger_fused_linear"] = skipped("naive_linear", status)
    else:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        out["liger_fused_linear"] = make(
            lambda: liger_fused_linear_cross_entropy(
                hidden, weight, labels, ignore_index=IGNORE, reduction="sum"
            )
        )
    status = peer_status("cut_cross_entropy", device)
    for name, filter_eps in (("cce", "high"), ("cce_exact", None)):
        if status != "ok":
            out[name] = skipped("naive_linear", status)
            continue
        from cut_cross_entropy import linear_cross_entropy as cce

        # CCE's backward asserts 16-bit embeddings: under autocast its operands are cast to
        # autocast's dtype first, as a caller must (the casts' backward upcasts its gradients).
        def operand(x: torch.Tensor) -> torch.Tensor:
            return x if autocast_dtype is None else x.to(autocast_dtype)

        out[name] = make(
            lambda filter_eps=filter_eps: cce(
                operand(hidden),
                operand(weight),
                labels,
                ignore_index=IGNORE,
                reduction="sum",
                filter_eps=filter_eps,
                impl="cce",
            )
        )
    if device.type == "cuda":
        # The bounds' operands in the dtype the matmuls run in (autocast's, else the inputs').
        matmul_dtype = autocast_dtype or weight.dtype
        h_in, w_in = hidden.detach().to(matmul_dtype), weight.detach().to(matmul_dtype)
        grad_logits = torch.randn(
            labels.numel(), weight.shape[0], device=device, dtype=matmul_dtype
        )

        def matmuls(count: int) -> Variant:
            def step() -> tuple[None, list[torch.Tensor]]:
                with torch.no_grad():
                    for _ in range(count - 2):  # forward (and the recomputation in backward)
                        h_in @ w_in.T
                    grad_logits @ w_in
                    grad_logits.T @ h_in
                return None, []

            return Variant(
                baseline="naive_linear",
                step=step,
                reset=out["naive_linear"].reset,
                grad_bytes=0,
                status="bound",
            )

        out["three_matmuls"] = matmuls(3)
        out["four_matmuls"] = matmuls(4)
    return out
