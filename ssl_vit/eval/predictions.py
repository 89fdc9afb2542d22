"""What `ssl-vit predict` does per batch and per row: the classifier's top-k on the device, the
rows gathered to the main process, and one writer for predictions.jsonl / predictions.csv
(streamed to a hidden sibling, renamed into place when complete). Rows are strict JSON: a
non-finite score (a classifier whose output overflowed) stops the writer with one line naming
the image, never a bare `NaN` in the file."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ssl_vit.atomic import replacing, writing
from ssl_vit.data.predict_stream import PredictBatch
from ssl_vit.jsonfile import dump_json

__all__ = ["Predicted", "PredictionWriter", "gather_on_main", "predict_batch"]


class Predicted(NamedTuple):
    """One global batch's predictions, on the host: top-k class indices and probabilities."""

    index: int
    names: list[str]
    labels: list[int]  # -1: none
    top_idx: list[list[int]]
    top_p: list[list[float]]
    skipped: list[tuple[str, str]]


@torch.no_grad()
def predict_batch(model, batch: PredictBatch, k: int, device, autocast) -> Predicted:
    """The softmax's top-k of `model` (a classifier taking uint8 images) on `batch`."""
    if len(batch.names):
        with autocast():
            logits = model(batch.images.to(device, non_blocking=True))
        p, idx = logits.float().softmax(dim=-1).topk(k, dim=-1)
        top_idx, top_p = idx.tolist(), p.tolist()  # the host needs them to write the rows
    else:
        top_idx, top_p = [], []
    labels = batch.labels.tolist()
    return Predicted(batch.index, batch.names, labels, top_idx, top_p, batch.skipped)


def gather_on_main(part: Predicted | None, acc) -> list[Predicted]:
    """Every process's batch of this round, in process (= source) order, on the main process
    ([] elsewhere); None: a process with no batch left in the last round."""
    if acc.num_processes == 1:
        return [part] if part is not None else []
    import torch.distributed as dist

    parts: list[Any] | None = [None] * acc.num_processes if acc.is_main_process else None
    dist.gather_object(part, parts, dst=0)
    return [p for p in parts or [] if p is not None]


class PredictionWriter:
    """Rows {key, label, score, top_k [[name, p], ...]} (+ true_label for a labelled source)
    to `folder/predictions.{jsonl,csv}`, written to a hidden sibling and renamed into place
    by `close` (`atomic.replacing`); `abort` removes the partial file."""

    def __init__(self, folder: Path, fmt: str, label_names: list[str], labelled: bool):
        self.path = Path(folder) / f"predictions.{fmt}"
        self._replacing = replacing(self.path)
        self.tmp = self._replacing.__enter__()  # left in `close` or `abort`
        self.names, self.labelled, self.fmt = label_names, labelled, fmt
        self.file = open(self.tmp, "w", newline="")
        self.csv = csv.writer(self.file) if fmt == "csv" else None
        if self.csv is not None:
            self.csv.writerow(["key", "label", "score", "top_k"] + ["true_label"] * labelled)

    def write(self, part: Predicted) -> None:
        with writing(self.path):
            for name, label, idx, p in zip(
                part.names, part.labels, part.top_idx, part.top_p, strict=True
            ):
                top = [[self.names[i], round(q, 6)] for i, q in zip(idx, p, strict=True)]
                row = {"key": name, "label": top[0][0], "score": top[0][1], "top_k": top}
                if self.labelled:
                    row["true_label"] = self.names[label] if label >= 0 else None
                self._write_row(row)

    def _write_row(self, row: dict[str, Any]) -> None:
        line = dump_json(row, f"{self.path}: image {row['key']!r}")  # NaN: one line, no row
        if self.csv is None:
            self.file.write(line + "\n")
        else:
            cells = [row["key"], row["label"], row["score"], dump_json(row["top_k"], "")]
            self.csv.writerow(cells + ([row["true_label"]] if self.labelled else []))

    def close(self) -> Path:
        with writing(self.path):
            self.file.close()
        self._replacing.__exit__(None, None, None)  # fsync, rename into place
        return self.path

    def abort(self) -> None:
        self.file.close()
        self._replacing.__exit__(RuntimeError, RuntimeError("aborted"), None)  # removes it
