"""The interface of a random-access labelled image source (`ssl_vit.data.sources`): `Record`,
one sample's encoded bytes, and `ImageSource`, a finite ordered collection of them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

__all__ = ["ImageSource", "Record"]


class Record(NamedTuple):
    """One sample of a source: `index` in source order, a dot-free unique `key`, the image
    extension (no dot, "" if unknown), the encoded bytes (b"" if unreadable), the label (-1 if
    none)."""

    index: int
    key: str
    ext: str
    data: bytes
    label: int


class ImageSource(ABC):
    """A finite, ordered collection of labelled encoded images.

    `label_names` is [] for an unlabelled source (then every label is -1).
    """

    label_names: list[str]
    # Why a source has no labels, as a job asking for them says it (each kind its own reason)
    unlabelled_why = "shards without label names in index.json"
    plain_label_column: str | None = None  # a dataset's classes stored as ints or strings

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def labels(self) -> np.ndarray:
        """int64 [N] labels in source order (-1 where unlabelled), without decoding images."""

    @abstractmethod
    def iter_records(self, indices: Iterable[int] | None = None) -> Iterator[Record]:
        """Records in ascending index order, only those in `indices` when given."""

    @abstractmethod
    def sample_keys(self) -> list[str]:
        """Every sample's key in source order (as `Record.key`), without reading images."""

    def __getitem__(self, index: int) -> Record:
        """Record `index` (for shards: reads the shard up to it; prefer `iter_records`)."""
        return next(self.iter_records([self._check_index(index)]))

    def _check_index(self, index: int) -> int:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range [0, {len(self)})")
        return int(index)

    @abstractmethod
    def describe(self, index: int) -> str:
        """Where sample `index` comes from, for log messages."""

    def name(self, record: Record) -> str:
        """What a person calls the sample (predictions' `key`): its key; a folder's file path."""
        return record.key

    def _check_indices(self, indices: Iterable[int] | None) -> np.ndarray | None:
        if indices is None:
            return None
        idx = np.unique(np.asarray(list(indices), dtype=np.int64))
        if idx.size and (idx[0] < 0 or idx[-1] >= len(self)):
            raise IndexError(f"indices must be in [0, {len(self)}), got {idx[0]}..{idx[-1]}")
        return idx
