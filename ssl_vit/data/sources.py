"""Random-access labelled image sources: an image folder, a Hugging Face dataset, or shards.

Downstream jobs (few-shot features, evaluation) need labels without decoding images, and the
encoded bytes of a few chosen samples out of many. An `ImageSource` gives exactly that:
`labels()` reads labels only (folder paths, the HF label column, `.cls` tar members) and
`iter_records(indices)` reads only the chosen samples' bytes (the interface:
`ssl_vit.data.image_source`). Decoding happens elsewhere
(`ssl_vit.data.decode.decode_image`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ssl_vit.data.decode import read_image_file
from ssl_vit.data.format import IMAGE_EXTENSIONS, sample_fields
from ssl_vit.data.image_source import ImageSource, Record
from ssl_vit.data.shards import is_shard_spec, read_index, resolve_shards
from ssl_vit.data.tar import tar_groups
from ssl_vit.errors import ConfigError, InputError

__all__ = ["FolderSource", "HFSource", "ShardSource", "open_raw_source", "open_source"]

log = logging.getLogger(__name__)

_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_MAGIC = (  # leading bytes -> extension, for HF images stored as bytes without a file name
    (b"\x89PNG", "png"),
    (b"\xff\xd8\xff", "jpg"),
    (b"GIF8", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)


def _sanitize(name: str) -> str:
    """A WebDataset-safe key: no dots or slashes (members are grouped on the first dot)."""
    key = re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_")
    return key or "img"


def _unique_keys(names: list[str]) -> list[str]:
    seen: set[str] = set()
    keys = []
    for name in names:
        key, n = _sanitize(name), 1
        while key in seen:  # e.g. "a.b.png" and "a_b.png" sanitize alike
            n += 1
            key = f"{_sanitize(name)}_{n}"
        seen.add(key)
        keys.append(key)
    return keys


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS


def _images_under(folder: Path) -> list[str]:
    """Relative posix paths of the image files under `folder` (recursive), sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel = os.path.relpath(dirpath, folder)
        found += [f if rel == "." else f"{rel}/{f}" for f in filenames if _is_image(f)]
    return sorted(Path(p).as_posix() for p in found)


LABELS = ("required", "optional", "ignored")  # FolderSource's `labels`


_LEFT_OUT: set[str] = set()  # the folders whose images outside class folders were named


class FolderSource(ImageSource):
    """Images in `root/<class>/**` (labels = sorted class names, a class folder any sub-folder
    with images) and directly in `root`. `labels` says what a labelled folder (one with class
    folders) gives of the images directly in `root`, which have no class:

    - "required" (training, evaluation, few-shot): every sample has a label; they are left out,
      named in one warning.
    - "optional" (predict, make-shards): they follow the class images, label -1; the job says
      what it does with them (predict predicts them, make-shards counts them as skipped).
    - "ignored" (predict --ignore-labels): no labels at all; every image under `root`.

    Either way the order is the class folders' images, class by class (paths sorted), then the
    images directly in `root` (sorted). A folder without class folders is unlabelled: its
    images, label -1, whatever `labels`."""

    unlabelled_why = "an image folder without class sub-folders"

    def __init__(self, root: str | os.PathLike, labels: str = "required") -> None:
        if labels not in LABELS:
            raise ConfigError(f"labels must be one of {LABELS}, got {labels!r}")
        self.root = Path(root)
        if self.root.is_file() and _is_image(self.root.name):  # `predict --source photo.jpg`
            self.root, classes, per_class, top = self.root.parent, [], {}, [self.root.name]
        elif not self.root.is_dir():
            raise FileNotFoundError(f"image folder not found: {root}")
        else:
            classes = sorted(d.name for d in os.scandir(root) if d.is_dir() and d.name[0] != ".")
            per_class = {c: _images_under(self.root / c) for c in classes}
            classes = [c for c in classes if per_class[c]]
            top = sorted(e.name for e in os.scandir(root) if e.is_file() and _is_image(e.name))
        if classes and top and labels == "required":
            if str(self.root) not in _LEFT_OUT:  # once: a training stream opens it every visit
                _LEFT_OUT.add(str(self.root))
                more = f", ... ({len(top) - 5} more)" if len(top) > 5 else ""
                log.warning(
                    "%s: leaving out %d images outside its class folders (no class: %s%s)",
                    root, len(top), ", ".join(top[:5]), more,
                )  # fmt: skip
            top = []
        elif classes and top and labels == "optional":
            log.info("%s: %d images outside its class folders have no label", root, len(top))
        self.label_names = classes if labels != "ignored" else []
        self.files = [f"{c}/{p}" for c in classes for p in per_class[c]] + top
        counts = [len(per_class[c]) for c in self.label_names]
        self._labels = np.full(len(self.files), -1, dtype=np.int64)  # -1: no label
        self._labels[: sum(counts)] = np.repeat(np.arange(len(counts)), counts)
        if not self.files:
            raise InputError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found in {root}")
        self.keys = _unique_keys([f.rsplit(".", 1)[0] for f in self.files])

    def __len__(self) -> int:
        return len(self.files)

    def labels(self) -> np.ndarray:
        return self._labels.copy()

    def sample_keys(self) -> list[str]:
        return list(self.keys)

    def describe(self, index: int) -> str:
        return str(self.root / self.files[index])

    def name(self, record: Record) -> str:
        return self.files[record.index]  # the path relative to the folder

    def __getitem__(self, index: int) -> Record:
        path = self.root / self.files[self._check_index(index)]
        try:  # a FIFO, a device or a huge file is refused, neither waited on nor read
            data = read_image_file(path)
        except OSError as e:  # unreadable: empty bytes, which every consumer rejects
            log.warning("cannot read %s: %s", path, e)
            data = b""
        ext = path.suffix[1:].lower()
        return Record(index, self.keys[index], ext, data, int(self._labels[index]))

    def iter_records(self, indices: Iterable[int] | None = None) -> Iterator[Record]:
        idx = self._check_indices(indices)
        for i in range(len(self)) if idx is None else idx.tolist():
            yield self[i]


