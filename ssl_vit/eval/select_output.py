"""Where `ssl-vit select` writes, and how a selection grows in rounds.

The output directory holds `config.yaml`, `features.npy`, `selection.jsonl` (one row per
pick, by rank), `to-label/` (a copy of each pick, `0001-<name>`), `metrics.jsonl` (a row per
round) and `results.json`. Running again into the same directory with a larger `--budget` is
the next round: the picks of `selection.jsonl` stay the first ranks, new ones follow, and only
their copies are added to `to-label/` (where the user may already have sorted the earlier ones
into class folders: nothing there is moved or removed). `--overwrite` starts over, and removes
only what select wrote: it refuses while `to-label/` holds anything else (the user's labels).

Writes, in this order, each atomic: selection.jsonl, the copies (a killed round leaves copies
that the rows name, completed by the next run), results.json.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ssl_vit import jobs
from ssl_vit.atomic import write_bytes, write_text
from ssl_vit.config import ConfigError
from ssl_vit.config.loader import save_config
from ssl_vit.data.image_source import ImageSource, Record
from ssl_vit.data.sources import FolderSource
from ssl_vit.eval.select_features import FeatureTable
from ssl_vit.eval.selection import Picks
from ssl_vit.jsonfile import dump_json, parse_json
from ssl_vit.runs.lock import RunLock, lock_run_dir, on_main
from ssl_vit.runs.occupancy import check_not_source, occupant, saved_job

__all__ = [
    "FEATURES",
    "SELECTION",
    "TO_LABEL",
    "check_output",
    "claim_output_on_main",
    "copy_picks",
    "label_file",
    "read_selection",
    "selection_rows",
    "source_indices",
    "source_names",
    "source_path",
    "write_selection",
]

log = logging.getLogger(__name__)
_WRITES = jobs.SELECT.writes  # config.yaml, metrics.jsonl, results.json and:
SELECTION, FEATURES, TO_LABEL = _WRITES[-3:]  # selection.jsonl, features.npy, to-label
_ROW_KEYS = ("rank", "key", "round")  # what a round reads back of an earlier row


def check_output(out: Path, overwrite: bool, reads: dict[str, str]) -> list[dict[str, Any]]:
    """The earlier picks to keep (rows of `out`'s selection.jsonl; [] for a new selection or
    with `overwrite`). ConfigError: `out` holds another job's run, a checkpoint or a dataset,
    or a file of a name select writes (config.yaml, to-label/, ...) but no selection; with
    `overwrite`, files in to-label/ that select did not write, or `out` is, holds or lies in
    one of `reads` (the checkpoint, the source)."""
    job = saved_job(out)
    if job is not jobs.SELECT:
        what = f"holds a {job.title} run" if job else occupant(out)
        ours = [n for n in _WRITES if (out / n).exists()]  # never replaced unless select's
        if what is None and ours:
            what = f"holds {ours[0]} of no selection"
        if what is not None:
            raise ConfigError(f"--output {out}: {what}; write the selection to a folder of its own")
        return []
    if overwrite:
        check_not_source("--output", out, reads)
        _own_copies(out)  # refuses files of the user's
        return []
    return read_selection(out)


def read_selection(out: Path) -> list[dict[str, Any]]:
    """The rows of `out`/selection.jsonl ([] when there is none), ranks 1..n in order."""
    path = out / SELECTION
    if not path.is_file():
        return []
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        row = parse_json(line, f"{path}:{i}")
        missing = [k for k in _ROW_KEYS if k not in row]
        if missing or row["rank"] != i:
            raise ConfigError(f"{path}:{i}: not a selection row (rank {i} with {_ROW_KEYS})")
        rows.append(row)
    return rows


def _own_copies(out: Path) -> list[Path]:
    """The files of to-label/ that the selection's rows name; ConfigError if it holds more."""
    folder = out / TO_LABEL
    if not folder.is_dir():
        return []
    named = {row.get("file") for row in read_selection(out)}
    entries = sorted(folder.iterdir())
    other = [p.name for p in entries if f"{TO_LABEL}/{p.name}" not in named or not p.is_file()]
    if other:
        shown = ", ".join(other[:4]) + (", ..." if len(other) > 4 else "")
        raise ConfigError(
            f"--output {out}: {TO_LABEL}/ holds {shown} besides the copies select made (your "
            "labels?); move them elsewhere before --overwrite, or pick another --output"
        )
    return entries


def claim_output_on_main(acc, out: Path, cfg: Any, overwrite: bool) -> RunLock | None:
    """The main process locks `out`, removes the earlier selection with `overwrite` (what
    select wrote, and nothing else) and writes config.yaml; every process learns whether it
    could (`runtime.on_main`, as for a run directory)."""

    def claim() -> RunLock:
        lock = lock_run_dir(out, key="--output")
        try:
            if overwrite:
                _remove_earlier(out)
            save_config(cfg, out / "config.yaml")  # atomic
        except BaseException:
            lock.release()
            raise
        return lock

    return on_main(acc, claim)


