"""Training on the unlabelled images too (beyond the paper), in the fine-tuning loop.

Offline (`distill.mode=offline`, self-training): a fine-tuned classifier, the teacher, labels
them softly and the student fits those targets besides the labelled images' true labels.
SimCLRv2's distillation loss (Chen et al. 2020, eq. 2): the cross-entropy of the student's
temperature-scaled softmax against the teacher's, on the same augmented images.

Online (`distill.mode=online`, semi-supervised: FixMatch, Sohn et al. 2020; Semi-ViT, Cai et
al. 2022): the teacher is the student's EMA (`ema.EMA`, updated after each applied step); its
argmax on a weak view (the labelled stream's crop and flip) is the pseudo-label where its
softmax maximum reaches `distill.threshold`, and the student's cross-entropy to it is taken on
a strong view of the same image (`strong_augment`: RandAugment-style ops and erasing on the
device, no second decode). An image below the threshold adds nothing; the mean is over all U
images (FixMatch's normalisation), so the unlabelled term grows as the teacher grows confident.
With `distill.mixup`, Semi-ViT's probabilistic pseudo-mixup blends the strong views in pairs
first (`pseudo_mixup`), weighted by the teacher's confidences. With `distill.class_thresholds`,
each class has its own threshold, lower for the classes the teacher is seldom confident in
(FlexMatch: `ssl_vit.train.class_thresholds`); with `distill.class_share`, lowered as far as
keeps each class's most confident share (class-balanced self-training, the same module). With
`distill.align`, the teacher's probabilities are first scaled toward the labelled images' class
frequencies (ReMixMatch's distribution alignment: `ssl_vit.train.align`).

In both, labelled and unlabelled micro-batches share each step. Shape legend: B labelled
images, U unlabelled images, K classes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.atomic import file_sha256, write_text
from ssl_vit.errors import ConfigError
from ssl_vit.jsonfile import read_json
from ssl_vit.train.align import Alignment, aligned
from ssl_vit.train.class_thresholds import ClassShares, ClassThresholds
from ssl_vit.train.metrics import ratio

log = logging.getLogger(__name__)

__all__ = [
    "SelfTraining",
    "Teacher",
    "autocast_dtype",
    "check_teacher",
    "check_unlabelled",
    "distill_forward",
    "distillation_loss",
    "frozen_teacher",
    "mixup_partners",
    "online_forward",
    "pseudo_label_loss",
    "pseudo_mixup",
    "record_teacher",
]

TEACHER_FILE = "teacher.json"  # in the run directory: which teacher, by path and checksum


def distillation_loss(
    student_UK: torch.Tensor, teacher_UK: torch.Tensor, temperature: float
) -> torch.Tensor:
    """mean over images of -sum_k softmax(teacher / T)_k log softmax(student / T)_k."""
    target_UK = F.softmax(teacher_UK.float() / temperature, dim=-1)
    return -(target_UK * F.log_softmax(student_UK.float() / temperature, dim=-1)).sum(-1).mean()


def frozen_teacher(teacher: nn.Module, device: torch.device) -> nn.Module:
    """The teacher on `device`, in eval mode (no dropout, drop path off) with no parameter
    that asks for a gradient: the step's backward and optimizer never reach it."""
    return teacher.to(device).eval().requires_grad_(False)


class DistillLoss(NamedTuple):
    loss: torch.Tensor  # labelled cross-entropy + weight x distillation (what is minimised)
    logits: torch.Tensor  # [B, K] the student's on the labelled images
    labelled: torch.Tensor  # the labelled part of the loss
    distill: torch.Tensor  # the distillation part
    agree: torch.Tensor  # unlabelled images whose student top-1 is the teacher's (a count)


