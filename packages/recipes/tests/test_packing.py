"""Packed rows: the recipe's token-sum loss equals the sum over the samples computed alone."""

from __future__ import annotations

import itertools

import pytest
import torch

from train_recipes import _integrations as data_api
from train_recipes.config import SFTConfig, load_config
from train_recipes.demo import DemoSplit, build_char_tokenizer
from train_recipes.modeling import build_model
from train_recipes.sft import token_sum_loss


@pytest.mark.timeout(120)
def test_packed_loss_equals_per_sample_reference(demo_data: DemoSplit) -> None:
    tokenizer = build_char_tokenizer()
    config = load_config(SFTConfig, None, ["data.max_length=64"])
    torch.manual_seed(0)
    model = build_model(config, tokenizer).double().eval()
    encoder = data_api.build_encoder(
        tokenizer,
        model_family="text",
        max_length=64,
        train_on="all_assistant",
        pad_to_multiple_of=1,
        packing=True,
    )
    loader = data_api.build_loader(
        demo_data.energon_dir,
        encoder=encoder,
        batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        num_workers=0,
        seed=0,
        shuffle=False,
        num_logical_shards=None,
    )
    batch = data_api.batch_tensors(next(iter(loader)), torch.device("cpu"))
    pos = batch["position_ids"]
    starts = [(r, c) for r in range(pos.shape[0]) for c in range(pos.shape[1]) if pos[r, c] == 0]
    assert len(starts) > 2 * pos.shape[0], "rows are not packed"
    with torch.no_grad():
        packed = token_sum_loss(model, batch)
        # Reference: cut every row at its position restarts and run each real sample alone
        # (float64, plain log_softmax), summing -log p over its trained labels.
        ref = torch.zeros((), dtype=torch.float64)
        for r in range(pos.shape[0]):
            cuts = [c for c in range(pos.shape[1]) if pos[r, c] == 0] + [pos.shape[1]]
            for a, b in itertools.pairwise(cuts):
                ids = batch["input_ids"][r, a:b]
                labels = batch["labels"][r, a:b]
                if not batch["attention_mask"][r, a:b].any() or (labels == -100).all():
                    continue
                logits = model(input_ids=ids[None]).logits[0].double()
                logp = torch.log_softmax(logits, -1)
                keep = labels != -100
                ref -= logp[keep].gather(-1, labels[keep][:, None]).sum()
    torch.testing.assert_close(packed.double(), ref, rtol=1e-6, atol=1e-6)
