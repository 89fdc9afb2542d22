"""The fine-tuning recipes: config resolution, layer-wise lr decay, mixing, drop path,
RandAugment seeding, and the modern recipe's exact resume / the paper's unchanged losses."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import pipeline
from safetensors.torch import load_file
from test_faults import stop_after_step
from test_pipelines import finetune_args, rows

from ssl_vit import seeds
from ssl_vit.config import ConfigError, FinetuneConfig, from_dict, load_config
from ssl_vit.config.recipe import RecipeParts
from ssl_vit.data.images import RandAugment, train_transform
from ssl_vit.model import Classifier
from ssl_vit.model.vit import ViT
from ssl_vit.train.optim import build_sgd
from ssl_vit.train.plan import build_plan
from ssl_vit.train.recipe import BatchMixer, build_finetune_optimizer, recipe_loss
from ssl_vit.train.schedules import set_lr

BASE = {"data": {"train": "x"}}


def test_modern_recipe_fills_only_what_is_not_given():
    paper = from_dict(FinetuneConfig, dict(BASE))
    assert paper.recipe == "paper" and paper.parts == RecipeParts()  # all off, SGD
    assert (paper.train.lr, paper.train.weight_decay) == (0.01, 0.0)
    modern = load_config(FinetuneConfig, None, ["data.train=x", "recipe=modern"])
    p = modern.parts
    assert (p.optimizer, p.layer_decay, p.randaugment) == ("adamw", 0.75, "rand-m9-mstd0.5-inc1")
    assert (p.mixup, p.cutmix, p.label_smoothing, p.drop_path) == (0.8, 1.0, 0.1, 0.1)
    assert modern.train.lr == pytest.approx(1e-3 * 512 / 256)  # MAE: base lr x batch / 256
    assert (modern.train.weight_decay, modern.train.betas) == (0.05, (0.9, 0.999))
    explicit = load_config(
        FinetuneConfig,
        None,
        ["data.train=x", "recipe=modern", "parts.mixup=0", "train.batch_size=64", "train.lr=0.5"],
    )
    assert explicit.parts.mixup == 0.0 and explicit.parts.cutmix == 1.0  # the rest: recipe's
    assert explicit.train.lr == 0.5  # explicit wins, whatever its value
    scaled = load_config(
        FinetuneConfig, None, ["data.train=x", "recipe=modern", "train.batch_size=64"]
    )
    assert scaled.train.lr == pytest.approx(2.5e-4)


def test_recipe_errors_name_the_key():
    with pytest.raises(ConfigError, match="recipe: expected one of"):
        from_dict(FinetuneConfig, {**BASE, "recipe": "mae"})
    with pytest.raises(ConfigError, match="parts.layer_decay"):
        from_dict(FinetuneConfig, {**BASE, "parts": {"layer_decay": 0.0}})
    with pytest.raises(ConfigError, match="parts.randaugment"):
        from_dict(FinetuneConfig, {**BASE, "parts": {"randaugment": "m9"}})
    odd = from_dict(FinetuneConfig, {**BASE, "recipe": "modern", "train": {"batch_size": 33}})
    with pytest.raises(ConfigError, match="^parts.mixup/cutmix: need an even batch"):
        build_plan(odd, 1)


def _tiny_classifier(depth: int = 3) -> Classifier:
    return Classifier(ViT(16, 4, width=8, depth=depth, heads=2), num_classes=5)


def _layer_of(name: str, depth: int) -> int:
    """Hand-written layer ids: embeddings 0, block i -> i + 1, final norm and head depth + 1."""
    if name.startswith(("encoder.patch_embed", "encoder.cls_token", "encoder.pos_embed")):
        return 0
    if name.startswith("encoder.blocks."):
        return int(name.split(".")[2]) + 1
    return depth + 1


def test_layer_decay_gives_each_block_its_lr_and_keeps_the_no_decay_set():
    depth, decay = 3, 0.6
    model = _tiny_classifier(depth)
    parts = RecipeParts(optimizer="adamw", layer_decay=decay)
    cfg = from_dict(FinetuneConfig, {**BASE, "train": {"weight_decay": 0.05}}).train
    opt = build_finetune_optimizer(model, parts, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    set_lr(opt, 2.0)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(group_of) == len(named)  # every parameter optimized, once
    for name, p in named.items():
        g = group_of[id(p)]
        assert g["lr"] == pytest.approx(2.0 * decay ** (depth + 1 - _layer_of(name, depth))), name
        exempt = p.ndim <= 1 or name in ("encoder.pos_embed", "encoder.cls_token")
        assert g["weight_decay"] == (0.0 if exempt else 0.05), name
    assert group_of[id(named["head.weight"])]["lr"] == 2.0
    assert group_of[id(named["encoder.pos_embed"])]["lr"] == pytest.approx(2.0 * decay**4)


def test_paper_parts_keep_the_papers_sgd():
    model = _tiny_classifier()
    cfg = from_dict(FinetuneConfig, dict(BASE)).train
    opt = build_finetune_optimizer(model, RecipeParts(), cfg)
    assert type(opt) is torch.optim.SGD and len(opt.param_groups) == 2
    assert all("lr_scale" not in g for g in opt.param_groups)
    assert recipe_loss(RecipeParts()) is torch.nn.functional.cross_entropy


def _smooth_onehot(y: torch.Tensor, k: int, eps: float) -> torch.Tensor:
    return torch.nn.functional.one_hot(y, k).float() * (1 - eps) + eps / k


def test_mixup_targets_are_the_hand_computed_mixture():
    k, eps, parts = 10, 0.1, RecipeParts(mixup=0.8, label_smoothing=0.1)
    mixer = BatchMixer(parts, k, seed=3)
    for index in range(20):
        x = torch.randn(8, 3, 4, 4)
        y = torch.randint(0, k, (8,))
        np.random.seed(seeds.derive(3, seeds.MIXUP, index))
        np.random.rand()  # timm: whether to mix at all (prob 1), then lam ~ Beta(0.8, 0.8)
        lam = float(np.random.beta(0.8, 0.8))
        np.random.seed(index)  # the caller's state: the mixer must leave it as it was
        before = np.random.get_state()[1].copy()
        x_mixed, target = mixer(x.clone(), y, index)
        assert np.array_equal(np.random.get_state()[1], before)
        expected = lam * _smooth_onehot(y, k, eps) + (1 - lam) * _smooth_onehot(y.flip(0), k, eps)
        torch.testing.assert_close(target, expected)
        torch.testing.assert_close(target.sum(-1), torch.ones(8))
        torch.testing.assert_close(x_mixed, lam * x + (1 - lam) * x.flip(0))


def test_cutmix_targets_weigh_the_pasted_area():
    """Image i is constant i: the share of its own pixels after cutmix is the target's lam."""
    k, b = 10, 6
    mixer = BatchMixer(RecipeParts(cutmix=1.0), k)
    y = torch.arange(b)
    for index in range(50):
        x = torch.arange(b, dtype=torch.float32).view(b, 1, 1, 1).expand(b, 3, 8, 8).clone()
        x_mixed, target = mixer(x, y, index)
        torch.testing.assert_close(target.sum(-1), torch.ones(b))
        own = (x_mixed == y.view(b, 1, 1, 1)).float().mean(dim=(1, 2, 3))
        torch.testing.assert_close(target[torch.arange(b), y], own)


