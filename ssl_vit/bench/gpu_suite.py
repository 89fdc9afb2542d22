"""The GPU table in one command: `python scripts/bench.py --suite gpu --out FILE.json`.

Sections, each guarded (a failure is a row with `status: "error: ..."`, the rest still runs)
and all under one time budget (rows that would not fit are `skipped: time budget`):
  peak      the bf16 matmul peak (a big square matmul), the denominator of every "% of peak";
  models    training steps of ours vs timm (same masked-prediction step) at ViT-B/16 224 px
            and the small shape (w384 d12 p4 32 px): eager bf16, torch.compile, and
            compile mode reduce-overhead (CUDA graphs); model FLOPs counted by FlopCounterMode
            (forward + backward);
  objectives our training step at the small shape for each pretraining objective given
            (scripts/bench.py: the variants of configs/study/classifier.yaml: the paper's, +
            a decoder, the visible-only arm), eager and compiled, and each one's speed-up
            over the first (per epoch: the images per epoch are the same);
  sync      host syncs of the training step: aten._local_scalar_dense counted per step (any
            device), and N steps under torch.cuda.set_sync_debug_mode("error") (CUDA);
  loader    loader img/s at the GPU batch, workers decode + collate (data.augment=device) and
            workers augmenting, and the device augmentation's own time per batch;
  pipeline  the real pipelines/pretrain.py at the small shape from shards (img_per_s of its
            metrics.jsonl, steady state: the laps after the first).
`size="tiny"` runs the same on a tiny model in seconds on the CPU (the test); CUDA-only rows
then say `skipped: no CUDA`.
"""

from __future__ import annotations

import functools
import gc
import logging
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ssl_vit.bench.host_sync import error_line, sync_count_row, sync_debug_row
from ssl_vit.bench.pipeline_rows import ddp_pipeline_row, pipeline_row
from ssl_vit.bench.timing import MODEL_KEYS, make_train_step, matmul_step, step_flops, sync
from ssl_vit.config.checks import auto_num_workers
from ssl_vit.config.schema import ModelConfig, ObjectiveConfig, OptimConfig

__all__ = ["SECTIONS", "SIZES", "Suite", "markdown_table", "run_suite"]

log = logging.getLogger(__name__)


def _shape(size: int, patch: int, width: int, depth: int, heads: int, batch: int) -> dict:
    return dict(image_size=size, patch_size=patch, width=width, depth=depth, heads=heads,
                batch=batch)  # fmt: skip


# Per size: the model shapes (with the GPU batch); the last one is also the shape of the
# sync, loader and pipeline rows.
SIZES = {
    "full": {
        "vit_b16_224": _shape(224, 16, 768, 12, 12, batch=128),
        "small_w384_p4_32": _shape(32, 4, 384, 12, 6, batch=256),
    },
    "tiny": {"tiny_w32_p4_16": _shape(16, 4, 32, 2, 2, batch=8)},
}
SECTIONS = ("peak", "models", "objectives", "sync", "loader", "pipeline")
MODES = {"eager": None, "compiled": "default", "reduce-overhead": "reduce-overhead"}
NEED_S = {"eager": 30, "compiled": 90, "reduce-overhead": 90}  # a row's rough worst case


