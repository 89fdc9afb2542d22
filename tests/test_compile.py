"""compile.enabled: forward+loss is one graph in both pipelines (fullgraph=True), `auto` means CUDA
only, and a compile failure falls back to eager with one warning line, results unchanged."""

import json
import logging

import pytest
import torch
from conftest import pipeline
from test_pipelines import ROOT, finetune_args, pretrain_args

from ssl_vit.config import FinetuneConfig, PretrainConfig, load_config
from ssl_vit.config.loader import ConfigError
from ssl_vit.config.schema import ObjectiveConfig
from ssl_vit.model import ViT
from ssl_vit.model import compile as compile_mod
from ssl_vit.model.compile import Compiled, compile_enabled
from ssl_vit.objectives import MaskedPatchPrediction


@pytest.mark.system
def test_pretraining_forward_and_loss_is_one_graph():
    model = MaskedPatchPrediction(ViT(16, 4, 32, 2, 2), ObjectiveConfig())
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    noise = model.draw_noise(4, torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(model)(images, noise)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out, ref = compiled(images, noise), model(images, noise)
    torch.testing.assert_close(out.loss, ref.loss)
    assert torch.equal(out.kind, ref.kind)
    out.loss.backward()
    assert model.mask_embedding.grad is not None


def test_compile_setting():
    assert compile_enabled("auto", "cuda") and not compile_enabled("auto", "cpu")
    assert compile_enabled(True, "cpu") and not compile_enabled(False, "cuda")
    pre, fine = ROOT / "configs/pretrain/smoke.yaml", ROOT / "configs/finetune/smoke.yaml"
    assert load_config(PretrainConfig, pre, []).compile.enabled == "auto"
    overrides = ["compile.enabled=true", "compile.mode=max-autotune"]
    cfg = load_config(FinetuneConfig, fine, overrides)
    assert cfg.compile.enabled is True and cfg.compile.mode == "max-autotune"
    with pytest.raises(ConfigError, match="compile.enabled"):
        load_config(PretrainConfig, pre, ["compile.enabled=sometimes"])
    with pytest.raises(ConfigError, match="compile.mode"):
        load_config(PretrainConfig, pre, ["compile.mode=fast"])


class Backend:
    """aot_eager, counting the graphs handed to it; or raising, as a broken compiler would."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.graphs = fail, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        if self.fail:
            raise RuntimeError("backend exploded\nsecond line of the trace")
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)


def test_a_compile_failure_runs_eagerly_after_one_warning(caplog):
    calls = []

    def step(x):
        calls.append(1)
        return x * 2

    compiled = Compiled(step, backend=Backend(fail=True))
    with caplog.at_level(logging.WARNING):
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "torch.compile of step failed, running it eagerly" in warnings[0]
    assert "backend exploded" in warnings[0] and "second line" not in warnings[0]


def _losses(out) -> list:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


@pytest.mark.system
@pytest.mark.parametrize("job", ["pretrain", "finetune"])
def test_pipelines_compile_one_graph_or_fall_back(job, synthetic_shards, tmp_path, monkeypatch):
    def run(out, *extra):
        torch.manual_seed(0)  # (finetune's random init is drawn before the job seeds)
        if job == "pretrain":
            args = pretrain_args(synthetic_shards, out, "train.steps=4", "train.log_every=2")
        else:
            args = finetune_args(synthetic_shards, out, "train.steps=4", "train.log_every=2")
        return pipeline(job)([*args, *extra])

    run(tmp_path / "eager", "compile.enabled=false")
    backend = Backend()
    monkeypatch.setattr(compile_mod, "BACKEND", backend)
    run(tmp_path / "compiled", "compile.enabled=true")
    assert backend.graphs == 1  # fullgraph=True: a graph break would have raised instead
    compiled, eager = _losses(tmp_path / "compiled"), _losses(tmp_path / "eager")
    assert compiled == pytest.approx(eager, rel=1e-4)

    monkeypatch.setattr(compile_mod, "BACKEND", Backend(fail=True))
    caplog_lines = []
    handler = logging.Handler()
    handler.emit = lambda record: caplog_lines.append(record.getMessage())
    logging.getLogger(compile_mod.__name__).addHandler(handler)
    try:
        run(tmp_path / "fallback", "compile.enabled=true")
    finally:
        logging.getLogger(compile_mod.__name__).removeHandler(handler)
    assert len(caplog_lines) == 1 and "running it eagerly" in caplog_lines[0]
    assert _losses(tmp_path / "fallback") == eager  # eager from the first step: identical


@pytest.mark.system  # takes seconds (the marker's definition): out of the fast tier
def test_fewshot_extraction_compiles_one_graph_for_all_batches(monkeypatch):
    from ssl_vit.eval.fewshot_job import extract_features
    from ssl_vit.eval.readouts import Extraction, extract_layer_features

    encoder = ViT(16, 4, 32, 2, 2)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (11, 3, 16, 16), dtype=torch.uint8, generator=g)
    batches = [(images[i : i + 4], torch.arange(i, min(i + 4, 11))) for i in range(0, 11, 4)]
    stats = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    eager, compiled = Extraction(*stats), Extraction(*stats, compile=True)
    eager_x, eager_y = extract_features(encoder, batches, eager, "gap")
    backend = Backend()
    monkeypatch.setattr(compile_mod, "BACKEND", backend)
    x, y = extract_features(encoder, batches, compiled, "gap")
    assert backend.graphs == 1  # the last batch (3 images) is padded to 4: the same graph
    assert x.shape == (11, 32) and torch.equal(y, eager_y)
    torch.testing.assert_close(x, eager_x, rtol=1e-5, atol=1e-5)
    feats, _ = extract_layer_features(encoder, batches, compiled, [0, 1])
    eager_feats, _ = extract_layer_features(encoder, batches, eager, [0, 1])
    torch.testing.assert_close(feats, eager_feats, rtol=1e-5, atol=1e-5)
