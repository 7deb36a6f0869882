"""``ckptops``: the command line for humans and scripts. It calls the same task code as the flows.

Exit codes: 0 success (for ``verify``: valid), 1 the thing checked is not good (invalid, in
progress, a failed step), 2 bad usage or unreadable input. An expected failure prints one line
naming the file and the check, never a traceback.
"""

import json
import os
import signal
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from tasks import render
from tasks.errors import CkptopsError, Interrupted, Malformed, UsageError, unreadable
from tasks.profile import Profile, load_profile
from tasks.storage.local import open_regular

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Verify, promote and keep training checkpoints you can trust.",
)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

ProfileOpt = Annotated[
    str | None,
    typer.Option("--profile", "-p", help="profile name in profiles/ or a YAML path [default: local]"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the result as JSON")]
# Promotion, status and retention work on any save directory (another job's is judged with the
# profile's verify and retention settings, none of its job's: name, layout, integrity.json);
# archive and drills carry one job's settings (bucket, budget, layout) and refuse another's.
ANY_SAVE_DIR = (
    "a save directory (default: the profile's); another job's is judged by the profile's verify and "
    "retention settings, not its job settings"
)
OWN_SAVE_DIR = "the profile's own save directory (the default); any other is refused"
# Real DCGM and nccl-tests outputs are kilobytes; a file far larger is not one (and would cost
# gigabytes to parse).
MAX_TOOL_OUTPUT = 64 << 20


def _warn(line: str) -> None:
    err.print(f"ckptops: warning: {line}", markup=False)


def _fail(error: CkptopsError) -> None:
    err.print(f"ckptops: {error}", markup=False)
    raise typer.Exit(error.exit_code)


@contextmanager
def _expected_errors():
    import httpx

    try:
        yield
    except CkptopsError as e:
        _fail(e)
    except httpx.HTTPStatusError as e:  # from the Prefect server (Prefect's own errors subclass it)
        if e.response.status_code != 401:
            raise
        _fail(
            UsageError(
                f"PREFECT_API_AUTH_STRING: the Prefect server at {e.request.url.scheme}://{e.request.url.host}:"
                f"{e.request.url.port} refused the credentials (401)"
            )
        )
    except httpx.ConnectError as e:
        _fail(UsageError(f"PREFECT_API_URL: no Prefect server answers ({e})"))
    except OSError as e:
        # Whatever the environment refused (a read-only directory, a full disk, EIO) is not a
        # verdict on a checkpoint: name the path and exit 2, like any unreadable input.
        _fail(unreadable(e.filename or "ckptops", e))


@contextmanager
def _byte_progress(description: str, total: int, enabled: bool):
    """A progress bar on stderr for long reads; nothing when piped or asked for JSON."""
    if not enabled or not err.is_terminal:
        yield None
        return
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def _shard_lines(statuses, events: list[str]) -> None:
    """The Slurm engine's news, one line each on stderr (with --json too: stdout stays JSON): a
    shard done (where, how fast), failed, or retried elsewhere."""
    for line in events:
        err.print(line, markup=False, highlight=False)


def _dir_bytes(path: Path) -> int:
    from tasks.storage.local import list_files

    return sum(st.st_size for st in list_files(path).values())


def _save_dir(profile: Profile, given: Path | None) -> Path:
    return (given or profile.job.save_dir).resolve()


def _options(profile: Profile, save_dir: Path, **overrides):
    from tasks.checkpoint.state import VerifyOptions

    return VerifyOptions.from_profile(profile, save_dir, **overrides)


@app.command()
def verify(
    path: Annotated[Path, typer.Argument(help="a checkpoint directory, iter_NNNNNNN")],
    as_json: JsonOpt = False,
    profile: ProfileOpt = None,
    read_only: Annotated[bool, typer.Option("--read-only", help="do not write manifest.json")] = False,
    engine: Annotated[
        str | None,
        typer.Option("--engine", help="local: read here; slurm: shards over nodes (default: the profile's)"),
    ] = None,
    nodes: Annotated[
        int | None, typer.Option("--nodes", min=1, help="nodes for the slurm engine (default: the profile's)")
    ] = None,
):
    """Verify one checkpoint: exit 0 valid, 1 invalid or still in progress, 2 unreadable input."""
    with _expected_errors():
        from tasks.checkpoint.lock import job_lock
        from tasks.checkpoint.verify import checkpoint_path, verify_checkpoint

        prof = load_profile(profile)
        if engine not in (None, "local", "slurm"):
            raise UsageError(f"--engine {engine}: not local or slurm")
        directory = checkpoint_path(path)
        slurm = prof.verify.slurm
        options = _options(
            prof,
            directory.parent,
            write_manifest=not read_only,
            engine=engine or prof.verify.engine,
            slurm=slurm.model_copy(update={"nodes": nodes}) if nodes else slurm,
        )
        # Writing the manifest takes the job lock: a promotion re-reads manifests under it, and
        # retention may be removing this very directory.
        lock = nullcontext() if read_only else job_lock(directory.parent, prof.verify.lock_timeout_seconds)
        with lock, _byte_progress(f"verify {path.name}", _dir_bytes(directory), not as_json) as progress:
            result = verify_checkpoint(directory, options, progress, watch=_shard_lines)
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "directory": str(result.directory),
                    "iteration": result.iteration,
                    "state": result.state.value,
                    "reason": result.reason,
                    "bytes_read": result.bytes_read,
                    "seconds": round(result.seconds, 3),
                    "checks": [asdict(c) for c in result.checks],
                    "shards": result.shards,
                }
            )
        )
    else:
        stats = (
            f" ({result.bytes_read / 1e6:.1f} MB in {result.seconds:.2f}s, {result.throughput_gbps:.2f} GB/s)"
        )
        out.print(result.line() + (stats if result.ok else ""), markup=False)
    raise typer.Exit(0 if result.ok else 1)


