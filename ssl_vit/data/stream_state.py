"""What a training stream is and where it stands: lanes, the stream's identity, its position.

The stream is `lanes` sequential lanes (see `train_stream`); every micro-batch takes the same
number of samples from each lane, in lane order. The number of lanes is fixed for a run; the
ranks and loader workers that read them are not, so a position saved by one cluster shape is
continued by any other. `StreamTracker` records the position of every lane after the last
*consumed* batch (prefetched ones do not count) and gathers all ranks' lanes into the state a
checkpoint holds; `start_stream` checks a saved state against the stream about to start and
refuses, in one line, a stream it cannot continue (other shards, seed, shuffle or lanes).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ssl_vit.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "MAX_AUTO_LANES",
    "StreamArgs",
    "StreamTracker",
    "check_same_stream",
    "lane_range",
    "resolve_lanes",
    "source_id",
    "start_stream",
]

MAX_AUTO_LANES = 64  # enough readers for 8 workers on each of 8 GPUs

Position = tuple[int, int]  # (visit, samples of that visit consumed)


@dataclass(frozen=True)
class StreamArgs:
    """Where a training stream's reader sits, as the run plan and the loop decided it
    (`loop.stream_args`); the loaders read it and derive none of it again."""

    global_micro: int  # the global micro-batch (`RunPlan.global_micro`): each lane gives 1/lanes
    num_workers: int  # loader workers per process (`RunPlan.num_workers`, resolved)
    image_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    resume: dict | None = None  # a `StreamTracker.state_dict()` (any processes and workers)
    load_size: int | None = None  # un-augmented uint8 [B,3,L,L] images for `DeviceAugment`
    max_consecutive_failures: int = 1000


def source_id(names: Sequence[str]) -> str:
    """A short identity of the shard list (or a source): a local file by its name and size,
    not its directory, so a dataset moved or mounted elsewhere still continues; anything else
    (a `pipe:` command, a URL, a folder) by its text."""
    parts = [
        f"{os.path.basename(n)}:{os.path.getsize(n)}" if os.path.isfile(n) else n for n in names
    ]
    digest = hashlib.sha256("\n".join(parts).encode())
    return f"{len(names)} shards/{digest.hexdigest()[:12]}"


def resolve_lanes(
    requested: int,
    global_micro: int,
    world_size: int,
    saved: int | None,
    shards: int = 0,
    paired: bool = False,
) -> int:
    """`data.lanes` (0: auto) -> the stream's lane count, checked against the global
    micro-batch (each lane gives global_micro / lanes samples) and the processes (each takes
    lanes / world_size whole lanes). Auto: the saved count when resuming, otherwise the largest
    divisor of the micro-batch up to 64 and up to `shards` (> 0: a lane per shard at most, so
    that no shard is read by several lanes; an indexed source's samples count here). That
    count does not depend on the processes or workers (the sample order depends on the lanes),
    except where it cannot split over the processes (fewer shards than processes): then the
    fewest lanes that do, sharing shards (each lane keeps its share of a shard's samples).
    `paired` (mixup / cutmix pair images within a lane's share, `BatchMixer`): the share must
    be even (the micro-batch is: `train.plan`)."""
    cap = min(MAX_AUTO_LANES, shards) if shards else MAX_AUTO_LANES
    n = global_micro // 2 if paired else global_micro
    lanes = requested or saved or max(d for d in range(1, min(n, cap) + 1) if n % d == 0)
    if not (requested or saved) and lanes % world_size:
        split = [d for d in range(world_size, n + 1, world_size) if n % d == 0]
        if split:
            log.info(
                "data.lanes (auto): %d lanes over %d shard(s), shared, to split over %d "
                "processes; set data.lanes for the same sample order on any number of them",
                split[0], shards, world_size,
            )  # fmt: skip
            lanes = split[0]
    how = "" if requested else " (auto)"
    if global_micro % lanes:
        raise ConfigError(
            f"data.lanes: {lanes}{how} does not divide the global micro-batch {global_micro} "
            "(train.batch_size / train.grad_accum); set data.lanes to a divisor of it"
        )
    if paired and (global_micro // lanes) % 2:
        raise ConfigError(
            f"data.lanes: {lanes}{how} lanes give {global_micro // lanes} images each to a "
            f"micro-batch of {global_micro}; mixup / cutmix pair images within a lane's share (the "
            "same pairs on any number of processes), so it must be even: set data.lanes to a "
            f"divisor of {global_micro // 2}"
        )
    if lanes % world_size:
        raise ConfigError(
            f"data.lanes: {lanes}{how} lanes do not split over {world_size} processes; set "
            f"data.lanes to a multiple of {world_size} that divides {global_micro} (more lanes "
            "than shards: shards are shared, each lane keeping its share)"
        )
    return lanes


def lane_range(lanes: int, rank: int, world_size: int, worker: int, workers: int) -> range:
    """The lanes that loader worker `worker` of `workers` on process `rank` reads: a contiguous
    share of the rank's contiguous share, so concatenating the workers' chunks in worker order
    and the ranks' in rank order gives the global micro-batch in lane order."""
    per_rank = lanes // world_size
    first = rank * per_rank
    return range(first + worker * per_rank // workers, first + (worker + 1) * per_rank // workers)


def check_same_stream(
    saved: dict[str, Any],
    now: dict[str, Any],
    keys: dict[str, str],
    what: str,
    error: type[ValueError] = ValueError,
) -> None:
    """The one check that a resumed stream is the saved one: `error` naming every field of
    `keys` (field -> config key) whose value changed, as `key old -> new`. The run directory
    compares its config.yaml's stream keys with it (before anything is read), the loader the
    checkpoint's stream identity (shards by content, lanes)."""
    changed = [
        f"{keys[k]} {saved.get(k)} -> {now.get(k)}" for k in keys if saved.get(k) != now.get(k)
    ]
    if changed:
        raise error(
            f"--resume: {what} cannot continue with {', '.join(changed)} (another sample "
            "order); resume with its settings, or start a new run in another output_dir"
        )


def start_stream(
    stream: StreamArgs,
    requested: int,
    identity: dict[str, Any],
    key: str,
    shards: int = 0,
    paired: bool = False,
) -> tuple[int, dict[int, Position], StreamTracker]:
    """(lanes, every lane's start position, this rank's tracker) of the stream of config key
    `key`; `identity`: what a saved stream must match (the seed added). The lanes are resolved
    here, not in the run plan: they depend on the stream's shards and its checkpoint (read after
    the plan), and a side stream (self-training's unlabelled images) has lanes of its own."""
    s = stream
    saved = s.resume.get("lanes") if s.resume else None
    lanes = resolve_lanes(requested, s.global_micro, s.world_size, saved, shards, paired)
    identity = {**identity, "seed": s.seed}
    names = {"source": key, "seed": "seed", "lanes": "data.lanes"}
    names.update({k: f"data.{k}" for k in identity if k not in names})
    start: dict[int, Position] = {}
    if s.resume is not None:  # one that cannot be continued exactly: an error naming the key
        before = {**s.resume["identity"], "lanes": s.resume["lanes"]}
        now = {**identity, "lanes": lanes}
        check_same_stream(before, now, names, "the checkpoint's data stream")
        start = {int(lane): (int(p[0]), int(p[1])) for lane, p in s.resume["positions"].items()}
    mine = lane_range(lanes, s.rank, s.world_size, 0, 1)
    tracker = StreamTracker(identity, lanes, {k: p for k, p in start.items() if k in mine})
    return lanes, start, tracker


class StreamTracker:
    """Main-process record of the stream: every lane's position after the last consumed batch.
    `state_dict()` (every rank at once: it gathers the ranks' lanes) goes into the checkpoint;
    the loaders take it back as `resume=`."""

    def __init__(
        self, identity: dict[str, Any], lanes: int, positions: dict[int, Position] | None = None
    ) -> None:
        self.identity, self.lanes = identity, lanes
        self.positions: dict[int, Position] = dict(positions or {})

    def update(self, batch: Any) -> None:
        """Record a consumed batch's lane positions (`Batch.position`: {lane: position})."""
        if batch.position:
            self.positions.update(batch.position)

    def state_dict(self) -> dict[str, Any]:
        positions = dict(self.positions)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Each rank reads its own lanes; a checkpoint resumed by fewer or more ranks needs
            # all of them (rank files are loaded per rank).
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, positions)
            for part in parts:
                positions.update(part)
        return {
            "lanes": self.lanes,
            "identity": dict(self.identity),
            "positions": {lane: list(p) for lane, p in sorted(positions.items())},
        }
