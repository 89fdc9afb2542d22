"""The README.md model card written with each export.

An encoder's facts come from the checkpoint (model config, step) and its run directory when the
checkpoint sits in one (`RUN/checkpoints/step_N`): `config.yaml` (data, objective, optimization),
`results.json` (final pretraining figures, few-shot), and the `results.json` of sibling runs
(`RUN/../*/`) whose `init` / `checkpoint` names this checkpoint (fine-tuning, few-shot jobs).
A fine-tuned classifier's (`classifier_card`) come from its file (classes, resolution, pooling,
preprocessing) and its fine-tuning run directory: `config.yaml` and `results.json` (label
budget, top-1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ssl_vit.config.pixels import PIXEL_NORM
from ssl_vit.eval.shots import format_summary, percent
from ssl_vit.report.runs import fewshot_pool, read_config, read_results, run_dir_of, step_of
from ssl_vit.train.classifier_file import ClassifierSpec

__all__ = ["classifier_card", "model_card", "run_config"]


def run_config(checkpoint: Path) -> dict[str, Any]:
    """The resolved config of the run that wrote `checkpoint` ({} when not in a run dir)."""
    run = run_dir_of(checkpoint)
    return {} if run is None else read_config(run)


def _downstream(checkpoint: Path, run: Path) -> list[str]:
    """Table rows of the few-shot / fine-tuning runs next to `run` started from this checkpoint."""
    ckpt = checkpoint if checkpoint.is_dir() else checkpoint.parent
    tail = f"{run.name}/checkpoints/{ckpt.name}"
    rows = []
    for res_file in sorted(run.parent.glob("*/results.json")):
        res = read_results(res_file.parent)
        source = str(res.get("init") or res.get("checkpoint") or "").rstrip("/")
        if not source.endswith(tail) or res_file.parent == run:
            continue
        pool = fewshot_pool(read_config(res_file.parent))
        if "top1" in res:
            rows.append(
                f"| fine-tune ({res_file.parent.name}) | {res.get('image_size')} px, "
                f"{res.get('step')} steps, pool {pool} | top-1 {percent(res['top1'])} |"
            )
        elif "summary" in res:
            shots = format_summary(res["summary"])
            rows.append(f"| few-shot linear ({res_file.parent.name}) | pool {pool} | {shots} |")
    return rows


def _results(checkpoint: Path, run: Path | None) -> str:
    if run is None:
        return "No run directory found next to the checkpoint: no results recorded.\n"
    res = read_results(run)
    lines = ["| evaluation | setting | result |", "|---|---|---|"]
    if "loss" in res:  # null: a run that ended diverged (results.json holds no NaN)
        loss = f"{res['loss']:.3f}" if isinstance(res["loss"], (int, float)) else "n/a"
        lines.append(
            f"| pretraining (final) | step {res.get('step')} | loss {loss}, "
            f"colour accuracy {percent(res.get('color_acc'))} on corrupted patches |"
        )
    if "top1" in res:  # the checkpoint of a fine-tuning run: its own final accuracy
        lines.append(
            f"| fine-tune (this run) | {res.get('image_size')} px, {res.get('step')} steps "
            f"| top-1 {percent(res['top1'])} |"
        )
    fewshot = res.get("fewshot", {}).get("summary")
    if fewshot:
        lines.append(
            f"| few-shot linear (during pretraining) | pool cls | {format_summary(fewshot)} |"
        )
    lines += _downstream(checkpoint, run)
    if len(lines) == 2:
        return "No results recorded for this checkpoint yet.\n"
    return "\n".join(lines) + "\n"


def _how_to_load(to: str, out: Path, cfg: dict[str, Any], config: dict[str, Any]) -> str:
    size = cfg["image_size"]
    if to == "timm":
        args = ", ".join(f"{k}={v!r}" for k, v in config["model_args"].items())
        return f"""```python
import timm, torch

model = timm.create_model("local-dir:{out}", pretrained=True).eval()
# or: timm.create_model("{config["architecture"]}", pretrained=True, {args},
#         pretrained_cfg_overlay=dict(file="{out}/model.safetensors"))
x = torch.randn(1, 3, {size}, {size})  # normalized as in the table above
tokens = model.forward_features(x)  # [1, 1 + {(size // cfg["patch_size"]) ** 2}, {cfg["width"]}]
feature = tokens[:, 0]  # the [class] token output
```

