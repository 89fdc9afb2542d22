"""The masked-prediction loss: only corrupted patches count, and it learns."""

import math

import pytest
import torch
import torch.nn.functional as F

from ssl_vit.config import ConfigError, ObjectiveConfig, PretrainConfig, from_dict
from ssl_vit.model import ViT
from ssl_vit.objectives import MaskedPatchPrediction, mean_color_classes
from ssl_vit.objectives.targets import (
    cell_color_classes,
    normalize_patches,
    patch_pixels,
    pixels_to_mean_color,
)

TARGETS = [
    {"target": "mean_color"},
    {"target": "color_4x4"},
    {"target": "pixels_l2"},
    {"target": "pixels_l2", "normalize_pixels": True},
]


def tiny_model(image_size=16, patch_size=4, **kw):
    torch.manual_seed(0)
    return MaskedPatchPrediction(ViT(image_size, patch_size, 32, 2, 2), ObjectiveConfig(**kw))


def test_initial_loss_is_log512_and_logits_only_for_corrupted():
    model = tiny_model()
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    out = model(images, model.draw_noise(len(images), torch.Generator().manual_seed(0)))
    assert math.isclose(out.loss.item(), math.log(512), rel_tol=1e-6)  # zero-init head
    assert out.logits.shape == (3 * 8, 512)  # 16 patches, 8 corrupted per image
    # Targets are the colour classes of exactly the corrupted patches, in order.
    classes = mean_color_classes(images, 4)
    expected = classes[out.kind != 0]
    assert torch.equal(out.targets, expected)


def test_loss_depends_only_on_corrupted_patches():
    model = tiny_model()
    with torch.no_grad():
        model.head.weight.normal_(std=0.1)
    captured = {}

    def keep_output(module, inputs, output):
        output.retain_grad()
        captured["tokens"] = output

    model.encoder.norm.register_forward_hook(keep_output)
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    out = model(images, model.draw_noise(len(images), torch.Generator().manual_seed(3)))
    out.loss.backward()
    grad_BND = captured["tokens"].grad[:, 1:]
    per_patch = grad_BND.abs().sum(dim=-1)
    assert (per_patch[out.kind == 0] == 0).all()  # untouched patches' outputs get no gradient
    assert (per_patch[out.kind != 0] > 0).all()
    assert (captured["tokens"].grad[:, 0] == 0).all()  # nor does the [class] token
    # And the loss is the mean cross-entropy over the corrupted patches, computed by hand.
    logits = model.head(captured["tokens"][:, 1:].detach())
    ce = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), mean_color_classes(images, 4).flatten(), reduction="none"
    ).view(2, 16)
    assert torch.allclose(out.loss, ce[out.kind != 0].mean(), atol=1e-6)


def params_without_gradient(model, images: torch.Tensor) -> list[str]:
    """The parameters with no gradient after two Adam steps (step 0 only trains the
    zero-initialized head)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for i in range(2):
        opt.zero_grad()
        noise = model.draw_noise(len(images), torch.Generator().manual_seed(i))
        model(images, noise).loss.backward()
        opt.step()
    return [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]


@pytest.mark.parametrize("kw", TARGETS + [{"target": "color_4x4", "patch_size": 6}])
def test_every_parameter_gets_a_gradient_after_one_step(kw):
    kw = {"image_size": 12 if kw.get("patch_size") == 6 else 16, **kw}
    model = tiny_model(**kw)
    size = kw["image_size"]
    images = torch.randint(0, 256, (4, 3, size, size), dtype=torch.uint8)
    missing = params_without_gradient(model, images)
    assert missing == []


@pytest.mark.system
def test_overfits_a_fixed_batch():
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    first = model(images, model.draw_noise(len(images), g)).loss.item()
    for _ in range(60):
        opt.zero_grad()
        loss = model(images, model.draw_noise(len(images), g)).loss
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_color_4x4_targets_logits_and_accuracy():
    model = tiny_model(image_size=12, patch_size=6, target="color_4x4")  # cells of 1 or 2 px
    images = torch.randint(0, 256, (3, 3, 12, 12), dtype=torch.uint8)
    out = model(images, model.draw_noise(len(images), torch.Generator().manual_seed(0)))
    assert math.isclose(out.loss.item(), math.log(512), rel_tol=1e-6)  # zero-init head
    assert out.logits.shape == (3 * 2, 16, 512)  # 4 patches, 2 corrupted per image
    expected = cell_color_classes(images, 6)[out.kind != 0]
    assert torch.equal(out.targets, expected) and torch.equal(out.color_targets, expected)
    with torch.no_grad():
        model.head.weight.normal_(std=0.3)
    out = model(images, model.draw_noise(len(images), torch.Generator().manual_seed(0)))
    hits = (out.logits.argmax(-1) == out.targets).sum()
    assert out.correct == hits and out.color_targets.numel() == 6 * 16
    ce = F.cross_entropy(out.logits.flatten(0, 1), out.targets.flatten())
    assert torch.allclose(out.loss, ce, atol=1e-6)


@pytest.mark.parametrize("normalize", [False, True])
def test_pixels_l2_loss_and_colour_accuracy(normalize):
    model = tiny_model(target="pixels_l2", normalize_pixels=normalize)
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    pixels = patch_pixels(images, 4)  # [2, 16, 48] in [0, 1]
    out = model(images, model.draw_noise(len(images), torch.Generator().manual_seed(1)))
    target = pixels[out.kind != 0]
    assert torch.equal(out.targets, target) and out.logits.shape == (2 * 8, 48)
    if normalize:
        target = normalize_patches(target)
    assert torch.allclose(out.loss, (target**2).mean(), atol=1e-6)  # zero head predicts 0
    with torch.no_grad():
        model.head.bias.uniform_(0, 1)
    out = model(images, model.draw_noise(len(images), torch.Generator().manual_seed(1)))
    assert torch.allclose(out.loss, ((out.logits - target) ** 2).mean(), atol=1e-6)
    colours = mean_color_classes(images, 4)[out.kind != 0]
    assert torch.equal(out.color_targets, colours)
    if normalize:
        assert out.correct is None  # the predicted patch mean carries no colour
    else:
        assert out.correct == (pixels_to_mean_color(out.logits) == colours).sum()


def test_config_targets():
    base = {"data": {"train_shards": "x"}, "model": {"image_size": 16, "patch_size": 2}}
    with pytest.raises(ConfigError, match="patch_size >= 4"):
        from_dict(PretrainConfig, {**base, "objective": {"target": "color_4x4"}})
    with pytest.raises(ConfigError, match="objective.target"):
        from_dict(PretrainConfig, {**base, "objective": {"target": "pixels"}})
    cfg = from_dict(PretrainConfig, {**base, "objective": {"target": "pixels_l2"}})
    assert cfg.objective.normalize_pixels is False
