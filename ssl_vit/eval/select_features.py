"""The features `ssl-vit select` chooses from: the few-shot probe's frozen readout of every
readable image of a source, streamed in source order to `features.npy` (float16), so a million
images x 768 take 1.5 GB on disk and a few batches in memory.

Each process embeds its global batches of `predict_loader` (`embed_batch`); the main process
gathers every round and appends its rows in source order (`FeatureWriter`, written to a hidden
sibling and renamed into place when complete). Each row also gets a content key: a fixed
random linear hash of the image's pixels at the encoder's resolution, exact in int64 on any
device. Sorting the rows by it gives an order that depends on the images only, not on the
source's order, folder names or format, so the picks do not either (`FeatureTable.canonical`).

A later round (the same --output, a larger --budget) reuses the pass: `features.index.npz`,
written after `features.npy` is in place, holds the rows' names, batches, indices and keys and
what the features were read with (`reused_table`); the same encoder weights, source, readout,
resolution, batch and precision over the same image names read nothing again.

Shape legend: B images of a batch, D feature width, L pixels x channels of one image.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ssl_vit.atomic import WriteError, replacing, writing
from ssl_vit.data.predict_stream import PredictBatch
from ssl_vit.data.predict_stream import num_batches as num_batches_of
from ssl_vit.errors import InputError
from ssl_vit.eval.fewshot_job import extract_features
from ssl_vit.eval.predictions import gather_on_main
from ssl_vit.eval.readouts import Extraction
from ssl_vit.eval.selection import Picks, normalised, select
from ssl_vit.model.vit import ViT
from ssl_vit.progress import progress_bar
from ssl_vit.watchdog import watched

__all__ = [
    "Embedded",
    "FeatureTable",
    "FeatureWriter",
    "choose",
    "content_keys",
    "embed_batch",
    "embed_rounds",
    "encoder_digest",
    "index_path",
    "reused_table",
]

_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


class Embedded(NamedTuple):
    """Global batch `index` (its first image is source index `first`) on the host: the
    readable images' names, float16 features [B, D] and content keys int64 [B]; the (name,
    reason) of each image that could not be read."""

    index: int
    first: int
    names: list[str]
    features: np.ndarray
    keys: np.ndarray
    skipped: list[tuple[str, str]]


def content_keys(images_BCHW: torch.Tensor) -> torch.Tensor:
    """int64 [B]: sum_i w_i x_i over an image's uint8 values, w fixed uniform in [0, 2^31)
    (seed 0). Below 2^63 for images up to 2^24 values (2,364 px square), so exact, and equal
    on every device and in any summation order; two images differ in key but with odds of
    about 2^-31."""
    B = len(images_BCHW)
    flat_BL = images_BCHW.reshape(B, -1)
    cache = (flat_BL.shape[1], str(flat_BL.device))
    if cache not in _WEIGHTS:
        g = torch.Generator().manual_seed(0)
        w = torch.randint(0, 2**31, (flat_BL.shape[1],), generator=g, dtype=torch.int64)
        _WEIGHTS[cache] = w.to(flat_BL.device)
    return (flat_BL.to(torch.int64) * _WEIGHTS[cache]).sum(dim=1)


@torch.no_grad()
def embed_batch(
    encoder: ViT, batch: PredictBatch, how: Extraction, pool: str, first: int
) -> Embedded:
    """The few-shot probe's features (`extract_features`: the final LayerNorm's output pooled
    by `pool`, pixels normalised as `how` says) and content keys of `batch`'s images."""
    dim = encoder.width * (2 if pool == "cls+gap" else 1)
    if not batch.names:  # every image of the batch failed to decode
        feats, keys = np.zeros((0, dim), np.float16), np.zeros(0, np.int64)
    else:
        images = batch.images.to(how.device, non_blocking=True)
        keys = content_keys(images).cpu().numpy()
        feats = extract_features(encoder, [(images, batch.labels)], how, pool)[0]
        feats = feats.to(torch.float16).numpy()
    return Embedded(batch.index, first, batch.names, feats, keys, batch.skipped)


