"""The ViT encoder: shapes, variants, parameter counts, the split at the patch embeddings."""

import pytest
import torch

from ssl_vit.config import ModelConfig
from ssl_vit.config.variants import VARIANTS
from ssl_vit.model import ViT, build_vit


def test_shapes_and_split_equals_full_forward():
    torch.manual_seed(0)
    vit = ViT((16, 24), 4, 32, 2, 4)
    x = torch.randn(2, 3, 16, 24)
    emb = vit.embed_patches(x)
    assert emb.shape == (2, 4 * 6, 32)
    tokens = vit.encode(emb)
    assert tokens.shape == (2, 1 + 24, 32)
    assert torch.equal(tokens, vit.forward_features(x))
    assert vit.pool(tokens, "cls").shape == (2, 32)
    assert torch.allclose(vit.pool(tokens, "gap"), tokens[:, 1:].mean(1))


def test_patch_projection_is_a_linear_map_of_flattened_patches():
    torch.manual_seed(0)
    vit = ViT(8, 4, 16, 1, 2)
    x = torch.randn(1, 3, 8, 8)
    # Patch (row 1, col 0), flattened channel-major like the conv weight.
    patch = x[0, :, 4:8, 0:4].reshape(-1)
    w = vit.patch_embed.weight.reshape(16, -1)
    expected = w @ patch + vit.patch_embed.bias
    assert torch.allclose(vit.embed_patches(x)[0, 2], expected, atol=1e-5)


def test_attention_matches_explicit_softmax():
    torch.manual_seed(0)
    vit = ViT(8, 4, 16, 1, 2)
    attn = vit.blocks[0].attn
    x = torch.randn(2, 5, 16)
    q, k, v = attn.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
    weights = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1)
    ref = attn.proj((weights @ v).transpose(1, 2).reshape(2, 5, 16))
    assert torch.allclose(attn(x), ref, atol=1e-5)


@pytest.mark.parametrize("name, params_m", [("Ti", 5.5), ("S", 21.7), ("B", 85.8)])
def test_variant_parameter_counts(name, params_m):
    # Known counts of ViT-{Ti,S,B}/16 at 224 px without a head (timm: 5.5M, 21.7M, 85.8M).
    cfg = ModelConfig(variant=f"{name}/16", image_size=224).resolved()
    cfg.validate()
    with torch.device("meta"):  # the count only: no 86M random numbers drawn (1.6 s for B)
        n = sum(p.numel() for p in build_vit(cfg).parameters())
    assert n / 1e6 == pytest.approx(params_m, abs=0.1)
    assert (cfg.width, cfg.depth, cfg.heads) == VARIANTS[name]


def test_build_requires_a_shape():
    with pytest.raises(ValueError, match="model.variant"):
        build_vit(ModelConfig(image_size=32, patch_size=4))


def test_layer_outputs_equal_the_truncated_model():
    """Block i's output from one pass is the residual stream of the model cut after block i
    (depth i + 1, same weights): the final LN of the cut model applied to it gives the cut
    model's features exactly; the last block's output is forward_features' own."""
    torch.manual_seed(0)
    vit = ViT(16, 4, 32, 3, 4).eval()
    x = torch.randn(2, 3, 16, 16)
    outs = vit.forward_features(x, layers=[0, 1, 2])
    assert len(outs) == 3 and all(o.shape == (2, 17, 32) for o in outs)
    state = vit.state_dict()
    for i in range(3):
        cut = ViT(16, 4, 32, i + 1, 4).eval()
        cut.load_state_dict(
            {k: v for k, v in state.items() if not k.startswith("blocks.") or int(k[7]) <= i}
        )
        features = cut.forward_features(x)
        assert torch.equal(outs[i] if i == 2 else vit.norm(outs[i]), features)
    assert torch.equal(outs[2], vit.forward_features(x))
    # Negative indices count from the end; a subset comes back in block order, deduplicated.
    sub = vit.forward_features(x, layers=[-1, 0, 2])
    assert len(sub) == 2 and torch.equal(sub[0], outs[0]) and torch.equal(sub[1], outs[2])
    with pytest.raises(ValueError, match="layer 3"):
        vit.forward_features(x, layers=[3])


def test_cls_plus_gap_pool_is_the_concatenation():
    tokens = torch.randn(2, 5, 8)
    both = ViT.pool(tokens, "cls+gap")
    assert both.shape == (2, 16)
    assert torch.equal(both[:, :8], tokens[:, 0])
    assert torch.allclose(both[:, 8:], tokens[:, 1:].mean(1))
