"""Functions run on spawned gloo ranks (imported by every rank: keep it light)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import _vp_reference as reference
import vocab_parallel as vp
from _vp_reference import IGNORE
from train_testing.reference import relative_error, token_log_probs, token_sum_cross_entropy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (value atol, grad atol, grad rtol)
TOL = {torch.float32: (3e-5, 3e-6, 1e-5), torch.bfloat16: (5e-5, 4e-3, 1e-2)}

# One mesh per shape for the life of a rank process: building a mesh creates process groups,
# a collective that every rank must join, so tests reuse them.
_MESHES: dict[tuple[str, tuple[int, ...]], DeviceMesh] = {}


def _mesh(shape: tuple[int, ...], device: str = "cpu") -> DeviceMesh:
    if (device, shape) not in _MESHES:
        _MESHES[device, shape] = init_device_mesh(device, shape)
    return _MESHES[device, shape]


def _placements(ndim: int, vocab_mesh_dim: int | None, shard: Any) -> list[Any]:
    placements: list[Any] = [Replicate()] * ndim
    if vocab_mesh_dim is not None:
        placements[vocab_mesh_dim] = shard
    return placements


def _close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, what: str):
    torch.testing.assert_close(
        actual.detach().cpu().double(),
        expected,
        atol=atol,
        rtol=rtol,
        equal_nan=True,
        msg=lambda m: f"rank {dist.get_rank()}, {what}: {m}",
    )


def _same_on_all_ranks(t: torch.Tensor, what: str) -> None:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    for rank, other in enumerate(gathered):
        # Bitwise equal; nan == nan (a mean over all-ignored labels is nan, as in PyTorch).
        torch.testing.assert_close(
            other,
            t,
            rtol=0,
            atol=0,
            equal_nan=True,
            msg=lambda m, rank=rank: (
                f"{what} differs between rank {dist.get_rank()} and {rank}: {m}"
            ),
        )


def check_logits_parity(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[str]:
    """All four logits functions on a vocab-sharded DTensor vs the float64 reference."""
    done = []
    for case in cases:
        vocab, dtype = case["vocab"], DTYPES[case["dtype"]]
        device = case.get("device", "cpu")
        mesh = _mesh(tuple(case["mesh"]), device)
        placements = _placements(mesh.ndim, case["vocab_mesh_dim"], Shard(-1))
        shape, seed = tuple(case.get("shape", (2, 3))), case.get("seed", 0)
        temp = case.get("temperature", 0.8)
        masked = case.get("masked", 0)
        what = f"case {case}"
        v_atol, g_atol, g_rtol = TOL[dtype]

        full = reference.make_logits(shape, vocab, seed=seed, masked_columns=masked).to(dtype)
        labels = reference.make_labels(shape, vocab, seed=seed, low=masked, ignore_index=IGNORE)
        ref = full.double().requires_grad_()
        full, labels_cpu, labels = full.to(device), labels, labels.to(device)
        x = distribute_tensor(full, mesh, placements).requires_grad_()
        log_p, ent = vp.token_log_probs_and_entropy(x, labels, temperature=temp)
        ce = vp.cross_entropy(x, labels)
        for name, value in (("log-probs", log_p), ("entropy", ent), ("cross-entropy", ce)):
            assert not isinstance(value, DTensor), f"{name} should be a plain tensor"
            _same_on_all_ranks(value, f"{what} {name}")
        ref_lp = token_log_probs(ref, labels_cpu, temperature=temp)
        ref_h = reference.ref_entropy(ref, temp)
        ref_ce = reference.ref_cross_entropy(ref, labels_cpu, IGNORE, "mean", 0.0)
        _close(log_p, ref_lp, atol=v_atol, rtol=1e-5, what=f"{what} log-probs")
        _close(ent, ref_h, atol=v_atol, rtol=1e-5, what=f"{what} entropy")
        _close(ce, ref_ce, atol=v_atol, rtol=1e-5, what=f"{what} cross-entropy")
        w1, w2 = reference.upstream(shape, seed=seed), reference.upstream(shape, seed=seed + 7)
        (
            log_p.double() * w1.to(device) + ent.double() * w2.to(device) + ce.double()
        ).sum().backward()
        (ref_lp * w1 + ref_h * w2 + ref_ce).sum().backward()
        assert isinstance(x.grad, DTensor), f"{what}: the gradient should be a DTensor"
        assert tuple(x.grad.placements) == tuple(x.placements), (x.grad.placements, placements)
        _close(x.grad.full_tensor(), ref.grad, atol=g_atol, rtol=g_rtol, what=f"{what} gradient")

        if not masked:  # label smoothing with a -inf logit is infinite in PyTorch too
            y = distribute_tensor(full, mesh, placements).requires_grad_()
            ref_y = full.detach().cpu().double().requires_grad_()
            smooth = vp.cross_entropy(y, labels, label_smoothing=0.15, reduction="sum")
            ref_smooth = reference.ref_cross_entropy(ref_y, labels_cpu, IGNORE, "sum", 0.15)
            _close(smooth, ref_smooth, atol=10 * v_atol, rtol=1e-5, what=f"{what} smoothed CE")
            smooth.backward()
            ref_smooth.backward()
            assert isinstance(y.grad, DTensor)
            _close(y.grad.full_tensor(), ref_y.grad, atol=g_atol, rtol=g_rtol, what="smoothed")
        done.append(f"V={vocab} mesh={case['mesh']} dim={case['vocab_mesh_dim']} {dtype} {device}")
    return done


def check_colwise_lm_head(rank: int, world_size: int, vocab: int, dtype_name: str) -> list[str]:
    """A ColwiseParallel lm_head: logits path and fused path, gradients to the sharded weight."""
    dtype = DTYPES[dtype_name]
    v_atol, _, g_rtol = TOL[dtype]
    hidden_size, shape, temp = 8, (2, 3), 1.2
    mesh = _mesh((world_size,))
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.7).to(dtype)
    hidden_full = torch.randn(*shape, hidden_size, generator=gen).to(dtype)
    labels = reference.make_labels(shape, vocab, seed=11, ignore_index=IGNORE)
    w1, w2 = reference.upstream(shape, seed=12), reference.upstream(shape, seed=13)

    wd = weight.double().requires_grad_()
    hd = hidden_full.double().requires_grad_()
    ref_logits = hd @ wd.T
    ref_lp = token_log_probs(ref_logits, labels, temperature=temp)
    ref_h = reference.ref_entropy(ref_logits, temp)
    ref_w_grad, ref_h_grad = torch.autograd.grad(
        (ref_lp * w1 + ref_h * w2).sum(), [wd, hd], retain_graph=True
    )

    head = nn.Linear(hidden_size, vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    head = parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
    hidden = hidden_full.clone().requires_grad_()
    logits = head(hidden)
    assert isinstance(logits, DTensor) and logits.placements[0].is_shard(logits.ndim - 1)
    log_p, ent = vp.token_log_probs_and_entropy(logits, labels, temperature=temp)
    # Our values come from bf16 logits, the reference from exact products: compare loosely.
    loose = 0.05 if dtype == torch.bfloat16 else v_atol
    _close(log_p, ref_lp, atol=loose, rtol=1e-4, what="colwise log-probs")
    _close(ent, ref_h, atol=loose, rtol=1e-4, what="colwise entropy")
    (log_p.double() * w1 + ent.double() * w2).sum().backward()
    w_grad = head.weight.grad
    assert isinstance(w_grad, DTensor) and w_grad.placements == (Shard(0),), w_grad
    g_loose = 0.05 if dtype == torch.bfloat16 else 1e-5
    _close(w_grad.full_tensor(), ref_w_grad, atol=g_loose, rtol=g_rtol, what="weight grad")
    assert hidden.grad is not None
    _close(hidden.grad, ref_h_grad, atol=g_loose, rtol=g_rtol, what="hidden grad")

    # The fused form on the same sharded weight.
    ref_w_grad, ref_h_grad = torch.autograd.grad((ref_lp * w1).sum(), [wd, hd])
    head.weight.grad = None
    hidden.grad = None
    fused = vp.linear_token_log_probs(hidden, head.weight, labels, temperature=temp, chunk_size=3)
    _same_on_all_ranks(fused, "fused log-probs")
    _close(fused, ref_lp, atol=loose, rtol=1e-4, what="fused log-probs")
    (fused.double() * w1).sum().backward()
    w_grad = head.weight.grad
    assert isinstance(w_grad, DTensor) and w_grad.placements == (Shard(0),), w_grad
    _close(w_grad.full_tensor(), ref_w_grad, atol=g_loose, rtol=g_rtol, what="fused weight grad")
    _close(hidden.grad, ref_h_grad, atol=g_loose, rtol=g_rtol, what="fused hidden grad")
    _same_on_all_ranks(hidden.grad, "fused hidden grad")

    # Hidden states as a Replicate DTensor: the gradient comes back as a Replicate DTensor.
    head.weight.grad = None
    hidden_dt = distribute_tensor(hidden_full, mesh, [Replicate()]).requires_grad_()
    fused = vp.linear_token_log_probs(hidden_dt, head.weight, labels, temperature=temp)
    (fused.double() * w1).sum().backward()
    h_grad = hidden_dt.grad
    assert isinstance(h_grad, DTensor) and h_grad.placements == (Replicate(),), h_grad
    _close(h_grad.to_local(), ref_h_grad, atol=g_loose, rtol=g_rtol, what="DTensor hidden grad")
    local_rows = head.weight.to_local().shape[0]
    return [f"rank {rank}: {local_rows} of {vocab} rows"]


def _check_sharded_grads(
    rank: int,
    what: str,
    weight_grad: DTensor,
    hidden_grad: torch.Tensor,
    ref_weight_grad: torch.Tensor,
    ref_hidden_grad: torch.Tensor,
    tol: float,
) -> None:
    """The hidden gradient is the same on every rank; both are within ``tol`` (relative)."""
    _same_on_all_ranks(hidden_grad, f"{what} hidden grad")
    for grad_name, got, want in (
        ("weight", weight_grad.full_tensor(), ref_weight_grad),
        ("hidden", hidden_grad, ref_hidden_grad),
    ):
        err = relative_error(got, want)
        assert err <= tol, f"rank {rank} {what} {grad_name} grad: relative error {err}"


def _autocast_on_sharded_head(
    rank: int,
    mesh: DeviceMesh,
    hidden_full: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temp: float,
) -> list[str]:
    """fp32 master tensors under bf16 autocast on a Shard(0) weight: the fused loss and the
    recompute form give fp32 gradients (the weight's still Shard(0)) within the bf16 floor of
    float64, and equal to the same call on the whole weight in one process to 1e-5: rounding
    either gradient to bf16 anywhere on the sharded path would move it by about 1.7e-3."""
    # bf16-representable values: float64 sees exactly the operands of the bf16 matmuls.
    hidden_full, weight = hidden_full.bfloat16().float(), weight.bfloat16().float()
    hd = hidden_full.double().requires_grad_()
    wd = weight.double().requires_grad_()
    ref = -token_log_probs(hd @ wd.T, labels, temperature=temp).sum()
    ref_w_grad, ref_h_grad = torch.autograd.grad(ref, [wd, hd])

    def grads(form: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = w.requires_grad_()
        hidden = hidden_full.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if form == "fused":
                loss = vp.linear_cross_entropy(
                    hidden, w, labels, reduction="sum", temperature=temp, chunk_size=4
                )
            else:
                loss = -vp.linear_token_log_probs(hidden, w, labels, temperature=temp).sum()
        loss.backward()
        assert w.grad is not None and hidden.grad is not None
        assert w.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
        return w.grad, hidden.grad

    done = []
    for form in ("fused", "recompute"):
        w_grad, h_grad = grads(form, distribute_tensor(weight, mesh, [Shard(0)]))
        what = f"autocast {form} on a Shard(0) head"
        assert isinstance(w_grad, DTensor) and w_grad.placements == (Shard(0),), w_grad
        _check_sharded_grads(rank, what, w_grad, h_grad, ref_w_grad, ref_h_grad, 8e-3)
        dense_w_grad, dense_h_grad = grads(form, weight.clone())
        _check_sharded_grads(
            rank, f"{what} vs one process", w_grad, h_grad, dense_w_grad, dense_h_grad, 1e-5
        )
        done.append(what)
    return done


def check_fused_linear_sharded(
    rank: int, world_size: int, vocab: int, dtype_name: str
) -> list[str]:
    """The grads-in-forward losses on a Shard(0) lm_head weight vs the float64 reference."""
    dtype = DTYPES[dtype_name]
    hidden_size, shape, temp = 8, (2, 7), 0.8  # 14 tokens in chunks of 4: a ragged last chunk
    mesh = _mesh((world_size,))
    gen = torch.Generator().manual_seed(31)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.7).to(dtype)
    hidden_full = torch.randn(*shape, hidden_size, generator=gen).to(dtype)
    labels = reference.make_labels(shape, vocab, seed=31, ignore_index=IGNORE)
    coef = reference.upstream(shape, seed=32)
    valid = labels != IGNORE
    # bf16: the gradients' own rounding (about 1.7e-3) plus that of the bf16 chunk logits.
    tol = 2e-6 if dtype == torch.float32 else 6e-3
    done = []
    cases = {
        "sum": (-torch.ones(shape, dtype=torch.float64), {"reduction": "sum"}),
        "mean": (-torch.ones(shape, dtype=torch.float64) / valid.sum(), {"reduction": "mean"}),
        "coefficients": (coef, {}),
    }
    for name, (ref_coef, options) in cases.items():
        wd = weight.double().requires_grad_()
        hd = hidden_full.double().requires_grad_()
        ref = (token_log_probs(hd @ wd.T, labels, temperature=temp) * ref_coef).sum()
        ref_w_grad, ref_h_grad = torch.autograd.grad(ref, [wd, hd])

        w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
        hidden = hidden_full.clone().requires_grad_()
        common = {"temperature": temp, "chunk_size": 4}
        if name == "coefficients":
            loss = vp.fused_linear_token_loss(hidden, w, labels, coef.float(), **common)
        else:
            loss = vp.linear_cross_entropy(hidden, w, labels, **options, **common)
        what = f"fused {name} V={vocab} {dtype_name}"
        assert not isinstance(loss, DTensor)
        _same_on_all_ranks(loss, f"{what} loss")
        _close(
            loss, ref.detach(), atol=1e-4, rtol=1e-4 if dtype == torch.float32 else 2e-3, what=what
        )
        loss.backward()
        assert isinstance(w.grad, DTensor) and w.grad.placements == (Shard(0),), w.grad
        assert hidden.grad is not None
        _check_sharded_grads(rank, what, w.grad, hidden.grad, ref_w_grad, ref_h_grad, tol)
        done.append(what)
    # An elementwise function of log p (a clipped policy loss) on the same sharded weight: each
    # rank differentiates it at the same (reduced) log-probs. The float64 reference starts from
    # the logits: exact for fp32; for bf16 the unfused matmul's rounded logits, because their
    # rounding moves each ratio (and may cross the clip), which no bf16 form can undo.
    with torch.no_grad():
        ref_lp = token_log_probs(hidden_full.double() @ weight.double().T, labels, temperature=temp)
    inputs = reference.policy_inputs(ref_lp, seed=33)
    if dtype == torch.float32:
        logits = hidden_full.double() @ weight.double().T
    else:
        logits = (hidden_full @ weight.T).double()
    logits.requires_grad_()
    per_token = reference.clipped_surrogate(
        token_log_probs(logits, labels, temperature=temp), *(x.double() for x in inputs)
    )
    for entropy_bonus in (False, True):  # the entropy's statistics are reduced over ranks too
        ref_terms = per_token
        if entropy_bonus:
            ref_terms = per_token - 0.05 * reference.ref_entropy(logits, temp) * inputs[2]
        ref = torch.where(valid, ref_terms, 0.0).sum()
        (grad_logits,) = torch.autograd.grad(ref, [logits], retain_graph=True)
        ref_h_grad = grad_logits @ weight.double()
        ref_w_grad = grad_logits.reshape(-1, vocab).T @ hidden_full.double().reshape(
            -1, hidden_size
        )
        w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
        hidden = hidden_full.clone().requires_grad_()
        fn = reference.clipped_with_entropy_bonus if entropy_bonus else reference.clipped_surrogate
        loss = vp.fused_linear_log_prob_loss(
            hidden,
            w,
            labels,
            fn,
            inputs,
            temperature=temp,
            chunk_size=4,
            with_entropy=entropy_bonus,
        )
        assert isinstance(loss, torch.Tensor)
        what = f"fused policy V={vocab} {dtype_name} entropy={entropy_bonus}"
        _same_on_all_ranks(loss, f"{what} loss")
        _close(loss, ref.detach(), atol=1e-4, rtol=1e-4, what=what)
        loss.backward()
        assert isinstance(w.grad, DTensor) and hidden.grad is not None
        _check_sharded_grads(rank, what, w.grad, hidden.grad, ref_w_grad, ref_h_grad, tol)
        done.append(what)
    if dtype == torch.float32:
        done += _autocast_on_sharded_head(rank, mesh, hidden_full, weight, labels, temp)
    # A frozen sharded lm_head (LoRA): only the hidden gradient.
    w = distribute_tensor(weight, mesh, [Shard(0)])
    hidden = hidden_full.clone().requires_grad_()
    vp.linear_cross_entropy(hidden, w, labels, reduction="sum").backward()
    hd = hidden_full.double().requires_grad_()
    ref = token_sum_cross_entropy(hd @ weight.double().T, labels)
    (ref_h_grad,) = torch.autograd.grad(ref, [hd])
    assert hidden.grad is not None and w.grad is None
    err = relative_error(hidden.grad, ref_h_grad)
    assert err <= tol, f"frozen sharded head: hidden grad relative error {err}"
    # Bad labels raise on every rank (the count travels with the first chunk's SUM).
    bad = labels.clone()
    bad[0, 0] = vocab
    with pytest.raises(ValueError, match=re.escape(f"outside [0, {vocab})")):
        vp.linear_cross_entropy(hidden_full, w, bad, validate=True)
    return done


class _CollectiveRecorder(TorchDispatchMode):
    """Records every c10d collective issued (eager or functional) with its tensor sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            numel = 0
            for arg in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(arg, torch.Tensor):
                    numel += arg.numel()
            self.calls.append((str(func.overloadpacket.__name__), numel))
        return func(*args, **(kwargs or {}))


def record_collectives(rank: int, world_size: int, vocab: int, tokens: int, hidden_size: int):
    """Collectives (name, elements) issued by each function, forward and backward, at this V."""
    mesh = _mesh((world_size,))
    gen = torch.Generator().manual_seed(21)
    full = torch.randn(tokens, vocab, generator=gen)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen)
    hidden = torch.randn(tokens, hidden_size, generator=gen).requires_grad_()
    x = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
    w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    out: dict[str, list[tuple[str, int]]] = {}
    runs = {
        "token_log_probs": lambda: vp.token_log_probs(x, labels, validate=True),
        "token_entropy": lambda: vp.token_entropy(x),
        "log_probs_and_entropy": lambda: sum(vp.token_log_probs_and_entropy(x, labels)),
        "cross_entropy": lambda: vp.cross_entropy(x, labels, label_smoothing=0.1),
        "linear_token_log_probs": lambda: vp.linear_token_log_probs(hidden, w, labels),
        "linear_cross_entropy": lambda: vp.linear_cross_entropy(hidden, w, labels),
    }
    for name, run in runs.items():
        recorder = _CollectiveRecorder()
        with recorder:
            run().sum().backward()
        out[name] = recorder.calls
    return out