def test_images_are_paired_within_their_group():
    """Image i is constant i; groups of 4: each image mixes with its group reversed (timm's
    pairing inside each group), the targets alike."""
    k, n = 8, 8
    mixer = BatchMixer(RecipeParts(mixup=0.8), k, seed=5, group=4)
    partner = torch.tensor([3, 2, 1, 0, 7, 6, 5, 4])
    y = torch.arange(n)
    for index in range(20):
        x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 3, 2, 2).clone()
        x_mixed, target = mixer(x, y, index)
        lam = target[0, 0].item()  # image 0's own share
        own = lam * torch.arange(n) + (1 - lam) * partner
        torch.testing.assert_close(x_mixed[:, 0, 0, 0], own.float())
        expected = lam * _smooth_onehot(y, k, 0) + (1 - lam) * _smooth_onehot(partner, k, 0)
        torch.testing.assert_close(target, expected)


@pytest.mark.parametrize("parts", [RecipeParts(mixup=0.8), RecipeParts(cutmix=1.0)])
def test_a_process_mixes_its_slice_as_the_whole_batch_does(parts):
    """Ranks hold whole groups (lanes): mixing each rank's slice of a micro-batch gives that
    slice of the whole micro-batch mixed in one process, for every index."""
    k, n, group = 10, 12, 2
    x = torch.randn(n, 3, 8, 8)
    y = torch.randint(0, k, (n,))
    whole, part = (
        BatchMixer(parts, k, seed=7, group=group),
        BatchMixer(parts, k, seed=7, group=group),
    )
    for index in range(30):
        xw, tw = whole(x.clone(), y, index)
        for ranks in (2, 3):
            b = n // ranks
            slices = [
                part(x[r * b : (r + 1) * b].clone(), y[r * b : (r + 1) * b], index)
                for r in range(ranks)
            ]
            assert torch.equal(torch.cat([s[0] for s in slices]), xw)
            assert torch.equal(torch.cat([s[1] for s in slices]), tw)


