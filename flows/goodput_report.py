"""goodput-report: the job's goodput ledger and checkpoint-interval advice, daily.

Publishes the ledger as a table and the advice with a per-day chart as markdown; says so when
the advised interval differs from the job's --save-interval by more than a quarter. Given the
job's target token count, also the calendar: the projected end date, now and at the advised
interval, with a chart of the projection day by day.
"""

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Completed

from tasks.errors import UsageError
from tasks.goodput.measure import CAUSES
from tasks.goodput.report import advice, interval_note, ledger, markdown
from tasks.profile import load_profile


@flow(name="goodput-report", log_prints=True)
def goodput_report(profile: str = "local", target_tokens: float | None = None):
    prof = load_profile(profile)
    found = ledger(prof, warn=print)
    rows = [
        {
            "figure": name,
            "hours": None if fig.seconds is None else round(fig.seconds / 3600, 4),
            "source": fig.source,
        }
        for name, fig in (("wall", found.wall), ("productive", found.productive))
        + tuple((f"lost: {c}", found.lost[c]) for c in CAUSES)
        + (("MTBF", found.mtbf),)
    ]
    create_table_artifact(table=rows, key=f"goodput-{prof.job.name}", description="goodput ledger")
    try:
        advised = advice(prof, found)
        lines, note = advised.lines(), interval_note(advised)
    except UsageError as e:  # a value not measured yet (no incident: no MTBF)
        lines, note = [f"no advice yet: {e}"], None
    create_markdown_artifact(
        markdown=markdown(found, lines, note),
        key=f"goodput-advice-{prof.job.name}",
        description="interval advice",
    )
    ettr = f"ETTR {found.ettr:.2%}" if found.ettr is not None else "ETTR not measured"
    message = f"{ettr}, {found.incidents} incidents" + (f"; {note}" if note else "")
    if target_tokens is not None:
        message += "; " + _calendar(prof, target_tokens, found)
    print(message)
    return Completed(message=message)


def _calendar(prof, target_tokens: float, measured) -> str:
    """Publish the calendar (``goodput-calendar-<job>``); its line for the summary."""
    from tasks.goodput.calendar import calendar
    from tasks.goodput.calendar import markdown as calendar_markdown

    try:
        found = calendar(prof, target_tokens, measured=measured)
    except UsageError as e:  # nothing to measure from yet, or the target is reached
        text, line = f"# calendar: {prof.job.name}\n\nno calendar: {e}", f"no calendar: {e}"
    else:
        text, line = calendar_markdown(found), f"projected end {found.projection.end}"
    create_markdown_artifact(
        markdown=text, key=f"goodput-calendar-{prof.job.name}", description="projected end date"
    )
    return line
