"""The one way every random stream of a job gets its seed.

A seed is `derive(seed, STREAM, *place)`: the job's `seed`, a stream id naming what draws from
it, and the integers that say where in the global stream the draw happens (epoch, shard, sample;
the micro-batch of a step). They are hashed with SplitMix64's finalizer (Steele et al. 2014),
so neighbouring places give unrelated seeds; a few microseconds (NumPy's `SeedSequence` takes
~25 us, paid for every sample of the stream). No stream is seeded by a rank or a loader
worker: what a sample looks like depends on the seed and on its place in the stream, never on
how many processes or workers read it (see docs/scaling.md). The one exception is `process`,
the seed of a process's global RNGs (dropout): per rank by nature.

Importable from every layer (it imports nothing).
"""

from __future__ import annotations

__all__ = [
    "AUGMENT",
    "CORRUPTION",
    "DEVICE_AUGMENT",
    "EPOCH",
    "LABELS",
    "LABELS_ORDER",
    "LABELS_RANDOM",
    "LOADER",
    "MIXUP",
    "PROCESS",
    "SHARDS",
    "SHUFFLE",
    "STRONG_AUGMENT",
    "UNLABELLED",
    "derive",
    "process",
]

# Stream ids: the second part of every derived seed, so that two streams never share draws.
SHARDS = 1  # resampled shard choice of a lane's visit
SHUFFLE = 2  # the order of a block of samples within a lane
AUGMENT = 3  # a sample's crop and flip (and RandAugment) in the loader workers
EPOCH = 4  # an epoch's permutation of the shards (or of a random-access source's records)
DEVICE_AUGMENT = 6  # crop and flip of a micro-batch on the device (data.augment=device)
CORRUPTION = 7  # the corruption draws of a micro-batch (objectives.corruption)
LOADER = 8  # DataLoader's own base seed (unused by the streams, drawn once)
PROCESS = 9  # a process's global RNGs (Python, NumPy, torch)
MIXUP = 10  # mixup / cutmix of a micro-batch: its lam, mode and box (train.recipe)
LABELS = 11  # which K images of a class form the labelled subset (data.labelled)
LABELS_ORDER = 12  # the order of the labelled subset's copy in its shards
UNLABELLED = 13  # self-training's unlabelled stream: its seed (order, crops) derives from this
STRONG_AUGMENT = 14  # the strong view of an unlabelled micro-batch (data.strong_augment)
LABELS_RANDOM = 15  # data.labels_select=random: which N images of the source are labelled


_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that scatters every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def derive(seed: int, stream: int, *place: int) -> int:
    """A 32-bit seed for stream `stream` at `place` (any number of integers, taken mod 2**64)."""
    h = 0
    for part in (seed, stream, *place):
        h = _mix((h ^ (int(part) & _MASK)) + _GOLDEN & _MASK)
    return h >> 32


def process(seed: int, rank: int) -> int:
    """The seed of process `rank`'s global RNGs; rank 0's builds the model's random init, so a
    1-process and an N-process run start from the same weights (DDP copies rank 0's)."""
    return derive(seed, PROCESS, rank)
