"""`ssl-vit report`: run directories -> report.html + report.md.

Sections: the runs, a summary table (one row per pretraining run, plus random init /
scratch), pretraining curves, few-shot accuracy vs shots, fine-tuning curves, and what the
model learned (paper Figure 7). A section with nothing to show says so.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ssl_vit.report.runs import Run, fewshot_table, link_runs, load_runs, source_checkpoint

__all__ = ["build_report"]

log = logging.getLogger(__name__)


def _pct(entry: dict | None) -> str:
    if not entry:
        return "-"
    return f"{100 * entry['mean']:.1f} ± {100 * entry.get('std', 0.0):.1f}"


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def _join(values: list[str]) -> str:
    """Several runs' values in one cell, one per line."""
    return "\n".join(values) if values else "-"


def _origin(run: Run, groups: dict) -> str:
    for owner, members in groups.items():
        for member, step in members:
            if member is run:
                if owner is None:
                    return "random init" if source_checkpoint(run) is None else "other run"
                return f"{owner} @ step {step}" if step is not None else owner
    return ""


def runs_section(runs: list[Run], groups: dict):
    from ssl_vit.report.render import Section, Table

    rows = []
    for r in runs:
        steps = r.results.get("step") if r.kind != "fewshot" else None
        rows.append([r.name, r.kind, _origin(r, groups) if r.kind != "pretrain" else "",
                     "-" if steps is None else str(steps),
                     _minutes(r.results.get("wall_time_s")),
                     "finished" if r.finished else "no results.json (running or stopped)",
                     str(r.path)])
    header = ["run", "kind", "started from", "steps", "wall time", "status", "directory"]
    return Section("Runs", tables=[Table(header, rows)])


def _summary_row(label: str, pre: Run | None, members: list, shots: list[int]) -> list[str]:
    obj = (pre.config.get("objective") or {}) if pre else {}
    fewshots = [m for m, _ in members if m.kind == "fewshot" and m.finished]
    finetunes = [m for m, _ in members if m.kind == "finetune" and m.finished]
    cells = [label, obj.get("target", "-"), f"{obj['mask_ratio']:.0%}" if obj else "-",
             str(pre.results.get("step", "-")) if pre else "0"]
    tables = [(m.config.get("pool", ""), fewshot_table(m.results)) for m in fewshots]
    if not tables and pre and pre.results.get("fewshot"):
        tables = [("in pretraining", fewshot_table(pre.results["fewshot"]))]
    many = len(tables) > 1
    for k in shots:
        cells.append(_join([_pct(t.get(k)) + (f" ({pool})" if many else "") for pool, t in tables]))
    cells.append(_join([f"{100 * m.results['top1']:.1f}" + (f" ({m.name})" if len(finetunes) > 1
                                                            else "") for m in finetunes
                        if m.results.get("top1") is not None]))
    cells.append(_minutes(pre.results.get("wall_time_s")) if pre else "-")
    cells.append(_join([_minutes(m.results.get("wall_time_s")) for m in finetunes]))
    return cells


def summary_section(runs: list[Run], groups: dict):
    from ssl_vit.report.render import Section, Table

    pretrains = [r for r in runs if r.kind == "pretrain"]
    tables = [fewshot_table(m.results) for ms in groups.values() for m, _ in ms
              if m.kind == "fewshot"]
    tables += [fewshot_table(p.results.get("fewshot") or {}) for p in pretrains]
    shots = sorted({k for t in tables for k in t})
    rows = [_summary_row(p.name, p, groups.get(p.name, []), shots) for p in pretrains]
    if groups.get(None):
        rows.append(_summary_row("random init / scratch", None, groups[None], shots))
    header = ["run", "target", "corrupted", "pretrain steps", *[f"{k}-shot (%)" for k in shots],
              "fine-tune top-1 (%)", "pretrain time", "fine-tune time"]
    notes = ["One row per pretraining run; few-shot and fine-tune runs are attached to it by "
             "the checkpoint path in their config/results. Few-shot: mean ± std over seeds at "
             "the first L2 regularizer; several values are several runs (e.g. cls / gap "
             "pooling)."]
    if not rows:
        notes.append("No runs to summarize.")
    return Section("Summary", notes=notes, tables=[Table(header, rows)] if rows else [])


def curve_sections(runs: list[Run], groups: dict):
    from ssl_vit.report import figures
    from ssl_vit.report.render import Chart, Section, png_bytes

    pre = [r for r in runs if r.kind == "pretrain"]
    s_pre = Section("Pretraining")
    if fig := figures.pretrain_curves(pre):
        s_pre.charts.append(Chart("pretrain_curves", png_bytes(fig),
                                  "Loss and colour accuracy on the corrupted patches."))
    else:
        s_pre.notes.append("No pretraining metrics in the runs given.")
    if fig := figures.fewshot_over_steps(pre):
        s_pre.charts.append(Chart("fewshot_over_steps", png_bytes(fig),
                                  "Few-shot accuracy logged during pretraining."))
    elif pre:
        s_pre.notes.append("No few-shot evaluation was logged during pretraining.")

    curves = []
    for r in runs:
        if r.kind == "fewshot" and r.finished:
            curves.append((f"{r.name} ({_origin(r, groups)}, {r.config.get('pool', 'cls')})",
                           fewshot_table(r.results)))
        elif r.kind == "pretrain" and r.results.get("fewshot") and not any(
            m.kind == "fewshot" and step == r.results.get("step")
            for m, step in groups.get(r.name, [])
        ):  # the final checkpoint's own few-shot runs replace the one logged in pretraining
            curves.append((f"{r.name} @ step {r.results.get('step')} (during pretraining)",
                           fewshot_table(r.results["fewshot"])))
    s_few = Section("Few-shot")
    if fig := figures.fewshot_vs_shots(curves):
        s_few.charts.append(Chart("fewshot_vs_shots", png_bytes(fig),
                                  "One line per encoder; band: ±1 std over seeds."))
    else:
        s_few.notes.append("No few-shot results in the runs given.")

    s_ft = Section("Fine-tuning")
    if fig := figures.finetune_curves([r for r in runs if r.kind == "finetune"]):
        s_ft.charts.append(Chart("finetune_curves", png_bytes(fig),
                                 "Training loss and test top-1 (logged at eval steps)."))
    else:
        s_ft.notes.append("No fine-tuning runs given.")
    return [s_pre, s_few, s_ft]


def build_report(
    run_dirs: list[str | Path], output: str | Path, num_examples: int = 8, seed: int = 0
) -> dict[str, Path]:
    """Write `output/report.html` and `output/report.md` (+ figures/) for the runs in
    `run_dirs`; returns their paths."""
    from ssl_vit.report.learned_section import learned_section
    from ssl_vit.report.render import write_html, write_markdown

    t0 = time.perf_counter()
    runs = load_runs(list(run_dirs))
    groups = link_runs(runs)
    log.info("report of %d runs: %s", len(runs), ", ".join(f"{r.name} ({r.kind})" for r in runs))
    sections = [summary_section(runs, groups), *curve_sections(runs, groups),
                learned_section([r for r in runs if r.kind == "pretrain"], num_examples, seed),
                runs_section(runs, groups)]
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    title = "ssl-vit report"
    intro = [f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from "
             f"{len(runs)} run directories."]
    paths = {"html": out / "report.html", "md": out / "report.md"}
    write_html(paths["html"], title, intro, sections)
    write_markdown(paths["md"], title, intro, sections)
    log.info("wrote %s and %s in %.1fs", paths["html"], paths["md"], time.perf_counter() - t0)
    return paths
