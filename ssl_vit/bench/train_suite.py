"""The training figures of `scripts/bench.py`: our pretraining step against a timm ViT of the
same shape (like-for-like and timm's defaults), timed interleaved in one process, with counted
FLOPs, the matmul peak they are a fraction of, the corruption's overhead and peak memory."""

from __future__ import annotations

import gc
import statistics
from typing import Any

import torch

from ssl_vit.bench import timing
from ssl_vit.bench.timm_baseline import TimmMaskedPatch, copy_weights
from ssl_vit.config.schema import ModelConfig, ObjectiveConfig, OptimConfig
from ssl_vit.model import build_vit
from ssl_vit.objectives import MaskedPatchPrediction, corrupt_patches, mean_color_classes
from ssl_vit.train.optim import build_adam

__all__ = ["SHAPES", "bf16_supported", "overhead_step", "training_figures"]

# Batch sizes chosen so one step takes ~1-3 s on 2 CPU cores; --batch-size overrides.
SHAPES = {
    "small": dict(image_size=32, patch_size=4, width=192, depth=12, heads=3, batch=64, gpu=256),
    "base": dict(image_size=224, patch_size=16, width=768, depth=12, heads=12, batch=8, gpu=128),
    "tiny": dict(image_size=16, patch_size=4, width=32, depth=2, heads=2, batch=8, gpu=8),
}


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return timing.cpu_has_native_bf16()  # emulated bf16 would only be slower


def training_figures(name: str, args: Any, device: torch.device, default_precision: str) -> dict:
    """Step timings of ours and timm's (like-for-like and defaults), FLOPs, utilization,
    overhead, peak accelerator memory."""
    s = SHAPES[name]
    batch = args.batch_size or (s["gpu"] if device.type == "cuda" else s["batch"])
    g = torch.Generator(device).manual_seed(0)
    images = torch.randint(0, 256, (batch, 3, s["image_size"], s["image_size"]), generator=g,
                           dtype=torch.uint8, device=device)  # fmt: skip
    shape = {k: s[k] for k in timing.MODEL_KEYS}
    fns, flops = _step_fns(ModelConfig(**shape), args, images, g, default_precision)
    times = timing.time_interleaved(fns, device, args.rounds, args.steps, args.warmup)
    peak_mem = None
    if device.type == "cuda":  # our default step alone, after the others have freed theirs
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        fns[f"ours_{default_precision}"]()
        torch.cuda.synchronize(device)
        peak_mem = torch.cuda.max_memory_allocated(device) / 2**20
    del fns  # the models and optimizers they hold
    gc.collect()
    out = {"model": name, "shape": shape, "batch_size": batch}
    return _figures(out, times, flops, default_precision, peak_mem, device)


def _step_fns(
    mcfg: ModelConfig, args: Any, images: torch.Tensor, g: torch.Generator, precision: str
) -> tuple[dict[str, Any], float]:
    """({name: step closure} for every timed row, our fp32 step's counted FLOPs)."""
    device = images.device
    ocfg, tcfg = ObjectiveConfig(), OptimConfig()
    torch.manual_seed(0)
    ours = MaskedPatchPrediction(build_vit(mcfg), ocfg).to(device)
    timm_model = TimmMaskedPatch(
        mcfg.image_size, mcfg.patch_size, mcfg.width, mcfg.depth, mcfg.heads, mcfg.mlp_ratio
    ).to(device)
    copy_weights(ours, timm_model)
    opt_ours, opt_timm = build_adam(ours, tcfg), build_adam(timm_model, tcfg)
    # What a timm user gets by default: timm's optimizer factory (torch AdamW, its defaults).
    from timm.optim import create_optimizer_v2

    opt_timm_default = create_optimizer_v2(
        timm_model, "adamw", lr=tcfg.lr, weight_decay=tcfg.weight_decay
    )
    fwd_ours, fwd_timm = ours, timm_model
    if args.compile:
        fwd_ours, fwd_timm = torch.compile(ours), torch.compile(timm_model)
    clip = tcfg.grad_clip
    fns = {}
    for prec in _precisions(device):
        fns[f"ours_{prec}"] = timing.make_train_step(fwd_ours, opt_ours, images, g, prec, clip)
        fns[f"timm_{prec}"] = timing.make_train_step(fwd_timm, opt_timm, images, g, prec, clip)
    # timm's defaults: its own loop's step (torch AdamW has no on-device skip to time)
    fns["timm_default"] = timing.plain_train_step(timm_model, opt_timm_default, images, g, clip)
    fns["corrupt_targets"] = overhead_step(ours, images, g, precision)
    for prec in _precisions(device):
        fns[f"matmul_{prec}"] = timing.matmul_step(
            _matmul_size(device), timing.autocast_dtype(prec) or torch.float32, device
        )
    return fns, timing.step_flops(timing.make_train_step(ours, opt_ours, images, g, "no", clip))


