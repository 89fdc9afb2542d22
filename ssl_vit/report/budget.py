"""The label-budget section: fine-tune top-1 against labelled images per class, one line per
encoder (`data.labels_per_class`, issue 27). matplotlib is imported only to draw the figure.

A fine-tune's results.json names its budget K (`labels_per_class`, 0: every label), the
images it trained on (`num_labelled`) and `num_classes`; K = 0 is drawn at num_labelled /
num_classes. Runs from before the budget existed count as K = 0 and are left out when they
do not say how many images they used.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

from ssl_vit.report.render import Chart, Section, Table, png_bytes
from ssl_vit.report.runs import Run, fewshot_table, run_dir_of, source_checkpoint

__all__ = [
    "SCRATCH",
    "all_labels_per_class",
    "budget_label",
    "budget_section",
    "budget_table",
    "encoder_name",
    "labels_curves",
    "spread",
]

log = logging.getLogger(__name__)
SCRATCH = "scratch"  # the random-init encoder's line
Curves = dict[str, dict[int, list[float]]]  # {encoder: {K: [top1 of each seed]}}


def encoder_name(run: Run) -> str:
    """The encoder a fine-tune / few-shot run started from: "scratch" for random init, else
    the pretraining run directory holding its checkpoint (every step of one pretraining run is
    one encoder), else the checkpoint as written."""
    ckpt = source_checkpoint(run)
    if ckpt is None:
        return SCRATCH
    run_dir = run_dir_of(ckpt)
    if run_dir is None and (Path(ckpt) / "checkpoints").is_dir():  # init: a run directory
        run_dir = Path(ckpt)
    return run_dir.name if run_dir is not None else ckpt


def _budget(run: Run) -> int:
    """K of a fine-tune (0: every label; runs from before the budget: 0)."""
    k = run.results.get("labels_per_class")
    return int(k if k is not None else (run.config.get("data") or {}).get("labels_per_class", 0))


def _budget_order(k: int) -> tuple[bool, int]:
    """Sort key of budgets: K ascending, then 0 (every label, the most)."""
    return k == 0, k


def _scored(runs: list[Run]) -> list[Run]:
    """The finished fine-tunes with a top-1."""
    ok = (int, float)
    return [r for r in runs if r.kind == "finetune" and isinstance(r.results.get("top1"), ok)]


def _per_class(run: Run) -> float | None:
    """num_labelled / num_classes of a run; None when either is unknown."""
    n, c = run.results.get("num_labelled"), run.results.get("num_classes")
    return n / c if n and c else None


def labels_curves(runs: list[Run]) -> Curves:
    """{encoder: {K: [top1, one per run (seed)]}} of the finished fine-tunes, K ascending and
    0 (every label) last; a K = 0 run whose num_labelled / num_classes is unknown is left out."""
    curves: Curves = {}
    points = [r for r in _scored(runs) if _budget(r) or _per_class(r) is not None]
    # Several fine-tuning recipes among them: one line per encoder and recipe.
    by_recipe = len({r.results.get("recipe") for r in points}) > 1
    for r in points:
        k = _budget(r)
        name = encoder_name(r)
        if by_recipe:
            name += f" ({r.results.get('recipe') or 'recipe unknown'})"
        curves.setdefault(name, {}).setdefault(k, []).append(float(r.results["top1"]))
    return {e: {k: c[k] for k in sorted(c, key=_budget_order)} for e, c in curves.items()}


def all_labels_per_class(runs: list[Run]) -> float | None:
    """Where K = 0 (every label) sits on the labels-per-class axis: the mean num_labelled /
    num_classes of those runs (one dataset: all equal); None without any."""
    xs = [x for r in _scored(runs) if _budget(r) == 0 and (x := _per_class(r)) is not None]
    return statistics.fmean(xs) if xs else None


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, population std) of one budget's seeds, as the few-shot tables' mean ± std; with
    two seeds the std is half their range."""
    return statistics.fmean(values), statistics.pstdev(values)


