"""The training step never waits on the host: no device->host read and no tensor built from
Python data between log steps (pretraining, fine-tuning with EMA), counted on the CPU by a
TorchDispatchMode; a non-finite step is skipped on the device and leaves the weights and the
optimizer state bit-identical."""

import copy
import types

import pytest
import torch
from accelerate import Accelerator
from conftest import pipeline
from test_pipelines import finetune_args, pretrain_args

from ssl_vit.bench.host_sync import HostReads
from ssl_vit.config.optim import FinetuneOptimConfig, OptimConfig
from ssl_vit.train import loop
from ssl_vit.train.ema import EMA
from ssl_vit.train.optim import apply_step, build_adam, build_sgd


def test_the_counter_sees_syncs_and_python_tensors():
    x = torch.ones(3)
    with HostReads() as reads:
        float(x.sum())  # a sync
        torch.tensor([1.0, 2.0])  # a host-to-device copy on a GPU
        bool(x[0] > 0)  # a sync
        torch.where(x > 0, x, 0.0).sum()  # neither
    assert [op for _, op in reads.events] == [
        "aten._local_scalar_dense.default",
        "aten.lift_fresh.default",
        "aten._local_scalar_dense.default",
    ]


def _run_counting(monkeypatch, main, args) -> HostReads:
    """Run a pipeline's `main(args)` in this process under HostReads; each batch taken from
    the stream starts the next step (one micro-batch per step), loading itself not counted."""
    reads = HostReads()
    next_batch = loop.Batches.next

    def counted_next(self):
        reads.step += 1
        reads.active = False
        try:
            return next_batch(self)
        finally:
            reads.active = True

    monkeypatch.setattr(loop.Batches, "next", counted_next)
    with reads:
        main(args)
    return reads


STEPS, EVERY = 8, 4  # steps 4 and 8 log (and may checkpoint): they may sync


def _between_log_steps(reads: HostReads) -> list:
    return [(s, op) for s, op in reads.events if 1 <= s <= STEPS and s % EVERY]


def test_pretraining_steps_between_log_steps_never_wait_on_the_host(
    synthetic_shards, tmp_path, monkeypatch
):
    args = pretrain_args(
        synthetic_shards,
        tmp_path,
        f"train.steps={STEPS}",
        f"train.log_every={EVERY}",
        f"train.checkpoint_every={EVERY}",
    )
    reads = _run_counting(monkeypatch, pipeline("pretrain"), args)
    assert _between_log_steps(reads) == []
    assert any(s == EVERY for s, _ in reads.events)  # the log step itself does read


def test_finetuning_with_ema_between_log_steps_never_waits_on_the_host(
    synthetic_shards, tmp_path, monkeypatch
):
    every = [f"train.log_every={EVERY}", f"train.checkpoint_every={EVERY}"]
    args = finetune_args(synthetic_shards, tmp_path, f"train.steps={STEPS}", *every, "ema=0.9")
    reads = _run_counting(monkeypatch, pipeline("finetune"), args)
    assert _between_log_steps(reads) == []
    assert any(s == EVERY for s, _ in reads.events)


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))


def _backward(model, x, poison=False):
    loss = model(x).square().mean()
    (loss * float("nan") if poison else loss).backward()


@pytest.mark.parametrize("build", [build_adam, build_sgd])
def test_a_non_finite_step_leaves_weights_and_optimizer_state_bit_identical(build, tmp_path):
    acc = Accelerator(cpu=True)
    model = _tiny()
    opt = build(model, FinetuneOptimConfig(lr=0.1, weight_decay=0.01))  # momentum for SGD
    model, opt = acc.prepare(model, opt)
    counters = loop.new_counters()
    bad = loop.BadSteps(2, tmp_path, counters, acc.device)
    x = torch.randn(4, 6)
    _backward(model, x)
    bad.update(apply_step(acc, model, opt, 1.0).applied)
    opt.zero_grad()
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))

    _backward(model, x, poison=True)
    applied = apply_step(acc, model, opt, 1.0).applied
    opt.zero_grad()
    assert applied.dtype == torch.bool and not applied
    params, state = model.state_dict(), opt.state_dict()
    assert all(torch.equal(params[k], v) for k, v in before[0].items())
    for i, s in before[1]["state"].items():  # Adam: moments and step; SGD: momentum buffers
        assert s.keys() == state["state"][i].keys()
        assert all(torch.equal(v, state["state"][i][k]) for k, v in s.items())
    bad.update(applied)
    assert counters["skipped_steps"] == 0  # on the device until a log step
    bad.update(apply_step(acc, model, opt, 1.0).applied)  # no gradient: norm 0, applied
    bad.check(3)  # a log step reads the counts
    assert counters["skipped_steps"] == 1 and bad.in_a_row == 0


