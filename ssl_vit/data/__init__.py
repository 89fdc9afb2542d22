"""The read side of the data: finding shards, image sources, decoding, augmentation, the loaders.

The write side (`make-shards`, `ShardWriter`) is `ssl_vit.data.write`, the dataset generators
`ssl_vit.datasets`; both sides share the format, `ssl_vit.data.format`.

The names below are imported when first used (PEP 562), not with the package: most of them need
torch and torchvision (about 6 s of imports on 2 cores), which the write side and `ssl-vit report`
do not, and they import `ssl_vit.data.format` through this package."""

import importlib
from typing import Any

_MODULE_OF = {
    "decode_image": "decode",
    "DeviceAugment": "device_augment",
    "build_device_augment": "device_augment",
    "eval_loader": "eval_stream",
    "IMAGE_EXTENSIONS": "format",
    "SHARD_FORMAT": "format",
    "ImageSource": "image_source",
    "Record": "image_source",
    "eval_transform": "images",
    "train_transform": "images",
    "is_shard_spec": "shards",
    "read_index": "shards",
    "resolve_shards": "shards",
    "FolderSource": "sources",
    "HFSource": "sources",
    "ShardSource": "sources",
    "open_source": "sources",
    "Batch": "stages",
    "StreamArgs": "stream_state",
    "StreamTracker": "stream_state",
    "pretrain_loader": "train_stream",
    "train_loader": "train_stream",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
