"""Exact loss masks with a real tokenizer and chat template, text and Qwen2.5-VL style."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest
import torch

from _esft_data import (
    MAX_PIXELS,
    MIN_PIXELS,
    build_processor,
    build_tokenizer,
    chat_sample,
    png_bytes,
)
from energon_sft import IGNORE_INDEX, SFTTaskEncoder


@pytest.fixture(scope="module")
def proc(tok: Any) -> Any:
    return build_processor(tok)


def _reference(
    tok: Any, messages: list[dict[str, Any]], tools: Any, *, final_only: bool
) -> tuple[list[int], list[bool], str]:
    """Hand-written ChatML pieces tokenized one by one: (ids, trained, trained text)."""
    pieces: list[tuple[str, bool]] = []
    if tools:
        pieces.append(("<|im_start|>tools\n" + json.dumps(tools) + "<|im_end|>\n", False))
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for i, m in enumerate(messages):
        train = m["role"] == "assistant" and (not final_only or i == last)
        pieces.append((f"<|im_start|>{m['role']}\n", False))
        body = m.get("content") or ""
        for call in m.get("tool_calls") or []:
            body += "<tool_call>" + json.dumps(call["function"]) + "</tool_call>"
        pieces.append((body + "<|im_end|>\n", train))
    ids: list[int] = []
    trained: list[bool] = []
    text = ""
    for piece, train in pieces:
        if not piece:
            continue
        p_ids = tok(piece, add_special_tokens=False)["input_ids"]
        ids += p_ids
        trained += [train] * len(p_ids)
        text += piece if train else ""
    return ids, trained, text


def _shift(ids: list[int], trained: list[bool]) -> list[int]:
    return [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [
        IGNORE_INDEX
    ]


CONVERSATIONS = {
    "single_turn": [
        {"role": "user", "content": "Hello! How are you?"},
        {"role": "assistant", "content": "I am fine, thank you."},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "The weather in Paris is sunny."},
        {"role": "user", "content": "What is in the picture?"},
        {"role": "assistant", "content": "A red square and a blue circle."},
    ],
    "tool_calls": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "sunny, twenty degrees", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is sunny, twenty degrees."},
    ],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("final_only", [False, True])
def test_text_masks_train_exactly_the_assistant_tokens(
    tok: Any, name: str, final_only: bool
) -> None:
    messages = CONVERSATIONS[name]
    tools = TOOLS if name == "tool_calls" else None
    enc = SFTTaskEncoder(
        tok,
        model_family="text",
        max_length=512,
        train_on="final_assistant" if final_only else "all_assistant",
    )
    out = enc.encode_chat(chat_sample(messages, tools=tools))
    ref_ids, ref_trained, ref_text = _reference(tok, messages, tools, final_only=final_only)
    assert out.input_ids.tolist() == ref_ids
    assert out.labels.tolist() == _shift(ref_ids, ref_trained)
    # Read back the targets: exactly the assistant bodies and their end-of-turn tokens.
    targets = [t for t in out.labels.tolist() if t != IGNORE_INDEX]
    assert tok.decode(targets) == ref_text
    assert "<|im_start|>" not in tok.decode(targets)
    assert out.sample_weights == [1.0]
    assert out.source_ids == ["src-0"]
    assert out.position_ids.tolist() == list(range(len(ref_ids)))


def _smart_resize(h: int, w: int) -> tuple[int, int]:
    """Independent Qwen2-VL resize: sides to multiples of 28 within [MIN, MAX] pixels."""
    f = 28
    hb, wb = round(h / f) * f, round(w / f) * f
    if hb * wb > MAX_PIXELS:
        beta = math.sqrt(h * w / MAX_PIXELS)
        hb, wb = math.floor(h / beta / f) * f, math.floor(w / beta / f) * f
    elif hb * wb < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (h * w))
        hb, wb = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
    return hb, wb


def test_vlm_image_tokens_grids_and_masks(tok: Any, proc: Any) -> None:
    sizes = [(100, 60), (56, 56), (300, 200), (30, 20)]  # (width, height)
    images = [png_bytes(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [
                {"type": "image", "media_index": 1},
                {"type": "text", "text": "What is in the picture?"},
                {"type": "image", "media_index": 0},
            ],
        },
        {"role": "assistant", "content": "A red square."},
        {
            "role": "user",
            "content": [{"type": "image", "media_index": 2}, {"type": "image", "media_index": 3}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "A blue circle."},
                {"type": "image", "media_index": 0},
            ],
        },
    ]
    enc = SFTTaskEncoder(proc, model_family="qwen2_5_vl", max_length=4096)
    out = enc.encode_chat(chat_sample(messages, images))
    order = [1, 0, 2, 3, 0]
    expect_grids = []
    for i in order:
        w, h = sizes[i]
        hb, wb = _smart_resize(h, w)
        expect_grids.append([1, hb // 14, wb // 14])
    assert out.image_grid_thw.tolist() == expect_grids
    expect_tokens = [g[1] * g[2] // 4 for g in expect_grids]
    assert out.pixel_values is not None
    assert out.pixel_values.shape == (sum(g[1] * g[2] for g in expect_grids), 3 * 2 * 14 * 14)
    # Pixels of each image, in render order, equal the processor run on that image alone.
    from PIL import Image

    offset = 0
    for i, g in zip(order, expect_grids, strict=True):
        pil = Image.open(io.BytesIO(images[i])).convert("RGB")
        alone = proc.image_processor(images=[pil], return_tensors="pt")["pixel_values"]
        n = g[1] * g[2]
        torch.testing.assert_close(out.pixel_values[offset : offset + n], alone, rtol=0, atol=0)
        offset += n
    ids = out.input_ids.tolist()
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    vs, ve = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    blocks, run = [], 0
    for a, b in zip(ids, [*ids[1:], -1], strict=True):
        if a == pad:
            run += 1
            if b != pad:
                blocks.append(run)
                run = 0
    assert blocks == expect_tokens
    assert out.image_mask.tolist() == [t == pad for t in ids]
    assert ids.count(vs) == ids.count(ve) == len(order)
    targets = [t for t in out.labels.tolist() if t != IGNORE_INDEX]
    assert pad not in targets and vs not in targets and ve not in targets
    # Assistant text stays trained around the (untrained) image block in the last turn.
    assert tok.decode(targets) == "A red square.<|im_end|>\nA blue circle.<|im_end|>\n"


def test_overlong_rows_are_truncated_zero_weight_without_media(tok: Any, proc: Any) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "media_index": 0}, {"type": "text", "text": "Hello!"}],
        },
        {"role": "assistant", "content": "I am fine, thank you. " * 10},
    ]
    enc = SFTTaskEncoder(proc, model_family="qwen2_5_vl", max_length=40)
    out = enc.encode_chat(chat_sample(messages, [png_bytes(300, 200, 0)]))
    assert out.input_ids.numel() == 40
    assert out.pixel_values is None and out.image_grid_thw.shape == (0, 3)
    image_ids = set(
        tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    )
    assert not image_ids & set(out.input_ids.tolist()), "no partial image block may remain"
    assert out.sample_weights == [0.0]
    assert bool((out.labels == IGNORE_INDEX).all())
    assert enc.error_handler.snapshot()["truncated"] == 1
    # Exactly max_length fits: no truncation.
    fit = SFTTaskEncoder(tok, model_family="text", max_length=512)
    n = fit.encode_chat(chat_sample(CONVERSATIONS["single_turn"])).input_ids.numel()
    exact = SFTTaskEncoder(tok, model_family="text", max_length=n)
    assert exact.encode_chat(chat_sample(CONVERSATIONS["single_turn"])).sample_weights == [1.0]


def test_row_without_target_after_shift_is_masked_and_counted(tok: Any) -> None:
    # A template with no header: the assistant's only token is position 0, which no logit
    # predicts. The unshifted mask has a one, the shifted one none: weight 0, counted.
    plain = build_tokenizer()
    plain.chat_template = "{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}"
    enc = SFTTaskEncoder(plain, model_family="text", max_length=64)
    out = enc.encode_chat(chat_sample([{"role": "assistant", "content": "Hello"}]))
    assert out.input_ids.numel() == 1
    assert out.sample_weights == [0.0]
    assert enc.error_handler.snapshot() == {"no_trainable_tokens": 1}


def test_unknown_family_lists_known_ones(tok: Any) -> None:
    with pytest.raises(ValueError, match=r"unknown model_family 'llama9'.*'qwen2_5_vl'.*'text'"):
        SFTTaskEncoder(tok, model_family="llama9", max_length=64)


def test_text_family_rejects_images(tok: Any) -> None:
    from energon_sft import BadSampleError

    enc = SFTTaskEncoder(tok, model_family="text", max_length=64)
    msgs = [
        {"role": "user", "content": [{"type": "image", "media_index": 0}]},
        {"role": "assistant", "content": "ok"},
    ]
    with pytest.raises(BadSampleError, match="unsupported_media"):
        enc.encode_chat(chat_sample(msgs, [png_bytes(28, 28, 0)]))


_WORDS = [
    "Hello",
    "How",
    "are",
    "you",
    "the",
    "weather",
    "in",
    "Paris",
    "is",
    "sunny",
    "red",
    "square",
    "blue",
    "circle",
    "joke",
]


def _conversations() -> Any:
    from hypothesis import strategies as st

    text = st.lists(st.sampled_from(_WORDS), min_size=1, max_size=6).map(" ".join)
    turn = st.tuples(text, text)
    return st.tuples(
        st.one_of(st.none(), text), st.lists(turn, min_size=1, max_size=4), st.booleans()
    )


def test_random_conversations_match_the_hand_built_reference(tok: Any) -> None:
    from hypothesis import given, settings

    encoders = {
        final: SFTTaskEncoder(
            tok,
            model_family="text",
            max_length=4096,
            train_on="final_assistant" if final else "all_assistant",
        )
        for final in (False, True)
    }

    @settings(max_examples=30, deadline=None)
    @given(_conversations())
    def check(case: Any) -> None:
        system, turns, final = case
        messages = [{"role": "system", "content": system}] if system else []
        for user, assistant in turns:
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": assistant},
            ]
        out = encoders[final].encode_chat(chat_sample(messages))
        ids, trained, _ = _reference(tok, messages, None, final_only=final)
        assert out.input_ids.tolist() == ids
        assert out.labels.tolist() == _shift(ids, trained)

    check()


def test_register_model_family(tok: Any) -> None:
    from energon_sft import TextAdapter, known_model_families, register_model_family

    class Tagged(TextAdapter):
        def identity(self, processor_or_tokenizer: Any) -> dict[str, Any]:
            return {"adapter": "Tagged"}

    register_model_family("tagged_text_test", Tagged(), replace=True)
    assert "tagged_text_test" in known_model_families()
    with pytest.raises(ValueError, match="already registered"):
        register_model_family("tagged_text_test", Tagged())
    with pytest.raises(TypeError, match=r"subclass energon_sft\.ModelFamilyAdapter"):
        register_model_family("bad", object(), replace=True)  # type: ignore[arg-type]
    enc = SFTTaskEncoder(tok, model_family="tagged_text_test", max_length=64)
    assert enc.identity()["adapter"] == {"adapter": "Tagged"}
