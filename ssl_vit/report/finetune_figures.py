"""Fine-tuning figures of the report, over fine-tunes grouped by encoder and label budget
(budget.finetune_groups): training curves and final top-1 per group, and top-1 against
labelled images per class. Colour: the encoder; line style and marker: the budget; every
seed a dot. matplotlib is imported here only (the `report` extra).
"""

from __future__ import annotations

import statistics
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ssl_vit.report.budget import Groups, budget_label, budget_order, scored, spread
from ssl_vit.report.figures import finish_log_x, new_figure, series
from ssl_vit.report.runs import Run

__all__ = ["accuracy_vs_labels", "finetune_figure", "mean_curve"]

STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"))  # (line style, marker) by budget


def mean_curve(runs: list[Run], key: str) -> tuple[list[float], list[float], list[float]]:
    """(steps, mean, (min, max) band) of `key` over the seeds `runs`: every step any seed
    logged, averaged over the seeds that logged it; the band is [min, max] of those seeds."""
    by_step: dict[float, list[float]] = {}
    for run in runs:
        for step, value in zip(*series(run.rows, key), strict=True):
            by_step.setdefault(step, []).append(float(value))
    steps = sorted(by_step)
    band = [(min(by_step[s]), max(by_step[s])) for s in steps]
    return steps, [statistics.fmean(by_step[s]) for s in steps], band


def _curves_panel(ax, groups: Groups, key: str, style: dict, x_all: float | None) -> None:
    """One line per group (mean over its seeds, band: min-max), scaled to % for top-1."""
    scale = 100.0 if key == "top1" else 1.0
    for (enc, k), runs in groups.items():
        steps, mean, band = mean_curve(runs, key)
        if not steps:
            continue
        color, (ls, marker) = style[enc, k]
        n = len(runs)
        label = f"{enc}, {budget_label(k, x_all)} / class ({n} seed{'s' if n > 1 else ''})"
        ax.plot(steps, [scale * m for m in mean], ls=ls, marker=marker, ms=4, color=color,
                label=label)  # fmt: skip
        if len(runs) > 1:
            lo, hi = [scale * b[0] for b in band], [scale * b[1] for b in band]
            ax.fill_between(steps, lo, hi, color=color, alpha=0.12, lw=0)
    ylabel, title = {"loss": ("training loss", "Training loss"), "top1": ("test top-1 (%)",
                     "Test top-1 during fine-tuning")}[key]  # fmt: skip
    ax.set(xlabel="fine-tuning step", ylabel=ylabel, title=f"{title} (band: seeds' min-max)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _final_panel(ax, groups: Groups, encoders: list[str], budgets: list[int], x_all) -> None:
    """Final test top-1: a cluster of bars per budget, a bar per encoder (the mean over its
    finished seeds, its value above it) and each seed a dot."""
    width = 0.8 / len(encoders)
    for (enc, k), runs in groups.items():
        top1 = [100 * float(r.results["top1"]) for r in scored(runs)]
        if not top1:
            continue
        i = encoders.index(enc)
        x = budgets.index(k) + (i - (len(encoders) - 1) / 2) * width
        mean = statistics.fmean(top1)
        ax.bar(x, mean, 0.9 * width, color=f"C{i}", alpha=0.5, label=enc)
        ax.plot([x] * len(top1), top1, "o", ms=4, color=f"C{i}", mec="black", mew=0.5)
        ax.annotate(f"{mean:.1f}", (x, max(top1)), (0, 3), textcoords="offset points",
                    ha="center", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(budgets)), [budget_label(k, x_all) for k in budgets])
    ax.set(xlabel="labelled images per class", ylabel="test top-1 (%)")
    ax.set_title("Test top-1 at the end (bar: mean; dots: seeds)")
    ax.margins(y=0.12)
    ax.grid(alpha=0.3, axis="y")


