"""Rank functions for cp-sharder's distributed tests (re-imported by every spawned rank).

Each function builds the same global inputs on every rank from a fixed seed, runs the CP path,
and compares against a single-process float64 reference computed without CP. Errors are
returned (not asserted) so the test shows every case's numbers at once.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from _packed_workers import packed_batch
from cp_sharder import ContextParallelSharder
from train_testing.reference import grads_of, token_sum_cross_entropy, worst_grad_error
from train_testing.tiny_hf import TEXT_SIZES
from train_testing.tiny_hf import tiny_model as tiny_model_of

VOCAB = TEXT_SIZES["vocab_size"]


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer random-init causal LM (train_testing's tiny sizes, vocab 128) in fp32."""
    if arch == "qwen3_sliding":
        # Layer 0 uses a 4-token sliding window, layer 1 full causal attention.
        sliding = {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 4,
            "use_sliding_window": True,
        }
        return tiny_model_of("qwen3", seed=seed, **sliding).eval()
    if arch not in ("llama", "qwen2"):
        raise ValueError(arch)
    return tiny_model_of(arch, seed=seed).eval()


def _backward_and_sum(
    model: torch.nn.Module, loss: torch.Tensor, *, group: Any = None
) -> tuple[float, dict[str, torch.Tensor]]:
    """Backward this rank's loss share, then sum loss and gradients over the CP ranks."""
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return float(total), grads_of(model, missing="zeros")


def _compare(
    loss: float, grads: dict[str, torch.Tensor], ref_loss: float, ref: dict[str, torch.Tensor]
) -> dict[str, float]:
    worst, worst_name = worst_grad_error(grads, ref, floor=1e-6)
    return {
        "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
        "grad_rel_err": worst,
        "worst_param": worst_name,  # type: ignore[dict-item]
        "ref_loss": ref_loss,
    }


def _bshd_batch(seed: int, bsz: int, seq: int) -> dict[str, torch.Tensor]:
    """Row 1 is left-padded by 3 tokens; labels are pre-shifted (labels[t] = ids[t+1])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (bsz, seq), generator=g)
    mask = torch.ones(bsz, seq, dtype=torch.long)
    if bsz > 1:
        mask[1, :3] = 0
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[mask == 0] = -100
    labels[:, :-1][mask[:, 1:] == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _reference_bshd(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], embeds: bool
) -> tuple[float, dict[str, torch.Tensor]]:
    ref = copy.deepcopy(model).double()
    ref.zero_grad()
    count = int((batch["labels"] != -100).sum())
    if embeds:
        inputs = {"inputs_embeds": ref.get_input_embeddings()(batch["input_ids"])}
    else:
        inputs = {"input_ids": batch["input_ids"]}
    logits = ref(**inputs, attention_mask=batch["attention_mask"]).logits
    loss = token_sum_cross_entropy(logits, batch["labels"]) / count
    loss.backward()
    return float(loss.detach()), grads_of(ref, missing="zeros")


def _cp_step(
    model: torch.nn.Module,
    mesh: Any,
    batch: dict[str, Any],
    *,
    embeds: bool = False,
    device: str = "cpu",
) -> tuple[float, dict[str, torch.Tensor], ContextParallelSharder]:
    model.zero_grad()
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    if embeds:
        # As a VLM passes it: embeddings that carry grad back to the embedding table.
        batch["inputs_embeds"] = model.get_input_embeddings()(batch.pop("input_ids"))
    sharder = ContextParallelSharder(model, mesh, padding_token_id=0)
    train_ctx, local = sharder.shard(batch)
    labels = local.pop("labels")
    with train_ctx():
        logits = model(**local).logits
    count = sharder.num_label_tokens(device=device)
    loss = token_sum_cross_entropy(logits, labels) / count
    total, grads = _backward_and_sum(model, loss, group=mesh.get_group())
    return total, {n: g.cpu() for n, g in grads.items()}, sharder


def _packed_batch(
    real: list[list[int]], padded: list[list[int]] | None, seq: int, seed: int
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The packed tests' THD rows, with -1000 marking absent documents (any negative does)."""
    return packed_batch(real, padded, seq, seed, absent=-1000)


