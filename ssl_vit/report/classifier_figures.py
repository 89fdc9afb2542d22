"""A classifier's figure: its confusion matrix as a heat map (rows: true class, normalised to
100 %) beside its per-class accuracy as bars, one bar per heat-map row. matplotlib is imported
here only (the `report` extra)."""

from __future__ import annotations

import math

from matplotlib import colormaps
from matplotlib.figure import Figure

from ssl_vit.report.classifier import Confusion, per_class_accuracy, row_normalised, top1_of
from ssl_vit.report.figures import new_figure

__all__ = ["confusion_figure"]

ANNOTATE_UP_TO = 20  # classes: each cell's percentage written in it
LABEL_UP_TO = 40  # classes: every name on the axes (more: every n-th)


def _heat_map(ax, conf: Confusion) -> None:
    K = len(conf.names)
    frac = row_normalised(conf.counts)
    pct = [[math.nan if f is None else 100 * f for f in row] for row in frac]
    cmap = colormaps["Blues"].with_extremes(bad="0.85")  # a class without images: grey
    image = ax.imshow(pct, cmap=cmap, vmin=0, vmax=100, aspect="auto", interpolation="none")
    step = math.ceil(K / LABEL_UP_TO)
    ticks = list(range(0, K, step))
    ax.set_xticks(ticks, [conf.names[i] for i in ticks], rotation=45, ha="right", fontsize=8)
    ax.set_yticks(ticks, [conf.names[i] for i in ticks], fontsize=8)
    ax.set(xlabel="predicted class", ylabel="true class")
    ax.set_title("Confusion matrix (% of each true class)", fontsize=10)
    if K <= ANNOTATE_UP_TO:
        for i, row in enumerate(pct):
            for j, p in enumerate(row):
                if conf.counts[i][j]:  # empty cells stay blank: the errors stand out
                    ax.text(j, i, f"{p:.0f}", ha="center", va="center", fontsize=7,
                            color="white" if p > 55 else "black")  # fmt: skip
    ax.figure.colorbar(image, ax=ax, shrink=0.6, aspect=30)  # the title says what in


def _accuracy_bars(ax, conf: Confusion) -> None:
    """Horizontal bars, one per true class in the heat map's row order, labelled correct / n."""
    K = len(conf.names)
    acc = per_class_accuracy(conf.counts)
    ax.barh(range(K), [0 if a is None else 100 * a for a in acc], color="C0", height=0.7)
    ax.set_ylim(K - 0.5, -0.5)  # row i level with the heat map's row i
    ax.set_yticks([])
    if K <= LABEL_UP_TO:
        for i, (a, row) in enumerate(zip(acc, conf.counts, strict=True)):
            text = "no images" if a is None else f"{100 * a:.0f}% ({row[i]}/{sum(row)})"
            ax.text(101, i, text, va="center", fontsize=7)
    if (top1 := top1_of(conf.counts)) is not None:
        ax.axvline(100 * top1, color="C3", ls="--", lw=1, label=f"top-1 {100 * top1:.1f}%")
        ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    ax.set_xlim(0, 100)
    ax.set_xticks([0, 25, 50, 75, 100])
    ax.set_xlabel("accuracy on the class (%)")
    ax.grid(alpha=0.3, axis="x")


def confusion_figure(conf: Confusion, title: str) -> Figure:
    """Heat map of `conf` row-normalised (cells: % of the row's images, written in each
    non-empty cell up to ANNOTATE_UP_TO classes) and per-class accuracy bars beside it."""
    K = len(conf.names)
    # A heat-map cell's side: 0.45 in for 10 classes, smaller for many, the figure <= ~11 in.
    side = max(0.08, min(0.45, 8.0 / K)) * K
    fig, (ax_map, ax_bars) = new_figure(
        side + 5.2, side + 1.9, ncols=2, gridspec_kw={"width_ratios": [side + 1.4, 2.6]}
    )
    _heat_map(ax_map, conf)
    _accuracy_bars(ax_bars, conf)
    fig.suptitle(title, fontsize=11)
    return fig
