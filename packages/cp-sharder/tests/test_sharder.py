"""Single-process tests of ContextParallelSharder: cp=1 identity, backend selection, errors."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cp_sharder import ContextParallelSharder, ShardLayout
from cp_sharder.attention import Backend, portable, torch_ring
from cp_sharder.layouts import LayoutKind
from train_testing.tiny_hf import tiny_model


class _IdsOnly(torch.nn.Module):
    """A model whose forward names only input_ids and position_ids."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 4)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.emb(input_ids)


class _Hooked(_IdsOnly):
    """A model that owns its CP preparation through the hook."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []
        self.entered = 0

    @contextlib.contextmanager
    def _ctx(self) -> Iterator[None]:
        self.entered += 1
        yield

    def prepare_model_inputs_for_cp(self, batch: dict[str, Any], **kw: Any) -> dict[str, Any]:
        self.calls.append(kw)
        pos = torch.arange(batch["input_ids"].shape[1])[None] * 2  # model-specific positions
        return {"position_ids": pos, "cp_layout": "contiguous", "cp_context": self._ctx}


class TEAttention(torch.nn.Module):
    """Stands in for transformer_engine's DotProductAttention (detected by module path)."""

    def set_context_parallel_group(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("not reached at cp=1")


TEAttention.__module__ = "transformer_engine.pytorch.attention"


class _TEModel(_IdsOnly):
    def __init__(self) -> None:
        super().__init__()
        self.attn = TEAttention()


def _batch(bsz: int = 2, seq: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 32, (bsz, seq), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels, "loss_mask": (labels != -100).float()}


def test_cp1_is_identity_and_verbs_round_trip() -> None:
    model = _IdsOnly()
    batch = _batch()
    sharder = ContextParallelSharder(model, None, batch)
    ctx, local = sharder.shard(batch)
    assert sharder.cp_size == 1
    assert sharder.backend_family is Backend.PORTABLE
    layout = sharder.layout
    assert isinstance(layout, ShardLayout)
    assert layout.sequence.kind is LayoutKind.IDENTITY
    assert layout.backend is Backend.NONE
    assert (layout.sequence.original_seq_len, layout.sequence.padded_seq_len) == (7, 7)
    assert torch.equal(local["input_ids"], batch["input_ids"])
    assert torch.equal(local["position_ids"], torch.arange(7)[None])
    # Keys the forward does not name stay with the sharder; labels always come back.
    assert set(local) == {"input_ids", "position_ids", "labels"}
    assert torch.equal(sharder.local_buffers["loss_mask"], batch["loss_mask"])
    with ctx():
        model(**{k: v for k, v in local.items() if k != "labels"})
    x = torch.randn(2, 7, 3, requires_grad=True)
    y = sharder.gather_token_tensor(sharder.shard_token_tensor(x), trim=True)
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert int(sharder.num_label_tokens()) == 12


def test_verbs_before_shard_and_length_mismatch_raise() -> None:
    sharder = ContextParallelSharder(_IdsOnly())
    with pytest.raises(RuntimeError, match=r"call shard\(batch\) first"):
        sharder.shard_token_tensor(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match=r"call shard\(batch\) first"):
        sharder.gather_token_tensor(torch.zeros(2, 7))
    sharder.shard(_batch())
    with pytest.raises(ValueError, match="expected the original length 7 or the padded length 7"):
        sharder.shard_token_tensor(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="expected the local length 7"):
        sharder.gather_token_tensor(torch.zeros(2, 6))


def test_batch_contract_errors() -> None:
    sharder = ContextParallelSharder(_IdsOnly())
    ids = torch.ones(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds, got both"):
        sharder.shard({"input_ids": ids, "inputs_embeds": torch.zeros(2, 6, 4)})
    with pytest.raises(ValueError, match="got neither"):
        sharder.shard({"labels": ids})
    with pytest.raises(ValueError, match=r"batch\['labels'\] has length 5"):
        sharder.shard({"input_ids": ids, "labels": ids[:, :5]})
    with pytest.raises(KeyError, match="needs 'seq_lens'"):
        sharder.shard({"input_ids": ids, "qkv_format": "thd"})
    with pytest.raises(ValueError, match="qkv_format must be"):
        sharder.shard({"input_ids": ids, "qkv_format": "sbhd_2"})
    with pytest.raises(
        ValueError, match="row 0: packed sequences take 8 tokens but the row holds 6"
    ):
        sharder.shard({"input_ids": ids, "qkv_format": "thd", "seq_lens": [[4, 4], [6, -1]]})
    with pytest.raises(ValueError, match="must be a \\[B, S\\] padding mask"):
        sharder.shard({"input_ids": ids, "attention_mask": torch.ones(2, 1, 6, 6)})
    with pytest.raises(KeyError, match="extra_seq_buffers names 'teacher'"):
        ContextParallelSharder(_IdsOnly(), extra_seq_buffers={"teacher": 1}).shard(
            {"input_ids": ids}
        )
    # The constructor's batch is validated eagerly.
    with pytest.raises(ValueError, match="got both"):
        ContextParallelSharder(
            _IdsOnly(), None, {"input_ids": ids, "inputs_embeds": torch.zeros(2, 6, 4)}
        )


def test_model_hook_wins_and_owns_layout_and_context() -> None:
    model = _Hooked()
    sharder = ContextParallelSharder(model)
    assert sharder.backend_family is Backend.MODEL_HOOK
    ctx, local = sharder.shard({"input_ids": torch.ones(1, 5, dtype=torch.long)})
    assert model.calls == [{"cp_size": 1, "cp_rank": 0, "cp_group": None}]
    assert torch.equal(local["position_ids"], torch.arange(5)[None] * 2)
    assert sharder.layout.backend is Backend.MODEL_HOOK
    with ctx():
        pass
    assert model.entered == 1


def test_te_modules_select_te_and_te_errors() -> None:
    model = _TEModel()
    sharder = ContextParallelSharder(model)
    assert sharder.backend_family is Backend.TE
    ids = torch.ones(1, 8, dtype=torch.long)
    # Packed sequences of odd padded length cannot be split by TE even at cp=1 (2*cp = 2).
    with pytest.raises(
        ValueError, match=r"Transformer Engine THD .* multiple of 2\*cp=2; found a padded length 3"
    ):
        sharder.shard({"input_ids": ids, "qkv_format": "thd", "seq_lens": [[3, 5]]})
    # TE's BSHD CP kernels take no padding mask.
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="cannot honour a padding attention_mask"):
        sharder.shard({"input_ids": ids, "attention_mask": mask})


def test_backend_family_for_plain_and_hf_models() -> None:
    llama = tiny_model("llama", attn_implementation=None)
    assert ContextParallelSharder(llama).backend_family is Backend.PORTABLE
    assert ContextParallelSharder(torch.nn.Linear(2, 2)).backend_family is Backend.PORTABLE


def test_mesh_without_cp_dimension_is_rejected() -> None:
    class FakeMesh:
        ndim = 2
        mesh_dim_names = ("dp", "tp")

        def __getitem__(self, name: str) -> Any:
            return self

    with pytest.raises(ValueError, match="none of them 'cp'"):
        ContextParallelSharder(_IdsOnly(), FakeMesh())


def test_mask_a_backend_cannot_honour_raises() -> None:
    module = torch.nn.Module()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cannot honour sliding_window=4"):
        torch_ring.hf_ring_attention(
            module, q, q, q, None, sliding_window=4, reenter=contextlib.nullcontext
        )
    module.is_causal = False
    with pytest.raises(ValueError, match="plain causal attention only"):
        torch_ring.hf_ring_attention(module, q, q, q, None, reenter=contextlib.nullcontext)
    spec = portable.MaskSpec(q_index=torch.arange(4), k_index=torch.arange(4))
    fn = portable.make_hf_attention(spec, ContextParallelSharder(_IdsOnly())._cp)
    with pytest.raises(ValueError, match="softcapping"):
        fn(module, q, q, q, None, softcap=30.0)
    with pytest.raises(ValueError, match="materialised attention mask"):
        fn(module, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="got 3 local queries"):
        fn(module, q[:, :, :3], q[:, :, :3], q[:, :, :3], None)


def test_portable_mask_matches_dense_reference() -> None:
    """Causal + documents + window + key padding, against an explicit double loop."""
    q_index = torch.tensor([0, 1, 6, 7])
    k_index = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5])
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    valid = torch.tensor([[True, True, True, True, True, False, True, True]])
    spec = portable.MaskSpec(q_index=q_index, k_index=k_index, doc_ids=docs, key_valid=valid)
    mask = spec.mask(causal=True, window=3, device=torch.device("cpu"))[0, 0]
    for a, qi in enumerate(q_index.tolist()):
        for b, ki in enumerate(k_index.tolist()):
            want = ki <= qi and qi - ki < 3 and docs[0, qi] == docs[0, ki] and bool(valid[0, ki])
            assert bool(mask[a, b]) == want, (qi, ki)


