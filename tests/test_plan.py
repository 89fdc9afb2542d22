"""The run plan (ssl_vit.train.plan): every derived value once, from hand-computed cases; the
config read-only after its checks."""

from __future__ import annotations

import dataclasses

import pytest

from ssl_vit.config import ConfigError, FinetuneConfig, PretrainConfig, from_dict, load_config
from ssl_vit.config.frozen import FrozenConfigError, freeze
from ssl_vit.train.plan import build_plan


def _pretrain(batch: int, accum: int) -> PretrainConfig:
    data = {"train_shards": "x", "num_workers": 3}
    train = {"batch_size": batch, "grad_accum": accum}
    return from_dict(PretrainConfig, {"data": data, "train": train})


@pytest.mark.parametrize(
    ("batch", "processes", "accum", "micro", "process_micro", "process_batch"),
    [
        (256, 1, 1, 256, 256, 256),  # one process: every figure is the global batch
        (256, 8, 1, 256, 32, 32),  # 8 processes share each micro-batch
        (256, 8, 2, 128, 16, 32),  # 2 micro-steps: a micro-batch is half a step
        (4096, 8, 4, 1024, 128, 512),
        (6, 3, 2, 3, 1, 2),  # an odd micro-batch is fine without mixing
    ],
)
def test_plan_splits_the_global_batch(batch, processes, accum, micro, process_micro, process_batch):
    plan = build_plan(_pretrain(batch, accum), processes, mixed_precision="bf16", device="cuda:0")
    assert (plan.global_batch, plan.grad_accum, plan.processes) == (batch, accum, processes)
    assert (plan.micro_batch, plan.process_micro, plan.process_batch) == (
        micro,
        process_micro,
        process_batch,
    )
    assert plan.eval_batch == batch // processes  # evaluation: no accumulation
    assert plan.micro_batch == plan.process_micro * processes
    assert plan.global_batch == plan.process_batch * processes
    assert (plan.num_workers, plan.mixed_precision, plan.device) == (3, "bf16", "cuda:0")
    assert not plan.paired
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.process_micro = 1  # a record to read


@pytest.mark.parametrize(("batch", "processes", "accum"), [(256, 3, 1), (100, 8, 1), (64, 4, 32)])
def test_an_impossible_split_is_one_line_naming_the_key(batch, processes, accum):
    with pytest.raises(ConfigError) as e:
        build_plan(_pretrain(batch, accum), processes)
    assert str(e.value).startswith(f"train.batch_size: {batch} is not divisible by processes")
    assert "\n" not in str(e.value)


def test_mixing_needs_an_even_micro_batch():
    base = {"data": {"train": "x"}, "parts": {"mixup": 0.8}}
    plan = build_plan(from_dict(FinetuneConfig, {**base, "train": {"batch_size": 12}}), 2)
    assert plan.paired and plan.micro_batch == 12 and plan.process_micro == 6
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
