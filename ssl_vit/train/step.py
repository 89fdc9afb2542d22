"""The training step, written once: both pipelines, the benchmark's timings (scripts/bench.py,
the GPU suite) and the host-sync counter run this object, so the figures measure what users run.

One call is one micro-batch: the caller's forward+loss (compiled per `compile.enabled`), backward,
and on the micro-batch that completes an optimizer step the global-norm clip, the optimizer
step skipped on the device when the norm is not finite (`optim.apply_step`) and zeroed grads.
No host sync: the applied flag stays a device tensor until a log step reads it.
Under DDP the compiled region is the wrapped module's forward (`TrainStep._compile`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ssl_vit.model.compile import maybe_compile
from ssl_vit.train.optim import apply_step

__all__ = ["TrainStep"]


class TrainStep:
    """`step(*inputs)` -> `forward(*inputs)`'s output, after backward (and, when the micro-batch
    ends an optimizer step, clip + step + zero grad). `applied` is the last optimizer step's
    flag (a bool tensor on the device: False when its gradient norm was not finite),
    `grad_norm` its gradients' global norm before clipping (on the device).

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
        self.forward = self._compile(forward, compile, compile_mode)
        self.autocast = autocast
        self.applied: bool | torch.Tensor = True
        self.grad_norm: torch.Tensor | None = None
        # The last optimizer step was skipped by the fp16 loss scaler (its gradients overflowed
        # with a finite loss; the scaler lowered its scale): not a bad step (`loop.BadSteps`).
        self.scaler_skipped: bool | torch.Tensor = False
        self._loss_finite: torch.Tensor | None = None  # this step's micro-batches so far

    def _compile(self, forward: Callable[..., Any], setting: bool | str, mode: str) -> Callable:
        """`forward` compiled per `compile.enabled`; under DDP the wrapped module's forward is
        compiled in place instead (`DDP(compiled module)`): Dynamo cannot trace DDP's own
        forward (its reducer's bookkeeping), so compiling `forward` around it would always
        fall back to eager. DDP's forward, gradient hooks and all-reduce stay as they are;
        what `forward` does around the module call (fine-tuning's loss) runs eagerly."""
        if not isinstance(self.model, DistributedDataParallel):
            return maybe_compile(forward, setting, mode, self.device)
        inner = self.model.module
        inner.forward = maybe_compile(inner.forward, setting, mode, self.device)
        return forward

    def __call__(self, *inputs: Any) -> Any:
        acc = self.acc
        with acc.accumulate(self.model) if acc is not None else contextlib.nullcontext():
            with self._autocast():
                out = self.forward(*inputs)
            loss = getattr(out, "loss", out)
            if self._scaler is not None:
                self._note_loss(loss)
            if acc is None:
                loss.backward()
            else:
                acc.backward(loss)
            if acc is None or acc.sync_gradients:
                applied = apply_step(acc, self.model, self.optimizer, self.grad_clip)
                self.applied, self.grad_norm = applied
                self.scaler_skipped = self._scaler_skip(self.applied)
            self.optimizer.zero_grad(set_to_none=True)
        return out

    def _note_loss(self, loss: torch.Tensor) -> None:
        """Whether every micro-batch loss of this step is finite (on the device, no sync)."""
        finite = torch.isfinite(loss.detach()).all()
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite

    def _scaler_skip(self, applied: bool | torch.Tensor) -> bool | torch.Tensor:
        """With a loss scaler (fp16): the step was not applied though its loss was finite, so
        its scaled gradients overflowed, which the scaler handles by lowering its scale. A
        non-finite loss stays a bad step. No scaler: False."""
        loss_finite, self._loss_finite = self._loss_finite, None
        if self._scaler is None:
            return False
        return ~torch.as_tensor(applied, device=self.device) & loss_finite

    @property
    def _scaler(self) -> Any:
        return None if self.acc is None else getattr(self.acc, "scaler", None)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)
