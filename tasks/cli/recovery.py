"""``ckptops triage | recover | automations | incidents``: what failed, the recovery that
relaunches the job, the server automations that guard it, and the ledger of what was done."""

import json
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from tasks import render
from tasks.cli.common import (
    OWN_SAVE_DIR,
    JsonOpt,
    ProfileOpt,
    err,
    expected_errors,
    fail,
    out,
    profile_for,
    warn,
)
from tasks.errors import Interrupted, UsageError
from tasks.profile import load_profile
from tasks.recovery.triage.flight_recorder import MAX_WORLD
from tasks.recovery.triage.model import FailureClass

commands = typer.Typer()


@commands.command()
def triage(
    files: Annotated[
        list[Path] | None,
        typer.Argument(help="logs of the failed run: per-rank logs, Slurm output, kernel logs"),
    ] = None,
    exit_code: Annotated[
        int | None,
        typer.Option("--exit-code", help="the job's exit code (Megatron: 16 rerun elsewhere, 17 stop)"),
    ] = None,
    flight_recorder: Annotated[
        Path | None,
        typer.Option(
            "--flight-recorder",
            help="the ranks' PyTorch Flight Recorder dumps (PREFIX<rank>): for a hang, the ranks that "
            "never entered the collective the others wait in",
        ),
    ] = None,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size", min=1, max=MAX_WORLD, help="the job's ranks, for the dumps it should have left"
        ),
    ] = None,
    as_json: JsonOpt = False,
):
    """Find the first error of a failed run and its class: the class word first, then the suspect
    nodes and the first error. With --flight-recorder the logs may be left out: ranks waiting in a
    collective are a hang, whatever the logs say. Exit 0 when a class was found, 1 when unknown,
    2 unreadable."""
    if not files and flight_recorder is None:
        fail(UsageError("name the logs of the failed run, or --flight-recorder DIR, or both"))
    with expected_errors():
        from tasks.recovery.triage import attribute_hang
        from tasks.recovery.triage import triage as run_triage

        found = run_triage(list(files or []), exit_code=exit_code)
        if flight_recorder is not None:
            found = attribute_hang(found, flight_recorder, world_size=world_size)
            for problem in (found.flight_recorder or {}).get("problems", []):
                warn(problem)
    if as_json:
        out.print_json(json.dumps(found.to_dict()))
    else:
        out.print(found.line(), markup=False)
        for line in found.evidence[:10]:
            out.print(f"  {line.file}:{line.line}: {line.text[:200]}", markup=False)
    raise typer.Exit(1 if found.cls == FailureClass.UNKNOWN else 0)


def _ask_on_terminal(approve: bool, timeout_seconds: float):
    """The CLI's approver: --approve goes; a terminal asks, for at most the profile's approval
    timeout (the recovery holds the job's recovery lock meanwhile); no answer, an empty input
    or anything else (a pipe, cron) says no."""
    import select

    from tasks.recovery.report import plan_markdown
    from tasks.recovery.run import Decision

    def ask(plan) -> Decision:
        if approve:
            return Decision(True, "--approve on the command line")
        if not sys.stdin.isatty():
            # Nobody to ask: the plan is shown all the same, with the way to approve it.
            err.print(plan_markdown(plan), markup=False)
            err.print(
                "ckptops: no terminal to ask and no --approve: nothing relaunched; to relaunch from "
                f"checkpoint {plan.checkpoint} as planned, run the same command with --retry --approve",
                markup=False,
            )
            return Decision(
                False, "no terminal to ask and no --approve (run it again with --retry --approve)"
            )
        err.print(plan_markdown(plan), markup=False)  # stdout stays the answer (--json)
        err.print(
            f"relaunch from checkpoint {plan.checkpoint}? [yes / no / another iteration] "
            f"(no answer within {timeout_seconds:.0f}s is no): ",
            end="",
            markup=False,
        )
        ready, _, _ = select.select([sys.stdin], [], [], timeout_seconds)
        if not ready:
            return Decision(False, f"no answer on the terminal within {timeout_seconds:.0f}s")
        answer = sys.stdin.readline().strip()
        if answer.isdigit():
            return Decision(True, "operator on the terminal", int(answer))
        return Decision(answer.lower() in ("y", "yes"), "operator on the terminal")

    return ask


