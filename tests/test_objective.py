"""The masked-prediction loss: only corrupted patches count, and it learns."""

import math

import torch

from ssl_vit.config import ObjectiveConfig
from ssl_vit.model import ViT
from ssl_vit.objectives import MaskedPatchPrediction, mean_color_classes


def tiny_model(**kw):
    torch.manual_seed(0)
    return MaskedPatchPrediction(ViT(16, 4, 32, 2, 2), ObjectiveConfig(**kw))


def test_initial_loss_is_log512_and_logits_only_for_corrupted():
    model = tiny_model()
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    out = model(images, torch.Generator().manual_seed(0))
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
    out = model(images, torch.Generator().manual_seed(3))
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


def test_every_parameter_gets_a_gradient_after_one_step():
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    for i in range(2):  # step 0 only trains the zero-initialized head
        opt.zero_grad()
        model(images, torch.Generator().manual_seed(i)).loss.backward()
        opt.step()
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert missing == []


def test_overfits_a_fixed_batch():
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    first = model(images, g).loss.item()
    for _ in range(60):
        opt.zero_grad()
        loss = model(images, g).loss
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
