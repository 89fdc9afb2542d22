"""The run plan (ssl_vit.train.plan): every derived value once, from hand-computed cases; the
config read-only after its checks."""

from __future__ import annotations

import dataclasses

import pytest

from ssl_vit.config import ConfigError, FinetuneConfig, PretrainConfig, from_dict, load_config
from ssl_vit.config.frozen import FrozenConfigError, freeze
from ssl_vit.data.eval_stream import eval_loader
from ssl_vit.train.plan import build_plan


def _pretrain(batch: int, accum: int) -> PretrainConfig:
    data = {"train_shards": "x", "num_workers": 3}
    train = {"batch_size": batch, "grad_accum": accum}
    return from_dict(PretrainConfig, {"data": data, "train": train})


@pytest.mark.parametrize(
    ("batch", "world", "accum", "global_micro", "local_micro"),
    [
        (256, 1, 1, 256, 256),  # one process: every figure is the global batch
        (256, 8, 1, 256, 32),  # 8 processes share each micro-batch
        (256, 8, 2, 128, 16),  # 2 micro-steps: a micro-batch is half a step
        (4096, 8, 4, 1024, 128),
        (6, 3, 2, 3, 1),  # an odd micro-batch is fine without mixing
    ],
)
def test_plan_splits_the_global_batch(batch, world, accum, global_micro, local_micro):
    cfg = _pretrain(batch, accum)
    plan = build_plan(cfg, world, rank=world - 1, device="cuda:0")
    assert (plan.global_batch, plan.grad_accum, plan.world) == (batch, accum, world)
    assert (plan.global_micro, plan.local_micro) == (global_micro, local_micro)
    assert plan.local_eval == local_micro  # evaluation: what the user sized to fit memory
    assert plan.global_micro == plan.local_micro * world
    assert plan.global_batch == plan.local_micro * world * accum
    assert (plan.num_workers, plan.device) == (3, "cuda:0")
    assert plan.rank == world - 1 and not plan.paired and plan.global_unlabelled_micro == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.local_micro = 1  # a record to read


def test_the_evaluation_batch_is_the_micro_batch_sized_to_fit_memory(synthetic_shards):
    """Fine-tuning evaluates in batches of one process's micro-batch (train.batch_size 64 over
    grad_accum 4: 16 images, what the user sized to fit memory), never grad_accum x that
    (64: the step's images of a process, whose activations never share memory)."""
    train = {"batch_size": 64, "grad_accum": 4}
    cfg = from_dict(FinetuneConfig, {"data": {"train": "x"}, "train": train})
    plan = build_plan(cfg, 1)
    assert plan.local_eval == plan.local_micro == 16
    loader = eval_loader(str(synthetic_shards), plan.local_eval, 16, num_workers=0, limit=40)
    assert [len(b.images) for b in loader] == [16, 16, 8]  # the loader's batch: the plan's


def test_self_training_reads_its_global_micro_batch_from_the_plan():
    base = {"data": {"train": "x"}, "distill": {"teacher": "t", "unlabelled": "u", "ratio": 3}}
    cfg = from_dict(FinetuneConfig, {**base, "train": {"batch_size": 32, "grad_accum": 2}})
    plan = build_plan(cfg, 4)
    assert (plan.global_micro, plan.local_micro, plan.global_unlabelled_micro) == (16, 4, 48)


@pytest.mark.parametrize(("batch", "processes", "accum"), [(256, 3, 1), (100, 8, 1), (64, 4, 32)])
def test_an_impossible_split_is_one_line_naming_the_key(batch, processes, accum):
    with pytest.raises(ConfigError) as e:
        build_plan(_pretrain(batch, accum), processes)
    assert str(e.value).startswith(f"train.batch_size: {batch} is not divisible by processes")
    assert "\n" not in str(e.value)


def test_mixing_needs_an_even_micro_batch():
    base = {"data": {"train": "x"}, "parts": {"mixup": 0.8}}
    plan = build_plan(from_dict(FinetuneConfig, {**base, "train": {"batch_size": 12}}), 2)
    assert plan.paired and plan.global_micro == 12 and plan.local_micro == 6
    odd = from_dict(FinetuneConfig, {**base, "train": {"batch_size": 12, "grad_accum": 4}})
    with pytest.raises(ConfigError, match=r"^parts.mixup/cutmix: .*grad_accum = 3$"):
        build_plan(odd, 1)


def test_a_loaded_config_is_frozen():
    cfg = load_config(FinetuneConfig, None, ["data.train=x"])
    with pytest.raises(FrozenConfigError, match="frozen after its checks"):
        cfg.seed = 1
    with pytest.raises(FrozenConfigError):
        cfg.train.batch_size = 8  # every section
    with pytest.raises(FrozenConfigError):
        cfg.model.width = 8
    changed = freeze(dataclasses.replace(cfg, seed=1))  # a changed copy, frozen in its turn
    assert (changed.seed, cfg.seed) == (1, 0) and changed.train is cfg.train
    with pytest.raises(FrozenConfigError):
        changed.seed = 2


@pytest.mark.parametrize(
    ("job", "data", "parts", "device", "augment"),
    [
        (PretrainConfig, {"train_shards": "x"}, {}, "cpu", "workers"),  # auto off CUDA
        (PretrainConfig, {"train_shards": "x"}, {}, "cuda:1", "device"),  # auto on CUDA
        (PretrainConfig, {"train_shards": "x", "augment": "device"}, {}, "cpu", "device"),
        (PretrainConfig, {"train_shards": "x", "load_size": 40}, {}, "cuda:0", "device"),
        (FinetuneConfig, {"train": "x"}, {}, "cuda:0", "device"),
        # RandAugment runs per sample after the crop: the workers crop, even on CUDA
        (FinetuneConfig, {"train": "x"}, {"randaugment": "rand-m9-n2"}, "cuda:0", "workers"),
    ],
)
def test_the_plan_resolves_where_the_crop_runs_and_the_load_size(job, data, parts, device, augment):
    for size, auto in ((32, 32), (224, 256)):  # auto: the size up to 64 px, 8/7 of it above
        model = {"image_size": size}
        cfg = from_dict(job, {"data": data, "model": model, **({"parts": parts} if parts else {})})
        plan = build_plan(cfg, 1, device=device)
        assert (plan.augment, plan.load_size) == (augment, data.get("load_size") or auto)
