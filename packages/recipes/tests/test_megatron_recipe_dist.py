"""``model.backend: megatron`` through the whole SFT recipe on 2 gloo ranks: the same tiny Llama
weights (the recipe's seeded random init) trained as a megatron-core GPTModel follow the HF
backend's losses at tp=2 (an odd vocabulary: padded and masked; accumulation 2 against the HF
run's dp=2, the same global batches), and the HF export of the trained GPTModel loads with
from_pretrained and gives its logits. (tp=1 with dp=2 is checked against float64 HF autograd in
test_megatron_backend_dist.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _megatron_workers import run_megatron_sft_on_rank
from _recipes_workers import run_sft_on_rank
from _runs import TinyRun
from train_recipes.data.demo import DemoSplit

pytest.importorskip("megatron.core", reason="megatron-core is the megatron extra's dependency")

PROBE = [[3, 23, 24, 17, 25, 35, 5, 4], [3, 30, 31, 17, 22, 22, 35, 5]]
STEPS = 5


def _two_shard_run(split: DemoSplit, out: Path) -> TinyRun:
    return TinyRun(
        data=split, out=out, steps=STEPS, micro_batch_size=8, logical_shards=2, shuffle=False
    )


def _losses(run: dict) -> torch.Tensor:
    assert sorted(run["losses"]) == list(range(1, STEPS + 1)), run["losses"]
    return torch.tensor([run["losses"][s] for s in range(1, STEPS + 1)], dtype=torch.float64)


# slow: the same equality (loss, gradients, clipped update, export round trip) is proven at the
# Engine level by test_megatron_backend_dist.py; this adds the recipe's wiring around it.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_backend_follows_the_hf_backend_and_exports(
    rank_pool: object, demo_data: DemoSplit, tmp_path: Path
) -> None:
    hf_run = rank_pool.run(  # type: ignore[attr-defined]
        2,
        run_sft_on_rank,
        _two_shard_run(demo_data, tmp_path / "hf").overrides(),
        PROBE,
        timeout_s=240,
    )[0]
    tp2 = rank_pool.run(  # type: ignore[attr-defined]
        2,
        run_megatron_sft_on_rank,
        _two_shard_run(demo_data, tmp_path / "mg2")
        .but(tp=2, accumulation=2, export=True)
        .overrides(),
        PROBE,
        timeout_s=240,
    )[0]
    reference = _losses(hf_run)
    assert reference[-1] < reference[0], f"loss did not go down: {reference.tolist()}"
    for name, run in (("tp=2", tp2),):
        got = _losses(run)
        torch.testing.assert_close(
            got,
            reference,
            rtol=2e-4,
            atol=2e-5,
            msg=lambda m, name=name, got=got: f"megatron {name} vs hf\n{got}\n{reference}\n{m}",
        )
        # The export: from_pretrained gives the trained GPTModel's logits, and the HF run's
        # trained model's (same weights, same updates) up to float32 rounding.
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(run["export_dir"]).eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(PROBE)).logits
        torch.testing.assert_close(logits, run["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, hf_run["logits"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("parallel.cp=2", "parallel.cp"),
        ("parallel.data_parallel=fsdp2", "parallel.data_parallel"),
        ("lora.enabled=true", "lora.enabled"),
        ("model.compile=true", "model.compile"),
    ],
)
def test_megatron_backend_refuses_what_it_does_not_do(override: str, key: str) -> None:
    from train_recipes.config import ConfigError, SFTConfig, load_config, validate_sft

    config = load_config(SFTConfig, None, ["model.backend=megatron", override])
    with pytest.raises(ConfigError, match=r"model\.backend=megatron") as err:
        validate_sft(config, world_size=2)
    assert err.value.key == key


def test_megatron_backend_without_megatron_core_names_the_extra(monkeypatch) -> None:
    import importlib.util

    from train_recipes.config import ConfigError, SFTConfig, load_config, validate_sft

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("megatron") else real(name, *a),
    )
    config = load_config(SFTConfig, None, ["model.backend=megatron"])
    with pytest.raises(ConfigError, match=r"train-recipes\[megatron\]"):
        validate_sft(config, world_size=2)
