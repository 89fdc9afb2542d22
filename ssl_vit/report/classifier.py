"""Classifiers' confusion matrices and per-class accuracy, as data: the matrix a fine-tune
(pipelines/finetune.py) or a predict output directory (`ssl-vit predict`, when its source had
labels) wrote into results.json, row-normalised, and which of many fine-tunes the report draws.

`confusion_matrix` [[int]] is K x K, rows: true class, columns: predicted class, in the order
of `label_names`. matplotlib is not imported here (classifier_figures.py draws).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

from ssl_vit.jobs import PREDICT
from ssl_vit.report.budget import finetune_groups, scored
from ssl_vit.report.runs import Run

__all__ = [
    "Confusion",
    "chosen_runs",
    "confusion_of",
    "most_confused",
    "per_class_accuracy",
    "row_normalised",
    "top1_of",
    "worst_classes",
]

ALL_UP_TO = 4  # fine-tunes with a matrix: every one drawn up to this many,
GROUPS_UP_TO = 8  # else the best of each (encoder, label budget) group up to this many groups,
# else the best of each encoder.


class Confusion(NamedTuple):
    names: list[str]  # K class names
    counts: list[list[int]]  # [K][K], rows: true class, columns: predicted


def confusion_of(run: Run) -> Confusion | None:
    """The confusion matrix in a run's results.json; None when it has none. Its shape and
    counts were checked where the run was read (`checks.results_problem`)."""
    counts = run.results.get("confusion_matrix")
    if not counts:
        return None
    names = run.results.get("label_names") or list(run.results.get("per_class_top1") or [])
    return Confusion(names or [str(i) for i in range(len(counts))], counts)


def row_normalised(counts: list[list[int]]) -> list[list[float | None]]:
    """Each row over its sum: [i][j] is the fraction of class i's images predicted as j (a row
    sums to 1); a class with no images is a row of None."""
    return [[c / n for c in row] if (n := sum(row)) else [None] * len(row) for row in counts]


def per_class_accuracy(counts: list[list[int]]) -> list[float | None]:
    """The accuracy on each true class (diagonal over row sum); None for a class without
    images. The same as results.json's per_class_top1, recomputed from the matrix drawn."""
    return [row[i] / sum(row) if sum(row) else None for i, row in enumerate(counts)]


def top1_of(counts: list[list[int]]) -> float | None:
    """Accuracy over all images: the trace over the total; None without images."""
    total = sum(map(sum, counts))
    return sum(row[i] for i, row in enumerate(counts)) / total if total else None


def most_confused(counts: list[list[int]], n: int) -> list[tuple[int, int, int]]:
    """The `n` most frequent errors (true class i, predicted class j != i, images), most images
    first (ties: the larger share of class i, then i, j), in O(n) memory: one pass over the
    cells, never a K x K copy."""
    totals = [sum(row) for row in counts]
    cells = ((i, j, c) for i, row in enumerate(counts) for j, c in enumerate(row) if c and i != j)
    return heapq.nlargest(n, cells, key=lambda t: (t[2], t[2] / totals[t[0]], -t[0], -t[1]))


def worst_classes(counts: list[list[int]], n: int) -> list[tuple[int, float, int | None]]:
    """The `n` classes with images of the lowest accuracy, lowest first (ties: by index), as
    (class, accuracy, the class it is most often taken for, None when never wrong)."""
    acc = per_class_accuracy(counts)
    worst = heapq.nsmallest(n, (i for i, a in enumerate(acc) if a is not None), key=acc.__getitem__)

    def taken_for(i: int) -> int | None:
        j = max((j for j in range(len(counts)) if j != i), key=counts[i].__getitem__, default=None)
        return j if j is not None and counts[i][j] else None

    return [(i, acc[i], taken_for(i)) for i in worst]


def _best(runs: list[Run]) -> Run:
    return max(runs, key=lambda r: float(r.results["top1"]))


def chosen_runs(runs: list[Run]) -> tuple[list[Run], str]:
    """The runs whose confusion matrix the report draws, and which fine-tunes those are in
    words: every predict run with a matrix, then every fine-tune with one when they are few
    (ALL_UP_TO), else the best (top-1) of each (encoder, label budget) group, else of each
    encoder; in the groups' order (encoders by name, scratch last, budgets ascending)."""
    predicts = [r for r in runs if r.job is PREDICT and confusion_of(r)]
    fts = [r for r in scored(runs) if confusion_of(r)]
    groups = finetune_groups(fts)
    if len(fts) <= ALL_UP_TO:
        chosen = [r for members in groups.values() for r in members]
        how = "every fine-tune"
    elif len(groups) <= GROUPS_UP_TO:
        chosen = [_best(members) for members in groups.values()]
        how = "the best seed (top-1) of each encoder and label budget"
    else:
        by_encoder: dict[str, list[Run]] = {}
        for (enc, _), members in groups.items():
            by_encoder.setdefault(enc, []).extend(members)
        chosen = [_best(members) for members in by_encoder.values()]
        how = "the best run (top-1) of each encoder"
    if fts:
        how = f"Fine-tunes shown: {how} ({len(chosen)} of {len(fts)} with a confusion matrix)."
    return predicts + chosen, how if fts else ""
