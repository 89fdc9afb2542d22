"""The random state of one rank (Python, NumPy, torch CPU and CUDA, an explicit generator),
as plain values a checkpoint stores and `torch.load(weights_only=True)` reads back."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """Python, NumPy, torch (CPU and CUDA) and an explicit generator's states of this rank."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    cuda = torch.cuda.is_available()
    state = {
        "python": random.getstate(),
        # As plain values: checkpoints load with weights_only=True, which refuses NumPy arrays.
        "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        # This process's own device only: another node may have fewer GPUs (issue 38).
        "cuda": torch.cuda.get_rng_state(torch.cuda.current_device()) if cuda else None,
    }
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    # This process's own device (another node may have fewer GPUs).
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())
    if generator is not None and state.get("generator") is not None:
        generator.set_state(state["generator"])
