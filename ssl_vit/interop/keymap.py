"""Key tables written once and applied in both directions, plus the checks shared by formats.

A table is a list of (ours, theirs) key templates; `{i}` stands for a block index and `{p}`
for `weight` or `bias`. `rename(state, table)` maps our keys to theirs, `rename(..., reverse=
True)` theirs to ours; keys matching no template are returned separately so that callers can
name them in an error instead of dropping them silently.
"""

from __future__ import annotations

import math
import re
from functools import cache
from typing import Any

import torch

from ssl_vit.config.schema import ModelConfig
from ssl_vit.errors import InputError
from ssl_vit.model.shapes import expected_shapes, size_mismatch

__all__ = ["InteropError", "check_complete", "check_model_config", "mlp_ratio_for", "rename"]

Table = list[tuple[str, str]]

# Our model_config fields, all of which have a timm / transformers counterpart (norm_eps only in
# transformers); a field added later is refused on export until its mapping is written.
KNOWN_CONFIG = (
    "variant",
    "image_size",
    "patch_size",
    "width",
    "depth",
    "heads",
    "mlp_ratio",
    "norm_eps",
)


class InteropError(InputError):
    """Weights or a shape that do not map between ssl-vit and timm / transformers (one line)."""


@cache
def _pattern(template: str) -> re.Pattern[str]:
    body = (
        re.escape(template)
        .replace(r"\{i\}", r"(?P<i>\d+)")
        .replace(r"\{p\}", r"(?P<p>weight|bias)")
    )
    return re.compile(f"^{body}$")


def rename(
    state: dict[str, torch.Tensor], table: Table, reverse: bool = False
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(renamed state, keys matching no template). reverse=False: ours -> theirs."""
    out, unmatched = {}, []
    for key, value in state.items():
        for ours, theirs in table:
            src, dst = (theirs, ours) if reverse else (ours, theirs)
            m = _pattern(src).match(key)
            if m:
                out[dst.format(**m.groupdict())] = value
                break
        else:
            unmatched.append(key)
    return out, sorted(unmatched)


def check_model_config(cfg: dict[str, Any], target: str) -> None:
    """Raise if the checkpoint's model config has a field `target` has no equivalent for."""
    unknown = sorted(set(cfg) - set(KNOWN_CONFIG))
    if unknown:
        raise InteropError(
            f"model config field(s) {unknown} have no {target} equivalent "
            f"(known: {', '.join(KNOWN_CONFIG)})"
        )


def mlp_ratio_for(hidden: int, width: int) -> float:
    """The float r with int(width * r) == hidden (what timm and our ViT compute)."""
    r = hidden / width
    while int(width * r) < hidden:  # hidden/width * width can round to just below hidden
        r = math.nextafter(r, math.inf)
    return r


def check_complete(
    state: dict[str, torch.Tensor], cfg: dict[str, Any], source: str, unexpected: list[str]
) -> None:
    """Raise listing missing / unexpected keys and wrong shapes of an imported encoder."""
    # The sizes first, by arithmetic: building the expected model even on the meta device takes
    # time and memory in the depth a config.json claims (10^6 layers: minutes, gigabytes).
    present = {k: tuple(v.shape) for k, v in state.items()}
    model_cfg = ModelConfig.from_saved(cfg)
    if {"pos_embed", "patch_embed.weight"} <= set(present):
        why = size_mismatch(model_cfg, present, claim="its config")
        if why is not None:
            raise InteropError(f"{source}: {why}")
    shapes = expected_shapes(model_cfg)
    missing = sorted(set(shapes) - set(state))
    if missing or unexpected:
        raise InteropError(
            f"{source}: weights do not fit a ViT encoder: missing {missing or 'none'}; "
            f"unexpected {unexpected or 'none'}"
        )
    wrong = [
        f"{k} {tuple(state[k].shape)} != {shapes[k]}"
        for k in shapes
        if tuple(state[k].shape) != shapes[k]
    ]
    if wrong:
        raise InteropError(f"{source}: wrong shapes: {'; '.join(wrong)}")
