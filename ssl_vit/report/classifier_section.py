"""The report's "Per-class accuracy" section: a confusion matrix and per-class accuracy figure
for each predict output directory with labels and for the fine-tunes classifier.chosen_runs
picks. Absent when no run has a confusion matrix and none is a predict run."""

from __future__ import annotations

from pathlib import Path

from ssl_vit.jobs import PREDICT
from ssl_vit.report.budget import budget_of, encoder_name, is_picked
from ssl_vit.report.classifier import (
    Confusion,
    chosen_runs,
    confusion_of,
    most_confused,
    worst_classes,
)
from ssl_vit.report.render import Section, Table
from ssl_vit.report.runs import Run

__all__ = ["MAP_UP_TO", "TOP_N", "classifier_section"]

# Classes drawn as a heat map: up to 50 the map stays within its 8-in side with cells of at
# least 0.16 in (17 px at the report's 110 dpi) and at least every second name on its axes.
# Above, a cell shrinks to a few pixels and most names go unlabelled, and from 100 classes on
# the figure's pixels grow with K^2 (1,000 classes: an 80-inch map took 3.9 GB and 55 s; 3,000
# tried to allocate a 4.8 GiB array for one resampling step, issue 47 #8): the most confused
# pairs and the worst classes say which classes are confused, in tables of a fixed size.
MAP_UP_TO = 50
TOP_N = 20  # rows of each of those tables

READING = (
    "Each figure, left: rows are the true classes, each normalised to 100 % (a cell: the % of "
    "that class's images predicted as the column's class; blank: none; grey: no images of the "
    "class). Right: accuracy on each class (the diagonal), correct / images; dashed: top-1."
)
MANY = (
    f"A classifier of more than {MAP_UP_TO} classes is listed, not drawn: its {TOP_N} most "
    "confused pairs (images of the true class predicted as the other; %: of the true class's "
    f"images) and its {TOP_N} classes of lowest accuracy, with the class each is most often "
    "taken for."
)


def _what(run: Run) -> tuple[str, str]:
    """(figure title, caption start) of a run: what was evaluated on what."""
    top1 = run.results.get("top1")
    score = f", top-1 {100 * top1:.1f}%" if isinstance(top1, int | float) else ""
    r = run.results
    left_out = r.get("classes_left_out") or r.get("eval_classes_left_out")
    scored = sum(map(sum, r.get("confusion_matrix") or []))
    # images of classes the classifier does not have: not in top-1 (the `scored` ones are)
    lacking = left_out and (
        f"{scored} scored, the classes {', '.join(left_out)} left out: the classifier has no "
        "such class"
    )
    if run.job is PREDICT:
        return (
            f"{run.name}: predictions on {Path(str(r.get('source', '?'))).name}{score}",
            f"{run.name}: `ssl-vit predict` of {r.get('checkpoint', '?')} on "
            f"{r.get('source', '?')} ({r.get('images', '?')} images, {r.get('skipped', 0)} "
            f"skipped{f'; {lacking}' if lacking else ''}).",
        )
    seed = r.get("seed", run.config.get("seed", "?"))
    where = f"{encoder_name(run)}, {_labels(run)}seed {seed}"
    on = f"its data.eval ({lacking})" if lacking else "its data.eval"
    return f"{run.name} ({where}){score}", f"{run.name}: fine-tune of {where}, on {on}."


def _labels(run: Run) -> str:
    """What a fine-tune was trained on: "10 labels / class, ", "every label (6,000 images), ",
    "" for picked labels (the encoder's name says "[100 labels by typiclust]")."""
    if k := budget_of(run):
        return f"{k} labels / class, "
    if is_picked(run):
        return ""
    n = run.results.get("num_labelled")
    return f"every label ({n:,} images), " if isinstance(n, int) else "every label, "


def _unlabelled(runs: list[Run]) -> list[str]:
    """Notes for the predict runs without a matrix (their source had no labels)."""
    return [
        f"{r.name}: {r.results.get('images', '?')} images predicted from "
        f"{r.results.get('source', '?')} without labels: no accuracy to show."
        for r in runs
        if r.job is PREDICT and r.finished and confusion_of(r) is None
    ]


def _listed(conf: Confusion, title: str, caption: str) -> list[Table]:
    """A classifier of many classes as two tables: its TOP_N most confused pairs (true class,
    predicted class, images, % of the true class's images), its TOP_N worst classes."""
    totals = [sum(row) for row in conf.counts]
    pairs = [
        [conf.names[i], conf.names[j], str(c), f"{100 * c / totals[i]:.0f}%"]
        for i, j, c in most_confused(conf.counts, TOP_N)
    ]
    worst = [
        [
            conf.names[i],
            f"{100 * acc:.1f}",
            f"{conf.counts[i][i]} / {totals[i]}",
            "-" if j is None else f"{conf.names[j]} ({100 * conf.counts[i][j] / totals[i]:.0f}%)",
        ]
        for i, acc, j in worst_classes(conf.counts, TOP_N)
    ]
    K = len(conf.names)
    return [
        Table(
            ["true class", "predicted as", "images", "% of the true class"],
            pairs,
            f"{title}. {caption} The {len(pairs)} most confused pairs of its {K} classes:",
        ),
        Table(
            ["class", "accuracy (%)", "correct / images", "most often taken for"],
            worst,
            f"{title}: the {len(worst)} classes of lowest accuracy of its {K}:",
        ),
    ]


def _draw(s: Section, drawn: list[tuple[Run, Confusion]]) -> None:
    """A confusion figure per run (heat map and accuracy bars) into `s`."""
    try:
        from ssl_vit.report.classifier_figures import confusion_figure
    except ImportError as e:  # matplotlib is the `report` extra
        s.notes.append(f"figures skipped: {e}; install it with: pip install 'ssl-vit[report]'")
        return
    names = set()
    for run, conf in drawn:
        title, caption = _what(run)
        name = f"confusion_{run.name}"
        while name in names:  # runs of one name in several folders
            name += "_"
        names.add(name)
        s.chart(name, confusion_figure(conf, title), caption)


def classifier_section(runs: list[Run]) -> Section | None:
    """The "Per-class accuracy" section: a figure per chosen run of at most MAP_UP_TO classes,
    two tables per larger one, notes for the rest; None when no run has a confusion matrix and
    none is a predict run (the report is as before)."""
    chosen, how = chosen_runs(runs)
    unlabelled = _unlabelled(runs)
    if not chosen and not unlabelled:
        return None
    confs = [(run, confusion_of(run)) for run in chosen]
    drawn = [(run, conf) for run, conf in confs if len(conf.names) <= MAP_UP_TO]
    listed = [(run, conf) for run, conf in confs if len(conf.names) > MAP_UP_TO]
    notes = [READING] * bool(drawn or not listed) + [MANY] * bool(listed)
    s = Section("Per-class accuracy", notes=[n for n in [*notes, how, *unlabelled] if n])
    for run, conf in listed:
        s.tables += _listed(conf, *_what(run))
    if drawn:
        _draw(s, drawn)
    return s
