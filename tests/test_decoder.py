"""The prediction decoder and MAE's visible-only arm (objectives.decoder): the default stays
the paper's objective bit for bit; the decoder and the arm are the objective's, not the
encoder's; the arm's encoder sees exactly N - n patches and its loss is on exactly the n."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import pipeline
from test_objective import params_without_gradient
from torch import nn

import ssl_vit.objectives
from ssl_vit.bench.host_sync import HostReads
from ssl_vit.config import ConfigError, ObjectiveConfig, PretrainConfig, from_dict
from ssl_vit.model import ViT, normalize_pixels
from ssl_vit.objectives import MASKED, UNTOUCHED, MaskedPatchPrediction, corrupt_patches
from ssl_vit.objectives.masked_patch import MaskedPatchOutput, _gather, _head_size
from ssl_vit.train.checkpoint import load_encoder, load_head

ROOT = Path(__file__).resolve().parents[1]

DECODER = {"decoder_depth": 1}
VISIBLE = {"decoder_depth": 2, "decoder_width": 16, "encoder": "visible", "mask_ratio": 0.75}


def pretrain(shards, out, *extra) -> list[float]:
    cfg = str(ROOT / "configs/pretrain/smoke.yaml")
    pipeline("pretrain")(
        ["--config", cfg, f"data.train_shards={shards}", f"output_dir={out}", *extra]
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def tiny_model(image_size=16, **kw):
    torch.manual_seed(0)
    return MaskedPatchPrediction(ViT(image_size, 4, 32, 2, 2), ObjectiveConfig(**kw))


class PaperObjective(MaskedPatchPrediction):
    """The reference: the paper's objective as objectives/masked_patch.py wrote it before the
    decoder existed (commit dbbcdce): [mask] embedding and head of the encoder's width, every
    patch through the encoder, no decoder branch. Target, loss and draws: the unchanged helpers."""

    built: list[nn.Module] = []  # proves the pipeline ran this class, not the package's

    def __init__(self, encoder, cfg, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> None:
        nn.Module.__init__(self)
        PaperObjective.built.append(self)
        self.encoder = encoder
        self.cfg = cfg
        self.mask_embedding = nn.Parameter(torch.empty(encoder.width))
        self.head = nn.Linear(encoder.width, _head_size(cfg.target, encoder.patch_size))
        self.register_buffer("pixel_mean", torch.tensor(mean), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std), persistent=False)
        nn.init.trunc_normal_(self.mask_embedding, std=0.02)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, images, noise):
        targets_BN, colors_BN = self.targets(images)
        x_BCHW = normalize_pixels(images, self.pixel_mean, self.pixel_std)
        emb_BND = self.encoder.embed_patches(x_BCHW)
        corrupted_BND, kind_BN = corrupt_patches(
            emb_BND, self.mask_embedding, noise, self.cfg.mask_ratio, self.cfg.probs
        )
        out_BND = self.encoder.encode(corrupted_BND)[:, 1:]
        n = self.num_corrupted
        idx_Bn = (kind_BN == 0).to(torch.uint8).argsort(dim=1, stable=True)[:, :n]
        preds_MX = self.head(_gather(out_BND, idx_Bn)).flatten(0, 1)
        targets_M = _gather(targets_BN, idx_Bn).flatten(0, 1)
        colors_M = _gather(colors_BN, idx_Bn).flatten(0, 1)
        loss, preds_MX, correct = self._loss(preds_MX, targets_M, colors_M)
        return MaskedPatchOutput(loss, preds_MX, targets_M, kind_BN, correct, colors_M)


def final_weights(run) -> dict[str, torch.Tensor]:
    state = torch.load(run / "checkpoints/step_00000020/state.pt", weights_only=True)
    return state["model"]


@pytest.mark.system
def test_no_decoder_all_patches_is_the_paper_objective_bit_for_bit(
    synthetic_shards, tmp_path, monkeypatch
):
    """The smoke run (20 steps, every step's loss) with the default objective and with
    decoder_depth=0 / encoder=all given explicitly: the losses and the final weights of the
    paper's objective written without a decoder (PaperObjective), in this process, bit for bit."""
    with monkeypatch.context() as m:  # pipelines/pretrain.py builds the reference model
        m.setattr(ssl_vit.objectives, "MaskedPatchPrediction", PaperObjective)
        PaperObjective.built.clear()
        paper = pretrain(synthetic_shards, tmp_path / "paper", "train.log_every=1")
        assert len(PaperObjective.built) == 1
        PaperObjective.built.clear()
    default = pretrain(synthetic_shards, tmp_path / "default", "train.log_every=1")
    explicit = pretrain(
        synthetic_shards,
        tmp_path / "explicit",
        "train.log_every=1",
        "objective.decoder_depth=0",
        "objective.encoder=all",
    )
    assert len(paper) == 20
    assert default == paper
    assert explicit == paper
    ref = final_weights(tmp_path / "paper")
    for run in ("default", "explicit"):
        got = final_weights(tmp_path / run)
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref), run
    assert "decoder" not in dict(tiny_model().named_children())


