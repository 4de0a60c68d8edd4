"""Multi-GPU validation run: CP, TP (vocab-parallel), EP and FSDP2 on one host, one torchrun.

    torchrun --nproc-per-node 4 benchmarks/multi_gpu.py --out benchmarks/results/mgpu
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py --quick --device cpu --out /tmp/mgpu

Sections (``--sections cp,vocab,moe,engine``), each with parity checks against an independent
reference and timings; each prints a table on rank 0 and writes ``<out>/mgpu_<section>_w<W>.json``:

1. ``cp``: cp-sharder on a random-init transformers Llama (8 layers, hidden 2048): loss and
   gradient parity of cp=W against cp=1 (fp32; portable backend and, on CUDA, torch's ring), then
   forward+backward throughput (bf16) against the sequence length with the peak memory per GPU.
2. ``vocab``: vocab-parallel ``token_log_probs`` / ``linear_token_log_probs`` on DTensors sharded
   over W ranks against a float64 dense reference, and their time against gathering the logits.
3. ``moe``: moe-dispatch ``AllToAllDispatcher`` dispatch+combine (unequal token counts per rank)
   against a dense float64 loop, forward and backward; bandwidth at 4k-32k tokens per rank.
4. ``engine``: train-engine FSDP2 SFT step of a 1.5B Llama, tokens/s per GPU at dp=W against the
   same step on one GPU.

Every phase catches its own exception and the ranks agree on the outcome (one all-reduce), so a
failure is recorded instead of killing the run; ``--timeout-s`` bounds a collective that a rank
never joins (e.g. an out-of-memory error on one rank only in the middle of a ring exchange).

# B batch, S sequence, T tokens, H hidden, V vocabulary, E experts, K top-k, W world size
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

SECTIONS = ("cp", "vocab", "moe", "engine")
IGNORE = -100
GIB = 2**30


# ----------------------------------------------------------------------------- configuration
@dataclass(kw_only=True, slots=True, frozen=True)
class Sizes:
    """Problem sizes of one run (full size on GPUs, or tiny with ``--quick``).

    Attributes:
        cp_model: LlamaConfig fields of the CP model.
        cp_parity_batch: B of the parity batch.
        cp_parity_seq: S of the parity batch (not a multiple of 2*cp, so padding is exercised).
        seq_lens: S of the throughput sweep (batch 1).
        vocab_tokens: T of the vocab-parallel check and timing.
        vocab_size: V.
        vocab_hidden: H of the fused linear form.
        moe_parity_tokens: tokens of rank 0 in the parity check (other ranks hold fewer).
        moe_parity_hidden: H of the parity check.
        moe_experts: E.
        moe_top_k: K.
        moe_tokens: tokens per rank of the bandwidth sweep.
        moe_hiddens: H of the bandwidth sweep.
        engine_model: LlamaConfig fields of the SFT model.
        engine_batch: micro-batch rows per GPU.
        engine_seq: S of the SFT step.
    """

    cp_model: dict[str, int]
    cp_parity_batch: int
    cp_parity_seq: int
    seq_lens: tuple[int, ...]
    vocab_tokens: int
    vocab_size: int
    vocab_hidden: int
    moe_parity_tokens: int
    moe_parity_hidden: int
    moe_experts: int
    moe_top_k: int
    moe_tokens: tuple[int, ...]
    moe_hiddens: tuple[int, ...]
    engine_model: dict[str, int]
    engine_batch: int
    engine_seq: int


FULL = Sizes(
    cp_model=dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
    cp_parity_batch=2,
    cp_parity_seq=4093,
    seq_lens=(8192, 16384, 32768, 65536, 131072),
    vocab_tokens=8192,
    vocab_size=151936,
    vocab_hidden=4096,
    moe_parity_tokens=4096,
    moe_parity_hidden=2048,
    moe_experts=64,
    moe_top_k=8,
    moe_tokens=(4096, 8192, 16384, 32768),
    moe_hiddens=(2048, 7168),
    engine_model=dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    engine_batch=2,
    engine_seq=4096,
)

QUICK = Sizes(
    cp_model=dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
    cp_parity_batch=2,
    cp_parity_seq=29,
    seq_lens=(64, 128, 256),
    vocab_tokens=64,
    vocab_size=1001,  # odd: uneven shards
    vocab_hidden=32,
    moe_parity_tokens=40,
    moe_parity_hidden=16,
    moe_experts=8,
    moe_top_k=2,
    moe_tokens=(64, 128),
    moe_hiddens=(32,),
    engine_model=dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    engine_batch=2,
    engine_seq=32,
)

# Parity tolerances. CP: fp32 end to end (TF32 off), as the package's CUDA tests.
CP_LOSS_TOL = 1e-4
CP_GRAD_TOL = 1e-3
# The bf16-autocast fallback of the ring case (cp and reference both autocast): rounding only.
CP_BF16_LOSS_TOL = 5e-3
CP_BF16_GRAD_TOL = 5e-2
# vocab: fp32 arithmetic on bf16 inputs. Values from given logits are exact up to fp32 sums;
# gradients are stored in bf16 (relative rounding 2^-8). The fused form rounds its logits to
# bf16 inside the matmul, hence the looser value bound.
VP_VALUE_TOL = 2e-4
VP_LINEAR_VALUE_TOL = 5e-2
VP_GRAD_TOL = 1e-2
VP_LINEAR_GRAD_TOL = 2e-2
# moe: dispatch only moves rows; the combine accumulates in fp32.
MOE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@dataclass(kw_only=True, slots=True)
class Run:
    """Process-wide state of the run (one per rank).

    Attributes:
        args: parsed command line.
        sizes: problem sizes.
        device: "cuda" or "cpu".
        rank: global rank.
        world: W.
        out: output folder.
        meta: environment recorded in every JSON file.
    """

    args: argparse.Namespace
    sizes: Sizes
    device: str
    rank: int
    world: int
    out: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def dev(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


# ----------------------------------------------------------------------------- output helpers
def emit(run: Run, text: str) -> None:
    """Print on rank 0 only (the library rule against print() does not apply to a script)."""
    if run.rank == 0:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.2e}"
        return f"{v:.4g}"
    return "" if v is None else str(v)


def table(run: Run, title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A fixed-width table of ``rows`` on rank 0."""
    if not rows:
        emit(run, f"\n{title}\n  (no rows)")
        return
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = [f"\n{title}", "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    for r in rows:
        lines.append(
            "  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True))
        )
    emit(run, "\n".join(lines))


def write_json(run: Run, section: str, payload: dict[str, Any]) -> None:
    """Write ``<out>/mgpu_<section>_w<W>.json`` on rank 0 (rewritten as the section progresses)."""
    if run.rank != 0:
        return
    run.out.mkdir(parents=True, exist_ok=True)
    path = run.out / f"mgpu_{section}_w{run.world}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": run.meta, **payload}, indent=2, default=str))
    tmp.replace(path)


