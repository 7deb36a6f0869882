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


@commands.callback(invoke_without_command=True)
def goodput(
    ctx: typer.Context,
    since: Annotated[str | None, typer.Option("--since", help="from this date or time (UTC)")] = None,
    log: Annotated[
        Path | None,
        typer.Option(
            "--log", help="the job's Megatron-LM log: its iteration lines and save-checkpoint timers"
        ),
    ] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """The job's goodput ledger: wall time, productive time on the surviving lineage, time lost
    per cause, ETTR, incidents and MTBF; every figure with its source."""
    if ctx.invoked_subcommand is not None:
        return
    with expected_errors():
        from tasks.goodput.report import ledger, ledger_lines

        found = ledger(load_profile(profile), _since(since), log, warn)
    if as_json:
        out.print_json(json.dumps(found.to_dict()))
        return
    for line in ledger_lines(found):
        out.print(line, markup=False)


# The advice's inputs, for advise and calendar alike (each measured unless given).
SaveSecondsOpt = Annotated[float | None, typer.Option("--save-seconds", help="C [default: measured]")]
MtbfHoursOpt = Annotated[float | None, typer.Option("--mtbf-hours", help="M [default: measured]")]
RestartMinutesOpt = Annotated[float | None, typer.Option("--restart-minutes", help="R [default: measured]")]
IntervalMinutesOpt = Annotated[
    float | None, typer.Option("--interval-minutes", help="the current interval [default: the job's]")
]


@commands.command("advise")
def goodput_advise(
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
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
):
    """Young's and Daly's checkpoint intervals, the expected ETTR now and at the advised interval,
    the GPU-hours a day the change would save, and the storage written a day at each interval."""
    with expected_errors():
        from tasks.goodput.report import advice, interval_note, ledger

        prof = load_profile(profile)
        found = advice(
            prof,
            ledger(prof, warn=warn),
            save_seconds,
            mtbf_hours,
            restart_minutes,
            interval_minutes,
            gpus,
            checkpoint_tb,
        )
    if as_json:
        out.print_json(json.dumps(found.to_dict()))
        return
    for line in found.lines():
        out.print(line, markup=False)
    note = interval_note(found)
    if note:
        out.print(note, markup=False)


@commands.command("simulate")
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
    with expected_errors():
        from tasks.goodput.report import simulation_report

        report = simulation_report(
            profile,
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

        found = calendar(
            load_profile(profile),
            target_tokens,
            log,
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
            warn,
        )
    if as_json:
        out.print_json(json.dumps(found.to_dict()))
        return
    for line in found.lines():
        out.print(line, markup=False)
