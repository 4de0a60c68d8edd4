"""Tiny models, data and float64 references shared by the engine tests (imported by spawned ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from train_testing.reference import grads_of, token_sum_cross_entropy

# B sequences, S tokens per sequence, H hidden, F feed-forward, V vocabulary
VOCAB, HIDDEN, FFN, SEQ = 11, 8, 16, 6
IGNORE = -100


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.w1 = nn.Linear(HIDDEN, FFN)
        self.w2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.w2(torch.tanh(self.w1(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks, a head: [B, S] ids -> [B, S, V] logits."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(), Block()])
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = self.drop(layer(x))
        return self.head(x)


def make_model(seed: int = 0, dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(dropout).to(dtype)


def global_batch(seed: int, n_seq: int) -> tuple[Tensor, Tensor]:
    """ids [n_seq, S] and labels [n_seq, S] with a random, uneven set of ignored positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n_seq, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (n_seq, SEQ), generator=g)
    # Between 1 and SEQ loss tokens per sequence, so micro-batches carry different counts.
    keep = torch.rand(n_seq, SEQ, generator=g) < torch.rand(n_seq, 1, generator=g).clamp(0.15, 1)
    keep[:, 0] = True
    return ids, torch.where(keep, labels, torch.full_like(labels, IGNORE))


def token_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )


def token_loss_mean(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE
    )


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """Unsharded float64 copy of a (plain, DDP or FSDP2/DTensor) model's parameters."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.removeprefix("module.")] = t.detach().to("cpu", torch.float64).clone()
    return out


def reference_sgd_run(
    *,
    steps: int,
    n_seq: int,
    lr: float,
    momentum: float,
    max_grad_norm: float | None,
    data_seed: int,
) -> dict[str, Tensor]:
    """Single-process float64 loop: each step one forward on the whole global batch,
    loss = (sum of token losses) / (number of loss tokens), hand-written clip and SGD."""
    model = make_model(dtype=torch.float64)
    buffers: dict[str, Tensor] = {}
    for step in range(steps):
        ids, labels = global_batch(data_seed + step, n_seq)
        model.zero_grad()
        n = (labels != IGNORE).sum()
        (token_sum_cross_entropy(model(ids), labels, ignore_index=IGNORE) / n).backward()
        grads = grads_of(model, missing="raise")
        norm = torch.sqrt(sum((g * g).sum() for g in grads.values()))
        coef = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (float(norm) + 1e-6))
        with torch.no_grad():
            for k, p in model.named_parameters():
                g = grads[k] * coef
                buf = buffers.get(k)
                buf = g.clone() if buf is None else buf * momentum + g
                buffers[k] = buf
                p -= lr * buf
    return {k: p.detach().clone() for k, p in model.named_parameters()}
