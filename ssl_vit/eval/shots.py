"""Shot counts as keys and in order: what the few-shot job writes and the report and the study
read back. No torch here, so that `ssl-vit report` starts without importing it."""

from __future__ import annotations

from typing import Literal

__all__ = ["ALL_SHOTS", "Shot", "shot_key", "shot_order"]

# The shot count meaning "every train sample": a full linear probe. Summary key "allshot",
# table heading "all-shot", like "5shot" / "5-shot".
ALL_SHOTS = "all"
Shot = int | Literal["all"]


def shot_key(k: int | str) -> Shot:
    """A shot count as used in memory: 5 or "5" (a JSON key read back) -> 5; "all" -> "all"."""
    return ALL_SHOTS if k == ALL_SHOTS else int(k)


def shot_order(k: int | str) -> tuple[int, int]:
    """Sort key: counts ascending, then "all"."""
    k = shot_key(k)
    return (1, 0) if k == ALL_SHOTS else (0, k)