def embed_rounds(
    encoder: ViT,
    loader,
    n: int,
    batch_size: int,
    pool: str,
    how: Extraction,
    acc,
    writer,
    source_key: str = "--source",
) -> FeatureTable | None:
    """Every process embeds its batch of round i (global batches iR .. iR + R - 1 of
    `predict_loader`'s `batch_size`); the main process appends them to `writer` (a
    `FeatureWriter`, None elsewhere) in source order. -> its `FeatureTable` (None elsewhere).
    A stalled source ends the job naming `source_key`; on any failure the partial features
    file is removed."""
    R, batches = acc.num_processes, num_batches_of(n, batch_size)
    bar = progress_bar(n, enabled=acc.is_main_process, desc="select", unit="img", every_s=30)
    it = iter(watched(loader, source_key))
    try:
        for i in range(math.ceil(batches / R)):
            g = i * R + acc.process_index  # the last round may leave some processes out
            batch = next(it) if g < batches else None
            first = g * batch_size
            part = None if batch is None else embed_batch(encoder, batch, how, pool, first)
            for p in gather_on_main(part, acc):
                writer.write(p)
                bar.update(len(p.names) + len(p.skipped))
    except BaseException:
        if writer is not None:
            writer.abort()  # no partial features file is left under the real name
        raise
    finally:
        bar.close()
    return writer.close() if writer is not None else None


class FeatureTable(NamedTuple):
    """What the feature pass leaves on the main process: `features.npy` (float16 [N, D], the
    readable images in source order, as a read-only memmap) and per row the image's name,
    global batch, source index (-1 when its batch had an unreadable image: resolve it from the
    batch) and content key; the skipped images' (name, reason)."""

    path: Path
    features: np.ndarray
    names: list[str]
    batch: np.ndarray
    index: np.ndarray
    keys: np.ndarray
    skipped: list[tuple[str, str]]

    def canonical(self) -> np.ndarray:
        """int64 [N]: the rows sorted by content key (then source order, for duplicates)."""
        return np.lexsort((np.arange(len(self.keys)), self.keys)).astype(np.int64)


class FeatureWriter:
    """Rows of `Embedded` parts, appended in the order written to `path`: a float16 .npy file
    (plain writes, so a full disk is an OSError naming it, never a SIGBUS of a memory map),
    written to a hidden sibling and renamed into place by `close`."""

    def __init__(self, path: Path, num_images: int, dim: int, meta: dict | None = None):
        self.path, self.dim, self.meta = Path(path), dim, meta
        need, free = num_images * dim * 2, shutil.disk_usage(self.path.parent).free
        if need > free:  # before any image is read, not after hours of features
            raise WriteError(
                errno.ENOSPC, f"cannot write {self.path}: {need / 1e9:.2f} GB for "
                f"{num_images} images x {dim} float16, {free / 1e9:.2f} GB free"
            )  # fmt: skip
        with writing(self.path):  # an earlier round's index no longer describes the features
            index_path(self.path).unlink(missing_ok=True)
        self._replacing = replacing(self.path)
        self.tmp = self._replacing.__enter__()  # left in `close` or `abort`
        self.file = open(self.tmp, "wb")
        with writing(self.path):  # the shape is rewritten by `close`: the same header length
            self.header_len = self.file.write(_npy_header((num_images, dim)))
        self.rows = 0
        self.names: list[str] = []
        self.skipped: list[tuple[str, str]] = []
        self._batch: list[np.ndarray] = []
        self._index: list[np.ndarray] = []
        self._keys: list[np.ndarray] = []

    def write(self, part: Embedded) -> None:
        n = len(part.names)
        bad = np.flatnonzero(~np.isfinite(part.features).all(axis=1))
        if len(bad):  # a float16 overflow or a diverged encoder: every distance would be NaN
            raise InputError(f"{self.path}: image {part.names[bad[0]]!r} has non-finite features")
        with writing(self.path):
            self.file.write(np.ascontiguousarray(part.features, dtype="<f2").tobytes())
        self.rows += n
        self.names += part.names
        self.skipped += part.skipped
        self._batch.append(np.full(n, part.index, dtype=np.int64))
        known = part.first + np.arange(n) if not part.skipped else np.full(n, -1)
        self._index.append(known.astype(np.int64))
        self._keys.append(part.keys.astype(np.int64))

    def close(self) -> FeatureTable:
        """The header's shape set to the rows written (NumPy pads a header so that its first
        axis may grow: the length stays), the file renamed into place and opened read-only."""
        with writing(self.path):
            header = _npy_header((self.rows, self.dim))
            self.file.seek(0)
            if len(header) != self.header_len:
                raise RuntimeError(f"{self.tmp}: the .npy header changed length")
            self.file.write(header)
            self.file.close()
        self._replacing.__exit__(None, None, None)  # fsync, rename into place
        cat = [np.concatenate(x) if x else np.zeros(0, np.int64) for x in
               (self._batch, self._index, self._keys)]  # fmt: skip
        empty = np.zeros((0, self.dim), np.float16)  # nothing readable: nothing to map
        features = np.load(self.path, mmap_mode="r") if self.rows else empty
        table = FeatureTable(self.path, features, self.names, *cat, self.skipped)
        if self.meta is not None:  # `meta`: what a later round must match to reuse them
            _write_index(table, self.meta)
        return table

    def abort(self) -> None:
        self.file.close()
        self._replacing.__exit__(RuntimeError, RuntimeError("aborted"), None)  # removes it


