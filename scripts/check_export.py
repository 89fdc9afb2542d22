"""Export a checkpoint to timm and transformers, load it back there, and measure the features;
or export a fine-tuned classifier and compare its labels there with ours on image files.

    python scripts/check_export.py --checkpoint runs/cifar10-ti6/checkpoints/step_00002000 \
        --data data/cifar10-test [--num 64] [--size 48] [--out runs/check_export]
    python scripts/check_export.py --classifier runs/finetune-cifar10 --images DIR [--num 64]

On `--num` real images: max |difference| of the [class] token output and of the patch token
outputs between our encoder and (1) timm `create_model("local-dir:...")`, (2) transformers
`ViTModel.from_pretrained`, at the pretraining resolution; (3) at `--size` px: our bicubic
position interpolation exported as is, transformers' `interpolate_pos_encoding=True`, and
timm's own resampling (`img_size=`); (4) the exports imported back with `ssl-vit import`.
Writes `check_export.json` in `--out`. Needs the `interop` extra (timm, transformers).

With `--classifier` (a fine-tuning run directory or its model.safetensors) and `--images` (a
folder of image files, searched recursively): on the first `--num` files, how many top-1 labels
of transformers' `pipeline("image-classification")` and of timm's `create_model` + its own
`create_transform` agree with ours (`load_classifier` + `eval_transform` on the decoded file),
and the max |logit difference|, overall and on the files that transformers crops where
torchvision does (it floors the crop offset, torchvision rounds half to even). Writes
`check_export_classifier.json` in `--out`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import timm
import torch
from transformers import ViTModel

from ssl_vit.config.pixels import PIXEL_NORM
from ssl_vit.config.schema import ModelConfig
from ssl_vit.data import eval_loader
from ssl_vit.model import normalize_pixels
from ssl_vit.publish import export_checkpoint, import_weights
from ssl_vit.publish.model_card import run_config
from ssl_vit.train.checkpoint import load_encoder, save_encoder
from ssl_vit.train.encoder_init import encoder_from_checkpoint


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


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def same_crop(size_wh: tuple[int, int], s: int) -> bool:
    """Whether transformers' center crop of an image of `size_wh` resized to shorter side `s`
    starts where torchvision's does (floored vs rounded half to even offset)."""
    long = int(s * max(size_wh) / min(size_wh))
    return (long - s) // 2 == round((long - s) / 2)


def agreement(ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor) -> dict:
    """Top-1 agreement and max |logit difference| of [N, K] logits, all and on `exact` [N]."""
    diff = (ours - theirs).abs().amax(dim=-1)
    agree = ours.argmax(-1) == theirs.argmax(-1)
    return {
        "top1_agree": f"{int(agree.sum())}/{len(agree)}",
        "max_logit_diff": diff.max().item(),
        "same_crop_top1_agree": f"{int(agree[exact].sum())}/{int(exact.sum())}",
        "same_crop_max_logit_diff": diff[exact].max().item() if exact.any() else None,
    }