# ----------------------------------------------------------------------------- collectives
def sync(run: Run) -> None:
    if run.device == "cuda":
        torch.cuda.synchronize()


def barrier(run: Run) -> None:
    """A barrier through an all-reduce on the run's device (no device guessing by c10d)."""
    dist.all_reduce(torch.zeros(1, device=run.dev))
    sync(run)


def reduce_scalar(run: Run, value: float, op: dist.ReduceOp.RedOpType) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=run.dev)
    dist.all_reduce(t, op=op)
    return float(t.item())


def all_ok(run: Run, ok: bool) -> bool:
    """True when ``ok`` holds on every rank (one MIN all-reduce)."""
    return reduce_scalar(run, 1.0 if ok else 0.0, dist.ReduceOp.MIN) > 0.5


@dataclass(kw_only=True, slots=True)
class Outcome:
    """Result of a phase run on every rank, after the ranks agreed.

    Attributes:
        ok: no rank raised.
        value: this rank's return value (None when this rank raised).
        errors: ``"rank r: message"`` of every rank that raised (the same list on every rank).
        oom: some rank ran out of device memory.
    """

    ok: bool
    value: Any
    errors: list[str]
    oom: bool


def phase(run: Run, name: str, fn: Callable[[], Any]) -> Outcome:
    """Run ``fn`` on every rank, catch its exception, and agree on the outcome.

    The agreement is one MIN all-reduce of a success flag (and an object all-gather of the error
    texts after a failure) on every rank. It covers failures that every rank hits at the same
    point, or that happen where ``fn`` runs no collective. A rank that raises while its peers
    wait inside one of ``fn``'s collectives cannot be rescued: that collective times out after
    ``--timeout-s`` and the run ends (the JSON written so far stays).
    """
    value: Any = None
    err: str | None = None
    oom = False
    try:
        value = fn()
    except Exception as exc:
        oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
        last = traceback.extract_tb(exc.__traceback__)[-1]
        err = (
            f"rank {run.rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            f" ({Path(last.filename).name}:{last.lineno})"
        )
        if run.args.verbose:
            traceback.print_exc()
        value = None
    if err is not None:
        free_memory(run)  # after the except block, which kept the failed frames' tensors alive
    ok = all_ok(run, err is None)
    errors: list[str] = []
    any_oom = reduce_scalar(run, 1.0 if oom else 0.0, dist.ReduceOp.MAX) > 0.5
    if not ok:
        gathered: list[Any] = [None] * run.world
        dist.all_gather_object(gathered, err)
        errors = [e for e in gathered if e]
        emit(run, f"[{name}] failed: " + " | ".join(errors))
    return Outcome(ok=ok, value=value, errors=errors, oom=any_oom)


def _all_gather_ints(run: Run, value: int) -> list[int]:
    t = torch.tensor([value], dtype=torch.int64, device=run.dev)
    out = [torch.zeros_like(t) for _ in range(run.world)]
    dist.all_gather(out, t)
    return [int(v) for v in out]


def free_memory(run: Run) -> None:
    gc.collect()
    if run.device == "cuda":
        torch.cuda.empty_cache()


def peak_gib_max(run: Run) -> float | None:
    """Peak allocated device memory since the last reset, maximum over ranks (GiB)."""
    if run.device != "cuda":
        return None
    return reduce_scalar(run, torch.cuda.max_memory_allocated() / GIB, dist.ReduceOp.MAX)


def reset_peak(run: Run) -> float:
    """Reset the peak counter; return the memory allocated now (GiB)."""
    if run.device != "cuda":
        return 0.0
    sync(run)
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / GIB


def timed(run: Run, fn: Callable[[], Any], *, warmup: int, iters: int) -> float:
    """Median seconds of one ``fn()`` call (each iteration starts together on every rank and is
    device-synchronised), the maximum of the ranks' medians."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        barrier(run)
        start = time.perf_counter()
        fn()
        sync(run)
        times.append(time.perf_counter() - start)
    return reduce_scalar(run, statistics.median(times), dist.ReduceOp.MAX)


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """TF32 off for parity checks (restored afterwards)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def rel_err(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected| / max |expected| in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    if e.numel() == 0:
        return 0.0
    return float((a - e).abs().max()) / (float(e.abs().max()) + 1e-30)


def abs_err(actual: Tensor, expected: Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).abs().max()) if e.numel() else 0.0


def broadcast_module(module: torch.nn.Module) -> None:
    """Make every rank hold rank 0's parameters and buffers (independent of RNG behaviour)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)


# ----------------------------------------------------------------------------- 1. cp
def _llama_config(dims: dict[str, int], max_len: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **dims,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )


def _build_llama(run: Run, dims: dict[str, int], max_len: int, dtype: torch.dtype) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(run.dev):
        model = LlamaForCausalLM(_llama_config(dims, max_len)).to(dtype)
    broadcast_module(model)
    return model


def _cp_batch(run: Run, kind: str, bsz: int, seq: int, vocab: int) -> dict[str, Tensor]:
    """Pre-shifted labels; ``portable`` left-pads row 1 by 3 tokens (a key-padding mask, which
    only the portable backend serves), ``ring`` is a plain causal batch."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, vocab, (bsz, seq), generator=g)
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    batch = {"input_ids": ids, "labels": labels}
    if kind == "portable":
        mask = torch.ones(bsz, seq, dtype=torch.long)
        mask[min(1, bsz - 1), :3] = 0
        labels[mask == 0] = IGNORE
        labels[:, :-1][mask[:, 1:] == 0] = IGNORE
        batch["attention_mask"] = mask
    return {k: v.to(run.dev) for k, v in batch.items()}


def _loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