def check_placement_errors(rank: int, world_size: int) -> list[str]:
    """Unsupported placements raise a clear error on every rank, and no rank hangs."""
    mesh = _mesh((world_size,))
    labels = torch.zeros(2, dtype=torch.long)
    messages = []
    partial = DTensor.from_local(torch.randn(2, 5), mesh, [Partial()])
    wrong_dim = distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
    cases = [
        (lambda: vp.token_log_probs(partial, labels), "Partial"),
        (lambda: vp.token_entropy(wrong_dim), "Shard(dim=0)"),
        (lambda: vp.linear_token_log_probs(torch.randn(2, 4), wrong_dim.T, labels), "Shard"),
        (
            lambda: vp.linear_token_log_probs(
                distribute_tensor(torch.randn(2, 6), mesh, [Shard(0)]),
                distribute_tensor(torch.randn(5, 6), mesh, [Shard(0)]),
                labels,
            ),
            "Replicate() on every mesh dim",
        ),
    ]
    for call, needle in cases:
        with pytest.raises(ValueError, match=re.escape(needle)) as info:
            call()
        messages.append(str(info.value))
    # Labels out of range on one shard: every rank raises (the count travels in the SUM).
    x = distribute_tensor(torch.randn(2, 7), mesh, [Shard(-1)])
    bad = torch.tensor([3, 7])
    with pytest.raises(ValueError, match=re.escape("outside [0, 7)")) as info:
        vp.token_log_probs(x, bad, validate=True)
    messages.append(str(info.value))
    _ = vp.token_log_probs(x, bad)  # unvalidated: no out-of-bounds read, no crash
    return messages
