"""The online semi-supervised stage (`distill.mode=online`: FixMatch / Semi-ViT): the EMA
teacher gets no gradient and follows the student by the momentum rule; a pseudo-label below
the threshold adds nothing (hand-computed loss and gradient); the step is one graph with no
host sync; stop and --resume bit-identical with both streams and the teacher; 2 processes as
1; the offline and paper paths untouched by the new keys."""

import json
import logging
import math
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import pipeline
from safetensors.torch import load_file
from test_compile import Backend, _losses
from test_distill import _tiny_classifier
from test_distributed import LAUNCH
from test_faults import stop_after_step
from test_pipelines import ROOT, finetune_args
from test_step_sync import EVERY, STEPS, _between_log_steps, _run_counting

from ssl_vit.config import ConfigError, FinetuneConfig, from_dict
from ssl_vit.model import compile as compile_mod
from ssl_vit.train.align import Alignment
from ssl_vit.train.class_thresholds import BINS, ClassShares, ClassThresholds, share_thresholds
from ssl_vit.train.distill import mixup_partners, online_forward, pseudo_label_loss, pseudo_mixup
from ssl_vit.train.ema import EMA

# A low threshold: the smoke runs' 8 steps from scratch use some pseudo-labels.
ONLINE = ["distill.mode=online", "distill.momentum=0.5", "distill.threshold=0.11"]


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def online_args(shards, out, *extra):
    more = [f"distill.unlabelled={shards}", *ONLINE]
    return finetune_args(shards, out, "train.steps=8", "train.log_every=4", *more, *extra)


def test_the_pseudo_label_loss_by_hand():
    """Teacher row 0: softmax (0.8, 0.1, 0.1) -> pseudo-label 0, confidence 0.8 >= 0.7: used.
    Row 1: (1/3, 1/3, 1/3) -> 0.33 < 0.7: not used. The student's row 0 logits (0, 0, 0): its
    cross-entropy to class 0 is ln 3; the mean over both rows: ln 3 / 2."""
    teacher = torch.tensor([[math.log(8.0), 0.0, 0.0], [0.0, 0.0, 0.0]])
    student = torch.tensor([[0.0, 0.0, 0.0], [5.0, -1.0, 2.0]], requires_grad=True)
    loss, pseudo, used, _, _ = pseudo_label_loss(student, teacher, 0.7)
    assert loss.item() == pytest.approx(math.log(3.0) / 2, rel=1e-6)
    assert pseudo.tolist() == [0, 0] and used.tolist() == [True, False]
    loss.backward()
    # d/dz of CE(z, 0) / 2 at z = 0: (softmax - onehot) / 2 = (1/3 - 1, 1/3, 1/3) / 2.
    want = torch.tensor([[-1 / 3, 1 / 6, 1 / 6], [0.0, 0.0, 0.0]])
    assert torch.allclose(student.grad, want, atol=1e-6)  # the unused row: no gradient at all
    # Over the threshold nothing is used: the term is exactly 0 whatever the student says.
    assert pseudo_label_loss(student, teacher, 0.81)[0].item() == 0.0


def test_class_thresholds_pick_each_pseudo_label_by_its_own_class():
    """The rows of the test above with thresholds per class [0.3, 0.9, 0.9]: both
    pseudo-labels are class 0, whose 0.3 row 1's 1/3 passes too. Row 1's student logits
    (5, -1, 2): cross-entropy to class 0 = ln(1 + e^-6 + e^-3). With [0.9, 0, 0] none counts."""
    teacher = torch.tensor([[math.log(8.0), 0.0, 0.0], [0.0, 0.0, 0.0]])
    student = torch.tensor([[0.0, 0.0, 0.0], [5.0, -1.0, 2.0]])
    thresholds = torch.tensor([0.3, 0.9, 0.9])
    loss, _, used, confidence, _ = pseudo_label_loss(student, teacher, thresholds)
    want = (math.log(3.0) + math.log(1 + math.exp(-6) + math.exp(-3))) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6) and used.tolist() == [True, True]
    assert confidence.tolist() == pytest.approx([0.8, 1 / 3])
    assert pseudo_label_loss(student, teacher, torch.tensor([0.9, 0.0, 0.0]))[0].item() == 0.0