def test_packed_cp1_matches_per_document_forward() -> None:
    """cp=1 packed batch: the varlen backend's per-document attention against separate documents."""
    model = tiny_model("llama", vocab_size=64, dtype=torch.float64)
    ids = torch.randint(1, 64, (1, 12))
    sharder = ContextParallelSharder(model)
    ctx, local = sharder.shard({"input_ids": ids, "qkv_format": "thd", "seq_lens": [[5, 4]]})
    assert sharder.layout.backend is Backend.VARLEN  # was PORTABLE (dense mask) before issue 15
    assert sharder.layout.sequence.input_row_shape == (1, 12)
    with ctx():
        logits = model(**local).logits
    assert model.config._attn_implementation == "sdpa", "override not restored"
    ref_model = copy.deepcopy(model)
    first = ref_model(input_ids=ids[:, :5]).logits
    second = ref_model(input_ids=ids[:, 5:9]).logits
    torch.testing.assert_close(logits[:, :5], first, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(logits[:, 5:9], second, rtol=1e-9, atol=1e-9)
    # Without document masking the second document would see the first: the check can fail.
    plain = ref_model(input_ids=ids[:, :9]).logits
    assert (plain[:, 5:9] - second).abs().max() > 1e-3
    assert torch.equal(local["position_ids"][0, :9], torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3]))