@app.command()
def promote(
    save_dir: Annotated[Path | None, typer.Argument(help=ANY_SAVE_DIR)] = None,
    iteration: Annotated[
        int | None,
        typer.Option(
            "--iteration", "-i", min=0, help="promote this iteration (verified valid) instead of the newest"
        ),
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Verify new complete checkpoints, oldest first, and point to the newest that passed (or to N)."""
    with _expected_errors():
        from tasks.checkpoint.promote import promote as run_promote

        prof = load_profile(profile)
        directory = _save_dir(prof, save_dir)
        options = _options(prof, directory)

        def report(result):
            if not as_json:
                out.print(result.line(), markup=False)

        report_ = run_promote(
            directory, options, prof.verify.lock_timeout_seconds, iteration, on_verified=report
        )
    if as_json:
        out.print_json(
            json.dumps(
                {
                    "previous": report_.previous,
                    "current": report_.current,
                    "changed": report_.changed,
                    "message": report_.message,
                    "verified": [
                        {"iteration": v.iteration, "state": v.state.value, "reason": v.reason}
                        for v in report_.verifications
                    ],
                }
            )
        )
    else:
        arrow = (
            f"{report_.previous} -> {report_.current}" if report_.changed else f"stays at {report_.current}"
        )
        out.print(f"latest verified: {arrow} ({report_.message})", markup=False)
    if report_.cleared:
        err.print(f"ckptops: {directory}: pointer removed, no valid checkpoint to resume from", markup=False)
    raise typer.Exit(0 if report_.ok else 1)


@app.command()
def status(
    save_dir: Annotated[Path | None, typer.Argument(help=ANY_SAVE_DIR)] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Every checkpoint with its state, size, verification time and promotion; and an ALERT line
    (exit 1) when the newest complete checkpoint has waited past verify.alert_after_seconds
    without being promoted."""
    with _expected_errors():
        from tasks.checkpoint.catalog import catalog
        from tasks.checkpoint.overdue import overdue
        from tasks.checkpoint.pointer import read_pointer

        prof = load_profile(profile)
        directory = _save_dir(prof, save_dir)
        # A garbled pointer must not hide the checkpoints: list them, and say what is wrong.
        try:
            pointer, problem = read_pointer(directory), None
        except Malformed as e:
            pointer, problem = None, str(e)
        infos = catalog(directory, _options(prof, directory), pointer=pointer)
        own = directory.resolve() == prof.job.save_dir.resolve()
        late = overdue(directory, infos, prof.verify.alert_after_seconds if own else None)
    if as_json:
        out.print_json(json.dumps([i.to_dict() for i in infos]))
    else:
        render.status(out, directory, infos, problem)
    if late is not None:
        (err if as_json else out).print(late.line(), markup=False)
    if prof.drill and not as_json:
        from tasks.restore.scratch import stale_scratch

        for path, why in stale_scratch(prof.drill.scratch_dir):
            out.print(f"stale drill scratch: {path} ({why}); the next drill removes it", markup=False)
    problems = [problem] * bool(problem) + [i.manifest_error for i in infos if i.manifest_error]
    for line in problems:
        err.print(f"ckptops: {line}", markup=False)
    if problems:
        raise typer.Exit(Malformed.exit_code)
    if late is not None:
        raise typer.Exit(1)


@app.command()
def retain(
    save_dir: Annotated[Path | None, typer.Argument(help=ANY_SAVE_DIR)] = None,
    keep: Annotated[
        int | None, typer.Option("--keep", help="verified checkpoints to keep [default: the profile's]")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="show the plan, delete nothing")] = False,
    profile: ProfileOpt = None,
):
    """Delete verified checkpoints older than the newest K (never the promoted, newer or pinned)."""
    with _expected_errors():
        from tasks.checkpoint.retention import retain as run_retain

        prof = load_profile(profile)
        directory = _save_dir(prof, save_dir)
        keep_verified = keep if keep is not None else prof.retention.keep_verified
        if keep_verified < 2:
            raise UsageError("--keep: at least 2 (the newest may still be in use)")
        plan, deleted = run_retain(
            directory, _options(prof, directory), keep_verified, prof.verify.lock_timeout_seconds, dry_run
        )
    verb = "would delete" if dry_run else "deleted"
    targets = plan.delete if dry_run else deleted
    out.print(f"{verb}: {', '.join(map(str, targets)) or 'nothing'}", markup=False)
    for iteration, why in sorted(plan.kept.items()):
        out.print(f"kept {iteration}: {why}", markup=False)
    if plan.failed:
        err.print(f"ckptops: failed checkpoints kept for inspection: {', '.join(map(str, plan.failed))}")


@app.command()
def pin(
    iteration: Annotated[int, typer.Argument(min=0)],
    reason: Annotated[str, typer.Option("--reason", help="why it must be kept")],
    save_dir: Annotated[Path | None, typer.Option("--save-dir")] = None,
    holder: Annotated[str, typer.Option("--holder")] = "operator",
    profile: ProfileOpt = None,
):
    """Keep a checkpoint whatever retention says."""
    with _expected_errors():
        from tasks.checkpoint.layout import iter_dir_name
        from tasks.checkpoint.pins import pin as do_pin

        directory = _save_dir(load_profile(profile), save_dir)
        if directory.is_dir() and not (directory / iter_dir_name(iteration)).is_dir():
            raise UsageError(f"{directory / iter_dir_name(iteration)}: no such checkpoint to pin")
        path = do_pin(directory, iteration, holder, reason)
    out.print(f"pinned {iteration} ({path.name})", markup=False)


@app.command()
def unpin(
    iteration: Annotated[int, typer.Argument()],
    save_dir: Annotated[Path | None, typer.Option("--save-dir")] = None,
    holder: Annotated[str, typer.Option("--holder")] = "operator",
    profile: ProfileOpt = None,
):
    """Remove a pin."""
    with _expected_errors():
        from tasks.checkpoint.pins import unpin as do_unpin

        removed = do_unpin(_save_dir(load_profile(profile), save_dir), iteration, holder)
    out.print(f"{'unpinned' if removed else 'was not pinned by ' + holder}: {iteration}", markup=False)
    raise typer.Exit(0 if removed else 1)


def _profile_for(profile: str | None, save_dir: Path | None) -> Profile:
    """The profile, checked to describe ``save_dir`` when one is given: archive and drill
    settings belong to one job, and must not be applied to another job's directory."""
    prof = load_profile(profile)
    if save_dir is not None and save_dir.resolve() != prof.job.save_dir.resolve():
        raise UsageError(f"{save_dir}: not the save directory of profile {prof.source} ({prof.job.save_dir})")
    return prof


@app.command()
def archive(
    save_dir: Annotated[Path | None, typer.Argument(help=OWN_SAVE_DIR)] = None,
    force: Annotated[
        bool, typer.Option("--force", help="copy even if the newest archive copy is younger than the period")
    ] = False,
    profile: ProfileOpt = None,
):
    """Copy the promoted checkpoint to the archive: upload, read back, commit, retention."""
    with _expected_errors():
        from tasks.archive.copy import archive_checkpoint
        from tasks.checkpoint.layout import iter_dir_name
        from tasks.checkpoint.pointer import read_pointer

        prof = _profile_for(profile, save_dir)
        promoted = read_pointer(prof.job.save_dir)
        total = _dir_bytes(prof.job.save_dir / iter_dir_name(promoted)) if promoted is not None else 0
        with _byte_progress("archive", 2 * total, True) as progress:  # upload, then read back
            result = archive_checkpoint(prof.job.save_dir, prof, force, progress)
    out.print(f"iteration {result.iteration} -> {result.location}: {result.message}", markup=False)
    if result.committed:
        out.print(
            f"uploaded {result.uploaded_bytes / 1e6:.1f} MB, reused {result.reused_bytes / 1e6:.1f} MB, "
            f"read back and committed in {result.seconds:.2f}s; archive retention deleted: "
            f"{', '.join(map(str, result.deleted)) or 'nothing'}",
            markup=False,
        )


@app.command()
def drill(
    save_dir: Annotated[Path | None, typer.Argument(help=OWN_SAVE_DIR)] = None,
    source: Annotated[str, typer.Option("--source", "-s", help="shared or archive")] = "shared",
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Restore, verify and load a checkpoint for real; exit 0 if it passed within budget, 1 if not."""
    with _expected_errors():
        from tasks.restore.drill import run_drill

        prof = _profile_for(profile, save_dir)
        report = run_drill(prof, source)
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
    else:
        out.print(report.line(), markup=False)
        for check in report.checks:
            out.print(f"  {check.outcome:<9} {check.name}: {check.detail}", markup=False)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def drills(
    save_dir: Annotated[Path | None, typer.Argument(help=OWN_SAVE_DIR)] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="also write the trend as a PNG here")] = None,
):
    """Drill history: restore window per drill and source, and the estimate at production size."""
    with _expected_errors():
        from tasks.restore.history import history, trend_png, trend_rows

        prof = _profile_for(profile, save_dir)
        found = history(prof)
        if plot is not None and found.drills:
            plot.write_bytes(trend_png(found.drills))
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


@app.command("validate-resume")
def validate_resume_command(
    after: Annotated[
        Path, typer.Option("--after", help="step records or Megatron-LM log of the resumed run")
    ],
    before: Annotated[
        Path | None,
        typer.Option(
            "--before", help="records or log of the run before the failure [default: the stored baseline]"
        ),
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="the checkpoint the run resumed from (iter_NNNNNNN) [default: the promoted one]",
        ),
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Check a resumed run against the run before the failure: exit 0 validated, 1 rejected."""
    with _expected_errors():
        from tasks.resume.validate import validate

        result = validate(load_profile(profile), after, before, checkpoint)
    if as_json:
        out.print_json(json.dumps(result.to_dict()))
    else:
        out.print(result.line(), markup=False)
        for check in result.checks:
            text = f"expected {check.expected}; observed {check.observed}" if check.expected else check.detail
            out.print(f"  {check.outcome:<9} {check.name}: {text}", markup=False)
    raise typer.Exit(0 if result.ok else 1)


@app.command()
def triage(
    files: Annotated[
        list[Path], typer.Argument(help="logs of the failed run: per-rank logs, Slurm output, kernel logs")
    ],
    exit_code: Annotated[
        int | None,
        typer.Option("--exit-code", help="the job's exit code (Megatron: 16 rerun elsewhere, 17 stop)"),
    ] = None,
    as_json: JsonOpt = False,
):
    """Find the first error of a failed run and its class: the class word first, then the suspect
    nodes and the first error. Exit 0 when a class was found, 1 when unknown, 2 unreadable."""
    with _expected_errors():
        from tasks.recovery.triage import triage as run_triage

        found = run_triage(files, exit_code=exit_code)
    if as_json:
        out.print_json(json.dumps(found.to_dict()))
    else:
        out.print(found.line(), markup=False)
        for line in found.evidence[:10]:
            out.print(f"  {line.file}:{line.line}: {line.text[:200]}", markup=False)
    raise typer.Exit(1 if found.cls == "unknown" else 0)


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
            return Decision(False, "no terminal to ask and no --approve")
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


@app.command()
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
        _fail(UsageError("name what failed: --slurm-job ID or --logs FILE..."))
    with _expected_errors():
        from tasks.recovery.ledger import COMPLETED
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
                warn=_warn,
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
    raise typer.Exit(0 if incident.outcome == COMPLETED else 1)


def _print_incident(incident, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps(incident.to_dict()))
    else:
        out.print(f"{incident.outcome} {incident.id} {incident.cls}: {incident.reason}", markup=False)


@app.command()
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
    with _expected_errors():
        from tasks.watchdog import install

        made = install(load_profile(profile), deployment)
    for automation in made:
        out.print(f"{automation.name}: {automation.description} ({automation.id})", markup=False)


@app.command()
def incidents(
    save_dir: Annotated[Path | None, typer.Argument(help=OWN_SAVE_DIR)] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="also write the phase timeline as a PNG here")
    ] = None,
):
    """The job's incident ledger: every recovery, its class, nodes, checkpoint and outcome."""
    with _expected_errors():
        from tasks.recovery.ledger import read_ledger
        from tasks.recovery.report import incident_rows, timeline_png

        prof = _profile_for(profile, save_dir)
        read = read_ledger(prof.job.save_dir)
        for problem in read.problems:
            _warn(problem)
        found = [i for i in read.incidents if i.job == prof.job.name]
        if plot is not None and found:
            plot.write_bytes(timeline_png(found))
    if as_json:
        out.print_json(json.dumps([i.to_dict() for i in found]))
        return
    if not found:
        out.print("no incidents recorded", markup=False)
        return
    render.incidents(out, prof.job.name, incident_rows(found))


