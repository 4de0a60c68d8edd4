"""build_sft_loader: fixed order, state envelope, mismatch diffs, elastic resume via logical shards."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from _esft_data import batch_digest, build_dataset, build_tokenizer, chat_rows
from energon_sft import SFTTaskEncoder, build_sft_loader
from energon_sft.state import StateMismatchError


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_dataset(tmp_path_factory.mktemp("loader"), chat_rows(32, image_every=0))


def _enc(tok: Any, **kw: Any) -> SFTTaskEncoder:
    return SFTTaskEncoder(tok, model_family="text", max_length=kw.pop("max_length", 128), **kw)


def _loader(ds: Path, enc: SFTTaskEncoder, **kw: Any) -> Any:
    args: dict[str, Any] = dict(
        encoder=enc, batch_size=2, dp_rank=0, dp_world_size=1, num_workers=0, seed=3
    )
    args.update(kw)
    return build_sft_loader(ds, **args)


def _take(loader: Any, n: int) -> list[tuple[int, int, str]]:
    out = []
    for i, b in enumerate(loader):
        out.append((b.logical_shard, b.shard_step, batch_digest(b)))
        if i + 1 == n:
            break
    return out


def test_shuffle_false_repeats_and_shuffle_true_depends_on_seed(ds: Path, tok: Any) -> None:
    enc = _enc(tok)
    a = _take(_loader(ds, enc, shuffle=False), 6)
    b = _take(_loader(ds, enc, shuffle=False), 6)
    assert a == b
    # With worker processes too (the order depends on the worker count, not on timing).
    runs = []
    for _ in range(2):
        with _loader(ds, enc, shuffle=False, num_workers=2) as loader:
            runs.append(_take(loader, 6))
    assert runs[0] == runs[1]
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader).__next__()
    c = _take(_loader(ds, enc, shuffle=True, seed=1), 6)
    d = _take(_loader(ds, enc, shuffle=True, seed=2), 6)
    assert c != d, "different seeds must give different orders (else the check above is vacuous)"


def test_state_roundtrip_weights_only_and_guards(ds: Path, tok: Any) -> None:
    enc = _enc(tok)
    ref = _take(_loader(ds, enc), 7)
    run = _loader(ds, enc)
    it = iter(run)
    for _ in range(3):
        next(it)
    buf = io.BytesIO()
    torch.save(run.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    with pytest.raises(RuntimeError, match="after iteration started"):
        run.load_state_dict(state)
    fresh = _loader(ds, enc)
    fresh.load_state_dict(state)
    assert _take(fresh, 4) == ref[3:]
    # Operational settings may change on resume.
    from energon_sft import LoaderOptions

    other = _loader(
        ds, enc, options=LoaderOptions(prefetch_factor=4, watchdog_timeout_seconds=None)
    )
    other.load_state_dict(state)
    assert _take(other, 1) == ref[3:4]


def test_loader_options_are_keywords_of_get_savable_loader() -> None:
    """build_sft_loader passes LoaderOptions' fields to Energon by name."""
    import dataclasses
    import inspect

    from megatron.energon import get_savable_loader

    from energon_sft import LoaderOptions

    params = inspect.signature(get_savable_loader).parameters
    for field in dataclasses.fields(LoaderOptions):
        assert field.name in params, f"get_savable_loader has no keyword {field.name!r}"
        assert params[field.name].kind is inspect.Parameter.KEYWORD_ONLY, field.name


def test_corrupt_or_hostile_payload_is_refused_before_unpickling(ds: Path, tok: Any) -> None:
    import hashlib

    enc = _enc(tok)
    state = _loader(ds, enc).state_dict()
    entry = state["shards"]["0"]
    tampered = dict(entry, state=entry["state"].clone())
    tampered["state"][-2] ^= 1
    with pytest.raises(StateMismatchError, match="sha256"):
        _loader(ds, enc).load_state_dict({**state, "shards": {"0": tampered}})

    class Evil:
        def __reduce__(self) -> Any:
            return (print, ("pwned",))

    data = pickle.dumps(Evil())
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    evil = {"consumed": 0, "sha256": hashlib.sha256(data).hexdigest(), "state": blob}
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to unpickle builtins\.print"):
        _loader(ds, enc).load_state_dict({**state, "shards": {"0": evil}})


def test_every_stream_setting_mismatch_is_rejected_with_its_diff(
    ds: Path, tok: Any, tmp_path: Path
) -> None:
    enc = _enc(tok)
    state = _loader(ds, enc).state_dict()
    other_tok = build_tokenizer()
    other_tok.chat_template = other_tok.chat_template.replace("<|im_end|>\\n", "<|im_end|>")
    other_ds = build_dataset(tmp_path, chat_rows(32, image_every=0))
    cases: list[tuple[dict[str, Any], str]] = [
        ({"batch_size": 3}, "batch_size: 2 -> 3"),
        ({"seed": 4}, "seed: 3 -> 4"),
        ({"num_workers": 2}, "num_workers: 0 -> 2"),
        ({"shuffle": False}, "shuffle: True -> False"),
        ({"shuffle_buffer_size": 50}, "shuffle_buffer_size: 100 -> 50"),
        ({"virtual_epoch_length": 5}, "virtual_epoch_length: None -> 5"),
        ({"num_logical_shards": 2}, "num_logical_shards: 1 -> 2"),
        ({"encoder": _enc(tok, max_length=64)}, "encoder.max_length: 128 -> 64"),
        (
            {"encoder": _enc(tok, train_on="final_assistant")},
            "encoder.train_on: 'all_assistant' -> 'final_assistant'",
        ),
        ({"encoder": _enc(other_tok)}, "encoder.chat_template_sha256: "),
        ({"ds": other_ds}, "dataset.index_uuid: "),
    ]
    for change, needle in cases:
        kw = dict(change)
        path = kw.pop("ds", ds)
        loader = _loader(path, kw.pop("encoder", enc), **kw)
        with pytest.raises(StateMismatchError) as info:
            loader.load_state_dict(state)
        assert needle in str(info.value), f"{change}: {info.value}"


