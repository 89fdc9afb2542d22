"""The report's fine-tuning sections: "Fine-tuning" (curves and final top-1 of the fine-tunes
grouped by encoder and label budget) and "Accuracy vs labels per class" (issue 27, only when
a fine-tune had a label budget). Data from budget.py, figures from finetune_figures.py
(imported late: matplotlib is the `report` extra)."""

from __future__ import annotations

import logging

from ssl_vit.report import budget
from ssl_vit.report.render import Section
from ssl_vit.report.runs import Run

__all__ = ["budget_section", "finetune_section"]

log = logging.getLogger(__name__)
SKIPPED = "figure skipped: {}; install it with: pip install 'ssl-vit[report]'"


def finetune_section(runs: list[Run]) -> Section:
    """The "Fine-tuning" section: training loss (and test top-1 when evaluated during
    training) per (encoder, label budget), mean over seeds, and the final top-1, seeds as dots."""
    s = Section("Fine-tuning")
    groups = budget.finetune_groups(runs)
    try:
        from ssl_vit.report.finetune_figures import finetune_figure
    except ImportError as e:
        s.notes.append(SKIPPED.format(e))
        return s
    if fig := finetune_figure(groups, budget.all_labels_per_class(runs)):
        s.chart(
            "finetune_curves",
            fig,
            "Fine-tunes grouped by encoder (colour) and labelled images per class (line "
            "style; all: every label): lines are the mean over seeds, the band their "
            "min-max. Last panel: final test top-1, bar the mean, dots the seeds.",
        )
    else:
        s.notes.append("No fine-tuning runs given.")
    return s


def _labels_chart(s: Section, runs: list[Run], curves, x_all: float | None) -> str | None:
    """Add the accuracy-vs-labels figure to `s`; -> None, or why it is not drawn."""
    try:
        from ssl_vit.report.finetune_figures import accuracy_vs_labels
    except ImportError as e:
        return SKIPPED.format(e)
    fewshot = budget.fewshot_curves(runs, {e.split(" (")[0] for e in curves})  # without the recipe
    fig = accuracy_vs_labels(curves, x_all, fewshot, order=sorted(curves, key=budget.encoder_order))
    s.chart(
        "accuracy_vs_labels",
        fig,
        "Fine-tune top-1 vs labelled images per class (log axis), one line per encoder: mean "
        "over seeds, error bars ±1 std (population; with 2 seeds: their min–max), dots: "
        "seeds, n: seeds. Dashed: frozen few-shot linear probe of the same encoder.",
    )
    return None


def budget_section(runs: list[Run]) -> Section | None:
    """The section "Accuracy vs labels per class", or None when no fine-tune used a label
    budget (K > 0): then the report is as before."""
    if not any(budget.budget_of(r) > 0 for r in budget.scored(runs)):
        return None
    curves, x_all = budget.labels_curves(runs), budget.all_labels_per_class(runs)
    s = Section("Accuracy vs labels per class")
    s.notes.append(
        "Fine-tune test top-1 (%) by label budget (data.labels_per_class; all: every label, "
        "at num_labelled / num_classes): mean ± std over seeds (population std), one row per "
        "encoder (the pretraining run its checkpoint is in; every step of one encoder is "
        "pooled, each fine-tuning recipe is a line of its own when there are several)."
    )
    every_label = [r for r in budget.scored(runs) if budget.budget_of(r) == 0]
    left = [r.name for r in every_label if budget.images_per_class(r) is None]
    if left:
        s.notes.append(
            f"Left out (every label, but results.json does not say how many): {', '.join(left)}."
        )
    s.tables.append(budget.budget_table(curves, x_all))
    if skipped := _labels_chart(s, runs, curves, x_all):
        log.info(skipped)
        s.notes.append(skipped)
    return s
