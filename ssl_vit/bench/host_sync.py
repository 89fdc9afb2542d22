"""The host-sync rows of the GPU suite (ssl_vit.bench.gpu_suite): the pretraining step as
pipelines/pretrain.py runs it, its `aten._local_scalar_dense` calls counted (any device: each
is a device -> host read), and N steps under `torch.cuda.set_sync_debug_mode("error")` (CUDA:
any synchronizing call raises; the first one is reported with our line that made it)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ssl_vit.bench.timing import MODEL_KEYS
from ssl_vit.config.schema import ModelConfig, ObjectiveConfig, OptimConfig

__all__ = ["HostReads", "error_line", "sync_count_row", "sync_debug_row"]

aten = torch.ops.aten
# Ops that read a device value on the host (on a GPU: a sync, the step waits for the queue),
# or whose output size depends on data (the same), and the op behind torch.tensor(<Python
# data>) (on a GPU: a host-to-device copy). aten.scalar_tensor is not one: on a GPU it is a
# fill kernel with the value as an argument.
SYNC_OPS = {
    aten._local_scalar_dense,
    aten.item,
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.masked_select,
    aten.bincount,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
}
FROM_PYTHON_OPS = {aten.lift_fresh, aten.lift_fresh_copy}


class HostReads(TorchDispatchMode):
    """Records (step, op) of every op in SYNC_OPS | FROM_PYTHON_OPS while active, on any
    device (on a CPU this proves what a GPU would wait for). `step` is set by the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.step, self.active, self.events = 0, True, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active and func.overloadpacket in SYNC_OPS | FROM_PYTHON_OPS:
            self.events.append((self.step, str(func)))
        return func(*args, **(kwargs or {}))

    @property
    def syncs(self) -> int:
        """Device -> host reads and data-dependent shapes seen (Python-data tensors apart)."""
        return sum(op.split(".")[0] != "aten.lift_fresh" for _, op in self.events)


def error_line(e: BaseException) -> str:
    """A failure as a table cell: its type and the first line of its message (300 characters)."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"error: {type(e).__name__}: {first[:300]}"


def training_step(shape: dict, dev: torch.device, precision: str) -> Callable[[], None]:
    """The pretraining step as pipelines/pretrain.py runs it (device augmentation, the model
    under Accelerate, its `TrainStep`, the on-device statistics)."""
    from accelerate import Accelerator

    from ssl_vit.data.device_augment import DeviceAugment
    from ssl_vit.model import build_vit
    from ssl_vit.objectives import MaskedPatchPrediction, draw_corruption
    from ssl_vit.train.loop import StepStats
    from ssl_vit.train.optim import build_adam
    from ssl_vit.train.step import TrainStep

    acc = Accelerator(mixed_precision=precision, cpu=dev.type != "cuda")
    mcfg = ModelConfig(**{k: shape[k] for k in MODEL_KEYS})
    model = MaskedPatchPrediction(build_vit(mcfg), ObjectiveConfig()).to(dev)
    optimizer = build_adam(model, OptimConfig())
    model, optimizer = acc.prepare(model, optimizer)
    train_step = TrainStep(model, optimizer, model, OptimConfig().grad_clip, acc=acc)
    augment = DeviceAugment(shape["image_size"], torch.Generator(dev).manual_seed(0))
    gen = torch.Generator(dev).manual_seed(1)
    stats = StepStats({"loss": 1, "micro": 1, "kinds": 4}, dev)
    size, batch = shape["image_size"], shape["batch"]
    num_patches = (size // shape["patch_size"]) ** 2
    loaded = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=dev)

    def step() -> None:
        images = augment(loaded)
        noise = draw_corruption(batch, num_patches, gen, dev)  # outside the compiled region
        out = train_step(images, noise)
        stats.add(loss=out.loss, micro=1, kinds=out.kind_counts())
        stats.end_step(train_step.applied)

    return step


def sync_count_row(shape: dict, device: torch.device, precision: str) -> dict:
    """Device -> host reads per step (`.item()`, `float()`, ...), counted over 3 steps."""
    step, steps = training_step(shape, device, precision), 3
    step()
    with HostReads() as reads:
        for _ in range(steps):
            step()
    n = sum(op == "aten._local_scalar_dense.default" for _, op in reads.events)
    return {"steps": steps, "host_syncs_per_step": n / steps}


def sync_debug_row(shape: dict, device: torch.device, precision: str) -> dict:
    """20 steps with every synchronizing CUDA call an error: sync_free, or the first one."""
    step, steps = training_step(shape, device, precision), 20
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(steps):
            try:
                step()
            except RuntimeError as e:  # the first synchronizing call, and our line that made it
                ours = [f for f in traceback.extract_tb(e.__traceback__) if "ssl_vit" in f.filename]
                where = [f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in ours[-2:]]
                return {
                    "steps_ok": i,
                    "sync_free": False,
                    "first_sync": error_line(e),
                    "where": where,
                }
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return {"steps_ok": steps, "sync_free": True}