def test_apply_step_returns_the_norm_before_the_clip():
    """Every gradient entry 0.5 over the tiny model's 6x8 + 8 + 8x3 + 3 = 83 parameters: the
    global norm is 0.5 sqrt(83) = 4.555; the clip at 1 scales the gradients by 1 / 4.555, and
    the norm returned is the one before it (what the log's grad_norm averages)."""
    acc = Accelerator(cpu=True)
    model = _tiny()
    opt = build_sgd(model, FinetuneOptimConfig(lr=0.1, momentum=0.0))
    model, opt = acc.prepare(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    applied, norm = apply_step(acc, model, opt, 1.0)
    assert applied and norm.item() == pytest.approx(0.5 * 83**0.5, rel=1e-6)
    for p, b in zip(model.parameters(), before, strict=True):  # lr x the clipped gradient
        assert torch.allclose(b - p.detach(), torch.full_like(p, 0.1 * 0.5 / norm.item()))


def test_sgd_skipping_the_first_step_changes_nothing_after(tmp_path):
    # The fused kernel creates the momentum buffers on the first step: a skipped first step
    # must not leave them uninitialized (build_sgd starts them at zero).
    acc = Accelerator(cpu=True)
    x = torch.randn(4, 6)
    runs = []
    for skip_first in (False, True):
        model = _tiny()
        opt = build_sgd(model, FinetuneOptimConfig(lr=0.1))
        if skip_first:
            _backward(model, x, poison=True)
            assert not apply_step(acc, model, opt, 1.0).applied
            opt.zero_grad()
        for _ in range(3):
            _backward(model, x)
            assert apply_step(acc, model, opt, 1.0).applied
            opt.zero_grad()
        runs.append(model.state_dict())
    assert all(torch.equal(v, runs[1][k]) for k, v in runs[0].items())


def test_fused_sgd_is_torchs_update():
    # Zero-started momentum buffers: bit-identical to torch's fused SGD (which creates them on
    # the first step); and the same update as the for-loop SGD up to float rounding.
    x = torch.randn(4, 6)
    ours, fused, plain = _tiny(), _tiny(), _tiny()
    opts = [
        build_sgd(ours, FinetuneOptimConfig(lr=0.1, momentum=0.9)),
        torch.optim.SGD(fused.parameters(), lr=0.1, momentum=0.9, fused=True),
        torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9, foreach=False),
    ]
    for _ in range(4):
        for m, o in zip((ours, fused, plain), opts, strict=True):
            _backward(m, x)
            o.step()
            o.zero_grad()
    for p, q, r in zip(ours.parameters(), fused.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_too_many_bad_steps_stop_at_the_next_log_step(tmp_path):
    counters = loop.new_counters()
    bad = loop.BadSteps(3, tmp_path, counters, "cpu")
    ok, skip = torch.tensor(True), torch.tensor(False)
    for applied in [ok, skip, skip, skip, ok]:  # 3 bad, then good
        bad.update(applied)
    with pytest.raises(loop.TooManyBadStepsError, match="at least 3 steps in a row with a non-"):
        bad.check(5)  # the run ended before the log step: still seen there
    assert counters["skipped_steps"] == 3


def test_due_is_each_period_on_its_own_and_the_meter_reads_counts_at_log_and_checkpoint_steps(
    tmp_path,
):
    assert [s for s in range(1, 11) if loop.due(s, 3)] == [3, 6, 9]
    assert not any(loop.due(s, 0) for s in range(1, 11))  # 0: never (final only)
    meter = _meter(tmp_path, steps=10, log_every=4, checkpoint_every=3)
    assert [s for s in range(1, 11) if meter.logs(s)] == [4, 8, 10]  # and the last step
    reads = []
    meter.bad.check = reads.append
    applied = types.SimpleNamespace(applied=True, scaler_skipped=False, grad_norm=None)
    for s in range(1, 11):
        meter.add(loss=1.0)
        meter.end_step(s, applied)
    assert reads == [3, 4, 6, 8, 9, 10]


def _meter(tmp_path, **train):
    from accelerate import Accelerator

    from ssl_vit.train.runtime import RunContext

    acc = Accelerator(cpu=True)
    plan = types.SimpleNamespace(global_batch=8)
    run = RunContext(acc, plan, tmp_path, tmp_path / "checkpoints")
    tc = types.SimpleNamespace(max_bad_steps=3, grad_clip=1.0, **train)
    cfg = types.SimpleNamespace(train=tc, trackers=(), seed=0)
    return loop.Meter(run, cfg, loop.Resumed(), ("step",))


def test_ema_on_the_device_matches_averaged_model():
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = _tiny()
    ours, ref = EMA(model, 0.9), AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for applied in (True, True, False, True):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ours.update(model, torch.tensor(applied))
        if applied:
            ref.update_parameters(model)
    assert ours.state_dict().keys() == ref.state_dict().keys()  # the same checkpoint format
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, rtol=0, atol=1e-6)
    assert int(ours.n_averaged) == 3