def _precisions(device: torch.device) -> list[str]:
    """The precisions timed: fp32 ('no'), and bf16 where it is native."""
    return ["no"] + (["bf16"] if bf16_supported(device) else [])


def _matmul_size(device: torch.device) -> int:
    """The square matmul whose rate stands for the device's peak."""
    return 8192 if device.type == "cuda" else 2048


def _figures(
    out: dict, times: dict, flops: float, d: str, peak_mem: float | None, device: torch.device
) -> dict[str, Any]:
    """`out` with the rates, ratios and utilizations of the timed rows; `d`: the default
    precision."""
    precisions, mm = _precisions(device), _matmul_size(device)
    med = {k: statistics.median(v) for k, v in times.items()}
    ips = {k: out["batch_size"] / med[k] for k in times if not k.startswith(("matmul", "corrupt"))}
    peak = {p: 2 * mm**3 / med[f"matmul_{p}"] for p in precisions}
    out.update({
        "default_precision": d,
        "images_per_s": ips,
        "step_s": {k: med[k] for k in ips},
        "ratio_vs_timm_same_precision": ips[f"ours_{d}"] / ips[f"timm_{d}"],
        "ratio_vs_timm_fp32": ips["ours_no"] / ips["timm_no"],
        "ratio_vs_timm_defaults": ips[f"ours_{d}"] / ips["timm_default"],
        "step_gflop": flops / 1e9,
        "matmul_peak_gflops": {p: v / 1e9 for p, v in peak.items()},
        "achieved_gflops": {p: flops / med[f"ours_{p}"] / 1e9 for p in precisions},
        "utilization": flops / med[f"ours_{d}"] / peak[d],
        "utilization_by_precision": {p: flops / med[f"ours_{p}"] / peak[p] for p in precisions},
        "overhead_fraction": med["corrupt_targets"] / med[f"ours_{d}"],
        "peak_accel_mem_mb": peak_mem,  # includes the timm model's weights, still resident
        "timing_spread": {k: [min(v), max(v)] for k, v in times.items()},
    })  # fmt: skip
    return out


def overhead_step(model: MaskedPatchPrediction, images, generator, precision: str):
    """Corruption + targets + the corrupted-token index, as the objective computes them."""
    dtype = timing.autocast_dtype(precision)
    with torch.no_grad(), torch.autocast(images.device.type, dtype=dtype, enabled=bool(dtype)):
        emb_BND = model.encoder.embed_patches(images.float())
    emb_BND.requires_grad_(True)  # the corruption is recorded for backward, as in training
    p, n = model.encoder.patch_size, model.num_corrupted

    def step():
        targets_BN = mean_color_classes(images, p)
        noise = model.draw_noise(len(images), generator)
        _, kind_BN = corrupt_patches(
            emb_BND, model.mask_embedding, noise, model.cfg.mask_ratio, model.cfg.probs
        )
        idx_Bn = (kind_BN == 0).to(torch.uint8).argsort(dim=1, stable=True)[:, :n]
        return targets_BN.gather(1, idx_Bn)

    return step
