"""Named ViT variants as data (paper Table 1, plus Ti and S from DeiT / big_vision).

In the config layer: `ModelConfig.resolved` fills width, depth and heads from them as the config
loads, and the model builds from the filled config only."""

from __future__ import annotations

from ssl_vit.config.loader import ConfigError

__all__ = ["VARIANTS", "resolve_variant"]

# name -> (width, depth, heads); the MLP is 4x the width in all of them.
VARIANTS: dict[str, tuple[int, int, int]] = {
    "Ti": (192, 12, 3),
    "S": (384, 12, 6),
    "B": (768, 12, 12),
    "L": (1024, 24, 16),
    "H": (1280, 32, 16),
}


def resolve_variant(name: str) -> dict[str, int]:
    """'B' -> {width, depth, heads}; 'B/16' also sets patch_size=16."""
    base, _, patch = name.partition("/")
    if base not in VARIANTS:
        raise ConfigError(f"model.variant: unknown '{name}' (known: {', '.join(VARIANTS)})")
    width, depth, heads = VARIANTS[base]
    out = {"width": width, "depth": depth, "heads": heads}
    if patch:
        if not patch.isdigit():
            raise ConfigError(f"model.variant: patch size in '{name}' must be an integer")
        out["patch_size"] = int(patch)
    return out
