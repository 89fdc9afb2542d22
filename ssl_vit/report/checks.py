"""What the report reads from a run directory, checked once, where it is read (`runs.load_runs`),
so that every section gets clean data (issue 47 #12).

No job writes a results.json that is not a JSON object, a count that is a string, NaN or
negative, a fraction outside [0, 1], a confusion matrix that is not K x K for its K label names,
a few-shot table without its means, a metrics.jsonl row that is not an object or plots a
string, or a predictions file cut short (not one row per image of results.json). Each
`*_problem` says what is wrong in words (None: nothing); the reader (`runs.load_runs`) logs one
line "FILE: what is wrong" (a `DamagedRunError`) and leaves the run out of the report.
"""

from __future__ import annotations

import csv
import math
import reprlib
from pathlib import Path
from typing import Any

from ssl_vit.errors import InputError
from ssl_vit.eval.shots import ALL_SHOTS

__all__ = ["DamagedRunError", "json_type", "predictions_problem", "results_problem", "rows_problem"]

COUNTS = ("step", "images", "skipped", "num_labelled", "num_classes", "labels_per_class")
FRACTIONS = ("top1", "top1_ema")
SECONDS = ("wall_time_s",)
PLOTTED = ("loss", "color_acc", "color_acc_majority", "top1", "knn/top1")  # and fewshot/*
_SHOWN = reprlib.Repr()  # a value in a message: short, however large (a 9M-cell matrix)
_SHOWN.maxstring = _SHOWN.maxother = 40
_SHOWN.maxlist = _SHOWN.maxdict = 4
_SHOWN.maxlevel = 2


class DamagedRunError(InputError):
    """A run directory's file that no job writes; the message: "FILE: what is wrong"."""


class _ProblemError(Exception):
    """What is wrong in a file, in words (the `*_problem` functions return it)."""


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type: "array", "string", "number", ..."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _is_count(v: Any) -> bool:
    return type(v) is int and v >= 0  # `type`: true / false are no counts


def _is_number(v: Any) -> bool:
    return type(v) in (int, float)


def _count(v: Any, where: str) -> None:
    if not _is_count(v):
        raise _ProblemError(f"{where} is {_SHOWN.repr(v)}, not a count")


def _fraction(v: Any, where: str) -> None:
    if not (_is_number(v) and 0 <= v <= 1):  # NaN fails both comparisons
        raise _ProblemError(f"{where} is {_SHOWN.repr(v)}, not a fraction in [0, 1]")


def _seconds(v: Any, where: str) -> None:
    if not (_is_number(v) and 0 <= v < math.inf):
        raise _ProblemError(f"{where} is {_SHOWN.repr(v)}, not a duration in seconds")


def _labels(results: dict[str, Any]) -> None:
    names = results.get("label_names")
    if names is not None and not (isinstance(names, list) and all(type(n) is str for n in names)):
        raise _ProblemError(f"label_names is {_SHOWN.repr(names)}, not a list of names")
    per_class = results.get("per_class_top1")
    if per_class is None:
        return
    if not isinstance(per_class, dict):
        raise _ProblemError(f"per_class_top1 is a JSON {json_type(per_class)}, not an object")
    for name, acc in per_class.items():
        if acc is not None:
            _fraction(acc, f"per_class_top1[{name!r}]")


def _matrix(results: dict[str, Any]) -> None:
    """confusion_matrix: K rows of K counts, K the number of label_names (per_class_top1)."""
    m = results.get("confusion_matrix")
    if m is None or m == []:
        return
    if not (isinstance(m, list) and all(isinstance(row, list) for row in m)):
        raise _ProblemError(f"confusion_matrix is {_SHOWN.repr(m)}, not a list of rows")
    K = len(m)
    for key in ("label_names", "per_class_top1"):
        if (names := results.get(key)) and len(names) != K:
            raise _ProblemError(f"confusion_matrix has {K} rows for {len(names)} {key}")
    for i, row in enumerate(m):
        if len(row) != K:
            raise _ProblemError(f"confusion_matrix row {i} has {len(row)} columns, not {K}")
        if row and not (set(map(type, row)) == {int} and min(row) >= 0):  # C loops: fast
            j = next(j for j, c in enumerate(row) if not _is_count(c))
            _count(row[j], f"confusion_matrix[{i}][{j}]")


def _mean_std(entry: Any, where: str) -> None:
    """A few-shot cell {"mean", "std", "per_seed"} (accuracies)."""
    if not isinstance(entry, dict):
        raise _ProblemError(f"{where} is {_SHOWN.repr(entry)}, not an object")
    _fraction(entry.get("mean"), f"{where}.mean")
    if entry.get("std") is not None:
        _fraction(entry["std"], f"{where}.std")
    for s, acc in enumerate(entry.get("per_seed") or []):
        _fraction(acc, f"{where}.per_seed[{s}]")


