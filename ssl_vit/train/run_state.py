"""What a checkpoint records of how the run ran, besides weights and stream: the fp16 loss
scaler's state, and the augmentation mode `data.augment` resolved to (device or workers).

Both differ between machines (the scaler exists only with fp16 on CUDA; `data.augment: auto`
resolves by device type), so a resume must restore the first and compare the second: a run
that resumes onto another augmentation would silently become another run.
"""

from __future__ import annotations

from typing import Any

from ssl_vit.config import ConfigError

__all__ = ["augment_state", "check_augment_mode", "load_scaler_state", "scaler_state"]


def scaler_state(acc: Any) -> dict[str, Any] | None:
    """The loss scaler's state (scale, growth tracker) with fp16; None without a scaler."""
    scaler = getattr(acc, "scaler", None)
    return None if scaler is None else scaler.state_dict()


def load_scaler_state(acc: Any, saved: dict[str, Any] | None) -> None:
    """Restore the scaler (fp16): the resumed run continues at the saved scale, not at 2^16.
    A checkpoint without one (a bf16 or fp32 run) leaves the scaler at its start."""
    scaler = getattr(acc, "scaler", None)
    if scaler is not None and saved:
        scaler.load_state_dict(saved)


def augment_state(augment: Any) -> dict[str, Any]:
    """The rng entry "augment": the resolved mode, and the device generator's state."""
    if augment is None:
        return {"mode": "workers"}
    return {"mode": "device", **augment.state_dict()}


def check_augment_mode(saved: dict[str, Any] | None, augment: Any, path: Any) -> None:
    """One error line when this run's augmentation (`augment`: the device augmentation or
    None) is not the checkpoint's: another augmentation is another run."""
    # The mode the checkpoint records (older ones: None under workers, the generator state
    # under device).
    was = "workers" if saved is None else saved.get("mode", "device")
    now = "workers" if augment is None else "device"
    if was != now:
        raise ConfigError(
            f"data.augment: the run in {path} was trained with {was!r} augmentation, this "
            f"job resolves it to {now!r} (data.augment=auto: device on CUDA, workers "
            f"elsewhere); set data.augment={was} to continue it"
        )