def test_class_thresholds_follow_flexmatch_by_hand():
    """K = 3, tau = 0.8, momentum 0.5. A micro-batch labelled (0, 0, 1, 2, 1) with confidences
    (0.9, 0.85, 0.8, 0.5, 0.7) counts (2, 1, 0) at tau; two processes' sum (the reduce) is
    (4, 2, 0): sigma = 0.5 x 0 + 0.5 x (4, 2, 0) = (2, 1, 0), beta = (1, 0.5, 0), thresholds
    M(beta) x tau = (1, 1/3, 0) x 0.8. A step that did not apply leaves them; its counts are
    dropped. Before any confident pseudo-label, and after steps with none, every class has tau."""
    t = ClassThresholds(3, tau=0.8, momentum=0.5)
    assert t.thresholds.tolist() == pytest.approx([0.8] * 3)
    none = torch.tensor([0.1, 0.2])
    t.add(torch.tensor([0, 1]), none)
    t.update(True, lambda x: x)
    assert t.sigma.tolist() == [0.0] * 3 and t.thresholds.tolist() == pytest.approx([0.8] * 3)
    pseudo, confidence = torch.tensor([0, 0, 1, 2, 1]), torch.tensor([0.9, 0.85, 0.8, 0.5, 0.7])
    t.add(pseudo, confidence)
    assert t.step_counts.tolist() == [2.0, 1.0, 0.0]
    t.update(torch.tensor(True), lambda x: 2 * x)  # the second process counted the same
    assert t.sigma.tolist() == [2.0, 1.0, 0.0]
    assert t.thresholds.tolist() == pytest.approx([0.8, 0.8 / 3, 0.0])
    assert t.step_counts.tolist() == [0.0] * 3
    t.add(torch.tensor([2, 2]), torch.tensor([0.95, 0.99]))
    t.update(torch.tensor(False), lambda x: x)  # a skipped step
    assert t.sigma.tolist() == [2.0, 1.0, 0.0] and t.step_counts.tolist() == [0.0] * 3
    assert set(t.state_dict()) == {"sigma", "thresholds"}  # what a checkpoint keeps


def test_class_shares_follow_cbst_by_hand():
    """K = 3, tau = 0.85, share 0.5, momentum 0.5. Class 0's pseudo-labels at 0.93, 0.91,
    0.62, 0.55 fall in the bins of 0.93, 0.91, 0.62, 0.55; two processes' sum doubles them.
    Its top half lies at or above 0.91's edge: q_0 = 0.91. Class 1's one at 0.4: q_1 = 0.40.
    Class 2 has none: tau. Then min(tau, q) = (0.85, 0.40, 0.85). A skipped step leaves them."""
    t = ClassShares(3, tau=0.85, share=0.5, momentum=0.5)
    assert t.thresholds.tolist() == pytest.approx([0.85] * 3)
    t.add(torch.tensor([0, 0, 1]), torch.tensor([0.93, 0.62, 0.4]))
    t.add(torch.tensor([0, 0]), torch.tensor([0.91, 0.55]))  # a second micro-batch
    assert t.step_hist.nonzero().tolist() == [[0, 55], [0, 62], [0, 91], [0, 93], [1, 40]]
    t.update(torch.tensor(True), lambda x: 2 * x)
    assert t.hist[0, [55, 62, 91, 93]].tolist() == [1.0] * 4 and t.hist[1, 40].item() == 1.0
    assert t.thresholds.tolist() == pytest.approx([0.85, 0.40, 0.85])
    assert t.step_hist.sum().item() == 0.0
    assert share_thresholds(t.hist, 0.5, tau=1.0).tolist() == pytest.approx([0.91, 0.40, 1.0])
    assert share_thresholds(t.hist, 0.75, tau=1.0)[0].item() == pytest.approx(0.62)
    t.add(torch.tensor([2, 2]), torch.tensor([0.95, 0.99]))
    t.update(torch.tensor(False), lambda x: x)  # a skipped step: its histogram is dropped
    assert t.thresholds.tolist() == pytest.approx([0.85, 0.40, 0.85])
    t.update(torch.tensor(True), lambda x: x)  # an empty step: the average decays, same shares
    assert t.thresholds.tolist() == pytest.approx([0.85, 0.40, 0.85])
    assert set(t.state_dict()) == {"hist", "thresholds"}  # what a checkpoint keeps


