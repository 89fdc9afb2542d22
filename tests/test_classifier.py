"""Fine-tuning model: zero-initialized head, loading an encoder at another resolution."""

import re

import pytest
import torch

from ssl_vit.config import ModelConfig
from ssl_vit.model import Classifier, ViT
from ssl_vit.train.checkpoint import CheckpointError, save_encoder
from ssl_vit.train.encoder_init import encoder_from_checkpoint


def test_zero_initialized_head_gives_zero_logits():
    torch.manual_seed(0)
    model = Classifier(ViT(16, 4, 32, 2, 2), num_classes=7, pool="gap")
    assert torch.count_nonzero(model.head.weight) == 0 and torch.count_nonzero(model.head.bias) == 0
    logits = model(torch.randn(3, 3, 16, 16))
    assert logits.shape == (3, 7) and torch.count_nonzero(logits) == 0


def _saved(tmp_path, image_size=16):
    torch.manual_seed(0)
    vit = ViT(image_size, 4, 32, 2, 2)
    cfg = {
        "variant": "",
        "image_size": image_size,
        "patch_size": 4,
        "width": 32,
        "depth": 2,
        "heads": 2,
        "mlp_ratio": 4.0,
    }
    save_encoder(vit, tmp_path / "encoder.safetensors", cfg)
    return vit


def test_encoder_at_higher_resolution_interpolates_positions(tmp_path):
    vit = _saved(tmp_path)
    cfg = ModelConfig(image_size=24)  # shape fields unset: taken from the checkpoint
    enc, cfg, saved = encoder_from_checkpoint(tmp_path, cfg, "bilinear")
    assert enc.grid == (6, 6) and enc.pos_embed.shape == (1, 37, 32)
    assert (cfg.width, cfg.patch_size) == (32, 4) and saved["image_size"] == 16
    assert torch.equal(enc.pos_embed[:, 0], vit.pos_embed[:, 0])  # [class] position kept
    assert torch.equal(enc.patch_embed.weight, vit.patch_embed.weight)
    same, _, _ = encoder_from_checkpoint(tmp_path, ModelConfig(image_size=16))
    assert torch.equal(same.pos_embed, vit.pos_embed)


def test_checkpoint_of_another_architecture_is_a_clear_error(tmp_path):
    _saved(tmp_path)
    line = rf"model.width=64 disagrees with the checkpoint {re.escape(str(tmp_path))} \(width 32\)$"
    with pytest.raises(CheckpointError, match=line):
        encoder_from_checkpoint(tmp_path, ModelConfig(image_size=16, width=64))