def budget_label(k: int, x_all: float | None) -> str:
    """A budget's name: "10", or "all (600)" for K = 0."""
    return f"all ({x_all:.0f})" if k == 0 else str(k)


def _order(curves: Curves) -> list[str]:
    """Encoders by name, scratch last (as the summary's random-init row)."""
    return sorted(curves, key=lambda e: (e.split(" (")[0] == SCRATCH, e))


def budget_table(curves: Curves, x_all: float | None) -> Table:
    """Rows: encoders; columns: budgets (K ascending, every label last); cells: top-1 (%)
    "mean ± std (n seeds)", "-" where not run."""
    budgets = sorted({k for c in curves.values() for k in c}, key=_budget_order)

    def cell(values: list[float] | None) -> str:
        if not values:
            return "-"
        mean, std = spread(values)
        n = len(values)
        return f"{100 * mean:.1f} ± {100 * std:.1f} ({n} seed{'s' if n > 1 else ''})"

    header = ["encoder", *[f"{budget_label(k, x_all)} / class" for k in budgets]]
    rows = [[e, *[cell(curves[e].get(k)) for k in budgets]] for e in _order(curves)]
    return Table(header, rows)


def _fewshot_curves(runs: list[Run], encoders: set[str]) -> list[tuple[str, dict[int, float]]]:
    """(label, {k: mean accuracy}) of the finished few-shot runs of the fine-tuned encoders,
    numeric shots only (a frozen linear probe on k labels per class)."""
    out = []
    for r in runs:
        if r.kind != "fewshot" or not r.finished or encoder_name(r) not in encoders:
            continue
        table = {k: e["mean"] for k, e in fewshot_table(r.results).items() if isinstance(k, int)}
        if table:
            out.append((encoder_name(r), table))
    return out


def _chart(curves: Curves, x_all: float | None, runs: list[Run]) -> Chart | str:
    """The figure, or why it is not drawn."""
    try:
        from ssl_vit.report.figures import accuracy_vs_labels
    except ImportError as e:  # matplotlib is the `report` extra
        return f"figure skipped: {e}; install it with: pip install 'ssl-vit[report]'"
    fewshot = _fewshot_curves(runs, {e.split(" (")[0] for e in curves})  # without the recipe
    fig = accuracy_vs_labels(curves, x_all, fewshot, order=_order(curves))
    return Chart(
        "accuracy_vs_labels",
        png_bytes(fig),
        "Fine-tune top-1 vs labelled images per class (log axis), one line per encoder: mean "
        "over seeds, error bars ±1 std (population; with 2 seeds: their min–max), dots: "
        "seeds, n: seeds. Dashed: frozen few-shot linear probe of the same encoder.",
    )


def budget_section(runs: list[Run]) -> Section | None:
    """The section "Accuracy vs labels per class", or None when no fine-tune used a label
    budget (K > 0): then the report is as before."""
    if not any(_budget(r) > 0 for r in _scored(runs)):
        return None
    curves, x_all = labels_curves(runs), all_labels_per_class(runs)
    s = Section("Accuracy vs labels per class")
    s.notes.append(
        "Fine-tune test top-1 (%) by label budget (data.labels_per_class; all: every label, "
        "at num_labelled / num_classes): mean ± std over seeds (population std), one row per "
        "encoder (the pretraining run its checkpoint is in; every step of one encoder is "
        "pooled, each fine-tuning recipe is a line of its own when there are several)."
    )
    left = [r.name for r in _scored(runs) if _budget(r) == 0 and _per_class(r) is None]
    if left:
        s.notes.append(
            f"Left out (every label, but results.json does not say how many): {', '.join(left)}."
        )
    s.tables.append(budget_table(curves, x_all))
    chart = _chart(curves, x_all, runs)
    if isinstance(chart, str):
        log.info(chart)
        s.notes.append(chart)
    else:
        s.charts.append(chart)
    return s
