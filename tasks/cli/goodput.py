"""``ckptops goodput [advise | simulate | calendar]``: the job's effective training time, the
checkpoint interval that would lose least, a simulation of the job's wall clock, and the date the
job reaches its target token count."""

import json
from pathlib import Path
from typing import Annotated

import typer

from tasks.cli.common import JsonOpt, ProfileOpt, expected_errors, out, warn
from tasks.errors import UsageError
from tasks.profile import load_profile

commands = typer.Typer(help="Effective training time and checkpoint-interval advice.")


def _since(value: str | None, option: str = "--since") -> float | None:
    if value is None:
        return None
    from datetime import UTC, datetime

    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise UsageError(f"{option} {value!r}: not a date (YYYY-MM-DD or an ISO time)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _given(ctx: typer.Context, used: tuple[str, ...], **mine):
    """This subcommand's options (``mine``, in order), with those given before it on ``goodput``
    (``goodput -p X advise``): an option the subcommand does not use (not in ``used``), or one
    given twice with two values, is refused, never dropped."""
    group = (ctx.parent.obj if ctx.parent is not None else None) or {}
    values = []
    for name, value in mine.items():
        option = _OPTIONS[name]
        before = group.get(name)
        if before is not None and value is not None and value != before and not isinstance(value, bool):
            raise UsageError(f"goodput {option} {before} and {ctx.info_name} {option} {value}: give it once")
        values.append(before if value in (None, False) and before is not None else value)
    for name, value in group.items():
        if value not in (None, False) and name not in used:
            raise UsageError(f"goodput {_OPTIONS[name]}: not used by 'goodput {ctx.info_name}'")
    return values


_OPTIONS = {"profile": "--profile", "log": "--log", "since": "--since", "as_json": "--json"}


def _emit(prof, found, lines: list[str], as_json: bool, more: dict | None = None) -> None:
    """Every goodput output says whose job it measured and from which profile."""
    if as_json:
        whose = {"job": prof.job.name, "profile": str(prof.source)}
        out.print_json(json.dumps(whose | found.to_dict() | (more or {})))
        return
    for line in [f"job {prof.job.name} (profile {prof.source})", *lines]:
        out.print(line, markup=False)


LogOpt = Annotated[
    Path | None,
    typer.Option("--log", help="the job's Megatron-LM log: its iteration lines and save-checkpoint timers"),
]


@commands.callback(invoke_without_command=True)
def goodput(
    ctx: typer.Context,
    since: Annotated[str | None, typer.Option("--since", help="from this date or time (UTC)")] = None,
    log: LogOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """The job's goodput ledger: wall time, productive time on the surviving lineage, time lost
    per cause, ETTR, incidents and MTBF; every figure with its source."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"profile": profile, "log": log, "since": since, "as_json": as_json}
        return
    with expected_errors():
        from tasks.goodput.report import ledger, ledger_lines
        from tasks.goodput.snapshot import read_job

        prof = load_profile(profile)
        found = ledger(read_job(prof, log, warn), _since(since))
    _emit(prof, found, ledger_lines(found), as_json)


# The advice's inputs, for advise and calendar alike (each measured unless given).
SaveSecondsOpt = Annotated[float | None, typer.Option("--save-seconds", help="C [default: measured]")]
MtbfHoursOpt = Annotated[float | None, typer.Option("--mtbf-hours", help="M [default: measured]")]
RestartMinutesOpt = Annotated[float | None, typer.Option("--restart-minutes", help="R [default: measured]")]
IntervalMinutesOpt = Annotated[
    float | None, typer.Option("--interval-minutes", help="the current interval [default: the job's]")
]


@commands.command("advise")
def goodput_advise(
    ctx: typer.Context,
    save_seconds: SaveSecondsOpt = None,
    mtbf_hours: MtbfHoursOpt = None,
    restart_minutes: RestartMinutesOpt = None,
    interval_minutes: IntervalMinutesOpt = None,
    gpus: Annotated[
        int | None, typer.Option("--gpus", help="[default: recovery.gpus or the world size]")
    ] = None,
    checkpoint_tb: Annotated[
        float | None,
        typer.Option("--checkpoint-tb", help="one checkpoint's size [default: the newest checkpoint's]"),
    ] = None,
    log: LogOpt = None,
    since: Annotated[str | None, typer.Option("--since", help="measure from this date or time (UTC)")] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Young's and Daly's checkpoint intervals, the expected ETTR now and at the advised interval,
    the GPU-hours a day the change would save, and the storage written a day at each interval;
    the job's measured saves (blocking, an async save's background write, on the store), with a
    warning when a background write is slower than the interval."""
    with expected_errors():
        from tasks.goodput.report import advice, interval_note, ledger, measured_saves
        from tasks.goodput.snapshot import read_job

        used = ("profile", "log", "since", "as_json")
        profile, log, since, as_json = _given(
            ctx, used, profile=profile, log=log, since=since, as_json=as_json
        )
        prof = load_profile(profile)
        job = read_job(prof, log, warn)
        found = advice(
            job,
            ledger(job, _since(since)),
            save_seconds,
            mtbf_hours,
            restart_minutes,
            interval_minutes,
            gpus,
            checkpoint_tb,
        )
        saves = measured_saves(job, found.interval_seconds)
    note = interval_note(found)
    lines = [*found.lines(), *(saves.lines() if saves else []), *([note] if note else [])]
    _emit(prof, found, lines, as_json, {"saves": saves.to_dict() if saves else None})


@commands.command("simulate")
def goodput_simulate(
    ctx: typer.Context,
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
    with expected_errors():
        from tasks.goodput.report import simulation_report

        given = {"profile": profile, "as_json": as_json}
        profile, as_json = _given(ctx, tuple(given), **given)
        report = simulation_report(
            lambda: load_profile(profile),
            gpus,
            days,
            mtbf_hours,
            save_seconds,
            interval_minutes,
            recover_minutes,
            blocking_seconds,
            runs,
            seed,
        )
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
        return
    for line in report.lines():
        out.print(line, markup=False)


@commands.command("calendar")
def goodput_calendar(
    ctx: typer.Context,
    target_tokens: Annotated[
        float, typer.Option("--target-tokens", help="the tokens to train on, e.g. 10e12")
    ],
    log: Annotated[
        Path | None, typer.Option("--log", help="the job's Megatron-LM log [default: the step records]")
    ] = None,
    start: Annotated[
        str | None, typer.Option("--start", help="project from this date or time (UTC) [default: now]")
    ] = None,
    tokens_done: Annotated[float | None, typer.Option("--tokens-done", help="[default: measured]")] = None,
    tokens_per_second: Annotated[
        float | None, typer.Option("--tokens-per-second", help="[default: the measured steady state]")
    ] = None,
    ettr: Annotated[float | None, typer.Option("--ettr", help="[default: the ledger's]")] = None,
    save_seconds: SaveSecondsOpt = None,
    mtbf_hours: MtbfHoursOpt = None,
    restart_minutes: RestartMinutesOpt = None,
    interval_minutes: IntervalMinutesOpt = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """When the job reaches --target-tokens: tokens so far, the steady-state tokens/s, ETTR from
    the ledger, the days of compute and the projected end date, now and at the advised
    checkpoint interval; day by day in --json."""
    with expected_errors():
        from tasks.goodput.calendar import calendar
        from tasks.goodput.snapshot import read_job

        profile, log, as_json = _given(
            ctx, ("profile", "log", "as_json"), profile=profile, log=log, as_json=as_json
        )
        prof = load_profile(profile)
        found = calendar(
            read_job(prof, log, warn),
            target_tokens,
            _since(start, "--start"),
            tokens_done,
            tokens_per_second,
            ettr,
            {
                "save": save_seconds,
                "mtbf_hours": mtbf_hours,
                "restart_minutes": restart_minutes,
                "interval_minutes": interval_minutes,
            },
        )
    _emit(prof, found, found.lines(), as_json)
