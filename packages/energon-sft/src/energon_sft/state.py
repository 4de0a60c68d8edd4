"""The loader state envelope: validated before a single byte of Energon state is unpickled.

Envelope (plain dicts, strings, numbers and uint8 tensors, so `torch.load(weights_only=True)`
accepts it):

    {"format_version": 1, "fingerprint": sha256(stream identity),
     "stream": {...},        # fields that define the sample stream: must match on resume
     "operational": {...},   # prefetch, timeouts, dp layout: may change on resume
     "shards": {"<logical shard>": {"consumed": int, "sha256": str, "state": uint8 tensor}}}
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT_VERSION",
    "StateMismatchError",
    "dataset_identity",
    "diff_fields",
    "fingerprint",
]

FORMAT_VERSION = 1


class StateMismatchError(ValueError):
    """A saved loader state does not fit the loader it is restored into."""


def fingerprint(stream: Mapping[str, Any]) -> str:
    """The sha256 hex digest of a stream description (JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(stream, sort_keys=True, default=str).encode()).hexdigest()


def _file_sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def dataset_identity(path: Path) -> dict[str, Any]:
    """The `stream["dataset"]` entry: what identifies a prepared dataset without reading it all.

    A folder: its name and the hashes of the `.nv-meta` files `energon prepare` wrote; a JSONL:
    its size and its row-offset index; a metadataset YAML: its content.

    Raises:
        FileNotFoundError: a folder that was never prepared.
    """
    meta = path / ".nv-meta"
    if path.is_dir() and not meta.is_dir():
        raise FileNotFoundError(
            f"{path} has no .nv-meta folder; prepare it first (energon-sft convert or "
            "`energon prepare`)"
        )
    if path.is_dir():
        uuid = meta / "index.uuid"
        return {
            "name": path.name,
            "index_uuid": uuid.read_text().strip() if uuid.is_file() else None,
            "info_sha256": _file_sha(meta / ".info.json"),
            "split_sha256": _file_sha(meta / "split.yaml"),
            "dataset_yaml_sha256": _file_sha(meta / "dataset.yaml"),
        }
    if path.suffix == ".jsonl":
        # Hashing a large JSONL at every start is slow; its size and the row-offset index
        # (written by `energon prepare`) identify it.
        return {
            "name": path.name,
            "size": path.stat().st_size,
            "idx_sha256": _file_sha(path.with_suffix(".jsonl.idx")),
        }
    # A metadataset YAML: its content defines the stream.
    return {"name": path.name, "file_sha256": _file_sha(path)}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, Mapping):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def diff_fields(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """`field: old -> new` for every (flattened) field that differs."""
    a, b = _flatten(old), _flatten(new)
    missing = object()
    lines = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            sa = "<absent>" if va is missing else repr(va)
            sb = "<absent>" if vb is missing else repr(vb)
            lines.append(f"{key}: {sa} -> {sb}")
    return lines


def pack_state(obj: Any) -> tuple[torch.Tensor, str]:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone(), hashlib.sha256(
        data
    ).hexdigest()


# Energon's loader state holds its own dataclasses, RNG states (random/numpy/torch) and
# containers. Anything else in the pickle is refused.
_ALLOWED_PREFIXES = ("megatron.energon.", "numpy", "torch", "collections", "_codecs")
_ALLOWED_BUILTINS = {
    "dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes",
    "bytearray", "bool", "complex", "slice", "range", "NoneType", "object",
}  # fmt: skip


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if module == "copyreg" and name in ("_reconstructor", "__newobj__"):
            return super().find_class(module, name)
        if module.startswith(_ALLOWED_PREFIXES) or module == "megatron.energon":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name} from a loader state: only Energon state "
            "classes, RNG states and containers are allowed"
        )


def unpack_state(blob: Any, sha256: str, *, shard: int) -> Any:
    """Check the payload hash, then unpickle with the restricted unpickler."""
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise StateMismatchError(f"logical shard {shard}: state payload is not a 1-D uint8 tensor")
    data = blob.numpy().tobytes()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise StateMismatchError(
            f"logical shard {shard}: state payload sha256 {got} != recorded {sha256} (corrupt "
            "or edited checkpoint)"
        )
    return _StateUnpickler(io.BytesIO(data)).load()


def validate_envelope(env: Any, stream: Mapping[str, Any]) -> None:
    """Raise `StateMismatchError` unless `env` is a v1 envelope of the same sample stream."""
    if not isinstance(env, Mapping):
        raise StateMismatchError(f"loader state must be a dict envelope, got {type(env).__name__}")
    version = env.get("format_version")
    if version != FORMAT_VERSION:
        raise StateMismatchError(
            f"loader state format_version {version!r} != {FORMAT_VERSION}; it was written by "
            "an incompatible energon-sft"
        )
    for key in ("fingerprint", "stream", "shards"):
        if key not in env:
            raise StateMismatchError(f"loader state envelope lacks {key!r}")
    lines = diff_fields(env["stream"], stream)
    if lines:
        raise StateMismatchError(
            "the saved loader state belongs to a different sample stream; changed fields "
            "(old -> new):\n  " + "\n  ".join(lines)
        )
    if env["fingerprint"] != fingerprint(env["stream"]):
        raise StateMismatchError(
            "loader state fingerprint does not match its stream fields (edited checkpoint?)"
        )