def _reference_docs(
    model: torch.nn.Module, docs: list[torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]]:
    """Each document run on its own (no packing at all), float64."""
    ref = copy.deepcopy(model).double()
    ref.zero_grad()
    count = sum(int(d.numel()) - 1 for d in docs)
    total = torch.zeros((), dtype=torch.float64)
    for d in docs:
        logits = ref(input_ids=d[None]).logits[0, :-1]
        total = total + token_sum_cross_entropy(logits, d[1:])
    loss = total / count
    loss.backward()
    return float(loss.detach()), grads_of(ref, missing="zeros")


def hf_parity(rank: int, world_size: int, arch: str) -> dict[str, dict[str, float]]:
    """Loss and all-reduced gradients of CP vs no-CP for BSHD, THD and inputs_embeds."""
    torch.manual_seed(1234)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = tiny_model(arch)
    results: dict[str, dict[str, float]] = {}

    # (a) batch 2, length 13 (not divisible by 2*cp), left padding in row 1.
    batch = _bshd_batch(seed=7, bsz=2, seq=13)
    ref_loss, ref = _reference_bshd(model, batch, embeds=False)
    loss, grads, sharder = _cp_step(model, mesh, batch)
    results["bshd"] = _compare(loss, grads, ref_loss, ref)
    results["bshd"]["padded_len"] = sharder.layout.sequence.padded_seq_len

    # (c) inputs_embeds carrying grad into the embedding table.
    loss, grads, _ = _cp_step(model, mesh, batch, embeds=True)
    ref_loss, ref = _reference_bshd(model, batch, embeds=True)
    results["embeds"] = _compare(loss, grads, ref_loss, ref)

    # Packed rows in [B, S] form marked only by restarting position_ids (transformers' rule).
    g = torch.Generator().manual_seed(17)
    docs = [torch.randint(1, VOCAB, (n,), generator=g) for n in (5, 8)]
    ids = torch.cat(docs)[None]
    labels = torch.full_like(ids, -100)
    labels[0, :4], labels[0, 5:12] = docs[0][1:], docs[1][1:]
    positions = torch.cat([torch.arange(5), torch.arange(8)])[None]
    ref_loss, ref = _reference_docs(model, docs)
    packed = {"input_ids": ids, "labels": labels, "position_ids": positions}
    loss, grads, sharder = _cp_step(model, mesh, packed)
    results["bshd_position_packed"] = _compare(loss, grads, ref_loss, ref)

    # (b) packed documents: each padded to a multiple of 8 (TE's THD partition) ...
    thd, docs = _packed_batch([[5, 7], [6, 3]], [[8, 8], [8, 8]], seq=16, seed=11)
    ref_loss, ref = _reference_docs(model, docs)
    loss, grads, sharder = _cp_step(model, mesh, thd)
    results["thd_padded"] = _compare(loss, grads, ref_loss, ref)
    results["thd_padded"]["layout"] = sharder.layout.sequence.kind.value  # type: ignore[assignment]

    # ... and unpadded documents (head/tail over the stream with document masking).
    thd, docs = _packed_batch([[5, 7, 4], [9, 3]], None, seq=16, seed=13)
    ref_loss, ref = _reference_docs(model, docs)
    loss, grads, sharder = _cp_step(model, mesh, thd)
    results["thd_unpadded"] = _compare(loss, grads, ref_loss, ref)
    results["thd_unpadded"]["layout"] = sharder.layout.sequence.kind.value  # type: ignore[assignment]
    return results


