"""A rank's training batches, assembled from its loader workers' messages (`TrainLoader`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ssl_vit.data.stages import Batch, WorkerLoader, end_workers
from ssl_vit.data.stream_state import StreamTracker

__all__ = ["TrainLoader"]


class _Assembled:
    """Iterator of a rank's batches. DataLoader hands out its `workers` workers' messages
    round-robin from worker 0; one message from each holds their shares of the next `workers`
    micro-batches, and micro-batch j is the workers' j-th shares side by side, copied into one
    (pinned, with CUDA) buffer; one worker's message is the batch itself."""

    def __init__(self, it: Iterator[Batch], workers: int) -> None:
        self.it, self.workers = it, workers
        self.pin = torch.cuda.is_available()  # for the copy to the GPU
        self.ready: list[Batch] = []

    def __iter__(self) -> _Assembled:
        return self

    def __next__(self) -> Batch:
        if not self.ready:
            self.ready = self._assemble([next(self.it) for _ in range(self.workers)])
        return self.ready.pop(0)

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A uint8 batch buffer: pinned (the CUDA host allocator caches pinned blocks), or
        NumPy's, whose malloc reuses the freed heap (torch's large blocks page-fault anew each
        batch: 64 images at 224 px took ~1.4x as long to assemble)."""
        if self.pin:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        return torch.from_numpy(np.empty(shape, dtype=np.uint8))

    def _assemble(self, messages: list[Batch]) -> list[Batch]:
        n, first = self.workers, messages[0].images
        if n == 1:  # one worker's message is the batch (pinned by the DataLoader's thread)
            return [messages[0]._replace(position=messages[0].position[0])]
        shares = [len(m.labels) // n for m in messages]  # each worker's share of a micro-batch
        batches = []
        for j in range(n):
            parts = [(m, slice(j * s, (j + 1) * s)) for m, s in zip(messages, shares, strict=True)]
            images = self._empty((sum(shares), *first.shape[1:]))
            # NumPy copies on this thread: torch.cat would wake the OpenMP pool, whose idle
            # spinning takes a core from the loader workers.
            np.concatenate([m.images.numpy()[p] for m, p in parts], out=images.numpy())
            batches.append(
                Batch(
                    images,
                    torch.cat([m.labels[p] for m, p in parts]),
                    skipped=sum(m.skipped for m in messages) if j == 0 else 0,
                    skipped_shards=sum(m.skipped_shards for m in messages) if j == 0 else 0,
                    keys=[k for m, p in parts for k in m.keys[p]],
                    position={lane: q for m, _ in parts for lane, q in m.position[j].items()},
                )
            )
        return batches

    @property
    def _workers(self) -> list[Any]:  # the watchdog names a dead worker (watchdog.dead_workers)
        return getattr(self.it, "_workers", [])

    def _shutdown_workers(self) -> None:  # `end_workers(self)` ends the DataLoader's workers
        end_workers(self.it)


class TrainLoader:
    """A rank's endless training batches (iterate it), and the `tracker` of its lanes'
    positions for checkpoints. Its worker processes end as a `stages.WorkerLoader`'s do."""

    def __init__(self, loader: WorkerLoader, tracker: StreamTracker) -> None:
        self.loader, self.tracker = loader, tracker
        self.dataset, self.num_workers = loader.dataset, loader.num_workers
        self.prefetch_factor = loader.prefetch_factor

    def close(self) -> None:
        """End the worker processes now (iterating again starts new ones)."""
        self.loader.close()

    def __enter__(self) -> TrainLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def lane_share(self) -> int:
        """Images a lane gives each micro-batch (consecutive in every process's batch)."""
        return self.dataset.global_micro // self.dataset.lanes

    def __iter__(self) -> _Assembled:
        return _Assembled(iter(self.loader), max(self.num_workers, 1))