def test_sdpa_override_is_confined_to_context() -> None:
    spec = portable.MaskSpec(q_index=torch.arange(4), k_index=torch.arange(4))
    cp = ContextParallelSharder(_IdsOnly())._cp
    original = F.scaled_dot_product_attention
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    with portable.sdpa_override(spec, cp):
        assert F.scaled_dot_product_attention is not original
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with pytest.raises(ValueError, match="explicit attn_mask"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    assert F.scaled_dot_product_attention is original
    torch.testing.assert_close(out, original(q, q, q, is_causal=True))


def test_attention_override_leaves_vision_configs_alone_and_restores() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    class Cfg:
        def __init__(self, impl: str, **subs: Any) -> None:
            self._attn_implementation_internal = impl
            self.sub_configs = dict.fromkeys(subs, Cfg)
            for key, value in subs.items():
                setattr(self, key, value)

    text, vision = Cfg("sdpa"), Cfg("eager")
    model = torch.nn.Module()
    model.config = Cfg("sdpa", text_config=text, vision_config=vision)
    fn = portable.make_hf_attention(
        portable.MaskSpec(q_index=torch.arange(2), k_index=torch.arange(2)),
        ContextParallelSharder(_IdsOnly())._cp,
    )
    with portable.hf_attention_override(model, "cp_test_key", fn):
        assert ALL_ATTENTION_FUNCTIONS["cp_test_key"] is fn
        assert model.config._attn_implementation_internal == "cp_test_key"
        assert text._attn_implementation_internal == "cp_test_key"
        assert vision._attn_implementation_internal == "eager"
    assert "cp_test_key" not in ALL_ATTENTION_FUNCTIONS
    assert model.config._attn_implementation_internal == "sdpa"
    assert text._attn_implementation_internal == "sdpa"


def test_shard_result_unpacks_and_verbs_take_an_explicit_layout() -> None:
    """Verbs given a result's layout never read a later shard()'s state."""
    sharder = ContextParallelSharder(_IdsOnly())
    first = sharder.shard(_batch(seq=7))
    train_ctx, local = first  # the seed usage still unpacks
    assert train_ctx is first.train_ctx and local is first.batch
    assert first.layout.sequence.original_seq_len == 7
    second = sharder.shard(_batch(seq=5))
    x = torch.randn(2, 7, 3)
    assert torch.equal(sharder.gather_token_tensor(x, layout=first, trim=True), x)
    assert torch.equal(sharder.shard_token_tensor(x, layout=first.layout), x)
    assert sharder.layout is second.layout  # the implicit form follows the last shard()
    with pytest.raises(ValueError, match="expected the local length 5"):
        sharder.gather_token_tensor(x)
    assert int(sharder.num_label_tokens(layout=first)) == 12
