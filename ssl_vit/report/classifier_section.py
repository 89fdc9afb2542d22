"""The report's "Per-class accuracy" section: a confusion matrix and per-class accuracy figure
for each predict output directory with labels and for the fine-tunes classifier.chosen_runs
picks. Absent when no run has a confusion matrix and none is a predict run."""

from __future__ import annotations

from pathlib import Path

from ssl_vit.report.budget import all_labels_per_class, budget_label, budget_of, encoder_name
from ssl_vit.report.classifier import chosen_runs, confusion_of
from ssl_vit.report.render import Section
from ssl_vit.report.runs import Run

__all__ = ["classifier_section"]

READING = (
    "Each figure, left: rows are the true classes, each normalised to 100 % (a cell: the % of "
    "that class's images predicted as the column's class; blank: none; grey: no images of the "
    "class). Right: accuracy on each class (the diagonal), correct / images; dashed: top-1."
)


def _what(run: Run, x_all: float | None) -> tuple[str, str]:
    """(figure title, caption start) of a run: what was evaluated on what."""
    top1 = run.results.get("top1")
    score = f", top-1 {100 * top1:.1f}%" if isinstance(top1, int | float) else ""
    if run.kind == "predict":
        r = run.results
        return (
            f"{run.name}: predictions on {Path(str(r.get('source', '?'))).name}{score}",
            f"{run.name}: `ssl-vit predict` of {r.get('checkpoint', '?')} on "
            f"{r.get('source', '?')} ({r.get('images', '?')} images, {r.get('skipped', 0)} "
            "skipped).",
        )
    budget = f"{budget_label(budget_of(run), x_all)} labels / class"
    seed = run.results.get("seed", run.config.get("seed", "?"))
    where = f"{encoder_name(run)}, {budget}, seed {seed}"
    return f"{run.name} ({where}){score}", f"{run.name}: fine-tune of {where}, on its data.eval."


def _unlabelled(runs: list[Run]) -> list[str]:
    """Notes for the predict runs without a matrix (their source had no labels)."""
    return [
        f"{r.name}: {r.results.get('images', '?')} images predicted from "
        f"{r.results.get('source', '?')} without labels: no accuracy to show."
        for r in runs
        if r.kind == "predict" and r.finished and confusion_of(r) is None
    ]


def classifier_section(runs: list[Run]) -> Section | None:
    """The "Per-class accuracy" section: a figure per chosen run, notes for the rest; None
    when no run has a confusion matrix and none is a predict run (the report is as before)."""
    chosen, how = chosen_runs(runs)
    unlabelled = _unlabelled(runs)
    if not chosen and not unlabelled:
        return None
    s = Section("Per-class accuracy", notes=[n for n in [READING, how, *unlabelled] if n])
    try:
        from ssl_vit.report.classifier_figures import confusion_figure
    except ImportError as e:  # matplotlib is the `report` extra
        s.notes.append(f"figures skipped: {e}; install it with: pip install 'ssl-vit[report]'")
        return s
    x_all, names = all_labels_per_class(runs), set()
    for run in chosen:
        title, caption = _what(run, x_all)
        name = f"confusion_{run.name}"
        while name in names:  # runs of one name in several folders
            name += "_"
        names.add(name)
        s.chart(name, confusion_figure(confusion_of(run), title), caption)
    return s
