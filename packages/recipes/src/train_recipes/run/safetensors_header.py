"""The header of a ``.safetensors`` file, read without touching its tensor data.

A safetensors file is 8 bytes of little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the data. Reading only the first two is what lets
the sharded load position its reads and the storage estimate count parameters for free.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

__all__ = ["SafetensorsHeader", "TensorEntry", "read_safetensors_header"]


class TensorEntry(TypedDict):
    """One tensor of the header, as the format writes it.

    ``dtype`` is the format's name ("BF16", "F32", ...); ``data_offsets`` are [begin, end)
    bytes from the start of the data (the first byte after the header).
    """

    dtype: str
    shape: list[int]
    data_offsets: list[int]


@dataclass(kw_only=True, slots=True, frozen=True)
class SafetensorsHeader:
    """The tensors of one file and where its data starts.

    Attributes:
        tensors: ``name -> entry``, without the ``__metadata__`` record.
        data_start: the absolute byte offset of the data (8 + the header's length).
    """

    tensors: dict[str, TensorEntry]
    data_start: int


def read_safetensors_header(path: Path) -> SafetensorsHeader:
    """Read the length and JSON header of ``path`` (8 + header bytes, no tensor data)."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return SafetensorsHeader(tensors=header, data_start=8 + length)