@dataclass
class Suite:
    """What every section needs: device, size, time budget, shared shards, the rows so far."""

    device: torch.device
    size: str = "full"
    budget_s: float = 480.0
    data: str | None = None  # shards to read (default: synthetic ones made here)
    pipeline: Path | None = None  # pipelines/pretrain.py
    overrides: list[str] = field(default_factory=list)  # extra pipeline overrides
    # The objectives section: name -> objective, the first the reference of the speed-ups.
    objectives: dict[str, ObjectiveConfig] = field(default_factory=dict)
    sections: frozenset[str] | None = None  # run only these (None: all)
    batch: int | None = None  # overrides every shape's batch (e.g. a smaller one on a CPU)
    rows: list[dict] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ssl-vit-bench-")))

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def tiny(self) -> bool:
        return self.size == "tiny"

    @property
    def precision(self) -> str:
        return "bf16" if self.cuda else "no"  # CPU: fp32 (bf16 is emulated on most CPUs)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def peak_flops(self) -> float | None:
        return next((r["flops_per_s"] for r in self.rows if r["name"] == "matmul peak"), None)

    @functools.cached_property
    def shards(self) -> str:
        """The shards the loader and pipeline rows read: --data, else synthetic 32 px shapes
        (made on first use)."""
        if self.data:
            return self.data
        from ssl_vit.datasets.synthetic import make_synthetic_shards

        n, per = (64, 32) if self.tiny else (4096, 512)
        make_synthetic_shards(self.tmp / "shards", n=n, image_size=32, seed=0, shard_size=per)
        return str(self.tmp / "shards")

    def shapes(self) -> dict[str, dict]:
        """The model shapes of this size, with `batch` applied."""
        return {k: {**s, "batch": self.batch or s["batch"]} for k, s in SIZES[self.size].items()}

    def small_shape(self) -> tuple[str, dict]:
        """The last shape (name, shape): that of the objectives, sync, loader, pipeline rows."""
        return list(self.shapes().items())[-1]

    def row(
        self, section: str, name: str, need_s: float, fn: Callable[[], dict], cuda_only=False
    ) -> dict | None:
        """Append and return the row `fn()` makes, or one that says why there is none (None:
        its section is not asked for)."""
        if self.sections is not None and section not in self.sections:
            return None
        base = {"section": section, "name": name}
        skipped = "skipped: no CUDA" if cuda_only and not self.cuda else None
        if skipped is None and self.left_s() < need_s:
            skipped = f"skipped: time budget ({self.left_s():.0f}s left)"
        if skipped is not None:
            self.rows.append({**base, "status": skipped})
            return self.rows[-1]
        log.info("[bench gpu] %s: %s", section, name)
        t0 = time.monotonic()
        try:
            figures = fn()
            status = "ok"
        except Exception as e:  # any failure is a row, never the end of the suite
            figures, status = {"traceback": traceback.format_exc(limit=-3)}, error_line(e)
        finally:
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        self.rows.append({**base, "status": status, **figures, "wall_s": time.monotonic() - t0})
        return self.rows[-1]