goodput_app = typer.Typer(help="Effective training time and checkpoint-interval advice.")
app.add_typer(goodput_app, name="goodput")


def _since(value: str | None) -> float | None:
    if value is None:
        return None
    from datetime import UTC, datetime

    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise UsageError(f"--since {value!r}: not a date (YYYY-MM-DD or an ISO time)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


@goodput_app.callback(invoke_without_command=True)
def goodput(
    ctx: typer.Context,
    since: Annotated[str | None, typer.Option("--since", help="from this date or time (UTC)")] = None,
    log: Annotated[
        Path | None, typer.Option("--log", help="the job's Megatron-LM log, for its save-checkpoint timers")
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """The job's goodput ledger: wall time, productive time on the surviving lineage, time lost
    per cause, ETTR, incidents and MTBF; every figure with its source."""
    if ctx.invoked_subcommand is not None:
        return
    with _expected_errors():
        from tasks.goodput.report import ledger, ledger_lines

        found = ledger(load_profile(profile), _since(since), log, _warn)
    if as_json:
        out.print_json(json.dumps(found.to_dict()))
        return
    for line in ledger_lines(found):
        out.print(line, markup=False)


@goodput_app.command("advise")
def goodput_advise(
    save_seconds: Annotated[
        float | None, typer.Option("--save-seconds", help="C [default: measured]")
    ] = None,
    mtbf_hours: Annotated[float | None, typer.Option("--mtbf-hours", help="M [default: measured]")] = None,
    restart_minutes: Annotated[
        float | None, typer.Option("--restart-minutes", help="R [default: measured]")
    ] = None,
    interval_minutes: Annotated[
        float | None, typer.Option("--interval-minutes", help="the current interval [default: the job's]")
    ] = None,
    gpus: Annotated[
        int | None, typer.Option("--gpus", help="[default: recovery.gpus or the world size]")
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Young's and Daly's checkpoint intervals, the expected ETTR now and at the advised interval,
    and the GPU-hours a day the change would save."""
    with _expected_errors():
        from tasks.goodput.report import advice, interval_note, ledger

        prof = load_profile(profile)
        found = advice(
            prof, ledger(prof, warn=_warn), save_seconds, mtbf_hours, restart_minutes, interval_minutes
        )
        if gpus is not None:
            from tasks.goodput.advice import advise

            found = advise(
                found.save_seconds,
                found.mtbf_seconds,
                found.restart_seconds,
                found.interval_seconds,
                gpus,
                found.sources,
            )
    if as_json:
        out.print_json(json.dumps(found.to_dict()))
        return
    for line in found.lines():
        out.print(line, markup=False)
    note = interval_note(found)
    if note:
        out.print(note, markup=False)


@goodput_app.command("simulate")
def goodput_simulate(
    gpus: Annotated[int, typer.Option("--gpus")],
    days: Annotated[float, typer.Option("--days")],
    mtbf_hours: Annotated[float, typer.Option("--mtbf-hours")],
    save_seconds: Annotated[
        float, typer.Option("--save-seconds", help="C: until the checkpoint is persisted")
    ],
    interval_minutes: Annotated[float, typer.Option("--interval-minutes")],
    recover_minutes: Annotated[float, typer.Option("--recover-minutes")],
    blocking_seconds: Annotated[
        float | None,
        typer.Option(
            "--blocking-seconds", help="async saves: the part that holds training [default: all of C]"
        ),
    ] = None,
    runs: Annotated[int, typer.Option("--runs", help="repeated runs for the confidence interval")] = 200,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Simulate the job's wall clock (exponential failures, saves, lost work, recoveries): ETTR
    with a 95% confidence interval, beside the first-order and exact closed forms; what the
    measured recoveries would give; what ETTR >= 97% would take."""
    with _expected_errors():
        from tasks.goodput.advice import ettr, ettr_exact
        from tasks.goodput.simulate import restart_for, save_cost_for, simulate

        m, c, t, r = mtbf_hours * 3600, save_seconds, interval_minutes * 60, recover_minutes * 60
        result = simulate(gpus, days, m, c, t, r, seed, runs, blocking_seconds)
        # With async saves the closed forms see only the blocking part (not the persist lag).
        first, exact = ettr(result.blocking_seconds, m, r, t), ettr_exact(result.blocking_seconds, m, r, t)
        measured = _measured_restart(profile)
        with_measured = (
            simulate(gpus, days, m, c, t, measured[0], seed, runs, blocking_seconds) if measured else None
        )
        need_save, need_restart = save_cost_for(0.97, m, r), restart_for(0.97, m, c)
    data = {
        **result.to_dict(),
        "ettr_first_order": first,
        "ettr_exact": exact,
        "measured_restart_seconds": measured[0] if measured else None,
        "measured_restart_source": measured[1] if measured else "not measured",
        "ettr_with_measured_restart": with_measured.ettr if with_measured else None,
        "save_seconds_for_97": need_save,
        "restart_seconds_for_97": need_restart,
    }
    if as_json:
        out.print_json(json.dumps(data))
        return
    low, high = result.ettr_ci
    out.print(
        f"ETTR {result.ettr:.2%} (95% CI {low:.2%} to {high:.2%}, {runs} runs of {days:g} days, "
        f"{result.failures_per_run:.1f} failures a run); closed forms: first order {first:.2%}, "
        f"exact {exact:.2%}; {result.gpu_hours_lost:,.0f} GPU-hours lost a run at {gpus} GPUs",
        markup=False,
    )
    if with_measured:
        out.print(
            f"with the measured recovery time ({measured[0] / 60:.1f} min, {measured[1]}): ETTR "
            f"{with_measured.ettr:.2%}",
            markup=False,
        )
    out.print(
        "ETTR >= 97% at Daly's interval needs "
        + (
            f"a save cost of at most {need_save:.0f} s at this recovery time"
            if need_save
            else "faster recoveries: no save cost is enough"
        )
        + (
            f", or recoveries within {need_restart / 60:.1f} min at this save cost"
            if need_restart is not None
            else ""
        ),
        markup=False,
    )


def _measured_restart(profile: str | None) -> tuple[float, str] | None:
    """The median measured recovery time of the profile's job, when its ledger has one."""
    from tasks.goodput.report import ledger

    found = ledger(load_profile(profile)).restart_seconds
    return (found.seconds, f"{found.source}") if found.seconds is not None else None


health_app = typer.Typer(no_args_is_help=True, help="Node health: DCGM, GPU basics, nccl-tests.")
app.add_typer(health_app, name="health")


@health_app.command("run")
def health_run(
    profile: ProfileOpt = None,
    nodes: Annotated[
        str | None, typer.Option("--nodes", help="comma-separated node names [default: the profile's]")
    ] = None,
    level: Annotated[
        int | None, typer.Option("--level", min=1, max=4, help="DCGM diag level [default: the profile's]")
    ] = None,
    admit: Annotated[
        bool, typer.Option("--admit", help="run the spare admission set (r3, NCCL, pair test)")
    ] = False,
    as_json: JsonOpt = False,
):
    """Check nodes in parallel; print a verdict per node; drain (or plan drains) as the profile says."""
    with _expected_errors():
        from tasks.health.sweep import sweep

        prof = load_profile(profile)
        if prof.health is None:
            raise UsageError(f"{prof.source}: no health section")
        done = sweep(
            prof.health,
            nodes.split(",") if nodes else None,
            level,
            admit,
            progress=None if as_json else lambda r: err.print(f"  {r.node}: {r.verdict.value}", markup=False),
        )
    if as_json:
        plan = done.plan
        out.print_json(
            json.dumps(
                {
                    "nodes": [r.to_dict() for r in done.run.reports],
                    "drain": plan.drain,
                    "drained": plan.drained,
                    "held": plan.held,
                    "rerun": plan.rerun,
                    "page": plan.page,
                    "spares": done.spares,
                }
            )
        )
    else:
        render.health(out, done)
    raise typer.Exit(done.exit_code)


@health_app.command("classify")
def health_classify(
    tool: Annotated[str, typer.Argument(help="dcgm or nccl")],
    file: Annotated[Path, typer.Argument(help="a saved raw output")],
    exit_code: Annotated[
        int | None, typer.Option("--exit-code", help="the tool's exit code, if known")
    ] = None,
    level: Annotated[
        int | None, typer.Option("--level", help="dcgm: the level it ran at (checks the test set)")
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Classify one saved dcgmi diag or all_reduce_perf output; the verdict word comes first.

    nccl: the busbw gates are the profile's (health.nccl for one node, health.pairs for several,
    told apart by the host names in the output's rank table; a profile without a health section
    has the schema's defaults)."""
    with _expected_errors():
        from tasks.health.dcgm import UnexpectedDocument, classify_diag
        from tasks.health.nccl import Gates, classify_allreduce
        from tasks.profile import Nccl, Pairs

        prof = load_profile(profile)
        nccl, pairs = (prof.health.nccl, prof.health.pairs) if prof.health else (Nccl(), Pairs())
        gates = Gates.from_settings(nccl, pairs)

        if tool not in ("dcgm", "nccl"):
            raise UsageError(f"{tool!r}: classify dcgm or nccl")
        try:
            with open_regular(file) as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_TOOL_OUTPUT:
                    raise UsageError(
                        f"{file}: {size / 2**20:.0f} MiB is more than any dcgmi or all_reduce_perf "
                        f"output (at most {MAX_TOOL_OUTPUT >> 20} MiB are read)"
                    )
                text = f.read(MAX_TOOL_OUTPUT).decode(errors="replace")
        except OSError as e:
            raise UsageError(f"{file}: {e.strerror}") from None
        try:
            verdict = (
                classify_diag(text, exit_code, level, strict=True)
                if tool == "dcgm"
                else classify_allreduce(text, exit_code, gates)
            )
        except UnexpectedDocument as e:
            raise UsageError(f"{file}: not a DCGM diag document: {e}") from None
    if as_json:
        out.print_json(json.dumps(verdict.to_dict()))
    else:
        out.print(f"{verdict.outcome.value} {verdict.detail}", markup=False)
        for item in verdict.evidence[1:]:
            out.print(f"  {item.detail}", markup=False)
    raise typer.Exit(verdict.outcome.exit_code)


def main() -> None:
    # Typer exits 2 on usage errors, like the rest of our input errors.
    sys.exit(app())
