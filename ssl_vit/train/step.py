"""The training step, written once: both pipelines, the benchmark's timings (scripts/bench.py,
the GPU suite) and the host-sync counter run this object, so the figures measure what users run.

One call is one micro-batch: the caller's forward+loss (compiled per `compile.enabled`), backward,
and on the micro-batch that completes an optimizer step the global-norm clip, the optimizer
step skipped on the device when the norm is not finite (`optim.apply_step`) and zeroed grads.
No host sync: the applied flag stays a device tensor until a log step reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ssl_vit.train.compile import maybe_compile
from ssl_vit.train.optim import apply_step

__all__ = ["TrainStep"]


class TrainStep:
    """`step(*inputs)` -> `forward(*inputs)`'s output, after backward (and, when the micro-batch
    ends an optimizer step, clip + step + zero grad). `applied` is the last optimizer step's
    flag (a bool tensor on the device: False when its gradient norm was not finite).

    forward: the caller's forward+loss; its output is the loss or has a `.loss`.
    acc: the job's Accelerator (gradient accumulation, DDP's no_sync, the fp16 scaler; its
        prepared model applies autocast). None: one process, plain `backward()`, and
        `autocast` (a dtype, or None for full precision) around the forward: the benchmark,
        which times several precisions in one process (Accelerate allows one per process).
    compile / compile_mode: `compile.enabled` / `compile.mode` for the forward
        (`compile.maybe_compile`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        forward: Callable[..., Any],
        grad_clip: float,
        acc: Any = None,
        autocast: torch.dtype | None = None,
        compile: bool | str = False,
        compile_mode: str = "default",
    ) -> None:
        self.model, self.optimizer, self.grad_clip, self.acc = model, optimizer, grad_clip, acc
        self.device = next(model.parameters()).device
        self.forward = maybe_compile(forward, compile, compile_mode, self.device)
        self.autocast = autocast
        self.applied: bool | torch.Tensor = True

    def __call__(self, *inputs: Any) -> Any:
        acc = self.acc
        with acc.accumulate(self.model) if acc is not None else contextlib.nullcontext():
            with self._autocast():
                out = self.forward(*inputs)
            loss = getattr(out, "loss", out)
            if acc is None:
                loss.backward()
            else:
                acc.backward(loss)
            if acc is None or acc.sync_gradients:
                self.applied = apply_step(acc, self.model, self.optimizer, self.grad_clip)
            self.optimizer.zero_grad(set_to_none=True)
        return out

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)
