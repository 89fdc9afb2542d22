"""data.labels_select=typiclust: the images to label picked by TypiClust on the init encoder's
features, with `ssl-vit select`'s code (its feature pass and its method) over data.train.

Every process embeds its share of the source (`predict_loader`'s global batches, at select's
default batch size whatever the process count, and read as unlabelled: no label is used);
the main process gathers the features in source order into a features.npy of its own (a
hidden folder of the run directory, removed after), runs TypiClust on them (`choose`: in
content order, seeded by data.labels_seed) and gives the picks' source indices to every
process (one broadcast). One process chooses, rather than each on its own features, so that
every process trains on the one subset that was picked, even where two devices' features
could differ in the last bit.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Any

from accelerate.utils import broadcast_object_list

from ssl_vit.config.select import SelectConfig
from ssl_vit.data.labelled import LabelledSubset, picked_subset
from ssl_vit.data.predict_stream import open_predict_source, predict_loader
from ssl_vit.errors import ConfigError
from ssl_vit.eval.readouts import Extraction
from ssl_vit.eval.select_features import FeatureWriter, choose, embed_rounds
from ssl_vit.eval.select_output import FEATURES, source_indices
from ssl_vit.train.preflight import load_frozen_encoder

__all__ = ["pick_typiclust"]

log = logging.getLogger(__name__)
SELECT = SelectConfig()  # the feature pass of `ssl-vit select` as it runs by default


def pick_typiclust(subset: LabelledSubset, cfg: Any, run: Any) -> None:
    """Set the picks of `subset` (data.labels_select=typiclust, not picked yet: its `keys` and
    `indices`, in place, as `use_labelled` sets `unusable`): the `labels_budget` images
    TypiClust picks among the readable images of its source, from the features of
    `cfg.init.checkpoint` at `cfg.model.image_size`, on `run`'s processes."""
    acc, plan = run.acc, run.plan
    frozen = load_frozen_encoder("init.checkpoint", cfg.init.checkpoint, cfg.model.image_size)
    source = open_predict_source(subset.source, ignore_labels=True)  # as `predict_loader`
    n, batch = len(source), SELECT.batch_size
    loader = predict_loader(
        subset.source, n, batch, frozen.image_size,
        num_workers=plan.num_workers, rank=plan.rank, world_size=plan.world,
    )  # fmt: skip
    how = Extraction(frozen.mean, frozen.std, acc.device, precision=acc.mixed_precision)
    dim = frozen.encoder.width * (2 if SELECT.pool == "cls+gap" else 1)
    log.info(
        "data.labels_select=typiclust: features of %d images of %s (%d px) on %d process(es)",
        n, subset.source, frozen.image_size, plan.world,
    )  # fmt: skip
    picks: list[str] | str | None = None  # the picks' keys (main process), or why none
    main, budget, seed = acc.is_main_process, subset.labels_budget, subset.labels_seed
    scratch = contextlib.nullcontext()  # the main process writes the features, in the run dir
    if main:
        scratch = tempfile.TemporaryDirectory(prefix=".typiclust-", dir=run.run_dir)
    with scratch as tmp:
        writer = FeatureWriter(Path(tmp) / FEATURES, n, dim) if main else None
        encoder = frozen.encoder.to(acc.device)
        table = embed_rounds(encoder, loader, n, batch, SELECT.pool, how, acc, writer, "data.train")
        if table is not None:
            try:  # fewer readable images than the budget: every process raises, none waits
                rows = choose(table, "typiclust", budget, [], seed)[1]
                keys = source.sample_keys()
                picks = [keys[i] for i in source_indices(table, rows, source, batch).tolist()]
            except ConfigError as e:
                picks = f"data.labels_budget={budget}: {e} of data.train that can be read"
            del table  # its memory map of the features file, before the folder goes
    if plan.world > 1:
        picks = broadcast_object_list([picks], from_process=0)[0]
    if isinstance(picks, str):
        raise ConfigError(picks)
    picked = picked_subset(subset.source, "typiclust", budget, seed, picks)
    subset.keys, subset.indices = picked.keys, picked.indices
