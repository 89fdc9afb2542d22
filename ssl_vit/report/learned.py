"""What the model learned, as the paper's Figure 7 shows it: the principal components of the
patch-embedding filters (left) and the cosine similarity of each position embedding with all
the others (centre). Pure tensor math here; the drawing is in `learned_figures.py`.

Shape legend: D width, P patch size, h x w patch grid, N = h * w patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["position_similarity", "filter_components"]


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