def finetune_figure(groups: Groups, x_all: float | None) -> Figure | None:
    """Fine-tunes by (encoder, K): training loss vs step (a line per group, mean over seeds),
    test top-1 vs step when evaluated more than once, and the final top-1 per group with its
    seeds as dots. None when no fine-tune logged a loss or finished."""
    groups = {
        g: runs
        for g, runs in groups.items()
        if scored(runs) or any(series(r.rows, "loss")[0] for r in runs)
    }
    if not groups:
        return None
    encoders = list(dict.fromkeys(e for e, _ in groups))  # in the groups' order
    budgets = sorted({k for _, k in groups}, key=budget_order)
    style = {
        (e, k): (f"C{encoders.index(e)}", STYLES[budgets.index(k) % len(STYLES)]) for e, k in groups
    }
    runs = [r for members in groups.values() for r in members]
    # Curves of what was logged: the loss, and top-1 when evaluated during training.
    points = {k: max(len(series(r.rows, k)[0]) for r in runs) for k in ("loss", "top1")}
    keys = [k for k, n in (("loss", 1), ("top1", 2)) if points[k] >= n]
    fig, axes = new_figure(4.6 * (len(keys) + 1), 4.6, ncols=len(keys) + 1, squeeze=False)
    axes = axes[0]
    for ax, key in zip(axes, keys, strict=False):
        _curves_panel(ax, groups, key, style, x_all)
    _final_panel(axes[-1], groups, encoders, budgets, x_all)
    # A column per encoder (legends fill columns first), its budgets down it.
    handles, labels = axes[0].get_legend_handles_labels() if keys else ([], [])
    if not handles:  # no curves logged: the bars' colours, one entry per encoder
        bar_handles, bar_labels = axes[-1].get_legend_handles_labels()
        unique = dict(zip(bar_labels, bar_handles, strict=True))
        handles, labels = list(unique.values()), list(unique)
    ncols = min(len(encoders), 4)
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=8)
    return fig


def accuracy_vs_labels(
    curves: dict[str, dict[int, list[float]]],
    x_all: float | None,
    fewshot: list[tuple[str, dict[int, float]]] = (),
    order: list[str] | None = None,
) -> Figure | None:
    """Fine-tune top-1 vs labels per class (log x), one line per encoder of `curves`
    ({encoder: {K: [top1 per seed]}}, K = 0: every label, drawn at `x_all`): mean with ±1
    population-std error bars, each seed a dot, the number of seeds beside each point; a
    dashed line per (encoder, {k: mean accuracy}) of `fewshot` in the encoder's colour."""
    order = [e for e in (order or sorted(curves)) if curves.get(e)]
    if not order:
        return None

    def x_of(k: int) -> float:
        return x_all if k == 0 else k

    fig, ax = new_figure(7, 4.2)
    for i, enc in enumerate(order):
        _labels_line(ax, [x_of(k) for k in curves[enc]], list(curves[enc].values()), i, enc)
    for enc, table in fewshot:
        color = f"C{order.index(enc)}"
        ax.plot(list(table), [100 * a for a in table.values()], "x--", color=color,
                label=f"{enc}, few-shot probe")  # fmt: skip
    ticks = {k for c in curves.values() for k in c} | {k for _, t in fewshot for k in t}
    ticks = sorted(ticks, key=x_of)
    finish_log_x(
        ax,
        {x_of(k): budget_label(k, x_all) for k in ticks},
        xlabel="labelled images per class",
        ylabel="test top-1 (%)",
        title="Fine-tuning accuracy vs labels (mean ± std over seeds; dots: seeds)",
    )
    return fig


def _labels_line(ax, xs: list[float], seeds: list[list[float]], i: int, label: Any) -> None:
    """One encoder's line of accuracy_vs_labels: mean ± std error bars, seeds, their count."""
    stats = [spread([100 * a for a in s]) for s in seeds]
    mean, std = [m for m, _ in stats], [s for _, s in stats]
    ax.errorbar(xs, mean, yerr=std, fmt="o-", color=f"C{i}", capsize=3, label=label)
    for x, m, s in zip(xs, mean, seeds, strict=True):
        ax.plot([x] * len(s), [100 * a for a in s], ".", color=f"C{i}", alpha=0.5)
        ax.annotate(f"n={len(s)}", (x, m), (4, -10), textcoords="offset points", fontsize=7)