def test_visible_arm_encoder_sees_exactly_the_kept_patches_and_no_sync():
    model = tiny_model(**VISIBLE)  # 16 patches, n = 12 left out, 4 kept
    shapes = {}

    def record(name):
        def hook(module, args):
            shapes.setdefault(name, tuple(args[0].shape))

        return hook

    model.encoder.blocks[0].register_forward_pre_hook(record("encoder"))
    model.decoder.blocks[0].register_forward_pre_hook(record("decoder"))
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    noise = model.draw_noise(3, torch.Generator().manual_seed(0))
    with HostReads() as counter:
        out = model(images, noise)
        out.loss.backward()
    assert counter.syncs == 0
    assert shapes == {"encoder": (3, 1 + 4, 32), "decoder": (3, 1 + 16, 16)}
    assert out.logits.shape == (3 * 12, 512) and (out.kind == MASKED).sum(1).tolist() == [12] * 3
    assert math.isclose(out.loss.item(), math.log(512), rel_tol=1e-6)  # zero-init head


def test_visible_arm_loss_is_on_the_masked_patches_hand_checked():
    """8x8 image, patches 4x4: N = 4 solid patches red, green, blue, white -> 3-bit classes
    7*64 = 448, 7*8 = 56, 7, 511. First draw [0.9, 0.1, 0.5, 0.3]: its two smallest are
    patches 1 and 3 (masked), 0 and 2 are kept."""
    model = tiny_model(image_size=8, decoder_depth=1, encoder="visible", mask_ratio=0.5)
    with torch.no_grad():
        model.head.weight.normal_(std=0.1)
    images = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    images[0, 0, :4, :4] = 255  # patch 0 red
    images[0, 1, :4, 4:] = 255  # patch 1 green
    images[0, 2, 4:, :4] = 255  # patch 2 blue
    images[0, :, 4:, 4:] = 255  # patch 3 white
    noise = torch.rand(3, 1, 4)
    noise[0, 0] = torch.tensor([0.9, 0.1, 0.5, 0.3])
    dec = {}
    model.decoder.norm.register_forward_hook(lambda m, a, o: dec.update(out=o))
    out = model(images, noise)
    assert out.kind.tolist() == [[UNTOUCHED, MASKED, UNTOUCHED, MASKED]]
    assert out.targets.tolist() == [56, 511]
    logits = model.head(dec["out"][0, [2, 4]])  # tokens of patches 1 and 3 ([class] first)
    assert torch.allclose(out.loss, F.cross_entropy(logits, torch.tensor([56, 511])))
    # The masked patches' pixels reach the loss only as targets: the encoder never sees them.
    recoloured = images.clone()
    recoloured[0, :, :4, 4:] = 0
    recoloured[0, :, 4:, 4:] = 128
    assert torch.equal(model(recoloured, noise).logits, out.logits)
    recoloured[0, 1, :4, :4] = 200  # a kept patch does change the prediction
    assert not torch.equal(model(recoloured, noise).logits, out.logits)


def test_visible_arm_masks_the_patches_the_first_draw_chooses():
    """The same patches as the paper's corruption for the same draws (its argsort)."""
    ref, model = tiny_model(), tiny_model(**VISIBLE)
    ref.cfg = ObjectiveConfig(mask_ratio=0.75)
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    noise = model.draw_noise(4, torch.Generator().manual_seed(5))
    assert torch.equal(model(images, noise).kind != 0, ref(images, noise).kind != 0)