def choose(
    table: FeatureTable, method: str, budget: int, earlier: list[str], seed: int
) -> tuple[np.ndarray, np.ndarray, Picks]:
    """(the rows of the `earlier` picks' names, the new picks' rows in rank order, the
    method's `Picks`): the method runs on the L2-normalised features in content order
    (`FeatureTable.canonical`), so its picks depend on the images and the seed only."""
    wanted = set(earlier)
    where = {name: i for i, name in enumerate(table.names) if name in wanted}
    missing = [name for name in earlier if name not in where]
    if missing:
        raise InputError(
            f"earlier pick {missing[0]!r} (selection.jsonl) is not among the readable images "
            "of --source; select from the source of the earlier rounds, or --overwrite"
        )
    earlier_rows = np.asarray([where[name] for name in earlier], dtype=np.int64)
    order = table.canonical()
    place = np.empty_like(order)
    place[order] = np.arange(len(order))
    picks = select(method, normalised(table.features, order), budget, place[earlier_rows], seed)
    return earlier_rows, order[picks.rows], picks


def index_path(features: Path) -> Path:
    """features.npy -> features.index.npz: the rows' side of a feature pass."""
    return Path(features).with_name(Path(features).stem + ".index.npz")


def encoder_digest(encoder: torch.nn.Module) -> str:
    """SHA-1 of the encoder's weights: a checkpoint path can hold other weights next round."""
    h = hashlib.sha1()
    for name, t in sorted(encoder.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())  # (no copy)
    return h.hexdigest()


def _write_index(table: FeatureTable, meta: dict) -> None:
    """The index a later round reads (`reused_table`), after features.npy is in place: the
    writer removed the earlier one first, so an index always describes the features beside."""
    text = json.dumps({"meta": meta, "names": table.names, "skipped": table.skipped})
    with replacing(index_path(table.path)) as tmp, open(tmp, "wb") as f:
        np.savez(f, batch=table.batch, index=table.index, keys=table.keys,
                 json=np.frombuffer(text.encode(), dtype=np.uint8))  # fmt: skip


def reused_table(path: Path, meta: dict, names: list[str]) -> FeatureTable | None:
    """An earlier round's feature pass at `path`, when it was read with `meta` (encoder
    digest, source, readout, resolution, batch, precision, width) from images of the same
    `names` (the source's now; the same names are taken for the same images); else None."""
    index = index_path(path)
    if not (path.is_file() and index.is_file()):
        return None
    try:  # an unreadable or foreign index is no reason to stop: the pass runs again
        with np.load(index) as z:
            info = json.loads(z["json"].tobytes())
            batch, rows, keys = z["batch"], z["index"], z["keys"]
        features = np.load(path, mmap_mode="r")
    except (OSError, ValueError, KeyError, EOFError):
        return None
    if not isinstance(info, dict):
        return None
    read, skipped = info.get("names", []), [tuple(s) for s in info.get("skipped", [])]
    same = info.get("meta") == meta and features.dtype == np.float16
    same = same and features.shape == (len(read), meta["dim"]) == (len(keys), meta["dim"])
    if not same or sorted(read + [n for n, _ in skipped]) != sorted(names):
        return None
    return FeatureTable(path, features, read, batch, rows, keys, skipped)


def _npy_header(shape: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    descr = np.lib.format.dtype_to_descr(np.dtype(np.float16))
    np.lib.format.write_array_header_1_0(
        buf, {"descr": descr, "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()