def test_drop_path_drops_whole_samples_in_training_only():
    torch.manual_seed(0)
    vit = ViT(16, 4, width=8, depth=3, heads=2)
    x = torch.randn(64, 17, 8)
    block = vit.blocks[2]
    reference = block(x)  # rate 0: no drop path module at all
    vit.set_drop_path(0.5)
    assert [getattr(b.drop_path, "drop_prob", 0.0) for b in vit.blocks] == [0.0, 0.25, 0.5]
    block.eval()
    torch.testing.assert_close(block(x), reference, rtol=0, atol=0)  # off in eval: identical
    block.train()
    out = block(x)
    unchanged = (out == x).flatten(1).all(1)  # both residual branches dropped: out == in
    assert 0 < unchanged.sum() < 64  # some samples dropped, not all
    vit.set_drop_path(0.0)
    assert all(isinstance(b.drop_path, torch.nn.Identity) for b in vit.blocks)


def test_randaugment_is_a_function_of_the_seed_and_restores_the_rngs():
    aug = train_transform(16, (0.5, 1.0), True, "rand-m9-mstd0.5-inc1")
    image = torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8)
    outs = []
    random.seed(1)
    np.random.seed(1)
    before = (random.random(), np.random.rand())
    for _ in range(2):
        random.seed(1)
        np.random.seed(1)
        torch.manual_seed(7)
        outs.append(aug(image))
        assert (random.random(), np.random.rand()) == before  # the global RNGs untouched
    assert outs[0].shape == (3, 16, 16) and outs[0].dtype == torch.uint8
    assert torch.equal(outs[0], outs[1])
    torch.manual_seed(8)
    ra = RandAugment("rand-m9-mstd0.5-inc1", 16)
    crops = train_transform(16, (0.5, 1.0), True)
    assert any(not torch.equal(ra(crops(image)), crops(image)) for _ in range(5))


def test_randaugment_never_fails_at_full_magnitude():
    """Posterize at magnitude 10 keeps 0 bits, which Pillow >= 12 refuses (a black image)."""
    ra = RandAugment("rand-n3-m10-mstd1-inc1", 16)
    image = torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8)
    for seed in range(300):
        torch.manual_seed(seed)
        assert ra(image).shape == (3, 16, 16)


def _smoke_args(shards, out, *extra):
    return finetune_args(shards, out, "train.log_every=1", "train.checkpoint_every=0", *extra)


