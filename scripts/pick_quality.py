"""How well would a pick label the whole set? A label-free selection's worth, read without a
fine-tune, on a source that has labels (read only to score).

    python scripts/pick_quality.py --source data/cifar10-train runs/pick-gap runs/pick-cls

Each folder is an `ssl-vit select` output of that source (its features.npy and
features.index.npz). For each, TypiClust and random picks of each budget and seed are drawn as
`ssl-vit select` draws them (the L2-normalised features in content order), then every image of
the source takes the label of its nearest pick (cosine), in the feature space of the LAST
folder, so that picks from different readouts are scored in one space. Prints the classes each
pick covers and that nearest-pick top-1 (%), mean and per seed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ssl_vit.data.sources import open_source
from ssl_vit.eval.select_features import index_path
from ssl_vit.eval.select_output import FEATURES
from ssl_vit.eval.selection import normalised, select


def space(folder: Path, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(normalised features, labels) of a select folder's rows, in content order."""
    features = np.load(folder / FEATURES, mmap_mode="r")
    index = np.load(index_path(folder / FEATURES))
    rows = index["index"]
    if (rows < 0).any():
        raise SystemExit(f"{folder}: a batch had unreadable images; score a clean source")
    order = np.lexsort((np.arange(len(index["keys"])), index["keys"]))
    return normalised(features, order), labels[rows[order]]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="ssl-vit select outputs of --source")
    p.add_argument("--source", required=True, help="the images, with labels (to score only)")
    p.add_argument("--budgets", type=int, nargs="+", default=[10, 100])
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args(argv)
    labels = open_source(args.source).labels()
    spaces = {f: space(f, labels) for f in args.folders}
    x_ref, y = spaces[args.folders[-1]]
    if any((other != y).any() for _, other in spaces.values()):
        raise SystemExit("the folders hold other images: select them from the same --source")
    none = np.array([], dtype=np.int64)
    for folder, (x, _) in spaces.items():
        for method in ("typiclust", "random"):
            for budget in args.budgets:
                covered, top1 = [], []
                for seed in range(args.seeds):
                    rows = select(method, x, budget, none, seed).rows
                    covered.append(int((np.bincount(y[rows]) > 0).sum()))
                    nearest = np.argmax(x_ref @ x_ref[rows].T.astype(np.float32), axis=1)
                    top1.append(round(100 * float((y[rows][nearest] == y).mean()), 1))
                print(
                    f"{folder.name} {method} {budget}: classes {covered}, nearest-pick top-1 "
                    f"{np.mean(top1):.1f} {top1}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