TINY = {"image_size": 16, "patch_size": 4, "width": 32, "depth": 2, "heads": 2, "batch": 8}


def test_the_benchmarks_host_sync_counter_times_a_step_free_of_host_syncs():
    """The GPU suite's counted row runs the pipelines' TrainStep (bench/host_sync.py)."""
    from ssl_vit.bench.host_sync import sync_count_row

    row = sync_count_row(TINY, torch.device("cpu"), "no")
    assert row == {"steps": 3, "host_syncs_per_step": 0.0}


def test_the_benchmarks_step_is_the_pipelines_step():
    """scripts/bench.py times `TrainStep` without an Accelerator (one precision per process
    is all Accelerate allows); with the pipelines' Accelerator the same 3 steps give
    bit-identical weights, and a non-finite step is skipped on the device in both."""
    from ssl_vit.bench.timing import make_train_step
    from ssl_vit.config.schema import ModelConfig, ObjectiveConfig
    from ssl_vit.model import build_vit
    from ssl_vit.objectives import MaskedPatchPrediction
    from ssl_vit.train.step import TrainStep

    def model_and_opt():
        torch.manual_seed(0)
        cfg = ModelConfig(**{k: v for k, v in TINY.items() if k != "batch"})
        model = MaskedPatchPrediction(build_vit(cfg), ObjectiveConfig())
        return model, build_adam(model, OptimConfig(lr=1e-3))

    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    bench_model, opt = model_and_opt()
    bench = make_train_step(bench_model, opt, images, torch.Generator().manual_seed(1))
    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(*model_and_opt())
    step, gen = TrainStep(model, opt, model, 1.0, acc=acc), torch.Generator().manual_seed(1)
    for _ in range(3):
        bench()
        step(images, acc.unwrap_model(model).draw_noise(8, gen))
        assert step.applied.dtype == torch.bool and step.applied
    ours = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(v, ours[k]) for k, v in bench_model.state_dict().items())

    before = copy.deepcopy(ours)
    poisoned = TrainStep(model, opt, lambda *a: model(*a).loss * float("nan"), 1.0, acc=acc)
    poisoned(images, acc.unwrap_model(model).draw_noise(8, gen))
    assert not poisoned.applied
    assert all(torch.equal(v, before[k]) for k, v in acc.unwrap_model(model).state_dict().items())