def _remove_earlier(out: Path) -> None:
    """What select wrote in `out` (`check_output` found nothing else among those names)."""
    copies = _own_copies(out)
    if copies or (out / SELECTION).exists():
        log.warning("--overwrite: removing the earlier selection in %s", out)
    for p in [*copies, *(out / n for n in _WRITES if n != TO_LABEL)]:
        p.unlink(missing_ok=True)
    if (out / TO_LABEL).is_dir():
        (out / TO_LABEL).rmdir()  # empty: _own_copies refused anything else


def source_names(source: ImageSource) -> list[str]:
    """Every image's name (predictions' `key`: a folder's relative path, else the sample key),
    in source order, without reading images (a shard source reads its tar headers)."""
    return [source.name(Record(i, k, "", b"", -1)) for i, k in enumerate(source.sample_keys())]


def source_path(source: ImageSource, name: str, index: int) -> str:
    """Where an image comes from: a folder's file path, else the source and sample index."""
    if isinstance(source, FolderSource):
        return str(source.root / name)
    return source.describe(index)


def label_file(rank: int, width: int, name: str, ext: str) -> str:
    """`to-label/0001-<file name>`: unique, sorted by rank; the extension added if missing."""
    base = Path(name).name or "image"
    if ext and not base.lower().endswith(f".{ext.lower()}"):
        base = f"{base}.{ext}"
    return f"{TO_LABEL}/{rank:0{width}d}-{base}"


def write_selection(out: Path, rows: list[dict[str, Any]]) -> Path:
    """selection.jsonl, strict JSON (a NaN typicality as null), replaced atomically."""
    path = out / SELECTION
    write_text(path, "".join(dump_json(r, str(path), nan_as_null=True) + "\n" for r in rows))
    return path


def copy_picks(source: ImageSource, out: Path, rows: list[dict[str, Any]]) -> int:
    """Copy each row's image to its `file` (the encoded bytes as the source holds them) unless
    a file of that name is already anywhere under to-label/ (a copy of an earlier round, maybe
    moved into a class folder). Returns the number of files written."""
    folder = out / TO_LABEL
    folder.mkdir(parents=True, exist_ok=True)
    present = {p.name for p in folder.rglob("*")}
    wanted = {r["index"]: r["file"] for r in rows if r.get("file")}
    wanted = {i: f for i, f in wanted.items() if Path(f).name not in present}
    for rec in source.iter_records(sorted(wanted)):
        write_bytes(out / wanted[rec.index], rec.data)  # atomic: no partial image
    return len(wanted)


def pick_extensions(source: ImageSource, indices: list[int]) -> dict[int, str]:
    """{source index: image extension} of the picks (a folder's from the file name)."""
    if isinstance(source, FolderSource):
        return {i: Path(source.files[i]).suffix[1:] for i in indices}
    return {rec.index: rec.ext for rec in source.iter_records(sorted(indices))}


def selection_rows(
    table: FeatureTable,
    source: ImageSource,
    earlier: list[dict[str, Any]],
    rows: tuple[np.ndarray, np.ndarray],
    picks: Picks,
    *,
    method: str,
    batch_size: int,
    copy: bool,
) -> list[dict[str, Any]]:
    """selection.jsonl's rows: the `earlier` ones first (as their round wrote them, with this
    run's feature row, source index and path, and a `file` if they had none), then the new
    picks `rows[1]` of `picks`, ranked on. `rows`: (earlier picks' rows, new picks' rows) of
    `table`; `file` is the to-label/ copy's name (None without `copy`)."""
    table_rows = np.concatenate(rows)
    index = source_indices(table, table_rows, source, batch_size)
    ext = pick_extensions(source, index.tolist()) if copy else {}
    width = max(4, len(str(len(table_rows))))
    rnd = max((int(r["round"]) for r in earlier), default=0) + 1
    out = []
    for rank, (r, i) in enumerate(zip(table_rows.tolist(), index.tolist(), strict=True), 1):
        name = table.names[r]
        row = dict(earlier[rank - 1]) if rank <= len(earlier) else {"rank": rank, "round": rnd}
        if rank > len(earlier):
            j = rank - len(earlier) - 1
            row.update(key=name, method=method, cluster=None, cluster_size=None, typicality=None)
            if picks.cluster is not None:
                row.update(cluster=int(picks.cluster[j]), cluster_size=int(picks.cluster_size[j]),
                           typicality=float(picks.typicality[j]))  # fmt: skip
        row.update(index=i, row=r, path=source_path(source, name, i))
        if not row.get("file"):
            row["file"] = label_file(rank, width, name, ext[i]) if copy else None
        out.append(row)
    return out


def source_indices(
    table: FeatureTable, rows: np.ndarray, source: ImageSource, batch_size: int
) -> np.ndarray:
    """int64: the source index of each of `rows`. Known from its place in its batch unless an
    image of that batch was unreadable: then the batch's readable names are matched, in order,
    to the source's names of the batch (`source_names`, read once)."""
    index = table.index[rows].copy()
    names = None
    for j in np.flatnonzero(index < 0).tolist():
        g = int(table.batch[rows[j]])
        names = source_names(source) if names is None else names
        lo = g * batch_size
        readable = np.flatnonzero(table.batch == g)
        k = 0
        for r in readable.tolist():  # the readable images are a subsequence of the batch's
            while names[lo + k] != table.names[r]:
                k += 1
            if r == rows[j]:
                break
            k += 1
        index[j] = lo + k
    return index
