"""Shot counts as keys and in order: what the few-shot job writes and the report and the study
read back. No torch here, so that `ssl-vit report` starts without importing it."""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["ALL_SHOTS", "Shot", "format_summary", "percent", "shot_key", "shot_order"]

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


def percent(x: Any) -> str:
    """A fraction as '52.0%' ('n/a' for what is no number: a null in a results file, or the
    NaN of an accuracy over no image)."""
    return f"{100 * x:.1f}%" if isinstance(x, int | float) and x == x else "n/a"  # NaN != NaN


def format_summary(summary: dict[str, Any]) -> str:
    """A few-shot summary {"5shot": 0.52, "allshot": 0.6, ...} as '5-shot 52.0%, all-shot
    60.0%, ...', for log lines and model cards."""
    return ", ".join(f"{k.replace('shot', '-shot')} {percent(v)}" for k, v in summary.items())
