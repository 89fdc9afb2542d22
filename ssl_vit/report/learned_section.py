"""The "What the model learned" section: for each pretraining run's final checkpoint, the
position-embedding similarity tiles, the filter components and the example strip.

The tiles and components are as the paper's Figure 7 shows them: the principal components of
the patch-embedding filters (left) and the cosine similarity of each position embedding with all
the others (centre). Tensor math here; the drawing is in `learned_figures.py`.

Shape legend: D width, P patch size, h x w patch grid, N = h * w patches.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from ssl_vit.report.render import Section
from ssl_vit.report.runs import Run
from ssl_vit.train.checkpoint import CheckpointError

__all__ = ["filter_components", "learned_section", "position_similarity"]

log = logging.getLogger(__name__)


def position_similarity(pos_embed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Cosine similarity of every patch position embedding with every other.

    Args:
        pos_embed: [1, 1 + N, D] or [1 + N, D] position embeddings; the first ([class] token)
            row is left out.
        grid: (h, w) with h * w = N, patches in row-major order.

    Returns:
        [h, w, h, w]: entry [i, j] is the similarity map of position (i, j) with all positions
        (the tile drawn at (i, j)); entry [i, j, i, j] is 1.
    """
    pe_ND = pos_embed.reshape(-1, pos_embed.shape[-1])[1:].float()
    h, w = grid
    if pe_ND.shape[0] != h * w:
        raise ValueError(f"{pe_ND.shape[0]} patch position embeddings for a {h}x{w} grid")
    unit_ND = F.normalize(pe_ND, dim=-1)
    return (unit_ND @ unit_ND.T).reshape(h, w, h, w)


def filter_components(weight: torch.Tensor, k: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal components of the patch-embedding filters (paper Figure 7, left).

    Args:
        weight: [D, 3, P, P] patch projection (one RGB filter per output channel).
        k: number of components kept (at most min(D, 3 * P * P)).

    Returns:
        components: [k, 3, P, P], orthonormal as flat vectors, by decreasing variance.
        explained: [k] fraction of the filters' variance each component explains.
    """
    D = weight.shape[0]
    x_DF = weight.reshape(D, -1).double()
    x_DF = x_DF - x_DF.mean(dim=0, keepdim=True)
    _, s, vh_FF = torch.linalg.svd(x_DF, full_matrices=False)
    k = min(k, vh_FF.shape[0])
    var = s**2
    explained = (var[:k] / var.sum().clamp(min=1e-30)).float()
    return vh_FF[:k].float().reshape(k, *weight.shape[1:]), explained


def _examples_chart(s: Section, run: Run, ckpt: Path, num_examples: int, seed: int) -> str | None:
    """Add the example strip to `s`; -> None, or why it was skipped."""
    from ssl_vit.report.examples import run_examples
    from ssl_vit.report.learned_figures import examples_figure

    try:
        ex = run_examples(run, ckpt, num_examples, seed)
    except (OSError, ValueError, RuntimeError, StopIteration) as e:  # unreadable data/state
        ex = f"could not run the model on the data ({type(e).__name__}: {e})"
    if isinstance(ex, str):
        return f"example strip skipped: {ex}"
    title = f"Examples ({run.name} @ {ex.checkpoint.name}, corruption seed {seed})"
    s.chart(
        f"{run.name}_examples",
        examples_figure(ex, title),
        "Rows: image; corrupted input (coloured borders: the patches chosen for "
        "prediction; a 'random' patch shows its own pixels, but the model saw another "
        "patch's embedding there); target; prediction. Faded patches were not predicted.",
    )
    return None


def _run_charts(s: Section, run: Run, ckpt: Path, num_examples: int, seed: int) -> str | None:
    """Add the charts of `run`'s checkpoint `ckpt` to `s` (CheckpointError before any: it is
    unreadable); -> None, or why the example strip was skipped."""
    from ssl_vit.report.learned_figures import filter_components_figure, position_similarity_figure
    from ssl_vit.train.checkpoint import load_encoder

    state, mc = load_encoder(ckpt)
    grid = (mc["image_size"] // mc["patch_size"],) * 2
    where = f"{run.name} @ {ckpt.name}"
    sim = position_similarity(state["pos_embed"], grid)
    comp, explained = filter_components(state["patch_embed.weight"], 28)
    s.chart(
        f"{run.name}_pos_embed",
        position_similarity_figure(sim, f"Position embedding similarity ({where})"),
        "Each tile: cosine similarity of one patch position's embedding with all others "
        "(paper Fig. 7, centre; the [class] token is left out).",
    )
    title = f"Patch-embedding filters, first {len(comp)} principal components ({where})"
    s.chart(
        f"{run.name}_filters",
        filter_components_figure(comp, explained, title),
        "Principal components of the RGB patch-embedding filters, each min-max scaled; "
        "title: fraction of variance (paper Fig. 7, left).",
    )
    return _examples_chart(s, run, ckpt, num_examples, seed)


def learned_section(pretrains: list[Run], num_examples: int = 8, seed: int = 0) -> Section:
    s = Section("What the model learned")
    if not pretrains:
        s.notes.append("No pretraining runs given.")
    for run in pretrains:
        ckpts = run.checkpoints()
        if not ckpts:
            s.notes.append(f"{run.name}: no checkpoint, nothing to show.")
            continue
        try:
            note = _run_charts(s, run, ckpts[-1], num_examples, seed)
        except CheckpointError as e:
            s.notes.append(f"{run.name}: unreadable checkpoint ({e}), nothing to show.")
            continue
        if note:
            log.info("%s: %s", run.name, note)
            s.notes.append(f"{run.name}: {note}")
    return s
