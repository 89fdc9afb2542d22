"""The fast train augmentation draws and computes exactly what torchvision v2's does."""

import pytest
import torch

from ssl_vit.data.images import torchvision_train_transform, train_transform


@pytest.mark.parametrize(
    ("shape", "size", "scale", "hflip"),
    [
        ((3, 32, 32), 32, (0.08, 1.0), True),
        ((3, 32, 32), 16, (0.35, 1.0), False),
        ((3, 40, 24), 48, (0.5, 1.0), True),
        ((3, 4, 64), 8, (0.9, 1.0), True),  # extreme aspect: mostly the central-crop fallback
        pytest.param(  # a photo: downscaled and upscaled crops; seconds, so the system tier
            (3, 300, 400), 224, (0.08, 1.0), True, marks=pytest.mark.system
        ),
    ],
)
def test_train_transform_is_bit_identical_to_torchvision(shape, size, scale, hflip):
    fast = train_transform(size, scale, hflip)
    ref = torchvision_train_transform(size, scale, hflip)
    g = torch.Generator().manual_seed(0)
    for i in range(100):
        image = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        torch.manual_seed(i)
        a = fast(image)
        state_a = torch.get_rng_state()
        torch.manual_seed(i)
        b = ref(image)
        assert torch.equal(a, b) and a.shape == (3, size, size)
        assert torch.equal(state_a, torch.get_rng_state())  # same number of draws


def _smooth_jpeg(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    """A photo-like JPEG q90: random colours on a coarse grid, upsampled (smooth content)."""
    import io

    import numpy as np
    from PIL import Image

    coarse = np.random.default_rng(seed).integers(0, 256, (height // 25, width // 25, 3))
    im = Image.fromarray(coarse.astype(np.uint8)).resize((width, height), Image.BICUBIC)
    buf = io.BytesIO()
    im.convert(mode).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.mark.parametrize(("mode", "size"), [("RGB", 16), ("RGB", 24), ("L", 16)])
def test_reduced_jpeg_decode_keeps_the_crop_and_the_image(monkeypatch, mode, size):
    """from_bytes draws what `self(decode_image(...))` draws (same boxes, same RNG state after,
    same flips), decodes most crops of a 400x300 JPEG at 1/2..1/8 scale, and its image stays
    close to the full decode's (the filters differ: DCT scaling + PIL's bilinear vs
    torchvision's antialiased bilinear)."""
    from ssl_vit.data import decode as decode_mod
    from ssl_vit.data import images
    from ssl_vit.data.decode import decode_image
    from ssl_vit.data.images import RandomResizedCropFlip

    crop = RandomResizedCropFlip(size)
    boxes, scales = [], []
    draw = RandomResizedCropFlip.crop_box
    monkeypatch.setattr(
        RandomResizedCropFlip,
        "crop_box",
        lambda self, h, w: boxes.append(draw(self, h, w)) or boxes[-1],
    )
    reduced = decode_mod.open_jpeg_reduced
    monkeypatch.setattr(images, "open_jpeg_reduced", lambda d, s: scales.append(s) or reduced(d, s))
    diffs = []
    for i in range(60):
        data = _smooth_jpeg(400, 300, seed=i % 5, mode=mode)
        torch.manual_seed(i)
        a = crop.from_bytes(data)
        state_a = torch.get_rng_state()
        torch.manual_seed(i)
        b = crop(decode_image(data))
        assert torch.equal(state_a, torch.get_rng_state())
        assert boxes[-1] == boxes[-2]
        assert a.shape == b.shape == (3, size, size) and a.dtype == torch.uint8
        diffs.append((a.float() - b.float()).abs().mean().item())
    assert len(scales) >= 30 and set(scales) <= {2, 4, 8}  # most crops took the reduced path
    assert max(diffs) < 6 and sum(diffs) / len(diffs) < 3  # grey levels of 255


def test_reduced_decode_only_when_nothing_is_lost():
    """A crop smaller than 2S a side, a PNG and a CMYK JPEG are decoded in full, exactly as
    before (bit-identical to decode + crop)."""
    import io

    from PIL import Image

    from ssl_vit.data.decode import decode_image
    from ssl_vit.data.images import RandomResizedCropFlip

    buf = io.BytesIO()
    Image.frombytes("CMYK", (64, 48), bytes(range(256)) * 48).save(buf, format="JPEG")
    png = io.BytesIO()
    Image.open(io.BytesIO(_smooth_jpeg(100, 75, 0))).save(png, format="PNG")
    cases = [(_smooth_jpeg(100, 75, 1), 64), (png.getvalue(), 8), (buf.getvalue(), 8)]
    for data, size in cases:
        crop = RandomResizedCropFlip(size)
        for i in range(20):
            torch.manual_seed(i)
            a = crop.from_bytes(data)
            torch.manual_seed(i)
            assert torch.equal(a, crop(decode_image(data)))


def test_stream_of_jpegs_resumes_exactly_through_the_reduced_decode(tmp_path):
    """Through the loader workers, with most crops decoded at reduced scale: a stream stopped
    and resumed from its tracker state yields the same keys and the same pixels."""
    from dataclasses import replace

    from ssl_vit.config import PretrainDataConfig
    from ssl_vit.data import StreamArgs, pretrain_loader
    from ssl_vit.data.write.convert import make_shards

    for i in range(24):
        (tmp_path / "src").mkdir(exist_ok=True)
        (tmp_path / "src" / f"{i:02d}.jpg").write_bytes(_smooth_jpeg(200, 150, seed=i))
    make_shards(tmp_path / "src", tmp_path / "shards", shard_size=6, progress=False)
    data = PretrainDataConfig(train_shards=str(tmp_path / "shards"), shuffle_buffer=4)
    stream = StreamArgs(micro_batch=4, num_workers=2, image_size=16, seed=3)

    def take(loader, n):
        it = iter(loader)
        return [next(it) for _ in range(n)]

    loader = pretrain_loader(data, stream)
    full, tracker = take(loader, 7), loader.tracker  # the loop records consumed batches
    for b in full[:4]:
        tracker.update(b)
    resumed = take(pretrain_loader(data, replace(stream, resume=tracker.state_dict())), 3)
    for a, b in zip(full[4:], resumed, strict=True):
        assert a.keys == b.keys and torch.equal(a.images, b.images)
