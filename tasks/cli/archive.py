"""``ckptops archive | drill | drills``: the archive copy of the promoted checkpoint, and the
restore drills that prove a checkpoint can be brought back (and how fast)."""

import json
from pathlib import Path
from typing import Annotated

import typer

from tasks import render
from tasks.cli.common import (
    OWN_SAVE_DIR,
    JsonOpt,
    ProfileOpt,
    byte_progress,
    expected_errors,
    out,
    profile_for,
)

commands = typer.Typer()


@commands.command()
def archive(
    save_dir: Annotated[Path | None, typer.Argument(help=OWN_SAVE_DIR)] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="copy even if the newest archive copy is younger than the period, and replace the "
            "promoted iteration's archived entry if its manifest cannot be read or trusted",
        ),
    ] = False,
    profile: ProfileOpt = None,
):
    """Copy the promoted checkpoint to the archive: upload, check, commit, retention."""
    with expected_errors():
        from tasks.archive.copy import archive_checkpoint, progress_total

        prof = profile_for(profile, save_dir)
        with byte_progress("archive", progress_total(prof.job.save_dir, prof.archive), True) as progress:
            result = archive_checkpoint(prof.job.save_dir, prof, force, progress)
    out.print(f"iteration {result.iteration} -> {result.location}: {result.message}", markup=False)
    if result.committed:
        out.print(
            f"uploaded {result.uploaded_bytes / 1e6:.1f} MB, reused {result.reused_bytes / 1e6:.1f} MB, "
            f"checked and committed in {result.seconds:.2f}s; archive retention deleted: "
            f"{', '.join(map(str, result.deleted)) or 'nothing'}",
            markup=False,
        )
        for line in result.kept:
            out.print(line, markup=False)


@commands.command()
def drill(
    save_dir: Annotated[Path | None, typer.Argument(help=OWN_SAVE_DIR)] = None,
    source: Annotated[str, typer.Option("--source", "-s", help="shared or archive")] = "shared",
    continue_steps: Annotated[
        int | None,
        typer.Option(
            "--continue",
            min=0,
            help="then train K iterations from the copy and compare with the original run's log "
            "(default: the profile's drill.continuation.steps)",
        ),
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Restore, verify and load a checkpoint for real; exit 0 if it passed within budget, 1 if not."""
    with expected_errors():
        from tasks.restore.drill import run_drill

        prof = profile_for(profile, save_dir)
        report = run_drill(prof, source, continue_steps=continue_steps)
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
    else:
        out.print(report.line(), markup=False)
        for check in report.checks:
            out.print(f"  {check.outcome:<9} {check.name}: {check.detail}", markup=False)
        for line in report.left:
            out.print(f"  left alone in the scratch dir: {line}", markup=False)
    raise typer.Exit(0 if report.ok else 1)


@commands.command()
def drills(
    save_dir: Annotated[Path | None, typer.Argument(help=OWN_SAVE_DIR)] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="also write the trend as a PNG here")] = None,
):
    """Drill history: restore window per drill and source, and the estimate at production size."""
    with expected_errors():
        from tasks.restore.history import history, trend_png, trend_rows
        from tasks.storage.local import write_output

        prof = profile_for(profile, save_dir)
        found = history(prof)
        if plot is not None and found.drills:
            write_output(plot, trend_png(found.drills))
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "drills": found.drills,
                    "estimate_for_bytes": found.size_bytes,
                    "estimate_seconds": {s: e.seconds for s, e in found.predicted.items()},
                }
            )
        )
        return
    rows = trend_rows(found.drills)
    if not rows:
        out.print("no drills recorded yet", markup=False)
        return
    render.drills(out, prof.job.name, rows)
    for line in found.estimate_lines():
        out.print(line, markup=False)
