"""fp32 master weights for bf16 models (``optim.master_weights``) and the one-rank setup
without a wrapper (``parallel.data_parallel: none``): the optimizer choice, its groups and
update against a float64 AdamW, a bf16 run that trains, resumes exactly and exports, and the
configs refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _master_weights_workers import export_on_rank, run_and_describe
from _runs import TinyRun, assert_same_weights
from train_recipes.config import OptimConfig, SFTConfig, load_config, validate_sft
from train_recipes.config.loader import ConfigError
from train_recipes.data.demo import DemoSplit

PROBE = [[3, 23, 24, 17, 25, 35, 5, 4], [3, 30, 31, 17, 22, 22, 35, 5]]
CPU = torch.device("cpu")


class _Block(nn.Module):
    """A matrix, a bias and a norm: both weight-decay groups."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def _block(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return _Block().to(dtype)


def _build(model: nn.Module, **optim: Any) -> torch.optim.Optimizer:
    from train_recipes.run.runtime import build_optimizer

    config = OptimConfig(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, **optim)
    optimizer, _ = build_optimizer(model, config, device=CPU, total_steps=4)
    return optimizer


@pytest.mark.parametrize(
    ("dtype", "setting", "master"),
    [
        (torch.bfloat16, None, True),
        (torch.float16, None, True),
        (torch.float32, None, False),
        (torch.float32, True, True),
        (torch.bfloat16, False, False),
    ],
)
def test_build_optimizer_resolves_master_weights(
    dtype: torch.dtype, setting: bool | None, master: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from train_engine import MasterWeightAdamW

    with caplog.at_level("INFO", logger="train_recipes.run.runtime"):
        optimizer = _build(_block(dtype), master_weights=setting, fused=False)
    expected = MasterWeightAdamW if master else torch.optim.AdamW
    assert type(optimizer) is expected, type(optimizer)
    lines = [r.getMessage() for r in caplog.records if r.name == "train_recipes.run.runtime"]
    assert len(lines) == 1 and lines[0].startswith("optimizer: "), lines
    assert expected.__name__ in lines[0], lines[0]
    reason = "optim.master_weights=" + ("null" if setting is None else str(setting).lower())
    assert reason in lines[0], lines[0]


def test_master_weights_follow_only_the_trainable_parameters() -> None:
    """A frozen bf16 base with fp32 adapters (what LoRA trains): no master weights."""
    model = _block(torch.bfloat16)
    model.proj.requires_grad_(False)
    model.norm.float()
    assert type(_build(model)) is torch.optim.AdamW


def test_master_adamw_gets_adamws_groups_and_hyperparameters() -> None:
    """The same groups (weight decay on matrices only), in the same order, and values."""
    plain = _build(_block(torch.float32), master_weights=False, fused=False)
    master = _build(_block(torch.float32), master_weights=True)
    assert len(plain.param_groups) == len(master.param_groups) == 2
    for a, b in zip(plain.param_groups, master.param_groups, strict=True):
        assert a["param_names"] == b["param_names"], (a["param_names"], b["param_names"])
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert a[key] == b[key], (key, a[key], b[key])
    assert master.param_groups[0]["weight_decay"] == 0.1
    assert master.param_groups[0]["param_names"] == ["proj.weight"]
    assert master.param_groups[1]["weight_decay"] == 0.0


def test_master_weights_take_adamws_float64_update() -> None:
    """Two steps on a bf16 model: the fp32 masters follow AdamW computed in float64 from the
    same gradients (written out here), and each bf16 parameter is its master rounded."""
    model = _block(torch.bfloat16)
    optimizer = _build(model)
    names = {id(p): n for n, p in model.named_parameters()}
    ref = {n: p.detach().double() for n, p in model.named_parameters()}
    moments = {n: (torch.zeros_like(w), torch.zeros_like(w)) for n, w in ref.items()}
    decay = {n: g["weight_decay"] for g in optimizer.param_groups for n in g["param_names"]}
    lr = optimizer.param_groups[0]["lr"]  # the schedule's first (warm-up) rate
    (b1, b2), eps = (0.8, 0.9), 1e-6
    g = torch.Generator().manual_seed(1)
    for step in (1, 2):
        x = torch.randn(5, 6, generator=g).to(torch.bfloat16)
        model(x).float().pow(2).sum().backward()
        for n, p in model.named_parameters():
            assert p.grad is not None
            grad = p.grad.double()
            m, v = moments[n]
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            ref[n] *= 1 - lr * decay[n]
            ref[n] -= lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
        optimizer.step()
        optimizer.zero_grad()
    for p in model.parameters():
        master = optimizer.state[p]["master_param"]
        assert master.dtype == torch.float32
        n = names[id(p)]
        torch.testing.assert_close(master.double(), ref[n], rtol=1e-6, atol=1e-7, msg=n)
        assert torch.equal(p.detach(), master.to(torch.bfloat16)), n
    # The update is visible in fp32 where bf16 alone would round part of it away.
    assert any(
        not torch.equal(optimizer.state[p]["master_param"], p.float()) for p in model.parameters()
    )


# -------------------------------------------------------------------------- end to end


def _one_rank_bf16(split: DemoSplit, out: Path) -> list[str]:
    return TinyRun(
        data=split,
        out=out,
        steps=6,
        checkpoint_every=3,
        export=True,
        warmup_steps=1,
        # Two micro-batches a window: the Engine sums their bf16 gradients in fp32.
        micro_batch_size=4,
        accumulation=2,
        shuffle=False,
        hidden_size=32,
        dtype="bfloat16",
        data_parallel="none",
    ).overrides()


def _assert_equal_weights(a: Path, b: Path) -> None:
    weights = assert_same_weights(a, b)
    for key, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16, (key, tensor.dtype)


@pytest.mark.slow  # three tiny runs (train, resume, export): about 30 s on 2 cores
@pytest.mark.timeout(300)
def test_bf16_run_without_wrapper_trains_resumes_exactly_and_exports(
    rank_pool: Any, demo_data: DemoSplit, tmp_path: Path
) -> None:
    """One rank, bf16 parameters, no wrapper, master weights by default, windows of two
    micro-batches (gradients summed in fp32 by the Engine): the loss goes down,
    the checkpoint holds fp32 master weights, a resume from step 3 continues exactly as the
    uninterrupted run (losses, parameters, export), and both exports (the live model's and
    ``train-recipes export`` of the last checkpoint) reproduce the trained model."""
    full_dir = tmp_path / "full"
    full = rank_pool.run(1, run_and_describe, _one_rank_bf16(demo_data, full_dir), PROBE)[0]
    assert full["wrapper"] == "LlamaForCausalLM", full["wrapper"]  # no DDP / FSDP2
    assert full["dtypes"] == ["bfloat16"], full["dtypes"]
    losses = [full["losses"][s] for s in range(1, 7)]
    assert losses[-1] < losses[0], losses
    masters = {k: v for k, v in full["saved"].items() if k.endswith(".master_param")}
    assert masters and set(masters.values()) == {"float32"}, full["saved"]
    moments = {v for k, v in full["saved"].items() if ".exp_avg" in k}
    assert moments == {"float32"}, full["saved"]

    # The same run killed after its step-3 checkpoint: the later checkpoint, the export and
    # the metric rows after step 3 are gone; --resume continues from step 3.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full_dir, resumed_dir, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(resumed_dir / "checkpoints" / "step_000006")
    shutil.rmtree(resumed_dir / "hf_model")
    rows = (resumed_dir / "metrics.jsonl").read_text().splitlines()
    kept = [r for r in rows if r.strip() and json.loads(r)["step"] <= 3]
    (resumed_dir / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    resumed = rank_pool.run(
        1, run_and_describe, _one_rank_bf16(demo_data, resumed_dir), PROBE, True
    )[0]
    assert [resumed["losses"][s] for s in range(4, 7)] == losses[3:], (resumed["losses"], losses)
    for name, param in full["params"].items():
        assert torch.equal(param, resumed["params"][name]), name
    assert torch.equal(full["logits"], resumed["logits"])
    _assert_equal_weights(Path(full["export_dir"]), Path(resumed["export_dir"]))

    # The live export and the checkpoint's export reproduce the trained model.
    from transformers import AutoModelForCausalLM

    exported = rank_pool.run(1, export_on_rank, full["checkpoint"], str(tmp_path / "export"))[0]
    _assert_equal_weights(Path(full["export_dir"]), Path(exported))
    model = AutoModelForCausalLM.from_pretrained(full["export_dir"]).eval()
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE)).logits
    torch.testing.assert_close(logits, full["logits"], rtol=0, atol=0)


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("overrides", "world_size", "key", "needle"),
    [
        ([], 2, "parallel.data_parallel", "use ddp or fsdp2 for 2 ranks"),
        ([], 4, "parallel.data_parallel", "use ddp or fsdp2 for 4 ranks"),
        (["parallel.ddp.bucket_cap_mb=50"], 1, "parallel.ddp", "DDP knobs are set"),
        (["parallel.fsdp.param_dtype=bfloat16"], 1, "parallel.fsdp", "FSDP2 knobs are set"),
        (["parallel.fsdp.reshard_after_forward=false"], 1, "parallel.fsdp", "remove"),
        (["parallel.tp=2"], 1, "parallel.tp", "tp must be 1"),
        (["parallel.ep=2"], 1, "parallel.ep", "ep must be 1"),
    ],
)
def test_no_wrapper_is_refused_where_it_cannot_work(
    overrides: list[str], world_size: int, key: str, needle: str
) -> None:
    config = load_config(SFTConfig, None, ["parallel.data_parallel=none", *overrides])
    with pytest.raises(ConfigError) as info:
        validate_sft(config, world_size=world_size)
    assert info.value.key == key, str(info.value)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_no_wrapper_on_one_rank_is_valid_and_shown_in_the_plan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from train_recipes.cli.main import main

    config = load_config(SFTConfig, None, ["parallel.data_parallel=none", "model.dtype=bfloat16"])
    validate_sft(config, world_size=1)
    with pytest.raises(ValueError, match="wraps nothing"):
        config.parallel.data_parallel_config()
    sets = ["--set", "parallel.data_parallel=none", "--set", "train.device=cpu"]
    assert main(["config", "show", "--nproc-per-node", "1", *sets]) == 0
    assert "none (the model as is: one rank" in capsys.readouterr().out
    # On two ranks: one error line naming the key and the fix, before any rank starts.
    assert main(["config", "show", "--nproc-per-node", "2", *sets]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "use ddp or fsdp2 for 2 ranks" in err[0], err


def test_pure_bf16_adamw_is_warned_about() -> None:
    from train_recipes.cli.preflight import config_warnings, plan_devices

    def warnings(*overrides: str) -> list[str]:
        config = load_config(SFTConfig, None, ["train.device=cpu", *overrides])
        plan = plan_devices(config, world_size=1, local_world_size=1)
        return [w for w in config_warnings(config, plan) if "master_weights" in w]

    assert warnings("model.dtype=bfloat16", "optim.master_weights=false")
    assert not warnings("model.dtype=bfloat16")
    assert not warnings("optim.master_weights=false")


def test_resume_applies_only_null_to_false_master_weights() -> None:
    """A checkpoint from before optim.master_weights (null, torch AdamW state) resumes with
    false; every other change of the key would load another optimizer's state: refused."""
    from train_recipes.config.loader import to_dict
    from train_recipes.run.resume_changes import config_changes

    def change(saved: str, new: str) -> dict[str, Any]:
        old = to_dict(load_config(SFTConfig, None, [f"optim.master_weights={saved}"]))
        config = load_config(SFTConfig, None, [f"optim.master_weights={new}"])
        return config_changes(old, config, saved_shards=None, new_shards=1)

    assert change("null", "false") == {"optim.master_weights": (None, False)}
    for saved, new in (("null", "true"), ("true", "false"), ("false", "null"), ("true", "null")):
        with pytest.raises(ConfigError, match=r"optim\.master_weights"):
            change(saved, new)
