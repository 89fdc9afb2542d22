"""`ssl-vit report`: run directories -> report.html + report.md.

Sections: the runs, a summary table (one row per pretraining run, plus random init /
scratch), pretraining curves, few-shot accuracy vs shots, fine-tuning curves, fine-tune
accuracy vs labels per class (only when a fine-tune had a label budget), and what the model
learned (paper Figure 7). A section with nothing to show says so.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ssl_vit.report.runs import Run, fewshot_pool, fewshot_table, link_runs, load_runs

__all__ = ["build_report"]

log = logging.getLogger(__name__)


def curve_sections(runs: list[Run], groups: dict):
    from ssl_vit.report import figures
    from ssl_vit.report.render import Chart, Section, png_bytes
    from ssl_vit.report.tables import origin

    pre = [r for r in runs if r.kind == "pretrain"]
    s_pre = Section("Pretraining")
    if fig := figures.pretrain_curves(pre):
        s_pre.charts.append(
            Chart(
                "pretrain_curves",
                png_bytes(fig),
                "Loss and colour accuracy on the corrupted patches.",
            )
        )
    else:
        s_pre.notes.append("No pretraining metrics in the runs given.")
    if fig := figures.fewshot_over_steps(pre):
        s_pre.charts.append(
            Chart(
                "fewshot_over_steps", png_bytes(fig), "Few-shot accuracy logged during pretraining."
            )
        )
    elif pre:
        s_pre.notes.append("No few-shot evaluation was logged during pretraining.")

    curves = []
    for r in runs:
        if r.kind == "fewshot" and r.finished:
            curves.append(
                (
                    f"{r.name} ({origin(r, groups)}, {fewshot_pool(r.config)})",
                    fewshot_table(r.results),
                )
            )
        elif (
            r.kind == "pretrain"
            and r.results.get("fewshot")
            and not any(
                m.kind == "fewshot" and step == r.results.get("step")
                for m, step in groups.get(r.name, [])
            )
        ):  # the final checkpoint's own few-shot runs replace the one logged in pretraining
            curves.append(
                (
                    f"{r.name} @ step {r.results.get('step')} (during pretraining)",
                    fewshot_table(r.results["fewshot"]),
                )
            )
    s_few = Section("Few-shot")
    if fig := figures.fewshot_vs_shots(curves):
        s_few.charts.append(
            Chart(
                "fewshot_vs_shots", png_bytes(fig), "One line per encoder; band: ±1 std over seeds."
            )
        )
    else:
        s_few.notes.append("No few-shot results in the runs given.")
    layer_curves = [
        (
            r.name if len(origin(r, groups)) > 24 else f"{r.name} ({origin(r, groups)})",
            r.results["layers"],
        )
        for r in runs
        if r.kind == "fewshot" and r.finished and r.results.get("layers")
    ]
    if fig := figures.fewshot_vs_layer(layer_curves):
        s_few.charts.append(
            Chart(
                "fewshot_vs_layer",
                png_bytes(fig),
                "Few-shot accuracy of each block's output (few-shot runs with `layers=all`).",
            )
        )

    s_ft = Section("Fine-tuning")
    if fig := figures.finetune_curves([r for r in runs if r.kind == "finetune"]):
        s_ft.charts.append(
            Chart(
                "finetune_curves",
                png_bytes(fig),
                "Training loss and test top-1 (logged at eval steps).",
            )
        )
    else:
        s_ft.notes.append("No fine-tuning runs given.")
    return [s_pre, s_few, s_ft]


def build_report(
    run_dirs: list[str | Path], output: str | Path, num_examples: int = 8, seed: int = 0
) -> dict[str, Path]:
    """Write `output/report.html` and `output/report.md` (+ figures/) for the runs in
    `run_dirs`; returns their paths."""
    from ssl_vit.report.budget import budget_section
    from ssl_vit.report.learned_section import learned_section
    from ssl_vit.report.render import write_html, write_markdown
    from ssl_vit.report.tables import runs_section, summary_section

    t0 = time.perf_counter()
    runs = load_runs(list(run_dirs))
    groups = link_runs(runs)
    log.info("report of %d runs: %s", len(runs), ", ".join(f"{r.name} ({r.kind})" for r in runs))
    sections = [summary_section(runs, groups), *curve_sections(runs, groups)]
    if (budget := budget_section(runs)) is not None:  # fine-tunes with a label budget only
        sections.append(budget)
    sections += [
        learned_section([r for r in runs if r.kind == "pretrain"], num_examples, seed),
        runs_section(runs, groups),
    ]
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
