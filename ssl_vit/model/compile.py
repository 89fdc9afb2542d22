"""torch.compile of a step's forward+loss (or of feature extraction), where it pays, with a
fallback to eager that never kills a job.

`compile.enabled`: `auto` compiles on CUDA and runs eagerly elsewhere (on a CPU the compile time
is not won back by short jobs); `true` / `false` force it. `compile.mode` is torch's:
`default`, `reduce-overhead` (CUDA graphs: for small models whose step is launch-bound) or
`max-autotune`. The region is compiled with fullgraph=True: the corruption draws are made
outside it (objectives.corruption.draw_corruption), so it is one graph; a graph break is a
bug, and is reported like any other compile failure.

Compilation is lazy: it happens at the first call, so that is where a failure shows. Then
the region runs eagerly from there on, after ONE warning line; the job goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Compiled", "compile_enabled", "maybe_compile"]

log = logging.getLogger(__name__)

BACKEND: str | Callable = "inductor"  # torch.compile's backend (tests swap in a CPU-cheap one)


def compile_enabled(setting: bool | str, device: torch.device | str) -> bool:
    """`compile.enabled` (true, false or "auto": on CUDA only) for a job on `device`."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return bool(setting)


class Compiled:
    """`fn` compiled (fullgraph) on first call; on a compile failure there, `fn` itself from
    then on, after one warning. Later calls go straight to whichever won."""

    def __init__(self, fn: Callable, mode: str = "default", backend: str | Callable | None = None):
        self.fn, self.name = fn, getattr(fn, "__name__", type(fn).__name__)
        self.compiled: Callable | None = torch.compile(
            fn,
            fullgraph=True,
            mode=None if mode == "default" else mode,
            backend=BACKEND if backend is None else backend,
        )
        self.first = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.fn(*args, **kwargs)
        if not self.first:
            return self.compiled(*args, **kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compiler error: eager is always correct
            cause: BaseException = e  # the compiler's own error, not dynamo's wrapper
            while (inner := getattr(cause, "inner_exception", cause.__cause__)) is not None:
                cause = inner
            first_line = (str(cause).strip().splitlines() or [""])[0][:200]
            log.warning(
                "torch.compile of %s failed, running it eagerly: %s: %s",
                *(self.name, type(cause).__name__, first_line),
            )
            self.compiled = None
            return self.fn(*args, **kwargs)
        self.first = False
        return out


def maybe_compile(
    fn: Callable, setting: bool | str, mode: str, device: torch.device | str
) -> Callable:
    """`Compiled(fn, mode)` when `compile.enabled` (`setting`) is on for `device`, else `fn`."""
    return Compiled(fn, mode) if compile_enabled(setting, device) else fn
