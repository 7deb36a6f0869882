"""goodput-report: the job's goodput ledger and checkpoint-interval advice, daily.

Publishes the ledger as a table and the advice with a per-day chart as markdown; says so when
the advised interval differs from the job's --save-interval by more than a quarter.
"""

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Completed

from tasks.errors import UsageError
from tasks.goodput.measure import CAUSES
from tasks.goodput.report import advice, interval_note, ledger, markdown
from tasks.profile import load_profile


@flow(name="goodput-report", log_prints=True)
def goodput_report(profile: str = "local"):
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
    print(message)
    return Completed(message=message)