def test_class_shares_keep_at_least_the_share_of_every_class_and_one_bin_more_would_not():
    """Over 200 random draws (classes, confidences, share; tau = 1, one step): every class the
    teacher predicted keeps at least `share` of its pseudo-labels at its threshold, and at the
    next bin's edge it would keep less: the threshold is the highest such edge."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(2, 12, (1,), generator=gen))
        n = int(torch.randint(1, 300, (1,), generator=gen))
        share = float(torch.rand(1, generator=gen).clamp_min(0.01))
        pseudo = torch.randint(0, k, (n,), generator=gen)
        confidence = torch.rand(n, generator=gen) ** 0.5  # more mass near 1, as a teacher's
        t = ClassShares(k, tau=1.0, share=share, momentum=0.0)
        t.add(pseudo, confidence)
        t.update(True, lambda x: x)
        for c in range(k):
            mine = confidence[pseudo == c]
            if len(mine) == 0:
                assert t.thresholds[c].item() == 1.0
                continue
            threshold = t.thresholds[c]
            assert (mine >= threshold).float().mean().item() >= share - 1e-6
            if threshold < t.edges[-1]:
                higher = t.edges[t.edges > threshold][0]
                assert (mine >= higher).float().mean().item() < share + 1e-6
    assert BINS == 100


def test_aligned_probabilities_pick_the_pseudo_label_by_hand():
    """Teacher row 0: softmax (0.5, 0.4, 0.1), row 1: (0.8, 0.1, 0.1). Scale p_L / p_U = (0.5,
    2, 1): row 0 -> (0.25, 0.8, 0.1) / 1.15, pseudo-label 1 (the teacher's under-predicted
    class), confidence 0.8 / 1.15 = 0.696; row 1 -> (0.4, 0.2, 0.1) / 0.7, class 0 at 4 / 7 =
    0.571. At threshold 0.6 only row 0 counts (unaligned: only row 1, at 0.8), so the loss is
    the student's row 0 cross-entropy to class 1, ln 3, over 2; the teacher's sum is
    unaligned."""
    teacher = torch.tensor([[0.5, 0.4, 0.1], [0.8, 0.1, 0.1]]).log()
    student = torch.tensor([[0.0, 0.0, 0.0], [0.0, math.log(2.0), 0.0]])
    scale = torch.tensor([0.5, 2.0, 1.0])
    loss, pseudo, used, confidence, teacher_sum = pseudo_label_loss(student, teacher, 0.6, scale)
    assert pseudo.tolist() == [1, 0] and used.tolist() == [True, False]
    assert confidence.tolist() == pytest.approx([0.8 / 1.15, 4 / 7], rel=1e-6)
    assert loss.item() == pytest.approx(math.log(3.0) / 2, rel=1e-6)
    assert teacher_sum.tolist() == pytest.approx([1.3, 0.5, 0.2], rel=1e-6)
    assert pseudo_label_loss(student, teacher, 0.6)[2].tolist() == [False, True]


def test_alignment_follows_remixmatch_by_hand():
    """K = 2, momentum 1 - 1/128. A micro-batch with labels (0, 1, 1, 1) and the teacher's
    softmax summed to (3, 1) over 4 unlabelled images; two processes (the reduce doubles the
    sums) give the same means: p_L <- m (1/2, 1/2) + (1 - m)(1/4, 3/4), p_U <- m (1/2, 1/2) +
    (1 - m)(3/4, 1/4), scale = p_L / p_U. A skipped step, or one with no images, changes
    nothing. What a checkpoint keeps: the two means and the scale."""
    a = Alignment(2)
    assert a.scale.tolist() == [1.0, 1.0]
    a.add(torch.tensor([0, 1, 1, 1]), torch.tensor([3.0, 1.0]), 4)
    assert a.step_sums.tolist() == [[1.0, 3.0, 4.0], [3.0, 1.0, 4.0]]
    a.update(torch.tensor(True), lambda x: 2 * x)
    m = 1 - 1 / 128
    p_l = [m / 2 + (1 - m) / 4, m / 2 + (1 - m) * 3 / 4]
    p_u = [m / 2 + (1 - m) * 3 / 4, m / 2 + (1 - m) / 4]
    assert a.labelled.tolist() == pytest.approx(p_l) and a.unlabelled.tolist() == pytest.approx(p_u)
    assert a.scale.tolist() == pytest.approx([p_l[0] / p_u[0], p_l[1] / p_u[1]])
    assert a.step_sums.abs().sum() == 0
    before = {k: v.clone() for k, v in a.state_dict().items()}
    a.add(torch.tensor([0, 0]), torch.tensor([0.0, 2.0]), 2)
    a.update(torch.tensor(False), lambda x: x)  # a skipped step
    a.update(True, lambda x: x)  # a step with nothing added
    assert all(torch.equal(before[k], v) for k, v in a.state_dict().items())
    assert set(a.state_dict()) == {"labelled", "unlabelled", "scale"}


def test_mixup_partners_cycle_in_blocks_of_four_and_two_halves_pair_as_the_whole():
    assert mixup_partners(8).tolist() == [1, 2, 3, 0, 5, 6, 7, 4]
    assert mixup_partners(6).tolist() == [1, 2, 3, 0, 5, 4]  # a last block of two
    assert mixup_partners(5).tolist() == [1, 2, 3, 0, 4]  # of one: itself, an unblended view
    assert mixup_partners(1).tolist() == [0]
    for n in (4, 8, 12, 32):  # 2 processes with n images each pair them as 1 with 2n
        whole = mixup_partners(2 * n)
        assert torch.equal(whole[:n], mixup_partners(n))
        assert torch.equal(whole[n:], mixup_partners(n) + n)
    for n in range(3, 40):  # a permutation, with no image its own partner or mutual pairs
        v = mixup_partners(n)
        assert sorted(v.tolist()) == list(range(n))
        whole = n - n % 4  # the images in full blocks
        assert all(v[i] != i and v[v[i]] != i for i in range(whole))


def test_pseudo_mixup_by_hand():
    """Confidences (0.8, 0.2, 0.6, 0.4), pseudo-labels (0, 1, 2, 1), partners (1, 2, 3, 0):
    lam = 0.8 / 1.0, 0.2 / 0.8, 0.6 / 1.0, 0.4 / 1.2; targets the same blends of the one-hot
    labels."""
    images = torch.tensor([0, 51, 102, 255], dtype=torch.uint8).view(4, 1, 1, 1).expand(4, 3, 2, 2)
    confidence = torch.tensor([0.8, 0.2, 0.6, 0.4])
    mixed, target = pseudo_mixup(images, torch.tensor([0, 1, 2, 1]), confidence, 3)
    lam = torch.tensor([0.8, 0.25, 0.6, 1 / 3])
    pixel = torch.tensor([0.8 * 0 + 0.2 * 51, 0.25 * 51 + 0.75 * 102, 0.6 * 102 + 0.4 * 255,
                          255 / 3 + 0])  # fmt: skip
    assert torch.allclose(mixed, (pixel / 255).view(4, 1, 1, 1).expand(4, 3, 2, 2), atol=1e-6)
    want = torch.tensor([[0.8, 0.2, 0.0], [0.0, 0.25, 0.75], [0.0, 0.4, 0.6], [2 / 3, 1 / 3, 0.0]])
    assert torch.allclose(target, want, atol=1e-6) and torch.allclose(target.sum(-1), lam / lam)


def test_with_pseudo_mixup_a_blend_counts_where_its_more_confident_image_passes():
    """The online loss with `mixup`: the teacher's confidences on the weak views weight the
    blends of the strong views. A threshold between the two largest confidences: only the most
    confident image u passes, so the two blends holding u count (u's own and the one whose
    partner u is) and the other two add nothing; `used` (the log's) is each image's own."""
    student, teacher = _tiny_classifier(0), _tiny_classifier(1).eval().requires_grad_(False)
    images = torch.randint(0, 256, (10, 3, 16, 16), dtype=torch.uint8)
    labelled, targets, strong, weak = images[:2], torch.tensor([0, 2]), images[2:6], images[6:]
    with torch.no_grad():
        confidence, pseudo = F.softmax(teacher(weak), -1).max(-1)
    top, second = confidence.sort(descending=True).values[:2]
    threshold = float(top + second) / 2
    forward = online_forward(student, teacher, F.cross_entropy, threshold, 1.0, mixup=True)
    out = forward(labelled, targets, strong, weak)
    mixed, target = pseudo_mixup(strong, pseudo, confidence, 3)
    counts = torch.maximum(confidence, confidence[[1, 2, 3, 0]])  # with its partner's
    assert (counts >= threshold).sum() == 2  # the case the test is about
    with torch.no_grad():
        ce = -(target * F.log_softmax(student(mixed), -1)).sum(-1)
        want = (ce * (counts >= threshold)).mean()
        labelled_ce = F.cross_entropy(student(labelled), targets)
    assert out.distill.item() == pytest.approx(want.item(), rel=1e-5)
    assert out.loss.item() == pytest.approx(labelled_ce.item() + want.item(), rel=1e-5)
    assert torch.equal(out.used, confidence >= threshold) and out.used.sum() == 1
    assert torch.equal(out.pseudo, pseudo)


def test_the_ema_teacher_gets_no_gradient_and_follows_the_student_by_the_momentum_rule():
    student = _tiny_classifier(0)
    ema = EMA(student, 0.9, copy_first=False)
    teacher = ema.module.eval()
    start = {k: v.clone() for k, v in teacher.state_dict().items()}
    assert all(torch.equal(start[k], v) for k, v in student.state_dict().items())
    forward = online_forward(student, teacher, F.cross_entropy, 0.0, 1.0)
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    images = torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8)
    out = forward(images[:2], torch.tensor([0, 2]), images[2:4], images[4:])
    with torch.no_grad():  # the loss: the teacher's argmax on the weak views, all used (0.0)
        pseudo = teacher(images[4:]).argmax(-1)
        want = F.cross_entropy(student(images[2:4]), pseudo)
    assert out.distill.item() == pytest.approx(want.item(), rel=1e-5)
    assert out.used.all() and torch.equal(out.pseudo, pseudo)
    out.loss.backward()
    opt.step()
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(start[k], v) for k, v in teacher.state_dict().items())
    ema.update(student, torch.tensor(False))  # a skipped step: the teacher stays
    assert all(torch.equal(start[k], v) for k, v in teacher.state_dict().items())
    ema.update(student, torch.tensor(True))  # t <- 0.9 t + 0.1 s, from the first step on
    now = student.state_dict()
    for k, v in teacher.state_dict().items():
        if v.is_floating_point():
            assert torch.allclose(v, 0.9 * start[k] + 0.1 * now[k], atol=1e-6), k


def test_the_online_keys_are_checked():
    def cfg(**distill):
        return from_dict(FinetuneConfig, {"data": {"train": "x"}, "distill": distill})

    assert cfg(unlabelled="u", mode="online").distill.online
    assert not cfg(unlabelled="u", teacher="t").distill.online
    with pytest.raises(ConfigError, match=r"^distill.teacher: distill.mode=online has no"):
        cfg(unlabelled="u", mode="online", teacher="t")
    with pytest.raises(ConfigError, match=r"^distill.teacher and distill.unlabelled: give both"):
        cfg(unlabelled="u")  # offline needs its teacher
    with pytest.raises(ConfigError, match=r"^distill.momentum: must be in \[0, 1\), got 1.0$"):
        cfg(unlabelled="u", mode="online", momentum=1.0)
    with pytest.raises(ConfigError, match=r"^distill.threshold: must be in \(0, 1\], got 0.0$"):
        cfg(unlabelled="u", mode="online", threshold=0.0)
    with pytest.raises(ConfigError, match=r"^distill.class_share=1.5: give 0 \(off\) to 1$"):
        cfg(unlabelled="u", mode="online", class_share=1.5)
    with pytest.raises(ConfigError, match=r"^distill.class_share and distill.class_thresholds: "):
        cfg(unlabelled="u", mode="online", class_share=0.2, class_thresholds=True)
    for key, on in {
        "mixup": True,
        "class_thresholds": True,
        "class_share": 0.2,
        "align": True,
    }.items():
        assert getattr(cfg(unlabelled="u", mode="online", **{key: on}).distill, key)
        with pytest.raises(ConfigError, match=rf"^distill.{key}: acts on pseudo-labels, which "):
            cfg(unlabelled="u", teacher="t", **{key: on})


def test_a_teacher_too_slow_for_its_run_is_named_before_and_after(
    synthetic_shards, tmp_path, caplog, capsys
):
    """A momentum whose window 1 / (1 - m) passes half of train.steps: a warning before the
    run (with the largest momentum that fits); a run whose last lap used no pseudo-label: a
    warning at its end. Both in the job's log format."""
    from ssl_vit.train.distill import _warn_slow_teacher

    for momentum, steps, warned in [
        (0.999, 100, True),
        (0.99, 500, False),
        (0.99, 200, False),
        (0.99, 199, True),
        (0.0, 1, False),  # momentum 0: the teacher is the student
        (0.5, 3, True),
    ]:
        caplog.clear()
        _warn_slow_teacher(momentum, steps)
        assert bool(caplog.records) is warned, (momentum, steps)
    caplog.clear()
    _warn_slow_teacher(0.999, 100)
    assert "~1000 steps, train.steps=100" in caplog.text and "at most 0.98 " in caplog.text
    slow = ["distill.momentum=0.999", "distill.threshold=0.99"]
    res = pipeline("finetune")(online_args(synthetic_shards, tmp_path / "slow", *slow))
    assert res["distill"]["pseudo_used"] == 0.0
    knobs = {"threshold": 0.99, "momentum": 0.999, "class_share": 0.0, "align": False}
    assert knobs.items() <= res["distill"].items()  # every online knob, beside its outcome
    err = capsys.readouterr().err
    assert (
        "WARNING ssl_vit.train.distill: distill.momentum=0.999: the teacher follows the "
        "student over ~1000 steps, train.steps=8" in err
    ), err[-3000:]
    assert (
        "WARNING finetune: distill: no unlabelled image passed distill.threshold=0.99 in "
        "the last 4 steps" in err
    ), err[-3000:]


def test_the_unlabelled_epochs_a_run_reads_are_said_before_it_and_under_one_warned(
    synthetic_shards, caplog
):
    """The online stage gains with unlabelled epochs (docs/results.md), so the check says
    how many a run reads, train.steps x train.batch_size x distill.ratio / the source's
    images, and warns an online run of under one; offline is only said."""
    from ssl_vit.train.distill import check_teacher

    caplog.set_level(logging.INFO, logger="ssl_vit.train.distill")

    def said(steps, mode="online", ratio=1):  # synthetic_shards: 96 images
        keys = {"steps": steps, "batch_size": 8}
        distill = {"mode": mode, "unlabelled": str(synthetic_shards), "ratio": ratio}
        if mode == "offline":
            distill["teacher"] = "unused"  # the check stops at the teacher, after the line
        data = {"train": str(synthetic_shards)}
        cfg = from_dict(FinetuneConfig, {"train": keys, "distill": distill, "data": data})
        caplog.clear()
        try:
            check_teacher(cfg, [], resume=False)
        except ConfigError:
            assert mode == "offline"
        return [(r.levelname, r.getMessage()) for r in caplog.records if "epoch" in r.message]

    info = "distill: %d unlabelled images a step (train.batch_size x distill.ratio) of the 96 in "
    (level, line), warned = said(6)
    assert (
        level == "INFO"
        and line.startswith(info % 8)
        and line.endswith(": 6 steps read 0.5 epochs of them")
    )
    assert warned == (
        "WARNING",
        "distill: 6 steps read 0.5 of an epoch of the unlabelled images; the online stage has "
        "gained over its control only after several (docs/results.md): raise train.steps or "
        "distill.ratio",
    )
    assert said(6, ratio=2)[0][1].endswith(": 6 steps read 1 epoch of them")  # 16 a step
    assert len(said(6, ratio=2)) == 1 and len(said(12)) == 1  # one epoch: not warned
    assert [lvl for lvl, _ in said(6, mode="offline")] == ["INFO"]


# The stage's forms: FixMatch's, with Semi-ViT's pseudo-mixup, with FlexMatch's class thresholds,
# with CBST's class shares (at threshold 1: the shares alone), with ReMixMatch's distribution
# alignment.
FORMS = {"plain": "distill.mixup=false", "mixup": "distill.mixup=true"}
FORMS["classes"] = "distill.class_thresholds=true"
FORMS["share"] = "distill.class_share=0.5 distill.threshold=1.0"
FORMS["align"] = "distill.align=true"


@pytest.mark.system
@pytest.mark.parametrize("form", FORMS)
def test_an_online_step_is_one_graph_and_never_waits_on_the_host(
    synthetic_shards, tmp_path, monkeypatch, form
):
    every = [f"train.log_every={EVERY}", f"train.checkpoint_every={EVERY}"]
    mix = FORMS[form].split()
    args = online_args(synthetic_shards, tmp_path / "sync", *every, *mix)
    args = [a for a in args if a != "train.log_every=4"] + [f"train.steps={STEPS}"]
    assert _between_log_steps(_run_counting(monkeypatch, pipeline("finetune"), args)) == []
    backend = Backend()
    monkeypatch.setattr(compile_mod, "BACKEND", backend)
    main = pipeline("finetune")
    torch.manual_seed(0)
    main(online_args(synthetic_shards, tmp_path / "c", "compile.enabled=true", *mix))
    assert backend.graphs == 1  # fullgraph=True: a graph break would have raised
    torch.manual_seed(0)
    main(online_args(synthetic_shards, tmp_path / "e", "compile.enabled=false", *mix))
    assert _losses(tmp_path / "c") == pytest.approx(_losses(tmp_path / "e"), rel=1e-4)


@pytest.mark.system
@pytest.mark.parametrize("form", FORMS)
def test_stopped_and_resumed_online_continues_exactly(
    synthetic_shards, tmp_path, monkeypatch, form
):
    """Uninterrupted with 2 workers and with 0; stopped after step 3 with 2 workers and resumed
    with 1: the same losses, pseudo-label use and final weights, bit for bit (the teacher's
    weights at the stop come back from the checkpoint: a fresh copy would score otherwise; so
    do the class thresholds' counts and the alignment's means). Pseudo-mixup keeps no state of
    its own: its pairs follow the stream's order."""
    main = pipeline("finetune")
    one = ["train.log_every=1", *FORMS[form].split()]

    def rows(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [(r["loss"], r["distill_loss"], r["pseudo_used"]) for r in map(json.loads, lines)]

    for name, workers in (("w2", "data.num_workers=2"), ("w0", "data.num_workers=0")):
        torch.manual_seed(0)
        main(online_args(synthetic_shards, tmp_path / name, workers, *one))
    assert rows(tmp_path / "w2") == rows(tmp_path / "w0")
    stop_after_step(monkeypatch, 3)
    torch.manual_seed(0)
    out = tmp_path / "stopped"
    assert main(online_args(synthetic_shards, out, "data.num_workers=2", *one))["step"] == 3
    main(online_args(synthetic_shards, out, "data.num_workers=1", *one, "--resume"))
    assert len(rows(out)) == 8 and rows(out) == rows(tmp_path / "w2")
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("w2", "stopped"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(r[2] > 0 for r in rows(out))  # some pseudo-labels were used: the test sees them
    results = json.loads((out / "results.json").read_text())["distill"]
    assert results["mode"] == "online" and results["unlabelled_images_seen"] == 8 * 32
    assert 0.0 <= results["pseudo_acc"] <= 1.0  # the shards have labels: scored, not used
    assert not (out / "teacher.json").exists()
    if form == "classes":  # per class name, as the last step left them; below the threshold
        whole = json.loads((tmp_path / "w2" / "results.json").read_text())["distill"]
        assert results["class_thresholds"] == whole["class_thresholds"]
        assert min(results["class_thresholds"].values()) < 0.11
    if form == "share":  # each class's top half, read off its histogram: they differ
        whole = json.loads((tmp_path / "w2" / "results.json").read_text())["distill"]
        assert results["class_thresholds"] == whole["class_thresholds"]
        assert len(set(results["class_thresholds"].values())) > 1
    if form == "align":  # p_L / p_U by class name, as the last step left it; it moved
        whole = json.loads((tmp_path / "w2" / "results.json").read_text())["distill"]
        assert results["align_scale"] == whole["align_scale"]
        assert len(set(results["align_scale"].values())) > 1


@pytest.mark.system
@pytest.mark.parametrize("form", FORMS)
def test_two_processes_train_online_as_one(synthetic_shards, tmp_path, form):
    """Every pseudo-label used (a threshold near 0): a confidence within float error of the
    threshold would flip an image in or out between the all-reduce's rounding and one
    process's, a difference of the discrete rule, not of the processes (the threshold itself:
    the hand-computed test and the exact resume above). With pseudo-mixup each process's 16
    unlabelled images are whole blocks of the 32: the same pairs as one process's. The class
    thresholds count both processes' pseudo-labels: the same as one process's. So do the class
    shares' histograms (their thresholds are the near-0 one here): the same mass by class, and
    the same bins but for an image within float error of a bin's edge (momentum 0.5: one image
    weighs at most 0.5)."""
    every = [*FORMS[form].split(), "distill.threshold=1e-6"]
    torch.manual_seed(0)
    pipeline("finetune")(online_args(synthetic_shards, tmp_path / "one", *every))
    cmd = [*LAUNCH, str(ROOT / "pipelines/finetune.py")]
    cmd += online_args(synthetic_shards, tmp_path / "two", "data.num_workers=1", *every)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert two == pytest.approx(one, rel=1e-4)  # the all-reduce's float error only
    norms = [
        [r["grad_norm"] for r in _rows(tmp_path / d) if "grad_norm" in r] for d in ("one", "two")
    ]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)  # each rank's count: not summed twice
    key = {"classes": "class_thresholds", "align": "align_scale"}.get(form)
    if key is not None:  # the statistics of both processes' images: as one process's
        a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
        want = a["distill"][key]
        assert b["distill"][key] == pytest.approx(want, rel=1e-6)
        assert len(set(want.values())) > 1  # the counts differ by class: a real check
    if form == "share":
        one, two = (
            torch.load(tmp_path / d / "checkpoints/step_00000008/state.pt")["class_share"]["hist"]
            for d in ("one", "two")
        )
        assert two.sum(1).tolist() == pytest.approx(one.sum(1).tolist(), rel=1e-6)
        assert (two.cumsum(1) - one.cumsum(1)).abs().max().item() <= 0.5 + 1e-6
        assert (one.sum(1) > 0).sum() > 1  # more than one class predicted: a real check


@pytest.mark.system
def test_the_online_keys_leave_the_offline_and_paper_paths_alone(synthetic_shards, tmp_path):
    """The same process: the paper's fine-tune with and without the online knobs set (no
    unlabelled source: off), offline self-training with and without them: the same losses."""
    main = pipeline("finetune")
    knobs = ["distill.threshold=0.5", "distill.momentum=0.5", "distill.strong_ops=3"]
    teacher = tmp_path / "teacher"
    main(finetune_args(synthetic_shards, teacher, "train.steps=4"))
    offline = [f"distill.teacher={teacher}", f"distill.unlabelled={synthetic_shards}"]
    losses = {}
    for name, extra in (("paper", []), ("off", offline)):
        for tag, more in ((name, []), (name + "_k", knobs)):
            torch.manual_seed(0)
            args = ["train.steps=4", "train.log_every=1", *extra, *more]
            main(finetune_args(synthetic_shards, tmp_path / tag, *args))
            losses[tag] = _losses(tmp_path / tag)
    assert losses["paper"] == losses["paper_k"] and losses["off"] == losses["off_k"]
    assert losses["off"] != losses["paper"]  # the teacher's term is there
