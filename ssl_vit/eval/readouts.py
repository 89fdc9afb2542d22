"""Frozen readouts below the last block: which block's output, pooled how, makes the best
few-shot features (masked-image models often carry their best linear features below the
last block).

A readout is a set of blocks and a pooling: `block3/gap` (block 3's mean-pooled patch
outputs), `block3/cls` ([class] token), `block3/cls+gap` (both), `last2/gap` (the last two
blocks' mean-pooled outputs concatenated). Features are extracted once per image for every
block asked for (`ViT.forward_features(x, layers=...)`, one pass), and every readout is
assembled from them.

Shape legend: B batch, M images, D width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils._pytree import tree_map

from ssl_vit.errors import ConfigError, InputError
from ssl_vit.eval.fewshot import fewshot_sweep
from ssl_vit.eval.shots import shot_order
from ssl_vit.model.compile import maybe_compile
from ssl_vit.model.pixels import PixelNorm
from ssl_vit.model.vit import POOLS, ViT, resolve_layers

__all__ = [
    "Extraction",
    "LayerFeatures",
    "Readout",
    "best_readout",
    "extract_layer_features",
    "format_layer_table",
    "frozen_forward",
    "layer_sweep",
    "parse_layers",
    "plan_readouts",
]

T = TypeVar("T")
# {block index: {"cls": [M, D], "gap": [M, D]}}, float32 on CPU.
LayerFeatures = dict[int, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Extraction:
    """How frozen features are computed: the encoder's input normalisation (`mean`, `std` of
    [0, 1] pixels), the device, torch.compile of the forward (`compile`: true, false, "auto" =
    CUDA only; `compile_mode`; see model.compile) and the autocast on a GPU (`precision`,
    Accelerate's mixed_precision: bf16, fp16 or no; the CPU runs float32)."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    device: torch.device | str = "cpu"
    compile: bool | str = False
    compile_mode: str = "default"
    precision: str = "bf16"


@dataclass(frozen=True)
class Readout:
    """Blocks (indices in [0, depth), concatenated in this order) and a pooling of `POOLS`."""

    name: str
    layers: tuple[int, ...]
    pool: str

    def features(self, store: LayerFeatures) -> torch.Tensor:
        """[M, len(layers) x D (x 2 for cls+gap)] from extracted features."""
        parts = [
            store[i][self.pool]
            if self.pool in store[i]
            else torch.cat([store[i]["cls"], store[i]["gap"]], dim=1)
            for i in self.layers
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def parse_layers(spec: str | int | Sequence[int], depth: int) -> list[int]:
    """`last`, `all`, a block index or a list of them (negative from the end) -> sorted
    block indices in [0, depth)."""
    if spec == "last":
        return [depth - 1]
    if spec == "all":
        return list(range(depth))
    if isinstance(spec, str):
        raise ConfigError(f"layers: expected 'last', 'all' or block indices, got {spec!r}")
    return resolve_layers(spec, depth)


def plan_readouts(
    layers: Sequence[int], depth: int, pools: Sequence[str] = POOLS, concat_last: int = 0
) -> list[Readout]:
    """Every (block, pool) of `layers` x `pools`, then for `concat_last` = N > 1 the
    concatenation of the last N blocks under each pool."""
    unknown = [p for p in pools if p not in POOLS]
    if unknown:
        raise ConfigError(f"unknown pooling {unknown} (use {', '.join(POOLS)})")
    if not 0 <= concat_last <= depth:
        raise ConfigError(f"concat_last: must be in [0, {depth}], got {concat_last}")
    out = [Readout(f"block{i}/{p}", (i,), p) for i in layers for p in pools]
    if concat_last > 1:
        last = tuple(range(depth - concat_last, depth))
        out += [Readout(f"last{concat_last}/{p}", last, p) for p in pools]
    return out


@torch.no_grad()
def frozen_forward(
    encoder: ViT,
    images: Iterable[tuple[torch.Tensor, torch.Tensor]],
    how: Extraction,
    forward: Callable[[torch.Tensor], T],
) -> tuple[list[T], torch.Tensor]:
    """(uint8 images [B, 3, S, S], labels [B]) batches -> ([forward(normalized images) of each
    batch, as float32 on the CPU], labels [M]), computed as `how` says: `forward` returns device
    tensors (any nesting of lists and dicts); the encoder in eval mode (its mode restored after).
    ValueError when there are no images.

    Compiled (`how.compile`), the last, smaller batch is padded to the first's size so that one
    static-shape graph (one CUDA graph with reduce-overhead) serves every batch."""
    was_training = encoder.training
    encoder.eval()
    dev = torch.device(how.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(how.precision)
    autocast = torch.autocast(dev.type, dtype=dtype, enabled=dev.type == "cuda" and bool(dtype))
    pixels = PixelNorm(how.mean, how.std).to(dev)
    step = maybe_compile(forward, how.compile, how.compile_mode, dev)
    padded_size, outs, labels = 0, [], []
    try:
        for x_u8, y in images:
            n = len(x_u8)
            x_u8 = x_u8.to(dev, non_blocking=True)
            padded_size = padded_size or n
            if step is not forward and n < padded_size:
                pad = x_u8.new_zeros((padded_size - n, *x_u8.shape[1:]))
                x_u8 = torch.cat([x_u8, pad])
            x = pixels(x_u8)
            with autocast:
                out = step(x)
            outs.append(tree_map(lambda t, n=n: t[:n].float().cpu(), out))
            labels.append(y)
    finally:
        encoder.train(was_training)
    if not labels:
        raise InputError("no images to extract features from")
    return outs, torch.cat(labels)


def extract_layer_features(
    encoder: ViT,
    images: Iterable[tuple[torch.Tensor, torch.Tensor]],
    how: Extraction,
    layers: Sequence[int],
) -> tuple[LayerFeatures, torch.Tensor]:
    """(uint8 images [B, 3, S, S], labels [B]) batches -> ({block: {"cls", "gap"}}, labels
    [M]): one forward pass per batch for all `layers` (sorted), pooled on the device."""

    def pooled(x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        outs = encoder.forward_features(x, layers=list(layers))
        return [{p: ViT.pool(t, p) for p in ("cls", "gap")} for t in outs]

    outs, labels = frozen_forward(encoder, images, how, pooled)  # outs[b][j]: layers[j], batch b
    feats = {
        i: {p: torch.cat([out[j][p] for out in outs]) for p in ("cls", "gap")}
        for j, i in enumerate(layers)
    }
    return feats, labels


def layer_sweep(
    readouts: Sequence[Readout],
    train: tuple[LayerFeatures, torch.Tensor],
    test: tuple[LayerFeatures, torch.Tensor],
    **sweep: Any,
) -> dict[str, Any]:
    """`fewshot_sweep` (same subsets, `sweep` its keyword arguments) for every readout:
    {"readouts": {name: {"layers": [...], "pool": str, "dim": D, "shots": {k: {"mean", "std",
    "per_seed"}}}}, "best": best_readout(...)}, at the first l2_reg."""
    table = {}
    for r in readouts:
        res = fewshot_sweep(r.features(train[0]), train[1], r.features(test[0]), test[1], **sweep)
        shots = {k: dict(next(iter(e["l2_reg"].values()))) for k, e in res["shots"].items()}
        dim = r.features(test[0]).shape[1]
        table[r.name] = {"layers": list(r.layers), "pool": r.pool, "dim": dim, "shots": shots}
    return {"readouts": table, "best": best_readout(table)}


def best_readout(table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The readout with the highest accuracy averaged over shots, and the best one per shot:
    {"readout": name, "mean_over_shots": float, "per_shot": {k: {"readout", "mean"}}}."""

    def avg(name: str) -> float:
        return float(np.mean([s["mean"] for s in table[name]["shots"].values()]))

    best = max(table, key=avg)
    shots = sorted({k for r in table.values() for k in r["shots"]}, key=shot_order)
    per_shot = {}
    for k in shots:
        having = [n for n in table if k in table[n]["shots"]]
        name = max(having, key=lambda n: table[n]["shots"][k]["mean"])
        per_shot[k] = {"readout": name, "mean": table[name]["shots"][k]["mean"]}
    return {"readout": best, "mean_over_shots": avg(best), "per_shot": per_shot}


def format_layer_table(layers: dict[str, Any]) -> str:
    """`layer_sweep`'s result as a text table (readout x shots, mean +- std in %) and the
    winning readout, for a command line."""
    table, best = layers["readouts"], layers["best"]
    shots = sorted({k for r in table.values() for k in r["shots"]}, key=shot_order)
    width = max(len(n) for n in table)
    lines = [f"{'readout':<{width}} " + " ".join(f"{f'{k}-shot':>14}" for k in shots)]
    for name, r in table.items():
        cells = [r["shots"].get(k) for k in shots]
        lines.append(
            f"{name:<{width}} "
            + " ".join(
                f"{100 * c['mean']:>6.2f} +- {100 * c['std']:4.2f}" if c else f"{'-':>14}"
                for c in cells
            )
        )
    per_shot = ", ".join(f"{k}-shot: {v['readout']}" for k, v in best["per_shot"].items())
    lines.append(
        f"best readout: {best['readout']} ({100 * best['mean_over_shots']:.2f}% averaged over "
        f"shots; per shot: {per_shot})"
    )
    return "\n".join(lines)