@pytest.mark.parametrize("kw", [DECODER, {**DECODER, "decoder_width": 48}, VISIBLE])
def test_every_parameter_gets_a_gradient(kw):
    model = tiny_model(**kw)
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    missing = params_without_gradient(model, images)
    assert missing == []
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert names == {"encoder", "decoder", "mask_embedding", "head"}


def test_decoder_shapes_and_defaults():
    model = tiny_model(**DECODER)
    d = model.decoder
    assert (d.embed.in_features, d.embed.out_features) == (32, 32)  # width 0: the encoder's
    assert len(d.blocks) == 1 and d.blocks[0].attn.heads == 2  # head dim 16 kept
    assert d.pos_embed.shape == (1, 17, 32) and model.mask_embedding.shape == (32,)
    wide = tiny_model(decoder_depth=1, decoder_width=48, decoder_heads=4)
    assert wide.head.in_features == 48 and wide.decoder.blocks[0].attn.heads == 4
    assert tiny_model(**VISIBLE).mask_embedding.shape == (16,)  # a decoder input there


@pytest.mark.system
def test_visible_arm_compiles_to_one_graph():
    model = tiny_model(**VISIBLE)
    images = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    noise = model.draw_noise(2, torch.Generator().manual_seed(0))
    compiled = torch.compile(lambda x, z: model(x, z).loss, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(images, noise), model(images, noise).loss)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"encoder": "visible"}, "decoder_depth >= 1"),
        ({"encoder": "visible", "decoder_depth": 1, "mask_ratio": 1.0}, "leave a patch"),
        ({"decoder_depth": -1}, "decoder_depth"),
        ({"decoder_depth": 1, "decoder_width": 30, "decoder_heads": 4}, "not divisible"),
    ],
)
def test_config_errors_name_the_key(overrides, match):
    raw = {"data": {"train_shards": "x"}, "model": {"width": 32, "depth": 2, "heads": 2}}
    with pytest.raises(ConfigError, match=match):
        from_dict(PretrainConfig, {**raw, "objective": overrides})


@pytest.mark.system
@pytest.mark.parametrize("kind", ["decoder", "visible"])
def test_finetune_and_fewshot_load_only_the_encoder(kind, synthetic_shards, tmp_path):
    """A pretraining checkpoint with a decoder: encoder.safetensors holds exactly the encoder's
    keys (loading it is strict: no missing, no unexpected key), the training state and the
    exported head hold the decoder, and the few-shot and fine-tuning pipelines start from it."""
    extra = {
        "decoder": ["objective.decoder_depth=1"],
        "visible": ["objective.decoder_depth=1", "objective.encoder=visible"],
    }[kind]
    run = tmp_path / "pre"
    pretrain(synthetic_shards, run, "train.steps=2", "train.checkpoint_every=2", *extra)
    ckpt = run / "checkpoints" / "step_00000002"
    state, model_cfg = load_encoder(ckpt)
    encoder_keys = set(ViT(16, 4, 32, 2, 2).state_dict())
    assert set(state) == encoder_keys
    head = load_head(ckpt)
    assert {k.split(".")[0] for k in head} == {"decoder", "mask_embedding", "head"}
    assert "decoder.pos_embed" in head and "decoder.embed.weight" in head

    shards = [f"fewshot.train={synthetic_shards}", f"fewshot.eval={synthetic_shards}"]
    fs = pipeline("fewshot")(
        ["--checkpoint", str(ckpt), "--config", str(ROOT / "configs/fewshot/smoke.yaml"),
         *shards, f"output_dir={tmp_path / 'fs'}"]
    )  # fmt: skip
    assert 0.0 <= fs["5shot"] <= 1.0
    shards = [f"data.train={synthetic_shards}", f"data.eval={synthetic_shards}"]
    ft = pipeline("finetune")(
        ["--config", str(ROOT / "configs/finetune/smoke.yaml"), *shards,
         f"init.checkpoint={ckpt}", f"output_dir={tmp_path / 'ft'}", "train.steps=2"]
    )  # fmt: skip
    assert 0.0 <= ft["top1"] <= 1.0
