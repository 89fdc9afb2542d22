"""Invariants of the BERT-style corruption over many random draws."""

import pytest
import torch

from ssl_vit import corrupt_patches
from ssl_vit.objectives.corruption import (
    KEPT,
    MASKED,
    RANDOM,
    UNTOUCHED,
    CorruptionDraws,
    draw_corruption,
)


def make_batch(B=8, N=64, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, D, generator=g), torch.randn(D, generator=g)


def corrupt(emb, mask, g, *args):
    """corrupt_patches with fresh draws from `g`."""
    return corrupt_patches(emb, mask, draw_corruption(*emb.shape[:2], g), *args)


@pytest.mark.parametrize("N, ratio", [(64, 0.5), (49, 0.5), (196, 0.15), (10, 1.0), (7, 0.3)])
def test_exact_count_per_image(N, ratio):
    emb, mask = make_batch(N=N)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        _, kind = corrupt(emb, mask, g, ratio)
        assert ((kind != UNTOUCHED).sum(dim=1) == round(ratio * N)).all()


@pytest.mark.system
def test_fractions_and_replacements_over_many_draws():
    B, N, D = 16, 64, 32
    emb, mask = make_batch(B, N, D)
    flat = emb.reshape(B * N, D)
    g = torch.Generator().manual_seed(2)
    counts = torch.zeros(4)
    chosen_positions = torch.zeros(N)
    for _ in range(200):
        out, kind = corrupt(emb, mask, g, 0.5, (0.8, 0.1, 0.1))
        counts += torch.bincount(kind.flatten(), minlength=4)
        chosen_positions += (kind != UNTOUCHED).sum(dim=0)
        # Untouched and kept patches are unchanged; masked ones are exactly the mask.
        keep = (kind == UNTOUCHED) | (kind == KEPT)
        assert torch.equal(out[keep], emb[keep])
        assert torch.equal(out[kind == MASKED], mask.expand(int((kind == MASKED).sum()), D))
        # Random replacements are some other patch's embedding, never the patch itself.
        rand = (kind == RANDOM).nonzero()
        for b, n in rand.tolist():
            matches = (flat == out[b, n]).all(dim=1).nonzero().flatten().tolist()
            assert matches and b * N + n not in matches
    corrupted = counts[1:].sum()
    assert counts[1:].sum() / counts.sum() == pytest.approx(0.5)
    # 200 * 16 * 32 = 102,400 corrupted patches: std of a 0.1 fraction is ~0.001.
    assert counts[MASKED] / corrupted == pytest.approx(0.8, abs=0.006)
    assert counts[RANDOM] / corrupted == pytest.approx(0.1, abs=0.005)
    assert counts[KEPT] / corrupted == pytest.approx(0.1, abs=0.005)
    # Every position is chosen about equally often (uniform choice).
    freq = chosen_positions / chosen_positions.sum()
    assert (freq - 1 / N).abs().max() < 0.2 / N


def test_random_sources_are_the_other_patches_of_the_same_image():
    # B=2, N=3: a random replacement comes from one of the 2 other patches of its own image
    # (never another image's: which images share a process's batch depends on the layout).
    emb = torch.arange(6.0).view(2, 3, 1).expand(2, 3, 3).contiguous()
    g = torch.Generator().manual_seed(0)
    seen = {i: set() for i in range(6)}
    for _ in range(400):
        out, kind = corrupt(emb, torch.full((3,), -1.0), g, 1.0, (0, 1, 0))
        assert (kind == RANDOM).all()
        for i, v in enumerate(out[..., 0].flatten().tolist()):
            seen[i].add(int(v))
    image = {0: {0, 1, 2}, 1: {3, 4, 5}}
    assert seen == {i: image[i // 3] - {i} for i in range(6)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_corruption_draws_of_ranks_are_slices_of_the_global_draws(world_size):
    """What world_size processes draw for micro-batch u, stacked in rank order, is what one
    process draws for the global micro-batch; another u draws otherwise."""
    global_micro = 4 * world_size  # each process's 4 images
    one = CorruptionDraws(7, 5, 0, global_micro, torch.device("cpu"))
    ranks = [CorruptionDraws(7, 5, r, global_micro, torch.device("cpu")) for r in range(world_size)]
    for u in (0, 1, 13):
        whole = one(u, global_micro)
        assert torch.equal(torch.cat([d(u, 4) for d in ranks], dim=1), whole)
        assert torch.equal(one(u, global_micro), whole)  # a function of u: nothing to save
    assert not torch.equal(one(0, global_micro), one(1, global_micro))


def test_ratio_and_probs_are_respected_and_gradients_flow():
    emb, mask = make_batch(4, 16, 8)
    emb.requires_grad_(True)
    mask.requires_grad_(True)
    out, kind = corrupt(emb, mask, torch.Generator(), 0.25, (1.0, 0.0, 0.0))
    assert set(kind.unique().tolist()) == {UNTOUCHED, MASKED}
    out.sum().backward()
    assert mask.grad.abs().sum() > 0 and emb.grad.abs().sum() > 0


def test_generator_makes_it_deterministic():
    emb, mask = make_batch()
    a = corrupt(emb, mask, torch.Generator().manual_seed(5))
    b = corrupt(emb, mask, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_draws_are_those_of_the_generator_in_the_old_order():
    # The corruption drawn before the draws moved out of corrupt_patches (three rand((B, N))
    # calls inside it): same seed, same kinds. Kinds recorded from that version (the CPU
    # generator's sequence is the same on every machine); a random replacement is the patch
    # 1 + floor(u * (N - 1)) places further in its own image (u: the third draw).
    emb = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    g = torch.Generator().manual_seed(5)
    out, kind = corrupt(emb, torch.full((3,), -1.0), g, 0.5, (0.5, 0.25, 0.25))
    assert kind.tolist() == [[0, 2, 0, 0, 0, 1, 1, 3], [3, 0, 0, 2, 1, 0, 0, 1]]
    noise = draw_corruption(2, 8, torch.Generator().manual_seed(5))
    for b, n in ((0, 1), (1, 3)):  # the two RANDOM patches
        source = (n + 1 + int(noise[2, b, n] * 7)) % 8
        assert source != n and out[b, n, 0] == emb[b, source, 0]
    g = torch.Generator().manual_seed(5)
    assert noise.shape == (3, 2, 8)
    assert torch.equal(noise, torch.stack([torch.rand((2, 8), generator=g) for _ in range(3)]))


def test_noise_of_the_wrong_shape_is_refused():
    emb, mask = make_batch(B=2, N=8)
    with pytest.raises(ValueError, match=r"noise: expected shape \(3, 2, 8\)"):
        corrupt_patches(emb, mask, torch.rand(3, 8, 2))
