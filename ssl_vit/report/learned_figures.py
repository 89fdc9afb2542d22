"""Drawing what the model learned (paper Figure 7): position-embedding similarity tiles,
patch-embedding filter components, and the example strip."""

from __future__ import annotations

import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from ssl_vit.objectives.corruption import KEPT, MASKED, RANDOM
from ssl_vit.report.examples import Examples
from ssl_vit.report.figures import new_figure

__all__ = ["position_similarity_figure", "filter_components_figure", "examples_figure"]

KIND_STYLE = {
    MASKED: ("[mask]", "#e41a1c"),
    RANDOM: ("random patch", "#ffb000"),
    KEPT: ("kept", "#00bcd4"),
}


def position_similarity_figure(sim_hwhw: torch.Tensor, title: str) -> Figure:
    """One tile per patch position (i, j), showing its cosine similarity with all positions."""
    h, w = sim_hwhw.shape[:2]
    size = min(9.0, 0.55 * max(h, w) + 1.5)
    fig, axes = new_figure(
        size * w / max(h, w) + 0.8,
        size * h / max(h, w),
        nrows=h,
        ncols=w,
        squeeze=False,
        gridspec_kw={"wspace": 0.02, "hspace": 0.02},
    )
    fig.get_layout_engine().set(w_pad=0.01, h_pad=0.01, wspace=0.0, hspace=0.0)
    for i in range(h):
        for j in range(w):
            ax = axes[i][j]
            im = ax.imshow(sim_hwhw[i, j].numpy(), cmap="viridis", vmin=-1, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[i][0].set_ylabel(str(i + 1), rotation=0, labelpad=8, fontsize=7, va="center")
    for j in range(w):
        axes[-1][j].set_xlabel(str(j + 1), fontsize=7)
    fig.colorbar(im, ax=axes, shrink=0.6, label="cosine similarity")
    fig.suptitle(title, fontsize=10)
    fig.supxlabel("input patch column", fontsize=9)
    fig.supylabel("input patch row", fontsize=9)
    return fig


def filter_components_figure(comp_kCPP: torch.Tensor, explained: torch.Tensor, title: str):
    """The principal components of the RGB patch-embedding filters, each min-max scaled."""
    k = comp_kCPP.shape[0]
    cols = min(7, k)
    rows = -(-k // cols)
    fig, axes = new_figure(1.25 * cols, 1.35 * rows + 0.5, nrows=rows, ncols=cols, squeeze=False)
    for idx, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if idx >= k:
            continue
        c = comp_kCPP[idx]
        c = (c - c.min()) / (c.max() - c.min()).clamp(min=1e-12)
        ax.imshow(c.permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_title(f"{idx + 1}: {100 * explained[idx]:.1f}%", fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


def _show(ax, image_CHW: torch.Tensor, title: str | None) -> None:
    ax.imshow(image_CHW.clamp(0, 1).permute(1, 2, 0).numpy(), interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_ylabel(title, fontsize=8)


def _pixels_of(mask_N: torch.Tensor, P: int, w_patches: int) -> torch.Tensor:
    """A mask over the N patches (row-major) as a mask over the pixels [H, W]."""
    return mask_N.reshape(-1, w_patches).repeat_interleave(P, 0).repeat_interleave(P, 1)


def _dim(image_CHW: torch.Tensor, kind_N: torch.Tensor, P: int) -> torch.Tensor:
    """Untouched patches washed out, so the corrupted patches (the predictions) stand out."""
    keep = _pixels_of(kind_N != 0, P, image_CHW.shape[2] // P)
    return torch.where(keep, image_CHW, 0.35 * image_CHW + 0.65)


def examples_figure(ex: Examples, title: str) -> Figure:
    """Rows: image, corrupted input, target, prediction; one column per image."""
    B, P = ex.images.shape[0], ex.patch_size
    w_patches = ex.images.shape[-1] // P
    fig, axes = new_figure(1.5 * B + 0.6, 6.6, nrows=4, ncols=B, squeeze=False)
    labels = ("image", "corrupted input", "target", "prediction")
    for b in range(B):
        kind = ex.kind[b]
        corrupted = torch.where(_pixels_of(kind == MASKED, P, w_patches), 0.5, ex.images[b])
        for row, img in enumerate(
            (ex.images[b], corrupted, _dim(ex.target[b], kind, P), _dim(ex.predicted[b], kind, P))
        ):
            _show(axes[row][b], img, labels[row] if b == 0 else None)
        for n in torch.nonzero(kind).flatten().tolist():
            name, color = KIND_STYLE[int(kind[n])]
            r, c = divmod(n, w_patches)
            axes[1][b].add_patch(
                Rectangle((c * P - 0.5, r * P - 0.5), P, P, fill=False, edgecolor=color, lw=1.0)
            )
    handles = [Line2D([], [], color=c, lw=3, label=n) for n, c in KIND_STYLE.values()]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncols=3,
        fontsize=8,
        title="corrupted patches (grey fill: [mask]); rows 3-4: untouched patches faded",
        title_fontsize=8,
    )
    fig.suptitle(title, fontsize=10)
    return fig
