"""The read side of the data: finding shards, image sources, decoding, augmentation, the loaders.

The write side (`make-shards`, `ShardWriter`) is `ssl_vit.data.write`, the dataset generators
`ssl_vit.datasets`; both sides share the format, `ssl_vit.data.format`."""

from ssl_vit.data.decode import decode_image
from ssl_vit.data.device_augment import DeviceAugment, build_device_augment
from ssl_vit.data.eval_stream import eval_loader
from ssl_vit.data.format import IMAGE_EXTENSIONS, SHARD_FORMAT
from ssl_vit.data.image_source import ImageSource, Record
from ssl_vit.data.images import eval_transform, train_transform
from ssl_vit.data.shards import is_shard_spec, read_index, resolve_shards
from ssl_vit.data.sources import FolderSource, HFSource, ShardSource, open_source
from ssl_vit.data.stages import Batch
from ssl_vit.data.train_stream import StreamTracker, pretrain_loader, train_loader

__all__ = [
    "IMAGE_EXTENSIONS",
    "SHARD_FORMAT",
    "Batch",
    "DeviceAugment",
    "FolderSource",
    "HFSource",
    "ImageSource",
    "Record",
    "ShardSource",
    "StreamTracker",
    "build_device_augment",
    "decode_image",
    "eval_loader",
    "eval_transform",
    "is_shard_spec",
    "open_source",
    "pretrain_loader",
    "read_index",
    "resolve_shards",
    "train_loader",
    "train_transform",
]