@commands.command()
def recover(
    slurm_job: Annotated[str | None, typer.Option("--slurm-job", help="the failed Slurm job's id")] = None,
    logs: Annotated[list[Path] | None, typer.Option("--logs", help="log files of the failed run")] = None,
    exit_code: Annotated[int | None, typer.Option("--exit-code", help="the job's exit code")] = None,
    approve: Annotated[
        bool, typer.Option("--approve", help="relaunch without asking (stop rules still apply)")
    ] = False,
    retry: Annotated[
        bool,
        typer.Option("--retry", help="recover a failure again whose earlier recovery relaunched nothing"),
    ] = False,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Recover a failed job: triage, stop rules, checkpoint, node health and drains, approval,
    relaunch, validation; the incident goes to the ledger. Exit 0 recovered, 1 stopped or aborted,
    3 another recovery has this failure in hand or has handled it (nothing relaunched), 128+N
    ended by signal N (the incident says what was done)."""
    if not slurm_job and not logs:
        fail(UsageError("name what failed: --slurm-job ID or --logs FILE..."))
    with expected_errors():
        from tasks.recovery.ledger import IncidentOutcome
        from tasks.recovery.run import Source
        from tasks.recovery.run import recover as run_recovery

        prof = load_profile(profile)
        timeout = prof.recovery.approval_timeout_seconds if prof.recovery else 0

        def step(name, fn, *args, **kwargs):
            err.print(f"{name} ...", markup=False)
            return fn(*args, **kwargs)

        try:
            incident = run_recovery(
                prof,
                Source(slurm_job, list(logs or []), exit_code),
                "cli",
                _ask_on_terminal(approve, timeout),
                step,
                warn=warn,
                retry=retry,
            )
        except (Interrupted, KeyboardInterrupt) as e:
            signum = getattr(e, "signum", signal.SIGINT)
            ended = getattr(e, "incident", None)
            if ended is not None:
                _print_incident(ended, as_json)
            else:
                err.print(f"ckptops: interrupted by {signal.Signals(signum).name}", markup=False)
            raise typer.Exit(128 + signum) from None
    _print_incident(incident, as_json)
    raise typer.Exit(0 if incident.outcome == IncidentOutcome.COMPLETED else 1)


def _print_incident(incident, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps(incident.to_dict()))
    else:
        out.print(f"{incident.outcome} {incident.id} {incident.cls}: {incident.reason}", markup=False)


@commands.command()
def automations(
    deployment: Annotated[
        str | None,
        typer.Option("--deployment", help="the automatic recovery deployment: FLOW/DEPLOYMENT"),
    ] = None,
    profile: ProfileOpt = None,
):
    """Install the job's automations on the Prefect server: the watchdog (crash a run whose worker
    died, RUNNING without heartbeats or PENDING past prefect.submission_timeout_seconds, so its
    deployment's slot is given back), with notify.block the promotion alarm (a save not promoted
    within verify.alert_after_seconds), and with --deployment the recovery's failure-storm guard and
    approval notice."""
    with expected_errors():
        from tasks.watchdog import install

        made = install(load_profile(profile), deployment)
    for automation in made:
        out.print(f"{automation.name}: {automation.description} ({automation.id})", markup=False)


@commands.command()
def incidents(
    save_dir: Annotated[Path | None, typer.Argument(help=OWN_SAVE_DIR)] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="also write the phase timeline as a PNG here")
    ] = None,
):
    """The job's incident ledger: every recovery, its class, nodes, checkpoint and outcome."""
    with expected_errors():
        from tasks.recovery.ledger import read_ledger
        from tasks.recovery.report import incident_rows, timeline_png
        from tasks.storage.local import write_output

        prof = profile_for(profile, save_dir)
        read = read_ledger(prof.job.save_dir)
        for problem in read.problems:
            warn(problem)
        found = [i for i in read.incidents if i.job == prof.job.name]
        if plot is not None and found:
            write_output(plot, timeline_png(found))
    if as_json:
        out.print_json(json.dumps([i.to_dict() for i in found]))
        return
    if not found:
        out.print("no incidents recorded", markup=False)
        return
    render.incidents(out, prof.job.name, incident_rows(found))
