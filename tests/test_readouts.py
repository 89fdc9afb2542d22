"""Frozen readouts below the last block (eval.readouts) and their few-shot sweep."""

import pytest
import torch

from ssl_vit.config import FewshotEvalConfig
from ssl_vit.eval.fewshot_job import fewshot_evaluate
from ssl_vit.eval.readouts import (
    Readout,
    best_readout,
    format_layer_table,
    parse_layers,
    plan_readouts,
)
from ssl_vit.model import ViT

MEAN = STD = (0.5, 0.5, 0.5)


def test_parse_layers_and_plan():
    assert parse_layers("last", 4) == [3]
    assert parse_layers("all", 4) == [0, 1, 2, 3]
    assert parse_layers([-1, 0, -4], 4) == [0, 3]
    with pytest.raises(ValueError, match="layers"):
        parse_layers("first", 4)
    names = [r.name for r in plan_readouts([1, 3], 4, ("cls", "gap"), concat_last=2)]
    assert names == ["block1/cls", "block1/gap", "block3/cls", "block3/gap"] + [
        "last2/cls",
        "last2/gap",
    ]
    assert plan_readouts([3], 4, ("gap",), concat_last=2)[-1].layers == (2, 3)


def test_readout_features_concatenate_in_block_then_pool_order():
    store = {
        i: {"cls": torch.full((2, 3), 10.0 * i), "gap": torch.full((2, 3), 10.0 * i + 1)}
        for i in (0, 1)
    }
    x = Readout("last2/cls+gap", (0, 1), "cls+gap").features(store)
    assert x.shape == (2, 12) and x[0, ::3].tolist() == [0.0, 1.0, 10.0, 11.0]


def test_best_readout_averages_over_shots():
    def row(*means):
        return {"shots": {k: {"mean": m, "std": 0.0} for k, m in zip((1, 5), means, strict=True)}}

    table = {"a": row(0.5, 0.5), "b": row(0.3, 0.8), "c": row(0.6, 0.2)}
    best = best_readout(table)
    assert best["readout"] == "b" and best["mean_over_shots"] == pytest.approx(0.55)
    assert {k: v["readout"] for k, v in best["per_shot"].items()} == {1: "c", 5: "b"}
    text = format_layer_table({"readouts": table, "best": best})
    assert "best readout: b (55.00%" in text and "80.00 +- 0.00" in text


def _evaluate(encoder, shards, **kw):
    spec = FewshotEvalConfig(
        str(shards), str(shards), shots=[1, 3], seeds=[0, 1], batch_size=32, num_workers=0, **kw
    )
    return fewshot_evaluate(encoder, spec, image_size=16, mean=MEAN, std=STD)


def test_all_layers_in_one_pass_and_last_equals_the_default(synthetic_shards):
    torch.manual_seed(0)
    encoder = ViT(16, 4, 32, 3, 4)
    default = _evaluate(encoder, synthetic_shards, pool="gap")
    seen = []
    hook = encoder.patch_embed.register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    res = _evaluate(encoder, synthetic_shards, pool="gap", layers="all", concat_last=2)
    hook.remove()
    # Each image through the encoder once: the few-shot rows (10 classes x 3 shots x 2 seeds,
    # at most) and the 96 test images, for all 3 blocks and every pooling.
    assert sum(seen) == res["num_train_features"] + 96
    assert res["shots"] == default["shots"] and res["summary"] == default["summary"]
    table = res["layers"]["readouts"]
    assert set(table) == {f"block{i}/{p}" for i in range(3) for p in ("cls", "gap", "cls+gap")} | {
        f"last2/{p}" for p in ("cls", "gap", "cls+gap")
    }
    for k in (1, 3):
        assert table["block2/gap"]["shots"][k]["mean"] == default[f"{k}shot"]
    assert table["last2/cls+gap"]["dim"] == 4 * 32 and table["block0/cls"]["dim"] == 32
    assert res["layers"]["best"]["readout"] in table and res["layers"]["depth"] == 3


def test_knn_monitor_on_the_same_features(synthetic_shards):
    torch.manual_seed(0)
    encoder = ViT(16, 4, 32, 2, 4)
    res = _evaluate(encoder, synthetic_shards, knn_k=5, knn_train=0)
    assert res["knn"]["num_train"] == 96 and res["knn"]["k"] == 5
    # Train and test are the same 96 images: each one's nearest neighbour is itself.
    one = _evaluate(encoder, synthetic_shards, knn_k=1, knn_train=0)
    assert one["knn"]["top1"] == 1.0
    assert "knn" not in _evaluate(encoder, synthetic_shards)


@pytest.mark.system
def test_support_set_decoded_by_workers_gives_the_serial_results(synthetic_shards):
    """Two loader workers decode the support set (their batches interleave); the features are
    put back in index order, so every figure equals the one-process pass's."""
    torch.manual_seed(0)
    encoder = ViT(16, 4, 32, 2, 4)
    kw = dict(knn_k=3, knn_train=40, layers="all")
    serial = _evaluate(encoder, synthetic_shards, **kw)
    spec = FewshotEvalConfig(
        str(synthetic_shards), str(synthetic_shards), shots=[1, 3], seeds=[0, 1], batch_size=5,
        num_workers=2, **kw,
    )  # fmt: skip
    workers = fewshot_evaluate(encoder, spec, image_size=16, mean=MEAN, std=STD)

    def timeless(r):
        return {
            k: timeless(v) if isinstance(v, dict) else v
            for k, v in r.items()
            if "time" not in str(k)
        }

    assert timeless(workers) == timeless(serial)
    assert workers["num_train_features"] >= 10 and workers["knn"]["num_train"] == 40
