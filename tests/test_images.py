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
    stream = StreamArgs(global_micro=4, num_workers=2, image_size=16, seed=3)

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


# --------------------------------------------------------------------------------------------
# EXIF orientation (issue 47, defect 4): every reading path sees the image upright, as
# `PIL.ImageOps.exif_transpose` (and the transformers export's pipeline) shows it.

# EXIF orientation -> the turn that stores an upright image so that exif_transpose undoes it.
_TURN_BACK = {
    2: "FLIP_LEFT_RIGHT",
    3: "ROTATE_180",
    4: "FLIP_TOP_BOTTOM",
    5: "TRANSPOSE",
    6: "ROTATE_90",
    7: "TRANSVERSE",
    8: "ROTATE_270",
}


def oriented(orientation: int, fmt: str = "JPEG", size=(64, 48), block: int = 16, tag=True):
    """Encoded bytes of an image whose upright view, `size` (width, height), is grey with a red,
    a green and a blue `block` in its top-left, top-right and bottom-left corners (no turn maps
    it onto itself), stored turned back for EXIF `orientation`, with that tag (`tag`: else no
    EXIF at all, the same stored pixels)."""
    import io

    import numpy as np
    from PIL import Image

    w, h = size
    up = np.full((h, w, 3), 128, np.uint8)
    up[:block, :block] = (255, 0, 0)
    up[:block, -block:] = (0, 255, 0)
    up[-block:, :block] = (0, 0, 255)
    stored = Image.fromarray(up)
    if orientation in _TURN_BACK:
        stored = stored.transpose(getattr(Image.Transpose, _TURN_BACK[orientation]))
    kw = {"JPEG": {"quality": 95}, "WEBP": {"lossless": True}}.get(fmt, {})
    if tag:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif
    buf = io.BytesIO()
    stored.save(buf, format=fmt, **kw)
    return buf.getvalue()


def exif_transposed(data: bytes):
    """uint8 [H, W, 3]: the bytes as `ImageOps.exif_transpose` shows them (PIL's decoder)."""
    import io

    import numpy as np
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))


def upright_reference(orientation: int, fmt: str = "JPEG", **kw) -> torch.Tensor:
    """uint8 [3, H, W]: `oriented(...)` as `decode_image` decodes its stored pixels (the twin
    without EXIF), turned by `ImageOps.exif_transpose` itself: the exact upright pixels, with
    no difference of decoder between reference and result."""
    import numpy as np
    from PIL import Image, ImageOps

    from ssl_vit.data.decode import decode_image

    stored = decode_image(oriented(orientation, fmt, tag=False, **kw)).permute(1, 2, 0).numpy()
    im = Image.fromarray(stored)
    exif = Image.Exif()
    exif[0x0112] = orientation
    im.info["exif"] = exif.tobytes()
    return torch.from_numpy(np.asarray(ImageOps.exif_transpose(im)).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
def test_decode_is_upright_as_exif_transpose(monkeypatch, fmt):
    """Orientations 1-8 in each format that carries EXIF: `decode_image` (training, evaluation,
    few-shot, the labelled subset, predict) gives exif_transpose's pixels; an image without
    EXIF costs no `Image.open` to find that out."""
    import numpy as np

    from ssl_vit.data import decode as decode_mod
    from ssl_vit.data.decode import decode_image

    for orientation in range(1, 9):
        data = oriented(orientation, fmt)
        out = decode_image(data)
        assert out.shape == (3, 48, 64), (fmt, orientation)
        assert torch.equal(out, upright_reference(orientation, fmt)), (fmt, orientation)
        pil = exif_transposed(data).astype(int)  # PIL's own decoder: equal up to JPEG's last bit
        assert np.abs(out.permute(1, 2, 0).numpy() - pil).max() <= (2 if fmt == "JPEG" else 0)
    if fmt in ("JPEG", "PNG"):  # the fast path: a header scan says there is no orientation
        monkeypatch.setattr(decode_mod.Image, "open", lambda *a, **k: 1 / 0)
        assert decode_mod.exif_orientation(oriented(1, fmt, tag=False)) == 1


@pytest.mark.parametrize("orientation", range(1, 9))
def test_training_crop_is_upright_also_at_reduced_decode(monkeypatch, orientation):
    """The training crop of an oriented JPEG draws its box on the upright image and cuts the
    same pixels at full and at reduced (draft) decode: what `crop(upright image)` gives, up to
    the filters' difference (DCT scaling + bilinear)."""
    from ssl_vit.data import decode as decode_mod
    from ssl_vit.data import images
    from ssl_vit.data.images import RandomResizedCropFlip

    data = oriented(orientation, size=(320, 240), block=80)
    ref = upright_reference(orientation, size=(320, 240), block=80)
    crop, scales, diffs = RandomResizedCropFlip(16), [], []
    reduced = decode_mod.open_jpeg_reduced
    monkeypatch.setattr(images, "open_jpeg_reduced", lambda d, s: scales.append(s) or reduced(d, s))
    for i in range(24):
        reduced_so_far = len(scales)
        torch.manual_seed(i)
        a = crop.from_bytes(data)
        torch.manual_seed(i)
        b = crop(ref)
        diffs.append((a.float() - b.float()).abs().mean().item())
        if len(scales) == reduced_so_far:  # decoded in full: the very pixels
            assert torch.equal(a, b), i
    assert len(scales) >= 12  # most took the reduced decode
    assert max(diffs) < 6 and sum(diffs) / len(diffs) < 2


def test_predict_stream_is_upright(tmp_path):
    """predict's stream (`predict_loader`, the path `select` will reuse) of a folder of JPEGs
    with orientations 1-8 gives the evaluation transform of each upright image."""
    from ssl_vit.data.images import eval_transform
    from ssl_vit.data.predict_stream import predict_loader

    for orientation in range(1, 9):
        (tmp_path / f"o{orientation}.jpg").write_bytes(oriented(orientation))
    seen = {}
    for batch in predict_loader(str(tmp_path), 8, 3, 16, num_workers=0):
        assert not batch.skipped
        seen.update(zip(batch.names, batch.images, strict=True))
    transform = eval_transform(16)
    for orientation in range(1, 9):
        expected = transform(upright_reference(orientation))
        assert torch.equal(seen[f"o{orientation}.jpg"], expected), orientation
