"""ssl-vit: masked patch prediction pretraining for Vision Transformers.

The public API used by jobs and outside code; everything else lives in the sub-packages
(`model`, `objectives`, `train`, `data`, `eval`). The names are imported on first use (PEP
562), so that `import ssl_vit.cli` (`ssl-vit --help`, `ssl-vit configs`) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it.
_API = {
    "MaskedPatchPrediction": "ssl_vit.objectives.masked_patch",
    "ViT": "ssl_vit.model.vit",
    "build_vit": "ssl_vit.model.vit",
    "cell_color_classes": "ssl_vit.objectives.targets",
    "corrupt_patches": "ssl_vit.objectives.corruption",
    "interpolate_pos_embed": "ssl_vit.model.pos_embed",
    "mean_color_classes": "ssl_vit.objectives.targets",
    "patch_pixels": "ssl_vit.objectives.targets",
    "ridge_accuracies": "ssl_vit.eval.fewshot",
}
__all__ = sorted(_API)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'ssl_vit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
