"""BERT-style corruption of patch embeddings (paper section 4.6 / appendix B.1.2).

Shape legend: B batch, N patches per image, D width.
`kind` convention, used everywhere: 0 untouched, 1 replaced by the [mask] embedding,
2 replaced by another patch's embedding, 3 chosen for prediction but kept as it is.
"""

from __future__ import annotations

import torch

__all__ = ["UNTOUCHED", "MASKED", "RANDOM", "KEPT", "num_corrupted", "corrupt_patches"]

UNTOUCHED, MASKED, RANDOM, KEPT = 0, 1, 2, 3


def num_corrupted(num_patches: int, ratio: float) -> int:
    """Exactly `round(ratio * N)` patches per image (Python's round: half to even)."""
    return round(ratio * num_patches)


def _rand(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device):
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device).to(device)


def corrupt_patches(
    embeddings: torch.Tensor,
    mask_embedding: torch.Tensor,
    ratio: float = 0.5,
    probs: tuple[float, float, float] = (0.8, 0.1, 0.1),
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt `round(ratio * N)` uniformly chosen patches of every image.

    Args:
        embeddings: [B, N, D] patch embeddings (after the linear projection, before position
            embeddings are added).
        mask_embedding: [D] (or broadcastable to [B, N, D]) learnable [mask] embedding.
        ratio: fraction of the patches of each image that are chosen.
        probs: (P(mask), P(random other patch), P(keep)) for each chosen patch independently.
        generator: source of randomness (its device may differ from the embeddings').

    Returns:
        corrupted: [B, N, D], differentiable w.r.t. `embeddings` and `mask_embedding`.
        kind: [B, N] int64, see the module docstring.
    """
    emb_BND = embeddings
    B, N, D = emb_BND.shape
    device = emb_BND.device
    n = num_corrupted(N, ratio)
    if B * N < 2 and probs[1] > 0:
        raise ValueError("random replacement needs at least two patches in the batch")

    # Uniform choice of exactly n patches per image: the n smallest of N uniform draws.
    order_BN = _rand((B, N), generator, device).argsort(dim=1)
    chosen_BN = torch.zeros(B, N, dtype=torch.bool, device=device)
    chosen_BN.scatter_(1, order_BN[:, :n], True)

    # Each chosen patch independently: mask / random / keep with probabilities `probs`.
    u_BN = _rand((B, N), generator, device)
    p_mask, p_random = probs[0], probs[0] + probs[1]
    kind_BN = torch.where(u_BN < p_mask, MASKED, torch.where(u_BN < p_random, RANDOM, KEPT))
    kind_BN = torch.where(chosen_BN, kind_BN, UNTOUCHED)

    # A random *other* patch of the batch: a uniform offset in [1, B*N) from the patch's own
    # flat index, so the source is never the patch itself and all others are equally likely.
    total = B * N
    offset_BN = 1 + (_rand((B, N), generator, device) * (total - 1)).long().clamp_(max=total - 2)
    own_BN = torch.arange(total, device=device).view(B, N)
    source_BN = (own_BN + offset_BN) % total
    random_BND = emb_BND.reshape(total, D)[source_BN]

    mask_BND = mask_embedding.to(emb_BND.dtype).expand_as(emb_BND)
    kind_BN1 = kind_BN.unsqueeze(-1)
    corrupted = torch.where(kind_BN1 == MASKED, mask_BND, emb_BND)
    corrupted = torch.where(kind_BN1 == RANDOM, random_BND, corrupted)
    return corrupted, kind_BN
