"""``smalti-launch logs RUN --goodput``: the goodput breakdown of every attempt of a run, as a table."""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from smalti.core.callbacks.goodput import CATEGORIES, LABELS, GoodputReport, read_goodput, run_goodput_files
from smalti.core.launch.errors import LaunchError


def format_report(report: GoodputReport, source: str) -> str:
    """One row per category (seconds per attempt, total, share of the wall time), then the wall time and goodput."""
    n = len(report.attempts)
    header = ["category", *(f"attempt {i}" for i in range(1, n + 1)), "total", "share"]
    per_attempt = [a.categories() for a in report.attempts]
    totals = report.totals()
    wall = report.wall
    rows = []
    for key in CATEGORIES:
        share = f"{100 * totals[key] / wall:.1f}%" if wall > 0 else "-"
        rows.append([LABELS[key], *(f"{c[key]:.2f} s" for c in per_attempt), f"{totals[key]:.2f} s", share])
    spans = [a.wall + a.idle_before for a in report.attempts]
    rows.append(["wall time", *(f"{s:.2f} s" for s in spans), f"{wall:.2f} s", "100.0%"])
    rows.append(
        ["last batch", *(str(a.batch) + ("" if a.finished else " (cut)") for a in report.attempts), "", ""]
    )
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"goodput of {source} ({n} attempt{'s' if n != 1 else ''})"]
    for row in [header, *rows]:
        lines.append(
            "  ".join(
                str(cell).ljust(w) if i == 0 else str(cell).rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
        )
    lines.append(
        f"goodput {100 * report.ratio:.1f}%: productive step time over wall time since the first start"
    )
    return "\n".join(lines)


def show_goodput(run_dir: Path, out: TextIO) -> int:
    """Print the table of every ``goodput.jsonl`` under ``run_dir`` (a sweep's points each have one)."""
    files = run_goodput_files(run_dir)
    if not files:
        raise LaunchError(f"no goodput.jsonl under {run_dir}: run with callbacks=[...,goodput] to record it")
    for i, path in enumerate(files):
        if i:
            print(file=out)
        print(format_report(read_goodput(path), str(path)), file=out)
    return 0
