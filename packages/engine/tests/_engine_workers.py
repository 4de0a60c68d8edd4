"""Functions run on spawned gloo ranks by the engine's distributed tests (keep imports light)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from _engine_models import (
    IGNORE,
    full_state,
    global_batch,
    make_model,
    token_loss_mean,
    token_loss_sum,
)
from train_engine import (
    DDPConfig,
    Engine,
    FSDP2Config,
    LossWindow,
    NonFiniteGradientError,
    apply_data_parallel,
    latest_checkpoint,
    param_groups,
)

N_SEQ = 8  # sequences in the global batch of every optimizer step


def _wrap(model: nn.Module, kind: str, mesh: DeviceMesh, **ddp: Any) -> nn.Module:
    if kind == "ddp":
        return apply_data_parallel(
            model, mesh=mesh, config=DDPConfig(**ddp), gradient_accumulation_steps=2
        )
    if kind in ("fsdp2", "fsdp2_sum"):
        model = apply_data_parallel(model, mesh=mesh, config=FSDP2Config())
        if kind == "fsdp2_sum":  # summed, not averaged, gradients: the Engine must adapt
            from torch.distributed.fsdp import FSDPModule

            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    # Gloo has no PREMUL_SUM: reduce with SUM and scale separately.
                    module.set_force_sum_reduction_for_comms(True)
        return model
    assert kind == "local"
    return model


def _chunks(ids: torch.Tensor, labels: torch.Tensor, rank: int, world: int, micro: int) -> list:
    """This rank's micro-batches of a global batch split into world*micro equal chunks."""
    size = ids.shape[0] // (world * micro)
    out = []
    for mb in range(micro):
        c = rank * micro + mb
        out.append((ids[c * size : (c + 1) * size], labels[c * size : (c + 1) * size]))
    return out


# --------------------------------------------------------------------------- invariance