def _timed(fn: Callable[[], object], device: torch.device, warmup: int, steps: int) -> float:
    """Seconds per call: `warmup` untimed calls (compilation), then `steps` back to back with
    one sync at the end (throughput, as training runs)."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / steps


# --- peak ------------------------------------------------------------------------------------
def peak_row(suite: Suite) -> dict:
    n = 256 if suite.tiny else (8192 if suite.cuda else 2048)
    dtype = torch.bfloat16 if suite.cuda else torch.float32
    sec = _timed(matmul_step(n, dtype, suite.device), suite.device, 3, 5 if suite.tiny else 50)
    return {
        "dtype": str(dtype),
        "n": n,
        "flops_per_s": 2 * n**3 / sec,
        "tflops": 2 * n**3 / sec / 1e12,
    }


# --- models ----------------------------------------------------------------------------------
def model_row(
    suite: Suite, shape: dict, contender: str, mode: str, objective: ObjectiveConfig | None = None
) -> dict:
    from ssl_vit.bench.timm_baseline import TimmMaskedPatch
    from ssl_vit.model import build_vit
    from ssl_vit.objectives import MaskedPatchPrediction
    from ssl_vit.train.optim import build_adam

    torch.manual_seed(0)
    mcfg = ModelConfig(**{k: shape[k] for k in MODEL_KEYS})
    dev = suite.device
    if contender == "ours":
        model = MaskedPatchPrediction(build_vit(mcfg), objective or ObjectiveConfig()).to(dev)
    else:
        args = (mcfg.image_size, mcfg.patch_size, mcfg.width, mcfg.depth, mcfg.heads)
        model = TimmMaskedPatch(*args, mcfg.mlp_ratio).to(dev)
    opt = build_adam(model, OptimConfig())
    batch, size = shape["batch"], shape["image_size"]
    g = torch.Generator(dev).manual_seed(0)
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=dev)
    flops = step_flops(make_train_step(model, opt, images, g, suite.precision))
    fwd = model if MODES[mode] is None else torch.compile(model, mode=MODES[mode])
    step = make_train_step(fwd, opt, images, g, suite.precision)
    try:
        sec = _timed(step, dev, 1 if suite.tiny else 5, 2 if suite.tiny else 20)
    finally:
        torch._dynamo.reset()  # frees the compiled graphs (and their CUDA graphs)
    peak = suite.peak_flops()
    return {
        "precision": suite.precision,
        "batch": batch,
        "img_per_s": batch / sec,
        "step_ms": sec * 1e3,
        "step_gflop": flops / 1e9,
        "tflops": flops / sec / 1e12,
        "pct_of_peak": 100 * flops / sec / peak if peak else None,
    }


def model_rows(suite: Suite, modes: list[str]) -> None:
    """Ours and timm at every shape in `modes` (compiled ones: CUDA only), and their ratio."""
    for mode in modes:
        for name, shape in suite.shapes().items():
            for who in ("ours", "timm"):
                suite.row(
                    "models",
                    f"{who} {name} {mode}",
                    NEED_S[mode] if not suite.tiny else 1,
                    lambda s=shape, w=who, m=mode: model_row(suite, s, w, m),
                    cuda_only=mode != "eager",
                )
            _ratio_row(suite, name, mode)


def _ratio_row(suite: Suite, name: str, mode: str) -> None:
    ips = {r["name"].split()[0]: r.get("img_per_s") for r in suite.rows[-2:]}
    if ips.get("ours") and ips.get("timm"):
        suite.rows.append(
            {"section": "models", "name": f"ours/timm {name} {mode}", "status": "ok",
             "ratio": ips["ours"] / ips["timm"]}
        )  # fmt: skip


# --- objectives ------------------------------------------------------------------------------
def objective_rows(suite: Suite, mode: str) -> None:
    """Our step at the small shape per objective, and each one's speed-up over the first:
    e.g. the visible-only arm's pretraining per epoch against the paper's (issue 22)."""
    name, shape = suite.small_shape()
    rows = {}
    for objective, cfg in suite.objectives.items():
        need = NEED_S[mode] if not suite.tiny else 1
        row = suite.row(
            "objectives", f"{objective} {name} {mode}", need,
            lambda c=cfg: model_row(suite, shape, "ours", mode, c), cuda_only=mode != "eager",
        )  # fmt: skip
        if row and row.get("img_per_s"):
            rows[objective] = row
    ref = next(iter(suite.objectives), None)
    for objective, r in rows.items():
        if objective != ref and ref in rows:
            suite.rows.append(
                {"section": "objectives", "name": f"{objective}/{ref} {name} {mode}",
                 "status": "ok", "speedup": r["img_per_s"] / rows[ref]["img_per_s"],
                 "flop_ratio": r["step_gflop"] / rows[ref]["step_gflop"]}
            )  # fmt: skip


# --- loader ----------------------------------------------------------------------------------
def loader_rows(suite: Suite) -> dict:
    from ssl_vit.bench.loaders import interleaved_rates
    from ssl_vit.config.schema import PretrainDataConfig
    from ssl_vit.data import StreamArgs, pretrain_loader, resolve_shards
    from ssl_vit.data.device_augment import DeviceAugment, load_size

    _, shape = suite.small_shape()
    batch, size = shape["batch"], shape["image_size"]
    workers = 1 if suite.tiny else auto_num_workers(-1)
    urls, data = resolve_shards(suite.shards), PretrainDataConfig()
    load, stream = load_size(0, size), StreamArgs(batch, workers, size)
    loaders = {
        "device": pretrain_loader(data, replace(stream, load_size=load), urls=urls),
        "workers": pretrain_loader(data, stream, urls=urls),
    }
    images = 4 * batch if suite.tiny else 40 * batch
    rates = interleaved_rates(loaders, images, rounds=1 if suite.tiny else 3)
    del loaders
    aug = DeviceAugment(size, torch.Generator(suite.device).manual_seed(0))
    x = torch.randint(0, 256, (batch, 3, load, load), dtype=torch.uint8, device=suite.device)
    sec = _timed(lambda: aug(x), suite.device, 2, 5 if suite.tiny else 50)
    return {
        "batch": batch,
        "image_size": size,
        "load_size": load,
        "num_workers": workers,
        "img_per_s_device_augment": statistics.median(rates["device"]),
        "img_per_s_workers_augment": statistics.median(rates["workers"]),
        "augment_ms_per_batch": sec * 1e3,
        "augment_img_per_s": batch / sec,
    }


# --- the suite -------------------------------------------------------------------------------
def run_suite(suite: Suite) -> dict:
    """Every section in order of importance and cost; -> the JSON document."""
    try:
        _sections(suite)
    finally:
        shutil.rmtree(suite.tmp, ignore_errors=True)
    return {
        "suite": "gpu",
        "size": suite.size,
        "device": str(suite.device),
        "gpu": torch.cuda.get_device_name(suite.device) if suite.cuda else None,
        "torch": torch.__version__,
        "budget_s": suite.budget_s,
        "elapsed_s": time.monotonic() - suite.start,
        "rows": suite.rows,
    }


def _sections(suite: Suite) -> None:
    suite.row("peak", "matmul peak", 10, lambda: peak_row(suite))
    model_rows(suite, ["eager"])  # cheap rows first; compiled ones last (they take the longest)
    objective_rows(suite, "eager")
    step = (suite.small_shape()[1], suite.device, suite.precision)
    suite.row("sync", "host syncs per step (counted)", 10, lambda: sync_count_row(*step))
    debug = "set_sync_debug_mode(error)"
    suite.row("sync", debug, 20, lambda: sync_debug_row(*step), cuda_only=True)
    suite.row("loader", "loader img/s at the GPU batch", 30, lambda: loader_rows(suite))
    suite.row("pipeline", "pipelines/pretrain.py eager", 60, lambda: pipeline_row(suite, False))
    model_rows(suite, ["compiled"])
    objective_rows(suite, "compiled")
    pipe = "pipelines/pretrain.py compiled"
    suite.row("pipeline", pipe, 120, lambda: pipeline_row(suite, True), cuda_only=True)
    ddp_pipeline_row(suite)
    model_rows(suite, ["reduce-overhead"])


COLUMNS = (
    ("img/s", "img_per_s"),
    ("ms", "step_ms"),
    ("TFLOP/s", "tflops"),
    ("% peak", "pct_of_peak"),
)


def markdown_table(result: dict) -> str:
    """The rows as a Markdown table for the README (numbers rounded, extra figures in notes)."""
    head = "| section | row | status | " + " | ".join(c for c, _ in COLUMNS) + " | other |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 4)]
    skip = {"section", "name", "status", "traceback", "wall_s", *(k for _, k in COLUMNS)}
    for r in result["rows"]:
        cells = [_fmt(r.get(k)) for _, k in COLUMNS]
        other = ", ".join(f"{k}={_fmt(v)}" for k, v in r.items() if k not in skip)
        lines.append(
            f"| {r['section']} | {r['name']} | {r['status']} | {' | '.join(cells)} | {other} |"
        )
    where = result["gpu"] or result["device"]
    lines.append(f"\n{where}, torch {result['torch']}, {result['elapsed_s']:.0f} s")
    return "\n".join(lines)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return "-" if v is None else str(v)
