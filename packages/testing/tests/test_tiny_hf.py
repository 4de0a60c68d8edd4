import pytest
import torch

from train_testing.tiny_hf import (
    FAMILIES,
    TEXT_SIZES,
    parameters_to,
    save_tiny,
    tiny_config,
    tiny_model,
)

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_builds_at_the_tiny_sizes_and_runs(family: str) -> None:
    # float32: the MoE families' grouped matmul has no float64 kernel.
    model = tiny_model(family)
    config = model.config.get_text_config() if family == "qwen2_5_vl" else model.config
    assert config.hidden_size == TEXT_SIZES["hidden_size"]
    assert config.num_hidden_layers == TEXT_SIZES["num_hidden_layers"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = torch.randint(0, TEXT_SIZES["vocab_size"] - 8, (1, 6))
    out = model(input_ids=ids)
    if family == "bert":
        assert out.last_hidden_state.shape == (1, 6, TEXT_SIZES["hidden_size"])
    else:
        assert out.logits.shape == (1, 6, TEXT_SIZES["vocab_size"])


def test_same_seed_same_weights_and_overrides_apply() -> None:
    a = tiny_model("llama", seed=3, vocab_size=97, num_hidden_layers=3)
    b = tiny_model("llama", seed=3, vocab_size=97, num_hidden_layers=3)
    c = tiny_model("llama", seed=4, vocab_size=97, num_hidden_layers=3)
    assert a.config.vocab_size == 97 and a.config.num_hidden_layers == 3
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert any(
        not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True)
    )
    redrawn = tiny_model("llama", init_std=0.3, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in redrawn.parameters())
    assert 0.2 < float(redrawn.lm_head.weight.detach().std()) < 0.4


def test_qwen2_5_vl_splits_fields_between_outer_text_and_vision() -> None:
    config = tiny_config("qwen2_5_vl", vision={"patch_size": 2}, image_token_id=120, hidden_size=64)
    assert config.image_token_id == 120
    assert config.vision_config.patch_size == 2
    assert config.vision_config.out_hidden_size == 64 == config.text_config.hidden_size
    # head_dim 16: M-RoPE splits its rotary half (8) over time, height and width.
    assert config.text_config.rope_parameters["mrope_section"] == [2, 2, 4]


def test_unknown_family_and_misplaced_vision_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown tiny model family 'gpt9'"):
        tiny_config("gpt9")
    with pytest.raises(ValueError, match="vision= is for 'qwen2_5_vl' only"):
        tiny_config("llama", vision={"depth": 2})


def test_save_tiny_round_trips_through_from_pretrained(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_model("qwen3").eval()
    folder = save_tiny(model, tmp_path / "qwen3")
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_parameters_to_keeps_the_rotary_tables_as_from_pretrained_does(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    # What from_pretrained(dtype=bf16) gives: bf16 parameters, fp32 rotary frequencies.
    folder = save_tiny(tiny_model("llama"), tmp_path / "llama")
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    want = loaded.model.rotary_emb.inv_freq
    assert want.dtype == torch.float32

    built = tiny_model("llama", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in built.parameters())
    assert torch.equal(built.model.rotary_emb.inv_freq, want)
    # The negative control: a plain .to() rounds the table, which is what this guards.
    rounded = tiny_model("llama").to(torch.bfloat16).model.rotary_emb.inv_freq
    assert rounded.dtype == torch.bfloat16 and not torch.equal(rounded.float(), want)

    model = tiny_model("llama")
    assert parameters_to(model, torch.float16) is model
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
