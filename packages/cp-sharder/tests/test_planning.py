"""Pure planning checks (no processes): backend choice, THD round trips, packed-batch errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_sharder import layouts
from cp_sharder._dist import CPGroup
from cp_sharder.attention import Backend
from cp_sharder.backends import pick_backend
from cp_sharder.planning import PlanOptions, plan_batch


class _CudaMesh:
    device_type = "cuda"


def _backend(batch: dict[str, Any], *, cp: int = 2, hf: bool = True, cuda: bool = True) -> Backend:
    plan = plan_batch(batch, PlanOptions(cp=cp))
    group = CPGroup(size=cp, rank=0, mesh=_CudaMesh() if cuda else None)
    return pick_backend(plan, family=Backend.PORTABLE, cp=group, hf=hf, sliding_window=False)


def _energon_rows(lengths: list[int], seq: int) -> dict[str, torch.Tensor]:
    """Rows as energon-sft collates them: positions per packed part, zeros on the padding."""
    rows = len(lengths)
    ids = torch.randint(1, 50, (rows, seq), generator=torch.Generator().manual_seed(0))
    pos = torch.zeros(rows, seq, dtype=torch.long)
    mask = torch.zeros(rows, seq, dtype=torch.long)
    labels = torch.full((rows, seq), -100)
    for r, n in enumerate(lengths):
        pos[r, :n] = torch.arange(n)
        mask[r, :n] = 1
        labels[r, : n - 1] = ids[r, 1:n]
    return {"input_ids": ids, "position_ids": pos, "attention_mask": mask, "labels": labels}


def test_zero_padded_positions_are_not_documents_so_the_ring_is_chosen() -> None:
    """energon-sft pads position ids with zeros: that padding is no document restart."""
    batch = _energon_rows([100, 128], seq=128)
    without_mask = {k: v for k, v in batch.items() if k != "attention_mask"}
    assert _backend(without_mask) is Backend.TORCH_RING
    assert _backend(batch) is Backend.TORCH_RING  # right padding in the mask: still plain causal
    # The rule is narrow: real restarts are documents (varlen), left padding is not plain
    # causal (portable), CPU meshes and plain models never get torch's ring.
    packed = dict(without_mask)
    packed["position_ids"] = torch.cat([torch.arange(60), torch.arange(68)]).expand(2, 128)
    packed["labels"] = torch.full((2, 128), -100)
    assert _backend(packed) is Backend.VARLEN
    assert _backend(packed, cp=1) is Backend.VARLEN  # no dense packed mask at cp=1 either
    assert _backend(batch, cp=1) is Backend.NONE  # one document per row: the model as is
    left = dict(batch)
    left["attention_mask"] = batch["attention_mask"].flip(-1)
    assert _backend(left) is Backend.PORTABLE
    assert _backend(batch, cuda=False) is Backend.PORTABLE
    assert _backend(batch, hf=False) is Backend.PORTABLE
    # 100 tokens: head/tail chunks of 25 are not a multiple of 32, torch's ring cannot merge.
    short = _energon_rows([90, 100], seq=100)
    assert _backend(short) is Backend.PORTABLE


def test_packed_rows_pick_varlen_at_any_cp() -> None:
    thd = {"input_ids": torch.ones(2, 8, dtype=torch.long), "qkv_format": "thd"}
    thd["seq_lens"] = torch.tensor([[3, 5], [8, -1]])
    assert _backend(dict(thd), cp=1) is Backend.VARLEN
    assert _backend(dict(thd), cp=2) is Backend.VARLEN
    assert _backend(dict(thd), cp=2, cuda=False, hf=False) is Backend.VARLEN


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([2, 4]),
    st.lists(
        st.lists(st.integers(min_value=1, max_value=11), min_size=1, max_size=4),
        min_size=1,
        max_size=3,
    ),
    st.booleans(),
    st.integers(min_value=0, max_value=5),
)
def test_thd_shard_then_gather_is_the_identity(
    cp: int, rows: list[list[int]], pad_docs: bool, slack: int
) -> None:
    """Random documents per row, padded per document or not: every token comes back."""
    if pad_docs:
        padded = [[layouts.round_up(n, 2 * cp) for n in row] for row in rows]
    else:
        padded = rows
    seq = max(sum(row) for row in padded) + slack
    width = max(len(r) for r in rows)
    real_t = torch.full((len(rows), width), -1)
    pad_t = torch.full((len(rows), width), -1)
    for b, (row, prow) in enumerate(zip(rows, padded, strict=True)):
        real_t[b, : len(row)] = torch.tensor(row)
        pad_t[b, : len(prow)] = torch.tensor(prow)
    x = torch.randn(len(rows), seq, 3, dtype=torch.float64)
    batch: dict[str, Any] = {"inputs_embeds": x, "qkv_format": "thd", "seq_lens": real_t}
    if pad_docs:
        batch["seq_lens_padded"] = pad_t
    plan = plan_batch(batch, PlanOptions(cp=cp))
    sequence = plan.sequence
    table = layouts.all_rank_indices(
        sequence.kind,
        padded_len=sequence.padded_seq_len,
        cp=cp,
        cu_seqlens_padded=sequence.cu_seqlens_padded,
    )
    layouts.check_partition(table, sequence.padded_seq_len)
    stream = plan.tensors["inputs_embeds"]  # [1, P, 3]
    shards = [stream.index_select(1, table[r]) for r in range(cp)]
    gathered = torch.cat(shards, dim=1)  # what the all-gather returns, rank order
    restored = gathered.index_select(1, layouts.inverse_permutation(table.flatten()))
    assert torch.equal(restored, stream)
    trimmed = restored[:, : sequence.original_seq_len].reshape(len(rows), seq, 3)
    assert torch.equal(trimmed, x)
    if pad_docs and seq % (2 * cp) == 0:
        assert sequence.kind.value == "thd"


def test_packed_batch_errors_name_the_value_and_the_fix() -> None:
    ids = torch.ones(1, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"document 0 has 20 tokens, longer than the row \(16"):
        plan_batch({"input_ids": ids, "qkv_format": "thd", "seq_lens": [[20]]}, PlanOptions(cp=2))
    with pytest.raises(
        ValueError, match=r"padded length 6 \(seq_lens_padded\), not a multiple of 2\*cp=8"
    ):
        plan_batch(
            {
                "input_ids": ids,
                "qkv_format": "thd",
                "seq_lens": [[5, 8]],
                "seq_lens_padded": [[6, 8]],
            },
            PlanOptions(cp=4),
        )
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[0, 2] = 0
    with pytest.raises(ValueError, match="attention_mask is 0 at packed token 2"):
        plan_batch(
            {"input_ids": ids, "attention_mask": mask, "qkv_format": "thd", "seq_lens": [[16]]},
            PlanOptions(cp=2),
        )
