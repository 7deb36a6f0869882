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
from tasks.goodput.snapshot import JobSnapshot, read_job
from tasks.profile import load_profile


@flow(name="goodput-report", log_prints=True)
def goodput_report(profile: str = "local", target_tokens: float | None = None):
    job = read_job(load_profile(profile), warn=print)
    found = ledger(job)
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
    create_table_artifact(table=rows, key=f"goodput-{job.name}", description="goodput ledger")
    try:
        advised = advice(job, found)
        lines, note = advised.lines(), interval_note(advised)
    except UsageError as e:  # a value not measured yet (no incident: no MTBF)
        lines, note = [f"no advice yet: {e}"], None
    create_markdown_artifact(
        markdown=markdown(found, lines, note),
        key=f"goodput-advice-{job.name}",
        description="interval advice",
    )
    ettr = f"ETTR {found.ettr:.2%}" if found.ettr is not None else "ETTR not measured"
    message = f"{ettr}, {found.incidents} incidents" + (f"; {note}" if note else "")
    if target_tokens is not None:
        message += "; " + _calendar(job, target_tokens)
    print(message)
    return Completed(message=message)


def _calendar(job: JobSnapshot, target_tokens: float) -> str:
    """Publish the calendar (``goodput-calendar-<job>``); its line for the summary."""
    from tasks.goodput.calendar import calendar
    from tasks.goodput.calendar import markdown as calendar_markdown

    try:
        found = calendar(job, target_tokens)
    except UsageError as e:  # nothing to measure from yet, or the target is reached
        text, line = f"# calendar: {job.name}\n\nno calendar: {e}", f"no calendar: {e}"
    else:
        text, line = calendar_markdown(found), f"projected end {found.projection.end}"
    create_markdown_artifact(
        markdown=text, key=f"goodput-calendar-{job.name}", description="projected end date"
    )
    return line
