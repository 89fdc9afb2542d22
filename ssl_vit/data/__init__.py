"""Data layer: shards (writing, finding), image sources, the synthetic dataset, the loaders."""

from ssl_vit.data.convert import make_shards
from ssl_vit.data.decode import decode_image
from ssl_vit.data.device_augment import DeviceAugment, build_device_augment
from ssl_vit.data.eval_stream import eval_loader
from ssl_vit.data.images import eval_transform, train_transform
from ssl_vit.data.shards import (
    IMAGE_EXTENSIONS,
    SHARD_FORMAT,
    ShardWriter,
    is_shard_spec,
    read_index,
    resolve_shards,
)
from ssl_vit.data.sources import (
    FolderSource,
    HFSource,
    ImageSource,
    Record,
    ShardSource,
    open_source,
)
from ssl_vit.data.stages import Batch
from ssl_vit.data.synthetic import SYNTHETIC_LABELS, make_synthetic_shards, synthetic_shapes
from ssl_vit.data.train_stream import StreamTracker, pretrain_loader, train_loader

__all__ = [
    "IMAGE_EXTENSIONS",
    "SHARD_FORMAT",
    "SYNTHETIC_LABELS",
    "Batch",
    "DeviceAugment",
    "FolderSource",
    "HFSource",
    "ImageSource",
    "Record",
    "ShardSource",
    "ShardWriter",
    "StreamTracker",
    "build_device_augment",
    "decode_image",
    "eval_loader",
    "eval_transform",
    "is_shard_spec",
    "make_shards",
    "make_synthetic_shards",
    "open_source",
    "pretrain_loader",
    "read_index",
    "resolve_shards",
    "synthetic_shapes",
    "train_loader",
    "train_transform",
]
