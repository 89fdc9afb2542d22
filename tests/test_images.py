"""The fast train augmentation draws and computes exactly what torchvision v2's does."""

import pytest
import torch

from ssl_vit.data.images import torchvision_train_transform, train_transform


@pytest.mark.parametrize(
    ("shape", "size", "scale", "hflip"),
    [
        ((3, 32, 32), 32, (0.08, 1.0), True),
        ((3, 32, 32), 16, (0.35, 1.0), False),
        ((3, 40, 24), 48, (0.5, 1.0), True),
        ((3, 4, 64), 8, (0.9, 1.0), True),  # extreme aspect: mostly the central-crop fallback
    ],
)
def test_train_transform_is_bit_identical_to_torchvision(shape, size, scale, hflip):
    fast = train_transform(size, scale, hflip)
    ref = torchvision_train_transform(size, scale, hflip)
    g = torch.Generator().manual_seed(0)
    for i in range(100):
        image = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        torch.manual_seed(i)
        a = fast(image)
        state_a = torch.get_rng_state()
        torch.manual_seed(i)
        b = ref(image)
        assert torch.equal(a, b) and a.shape == (3, size, size)
        assert torch.equal(state_a, torch.get_rng_state())  # same number of draws
