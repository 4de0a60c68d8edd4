"""Multimodal SFT data path on Megatron-Energon: cookers, task encoders, exact loss masks, resumable rank-aware loaders."""

from importlib.metadata import version as _version

from energon_sft.batch import IGNORE_INDEX, EncodedSample, SFTBatch
from energon_sft.convert import convert_jsonl
from energon_sft.cookers import (
    SubflavorCooker,
    check_cookers,
    cook_chat,
    cook_sharegpt,
    default_cookers,
    make_stateless_cooker,
)
from energon_sft.dataset import prepare_dataset, write_chat_shards
from energon_sft.encoder import SFTTaskEncoder
from energon_sft.errors import BadSampleError, OverlongSampleError, TooManyBadSamplesError
from energon_sft.families import (
    ImageFeatures,
    ModelFamilyAdapter,
    Qwen25VLAdapter,
    TextAdapter,
    get_model_family,
    known_model_families,
    register_model_family,
)
from energon_sft.loader import LoaderOptions, SFTLoader, build_sft_loader
from energon_sft.megatron import MegatronInputs, to_megatron_inputs
from energon_sft.render import render_conversation
from energon_sft.rope import mrope_position_ids
from energon_sft.sampling import FirstSamples, first_samples
from energon_sft.schema import ChatSample, MediaItem
from energon_sft.shard_files import ShardFileError, check_shard_files
from energon_sft.state import StateMismatchError
from energon_sft.topology import (
    TopologyMapper,
    broadcast_batch,
    broadcast_next,
    logical_shards_for,
)

__version__ = _version("energon-sft")

__all__ = [
    "IGNORE_INDEX",
    "BadSampleError",
    "ChatSample",
    "EncodedSample",
    "FirstSamples",
    "ImageFeatures",
    "LoaderOptions",
    "MediaItem",
    "MegatronInputs",
    "ModelFamilyAdapter",
    "OverlongSampleError",
    "Qwen25VLAdapter",
    "SFTBatch",
    "SFTLoader",
    "SFTTaskEncoder",
    "ShardFileError",
    "StateMismatchError",
    "SubflavorCooker",
    "TextAdapter",
    "TooManyBadSamplesError",
    "TopologyMapper",
    "__version__",
    "broadcast_batch",
    "broadcast_next",
    "build_sft_loader",
    "check_cookers",
    "check_shard_files",
    "convert_jsonl",
    "cook_chat",
    "cook_sharegpt",
    "default_cookers",
    "first_samples",
    "get_model_family",
    "known_model_families",
    "logical_shards_for",
    "make_stateless_cooker",
    "mrope_position_ids",
    "prepare_dataset",
    "register_model_family",
    "render_conversation",
    "to_megatron_inputs",
    "write_chat_shards",
]