def test_resume_on_a_different_dp_size_through_logical_shards(ds: Path, tok: Any) -> None:
    enc = _enc(tok)
    common = dict(num_logical_shards=4)
    # Reference: one replica runs all 4 logical shards; record each shard's own stream.
    streams: dict[int, list[str]] = {s: [] for s in range(4)}
    for shard, step, digest in _take(_loader(ds, enc, **common), 24):
        assert step == len(streams[shard])
        streams[shard].append(digest)
    # Save on dp=2 after uneven progress of the two replicas.
    envs = []
    for rank, steps in ((0, 3), (1, 5)):
        loader = _loader(ds, enc, dp_rank=rank, dp_world_size=2, **common)
        for shard, step, digest in _take(loader, steps):
            assert streams[shard][step] == digest, "a shard's stream must not depend on dp size"
        envs.append(loader.state_dict())
    consumed = {int(k): v["consumed"] for e in envs for k, v in e["shards"].items()}
    assert consumed == {0: 2, 1: 1, 2: 3, 3: 2}
    # Resume on dp=4: every shard continues exactly where it stopped.
    for rank in range(4):
        loader = _loader(ds, enc, dp_rank=rank, dp_world_size=4, **common)
        loader.load_state_dict(envs)
        got = _take(loader, 2)
        start = consumed[rank]
        assert got == [(rank, start + i, streams[rank][start + i]) for i in range(2)]
    # A replica given only some ranks' envelopes is told what is missing.
    loader = _loader(ds, enc, dp_rank=3, dp_world_size=4, **common)
    with pytest.raises(StateMismatchError, match=r"lacks logical shards \[3\]"):
        loader.load_state_dict(envs[0])
    with pytest.raises(ValueError, match="not divisible by dp_world_size=3"):
        _loader(ds, enc, dp_rank=0, dp_world_size=3, **common)


def test_state_dict_with_workers_before_every_shard_gave_a_batch(ds: Path, tok: Any) -> None:
    """With worker processes, a state_dict() taken after the first batch of 2 logical shards
    waited forever: shard 1's workers counted as started but had not, and never answered."""
    import threading

    enc = _enc(tok)
    opts = dict(shuffle=False, num_workers=1, num_logical_shards=2)
    with _loader(ds, enc, **opts) as straight:
        reference = _take(straight, 4)
    with _loader(ds, enc, **opts) as loader:
        assert _take(loader, 1) == reference[:1]
        saved: list[Any] = []
        saver = threading.Thread(target=lambda: saved.append(loader.state_dict()), daemon=True)
        saver.start()
        saver.join(timeout=60)
        assert saved, "state_dict() did not return within 60 s"
    with _loader(ds, enc, **opts) as resumed:
        resumed.load_state_dict(saved[0])
        assert _take(resumed, 3) == reference[1:]


def test_virtual_epoch_length_counts_batches_per_shard(ds: Path, tok: Any) -> None:
    loader = _loader(ds, _enc(tok), virtual_epoch_length=3, num_logical_shards=2)
    assert len(loader) == 6
    first = [(s, k) for s, k, _ in _take(loader, 100)]
    assert first == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    second = [(s, k) for s, k, _ in _take(loader, 100)]
    assert second == [(0, 3), (1, 3), (0, 4), (1, 4), (0, 5), (1, 5)]


def test_packed_stream_resumes_exactly(ds: Path, tok: Any) -> None:
    enc = _enc(tok, max_length=256, packing_buffer_size=6)
    ref = _take(_loader(ds, enc, batch_size=1), 6)
    run = _loader(ds, enc, batch_size=1)
    it = iter(run)
    for _ in range(2):
        next(it)
    state = run.state_dict()
    fresh = _loader(ds, enc, batch_size=1)
    fresh.load_state_dict(state)
    assert _take(fresh, 4) == ref[2:]


def test_packing_draws_no_progress_bar_in_the_workers(
    ds: Path, tok: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """Energon's "Filling reading buffer" bar (every worker, every rank) is not drawn."""
    enc = _enc(tok, max_length=256, packing_buffer_size=6)
    with _loader(ds, enc, batch_size=1, num_workers=1) as loader:
        assert len(_take(loader, 2)) == 2
    err = capfd.readouterr().err
    assert "Filling reading buffer" not in err, err


def test_state_saved_at_an_epoch_boundary_resumes_the_next_epoch(ds: Path, tok: Any) -> None:
    enc = _enc(tok)
    ref = _loader(ds, enc, virtual_epoch_length=3)
    epochs = [_take(ref, 100), _take(ref, 100)]
    run = _loader(ds, enc, virtual_epoch_length=3)
    assert _take(run, 100) == epochs[0]
    fresh = _loader(ds, enc, virtual_epoch_length=3)
    fresh.load_state_dict(run.state_dict())
    assert _take(fresh, 100) == epochs[1]