def token_verbs(rank: int, world_size: int) -> dict[str, float]:
    """shard/gather round trips and gradient routing to owners, on BSHD and packed layouts."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = torch.nn.Linear(2, 2)  # no hook, no TE: portable family
    out: dict[str, float] = {}
    for case, batch in (
        ("bshd", {"input_ids": torch.arange(2 * 11).reshape(2, 11)}),
        (
            "thd",
            {
                "input_ids": torch.arange(2 * 16).reshape(2, 16),
                "seq_lens": torch.tensor([[8, 8], [16, -1]]),
                "qkv_format": "thd",
            },
        ),
    ):
        sharder = ContextParallelSharder(model, mesh)
        sharder.shard(batch)
        layout = sharder.layout
        g = torch.Generator().manual_seed(5)
        rows = 2
        seq = batch["input_ids"].shape[1]
        x = torch.randn(rows, seq, 3, generator=g, dtype=torch.float64)
        x_local = sharder.shard_token_tensor(x, fill=0.0).detach().requires_grad_(True)
        back = sharder.gather_token_tensor(x_local, trim=True)
        out[f"{case}_roundtrip_err"] = float((back.detach() - x).abs().max())
        # Every rank weighs the gathered tensor differently; the gradient a token receives
        # must be the sum over ranks of those weights at its global position.
        full = sharder.gather_token_tensor(x_local)
        weights = [
            torch.randn(
                full.shape, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64
            )
            for r in range(world_size)
        ]
        (full * weights[rank]).sum().backward()
        expected = sum(weights).index_select(1, layout.local_token_global_indices)
        out[f"{case}_grad_err"] = float((x_local.grad - expected).abs().max())
        out[f"{case}_local_len"] = layout.local_seq_len

    class Hooked(torch.nn.Module):
        def prepare_model_inputs_for_cp(self, batch: dict[str, Any], **kw: Any) -> dict[str, Any]:
            return {"cp_layout": "contiguous"}

    sharder = ContextParallelSharder(Hooked(), mesh)
    _, local = sharder.shard({"input_ids": torch.arange(10)[None]})
    out["hook_indices"] = sharder.layout.local_token_global_indices.tolist()  # type: ignore[assignment]
    out["hook_ids"] = local["input_ids"][0].tolist()  # type: ignore[assignment]
    x = torch.randn(1, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    back = sharder.gather_token_tensor(sharder.shard_token_tensor(x, fill=0.0), trim=True)
    out["hook_roundtrip_err"] = float((back - x).abs().max())
    return out


class _TinyAttention(torch.nn.Module):
    """A plain PyTorch causal self-attention block calling SDPA (no transformers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, VOCAB)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.emb(input_ids)
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, s, 16) + h)


def plain_sdpa_parity(rank: int, world_size: int) -> dict[str, float]:
    """A non-transformers model: the SDPA override routes its causal attention through CP."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = _TinyAttention()
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (2, 10), generator=g)
    labels = torch.randint(0, VOCAB, (2, 10), generator=g)
    ref = copy.deepcopy(model).double()
    ref_loss = F.cross_entropy(ref(ids).reshape(-1, VOCAB), labels.reshape(-1))
    ref_loss.backward()
    sharder = ContextParallelSharder(model, mesh)
    ctx, local = sharder.shard({"input_ids": ids, "labels": labels})
    local_labels = local.pop("labels")
    with ctx():
        logits = model(**local)
    restored = F.scaled_dot_product_attention.__module__
    loss = token_sum_cross_entropy(logits, local_labels) / sharder.num_label_tokens()
    total, grads = _backward_and_sum(model, loss)
    result = _compare(total, grads, float(ref_loss.detach()), grads_of(ref, missing="zeros"))
    result["sdpa_restored"] = float(restored == "torch._C._nn" or "portable" not in restored)
    return result


def no_context_control(rank: int, world_size: int) -> dict[str, Any]:
    """Negative control: the sharded batch run WITHOUT train_ctx must fail the parity check."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = tiny_model("llama")
    batch = _bshd_batch(seed=7, bsz=2, seq=13)
    ref_loss, ref = _reference_bshd(model, batch, embeds=False)
    model.zero_grad()
    sharder = ContextParallelSharder(model, mesh)
    _, local = sharder.shard(batch)
    labels = local.pop("labels")
    logits = model(**local).logits  # local attention only: tokens miss other ranks' keys
    loss = token_sum_cross_entropy(logits, labels) / sharder.num_label_tokens()
    return _compare(*_backward_and_sum(model, loss), ref_loss, ref)