def invariance(
    rank: int, world: int, kind: str, micro: int, steps: int, seed: int, device: str = "cpu"
) -> dict:
    mesh = init_device_mesh(device, (world,))
    model = _wrap(make_model().to(device), kind, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = Engine(model, opt, max_grad_norm=0.5, gradient_accumulation_steps=micro)
    norms = []
    for step in range(steps):
        ids, labels = global_batch(seed + step, N_SEQ)
        batches = _chunks(ids.to(device), labels.to(device), rank, world, micro)
        local = sum(int((lab != IGNORE).sum()) for _, lab in batches)
        n = engine.global_num_tokens(local)
        for x, lab in batches:
            engine.backward(token_loss_sum(engine(x), lab), num_tokens=n)
            result = engine.step()
        assert result.updated, result
        norms.append(float(result.grad_norm))
    return {"params": full_state(model), "norms": norms}


# ----------------------------------------------------------------------------- deferral


def _is_grad_collective(op: object) -> bool:
    name = str(op)
    return "reduce_scatter" in name or "all_reduce" in name or "allreduce" in name


def deferral(rank: int, world: int, kind: str, defer: bool) -> dict:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = _wrap(make_model(), kind, mesh)
    counts: Counter[str] = Counter()
    if kind == "ddp":
        # No annotations: DDP checks them at run time and they are strings in this module.
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            state["grad"] += 1
            buf = bucket.buffer().div_(world)
            fut = dist.all_reduce(buf, async_op=True).get_future()  # type: ignore[union-attr]
            return fut.then(lambda f: f.value()[0])

        model.register_comm_hook(counts, hook)  # type: ignore[operator]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(model, opt, gradient_accumulation_steps=3, defer_grad_sync=defer)
    per_backward = []
    ids, labels = global_batch(1, 6 * world)
    batches = _chunks(ids, labels, rank, world, 3)
    n = engine.global_num_tokens(sum(int((lab != IGNORE).sum()) for _, lab in batches))
    from torch.distributed.tensor.debug import CommDebugMode

    for x, lab in batches:
        before = counts["grad"]
        with CommDebugMode() as comm:
            engine.backward(token_loss_sum(engine(x), lab), num_tokens=n)
        fsdp_grad_ops = sum(
            c for op, c in comm.get_comm_counts().items() if _is_grad_collective(op)
        )
        per_backward.append(counts["grad"] - before + fsdp_grad_ops)
        engine.step()
    return {"per_backward": per_backward, "params": full_state(model)}


# ------------------------------------------------------------------------ clip parity


def _tp_model(mesh: DeviceMesh, device: str) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = make_model().to(device)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return apply_data_parallel(model, mesh=mesh["dp"], config=FSDP2Config())


@contextlib.contextmanager
def _count_all_reduce() -> Iterator[list[int]]:
    """Count torch.distributed.all_reduce calls (the grad-norm reductions) inside the block."""
    calls: list[int] = []
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        yield calls
    finally:
        dist.all_reduce = original


def clip_parity(
    rank: int,
    world: int,
    kind: str,
    norm_type: float,
    bucket_view: bool = False,
    device: str = "cpu",
) -> dict:
    """One clipped SGD(lr=1) window through the Engine vs clip_grad_norm_ on an unsharded copy."""
    if kind == "fsdp2_tp":
        mesh2 = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        model = _tp_model(mesh2, device)
        dp_rank, dp_size = mesh2["dp"].get_local_rank(), world // 2
    else:
        mesh = init_device_mesh(device, (world,))
        model = _wrap(make_model().to(device), kind, mesh, gradient_as_bucket_view=bucket_view)
        dp_rank, dp_size = rank, world
    reference = make_model().to(device)
    micro, max_norm = 2, 0.05
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = Engine(
        model,
        opt,
        max_grad_norm=max_norm,
        norm_type=norm_type,
        gradient_accumulation_steps=micro,
        nonfinite="step",
    )
    ids, labels = global_batch(7, 4 * dp_size)
    ids, labels = ids.to(device), labels.to(device)
    batches = _chunks(ids, labels, dp_rank, dp_size, micro)
    n = engine.global_num_tokens(sum(int((lab != IGNORE).sum()) for _, lab in batches))
    aliases_buckets = None
    for i, (x, lab) in enumerate(batches):
        engine.backward(token_loss_sum(engine(x), lab), num_tokens=n)
        if i == micro - 1 and kind == "ddp":
            storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
            aliases_buckets = len(storages) < len(list(model.parameters()))
            held_grads = [p.grad for p in model.parameters()]
            params_before = [p.detach().clone() for p in model.parameters()]
        if i == micro - 1:
            with _count_all_reduce() as calls:
                result = engine.step()
        else:
            engine.step()
    # Reference: the global batch in one forward, token-mean loss, torch's clip, p -= g.
    (token_loss_sum(reference(ids), labels) / (labels != IGNORE).sum()).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad
    out = {
        "norm": float(result.grad_norm),
        "ref_norm": float(ref_norm),
        "params": full_state(model),
        "ref_params": full_state(reference),
        "norm_collectives": len(calls),
        "aliases_buckets": aliases_buckets,
    }
    if kind == "ddp":
        # The gradient tensors held from before step() (bucket views when enabled) contain the
        # clipped gradient: clipping wrote into them instead of replacing them (lr = 1).
        out["clipped_in_place"] = all(
            torch.allclose(g, b - p.detach(), atol=1e-6)
            for g, b, p in zip(held_grads, params_before, model.parameters(), strict=True)
        )
        # A second window: DDP re-attaches its bucket views after zero_grad(set_to_none=True).
        for i, (x, lab) in enumerate(batches):
            engine.backward(token_loss_sum(engine(x), lab), num_tokens=n)
            if i < micro - 1:
                engine.step()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        out["aliases_buckets_again"] = len(storages) < len(list(model.parameters()))
    return out


# -------------------------------------------------------------------------- non-finite


def nonfinite(rank: int, world: int, kind: str, policy: str, fused: bool = False) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    model = _wrap(make_model(), kind, mesh)
    if fused:  # the update is skipped inside the fused kernel, without a host sync
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine = Engine(model, opt, sched, max_grad_norm=1.0, nonfinite=policy)  # type: ignore[arg-type]
    before = full_state(model)
    ids, labels = global_batch(3 + rank, 4)
    loss = token_loss_mean(engine(ids), labels)
    if rank == 1:
        loss = loss * float("inf")  # only this rank's gradients become non-finite
    engine.backward(loss)
    outcome: dict[str, Any] = {}
    try:
        result = engine.step()
        outcome["skipped"] = result.skipped
        outcome["updated"] = result.updated
    except NonFiniteGradientError as err:
        outcome["raised"] = str(err)
    outcome["unchanged"] = all(torch.equal(before[k], v) for k, v in full_state(model).items())
    outcome["optimizer_steps"] = engine.optimizer_steps
    outcome["lr"] = opt.param_groups[0]["lr"]
    outcome["grads_cleared"] = all(p.grad is None for p in model.parameters())
    # The Engine stays usable: a finite window updates on every rank.
    engine.backward(token_loss_mean(engine(ids), labels))
    outcome["next_updated"] = engine.step().updated
    return outcome


# ------------------------------------------------------------------ setup and helpers


def setup_checks(rank: int, world: int) -> dict:
    """Validation errors of apply_data_parallel/Engine, FSDP2 block wrapping, param groups."""
    from torch.distributed.fsdp import FSDPModule

    errors: dict[str, str] = {}
    mesh = init_device_mesh("cpu", (world,))
    for name, call in {
        "static_graph_accum": lambda: apply_data_parallel(
            make_model(),
            mesh=mesh,
            config=DDPConfig(static_graph=True),
            gradient_accumulation_steps=4,
        ),
        "bucket_cap": lambda: apply_data_parallel(
            make_model(), mesh=mesh, config=DDPConfig(bucket_cap_mb=0)
        ),
        "bad_config": lambda: apply_data_parallel(make_model(), mesh=mesh, config=object()),  # type: ignore[arg-type]
        "bad_dtype_name": lambda: apply_data_parallel(
            make_model(),
            mesh=mesh,
            config=FSDP2Config(param_dtype="fp8"),  # type: ignore[arg-type]
        ),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as err:
            errors[name] = str(err)
    static = apply_data_parallel(make_model(), mesh=mesh, config=DDPConfig(static_graph=True))
    try:
        Engine(static, torch.optim.SGD(static.parameters(), lr=0.1), gradient_accumulation_steps=2)
    except ValueError as err:
        errors["engine_static_graph"] = str(err)

    ddp = apply_data_parallel(make_model(), mesh=mesh, config=DDPConfig())
    ddp_engine = Engine(
        ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), gradient_accumulation_steps=2
    )
    ids, labels = global_batch(0, 2)
    try:
        ddp_engine.backward(token_loss_mean(ddp(ids), labels))  # forward bypassed the Engine
    except RuntimeError as err:
        errors["ddp_forward_bypass"] = str(err)

    # Dtypes by name (as YAML gives them) are resolved when wrapping: float64 parameters
    # computed in float32 give float32 logits.
    named = apply_data_parallel(
        make_model().double(), mesh=mesh, config=FSDP2Config(param_dtype="float32")
    )
    stored = str(next(named.parameters()).dtype)  # read before a forward unshards them
    named_dtypes = (str(named(ids).dtype), stored)
    fsdp = apply_data_parallel(make_model(), mesh=mesh, config=FSDP2Config())
    blocks_sharded = all(isinstance(b, FSDPModule) for b in fsdp.layers) and isinstance(
        fsdp, FSDPModule
    )
    groups = param_groups(fsdp, weight_decay=0.1)
    opt = torch.optim.AdamW(groups, lr=1e-3)
    decay_of = {name: g["weight_decay"] for g in opt.param_groups for name in g["param_names"]}
    engine = Engine(fsdp, opt, gradient_accumulation_steps=2)
    engine.backward(token_loss_mean(engine(ids), labels))
    engine.step()
    try:
        engine.zero_grad()
    except RuntimeError as err:
        errors["fsdp2_mid_window_zero_grad"] = str(err)
    summed = apply_data_parallel(make_model(), mesh=mesh, config=FSDP2Config())
    for module in summed.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    summed_size = Engine(summed, torch.optim.SGD(summed.parameters(), lr=0.1)).grad_average_size
    summed.layers[0].set_gradient_divide_factor(2.0)  # type: ignore[operator]
    try:
        Engine(summed, torch.optim.SGD(summed.parameters(), lr=0.1))
    except ValueError as err:
        errors["mixed_divide_factors"] = str(err)
    return {
        "named_dtypes": named_dtypes,
        "summed_size": summed_size,
        "errors": errors,
        "blocks_sharded": blocks_sharded,
        "decay_of": decay_of,
        "grad_average_size": engine.grad_average_size,
    }


def dp_cp_tokens_and_window(rank: int, world: int) -> dict:
    """4 ranks as (dp=2, cp=2): HSDP averages over all 4, tokens are summed over dp only."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = apply_data_parallel(make_model(), mesh=mesh, config=FSDP2Config())
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), dp_group=mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    # CP replicas of one dp rank count the same tokens.
    tokens = engine.global_num_tokens(10 + 5 * dp_rank)
    window = LossWindow(steps=3)
    first = window.average()
    for step in range(5):
        window.update(torch.tensor(float(rank + 10 * step)))
    # Contract (b): each of the 4 ranks (dp x cp) holds a disjoint part of the step's token-loss
    # sum, with the global token count; the window reads sum over ranks / tokens.
    token_mean = LossWindow(steps=2)
    for step in (1, 2):
        token_mean.update(torch.tensor(0.5 * step * (rank + 1), dtype=torch.float64), tokens)
    return {
        "token_mean_last": token_mean.last(),
        "token_mean_average": token_mean.average(),
        "grad_average_size": engine.grad_average_size,
        "tokens": int(tokens),
        "first": first,
        "average": window.average(),
        "last": window.last(),
        "len": len(window),
    }


# ------------------------------------------------------------------------------ resume


class Sampler:
    """A toy data loader with state: its own generator and a position."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        seed = int(torch.randint(0, 2**31 - 1, (), generator=self.gen))
        return global_batch(seed, 2)

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.position = state["position"]


def resume_run(
    rank: int, world: int, root: str, total_steps: int, kill_at: int | None, resume: bool
) -> dict:
    """FSDP2 + dropout + AdamW + warmup, 2 micro-batches per step, checkpoint every 2 steps.

    ``kill_at``: SIGKILL this process in the middle of that step's window.
    """
    torch.manual_seed(1234)  # same init everywhere; the per-rank RNG stream diverges below
    mesh = init_device_mesh("cpu", (world,))
    model = apply_data_parallel(make_model(dropout=0.1), mesh=mesh, config=FSDP2Config())
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.01), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    engine = Engine(model, opt, sched, max_grad_norm=1.0, gradient_accumulation_steps=2)
    sampler = Sampler(seed=100 + rank)
    torch.manual_seed(99 + rank)  # dropout stream, restored from the checkpoint
    start = 0
    if resume:
        path = latest_checkpoint(root)
        assert path is not None, f"no checkpoint under {root}"
        sampler.load_state_dict(engine.load_checkpoint(path))
        start = engine.optimizer_steps
    losses: dict[int, float] = {}
    for step in range(start, total_steps):
        batches = [sampler.next() for _ in range(2)]
        local = sum(int((lab != IGNORE).sum()) for _, lab in batches)
        n = engine.global_num_tokens(local)
        step_loss = torch.zeros((), dtype=torch.float64)
        for i, (x, lab) in enumerate(batches):
            loss = token_loss_sum(engine(x), lab)
            step_loss += loss.detach().double()
            engine.backward(loss, num_tokens=n)
            if step == kill_at and i == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            engine.step()
        losses[step] = float(step_loss / n)
        if (step + 1) % 2 == 0:
            engine.save_checkpoint(
                Path(root) / f"step_{step + 1}", extra_state=sampler.state_dict()
            )
    return {"losses": losses, "params": full_state(model), "start": start}