Another resolution: `timm.create_model(..., img_size=S)` resamples the position embeddings
(timm uses antialiased bicubic, ssl-vit plain bicubic: features differ slightly).
"""
    return f"""```python
import torch
from transformers import ViTModel

model = ViTModel.from_pretrained("{out}", add_pooling_layer=False).eval()
x = torch.randn(1, 3, {size}, {size})  # normalized as in the table above
tokens = model(pixel_values=x).last_hidden_state  # [1, 1 + N, {cfg["width"]}]
feature = tokens[:, 0]  # the [class] token output
```

There is no pooler (dense + tanh) in this model: `add_pooling_layer=False` loads it without
warnings; without it transformers adds a randomly initialized pooler. Another resolution:
`model(pixel_values=x, interpolate_pos_encoding=True)` (bicubic, the same as ssl-vit's).
"""


def _table(rows: list[tuple[str, str]]) -> str:
    return "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def _architecture(
    cfg: dict[str, Any],
    data: dict[str, Any],
    params: int,
    stage: str = "pretraining",
    resize: str = "",
) -> str:
    """The architecture table; `resize`: how an image of any size becomes the input, if it
    does (a classifier's eval transform)."""
    grid = cfg["image_size"] // cfg["patch_size"]
    mean, std = list(data.get("mean", PIXEL_NORM)), list(data.get("std", PIXEL_NORM))
    return _table(
        [
            (
                "input",
                f"{resize}{cfg['image_size']} x {cfg['image_size']} px RGB in [0, 1], then "
                f"(x - mean) / std with mean {mean}, std {std}",
            ),
            (
                "patches",
                f"{cfg['patch_size']} x {cfg['patch_size']} px, "
                f"{grid} x {grid} = {grid * grid} patches",
            ),
            ("width / depth / heads", f"{cfg['width']} / {cfg['depth']} / {cfg['heads']}"),
            ("MLP", f"{int(cfg['width'] * cfg['mlp_ratio'])} hidden units, exact GELU"),
            (
                "normalization",
                f"pre-LayerNorm blocks, final LayerNorm, eps {cfg.get('norm_eps', 1e-6):g}",
            ),
            (
                "tokens",
                f"[class] + {grid * grid} patch tokens, learned 1D position embeddings "
                f"({grid} x {grid} {stage} grid)",
            ),
            ("parameters", f"{params:,} ({params / 1e6:.2f} M)"),
        ]
    )


def _pretraining(rc: dict[str, Any], step: int | None) -> str:
    data, obj, tc = rc.get("data", {}), rc.get("objective", {}), rc.get("train", {})
    probs = obj.get("probs", (0.8, 0.1, 0.1))
    batch = tc.get("batch_size")
    seen = f"{step * batch:,} images" if step and batch else "n/a"
    return _table(
        [
            (
                "data",
                f"`{data.get('train_shards', 'n/a')}` (random-resized crops, scale "
                f"{data.get('crop_scale', 'n/a')}, horizontal flips {data.get('hflip', 'n/a')})",
            ),
            ("steps", f"{step if step is not None else 'n/a'} at batch {batch or 'n/a'} ({seen})"),
            (
                "optimizer",
                f"Adam, lr {tc.get('lr', 'n/a')}, betas {tc.get('betas', 'n/a')}, weight "
                f"decay {tc.get('weight_decay', 'n/a')}, {tc.get('warmup_steps', 'n/a')} "
                f"warmup steps then cosine decay, gradient clipping "
                f"{tc.get('grad_clip', 'n/a')}",
            ),
            (
                "objective",
                f"{obj.get('target', 'mean_color')}: 512-way classification of the 3-bit "
                "mean colour of each corrupted patch",
            ),
            (
                "corruption",
                f"{percent(obj.get('mask_ratio', 0.5))} of the patch embeddings; of those "
                f"{percent(probs[0])} replaced by a learned [mask] embedding, "
                f"{percent(probs[1])} by another patch's embedding, {percent(probs[2])} kept",
            ),
        ]
    )


def model_card(
    checkpoint: Path,
    to: str,
    out: Path,
    cfg: dict[str, Any],
    config: dict[str, Any],
    params: int,
) -> str:
    """Markdown model card for an export of `checkpoint` to `to` ('timm' or 'hf') in `out`."""
    run = run_dir_of(checkpoint)
    rc = run_config(checkpoint)
    name = run.name if run else checkpoint.name
    library = "timm" if to == "timm" else "transformers"
    if "objective" in rc:
        pretraining = _pretraining(rc, step_of(checkpoint))
    elif rc:  # e.g. a fine-tuning run's checkpoint: its own encoder, not a pretraining run
        source = rc.get("init", {}).get("checkpoint") or "random init"
        pretraining = (
            f"Written by a run without a pretraining objective (`{run}/config.yaml`, "
            f"initialized from `{source}`); see that run's config.\n"
        )
    else:
        pretraining = "No run directory with a config.yaml next to the checkpoint: not recorded.\n"
    return f"""---
library_name: {library}
tags: [vision-transformer, self-supervised, masked-patch-prediction, ssl-vit]
---

# {name}: ViT (width {cfg["width"]}, depth {cfg["depth"]}, patch {cfg["patch_size"]})

A Vision Transformer encoder pretrained with ssl-vit by masked patch prediction
(Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words", sections 3.1-3.2, appendix
B.1.2), exported from `{checkpoint}` for {library}. Encoder only: the pretraining head (a
linear layer predicting each corrupted patch's 3-bit mean colour) is not included.

## Architecture

{_architecture(cfg, rc.get("data", {}), params)}
## Pretraining

{pretraining}
## Results

{_results(checkpoint, run)}
## How to load

{_how_to_load(to, out, cfg, config)}
Made with `ssl-vit export {checkpoint} --to {to} {out}`.
"""


# --- A fine-tuned classifier (`ssl_vit.publish.export_classifier`) ---------------------------

_SHOWN_CLASSES = 100  # class names listed in the card (all of them are in config.json)
_POOLS = {"cls": "the [class] token output", "gap": "the mean of the patch token outputs"}


def _classes(names: tuple[str, ...]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:_SHOWN_CLASSES])
    more = len(names) - _SHOWN_CLASSES
    return shown + (f", ... ({more} more, all in config.json)" if more > 0 else "")


def _finetuning(rc: dict[str, Any], res: dict[str, Any], spec: ClassifierSpec) -> str:
    """The fine-tuning table: the classifier's shape, and the run's settings from its
    config.yaml and results.json (`rc`, `res`; rows left out when the file is absent)."""
    grid = spec.image_size // spec.model_config["patch_size"]
    rows = [
        ("resolution", f"{spec.image_size} px ({grid} x {grid} patches)"),
        ("head", f"linear, {spec.num_classes} classes, on {_POOLS[spec.pool]}"),
    ]
    if res:
        per_class, labelled = res.get("labels_per_class"), res.get("num_labelled")
        count = f"{labelled:,} labelled images" if isinstance(labelled, int) else "n/a"
        rows.append(
            ("label budget", f"{per_class} per class ({count})" if per_class else f"all ({count})")
        )
    if rc:
        init = rc.get("init", {}).get("checkpoint")
        tc, ema = rc.get("train", {}), rc.get("ema") or 0.0
        rows += [
            ("initialized from", "random" if init in (None, "", "none") else f"`{init}`"),
            ("data", f"`{rc.get('data', {}).get('train', 'n/a')}`"),
            ("steps", f"{tc.get('steps', 'n/a')} at batch {tc.get('batch_size', 'n/a')}"),
            ("weight averaging", f"EMA {ema}: the averaged weights are exported" if ema else "no"),
        ]
    else:
        rows.append(("run", "no fine-tuning run directory next to the classifier: not recorded"))
    return _table(rows)


def _classifier_results(rc: dict[str, Any], res: dict[str, Any]) -> str:
    if res.get("top1") is None:
        if res.get("eval_skipped"):  # an eval split of which no image could be scored
            return (
                f"No top-1 measured: none of the images of "
                f"`{rc.get('data', {}).get('eval', 'n/a')}` could be scored "
                f"({res['eval_skipped']} skipped).\n"
            )
        return "No top-1 recorded (no results.json next to the classifier, or no eval split).\n"
    source = f"`{rc.get('data', {}).get('eval', 'n/a')}`"
    if res.get("top1_ema") is not None:  # model.safetensors holds the averaged weights
        return (
            f"Top-1 {percent(res['top1_ema'])} on {source} (the averaged weights exported here; "
            f"the raw weights: {percent(res['top1'])}), after {res.get('step')} steps.\n"
        )
    return f"Top-1 {percent(res['top1'])} on {source}, after {res.get('step')} steps.\n"


def _how_to_classify(to: str, out: Path) -> str:
    if to == "timm":
        return f"""```python
import timm
from PIL import Image

model = timm.create_model("local-dir:{out}", pretrained=True).eval()
transform = timm.data.create_transform(**timm.data.resolve_data_config({{}}, model=model))
logits = model(transform(Image.open("image.jpg").convert("RGB")).unsqueeze(0))
label = model.pretrained_cfg["label_names"][logits.argmax(-1).item()]
```
"""
    return f"""```python
from transformers import pipeline

classify = pipeline("image-classification", model="{out}")
classify("image.jpg")  # [{{"label": ..., "score": ...}}, ...], the top 5
# or: AutoImageProcessor.from_pretrained("{out}") and
#     ViTForImageClassification.from_pretrained("{out}"); model.config.id2label
```

`preprocessor_config.json` is a `BitImageProcessor`: shorter side resized, then the central
square, as in fine-tuning's evaluation (transformers rounds the crop offset down where
torchvision rounds half to even: some image sizes are cropped one pixel apart).
"""


def classifier_card(file: Path, to: str, out: Path, spec: ClassifierSpec, params: int) -> str:
    """Markdown model card for an export of the fine-tuned classifier `file` (a fine-tuning
    run's model.safetensors, facts from the run's config.yaml and results.json) to `out`."""
    run = file.parent
    rc, res = read_config(run), read_results(run)
    cfg, size = spec.model_config, spec.image_size
    library = "timm" if to == "timm" else "transformers"
    resize = f"any image: shorter side resized to {size} px (bilinear, antialiased), central "
    return f"""---
library_name: {library}
pipeline_tag: image-classification
tags: [vision-transformer, image-classification, ssl-vit]
---

# {run.name}: ViT classifier, {spec.num_classes} classes ({size} px, width {cfg["width"]}, \
depth {cfg["depth"]}, patch {cfg["patch_size"]})

A Vision Transformer fine-tuned with ssl-vit as a {spec.num_classes}-way image classifier (a
linear head on {_POOLS[spec.pool]}), exported from `{file}` for {library}: encoder and head.

## Classes

In label order (output index 0, 1, ...): {_classes(spec.label_names)}

## Architecture

{_architecture(cfg, {"mean": spec.mean, "std": spec.std}, params, "fine-tuning", resize)}
## Fine-tuning

{_finetuning(rc, res, spec)}
## Results

{_classifier_results(rc, res)}
## How to load

{_how_to_classify(to, out)}
Made with `ssl-vit export {file} --to {to} {out}`.
"""
