"""The run plan: every value a job derives from its config and the launch (processes, rank,
device; the precision is the Accelerator's, `acc.mixed_precision`), derived and checked here
once, right after the config is loaded and checked; every module reads it instead of
re-deriving. The only place batch sizes are multiplied or divided.

Each batch figure is named by its scope: `global_` (all processes together) or `local_` (one
process). `train.batch_size` is GLOBAL; it splits over `world` processes x `grad_accum`
micro-steps:

    global_batch = world x grad_accum x local_micro      (train.batch_size: one optimizer step)
    global_micro = world x local_micro                   (one forward pass of every process)
    local_micro                                          (one process's loader batch)
    local_eval   = local_micro                           (one process's evaluation batch)

`local_micro` is what the user sizes to fit memory (with gradients), so an evaluation
batch (no gradients) of that size fits too.

Where the crop and flip run is resolved here too (`augment`: `data.augment`, auto by device;
RandAugment keeps the workers'), with the square size the loaders then deliver (`load_size`):
the checkpoint records the mode and a resume onto another is refused (`train.loop`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ssl_vit.config import ConfigError
from ssl_vit.config.checks import auto_num_workers, check_batch_memory
from ssl_vit.data.device_augment import load_size, resolve_augment

__all__ = ["RunPlan", "build_plan"]


@dataclass(frozen=True)
class RunPlan:
    """The derived values of a training run (a frozen record: read it, never patch it)."""

    world: int  # processes
    rank: int  # this process's index among them
    global_batch: int  # train.batch_size: images per optimizer step, all processes
    grad_accum: int  # micro-steps per optimizer step (gradients summed)
    global_micro: int  # one forward pass of every process together (the training stream's)
    local_micro: int  # one process's micro-batch (its loader's batch)
    local_eval: int  # one process's evaluation batch: local_micro (sized to fit memory)
    num_workers: int  # loader workers per process (data.num_workers, -1 resolved)
    device: str  # e.g. 'cuda:0' or 'cpu'
    # Crop + flip: 'device' (batched, DeviceAugment) or 'workers' (per sample in the loader).
    augment: str = "workers"
    # The square size a loader delivers to a device augmentation (data.load_size, 0 resolved);
    # also the unlabelled stream's, which is augmented on the device under either mode.
    load_size: int = 0
    paired: bool = False  # mixup / cutmix pair images of a micro-batch (BatchMixer)
    # Self-training (distill.enabled): the unlabelled stream's global micro-batch,
    # distill.ratio x global_micro (0: no unlabelled stream).
    global_unlabelled_micro: int = 0

    def micro_steps(self, step: int) -> range:
        """The micro-batches of optimizer step `step` (1-based), numbered over the run
        (their draws are seeded by that number: the same on any number of processes)."""
        return range((step - 1) * self.grad_accum, step * self.grad_accum)


def build_plan(cfg: Any, world: int, *, rank: int = 0, device: str = "cpu") -> RunPlan:
    """The plan of `cfg` (a checked job config) for process `rank` of `world`; an impossible
    split is one ConfigError line naming the key."""
    tc = cfg.train
    per_step = world * tc.grad_accum
    if tc.batch_size % per_step:
        raise ConfigError(
            f"train.batch_size: {tc.batch_size} is not divisible by processes x grad_accum "
            f"= {world} x {tc.grad_accum}"
        )
    global_micro, local_micro = tc.batch_size // tc.grad_accum, tc.batch_size // per_step
    parts = getattr(cfg, "parts", None)
    paired = parts is not None and parts.mixes
    if paired and global_micro % 2:
        # Mixing pairs images within a lane's share of the micro-batch (BatchMixer); the
        # training stream checks that share once it has resolved its lanes.
        raise ConfigError(
            f"parts.mixup/cutmix: need an even batch per step, got train.batch_size / "
            f"train.grad_accum = {global_micro}"
        )
    distill = getattr(cfg, "distill", None)
    unlabelled = 0
    if distill is not None and distill.enabled:  # ratio x as many unlabelled images beside
        size = cfg.model.image_size
        check_batch_memory("distill.ratio", distill.ratio, local_micro, size)
        unlabelled = global_micro * distill.ratio
    # RandAugment (parts.randaugment) works on PIL images after the crop: the workers crop too.
    randaugment = parts is not None and bool(parts.randaugment)
    augment = "workers" if randaugment else resolve_augment(cfg.data.augment, device)
    return RunPlan(
        world=world,
        rank=rank,
        global_batch=tc.batch_size,
        grad_accum=tc.grad_accum,
        global_micro=global_micro,
        local_micro=local_micro,
        local_eval=local_micro,
        num_workers=auto_num_workers(cfg.data.num_workers),
        device=device,
        augment=augment,
        load_size=load_size(cfg.data.load_size, cfg.model.image_size),
        paired=paired,
        global_unlabelled_micro=unlabelled,
    )