def batch_prep(rank: int, world_size: int) -> dict[str, Any]:
    """Gathered (untrimmed) padded tensors, to check the pad fills and rotary handling."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))

    class Model(torch.nn.Module):
        def forward(
            self,
            input_ids: torch.Tensor,
            position_ids: torch.Tensor,
            padding_mask: torch.Tensor,
            teacher: torch.Tensor,
        ) -> None:
            return None

    ids = torch.arange(1, 2 * 7 + 1).reshape(2, 7)
    labels = ids + 100
    mask = torch.ones(2, 7, dtype=torch.long)
    mrope = torch.stack([torch.arange(7).expand(2, 7) * (a + 1) for a in range(3)])  # [3, B, S]
    teacher = torch.randn(2, 7, 5, generator=torch.Generator().manual_seed(1))
    sharder = ContextParallelSharder(
        Model(), mesh, padding_token_id=-7, extra_seq_buffers={"teacher": 1}
    )
    _, local = sharder.shard(
        {
            "input_ids": ids,
            "labels": labels,
            "attention_mask": mask,
            "padding_mask": mask == 0,
            "position_ids": mrope,
            "teacher": teacher,
        }
    )
    g = sharder.gather_token_tensor
    return {
        "keys": sorted(local),
        "ids": g(local["input_ids"]),
        "labels": g(local["labels"]),
        "padding_mask": g(local["padding_mask"]),
        "attention_mask": g(sharder.local_buffers["attention_mask"]),
        "position_ids": g(local["position_ids"], seq_dim=2),
        "teacher": g(local["teacher"], trim=True),
        "teacher_in": teacher,
        "local_ids": local["input_ids"],
        "indices": sharder.layout.local_token_global_indices,
    }


def disagreeing_batches(rank: int, world_size: int) -> list[str]:
    """Ranks passing different batches, or one rank's batch failing validation, must raise on
    every rank; none may hang."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    sharder = ContextParallelSharder(torch.nn.Linear(2, 2), mesh)
    messages = []
    seq = 8 if rank == 0 else 12
    bad_ids = torch.ones(1, 8, dtype=torch.long)
    for batch in (
        {"input_ids": torch.ones(1, seq, dtype=torch.long)},
        {"input_ids": bad_ids, "labels": bad_ids if rank == 0 else bad_ids[:, :5]},
    ):
        try:
            sharder.shard(batch)
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


