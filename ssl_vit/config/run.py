"""Sections every job shares besides its training: torch.compile, experiment trackers and
timeouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ssl_vit.config.checks import check_positive
from ssl_vit.config.frozen import Frozen
from ssl_vit.errors import ConfigError

__all__ = [
    "CompileConfig",
    "CollectiveTimeoutConfig",
    "DataTimeoutConfig",
    "TimeoutConfig",
    "check_trackers",
]


@dataclass
class CompileConfig(Frozen):
    """torch.compile of the step's forward+loss and of few-shot feature extraction. A compile
    failure falls back to eager with one warning."""

    enabled: bool | Literal["auto"] = "auto"  # auto: on CUDA only (a CPU job does not win it back)
    # torch's mode: default | reduce-overhead (CUDA graphs, for small models) | max-autotune
    mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"


@dataclass
class DataTimeoutConfig(Frozen):
    """How long a job waits before it fails (a stalled pipe, a rank gone) instead of hanging."""

    # A wait for one batch longer than this (a stalled pipe: command, FIFO or mount) ends the
    # job with exit 1; covers loader start-up and the evaluation loaders too.
    data_s: float = 600.0

    def validate(self) -> None:
        check_positive("timeouts.", self, tuple(self.__dataclass_fields__))


@dataclass
class CollectiveTimeoutConfig(DataTimeoutConfig):
    """How long a job waits before it fails (a stalled pipe, a rank gone) instead of hanging."""

    # A collective (all-reduce, barrier) waiting this long for another rank fails the job.
    dist_s: float = 1800.0


@dataclass
class TimeoutConfig(CollectiveTimeoutConfig):
    """How long a job waits before it fails (a stalled pipe, a rank gone) instead of hanging."""

    # After SIGTERM / SIGINT the job checkpoints and exits; if that takes longer (a rank gone),
    # it exits 1 without a new checkpoint.
    stop_s: float = 300.0


def check_trackers(names: list[str]) -> None:
    """Each of `trackers` one Accelerate knows and whose package is installed: checked here,
    before the run directory is claimed, so a missing package leaves nothing behind (imported
    only when asked for)."""
    if names:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

        available = {str(t) for t in get_available_trackers()}
        for name in names:
            if name not in LOGGER_TYPE_TO_CLASS:
                raise ConfigError(
                    f"trackers: unknown tracker {name!r}, one of {sorted(LOGGER_TYPE_TO_CLASS)}"
                )
            if name not in available:
                raise ConfigError(
                    f"trackers: tracker {name!r} needs its package {name!r}, "
                    f"which is not installed: pip install {name}"
                )
