"""ssl_vit.data.device_augment: the batched crop + flip is exact where it should be, draws
torchvision's boxes, never syncs with the host, and a resumed run sees the same batches."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import pipeline
from torchvision import transforms

from ssl_vit.bench.host_sync import HostReads
from ssl_vit.config import PretrainConfig, load_config
from ssl_vit.config.checks import auto_num_workers
from ssl_vit.config.schema import PretrainDataConfig
from ssl_vit.data import StreamArgs, pretrain_loader, resolve_shards
from ssl_vit.data.decode import decode_image
from ssl_vit.data.device_augment import DeviceAugment, load_size, resolve_augment
from ssl_vit.data.images import SquareLoad
from ssl_vit.data.stages import Stats, shard_samples
from ssl_vit.train.plan import build_plan

ROOT = Path(__file__).resolve().parents[1]


def _augment(size, seed=0, **kw) -> DeviceAugment:
    return DeviceAugment(size, torch.Generator().manual_seed(seed), **kw)


@pytest.mark.parametrize("size", [16, 24, 33])
def test_identity_at_full_scale_and_unit_ratio(size):
    x = torch.randint(0, 256, (6, 3, size, size), dtype=torch.uint8)
    out = _augment(size, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=False)(x)
    assert out.dtype == torch.uint8 and torch.equal(out, x)


def test_flip_only_is_exact_torch_flip():
    x = torch.randint(0, 256, (64, 3, 20, 20), dtype=torch.uint8)
    aug = _augment(20, seed=3, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    flips = _augment(20, seed=3, scale=(1.0, 1.0), ratio=(1.0, 1.0)).boxes(64, 20, 20, "cpu")[-1]
    out = aug(x)
    assert 10 < int(flips.sum()) < 54  # both kinds present
    for i in range(64):
        assert torch.equal(out[i], torch.flip(x[i], [-1]) if flips[i] else x[i])


def test_crop_resizes_the_drawn_box():
    """A box of the output's size (scale 1/4 of a 16 px load, output 8): the box's pixels."""
    aug = _augment(8, scale=(0.25, 0.25), ratio=(1.0, 1.0), hflip=False)
    x = torch.arange(16 * 16, dtype=torch.float32).reshape(1, 1, 16, 16).expand(1, 3, 16, 16)
    top, left, h, w, _ = _augment(8, scale=(0.25, 0.25), ratio=(1.0, 1.0)).boxes(1, 16, 16, "cpu")
    assert (h.item(), w.item()) == (8, 8)
    out = aug(x.contiguous())
    t, l_ = int(top), int(left)
    torch.testing.assert_close(out[0, 0], x[0, 0, t : t + 8, l_ : l_ + 8])


def _ks(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    grid = torch.cat([a, b]).unique()
    fa = torch.searchsorted(a.sort().values, grid, right=True) / len(a)
    fb = torch.searchsorted(b.sort().values, grid, right=True) / len(b)
    return float((fa - fb).abs().max())


@pytest.mark.parametrize(
    ("height", "width", "scale"), [(224, 224, (0.08, 1.0)), (40, 160, (0.5, 1.0))]
)
def test_box_distribution_matches_torchvision(height, width, scale):
    """KS tests (fixed seeds: deterministic) of area fraction, log aspect and relative position
    against RandomResizedCrop.get_params; the thin image exercises the central fallback."""
    n = 3000
    top, left, h, w, _ = _augment(16, seed=1, scale=scale).boxes(n, height, width, "cpu")
    ours = torch.stack([top, left, h, w], 1).float()
    torch.manual_seed(2)
    img = torch.empty(3, height, width)
    ref = torch.tensor(
        [transforms.RandomResizedCrop.get_params(img, scale, (3 / 4, 4 / 3)) for _ in range(n)]
    ).float()
    for boxes in (ours, ref):
        assert (boxes[:, 2] >= 1).all() and (boxes[:, 0] + boxes[:, 2] <= height).all()
        assert (boxes[:, 3] >= 1).all() and (boxes[:, 1] + boxes[:, 3] <= width).all()

    def stats(b):
        t, l_, hh, ww = b.unbind(1)
        return {
            "area": hh * ww / (height * width),
            "log_aspect": torch.log(ww / hh),
            "top": t / (height - hh).clamp(min=1),
            "left": l_ / (width - ww).clamp(min=1),
        }

    critical = 1.95 * math.sqrt(2 / n)  # alpha = 0.001
    so, sr = stats(ours), stats(ref)
    for k in so:
        assert _ks(so[k], sr[k]) < critical, k
    # Same share of central fallbacks (a thin image: many tries fail).
    fb_ours = ((ours[:, 2] == height) & (ours[:, 1] == (width - ours[:, 3]) // 2)).float().mean()
    fb_ref = ((ref[:, 2] == height) & (ref[:, 1] == (width - ref[:, 3]) // 2)).float().mean()
    assert abs(float(fb_ours - fb_ref)) < 0.05


def test_no_host_sync_and_static_shape():
    aug = _augment(24)
    x = torch.randint(0, 256, (32, 3, 28, 28), dtype=torch.uint8)
    with HostReads() as counter:
        outs = [aug(x) for _ in range(3)]
    assert counter.syncs == 0
    assert all(o.shape == (32, 3, 24, 24) and o.dtype == torch.uint8 for o in outs)
    assert not torch.equal(outs[0], outs[1])  # fresh draws every call


def test_ranks_draw_their_slice_of_the_global_micro_batch():
    """Micro-batch u's crops on 2 processes (each its 4 images) are one process's crops of the
    8; a function of u (seed, rank and world size fixed), not of earlier calls."""
    x = torch.randint(0, 256, (8, 3, 20, 20), dtype=torch.uint8)
    one = DeviceAugment(12, torch.Generator(), stream=(5, 0, 8))  # the global micro-batch: 8
    two = [DeviceAugment(12, torch.Generator(), stream=(5, r, 8)) for r in range(2)]
    for u in (0, 3, 0):
        whole = one(x, u)
        assert torch.equal(
            torch.cat([a(x[4 * r : 4 * r + 4], u) for r, a in enumerate(two)]), whole
        )
    assert not torch.equal(one(x, 0), one(x, 1))


def test_generator_state_round_trip():
    aug = _augment(16, seed=5)
    x = torch.randint(0, 256, (8, 3, 20, 20), dtype=torch.uint8)
    aug(x)
    state = aug.state_dict()
    a = aug(x)
    other = _augment(16, seed=99)
    other.load_state_dict(state)
    assert torch.equal(other(x), a)


def test_resolution_of_keys(monkeypatch):
    assert resolve_augment("auto", "cpu") == "workers"
    assert resolve_augment("auto", torch.device("cuda", 0)) == "device"
    assert resolve_augment("device", "cpu") == "device"
    assert [load_size(0, s) for s in (16, 32, 64, 224, 384)] == [16, 32, 64, 256, 440]
    assert load_size(40, 32) == 40
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert auto_num_workers(-1) == 4 and auto_num_workers(3) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert auto_num_workers(-1) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert auto_num_workers(-1) == 1
    cfg = load_config(PretrainConfig, None, ["data.train_shards=x"])
    assert build_plan(cfg, 1).num_workers == 1  # resolved once (32 processes on 16 CPUs: 1 each)


def test_square_load_keeps_aspect():
    x = torch.zeros(3, 20, 40, dtype=torch.uint8)
    x[:, :, 10:30] = 255  # the central square is white, the ends black
    out = SquareLoad(10)(x)
    # The centre is kept (squashing would bring the black ends in); antialiasing blurs the rim.
    assert out.shape == (3, 10, 10) and out[..., 1:-1].min() == 255


def test_loader_with_load_size_delivers_unaugmented_images(synthetic_shards):
    urls = resolve_shards(str(synthetic_shards))
    data = PretrainDataConfig(shuffle_buffer=1)
    batch = next(iter(pretrain_loader(data, StreamArgs(8, 0, 16, load_size=32), urls=urls)))
    assert batch.images.shape == (8, 3, 32, 32)
    raw = {}
    for url in urls:
        for s in shard_samples(url, Stats(), True):
            raw[s["__key__"]] = decode_image(s["png"])
    for key, image in zip(batch.keys, batch.images, strict=True):
        assert torch.equal(image, raw[key])  # 32 px images at load 32: exactly the decoded ones


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _job_args(job: str, shards: Path) -> list[str]:
    if job == "pretrain":
        data = [f"data.train_shards={shards}"]
    else:  # from scratch, no evaluation: the training losses are what is compared
        data = [f"data.train={shards}", "data.eval=", "init.checkpoint=none", "eval_every=0"]
    return [
        *("--config", str(ROOT / f"configs/{job}/smoke.yaml"), *data),
        *("data.augment=device", "data.load_size=32", "train.steps=20", "train.log_every=5"),
        *("train.checkpoint_every=10", "train.keep_checkpoints=3"),
    ]


@pytest.mark.system
@pytest.mark.parametrize("job", ["pretrain", "finetune"])
def test_resumed_run_sees_the_same_batches(job, synthetic_shards, tmp_path):
    """Device augmentation on the CPU: a run resumed from its step-10 checkpoint logs the same
    losses as the uninterrupted run (the augmentation generator is saved and restored)."""
    main, args = pipeline(job), _job_args(job, synthetic_shards)
    full, cut = tmp_path / "full", tmp_path / "cut"
    main([*args, f"output_dir={full}"])
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints/step_00000020")
    main([*args, f"output_dir={cut}", "--resume"])
    a, b = _losses(full), _losses(cut)
    assert sorted(a) == sorted(b) == [5, 10, 15, 20]
    assert a == b, (a, b)
    # (The draws are a function of the micro-batch's index: nothing to restore.)
