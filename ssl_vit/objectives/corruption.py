"""BERT-style corruption of patch embeddings (paper section 4.6 / appendix B.1.2).

Shape legend: B batch, N patches per image, D width.
The random draws are made apart from the corruption (`draw_corruption`) and passed in as one
tensor, so the corruption itself is a pure function of tensors: it compiles into the step's
graph (a `torch.Generator` call inside it would break the graph), and a CUDA graph can replay it.
`kind` convention, used everywhere: 0 untouched, 1 replaced by the [mask] embedding,
2 replaced by another patch's embedding (of the same image), 3 chosen for prediction but kept
as it is.

In training the draws of micro-batch u are made for the whole global micro-batch from a
generator seeded by (seed, u) and each process keeps its slice (`CorruptionDraws`): a patch's
corruption depends on the seed and the sample's place in the global stream, not on the number
of processes; a random replacement comes from the same image, which is on the same process
whatever the layout.
"""

from __future__ import annotations

import torch

from ssl_vit import seeds
from ssl_vit.errors import ConfigError

__all__ = [
    "UNTOUCHED",
    "MASKED",
    "RANDOM",
    "KEPT",
    "NUM_DRAWS",
    "CorruptionDraws",
    "num_corrupted",
    "draw_corruption",
    "corrupt_patches",
]

UNTOUCHED, MASKED, RANDOM, KEPT = 0, 1, 2, 3
NUM_DRAWS = 3  # uniform draws per patch: which patches, which kind, which other patch


def num_corrupted(num_patches: int, ratio: float) -> int:
    """Exactly `round(ratio * N)` patches per image (Python's round: half to even)."""
    return round(ratio * num_patches)


def draw_corruption(
    batch_size: int,
    num_patches: int,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The uniform draws of one batch's corruption: [3, B, N] float32 in [0, 1), on `device`.

    Three `torch.rand((B, N))` calls in this order (choice of patches, kind of each, source of
    a random replacement), so a seeded generator gives the same corruption as ever. The
    generator's device may differ from `device` (the draws are then copied over); `device`
    defaults to the generator's, then to the CPU."""
    gen_device = generator.device if generator is not None else torch.device(device or "cpu")
    device = gen_device if device is None else torch.device(device)
    shape = (batch_size, num_patches)
    draws = [torch.rand(shape, generator=generator, device=gen_device) for _ in range(NUM_DRAWS)]
    return torch.stack(draws).to(device)


class CorruptionDraws:
    """`draws(u, b)`: this process's [3, b, N] corruption draws of micro-batch `u` (step x
    grad_accum + micro-step): rows rank*b..(rank+1)*b of the global micro-batch's
    `draw_corruption(global_micro, N)` (`RunPlan.global_micro`: every process's b images) from
    a generator seeded by (seed, u). A pure function of (seed, u): nothing to save in a
    checkpoint, and a 1-process run draws what N processes together draw."""

    def __init__(
        self, seed: int, num_patches: int, rank: int, global_micro: int, device: torch.device
    ) -> None:
        self.seed, self.num_patches = seed, num_patches
        self.rank, self.global_micro = rank, global_micro
        self.generator = torch.Generator(device)

    def __call__(self, index: int, local_micro: int) -> torch.Tensor:
        self.generator.manual_seed(seeds.derive(self.seed, seeds.CORRUPTION, index))
        full = draw_corruption(self.global_micro, self.num_patches, self.generator)
        if local_micro == self.global_micro:  # one process
            return full
        return full[:, self.rank * local_micro : (self.rank + 1) * local_micro].contiguous()


def corrupt_patches(
    embeddings: torch.Tensor,
    mask_embedding: torch.Tensor,
    noise: torch.Tensor,
    ratio: float = 0.5,
    probs: tuple[float, float, float] = (0.8, 0.1, 0.1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt `round(ratio * N)` uniformly chosen patches of every image.

    Args:
        embeddings: [B, N, D] patch embeddings (after the linear projection, before position
            embeddings are added).
        mask_embedding: [D] (or broadcastable to [B, N, D]) learnable [mask] embedding.
        noise: [3, B, N] uniform draws in [0, 1) from `draw_corruption`, on the embeddings'
            device: the only randomness used.
        ratio: fraction of the patches of each image that are chosen.
        probs: (P(mask), P(random other patch), P(keep)) for each chosen patch independently.

    Returns:
        corrupted: [B, N, D], differentiable w.r.t. `embeddings` and `mask_embedding`.
        kind: [B, N] int64, see the module docstring.
    """
    emb_BND = embeddings
    B, N, D = emb_BND.shape
    device = emb_BND.device
    n = num_corrupted(N, ratio)
    if N < 2 and probs[1] > 0:
        raise ConfigError("random replacement needs at least two patches per image")
    if noise.shape != (NUM_DRAWS, B, N):
        raise ValueError(f"noise: expected shape {(NUM_DRAWS, B, N)}, got {tuple(noise.shape)}")
    choose_BN, kind_u_BN, source_u_BN = noise.unbind(0)

    # Uniform choice of exactly n patches per image: the n smallest of N uniform draws.
    order_BN = choose_BN.argsort(dim=1)
    chosen_BN = torch.zeros(B, N, dtype=torch.bool, device=device)
    chosen_BN.scatter_(1, order_BN[:, :n], True)

    # Each chosen patch independently: mask / random / keep with probabilities `probs`.
    p_mask, p_random = probs[0], probs[0] + probs[1]
    kind_BN = torch.where(
        kind_u_BN < p_mask, MASKED, torch.where(kind_u_BN < p_random, RANDOM, KEPT)
    )
    kind_BN = torch.where(chosen_BN, kind_BN, UNTOUCHED)

    # A random *other* patch of the same image: a uniform offset in [1, N) from the patch's own
    # index, so the source is never the patch itself and all others are equally likely. (Of
    # the same image, not of the batch: a process's batch depends on the number of processes.)
    offset_BN = 1 + (source_u_BN * (N - 1)).long().clamp_(max=max(N - 2, 0))
    own_BN = torch.arange(N, device=device).expand(B, N)
    first_B1 = torch.arange(B, device=device).unsqueeze(1) * N
    source_BN = first_B1 + (own_BN + offset_BN) % N
    random_BND = emb_BND.reshape(B * N, D)[source_BN]

    mask_BND = mask_embedding.to(emb_BND.dtype).expand_as(emb_BND)
    kind_BN1 = kind_BN.unsqueeze(-1)
    corrupted = torch.where(kind_BN1 == MASKED, mask_BND, emb_BND)
    corrupted = torch.where(kind_BN1 == RANDOM, random_BND, corrupted)
    return corrupted, kind_BN
