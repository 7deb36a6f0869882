"""restore-drill: prove nightly that a checkpoint can really be restored, and how fast.

``source=shared`` restores the promoted checkpoint from the shared store, ``source=archive`` the
newest committed archive entry. Restore, verify, load for real, check what was loaded, compare
the restore window with the budget; the history and trend go to artifacts. With
``continue_steps`` (default the profile's ``drill.continuation.steps``), train on from the copy
and compare with the original run's log: the plot of both goes to an artifact.
"""

from prefect import flow
from prefect.states import Completed, Failed

from tasks.notify import send
from tasks.profile import load_profile
from tasks.restore.flow_tasks import drill_task, publish_drill_report


@flow(name="restore-drill", log_prints=True)
def restore_drill(profile: str = "local", source: str = "shared", continue_steps: int | None = None):
    prof = load_profile(profile)
    report = drill_task(prof, source, continue_steps)
    publish_drill_report(prof, report)
    print(report.line())
    if report.ok:
        return Completed(message=report.line())
    unsent = send(prof, f"restore drill from {source} failed", report.line())
    return Failed(message=report.line() + (f"; {unsent}" if unsent else ""))