def _grads(model: torch.nn.Module) -> dict[str, Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def _autocast(run: Run, on: bool) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast (the fallback of a ring parity case whose fp32 run failed), or nothing."""
    if not on:
        return contextlib.nullcontext()
    return torch.autocast(run.device, dtype=torch.bfloat16)


def _cp1_reference(
    run: Run, model: Any, batch: dict[str, Tensor], *, bf16: bool = False
) -> tuple[float, dict[str, Tensor]]:
    """cp=1: the unmodified model on the whole batch (computed redundantly by every rank)."""
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    with _autocast(run, bf16):
        logits = model(**inputs).logits
    count = int((batch["labels"] != IGNORE).sum())
    loss = _loss_sum(logits, batch["labels"]) / count
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _cp_parity_step(
    run: Run,
    model: Any,
    mesh: DeviceMesh,
    batch: dict[str, Tensor],
    ref: tuple[float, dict[str, Tensor]],
    *,
    use_ctx: bool = True,
    bf16: bool = False,
) -> dict[str, Any]:
    from cp_sharder import ContextParallelSharder

    model.zero_grad(set_to_none=True)
    sharder = ContextParallelSharder(model, mesh, padding_token_id=0)
    train_ctx, local = sharder.shard(batch)
    labels = local.pop("labels")
    with train_ctx() if use_ctx else contextlib.nullcontext(), _autocast(run, bf16):
        logits = model(**local).logits
    count = sharder.num_label_tokens(device=run.dev)
    loss = _loss_sum(logits, labels) / count
    loss.backward()
    del logits
    group = mesh.get_group()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    ref_loss, ref_grads = ref
    loss_tol, grad_tol = (
        (CP_BF16_LOSS_TOL, CP_BF16_GRAD_TOL) if bf16 else (CP_LOSS_TOL, CP_GRAD_TOL)
    )
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)  # local loss / global count: summed grads = no-CP grads
        err = rel_err(g, ref_grads[name])
        if err > worst:
            worst, worst_name = err, name
    model.zero_grad(set_to_none=True)
    loss_err = abs(float(total) - ref_loss) / abs(ref_loss)
    return {
        "backend": sharder.layout.backend.value,
        "loss": float(total),
        "ref_loss": ref_loss,
        "loss_rel_err": loss_err,
        "grad_rel_err": worst,
        "worst_param": worst_name,
        "pass": loss_err < loss_tol and worst < grad_tol,
    }


def _ring_bf16_fallback(
    run: Run, model: Any, mesh: DeviceMesh, batch: dict[str, Tensor]
) -> dict[str, Any]:
    """The ring case again under bf16 autocast (flash kernels), when its fp32 run failed (e.g. no
    fp32 kernel for grouped-query attention in torch's ring): CP and reference both autocast."""
    c = mesh.size()
    ref = phase(run, "cp reference ring bf16", lambda: _cp1_reference(run, model, batch, bf16=True))
    if not ref.ok:
        return {"case": "ring (bf16 autocast)", "cp": c, "status": "error", "error": ref.errors}
    out = phase(
        run,
        f"cp parity ring bf16 cp={c}",
        lambda r=ref.value: _cp_parity_step(run, model, mesh, batch, r, bf16=True),
    )
    row = {"case": "ring (bf16 autocast)", "cp": c, **(out.value or {})}
    if not out.ok:
        row.update(status="error", error=out.errors, **{"pass": False})
    else:
        if row["backend"] == "torch_ring":
            row["status"] = "ok"
        else:
            row.update(status=f"wrong backend {row['backend']}", **{"pass": False})
        row["tolerances"] = {"loss_rel": CP_BF16_LOSS_TOL, "grad_rel": CP_BF16_GRAD_TOL}
    return row


def _cp_meshes(run: Run, sizes: list[int]) -> dict[int, DeviceMesh]:
    """A ("dp", "cp") mesh per cp size; cp < W runs W/cp replicas of the same work side by side."""
    out = {}
    for c in sizes:
        if run.world % c:
            raise ValueError(f"--cp-sizes entry {c} does not divide the world size {run.world}")
        mesh = init_device_mesh(run.device, (run.world // c, c), mesh_dim_names=("dp", "cp"))
        out[c] = mesh["cp"]
    return out


def _model_flops_per_token(model: Any, seq: int) -> float:
    """6 * non-embedding parameters + causal attention (6 * layers * hidden * S), per token."""
    cfg = model.config
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6.0 * n + 6.0 * cfg.num_hidden_layers * cfg.hidden_size * seq


def section_cp(run: Run) -> dict[str, Any]:

    s = run.sizes
    args = run.args
    cp_sizes = args.cp_sizes or [run.world]
    seq_lens = args.seq_lens or list(s.seq_lens)
    meshes = _cp_meshes(run, cp_sizes)
    vocab = s.cp_model["vocab_size"]
    backends = ["portable"] + (["ring"] if run.device == "cuda" else [])
    result: dict[str, Any] = {
        "model": s.cp_model,
        "cp_sizes": cp_sizes,
        "parity": [],
        "throughput": [],
        "longest_fit": {},
        "errors": [],
        "tolerances": {"loss_rel": CP_LOSS_TOL, "grad_rel": CP_GRAD_TOL},
    }
    if run.device != "cuda":
        result["parity"].append(
            {"backend": "ring", "status": "skipped: torch's ring attention runs on CUDA only"}
        )

    built = phase(
        run,
        "cp build",
        lambda: _build_llama(run, s.cp_model, max(max(seq_lens), s.cp_parity_seq), torch.float32),
    )
    if not built.ok:
        result["errors"] += built.errors
        return result
    model = built.value
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    result["params"] = n_params

    # Parity: cp=c vs cp=1, fp32, for each backend; one control run without train_ctx.
    parity_cps = [c for c in cp_sizes if c > 1]
    for kind in backends:
        batch = _cp_batch(run, kind, s.cp_parity_batch, s.cp_parity_seq, vocab)
        with strict_fp32():
            ref = phase(run, f"cp reference {kind}", lambda b=batch: _cp1_reference(run, model, b))
        if not ref.ok:
            result["errors"] += ref.errors
            continue
        for c in parity_cps:
            with strict_fp32():
                out = phase(
                    run,
                    f"cp parity {kind} cp={c}",
                    lambda b=batch, c=c, r=ref.value: _cp_parity_step(run, model, meshes[c], b, r),
                )
            row = {"case": kind, "cp": c, **(out.value or {})}
            if not out.ok:
                row.update(status="error", error=out.errors, **{"pass": False})
            elif row["backend"] != {"portable": "portable", "ring": "torch_ring"}[kind]:
                row.update(status=f"wrong backend {row['backend']}", **{"pass": False})
            else:
                row["status"] = "ok"
            result["parity"].append(row)
            if kind == "ring" and not out.ok:
                result["parity"].append(_ring_bf16_fallback(run, model, meshes[c], batch))
            if kind == "portable" and c == parity_cps[-1]:
                # Negative control: the same sharded batch without train_ctx attends only to local
                # keys; the check must flag it, or the tolerances are too loose to mean anything.
                with strict_fp32():
                    ctl = phase(
                        run,
                        "cp control",
                        lambda b=batch, c=c, r=ref.value: _cp_parity_step(
                            run, model, meshes[c], b, r, use_ctx=False
                        ),
                    )
                ctl_row = {"case": "control: no train_ctx", "cp": c, **(ctl.value or {})}
                if ctl.ok:
                    ctl_row["detected"] = not ctl_row.pop("pass")
                    ctl_row["status"] = "ok" if ctl_row["detected"] else "CONTROL NOT DETECTED"
                    ctl_row["pass"] = ctl_row["detected"]
                else:
                    ctl_row.update(status="error", error=ctl.errors, **{"pass": False})
                result["parity"].append(ctl_row)
        del ref
        free_memory(run)
    table(
        run,
        f"[cp] parity vs cp=1 (fp32, batch {s.cp_parity_batch} x {s.cp_parity_seq}, "
        f"{n_params / 1e6:.1f}M params)",
        result["parity"],
        [
            "case",
            "cp",
            "backend",
            "loss_rel_err",
            "grad_rel_err",
            "worst_param",
            "pass",
            "detected",
            "status",
        ],
    )
    write_json(run, "cp", result)

    # Throughput: bf16, batch 1, plain causal batch (torch's ring on CUDA, portable on CPU).
    model.to(torch.bfloat16 if run.device == "cuda" else torch.float32)
    model.zero_grad(set_to_none=True)
    free_memory(run)
    capacity = (
        torch.cuda.get_device_properties(run.dev).total_memory / GIB
        if run.device == "cuda"
        else None
    )
    for c in cp_sizes:
        backend = args.cp_throughput_backend
        longest, broke = _cp_sweep(run, model, meshes[c], seq_lens, backend, capacity, result)
        if longest is None and broke == "error" and backend == "auto" and c > 1:
            # torch's ring failed outright (e.g. an API change in this torch): still measure CP,
            # with the portable backend, instead of leaving the sweep empty.
            emit(run, f"[cp] cp={c}: the auto backend failed; sweeping the portable backend")
            longest, broke = _cp_sweep(
                run, model, meshes[c], seq_lens, "portable", capacity, result
            )
        result["longest_fit"][str(c)] = longest
    table(
        run,
        f"[cp] forward+backward throughput, batch 1 ({run.device}, "
        f"{'bf16' if run.device == 'cuda' else 'fp32'})",
        result["throughput"],
        [
            "cp",
            "seq",
            "backend",
            "ms",
            "tokens/s",
            "tokens/s/gpu",
            "TFLOP/s/gpu",
            "peak_gib",
            "status",
        ],
    )
    emit(run, f"[cp] longest sequence that fits per cp: {result['longest_fit']}")
    return result


def _cp_sweep(
    run: Run,
    model: Any,
    mesh: DeviceMesh,
    seq_lens: list[int],
    backend: str,
    capacity: float | None,
    result: dict[str, Any],
) -> tuple[int | None, str]:
    """Throughput at growing S on one cp mesh until a failure or a predicted out-of-memory.

    Returns:
        (longest S that ran or None, why the sweep ended: "done", "oom", "predicted", "error").
    """
    from cp_sharder import ContextParallelSharder

    c = mesh.size()
    vocab = run.sizes.cp_model["vocab_size"]
    last: tuple[int, float] | None = None
    longest = None
    for seq in seq_lens:
        if seq % (2 * c):
            result["throughput"].append({"cp": c, "seq": seq, "status": "skip: not % 2*cp"})
            continue
        if last is not None and capacity is not None:
            prev_seq, prev_peak = last
            growth = seq / prev_seq
            if backend == "portable" and c > 1:
                growth = growth**2  # the portable backend's [S/cp, S] mask and scores
            predicted = prev_peak * growth
            if predicted > 0.95 * capacity:
                result["throughput"].append(
                    {
                        "cp": c,
                        "seq": seq,
                        "status": f"skip: predicted {predicted:.0f} GiB > "
                        f"0.95 x {capacity:.0f} GiB",
                    }
                )
                return longest, "predicted"
        out = phase(
            run,
            f"cp throughput cp={c} S={seq}",
            lambda seq=seq: _cp_throughput(
                run, model, mesh, seq, vocab, backend, ContextParallelSharder
            ),
        )
        model.zero_grad(set_to_none=True)
        free_memory(run)
        if not out.ok:
            status = "OOM" if out.oom else "error"
            result["throughput"].append(
                {"cp": c, "seq": seq, "status": status, "error": out.errors}
            )
            if not out.oom:
                result["errors"] += out.errors
            write_json(run, "cp", result)
            return longest, status.lower()
        row = out.value
        result["throughput"].append(row)
        longest = seq
        if row["peak_gib"] is not None:
            last = (seq, row["peak_gib"])
        write_json(run, "cp", result)
    return longest, "done"


def _cp_throughput(
    run: Run,
    model: Any,
    mesh: DeviceMesh,
    seq: int,
    vocab: int,
    backend: str,
    sharder_cls: Any,
) -> dict[str, Any]:
    c = mesh.size()
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(1, vocab, (1, seq), generator=g)
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    batch = {"input_ids": ids.to(run.dev), "labels": labels.to(run.dev)}
    if backend == "portable":
        # A masked first key makes the batch not plain causal: the sharder then keeps the
        # portable backend on CUDA too.
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        batch["attention_mask"] = mask.to(run.dev)
        batch["labels"][0, 0] = IGNORE
    sharder = sharder_cls(model, mesh, padding_token_id=0)
    used = {"backend": ""}

    def step() -> None:
        train_ctx, local = sharder.shard(batch)
        used["backend"] = sharder.layout.backend.value
        lab = local.pop("labels")
        with train_ctx():
            logits = model(**local).logits
        loss = _loss_sum(logits, lab) / sharder.num_label_tokens(device=run.dev)
        del logits
        loss.backward()
        model.zero_grad(set_to_none=True)

    base = reset_peak(run)
    seconds = timed(run, step, warmup=1, iters=run.args.steps)
    peak = peak_gib_max(run)
    tokens_s = seq / seconds
    flops = _model_flops_per_token(model, seq) * seq
    return {
        "cp": c,
        "seq": seq,
        "backend": used["backend"],
        "ms": seconds * 1e3,
        "tokens/s": tokens_s,
        "tokens/s/gpu": tokens_s / c,
        "TFLOP/s/gpu": flops / seconds / c / 1e12,
        "peak_gib": peak,
        "base_gib": base,
        "status": "ok",
    }


# ----------------------------------------------------------------------------- 2. vocab
def _vp_inputs(run: Run) -> dict[str, Tensor]:
    """Same tensors on every rank: generated on rank 0's stream of a fixed seed, then broadcast."""
    s = run.sizes
    t, v, h = s.vocab_tokens, s.vocab_size, s.vocab_hidden
    dev = run.dev
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if run.device == "cuda" else torch.float32
    out = {
        "logits": (torch.randn(t, v, generator=g, device=dev) * 2.0).to(dtype),
        "hidden": torch.randn(t, h, generator=g, device=dev).to(dtype),
        # Logits of std 1: bf16 rounding of the fused form's logits stays well inside its bound.
        "weight": (torch.randn(v, h, generator=g, device=dev) / math.sqrt(h)).to(dtype),
        "labels": torch.randint(0, v, (t,), generator=g, device=dev),
        "upstream": torch.randn(t, generator=g, device=dev),
    }
    ignored = torch.rand(t, generator=g, device=dev) < 0.05
    out["labels"] = out["labels"].masked_fill(ignored, IGNORE)
    for x in out.values():
        dist.broadcast(x, src=0)
    return out


def _ref_log_probs(logits64: Tensor, labels: Tensor) -> Tensor:
    """float64 dense reference: log_softmax then gather; 0 where the label is ignored."""
    valid = labels != IGNORE
    lp = torch.log_softmax(logits64, dim=-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    return torch.where(valid, lp, torch.zeros_like(lp))


def _vp_parity(run: Run, mesh: DeviceMesh, x: dict[str, Tensor]) -> list[dict[str, Any]]:
    from torch.distributed.tensor import Shard, distribute_tensor

    import vocab_parallel as vp

    rows = []
    labels, up = x["labels"], x["upstream"]
    # Logits form.
    dt = distribute_tensor(x["logits"], mesh, [Shard(1)]).requires_grad_()
    lp = vp.token_log_probs(dt, labels)
    (lp * up).sum().backward()
    got_grad = dt.grad.full_tensor()
    ref_in = x["logits"].double().requires_grad_()
    ref = _ref_log_probs(ref_in, labels)
    (ref * up.double()).sum().backward()
    v_err, g_err = abs_err(lp, ref), rel_err(got_grad, ref_in.grad)
    rows.append(
        {
            "function": "token_log_probs",
            "local_shape": list(dt.to_local().shape),
            "value_abs_err": v_err,
            "grad_rel_err": g_err,
            "pass": v_err < VP_VALUE_TOL and g_err < VP_GRAD_TOL,
        }
    )
    # Negative control: each rank normalising over its own shard only must be flagged.
    local = dt.to_local().detach()
    offset = sum(_all_gather_ints(run, local.shape[-1])[: run.rank])
    in_shard = (labels >= offset) & (labels < offset + local.shape[-1])
    local_labels = torch.where(in_shard, labels - offset, torch.full_like(labels, IGNORE))
    wrong = vp.token_log_probs(local, local_labels)
    expect = torch.where(in_shard, ref.detach(), torch.zeros_like(ref))
    c_err = reduce_scalar(run, abs_err(wrong, expect), dist.ReduceOp.MAX)
    rows.append(
        {
            "function": "control: shard-local softmax",
            "local_shape": list(local.shape),
            "value_abs_err": c_err,
            "detected": c_err >= VP_VALUE_TOL,
            "pass": c_err >= VP_VALUE_TOL,
            "status": "ok (control)" if c_err >= VP_VALUE_TOL else "CONTROL NOT DETECTED",
        }
    )
    del dt, lp, got_grad, ref_in, ref, local, wrong
    free_memory(run)
    # Fused linear form: weight sharded over V (a ColwiseParallel lm_head).
    w = distribute_tensor(x["weight"], mesh, [Shard(0)]).requires_grad_()
    hidden = x["hidden"].clone().requires_grad_()
    lp = vp.linear_token_log_probs(hidden, w, labels)
    (lp * up).sum().backward()
    w_grad = w.grad.full_tensor()
    h64 = x["hidden"].double().requires_grad_()
    w64 = x["weight"].double().requires_grad_()
    ref = _ref_log_probs(h64 @ w64.T, labels)
    (ref * up.double()).sum().backward()
    v_err = abs_err(lp, ref)
    gw, gh = rel_err(w_grad, w64.grad), rel_err(hidden.grad, h64.grad)
    # Every rank must hold the same (full) hidden gradient.
    first = hidden.grad.clone()
    dist.broadcast(first, src=0)
    h_spread = reduce_scalar(run, rel_err(hidden.grad, first), dist.ReduceOp.MAX)
    rows.append(
        {
            "function": "linear_token_log_probs",
            "local_shape": list(w.to_local().shape),
            "value_abs_err": v_err,
            "grad_rel_err": max(gw, gh),
            "weight_grad_rel_err": gw,
            "hidden_grad_rel_err": gh,
            "hidden_grad_rank_spread": h_spread,
            "pass": v_err < VP_LINEAR_VALUE_TOL
            and max(gw, gh) < VP_LINEAR_GRAD_TOL
            and h_spread < 1e-6,
        }
    )
    return rows


def _vp_timing(run: Run, mesh: DeviceMesh, x: dict[str, Tensor]) -> list[dict[str, Any]]:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import vocab_parallel as vp

    labels, up = x["labels"], x["upstream"]
    safe = labels.clamp(min=0)[:, None]
    valid = labels != IGNORE
    dt = distribute_tensor(x["logits"], mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(x["weight"], mesh, [Shard(0)]).requires_grad_()
    hidden = x["hidden"].clone().requires_grad_()
    shape = torch.Size((hidden.shape[0], w.shape[0]))  # [T, V]; V may be uneven over ranks

    def naive(logits: Tensor) -> Tensor:
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, safe)[:, 0]
        return torch.where(valid, lp, torch.zeros_like(lp))

    def ours_logits() -> None:
        (vp.token_log_probs(dt, labels) * up).sum().backward()
        dt.grad = None

    def gather_logits() -> None:
        (naive(dt.full_tensor()) * up).sum().backward()
        dt.grad = None

    def ours_linear() -> None:
        (vp.linear_token_log_probs(hidden, w, labels) * up).sum().backward()
        w.grad, hidden.grad = None, None

    def gather_linear() -> None:
        local = hidden @ w.to_local().T  # [T, V/W]
        full = DTensor.from_local(
            local, mesh, [Shard(1)], run_check=False, shape=shape, stride=(shape[1], 1)
        ).full_tensor()
        (naive(full) * up).sum().backward()
        assert hidden.grad is not None
        dist.all_reduce(hidden.grad)  # what the fused form's backward does for the hidden grad
        w.grad, hidden.grad = None, None

    rows = []
    pairs = [
        ("token_log_probs (sharded)", ours_logits, "logits"),
        ("full_tensor + log_softmax", gather_logits, "logits"),
        ("linear_token_log_probs (sharded W)", ours_linear, "linear"),
        ("matmul + full_tensor + log_softmax", gather_linear, "linear"),
    ]
    for name, fn, form in pairs:
        out = phase(run, f"vocab timing {name}", lambda fn=fn: _time_with_memory(run, fn))
        row = {"variant": name, "form": form}
        if out.ok:
            row.update(out.value)
        else:
            row.update(status="OOM" if out.oom else "error", error=out.errors)
        rows.append(row)
    for form in ("logits", "linear"):
        ours, base = [r for r in rows if r["form"] == form]
        if "ms" in ours and "ms" in base:
            ours["speedup_vs_gather"] = base["ms"] / ours["ms"]
    return rows


def _time_with_memory(run: Run, fn: Callable[[], None]) -> dict[str, Any]:
    base = reset_peak(run)
    seconds = timed(run, fn, warmup=2, iters=run.args.iters)
    peak = peak_gib_max(run)
    return {
        "ms": seconds * 1e3,
        "peak_extra_gib": None if peak is None else peak - base,
        "status": "ok",
    }


def section_vocab(run: Run) -> dict[str, Any]:
    s = run.sizes
    result: dict[str, Any] = {
        "tokens": s.vocab_tokens,
        "vocab": s.vocab_size,
        "hidden": s.vocab_hidden,
        "dtype": "bfloat16" if run.device == "cuda" else "float32",
        "tp": run.world,
        "tolerances": {
            "value_abs": VP_VALUE_TOL,
            "grad_rel": VP_GRAD_TOL,
            "linear_value_abs": VP_LINEAR_VALUE_TOL,
            "linear_grad_rel": VP_LINEAR_GRAD_TOL,
        },
        "errors": [],
    }
    mesh = init_device_mesh(run.device, (run.world,), mesh_dim_names=("tp",))
    inputs = phase(run, "vocab inputs", lambda: _vp_inputs(run))
    if not inputs.ok:
        result["errors"] += inputs.errors
        return result
    x = inputs.value
    par = phase(run, "vocab parity", lambda: _vp_parity(run, mesh, x))
    result["parity"] = par.value if par.ok else [{"status": "error", "error": par.errors}]
    if not par.ok:
        result["errors"] += par.errors
    free_memory(run)
    table(
        run,
        f"[vocab] parity vs float64 dense, tp={run.world}, T={s.vocab_tokens} V={s.vocab_size}",
        result["parity"],
        ["function", "local_shape", "value_abs_err", "grad_rel_err", "pass", "detected", "status"],
    )
    write_json(run, "vocab", result)
    tim = phase(run, "vocab timing", lambda: _vp_timing(run, mesh, x))
    result["timing"] = tim.value if tim.ok else [{"status": "error", "error": tim.errors}]
    if not tim.ok:
        result["errors"] += tim.errors
    table(
        run,
        f"[vocab] forward+backward, tp={run.world} ({result['dtype']}, H={s.vocab_hidden})",
        result["timing"],
        ["variant", "ms", "speedup_vs_gather", "peak_extra_gib", "status"],
    )
    return result


# ----------------------------------------------------------------------------- 3. moe
def _moe_counts(base: int, world: int) -> list[int]:
    """Unequal tokens per rank; with 3 or more ranks the last one holds none."""
    counts = [base - r * base // (2 * world) + 3 * r for r in range(world)]
    if world >= 3:
        counts[-1] = 0
    return counts


def _moe_global(run: Run, counts: list[int], hidden: int, dtype: torch.dtype) -> dict[str, Tensor]:
    """Global routing problem, identical on every rank (CPU generator, then moved)."""
    s = run.sizes
    e, k = s.moe_experts, s.moe_top_k
    total = sum(counts)
    g = torch.Generator().manual_seed(11)
    scores = torch.rand(total, e, generator=g)
    ids = scores.topk(k, dim=-1).indices
    ids[torch.rand(total, k, generator=g) < 0.05] = -1  # some slots route nowhere
    weights = torch.softmax(torch.randn(total, k, generator=g), dim=-1)
    return {
        "x": torch.randn(total, hidden, generator=g).to(run.dev, dtype),
        "ids": ids.to(run.dev),
        "w": weights.to(run.dev, dtype),
        "grad_out": torch.randn(total, hidden, generator=g).to(run.dev, dtype),
        # Expert e computes x * a[e] + b[e]: distinct per expert, so a row routed to the wrong
        # expert or a swapped token changes the result.
        "a": (1.0 + 0.1 * torch.randn(e, hidden, generator=g)).to(run.dev, dtype),
        "b": (0.1 * torch.randn(e, hidden, generator=g)).to(run.dev, dtype),
    }


def _moe_reference(glob: dict[str, Tensor], rows: slice) -> tuple[Tensor, Tensor, Tensor]:
    """Dense float64 loop over the top-k slots: out, d loss/d x, d loss/d w."""
    x = glob["x"][rows].double().requires_grad_()
    w = glob["w"][rows].double().requires_grad_()
    ids = glob["ids"][rows]
    a, b = glob["a"].double(), glob["b"].double()
    out = torch.zeros_like(x)
    for slot in range(ids.shape[1]):
        e = ids[:, slot]
        live = (e >= 0).double()[:, None]
        ec = e.clamp(min=0)
        out = out + live * w[:, slot : slot + 1] * (x * a[ec] + b[ec])
    (out * glob["grad_out"][rows].double()).sum().backward()
    assert x.grad is not None and w.grad is not None
    return out.detach(), x.grad, w.grad


def _moe_parity(
    run: Run, dispatcher: Any, dtype: torch.dtype, name: str, *, control: bool = False
) -> dict[str, Any]:
    """Dispatch, a distinct function per expert, combine, backward; vs the dense reference.

    ``control=True`` applies each row the function of the next expert (an ownership off by one),
    which the check must flag.
    """
    s = run.sizes
    counts = _moe_counts(s.moe_parity_tokens, run.world)
    glob = _moe_global(run, counts, s.moe_parity_hidden, dtype)
    start = sum(counts[: run.rank])
    rows = slice(start, start + counts[run.rank])
    x = glob["x"][rows].clone().requires_grad_()
    w = glob["w"][rows].clone().requires_grad_()
    expert_in, per_expert, handle = dispatcher.dispatch(x, glob["ids"][rows], w)
    first = dispatcher.local_expert_start
    local_ids = torch.repeat_interleave(
        torch.arange(first, first + dispatcher.num_local_experts, device=run.dev), per_expert
    )
    if control:
        local_ids = (local_ids + 1) % s.moe_experts
    y = expert_in * glob["a"][local_ids] + glob["b"][local_ids]
    out = dispatcher.combine(y, handle)
    (out.float() * glob["grad_out"][rows].float()).sum().backward()
    ref_out, ref_x, ref_w = _moe_reference(glob, rows)
    # Global per-expert counts: this rank's slice of them is what it must have received.
    all_ids = glob["ids"]
    global_counts = torch.bincount(all_ids[all_ids >= 0], minlength=s.moe_experts)
    want = global_counts[first : first + dispatcher.num_local_experts]
    assert x.grad is not None and w.grad is not None
    errs = {
        "out": rel_err(out, ref_out),
        "grad_x": rel_err(x.grad, ref_x),
        "grad_w": rel_err(w.grad, ref_w),
    }
    counts_ok = bool(torch.equal(per_expert.cpu(), want.cpu()))
    tol = MOE_TOL[dtype]
    ok = counts_ok and all(v < tol for v in errs.values())
    # Every rank must pass: reduce the worst error and the pass flag.
    worst = {k: reduce_scalar(run, v, dist.ReduceOp.MAX) for k, v in errs.items()}
    return {
        "dispatcher": name + (" (control: wrong expert)" if control else ""),
        "dtype": str(dtype).replace("torch.", ""),
        "tokens_per_rank": counts,
        "hidden": s.moe_parity_hidden,
        "counts_match": all_ok(run, counts_ok),
        **{f"{k}_rel_err": v for k, v in worst.items()},
        "tol": tol,
        "pass": all_ok(run, ok),
        "status": "ok",
    }


def _moe_bandwidth(run: Run, dispatcher: Any, tokens: int, hidden: int) -> dict[str, Any]:
    s = run.sizes
    dtype = torch.bfloat16 if run.device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(100 + run.rank)
    ids = torch.rand(tokens, s.moe_experts, generator=g).topk(s.moe_top_k, dim=-1).indices
    ids = ids.to(run.dev)
    w = torch.full((tokens, s.moe_top_k), 1.0 / s.moe_top_k, device=run.dev, dtype=dtype)
    x = torch.randn(tokens, hidden, generator=g).to(run.dev, dtype)
    t_dispatch: list[float] = []
    t_combine: list[float] = []
    with torch.no_grad():
        for i in range(2 + run.args.iters):
            barrier(run)
            t0 = time.perf_counter()
            expert_in, _, handle = dispatcher.dispatch(x, ids, w)
            sync(run)
            t1 = time.perf_counter()
            dispatcher.combine(expert_in, handle)
            sync(run)
            t2 = time.perf_counter()
            if i >= 2:
                t_dispatch.append(t1 - t0)
                t_combine.append(t2 - t1)
    d = reduce_scalar(run, statistics.median(t_dispatch), dist.ReduceOp.MAX)
    c = reduce_scalar(run, statistics.median(t_combine), dist.ReduceOp.MAX)
    nbytes = tokens * s.moe_top_k * hidden * x.element_size()
    return {
        "tokens/rank": tokens,
        "hidden": hidden,
        "MB/rank/way": nbytes / 1e6,
        "dispatch_ms": d * 1e3,
        "combine_ms": c * 1e3,
        "dispatch_GB/s": nbytes / d / 1e9,
        "combine_GB/s": nbytes / c / 1e9,
        "status": "ok",
    }


def section_moe(run: Run) -> dict[str, Any]:
    from moe_dispatch import AllToAllDispatcher

    s = run.sizes
    if s.moe_experts % run.world:
        raise ValueError(f"{s.moe_experts} experts do not split over {run.world} ranks")
    result: dict[str, Any] = {
        "experts": s.moe_experts,
        "top_k": s.moe_top_k,
        "ep": run.world,
        "parity": [],
        "bandwidth": [],
        "errors": [],
        "bytes_note": "tokens * top_k * hidden * element size per rank and direction, rows a "
        "rank sends to itself included (algorithmic bandwidth)",
    }
    group = dist.new_group(list(range(run.world)))
    a2a = AllToAllDispatcher(group, s.moe_experts)
    dtypes = [torch.float32] + ([torch.bfloat16] if run.device == "cuda" else [])
    for dtype in dtypes:
        out = phase(
            run, f"moe parity {dtype}", lambda d=dtype: _moe_parity(run, a2a, d, "all-to-all")
        )
        if out.ok:
            result["parity"].append(out.value)
        else:
            result["parity"].append({"dispatcher": "all-to-all", "status": "error", "pass": False})
            result["errors"] += out.errors
    # Negative control: off-by-one expert ownership must be flagged by the same check.
    ctl = phase(
        run, "moe control", lambda: _moe_parity(run, a2a, torch.float32, "all-to-all", control=True)
    )
    if ctl.ok:
        row = ctl.value
        row["detected"] = not row["pass"]
        row["pass"] = row["detected"]
        row["status"] = "ok (control)" if row["detected"] else "CONTROL NOT DETECTED"
        result["parity"].append(row)
    else:
        result["errors"] += ctl.errors
    if run.device == "cuda" and importlib.util.find_spec("deep_ep") is not None:
        from moe_dispatch import HybridEPDispatcher

        def hybrid() -> dict[str, Any]:
            return _moe_parity(
                run, HybridEPDispatcher(group, s.moe_experts), torch.bfloat16, "hybrid-ep"
            )

        out = phase(run, "moe parity hybrid-ep", hybrid)
        result["parity"].append(
            out.value if out.ok else {"dispatcher": "hybrid-ep", "status": "error", "pass": False}
        )
        result["errors"] += out.errors
    else:
        result["parity"].append(
            {"dispatcher": "hybrid-ep", "status": "skipped: deep_ep not installed or no CUDA"}
        )
    table(
        run,
        f"[moe] dispatch+combine parity vs dense float64 loop, ep={run.world}, "
        f"E={s.moe_experts} K={s.moe_top_k}",
        result["parity"],
        [
            "dispatcher",
            "dtype",
            "tokens_per_rank",
            "counts_match",
            "out_rel_err",
            "grad_x_rel_err",
            "grad_w_rel_err",
            "pass",
            "detected",
            "status",
        ],
    )
    write_json(run, "moe", result)
    for hidden in s.moe_hiddens:
        for tokens in s.moe_tokens:
            out = phase(
                run,
                f"moe bandwidth T={tokens} H={hidden}",
                lambda t=tokens, h=hidden: _moe_bandwidth(run, a2a, t, h),
            )
            if out.ok:
                result["bandwidth"].append(out.value)
            else:
                result["bandwidth"].append(
                    {
                        "tokens/rank": tokens,
                        "hidden": hidden,
                        "status": "OOM" if out.oom else "error",
                    }
                )
                result["errors"] += out.errors
            free_memory(run)
    table(
        run,
        f"[moe] all-to-all bandwidth, ep={run.world}, top-{s.moe_top_k}, "
        f"{'bf16' if run.device == 'cuda' else 'fp32'} (forward, no grad)",
        result["bandwidth"],
        [
            "tokens/rank",
            "hidden",
            "MB/rank/way",
            "dispatch_ms",
            "dispatch_GB/s",
            "combine_ms",
            "combine_GB/s",
            "status",
        ],
    )
    return result


# ----------------------------------------------------------------------------- 4. engine
def _engine_step_rate(run: Run, mesh: DeviceMesh) -> dict[str, Any]:
    from train_engine import Engine, FSDP2Config, apply_data_parallel, param_groups

    s = run.sizes
    model = _build_llama(run, s.engine_model, s.engine_seq, torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    cuda = run.device == "cuda"
    model = apply_data_parallel(
        model,
        mesh=mesh,
        config=FSDP2Config(
            param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32
        ),
    )
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-5, fused=cuda)
    engine = Engine(model, opt, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(1000 + run.rank)
    vocab = s.engine_model["vocab_size"]
    data = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (s.engine_batch, s.engine_seq), generator=g).to(run.dev)
        data.append({"input_ids": ids, "labels": ids.clone()})
    state = {"i": 0, "loss": 0.0}

    def step() -> None:
        batch = data[state["i"] % 2]
        state["i"] += 1
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

    base = reset_peak(run)
    seconds = timed(run, step, warmup=2, iters=run.args.steps)
    peak = peak_gib_max(run)
    with torch.no_grad():
        final = float(model(**data[0]).loss)
    tokens = s.engine_batch * s.engine_seq
    cfg = model.config
    flops = 6.0 * n_params + 6.0 * cfg.num_hidden_layers * cfg.hidden_size * s.engine_seq
    return {
        "dp": mesh.size(),
        "ms/step": seconds * 1e3,
        "tokens/s/gpu": tokens / seconds,
        "TFLOP/s/gpu": tokens / seconds * flops / 1e12,
        "peak_gib": peak,
        "base_gib": base,
        "final_loss": final,
        "finite": math.isfinite(final),
        "params": n_params,
        "status": "ok",
    }


def section_engine(run: Run) -> dict[str, Any]:
    s = run.sizes
    result: dict[str, Any] = {
        "model": s.engine_model,
        "batch_per_gpu": [s.engine_batch, s.engine_seq],
        "rows": [],
        "errors": [],
    }
    single: float | None = run.args.single_gpu_tokens_per_s
    if single is None:
        # Every rank runs the one-GPU step on its own 1-rank mesh at the same time: the
        # same number as rank 0 alone, in the time of one run.
        solo_mesh = init_device_mesh(run.device, (run.world, 1), mesh_dim_names=("rep", "dp"))
        out = phase(run, "engine dp=1", lambda: _engine_step_rate(run, solo_mesh["dp"]))
        if out.ok:
            row = out.value
            # Each rank measured its own GPU; report the slowest.
            row["tokens/s/gpu"] = reduce_scalar(run, row["tokens/s/gpu"], dist.ReduceOp.MIN)
            row["setup"] = "one GPU (every rank alone)"
            result["rows"].append(row)
            single = row["tokens/s/gpu"]
        else:
            result["rows"].append({"dp": 1, "status": "OOM" if out.oom else "error"})
            result["errors"] += out.errors
    else:
        result["rows"].append(
            {"dp": 1, "tokens/s/gpu": single, "setup": "--single-gpu-tokens-per-s", "status": "ok"}
        )
    free_memory(run)
    mesh = init_device_mesh(run.device, (run.world,), mesh_dim_names=("dp",))
    out = phase(run, f"engine dp={run.world}", lambda: _engine_step_rate(run, mesh))
    if out.ok:
        row = out.value
        row["setup"] = f"FSDP2 over {run.world} ranks"
        if single:
            row["efficiency"] = row["tokens/s/gpu"] / single
        result["rows"].append(row)
    else:
        result["rows"].append({"dp": run.world, "status": "OOM" if out.oom else "error"})
        result["errors"] += out.errors
    table(
        run,
        f"[engine] SFT step (Engine + FSDP2, "
        f"{'bf16 params / fp32 reduce' if run.device == 'cuda' else 'fp32'}), batch "
        f"{s.engine_batch} x {s.engine_seq} per GPU",
        result["rows"],
        [
            "setup",
            "dp",
            "ms/step",
            "tokens/s/gpu",
            "efficiency",
            "TFLOP/s/gpu",
            "peak_gib",
            "final_loss",
            "status",
        ],
    )
    return result


# ----------------------------------------------------------------------------- main
def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for dist_name in (
        "transformers",
        "cp-sharder",
        "vocab-parallel",
        "moe-dispatch",
        "train-engine",
    ):
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            out[dist_name] = "not installed"
    return out


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU, < 2 minutes)")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma list of " + ",".join(SECTIONS)
    )
    p.add_argument("--out", required=True, help="folder for the JSON files")
    p.add_argument("--seq-lens", type=_int_list, default=None, help="cp sweep, e.g. 8192,16384")
    p.add_argument(
        "--cp-sizes",
        type=_int_list,
        default=None,
        help="cp degrees (each divides W; default W; 1 adds the no-CP baseline)",
    )
    p.add_argument(
        "--cp-throughput-backend",
        choices=["auto", "portable"],
        default="auto",
        help="auto: the sharder's pick for a plain causal batch (torch's ring on CUDA); "
        "portable: mask one key so the portable backend runs (memory grows with S^2/cp)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps of cp / engine")
    p.add_argument("--iters", type=int, default=None, help="timed iterations of vocab / moe")
    p.add_argument("--single-gpu-tokens-per-s", type=float, default=None)
    p.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of caught errors")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    bad = [x for x in args.sections if x not in SECTIONS]
    if bad:
        p.error(f"unknown sections {bad}; choose from {list(SECTIONS)}")
    if args.steps is None:
        args.steps = 2 if args.quick else 4
    if args.iters is None:
        args.iters = 3 if args.quick else 10
    if args.device == "cpu" and not args.quick:
        p.error("full sizes need GPUs (--device cuda); use --quick on the CPU")
    return args


def main() -> None:
    args = parse_args()
    # NVLink multicast stays off: on shared hosts a program using it can take the GPUs down.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --nproc-per-node 2 " + sys.argv[0])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    run = Run(
        args=args,
        sizes=QUICK if args.quick else FULL,
        device=args.device,
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        out=Path(args.out),
    )
    names: list[Any] = [None] * run.world
    name = torch.cuda.get_device_name() if run.device == "cuda" else platform.processor() or "cpu"
    dist.all_gather_object(names, name)
    run.meta = {
        "command": " ".join(
            [
                "torchrun",
                f"--nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', run.world)}",
                *sys.argv,
            ]
        ),
        "world_size": run.world,
        "device": run.device,
        "device_names": names,
        "versions": _versions(),
        "quick": args.quick,
        "steps": args.steps,
        "iters": args.iters,
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "sizes": asdict(run.sizes),
    }
    emit(
        run,
        f"multi_gpu: W={run.world} on {run.device} ({names[0]}), torch {torch.__version__}, "
        f"sections {args.sections}{' (quick)' if args.quick else ''}",
    )
    runners = {
        "cp": section_cp,
        "vocab": section_vocab,
        "moe": section_moe,
        "engine": section_engine,
    }
    summary = {}
    for section in args.sections:
        start = time.perf_counter()
        out = phase(run, section, lambda section=section: runners[section](run))
        payload = out.value if out.ok else {"errors": out.errors}
        payload["seconds"] = reduce_scalar(run, time.perf_counter() - start, dist.ReduceOp.MAX)
        payload["failed"] = not out.ok or bool(payload.get("errors"))
        write_json(run, section, payload)
        summary[section] = (payload["failed"], payload["seconds"])
        emit(
            run,
            f"[{section}] done in {payload['seconds']:.1f} s"
            + (" (with errors)" if payload["failed"] else ""),
        )
        free_memory(run)
    emit(
        run,
        "\nsummary: "
        + ", ".join(f"{k}={'ERRORS' if f else 'ok'} ({t:.0f} s)" for k, (f, t) in summary.items())
        + f"; JSON in {run.out}",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
