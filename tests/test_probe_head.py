"""init.head=probe (LP-FT): the head starts as the few-shot job's ridge probe of the frozen
encoder on the labelled images, folded into one linear layer."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ssl_vit.config.schema import ModelConfig
from ssl_vit.data import eval_loader
from ssl_vit.eval.fewshot import ridge_accuracies
from ssl_vit.eval.fewshot_job import extract_features
from ssl_vit.eval.readouts import Extraction
from ssl_vit.model import Classifier, PixelNorm, build_vit
from ssl_vit.train.probe_head import SCALES, fit_probe_head, probe_head_weights

# Not the default: the probe must normalize as the model does (its own `pixels`).
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def test_the_folded_head_predicts_as_the_ridge_probe_over_random_draws():
    """On raw features, the head's argmax equals the few-shot probe's (standardize, bias
    column, ridge to {-1, 1}) on a held-out set, and its scale has the least cross-entropy."""
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(4, 16, generator=g) * 2
        y = torch.randint(0, 4, (200,), generator=g)
        x = centers[y] * torch.rand(16, generator=g) * 5 + torch.randn(200, 16, generator=g) + 3
        weight, bias, scale = probe_head_weights(x[:120], y[:120], 4, l2_reg=10.0)
        pred = (x[120:] @ weight.T + bias).argmax(-1)
        acc = (pred == y[120:]).double().mean().item()
        assert acc == ridge_accuracies(x[:120], y[:120], x[120:], y[120:], [10.0], 4)[0]
        logits = x[:120].double() @ weight.T.double() / scale + bias.double() / scale
        losses = {s: F.cross_entropy(s * logits, y[:120]).item() for s in SCALES}
        assert min(losses, key=losses.get) == scale


def test_fit_probe_head_sets_the_probe_of_the_frozen_encoder(synthetic_shards):
    torch.manual_seed(0)
    model_cfg = ModelConfig(image_size=16, patch_size=4, width=32, depth=2, heads=2)
    model = Classifier(build_vit(model_cfg), 10, "gap", PixelNorm(MEAN, STD))
    before = {k: v.clone() for k, v in model.encoder.state_dict().items()}
    plan = SimpleNamespace(world=1, local_eval=32, num_workers=0)
    run = SimpleNamespace(
        acc=SimpleNamespace(is_main_process=True, mixed_precision="no"), plan=plan
    )
    figures = fit_probe_head(model, str(synthetic_shards), 16, run)
    assert figures["images"] == 96 and model.training  # left in training mode
    assert all(torch.equal(v, model.encoder.state_dict()[k]) for k, v in before.items())
    loader = eval_loader(str(synthetic_shards), 32, 16, num_workers=0)
    feats, labels = extract_features(
        model.encoder,
        ((b.images, b.labels) for b in loader),
        Extraction(MEAN, STD, precision="no"),
        "gap",
    )
    ridge = ridge_accuracies(feats, labels, feats, labels, [1024.0], 10)[0]
    model.eval()
    with torch.no_grad():
        logits = torch.cat(
            [model(b.images) for b in eval_loader(str(synthetic_shards), 32, 16, num_workers=0)]
        )
    assert abs((logits.argmax(-1) == labels).double().mean().item() - ridge) < 1e-9
    # train_acc is a float32 mean: k / 96 to float32 rounding, far below one image (1 / 96).
    assert abs(figures["train_acc"] - ridge) < 1e-6 and ridge > 0.1
