"""Which unlabelled images to label, from frozen features: TypiClust, k-center, random.

TypiClust (Hacohen, Dekel and Weinshall, "Active Learning on a Budget", ICML 2022, section
3.2): L2-normalised features are clustered by k-means into as many clusters as images to label
in all (the earlier rounds' included); each cluster that holds no earlier pick, largest first,
gives its most *typical* image, typicality(x) = 1 / (mean L2 distance to x's K = 20 nearest
neighbours in its cluster). The paper's code drops clusters of <= 5 images; here they come last
(used only when the larger ones run out). k-center is the greedy coreset (Sener and Savarese,
ICLR 2018): each pick is the image farthest from every earlier one. Random is a uniform draw.

Every function is a pure function of its inputs and the seed: rows are positions in the
caller's order of the features, and `previous` (earlier rounds' picks) stay picked and shape
the new picks. Budgets are totals: `budget - len(previous)` new picks.

Shape legend: N images, D feature width, M images of one cluster, C rows of a chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ssl_vit.errors import ConfigError

__all__ = [
    "KNN",
    "MAX_TYPICALITY_POINTS",
    "METHODS",
    "MIN_CLUSTER",
    "Picks",
    "kcenter",
    "kmeans_labels",
    "normalised",
    "random_picks",
    "select",
    "typicality",
    "typiclust",
]

METHODS = ("typiclust", "kcenter", "random")
KNN = 20  # the paper's K nearest neighbours of the typicality
MIN_CLUSTER = 5  # clusters of at most this many images are picked from last (the paper: never)
# A cluster's typicality is estimated on at most this many of its images (a seeded draw): an
# M-image cluster needs M x M distances, 20,000^2 x 768 multiply-adds at the most.
MAX_TYPICALITY_POINTS = 20_000
_CHUNK = 2048  # rows of a distance block: 2,048 x 20,000 float32 = 160 MB at the most
_EPS = 1e-5  # the paper's, so a cluster of duplicates has a finite typicality


class Picks(NamedTuple):
    """The new picks in rank order: rows [P] (int64), and for TypiClust each pick's cluster,
    its size (earlier picks included) and typicality (NaN for a one-image cluster); None for
    the other methods."""

    rows: np.ndarray
    cluster: np.ndarray | None = None
    cluster_size: np.ndarray | None = None
    typicality: np.ndarray | None = None


def _new_count(n: int, budget: int, previous: np.ndarray) -> int:
    if not len(previous) < budget <= n:
        raise ConfigError(
            f"budget {budget}: must exceed the {len(previous)} earlier picks and be at most "
            f"the {n} images"
        )
    if len(np.unique(previous)) != len(previous) or (len(previous) and previous.max() >= n):
        raise ValueError("previous: repeated rows or rows outside the features")
    return budget - len(previous)


def normalised(x_ND: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """float32 [N, D] rows of `x_ND` (any float dtype, e.g. a float16 memmap; `order`: the rows
    to take, in that order) scaled to unit L2 norm (an all-zero row stays zero), chunk by chunk
    so a memmap is read once and never converted whole."""
    rows = np.arange(len(x_ND)) if order is None else np.asarray(order)
    out = np.empty((len(rows), x_ND.shape[1]), dtype=np.float32)
    for lo in range(0, len(rows), 65536):
        chunk = np.asarray(x_ND[rows[lo : lo + 65536]], dtype=np.float32)
        norm = np.linalg.norm(chunk, axis=1, keepdims=True)
        out[lo : lo + len(chunk)] = chunk / np.maximum(norm, 1e-12)
    return out


def kmeans_labels(x_ND: np.ndarray, k: int, seed: int) -> np.ndarray:
    """int64 [N] cluster of each row, k-means into `k` clusters.

    scikit-learn's MiniBatchKMeans: a well-kept k-means that streams mini-batches through
    memory, seeded by `random_state`. faiss would be faster, but its GPU build has no PyPI
    wheel for Python >= 3.10 (faiss-gpu stops at 1.7.2, cp36-cp39; faiss-cpu 1.15.1 ships
    wheels for Linux, macOS and Windows), so on the CPU it would only add a 19 MB native
    library for what scikit-learn does here."""
    from sklearn.cluster import MiniBatchKMeans

    km = MiniBatchKMeans(
        n_clusters=k,
        random_state=seed,
        # Explicit (the default changed across releases): one k-means++ start, scikit-learn's
        # `auto` for it; at 1,000 clusters the start is most of the time (3: 3x as long).
        n_init=1,
        batch_size=max(4096, 4 * k),  # a few images per cluster in every mini-batch
    )
    return km.fit(x_ND).labels_.astype(np.int64)


def typicality(x_MD: np.ndarray, k: int = KNN) -> np.ndarray:
    """float64 [M]: 1 / (mean L2 distance to the row's min(k, M - 1) nearest other rows +
    1e-5) (the paper's density); NaN for M = 1. Distances in float32 blocks of _CHUNK rows."""
    M = len(x_MD)
    k = min(k, M - 1)
    if k < 1:
        return np.full(M, np.nan)
    x = np.asarray(x_MD, dtype=np.float32)
    sq_M = np.einsum("md,md->m", x, x)
    out = np.empty(M)
    for lo in range(0, M, _CHUNK):
        hi = min(lo + _CHUNK, M)
        d2_CM = sq_M[lo:hi, None] + sq_M[None, :] - 2 * (x[lo:hi] @ x.T)
        d2_CM[np.arange(hi - lo), np.arange(lo, hi)] = np.inf  # not its own neighbour
        nearest_Ck = np.partition(d2_CM, k - 1, axis=1)[:, :k]
        out[lo:hi] = np.sqrt(np.maximum(nearest_Ck, 0)).mean(axis=1, dtype=np.float64)
    return 1.0 / (out + _EPS)


def _cluster_order(sizes: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Cluster ids to pick from, in order: non-empty clusters by (tiny last, fewest earlier
    picks, largest, lowest id)."""
    ids = np.flatnonzero(sizes)
    return ids[np.lexsort((ids, -sizes[ids], held[ids], sizes[ids] <= MIN_CLUSTER))]


def typiclust(x_ND: np.ndarray, budget: int, previous=(), seed: int = 0) -> Picks:
    """TypiClust's new picks of `budget` in all (module docstring). `x_ND`: normalised
    features. Clusters are visited in `_cluster_order` (cycled if the budget outlasts them);
    each gives its most typical image not picked yet, the typicality computed once per cluster
    among its images that are no earlier pick (the paper's code also leaves those out), on a
    seeded draw of MAX_TYPICALITY_POINTS of them for a larger cluster."""
    previous = np.asarray(previous, dtype=np.int64)
    new = _new_count(len(x_ND), budget, previous)
    labels = kmeans_labels(x_ND, budget, seed)
    sizes = np.bincount(labels, minlength=budget)
    held = np.bincount(labels[previous], minlength=budget)
    members = np.split(np.argsort(labels, kind="stable"), np.cumsum(sizes)[:-1])
    taken = np.zeros(len(x_ND), dtype=bool)
    taken[previous] = True
    ranked: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # cluster -> (rows, typicality)
    rows, clusters, typ = [], [], []
    order, i = _cluster_order(sizes, held), 0
    while len(rows) < new:
        c = int(order[i % len(order)])
        i += 1
        if c not in ranked:
            ranked[c] = _ranked_members(x_ND, members[c][~taken[members[c]]], seed, c)
        cand, t = ranked[c]
        free = np.flatnonzero(~taken[cand])
        if not len(free):
            continue  # every image of this cluster is picked
        j = free[0]  # candidates are sorted by typicality, most typical first
        rows.append(cand[j])
        clusters.append(c)
        typ.append(t[j])
        taken[cand[j]] = True
    clusters = np.asarray(clusters, dtype=np.int64)
    return Picks(np.asarray(rows, dtype=np.int64), clusters, sizes[clusters], np.asarray(typ))


def _ranked_members(x_ND, rows: np.ndarray, seed: int, cluster: int):
    """(rows of the cluster, most typical first, ties by row; their typicality). A larger
    cluster is ranked on a seeded draw of MAX_TYPICALITY_POINTS rows (the same draw for any
    visit), the rest after them in row order, typicality NaN."""
    rest = rows[:0]
    if len(rows) > MAX_TYPICALITY_POINTS:
        rng = np.random.default_rng([seed, cluster])
        drawn = np.sort(rng.choice(rows, MAX_TYPICALITY_POINTS, replace=False))
        rows, rest = drawn, np.setdiff1d(rows, drawn)
    t = typicality(x_ND[rows])
    by = np.lexsort((rows, -np.nan_to_num(t, nan=0.0)))
    return np.concatenate([rows[by], rest]), np.concatenate([t[by], np.full(len(rest), np.nan)])


def kcenter(x_ND: np.ndarray, budget: int, previous=(), seed: int = 0) -> Picks:
    """Greedy k-center: the earlier picks (or, without any, one seeded uniform draw, the first
    new pick) are centres; each next pick is the row farthest (L2) from its nearest centre,
    ties by lowest row. One [N] distance pass per pick: budget x N x D multiply-adds."""
    previous = np.asarray(previous, dtype=np.int64)
    new = _new_count(len(x_ND), budget, previous)
    x = np.asarray(x_ND, dtype=np.float32)
    sq_N = np.einsum("nd,nd->n", x, x)
    nearest_N = np.full(len(x), np.inf, dtype=np.float32)

    def add_centre(r: int) -> None:
        d2 = np.maximum(sq_N + sq_N[r] - 2 * (x @ x[r]), 0)
        np.minimum(nearest_N, d2, out=nearest_N)
        nearest_N[r] = -1  # never picked again, even where duplicates leave every distance 0

    for r in previous:
        add_centre(int(r))
    rows = []
    if not len(previous):
        rows.append(int(np.random.default_rng(seed).integers(len(x))))
        add_centre(rows[0])
    while len(rows) < new:
        rows.append(int(np.argmax(nearest_N)))
        add_centre(rows[-1])
    return Picks(np.asarray(rows, dtype=np.int64))


def random_picks(n: int, budget: int, previous=(), seed: int = 0) -> Picks:
    """A seeded uniform draw without replacement of the new picks among the rows not picked."""
    previous = np.asarray(previous, dtype=np.int64)
    new = _new_count(n, budget, previous)
    free = np.setdiff1d(np.arange(n), previous)
    return Picks(np.random.default_rng(seed).choice(free, new, replace=False).astype(np.int64))


def select(method: str, x_ND: np.ndarray, budget: int, previous=(), seed: int = 0) -> Picks:
    """`method`'s (METHODS) new picks on normalised features (`normalised`)."""
    if method == "typiclust":
        return typiclust(x_ND, budget, previous, seed)
    if method == "kcenter":
        return kcenter(x_ND, budget, previous, seed)
    if method == "random":
        return random_picks(len(x_ND), budget, previous, seed)
    raise ConfigError(f"unknown selection method {method!r} (one of {', '.join(METHODS)})")