# --------------------------------------------------------------------------------- CUDA


def bf16_fsdp2_step(rank: int, world: int) -> float:
    """One FSDP2 bf16/fp32-reduce step on CUDA vs an fp32 reference: max |param difference|."""
    mesh = init_device_mesh("cuda", (1,))
    model = apply_data_parallel(
        make_model().cuda(),
        mesh=mesh,
        config=FSDP2Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    reference = make_model().cuda()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ids, labels = global_batch(0, 4)
    ids, labels = ids.cuda(), labels.cuda()
    n = int((labels != IGNORE).sum())
    engine.backward(token_loss_sum(engine(ids), labels), num_tokens=engine.global_num_tokens(n))
    engine.step()
    (token_loss_sum(reference(ids), labels) / n).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    ref_opt.step()
    got, ref = full_state(model), full_state(reference)
    return max(float((got[k] - ref[k]).abs().max()) for k in ref)


# ------------------------------------------------------------------- grad-norm edge cases


def norm_edge_cases(rank: int, world: int) -> dict:
    """DTensor gradients with uneven and empty shards, Partial and Replicate placements, and
    different numbers of sharded tensors per mesh, vs the float64 norm of the full tensors."""
    import math

    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from train_engine import clip_grads_with_norm_, global_grad_norm

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    fulls = [torch.randn(shape, generator=g) for shape in [(5, 3), (1,), (7,), (4, 4)]]
    params, reference = [], []
    # Shard(0) with uneven (5 rows) and empty (1 row on 2 ranks) local shards, then Replicate.
    for full, placement in zip(fulls[:3], [Shard(0), Shard(0), Replicate()], strict=True):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full), mesh, [placement]))
        p.grad = distribute_tensor(full.clone(), mesh, [placement])
        params.append(p)
        reference.append(full)
    # Partial: every rank holds a different addend; the gradient is their sum.
    addend = torch.randn((4, 4), generator=torch.Generator().manual_seed(rank))
    total = sum(
        torch.randn((4, 4), generator=torch.Generator().manual_seed(r)) for r in range(world)
    )
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh, [Replicate()]))
    p.grad = DTensor.from_local(addend, mesh, [Partial()])
    params.append(p)
    reference.append(total)
    # A plain (already reduced) gradient next to the DTensors.
    plain = torch.nn.Parameter(torch.zeros(3))
    plain.grad = torch.tensor([1.0, -2.0, 2.0])
    params.append(plain)
    reference.append(plain.grad)
    flat = torch.cat([t.double().reshape(-1) for t in reference])
    out = {}
    for p_norm in (2.0, 1.0, math.inf):
        got = float(global_grad_norm(params, p_norm))
        expected = float(
            flat.abs().max() if math.isinf(p_norm) else flat.abs().pow(p_norm).sum() ** (1 / p_norm)
        )
        out[p_norm] = (got, expected)
    # Clipping scales the local shards by the common coefficient.
    norm = global_grad_norm(params[:3])
    coef = float(clip_grads_with_norm_(params[:3], 0.5, norm))
    clipped = [q.grad.full_tensor() for q in params[:3]]
    out["clip_err"] = max(
        float((c - f * coef).abs().max()) for c, f in zip(clipped, reference[:3], strict=True)
    )
    out["coef"] = coef
    return out
