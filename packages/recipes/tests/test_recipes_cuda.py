"""CUDA/NCCL paths of the SFT recipe (skipped without GPUs; the lead runs them on a GPU host)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from _recipes_workers import metric_rows
from conftest import CLI, data_overrides, sft_args
from train_recipes.data.demo import DemoSplit
from train_testing import requires_cuda


def _run(split: DemoSplit, out: Path, nproc: int, sets: list[str]) -> dict[int, float]:
    run = [
        *data_overrides(split),
        "train.steps=40",
        "train.log_every=1",
        "train.checkpoint_every=20",
        "train.eval_samples=32",
        "train.device=cuda",
        "data.micro_batch_size=16",
        "data.num_logical_shards=2",
        "data.shuffle=false",
        *sets,
    ]
    done = subprocess.run(
        [*CLI, *sft_args(out, run, nproc=nproc)],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = metric_rows(out)
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@requires_cuda(1)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("speed", [False, True], ids=["plain", "compiled-cudnn"])
def test_one_gpu_fsdp2_bf16_trains_and_exports(
    demo_data: DemoSplit, tmp_path: Path, speed: bool
) -> None:
    knobs = ["model.compile=true", "model.sdpa_backends=[cudnn,flash]"] if speed else []
    losses = _run(
        demo_data,
        tmp_path / "fsdp2",
        1,
        [
            "parallel.data_parallel=fsdp2",
            "parallel.fsdp.param_dtype=bfloat16",
            "parallel.fsdp.reduce_dtype=float32",
            "data.num_logical_shards=null",
            *knobs,
        ],
    )
    assert losses[40] < 0.8 * losses[1], losses
    assert (tmp_path / "fsdp2" / "hf_model" / "model.safetensors").is_file()


@requires_cuda(1)
@pytest.mark.timeout(900)
def test_one_gpu_bf16_without_wrapper_trains_and_exports(
    demo_data: DemoSplit, tmp_path: Path
) -> None:
    """llama-1b5-1gpu's setup: bf16 parameters, no wrapper, fp32 master weights in
    MasterWeightAdamW's Triton kernel (optim.master_weights resolves on for bf16)."""
    losses = _run(
        demo_data,
        tmp_path / "none",
        1,
        ["parallel.data_parallel=none", "model.dtype=bfloat16", "data.num_logical_shards=null"],
    )
    assert losses[40] < 0.8 * losses[1], losses
    assert (tmp_path / "none" / "hf_model" / "model.safetensors").is_file()


@requires_cuda(2)
@pytest.mark.timeout(900)
def test_two_gpus_cp2_matches_dp2_on_nccl(demo_data: DemoSplit, tmp_path: Path) -> None:
    dp = _run(demo_data, tmp_path / "dp2", 2, ["parallel.cp=1"])
    cp = _run(
        demo_data, tmp_path / "cp2", 2, ["parallel.cp=2", "train.gradient_accumulation_steps=2"]
    )
    for step in range(1, 41):
        assert abs(dp[step] - cp[step]) <= 1e-3 * abs(dp[step]) + 1e-4, (step, dp[step], cp[step])