def _student_and_teacher(
    model: nn.Module,
    teacher: nn.Module,
    images_B: torch.Tensor,
    student_U: torch.Tensor,
    teacher_U: torch.Tensor,
    autocast: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(student logits [B, K] on the labelled images, [U, K] on its view of the unlabelled
    ones, the teacher's [U, K] on its view): one student forward over both, the teacher's
    under no_grad, autocast to `autocast` (None: as called)."""
    if images_B.dtype != student_U.dtype:  # mixed labelled images are [0, 1] floats
        student_U = student_U.float() / 255.0
    logits = model(torch.cat([images_B, student_U]))
    teacher_UK = _teacher_logits(teacher, teacher_U, autocast)
    return logits[: len(images_B)], logits[len(images_B) :], teacher_UK


def _teacher_logits(
    teacher: nn.Module, images_U: torch.Tensor, autocast: torch.dtype | None
) -> torch.Tensor:
    """The teacher's [U, K] under no_grad, autocast to `autocast` (None: as called)."""
    on = autocast is not None
    with torch.no_grad(), torch.autocast(images_U.device.type, autocast, enabled=on):
        return teacher(images_U)  # uint8 or [0, 1]: PixelNorm takes both


Scale = torch.Tensor | None  # [K] distribution alignment's p_L / p_U (`align`), or none


def _confidence(
    teacher_UK: torch.Tensor, scale: Scale = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(confidence_U, pseudo_U, teacher_sum_K): the maximum and argmax of the teacher's softmax,
    aligned by `scale` if given; and that softmax summed over the images, before alignment (what
    `align.Alignment` averages)."""
    probs_UK = F.softmax(teacher_UK.detach().float(), dim=-1)
    confidence_U, pseudo_U = (probs_UK if scale is None else aligned(probs_UK, scale)).max(dim=-1)
    return confidence_U, pseudo_U, probs_UK.sum(0)


def distill_forward(
    model: nn.Module,
    teacher: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    temperature: float,
    weight: float,
    autocast: torch.dtype | None = None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], DistillLoss]:
    """forward+loss of one micro-batch: labelled images (uint8, or mixed [0, 1]) with their
    targets, and the unlabelled images (uint8) as the student sees them and as the teacher
    does (the same tensor but under `distill.views=weak_strong`). The student sees both in one
    forward pass; the teacher only the unlabelled ones, under no_grad, in the same (compiled)
    region, autocast to `autocast` (`autocast_dtype`: the run's mixed precision; None: as
    called)."""

    def forward_loss(images_B, targets, unlabelled_U, teacher_view_U) -> DistillLoss:
        logits_B, student_UK, teacher_UK = _student_and_teacher(
            model, teacher, images_B, unlabelled_U, teacher_view_U, autocast
        )
        labelled = loss_fn(logits_B.float(), targets)
        distill = distillation_loss(student_UK, teacher_UK, temperature)
        agree = (student_UK.argmax(-1) == teacher_UK.argmax(-1)).sum()
        return DistillLoss(labelled + weight * distill, logits_B, labelled, distill, agree)

    return forward_loss


Threshold = float | torch.Tensor  # one for every class, or [K] (`class_thresholds`, `class_share`)


def _passes(confidence_U: torch.Tensor, pseudo_U: torch.Tensor, threshold: Threshold):
    """[U] bool: the confidence reaches the threshold (its pseudo-label class's, if [K])."""
    if isinstance(threshold, torch.Tensor):
        threshold = threshold[pseudo_U]
    return confidence_U >= threshold


def pseudo_label_loss(
    student_UK: torch.Tensor, teacher_UK: torch.Tensor, threshold: Threshold, scale: Scale = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, pseudo_U, used_U, confidence_U, teacher_sum_K): FixMatch's unlabelled term, the
    mean over all U images of used_u x cross-entropy(student_u, pseudo_u), where pseudo_u is the
    teacher's argmax and used_u whether its softmax maximum, confidence_u, is >= `threshold`
    (per class: pseudo_u's), both read from its probabilities aligned by `scale` if given
    (`_confidence`); no gradient reaches the teacher."""
    confidence_U, pseudo_U, teacher_sum_K = _confidence(teacher_UK, scale)
    used_U = _passes(confidence_U, pseudo_U, threshold)
    ce_U = F.cross_entropy(student_UK.float(), pseudo_U, reduction="none")
    return (ce_U * used_U).mean(), pseudo_U, used_U, confidence_U, teacher_sum_K


MIXUP_BLOCK = 4  # pseudo-mixup partners: the next image in its block of four (`mixup_partners`)


def mixup_partners(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n] each image's partner: the next image in its block of `MIXUP_BLOCK`, cyclically (a
    last block of n % 4 images cycles on its own). The stream is shuffled, so partners are
    random images. Blocks rather than one permutation of the micro-batch: a process holds whole
    blocks of the global micro-batch when its share is a multiple of 4, so N processes pair
    the images as one does. Cycles of 3 or more: never mutual partners (u with v and v with u
    would blend into one image twice)."""
    i = torch.arange(n, device=device)
    start = i - i % MIXUP_BLOCK
    return start + (i - start + 1) % (n - start).clamp(max=MIXUP_BLOCK)


def pseudo_mixup(
    strong_U: torch.Tensor, pseudo_U: torch.Tensor, confidence_U: torch.Tensor, classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semi-ViT's probabilistic pseudo-mixup (Cai et al. 2022, section 3.3): image u and its
    partner v (`mixup_partners`) blend as lam x_u + (1 - lam) x_v, lam = c_u / (c_u + c_v)
    from the teacher's confidences, so the more confident pseudo-label dominates, and the
    target is the same blend of the two one-hot pseudo-labels. Which blends count is the
    caller's (`_mixed_loss`: where either image passes). (blended views [U, 3, S, S] in
    [0, 1], targets [U, K])."""
    v = mixup_partners(len(strong_U), strong_U.device)
    lam_U = confidence_U / (confidence_U + confidence_U[v])  # each >= 1 / K: never 0 / 0
    x = strong_U.float() / 255.0 if strong_U.dtype == torch.uint8 else strong_U.float()
    lam = lam_U.view(-1, *[1] * (x.dim() - 1))
    # (F.one_hot checks its values on the host: a sync per step)
    onehot_UK = (pseudo_U[:, None] == torch.arange(classes, device=pseudo_U.device)).float()
    target_UK = lam_U[:, None] * onehot_UK + (1 - lam_U[:, None]) * onehot_UK[v]
    return lam * x + (1 - lam) * x[v], target_UK


class OnlineLoss(NamedTuple):
    loss: torch.Tensor  # labelled cross-entropy + weight x pseudo-label term
    logits: torch.Tensor  # [B, K] the student's on the labelled images
    labelled: torch.Tensor
    distill: torch.Tensor  # the pseudo-label term (named as offline's: one log column)
    pseudo: torch.Tensor  # [U] the teacher's argmax on the weak views
    used: torch.Tensor  # [U] bool: confident enough to count (before any blending)
    confidence: torch.Tensor  # [U] the teacher's softmax maximum (aligned, with `align`)
    teacher_sum: torch.Tensor  # [K] the teacher's softmax summed over the U images (unaligned)


def _mixed_loss(
    model: nn.Module,
    teacher: nn.Module,
    images_B: torch.Tensor,
    strong_U: torch.Tensor,
    weak_U: torch.Tensor,
    threshold: Threshold,
    autocast: torch.dtype | None,
    scale: Scale,
) -> tuple[torch.Tensor, ...]:
    """(student logits [B, K], pseudo-mixup's unlabelled term, pseudo_U, used_U,
    confidence_U, teacher_sum_K): the teacher first (its confidences weight the blends), then
    one student forward over the labelled images and the blended strong views, both as [0, 1]
    floats. A blend counts where either of its images passes (for one threshold: the larger
    confidence)."""
    teacher_UK = _teacher_logits(teacher, weak_U, autocast)
    confidence_U, pseudo_U, teacher_sum_K = _confidence(teacher_UK, scale)
    mixed_U, target_UK = pseudo_mixup(strong_U, pseudo_U, confidence_U, teacher_UK.shape[-1])
    if images_B.dtype == torch.uint8:
        images_B = images_B.float() / 255.0
    logits = model(torch.cat([images_B, mixed_U.to(images_B.dtype)]))
    ce_U = -(target_UK * F.log_softmax(logits[len(images_B) :].float(), dim=-1)).sum(-1)
    used_U = _passes(confidence_U, pseudo_U, threshold)
    counts_U = used_U | used_U[mixup_partners(len(used_U), used_U.device)]
    unlabelled = (ce_U * counts_U).mean()
    return logits[: len(images_B)], unlabelled, pseudo_U, used_U, confidence_U, teacher_sum_K


def online_forward(
    model: nn.Module,
    teacher: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    threshold: Threshold,
    weight: float,
    autocast: torch.dtype | None = None,
    mixup: bool = False,
    scale: Scale = None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], OnlineLoss]:
    """forward+loss of one micro-batch: labelled images with their targets, the unlabelled
    images' strong views (the student's) and weak views (the teacher's). One student forward
    over both; the teacher (the EMA module) under no_grad in the same compiled region, autocast
    as `distill_forward`'s. With `mixup`, the strong views are blended (`pseudo_mixup`). A [K]
    `threshold` (`ClassThresholds.thresholds`, updated in place between steps) is read at each
    call: a graph input, not a constant; so is `scale` (`Alignment.scale`), which aligns the
    teacher's probabilities before its pseudo-labels are taken."""

    def forward_loss(images_B, targets, strong_U, weak_U) -> OnlineLoss:
        if mixup:
            logits_B, unlabelled, *u = _mixed_loss(
                model, teacher, images_B, strong_U, weak_U, threshold, autocast, scale
            )
        else:
            logits_B, student_UK, teacher_UK = _student_and_teacher(
                model, teacher, images_B, strong_U, weak_U, autocast
            )
            unlabelled, *u = pseudo_label_loss(student_UK, teacher_UK, threshold, scale)
        labelled = loss_fn(logits_B.float(), targets)
        return OnlineLoss(labelled + weight * unlabelled, logits_B, labelled, unlabelled, *u)

    return forward_loss


class Teacher(NamedTuple):
    """The teacher as checked before any compute: its classifier file, the file's SHA-256 and
    its fine-tune's top-1 (None when its run has no results.json)."""

    file: Path
    sha256: str
    top1: float | None

    def record(self) -> dict[str, Any]:
        return {"teacher": str(self.file), "teacher_sha256": self.sha256, "teacher_top1": self.top1}


def check_teacher(cfg: Any, label_names: list[str], resume: bool) -> Teacher | None:
    """distill.teacher is a fine-tuned classifier for data.train's classes at model.image_size
    (None under `distill.mode=online`: the student's EMA is its teacher), distill.unlabelled a
    readable source holding a step's unlabelled images (distill.ratio), and on --resume the
    teacher the run started with: each a one-line ConfigError before any compute."""
    from ssl_vit.train.classifier_file import ClassifierError, find_classifier, read_classifier_spec

    d = cfg.distill
    _say_epochs(cfg, check_unlabelled(cfg))
    if d.online:
        _warn_slow_teacher(d.momentum, cfg.train.steps)
        return None
    try:
        spec = read_classifier_spec(d.teacher)
        file = find_classifier(d.teacher).resolve()
    except ClassifierError as e:
        raise ConfigError(f"distill.teacher={d.teacher!r}: {e}") from None
    if list(spec.label_names) != list(label_names):
        raise ConfigError(
            f"distill.teacher={d.teacher!r}: classifies {list(spec.label_names)[:6]}, not "
            f"data.train's classes {list(label_names)[:6]} (in that order)"
        )
    if spec.image_size != cfg.model.image_size:
        raise ConfigError(
            f"distill.teacher={d.teacher!r}: takes {spec.image_size} px images, the student "
            f"{cfg.model.image_size} px (model.image_size); give them the same resolution"
        )
    teacher = Teacher(file, file_sha256(file), _teacher_top1(file.parent))
    if resume:
        _check_same_teacher(Path(cfg.output_dir) / TEACHER_FILE, teacher)
    return teacher


def _warn_slow_teacher(momentum: float, steps: int) -> None:
    """The online teacher averages the student over ~1 / (1 - momentum) steps: a window past
    half the run keeps it near where the student started (a zero-initialized head: uniform
    predictions, under any threshold), and the unlabelled images then teach little or nothing."""
    window = 1 / (1 - momentum)
    # (1 / (1 - 0.9) is 10.000000000000002; momentum 0: the teacher is the student)
    if momentum > 0 and 2 * window > steps + 1e-6:
        log.warning(
            "distill.momentum=%s: the teacher follows the student over ~%.0f steps, train.steps"
            "=%d: it stays near the starting classifier, whose pseudo-labels rarely pass "
            "distill.threshold; lower distill.momentum (at most %s for this run) or train longer",
            momentum, window, steps, f"{max(0.0, 1 - 2 / steps):.3g}",
        )  # fmt: skip


def _say_epochs(cfg: Any, images: int) -> None:
    """How much of distill.unlabelled the run reads. The online stage's gain grows with the
    unlabelled epochs (docs/results.md, "The online semi-supervised stage in the quick start":
    -0.1 points at 0.3 epochs, +2.8 at 8; CIFAR-10: -0.1 at 0.5, +2.0 at 2.6), so a run of
    under one is warned before its compute (about twice a plain fine-tune's)."""
    d, tc = cfg.distill, cfg.train
    per_step = tc.batch_size * d.ratio
    epochs = tc.steps * per_step / images
    log.info(
        "distill: %d unlabelled images a step (train.batch_size x distill.ratio) of the %s in "
        "%s: %d steps read %.2g epoch%s of them", per_step, f"{images:,}", d.unlabelled,
        tc.steps, epochs, "" if f"{epochs:.2g}" == "1" else "s",
    )  # fmt: skip
    if d.online and epochs < 1:
        log.warning(
            "distill: %d steps read %.2g of an epoch of the unlabelled images; the online "
            "stage has gained over its control only after several (docs/results.md): raise "
            "train.steps or distill.ratio", tc.steps, epochs,
        )  # fmt: skip


def check_unlabelled(cfg: Any) -> int:
    """distill.unlabelled: a readable source with at least a step's unlabelled images (their
    number)."""
    from ssl_vit.data.sources import open_source
    from ssl_vit.train.preflight import check_not_a_run

    d = cfg.distill
    check_not_a_run("distill.unlabelled", d.unlabelled)
    try:
        images = len(open_source(d.unlabelled, labels="ignored"))  # as the stream reads it
        if images == 0:
            raise ValueError("no images")
    except (OSError, ValueError) as e:
        raise ConfigError(f"distill.unlabelled={d.unlabelled!r}: {e}") from None
    _check_ratio(d.ratio, cfg.train.batch_size, images)
    return images


def _check_ratio(ratio: int, batch_size: int, images: int) -> None:
    """A step's unlabelled images (train.batch_size x distill.ratio) are at most the `images`
    distill.unlabelled holds: more would repeat images within one step, and a ratio far past it
    (100,000) assembles a batch that never reaches step 1. (What fits in memory: `train.plan`.)"""
    if batch_size * ratio <= images:
        return
    most = images // batch_size
    hint = f"lower distill.ratio (at most {most})" if most else "lower train.batch_size"
    raise ConfigError(
        f"distill.ratio={ratio}: {batch_size * ratio:,} unlabelled images a step "
        f"(train.batch_size {batch_size} x {ratio}), more than distill.unlabelled holds "
        f"({images:,}); {hint}"
    )


def _teacher_top1(run_dir: Path) -> float | None:
    """The saved model's top-1 in its fine-tune's results.json (top1_ema with averaging)."""
    try:
        results = read_json(run_dir / "results.json")
    except (OSError, ValueError):  # none, or not ours: the top-1 is only shown
        return None
    top1 = results.get("top1_ema") if results.get("top1_ema") is not None else results.get("top1")
    return top1 if isinstance(top1, (int, float)) else None


def _check_same_teacher(recorded: Path, teacher: Teacher) -> None:
    if not recorded.is_file():
        return  # stopped before its first record: nothing trained with another teacher
    try:
        before = read_json(recorded)
    except ValueError as e:  # JsonFileError: truncated, another shape, nested too deep
        raise ConfigError(f"{e}; start a new run (--overwrite)") from None
    if before.get("teacher_sha256") != teacher.sha256:
        raise ConfigError(
            f"--resume: distill.teacher is not the teacher this run started with "
            f"({before.get('teacher')}, sha256 {str(before.get('teacher_sha256'))[:12]}...; now "
            f"{teacher.file}, {teacher.sha256[:12]}...); resume with that one or start a new run"
        )


def record_teacher(run_dir: Path, teacher: Teacher) -> None:
    """teacher.json in the run directory (atomic), what --resume compares."""
    write_text(Path(run_dir) / TEACHER_FILE, json.dumps(teacher.record(), indent=1) + "\n")


def autocast_dtype(mixed_precision: str) -> torch.dtype | None:
    """The dtype the teacher's forward autocasts to: the run's mixed precision, as
    Accelerate's `prepare` gives the student (the teacher is not prepared: without this it
    ran in fp32 under bf16, at twice the memory and several times the time)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)


class SelfTraining:
    """One fine-tuning run's training on the unlabelled images: its teacher on the device (the
    frozen classifier offline; online, the student's EMA, checkpointed as `parts["teacher"]`),
    the unlabelled stream's loader (the fine-tuning loop reads it beside the labelled one; its
    position is checkpointed apart, as elastic as the labelled one) and its views: crops in the
    workers, or on the device with the labelled stream's `data.augment`; always on the device
    under `distill.views=weak_strong` (whose stream only decodes and resizes: the teacher's
    view) and online (weak: crop and flip; strong: those, then `strong_augment`), each from a
    seed of its own (`seeds.UNLABELLED`).

    Built before the checkpoint is restored (`parts` joins the training state); the loop calls
    `start` once, `views` and `counts` per micro-batch, `follow` after each step, `row` at log
    steps."""

    NAME = "unlabelled"  # the stream's name (checkpoint key stream_unlabelled, images_unlabelled)

    def __init__(
        self, cfg: Any, run: Any, teacher: Teacher | None, device_augment: Any, start: Any,
        student: nn.Module,
    ) -> None:  # fmt: skip
        from ssl_vit import seeds
        from ssl_vit.data.device_augment import build_device_augment
        from ssl_vit.data.strong_augment import build_strong_augment
        from ssl_vit.data.train_stream import train_loader
        from ssl_vit.train.classifier_file import load_classifier
        from ssl_vit.train.ema import EMA
        from ssl_vit.train.loop import stream_args

        plan, d = run.plan, cfg.distill
        self.cfg, self.device, self.online = cfg, run.acc.device, d.online
        self.autocast = autocast_dtype(run.acc.mixed_precision)
        seed = seeds.derive(cfg.seed, seeds.UNLABELLED)
        micro = plan.global_unlabelled_micro
        self.parts: dict[str, nn.Module] = {}
        self.strong, self.classes, self.align = None, None, None
        if self.online:  # the student's EMA, from the student's weights at step 0
            self.ema = EMA(student, d.momentum, copy_first=False)
            self.teacher = self.ema.module.eval()
            self.parts["teacher"] = self.ema
            opts = {"ops": d.strong_ops, "magnitude": d.strong_magnitude / 10}  # of (0, 1)
            self.strong = build_strong_augment(seed, plan.rank, micro, self.device, **opts)
            if d.class_thresholds:  # FlexMatch's, checkpointed beside the teacher
                classes = student.head.out_features
                self.classes = ClassThresholds(classes, d.threshold, d.momentum, self.device)
                self.parts["class_thresholds"] = self.classes
            elif d.class_share:  # CBST's, checkpointed beside the teacher
                classes, share = student.head.out_features, d.class_share
                self.classes = ClassShares(classes, d.threshold, share, d.momentum, self.device)
                self.parts["class_share"] = self.classes
            if d.align:  # ReMixMatch's distribution alignment, checkpointed beside the teacher
                self.align = Alignment(student.head.out_features, self.device)
                self.parts["align"] = self.align
            self.reduce = partial(run.acc.reduce, reduction="sum")
        else:
            self.teacher = frozen_teacher(load_classifier(teacher.file)[0], self.device)
        self.augment, self.two_views = None, d.views == "weak_strong" and not self.online
        if device_augment is not None or self.two_views or self.online:
            size, opts = cfg.model.image_size, {"global_micro": micro, "always": True}
            self.augment = build_device_augment(cfg.data, size, self.device, seed, plan, **opts)
        args = stream_args(run, cfg, start, self.augment, self.NAME)
        args = replace(args, global_micro=micro, seed=seed)
        self.loader = train_loader(cfg.data, args, source=d.unlabelled)

    def forward(self, model: nn.Module, loss_fn: Callable) -> Callable:
        d = self.cfg.distill
        if self.online:
            threshold = d.threshold if self.classes is None else self.classes.thresholds
            scale = None if self.align is None else self.align.scale
            return online_forward(
                model, self.teacher, loss_fn, threshold, d.weight, self.autocast, d.mixup, scale
            )
        return distill_forward(model, self.teacher, loss_fn, d.temperature, d.weight, self.autocast)

    def views(self, images: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An unlabelled micro-batch (uint8, as the loader gives it) on the device: (the
        student's view, the teacher's). Offline: cropped like the labelled; the teacher's only
        resized to the model's size under `weak_strong` (antialiased, as the loaders resize).
        Online: (strong, weak), the strong made from the weak."""
        x = images.to(self.device, non_blocking=True)
        student = self.augment(x, index) if self.augment is not None else x
        if self.online:
            return self.strong(student, index), student
        if not self.two_views:
            return student, student
        size = self.cfg.model.image_size
        if x.shape[-1] != size:
            x = F.interpolate(x.float(), size=(size, size), mode="bilinear", antialias=True)
            x = x.round().clamp_(0, 255).to(torch.uint8)
        return student, x

    def counts(
        self, out: Any, labels: torch.Tensor, labelled_B: torch.Tensor
    ) -> dict[str, torch.Tensor | int]:
        """A micro-batch's figures for the log (on the device). Online: pseudo-labels used and,
        where the unlabelled source has labels (>= 0), how many used ones are right: those
        labels are read here only, never by the loss. With class thresholds, the micro-batch's
        confident pseudo-labels are also counted toward them here (`ClassThresholds.add`), and
        with alignment its labelled images' classes `labelled_B` and the teacher's predictions
        (`Alignment.add`): the one place the loop hands over each micro-batch's output;
        `follow` applies the step's counts."""
        if not self.online:
            return {"distill": out.distill, "agree": out.agree, "unlabelled": len(labels)}
        if self.classes is not None:
            self.classes.add(out.pseudo, out.confidence)
        if self.align is not None:
            self.align.add(labelled_B, out.teacher_sum, len(labels))
        labels = labels.to(self.device, non_blocking=True)
        known = out.used & (labels >= 0)
        right = known & (out.pseudo == labels)
        return {
            "distill": out.distill, "unlabelled": len(labels), "used": out.used.sum(),
            "known": known.sum(), "right": right.sum(),
        }  # fmt: skip

    @torch.no_grad()
    def start(self, student: nn.Module, step: int) -> None:
        """After `prepare`, before the first step: online, a new run's teacher is the student
        as DDP broadcast it from rank 0 (each process built its own random init; a resumed
        run's teacher is the checkpoint's)."""
        if self.online and step == 0:
            torch._foreach_copy_(list(self.teacher.parameters()), list(student.parameters()))

    def follow(self, student: nn.Module, applied: torch.Tensor | bool) -> None:
        """After a step: online, the teacher moves toward the student, and the class
        thresholds and the alignment take the step's counts (if the step applied)."""
        if self.online:
            self.ema.update(student, applied)
        if self.align is not None:
            self.align.update(applied, self.reduce)
        if self.classes is not None:
            self.classes.update(applied, self.reduce)

    def row(self, sums: dict) -> dict[str, float | None]:
        """A log row's unlabelled columns: the unlabelled loss; offline, how often the student's
        top-1 is the teacher's; online, the share of pseudo-labels used and their accuracy
        (NaN in a lap that used none, or where the source has no labels)."""
        out = {"distill_loss": ratio(sums["distill"], sums["micro"])}
        if not self.online:
            return {**out, "teacher_agree": ratio(sums["agree"], sums["unlabelled"])}
        out["pseudo_used"] = ratio(sums["used"], sums["unlabelled"])
        return {**out, "pseudo_acc": ratio(sums["right"], sums["known"])}