def _sniff_ext(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return next((ext for magic, ext in _MAGIC if data.startswith(magic)), "")


HUB_PREFIX = "hf://"


class HFSource(ImageSource):
    """A Hugging Face dataset: a `save_to_disk` directory or an `imagefolder` directory.

    The image column is the one `Image` feature (several: an error naming them), the label
    column the first `ClassLabel` (none: unlabelled). Images are read undecoded
    (`Image(decode=False)`): original bytes; a null image is empty bytes (a counted skip).
    """

    def __init__(
        self, path: str, split: str | None = None, imagefolder: bool = False, hub: bool = False
    ) -> None:
        import datasets  # heavy (pyarrow, pandas): only when an HF source is used

        self.path = path
        if hub:  # a dataset name on the Hugging Face Hub (needs internet or the local cache)
            ds = datasets.load_dataset(path, split=split or "train")
        elif not os.path.isdir(path):
            raise FileNotFoundError(f"dataset directory not found: {path}")
        elif imagefolder:
            ds = datasets.load_dataset("imagefolder", data_dir=path, split=split or "train")
        else:
            ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if split is None and len(ds) > 1:  # reading "train" unasked could evaluate on it
                paths = " or ".join(os.path.join(path, s) for s in sorted(ds))
                raise InputError(
                    f"{path}: a dataset of {len(ds)} splits ({', '.join(sorted(ds))}); "
                    f"name the one to read: {paths}"
                )
            split = split or next(iter(ds))
            if split not in ds:
                raise InputError(f"{path}: no split {split!r} (splits: {sorted(ds)})")
            ds = ds[split]
        feats = ds.features
        images = [k for k, f in feats.items() if isinstance(f, datasets.Image)]
        if not images:
            raise InputError(f"{path}: no Image column (features: {dict(feats)})")
        if len(images) > 1:  # e.g. `mask` before `image`: which one is the input is not ours
            raise InputError(
                f"{path}: {len(images)} Image columns ({', '.join(images)}); keep the one to "
                "read and remove the others (Dataset.remove_columns)"
            )
        self.image_col = images[0]
        labels = [k for k, f in feats.items() if isinstance(f, datasets.ClassLabel)]
        self.label_col = labels[0] if labels else None
        plain = [k for k in ("label", "labels") if k in feats and not labels]
        self.plain_label_column = plain[0] if plain else None  # classes as ints or strings
        self.unlabelled_why = (
            f"its column {plain[0]!r} is {feats[plain[0]]}, not a ClassLabel: store it as one "
            f"(strings: Dataset.class_encode_column({plain[0]!r}); ints: cast_column with "
            "ClassLabel(names=[...])) and save_to_disk again"
            if plain
            else "no ClassLabel column"
        )
        self.label_names = list(feats[self.label_col].names) if self.label_col else []
        self._decoded = ds
        self._ds = ds.cast_column(self.image_col, datasets.Image(decode=False))
        self._rows = self._ds.select_columns([self.image_col] + labels[:1])

    def __len__(self) -> int:
        return len(self._ds)

    def labels(self) -> np.ndarray:
        if self.label_col is None:
            return np.full(len(self), -1, dtype=np.int64)
        col = self._ds.select_columns([self.label_col]).with_format("numpy")[self.label_col]
        return np.asarray(col, dtype=np.int64)

    def sample_keys(self) -> list[str]:
        return [f"{i:08d}" for i in range(len(self))]

    def describe(self, index: int) -> str:
        return f"{self.path} row {index}"

    def __getitem__(self, index: int) -> Record:
        row = self._rows[self._check_index(index)]
        data, ext = self._image_bytes(index, row[self.image_col])
        label = int(row[self.label_col]) if self.label_col else -1
        return Record(int(index), f"{index:08d}", ext, data, label)

    def _image_bytes(self, index: int, image: dict[str, Any] | None) -> tuple[bytes, str]:
        """Row `index`'s encoded image and its extension; (b"", "") if the image is null or
        its file unreadable (logged; every consumer skips and counts empty data)."""
        path = (image or {}).get("path") or ""
        ext = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
        if image is not None and image.get("bytes"):
            data = image["bytes"]
            return data, _sniff_ext(data) or ext
        if not path:
            log.warning("%s: the image is null", self.describe(index))
            return b"", ""
        if os.path.lexists(path):
            try:  # a FIFO, a device or a huge file is refused, neither waited on nor read
                return read_image_file(path), ext
            except OSError as e:
                log.warning("%s: cannot read %s: %s", self.describe(index), path, e)
                return b"", ""
        # No bytes nor local file (e.g. a path inside a remote archive): let datasets decode
        # and store PNG. Rare, slow, and lossless.
        import io

        from PIL import Image

        from ssl_vit.data.decode import pil_to_rgb8  # 16-bit scaled, not clipped

        buf = io.BytesIO()
        Image.fromarray(pil_to_rgb8(self._decoded[int(index)][self.image_col])).save(buf, "PNG")
        return buf.getvalue(), "png"

    def iter_records(self, indices: Iterable[int] | None = None) -> Iterator[Record]:
        idx = self._check_indices(indices)
        order = range(len(self)) if idx is None else idx.tolist()
        ds = self._rows if idx is None else self._rows.select(order)
        rows = iter(order)
        for batch in ds.iter(batch_size=256):
            labels = batch[self.label_col] if self.label_col else [-1] * len(batch[self.image_col])
            for image, label in zip(batch[self.image_col], labels, strict=True):
                i = next(rows)
                data, ext = self._image_bytes(i, image)
                yield Record(i, f"{i:08d}", ext, data, int(label))


class ShardSource(ImageSource):
    """Shards as a random-access source: sample i = the i-th key group across the shards.

    Counts come from index.json when there is one, else from reading tar headers. Local tars
    are read with seeks, so `labels()` and `iter_records(indices)` only read `.cls` members and
    the chosen samples' images.
    """

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.urls = resolve_shards(spec)
        index = read_index(spec)
        self.label_names = list(index["label_names"]) if index else []
        # Counts from the indexes of the shards' directories (several for a dataset in parts),
        # if they cover every shard; else from reading the tars.
        counts = {}
        for folder in dict.fromkeys(os.path.dirname(u) for u in self.urls):
            folder_index = read_index(folder) if os.path.isdir(folder) else None
            for s in folder_index["shards"] if folder_index else []:
                counts[os.path.join(folder, s["name"])] = s["num_samples"]
        known = all(u in counts for u in self.urls)
        self._counts = [counts[u] for u in self.urls] if known else None
        self._labels: np.ndarray | None = None
        self._keys: list[str] | None = None

    def _scan(self) -> None:
        counts, labels, keys = [], [], []
        for url in self.urls:
            groups = list(_records(url, None, ("cls",)))
            counts.append(len(groups))
            labels += [label for _, _, _, _, label in groups]
            keys += [key for _, key, _, _, _ in groups]
        self._counts, self._labels = counts, np.asarray(labels, dtype=np.int64)
        self._keys = keys

    def shard_counts(self) -> list[int]:
        """Number of samples in each of `self.urls`."""
        if self._counts is None:
            self._scan()
        return list(self._counts)

    def __len__(self) -> int:
        return sum(self.shard_counts())

    def labels(self) -> np.ndarray:
        if self._labels is None:
            self._scan()
        return self._labels.copy()

    def sample_keys(self) -> list[str]:
        if self._keys is None:
            self._scan()
        return list(self._keys)

    def describe(self, index: int) -> str:
        return f"{self.spec} sample {index}"

    def iter_records(self, indices: Iterable[int] | None = None) -> Iterator[Record]:
        idx = self._check_indices(indices)
        start = 0
        for url, count in zip(self.urls, self.shard_counts(), strict=True):
            wanted = None
            if idx is not None:
                lo, hi = np.searchsorted(idx, [start, start + count])
                wanted = set((idx[lo:hi] - start).tolist())
            if wanted is None or wanted:
                for i, key, ext, data, label in _records(url, wanted, IMAGE_EXTENSIONS + ("cls",)):
                    yield Record(start + i, key, ext, data, label)
            start += count


def _records(
    url: str, wanted: set[int] | None, suffixes: tuple[str, ...]
) -> Iterator[tuple[int, str, str, bytes, int]]:
    """(i, key, image ext, image bytes, label) per sample of a tar (`tar_groups`); a sample
    without an image member has ext "" and b"", without `.cls` label -1."""
    for i, g in tar_groups(url, wanted, suffixes):
        ext, label = sample_fields(g)
        data = g[ext] if ext is not None else b""
        yield i, g["__key__"], ext or "", data, -1 if label is None else label


def open_raw_source(
    spec: str, split: str | None = None, source_format: str = "auto", labels: str = "optional"
) -> ImageSource:
    """An image folder, one image file or an HF dataset directory (what `make_shards` reads);
    see `open_source`.
    `labels`: a folder's (`FolderSource`); by default its images outside the class folders are
    samples with label -1, so that make-shards meets, and counts, every image."""
    if source_format not in ("auto", "folder", "hf", "hf-imagefolder"):
        raise ConfigError(f"unknown source format {source_format!r}")
    if os.path.isfile(spec) and _is_image(os.path.basename(spec)):  # one photo
        return FolderSource(spec, labels)
    if os.path.isfile(spec):
        raise FileNotFoundError(
            f"{spec}: a file, neither an image ({', '.join(IMAGE_EXTENSIONS)}) nor a folder, "
            "a dataset or shards"
        )
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"source directory not found: {spec}")
    if source_format == "hf-imagefolder":
        return HFSource(spec, split, imagefolder=True)
    is_hf = any(os.path.isfile(os.path.join(spec, m)) for m in _HF_MARKERS)
    if source_format == "hf" or (source_format == "auto" and is_hf):
        return HFSource(spec, split)
    return FolderSource(spec, labels)


def open_source(spec: str, split: str | None = None, labels: str = "required") -> ImageSource:
    """Open a labelled image source: shards (directory with index.json or *.tar, index JSON,
    brace pattern, tar), an HF saved dataset or `imagefolder` directory, an image folder, or
    a Hugging Face Hub dataset as `hf://NAME[:SPLIT]` (e.g. `hf://uoft-cs/cifar10:test`).
    `labels`: what an image folder's class folders and the images beside them give
    (`FolderSource`); other sources store their labels.

    FileNotFoundError with a one-line message if it does not exist.
    """
    spec = str(spec)
    if spec.startswith(HUB_PREFIX):
        name, _, hub_split = spec[len(HUB_PREFIX) :].partition(":")
        return HFSource(name, hub_split or split, hub=True)
    if is_shard_spec(spec):
        return ShardSource(spec)
    if not os.path.exists(os.path.expanduser(spec)):
        raise FileNotFoundError(f"image source not found: {spec}")
    return open_raw_source(os.path.expanduser(spec), split, labels=labels)