@torch.no_grad()
def check_classifier(source: str, image_dir: str, n: int, out: Path) -> dict:
    """Export the classifier at `source` to both libraries and compare labels and logits with
    ours on the first `n` image files of `image_dir`."""
    from PIL import Image
    from transformers import pipeline

    from ssl_vit.data.decode import decode_image
    from ssl_vit.data.images import eval_transform
    from ssl_vit.publish import export_classifier
    from ssl_vit.train.classifier_file import load_classifier

    files = sorted(f for f in Path(image_dir).rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)[:n]
    model, spec = load_classifier(source)
    t = eval_transform(spec.image_size)
    ours = torch.cat([model(t(decode_image(f.read_bytes()))[None]) for f in files])
    pil = [Image.open(f).convert("RGB") for f in files]
    exact = torch.tensor([same_crop(im.size, spec.image_size) for im in pil])
    res: dict = {"classifier": str(source), "images": len(files), "pool": spec.pool}
    export_classifier(source, "timm", out / "timm", overwrite=True)
    tm = timm.create_model(f"local-dir:{out / 'timm'}", pretrained=True).eval()
    tt = timm.data.create_transform(**timm.data.resolve_data_config({}, model=tm))
    res["timm"] = agreement(ours, torch.cat([tm(tt(im)[None]) for im in pil]), exact)
    if spec.pool == "cls":  # transformers has no mean-of-patches classifier
        export_classifier(source, "hf", out / "hf", overwrite=True)
        clf = pipeline("image-classification", model=str(out / "hf"))
        labels = [r[0]["label"] for r in clf([str(f) for f in files], top_k=1)]
        x = [clf.image_processor(im, return_tensors="pt") for im in pil]
        res["hf"] = agreement(ours, torch.cat([clf.model(**b).logits for b in x]), exact)
        ids = ours.argmax(-1).tolist()
        agree = sum(lab == spec.label_names[i] for lab, i in zip(labels, ids, strict=True))
        res["hf"]["pipeline_top1_agree"] = f"{agree}/{len(files)}"
        res["hf"]["image_processor"] = type(clf.image_processor).__name__
    res["logit_scale"] = ours.abs().max().item()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint")
    p.add_argument("--data", help="labelled eval source (shards, image folder)")
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--size", type=int, default=48, help="second resolution (interpolated)")
    p.add_argument("--out", default="runs/check_export")
    p.add_argument("--png-dir", help="image folder to compare the preprocessing configs on")
    p.add_argument("--classifier", help="a fine-tuning run directory: check its export")
    p.add_argument("--images", help="with --classifier: a folder of image files")
    args = p.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    if args.classifier:
        if not args.images:
            p.error("--classifier needs --images")
        res = check_classifier(args.classifier, args.images, args.num, out)
        (out / "check_export_classifier.json").write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res, indent=2))
        return
    if not args.checkpoint or not args.data:
        p.error("--checkpoint and --data are required (or --classifier and --images)")
    check_encoder(args, out)


def check_encoder(args: argparse.Namespace, out: Path) -> None:
    """The encoder checks (see the module docstring); writes check_export.json in `out`."""
    data = run_config(Path(args.checkpoint)).get("data", {})
    mean, std = data.get("mean", PIXEL_NORM), data.get("std", PIXEL_NORM)
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

        res.update(import_gaps(out, (size0, x0, f0), (args.size, x1, f1)))
    if args.png_dir:
        res["preprocessing"] = preprocessing_gaps(
            Path(args.png_dir), args.num, size0, mean, std, out
        )
        print(f"preprocessing (max |pixel difference|): {res['preprocessing']}")
    res["feature_scale"] = {"max_abs": f0.abs().max().item(), "std": f0.std().item()}
    (out / "check_export.json").write_text(json.dumps(res, indent=2) + "\n")
    print_gaps(res, out / "check_export.json")


def import_gaps(out: Path, at0: tuple, at1: tuple) -> dict[str, dict[str, float]]:
    """Import back (theirs -> ours) and compare with the original encoder's features; `at0`,
    `at1`: (image size, images, our features) at the pretraining and the second resolution."""
    (size0, x0, f0), (size1, x1, f1) = at0, at1
    res = {}
    for fmt in ("timm", "hf"):
        import_weights(out / fmt, fmt, out / f"imported_{fmt}")
        back = encoder_from_checkpoint(out / f"imported_{fmt}", ModelConfig(image_size=size0))
        res[f"import_{fmt}"] = gap(f0, back[0].eval().forward_features(x0))
        b1 = encoder_from_checkpoint(out / f"imported_{fmt}", ModelConfig(image_size=size1))
        res[f"import_{fmt}_{size1}px"] = gap(f1, b1[0].eval().forward_features(x1))
    return res


def print_gaps(res: dict, written: Path) -> None:
    """One line per compared pair, then the feature scale."""
    for k, v in res.items():
        if isinstance(v, dict) and "cls" in v:
            print(f"{k:<36} cls {v['cls']:.3g}  patches {v['patches']:.3g}")
    print(
        f"feature scale: max |x| {res['feature_scale']['max_abs']:.3g}, "
        f"std {res['feature_scale']['std']:.3g}; wrote {written}"
    )


if __name__ == "__main__":
    main()
