"""Measurement machinery of scripts/bench.py: training steps, interleaved medians, the matmul
peak, model FLOPs, peak resident memory.

Timings on a shared machine drift; `time_interleaved` runs every contender in alternating
rounds (A B C, C B A, ...) so that a slow phase of the machine hits all of them alike, and the
ratios of medians stay fair even when the absolute numbers are depressed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.train.step import TrainStep

__all__ = [
    "MODEL_KEYS",
    "PeakRSS",
    "autocast_dtype",
    "cpu_has_native_bf16",
    "make_train_step",
    "matmul_step",
    "plain_train_step",
    "step_flops",
    "sync",
    "time_interleaved",
]

MODEL_KEYS = ("image_size", "patch_size", "width", "depth", "heads")  # of a benchmark shape
DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """'no' -> None (full precision), 'bf16' / 'fp16' -> the autocast dtype."""
    return None if precision == "no" else DTYPES[precision]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX; Linux flags).
    Elsewhere oneDNN emulates bf16, which is only slower, so the bf16 contenders are skipped."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    generator: torch.Generator,
    precision: str = "no",
    grad_clip: float = 1.0,
) -> Callable[[], torch.Tensor]:
    """One pretraining step as the pipelines run it: `ssl_vit.train.step.TrainStep` (forward
    under autocast, backward, global-norm clip, the optimizer step skipped on the device when
    the norm is not finite, zero grads). `model(images, model.draw_noise(B, generator))`
    returns the loss (or an object with `.loss`); the optimizer must be a fused one (it skips
    a step on the device: `build_adam`). Without an Accelerator: Accelerate allows one
    precision per process, and the benchmark times several in alternating rounds."""
    train_step = TrainStep(model, optimizer, model, grad_clip, autocast=autocast_dtype(precision))

    def step() -> torch.Tensor:
        noise = model.draw_noise(len(images), generator)  # outside the compiled forward
        out = train_step(images, noise)
        return getattr(out, "loss", out).detach()

    return step


def plain_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    generator: torch.Generator,
    grad_clip: float = 1.0,
) -> Callable[[], torch.Tensor]:
    """What a timm user's loop does by default (the `timm_default` contender): fp32, backward,
    `clip_grad_norm_`, a plain `optimizer.step()` (timm's AdamW: no on-device skip)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> torch.Tensor:
        loss = model(images, model.draw_noise(len(images), generator))
        loss = getattr(loss, "loss", loss)
        loss.backward()
        if grad_clip > 0:
            nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def matmul_step(n: int, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """One n x n x n matmul (2 n^3 FLOPs) into a preallocated output."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    return lambda: torch.matmul(a, b, out=c)


def step_flops(step: Callable[[], object]) -> int:
    """FLOPs of one call (matmuls, convolutions, attention; forward and backward), counted by
    torch's FlopCounterMode: the model FLOPs, independent of how fast the kernels are."""
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    rounds: int = 3,
    steps: int = 3,
    warmup: int = 2,
) -> dict[str, list[float]]:
    """Seconds per call of every function, `steps` calls per round, rounds alternating in
    order (forward, reversed, ...), after `warmup` untimed calls each."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
        sync(device)
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            for _ in range(steps):
                t0 = time.perf_counter()
                fns[name]()
                sync(device)
                times[name].append(time.perf_counter() - t0)
    return times


class PeakRSS:
    """Peak resident memory (MB) of this process plus its children (DataLoader workers),
    sampled every `interval` seconds while the `with` block runs."""

    def __init__(self, interval: float = 0.02) -> None:
        import psutil

        self._proc, self._interval = psutil.Process(), interval
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample_mb(self) -> float:
        total = 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:  # a worker that exited between listing and reading
                continue
        return total / 2**20

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self.sample_mb())
            self._stop.wait(self._interval)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, self.sample_mb())
