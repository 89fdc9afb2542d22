"""How well would a pick label the whole set? A label-free selection's worth, read without a
fine-tune, on a source that has labels (read only to score).

    python scripts/pick_quality.py --source data/cifar10-train runs/pick-gap runs/pick-cls

Each folder is an `ssl-vit select` output of that source (its features.npy and
features.index.npz). For each, TypiClust and random picks of each budget and seed are drawn by
`ssl-vit select`'s own `choose` (the features in content order), then every image of
the source takes the label of its nearest pick (cosine), in the feature space of the LAST
folder, so that picks from different readouts are scored in one space. Prints the classes each
pick covers and that nearest-pick top-1 (%), mean and per seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ssl_vit.data.sources import open_source
from ssl_vit.eval.select_features import FeatureTable, choose, index_path, reused_table
from ssl_vit.eval.select_output import FEATURES
from ssl_vit.eval.selection import normalised


def feature_table(folder: Path) -> FeatureTable:
    """A select folder's feature pass, read as a next round reads it (`reused_table`)."""
    path = folder / FEATURES
    try:
        with np.load(index_path(path)) as z:
            info = json.loads(z["json"].tobytes())
        names = info["names"] + [name for name, _ in info["skipped"]]
        table = reused_table(path, info["meta"], names)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{folder}: no readable ssl-vit select features ({e})") from None
    if table is None or table.skipped:
        raise SystemExit(
            f"{folder}: no complete feature pass of a source without unreadable images"
        )
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="ssl-vit select outputs of --source")
    p.add_argument("--source", required=True, help="the images, with labels (to score only)")
    p.add_argument("--budgets", type=int, nargs="+", default=[10, 100])
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args(argv)
    tables = {f: feature_table(f) for f in args.folders}
    ref = tables[args.folders[-1]]  # rows in source order, in every folder alike
    if any(t.names != ref.names for t in tables.values()):
        raise SystemExit("the folders hold other images: select them from the same --source")
    y, x_ref = open_source(args.source).labels()[ref.index], normalised(ref.features)
    for folder, table in tables.items():
        for method in ("typiclust", "random"):
            for budget in args.budgets:
                covered, top1 = [], []
                for seed in range(args.seeds):
                    rows = choose(table, method, budget, [], seed)[1]  # as ssl-vit select
                    covered.append(int((np.bincount(y[rows]) > 0).sum()))
                    nearest = np.argmax(x_ref @ x_ref[rows].T, axis=1)
                    top1.append(round(100 * float((y[rows][nearest] == y).mean()), 1))
                print(
                    f"{folder.name} {method} {budget}: classes {covered}, nearest-pick top-1 "
                    f"{np.mean(top1):.1f} {top1}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