def mesh_errors(rank: int, world_size: int) -> list[str]:
    """A cp mesh whose group disagrees with it, and TE attention without TE installed."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    messages = []

    class WrongSizeMesh:
        ndim = 1
        mesh_dim_names = ("cp",)

        def get_group(self) -> Any:
            return mesh.get_group()

        def size(self) -> int:
            return world_size + 1

        def get_local_rank(self) -> int:
            return rank

    class WrongRankMesh(WrongSizeMesh):
        def size(self) -> int:
            return world_size

        def get_local_rank(self) -> int:
            return (rank + 1) % world_size

    for bad in (WrongSizeMesh(), WrongRankMesh()):
        try:
            ContextParallelSharder(torch.nn.Linear(2, 2), bad)
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))

    class TEAttention(torch.nn.Module):
        def set_context_parallel_group(self, *args: Any, **kwargs: Any) -> None:
            pass

    TEAttention.__module__ = "transformer_engine.pytorch.attention"
    model = torch.nn.Sequential(TEAttention())
    try:
        ContextParallelSharder(model, mesh).shard({"input_ids": torch.ones(1, 8, dtype=torch.long)})
        messages.append("no error")
    except ImportError as err:
        messages.append(str(err))
    return messages


def cuda_parity(rank: int, world_size: int, arch: str) -> dict[str, Any]:
    """NCCL/CUDA: the portable backend (padded and packed batches) and torch's ring (plain
    causal batch) against the CPU float64 no-CP reference."""
    device = f"cuda:{torch.cuda.current_device()}"
    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("cp",))
    cpu_model = tiny_model(arch)
    model = copy.deepcopy(cpu_model).to(device)
    results: dict[str, Any] = {}
    batch = _bshd_batch(seed=7, bsz=2, seq=13)
    ref_loss, ref = _reference_bshd(cpu_model, batch, embeds=False)
    loss, grads, sharder = _cp_step(model, mesh, batch, device=device)
    results["bshd_portable"] = _compare(loss, grads, ref_loss, ref)
    results["bshd_portable"]["backend"] = sharder.layout.backend.value
    thd, docs = _packed_batch([[5, 7], [6, 3]], [[8, 8], [8, 8]], seq=16, seed=11)
    ref_loss, ref = _reference_docs(cpu_model, docs)
    loss, grads, sharder = _cp_step(model, mesh, thd, device=device)
    results["thd_portable"] = _compare(loss, grads, ref_loss, ref)
    results["thd_portable"]["backend"] = sharder.layout.backend.value
    # No padding, no documents: plain causal, which torch's ring handles.
    # 125 tokens pad to 128: head/tail chunks of 32 at cp=2, as torch's ring needs.
    plain = _bshd_batch(seed=9, bsz=2, seq=125)
    plain.pop("attention_mask")
    plain["labels"][:, -1] = -100
    ref_model = copy.deepcopy(cpu_model).double()
    logits = ref_model(input_ids=plain["input_ids"]).logits
    ref_l = token_sum_cross_entropy(logits, plain["labels"]) / int((plain["labels"] != -100).sum())
    ref_l.backward()
    loss, grads, sharder = _cp_step(model, mesh, plain, device=device)
    results["bshd_ring"] = _compare(
        loss, grads, float(ref_l.detach()), grads_of(ref_model, missing="zeros")
    )
    results["bshd_ring"]["backend"] = sharder.layout.backend.value
    return results


def te_partition_parity(cu: list[int], world: int) -> bool:
    """Our closed form against Transformer Engine's own kernel (CUDA, TE installed)."""
    import transformer_engine_torch as tex

    from cp_sharder import layouts

    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    for rank in range(world):
        theirs = tex.thd_get_partitioned_indices(cu_t, cu[-1], world, rank).long().cpu()
        ours = layouts.thd_partitioned_indices(cu_t, cu[-1], world, rank).cpu()
        if not torch.equal(theirs, ours):
            return False
    return True


def two_d_mesh(rank: int, world_size: int) -> dict[str, Any]:
    """A ("dp", "cp") mesh: the sharder binds the cp sub-mesh; the label count sums over dp."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "cp"))
    dp_rank = mesh["dp"].get_local_rank()
    sharder = ContextParallelSharder(torch.nn.Linear(2, 2), mesh)
    # Each dp replica has its own global batch; its cp ranks share it.
    ids = torch.arange(2 * 9).reshape(2, 9) + 100 * dp_rank
    labels = ids.clone()
    labels[:, : 1 + dp_rank] = -100
    sharder.shard({"input_ids": ids, "labels": labels})
    x = ids.double()[..., None].requires_grad_(False)
    back = sharder.gather_token_tensor(sharder.shard_token_tensor(x, fill=-1.0), trim=True)
    return {
        "cp_size": sharder.cp_size,
        "cp_rank": sharder.cp_rank,
        "roundtrip_err": float((back - x).abs().max()),
        "local_count": sharder.layout.sequence.num_label_tokens,
        "dp_count": int(sharder.num_label_tokens(dp_group=mesh["dp"].get_group())),
    }