@requires_cuda(1)
@pytest.mark.timeout(300)
def test_sharded_load_onto_cuda_is_bitwise_from_pretrained(tmp_path: Path) -> None:
    """The pinned, cast-on-device staging path gives exactly from_pretrained's fp32 weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from train_recipes.model.loading import build_on_meta, load_sharded_safetensors
    from train_testing.tiny_hf import tiny_config

    # train_testing's 2 layers and 4/2 heads, wider: the bf16 files span several 50 KB shards.
    config = tiny_config(
        "llama", hidden_size=96, intermediate_size=160, vocab_size=301, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    # bf16 files, several shards: the load casts on the device and crosses files.
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="50KB")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda()
    model = build_on_meta(
        tmp_path, dtype=torch.float32, attn_implementation="sdpa", image_text=False
    )
    load_sharded_safetensors(model, tmp_path, device=torch.device("cuda"))
    loaded = model.state_dict()
    for name, value in reference.state_dict().items():
        assert loaded[name].device.type == "cuda", name
        assert torch.equal(loaded[name], value), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def _vision_run(model: object, pixels: object, grid: object) -> tuple[object, object, dict]:
    """Merged output, d(fixed projection)/d pixels and two weight grads, as float64 on the CPU."""
    import torch

    visual = model.model.visual  # type: ignore[attr-defined]
    x = pixels.clone().requires_grad_(True)  # type: ignore[attr-defined]
    merged = visual(x, grid_thw=grid).pooler_output
    probe = torch.randn(merged.shape, generator=torch.Generator().manual_seed(4))
    (merged * probe.to(merged)).sum().backward()
    params = dict(visual.named_parameters())
    names = ("blocks.0.attn.qkv.weight", "blocks.1.attn.proj.weight")
    return (
        merged.detach().double().cpu(),
        x.grad.double().cpu(),
        {n: params[n].grad.double().cpu() for n in names},
    )


@requires_cuda(1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_vision_varlen_bf16_on_cuda_matches_float64_per_window(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vision tower through torch's FlashAttention varlen kernel (head dim 80, as in
    Qwen2.5-VL-3B), bf16, its patch embedding as a matmul, eager or compiled (inductor): output
    and gradients within bf16 error of transformers' eager per-window path in float64."""
    import torch

    from cp_sharder.attention import varlen
    from train_recipes.model.build import compile_decoder_layers
    from train_recipes.model.patch_embed import use_linear_patch_embed
    from train_recipes.model.vision_attention import use_varlen_vision_attention
    from train_testing.tiny_hf import tiny_model

    vision = {
        "depth": 2,
        "hidden_size": 160,
        "intermediate_size": 256,
        "num_heads": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    }
    reference = tiny_model("qwen2_5_vl", vision=vision, dtype=torch.float64, init_std=0.05)
    reference.model.visual.config._attn_implementation = "eager"  # type: ignore[union-attr]
    model = tiny_model("qwen2_5_vl", vision=vision, dtype=torch.float64, init_std=0.05)
    model.load_state_dict(reference.state_dict())
    model = model.to("cuda", torch.bfloat16)
    assert use_varlen_vision_attention(model) and use_linear_patch_embed(model) == 1
    if compiled:
        compile_decoder_layers(model)
    else:
        # Eager: the per-window fallback must not run (the kernel takes bf16 head dim 80).
        def per_segment(*args: object, **kwargs: object) -> None:
            raise AssertionError("varlen_attention fell back to per-segment SDPA on CUDA")

        monkeypatch.setattr(varlen, "_per_segment", per_segment)
    grid = torch.tensor([[1, 8, 10], [1, 4, 4]])  # 6 + 1 windows in block 0, 2 images in block 1
    pixels = torch.randn(96, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(3))
    try:
        got = _vision_run(model, pixels.to("cuda", torch.bfloat16), grid.cuda())
    finally:
        torch._dynamo.reset()
    want = _vision_run(reference, pixels.double(), grid)
    pairs = [(got[0], want[0], "output"), (got[1], want[1], "pixels grad")]
    pairs += [(got[2][n], want[2][n], n) for n in want[2]]
    for g, w, name in pairs:
        err, scale = float((g - w).abs().max()), float(w.abs().max())  # type: ignore[attr-defined]
        assert scale > 0 and err <= 3e-2 * scale, f"{name}: max error {err}, scale {scale}"


@requires_cuda(1)
@pytest.mark.timeout(300)
def test_fused_loss_over_trained_rows_does_not_synchronise_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``model.fused_loss_trained_only`` on CUDA: the loss call (the forward through the recipe's
    CausalFastPath, the count read from pinned memory behind its event, the fused loss selecting
    K rows with nonzero_static and gathering each chunk's) runs under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call; the
    loss is given K, and the loss and gradients match the all-positions loss on CUDA and a
    float64 cross-entropy on the CPU."""
    import torch

    import vocab_parallel as vp
    from train_recipes.loss.fused_loss import token_sum_loss_of
    from train_recipes.model.attention import CausalFastPath
    from train_testing.tiny_hf import tiny_model

    reference = tiny_model("llama", dtype=torch.float64)
    model = tiny_model("llama", dtype=torch.float64).to("cuda", torch.float32)
    fast = CausalFastPath(model)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 50, (2, 16), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    labels[0, :5] = -100  # a prompt
    labels[1, 11:] = -100  # padding
    positions = torch.arange(16).expand(2, 16)
    given: list[object] = []
    original = vp.linear_cross_entropy

    def spy(hidden: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        given.append(kwargs["trained_count"])
        return original(hidden, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(vp, "linear_cross_entropy", spy)

    def loss_and_grads(trained_only: bool, *, no_sync: bool) -> tuple[float, dict]:
        model.zero_grad(set_to_none=True)
        # On the device first: a blocking host-to-device copy counts as a sync.
        inputs = {"input_ids": ids.cuda(), "position_ids": positions.cuda()}
        device_labels = labels.cuda()
        torch.cuda.synchronize()
        if no_sync:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with fast.selected(packed=False):
                loss = token_sum_loss_of(model, inputs, device_labels, trained_only=trained_only)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        loss.backward()
        return float(loss), {n: p.grad.cpu().double() for n, p in model.named_parameters()}

    # Warm-up: the first call compiles and autotunes the loss's kernels (which synchronises).
    loss_and_grads(True, no_sync=False)
    torch.cuda.synchronize()
    got = loss_and_grads(True, no_sync=True)
    full = loss_and_grads(False, no_sync=False)
    k = int((labels != -100).sum())
    assert given == [k, k, None], given
    logits = reference(input_ids=ids, position_ids=positions, use_cache=False).logits
    ref_loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    ref_loss.backward()
    for name, (loss, grads) in (("trained rows", got), ("all positions", full)):
        assert loss == pytest.approx(float(ref_loss), rel=1e-3), name
        for n, p in reference.named_parameters():
            err, scale = float((grads[n] - p.grad).abs().max()), float(p.grad.abs().max())
            assert err <= 1e-2 * scale + 1e-6, f"{name} {n}: max error {err}, scale {scale}"