def _shot_counts(table: Any, where: str) -> dict:
    if not isinstance(table, dict):
        raise _ProblemError(f"{where} is a JSON {json_type(table)}, not an object")
    for k in table:
        if k != ALL_SHOTS and not str(k).isdigit():
            raise _ProblemError(f"{where} has the shot count {k!r}")
    return table


def _shots(table: Any, where: str) -> None:
    """A few-shot job's {shots: {"l2_reg": {reg: {"mean", "std", "per_seed"}}}}."""
    for k, entry in _shot_counts(table, where).items():
        regs = entry.get("l2_reg") if isinstance(entry, dict) else None
        if not isinstance(regs, dict):
            raise _ProblemError(f"{where}[{k}] has no l2_reg table")
        for reg, cell in regs.items():
            try:
                float(reg)
            except ValueError:
                raise _ProblemError(
                    f"{where}[{k}].l2_reg has the key {reg!r}, not a number"
                ) from None
            _mean_std(cell, f"{where}[{k}].l2_reg[{reg}]")


def _layers(layers: Any) -> None:
    """A few-shot job's per-layer table {"depth", "readouts": {name: {"layers", "pool",
    "shots": {k: {"mean", ...}}}}} (`fewshot.layers=all`)."""
    if not isinstance(layers, dict) or not isinstance(layers.get("readouts"), dict):
        raise _ProblemError(f"layers is {_SHOWN.repr(layers)}, not a per-layer table")
    _count(layers.get("depth"), "layers.depth")
    for name, r in layers["readouts"].items():
        where = f"layers.readouts[{name!r}]"
        if not (isinstance(r, dict) and isinstance(r.get("pool"), str)):
            raise _ProblemError(f"{where} is {_SHOWN.repr(r)}, not a readout with its pool")
        blocks = r.get("layers")
        if not (isinstance(blocks, list) and blocks and all(map(_is_count, blocks))):
            raise _ProblemError(f"{where}.layers is {_SHOWN.repr(blocks)}, not a list of blocks")
        for k, cell in _shot_counts(r.get("shots"), f"{where}.shots").items():
            _mean_std(cell, f"{where}.shots[{k}]")


def results_problem(results: Any) -> str | None:
    """What is wrong with a parsed results.json, in words; None if the report can use it."""
    if not isinstance(results, dict):
        return f"a JSON {json_type(results)}, not an object"
    try:
        for keys, check in ((COUNTS, _count), (FRACTIONS, _fraction), (SECONDS, _seconds)):
            for key in keys:
                if results.get(key) is not None:  # null: not known (e.g. top1 without labels)
                    check(results[key], key)
        _labels(results)
        _matrix(results)
        if results.get("shots") is not None:  # a few-shot run's
            _shots(results["shots"], "shots")
        if (fewshot := results.get("fewshot")) is not None:  # logged in pretraining
            if not isinstance(fewshot, dict):
                raise _ProblemError(f"fewshot is a JSON {json_type(fewshot)}, not an object")
            if fewshot.get("shots") is not None:
                _shots(fewshot["shots"], "fewshot.shots")
        if results.get("layers"):
            _layers(results["layers"])
    except _ProblemError as e:
        return str(e)
    return None


def rows_problem(rows: list[Any]) -> str | None:
    """What is wrong with metrics.jsonl's rows (parsed), in words; None if the report can use
    them. A plotted value may be NaN (a diverged loss is a measurement), not a string."""
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            return f"row {i} is a JSON {json_type(row)}, not an object"
        if row.get("step") is not None and not _is_count(row["step"]):
            return f"row {i}: step is {_SHOWN.repr(row['step'])}, not a count"
        for key, v in row.items():
            plotted = key in PLOTTED or key.startswith("fewshot/")
            if plotted and v is not None and not _is_number(v):
                return f"row {i}: {key} is {_SHOWN.repr(v)}, not a number"
    return None


def _rows_in(path: Path) -> tuple[int, bool]:
    """(rows, whether the file ends with a newline) of a predictions file, read in chunks."""
    if path.suffix == ".csv":  # a quoted key may hold a newline: the csv module counts rows
        with open(path, newline="") as f:
            rows = sum(1 for _ in csv.reader(f)) - 1  # the header
    with open(path, "rb") as f:
        n, last = 0, b"\n"
        while chunk := f.read(1 << 20):
            n, last = n + chunk.count(b"\n"), chunk[-1:]
    return (rows if path.suffix == ".csv" else n), last == b"\n"


def predictions_problem(folder: Path, images: Any) -> tuple[Path, str] | None:
    """(file, what is wrong) of a predict output directory's predictions.jsonl / .csv: cut
    short (a last line without its newline) or not one row per image of results.json."""
    for path in (folder / "predictions.jsonl", folder / "predictions.csv"):
        if not path.is_file():
            continue
        rows, complete = _rows_in(path)
        if not complete:
            return path, "its last line is cut short (no newline at its end)"
        if type(images) is int and rows != images:
            return path, f"{rows} row(s) for the {images} images of results.json"
    return None