@pytest.mark.system
def test_paper_recipe_keeps_the_losses_of_before(synthetic_shards, tmp_path, monkeypatch):
    """recipe=paper through the recipe's code (build_finetune_optimizer, recipe_loss,
    set_drop_path, the loader's randaugment) against the same run with those calls replaced by
    what the pipeline called before recipes existed (commit 1f9e305: build_sgd, F.cross_entropy,
    no drop path, no RandAugment argument), in this process: the same 20 losses and final
    weights, bit for bit."""
    pipeline("finetune")(_smoke_args(synthetic_shards, tmp_path / "recipe", "data.num_workers=0"))
    before = pipeline("finetune")
    g = before.__globals__  # this fresh module's own names: nothing else sees the swap
    calls: list[str] = []
    train_loader = g["train_loader"]

    def sgd(model, parts, cfg):
        calls.append("optimizer")
        return build_sgd(model, cfg)

    def cross_entropy(parts):
        calls.append("loss")
        return F.cross_entropy

    def loader(*args, randaugment, **kwargs):
        calls.append("loader")
        return train_loader(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setitem(g, "build_finetune_optimizer", sgd)
        m.setitem(g, "recipe_loss", cross_entropy)
        m.setattr(ViT, "set_drop_path", lambda self, rate: calls.append("drop_path"))
        m.setitem(g, "train_loader", loader)
        before(_smoke_args(synthetic_shards, tmp_path / "before", "data.num_workers=0"))
    assert sorted(calls) == ["drop_path", "loader", "loss", "optimizer"]  # the swap took
    recipe, ref = rows(tmp_path / "recipe"), rows(tmp_path / "before")
    assert len(ref) == 20
    assert [r["loss"] for r in recipe] == [r["loss"] for r in ref]
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("recipe", "before"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.system
def test_modern_recipe_preempted_and_resumed_is_exact(synthetic_shards, tmp_path, monkeypatch):
    """recipe=modern (RandAugment in 2 workers, mixup/cutmix from NumPy's RNG, drop path from
    torch's, AdamW with layer decay): stopped after step 5 and resumed, the losses and the final
    weights are those of the uninterrupted run."""

    def args(out, *extra):
        modern = ["recipe=modern", "train.lr=1e-3", "train.steps=10", "data.num_workers=2"]
        return _smoke_args(synthetic_shards, out, *modern, *extra)

    main = pipeline("finetune")
    torch.manual_seed(0)
    main(args(tmp_path / "ref"))
    stop_after_step(monkeypatch, 5)
    torch.manual_seed(0)
    assert main(args(tmp_path / "run")) == {"step": 5, "preempted": True}
    main(args(tmp_path / "run", "--resume"))
    ref, run = rows(tmp_path / "ref"), rows(tmp_path / "run")
    assert [r["step"] for r in run] == list(range(1, 11))
    assert [r["loss"] for r in run] == [r["loss"] for r in ref]
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("ref", "run"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    config = yaml.safe_load((tmp_path / "run/config.yaml").read_text())  # resolved values
    assert config["parts"]["mixup"] == 0.8 and config["train"]["weight_decay"] == 0.05


def test_a_micro_batchs_mix_depends_on_the_seed_and_its_index_only():
    """Two mixers (two processes, or a resumed run) mix micro-batch u alike whatever ran
    before; another u or another seed mixes otherwise."""
    parts, k = RecipeParts(mixup=0.8, cutmix=1.0, switch_prob=0.5), 10
    x = torch.arange(4 * 3 * 8 * 8, dtype=torch.float32).view(4, 3, 8, 8)
    y = torch.arange(4)

    def mix(mixer, index):
        return mixer(x.clone(), y, index)[1]

    a, b = BatchMixer(parts, k, seed=1), BatchMixer(parts, k, seed=1)
    ran_a = [mix(a, u) for u in range(30)]
    for u in (29, 3, 17, 0):  # b in another order, with unrelated global draws between
        np.random.rand(u + 1)
        torch.testing.assert_close(mix(b, u), ran_a[u])
    assert len({round(t[0, 0].item(), 6) for t in ran_a}) > 10  # lam varies with u
    other = BatchMixer(parts, k, seed=2)
    assert any(not torch.equal(mix(other, u), ran_a[u]) for u in range(30))
