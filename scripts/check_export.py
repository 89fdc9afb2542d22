"""Export a checkpoint to timm and transformers, load it back there, and measure the features.

    python scripts/check_export.py --checkpoint runs/cifar10-ti6/checkpoints/step_00002000 \
        --data data/cifar10-test [--num 64] [--size 48] [--out runs/check_export]

On `--num` real images: max |difference| of the [class] token output and of the patch token
outputs between our encoder and (1) timm `create_model("local-dir:...")`, (2) transformers
`ViTModel.from_pretrained`, at the pretraining resolution; (3) at `--size` px: our bicubic
position interpolation exported as is, transformers' `interpolate_pos_encoding=True`, and
timm's own resampling (`img_size=`); (4) the exports imported back with `ssl-vit import`.
Writes `check_export.json` in `--out`. Needs the `interop` extra (timm, transformers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import timm
import torch
from transformers import ViTModel

from ssl_vit.config.schema import ModelConfig
from ssl_vit.data import eval_loader
from ssl_vit.model import normalize_pixels
from ssl_vit.publish import export_checkpoint, import_weights
from ssl_vit.publish.model_card import run_config
from ssl_vit.train.checkpoint import encoder_from_checkpoint, load_encoder, save_encoder


def images(source: str, n: int, size: int, mean, std) -> torch.Tensor:
    """The first n images of `source`, resized to `size`, normalized: [n, 3, size, size]."""
    batch = next(iter(eval_loader(source, n, size, num_workers=0, limit=n)))
    return normalize_pixels(batch.images.float(), mean, std)


def gap(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    """Max |difference| of the [class] token and of the patch tokens ([B, 1 + N, D] each)."""
    d = (ours - theirs).abs()
    return {"cls": d[:, 0].max().item(), "patches": d[:, 1:].max().item()}


def preprocessing_gaps(png_dir: Path, n: int, size: int, mean, std, out: Path) -> dict:
    """Max |difference| (normalized pixel units) between ssl-vit's eval preprocessing and the
    exported preprocessing configs (timm data config, transformers ViTImageProcessor) on the
    first n images of an image folder."""
    from PIL import Image
    from torchvision.transforms.v2.functional import pil_to_tensor
    from transformers import ViTImageProcessor

    from ssl_vit.data.images import eval_transform

    files = sorted(png_dir.rglob("*.png"))[:n]
    pil = [Image.open(f).convert("RGB") for f in files]
    t = eval_transform(size)
    ours = torch.stack([t(pil_to_tensor(im)) for im in pil]).float() / 255
    ours = normalize_pixels(ours, mean, std)
    hf = ViTImageProcessor.from_pretrained(out / "hf")(images=pil, return_tensors="pt")
    tm = timm.create_model(f"local-dir:{out / 'timm'}", pretrained=True)
    tt = timm.data.create_transform(**timm.data.resolve_data_config({}, model=tm))
    theirs_timm = torch.stack([tt(im) for im in pil])
    return {
        "images": len(files),
        "hf_image_processor": (ours - hf["pixel_values"]).abs().max().item(),
        "timm_transform": (ours - theirs_timm).abs().max().item(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True, help="labelled eval source (shards, image folder)")
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--size", type=int, default=48, help="second resolution (interpolated)")
    p.add_argument("--out", default="runs/check_export")
    p.add_argument("--png-dir", help="image folder to compare the preprocessing configs on")
    args = p.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    data = run_config(Path(args.checkpoint)).get("data", {})
    mean, std = data.get("mean", (0.5,) * 3), data.get("std", (0.5,) * 3)
    _, cfg = load_encoder(args.checkpoint)
    size0 = cfg["image_size"]
    x0 = images(args.data, args.num, size0, mean, std)
    x1 = images(args.data, args.num, args.size, mean, std)
    res: dict = {"checkpoint": args.checkpoint, "images": args.num, "sizes": [size0, args.size]}

    with torch.no_grad():
        ours0 = encoder_from_checkpoint(args.checkpoint, ModelConfig(image_size=size0))[0].eval()
        ours1 = encoder_from_checkpoint(args.checkpoint, ModelConfig(image_size=args.size))[0]
        ours1.eval()
        f0, f1 = ours0.forward_features(x0), ours1.forward_features(x1)
        export_checkpoint(args.checkpoint, "timm", out / "timm")
        export_checkpoint(args.checkpoint, "hf", out / "hf")

        tm = timm.create_model(f"local-dir:{out / 'timm'}", pretrained=True).eval()
        res["timm"] = gap(f0, tm.forward_features(x0))
        hf, info = ViTModel.from_pretrained(
            out / "hf", add_pooling_layer=False, output_loading_info=True
        )
        res["hf_loading_info"] = {k: sorted(v) for k, v in info.items()}
        res["hf"] = gap(f0, hf.eval()(pixel_values=x0).last_hidden_state)

        # At the second resolution: like with like (our interpolation, exported) ...
        ck1 = out / f"ours_{args.size}px"
        ck1.mkdir(parents=True, exist_ok=True)
        save_encoder(ours1, ck1 / "encoder.safetensors", {**cfg, "image_size": args.size})
        export_checkpoint(ck1, "timm", out / f"timm_{args.size}px")
        export_checkpoint(ck1, "hf", out / f"hf_{args.size}px")
        tm1 = timm.create_model(f"local-dir:{out / f'timm_{args.size}px'}", pretrained=True)
        res[f"timm_{args.size}px_exported"] = gap(f1, tm1.eval().forward_features(x1))
        hf1 = ViTModel.from_pretrained(out / f"hf_{args.size}px", add_pooling_layer=False)
        res[f"hf_{args.size}px_exported"] = gap(f1, hf1.eval()(pixel_values=x1).last_hidden_state)
        # ... and each library interpolating the pretraining-resolution export itself.
        h = hf(pixel_values=x1, interpolate_pos_encoding=True).last_hidden_state
        res[f"hf_{args.size}px_interpolate_pos_encoding"] = gap(f1, h)
        tm2 = timm.create_model(f"local-dir:{out / 'timm'}", pretrained=True, img_size=args.size)
        res[f"timm_{args.size}px_img_size"] = gap(f1, tm2.eval().forward_features(x1))

        # Import back (theirs -> ours) and compare with the original encoder.
        for fmt in ("timm", "hf"):
            import_weights(out / fmt, fmt, out / f"imported_{fmt}")
            back = encoder_from_checkpoint(out / f"imported_{fmt}", ModelConfig(image_size=size0))
            res[f"import_{fmt}"] = gap(f0, back[0].eval().forward_features(x0))
            b1 = encoder_from_checkpoint(out / f"imported_{fmt}", ModelConfig(image_size=args.size))
            res[f"import_{fmt}_{args.size}px"] = gap(f1, b1[0].eval().forward_features(x1))
    if args.png_dir:
        res["preprocessing"] = preprocessing_gaps(
            Path(args.png_dir), args.num, size0, mean, std, out
        )
        print(f"preprocessing (max |pixel difference|): {res['preprocessing']}")
    res["feature_scale"] = {"max_abs": f0.abs().max().item(), "std": f0.std().item()}
    (out / "check_export.json").write_text(json.dumps(res, indent=2) + "\n")
    for k, v in res.items():
        if isinstance(v, dict) and "cls" in v:
            print(f"{k:<36} cls {v['cls']:.3g}  patches {v['patches']:.3g}")
    print(
        f"feature scale: max |x| {res['feature_scale']['max_abs']:.3g}, "
        f"std {res['feature_scale']['std']:.3g}; wrote {out / 'check_export.json'}"
    )


if __name__ == "__main__":
    main()
