"""Packed (per-document) attention for any token layout: all-gather K/V, then varlen attention.

At cp=1 the local tokens are the whole stream, each document is one varlen segment and keys are
the queries' own. Under context parallelism each rank keeps its queries, all-gathers keys and
values once per layer (the backward reduce-scatters dK/dV to their owners) and cuts its queries
into *runs*: maximal stretches of consecutive global positions inside one document. A run
``[a, e)`` of a document starting at ``s`` attends to the keys ``[s, e)`` (causal) or the whole
document (bidirectional); its queries are the last keys of that range, so the kernel's
bottom-right causal alignment is exactly the global causal mask. With the head/tail layouts a
document meets a rank in at most two runs (its head and tail chunk), so the keys gathered for the
kernel are at most ``(1 + 1/2W)`` times the stream per layer, and no ``[S/W, S]`` mask exists.

Dimension letters: B rows, H heads, Hkv key/value heads, n local tokens per row, P padded
global length per row, D head dim, R runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cp_sharder._dist import CPGroup, all_gather_seq
from cp_sharder.attention import adapters
from cp_sharder.attention.adapters import AttentionArgs, Kernel, Limits, hf_attention
from cp_sharder.attention.varlen import Segments, varlen_attention

__all__ = ["HF_ATTENTION_KEY", "PackedAttention", "VarlenPlan", "plan_runs"]

#: Name under which the packed attention is registered in transformers' attention registry.
HF_ATTENTION_KEY = "cp_sharder_varlen"


@dataclass(kw_only=True, slots=True, frozen=True)
class VarlenPlan(Segments):
    """The kernel arguments of one step's packed attention (one per causal flag).

    The segments are this rank's query runs over the B*n flattened local queries and each run's
    key range; ``cu_seqlens_k`` is the same object as ``cu_seqlens_q`` when every run's keys are
    its own queries (cp=1, causal).

    Attributes:
        kv_index: [sum Lk] int64 index of each run's keys into the gathered keys flattened to
            [B*P], or None when the keys are the local queries themselves.
    """

    kv_index: Tensor | None


def _cumulative(lengths: Tensor) -> Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def plan_runs(
    segment_ids: Tensor,
    local_index: Tensor,
    inverse_index: Tensor,
    *,
    rows: int,
    causal: bool,
) -> VarlenPlan:
    """Build the varlen runs of this rank's queries (pure index math, on CPU).

    Args:
        segment_ids: [B or 1, P] int64 document (segment) id of every global position; a
            padding run must carry an id of its own, never its neighbour document's.
        local_index: [n] int64 global positions of this rank's tokens, in local order.
        inverse_index: [P] int64 slot of each global position in the gathered (rank-order)
            keys; ``arange(P)`` at cp=1.
        rows: B, the rows of the local query tensor.
        causal: whether the attention is causal (keys end at each run's last query).

    Returns:
        The plan; its tensors are on CPU.
    """
    segs = segment_ids.detach().to("cpu", torch.int64)
    if segs.shape[0] not in (1, rows):
        raise ValueError(f"segment ids have {segs.shape[0]} rows; expected 1 or {rows}")
    segs = segs.expand(rows, -1)
    padded = segs.shape[1]
    g = local_index.detach().to("cpu", torch.int64)
    n = g.numel()
    positions = torch.arange(padded)
    # First and one-past-last global position of the segment holding each global position.
    change = torch.ones_like(segs, dtype=torch.bool)
    change[:, 1:] = segs[:, 1:] != segs[:, :-1]
    seg_start = torch.where(change, positions, 0).cummax(dim=1).values
    end_mark = torch.ones_like(segs, dtype=torch.bool)
    end_mark[:, :-1] = segs[:, 1:] != segs[:, :-1]
    big = torch.full_like(segs, padded)
    seg_end = (
        torch.where(end_mark, positions + 1, big).flip(1).cummin(dim=1).values.flip(1)
    )  # exclusive end
    local_seg = segs[:, g]  # [B, n]
    new_run = torch.ones(rows, n, dtype=torch.bool)
    if n > 1:
        new_run[:, 1:] = (g[1:] != g[:-1] + 1)[None] | (local_seg[:, 1:] != local_seg[:, :-1])
    flat_new = new_run.reshape(-1)
    run_start = flat_new.nonzero().flatten()  # in flattened local order
    run_q_len = torch.diff(run_start, append=torch.tensor([rows * n]))
    run_row = run_start // n
    run_first = g[run_start % n]
    run_last = g[(run_start + run_q_len - 1) % n]
    key_start = seg_start[run_row, run_first]
    key_end = run_last + 1 if causal else seg_end[run_row, run_first]
    key_len = key_end - key_start
    cu_q = _cumulative(run_q_len)
    identity = bool(torch.equal(inverse_index.cpu(), positions)) and n == padded
    kv_index: Tensor | None = None
    if identity and causal:
        # cp=1: every run is a whole segment and its keys are its own queries.
        cu_k, max_k = cu_q, int(run_q_len.max())
    else:
        run_of_key = torch.repeat_interleave(torch.arange(run_start.numel()), key_len)
        cu_k, max_k = _cumulative(key_len), int(key_len.max())
        offset = torch.arange(int(cu_k[-1])) - cu_k[:-1][run_of_key]
        global_pos = key_start[run_of_key] + offset
        slot = inverse_index.cpu()[global_pos]
        kv_index = run_row[run_of_key] * padded + slot
    return VarlenPlan(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(run_q_len.max()),
        max_seqlen_k=max_k,
        kv_index=kv_index,
    )


@dataclass(kw_only=True, slots=True)
class PackedAttention:
    """One step's packed attention: the token metadata and its plans, shared by all layers.

    Attributes:
        segment_ids: [B or 1, P] int64 segment id of every global position (CPU).
        local_index: [n] int64 global positions of this rank's tokens.
        inverse_index: [P] int64 slot of each global position in the gathered keys.
        cp: the CP group.
        plans: plans already built, keyed by the causal flag.
        device_plans: plans moved to a device, keyed by (causal, device).
    """

    segment_ids: Tensor
    local_index: Tensor
    inverse_index: Tensor
    cp: CPGroup
    plans: dict[bool, VarlenPlan] = field(default_factory=dict)
    device_plans: dict[tuple[bool, str], VarlenPlan] = field(default_factory=dict)

    def plan(self, *, rows: int, causal: bool, device: torch.device) -> VarlenPlan:
        """The plan for this step and causal flag on ``device`` (built once)."""
        key = (causal, str(device))
        hit = self.device_plans.get(key)
        if hit is not None:
            return hit
        cpu = self.plans.get(causal)
        if cpu is None:
            cpu = plan_runs(
                self.segment_ids, self.local_index, self.inverse_index, rows=rows, causal=causal
            )
            self.plans[causal] = cpu
        cu_q = cpu.cu_seqlens_q.to(device=device, dtype=torch.int32)
        cu_k = (
            cu_q
            if cpu.cu_seqlens_k is cpu.cu_seqlens_q
            else cpu.cu_seqlens_k.to(device=device, dtype=torch.int32)
        )
        moved = VarlenPlan(
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=cpu.max_seqlen_q,
            max_seqlen_k=cpu.max_seqlen_k,
            kv_index=None if cpu.kv_index is None else cpu.kv_index.to(device),
        )
        self.device_plans[key] = moved
        return moved

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        causal: bool = True,
        scale: float | None = None,
        window: int | None = None,
    ) -> Tensor:
        """Packed attention of the local queries.

        Args:
            query: [B, H, n, D] this rank's queries (local order).
            key: [B, Hkv, n, D] this rank's keys.
            value: [B, Hkv, n, Dv] this rank's values.
            causal: causal attention within each document.
            scale: softmax scale; None means 1/sqrt(D).
            window: sliding window (transformers' convention), or None.

        Returns:
            [B, n, H, Dv] (the layout transformers' attention functions return).
        """
        rows, heads, n, head_dim = query.shape
        if n != self.local_index.numel():
            raise ValueError(
                f"attention got {n} local queries but the shard layout holds "
                f"{self.local_index.numel()} tokens per rank; call the model inside the "
                "train_ctx of the shard() that produced this batch"
            )
        plan = self.plan(rows=rows, causal=causal, device=query.device)
        q = query.transpose(1, 2).reshape(rows * n, heads, head_dim)
        if plan.kv_index is None:
            k = key.transpose(1, 2).reshape(rows * n, key.shape[1], key.shape[-1])
            v = value.transpose(1, 2).reshape(rows * n, value.shape[1], value.shape[-1])
        else:
            # One collective for K and V together; gathered slots are in rank order.
            kv = all_gather_seq(torch.cat([key, value], dim=-1), dim=2, cp=self.cp)
            kv = kv.transpose(1, 2).reshape(-1, kv.shape[1], kv.shape[-1])
            kv = kv.index_select(0, plan.kv_index)
            k, v = kv[..., : key.shape[-1]], kv[..., key.shape[-1] :]
        out = varlen_attention(q, k, v, plan, causal=causal, scale=scale, window=window)
        return out.reshape(rows, n, heads, out.shape[-1])


#: What the packed (varlen) kernel cannot honour; excluded from ``torch.compile`` because it
#: closes over this step's plan, and tracing it would recompile every layer at every step.
LIMITS = Limits(
    name="the packed (varlen) attention",
    mask_source="document boundaries come from shard()",
    dropout=False,
    compile_disabled=True,
)


def _kernel(packed: PackedAttention) -> Kernel:
    def kernel(query: Tensor, key: Tensor, value: Tensor, args: AttentionArgs) -> Tensor:
        out = packed(query, key, value, causal=args.causal, scale=args.scale, window=args.window)
        return out.transpose(1, 2)

    return kernel


def make_hf_attention(packed: PackedAttention) -> Callable[..., tuple[Tensor, None]]:
    """A transformers attention function (the registry signature) bound to this step."""
    return hf_attention(_kernel(packed), LIMITS)


def sdpa_attention(packed: PackedAttention) -> Callable[..., Tensor]:
    """A stand-in for ``F.scaled_dot_product_attention`` ([B, H, n, D]) for plain models."""
    return adapters.sdpa_attention(_kernel(packed), LIMITS)
