"""`ssl-vit report`: run directories -> report.html + report.md.

Sections: the runs, a summary table (one row per pretraining run, plus random init /
scratch), pretraining curves, few-shot accuracy vs shots, fine-tuning curves and final top-1
by encoder and label budget, fine-tune accuracy vs labels per class (only when a fine-tune had
a label budget), per-class accuracy and confusion matrices (fine-tunes and predict output
directories that have them), and what the model learned (paper Figure 7). A section with
nothing to show says so; a report of predict directories only has their section and the runs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ssl_vit.jobs import FEWSHOT, PREDICT, PRETRAIN
from ssl_vit.report.finetune_section import budget_section, finetune_section
from ssl_vit.report.render import Section, write_html, write_markdown
from ssl_vit.report.runs import Run, fewshot_pool, fewshot_table, link_runs, load_runs
from ssl_vit.report.tables import origin, runs_section, summary_section

__all__ = ["build_report"]

log = logging.getLogger(__name__)


def pretrain_section(runs: list[Run]) -> Section:
    from ssl_vit.report import figures

    pre = [r for r in runs if r.job is PRETRAIN]
    s_pre = Section("Pretraining")
    if fig := figures.pretrain_curves(pre):
        s_pre.chart("pretrain_curves", fig, "Loss and colour accuracy on the corrupted patches.")
    else:
        s_pre.notes.append("No pretraining metrics in the runs given.")
    if fig := figures.fewshot_over_steps(pre):
        s_pre.chart("fewshot_over_steps", fig, "Few-shot accuracy logged during pretraining.")
    elif pre:
        s_pre.notes.append("No few-shot evaluation was logged during pretraining.")
    return s_pre


def _shots_curves(runs: list[Run], groups: dict) -> list[tuple[str, dict]]:
    """(label, few-shot table) of the few-shot runs and of the few-shot evaluations logged in
    pretraining whose final checkpoint has no few-shot run of its own."""
    curves = []
    for r in runs:
        if r.job is FEWSHOT and r.finished:
            label = f"{r.name} ({origin(r, groups)}, {fewshot_pool(r.config)})"
            curves.append((label, fewshot_table(r.results)))
        elif (
            r.job is PRETRAIN
            and r.results.get("fewshot")
            and not any(
                m.job is FEWSHOT and step == r.results.get("step")
                for m, step in groups.get(r.name, [])
            )
        ):  # the final checkpoint's own few-shot runs replace the one logged in pretraining
            label = f"{r.name} @ step {r.results.get('step')} (during pretraining)"
            curves.append((label, fewshot_table(r.results["fewshot"])))
    return curves


def fewshot_section(runs: list[Run], groups: dict) -> Section:
    from ssl_vit.report import figures

    s_few = Section("Few-shot")
    if fig := figures.fewshot_vs_shots(_shots_curves(runs, groups)):
        s_few.chart("fewshot_vs_shots", fig, "One line per encoder; band: ±1 std over seeds.")
    else:
        s_few.notes.append("No few-shot results in the runs given.")
    layer_curves = [
        (
            r.name if len(origin(r, groups)) > 24 else f"{r.name} ({origin(r, groups)})",
            r.results["layers"],
        )
        for r in runs
        if r.job is FEWSHOT and r.finished and r.results.get("layers")
    ]
    if fig := figures.fewshot_vs_layer(layer_curves):
        caption = "Few-shot accuracy of each block's output (few-shot runs with `layers=all`)."
        s_few.chart("fewshot_vs_layer", fig, caption)
    return s_few


def _sections(runs: list[Run], num_examples: int, seed: int) -> list[Section]:
    from ssl_vit.report.classifier_section import classifier_section

    groups = link_runs(runs)
    classifier = classifier_section(runs)
    if all(r.job is PREDICT for r in runs):  # nothing trained: no empty sections
        return [s for s in (classifier, runs_section(runs, groups)) if s is not None]
    from ssl_vit.report.learned_section import learned_section  # imports torch: ~0.7 GB RSS

    sections = [summary_section(runs, groups), pretrain_section(runs)]
    sections += [fewshot_section(runs, groups), finetune_section(runs)]
    sections += [s for s in (budget_section(runs), classifier) if s is not None]
    sections.append(learned_section([r for r in runs if r.job is PRETRAIN], num_examples, seed))
    return [*sections, runs_section(runs, groups)]


def build_report(
    run_dirs: list[str | Path], output: str | Path, num_examples: int = 8, seed: int = 0
) -> dict[str, Path]:
    """Write `output/report.html` and `output/report.md` (+ figures/) for the runs in
    `run_dirs`; returns their paths."""
    t0 = time.perf_counter()
    runs = load_runs(list(run_dirs))
    log.info(
        "report of %d runs: %s", len(runs), ", ".join(f"{r.name} ({r.job.name})" for r in runs)
    )
    sections = _sections(runs, num_examples, seed)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    title = "ssl-vit report"
    intro = [
        f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from "
        f"{len(runs)} run directories."
    ]
    paths = {"html": out / "report.html", "md": out / "report.md"}
    write_html(paths["html"], title, intro, sections)
    write_markdown(paths["md"], title, intro, sections)
    log.info("wrote %s and %s in %.1fs", paths["html"], paths["md"], time.perf_counter() - t0)
    return paths
